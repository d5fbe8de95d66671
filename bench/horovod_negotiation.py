"""What Horovod's negotiation costs per call in collectives.horovod.torch.

    mpiexec -n 2 python bench/horovod_negotiation.py [--sizes 8,65536,4194304] [--rounds 7] [--json FILE]

Before every call, ``hvd`` allgathers a 168-byte record per rank over the call's process
set, so that mismatched calls raise on every rank and joined ranks can take part
(``COLLECTIVES_HOROVOD_CHECK=1``, the default). This times ``hvd.allreduce`` (float32,
``op=hvd.Sum``, out of place) with negotiation and without (``COLLECTIVES_HOROVOD_CHECK=0``:
``hvd.init()`` reads it, so each round initialises twice), and the library's own
``Communicator.allreduce`` on the same bytes, in the same interleaved rounds (round r
times each contender once, in turn, after a barrier). A timing is the slowest rank's
mean per call; the table shows each contender's median over the rounds, and the
negotiation's cost: the difference with and without, absolute and relative.
"""

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI

import collectives as cc
import collectives.horovod.torch as hvd


def timed(call, calls, world):
    call()  # warm: the first call of a kind takes the checked path
    world.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return world.allreduce((time.perf_counter() - start) / calls, op=MPI.MAX)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,65536,4194304", help="bytes per rank, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.5, help="about how long each timing runs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    comm = cc.Communicator()
    sizes = [int(s) for s in args.sizes.split(",")]
    times = {(size, who): [] for size in sizes for who in ("negotiated", "not negotiated", "Communicator")}
    for _ in range(args.rounds):
        for size in sizes:
            x = torch.ones(max(1, size // 4))
            out = np.empty(x.numel(), np.float32)
            calls = max(5, min(5000, int(args.seconds / (2e-5 + size / 2e9))))
            for check in ("1", "0"):
                os.environ["COLLECTIVES_HOROVOD_CHECK"] = check
                hvd.init()
                who = "negotiated" if check == "1" else "not negotiated"
                times[size, who].append(timed(lambda: hvd.allreduce(x, op=hvd.Sum), calls, world))
                hvd.shutdown()
            times[size, "Communicator"].append(timed(lambda: comm.allreduce(x.numpy(), out=out), calls, world))
    rows = []
    for size in sizes:
        median = {who: statistics.median(times[size, who]) for who in ("negotiated", "not negotiated", "Communicator")}
        cost = median["negotiated"] - median["not negotiated"]
        rows.append(dict(bytes=size, ranks=world.Get_size(), **{f"{k} us": v * 1e6 for k, v in median.items()},
                         **{"negotiation us": cost * 1e6, "negotiation share": cost / median["negotiated"]}))
    if world.Get_rank() == 0:
        print(f"hvd.allreduce, float32 sum, {world.Get_size()} ranks, median of {args.rounds} interleaved rounds "
              "(slowest rank's mean per call)")
        print(f"{'bytes':>9} {'negotiated':>12} {'not':>12} {'Communicator':>13} {'negotiation':>12} {'share':>6}")
        for row in rows:
            print(f"{row['bytes']:>9} {row['negotiated us']:>10.1f}us {row['not negotiated us']:>10.1f}us "
                  f"{row['Communicator us']:>11.1f}us {row['negotiation us']:>10.1f}us "
                  f"{100 * row['negotiation share']:>5.0f}%")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "rounds": args.rounds}, f, indent=1)


if __name__ == "__main__":
    main()
