"""collectives: allreduce, reduce_scatter, allgather, broadcast, reduce, gather, scatter
and alltoall(v) built on MPI point-to-point messages, each in several algorithms.

    import collectives as cc
    comm = cc.Communicator()                 # MPI.COMM_WORLD
    total = comm.allreduce(x, op="sum", algorithm="ring")

``import collectives`` loads the core library only. The simulator (``cc.sim``), the
framework adapters (``cc.training``, ``cc.ps``, ``collectives.torch``,
``collectives.horovod.torch``; they live in :mod:`collectives.adapters`) and the tools
(:mod:`collectives.tools`) load when first used. Under ``mpiexec`` it sets torch's
``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` where unset, from MPI's node split
(:mod:`collectives.launcher`): every rank must import it, as every rank initialises MPI.
"""

import importlib

from . import (
    _aliases,
    device,
    launcher,
    mpi_library,  # first: importing it prepares MPI's environment, before mpi4py.MPI loads
)
from .algorithms import COLLECTIVES, algorithms
from .communicator import Communicator
from .dtypes import SUPPORTED_DTYPES
from .errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError, MessageSizeError, TransportError
from .ops import OPS, ops_for
from .topology import Topology
from .transport.progress import Handle

__version__ = "0.1.0"

launcher.export_local_ranks()  # LOCAL_RANK, LOCAL_WORLD_SIZE where unset, as torchrun sets them
_aliases.install()  # collectives.torch, collectives.horovod.torch, ...: the adapters by their short names

# Loaded at first use: cc.sim.run(...), cc.training.GradientReducer, cc.ps.ParameterServer.
_ON_FIRST_USE = {"sim": "collectives.sim", "training": "collectives.adapters.training",
                 "ps": "collectives.adapters.ps"}


def __getattr__(name):
    if name in _ON_FIRST_USE:
        module = importlib.import_module(_ON_FIRST_USE[name])
        globals()[name] = module
        return module
    raise AttributeError(f"module 'collectives' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_ON_FIRST_USE))


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
    "device",
    "mpi_library",
    "ops_for",
    "ps",
    "sim",
    "training",
]
