"""``bench/gpu_paths.py`` (``make bench-gpu-paths``): the GPU path against its physical
references, every ratio from one interleaved run.

    mpiexec -n 2 python -m mpi4py bench/gpu_paths.py --json gpu.json        # on a GPU
    mpiexec -n 2 python -m mpi4py bench/gpu_paths.py --device standin --quick

Three measurements (the target of each beside it):

- **kernels** (rank 0 alone): the reduce kernel (``dst = a + b``, float32, float16,
  bfloat16) and the 4-input fold against the device's own device-to-device copy of
  the same buffers, as bandwidth over the bytes each touches (reduce: 3n, fold: 5n,
  copy: 2n). Target: reduce >= 85% of the copy's bandwidth at >= 64 MiB.
- **pipeline**: staged allreduce (device -> pinned host -> MPI -> device) cut into
  segments (``device_segment_size``, 4 MiB) against the same with whole messages.
  Target: >= 1.5x at >= 16 MiB.
- **ipc**: allreduce between ranks of one node through CUDA IPC against staging.
  Target: >= 5x at >= 16 MiB.

With ``--device standin`` it runs on the CPU stand-in: a check that the code works,
whose times mean nothing.
"""

import argparse
import json
import sys
import time

import numpy as np
from mpi4py import MPI

from collectives import Communicator
from collectives.device import kernels as kernel_names
from collectives.tools.bench import timing
from collectives.tools.bench.cli import parse_bytes
from collectives.tools.bench.devices import BenchDevice
from collectives.tools.bench.report import human_bytes

_PATHS = {"staged": {"cuda_ipc": False}, "ipc": {"cuda_ipc": True}}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="bench/gpu_paths.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "standin"), default="cuda")
    p.add_argument("--kernel-sizes", default="64M,256M,1G", help="buffer sizes of the kernel measurement")
    p.add_argument("--sizes", default="1M,16M,64M,256M", help="allreduce sizes of the pipeline and ipc measurements")
    p.add_argument("--algorithm", default="ring", help="the allreduce algorithm of the pipeline and ipc runs")
    p.add_argument("--segment", type=parse_bytes, default=4 << 20, help="the pipelined runs' device segment size")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per contender and round (default 10)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round: checks the code runs")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON (rank 0)")
    args = p.parse_args(argv)
    if args.quick:
        args.kernel_sizes, args.sizes, args.rounds, args.iters, args.segment = "64K", "256K", 1, 2, 32 << 10
    args.kernel_sizes = [parse_bytes(s) for s in args.kernel_sizes.split(",")]
    args.sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    return args


# -- kernels ---------------------------------------------------------------------------------------
class _Timer:
    """Times device work with CUDA events (or the wall clock on the stand-in)."""

    def __init__(self, device):
        self.device = device
        self.cuda = device.kind == "cuda"

    def __call__(self, work, iters):
        stream = self.device.stream
        if self.cuda:
            start, stop = self.device.cupy.cuda.Event(), self.device.cupy.cuda.Event()
            start.record(stream)
            for _ in range(iters):
                work(stream)
            stop.record(stream)
            stop.synchronize()
            return self.device.cupy.cuda.get_elapsed_time(start, stop) / 1e3 / iters
        begin = time.perf_counter()
        for _ in range(iters):
            work(stream)
        self.device.sync()
        return (time.perf_counter() - begin) / iters


