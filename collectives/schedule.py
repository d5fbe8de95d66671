"""Schedules: what an algorithm says, independent of how messages are carried.

An algorithm builds, for one rank, a *schedule*: a list of operations written as if
they ran one after another:

    Send(peer, src)        send the elements of slice ``src`` to ``peer``
    Recv(peer, dst)        receive from ``peer`` into slice ``dst``
    Reduce(dst, a, b)      dst = a op b (the collective's op), elementwise
    Copy(dst, src)         dst = src
    ReduceMany(dst, srcs)  dst = srcs[0] op srcs[1] op ... folded left: no algorithm
                           writes it; :func:`fuse_reductions` makes it of a chain of
                           Reduce for the device, where it is one kernel
    Fence()                wait until every rank has reached this point: what any rank
                           wrote to ``shm`` before it is then what every rank reads
                           (the shared-memory algorithms' only synchronisation)

A slice names a buffer and an element range: ``("in", lo, hi)``, ``("out", lo, hi)``,
``("tmp", lo, hi)`` or ``("shm", lo, hi)``. ``in`` is the caller's input (read only),
``out`` the result and ``tmp`` a workspace whose size the schedule states. ``shm`` is
memory every rank of the node sees, the same elements for all (a shared window; the
schedule states its size too): only the shared-memory algorithms use it, and only
executors that have one run them (``collectives.transport.shm`` and the in-process
runner). ``("reg", lo, hi)`` is every rank's input at once, where the inputs are
registered buffers (arrays in memory the node shares, ``Communicator.empty``): rank q's
element i is element ``q·stride + offset + i`` of ``reg``, ``stride`` and ``offset``
given to the algorithm; a plan reads it, and only between fences. ``("rout", lo, hi)``
is every rank's output at once, rank q's element i at ``q·stride + i``, ``stride`` the
schedule's ``rout_stride`` (its largest output): a plan writes it, only between fences
(the leader algorithms, whose one rank writes every output). Buffers are flat and
contiguous.

:func:`compile_plan` turns the list into a :class:`Plan`: each operation waits only for
the earlier operations that touch the same elements (read after write, write after
read, write after write), so a transport may post every send and receive whose data
is ready and overlap everything else. For an in-place call ``in`` and ``out`` are one
buffer, and the plan says so. Messages between two ranks match in the order each side
lists them: a transport posts the sends to one peer in schedule order, and likewise
the receives, so one tag per collective call is enough.

Transports (MPI, in-process, the device's) execute plans; they never know the algorithm.
"""

from bisect import bisect_right
from collections import namedtuple
from dataclasses import dataclass

Slice = namedtuple("Slice", "buf lo hi")
Send = namedtuple("Send", "peer src")
Recv = namedtuple("Recv", "peer dst")
Reduce = namedtuple("Reduce", "dst a b")
Copy = namedtuple("Copy", "dst src")
ReduceMany = namedtuple("ReduceMany", "dst srcs")
Fence = namedtuple("Fence", "")

BUFFERS = ("in", "out", "tmp", "shm", "reg", "rout")
_END = 1 << 62  # past the end of any buffer


def sl(buf, lo, hi):
    """Shorthand for a :class:`Slice`."""
    return Slice(buf, int(lo), int(hi))


@dataclass
class Schedule:
    """One rank's part of a collective: operations in program order, and the
    workspace (in elements) they need."""

    ops: list
    tmp: int = 0
    shm: int = 0
    banks: int = 0  # shared-memory schedules: how many segments (banks used in turn, 0, 1, 0 …)
    shared_out: bool = False  # another rank writes this rank's output (``rout``): every rank's says where it is
    rout_stride: int = 0  # elements from one rank's output to the next in ``rout`` (share_output)
    outputs_apart: bool = False  # no rank's output shares memory with its input (share_output)

    def send(self, peer, src):
        self.ops.append(Send(peer, src))

    def recv(self, peer, dst):
        self.ops.append(Recv(peer, dst))

    def reduce(self, dst, a, b):
        self.ops.append(Reduce(dst, a, b))

    def copy(self, dst, src):
        self.ops.append(Copy(dst, src))

    def fence(self):
        self.ops.append(Fence())

    def need_tmp(self, elements):
        self.tmp = max(self.tmp, int(elements))

    def need_shm(self, elements):
        self.shm = max(self.shm, int(elements))

    def share_output(self, stride, apart=False):
        """Another rank writes this rank's output (its ``rout`` slices, rank q's output
        from element ``q·stride``: at least its size): the executor says where it is,
        whether this rank's own plan writes any ``rout`` or not. ``apart``: no rank's
        output shares memory with its input (the collective has no in-place form, and
        its callers copy an input that overlaps the output), so the executor may write
        outputs while it reads inputs in one kernel."""
        self.shared_out = True
        self.rout_stride = int(stride)
        self.outputs_apart = bool(apart)


