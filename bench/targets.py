"""Check benchmark JSON files (from ``collectives-bench --json``) against the project's
performance targets and print a Markdown report.

    python bench/targets.py bench/results/<machine>/n2.json bench/results/<machine>/n4.json

Every ratio compares contenders measured in the same run (interleaved), never across
runs. Times are each row's ``time_us`` (average over calls and ranks); the ``p50``
columns repeat the comparison on the median, which a descheduled rank disturbs less.
"""

import json
import sys
from collections import defaultdict

MiB = 1024 * 1024


def load(path):
    rows = json.load(open(path))
    table = defaultdict(dict)  # (collective, bytes) -> algorithm -> row
    for row in rows:
        table[row["collective"], row["bytes"]][row["algorithm"]] = row
    return rows[0]["world_size"], table


def ours(algorithms):
    return {a: r for a, r in algorithms.items() if a not in ("native", "gloo", "auto")}


def library(algorithms):
    """Every way to call the library: its algorithms and auto (which may pick native)."""
    return {a: r for a, r in algorithms.items() if a not in ("native", "gloo")}


def fastest(candidates, key):
    name = min(candidates, key=lambda a: candidates[a][key])
    return name, candidates[name][key]


def report(path):
    p, table = load(path)
    out = [f"\n## World size {p} (`{path}`)\n"]
    verdicts = []

    def verdict(name, ok, detail):
        verdicts.append(f"| {name} | {'met' if ok else '**missed**'} | {detail} |")

    # 1. best allreduce >= 1.5x native busbw at 16 MiB and above
    worst = None
    lines = ["| size | best (ours) | vs native (avg) | vs native (p50) |", "|---|---|---|---|"]
    for (c, size), algs in sorted(table.items()):
        if c == "allreduce" and size >= 16 * MiB and "native" in algs and ours(algs):
            name, t = fastest(ours(algs), "time_us")
            ratio = algs["native"]["time_us"] / t
            ratio50 = algs["native"]["p50_us"] / fastest(ours(algs), "p50_us")[1]
            worst = ratio if worst is None else min(worst, ratio)
            lines.append(f"| {size // MiB} MiB | {name} | {ratio:.2f}x | {ratio50:.2f}x |")
    if worst is not None:
        out += ["### Allreduce at 16 MiB and above: best of ours against native\n", *lines, ""]
        verdict("allreduce best >= 1.5x native, >= 16 MiB", worst >= 1.5, f"lowest {worst:.2f}x")

    # 2. auto within 1.2x of the fastest (native included), 8 B .. 64 MiB
    lines, misses = auto_misses(table, 1.2)
    for c in sorted({c for c, _ in table}):
        if any("auto" in algs for (cc, _), algs in table.items() if cc == c):
            sizes = misses.get(c, [])
            verdict(f"{c}: auto within 1.2x of fastest, 8 B..64 MiB", not sizes,
                    f"over 1.2x at {len(sizes)} sizes" + (f": {sizes}" if sizes else ""))
    if len(lines) > 2:
        out += ["### Sizes where auto is more than 1.2x off the fastest\n", *lines, ""]

    # 3. 8-byte allreduce through auto <= 2x native latency
    algs = table.get(("allreduce", 8))
    if algs and "auto" in algs:
        ratio = algs["auto"]["time_us"] / algs["native"]["time_us"]
        ratio50 = algs["auto"]["p50_us"] / algs["native"]["p50_us"]
        verdict("8 B allreduce via auto <= 2x native", ratio <= 2.0,
                f"{algs['auto']['time_us']:.1f} us vs {algs['native']['time_us']:.1f} us = {ratio:.2f}x "
                f"(p50 {ratio50:.2f}x)")

    # 4. broadcast and allgather: best >= native at 1 MiB and above
    for c in ("broadcast", "allgather"):
        ratios = best_over_native(table, c, MiB)
        if ratios:
            verdict(f"{c}: best >= native, >= 1 MiB", min(ratios.values()) >= 1.0,
                    "; ".join(f"{s // MiB} MiB {r:.2f}x" for s, r in sorted(ratios.items())))

    # 5. >= 3x faster than gloo from 64 KiB: what the library gives (auto, or the best
    # algorithm named explicitly)
    for c in ("allreduce", "broadcast", "allgather"):
        ratios = {size: algs["gloo"]["time_us"] / fastest(library(algs), "time_us")[1]
                  for (cc, size), algs in table.items() if cc == c and size >= 64 * 1024 and "gloo" in algs}
        if ratios:
            low = min(ratios.values())
            verdict(f"{c}: >= 3x faster than gloo, >= 64 KiB", low >= 3.0,
                    f"lowest {low:.2f}x (at {min(ratios, key=ratios.get)} B), highest {max(ratios.values()):.1f}x")

    # One node at the memory-bandwidth limit: 6. allreduce from 16 MiB within
    # 1.5x of the memory-traffic bound and >= 3x native; 7. broadcast and allgather
    # >= native from 64 KiB; 8. auto within 1.1x of the fastest at every size.
    rows = [(size, fastest(ours(algs), "time_us")[0], algs) for (c, size), algs in sorted(table.items())
            if c == "allreduce" and size >= 16 * MiB and "native" in algs and ours(algs)]
    if rows and all(algs[name].get("vs_bound") for _, name, algs in rows):
        bound = max(algs[name]["vs_bound"] for _, name, algs in rows)
        native = min(algs["native"]["time_us"] / algs[name]["time_us"] for _, name, algs in rows)
        verdict("allreduce >= 16 MiB within 1.5x of the memory-traffic bound", bound <= 1.5,
                "; ".join(f"{s // MiB} MiB {a[n]['vs_bound']:.2f}x ({n})" for s, n, a in rows))
        verdict("allreduce >= 16 MiB >= 3x native", native >= 3.0,
                "; ".join(f"{s // MiB} MiB {a['native']['time_us'] / a[n]['time_us']:.2f}x" for s, n, a in rows))
    for c in ("broadcast", "allgather"):
        ratios = best_over_native(table, c, 64 * 1024)
        if ratios:
            below = {s: r for s, r in sorted(ratios.items()) if r < 1.0}
            verdict(f"{c}: best >= native, >= 64 KiB", not below,
                    f"below at {len(below)} of {len(ratios)} sizes" +
                    (": " + "; ".join(f"{s} B {r:.2f}x" for s, r in below.items()) if below else ""))
    lines, misses = auto_misses(table, 1.1)
    for c in sorted(misses):
        verdict(f"{c}: auto within 1.1x of fastest, 8 B..64 MiB", False,
                f"over 1.1x at {len(misses[c])} sizes: {misses[c]}")

    out = out[:1] + ["| target | | measured |", "|---|---|---|", *verdicts, ""] + out[1:]
    return "\n".join(out)


