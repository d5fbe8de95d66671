"""A blocking peer-read call's time on the device lean path against the general path,
in one interleaved run (A/B).

    mpiexec -n 2 python bench/device_lean_ab.py [--device standin|cuda] [--fence host]
        [--algorithm one_shot] [--bytes 8] [--calls 2000] [--block 100] [--json FILE]

Both paths run in this checkout: ``general`` is every call with the lean path made to
decline (``calls.lean_device_call``), which is the path a call took before the lean
path existed; ``lean`` is the same call as it runs now. Blocks of ``--block`` float32
sum allreduces on ``--bytes``, in place (``out=x``) and into a kept ``out=``, take turns
in the same run (each block after a barrier; a block's time is the slowest rank's mean
per call) until each contender has made ``--calls`` calls. The table gives each
contender's median and least block, and lean/general of both: on a shared machine
only the ratios from one run mean anything.
"""

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

import collectives as cc
from collectives import calls


def device_module(name):
    if name == "cuda":
        import cupy

        cupy.cuda.Device(MPI.COMM_WORLD.Get_rank() % cupy.cuda.runtime.getDeviceCount()).use()
        return cupy.asarray, lambda x: cupy.cuda.get_current_stream().synchronize()
    from collectives.device import standin

    return standin.asarray, lambda x: standin.asnumpy(x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="standin", choices=("standin", "cuda"))
    parser.add_argument("--fence", default="host", choices=("host", "stream", "kernel"))
    parser.add_argument("--algorithm", default="one_shot", choices=("one_shot", "two_shot"))
    parser.add_argument("--bytes", type=int, default=8)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--block", type=int, default=100)
    parser.add_argument("--json")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    asarray, sync = device_module(args.device)
    comm = cc.Communicator(device_fence=args.fence)
    count = max(args.bytes // 4, 1)
    x = asarray(np.zeros(count, np.float32))  # (zeros: in place, the sum stays finite call after call)
    out = asarray(np.zeros(count, np.float32))
    lean, general = calls.lean_device_call, (lambda *a: calls.NOT_HANDLED)
    contenders = {"in place": lambda: comm.allreduce(x, out=x, algorithm=args.algorithm),
                  "out=": lambda: comm.allreduce(x, out=out, algorithm=args.algorithm)}
    for run in contenders.values():  # warm: the device, the window, the lean entries
        for _ in range(20):
            run()
    times = {(name, path): [] for name in contenders for path in ("general", "lean")}
    for _ in range(max(args.calls // args.block, 1)):
        for (name, path), found in times.items():
            calls.lean_device_call = lean if path == "lean" else general
            run = contenders[name]
            world.Barrier()
            start = time.perf_counter()
            for _ in range(args.block):
                run()
            elapsed = world.allreduce((time.perf_counter() - start) / args.block, op=MPI.MAX)
            found.append(elapsed)
    calls.lean_device_call = lean
    sync(x)
    rows = []
    for name in contenders:
        g, lean_times = times[(name, "general")], times[(name, "lean")]
        rows.append({"call": name, "general_median_us": statistics.median(g) * 1e6,
                     "lean_median_us": statistics.median(lean_times) * 1e6,
                     "general_least_us": min(g) * 1e6, "lean_least_us": min(lean_times) * 1e6,
                     "median_ratio": statistics.median(lean_times) / statistics.median(g),
                     "least_ratio": min(lean_times) / min(g)})
    if comm.rank == 0:
        print(f"allreduce {args.algorithm}, {count * 4} B float32 sum, {args.device}, {args.fence} fences, "
              f"{comm.size} ranks: {args.calls} calls per contender in blocks of {args.block}, interleaved")
        print(f"{'call':<10} {'general':>12} {'lean':>12} {'lean/general':>13}   {'least: general':>15} "
              f"{'lean':>9} {'ratio':>7}")
        for r in rows:
            print(f"{r['call']:<10} {r['general_median_us']:>9.1f} us {r['lean_median_us']:>9.1f} us "
                  f"{r['median_ratio']:>13.2f}   {r['general_least_us']:>12.1f} us {r['lean_least_us']:>6.1f} us "
                  f"{r['least_ratio']:>7.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "ranks": comm.size, "rows": rows}, f, indent=1)
    comm.free()


if __name__ == "__main__":
    main()
