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
from ..demo import collective_input, native_result

MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN, "band": MPI.BAND, "bor": MPI.BOR,
           "bxor": MPI.BXOR}
PEER_ALGORITHMS = ("native", "gloo")  # contenders that are not ours


def bus_factor(collective, world_size):
    """nccl-tests' busbw / algbw factor (``../shared/reference/cost-model.md``)."""
    p = world_size
    if collective == "allreduce":
        return 2 * (p - 1) / p
    if collective in ("reduce_scatter", "allgather", "gather", "scatter", "alltoall", "alltoallv"):
        return (p - 1) / p
    return 1.0


def element_count(collective, nbytes, world_size, itemsize):
    """Elements of the user's input for a benchmark size of ``nbytes``.

    The size is the buffer nccl-tests reports: the input for allreduce, broadcast and
    reduce, the whole (scattered or gathered) buffer for reduce_scatter, allgather,
    gather and scatter, which are rounded to a whole number of elements per rank (at
    least one). For allgather, gather, scatter and alltoall the count is one block (for
    alltoall the size is a rank's input); for alltoallv the average block, the blocks
    being uneven (``sim.alltoallv_counts``: 0, 1 and 2 times it).
    """
    if collective in ("reduce_scatter", "allgather", "gather", "scatter", "alltoall", "alltoallv"):
        per_rank = max(1, nbytes // (itemsize * world_size))
        return per_rank * world_size if collective == "reduce_scatter" else per_rank
    return max(1, nbytes // itemsize)


class Case:
    """Buffers and calls for (collective, size, dtype, op, in place) on this rank; with
    ``device`` (a :class:`~collectives.tools.bench.devices.BenchDevice`) the library's calls run
    on device copies of the buffers and ``native`` is the MPI library's collective on
    host copies (device -> host, MPI, host -> device: what a GPU user without a
    CUDA-aware MPI has)."""

    def __init__(self, collective, nbytes, world, dtype, op, inplace, root=0, device=None):
        self.collective, self.dtype, self.op, self.root = collective, np.dtype(dtype), op, root
        self.inplace = inplace and collective not in ("gather", "scatter", "alltoall", "alltoallv")  # no in-place form
        self.world = world  # the mpi4py communicator the native calls run on
        self.rank, self.size = world.Get_rank(), world.Get_size()
        self.count = element_count(collective, nbytes, self.size, self.dtype.itemsize)
        scale = self.size if collective in ("allgather", "gather", "scatter", "alltoall", "alltoallv") else 1
        self.nbytes = self.count * self.dtype.itemsize * scale
        if collective == "alltoallv":  # rank i sends count * ((j - i mod p + 1) % 3) to rank j
            counts = alltoallv_counts(self.size, self.count)
            self.send_counts, self.recv_counts = counts[self.rank].tolist(), counts[:, self.rank].tolist()
            self.fresh = collective_input(self.rank, self.size, "allreduce", sum(self.send_counts), self.dtype,
                                          "prod" if op == "prod" else "sum")
        else:
            self.fresh = collective_input(self.rank, self.size, collective, self.count, self.dtype,
                                          "prod" if op == "prod" else "sum")
        self.x = self.fresh.copy()
        if collective == "gather":
            self.out = np.empty((self.size, self.count), self.dtype)
        elif collective == "scatter":
            self.out = np.empty(self.count, self.dtype)
        elif collective == "alltoall":
            self.out = np.empty((self.size, self.count), self.dtype)
        elif collective == "alltoallv":
            self.out = np.empty(sum(self.recv_counts), self.dtype)
        elif collective == "allgather":
            self.out = np.empty((self.size, self.count), self.dtype)
            if inplace:  # MPI_IN_PLACE style: this rank's input is its row of the output
                self.x = self.out[self.rank]
        elif collective == "reduce_scatter":
            self.out = np.empty(len(np.array_split(self.fresh, self.size)[self.rank]), self.dtype)
        elif collective == "broadcast":
            self.out = self.x  # broadcast is in place by definition
        else:
            self.out = self.x if inplace else np.empty_like(self.x)
        self.device = device
        if device is not None:  # device twins of x and out, laid out alike
            if collective == "allgather":
                self.dout = device.empty(self.out.shape, self.dtype)
                self.dx = self.dout[self.rank] if inplace else device.empty(self.x.shape, self.dtype)
            elif collective in ("reduce_scatter", "gather", "scatter", "alltoall", "alltoallv"):
                self.dx, self.dout = device.empty(self.x.shape, self.dtype), device.empty(self.out.shape, self.dtype)
            else:
                self.dx = device.empty(self.x.shape, self.dtype)
                self.dout = self.dx if inplace or collective == "broadcast" else device.empty(self.x.shape, self.dtype)
        self._reset()

    def registered(self, pool):
        """This case with its input in ``pool`` (a registered array, ``Communicator.empty``)
        and, for allreduce, in place: what ``shm`` reads in place across ranks."""
        twin = copy.copy(self)
        twin.x = pool[: self.x.nbytes].view(self.dtype).reshape(self.x.shape)
        twin.inplace = self.collective in ("allreduce", "broadcast")
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
        c, op, root = self.collective, self.op, self.root
        if c == "allreduce":
            return lambda: comm.allreduce(x, op, algorithm, out)
        if c == "reduce_scatter":
            return lambda: comm.reduce_scatter(x, op, algorithm, out)
        if c == "allgather":
            return lambda: comm.allgather(x, algorithm, out)
        if c == "broadcast":
            return lambda: comm.broadcast(x, root, algorithm)
        if c == "gather":
            return lambda: comm.gather(x, root, algorithm, out)
        if c == "scatter":
            return lambda: comm.scatter(x, root, algorithm, out)
        if c == "alltoall":
            return lambda: comm.alltoall(x, algorithm, out)
        if c == "alltoallv":
            return lambda: comm.alltoallv(x, self.send_counts, self.recv_counts, algorithm, out)
        return lambda: comm.reduce(x, root, op, algorithm, out)

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
        c, x, out, root, mpi_op = self.collective, self.x, self.out, self.root, MPI_OPS.get(self.op, MPI.SUM)
        send = MPI.IN_PLACE if self.inplace else x
        if c == "allreduce":
            return lambda: mpi_comm.Allreduce(send, out, mpi_op)
        if c == "reduce_scatter":
            counts = [len(b) for b in np.array_split(self.fresh, self.size)]
            return lambda: mpi_comm.Reduce_scatter(x, out, counts, mpi_op)
        if c == "allgather":
            return lambda: mpi_comm.Allgather(send, out)
        if c == "broadcast":
            return lambda: mpi_comm.Bcast(x, root)
        if c == "gather":
            return lambda: mpi_comm.Gather(x, out if self.rank == root else None, root)
        if c == "scatter":
            return lambda: mpi_comm.Scatter(x if self.rank == root else None, out, root)
        if c == "alltoall":
            return lambda: mpi_comm.Alltoall(x, out)
        if c == "alltoallv":
            send, recv = self._vector_specs(x, out)
            return lambda: mpi_comm.Alltoallv(send, recv)
        if self.rank != root:  # MPI_IN_PLACE is for the root only
            return lambda: mpi_comm.Reduce(x, None, mpi_op, root)
        return lambda: mpi_comm.Reduce(send, out, mpi_op, root)

    def _vector_specs(self, x, out):
        """mpi4py's ``[buffer, (counts, displacements)]`` for MPI_Alltoallv."""
        def spec(buffer, counts):
            return [buffer, (counts, np.concatenate(([0], np.cumsum(counts)[:-1])).tolist())]

        return spec(x, self.send_counts), spec(out, self.recv_counts)

    def gloo(self, group):
        """torch.distributed's gloo collective, or None where gloo has no equivalent."""
        import torch
        import torch.distributed as dist

        if (self.op not in ("sum", "max", "min", "prod")
                or self.collective not in ("allreduce", "broadcast", "allgather")):
            return None
        reduce_op = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
                     "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[self.op]
        x, out = torch.from_numpy(self.x), torch.from_numpy(self.out.reshape(-1))  # zero copy, flat
        if self.collective == "allreduce":
            if self.inplace:
                return lambda: dist.all_reduce(out, reduce_op, group=group)

            def allreduce():  # gloo reduces in place: out of place costs the user a copy
                out.copy_(x)
                dist.all_reduce(out, reduce_op, group=group)

            return allreduce
        if self.collective == "broadcast":
            return lambda: dist.broadcast(x, self.root, group=group)
        return lambda: dist.all_gather_into_tensor(out, x, group=group)

    # -- checking ----------------------------------------------------------------
    def count_wrong(self, run):
        """Run once on fresh input; the number of elements on this rank that differ
        from what the MPI library's own collective gives."""
        self._reset()
        if self.collective == "alltoallv":
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
        if self.collective == "broadcast":
            return self.x
        if self.collective in ("reduce", "gather") and self.rank != self.root:
            return None
        return self.out
