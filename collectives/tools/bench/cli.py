"""``collectives-bench``: bandwidth and latency of every collective and algorithm,
against the MPI library's own collectives measured in the same run.

    mpiexec -n 4 collectives-bench                        # all collectives, 8 B .. 64 MiB
    mpiexec -n 4 collectives-bench -c allreduce -b 1M -e 256M --check --plot ar.png
    mpiexec -n 4 collectives-bench --tune tuning.json     # then COLLECTIVES_TUNING=tuning.json
    mpiexec -n 2 collectives-bench --device cuda -c allreduce -b 64K -e 256M --check   # on a GPU
    mpiexec -n 4 collectives-bench -c allreduce --deterministic   # + what deterministic mode runs
    mpiexec -n 2 collectives-bench -c allreduce -b 1M --registered  # + shm on registered buffers

Exit status: 1 if ``--check`` found any wrong element, 2 on bad arguments.
"""

import argparse
import os
import re
import sys

import numpy as np
from mpi4py import MPI

from ... import Communicator
from ...algorithms import COLLECTIVES, ORDERED, PEER_READS, SHARED_MEMORY, VARIABLE, algorithms
from ...algorithms.shm import REGISTERED
from ...auto import TuningTable
from ...dtypes import SUPPORTED_DTYPES
from ...ops import OPS, check_op
from ...topology import measure_link
from . import membound, report, timing, tune
from .cases import GLOO, Case, bus_factor
from .devices import BenchDevice

_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": 1024**2, "MB": 1024**2, "MIB": 1024**2,
          "G": 1024**3, "GB": 1024**3, "GIB": 1024**3}


