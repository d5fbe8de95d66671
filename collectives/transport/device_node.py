"""The device executor of the peer-read plans (``one_shot``, ``two_shot``, ``leader``:
:mod:`collectives.algorithms.peer`): the ranks of one node read each other's device
buffers where they are, through CUDA IPC, and meet at the plans' fences: two per
call, at any size, and no message: those two fences are the call's only
synchronisations between the ranks, whatever the fence mechanism.

    rank r, one call (one stream: the peer calls' own, which holds nothing else)
    ──────────────────────────────────────────────────────────────────
    the stream waits for the user's stream (an event recorded at the call), and for
    the other routes' calls that ended before the call was made (their workspace)
    phase 0: what needs no other rank (allgather's own row: one copy)
    fence 1: arrive, publishing where this rank's input and window slot are
             (allocation, buffer id, offset: the node's shared window, host memory);
             pass once every rank has arrived; open what this process has not opened
    phase 1: read the other ranks' buffers: a fold is one kernel over the p inputs,
             allgather's copies one copy kernel (at most 16 inputs or copies a
             kernel); broadcast one copy; the allreduce leader's fold, written
             into every rank's output (published at fence 1 too), one kernel on
             rank 0 alone (avg: divided as it is written; no rank divides after
             it); the other leaders' work likewise on rank 0 (broadcast: the root)
             alone: reduce_scatter's p folds one kernel (reduce_blocks); allgather's
             p² copies and broadcast's p - 1 read each input once into every
             output it goes to (copy_n's fan: 16 // m inputs of m outputs each a
             kernel; allgather one kernel up to 4 ranks)
    fence 2: nobody reads this rank's input any more
    phase 2: two_shot's copies out of the window slots: one copy kernel
    the call finishes once its last kernel has run (an event the host polls; with
    host fences an event is recorded only where work was queued since the last one,
    so the leader's other ranks record one a call, at the first fence)

A fence is one of three mechanisms, chosen per communicator (``device_fence``):
``host`` (the hosts meet at every fence), ``stream`` (stream memory operations) or
``kernel`` (fence kernels, ranks on distinct GPUs); :mod:`.peer_fences` has a class
for each and says how each meets.

Whatever the mechanism, a call finishes once its last event has completed: so its
result is ready for anything the user queues afterwards (the user's stream needs no
wait), its workspace goes back to the pool only then (the other routes' calls need not
wait for it on the device), and a timeout covers its device work too and names the
ranks that have not reached the fence it waits at (the host reads the counters, this
rank's row of words, or its flags). Calls run in the order they were made (the
progress engine's queue of shared-memory calls): a call enqueues nothing until the one
before it has enqueued everything. At the first fence each rank also signs the call
(number, collective, algorithm, dtype, op, size, root), and once past it every rank
compares the signatures and checks every rank's descriptors (its own too): ranks that
called different things, or a buffer that cannot be shared, make every rank raise
alike instead of reading each other's memory or waiting for ranks that raised (ranks
that took registered arrays without asking raise the digests' mismatch instead).

Registration: a rank's input is exported once per allocation (its base address and the
driver's buffer id: CuPy's and torch's pools sub-allocate, so a buffer is base plus
offset), and a peer opens an allocation once per owner process, base and buffer id
(:class:`~.peer_memory.PeerMemory`, one per device and process): memory freed and
allocated again at the same base gets a new buffer id, so it is opened anew and the
old mapping closed, never read (:class:`~.peer_node.PeerNode` keeps what one
communicator opened and registered). A steady loop of calls on the same buffers opens
nothing, allocates nothing, makes no event and sends no MPI message
(``PeerNode.counters`` and the device's say so).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CollectiveMismatchError
from .peer_fences import DEFAULT_KERNEL_LIMIT
from .peer_memory import Sliced
from .peer_phases import _COPY, _COPY_KERNELS, _FOLD_BLOCKS, _FOLD_TO_ALL, _REDUCE_MANY, _fold_parts, phases_and_facts
from .peer_window import _NOTHING, compare_signatures, refuse_unshareable
from .progress import QueuedHandle


@dataclass(slots=True)
class PeerWork:
    """What one peer-read call is asked to do (a :class:`PeerCall` runs it)."""

    plan: Any  # the compiled plan (schedule.Plan)
    arrays: dict  # the flat device buffers "in", "out", "tmp"
    stride: int  # elements of each rank's part of the plan's peer buffers
    op: str
    dtype: np.dtype  # the logical dtype the folds compute in
    # four integers every rank must give alike: the call's number, a code of the
    # collective, algorithm, dtype and op, the size in bytes, the root
    signature: tuple
    describe: str  # the call, for messages
    started: Any  # an event recorded on the user's stream at the call
    before: Callable | None = None  # before(stream): work beside the plan before it (packing a strided input)
    after: Callable | None = None  # after(stream): work after it (the average's division, unpacking)
    limit: float | None = None  # seconds an in-kernel wait lasts at most (None: DEFAULT_KERNEL_LIMIT)
    # avg on a plan whose outputs are shared (a leader's): the folds that write them
    # divide by it as they write, so the other ranks launch no division
    divisor: int | None = None


class PeerCall:
    """One call's plan (:class:`PeerWork`) on the device, run step by step by
    :class:`PeerHandle` in the order the calls were made (see the module's docstring)."""

    def __init__(self, node, work):
        self.node, self.backend, self.window = node, node.backend, node.window
        plan, stride, limit, divisor = work.plan, work.stride, work.limit, work.divisor
        self.arrays, self.op, self.dtype, self.describe = work.arrays, work.op, work.dtype, work.describe
        self.signature = tuple(int(v) for v in work.signature)
        self.started, self.before, self.after = work.started, work.before, work.after
        # The other routes' calls that ended before this call was made (their workspace,
        # which this call may have taken, is free once it has run): their last event now,
        # not at the start, which may come after later calls' (they must not be waited for).
        self.previous = node.device.last_end
        self.limit = DEFAULT_KERNEL_LIMIT if limit is None else limit  # seconds an in-kernel wait lasts at most
        size = self.window.size
        self.slot = plan.shm // size if plan.shm else 0  # elements of each rank's window slot
        self.shared_out = plan.shared_out  # another rank writes this rank's output: published too
        # the phases; the ranks whose outputs this rank's plan writes (only a plan whose
        # outputs are shared can); its final folds, {(phase, entry)}, which divide for avg
        self.phases, self.writes_peers, final = phases_and_facts(plan, self.window.rank, stride, self.slot)
        self.fences = len(self.phases) - 1
        self.divisor = divisor
        self.dividing = final if divisor is not None else ()
        self.base, self.number = self._numbered()
        self.parity = self.number & 1  # which of the window's two sets of descriptors it publishes in
        self.phase = -1  # the phase enqueued last (-1: none yet)
        self.waiting = False  # host fences: recorded the event before the next fence; arrived once it completed
        self.arrived = False  # arrived at the next fence (host), or signalled the first (stream, kernel)
        self.ended = False
        self.done = False
        # host fences: device work queued on the stream since the last fence's event was
        # recorded; where none was, that event (completed) covers it: no record, no wait
        # (the leader's other ranks touch the device once a call, not three times)
        self.unrecorded = True
        self.end_covered = False  # the last fence's event covers the call's end: end_event not recorded
        self.peers = None  # rank -> (its input, its window slot, its output), each a Sliced typed device array
        self.mine = None  # this rank's input's descriptor, as published
        self.assumed = False  # kernel: the peers' inputs taken as registered counterparts (no host wait)
        self.digest = 0  # kernel: the call's digest, which the first fence kernels compare

    def _numbered(self):
        """``(base, number)``: this call's fences are the window's ``base + 1`` …
        ``base + fences``, and it is the window's call ``number`` (every rank numbers
        alike: calls run in the order they were made)."""
        window = self.window
        base = window.fences
        window.fences += self.fences
        window.calls += 1
        return base, window.calls

    # -- the steps ------------------------------------------------------------------------------
    def step(self):
        """Enqueue and pass what can be now; True if anything moved."""
        moved = False
        if self.phase < 0:
            self._start()
            moved = True
        while self.phase < self.fences:
            if not self._fence(self.phase + 1):
                return moved
            self.phase += 1
            self._enqueue(self.phase)
            moved = True
        if not self.ended:
            self._end()
            moved = True
        if self.end_covered or self.backend.query(self.node.end_event):
            self.node.fence.finished(self)
            self.done = True
            return True
        return moved

    def _start(self):
        self._wait_for_user()
        self._wait_for_other_routes()
        if self.before is not None:
            self.before(self.node.stream)
        self.node.fence.start(self)
        self.phase = 0
        self.node.counters["calls"] += 1
        self._enqueue(0)

    def _fence(self, k):
        """Fence ``k`` (1-based) of this call: True once passed, or queued on the
        devices (the node's fence mechanism says which)."""
        if not self.node.fence.fence(self, k):
            return False
        self.node.counters["fences"] += 1
        return True

    # The call's synchronisations with the user's and the other routes' work, one method
    # each, as the fences' (the tests take them out one at a time:
    # tests/device/test_device_peer.py).
    def _wait_for_user(self):
        """The stream waits for the user's work before the call (its event)."""
        self.backend.wait(self.node.stream, self.started)
        self.node.give_event(self.started)

    def _wait_for_other_routes(self):
        """The stream waits for the other routes' calls that ended before this call was
        made (it may reuse the workspace they gave back once they had queued their work)."""
        if self.previous is not None:
            self.backend.wait(self.node.stream, self.previous)

    def check_announced(self):
        """stream and kernel, waiting at the first fence: once every rank has published
        this call, raise at once where one signed another call or gave a buffer that
        cannot be shared, as :meth:`meet` would. A host publishes as it makes the call,
        but its stream signals only once its device work before the call has run, and a
        rank that passes the fence and raises first breaks the communicator: the others
        must not learn of the mismatch only from its notice, but raise the same error
        themselves."""
        window = self.window
        if len(window.announced(self.number)) < window.size:
            return
        compare_signatures(window, self.parity, self.signature, self.describe)
        self._check_shareable()

    def _check_shareable(self):
        """Every rank's buffers that the call shares (this rank's too) can be opened:
        else raise, alike on every rank (:func:`check_shareable`)."""
        window = self.window
        for which, what, shared in ((0, "input x", True), (1, "window slot", self.slot),
                                    (2, "output out", self.shared_out)):
            if shared:
                refuse_unshareable(window.unshareable(self.parity, which), what, self.describe)

    def publish(self):
        """Sign the call and say where this rank's input, window slot and (where
        another rank writes it) output are."""
        window, node = self.window, self.node
        window.sign(self.parity, self.signature)
        inp, out = self.arrays["in"], self.arrays["out"]
        self.mine = node.descriptor(inp, inp.nbytes)
        window.publish(self.parity, 0, self.mine)
        slot = node.slot_of(self.slot * self.dtype.itemsize) if self.slot else None
        window.publish(self.parity, 1, node.descriptor(slot, slot.nbytes) if slot is not None else _NOTHING)
        window.publish(self.parity, 2, node.descriptor(out, out.nbytes) if self.shared_out else _NOTHING)

    def meet(self):
        """Past the first fence: compare the signatures; check that every rank's buffers
        (this rank's too) can be shared, so that where one cannot, every rank raises
        alike, none waiting at the second fence for ranks that raised; open the peers'."""
        compare_signatures(self.window, self.parity, self.signature, self.describe)
        node, window, storage = self.node, self.window, self.arrays["in"].dtype
        self._check_shareable()
        self.peers = {q: self._peer_buffers(q, storage) for q in range(window.size) if q != window.rank}
        if self.slot:
            self.own_slot = Sliced(node.slot[: self.slot * storage.itemsize].view(storage))

    def _peer_buffers(self, q, storage):
        """``(input, window slot, output)`` of rank ``q`` that this call reads or writes
        (None where it does not), each a :class:`Sliced` typed ``storage``, opened here
        from what ``q`` published."""
        node, window, parity = self.node, self.window, self.parity
        inp = node.peer_buffer(q, window.descriptor_of(q, parity, 0), "input", storage)
        slot = node.peer_buffer(q, window.descriptor_of(q, parity, 1), "window slot", storage) if self.slot else None
        writes = q in self.writes_peers
        out = node.peer_buffer(q, window.descriptor_of(q, parity, 2), "output", storage) if writes else None
        if (inp is None and self.arrays["in"].size) or (slot is None and self.slot) or (out is None and writes):
            raise CollectiveMismatchError(f"{self.describe}: rank {q} published no buffer for this call where "
                                          "this rank needs one (a different call there, or a broken exchange)")
        return inp, slot, out

    def _view(self, spec):
        buf, q, lo, hi = spec
        if buf == "reg":
            return self.peers[q][0].part(lo, hi)
        if buf == "shm":
            return (self.own_slot if q == self.window.rank else self.peers[q][1]).part(lo, hi)
        if buf == "rout":
            return self.peers[q][2].part(lo, hi)
        array = self.arrays[buf]
        return array if lo == 0 and hi == array.size else array[lo:hi]

    def _enqueue(self, k):
        """Queue phase ``k``'s kernels and copies on the node's stream."""
        if self.phases[k]:
            self.unrecorded = True
        for i, (kind, specs) in enumerate(self.phases[k]):
            self._launch(kind, specs, self.divisor if (k, i) in self.dividing else None)

    def _launch(self, kind, specs, divisor):
        """Queue one entry of a phase (:func:`~.peer_phases.phases`); ``divisor``: a final
        fold of avg's, divided as it writes."""
        backend, stream, view = self.backend, self.node.stream, self._view
        if divisor is not None and kind != _FOLD_BLOCKS:  # avg's result: divided as the fold writes it
            outputs, inputs = _fold_parts((kind, specs))
            backend.reduce_n(stream, self.op, self.dtype, [view(d) for d in outputs], [view(s) for s in inputs],
                             divisor=divisor)
        elif kind == _COPY:
            backend.copy(view(specs[0]), view(specs[1]), stream)
        elif kind == _COPY_KERNELS:
            for dsts, srcs in specs:
                backend.copy_n(stream, [view(d) for d in dsts], [view(s) for s in srcs])
        elif kind == _REDUCE_MANY:
            backend.reduce_n(stream, self.op, self.dtype, view(specs[0]), [view(s) for s in specs[1:]])
        elif kind == _FOLD_TO_ALL:
            backend.reduce_n(stream, self.op, self.dtype, [view(d) for d in specs[0]], [view(s) for s in specs[1]])
        elif kind == _FOLD_BLOCKS:
            backend.reduce_blocks(stream, self.op, self.dtype, [view(d) for d in specs[0]],
                                  [view(s) for s in specs[1]], specs[2], divisor=divisor)
        else:
            backend.reduce2(stream, self.op, self.dtype, view(specs[0]), view(specs[1]), view(specs[2]))

    def _end(self):
        node, stream = self.node, self.node.stream
        if self.after is not None:
            self.after(stream)
            self.unrecorded = True
        if node.fence.covers_end(self):
            self.end_covered = True  # the last fence's event ran after all of this call's work
        else:
            self.backend.record(node.end_event, stream)
        # (not device.last_end: the other routes' calls need not wait for this one, whose
        # workspace goes back once its work has run; waiting would tie their streams, which
        # earlier calls of theirs still use, to this call's waits for the other ranks)
        self.ended = True

    # -- what it waits for ----------------------------------------------------------------------
    def outstanding(self):
        if self.phase < 0:
            return "not started (a call before it on this communicator is running)"
        if self.ended or self.phase + 1 > self.fences:
            return f"its device work runs{self.node.fence.late_on_device(self)}"
        return self.node.fence.waiting(self, self.phase + 1)


class PeerHandle(QueuedHandle):
    """A peer-read call in flight: the progress engine runs it in its queue of
    shared-memory calls (oldest first) whenever it polls."""

    def _on_break(self):
        self._running.node.release()
