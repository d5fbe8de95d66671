"""``run`` and ``costs``: build the virtual ranks' plans (every rank's, or for a symmetric
call only the representatives'), run them, count and time them."""

import math
from functools import cached_property

import numpy as np

from .. import ops as ops_layer
from ..algorithms import (
    BUILDERS,
    NODE_SYMMETRIC,
    PEER_READS,
    SEGMENTED,
    SHARED_MEMORY,
    SYMMETRIC,
    TOPOLOGICAL,
    VARIABLE,
    build,
    check_ordered,
)
from ..algorithms.hierarchical import pipeline_pieces
from ..algorithms.shm import DEFAULT_SLOT_BYTES, REGISTERED
from ..dtypes import check_dtype
from ..errors import CollectiveError
from ..options import DEFAULT_SEGMENT_SIZE, check_segment_size  # segments as the Communicator cuts them
from ..schedule import Recv, Reduce, Send, compile_plan
from ..specs import SPECS
from ..topology import Topology
from ..transport import local
from . import closed_form, parameter_server
from .timing import Graph, Model

# Schedules that exist only in the simulator: baselines to compare with, not algorithms.
BASELINES = {("allreduce", "parameter_server"): parameter_server.allreduce}
PARAMS = ("segment_size", "servers", "inplace", "ordered", "counts", "nodes", "registered")


def alltoallv_counts(world_size, count):
    """The uneven alltoallv the simulator runs unless given ``counts``: rank i sends
    ``count * ((d + 1) % 3)`` elements to rank j, d = j - i mod p (one block to itself,
    two to the next rank, none to the one after, and so on: ``count`` on average where
    3 divides p). Every rank sends and receives as much, and the matrix is circulant,
    so the call is rotation-symmetric (:func:`symmetry`)."""
    i, j = np.indices((world_size, world_size))
    return count * (((j - i) % world_size + 1) % 3)


def algorithms(collective):
    """The algorithms the simulator runs for ``collective`` (the library's, without
    ``native``/``auto``, plus the baselines)."""
    if collective not in BUILDERS:
        raise ValueError(f"collective must be one of {', '.join(BUILDERS)}; got {collective!r}")
    return tuple(BUILDERS[collective]) + tuple(a for c, a in BASELINES if c == collective)


