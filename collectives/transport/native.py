"""MPI's own collectives (``native``), told of a size mismatch before they run.

The library cannot tag MPI's own messages with their size (:mod:`.tags`), and what MPI
does with a collective called with different sizes differs (measured: see
``collectives.mpi_library``): MPICH 5.0.2 ends the job with a truncation error in
most collectives but returns short data in gather and scatter; Open MPI 5.0.11
writes past the receive buffer; Intel MPI 2021.18 returns wrong data or waits for
ever. Wherever the MPI library was not measured to stop by itself
(``mpi_library.native_checked``), the ranks first agree on the call's size: one MPI
allreduce of two int64s (the largest size and the negated smallest), after which
every rank knows whether they differ and raises the same :class:`MessageSizeError`
before MPI's collective is called. It costs that small allreduce per call (a few
microseconds), for those MPI libraries and collectives only.

The size agreed on is what each rank contributes (:func:`unit`): its input's bytes,
or for scatter its block of the result. ``alltoallv``'s counts differ per pair of
ranks by design; it is left to the count exchange (``Communicator._exchange_counts``).

A broadcast that runs alone (host arrays, blocking, no timeout or stall warning: MPI's
blocking broadcast) needs no agreement (:class:`RootSizeFirst`): only the ranks that
receive can hold a wrong size, and they can learn the root's from the root. The
agreement is a round trip, which a broadcast, one way, does not otherwise make: it
took a small broadcast from 2.6 to 6.6 us at 2 ranks (MPICH,
``bench/results/epyc-2vcpu-mpich5/auto-vs-fastest/latency-ab-broadcast-n2.txt``); the root's
size sent ahead travels with the data up to ``HEADER - 8`` bytes (a 512-byte broadcast
costs MPI what an 8-byte one does; the copies in and out, 0.7-0.9 us over the code
before the checks at 8 B) and as a small broadcast beside a larger one. The root cannot
learn of a receiver's mismatch without that round trip, so there only the ranks whose
buffers differ from the root's raise; every rank makes the same MPI calls, so the
communicator stays usable on every rank.
"""

import numpy as np
from mpi4py import MPI

from ..errors import MessageSizeError, TransportError
from .mpi import RequestHandle

CHECKED = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "gather", "scatter", "alltoall")


def unit(spec, inp, out):
    """The bytes every rank must give MPI's collective alike (``spec``: its
    :class:`~collectives.specs.Spec`): its input's, or where only the root's input is
    read (scatter) its result's."""
    return out.nbytes if spec.root_input else inp.nbytes


def mismatch(describe, agreed):
    """The error where ``agreed`` (the largest size and the negated smallest) says the
    ranks' sizes differ, else None."""
    largest, smallest = int(agreed[0]), -int(agreed[1])
    if largest == smallest:
        return None
    error = MessageSizeError(f"{describe}: the ranks called it with buffers of different sizes ({smallest} to "
                             f"{largest} B per rank), so MPI's own collective was not called")
    error.peer, error.step = -1, -1
    return error


HEADER = 512  # bytes every rank broadcasts first in a checked blocking broadcast: 8 of size, then the data if it fits


class RootSizeFirst:
    """MPI's blocking broadcast of ``nbytes`` (``dtype``) from ``root`` over ``comm``,
    called as ``run(buffer, _)`` (as the lean path keeps MPI's bound collective), told
    of a size mismatch without an agreement. Every rank first broadcasts a block of
    ``HEADER`` bytes alike, whatever its own size: the root's size, then the root's data
    where it fits (the whole call: MPI's small broadcast costs no more for 512 bytes
    than for 8); a larger broadcast follows it as bytes, every rank giving MPI the
    root's size (a rank whose size differs may hold another dtype too). A
    rank whose buffer differs from the root's takes what follows into a scratch buffer,
    leaves its own untouched and raises :class:`MessageSizeError` naming both sizes
    (``describe()`` names the call); the root and the ranks whose buffers match return.
    Made once per kind of call (``buffer``: contiguous, ``nbytes`` of ``dtype``)."""

    __slots__ = ("bcast", "block", "describe", "header", "inline", "is_root", "nbytes", "payload", "root")

    def __init__(self, comm, nbytes, dtype, root, describe):
        self.bcast, self.root, self.nbytes, self.describe = comm.Bcast, root, nbytes, describe
        self.is_root = comm.Get_rank() == root
        self.block = np.zeros(HEADER, np.uint8)
        self.header = self.block[:8].view(np.int64)
        self.inline = nbytes <= HEADER - 8  # the data travels in the block
        self.payload = self.block[8 : 8 + nbytes].view(dtype) if self.inline else None

    def __call__(self, buffer, _receive=None):
        flat = buffer if buffer.ndim == 1 else buffer.reshape(-1)
        bcast, root, block = self.bcast, self.root, self.block
        if self.is_root:
            self.header[0] = self.nbytes
            if self.inline:
                self.payload[...] = flat
                bcast(block, root)
            else:
                bcast(block, root)
                bcast([flat, MPI.BYTE], root)
            return
        bcast(block, root)
        sent = self.header.item()
        if sent != self.nbytes:
            if sent > HEADER - 8:  # the root's data, received as every rank receives it
                bcast([np.empty(sent, np.uint8), MPI.BYTE], root)
            error = MessageSizeError(f"{self.describe()}: this rank's buffer holds {self.nbytes} B where the root, "
                                     f"rank {root}, broadcast {sent} B; the ranks called it with buffers of different "
                                     "sizes, so nothing was written to it (the root and the ranks whose buffers "
                                     "match returned)")
            error.peer, error.step = root, -1
            raise error
        if self.inline:
            flat[...] = self.payload
        else:
            bcast([flat, MPI.BYTE], root)


