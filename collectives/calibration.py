"""``auto`` on a machine with no measured table: the cost model calibrated here, once.

Where no tuning table matches the job's machine and layout, a :class:`~collectives.Communicator`
measures what the cost model (:class:`collectives.tuning.CostModel`) needs, on its own
ranks, when it is made (:func:`obtain`):

- the library's cost per message, ``alpha``: its ring allreduce of a few hundred bytes
  among each node's ranks, on the lean executor, over the number of messages in a row;
  and, with 3 ranks or more on a node, ``message``, what each message after the first
  of a round adds (its direct allreduce, 2 rounds of k - 1 messages): with more ranks
  than cores a message that waits for its peer to be scheduled costs far more than one
  sent beside it;
- within the node, the per-byte cost of a message, ``beta``: every rank sends
  ``PROBE_BYTES`` to the next rank of its node and receives from the previous one at
  once (all ranks stream together, as in a collective), and MPI's own latency,
  ``mpi_alpha``, from the same exchange of 8 bytes;
- the memory rate that bounds reductions, ``gamma``: ``np.add`` on ``PROBE_BYTES``
  arrays on every rank at once, seconds per byte reduced;
- across nodes (where the ranks span several): the link's rate, ``net_beta``
  (:func:`collectives.topology.measure_link`) and its latency, the same exchange of 8
  bytes between ranks on different nodes;
- MPI's own collective (``native``) for allreduce, reduce_scatter, allgather,
  broadcast and reduce at ``NATIVE_SIZES`` (64 KiB, 1 MiB, 4 MiB, and 16 MiB for
  allreduce; fewer where a call would take long): MPI's collectives run schedules
  and copies of their own, whose cost the model cannot know (MPICH 5's allreduce of 4
  MiB takes 1.3x what the same bytes through its point-to-point messages take here,
  and 2x at 64 MiB);
- the library's own ring allreduce at the same sizes (16 MiB too): its time over the model's
  prediction (:meth:`Calibration.correction`) scales every prediction of the
  library's algorithms at that size, for what the model leaves out (a call's fixed
  cost, MPI's protocol for messages of that size, the caches).

Every figure is the slowest rank's (each timing is reduced with MAX over the ranks),
the least of ``REPEATS`` runs, so every rank holds the same calibration and makes the
same choices. It takes 0.1-0.5
s at 2-4 ranks on one node. ``collectives.tuning.calibrated_choice`` then chooses:
below ``SMALL`` (64 KiB) and for gather, scatter, alltoall and alltoallv, ``native``;
above, the library's algorithm the calibrated model predicts fastest
(:func:`collectives.tuning.predict`), where MPI's measured time (interpolated between
the sizes measured, extended along the last two beyond them) is at least ``MARGIN``
(1.1x) its prediction; else ``native``. Only algorithms the model covers and that run
alike on every rank take part (no ``shm`` on registered buffers, a property of one
rank's input).

The result is cached per user (``$COLLECTIVES_CACHE_DIR``, else
``$XDG_CACHE_HOME/collectives``, else ``~/.cache/collectives``), one file per
fingerprint and layout (:func:`collectives.tuning.fingerprint`), written to a
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

CALIBRATE_ENV = "COLLECTIVES_CALIBRATE"
CACHE_ENV = "COLLECTIVES_CACHE_DIR"
FORMAT = 1
SMALL = 64 << 10  # below this many bytes auto stays native: MPI's per-call cost is a tenth of ours
MARGIN = 1.1  # MPI's time over the model's best before auto leaves native
PROBE_BYTES = 4 << 20  # the exchange and the reduction timed for beta and gamma
NATIVE_SIZES = (64 << 10, 1 << 20, 4 << 20)
# Allreduce, the collective that matters most, is also measured at 16 MiB (MPI's and
# the library's): past the caches MPICH's allreduce slows to twice its 4 MiB cost per
# byte here (1.3 ns/B at 64 MiB and 4 ranks against 0.64 at 4 MiB), which no line
# through the smaller sizes foresees.
LARGEST = 16 << 20
NATIVE = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")
SLOW_CALL = 0.03  # seconds: a native size (past the second) whose call would take longer is not measured
REPEATS = 3  # timings per figure, the least kept (twice as many for the smallest, 2 for the largest)


@dataclass
class Calibration:
    """What was measured (seconds; seconds per byte) and where."""

    alpha: float
    beta: float
    gamma: float
    mpi_alpha: float
    message: float = None  # one more of ours in a round (CostModel.message); None: alpha
    net_alpha: float = 0.0
    mpi_net_alpha: float = 0.0
    net_beta: float = 0.0
    native: dict = field(default_factory=dict)  # collective -> [[bytes, seconds], ...], ascending
    ring: list = field(default_factory=list)  # the library's ring allreduce: [[bytes, seconds], ...], ascending
    fingerprint: dict = field(default_factory=dict)
    key: str = ""
    seconds: float = 0.0  # how long measuring took
    measured_at: float = 0.0  # time.time() when it was measured
    source: str = "measured now"  # or the cache file it was read from

    def parameters(self):
        """The cost model's parameters measured (``collectives.tuning.CostModel``'s names;
        the network's only where the ranks span nodes)."""
        found = dict(alpha=self.alpha, mpi_alpha=self.mpi_alpha, beta=self.beta, gamma=self.gamma,
                     message=self.message)
        if self.net_beta:
            found.update(net_alpha=self.net_alpha, mpi_net_alpha=self.mpi_net_alpha, net_beta=self.net_beta)
        return found

    def native_time(self, collective, nbytes):
        """MPI's measured time for ``collective`` on ``nbytes``: linear between the sizes
        measured, along the last (or first) two beyond them; None where unmeasured."""
        points = self.native.get(collective)
        if not points:
            return None
        sizes = [b for b, _ in points]
        if len(points) == 1:
            return points[0][1] * max(nbytes, 1) / max(sizes[0], 1)
        i = min(max(bisect.bisect_right(sizes, nbytes) - 1, 0), len(points) - 2)
        (b0, t0), (b1, t1) = points[i], points[i + 1]
        return max(t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0), 0.0)

    def correction(self, predicted_ring, nbytes):
        """The library's measured time over the model's prediction, for its ring
        allreduce (``predicted_ring(bytes)``, seconds), at ``nbytes``: between the sizes
        measured, linear in the logarithm of the size; the nearest one's beyond them; 1
        where none was measured. It carries what the model leaves out (the call's fixed
        cost, MPI's protocol for a message of that size, the caches) into every
        prediction of the library's algorithms."""
        points = [(math.log2(b), t / predicted_ring(b)) for b, t in self.ring if predicted_ring(b) > 0]
        if not points:
            return 1.0
        x = math.log2(max(nbytes, 1))
        if x <= points[0][0]:
            return points[0][1]
        for (x0, f0), (x1, f1) in zip(points, points[1:]):
            if x <= x1:
                return f0 + (f1 - f0) * (x - x0) / (x1 - x0)
        return points[-1][1]

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

