"""Two-level algorithms: first the node, then the network, then the node again.

    2 nodes x 4 ranks, allreduce ``hierarchical``:

    node 0  [r0 r1 r2 r3]   1. ring reduce-scatter in each node: local rank l holds
    node 1  [r4 r5 r6 r7]      block l (of 4) summed over its node
              │  │  │  │    2. ring allreduce of block l among the ranks with local
              r0↔r4 r1↔r5      rank l, one per node: every rank drives the network
              r2↔r6 r3↔r7      at once, each with a quarter of the bytes
                            3. ring allgather in each node

With N nodes of k ranks and n bytes, each rank sends 2(N-1)/N · n/k bytes over the
network, and the k ranks of a node share its link: 2(N-1)/N · n per node link, where a
flat ring over p = N·k ranks puts 2(p-1)/p · n on each link it crosses (at 2 × 4,
n against 1.75 n). This is NCCL's and Horovod's two-level scheme. Buffers of 2 MiB and more (float32) go
through the three steps in up to 8 pieces, in order, so that the network carries one
piece while the node reduces the next and gathers the previous one: about the
network's time plus an eighth of the node's, where the steps in turn would add all of
it (measured at 2 × 4 on 1 Gbit/s links at 16-64 MiB: 1.64-1.79× the flat ring, within
3% of the link's bound; 4 pieces gave 1.49-1.61×, none 1.46-1.49×). Nodes of unequal
size work: with m ranks on the smallest node, local ranks ≥ m first hand their input to
local rank ``l mod m`` (which adds it to its own) and get the result back at the end,
so steps 1-3 run among m ranks per node.

``hierarchical_leader`` (small messages, fewest steps): binomial reduce to each node's
leader (its lowest rank), recursive-doubling allreduce among the leaders, binomial
broadcast in the node: lg k + lg N + lg k messages of n bytes on the critical path.

Broadcast ``hierarchical``: scatter-allgather broadcast among one rank per node (the
root on its node, the leader elsewhere), then a binomial broadcast in each node. The
network carries ≈ 2(N-1)/N · n per node instead of every rank's copy.

Allgather ``hierarchical``: binomial gather to each node's leader, ring allgather of the
nodes' (unequal) segments among the leaders, binomial broadcast of the whole result in
each node. Reduce-scatter ``hierarchical``: binomial reduce of the whole buffer to each
node's leader, ring reduce-scatter of the nodes' segments among the leaders, then each
leader hands its node's ranks their blocks. Each node's link carries (N-1)/N of the
result once, as one node-sized rank would. Where ranks are not placed node by node,
the leaders work on a copy in node order (one more copy on each leader).

Every step is a flat algorithm of this package run on a group of ranks (ring helpers,
or :func:`collectives.schedule.embed` of a whole schedule): nothing is written twice.
The node's steps are messages, which MPI carries over the node's shared memory. They
do not use the ``shm`` executor (one window per node, fences): measured on one node of
this machine from 1 MiB (bench/results/xeon-2vcpu-mpich5/algorithm-sweep), plain ``shm``
allgather took 1.15-1.64x the best message algorithm's time at 2 ranks and, from 8
MiB, 1.16-1.35x at 4; only its registered form, on buffers the caller registers, is
faster, and a step's pieces are the library's own workspace.
The builders take the communicator's :class:`collectives.topology.Topology`; with
one node or one rank per node they reduce to the flat algorithm they are made of.
"""

from ..schedule import Schedule, embed, sl
from ..topology import Topology
from . import binomial, recursive_doubling, scatter_allgather
from ._layout import block_bounds
from .ring import allgather_ring, reduce_scatter_ring


class _Place:
    """Where ``rank`` sits in ``topology``: its node's ranks, its local rank, the
    leaders (each node's lowest rank) and its node's index."""

    def __init__(self, rank, size, topology):
        topology = topology or Topology.single(size)
        if topology.size != size:
            raise ValueError(f"topology has {topology.size} ranks; the call has {size}")
        self.topology = topology
        self.node_index = topology.node_of[rank]
        self.node = topology.nodes[self.node_index]
        self.local = topology.local_rank[rank]
        self.leaders = list(topology.across[0])


