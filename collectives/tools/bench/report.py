"""Writing results: the stdout table, JSON, CSV and the busbw plot (rank 0 only)."""

import csv
import json

from ...specs import SPECS

COLUMNS = [  # key, header, width, format ("" for text)
    ("bytes", "bytes", 11, "d"),
    ("count", "count", 10, "d"),
    ("algorithm", "algorithm", -28, ""),
    ("time_us", "avg_us", 10, ".1f"),
    ("min_us", "min_us", 10, ".1f"),
    ("max_us", "max_us", 10, ".1f"),
    ("p50_us", "p50_us", 10, ".1f"),
    ("p99_us", "p99_us", 10, ".1f"),
    ("algbw_GBps", "algbw", 7, ".3f"),
    ("busbw_GBps", "busbw", 7, ".3f"),
    ("speedup", "vs_nat", 6, ".2f"),
    ("vs_bound", "bound", 6, ".2f"),
    ("extra_mem_bytes", "mem", 7, ""),
    ("wrong", "#wrong", 6, ""),
]


def human_bytes(n):
    """1536 -> '1.5K'; None -> '-'."""
    if n is None:
        return "-"
    for unit in ("B", "K", "M"):
        if n < 1024:
            return f"{n:.0f}{unit}" if unit == "B" or n == int(n) else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}G"


def _text(row, key, fmt):
    value = row.get(key)
    if key == "extra_mem_bytes":
        return human_bytes(value)
    if key == "algorithm" and row.get("chosen"):
        return f"{value} ({row['chosen']})"  # auto, and what it picked
    if value is None:
        return "-"
    return format(value, fmt)


def _align(text, width):
    return text.ljust(-width) if width < 0 else text.rjust(width)


def header(collective, meta):
    place = "in place" if meta["inplace"] else "out of place"
    op = f" {meta['op']}" if SPECS[collective].reduces else ""
    titles = " ".join(_align(title, width) for _, title, width, _ in COLUMNS)
    return (f"\n# {collective}  {meta['dtype']}{op}  {place}  world size {meta['world_size']}"
            f"  (times in us, bw in GB/s, vs_nat = native time / time, bound = time / memory-traffic bound, "
            f"mem = peak extra per call)\n# {titles}")


def line(row):
    return "  " + " ".join(_align(_text(row, key, fmt), width) for key, _, width, fmt in COLUMNS)


def write_json(path, rows):
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
        f.write("\n")


def write_csv(path, rows):
    keys = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def plot(path, rows, title):
    """busbw against size: one panel per collective, one line per algorithm, native
    dashed, gloo dotted. Needs matplotlib (the ``bench`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install 'collectives[bench]'") from exc
    collectives = list(dict.fromkeys(r["collective"] for r in rows))
    ncols = min(3, len(collectives))
    nrows = -(-len(collectives) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(collectives):]:
        ax.set_visible(False)
    for ax, collective in zip(axes.flat, collectives):
        mine = [r for r in rows if r["collective"] == collective]
        for algorithm in dict.fromkeys(r["algorithm"] for r in mine):
            points = sorted((r["bytes"], r["busbw_GBps"]) for r in mine if r["algorithm"] == algorithm)
            style = {"native": dict(linestyle="--", color="black", linewidth=2),
                     "gloo": dict(linestyle=":", color="gray", linewidth=2)}.get(algorithm, dict(marker="."))
            ax.plot([p[0] for p in points], [p[1] for p in points], label=algorithm, **style)
        bounds = sorted({(r["bytes"], r["bytes"] / (r["bound_us"] * 1e3) * r["busbw_GBps"] / r["algbw_GBps"])
                         for r in mine if r.get("bound_us")})
        if bounds:  # the busbw a contender at the memory-traffic bound would show
            ax.plot([b[0] for b in bounds], [b[1] for b in bounds], label="memory bound", color="red",
                    linestyle="-.", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(collective)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
