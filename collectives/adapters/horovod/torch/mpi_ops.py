"""The collectives: ``allreduce``, ``allgather``, ``broadcast``, ``alltoall``,
``reducescatter`` (each with its in-place, asynchronous and grouped forms),
``sparse_allreduce_async``, ``barrier`` and ``join``; ``poll`` and ``synchronize``
for the handles of the asynchronous calls."""

import warnings
import zlib

import numpy as np
import torch

from ....errors import CollectiveError, CollectiveMismatchError
from ...tensors import BFLOAT16 as _BFLOAT16
from ...tensors import to_array
from . import runtime
from .basics import _OPS, Adasum, Average, Max, Min, Sum, _ReduceOp
from .calls import _enqueue
from .compression import Compression
from .negotiation import (
    _DTYPES,
    _KINDS,
    _SHOWN_DIMS,
    DEVICE,
    DTYPE,
    EXTRA,
    KIND,
    NDIM,
    NUMEL,
    OP,
    SHAPE,
    _negotiate,
    _record,
)
from .process_sets import _global_rank_in, _ranks, _set_of, global_process_set
from .runtime import start_queued

__all__ = [
    "allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
    "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
    "join", "poll", "reducescatter", "reducescatter_async", "sparse_allreduce_async", "synchronize",
]


# -- argument checks (on this rank, before anything is queued) ----------------------------------
def _resolve_op(op, average, default=Average):
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        if average is None:
            return default
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    if op is Adasum:
        raise NotImplementedError("op=hvd.Adasum is not implemented by collectives.horovod")
    if not isinstance(op, _ReduceOp):
        raise ValueError(f"op must be one of {', '.join(map(repr, _OPS))}; got {op!r}")
    return op


def _check_tensor(tensor, what="tensor"):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor; got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{what} is a sparse tensor ({tensor.layout}): reduce it with hvd.sparse_allreduce_async, "
                        "or densify it (tensor.to_dense())")
    if tensor.device.type not in ("cpu", "cuda"):
        raise TypeError(f"{what} is on {tensor.device}: collectives takes CPU and CUDA tensors")
    return tensor


def _check_reducible(tensor, op, what="tensor"):
    if tensor.dtype == torch.bool:
        raise TypeError(f"{what} is a bool tensor: reductions need numbers (cast it, e.g. to torch.uint8)")
    if tensor.dtype == torch.bfloat16 and _BFLOAT16 is None and tensor.device.type == "cpu":
        raise TypeError(f"{what} is bfloat16: reducing bfloat16 needs ml_dtypes (pip install ml_dtypes)")
    if op in (Min, Max) and tensor.is_complex():
        raise TypeError(f"op={op!r} is not defined for complex tensors; {what} is {tensor.dtype}")


def _check_name(name):
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a string or None; got {type(name).__name__}")


def _check_factor(value, what):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what} must be a number; got {value!r}")
    return float(value)


