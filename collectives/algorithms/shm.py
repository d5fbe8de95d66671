"""Shared-memory algorithms (``shm``): the ranks of one node meet in a shared window.

    rank 0 ──copy──▶ ┌ slot 0 ┐                    rank r folds share r of every     everyone
    rank 1 ──copy──▶ │ slot 1 │ ──fence──▶  slot, in rank order, into its own ──fence──▶ copies
    rank 2 ──copy──▶ └ slot 2 ┘            slot's share r (its own part read     every share
                                            from its input in place)             out

No messages: every rank copies its input into its own slot of a window all ranks of
the node map (``shm``), a *fence* waits until every rank has reached it (after which
each rank sees what the others wrote before it), and the ranks then read each other's
slots in place. allreduce: copy in (all but the rank's own share); fence; rank r folds
share r of every slot (its own from ``in``) into share r of its slot; fence; every rank
copies every share out. reduce_scatter: rank r's slot holds a piece of every other
block; fence; rank r folds block r's pieces into its ``out``. allgather: copy in;
fence; copy every slot out. broadcast: the root copies into the window (one slot the
size of all p); fence; the others copy out. reduce: allreduce, but only the root
copies the shares out.

A window holds two banks of p slots of ``segment`` elements at most (fewer for a
shorter call); a call longer than a slot runs in segments, alternating banks, so that
segment k+2 writes a bank only after a fence that every rank passes once it has
finished reading segment k (the executor also alternates the banks from call to call:
:mod:`collectives.transport.shm`).

**Registered buffers** (``registered=(stride, offset)``: every rank's input lives in
memory the node shares, ``Communicator.empty``, rank q's element i at ``reg[q·stride +
offset + i]``): nothing is copied in; the ranks read each other's inputs where they are.

    allreduce (in place):  fence; rank r folds share r of every input into its own
                           array; fence; copies every other share from its owner's
                           array; fence (nobody reads this rank's array any more)
    reduce_scatter:        fence; rank r folds block r of every input into out; fence
    allgather:             fence; every rank copies every input into out; fence
    broadcast:             fence; the others copy the root's array; fence

No window data, no segments: three fences (allreduce) or two, whatever the size. The
last fence is there because the caller may write its array as soon as the call
returns, and another rank may still be reading it. reduce has no registered form.

Every reduction is the left fold x0 op x1 op … op x(p-1) in rank order, so these are
deterministic-mode algorithms, and every rank's result has the same bits.

Cost per rank for n bytes (the memory traffic is what costs here): allreduce copies
(p-1)/p·n in, reads n and writes n/p to fold, copies n out: 2n + (p-1)/p·2n moved (4.5n
at p = 2) and 2 fences per segment. MPI's shared-memory messages cost a copy into and
out of its cells on each hop, so a ring moves about as much (5.5n at p = 2): what this
saves is the messages, not the copies. reduce_scatter: (p-1)/p·n in, n reduced, one
fence per segment; allgather: n/p in, n out, one fence; broadcast: the root n in, the
others n out, one fence. In the simulator a fence costs α after the last rank arrives,
a copy to or from ``shm`` m·β, a fold step m·γ. Any p works. Only ranks that share
memory can run them: the communicator refuses them across nodes and for device arrays.

Registered, per rank: allreduce reads every input's share (n) and writes its own
share (n/p) to fold, then copies the other shares in, (p-1)/p·n read and written: at
p = 2, 2.5n moved, the physical floor (read both halves, write one, fetch the other),
and 3 fences; a rank r ≥ 2 folds beside its array first (n/p more each way), since
its own share is an input of a later fold step.
reduce_scatter: n read, n/p written; allgather: n in and out; broadcast: n (the root
nothing). Copies from ``reg`` cost m·β in the simulator, as copies to ``shm`` do.
"""

from ..schedule import Schedule, sl
from ._layout import block_bounds, segments

REGISTERED = ("allreduce", "reduce_scatter", "allgather", "broadcast")  # collectives with a registered form

DEFAULT_SLOT_BYTES = 1 << 20  # one rank's slot in one bank: the segment of a long call


