"""How close ``auto`` comes to the fastest contender, per collective and size, from
``collectives-bench --json`` files (each one interleaved run), as a Markdown table.

    python bench/auto_vs_fastest.py [--from 65536] [--target 1.2] n2.json n4.json

The fastest is the least average time (``time_us``) among every contender ``auto``
could have picked: ``native`` and the library's algorithms (``shm_registered`` aside:
only a call whose input is a registered buffer on every rank can take it). A size
holds the target where ``auto``'s time is at most ``--target`` times the fastest's.
``auto``'s pick is the row's ``chosen``.
"""

import argparse
import json
from collections import defaultdict


def rows_of(path):
    table = defaultdict(dict)
    for row in json.load(open(path)):
        table[row["collective"], row["bytes"]][row["algorithm"]] = row
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--from", dest="start", type=int, default=64 << 10)
    parser.add_argument("--target", type=float, default=1.2)
    args = parser.parse_args()
    for path in args.files:
        table = rows_of(path)
        size = next(iter(next(iter(table.values())).values()))["world_size"]
        print(f"\n### {path}: {size} ranks, auto against the fastest it could pick (target: within "
              f"{args.target:g}x from {args.start >> 10} KiB)\n")
        print("| collective | bytes | fastest | its time (us) | native (us) | auto picked | auto (us) | auto / fastest "
              "| held |")
        print("|---|---|---|---|---|---|---|---|---|")
        held = missed = 0
        for (collective, nbytes), contenders in sorted(table.items()):
            if nbytes < args.start or "auto" not in contenders:
                continue
            pickable = {a: r for a, r in contenders.items() if a not in ("auto", "shm_registered", "gloo")}
            best = min(pickable, key=lambda a: pickable[a]["time_us"])
            auto = contenders["auto"]
            ratio = auto["time_us"] / pickable[best]["time_us"]
            ok = ratio <= args.target
            held, missed = held + ok, missed + (not ok)
            native = contenders.get("native", {}).get("time_us", float("nan"))
            print(f"| {collective} | {nbytes} | {best} | {pickable[best]['time_us']:.0f} | {native:.0f} | "
                  f"{auto.get('chosen') or '?'} | {auto['time_us']:.0f} | {ratio:.2f} | {'yes' if ok else '**no**'} |")
        print(f"\n{held} of {held + missed} sizes held.")


if __name__ == "__main__":
    main()
