"""The one scheduling rule every executor of plans follows, written once.

    start an operation as soon as nothing it waits on is pending, the ready ones in
    program order; a local operation (copy, reduction) runs at once; a message is
    posted, and to each peer in the order of the schedule (posting one releases the
    next to the same peer, so MPI, which matches a pair's messages in posting order,
    matches them as the plan pairs them)

A :class:`Program` is a plan's tables for that rule, made once per plan, with its
*opening*: what a call starts before any message has finished (the same at every call,
so worked out once). A :class:`Scheduler` runs it for one call: :meth:`Scheduler.take`
hands the operations to start now, in order (the opening first, then what each
:meth:`Scheduler.complete` of a posted message released), to the executor's own loop
(the blocking executors' way: no Python call per operation), or
:meth:`Scheduler.run` runs them (``local(i)`` runs operation i, ``post(i)`` posts
message i). The executors differ only in how they post and learn of completions: the
progress engine's plan handles (:mod:`.mpi`, ``Isend``/``Irecv``, completions from its
``Testsome``), the lean executor and persistent programs (:mod:`.lean`:
``Isend``/``Irecv``, or ``Start`` on requests made once), the device executor
(:mod:`.device`) and the in-process runner (:mod:`.local`).

The blocking executors run a program's calls one at a time, the same calls again and
again, so they take through a :class:`BlockingScheduler`: what a take hands out depends
only on which messages had finished at the previous take and which have now, so it is
worked out once, by a :class:`Scheduler`, and remembered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from heapq import heappop, heappush

from ..schedule import Copy, Fence, Plan, Recv, Reduce, Send

# What each operation is: the messages (posted, completed later) below LOCAL, the local
# operations (run at once) from it.
SEND, RECV, FENCE, LOCAL, REDUCE = 0, 1, 2, 3, 4  # LOCAL: a copy or a fused reduction; REDUCE: a two-input one


class Program:
    """A plan's tables: what each operation is, which slice a message moves, its peer,
    the plan's ``dependents`` and ``fifo_next``, and what starting each operation
    releases (``releases``: a local operation's dependents, a message's next message
    to the same peer); and its ``opening`` (the operations a call starts before any
    message has finished, in order) with the state it leaves: how many operations each
    still waits for (``pending``), the ready ones (``ready``: none, the opening took
    them all), the operations not yet taken (``untaken``) and the messages (all of
    them not yet finished: ``messages``)."""

    __slots__ = ("_blocking", "all_messages", "dependents", "fifo_next", "kinds", "messages", "opening", "peers",
                 "pending", "plan", "ready", "releases", "slices", "untaken")

    def __init__(self, plan: Plan):
        self.plan = plan
        self.kinds = kinds = tuple(SEND if isinstance(op, Send) else RECV if isinstance(op, Recv)
                                   else FENCE if isinstance(op, Fence) else REDUCE if isinstance(op, Reduce)
                                   else LOCAL for op in plan.ops)
        self.slices = tuple(op.src if isinstance(op, Send) else op.dst if isinstance(op, Recv) else None
                            for op in plan.ops)
        self.peers = tuple(getattr(op, "peer", -1) for op in plan.ops)
        self.dependents = plan.dependents
        self.fifo_next = plan.fifo_next
        # A local operation finishes as it starts, releasing what waits for it; posting a
        # message releases the next one to the same peer (what waits for the message
        # itself is released when it finishes: Scheduler.complete).
        self.releases = tuple(plan.dependents[i] if kind >= LOCAL else (plan.fifo_next[i],) if plan.fifo_next[i] >= 0
                              else () for i, kind in enumerate(kinds))
        self.messages = sum(kind < LOCAL for kind in kinds)
        self.all_messages = sum(1 << i for i, kind in enumerate(kinds) if kind < LOCAL)  # as a finished set
        self._blocking: BlockingScheduler | None = None
        # The state at the start (a heap already: ascending), then the opening taken from it once.
        self.pending = tuple(plan.initial_pending())
        self.ready = [i for i, n in enumerate(self.pending) if n == 0]
        self.untaken = len(plan.ops)
        self.opening: tuple[int, ...] = ()
        first = Scheduler(self)
        self.opening = tuple(first.take())
        self.pending, self.ready, self.untaken = tuple(first.pending), first.ready, first.untaken

    def blocking_scheduler(self) -> BlockingScheduler:
        """The program's :class:`BlockingScheduler`, restarted for a new call (one call at
        a time: the blocking executors run a call to its end, or the call fails, before
        the next starts)."""
        scheduler = self._blocking
        if scheduler is None:
            scheduler = self._blocking = BlockingScheduler(self)
        scheduler.restart()
        return scheduler

    def is_copy(self, i: int) -> bool:
        return isinstance(self.plan.ops[i], Copy)


def program_of(plan: Plan) -> Program:
    """``plan``'s :class:`Program`, made at its first use and kept with the plan."""
    program = plan.__dict__.get("_program")
    if program is None:
        program = Program(plan)
        object.__setattr__(plan, "_program", program)  # the plan is frozen; this is a cache beside it
    return program


