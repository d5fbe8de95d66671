"""What check mode and timeouts cost: allreduce time with each, against the same call
without, and against the MPI library's own ``MPI_Allreduce``, all in the same run.

    mpiexec -n 4 python -m collectives.tools.bench.reliability
    mpiexec -n 4 python -m collectives.tools.bench.reliability --sizes 8,64K,4M --algorithms ring,auto --json out.json

Contenders, interleaved round by round (see :mod:`collectives.tools.bench.timing`):
``native MPI`` (mpi4py's ``Allreduce`` on a duplicate of COMM_WORLD), and for each
algorithm the library's call plain, with ``check=True`` (one 152-byte allgather of the
call's fingerprint first) and with ``timeout=`` (the waiting loop looks at the clock;
a blocking call that resolves to ``native`` becomes MPI's non-blocking collective).
Each result is checked against NumPy before timing.
"""

import argparse
import json
import sys

import numpy as np
from mpi4py import MPI

from ... import Communicator, algorithms
from . import timing
from .cli import parse_bytes


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m collectives.tools.bench.reliability",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,1K,64K,1M,16M", help="comma-separated buffer sizes (default 8,1K,64K,1M,16M)")
    p.add_argument("--algorithms", default="ring,auto", help="allreduce algorithms (default ring,auto)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--budget", type=float, default=0.5, help="seconds of timed calls per contender and size")
    p.add_argument("--json", help="write the rows here (rank 0)")
    args = p.parse_args(argv)
    try:
        args.sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    except argparse.ArgumentTypeError as exc:
        p.error(f"--sizes: {exc}")
    args.algorithms = args.algorithms.split(",")
    for name in args.algorithms:
        if name not in algorithms("allreduce") or name == "native":
            p.error(f"--algorithms: {name!r} is not one of the library's allreduce algorithms")
    return args


def contenders(nbytes, names, world):
    """name -> (call, result getter) for one buffer size."""
    count = max(1, nbytes // 4)
    x = (np.arange(count) % 7 + world.Get_rank()).astype(np.float32)
    out = np.empty_like(x)
    mpi = world.Dup()
    plain, checked, timed = Communicator(), Communicator(check=True), Communicator(timeout=600)
    calls = {"native MPI": lambda: mpi.Allreduce(x, out, MPI.SUM)}
    for name in names:
        calls[f"{name}"] = lambda name=name: plain.allreduce(x, algorithm=name, out=out)
        calls[f"{name} check"] = lambda name=name: checked.allreduce(x, algorithm=name, out=out)
        calls[f"{name} timeout"] = lambda name=name: timed.allreduce(x, algorithm=name, out=out)
    p = world.Get_size()
    expected = (np.arange(count) % 7 * p + p * (p - 1) // 2).astype(np.float32)
    return calls, out, expected, (mpi, plain, checked, timed)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    world = MPI.COMM_WORLD
    rank0 = world.Get_rank() == 0
    rows = []
    for nbytes in args.sizes:
        calls, out, expected, comms = contenders(nbytes, args.algorithms, world)
        for name, call in calls.items():  # checked first: a wrong result is not timed
            out[...] = -1
            call()
            if not np.array_equal(out, expected):
                raise SystemExit(f"rank {world.Get_rank()}: {name} at {nbytes} B gave a wrong result")
        iters = {name: timing.iterations(world, call, 2, args.budget, 5, 10000) for name, call in calls.items()}
        samples = timing.interleaved(world, calls, iters, args.rounds)
        stats = {name: timing.combine(world, s) for name, s in samples.items()}
        for name, s in stats.items():
            algorithm = name.split()[0] if name != "native MPI" else "native MPI"
            base = stats[algorithm]["time_us"]
            rows.append({"bytes": nbytes, "contender": name, "time_us": s["time_us"], "p50_us": s["p50_us"],
                         "vs_plain": s["time_us"] / base, "vs_native": s["time_us"] / stats["native MPI"]["time_us"]})
        comms[0].Free()
        for comm in comms[1:]:
            comm.free()
    if rank0:
        print(f"# allreduce float32, {world.Get_size()} ranks; time is the mean over ranks of each rank's mean call")
        print(f"{'bytes':>10} {'contender':<24} {'time_us':>10} {'vs plain':>9} {'vs native':>10}")
        for row in rows:
            print(f"{row['bytes']:>10} {row['contender']:<24} {row['time_us']:>10.1f} {row['vs_plain']:>9.2f} "
                  f"{row['vs_native']:>10.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": world.Get_size(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
