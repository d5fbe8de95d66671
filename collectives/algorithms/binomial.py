"""Binomial trees: broadcast, reduce, gather and scatter.

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

Cost per rank (tested in ``tests/unit/test_sim.py``): a rank's children are vr + 2^k for the
2^k below vr's lowest set bit (the root: below p) with vr + 2^k < p; broadcast sends
n to each child and receives n once (not the root): the root sends ⌈lg p⌉ messages,
all ranks together (p-1)·n bytes. Reduce runs it backwards: n received and reduced per
child, one n-byte message to the parent.

Gather and scatter move blocks, not the whole buffer: the subtree of vr is the virtual
ranks [vr, vr + e) with e = min(lowbit(vr), p - vr) (the root: e = p), and a rank
forwards its whole subtree's blocks in one message.

    gather to root 0, p = 8, blocks of n bytes (scatter runs the arrows backwards)
    step 1: 1 → 0, 3 → 2, 5 → 4, 7 → 6       (n each)
    step 2: 2 → 0, 6 → 4                     (2n each)
    step 3: 4 → 0                            (4n)

Cost per rank: vr sends e·n bytes to its parent in one message (not the root) and
receives each child's subtree, (e - 1)·n bytes in all; the root receives (p-1)·n in
⌈lg p⌉ messages, so lg p·α + (p-1)·n·β at the root, the time of the whole call. The
blocks travel in virtual-rank order: for a root other than 0 the root rotates them
once between its workspace and the caller's buffer (one copy of p·n bytes).
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


def _subtree(vr, size):
    """How many virtual ranks the subtree of ``vr`` holds: [vr, vr + extent)."""
    return size if vr == 0 else min(vr & -vr, size - vr)


def gather(rank, size, count, *, root=0, **_):
    """Block r of the root's ``out`` (``count`` elements each) is rank r's ``in``. The
    other ranks gather their subtree's blocks in ``tmp``, in virtual-rank order."""
    s = Schedule([])
    vr = (rank - root) % size
    extent = _subtree(vr, size)
    buf = "out" if vr == 0 and root == 0 else "tmp"
    if buf == "tmp" and extent > 1:  # a leaf sends its input as it is
        s.need_tmp(extent * count)
    if extent > 1 or vr == 0:
        s.copy(sl(buf, 0, count), sl("in", 0, count))
    mask = 1
    while mask < extent:
        child = vr + mask
        s.recv((child + root) % size, sl(buf, mask * count, (mask + _subtree(child, size)) * count))
        mask <<= 1
    if vr:
        mine = sl("in", 0, count) if extent == 1 else sl(buf, 0, extent * count)
        s.send((vr - (vr & -vr) + root) % size, mine)
    elif root != 0:  # virtual block v is real block (v + root) % size
        head = (size - root) * count
        s.copy(sl("out", root * count, size * count), sl("tmp", 0, head))
        s.copy(sl("out", 0, root * count), sl("tmp", head, size * count))
    return s


def scatter(rank, size, count, *, root=0, **_):
    """Rank r's ``out`` (``count`` elements) is block r of the root's ``in``. The other
    ranks receive their subtree's blocks in ``tmp`` (a leaf: straight into ``out``)."""
    s = Schedule([])
    vr = (rank - root) % size
    extent = _subtree(vr, size)
    if vr == 0:
        if root == 0:
            buf = "in"
        else:  # rotate into virtual-rank order once
            buf = "tmp"
            s.need_tmp(size * count)
            head = (size - root) * count
            s.copy(sl("tmp", 0, head), sl("in", root * count, size * count))
            s.copy(sl("tmp", head, size * count), sl("in", 0, root * count))
    elif extent == 1:
        s.recv((vr - (vr & -vr) + root) % size, sl("out", 0, count))
        return s
    else:
        buf = "tmp"
        s.need_tmp(extent * count)
        s.recv((vr - (vr & -vr) + root) % size, sl(buf, 0, extent * count))
    mask = 1 << ((extent - 1).bit_length() - 1) if extent > 1 else 0  # the farthest child first
    while mask:
        child = vr + mask
        s.send((child + root) % size, sl(buf, mask * count, (mask + _subtree(child, size)) * count))
        mask >>= 1
    s.copy(sl("out", 0, count), sl(buf, 0, count))
    return s
