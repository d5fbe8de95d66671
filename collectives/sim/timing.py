"""The completion time of every rank's plan under the α-β-γ model.

The model (also in the package docstring and docs/algorithms.md):

- A message of m bytes from rank s to rank d takes ``α + m·β`` once it has started.
  It starts when both sides have posted it (the send's data is ready and the receive's
  slice is free, as the plan's dependencies say; messages between two ranks start in
  the order the plans list them) and as soon as s's send port and d's receive port are
  free: a rank sends one message and receives one at a time, both at once.
- With a two-level topology (``ranks_per_node``), ranks ``k·r … k·r + k - 1`` share a
  node; or, with one node label per rank (``ranks_per_node=[0, 0, 0, 1]``, as the
  plans' ``nodes=`` takes), the ranks of equal labels do: uneven and interleaved
  layouts. A message between nodes costs ``inter_alpha + m·inter_beta`` and also holds
  the sending node's outgoing link and the receiving node's incoming link, so the
  ranks of a node take turns on the network.
- A reduction of m bytes takes ``m·γ`` on its rank's processor, one at a time, while
  the rank's messages go on. Copies cost nothing (the model has no memory-copy term),
  except a copy to or from the node's shared window or another rank's registered
  buffer (the shared-memory algorithms), which carries their data and takes ``m·β`` on
  the processor, like a message's bytes.
- A fence (shared-memory algorithms) ends ``α`` after the last rank has reached it.
- Everything starts as soon as the plan allows; where several messages could take a
  port, the one that was ready first gets it (ties: the sender's earlier operation,
  then the lower rank). Completion is the time the last rank finishes.

This is list scheduling over the plans' dependency graphs: the critical path through
the schedule, with port contention on it.
"""

import bisect
import heapq
import math
import numbers
from dataclasses import dataclass

from ..schedule import Copy, Fence, Recv, Reduce, Send
from ..topology import Topology

_SEND, _RECV, _REDUCE, _COPY, _FENCE = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class Model:
    """The parameters of the α-β-γ model, in seconds and seconds per byte."""

    alpha: float
    beta: float
    gamma: float
    ranks_per_node: object = None  # an int, or one node label per rank (a tuple)
    inter_alpha: float | None = None
    inter_beta: float | None = None

    def __post_init__(self):
        for name in ("alpha", "beta", "gamma", "inter_alpha", "inter_beta"):
            value = getattr(self, name)
            if value is None and name.startswith("inter"):
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0 (seconds); got {value!r}")
        rpn = self.ranks_per_node
        if isinstance(rpn, (list, tuple)):
            if not rpn or any(isinstance(label, (list, tuple, dict, set)) for label in rpn):
                raise ValueError(f"ranks_per_node as a list needs one node label per rank; got {rpn!r}")
            object.__setattr__(self, "ranks_per_node", tuple(rpn))  # frozen, and hashable
        elif rpn is not None and (isinstance(rpn, bool) or not isinstance(rpn, numbers.Integral) or rpn < 1):
            raise ValueError(f"ranks_per_node must be a positive integer, one node label per rank, or None; "
                             f"got {rpn!r}")
        if rpn is None and (self.inter_alpha is not None or self.inter_beta is not None):
            raise ValueError("inter_alpha and inter_beta need ranks_per_node (how many ranks share a node)")


