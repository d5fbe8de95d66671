"""Horovod's PyTorch API (``horovod.torch``) on the collectives.

    import collectives.horovod.torch as hvd     # instead of: import horovod.torch as hvd

    hvd.init()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16)

Launch with ``mpiexec -n N python train.py`` (there is no ``horovodrun``). The names,
arguments, defaults and results are Horovod's; underneath, every collective is a call of
one :class:`collectives.Communicator` (its algorithms, ``COLLECTIVES_*`` settings, check
mode and timeouts apply), and the training calls are :mod:`collectives.torch`'s:
``DistributedOptimizer`` is ``collectives.torch.DistributedOptimizer`` (fused buckets
overlapped with backward), ``broadcast_parameters`` and ``broadcast_optimizer_state``
are that module's. CPU tensors are shared with the library without copies; CUDA
tensors go through its device path (CuPy).

What maps:

- ``init(comm=None)`` (``comm``: an mpi4py intracommunicator, default
  ``MPI.COMM_WORLD``), ``shutdown``, ``is_initialized``, ``size``, ``rank``,
  ``local_size``/``local_rank`` (the ranks on this node: ``MPI_Comm_split_type`` with
  ``MPI_COMM_TYPE_SHARED``, ordered by rank), ``cross_size``/``cross_rank`` (among the
  ranks with this local rank), ``is_homogeneous``, ``mpi_threads_supported``, the
  ``*_built``/``*_enabled`` queries.
- Ops ``Average`` (the default), ``Sum``, ``Min``, ``Max``, ``Product``; the legacy
  ``average=`` argument (with Horovod's DeprecationWarning; ``op`` and ``average``
  together are a ValueError). ``prescale_factor`` multiplies each rank's input before
  the reduction, ``postscale_factor`` the result after it; as in Horovod, integer
  tensors are scaled in double precision and truncated, and an integer ``Average`` is
  the sum divided by the world size, truncated toward zero.
- ``allreduce`` (with ``compression=``), ``allreduce_`` (in place),
  ``allreduce_async``, ``allreduce_async_``; ``grouped_allreduce`` and its
  ``_``/``_async``/``_async_`` twins (one call per tensor, all in flight together);
  ``allgather`` (concatenated along dimension 0, whose size may differ between ranks),
  ``allgather_async``, ``grouped_allgather(_async)``; ``broadcast``, ``broadcast_``,
  ``broadcast_async``, ``broadcast_async_``; ``alltoall(tensor, splits=None)`` (without
  ``splits`` the first dimension is cut in equal parts and the received tensor is
  returned; with ``splits`` it returns ``(received tensor, received splits)``),
  ``alltoall_async``; ``reducescatter`` (rows of dimension 0 split as Horovod splits
  them: the first ``n % size`` ranks get one more), ``reducescatter_async``,
  ``grouped_reducescatter(_async)``; ``barrier``; ``poll(handle)`` and
  ``synchronize(handle)`` for every ``*_async`` handle (``synchronize`` of an alltoall
  handle gives ``(tensor, received splits)``, of a grouped one a list).
  ``allreduce``, ``allgather``, ``broadcast``, ``alltoall`` and ``reducescatter`` are
  differentiable with Horovod's gradients (e.g. allgather's is the averaged gradient's
  slice of this rank).
- ``broadcast_parameters``, ``broadcast_optimizer_state``, ``broadcast_object``,
  ``allgather_object``.
- ``DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
  backward_passes_per_step=1, op=Average, ...)`` with ``synchronize()``,
  ``skip_synchronize()`` and ``set_backward_passes_per_step()``; ``op=Sum`` sums the
  gradients. As in Horovod, a parameter whose gradient backward did not produce on a
  rank is reduced anyway at ``step()`` (as zeros if it has no ``.grad``), so ranks whose
  forward passes use different parameters still match.
- ``Compression.none`` and ``Compression.fp16`` (``Compressor`` classes with static
  ``compress``/``decompress``). ``allreduce(compression=)`` calls them around the
  reduction, so custom compressors work there. ``DistributedOptimizer`` maps them onto
  the adapter's bucket compression (``None``/``"fp16"``: each bucket is divided by the
  world size, summed in float16, cast back); a custom compressor there is a ValueError.
- ``HorovodInternalError`` is :class:`collectives.CollectiveError`, the base of the
  library's failures (timeouts, mismatched calls, dead peers).

Differences from Horovod:

- Calls are matched by their order, not by ``name`` (accepted and checked to be a
  string, otherwise unused): every rank must make the same calls in the same order, as
  with MPI. Horovod's coordinator also matches calls issued in different orders.
- ``allgather``, ``alltoall`` and ``allgather_object`` exchange the ranks' sizes first
  (a small allgather or alltoall, finished before the call returns, async or not); a
  bad shape or ``splits`` on one rank then raises on every rank, before any data moves.
- ``broadcast_optimizer_state`` does not take the zero-gradient optimizer step Horovod
  takes to create the state of a fresh optimizer (it would start Adam's step count at
  1): a state-less optimizer's hyperparameters are broadcast and its state stays empty.
  ``model=`` is accepted and unused.
- ``broadcast_object`` and ``allgather_object`` pickle with :mod:`pickle`, not
  cloudpickle (lambdas and local classes cannot go).
- ``DistributedOptimizer``: ``gradient_predivide_factor`` (which in Horovod only
  splits the division by the world size into a part before and a part after the sum)
  and ``groups``/``num_groups`` (explicit fusion) are checked as Horovod checks them and
  otherwise left to the adapter, whose buckets fuse the gradients and, with fp16,
  divide before the sum; the average is the same up to rounding. ``step()`` after
  ``synchronize()`` does not reduce again (nor warn); ``step(closure)`` is refused.
  fp16 compression needs float32/float64 parameters.

Not implemented (each raises ``NotImplementedError`` naming it): process sets other than
``global_process_set`` (``ProcessSet``, ``add_process_set``, ``remove_process_set``,
``init(process_sets=)``, ``process_set=`` anything else), ``init(comm=<list of
ranks>)``, ``join``, ``op=Adasum``, ``sparse_allreduce_async`` (sparse tensors are
refused with a TypeError; ``sparse_as_dense`` is accepted, but sparse gradients are
not supported), ``SyncBatchNorm``, ``elastic``, ``start_timeline``/``stop_timeline``.
"""

