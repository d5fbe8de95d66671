"""``auto`` on a machine with no measured table: the cost model calibrated here, once.

Where no tuning table matches the job's machine and layout, a :class:`~collectives.Communicator`
measures what the cost model (:class:`collectives.auto.host_model.CostModel`) needs, on its own
ranks, when it is made (:func:`obtain`):

- the library's cost per message, ``alpha``: its ring allreduce of a few hundred bytes
  among each node's ranks, on the lean executor, over the number of messages in a row;
  and, with 3 ranks or more on a node, ``message``, what each message after the first
  of a round adds (its direct allreduce, 2 rounds of k - 1 messages): with more ranks
  than cores a message that waits for its peer to be scheduled costs far more than one
  sent beside it;
- within the node, the per-byte cost of a message, ``beta``: every rank sends
  ``PROBE_BYTES`` to the next rank of its node and receives from the previous one at
  once (all ranks stream together, as in a collective), less MPI's own latency,
  ``mpi_alpha``, from the same exchange of 8 bytes; never below a copy of
  ``PROBE_BYTES`` (``np.copyto``), as a message copies its bytes once at least;
- the memory rate that bounds reductions, ``gamma``: ``np.add`` on ``PROBE_BYTES``
  arrays on every rank at once, seconds per byte reduced;
- across nodes (where the ranks span several): the link's rate, ``net_beta``
  (:func:`collectives.topology.measure_link`) and its latency, the same exchange of 8
  bytes between ranks on different nodes;
- MPI's own collective (``native``) and the library's algorithms that run alike on
  every rank (:data:`TIMED`: those the model covers, and on one node ``shm``), each
  called as a user's call is (``timer``: blocking calls through a communicator of the
  calibration's own), for allreduce, reduce_scatter, allgather, broadcast and reduce
  at ``NATIVE_AT``'s sizes (64 KiB, 1 MiB and 4 MiB; allreduce 256 KiB too, and MPI's
  own allreduce 16 MiB, where MPICH's slows to twice its 4 MiB cost per byte).
  MPI's collectives run schedules and copies of their own, and the library's calls
  have costs the model leaves out (a call's fixed cost, MPI's protocol for messages
  of that size, the caches) that differ from algorithm to algorithm (here at 2 ranks
  and 256 KiB, recursive doubling's one message took 0.75x recursive halving's two).
  From 4 MiB on only the library's two fastest at the size before are timed, and
  none whose call would take over ``SLOW_OURS`` (5 ms); a size whose calls would take
  over ``SLOW_CALL`` is left out. Where the ranks span several nodes only the ring
  allreduce is timed (over the network every call is slow; the model, with the
  link's measured rate, answers for the others).

Every figure is the slowest rank's (each timing is reduced with MAX over the ranks),
so every rank holds the same calibration and makes the same choices; each is the
least of ``REPEATS`` timings (a timing that another process's time slice slowed says
nothing of the machine), of one run for the model's parameters, of a batch of calls
in a row for the calls (what a program's calls take, the waits on peers the
scheduler lets run late among them). The sizes go in ascending order, and timing
stops, for the largest sizes left, once ``BUDGET`` (0.6 s) was spent on it (MPI's own
collectives are timed at their first two sizes all the same: they are the yardstick,
and the model scales between two sizes at least). Measured
at 2 and 4 ranks on one node of the 2-core machine: 0.27-0.32 s and 0.61-0.71 s
(``bench/results/xeon-2vcpu-mpich5/auto-vs-fastest``).
:func:`calibrated_choice` then chooses: below ``SMALL`` (64 KiB) and
for gather, scatter, alltoall and alltoallv, ``native``; above, the library's
algorithm expected fastest (:meth:`Calibration.times`: the model's prediction scaled
by what that algorithm's timings say of it), where MPI's own, timed (interpolated
between the sizes timed, extended along the last two beyond them), takes at least
``MARGIN`` (1.1x) as long; else ``native``. Every algorithm ``auto`` picks runs alike
on every rank, whatever one rank's input is (``shm`` from ``auto`` copies in even
where the input is a registered buffer: see ``collectives.routes.shared``).

The result is cached per user (``$COLLECTIVES_CACHE_DIR``, else
``$XDG_CACHE_HOME/collectives``, else ``~/.cache/collectives``), one file per
fingerprint and layout (:func:`collectives.auto.fingerprints.fingerprint`), written to a
temporary file and renamed into place, so two jobs writing at once leave one whole
file. Rank 0 reads it and tells the others (their home may differ across nodes). It is
used only where it was measured: the same fingerprint, and on several nodes a link
within ``LINK_TOLERANCE`` of this job's.

``COLLECTIVES_CALIBRATE=0`` turns it off (``auto`` then keeps to the conservative
rule, as before); so does choosing a rule with ``COLLECTIVES_AUTO_RULE``. Set both
alike on every rank (the ranks agree on whether to calibrate; where one says no, none
does).
"""

