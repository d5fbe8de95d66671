"""The library's own message-based algorithms on host arrays: their compiled plans,
run over MPI point-to-point messages.

A call that runs alone (blocking, no timeout or stall warning) first finishes this
rank's calls in flight, and its messages carry one tag kept for such calls. Every rank
does so for the same calls, whichever executor each one takes, so their messages meet;
a size mismatch across the persistent programs' threshold is then still a size error,
not a wait on two tags. A small one runs on a persistent program
(:class:`~collectives.transport.lean.PersistentProgram`, route ``persistent``); a
larger one on the lean executor where its plan is small enough, else on the progress
engine (route ``plan engine``), as every call that does not run alone does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..call import host_buffers
from ..transport import lean
from ..transport.buffers import Buffers
from ..transport.mpi import PlanHandle
from .base import LeanEntry, Route, break_on, finish_in_flight, look, plan_for


def _plan(ctx: Any, call: Any) -> Any:
    return plan_for(ctx, call.spec.name, call.algorithm, call.count, call.root, call.dtype.itemsize, call.inplace,
                    call.segment_size, call.counts if call.spec.variable else None)


def run_persistent(ctx: Any, plan: Any, inp: np.ndarray, result: np.ndarray, inplace: bool, op: str, describe: Any,
                   entry: LeanEntry | None = None) -> None:
    """Run a small blocking call's ``plan`` on its persistent program (made at its first
    call, kept): ``inp`` copied in, ``result`` copied out. On a failure the engine
    breaks, as on the general path. ``entry``: the lean path's entry for the call's
    kind, which keeps the program (the call then skips the lookup)."""
    try:
        program = entry.program if entry is not None else None
        if program is None or program.requests is None:
            key = (id(plan), inp.dtype, inp.size, result.size)
            program = ctx.persistent.get(key)
            if program is None:
                program = ctx.persistent.put(key, lean.PersistentProgram(plan, ctx.comm, ctx.blocking_tag, inp.dtype,
                                                                         inp.size, result.size, inplace))
            if entry is not None:
                entry.program = program
        if inp.size:
            program.inp[...] = inp  # (not np.copyto, a Python wrapper: the small calls' path)
        program.run(op, describe, lambda: look(ctx, describe()))
        if result.size:
            result[...] = program.out
    except BaseException as exc:  # (no closure for breaking_on_failure: this is the small calls' hot path)
        break_on(ctx, exc, describe)
        raise


def run_lean(ctx: Any, program: Any, buffers: Buffers, op: str, describe: Any) -> None:
    """Run a blocking call's plan on the lean executor (``describe()`` names the call),
    its messages on the tag of calls that run alone. If it fails, its requests are given
    up and the engine breaks as on the general path, telling the other ranks of a
    message-size or MPI error; an interrupt (KeyboardInterrupt) breaks it too, since the
    ranks no longer agree on which message belongs to which call."""
    try:  # (not breaking_on_failure's closure: the lean path's calls come here)
        lean.run(program, ctx.comm, ctx.blocking_tag, buffers, op, describe, ctx.progress.abandon,
                 lambda: look(ctx, describe()))
    except BaseException as exc:
        break_on(ctx, exc, describe)
        raise


class Persistent(Route):
    """Small blocking calls that run alone: a persistent program (no request made per
    message), up to ``lean.PERSISTENT_BYTES`` per message of the rank's plan
    (:func:`~collectives.transport.lean.persistent_limit`) where the plan is small
    enough for the lean executor. The ranks of a rooted collective may decide apart
    (their plans differ): their messages meet all the same, on the tag both executors
    use (see the module's docstring)."""

    name, lean = "persistent", True

    def takes(self, ctx, call):
        if not call.alone or call.spec.variable:
            return False
        nbytes = call.count * call.dtype.itemsize
        if nbytes <= lean.PERSISTENT_BYTES:
            return True
        # The program keeps buffers of the input's and the result's size (a gather's is
        # the ranks' inputs together): the larger of the two is held to the limit.
        held = max(nbytes, call.spec.result_count(call.count, ctx.size, ctx.rank, call.root) * call.dtype.itemsize)
        if held > lean.PERSISTENT_MOST:
            return False  # (before a plan is made: a large call's may be long to make)
        # (its messages are the same in place or not)
        program = lean.program(plan_for(ctx, call.spec.name, call.algorithm, call.count, call.root,
                                        call.dtype.itemsize, False, call.segment_size))
        return program is not None and held <= lean.persistent_limit(program)

    def run(self, ctx, call):
        host_buffers(call, ctx.rank, ctx.size)
        finish_in_flight(ctx)
        describe = call.describe
        run_persistent(ctx, _plan(ctx, call), call.inp, call.result, call.inplace, call.op, lambda: describe)
        return call.finish()

    def lean_entry(self, ctx, call):
        entry = LeanEntry(self, call.spec, call.algorithm, call.count, call.op, call.root)
        entry.plan = _plan(ctx, call)
        name, op, inplace = call.spec.name, call.op, call.inplace

        def run(x, result):  # nothing in flight to finish first (the lean path checked)
            sequence = ctx.sequence
            run_persistent(ctx, entry.plan, x, result, inplace, op,
                           lambda: f"{name}(algorithm={entry.algorithm!r}) call #{sequence}", entry)

        entry.run = run
        return entry


class Plans(Route):
    """The library's message-based algorithms: a call that runs alone on the lean
    executor where its plan is small enough (``lean.MAX_OPS``), else on the progress
    engine with every other call in flight."""

    name, lean = "plan engine", True

    def takes(self, ctx, call):
        return True

    def run(self, ctx, call):
        host_buffers(call, ctx.rank, ctx.size)
        plan = _plan(ctx, call)
        tag = ctx.tags.call(ctx.sequence)
        if call.alone:
            finish_in_flight(ctx)
            tag = ctx.blocking_tag
        raw, tmp = ctx.workspace.take(plan.tmp, call.result.dtype)
        buffers = Buffers(call.inp, call.result, tmp)
        describe = call.describe
        if call.alone:
            program = lean.program(plan)
            if program is not None:  # nothing else to serve while it runs: the lean executor
                run_lean(ctx, program, buffers, call.op, lambda: describe)
                ctx.workspace.give(raw)
                return call.finish()
        finish = call.finish

        def done():
            ctx.workspace.give(raw)
            return finish()

        handle = PlanHandle(ctx.progress, describe, done, ctx.comm, tag, plan, buffers, call.op, call.timeout,
                            ctx.sequence).start()
        return handle.wait() if call.blocking else handle

    def lean_entry(self, ctx, call):
        plan = _plan(ctx, call)
        program = lean.program(plan)
        if program is None:
            return None  # too large for the lean executor: the general path
        entry = LeanEntry(self, call.spec, call.algorithm, call.count, call.op, call.root)
        entry.plan, entry.program = plan, program
        name, op = call.spec.name, call.op

        def run(x, result):
            sequence = ctx.sequence
            raw, tmp = ctx.workspace.take(plan.tmp, x.dtype)
            run_lean(ctx, program, Buffers(x, result, tmp), op,
                     lambda: f"{name}(algorithm={entry.algorithm!r}) call #{sequence}")
            ctx.workspace.give(raw)

        entry.run = run
        return entry


PERSISTENT = Persistent()
PLANS = Plans()