import contextlib
import importlib.util
import pickle
import warnings
import zlib

import numpy as np
import torch
from mpi4py import MPI

from .. import torch as cct
from ...communicator import Communicator
from ...errors import CollectiveError
from ..tensors import BFLOAT16 as _BFLOAT16, to_array, torch_stream

HorovodInternalError = CollectiveError

__all__ = [
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "Compression", "Compressor", "DistributedOptimizer",
    "FP16Compressor", "HorovodInternalError", "NoneCompressor", "ProcessSet", "SyncBatchNorm", "add_process_set",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "ccl_built",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built", "gloo_enabled",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
    "init", "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async",
    "remove_process_set", "rocm_built", "shutdown", "size", "sparse_allreduce_async", "start_timeline",
    "stop_timeline", "synchronize",
]


# -- init and topology ----------------------------------------------------------------------
class _State:
    def __init__(self, comm, local_rank, local_size, cross_rank, cross_size, homogeneous):
        self.comm = comm
        self.local_rank, self.local_size = local_rank, local_size
        self.cross_rank, self.cross_size = cross_rank, cross_size
        self.homogeneous = homogeneous


_state = None


def init(comm=None, process_sets=None):
    """Start: every later call works over ``comm`` (an mpi4py intracommunicator; default
    ``MPI.COMM_WORLD``). Collective. Calling it again does nothing, as in Horovod."""
    global _state
    if process_sets is not None and (not isinstance(process_sets, (list, tuple)) or len(process_sets)):
        raise NotImplementedError("init(process_sets=...): process sets are not implemented by "
                                  "collectives.horovod; only the global process set exists")
    if comm is None:
        comm = MPI.COMM_WORLD
    if isinstance(comm, (list, tuple, range)):
        raise NotImplementedError("init(comm=<list of ranks>) is not implemented by collectives.horovod: pass an "
                                  "mpi4py communicator of those ranks instead (MPI.COMM_WORLD.Split or Create_group)")
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise ValueError(f"Invalid type of argument comm: expected an mpi4py intracommunicator or None; got {comm!r}")
    if _state is not None:
        return
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    cross = comm.Split(color=local_rank, key=comm.Get_rank())
    cross_rank, cross_size = cross.Get_rank(), cross.Get_size()
    cross.Free()
    homogeneous = len(set(comm.allgather(local_size))) == 1
    _state = _State(Communicator(comm), local_rank, local_size, cross_rank, cross_size, homogeneous)


def shutdown():
    """Release the communicator (collective); :func:`init` may be called again after."""
    global _state
    if _state is not None:
        state, _state = _state, None
        state.comm.free()


def is_initialized():
    return _state is not None


def _initialized():
    if _state is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _state


def _comm():
    return _initialized().comm


def size():
    """The number of processes."""
    return _comm().size


def rank():
    """This process's rank, 0 .. size() - 1."""
    return _comm().rank


def local_size():
    """The number of processes on this node."""
    return _initialized().local_size


def local_rank():
    """This process's rank among those on its node (in the order of their ranks)."""
    return _initialized().local_rank


def cross_size():
    """The number of processes with this process's local rank (one per node that has one)."""
    return _initialized().cross_size


def cross_rank():
    """This process's rank among the processes with its local rank (its node's index)."""
    return _initialized().cross_rank


def is_homogeneous():
    """Whether every node runs the same number of processes."""
    return _initialized().homogeneous


def mpi_threads_supported():
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_built(verbose=False):
    return True


def mpi_enabled():
    return True


def gloo_built(verbose=False):
    return False


def gloo_enabled():
    return False


