"""Pipelined binary-tree allreduce (as NCCL's tree: reduce up, broadcast down, with
segments in flight at once).

              0                 segment k climbs: leaves send it to their parent,
           /     \\              which adds its own and its children's parts and
          1       2             passes it on; rank 0 then sends the finished
         / \\     / \\            segment back down. Segment k+1 climbs while
        3   4   5   6           segment k descends.

Ranks form a heap-ordered binary tree (children of r are 2r+1 and 2r+2), so any p
works, powers of two or not: the last level is simply partly filled. The buffer is cut
into segments of ``segment`` elements. An inner rank sends about 2n bytes (n up, n
down); its depth-first latency is ≈ (2·depth + segments)·α. Workspace: two segments per
child (double buffering). Every element is reduced once, at its way up, in one order
(own, left child, right child), then copied down: all ranks get the same bits.

Cost per rank (s segments; tested in ``tests/unit/test_sim.py``): with c children and a
parent (not the root), s·(c + 1) messages and (c + 1)·n bytes sent and received, c·n
reduced; the root s·c messages and c·n bytes.
"""

from ..schedule import Schedule, sl
from ._layout import segments

DEFAULT_SEGMENT_BYTES = 256 * 1024


def allreduce(rank, size, count, *, segment, **_):
    s = Schedule([])
    if size == 1:
        s.copy(sl("out", 0, count), sl("in", 0, count))
        return s
    parent = (rank - 1) // 2 if rank else None
    children = [c for c in (2 * rank + 1, 2 * rank + 2) if c < size]
    segs = segments(0, count, segment)
    width = max(hi - lo for lo, hi in segs)
    s.need_tmp(2 * len(children) * width)
    for k, (lo, hi) in enumerate(segs):
        mine, result = sl("in", lo, hi), sl("out", lo, hi)
        slots = [sl("tmp", (2 * j + k % 2) * width, (2 * j + k % 2) * width + hi - lo) for j in range(len(children))]
        for child, slot in zip(children, slots):
            s.recv(child, slot)
        partial = mine
        for slot in slots:
            s.reduce(result, partial, slot)
            partial = result
        if parent is not None:
            s.send(parent, partial)
            s.recv(parent, result)
        for child in children:
            s.send(child, result)
    return s
