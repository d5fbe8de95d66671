"""Point-to-point messages (``Communicator.send``/``recv``), for pipeline parallelism.

They travel on a private MPI communicator of their own, so they never match a
collective's messages (whose tags are call numbers) nor the caller's. A message goes
as raw bytes; a receive is posted once a matched probe has found its message, and only
if that message is exactly its buffer's size (:class:`PointHandle`). Their handles
join the communicator's progress engine: waiting on one advances the collectives in
flight too, a timeout names the peer, and a failure breaks the communicator as a
collective's does.

Device arrays are staged through pinned host memory, in the order of the user's
stream: a send copies the data out (and waits for that copy) before the message goes;
a receive copies the message in on the user's stream once it has arrived.
"""

import numpy as np
from mpi4py import MPI

from ..errors import MessageSizeError, TransportError
from .progress import Handle


class PointHandle(Handle):
    """One send or one receive of ``buffer`` (a flat uint8 array) to or from ``peer``
    (None: any rank) on ``comm``. ``source``: the rank a finished receive came from.

    A receive is posted only once a matched probe has found its message and that
    message is exactly the buffer's size (``tags.Probes``, polled by the progress
    engine): a message of another size is received into scratch memory and raises
    :class:`MessageSizeError`, and nothing is written into the buffer. MPI's own
    truncation is never relied on (Open MPI's shared-memory path writes a longer
    message past the end of the buffer before it reports it)."""

    def __init__(self, progress, describe, finish, comm, buffer, peer, tag, receive, timeout=None, sequence=0):
        super().__init__(progress, describe, finish, timeout, sequence)
        self._peer, self._message_tag, self._nbytes, self._receive = peer, tag, buffer.nbytes, receive
        self.source = None
        if receive:
            progress.probes.add(comm, MPI.ANY_SOURCE if peer is None else peer, tag, buffer, (self, 0))
        else:
            try:
                self._add_request(comm.Isend([buffer, MPI.BYTE], peer, tag), 0)
            except MPI.Exception as exc:
                raise TransportError(f"{describe}: the MPI library refused it: {exc}") from exc
        self._pending = True

    def start(self):
        self._begin()
        return self

    def _on_request_done(self, token, status):
        if self._receive:
            self.source = status.Get_source()
            arrived = status.Get_count(MPI.BYTE)
            if arrived != self._nbytes:  # probed for its size before: never here on a correct MPI
                raise self._wrong_size(token, arrived, self.source)
        self._pending = False

    def _wrong_size(self, _token, got, source):
        self.source = source
        return MessageSizeError(f"{self._describe}: rank {source} sent {got} B where the receive holds "
                                f"{self._nbytes} B; send and receive must have the same size (nothing was "
                                "received into the buffer)")

    def _is_done(self):
        return not self._pending

    def _cancel(self, request, _token):
        if self._receive:
            request.Cancel()

    def _owns(self, status):
        return self._receive and status.Get_tag() == self._message_tag and \
            self._peer in (None, status.Get_source())

    def _message_error(self, status, code):
        if MPI.Get_error_class(code) == MPI.ERR_TRUNCATE:
            return MessageSizeError(f"{self._describe}: rank {status.Get_source()} sent more than the receive holds "
                                    f"({self._nbytes} B; MPI truncation error); send and receive must have the "
                                    "same size")
        return TransportError(f"{self._describe}: MPI failed on the message: {MPI.Get_error_string(code)}")

    def _outstanding(self):
        peer = "any rank" if self._peer is None else f"rank {self._peer}"
        what = f"for a message from {peer}" if self._receive else f"for {peer} to receive"
        return f"waiting {what} ({self._nbytes} B)"


def device_to_host(x):
    """A device array's bytes in pinned host memory, copied on the user's stream and
    waited for (the send may then go at once)."""
    backend = x.backend
    host = backend.pinned(x.nbytes)
    source = x.data
    if not x.contiguous:
        source = backend.empty((x.size,), x.data.dtype, x.stream)
        backend.pack(x.stream, source, x.data)
    backend.copy(host, source, x.stream)
    backend.synchronize_stream(x.stream)
    return host


def host_to_device(host, out):
    """Copy a received message into the device array ``out`` on the user's stream; waits
    for the copy, so the pinned buffer may be dropped after."""
    backend = out.backend
    if out.contiguous:
        backend.copy(out.data, host, out.stream)
    else:
        flat = backend.empty((out.size,), out.data.dtype, out.stream)
        backend.copy(flat, host, out.stream)
        backend.unpack(out.stream, out.data, flat)
    backend.synchronize_stream(out.stream)


def as_bytes(array):
    """A contiguous array's memory as a flat uint8 view (a 0-d or empty array too)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)
