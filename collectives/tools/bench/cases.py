"""One benchmark case: a collective at one size, with its buffers and its contenders.

In the nccl-tests style each collective is a small table entry: how a size in bytes
becomes an element count, the bus-bandwidth factor, and how to call it through this
library, through the MPI library directly (``native``) and through gloo. Buffers are
allocated once per case, so the timed calls allocate nothing of the harness's.
"""

import copy

import numpy as np
from mpi4py import MPI

from ...sim.simulate import alltoallv_counts
from ...specs import SPECS
from ..demo import collective_input, native_result

MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN, "band": MPI.BAND, "bor": MPI.BOR,
           "bxor": MPI.BXOR}
PEER_ALGORITHMS = ("native", "gloo")  # contenders that are not ours


# nccl-tests' busbw / algbw factor of each collective at p ranks; 1 where it has no entry
# (broadcast, reduce).
BUS_FACTORS = {
    "allreduce": lambda p: 2 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "allgather": lambda p: (p - 1) / p,
    "gather": lambda p: (p - 1) / p,
    "scatter": lambda p: (p - 1) / p,
    "alltoall": lambda p: (p - 1) / p,
    "alltoallv": lambda p: (p - 1) / p,
}


def bus_factor(collective, world_size):
    """nccl-tests' busbw / algbw factor (``../shared/reference/cost-model.md``)."""
    factor = BUS_FACTORS.get(collective)
    return 1.0 if factor is None else factor(world_size)


def _per_block(spec):
    """Whether the benchmark's size is the whole buffer of one block per rank, and its
    count one block (allgather, gather, scatter, alltoall, alltoallv)."""
    return spec.gathers or spec.root_input or spec.blocked or spec.variable


