"""Pipelined chain broadcast.

    root → root+1 → root+2 → ... → root+p-1      (ranks mod p)
    segment k moves one hop while segment k+1 follows one hop behind

The buffer is cut into segments of ``segment`` elements; each rank receives every
segment from its predecessor and forwards it to its successor as soon as it arrives.
With s segments the time is ≈ (p - 1 + s - 1)(α + n/s·β): for large buffers nearly
n·β whatever p is. Any p works (a chain needs no power of two). No workspace.
"""

from ..schedule import Schedule, sl
from ._layout import segments

DEFAULT_SEGMENT_BYTES = 256 * 1024


def broadcast(rank, size, count, *, root=0, segment, **_):
    s = Schedule([])
    pos = (rank - root) % size
    prev, nxt = (rank - 1) % size, (rank + 1) % size
    for lo, hi in segments(0, count, segment):
        if pos > 0:
            s.recv(prev, sl("out", lo, hi))
        if pos < size - 1:
            s.send(nxt, sl("out", lo, hi))
    return s