import bisect
import hashlib
import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .fingerprints import describe_fingerprint
from .host_model import CostModel, predict

CALIBRATE_ENV = "COLLECTIVES_CALIBRATE"
CACHE_ENV = "COLLECTIVES_CACHE_DIR"
FORMAT = 2  # 2: the library's algorithms timed per collective (1 timed its ring allreduce only)
SMALL = 64 << 10  # below this many bytes auto stays native: MPI's per-call cost is a tenth of ours
MARGIN = 1.1  # MPI's time over the model's best before auto leaves native
PROBE_BYTES = 4 << 20  # the exchange and the reduction timed for beta and gamma
NATIVE_SIZES = (64 << 10, 1 << 20, 4 << 20)
# Allreduce, the collective that matters most, is also timed at 256 KiB and (MPI's
# own; the library's where a call is quick) at 16 MiB: past the caches MPICH's
# allreduce slows to twice its 4 MiB cost per byte here (1.3 ns/B at 64 MiB and 4
# ranks against 0.64 at 4 MiB), which no line through the smaller sizes foresees.
LARGEST = 16 << 20
# The collectives timed -> the sizes they are timed at (bytes as the tuning tables count them).
NATIVE_AT = {"allreduce": (64 << 10, 256 << 10, 1 << 20, 4 << 20, LARGEST), "reduce_scatter": NATIVE_SIZES,
             "allgather": NATIVE_SIZES, "broadcast": NATIVE_SIZES, "reduce": NATIVE_SIZES}
NATIVE = tuple(NATIVE_AT)
# The library's algorithms timed on one node, per collective: every flat one that runs
# alike on every rank (the peer reads are for device arrays; on one node the two-level
# ones are a ring in pieces), shm only where the ranks share memory.
TIMED = {"allreduce": ("ring", "recursive_doubling", "recursive_halving", "direct", "shm"),
         "reduce_scatter": ("ring", "recursive_halving", "direct", "shm"),
         "allgather": ("ring", "recursive_doubling", "bruck", "direct", "shm"),
         "broadcast": ("binomial", "scatter_allgather", "direct", "shm"),
         "reduce": ("binomial", "direct", "shm")}
SLOW_CALL = 0.03  # seconds: a size (past the second) whose call would take longer is not timed
SLOW_OURS = 0.005  # seconds: nor a library's call that would take longer (MPI's own is: it is the yardstick)
FEWER, FEWER_FROM = 2, 4 << 20  # from this size on, the library's 2 fastest at the size before are timed
BATCH = 0.5e-3  # seconds: the calls of one timing, in a row (at least one call)
BUDGET = 0.6  # seconds of calls timed (the slowest rank's), after which what is left is not timed
WARM_UP = 2  # calls before each timing, not counted
REPEATS = 3  # timings per figure, the least kept (twice as many for the model's smallest)


def interpolate(points, nbytes):
    """The time at ``nbytes`` of ``points`` (``[[bytes, seconds], ...]``, ascending, at
    least one): linear between the sizes timed, along the last (or first) two beyond
    them, never below 0; with one point, proportional to the size."""
    sizes = [b for b, _ in points]
    if len(points) == 1:
        return points[0][1] * max(nbytes, 1) / max(sizes[0], 1)
    i = min(max(bisect.bisect_right(sizes, nbytes) - 1, 0), len(points) - 2)
    (b0, t0), (b1, t1) = points[i], points[i + 1]
    return max(t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0), 0.0)


