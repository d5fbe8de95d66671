"""The shared-memory algorithms (``shm``) on host arrays of ranks that share memory:
their plans run on the node's window (:mod:`collectives.transport.shm`), or read every
rank's input in place where the inputs are registered buffers
(:mod:`collectives.registered`)."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
from mpi4py import MPI

from ..algorithms import SHARED_MEMORY
from ..algorithms.shm import REGISTERED
from ..call import host_buffers
from ..schedule import Fence, Schedule, compile_plan
from ..transport.shm import NodeWindow, ShmCall, ShmHandle
from . import base
from .base import LeanEntry, Route, breaking_on_failure, finish_in_flight, look

# A fence and nothing else, on the window: what the ranks pass before it grows (window_for).
_GROW_PLAN = compile_plan(Schedule([Fence()], shm=1))


def _nothing() -> None:
    return None


def call_code(spec: Any, algorithm: str, dtype: Any, op: str, slot: int, registered: Any = None) -> int:
    """A number naming a call's kind (collective, algorithm, dtype, op, and the slot
    size, which sets its segments and fences; for registered buffers, which
    registration and where in it): ranks compare it in shared memory before they read
    each other's data (``transport.shm``)."""
    op = op if spec.reduces else "-"  # as every path names it
    return zlib.crc32(f"{spec.name}/{algorithm}/{dtype.name}/{dtype.itemsize}/{op}/{slot}/{registered}".encode())


def needs_window(plan: Any) -> bool:
    """Whether a shared-memory plan uses the node's window: its data area, or its flags
    for fences (registered plans have fences and no data); kept beside the plan."""
    needs = plan.__dict__.get("_needs_window")
    if needs is None:
        needs = bool(plan.shm) or any(type(op) is Fence for op in plan.ops)
        object.__setattr__(plan, "_needs_window", needs)  # the plan is frozen; a cache beside it
    return needs


