"""The algorithm registry and the ``auto`` rule.

Every algorithm is a function ``build(rank, size, count, *, root, segment) ->
Schedule`` (see ``collectives.schedule``); ``count`` is the element count of the
input (for allgather and gather: of one rank's contribution; for scatter: of the block
each rank receives; for alltoall: of one block, a rank's input holding ``size`` of
them; for alltoallv: unused, the per-peer ``counts`` say it all). ``native`` is not
here: it is the MPI library's own collective, which the transport calls directly.
"""

from collections.abc import Callable
from dataclasses import dataclass
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
# tests/test_sim.py checks each against the full simulation.
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

SMALL = 64 * 1024  # bytes: below this, latency (message count) dominates
LARGE = 1024 * 1024  # bytes
# Below this, the MPI library's own collective: each of our messages costs a Python
# round trip (~10 us) where MPI's cost ~1 us, and at this size latency is all there is.
NATIVE_BELOW = 4 * 1024  # bytes


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


def two_level(topology):
    """True where the two-level algorithms have something to gain: several nodes, and
    more than one rank on some node."""
    return topology is not None and topology.node_count > 1 and max(topology.ranks_per_node) > 1


def _pof2(size):
    return size & (size - 1) == 0


# The library's algorithm on one node, (nbytes, size) -> name: each rule's ``flat``.
def _allreduce_flat(nbytes, size):
    if nbytes < SMALL:
        return "recursive_doubling"
    return "recursive_halving" if nbytes < LARGE and _pof2(size) else "ring"


def _reduce_scatter_flat(nbytes, size):
    return "recursive_halving" if nbytes < SMALL else "ring"


def _allgather_flat(nbytes, size):
    if nbytes < SMALL:
        return "recursive_doubling" if _pof2(size) else "bruck"
    return "ring"


def _broadcast_flat(nbytes, size):
    return "binomial" if nbytes < LARGE or size <= 2 else "scatter_allgather"


def _binomial_flat(nbytes, size):
    return "binomial"


def _alltoall_flat(nbytes, size):
    return "bruck" if nbytes < SMALL else "pairwise"


def _pairwise_flat(nbytes, size):
    return "pairwise"


@dataclass(frozen=True)
class CostModelRule:
    """How :func:`cost_model_choice` picks for one collective.

    ``flat(nbytes, size)``: the library's algorithm on one node (``size`` ranks);
    ``mpi_always``: the MPI library's own at every size unless the dtype rules it out
    (``own``); ``hierarchical``: with several nodes, ``hierarchical`` from ``SMALL``
    up; ``two_level_small``: with several nodes, the two-level algorithm below
    ``SMALL`` (None: ``flat``'s)."""

    flat: Callable[[int, int], str]
    mpi_always: bool = False
    hierarchical: bool = False
    two_level_small: str | None = None


# collective -> its cost-model rule. Latency-optimal algorithms (fewest messages) below
# SMALL, bandwidth-optimal ones above. Rabenseifner's allreduce (recursive_halving) and
# the recursive-doubling allgather only on a power of two of ranks, where they need no
# extra fold steps; scatter-allgather broadcast from LARGE and more than 2 ranks, where
# its 2(p-1)/p·n bytes per rank undercut binomial's lg p·n.
COST_MODEL_RULES = {
    "allreduce": CostModelRule(_allreduce_flat, hierarchical=True, two_level_small="hierarchical_leader"),
    "reduce_scatter": CostModelRule(_reduce_scatter_flat, hierarchical=True),
    "allgather": CostModelRule(_allgather_flat, hierarchical=True),
    "broadcast": CostModelRule(_broadcast_flat, hierarchical=True),
    "reduce": CostModelRule(_binomial_flat),
    "gather": CostModelRule(_binomial_flat, mpi_always=True),
    "scatter": CostModelRule(_binomial_flat, mpi_always=True),
    "alltoall": CostModelRule(_alltoall_flat, mpi_always=True),
    "alltoallv": CostModelRule(_pairwise_flat, mpi_always=True),
}


def cost_model_choice(collective, nbytes, size, own=False, topology=None):
    """What ``auto`` picks where no measured table covers the world size; ``own``: among
    the library's own algorithms only (for dtypes the MPI library cannot move).

    From the cost model (``docs/algorithms.md``), by the collective's rule in
    ``COST_MODEL_RULES``: the MPI library's own collective for tiny buffers (below
    ``NATIVE_BELOW``: its per-message latency is a tenth of ours), latency-optimal
    algorithms (fewest messages) below 64 KiB, bandwidth-optimal ones above.
    Gather, scatter, alltoall and alltoallv: the MPI library's own at every size, since MPICH's are
    the same schedules (binomial trees; Bruck and pairwise exchange) at a tenth of our
    per-message cost.
    ``nbytes`` is the input size (allgather and gather: the gathered size; scatter: the
    root's whole buffer; alltoall and alltoallv: a rank's whole input).

    With several nodes (``topology``), the two-level algorithms from 64 KiB (the
    network, not the per-message cost, decides there), the leader-based allreduce
    below: see ``hierarchical``.
    """
    rule = COST_MODEL_RULES.get(collective, COST_MODEL_RULES["reduce"])  # any other name: reduce's
    if rule.mpi_always:
        return rule.flat(nbytes, size) if own else "native"
    if nbytes < NATIVE_BELOW and not own:
        return "native"
    if rule.hierarchical and two_level(topology):
        if nbytes >= SMALL:
            return "hierarchical"
        if rule.two_level_small is not None:
            return rule.two_level_small
    return rule.flat(nbytes, size)


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
