"""The simulator: counters against the cost model's formulas, times against their
closed forms, results against NumPy.

The expected counters are written here from ``shared/reference/cost-model.md`` (p a
power of two) and from the non-power-of-two derivations in each algorithm module's
docstring; nothing here calls the library's own cost code. Counts are multiples of p
so that the blocks are equal, as the formulas assume.
"""

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import collectives as cc
import collectives.schedule as sim_schedule
import collectives.sim as sim
from collectives.algorithms import (
    BUILDERS,
    NODE_SYMMETRIC,
    ORDERED,
    PEER_READS,
    SHARED_MEMORY,
    SYMMETRIC,
    block_bounds,
    hierarchical,
)

from conftest import ALL_DTYPES, expected_everywhere, ops_for, quick_and_deep

pytestmark = pytest.mark.serial

# The counter sweep covers p = 1-64 in two parts; p > 16 runs in `make test-long`.
SIZE_RANGES = [pytest.param(range(1, 17), id="p1-16"),
               pytest.param(range(17, 65), id="p17-64", marks=pytest.mark.long)]
ITEM = 4  # float32


def lowbit(v):
    return v & -v


class Fold:
    """The non-power-of-two layout: p' = 2^⌊lg p⌋ and e = p - p' extra ranks; the first
    2e ranks pair up, the even one of a pair sits out, the odd one (the keeper) is
    virtual rank r // 2 and stands for two blocks."""

    def __init__(self, p, block):
        self.p, self.block = p, block
        self.pof2 = 1 << (p.bit_length() - 1)
        self.extra = p - self.pof2
        self.steps = self.pof2.bit_length() - 1

    def role(self, r):
        if r < 2 * self.extra:
            return ("out", None) if r % 2 == 0 else ("keeper", r // 2)
        return ("plain", r - self.extra)

    def width(self, v):
        return 2 * self.block if v < self.extra else self.block

    def group(self, d, v):
        """Bytes of the aligned group of d virtual blocks holding v."""
        first = v - v % d
        return sum(self.width(u) for u in range(first, first + d))

    def halving_kept(self, v):
        """Σ over the halving steps of what v keeps (= receives = reduces)."""
        return sum(self.group(1 << k, v) for k in range(self.steps))


def binomial_row(collective, r, root, p, n):
    """A binomial tree's row (``n``: the whole buffer; gather: one block)."""
    lg_ceil = (p - 1).bit_length()
    vr = (r - root) % p
    if collective == "gather":
        extent = min(lowbit(vr), p - vr) if vr else p  # the subtree's blocks
        return (1 if vr else 0, extent * n if vr else 0, (extent - 1) * n, 0)
    below = lowbit(vr) if vr else 1 << lg_ceil
    children = sum(1 for k in range(lg_ceil) if (1 << k) < below and vr + (1 << k) < p)
    if collective == "broadcast":
        return (children, children * n, n if vr else 0, 0)
    return (1 if vr else 0, n if vr else 0, children * n, children * n)  # reduce


def add(*rows):
    return tuple(map(sum, zip(*rows)))


def expected_counters(collective, algorithm, p, count, root=0, segments=1):
    """(messages sent, bytes sent, bytes received, bytes reduced) for every rank. The
    two-level algorithms on one node (the default layout) are the flat algorithms they
    are made of: see ``expected_two_level`` for several nodes."""
    n = count * ITEM * (p if collective == "allgather" else 1)
    b = n // p
    lg_ceil = (p - 1).bit_length()
    fold = Fold(p, b)
    rows = []
    for r in range(p):
        if p == 1:
            rows.append((0, 0, 0, 0))
            continue
        key = (collective, algorithm)
        if key in (("allreduce", "ring"), ("allreduce", "direct"), ("allreduce", "hierarchical")):
            row = (2 * (p - 1), 2 * (p - 1) * b, 2 * (p - 1) * b, (p - 1) * b)
        elif key in (("reduce_scatter", "ring"), ("reduce_scatter", "direct")):
            row = (p - 1, (p - 1) * b, (p - 1) * b, (p - 1) * b)
        elif key in (("allgather", "ring"), ("allgather", "direct")):
            row = (p - 1, (p - 1) * b, (p - 1) * b, 0)
        elif key == ("allgather", "bruck"):
            row = (lg_ceil, (p - 1) * b, (p - 1) * b, 0)
        elif key == ("allreduce", "recursive_doubling"):
            role, _ = fold.role(r)
            k = fold.steps + (role == "keeper")
            row = (1, n, n, 0) if role == "out" else (k, k * n, k * n, k * n)
        elif key == ("allreduce", "recursive_halving"):
            role, v = fold.role(r)
            if role == "out":
                row = (1, n, n, 0)
            else:
                kept, given = fold.halving_kept(v), n - fold.width(v)
                row = (2 * fold.steps, given + kept, kept + given, kept)
                if role == "keeper":  # the fold received and reduced, the result sent back
                    row = (row[0] + 1, row[1] + n, row[2] + n, row[3] + n)
        elif key == ("reduce_scatter", "recursive_halving"):
            role, v = fold.role(r)
            if role == "out":
                row = (1, n, b, 0)
            else:
                kept, given = fold.halving_kept(v), n - fold.width(v)
                row = (fold.steps, given, kept, kept)
                if role == "keeper":  # the partner's input in, its block back
                    row = (row[0] + 1, row[1] + b, row[2] + n, row[3] + n)
        elif key == ("allgather", "recursive_doubling"):
            role, v = fold.role(r)
            if role == "out":
                row = (1, b, n, 0)
            else:
                row = (fold.steps, fold.halving_kept(v), n - fold.width(v), 0)
                if role == "keeper":  # the partner's block in, everything back
                    row = (row[0] + 1, row[1] + n, row[2] + b, 0)
        elif key == ("allreduce", "tree"):  # heap-ordered binary tree
            links = (r > 0) + sum(c < p for c in (2 * r + 1, 2 * r + 2))
            children = links - (r > 0)
            row = (segments * links, links * n, links * n, children * n)
        elif key in (("broadcast", "binomial"), ("reduce", "binomial"), ("broadcast", "hierarchical")):
            row = binomial_row(collective, r, root, p, n)
        elif key == ("allreduce", "hierarchical_leader"):  # reduce to rank 0, broadcast back
            row = add(binomial_row("reduce", r, 0, p, n), binomial_row("broadcast", r, 0, p, n))
        elif key == ("allgather", "hierarchical"):  # gather to rank 0, broadcast back
            row = add(binomial_row("gather", r, 0, p, b), binomial_row("broadcast", r, 0, p, n))
        elif key == ("reduce_scatter", "hierarchical"):  # reduce to rank 0, which hands out the blocks
            row = add(binomial_row("reduce", r, 0, p, n), (p - 1, (p - 1) * b, 0, 0) if r == 0 else (0, 0, b, 0))
        elif key == ("broadcast", "pipeline"):
            pos = (r - root) % p
            row = (segments if pos < p - 1 else 0, n if pos < p - 1 else 0, n if pos else 0, 0)
        elif key == ("broadcast", "scatter_allgather"):
            vr = (r - root) % p
            subtree = min(lowbit(vr), p - vr) if vr else p  # blocks this rank gets (root: has)
            below = lowbit(vr) if vr else 1 << lg_ceil
            children = sum(1 for k in range(lg_ceil) if (1 << k) < below and vr + (1 << k) < p)
            row = (children + p - 1, (subtree - 1) * b + (p - 1) * b, (subtree * b if vr else 0) + (p - 1) * b, 0)
        elif key == ("broadcast", "direct"):
            row = (2 * (p - 1), 2 * (p - 1) * b, 0, 0) if r == root else (p - 2, (p - 2) * b, n, 0)
        elif key in (("gather", "binomial"), ("scatter", "binomial")):  # n: one block
            vr = (r - root) % p
            extent = min(lowbit(vr), p - vr) if vr else p  # the subtree's blocks
            children = (extent - 1).bit_length()
            if collective == "gather":
                row = (1 if vr else 0, extent * n if vr else 0, (extent - 1) * n, 0)
            else:
                row = (children, (extent - 1) * n, extent * n if vr else 0, 0)
        elif key == ("alltoall", "pairwise"):  # n: one block
            row = (p - 1, (p - 1) * n, (p - 1) * n, 0)
        elif key == ("alltoallv", "pairwise"):  # the default matrix: count·((j-r mod p + 1) % 3) to rank j
            out = [(((j - r) % p + 1) % 3) * n for j in range(p) if j != r]  # circulant: as many come back
            row = (sum(1 for m in out if m), sum(out), sum(out), 0)
        elif key == ("alltoall", "bruck"):  # the slots with bit k set, at every step k
            moved = sum(sum(1 for i in range(p) if i & (1 << k)) for k in range(lg_ceil))
            row = (lg_ceil, moved * n, moved * n, 0)
        elif key in (("allreduce", "shm"), ("reduce_scatter", "shm"), ("reduce", "shm")):
            row = (0, 0, 0, (p - 1) * b)  # no messages: each rank folds its share of the p inputs
        elif key in (("allgather", "shm"), ("broadcast", "shm")):
            row = (0, 0, 0, 0)
        elif key in (("allreduce", "two_shot"), ("reduce_scatter", "one_shot")):
            row = (0, 0, 0, (p - 1) * b)  # no messages: each rank folds its share of the p inputs, read in place
        elif key == ("allreduce", "one_shot"):
            row = (0, 0, 0, (p - 1) * n)  # each rank folds every input whole
        elif key == ("reduce", "one_shot"):
            row = (0, 0, 0, (p - 1) * n if r == root else 0)
        elif key in (("allreduce", "leader"), ("reduce_scatter", "leader")):  # rank 0 folds every input
            row = (0, 0, 0, (p - 1) * n if r == 0 else 0)
        elif key in (("allgather", "one_shot"), ("broadcast", "one_shot"), ("allgather", "leader"),
                     ("broadcast", "leader")):
            row = (0, 0, 0, 0)
        elif key == ("reduce", "direct"):  # reduce_scatter, then every block to the root
            row = (p - 1, (p - 1) * b, 2 * (p - 1) * b, (p - 1) * b) if r == root else \
                (p, p * b, (p - 1) * b, (p - 1) * b)
        else:
            raise AssertionError(f"no formula for {key}")
        rows.append(row)
    return rows


ALGORITHMS = [(c, a) for c, names in BUILDERS.items() for a in names]


def test_every_algorithm_has_a_formula():
    for collective, algorithm in ALGORITHMS:
        expected_counters(collective, algorithm, 5, 10)


def counters(result):
    return list(zip(result.messages_sent, result.bytes_sent, result.bytes_received, result.bytes_reduced))


@pytest.mark.parametrize("sizes", SIZE_RANGES)
@pytest.mark.parametrize("collective,algorithm", ALGORITHMS)
def test_counters_equal_the_cost_model_for_every_p(collective, algorithm, sizes):
    problems = []
    for p in sizes:
        count = 3 * p
        roots = [0, p - 1] if collective in ("broadcast", "reduce", "gather", "scatter") else [0]
        for root in roots:
            got = counters(sim.costs(collective, algorithm, p, count, root=root))
            want = expected_counters(collective, algorithm, p, count, root)
            if got != want:
                bad = next(r for r in range(p) if got[r] != want[r])
                problems.append(f"p={p} root={root} rank {bad}: got {got[bad]}, formula {want[bad]}")
    assert not problems, "\n".join(problems[:10])


@pytest.mark.parametrize("collective,algorithm", [("allreduce", "tree"), ("broadcast", "pipeline")])
@pytest.mark.parametrize("p", [2, 3, 5, 8, 13])
def test_segmented_counters(collective, algorithm, p):
    count, segments = 7 * 12, 7  # segments of 12 elements
    got = counters(sim.costs(collective, algorithm, p, count, segment_size=12 * ITEM))
    assert got == expected_counters(collective, algorithm, p, count, segments=segments)


def test_the_cost_model_power_of_two_rows():
    # The cost model's own columns, for p a power of two, straight from its table.
    for p in (2, 4, 8, 16, 32, 64):
        n, lg = 3 * p * ITEM, int(math.log2(p))
        bound = 2 * (p - 1) * n // p
        for r in (0, p - 1):
            rh = sim.costs("allreduce", "recursive_halving", p, 3 * p)
            assert (rh.messages_sent[r], rh.bytes_sent[r], rh.bytes_reduced[r]) == (2 * lg, bound, (p - 1) * n // p)
            rd = sim.costs("allreduce", "recursive_doubling", p, 3 * p)
            assert (rd.messages_sent[r], rd.bytes_sent[r], rd.bytes_reduced[r]) == (lg, lg * n, lg * n)
        binomial = sim.costs("broadcast", "binomial", p, 3 * p)
        assert binomial.messages_sent[0] == lg and binomial.bytes_sent[0] == lg * n
        assert sum(binomial.bytes_sent) == (p - 1) * n  # everyone else receives once


def test_parameter_server_counters():
    servers, p, count = 3, 8, 60
    result = sim.costs("allreduce", "parameter_server", p, count, servers=servers)
    n, workers = count * ITEM, p - servers
    shard = n // servers
    for r in range(p):
        want = (workers, workers * shard, workers * shard, (workers - 1) * shard) if r < servers else (servers, n, n, 0)
        assert counters(result)[r] == want


# ---------------------------------------------------------------- time: closed forms

A, B, G = 1000.0, 3.0, 1.0  # α, β, γ in units that keep every sum an exact integer


def c(m):
    return A + m * B


def g(m, gamma=G):
    return m * gamma


def closed_form(collective, algorithm, p, n, gamma=G, segments=1):
    """Completion time under the α-β-γ model, for the cases where it has one."""
    b, lg = n // p, int(math.log2(p))
    lg_ceil = (p - 1).bit_length()
    pof2 = p & (p - 1) == 0
    key = (collective, algorithm)
    if key in (("allreduce", "ring"), ("allreduce", "hierarchical")):  # one node: the ring it is made of
        return (p - 1) * (c(b) + g(b, gamma)) + (p - 1) * c(b)
    if key == ("reduce_scatter", "ring"):
        return (p - 1) * (c(b) + g(b, gamma))
    if key in (("allgather", "ring"), ("allgather", "direct")):
        return (p - 1) * c(b)
    if key == ("allreduce", "direct"):  # one round of p-1 messages, the reductions overlap
        return (p - 1) * c(b) + max((p - 1) * c(b) + g(b, gamma), c(b) + (p - 1) * g(b, gamma))
    if key == ("reduce_scatter", "direct"):
        return max((p - 1) * c(b) + g(b, gamma), c(b) + (p - 1) * g(b, gamma))
    if key == ("reduce", "direct"):  # the reduce_scatter, then the root receives p-1 blocks in turn
        return max((p - 1) * c(b) + g(b, gamma), c(b) + (p - 1) * g(b, gamma)) + (p - 1) * c(b)
    # Shared memory: a copy to or from the window costs m·β, a fence α after the last arrival.
    if key in (("allreduce", "shm"), ("reduce", "shm")):  # the others' shares in, fence, fold, fence, all out
        return 2 * A + (2 * n - b) * B + g((p - 1) * b, gamma)
    if key == ("reduce_scatter", "shm"):  # the other blocks' pieces in, fence, fold
        return A + (p - 1) * b * B + g((p - 1) * b, gamma)
    if key == ("allgather", "shm"):  # n: the gathered size
        return A + n * B
    if key == ("broadcast", "shm"):
        return A + 2 * n * B
    # Peer reads: two fences, the fold of the inputs read in place (m·γ per step; a
    # Reduce's operands cost nothing), a copy from another rank's input or slot m·β.
    if key in (("allreduce", "one_shot"), ("reduce", "one_shot")):
        return 2 * A + g((p - 1) * n, gamma)
    if key == ("allreduce", "leader"):  # rank 0 folds every input, then writes every other output
        return 2 * A + g((p - 1) * n, gamma) + (p - 1) * n * B
    if key == ("reduce_scatter", "leader"):  # rank 0 folds every block into its rank's output
        return 2 * A + g((p - 1) * n, gamma)
    if key == ("allgather", "leader"):  # rank 0 copies every input into every output: all but in -> out shared
        return 2 * A + (p * p - 1) * b * B
    if key == ("broadcast", "leader"):  # the root copies its array into the p - 1 others'
        return 2 * A + (p - 1) * n * B
    if key == ("allreduce", "two_shot"):  # fold share r into slot r, fence, every slot out
        return 2 * A + g((p - 1) * b, gamma) + n * B
    if key == ("reduce_scatter", "one_shot"):
        return 2 * A + g((p - 1) * b, gamma)
    if key == ("allgather", "one_shot"):  # n: the gathered size
        return 2 * A + (p - 1) * b * B
    if key == ("broadcast", "one_shot"):
        return 2 * A + n * B
    if key == ("allgather", "bruck"):
        return lg_ceil * A + (p - 1) * b * B
    if key in (("broadcast", "binomial"), ("broadcast", "hierarchical")):
        return lg_ceil * c(n)
    if key in (("gather", "binomial"), ("scatter", "binomial")):  # n: one block; the root's ⌈lg p⌉ messages
        return lg_ceil * A + (p - 1) * n * B
    if key == ("alltoall", "pairwise"):  # n: one block, p-1 of them in and out
        return (p - 1) * c(n)
    if key == ("broadcast", "pipeline"):
        return (p - 1 + segments - 1) * c(n // segments)
    if key == ("broadcast", "direct"):
        # The root sends 2(p-1) blocks one after another; the last rank has its own at
        # 2p-3 and then forwards it to the p-2 other non-roots, one after another.
        return max(2 * (p - 1), 3 * p - 5) * c(b)
    if not pof2:
        if key == ("allreduce", "recursive_doubling"):  # fold in, lg p' steps, result back
            k = int(math.log2(1 << (p.bit_length() - 1)))
            return (k + 2) * c(n) + (k + 1) * g(n, gamma)
        return None
    if key == ("allreduce", "recursive_doubling"):
        return lg * (c(n) + g(n, gamma))
    if key == ("allreduce", "recursive_halving"):
        return 2 * lg * A + 2 * (p - 1) * b * B + (p - 1) * b * gamma
    if key == ("reduce_scatter", "recursive_halving"):
        return lg * A + (p - 1) * b * (B + gamma)
    if key == ("allgather", "recursive_doubling"):
        return lg * A + (p - 1) * b * B
    if key == ("reduce", "binomial"):
        return lg * (c(n) + g(n, gamma))
    # The two-level algorithms on one node: their binomial steps one after the other.
    if key == ("allreduce", "hierarchical_leader"):  # reduce, then broadcast
        return lg * (c(n) + g(n, gamma)) + lg * c(n)
    if key == ("allgather", "hierarchical"):  # gather, then broadcast
        return lg * A + (p - 1) * b * B + lg * c(n)
    if key == ("reduce_scatter", "hierarchical"):  # reduce, then the root sends p-1 blocks
        return lg * (c(n) + g(n, gamma)) + (p - 1) * c(b)
    if key == ("broadcast", "scatter_allgather"):
        return (lg + p - 1) * A + 2 * (p - 1) * b * B
    if key == ("alltoall", "bruck"):  # n: one block; p/2 of them per step
        return lg * c(p // 2 * n)
    return None


CLOSED_FORMS = [
    ca for ca in ALGORITHMS if closed_form(*ca, 4, 64) is not None
]


def test_closed_forms_cover_all_but_the_tree():
    missing = {ca for ca in ALGORITHMS} - set(CLOSED_FORMS)
    # The tree's special cases: test_tree_times. alltoallv's time depends on which
    # uneven blocks meet: with equal blocks it is alltoall's (test_alltoallv_...).
    assert missing == {("allreduce", "tree"), ("alltoallv", "pairwise")}


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8, 16])
def test_alltoallv_with_equal_blocks_costs_what_alltoall_does(p):
    count = 7
    equal = sim.costs("alltoallv", "pairwise", p, count, counts=np.full((p, p), count))
    plain = sim.costs("alltoall", "pairwise", p, count)
    assert counters(equal) == counters(plain) and equal.nbytes == plain.nbytes
    assert equal.time(1e-5, 1e-9, 1e-10) == plain.time(1e-5, 1e-9, 1e-10)


def test_alltoallv_counts_are_checked():
    with pytest.raises(ValueError, match="counts must be a 3×3 matrix"):
        sim.run("alltoallv", "pairwise", 3, 2, counts=np.ones((3, 2), int))
    with pytest.raises(ValueError, match="counts must be"):
        sim.run("alltoallv", "pairwise", 2, 2, counts=[[1, -1], [0, 0]])
    with pytest.raises(TypeError, match="counts is a parameter of alltoallv, not of alltoall"):
        sim.run("alltoall", "pairwise", 2, 2, counts=[[1, 1], [1, 1]])
    got = sim.run("alltoallv", "pairwise", 3, 0, counts=[[0, 2, 0], [1, 0, 0], [0, 0, 3]])
    assert [r.size for r in got.results] == [1, 2, 3]


@pytest.mark.parametrize("collective,algorithm", CLOSED_FORMS)
@pytest.mark.parametrize("gamma", [G, 5000.0])  # reductions cheaper, and dearer, than a message
def test_time_equals_the_closed_form(collective, algorithm, gamma):
    problems = []
    for p in list(range(2, 18)) + [32, 64]:
        count = 6 * p
        n = count * ITEM * (p if collective == "allgather" else 1)
        want = closed_form(collective, algorithm, p, n, gamma)
        if want is None:
            continue
        got = sim.costs(collective, algorithm, p, count).time(A, B, gamma)
        if got != want:
            problems.append(f"p={p}: simulated {got}, closed form {want}")
    assert not problems, "\n".join(problems[:10])


def registered_closed_form(collective, p, n, gamma):
    """``shm`` on registered buffers: nothing copied in; fences, the fold, the copies
    from the other ranks' arrays (m·β each, as copies from the window)."""
    moved = (p - 1) * (n // p)
    return {"allreduce": 3 * A + moved * B + g(moved, gamma), "reduce_scatter": 2 * A + g(moved, gamma),
            "allgather": 2 * A + moved * B, "broadcast": 2 * A + n * B}[collective]


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather", "broadcast"])
@pytest.mark.parametrize("gamma", [G, 5000.0])
def test_registered_time_equals_the_closed_form(collective, gamma):
    problems = []
    for p in list(range(2, 18)) + [32]:
        count = 6 * p
        n = count * ITEM * (p if collective == "allgather" else 1)
        got = sim.costs(collective, "shm", p, count, registered=True).time(A, B, gamma)
        want = registered_closed_form(collective, p, n, gamma)
        if got != want:
            problems.append(f"p={p}: simulated {got}, closed form {want}")
    assert not problems, "\n".join(problems[:10])


def _peer_reads_need(collective, algorithm, rank, p, count, root):
    """The (rank, element) pairs of the other ranks' inputs that ``rank``'s part of a
    peer read needs: what its result is made of."""
    whole = range(count)
    if collective == "allreduce" and algorithm == "one_shot" or (collective, algorithm) == ("allgather", "one_shot"):
        return {(q, i) for q in range(p) if q != rank for i in whole}
    if algorithm == "leader":  # rank 0 reads for everyone (the root of broadcast its own array)
        if rank != 0 or collective == "broadcast":
            return set()
        others = [(q, i) for q in range(p) if q != rank for i in whole]
        return others * p if collective == "allgather" else set(others)  # allgather: once for every output
    if collective in ("allreduce", "reduce_scatter"):  # its block of every other input
        bounds = block_bounds(count, p)
        return {(q, i) for q in range(p) if q != rank for i in range(bounds[rank], bounds[rank + 1])}
    if collective == "broadcast":
        return set() if rank == root else {(root, i) for i in whole}
    assert collective == "reduce", collective
    return {(q, i) for q in range(p) if q != rank for i in whole} if rank == root else set()


@pytest.mark.parametrize("collective,algorithm", sorted(PEER_READS))
def test_peer_reads_read_what_they_need_once_where_it_lies_between_the_fences(collective, algorithm):
    """Each rank's plan reads, straight from the other ranks' inputs (``reg``: rank q's
    input at q·count), exactly the elements its result needs, each once, and only between
    its two fences; it never writes another rank's input, and stages nothing into the
    window (``shm``) before the first fence, as the shm algorithms' unregistered forms do
    (uneven blocks, both ends for the root, in place too). The allgather leader reads
    each once for every output it copies it into."""
    copy, reduce, many, fence = sim_schedule.Copy, sim_schedule.Reduce, sim_schedule.ReduceMany, sim_schedule.Fence
    for p in (2, 3, 8):
        count = 6 * p + 1
        roots = sorted({0, p - 1}) if collective in ("broadcast", "reduce") else [0]
        forms = (False, True) if collective in ("allreduce", "reduce") else (False,)
        for root, inplace in ((root, inplace) for root in roots for inplace in forms):
            plans = sim.simulate.plans_for(collective, algorithm, p, count, root=root, inplace=inplace)
            for rank, plan in enumerate(plans):
                where = f"{collective} {algorithm} p={p} root={root} inplace={inplace} rank {rank}"
                fences = [k for k, op in enumerate(plan.ops) if isinstance(op, fence)]
                assert len(fences) == 2, where
                read = Counter()
                for k, op in enumerate(plan.ops):
                    if isinstance(op, fence):
                        continue
                    srcs = (op.src,) if isinstance(op, copy) else (op.a, op.b) if isinstance(op, reduce) else \
                        tuple(op.srcs)
                    assert isinstance(op, (copy, reduce, many)), (where, op)
                    assert op.dst.buf != "reg", f"{where}: writes another rank's input: {op}"
                    assert k > fences[0] or op.dst.buf != "shm", f"{where}: stages into the window first: {op}"
                    for src in srcs:
                        if src.buf == "reg":
                            assert fences[0] < k < fences[1], f"{where}: reads an input outside the fences: {op}"
                            read.update(divmod(j, count) for j in range(src.lo, src.hi))
                need = _peer_reads_need(collective, algorithm, rank, p, count, root)
                assert read == Counter(need), f"{where}: read {sorted(read.items())[:6]}, needs {sorted(need)[:6]}"


ORDERED_ALGORITHMS = [(c, a) for c, names in ORDERED.items() for a in names]


@pytest.mark.parametrize("collective,algorithm", ORDERED_ALGORITHMS)
def test_ordered_schedules_cost_the_same_messages_and_reductions(collective, algorithm):
    for p in (1, 2, 3, 5, 8, 17):
        for root in ([0, p - 1] if collective == "reduce" else [0]):
            got = counters(sim.costs(collective, algorithm, p, 3 * p, root=root, ordered=True))
            assert got == expected_counters(collective, algorithm, p, 3 * p, root), f"p={p} root={root}"


@pytest.mark.parametrize("gamma", [G, 5000.0])
def test_ordered_direct_reduce_scatter_time(gamma):
    # Folding in rank order, some rank's first or next block comes last, (p-1)c in:
    # no reduction overlaps the messages any more, (p-1)(c + n/p·γ).
    for p in list(range(2, 18)) + [32]:
        b = 6 * ITEM
        got = sim.costs("reduce_scatter", "direct", p, 6 * p, ordered=True).time(A, B, gamma)
        assert got == (p - 1) * (c(b) + g(b, gamma)), f"p={p}"


def test_ordered_is_refused_for_algorithms_that_cannot_keep_the_order():
    with pytest.raises(ValueError, match="'ring' cannot reduce in rank order"):
        sim.costs("allreduce", "ring", 4, 12, ordered=True)
    sim.costs("allgather", "ring", 4, 12, ordered=True)  # nothing to reduce: any order is the order


@pytest.mark.parametrize("p", [2, 3, 5, 16])
def test_pipelined_chain_time(p):
    count, segments = 12 * 8, 8
    got = sim.costs("broadcast", "pipeline", p, count, segment_size=12 * ITEM).time(A, B, G)
    assert got == closed_form("broadcast", "pipeline", p, count * ITEM, segments=segments)


def test_tree_times():
    # Two ranks, s segments: the leaf streams its segments up back to back, the root adds
    # each and sends it down: (s + 1)(α + mβ) + mγ.
    count, s = 10 * 16, 10
    m = count * ITEM // s
    got = sim.costs("allreduce", "tree", 2, count, segment_size=16 * ITEM).time(A, B, G)
    assert got == (s + 1) * c(m) + g(m)
    # A full binary tree of depth D, one segment: each level up receives two children one
    # after the other and adds them, then the result goes down, two sends per level.
    for depth in (1, 2, 3, 4, 5):
        p = 2 ** (depth + 1) - 1
        n = 4 * ITEM
        for gamma in (G, 5000.0):
            got = sim.costs("allreduce", "tree", p, 4).time(A, B, gamma)
            assert got == depth * (max(2 * c(n), c(n) + g(n, gamma)) + g(n, gamma)) + 2 * depth * c(n)


def test_a_message_waits_only_while_its_ports_are_busy():
    # Rank 2 sends rank 1 a long message first; rank 0 then wants rank 1 (busy
    # receiving) and rank 2 (free to receive). Rank 0's port must not sit idle waiting
    # for rank 1: the message to rank 2 goes at once, the one to rank 1 when it can.
    from collectives.schedule import Schedule, compile_plan, sl
    from collectives.sim.timing import Graph, Model

    r0 = Schedule([])
    r0.copy(sl("out", 0, 1), sl("in", 0, 1))
    r0.send(1, sl("in", 0, 1))
    r0.send(2, sl("in", 0, 1))
    r1 = Schedule([], tmp=101)
    r1.recv(2, sl("tmp", 0, 100))
    r1.recv(0, sl("tmp", 100, 101))
    r2 = Schedule([])
    r2.send(1, sl("in", 0, 100))
    r2.recv(0, sl("out", 0, 1))
    graph = Graph([compile_plan(x) for x in (r0, r1, r2)], itemsize=1)
    assert graph.time(Model(0.0, 1.0, 0.0)) == 101  # 2→1 [0, 100], 0→2 [0, 1], 0→1 [100, 101]


def test_numpy_integers_are_accepted():
    result = sim.run("allreduce", "recursive_halving", np.int64(6), np.int32(12), root=np.int64(0))
    assert result.world_size == 6 and result.bytes_sent == sim.costs("allreduce", "recursive_halving", 6, 12).bytes_sent
    assert result.time(np.float32(1), np.float64(0), 0, ranks_per_node=np.int64(2)) > 0


def test_rounds_count_latencies_on_the_critical_path():
    assert sim.costs("allreduce", "ring", 8, 64).rounds == 14
    assert sim.costs("allreduce", "recursive_halving", 8, 64).rounds == 6
    assert sim.costs("allreduce", "recursive_doubling", 6, 64).rounds == 4  # fold, 2 steps, unfold
    assert sim.costs("broadcast", "binomial", 64, 64).rounds == 6
    assert sim.costs("allgather", "bruck", 7, 64).rounds == 3


def test_two_level_topology():
    # Ring allreduce over 2 nodes of 4: every step has two messages between nodes, one
    # each way on each node's link, so the step costs the inter-node α + mβ.
    p, count = 8, 8 * 100
    b = count * ITEM // p
    cost = sim.costs("allreduce", "ring", p, count)
    flat = cost.time(A, B, 0.0)
    two_level = cost.time(A, B, 0.0, ranks_per_node=4, inter_alpha=10 * A, inter_beta=10 * B)
    assert flat == 2 * (p - 1) * c(b)
    assert two_level == 2 * (p - 1) * (10 * A + 10 * B * b)
    # Direct allreduce sends 4·4 messages between the nodes per phase where the ring sends
    # 2: the shared links make it slower than the ring there, though not within a node.
    direct = sim.costs("allreduce", "direct", p, count)
    assert direct.time(A, B, 0.0) == flat
    assert direct.time(A, B, 0.0, ranks_per_node=4, inter_alpha=10 * A, inter_beta=10 * B) > two_level
    # One node holding every rank is the flat model.
    assert cost.time(A, B, 0.0, ranks_per_node=8, inter_alpha=10 * A, inter_beta=10 * B) == flat


def test_two_level_model_takes_one_node_label_per_rank():
    # The layouts the plans take with nodes=: node by node, uneven, interleaved.
    p, count = 4, 4 * 100
    b = count * ITEM // p
    net = dict(inter_alpha=10 * A, inter_beta=10 * B)
    step = 10 * A + 10 * B * b  # one message between nodes
    ring = sim.costs("allreduce", "ring", p, count)
    # node by node, as ranks_per_node=2 (which times rank 0 alone): one message each way
    # on each node's link per step
    assert ring.time(A, B, 0.0, ranks_per_node=["a", "a", "b", "b"], **net) == 2 * (p - 1) * step
    assert ring.time(A, B, 0.0, ranks_per_node=2, **net) == 2 * (p - 1) * step
    # 3 + 1: ranks 2 -> 3 and 3 -> 0 cross, each on its own node's link
    assert ring.time(A, B, 0.0, ranks_per_node=[0, 0, 0, 1], **net) == 2 * (p - 1) * step
    # interleaved: every hop crosses, two messages take turns on each node's link
    assert ring.time(A, B, 0.0, ranks_per_node=[0, 1, 0, 1], **net) == 2 * 2 * (p - 1) * step
    # one node holding every rank is the flat model
    assert ring.time(A, B, 0.0, ranks_per_node=[7] * p, **net) == ring.time(A, B, 0.0)
    # the two-level algorithms on the layout their plans were made for: slower when the
    # network is; never faster than flat with the node's α and β (a node's ranks only
    # add turns on its link)
    for labels in ([0, 0, 0, 1], [0, 1, 1, 1, 1, 2], [1, 0, 0, 1, 1, 0, 2, 2]):
        q = len(labels)
        for collective, algorithm in TWO_LEVEL:
            result = sim.costs(collective, algorithm, q, 6 * q, nodes=labels)
            flat = result.time(A, B, G)
            assert result.time(A, B, G, ranks_per_node=labels, **net) > flat, (collective, algorithm, labels)
            assert result.time(A, B, G, ranks_per_node=labels, inter_alpha=A, inter_beta=B) >= flat
    with pytest.raises(ValueError, match="ranks_per_node has 3 node labels for 4 ranks"):
        ring.time(A, B, 0.0, ranks_per_node=[0, 0, 1])
    with pytest.raises(ValueError, match="one node label per rank"):
        ring.time(A, B, 0.0, ranks_per_node=[[0, 1], [2, 3]])


# ---------------------------------------------------------------- two-level algorithms

TWO_LEVEL = sorted(ca for ca in ALGORITHMS if ca[1].startswith("hierarchical"))
LAYOUTS = [(nodes, k) for nodes in (1, 2, 3, 4) for k in (1, 2, 3, 4)]  # nodes x ranks per node


def network_bytes(result, k):
    """Bytes each rank sends to ranks of other nodes (``k`` ranks per node, node by node)."""
    return [sum((op.src.hi - op.src.lo) * ITEM for op in plan.ops
                if isinstance(op, sim_schedule.Send) and op.peer // k != r // k)
            for r, plan in enumerate(result.plans)]


@pytest.mark.parametrize("nodes,k", LAYOUTS)
def test_hierarchical_allreduce_counters(nodes, k):
    # Ring reduce-scatter in the node (k-1 messages of n/k), ring allreduce of the rank's
    # block across nodes (2(N-1) messages of n/(kN)), ring allgather in the node.
    p, count = nodes * k, 3 * nodes * k
    n = count * ITEM
    result = sim.costs("allreduce", "hierarchical", p, count, nodes=k)
    local, across = n // k, n // (k * nodes)
    row = (2 * (k - 1) + 2 * (nodes - 1), 2 * (k - 1) * local + 2 * (nodes - 1) * across,
           2 * (k - 1) * local + 2 * (nodes - 1) * across, (k - 1) * local + (nodes - 1) * across)
    assert counters(result) == [row] * p
    # The network carries each rank's 1/k share: 2(N-1)/N · n/k from every rank.
    assert network_bytes(result, k) == [2 * (nodes - 1) * across] * p


@pytest.mark.parametrize("nodes,k", LAYOUTS)
@pytest.mark.parametrize("collective,algorithm,flat", [
    ("allreduce", "hierarchical_leader", "recursive_doubling"),
    ("broadcast", "hierarchical", "scatter_allgather"),
])
def test_only_leaders_cross_nodes_with_the_flat_algorithm(nodes, k, collective, algorithm, flat):
    # What crosses the network is the flat algorithm among one rank per node, on the
    # whole buffer; the other ranks never leave their node.
    p, count = nodes * k, 3 * nodes * k
    result = sim.costs(collective, algorithm, p, count, nodes=k)
    among_leaders = sim.costs(collective, flat, nodes, count).bytes_sent
    assert network_bytes(result, k) == [among_leaders[r // k] if r % k == 0 else 0 for r in range(p)]


@pytest.mark.parametrize("nodes,k", LAYOUTS)
@pytest.mark.parametrize("collective", ["allgather", "reduce_scatter"])
def test_hierarchical_allgather_and_reduce_scatter_send_each_node_segment_once(nodes, k, collective):
    # A ring among the leaders over the nodes' segments (k blocks each): every leader
    # sends N-1 segments; nothing else crosses a node.
    p, count = nodes * k, 3 * nodes * k
    result = sim.costs(collective, "hierarchical", p, count, nodes=k)
    block = count * ITEM if collective == "allgather" else count * ITEM // p  # one rank's block
    assert network_bytes(result, k) == [(nodes - 1) * k * block if r % k == 0 else 0 for r in range(p)]


@pytest.mark.parametrize("collective,algorithm", TWO_LEVEL)
@pytest.mark.parametrize("nodes", [[0, 0, 0, 1], [0, 1, 1, 1, 1, 2], [0, 1, 0, 1, 2], [1, 0, 0, 1, 1, 0, 2, 2]],
                         ids=["3+1", "1+4+1", "round-robin", "shuffled"])
def test_two_level_algorithms_on_uneven_and_interleaved_nodes(collective, algorithm, nodes):
    p = len(nodes)
    for count in (0, 1, p + 2, 7 * p):
        roots = range(p) if collective == "broadcast" else [0]
        for root in roots:
            for inplace in ((False, True) if collective == "allreduce" else (False,)):
                sim.run(collective, algorithm, p, count, "float64", root=root, nodes=nodes, inplace=inplace)


@pytest.mark.parametrize("nodes,k", [(2, 4), (3, 2), (4, 3)])
def test_hierarchical_allreduce_in_pieces(monkeypatch, nodes, k):
    # A large buffer goes in pieces: the same bytes, (2(k-1) + 2(N-1)) messages per piece,
    # and with a slow network the node's steps hide behind the network's.
    from collectives.algorithms import hierarchical

    p, count = nodes * k, 4 * nodes * k * 1024
    model = dict(alpha=1.0, beta=B, gamma=G, ranks_per_node=k, inter_alpha=1.0, inter_beta=2 * B)
    whole = sim.costs("allreduce", "hierarchical", p, count, nodes=k)
    monkeypatch.setattr(hierarchical, "PIPELINE_MIN", count // 4)
    pieces = sim.costs("allreduce", "hierarchical", p, count, nodes=k)
    assert pieces.bytes_sent == whole.bytes_sent and pieces.bytes_reduced == whole.bytes_reduced
    assert pieces.messages_sent == [4 * m for m in whole.messages_sent]
    assert pieces.time(**model) < whole.time(**model)  # 2x4: 0.73 of it; less where the node steps are short
    for labels in ([r // k for r in range(p)], [0] * (p - 1) + [1], [r % nodes for r in range(p)]):
        for n in (count, count + 3, 7):
            sim.run("allreduce", "hierarchical", p, n, "float64", nodes=labels)
            sim.run("allreduce", "hierarchical", p, n, "int32", op="max", nodes=labels, inplace=True)


def test_hierarchical_beats_the_ring_where_the_network_is_slow():
    # 2 nodes x 4, the network 100x slower than the node: the ring crosses it with
    # 2(p-1)/p·n per node link, the two-level algorithm with 2(N-1)/N·n, 1.75x less.
    p, count = 8, 8 * 4096
    model = dict(alpha=A, beta=B, gamma=G, ranks_per_node=4, inter_alpha=100 * A, inter_beta=100 * B)
    ring = sim.costs("allreduce", "ring", p, count).time(**model)
    two_level = sim.costs("allreduce", "hierarchical", p, count, nodes=4).time(**model)
    assert ring / two_level > 1.5
    # On one node, the two-level algorithm is the ring.
    assert sim.costs("allreduce", "hierarchical", p, count, nodes=8).time(**model) == ring


def test_nodes_are_checked():
    with pytest.raises(ValueError, match="nodes must be ranks per node or one node label per rank"):
        sim.run("allreduce", "hierarchical", 4, 8, nodes=[0, 1])
    with pytest.raises(ValueError, match="ranks_per_node must be a positive integer"):
        sim.run("allreduce", "hierarchical", 4, 8, nodes=0)


@pytest.mark.long
def test_four_thousand_ranks():
    result = sim.run("allreduce", "recursive_doubling", 4096, 16)
    assert result.rounds == 12 and result.bytes_sent[5] == 12 * 16 * ITEM
    result = sim.run("broadcast", "binomial", 4096, 16, root=17)
    assert result.rounds == 12 and sum(result.bytes_sent) == 4095 * 16 * ITEM


# ---------------------------------------------------------------- data: NumPy reference


@st.composite
def calls(draw):
    collective, algorithm = draw(st.sampled_from(ALGORITHMS))
    dtype = draw(st.sampled_from(ALL_DTYPES))
    op = draw(st.sampled_from(ops_for(dtype))) if collective in ("allreduce", "reduce_scatter", "reduce") else "sum"
    p = draw(st.integers(1, 64))
    count = draw(st.integers(0, 3 * p + 5))
    root = draw(st.integers(0, p - 1))
    segment = draw(st.integers(1, 5)) * np.dtype(dtype).itemsize
    inplace = draw(st.booleans()) if collective in ("allreduce", "reduce") else False
    return collective, algorithm, dtype, op, p, count, root, segment, inplace


@pytest.mark.parametrize("examples", quick_and_deep(30, 120))
def test_results_equal_numpy_bit_for_bit_on_every_rank(examples):
    settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
        given(calls())(_results_equal_numpy_bit_for_bit_on_every_rank))()


def _results_equal_numpy_bit_for_bit_on_every_rank(call):
    collective, algorithm, dtype, op, p, count, root, segment, inplace = call
    result = sim.run(collective, algorithm, p, count, dtype, op, root, segment_size=segment, inplace=inplace)
    per_rank = count * p if collective in ("scatter", "alltoall") else count  # count per block
    if collective == "alltoallv":  # the simulator's default matrix
        matrix = sim.alltoallv_counts(p, count)
        inputs = [sim.simulate.make_input(r, p, int(matrix[r].sum()), dtype, op) for r in range(p)]
        want = [np.concatenate([np.split(x, np.cumsum(row)[:-1])[r] for x, row in zip(inputs, matrix)])
                for r in range(p)]
    else:
        inputs = [sim.simulate.make_input(r, p, per_rank, dtype, op) for r in range(p)]
        want = expected_everywhere(collective, inputs, op, root)
    for r in range(p):
        if want[r] is None:
            assert result.results[r] is None
        else:
            assert result.results[r].dtype == np.dtype(dtype)
            assert np.array_equal(result.results[r], want[r]), f"rank {r}"  # -0 == +0
    if collective in ("allreduce", "allgather", "broadcast"):
        assert len({x.tobytes() for x in result.results}) == 1


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(sorted(BUILDERS["allreduce"])),
    st.integers(2, 64),
    st.integers(1, 300),
    st.sampled_from(["float16", "float32", "float64", "complex128"]),
    st.sampled_from(["sum", "prod", "avg"]),
)
def test_inexact_floats_give_the_same_bits_on_every_rank(algorithm, p, count, dtype, op):
    # Integer-valued inputs give the same bits in any order; these do not (±1e6 mixed
    # with 1e-2, as MPICH's test does): every rank must still get identical bits, since
    # each element is reduced once, in one order, and then copied.
    from collectives.transport.local import run_collective

    rng = np.random.default_rng(p * 1000 + count)
    plans = sim.simulate.plans_for("allreduce", algorithm, p, count, dtype, segment_size=8 * 16)
    with np.errstate(over="ignore", invalid="ignore"):  # float16 overflows to inf on purpose
        inputs = [(rng.choice([-1e6, 1e6, 1e-2, -1e-2, 3.3], count) * rng.random(count)).astype(dtype)
                  for _ in range(p)]
        got = run_collective("allreduce", algorithm, inputs, op, plans=plans)
    assert len({g.tobytes() for g in got}) == 1


def test_a_wrong_schedule_is_caught(monkeypatch):
    # The check inside run() must notice a result that differs from NumPy's.
    from collectives.transport import local

    real = local.run

    def off_by_one(plans, inputs, outputs, op, dtype, registered=None, routed=None):
        real(plans, inputs, outputs, op, dtype, registered, routed)
        outputs[1][0] += 1

    monkeypatch.setattr(local, "run", off_by_one)
    with pytest.raises(cc.CollectiveError, match="rank 1's result differs from NumPy's: element 0"):
        sim.run("allreduce", "ring", 4, 8)


def test_parameter_server_result():
    result = sim.run("allreduce", "parameter_server", 7, 50, "int32", "sum", servers=2)
    workers = [sim.simulate.make_input(r, 7, 50, "int32", "sum") for r in range(2, 7)]
    assert result.results[:2] == [None, None]
    for got in result.results[2:]:
        assert got.tobytes() == np.sum(workers, axis=0, dtype=np.int32).tobytes()


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(algorithm="native"), ValueError, "algorithm for allreduce must be one of .*native is the MPI"),
        (dict(world_size=0), ValueError, "world_size must be a positive integer"),
        (dict(count=-1), ValueError, "count must be an integer >= 0"),
        (dict(dtype="bool"), TypeError, "dtype has unsupported dtype bool"),
        (dict(op="mean"), ValueError, "op must be one of"),
        (dict(root=4), ValueError, r"root must be a rank in \[0, 4\)"),
        (dict(segment=3), TypeError, "unknown parameter"),
        (dict(servers=2), TypeError, "servers is a parameter of the parameter_server baseline"),
        (dict(algorithm="parameter_server", servers=4), ValueError, r"servers must be an integer in \[1, world_size\)"),
        (dict(segment_size=0), ValueError, "segment_size must be a positive number of bytes"),
        (dict(inplace="no"), ValueError, "inplace must be True or False"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    args = dict(collective="allreduce", algorithm="ring", world_size=4, count=8)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        sim.run(**args)


def test_time_arguments_are_checked():
    cost = sim.costs("allreduce", "ring", 4, 8)
    with pytest.raises(ValueError, match="alpha must be a finite number >= 0"):
        cost.time(-1, 0, 0)
    with pytest.raises(ValueError, match="gamma must be a finite number >= 0"):
        cost.time(0, 0, float("inf"))
    with pytest.raises(ValueError, match="need ranks_per_node"):
        cost.time(1, 1, 1, inter_alpha=3)


# ---------------------------------------------------------------- projection and fit


def test_projection_closed_forms_equal_the_simulator():
    from collectives.sim import project

    params = dict(alpha=A, beta=B, gamma=G)
    for algorithm in ("ring", "direct", "recursive_halving", "recursive_doubling"):
        for p in (2, 4, 8, 16, 32, 64):
            for nbytes in (4 * p, 256 * p, 4096 * p):
                want = sim.costs("allreduce", algorithm, p, nbytes // 4).time(**params)
                assert project.closed_form(algorithm, p, nbytes, **params) == want, (algorithm, p, nbytes)
    assert project.closed_form("ring", 6, 4 * 6, **params) is None  # not a power of two
    assert project.closed_form("tree", 8, 4 * 8, **params) is None


def test_projection_switches_to_the_closed_form_beyond_the_simulated_range():
    from collectives.sim import project

    model = dict(alpha=A, beta=B, gamma=G)
    small, how = project.predict("ring", 64, 1 << 20, model, max_ops=10**6)
    assert how == "sim"
    assert project.predict("ring", 64, 1 << 20, model, max_ops=10) == (small, "closed form")
    assert project.predict("tree", 64, 1 << 20, model, max_ops=10) == (None, None)


def test_projection_estimates_do_not_undercount_the_plans():
    """predict() simulates where estimated_ops says the plans are small enough: an
    estimate far below the real count would simulate p = 4096 plans of millions of
    operations (the shared-memory algorithms' grow as p² and are left out of projections)."""
    from collectives.algorithms import SHARED_MEMORY
    from collectives.sim import project
    from collectives.sim.simulate import plan_maker, symmetry, timed_ranks

    assert not any(("allreduce", a) in SHARED_MEMORY for a in project.ALLREDUCE)
    for algorithm in project.ALLREDUCE:
        for p in (16, 64):
            for nbytes in (64 << 10, 4 << 20):
                params = dict(segment_size=project.SEGMENT)
                if algorithm.startswith("hierarchical"):
                    params["nodes"] = p
                count = nbytes // 4
                plan_of = plan_maker("allreduce", algorithm, p, count, **params)
                reps = timed_ranks(p, symmetry("allreduce", algorithm, p, count, **params))
                actual = sum(len(plan_of(r).ops) for r in range(reps))
                assert actual <= 2 * project.estimated_ops(algorithm, p, nbytes), (algorithm, p, nbytes, actual)


def synthetic_rows(params, world_sizes=(2, 4)):
    """Benchmark rows whose 'measured' time is the model's under ``params``."""
    rows = []
    for p in world_sizes:
        for collective, algorithm in ALGORITHMS:
            for nbytes in (1 << 12, 1 << 16, 1 << 20, 1 << 22):
                count = nbytes // 4 // (p if collective in ("allgather", "gather", "scatter", "alltoall") else 1)
                t = sim.costs(collective, algorithm, p, count).time(*params)
                rows.append(dict(collective=collective, algorithm=algorithm, bytes=nbytes, count=count, world_size=p,
                                 dtype="float32", time_us=t * 1e6))
        rows.append(dict(collective="allreduce", algorithm="native", bytes=64, count=16, world_size=p,
                         dtype="float32", time_us=1.0))  # another library's: ignored
    return rows


def two_level_rows(params, layouts=((2, 2), (2, 4), (4, 1))):
    """Rows measured (here: made by the model) across nodes, ``layout`` as the benchmark
    writes it."""
    rows = []
    for layout in layouts:
        if isinstance(layout, str):  # uneven node sizes, "3+1": one node label per rank
            sizes = [int(n) for n in layout.split("+")]
            nodes, k, p = len(sizes), [j for j, n in enumerate(sizes) for _ in range(n)], sum(sizes)
        else:
            nodes, k = layout
            p, layout = nodes * k, f"{nodes}x{k}"
        for algorithm in BUILDERS["allreduce"]:
            if algorithm == "shm" and nodes > 1:  # one node only
                continue
            extra = {"nodes": k} if algorithm.startswith("hierarchical") else {}
            for nbytes in (1 << 16, 1 << 20, 1 << 22):
                count = nbytes // 4
                t = sim.costs("allreduce", algorithm, p, count, **extra).time(*params[:3], k, *params[3:])
                rows.append(dict(collective="allreduce", algorithm=algorithm, bytes=nbytes, count=count, world_size=p,
                                 layout=layout, dtype="float32", time_us=t * 1e6))
    return rows


def test_two_level_fit_recovers_the_network_and_the_node():
    from collectives.sim import calibrate

    truth = (9e-6, 2e-10, 3e-10, 40e-6, 8e-9)  # the network: 40 us, 125 MB/s
    rows = calibrate.load_rows_from(two_level_rows(truth, layouts=((2, 2), (4, 1))))
    fitted = calibrate.fit(rows)
    assert fitted == pytest.approx(truth, rel=1e-6)
    # uneven nodes predicted too: this checks that their rows reach the model as node
    # labels (the labels' times themselves: test_two_level_model_takes_one_node_label_per_rank)
    held_out = calibrate.load_rows_from(two_level_rows(truth, layouts=((2, 4), "3+1", "2+3+1")))
    assert max(abs(e) for *_, e in calibrate.compare(held_out, fitted)) < 1e-6
    assert "3+1 " in calibrate.report(calibrate.compare(held_out, fitted))
    with pytest.raises(ValueError, match=r"layout '3\+2': expected nodes x ranks per node \(2x4\) or node sizes"):
        calibrate.fit([dict(rows[0], layout="3+2")])


def test_the_command_line_fits_two_levels_and_compares_held_out_runs(tmp_path, capsys):
    import json

    from collectives.tools.sim import main

    truth = (9e-6, 2e-10, 3e-10, 40e-6, 8e-9)
    fit_file, held_out = tmp_path / "fit.json", tmp_path / "held.json"
    fit_file.write_text(json.dumps(two_level_rows(truth, layouts=((2, 2), (4, 1)))))
    held_out.write_text(json.dumps(two_level_rows(truth, layouts=((2, 4),))))
    main(["--fit", str(fit_file), "--compare", str(held_out), "--max-world-size", "16", "--world-size", "8",
          "--max-bytes", "64K", "--servers", "2", "--plot", str(tmp_path / "p.png"), "--no-progress"])
    out = capsys.readouterr().out
    assert "inter_alpha 40.00 us" in out and "inter_beta 8.0000 ns/B" in out
    assert "2x4 " in out and "2x2 " not in out  # the held-out rows only
    assert "allreduce hierarchical" in out and "within 25%: 100%" in out


def test_fit_recovers_the_parameters_that_made_the_times():
    from collectives.sim import calibrate

    truth = (7e-6, 2e-10, 3e-10)
    rows = synthetic_rows(truth)
    fitted = calibrate.fit(calibrate.load_rows_from(rows))
    assert fitted == pytest.approx(truth, rel=1e-6)
    comparison = calibrate.compare(calibrate.load_rows_from(rows), fitted, 1 << 20)
    assert len(comparison) == 2 * len(ALGORITHMS) * 2
    assert max(abs(e) for *_, e in comparison) < 1e-6


def test_the_command_line_fits_projects_and_plots(tmp_path, capsys):
    import json

    from collectives.tools.sim import main

    bench = tmp_path / "n.json"
    bench.write_text(json.dumps(synthetic_rows((5e-6, 1e-10, 2e-10))))
    png, rows = tmp_path / "p.png", tmp_path / "p.json"
    main(["--fit", str(bench), "--max-world-size", "16", "--world-size", "8", "--max-bytes", "64K",
          "--servers", "2", "--plot", str(png), "--json", str(rows), "--no-progress"])
    out = capsys.readouterr().out
    assert "# fitted: alpha 5.00 us" in out and "within 25%: 100%" in out
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(rows.read_text())
    assert {r["world_size"] for r in data["by_world_size"]} == {2, 4, 8, 16}
    projected = set(BUILDERS["allreduce"]) - {a for c, a in SHARED_MEMORY if c == "allreduce"}  # clusters only
    assert {r["algorithm"] for r in data["by_size"]} == projected | {"parameter_server(S=2)"}
    assert all(r["how"] == "sim" and r["time_s"] > 0 for r in data["by_size"])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--fit", "x.json", "--alpha", "1"], "either --fit or"),
        (["--beta", "-1"], "--beta must be >= 0"),
        (["--inter-beta", "1"], "need --ranks-per-node"),
        (["--plot", "x.svg"], "must name a .png"),
        (["--world-size", "1"], "--world-size must be at least 2"),
        (["--size", "2"], "--size must be a positive multiple of 4"),
    ],
)
def test_the_command_line_rejects_bad_options(argv, message, capsys):
    from collectives.tools.sim import main

    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_fit_rejects_a_file_without_our_rows(tmp_path):
    from collectives.sim import calibrate

    path = tmp_path / "n.json"
    path.write_text('[{"collective": "allreduce", "algorithm": "native", "bytes": 4, "count": 1, "world_size": 2, '
                    '"dtype": "float32", "time_us": 3}]')
    with pytest.raises(ValueError, match="no rows of this library's algorithms"):
        calibrate.load_rows([path])


# ---------------------------------------------------------------- rotation symmetry

@pytest.mark.parametrize("collective,algorithm", sorted(SYMMETRIC))
@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8, 12])
def test_symmetric_calls_time_from_rank_0_as_the_full_simulation_does(collective, algorithm, p):
    # The representatives (rank 0; ranks 0..k-1 with k ranks per node) give every
    # rank's counters and the same time as simulating all p ranks, in every model.
    count = 3 if collective in ("allgather", "alltoall") else 3 * p
    for n in (count, 64 * count):
        fast = sim.costs(collective, algorithm, p, n)
        assert fast.symmetric
        full = sim.simulate.Costs(collective, algorithm, p, n, "float32", 0,
                                  sim.simulate.plan_maker(collective, algorithm, p, n))
        assert counters(fast) == counters(full)
        models = [dict(alpha=A, beta=B, gamma=G), dict(alpha=1.0, beta=B, gamma=0.0)]
        models += [dict(alpha=A, beta=B, gamma=G, ranks_per_node=k, inter_alpha=7 * A, inter_beta=9 * B)
                   for k in (2, 3, 5) if k < p]  # 5 divides none but p=5 itself: the full fallback
        for model in models:
            assert fast.time(**model) == full.time(**model), model
        assert fast.rounds == full.rounds


@pytest.mark.parametrize("collective,algorithm", sorted(NODE_SYMMETRIC))
@pytest.mark.parametrize("p,k", [(4, 2), (6, 2), (6, 3), (8, 4), (12, 3), (8, 8), (8, 1)])
def test_two_level_calls_time_from_one_node_as_the_full_simulation_does(collective, algorithm, p, k):
    # Equal nodes of k ranks: one node's ranks stand for all (lcm(k, the model's ranks
    # per node) of them), with every rank's counters and the full simulation's time.
    count = 3 if collective == "allgather" else 3 * p
    pieces = 8 * hierarchical.PIPELINE_MIN * p  # allreduce in 8 pieces of equal blocks
    for n in (count, 64 * count) + ((pieces,) if collective == "allreduce" and p <= 6 else ()):
        fast = sim.costs(collective, algorithm, p, n, nodes=k)
        assert fast.period == k
        full = sim.simulate.Costs(collective, algorithm, p, n, "float32", 0,
                                  sim.simulate.plan_maker(collective, algorithm, p, n, nodes=k))
        assert counters(fast) == counters(full)
        models = [dict(alpha=A, beta=B, gamma=G)]
        models += [dict(alpha=A, beta=B, gamma=G, ranks_per_node=m, inter_alpha=7 * A, inter_beta=9 * B)
                   for m in {k, 2, 3} if m <= p]
        for model in models:
            assert fast.time(**model) == full.time(**model), model
        assert fast.rounds == full.rounds


def test_uneven_blocks_and_ordered_calls_are_not_symmetric():
    symmetry = sim.simulate.symmetry
    assert symmetry("allreduce", "ring", 4, 10) is None
    assert symmetry("allreduce", "ring", 4, 12) == 1
    assert symmetry("allreduce", "direct", 4, 12, ordered=True) is None
    assert symmetry("allreduce", "tree", 4, 12) is None
    assert symmetry("allreduce", "hierarchical", 8, 16, nodes=4) == 4
    assert symmetry("allreduce", "hierarchical", 8, 12, nodes=4) is None  # blocks of 1 and 2
    assert symmetry("allreduce", "hierarchical", 6, 12, nodes=4) is None  # nodes of 4 and 2
    assert symmetry("allreduce", "hierarchical", 8, 16, nodes=[0, 0, 1, 1, 0, 0, 1, 1]) is None
    assert symmetry("allreduce", "hierarchical_leader", 8, 16, nodes=4) is None
    assert symmetry("alltoallv", "pairwise", 5, 2) == 1  # the default counts are circulant
    assert symmetry("alltoallv", "pairwise", 3, 2, counts=np.array([[0, 1, 2]] * 3)) is None
    assert symmetry("allreduce", "hierarchical", 8, 16, nodes=0) is None
    plans = sim.simulate.plans_for("allreduce", "ring", 4, 12)
    assert sim.simulate.Costs("allreduce", "ring", 4, 12, "float32", 0, plans).time(A, B, G) == \
        sim.costs("allreduce", "ring", 4, 12).time(A, B, G)
    with pytest.raises(ValueError, match="period"):
        sim.simulate.Costs("allreduce", "ring", 4, 12, "float32", 0, plans, period=3)
    result = sim.costs("allreduce", "ring", 4, 10)
    assert not result.symmetric and len(result.plans) == 4


def test_p_4096_with_the_algorithms_that_send_p_squared_messages():
    # p^2 messages at 4096 ranks, costed in seconds: the counters are still the closed
    # forms (ring: 2(p-1) messages of n/p).
    p, count = 4096, 4096 * 16
    ring = sim.costs("allreduce", "ring", p, count)
    assert ring.messages_sent == [2 * (p - 1)] * p
    assert ring.bytes_sent == [2 * (p - 1) * 16 * ITEM] * p
    assert ring.time(alpha=A, beta=B, gamma=G) > 0
    direct = sim.costs("allgather", "direct", p, 16)
    assert direct.messages_sent == [p - 1] * p


ROOTED_O_P2 = [("broadcast", "direct"), ("broadcast", "scatter_allgather"), ("reduce", "direct")]


def full_simulation(collective, algorithm, p, count, root, inplace=False):
    """The simulation itself, from every rank's plan (no closed form, no symmetry)."""
    plan_of = sim.simulate.plan_maker(collective, algorithm, p, count, root=root, inplace=inplace)
    return sim.simulate.Costs(collective, algorithm, p, count, "float32", root, plan_of)


def closed_form_costs(collective, algorithm, p, count, root):
    """What ``costs`` gives above ``SIMULATED_UP_TO`` ranks, made at any p."""
    plan_of = sim.simulate.plan_maker(collective, algorithm, p, count, root=root)
    return sim.simulate.ClosedFormCosts(collective, algorithm, p, count, "float32", root, plan_of)


@pytest.mark.parametrize("sizes", quick_and_deep([*range(2, 13), 16, 17, 32, 64],
                                                 [13, 14, 15, *range(18, 32), *range(33, 41), 63, 100]))
@pytest.mark.parametrize("collective,algorithm", ROOTED_O_P2)
def test_rooted_closed_forms_equal_the_simulation(collective, algorithm, sizes):
    # Counters and time, at every p to 40 and some larger, roots at both ends and in
    # the middle, α-β-γ drawn at random (γ from far below to far above a message).
    rng = np.random.default_rng(7)
    problems = []
    for p in sizes:
        for root in sorted({0, 1 % p, p // 2, p - 1}):
            count = p * int(rng.choice([1, 3, 16]))
            full = full_simulation(collective, algorithm, p, count, root, inplace=bool(rng.integers(2)))
            fast = closed_form_costs(collective, algorithm, p, count, root)
            if counters(fast) != counters(full):
                problems.append(f"p={p} root={root}: counters differ")
            for _ in range(3):
                model = dict(alpha=float(rng.choice([0.0, rng.random()])), beta=rng.random() * 1e-2,
                             gamma=rng.random() * float(rng.choice([1e-4, 1e-2, 1.0])))
                got, want = fast.time(**model), full.time(**model)
                if not math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-15):
                    problems.append(f"p={p} root={root} {model}: closed form {got}, simulated {want}")
            if fast.rounds != full.rounds:
                problems.append(f"p={p} root={root}: rounds {fast.rounds} != {full.rounds}")
    assert not problems, "\n".join(problems[:10])


def test_rooted_closed_forms_leave_two_level_models_to_the_plans():
    # Node links break the closed forms: the time under ranks_per_node is the plans'.
    for collective, algorithm in ROOTED_O_P2:
        full = full_simulation(collective, algorithm, 8, 16, 3)
        fast = closed_form_costs(collective, algorithm, 8, 16, 3)
        model = dict(alpha=A, beta=B, gamma=G, ranks_per_node=4, inter_alpha=7 * A, inter_beta=9 * B)
        assert fast.time(**model) == full.time(**model)
        assert len(fast.plans) == 8


def test_costs_use_the_rooted_closed_forms_only_above_the_simulated_sizes():
    limit = sim.closed_form.SIMULATED_UP_TO
    assert isinstance(sim.costs("broadcast", "direct", limit + 1, limit + 1), sim.simulate.ClosedFormCosts)
    assert not isinstance(sim.costs("broadcast", "direct", limit, limit), sim.simulate.ClosedFormCosts)
    uneven = sim.costs("broadcast", "scatter_allgather", limit + 1, limit + 2)  # blocks of 1 and 2: simulated
    assert not isinstance(uneven, sim.simulate.ClosedFormCosts)
    ordered = sim.costs("reduce", "direct", limit + 1, limit + 1, ordered=True)  # a fold in rank order
    assert not isinstance(ordered, sim.simulate.ClosedFormCosts)
    assert not isinstance(sim.costs("broadcast", "binomial", limit + 1, limit + 1), sim.simulate.ClosedFormCosts)
    empty = sim.costs("broadcast", "direct", limit + 1, 0)  # nothing to send: the plans send nothing
    assert not isinstance(empty, sim.simulate.ClosedFormCosts) and empty.messages_sent == [0] * (limit + 1)
    assert empty.time(A, B, G) == 0


@pytest.mark.parametrize("collective,algorithm", ROOTED_O_P2)
def test_p_4096_with_the_rooted_algorithms_that_send_p_squared_messages(collective, algorithm):
    # 16 million messages each, costed at once by the closed forms, against this file's
    # own formulas (counters: the cost model's; time: closed_form).
    p, count, root = 4096, 4096 * 16, 5
    got = sim.costs(collective, algorithm, p, count, root=root)
    assert counters(got) == expected_counters(collective, algorithm, p, count, root=root)
    want = closed_form(collective, algorithm, p, count * ITEM, G)
    assert got.time(A, B, G) == want


def test_the_projection_counts_every_rank_where_the_nodes_do_not_divide_p():
    # Costs times every rank when lcm(1, ranks per node) does not divide p; the
    # projection's estimate must say so, or it starts a simulation of millions of ops.
    from collectives.sim.project import DEFAULT_MAX_OPS, estimated_ops
    nbytes = 4096 * 4 * 16
    assert estimated_ops("ring", 4096, nbytes, ranks_per_node=8) <= DEFAULT_MAX_OPS
    assert estimated_ops("ring", 4096, nbytes, ranks_per_node=6) > DEFAULT_MAX_OPS
    assert estimated_ops("hierarchical", 4096, nbytes, ranks_per_node=8) <= DEFAULT_MAX_OPS
    assert estimated_ops("hierarchical", 4096, nbytes, ranks_per_node=6) > DEFAULT_MAX_OPS


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "reduce"])
def test_shared_memory_calls_in_many_segments_time_from_rank_0_where_shares_are_equal(collective):
    # shm runs slot by slot: rank 0 stands for all only where every segment's shares are
    # equal (p divides the slot as well as the count); then it gives the full time.
    # reduce: rank 0 is the root, whose time is the call's (its copies out come last).
    for p, slot_elements in ((2, 8), (4, 8), (8, 16), (3, 9)):
        count = slot_elements * 5 + p  # five full segments and a short one
        count -= count % p
        params = dict(segment_size=slot_elements * ITEM)
        fast = sim.costs(collective, "shm", p, count, **params)
        assert fast.symmetric
        full = sim.simulate.Costs(collective, "shm", p, count, "float32", 0,
                                  sim.simulate.plan_maker(collective, "shm", p, count, **params))
        assert counters(fast) == counters(full)
        assert fast.time(alpha=A, beta=B, gamma=G) == full.time(alpha=A, beta=B, gamma=G)
    uneven = sim.simulate.symmetry("allreduce", "shm", 4, 40, segment_size=6 * ITEM)  # slots of 6: shares 2,2,1,1
    assert uneven is None
    assert sim.simulate.symmetry("reduce", "shm", 4, 40, root=1) is None  # rank 0 would not be the root
