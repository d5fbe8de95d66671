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
raises. ``import collectives`` has set ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` where
unset (:mod:`collectives.launcher`), so ``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))``
works as under torchrun.

Each torch call becomes the library's async call on the group's communicator and
returns a Work whose ``wait()`` waits for it. The library's messages move while
something waits or polls. By default ``get_future()`` waits first and returns a
completed future (DDP's reducer and comm hooks chain on these futures, so a bucket's
allreduce then runs inside backward). With ``COLLECTIVES_TORCH_PROGRESS_THREAD=1`` (or
``group.progress_thread = True`` before its first future) a progress thread of the
group completes the futures instead, polling the calls in flight while the program
computes: DDP's allreduces then overlap backward. That pays only where a rank has a
core to spare for the polling; on the 2-core development machine it made DDP's step
5-25% slower at 2 and 4 ranks, hence off by default. The thread needs MPI initialised
with at least ``MPI_THREAD_SERIALIZED`` (mpi4py asks for ``MPI_THREAD_MULTIPLE``);
every call into a group's communicator, from the program or from the thread, holds the
group's lock, so MPI is never called from two threads at once. A future nobody waits
on still fails with the library's timeout error once the group's timeout has passed.
Each group's communicator uses the timeout given to ``init_process_group``/``new_group``.
"""

import contextlib
import datetime
import functools
import os
import socket
import threading
import time
import warnings
import zlib

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from ..communicator import Communicator
from .tensors import BFLOAT16, BIT_TWINS, to_array

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


def _array(tensor, what, reduced=False):
    """The library's zero-copy view of ``tensor`` (collectives.torch's conversion: a
    NumPy array on the CPU, bfloat16 through ml_dtypes and bool as bytes; a device array
    for CUDA). ``reduced``: the call reduces it, which bfloat16 cannot be without
    ml_dtypes (its bits would be summed as integers)."""
    if reduced and tensor.dtype == torch.bfloat16 and BFLOAT16 is None:
        raise NotImplementedError(f"{what}: reducing bfloat16 tensors needs ml_dtypes (pip install ml_dtypes)")
    if reduced and tensor.dtype == torch.bool and tensor.device.type == "cuda":
        raise NotImplementedError(f"{what}: reducing bool CUDA tensors is not supported; use uint8")
    return to_array(tensor.detach(), "tensor", what)


def _view(tensor, shape, what, reduced=False):
    """``tensor``'s memory as a library array of ``shape`` (no copy), or None where its
    strides allow no such view (a non-contiguous CPU tensor: the caller copies)."""
    shape = tuple(shape)
    if tuple(tensor.shape) == shape:
        return _array(tensor, what, reduced)
    if tensor.is_contiguous():
        return _array(tensor.reshape(shape), what, reduced)  # a view of contiguous memory
    if tensor.device.type != "cpu":
        raise ValueError(f"{what}: a non-contiguous {tensor.device.type} tensor; pass a contiguous one")
    view = _array(tensor, what, reduced).view()
    try:
        view.shape = shape  # NumPy refuses where this would need a copy
    except AttributeError:
        return None
    return view


def _copy_into(tensor, result):
    """Write ``result`` (a NumPy array) into the CPU tensor ``tensor``, element for element."""
    _array(tensor, "output")[...] = np.asarray(result).reshape(tensor.shape)


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


def _same_dtype(what, *tensors):
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"{what}: every tensor must have the same dtype; got {', '.join(sorted(map(str, dtypes)))}")


class Work(dist.Work):
    """One call in flight: ``wait()`` finishes it (and copies results where torch wants
    them); ``get_future()`` returns a future completed when the call finishes (by the
    group's progress thread, or by a wait). ``parts``: Works this one finishes with
    (coalesced calls). ``group``: the ProcessGroup that made it (set by the group),
    whose lock every call into its communicator holds."""

    def __init__(self, handles=(), after=None, result=None, parts=()):
        super().__init__()
        self._handles, self._after, self._result, self._parts = list(handles), after, result, list(parts)
        self._done, self._error = False, None
        self.group = None
        self._started = time.monotonic()  # the group's timeout counts from here for a watched future
        self._future, self._future_claimed = None, False

    def _lock(self):
        return self.group._lock if self.group is not None else contextlib.nullcontext()

    def _finish(self, timeout=None, already_waited=0.0):
        try:
            for part in self._parts:
                if not part._done:
                    part._finish(timeout, already_waited)
                elif part._error is not None:
                    raise part._error
            for handle in self._handles:
                if timeout is None:
                    handle.wait(already_waited=already_waited)
                else:
                    handle.wait(timeout, already_waited=already_waited)
            if self._after is not None:
                self._after()
        except Exception as exc:
            self._error = exc
            raise
        finally:
            self._done = True

    def wait(self, timeout=None):
        """Finish the call (``timeout``: a timedelta or seconds bounding each wait, else
        the group's timeout); raises what the call raised."""
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds() if timeout.total_seconds() > 0 else None
        try:
            with self._lock():
                if self._error is not None:
                    raise self._error
                if not self._done:
                    self._finish(timeout)
        finally:
            self._settle_future()
        return True

    def is_completed(self):
        """Whether the call has finished (advancing it as far as it can go meanwhile)."""
        with self._lock():
            done = self._advance()
        if done:
            self._settle_future()
        return done

    def _advance(self):
        """Under the group's lock: advance the call; whether it has finished (failed
        too). Past the group's timeout since the call started, finish it with a wait
        that times out at once (naming the missing ranks, breaking the group), as a
        wait would have: a future nobody waits on must not hang for ever."""
        if self._done:
            return True
        try:  # a failure surfaces here as well as in a wait
            if all(part._advance() for part in self._parts) and all(handle.test() for handle in self._handles):
                self._finish()
            elif self.group is not None and self.group.comm.timeout is not None:
                waited = time.monotonic() - self._started
                if waited >= self.group.comm.timeout:
                    self._finish(self.group.comm.timeout, already_waited=waited)
        except Exception as exc:  # noqa: BLE001 - kept in _error: wait() raises it, the future carries it
            self._error, self._done = self._error or exc, True
        return self._done

    def is_success(self):
        return self._done and self._error is None

    def exception(self):
        return self._error

    def result(self):
        return self._result

    def get_future(self):
        """A future of the result: completed now if the call has finished, else by the
        group's progress thread once it does (where the group has none: after a wait)."""
        progress = self.group._progress_thread() if self.group is not None else None
        if progress is None:
            self.wait()
        if self._future is None:
            self._future = torch.futures.Future()
        if self._done:
            self._settle_future()
        else:
            progress.watch(self)
        return self._future

    def _settle_future(self):
        """Complete the future (once, outside the group's lock: its callbacks may call the group)."""
        with self._lock():
            if self._future is None or self._future_claimed or not self._done:
                return
            self._future_claimed = True
        if self._error is not None:
            self._future.set_exception(self._error)
        else:
            self._future.set_result(self._result)

    def source_rank(self):
        return self._handles[0].source if self._handles else -1

    _source_rank = source_rank


class _Progress:
    """A group's progress thread: polls the Works whose futures are pending, each poll
    under the group's lock, and completes their futures. Sleeps ``interval`` seconds
    between polls (the program's threads get the GIL), and on a condition while no
    future is pending."""

    def __init__(self, group, interval=50e-6):
        self.group, self.interval = group, interval
        self._watched = []
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="collectives-torch-progress", daemon=True)
        self._thread.start()

    def watch(self, work):
        with self._wake:
            self._watched.append(work)
            self._wake.notify()

    def stop(self):
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join()

    def _loop(self):
        while True:
            with self._wake:
                while not self._watched and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    return
                watched = list(self._watched)
            with self.group._lock:
                finished = [work for work in watched if work._advance()]
            if finished:
                with self._wake:
                    self._watched = [work for work in self._watched if work not in finished]
                for work in finished:
                    work._settle_future()
            time.sleep(self.interval)


def _serialized(method):
    """A ProcessGroup method that calls the communicator: under the group's lock, and
    the Work it returns knows its group."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            result = method(self, *args, **kwargs)
        if isinstance(result, Work):
            result.group = self
            for part in result._parts:
                part.group = self
        return result
    return call


class ProcessGroup(dist.ProcessGroup):
    """torch.distributed's collectives on a :class:`~collectives.Communicator`.
    ``owned``: an MPI communicator the group made for itself (freed with it)."""

    def __init__(self, comm, owned=None):
        super().__init__(comm.rank, comm.size)
        self.comm, self._owned = comm, owned
        self._lock = threading.RLock()  # every call into comm: the program's and the progress thread's
        self._progress = None
        # Whether pending futures get a progress thread (set before the group's first
        # future); else get_future() waits. See the module's docstring for the trade.
        self.progress_thread = os.environ.get("COLLECTIVES_TORCH_PROGRESS_THREAD", "0") == "1"

    def _progress_thread(self):
        """The group's progress thread (started at the first pending future), or None
        where ``progress_thread`` is off or MPI's thread level rules it out."""
        if self._progress is None and self.progress_thread \
                and MPI.Query_thread() >= MPI.THREAD_SERIALIZED and self.comm.mpi_comm != MPI.COMM_NULL:
            self._progress = _Progress(self)
        return self._progress

    def getBackendName(self):
        return BACKEND

    def shutdown(self):
        """Stop the progress thread and free the group's MPI communicators
        (``destroy_process_group`` calls this on every member)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self.comm.mpi_comm != MPI.COMM_NULL:
            self.comm.free()
            if self._owned is not None:
                self._owned.Free()
                self._owned = None

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
        reduce_op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if any(tensor.layout == torch.sparse_coo for tensor in tensors):
            return self._sparse_allreduce(tensors, reduce_op)
        op = _op(reduce_op, "all_reduce")
        arrays = [_array(tensor, "all_reduce", reduced=True) for tensor in tensors]  # every check first
        return Work([self.comm.allreduce_async(x, op=op, out=x) for x in arrays], result=tensors)

    def _sparse_allreduce(self, tensors, reduce_op):
        """gloo's sparse all_reduce: the sum of every rank's sparse COO tensor (coalesced
        first, then added in rank order), coalesced, written into the tensor in place.
        The ranks first allgather what their tensors
        are (dimensions, size, dtype, number of entries), so tensors that differ raise on
        every rank before any data moves; then every rank's indices and values, each
        padded to the most entries any rank has."""
        if reduce_op != dist.ReduceOp.SUM:
            name = str(getattr(reduce_op, "op", reduce_op)).split(".")[-1]
            raise ValueError(f"all_reduce of a sparse tensor: op must be SUM (as with gloo); got {name}")
        if len(tensors) != 1 or tensors[0].layout != torch.sparse_coo:
            raise ValueError("all_reduce of sparse tensors: one sparse COO tensor per call (not mixed with dense "
                             "ones)")
        tensor = tensors[0]
        if tensor.device.type != "cpu":
            raise NotImplementedError(f"all_reduce of a sparse {tensor.device.type} tensor: sparse tensors are "
                                      "reduced on the CPU only")
        local = tensor.detach().coalesce()
        indices, values = local.indices(), local.values()
        nnz = indices.shape[1]
        kind = zlib.crc32(repr((str(tensor.dtype), tuple(tensor.shape), tensor.sparse_dim())).encode())
        everyone = self.comm.allgather(np.array([nnz, kind], np.int64))
        differ = [r for r in range(self.comm.size) if everyone[r, 1] != everyone[0, 1]]
        if differ:
            raise ValueError(f"all_reduce of a sparse tensor: every rank's tensor must have the same size, dtype and "
                             f"sparse dimensions; rank(s) {', '.join(map(str, differ))} differ from rank 0 (here on "
                             f"rank {self.comm.rank}: size {tuple(tensor.shape)}, {tensor.dtype}, "
                             f"{tensor.sparse_dim()} sparse dimension(s))")
        counts = [int(n) for n in everyone[:, 0]]
        longest = max(counts)
        padded_indices = indices.new_zeros((indices.shape[0], longest))
        padded_indices[:, :nnz] = indices
        padded_values = values.new_zeros((longest, *values.shape[1:]))
        padded_values[:nnz] = values
        wire = padded_values.view(BIT_TWINS.get(values.dtype, values.dtype))  # moved as bits, summed by torch below
        gathered_indices = self.comm.allgather_async(padded_indices.numpy())
        gathered_values = self.comm.allgather_async(wire.numpy())

        def after():
            all_indices = torch.from_numpy(gathered_indices.wait())
            all_values = torch.from_numpy(gathered_values.wait()).view(values.dtype)
            total = None
            for r, n in enumerate(counts):  # summed in rank order, as gloo does (the same bits)
                part = torch.sparse_coo_tensor(all_indices[r, :, :n], all_values[r, :n], tuple(tensor.shape),
                                               check_invariants=False)  # every rank's tensor was valid
                total = part if total is None else total + part
            tensor.copy_(total.coalesce())

        return Work([gathered_indices, gathered_values], after=after, result=tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts):
        op, root = _op(opts.reduceOp, "reduce"), opts.rootRank
        x = _array(tensors[0], "reduce", reduced=True)
        handle = self.comm.reduce_async(x, root=root, op=op, out=x if self.comm.rank == root else None)
        return Work([handle], result=tensors)

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        op = _op(opts.reduceOp, "reduce_scatter")
        output, inputs = output_tensors[0], input_tensors[0]
        self._same_sizes(inputs, output, "reduce_scatter")
        stacked = _flat(inputs).to(output.device)
        return self._reduce_scatter(output, stacked, op, "reduce_scatter")

    def reduce_scatter_single(self, output, input, opts):
        op = _op(opts.reduceOp, "reduce_scatter_tensor")
        if input.numel() != output.numel() * self.comm.size:
            raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, not world size × "
                             f"output's ({self.comm.size} × {output.numel()})")
        _same_dtype("reduce_scatter_tensor", input, output)
        return self._reduce_scatter(output, input, op, "reduce_scatter_tensor")

    def _reduce_scatter(self, output, input, op, what):
        x = _view(input, (input.numel(),), what, reduced=True)
        if x is None:
            x = _array(input.reshape(-1), what, reduced=True)  # a contiguous copy
        out = _view(output, (output.numel(),), what)
        handle = self.comm.reduce_scatter_async(x, op=op, out=out)
        after = None if out is not None else (lambda: _copy_into(output, handle.wait()))
        return Work([handle], after=after, result=[output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return Work(parts=works, result=outputs)

    # -- moving data ----------------------------------------------------------------------
    def broadcast(self, tensors, opts):
        arrays = [_array(t, "broadcast") for t in tensors]
        return Work([self.comm.broadcast_async(x, root=opts.rootRank) for x in arrays], result=tensors)  # in place

    def allgather(self, output_tensors, input_tensors, opts=None):
        for outputs, tensor in zip(output_tensors, input_tensors):
            self._same_sizes(outputs, tensor, "all_gather")
        works = []
        for outputs, tensor in zip(output_tensors, input_tensors):
            handle = self.comm.allgather_async(_array(tensor, "all_gather"))
            works.append((handle, outputs))

        def after():
            for handle, outputs in works:
                rows = handle.wait()
                for out, row in zip(outputs, rows):
                    self._copy_row(out, row)

        return Work([h for h, _ in works], after=after, result=output_tensors)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """``output_lists[r][j]`` receives input ``j`` of rank ``r`` (one allgather per input)."""
        if len(output_lists) != self.comm.size:
            raise ValueError(f"all_gather_coalesced: expected {self.comm.size} output lists (one per rank); "
                             f"got {len(output_lists)}")
        for outputs in output_lists:
            if len(outputs) != len(input_list):
                raise ValueError("all_gather_coalesced: every output list must hold one tensor per input")
            for out, tensor in zip(outputs, input_list):
                if out.numel() != tensor.numel() or out.dtype != tensor.dtype:
                    raise ValueError("all_gather_coalesced: each output must match its input's size and dtype")
        handles = [self.comm.allgather_async(_array(tensor, "all_gather_coalesced")) for tensor in input_list]

        def after():
            for j, handle in enumerate(handles):
                for rank, row in enumerate(handle.wait()):
                    self._copy_row(output_lists[rank][j], row)

        return Work(handles, after=after, result=output_lists)

    def all_gather_single(self, output, input, opts=None):
        if output.numel() != input.numel() * self.comm.size:
            raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements, not world size × "
                             f"input's ({self.comm.size} × {input.numel()})")
        _same_dtype("all_gather_into_tensor", input, output)
        x = _view(input, (input.numel(),), "all_gather_into_tensor")
        if x is None:
            x = _array(input.reshape(-1), "all_gather_into_tensor")
        out = _view(output, (self.comm.size, input.numel()), "all_gather_into_tensor")
        handle = self.comm.allgather_async(x, out=out)
        after = None if out is not None else (lambda: _copy_into(output, handle.wait()))
        return Work([handle], after=after, result=[output])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return Work(parts=works, result=outputs)

    def gather(self, output_tensors, input_tensors, opts):
        root, tensor = opts.rootRank, input_tensors[0]
        outputs = output_tensors[0] if self.comm.rank == root else []
        if self.comm.rank == root:
            self._same_sizes(outputs, tensor, "gather")
        handle = self.comm.gather_async(_array(tensor, "gather"), root=root)

        def after():
            rows = handle.wait()
            for out, row in zip(outputs, rows if rows is not None else []):
                self._copy_row(out, row)

        return Work([handle], after=after, result=output_tensors)

    def scatter(self, output_tensors, input_tensors, opts):
        root, output = opts.rootRank, output_tensors[0]
        out = _view(output, tuple(output.shape), "scatter")
        if self.comm.rank == root:
            self._same_sizes(input_tensors[0], output, "scatter")
            rows = torch.stack([t.detach().reshape(output.shape) for t in input_tensors[0]]).to(output.device)
            handle = self.comm.scatter_async(_array(rows, "scatter"), root=root, out=out)
        else:
            handle = self.comm.scatter_async(None, root=root, out=out)
        return Work([handle], result=[output])

    def alltoall(self, output_tensors, input_tensors, opts=None):
        _same_dtype("all_to_all", *output_tensors, *input_tensors)
        send = [t.numel() for t in input_tensors]
        recv = [t.numel() for t in output_tensors]
        flat = _flat(input_tensors)
        if input_tensors:
            flat = flat.to(dtype=input_tensors[0].dtype, device=input_tensors[0].device)  # an empty list's dtype
        handle = self.comm.alltoallv_async(_array(flat, "all_to_all"), send, recv)

        def after():
            result, start = handle.wait(), 0
            for out, n in zip(output_tensors, recv):
                self._copy_row(out, result[start:start + n])
                start += n

        return Work([handle], after=after, result=output_tensors)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        size = self.comm.size
        _same_dtype("all_to_all_single", input, output)
        x, y = _rows(input), _rows(output)
        send = list(input_split_sizes) or self._equal_split(x.shape[0], "input")
        recv = list(output_split_sizes) or self._equal_split(y.shape[0], "output")
        if len(send) != size or len(recv) != size:
            raise ValueError(f"all_to_all_single: split sizes must have one entry per rank ({size})")
        out = _view(output, tuple(y.shape), "all_to_all_single")
        handle = self.comm.alltoallv_async(_array(x, "all_to_all_single"), send, recv, out=out)
        after = None if out is not None else (lambda: _copy_into(output, handle.wait()))
        return Work([handle], after=after, result=[output])

    def barrier(self, opts=None):
        self.comm.barrier()
        return Work()

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """Not gloo's monitored barrier: a clear error (torch's ``dist.monitored_barrier``
        itself refuses every backend but gloo before reaching the group)."""
        raise NotImplementedError(
            "monitored_barrier is gloo's (torch allows it on gloo groups only); on a 'collectives' group use "
            "barrier(): with the group's timeout (timeout= of init_process_group or new_group) a barrier that "
            "some ranks do not reach raises CollectiveTimeoutError naming them")

    # -- point to point -------------------------------------------------------------------
    def send(self, tensors, dst, tag):
        return Work([self.comm.send_async(_array(t, "send"), dst, tag) for t in tensors])

    def recv(self, tensors, src, tag):
        return Work([self.comm.recv_async(_array(t, "recv"), src, tag) for t in tensors], result=tensors)

    def recv_anysource(self, tensors, tag):
        return Work([self.comm.recv_async(_array(t, "recv"), None, tag) for t in tensors], result=tensors)

    # -- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _copy_row(tensor, row):
        """Copy the library's result ``row`` (a host or device array) into ``tensor``."""
        if tensor.device.type == "cpu":
            _copy_into(tensor, row)
        else:  # on the device: a tensor, or an array torch reads through DLPack
            if not isinstance(row, torch.Tensor):
                row = torch.from_dlpack(getattr(row, "data", row))
            tensor.copy_(row.reshape(tensor.shape))

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


for _name in ("allreduce", "allreduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_single",
              "reduce_scatter_single_coalesced", "broadcast", "allgather", "allgather_coalesced", "all_gather_single",
              "all_gather_single_coalesced", "gather", "scatter", "alltoall", "all_to_all_single", "barrier", "send",
              "recv", "recv_anysource"):
    setattr(ProcessGroup, _name, _serialized(getattr(ProcessGroup, _name)))
# torch's other names for the same calls (torch's stubs type them for its own class)
ProcessGroup._reduce_scatter_base = ProcessGroup.reduce_scatter_single  # type: ignore[method-assign,assignment]
ProcessGroup._allgather_base = ProcessGroup.all_gather_single  # type: ignore[method-assign,assignment]
ProcessGroup.allgather_into_tensor_coalesced = ProcessGroup.all_gather_single_coalesced  # type: ignore[method-assign,assignment]
ProcessGroup.alltoall_base = ProcessGroup.all_to_all_single  # type: ignore[method-assign,assignment]


def _create(dist_backend_opts, backend_options):
    """torch's creator for a group: a Communicator over the group's ranks (MPI's ranks:
    the default group's are checked to be MPI's, on every rank, before anything else)."""
    world, opts = MPI.COMM_WORLD, dist_backend_opts
    timeout = opts.timeout.total_seconds() if isinstance(opts.timeout, datetime.timedelta) else None
    timeout = timeout if timeout and timeout > 0 else None
    if not dist.is_initialized():  # the default group, being made
        if opts.group_size != world.Get_size():
            raise RuntimeError(
                f"init_process_group('collectives'): torch's world size is {opts.group_size} (WORLD_SIZE or the "
                f"arguments), MPI's is {world.Get_size()}; unset RANK and WORLD_SIZE under mpiexec")
        views = world.allgather(opts.group_rank)  # every rank hears every rank's view: all raise, or none
        wrong = [(mpi_rank, view) for mpi_rank, view in enumerate(views) if view != mpi_rank]
        if wrong:
            listed = ", ".join(f"MPI rank {m} is torch rank {t}" for m, t in wrong[:8])
            raise RuntimeError(f"init_process_group('collectives'): torch's ranks (RANK or the arguments) are not "
                               f"MPI's: {listed}; MPI says rank {world.Get_rank()} here; unset RANK and WORLD_SIZE "
                               "under mpiexec")
        return ProcessGroup(Communicator(world, timeout=timeout))
    ranks = list(opts.global_ranks_in_group)
    if ranks == list(range(world.Get_size())):
        return ProcessGroup(Communicator(world, timeout=timeout))
    group = world.Get_group()
    members = group.Incl(ranks)
    mpi_comm = world.Create_group(members)  # collective over the members only, as new_group's creation is
    members.Free()
    group.Free()
    return ProcessGroup(Communicator(mpi_comm, timeout=timeout), owned=mpi_comm)


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _routable_address():
    """An address of this host other hosts can reach (the interface of the default
    route; a UDP connect sends nothing), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never answers; only picks the route
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def set_rendezvous_environment(world=None):
    """Give torch's ``env://`` rendezvous what it needs from MPI: ``RANK`` and
    ``WORLD_SIZE`` where unset, and where ``MASTER_ADDR`` is unset rank 0's address and a
    free port on it. Collective over ``world`` (MPI.COMM_WORLD): a gather of the host
    names and a broadcast of the address, which every rank must reach."""
    world = MPI.COMM_WORLD if world is None else world
    rank, size = world.Get_rank(), world.Get_size()
    env_rank, env_size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if size > 1 and (env_rank not in (None, str(rank)) or env_size not in (None, str(size))):
        warnings.warn(f"RANK={env_rank} and WORLD_SIZE={env_size} disagree with MPI (rank {rank} of {size}): "
                      "init_process_group('collectives') will refuse them (a larger WORLD_SIZE makes torch's "
                      "store wait for ranks that never come); unset them under mpiexec", stacklevel=3)
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(size))
    if "MASTER_ADDR" in os.environ:
        return
    host, port = rendezvous_address(world)
    os.environ["MASTER_ADDR"] = host
    os.environ.setdefault("MASTER_PORT", str(port))


def rendezvous_address(world):
    """``(host, port)`` for a TCP rendezvous served by rank 0 of ``world``: its address
    (where its host name resolves to loopback but the ranks span several hosts, the
    address of its default route) and a free port there. Collective over ``world``: a
    gather of the host names and a broadcast."""
    rank, size = world.Get_rank(), world.Get_size()
    if size == 1:
        return "127.0.0.1", _free_port()
    hosts = world.gather(MPI.Get_processor_name(), root=0)
    address = None
    if rank == 0:
        try:
            host = socket.gethostbyname(MPI.Get_processor_name())
        except OSError:
            host = "127.0.0.1"
        if host.startswith("127.") and len(set(hosts)) > 1:  # the host name maps to loopback: no good off-host
            host = _routable_address() or host
            if host.startswith("127."):
                warnings.warn(f"rank 0's address is {host} (loopback) but the ranks span several hosts: set "
                              "MASTER_ADDR to an address of rank 0's host the others can reach", stacklevel=3)
        address = (host, _free_port())
    return world.bcast(address, root=0)


def register():
    """Register the backend (idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