def allreduce(rank, size, count, *, topology=None, **_):
    s = Schedule([])
    place = _Place(rank, size, topology)
    node, local = place.node, place.local
    m = min(place.topology.ranks_per_node)
    whole_in, whole_out = sl("in", 0, count), sl("out", 0, count)
    if local >= m:  # past the smallest node's size: a core rank works for this one
        keeper = node[local % m]
        s.send(keeper, whole_in)
        s.recv(keeper, whole_out)
        return s
    extras = node[local + m::m]
    source = "in"
    for extra in extras:  # fold their inputs into ours (in local-rank order)
        s.need_tmp(count)
        s.recv(extra, sl("tmp", 0, count))
        s.reduce(whole_out, sl(source, 0, count), sl("tmp", 0, count))
        source = "out"
    core = node[:m]
    across = list(place.topology.across[local])
    pieces = pipeline_pieces(count) if m > 1 and len(across) > 1 else [(0, count)]
    bounds = [[lo + b for b in block_bounds(hi - lo, m)] for lo, hi in pieces]
    # The node's steps receive into tmp from 0, the network's after them: a piece's
    # network step need not wait for the next piece's node step to free its slots.
    net_slots = 2 * max(-(-(hi - lo) // m) for lo, hi in pieces)
    if m > 1:
        for b in bounds:  # 1. in the node, piece after piece
            reduce_scatter_ring(s, local, m, b, core, partial_in_out=True, source=source)
    elif source == "in":
        s.copy(whole_out, whole_in)
    if len(across) > 1:
        for b in bounds:  # 2. across the nodes: piece k while the node reduces piece k+1
            inner = [b[local] + x for x in block_bounds(b[local + 1] - b[local], len(across))]
            reduce_scatter_ring(s, place.node_index, len(across), inner, across, partial_in_out=True, source="out",
                                slots_at=net_slots)
            allgather_ring(s, place.node_index, len(across), inner, across)
    if m > 1:
        for b in bounds:  # 3. in the node: piece k while the network carries piece k+1
            allgather_ring(s, local, m, b, core)
    for extra in extras:
        s.send(extra, whole_out)
    return s


# Large buffers go through the three steps in pieces, so that the network's step on one
# piece overlaps the node's steps on the others (as NCCL pipelines its two-level
# schedule): a piece is at least PIPELINE_MIN elements (1 MiB of float32), and there are
# at most PIPELINE_PIECES of them (each costs every rank 2(k-1) + 2(N-1) more messages;
# 8 beat 4 on the testbed at 2 x 4, 16 and 64 MiB).
PIPELINE_MIN = 1 << 18
PIPELINE_PIECES = 8


def pipeline_pieces(count):
    """The ``(lo, hi)`` element ranges the two-level allreduce works through in turn."""
    pieces = max(1, min(PIPELINE_PIECES, count // PIPELINE_MIN))
    edges = block_bounds(count, pieces)
    return [(edges[i], edges[i + 1]) for i in range(pieces)]


def allreduce_leader(rank, size, count, *, topology=None, **_):
    s = Schedule([])
    place = _Place(rank, size, topology)
    k = len(place.node)
    # 1. reduce to the leader: its sum lands in out (a non-leader's partial sums in tmp)
    embed(s, binomial.reduce(place.local, k, count, root=0), place.node,
          {"in": ("in", 0), "out": ("out", 0), "tmp": ("tmp", 0)})
    if place.local == 0 and len(place.leaders) > 1:  # 2. allreduce among leaders, in place
        embed(s, recursive_doubling.allreduce(place.node_index, len(place.leaders), count), place.leaders,
              {"in": ("out", 0), "out": ("out", 0), "tmp": ("tmp", 0)})
    # 3. broadcast in the node
    embed(s, binomial.broadcast(place.local, k, count, root=0), place.node, {"out": ("out", 0)})
    return s


def broadcast(rank, size, count, *, root=0, topology=None, **_):
    s = Schedule([])
    place = _Place(rank, size, topology)
    root_node = place.topology.node_of[root]
    heads = list(place.leaders)
    heads[root_node] = root  # the root speaks for its node
    if rank == heads[place.node_index] and len(heads) > 1:
        embed(s, scatter_allgather.broadcast(place.node_index, len(heads), count, root=root_node), heads,
              {"out": ("out", 0)})
    embed(s, binomial.broadcast(place.local, len(place.node), count, root=place.node.index(heads[place.node_index])),
          place.node, {"out": ("out", 0)})
    return s


class _NodeOrder:
    """Positions of the ranks' blocks when the blocks are laid out node by node: the
    identity where ranks are placed node by node (``contiguous``)."""

    def __init__(self, topology, block_sizes):
        order = [r for node in topology.nodes for r in node]
        self.contiguous = topology.contiguous
        self.start = {}
        at = 0
        for r in order:
            self.start[r] = at
            at += block_sizes[r]
        self.total = at
        self.segments = [self.start[node[0]] for node in topology.nodes] + [at]


def allgather(rank, size, count, *, topology=None, **_):
    """``count`` is one rank's block; ``out`` holds the ``size`` blocks in rank order."""
    s = Schedule([])
    place = _Place(rank, size, topology)
    order = _NodeOrder(place.topology, [count] * size)
    # The node-ordered result: out itself, or a staging area in tmp past the steps' own
    # workspace (the gather's, at most one node's blocks).
    k = len(place.node)
    stage_at = k * count
    buf, at = ("out", 0) if order.contiguous else ("tmp", stage_at)
    if not order.contiguous:
        s.need_tmp(stage_at + size * count)
    embed(s, binomial.gather(place.local, k, count, root=0), place.node,
          {"in": ("in", 0), "out": (buf, at + order.segments[place.node_index]), "tmp": ("tmp", 0)})
    if place.local == 0 and len(place.leaders) > 1:
        allgather_ring(s, place.node_index, len(place.leaders), [at + x for x in order.segments], place.leaders,
                       buf=buf)
    embed(s, binomial.broadcast(place.local, k, size * count, root=0), place.node, {"out": (buf, at)})
    if not order.contiguous:
        for r in range(size):
            s.copy(sl("out", r * count, (r + 1) * count), sl(buf, at + order.start[r], at + order.start[r] + count))
    return s


def reduce_scatter(rank, size, count, *, topology=None, **_):
    """``count`` is the whole input; rank r's result (``out``) is its block r, cut as
    ``numpy.array_split`` cuts it."""
    s = Schedule([])
    place = _Place(rank, size, topology)
    bounds = block_bounds(count, size)
    sizes = [bounds[r + 1] - bounds[r] for r in range(size)]
    order = _NodeOrder(place.topology, sizes)
    k = len(place.node)
    leader = place.node[0]
    # 1. the node's sum on its leader, in tmp[0:count] (the reduce's own workspace after it)
    embed(s, binomial.reduce(place.local, k, count, root=0), place.node,
          {"in": ("in", 0), "out": ("tmp", 0), "tmp": ("tmp", count)})
    if place.local != 0:
        s.recv(leader, sl("out", 0, sizes[rank]))
        return s
    s.need_tmp(count)
    # Where the node-ordered sum lives in tmp: in place, or copied past it. (The
    # reduce's workspace after it is free again: the plan orders the reuse.)
    summed = 0 if order.contiguous else count
    if not order.contiguous:
        s.need_tmp(2 * count)
        for r in range(size):
            s.copy(sl("tmp", summed + order.start[r], summed + order.start[r] + sizes[r]),
                   sl("tmp", bounds[r], bounds[r + 1]))
    nodes = len(place.leaders)
    if nodes > 1:  # 2. each leader ends with its node's segment summed over all nodes
        segments = [summed + x for x in order.segments]
        reduce_scatter_ring(s, place.node_index, nodes, segments, place.leaders, partial_in_out=True,
                            source="tmp", dest="tmp", slots_at=summed + count)
    for r in place.node:  # 3. hand out the blocks
        block = sl("tmp", summed + order.start[r], summed + order.start[r] + sizes[r])
        if r == rank:
            s.copy(sl("out", 0, sizes[r]), block)
        else:
            s.send(r, block)
    return s
