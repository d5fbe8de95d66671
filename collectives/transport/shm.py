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

from ..errors import CollectiveMismatchError, MessageSizeError
from ..schedule import Fence
from .buffers import Buffers
from .liveness import ranks
from .mpi import Handle

_LINE = 16  # int64 per rank in the flag area: two cache lines, so no two ranks share one
_COUNTER, _SIGNATURE = 0, 2  # the fence counter; two signatures (calls alternate) of 4 words
_MIN_DATA = 64 << 10  # bytes: the smallest data area made


class NodeWindow:
    """One communicator's shared window on this node (collective to make and to grow)."""

    def __init__(self, node_comm):
        self.comm = node_comm
        self.rank = node_comm.Get_rank()
        self.size = node_comm.Get_size()
        self.win = None
        self.capacity = 0  # bytes of data area
        self.fences = 0  # fences handed out to calls so far (the next call's first is fences + 1)
        self.flip = 0  # the bank the next call's bank 0 is
        self.calls = 0  # shared-memory calls so far (their signatures alternate)

    def ensure(self, nbytes):
        """Make the data area hold ``nbytes`` (collective over the node: every rank calls
        it at the same point, with the same size, and no call on the window in flight)."""
        if nbytes <= self.capacity:
            return
        capacity = max(_MIN_DATA, self.capacity * 2)
        while capacity < nbytes:
            capacity *= 2
        self.free()
        flags = -(-self.size * _LINE * 8 // 4096) * 4096
        self.win = MPI.Win.Allocate_shared(flags + capacity if self.rank == 0 else 0, 1, comm=self.comm)
        buffer, _ = self.win.Shared_query(0)
        memory = np.frombuffer(buffer, np.uint8)
        self.flags = memory[:flags].view(np.int64)
        self.counters = self.flags[_COUNTER : self.size * _LINE : _LINE]
        self.data = memory[flags : flags + capacity]
        self.win.Lock_all(MPI.MODE_NOCHECK)
        if self.rank == 0:
            self.flags[:] = 0
        self.win.Sync()
        self.comm.Barrier()  # nobody reads a flag before it is zero
        self.win.Sync()
        self.capacity, self.fences, self.flip = capacity, 0, 0

    def free(self):
        """Release the window (collective over the node)."""
        if self.win is not None:
            self.win.Unlock_all()
            self.win.Free()
            self.win, self.capacity = None, 0

    def arrive(self, fence):
        self.win.Sync()  # this rank's writes before the counter
        self.counters[self.rank] = fence

    def passed(self, fence):
        if self.counters.min() < fence:
            return False
        self.win.Sync()  # the others' writes after their counters
        return True

    def behind(self, fence):
        """The node ranks that have not reached ``fence``."""
        return [q for q in range(self.size) if self.counters[q] < fence]

    def sign(self, parity, signature):
        start = self.rank * _LINE + _SIGNATURE + 4 * parity
        self.flags[start : start + 4] = signature

    def signatures(self, parity):
        lines = self.flags[: self.size * _LINE].reshape(self.size, _LINE)
        return lines[:, _SIGNATURE + 4 * parity : _SIGNATURE + 4 * parity + 4].copy()


class _WindowBuffers(Buffers):
    """``Buffers`` whose ``shm`` is the window: the plan's two banks (``half`` elements
    each, a slice lying in one) are the window's halves, swapped where the call starts
    on the window's second half (``flip``). Every call's bank k is then the same memory
    whatever its size, which is what alternating them from call to call relies on."""

    def __init__(self, inp, out, tmp, shm, half, flip):
        super().__init__(inp, out, tmp, shm)
        self._half, self._flip, self._window_half = half, flip, shm.size // 2

    def view(self, s):
        if s.buf != "shm":
            return self.arrays[s.buf][s.lo : s.hi]
        bank, offset = (1, s.lo - self._half) if s.lo >= self._half else (0, s.lo)
        lo = ((bank + self._flip) & 1) * self._window_half + offset
        return self.arrays["shm"][lo : lo + s.hi - s.lo]


class ShmHandle(Handle):
    """A shared-memory call: runs its plan in order, waiting at each fence.

    ``signature``: four integers every rank must give alike (call number, a code of
    collective, algorithm, dtype and op, the size in bytes, the root), compared at the
    call's first fence; a size that differs is a :class:`MessageSizeError`, anything
    else a :class:`CollectiveMismatchError`."""

    def __init__(self, progress, describe, finish, window, plan, inp, out, tmp, op, signature, timeout=None, call=0):
        super().__init__(progress, describe, finish, timeout, call)
        self._window, self._plan, self._op = window, plan, op
        self._ops = plan.ops
        self._next = 0  # the next operation to run
        self._fences = sum(isinstance(op_, Fence) for op_ in plan.ops)
        if not plan.shm:  # nothing shared (an empty call, one rank): local copies at most
            self._buffers, self._base = Buffers(inp, out, tmp), 0
            return
        nbytes = plan.shm * inp.itemsize
        if nbytes > window.capacity:
            raise ValueError(f"{describe}: the window holds {window.capacity} B, the plan needs {nbytes} B "
                             "(a bug in the library: please report it)")
        shared = window.data[: window.capacity - window.capacity % (2 * inp.itemsize)].view(inp.dtype)
        self._buffers = _WindowBuffers(inp, out, tmp, shared, plan.shm // 2, window.flip)
        # fences are numbered over the window's life: this call's are _base + 1 … _base + _fences
        self._base = self._fence = window.fences  # _fence: the last one this call passed
        window.fences += self._fences
        window.flip ^= plan.banks & 1
        self._parity = window.calls & 1
        window.calls += 1
        self._signature = np.asarray(signature, np.int64)
        self._arrived = False  # at the fence self._fence + 1

    def start(self):
        self._progress.shm.append(self)
        self._begin()
        return self

    def step(self):
        """Run operations until the plan ends or a fence holds it; True if any ran or
        a fence was passed."""
        ops, window, buffers, op_name = self._ops, self._window, self._buffers, self._op
        moved = False
        while self._next < len(ops):
            op = ops[self._next]
            if isinstance(op, Fence):
                fence = self._fence + 1
                if not self._arrived:
                    if fence == self._base + 1:
                        window.sign(self._parity, self._signature)
                    window.arrive(fence)
                    self._arrived = True
                if not window.passed(fence):
                    return moved
                self._arrived, self._fence = False, fence
                if fence == self._base + 1:
                    self._compare_signatures()
            else:
                buffers.run_local(op_name, op)
            self._next += 1
            moved = True
        self._check_done()
        return True

    def _compare_signatures(self):
        theirs = self._window.signatures(self._parity)
        mine = self._signature
        for rank, signature in enumerate(theirs):
            if np.array_equal(signature, mine):
                continue
            if signature[0] == mine[0] and signature[1] == mine[1] and signature[3] == mine[3]:
                raise MessageSizeError(f"{self._describe}: rank {rank} called it with {signature[2]} B where "
                                       f"this rank has {mine[2]} B; the ranks called it with buffers of different "
                                       "sizes")
            raise CollectiveMismatchError(f"{self._describe}: rank {rank} is in a different call (call "
                                          f"#{signature[0]}, or another collective, algorithm, dtype, op or root); "
                                          "every rank must call the same collectives in the same order")

    def _is_done(self):
        return self._next == len(self._ops)

    def _outstanding(self):
        fence = self._fence + 1
        behind = self._window.behind(fence) if self._arrived else []
        waiting = (f"waiting at fence {fence - self._base} of {self._fences} in shared memory for "
                   f"{ranks(behind)} to arrive") if behind else "running"
        return f"at step {self._next + 1} of {len(self._ops)}: {waiting}"