@dataclass(frozen=True)
class Plan:
    """A compiled schedule, shared by every call with the same parameters.

    ``ops[i]`` may start once the ``waits[i]`` operations it depends on have completed
    and, for a send or receive, once ``fifo_prev[i]`` (the previous message to or from
    the same peer, or -1) has been posted. ``dependents[i]`` lists the operations that
    wait for ``i``; ``fifo_next[i]`` the one that waits for ``i`` to be posted;
    ``predecessors[i]`` the operations ``i`` waits for (the device executor makes its
    streams wait on their events); ``readers[i]`` the operations that read what ``i``
    wrote (the device executor lets a reduction read a peer's memory in place of a
    receive that only it reads).
    """

    ops: tuple
    waits: tuple
    dependents: tuple
    fifo_prev: tuple
    fifo_next: tuple
    tmp: int
    predecessors: tuple = ()
    readers: tuple = ()
    shm: int = 0  # elements of the node's shared window the plan addresses (0: none)
    banks: int = 0  # how many segments it runs through the window's two banks in turn
    shared_out: bool = False  # another rank writes this rank's output (Schedule.share_output)
    rout_stride: int = 0  # and where in ``rout`` (Schedule.rout_stride)
    outputs_apart: bool = False  # no rank's output shares memory with its input (Schedule.share_output)

    def initial_pending(self):
        return [w + (p >= 0) for w, p in zip(self.waits, self.fifo_prev)]


class _Accesses:
    """Who last wrote, and who read since, each element range of one buffer."""

    def __init__(self):
        self.bounds = [0, _END]
        self.states = [(-1, ())]  # (last writer, readers since that write)

    def _split(self, x):
        i = bisect_right(self.bounds, x) - 1
        if self.bounds[i] != x:
            self.bounds.insert(i + 1, x)
            self.states.insert(i + 1, self.states[i])
            i += 1
        return i

    def _pieces(self, lo, hi):
        i = self._split(lo)
        j = self._split(hi)
        return i, j

    def read(self, op, lo, hi, deps, read_from=None):
        i, j = self._pieces(lo, hi)
        for k in range(i, j):
            writer, readers = self.states[k]
            if writer >= 0:
                deps.add(writer)
                if read_from is not None:
                    read_from.add(writer)
            self.states[k] = (writer, readers + (op,))

    def write(self, op, lo, hi, deps):
        i, j = self._pieces(lo, hi)
        for k in range(i, j):
            writer, readers = self.states[k]
            if writer >= 0:
                deps.add(writer)
            deps.update(readers)
        del self.bounds[i + 1 : j]
        self.states[i:j] = [(op, ())]


_EVERYTHING = tuple(Slice(buf, 0, _END) for buf in BUFFERS)


def _reads_writes(op):
    if isinstance(op, Fence):  # after it, other ranks' writes are visible: as if it wrote everything
        return (), _EVERYTHING
    if isinstance(op, Send):
        return (op.src,), ()
    if isinstance(op, Recv):
        return (), (op.dst,)
    if isinstance(op, Reduce):
        return (op.a, op.b), (op.dst,)
    if isinstance(op, ReduceMany):
        return tuple(op.srcs), (op.dst,)
    return (op.src,), (op.dst,)


def _length(s):
    return s.hi - s.lo