class Graph:
    """Every rank's plan in the arrays the timing loop reads, with each send matched
    to its receive. Built once per simulated call and reused for every :meth:`time`.

    With ``world_size`` larger than the number of plans, the plans are those of ranks
    0 … s-1 of a call whose rank r runs the plan of rank r mod s with every peer q read
    as q + (r - r mod s) (mod p): a rotation-symmetric algorithm, s = 1, or s = the ranks
    per node of a two-level model. Every rank then does what its representative does,
    at the same times, so the representatives alone give the call's time: a message
    to rank q is one to q's representative (q mod s), whose ports and node links stand
    for q's. ``peers`` hold representatives; ``real_peers`` the ranks themselves."""

    def __init__(self, plans, itemsize, world_size=None):
        self.plans = plans
        self.world_size = len(plans) if world_size is None else int(world_size)
        reps = len(plans)
        if self.world_size % reps:
            raise ValueError(f"{reps} representative plans cannot stand for {self.world_size} ranks")
        self.kinds, self.nbytes, self.peers, self.real_peers = [], [], [], []
        for plan in plans:
            kinds, nbytes, peers = [], [], []
            for op in plan.ops:
                if isinstance(op, Send):
                    kinds.append(_SEND), nbytes.append((op.src.hi - op.src.lo) * itemsize), peers.append(op.peer)
                elif isinstance(op, Recv):
                    kinds.append(_RECV), nbytes.append((op.dst.hi - op.dst.lo) * itemsize), peers.append(op.peer)
                elif isinstance(op, Reduce):
                    kinds.append(_REDUCE), nbytes.append((op.dst.hi - op.dst.lo) * itemsize), peers.append(-1)
                elif isinstance(op, Fence):
                    kinds.append(_FENCE), nbytes.append(0), peers.append(-1)
                else:
                    assert isinstance(op, Copy)
                    shared = op.dst.buf in ("shm", "reg", "rout") or op.src.buf in ("shm", "reg", "rout")
                    kinds.append(_COPY), nbytes.append((op.dst.hi - op.dst.lo) * itemsize * shared), peers.append(-1)
            self.kinds.append(kinds)
            self.nbytes.append(nbytes)
            self.real_peers.append(peers)
            self.peers.append([q % reps if q >= 0 else q for q in peers])
        self.match = self._match()

    def _match(self):
        """``match[r][i]`` = the index of the receive (at the peer) that send ``i`` of
        rank ``r`` meets, or of the send that receive ``i`` meets: the k-th message
        from s to d meets d's k-th receive from s, as MPI's ordering on one tag says.
        With representatives, rank q's k-th receive from rank a is its
        representative's k-th receive from a - (q - q mod s)."""
        reps, p = len(self.plans), self.world_size
        sends, recvs = {}, {}  # (sender, receiver) -> op indices, in each one's own frame
        for rank, kinds in enumerate(self.kinds):
            for i, kind in enumerate(kinds):
                if kind == _SEND:
                    sends.setdefault((rank, self.real_peers[rank][i]), []).append(i)
                elif kind == _RECV:
                    recvs.setdefault((self.real_peers[rank][i], rank), []).append(i)
        match = [[-1] * len(kinds) for kinds in self.kinds]
        for (src, dst), out in sends.items():  # dst seen from its representative: (src - shift, dst - shift)
            shift = dst - dst % reps
            rep_src, rep_dst = (src - shift) % p, dst % reps
            into = recvs.get((rep_src, rep_dst), [])
            if len(out) != len(into):
                raise ValueError(f"rank {src} sends {len(out)} messages to rank {dst}, which receives {len(into)}")
            for i, j in zip(out, into):
                if self.nbytes[src][i] != self.nbytes[rep_dst][j]:
                    raise ValueError(f"rank {src} sends {self.nbytes[src][i]} bytes to rank {dst}, which expects "
                                     f"{self.nbytes[rep_dst][j]}")
                match[src][i] = j
                match[rep_dst][j] = i  # its sender's representative is src itself (shift is a multiple of reps)
        for (src, dst), into in recvs.items():
            if any(match[dst][j] < 0 for j in into):
                raise ValueError(f"rank {dst} receives {len(into)} messages from rank {src}, which sends fewer")
        return match

    def time(self, model):
        """Completion time of the whole call under ``model`` (a :class:`Model`)."""
        return _simulate(self, model)


