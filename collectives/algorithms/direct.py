"""Direct algorithms: every rank exchanges blocks with every other rank at once.

        ┌──▶ 1
    0 ──┼──▶ 2      every rank sends to and receives from all p-1 others in one
        └──▶ 3      round: no message waits for another message

The buffer is cut into p blocks (as ``numpy.array_split``). reduce_scatter: rank r
sends block q of its input to rank q, for every q ≠ r, and receives block r from
everyone; it reduces the p contributions to block r starting with its own, then rank
r-1's, r-2's … (the order they are sent in), each as soon as it has arrived.
allgather: rank r sends its block to every other rank and receives theirs.
allreduce = the two in a row (NCCL's "two-shot"); broadcast = the root sends block q
to rank q and its own block to everyone, then the other ranks exchange their blocks;
reduce = reduce_scatter, then every rank sends its reduced block to the root.

``ordered=True`` (deterministic mode): every block is reduced in rank order instead,
the left fold x0 op x1 op … op x(p-1), so the result is the serial fold's, bit for
bit, whatever the timing. It costs the overlap: a fold step waits for rank q's block
even when later ones have come, and the α-β model's time of a reduce_scatter grows
from max((p-1)c + n/p·γ, c + (p-1)/p·nγ) to (p-1)(c + n/p·γ), c = α + n/p·β.

Per rank the messages and bytes are the ring's — p-1 messages and (p-1)/p·n bytes
per phase — and so is the time in the α-β model, where a rank sends one message at a
time: (p-1)(α + n/p·β) per phase. What it saves is the ring's chain of p-1 dependent
steps: ranks wait for each other once per phase instead of p-1 times, which is what
costs when a step is a round trip through Python and the OS scheduler (shared
memory, a few ranks, more ranks than cores). With many ranks the p-1 messages in
flight at once congest a network: then ring or recursive halving. Broadcast: the root
sends 2(p-1)/p·n, the others (p-2)/p·n. Any p works: nothing needs a power of two.
Workspace: the p-1 received contributions to one block, (p-1)/p·n (reduce_scatter,
allreduce); none for allgather and broadcast. Each block is reduced once, by its
owner, so every rank gets the same bits.

Cost per rank, p | count (tested in ``tests/unit/test_sim.py``): allreduce 2(p-1) messages,
2(p-1)/p·n sent and received, (p-1)/p·n reduced; reduce_scatter and allgather half of
that (allgather reduces nothing); broadcast root 2(p-1) messages and 2(p-1)/p·n bytes,
the others p-2 messages, (p-2)/p·n sent and n received; reduce: the reduce_scatter's,
plus one message of n/p from every other rank to the root. Ordered or not, the same.
"""

from ..schedule import Schedule, sl
from ._layout import block_bounds


def _reduce_scatter(s, rank, size, bounds, dst, ordered):
    """Rank ``rank`` ends with block ``rank`` reduced over all ranks in slice ``dst``:
    folded in rank order if ``ordered``, else in the order the blocks arrive in."""
    mine = bounds[rank + 1] - bounds[rank]
    s.need_tmp((size - 1) * mine)
    for k in range(1, size):  # rank r+1 first: no rank is everyone's first target
        q = (rank + k) % size
        s.send(q, sl("in", bounds[q], bounds[q + 1]))
    contribution = {rank: sl("in", bounds[rank], bounds[rank + 1])}
    for k in range(1, size):  # from r-1 first: the order they are sent in
        q = (rank - k) % size
        contribution[q] = sl("tmp", (k - 1) * mine, k * mine)
        s.recv(q, contribution[q])
    order = range(size) if ordered else [(rank - k) % size for k in range(size)]
    # Until this rank's own block has joined the fold, the partial result stays in the
    # first contribution's receive slot: in place, ``dst`` is the rank's own block, and
    # writing it earlier would lose that block before it is read.
    first = contribution[order[0]]
    acc, own_folded = first, order[0] == rank
    for q in order[1:]:
        own_folded = own_folded or q == rank
        target = dst if own_folded else first
        s.reduce(target, acc, contribution[q])
        acc = target


def _allgather(s, rank, size, bounds, skip=None):
    """Every rank sends ``out`` block ``rank`` to every other and receives theirs
    (``skip``: a rank that neither sends nor receives here)."""
    for k in range(1, size):
        q = (rank + k) % size
        if q != skip:
            s.send(q, sl("out", bounds[rank], bounds[rank + 1]))
    for k in range(1, size):
        q = (rank - k) % size
        if q != skip:
            s.recv(q, sl("out", bounds[q], bounds[q + 1]))


def allreduce(rank, size, count, *, ordered=False, **_):
    s = Schedule([])
    if size == 1:
        s.copy(sl("out", 0, count), sl("in", 0, count))
        return s
    bounds = block_bounds(count, size)
    _reduce_scatter(s, rank, size, bounds, sl("out", bounds[rank], bounds[rank + 1]), ordered)
    _allgather(s, rank, size, bounds)
    return s


def reduce_scatter(rank, size, count, *, ordered=False, **_):
    s = Schedule([])
    if size == 1:
        s.copy(sl("out", 0, count), sl("in", 0, count))
        return s
    bounds = block_bounds(count, size)
    _reduce_scatter(s, rank, size, bounds, sl("out", 0, bounds[rank + 1] - bounds[rank]), ordered)
    return s


def reduce(rank, size, count, *, root=0, ordered=False, **_):
    """The root's ``out`` gets the result; the other ranks reduce their block into the
    workspace (they have no ``out``) and send it to the root."""
    s = Schedule([])
    if size == 1:
        s.copy(sl("out", 0, count), sl("in", 0, count))
        return s
    bounds = block_bounds(count, size)
    mine = bounds[rank + 1] - bounds[rank]
    if rank == root:
        _reduce_scatter(s, rank, size, bounds, sl("out", bounds[rank], bounds[rank + 1]), ordered)
        for k in range(1, size):
            q = (root + k) % size
            s.recv(q, sl("out", bounds[q], bounds[q + 1]))
        return s
    result = sl("tmp", (size - 1) * mine, size * mine)  # after the receive slots
    s.need_tmp(size * mine)
    _reduce_scatter(s, rank, size, bounds, result, ordered)
    s.send(root, result)
    return s


def allgather(rank, size, count, **_):
    """``count`` is the per-rank element count; ``out`` holds ``size * count``."""
    s = Schedule([])
    bounds = [b * count for b in range(size + 1)]
    s.copy(sl("out", bounds[rank], bounds[rank + 1]), sl("in", 0, count))
    _allgather(s, rank, size, bounds)
    return s


def broadcast(rank, size, count, *, root=0, **_):
    s = Schedule([])
    bounds = block_bounds(count, size)
    if rank == root:
        for k in range(1, size):
            q = (root + k) % size
            s.send(q, sl("out", bounds[q], bounds[q + 1]))
            s.send(q, sl("out", bounds[root], bounds[root + 1]))
        return s
    s.recv(root, sl("out", bounds[rank], bounds[rank + 1]))
    s.recv(root, sl("out", bounds[root], bounds[root + 1]))
    _allgather(s, rank, size, bounds, skip=root)
    return s
