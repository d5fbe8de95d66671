"""Run every rank's plan of a collective inside one process, without MPI.

Messages between two ranks match in posting order, as MPI's do on one tag. This is the
seed of the simulator (``collectives.sim``, a later issue) and lets the tests check
every algorithm at many world sizes in seconds. It runs the very same plans as the
MPI transport.
"""

from collections import deque

import numpy as np

from ..errors import CollectiveError
from ..schedule import Send
from .buffers import Buffers
from .engine import Execution


def run(plans, inputs, outputs, op, dtype):
    """Run ``plans[r]`` with ``inputs[r]`` / ``outputs[r]`` (flat arrays) for every rank.

    Raises :class:`CollectiveError` if the ranks' messages do not fit together
    (a length mismatch, or a deadlock).
    """
    size = len(plans)
    buffers = [Buffers(inputs[r], outputs[r], np.empty(plans[r].tmp, dtype)) for r in range(size)]
    sends, recvs = {}, {}
    finished = deque()

    def poster(rank):
        def post(i):
            op_ = plans[rank].ops[i]
            if isinstance(op_, Send):
                key = (rank, op_.peer)
                sends.setdefault(key, deque()).append(i)
            else:
                key = (op_.peer, rank)
                recvs.setdefault(key, deque()).append(i)
            match(key)

        return post

    def match(key):
        src, dst = key
        outgoing, incoming = sends.get(key), recvs.get(key)
        while outgoing and incoming:
            i, j = outgoing.popleft(), incoming.popleft()
            data = buffers[src].view(plans[src].ops[i].src)
            target = buffers[dst].view(plans[dst].ops[j].dst)
            if data.size != target.size:
                raise CollectiveError(
                    f"rank {src} sent {data.size} elements but rank {dst} expected {target.size}"
                )
            target[...] = data
            finished.append((src, i))
            finished.append((dst, j))

    executions = []
    for r in range(size):
        run_local = (lambda b, p: lambda i: b.run_local(op, p.ops[i]))(buffers[r], plans[r])
        executions.append(Execution(plans[r], run_local, poster(r)))
    for execution in executions:
        execution.start()
    while finished:
        rank, i = finished.popleft()
        executions[rank].complete(i)
    stuck = [r for r, e in enumerate(executions) if not e.done]
    if stuck:
        raise CollectiveError(f"ranks {stuck} never finished: the schedules deadlock")
    return [b.arrays["tmp"] for b in buffers]
