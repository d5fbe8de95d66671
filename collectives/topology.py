"""Which ranks share a node: learned once per communicator, given to the two-level
algorithms and to ``auto``.

    node 0: ranks 0 1 2      node 1: ranks 3 4 5 6      (uneven nodes work)
            local 0 1 2              local 0 1 2 3

A :class:`Topology` is the list of nodes, each the ascending list of its ranks. A
rank's *local rank* is its index on its node; the node's *leader* is its local rank 0
(its lowest rank). The cross-node groups (``across``) are the ranks of one local rank,
one per node. Nodes are numbered by their lowest rank, so every rank numbers them
the same way whatever order MPI placed the ranks in.

:func:`learn` asks MPI (``Split_type(COMM_TYPE_SHARED)``: ranks that can share memory)
and allgathers each rank's node; :meth:`Topology.from_labels` takes any per-rank
labels, for a simulated layout or to override MPI's view (``Communicator(nodes=...)``).
:func:`measure_link` times the network between the nodes (``auto``'s tables of several
nodes are keyed by it, and ``python -m collectives.tools.bench.link`` reports it).
"""

import statistics
import time
from dataclasses import dataclass
from functools import cached_property, lru_cache

LINK_PROBE_BYTES = 1 << 20  # what each stream sends when auto's key is measured


@dataclass(frozen=True)
class Topology:
    """The nodes of a communicator: ``nodes[j]`` is the ascending tuple of the ranks on
    node j, and nodes are in the order of their lowest rank."""

    nodes: tuple

    def __post_init__(self):
        ranks = sorted(r for node in self.nodes for r in node)
        if ranks != list(range(len(ranks))) or any(not node for node in self.nodes):
            raise ValueError(f"nodes must split ranks 0..p-1 into non-empty groups; got {self.nodes!r}")
        if any(list(node) != sorted(node) for node in self.nodes) or \
                [node[0] for node in self.nodes] != sorted(node[0] for node in self.nodes):
            raise ValueError(f"nodes must be ascending and ordered by their lowest rank; got {self.nodes!r}")

    @classmethod
    def from_labels(cls, labels):
        """The topology in which ranks with equal ``labels[r]`` share a node."""
        labels = list(labels)
        groups = {}
        for rank, label in enumerate(labels):
            groups.setdefault(label, []).append(rank)
        return cls(tuple(sorted((tuple(g) for g in groups.values()), key=lambda g: g[0])))

    @classmethod
    def uniform(cls, size, ranks_per_node):
        """``size`` ranks placed node by node, ``ranks_per_node`` on each (the last node
        holds the rest)."""
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive integer; got {ranks_per_node!r}")
        return cls.from_labels(r // ranks_per_node for r in range(size))

    @classmethod
    @lru_cache(maxsize=256)
    def single(cls, size):
        """Every rank on one node. One object per size: the two-level schedules ask for
        it at every rank they are built for, and its cached tables are then made once."""
        return cls((tuple(range(size)),))

    @cached_property
    def size(self):
        """The number of ranks."""
        return sum(len(node) for node in self.nodes)

    @property
    def node_count(self):
        return len(self.nodes)

    @cached_property
    def node_of(self):
        """``node_of[r]``: the node of rank r."""
        table = [0] * self.size
        for j, node in enumerate(self.nodes):
            for r in node:
                table[r] = j
        return tuple(table)

    @cached_property
    def local_rank(self):
        """``local_rank[r]``: rank r's index on its node."""
        table = [0] * self.size
        for node in self.nodes:
            for i, r in enumerate(node):
                table[r] = i
        return tuple(table)

    @cached_property
    def across(self):
        """The cross-node groups: ``across[l]`` holds the rank of local rank l on every
        node, in node order, for each local rank every node has (``across[0]``: the
        leaders). A two-level schedule's network step runs within these groups, over
        the communicator's own messages (no MPI communicator is made for them)."""
        return tuple(tuple(node[local] for node in self.nodes) for local in range(min(self.ranks_per_node)))

    @property
    def ranks_per_node(self):
        """The node sizes, in node order."""
        return tuple(len(node) for node in self.nodes)

    @property
    def contiguous(self):
        """True when every node holds consecutive ranks (host-major placement)."""
        return all(node[-1] - node[0] == len(node) - 1 for node in self.nodes)

    def describe(self):
        """A short text such as ``2 nodes x 4 ranks`` or ``2 nodes (3+1 ranks)``."""
        sizes = self.ranks_per_node
        if len(set(sizes)) == 1:
            return f"{len(sizes)} node{'s' * (len(sizes) > 1)} x {sizes[0]} rank{'s' * (sizes[0] > 1)}"
        return f"{len(sizes)} nodes ({'+'.join(map(str, sizes))} ranks)"

    def key(self):
        """How ``auto``'s tables name the layout: ``"1x4"``, ``"2x2"``, ``"3+1"``."""
        sizes = self.ranks_per_node
        return f"{len(sizes)}x{sizes[0]}" if len(set(sizes)) == 1 else "+".join(map(str, sizes))


def learn(mpi_comm, node_comm=None):
    """The topology of ``mpi_comm`` as MPI sees it (collective): ranks that can share
    memory are one node. ``node_comm``: those ranks of ``mpi_comm`` as the caller
    already has them (``Split_type(COMM_TYPE_SHARED, key=rank)``), else made and freed
    here."""
    own = node_comm is None
    if own:
        node_comm = mpi_comm.Split_type(_shared_type(), key=mpi_comm.Get_rank())
    try:
        # the node's label: the lowest communicator rank on it (the node's rank 0, by key)
        leader = node_comm.bcast(mpi_comm.Get_rank(), root=0)
    finally:
        if own:
            node_comm.Free()
    return Topology.from_labels(mpi_comm.allgather(leader))


def _shared_type():
    from mpi4py import MPI

    return MPI.COMM_TYPE_SHARED


def measure_link(mpi_comm, topology, nbytes=LINK_PROBE_BYTES, repeats=3):
    """The node-to-node rate in bytes per second (collective; the same value on every
    rank), or None on one node.

    Every node sends to the next one round a ring of the nodes and receives from the
    previous one, at once, as a ring collective keeps every link busy: each rank of
    local rank i sends ``nbytes`` to the rank of local rank i on the next node, where
    every node has one (with k ranks per node, the node's link shared by k streams, as a
    two-level collective shares it). The rate is a node's bytes over the slowest rank's
    time, the median of ``repeats`` rounds after one that warms the connections up.
    ``mpi_comm`` should carry no other traffic (a Communicator's own duplicate)."""
    import numpy as np
    from mpi4py import MPI

    if topology.node_count < 2:
        return None
    nodes = topology.nodes
    rank = mpi_comm.Get_rank()
    streams = min(len(n) for n in nodes)  # local ranks present on every node
    node, local = topology.node_of[rank], topology.local_rank[rank]
    send, receive = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    times = []
    for _ in range(repeats + 1):
        mpi_comm.Barrier()
        start = time.perf_counter()
        if local < streams:
            after, before = nodes[(node + 1) % len(nodes)][local], nodes[(node - 1) % len(nodes)][local]
            MPI.Request.Waitall([mpi_comm.Isend(send, dest=after, tag=7),
                                 mpi_comm.Irecv(receive, source=before, tag=7)])
        times.append(mpi_comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return streams * nbytes / statistics.median(times[1:])
