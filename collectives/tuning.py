"""What ``algorithm="auto"`` picks, per (collective, bytes, world size).

In order, the first that answers:

1. ``COLLECTIVES_<COLLECTIVE>_ALGORITHM`` (e.g. ``COLLECTIVES_ALLREDUCE_ALGORITHM=ring``)
   forces one algorithm for every size, like ``NCCL_ALGO`` or MPICH's CVARs;
2. a measured tuning table: the file named by ``COLLECTIVES_TUNING``, else the table
   measured on the development machine that ships with the package
   (``collectives/data/tuning.json``), if it has the world size;
3. the cost-model rule in :func:`collectives.algorithms.cost_model_choice`.

In deterministic mode a choice that cannot reduce in rank order (see
``collectives.algorithms.ORDERED``) gives way to one that can, and an override that
names one is refused.

A tuning file is what ``collectives-bench --tune`` writes::

    {"format": 1,
     "measured": {...where and how...},
     "tables": {"allreduce": {"4": [[0, "native"], [65536, "ring"]], ...}, ...}}

Each world size maps to a list of ``[from_bytes, algorithm]``, ascending: the
algorithm applies from ``from_bytes`` up to the next entry's (the first entry also
below its ``from_bytes``, which ``--tune`` writes as 0). ``bytes`` is the size
the benchmark reports: the input for allreduce, reduce_scatter, broadcast and reduce,
the gathered output for allgather and gather, the root's whole buffer for scatter and
a rank's whole input for alltoall.

The environment is read when a :class:`~collectives.Communicator` is created, and
bad values raise there, before any message is sent.
"""

import bisect
import json
import os
import re
from pathlib import Path

from .algorithms import BUILDERS, COLLECTIVES, ORDERED, algorithms, check_ordered, cost_model_choice

FORMAT = 1
DEFAULT_TABLE = Path(__file__).parent / "data" / "tuning.json"
TUNING_ENV = "COLLECTIVES_TUNING"
# A node layout as Topology.key() writes it: nodes x ranks per node, or the node sizes.
LAYOUT_KEY = re.compile(r"[1-9][0-9]*x[1-9][0-9]*|[1-9][0-9]*(\+[1-9][0-9]*)+")


def override_variable(collective):
    """The environment variable that forces ``collective``'s algorithm."""
    return f"COLLECTIVES_{collective.upper()}_ALGORITHM"


def _concrete(collective):
    return tuple(a for a in algorithms(collective) if a != "auto")


class TuningTable:
    """Size thresholds between algorithms, per collective and world size."""

    def __init__(self, tables, source="<memory>"):
        self.source = str(source)
        self._ranges = {}  # (collective, world_size) -> (from_bytes list, algorithm list)
        if not isinstance(tables, dict):
            raise ValueError(f"tuning table {self.source}: 'tables' must be an object")
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
        return cls(data.get(key), source=f"{path} ({key})" if key != "tables" else path)

    def world_sizes(self, collective):
        return sorted(size for c, size in self._ranges if c == collective and isinstance(size, int))

    def lookup(self, collective, nbytes, world_size):
        """The measured choice, or None if the table lacks this world size."""
        ranges = self._ranges.get((collective, world_size))
        if ranges is None:
            return None
        starts, names = ranges
        return names[bisect.bisect_right(starts, nbytes) - 1]


class Selector:
    """Resolves ``auto`` for one communicator's world size (decisions are cached)."""

    def __init__(self, world_size, table=None, overrides=None, device_table=None, deterministic=False, topology=None):
        self.world_size = world_size
        self.topology = topology  # the node layout (None: one node)
        self.deterministic = deterministic
        self.table = table
        self.device_table = device_table  # measured on device arrays (collectives-bench --device --tune)
        self.overrides = dict(overrides or {})
        self._cache = {}

    @classmethod
    def from_environment(cls, world_size, environ=None, deterministic=False, topology=None):
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
        path = environ.get(TUNING_ENV, "").strip() or (DEFAULT_TABLE if DEFAULT_TABLE.exists() else "")
        table = TuningTable.load(path) if path else None
        device_table = TuningTable.load(path, "device_tables") if path else None
        return cls(world_size, table, overrides, device_table, deterministic, topology)

    def choose(self, collective, nbytes, device=False):
        key = (collective, nbytes, device)
        choice = self._cache.get(key)
        if choice is None:
            choice = self.explain(collective, nbytes, device)[0]
            if len(self._cache) > 4096:  # many distinct sizes: do not grow without bound
                self._cache.clear()
            self._cache[key] = choice
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
        several = self.topology is not None and self.topology.node_count > 1
        if table is not None:
            # A table keyed by the world size alone was measured on one node; several
            # nodes need one keyed by their layout ("2x4", "3+1").
            key = self.topology.key() if several else self.world_size
            choice = table.lookup(collective, nbytes, key)
            if choice is not None:
                return choice, f"measured table {table.source}" + (f" (layout {key})" if several else "")
        why = "cost-model rule" + (" (no measured table for device arrays)" if device else "")
        if several:
            why += f" for {self.topology.describe()}"
        return cost_model_choice(collective, nbytes, self.world_size, topology=self.topology), why
