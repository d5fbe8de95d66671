"""Bruck allgather: ⌈lg p⌉ steps for any p.

    p = 5, rank r holds blocks r, r+1, ... (mod p) in a rotated workspace
    step 1 (d=1): send my 1 block to r-1, get 1 block from r+1    → holds 2
    step 2 (d=2): send my 2 blocks to r-2, get 2 from r+2         → holds 4
    step 3 (d=4): send 1 block (p - 4) to r-4, get 1 from r+4     → holds 5
    then rotate: block (r + j) mod p moves from workspace slot j to its place

Works for every p as is: the last step sends only the p - d blocks still missing.
The rotation is a local copy. Workspace: the whole gathered buffer (rotated).
"""

from ..schedule import Schedule, sl


def allgather(rank, size, count, **_):
    """``count`` is the per-rank element count; ``out`` holds ``size * count``."""
    s = Schedule([])
    total = size * count
    s.need_tmp(total)
    s.copy(sl("tmp", 0, count), sl("in", 0, count))
    d = 1
    while d < size:
        blocks = min(d, size - d)
        s.send((rank - d) % size, sl("tmp", 0, blocks * count))
        s.recv((rank + d) % size, sl("tmp", d * count, (d + blocks) * count))
        d *= 2
    head = (size - rank) * count
    s.copy(sl("out", rank * count, total), sl("tmp", 0, head))
    s.copy(sl("out", 0, rank * count), sl("tmp", head, total))
    return s