@dataclass
class Calibration:
    """What was measured (seconds; seconds per byte) and where."""

    alpha: float
    beta: float
    gamma: float
    mpi_alpha: float
    message: float | None = None  # one more of ours in a round (CostModel.message); None: alpha
    net_alpha: float = 0.0
    mpi_net_alpha: float = 0.0
    net_beta: float = 0.0
    native: dict = field(default_factory=dict)  # collective -> [[bytes, seconds], ...], ascending
    ours: dict = field(default_factory=dict)  # collective -> {algorithm: [[bytes, seconds], ...], ascending}
    fingerprint: dict = field(default_factory=dict)
    key: str = ""
    seconds: float = 0.0  # how long measuring took
    measured_at: float = 0.0  # time.time() when it was measured
    source: str = "measured now"  # or the cache file it was read from

    def parameters(self):
        """The cost model's parameters measured (:class:`~collectives.auto.host_model.CostModel`'s names;
        the network's only where the ranks span nodes)."""
        found = dict(alpha=self.alpha, mpi_alpha=self.mpi_alpha, beta=self.beta, gamma=self.gamma,
                     message=self.message)
        if self.net_beta:
            found.update(net_alpha=self.net_alpha, mpi_net_alpha=self.mpi_net_alpha, net_beta=self.net_beta)
        return found

    def native_time(self, collective, nbytes):
        """MPI's timed time for ``collective`` on ``nbytes`` (:func:`interpolate`); None
        where it was not timed."""
        points = self.native.get(collective)
        return interpolate(points, nbytes) if points else None

    def correction(self, predicted, nbytes, collective="allreduce", algorithm="ring"):
        """``algorithm``'s timed time over the model's prediction (``predicted(bytes)``,
        seconds) at ``nbytes``: between the sizes timed, linear in the logarithm of the
        size; the nearest one's beyond them; 1 where it was not timed. It carries what
        the model leaves out of that algorithm (the call's fixed cost, MPI's protocol for
        messages of that size, the caches) into its prediction; the ring allreduce's
        (the default) into those of algorithms not timed."""
        timed = self.ours.get(collective, {}).get(algorithm, ())
        points = [(math.log2(b), t / predicted(b)) for b, t in timed if predicted(b) > 0]
        if not points:
            return 1.0
        x = math.log2(max(nbytes, 1))
        if x <= points[0][0]:
            return points[0][1]
        for (x0, f0), (x1, f1) in zip(points, points[1:]):
            if x <= x1:
                return f0 + (f1 - f0) * (x - x0) / (x1 - x0)
        return points[-1][1]

    def times(self, collective, nbytes, predicted):
        """``{algorithm: seconds}``: what each of the library's algorithms of
        ``collective`` is expected to take on ``nbytes`` here. ``predicted(collective,
        bytes)`` is the model's ``{algorithm: seconds}``. An algorithm timed here and
        modelled: its prediction times its own :meth:`correction`; timed and not
        modelled (``shm``): its timings interpolated as MPI's are, between them only
        (past them nothing says how it grows: ``shm``'s fences, one per segment, cost
        ever more on a busy machine); modelled and not timed: its prediction times the
        ring allreduce's correction. An algorithm timed at fewer sizes than others of
        its collective (not among the fastest: :func:`_time_calls`) is out past its
        last timing too."""
        timed = self.ours.get(collective, {})
        largest = max((points[-1][0] for points in timed.values() if points), default=0)
        modelled = predicted(collective, nbytes)
        found = {}
        for algorithm, points in timed.items():
            past = not points or nbytes > points[-1][0]
            if past and (algorithm not in modelled or points[-1][0] < largest):
                continue  # nothing says what it takes there
            if algorithm in modelled:
                found[algorithm] = modelled[algorithm] * self.correction(
                    lambda b, a=algorithm: predicted(collective, b)[a], nbytes, collective, algorithm)
            else:
                found[algorithm] = interpolate(points, nbytes)
        untimed = [a for a in modelled if a not in timed]
        if untimed:
            factor = self.correction(lambda b: predicted("allreduce", b)["ring"], nbytes)
            found.update((a, modelled[a] * factor) for a in untimed)
        return found

    def describe(self):
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.measured_at)) if self.measured_at else "?"
        how = "measured now" if self.source == "measured now" else f"cached in {self.source}"
        return f"this machine and layout, measured {when} in {self.seconds:.2f} s, {how}"

    def to_json(self):
        data = asdict(self)
        data.pop("source")
        return {"format": FORMAT, **data}

    @classmethod
    def from_json(cls, data, source):
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("not a calibration of this format")
        data = {k: v for k, v in data.items() if k != "format"}
        calibration = cls(**data, source=str(source))
        for name in ("alpha", "beta", "gamma", "mpi_alpha"):
            value = getattr(calibration, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} is {value!r}")
        return calibration


