"""Small-call latency of this checkout against another one, in one interleaved run (A/B).

    git archive BASE | tar -x -C /tmp/base        # the other checkout, e.g. the commit before a change
    mpiexec -n 2 python bench/latency_ab.py --baseline /tmp/base [--bytes 8] [--lean-bytes 16384] \\
        [--p2p-bytes 1048576] [--rounds 9] [--calls 4000] [--json FILE]

The package in ``BASELINE/collectives`` is imported a second time, as
``collectives_baseline`` (the core imports itself only relatively, so the two copies
share nothing but mpi4py), and every contender runs once per round in each copy, in
turn, in the same rounds (``--calls`` blocking calls per timing after a barrier; a
timing is the slowest rank's mean per call). The table gives each contender's median
over rounds in both copies and the difference, and the same for the least over rounds
(on a shared machine the least is the run another process disturbed least), float32
sum allreduce, out of place:

- ``auto``: what ``auto`` picks on ``--bytes`` (MPI's own collective there, on the lean
  path);
- ``recursive_doubling``: the library's own algorithm on ``--bytes`` (a persistent
  program, the smallest calls' path);
- ``ring``: on ``--lean-bytes`` (past the persistent programs' 8 KiB: the lean executor);
- ``recursive_doubling, timeout``: on ``--bytes`` through the progress engine;
- ``native, timeout``: MPI's non-blocking collective through the engine;
- ``broadcast``: what ``auto`` picks for a broadcast from rank 0 on ``--bytes`` (MPI's
  own there, checked: the root's size sent ahead, or in older code the ranks' agreement
  on it);
- ``send/recv`` on ``--bytes`` and on ``--p2p-bytes``: a ping-pong between ranks 0 and
  1 (the others idle), a round trip per call;
- ``mpi4py Allreduce``, ``mpi4py Bcast`` and ``mpi4py Send/Recv`` (the same ping-pong):
  the floors, once.
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


def load_baseline(folder):
    init = Path(folder) / "collectives" / "__init__.py"
    if not init.exists():
        sys.exit(f"--baseline {folder}: no collectives/__init__.py there")
    spec = importlib.util.spec_from_file_location("collectives_baseline", init,
                                                  submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["collectives_baseline"] = module
    spec.loader.exec_module(module)
    return module


def ping_pong(send, recv, rank, a, b):
    """One round trip of ``a`` from rank 0 to rank 1, answered into ``b`` (``send(x,
    peer)``, ``recv(out, peer)``); nothing on the other ranks."""
    if rank == 0:
        return lambda: (send(a, 1), recv(b, 1))
    if rank == 1:
        return lambda: (recv(b, 0), send(b, 0))
    return lambda: None


def contenders(package, nbytes, lean_bytes, p2p_bytes):
    comm = package.Communicator()
    x, out = np.ones(max(1, nbytes // 4), np.float32), np.empty(max(1, nbytes // 4), np.float32)
    y, out_y = np.ones(max(1, lean_bytes // 4), np.float32), np.empty(max(1, lean_bytes // 4), np.float32)
    found = {
        "auto": lambda: comm.allreduce(x, out=out),
        "recursive_doubling": lambda: comm.allreduce(x, out=out, algorithm="recursive_doubling"),
        f"ring ({lean_bytes} B)": lambda: comm.allreduce(y, out=out_y, algorithm="ring"),
        "recursive_doubling, timeout": lambda: comm.allreduce(x, out=out, algorithm="recursive_doubling",
                                                              timeout=600),
        "native, timeout": lambda: comm.allreduce(x, out=out, algorithm="native", timeout=600),
        "broadcast": lambda: comm.broadcast(x),
    }
    if comm.size > 1:
        for n in (nbytes, p2p_bytes):
            a, b = np.ones(max(1, n // 4), np.float32), np.empty(max(1, n // 4), np.float32)
            found[f"send/recv ({n} B)"] = ping_pong(comm.send, comm.recv, comm.rank, a, b)
    return comm, found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="a folder holding the other checkout's collectives/")
    parser.add_argument("--bytes", type=int, default=8)
    parser.add_argument("--lean-bytes", type=int, default=16384)
    parser.add_argument("--p2p-bytes", type=int, default=1 << 20)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    baseline = load_baseline(args.baseline)
    raw = world.Dup()
    x, out = np.ones(max(1, args.bytes // 4), np.float32), np.empty(max(1, args.bytes // 4), np.float32)
    new_comm, new = contenders(cc, args.bytes, args.lean_bytes, args.p2p_bytes)
    old_comm, old = contenders(baseline, args.bytes, args.lean_bytes, args.p2p_bytes)
    floors = {"mpi4py Allreduce": lambda: raw.Allreduce(x, out, MPI.SUM), "mpi4py Bcast": lambda: raw.Bcast(x, 0)}
    if world.size > 1:
        floors["mpi4py Send/Recv"] = ping_pong(lambda a, peer: raw.Send(a, peer), lambda b, peer: raw.Recv(b, peer),
                                               world.rank, x, out.copy())
    timed = {(name, "-"): f for name, f in floors.items()}
    for name in new:
        timed[(name, "baseline")] = old[name]
        timed[(name, "this")] = new[name]
    times = {key: [] for key in timed}
    for r in range(args.rounds):
        keys = list(timed) if r % 2 == 0 else list(timed)[::-1]  # alternate the order between rounds
        for key in keys:
            f = timed[key]
            calls = args.calls if "timeout" not in key[0] else max(100, args.calls // 10)
            for _ in range(max(10, calls // 20)):  # warm
                f()
            world.Barrier()
            start = time.perf_counter()
            for _ in range(calls):
                f()
            took = (time.perf_counter() - start) / calls
            times[key].append(world.allreduce(took, op=MPI.MAX) * 1e6)
    if world.rank == 0:
        print(f"# {world.size} ranks, float32 sum allreduce, {args.rounds} interleaved rounds; "
              f"{cc.mpi_library.library()}; baseline {args.baseline}; auto picks "
              f"{new_comm.choose('allreduce', x.nbytes)[0]} on {x.nbytes} B")
        print(f"# {'contender':34s} {'median: baseline':>16s} {'this':>8s} {'diff':>8s}   "
              f"{'least: baseline':>15s} {'this':>8s} {'diff':>8s}  (us)")
        rows = []
        for name in floors:
            floor = times[(name, "-")]
            rows.append({"contender": name, "this_us": statistics.median(floor), "this_min_us": min(floor)})
            print(f"  {name:34s} {'':>16s} {statistics.median(floor):8.2f} {'':>8s}   {'':>15s} "
                  f"{min(floor):8.2f}")
        for name in new:
            old_t, new_t = times[(name, "baseline")], times[(name, "this")]
            a, b = statistics.median(old_t), statistics.median(new_t)
            la, lb = min(old_t), min(new_t)
            rows.append({"contender": name, "baseline_us": a, "this_us": b, "diff_us": b - a, "baseline_min_us": la,
                         "this_min_us": lb, "diff_min_us": lb - la, "baseline_rounds_us": old_t,
                         "this_rounds_us": new_t})
            print(f"  {name:34s} {a:16.2f} {b:8.2f} {b - a:+8.2f}   {la:15.2f} {lb:8.2f} {lb - la:+8.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": world.size, "bytes": args.bytes, "lean_bytes": args.lean_bytes,
                           "p2p_bytes": args.p2p_bytes,
                           "rounds": args.rounds, "calls": args.calls, "mpi": str(cc.mpi_library.library()),
                           "rows": rows}, f, indent=1)
    new_comm.free()
    old_comm.free()
    raw.Free()


if __name__ == "__main__":
    main()