class Scheduler:
    """One call's run of a :class:`Program` (see the module's docstring).
    ``remaining``: the messages not yet finished; ``untaken``: the operations not yet
    handed out. Once no message remains, the take that follows the last completion
    hands out every operation left (a plan has no cycle): an executor that runs what it
    takes before it looks at ``remaining`` is done when ``remaining`` is 0."""

    __slots__ = ("dependents", "opening", "pending", "program", "ready", "releases", "remaining", "untaken")

    def __init__(self, program: Program):
        self.program = program
        self.dependents = program.dependents
        self.releases = program.releases
        self.pending = list(program.pending)
        self.ready = program.ready[:]
        self.untaken = program.untaken
        self.remaining = program.messages
        self.opening = program.opening  # what the first take() hands out

    def restart(self) -> None:
        """Set back to the start of a call."""
        program = self.program
        self.pending[:] = program.pending
        self.ready[:] = program.ready
        self.untaken, self.remaining, self.opening = program.untaken, program.messages, program.opening

    @property
    def done(self) -> bool:
        return self.remaining == 0 and self.untaken == 0

    def run(self, local: Callable[[int], object], post: Callable[[int], object]) -> None:
        """Start every operation :meth:`take` hands out: ``local(i)`` runs a copy or
        reduction (finished when it returns); ``post(i)`` posts a send, receive or fence
        (finished at :meth:`complete`)."""
        kinds = self.program.kinds
        for i in self.take():
            if kinds[i] >= LOCAL:
                local(i)
            else:
                post(i)

    def take(self) -> tuple[int, ...] | list[int]:
        """:meth:`run` for an executor that runs each operation in its own loop: every
        operation to start now, in order, and whatever each releases (a local operation
        counts as finished, a message as posted); the caller runs the local ones and
        posts the messages, in that order. The first take of a call is the program's
        opening, worked out once; later ones hand out what :meth:`complete` released."""
        opening = self.opening
        if opening:
            self.opening = ()
            return opening
        ready, pending, releases = self.ready, self.pending, self.releases
        taken = []
        while ready:
            i = heappop(ready) if len(ready) > 1 else ready.pop()
            taken.append(i)
            for j in releases[i]:
                pending[j] -= 1
                if pending[j] == 0:
                    heappush(ready, j)
        self.untaken -= len(taken)
        return taken

    def complete(self, i: int) -> None:
        """Posted operation ``i`` has finished: what waited for it may be ready (the
        next :meth:`take` or :meth:`run` starts it)."""
        self.remaining -= 1
        pending = self.pending
        for j in self.dependents[i]:
            pending[j] -= 1
            if pending[j] == 0:
                heappush(self.ready, j)


def _members(finished: int) -> Iterator[int]:
    """The operations in the finished set ``finished`` (a bit mask), in order."""
    while finished:
        low = finished & -finished
        yield low.bit_length() - 1
        finished ^= low


class BlockingScheduler:
    """A program's scheduler for the blocking executors, which run its calls one at a
    time, the same calls over and over. A call is described by the sets of messages
    finished (bit masks, bit i for operation i): it starts with the program's
    ``opening`` (finished set 0), and after each poll that found messages finished,
    :meth:`take` hands out what to start now. What that is depends on nothing but the
    sets finished at the previous take and at this one (each take starts everything
    the finished messages allow, and the heap hands out the ready ones in order), so it
    is worked out once, by a :class:`Scheduler`, and kept in ``remembered``, keyed by
    ``(finished before, finished now)``: an executor looks there first (a dictionary
    look-up, no Python call) and calls :meth:`take` only where it finds nothing. Once
    ``MEMO`` transitions are kept (a program whose messages finish in many orders), it
    keeps no more and empties ``remembered``: every take then runs on a live
    :class:`Scheduler`, as the engine's do."""

    MEMO = 256  # transitions kept at most

    __slots__ = ("live", "live_at", "program", "remembered", "remembering")

    def __init__(self, program: Program):
        self.program = program
        self.remembered: dict[tuple[int, int], tuple[int, ...]] = {}
        self.remembering = True
        self.live: Scheduler | None = None  # a Scheduler in the state of a call whose last take was at live_at
        self.live_at = -1

    def restart(self) -> None:
        """Set back to the start of a call, its opening taken (the caller starts the
        program's ``opening`` itself)."""
        if self.remembering:
            self.live_at = -1  # the live scheduler, if any, is stale: take() replays
        else:  # every take on the live scheduler: set it back, past the opening
            if self.live is None:
                self.live = Scheduler(self.program)
            else:
                self.live.restart()
            self.live.opening = ()
            self.live_at = 0

    def take(self, before: int, finished: int) -> tuple[int, ...]:
        """Every operation to start now, in order (the caller runs the local ones and
        posts the messages, in that order): ``finished`` is the set of messages
        finished now, ``before`` the set at the previous take (0: the opening). Once
        ``finished`` holds every message (the program's ``all_messages``), this hands
        out every operation left: the call is done when it has run them."""
        live = self.live
        if live is None or self.live_at != before:  # (a new call, or a remembered take since)
            live = self.live = self._replayed(before)
        for i in _members(finished & ~before):
            live.complete(i)
        taken = tuple(live.take())
        self.live_at = finished
        if self.remembering:
            if len(self.remembered) < self.MEMO:
                self.remembered[before, finished] = taken
            else:  # messages finish in too many orders to remember
                self.remembering = False
                self.remembered.clear()
        return taken

    def _replayed(self, finished: int) -> Scheduler:
        """A :class:`Scheduler` in the state of a call whose last take was at ``finished``."""
        scheduler = Scheduler(self.program)
        scheduler.opening = ()  # the state after the opening, where it starts
        for i in _members(finished):
            scheduler.complete(i)
        scheduler.take()
        return scheduler

    def pending(self, finished: int) -> list[int]:
        """How many operations each operation still waits for, in a call whose last take
        was at ``finished``."""
        live = self.live if self.live is not None and self.live_at == finished else self._replayed(finished)
        return live.pending
