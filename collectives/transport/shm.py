"""The shared-memory executor: runs the plans of the ``shm`` algorithms on a window that
every rank of the node maps (``MPI.Win.Allocate_shared`` on the node communicator).

The window (:class:`NodeWindow`), made at a communicator's first shared-memory call and
grown when a call needs more, holds one flag line per rank and then the data: two banks
of p slots (see :mod:`collectives.algorithms.shm`). A plan's ``shm`` slices address the
data; its copies and reductions run on NumPy views of it, and its fences are counters:

    fence k of rank r:   Win.Sync(); counter[r] = k         (arrive: r's writes are out)
                         wait until every counter >= k; Win.Sync()   (then read theirs)

``Win.Sync`` is MPI-3's memory barrier for shared windows (the window is in a
``Lock_all`` epoch), so the data a rank wrote before arriving is what the others read
after passing, on weakly ordered CPUs too. The counters only grow, and every rank of
the node passes every fence, so fence k is the same point of the same call everywhere.

Calls run in the order they were made (a queue on the communicator's :class:`Progress`
engine), each from where its predecessor left the window: the executor alternates the
banks from call to call so that a call's first writes never land in the bank the
previous call read last. Waiting for a fence is the engine's wait: it yields the CPU
between polls (ranks may outnumber cores), answers liveness probes, reads other ranks'
failure notices, warns of stalls, and times out naming the ranks that have not arrived
(a rank that died stops its counter). Before its first fence each call writes a
signature (call number, collective, size, root, op) beside its counter, and every rank
compares all of them once the fence is passed: ranks that called different things all
raise instead of mixing up data.
"""


import numpy as np
from mpi4py import MPI

from .. import ops as ops_layer
from ..cache import BoundedCache
from ..errors import CollectiveMismatchError, MessageSizeError
from ..schedule import Copy, Fence, Reduce
from .lean import Patience  # the lean path's waiting, the same here
from .liveness import ranks
from .progress import QueuedHandle

_LINE = 16  # int64 per rank in the flag area: 128 bytes, so no two ranks share a cache line
_COUNTER, _SIGNATURE = 0, 2  # the fence counter; two signatures (calls alternate) of 4 words
_MIN_DATA = 64 << 10  # bytes: the smallest data area made
_COPY, _REDUCE, _FENCE = 0, 1, 2