# -- what it picks ------------------------------------------------------------------------

def calibrated_choice(calibration, collective, nbytes, size, topology=None):
    """``(algorithm, why)``: what the model calibrated on this machine picks
    (this module): ``native`` below ``SMALL`` and for
    the collectives whose MPI's own it did not time; else the library's algorithm
    expected fastest (:meth:`Calibration.times`: the model's
    prediction with the measured parameters, scaled by what that algorithm's timings
    here say of it), where MPI's own, timed, takes at least ``MARGIN``
    (1.1x) as long; else ``native``."""
    small, margin = SMALL, MARGIN
    where = f"calibrated model ({describe_fingerprint(calibration.fingerprint)}): {calibration.describe()}"
    mpi = calibration.native_time(collective, nbytes)
    if mpi is None:
        return "native", f"{where}; native (MPI's own {collective}: not timed)"
    if nbytes < small:
        return "native", f"{where}; native below {small >> 10} KiB (MPI's latency)"
    model = CostModel(**calibration.parameters())
    ours = calibration.times(collective, nbytes, lambda c, b: predict(c, b, size, topology, model)[1])
    if not ours:
        return "native", f"{where}; native (none of the library's {collective} algorithms is modelled or timed)"
    best = min(ours, key=ours.get)
    gain = mpi / ours[best] if ours[best] > 0 else 1.0
    said = (f"{best} expected to take {ours[best] * 1e6:.0f} us against MPI's own, timed, {mpi * 1e6:.0f} us "
            f"({gain:.2f}x)")
    if gain >= margin:
        return best, f"{where}; {said}"
    return "native", f"{where}; native, as {said} is under {margin:g}x"


# -- whether, and the cache ---------------------------------------------------------------

def wanted(environ=None):
    """Whether this rank would calibrate (``COLLECTIVES_CALIBRATE``: 1 or 0, default 1);
    a ValueError for another value."""
    environ = os.environ if environ is None else environ
    text = environ.get(CALIBRATE_ENV, "").strip()
    if text not in ("", "0", "1"):
        raise ValueError(f"{CALIBRATE_ENV} must be 1 or 0; got {text!r}")
    return text != "0"


def cache_dir(environ=None):
    environ = os.environ if environ is None else environ
    if environ.get(CACHE_ENV, "").strip():
        return Path(environ[CACHE_ENV].strip())
    base = environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "collectives"


