"""The torch.distributed backend ``"collectives"``: a Python ProcessGroup over a
:class:`~collectives.Communicator`, registered when :mod:`collectives.torch` is imported.

    import torch.distributed as dist
    import collectives.torch                       # registers the backend
    dist.init_process_group("collectives")         # under mpiexec: no MASTER_ADDR, RANK or WORLD_SIZE
    model = torch.nn.parallel.DistributedDataParallel(model)   # unchanged

Rank and world size come from MPI. torch still makes its TCP store at
``init_process_group`` (gloo groups made with ``new_group(backend="gloo")`` use it); on
import, where ``MASTER_ADDR`` is not set, rank 0 picks a free port and tells the others
(one MPI broadcast: every rank must import the module), and ``RANK``/``WORLD_SIZE``
default to MPI's. Where they are set and disagree with MPI, ``init_process_group``
raises.

Each torch call becomes the library's async call on the group's communicator and
returns a Work whose ``wait()`` waits for it; the library's messages move while
something waits or polls, so ``async_op=True`` overlaps work only as far as the
program waits or polls. ``get_future()`` waits first and returns a completed future
(DDP's comm hooks and its reducer chain on it). Each group's communicator
uses the timeout given to ``init_process_group``/``new_group``.
"""

import datetime
import os
import socket

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from .communicator import Communicator

BACKEND = "collectives"

_OPS = {
    dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PRODUCT: "prod", dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max", dist.ReduceOp.BAND: "band", dist.ReduceOp.BOR: "bor", dist.ReduceOp.BXOR: "bxor",
}


def _op(reduce_op, what):
    for torch_op, name in _OPS.items():
        if reduce_op == torch_op:
            return name
    name = str(getattr(reduce_op, "op", reduce_op)).split(".")[-1]  # a ReduceOp object holds its RedOpType
    raise NotImplementedError(f"{what}: reduce op {name} has no counterpart in collectives "
                              f"(it has {', '.join(str(op).split('.')[-1] for op in _OPS)})")


def _array(tensor):
    """What the library takes for ``tensor``: a CUDA tensor as it is, a CPU tensor as a
    NumPy view of its memory (bfloat16 and bool as collectives.torch views them)."""
    from .torch import _numpy  # the adapter's conversion (bfloat16 through ml_dtypes, bool as bytes)

    if tensor.device.type == "cuda":
        return tensor.detach()
    return _numpy(tensor.detach(), "tensor", "tensor")


def _copy_into(tensor, result):
    """Write ``result`` (an array, or a tensor for CUDA) into ``tensor``."""
    if isinstance(result, torch.Tensor):
        tensor.copy_(result.reshape(tensor.shape))
    else:
        _array(tensor)[...] = np.asarray(result).reshape(tensor.shape)


def _rows(tensor):
    """``tensor`` as a 2-D (rows, rest) view or copy: its first axis are the rows that
    split sizes count (a 0-d tensor is one row)."""
    rows = tensor.shape[0] if tensor.dim() else 1
    return tensor.reshape(rows, int(np.prod(tensor.shape[1:], dtype=np.int64)))


def _flat(tensors):
    """The tensors one after another, flat and contiguous (a new tensor)."""
    if not tensors:
        return torch.empty(0)
    return torch.cat([t.detach().reshape(-1) for t in tensors])


class Work(dist.Work):
    """One call in flight: ``wait()`` finishes it (and copies results where torch wants
    them); ``get_future()`` waits, then returns a completed future."""

    def __init__(self, handles=(), after=None, result=None):
        super().__init__()
        self._handles, self._after, self._result = list(handles), after, result
        self._done = False

    def _finish(self):
        for handle in self._handles:
            handle.wait()
        if self._after is not None:
            self._after()
        self._done = True

    def wait(self, timeout=None):
        if not self._done:
            self._finish()
        return True

    def is_completed(self):
        if not self._done and all(handle.test() for handle in self._handles):
            self._finish()
        return self._done

    def is_success(self):
        return self.is_completed()

    def exception(self):
        return None

    def get_future(self):
        self.wait()
        future = torch.futures.Future()
        future.set_result(self._result)
        return future

    def source_rank(self):
        return self._handles[0].source if self._handles else -1

    _source_rank = source_rank


