"""Binding a plan's buffer names to arrays, and running its local operations."""

import numpy as np

from .. import ops as ops_layer
from ..schedule import Copy


class Buffers:
    """The arrays behind ``in``, ``out`` and ``tmp`` for one call (flat, contiguous)."""

    def __init__(self, inp, out, tmp):
        self.arrays = {"in": inp, "out": out, "tmp": tmp}

    def view(self, s):
        return self.arrays[s.buf][s.lo : s.hi]

    def run_local(self, op_name, op):
        """Run a Reduce or Copy operation of the plan."""
        if isinstance(op, Copy):
            np.copyto(self.view(op.dst), self.view(op.src))
        else:
            ops_layer.combine(op_name, self.view(op.a), self.view(op.b), self.view(op.dst))