def nccl_built(verbose=False):
    return False


def ddl_built(verbose=False):
    return False


def ccl_built(verbose=False):
    return False


def rocm_built(verbose=False):
    return False


def cuda_built(verbose=False):
    """Whether CUDA tensors can be used: the library's device path needs CuPy."""
    return importlib.util.find_spec("cupy") is not None


def start_timeline(file_path, mark_cycles=False):
    raise NotImplementedError("hvd.start_timeline is not implemented by collectives.horovod")


def stop_timeline():
    raise NotImplementedError("hvd.stop_timeline is not implemented by collectives.horovod")


# -- process sets: only the global one -------------------------------------------------------
class ProcessSet:
    """Horovod's process sets are not implemented: only :data:`global_process_set` exists."""

    def __init__(self, ranks_or_comm=None):
        raise NotImplementedError("hvd.ProcessSet: process sets are not implemented by collectives.horovod; only "
                                  "hvd.global_process_set exists")

    process_set_id = 0

    @property
    def ranks(self):
        return list(range(size()))

    def size(self):
        return size()

    def rank(self):
        return rank()

    def included(self):
        return True

    def __repr__(self):
        return "ProcessSet(global)"


global_process_set = object.__new__(ProcessSet)


def add_process_set(process_set):
    raise NotImplementedError("hvd.add_process_set: process sets are not implemented by collectives.horovod")


def remove_process_set(process_set):
    raise NotImplementedError("hvd.remove_process_set: process sets are not implemented by collectives.horovod")


def _check_process_set(process_set):
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError(f"process_set={process_set!r}: process sets are not implemented by "
                                  "collectives.horovod; pass hvd.global_process_set (the default)")


def join(device=-1):
    raise NotImplementedError("hvd.join is not implemented by collectives.horovod: every rank must take the same "
                              "number of steps (shard the data evenly, e.g. with DistributedSampler)")


def sparse_allreduce_async(tensor, name, op, process_set=None):
    raise NotImplementedError("hvd.sparse_allreduce_async: sparse tensors are not implemented by "
                              "collectives.horovod")


class SyncBatchNorm:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("hvd.SyncBatchNorm is not implemented by collectives.horovod")


class _NotImplementedAttribute(AttributeError, NotImplementedError):
    """A Horovod name this module does not implement (``hasattr`` still answers False)."""


def __getattr__(name):
    if name == "elastic":
        raise _NotImplementedAttribute("hvd.elastic (elastic training) is not implemented by collectives.horovod")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- ops ----------------------------------------------------------------------------------
class _ReduceOp:
    """A reduction op (``hvd.Average``, ``hvd.Sum`` ...)."""

    __slots__ = ("name", "library")

    def __init__(self, name, library):
        self.name, self.library = name, library  # library: the Communicator's op name

    def __repr__(self):
        return f"hvd.{self.name}"

    def __reduce__(self):
        return self.name  # pickled by reference: the module's own object comes back


Average = _ReduceOp("Average", "avg")
Sum = _ReduceOp("Sum", "sum")
Min = _ReduceOp("Min", "min")
Max = _ReduceOp("Max", "max")
Product = _ReduceOp("Product", "prod")
Adasum = _ReduceOp("Adasum", None)
_OPS = (Average, Sum, Min, Max, Product)


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


# -- compression ----------------------------------------------------------------------------------
class Compressor:
    """Horovod's compression interface: ``compress(tensor) -> (tensor, context)`` and
    ``decompress(tensor, context) -> tensor``, both static."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression: the tensor as it is."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors sent as float16 and cast back; others as they are."""

    @staticmethod
    def compress(tensor):
        return (tensor.to(torch.float16) if tensor.dtype.is_floating_point else tensor), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx) if ctx.is_floating_point and tensor.dtype != ctx else tensor


