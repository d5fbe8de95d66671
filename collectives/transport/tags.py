"""Message tags that carry the message's size, so a message of the wrong size is never
received into a buffer it does not fit.

MPI receives a message longer than its buffer with a truncation error, but what it
writes first differs: MPICH and Intel MPI write nothing past the buffer; Open MPI
5.0's shared-memory path writes the whole message (96 B past a 4000 B buffer for
4096 B sent, 536 B past 65 000 B for 65 536 B: tests/harness/truncation.py). So the library's messages never
rely on it: a message's tag is its call's *base* tag plus a *size code*,

- the size in bytes, for a message under ``large`` bytes (128 KiB with MPICH's
  29-bit tags, 512 KiB with Open MPI's 31): a receive then only ever matches a
  message of exactly its size;
- ``large`` for a larger one: its receive is not posted until a matched probe
  (``Improbe``) has found the message and its size equals the receive's
  (:class:`Probes`); otherwise it raises without receiving into the buffer.

A message whose size differs matches no receive, and the receiving rank would wait.
So while a call waits (every ``LOOK_EVERY`` seconds, with the looks for other ranks'
failure notices), it probes (``Iprobe``, any tag) each peer it still expects a
message from: a message of this call (its tag in the call's range) whose size is
none of those it still expects from that peer is the wrong size. It is reported
once a second look finds it again with nothing received from that peer in between
(:class:`Strays`: a receive in the middle of its transfer lets the peer's next
message show first). The fast path pays nothing: a tag is an addition, and the
probes run only while a call waits.

The tag's upper bits number the call (:meth:`Layout.call`): ``CALL_BITS`` of them,
4095 numbers for calls in flight and one, the highest, shared by the blocking calls
that run alone (:attr:`Layout.blocking`); the rest hold the size code.
"""

import functools

import numpy as np
from mpi4py import MPI

from .. import mpi_library
from ..errors import MessageSizeError

CALL_BITS = 12


class Layout:
    """How a tag splits into the call's number and the message's size code, for an MPI
    whose largest tag is ``tag_ub``."""

    def __init__(self, tag_ub):
        bits = (int(tag_ub) + 1).bit_length() - 1  # every tag below 2**bits is allowed
        call_bits = min(CALL_BITS, bits - 1)
        self.size_bits = bits - call_bits
        self.span = 1 << self.size_bits  # the tags of one call: base .. base + span - 1
        self.large = self.span - 1  # messages of this many bytes or more are probed before they are received
        self.calls = 1 << call_bits
        self.blocking = (self.calls - 1) * self.span  # the base of every call that runs alone

    def call(self, sequence):
        """The base tag of the call numbered ``sequence`` (any int; taken mod 4095)."""
        return (sequence % (self.calls - 1)) * self.span

    def tag(self, base, nbytes):
        """The tag of a message of ``nbytes`` bytes of the call whose base is ``base``."""
        return base + (nbytes if nbytes < self.large else self.large)

    def __repr__(self):
        return f"<tag layout: {self.calls} calls x {self.span} size codes; probed from {self.large} B>"


@functools.lru_cache(maxsize=None)
def layout():
    """The layout of this job's tags (from ``MPI_TAG_UB``, the same on every rank)."""
    return Layout(mpi_library.tag_ub())


def wrong_size(describe, step, steps, peer, got, expected):
    """The :class:`MessageSizeError` of a message of ``got`` bytes from ``peer`` where
    the plan's step ``step`` (0-based) of ``steps`` expects ``expected``."""
    error = MessageSizeError(f"{describe()}: step {step + 1} of {steps}: received {got} B from rank {peer} where the "
                             f"schedule expects {expected} B; the ranks called it with buffers of different sizes")
    error.peer, error.step = peer, step + 1
    return error