def _slot(bank, rank, size, slot):
    """The first element of ``rank``'s slot in ``bank`` (0 or 1)."""
    return (bank * size + rank) * slot


def _fold(s, dst, srcs):
    """``dst = srcs[0] op srcs[1] op …``, left to right; ``dst`` overlaps none of them."""
    s.reduce(dst, srcs[0], srcs[1])
    for src in srcs[2:]:
        s.reduce(dst, dst, src)


def _trivial(count):
    s = Schedule([])
    s.copy(sl("out", 0, count), sl("in", 0, count))
    return s


def _reduce_to(s, rank, size, count, slot):
    """allreduce's and reduce's steps up to the second fence, per segment: the other
    ranks' shares of this rank's input copied into its slot; fence; share ``rank``
    folded, in rank order (its own part read from ``in`` in place), into the slot's
    share ``rank`` (the part nobody copied in: so the fold's target overlaps none of
    its inputs, in place too); fence. Yields ``(bank, lo, bounds)`` after each
    segment's last fence."""
    s.need_shm(2 * size * slot)
    for k, (lo, hi) in enumerate(segments(0, count, slot)):
        bank, s.banks = k % 2, k + 1
        bounds = block_bounds(hi - lo, size)
        first, last = bounds[rank], bounds[rank + 1]
        mine = _slot(bank, rank, size, slot)
        s.copy(sl("shm", mine, mine + first), sl("in", lo, lo + first))
        s.copy(sl("shm", mine + last, mine + hi - lo), sl("in", lo + last, hi))
        s.fence()
        _fold(s, sl("shm", mine + first, mine + last), [sl("in", lo + first, lo + last) if q == rank else
                          sl("shm", _slot(bank, q, size, slot) + first, _slot(bank, q, size, slot) + last)
                          for q in range(size)])
        s.fence()
        yield bank, lo, bounds


def _theirs(rank, stride, offset, lo, hi):
    """Elements ``[lo, hi)`` of ``rank``'s registered input."""
    base = rank * stride + offset
    return sl("reg", base + lo, base + hi)


def _allreduce_registered(rank, size, count, stride, offset):
    """In place on registered arrays (see the module's drawing)."""
    s = Schedule([])
    if count == 0:
        return s
    bounds = block_bounds(count, size)
    first, last = bounds[rank], bounds[rank + 1]
    inputs = [sl("in", first, last) if q == rank else _theirs(q, stride, offset, first, last) for q in range(size)]
    s.fence()
    if rank < 2:  # its own share is read by the fold's first step, before anything is written
        _fold(s, sl("out", first, last), inputs)
    else:
        s.need_tmp(last - first)
        _fold(s, sl("tmp", 0, last - first), inputs)
        s.copy(sl("out", first, last), sl("tmp", 0, last - first))
    s.fence()
    for q in range(size):
        if q != rank:
            s.copy(sl("out", bounds[q], bounds[q + 1]), _theirs(q, stride, offset, bounds[q], bounds[q + 1]))
    s.fence()
    return s


def _reduce_scatter_registered(rank, size, count, stride, offset):
    s = Schedule([])
    bounds = block_bounds(count, size)
    if bounds[1] == 0:  # every block empty
        return s
    first, last = bounds[rank], bounds[rank + 1]
    s.fence()
    if last > first:
        _fold(s, sl("out", 0, last - first), [sl("in", first, last) if q == rank else
                                              _theirs(q, stride, offset, first, last) for q in range(size)])
    s.fence()
    return s


def _copy_out(s, rank, size, slot, bank, lo, bounds):
    """Every rank's reduced share of the segment at ``lo``, from its slot into ``out``."""
    for q in range(size):
        start = _slot(bank, q, size, slot)
        s.copy(sl("out", lo + bounds[q], lo + bounds[q + 1]), sl("shm", start + bounds[q], start + bounds[q + 1]))


def allreduce(rank, size, count, *, segment=1, registered=None, **_):
    if size == 1:
        return _trivial(count)
    if registered is not None:
        return _allreduce_registered(rank, size, count, *registered)
    s = Schedule([])
    slot = min(max(1, segment), count)
    if count == 0:
        return s
    for bank, lo, bounds in _reduce_to(s, rank, size, count, slot):
        _copy_out(s, rank, size, slot, bank, lo, bounds)
    return s


