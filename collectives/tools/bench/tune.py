"""From benchmark rows to a tuning table (the file ``auto`` reads; format in
:mod:`collectives.auto.table`).

Each contender's score at a measured size is its average time divided by the
fastest one's there (``native`` included), averaged geometrically with the same
ratio at the ``SMOOTHING`` measured sizes on either side, which count half as much: on a noisy machine one
lucky size should not win an algorithm a range of its own. The lowest score wins,
except that:

- the previous size's winner keeps the size while its score is within
  ``STICKINESS`` of the best (so two algorithms that are really tied do not make the
  table flap);
- ``native`` keeps the size unless the winner's score beats native's by more than the
  noise measured there: by a factor over ``1 + max(noise, NOISE_FLOOR)``, where the
  noise is the larger ``round_spread`` of the two rows (max/min - 1 of their
  per-round mean times over the interleaved ``--rounds``; rows without it count as
  0). A table that leaves MPI's own collective should do so only where the
  difference is larger than what the machine's drift could make of it.

A switch between two measured sizes takes effect at their geometric mean. Every
entry of ``measured`` is stamped with the :func:`collectives.auto.fingerprints.fingerprint` of
the machine and layout it was measured on, for several nodes the link between them,
and for device tables the GPUs (:func:`collectives.device.gpus.gpu_stamp`) (``auto`` uses
the entry only where that fingerprint is the job's, the link within
``collectives.auto.LINK_TOLERANCE``, the GPUs as the first call on a device finds them).

With the defaults (``--budget 0.05`` s per contender, size and run, ``--rounds 3``,
8 B to 64 MiB by 2: 24 sizes, 35 contenders) a ``--tune`` run is about 1-2 minutes
per world size here (2 vCPUs, 2-8 ranks; estimated from the iteration counts and
times of bench/results/epyc-2vcpu-mpich5/tuning/), so ``make tune``'s three world
sizes take 3-6 minutes. Where a call takes under 10 ms (up to a few MiB here) each
contender gets 0.05 s of calls (at most 2000); above, 5 calls (2, 2 and 1 per round,
whose spread is then the noise that the margin over native must beat).
"""

import datetime
import json
import math
import platform
from pathlib import Path

from mpi4py import MPI

from ...auto import FORMAT, GPU, TuningTable, fingerprint_for_key

STICKINESS = 1.05
NOISE_FLOOR = 0.05  # native keeps a size unless beaten by more than max(this, the rounds' spread)
NOT_TUNED = ("auto", "gloo", "deterministic")  # what auto cannot pick


SMOOTHING = 1


def winners(rows, window=SMOOTHING):
    """``[(size, algorithm), ...]`` ascending: the winner at each measured size, for the
    rows of one collective and world size."""
    by_size, noise = {}, {}
    for row in rows:
        if row["algorithm"] not in NOT_TUNED and row["time_us"] is not None:
            by_size.setdefault(row["bytes"], {})[row["algorithm"]] = row["time_us"]
            noise.setdefault(row["bytes"], {})[row["algorithm"]] = row.get("round_spread") or 0.0
    sizes = sorted(by_size)
    ratios = []  # per size: each algorithm's time / the fastest time at that size
    for size in sizes:
        fastest = min(by_size[size].values())
        ratios.append({a: t / fastest for a, t in by_size[size].items()})
    result, winner = [], None
    for i, size in enumerate(sizes):
        scores = {}
        for algorithm in ratios[i]:
            # the size itself counts twice as much as each neighbour
            weighted = [(2.0, math.log(ratios[i][algorithm]))]
            for j in range(max(0, i - window), min(len(sizes), i + window + 1)):
                if j != i and algorithm in ratios[j]:
                    weighted.append((1.0, math.log(ratios[j][algorithm])))
            scores[algorithm] = math.exp(sum(w * x for w, x in weighted) / sum(w for w, _ in weighted))
        best = min(scores, key=scores.get)
        if winner in scores and scores[winner] <= STICKINESS * scores[best]:
            best = winner
        if best != "native" and "native" in scores:
            margin = max(NOISE_FLOOR, noise[size]["native"], noise[size][best])
            if scores["native"] <= (1 + margin) * scores[best]:
                best = "native"
        result.append((size, best))
        winner = best
    return result


def thresholds(rows, window=SMOOTHING):
    """``[[from_bytes, algorithm], ...]`` for the rows of one collective and world size."""
    entries, previous_size, winner = [], None, None
    for size, best in winners(rows, window):
        if best != winner:  # from the geometric mean, past the size the old winner won at
            start = 0 if previous_size is None else max(previous_size + 1, int(math.sqrt(previous_size * size)))
            entries.append([start, best])
            winner = best
        previous_size = size
    return entries


def table_key(row):
    """What a row's table is keyed by: its world size on one node, its node layout
    (``"2x4"``, ``"3+1"``) on several, which a one-node table says nothing of."""
    layout = row.get("layout")
    return layout if layout and not layout.startswith("1x") else str(row["world_size"])


def tables_from_rows(rows):
    """``{collective: {world_size or layout: thresholds}}`` from benchmark rows."""
    groups = {}
    for row in rows:
        groups.setdefault((row["collective"], table_key(row)), []).append(row)
    tables = {}
    for (collective, key), group in sorted(groups.items()):
        entries = thresholds(group)
        if entries:
            tables.setdefault(collective, {})[key] = entries
    return tables


def describe_machine():
    return {
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "mpi": " ".join(MPI.Get_library_version().split("\n")[0].split()),
        "mpi4py": __import__("mpi4py").__version__,
    }


def write(path, rows, settings, key="tables", link=None, gpus=None):
    """Merge the tables measured in ``rows`` into the tuning file at ``path`` (created if
    missing; world sizes measured before and not now are kept). ``key`` is
    ``"device_tables"`` for measurements on device arrays. ``link``: the node-to-node
    rate measured in the same job (bytes per second), which the fingerprint of a
    layout of several nodes holds; ``gpus``: the node's GPUs
    (:func:`~collectives.device.gpus.gpu_stamp`), which a device table's fingerprint holds
    (auto uses the table only on the same GPUs)."""
    path = Path(path)
    data = {"format": FORMAT, "measured": {}, "tables": {}}
    if path.exists():
        TuningTable.load(path)  # refuse to merge into a broken file (raises naming it)
        data = json.loads(path.read_text())
        data.setdefault("measured", {})
        data["tables"] = data.get("tables") or {}
    data[key] = data.get(key) or {}
    new = tables_from_rows(rows)
    where = "" if key == "tables" else " device"
    for collective, by_size in new.items():
        data[key].setdefault(collective, {}).update(by_size)
        for world_size in by_size:
            data["measured"][world_size + where] = {**settings, **describe_machine(),
                                                    "fingerprint": {**fingerprint_for_key(world_size, link),
                                                                    **({GPU: gpus} if gpus and where else {})},
                                                    "date": datetime.date.today().isoformat()}
    TuningTable(data[key], source=path)  # what auto will load must be valid
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return new
