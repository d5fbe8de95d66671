"""The call path: how one call of a collective goes from ``comm.allreduce(x)`` to the
route that runs it.

    comm.allreduce(x, ...)                  the Communicator: builds nothing, hands on
      run(ctx, ALLREDUCE, x, ...)
        lean_call(...)                      a blocking call on plain arrays, of a kind seen
                                            before: its kept LeanEntry runs it at once
        Call(...); spec.arguments(...)      checks; shape, count, bytes auto sees
        resolve(...)                        the algorithm (auto: auto.Selector)
        route_for(...)                      the first route that takes it (collectives.routes);
                                            resolve's and route_for's answers kept per kind of call
        gate(...)                           numbered; check mode compares the ranks' calls
        spec.agree(...)                     what the ranks settle first (alltoallv's counts)
        route.run(...)                      runs it

Nothing here branches on a collective's name: what differs between collectives is in
their specs (:mod:`collectives.specs`), and what differs between ways of running a
call is in the routes (:mod:`collectives.routes`).
"""

from __future__ import annotations

import math
import pickle
from typing import Any

import numpy as np
from mpi4py import MPI

from . import ops
from .algorithms import ORDERED, PEER_READS, SHARED_MEMORY, check_algorithm, check_ordered
from .auto import cost_model_choice
from .call import Call
from .device import DeviceArray, as_device_array
from .device.array import is_own_array_type
from .dtypes import check_dtype, is_extra
from .errors import TransportError
from .gate import gate, number
from .options import check_root
from .routes import NATIVE_BLOCKING, PEER, ROUTES, SHARED, route_for
from .routes.base import collectives_in_flight, finish_in_flight
from .specs import SPECS

# MPI libraries reduce float16 in scalar software loops: MPICH 5's allreduce of float16
# ran at 0.07 GB/s busbw at 4 ranks here, 4-20x slower than the library's own algorithms
# from 64 KiB on (bench/results/epyc-2vcpu-mpich5/float16-n4.txt). The tuning tables are
# measured in float32, so ``auto`` does not hand float16 reductions of this many bytes
# or more to MPI; below it MPI's lower latency wins.
FLOAT16_NATIVE_UP_TO = 64 << 10

NOT_HANDLED = object()  # lean_call's "take the general path"


def run(ctx: Any, spec: Any, x: Any, out: Any, op: str, root: Any, algorithm: Any, segment_size: Any, timeout: Any,
        blocking: bool, send: Any = None, recv: Any = None) -> Any:
    """Run one call of ``spec``'s collective: its result if ``blocking``, else its
    :class:`~collectives.Handle`. Arguments as the Communicator's methods take them
    (``op`` is ``"-"`` and ``root`` 0 for the collectives without them; ``send`` and
    ``recv``: alltoallv's counts)."""
    if blocking and spec.lean and segment_size is None and type(algorithm) is str:
        if type(x) is np.ndarray:
            if timeout is None:
                result = lean_call(ctx, spec, x, out, op, root, algorithm)
                if result is not NOT_HANDLED:
                    return result
        else:
            own = _DEVICE_OWN.get(type(x))
            if own or (own is None and _device_own(type(x))):
                result = lean_device_call(ctx, spec, x, out, op, root, algorithm, timeout)
                if result is not NOT_HANDLED:
                    return result
    call = Call(spec, x, out, op, root, algorithm, segment_size, timeout, blocking)
    if send is not None or recv is not None:  # alltoallv's counts
        call.send, call.recv = send, recv
    spec.arguments(ctx, call)
    options = ctx.options
    call.timeout = timeout = options.timeout_for(timeout)
    call.alone = alone = options.alone(blocking, timeout)
    algorithm = call.algorithm
    call.auto = algorithm == "auto"
    # The algorithm and the route follow from these alone (the selector and the
    # options they read are the communicator's, fixed): worked out once per kind.
    kind = (spec, algorithm, call.dtype, call.nbytes, call.count, call.device, alone)
    known = ctx.call_kinds.get(kind)
    if known is None:
        call.algorithm = resolve(ctx, spec.name, algorithm, call.nbytes, call.dtype, call.device)
        known = ctx.call_kinds.put(kind, (call.algorithm, route_for(ctx, call),
                                          f"{spec.name}(algorithm={call.algorithm!r}) call #"))
    call.algorithm, route, describe = known
    if options.check:
        gate(ctx, spec.name, timeout, call.algorithm, call.op, call.dtype, call.gate_shape,
             call.root if spec.rooted else -1, blocking, memory=call.where)
    else:
        number(ctx, spec.name)  # the gate without check mode's comparison
    spec.agree(ctx, call)
    call.sequence = sequence = ctx.sequence
    call.describe = f"{describe}{sequence}"
    return route.run(ctx, call)


