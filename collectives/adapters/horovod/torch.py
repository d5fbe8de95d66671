"""Horovod's PyTorch API (``horovod.torch``) on the collectives.

    import collectives.horovod.torch as hvd     # instead of: import horovod.torch as hvd

    hvd.init()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16)

Launch with ``mpiexec -n N python train.py`` (there is no ``horovodrun``). The names,
arguments, defaults, results and errors are Horovod's; underneath, every collective is
a call of a :class:`collectives.Communicator` (its algorithms, ``COLLECTIVES_*``
settings and timeouts apply). CPU tensors are shared with the library without copies;
CUDA tensors go through its device path (CuPy).

How calls run, as in Horovod:

- **Negotiation.** Before a call moves data, the ranks of its process set compare
  what they are calling (one allgather of 160 bytes per rank, Horovod's negotiation):
  the operation, the name, dtype, device, shape (all of it for allreduce, broadcast
  and reducescatter; beyond dimension 0 for allgather and alltoall), root, reduction
  op and scale factors. Where they differ, every rank raises
  :class:`collectives.CollectiveMismatchError` (an ``hvd.HorovodInternalError``, a
  ``RuntimeError``) with Horovod's words ("Mismatched data types: ...") and the ranks,
  and no data moves; the ranks carry on with their next call. This also serves
  :func:`join`. ``COLLECTIVES_HOROVOD_CHECK=0`` turns it off (then mismatched calls
  hang or mix data, as with MPI, and ``join`` raises); it costs one small allgather per
  call (measured in docs/guides/training.md).
- **Asynchronous calls start when waited for.** An ``*_async`` call checks its
  arguments and returns a handle at once; the call is queued, and every queued call
  starts, in call order, at the next :func:`synchronize` or :func:`poll` (of any
  handle), blocking call or :func:`join`. So, as in Horovod, a call made before a
  :func:`barrier` on one rank may meet the others' after theirs (a barrier neither
  starts nor waits for queued calls), and an error found by negotiation is raised by
  :func:`synchronize`. Calls are matched in the order each rank makes them (per
  process set), not by name: where the ranks' names differ, negotiation says so.
- **Names.** A call whose name is already in flight (queued or running) on this rank
  in the same process set raises ``ValueError``, as in Horovod.
- **Process sets.** :func:`add_process_set` (collective over every rank) makes a
  sub-communicator of the set's ranks; ``process_set=`` on every call runs it there.
  ``root_rank`` stays a global rank, as in Horovod. :func:`remove_process_set` frees it.
- **Join.** :func:`join` (uneven data): the ranks that joined take part in every
  allreduce of the others with zeros (an ``Average`` still divides by the full size),
  and in their barriers and optimizer steps; allgather, broadcast, alltoall and
  reducescatter raise while a rank has joined, as in Horovod. It returns the rank that
  joined last.

What maps:

- ``init(comm=None, process_sets=None)`` (``comm``: an mpi4py intracommunicator,
  default ``MPI.COMM_WORLD``; ``process_sets``: ``ProcessSet`` objects of rank lists),
  ``shutdown``, ``is_initialized``, ``size``, ``rank``, ``local_size``/``local_rank``
  (``MPI_Comm_split_type`` with ``MPI_COMM_TYPE_SHARED``, ordered by rank),
  ``cross_size``/``cross_rank``, ``is_homogeneous``, ``mpi_threads_supported``, the
  ``*_built``/``*_enabled`` queries; ``ProcessSet``, ``add_process_set``,
  ``remove_process_set``, ``global_process_set``.
- Ops ``Average`` (the default), ``Sum``, ``Min``, ``Max``, ``Product``; the legacy
  ``average=`` argument (with Horovod's DeprecationWarning). ``prescale_factor``
  multiplies each rank's input before the reduction, ``postscale_factor`` the result;
  integer tensors are scaled in double precision and truncated, and an integer
  ``Average`` is the sum divided by the set's size, truncated toward zero.
- ``allreduce`` (with ``compression=``), ``allreduce_``, ``allreduce_async``,
  ``allreduce_async_``, ``grouped_allreduce`` and its ``_``/``_async``/``_async_``
  twins; ``sparse_allreduce_async`` (Horovod's: an allgather of the indices and of the
  values; the handle is a function returning the sparse sum, or mean, not coalesced);
  ``allgather`` (along dimension 0, whose size may differ between ranks),
  ``allgather_async``, ``grouped_allgather(_async)``; ``broadcast``, ``broadcast_``,
  ``broadcast_async``, ``broadcast_async_``; ``alltoall(tensor, splits=None)``,
  ``alltoall_async``; ``reducescatter`` (rows split as Horovod splits them: the first
  ``n % size`` ranks get one more), ``reducescatter_async``,
  ``grouped_reducescatter(_async)``; ``barrier``; ``join``; ``poll`` and
  ``synchronize``. ``allreduce``, ``allgather``, ``broadcast``, ``alltoall`` and
  ``reducescatter`` are differentiable with Horovod's gradients.
- ``broadcast_parameters``, ``broadcast_optimizer_state`` (with Horovod's zero-gradient
  step that creates a fresh optimizer's state first), ``broadcast_object``,
  ``allgather_object``.
- ``DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
  backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0, num_groups=0,
  groups=None, sparse_as_dense=False, process_set=global_process_set)`` with
  ``synchronize()``, ``skip_synchronize()``, ``set_backward_passes_per_step()``: dense
  gradients are averaged in fused buckets (:class:`collectives.training.GradientReducer`,
  overlapped with backward from the second step on: the buckets are laid out at the
  first ``synchronize()``, once every rank knows which gradients are sparse); sparse
  gradients (``nn.Embedding(sparse=True)``) go as Horovod sends them, an allgather of
  indices and values, or densified with ``sparse_as_dense=True``. A parameter whose
  gradient backward did not produce is reduced anyway (zeros), as in Horovod. Ranks
  outside its process set step on their own gradients.
- ``Compression.none`` and ``Compression.fp16``; ``HorovodInternalError`` is
  :class:`collectives.CollectiveError`, the base of the library's failures.

Differences from Horovod:

- Queued calls start at the next wait, not in a background thread: a rank that never
  waits never starts them, and :func:`poll` of a queued call waits for the other ranks
  to reach theirs (negotiation) before it answers.
- :func:`join` serves the calls of the global process set (and the steps of a
  ``DistributedOptimizer`` on it); a call on another process set that includes a
  rank that has joined waits for that rank (until the communicator's timeout, if one is
  set).
- ``DistributedOptimizer``: ``gradient_predivide_factor`` and ``groups``/``num_groups``
  are checked as Horovod checks them and otherwise left to the buckets (the average is
  the same up to rounding); fp16 compression needs float32/float64 parameters and
  divides before the sum. ``step()`` after ``synchronize()`` warns as Horovod does but
  does not reduce the gradients a second time.
- ``broadcast_object`` and ``allgather_object`` pickle with :mod:`pickle`, not
  cloudpickle (lambdas and local classes cannot go).

Not implemented (each raises ``NotImplementedError`` naming it): ``op=Adasum``, process
sets made from an MPI communicator, ``init(comm=<list of ranks>)``, ``SyncBatchNorm``,
``elastic``, ``start_timeline``/``stop_timeline``.
"""

