"""Peer-read algorithms (``one_shot``, ``two_shot``, ``leader``): the ranks of one node
read each other's inputs where they are, between two fences.

    one_shot allreduce                      two_shot allreduce

    x0  x1  x2  x3   every input, in place   x0  x1  x2  x3
     \\   \\ /   /                              | \\ | \\ | \\ |      rank r folds share r
    ──── fence ────                         ──── fence ────       of every input into
    rank r: out = x0 op x1 op x2 op x3      s0  s1  s2  s3        slot r of the window
    ──── fence ────                         ──── fence ────
    (nobody reads x_r any more)             rank r: out = s0 | s1 | s2 | s3

    leader allreduce (for ranks that share one GPU)

    x0  x1  x2  x3   every input, in place
    ──── fence ────
    rank 0: v = x0 op x1 op x2 op x3, written into out0, out1, out2, out3 (one pass)
    ──── fence ────  (the others did nothing on the device: their outputs are written)

No messages: every rank's input is memory the node's ranks can all read (device
memory opened through CUDA IPC, by :mod:`collectives.transport.device_node`), a *fence*
waits until every rank has reached it, and a rank reads the others' inputs only
between two fences. The first fence says every input is ready (and, on the device,
where it is); the second that nobody reads this rank's input (or, for two_shot, the
others' inputs) any more, so the caller may write it as soon as the call returns.
two_shot's second phase reads the reduced shares from the window slots (``shm``), not
from the inputs: a slot is written again only after the next call's first fence, which
every rank reaches once it has finished this call. So every call has two fences, at
any size, and nothing is cut into segments.

    allreduce one_shot   fence; out = x0 op … op x(p-1) (in place: into tmp, then out
                         after the second fence); fence
    allreduce two_shot   fence; slot r = share r of x0 op … op x(p-1); fence; out =
                         slot 0 | slot 1 | … | slot p-1
    allreduce leader     fence; rank 0: out = x0 op … op x(p-1), copied into every
                         other rank's out (``rout``: every output, rank q's from
                         q·count); fence
    reduce_scatter       fence; out = block r of x0 op … op x(p-1); fence
    reduce_scatter       fence; rank 0: block q of x0 op … op x(p-1) into rank q's out,
      leader             for every q (``rout``, rank q's from q·the largest block); fence
    allgather            out[r] = x_r; fence; out[q] = x_q for every other q; fence
    allgather leader     fence; rank 0: x_q into row q of every rank's out, for every q
                         (``rout``, rank q's from q·p·count); fence
    broadcast            fence; the others copy the root's array; fence
    broadcast leader     fence; the root copies its array into every other rank's; fence
    reduce               fence; the root folds every input; fence

``registered=(stride, offset)``: rank q's input element i is element ``q·stride +
offset + i`` of ``reg`` (default ``(count, 0)``: the inputs side by side, as the
in-process runner and the simulator lay them out; the device executor reads slice q
from rank q's own buffer). ``shm`` (two_shot) holds p equal slots, slot q written by
rank q alone: the device executor places slot q in rank q's memory.

Every fold is the left fold x0 op x1 op … op x(p-1) in rank order, so these are
deterministic-mode algorithms and every rank's result has the same bits; on the
device the fold of p ≤ 16 inputs is one kernel (``schedule.fuse_reductions``), and
the leader's fold and its copies into the p ≤ 16 outputs one kernel too
(``device_node``: each element's inputs read before its outputs are written), its
reduce_scatter's p ≤ 16 folds, a block each, one kernel, and its allgather's p²
copies one kernel up to 4 ranks (``device_node``: each input read once and written
into every rank's output, 16 // p inputs a kernel; broadcast's p - 1 copies likewise).

Why a leader: a GPU the ranks share runs one process's work at a time and switches
between them (measured on an H200: a small kernel and its wait took 20 us on one
rank alone, 275 us with 2 ranks each running one, 550 us with 4). With the leader one
process runs the call's device work; the others only pass the fences on the host.
With a GPU each, the leader's would carry everyone's traffic alone: it is for ranks
that share one. Each leader moves what all ranks of its one_shot move together: on a
GPU they share, the same traffic, from one process.

Cost per rank for n bytes of input (memory traffic; a fence costs the
synchronisation floor F): one_shot allreduce reads p·n and writes n, 2F (in place: n
more each way, through tmp); two_shot reads n and writes n/p, then reads and writes n,
2F; reduce_scatter reads n and writes n/p; allgather (n: the gathered size) reads and
writes n; broadcast: the others read and write n, the root nothing; reduce: the root
reads p·n and writes n; leader allreduce: rank 0 reads p·n and writes p·n, the others
nothing, 2F; the other leaders, rank 0 (broadcast's root) alone: reduce_scatter reads
p·n and writes n, allgather reads n and writes p·n, broadcast reads n and writes
(p-1)·n (on the device each input is read once for all of its copies).
One GPU shared by the p ranks carries the sum of their traffic at its copy
rate B: one_shot allreduce p(p + 1)·n/B, two_shot (3p + 1)·n/B, leader 2p·n/B (the
same-GPU bound's own count), each after 2F. In the simulator a fence costs α after
the last rank arrives, a copy from ``reg`` or ``shm`` (or into ``rout``) m·β, a fold
step m·γ. Any p works; only ranks of one node run them.
"""

