"""What ``algorithm="auto"`` picks, per (collective, bytes, world size).

In order, the first that answers:

1. ``COLLECTIVES_<COLLECTIVE>_ALGORITHM`` (e.g. ``COLLECTIVES_ALLREDUCE_ALGORITHM=ring``)
   forces one algorithm for every size, like ``NCCL_ALGO`` or MPICH's CVARs;
2. a measured tuning table, **if it was measured here**: the file named by
   ``COLLECTIVES_TUNING``, else the table that ships with the package
   (``collectives/data/tuning.json``, measured on the development machine), if it
   has the world size (one node) or the node layout (several) and that entry's
   fingerprint (:func:`fingerprint`: CPU model, logical CPUs, ranks per node, nodes,
   MPI library and version) equals this job's on *every* rank. The ranks agree on
   it when the :class:`~collectives.Communicator` is made (one allreduce), so a job
   whose nodes differ falls back on all ranks together. An entry of several nodes
   also holds the node-to-node link ``--tune`` measured (``link_MBps``,
   :func:`collectives.topology.measure_link`): the job measures its own link when it
   is made (about 10 ms per MiB the probe sends, at 1 Gbit/s), only where such an entry
   matches it otherwise, and uses the entry only where its link is within
   ``LINK_TOLERANCE`` (1.5x either way) of it. Choices that win on a 1 Gbit/s network
   need not win on a 100 Gbit/s one. An entry without a
   fingerprint (a file written before fingerprints) is used only from a file named
   by ``COLLECTIVES_TUNING``: the user chose it;
3. where no host table matches, the cost model **calibrated on this machine**
   (:mod:`collectives.calibration`; :func:`calibrated_choice`): measured by the ranks
   together when the communicator is made, in well under a second, and cached per
   user for the fingerprint and layout; ``native`` below 64 KiB, above it the
   library's algorithm expected fastest (the model, scaled by the timings of the
   library's calls made while calibrating) where MPI's own, timed, takes 1.1x as
   long. ``COLLECTIVES_CALIBRATE=0``, or choosing a rule with
   ``COLLECTIVES_AUTO_RULE``, leaves it out;
4. the conservative rule (:func:`conservative_choice`): ``native`` unless the cost
   model predicts at least ``GAIN_NEEDED`` (2x) for one of the library's algorithms.
   ``COLLECTIVES_AUTO_RULE=cost-model`` asks for the older rule of
   :func:`collectives.algorithms.cost_model_choice` here instead (latency- then
   bandwidth-optimal algorithms, the two-level ones on several nodes).

Device arrays have tables of their own (``device_tables``, same fingerprint rule, and
an entry names the GPUs it was measured on, :func:`gpu_stamp`: the first call on a
device learns the ranks' GPUs, and a table of others is put aside from then on);
without one they take the device cost model (:func:`device_choice`): on one node the
fastest predicted of the peer-read algorithms (``one_shot``, ``two_shot``, ``leader``: the
last only where the ranks share a GPU, which the first peer-read call learns and tells
the selector, :meth:`Selector.learn_gpus`; until then they are taken to share one), the ring
over CUDA IPC and ``native`` staged (MPI's own collective on host copies), from the
parameters of :class:`DeviceCostModel`; across nodes the cost-model rule (the
conservative rule's model is calibrated for host buffers, and ``native`` there means
MPI on host copies).

In deterministic mode a choice that cannot reduce in rank order (see
``collectives.algorithms.ORDERED``) gives way to one that can, and an override that
names one is refused. ``comm.choose(collective, nbytes)`` says which rule decided.

Where no table matches, rank 0 of the first such communicator prints one line to
stderr (once per process) saying so (and, where it calibrated, how long that took)
and how to tune; ``COLLECTIVES_QUIET=1`` (or choosing a rule with
``COLLECTIVES_AUTO_RULE``) hides it. A calibration read from the cache says nothing.

A tuning file is what ``collectives-bench --tune`` writes::

    {"format": 1,
     "measured": {"4": {...how..., "fingerprint": {"cpu": "AMD EPYC", "cpus": 2,
                                                    "mpi": "MPICH Version: 5.0.2",
                                                    "nodes": 1, "ranks_per_node": 4}}, ...},
     "tables": {"allreduce": {"4": [[0, "native"], [65536, "ring"]], ...}, ...}}

``measured`` is keyed like the tables (``"4"``, ``"2x4"``; ``"4 device"`` for the
device tables). Each world size maps to a list of ``[from_bytes, algorithm]``,
ascending: the algorithm applies from ``from_bytes`` up to the next entry's (the
first entry also below its ``from_bytes``, which ``--tune`` writes as 0). ``bytes`` is
the size the benchmark reports: the input for allreduce, reduce_scatter, broadcast
and reduce, the gathered output for allgather and gather, the root's whole buffer for
scatter and a rank's whole input for alltoall.

The environment is read when a :class:`~collectives.Communicator` is created, and
bad values raise there, before any message is sent.
"""

import bisect
import functools
import json
import os
import platform
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from . import calibration as calibration_module
from . import mpi_library as mpi_library_module
from .algorithms import BUILDERS, COLLECTIVES, ORDERED, algorithms, check_ordered, cost_model_choice, two_level
from .cache import BoundedCache

FORMAT = 1
DEFAULT_TABLE = Path(__file__).parent / "data" / "tuning.json"
TUNING_ENV = "COLLECTIVES_TUNING"
RULE_ENV = "COLLECTIVES_AUTO_RULE"  # "conservative" (the default) or "cost-model"
RULES = ("conservative", "cost-model")
QUIET_ENV = "COLLECTIVES_QUIET"  # hides the one-line hint
GAIN_NEEDED = 2.0  # the conservative rule leaves native only for this predicted speedup
# A several-node entry's measured link (MB/s) in its fingerprint, and how far a job's
# own measurement may stray from it: a run's measurements differ by a few percent
# (113-118 MB/s in bench/results/testbed-1gbit), networks by factors of 10.
LINK = "link_MBps"
GPU = "gpu"  # a device table entry's stamp of the ranks' GPUs (gpu_stamp), checked at the first device call
GPU_NAME_BYTES = 64  # of a GPU's model name, as the device negotiation exchanges it
LINK_TOLERANCE = 1.5

# A node layout as Topology.key() writes it: nodes x ranks per node, or the node sizes.
LAYOUT_KEY = re.compile(r"[1-9][0-9]*x[1-9][0-9]*|[1-9][0-9]*(\+[1-9][0-9]*)+")


def override_variable(collective):
    """The environment variable that forces ``collective``'s algorithm."""
    return f"COLLECTIVES_{collective.upper()}_ALGORITHM"


def _concrete(collective):
    return tuple(a for a in algorithms(collective) if a != "auto")


# == fingerprints: where a table was measured =========================================

def _squeeze(text):
    return " ".join(str(text).split())


