"""One call of a collective, as a record that goes down the call path.

A :class:`Call` holds what the user passed; the collective's spec
(:mod:`collectives.specs`) fills in what the checks made of it (the result's shape,
the element count the plan is built for, the bytes ``auto`` sees); the call path
(:mod:`collectives.calls`) the algorithm, the timeout and the call's number; the route
(:mod:`collectives.routes`) that runs it, its flat buffers (:func:`host_buffers`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import ops
from .arrays import flat_input, flat_view, overlaps, same_memory


class Call:
    """One call, its arguments and what was made of them (see the module's docstring).
    What the call path fills in later starts as the class's default (a call sets only
    what it passed: the hot path makes one per call)."""

    auto = False  # the algorithm was auto's choice (a route may choose again: see routes.peer)
    shape: tuple[int, ...] = ()  # the result's shape
    count = 0  # the element count the plan is built for (see algorithms.build)
    nbytes = 0  # the size auto sees (see Communicator.choose)
    dtype: Any = None
    device = False  # the arrays are on a device
    gate_shape: tuple[int, ...] = ()  # the shape check mode compares
    counts: Any = None  # per-peer counts: alltoallv's (send, recv); reduce_scatter's blocks (for MPI)
    send: Any = None  # alltoallv: the rows sent to each rank, and those received (None: to learn)
    recv: Any = None
    alone = False  # blocking, no timeout or stall warning: runs after the calls in flight
    sequence = 0
    describe = ""
    inp: Any = None  # flat buffers, made by the route
    result: Any = None
    inplace = False
    finish: Callable[[], Any] | None = None
    plan: Any = None  # the compiled plan, once a route has asked for it

    def __init__(self, spec: Any, x: Any, out: Any, op: str, root: int, algorithm: str, segment_size: int | None,
                 timeout: float | None, blocking: bool):
        self.spec, self.x, self.out, self.op, self.root = spec, x, out, op, root
        self.algorithm, self.segment_size, self.timeout, self.blocking = algorithm, segment_size, timeout, blocking
        self.where: Any = x  # the array that says the dtype and the device (x, or out for a scatter without x)


def nothing() -> None:
    return None


def host_buffers(call: Call, rank: int, size: int) -> None:
    """Make ``call``'s flat contiguous host buffers: ``inp``, ``result`` and ``inplace``,
    and ``finish``, which puts the result where the caller wants it (``avg``'s division
    first) and returns what the call returns. By the spec's rules: a non-root of reduce
    and gather sends its input and gets nothing; broadcast works in ``x`` itself;
    scatter reads the root's ``x`` only; the others read ``x`` into a fresh or given
    ``out``, in place where the spec allows ``out=x``."""
    spec, x, out = call.spec, call.x, call.out
    if spec.root_result and rank != call.root:
        call.inp = flat_input(x)
        call.result, call.inplace, call.finish = call.inp[:0], False, nothing
        return
    if spec.one_buffer:
        _, result, _, unpack = prepare(x, x, call.shape)
        call.inp, call.result, call.inplace, call.finish = result, result, True, unpack
        return
    if spec.root_input:
        target = np.empty(call.shape, call.where.dtype) if out is None else out
        _, result, _, unpack = prepare(target, target, call.shape)  # packed and written back if strided
        if rank != call.root:
            inp = result[:0]  # nothing is read here
        else:
            inp = flat_input(x)
            if overlaps(x, target):  # out inside x: the root's own row lands in it early
                inp = inp.copy()
        call.inp, call.result, call.inplace, call.finish = inp, result, False, unpack
        return
    inp, result, inplace, unpack = prepare(x, out, call.shape, allow_inplace=spec.inplace)
    call.inp, call.result, call.inplace = inp, result, inplace
    if spec.reduces:
        op = call.op

        def finish() -> Any:
            ops.finish(op, result, size)
            return unpack()

        call.finish = finish
    else:
        call.finish = unpack


def prepare(x: np.ndarray, out: np.ndarray | None, shape: tuple[int, ...], allow_inplace: bool = True
            ) -> tuple[np.ndarray, np.ndarray, bool, Callable[[], Any]]:
    """Flat contiguous buffers for a call: ``(input, result, inplace, unpack)``.

    ``unpack()`` puts the result where the caller wants it and returns it: a
    non-contiguous ``out`` is computed in a contiguous copy and written back at the end;
    an ``out`` that overlaps ``x`` without being ``x`` gets a snapshot of ``x`` first.
    """
    if out is None:  # a fresh output shares nothing with x
        fresh = np.empty(shape, x.dtype)
        return flat_input(x), flat_view(fresh), False, lambda: fresh
    shares = overlaps(x, out)
    inplace = allow_inplace and shares and same_memory(x, out)
    result = flat_view(out)
    packed = result is None
    if packed:
        result = np.ascontiguousarray(out).reshape(-1) if inplace else np.empty(out.size, out.dtype)
    if inplace:
        inp = result
    else:
        inp = flat_input(x)
        if shares:
            inp = inp.copy()

    def unpack() -> np.ndarray:
        if packed:
            out[...] = result.reshape(shape)
        return out

    return inp, result, inplace, unpack