from ..schedule import Schedule, sl
from ._layout import block_bounds

ALGORITHMS = {"allreduce": ("one_shot", "two_shot", "leader"), "reduce_scatter": ("one_shot", "leader"),
              "allgather": ("one_shot", "leader"), "broadcast": ("one_shot", "leader"), "reduce": ("one_shot",)}


def _input(q, rank, registered, lo, hi):
    """Elements ``[lo, hi)`` of rank ``q``'s input: its own ``in``, another rank's in ``reg``."""
    if q == rank:
        return sl("in", lo, hi)
    stride, offset = registered
    base = q * stride + offset
    return sl("reg", base + lo, base + hi)


def _output(q, stride, lo, hi):
    """Elements ``[lo, hi)`` of rank ``q``'s output, another rank's (in ``rout``, rank
    q's output from ``q·stride``: the schedule's ``share_output(stride)``)."""
    return sl("rout", q * stride + lo, q * stride + hi)


def _fold(s, dst, srcs):
    """``dst = srcs[0] op srcs[1] op …``, left to right; ``dst`` overlaps none of them
    except, possibly, ``srcs[0]`` or ``srcs[1]`` (read by the first step, before it
    writes)."""
    if len(srcs) == 1:
        s.copy(dst, srcs[0])
        return
    s.reduce(dst, srcs[0], srcs[1])
    for src in srcs[2:]:
        s.reduce(dst, dst, src)


def _trivial(count):
    s = Schedule([])
    s.copy(sl("out", 0, count), sl("in", 0, count))
    return s


def _layout(count, registered):
    return (count, 0) if registered is None else tuple(registered)


def allreduce_one_shot(rank, size, count, *, registered=None, inplace=False, **_):
    if size == 1:
        return _trivial(count)
    s = Schedule([])
    if count == 0:
        return s
    where = _layout(count, registered)
    inputs = [_input(q, rank, where, 0, count) for q in range(size)]
    s.fence()
    if inplace:  # out is this rank's input, which the others read until the second fence
        s.need_tmp(count)
        _fold(s, sl("tmp", 0, count), inputs)
        s.fence()
        s.copy(sl("out", 0, count), sl("tmp", 0, count))
    else:
        _fold(s, sl("out", 0, count), inputs)
        s.fence()
    return s


def allreduce_two_shot(rank, size, count, *, registered=None, **_):
    if size == 1:
        return _trivial(count)
    s = Schedule([])
    if count == 0:
        return s
    where = _layout(count, registered)
    bounds = block_bounds(count, size)
    slot = bounds[1] - bounds[0]  # the largest share: every slot holds that much
    s.need_shm(size * slot)
    first, last = bounds[rank], bounds[rank + 1]
    s.fence()
    if last > first:
        _fold(s, sl("shm", rank * slot, rank * slot + last - first),
              [_input(q, rank, where, first, last) for q in range(size)])
    s.fence()
    for q in range(size):  # in place too: nobody reads the inputs after the second fence
        s.copy(sl("out", bounds[q], bounds[q + 1]), sl("shm", q * slot, q * slot + bounds[q + 1] - bounds[q]))
    return s


def allreduce_leader(rank, size, count, *, registered=None, **_):
    """Rank 0 folds every input into its output and copies it into every other rank's;
    the others only pass the fences: on a GPU the ranks share, one process runs the
    call's device work (each further one costs a switch of the GPU between processes)."""
    if size == 1:
        return _trivial(count)
    s = Schedule([])
    if count == 0:
        return s
    where = _layout(count, registered)
    s.share_output(count)
    s.fence()
    if rank == 0:  # in place too: its input is the fold's first, read before it writes; no other reads it
        _fold(s, sl("out", 0, count), [_input(q, rank, where, 0, count) for q in range(size)])
        for q in range(1, size):  # their inputs, in place, were read by the fold before
            s.copy(_output(q, count, 0, count), sl("out", 0, count))
    s.fence()
    return s


