"""Binomial trees: broadcast and reduce.

    broadcast from root 0, p = 8 (relative ranks; reduce runs the arrows backwards)
    step 1: 0 → 4
    step 2: 0 → 2, 4 → 6
    step 3: 0 → 1, 2 → 3, 4 → 5, 6 → 7

Ranks are numbered relative to the root (vr = (rank - root) mod p). A rank receives
from vr with its lowest set bit cleared and sends to vr + 2^k for each 2^k below that
bit, skipping children ≥ p: so any p works, the tree is just not full. lg p steps of
the whole buffer: the choice for small messages. Reduce adds each child's buffer into
a running sum as it arrives (workspace: one receive buffer, plus the running sum on
ranks other than the root).

Cost per rank (tested in ``tests/test_sim.py``): a rank's children are vr + 2^k for the
2^k below vr's lowest set bit (the root: below p) with vr + 2^k < p; broadcast sends
n to each child and receives n once (not the root): the root sends ⌈lg p⌉ messages,
all ranks together (p-1)·n bytes. Reduce runs it backwards: n received and reduced per
child, one n-byte message to the parent.
"""

from ..schedule import Schedule, sl


def broadcast(rank, size, count, *, root=0, **_):
    s = Schedule([])
    whole = sl("out", 0, count)
    vr = (rank - root) % size
    mask = 1
    while mask < size:
        if vr & mask:
            s.recv((rank - mask) % size, whole)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vr + mask < size:
            s.send((rank + mask) % size, whole)
        mask >>= 1
    return s


def reduce(rank, size, count, *, root=0, **_):
    """The root's result goes to ``out``; other ranks write only ``tmp``."""
    s = Schedule([])
    vr = (rank - root) % size
    slot = sl("tmp", 0, count)
    acc = sl("out", 0, count) if vr == 0 else sl("tmp", count, 2 * count)
    s.need_tmp(count if vr == 0 else 2 * count)
    current = sl("in", 0, count)
    mask = 1
    while mask < size:
        if vr & mask:
            s.send((rank - mask) % size, current)
            break
        if vr + mask < size:
            s.recv((rank + mask) % size, slot)
            s.reduce(acc, current, slot)
            current = acc
        mask <<= 1
    if vr == 0 and current.buf == "in":
        s.copy(acc, current)
    return s