class Costs:
    """What a simulated call costs, per virtual rank and in time.

    ``messages_sent[r]``, ``bytes_sent[r]``, ``bytes_received[r]`` and
    ``bytes_reduced[r]`` count what rank r's plan does (operations on zero elements
    are not sent, as on MPI). ``rounds`` is the number of message latencies on the
    critical path (the time with α = 1, β = γ = 0). :meth:`time` gives the predicted
    completion time.

    ``plan_of(rank)`` makes a rank's plan. Where the call is symmetric under a shift
    of the ranks by ``period`` (:func:`symmetry`: 1 for a rotation-symmetric algorithm,
    the ranks per node for a two-level one), only ranks 0 … period-1 get a plan made:
    rank r's counters are rank (r mod period)'s, and the time comes from them alone
    (from ranks 0 … lcm(period, k)-1 for a model of k ranks per node, where that
    divides p; from every rank where it does not). ``plans`` makes every rank's on
    first use. ``plan_of`` may also be a list of every rank's plans. ``counters``:
    the four counters' lists, where they are known without the plans
    (:class:`ClosedFormCosts`).
    """

    def __init__(self, collective, algorithm, world_size, count, dtype, root, plan_of, period=None, counters=None):
        self.collective, self.algorithm = collective, algorithm
        self.world_size, self.count, self.dtype, self.root = world_size, count, np.dtype(dtype), root
        if period is not None and (period < 1 or world_size % period):
            raise ValueError(f"period must divide the world size {world_size}; got {period!r}")
        self.period = period
        self._plan_of = plan_of if callable(plan_of) else list(plan_of).__getitem__  # a list of plans too
        self._representatives = []  # the plans of ranks 0, 1, … made so far
        self._graphs = {}
        if counters is not None:  # every rank's, known without the plans (ClosedFormCosts)
            self.messages_sent, self.bytes_sent, self.bytes_received, self.bytes_reduced = counters
            return
        measured = self._reps(period) if period else self.plans
        itemsize = self.dtype.itemsize
        self.messages_sent, self.bytes_sent, self.bytes_received, self.bytes_reduced = [], [], [], []
        for plan in measured:
            sent = [op.src.hi - op.src.lo for op in plan.ops if isinstance(op, Send)]
            received = sum(op.dst.hi - op.dst.lo for op in plan.ops if isinstance(op, Recv))
            reduced = sum(op.dst.hi - op.dst.lo for op in plan.ops if isinstance(op, Reduce))
            self.messages_sent.append(len(sent))
            self.bytes_sent.append(sum(sent) * itemsize)
            self.bytes_received.append(received * itemsize)
            self.bytes_reduced.append(reduced * itemsize)
        if period:  # rank r does what rank r mod period does
            for counter in (self.messages_sent, self.bytes_sent, self.bytes_received, self.bytes_reduced):
                counter *= world_size // period

    @property
    def symmetric(self):
        """Whether the simulation works from representatives (see :func:`symmetry`)."""
        return self.period is not None

    @property
    def plans(self):
        """Every rank's plan (made here, on first use, for a symmetric call)."""
        return self._reps(self.world_size)

    def _reps(self, count):
        """The plans of ranks 0 … count-1 (each made once)."""
        made = self._representatives
        made += [self._plan_of(r) for r in range(len(made), count)]
        return made[:count]

    def _graph(self, ranks_per_node=None):
        """The timing graph of the ranks :func:`timed_ranks` says stand for all."""
        reps = timed_ranks(self.world_size, self.period, ranks_per_node)
        if reps not in self._graphs:
            self._graphs[reps] = Graph(self._reps(reps), self.dtype.itemsize, self.world_size)
        return self._graphs[reps]

    @cached_property
    def rounds(self):
        return round(self._graph().time(Model(1.0, 0.0, 0.0)))

    def time(self, alpha, beta, gamma, ranks_per_node=None, inter_alpha=None, inter_beta=None):
        """Predicted completion time in seconds: α per message, β seconds per byte per
        link, γ seconds per byte reduced; with ``ranks_per_node`` (k ranks per node,
        node by node, or one node label per rank as ``nodes=`` takes them), messages
        between nodes cost ``inter_alpha``/``inter_beta`` (default: α and β) and share
        each node's link. See :mod:`collectives.sim.timing` for the whole model."""
        model = Model(alpha, beta, gamma, ranks_per_node, inter_alpha, inter_beta)  # checked before any work
        return self._graph(model.ranks_per_node).time(model)

    def __repr__(self):
        return (
            f"<{type(self).__name__} {self.collective}/{self.algorithm} p={self.world_size} "
            f"count={self.count} {self.dtype.name}: max {max(self.bytes_sent, default=0)} bytes sent, "
            f"{self.rounds} rounds>"
        )

    @property
    def nbytes(self):
        """The size the benchmarks call S: the input, or for allgather and gather the
        gathered output, for scatter the root's whole buffer, for alltoall a rank's input
        (alltoallv: a rank's mean input, ``count`` the mean block)."""
        n = self.count * self.dtype.itemsize
        spec = SPECS[self.collective]
        return n * self.world_size if spec.gathers or spec.root_input or spec.blocked or spec.variable else n


class ClosedFormCosts(Costs):
    """:class:`Costs` of a rooted call with O(p²) messages and no symmetry to use
    (:mod:`.closed_form`), given above ``closed_form.SIMULATED_UP_TO`` ranks: the
    counters and the one-level time come from closed forms that the tests hold equal
    to the simulation. Every rank's plan (``plans``), and the time under a two-level
    model, are made from the plans on first use, as for any call."""

    def __init__(self, collective, algorithm, world_size, count, dtype, root, plan_of):
        counters = closed_form.rooted_counters(collective, algorithm, world_size, count, np.dtype(dtype).itemsize, root)
        super().__init__(collective, algorithm, world_size, count, dtype, root, plan_of, counters=counters)

    @cached_property
    def rounds(self):
        return round(self.time(1.0, 0.0, 0.0))

    def time(self, alpha, beta, gamma, ranks_per_node=None, inter_alpha=None, inter_beta=None):
        model = Model(alpha, beta, gamma, ranks_per_node, inter_alpha, inter_beta)  # checked before any work
        if model.ranks_per_node is not None:
            return super().time(alpha, beta, gamma, ranks_per_node, inter_alpha, inter_beta)
        return closed_form.rooted_time(self.collective, self.algorithm, self.world_size, self.count,
                                       self.dtype.itemsize, alpha, beta, gamma)