def cache_path(fingerprint, key, environ=None):
    """The cache file of a fingerprint and layout key."""
    text = json.dumps({"fingerprint": fingerprint, "key": str(key)}, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return cache_dir(environ) / f"calibration-{key}-{digest}.json"


def load(path, fingerprint, key):
    """The cached :class:`Calibration` at ``path`` if it is whole and was measured with
    this ``fingerprint`` and ``key``; else None."""
    try:
        calibration = Calibration.from_json(json.loads(Path(path).read_text()), path)
    except (OSError, ValueError, TypeError):
        return None
    if calibration.fingerprint != fingerprint or calibration.key != str(key):
        return None
    return calibration


def save(calibration, path):
    """Write ``calibration`` to ``path`` atomically (a temporary file, then a rename):
    a reader never sees half a file, and of two writers at once the last one's stays.
    Returns False (and writes nothing) where the folder cannot be written."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(calibration.to_json(), f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return False
    return True


# -- measuring ------------------------------------------------------------------------------

def obtain(comm, topology, fingerprint, key, tag, timer, environ=None, link=None, link_tolerance=1.5,
           shares_memory=False):
    """The calibration for this job (collective over ``comm``, whose other traffic must
    wait: the Communicator calls it while it is made): rank 0's cached one where it
    matches, else measured now on every rank together and cached by rank 0. ``tag``: a
    base tag no call of ``comm`` uses yet; ``timer``: as :func:`measure` takes it;
    ``link``: the node-to-node rate already measured (bytes per second), if any; a
    cached calibration of several nodes counts where its link is within
    ``link_tolerance`` of this job's; ``shares_memory``: whether every rank is on this
    node, as MPI says (``shm`` is timed then)."""
    from mpi4py import MPI

    several = topology is not None and topology.node_count > 1
    if several and link is None:  # this job's link, to hold a cached calibration to
        from ..topology import measure_link

        link = measure_link(comm, topology)
    path = cache_path(fingerprint, key, environ)
    cached = load(path, fingerprint, key) if comm.Get_rank() == 0 else None
    if cached is not None and several and link and cached.net_beta:
        if not 1 / link_tolerance <= link * cached.net_beta <= link_tolerance:
            cached = None  # measured over another network: measure again
    data = comm.bcast(cached.to_json() if cached is not None else None, root=0)
    if data is not None:
        return Calibration.from_json(data, path)
    start = time.perf_counter()
    calibration = measure(comm, topology, tag, timer, link, shares_memory)
    calibration.fingerprint, calibration.key = dict(fingerprint), str(key)
    calibration.seconds = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    calibration.measured_at = comm.bcast(time.time(), root=0)
    if comm.Get_rank() == 0:
        save(calibration, path)
    return calibration


def _slowest(comm, f, repeats=REPEATS):
    """The slowest rank's time of ``f()``, the least over ``repeats`` runs (after a
    barrier each, and one untimed run): what the machine can do, not what another
    process's time slice left of it (on a shared machine a single run can lose
    milliseconds to one)."""
    from mpi4py import MPI

    f()
    times = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    slowest = np.empty(len(times))
    comm.Allreduce(np.array(times), slowest, MPI.MAX)
    return float(slowest.min())


def measure(comm, topology, tag, timer, link=None, shares_memory=False):
    """Measure every figure of a :class:`Calibration` (collective). The node's figures
    (``alpha``, ``beta``, ``mpi_alpha``) are measured among each node's ranks at once
    (a ring within the node), the network's between nodes. ``timer(collective,
    algorithm, nbytes)`` gives a function of no arguments that makes one blocking call
    of ``collective`` with ``algorithm`` (``native`` too) on ``nbytes`` of float32 (as
    the tuning tables count bytes), every rank alike; ``shares_memory``: whether
    ``shm`` can run (every rank on this node, as MPI says)."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    several = topology is not None and topology.node_count > 1
    node = comm.Split(topology.node_of[rank] if several else 0, rank)
    try:
        local, per_node = node.Get_rank(), node.Get_size()
        widest = max(topology.ranks_per_node) if several else size

        def exchange(send, receive):  # to the next rank of the node, from the previous one, all at once
            if per_node > 1:
                MPI.Request.Waitall([node.Isend([send, MPI.BYTE], (local + 1) % per_node, tag),
                                     node.Irecv([receive, MPI.BYTE], (local - 1) % per_node, tag)])

        tiny_out, tiny_in = np.zeros(8, np.uint8), np.empty(8, np.uint8)
        big_out, big_in = np.ones(PROBE_BYTES, np.uint8), np.empty(PROBE_BYTES, np.uint8)
        a, b = big_out.view(np.float32), big_in.view(np.float32)
        c = np.empty_like(a)
        gamma = _slowest(comm, lambda: np.add(a, b, out=c), 2) / PROBE_BYTES
        if widest > 1:
            mpi_alpha = _slowest(comm, lambda: exchange(tiny_out, tiny_in), 2 * REPEATS)
            # A message within a node copies its bytes once at least: that floors beta
            # where, with more ranks than cores, the 8-byte exchange waited on the
            # scheduler about as long as the large one (a CI run measured beta = 0).
            copy = _slowest(comm, lambda: np.copyto(big_in, big_out), 2)
            streamed = _slowest(comm, lambda: exchange(big_out, big_in), 2)
            beta = max(streamed - mpi_alpha, copy) / PROBE_BYTES
            alpha = _ring_time(comm, node if per_node > 1 else None, tag) / (2 * (widest - 1))
            message = None
            if widest > 2:  # direct's 2 rounds of k - 1 messages: alpha for each round's first, the rest
                rounds = _ring_time(comm, node if per_node > 1 else None, tag, "direct")
                message = min(max((rounds / 2 - alpha) / (widest - 2), 0.0), alpha)
        else:  # one rank per node: no message stays in a node (alpha and beta only matter there)
            mpi_alpha, beta = 0.0, gamma
            alpha, message = 0.0, None
        calibration = Calibration(alpha=alpha, beta=beta, gamma=gamma, mpi_alpha=mpi_alpha, message=message)
        if several:
            from ..topology import measure_link

            rate = link if link is not None else measure_link(comm, topology)
            nodes, here = topology.nodes, topology.node_of[rank]
            leader = topology.local_rank[rank] == 0
            far, near = nodes[(here + 1) % len(nodes)][0], nodes[(here - 1) % len(nodes)][0]

            def leaders():  # each node's first rank to the next node's, at once
                if leader:
                    MPI.Request.Waitall([comm.Isend([tiny_out, MPI.BYTE], far, tag),
                                         comm.Irecv([tiny_in, MPI.BYTE], near, tag)])

            calibration.mpi_net_alpha = _slowest(comm, leaders, 2 * REPEATS)
            calibration.net_beta = 1.0 / rate if rate else 0.0
            if widest > 1:  # ours: MPI's latency plus the library's own cost per message
                calibration.net_alpha = calibration.mpi_net_alpha + max(alpha - mpi_alpha, 0.0)
            else:  # the library's ring across the nodes: its cost per message there
                calibration.net_alpha = _ring_time(comm, comm, tag) / (2 * (size - 1))
                calibration.alpha = max(calibration.net_alpha - calibration.mpi_net_alpha, 0.0)
    finally:
        node.Free()
    if several:  # over the network every call is slow: the ring allreduce only, for the correction
        algorithms = {"allreduce": ("ring",)}
    else:
        algorithms = {c: tuple(a for a in names if a != "shm" or shares_memory) for c, names in TIMED.items()}
    calibration.native, calibration.ours = _time_calls(comm, timer, algorithms)
    return calibration