import contextlib
import importlib.util
import os
import pickle
import struct
import warnings
import weakref
import zlib

import numpy as np
import torch
from mpi4py import MPI

from .. import torch as cct
from .. import training
from ...communicator import Communicator
from ...errors import CollectiveError, CollectiveMismatchError
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


# -- process sets -----------------------------------------------------------------------------
class ProcessSet:
    """A set of ranks that run collectives together (Horovod's): made from a list of
    ranks, registered by :func:`add_process_set` (or ``init(process_sets=...)``), which
    gives it ``process_set_id``; then passed as ``process_set=`` to any call."""

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        if isinstance(ranks_or_comm, MPI.Comm):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm "
                             f"object; got {ranks_or_comm!r}") from None
        if not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) for r in ranks):
            raise ValueError(f"ProcessSet should be initialized with a list of process ranks; got {ranks_or_comm!r}")
        self.ranks = [int(r) for r in ranks]

    def _invalidate(self):
        self.process_set_id = None

    def size(self):
        """The number of ranks in the set; None until it is registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self):
        """This process's rank within the set (the order of the global ranks); None
        until the set is registered. ``root_rank`` arguments stay global ranks."""
        if self.process_set_id is None:
            return None
        if not self.included():
            raise ValueError("Process is not part of provided process set.")
        return self.ranks.index(rank())

    def included(self):
        """Whether this process is in the set; None while its ranks are unknown."""
        return None if self.ranks is None else rank() in self.ranks

    def __repr__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __str__ = __repr__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


class _Set:
    """A registered process set on this rank: its ranks (global), its communicator
    (None on ranks outside it) and how many negotiations it has run (the same count on
    every member: :func:`join` numbers its rounds by it)."""

    def __init__(self, process_set, comm, owned=None):
        self.process_set, self.comm, self.owned = process_set, comm, owned
        self.rounds = 0

    @property
    def ranks(self):
        return self.process_set.ranks

    def where(self, members):
        """The global ranks of the set's members ``members`` (set ranks), as text."""
        return _ranks([self.ranks[i] for i in members])


# -- init and topology ----------------------------------------------------------------------
class _State:
    def __init__(self, comm, mpi_comm, local_rank, local_size, cross_rank, cross_size, homogeneous, check):
        self.mpi_comm = mpi_comm  # this module's duplicate of init's comm: process sets are made from it
        self.local_rank, self.local_size = local_rank, local_size
        self.cross_rank, self.cross_size = cross_rank, cross_size
        self.homogeneous = homogeneous
        self.check = check  # negotiation before every call (COLLECTIVES_HOROVOD_CHECK)
        self.sets = {0: _Set(global_process_set, comm)}
        self.next_id = 1
        self.queue = []  # _Calls made but not started, in call order
        self.running = []  # _Calls started, not yet finished
        self.names = {}  # (process set id, name) -> the _Call in flight under that name
        self.optimizers = []  # every DistributedOptimizer made, by number: join serves their steps

    @property
    def comm(self):
        return self.sets[0].comm


_state = None


def _check_enabled():
    text = os.environ.get("COLLECTIVES_HOROVOD_CHECK", "1").strip()
    if text not in ("0", "1"):
        raise ValueError(f"COLLECTIVES_HOROVOD_CHECK must be 0 or 1; got {text!r}")
    return text == "1"


