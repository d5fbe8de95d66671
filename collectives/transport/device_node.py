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
old mapping closed, never read. A steady loop of calls on the same buffers opens nothing, allocates
nothing, makes no event and sends no MPI message (``PeerNode.counters`` and the
device's say so).
"""

import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from ..errors import CollectiveError, CollectiveMismatchError
from .peer_fences import DEFAULT_KERNEL_LIMIT, fence_mechanism
from .peer_memory import Sliced, peer_memory
from .peer_phases import _COPY, _COPY_KERNELS, _FOLD_BLOCKS, _FOLD_TO_ALL, _REDUCE_MANY, _fold_parts, phases_and_facts
from .peer_window import (
    _DESCRIPTOR,
    _HANDLE_WORDS,
    _NOTHING,
    _UNSHAREABLE,
    _UNSHAREABLE_WORDS,
    PeerWindow,
    _placement,
    compare_signatures,
    placement_crc,
    refuse_unshareable,
    unshareable_message,
)
from .progress import QueuedHandle


class PeerNode:
    """What one communicator keeps for its peer-read calls on one device: the window,
    the fence mechanism, this rank's window slot (``shm``: device memory, grown as
    calls need, old ones kept while a peer may still hold them), pooled events, and
    counters. Made (collectively) at the first such call."""

    def __init__(self, device, node_comm, device_fence, exchange):
        """``device_fence``: the option's value (``auto``, ``host``, ``stream``,
        ``kernel``); ``exchange(words)``: every node rank's int64 ``words`` (a timed
        allgather over the node), for what the ranks settle at the start."""
        self.device, self.backend = device, device.backend
        self._described = {}  # where this rank's buffers lie -> their descriptor words (descriptor)
        uuids = device.node_gpus  # (as the device negotiation exchanged them)
        self.gpus = len(uuids)  # the node's GPUs (its ranks' devices)
        # every rank of the node on one GPU: auto's leader runs there (else one_shot: routes.peer)
        self.one_gpu = self.gpus == 1
        fences = fence_mechanism(device_fence, uuids, node_comm.Get_size())
        self.window = PeerWindow(node_comm)
        self.memory = peer_memory(self.backend)
        # A stream of its own, which holds the peer calls only, in call order on every
        # rank: their device-side waits for the other ranks (stream and kernel fences)
        # must not hold up work of the other routes' calls in flight, which each rank
        # queues on the shared streams in an order of its own (a deadlock across ranks).
        self.stream = self.backend.stream("peer")
        self.fence = fences(self, exchange)  # the fence mechanism (peer_fences)
        self._events = []  # pooled events, recorded and waited for again and again
        self.fence_event = self.backend.event()
        self.end_event = self.backend.event()
        self.slot, self._slots = None, []  # this rank's window slot (device bytes), and every one made
        self.nothing = self.backend.empty(0, np.uint8)  # the buffers of a call that moves nothing (a barrier)
        self._buffers = {}  # the peers' buffers seen, typed (peer_buffer)
        # Registered arrays (Communicator.empty(device=)): where this rank's lies (base,
        # buffer id, offset, bytes) -> (the array, weakly: registered while it lives;
        # every rank's descriptor of its own; their placement_crc) (remember, counterparts)
        self._registered = {}
        # calls; fences (the plans': two a call, the ranks' only synchronisations); host
        # meetings (fences a host waits at for the others: both with host fences, the
        # first with stream and kernel ones)
        self.counters = Counter()

    def take_event(self):
        return self._events.pop() if self._events else self.backend.event()

    def give_event(self, event):
        self._events.append(event)

    def slot_of(self, nbytes):
        """This rank's window slot, at least ``nbytes`` long."""
        if self.slot is None or self.slot.nbytes < nbytes:
            self.slot = self.backend.empty(max(1 << max(int(nbytes) - 1, 0).bit_length(), 4096), np.uint8)
            self._slots.append(self.slot)  # a peer may have it open until its next call's first fence
        return self.slot

    def descriptor(self, array, nbytes):
        """The words that tell the other ranks where ``array`` is: its allocation's
        handle, base address and buffer id, the offset in it, ``nbytes``, the
        allocation's size; ``nbytes`` -1 where it cannot be shared (memory the device
        cannot export), 0 for nothing. Read-only: the same words for the same place, made
        once (a steady loop of calls describes the same buffers call after call); the
        driver is asked where the buffer lies every time (memory freed and allocated
        again at the same address is another allocation: another buffer id)."""
        if nbytes == 0:
            return _NOTHING
        try:
            base, size, buffer_id = self.backend.allocation(array)
            key = (base, buffer_id, _ptr(array) - base, nbytes, size)  # (the handle: base's and buffer id's)
            words = self._described.get(key)
            handle = self.memory.handle_of(base, buffer_id) if words is None else None
        except Exception:  # noqa: BLE001 - whatever the driver says, the others must hear of it
            return _UNSHAREABLE_WORDS
        if words is None:
            words = np.zeros(_DESCRIPTOR, np.int64)
            words[:_HANDLE_WORDS] = np.frombuffer(handle.ljust(8 * _HANDLE_WORDS, b"\0"), np.int64)
            words[_HANDLE_WORDS:] = (base, np.uint64(buffer_id).view(np.int64), key[2], nbytes, size)
            words.flags.writeable = False
            if len(self._described) >= 256:
                self._described.clear()
            self._described[key] = words
        return words

    def open(self, rank, words, what):
        """Rank ``rank``'s buffer that ``words`` describes, as uint8 device bytes here
        (None for nothing). Check every rank's descriptor first (:func:`check_shareable`),
        so that every rank raises alike where one cannot be shared."""
        base, buffer_id, offset, nbytes, size = (int(v) for v in words[_HANDLE_WORDS:])
        if nbytes == _UNSHAREABLE:  # (the callers checked: only if one did not)
            raise CollectiveError(unshareable_message(what, [rank]))
        if nbytes == 0:
            return None
        return self.memory.view(self.window.pids[rank], base, buffer_id & (2 ** 64 - 1),
                                words[:_HANDLE_WORDS].tobytes(), size, offset, nbytes)

    def peer_buffer(self, rank, described, what, storage):
        """Rank ``rank``'s buffer that ``described`` (its descriptor's bytes) describes,
        typed ``storage`` (a :class:`Sliced`; None for nothing). Kept: the same buffer
        in a later call costs a lookup, and its slices too (the peer's allocation stays
        open anyway)."""
        key = (rank, described, storage)
        found = self._buffers.get(key, False)
        if found is False:
            raw = self.open(rank, np.frombuffer(described, np.int64), what)
            found = None if raw is None else Sliced(raw.view(storage))
            if len(self._buffers) >= 256:
                self._buffers.clear()
            self._buffers[key] = found
        return found

    def remember(self, array, everyone):
        """``array`` is registered: ``everyone`` holds every node rank's descriptor of its
        own (``Communicator.empty(device=)``, collective), each opened here already."""
        key = _placement(everyone[self.window.rank])
        if key[3] <= 0:
            return
        try:
            alive = weakref.ref(array)
        except TypeError:  # an array that cannot be referred to weakly: never taken as registered
            return
        for gone in [k for k, (held, _, _) in self._registered.items() if held() is None]:
            del self._registered[gone]
        self._registered[key] = (alive, everyone.copy(), placement_crc(everyone))

    def counterparts(self, mine):
        """Every rank's registered array, if this rank's buffer ``mine`` (its descriptor)
        is a whole array registered here that still lives, and every peer's is still the
        allocation open here: ``(every rank's descriptor of its own, as each publishes
        it; a CRC of where they are)``, else None. A registered array that lives is the
        only array in its memory. (Only a whole array: a slice of one may be at a place
        that differs from rank to rank, as a rank's row of an allgather's output.)"""
        alive, rows, crc = self._registered.get(_placement(mine), (None, None, None))
        if alive is None or alive() is None:
            return None
        opened, pids = self.memory.opened, self.window.pids
        for q, row in enumerate(rows):  # (a peer's allocation closed here since: never read it)
            if q != self.window.rank:
                known = opened.get((pids[q], int(row[_HANDLE_WORDS])))
                if known is None or known[0] != int(row[_HANDLE_WORDS + 1]) & (2 ** 64 - 1):
                    return None
        return rows, crc

    def release(self):
        """Let this rank's stream pass every fence it may wait at (after a failure, so
        that its queued work does not wait for ever; :meth:`Fences.release`). For good: a
        call starting afterwards does not undo it (a broken communicator starts none)."""
        self.fence.release()

    def free(self, broken=False):
        """Release the window (collective over the node). Every call has finished its
        device work by then (a call finishes once its last event has), unless the
        communicator is ``broken`` on some rank: then a stream may still hold work that
        writes the window once released, so every rank keeps it (the ranks agree first)."""
        self.release()
        if not self.window.comm.allreduce(not broken, op=MPI.LAND):
            return
        self.fence.free()
        self.window.free()
        self._slots, self.slot = [], None


