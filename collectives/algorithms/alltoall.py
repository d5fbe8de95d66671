"""All-to-all: rank r's block j goes to rank j, as block r of its result. In
alltoallv the blocks differ in length: rank r sends send[j] elements to rank j and
receives recv[i] from rank i (recv[i] is rank i's send[r]).

    pairwise, p = 4 (step k: send to r+k, receive from r-k)
    step 1: 0→1 1→2 2→3 3→0
    step 2: 0→2 1→3 2→0 3→1
    step 3: 0→3 1→0 2→1 3→2

    bruck, p = 5: rotate so that slot i holds the block for rank r+i; at step k = 1,
    2, 4 send every slot whose index has bit k to r+k, receive the same slots from r-k
    (packed into one message each way); then slot i holds the block from rank r-i

Pairwise: p-1 messages of n/p bytes per rank, (p-1)(α + n/p·β) with one message at a
time, the bandwidth-optimal choice (alltoallv: p-1 messages at most, empty blocks are
not sent; Σ_j (α + send[j]·β) out); the transport posts all p-1 steps at once (the
step order is the order they are posted in), so no step waits for the one before.
Bruck: ⌈lg p⌉ messages of at most ⌈p/2⌉ blocks, ⌈lg p⌉(α + n/2·β) for p a power of
two: fewer messages, each block travels up to lg p times; the choice for small blocks.
n is the whole input (p blocks). Both work for every p. Workspace: none (pairwise);
the rotated input plus two packing areas of ⌈p/2⌉ blocks (Bruck).
"""

from ..schedule import Schedule, sl


def pairwise(rank, size, count, counts=None, **_):
    """``count`` is the block: ``in`` and ``out`` hold ``size * count`` elements.
    ``counts`` (alltoallv): ``(send, recv)``, the element count of each block this rank
    sends and receives, in rank order, packed one after another in ``in`` and ``out``;
    ``send[rank] == recv[rank]``."""
    send, recv = counts if counts is not None else ((count,) * size, (count,) * size)
    first_in, first_out = _starts(send), _starts(recv)

    def block(buf, starts, lengths, j):
        return sl(buf, starts[j], starts[j] + lengths[j])

    s = Schedule([])
    s.copy(block("out", first_out, recv, rank), block("in", first_in, send, rank))
    for k in range(1, size):
        to, frm = (rank + k) % size, (rank - k) % size
        s.send(to, block("in", first_in, send, to))
        s.recv(frm, block("out", first_out, recv, frm))
    return s


def _starts(lengths):
    """Where each block begins when blocks of ``lengths`` are packed in order."""
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    return starts


def bruck(rank, size, count, **_):
    s = Schedule([])
    half = (size + 1) // 2  # the most slots any step moves
    pack, unpack = size * count, (size + half) * count  # the packing areas after the p rotated slots
    s.need_tmp((size + 2 * half) * count)

    def slot(i, buf="tmp", base=0):
        return sl(buf, base + i * count, base + (i + 1) * count)

    for i in range(size):  # slot i: the block for rank + i
        s.copy(slot(i), slot((rank + i) % size, "in"))
    k = 1
    while k < size:
        moving = [i for i in range(size) if i & k]
        for j, i in enumerate(moving):
            s.copy(slot(j, base=pack), slot(i))
        s.send((rank + k) % size, sl("tmp", pack, pack + len(moving) * count))
        s.recv((rank - k) % size, sl("tmp", unpack, unpack + len(moving) * count))
        for j, i in enumerate(moving):
            s.copy(slot(i), slot(j, base=unpack))
        k *= 2
    for i in range(size):  # slot i now holds the block from rank - i
        s.copy(slot((rank - i) % size, "out"), slot(i))
    return s
