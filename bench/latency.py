"""Small-message latency: where a small call's time goes, and whether a change slowed it.

    mpiexec -n 2 python bench/latency.py [--sizes 8,64K] [--rounds 7] [--calls 2000] [--json FILE]
    mpiexec -n 2 python bench/latency.py --before /path/to/old/checkout ...

Every contender is timed in the same interleaved rounds (round r times each contender
once, in turn, in the opposite order every other round), ``--calls`` calls per timing,
after a barrier; a timing is the slowest
rank's mean per call, and the table shows each contender's median over rounds and its
ratio to the raw mpi4py ``Allreduce`` on the same buffers (the floor). Float32 sum,
``out=`` given, for each size in ``--sizes``:

- ``mpi4py Allreduce``: ``comm.Allreduce(x, out, MPI.SUM)``;
- ``auto``: the library's call (``auto`` picks ``native`` at these sizes here): the
  lean path to MPI's blocking collective;
- ``ring`` and ``recursive_doubling``: the library's own algorithms, blocking: a
  persistent program up to 8 KiB, the lean executor above;
- ``shm``: the shared-memory algorithm, blocking (the lean path runs it inline);
- ``... async``: the ``_async`` call then ``wait()``: the progress engine;
- ``... timeout``: blocking with ``timeout=`` (the general path: the engine, since it
  may have to stop);
- ``lean.run``: the lean executor alone on ``recursive_doubling``'s plan, without the
  call's argument checks (this version only).

With ``--before DIR`` (a checkout of an earlier commit: ``git worktree add DIR REV``),
its ``collectives`` package is loaded beside this one as ``collectives_before`` and
every contender above (but ``lean.run``) is timed for both, interleaved in the same
rounds, each right beside its before (so that neither always follows the same
neighbour); the table then adds each one's ratio after/before (of the medians) and
``paired``, the median over rounds of each round's after/before (the two timings of a
round ran side by side, so a disturbance of the machine then falls on both).
"""

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import collectives as cc
from collectives.routes.base import compiled_plan
from collectives.transport import lean
from collectives.transport.buffers import Buffers


