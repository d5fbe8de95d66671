"""The MPI library's own collectives (``algorithm="native"``) on host arrays.

Blocking calls that run alone (no timeout or stall warning) call MPI's blocking
collective, straight on the caller's arrays where they are contiguous: the cheapest
path for tiny buffers, which ``auto`` sends here. The others call MPI's non-blocking
collective, driven by the progress engine (so they can time out and warn). A blocking
and a non-blocking collective never match each other in MPI, so every rank must take
the same one: the choice depends only on the options every rank shares (check mode
compares it). Where the MPI library does not stop by itself on a collective called
with different sizes (``mpi_library.native_checked``), the ranks first agree on the
size (:mod:`collectives.transport.native`): one small allreduce, so that a mismatch is
a clear error on every rank rather than memory written past a buffer. MPI's blocking
broadcast (calls that run alone) sends the root's size ahead instead, with its data
where it fits (``RootSizeFirst``): the ranks whose buffers differ from the root's raise
(:func:`checked`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .. import ops
from ..arrays import overlaps
from ..call import host_buffers
from ..errors import TransportError
from ..transport import native as agreement
from ..transport.mpi import RequestHandle
from .base import LeanEntry, Route, finish_in_flight

NOT_HANDLED = object()


def starter(ctx: Any, spec: Any, op: str, root: int, counts: Any, blocking: bool, comm: Any = None) -> Any:
    """MPI's collective for ``spec`` as ``(send, receive) -> request`` (blocking: MPI's
    blocking call, returning nothing), on ``comm`` (default: the communicator's own):
    made once per kind of call and kept, except where per-call counts are bound into
    it."""
    comm = ctx.comm if comm is None else comm
    if counts is not None:
        return spec.native(comm, op, root, counts, blocking)
    key = (spec.name, op, root, blocking, comm is ctx.comm)
    start = ctx.native_starters.get(key)
    if start is None:
        start = ctx.native_starters.put(key, spec.native(comm, op, root, None, blocking))
    return start


def native(ctx: Any, spec: Any, inp: Any, out: Any, inplace: bool, op: str, root: int, counts: Any,
           blocking: bool = False, comm: Any = None) -> Any:
    """Start MPI's own non-blocking collective (return its request), or with
    ``blocking`` run the blocking one, on ``comm`` (default: the communicator's own;
    the size-agreed non-blocking ones go on ``transport.native.Deferred``'s). Arrays go
    to mpi4py as they are: it maps the dtype to MPI's predefined type."""
    if out is not None and out.size == 0 and not inplace:
        # An empty result (a reduce_scatter block of 0 elements) may sit at x's own
        # address: NumPy says they share nothing, MPI refuses the alias all the same.
        out = np.empty(0, out.dtype)
    start = starter(ctx, spec, op, root, counts, blocking, comm)
    # The starter reads one buffer for both as MPI_IN_PLACE; a one-buffer collective's is out.
    send = out if spec.one_buffer or (inplace and spec.inplace) else inp
    return start(send, out)


def checked(ctx: Any, spec: Any, run: Any, nbytes: int, dtype: Any, root: int) -> Any:
    """``run(send, receive)`` (MPI's blocking collective) told of a size mismatch where
    the MPI library would not stop on one by itself (``ctx.native_checked``): the root's
    size sent ahead where the collective goes one way from it (``spec.root_size_first``),
    else the ranks' agreement on ``nbytes`` first (:mod:`collectives.transport.native`);
    ``run`` itself elsewhere."""
    if spec.name not in ctx.native_checked:
        return run

    def describe():
        return f"{spec.name}(algorithm='native') call #{ctx.sequence}"

    if spec.root_size_first:
        return agreement.RootSizeFirst(ctx.comm, nbytes, dtype, root, describe)
    return agreement.agreeing(ctx.comm, run, nbytes, describe, ctx.broken_by)


def native_blocking(ctx: Any, spec: Any, inp: Any, out: Any, inplace: bool, op: str, root: int, counts: Any) -> None:
    """MPI's blocking collective, checked (:func:`checked`), after this rank's calls in
    flight have finished.

    Our own calls in flight need this rank's Python to progress them, which a rank
    blocked inside MPI cannot do, so they are finished first; every rank started them
    before this call, so every rank can finish them."""
    finish_in_flight(ctx)
    try:
        run = checked(ctx, spec, lambda *_: native(ctx, spec, inp, out, inplace, op, root, counts, blocking=True),
                      agreement.unit(spec, inp, out), inp.dtype, root)
        run(inp, out)  # (a broadcast's inp is its out: one buffer)
    except MPI.Exception as exc:
        raise TransportError(f"{spec.name}(algorithm='native'): the MPI library failed: {exc}") from exc


def callers_arrays(ctx: Any, call: Any) -> tuple[Any, Any, bool] | None:
    """``(x, out, inplace)``: the caller's own arrays, which MPI's collective takes as
    they are (``out`` made where the caller gave none; None where this rank gets no
    result), or None where they need packing (not contiguous) or ``out`` overlaps
    ``x`` without being it: MPI would read what it has written."""
    spec, out, rank = call.spec, call.out, ctx.rank
    x = call.x
    if spec.root_input and rank != call.root:
        x = np.empty(0, call.where.dtype)  # the other ranks' x is not read
    if not x.flags.c_contiguous:
        return None
    leaf = spec.root_result and rank != call.root  # gets no result; out is left alone
    inplace = out is x and spec.inplace and not leaf
    if spec.one_buffer:
        out = x
    elif leaf:
        out = None
    elif out is None:
        out = np.empty(call.shape, x.dtype)
    elif not inplace and (not out.flags.c_contiguous or overlaps(x, out)):
        return None
    return x, out, inplace


class NativeBlocking(Route):
    """MPI's blocking collective, for blocking calls that run alone."""

    name, lean = "native blocking", True

    def takes(self, ctx, call):
        return call.algorithm == "native" and call.alone

    def run(self, ctx, call):
        direct = callers_arrays(ctx, call)
        if direct is None:  # packed into contiguous buffers first
            host_buffers(call, ctx.rank, ctx.size)
            native_blocking(ctx, call.spec, call.inp, call.result, call.inplace, call.op, call.root, call.counts)
            return call.finish()
        x, out, inplace = direct
        native_blocking(ctx, call.spec, x, out, inplace, call.op, call.root, call.counts)
        if out is not None:
            ops.finish(call.op, out, ctx.size)
        return out

    def lean_entry(self, ctx, call):
        spec, op, root = call.spec, call.op, call.root
        entry = LeanEntry(self, spec, call.algorithm, call.count, op, root)
        counts = None  # every rank's block where the collective scatters, for MPI
        if spec.scatters:
            counts = [spec.result_count(call.count, ctx.size, r, root) for r in range(ctx.size)]
        if call.count == 0:  # native() gives an empty out an address of its own (MPI refuses the alias)
            entry.run = lambda x, out: native(ctx, spec, x, out, out is x, op, root, counts, blocking=True)
        else:
            entry.run = starter(ctx, spec, op, root, counts, True)  # nothing in flight to finish first
        entry.run = checked(ctx, spec, entry.run, call.count * call.dtype.itemsize, call.dtype, root)
        return entry


class Native(Route):
    """MPI's non-blocking collective, driven by the progress engine."""

    name = "native non-blocking"

    def takes(self, ctx, call):
        return call.algorithm == "native"

    def run(self, ctx, call):
        spec, op, root, counts = call.spec, call.op, call.root, call.counts
        direct = callers_arrays(ctx, call)
        if direct is None:  # packed into contiguous buffers first, unpacked at the end
            host_buffers(call, ctx.rank, ctx.size)
            inp, out, inplace = call.inp, call.result, call.inplace
        else:
            inp, out, inplace = direct
            call.finish = _finisher(op, out, ctx.size)
        if spec.name in ctx.native_checked:  # the ranks agree on the size first, then MPI's collective is posted
            handle = agreement.AgreedHandle(
                ctx.progress, call.describe, call.finish, ctx.comm, ctx.deferred, agreement.unit(spec, inp, out),
                lambda comm: native(ctx, spec, inp, out, inplace, op, root, counts, comm=comm), call.timeout,
                call.sequence, inp.nbytes)
        else:
            handle = RequestHandle(ctx.progress, call.describe, call.finish,
                                   lambda: native(ctx, spec, inp, out, inplace, op, root, counts), call.timeout,
                                   call.sequence, inp.nbytes)
        handle.start()
        return handle.wait() if call.blocking else handle


def _finisher(op: str, out: Any, size: int) -> Any:
    """What a call on the caller's arrays does at the end: ``avg``'s division, then
    return ``out``."""

    def finish() -> Any:
        if out is not None:
            ops.finish(op, out, size)
        return out

    return finish


NATIVE_BLOCKING = NativeBlocking()
NATIVE = Native()