# Contenders that run on other buffers or another communicator than auto's call:
# shm_registered on registered buffers (collectives-bench --registered), deterministic
# on a deterministic communicator. auto cannot pick them for the call it is given, so
# they are not in the field it is measured against (they count as ours elsewhere).
OTHER_CALLS = ("shm_registered", "deterministic")


def auto_misses(table, limit):
    """The rows of a table of sizes where auto is more than ``limit`` times the fastest
    contender it could have picked (native included: not ``OTHER_CALLS``), and those
    sizes per collective."""
    lines = ["| collective | size | auto picks | fastest | auto / fastest (avg) | (p50) |", "|---|---|---|---|---|---|"]
    misses = defaultdict(list)
    for (c, size), algs in sorted(table.items()):
        if "auto" not in algs or size > 64 * MiB:
            continue
        field = {a: r for a, r in algs.items() if a not in ("auto", "gloo") + OTHER_CALLS}
        best, t = fastest(field, "time_us")
        ratio = algs["auto"]["time_us"] / t
        ratio50 = algs["auto"]["p50_us"] / fastest(field, "p50_us")[1]
        if ratio > limit:
            misses[c].append(size)
            lines.append(f"| {c} | {size} | {algs['auto'].get('chosen')} | {best} | {ratio:.2f} | {ratio50:.2f} |")
    return lines, misses


def best_over_native(table, collective, from_bytes):
    """Size -> native's time over our fastest algorithm's, from ``from_bytes`` up."""
    return {size: algs["native"]["time_us"] / fastest(ours(algs), "time_us")[1]
            for (c, size), algs in table.items() if c == collective and size >= from_bytes and ours(algs)}


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print("# Targets\n" + "".join(report(path) for path in sys.argv[1:]))
