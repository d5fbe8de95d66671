"""The progress engine: every call in flight of one communicator, driven together.

Every handle of a communicator (a collective's, a send's or receive's, a shared-memory
call's, a device call's) is driven by one :class:`Progress` engine: waiting on one
handle also advances the others, so ranks that wait on their handles in different
orders cannot deadlock. :class:`Handle` is what the engine drives, and what the
``*_async`` calls return; the transports subclass it (:mod:`.mpi`, :mod:`.shm`,
:mod:`.p2p`, :mod:`.device`).

When something goes wrong while messages are in flight (a timeout, a message of the
wrong size, an MPI error) the engine *breaks*: it cancels the receives in flight,
fails every handle, and refuses later calls. The ranks no longer agree on which
message belongs to which call, so going on could only hang or mix up data. A rank
that breaks on a message of the wrong size or an MPI error tells the others (see
:mod:`.liveness`), so that ranks whose own messages were fine stop as well.
"""

import logging
import math
import os
import time
from collections import namedtuple

from mpi4py import MPI

from ..errors import CollectiveError, CollectiveTimeoutError, MessageSizeError, TransportError
from ..options import check_timeout
from . import retired, tags
from .liveness import DEFAULT_GRACE
from .liveness import describe as describe_liveness

log = logging.getLogger("collectives")

# Device work the host waits for: handle._device_done(token) once backend.query(event) says it ran.
DeviceWait = namedtuple("DeviceWait", "handle token backend event")

_CHECK_EVERY = 0.02  # seconds between looks at the clock, probes and stall warnings while waiting
_REASONS = {1: MessageSizeError, 2: TransportError}  # the codes of failures a rank tells the others