def _ptr(array):
    return array.ptr if hasattr(array, "ptr") else array.data.ptr


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
        window = self.window
        self.base = window.fences  # this call's fences are base + 1 … base + fences
        window.fences += self.fences
        window.calls += 1
        self.number = window.calls
        self.parity = self.number & 1
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
    # each, as the fences' (the tests take them out one at a time: tests/test_device_peer.py).
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
        self.peers = {}
        for q in range(window.size):
            if q == window.rank:
                continue
            inp = node.peer_buffer(q, window.descriptor_of(q, self.parity, 0), "input", storage)
            slot = node.peer_buffer(q, window.descriptor_of(q, self.parity, 1), "window slot",
                                    storage) if self.slot else None
            out = node.peer_buffer(q, window.descriptor_of(q, self.parity, 2), "output",
                                   storage) if q in self.writes_peers else None
            if (inp is None and self.arrays["in"].size) or (slot is None and self.slot) or \
                    (out is None and q in self.writes_peers):
                raise CollectiveMismatchError(f"{self.describe}: rank {q} published no buffer for this call where "
                                              "this rank needs one (a different call there, or a broken exchange)")
            self.peers[q] = (inp, slot, out)
        if self.slot:
            self.own_slot = Sliced(node.slot[: self.slot * storage.itemsize].view(storage))

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
        backend, stream, view = self.backend, self.node.stream, self._view
        if self.phases[k]:
            self.unrecorded = True
        for i, (kind, specs) in enumerate(self.phases[k]):
            if (k, i) in self.dividing and kind != _FOLD_BLOCKS:  # avg's result: divided as the fold writes it
                outputs, inputs = _fold_parts((kind, specs))
                backend.reduce_n(stream, self.op, self.dtype, [view(d) for d in outputs], [view(s) for s in inputs],
                                 divisor=self.divisor)
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
                                      [view(s) for s in specs[1]], specs[2],
                                      divisor=self.divisor if (k, i) in self.dividing else None)
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
        self._run.node.release()
