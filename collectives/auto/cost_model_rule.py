"""The cost-model rule: what ``auto`` picks from the algorithms' message counts and
bytes alone, latency-optimal algorithms below 64 KiB and bandwidth-optimal ones above
(``COLLECTIVES_AUTO_RULE=cost-model``; the choice among the library's own algorithms
where MPI cannot take a call; the device rule across nodes)."""

from collections.abc import Callable
from dataclasses import dataclass

SMALL = 64 * 1024  # bytes: below this, latency (message count) dominates
LARGE = 1024 * 1024  # bytes
# Below this, the MPI library's own collective: each of our messages costs a Python
# round trip (~10 us) where MPI's cost ~1 us, and at this size latency is all there is.
NATIVE_BELOW = 4 * 1024  # bytes


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
