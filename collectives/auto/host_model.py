"""The host cost model: the α-β-γ times of MPI's own collective and of the library's
algorithms on host buffers (:func:`predict`), and the conservative rule built on it
(:func:`conservative_choice`: ``native`` unless the model predicts a ``GAIN_NEEDED``
gain). :mod:`collectives.auto.calibration` measures its parameters on this machine."""

from dataclasses import dataclass

from ..algorithms import BUILDERS
from .cost_model_rule import two_level

GAIN_NEEDED = 2.0  # the conservative rule leaves native only for this predicted speedup


@dataclass(frozen=True)
class CostModel:
    """The conservative rule's α-β-γ parameters, in seconds and seconds per byte.

    ``alpha`` is one of this library's messages in a node (a Python round trip through
    the plan engine), ``mpi_alpha`` one of MPI's own (about a tenth); ``beta`` and
    ``gamma``, per byte sent and reduced, are the same for both (the same memory and
    transport carry the bytes). Between nodes a message costs ``net_alpha`` (ours) or
    ``mpi_net_alpha`` (MPI's), plus ``net_beta`` per byte on its node's link, which
    the node's ranks share. The defaults are the calibrations shipped in
    ``bench/results``: in a node, the joint fit at 2 and 4 ranks of
    ``epyc-2vcpu-mpich5/README.md`` (α 22 µs, rounded to 20; β 0.166 ns/B; γ 0.093 ns/B);
    between nodes, the two-level fit of ``testbed-1gbit/README.md`` (α′ 50 µs for ours,
    MPI's taken as that less our extra 18 µs per message; β′ 8.43 ns/B, 1 Gbit/s).

    ``alpha`` is a message that waits for the one before it (a step of a ring, say).
    ``message``, where set, is one more of ours in the same round, sent while the
    round's first is in flight (``direct``'s p - 1 at once): with more ranks than
    cores a step costs a wait for the peer to be scheduled, which the messages of one
    round share, so it is less than ``alpha`` there (:mod:`collectives.auto.calibration`
    measures both). None: ``alpha``, as the shipped model has it."""

    alpha: float = 20e-6
    mpi_alpha: float = 2e-6
    beta: float = 0.166e-9
    gamma: float = 0.093e-9
    net_alpha: float = 50e-6
    mpi_net_alpha: float = 32e-6
    net_beta: float = 8.43e-9
    message: float | None = None


SHIPPED_MODEL = CostModel()


def _lg(x):
    """⌈lg x⌉ for x >= 1."""
    return (int(x) - 1).bit_length()


