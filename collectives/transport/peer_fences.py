"""How the ranks of a node meet at the fences of the peer-read calls
(:mod:`.device_node`): one class per mechanism, chosen once per communicator
(``device_fence``, ``COLLECTIVES_DEVICE_FENCE``; ``make bench-gpu`` measures them) by
:func:`fence_mechanism`, the one place that reads the option's values.

- :class:`HostFences` (``host``): the host waits (polling an event) for its device
  work before the fence, then writes the fence's number into its counter in the node's
  shared window and waits until every rank's counter has reached it; then it launches
  the next phase.
- :class:`StreamFences` (``stream``): at the first fence (every input ready, and where
  it is) the host publishes where its buffers are, then its stream writes the fence's
  number into a word of each peer's row of the window (``cuStreamWriteValue32``, once
  the work before it has run), and the host waits until every peer's stream has
  written it into this rank's row: it has then seen both where the peers' inputs are
  and that they are ready, and enqueues the rest of the call at once. The second fence
  is the devices' alone: the stream writes its number as at the first and waits until
  every peer has (``cuStreamWaitValue32``); the host does not wait for it.
- :class:`KernelFences` (``kernel``, ranks on distinct GPUs): at the second fence a
  small kernel writes the fence's number into every peer's flags (device memory) and
  spins on its own, at most a time limit. At the first the host waits as with
  ``stream`` to see where the peers' inputs are, unless this rank's input is a whole
  registered array (``Communicator.empty(device=)``) and the call needs no window
  slot: then it takes every peer's input to be that peer's array of the same
  ``empty``, no host waits for another, and a first fence kernel waits as the second
  does, comparing a digest of the call and of where every rank's input is. Ranks whose
  digests differ (one passed another array or made another call) mark each other, and
  every rank raises (any two that disagree make every rank see a difference). Such
  ranks publish their digest in the window: a rank that asked compares them at its
  hosts' meeting, and signals the first fence on the devices (a kernel that only
  writes; before raising, every fence left), so that their kernels pass.

The first fence is where the hosts must meet unless they know where the buffers are
(a host can only launch a read of a peer's buffer once it knows where that buffer is),
so it also carries the device's readiness: one synchronisation, not a hosts' meeting
beside a device fence.

Each synchronisation is a method of its own (``_work_done``, ``_others_arrived``,
``_signal``, ``_others_signalled``, ``_wait_for_others``, ``_fence_kernel``): the
tests take them out one at a time and show a test failing for each
(``tests/test_device_peer.py``).
"""

import time

import numpy as np

from ..errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError
from .liveness import ranks
from .peer_window import _AHEAD, _ANNOUNCED, _EPOCH, call_digest, check_shareable, placement_crc

DEFAULT_KERNEL_LIMIT = 300.0  # seconds an in-kernel wait lasts at most where the call has no timeout


class Fences:
    """A fence mechanism of one node's peer-read calls (one per :class:`~.peer_node.PeerNode`,
    made with it). A running call (:class:`~.device_node.PeerCall`, ``running`` in the
    methods) hands each of its fences here; what it keeps between its steps (arrived,
    waiting ...) stays on it."""

    name = ""  # the device_fence value that chooses it
    in_kernel = False  # a rank's own kernel waits at the fences (the device cost model's own_fence)

    def __init__(self, node, exchange):
        """Set up on ``node`` (collective over the node where the mechanism needs it:
        ``exchange(words)``, every node rank's int64 ``words``)."""
        self.node, self.backend, self.window = node, node.backend, node.window

    def start(self, running):
        """At ``running``'s start, before its first phase is queued."""

    def fence(self, running, k):
        """Fence ``k`` (1-based) of ``running``: True once passed (the call then queues the
        next phase), False while it must be asked again."""
        raise NotImplementedError

    def covers_end(self, running):
        """Whether the event of ``running``'s last fence already marks the end of its device
        work (so no end event is recorded)."""
        return False

    def finished(self, running):
        """Once ``running``'s device work has run: raise what the device found wrong."""

    def waiting(self, running, k):
        """What ``running`` waits for at fence ``k``, for timeout and stall messages."""
        raise NotImplementedError

    def late_on_device(self, running):
        """Where ``running``'s device waits for other ranks after its host went on: a
        clause for messages, or ""."""
        return ""

    def release(self):
        """Let this rank's stream pass every fence it may wait at, for good (after a
        failure, so that its queued work does not wait for ever)."""

    def free(self):
        """Undo the set-up (every call's device work has run)."""


