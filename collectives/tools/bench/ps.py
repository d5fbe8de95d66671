"""Benchmark: step time of parameter-server training against allreduce training, on
the same model and per-rank batch, at the same world size, in the same run.

    for n in 2 3 4 6 8; do
      mpiexec -n $n python -m collectives.tools.bench.ps --json ps.json    # adds (replaces) this size's rows
    done                                                             # each run prints every size so far

The model is collectives.tools.bench.training's NumPy MLP (``--layers`` x ``--width`` squared,
float32, ReLU; forward and backward by hand, BLAS single-threaded), ``--batch``
samples per computing rank. Variants, each timed in every round, in an order that
rotates from round to round (a shared machine's drift slows all alike):

- ``compute``: forward + backward on every rank, no communication;
- ``allreduce``: forward + backward on all p ranks, the gradients averaged by
  :class:`~collectives.training.GradientReducer` (after backward; buckets as the
  library's defaults), then the SGD step: data-parallel training;
- ``ps-sync-S<k>`` / ``ps-async-S<k>``: :class:`~collectives.ps.ParameterServer` with
  the first k ranks as servers and W = p - k workers, each doing forward + backward,
  ``push`` and ``pull``; the servers apply SGD.

At equal world size the parameter server has fewer computing ranks (W = p - k), so the
table gives both the step time and the throughput (samples per second over the
computing ranks): ``ps/ar`` is the step-time ratio, ``thr/ar`` the throughput ratio.
``step_ms``: for each round, the slowest computing rank's mean time per step over
``--steps`` steps (after one untimed step); then the median over rounds. Before the
timing, one synchronous step with known gradients is checked against NumPy (exit 1 if
wrong). ``--json FILE`` keeps the rows of every world size run into it (rank 0).
"""

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # in time only if numpy is not imported yet; threadpoolctl below

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from ... import Communicator  # noqa: E402
from ...adapters.ps import ParameterServer  # noqa: E402
from ...adapters.training import GradientReducer  # noqa: E402
from .cli import mpi_library  # noqa: E402
from .training import MiB, NumpyMLP, threadpool_limits  # noqa: E402

LR = 1e-4  # small: the values stay tame (no overflow, no denormals) over many steps


def check_sync_step(world, servers):
    """One synchronous step with gradient ``rank + 1`` everywhere must give
    ``-lr * mean(worker rank + 1)``; returns a problem string or None (every rank)."""
    params = {"w": np.zeros((33, 17), np.float32), "b": np.zeros(5, np.float32)}
    ps = ParameterServer(params, world, servers=servers, lr=1.0)
    if ps.is_worker:
        ps.step({n: np.full_like(a, world.Get_rank() + 1) for n, a in params.items()})
    stats = ps.run(lambda _: None)
    want = -np.mean([w + 1 for w in ps.workers], dtype=np.float32)
    ok = all(np.allclose(a, want, rtol=1e-6) for a in params.values()) if ps.is_worker else True
    problems = [r for r, good in enumerate(world.allgather(ok and stats["versions"] == [1] * servers)) if not good]
    return f"sync check failed on rank(s) {problems}" if problems else None


class Variant:
    """One contender: ``round(steps)`` runs one untimed and ``steps`` timed steps and
    returns this rank's seconds per step (None on a rank that does not compute)."""

    def __init__(self, name, model, world, comm, servers=None, mode=None):
        self.name, self.model, self.world, self.comm = name, model, world, comm
        self.servers, self.mode = servers, mode
        self.computing = world.Get_size() - (servers or 0)

    def round(self, steps):
        if self.servers is None:
            return self._allreduce(steps) if self.name == "allreduce" else self._compute(steps)
        return self._ps(steps)

    def _compute(self, steps):
        self.model.step()
        start = time.perf_counter()
        for _ in range(steps):
            self.model.step()
        return (time.perf_counter() - start) / steps

    def _allreduce(self, steps):
        m = self.model
        with GradientReducer(m.params, self.comm) as reducer:
            start = None
            for i in range(steps + 1):
                if i == 1:
                    start = time.perf_counter()
                m.step()
                for name in m.ready_order():
                    reducer.gradient_ready(name, m.grads[name])
                for name, g in reducer.synchronize().items():
                    m.by_name[name] -= LR * g
            return (time.perf_counter() - start) / steps

    def _ps(self, steps):
        m = self.model
        timing = []

        def train(ps):
            for i in range(steps + 1):
                if i == 1:
                    timing.append(time.perf_counter())
                m.step()
                ps.step(m.grads)
            timing.append(time.perf_counter())

        ParameterServer(m.params, self.world, servers=self.servers, mode=self.mode, lr=LR).run(train)
        return (timing[1] - timing[0]) / steps if timing else None


