"""Fit α, β and γ to benchmark results, and compare the model's predictions with them.

The rows are ``collectives-bench --json`` output: one per (collective, algorithm, size,
world size), with the measured mean time. Only this library's algorithms are used:
``native`` and ``gloo`` are other libraries, and ``auto`` repeats one of ours.

The model's time is piecewise linear in (α, β, γ): on the critical path it is
``a·α + b·β + g·γ``, where a, b and g are counts of messages, bytes sent and bytes
reduced along that path. The fit takes a, b and g for every row at the current guess
(finite differences of the simulated time), solves the least-squares problem for the
relative error ``(predicted - measured) / measured``, keeping each parameter ≥ 0, and
repeats until the critical paths stop changing.

Rows measured across several nodes (``layout`` such as ``"2x4"``, which
``collectives-bench`` writes) are timed with the two-level model: messages between
nodes cost their own α′ and β′ and share the node's link. Where any row has several
nodes the fit has five parameters, (α, β, γ, α′, β′): the node's and the network's.
"""

import json
import re

import numpy as np

from ..algorithms import SHARED_MEMORY, TOPOLOGICAL
from ..algorithms.shm import DEFAULT_SLOT_BYTES
from .simulate import DEFAULT_SEGMENT_SIZE, costs

OTHER_LIBRARIES = ("native", "gloo", "auto")
START = (20e-6, 1e-9, 1e-9, 30e-6, 8e-9)  # α, β, γ, α′, β′: a first guess for the critical paths
NAMES = ("alpha", "beta", "gamma", "inter_alpha", "inter_beta")


def nodes_of(row):
    """``(nodes, ranks per node)`` of a row's layout (one node where it has none): the
    ranks per node an int for NxK, else (``"3+1"``, uneven nodes) one node label per
    rank, the nodes placed node by node in that order."""
    layout = str(row.get("layout") or f"1x{row['world_size']}")
    match = re.fullmatch(r"([0-9]+)x([0-9]+)", layout)
    if match:
        return int(match[1]), int(match[2])
    if re.fullmatch(r"[1-9][0-9]*(\+[1-9][0-9]*)+", layout):
        sizes = [int(n) for n in layout.split("+")]
        if sum(sizes) == int(row["world_size"]):
            return len(sizes), [node for node, size in enumerate(sizes) for _ in range(size)]
    raise ValueError(f"layout {layout!r}: expected nodes x ranks per node (2x4) or node sizes adding up to the "
                     f"world size {row['world_size']} (3+1)")


def parameter_count(rows):
    """3 (α, β, γ) for rows of one node; 5 where some row spans several nodes."""
    return 5 if any(nodes_of(r)[0] > 1 for r in rows) else 3


def load_rows(paths):
    """The rows of our own algorithms in the benchmark JSON files ``paths``."""
    rows = []
    for path in paths:
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not JSON ({e})") from None
        rows += load_rows_from(data, str(path))
    return rows


def load_rows_from(data, source="the rows"):
    """The rows of our own algorithms in ``data`` (a list of benchmark rows)."""
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{source}: expected a list of rows as collectives-bench --json writes")
    rows = []
    for row in data:
        missing = {"collective", "algorithm", "bytes", "count", "world_size", "dtype", "time_us"} - set(row)
        if missing:
            raise ValueError(f"{source}: a row lacks {', '.join(sorted(missing))}")
        if row["algorithm"] not in OTHER_LIBRARIES and row["time_us"]:
            rows.append(row)
    if not rows:
        raise ValueError(f"no rows of this library's algorithms in {source}")
    return rows


class _Prediction:
    """The simulated cost of one benchmark row (built once, timed for many guesses)."""

    def __init__(self, row):
        self.row = row
        self.nodes, self.ranks_per_node = nodes_of(row)
        key = (row["collective"], row["algorithm"])
        extra = {"nodes": self.ranks_per_node} if key in TOPOLOGICAL else {}
        default = DEFAULT_SLOT_BYTES if key in SHARED_MEMORY else DEFAULT_SEGMENT_SIZE  # as the Communicator cuts it
        self.costs = costs(
            row["collective"], row["algorithm"], int(row["world_size"]), int(row["count"]), row["dtype"],
            segment_size=int(row.get("segment_size") or default), **extra,
        )
        self.measured = float(row["time_us"]) * 1e-6

    def time(self, params):
        alpha, beta, gamma, *network = params
        if self.nodes > 1:
            return self.costs.time(alpha, beta, gamma, self.ranks_per_node, *network)
        return self.costs.time(alpha, beta, gamma)

    def coefficients(self, params):
        """How the time grows with each parameter around ``params``."""
        base = self.time(params)
        coef = []
        for k in range(len(params)):
            step = list(params)
            delta = max(params[k], START[k]) * 1e-3
            step[k] += delta
            coef.append((self.time(step) - base) / delta)
        return coef


