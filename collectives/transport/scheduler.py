"""The one scheduling rule every executor of plans follows, written once.

    start an operation as soon as nothing it waits on is pending, the ready ones in
    program order; a local operation (copy, reduction) runs at once; a message is
    posted, and to each peer in the order of the schedule (posting one releases the
    next to the same peer, so MPI, which matches a pair's messages in posting order,
    matches them as the plan pairs them)

A :class:`Program` is a plan's tables for that rule, made once per plan. A
:class:`Scheduler` runs it for one call: :meth:`Scheduler.run` starts everything that
is ready (``local(i)`` runs operation i, ``post(i)`` posts message i), or
:meth:`Scheduler.turn` hands the same operations, in the same order, to the
executor's own loop (the blocking executors' way: no Python call per operation), and
:meth:`Scheduler.complete` tells it a posted message has finished. The executors
differ only in how they post and learn of completions: the progress engine's plan
handles (:mod:`.mpi`, ``Isend``/``Irecv``, completions from its ``Testsome``), the
lean executor and persistent programs (:mod:`.lean`: ``Isend``/``Irecv``, or ``Start``
on requests made once), the device executor (:mod:`.device`) and the in-process runner
(:mod:`.local`).
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
    how many operations each waits for, the ones ready at the start (a heap already:
    ascending), and the plan's ``dependents`` and ``fifo_next``."""

    __slots__ = ("_blocking", "count", "dependents", "fifo_next", "kinds", "peers", "pending", "plan", "ready",
                 "slices")

    def __init__(self, plan: Plan):
        self.plan = plan
        self.kinds = tuple(SEND if isinstance(op, Send) else RECV if isinstance(op, Recv)
                           else FENCE if isinstance(op, Fence) else REDUCE if isinstance(op, Reduce)
                           else LOCAL for op in plan.ops)
        self.slices = tuple(op.src if isinstance(op, Send) else op.dst if isinstance(op, Recv) else None
                            for op in plan.ops)
        self.peers = tuple(getattr(op, "peer", -1) for op in plan.ops)
        self.pending = tuple(plan.initial_pending())
        self.ready = [i for i, n in enumerate(self.pending) if n == 0]
        self.dependents = plan.dependents
        self.fifo_next = plan.fifo_next
        self.count = len(plan.ops)
        self._blocking: Scheduler | None = None

    def blocking_scheduler(self) -> Scheduler:
        """A :class:`Scheduler` of this program restarted for a new call, the one kept for
        the blocking executor (one call at a time: it runs a call to its end, or the call
        fails, before the next starts)."""
        scheduler = self._blocking
        if scheduler is None:
            scheduler = self._blocking = Scheduler(self)
        else:
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
    ``remaining``: the operations not yet finished (0: the call is done)."""

    __slots__ = ("dependents", "fifo_next", "kinds", "pending", "program", "ready", "remaining")

    def __init__(self, program: Program):
        self.program = program
        self.kinds = program.kinds
        self.dependents = program.dependents
        self.fifo_next = program.fifo_next
        self.pending = list(program.pending)
        self.ready = program.ready[:]
        self.remaining = program.count

    def restart(self) -> None:
        """Make this scheduler a new call's, from the start (an executor that runs the
        same program call after call keeps one)."""
        program = self.program
        self.pending[:] = program.pending
        self.ready[:] = program.ready
        self.remaining = program.count

    @property
    def done(self) -> bool:
        return self.remaining == 0

    def run(self, local: Callable[[int], object], post: Callable[[int], object]) -> None:
        """Start every ready operation, and whatever that releases in turn: ``local(i)``
        runs a copy or reduction (finished when it returns); ``post(i)`` posts a send,
        receive or fence (finished at :meth:`complete`)."""
        kinds = self.kinds
        for i in self.turn():
            if kinds[i] >= LOCAL:
                local(i)
            else:
                post(i)

    def turn(self) -> Iterator[int]:
        """:meth:`run` for an executor that runs each operation in its own loop: yields
        every ready operation in turn; the caller runs a local one, or posts a message,
        before it asks for the next (which may be what that released)."""
        ready, pending, kinds, dependents, fifo_next = self.ready, self.pending, self.kinds, self.dependents, \
            self.fifo_next
        while ready:
            i = heappop(ready) if len(ready) > 1 else ready.pop()
            yield i
            if kinds[i] >= LOCAL:
                self.remaining -= 1
                released = dependents[i]
            else:
                nxt = fifo_next[i]
                if nxt < 0:
                    continue
                released = (nxt,)
            for j in released:
                pending[j] -= 1
                if pending[j] == 0:
                    heappush(ready, j)

    def complete(self, i: int) -> None:
        """Posted operation ``i`` has finished: what waited for it may be ready (call
        :meth:`run` to start it)."""
        self.remaining -= 1
        pending = self.pending
        for j in self.dependents[i]:
            pending[j] -= 1
            if pending[j] == 0:
                heappush(self.ready, j)