def _check_compressor(compression):
    if not (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
        raise TypeError(f"compression must be a Compressor (hvd.Compression.none, hvd.Compression.fp16 or a class "
                        f"with compress and decompress); got {compression!r}")


def _check_tensors(tensors, what="tensors"):
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{what} must be a list of torch.Tensor; got {type(tensors).__name__}")
    for i, tensor in enumerate(tensors):
        _check_tensor(tensor, f"{what}[{i}]")
    return list(tensors)


def _array(tensor):
    """The library's view of ``tensor`` (its memory, no copy)."""
    return to_array(tensor, "tensor", "tensor")


# -- handles ------------------------------------------------------------------------------------
class _Handle:
    """What an ``*_async`` call returns: pass it to :func:`poll` or :func:`synchronize`."""

    __slots__ = ("what", "_calls", "_combine")

    def __init__(self, what, calls, combine=None):
        self.what, self._calls = what, calls
        self._combine = combine if combine is not None else (lambda results: results[0])

    def _test(self):
        start_queued()
        return all(call.done() for call in self._calls)

    def _wait(self):
        start_queued()
        for call in self._calls:
            call.complete()
        for call in self._calls:
            if call.error is not None:
                raise call.error
        return self._combine([call.result for call in self._calls])

    def __repr__(self):
        return f"<hvd handle: {self.what}>"


def _check_handle(handle):
    if not isinstance(handle, _Handle):
        raise TypeError(f"handle must be what an hvd *_async call returned; got {type(handle).__name__}")
    return handle


def poll(handle):
    """Whether the call behind ``handle`` has finished (starting the queued calls and
    advancing the running ones); then :func:`synchronize` returns at once."""
    return _check_handle(handle)._test()


def synchronize(handle):
    """Wait for the call behind ``handle`` and return its result (the same again if
    called twice); raises what the call raised (a mismatch found by negotiation, say)."""
    return _check_handle(handle)._wait()


# -- allreduce ----------------------------------------------------------------------------------
def _scale_(tensor, factor):
    """``tensor *= factor`` in place; integer tensors in double precision, truncated (Horovod's way)."""
    if factor != 1.0:
        data = tensor.detach()
        if data.is_floating_point() or data.is_complex():
            data.mul_(factor)
        else:
            data.copy_(data.double() * factor)
    return tensor


def _library_op(op, tensor):
    """The Communicator's op for ``op`` on ``tensor``'s dtype: integer averages are summed
    here and divided by :func:`_finish_reduction`."""
    if op is Average and not (tensor.is_floating_point() or tensor.is_complex()):
        return "sum"
    return op.library


def _finish_reduction(output, op, postscale, world):
    if op is Average and not (output.is_floating_point() or output.is_complex()):
        if postscale == 1.0:
            output.detach().copy_(torch.div(output.detach(), world, rounding_mode="trunc"))
        else:
            _scale_(output, postscale / world)
    else:
        _scale_(output, postscale)
    return output


def _allreduce_call(tensor, output, op, prescale, postscale, name, hset):
    """Queue reducing ``tensor`` into ``output`` (``tensor`` itself: in place). The input
    is read when the call starts."""
    def start(everyone):
        comm = hset.comm
        source = tensor
        if prescale != 1.0:  # the input is left alone (out of place): scaled in the output
            if output is not tensor:
                output.copy_(tensor.detach())
            source = _scale_(output, prescale)
        handle = comm.allreduce_async(_array(source), op=_library_op(op, tensor), out=_array(output))
        return [handle], lambda: _finish_reduction(output, op, postscale, comm.size)

    record = _record("allreduce", name, tensor, op=op, prescale=prescale, postscale=postscale)
    return _enqueue("allreduce", hset, name, record, start)


def _allreduce_args(tensor, average, name, op, prescale_factor, postscale_factor, process_set):
    hset = _set_of(process_set)
    _check_name(name)
    _check_tensor(tensor)
    op = _resolve_op(op, average)
    _check_reducible(tensor, op)
    return (hset, op, _check_factor(prescale_factor, "prescale_factor"),
            _check_factor(postscale_factor, "postscale_factor"))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    """Start reducing ``tensor`` over the ranks (``op``: default ``Average``) into a new
    tensor; returns a handle for :func:`synchronize`. ``tensor`` is not modified."""
    hset, op, pre, post = _allreduce_args(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _Handle("allreduce", [_allreduce_call(tensor, output, op, pre, post, name, hset)])


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    """Start reducing ``tensor`` over the ranks in place; returns a handle."""
    hset, op, pre, post = _allreduce_args(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    return _Handle("allreduce", [_allreduce_call(tensor, tensor, op, pre, post, name, hset)])


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Reduce ``tensor`` over the ranks in place; returns it."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)._wait()


class _AllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, name, hset):
        ctx.args = (op, prescale, postscale, hset)
        output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        return _Handle("allreduce", [_allreduce_call(tensor, output, op, prescale, postscale, name, hset)])._wait()

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, hset = ctx.args  # Horovod's gradient: the same reduction of the gradients
        return _AllreduceFunction.apply(grad, op, prescale, postscale, None, hset), None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """``tensor`` reduced over the ranks (``op``: default ``Average``), a new tensor;
    ``compression`` compresses it before and decompresses the result after.
    Differentiable."""
    compression = Compression.none if compression is None else compression
    _check_compressor(compression)
    hset, op, pre, post = _allreduce_args(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    compressed, context = compression.compress(tensor)
    return compression.decompress(_AllreduceFunction.apply(compressed, op, pre, post, name, hset), context)


def _group_names(name, count):
    """The names of a grouped call's calls (each tensor's call is in flight on its own)."""
    return [None] * count if name is None else [f"{name}.{i}" for i in range(count)]


def _grouped_allreduce_args(tensors, average, name, op, prescale_factor, postscale_factor, process_set):
    tensors = _check_tensors(tensors)
    hset = _set_of(process_set)
    _check_name(name)
    op = _resolve_op(op, average)
    for i, tensor in enumerate(tensors):
        _check_reducible(tensor, op, f"tensors[{i}]")
    return (tensors, hset, op, _check_factor(prescale_factor, "prescale_factor"),
            _check_factor(postscale_factor, "postscale_factor"))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set):
    """:func:`allreduce_async` of every tensor of the list; one handle whose
    :func:`synchronize` gives the list of results."""
    tensors, hset, op, pre, post = _grouped_allreduce_args(tensors, average, name, op, prescale_factor,
                                                           postscale_factor, process_set)
    outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    return _Handle("grouped_allreduce", [_allreduce_call(t, o, op, pre, post, n, hset) for t, o, n in
                                         zip(tensors, outputs, _group_names(name, len(tensors)))], list)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set):
    """:func:`allreduce_async_` of every tensor of the list (in place)."""
    tensors, hset, op, pre, post = _grouped_allreduce_args(tensors, average, name, op, prescale_factor,
                                                           postscale_factor, process_set)
    return _Handle("grouped_allreduce", [_allreduce_call(t, t, op, pre, post, n, hset) for t, n in
                                         zip(tensors, _group_names(name, len(tensors)))], list)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                    process_set)._wait()


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    """The list of ``tensors`` each reduced over the ranks (new tensors). Differentiable."""
    tensors = _check_tensors(tensors)
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():  # one differentiable call each
        names = _group_names(name, len(tensors))
        return [allreduce(t, average, n, compression, op, prescale_factor, postscale_factor, process_set)
                for t, n in zip(tensors, names)]
    compression = Compression.none if compression is None else compression
    _check_compressor(compression)
    compressed, contexts = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    reduced = grouped_allreduce_async(list(compressed), average, name, op, prescale_factor, postscale_factor,
                                      process_set)._wait()
    return [compression.decompress(t, c) for t, c in zip(reduced, contexts)]