def obtain(comm, topology, fingerprint, key, tag, environ=None, link=None, link_tolerance=1.5):
    """The calibration for this job (collective over ``comm``, whose other traffic must
    wait: the Communicator calls it while it is made): rank 0's cached one where it
    matches, else measured now on every rank together and cached by rank 0. ``tag``: a
    base tag no call of ``comm`` uses yet; ``link``: the node-to-node rate already
    measured (bytes per second), if any; a cached calibration of several nodes counts
    where its link is within ``link_tolerance`` of this job's."""
    from mpi4py import MPI

    several = topology is not None and topology.node_count > 1
    if several and link is None:  # this job's link, to hold a cached calibration to
        from .topology import measure_link

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
    calibration = measure(comm, topology, tag, link)
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


def measure(comm, topology, tag, link=None):
    """Measure every figure of a :class:`Calibration` (collective). The node's figures
    (``alpha``, ``beta``, ``mpi_alpha``) are measured among each node's ranks at once
    (a ring within the node), the network's between nodes."""
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
            beta = max(_slowest(comm, lambda: exchange(big_out, big_in), 2) - mpi_alpha, 0.0) / PROBE_BYTES
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
            from .topology import measure_link

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
    calibration.native = _measure_native(comm, size)
    calibration.ring = _measure_ring(comm, size, tag)
    return calibration