class ProcessGroup(dist.ProcessGroup):
    """torch.distributed's collectives on a :class:`~collectives.Communicator`."""

    def __init__(self, comm):
        super().__init__(comm.rank, comm.size)
        self.comm = comm

    def getBackendName(self):
        return BACKEND

    # torch names every group and looks groups up by name (DeviceMesh, FSDP2). The C++
    # ProcessGroup keeps the name on its device backends, which a Python group has none
    # of, so the name lives here.
    def _set_group_name(self, name):
        self._group_name = name

    @property
    def group_name(self):
        return getattr(self, "_group_name", "")

    def _set_group_desc(self, desc):
        self._group_desc = desc

    @property
    def group_desc(self):
        return getattr(self, "_group_desc", "")

    def __repr__(self):
        return f"<collectives ProcessGroup rank {self.comm.rank} of {self.comm.size}>"

    # -- reductions -----------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "all_reduce")
        handles = []
        for tensor in tensors:
            x = _array(tensor)
            handles.append(self.comm.allreduce_async(x, op=op, out=x))
        return Work(handles, result=tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts):
        op, root = _op(opts.reduceOp, "reduce"), opts.rootRank
        x = _array(tensors[0])
        handle = self.comm.reduce_async(x, root=root, op=op, out=x if self.comm.rank == root else None)
        return Work([handle], result=tensors)

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        op = _op(opts.reduceOp, "reduce_scatter")
        output, inputs = output_tensors[0], input_tensors[0]
        self._same_sizes(inputs, output, "reduce_scatter")
        stacked = _flat(inputs).to(output.device)
        handle = self.comm.reduce_scatter_async(_array(stacked), op=op)
        return Work([handle], after=lambda: _copy_into(output, handle.wait()), result=[output])

    def reduce_scatter_single(self, output, input, opts):
        op = _op(opts.reduceOp, "reduce_scatter_tensor")
        if input.numel() != output.numel() * self.comm.size:
            raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, not world size × "
                             f"output's ({self.comm.size} × {output.numel()})")
        handle = self.comm.reduce_scatter_async(_array(input.reshape(-1)), op=op)
        return Work([handle], after=lambda: _copy_into(output, handle.wait()), result=[output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return Work([], after=lambda: [w.wait() for w in works], result=outputs)

    # -- moving data ----------------------------------------------------------------------
    def broadcast(self, tensors, opts):
        handles = [self.comm.broadcast_async(_array(t), root=opts.rootRank) for t in tensors]  # in place
        return Work(handles, result=tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        works = []
        for outputs, tensor in zip(output_tensors, input_tensors):
            self._same_sizes(outputs, tensor, "all_gather")
            handle = self.comm.allgather_async(_array(tensor))
            works.append((handle, outputs))

        def after():
            for handle, outputs in works:
                rows = handle.wait()
                for i, out in enumerate(outputs):
                    _copy_into(out, rows[i])

        return Work([h for h, _ in works], after=after, result=output_tensors)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self.allgather(output_lists, input_list, opts)

    def all_gather_single(self, output, input, opts=None):
        if output.numel() != input.numel() * self.comm.size:
            raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements, not world size × "
                             f"input's ({self.comm.size} × {input.numel()})")
        handle = self.comm.allgather_async(_array(input.reshape(-1)))
        return Work([handle], after=lambda: _copy_into(output, handle.wait()), result=[output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return Work([], after=lambda: [w.wait() for w in works], result=outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors, input_tensors, opts):
        root, tensor = opts.rootRank, input_tensors[0]
        handle = self.comm.gather_async(_array(tensor), root=root)
        outputs = output_tensors[0] if self.comm.rank == root else []
        if self.comm.rank == root:
            self._same_sizes(outputs, tensor, "gather")

        def after():
            rows = handle.wait()
            for i, out in enumerate(outputs):
                _copy_into(out, rows[i])

        return Work([handle], after=after, result=output_tensors)

    def scatter(self, output_tensors, input_tensors, opts):
        root, output = opts.rootRank, output_tensors[0]
        if self.comm.rank == root:
            self._same_sizes(input_tensors[0], output, "scatter")
            rows = torch.stack([t.detach().reshape(output.shape) for t in input_tensors[0]]).to(output.device)
            handle = self.comm.scatter_async(_array(rows), root=root)
        else:
            handle = self.comm.scatter_async(None, root=root, out=_array(torch.empty_like(output)))
        return Work([handle], after=lambda: _copy_into(output, handle.wait()), result=[output])

    def alltoall(self, output_tensors, input_tensors, opts=None):
        send = [t.numel() for t in input_tensors]
        recv = [t.numel() for t in output_tensors]
        flat = _flat(input_tensors)
        if output_tensors:
            flat = flat.to(dtype=output_tensors[0].dtype, device=output_tensors[0].device)
        handle = self.comm.alltoallv_async(_array(flat), send, recv)

        def after():
            result, start = handle.wait(), 0
            for out, n in zip(output_tensors, recv):
                _copy_into(out, result[start:start + n])
                start += n

        return Work([handle], after=after, result=output_tensors)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        size = self.comm.size
        x, y = _rows(input), _rows(output)
        send = list(input_split_sizes) or self._equal_split(x.shape[0], "input")
        recv = list(output_split_sizes) or self._equal_split(y.shape[0], "output")
        if len(send) != size or len(recv) != size:
            raise ValueError(f"all_to_all_single: split sizes must have one entry per rank ({size})")
        handle = self.comm.alltoallv_async(_array(x), send, recv, out=_array(y) if output.is_contiguous() else None)
        return Work([handle], after=lambda: _copy_into(output, handle.wait()), result=[output])

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        self.comm.barrier()
        return Work()

    # -- point to point -------------------------------------------------------------------
    def send(self, tensors, dst, tag):
        return Work([self.comm.send_async(_array(t), dst, tag) for t in tensors])

    def recv(self, tensors, src, tag):
        return Work([self.comm.recv_async(_array(t), src, tag) for t in tensors], result=tensors)

    def recv_anysource(self, tensors, tag):
        return Work([self.comm.recv_async(_array(t), None, tag) for t in tensors], result=tensors)

    # -- helpers ----------------------------------------------------------------------------
    def _equal_split(self, rows, which):
        if rows % self.comm.size:
            raise ValueError(f"all_to_all_single: the {which} has {rows} rows, which world size "
                             f"{self.comm.size} does not divide; give split sizes")
        return [rows // self.comm.size] * self.comm.size

    def _same_sizes(self, tensors, like, what):
        if len(tensors) != self.comm.size:
            raise ValueError(f"{what}: expected a list of {self.comm.size} tensors (one per rank); got {len(tensors)}")
        for t in tensors:
            if t.numel() != like.numel() or t.dtype != like.dtype:
                raise ValueError(f"{what}: every tensor must have {like.numel()} elements of {like.dtype} "
                                 f"(uneven sizes are not supported); got {t.numel()} of {t.dtype}")


def _create(dist_backend_opts, backend_options):
    """torch's creator for a group: a Communicator over the group's ranks."""
    world = MPI.COMM_WORLD
    ranks = list(dist_backend_opts.global_ranks_in_group) or list(range(dist_backend_opts.group_size))
    if len(ranks) == world.Get_size() and ranks == list(range(world.Get_size())):
        if dist_backend_opts.group_rank != world.Get_rank() or dist_backend_opts.group_size != world.Get_size():
            raise RuntimeError(
                f"init_process_group('collectives'): torch says rank {dist_backend_opts.group_rank} of "
                f"{dist_backend_opts.group_size} (RANK/WORLD_SIZE or the arguments), MPI says rank "
                f"{world.Get_rank()} of {world.Get_size()}; unset RANK and WORLD_SIZE under mpiexec")
        mpi_comm = world
    else:
        mpi_comm = world.Create_group(world.Get_group().Incl(ranks))
    timeout = dist_backend_opts.timeout
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else None
    return ProcessGroup(Communicator(mpi_comm, timeout=seconds if seconds and seconds > 0 else None))


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def set_rendezvous_environment(world=None):
    """Give torch's ``env://`` rendezvous what it needs from MPI: ``RANK`` and
    ``WORLD_SIZE`` where unset, and where ``MASTER_ADDR`` is unset rank 0's address and a
    free port on it (one broadcast: collective over ``world``, MPI.COMM_WORLD)."""
    world = MPI.COMM_WORLD if world is None else world
    os.environ.setdefault("RANK", str(world.Get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(world.Get_size()))
    if "MASTER_ADDR" in os.environ:
        return
    address = None
    if world.Get_rank() == 0:
        try:
            host = socket.gethostbyname(MPI.Get_processor_name())
        except OSError:
            host = "127.0.0.1"
        address = (host if world.Get_size() > 1 else "127.0.0.1", _free_port())
    if world.Get_size() > 1:
        address = world.bcast(address, root=0)
    os.environ["MASTER_ADDR"] = address[0]
    os.environ.setdefault("MASTER_PORT", str(address[1]))


def register():
    """Register the backend (idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