class _Net:
    """The layout as the model sees it: p ranks on N nodes of at most k ranks (m on the
    smallest), ``blocked`` where each node holds consecutive ranks. For a flat schedule
    each method says how many of a node's ranks send across the network at once in a
    step where rank r's partner is at distance d (0: the step stays in the nodes)."""

    def __init__(self, size, topology):
        sizes = topology.ranks_per_node if topology is not None and topology.size == size else (size,)
        self.p, self.N, self.k, self.m = size, len(sizes), max(sizes), min(sizes)
        self.blocked = topology is None or topology.contiguous
        self.even = self.k == self.m and self.k & (self.k - 1) == 0  # equal nodes of 2^j ranks

    def xor(self, d):  # partners r ^ d (recursive doubling and halving)
        if self.N == 1:
            return 0
        if not self.blocked:
            return self.k
        return (0 if d < self.k else self.k) if self.even else min(d, self.k)

    def shift(self, d):  # partners r ± d (ring: d = 1; Bruck)
        return 0 if self.N == 1 else min(d, self.k) if self.blocked else self.k

    def tree(self, d):  # a binomial tree's step at distance d: one sender per subtree
        if self.N == 1:
            return 0
        if self.blocked:
            return 0 if self.even and d < self.k else 1
        return min(self.k, max(1, self.p // (2 * d * self.N)))


def _step(model, ours, nbytes, crossing=0, reduced=0.0):
    """One step in which each rank sends ``nbytes`` (and reduces ``reduced``), with
    ``crossing`` of a node's ranks sending across the network at once."""
    if crossing:
        alpha = model.net_alpha if ours else model.mpi_net_alpha
        return alpha + max(nbytes * model.beta, crossing * nbytes * model.net_beta) + reduced * model.gamma
    return (model.alpha if ours else model.mpi_alpha) + nbytes * model.beta + reduced * model.gamma


def _distances(p):
    """1, 2, 4, … p'/2, p' = 2^⌊lg p⌋: the steps of the recursive algorithms."""
    return [1 << i for i in range(p.bit_length() - 1)]


def _fold(model, net, ours, out, back):
    """Not a power of two: pairs fold onto p' ranks (``out`` bytes sent and reduced)
    and get ``back`` bytes at the end."""
    if net.p & (net.p - 1) == 0:
        return 0.0
    return _step(model, ours, out, net.shift(1), out) + _step(model, ours, back, net.shift(1))


def _recursive_doubling(model, net, n, ours):  # allreduce: the whole buffer at each step
    return sum(_step(model, ours, n, net.xor(d), n) for d in _distances(net.p)) + _fold(model, net, ours, n, n)


def _halving(model, net, n, ours, ascending, whole):
    """Recursive halving (reduce_scatter; with ``whole``, then recursive doubling back:
    Rabenseifner's allreduce). The halves n/2, n/4, … go at distances 1, 2, … where
    ``ascending`` (MPICH's allreduce), at p'/2, p'/4, … otherwise (this library's)."""
    ds = _distances(net.p)
    pairs = list(zip(ds if ascending else ds[::-1], (n / 2 ** (i + 1) for i in range(len(ds)))))
    t = sum(_step(model, ours, m, net.xor(d), m) for d, m in pairs)
    if whole:
        return 2 * t - sum(m for _, m in pairs) * model.gamma + _fold(model, net, ours, n, n)
    return t + _fold(model, net, ours, n, n / net.p)


def _ring(model, net, n, ours, reducing, plain):
    b = n / net.p
    return reducing * _step(model, ours, b, net.shift(1), b) + plain * _step(model, ours, b, net.shift(1))


def _direct(model, net, n, ours, rounds, reduced):
    """``rounds`` rounds in which every rank sends a block of n/p to every other rank,
    one message at a time through its port; the node's link carries its ranks'
    blocks for the other nodes. ``reduced``: bytes each rank reduces, (p-1)/p·n where
    it reduces its own block of every other rank's (docs/algorithms.md)."""
    p, k, b = net.p, net.k, n / net.p
    alpha, net_alpha = (model.alpha, model.net_alpha) if ours else (model.mpi_alpha, model.mpi_net_alpha)
    # The round's first message waits; the other k - 2 of the node go with it (model.message).
    node = alpha + (k - 2) * (model.message if ours and model.message is not None else alpha) if k > 1 else 0.0
    per_round = node + (p - k) * net_alpha + max((p - 1) * b * model.beta, k * (p - k) * b * model.net_beta)
    return rounds * per_round + reduced * model.gamma


def _doubling_gather(model, net, n, ours):  # allgather, recursive doubling
    p2 = 1 << (net.p.bit_length() - 1)
    return sum(_step(model, ours, d * n / p2, net.xor(d)) for d in _distances(net.p)) \
        + _fold(model, net, ours, n / net.p, n) - (n / net.p * model.gamma if net.p != p2 else 0.0)


def _bruck(model, net, n, ours, alltoall=False):
    steps, d = [], 1
    while d < net.p:
        steps.append((n / 2 if alltoall else min(d, net.p - d) * n / net.p, net.shift(d)))
        d *= 2
    return sum(_step(model, ours, m, c) for m, c in steps)


def _tree_distances(p):
    """1, 2, 4, … below p: the ⌈lg p⌉ steps of a binomial tree."""
    return [1 << i for i in range(_lg(p))]


def _binomial_broadcast(model, net, n, ours):  # n at each step, far partners first
    return sum(_step(model, ours, n, net.tree(d)) for d in _tree_distances(net.p))


def _binomial_reduce(model, net, n, ours):  # n reduced at each step, near partners first
    return sum(_step(model, ours, n, net.tree(d), n) for d in _tree_distances(net.p))


def _binomial_gather(model, net, n, ours):  # gather or scatter (n: the whole): d blocks at distance d
    return sum(_step(model, ours, min(d, net.p - d) * n / net.p, net.tree(d)) for d in _tree_distances(net.p))


def _pairwise(model, net, n, ours):  # alltoall: p - 1 steps; on average k(N-1)/N of a node's ranks cross
    return (net.p - 1) * _step(model, ours, n / net.p, net.k * (net.N - 1) / net.N)


# == what predict times, per collective ================================================
# Each function takes the model, the layout (_Net) and n, the bytes as a tuning table
# counts them, and returns (native, ours): the times of the classic schedules MPI's own
# collective may run, at MPI's cost per message and flat (predict keeps the least), and
# {algorithm: seconds} of this library's flat algorithms (where two tie, the rules take
# the one listed first).

def _allreduce_times(model, net, n):
    p = net.p
    native = [_recursive_doubling(model, net, n, False), _halving(model, net, n, False, True, True),
              _ring(model, net, n, False, p - 1, p - 1)]
    ours = {"recursive_doubling": _recursive_doubling(model, net, n, True),
            "recursive_halving": _halving(model, net, n, True, False, True),
            "ring": _ring(model, net, n, True, p - 1, p - 1),
            "direct": _direct(model, net, n, True, 2, (p - 1) / p * n)}
    return native, ours


def _reduce_scatter_times(model, net, n):
    p = net.p
    native = [_halving(model, net, n, False, False, False), _ring(model, net, n, False, p - 1, 0)]
    ours = {"recursive_halving": _halving(model, net, n, True, False, False),
            "ring": _ring(model, net, n, True, p - 1, 0),
            "direct": _direct(model, net, n, True, 1, (p - 1) / p * n)}
    return native, ours


def _allgather_times(model, net, n):  # n: the gathered size
    p = net.p
    native = [_doubling_gather(model, net, n, False), _bruck(model, net, n, False),
              _ring(model, net, n, False, 0, p - 1)]
    ours = {"recursive_doubling": _doubling_gather(model, net, n, True), "bruck": _bruck(model, net, n, True),
            "ring": _ring(model, net, n, True, 0, p - 1), "direct": _direct(model, net, n, True, 1, 0)}
    return native, ours


def _broadcast_times(model, net, n):
    p = net.p
    scatter_allgather = [_binomial_gather(model, net, n, mine) + _ring(model, net, n, mine, 0, p - 1)
                         for mine in (False, True)]
    native = [_binomial_broadcast(model, net, n, False), scatter_allgather[0]]
    ours = {"binomial": _binomial_broadcast(model, net, n, True), "scatter_allgather": scatter_allgather[1]}
    return native, ours


def _reduce_times(model, net, n):  # MPI's long-message reduce: reduce_scatter, then a binomial gather
    p = net.p
    native = [_binomial_reduce(model, net, n, False),
              _halving(model, net, n, False, True, False) + _binomial_gather(model, net, n, False)]
    ours = {"binomial": _binomial_reduce(model, net, n, True),
            "direct": _direct(model, net, n, True, 2, (p - 1) / p * n)}
    return native, ours


def _gather_times(model, net, n):  # gather (n: the gathered size) and scatter (the root's buffer) alike
    return [_binomial_gather(model, net, n, False)], {"binomial": _binomial_gather(model, net, n, True)}


def _alltoall_times(model, net, n):  # n: a rank's whole input
    native = [_pairwise(model, net, n, False), _bruck(model, net, n, False, alltoall=True)]
    ours = {"pairwise": _pairwise(model, net, n, True), "bruck": _bruck(model, net, n, True, alltoall=True)}
    return native, ours


def _alltoallv_times(model, net, n):  # as alltoall's equal blocks
    return [_pairwise(model, net, n, False)], {"pairwise": _pairwise(model, net, n, True)}


# collective -> its flat times; ``tree`` and ``pipeline`` are left out (not modelled).
FLAT_TIMES = {"allreduce": _allreduce_times, "reduce_scatter": _reduce_scatter_times, "allgather": _allgather_times,
              "broadcast": _broadcast_times, "reduce": _reduce_times, "gather": _gather_times,
              "scatter": _gather_times, "alltoall": _alltoall_times, "alltoallv": _alltoallv_times}


# This library's two-level algorithms (docs/algorithms.md's second table; N nodes, k
# ranks per node: the smallest node's, m, for ``hierarchical`` allreduce, which folds
# the others' extra ranks in first): {algorithm: seconds}.

def _allreduce_two_level(model, net, n):
    a, an, b, bn, g = model.alpha, model.net_alpha, model.beta, model.net_beta, model.gamma
    N, k, m = net.N, net.k, net.m
    hier = 2 * (m - 1) * (a + n / m * b) + 2 * (N - 1) * (an + n / N * bn) \
        + ((m - 1) / m + (N - 1) / (m * N)) * n * g
    if k != m:  # the fold onto the smallest node's size, and the result handed back
        hier += 2 * (a + n * b) + n * g
    leader = 2 * _lg(k) * (a + n * b) + _lg(N) * (an + n * bn) + (_lg(k) + _lg(N)) * n * g
    return {"hierarchical": hier, "hierarchical_leader": leader}


def _broadcast_two_level(model, net, n):
    a, an, b, bn = model.alpha, model.net_alpha, model.beta, model.net_beta
    N, k = net.N, net.k
    return {"hierarchical": (_lg(N) + N - 1) * an + 2 * (N - 1) / N * n * bn + _lg(k) * (a + n * b)}


def _allgather_two_level(model, net, n):
    a, an, b, bn = model.alpha, model.net_alpha, model.beta, model.net_beta
    N, k, p = net.N, net.k, net.p
    return {"hierarchical": _lg(k) * a + (k - 1) / p * n * b + (N - 1) * (an + n / N * bn) + _lg(k) * (a + n * b)}


def _reduce_scatter_two_level(model, net, n):
    a, an, b, bn, g = model.alpha, model.net_alpha, model.beta, model.net_beta, model.gamma
    N, k, p = net.N, net.k, net.p
    return {"hierarchical": _lg(k) * (a + n * b + n * g) + (N - 1) * (an + n / N * (bn + g))
            + (k - 1) * (a + n / p * b)}


# collective -> its two-level times; the collectives not here have no two-level algorithm.
TWO_LEVEL_TIMES = {"allreduce": _allreduce_two_level, "broadcast": _broadcast_two_level,
                   "allgather": _allgather_two_level, "reduce_scatter": _reduce_scatter_two_level}


def predict(collective, nbytes, size, topology=None, model=SHIPPED_MODEL):
    """``(native, ours)``: the predicted seconds of MPI's own collective, modelled as the
    best of the classic schedules MPI itself uses (recursive doubling and halving,
    ring, Bruck, binomial trees, pairwise exchange) at MPI's per-message cost and
    topology-unaware (flat, whatever the nodes), and ``{algorithm: seconds}`` for this
    library's algorithms the model covers (``tree`` and ``pipeline`` it leaves out),
    the two-level ones where there are several nodes with more than one rank on some.
    ``nbytes`` as for a tuning table (allgather and gather: the gathered size; scatter:
    the root's buffer; alltoall: a rank's whole input). The formulas are the
    collective's entries in ``FLAT_TIMES`` and ``TWO_LEVEL_TIMES``."""
    net, n = _Net(size, topology), float(nbytes)
    times = FLAT_TIMES.get(collective)
    if times is None:
        raise ValueError(f"collective must be one of {', '.join(BUILDERS)}; got {collective!r}")
    native, ours = times(model, net, n)
    if two_level(topology) and collective in TWO_LEVEL_TIMES:
        ours.update(TWO_LEVEL_TIMES[collective](model, net, n))
    return min(native), ours


def conservative_choice(collective, nbytes, size, topology=None, model=SHIPPED_MODEL, needed=GAIN_NEEDED):
    """``(algorithm, gain, best)``: what the conservative rule picks where no measured
    table answers. ``best`` is this library's algorithm with the lowest predicted time
    (:func:`predict`) and ``gain`` native's predicted time over it; the rule picks
    ``best`` if ``gain >= needed`` (2), else ``native``. The model is coarse (and the
    per-message costs differ from machine to machine), so only a large predicted gain
    moves ``auto`` off the MPI library's own collective; a measured table decides
    finer. With the shipped parameters: on one node, never (MPI runs the same
    schedules as ours at a tenth of the cost per message: at most 1.0x, 1.6x for a
    3-rank reduce); on several nodes, the two-level algorithms where ranks are not
    placed node by node (a flat schedule then crosses the network at nearly every
    step), and with 8 or more ranks per node the two-level allgather and
    reduce_scatter at some sizes between 4 KiB and 1 MiB (a flat ring crosses the
    network p - 1 times, at MPI's cost per message there)."""
    if size < 2:
        return "native", 1.0, None
    native, ours = predict(collective, nbytes, size, topology, model)
    best = min(ours, key=ours.get)
    gain = native / ours[best] if ours[best] > 0 else 1.0
    return (best if gain >= needed else "native"), gain, best