class Progress:
    """The handles of one communicator that still have messages in flight.

    Waiting polls (``Testsome``) and yields the CPU between polls instead of spinning
    inside ``MPI_Waitsome``: when there are more ranks than cores, a rank that spins
    keeps the very peer it waits for off the CPU, and every step of a schedule then
    costs a scheduler time slice (a 1 MiB ring allreduce at 4 ranks on 2 cores went
    from 21 ms to 0.8 ms). With a core per rank, ``sched_yield`` returns at once.

    The requests of all active handles live in one list that only grows until half of
    it has completed (MPI sets completed entries to ``REQUEST_NULL``, which later polls
    skip); then it is compacted. So a pipelined schedule with thousands of segments in
    flight costs O(1) Python work per completed request, not a rebuild per completion.
    """

    def __init__(self, liveness=None, stall_warn=None):
        self.active = []
        self.broken = None  # the error that broke the engine, once one has
        self.liveness = liveness  # asked which ranks are alive when a wait times out
        self.stall_warn = stall_warn  # seconds of waiting between stall warnings, or None
        self.sequence = 0  # the number of the newest call, for liveness replies
        self._requests = []  # requests posted and not yet compacted away
        self._owners = []  # (handle, token) for each entry of _requests
        self._statuses = []  # filled by Testsome: entry k is for the k-th finished request
        self._completed = 0  # entries of _requests that are REQUEST_NULL
        self._abandoned = 0  # requests given up on (kept by transport.retired: MPI may still use their buffers)
        self._next_look = 0.0  # when drain() next answers probes and reads failure notices
        self._device = []  # DeviceWait: device work the host waits for
        self.backends = []  # devices this communicator uses: polled while waiting (see device.standin)
        self.shm = []  # shared-memory calls (QueuedHandle), run in the order they were made
        self.probes = tags.Probes()  # receives posted once a probe finds their message (large ones, send/recv)

    def leftovers(self):
        """What the engine still holds once every call has finished (none of which
        should be left): descriptions of active handles, live requests, abandoned
        requests and the failure that broke the engine, if any."""
        found = []
        if self.active:
            found.append(f"{len(self.active)} handles still active: "
                         + ", ".join(h._describe for h in self.active[:3]))
        live = sum(1 for request in self._requests if request != MPI.REQUEST_NULL)
        if live:
            found.append(f"{live} live requests in the engine's list")
        if self._abandoned:
            found.append(f"{self._abandoned} abandoned requests")
        if self.broken is not None:
            found.append(f"the engine is broken: {self.broken}")
        return found

    @property
    def entries(self):
        """Requests posted and not yet compacted away (a measure of the engine's list)."""
        return len(self._requests)

    def abandon(self, *requests):
        """Keep ``requests`` (given up on after a failure) referenced for the life of the
        process (:func:`.retired.abandon`): MPI may still use their buffers."""
        self._abandoned += len(requests)
        retired.abandon(*requests)

    def device_work(self, handle):
        """How many device operations the host waits for on behalf of ``handle``."""
        return sum(1 for entry in self._device if entry.handle is handle)

    def add(self, handle, token, request):
        self._requests.append(request)
        self._owners.append((handle, token))

    def add_device(self, handle, token, backend, event):
        """Call ``handle._device_done(token)`` once ``event`` (device work) has completed."""
        self._device.append(DeviceWait(handle, token, backend, event))

    def advance(self):
        """Complete what has finished, without blocking. Returns True if some request or
        device work completed."""
        progressed = False
        if self.probes.entries:  # (not len(): this runs at every turn of every wait)
            progressed = self._advance_probes()
        if self._requests:
            try:
                finished = MPI.Request.Testsome(self._requests, self._statuses)
            except MPI.Exception as exc:
                self._fail_in_status(exc)
            if finished:
                statuses = self._statuses
                done = [(self._owners[j], statuses[k]) for k, j in enumerate(finished)]
                self._completed += len(done)
                if 2 * self._completed >= len(self._requests):
                    self._compact()
                for (handle, token), status in done:  # may post new requests: appended to the lists
                    try:
                        handle._request_done(token, status)
                    except Exception as exc:
                        self.fail(exc, culprit=handle)
                        raise
                progressed = True
        if self.backends:
            progressed = self._advance_device() or progressed
        if self.shm:
            progressed = self._advance_shm() or progressed
        return progressed

    def _advance_probes(self):
        """Post the receives whose message a probe has found (see ``tags.Probes``);
        break on one of the wrong size."""
        return self.probes.poll(self._probe_found, self._probe_wrong) > 0

    def _probe_found(self, owner, request):
        self.add(owner[0], owner[1], request)

    def _probe_wrong(self, owner, got, request, source):
        handle, i = owner
        self.abandon(request)  # the message goes to a scratch buffer: MPI keeps it until it ends
        error = handle._wrong_size(i, got, source)
        self.fail(error, culprit=handle)
        raise error

    def _look_for_strays(self):
        """At each look while waiting: break if a call in flight has a message of the
        wrong size waiting for it (see ``tags.Strays``)."""
        for handle in list(self.active):
            error = handle._stray()
            if error is not None:
                self.fail(error, culprit=handle)
                raise error

    def _advance_shm(self):
        """Run the shared-memory calls, oldest first, as far as their fences let them."""
        progressed = False
        while self.shm:
            handle = self.shm[0]
            try:
                progressed = handle.step() or progressed
            except Exception as exc:
                self.fail(exc, culprit=handle)
                raise
            if not handle._finished:
                break
            self.shm.pop(0)
        return progressed

    def _advance_device(self):
        """Let the devices progress, and complete the device work that has finished."""
        for backend in self.backends:
            backend.poll()  # a no-op on a GPU; the stand-in runs a little of its queued work
        if not self._device:
            return False
        waiting, finished = [], []
        for entry in self._device:
            (finished if entry.backend.query(entry.event) else waiting).append(entry)
        if not finished:
            return False
        self._device = waiting  # callbacks may add to it
        for entry in finished:
            try:
                entry.handle._device_done(entry.token)
            except Exception as exc:
                self.fail(exc, culprit=entry.handle)
                raise
        return True

    def drain(self):
        """Advance without blocking for as long as requests keep completing: a schedule
        goes as many steps as its messages allow now, not one step per call. Every
        ``_CHECK_EVERY`` seconds also answers probes and reads failure notices."""
        while self.advance():
            pass
        if self.active:
            now = time.monotonic()
            if now >= self._next_look:
                self._next_look = now + _CHECK_EVERY
                self.look_around(self.active[0])
                self._look_for_strays()

    def wait_for(self, handle, timeout, already_waited=0.0):
        """Advance until ``handle`` has finished or failed. After ``timeout`` seconds
        (None: never), counting ``already_waited`` seconds spent polling it elsewhere,
        the engine breaks with a :class:`CollectiveTimeoutError`. While waiting,
        answers liveness probes and logs a stall warning every ``stall_warn`` seconds."""
        start = time.monotonic() - already_waited
        next_look = time.monotonic() + _CHECK_EVERY
        next_warning = start + self.stall_warn if self.stall_warn else math.inf
        deadline = start + timeout if timeout is not None else math.inf
        while not handle._finished and handle._error is None:
            if self.advance():
                continue
            if not self._requests and not self._device and not self.shm and not self.probes.entries:
                raise CollectiveError(f"{handle._describe} is unfinished with no message in flight "
                                      "(a bug in the library: please report it)")
            yield_cpu()
            now = time.monotonic()
            if now < next_look:
                continue
            next_look = now + _CHECK_EVERY
            self.look_around(handle)
            self._look_for_strays()
            if now >= deadline:
                self.time_out(handle, now - start)
            if now >= next_warning:
                next_warning = now + self.stall_warn
                log.warning("rank %s: %s has waited %.1f s %s", _rank(self), handle._describe, now - start,
                            handle._outstanding())

    def look_around(self, handle):
        """Answer liveness probes; if another rank reported that it broke, break too
        (raising, for ``handle``'s wait, an error that says which rank and why)."""
        if self.liveness is None:
            return
        notice = self.liveness.answer(self.sequence)
        if notice is None:
            return
        source, (sequence, code, peer, step) = notice
        kind = _REASONS.get(code, TransportError)
        why = ("found a message of the wrong size (the ranks called it with buffers of different sizes)"
               if kind is MessageSizeError else "hit an MPI error")
        where = f" from rank {peer} at step {step}" if peer >= 0 else ""
        error = kind(f"rank {_rank(self)}: {handle._describe} stopped: rank {source} {why} in its call #{sequence}"
                     f"{where}, and gave up")
        self.fail(error, culprit=handle, notify=False)
        raise error

    def fail(self, error, culprit=None, notify=True):
        """Break the engine: every active handle fails (``culprit`` with ``error``, the
        others as cancelled), receives in flight are cancelled, later calls refused.
        A message-size or MPI error is reported to the other ranks (with ``notify``)."""
        if notify and self.broken is None and isinstance(error, TransportError) and self.liveness is not None:
            code = 1 if isinstance(error, MessageSizeError) else 2
            sequence = culprit._sequence if culprit is not None else self.sequence
            self.liveness.notify(sequence, code, getattr(error, "peer", -1), getattr(error, "step", -1))
        if self.broken is None:
            self.broken = error
        for handle in self.active:
            if handle is not culprit:
                handle._error = CollectiveError(f"{handle._describe} was cancelled: another call on this "
                                                f"communicator failed: {error}")
        if culprit is not None and culprit._error is None:  # it may not have joined active yet
            culprit._error = error
        self.active.clear()
        live = []
        for request, (handle, token) in zip(self._requests, self._owners):
            if request != MPI.REQUEST_NULL:
                handle._cancel(request, token)
                live.append(request)
        self.abandon(*live)  # each holds its buffer: the cancel may not have taken
        self._requests, self._owners, self._completed = [], [], 0
        self._device = []
        for handle in self.shm:  # their device work may wait on the others: let it through
            handle._on_break()
        self.shm = []
        self.probes.clear()

    def time_out(self, handle, waited):
        """Break with the :class:`CollectiveTimeoutError` of ``handle`` (or a call run
        outside the engine, as ``routes.base`` names one), ``waited`` seconds in: what
        it waits for, and which ranks answer liveness probes."""
        outstanding = handle._outstanding()
        alive = ""
        if self.liveness is not None and self.liveness.size > 1:
            alive = ". Liveness: " + describe_liveness(*self.liveness.check(handle._sequence), DEFAULT_GRACE)
        error = CollectiveTimeoutError(f"rank {_rank(self)}: {handle._describe}: Timed out after {waited:.1f} s "
                                       f"{outstanding}{alive}")
        self.fail(error, culprit=handle)
        raise error

    def _fail_in_status(self, exc):
        """``Testsome`` raised: find the message that failed (its status says which
        peer sent it, and its tag which call), break the engine and raise."""
        error = TransportError(f"MPI failed while waiting for messages: {exc}")
        culprit = None
        if exc.Get_error_class() == MPI.ERR_IN_STATUS:
            for status in self._statuses:
                code = status.Get_error()
                culprit = self._owner_of(status) if code not in (MPI.SUCCESS, MPI.ERR_PENDING) else None
                if culprit is not None:  # a failed message of a call in flight (not a stale entry)
                    error = culprit._message_error(status, code)
                    break
        self.fail(error, culprit)
        raise error

    def _owner_of(self, status):
        for handle in self.active:
            if handle._owns(status):
                return handle
        return None

    def _compact(self):
        keep = [j for j, request in enumerate(self._requests) if request != MPI.REQUEST_NULL]
        self._requests = [self._requests[j] for j in keep]
        self._owners = [self._owners[j] for j in keep]
        self._completed = 0