# -- allgather ----------------------------------------------------------------------------------
def _exchange_rows(comm, tensor):
    """Without negotiation: every rank's first dimension (a small allgather), and the
    checks negotiation would have made of it."""
    descriptor = np.array([tensor.dim(), tensor.shape[0] if tensor.dim() else 0,
                           zlib.crc32(repr((str(tensor.dtype), tuple(tensor.shape[1:]))).encode())], np.int64)
    everyone = comm.allgather(descriptor)
    scalar = [r for r in range(comm.size) if everyone[r, 0] == 0]
    if scalar:
        raise CollectiveMismatchError(f"rank(s) {_ranks(scalar)} tried to allgather a rank-zero tensor (allgather "
                                      "works along dimension 0)")
    differ = [r for r in range(comm.size) if everyone[r, 2] != everyone[0, 2] or everyone[r, 0] != everyone[0, 0]]
    if differ:
        raise CollectiveMismatchError(f"Mismatched allgather tensors: rank(s) {_ranks(differ)} sent another dtype "
                                      "or shape beyond dimension 0 than rank 0")
    return [int(n) for n in everyone[:, 1]]


def _beyond_first(tensor):
    """A number for ``tensor``'s shape beyond dimension 0 (negotiated where it has more
    dimensions than a record shows)."""
    return zlib.crc32(repr(tuple(tensor.shape[1:])).encode())


def _allgather_call(tensor, name, hset, rows_out=None):
    """Queue concatenating every rank's ``tensor`` along dimension 0. ``rows_out``: a
    list that receives every rank's number of rows when the call starts."""
    def start(everyone):
        comm = hset.comm
        rows = _exchange_rows(comm, tensor) if everyone is None else [int(n) for n in everyone[:, SHAPE]]
        if rows_out is not None:
            rows_out.extend(rows)
        n, rest = rows[comm.rank], tuple(tensor.shape[1:])
        output = tensor.new_empty((sum(rows), *rest))
        if len(set(rows)) == 1:  # straight into the output
            handle = comm.allgather_async(_array(tensor), out=_array(output.view(comm.size, n, *rest)))
            return [handle], lambda: output
        longest = max(rows)  # uneven: every rank's rows padded to the longest
        padded = tensor.new_zeros((longest, *rest))
        padded[:n] = tensor.detach()
        gathered = tensor.new_empty((comm.size, longest, *rest))
        handle = comm.allgather_async(_array(padded), out=_array(gathered))

        def finish():
            start = 0
            for r, count in enumerate(rows):
                output[start:start + count] = gathered[r, :count]
                start += count
            return output

        return [handle], finish

    record = _record("allgather", name, tensor, extra=_beyond_first(tensor))
    return _enqueue("allgather", hset, name, record, start)


