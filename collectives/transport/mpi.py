"""The MPI transport: runs plans with non-blocking buffer sends and receives.

Messages go as raw bytes (``MPI.BYTE``: no pickling, no datatype mapping) on the
communicator's private duplicate, tagged with the call's base tag (from its number)
plus the message's size code (:mod:`.tags`), so library traffic never matches user
messages, two collectives in flight never match each other's, and a message of the
wrong size never lands in a buffer it does not fit. ``native`` calls the MPI library's own non-blocking collective
instead
(:class:`RequestHandle`). Both are driven by the communicator's progress engine
(:mod:`.progress`).
"""

from mpi4py import MPI

from ..errors import MessageSizeError, TransportError
from ..schedule import Recv, Send
from . import tags
from .liveness import ranks
from .progress import Handle, at
from .scheduler import Scheduler, program_of


class PlanHandle(Handle):
    """Runs a compiled plan over MPI point-to-point messages, by the scheduling rule
    of :mod:`.scheduler`: the progress engine reports each finished message
    (:meth:`_on_request_done`), which starts what it releases."""

    def __init__(self, progress, describe, finish, comm, tag, plan, buffers, op, timeout=None, sequence=0):
        super().__init__(progress, describe, finish, timeout, sequence)
        self._comm, self._tag, self._buffers, self._op = comm, tag, buffers, op
        self._plan = plan
        self._scheduler = Scheduler(program_of(plan))
        self._in_flight = {}  # op index -> bytes, for the messages posted and not finished
        self._bytes_done = 0
        self._layout = tags.layout()  # each message's tag is the call's base tag plus its size code
        self._strays = None  # made at the first look (tags.Strays)

    def start(self):
        self._advance_plan()
        self._begin()
        return self

    def _advance_plan(self):
        """Start everything the plan allows now (see Scheduler.run)."""
        self._scheduler.run(self._run_local, self._post)

    def _complete(self, i):
        """Posted operation ``i`` has finished: start what it releases."""
        self._scheduler.complete(i)
        self._advance_plan()

    def _run_local(self, i):
        self._buffers.run_local(self._op, self._plan.ops[i])

    def _post(self, i):
        op = self._plan.ops[i]
        sending = isinstance(op, Send)
        view = self._buffers.view(op.src if sending else op.dst)
        self._in_flight[i] = view.nbytes
        self._message(self._comm, sending, view, op.peer, i)

    def _message(self, comm, sending, buffer, peer, token):
        """Post a send (``sending``) or a receive of ``buffer`` with ``peer`` on ``comm``,
        reported to :meth:`_on_request_done` as ``token``. Its tag is the call's base tag
        plus its size code (:mod:`.tags`): a receive matches only a message of its size,
        or (a large one) is posted once a probe has found its message and its size is
        right; MPI's truncation is never relied on."""
        layout = self._layout
        nbytes = buffer.nbytes
        tag = layout.tag(self._tag, nbytes)
        try:
            if sending:
                request = comm.Isend([buffer, MPI.BYTE], peer, tag)
            elif nbytes >= layout.large:
                self._progress.probes.add(comm, peer, tag, buffer, (self, token))
                return
            else:
                request = comm.Irecv([buffer, MPI.BYTE], peer, tag)
        except MPI.Exception as exc:
            raise TransportError(f"{self._describe}: MPI failed to post a message: {exc}") from exc
        self._add_request(request, token)

    def _wrong_size(self, i, got, source=None):
        op = self._plan.ops[i]
        return at(MessageSizeError(f"{self._describe}: step {self._step(i)}: received {got} B from rank {op.peer} "
                                   f"where the schedule expects {self._in_flight[i]} B; the ranks called it with "
                                   "buffers of different sizes"), op.peer, i + 1)

    def _owns(self, status):
        return self._tag <= status.Get_tag() < self._tag + self._layout.span

    def _stray(self):
        if self._strays is None:
            self._strays = tags.Strays(self._comm, self._tag, self._layout)
        ops, pending, in_flight = self._plan.ops, self._scheduler.pending, self._in_flight
        found = self._strays.check(tags.awaited(
            (op.peer, self._message_bytes(op), i, pending[i] == 0 and i not in in_flight)
            for i, op in enumerate(ops) if isinstance(op, Recv)))
        if found is None:
            return None
        peer, got, expected, step = found
        return at(MessageSizeError(f"{self._describe}: step {self._step(step)}: received {got} B from rank {peer} "
                                   f"where the schedule expects {expected} B; the ranks called it with buffers "
                                   "of different sizes"), peer, step + 1)

    def _message_bytes(self, op):
        """The size of the message that receive ``op`` takes."""
        return self._buffers.view(op.dst).nbytes

    def _on_request_done(self, i, status):
        expected = self._in_flight.pop(i)
        self._bytes_done += expected
        op = self._plan.ops[i]
        if isinstance(op, Recv):
            got = status.Get_count(MPI.BYTE)
            if got != expected:  # a large message's, probed for its size before: never here on a correct MPI
                self._in_flight[i] = expected
                raise self._wrong_size(i, got)
        self._complete(i)

    def _is_done(self):
        return self._scheduler.done

    def _step(self, i):
        return f"{i + 1} of {len(self._plan.ops)}"

    def _cancel(self, request, i):
        if isinstance(self._plan.ops[i], Recv):
            request.Cancel()

    def _message_error(self, status, code):
        """A receive of this call failed (status from Testsome): name its peer and step."""
        peer = status.Get_source()
        steps = [i for i, op in enumerate(self._plan.ops)
                 if isinstance(op, Recv) and op.peer == peer and i in self._in_flight]
        where = f"step {self._step(steps[0])}: " if steps else ""
        step = steps[0] + 1 if steps else -1
        if MPI.Get_error_class(code) == MPI.ERR_TRUNCATE:
            size = f" of {self._in_flight[steps[0]]} B" if steps else ""
            return at(MessageSizeError(f"{self._describe}: {where}the message from rank {peer} is longer than the "
                                       f"receive{size} (MPI truncation error); the ranks called it with buffers "
                                       "of different sizes"), peer, step)
        return at(TransportError(f"{self._describe}: {where}MPI failed on the message from rank {peer}: "
                                 f"{MPI.Get_error_string(code)}"), peer, step)

    def _outstanding(self):
        ops = self._plan.ops
        receives = sorted({ops[i].peer for i in self._in_flight if isinstance(ops[i], Recv)})
        sends = sorted({ops[i].peer for i in self._in_flight if isinstance(ops[i], Send)})
        in_flight = sum(self._in_flight.values())
        total = sum(self._buffers.view(op.src if isinstance(op, Send) else op.dst).nbytes
                    for op in ops if isinstance(op, (Send, Recv)))
        done = len(ops) - self._scheduler.untaken - len(self._in_flight)  # operations finished
        waiting = []
        if receives:
            waiting.append(f"for messages from {ranks(receives)}")
        if sends:
            waiting.append(f"for {ranks(sends)} to receive")
        return (f"at step {done + 1} of {len(ops)}: waiting {' and '.join(waiting) or 'to post'} "
                f"({in_flight} B in flight, {total - self._bytes_done - in_flight} B not yet posted)")


class RequestHandle(Handle):
    """Wraps one MPI request: a native collective, a barrier, a check-mode exchange."""

    def __init__(self, progress, describe, finish, start_request, timeout=None, sequence=0, nbytes=0):
        super().__init__(progress, describe, finish, timeout, sequence)
        try:
            self._add_request(start_request(), 0)
        except MPI.Exception as exc:
            raise TransportError(f"{describe}: the MPI library refused the call: {exc}") from exc
        self._pending = 1
        self._nbytes = nbytes

    def start(self):
        self._begin()
        return self

    def _on_request_done(self, _token, _status):
        self._pending = 0

    def _is_done(self):
        return self._pending == 0

    def _outstanding(self):
        return (f"inside the MPI library's own collective ({self._nbytes} B; it does not say which "
                "peers it waits for)")
