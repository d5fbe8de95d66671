"""Binding a plan's buffer names to arrays, and running its local operations."""

import numpy as np

from .. import ops as ops_layer
from ..schedule import Copy, ReduceMany


class Buffers:
    """The arrays behind ``in``, ``out``, ``tmp``, ``shm``, ``reg`` and ``rout`` for one
    call (flat, contiguous; ``shm``, ``reg`` and ``rout`` only for the shared-memory and
    peer-read algorithms)."""

    def __init__(self, inp, out, tmp, shm=None, reg=None, rout=None):
        self.arrays = {"in": inp, "out": out, "tmp": tmp, "shm": shm, "reg": reg, "rout": rout}

    def view(self, s):
        return self.arrays[s.buf][s.lo : s.hi]

    def run_local(self, op_name, op):
        """Run a Reduce, ReduceMany or Copy operation of the plan."""
        if isinstance(op, Copy):
            np.copyto(self.view(op.dst), self.view(op.src))
        elif isinstance(op, ReduceMany):  # a left fold, pairwise
            dst, srcs = self.view(op.dst), [self.view(s) for s in op.srcs]
            # A later input may be the destination itself (in place): fold beside it then.
            acc = np.empty_like(dst) if any(np.shares_memory(dst, s) for s in srcs[2:]) else dst
            ops_layer.combine(op_name, srcs[0], srcs[1], acc)
            for src in srcs[2:]:
                ops_layer.combine(op_name, acc, src, acc)
            if acc is not dst:
                np.copyto(dst, acc)
        else:
            ops_layer.combine(op_name, self.view(op.a), self.view(op.b), self.view(op.dst))