class SimResult(Costs):
    """:class:`Costs` plus ``results[r]``: rank r's result (flat; ``None`` where the
    collective gives none: non-roots of reduce, parameter servers), already checked
    against NumPy."""

    def __init__(self, results, *args):
        super().__init__(*args)
        self.results = results


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_args(collective, algorithm, world_size, count, dtype, op, root, params):
    names = algorithms(collective)
    if algorithm not in names:
        raise ValueError(
            f"algorithm for {collective} must be one of {', '.join(names)} in the simulator; got {algorithm!r}"
            + (" (native is the MPI library's own, and auto picks among these)"
               if algorithm in ("native", "auto") else "")
        )
    if not _is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer; got {world_size!r}")
    if not _is_int(count) or count < 0:
        raise ValueError(f"count must be an integer >= 0; got {count!r}")
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must name a NumPy dtype; got {dtype!r}") from None
    check_dtype(np_dtype, name="dtype")
    if op is not None:
        ops_layer.check_op(op, dtype)
    if not _is_int(root) or not 0 <= root < world_size:
        raise ValueError(f"root must be a rank in [0, {world_size}); got {root!r}")
    unknown = set(params) - set(PARAMS)
    if unknown:
        raise TypeError(f"unknown parameter(s) {', '.join(sorted(unknown))}; the simulator takes {', '.join(PARAMS)}")
    check_segment_size(params.get("segment_size", DEFAULT_SEGMENT_SIZE))
    if (collective, algorithm) in BASELINES:
        servers = params.get("servers", 1)
        if not _is_int(servers) or not 1 <= servers < world_size:
            raise ValueError(
                f"servers must be an integer in [1, world_size) = [1, {world_size}) (the other ranks are "
                f"the workers); got {servers!r}"
            )
    elif "servers" in params:
        raise TypeError(f"servers is a parameter of the parameter_server baseline, not of {algorithm}")
    if params.get("registered") and (collective, algorithm) not in PEER_READS:
        if (collective, algorithm) not in SHARED_MEMORY or collective not in REGISTERED:
            raise ValueError(f"registered: only the shm algorithm of {', '.join(REGISTERED)} and the peer-read "
                             f"ones read registered buffers; got {collective} {algorithm!r}")
    for flag in ("inplace", "ordered", "registered"):
        if not isinstance(params.get(flag, False), (bool, np.bool_)):
            raise ValueError(f"{flag} must be True or False; got {params[flag]!r}")
    if params.get("inplace") and not (SPECS[collective].inplace or SPECS[collective].one_buffer):
        raise ValueError(f"inplace: {collective} has no in-place form here (allreduce, reduce and broadcast do)")
    if params.get("ordered"):
        check_ordered(collective, algorithm)
    layout = topology_of(world_size, params.get("nodes"))  # raises on a bad layout
    if ((collective, algorithm) in SHARED_MEMORY or (collective, algorithm) in PEER_READS) and layout is not None \
            and layout.node_count > 1:
        raise ValueError(f"algorithm {algorithm!r} runs on the ranks of one node only; nodes gives {layout.describe()}")
    if "counts" in params:
        if collective not in VARIABLE:
            raise TypeError(f"counts is a parameter of {', '.join(VARIABLE)}, not of {collective}")
        counts = np.asarray(params["counts"])
        if counts.shape != (world_size, world_size) or counts.dtype.kind not in "iu" or (counts < 0).any():
            raise ValueError(f"counts must be a {world_size}×{world_size} matrix of non-negative integers "
                             "(counts[i][j]: elements rank i sends rank j)")


def topology_of(world_size, nodes):
    """The :class:`~collectives.topology.Topology` that ``nodes`` names: None (one
    node), a number of ranks per node (placed node by node, the last node holding the
    rest) or one node label per rank."""
    if nodes is None:
        return None
    if _is_int(nodes):
        return Topology.uniform(int(world_size), int(nodes))
    try:
        labels = list(nodes)
        hash(tuple(labels))
    except TypeError:
        labels = None
    if labels is None or len(labels) != world_size:
        raise ValueError(f"nodes must be ranks per node or one node label per rank ({world_size}); got {nodes!r}")
    return Topology.from_labels(labels)