class HostFences(Fences):
    """``host``: the hosts meet at every fence, in the window's counters."""

    name = "host"

    def fence(self, running, k):
        epoch = running.base + k
        if not running.arrived:
            if not self._work_done(running):
                return False
            if k == 1:
                running.publish()
            self.window.arrive(_EPOCH, epoch)
            running.arrived = True
        if not self._others_arrived(running, k, epoch):
            return False
        running.arrived = False
        self.node.counters["host meetings"] += 1  # the fence is the hosts' meeting
        if k == 1:
            running.meet()
        return True

    def _work_done(self, running):
        """Whether this rank's device work before the fence has run (recording the event
        that says so the first time, unless nothing was queued since the last fence's,
        which has run)."""
        node = self.node
        if not running.waiting:
            if not running.unrecorded:
                return True
            self.backend.record(node.fence_event, node.stream)
            running.waiting = True
        if not self.backend.query(node.fence_event):
            return False
        running.waiting = running.unrecorded = False
        return True

    def _others_arrived(self, running, k, epoch):
        """Whether every rank has arrived at fence ``k``."""
        return self.window.passed(_EPOCH, epoch)

    def covers_end(self, running):
        return not running.unrecorded  # nothing queued since the last fence's event, which has run

    def waiting(self, running, k):
        if running.arrived:
            return (f"waiting at fence {k} of {running.fences} for "
                    f"{ranks(self.window.behind(_EPOCH, running.base + k))} to arrive")
        return f"waiting for this rank's device work before fence {k} of {running.fences}"


class _SignalledFences(Fences):
    """``stream`` and ``kernel``: at the first fence every stream signals in the
    window's rows once its work before the fence has run, and the host waits for the
    peers' signals (unless it need not know where their buffers are); later fences are
    the devices' alone."""

    def __init__(self, node, exchange):
        super().__init__(node, exchange)
        self.inbox = self.backend.map_host(self.window.inbox)  # every stream signals the first fence here

    def fence(self, running, k):
        epoch = running.base + k
        if k > 1:  # the devices' own: the host enqueues it and goes on
            self._on_devices(running, k, epoch)
            return True
        if not running.arrived:  # where the inputs are, and that they are ready: the host sees both
            self._announce(running)
            self.window.arrive(_ANNOUNCED, running.number)  # (nobody waits for it: see PeerCall.check_announced)
            self._signal(running, k, epoch)
            running.arrived = True
        if not self._first_passed(running, k, epoch):
            return False
        running.arrived = False
        return True

    def _announce(self, running):
        """Publish what the others read at the first fence."""
        running.publish()

    def _first_passed(self, running, k, epoch):
        """Whether the first fence is passed (signalled already)."""
        raise NotImplementedError

    def _on_devices(self, running, k, epoch):
        """Queue fence ``k`` (the second) on the devices."""
        raise NotImplementedError

    def _signal(self, running, k, epoch):
        """Once the work before it has run, the stream writes fence ``k``'s number into
        every peer's row."""
        node, window, value = self.node, self.window, epoch & 0xFFFFFFFF
        for q in range(window.size):
            if q != window.rank:
                self.backend.write_value(node.stream, self.inbox, window.word(q, window.rank), value)

    def _others_signalled(self, running, epoch):
        """The first fence: whether every peer's stream has signalled it (so its input is
        ready, and where it is has been published)."""
        return self.window.signalled(epoch & 0xFFFFFFFF)

    def waiting(self, running, k):
        return (f"waiting at fence {k} of {running.fences} for "
                f"{ranks(self.window.behind_on_device(running.base + k))} to arrive")

    def late_on_device(self, running):
        behind = self._behind()
        first = 1 if running.assumed else 2  # the host saw the first passed, unless assumed
        for k in range(first, running.fences + 1):
            late = behind((running.base + k) & 0xFFFFFFFF)
            if late:
                return f" (at fence {k} of {running.fences} it waits for {ranks(late)} to arrive)"
        return ""

    def _behind(self):
        """``behind(epoch)``: the peers whose signal of ``epoch`` this rank's device has not seen."""
        return self.window.behind_on_device

    def free(self):
        self.backend.unmap_host(self.inbox)


