"""``bench/gpu_peer.py`` (``make bench-gpu``): the device peer reads on a GPU the ranks
share, against their targets, every ratio from one interleaved run on one machine.

    mpiexec -n 2 python -m mpi4py bench/gpu_peer.py --json peer-n2.json        # on a GPU
    mpiexec -n 2 python -m mpi4py bench/gpu_peer.py --device standin --quick   # checks the code runs
    python bench/gpu_peer.py --report DIR                  # sync-floor.*, targets.md, peer-report.md

What it measures, at the world size it runs at (``make bench-gpu`` runs 2 and 4 ranks):

- **the synchronisation floor**: an empty cross-process synchronisation, p50 and p99
  over ``--floor-iters`` of them (each the slowest rank's), by each mechanism:
  (a) ``ipc``: the message-based handshake, a 4-byte device ``ring`` allgather through CUDA IPC
  (an interprocess event and an MPI control message per step, and its acknowledgement)
  divided by its p-1 steps; (b) ``host``: ``comm.barrier(device=...)`` with host-watched
  epochs in the node's shared window; (c) ``stream``: the same with the first fence
  of stream fences (each stream writes its word into the peers' rows,
  ``cuStreamWriteValue32``, and the host waits for the peers' words); (d) ``kernel``:
  a barrier's one fence is that same first fence, so this row times it again (the
  fence kernel, meant for distinct GPUs, is a call's second fence, not timed apart
  here; on one GPU shared by processes a spinning kernel holds the others off for its
  time slice).
- **the copy**: the device's own device-to-device copy of 256 MiB by rank 0 alone; B,
  its traffic rate, counts the bytes read plus written (2n per copy).
- **allreduce** from 8 B to 256 MiB: ``one_shot``, ``two_shot``, ``leader``, ``ring`` (CUDA IPC),
  ``staged`` (the ring through host memory: ``cuda_ipc=False``), ``native`` (MPI on host
  copies) and ``auto``, interleaved per size; each call ends with the device synchronized.
- **allgather, broadcast, reduce_scatter** at 64 MiB: ``one_shot``, ``leader``, the ring
  (broadcast: ``binomial``) over IPC, staged, native.
- every collective's ``leader`` once more on a communicator with stream fences
  (``leader/stream``; the others' fences are auto's: host ones on a GPU the ranks
  share): the report sets its whole calls beside the host-fenced ones', since the
  floor times one fence and a call has two.

The bounds beside the figures: the same GPU carries every rank's traffic, at most B
bytes a second. Each rank of an allreduce must read its n bytes and write n (2pn in
all): busbw = 2(p-1)/p·n/t is at most B(p-1)/p². Allgather (n gathered): each rank reads
and writes n, busbw (p-1)/p·n/t at most B(p-1)/(2p²); broadcast: the p-1 others read and
write n, busbw n/t at most B/(2(p-1)); reduce_scatter: each reads n and writes n/p,
busbw (p-1)/p·n/t at most B(p-1)/(p(p+1)).

``--tune FILE`` writes the device tables ``auto`` reads (``collectives.tools.bench.tune``)
from the rows of the library's algorithms. ``--report DIR`` reads ``peer-n*.json`` and
``ddp-n2.json`` there and writes ``sync-floor.json``, ``sync-floor.md``, ``targets.md``
(each target: the figure measured, the bound beside it, held or missed) and
``peer-report.md`` (both tables under one heading); it writes no other file.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from collectives import Communicator
from collectives.specs import SPECS
from collectives.tools.bench import timing, tune
from collectives.tools.bench.cases import bus_factor
from collectives.tools.bench.cli import parse_bytes
from collectives.tools.bench.devices import BenchDevice
from collectives.tools.bench.report import human_bytes

MiB = 1 << 20
MECHANISMS = ("host", "stream", "kernel")
ALLREDUCE_SIZES = "8,64,512,4K,32K,256K,1M,4M,16M,64M,256M"
OTHERS = ("allgather", "broadcast", "reduce_scatter")
REPORT = "peer-report.md"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="bench/gpu_peer.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "standin"), default="cuda")
    p.add_argument("--sizes", default=ALLREDUCE_SIZES, help="allreduce sizes in bytes (K, M suffixes)")
    p.add_argument("--other-size", default="64M", help="the size of allgather, broadcast and reduce_scatter")
    p.add_argument("--copy-size", default="256M", help="the device copy that gives B")
    p.add_argument("--floor-iters", type=int, default=2000, help="synchronisations timed per mechanism")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--budget", type=float, default=0.15, help="seconds of calls per contender and size")
    p.add_argument("--quick", action="store_true", help="small sizes, few calls: checks the code runs")
    p.add_argument("--json", help="write the rows here (rank 0)")
    p.add_argument("--tune", help="write the device tables auto reads into this tuning file")
    p.add_argument("--report", metavar="DIR", help=f"no measuring: write DIR's sync-floor.*, targets.md and {REPORT}")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.other_size, args.copy_size, args.floor_iters, args.rounds, args.budget = \
            "8,4K,256K", "64K", "1M", 20, 1, 0.01
    args.sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    args.other_size, args.copy_size = parse_bytes(args.other_size), parse_bytes(args.copy_size)
    return args


# -- measuring ------------------------------------------------------------------------------------------
def _stats(world, samples):
    return timing.combine(world, np.asarray(samples, np.float64))


def floor_rows(world, device, args, comms):
    """An empty synchronisation by each mechanism (see the module's docstring)."""
    p, rows = world.Get_size(), []
    one = device.empty(1, np.float32)
    device.upload(one, np.ones(1, np.float32))
    out = device.empty((p, 1), np.float32)
    ring = comms["ipc"]

    def ipc_step():
        ring.allgather(one, algorithm="ring", out=out)
        device.sync()

    contenders = {"ipc": (ipc_step, max(p - 1, 1))}
    for mechanism in MECHANISMS:
        comm = comms[mechanism]
        contenders[mechanism] = ((lambda c=comm: c.barrier(device=one)), 1)
    for name, (call, steps) in contenders.items():
        iters = args.floor_iters
        for _ in range(min(50, iters)):  # warm-up (the first makes the window)
            call()
        samples = []
        clock = time.perf_counter
        for _ in range(iters):
            world.Barrier()
            start = clock()
            call()
            samples.append((clock() - start) / steps)
        stats = _stats(world, samples)
        rows.append({"measure": "floor", "mechanism": name, "world_size": p, "p50_us": stats["p50_us"],
                     "p99_us": stats["p99_us"], "mean_us": stats["time_us"], "iters": iters,
                     "per": "handshake (call time / (p-1))" if name == "ipc" else "barrier(device=)"})
    return rows


def copy_rate(world, device, nbytes):
    """B: the device-to-device copy's bytes read plus written per second (rank 0 alone,
    the others waiting); every rank gets it."""
    rate = 0.0
    if world.Get_rank() == 0:
        a, b = device.empty(nbytes, np.uint8), device.empty(nbytes, np.uint8)
        backend, stream = device.backend, device.stream
        backend.copy(b, a, stream)
        device.sync()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(4):
                backend.copy(b, a, stream)
            device.sync()
            times.append((time.perf_counter() - start) / 4)
        rate = 2 * nbytes / float(np.median(times))
    world.Barrier()
    return world.bcast(rate, root=0)


def _call(comm, collective, algorithm, x, out):
    """One blocking call (a collective that works in ``x`` itself gets no ``out``)."""
    if SPECS[collective].one_buffer:
        return getattr(comm, collective)(x, algorithm=algorithm)
    return getattr(comm, collective)(x, algorithm=algorithm, out=out)


# Per collective: its message-based algorithm over CUDA IPC (broadcast has no ring: its
# tree), the peer reads besides one_shot, and whether auto is timed (allreduce: the
# targets ask for auto there); then the same-GPU bound of busbw from B (the module's
# docstring). busbw's factor is collectives-bench's (cases.bus_factor).
CONTENDERS = {"allreduce": ("ring", ("two_shot", "leader"), True), "reduce_scatter": ("ring", ("leader",), False),
              "allgather": ("ring", ("leader",), False), "broadcast": ("binomial", ("leader",), False)}
BOUNDS = {"allreduce": lambda p, B: B * (p - 1) / p ** 2, "allgather": lambda p, B: B * (p - 1) / (2 * p ** 2),
          "broadcast": lambda p, B: B / (2 * (p - 1)), "reduce_scatter": lambda p, B: B * (p - 1) / (p * (p + 1))}


# The leader once more with stream fences: auto's communicator fences on the host on a
# GPU the ranks share (the floor's choice, one fence), but a call has two, and the
# second of stream fences is the devices' own (the H200's probe timed one_shot's whole
# call 2-12% shorter with them). Not in the device tables: a call cannot choose its fences.
STREAM_FENCED, FENCED_MARK = ("leader",), "/stream"


def contenders(collective):
    """(name, communicator key, algorithm) of every contender for ``collective``."""
    ring, peer_reads, auto = CONTENDERS[collective]
    names = [("one_shot", "ipc", "one_shot")] + [(name, "ipc", name) for name in peer_reads]
    names += [(name + FENCED_MARK, "stream", name) for name in peer_reads if name in STREAM_FENCED]
    names += [(ring, "ipc", ring), ("staged", "staged", ring), ("native", "ipc", "native")]
    if auto:
        names.append(("auto", "ipc", "auto"))
    return names


def collective_rows(world, device, args, comms, collective, nbytes, copy_B):
    """Every contender of ``collective`` at ``nbytes``, interleaved."""
    p, rank = world.Get_size(), world.Get_rank()
    spec = SPECS[collective]
    if spec.gathers:  # nbytes: the gathered result
        count = max(nbytes // 4 // p, 1)
        x, out = device.empty(count, np.float32), device.empty((p, count), np.float32)
    elif spec.scatters:  # each rank's result is its block
        count = max(nbytes // 4 // p, 1) * p
        x, out = device.empty(count, np.float32), device.empty(count // p, np.float32)
    else:
        count = max(nbytes // 4, 1)
        x, out = device.empty(count, np.float32), device.empty(count, np.float32)
    device.upload(x, np.full(count, rank + 1, np.float32))
    calls = {}
    for name, key, algorithm in contenders(collective):
        comm = comms[key]
        calls[name] = (lambda c=comm, a=algorithm: (_call(c, collective, a, x, out), device.sync()))
    iters = {name: timing.iterations(world, call, 2, args.budget, args.rounds, 2000) for name, call in calls.items()}
    samples = timing.interleaved_rounds(world, calls, iters, args.rounds)
    rows = []
    bytes_seen = spec.auto_bytes(count * 4, p)
    chosen = comms["ipc"].choose(collective, bytes_seen, device=True)
    for name, parts in samples.items():
        stats = timing.combine(world, np.concatenate(parts), [len(s) for s in parts])
        t = stats["p50_us"] * 1e-6
        busbw = bus_factor(collective, p) * bytes_seen / t / 1e9
        row = {"measure": "collective", "collective": collective, "contender": name, "bytes": bytes_seen,
               "world_size": p, "busbw_GBps": busbw, "copy_B_GBps": copy_B / 1e9, **stats}
        if name == "auto":
            row["chosen"] = chosen[0]
            row["why"] = chosen[1]
        rows.append(row)
    return rows


def measure(args):
    from mpi4py import MPI


    world = MPI.COMM_WORLD
    device = BenchDevice(args.device, world.Get_rank())
    info = {"device": device.versions(), "mpi": MPI.Get_library_version().split("\n")[0],
            "world_size": world.Get_size(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv,
            "fence_auto": "kernel if every rank has its own GPU, else host", "complete": False}
    rows = []

    def save():  # after every stage: a run stopped by its time limit keeps what it measured
        if world.Get_rank() == 0 and args.json:
            Path(args.json).write_text(json.dumps({"info": info, "rows": rows}, indent=1) + "\n")

    comms = {"ipc": Communicator(), "staged": Communicator(cuda_ipc=False)}
    comms.update({m: Communicator(device_fence=m) for m in MECHANISMS})
    one = device.empty(1, np.float32)
    device.upload(one, np.ones(1, np.float32))
    for comm in comms.values():  # every communicator agrees its device paths now
        comm.allreduce(one, algorithm="direct")
    rows += floor_rows(world, device, args, comms)
    save()
    B = copy_rate(world, device, args.copy_size)
    rows.append({"measure": "copy", "bytes": args.copy_size, "B_GBps": B / 1e9, "world_size": world.Get_size()})
    save()
    for nbytes in args.sizes:
        rows += collective_rows(world, device, args, comms, "allreduce", nbytes, B)
        save()
        if world.Get_rank() == 0:
            print(f"allreduce {nbytes} B done", file=sys.stderr, flush=True)
    for collective in OTHERS:
        rows += collective_rows(world, device, args, comms, collective, args.other_size, B)
        save()
    info["complete"] = True
    save()
    if world.Get_rank() == 0:
        print_rows(rows)
    if args.tune:
        tune_rows = [{"collective": r["collective"], "algorithm": r["contender"], "bytes": r["bytes"],
                      "time_us": r["p50_us"], "round_spread": r.get("round_spread", 0.0),
                      "world_size": r["world_size"]}
                     for r in rows if r["measure"] == "collective" and r["contender"] not in ("staged", "auto")
                     and not r["contender"].endswith(FENCED_MARK)]
        gpus = device.gpus(world)  # (collective)
        if world.Get_rank() == 0:
            tune.write(args.tune, tune_rows, {"dtype": "float32", "tool": "bench/gpu_peer.py"},
                       key="device_tables", gpus=gpus)
    for comm in comms.values():
        comm.free()
    return 0


def print_rows(rows):
    for r in rows:
        if r["measure"] == "floor":
            print(f"  floor  {r['mechanism']:7s} p50 {r['p50_us']:8.1f} us  p99 {r['p99_us']:8.1f} us")
        elif r["measure"] == "copy":
            print(f"  copy   B = {r['B_GBps']:.1f} GB/s (read + write)")
        else:
            extra = f" -> {r['chosen']}" if "chosen" in r else ""
            print(f"  {r['collective']:14s} {r['bytes']:>10d} B {r['contender']:13s} p50 {r['p50_us']:10.1f} us  "
                  f"busbw {r['busbw_GBps']:8.2f} GB/s{extra}")


# -- the report -------------------------------------------------------------------------------------------
def bound(collective, p, B):
    """The same-GPU bound of ``collective``'s busbw (bytes/s), from B (module docstring)."""
    return BOUNDS[collective](p, B)


def report(folder):
    """sync-floor.json/.md, targets.md and peer-report.md (both tables), from ``folder``'s JSON."""
    folder = Path(folder)
    runs = {}
    for path in sorted(folder.glob("peer-n*.json")):
        data = json.loads(path.read_text())
        runs[data["info"]["world_size"]] = data
    if not runs:  # still written: targets.md then says that nothing was measured
        print(f"--report: no peer-n*.json in {folder}: every target 'not measured'", file=sys.stderr)
    floors = [r for p in sorted(runs) for r in runs[p]["rows"] if r["measure"] == "floor"]
    (folder / "sync-floor.json").write_text(json.dumps({"rows": floors}, indent=1) + "\n")
    chosen = {}
    lines = ["# The synchronisation floor", "", "An empty cross-process synchronisation on one GPU, p50 and p99 "
             "over the iterations (each the slowest rank's), by each mechanism (bench/gpu_peer.py).", "",
             "| ranks | mechanism | p50 µs | p99 µs |", "|---|---|---|---|"]
    for r in floors:
        lines.append(f"| {r['world_size']} | {r['mechanism']} | {r['p50_us']:.1f} | {r['p99_us']:.1f} |")
    for p in sorted(runs):
        shared = {r["mechanism"]: r["p50_us"] for r in floors if r["world_size"] == p and r["mechanism"]
                  in ("host", "stream")}
        if shared:
            chosen[p] = min(shared, key=shared.get)
    lines += ["", "On a GPU the ranks share, the fence mechanism to use is the one with the lower p50 of host and "
              "stream (the kernel's spins hold the other processes off): "
              + ("; ".join(f"{chosen[p]} at {p} ranks" for p in sorted(chosen)) or "not measured")
              + ". Set it with COLLECTIVES_DEVICE_FENCE (auto picks host on a shared GPU, kernel across distinct "
              "GPUs)."]
    lines += fence_lines(runs)
    (folder / "sync-floor.md").write_text("\n".join(lines) + "\n")
    targets = target_rows(runs, folder, chosen)
    table = ["# Targets of the peer reads on one GPU", "", "One interleaved run per world size on one GPU; B is "
             "the same run's device copy rate (read plus write).", "", "| target | measured | bound | |",
             "|---|---|---|---|"]
    verdict = {True: "held", False: "missed", None: "not measured"}
    table += [f"| {t} | {m} | {b} | {verdict[ok]} |" for t, m, b, ok in targets]
    (folder / "targets.md").write_text("\n".join(table) + "\n")
    report_lines = ["# Peer reads on one GPU (`make bench-gpu`)", ""] + table[2:] + [""] + lines[2:]
    (folder / REPORT).write_text("\n".join(report_lines) + "\n")
    print("\n".join(table))
    return 0


def fence_lines(runs):
    """The floor times one fence, a call has two: the leader's whole calls with host
    fences against stream fences, the same run's p50s, per world size and size (none
    where the run has no stream-fenced rows)."""
    lines = []
    for p in sorted(runs):
        rows = [r for r in runs[p]["rows"] if r["measure"] == "collective"]
        at = {(r["collective"], r["bytes"], r["contender"]): r["p50_us"] for r in rows}
        pairs = [(c, n, at[(c, n, name)] / at[(c, n, name + FENCED_MARK)])
                 for (c, n, name) in sorted(at) if name in STREAM_FENCED and (c, n, name + FENCED_MARK) in at]
        if pairs:
            if not lines:
                lines = ["", "A call has two fences, the floor times one: the leader's whole calls, p50 with "
                         "host fences / p50 with stream fences, the same run (above 1: stream fences faster).", "",
                         "| ranks | collective | bytes | host / stream |", "|---|---|---|---|"]
            lines += [f"| {p} | {c} | {human_bytes(n)} | {ratio:.2f} |" for c, n, ratio in pairs]
    return lines


TARGETS = ("allreduce 64-256 MiB, {p} ranks: busbw >= 40% of B(p-1)/p^2",
           "allreduce 8 B-256 KiB, {p} ranks: p50 <= floor + 30 us and <= {cap} us",
           "allgather 64 MiB, {p} ranks: busbw >= 40% of the same-GPU bound",
           "broadcast 64 MiB, {p} ranks: busbw >= 40% of the same-GPU bound",
           "reduce_scatter 64 MiB, {p} ranks: busbw >= 40% of the same-GPU bound",
           "auto on device arrays, {p} ranks: within 1.2x of the fastest device contender")


def target_rows(runs, folder, chosen):
    """``(target, measured, bound, held)`` for every target at 2 and 4
    ranks, in ``TARGETS``' order (``held`` None: not measured)."""
    rows = []
    for p in (2, 4):
        cap = 100 if p == 2 else 150
        names = [t.format(p=p, cap=cap) for t in TARGETS]
        if p not in runs:
            rows += [(name, f"no peer-n{p}.json", "-", None) for name in names]
            continue
        found = runs[p]["rows"]
        if not runs[p]["info"].get("complete", True):  # stopped by its time limit: what it measured counts
            names = [name + " (run cut short)" for name in names]
        B = next((r["B_GBps"] * 1e9 for r in found if r["measure"] == "copy"), None)
        floor = next((r["p50_us"] for r in found if r["measure"] == "floor" and r["mechanism"] == chosen.get(p)),
                     None)
        coll = [r for r in found if r["measure"] == "collective"]
        peers = ("one_shot", "two_shot", "leader", "leader" + FENCED_MARK, "auto")
        measured = {}
        big = [r for r in coll if r["collective"] == "allreduce" and 64 * MiB <= r["bytes"] <= 256 * MiB
               and r["contender"] in peers]
        if big and B:
            best = [max((r for r in big if r["bytes"] == n), key=lambda r: r["busbw_GBps"])
                    for n in {r["bytes"] for r in big}]
            worst = min(best, key=lambda r: r["busbw_GBps"])
            limit = bound("allreduce", p, B) / 1e9
            measured[names[0]] = (f"{worst['busbw_GBps']:.0f} GB/s (the best peer read at the worst size: "
                                  f"{worst['contender']}, {human_bytes(worst['bytes'])})",
                                  f"{limit:.0f} GB/s (40%: {0.4 * limit:.0f})", worst["busbw_GBps"] >= 0.4 * limit)
        small = [r for r in coll if r["collective"] == "allreduce" and r["bytes"] <= 256 << 10
                 and r["contender"] in peers]
        if small and floor is not None:
            best = [min((r for r in small if r["bytes"] == n), key=lambda r: r["p50_us"])
                    for n in {r["bytes"] for r in small}]
            worst = max(best, key=lambda r: r["p50_us"])
            limit = min(floor + 30, cap)
            measured[names[1]] = (f"{worst['p50_us']:.0f} us (the best peer read at the worst size: "
                                  f"{worst['contender']}, {human_bytes(worst['bytes'])})",
                                  f"floor {floor:.0f} us ({chosen.get(p)}): cap {limit:.0f} us",
                                  worst["p50_us"] <= limit)
        readers = ("one_shot", "leader", "leader" + FENCED_MARK)
        for name, collective in zip(names[2:5], OTHERS):
            mine = [r for r in coll if r["collective"] == collective and r["contender"] in readers
                    and r["bytes"] >= 64 * MiB]
            if mine and B:
                r = max(mine, key=lambda r: r["busbw_GBps"])  # the better peer read
                limit = bound(collective, p, B) / 1e9
                measured[name] = (f"{r['busbw_GBps']:.0f} GB/s ({r['contender']}, {human_bytes(r['bytes'])})",
                                  f"{limit:.0f} GB/s (40%: {0.4 * limit:.0f})", r["busbw_GBps"] >= 0.4 * limit)
        ratios = []
        for n in sorted({r["bytes"] for r in coll if r["collective"] == "allreduce"}):
            at = {r["contender"]: r["p50_us"] for r in coll if r["collective"] == "allreduce" and r["bytes"] == n}
            if "auto" in at:
                # what auto could have picked: native too (staged), not the ring of a cuda_ipc=False
                # communicator, nor the leader of a stream-fenced one (fence_lines sets that beside)
                fastest = min(t for c, t in at.items() if c not in ("auto", "staged") and not c.endswith(FENCED_MARK))
                ratios.append((at["auto"] / fastest, n))
        if ratios:
            worst, n = max(ratios)
            measured[names[5]] = (f"{worst:.2f}x at worst ({human_bytes(n)})", "1.2x", worst <= 1.2)
        rows += [(name,) + measured.get(name, ("no figure in this run", "-", None)) for name in names]
    ddp = folder / "ddp-n2.json"
    target = "DDP on a CUDA model, 2 ranks: its communication >= 3x gloo's"
    if ddp.exists():
        data = json.loads(ddp.read_text())
        ours = [r for r in data["rows"] if r.get("backend") in ("collectives", "overlap") and r.get("exposed_vs_gloo")]
        best = max((r["exposed_vs_gloo"] for r in ours), default=None)
        rows.append((target, "-" if best is None else f"{best:.2f}x gloo (exposed time, same run)", "3x",
                     None if best is None else best >= 3))
    else:
        rows.append((target, "no ddp-n2.json", "3x", None))
    return rows


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.report:
        return report(args.report)
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