class NodeWindow:
    """One communicator's shared window on this node (collective to make and to grow)."""

    def __init__(self, node_comm):
        self.comm = node_comm
        self.rank = node_comm.Get_rank()
        self.size = node_comm.Get_size()
        self.win = None
        self.capacity = 0  # bytes of data area
        self.fences = 0  # fences handed out to calls so far (the next call's first is fences + 1)
        self.flip = 0  # which half of the data area the next call's bank 0 is
        self.calls = 0  # shared-memory calls so far (their signatures alternate)

    def ensure(self, nbytes):
        """Make the data area hold ``nbytes`` (collective over the node: every rank calls
        it at the same point, with the same size, and no call on the window in flight).
        The window is made even for 0 bytes: its flag area holds the fences."""
        if self.win is not None and nbytes <= self.capacity:
            return
        capacity = max(_MIN_DATA, self.capacity * 2)
        while capacity < nbytes:
            capacity *= 2
        self.free()
        flags = -(-self.size * _LINE * 8 // 4096) * 4096
        self.win = MPI.Win.Allocate_shared(flags + capacity if self.rank == 0 else 0, 1, comm=self.comm)
        buffer, _ = self.win.Shared_query(0)
        memory = np.frombuffer(buffer, np.uint8)
        self.words = memoryview(memory[:flags]).cast("q")  # the flag area, read and written word by word
        self.data = memory[flags : flags + capacity]
        self._typed, self._steps = {}, BoundedCache(256)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        if self.rank == 0:
            memory[:flags] = 0
        self.win.Sync()
        self.comm.Barrier()  # nobody reads a flag before it is zero
        self.win.Sync()
        self.capacity, self.fences, self.flip, self.calls = capacity, 0, 0, 0

    def free(self):
        """Release the window (collective over the node)."""
        if self.win is not None:
            self.words.release()
            self.win.Unlock_all()
            self.win.Free()
            self.win, self.capacity, self.data, self._typed, self._steps = None, 0, None, {}, BoundedCache(256)

    def typed(self, dtype):
        """The data area as ``dtype`` elements (an even number of them: two halves)."""
        view = self._typed.get(dtype)
        if view is None:
            usable = self.capacity - self.capacity % (2 * dtype.itemsize)
            view = self._typed[dtype] = self.data[:usable].view(dtype)
        return view

    def steps(self, plan, dtype, flip):
        """``plan``'s steps with its ``shm`` slices made views of this window (for calls
        that start on half ``flip``); the other slices stay ``(buffer, lo, hi, bank)``.
        Kept per plan until the window is remade."""
        key = (id(plan), dtype, flip)
        cached = self._steps.get(key)
        if cached is None:
            shared = self.typed(dtype)
            half = shared.size // 2

            def view(spec):
                buf, lo, hi, bank = spec
                if buf != "shm":
                    return spec
                start = ((bank + flip) & 1) * half
                return shared[start + lo : start + hi]

            steps = [(kind, tuple(view(x) for x in slices)) for kind, slices in _steps(plan)]
            # The plan is kept with its steps: id(plan) names no other plan while they are cached.
            cached = self._steps.put(key, (plan, steps))
        return cached[1]

    def arrive(self, fence):
        self.win.Sync()  # this rank's writes before the counter
        self.words[self.rank * _LINE] = fence

    def passed(self, fence):
        words = self.words
        for q in range(0, self.size * _LINE, _LINE):
            if words[q] < fence:
                return False
        self.win.Sync()  # the others' writes after their counters
        return True

    def behind(self, fence):
        """The node ranks that have not reached ``fence``."""
        return [q for q in range(self.size) if self.words[q * _LINE] < fence]

    def sign(self, parity, signature):
        start = self.rank * _LINE + _SIGNATURE + 4 * parity
        for k, word in enumerate(signature):
            self.words[start + k] = word

    def signature_of(self, rank, parity):
        start = rank * _LINE + _SIGNATURE + 4 * parity
        return tuple(self.words[start : start + 4])


class Registration:
    """Memory every rank of the node maps, for the arrays ``Communicator.empty`` makes
    (registered buffers): one window per ``empty`` call, made collectively, holding one
    region per node rank, ``stride`` bytes apart (page-aligned). Rank q's array is the
    first ``nbytes`` of region q; every rank can read all of them (``memory``), which is
    what lets the ``shm`` algorithms read another rank's input in place instead of
    copying it into the window first. Valid until :meth:`free` (the communicator's
    ``free()``): the arrays made on it must not be used after that."""

    def __init__(self, node_comm, nbytes, number):
        size, rank = node_comm.Get_size(), node_comm.Get_rank()
        self.number = number  # the communicator's count of empty() calls: alike on every rank
        self.nbytes = nbytes
        self.stride = max(1, -(-nbytes // 4096)) * 4096
        # Rank 0 allocates every region (as NodeWindow does), so that region q starts q
        # strides in on every rank, whatever the MPI library does with per-rank segments.
        self.win = MPI.Win.Allocate_shared(size * self.stride if rank == 0 else 0, 1, comm=node_comm)
        buffer, _ = self.win.Shared_query(0)
        self.memory = np.frombuffer(buffer, np.uint8)[: size * self.stride]
        self.mine = self.memory[rank * self.stride : rank * self.stride + nbytes]
        self.start = self.mine.__array_interface__["data"][0]
        self._typed = {}
        self.win.Lock_all(MPI.MODE_NOCHECK)  # Win.Sync (the fences' memory barrier) needs an epoch

    def typed(self, dtype):
        """Every rank's region as ``dtype`` elements (rank q's from ``q * stride /
        itemsize``)."""
        view = self._typed.get(dtype)
        if view is None:
            view = self._typed[dtype] = self.memory.view(dtype)
        return view

    def offset_of(self, array):
        """The byte offset of ``array`` (flat, contiguous) in this rank's region, or None
        if it does not lie wholly inside it."""
        offset = array.__array_interface__["data"][0] - self.start
        return offset if 0 <= offset and offset + array.nbytes <= self.nbytes else None

    def free(self):
        """Release the window (collective over the node)."""
        if self.win is not None:
            self.win.Unlock_all()
            self.win.Free()
            self.win, self.memory, self.mine, self._typed = None, None, None, {}


def _steps(plan):
    """The plan as ``(kind, slices)`` steps, each slice ``(buffer, lo, hi, bank)`` (a
    ``shm`` slice: its bank, 0 or 1, and lo/hi within it); made once per plan."""
    steps = plan.__dict__.get("_shm_steps")
    if steps is None:
        half = plan.shm // 2

        def spec(s):
            if s.buf != "shm":
                return (s.buf, s.lo, s.hi, 0)
            bank = 1 if s.lo >= half else 0
            return ("shm", s.lo - bank * half, s.hi - bank * half, bank)

        steps = []
        for op in plan.ops:
            if isinstance(op, Fence):
                steps.append((_FENCE, ()))
            elif isinstance(op, Copy):
                steps.append((_COPY, (spec(op.dst), spec(op.src))))
            elif isinstance(op, Reduce):
                steps.append((_REDUCE, (spec(op.dst), spec(op.a), spec(op.b))))
            else:
                raise ValueError(f"the shared-memory executor cannot run {op!r}")
        object.__setattr__(plan, "_shm_steps", steps)  # the plan is frozen; a cache beside it
    return steps


class ShmCall:
    """One call's plan on the window: its views resolved, its fences and banks taken in
    call order (so make calls in the order every rank makes them).

    ``signature``: four integers every rank must give alike (call number, a code of
    collective, algorithm, dtype and op, the size in bytes, the root), compared at the
    call's first fence; a size that differs is a :class:`MessageSizeError`, anything
    else a :class:`CollectiveMismatchError`. ``registration``: the
    :class:`Registration` the plan's ``reg`` slices address (registered buffers)."""

    def __init__(self, window, plan, inp, out, tmp, op, signature, describe, registration=None):
        self.describe = describe
        self.total = len(plan.ops)
        self.fences = plan.__dict__.get("_shm_fences")
        if self.fences is None:
            self.fences = sum(1 for kind, _ in _steps(plan) if kind == _FENCE)
            object.__setattr__(plan, "_shm_fences", self.fences)
        arrays = {"in": inp, "out": out, "tmp": tmp}
        # Win.Sync is the memory barrier of one window: the fences pass it on the
        # registration's window too, whose memory the plan reads across ranks.
        self.sync = registration.win.Sync if registration is not None else None
        if registration is not None:
            arrays["reg"] = registration.typed(inp.dtype)
        if plan.shm or self.fences:
            shared = window.typed(inp.dtype)
            if plan.shm > shared.size:
                raise ValueError(f"{describe}: the window holds {shared.size} elements, the plan needs {plan.shm} "
                                 "(a bug in the library: please report it)")
            flip = window.flip
            # fences are numbered over the window's life: this call's are base + 1 … base + fences
            self.base = window.fences
            window.fences += self.fences
            window.flip ^= plan.banks & 1
            self.parity = window.calls & 1
            window.calls += 1
        else:  # nothing shared (an empty call, one rank): local copies at most, no fence
            flip, self.base, self.parity = 0, 0, 0

        template = window.steps(plan, inp.dtype, flip) if plan.shm else _steps(plan)
        self.steps = [(kind, tuple(x if type(x) is np.ndarray else arrays[x[0]][x[1] : x[2]] for x in views))
                      for kind, views in template]
        self.window, self.op, self.signature = window, op, tuple(int(v) for v in signature)
        self.next = 0  # the next step to run
        self.passed = self.base  # the last fence passed
        self.arrived = False  # at fence self.passed + 1

    @property
    def done(self):
        return self.next == len(self.steps)

    def step(self):
        """Run steps until the plan ends or a fence holds it; True if any ran."""
        steps, op_name, window = self.steps, self.op, self.window
        moved = False
        while self.next < len(steps):
            kind, views = steps[self.next]
            if kind == _COPY:
                np.copyto(views[0], views[1])
            elif kind == _REDUCE:
                ops_layer.combine(op_name, views[1], views[2], views[0])
            else:
                fence = self.passed + 1
                if not self.arrived:
                    if fence == self.base + 1:
                        window.sign(self.parity, self.signature)
                    if self.sync is not None:
                        self.sync()
                    window.arrive(fence)
                    self.arrived = True
                if not window.passed(fence):
                    return moved
                if self.sync is not None:
                    self.sync()
                self.arrived, self.passed = False, fence
                if fence == self.base + 1:
                    self._compare_signatures()
            self.next += 1
            moved = True
        return True

    def run(self, look):
        """Run to the end, here and now (a blocking call with nothing else in flight),
        waiting as the lean path's calls wait (:class:`~.lean.Patience`: a spin, then
        yielding the CPU between polls, since ranks may outnumber cores); ``look()``
        every ``LOOK_EVERY`` seconds of waiting."""
        patience = Patience(look)
        while not self.done:
            if self.step():
                patience.progressed()
            else:
                patience.idle()

    def _compare_signatures(self):
        mine = self.signature
        for rank in range(self.window.size):
            theirs = self.window.signature_of(rank, self.parity)
            if theirs == mine:
                continue
            if theirs[0] == mine[0] and theirs[1] == mine[1] and theirs[3] == mine[3]:
                raise MessageSizeError(f"{self.describe}: rank {rank} called it with {theirs[2]} B where this "
                                       f"rank has {mine[2]} B; the ranks called it with buffers of different sizes")
            raise CollectiveMismatchError(f"{self.describe}: rank {rank} is in a different call (call #{theirs[0]}, "
                                          "or another collective, algorithm, dtype, op or root, or registered "
                                          "buffers on some ranks only); every rank must "
                                          "call the same collectives in the same order")

    def outstanding(self):
        """What the call waits for, for timeout and stall messages."""
        fence = self.passed + 1
        behind = self.window.behind(fence) if self.arrived else []
        waiting = (f"waiting at fence {fence - self.base} of {self.fences} in shared memory for {ranks(behind)} "
                   "to arrive") if behind else "running"
        return f"at step {self.next + 1} of {self.total}: {waiting}"


class ShmHandle(QueuedHandle):
    """A shared-memory call in flight: the :class:`Progress` engine runs it (its
    ``shm`` queue, oldest call first) whenever it polls."""
