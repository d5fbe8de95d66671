"""The algorithm registry.

Every algorithm is a function ``build(rank, size, count, *, root, segment) ->
Schedule`` (see ``collectives.schedule``); ``count`` is the element count of the
input (for allgather and gather: of one rank's contribution; for scatter: of the block
each rank receives; for alltoall: of one block, a rank's input holding ``size`` of
them; for alltoallv: unused, the per-peer ``counts`` say it all). ``native`` is not
here: it is the MPI library's own collective, which the transport calls directly.
"""

from typing import Any

from . import (
    alltoall,
    binomial,
    bruck,
    direct,
    hierarchical,
    peer,
    pipeline,
    recursive_doubling,
    recursive_halving,
    ring,
    scatter_allgather,
    shm,
    tree,
)
from ._layout import block_bounds  # noqa: F401 (used by the communicator)

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "gather", "scatter", "alltoall")
ROOTED = ("broadcast", "reduce", "gather", "scatter")  # the collectives that take a root
# Collectives whose blocks differ per peer: their plans are keyed by the per-peer counts,
# not one count, so the sweeps over COLLECTIVES (which size every input from one count)
# leave them out and they have tests of their own.
VARIABLE = ("alltoallv",)

BUILDERS: dict[str, dict[str, Any]] = {
    "allreduce": {
        "ring": ring.allreduce,
        "tree": tree.allreduce,
        "recursive_halving": recursive_halving.allreduce,
        "recursive_doubling": recursive_doubling.allreduce,
        "direct": direct.allreduce,
        "hierarchical": hierarchical.allreduce,
        "hierarchical_leader": hierarchical.allreduce_leader,
        "shm": shm.allreduce,
        "one_shot": peer.allreduce_one_shot,
        "two_shot": peer.allreduce_two_shot,
        "leader": peer.allreduce_leader,
    },
    "reduce_scatter": {
        "ring": ring.reduce_scatter,
        "recursive_halving": recursive_halving.reduce_scatter,
        "direct": direct.reduce_scatter,
        "hierarchical": hierarchical.reduce_scatter,
        "shm": shm.reduce_scatter,
        "one_shot": peer.reduce_scatter,
        "leader": peer.reduce_scatter_leader,
    },
    "allgather": {
        "ring": ring.allgather,
        "recursive_doubling": recursive_doubling.allgather,
        "bruck": bruck.allgather,
        "direct": direct.allgather,
        "hierarchical": hierarchical.allgather,
        "shm": shm.allgather,
        "one_shot": peer.allgather,
        "leader": peer.allgather_leader,
    },
    "broadcast": {
        "binomial": binomial.broadcast,
        "pipeline": pipeline.broadcast,
        "scatter_allgather": scatter_allgather.broadcast,
        "direct": direct.broadcast,
        "hierarchical": hierarchical.broadcast,
        "shm": shm.broadcast,
        "one_shot": peer.broadcast,
        "leader": peer.broadcast_leader,
    },
    "reduce": {
        "binomial": binomial.reduce,
        "direct": direct.reduce,
        "shm": shm.reduce,
        "one_shot": peer.reduce,
    },
    "gather": {
        "binomial": binomial.gather,
    },
    "scatter": {
        "binomial": binomial.scatter,
    },
    "alltoall": {
        "pairwise": alltoall.pairwise,
        "bruck": alltoall.bruck,
    },
    "alltoallv": {
        "pairwise": alltoall.pairwise,
    },
}

# Deterministic mode: the algorithms that can reduce in rank order (built with
# ``ordered=True``, every reduction is the left fold x0 op x1 op … op x(p-1)).
# The collectives not listed reduce nothing: every algorithm of theirs, native
# included, moves the same bits whatever the order.
ORDERED = {"allreduce": ("direct", "shm", "one_shot", "two_shot", "leader"),
           "reduce_scatter": ("direct", "shm", "one_shot", "leader"), "reduce": ("direct", "shm", "one_shot")}

# Shared-memory algorithms: their plans address the node's shared window (``shm``) and
# synchronise with fences, so only ranks that share memory run them, on host arrays; the
# communicator cuts them in segments of ``shm.DEFAULT_SLOT_BYTES`` (its ``shm_slot``).
SHARED_MEMORY = frozenset((collective, name) for collective, names in BUILDERS.items() for name in names
                          if name == "shm")

# Peer-read algorithms: every rank reads the others' inputs where they are, between two
# fences (``peer``); only ranks of one node whose device memory they can open (CUDA IPC)
# run them, on device arrays; the in-process runner and the simulator lay the inputs
# side by side (``registered`` defaults to ``(count, 0)``).
PEER_READS = frozenset((collective, name) for collective, names in peer.ALGORITHMS.items() for name in names)

# Two-level algorithms: their builders take the communicator's node layout (``topology``,
# a :class:`collectives.topology.Topology`); with one node they run as flat ones.
TOPOLOGICAL = frozenset((collective, name) for collective, names in BUILDERS.items() for name in names
                        if name.startswith("hierarchical"))