def reduce_scatter(rank, size, count, *, registered=None, **_):
    if size == 1:
        return _trivial(count)
    s = Schedule([])
    bounds = block_bounds(count, size)
    if bounds[1] == 0:  # every block empty
        return s
    where = _layout(count, registered)
    first, last = bounds[rank], bounds[rank + 1]
    s.fence()
    if last > first:
        _fold(s, sl("out", 0, last - first), [_input(q, rank, where, first, last) for q in range(size)])
    s.fence()
    return s


def reduce_scatter_leader(rank, size, count, *, registered=None, **_):
    """Rank 0 folds every block of every input into its rank's output (its own
    included); the others only pass the fences."""
    if size == 1:
        return _trivial(count)
    s = Schedule([])
    bounds = block_bounds(count, size)
    if bounds[1] == 0:  # every block empty
        return s
    where = _layout(count, registered)
    s.share_output(bounds[1] - bounds[0], apart=True)  # the largest block; an output is never the input
    s.fence()
    if rank == 0:
        for q in range(size):
            lo, hi = bounds[q], bounds[q + 1]
            if hi > lo:
                dst = sl("out", 0, hi - lo) if q == 0 else _output(q, bounds[1], 0, hi - lo)
                _fold(s, dst, [_input(r, rank, where, lo, hi) for r in range(size)])
    s.fence()
    return s


def allgather_leader(rank, size, count, *, registered=None, **_):
    """Rank 0 copies every rank's input into every rank's output (its own included);
    the others only pass the fences. ``count``: the per-rank element count."""
    s = Schedule([])
    if size == 1 or count == 0:
        s.copy(sl("out", rank * count, (rank + 1) * count), sl("in", 0, count))
        return s
    where = _layout(count, registered)
    s.share_output(size * count, apart=True)  # an output is never the input
    s.fence()
    if rank == 0:
        for r in range(size):
            for q in range(size):
                lo, hi = q * count, (q + 1) * count
                s.copy(sl("out", lo, hi) if r == 0 else _output(r, size * count, lo, hi),
                       _input(q, rank, where, 0, count))
    s.fence()
    return s


def broadcast_leader(rank, size, count, *, root=0, registered=None, **_):
    """The root copies its array into every other rank's; the others only pass the
    fences."""
    s = Schedule([])
    if size == 1 or count == 0:
        return s
    s.share_output(count)
    s.fence()
    if rank == root:
        for q in range(size):
            if q != root:
                s.copy(_output(q, count, 0, count), sl("in", 0, count))
    s.fence()
    return s


def allgather(rank, size, count, *, registered=None, **_):
    """``count`` is the per-rank element count; ``out`` holds ``size * count``."""
    s = Schedule([])
    s.copy(sl("out", rank * count, (rank + 1) * count), sl("in", 0, count))
    if size == 1 or count == 0:
        return s
    where = _layout(count, registered)
    s.fence()
    for q in range(size):
        if q != rank:
            s.copy(sl("out", q * count, (q + 1) * count), _input(q, rank, where, 0, count))
    s.fence()
    return s


def broadcast(rank, size, count, *, root=0, registered=None, **_):
    s = Schedule([])
    if size == 1 or count == 0:
        return s
    where = _layout(count, registered)
    s.fence()
    if rank != root:
        s.copy(sl("out", 0, count), _input(root, rank, where, 0, count))
    s.fence()
    return s


def reduce(rank, size, count, *, root=0, registered=None, inplace=False, **_):
    """The root folds every rank's input; the others only pass the fences (they keep
    their inputs unchanged until the root has read them)."""
    if size == 1:
        return _trivial(count)
    s = Schedule([])
    if count == 0:
        return s
    where = _layout(count, registered)
    s.fence()
    if rank == root:
        inputs = [_input(q, rank, where, 0, count) for q in range(size)]
        if inplace and rank >= 2:  # out is its own input, read by a later step of the fold
            s.need_tmp(count)
            _fold(s, sl("tmp", 0, count), inputs)
            s.copy(sl("out", 0, count), sl("tmp", 0, count))
        else:
            _fold(s, sl("out", 0, count), inputs)
    s.fence()
    return s


BUILDERS = {
    ("allreduce", "one_shot"): allreduce_one_shot,
    ("allreduce", "two_shot"): allreduce_two_shot,
    ("allreduce", "leader"): allreduce_leader,
    ("reduce_scatter", "one_shot"): reduce_scatter,
    ("reduce_scatter", "leader"): reduce_scatter_leader,
    ("allgather", "one_shot"): allgather,
    ("allgather", "leader"): allgather_leader,
    ("broadcast", "one_shot"): broadcast,
    ("broadcast", "leader"): broadcast_leader,
    ("reduce", "one_shot"): reduce,
}
