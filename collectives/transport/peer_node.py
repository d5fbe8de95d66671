"""What one communicator keeps for its peer-read calls on one device
(:class:`PeerNode`): the node's window and fence mechanism, the descriptors of this
rank's buffers and the peers' buffers opened from theirs, the registered arrays, this
rank's window slot, pooled events and counters."""

import weakref
from collections import Counter

import numpy as np
from mpi4py import MPI

from ..errors import CollectiveError
from .peer_fences import fence_mechanism
from .peer_memory import Sliced, peer_memory
from .peer_window import (
    _DESCRIPTOR,
    _HANDLE_WORDS,
    _NOTHING,
    _UNSHAREABLE,
    _UNSHAREABLE_WORDS,
    PeerWindow,
    _placement,
    placement_crc,
    unshareable_message,
)


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