def parse_bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def load_before(path):
    """The ``collectives`` package of the checkout at ``path``, as ``collectives_before``."""
    root = Path(path) / "collectives"
    spec = importlib.util.spec_from_file_location("collectives_before", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["collectives_before"] = module
    spec.loader.exec_module(module)
    return module


def contenders_for(package, label, comm, x, out):
    """The library's contenders on one package (``label`` prefixes their names)."""
    f = {}
    f[f"{label}auto"] = lambda: comm.allreduce(x, out=out)
    for name in ("ring", "recursive_doubling"):
        f[f"{label}{name}"] = (lambda a: lambda: comm.allreduce(x, out=out, algorithm=a))(name)
    if comm.size > 1 and getattr(comm, "shares_memory", getattr(comm, "_shares_memory", True)):
        f[f"{label}shm"] = lambda: comm.allreduce(x, out=out, algorithm="shm")
    f[f"{label}auto async"] = lambda: comm.allreduce_async(x, out=out).wait()
    f[f"{label}recursive_doubling async"] = lambda: comm.allreduce_async(x, out=out,
                                                                         algorithm="recursive_doubling").wait()
    f[f"{label}auto timeout"] = lambda: comm.allreduce(x, out=out, timeout=600)
    f[f"{label}recursive_doubling timeout"] = lambda: comm.allreduce(x, out=out, algorithm="recursive_doubling",
                                                                     timeout=600)
    return f


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,64,512,4K,32K,64K", help="bytes per rank, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000, help="calls per timing at 8 B (fewer for larger sizes)")
    parser.add_argument("--before", default=None, help="a checkout of an earlier commit to compare with")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    world = MPI.COMM_WORLD
    raw = world.Dup()
    comm = cc.Communicator()
    before = load_before(args.before) if args.before else None
    old = before.Communicator() if before else None
    rows = []
    for nbytes in sizes:
        x = np.ones(max(1, nbytes // 4), np.float32)
        out = np.empty_like(x)
        calls = max(50, args.calls * 8 // max(nbytes, 8)) if nbytes > 4096 else args.calls
        contenders = {"mpi4py Allreduce": lambda x=x, out=out: raw.Allreduce(x, out, MPI.SUM)}
        befores = contenders_for(before, "before: ", old, x, out) if old is not None else {}
        for name, f in contenders_for(cc, "", comm, x, out).items():  # each beside its before
            contenders[name] = f
            if f"before: {name}" in befores:
                contenders[f"before: {name}"] = befores[f"before: {name}"]
        plan = compiled_plan("allreduce", "recursive_doubling", comm.rank, comm.size, x.size, 0, 1, False, False)
        program = lean.program(plan)
        tmp = np.empty(max(plan.tmp, 1), np.float32)
        buffers = Buffers(x, out, tmp)
        if program is not None:
            contenders["lean.run (recursive_doubling)"] = (
                lambda program=program, buffers=buffers: lean.run(program, raw, 11, buffers, "sum", str, list.append))
        times = {name: [] for name in contenders}
        for r in range(args.rounds):
            for name in list(contenders) if r % 2 == 0 else list(contenders)[::-1]:
                f = contenders[name]
                for _ in range(max(10, calls // 20)):  # warm
                    f()
                world.Barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    f()
                took = (time.perf_counter() - start) / calls
                times[name].append(world.allreduce(took, op=MPI.MAX) * 1e6)
        floor = statistics.median(times["mpi4py Allreduce"])
        for name, ts in times.items():
            med = statistics.median(ts)
            row = {"bytes": x.nbytes, "contender": name, "median_us": med, "min_us": min(ts), "max_us": max(ts),
                   "ratio_to_mpi": med / floor, "rounds_us": ts}
            if old is not None and not name.startswith("before: ") and f"before: {name}" in times:
                before_ts = times[f"before: {name}"]
                row["after_over_before"] = med / statistics.median(before_ts)
                # Each round's pair ran side by side, so it shares the machine's state then.
                row["paired"] = statistics.median(a / b for a, b in zip(ts, before_ts))
            rows.append(row)
    if world.rank == 0:
        library = MPI.Get_library_version().splitlines()[0].strip()
        print(f"# {comm.size} ranks, float32 sum, {args.rounds} interleaved rounds; {library}; "
              f"auto picks {comm.choose('allreduce', 8)[0]} at 8 B" + (f"; before: {args.before}" if old else ""))
        print(f"# {'bytes':>6s} {'contender':40s} {'median_us':>10s} {'min_us':>8s} {'max_us':>8s} {'x_mpi':>6s}"
              + (f" {'after/before':>12s} {'paired':>6s}" if old else ""))
        for row in rows:
            if row["contender"].startswith("before: "):
                continue
            ratio = (f" {row['after_over_before']:12.3f} {row['paired']:6.3f}" if "after_over_before" in row
                     else (" " * 20 if old else ""))
            print(f"  {row['bytes']:6d} {row['contender']:40s} {row['median_us']:10.2f} {row['min_us']:8.2f} "
                  f"{row['max_us']:8.2f} {row['ratio_to_mpi']:6.2f}{ratio}")
        if old is not None:
            worst = max((r for r in rows if "after_over_before" in r), key=lambda r: r["after_over_before"])
            paired = max((r for r in rows if "paired" in r), key=lambda r: r["paired"])
            print(f"# slowest against before: {worst['contender']} at {worst['bytes']} B, "
                  f"{worst['after_over_before']:.3f}x; paired: {paired['contender']} at {paired['bytes']} B, "
                  f"{paired['paired']:.3f}x")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": comm.size, "mpi": library, "rounds": args.rounds, "calls": args.calls,
                           "before": args.before, "rows": rows}, f, indent=1)
    comm.free()
    if old is not None:
        old.free()
    raw.Free()


if __name__ == "__main__":
    main()
