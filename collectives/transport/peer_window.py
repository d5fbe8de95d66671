"""The node's shared window of the peer-read calls (:class:`PeerWindow`: host memory
every rank of the node maps) and what the ranks publish in it at a call's first
fence: a signature of the call, and a descriptor of each buffer the others read
(where it lies: the allocation's IPC handle, base, buffer id, offset, bytes), which
every rank checks alike (:func:`compare_signatures`, :func:`check_shareable`).
"""

import os
import zlib

import numpy as np
from mpi4py import MPI

from ..errors import CollectiveError, CollectiveMismatchError, MessageSizeError
from .liveness import ranks

_LINE = 96  # int64 words of one rank's line in the window (768 bytes: the rows after stay 128-byte aligned)
# word offsets in a line; the descriptors: 3 buffers (input, window slot, output) for each parity of calls
_EPOCH, _ANNOUNCED, _SIGNATURE, _DESCRIPTORS, _PID, _DIGEST = 0, 1, 2, 10, 88, 89
_DESCRIPTOR = 13  # words of a buffer's descriptor: IPC handle (8), base, buffer id, offset, bytes, allocation size
_HANDLE_WORDS = 8
_BYTES_WORD = _HANDLE_WORDS + 3  # a descriptor's byte count
_UNSHAREABLE = -1  # a descriptor's byte count where the rank's buffer cannot be exported
_AHEAD = 1 << 20  # released waits: a value this far past the fences pending (cyclic comparison)
_NOTHING = np.zeros(_DESCRIPTOR, np.int64)  # the descriptor of no buffer (read-only, as every descriptor)
_NOTHING.flags.writeable = False
_UNSHAREABLE_WORDS = _NOTHING.copy()  # the descriptor of a buffer the driver cannot export
_UNSHAREABLE_WORDS[_BYTES_WORD] = _UNSHAREABLE
_UNSHAREABLE_WORDS.flags.writeable = False