def lean_call(ctx: Any, spec: Any, x: np.ndarray, out: Any, op: str, root: Any, algorithm: str) -> Any:
    """The lean path of a blocking host call: the result, or ``NOT_HANDLED`` (nothing
    done, no message sent) where the general path must run instead.

    It takes the common case only: ``x`` and ``out`` contiguous NumPy arrays that need
    no packing and do not overlap (or ``out is x``, in place), no timeout, stall
    warning or check mode, no collective of this communicator in flight, and a kind of
    call (algorithm, dtype, size, op, root, in place) seen before. What was learnt then
    is kept (:class:`~collectives.routes.LeanEntry`, made by the route the general path
    would choose: MPI's blocking collective, a shared-memory plan, a persistent program,
    or a plan on the lean executor). What the general path would refuse falls through
    to it, so errors are its own."""
    progress = ctx.progress
    flags = x.flags
    if not ctx.plain or progress.broken is not None or type(op) is not str or not flags.c_contiguous:
        return NOT_HANDLED
    if progress.active and collectives_in_flight(ctx):
        return NOT_HANDLED  # the general path finishes them first
    if type(root) is not int or not 0 <= root < ctx.size:  # False, 0.0: the general path refuses them
        return NOT_HANDLED
    leaf = spec.root_result and root != ctx.rank  # gets no result; out is left alone
    # (result_shape's common case, x's own shape, inline: this is every small call's path)
    shape = spec.result_shape(x.shape, x.size, ctx.size, ctx.rank) if spec.gathers or spec.scatters else x.shape
    if spec.one_buffer:
        if not flags.writeable:
            return NOT_HANDLED
        out = x
    elif out is None:
        if not leaf:
            out = np.empty(shape, x.dtype)
    elif out is x and spec.inplace:  # in place
        if not flags.writeable:  # the general path refuses it
            return NOT_HANDLED
    else:
        if out is x or type(out) is not np.ndarray or out.shape != shape or out.dtype != x.dtype:
            return NOT_HANDLED  # (out is x where the collective has no in-place form: the general path says so)
        out_flags = out.flags
        if not (out_flags.writeable and out_flags.c_contiguous):
            return NOT_HANDLED
        # Arrays that own their memory are distinct; views may overlap (a bounds check).
        if (x.base is not None or out.base is not None) and np.may_share_memory(x, out):
            return NOT_HANDLED
    if leaf:
        out = None
    inplace = out is x
    # The options that shape plans are the communicator's, fixed (shm_slot's setter
    # empties this cache), so the kind of call is the key.
    key = (spec, algorithm, x.dtype, x.nbytes, op, root, inplace)
    entry = ctx.lean_entries.get(key)
    if entry is None:
        entry = ctx.lean_entries.put(key, _lean_entry(ctx, spec, algorithm, x, op, root, inplace) or False)
    if entry is False:
        return NOT_HANDLED
    if entry.route is SHARED:
        entry = SHARED.usable(ctx, entry, x, out, inplace)
        if entry is None:
            return NOT_HANDLED  # the general path makes the window (collective)
    ctx.sequence = (ctx.sequence + 1) % ctx.tag_limit  # as the gate numbers every call
    progress.sequence = ctx.sequence
    if entry.route is NATIVE_BLOCKING:
        try:  # MPI's blocking collective, made once for this kind (nothing in flight to finish first)
            entry.run(x, out)
        except MPI.Exception as exc:
            raise TransportError(f"{spec.name}(algorithm='native'): the MPI library failed: {exc}") from exc
    else:
        inp = x if x.ndim == 1 else x.reshape(-1)
        result = inp if inplace else inp[:0] if out is None else out if out.ndim == 1 else out.reshape(-1)
        entry.run(inp, result)
    if op == "avg" and out is not None:
        ops.finish(op, out, ctx.size)
    return out


_DEVICE_OWN: dict[type, bool] = {}  # a type of x -> whether it is a device's own array type (_device_own)


def _device_own(kind: type) -> bool:
    """:func:`~collectives.device.array.is_own_array_type`, remembered per type. The
    others (a torch tensor, a marked bfloat16 array) are wrapped anew at every call: the
    general path takes those."""
    own = is_own_array_type(kind)
    if len(_DEVICE_OWN) < 64:
        _DEVICE_OWN[kind] = own
    return own