def reduce(rank, size, count, *, root=0, segment=1, **_):
    """allreduce, but only the root copies the shares out."""
    if size == 1:
        return _trivial(count)
    s = Schedule([])
    slot = min(max(1, segment), count)
    if count == 0:
        return s
    for bank, lo, bounds in _reduce_to(s, rank, size, count, slot):
        if rank == root:
            _copy_out(s, rank, size, slot, bank, lo, bounds)
    return s


def reduce_scatter(rank, size, count, *, segment=1, registered=None, **_):
    """Each segment carries a piece of every block: rank r's slot holds pieces
    ``[t, t + piece)`` of blocks 0 … p-1 side by side, and rank q folds block q's."""
    if size == 1:
        return _trivial(count)
    if registered is not None:
        return _reduce_scatter_registered(rank, size, count, *registered)
    s = Schedule([])
    bounds = block_bounds(count, size)
    longest = bounds[1] - bounds[0]
    if longest == 0:
        return s
    piece = min(max(1, segment // size), longest)
    slot = size * piece
    s.need_shm(2 * size * slot)
    for k, (t, end) in enumerate(segments(0, longest, piece)):
        bank, s.banks = k % 2, k + 1
        mine = _slot(bank, rank, size, slot)
        for q in range(size):  # every block's piece but this rank's own, which it reads in place
            n = max(0, min(end, bounds[q + 1] - bounds[q]) - t)
            if q != rank:
                s.copy(sl("shm", mine + q * piece, mine + q * piece + n), sl("in", bounds[q] + t, bounds[q] + t + n))
        s.fence()
        n = max(0, min(end, bounds[rank + 1] - bounds[rank]) - t)
        own = bounds[rank] + t
        _fold(s, sl("out", t, t + n), [sl("in", own, own + n) if q == rank else
                                       sl("shm", _slot(bank, q, size, slot) + rank * piece,
                                          _slot(bank, q, size, slot) + rank * piece + n) for q in range(size)])
    return s


def allgather(rank, size, count, *, segment=1, registered=None, **_):
    """``count`` is the per-rank element count; ``out`` holds ``size * count``."""
    s = Schedule([])
    s.copy(sl("out", rank * count, (rank + 1) * count), sl("in", 0, count))
    if size == 1 or count == 0:
        return s
    if registered is not None:
        stride, offset = registered
        s.fence()
        for q in range(size):
            if q != rank:
                s.copy(sl("out", q * count, (q + 1) * count), _theirs(q, stride, offset, 0, count))
        s.fence()
        return s
    slot = min(max(1, segment), count)
    s.need_shm(2 * size * slot)
    for k, (lo, hi) in enumerate(segments(0, count, slot)):
        bank, s.banks = k % 2, k + 1
        mine = _slot(bank, rank, size, slot)
        s.copy(sl("shm", mine, mine + hi - lo), sl("in", lo, hi))
        s.fence()
        for q in range(size):
            if q != rank:
                start = _slot(bank, q, size, slot)
                s.copy(sl("out", q * count + lo, q * count + hi), sl("shm", start, start + hi - lo))
    return s


def broadcast(rank, size, count, *, root=0, segment=1, registered=None, **_):
    """The root's data goes through one slot the size of a whole bank."""
    s = Schedule([])
    if size == 1 or count == 0:
        return s
    if registered is not None:
        stride, offset = registered
        s.fence()
        if rank != root:
            s.copy(sl("out", 0, count), _theirs(root, stride, offset, 0, count))
        s.fence()
        return s
    whole = min(size * max(1, segment), count)
    s.need_shm(2 * whole)
    for k, (lo, hi) in enumerate(segments(0, count, whole)):
        start, s.banks = (k % 2) * whole, k + 1
        if rank == root:
            s.copy(sl("shm", start, start + hi - lo), sl("out", lo, hi))
        s.fence()
        if rank != root:
            s.copy(sl("out", lo, hi), sl("shm", start, start + hi - lo))
    return s
