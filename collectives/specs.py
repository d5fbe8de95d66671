"""One spec per collective: everything the call path needs to know about it.

A spec says what the collective is, and nothing else does:

- its rules, as flags: whether it reduces (takes an ``op``), takes a ``root``,
  gathers (its result is one row per rank), runs in place on ``out=x``, works in one
  buffer (broadcast), gives a result on the root only (reduce, gather), reads the
  root's input only (scatter), has per-peer counts (alltoallv), whether blocking
  calls on plain arrays take the lean path, and whether a checked native blocking call
  sends the root's size ahead (broadcast);
- :meth:`Spec.arguments`: its argument checks, and from them the result's shape, the
  element count its plans are built for and the bytes ``auto`` sees;
- :meth:`Spec.native`: the MPI library's own collective for it;
- :meth:`Spec.reference`: what it computes, in NumPy (:mod:`collectives.reference`).

The call path (:mod:`collectives.calls`) and the routes (:mod:`collectives.routes`)
never branch on a collective's name: they read its spec (``SPECS[name]``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from . import ops
from . import reference as reference_module
from .algorithms import block_bounds, check_algorithm
from .arrays import as_array, check_out
from .device import DeviceArray, is_device
from .errors import CollectiveError, CollectiveMismatchError
from .options import check_counts, check_root, check_segment_size

MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN,
           "band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR}

Starter = Callable[[Any, Any], Any]  # (send buffer, receive buffer) -> MPI request (None when blocking)


class Spec:
    """What one collective is (see the module's docstring). The flags are class
    attributes, the same for every call."""

    name = ""
    reduces = False  # takes an op; avg divides by the world size at the end
    rooted = False  # takes a root
    gathers = False  # the result is (size, *x.shape); auto sees the gathered bytes
    inplace = False  # out=x runs in place
    one_buffer = False  # works in x itself (broadcast): x is input and result
    root_result = False  # only the root gets a result; the others get None, their out is left alone
    root_input = False  # only the root's x is read (the others' gives the shape and dtype)
    variable = False  # its blocks differ per peer (per-peer counts, learned per call)
    blocked = False  # x holds one block per rank, and the plan's count is one block (alltoall)
    scatters = False  # each rank's result is its block of the reduced input (reduce_scatter)
    lean = False  # blocking calls on plain contiguous arrays take the lean path (calls.run)
    # one way, from the root (broadcast): a checked native blocking call sends the root's
    # size ahead instead of the ranks agreeing on it (transport.native.RootSizeFirst)
    root_size_first = False

    def arguments(self, ctx: Any, call: Any) -> None:
        """Check ``call``'s arguments (before any message) and fill in what follows from
        them: ``x`` and ``out`` as arrays, ``shape``, ``count``, ``nbytes``, ``where``,
        ``gate_shape``."""
        raise NotImplementedError

    def agree(self, ctx: Any, call: Any) -> None:
        """What the ranks must settle between them once the call is numbered and
        before its route runs (alltoallv's counts); nothing for most."""

    def result_shape(self, shape: tuple[int, ...], count: int, size: int, rank: int) -> tuple[int, ...]:
        """The result's shape on ``rank`` for an input of ``shape`` and ``count``
        elements (the lean path's collectives): a row per rank where it gathers, this
        rank's block of the elements where it scatters, else the input's."""
        if self.gathers:
            return (size,) + shape
        if self.scatters:
            return (self.result_count(count, size, rank, 0),)
        return shape

    def auto_bytes(self, nbytes: int, size: int) -> int:
        """The size ``auto`` sees for an input of ``nbytes`` (the lean path's collectives)."""
        return nbytes * size if self.gathers else nbytes

    def count_of(self, nbytes: int, itemsize: int, size: int) -> int:
        """The element count a call's plan is built for, from the bytes ``auto`` sees."""
        elements = nbytes // itemsize
        return elements // size if self.gathers or self.root_input or self.blocked else elements

    def native(self, comm: MPI.Intracomm, op: str, root: int, counts: Any, blocking: bool = False) -> Starter:
        """The MPI library's own collective on ``comm``: ``(send, receive) -> request``
        (its non-blocking form), or with ``blocking`` its blocking form (returning
        nothing). One buffer for both (``send is receive``) is MPI_IN_PLACE where the
        collective has it."""
        raise NotImplementedError

    def reference(self, inputs: Sequence[np.ndarray], op: str = "sum", root: int = 0, counts: Any = None
                  ) -> list[Any]:
        """What every rank's call returns, in NumPy (see :mod:`collectives.reference`)."""
        return getattr(reference_module, self.name)(list(inputs), op=op, root=root, counts=counts)

    def reference_flat(self, inputs: Sequence[np.ndarray], op: str = "sum", root: int = 0, counts: Any = None
                       ) -> list[Any]:
        """:meth:`reference` for flat inputs, as the simulator and the in-process runner
        hold them (scatter's and alltoall's: one block per rank, one after another;
        alltoallv's ``counts[i][j]`` in elements), each result flat too."""
        size = len(inputs)
        if self.root_input or self.blocked:
            inputs = [np.asarray(x).reshape(size, -1) for x in inputs]
        return [None if r is None else np.asarray(r).reshape(-1) for r in self.reference(inputs, op, root, counts)]

    def result_count(self, count: int, size: int, rank: int, root: int, counts: Any = None) -> int:
        """Elements of rank ``rank``'s result for a plan built for ``count`` elements
        (``counts``: alltoallv's ``counts[i][j]``, elements from rank i to rank j)."""
        if self.root_result and rank != root:
            return 0
        if self.variable:
            return int(sum(row[rank] for row in counts))
        if self.scatters:
            bounds = block_bounds(count, size)
            return bounds[rank + 1] - bounds[rank]
        return count * size if self.gathers or self.blocked else count

    def __repr__(self) -> str:
        return f"<spec {self.name}>"


def _mpi(comm: MPI.Intracomm, name: str, blocking: bool) -> Callable[..., Any]:
    """mpi4py's ``name`` (``Allreduce``) or its non-blocking twin (``Iallreduce``)."""
    return getattr(comm, name if blocking else "I" + name[0].lower() + name[1:])


# A starter given one buffer as both send and receive passes MPI_IN_PLACE (inline in each
# starter, not a function: MPI's own collective through the library is the smallest
# calls' path, and a Python call is a tenth of its cost).
IN_PLACE = MPI.IN_PLACE


def _out(call: Any, shape: tuple[int, ...]) -> Any:
    """``call.out`` checked (the caller skips it where it is None: a call's hot path)."""
    return check_out(call.out, shape, call.x.dtype, like=call.x)


def _sized(call: Any, shape: tuple[int, ...], count: int, nbytes: int, gate_shape: tuple[int, ...] | None = None
           ) -> None:
    x = call.x
    call.shape, call.count, call.nbytes = shape, count, nbytes
    call.gate_shape = x.shape if gate_shape is None else gate_shape
    call.where, call.dtype, call.device = x, x.dtype, isinstance(x, DeviceArray)


class Allreduce(Spec):
    name, reduces, inplace, lean = "allreduce", True, True, True

    def arguments(self, ctx, call):
        call.x = x = as_array(call.x, "x")
        ops.check_op(call.op, x.dtype)
        check_algorithm(self.name, call.algorithm)
        call.out = None if call.out is None else _out(call, x.shape)
        if call.segment_size is not None:
            check_segment_size(call.segment_size)
        _sized(call, x.shape, x.size, x.nbytes)

    def native(self, comm, op, root, counts, blocking=False):
        allreduce, mpi_op = _mpi(comm, "Allreduce", blocking), MPI_OPS[op]
        return lambda send, recv: allreduce(IN_PLACE if send is recv else send, recv, mpi_op)


class ReduceScatter(Spec):
    name, reduces, scatters, lean = "reduce_scatter", True, True, True

    def arguments(self, ctx, call):
        call.x = x = as_array(call.x, "x")
        ops.check_op(call.op, x.dtype)
        check_algorithm(self.name, call.algorithm)
        bounds = block_bounds(x.size, ctx.size)
        call.counts = [bounds[r + 1] - bounds[r] for r in range(ctx.size)]  # every rank's block, for MPI
        shape = (call.counts[ctx.rank],)
        call.out = None if call.out is None else _out(call, shape)
        _sized(call, shape, x.size, x.nbytes)

    def native(self, comm, op, root, counts, blocking=False):
        reduce_scatter, mpi_op = _mpi(comm, "Reduce_scatter", blocking), MPI_OPS[op]
        return lambda send, recv: reduce_scatter(send, recv, counts, mpi_op)


class Allgather(Spec):
    name, gathers, lean = "allgather", True, True

    def arguments(self, ctx, call):
        call.x = x = as_array(call.x, "x")
        check_algorithm(self.name, call.algorithm)
        shape = (ctx.size,) + x.shape
        call.out = None if call.out is None else _out(call, shape)
        _sized(call, shape, x.size, x.nbytes * ctx.size)

    def native(self, comm, op, root, counts, blocking=False):
        return _mpi(comm, "Allgather", blocking)


class Broadcast(Spec):
    name, rooted, one_buffer, lean, root_size_first = "broadcast", True, True, True, True

    def arguments(self, ctx, call):
        call.x = x = as_array(call.x, "x")
        call.root = check_root(call.root, ctx.size)
        check_algorithm(self.name, call.algorithm)
        if not isinstance(x, DeviceArray) and (not isinstance(x, np.ndarray) or not x.flags.writeable):
            raise ValueError("x must be a writable array: broadcast fills it in place")
        if call.segment_size is not None:
            check_segment_size(call.segment_size)
        call.out = None
        _sized(call, x.shape, x.size, x.nbytes)

    def native(self, comm, op, root, counts, blocking=False):
        bcast = _mpi(comm, "Bcast", blocking)
        return lambda send, recv: bcast(send, root)


class Reduce(Spec):
    name, reduces, rooted, inplace, root_result, lean = "reduce", True, True, True, True, True

    def arguments(self, ctx, call):
        call.x = x = as_array(call.x, "x")
        call.root = check_root(call.root, ctx.size)
        ops.check_op(call.op, x.dtype)
        check_algorithm(self.name, call.algorithm)
        call.out = None if call.out is None else _out(call, x.shape)
        _sized(call, x.shape, x.size, x.nbytes)

    def native(self, comm, op, root, counts, blocking=False):
        reduce, mpi_op, is_root = _mpi(comm, "Reduce", blocking), MPI_OPS[op], comm.Get_rank() == root
        return lambda send, recv: reduce(IN_PLACE if send is recv else send, recv if is_root else None, mpi_op,
                                          root)


class Gather(Spec):
    name, rooted, gathers, root_result = "gather", True, True, True

    def arguments(self, ctx, call):
        call.x = x = as_array(call.x, "x")
        call.root = check_root(call.root, ctx.size)
        check_algorithm(self.name, call.algorithm)
        shape = (ctx.size,) + x.shape
        # the others' out is left alone
        call.out = _out(call, shape) if ctx.rank == call.root and call.out is not None else None
        _sized(call, shape, x.size, x.nbytes * ctx.size)

    def native(self, comm, op, root, counts, blocking=False):
        gather, is_root = _mpi(comm, "Gather", blocking), comm.Get_rank() == root
        return lambda send, recv: gather(send, recv if is_root else None, root)


class Scatter(Spec):
    name, rooted, root_input = "scatter", True, True

    def arguments(self, ctx, call):
        call.root = root = check_root(call.root, ctx.size)
        check_algorithm(self.name, call.algorithm)
        x, out = call.x, call.out
        if x is None and ctx.rank == root:
            raise ValueError(f"x must be an array on the root (rank {root}): its rows are scattered; got None")
        if x is None and out is None:
            raise ValueError("x is None: pass out, the array of shape s that receives this rank's row")
        if x is None:  # out alone says the row's shape and dtype: an array, not a list to convert
            if not isinstance(out, np.ndarray) and not is_device(out):
                raise TypeError(f"out must be a numpy.ndarray or a device array; got {type(out).__name__}")
            out = as_array(out, "out")
            shape, where = out.shape, out
        else:
            call.x = x = as_array(x, "x")
            if x.ndim == 0 or x.shape[0] != ctx.size:
                raise ValueError(f"x must have shape (size, *s) = ({ctx.size}, ...), one row per rank; got {x.shape}")
            shape, where = x.shape[1:], x
        if out is not None:
            out = check_out(out, shape, where.dtype, like=where)
        call.out = out
        count = math.prod(shape)
        call.shape, call.count, call.nbytes, call.gate_shape = shape, count, count * ctx.size * where.itemsize, shape
        call.where, call.dtype, call.device = where, where.dtype, isinstance(where, DeviceArray)

    def native(self, comm, op, root, counts, blocking=False):
        scatter, is_root = _mpi(comm, "Scatter", blocking), comm.Get_rank() == root
        return lambda send, recv: scatter(send if is_root else None, recv, root)


class Alltoall(Spec):
    name, blocked = "alltoall", True

    def arguments(self, ctx, call):
        call.x = x = as_array(call.x, "x")
        check_algorithm(self.name, call.algorithm)
        if x.ndim == 0 or x.shape[0] != ctx.size:
            raise ValueError(f"x must have shape (size, *s) = ({ctx.size}, ...), one row per rank; got {x.shape}")
        call.out = None if call.out is None else _out(call, x.shape)
        _sized(call, x.shape, x.size // ctx.size, x.nbytes)  # the plan's count: one block

    def native(self, comm, op, root, counts, blocking=False):
        return _mpi(comm, "Alltoall", blocking)


class Alltoallv(Spec):
    name, variable = "alltoallv", True

    def arguments(self, ctx, call):
        call.x = x = as_array(call.x, "x")
        check_algorithm(self.name, call.algorithm)
        if x.ndim == 0:
            raise ValueError("x must have shape (n, *s): its rows are sent; got a 0-d array")
        send = check_counts(call.send, "send_counts", ctx.size)
        if sum(send) != x.shape[0]:
            raise ValueError(f"send_counts must add up to the rows of x ({x.shape[0]}); they add up to {sum(send)}")
        recv = None
        if call.recv is not None:
            recv = check_counts(call.recv, "recv_counts", ctx.size)
            if recv[ctx.rank] != send[ctx.rank]:
                raise ValueError(f"recv_counts[{ctx.rank}] must equal send_counts[{ctx.rank}], the rows this rank "
                                 f"sends itself; got {recv[ctx.rank]} and {send[ctx.rank]}")
        row = x.shape[1:]
        out = call.out
        if out is not None:  # with recv_counts=None, its number of rows is checked once the counts are known
            if recv is None and getattr(out, "ndim", 1) == 0:
                raise ValueError(f"out must have shape (rows, *s) with s = {row}; got a 0-d array")
            rows = sum(recv) if recv is not None else getattr(out, "shape", (0,))[0]
            call.out = check_out(out, (rows,) + row, x.dtype, like=x)
        call.send, call.recv = send, recv
        # Every rank must pick the same algorithm, and their input sizes differ: the
        # rule for alltoallv does not look at the size.
        _sized(call, x.shape, 0, x.nbytes, gate_shape=row)  # count 0: the per-peer counts say it all

    def agree(self, ctx, call):
        # Counts the caller gave are checked where a wrong one would go unseen: check
        # mode, and MPI's own alltoallv, which may write past a buffer or return short
        # rows without an error (mpi_library.native_checked); the library's algorithms
        # find a wrong size in the message itself.
        if (call.recv is None or ctx.options.check
                or (call.algorithm == "native" and self.name in ctx.native_counts_checked)):
            call.recv = _exchange_counts(ctx, call.send, call.recv, call.out, call.timeout)
        row = call.x.shape[1:]
        call.shape = (sum(call.recv),) + row
        size_of_row = math.prod(row)
        call.counts = (tuple(n * size_of_row for n in call.send), tuple(n * size_of_row for n in call.recv))

    def native(self, comm, op, root, counts, blocking=False):
        alltoallv = _mpi(comm, "Alltoallv", blocking)
        send_counts, recv_counts = counts
        sends, recvs = (send_counts, _starts(send_counts)), (recv_counts, _starts(recv_counts))
        return lambda send, recv: alltoallv([send, sends], [recv, recvs])


def _starts(lengths: Sequence[int]) -> tuple[int, ...]:
    """Where each block begins when blocks of ``lengths`` are packed one after another."""
    return tuple(itertools.accumulate(lengths[:-1], initial=0)) if lengths else ()  # (NumPy's cumsum costs µs)


def _exchange_counts(ctx: Any, send: tuple[int, ...], recv: tuple[int, ...] | None, out: Any,
                     timeout: float | None) -> tuple[int, ...]:
    """alltoallv's receive counts, from every rank's ``send``: exchanged (one
    MPI_Alltoall), then, where a rank could find a problem the others cannot see (its
    ``recv`` disagrees with them, its ``out`` has the wrong number of rows), agreed on
    (one allgather) so that every rank raises before any data moves."""
    theirs = np.empty(ctx.size, np.int64)
    mine = np.array(send, np.int64)
    ctx.request("alltoallv's exchange of counts", lambda: ctx.comm.Ialltoall(mine, theirs), timeout, theirs.nbytes)
    learned = tuple(int(n) for n in theirs)
    if recv is None and out is None and not ctx.options.check:
        return learned  # nothing the ranks gave can disagree with it
    problem = np.full(3, -1, np.int64)  # (peer, rows it sends, rows expected) or (-2, rows, out's rows)
    if recv is not None and recv != learned:
        peer = next(i for i in range(ctx.size) if recv[i] != learned[i])
        problem[:] = (peer, learned[peer], recv[peer])
    elif out is not None and out.shape[0] != sum(learned):
        problem[:] = (-2, sum(learned), out.shape[0])
    problems = np.empty((ctx.size, 3), np.int64)
    ctx.request("alltoallv's agreement on counts", lambda: ctx.comm.Iallgather(problem, problems), timeout,
                problems.nbytes)
    for rank, (peer, sent, expected) in enumerate(problems.tolist()):
        if peer >= 0:
            raise CollectiveMismatchError(
                f"alltoallv: rank {rank} expects {expected} rows from rank {peer} (its recv_counts[{peer}]), "
                f"but rank {peer} sends it {sent} (its send_counts[{rank}])")
        if peer == -2:
            message = f"out on rank {rank} must have {sent} rows (the sum of what the ranks send it); got {expected}"
            if rank == ctx.rank:
                raise ValueError(message)
            raise CollectiveError(f"alltoallv: no data moved, since {message}")
    return learned


SPECS: dict[str, Spec] = {spec.name: spec for spec in (Allreduce(), ReduceScatter(), Allgather(), Broadcast(), Reduce(),
                                                       Gather(), Scatter(), Alltoall(), Alltoallv())}