def lean_device_call(ctx: Any, spec: Any, x: Any, out: Any, op: str, root: Any, algorithm: str, timeout: Any) -> Any:
    """The lean path of a blocking call on device arrays: the result, or ``NOT_HANDLED``
    (nothing done, nothing numbered) where the general path must run instead.

    :func:`lean_call`'s rules, for the routes that keep entries for device arrays (the
    peer reads: :class:`~collectives.routes.peer.PeerRead`): ``x`` and ``out``
    contiguous arrays of the device's own type (:func:`_device_own`) that do not
    overlap (or ``out is x``, in place), no stall warning or check mode, no collective
    of this communicator in flight, the device set up by an earlier call, and a kind
    of call seen before. Unlike there, a timeout is taken (the call's, or the
    communicator's): a peer-read call has no messages and no tag, so it runs the same
    with or without one (on the host a call with a timeout goes among the calls in
    flight, on their tags); the lean wait watches the clock as the engine's does, and
    its timeout is the engine's error."""
    progress, options = ctx.progress, ctx.options
    if options.check or options.stall_warn is not None or progress.broken is not None or type(op) is not str:
        return NOT_HANDLED
    if timeout is None:
        timeout = options.timeout
    elif (type(timeout) is not float and type(timeout) is not int) or not 0 < timeout < math.inf:
        return NOT_HANDLED  # the general path checks it (or takes infinity as no limit)
    if progress.active and collectives_in_flight(ctx):
        return NOT_HANDLED  # the general path queues it after them
    if type(root) is not int or not 0 <= root < ctx.size:
        return NOT_HANDLED
    try:
        array = as_device_array(x)
    except TypeError:
        return NOT_HANDLED  # the general path raises it
    if not x.flags.c_contiguous:
        return NOT_HANDLED
    leaf = spec.root_result and root != ctx.rank  # gets no result; out is left alone
    shape = spec.result_shape(x.shape, x.size, ctx.size, ctx.rank) if spec.gathers or spec.scatters else x.shape
    if spec.one_buffer:
        out = x
    elif out is not None and not (out is x and spec.inplace):
        from .transport.device_call import overlaps

        if (type(out) is not type(x) or out.shape != shape or out.dtype != x.dtype or not out.flags.c_contiguous
                or out.device != x.device or overlaps(x, out)):
            return NOT_HANDLED
    if leaf:
        out = None
    inplace = out is x
    backend = array.backend
    key = (backend, spec, algorithm, array.dtype, array.nbytes, op, root, inplace, options.deterministic)
    entry = ctx.lean_entries.get(key)
    if entry is None:
        entry = _lean_entry(ctx, spec, algorithm, array, op, root, inplace)
        if entry is NOT_HANDLED:
            return NOT_HANDLED  # the general path sets the device up (collective); nothing learnt yet
        entry = ctx.lean_entries.put(key, entry or False)
    if entry is False:
        return NOT_HANDLED
    ctx.sequence = (ctx.sequence + 1) % ctx.tag_limit  # as the gate numbers every call
    progress.sequence = ctx.sequence
    return entry.run(array, None if inplace else out, shape, timeout)


def _lean_entry(ctx: Any, spec: Any, algorithm: str, x: Any, op: str, root: int, inplace: bool) -> Any:
    """What the lean path keeps for a kind of call: the entry made by the route the
    general path would take for it, or None where the general path must take it (bad
    arguments, which it reports; a route the lean path does not run). ``x``: a NumPy
    array, or a DeviceArray: ``NOT_HANDLED`` then where the peer reads would take it
    and the general path has yet to set the device up for them (ask again later)."""
    device = isinstance(x, DeviceArray)
    try:
        check_algorithm(spec.name, algorithm)
        check_dtype(x.dtype, "x")
        if op != "-":
            ops.check_op(op, x.dtype)
        check_root(root, ctx.size)
        name = resolve(ctx, spec.name, algorithm, spec.auto_bytes(x.nbytes, ctx.size), x.dtype, device)
    except (TypeError, ValueError):
        return None  # the general path raises it
    call = Call(spec, x, None, op, root, name, None, None, True)
    call.count, call.dtype, call.inplace, call.alone, call.device = x.size, x.dtype, inplace, True, device
    call.auto = algorithm == "auto"
    route = route_for(ctx, call)
    if route is PEER and not PEER.set_up(ctx, x.backend):
        return NOT_HANDLED
    return route.lean_entry(ctx, call) if route.lean else None


