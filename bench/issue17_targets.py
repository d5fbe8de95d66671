"""Issue 17's targets from a collectives-bench JSON file (one interleaved run):

    python bench/issue17_targets.py n2.json

prints the number of wrong elements, allreduce >= 16 MiB against native and the
memory-traffic bound, the sizes where auto is more than 1.1x the fastest contender
(native included), and our best broadcast/allgather against native from 64 KiB.
"""
import json, sys
from collections import defaultdict
rows = json.load(open(sys.argv[1]))
rows = rows["rows"] if isinstance(rows, dict) else rows
by = defaultdict(dict)
for r in rows:
    by[(r["collective"], r["bytes"])][r["algorithm"]] = r
print("wrong:", sum(r["wrong"] or 0 for r in rows), "rows", len(rows))
for coll in ("allreduce", "allgather", "broadcast"):
    over = []
    worst = []
    for (c, b), d in sorted(by.items()):
        if c != coll: continue
        auto = d.get("auto"); nat = d.get("native")
        cont = {a: r["time_us"] for a, r in d.items() if a not in ("auto", "gloo", "deterministic")}
        fa = min(cont, key=cont.get)
        ratio = auto["time_us"] / cont[fa]
        if ratio > 1.1: over.append((b, auto["chosen"], fa, round(ratio, 2)))
        if coll != "allreduce" and b >= 65536:
            best = min((r["time_us"] for a, r in d.items() if a not in ("native","auto","gloo","deterministic")))
            worst.append((b, round(nat["time_us"] / best, 2)))
        if coll == "allreduce" and b >= 16 << 20:
            best_a = min((a for a in d if a not in ("native","auto","gloo","deterministic")), key=lambda a: d[a]["time_us"])
            print(f"  allreduce {b>>20} MiB best {best_a} {d[best_a]['time_us']:.0f} us, vs native {nat['time_us']/d[best_a]['time_us']:.2f}x, time/bound {d[best_a]['vs_bound']:.2f}; native/bound {nat['vs_bound']:.2f}")
    print(coll, "auto >1.1x fastest at", len(over), "sizes:", over)
    if worst: print(coll, "best ours / native speedup >=64KiB:", worst)