def _measure_ring(comm, size, tag):
    """The library's ring allreduce over every rank of ``comm`` at NATIVE_SIZES, as a
    large call runs it (the lean executor), fewer where a call would take over
    ``SLOW_CALL``: ``[[bytes, seconds], ...]`` (collective)."""
    from .algorithms import build
    from .schedule import compile_plan
    from .transport import lean
    from .transport.buffers import Buffers
    from .transport.scheduler import program_of

    points = []
    for nbytes in NATIVE_SIZES + (LARGEST,):
        if len(points) >= 2 and points[-1][1] * nbytes / points[-1][0] > SLOW_CALL:
            break
        count = max(size, (nbytes // 4) // size * size)
        plan = compile_plan(build("allreduce", "ring", comm.Get_rank(), size, count))
        program = program_of(plan)
        buffers, kept = Buffers(np.ones(count, np.float32), np.empty(count, np.float32),
                                np.empty(max(plan.tmp, 1), np.float32)), []
        points.append([nbytes, _slowest(comm, lambda: lean.run(program, comm, tag, buffers, "sum", str, kept.append),
                                        _repeats(nbytes))])
    return points


def _repeats(nbytes):
    """Timed runs for a size: more for the small ones (a descheduled rank costs a small
    call milliseconds on a shared machine), 2 from 4 MiB up (each takes milliseconds)."""
    return 2 * REPEATS if nbytes < NATIVE_SIZES[1] else REPEATS if nbytes < NATIVE_SIZES[-1] else 2


def _ring_time(comm, ring_comm, tag, algorithm="ring"):
    """The time of the library's ring allreduce (or ``algorithm``'s) of 64 float32s per
    rank among the ranks of ``ring_comm`` (None: this rank takes no part), on the lean
    executor as a large call's messages go: for the ring 2(k - 1) messages in a row,
    for direct 2 rounds of k - 1 (collective over ``comm``)."""
    from .algorithms import build
    from .schedule import compile_plan
    from .transport import lean
    from .transport.buffers import Buffers
    from .transport.scheduler import program_of

    if ring_comm is None:
        return _slowest(comm, lambda: None, 2 * REPEATS)
    rank, k = ring_comm.Get_rank(), ring_comm.Get_size()
    count = 64 * k
    plan = compile_plan(build("allreduce", algorithm, rank, k, count))
    program = program_of(plan)
    x, out, tmp = np.ones(count, np.float32), np.empty(count, np.float32), np.empty(max(plan.tmp, 1), np.float32)
    buffers, kept = Buffers(x, out, tmp), []
    return _slowest(comm, lambda: lean.run(program, ring_comm, tag, buffers, "sum", str, kept.append), 2 * REPEATS)


def _measure_native(comm, size):
    """MPI's own collectives at NATIVE_SIZES (bytes as the tuning tables count them),
    largest sizes left out where the previous one's time says a call would take over
    ``SLOW_CALL`` (two sizes at least): ``{collective: [[bytes, seconds], ...]}``."""
    from mpi4py import MPI

    found = {}
    for collective in NATIVE:
        points = []
        for nbytes in NATIVE_SIZES + ((LARGEST,) if collective == "allreduce" else ()):
            if len(points) >= 2 and points[-1][1] * nbytes / points[-1][0] > SLOW_CALL:
                break
            call = _native_call(comm, collective, nbytes, size, MPI)
            points.append([nbytes, _slowest(comm, call, _repeats(nbytes))])
        found[collective] = points
    return found


def _native_call(comm, collective, nbytes, size, MPI):
    n = max(size, (nbytes // 4) // size * size)  # float32s, a multiple of the world size
    if collective == "allreduce":
        x, out = np.ones(n, np.float32), np.empty(n, np.float32)
        return lambda: comm.Allreduce(x, out, MPI.SUM)
    if collective == "reduce_scatter":
        x, out = np.ones(n, np.float32), np.empty(n // size, np.float32)
        return lambda: comm.Reduce_scatter_block(x, out, MPI.SUM)
    if collective == "allgather":  # nbytes: the gathered output
        x, out = np.ones(n // size, np.float32), np.empty(n, np.float32)
        return lambda: comm.Allgather(x, out)
    if collective == "broadcast":
        x = np.ones(n, np.float32)
        return lambda: comm.Bcast(x, 0)
    x, out = np.ones(n, np.float32), np.empty(n, np.float32)  # reduce
    return lambda: comm.Reduce(x, out, MPI.SUM, 0)