def _allgather_args(tensor, name, process_set):
    hset = _set_of(process_set)
    _check_name(name)
    _check_tensor(tensor)
    return hset


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start concatenating every rank's ``tensor`` along dimension 0 (whose size may
    differ between ranks); returns a handle."""
    return _Handle("allgather", [_allgather_call(tensor, name, _allgather_args(tensor, name, process_set))])


class _AllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, hset):
        rows = []
        output = _Handle("allgather", [_allgather_call(tensor, name, hset, rows)])._wait()
        here = hset.comm.rank
        ctx.offset, ctx.rows, ctx.hset = sum(rows[:here]), rows[here], hset
        return output

    @staticmethod
    def backward(ctx, grad):
        # Horovod's gradient: this rank's slice of the gradients averaged over the ranks
        averaged = _AllreduceFunction.apply(grad, Average, 1.0, 1.0, None, ctx.hset)
        return averaged.narrow(0, ctx.offset, ctx.rows), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated along dimension 0, in rank order (the sizes
    of dimension 0 may differ; the rest of the shape and the dtype must not).
    Differentiable."""
    hset = _allgather_args(tensor, name, process_set)
    return _AllgatherFunction.apply(tensor, name, hset)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    tensors = _check_tensors(tensors)
    hset = _set_of(process_set)
    _check_name(name)
    return _Handle("grouped_allgather", [_allgather_call(t, n, hset) for t, n in
                                         zip(tensors, _group_names(name, len(tensors)))], list)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    tensors = _check_tensors(tensors)
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return [allgather(t, n, process_set) for t, n in zip(tensors, _group_names(name, len(tensors)))]
    return grouped_allgather_async(tensors, name, process_set)._wait()


