"""Recursive halving: reduce_scatter, and allreduce as Rabenseifner's algorithm
(recursive-halving reduce-scatter, then recursive-doubling allgather).

    p = 8, halving: distance 4, then 2, then 1; doubling runs the other way
    step 1: 0↔4 1↔5 2↔6 3↔7   each keeps one half of its range, sends the other
    step 2: 0↔2 1↔3 4↔6 5↔7   ... of the half it kept
    step 3: 0↔1 2↔3 4↔5 6↔7   now rank v holds block v reduced over all ranks

Each rank sends (p-1)/p·n bytes per phase in lg p messages: the bandwidth of the ring
with the latency of a tree. A world size that is not a power of two is folded first
(see ``Fold``): of each of the first 2·(p - p') ranks' pairs, the even rank sends its
whole buffer to the odd one, which reduces it in and stands for both; the p' remaining
ranks run the power-of-two algorithm on ranges made of their real blocks; at the end
the odd rank sends the pair's result back (the even rank's block for reduce_scatter,
the whole buffer for allreduce). Workspace: half the buffer to receive into, plus the
whole buffer on ranks that receive a fold, plus (reduce_scatter only) the running sums.

Cost per rank (n bytes, p | count so blocks are b = n/p; p' = 2^⌊lg p⌋, e = p - p';
tested against these in ``tests/unit/test_sim.py``). Virtual block v weighs w_v = 2b for
v < e (a pair's two blocks), else b; W_d(v) is the weight of the aligned group of d
virtual blocks holding v. A halving step at distance d keeps, receives and reduces
W_d(v) and sends the other half, so over the lg p' steps a rank sends n - w_v and
receives and reduces K_v = Σ_{d=1,2,…,p'/2} W_d(v); the doubling steps mirror this
(send K_v, receive n - w_v).
    allreduce:      2 lg p' messages, n - w_v + K_v bytes sent and received, K_v reduced
    reduce_scatter: lg p' messages, n - w_v sent, K_v received and reduced
The pair's even rank sends n in one message and receives the result (n; its block b
for reduce_scatter). The odd rank adds the fold: n more received and reduced, and one
more message back (n for allreduce, b for reduce_scatter). For p a power of two this
is the cost model's 2 lg p messages, 2(p-1)/p·n sent, (p-1)/p·n reduced.
"""

from ..schedule import Schedule, sl
from ._layout import Fold, block_bounds, doubling_exchange, virtual_offsets


def _reduce_in_order(s, dst, mine, theirs, me, peer):
    """dst = lower rank's data op higher rank's data: one fixed order per element."""
    if me < peer:
        s.reduce(dst, mine, theirs)
    else:
        s.reduce(dst, theirs, mine)


def fold_in(s, fold, count, acc, recv_at):
    """The fold step: the even rank of a pair sends its input; the odd one reduces it
    into ``acc(0, count)`` after receiving it at ``recv_at``. Returns where the rank's
    running data lives afterwards (``"in"`` until something is reduced)."""
    if fold.folded_out:
        s.send(fold.rank + 1, sl("in", 0, count))
        return None
    if fold.is_pair_keeper:
        s.recv(fold.rank - 1, sl("tmp", recv_at, recv_at + count))
        s.reduce(acc(0, count), sl("tmp", recv_at, recv_at + count), sl("in", 0, count))
        return acc
    return lambda lo, hi: sl("in", lo, hi)


def halving(s, fold, offsets, current, acc):
    """The power-of-two recursive-halving steps for a virtual rank.

    ``current(lo, hi)`` gives the slice with the rank's data for an element range;
    after the first reduction it is ``acc``. Receives go to ``tmp[0:half]``.
    Returns the virtual block range [lo, hi) this rank ends with (one block).
    """
    v = fold.vrank
    lo, hi = 0, fold.pof2
    d = fold.pof2 // 2
    while d >= 1:
        mid = lo + d
        partner = v ^ d
        keep, give = ((lo, mid), (mid, hi)) if v < partner else ((mid, hi), (lo, mid))
        k_lo, k_hi = offsets[keep[0]], offsets[keep[1]]
        peer = fold.real(partner)
        s.send(peer, current(offsets[give[0]], offsets[give[1]]))
        slot = sl("tmp", 0, k_hi - k_lo)
        s.recv(peer, slot)
        _reduce_in_order(s, acc(k_lo, k_hi), current(k_lo, k_hi), slot, fold.rank, peer)
        current = acc
        lo, hi = keep
        d //= 2
    return current


def _receive_space(offsets):
    """The largest range a rank keeps at the first halving step (later ones are
    smaller): blocks differ by one element, so this can exceed half the buffer."""
    middle = offsets[len(offsets) // 2]
    return max(middle - offsets[0], offsets[-1] - middle)


def reduce_scatter(rank, size, count, **_):
    s = Schedule([])
    bounds = block_bounds(count, size)
    mine = sl("out", 0, bounds[rank + 1] - bounds[rank])
    fold = Fold(rank, size)
    offsets = virtual_offsets(fold, bounds)
    half = _receive_space(offsets)
    # Running sums live in tmp after the receive space, indexed like the input.
    acc = lambda lo, hi: sl("tmp", half + lo, half + hi)  # noqa: E731
    s.need_tmp(half + count + (count if fold.is_pair_keeper else 0))
    current = fold_in(s, fold, count, acc, recv_at=half + count)
    if fold.folded_out:
        s.recv(rank + 1, mine)
        return s
    current = halving(s, fold, offsets, current, acc)
    if fold.is_pair_keeper:
        s.send(rank - 1, current(bounds[rank - 1], bounds[rank]))
    s.copy(mine, current(bounds[rank], bounds[rank + 1]))
    return s


def allreduce(rank, size, count, **_):
    s = Schedule([])
    fold = Fold(rank, size)
    whole = sl("out", 0, count)
    acc = lambda lo, hi: sl("out", lo, hi)  # noqa: E731
    offsets = virtual_offsets(fold, block_bounds(count, size))
    s.need_tmp(count if fold.is_pair_keeper else _receive_space(offsets))
    current = fold_in(s, fold, count, acc, recv_at=0)
    if fold.folded_out:
        s.recv(rank + 1, whole)
        return s
    if fold.pof2 == 1:
        s.copy(whole, current(0, count))
        return s
    halving(s, fold, offsets, current, acc)
    doubling_exchange(s, fold, offsets)
    if fold.is_pair_keeper:
        s.send(rank - 1, whole)
    return s
