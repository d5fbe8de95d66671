"""Ring algorithms: reduce_scatter, allgather and allreduce (= the two in a row).

    rank 0 ──▶ rank 1 ──▶ rank 2 ──▶ ... ──▶ rank p-1 ──┐
      ▲                                                 │
      └─────────────────────────────────────────────────┘

The buffer is cut into p blocks (as ``numpy.array_split``). Reduce-scatter: at step
t = 0 … p-2 each rank sends block (r-t-1) to its right neighbour and receives block
(r-t-2) from its left one, adding its own contribution, so after p-1 steps rank r
holds block r reduced over all ranks. Allgather: at step t each rank forwards block
(r-t) and receives block (r-t-1). Each rank sends (p-1)/p·n bytes per phase: the
allreduce bound 2(p-1)/p·n. Any p works as is: the ring needs no power of two, and
blocks differ by at most one element. Workspace: two blocks (double buffering).
"""

from ..schedule import Schedule, sl
from ._layout import block_bounds


def reduce_scatter_ring(s, pos, size, bounds, ranks, partial_in_out, source="in", dest="out", slots_at=0):
    """Ring reduce-scatter steps: afterwards ``pos`` holds block ``pos`` reduced.

    ``ranks[i]`` is the real rank at ring position i. The contributions are read from
    buffer ``source`` at ``bounds`` (offsets into the buffer). Partial sums of the
    other blocks live in ``dest`` (allreduce: ``out`` is full size) or, if not
    ``partial_in_out``, in the receive slot itself (reduce_scatter: ``out`` is one
    block). The final reduction of block ``pos`` goes to ``dest`` at ``bounds[pos]``
    (allreduce) or at 0 (reduce_scatter). The two receive slots are ``tmp`` from
    ``slots_at``. ``source`` may be ``dest`` (the two-level algorithms reduce in place).
    """
    right, left = ranks[(pos + 1) % size], ranks[(pos - 1) % size]
    width = max(bounds[b + 1] - bounds[b] for b in range(size))
    s.need_tmp(slots_at + 2 * width)
    held = None  # slice holding the partial sum to send next
    for t in range(size - 1):
        send_b = (pos - t - 1) % size
        s.send(right, held if held is not None else sl(source, bounds[send_b], bounds[send_b + 1]))
        recv_b = (pos - t - 2) % size
        length = bounds[recv_b + 1] - bounds[recv_b]
        first = slots_at + (t % 2) * width
        slot = sl("tmp", first, first + length)
        s.recv(left, slot)
        own = sl(source, bounds[recv_b], bounds[recv_b + 1])
        if t == size - 2:
            dst = sl(dest, bounds[recv_b], bounds[recv_b + 1]) if partial_in_out else sl(dest, 0, length)
        else:
            dst = sl(dest, bounds[recv_b], bounds[recv_b + 1]) if partial_in_out else slot
        s.reduce(dst, slot, own)
        held = dst


def allgather_ring(s, pos, size, bounds, ranks, buf="out"):
    """Ring allgather steps over ``buf``: position ``pos`` starts with its own block."""
    right, left = ranks[(pos + 1) % size], ranks[(pos - 1) % size]
    for t in range(size - 1):
        send_b = (pos - t) % size
        recv_b = (pos - t - 1) % size
        s.send(right, sl(buf, bounds[send_b], bounds[send_b + 1]))
        s.recv(left, sl(buf, bounds[recv_b], bounds[recv_b + 1]))


def allreduce(rank, size, count, **_):
    s = Schedule([])
    bounds = block_bounds(count, size)
    if size == 1:
        s.copy(sl("out", 0, count), sl("in", 0, count))
        return s
    ranks = list(range(size))
    reduce_scatter_ring(s, rank, size, bounds, ranks, partial_in_out=True)
    allgather_ring(s, rank, size, bounds, ranks)
    return s


def reduce_scatter(rank, size, count, **_):
    s = Schedule([])
    bounds = block_bounds(count, size)
    if size == 1:
        s.copy(sl("out", 0, count), sl("in", 0, count))
        return s
    reduce_scatter_ring(s, rank, size, bounds, list(range(size)), partial_in_out=False)
    return s


def allgather(rank, size, count, **_):
    """``count`` is the per-rank element count; ``out`` holds ``size * count``."""
    s = Schedule([])
    bounds = [b * count for b in range(size + 1)]
    s.copy(sl("out", bounds[rank], bounds[rank + 1]), sl("in", 0, count))
    allgather_ring(s, rank, size, bounds, list(range(size)))
    return s
