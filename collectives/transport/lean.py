"""The lean executor: a blocking call's plan run straight through, for small plans.

The progress engine (:mod:`.mpi`) serves every call in flight of a communicator at
once: it keeps owners and statuses for each request, answers liveness probes, looks
at the clock for timeouts and stall warnings, and hands every completion to a handle.
That costs tens of microseconds per call, which is all there is to a call on a few
bytes. A blocking call that has none of that to do (no timeout, no stall warning, no
other call of this communicator in flight) runs here instead: the same plan, the same
order of posting (every operation as soon as what it waits for has finished, ready
ones in program order), the same message checks, in one loop over precomputed
tables (:class:`~.scheduler.Program`, made once per plan), by the scheduling rule
every executor shares (:mod:`.scheduler`).

Waiting polls ``Testsome``; after ``SPIN`` seconds without progress it yields the CPU
between polls, as the engine does (a rank that spins keeps the peer it waits for off
the CPU when ranks outnumber cores).
Plans with more than ``MAX_OPS`` operations (pipelined ones, with many segments) go to
the engine: their messages are large and the fixed cost does not matter there.
"""

import functools
import time

import numpy as np
from mpi4py import MPI

from ..errors import MessageSizeError, TransportError
from ..ops import combine
from ..schedule import Copy
from . import retired
from . import tags as tags_module
from .buffers import Buffers
from .progress import yield_cpu
from .scheduler import LOCAL, RECV, REDUCE, SEND, program_of
from .tags import wrong_size  # noqa: F401 (also this module's name for it)

MAX_OPS = 64
LOOK_EVERY = 0.02  # seconds of waiting between looks for other ranks' failure notices
# Seconds a call polls without yielding the CPU, from its first empty poll: a peer on
# another core answers a small message within a few microseconds, and a yield (a system
# call, and on a shared machine possibly another process's time slice) would double that.
SPIN = 20e-6


def program(plan):
    """The plan's :class:`~.scheduler.Program`, or None if the plan is too large for the
    lean path or uses the shared window (the shared-memory algorithms: ``transport.shm``
    runs those)."""
    if len(plan.ops) > MAX_OPS or plan.shm:
        return None
    return program_of(plan)


class Patience:
    """How one blocking call waits (both executors here, and the shared-memory one): it
    polls without yielding for ``SPIN`` seconds from the first poll that found nothing,
    then yields the CPU between polls, and calls ``look()`` every ``LOOK_EVERY`` seconds
    of waiting. :meth:`progressed` after a poll that found something; :meth:`idle`
    after one that found nothing, which returns True where it was time to look (the
    caller then looks for what else it watches: a message of the wrong size)."""

    __slots__ = ("spin_until", "next_look", "look")

    def __init__(self, look=None):
        self.spin_until = self.next_look = None
        self.look = look

    def progressed(self):
        self.spin_until = None  # the next wait spins again first

    def idle(self):
        now = time.monotonic()
        if self.spin_until is None:  # the first poll of this wait that found nothing
            self.spin_until = now + SPIN
            if self.next_look is None:
                self.next_look = now + LOOK_EVERY
        elif now >= self.spin_until:
            yield_cpu()
            if now >= self.next_look:
                self.next_look = now + LOOK_EVERY
                if self.look is not None:
                    self.look()
                return True
        return False


def too_long(describe, where, peer):
    """The :class:`MessageSizeError` of a message longer than its receive (MPI's
    truncation error); ``where``: "step k of n: " or ""."""
    return MessageSizeError(f"{describe()}: {where}the message from rank {peer} is longer than the receive "
                            "(MPI truncation error); the ranks called it with buffers of different sizes")


