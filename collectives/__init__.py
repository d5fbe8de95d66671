"""collectives: allreduce, reduce_scatter, allgather, broadcast, reduce, gather, scatter
and alltoall(v) built on MPI point-to-point messages, each in several algorithms.

    import collectives as cc
    comm = cc.Communicator()                 # MPI.COMM_WORLD
    total = comm.allreduce(x, op="sum", algorithm="ring")
"""

from .algorithms import COLLECTIVES, algorithms
from .arrays import SUPPORTED_DTYPES
from .communicator import Communicator
from .errors import (CollectiveError, CollectiveMismatchError, CollectiveTimeoutError, MessageSizeError,
                     TransportError)
from .ops import OPS, ops_for
from .topology import Topology
from .transport.mpi import Handle
from . import device  # noqa: E402 (device arrays: cc.device.bfloat16, the stand-in GPU)
from . import sim  # noqa: E402 (the simulator: cc.sim.run)
from . import training  # noqa: E402 (data-parallel training: cc.training.GradientReducer)
from . import ps  # noqa: E402 (parameter server: cc.ps.ParameterServer)

__version__ = "0.1.0"

__all__ = [
    "COLLECTIVES",
    "OPS",
    "SUPPORTED_DTYPES",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "Communicator",
    "Handle",
    "MessageSizeError",
    "Topology",
    "TransportError",
    "algorithms",
    "ops_for",
    "device",
    "sim",
    "ps",
    "training",
]
