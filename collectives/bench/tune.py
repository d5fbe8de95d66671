"""From benchmark rows to a tuning table (the file ``auto`` reads; format in
:mod:`collectives.tuning`).

At each measured size the fastest contender (lowest average time, ``native``
included) wins, except that the previous size's winner keeps the size if it is
within ``STICKINESS`` of the fastest: on a noisy machine this stops the table from
flapping between two algorithms that are really tied. A switch between two measured
sizes takes effect at their geometric mean.
"""

import datetime
import json
import math
import platform
from pathlib import Path

from mpi4py import MPI

from ..tuning import FORMAT, TuningTable

STICKINESS = 1.05
NOT_TUNED = ("auto", "gloo")  # what auto cannot pick


def thresholds(rows):
    """``[[from_bytes, algorithm], ...]`` for the rows of one collective and world size."""
    by_size = {}
    for row in rows:
        if row["algorithm"] not in NOT_TUNED and row["time_us"] is not None:
            by_size.setdefault(row["bytes"], {})[row["algorithm"]] = row["time_us"]
    entries, previous_size, winner = [], None, None
    for size in sorted(by_size):
        times = by_size[size]
        best = min(times, key=times.get)
        if winner in times and times[winner] <= STICKINESS * times[best]:
            best = winner
        if best != winner:  # from the geometric mean, past the size the old winner won at
            start = 0 if previous_size is None else max(previous_size + 1, int(math.sqrt(previous_size * size)))
            entries.append([start, best])
            winner = best
        previous_size = size
    return entries


def tables_from_rows(rows):
    """``{collective: {world_size: thresholds}}`` from benchmark rows."""
    groups = {}
    for row in rows:
        groups.setdefault((row["collective"], row["world_size"]), []).append(row)
    tables = {}
    for (collective, world_size), group in sorted(groups.items()):
        entries = thresholds(group)
        if entries:
            tables.setdefault(collective, {})[str(world_size)] = entries
    return tables


def describe_machine():
    return {
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "mpi4py": __import__("mpi4py").__version__,
    }


def write(path, rows, settings):
    """Merge the tables measured in ``rows`` into the tuning file at ``path`` (created if
    missing; world sizes measured before and not now are kept)."""
    path = Path(path)
    data = {"format": FORMAT, "measured": {}, "tables": {}}
    if path.exists():
        TuningTable.load(path)  # refuse to merge into a broken file (raises naming it)
        data = json.loads(path.read_text())
        data.setdefault("measured", {})
        data["tables"] = data.get("tables") or {}
    new = tables_from_rows(rows)
    for collective, by_size in new.items():
        data["tables"].setdefault(collective, {}).update(by_size)
        for world_size in by_size:
            data["measured"][world_size] = {**settings, **describe_machine(), "date": datetime.date.today().isoformat()}
    TuningTable(data["tables"], source=path)  # what auto will load must be valid
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return new