class Compression:
    """Gradient compression: ``Compression.none`` (the default) or ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


# -- argument checks ----------------------------------------------------------------------------
def _check_tensor(tensor, what="tensor"):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor; got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{what} is a sparse tensor ({tensor.layout}): sparse tensors are not implemented by "
                        "collectives.horovod")
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


def _check_root(root_rank):
    n = size()
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)) or not 0 <= root_rank < n:
        raise ValueError(f"root_rank must be a rank in 0..{n - 1}; got {root_rank!r}")
    return int(root_rank)


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


def _signature(tensor):
    """A number that differs between tensors whose dtype, device kind or shape beyond
    dimension 0 differ (compared across ranks by allgather and alltoall)."""
    return zlib.crc32(repr((str(tensor.dtype), tensor.device.type, tuple(tensor.shape[1:]))).encode())


def _describe(tensor):
    return f"shape {tuple(tensor.shape)}, dtype {str(tensor.dtype).replace('torch.', '')}"


def _ranks(ranks):
    return ", ".join(map(str, ranks))


# -- handles ------------------------------------------------------------------------------------
class _Handle:
    """What an ``*_async`` call returns: pass it to :func:`poll` or :func:`synchronize`."""

    __slots__ = ("what", "_parts", "_finish", "_done", "_result")

    def __init__(self, what, parts, finish):
        self.what = what
        self._parts = parts  # the library's handles
        self._finish = finish  # () -> the result, once the parts have finished
        self._done = False
        self._result = None

    def _test(self):
        return self._done or all(part.test() for part in self._parts)

    def _wait(self):
        if not self._done:
            for part in self._parts:
                part.wait()
            self._result = self._finish()
            self._done = True
            self._parts = []
        return self._result

    def __repr__(self):
        return f"<hvd handle: {self.what}{', done' if self._done else ''}>"


def _group(what, handles):
    return _Handle(what, [part for h in handles for part in h._parts], lambda: [h._wait() for h in handles])


def _check_handle(handle):
    if not isinstance(handle, _Handle):
        raise TypeError(f"handle must be what an hvd *_async call returned; got {type(handle).__name__}")
    return handle


def poll(handle):
    """Whether the call behind ``handle`` has finished (advancing it without blocking);
    then :func:`synchronize` returns at once."""
    return _check_handle(handle)._test()


def synchronize(handle):
    """Wait for the call behind ``handle`` and return its result (the same again if
    called twice)."""
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


def _allreduce_start(tensor, output, op, prescale, postscale):
    """Start reducing ``tensor`` into ``output`` (``tensor`` itself: in place)."""
    comm = _comm()
    _check_reducible(tensor, op)
    source = tensor
    if prescale != 1.0:  # the input is left alone (out of place): scaled in the output
        if output is not tensor:
            output.copy_(tensor.detach())
        source = _scale_(output, prescale)
    handle = comm.allreduce_async(_array(source), op=_library_op(op, tensor), out=_array(output))
    return _Handle("allreduce", [handle], lambda: _finish_reduction(output, op, postscale, comm.size))


def _allreduce_args(tensor, average, name, op, prescale_factor, postscale_factor, process_set):
    _check_process_set(process_set)
    _check_name(name)
    _check_tensor(tensor)
    return (_resolve_op(op, average), _check_factor(prescale_factor, "prescale_factor"),
            _check_factor(postscale_factor, "postscale_factor"))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    """Start reducing ``tensor`` over the ranks (``op``: default ``Average``) into a new
    tensor; returns a handle for :func:`synchronize`. ``tensor`` is not modified."""
    op, pre, post = _allreduce_args(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    return _allreduce_start(tensor, torch.empty_like(tensor, memory_format=torch.contiguous_format), op, pre, post)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    """Start reducing ``tensor`` over the ranks in place; returns a handle."""
    op, pre, post = _allreduce_args(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    return _allreduce_start(tensor, tensor, op, pre, post)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Reduce ``tensor`` over the ranks in place; returns it."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)._wait()


class _AllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale):
        ctx.args = (op, prescale, postscale)
        output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        return _allreduce_start(tensor, output, op, prescale, postscale)._wait()

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale = ctx.args  # Horovod's gradient: the same reduction of the gradients
        return _AllreduceFunction.apply(grad, op, prescale, postscale), None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """``tensor`` reduced over the ranks (``op``: default ``Average``), a new tensor;
    ``compression`` compresses it before and decompresses the result after.
    Differentiable."""
    compression = Compression.none if compression is None else compression
    _check_compressor(compression)
    op, pre, post = _allreduce_args(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    compressed, context = compression.compress(tensor)
    return compression.decompress(_AllreduceFunction.apply(compressed, op, pre, post), context)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set):
    """:func:`allreduce_async` of every tensor of the list, in flight together; one handle
    whose :func:`synchronize` gives the list of results."""
    tensors = _check_tensors(tensors)
    op, pre, post = _allreduce_args(torch.empty(0), average, name, op, prescale_factor, postscale_factor,
                                    process_set)
    for i, tensor in enumerate(tensors):
        _check_reducible(tensor, op, f"tensors[{i}]")
    outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    return _group("grouped_allreduce", [_allreduce_start(t, o, op, pre, post) for t, o in zip(tensors, outputs)])


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set):
    """:func:`allreduce_async_` of every tensor of the list (in place), in flight together."""
    tensors = _check_tensors(tensors)
    op, pre, post = _allreduce_args(torch.empty(0), average, name, op, prescale_factor, postscale_factor,
                                    process_set)
    for i, tensor in enumerate(tensors):
        _check_reducible(tensor, op, f"tensors[{i}]")
    return _group("grouped_allreduce", [_allreduce_start(t, t, op, pre, post) for t in tensors])


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                    process_set)._wait()


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    """The list of ``tensors`` each reduced over the ranks (new tensors). Differentiable."""
    tensors = _check_tensors(tensors)
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():  # one differentiable call each
        return [allreduce(t, average, name, compression, op, prescale_factor, postscale_factor, process_set)
                for t in tensors]
    compression = Compression.none if compression is None else compression
    _check_compressor(compression)
    compressed, contexts = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    reduced = grouped_allreduce_async(list(compressed), average, name, op, prescale_factor, postscale_factor,
                                      process_set)._wait()
    return [compression.decompress(t, c) for t, c in zip(reduced, contexts)]


# -- allgather ----------------------------------------------------------------------------------
def _agree_on_rows(comm, tensor, collective):
    """Every rank's first dimension (an allgather of a small descriptor); raises on every
    rank if any rank passed a 0-d tensor or a tensor whose dtype or shape beyond
    dimension 0 differs from rank 0's."""
    descriptor = np.array([tensor.dim(), tensor.shape[0] if tensor.dim() else 0, _signature(tensor)], np.int64)
    everyone = comm.allgather(descriptor)
    scalar = [r for r in range(comm.size) if everyone[r, 0] == 0]
    if scalar:
        raise ValueError(f"{collective}: tensor must have at least one dimension ({collective} concatenates along "
                         f"dimension 0); rank(s) {_ranks(scalar)} passed a 0-d tensor")
    differ = [r for r in range(comm.size) if everyone[r, 2] != everyone[0, 2] or everyone[r, 0] != everyone[0, 0]]
    if differ:
        raise ValueError(f"{collective}: the tensors must have the same dtype and the same shape beyond dimension 0 "
                         f"on every rank; rank(s) {_ranks(differ)} differ from rank 0 (here on rank {comm.rank}: "
                         f"{_describe(tensor)})")
    return [int(n) for n in everyone[:, 1]]