def run(program, comm, tag, buffers, op_name, describe, abandon, look=None):
    """Run ``program`` (a plan's :class:`~.scheduler.Program`) over ``comm`` on
    ``buffers`` (a :class:`~collectives.transport.buffers.Buffers`), blocking until it
    has finished; ``tag`` is the call's base tag: each message's tag adds its size code
    (:mod:`.tags`). ``describe()`` names the call in errors. While it waits, ``look()``
    is called every ``LOOK_EVERY`` seconds (the engine's look for other ranks' failure
    notices, which raises :class:`TransportError` if one came), and the peers it waits
    for are probed for a message of the wrong size. On a message of the wrong size, an
    MPI error or an error from ``look``, cancels its receives in flight, hands every
    request still in flight to ``abandon`` (their buffers must stay alive) and raises
    the error (:class:`MessageSizeError` or :class:`TransportError`, naming the peer
    and step like the engine's)."""
    kinds, slices, peers = program.kinds, program.slices, program.peers
    ops = program.plan.ops
    arrays = buffers.arrays
    requests, owners, sizes = [], [], []
    statuses = []  # Testsome fills it: entry k is for the k-th finished request
    isend, irecv = comm.Isend, comm.Irecv
    layout = tags_module.layout()
    large = layout.large
    probes = None  # receives of large messages, posted once a probe has found their message (tags.Probes)
    strays = None  # made at the first look (tags.Strays)

    scheduler = program.blocking_scheduler()
    remembered = scheduler.remembered  # what a take hands out, by (finished before, finished now)
    done = at = 0  # the messages finished (bit i: operation i), now and at the last take
    everything = program.all_messages
    starting = program.opening  # later, what each poll's completions released
    patience = Patience(look)
    try:
        while True:
            if starting:
                for i in starting:
                    if kinds[i] == REDUCE:
                        dst, a, b = ops[i]
                        combine(op_name, arrays[a.buf][a.lo:a.hi], arrays[b.buf][b.lo:b.hi],
                                arrays[dst.buf][dst.lo:dst.hi])
                        continue
                    if kinds[i] >= LOCAL:
                        buffers.run_local(op_name, ops[i])
                        continue
                    s = slices[i]  # a message: post it
                    view = arrays[s.buf][s.lo:s.hi]
                    nbytes = view.nbytes
                    if kinds[i] == SEND:
                        requests.append(isend([view, MPI.BYTE], peers[i], tag + (nbytes if nbytes < large else large)))
                    elif nbytes < large:
                        requests.append(irecv([view, MPI.BYTE], peers[i], tag + nbytes))
                    else:
                        if probes is None:
                            probes = tags_module.Probes()
                        probes.add(comm, peers[i], tag + large, view, i)
                        requests.append(MPI.REQUEST_NULL)  # its place, until the probe finds the message
                    owners.append(i)
                    sizes.append(nbytes)
                starting = ()
            if done == everything:
                return
            if probes is not None and probes.entries and probes.poll(
                    lambda i, request: requests.__setitem__(owners.index(i), request),
                    lambda i, got, request, _source: _probed_wrong(i, got, request, owners, sizes, abandon, describe,
                                                                   peers, len(kinds))):
                patience.progressed()
            finished = MPI.Request.Testsome(requests, statuses)
            if not finished:
                if finished is None and not probes:  # every request has completed, yet operations remain
                    raise TransportError(f"{describe()} is unfinished with no message in flight "
                                         "(a bug in the library: please report it)")
                if patience.idle():  # it looked for failure notices: look for a message of the wrong size too
                    if strays is None:
                        strays = tags_module.Strays(comm, tag, layout)
                    posted = {i: j for j, i in enumerate(owners)}
                    unmatched = {entry[4] for entry in probes.entries} if probes else ()
                    pending = scheduler.pending(at)
                    _stray(strays, _awaited(program, lambda i: _slice_bytes(slices[i], arrays),
                                            lambda i, pending=pending, unmatched=unmatched, posted=posted:
                                            pending[i] > 0 or i in unmatched
                                            or (i in posted and requests[posted[i]] != MPI.REQUEST_NULL)),
                           describe, len(kinds))
                continue
            patience.progressed()
            for k, j in enumerate(finished):
                i = owners[j]
                if kinds[i] == RECV:
                    got = statuses[k].Get_count(MPI.BYTE)
                    if got != sizes[j]:
                        raise wrong_size(describe, i, len(kinds), peers[i], got, sizes[j])
                done |= 1 << i
            starting = remembered.get((at, done))
            if starting is None:
                starting = scheduler.take(at, done)
            at = done
    except MPI.Exception as exc:
        error = _mpi_error(exc, statuses, requests, owners, kinds, peers, describe)
        _give_up(requests, owners, kinds, abandon)
        raise error from exc
    except BaseException:  # a size error, a failed reduction, an interrupt: MPI must not keep our buffers
        _give_up(requests, owners, kinds, abandon)
        raise