@functools.lru_cache(maxsize=None)
def cpu_model():
    """The CPU model: ``/proc/cpuinfo``'s first "model name" where there is one (Linux
    x86), else ``platform.processor()`` or ``platform.machine()``; spaces squeezed."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return _squeeze(value)
    except OSError:
        pass
    return _squeeze(platform.processor() or platform.machine() or "unknown")


def mpi_library():
    """The MPI library's family and version as fingerprints hold them: "MPICH 5.0.2",
    "Open MPI 5.0.11", "Intel MPI 2021.18.1" (:mod:`collectives.mpi_library`)."""
    return str(mpi_library_module.library())


def canonical(stamp):
    """``stamp`` (a fingerprint) with its MPI library written as :func:`mpi_library`
    writes it: a table stamped before fingerprints named the family ("MPICH Version:
    5.0.2", the version string's first line) still matches the same library."""
    if not isinstance(stamp, dict) or "mpi" not in stamp:
        return stamp
    return {**stamp, "mpi": str(mpi_library_module.parse(stamp["mpi"]))}


def _layout(topology, world_size):
    """``{"nodes": N, "ranks_per_node": k}``; k is an int where every node holds the
    same number of ranks, else the layout key (``"3+1"``)."""
    if topology is None:
        return {"nodes": 1, "ranks_per_node": world_size}
    sizes = topology.ranks_per_node
    return {"nodes": len(sizes), "ranks_per_node": sizes[0] if len(set(sizes)) == 1 else topology.key()}


def _machine():
    """The machine's part of a fingerprint: CPU model, logical CPUs, MPI library."""
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "mpi": mpi_library()}


def fingerprint(topology=None, world_size=None):
    """This machine and layout, as a tuning table's entries are stamped with it:
    ``{"cpu", "cpus", "mpi", "nodes", "ranks_per_node"}`` (CPU model, ``os.cpu_count()``,
    the MPI library's first version line, the node count and the ranks per node, from
    ``topology``, a :class:`~collectives.Topology`, or one node of ``world_size`` ranks)."""
    if topology is None and world_size is None:
        raise ValueError("fingerprint needs a topology or a world size")
    return {**_machine(), **_layout(topology, world_size)}


_this_fingerprint = fingerprint  # for Selector, whose argument of that name shadows it


def gpu_stamp(names, uuids):
    """The ranks' GPUs as a device table's entry is stamped with them (``GPU``): their
    models and how many distinct ones the ranks use, ``"NVIDIA H200 x1"`` (the ranks
    share one) or ``"NVIDIA H100 80GB HBM3 x4"``; ``names`` and ``uuids``: each rank's
    device's (a node's PCI address: on several alike nodes, the GPUs of one). A name
    counts by its first ``GPU_NAME_BYTES`` bytes, as the ranks exchange it."""
    names = {str(name).encode()[:GPU_NAME_BYTES].decode(errors="replace") for name in names}
    return f"{' + '.join(sorted(names))} x{len(set(uuids))}"


def link_stamp(rate):
    """A link rate in bytes per second as a fingerprint holds it: MB/s, 3 figures."""
    return float(f"{rate / 1e6:.3g}")


def fingerprint_for_key(key, link=None):
    """The fingerprint of this machine for a table key: ``"4"`` (one node of 4 ranks),
    ``"2x4"``, ``"3+1"`` (what ``collectives-bench --tune`` stamps each entry with);
    for several nodes, with ``link`` (bytes per second, measured) as ``link_MBps``."""
    key = str(key)
    if re.fullmatch(r"[1-9][0-9]*", key):
        layout = {"nodes": 1, "ranks_per_node": int(key)}
    elif re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*", key):
        nodes, per_node = key.split("x")
        layout = {"nodes": int(nodes), "ranks_per_node": int(per_node)}
    elif LAYOUT_KEY.fullmatch(key):
        layout = {"nodes": key.count("+") + 1, "ranks_per_node": key}
    else:
        raise ValueError(f"{key!r} is not a world size nor a node layout such as 2x4 or 3+1")
    if link is not None and layout["nodes"] > 1:
        layout[LINK] = link_stamp(link)
    return {**_machine(), **layout}


def describe_fingerprint(stamp):
    """A short text: ``AMD EPYC, 2 CPUs, MPICH 5.0.2, 1x4``."""
    mpi = re.sub(r"\s*\bVersion:?\s*", " ", str(stamp.get("mpi", "?"))).split(",")[0].strip()
    rpn = stamp.get("ranks_per_node", "?")
    layout = f"{stamp.get('nodes', '?')}x{rpn}" if isinstance(rpn, int) else f"{stamp.get('nodes', '?')} nodes {rpn}"
    link = f", a {stamp[LINK]:g} MB/s link" if LINK in stamp else ""
    gpus = f", GPUs {stamp[GPU]}" if GPU in stamp else ""
    return f"{stamp.get('cpu', '?')}, {stamp.get('cpus', '?')} CPUs, {mpi}, {layout}{link}{gpus}"