def init(comm=None, process_sets=None):
    """Start: every later call works over ``comm`` (an mpi4py intracommunicator; default
    ``MPI.COMM_WORLD``), and ``process_sets`` (ProcessSets of rank lists) are
    registered. Collective. Calling it again does nothing, as in Horovod."""
    global _state
    if comm is None:
        comm = MPI.COMM_WORLD
    if isinstance(comm, (list, tuple, range)):
        raise NotImplementedError("init(comm=<list of ranks>) is not implemented by collectives.horovod: pass an "
                                  "mpi4py communicator of those ranks instead (MPI.COMM_WORLD.Split or Create_group)")
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise ValueError(f"Invalid type of argument comm: expected an mpi4py intracommunicator or None; got {comm!r}")
    if process_sets is not None:
        if not isinstance(process_sets, (list, tuple)) or not all(isinstance(p, ProcessSet) for p in process_sets):
            raise ValueError(f"process_sets must be a list of hvd.ProcessSet; got {process_sets!r}")
        for process_set in process_sets:
            _check_ranks_only(process_set)
    if _state is not None:
        return
    check = _check_enabled()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    cross = comm.Split(color=local_rank, key=comm.Get_rank())
    cross_rank, cross_size = cross.Get_rank(), cross.Get_size()
    cross.Free()
    homogeneous = len(set(comm.allgather(local_size))) == 1
    _state = _State(Communicator(comm), comm.Dup(), local_rank, local_size, cross_rank, cross_size, homogeneous,
                    check)
    global_process_set.ranks = list(range(comm.Get_size()))
    global_process_set.process_set_id = 0
    for process_set in process_sets or ():
        _register(process_set)


def shutdown():
    """Release the communicators (collective); :func:`init` may be called again after.
    Calls still queued are dropped: their handles raise."""
    global _state
    if _state is not None:
        for call in list(_state.queue):
            call.fail(CollectiveError(f"{call.what}: Horovod was shut down before the call started"))
        state, _state = _state, None
        for hset in list(state.sets.values())[1:]:
            _free_set(hset)
        state.comm.free()
        state.mpi_comm.Free()


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


# -- registering process sets ------------------------------------------------------------------
def _check_ranks_only(process_set):
    if process_set.ranks is None:
        raise NotImplementedError("process sets made from an MPI communicator are not implemented by "
                                  "collectives.horovod: make the ProcessSet from a list of ranks")