def _time_calls(comm, timer, algorithms):
    """``(native, ours)``: MPI's own collectives (every one of ``NATIVE_AT``) and the
    library's ``algorithms`` (``{collective: names}``) timed at the collective's sizes
    (:func:`_typical`), as ``{collective: [[bytes, seconds], ...]}`` and ``{collective:
    {algorithm: [[bytes, seconds], ...]}}``. Size by size, ascending, every collective
    at each (allreduce first), so that what ``BUDGET`` leaves out, once spent, is the
    largest sizes (and the library's calls: MPI's own are timed at the first two sizes
    whatever was spent; with more ranks than cores a loaded machine spent it all at
    the first size). From ``FEWER_FROM`` on, where each call takes milliseconds, only
    the library's ``FEWER`` fastest at the size before are timed; none whose call
    would take over ``SLOW_OURS``; and no size (past the second) whose calls would take
    over ``SLOW_CALL``. Every decision follows from the slowest rank's figures, the
    same on every rank (collective)."""
    alive = {c: ("native",) + tuple(algorithms.get(c, ())) for c in NATIVE_AT}
    found = {c: {name: [] for name in names} for c, names in alive.items()}
    spent = 0.0
    for nbytes in sorted({b for sizes in NATIVE_AT.values() for b in sizes}):
        for collective, sizes in NATIVE_AT.items():
            over = spent > BUDGET
            if nbytes not in sizes or not alive[collective] or (over and nbytes > sizes[1]):
                continue
            points = found[collective]
            if nbytes > sizes[1] and any(points[a][-1][1] * nbytes / points[a][-1][0] > SLOW_CALL
                                         for a in alive[collective]):
                alive[collective] = ()  # its calls would take too long from here on
                continue
            if nbytes >= FEWER_FROM:
                ours = sorted(alive[collective][1:], key=lambda a: points[a][-1][1])
                alive[collective] = ("native",) + tuple(ours[:FEWER])
            slow = set()
            for name in alive[collective]:
                if over and name != "native":
                    continue
                guess = points[name][-1][1] * nbytes / points[name][-1][0] if points[name] else None
                if name != "native" and guess is not None and guess > SLOW_OURS:
                    slow.add(name)  # not timed here, nor at the larger sizes
                    continue
                seconds, took = _typical(comm, timer(collective, name, nbytes), guess)
                points[name].append([nbytes, seconds])
                spent += took
            alive[collective] = tuple(a for a in alive[collective] if a not in slow)
    native = {c: points.pop("native") for c, points in found.items()}
    ours = {c: {a: p for a, p in points.items() if p} for c, points in found.items()}
    return native, {c: timed for c, timed in ours.items() if timed}