def _allgather_start(tensor):
    comm = _comm()
    rows = _agree_on_rows(comm, tensor, "allgather")
    n, rest = rows[comm.rank], tuple(tensor.shape[1:])
    output = tensor.new_empty((sum(rows), *rest))
    if len(set(rows)) == 1:  # straight into the output
        handle = comm.allgather_async(_array(tensor), out=_array(output.view(comm.size, n, *rest)))
        return _Handle("allgather", [handle], lambda: output), rows
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

    return _Handle("allgather", [handle], finish), rows


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start concatenating every rank's ``tensor`` along dimension 0 (whose size may
    differ between ranks); returns a handle. The sizes are exchanged before it returns."""
    _check_process_set(process_set)
    _check_name(name)
    return _allgather_start(_check_tensor(tensor))[0]


class _AllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        handle, rows = _allgather_start(tensor)
        here = _comm().rank
        ctx.offset, ctx.rows = sum(rows[:here]), rows[here]
        return handle._wait()

    @staticmethod
    def backward(ctx, grad):
        # Horovod's gradient: this rank's slice of the gradients averaged over the ranks
        averaged = _AllreduceFunction.apply(grad, Average, 1.0, 1.0)
        return averaged.narrow(0, ctx.offset, ctx.rows)


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated along dimension 0, in rank order (the sizes
    of dimension 0 may differ; the rest of the shape and the dtype must not).
    Differentiable."""
    _check_process_set(process_set)
    _check_name(name)
    return _AllgatherFunction.apply(_check_tensor(tensor))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    _check_process_set(process_set)
    _check_name(name)
    return _group("grouped_allgather", [_allgather_start(t)[0] for t in _check_tensors(tensors)])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    tensors = _check_tensors(tensors)
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return [allgather(t, name, process_set) for t in tensors]
    return grouped_allgather_async(tensors, name, process_set)._wait()


# -- broadcast ----------------------------------------------------------------------------------
def _broadcast_start(tensor, root, inplace):
    comm = _comm()
    if inplace:
        output = tensor
    elif comm.rank == root:
        output = tensor.detach().clone(memory_format=torch.contiguous_format)
    else:
        output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    handle = comm.broadcast_async(_array(output), root=root)
    return _Handle("broadcast", [handle], lambda: output)


def _broadcast_args(tensor, root_rank, name, process_set):
    _check_process_set(process_set)
    _check_name(name)
    _check_tensor(tensor)
    return _check_root(root_rank)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Start copying rank ``root_rank``'s ``tensor`` into a new tensor on every rank."""
    return _broadcast_start(tensor, _broadcast_args(tensor, root_rank, name, process_set), False)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Start overwriting ``tensor`` on every rank with rank ``root_rank``'s, in place."""
    return _broadcast_start(tensor, _broadcast_args(tensor, root_rank, name, process_set), True)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with rank ``root_rank``'s, in place; returns it."""
    return broadcast_async_(tensor, root_rank, name, process_set)._wait()