class PeerWindow:
    """The node's shared window of one communicator's peer-read calls (host memory,
    ``MPI.Win.Allocate_shared``; collective to make): a line per rank (fence counter,
    call counter, signatures, descriptors, process id, digests), a row of 32-bit words per rank,
    which the other ranks' streams write (``stream`` and ``kernel`` fences), and one the
    rank's own fence kernels write where a peer did not come in time (``late``)."""

    def __init__(self, node_comm):
        self.comm = node_comm
        self.rank, self.size = node_comm.Get_rank(), node_comm.Get_size()
        self.row = 32 * -(-self.size // 32)  # words per row: 128-byte rows
        lines, rows = self.size * _LINE * 8, self.size * self.row * 4
        nbytes = -(-(lines + 2 * rows) // 4096) * 4096
        self.win = MPI.Win.Allocate_shared(nbytes if self.rank == 0 else 0, 1, comm=node_comm)
        buffer, _ = self.win.Shared_query(0)
        memory = np.frombuffer(buffer, np.uint8)[:nbytes]
        self.lines = memory[:lines].view(np.int64).reshape(self.size, _LINE)
        self.words = memoryview(memory[:lines]).cast("q")  # read and written word by word
        self.inbox = memory[lines : lines + rows].view(np.uint32)  # rank r's row at r * row
        self.late = memory[lines + rows : lines + 2 * rows].view(np.uint32)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        if self.rank == 0:
            memory[...] = 0
        self.win.Sync()
        node_comm.Barrier()  # nobody reads a word before it is zero
        self.win.Sync()
        self.words[self.rank * _LINE + _PID] = os.getpid()
        self.win.Sync()
        node_comm.Barrier()
        self.win.Sync()
        self.pids = [int(self.words[q * _LINE + _PID]) for q in range(self.size)]
        self.fences = 0  # fences handed out to calls so far
        self.calls = 0  # calls so far

    def free(self):
        if self.win is not None:
            self.words.release()
            self.win.Unlock_all()
            self.win.Free()
            self.win = None

    # -- host fences ------------------------------------------------------------------------
    def arrive(self, word, value):
        self.win.Sync()  # what this rank wrote before (descriptors, signature) goes first
        self.words[self.rank * _LINE + word] = value

    def passed(self, word, value):
        words = self.words
        for q in range(word, self.size * _LINE, _LINE):
            if words[q] < value:
                return False
        self.win.Sync()  # the others' words before what they wrote after
        return True

    def behind(self, word, value):
        return [q for q in range(self.size) if self.words[q * _LINE + word] < value]

    # -- what a call publishes at its first fence ------------------------------------------
    def sign(self, parity, signature):
        start = self.rank * _LINE + _SIGNATURE + 4 * parity
        for k, value in enumerate(signature):
            self.words[start + k] = value

    def signature_of(self, rank, parity):
        start = rank * _LINE + _SIGNATURE + 4 * parity
        return tuple(self.words[start : start + 4])

    def publish(self, parity, which, descriptor):
        start = _DESCRIPTORS + (3 * parity + which) * _DESCRIPTOR
        self.lines[self.rank, start : start + _DESCRIPTOR] = descriptor

    def descriptor_of(self, rank, parity, which):
        """Rank ``rank``'s descriptor of buffer ``which``, as bytes (what
        :meth:`PeerNode.peer_buffer` looks buffers up by)."""
        start = _DESCRIPTORS + (3 * parity + which) * _DESCRIPTOR
        return self.lines[rank, start : start + _DESCRIPTOR].tobytes()

    def unshareable(self, parity, which):
        """The ranks whose descriptor of buffer ``which`` says it cannot be shared."""
        at = _DESCRIPTORS + (3 * parity + which) * _DESCRIPTOR + _BYTES_WORD
        words = self.words
        return [q for q in range(self.size) if words[q * _LINE + at] == _UNSHAREABLE]

    def publish_digest(self, parity, digest):
        self.words[self.rank * _LINE + _DIGEST + parity] = digest

    def digests(self, parity):
        """Every rank's digest of its call of ``parity`` (0: it asked where the buffers are)."""
        return [int(self.words[q * _LINE + _DIGEST + parity]) for q in range(self.size)]

    def descriptors(self, parity, which):
        """Every rank's descriptor of buffer ``which`` (a view: one row per rank)."""
        start = _DESCRIPTORS + (3 * parity + which) * _DESCRIPTOR
        return self.lines[:, start : start + _DESCRIPTOR]

    # -- stream fences -------------------------------------------------------------------------
    def word(self, owner, writer):
        """The index (in ``inbox``) of the word ``writer`` writes into ``owner``'s row."""
        return owner * self.row + writer

    def behind_on_device(self, value):
        """The ranks whose word in this rank's row has not reached ``value``."""
        row = self.rank * self.row
        return [q for q in range(self.size)
                if q != self.rank and ((int(self.inbox[row + q]) - value) & 0xFFFFFFFF) >= 0x80000000]

    def announced(self, number):
        """The ranks whose line holds call ``number``'s signature and descriptors now
        (its word ``_ANNOUNCED``, written after them), read after it."""
        words = self.words
        found = [q for q in range(self.size) if words[q * _LINE + _ANNOUNCED] == number]
        self.win.Sync()  # (what they wrote before the word, read after it)
        return found

    def signalled(self, value):
        """Whether every peer's stream has written ``value`` (or later) into this rank's
        row; once so, what their hosts published before is read after it."""
        if self.behind_on_device(value):
            return False
        self.win.Sync()
        return True


def _placement(descriptor):
    """Where a descriptor's buffer is: (base, buffer id, offset, bytes)."""
    return tuple(int(v) for v in descriptor[_HANDLE_WORDS : _HANDLE_WORDS + 4])


def placement_crc(descriptors):
    """A CRC of where every rank's buffer is (base, buffer id, offset, bytes of each
    rank's descriptor), the same on every rank that sees the same."""
    return zlib.crc32(np.ascontiguousarray(descriptors[:, _HANDLE_WORDS : _HANDLE_WORDS + 4]).tobytes())


def call_digest(signature, placement):
    """The 32-bit digest of a call that the fence kernels compare at the first fence:
    its signature (number, code, bytes, root) and where every rank's input is."""
    return zlib.crc32(np.asarray(signature, np.int64).tobytes(), placement) or 1


def unshareable_message(what, which):
    """What every rank says where the ranks ``which`` published a ``what`` that cannot be
    shared (the same words on every rank)."""
    return (f"the {what} of {ranks(which)} {'is' if len(which) == 1 else 'are'} in device memory this library "
            "cannot share through CUDA IPC (an allocation the driver cannot export: managed memory, a "
            "stream-ordered pool such as cudaMallocAsync's, torch's expandable segments). The peer reads "
            "('one_shot', 'two_shot', 'leader') cannot read it, and 'auto' chooses them for device arrays of one node: "
            "name a message-based algorithm (algorithm='ring') for such arrays, or allocate them where they can "
            "be shared (Communicator.empty(device=...), CuPy's default pool, torch's caching allocator)")


def check_shareable(descriptors, what, describe):
    """Raise where some rank's descriptor (a row of ``descriptors`` per rank, this
    rank's included) says its ``what`` cannot be shared: every rank reads the same rows,
    so every rank raises the same error, naming the ranks, before anyone opens or reads
    anything."""
    refuse_unshareable(np.flatnonzero(descriptors[:, _BYTES_WORD] == _UNSHAREABLE).tolist(), what, describe)


def refuse_unshareable(which, what, describe):
    """Raise naming the ranks ``which`` (a list) whose ``what`` cannot be shared, if any."""
    if which:
        raise CollectiveError(f"{describe}: {unshareable_message(what, which)}")


def compare_signatures(window, parity, mine, describe):
    """Raise on every rank where some rank signed another call (its size, or anything else)."""
    for rank in range(window.size):
        theirs = window.signature_of(rank, parity)
        if theirs == mine:
            continue
        if theirs[0] == mine[0] and theirs[1] == mine[1] and theirs[3] == mine[3]:
            raise MessageSizeError(f"{describe}: rank {rank} called it with {theirs[2]} B where this rank has "
                                   f"{mine[2]} B; the ranks called it with buffers of different sizes")
        raise CollectiveMismatchError(f"{describe}: rank {rank} is in a different call (call #{theirs[0]}, or "
                                      "another collective, algorithm, dtype, op or root); every rank must call "
                                      "the same collectives in the same order")
