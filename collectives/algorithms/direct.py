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
to rank q and its own block to everyone, then the other ranks exchange their blocks.

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

Cost per rank, p | count (tested in ``tests/test_sim.py``): allreduce 2(p-1) messages,
2(p-1)/p·n sent and received, (p-1)/p·n reduced; reduce_scatter and allgather half of
that (allgather reduces nothing); broadcast root 2(p-1) messages and 2(p-1)/p·n bytes,
the others p-2 messages, (p-2)/p·n sent and n received.
"""

from ..schedule import Schedule, sl
from ._layout import block_bounds


def _reduce_scatter(s, rank, size, bounds, dst_at_bounds):
    """Rank ``rank`` ends with block ``rank`` reduced over all ranks, in ``out`` at
    ``bounds[rank]`` (``dst_at_bounds``, allreduce) or at 0 (reduce_scatter)."""
    mine = bounds[rank + 1] - bounds[rank]
    s.need_tmp((size - 1) * mine)
    for k in range(1, size):  # rank r+1 first: no rank is everyone's first target
        q = (rank + k) % size
        s.send(q, sl("in", bounds[q], bounds[q + 1]))
    slots = []
    for k in range(1, size):  # from r-1 first: the order they are sent in
        slot = sl("tmp", (k - 1) * mine, k * mine)
        s.recv((rank - k) % size, slot)
        slots.append(slot)
    lo = bounds[rank] if dst_at_bounds else 0
    dst = sl("out", lo, lo + mine)
    acc = sl("in", bounds[rank], bounds[rank + 1])  # read before dst is written: in place is safe
    for slot in slots:
        s.reduce(dst, acc, slot)
        acc = dst


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


def allreduce(rank, size, count, **_):
    s = Schedule([])
    if size == 1:
        s.copy(sl("out", 0, count), sl("in", 0, count))
        return s
    bounds = block_bounds(count, size)
    _reduce_scatter(s, rank, size, bounds, dst_at_bounds=True)
    _allgather(s, rank, size, bounds)
    return s


def reduce_scatter(rank, size, count, **_):
    s = Schedule([])
    if size == 1:
        s.copy(sl("out", 0, count), sl("in", 0, count))
        return s
    _reduce_scatter(s, rank, size, block_bounds(count, size), dst_at_bounds=False)
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