class _BroadcastFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root):
        ctx.root = root
        return _broadcast_start(tensor, root, False)._wait()

    @staticmethod
    def backward(ctx, grad):
        # Horovod's gradient: the averaged gradient on the root, zero elsewhere
        averaged = _AllreduceFunction.apply(grad, Average, 1.0, 1.0)
        return (averaged if rank() == ctx.root else torch.zeros_like(averaged)), None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Rank ``root_rank``'s ``tensor``, as a new tensor on every rank (``tensor`` is not
    modified). Differentiable."""
    return _BroadcastFunction.apply(tensor, _broadcast_args(tensor, root_rank, name, process_set))


# -- alltoall -----------------------------------------------------------------------------------
def _split_values(splits):
    """``splits`` as a list of ints (type errors here; value errors are agreed on)."""
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype.is_complex or splits.dtype == torch.bool:
            raise TypeError(f"splits must hold integers; got a tensor of {splits.dtype}")
        if splits.dim() != 1:
            raise TypeError(f"splits must be a 1-D tensor or a sequence of integers; got shape {tuple(splits.shape)}")
        return [int(v) for v in splits.tolist()]
    if isinstance(splits, (list, tuple, np.ndarray)):
        values = list(splits)
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
            raise TypeError(f"splits must be a sequence of integers; got {splits!r}")
        return [int(v) for v in values]
    raise TypeError(f"splits must be None, a 1-D integer tensor or a sequence of integers; got {type(splits).__name__}")


def _alltoall_start(tensor, splits):
    comm = _comm()
    p = comm.size
    values = None if splits is None else _split_values(splits)
    rows = tensor.shape[0] if tensor.dim() else 0
    problem = None
    if tensor.dim() == 0:
        problem = "tensor must have at least one dimension (alltoall splits dimension 0); got a 0-d tensor"
    elif values is None:
        if rows % p:
            problem = (f"splits is None, so the first dimension of tensor ({rows}) must be a multiple of the number "
                       f"of ranks ({p})")
        send = [rows // p] * p
    elif len(values) != p:
        problem = f"splits must have one entry per rank ({p}); got {len(values)}"
    elif min(values) < 0:
        problem = f"splits must not be negative; got {values}"
    elif sum(values) > rows:
        problem = f"splits add up to {sum(values)}, more than the first dimension of tensor ({rows})"
    else:
        send = values
    # One small alltoall: row j tells rank j how many rows it gets from here, this rank's
    # tensor signature, and whether its arguments were bad (so every rank raises alike).
    table = np.zeros((p, 3), np.int64)
    if problem is None:
        table[:, 0] = send
        table[:, 1] = _signature(tensor)
    else:
        table[:, 2] = 1
    got = comm.alltoall(table)
    if problem is not None:
        raise ValueError(f"alltoall: {problem}")
    bad = [r for r in range(p) if got[r, 2]]
    if bad:
        raise ValueError(f"alltoall: rank(s) {_ranks(bad)} passed a bad tensor or splits (see the error there); no "
                         "data moved")
    differ = [r for r in range(p) if got[r, 1] != table[0, 1]]
    if differ:
        raise ValueError(f"alltoall: the tensors must have the same dtype and the same shape beyond dimension 0 on "
                         f"every rank; rank(s) {_ranks(differ)} differ from rank {comm.rank} (here: "
                         f"{_describe(tensor)})")
    recv = [int(n) for n in got[:, 0]]
    output = tensor.new_empty((sum(recv), *tensor.shape[1:]))
    handle = comm.alltoallv_async(_array(tensor.narrow(0, 0, sum(send))), send, recv, out=_array(output))
    like = splits if isinstance(splits, torch.Tensor) else None
    received = torch.tensor(recv, dtype=like.dtype if like is not None else torch.int32,
                            device=like.device if like is not None else "cpu")
    return _Handle("alltoall", [handle], lambda: (output, received))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Start sending ``splits[j]`` rows of ``tensor`` (dimension 0, in order) to rank j
    (``splits=None``: equal parts); returns a handle whose :func:`synchronize` gives
    ``(received tensor, received splits)``. The counts are exchanged before it returns."""
    _check_process_set(process_set)
    _check_name(name)
    return _alltoall_start(_check_tensor(tensor), splits)