# -- sparse allreduce --------------------------------------------------------------------------------
def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Start reducing the sparse COO ``tensor`` as Horovod does: an allgather of its
    indices and one of its values. Returns a function (Horovod's handle) that waits and
    returns the sum over the ranks (``op=Average``: divided by the set's size), a
    sparse tensor of every rank's entries, not coalesced (duplicates add up when
    densified or coalesced)."""
    hset = _set_of(process_set)
    _check_name(name)
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError(f"tensor must be a sparse COO torch.Tensor; got {getattr(tensor, 'layout', type(tensor))}")
    if op not in (Average, Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum for a sparse allreduce; got {op!r}")
    local = tensor.detach().coalesce()  # duplicates summed here: fewer entries to send
    # allgather concatenates along dimension 0: the indices go transposed (one row per entry)
    indices = _allgather_call(local.indices().transpose(0, 1).contiguous(), None if name is None else
                              f"{name}.indices", hset)
    values = _allgather_call(local.values(), None if name is None else f"{name}.values", hset)
    handle = _Handle("sparse_allreduce", [indices, values], list)

    def result():
        gathered_indices, gathered_values = handle._wait()
        if op is Average:
            gathered_values = gathered_values / hset.comm.size
        return torch.sparse_coo_tensor(gathered_indices.transpose(0, 1), gathered_values, tensor.shape,
                                       check_invariants=False)  # every rank's entries were valid

    return result


# -- broadcast ----------------------------------------------------------------------------------
def _broadcast_call(tensor, root, inplace, name, hset):
    """Queue broadcasting set rank ``root``'s ``tensor``."""
    def start(everyone):
        comm = hset.comm
        if inplace:
            output = tensor
        elif comm.rank == root:
            output = tensor.detach().clone(memory_format=torch.contiguous_format)
        else:
            output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        return [comm.broadcast_async(_array(output), root=root)], lambda: output

    return _enqueue("broadcast", hset, name, _record("broadcast", name, tensor, root=root), start)


def _broadcast_args(tensor, root_rank, name, process_set):
    hset = _set_of(process_set)
    _check_name(name)
    _check_tensor(tensor)
    return hset, _global_rank_in(hset, root_rank)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Start copying rank ``root_rank``'s ``tensor`` into a new tensor on every rank."""
    hset, root = _broadcast_args(tensor, root_rank, name, process_set)
    return _Handle("broadcast", [_broadcast_call(tensor, root, False, name, hset)])


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Start overwriting ``tensor`` on every rank with rank ``root_rank``'s, in place."""
    hset, root = _broadcast_args(tensor, root_rank, name, process_set)
    return _Handle("broadcast", [_broadcast_call(tensor, root, True, name, hset)])


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with rank ``root_rank``'s, in place; returns it."""
    return broadcast_async_(tensor, root_rank, name, process_set)._wait()


class _BroadcastFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root, name, hset):
        ctx.root, ctx.hset = root, hset
        return _Handle("broadcast", [_broadcast_call(tensor, root, False, name, hset)])._wait()

    @staticmethod
    def backward(ctx, grad):
        # Horovod's gradient: the averaged gradient on the root, zero elsewhere
        averaged = _AllreduceFunction.apply(grad, Average, 1.0, 1.0, None, ctx.hset)
        return (averaged if ctx.hset.comm.rank == ctx.root else torch.zeros_like(averaged)), None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Rank ``root_rank``'s ``tensor``, as a new tensor on every rank (``tensor`` is not
    modified). Differentiable."""
    hset, root = _broadcast_args(tensor, root_rank, name, process_set)
    return _BroadcastFunction.apply(tensor, root, name, hset)


# -- alltoall -----------------------------------------------------------------------------------
def _split_values(splits):
    """``splits`` as a list of ints (Horovod: a ValueError for anything else)."""
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype.is_complex or splits.dtype == torch.bool:
            raise ValueError(f"splits must hold integers (torch.int32 in Horovod); got a tensor of {splits.dtype}")
        if splits.dim() != 1:
            raise ValueError(f"splits must be a 1-D tensor or a sequence of integers; got shape {tuple(splits.shape)}")
        return [int(v) for v in splits.tolist()]
    if isinstance(splits, (list, tuple, np.ndarray)):
        values = list(splits)
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
            raise ValueError(f"splits must be a sequence of integers; got {splits!r}")
        return [int(v) for v in values]
    raise ValueError(f"splits must be None, a 1-D integer tensor or a sequence of integers; got "
                     f"{type(splits).__name__}")


def _alltoall_call(tensor, splits, name, hset):
    """Queue sending ``splits[j]`` rows of ``tensor`` to set rank j (checked here)."""
    p = hset.comm.size
    values = None if splits is None else _split_values(splits)
    if tensor.dim() == 0:
        raise ValueError("alltoall: tensor must have at least one dimension (alltoall splits dimension 0); got a "
                         "0-d tensor")
    rows = tensor.shape[0]
    if values is None:
        if rows % p:
            raise ValueError(f"alltoall: splits is None, so the first dimension of tensor ({rows}) must be a "
                             f"multiple of the number of ranks ({p})")
        send = [rows // p] * p
    elif len(values) != p:
        raise ValueError(f"alltoall: splits must have one entry per rank of the process set ({p}); got {len(values)}")
    elif min(values) < 0:
        raise ValueError(f"alltoall: splits must not be negative; got {values}")
    elif sum(values) > rows:
        raise ValueError(f"alltoall: splits add up to {sum(values)}, more than the first dimension of tensor ({rows})")
    else:
        send = values
    like = splits if isinstance(splits, torch.Tensor) else None

    def start(everyone):
        comm = hset.comm
        recv = [int(n) for n in comm.alltoall(np.array(send, np.int64).reshape(p, 1)).ravel()]
        output = tensor.new_empty((sum(recv), *tensor.shape[1:]))
        handle = comm.alltoallv_async(_array(tensor.narrow(0, 0, sum(send))), send, recv, out=_array(output))
        received = torch.tensor(recv, dtype=like.dtype if like is not None else torch.int32,
                                device=like.device if like is not None else "cpu")
        return [handle], lambda: (output, received)

    record = _record("alltoall", name, tensor, extra=_beyond_first(tensor))
    return _enqueue("alltoall", hset, name, record, start)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Start sending ``splits[j]`` rows of ``tensor`` (dimension 0, in order) to rank j
    of the process set (``splits=None``: equal parts); returns a handle whose
    :func:`synchronize` gives ``(received tensor, received splits)``."""
    hset = _set_of(process_set)
    _check_name(name)
    return _Handle("alltoall", [_alltoall_call(_check_tensor(tensor), splits, name, hset)])


