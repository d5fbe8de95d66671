"""Measured tables: the algorithm ``collectives-bench --tune`` found fastest, per
collective, world size (or node layout) and size; reading them (:class:`TuningTable`,
:func:`tables_from_environment`) and deciding whether one was measured here
(:func:`usable`, :func:`link_verdict`).

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
"""

import bisect
import json
import os
import re
from pathlib import Path

from ..algorithms import COLLECTIVES, algorithms
from .fingerprints import GPU, LAYOUT_KEY, LINK, LINK_TOLERANCE, canonical, describe_fingerprint, link_stamp

FORMAT = 1
DEFAULT_TABLE = Path(__file__).parent.parent / "data" / "tuning.json"
TUNING_ENV = "COLLECTIVES_TUNING"


def concrete(collective):
    """The algorithms a table may name for ``collective``: every one but ``auto``."""
    return tuple(a for a in algorithms(collective) if a != "auto")


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
            if entry[1] not in concrete(collective):
                raise ValueError(f"{where}: algorithm {entry[1]!r} is not one of {', '.join(concrete(collective))}")
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


def tables_from_environment(environ=None):
    """``(table, device_table, named)``: the tables of the file ``COLLECTIVES_TUNING``
    names, else of the one that ships with the package (``DEFAULT_TABLE``), else
    ``(None, None, False)``; ``named``: the user named the file (then its entries
    without a fingerprint count, :func:`usable`)."""
    environ = os.environ if environ is None else environ
    named = environ.get(TUNING_ENV, "").strip()
    path = named or (DEFAULT_TABLE if DEFAULT_TABLE.exists() else "")
    if not path:
        return None, None, False
    return TuningTable.load(path), TuningTable.load(path, "device_tables"), bool(named)


def usable(table, key, fingerprint, unstamped, suffix=""):
    """``(usable, why not)`` for ``table`` on this rank alone: whether its entry for
    ``key`` (a world size or a layout key; ``suffix`` " device" for a device table's)
    was measured with ``fingerprint``; ``usable`` is ``"link"`` where the entry differs
    only by its link, which then decides (:func:`link_verdict`). An entry with no
    fingerprint counts where ``unstamped`` (a file the user named)."""
    if table is None or not table.has(key):
        return False, None
    stamp = table.stamp(f"{key}{suffix}")
    if stamp is None:
        return unstamped, f"{table.source} has no fingerprint, so only a file named by {TUNING_ENV} is used"
    same = canonical(stamp)  # an MPI written as before fingerprints named the family counts as that family's
    if isinstance(same, dict):  # (a device entry's GPUs: checked at the first device call)
        same = {k: v for k, v in same.items() if k != GPU}
    if same == fingerprint:
        return True, None
    if LINK in same and {k: v for k, v in same.items() if k != LINK} == fingerprint:
        return "link", None  # the same machines and layout: the link decides (link_verdict)
    return False, f"{table.source} was measured on {describe_fingerprint(stamp)}"


def link_verdict(table, key, link, suffix=""):
    """``(usable, why not)`` for ``table``, whose entry for ``key`` holds a link, given
    this job's measured ``link`` (bytes per second; None: not measured): usable where
    they are within ``LINK_TOLERANCE`` of each other."""
    measured = table.stamp(f"{key}{suffix}")[LINK]
    if link is None:
        return False, f"{table.source} was measured over a {measured:g} MB/s link; this job's was not measured"
    here = link_stamp(link)
    if not measured / LINK_TOLERANCE <= here <= measured * LINK_TOLERANCE:
        return False, (f"{table.source} was measured over a {measured:g} MB/s link; this job's measures "
                       f"{here:g} MB/s")
    return True, None
