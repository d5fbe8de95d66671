"""Recursive doubling: allreduce and allgather.

    p = 8: distance 1, then 2, then 4
    step 1: 0↔1 2↔3 4↔5 6↔7
    step 2: 0↔2 1↔3 4↔6 5↔7
    step 3: 0↔4 1↔5 2↔6 3↔7

Allreduce: at each step partners swap their whole buffers and both compute
(lower rank's data) op (higher rank's data), so they get the same bits; lg p
messages of n bytes: the latency-optimal choice for small buffers. Allgather: partners
swap the blocks they have gathered so far, doubling them each step. A world size that
is not a power of two is folded first (see ``Fold``): the even rank of each of the
first 2·(p - p') ranks' pairs sends its data to the odd one and gets the result back
at the end. Workspace: allreduce one buffer to receive into; allgather none.

Cost per rank (tested in ``tests/unit/test_sim.py``; p' = 2^⌊lg p⌋): allreduce, lg p'
messages of n bytes, each received and reduced; the pair's even rank sends n once and
receives n; the odd rank adds n received and reduced (the fold) and one n-byte message
back. Allgather, b = the gathered n/p: a rank sends K_v and receives n - w_v over
lg p' messages (w_v and K_v as in ``recursive_halving``: (p-1)·b each for p a power of
two); the even rank of a pair sends its b and receives all n, the odd rank adds b
received and one n-byte message back.
"""

from ..schedule import Schedule, sl
from ._layout import Fold, doubling_exchange
from .recursive_halving import _reduce_in_order, fold_in


def allreduce(rank, size, count, **_):
    s = Schedule([])
    fold = Fold(rank, size)
    whole = sl("out", 0, count)
    s.need_tmp(count)
    current = fold_in(s, fold, count, lambda lo, hi: sl("out", lo, hi), recv_at=0)
    if fold.folded_out:
        s.recv(rank + 1, whole)
        return s
    d = 1
    while d < fold.pof2:
        peer = fold.real(fold.vrank ^ d)
        s.send(peer, current(0, count))
        s.recv(peer, sl("tmp", 0, count))
        _reduce_in_order(s, whole, current(0, count), sl("tmp", 0, count), rank, peer)
        current = lambda lo, hi: sl("out", lo, hi)  # noqa: E731
        d *= 2
    if current(0, count).buf == "in":
        s.copy(whole, current(0, count))
    if fold.is_pair_keeper:
        s.send(rank - 1, whole)
    return s


def allgather(rank, size, count, **_):
    """``count`` is the per-rank element count; ``out`` holds ``size * count``."""
    s = Schedule([])
    fold = Fold(rank, size)
    total = size * count
    s.copy(sl("out", rank * count, (rank + 1) * count), sl("in", 0, count))
    if fold.folded_out:
        s.send(rank + 1, sl("in", 0, count))
        s.recv(rank + 1, sl("out", 0, total))
        return s
    if fold.is_pair_keeper:
        s.recv(rank - 1, sl("out", (rank - 1) * count, rank * count))
    offsets = [fold.first_block(v) * count for v in range(fold.pof2 + 1)]
    doubling_exchange(s, fold, offsets)
    if fold.is_pair_keeper:
        s.send(rank - 1, sl("out", 0, total))
    return s
