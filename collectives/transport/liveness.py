"""Which ranks are still alive, asked when a collective times out.

A rank that times out knows only its own peers: in a ring, rank 1 waits for rank 0,
which waits for the rank that died. So the timed-out rank asks every other rank, on a
communicator of its own (never the one collectives use):

    timed-out rank r  --PROBE [sequence]-->  every other rank
                      <--REPLY [sequence]--  ranks waiting inside the library (they poll
                                             for probes every few ms while they wait)
                      <--PROBE [sequence]--  ranks that timed out too and ask in turn

Whoever answers within the grace period (or probed this rank earlier) is alive and
says which call it is in; the others are dead, hung, busy outside the library, or
blocked in a blocking MPI call. Probes are 16-byte buffer messages, never pickled.
Each rank asks at most once: the communicator is broken after a timeout.

The same communicator carries one more message: a rank whose call failed on a message
of the wrong size (or an MPI error) tells every other rank (BROKEN [sequence, code, peer,
step]), so that ranks whose own messages were fine stop too instead of waiting for a
rank that has given up.
"""

import time

import numpy as np
from mpi4py import MPI

from .retired import retire

PROBE, REPLY, BROKEN, CONNECT = 1, 2, 3, 4
DEFAULT_GRACE = 0.5  # seconds the timed-out rank listens for answers
# Up to this many ranks, a communicator that spans nodes connects every pair across
# nodes when it is made (connect): one small message each way per pair.
CONNECT_UP_TO = 256


class Liveness:
    def __init__(self, comm):
        self._comm = comm  # a private duplicate, for probes and replies only
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.heard = {}  # rank -> (call it was in, "waiting" or "timed out") when it probed or replied
        self._sent = []  # requests (and the buffers they hold) of replies and probes sent

    def connect(self, peers):
        """Exchange one small message with each of ``peers`` (every one of them must call
        this with this rank among its own peers), so that the MPI library has a
        connection to each before anything can fail. Over TCP, a probe to a rank this
        process never messaged opens a connection first, and where that rank's host has
        dropped off the network, MPICH's send blocks while TCP retries its connect (tens
        of seconds): the timed-out rank would hang in :meth:`check`, not raise."""
        token = np.zeros(1, np.int64)
        inbox = np.empty(len(peers), np.int64)
        requests = [self._comm.Irecv([inbox[i:i + 1], MPI.BYTE], r, CONNECT) for i, r in enumerate(peers)]
        requests += [self._comm.Isend([token, MPI.BYTE], r, CONNECT) for r in peers]
        MPI.Request.Waitall(requests)

    def answer(self, sequence):
        """Reply to every probe that has arrived: "this rank is waiting in the call
        numbered ``sequence``". Returns ``(rank, [sequence, code, peer, step])`` if a
        rank reported a failure (:meth:`notify`), else None."""
        status = MPI.Status()
        if self._comm.Iprobe(MPI.ANY_SOURCE, BROKEN, status):
            notice = np.empty(4, np.int64)
            self._comm.Recv([notice, MPI.BYTE], status.Get_source(), BROKEN)
            return status.Get_source(), [int(v) for v in notice]
        while self._comm.Iprobe(MPI.ANY_SOURCE, PROBE, status):
            source = status.Get_source()
            got = np.empty(2, np.int64)
            self._comm.Recv([got, MPI.BYTE], source, PROBE)
            self.heard[source] = (int(got[0]), "timed out")
            reply = np.array([sequence, 0], np.int64)
            self._sent.append(self._comm.Isend([reply, MPI.BYTE], source, REPLY))
        self._sent = [q for q in self._sent if not q.Test()]
        return None

    def notify(self, sequence, code, peer, step):
        """Tell every other rank that this rank's call numbered ``sequence`` failed
        (``code``: an index into the caller's table of reasons) on a message from
        ``peer`` at ``step``."""
        notice = np.array([sequence, code, peer, step], np.int64)
        for r in range(self.size):
            if r != self.rank:
                try:
                    self._sent.append(self._comm.Isend([notice, MPI.BYTE], r, BROKEN))
                except MPI.Exception:
                    pass

    def check(self, sequence, grace=DEFAULT_GRACE):
        """Ask every other rank; return ``(alive, silent)``: ``alive`` maps each rank
        that answered (now or earlier) to ``(its call, "waiting" | "timed out")``,
        ``silent`` lists the ranks that did not answer within ``grace`` seconds."""
        others = [r for r in range(self.size) if r != self.rank]
        probe = np.array([sequence, 0], np.int64)
        inbox = {r: np.empty(2, np.int64) for r in others if r not in self.heard}
        receives = {}
        for r in others:
            try:
                self._sent.append(self._comm.Isend([probe, MPI.BYTE], r, PROBE))
                if r in inbox:
                    receives[r] = self._comm.Irecv([inbox[r], MPI.BYTE], r, MPI.ANY_TAG)
            except MPI.Exception:  # a peer the MPI library already knows is gone
                pass
        status = MPI.Status()
        deadline = time.monotonic() + grace
        while receives and time.monotonic() < deadline:
            for r, request in list(receives.items()):
                if request.Test(status):
                    kind = "waiting" if status.Get_tag() == REPLY else "timed out"
                    self.heard[r] = (int(inbox[r][0]), kind)
                    del receives[r]
            time.sleep(0.001)
        for request in receives.values():  # nobody will answer these: take them back
            request.Cancel()
            self._sent.append(request)  # keeps the request (and its buffer) alive
        alive = {r: self.heard[r] for r in others if r in self.heard}
        return alive, [r for r in others if r not in self.heard]

    def free(self, keep=False):
        """Free the private communicator (``keep``: retire it instead: see :mod:`.retired`)."""
        if self._comm != MPI.COMM_NULL:
            if keep:
                retire(self._comm)
                self._comm = MPI.COMM_NULL
            else:
                self._comm.Free()


def describe(alive, silent, grace=DEFAULT_GRACE):
    """The liveness part of a timeout message."""
    parts = []
    if silent:
        parts.append(f"no answer within {grace:g} s from {ranks(silent)} "
                     "(dead, hung, busy outside the library, or blocked in a blocking MPI call)")
    for state in ("waiting", "timed out"):
        group = sorted(r for r, (_, kind) in alive.items() if kind == state)
        if group:
            calls = sorted({alive[r][0] for r in group})
            where = ", ".join(f"#{c}" for c in calls)
            parts.append(f"{ranks(group)} answered ({state} in call {where})")
    return "; ".join(parts)


def ranks(group):
    """'rank 3' or 'ranks 0-2, 5'."""
    runs = []  # [first, last] of each run of consecutive ranks
    for r in sorted(group):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in runs)
    return ("rank " if len(group) == 1 else "ranks ") + text
