"""Projections: predicted allreduce time and bus bandwidth against the world size and
against the message size, for every allreduce algorithm and a parameter server.

Each point is simulated (the library's schedules, timed by :mod:`.timing`) when the
simulation has at most ``max_ops`` operations (a rotation-symmetric call simulates
rank 0's plan alone, or one node's ranks: ring and direct to 4096 ranks and beyond). Beyond that, ring, direct and the
recursive algorithms, whose messages grow as p² or p·lg p, use their closed form under
the same model (``closed_form``; the tests check it equals the simulation wherever both
run); the pipelined tree, which has none, is left out there. Every row says which.
"""

import math

from ..algorithms import BUILDERS, SHARED_MEMORY
from ..algorithms.hierarchical import pipeline_pieces
from .closed_form import allreduce_time as closed_form
from .simulate import DEFAULT_SEGMENT_SIZE as SEGMENT
from .simulate import costs, symmetry, timed_ranks

# Projections are of clusters (p up to 4096 over links): the shared-memory algorithms,
# which run only among the ranks of one node (and whose plans grow as p²), are left out.
ALLREDUCE = tuple(a for a in BUILDERS["allreduce"] if ("allreduce", a) not in SHARED_MEMORY)
DEFAULT_MAX_OPS = 400_000  # simulated operations per point: about 3 s here


def parameter_server_name(servers):
    return f"parameter_server(S={servers})"


def estimated_ops(algorithm, p, nbytes, servers=None, ranks_per_node=None):
    """Roughly how many plan operations a simulation of this call holds."""
    if servers is not None:
        return 5 * servers * p
    lg = max(1, math.ceil(math.log2(p)))
    if algorithm == "hierarchical":  # rings in the node and across (k and N steps), per piece
        k = min(ranks_per_node or p, p)
        reps = timed_ranks(p, symmetry("allreduce", algorithm, p, nbytes // 4, nodes=k), k)  # one node's ranks
        return 6 * reps * (k + math.ceil(p / k)) * len(pipeline_pieces(nbytes // 4))
    if algorithm in ("ring", "direct"):  # symmetric with equal blocks: rank 0 (or a node's ranks) alone
        reps = timed_ranks(p, symmetry("allreduce", algorithm, p, nbytes // 4), ranks_per_node)
        return 6 * reps * (p - 1)
    if algorithm == "tree":
        return 6 * p * max(1, math.ceil(nbytes / SEGMENT))
    return 4 * lg * p


def predict(algorithm, p, nbytes, model, servers=None, max_ops=DEFAULT_MAX_OPS):
    """(seconds, how) for an allreduce of ``nbytes`` float32 bytes over ``p`` ranks (for
    the parameter server: p workers plus ``servers`` server ranks); how is "sim",
    "closed form" or None when neither could be had."""
    count = nbytes // 4
    if estimated_ops(algorithm, p, nbytes, servers, model.get("ranks_per_node")) <= max_ops:
        if servers is not None:
            cost = costs("allreduce", "parameter_server", p + servers, count, servers=servers)
        else:
            nodes = model.get("ranks_per_node") if algorithm.startswith("hierarchical") else None
            cost = costs("allreduce", algorithm, p, count, segment_size=SEGMENT, nodes=nodes)
        return cost.time(**model), "sim"
    if model.get("ranks_per_node") is None and servers is None:
        t = closed_form(algorithm, p, nbytes, model["alpha"], model["beta"], model["gamma"])
        if t is not None:
            return t, "closed form"
    return None, None


def sweep(world_sizes, sizes, model, servers=(), max_ops=DEFAULT_MAX_OPS, progress=None):
    """Rows {algorithm, world_size, bytes, time_s, busbw_GBps, how} for every algorithm
    over every (world size, size) pair given."""
    variants = [(a, None) for a in ALLREDUCE] + [(parameter_server_name(s), s) for s in servers]
    rows = []
    for p in world_sizes:
        for nbytes in sizes:
            for name, s in variants:
                t, how = predict(name, p, nbytes, model, s, max_ops)
                busbw = nbytes / t * 2 * (p - 1) / p / 1e9 if t else None
                rows.append(dict(algorithm=name, world_size=p, bytes=nbytes, time_s=t, busbw_GBps=busbw, how=how))
                if progress:
                    progress()
    return rows


def table(rows, key):
    """Text table: one line per ``key`` value (world_size or bytes), time per algorithm."""
    names = list(dict.fromkeys(r["algorithm"] for r in rows))
    width = max(12, *(len(n) + 1 for n in names))
    lines = [f"{key:>10} " + "".join(f"{n:>{width}}" for n in names)]
    for value in dict.fromkeys(r[key] for r in rows):
        cells = []
        for n in names:
            row = next(r for r in rows if r[key] == value and r["algorithm"] == n)
            t = row["time_s"]
            mark = "*" if row["how"] == "closed form" else " "
            cells.append(f"{_time(t) + mark:>{width}}" if t is not None else f"{'-':>{width}}")
        lines.append(f"{_size(value) if key == 'bytes' else value:>10} " + "".join(cells))
    lines.append("time per call; * closed form (beyond the simulated range), - not simulated that far")
    return "\n".join(lines)


def _time(t):
    return f"{t * 1e6:.1f}us" if t < 1e-3 else f"{t * 1e3:.2f}ms" if t < 1 else f"{t:.2f}s"


def _size(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n}B"


def plot(by_world_size, by_size, path, title):
    """Four panels: time and busbw against p, and against the size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    for column, (rows, key, label) in enumerate(
        ((by_world_size, "world_size", "world size p (ranks)"), (by_size, "bytes", "message size (bytes)"))
    ):
        for name in dict.fromkeys(r["algorithm"] for r in rows):
            mine = [r for r in rows if r["algorithm"] == name and r["time_s"] is not None]
            style = dict(linestyle="--") if name.startswith("parameter_server") else {}
            for row_index, (field, scale) in enumerate((("time_s", 1e3), ("busbw_GBps", 1))):
                ax = axes[row_index][column]
                (line,) = ax.plot([r[key] for r in mine], [r[field] * scale for r in mine], label=name, **style)
                closed = [r for r in mine if r["how"] == "closed form"]
                ax.plot([r[key] for r in closed], [r[field] * scale for r in closed], "o", mfc="none",
                        color=line.get_color(), markersize=5)
        for row_index, ylabel in enumerate(("predicted time (ms)", "busbw (GB/s)")):
            ax = axes[row_index][column]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(label)
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
    fixed_size = by_world_size[0]["bytes"] if by_world_size else None
    fixed_p = by_size[0]["world_size"] if by_size else None
    axes[0][0].set_title(f"allreduce of {_size(fixed_size)} against p")
    axes[0][1].set_title(f"allreduce at p = {fixed_p} against size")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title + "\n(hollow markers: closed form, beyond the simulated range)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
