"""Run every rank's plan of a collective inside one process, without MPI.

Messages between two ranks match in posting order, as MPI's do on one tag. It lets the
tests check every algorithm at many world sizes in seconds, and it runs the very same
plans as the MPI transport (as the simulator, ``collectives.sim``, times them).
"""

from collections import deque

import numpy as np

from ..errors import CollectiveError
from ..schedule import Fence, Send
from .buffers import Buffers
from .scheduler import Scheduler, program_of


def run(plans, inputs, outputs, op, dtype, registered=None, routed=None):
    """Run ``plans[r]`` with ``inputs[r]`` / ``outputs[r]`` (flat arrays) for every rank.
    ``registered``: the array the plans' ``reg`` slices address (every rank's input,
    where the inputs are registered buffers: views of it); ``routed`` likewise the one
    their ``rout`` slices address (every rank's output, the outputs views of it).

    Raises :class:`CollectiveError` if the ranks' messages do not fit together
    (a length mismatch, or a deadlock).
    """
    size = len(plans)
    shared = np.empty(max(plan.shm for plan in plans), dtype)  # one window, every rank's view of it
    buffers = [Buffers(inputs[r], outputs[r], np.empty(plans[r].tmp, dtype), shared, registered, routed)
               for r in range(size)]
    sends, recvs = {}, {}
    fences = [deque() for _ in range(size)]  # each rank's fences reached, not yet passed
    finished = deque()

    def poster(rank):
        def post(i):
            op_ = plans[rank].ops[i]
            if isinstance(op_, Fence):  # passed once every rank has reached its next one
                fences[rank].append(i)
                if all(fences):
                    finished.extend((r, waiting.popleft()) for r, waiting in enumerate(fences))
                return
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

    schedulers = [Scheduler(program_of(plan)) for plan in plans]
    locals_ = [(lambda b, p: lambda i: b.run_local(op, p.ops[i]))(buffers[r], plans[r]) for r in range(size)]
    posts = [poster(r) for r in range(size)]
    for r, scheduler in enumerate(schedulers):
        scheduler.run(locals_[r], posts[r])
    while finished:
        rank, i = finished.popleft()
        schedulers[rank].complete(i)
        schedulers[rank].run(locals_[rank], posts[rank])
    stuck = [r for r, s in enumerate(schedulers) if not s.done]
    if stuck:
        raise CollectiveError(f"ranks {stuck} never finished: the schedules deadlock")


def run_collective(collective, algorithm, inputs, op="sum", root=0, segment=1, inplace=False, plans=None,
                   counts=None, registered=False):
    """Run ``collective`` with ``algorithm`` for ``len(inputs)`` virtual ranks in this
    process and return each rank's result as the Communicator would shape it (flat;
    ``None`` for the non-roots of reduce and gather). ``inputs[r]`` is rank r's flat
    array; for scatter only the root's counts (``len(inputs)`` blocks); for alltoall each
    holds ``len(inputs)`` blocks; for alltoallv ``counts[i][j]`` elements go from rank i
    to rank j.
    ``plans``: every rank's compiled plan, if the caller has built them already.
    ``registered``: the inputs are registered buffers (copied into one array, rank r's
    from ``r * count``, as ``Communicator.empty`` places them; the plans address it as
    ``reg`` with stride ``count``, offset 0); a collective that can run in place then does.
    The peer-read algorithms (``PEER_READS``) always read their inputs so, in place or not,
    and where a plan writes other ranks' outputs (``rout``), every rank's lies in one
    array, rank r's from ``r·rout_stride``.
    """
    # Imported here: the algorithm registry imports nothing from the transports.
    from .. import ops as ops_layer
    from ..algorithms import PEER_READS, build
    from ..schedule import compile_plan
    from ..specs import SPECS

    spec = SPECS[collective]
    peers = (collective, algorithm) in PEER_READS
    size = len(inputs)
    count = inputs[root].size // size if spec.root_input or spec.blocked else inputs[0].size
    dtype = inputs[root].dtype
    inputs = [np.ascontiguousarray(x).reshape(-1) for x in inputs]
    shared = None
    if counts is not None:
        counts = np.asarray(counts)
    registered = registered or peers
    if registered:
        inplace = inplace or (spec.inplace and not peers)
        shared = np.concatenate(inputs) if inputs[0].size else np.empty(0, dtype)
        inputs = [shared[r * count : (r + 1) * count] for r in range(size)]  # fresh copies already
    if spec.one_buffer:
        inputs = inputs if registered else [x.copy() for x in inputs]
        outputs = inputs
        inplace = True
    elif inplace:
        inputs = inputs if registered else [x.copy() for x in inputs]
        outputs = [x if not spec.root_result or r == root else x[:0] for r, x in enumerate(inputs)]
    else:
        outputs = [np.empty(spec.result_count(count, size, r, root, counts), dtype) for r in range(size)]
    if plans is None:
        plans = [
            compile_plan(build(collective, algorithm, r, size, count, root=root, segment=segment,
                               counts=None if counts is None else (tuple(counts[r].tolist()),
                                                                   tuple(counts[:, r].tolist())),
                               registered=(count, 0) if registered else None, inplace=inplace),
                         inplace=inplace)
            for r in range(size)
        ]
    routed = None
    stride = max(plan.rout_stride for plan in plans)
    if stride:  # a leader's plans: every rank's output in one array, rank r's from r·stride
        if inplace and stride == count:
            routed = shared  # the outputs are the inputs
        else:
            routed = np.empty(size * stride, dtype)
            outputs = [routed[r * stride : r * stride + out.size] for r, out in enumerate(outputs)]
    run(plans, inputs, outputs, op, dtype, shared, routed)
    if spec.reduces:
        for r, out in enumerate(outputs):
            if not spec.root_result or r == root:
                ops_layer.finish(op, out, size)
    if spec.root_result:
        return [out if r == root else None for r, out in enumerate(outputs)]
    return outputs