class TuningTable:
    """Size thresholds between algorithms, per collective and world size."""

    def __init__(self, tables, source="<memory>", measured=None):
        self.source = str(source)
        self._ranges = {}  # (collective, world_size) -> (from_bytes list, algorithm list)
        if not isinstance(tables, dict):
            raise ValueError(f"tuning table {self.source}: 'tables' must be an object")
        self.measured = self._check_measured(measured)
        for collective, by_size in tables.items():
            if collective not in COLLECTIVES:
                raise ValueError(f"tuning table {self.source}: unknown collective {collective!r}")
            if not isinstance(by_size, dict):
                raise ValueError(f"tuning table {self.source}, {collective}: expected an object keyed by world size")
            for world_size, entries in by_size.items():
                if isinstance(world_size, str) and re.fullmatch(r"[1-9][0-9]*", world_size):
                    key = int(world_size)
                elif isinstance(world_size, str) and LAYOUT_KEY.fullmatch(world_size):
                    key = world_size  # a layout of several nodes: "2x4", "3+1"
                else:
                    raise ValueError(f"tuning table {self.source}, {collective}: world size {world_size!r} "
                                     "is not a positive integer nor a node layout such as 2x4 or 3+1")
                self._ranges[collective, key] = self._check(collective, world_size, entries)

    def _check_measured(self, measured):
        """The file's ``measured`` object (key -> how and where); each entry's
        ``fingerprint``, where present, must be an object."""
        if measured is None:
            return {}
        if not isinstance(measured, dict):
            raise ValueError(f"tuning table {self.source}: 'measured' must be an object")
        for key, entry in measured.items():
            stamp = entry.get("fingerprint") if isinstance(entry, dict) else None
            if not isinstance(entry, dict) or not (stamp is None or isinstance(stamp, dict)):
                raise ValueError(f"tuning table {self.source}: measured[{key!r}] must be an object whose "
                                 "'fingerprint' is an object")
        return measured

    def stamp(self, key):
        """The fingerprint the entry ``key`` (``"4"``, ``"2x4"``, ``"4 device"``) was
        measured with, or None (none recorded: a file from before fingerprints)."""
        entry = self.measured.get(str(key))
        return entry.get("fingerprint") if entry is not None else None

    def has(self, world_size):
        """True if some collective has a table at ``world_size`` (an int, or a layout key)."""
        return any(size == world_size for _, size in self._ranges)

    def _check(self, collective, world_size, entries):
        where = f"tuning table {self.source}, {collective} at world size {world_size}"
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"{where}: expected a non-empty list of [from_bytes, algorithm]")
        starts, names = [], []
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int and entry[0] >= 0):
                raise ValueError(f"{where}: entry {entry!r} is not [from_bytes, algorithm]")
            if entry[1] not in _concrete(collective):
                raise ValueError(f"{where}: algorithm {entry[1]!r} is not one of {', '.join(_concrete(collective))}")
            if starts and entry[0] <= starts[-1]:
                raise ValueError(f"{where}: from_bytes must increase; {entry[0]} follows {starts[-1]}")
            starts.append(entry[0])
            names.append(entry[1])
        starts[0] = 0  # the first entry covers everything below the second
        return starts, names

    @classmethod
    def load(cls, path, key="tables"):
        """Read a tuning file's ``tables`` (or, with ``key="device_tables"``, the ones
        measured on device arrays: None if the file has none); raises ``ValueError``
        naming the file on anything malformed."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read tuning file {path}: {exc}") from exc
        if not isinstance(data, dict) or type(data.get("format")) is not int or data["format"] != FORMAT:
            raise ValueError(f"tuning file {path}: expected an object with \"format\": {FORMAT}")
        if key != "tables" and key not in data:
            return None
        return cls(data.get(key), source=f"{path} ({key})" if key != "tables" else path,
                   measured=data.get("measured"))

    def world_sizes(self, collective):
        return sorted(size for c, size in self._ranges if c == collective and isinstance(size, int))

    def lookup(self, collective, nbytes, world_size):
        """The measured choice, or None if the table lacks this world size."""
        ranges = self._ranges.get((collective, world_size))
        if ranges is None:
            return None
        starts, names = ranges
        return names[bisect.bisect_right(starts, nbytes) - 1]


# == the conservative rule: native unless the cost model predicts a 2x gain ============

@dataclass(frozen=True)
class CostModel:
    """The conservative rule's α-β-γ parameters, in seconds and seconds per byte.

    ``alpha`` is one of this library's messages in a node (a Python round trip through
    the plan engine), ``mpi_alpha`` one of MPI's own (about a tenth); ``beta`` and
    ``gamma``, per byte sent and reduced, are the same for both (the same memory and
    transport carry the bytes). Between nodes a message costs ``net_alpha`` (ours) or
    ``mpi_net_alpha`` (MPI's), plus ``net_beta`` per byte on its node's link, which
    the node's ranks share. The defaults are the calibrations shipped in
    ``bench/results``: in a node, the joint fit at 2 and 4 ranks of
    ``epyc-2vcpu-mpich5/README.md`` (α 22 µs, rounded to 20; β 0.166 ns/B; γ 0.093 ns/B);
    between nodes, the two-level fit of ``testbed-1gbit/README.md`` (α′ 50 µs for ours,
    MPI's taken as that less our extra 18 µs per message; β′ 8.43 ns/B, 1 Gbit/s).

    ``alpha`` is a message that waits for the one before it (a step of a ring, say).
    ``message``, where set, is one more of ours in the same round, sent while the
    round's first is in flight (``direct``'s p - 1 at once): with more ranks than
    cores a step costs a wait for the peer to be scheduled, which the messages of one
    round share, so it is less than ``alpha`` there (:mod:`collectives.calibration`
    measures both). None: ``alpha``, as the shipped model has it."""

    alpha: float = 20e-6
    mpi_alpha: float = 2e-6
    beta: float = 0.166e-9
    gamma: float = 0.093e-9
    net_alpha: float = 50e-6
    mpi_net_alpha: float = 32e-6
    net_beta: float = 8.43e-9
    message: float | None = None


SHIPPED_MODEL = CostModel()


def _lg(x):
    """⌈lg x⌉ for x >= 1."""
    return (int(x) - 1).bit_length()


class _Net:
    """The layout as the model sees it: p ranks on N nodes of at most k ranks (m on the
    smallest), ``blocked`` where each node holds consecutive ranks. For a flat schedule
    each method says how many of a node's ranks send across the network at once in a
    step where rank r's partner is at distance d (0: the step stays in the nodes)."""

    def __init__(self, size, topology):
        sizes = topology.ranks_per_node if topology is not None and topology.size == size else (size,)
        self.p, self.N, self.k, self.m = size, len(sizes), max(sizes), min(sizes)
        self.blocked = topology is None or topology.contiguous
        self.even = self.k == self.m and self.k & (self.k - 1) == 0  # equal nodes of 2^j ranks

    def xor(self, d):  # partners r ^ d (recursive doubling and halving)
        if self.N == 1:
            return 0
        if not self.blocked:
            return self.k
        return (0 if d < self.k else self.k) if self.even else min(d, self.k)

    def shift(self, d):  # partners r ± d (ring: d = 1; Bruck)
        return 0 if self.N == 1 else min(d, self.k) if self.blocked else self.k

    def tree(self, d):  # a binomial tree's step at distance d: one sender per subtree
        if self.N == 1:
            return 0
        if self.blocked:
            return 0 if self.even and d < self.k else 1
        return min(self.k, max(1, self.p // (2 * d * self.N)))


def _step(model, ours, nbytes, crossing=0, reduced=0.0):
    """One step in which each rank sends ``nbytes`` (and reduces ``reduced``), with
    ``crossing`` of a node's ranks sending across the network at once."""
    if crossing:
        alpha = model.net_alpha if ours else model.mpi_net_alpha
        return alpha + max(nbytes * model.beta, crossing * nbytes * model.net_beta) + reduced * model.gamma
    return (model.alpha if ours else model.mpi_alpha) + nbytes * model.beta + reduced * model.gamma


def _distances(p):
    """1, 2, 4, … p'/2, p' = 2^⌊lg p⌋: the steps of the recursive algorithms."""
    return [1 << i for i in range(p.bit_length() - 1)]


def _fold(model, net, ours, out, back):
    """Not a power of two: pairs fold onto p' ranks (``out`` bytes sent and reduced)
    and get ``back`` bytes at the end."""
    if net.p & (net.p - 1) == 0:
        return 0.0
    return _step(model, ours, out, net.shift(1), out) + _step(model, ours, back, net.shift(1))


def _recursive_doubling(model, net, n, ours):  # allreduce: the whole buffer at each step
    return sum(_step(model, ours, n, net.xor(d), n) for d in _distances(net.p)) + _fold(model, net, ours, n, n)


def _halving(model, net, n, ours, ascending, whole):
    """Recursive halving (reduce_scatter; with ``whole``, then recursive doubling back:
    Rabenseifner's allreduce). The halves n/2, n/4, … go at distances 1, 2, … where
    ``ascending`` (MPICH's allreduce), at p'/2, p'/4, … otherwise (this library's)."""
    ds = _distances(net.p)
    pairs = list(zip(ds if ascending else ds[::-1], (n / 2 ** (i + 1) for i in range(len(ds)))))
    t = sum(_step(model, ours, m, net.xor(d), m) for d, m in pairs)
    if whole:
        return 2 * t - sum(m for _, m in pairs) * model.gamma + _fold(model, net, ours, n, n)
    return t + _fold(model, net, ours, n, n / net.p)


def _ring(model, net, n, ours, reducing, plain):
    b = n / net.p
    return reducing * _step(model, ours, b, net.shift(1), b) + plain * _step(model, ours, b, net.shift(1))


def _direct(model, net, n, ours, rounds, reduced):
    """``rounds`` rounds in which every rank sends a block of n/p to every other rank,
    one message at a time through its port; the node's link carries its ranks'
    blocks for the other nodes. ``reduced``: bytes each rank reduces, (p-1)/p·n where
    it reduces its own block of every other rank's (docs/algorithms.md)."""
    p, k, b = net.p, net.k, n / net.p
    alpha, net_alpha = (model.alpha, model.net_alpha) if ours else (model.mpi_alpha, model.mpi_net_alpha)
    # The round's first message waits; the other k - 2 of the node go with it (model.message).
    node = alpha + (k - 2) * (model.message if ours and model.message is not None else alpha) if k > 1 else 0.0
    per_round = node + (p - k) * net_alpha + max((p - 1) * b * model.beta, k * (p - k) * b * model.net_beta)
    return rounds * per_round + reduced * model.gamma


def _doubling_gather(model, net, n, ours):  # allgather, recursive doubling
    p2 = 1 << (net.p.bit_length() - 1)
    return sum(_step(model, ours, d * n / p2, net.xor(d)) for d in _distances(net.p)) \
        + _fold(model, net, ours, n / net.p, n) - (n / net.p * model.gamma if net.p != p2 else 0.0)


def _bruck(model, net, n, ours, alltoall=False):
    steps, d = [], 1
    while d < net.p:
        steps.append((n / 2 if alltoall else min(d, net.p - d) * n / net.p, net.shift(d)))
        d *= 2
    return sum(_step(model, ours, m, c) for m, c in steps)


def _tree_distances(p):
    """1, 2, 4, … below p: the ⌈lg p⌉ steps of a binomial tree."""
    return [1 << i for i in range(_lg(p))]


def _binomial_broadcast(model, net, n, ours):  # n at each step, far partners first
    return sum(_step(model, ours, n, net.tree(d)) for d in _tree_distances(net.p))


def _binomial_reduce(model, net, n, ours):  # n reduced at each step, near partners first
    return sum(_step(model, ours, n, net.tree(d), n) for d in _tree_distances(net.p))


def _binomial_gather(model, net, n, ours):  # gather or scatter (n: the whole): d blocks at distance d
    return sum(_step(model, ours, min(d, net.p - d) * n / net.p, net.tree(d)) for d in _tree_distances(net.p))


def _pairwise(model, net, n, ours):  # alltoall: p - 1 steps; on average k(N-1)/N of a node's ranks cross
    return (net.p - 1) * _step(model, ours, n / net.p, net.k * (net.N - 1) / net.N)


# == what predict times, per collective ================================================
# Each function takes the model, the layout (_Net) and n, the bytes as a tuning table
# counts them, and returns (native, ours): the times of the classic schedules MPI's own
# collective may run, at MPI's cost per message and flat (predict keeps the least), and
# {algorithm: seconds} of this library's flat algorithms (where two tie, the rules take
# the one listed first).

def _allreduce_times(model, net, n):
    p = net.p
    native = [_recursive_doubling(model, net, n, False), _halving(model, net, n, False, True, True),
              _ring(model, net, n, False, p - 1, p - 1)]
    ours = {"recursive_doubling": _recursive_doubling(model, net, n, True),
            "recursive_halving": _halving(model, net, n, True, False, True),
            "ring": _ring(model, net, n, True, p - 1, p - 1),
            "direct": _direct(model, net, n, True, 2, (p - 1) / p * n)}
    return native, ours


def _reduce_scatter_times(model, net, n):
    p = net.p
    native = [_halving(model, net, n, False, False, False), _ring(model, net, n, False, p - 1, 0)]
    ours = {"recursive_halving": _halving(model, net, n, True, False, False),
            "ring": _ring(model, net, n, True, p - 1, 0),
            "direct": _direct(model, net, n, True, 1, (p - 1) / p * n)}
    return native, ours


def _allgather_times(model, net, n):  # n: the gathered size
    p = net.p
    native = [_doubling_gather(model, net, n, False), _bruck(model, net, n, False),
              _ring(model, net, n, False, 0, p - 1)]
    ours = {"recursive_doubling": _doubling_gather(model, net, n, True), "bruck": _bruck(model, net, n, True),
            "ring": _ring(model, net, n, True, 0, p - 1), "direct": _direct(model, net, n, True, 1, 0)}
    return native, ours


def _broadcast_times(model, net, n):
    p = net.p
    scatter_allgather = [_binomial_gather(model, net, n, mine) + _ring(model, net, n, mine, 0, p - 1)
                         for mine in (False, True)]
    native = [_binomial_broadcast(model, net, n, False), scatter_allgather[0]]
    ours = {"binomial": _binomial_broadcast(model, net, n, True), "scatter_allgather": scatter_allgather[1]}
    return native, ours


def _reduce_times(model, net, n):  # MPI's long-message reduce: reduce_scatter, then a binomial gather
    p = net.p
    native = [_binomial_reduce(model, net, n, False),
              _halving(model, net, n, False, True, False) + _binomial_gather(model, net, n, False)]
    ours = {"binomial": _binomial_reduce(model, net, n, True),
            "direct": _direct(model, net, n, True, 2, (p - 1) / p * n)}
    return native, ours


def _gather_times(model, net, n):  # gather (n: the gathered size) and scatter (the root's buffer) alike
    return [_binomial_gather(model, net, n, False)], {"binomial": _binomial_gather(model, net, n, True)}


def _alltoall_times(model, net, n):  # n: a rank's whole input
    native = [_pairwise(model, net, n, False), _bruck(model, net, n, False, alltoall=True)]
    ours = {"pairwise": _pairwise(model, net, n, True), "bruck": _bruck(model, net, n, True, alltoall=True)}
    return native, ours


def _alltoallv_times(model, net, n):  # as alltoall's equal blocks
    return [_pairwise(model, net, n, False)], {"pairwise": _pairwise(model, net, n, True)}


# collective -> its flat times; ``tree`` and ``pipeline`` are left out (not modelled).
FLAT_TIMES = {"allreduce": _allreduce_times, "reduce_scatter": _reduce_scatter_times, "allgather": _allgather_times,
              "broadcast": _broadcast_times, "reduce": _reduce_times, "gather": _gather_times,
              "scatter": _gather_times, "alltoall": _alltoall_times, "alltoallv": _alltoallv_times}


# This library's two-level algorithms (docs/algorithms.md's second table; N nodes, k
# ranks per node: the smallest node's, m, for ``hierarchical`` allreduce, which folds
# the others' extra ranks in first): {algorithm: seconds}.

def _allreduce_two_level(model, net, n):
    a, an, b, bn, g = model.alpha, model.net_alpha, model.beta, model.net_beta, model.gamma
    N, k, m = net.N, net.k, net.m
    hier = 2 * (m - 1) * (a + n / m * b) + 2 * (N - 1) * (an + n / N * bn) \
        + ((m - 1) / m + (N - 1) / (m * N)) * n * g
    if k != m:  # the fold onto the smallest node's size, and the result handed back
        hier += 2 * (a + n * b) + n * g
    leader = 2 * _lg(k) * (a + n * b) + _lg(N) * (an + n * bn) + (_lg(k) + _lg(N)) * n * g
    return {"hierarchical": hier, "hierarchical_leader": leader}


def _broadcast_two_level(model, net, n):
    a, an, b, bn = model.alpha, model.net_alpha, model.beta, model.net_beta
    N, k = net.N, net.k
    return {"hierarchical": (_lg(N) + N - 1) * an + 2 * (N - 1) / N * n * bn + _lg(k) * (a + n * b)}


def _allgather_two_level(model, net, n):
    a, an, b, bn = model.alpha, model.net_alpha, model.beta, model.net_beta
    N, k, p = net.N, net.k, net.p
    return {"hierarchical": _lg(k) * a + (k - 1) / p * n * b + (N - 1) * (an + n / N * bn) + _lg(k) * (a + n * b)}


def _reduce_scatter_two_level(model, net, n):
    a, an, b, bn, g = model.alpha, model.net_alpha, model.beta, model.net_beta, model.gamma
    N, k, p = net.N, net.k, net.p
    return {"hierarchical": _lg(k) * (a + n * b + n * g) + (N - 1) * (an + n / N * (bn + g))
            + (k - 1) * (a + n / p * b)}


# collective -> its two-level times; the collectives not here have no two-level algorithm.
TWO_LEVEL_TIMES = {"allreduce": _allreduce_two_level, "broadcast": _broadcast_two_level,
                   "allgather": _allgather_two_level, "reduce_scatter": _reduce_scatter_two_level}


def predict(collective, nbytes, size, topology=None, model=SHIPPED_MODEL):
    """``(native, ours)``: the predicted seconds of MPI's own collective, modelled as the
    best of the classic schedules MPI itself uses (recursive doubling and halving,
    ring, Bruck, binomial trees, pairwise exchange) at MPI's per-message cost and
    topology-unaware (flat, whatever the nodes), and ``{algorithm: seconds}`` for this
    library's algorithms the model covers (``tree`` and ``pipeline`` it leaves out),
    the two-level ones where there are several nodes with more than one rank on some.
    ``nbytes`` as for a tuning table (allgather and gather: the gathered size; scatter:
    the root's buffer; alltoall: a rank's whole input). The formulas are the
    collective's entries in ``FLAT_TIMES`` and ``TWO_LEVEL_TIMES``."""
    net, n = _Net(size, topology), float(nbytes)
    times = FLAT_TIMES.get(collective)
    if times is None:
        raise ValueError(f"collective must be one of {', '.join(BUILDERS)}; got {collective!r}")
    native, ours = times(model, net, n)
    if two_level(topology) and collective in TWO_LEVEL_TIMES:
        ours.update(TWO_LEVEL_TIMES[collective](model, net, n))
    return min(native), ours


def conservative_choice(collective, nbytes, size, topology=None, model=SHIPPED_MODEL, needed=GAIN_NEEDED):
    """``(algorithm, gain, best)``: what the conservative rule picks where no measured
    table answers. ``best`` is this library's algorithm with the lowest predicted time
    (:func:`predict`) and ``gain`` native's predicted time over it; the rule picks
    ``best`` if ``gain >= needed`` (2), else ``native``. The model is coarse (and the
    per-message costs differ from machine to machine), so only a large predicted gain
    moves ``auto`` off the MPI library's own collective; a measured table decides
    finer. With the shipped parameters: on one node, never (MPI runs the same
    schedules as ours at a tenth of the cost per message: at most 1.0x, 1.6x for a
    3-rank reduce); on several nodes, the two-level algorithms where ranks are not
    placed node by node (a flat schedule then crosses the network at nearly every
    step), and with 8 or more ranks per node the two-level allgather and
    reduce_scatter at some sizes between 4 KiB and 1 MiB (a flat ring crosses the
    network p - 1 times, at MPI's cost per message there)."""
    if size < 2:
        return "native", 1.0, None
    native, ours = predict(collective, nbytes, size, topology, model)
    best = min(ours, key=ours.get)
    gain = native / ours[best] if ours[best] > 0 else 1.0
    return (best if gain >= needed else "native"), gain, best


# == the device cost model: peer reads, the ring and staged native, on one node ========

@dataclass(frozen=True)
class DeviceCostModel:
    """The device rule's parameters where no device table was measured, in seconds and
    bytes per second: ``call`` the host's work of one call, ``fence`` one synchronisation
    of the node's ranks, ``launch`` one kernel or copy, ``bandwidth`` the device's copy
    rate B (bytes read plus written per second; ``shared``: the node's ranks share one
    GPU, whose memory carries the sum of their traffic), ``switch`` what each further
    process whose device work a call waits for costs on a GPU the ranks share (the GPU
    runs one process at a time: it switches to each in turn, per round of kernels), for
    the ring over CUDA IPC ``ipc_step`` the host's handshake of one message and
    ``ipc_rate`` its bytes per second, and for ``native`` on device arrays (staged: the
    input device -> pinned host, the MPI library's own collective on the host copies,
    the result back, two switches a process) ``staged_fixed`` its cost beyond ``call``
    and ``staged_rate`` the bytes per second of what crosses the host
    (``STAGED_BYTES``: copied in plus copied back), MPI's own work on the host copies
    included. ``one_gpu``: every rank of the node on one GPU (the leader algorithms
    are for that node alone); ``kernel_fences``: the fences are in-kernel flags (the
    mechanism of ranks with a GPU each), costing ``own_fence``, no host in them.

    The defaults come from the one GPU measured with peer reads
    (bench/results/NVIDIA-H200: 2 and 4 ranks sharing one H200, MPICH 5.0.2 not
    CUDA-aware). B: its copy, 4.0-4.1 TB/s. ``call``, ``fence`` and ``switch`` solve
    one_shot allreduce at 8 B, 440 us at 2 ranks and 820 at 4 (2 fences and p - 1
    switches); they then give two_shot (two rounds of kernels) 630 and 1390 us against
    830 and 1200-1500 measured, and broadcast at 64 MiB (p - 1 processes copy) 280 and
    730 us against 147 and 704. ``ipc_step``: one handshake of a 4-byte ring allgather,
    639 us at 2 ranks and 575 at 4 (the 8 B ring allreduce, 2(p - 1) handshakes, took
    less: 831 and 2228 us, against 1240 and 3640 from it). ``staged_fixed``: native at
    8 B, 470 us at 2 ranks (1142 at 4: the model says 1230); ``staged_rate`` the
    least-squares fit (in relative error) of native allreduce from 1 to 256 MiB at 2 and
    4 ranks, within -60% to +62% of them (42% rms: MPI's reduction on the host slows past
    16 MiB). ``own_fence`` has not been measured (no machine with a GPU per rank was
    lent): 10 us, the order of the whole small allreduces that flag-based
    implementations report on 8 H100s over NVLink (4-25 us); ``fence``, measured with
    host fences on a shared GPU, would make the staged ``native`` win every small call
    there. A device table (``collectives-bench --device cuda --tune``, or ``make
    bench-gpu``'s tuning.json) replaces the whole rule."""

    call: float = 40e-6
    fence: float = 100e-6
    own_fence: float = 10e-6
    launch: float = 6e-6
    bandwidth: float = 4.0e12
    shared: bool = True
    one_gpu: bool = True
    kernel_fences: bool = False
    switch: float = 190e-6
    ipc_step: float = 600e-6
    ipc_rate: float = 15e9
    staged_fixed: float = 50e-6
    staged_rate: float = 4.0e9


SHIPPED_DEVICE_MODEL = DeviceCostModel()


def _kernels(inputs):
    """Kernels a phase of the peer reads launches over ``inputs`` buffers: a fold or a
    copy kernel takes 16 (``collectives.transport.peer_phases``)."""
    return -(-inputs // 16)


def _fanned_kernels(p):
    """Kernels of the allgather leader's copies: each of the p inputs read once into the p
    outputs, 16 // p inputs a kernel; past 16 ranks a copy each, 16 a kernel
    (``collectives.transport.peer_phases``)."""
    return -(-p // (16 // p)) if p <= 16 else _kernels(p * p)


# Per collective, for predict_device: each peer-read algorithm's memory traffic (bytes,
# of n the table's bytes at p ranks), kernel launches, how many ranks run device work
# and in how many rounds (the kernels before, between and after its fences); then the
# message-based contender over CUDA IPC, its rounds of p - 1 handshakes and the bytes of
# one step.
DEVICE_COSTS = {
    # leader: rank 0 reads p·n and writes p·n, 2n a rank on average; one kernel to 16 ranks
    "allreduce": ({"one_shot": (lambda p, n: (p + 1) * n, lambda p: _kernels(p), lambda p: p, 1),
                   "two_shot": (lambda p, n: (3 + 1 / p) * n, lambda p: 2 * _kernels(p), lambda p: p, 2),
                   "leader": (lambda p, n: 2 * n, lambda p: _kernels(p) * (1 if p <= 16 else 2), lambda p: 1, 1)},
                  "ring", 2, lambda p, n: n / p),
    # the leaders (rank 0, broadcast's root) move what every rank of one_shot does, alone
    "reduce_scatter": ({"one_shot": (lambda p, n: (1 + 1 / p) * n, lambda p: _kernels(p), lambda p: p, 1),
                        "leader": (lambda p, n: (1 + 1 / p) * n, lambda p: 1 if p <= 16 else p * _kernels(p),
                                   lambda p: 1, 1)},
                       "ring", 1, lambda p, n: n / p),
    # its own row before the first fence, the others' after it; the leader reads each input
    # once into the p outputs (n read, pn written), 16 // p inputs a kernel
    "allgather": ({"one_shot": (lambda p, n: 2 * n, lambda p: 1 + _kernels(p - 1), lambda p: p, 2),
                   "leader": (lambda p, n: (1 + 1 / p) * n, _fanned_kernels, lambda p: 1, 1)}, "ring", 1,
                  lambda p, n: n / p),
    # the root reads nothing: p - 1 ranks copy (the leader: the root reads n once and writes
    # it p - 1 times); broadcast has no ring, its tree moves as much here
    "broadcast": ({"one_shot": (lambda p, n: 2 * n * (p - 1) / p, lambda p: 1, lambda p: p - 1, 1),
                   "leader": (lambda p, n: n, lambda p: _kernels(p - 1), lambda p: 1, 1)},
                  "binomial", 1, lambda p, n: n),
    # the root folds every input
    "reduce": ({"one_shot": (lambda p, n: (p + 1) * n / p, lambda p: _kernels(p), lambda p: 1, 1)}, "direct", 2,
               lambda p, n: n / p),
}

# Per collective, for predict_device: the bytes of a staged ``native`` call that cross
# between device and host one after the other (of n the table's bytes at p ranks): the
# input copied to the host, then the result copied back (a broadcast's root copies in,
# the others back; a reduce's ranks copy in, the root back).
STAGED_BYTES = {
    "allreduce": lambda p, n: n + n,
    "reduce_scatter": lambda p, n: n + n / p,
    "allgather": lambda p, n: n / p + n,  # n: the gathered size
    "broadcast": lambda p, n: n + n,
    "reduce": lambda p, n: n + n,
}

# How device_choice's explanation names each contender where the name alone would not say.
DEVICE_NAMES = {"native": "native (staged: MPI's own on host copies)"}


def predict_device(collective, nbytes, size, model=SHIPPED_DEVICE_MODEL):
    """``{algorithm: seconds}`` of the peer-read algorithms of ``collective``, its ring
    (over CUDA IPC) and ``native`` (staged: the MPI library's own collective on host
    copies) on one node of ``size`` ranks, ``nbytes`` as a tuning table counts them
    (allgather: the gathered size). The peer reads cost ``call`` + two fences (``fence``;
    ``own_fence`` where they are in-kernel flags) + their
    launches + their memory traffic (:mod:`collectives.algorithms.peer`'s docstring;
    all ranks' where they share a GPU, one rank's where each has its own) + where they
    share one, a ``switch`` per further rank with device work, per round of it; the ring
    2(p-1) (allreduce) or p-1 handshakes and its bytes at ``ipc_rate``; ``native``
    ``call`` + ``staged_fixed`` + its ``STAGED_BYTES`` at ``staged_rate`` (+ two rounds
    of switches on a shared GPU)."""
    p, n, m = size, float(nbytes), model
    ranks = p if m.shared else 1  # whose traffic one device's memory carries

    def switches(working, rounds):  # a GPU the ranks share runs one process's work at a time
        return m.switch * rounds * max(working - 1, 0) if m.shared else 0.0

    fence = m.own_fence if m.kernel_fences else m.fence

    def peer(traffic, launches, working, rounds):
        return (m.call + 2 * fence + launches * m.launch + ranks * traffic / m.bandwidth
                + switches(working, rounds))

    if collective not in DEVICE_COSTS:
        return {}
    reads, other, rounds, step = DEVICE_COSTS[collective]
    times = {algorithm: peer(traffic(p, n), launches(p), working(p), kernel_rounds)
             for algorithm, (traffic, launches, working, kernel_rounds) in reads.items()}
    times[other] = m.call + rounds * (p - 1) * (m.ipc_step + step(p, n) / m.ipc_rate)
    if not (m.shared and m.one_gpu):  # the leader's GPU would carry every rank's traffic alone: for ranks on one
        times.pop("leader", None)
    times = {a: t for a, t in times.items() if a in BUILDERS[collective]}
    # native is no builder: MPI's own collective, which every collective has; its copy in
    # and its copy back are a round each on every rank's device
    times["native"] = m.call + m.staged_fixed + STAGED_BYTES[collective](p, n) / m.staged_rate + switches(p, 2)
    return times


def device_choice(collective, nbytes, size, topology=None, model=SHIPPED_DEVICE_MODEL):
    """``(algorithm, why)``: the device rule where no device table answers. On one node,
    the fastest of :func:`predict_device` (the peer reads, the ring over CUDA IPC, or
    ``native`` staged through host copies); elsewhere (several nodes, or a collective
    without peer-read algorithms) the cost-model rule."""
    one_node = topology is None or topology.node_count == 1
    times = predict_device(collective, nbytes, size, model) if one_node and size > 1 else {}
    if not times:
        return cost_model_choice(collective, nbytes, size, topology=topology), "cost-model rule"
    best = min(times, key=times.get)
    said = ", ".join(f"{DEVICE_NAMES.get(a, a)} {t * 1e6:.0f} us"
                     for a, t in sorted(times.items(), key=lambda item: item[1]))
    return best, f"device cost model on one node (predicted: {said})"


def calibrated_choice(calibration, collective, nbytes, size, topology=None):
    """``(algorithm, why)``: what the model calibrated on this machine picks
    (:mod:`collectives.calibration`): ``native`` below ``calibration.SMALL`` and for
    the collectives whose MPI's own it did not time; else the library's algorithm
    expected fastest (:meth:`~collectives.calibration.Calibration.times`: the model's
    prediction with the measured parameters, scaled by what that algorithm's timings
    here say of it), where MPI's own, timed, takes at least ``calibration.MARGIN``
    (1.1x) as long; else ``native``."""
    small, margin = calibration_module.SMALL, calibration_module.MARGIN
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


_hinted = False  # the one-line hint: printed once per process


class Selector:
    """Resolves ``auto`` for one communicator's world size (decisions are cached).

    ``table`` and ``device_table`` answer where their entry for this world size (one
    node) or layout (several) is stamped with this job's ``fingerprint`` (default:
    :func:`fingerprint` of this machine and ``topology``) or, if ``unstamped``, has no
    stamp. ``agree`` makes that decision the same on every rank: it is given this
    rank's bits (1: the table is usable here, 2: the device table is; 4 and 8: each is,
    if this job's link is the one its entry holds) and returns their bitwise AND over
    the ranks (the :class:`~collectives.Communicator` passes an allreduce); where 4 or
    8 survives, every rank measures the link and agrees once more on bits 1 and 2.
    ``rule`` answers where no table does: ``"conservative"`` or ``"cost-model"``.
    ``measure_link`` (collective: bytes per second, the same on every rank) is called
    where every rank's entry of several nodes holds a link (see the module's
    docstring); ``link`` is then what it measured. ``calibrate(fingerprint, key,
    link)`` (collective; a :class:`~collectives.calibration.Calibration`, the same on
    every rank) is called where no host table is usable and every rank passed one (bit
    16 of the agreement): the calibrated model then answers before ``rule``
    (:mod:`collectives.calibration`)."""

    def __init__(self, world_size, table=None, overrides=None, device_table=None, deterministic=False, topology=None,
                 *, fingerprint=None, unstamped=True, agree=None, rule="conservative", measure_link=None,
                 calibrate=None):
        if rule not in RULES:
            raise ValueError(f"{RULE_ENV} must be one of {', '.join(RULES)}; got {rule!r}")
        self.world_size = world_size
        self.topology = topology  # the node layout (None: one node)
        self.deterministic = deterministic
        self.table = table
        self.device_table = device_table  # measured on device arrays (collectives-bench --device --tune)
        self.overrides = dict(overrides or {})
        self.rule = rule
        self.unstamped = unstamped  # entries without a fingerprint count (a file the user named)
        self.several = topology is not None and topology.node_count > 1
        # A table keyed by the world size alone was measured on one node; several
        # nodes need one keyed by their layout ("2x4", "3+1").
        self.key = topology.key() if self.several else world_size
        self.fingerprint = canonical(dict(fingerprint)) if fingerprint is not None else _this_fingerprint(
            topology if self.several else None, world_size)
        agree = agree or (lambda bits: bits)
        here = [self._usable(table, ""), self._usable(device_table, " device")]
        # Bits 0-1: usable; bits 2-3: usable if this job's link is the one measured there.
        agreed = agree(sum(1 << i for i, (ok, _) in enumerate(here) if ok is True)
                       + sum(4 << i for i, (ok, _) in enumerate(here) if ok == "link")
                       + (16 if calibrate is not None else 0))
        self.link = None
        if agreed & 12:  # every rank is waiting on the link: every rank measures it, together
            self.link = measure_link() if measure_link is not None else None
            here = [self._link_verdict((table, device_table)[i], suffix) if agreed & 4 << i else (ok, why)
                    for i, ((ok, why), suffix) in enumerate(zip(here, ("", " device")))]
            agreed |= agree(sum(1 << i for i in range(2) if agreed & 4 << i and here[i][0] is True))
        self.in_use = [bool(agreed & 1 << i) for i in range(2)]  # [host table, device table]
        self._why_not = [why if ok is False else None if self.in_use[i] else "another rank's machine or layout "
                         f"differs from the one {(table, device_table)[i].source} was measured on"
                         for i, (ok, why) in enumerate(here)]
        # why the device table was put aside at the first call on a device: measured on
        # other GPUs (learn_gpu_stamp; a communicator is made without touching the device)
        self._other_gpus = None
        # No host table here: calibrate the cost model on this machine (every rank, or none).
        self.calibration = None
        if agreed & 16 and not self.in_use[0] and world_size > 1 and set(BUILDERS) - set(self.overrides):
            self.calibration = calibrate(self.fingerprint, self.key, self.link)
        self._cache = BoundedCache(4096)  # (collective, nbytes, device) -> choice
        # The node's GPUs, ranks and fence mechanism: None until a device call learns them
        # (the device model meanwhile takes the ranks to share one GPU, as on the GPU it was
        # measured on).
        self.gpus = None
        self.device_model = SHIPPED_DEVICE_MODEL  # the device rule's parameters

    def learn_gpu_stamp(self, stamp, agree=None):
        """The ranks' GPUs are ``stamp`` (:func:`gpu_stamp`), as the first call on a device
        learnt (the same on every rank): a device table whose entry names other GPUs is
        no longer used. ``agree(fits)``: every rank's verdict ANDed (collective; called
        on every rank where the device table is in use, which the ranks agreed on), so
        that ranks whose table files differ decide alike. True if that changed what
        ``auto`` picks."""
        if not self.in_use[1]:
            return False
        measured_on = (self.device_table.stamp(f"{self.key} device") or {}).get(GPU)  # (None: it names none)
        fits = measured_on is None or stamp == measured_on
        if (agree(fits) if agree is not None else fits):
            return False
        self.in_use[1] = False
        self._other_gpus = (f"{self.device_table.source} was measured on GPUs {measured_on}, these are {stamp}"
                            if not fits else "another rank's device table was measured on other GPUs")
        self._cache.clear()
        return True

    def learn_gpus(self, gpus, ranks, mechanism):
        """The node's ``ranks`` are on ``gpus`` GPUs and meet at fences of ``mechanism``,
        as the first peer-read call learnt (the same on every rank): the device cost
        model predicts for that from now on (the leader only where every rank is on one
        GPU; each GPU's processes switching where it carries several ranks; a fence's
        cost by its mechanism)."""
        known = (int(gpus), int(ranks), mechanism)
        if known != self.gpus:
            self.gpus = known
            self.device_model = replace(self.device_model, shared=gpus < ranks, one_gpu=gpus == 1,
                                        kernel_fences=mechanism == "kernel")
            self._cache.clear()

    def _describe_gpus(self):
        if self.gpus is None:
            return "the node's ranks taken to share one GPU until a device call learns it"
        gpus, ranks, mechanism = self.gpus
        where = "the node's ranks share one GPU" if gpus == 1 else \
            "each of the node's ranks has a GPU of its own" if gpus >= ranks else \
            f"the node's {ranks} ranks share {gpus} GPUs"
        return f"{where}, {mechanism} fences"

    def _usable(self, table, suffix):
        """``(usable, why not)`` for ``table`` on this rank alone."""
        if table is None or not table.has(self.key):
            return False, None
        stamp = table.stamp(f"{self.key}{suffix}")
        if stamp is None:
            return self.unstamped, f"{table.source} has no fingerprint, so only a file named by {TUNING_ENV} is used"
        same = canonical(stamp)  # an MPI written as before fingerprints named the family counts as that family's
        if isinstance(same, dict):  # (a device entry's GPUs: checked at the first device call, learn_gpu_stamp)
            same = {k: v for k, v in same.items() if k != GPU}
        if same == self.fingerprint:
            return True, None
        if LINK in same and {k: v for k, v in same.items() if k != LINK} == self.fingerprint:
            return "link", None  # the same machines and layout: the link decides (_link_verdict)
        return False, f"{table.source} was measured on {describe_fingerprint(stamp)}"

    def _link_verdict(self, table, suffix):
        """``(usable, why not)`` for ``table``, whose entry holds a link, once this job's
        link (``self.link``) is measured."""
        measured = table.stamp(f"{self.key}{suffix}")[LINK]
        if self.link is None:
            return False, f"{table.source} was measured over a {measured:g} MB/s link; this job's was not measured"
        here = link_stamp(self.link)
        if not measured / LINK_TOLERANCE <= here <= measured * LINK_TOLERANCE:
            return False, (f"{table.source} was measured over a {measured:g} MB/s link; this job's measures "
                           f"{here:g} MB/s")
        return True, None

    @classmethod
    def from_environment(cls, world_size, environ=None, deterministic=False, topology=None, *, fingerprint=None,
                         agree=None, hint=False, measure_link=None, calibrate=None):
        """The selector the environment asks for (see the module's docstring). ``agree``,
        ``fingerprint``, ``measure_link`` and ``calibrate`` as for :class:`Selector`
        (``calibrate`` is passed on unless ``COLLECTIVES_CALIBRATE=0`` or a rule is
        chosen with ``COLLECTIVES_AUTO_RULE``); ``hint``: this process may print the
        one-line note where no table matches (rank 0 of a communicator)."""
        environ = os.environ if environ is None else environ
        overrides = {}
        for collective in BUILDERS:  # alltoallv too
            variable = override_variable(collective)
            value = environ.get(variable, "").strip()
            if value and value != "auto":
                if value not in _concrete(collective):
                    raise ValueError(f"{variable} must be one of {', '.join(_concrete(collective))}; got {value!r}")
                if deterministic:
                    try:
                        check_ordered(collective, value)
                    except ValueError as exc:
                        raise ValueError(f"{variable}={value}: {exc}") from None
                overrides[collective] = value
        rule = environ.get(RULE_ENV, "").strip() or "conservative"
        if rule not in RULES:
            raise ValueError(f"{RULE_ENV} must be one of {', '.join(RULES)}; got {rule!r}")
        named = environ.get(TUNING_ENV, "").strip()
        path = named or (DEFAULT_TABLE if DEFAULT_TABLE.exists() else "")
        table = TuningTable.load(path) if path else None
        device_table = TuningTable.load(path, "device_tables") if path else None
        if not calibration_module.wanted(environ) or environ.get(RULE_ENV, "").strip():
            calibrate = None
        selector = cls(world_size, table, overrides, device_table, deterministic, topology, fingerprint=fingerprint,
                       unstamped=bool(named), agree=agree, rule=rule, measure_link=measure_link, calibrate=calibrate)
        quiet = environ.get(QUIET_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
        if hint and not quiet and not environ.get(RULE_ENV, "").strip():
            global _hinted
            note = selector.hint()
            if note and not _hinted:
                _hinted = True
                print(note, file=sys.stderr, flush=True)
        return selector

    def hint(self):
        """The one-line note shown where the conservative rule is in force because no
        host table matches this machine and layout; None where one does (or where
        nothing is left to choose: one rank, every collective forced)."""
        if self.rule != "conservative" or self.in_use[0] or self.world_size < 2 or set(BUILDERS) <= set(self.overrides):
            return None
        calibrated = self.calibration
        if calibrated is not None:  # said once, where it was measured now (a cached one says nothing)
            if calibrated.source != "measured now":
                return None
            return (f"collectives: no tuning table measured on this machine and layout "
                    f"({describe_fingerprint(self.fingerprint)}); auto's cost model was calibrated here in "
                    f"{calibrated.seconds:.2f} s (cached for later jobs; {calibration_module.CALIBRATE_ENV}=0 turns "
                    f"it off). `make tune` measures a full table; {QUIET_ENV}=1 hides this.")
        return (f"collectives: no tuning table measured on this machine and layout "
                f"({describe_fingerprint(self.fingerprint)}); auto uses MPI's own collectives unless the cost "
                f"model predicts a {GAIN_NEEDED:g}x gain. Run `make tune` (or collectives-bench --tune FILE, then "
                f"{TUNING_ENV}=FILE) to tune; {QUIET_ENV}=1 hides this.")

    def choose(self, collective, nbytes, device=False):
        key = (collective, nbytes, device)
        choice = self._cache.get(key)
        if choice is None:
            choice = self._cache.put(key, self.explain(collective, nbytes, device)[0])
        return choice

    def explain(self, collective, nbytes, device=False):
        """``(algorithm, why)``: what ``auto`` picks and which rule decided. Device
        arrays have tables of their own (a host table says nothing of them)."""
        choice, why = self._explain(collective, nbytes, device)
        if self.deterministic and collective in ORDERED and choice not in ORDERED[collective]:
            return ORDERED[collective][0], f"deterministic mode (reduces in rank order; else {choice}, by the {why})"
        return choice, why

    def _explain(self, collective, nbytes, device):
        if collective in self.overrides:
            return self.overrides[collective], f"forced by {override_variable(collective)}"
        table = self.device_table if device else self.table
        if table is not None and self.in_use[device]:
            choice = table.lookup(collective, nbytes, self.key)
            if choice is not None:
                return choice, f"measured table {table.source}" + (f" (layout {self.key})" if self.several else "")
        if device:
            choice, why = device_choice(collective, nbytes, self.world_size, self.topology, self.device_model)
            other = f": {self._other_gpus}" if self._other_gpus else ""
            why += f" (no measured table for device arrays{other}; {self._describe_gpus()})"
            if self.several:
                why += f" for {self.topology.describe()}"
            return choice, why
        if self.calibration is not None:
            return calibrated_choice(self.calibration, collective, nbytes, self.world_size,
                                     self.topology if self.several else None)
        if self.rule == "cost-model":
            why = "cost-model rule" + (f" for {self.topology.describe()}" if self.several else "")
            return cost_model_choice(collective, nbytes, self.world_size, topology=self.topology), why
        choice, gain, best = conservative_choice(collective, nbytes, self.world_size, self.topology)
        if self.in_use[0]:
            missing = f"{table.source} has no {collective} table for " + \
                (f"layout {self.key}" if self.several else f"world size {self.key}")
        else:
            missing = f"no measured table for this machine and layout ({describe_fingerprint(self.fingerprint)}" + \
                (f"; {self._why_not[0]})" if self._why_not[0] else ")")
        if choice == "native":
            said = f"native (the cost model predicts at most {gain:.2f}x gain" + (f", {best})" if best else ")")
        else:
            said = f"{choice} (the cost model predicts {gain:.2f}x gain over native)"
        return choice, f"conservative rule: {missing}; {said}"