def _slice_bytes(s, arrays):
    return (s.hi - s.lo) * arrays[s.buf].itemsize


def _probed_wrong(i, got, request, owners, sizes, abandon, describe, peers, steps):
    """A large receive's probe found a message of ``got`` bytes: raise (its scratch
    receive goes to ``abandon``: MPI keeps its buffer until it ends)."""
    abandon(request)
    raise wrong_size(describe, i, steps, peers[i], got, sizes[owners.index(i)])


def _awaited(program, size_of, incomplete):
    """:func:`~.tags.awaited` of the receives of ``program``: sizes ``size_of(i)``, not
    yet complete where ``incomplete(i)``."""
    kinds, peers = program.kinds, program.peers
    return tags_module.awaited((peers[i], size_of(i), i, not incomplete(i)) for i in range(len(kinds))
                               if kinds[i] == RECV)


def _stray(strays, expected, describe, steps):
    """Raise if ``strays`` (a :class:`~.tags.Strays`) finds a message of the wrong size."""
    found = strays.check(expected)
    if found is not None:
        peer, got, size, step = found
        raise wrong_size(describe, step, steps, peer, got, size)


def _mpi_error(exc, statuses, requests, owners, kinds, peers, describe):
    """The error to raise for MPI's exception ``exc``: where ``Testsome`` names a failed
    receive in its statuses, one naming its peer and step (a message longer than its
    receive, MPI's truncation error, is a :class:`MessageSizeError`, as the engine
    says); else a :class:`TransportError`."""
    peer = step = -1
    code = None
    if exc.Get_error_class() == MPI.ERR_IN_STATUS:
        for status in statuses:
            status_code = status.Get_error()
            if status_code not in (MPI.SUCCESS, MPI.ERR_PENDING):
                peer, code = status.Get_source(), status_code
                break
    if code is not None:
        pending = [i for request, i in zip(requests, owners)
                   if kinds[i] == RECV and peers[i] == peer and request != MPI.REQUEST_NULL]
        step = pending[0] + 1 if pending else -1
        where = f"step {step} of {len(kinds)}: " if pending else ""
        if MPI.Get_error_class(code) == MPI.ERR_TRUNCATE:
            error = too_long(describe, where, peer)
        else:
            error = TransportError(f"{describe()}: {where}MPI failed on the message from rank {peer}: "
                                   f"{MPI.Get_error_string(code)}")
    else:
        error = TransportError(f"{describe()}: MPI failed: {exc}")
    error.peer, error.step = peer, step
    return error


def _give_up(requests, owners, kinds, abandon):
    live = []
    for request, i in zip(requests, owners):
        if request != MPI.REQUEST_NULL:
            if kinds[i] == RECV:
                try:
                    request.Cancel()
                except MPI.Exception:
                    pass
            live.append(request)
    abandon(*live)


# -- persistent programs: small blocking calls without making a request per message ----
# A persistent program saves each message the making of its request (and mpi4py's reading
# of its buffer), about 1.5 us, and costs a copy of the input in and of the result out. So
# it pays up to a size that grows with the plan's messages: measured at 16-64 KiB
# (bench/results/xeon-2vcpu-mpich5/call-path-latency/), ring and recursive doubling allreduces ran
# 8-28% faster on it than on the lean executor at up to 8 KiB per message at 2 ranks,
# 14-32% slower at 16 KiB per message (at 4 ranks on 2 cores, 9-30% faster up to 16).
PERSISTENT_BYTES = 8 << 10  # calls on at most this many bytes per message of the plan (at least one)
PERSISTENT_MOST = 64 << 10  # and never more (as measured; each program keeps buffers of the call's size)