def element_count(collective, nbytes, world_size, itemsize):
    """Elements of the user's input for a benchmark size of ``nbytes``.

    The size is the buffer nccl-tests reports: the input for allreduce, broadcast and
    reduce, the whole (scattered or gathered) buffer for reduce_scatter, allgather,
    gather and scatter, which are rounded to a whole number of elements per rank (at
    least one). For allgather, gather, scatter and alltoall the count is one block (for
    alltoall the size is a rank's input); for alltoallv the average block, the blocks
    being uneven (``sim.alltoallv_counts``: 0, 1 and 2 times it).
    """
    spec = SPECS[collective]
    if spec.scatters or _per_block(spec):
        per_rank = max(1, nbytes // (itemsize * world_size))
        return per_rank * world_size if spec.scatters else per_rank
    return max(1, nbytes // itemsize)


class Case:
    """Buffers and calls for (collective, size, dtype, op, in place) on this rank; with
    ``device`` (a :class:`~collectives.tools.bench.devices.BenchDevice`) the library's calls run
    on device copies of the buffers and ``native`` is the MPI library's collective on
    host copies (device -> host, MPI, host -> device: what a GPU user without a
    CUDA-aware MPI has)."""

    def __init__(self, collective, nbytes, world, dtype, op, inplace, root=0, device=None):
        self.collective, self.dtype, self.op, self.root = collective, np.dtype(dtype), op, root
        self.spec = spec = SPECS[collective]
        # gather, scatter, alltoall and alltoallv have no in-place form here
        self.inplace = inplace and not (spec.root_input or spec.blocked or spec.variable
                                        or (spec.gathers and spec.root_result))
        self.world = world  # the mpi4py communicator the native calls run on
        self.rank, self.size = world.Get_rank(), world.Get_size()
        self.count = element_count(collective, nbytes, self.size, self.dtype.itemsize)
        scale = self.size if _per_block(spec) else 1
        self.nbytes = self.count * self.dtype.itemsize * scale
        if spec.variable:  # rank i sends count * ((j - i mod p + 1) % 3) to rank j
            counts = alltoallv_counts(self.size, self.count)
            self.send_counts, self.recv_counts = counts[self.rank].tolist(), counts[:, self.rank].tolist()
            self.fresh = collective_input(self.rank, self.size, "allreduce", sum(self.send_counts), self.dtype,
                                          "prod" if op == "prod" else "sum")
        else:
            self.fresh = collective_input(self.rank, self.size, collective, self.count, self.dtype,
                                          "prod" if op == "prod" else "sum")
        self.x = self.fresh.copy()
        if spec.one_buffer:
            self.out = self.x  # broadcast is in place by definition
        elif spec.variable:
            self.out = np.empty(sum(self.recv_counts), self.dtype)
        elif spec.scatters:
            self.out = np.empty(len(np.array_split(self.fresh, self.size)[self.rank]), self.dtype)
        elif spec.root_input:
            self.out = np.empty(self.count, self.dtype)
        elif spec.gathers or spec.blocked:
            self.out = np.empty((self.size, self.count), self.dtype)
            if spec.gathers and self.inplace:  # MPI_IN_PLACE style: this rank's input is its row of the output
                self.x = self.out[self.rank]
        else:
            self.out = self.x if inplace else np.empty_like(self.x)
        self.device = device
        if device is not None:  # device twins of x and out, laid out alike
            if spec.gathers and self.inplace:
                self.dout = device.empty(self.out.shape, self.dtype)
                self.dx = self.dout[self.rank]
            elif self.out is self.x:
                self.dx = self.dout = device.empty(self.x.shape, self.dtype)
            else:
                self.dx, self.dout = device.empty(self.x.shape, self.dtype), device.empty(self.out.shape, self.dtype)
        self._reset()

    def registered(self, pool):
        """This case with its input in ``pool`` (a registered array, ``Communicator.empty``)
        and, for allreduce, in place: what ``shm`` reads in place across ranks."""
        twin = copy.copy(self)
        twin.x = pool[: self.x.nbytes].view(self.dtype).reshape(self.x.shape)
        twin.inplace = (self.spec.inplace or self.spec.one_buffer) and not self.spec.root_result  # allreduce, broadcast
        if twin.inplace:
            twin.out = twin.x
        twin._reset()
        return twin

    def _reset(self):
        self.x[...] = self.fresh
        if self.device is not None:
            self.device.upload(self.dx, self.fresh)

    # -- the contenders ----------------------------------------------------------
    def ours(self, comm, algorithm):
        """A no-argument callable running the collective through ``comm`` (on a device:
        until its result is there, on the stream)."""
        if self.device is not None:
            run, sync = self._ours(comm, algorithm, self.dx, self.dout), self.device.sync

            def on_device():
                run()
                sync()

            return on_device
        return self._ours(comm, algorithm, self.x, self.out)

    def _ours(self, comm, algorithm, x, out):
        # The Communicator's positional arguments, from the spec: x, (send_counts,
        # recv_counts), root, op, algorithm, out (none for broadcast, which works in x).
        spec = self.spec
        args = ((x,) + ((self.send_counts, self.recv_counts) if spec.variable else ())
                + ((self.root,) if spec.rooted else ()) + ((self.op,) if spec.reduces else ())
                + (algorithm,) + (() if spec.one_buffer else (out,)))
        method = getattr(comm, self.collective)
        return lambda: method(*args)

    def native(self, mpi_comm):
        """The MPI library's own collective, through mpi4py directly (on a device: on host
        copies, the copies in the time)."""
        call = self._native(mpi_comm)
        if self.op == "avg" and self._host_result() is not None:
            plain, result, size = call, self._host_result(), self.size

            def call():  # MPI has no average: a sum, then one division, as ours does
                plain()
                np.divide(result, size, out=result)

        if self.device is None:
            return call
        device, dx, x, dout, out = self.device, self.dx, self.x, self.dout, self._host_result()

        def staged():
            device.download(x, dx)
            call()
            if out is not None:
                device.upload(dout, out)

        return staged

    def _native(self, mpi_comm):
        send = MPI.IN_PLACE if self.inplace else self.x
        return NATIVE[self.collective](self, mpi_comm, send, MPI_OPS.get(self.op, MPI.SUM))

    def _vector_specs(self, x, out):
        """mpi4py's ``[buffer, (counts, displacements)]`` for MPI_Alltoallv."""
        def spec(buffer, counts):
            return [buffer, (counts, np.concatenate(([0], np.cumsum(counts)[:-1])).tolist())]

        return spec(x, self.send_counts), spec(out, self.recv_counts)

    def gloo(self, group):
        """torch.distributed's gloo collective, or None where gloo has no equivalent."""
        import torch
        import torch.distributed as dist

        if self.op not in ("sum", "max", "min", "prod") or self.collective not in GLOO:
            return None
        reduce_op = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
                     "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[self.op]
        x, out = torch.from_numpy(self.x), torch.from_numpy(self.out.reshape(-1))  # zero copy, flat
        return GLOO[self.collective](self, dist, group, reduce_op, x, out)

    # -- checking ----------------------------------------------------------------
    def count_wrong(self, run):
        """Run once on fresh input; the number of elements on this rank that differ
        from what the MPI library's own collective gives."""
        self._reset()
        if self.spec.variable:  # not in mpi_result: the counts are the case's
            expected = np.empty_like(self.out)
            self.world.Alltoallv(*self._vector_specs(self.fresh, expected))
        else:
            expected = native_result(self.world, self.collective, self.fresh, self.op, self.root)
        self._reset()
        run()
        got = self.result()
        got = None if got is None else got.copy()  # the reset below may overwrite it
        self._reset()
        if expected is None or got is None:
            return 0
        got, expected = np.asarray(got).reshape(-1), np.asarray(expected).reshape(-1)
        if got.shape != expected.shape:
            return max(got.size, expected.size)
        same = (got == expected) | (np.isnan(got) & np.isnan(expected) if self.dtype.kind in "fc" else False)
        return int(np.count_nonzero(~same))

    def result(self):
        """This rank's result after a call (None where the collective leaves none), on
        the host."""
        host = self._host_result()
        if host is None or self.device is None:
            return host
        got = np.empty_like(host)
        self.device.download(got, self.dout)
        return got

    def _host_result(self):
        if self.spec.one_buffer:
            return self.x
        if self.spec.root_result and self.rank != self.root:
            return None
        return self.out


# The MPI library's own call for each collective, through mpi4py: ``(case, mpi4py
# communicator, x or MPI_IN_PLACE, MPI op) -> a no-argument callable`` (Case.native).
def _native_allreduce(case, mpi_comm, send, mpi_op):
    out = case.out
    return lambda: mpi_comm.Allreduce(send, out, mpi_op)


def _native_reduce_scatter(case, mpi_comm, send, mpi_op):
    x, out = case.x, case.out
    counts = [len(b) for b in np.array_split(case.fresh, case.size)]
    return lambda: mpi_comm.Reduce_scatter(x, out, counts, mpi_op)


def _native_allgather(case, mpi_comm, send, mpi_op):
    out = case.out
    return lambda: mpi_comm.Allgather(send, out)


def _native_broadcast(case, mpi_comm, send, mpi_op):
    x, root = case.x, case.root
    return lambda: mpi_comm.Bcast(x, root)


def _native_reduce(case, mpi_comm, send, mpi_op):
    x, out, root = case.x, case.out, case.root
    if case.rank != root:  # MPI_IN_PLACE is for the root only
        return lambda: mpi_comm.Reduce(x, None, mpi_op, root)
    return lambda: mpi_comm.Reduce(send, out, mpi_op, root)


def _native_gather(case, mpi_comm, send, mpi_op):
    x, out, root, rank = case.x, case.out, case.root, case.rank
    return lambda: mpi_comm.Gather(x, out if rank == root else None, root)


def _native_scatter(case, mpi_comm, send, mpi_op):
    x, out, root, rank = case.x, case.out, case.root, case.rank
    return lambda: mpi_comm.Scatter(x if rank == root else None, out, root)


def _native_alltoall(case, mpi_comm, send, mpi_op):
    x, out = case.x, case.out
    return lambda: mpi_comm.Alltoall(x, out)


def _native_alltoallv(case, mpi_comm, send, mpi_op):
    sends, recvs = case._vector_specs(case.x, case.out)
    return lambda: mpi_comm.Alltoallv(sends, recvs)


NATIVE = {"allreduce": _native_allreduce, "reduce_scatter": _native_reduce_scatter, "allgather": _native_allgather,
          "broadcast": _native_broadcast, "reduce": _native_reduce, "gather": _native_gather,
          "scatter": _native_scatter, "alltoall": _native_alltoall, "alltoallv": _native_alltoallv}


# torch.distributed's gloo call for the collectives gloo has: ``(case, torch.distributed,
# group, reduce op, x and out as tensors) -> a no-argument callable`` (Case.gloo).
def _gloo_allreduce(case, dist, group, reduce_op, x, out):
    if case.inplace:
        return lambda: dist.all_reduce(out, reduce_op, group=group)

    def allreduce():  # gloo reduces in place: out of place costs the user a copy
        out.copy_(x)
        dist.all_reduce(out, reduce_op, group=group)

    return allreduce


def _gloo_broadcast(case, dist, group, reduce_op, x, out):
    root = case.root
    return lambda: dist.broadcast(x, root, group=group)


def _gloo_allgather(case, dist, group, reduce_op, x, out):
    return lambda: dist.all_gather_into_tensor(out, x, group=group)


GLOO = {"allreduce": _gloo_allreduce, "broadcast": _gloo_broadcast, "allgather": _gloo_allgather}
