"""What every route is, and what the routes share: finishing the calls in flight,
breaking the engine when a call outside it fails, and compiling plans."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from ..algorithms import SEGMENTED, TOPOLOGICAL, build
from ..errors import CollectiveError
from ..schedule import compile_plan, fuse_reductions, split_schedule
from ..transport import p2p


class Route:
    """One way a call can run. :meth:`takes` says whether a call (checked, numbered,
    its algorithm resolved) runs here; :meth:`run` runs it and returns its result, or,
    for a call that is not ``blocking``, its :class:`~collectives.Handle`. A route
    that can also run the lean path's blocking calls (``lean = True``) makes, for a
    kind of call, the :class:`LeanEntry` the call path keeps (:meth:`lean_entry`)."""

    name = ""
    lean = False

    def takes(self, ctx: Any, call: Any) -> bool:
        raise NotImplementedError

    def run(self, ctx: Any, call: Any) -> Any:
        raise NotImplementedError

    def lean_entry(self, ctx: Any, call: Any) -> LeanEntry | None:
        """What the lean path keeps for blocking calls of ``call``'s kind (its arrays
        plain and contiguous: NumPy's, no timeout; or a device's own, see
        ``calls.lean_device_call``), or None where it cannot take them."""
        return None

    def __repr__(self) -> str:
        return f"<route {self.name}>"


class LeanEntry:
    """What the lean path keeps for one kind of blocking call (collective, algorithm as
    asked, dtype, size, op, root, in place and the options that shape plans): the
    route, the algorithm ``auto`` resolved to, and ``run(x, result)``, which runs such
    a call on flat contiguous ``x`` and ``result``. The route keeps what else it
    needs here (a plan, a program, MPI's bound collective)."""

    __slots__ = ("algorithm", "code", "count", "op", "plan", "program", "registered_form", "registration", "root",
                 "route", "run", "spec", "window_bytes")

    def __init__(self, route: Route, spec: Any, algorithm: str, count: int, op: str, root: int):
        self.route, self.spec, self.algorithm = route, spec, algorithm
        self.count, self.op, self.root = count, op, root
        self.run: Any = None
        self.plan: Any = None
        self.program: Any = None  # a PersistentProgram or the plan's lean Program
        self.code = 0  # a shared-memory call's code (see routes.shared)
        self.registration: Any = None
        self.registered_form = True  # shm: a registered input takes its registered form (not where auto chose shm)
        self.window_bytes: int | None = None  # the shared window a shared-memory call needs (None: none)


@lru_cache(maxsize=512)
def compiled_plan(collective: str, algorithm: str, rank: int, size: int, count: int, root: int, segment: int,
                  inplace: bool, ordered: bool, device_split: int | None = None, counts: Any = None,
                  topology: Any = None, registered: Any = None) -> Any:
    """The compiled plan of one rank (``ordered``: reductions in rank order; ``counts``:
    the per-peer ``(send, recv)`` element counts of alltoallv; ``topology``: the node
    layout, for the two-level algorithms only, so the others share plans). For device
    buffers (``device_split`` not None) its chains of reductions are fused into
    multi-input kernels and it is cut into segments of ``device_split`` elements (0:
    not cut). ``registered``: ``(stride, offset)`` of registered inputs (``shm``)."""
    schedule = build(collective, algorithm, rank, size, count, root=root, segment=segment, ordered=ordered,
                     counts=counts, topology=topology, registered=registered, inplace=inplace)
    if device_split is not None:
        schedule = fuse_reductions(schedule, inplace=inplace)
        if device_split:
            schedule = split_schedule(schedule, device_split)
    return compile_plan(schedule, inplace=inplace)


def plan_for(ctx: Any, name: str, algorithm: str, count: int, root: int, itemsize: int, inplace: bool,
             segment_size: int | None = None, counts: Any = None, device_split: int | None = None) -> Any:
    """The compiled plan of a call of ``name`` with one of the library's message-based
    algorithms, on this communicator (its segment size, layout, deterministic mode)."""
    segment = ctx.options.segment(segment_size, itemsize) if (name, algorithm) in SEGMENTED else 1
    return compiled_plan(name, algorithm, ctx.rank, ctx.size, count, root, segment, inplace,
                         ctx.options.deterministic, device_split, counts,
                         ctx.topology if (name, algorithm) in TOPOLOGICAL else None)


def collectives_in_flight(ctx: Any) -> list[Any]:
    """This rank's calls in flight other than sends and receives."""
    return [h for h in ctx.progress.active if not isinstance(h, p2p.PointHandle)]


def finish_in_flight(ctx: Any, sends_and_receives: bool = False) -> None:
    """Finish this rank's collectives in flight: before a blocking MPI call, during
    which this rank's Python cannot progress them, or a call that runs alone. Every
    rank started them before this call, so every rank can finish them. Sends and
    receives (``send_async``/``recv_async``) stay in flight unless
    ``sends_and_receives`` (``free()``): they travel on a communicator of their own,
    each is one MPI request that MPI progresses by itself, and the message a pending
    receive waits for may be sent only after this call."""
    while True:
        waiting = collectives_in_flight(ctx) if not sends_and_receives else ctx.progress.active
        if not waiting:
            return
        waiting[0].wait()  # waited for up to its own timeout; the engine advances the others meanwhile


class _OutsideCall:
    """A call run outside the engine (the lean path), as the engine's failure handling
    names it (``outstanding()``: what it waits for, for a timeout's message)."""

    __slots__ = ("_describe", "_error", "_outstanding", "_sequence")

    def __init__(self, describe: str, sequence: int, outstanding: Any = None):
        self._describe, self._sequence, self._error, self._outstanding = describe, sequence, None, outstanding


def look(ctx: Any, describe: str) -> None:
    """What the engine does every 20 ms of waiting, for a call run outside it: read
    other ranks' failure notices (and raise if one came) and answer liveness probes."""
    ctx.progress.look_around(_OutsideCall(describe, ctx.sequence))


def time_out(ctx: Any, describe: str, outstanding: Any, waited: float) -> None:
    """Raise the engine's timeout error for a call run outside it (the lean path of the
    peer reads), ``waited`` seconds in: the same message (what ``outstanding()`` says it
    waits for, the ranks' liveness), and the engine breaks as it would have."""
    ctx.progress.time_out(_OutsideCall(describe, ctx.sequence, outstanding), waited)


def breaking_on_failure(ctx: Any, run: Any, describe: Any) -> None:
    """``run()`` a call outside the engine (the lean path); if anything escapes it, an
    interrupt too, the engine breaks as it would have (``describe()`` names the call)."""
    try:
        run()
    except BaseException as exc:
        break_on(ctx, exc, describe)
        raise


def break_on(ctx: Any, exc: BaseException, describe: Any) -> None:
    """Break the engine on ``exc``, escaped from a call run outside it, as it would have
    broken (``describe()`` names the call); the caller raises it on."""
    if ctx.progress.broken is None:
        ctx.progress.fail(exc if isinstance(exc, Exception) else CollectiveError(
            f"{describe()} was interrupted ({type(exc).__name__})"))
