"""Layouts shared by the algorithms: how a buffer is cut into blocks, and how a world
size that is not a power of two is folded onto one that is."""

from functools import lru_cache

from ..schedule import sl


@lru_cache(maxsize=64)  # every rank of a call asks for the same (the simulator: p times)
def block_bounds(count, parts):
    """Offsets of ``parts`` blocks of ``count`` elements, as ``numpy.array_split`` cuts
    them: the first ``count % parts`` blocks hold one element more. Block ``b`` is
    ``[bounds[b], bounds[b + 1])`` (a tuple: shared between callers)."""
    base, extra = divmod(count, parts)
    bounds = [0]
    for b in range(parts):
        bounds.append(bounds[-1] + base + (b < extra))
    return tuple(bounds)


def segments(lo, hi, segment):
    """Split ``[lo, hi)`` into pipelining segments of at most ``segment`` elements."""
    segment = max(1, int(segment))
    return [(s, min(s + segment, hi)) for s in range(lo, hi, segment)] or [(lo, lo)]


class Fold:
    """Fold ``size`` ranks onto ``pof2``, the largest power of two <= size.

    The first ``2 * extra`` ranks pair up (2i, 2i+1); the even one hands its data to the
    odd one and sits out the power-of-two phase, so virtual rank ``v`` is real rank
    ``2v + 1`` for ``v < extra`` and ``v + extra`` after. Virtual rank ``v`` stands for
    the real blocks of its ranks, which are adjacent, so its share is still one
    contiguous range: ``[first_block(v), first_block(v + 1))``.
    """

    def __init__(self, rank, size):
        self.rank, self.size = rank, size
        self.pof2 = 1 << (size.bit_length() - 1)
        self.extra = size - self.pof2
        if rank < 2 * self.extra:
            self.vrank = rank // 2 if rank % 2 else None
        else:
            self.vrank = rank - self.extra

    @property
    def folded_out(self):
        """True for the even rank of a pair: it only sends in and receives back."""
        return self.vrank is None

    @property
    def is_pair_keeper(self):
        """True for the odd rank of a pair, which works for both."""
        return self.rank < 2 * self.extra and self.rank % 2 == 1

    def real(self, v):
        return 2 * v + 1 if v < self.extra else v + self.extra

    def first_block(self, v):
        """The first real block of virtual rank ``v`` (``v == pof2`` gives ``size``)."""
        return 2 * v if v < self.extra else v + self.extra


def doubling_exchange(s, fold, offsets, buf="out"):
    """Recursive-doubling allgather among the virtual ranks of ``fold`` over ``buf``:
    at distance d = 1, 2, 4 ... each virtual rank swaps the d virtual blocks it holds
    with partner ``v XOR d``. ``offsets[v]`` is where virtual block ``v`` starts."""
    v = fold.vrank
    d = 1
    while d < fold.pof2:
        partner = v ^ d
        mine = v & ~(d - 1)
        theirs = partner & ~(d - 1)
        s.send(fold.real(partner), sl(buf, offsets[mine], offsets[mine + d]))
        s.recv(fold.real(partner), sl(buf, offsets[theirs], offsets[theirs + d]))
        d *= 2


def virtual_offsets(fold, bounds):
    """Element offsets of the virtual blocks of ``fold`` given the real block bounds."""
    return _virtual_offsets(fold.size, tuple(bounds))


@lru_cache(maxsize=64)
def _virtual_offsets(size, bounds):
    fold = Fold(0, size)  # the layout depends on the size only
    return tuple(bounds[fold.first_block(v)] for v in range(fold.pof2 + 1))