# -- the algorithm ------------------------------------------------------------------------
def resolve(ctx: Any, collective: str, algorithm: str, nbytes: int, dtype: Any, device: bool = False) -> str:
    """The algorithm a call runs: the one named (checked against the options and the
    arrays), or what ``auto`` picks for ``nbytes`` (see :func:`explain`)."""
    if algorithm != "auto" and ctx.options.deterministic:
        check_ordered(collective, algorithm)
    if (collective, algorithm) in SHARED_MEMORY:
        _check_shared_memory(ctx, algorithm, device)
    if (collective, algorithm) in PEER_READS:
        _check_peer_reads(ctx, algorithm, device)
    if algorithm == "native" and is_extra(dtype):
        raise ValueError(f"algorithm 'native' cannot move {dtype.name} (the MPI library has no type for it); "
                         "use one of the library's algorithms or 'auto'")
    if algorithm != "auto":
        return algorithm
    chosen = ctx.selector.choose(collective, nbytes, device)
    if (collective, chosen) in SHARED_MEMORY and (device or not ctx.shares_memory):
        if collective in ctx.selector.overrides:  # COLLECTIVES_<COLLECTIVE>_ALGORITHM names it
            _check_shared_memory(ctx, chosen, device)
        chosen = _instead_of_shared(ctx, collective, nbytes)  # a table measured where memory was shared
    if (collective, chosen) in PEER_READS and not (device and ctx.shares_memory):
        if collective in ctx.selector.overrides:
            _check_peer_reads(ctx, chosen, device)
        chosen = _instead_of_shared(ctx, collective, nbytes)
    if chosen == "native":
        instead = _instead_of_native(ctx, collective, nbytes, dtype, device)
        if instead is not None:
            return instead[0]
    return chosen


class Choice(tuple):
    """``(algorithm, why)``, what ``auto`` picks and which rule decided, with ``route``:
    the name of the route a blocking call of that size takes (from ``ROUTES``, as the
    call path picks it)."""

    route: str

    def __new__(cls, algorithm: str, why: str, route: str) -> Choice:
        choice = super().__new__(cls, (algorithm, why))
        choice.route = route
        return choice


def explain(ctx: Any, collective: str, nbytes: int, device: bool = False, dtype: Any = None) -> Choice:
    """What ``auto`` picks for ``collective`` on ``nbytes`` bytes, which rule decided,
    and the route a blocking call of that size takes."""
    check_algorithm(collective, "auto")
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative number of bytes; got {nbytes!r}")
    nbytes = int(nbytes)
    choice, why = ctx.selector.explain(collective, nbytes, bool(device))
    if (collective, choice) in SHARED_MEMORY and (device or not ctx.shares_memory):
        choice = _instead_of_shared(ctx, collective, nbytes)
        why = f"{why}, but shm runs on host arrays of ranks that share memory: so {choice}"
    if (collective, choice) in PEER_READS and not (device and ctx.shares_memory):
        was, choice = choice, _instead_of_shared(ctx, collective, nbytes)
        why = f"{why}, but {was} runs on device arrays of ranks on one node: so {choice}"
    if choice == "native" and dtype is not None:
        instead = _instead_of_native(ctx, collective, nbytes, np.dtype(dtype), bool(device))
        if instead is not None:
            choice, why = instead
    return Choice(choice, why, _route_of(ctx, collective, choice, nbytes, device, dtype).name)


def _route_of(ctx: Any, collective: str, algorithm: str, nbytes: int, device: bool, dtype: Any) -> Any:
    """The route a blocking call of ``nbytes`` with ``algorithm`` takes, with this
    communicator's options (from ``ROUTES``, as the call path picks it)."""
    spec = SPECS[collective]
    dtype = np.dtype("float32" if dtype is None else dtype)
    call = Call(spec, None, None, "sum" if spec.reduces else "-", 0, algorithm, None, None, True)
    call.dtype, call.device = dtype, bool(device)
    call.count = 0 if spec.variable else spec.count_of(nbytes, dtype.itemsize, ctx.size)
    call.alone = ctx.options.alone(True, ctx.options.timeout)
    return next(route for route in ROUTES if route.takes(ctx, call))


def _instead_of_native(ctx: Any, collective: str, nbytes: int, dtype: Any, device: bool) -> tuple[str, str] | None:
    """``(algorithm, why)`` where ``auto`` must not hand ``dtype`` to MPI, else None."""
    if is_extra(dtype):
        return (cost_model_choice(collective, nbytes, ctx.size, own=True, topology=ctx.topology),
                f"the cost model among the library's own algorithms (MPI has no type for {dtype.name})")
    if (dtype == np.float16 and not device and SPECS[collective].reduces and nbytes >= FLOAT16_NATIVE_UP_TO
            and collective not in ctx.selector.overrides):
        return (cost_model_choice(collective, nbytes, ctx.size, own=True, topology=ctx.topology),
                "the cost model among the library's own algorithms (MPI reduces float16 in slow software loops)")
    return None