class StreamFences(_SignalledFences):
    """``stream``: stream memory operations on words of the window."""

    name = "stream"

    def _first_passed(self, running, k, epoch):
        if not self._others_signalled(running, epoch):
            running.check_announced()
            return False
        self.node.counters["host meetings"] += 1
        running.meet()
        return True

    def _on_devices(self, running, k, epoch):
        self._signal(running, k, epoch)
        self._wait_for_others(running, k, epoch)

    def _wait_for_others(self, running, k, epoch):
        """The stream waits until every peer has written fence ``k``'s number into this
        rank's row."""
        node, window, value = self.node, self.window, epoch & 0xFFFFFFFF
        for q in range(window.size):
            if q != window.rank:
                self.backend.wait_value(node.stream, self.inbox, window.word(window.rank, q), value)

    def release(self):
        """The words the stream waits for, written far ahead."""
        window = self.window
        row = window.rank * window.row
        window.inbox[row : row + window.size] = (window.fences + _AHEAD) & 0xFFFFFFFF


class KernelFences(_SignalledFences):
    """``kernel``: fence kernels that spin on flags in device memory (ranks on distinct
    GPUs), the first fence's on a call of whole registered arrays too."""

    name = "kernel"
    in_kernel = True

    def __init__(self, node, exchange):
        super().__init__(node, exchange)
        backend, window = self.backend, self.window
        self.late = backend.map_host(window.late)  # where a fence kernel marks the ranks it gave up on
        # every rank's inbox of flags, in its device memory, opened by the others (2
        # words a rank: the fence it reached, and its digest of the call)
        self.flags = backend.empty(2 * window.size, np.uint32)
        backend.copy(self.flags, np.zeros(2 * window.size, np.uint32), node.stream)
        backend.synchronize_stream(node.stream)
        everyone = exchange(node.descriptor(self.flags, self.flags.nbytes))
        check_shareable(everyone, "fence flags", "the peer-read set-up")
        inboxes = [self.flags if q == window.rank else node.open(q, everyone[q], "fence flags").view(np.uint32)
                   for q in range(window.size)]
        self.table = backend.pointer_table(inboxes)
        self._flag_stream = None  # where flags_now copies the flags out

    def start(self, running):
        """The previous call's fence kernels have all run: clear what they marked."""
        window, row = self.window, self.window.rank * self.window.row
        window.late[row : row + window.rank] = 0  # (not the rank's own word: release's, see release)
        window.late[row + window.rank + 1 : row + window.size] = 0

    def _announce(self, running):
        running.publish()
        self._assume(running)
        self.window.publish_digest(running.parity, running.digest if running.assumed else 0)

    def _first_passed(self, running, k, epoch):
        if running.assumed:  # the devices meet alone
            self._fence_kernel(running, k, epoch)
            return True
        # a rank that asks: ranks that did not may wait for it on their devices
        if not self._others_signalled(running, epoch):
            self._signalling_if_it_raises(running, running.check_announced, 1)
            return False
        self.node.counters["host meetings"] += 1
        self._signal_fences(running, (1,))  # first: so that they go on while this host opens buffers
        self._signalling_if_it_raises(running, lambda: self._meet_having_asked(running), 2)
        return True

    def _on_devices(self, running, k, epoch):
        self._fence_kernel(running, k, epoch)

    def _fence_kernel(self, running, k, epoch):
        """One small kernel writes fence ``k``'s number (and the call's digest) into every
        peer's flags and waits for theirs in its own, at most the call's ``limit``
        seconds; at the first fence (a rank that took the peers' registered arrays
        without asking) it compares the peers' digests with this rank's."""
        self._launch(running, epoch, wait=True, check=k == 1)

    def _launch(self, running, epoch, wait, check=False):
        """The fence kernel at ``epoch`` with ``running``'s digest: waiting, or only signalling."""
        node, window = self.node, self.window
        self.backend.fence_kernel(node.stream, self.table, self.flags, window.rank, epoch & 0xFFFFFFFF, running.limit,
                                  self.late, window.rank * window.row, digest=running.digest, wait=wait, check=check)

    def _assume(self, running):
        """The first fence: where this rank's input is a whole registered array
        (``Communicator.empty(device=)``) and the call needs no window slot, take every
        peer's input to be its counterpart, its array of the same ``empty`` (so the host
        need not wait to see where they are: the devices then meet alone). The digest
        the fence kernels compare names where every rank's input is, so a rank that
        passed another array makes every rank raise."""
        if running.slot or running.shared_out or not running.arrays["in"].nbytes:
            return
        node = self.node
        found = node.counterparts(running.mine)
        if found is None:
            return
        rows, placement = found
        storage = running.arrays["in"].dtype
        running.peers = {q: (node.peer_buffer(q, rows[q].tobytes(), "input", storage), None, None)
                      for q in range(self.window.size) if q != self.window.rank}
        running.digest = call_digest(running.signature, placement)
        running.assumed = True
        node.counters["registered calls"] += 1

    def _meet_having_asked(self, running):
        """:meth:`PeerCall.meet`, then the published digests compared with this rank's."""
        running.meet()
        self._compare_digests(running)

    def _signal_fences(self, running, fences):
        """A rank whose host asked where the buffers are: where a rank took its
        registered array without asking (it published a digest), its fence kernels wait
        for this rank's on its device, so write this rank's digest and the numbers of
        ``fences`` into the peers' flags, waiting for nothing (the first fence, or every
        one left before raising: their kernels then see the digest, pass, and raise too).
        Where every rank asked, no device waits at the first fence: no kernel. True if it
        signalled."""
        window = self.window
        if not any(window.digests(running.parity)):
            return False
        running.digest = call_digest(running.signature, placement_crc(window.descriptors(running.parity, 0)))
        for k in fences:
            self._launch(running, running.base + k, wait=False)
        return True

    def _signalling_if_it_raises(self, running, check, first):
        """Run ``check``; if it raises a disagreement (a :class:`CollectiveError`: another
        call, a buffer that cannot be shared, another digest; this rank's digest then
        differs from theirs, so they raise too), first signal fences ``first`` … the
        call's last (:meth:`_signal_fences`) and let this rank's stream run up to there,
        within a few seconds (a GPU runs what was queued anyway; the stand-in runs its
        streams only while someone waits). Another error (a driver's) leaves the digests
        alike: the others are not let past fences whose reads of this rank's input its
        caller may overwrite once it has raised; they time out, naming it."""
        try:
            check()
        except CollectiveError:
            if self._signal_fences(running, range(first, running.fences + 1)):
                backend, event = self.backend, self.node.fence_event
                backend.record(event, self.node.stream)
                until = time.monotonic() + min(running.limit, 10.0)
                while not backend.query(event) and time.monotonic() < until:
                    time.sleep(1e-4)
            raise

    def _compare_digests(self, running):
        """Past the first fence's hosts' meeting: the ranks that took the buffers without
        asking published their digest; raise if one differs from this rank's (which
        names the call and where every rank's input is). This rank's fence kernel has
        signalled already, with its own digest, so those ranks' kernels pass and see the
        difference too, and every rank raises (:meth:`PeerCall.meet`'s errors too)."""
        differ = [q for q, d in enumerate(self.window.digests(running.parity)) if d and d != running.digest]
        if differ:
            raise CollectiveMismatchError(
                f"{running.describe}: {ranks(differ)} passed a whole registered array (Communicator.empty(device=)) "
                "and so read this rank's array of the same empty() without asking, but this rank passed another "
                "buffer or made another call: on whole registered arrays every rank must pass its own alike")

    def finished(self, running):
        """Raise naming the ranks a fence kernel gave up on, or whose digest of the call
        differed from this rank's."""
        window = self.window
        row = window.late[window.rank * window.row : window.rank * window.row + window.size]
        differ = [q for q in range(window.size) if row[q] == 2 and q != window.rank]  # (its own word: release's)
        if differ:  # (first: ranks that called something else may well be late too)
            raise CollectiveMismatchError(
                f"{running.describe}: {ranks(differ)} made another call, or passed another buffer: a call on a whole "
                "registered array (Communicator.empty(device=)) reads every rank's array of the same empty() "
                "without asking where it is, so every rank must pass its own alike (the result is undefined)")
        late = [q for q in range(window.size) if row[q] == 1 and q != window.rank]
        if late:
            raise CollectiveTimeoutError(f"{running.describe}: its in-kernel fences waited {running.limit:g} s for "
                                         f"{ranks(late)} to arrive, and gave up (the call's timeout, else "
                                         f"{DEFAULT_KERNEL_LIMIT:g} s: a kernel cannot be stopped from outside)")

    def _behind(self):
        """From this rank's flags (copied to the host, on a stream of their own)."""
        flags, window = self.flags_now(), self.window
        return lambda epoch: [q for q in range(window.size)
                              if q != window.rank and ((int(flags[q]) - epoch) & 0xFFFFFFFF) >= 0x80000000]

    def flags_now(self):
        """This rank's flags as they are now, on the host (for messages; the copy runs on
        a stream of its own beside the fence kernel that spins on them)."""
        if self._flag_stream is None:
            self._flag_stream = self.backend.stream("flags")
        host = np.empty(self.window.size, np.uint32)
        self.backend.copy(host, self.flags[: self.window.size], self._flag_stream)
        self.backend.synchronize_stream(self._flag_stream)
        return host

    def release(self):
        """The rank's own word of its row of ``late`` (which no fence kernel writes: they
        write the peers' words) set, which its fence kernels read as they spin and then
        stop, within a tenth of a millisecond, instead of spinning to their time limit
        (up to 300 s)."""
        window = self.window
        window.late[window.rank * window.row + window.rank] = 1

    def free(self):
        super().free()
        self.backend.unmap_host(self.late)


FENCES = {fences.name: fences for fences in (HostFences, StreamFences, KernelFences)}
MECHANISMS = tuple(FENCES)  # the device_fence values besides "auto"


def fence_mechanism(option, uuids, ranks):
    """The :class:`Fences` class that the ``device_fence`` value ``option`` names.
    ``auto``: in-kernel flags where every one of the node's ``ranks`` has a GPU of its
    own (``uuids``: the node's GPUs; whose kernels can spin on a flag without holding
    the others' off the device), else the host's epochs (on a shared GPU a spinning
    kernel would hold the others off for its whole time slice)."""
    if option == "auto":
        return KernelFences if len(uuids) == ranks and ranks > 1 else HostFences
    if option not in FENCES:
        raise ValueError(f"device_fence must be auto or one of {', '.join(MECHANISMS)}; got {option!r}")
    return FENCES[option]