def _register(process_set):
    """Make ``process_set``'s sub-communicator (collective over every rank) and give it
    its id; raises on every rank if the ranks disagree or the set exists already."""
    state = _initialized()
    n = state.comm.size
    bad = [r for r in process_set.ranks if not 0 <= r < n]
    if bad or len(set(process_set.ranks)) != len(process_set.ranks) or not process_set.ranks:
        raise ValueError(f"a process set needs distinct ranks in 0..{n - 1}; got {process_set.ranks}")
    digest = zlib.crc32(repr(process_set.ranks).encode())
    everyone = state.mpi_comm.allgather(digest)  # every rank must add the same set, at the same point
    if len(set(everyone)) != 1:
        differ = [r for r in range(n) if everyone[r] != everyone[0]]
        raise ValueError(f"add_process_set is collective: every rank must pass the same ranks; rank(s) "
                         f"{_ranks(differ)} passed other ranks than rank 0 (here: {process_set.ranks})")
    if any(hset.ranks == process_set.ranks for hset in state.sets.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    group = state.mpi_comm.Get_group()
    members = group.Incl(process_set.ranks)
    sub = state.mpi_comm.Create(members)  # collective over every rank; COMM_NULL outside the set
    members.Free()
    group.Free()
    comm = Communicator(sub) if sub != MPI.COMM_NULL else None
    process_set.process_set_id = state.next_id
    state.sets[state.next_id] = _Set(process_set, comm, sub if comm is not None else None)
    state.next_id += 1
    return process_set


def _free_set(hset):
    if hset.comm is not None:
        hset.comm.free()
        hset.owned.Free()
        hset.comm = None


def add_process_set(process_set):
    """Register a process set (a ``ProcessSet`` or a list of ranks) and return it.
    Collective: every rank calls it with the same ranks."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    _check_ranks_only(process_set)
    return _register(process_set)


def remove_process_set(process_set):
    """Unregister ``process_set`` and free its communicator (collective over every
    rank; its calls still queued start first); whether it was removed (the global set
    and unregistered sets are not)."""
    state = _initialized()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be an hvd.ProcessSet; got {type(process_set).__name__}")
    hset = state.sets.get(process_set.process_set_id)
    if hset is None or process_set.process_set_id == 0 or hset.process_set is not process_set:
        return False
    _flush()
    for call in [c for c in state.running if c.set is hset]:
        call.complete()
    state.mpi_comm.Barrier()  # every rank removes it at the same point, as it added it
    _free_set(hset)
    del state.sets[process_set.process_set_id]
    process_set._invalidate()
    return True


def _set_of(process_set, what="process_set"):
    """The registered set ``process_set`` stands for, on a rank that belongs to it."""
    state = _initialized()
    if process_set is None:
        process_set = global_process_set
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{what} must be an hvd.ProcessSet (hvd.global_process_set or one from add_process_set); "
                        f"got {type(process_set).__name__}")
    hset = state.sets.get(process_set.process_set_id)
    if hset is None or hset.process_set is not process_set:
        raise ValueError(f"{what}: {process_set} is not registered (add it with hvd.add_process_set)")
    if hset.comm is None:
        raise ValueError(f"{what}: rank {rank()} is not part of {process_set}")
    return hset


def _global_rank_in(hset, root_rank):
    """``root_rank`` (a global rank) as a rank of ``hset``'s communicator."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)) or root_rank not in hset.ranks:
        where = f"0..{size() - 1}" if hset.process_set is global_process_set else f"the process set {hset.ranks}"
        raise ValueError(f"root_rank must be a rank in {where}; got {root_rank!r}")
    return hset.ranks.index(int(root_rank))


# -- what Horovod does not have here -------------------------------------------------------------
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



# -- argument checks (on this rank, before anything is queued) ----------------------------------
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


def _ranks(ranks):
    return ", ".join(map(str, ranks))


# -- negotiation: what every rank of a set is about to call ---------------------------------------
# One fixed-size int64 record per rank and call, allgathered over the call's process set
# before any of its data moves (Horovod's coordinator compares the same things).
_KINDS = ("-", "allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier", "join",
          "broadcast_object", "allgather_object", "broadcast_parameters", "optimizer step")
_DTYPES = (None, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
           torch.float32, torch.float64, torch.complex64, torch.complex128, torch.bool)
_SHOWN_DIMS = 8
KIND, DTYPE, DEVICE, NDIM, SHAPE = 0, 1, 2, 3, 4  # SHAPE .. SHAPE + 7: the first eight dimensions
SHAPE_HASH, NUMEL, ROOT, OP, PRESCALE, POSTSCALE, NAME, JOINED, EXTRA = range(12, 21)
RECORD_LENGTH = 21  # 168 bytes per rank
# Calls a rank that joined cannot take part in (Horovod's words for them)
_NOT_WITH_JOIN = {
    "allgather": "Allgather is not supported with Join at this time. Specify sparse_to_dense=True if using "
                 "DistributedOptimizer",
    "alltoall": "Alltoall is not supported with Join at this time.",
    "reducescatter": "Reducescatter is not supported with Join at this time.",
    "broadcast": "Broadcast is not supported with Join at this time.",
    "broadcast_object": "Broadcast is not supported with Join at this time.",
    "allgather_object": "Allgather is not supported with Join at this time.",
    "broadcast_parameters": "Broadcast is not supported with Join at this time.",
}


_ALONG_DIMENSION_0 = (_KINDS.index("allgather"), _KINDS.index("alltoall"))  # a 0-d tensor is an error there


def _bits(value):
    """A float as the int64 with its bits (a record holds int64s only)."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _from_bits(bits):
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def _record(kind, name=None, tensor=None, root=-1, op=None, prescale=1.0, postscale=1.0, extra=-1):
    """This rank's record of a call (-1: not part of it). Built as a list, then one
    array: it is made before every call."""
    record = [-1] * RECORD_LENGTH
    record[KIND] = _KINDS.index(kind)
    if tensor is not None:
        record[DTYPE] = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
        record[DEVICE] = 0 if tensor.device.type == "cpu" else 1
        shape = tuple(tensor.shape)
        record[NDIM] = len(shape)
        record[SHAPE:SHAPE + min(len(shape), _SHOWN_DIMS)] = shape[:_SHOWN_DIMS]
        record[SHAPE_HASH] = zlib.crc32(repr(shape).encode())
        record[NUMEL] = tensor.numel()
    record[ROOT] = root
    if op is not None:
        record[OP] = _OPS.index(op)
    record[PRESCALE], record[POSTSCALE] = _bits(prescale), _bits(postscale)
    record[NAME] = -1 if name is None else zlib.crc32(name.encode())
    record[EXTRA] = extra
    return np.array(record, np.int64)


def _shape_text(record):
    ndim = int(record[NDIM])
    shown = [int(n) for n in record[SHAPE:SHAPE + min(ndim, _SHOWN_DIMS)]]
    return str(shown) if ndim <= _SHOWN_DIMS else f"[{', '.join(map(str, shown))}, ...] ({ndim} dimensions)"


def _dtype_text(code):
    return str(_DTYPES[code]).replace("torch.", "") if 0 < code < len(_DTYPES) else "another dtype"


def _differ(hset, everyone, active, value, label, show):
    """Raise if ``value(record)`` is not the same on every rank in ``active``:
    "Mismatched <label>: rank(s) A <show(a)>, but rank(s) B <show(b)>, ..." (Horovod's
    wording, with the ranks of each value)."""
    groups = {}
    for i in active:
        groups.setdefault(value(everyone[i]), []).append(i)
    if len(groups) > 1:
        (_, first), *others = list(groups.items())
        rest = ", ".join(f"rank(s) {hset.where(members)} {show(everyone[members[0]])}" for _, members in others)
        raise CollectiveMismatchError(
            f"Mismatched {label}: rank(s) {hset.where(first)} {show(everyone[first[0]])}, but {rest}.")


def _agree(hset, everyone):
    """Raise :class:`CollectiveMismatchError` on every rank of ``hset`` unless the
    records of the ranks that have not joined (``everyone``: every rank's) describe one
    call Horovod would run. The message is built from the records alone, so every rank
    raises the same one."""
    if (everyone == everyone[0]).all() and not (everyone[0, NDIM] == 0 and everyone[0, KIND] in _ALONG_DIMENSION_0):
        return  # the common case: every rank made the very same call
    joined = [i for i in range(len(everyone)) if everyone[i, KIND] == _KINDS.index("join")]
    active = [i for i in range(len(everyone)) if i not in joined]
    kinds = {int(everyone[i, KIND]) for i in active}
    _differ(hset, everyone, active, lambda r: int(r[KIND]), "operations",
            lambda r: f"did an {_KINDS[int(r[KIND])]}")
    kind = _KINDS[kinds.pop()]
    if joined and kind in _NOT_WITH_JOIN:
        raise CollectiveMismatchError(f"{_NOT_WITH_JOIN[kind]} (rank(s) {hset.where(joined)} joined)")
    named = [i for i in active if everyone[i, NAME] != -1]
    if len({int(everyone[i, NAME]) for i in named}) > 1:
        differ = [i for i in named if everyone[i, NAME] != everyone[named[0], NAME]]
        raise CollectiveMismatchError(
            f"Mismatched names: rank(s) {hset.where(differ)} named this {kind} otherwise than rank "
            f"{hset.where(named[:1])} (collectives.horovod matches calls in the order each rank makes them, per "
            "process set; make them in the same order on every rank)")
    if everyone[active[0], DTYPE] == -1:  # no tensor: barrier, join, objects, optimizer step
        _differ(hset, everyone, active, lambda r: int(r[ROOT]), f"{kind} root ranks",
                lambda r: f"specified root rank {hset.ranks[int(r[ROOT])]}")
        _differ(hset, everyone, active, lambda r: int(r[EXTRA]), f"{kind} calls", lambda r: f"made call {r[EXTRA]}")
        return
    _differ(hset, everyone, active, lambda r: int(r[DTYPE]), "data types",
            lambda r: f"had type {_dtype_text(int(r[DTYPE]))}")
    if kind in ("allreduce", "broadcast", "reducescatter"):
        _differ(hset, everyone, active, lambda r: (int(r[NDIM]), tuple(r[SHAPE:SHAPE_HASH + 1])),
                f"{kind} tensor shapes", lambda r: f"sent a tensor of shape {_shape_text(r)}")
    if kind in ("allreduce", "reducescatter"):
        _differ(hset, everyone, active, lambda r: (int(r[PRESCALE]), int(r[POSTSCALE])),
                "prescale and/or postscale factors",
                lambda r: f"sent factors ({_from_bits(r[PRESCALE]):g}, {_from_bits(r[POSTSCALE]):g})")
        _differ(hset, everyone, active, lambda r: int(r[OP]), "reduction operation",
                lambda r: f"sent reduction op {_OPS[int(r[OP])]!r}")
    if kind in ("allgather", "alltoall"):
        zero = [i for i in active if everyone[i, NDIM] == 0]
        if zero:
            raise CollectiveMismatchError(f"rank(s) {hset.where(zero)} tried to {kind} a rank-zero tensor ({kind} "
                                          "works along dimension 0)")
        _differ(hset, everyone, active, lambda r: int(r[NDIM]), f"{kind} tensor shapes",
                lambda r: f"sent a tensor of rank {int(r[NDIM])}")
        ndim = int(everyone[active[0], NDIM])
        for dim in range(1, min(ndim, _SHOWN_DIMS)):
            _differ(hset, everyone, active, lambda r, d=dim: int(r[SHAPE + d]), f"{kind} tensor shapes",
                    lambda r, d=dim: f"sent a tensor with dimension {d} equal to {int(r[SHAPE + d])}")
        if ndim > _SHOWN_DIMS:  # beyond what the record shows: the shape without dimension 0, as a hash
            _differ(hset, everyone, active, lambda r: int(r[EXTRA]), f"{kind} tensor shapes",
                    lambda r: "sent a tensor of another shape beyond dimension 0")
    if kind == "broadcast":
        _differ(hset, everyone, active, lambda r: int(r[ROOT]), "broadcast root ranks",
                lambda r: f"specified root rank {hset.ranks[int(r[ROOT])]}")
    _differ(hset, everyone, active, lambda r: int(r[DEVICE]), f"{kind} CPU/GPU device selection",
            lambda r: f"specified device {'CPU' if r[DEVICE] == 0 else 'GPU'}")


def _negotiate(hset, record):
    """Every rank's record of the call (an allgather over ``hset``), checked; None
    where negotiation is off. Raises CollectiveMismatchError on every rank alike."""
    if not _state.check:
        return None
    everyone = hset.comm.allgather(record)
    hset.rounds += 1
    _agree(hset, everyone)
    return everyone


# -- calls, the queue, handles -------------------------------------------------------------------
class _Call:
    """One collective of one tensor: made by an hvd call (queued), started at the next
    wait (negotiated, then handed to the library), finished once (its result kept).
    ``starter(everyone)`` starts it: every rank's records (None without negotiation)
    -> (the library's handles, a function giving the result once they are done)."""

    __slots__ = ("what", "set", "key", "record", "starter", "parts", "finish", "result", "error", "state")

    def __init__(self, what, hset, name, record, starter):
        self.what, self.set, self.record, self.starter = what, hset, record, starter
        self.key = None if name is None else (hset.process_set.process_set_id, name)
        self.parts, self.finish, self.result, self.error = [], None, None, None
        self.state = "queued"

    def start(self):
        try:
            everyone = _negotiate(self.set, self.record)
            self.parts, self.finish = self.starter(everyone)
        except Exception as exc:  # noqa: BLE001 - kept: raised by synchronize, as Horovod raises there
            self.fail(exc)
            return
        self.state = "started"
        _state.running.append(self)

    def done(self):
        """Whether it has finished (advancing it; finishing it if its messages are in)."""
        if self.state == "started":
            try:
                ready = all(part.test() for part in self.parts)
            except Exception as exc:  # noqa: BLE001 - kept for synchronize
                self.fail(exc)
                return True
            if ready:
                self.complete()
        return self.state in ("done", "failed")

    def complete(self):
        """Wait for it (started already) and keep its result or error."""
        if self.state != "started":
            return
        try:
            for part in self.parts:
                part.wait()
            self.result = self.finish()
        except Exception as exc:  # noqa: BLE001 - kept for synchronize
            self.fail(exc)
            return
        self._settle("done")

    def fail(self, error):
        self.error = error
        self._settle("failed")

    def _settle(self, state):
        self.state = state
        self.parts, self.starter = [], None
        if self in _state.running:
            _state.running.remove(self)
        if self.key is not None and _state.names.get(self.key) is self:
            del _state.names[self.key]


def _enqueue(what, hset, name, record, starter):
    """Queue a call (after its arguments were checked); its name is in flight from now
    until it finishes."""
    call = _Call(what, hset, name, record, starter)
    if call.key is not None:
        if call.key in _state.names:
            raise ValueError(f"{what}: a call named {name!r} is already in flight in this process set (Horovod "
                             "refuses a second call with the name of a call that has not finished: use another "
                             "name, or synchronize the first)")
        _state.names[call.key] = call
    _state.queue.append(call)
    return call


def _flush():
    """Start every queued call, in call order; then finish those whose messages are in
    (which frees their names)."""
    state = _initialized()
    while state.queue:
        state.queue.pop(0).start()
    for call in list(state.running):
        call.done()


class _Handle:
    """What an ``*_async`` call returns: pass it to :func:`poll` or :func:`synchronize`."""

    __slots__ = ("what", "_calls", "_combine")

    def __init__(self, what, calls, combine=None):
        self.what, self._calls = what, calls
        self._combine = combine if combine is not None else (lambda results: results[0])

    def _test(self):
        _flush()
        return all(call.done() for call in self._calls)

    def _wait(self):
        _flush()
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
    state = _initialized()
    if not state.check:
        raise ValueError("hvd.join needs negotiation, which COLLECTIVES_HOROVOD_CHECK=0 turned off")
    if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
        raise TypeError(f"device must be an int (-1: CPU, else a GPU index); got {device!r}")
    _flush()
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
        optimizer = _state.optimizers[int(record[EXTRA])]()
        if optimizer is None:
            raise CollectiveError(f"join: the other ranks step DistributedOptimizer #{int(record[EXTRA])}, which "
                                  "this rank no longer has")
        optimizer._hvd_serve_step()
    # anything else raises on the ranks that have not joined: nothing moves


# -- objects ------------------------------------------------------------------------------------
def _blocking(kind, hset, root=-1):
    """Before a blocking call that is not a collective of this module's own (objects,
    parameters): the queued calls start, and the ranks negotiate this one."""
    _flush()
    _negotiate(hset, _record(kind, root=root))


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Rank ``root_rank``'s ``obj`` (pickled) on every rank of the process set."""
    hset = _set_of(process_set)
    _check_name(name)
    root = _global_rank_in(hset, root_rank)
    _blocking("broadcast_object", hset, root)
    return hset.comm.broadcast_object(obj, root=root)


def allgather_object(obj, name=None, process_set=global_process_set):
    """Every rank's ``obj`` (pickled), as a list in rank order."""
    hset = _set_of(process_set)
    _check_name(name)
    _blocking("allgather_object", hset)
    comm = hset.comm
    try:
        payload, problem = pickle.dumps(obj), None
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it, not wait for data
        payload, problem = b"", exc
    lengths = comm.allgather(np.array([len(payload) if problem is None else -1], np.int64)).ravel()
    failed = [r for r in range(comm.size) if lengths[r] < 0]
    if failed:
        raise TypeError(f"allgather_object: the object on rank(s) {_ranks(failed)} cannot be pickled") from problem
    longest = int(lengths.max())
    padded = np.zeros(longest, np.uint8)
    padded[:len(payload)] = np.frombuffer(payload, np.uint8)
    gathered = comm.allgather(padded)
    return [pickle.loads(gathered[r, :lengths[r]].tobytes()) for r in range(comm.size)]


# -- training -----------------------------------------------------------------------------------
def broadcast_parameters(params, root_rank):
    """Overwrite ``params`` on every rank with rank ``root_rank``'s, in place: a
    ``state_dict()``, ``named_parameters()``, ``parameters()`` or a list of tensors
    (``collectives.torch.broadcast_parameters``)."""
    if isinstance(params, torch.Tensor) or not (hasattr(params, "items") or hasattr(params, "__iter__")):
        raise ValueError(f"invalid params of type: {type(params).__name__} (pass a state_dict(), "
                         "named_parameters(), parameters() or a list of tensors)")
    hset = _set_of(global_process_set)
    root = _global_rank_in(hset, root_rank)
    _blocking("broadcast_parameters", hset, root)
    cct.broadcast_parameters(params, root=root, comm=hset.comm)


def broadcast_optimizer_state(optimizer, root_rank, model=None):
    """Give every rank rank ``root_rank``'s optimizer state and hyperparameters
    (``collectives.torch.broadcast_optimizer_state``). As in Horovod, an optimizer
    without state first takes one step on zero gradients, which creates its state (its
    own step, not the DistributedOptimizer's: nothing is reduced); ``model`` tells
    which parameters have sparse gradients (``nn.Embedding(sparse=True)``), whose
    zero gradients are then sparse too."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    hset = _set_of(global_process_set)
    root = _global_rank_in(hset, root_rank)
    if not optimizer.state_dict()["state"]:  # Horovod's zero-gradient step
        sparse = {id(p) for m in (model.modules() if model is not None else ())
                  if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse for p in m.parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = p.detach().new_zeros(p.shape)
                    if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                        p.grad = p.grad.to_sparse()
        if isinstance(optimizer, _HorovodOptimizer):
            super(_HorovodOptimizer, optimizer).step()  # the wrapped optimizer's step: no reduction
        else:
            optimizer.step()
    _blocking("broadcast_parameters", hset, root)
    cct.broadcast_optimizer_state(optimizer, root=root, comm=hset.comm)


def _adapter_compression(compression):
    """The reducer's compression for a Horovod compressor (the class or an instance)."""
    kind = compression if isinstance(compression, type) else type(compression)
    if compression is None or kind is NoneCompressor:
        return None
    if kind is FP16Compressor:
        return "fp16"
    raise ValueError(f"compression must be hvd.Compression.none or hvd.Compression.fp16 for DistributedOptimizer; got "
                     f"{compression!r}: its gradients are compressed a bucket at a time, where a custom "
                     "Compressor cannot run")


class _HorovodOptimizer:
    """Mixed into the user's optimizer class by :func:`DistributedOptimizer`: Horovod's
    optimizer on this module's calls. Dense gradients go into the buckets of a
    :class:`collectives.training.GradientReducer` on a duplicate of the process set's
    communicator, laid out at the first :meth:`synchronize` (collective), once the
    ranks have agreed which gradients are sparse; sparse ones go through
    :func:`sparse_allreduce_async` (or densified into the buckets with
    ``sparse_as_dense``)."""

    def _hvd_setup(self, named, hset, options, sparse_as_dense):
        self._hvd_set = hset  # None on ranks outside the process set: they step alone
        self._hvd_params = dict(named)
        self._parameter_names = {p: name for name, p in named}  # Horovod's attribute, which scripts read
        self._hvd_options = options  # the reducer's: compression, op
        self._hvd_sparse_as_dense = sparse_as_dense
        self._hvd_reducer = None  # made at the first synchronize()
        self._hvd_sparse_names = set()  # parameters whose gradients go as sparse tensors (agreed then)
        self._hvd_sparse = {}  # name -> the sparse allreduce in flight this step
        self._hvd_dense = {}  # name -> the dense copy of a sparse gradient handed to the buckets
        self._hvd_passes = {name: 0 for name in self._hvd_params}  # backward passes this step
        self._hvd_handed = set()  # names handed over this step
        self._hvd_synchronized = False
        self._hvd_skip = False
        self.backward_passes_per_step = options.pop("backward_passes_per_step")
        state = _initialized()
        self._hvd_number = len(state.optimizers)
        state.optimizers.append(weakref.ref(self))
        self._hvd_hooks = []
        if hset is not None:
            self._hvd_hooks = [p.register_post_accumulate_grad_hook(self._hvd_hook(name)) for name, p in named]

    def _hvd_hook(self, name):
        def hook(param):  # after autograd accumulated this backward pass into param.grad
            self._hvd_gradient(name, param)
        return hook

    def _hvd_gradient(self, name, param):
        """One backward pass's gradient of ``name``; the k-th of the step is handed over."""
        if self._hvd_passes[name] >= self.backward_passes_per_step:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before call to "
                                 "step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._hvd_passes[name] += 1
        if self._hvd_passes[name] == self.backward_passes_per_step and self._hvd_reducer is not None:
            self._hvd_hand_over(name, param)  # before the first synchronize, that one hands everything over

    def _hvd_hand_over(self, name, param):
        """Start reducing ``name``'s gradient: into its bucket, or as a sparse tensor."""
        self._hvd_handed.add(name)
        grad = param.grad
        if name in self._hvd_sparse_names:
            if grad is None or not grad.is_sparse:  # none on this rank: an empty sparse one, as the others send
                grad = torch.zeros_like(param).to_sparse() if grad is None else grad.to_sparse()
            op = Average if self._hvd_options["op"] == "avg" else Sum
            self._hvd_sparse[name] = sparse_allreduce_async(grad, name, op, self._hvd_set.process_set)
            return
        if grad is None:
            grad = param.grad = torch.zeros_like(param)
        if grad.is_sparse:  # sparse_as_dense, or a gradient that turned sparse after the first step
            if not self._hvd_sparse_as_dense:
                warnings.warn(f"the gradient of {name!r} is sparse, but was dense (or absent) at the first step, when "
                              "the buckets were laid out: it is averaged densified (sparse_as_dense)", stacklevel=3)
            grad = self._hvd_dense[name] = grad.to_dense()
        with torch_stream(param):
            self._hvd_reducer.gradient_ready(name, to_array(grad, name, "grad"))

    def _hvd_build(self):
        """Lay out the buckets (collective over the set): the ranks agree which gradients
        are sparse (an allgather of one flag per parameter), the others get buckets."""
        names = list(self._hvd_params)
        sparse = np.array([0 if self._hvd_sparse_as_dense else
                           int(p.grad is not None and p.grad.is_sparse) for p in self._hvd_params.values()], np.uint8)
        anywhere = self._hvd_set.comm.allgather(sparse).any(axis=0) if names else sparse
        self._hvd_sparse_names = {name for name, flag in zip(names, anywhere) if flag}
        dense = [(name, to_array(p, name, "named_parameters")) for name, p in self._hvd_params.items()
                 if name not in self._hvd_sparse_names]
        self._hvd_reducer = training.GradientReducer(dense, self._hvd_set.comm, **self._hvd_options)

    def _hvd_negotiate_step(self):
        """On the global set, the ranks agree on this step (so that ranks that joined
        take part); elsewhere nothing."""
        if self._hvd_set.process_set is global_process_set:
            _negotiate(self._hvd_set, _record("optimizer step", extra=self._hvd_number))

    def _hvd_reduce(self):
        """The step's reduction: every parameter handed over (those backward did not reach
        with what their .grad holds, zeros if nothing, as Horovod does), then waited for."""
        if self._hvd_reducer is None:
            self._hvd_build()
        for name, param in self._hvd_params.items():
            if name not in self._hvd_handed:
                self._hvd_hand_over(name, param)
        self._hvd_reducer.synchronize()
        for name, dense in self._hvd_dense.items():  # back to sparse, as Horovod does with sparse_as_dense
            self._hvd_params[name].grad.zero_().add_(dense.to_sparse())
        for name, result in self._hvd_sparse.items():
            grad = self._hvd_params[name].grad
            if grad is not None and grad.is_sparse:
                grad.zero_().add_(result())  # Horovod's way: sparse gradients keep their tensor
            else:
                self._hvd_params[name].grad = result()
        self._hvd_sparse, self._hvd_dense, self._hvd_handed = {}, {}, set()
        self._hvd_passes = dict.fromkeys(self._hvd_passes, 0)

    def _hvd_serve_step(self):
        """A rank that joined, in the others' step: zero gradients for every parameter."""
        for param in self._hvd_params.values():
            param.grad = None
        self._hvd_reduce()

    def synchronize(self):
        """Wait for the reduced gradients (now in every ``.grad``). Collective over the
        process set; on ranks outside it, nothing."""
        if self._hvd_set is not None:
            self._hvd_negotiate_step()
            self._hvd_reduce()
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside does not synchronize (call :meth:`synchronize` before)."""
        self._hvd_skip = True
        try:
            yield
        finally:
            self._hvd_skip = False

    def step(self, closure=None):
        """Synchronize the gradients (unless :meth:`skip_synchronize`), then take the
        wrapped optimizer's step."""
        if not self._hvd_skip:
            if self._hvd_synchronized:  # Horovod's warning (Horovod would reduce again; the result is the same)
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your "
                              "code.", stacklevel=2)
            else:
                self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, *args, **kwargs):
        if any(self._hvd_passes.values()):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                                 "or optimizer.synchronize(). This is prohibited as it can cause a race condition.")
        return super().zero_grad(*args, **kwargs)

    def set_backward_passes_per_step(self, passes):
        """Expect ``passes`` backward passes per step (the count starts over)."""
        if isinstance(passes, bool) or not isinstance(passes, (int, np.integer)) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be > 0; got {passes!r}")
        self.backward_passes_per_step = int(passes)
        self._hvd_passes = dict.fromkeys(self._hvd_passes, 0)

    def load_state_dict(self, *args, **kwargs):
        self._hvd_passes = dict.fromkeys(self._hvd_passes, 0)
        self._hvd_synchronized = False
        return super().load_state_dict(*args, **kwargs)

    def add_param_group(self, param_group):
        raise ValueError("add_param_group on a DistributedOptimizer: its gradients would never be averaged; add "
                         "every parameter group to the optimizer before wrapping it")

    def close(self):
        """Remove the gradient hooks and free the buckets' communicator (collective over
        the process set, where they were laid out)."""
        for handle in self._hvd_hooks:
            handle.remove()
        self._hvd_hooks = []
        if self._hvd_reducer is not None:
            self._hvd_reducer.close()
            self._hvd_reducer = None


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Wrap ``optimizer`` so that ``step()`` applies the gradients averaged (``op=Sum``:
    summed) over the ranks of ``process_set``, with Horovod's ``synchronize()``,
    ``skip_synchronize()`` and ``set_backward_passes_per_step()``. Returns an instance
    of a subclass of ``optimizer``'s class sharing its attributes. Collective at its
    first ``synchronize()``."""
    _initialized()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be an hvd.ProcessSet; got {type(process_set).__name__}")
    if process_set.process_set_id is None:
        raise ValueError(f"process_set: {process_set} is not registered (add it with hvd.add_process_set)")
    hset = _set_of(process_set) if process_set.included() else None  # None: this rank steps alone
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
    if isinstance(optimizer, _HorovodOptimizer) or "_hvd_params" in optimizer.__dict__:
        raise ValueError("optimizer is already a DistributedOptimizer (or wrapped by one)")
    if "step" in optimizer.__dict__:  # what an LR scheduler made before wrapping leaves behind
        raise ValueError("optimizer.step was replaced on the instance (by an LR scheduler created before "
                         "DistributedOptimizer?): its step would skip the gradient averaging; wrap the optimizer "
                         "first, then create schedulers on the DistributedOptimizer")
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
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, (int, np.integer)) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer; got {backward_passes_per_step!r}")
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
    seen, duplicates = set(), set()
    for name, _ in named:
        (duplicates if name in seen else seen).add(name)
    if duplicates:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                         f"{', '.join(sorted(duplicates))}")
    given = {id(p) for _, p in named}
    unnamed = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in given]
    if unnamed:
        raise ValueError(f"named_parameters was specified, but {len(unnamed)} model parameter(s) were not named: pass "
                         "model.named_parameters() of the model the optimizer was built from")
    mine = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
    named = [(name, p) for name, p in named if id(p) in mine]
    base = type(optimizer)
    cls = type(base.__name__, (_HorovodOptimizer, base), {})
    distributed = cls.__new__(cls)
    # One attribute dict for both objects: param_groups, state and hooks stay shared even
    # when load_state_dict replaces them (it assigns new ones).
    distributed.__dict__ = optimizer.__dict__
    options = dict(backward_passes_per_step=int(backward_passes_per_step), compression=wire,
                   op="avg" if op is Average else "sum")
    distributed._hvd_setup(named, hset, options, sparse_as_dense)
    return distributed