def kernel_rows(device, args):
    """Reduce kernels against the device-to-device copy, interleaved (rank 0)."""
    backend = device.backend
    timer = _Timer(device)
    rows = []
    for nbytes in args.kernel_sizes:
        contenders = {}
        buffers = {}
        for dtype_name in ("float32", "float16", "bfloat16"):
            dtype = kernel_names.BFLOAT16 if dtype_name == "bfloat16" else np.dtype(dtype_name)
            n = nbytes // dtype.itemsize
            storage = backend.storage_dtype(dtype)
            a, b, dst = (backend.empty(n, storage) for _ in range(3))
            buffers[dtype_name] = (a, b, dst)
            contenders[f"reduce sum {dtype_name}"] = (3 * nbytes, lambda s, d=dtype, x=(dst, a, b):
                                                      backend.reduce2(s, "sum", d, *x))
        a, b, dst = buffers["float32"]
        more = [backend.empty(a.size, a.dtype) for _ in range(2)]
        contenders["reduce_n sum float32, 4 inputs"] = (5 * nbytes, lambda s, dst=dst, ins=[a, b] + more:
                                                           backend.reduce_n(s, "sum", np.dtype("float32"), dst, ins))
        contenders["device-to-device copy"] = (2 * nbytes, lambda s, dst=dst, a=a: backend.copy(dst, a, s))
        for _, work in contenders.values():  # warm up (compiles the kernels)
            work(device.stream)
        device.sync()
        times = {name: [] for name in contenders}
        for r in range(args.rounds):
            names = list(contenders)
            for name in names[r % len(names):] + names[: r % len(names)]:
                times[name].append(timer(contenders[name][1], args.iters))
        copy_bw = 2 * nbytes / np.median(times["device-to-device copy"]) / 1e9
        for name, (touched, _) in contenders.items():
            seconds = float(np.median(times[name]))
            bandwidth = touched / seconds / 1e9
            rows.append({"measure": "kernels", "bytes": nbytes, "contender": name, "time_us": seconds * 1e6,
                         "GBps": bandwidth, "vs_copy": bandwidth / copy_bw})
    return rows


# -- pipeline and IPC ------------------------------------------------------------------------------
def communicator(path, device, segment):
    """A communicator whose device messages go ``path``'s way, agreed by the ranks now."""
    comm = Communicator(device_segment_size=segment, **_PATHS[path])
    one = device.empty(1, np.float32)
    device.upload(one, np.ones(1, np.float32))
    comm.allreduce(one)
    return comm


def collective_rows(device, args, world):
    """Pipelined against whole-message staging, and IPC against staging, interleaved."""
    contenders = {
        "staged, pipelined": communicator("staged", device, args.segment),
        "staged, whole messages": communicator("staged", device, 0),
        "ipc, pipelined": communicator("ipc", device, args.segment),
    }
    rows = []
    for nbytes in args.sizes:
        n = nbytes // 4
        x = device.empty(n, np.float32)
        device.upload(x, np.full(n, world.Get_rank() + 1, np.float32))
        calls = {}
        for name, comm in contenders.items():
            calls[name] = (lambda c=comm, x=x: (c.allreduce(x, algorithm=args.algorithm, out=x),
                                                   device.sync()))
        for call in calls.values():
            call()
        samples = timing.interleaved(world, calls, {name: args.iters * args.rounds for name in calls}, args.rounds)
        stats = {name: timing.combine(world, samples[name]) for name in calls}
        p = world.Get_size()
        for name, stat in stats.items():
            busbw = nbytes / (stat["time_us"] * 1e-6) / 1e9 * 2 * (p - 1) / p
            rows.append({"measure": "allreduce", "bytes": nbytes, "contender": name, "time_us": stat["time_us"],
                         "busbw_GBps": busbw, "algorithm": args.algorithm, "world_size": p,
                         "vs_whole": stats["staged, whole messages"]["time_us"] / stat["time_us"],
                         "vs_staged": stats["staged, pipelined"]["time_us"] / stat["time_us"]})
    for comm in contenders.values():
        comm.free()
    return rows


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    world = MPI.COMM_WORLD
    device = BenchDevice(args.device, world.Get_rank())
    rank0 = world.Get_rank() == 0
    rows = kernel_rows(device, args) if rank0 else []
    world.Barrier()
    if world.Get_size() > 1:
        rows += collective_rows(device, args, world)
    if rank0:
        print(f"# bench/gpu_paths.py: {world.Get_size()} ranks on {device.name}; "
              f"{args.rounds} interleaved rounds of {args.iters} calls; medians (kernels) and means (allreduce)")
        for row in rows:
            if row["measure"] == "kernels":
                print(f"  kernels  {human_bytes(row['bytes']):>6s}  {row['contender']:34s} {row['time_us']:10.1f} us "
                      f"{row['GBps']:8.1f} GB/s  {row['vs_copy']:5.2f} x copy")
            else:
                print(f"  {row['algorithm']} allreduce {human_bytes(row['bytes']):>6s}  {row['contender']:24s} "
                      f"{row['time_us']:10.1f} us  busbw {row['busbw_GBps']:7.2f} GB/s  "
                      f"{row['vs_whole']:5.2f} x whole  {row['vs_staged']:5.2f} x staged")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"versions": device.versions(), "mpi": MPI.Get_library_version().split("\n")[0],
                           "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