class _AlltoallFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, hset):
        output, received = _Handle("alltoall", [_alltoall_call(tensor, splits, name, hset)])._wait()
        ctx.received, ctx.rows, ctx.hset = received, tensor.shape[0], hset
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _):
        # Horovod's gradient: the gradients sent back where their rows came from
        back, _ = _Handle("alltoall", [_alltoall_call(grad.contiguous(), ctx.received, None, ctx.hset)])._wait()
        if back.shape[0] < ctx.rows:  # rows beyond sum(splits) were not sent
            back = torch.cat([back, back.new_zeros((ctx.rows - back.shape[0], *back.shape[1:]))])
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send ``splits[j]`` rows of ``tensor`` (dimension 0, in order) to rank j of the
    process set and return the rows received, in rank order; with ``splits`` also how
    many came from each rank (``(tensor, received_splits)``). Without ``splits``,
    dimension 0 is cut into equal parts. Differentiable."""
    hset = _set_of(process_set)
    _check_name(name)
    output, received = _AlltoallFunction.apply(_check_tensor(tensor), splits, name, hset)
    return output if splits is None else (output, received)


# -- reducescatter --------------------------------------------------------------------------------
def _reducescatter_call(tensor, op, prescale, postscale, name, hset):
    """Queue reducing ``tensor`` and keeping this rank's rows of the result."""
    if tensor.dim() == 0:
        raise ValueError("reducescatter: tensor must have at least one dimension (its rows are scattered)")

    def start(everyone):
        comm = hset.comm
        p, n = comm.size, tensor.shape[0]
        first = comm.rank * (n // p) + min(comm.rank, n % p)  # the first n % p ranks get one row more
        count = n // p + (comm.rank < n % p)
        source = tensor
        if prescale != 1.0:
            source = _scale_(tensor.detach().clone(memory_format=torch.contiguous_format), prescale)
        if n % p == 0:  # the library's blocks are whole rows
            output = tensor.new_empty((count, *tensor.shape[1:]))
            handle = comm.reduce_scatter_async(_array(source), op=_library_op(op, tensor), out=_array(output.view(-1)))
            return [handle], lambda: _finish_reduction(output, op, postscale, p)
        full = torch.empty_like(tensor, memory_format=torch.contiguous_format)  # else: reduce all, keep our rows
        handle = comm.allreduce_async(_array(source), op=_library_op(op, tensor), out=_array(full))
        return [handle], lambda: _finish_reduction(full.narrow(0, first, count).clone(), op, postscale, p)

    record = _record("reducescatter", name, tensor, op=op, prescale=prescale, postscale=postscale)
    return _enqueue("reducescatter", hset, name, record, start)


def _reducescatter_args(name, op, process_set, prescale_factor, postscale_factor):
    hset = _set_of(process_set)
    _check_name(name)
    return (hset, _resolve_op(op, None), _check_factor(prescale_factor, "prescale_factor"),
            _check_factor(postscale_factor, "postscale_factor"))


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Start reducing ``tensor`` over the ranks and keeping this rank's rows of the result
    (dimension 0 split as Horovod splits it); returns a handle."""
    hset, op, pre, post = _reducescatter_args(name, op, process_set, prescale_factor, postscale_factor)
    _check_reducible(_check_tensor(tensor), op)
    return _Handle("reducescatter", [_reducescatter_call(tensor, op, pre, post, name, hset)])


class _ReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, name, hset):
        ctx.args = (op, prescale, postscale, hset)
        return _Handle("reducescatter", [_reducescatter_call(tensor, op, prescale, postscale, name, hset)])._wait()

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, hset = ctx.args  # Horovod's gradient: the gathered gradients, scaled
        factor = (hset.comm.size if op is Sum else 1) * prescale * postscale
        grad = grad * factor if factor != 1 else grad
        return _AllgatherFunction.apply(grad.contiguous(), None, hset), None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """``tensor`` reduced over the ranks, this rank's rows of it: the first ``n % size``
    ranks get ``n // size + 1`` rows, the others ``n // size``. Differentiable."""
    compression = Compression.none if compression is None else compression
    _check_compressor(compression)
    hset, op, pre, post = _reducescatter_args(name, op, process_set, prescale_factor, postscale_factor)
    _check_reducible(_check_tensor(tensor), op)
    if tensor.dim() == 0:
        raise ValueError("reducescatter: tensor must have at least one dimension (its rows are scattered)")
    compressed, context = compression.compress(tensor)
    return compression.decompress(_ReducescatterFunction.apply(compressed, op, pre, post, name, hset), context)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    tensors = _check_tensors(tensors)
    hset, op, pre, post = _reducescatter_args(name, op, process_set, prescale_factor, postscale_factor)
    for i, tensor in enumerate(tensors):
        _check_reducible(tensor, op, f"tensors[{i}]")
        if tensor.dim() == 0:
            raise ValueError(f"reducescatter: tensors[{i}] must have at least one dimension (its rows are scattered)")
    return _Handle("grouped_reducescatter", [_reducescatter_call(t, op, pre, post, n, hset) for t, n in
                                             zip(tensors, _group_names(name, len(tensors)))], list)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0):
    tensors = _check_tensors(tensors)
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return [reducescatter(t, n, compression, op, process_set, prescale_factor, postscale_factor)
                for t, n in zip(tensors, _group_names(name, len(tensors)))]
    compression = Compression.none if compression is None else compression
    _check_compressor(compression)
    compressed, contexts = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    reduced = grouped_reducescatter_async(list(compressed), name, op, process_set, prescale_factor,
                                          postscale_factor)._wait()
    return [compression.decompress(t, c) for t, c in zip(reduced, contexts)]