def _rank(progress):
    return progress.liveness.rank if progress.liveness is not None else "?"


yield_cpu = getattr(os, "sched_yield", lambda: None)  # lets the peer a wait waits for run (ranks may outnumber cores)


def at(error, peer, step):
    """``error`` marked with the peer and step it happened at (told to the other ranks)."""
    error.peer, error.step = peer, step
    return error


_DEFAULT = object()  # wait(): the call's own timeout


class Handle:
    """A collective in flight. ``test()`` says whether it has finished (and advances
    it); ``wait()`` blocks until it has and returns the result."""

    def __init__(self, progress, describe, finish, timeout=None, sequence=0):
        self._progress = progress
        self._describe = describe  # for error messages: "allreduce(ring) call #3" etc.
        self._finish = finish
        self._finished = False
        self._result = None
        self._error = None  # set when the call failed or was cancelled
        self._timeout = timeout  # seconds, the default of wait(); None: no limit
        self._sequence = sequence  # the call's number (its messages' base tag)

    def test(self):
        """True once the call has finished; raises its error if it failed."""
        if not self._finished and self._error is None:
            self._advance(self._progress.drain)
        if self._error is not None:
            raise self._error
        return self._finished

    def wait(self, timeout=_DEFAULT, already_waited=0.0):
        """The call's result, once it has finished. ``timeout`` (seconds; default: the
        ``timeout`` the call was made with, else ``COLLECTIVES_TIMEOUT``, else none)
        bounds this wait: when it expires, :class:`~collectives.CollectiveTimeoutError`
        names the step, the peers whose messages are outstanding and the ranks that
        did not answer, and the communicator is broken (see ``collectives.errors``).
        ``already_waited``: seconds already spent on this call elsewhere (polling it
        with :meth:`test`), which the timeout counts."""
        timeout = self._timeout if timeout is _DEFAULT else check_timeout(timeout)
        if not self._finished and self._error is None:
            self._advance(lambda: self._progress.wait_for(self, timeout, already_waited))
        if self._error is not None:
            raise self._error
        return self._result

    def _advance(self, step):
        """Run ``step``; if it broke the engine, this handle raises its own error (which
        names the failure) rather than another call's."""
        try:
            step()
        except CollectiveError:
            if self._error is None:
                raise

    # -- for transports -------------------------------------------------------
    def _begin(self):
        self._progress.active.append(self)
        self._check_done()

    def _add_request(self, request, token):
        self._progress.add(self, token, request)

    def _request_done(self, token, status):
        self._on_request_done(token, status)
        self._check_done()

    def _device_done(self, token):
        self._on_device_done(token)
        self._check_done()

    def _on_device_done(self, token):
        raise NotImplementedError

    def _check_done(self):
        if not self._finished and self._is_done():
            if self in self._progress.active:  # a handle whose start() failed never joined
                self._progress.active.remove(self)
            self._result = self._finish()
            self._finished = True

    def _owns(self, status):
        """Whether the failed message of ``status`` is one of this call's (by its tag)."""
        return getattr(self, "_tag", None) == status.Get_tag()

    def _stray(self):
        """The :class:`MessageSizeError` of a message of this call that none of its
        receives will take, or None (the engine asks at each look while it waits)."""
        return None

    def _wrong_size(self, i, got, source):
        """The :class:`MessageSizeError` of this call's receive ``i``, which a probe
        found to be ``got`` bytes from rank ``source`` (transports that probe their
        receives name the step)."""
        return MessageSizeError(f"{self._describe}: received {got} B where the receive holds another size; the ranks "
                                "called it with buffers of different sizes")

    def _cancel(self, request, token):
        """Take back a request in flight when the engine breaks (receives only: a send's
        cancel needs the peer, which may be gone; its buffer stays referenced)."""

    def _on_break(self):
        """The engine broke while this call was in its queue of shared-memory calls (a
        device executor lets the device work it queued stop waiting for the others)."""

    def _outstanding(self):
        """What this call is waiting for, for timeout and stall messages."""
        raise NotImplementedError

    def _message_error(self, status, code):
        """The error for one of this call's messages that MPI failed (``status`` from
        ``Testsome``, ``code`` its error); transports name its peer and step."""
        return TransportError(f"{self._describe}: MPI failed on a message: {MPI.Get_error_string(code)}")

    def _on_request_done(self, token, status):
        raise NotImplementedError

    def _is_done(self):
        raise NotImplementedError


class QueuedHandle(Handle):
    """A call in flight that the :class:`Progress` engine runs in its queue of
    shared-memory calls (``shm``: oldest first, each to its end before the next starts)
    whenever it polls: ``running`` (the call's running state) has ``step()`` (True if
    it moved), ``done`` and ``outstanding()``. The shared-memory calls (:mod:`.shm`) and the peer reads
    (:mod:`.device_node`) are such calls."""

    def __init__(self, progress, describe, finish, running, timeout=None, sequence=0):
        super().__init__(progress, describe, finish, timeout, sequence)
        self._running = running

    def start(self):
        self._progress.shm.append(self)
        self._begin()
        return self

    def step(self):
        moved = self._running.step()
        if self._running.done:
            self._check_done()
        return moved

    def _is_done(self):
        return self._running.done

    def _outstanding(self):
        return self._running.outstanding()