def _nonnegative_least_squares(matrix, target):
    """Least squares with every parameter ≥ 0 (few parameters: drop the negative ones)."""
    active = list(range(matrix.shape[1]))
    while True:
        solution = np.zeros(matrix.shape[1])
        if active:
            solution[active] = np.linalg.lstsq(matrix[:, active], target, rcond=None)[0]
        negative = [k for k in active if solution[k] < 0]
        if not negative:
            return solution
        active.remove(min(negative, key=lambda k: solution[k]))


def fit(rows, from_bytes=0, iterations=50):
    """Fit (α, β, γ) to ``rows`` of at least ``from_bytes`` bytes, or (α, β, γ, α′, β′)
    where some row spans several nodes; returns the tuple.

    Each round solves for the parameters with every row's critical path held fixed,
    then finds the paths again under the new parameters; it stops when no parameter
    moves by 1e-6 of itself, or after ``iterations`` rounds. (Eight rounds were not
    enough once the two-level algorithms joined the rows: their paths switch later.)"""
    chosen = [_Prediction(r) for r in rows if int(r.get("bytes", 0)) >= from_bytes]
    if not chosen:
        raise ValueError(f"no benchmark rows of {from_bytes} bytes or more to fit")
    params = START[:parameter_count([p.row for p in chosen])]
    for _ in range(iterations):
        matrix = np.array([[c / p.measured for c in p.coefficients(params)] for p in chosen])
        # Columns scaled to unit size so that α (µs) and β (ns per byte) weigh alike.
        scale = np.abs(matrix).max(axis=0)
        scale[scale == 0] = 1
        solution = _nonnegative_least_squares(matrix / scale, np.ones(len(chosen))) / scale
        new = tuple(float(x) for x in solution)
        if np.allclose(new, params, rtol=1e-6, atol=0):
            break
        params = new
    return params


def compare(rows, params, from_bytes=0):
    """``[(row, predicted seconds, measured seconds, relative error)]`` for the rows of
    at least ``from_bytes`` bytes."""
    out = []
    for row in rows:
        if int(row.get("bytes", 0)) >= from_bytes:
            p = _Prediction(row)
            predicted = p.time(params)
            out.append((row, predicted, p.measured, predicted / p.measured - 1))
    return out


def report(comparison):
    """A table of predicted against measured, and a summary per world size."""
    lines = [
        f"{'layout':>6} {'collective':<15}{'algorithm':<20}{'bytes':>10} {'measured us':>12} {'predicted us':>13} "
        f"{'error':>7}"
    ]
    for row, predicted, measured, error in comparison:
        lines.append(
            f"{_layout(row):>6} {row['collective']:<15}{row['algorithm']:<20}{row['bytes']:>10} "
            f"{measured * 1e6:>12.1f} {predicted * 1e6:>13.1f} {error:>+7.0%}"
        )
    lines.append("")
    lines += summary(comparison)
    return "\n".join(lines)


def _layout(row):
    nodes, per_node = nodes_of(row)
    return f"{nodes}x{per_node}" if isinstance(per_node, int) else str(row["layout"])


def summary(comparison, by=_layout):
    """One line per group (``by``: a row's layout, or e.g. its algorithm) and one for all:
    the median, mean and largest relative error."""
    lines = []
    for p in sorted({by(row) for row, *_ in comparison}) + [None]:
        errors = np.array([abs(e) for row, _, _, e in comparison if p is None or by(row) == p])
        if errors.size:
            label = str(p) if p is not None else "all"
            lines.append(
                f"{label:<13} rows {errors.size:>4}  |error| median {np.median(errors):.1%}, "
                f"mean {errors.mean():.1%}, max {errors.max():.1%}; within 25%: {np.mean(errors <= 0.25):.0%}"
            )
    return lines
