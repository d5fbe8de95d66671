"""Horovod's PyTorch API (``horovod.torch``) on the collectives:
``import collectives.horovod.torch as hvd`` in place of ``import horovod.torch as hvd``,
launched with ``mpiexec -n N python train.py``.

The package is laid out as Horovod's: :mod:`.basics` (``init``, ``size``, ``rank`` ...),
:mod:`.process_sets`, :mod:`.mpi_ops` (the collectives, ``synchronize``, ``join``),
:mod:`.functions` (``broadcast_parameters``, ``broadcast_optimizer_state``, objects),
:mod:`.optimizer` (``DistributedOptimizer``) and :mod:`.compression`. What maps, how
calls run and what differs from Horovod: docs/reference/horovod.md.
"""

from .basics import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    Product,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from .compression import Compression, Compressor, FP16Compressor, NoneCompressor
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from .optimizer import DistributedOptimizer
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .sync_batch_norm import SyncBatchNorm

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


class _NotImplementedAttribute(AttributeError, NotImplementedError):
    """A Horovod name this package does not implement (``hasattr`` still answers False)."""


def __getattr__(name):
    if name == "elastic":
        raise _NotImplementedAttribute("hvd.elastic (elastic training) is not implemented by collectives.horovod")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
