"""Process sets: sets of ranks that run collectives together, each on a
sub-communicator of its ranks (Horovod's ``ProcessSet``, ``add_process_set``,
``remove_process_set``, ``global_process_set``)."""

import zlib

import numpy as np
from mpi4py import MPI

from ....communicator import Communicator
from .runtime import initialized, start_queued

__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's): made from a list of
    ranks, registered by :func:`add_process_set` (or ``init(process_sets=...)``), which
    gives it ``process_set_id``; then passed as ``process_set=`` to any call."""

    process_set_id: int | None = None
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
        return self.ranks.index(initialized().comm.rank)

    def included(self):
        """Whether this process is in the set; None while its ranks are unknown."""
        return None if self.ranks is None else initialized().comm.rank in self.ranks

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


def _check_ranks_only(process_set):
    if process_set.ranks is None:
        raise NotImplementedError("process sets made from an MPI communicator are not implemented by "
                                  "collectives.horovod: make the ProcessSet from a list of ranks")


def _register(process_set):
    """Make ``process_set``'s sub-communicator (collective over every rank) and give it
    its id; raises on every rank if the ranks disagree or the set exists already."""
    state = initialized()
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
    state = initialized()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be an hvd.ProcessSet; got {type(process_set).__name__}")
    hset = state.sets.get(process_set.process_set_id)
    if hset is None or process_set.process_set_id == 0 or hset.process_set is not process_set:
        return False
    start_queued()
    for call in [c for c in state.running if c.set is hset]:
        call.complete()
    state.mpi_comm.Barrier()  # every rank removes it at the same point, as it added it
    _free_set(hset)
    del state.sets[process_set.process_set_id]
    process_set._invalidate()
    return True


def _set_of(process_set, what="process_set"):
    """The registered set ``process_set`` stands for, on a rank that belongs to it."""
    state = initialized()
    if process_set is None:
        process_set = global_process_set
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{what} must be an hvd.ProcessSet (hvd.global_process_set or one from add_process_set); "
                        f"got {type(process_set).__name__}")
    hset = state.sets.get(process_set.process_set_id)
    if hset is None or hset.process_set is not process_set:
        raise ValueError(f"{what}: {process_set} is not registered (add it with hvd.add_process_set)")
    if hset.comm is None:
        raise ValueError(f"{what}: rank {state.comm.rank} is not part of {process_set}")
    return hset


def _global_rank_in(hset, root_rank):
    """``root_rank`` (a global rank) as a rank of ``hset``'s communicator."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)) or root_rank not in hset.ranks:
        everyone = f"0..{initialized().comm.size - 1}"
        where = everyone if hset.process_set is global_process_set else f"the process set {hset.ranks}"
        raise ValueError(f"root_rank must be a rank in {where}; got {root_rank!r}")
    return hset.ranks.index(int(root_rank))


def _ranks(ranks):
    return ", ".join(map(str, ranks))
