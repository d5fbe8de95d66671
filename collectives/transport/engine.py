"""The state machine that runs one rank's :class:`~collectives.schedule.Plan`.

It starts every operation as soon as the plan allows: local operations (reduce, copy)
run at once through ``run_local``; sends, receives and fences are handed to ``post``
and reported back with :meth:`Execution.complete` when the transport sees them finish.
Operations that become ready together start in program order.
"""

import heapq

from ..schedule import Fence, Recv, Send


class Execution:
    def __init__(self, plan, run_local, post):
        self.plan = plan
        self.pending = plan.initial_pending()
        self.remaining = len(plan.ops)
        self._run_local = run_local
        self._post = post

    @property
    def done(self):
        return self.remaining == 0

    def start(self):
        self._run([i for i, n in enumerate(self.pending) if n == 0])

    def complete(self, index):
        """A send or receive that was posted has finished."""
        self.remaining -= 1
        self._run(self._release(self.plan.dependents[index]))

    def _release(self, indices):
        ready = []
        pending = self.pending
        for j in indices:
            pending[j] -= 1
            if pending[j] == 0:
                ready.append(j)
        return ready

    def _run(self, ready):
        heapq.heapify(ready)
        ops, plan = self.plan.ops, self.plan
        while ready:
            i = heapq.heappop(ready)
            op = ops[i]
            if isinstance(op, (Send, Recv, Fence)):
                self._post(i)
                nxt = plan.fifo_next[i]
                if nxt >= 0:
                    for j in self._release((nxt,)):
                        heapq.heappush(ready, j)
            else:
                self._run_local(i)
                self.remaining -= 1
                for j in self._release(plan.dependents[i]):
                    heapq.heappush(ready, j)