def registered(ctx: Any, spec: Any, inp: Any, inplace: bool) -> Any:
    """``(registration, (stride, offset))`` in elements where ``inp`` lies in one of
    this rank's registered arrays and the call has a registered form (allreduce: only
    in place), else None."""
    if not ctx.registrations or spec.name not in REGISTERED or (spec.inplace and not inplace):
        return None
    itemsize = inp.itemsize
    for registration in ctx.registrations:
        offset = registration.offset_of(inp)
        if offset is not None:
            if offset % itemsize:
                return None
            return registration, (registration.stride // itemsize, offset // itemsize)
    return None


def shm_plan(ctx: Any, spec: Any, algorithm: str, count: int, root: int, inplace: bool, dtype: Any, op: str,
             found: Any = None) -> tuple[Any, Any, int]:
    """``(registration, plan, call code)`` of a shared-memory call; ``found``: what
    :func:`registered` says of its input (None: a plain one)."""
    registration, where = found if found is not None else (None, None)
    slot = ctx.options.shm_slot
    plan = base.compiled_plan(spec.name, algorithm, ctx.rank, ctx.size, count, root, max(1, slot // dtype.itemsize),
                              inplace, ctx.options.deterministic, registered=where)
    which = None if registration is None or where is None else (registration.number, where[1])  # where it lies
    code = call_code(spec, algorithm, dtype, op, slot, which)
    return registration, plan, code


def window_for(ctx: Any, nbytes: int, timeout: float | None, signature: tuple, describe: str) -> Any:
    """The node's shared window, holding ``nbytes`` of data (made or grown here:
    collective; the ranks agree on the size first, within ``timeout``). Before it
    grows, the ranks pass a fence signed with the call's ``signature``: a rank whose
    call differs (in size, say, and fits the window as it is) meets it at its own
    first fence, and both raise there instead of waiting for each other."""
    window = ctx.window
    if window is not None and nbytes <= window.capacity:
        return window
    finish_in_flight(ctx)  # nothing may use the old window, nor wait on this rank meanwhile
    if window is None:  # the first call on it: nothing to sign yet, only the size to agree on
        window = ctx.window = NodeWindow(ctx.node_comm)
    else:
        nothing = np.empty(0, np.uint8)
        grow = ShmCall(window, _GROW_PLAN, nothing, nothing, nothing, "-", signature, describe)
        ShmHandle(ctx.progress, describe, _nothing, grow, timeout, ctx.sequence).start().wait()
    need = np.array([nbytes], np.int64)
    ctx.request("the shared window's set-up", lambda: ctx.node_comm.Iallreduce(MPI.IN_PLACE, need, MPI.MAX), timeout,
                need.nbytes)
    window.ensure(int(need[0]))
    return window


class SharedMemory(Route):
    """A shared-memory algorithm's call, in the progress engine's queue of them (or, on
    the lean path, run to its end at once)."""

    name, lean = "shared memory", True

    def takes(self, ctx, call):
        return (call.spec.name, call.algorithm) in SHARED_MEMORY

    def run(self, ctx, call):
        host_buffers(call, ctx.rank, ctx.size)
        spec, inp, out, inplace, op, root = call.spec, call.inp, call.result, call.inplace, call.op, call.root
        # Where auto chose shm, a registered input copies in as any other does: whether
        # an input is registered is one rank's business, and auto's choice must run
        # alike on every rank (the two forms' calls differ, and would refuse each other).
        found = None if call.auto else registered(ctx, spec, inp, inplace)
        registration, plan, code = shm_plan(ctx, spec, call.algorithm, call.count, root, inplace, inp.dtype, op, found)
        signature = (ctx.sequence, code, inp.nbytes, root)
        describe = call.describe
        window = (window_for(ctx, plan.shm * inp.itemsize, call.timeout, signature, describe)
                  if needs_window(plan) else None)
        raw, tmp = ctx.workspace.take(plan.tmp, inp.dtype)
        finish = call.finish

        def done():
            ctx.workspace.give(raw)
            return finish()

        shm_call = ShmCall(window, plan, inp, out, tmp, op, signature, describe, registration)
        handle = ShmHandle(ctx.progress, describe, done, shm_call, call.timeout, ctx.sequence).start()
        return handle.wait() if call.blocking else handle

    def lean_entry(self, ctx, call):
        entry = LeanEntry(self, call.spec, call.algorithm, call.count, call.op, call.root)
        _, entry.plan, entry.code = shm_plan(ctx, call.spec, call.algorithm, call.count, call.root, call.inplace,
                                             call.dtype, call.op)
        entry.window_bytes = entry.plan.shm * call.dtype.itemsize if needs_window(entry.plan) else None
        entry.registered_form = not call.auto  # as run() says
        entry.run = lambda x, result: self.run_now(ctx, entry, x, result)
        return entry

    def usable(self, ctx, entry, x, result, inplace):
        """The entry a lean call on ``x`` runs: ``entry``, or its registered form where
        ``x`` is a registered buffer; None where the window must first be made or grown
        (collective: the general path does that)."""
        if ctx.registrations and entry.registered_form:  # the input may be a registered buffer: its own plan then
            found = registered(ctx, entry.spec, x, inplace)
            if found is not None:
                entry = self._registered_entry(ctx, entry, x, inplace, found)
        if entry.window_bytes is not None and (ctx.window is None or entry.window_bytes > ctx.window.capacity):
            return None
        return entry

    def _registered_entry(self, ctx, entry, x, inplace, found):
        """The registered form of ``entry`` (kept per kind of call, registration and offset)."""
        options = ctx.options
        key = (entry.spec.name, entry.algorithm, x.dtype, entry.count, entry.root, inplace, entry.op,
               options.shm_slot, options.deterministic, found[0].number, found[1])
        made = ctx.registered_entries.get(key)
        if made is None:
            made = LeanEntry(self, entry.spec, entry.algorithm, entry.count, entry.op, entry.root)
            made.registration, made.plan, made.code = shm_plan(ctx, entry.spec, entry.algorithm, entry.count,
                                                                entry.root, inplace, x.dtype, entry.op, found)
            made.window_bytes = made.plan.shm * x.dtype.itemsize if needs_window(made.plan) else None
            made.run = lambda x, result: self.run_now(ctx, made, x, result)
            ctx.registered_entries.put(key, made)
        return made

    def run_now(self, ctx, entry, x, result):
        """A blocking shared-memory call on the lean path, run to its end here; on any
        failure the engine breaks as on the general path."""
        plan = entry.plan
        raw, tmp = ctx.workspace.take(plan.tmp, x.dtype)
        describe = f"{entry.spec.name}(algorithm={entry.algorithm!r}) call #{ctx.sequence}"
        shm_call = ShmCall(ctx.window, plan, x, result, tmp, entry.op, (ctx.sequence, entry.code, x.nbytes, entry.root),
                           describe, entry.registration)
        breaking_on_failure(ctx, lambda: shm_call.run(lambda: look(ctx, describe)), lambda: describe)
        ctx.workspace.give(raw)


SHARED = SharedMemory()