def _node_of(ranks_per_node, world_size, timed):
    """Every rank's node, numbered 0, 1, … in the order of their lowest ranks (None
    for one level), checked against the world size and the ``timed`` ranks that
    stand for it."""
    if not ranks_per_node:
        return None
    if isinstance(ranks_per_node, tuple):
        if len(ranks_per_node) != world_size:
            raise ValueError(f"ranks_per_node has {len(ranks_per_node)} node labels for {world_size} ranks")
        if timed < world_size:
            raise ValueError("node labels need every rank timed (a symmetric call's representatives stand for "
                             "equal nodes of ranks_per_node ranks)")
        return list(Topology.from_labels(ranks_per_node).node_of)
    k = int(ranks_per_node)
    if timed < world_size and timed % k:
        raise ValueError(f"{timed} representatives of {world_size} ranks cannot model {k} ranks per node")
    return [r // k for r in range(world_size)]


def _simulate(graph, model):
    plans, kinds, nbytes, peers, match = graph.plans, graph.kinds, graph.nbytes, graph.peers, graph.match
    real_peers = graph.real_peers
    size = len(plans)  # ranks, or their representatives (whose node links stand for every node's)
    node_of = _node_of(model.ranks_per_node, graph.world_size, size)  # of every rank; None: one level
    inter_alpha = model.alpha if model.inter_alpha is None else model.inter_alpha
    inter_beta = model.beta if model.inter_beta is None else model.inter_beta
    gamma = model.gamma
    nodes = max(node_of[:size]) + 1 if node_of else 0  # the timed ranks' nodes (links numbered by node)

    pending = [plan.initial_pending() for plan in plans]
    remaining = [len(plan.ops) for plan in plans]
    posted = [[False] * len(plan.ops) for plan in plans]
    cpu_free = [0.0] * size  # reductions queue on their rank's processor in ready order
    # Ports and links, numbered: send port of rank r = r, receive port = size + r,
    # node a's outgoing link = 2·size + a, its incoming link = 2·size + nodes + a.
    busy = bytearray(2 * size + 2 * nodes)
    waiting = {}  # port or link -> keys of the messages waiting for it, best first
    needs = {}  # message key -> the ports and links it holds while in flight
    in_flight = {}  # (sender, send index) -> key
    started = set()
    dirty = set()  # ports and links freed (or newly wanted) since the last dispatch
    events = []  # (time, rank, index): an operation completes
    fences = [[] for _ in range(size)]  # (time, index) of the fences each rank has reached, not passed
    finish = 0.0

    def post_message(now, src, i, dst, j):
        key = (now, i, src, dst, j)  # ready first, then the sender's earlier operation, then the lower rank
        held = [src, size + dst]
        if node_of and node_of[src] != node_of[real_peers[src][i]]:
            held += [2 * size + node_of[src], 2 * size + nodes + node_of[dst]]
        needs[key] = held
        for port in held:
            bisect.insort(waiting.setdefault(port, []), key)
        dirty.update(held)

    def release(rank, i, now):
        """One more thing operation i of rank waited for is done; start it if it was
        the last. A send or receive posted here lets the next one to that peer post."""
        pending[rank][i] -= 1
        while pending[rank][i] == 0:
            kind = kinds[rank][i]
            if kind == _COPY:
                start = max(now, cpu_free[rank]) if nbytes[rank][i] else now
                end = start + nbytes[rank][i] * model.beta
                if nbytes[rank][i]:
                    cpu_free[rank] = end
                heapq.heappush(events, (end, rank, i))
                return
            if kind == _FENCE:  # representatives stand for every rank: all of them reached it
                fences[rank].append((now, i))
                if all(fences):
                    end = max(reached[0][0] for reached in fences) + model.alpha
                    for r, reached in enumerate(fences):
                        heapq.heappush(events, (end, r, reached.pop(0)[1]))
                return
            if kind == _REDUCE:
                start = max(now, cpu_free[rank])
                cpu_free[rank] = end = start + nbytes[rank][i] * gamma
                heapq.heappush(events, (end, rank, i))
                return
            posted[rank][i] = True
            peer, j = peers[rank][i], match[rank][i]
            if posted[peer][j]:  # both sides are posted: the message may go
                if kind == _SEND:
                    post_message(now, rank, i, peer, j)
                else:
                    post_message(now, peer, j, rank, i)
            i = plans[rank].fifo_next[i]
            if i < 0:
                return
            pending[rank][i] -= 1

    def first_startable(port):
        """The best waiting message on ``port`` whose ports and links are all free."""
        queue = waiting.get(port, ())
        k = 0
        while k < len(queue):
            key = queue[k]
            if key in started:
                del queue[k]
                continue
            if not any(busy[x] for x in needs[key]):
                return key
            k += 1
        return None

    def dispatch(now):
        """Start every waiting message whose ports and links are free now, best first."""
        while dirty:
            candidates = sorted({key for port in dirty if not busy[port] for key in [first_startable(port)] if key})
            dirty.clear()
            for key in candidates:
                held = needs[key]
                if any(busy[x] for x in held):  # lost a port to a better message: look again
                    dirty.update(x for x in held if not busy[x])
                    continue
                for x in held:
                    busy[x] = 1
                started.add(key)
                _, i, src, dst, j = key
                inter = len(held) > 2
                alpha, beta = (inter_alpha, inter_beta) if inter else (model.alpha, model.beta)
                end = now + alpha + nbytes[src][i] * beta
                in_flight[src, i] = key
                heapq.heappush(events, (end, src, i))
                heapq.heappush(events, (end, dst, j))

    for rank in range(size):
        for i in [i for i, n in enumerate(pending[rank]) if n == 0]:  # before any release
            pending[rank][i] = 1
            release(rank, i, 0.0)
    dispatch(0.0)
    while events:
        now = events[0][0]
        while events and events[0][0] == now:  # everything that ends now, then dispatch
            _, rank, i = heapq.heappop(events)
            remaining[rank] -= 1
            finish = now
            if kinds[rank][i] == _SEND:
                for x in needs.pop(in_flight.pop((rank, i))):
                    busy[x] = 0
                    dirty.add(x)
            for j in plans[rank].dependents[i]:
                release(rank, j, now)
        dispatch(now)

    stuck = [r for r in range(size) if remaining[r]]
    if stuck:
        raise ValueError(f"ranks {stuck[:8]} never finish: the schedules deadlock")
    return finish
