"""What each collective computes, in NumPy: the one reference the tests, the simulator,
the soak and the demo check results against.

Each function takes every rank's input as the :class:`~collectives.Communicator` takes
it (``inputs[r]`` is rank r's ``x``) and returns every rank's result as the
communicator returns it: a list, ``None`` where a rank gets none (the non-roots of
reduce and gather). Reductions fold in rank order, ``x0 op x1 op … op x(p-1)``, in the
inputs' dtype, with ``avg``'s one division by the world size at the end: the bits the
library's deterministic mode promises, and, for integer-valued inputs that stay exact,
the bits of every algorithm.

:func:`mpi_result` is the other reference: what the MPI library's own collective gives
(through mpi4py directly, not through the library), shaped the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .algorithms import block_bounds

UFUNCS = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
          "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}

Results = list[Any]


def expected(collective: str, inputs: Sequence[np.ndarray], op: str = "sum", root: int = 0,
             counts: Any = None) -> Results:
    """Every rank's result of ``collective`` (``counts``: alltoallv's ``counts[i][j]``,
    the rows rank i sends rank j)."""
    function = globals().get(collective)
    if function is None or collective.startswith("_") or not callable(function):
        raise ValueError(f"no reference for collective {collective!r}")
    return function([np.asarray(x) for x in inputs], op=op, root=root, counts=counts)


def fold(op: str, inputs: Sequence[np.ndarray]) -> np.ndarray:
    """``x0 op x1 op … op x(p-1)``, left to right, in the inputs' dtype (avg: then / p)."""
    acc = np.array(inputs[0], copy=True)
    with np.errstate(all="ignore"):  # an overflow gives what the dtype gives (inf, wrapped integers)
        for x in inputs[1:]:
            UFUNCS[op](acc, x, out=acc)
        if op == "avg" and len(inputs) > 1 and acc.size:
            np.divide(acc, len(inputs), out=acc)
    return acc


def allreduce(inputs: list[np.ndarray], op: str = "sum", root: int = 0, counts: Any = None) -> Results:
    total = fold(op, inputs)
    return [total.copy() for _ in inputs]


def reduce_scatter(inputs: list[np.ndarray], op: str = "sum", root: int = 0, counts: Any = None) -> Results:
    total = fold(op, inputs).reshape(-1)
    bounds = block_bounds(total.size, len(inputs))
    return [total[bounds[r] : bounds[r + 1]].copy() for r in range(len(inputs))]


def allgather(inputs: list[np.ndarray], op: str = "sum", root: int = 0, counts: Any = None) -> Results:
    return [np.stack(inputs) for _ in inputs]


def broadcast(inputs: list[np.ndarray], op: str = "sum", root: int = 0, counts: Any = None) -> Results:
    return [inputs[root].copy() for _ in inputs]


def reduce(inputs: list[np.ndarray], op: str = "sum", root: int = 0, counts: Any = None) -> Results:
    total = fold(op, inputs)
    return [total if r == root else None for r in range(len(inputs))]


def gather(inputs: list[np.ndarray], op: str = "sum", root: int = 0, counts: Any = None) -> Results:
    return [np.stack(inputs) if r == root else None for r in range(len(inputs))]


def scatter(inputs: list[np.ndarray], op: str = "sum", root: int = 0, counts: Any = None) -> Results:
    """Row r of the root's input (shape ``(size, *s)``) to rank r."""
    return [inputs[root][r].copy() for r in range(len(inputs))]


def alltoall(inputs: list[np.ndarray], op: str = "sum", root: int = 0, counts: Any = None) -> Results:
    """Row j of rank i's input to rank j, stacked in rank order."""
    return [np.stack([x[r] for x in inputs]) for r in range(len(inputs))]


def alltoallv(inputs: list[np.ndarray], op: str = "sum", root: int = 0, counts: Any = None) -> Results:
    """``counts[i][j]`` rows of rank i's input (in order) to rank j; rank j gets rank
    0's rows first, then rank 1's, and so on."""
    size = len(inputs)
    blocks = [np.split(x, np.cumsum([int(n) for n in counts[i]])[:-1]) for i, x in enumerate(inputs)]
    return [np.concatenate([blocks[i][r] for i in range(size)]) for r in range(size)]


# -- the MPI library's own collectives ----------------------------------------------------
def mpi_result(mpi_comm: Any, collective: str, x: np.ndarray, op: str = "sum", root: int = 0) -> np.ndarray | None:
    """What the MPI library's own collective gives this rank for ``x`` (mpi4py's buffer
    calls on ``mpi_comm``, collective), shaped as the Communicator shapes results; None
    where the Communicator returns None. Not alltoallv."""
    function = _MPI.get(collective)
    if function is None:
        raise ValueError(f"no MPI reference for collective {collective!r}")
    return function(mpi_comm, np.ascontiguousarray(x), op, root)


def _mpi_op(op: str) -> Any:
    from mpi4py import MPI

    return {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN,
            "band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR}[op]


def _averaged(out: np.ndarray, op: str, size: int) -> np.ndarray:
    if op == "avg" and size > 1 and out.size:
        np.divide(out, size, out=out)
    return out


def _mpi_allreduce(mpi_comm: Any, x: np.ndarray, op: str, root: int) -> Any:
    out = np.empty_like(x)
    mpi_comm.Allreduce(x, out, _mpi_op(op))
    return _averaged(out, op, mpi_comm.Get_size())


def _mpi_reduce_scatter(mpi_comm: Any, x: np.ndarray, op: str, root: int) -> Any:
    size, rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
    total = _mpi_allreduce(mpi_comm, x, op, root).reshape(-1)
    bounds = block_bounds(total.size, size)
    return total[bounds[rank] : bounds[rank + 1]].copy()


def _mpi_allgather(mpi_comm: Any, x: np.ndarray, op: str, root: int) -> Any:
    out = np.empty((mpi_comm.Get_size(),) + x.shape, x.dtype)
    mpi_comm.Allgather(x, out)
    return out


def _mpi_broadcast(mpi_comm: Any, x: np.ndarray, op: str, root: int) -> Any:
    out = x.copy()
    mpi_comm.Bcast(out, root)
    return out


def _mpi_reduce(mpi_comm: Any, x: np.ndarray, op: str, root: int) -> Any:
    here = mpi_comm.Get_rank() == root
    out = np.empty_like(x)
    mpi_comm.Reduce(x, out if here else None, _mpi_op(op), root)
    return _averaged(out, op, mpi_comm.Get_size()) if here else None


def _mpi_gather(mpi_comm: Any, x: np.ndarray, op: str, root: int) -> Any:
    here = mpi_comm.Get_rank() == root
    out = np.empty((mpi_comm.Get_size(),) + x.shape, x.dtype)
    mpi_comm.Gather(x, out if here else None, root)
    return out if here else None


def _mpi_scatter(mpi_comm: Any, x: np.ndarray, op: str, root: int) -> Any:  # x: (size, *s); the root's rows go
    out = np.empty(x.shape[1:], x.dtype)
    mpi_comm.Scatter(x if mpi_comm.Get_rank() == root else None, out, root)
    return out


def _mpi_alltoall(mpi_comm: Any, x: np.ndarray, op: str, root: int) -> Any:
    out = np.empty_like(x)
    mpi_comm.Alltoall(x, out)
    return out


_MPI = {"allreduce": _mpi_allreduce, "reduce_scatter": _mpi_reduce_scatter, "allgather": _mpi_allgather,
        "broadcast": _mpi_broadcast, "reduce": _mpi_reduce, "gather": _mpi_gather, "scatter": _mpi_scatter,
        "alltoall": _mpi_alltoall}