def _typical(comm, f, guess=None):
    """``(typical, spent)``: what a call of ``f`` typically takes on the slowest rank,
    the least of ``REPEATS`` timings (a batch that another process's time slice slowed
    says nothing of the call), each the mean of a batch of calls lasting about
    ``BATCH`` (one call at least), the batches in a row after one barrier: what the
    calls of a program in a row take, the waits on peers that the scheduler lets run
    late among them; and the seconds all that took (the slowest rank's). ``WARM_UP``
    calls come first, not counted: what first calls make (plans, the shared window
    grown, memory touched; MPICH allocates its allreduce's scratch memory at every
    call, which the C library maps anew, page by page, until a free of that size has
    raised its threshold) is not a call's typical cost. ``guess``: a call's expected
    time, for the batch (None: the last warm-up call's)."""
    from mpi4py import MPI

    began = time.perf_counter()
    comm.Barrier()
    for _ in range(WARM_UP - 1):
        f()
    start = time.perf_counter()
    f()
    last = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)  # a warm call's time
    batch = max(1, min(256, int(BATCH / max(last if guess is None else guess, 1e-7))))
    times = []
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(REPEATS):  # in a row, as a program's calls come: only the first meets the barrier's stragglers
        for _ in range(batch):
            f()
        now = time.perf_counter()
        times.append((now - start) / batch)
        start = now
    times.append(now - began)
    slowest = np.empty(len(times))
    comm.Allreduce(np.array(times), slowest, MPI.MAX)
    return float(slowest[:-1].min()), float(slowest[-1])


def _ring_time(comm, ring_comm, tag, algorithm="ring"):
    """The time of the library's ring allreduce (or ``algorithm``'s) of 64 float32s per
    rank among the ranks of ``ring_comm`` (None: this rank takes no part), on the lean
    executor as a large call's messages go: for the ring 2(k - 1) messages in a row,
    for direct 2 rounds of k - 1 (collective over ``comm``)."""
    from ..algorithms import build
    from ..schedule import compile_plan
    from ..transport import lean, retired
    from ..transport.buffers import Buffers
    from ..transport.scheduler import program_of

    if ring_comm is None:
        return _slowest(comm, lambda: None, 2 * REPEATS)
    rank, k = ring_comm.Get_rank(), ring_comm.Get_size()
    count = 64 * k
    plan = compile_plan(build("allreduce", algorithm, rank, k, count))
    program = program_of(plan)
    x, out, tmp = np.ones(count, np.float32), np.empty(count, np.float32), np.empty(max(plan.tmp, 1), np.float32)
    buffers = Buffers(x, out, tmp)
    return _slowest(comm, lambda: lean.run(program, ring_comm, tag, buffers, "sum", str, retired.abandon),
                    2 * REPEATS)