def compile_plan(schedule, inplace=False):
    """Compile ``schedule`` into a :class:`Plan`.

    Operations on zero elements are dropped (the peer drops its matching one too, since
    both sides compute the same slice lengths), and so are copies of a slice onto
    itself (an in-place call's ``out = in``). With ``inplace`` the ``in`` buffer is
    the ``out`` buffer, so hazards between the two are respected.
    """
    alias = {"in": "out"} if inplace else {}

    def same_elements(a, b):
        return alias.get(a.buf, a.buf) == alias.get(b.buf, b.buf) and a.lo == b.lo and a.hi == b.hi

    ops = [
        op
        for op in schedule.ops
        if isinstance(op, Fence) or (_length(op.dst if isinstance(op, (Reduce, Copy, ReduceMany)) else op[1]) > 0
                                     and not (isinstance(op, Copy) and same_elements(op.dst, op.src)))
    ]
    accesses = {}
    waits, dependents, predecessors, readers = [], [[] for _ in ops], [], [[] for _ in ops]
    fifo_prev, fifo_next = [-1] * len(ops), [-1] * len(ops)
    last_message = {}
    for index, op in enumerate(ops):
        deps = set()
        reads, writes = _reads_writes(op)
        for s in () if isinstance(op, Fence) else reads + writes:
            if s.buf not in BUFFERS or not 0 <= s.lo <= s.hi or (s.buf == "tmp" and s.hi > schedule.tmp) \
                    or (s.buf == "shm" and s.hi > schedule.shm):
                raise ValueError(f"schedule slice {s} is outside its buffer (tmp holds {schedule.tmp}, "
                                 f"shm {schedule.shm})")
        read_from = set()
        for s in reads:
            accesses.setdefault(alias.get(s.buf, s.buf), _Accesses()).read(index, s.lo, s.hi, deps, read_from)
        for writer in read_from:
            readers[writer].append(index)
        for s in writes:
            accesses.setdefault(alias.get(s.buf, s.buf), _Accesses()).write(index, s.lo, s.hi, deps)
        deps.discard(index)
        waits.append(len(deps))
        predecessors.append(tuple(sorted(deps)))
        for d in deps:
            dependents[d].append(index)
        if isinstance(op, (Send, Recv)):
            key = (type(op), op.peer)
            prev = last_message.get(key, -1)
            if prev >= 0:
                fifo_prev[index] = prev
                fifo_next[prev] = index
            last_message[key] = index
    return Plan(
        ops=tuple(ops),
        waits=tuple(waits),
        dependents=tuple(tuple(d) for d in dependents),
        fifo_prev=tuple(fifo_prev),
        fifo_next=tuple(fifo_next),
        tmp=schedule.tmp,
        predecessors=tuple(predecessors),
        readers=tuple(tuple(r) for r in readers),
        shm=schedule.shm,
        banks=schedule.banks,
        shared_out=schedule.shared_out,
        rout_stride=schedule.rout_stride,
        outputs_apart=schedule.outputs_apart,
    )


def split_schedule(schedule, segment):
    """``schedule`` with every operation cut into pieces of at most ``segment`` elements,
    in order: a message becomes several messages (its receiver cuts the matching
    receive the same way, since both slices have the same length), and a reduction or
    copy one per piece. :func:`compile_plan` then lets piece k of a reduction start
    as soon as piece k of the message it reads has arrived: the device executor's
    pipeline (copy of segment k+1, message of segment k and reduction of segment k-1
    at once). Any algorithm, unchanged."""
    segment = max(1, int(segment))
    out = Schedule([], schedule.tmp, schedule.shm, schedule.banks, schedule.shared_out, schedule.rout_stride,
                   schedule.outputs_apart)
    for op in schedule.ops:
        if isinstance(op, Fence):
            out.ops.append(op)
            continue
        first = op.dst if isinstance(op, (Reduce, Copy, ReduceMany)) else op[1]
        length = first.hi - first.lo
        if length <= segment:
            out.ops.append(op)
            continue
        for lo in range(0, length, segment):
            hi = min(lo + segment, length)
            out.ops.append(type(op)(*(_piece(field, lo, hi) for field in op)))
    return out


def _piece(field, lo, hi):
    """Elements ``[lo, hi)`` of a slice (relative to its start), or of each slice of a
    tuple of them; a peer stays as it is."""
    if isinstance(field, Slice):
        return Slice(field.buf, field.lo + lo, field.lo + hi)
    if isinstance(field, tuple):
        return tuple(_piece(f, lo, hi) for f in field)
    return field