def _instead_of_shared(ctx: Any, collective: str, nbytes: int) -> str:
    """What ``auto`` picks where its table names ``shm`` but this call cannot run it."""
    if ctx.options.deterministic and collective in ORDERED:
        return ORDERED[collective][0]
    return cost_model_choice(collective, nbytes, ctx.size, topology=ctx.topology)


def _check_peer_reads(ctx: Any, algorithm: str, device: bool) -> None:
    if not device:
        raise ValueError(f"algorithm {algorithm!r} reads the other ranks' device buffers in place (CUDA IPC): it "
                         "runs on device arrays only; on host arrays use 'shm' (on registered buffers, "
                         "Communicator.empty, it reads the others' inputs in place too) or 'auto'")
    if not ctx.shares_memory:
        raise ValueError(f"algorithm {algorithm!r} needs every rank on one node (ranks whose device memory can "
                         f"be opened through CUDA IPC); this communicator spans {ctx.topology.describe()}: "
                         "use 'ring' or 'auto'")


def _check_shared_memory(ctx: Any, algorithm: str, device: bool) -> None:
    if device:
        raise ValueError(f"algorithm {algorithm!r} runs on host arrays only (it reduces in a shared window of "
                         "host memory); for device arrays use another algorithm or 'auto'")
    if not ctx.shares_memory:
        raise ValueError(f"algorithm {algorithm!r} needs every rank on one node (ranks that share memory); "
                         f"this communicator spans {ctx.topology.describe()}: use 'hierarchical' or 'auto'")


# -- the calls beside the collectives -----------------------------------------------------
def barrier(ctx: Any, timeout: Any, device: Any = None) -> None:
    """Block until every rank has called ``barrier`` (collectives in flight go on); with
    ``device``, until every rank's device work queued before it has run too."""
    timeout = ctx.options.timeout_for(timeout)
    backend = None
    if device is not None:
        from .device import as_device_array, is_device
        from .registered import device_backend

        backend = as_device_array(device, "device").backend if is_device(device) else device_backend(device)
    gate(ctx, "barrier", timeout)
    if backend is not None:
        PEER.barrier(ctx, backend, timeout)
        return
    ctx.request("barrier", ctx.comm.Ibarrier, timeout)


def broadcast_object(ctx: Any, obj: Any, root: Any, timeout: Any) -> Any:
    """``obj`` from ``root`` on every rank (pickled; see Communicator.broadcast_object)."""
    root = check_root(root, ctx.size)
    timeout = ctx.options.timeout_for(timeout)
    payload, problem = b"", None
    if ctx.rank == root:
        try:
            payload = pickle.dumps(obj)
        except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it, not wait for data
            problem = exc
    gate(ctx, "broadcast_object", timeout, root=root)
    finish_in_flight(ctx)
    length = np.array([len(payload) if problem is None else -1], np.int64)
    ctx.request("broadcast_object", lambda: ctx.comm.Ibcast(length, root), timeout, length.nbytes)
    if length[0] < 0:  # the same message everywhere; the root's names the cause too
        raise TypeError(f"broadcast_object: the object on rank {root} (the root) cannot be pickled") from problem
    data = np.frombuffer(payload, np.uint8) if ctx.rank == root else np.empty(int(length[0]), np.uint8)
    ctx.request("broadcast_object", lambda: ctx.comm.Ibcast([data, MPI.BYTE], root), timeout, data.nbytes)
    return obj if ctx.rank == root else pickle.loads(data.tobytes())


# -- the calls the calibration times ------------------------------------------------------
def sample(ctx: Any, collective: str, algorithm: str, nbytes: int) -> Any:
    """A function of no arguments that makes one blocking call of ``collective`` with
    ``algorithm`` on ``ctx`` (every rank alike: the calibration times it), on float32
    arrays made here, ``nbytes`` counted as the tuning tables count them (allgather:
    the gathered size), rounded down to whole elements for every rank (one each at
    least): a sum where the collective reduces, rank 0 the root where it has one."""
    spec, p = SPECS[collective], ctx.size
    count = max(1, nbytes // 4 // p) * p
    x = np.ones(count // p if spec.gathers else count, np.float32)
    op = "sum" if spec.reduces else "-"
    if spec.one_buffer:
        out = None
    else:  # written now (np.ones, not np.empty): a first write to fresh memory costs a page fault per page
        out = np.ones((p, count // p) if spec.gathers else count // p if spec.scatters else count, np.float32)
    return lambda: run(ctx, spec, x, out, op, 0, algorithm, None, None, True)