def agreeing(comm, collective, nbytes, describe, fail):
    """``collective(send, receive)`` (MPI's blocking collective, as the lean path keeps it per
    kind of call) once the ranks of ``comm`` have compared ``nbytes``: where they differ,
    ``fail(error)`` (the communicator breaks) and raise it, on every rank alike, before
    ``collective``; the buffer it agrees in is made once."""
    agreed = np.empty(2, np.int64)
    allreduce, maximum = comm.Allreduce, MPI.MAX

    def run(send, receive):
        agreed[0], agreed[1] = nbytes, -nbytes
        allreduce(MPI.IN_PLACE, agreed, maximum)
        if agreed[0] != -agreed[1]:
            error = mismatch(describe(), agreed)
            fail(error)
            raise error
        collective(send, receive)

    return run


class Deferred:
    """MPI's non-blocking collectives waiting for their ranks to agree on the size,
    posted in the order they were called.

    MPI matches a communicator's collectives by the order each rank calls them, so a
    collective posted once its agreement has completed, which each rank learns at its
    own moment, must not share a communicator with collectives posted at call time:
    these go on ``comm``, a duplicate of their own, and in call order among
    themselves (a later one waits for an earlier one's agreement)."""

    def __init__(self, comm):
        self.comm = comm
        self.waiting = []  # AgreedHandle, in call order

    def post_ready(self):
        while self.waiting and self.waiting[0]._agreed:
            self.waiting.pop(0)._post_collective()


class AgreedHandle(RequestHandle):
    """MPI's non-blocking collective (``start_request(comm)``, on ``deferred.comm``),
    started once the ranks have agreed on its size: a non-blocking allreduce on
    ``comm`` first, posted at call time like any collective. It can time out and warn
    like any call."""

    def __init__(self, progress, describe, finish, comm, deferred, nbytes, start_request, timeout=None, sequence=0,
                 total=0):
        self._sizes = np.array([nbytes, -nbytes], np.int64)
        self._start_collective = start_request
        self._deferred = deferred
        self._agreed = False  # the agreement completed and the sizes are equal
        self._posted = False  # MPI's collective posted
        super().__init__(progress, describe, finish, lambda: comm.Iallreduce(MPI.IN_PLACE, self._sizes, MPI.MAX),
                         timeout, sequence, total)
        deferred.waiting.append(self)

    def _on_request_done(self, token, status):
        if self._posted:
            return super()._on_request_done(token, status)
        error = mismatch(self._describe, self._sizes)
        if error is not None:
            self._deferred.waiting.clear()  # the engine breaks: nothing after it is posted
            raise error  # the engine breaks, naming this call
        self._agreed = True
        self._deferred.post_ready()

    def _post_collective(self):
        self._posted = True
        try:
            self._add_request(self._start_collective(self._deferred.comm), 0)
        except MPI.Exception as exc:
            raise TransportError(f"{self._describe}: the MPI library refused the call: {exc}") from exc

    def _outstanding(self):
        if not self._posted:
            return ("in the ranks' agreement on its size before the MPI library's own collective (an MPI allreduce "
                    "of 16 B; it does not say which peers it waits for)")
        return super()._outstanding()