def fuse_reductions(schedule, limit=16, inplace=False):
    """``schedule`` with each run of consecutive reductions that carry one fold on —
    ``d = a op b; d = d op c; d = d op e`` — made one ``ReduceMany(d, (a, b, c, e))`` of
    at most ``limit`` inputs: the same values, in the same order (a left fold), in one
    pass over memory instead of one per input. The device uses it (the direct
    algorithm's p-1 reductions become one kernel); the host's NumPy has no multi-input
    ufunc, so it keeps the chain.

    A step may also move the fold to a new destination (``t = a op b; d = t op c``)
    where ``t`` is workspace (``tmp``) no later operation touches, and a copy of the
    fold's result right after it (``t = a op b op c; d = t``: an in-place reduce's root,
    which folds into ``tmp`` for the host's chain of steps) becomes the fold into ``d``
    on the same terms: one kernel, not a kernel and a copy. (Not where ``t`` is the
    output, or a window slot: those are read after the plan, or by other ranks.) A run
    is fused only where each input either is the destination's very elements or shares
    no memory with it (``inplace``: ``in`` and ``out`` are one buffer), as the one-pass
    kernel reads every input of an element before it writes that element."""

    def memory(x):
        return "out" if inplace and x.buf == "in" else x.buf

    def overlap(x, y):
        return memory(x) == memory(y) and x.lo < y.hi and y.lo < x.hi

    def safe_input(x, dst):
        return not overlap(x, dst) or (memory(x) == memory(dst) and (x.lo, x.hi) == (dst.lo, dst.hi))

    def untouched_after(index, x):
        return not any(overlap(x, y) for later in schedule.ops[index + 1:] for y in sum(_reads_writes(later), ()))

    def scratch(x):  # the result and a window slot are read after the plan, or by the others
        return x.buf == "tmp"

    def unread_after(index, x):  # (a fence orders memory but reads none of it)
        return not any(overlap(x, y) for later in schedule.ops[index + 1:] if not isinstance(later, Fence)
                       for y in sum(_reads_writes(later), ()))

    out = Schedule([], schedule.tmp, schedule.shm, schedule.banks, schedule.shared_out, schedule.rout_stride,
                   schedule.outputs_apart)
    for index, op in enumerate(schedule.ops):
        last = out.ops[-1] if out.ops else None
        if isinstance(op, Reduce) and isinstance(last, (Reduce, ReduceMany)) and op.a == last.dst:
            inputs = last.srcs if isinstance(last, ReduceMany) else (last.a, last.b)
            inputs += (op.b,)
            if (len(inputs) <= limit and not overlap(op.b, last.dst)
                    and all(safe_input(x, op.dst) for x in inputs)
                    and (op.dst == last.dst or (scratch(last.dst) and untouched_after(index, last.dst)))):
                out.ops[-1] = ReduceMany(op.dst, inputs)
                continue
        if isinstance(op, Copy) and isinstance(last, (Reduce, ReduceMany)) and op.src == last.dst:
            inputs = last.srcs if isinstance(last, ReduceMany) else (last.a, last.b)
            if all(safe_input(x, op.dst) for x in inputs) and scratch(last.dst) and unread_after(index, last.dst):
                out.ops[-1] = ReduceMany(op.dst, inputs)
                continue
        out.ops.append(op)
    return out



def embed(parent, child, ranks, buffers):
    """Append ``child`` — a schedule built for a group of ``len(ranks)`` ranks, as if
    they were the whole world — to ``parent``, run by the real ranks ``ranks`` (group
    rank i is real rank ``ranks[i]``) on parts of ``parent``'s buffers: ``buffers`` maps
    each of the child's buffer names it uses to ``(parent buffer, offset)``. The
    two-level algorithms are made of the flat ones this way, written once.

    A child's ``in`` and ``out`` may map onto the same elements (the step then runs in
    place, as every algorithm can); its ``tmp`` should map onto ``tmp`` elements no
    other live data holds, and ``parent`` grows its workspace to hold it."""

    def move(field):
        if isinstance(field, Slice):
            buf, offset = buffers[field.buf]
            return Slice(buf, field.lo + offset, field.hi + offset)
        return tuple(move(f) for f in field)

    if child.shm:  # its fences would hold every rank of the node, not only the group's
        raise ValueError("a shared-memory schedule cannot be embedded in another (its fences span the whole node)")
    for op in child.ops:
        if isinstance(op, (Send, Recv)):
            parent.ops.append(type(op)(ranks[op.peer], move(op[1])))
        else:
            parent.ops.append(type(op)(*(move(field) for field in op)))
    if child.tmp:
        buf, offset = buffers["tmp"]
        if buf != "tmp":
            raise ValueError(f"a child's workspace must map onto tmp; got {buf!r}")
        parent.need_tmp(offset + child.tmp)