# -- barrier and join ------------------------------------------------------------------------------
def barrier(process_set=global_process_set):
    """Wait until every rank of the process set has called it. Calls still queued stay
    queued (as in Horovod, a barrier does not order them)."""
    hset = _set_of(process_set)
    _negotiate(hset, _record("barrier"))
    hset.comm.barrier()


def join(device=-1):
    """This rank has no more data (Horovod's join, over every rank): until every rank
    has joined, take part in the others' calls: their allreduces with zeros, their
    barriers and their ``DistributedOptimizer`` steps (allgather, broadcast, alltoall
    and reducescatter raise on their ranks meanwhile). Returns the rank that joined last
    (the highest of those that joined in the last round), the same on every rank.
    ``device``: the GPU for the zeros of CUDA allreduces (default: the current one)."""
    state = runtime.initialized()
    if not state.check:
        raise ValueError("hvd.join needs negotiation, which COLLECTIVES_HOROVOD_CHECK=0 turned off")
    if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
        raise TypeError(f"device must be an int (-1: CPU, else a GPU index); got {device!r}")
    start_queued()
    for call in list(state.running):  # its calls run to the end first: the others may wait for them
        call.complete()
    hset = state.sets[0]
    joined_at = hset.rounds
    while True:
        everyone = hset.comm.allgather(_record("join", extra=joined_at))
        hset.rounds += 1
        join_kind = _KINDS.index("join")
        waiting = [i for i in range(len(everyone)) if everyone[i, KIND] != join_kind]
        if not waiting:  # the last round: the rank that joined last, the highest of them if several
            last = max(range(len(everyone)), key=lambda i: (int(everyone[i, EXTRA]), i))
            return hset.ranks[last]
        _serve(hset, everyone, waiting, device)


def _serve(hset, everyone, waiting, device):
    """A joined rank's part in the others' call, as their records describe it."""
    record = everyone[waiting[0]]
    kind = _KINDS[int(record[KIND])]
    if any(everyone[i, KIND] != record[KIND] for i in waiting):
        return  # they disagree among themselves: they raise, nothing moves
    if kind == "allreduce":
        dtype = _DTYPES[int(record[DTYPE])]
        ndim = int(record[NDIM])
        shape = [int(n) for n in record[SHAPE:SHAPE + ndim]] if ndim <= _SHOWN_DIMS else [int(record[NUMEL])]
        where = "cpu"
        if record[DEVICE] == 1:
            where = torch.device("cuda", device if device >= 0 else torch.cuda.current_device())
        zeros = torch.zeros(shape, dtype=dtype, device=where)
        op = _OPS[int(record[OP])]
        # the others' call is non-blocking: so is this one (MPI never matches the two forms)
        hset.comm.allreduce_async(_array(zeros), op=_library_op(op, zeros), out=_array(zeros)).wait()
    elif kind == "barrier":
        hset.comm.barrier()
    elif kind == "optimizer step":
        serve_step = runtime.current().optimizer_steps[int(record[EXTRA])]()
        if serve_step is None:
            raise CollectiveError(f"join: the other ranks step DistributedOptimizer #{int(record[EXTRA])}, which "
                                  "this rank no longer has")
        serve_step()
    # anything else raises on the ranks that have not joined: nothing moves