def measure(variants, steps, rounds, world):
    """{name: [the slowest computing rank's seconds per step, per round]}."""
    times = {v.name: [] for v in variants}
    for r in range(rounds):
        shift = r % len(variants)
        for v in variants[shift:] + variants[:shift]:
            world.Barrier()
            mine = v.round(steps)
            slowest = max(t for t in world.allgather(mine) if t is not None)
            times[v.name].append(slowest)
    return times


def rows_for(times, variants, size, batch, model_bytes):
    ar = float(np.median(times["allreduce"]))
    rows = []
    for v in variants:
        t = float(np.median(times[v.name]))
        throughput = v.computing * batch / t
        rows.append(dict(world_size=size, variant=v.name, servers=v.servers or 0, workers=v.computing,
                         step_ms=1e3 * t, min_ms=1e3 * min(times[v.name]), max_ms=1e3 * max(times[v.name]),
                         samples_per_s=throughput, ps_over_ar=t / ar,
                         throughput_over_ar=throughput / (size * batch / ar), model_bytes=model_bytes))
    return rows


def table(rows):
    lines = [f"{'p':>3} {'variant':<14}{'S':>3}{'W':>3}{'step_ms':>9}{'min':>8}{'max':>8}{'samples/s':>11}"
             f"{'ps/ar':>7}{'thr/ar':>8}"]
    for r in sorted(rows, key=lambda r: (r["world_size"], r["variant"] != "compute", r["variant"] != "allreduce")):
        lines.append(f"{r['world_size']:>3} {r['variant']:<14}{r['servers']:>3}{r['workers']:>3}{r['step_ms']:>9.2f}"
                     f"{r['min_ms']:>8.2f}{r['max_ms']:>8.2f}{r['samples_per_s']:>11.0f}{r['ps_over_ar']:>7.2f}"
                     f"{r['throughput_over_ar']:>8.2f}")
    lines.append("step_ms: median over rounds of the slowest computing rank's mean step; ps/ar: step time over "
                 "allreduce's at the same p; thr/ar: samples/s over allreduce's (PS computes on W = p - S ranks)")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m collectives.tools.bench.ps", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="dense layers (default 4)")
    p.add_argument("--width", type=int, default=512, help="layer width (default 512: 4 MiB of parameters)")
    p.add_argument("--batch", type=int, default=32, help="samples per computing rank (default 32)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant per round (default 10)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--servers", default="1", help="comma-separated server counts (default 1; those >= p skipped)")
    p.add_argument("--modes", default="sync,async", help="comma-separated PS modes (default sync,async)")
    p.add_argument("--json", help="rank 0 adds this world size's rows to this file (replacing any of this size)")
    args = p.parse_args(argv)
    args.servers = [int(s) for s in args.servers.split(",")]
    args.modes = [m.strip() for m in args.modes.split(",")]
    for name in ("layers", "width", "batch", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be positive")
    if any(s < 1 for s in args.servers) or not set(args.modes) <= {"sync", "async"}:
        p.error("--servers must be positive and --modes sync and/or async")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if size < 2:
        sys.exit("python -m collectives.tools.bench.ps: needs at least 2 ranks (a server and a worker): "
                 "run under mpiexec")
    limits = threadpool_limits(1) if threadpool_limits is not None else None  # noqa: F841 (kept alive)
    servers = [s for s in args.servers if s < size]
    problem = check_sync_step(world, servers[0])
    if problem:
        if rank == 0:
            print(problem, file=sys.stderr)
        sys.exit(1)
    comm = Communicator()
    model = NumpyMLP(args.layers, args.width, args.batch, rank)
    variants = [Variant("compute", model, world, comm), Variant("allreduce", model, world, comm)]
    variants += [Variant(f"ps-{mode}-S{s}", model, world, comm, servers=s, mode=mode)
                 for s in servers for mode in args.modes]
    times = measure(variants, args.steps, args.rounds, world)
    rows = rows_for(times, variants, size, args.batch, model.nbytes)
    if rank != 0:
        return
    everything = rows
    meta = dict(host=platform.node(), cpus=os.cpu_count(), mpi=mpi_library(), numpy=np.__version__,
                model=f"{args.layers} x {args.width}x{args.width} float32 MLP, {model.nbytes / MiB:.2f} MiB",
                batch_per_rank=args.batch, steps=args.steps, rounds=args.rounds)
    if args.json:
        if os.path.exists(args.json):
            with open(args.json) as f:
                kept = [r for r in json.load(f)["rows"] if r["world_size"] != size]
            everything = kept + rows
        with open(args.json, "w") as f:
            json.dump(dict(meta, rows=everything), f, indent=1)
            f.write("\n")
    print(f"# parameter server against allreduce training: {meta['model']}, batch {args.batch} per computing "
          f"rank, {args.rounds} rounds x {args.steps} steps; {meta['mpi']}, {meta['cpus']} CPUs")
    print(table(everything))


if __name__ == "__main__":
    main()