def persistent_limit(program):
    """The most bytes (per rank, the call's count) a blocking call of ``program`` (a
    :class:`~.scheduler.Program`) runs on a persistent program for."""
    return min(PERSISTENT_BYTES * max(1, program.messages), PERSISTENT_MOST)


class PersistentProgram:
    """A plan bound, once, to buffers of its own and to MPI persistent requests
    (``Send_init``/``Recv_init``): a small blocking call copies its input in, starts the
    requests the plan's order allows (``Start``, no request made, no buffer parsed),
    polls each with ``Test``, runs its local operations on views made once, and copies
    the result out. MPI costs about 1 µs to make a request and mpi4py as much to parse
    its buffer; a persistent request costs neither, so the call's fixed cost is a
    fraction of :func:`run`'s. Allocates nothing per call.

    Its messages carry fixed tags (a persistent request's tag is fixed): ``tag``, the
    base no per-call tag uses, plus each message's size code (:mod:`.tags`). Calls on
    it must be blocking and made one at a time, in the same order on every rank (a
    rank's earlier calls finished first), so that each peer's messages on those tags
    match in the order both sides post them. The caller makes that so: every rank runs
    such calls alone on that base, here or on :func:`run`, whose messages carry the
    same tags. A plan with a message too large for a tag to hold its size (``large``
    bytes: never with MPICH, Open MPI or Intel MPI's tags and these small calls) runs
    on :func:`run`, over the program's buffers, which probes for such messages.
    """

    def __init__(self, plan, comm, tag, dtype, in_count, out_count, inplace):
        self.plan = plan
        self.program = program_of(plan)
        self.out = np.empty(out_count, dtype)
        self.inp = self.out if inplace else np.empty(in_count, dtype)
        self.tmp = np.empty(plan.tmp, dtype)
        arrays = {"in": self.inp, "out": self.out, "tmp": self.tmp}
        kinds, slices = self.program.kinds, self.program.slices
        layout = tags_module.layout()
        self.requests = requests = [None] * len(plan.ops)
        self.sizes = [0] * len(plan.ops)
        work = [None] * len(plan.ops)  # each copy's (dst, src) and reduction's (dst, a, b) views; a fused one's op
        views = {}
        for i, op in enumerate(plan.ops):
            kind = kinds[i]
            if kind in (SEND, RECV):
                s = slices[i]
                views[i] = arrays[s.buf][s.lo : s.hi]
                self.sizes[i] = views[i].nbytes
            elif kind == REDUCE:
                work[i] = tuple(arrays[x.buf][x.lo : x.hi] for x in (op.dst, op.a, op.b))
            elif isinstance(op, Copy):
                work[i] = (arrays[op.dst.buf][op.dst.lo : op.dst.hi], arrays[op.src.buf][op.src.lo : op.src.hi])
            else:
                work[i] = op  # a fused reduction: Buffers.run_local
        buffers = Buffers(self.inp, self.out, self.tmp)
        self.buffers = buffers
        self.comm, self.tag = comm, tag
        if any(nbytes >= layout.large for nbytes in self.sizes):  # no persistent requests: run() runs it
            self.run = functools.partial(self._run_lean, comm, tag)
        else:
            for i, view in views.items():
                start = comm.Send_init if kinds[i] == SEND else comm.Recv_init
                requests[i] = start([view, MPI.BYTE], plan.ops[i].peer, layout.tag(tag, view.nbytes))
        self.in_flight = []  # the requests started and not yet found complete
        op_name = self._op_name = ["sum"]  # the running call's op

        def local(i):
            views = work[i]
            if type(views) is not tuple:
                buffers.run_local(op_name[0], views)
            elif len(views) == 3:
                combine(op_name[0], views[1], views[2], views[0])
            else:
                views[0][...] = views[1]  # (np.copyto is a Python wrapper: this is the small calls' path)

        self._local = local
        self.status = MPI.Status()
        self.broken = False

    def _run_lean(self, comm, tag, op_name, describe, look=None):
        """:meth:`run` for a plan with a large message: :func:`run` on the program's buffers."""
        if self.broken:
            raise TransportError(f"{describe()}: an earlier call on this program failed")
        try:
            run(self.program, comm, tag, self.buffers, op_name, describe, retired.abandon, look)
        except BaseException:
            self.broken = True
            raise

    def run(self, op_name, describe, look=None):
        """Run the plan once on the program's buffers (the input copied in first, by
        the caller). Raises like :func:`run`; a failed program is not run again."""
        if self.broken:
            raise TransportError(f"{describe()}: an earlier call on this program failed")
        requests, status, sizes, in_flight = self.requests, self.status, self.sizes, self.in_flight
        kinds, peers = self.program.kinds, self.program.peers
        self._op_name[0] = op_name
        del in_flight[:]
        scheduler = self.program.blocking_scheduler()
        remembered = scheduler.remembered  # what a take hands out, by (finished before, finished now)
        done = at = 0  # the messages finished (bit i: operation i), now and at the last take
        everything = self.program.all_messages
        starting = self.program.opening  # later, what each poll's completions released
        local = self._local
        patience = Patience(look)
        strays = None  # made at the first look (tags.Strays)
        i = -1  # the operation being tested, for MPI's errors
        try:
            while True:
                if starting:
                    for i in starting:
                        if kinds[i] >= LOCAL:
                            local(i)
                        else:
                            requests[i].Start()  # no request made, no buffer parsed
                            in_flight.append(i)
                    starting = ()
                if done == everything:
                    return
                progressed = False
                k = 0
                while k < len(in_flight):
                    i = in_flight[k]
                    if not requests[i].Test(status):
                        k += 1
                        continue
                    if kinds[i] == RECV and status.Get_count(MPI.BYTE) != sizes[i]:
                        raise wrong_size(describe, i, len(kinds), peers[i], status.Get_count(MPI.BYTE), sizes[i])
                    del in_flight[k]
                    done |= 1 << i
                    progressed = True
                if progressed:
                    patience.progressed()
                    starting = remembered.get((at, done))
                    if starting is None:
                        starting = scheduler.take(at, done)
                    at = done
                elif patience.idle():  # it looked for failure notices: look for a message of the wrong size too
                    if strays is None:
                        strays = tags_module.Strays(self.comm, self.tag, tags_module.layout())
                    pending = scheduler.pending(at)
                    _stray(strays, _awaited(self.program, sizes.__getitem__,
                                            lambda i, pending=pending: pending[i] > 0 or i in in_flight),
                           describe, len(kinds))
        except MPI.Exception as exc:
            self._give_up(in_flight)
            peer = peers[i] if i >= 0 and kinds[i] == RECV else -1
            if peer >= 0 and exc.Get_error_class() == MPI.ERR_TRUNCATE:
                error = too_long(describe, f"step {i + 1} of {len(kinds)}: ", peer)
            else:
                error = TransportError(f"{describe()}: MPI failed: {exc}")
            error.peer, error.step = peer, (i + 1 if peer >= 0 else -1)
            raise error from exc
        except BaseException:  # a size error, a failed reduction, an interrupt
            self._give_up(in_flight)
            raise

    def _give_up(self, in_flight):
        """After a failure: cancel the receives still active; the program is never run
        again (its requests may still be matched by the peers' messages)."""
        self.broken = True
        for i in in_flight:
            if self.program.kinds[i] == RECV:
                try:
                    self.requests[i].Cancel()
                except MPI.Exception:
                    pass

    def free(self):
        """Release the persistent requests. After a failure some may still be active:
        those are kept instead, with their buffers, until MPI has finished with them
        (:func:`.retired.abandon`)."""
        requests = [request for request in self.requests or () if request is not None]
        if self.broken:
            retired.abandon(*requests)
        else:
            for request in requests:
                request.Free()
        self.requests = None  # freed: a lean-path entry that still names it makes a new one