# Rotation-symmetric algorithms: where every block is the same size, rank r's plan is
# rank 0's with every peer q read as (q + r) mod p and every block b as (b + r) mod p.
# The simulator then times p ranks through rank 0's plan alone (a few, with nodes).
# The deterministic (ordered) forms fold in rank order and are not symmetric; alltoallv
# is symmetric where its counts are circulant (counts[i][j] depends on j - i mod p).
# tests/unit/test_sim.py checks each against the full simulation.
# The shared-memory and peer-read ones send nothing: rank r copies, folds and fences as
# rank 0 does, on its own share (and slot) of each segment, so with equal shares every
# rank's steps are rank 0's, at the same times (fences hold everyone alike).
SYMMETRIC = frozenset({("allreduce", "ring"), ("reduce_scatter", "ring"), ("allgather", "ring"),
                       ("allreduce", "direct"), ("reduce_scatter", "direct"), ("allgather", "direct"),
                       ("alltoall", "pairwise"), ("alltoall", "bruck"), ("allgather", "bruck"),
                       ("alltoallv", "pairwise"),
                       ("allreduce", "shm"), ("reduce_scatter", "shm"), ("allgather", "shm"),
                       ("allreduce", "one_shot"), ("allreduce", "two_shot"), ("reduce_scatter", "one_shot"),
                       ("allgather", "one_shot")})

# Two-level algorithms symmetric under a shift by one node: with equal nodes of k ranks
# placed node by node (and equal blocks), rank r + k's plan is rank r's with every peer
# q read as q + k. Their steps across nodes are rings; those in a node either rings or
# rooted at the node's leader, the same on every node.
NODE_SYMMETRIC = frozenset({("allreduce", "hierarchical"), ("allgather", "hierarchical"),
                            ("reduce_scatter", "hierarchical")})

# Algorithms cut into pipelining segments; their default segment size in bytes.
SEGMENTED = {("allreduce", "tree"): tree.DEFAULT_SEGMENT_BYTES,
             ("broadcast", "pipeline"): pipeline.DEFAULT_SEGMENT_BYTES}


def algorithms(collective):
    """The algorithm names ``collective`` accepts, ``"native"`` and ``"auto"`` included."""
    if collective not in BUILDERS:
        raise ValueError(f"collective must be one of {', '.join(BUILDERS)}; got {collective!r}")
    return tuple(BUILDERS[collective]) + ("native", "auto")


def check_algorithm(collective, algorithm):
    if isinstance(algorithm, str) and algorithm in _VALID.get(collective, ()):  # the common case
        return algorithm
    names = algorithms(collective)
    if not isinstance(algorithm, str) or algorithm not in names:
        raise ValueError(f"algorithm for {collective} must be one of {', '.join(names)}; got {algorithm!r}")
    return algorithm


_VALID = {collective: frozenset(algorithms(collective)) for collective in BUILDERS}


def check_ordered(collective, algorithm):
    """Raise ``ValueError`` unless ``algorithm`` can run in deterministic mode."""
    if collective in ORDERED and algorithm not in ORDERED[collective]:
        raise ValueError(f"algorithm {algorithm!r} cannot reduce in rank order, which deterministic mode needs; "
                         f"for {collective} it allows {', '.join(ORDERED[collective])} (or 'auto')")
    return algorithm


def build(collective, algorithm, rank, size, count, *, root=0, segment=1, ordered=False, counts=None, topology=None,
          registered=None, inplace=False):
    """The schedule of ``algorithm`` for one rank; ``ordered``: reductions in rank order
    (deterministic mode; only the algorithms in ``ORDERED`` can); ``counts``: this
    rank's ``(send, recv)`` element counts per peer (the collectives in ``VARIABLE``);
    ``topology``: the node layout (the algorithms in ``TOPOLOGICAL``; None: one node);
    ``registered``: ``(stride, offset)`` in elements where every rank's input is a
    registered buffer (the shared-memory algorithms of ``shm.REGISTERED``, and the
    ``PEER_READS``, for which it defaults to ``(count, 0)``); ``inplace``: ``in`` and
    ``out`` are one buffer (the ``PEER_READS`` need to know: the others read this rank's
    input in place)."""
    builder = BUILDERS[collective][algorithm]
    if (collective, algorithm) in PEER_READS:  # rank order always: ordered or not, the same plan
        return builder(rank, size, count, root=root, registered=registered, inplace=inplace)
    if registered is not None:
        if (collective, algorithm) not in SHARED_MEMORY or collective not in shm.REGISTERED:
            raise ValueError(f"{collective} {algorithm!r} has no form for registered buffers "
                             f"(the shm algorithm of {', '.join(shm.REGISTERED)} and the peer-read ones have)")
        return builder(rank, size, count, root=root, segment=segment, registered=tuple(registered))
    if (collective, algorithm) in TOPOLOGICAL:
        return builder(rank, size, count, root=root, segment=segment, topology=topology)
    if collective in VARIABLE:
        return builder(rank, size, count, counts=counts)
    if ordered and collective in ORDERED:
        check_ordered(collective, algorithm)
        return builder(rank, size, count, root=root, segment=segment, ordered=True)
    return builder(rank, size, count, root=root, segment=segment)
