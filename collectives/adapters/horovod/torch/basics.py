"""Starting and stopping, and what the job looks like: ``init``, ``shutdown``,
``size``, ``rank``, ``local_rank`` ... and the queries of what Horovod was built with;
the reduction ops (``Average``, ``Sum`` ...) and ``HorovodInternalError``."""

import importlib.util
import os
import warnings

from mpi4py import MPI

from ....communicator import Communicator
from ....errors import CollectiveError
from . import runtime
from .process_sets import ProcessSet, _check_ranks_only, _free_set, _register, _Set, global_process_set

HorovodInternalError = CollectiveError

__all__ = [
    "Adasum", "Average", "HorovodInternalError", "Max", "Min", "Product", "Sum", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "init", "is_homogeneous",
    "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "rank", "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline",
]


def _check_enabled():
    text = os.environ.get("COLLECTIVES_HOROVOD_CHECK", "1").strip()
    if text not in ("0", "1"):
        raise ValueError(f"COLLECTIVES_HOROVOD_CHECK must be 0 or 1; got {text!r}")
    return text == "1"


def _warn_of_horovod_variables(environ, rank):
    """One line, on rank 0, naming the ``HOROVOD_*`` variables set: Horovod's own
    settings (fusion, cycle time, timeline, autotune, ...), none of which this module
    reads. Silence would let a user believe them in force."""
    names = sorted(name for name in environ if name.startswith("HOROVOD_"))
    if names and rank == 0:
        warnings.warn(f"{', '.join(names)}: Horovod's settings, which collectives.horovod.torch does not read "
                      "(its calls take the library's options: COLLECTIVES_* variables)", stacklevel=3)


def init(comm=None, process_sets=None):
    """Start: every later call works over ``comm`` (an mpi4py intracommunicator; default
    ``MPI.COMM_WORLD``), and ``process_sets`` (ProcessSets of rank lists) are
    registered. Collective. Calling it again does nothing, as in Horovod. A
    ``HOROVOD_*`` variable in the environment gets a warning on rank 0: none is read."""
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
    if runtime.current() is not None:
        return
    check = _check_enabled()
    _warn_of_horovod_variables(os.environ, comm.Get_rank())
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    cross = comm.Split(color=local_rank, key=comm.Get_rank())
    cross_rank, cross_size = cross.Get_rank(), cross.Get_size()
    cross.Free()
    homogeneous = len(set(comm.allgather(local_size))) == 1
    global_set = _Set(global_process_set, Communicator(comm))
    runtime.begin(runtime.State(comm.Dup(), global_set, local_rank, local_size, cross_rank, cross_size,
                                homogeneous, check))
    global_process_set.ranks = list(range(comm.Get_size()))
    global_process_set.process_set_id = 0
    for process_set in process_sets or ():
        _register(process_set)


def shutdown():
    """Release the communicators (collective); :func:`init` may be called again after.
    Calls still queued are dropped: their handles raise."""
    if runtime.current() is not None:
        for call in list(runtime.current().queue):  # failed while the state is there: they leave its queue
            call.fail(CollectiveError(f"{call.what}: Horovod was shut down before the call started"))
        state = runtime.end()
        for hset in list(state.sets.values())[1:]:
            _free_set(hset)
        state.comm.free()
        state.mpi_comm.Free()


def is_initialized():
    return runtime.current() is not None


def _comm():
    return runtime.initialized().comm


def size():
    """The number of processes."""
    return _comm().size


def rank():
    """This process's rank, 0 .. size() - 1."""
    return _comm().rank


def local_size():
    """The number of processes on this node."""
    return runtime.initialized().local_size


def local_rank():
    """This process's rank among those on its node (in the order of their ranks)."""
    return runtime.initialized().local_rank


def cross_size():
    """The number of processes with this process's local rank (one per node that has one)."""
    return runtime.initialized().cross_size


def cross_rank():
    """This process's rank among the processes with its local rank (its node's index)."""
    return runtime.initialized().cross_rank


def is_homogeneous():
    """Whether every node runs the same number of processes."""
    return runtime.initialized().homogeneous


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

