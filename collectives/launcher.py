"""The variables torch's launcher gives each process that ``mpiexec`` does not: the
rank's index on its host and the host's rank count, as ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE``.

torchrun sets ``LOCAL_RANK`` for every process it starts, and training scripts pick
their GPU with it (``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))``). Under
``mpiexec`` nothing sets it, so ``import collectives`` does (:func:`export_local_ranks`),
where it is unset, in a world of two ranks or more, from MPI's node split: the ranks
that share a host, in the order of their ranks in ``MPI.COMM_WORLD``. That is the order
of ``hvd.local_rank()`` and of :class:`~collectives.Topology`'s ``local_rank``. The
launchers' own variables are not always that order: Open MPI 5.0.11's
``OMPI_COMM_WORLD_LOCAL_RANK`` gave world ranks 1 and 2 of 4 the local ranks 2 and 1
(2026-12-08, the 2-core development machine, ``--oversubscribe``).
"""

import os

LOCAL_RANK, LOCAL_WORLD_SIZE = "LOCAL_RANK", "LOCAL_WORLD_SIZE"


def export_local_ranks(world=None, environ=None):
    """Set ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` in ``environ`` (``os.environ`` by
    default), each only where unset, to this rank's index among the ranks of ``world``
    (``MPI.COMM_WORLD``) on its host and their count. Collective, whatever is set on
    any rank (a ``Split_type``): every rank of ``world`` must call it, as every rank
    calls ``MPI_Init``. In a world of one it sets nothing: a process started alone
    (a script, a driver that starts jobs of its own) must not hand "0 of 1" to the
    ranks of a job it launches. Nor does it where MPI is not running (a program that
    initialises MPI itself, ``mpi4py.rc.initialize = False``)."""
    from mpi4py import MPI  # (here: importing this module must not start MPI)

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    world = MPI.COMM_WORLD if world is None else world
    environ = os.environ if environ is None else environ
    if world.Get_size() == 1:
        return
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    rank, size = node.Get_rank(), node.Get_size()
    node.Free()
    environ.setdefault(LOCAL_RANK, str(rank))
    environ.setdefault(LOCAL_WORLD_SIZE, str(size))
