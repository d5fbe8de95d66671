"""Scatter + allgather broadcast (van de Geijn).

    1. binomial scatter from the root: each rank gets its block of the buffer
       (root 0, p = 4: 0 → 2 blocks 2-3, then 0 → 1 block 1, 2 → 3 block 3)
    2. ring allgather of the blocks (see ``ring``)

Ranks are numbered relative to the root and the blocks are cut as
``numpy.array_split`` cuts them, in that order. The root sends about n bytes instead
of lg p · n, so this wins for large buffers: ≈ (lg p + p - 1)α + 2(p-1)/p·nβ. The
binomial scatter skips subtrees past p, so any p works. No workspace.

Cost per rank with p | count (blocks b = n/p; tested in ``tests/unit/test_sim.py``): rank vr
receives its subtree's t = min(lowbit(vr), p - vr) blocks (the root has all p), sends
(t - 1)·b to its children (one message each, as in ``binomial``), then p-1 ring
messages of b each way. The root sends 2(p-1)·b = 2(p-1)/p·n.
"""

from ..schedule import Schedule, sl
from ._layout import block_bounds
from .ring import allgather_ring


def broadcast(rank, size, count, *, root=0, **_):
    s = Schedule([])
    bounds = block_bounds(count, size)
    ranks = [(root + j) % size for j in range(size)]
    vr = (rank - root) % size

    def blocks(first, last):
        return sl("out", bounds[first], bounds[min(last, size)])

    mask = 1
    while mask < size:
        if vr & mask:
            s.recv(ranks[vr - mask], blocks(vr, vr + mask))
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vr + mask < size:
            s.send(ranks[vr + mask], blocks(vr + mask, vr + 2 * mask))
        mask >>= 1
    allgather_ring(s, vr, size, bounds, ranks)
    return s