class Probes:
    """Receives waiting for their message to be found by a matched probe before they
    are posted, in the order they were added: a collective's receives of ``large``
    bytes or more, and every point-to-point receive (:mod:`.p2p`).

    Messages from one peer with one tag match in the order they were sent, and these
    receives were added in the order they were made (each peer's receives are posted
    in program order), so only the first waiting entry of each (communicator, peer,
    tag) probes. A receive from any rank (``MPI.ANY_SOURCE``) keeps MPI's order too:
    it waits while an earlier receive of its tag waits, and a later receive of its tag
    waits while it does. :meth:`poll` posts what it found; a message whose size is
    not the receive's is received into a scratch buffer of its own (so that its
    sender is not left waiting) and raises."""

    __slots__ = ("entries", "status")

    def __init__(self):
        self.entries = []  # [comm, peer, tag, view, owner]
        self.status = MPI.Status()

    def __len__(self):
        return len(self.entries)

    def add(self, comm, peer, tag, view, owner):
        self.entries.append([comm, peer, tag, view, owner])

    def poll(self, posted, wrong):
        """Probe for each entry's message; for each found, ``posted(owner, request)``
        with its receive posted, or ``wrong(owner, got_bytes, request, source)`` where
        the size differs (``request``: the scratch receive, to be kept until it ends;
        ``source``: the sender's rank). Returns how many were found."""
        found, blocked, kept = 0, None, []
        status = self.status
        anyone = MPI.ANY_SOURCE
        for entry in self.entries:
            comm, peer, tag, view, owner = entry
            if blocked is not None and ((id(comm), peer, tag) in blocked or (id(comm), anyone, tag) in blocked
                                        or (peer == anyone and (id(comm), tag) in blocked)):
                kept.append(entry)
                continue
            message = comm.Improbe(peer, tag, status)
            if message is None:
                if blocked is None:  # (made only here: most polls have one entry, which finds nothing yet)
                    blocked = set()
                blocked.add((id(comm), peer, tag))
                blocked.add((id(comm), tag))  # what a later receive from any rank must wait for
                kept.append(entry)
                continue
            found += 1
            got = status.Get_count(MPI.BYTE)
            if got != view.nbytes:
                self.entries = kept + self.entries[len(kept) + found:]
                wrong(owner, got, message.Irecv([np.empty(got, np.uint8), MPI.BYTE]), status.Get_source())
                return found
            posted(owner, message.Irecv([view, MPI.BYTE]))
        self.entries = kept
        return found

    def clear(self):
        self.entries = []


def awaited(receives):
    """What :meth:`Strays.check` takes, from ``(peer, bytes, step, complete)`` of each
    receive of a call, in program order: for each peer, the sizes and steps of its
    receives not yet complete, and how many from it have completed."""
    expected, done = {}, {}
    for peer, nbytes, step, complete in receives:
        if complete:
            done[peer] = done.get(peer, 0) + 1
        else:
            entry = expected.setdefault(peer, ([], []))
            entry[0].append(nbytes)
            entry[1].append(step)
    return {peer: (sizes, steps, done.get(peer, 0)) for peer, (sizes, steps) in expected.items()}


class Strays:
    """Finds a message of one call that none of its receives will take (see the
    module's docstring). ``check(expected)`` at each look while the call waits;
    ``expected`` maps each peer the call still expects messages from to ``(sizes in
    bytes of its receives not yet complete, in program order; their steps; receives
    completed from it so far)``."""

    __slots__ = ("comm", "base", "layout", "status", "suspect")

    def __init__(self, comm, base, layout):
        self.comm, self.base, self.layout = comm, base, layout
        self.status = MPI.Status()
        self.suspect = None  # (peer, tag, bytes, receives completed from it) seen at the last look

    def check(self, expected):
        """``(peer, got, expected bytes, step)`` of a message of the wrong size, found at
        two looks in a row; else None."""
        comm, status, base, span = self.comm, self.status, self.base, self.layout.span
        suspect, self.suspect = self.suspect, None
        for peer, (sizes, steps, done) in expected.items():
            if not comm.Iprobe(peer, MPI.ANY_TAG, status):
                continue
            tag = status.Get_tag()
            if not base <= tag < base + span:
                continue  # another call's message
            got = status.Get_count(MPI.BYTE)
            if got in sizes:
                continue  # one this call expects, taken when its receive is posted
            seen = (peer, tag, got, done)
            if seen == suspect:
                return peer, got, sizes[0], steps[0]
            self.suspect = seen
            return None
        return None
