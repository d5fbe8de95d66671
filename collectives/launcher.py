"""What the launcher told this process: its rank on its host, and how many ranks the
host runs, exported as torch's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``.

torchrun sets ``LOCAL_RANK`` for every process it starts, and training scripts pick
their GPU with it (``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))``). Under
``mpiexec`` nothing sets it, but every launcher here tells each process the same in
variables of its own (local rank, ranks on the host):

- MPICH's hydra and Intel MPI's: ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``;
- Open MPI's: ``OMPI_COMM_WORLD_LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_SIZE``.

:func:`export_local_ranks` copies them into ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``
where those are unset, reading nothing but the environment (``import collectives``
calls it: it sends no message). A process started alone (no
launcher: an MPI world of one) is local rank 0 of 1 (:func:`export_single_process`).
Under another launcher (Slurm's ``srun``) the variables stay unset here;
``collectives.torch`` then sets them from the node split, a collective it can make
because importing it is collective already.
"""

import os
import warnings

LOCAL_RANK, LOCAL_WORLD_SIZE = "LOCAL_RANK", "LOCAL_WORLD_SIZE"

# Each launcher's (local rank, ranks on the host) variables, the first one present wins.
LAUNCHER_VARIABLES = (
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH's hydra, Intel MPI's
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),  # Open MPI's
)


def local_ranks(environ=None):
    """``(local rank, ranks on the host)`` as the launcher gave them in ``environ``
    (``os.environ`` by default), or None where no launcher of
    :data:`LAUNCHER_VARIABLES` did. A launcher's variable that is not a count (or a
    rank outside its host's count) raises ValueError naming it."""
    environ = os.environ if environ is None else environ
    for rank_name, size_name in LAUNCHER_VARIABLES:
        if rank_name in environ and size_name in environ:
            rank, size = _count(environ, rank_name), _count(environ, size_name)
            if not 0 <= rank < size:
                raise ValueError(f"the launcher set {rank_name}={rank} and {size_name}={size}: "
                                 "a local rank must be below the host's rank count")
            return rank, size
    return None


def export_local_ranks(environ=None):
    """Set ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` in ``environ`` (``os.environ`` by
    default) from the launcher's variables, each only where unset. Returns True if
    the launcher gave them. Variables that make no sense get a warning naming them and
    set nothing: this runs at ``import collectives``, which they must not stop."""
    environ = os.environ if environ is None else environ
    try:
        found = local_ranks(environ)
    except ValueError as exc:
        warnings.warn(f"{exc}; {LOCAL_RANK} and {LOCAL_WORLD_SIZE} are left unset", stacklevel=2)
        return False
    if found is None:
        return False
    environ.setdefault(LOCAL_RANK, str(found[0]))
    environ.setdefault(LOCAL_WORLD_SIZE, str(found[1]))
    return True


def export_single_process(world_size=None, environ=None):
    """For a process that no launcher started (an MPI world of ``world_size`` 1;
    ``MPI.COMM_WORLD``'s size by default): local rank 0 of 1, each only where unset.
    Does nothing in a larger world."""
    environ = os.environ if environ is None else environ
    if world_size is None:
        from mpi4py import MPI  # (here: importing this module must not start MPI)

        world_size = MPI.COMM_WORLD.Get_size()
    if world_size == 1:
        environ.setdefault(LOCAL_RANK, "0")
        environ.setdefault(LOCAL_WORLD_SIZE, "1")


def export_node_split(node_rank, node_size, environ=None):
    """``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` from a node split made elsewhere
    (``MPI.COMM_WORLD.Split_type(COMM_TYPE_SHARED)``), each only where unset."""
    environ = os.environ if environ is None else environ
    environ.setdefault(LOCAL_RANK, str(node_rank))
    environ.setdefault(LOCAL_WORLD_SIZE, str(node_size))


def _count(environ, name):
    text = environ[name]
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"the launcher set {name}={text!r}, which is not a count") from None
    if value < 0:
        raise ValueError(f"the launcher set {name}={text!r}, which is not a count")
    return value