def parse_bytes(text):
    """'8' -> 8, '64K' -> 65536, '1MiB' -> 1048576."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 8, 64K, 16M or 1G; got {text!r}")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def sizes(begin, end, factor):
    out, size = [], begin
    while size <= end:
        out.append(size)
        size *= factor
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(prog="collectives-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--collectives", default="all",
                   help=f"comma-separated, from {','.join(COLLECTIVES + VARIABLE)}; or 'all' "
                        f"(default: all but {','.join(VARIABLE)})")
    p.add_argument("-a", "--algorithms", default="all",
                   help="comma-separated algorithm names, each run where the collective has it; "
                        "'all' (default) is every algorithm plus native and auto")
    p.add_argument("-b", "--begin", type=parse_bytes, default=8, help="smallest size in bytes (default 8)")
    p.add_argument("-e", "--end", type=parse_bytes, default=64 * 1024**2, help="largest size (default 64M)")
    p.add_argument("-f", "--factor", type=int, default=2, help="size multiplier between steps (default 2)")
    p.add_argument("-d", "--dtype", default="float32", choices=[d.name for d in SUPPORTED_DTYPES])
    p.add_argument("-o", "--op", default="sum", choices=OPS)
    p.add_argument("-w", "--warmup", type=int, default=2, help="untimed calls per contender and size")
    p.add_argument("--budget", type=float, default=0.05,
                   help="seconds of timed calls per contender and size: sets the iteration count (default 0.05)")
    p.add_argument("--min-iters", type=int, default=5, help="fewest timed calls per contender and size")
    p.add_argument("--max-iters", type=int, default=2000, help="most timed calls per contender and size")
    p.add_argument("-n", "--iters", type=int, help="exactly this many timed calls (instead of --budget)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per size (default 3)")
    p.add_argument("--inplace", action="store_true",
                   help="in place (out=x; MPI_IN_PLACE for native); reduce_scatter, gather, scatter and alltoall "
                        "stay out of place")
    p.add_argument("--check", action="store_true", help="verify every result against native MPI (#wrong)")
    p.add_argument("--peers", default="", help="extra contenders: 'gloo' (torch.distributed, needs torch)")
    p.add_argument("--no-memory", action="store_true", help="skip the tracemalloc measurement")
    p.add_argument("--json", metavar="FILE", help="write the rows as a JSON list")
    p.add_argument("--csv", metavar="FILE", help="write the rows as CSV")
    p.add_argument("--plot", metavar="FILE.png", help="plot busbw against size (needs matplotlib)")
    p.add_argument("--tune", metavar="FILE", nargs="?", const="collectives-tuning.json",
                   help="measure every algorithm and merge the winners into a tuning file for auto "
                        "(default collectives-tuning.json; use it with COLLECTIVES_TUNING=FILE)")
    p.add_argument("--device", choices=("host", "cuda", "standin"), default="host",
                   help="where the buffers live: host (default), cuda (a GPU through CuPy; native is then MPI on "
                        "host copies) or standin (the CPU stand-in GPU of the tests: checks the code, times mean "
                        "nothing)")
    p.add_argument("--deterministic", action="store_true",
                   help="also time what deterministic mode runs (auto on a Communicator(deterministic=True)), "
                        "as the contender 'deterministic', for allreduce, reduce_scatter and reduce")
    p.add_argument("--registered", action="store_true",
                   help="also time shm on registered buffers (Communicator.empty: the ranks read each other's "
                        "inputs in place), as the contender 'shm_registered', for allreduce (in place), "
                        "reduce_scatter, allgather and broadcast on ranks that share memory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--no-bound", action="store_true",
                   help="skip the memory-bandwidth probe and the 'bound' column (time over the memory-traffic bound)")
    args = p.parse_args(argv)

    args.collectives = list(COLLECTIVES) if args.collectives == "all" else args.collectives.split(",")
    for c in args.collectives:
        if c not in COLLECTIVES + VARIABLE:
            p.error(f"--collectives: {c!r} is not one of {', '.join(COLLECTIVES + VARIABLE)}")
        if c in VARIABLE and args.tune:
            p.error(f"--collectives: {c} has per-peer counts, which one size in bytes does not describe: "
                    "--tune leaves it out (auto runs native's Alltoallv)")
    if args.algorithms == "all":
        args.algorithms = None
    else:
        args.algorithms = args.algorithms.split(",")
        known = {a for c in args.collectives for a in algorithms(c)}
        for a in args.algorithms:
            if a not in known:
                p.error(f"--algorithms: {a!r} is not an algorithm of {', '.join(args.collectives)}; "
                        f"known: {', '.join(sorted(known))}")
    args.peers = [peer for peer in args.peers.split(",") if peer]
    for peer in args.peers:
        if peer != "gloo":
            p.error(f"--peers: only 'gloo' is supported; got {peer!r}")
    if args.peers and args.device != "host":
        p.error("--peers gloo compares host buffers: leave --device out")
    if args.factor < 2 or args.begin < 1 or args.end < args.begin:
        p.error("need 1 <= --begin <= --end and --factor >= 2")
    if args.iters is not None:
        if args.iters < 1:
            p.error("--iters must be >= 1")
        args.min_iters = args.max_iters = args.iters
    if min(args.warmup, args.min_iters, args.rounds) < 1 or args.max_iters < args.min_iters:
        p.error("--warmup, --min-iters and --rounds must be >= 1, --max-iters >= --min-iters")
    try:
        check_op(args.op, args.dtype)
    except TypeError as exc:
        p.error(f"--op/--dtype: {exc}")
    return args


def contenders(collective, args, one_node=True):
    """The names to run for ``collective``, in table order (native first);
    ``one_node``: every rank shares memory, as the shared-memory algorithms need."""
    ours = [a for a in algorithms(collective) if a not in ("native", "auto")]
    if args.algorithms is None:
        wanted = ours + ([] if args.tune else ["auto"])  # auto is what is being tuned
    else:
        wanted = args.algorithms
    names = ["native"] + [a for a in wanted if a in algorithms(collective) and a != "native"
                          and not ((args.device != "host" or not one_node) and (collective, a) in SHARED_MEMORY)
                          and not ((args.device == "host" or not one_node) and (collective, a) in PEER_READS)]
    if "gloo" in args.peers and collective in GLOO and args.op != "avg":
        names.append("gloo")
    if args.deterministic and collective in ORDERED:
        names.append("deterministic")
    if args.registered and collective in REGISTERED and args.device == "host":
        names.append("shm_registered")
    return names


def mpi_library():
    """'MPICH Version: 5.0.2' and the like: the first line, spaces squeezed."""
    return " ".join(MPI.Get_library_version().split("\n")[0].split())


def start_gloo(world):
    """torch.distributed with the gloo backend over the same ranks (rank 0 serves)."""
    try:
        import torch.distributed as dist
    except ImportError:
        raise SystemExit("--peers gloo needs torch: pip install torch") from None
    if dist.is_initialized():  # a second sweep in the same processes
        return dist.group.WORLD
    from ...adapters.torch_backend import rendezvous_address

    host, port = rendezvous_address(world)  # gloo binds the port right after
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}",
                            rank=world.Get_rank(), world_size=world.Get_size())
    return dist.group.WORLD


def measure(case, comm, world, names, args, gloo_group, ordered_comm=None, bandwidth=None, pool=None):
    """Rows (dicts) for every contender on one case (``ordered_comm``: the deterministic
    communicator that runs the contender ``deterministic``; ``bandwidth``: the memory
    probe's bytes per second per rank, for the bound column; ``pool``: a registered
    array of ``comm``'s, the buffers of the contender ``shm_registered``)."""
    calls, cases = {}, {}
    for name in names:
        cases[name] = case
        if name == "shm_registered":
            cases[name] = case.registered(pool)
            calls[name] = cases[name].ours(comm, "shm")
        elif name == "native":
            calls[name] = case.native(world)
        elif name == "gloo":
            calls[name] = case.gloo(gloo_group)
        elif name == "deterministic":
            calls[name] = case.ours(ordered_comm, "auto")
        else:
            calls[name] = case.ours(comm, name)
    # Calls in place (--inplace, shm_registered's allreduce) feed each result back in:
    # sums grow to inf over the timed calls, which is no matter for the time (--check
    # runs on fresh input) but would print NumPy's overflow warnings.
    with np.errstate(over="ignore", invalid="ignore"):
        iters = {name: timing.iterations(world, call, args.warmup, args.budget, args.min_iters, args.max_iters)
                 for name, call in calls.items()}
        samples = timing.interleaved_rounds(world, calls, iters, args.rounds)
    rows = []
    factor = bus_factor(case.collective, case.size)
    for name in names:
        stats = timing.combine(world, np.concatenate(samples[name]), [part.size for part in samples[name]])
        algbw = case.nbytes / (stats["time_us"] * 1e-6) / 1e9
        row = {
            "collective": case.collective, "algorithm": name, "bytes": case.nbytes, "count": case.count,
            "world_size": case.size, "layout": comm.topology.key(), "dtype": case.dtype.name, "op": case.op,
            "inplace": cases[name].inplace, **stats, "algbw_GBps": algbw, "busbw_GBps": algbw * factor,
            "chosen": (comm if name == "auto" else ordered_comm).choose(case.collective, case.nbytes,
                                                                        case.device is not None, case.dtype)[0]
            if name in ("auto", "deterministic") else None,
            "extra_mem_bytes": None, "wrong": None, "device": args.device,
        }
        if not args.no_memory and name not in ("native", "gloo") and case.device is None:
            # MPI's and gloo's C memory is invisible to tracemalloc, and so is a device's
            row["extra_mem_bytes"] = timing.peak_extra_memory(world, calls[name], comm.release_memory)
        if args.check:
            row["wrong"] = world.allreduce(cases[name].count_wrong(calls[name]), op=MPI.SUM)
        rows.append(row)
    native = rows[0]["time_us"]
    bound = membound.bound_us(case.collective, case.nbytes, case.size, bandwidth)
    for row in rows:
        row["speedup"] = native / row["time_us"]
        row["bound_us"] = bound
        row["vs_bound"] = None if bound is None else row["time_us"] / bound
    return rows


def check_outputs(args, world):
    """Fail before the sweep, on every rank, if the results could not be written."""
    problem = None
    if world.Get_rank() == 0:
        try:
            outputs = (("--json", args.json), ("--csv", args.csv), ("--plot", args.plot), ("--tune", args.tune))
            for option, path in outputs:
                if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
                    raise ValueError(f"{option} {path}: the folder does not exist")
            if args.plot:
                import matplotlib  # noqa: F401
            if args.tune and os.path.exists(args.tune):
                TuningTable.load(args.tune)
        except ImportError:
            problem = "--plot needs matplotlib: pip install 'collectives[bench]'"
        except ValueError as exc:
            problem = str(exc) if str(exc).startswith("--") else f"--tune: {exc}"
    problem = world.bcast(problem, root=0)
    if problem:
        raise SystemExit(problem)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    world = MPI.COMM_WORLD.Dup()  # native runs here, ours on the Communicator's own duplicate
    try:
        check_outputs(args, world)
        comm = Communicator(world)
        ordered_comm = Communicator(world, deterministic=True) if args.deterministic else None
        try:
            device = None if args.device == "host" else BenchDevice(args.device, world.Get_rank())
            return sweep(args, world, comm, device, ordered_comm)
        finally:
            comm.free()
            if ordered_comm is not None:
                ordered_comm.free()
    finally:
        world.Free()


def sweep(args, world, comm, device=None, ordered_comm=None):
    """Run the benchmark; write the outputs on rank 0; return the exit status."""
    rank0 = world.Get_rank() == 0
    gloo_group = start_gloo(world) if "gloo" in args.peers else None
    size_list = sizes(args.begin, args.end, args.factor)
    meta = {"dtype": args.dtype, "op": args.op, "inplace": args.inplace, "world_size": world.Get_size(),
            "layout": comm.topology.key()}
    bar = None
    if rank0 and not args.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(args.collectives) * len(size_list), file=sys.stderr, unit="size",
                       leave=False, dynamic_ncols=True)
        except ImportError:
            pass
    say = (bar.write if bar is not None else print) if rank0 else (lambda *_: None)
    if rank0:
        say(f"# collectives-bench: {world.Get_size()} ranks, {mpi_library()}, "
            f"{os.cpu_count()} cpus; budget {args.budget}s x {args.rounds} interleaved rounds per contender")
        if device is not None:
            say(f"# buffers on {device.name}; native = MPI on host copies (device -> host, MPI, host -> device)")
    bandwidth = None
    if device is None and not args.no_bound:  # every rank at once, as the collectives run
        bandwidth = membound.probe(world)
        say(f"# memory: {bandwidth / 1e9:.1f} GB/s read + written per rank, all ranks at once (np.add); "
            "bound = time / the memory-traffic bound (collectives.tools.bench.membound)")
    link = None
    if args.tune and comm.topology.node_count > 1:  # a table of several nodes is keyed by their link too
        link = measure_link(comm.mpi_comm, comm.topology)
        say(f"# link: {link / 1e6:.1f} MB/s node to node (collectives.topology.measure_link), in the tuning key")
    rows = []
    pool = None
    if args.registered and device is None and comm.shares_memory:  # the buffers of every shm_registered case
        pool = comm.empty(args.end + 4096, np.uint8)
    elif args.registered and rank0:
        say("# --registered: left out (it needs host buffers on ranks that share memory)")
    for collective in args.collectives:
        names = [n for n in contenders(collective, args, comm.shares_memory)
                 if n != "shm_registered" or pool is not None]
        say(report.header(collective, meta))
        for nbytes in size_list:
            case = Case(collective, nbytes, world, args.dtype, args.op, args.inplace, device=device)
            if bar is not None:
                bar.set_description(f"{collective} {report.human_bytes(case.nbytes)}")
            for row in measure(case, comm, world, names, args, gloo_group, ordered_comm, bandwidth, pool):
                rows.append(row)
                say(report.line(row))
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()
    wrong = sum(row["wrong"] or 0 for row in rows)
    gpus = device.gpus(world) if args.tune and device is not None else None  # (collective)
    if rank0:
        if args.check:
            print(f"\n# check: {wrong} wrong elements over {len(rows)} rows (summed over ranks)")
        if args.json:
            report.write_json(args.json, rows)
        if args.csv:
            report.write_csv(args.csv, rows)
        if args.plot:
            report.plot(args.plot, rows, f"{args.dtype} {args.op}, {world.Get_size()} ranks, "
                                         f"{mpi_library()}")
        if args.tune:
            settings = {"dtype": args.dtype, "op": args.op, "inplace": args.inplace, "budget_s": args.budget,
                        "device": args.device}
            new = tune.write(args.tune, rows, settings, "tables" if device is None else "device_tables", link, gpus)
            print(f"\n# tuning for world size {world.Get_size()} merged into {args.tune}:")
            for collective, by_size in new.items():
                for entries in by_size.values():
                    print(f"#   {collective:15s} " + ", ".join(f"{report.human_bytes(b)}+ {a}" for b, a in entries))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