def _counts(collective, world_size, count, params):
    """The alltoallv matrix: ``counts[i][j]`` elements from rank i to rank j."""
    if collective not in VARIABLE:
        return None
    return np.asarray(params["counts"]) if "counts" in params else alltoallv_counts(world_size, count)


def plans_for(collective, algorithm, world_size, count, dtype="float32", root=0, **params):
    """Every virtual rank's compiled plan: the very ones the MPI transport would run."""
    plan_of = plan_maker(collective, algorithm, world_size, count, dtype, root, **params)
    return [plan_of(r) for r in range(int(world_size))]


def plan_maker(collective, algorithm, world_size, count, dtype="float32", root=0, **params):
    """``plan_of(rank)``: one virtual rank's compiled plan (the arguments checked first)."""
    _check_args(collective, algorithm, world_size, count, dtype, None, root, params)
    world_size, count, root = int(world_size), int(count), int(root)  # NumPy integers too
    # the peer-read algorithms always read the others' inputs in place: the flag changes nothing there
    registered = bool(params.get("registered", False)) and (collective, algorithm) not in PEER_READS
    spec = SPECS[collective]
    inplace = bool(params.get("inplace", False)) or spec.one_buffer or (registered and spec.inplace)
    if (collective, algorithm) in BASELINES:
        builder = BASELINES[collective, algorithm]
        servers = int(params.get("servers", 1))
        return lambda r: compile_plan(builder(r, world_size, count, servers=servers), inplace)
    segment = 1
    if (collective, algorithm) in SEGMENTED:
        segment = max(1, int(params.get("segment_size", DEFAULT_SEGMENT_SIZE)) // np.dtype(dtype).itemsize)
    elif (collective, algorithm) in SHARED_MEMORY:  # a slot of the shared window
        segment = max(1, int(params.get("segment_size", DEFAULT_SLOT_BYTES)) // np.dtype(dtype).itemsize)
    ordered = bool(params.get("ordered", False))
    matrix = _counts(collective, world_size, count, params)
    topology = topology_of(world_size, params.get("nodes")) if (collective, algorithm) in TOPOLOGICAL else None

    def plan_of(r):
        counts = None if matrix is None else (tuple(matrix[r].tolist()), tuple(matrix[:, r].tolist()))
        return compile_plan(build(collective, algorithm, r, world_size, count, root=root, segment=segment,
                                  ordered=ordered, counts=counts, topology=topology,
                                  registered=(count, 0) if registered else None, inplace=inplace), inplace)

    return plan_of


def symmetry(collective, algorithm, world_size, count, dtype="float32", root=0, **params):
    """A shift s of the ranks under which the call is symmetric (rank r + s's plan is
    rank r's with every peer q read as q + s, mod p), or None where there is none to
    use:

    - 1 for one of ``collectives.algorithms.SYMMETRIC``, not ordered, with every block
      the same size (allgather's and alltoall's always are; alltoallv's where its
      counts are circulant; the others' where p divides count, and for the
      shared-memory allreduce, copied in segment by segment, each segment: p divides
      the slot too); and the shared-memory reduce rooted at rank 0, whose steps are the
      allreduce's with the root's copies out added: the fences hold every rank until
      the root arrives, so the root's time is the call's and rank 0 stands for all (the
      counters do not count copies);
    - k for one of ``NODE_SYMMETRIC`` over equal nodes of k ranks (``nodes=k`` with k
      dividing p) and equal blocks (allreduce: p times its pieces divide count;
      reduce_scatter: p divides count)."""
    p, count = int(world_size), int(count)
    if params.get("ordered") or p < 1:
        return None
    if (collective, algorithm) in _AS_IF and int(root) == 0:
        collective = _AS_IF[collective, algorithm]  # the same conditions (the root's plan is allreduce's, plus copies)
    spec = SPECS[collective]
    if (collective, algorithm) in SYMMETRIC:
        if spec.variable:
            matrix = _counts(collective, p, count, params)
            shifted = (np.arange(p)[None, :] - np.arange(p)[:, None]) % p  # j - i mod p
            return 1 if np.array_equal(matrix, matrix[0][shifted]) else None
        if spec.gathers or spec.blocked:  # every rank's block has count elements
            return 1
        if (collective, algorithm) in _SLOT_BY_SLOT and not params.get("registered"):
            slot = max(1, int(params.get("segment_size", DEFAULT_SLOT_BYTES)) // np.dtype(dtype).itemsize)
            if min(slot, count) % p:
                return None
        return 1 if count % p == 0 else None
    nodes = params.get("nodes")
    if (collective, algorithm) in NODE_SYMMETRIC and _is_int(nodes) and 0 < int(nodes) and p % int(nodes) == 0:
        return int(nodes) if _NODE_EQUAL_BLOCKS[collective, algorithm](p, count) else None
    return None


# The shared-memory reduce rooted at rank 0 is symmetric where the shared-memory
# allreduce is (its steps are the allreduce's, with the root's copies out added).
_AS_IF = {("reduce", "shm"): "allreduce"}
# Copied into the window slot by slot: every slot's share must be equal too.
_SLOT_BY_SLOT = frozenset({("allreduce", "shm")})
# The two-level algorithms' blocks are equal where: (p, count) -> bool.
_NODE_EQUAL_BLOCKS = {
    ("allreduce", "hierarchical"): lambda p, count: count % (p * len(pipeline_pieces(count))) == 0,
    ("reduce_scatter", "hierarchical"): lambda p, count: count % p == 0,
    ("allgather", "hierarchical"): lambda p, count: True,
}


def timed_ranks(world_size, period, ranks_per_node=None):
    """How many ranks' plans the timing of a call symmetric under a shift by ``period``
    (None: not symmetric) needs: s = lcm(period, k) for a model of k ranks per node
    (period alone without nodes), where s divides p; else every rank."""
    if not period or isinstance(ranks_per_node, (list, tuple)):  # node labels: every rank
        return world_size
    shift = math.lcm(period, ranks_per_node) if ranks_per_node else period
    return shift if world_size % shift == 0 else world_size


def costs(collective, algorithm, world_size, count, dtype="float32", root=0, **params):
    """Counters and timing of a call without running it on data (for sweeps and fits).

    Same arguments as :func:`run`, less ``op``; the counts and times are the ones
    :func:`run` gives, since they depend only on the plans. A symmetric call
    (:func:`symmetry`) makes rank 0's plan alone, or one node's: p = 4096 takes seconds.
    So does a rooted call with O(p²) messages and no symmetry (broadcast ``direct`` and
    ``scatter_allgather``, reduce ``direct``, with equal blocks): above
    ``closed_form.SIMULATED_UP_TO`` ranks it is a :class:`ClosedFormCosts`.
    """
    plan_of = plan_maker(collective, algorithm, world_size, count, dtype, root, **params)
    p, count, root = int(world_size), int(count), int(root)
    if p > closed_form.SIMULATED_UP_TO and closed_form.applies(collective, algorithm, p, count, params.get("ordered")):
        return ClosedFormCosts(collective, algorithm, p, count, dtype, root, plan_of)
    return Costs(collective, algorithm, p, count, dtype, root, plan_of,
                 symmetry(collective, algorithm, p, count, dtype, root, **params))


def run(collective, algorithm, world_size, count, dtype="float32", op="sum", root=0, **params):
    """Run ``collective`` with ``algorithm`` for ``world_size`` virtual ranks in this
    process, on integer-valued NumPy inputs of ``count`` elements per rank (allgather and
    gather: each rank's contribution; scatter and alltoall: each block; alltoallv: the
    mean block, its blocks as ``counts`` says, default :func:`alltoallv_counts`), and
    check every rank's result against NumPy's reduction of the same inputs: equal
    values (+0 and -0 alike), and for allreduce the same bits on every rank.

    ``params``: ``segment_size`` (bytes, for the pipelined ``tree`` and ``pipeline``, and the
    shared-memory algorithms' slot),
    ``inplace`` (the in-place form of the call), ``servers`` (``parameter_server``),
    ``registered`` (``shm`` on registered buffers, which reads the other ranks' inputs
    where they are; its allreduce runs in place),
    ``ordered`` (reductions in rank order, as in deterministic mode), ``counts``
    (alltoallv: ``counts[i][j]`` elements from rank i to rank j), ``nodes`` (the node
    layout the two-level algorithms see: ranks per node, or one node label per rank;
    default one node).
    Raises :class:`~collectives.CollectiveError` if a result differs from NumPy's.
    """
    _check_args(collective, algorithm, world_size, count, dtype, op, root, params)
    world_size, count, root, dtype = int(world_size), int(count), int(root), np.dtype(dtype)
    baseline = (collective, algorithm) in BASELINES
    if baseline and op == "avg":
        raise ValueError("op 'avg' is not modelled for the parameter_server baseline; use op='sum'")
    plans = plans_for(collective, algorithm, world_size, count, dtype, root, **params)
    spec = SPECS[collective]
    per_rank = count * world_size if spec.root_input or spec.blocked else count  # count per block
    matrix = _counts(collective, world_size, count, params)
    inputs = [make_input(r, world_size, per_rank if matrix is None else int(matrix[r].sum()), dtype, op)
              for r in range(world_size)]
    inplace = bool(params.get("inplace", False))
    got = local.run_collective(collective, algorithm, [x.copy() for x in inputs], op, root, inplace=inplace,
                               plans=plans, counts=matrix, registered=bool(params.get("registered", False)))
    contributors = range(world_size)
    if baseline:  # servers hold no data and get no result
        contributors = range(int(params.get("servers", 1)), world_size)
        got = [got[r] if r in contributors else None for r in range(world_size)]
    want = reference(collective, [inputs[r] for r in contributors], op, root if not baseline else 0, matrix)
    for r in range(world_size):
        expected = None if (baseline and r not in contributors) else want[r - contributors.start]
        _check_equal(r, got[r], expected, collective, algorithm)
    # one reduction per element, then copies: the same bits on every rank
    if spec.reduces and not (spec.root_result or spec.scatters):
        first = got[contributors.start]
        for r in contributors:
            if got[r].tobytes() != first.tobytes():
                raise CollectiveError(f"{collective}/{algorithm}: ranks {contributors.start} and {r} got "
                                      "different bits")
    return SimResult(got, collective, algorithm, world_size, count, dtype, root, plans.__getitem__)


def _check_equal(rank, got, expected, collective, algorithm):
    if expected is None:
        if got is not None:
            raise CollectiveError(f"{collective}/{algorithm}: rank {rank} got a result where none was due")
        return
    # Equal values: the sign of a zero may differ (a complex product's in another order).
    if got.shape != expected.shape or not np.array_equal(got, expected):
        if got.shape != expected.shape:
            detail = f"{got.size} elements instead of {expected.size}"
        else:
            index = int(np.flatnonzero(got != expected)[0])
            detail = f"element {index} is {got[index]!r}, NumPy says {expected[index]!r}"
        raise CollectiveError(f"{collective}/{algorithm}: rank {rank}'s result differs from NumPy's: {detail}")


def reference(collective, inputs, op="sum", root=0, counts=None):
    """NumPy's answer for every rank, given every rank's input (flat arrays; alltoallv:
    ``counts[i][j]`` elements from rank i to rank j): :mod:`collectives.reference`'s."""
    return SPECS[collective].reference_flat(inputs, op, root, counts)


def make_input(rank, world_size, count, dtype, op):
    """Rank ``rank``'s input: integer-valued and distinct per rank and index, chosen so
    that ``op`` over ``world_size`` ranks is exact in ``dtype`` in any order (sums stay
    within the dtype's exact integers; products are of ±1 and 2, whose overflow to
    infinity or wrap-around does not depend on the order)."""
    dtype = np.dtype(dtype)
    index = np.arange(count)
    if op == "prod":
        values = np.where((index + rank) % 5 == 0, 2, 1)
        if dtype.kind != "u":
            values = np.where((index * 3 + rank) % 7 == 0, -values, values)
    else:
        limit = world_size * 3
        if dtype.kind in "fc":  # sums must stay within the consecutive integers
            limit = 2 ** (np.finfo(dtype).nmant + 1)
        amplitude = min(3, limit // world_size)
        if amplitude >= 1:
            low = 0 if dtype.kind == "u" else -amplitude
            values = (index * 5 + rank * 3) % (amplitude - low + 1) + low
        else:  # so many ranks that only a sparse set of ones stays exact
            values = ((index + rank) % math.ceil(world_size / limit) == 0).astype(int)
    x = values.astype(dtype)
    if dtype.kind == "c" and op != "prod":
        x = x + (1j * values[::-1]).astype(dtype)
    return x