class _AlltoallFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits):
        output, received = _alltoall_start(tensor, splits)._wait()
        ctx.received, ctx.rows = received, tensor.shape[0]
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _):
        # Horovod's gradient: the gradients sent back where their rows came from
        back, _ = _alltoall_start(grad.contiguous(), ctx.received)._wait()
        if back.shape[0] < ctx.rows:  # rows beyond sum(splits) were not sent
            back = torch.cat([back, back.new_zeros((ctx.rows - back.shape[0], *back.shape[1:]))])
        return back, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send ``splits[j]`` rows of ``tensor`` (dimension 0, in order) to rank j and return
    the rows received, in rank order; with ``splits`` also how many came from each rank
    (``(tensor, received_splits)``). Without ``splits``, dimension 0 is cut into
    equal parts. Differentiable."""
    _check_process_set(process_set)
    _check_name(name)
    output, received = _AlltoallFunction.apply(_check_tensor(tensor), splits)
    return output if splits is None else (output, received)


# -- reducescatter --------------------------------------------------------------------------------
def _reducescatter_start(tensor, op, prescale, postscale):
    comm = _comm()
    _check_reducible(tensor, op)
    if tensor.dim() == 0:
        raise ValueError("reducescatter: tensor must have at least one dimension (its rows are scattered)")
    p, n = comm.size, tensor.shape[0]
    start = comm.rank * (n // p) + min(comm.rank, n % p)  # the first n % p ranks get one row more
    count = n // p + (comm.rank < n % p)
    source = tensor
    if prescale != 1.0:
        source = _scale_(tensor.detach().clone(memory_format=torch.contiguous_format), prescale)
    if n % p == 0:  # the library's blocks are whole rows
        output = tensor.new_empty((count, *tensor.shape[1:]))
        handle = comm.reduce_scatter_async(_array(source), op=_library_op(op, tensor), out=_array(output.view(-1)))
        return _Handle("reducescatter", [handle], lambda: _finish_reduction(output, op, postscale, p))
    full = torch.empty_like(tensor, memory_format=torch.contiguous_format)  # else: reduce all, keep our rows
    handle = comm.allreduce_async(_array(source), op=_library_op(op, tensor), out=_array(full))
    return _Handle("reducescatter", [handle],
                   lambda: _finish_reduction(full.narrow(0, start, count).clone(), op, postscale, p))


def _reducescatter_args(tensor, name, op, process_set, prescale_factor, postscale_factor):
    _check_process_set(process_set)
    _check_name(name)
    _check_tensor(tensor)
    return (_resolve_op(op, None), _check_factor(prescale_factor, "prescale_factor"),
            _check_factor(postscale_factor, "postscale_factor"))


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Start reducing ``tensor`` over the ranks and keeping this rank's rows of the result
    (dimension 0 split as Horovod splits it); returns a handle."""
    op, pre, post = _reducescatter_args(tensor, name, op, process_set, prescale_factor, postscale_factor)
    return _reducescatter_start(tensor, op, pre, post)


class _ReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale):
        ctx.args = (op, prescale, postscale)
        return _reducescatter_start(tensor, op, prescale, postscale)._wait()

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale = ctx.args  # Horovod's gradient: the gathered gradients, scaled
        factor = (size() if op is Sum else 1) * prescale * postscale
        grad = grad * factor if factor != 1 else grad
        return _AllgatherFunction.apply(grad.contiguous()), None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """``tensor`` reduced over the ranks, this rank's rows of it: the first ``n % size``
    ranks get ``n // size + 1`` rows, the others ``n // size``. Differentiable."""
    compression = Compression.none if compression is None else compression
    _check_compressor(compression)
    op, pre, post = _reducescatter_args(tensor, name, op, process_set, prescale_factor, postscale_factor)
    compressed, context = compression.compress(tensor)
    return compression.decompress(_ReducescatterFunction.apply(compressed, op, pre, post), context)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    tensors = _check_tensors(tensors)
    op, pre, post = _reducescatter_args(torch.empty(0), name, op, process_set, prescale_factor, postscale_factor)
    return _group("grouped_reducescatter", [_reducescatter_start(t, op, pre, post) for t in tensors])


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0):
    tensors = _check_tensors(tensors)
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return [reducescatter(t, name, compression, op, process_set, prescale_factor, postscale_factor)
                for t in tensors]
    compression = Compression.none if compression is None else compression
    _check_compressor(compression)
    compressed, contexts = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    reduced = grouped_reducescatter_async(list(compressed), name, op, process_set, prescale_factor,
                                          postscale_factor)._wait()
    return [compression.decompress(t, c) for t, c in zip(reduced, contexts)]


def barrier(process_set=global_process_set):
    """Wait until every rank has called it."""
    _check_process_set(process_set)
    _comm().barrier()


# -- objects ------------------------------------------------------------------------------------
def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Rank ``root_rank``'s ``obj`` (pickled) on every rank."""
    _check_process_set(process_set)
    _check_name(name)
    return _comm().broadcast_object(obj, root=_check_root(root_rank))


def allgather_object(obj, name=None, process_set=global_process_set):
    """Every rank's ``obj`` (pickled), as a list in rank order."""
    _check_process_set(process_set)
    _check_name(name)
    comm = _comm()
    try:
        payload, problem = pickle.dumps(obj), None
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it, not wait for data
        payload, problem = b"", exc
    lengths = comm.allgather(np.array([len(payload) if problem is None else -1], np.int64)).ravel()
    failed = [r for r in range(comm.size) if lengths[r] < 0]
    if failed:
        raise TypeError(f"allgather_object: the object on rank(s) {_ranks(failed)} cannot be pickled") from problem
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    gathered = _allgather_start(data)[0]._wait().numpy()
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [pickle.loads(gathered[bounds[r]:bounds[r + 1]].tobytes()) for r in range(comm.size)]


# -- training -----------------------------------------------------------------------------------
def broadcast_parameters(params, root_rank):
    """Overwrite ``params`` on every rank with rank ``root_rank``'s, in place: a
    ``state_dict()``, ``named_parameters()``, ``parameters()`` or a list of tensors
    (``collectives.torch.broadcast_parameters``)."""
    if isinstance(params, torch.Tensor) or not (hasattr(params, "items") or hasattr(params, "__iter__")):
        raise ValueError(f"invalid params of type: {type(params).__name__} (pass a state_dict(), "
                         "named_parameters(), parameters() or a list of tensors)")
    cct.broadcast_parameters(params, root=_check_root(root_rank), comm=_comm())


