"""Small-message latency: where a tiny call's time goes (issue 17, the lean path).

    mpiexec -n 2 python bench/latency.py [--bytes 8] [--rounds 7] [--calls 4000] [--json FILE]

Every contender is timed in the same interleaved rounds (round r times each contender
once, in turn), ``--calls`` blocking calls per timing, after a barrier; a timing is the
slowest rank's mean per call, and the table shows each contender's median over rounds
and its ratio to the raw mpi4py call of MPI_Allreduce on the same buffers:

- ``mpi4py Allreduce``: ``comm.Allreduce(x, out, MPI.SUM)``, the floor;
- ``auto`` / ``native``: the library's call that resolves to MPI's own collective
  (``out=`` given, as the raw call has it): its fixed cost is the difference;
- each of the library's own allreduce algorithms on the same bytes;
- ``lean.run`` alone: the lean executor on ``recursive_doubling``'s plan, without the
  call's argument checks (what the algorithm's own messages and reduction cost);
- ``engine``: ``recursive_doubling`` with a timeout, which takes the progress engine
  (the general path a call takes when it can time out or has company in flight).

Float32 sum, ``--bytes`` per rank.
"""

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

import collectives as cc
from collectives import communicator as communicator_module
from collectives.transport import lean
from collectives.transport.buffers import Buffers


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    comm = cc.Communicator()
    raw = world.Dup()
    x = np.ones(max(1, args.bytes // 4), np.float32)
    out = np.empty_like(x)
    plan = communicator_module._plan("allreduce", "recursive_doubling", comm.rank, comm.size, x.size, 0, 1, False,
                                     False)
    program = lean.program(plan)
    tmp = np.empty(max(plan.tmp, 1), np.float32)
    buffers = Buffers(x, out, tmp)
    contenders = {
        "mpi4py Allreduce": lambda: raw.Allreduce(x, out, MPI.SUM),
        "auto": lambda: comm.allreduce(x, out=out),
        "native": lambda: comm.allreduce(x, out=out, algorithm="native"),
    }
    for name in cc.algorithms("allreduce"):
        if name not in ("auto", "native") and not name.startswith("hierarchical"):
            contenders[name] = (lambda a: lambda: comm.allreduce(x, out=out, algorithm=a))(name)
    contenders["lean.run (recursive_doubling)"] = lambda: lean.run(program, raw, 11, buffers, "sum", str, list.append)
    contenders["engine (recursive_doubling, timeout)"] = lambda: comm.allreduce(x, out=out,
                                                                                algorithm="recursive_doubling",
                                                                                timeout=600)
    times = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, f in contenders.items():
            for _ in range(max(10, args.calls // 20)):  # warm
                f()
            world.Barrier()
            start = time.perf_counter()
            for _ in range(args.calls):
                f()
            took = (time.perf_counter() - start) / args.calls
            times[name].append(world.allreduce(took, op=MPI.MAX) * 1e6)
    if world.rank == 0:
        floor = statistics.median(times["mpi4py Allreduce"])
        auto_choice = comm.choose("allreduce", x.nbytes)[0]
        print(f"# {comm.size} ranks, {x.nbytes} B float32 sum, {args.rounds} interleaved rounds x {args.calls} calls; "
              f"{MPI.Get_library_version().splitlines()[0].strip()}; auto picks {auto_choice}")
        print(f"# {'contender':40s} {'median_us':>10s} {'min_us':>8s} {'max_us':>8s} {'x_mpi':>6s} {'over_mpi_us':>11s}")
        rows = []
        for name, ts in times.items():
            med = statistics.median(ts)
            rows.append({"contender": name, "median_us": med, "min_us": min(ts), "max_us": max(ts),
                         "ratio_to_mpi": med / floor, "rounds_us": ts})
            print(f"  {name:40s} {med:10.2f} {min(ts):8.2f} {max(ts):8.2f} {med / floor:6.2f} {med - floor:11.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": comm.size, "bytes": x.nbytes, "rounds": args.rounds, "calls": args.calls,
                           "mpi": MPI.Get_library_version().splitlines()[0].strip(), "auto": auto_choice,
                           "rows": rows}, f, indent=1)
    comm.free()
    raw.Free()


if __name__ == "__main__":
    main()