def broadcast_optimizer_state(optimizer, root_rank, model=None):
    """Give every rank rank ``root_rank``'s optimizer state and hyperparameters
    (``collectives.torch.broadcast_optimizer_state``). ``model`` is not needed."""
    cct.broadcast_optimizer_state(optimizer, root=_check_root(root_rank), comm=_comm())


def _adapter_compression(compression):
    """The adapter's compression for a Horovod compressor (the class or an instance)."""
    kind = compression if isinstance(compression, type) else type(compression)
    if compression is None or kind is NoneCompressor:
        return None
    if kind is FP16Compressor:
        return "fp16"
    raise ValueError(f"compression must be hvd.Compression.none or hvd.Compression.fp16 for DistributedOptimizer; got "
                     f"{compression!r}: its gradients are compressed a bucket at a time, where a custom "
                     "Compressor cannot run")


class _HorovodOptimizer:
    """Horovod's methods on top of :func:`collectives.torch.DistributedOptimizer`'s."""

    @property
    def backward_passes_per_step(self):
        return self._reducer.backward_passes_per_step

    def synchronize(self):
        """Wait for the reduced gradients. As in Horovod, a parameter whose gradient has not
        arrived (backward did not reach it on this rank) is reduced with what its
        ``.grad`` holds, zeros if nothing."""
        reducer = self._reducer
        for name, left in reducer.missing().items():
            param = self._hvd_params[name]
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            with torch_stream(param):
                for _ in range(left):
                    reducer.gradient_ready(name, to_array(param.grad, name, "grad"))
        super().synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside does not synchronize (call :meth:`synchronize` before)."""
        self._hvd_skip = True
        try:
            yield
        finally:
            self._hvd_skip = False

    def step(self, closure=None):
        if self._hvd_skip:
            self._synchronized = False
            return super(cct._Distributed, self).step(closure)  # the wrapped optimizer's own step
        return super().step(closure)

    def set_backward_passes_per_step(self, passes):
        """Expect ``passes`` backward passes per step from the next step on."""
        if isinstance(passes, bool) or not isinstance(passes, (int, np.integer)) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be > 0; got {passes!r}")
        reducer = self._reducer
        if any(left != reducer.backward_passes_per_step for left in reducer.missing().values()) \
                or len(reducer.missing()) != len(reducer.names):
            raise ValueError("set_backward_passes_per_step during a step (some gradients were handed over already): "
                             "call it before the step's first backward pass")
        reducer.backward_passes_per_step = int(passes)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Wrap ``optimizer`` so that ``step()`` applies the gradients averaged (``op=Sum``:
    summed) over the ranks: :func:`collectives.torch.DistributedOptimizer`, with
    Horovod's arguments and its ``synchronize()``, ``skip_synchronize()`` and
    ``set_backward_passes_per_step()``. Collective."""
    comm = _comm()
    _check_process_set(process_set)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
    wire = _adapter_compression(compression)
    if op is Adasum:
        raise NotImplementedError("DistributedOptimizer(op=hvd.Adasum) is not implemented by collectives.horovod")
    if op not in (Average, Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum for DistributedOptimizer; got {op!r}")
    predivide = _check_factor(gradient_predivide_factor, "gradient_predivide_factor")
    if predivide <= 0:
        raise ValueError(f"gradient_predivide_factor must be positive; got {gradient_predivide_factor!r}")
    if predivide != 1.0 and op is not Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) or num_groups < 0:
        raise ValueError(f"num_groups must be a non-negative integer; got {num_groups!r}")
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=2)
    if groups is not None:
        if isinstance(groups, list):
            if not all(isinstance(g, (list, tuple)) and all(isinstance(p, torch.Tensor) for p in g) for g in groups):
                raise ValueError("groups must consist of torch.Tensor.")
        elif isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups <= 0:
            raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if not isinstance(sparse_as_dense, bool):
        raise TypeError(f"sparse_as_dense must be True or False; got {sparse_as_dense!r}")
    if named_parameters is None:
        named = [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(optimizer.param_groups)
                 for j, p in enumerate(group["params"])]
    else:
        named = list(named_parameters)
        if not all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) for item in named):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                             "model.named_parameters().")
    distributed = cct.DistributedOptimizer(optimizer, named_parameters=named, comm=comm,
                                           backward_passes_per_step=backward_passes_per_step, compression=wire,
                                           op=op.library)
    base = type(distributed)
    distributed.__class__ = type(base.__name__, (_HorovodOptimizer, base), {})
    reduced = set(distributed._reducer.names)
    distributed._hvd_params = {name: p for name, p in named if name in reduced}
    distributed._hvd_skip = False
    return distributed
