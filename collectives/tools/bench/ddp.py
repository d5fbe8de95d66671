"""DDP's training step on the "collectives" torch.distributed backend against gloo:
``python -m collectives.tools.bench.training --ddp`` (the options of the training benchmark
that apply: --layers, --width, --batch, --steps, --rounds, --warmup, --bucket-mib,
--compression, --json; ``--device cuda`` puts the model, its gradients and so what
both backends reduce on the GPU).

The model is the training benchmark's torch MLP (``TorchMLP``). One copy of it per
(backend, bucket size, compression) is wrapped in ``DistributedDataParallel`` with
``bucket_cap_mb`` = the bucket size, ``process_group`` = the default group (on
"collectives"; its futures complete inside backward, as DDP asks for them), a
"collectives" group with a progress thread (``overlap``: the allreduces run on while
backward computes) or a gloo group over the same ranks, and DDP's
``fp16_compress_hook`` for compression fp16. Every variant runs in the same rounds, in
an order that rotates from round to round; ``compute`` is forward + backward of the bare model.

Columns: ``step_ms`` (median over steps of the slowest rank's step, each step after a
barrier), its quartiles, ``exposed`` (step minus compute: what communication adds) and
``vs_gloo``: gloo's step time over this one (and ``exposed_vs_gloo`` the same for the
exposed time), from the same run.

Before timing, one step of every variant is checked: the gradients DDP leaves must be
the mean over ranks of the ranks' own gradients (MPI_Allreduce in float64), within
float32 rounding (fp16 compression: within its rounding). Exit status 1 if not.
"""

import copy
import sys
import time

import numpy as np
from mpi4py import MPI

MiB = 1 << 20


def run(args, model, world):
    """Time DDP on both backends; returns (rows, failures, info) on every rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ...adapters import torch as _registers_the_backend  # noqa: F401
    from .gradients import mean_gradients

    if not dist.is_initialized():
        dist.init_process_group("collectives")
    elif dist.get_backend() != "collectives":
        raise SystemExit(f"--ddp: this process already has a default process group on {dist.get_backend()}; "
                         "the DDP benchmark needs its own, on 'collectives'")
    overlap = dist.new_group(backend="collectives")
    overlap.progress_thread = True  # a progress thread completes its futures: allreduces overlap backward
    groups = {"collectives": None, "overlap": overlap, "gloo": dist.new_group(backend="gloo")}
    variants = {("compute", None, None): model.model}
    for compression in args.compression:
        for bucket in args.bucket_mib:
            for backend, group in groups.items():
                ddp = DDP(copy.deepcopy(model.model), process_group=group, bucket_cap_mb=bucket)
                if compression == "fp16":
                    ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
                elif compression is not None:
                    raise SystemExit(f"--ddp: compression {compression!r}: only none and fp16 (DDP's hook)")
                variants[(backend, bucket, compression)] = ddp

    # Every rank's own gradients first (the bare model), then one step of each variant.
    model.step()
    want = list(mean_gradients(model.model.named_parameters(), world).values())
    failures = []
    for key, module in variants.items():
        if key[0] == "compute":
            continue
        model.step(module)
        tol = 2e-3 if key[2] == "fp16" else 1e-5
        for p, w in zip(module.parameters(), want):
            error = np.abs(p.grad.detach().cpu().numpy() - w).max()
            if error > tol * max(np.abs(w).max(), 1e-30):
                failures.append(f"{key}: gradients differ from the mean over ranks by {error:.3g}")
                break

    names = list(variants)
    samples = {name: [] for name in names}

    def timed(name, steps, into):
        module = variants[name]
        for _ in range(steps):
            world.Barrier()
            t0 = time.perf_counter()
            model.step(module)
            into.append(time.perf_counter() - t0)

    if not world.allreduce(len(failures), op=MPI.SUM):
        for name in names:
            timed(name, args.warmup, [])
        for rnd in range(args.rounds):
            shift = rnd % len(names)
            for name in names[shift:] + names[:shift]:
                timed(name, args.steps, samples[name])
            if world.Get_rank() == 0:
                print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    rows = []
    for name in names:
        steps = np.array(samples[name])
        slowest = np.empty_like(steps)
        world.Allreduce(steps, slowest, op=MPI.MAX)
        backend, bucket, compression = name
        row = {"variant": "compute" if backend == "compute" else "ddp", "backend": backend if bucket else None,
               "bucket_mib": bucket, "compression": compression or ("none" if bucket else None),
               "steps": int(steps.size)}
        if steps.size:
            row.update(step_ms=float(np.median(slowest) * 1e3), p25_ms=float(np.percentile(slowest, 25) * 1e3),
                       p75_ms=float(np.percentile(slowest, 75) * 1e3))
        rows.append(row)
    if samples[names[0]]:
        compute = rows[0]["step_ms"]
        by_key = {(r["backend"], r["bucket_mib"], r["compression"]): r for r in rows[1:]}
        for r in rows[1:]:
            r["exposed_ms"] = r["step_ms"] - compute
        for r in rows[1:]:
            gloo = by_key[("gloo", r["bucket_mib"], r["compression"])]
            r["vs_gloo"] = gloo["step_ms"] / r["step_ms"]
            r["exposed_vs_gloo"] = gloo["exposed_ms"] / r["exposed_ms"] if r["exposed_ms"] > 0 else None
    info = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "ddp_buckets_mib": list(args.bucket_mib)}
    return rows, failures, info


def print_table(rows, model_bytes, world_size):
    print(f"\n# DDP training step, torch MLP, {model_bytes / MiB:.1f} MiB of float32 gradients, world size "
          f"{world_size}; median over steps of the slowest rank's step; vs_gloo = gloo's time / this one's")
    print(f"{'variant':<9}{'backend':>13}{'bucket':>7}{'compr':>6}{'step_ms':>9}{'p25':>8}{'p75':>8}"
          f"{'exposed':>9}{'vs_gloo':>8}{'exp_vs_gloo':>12}")

    def cell(value, fmt, width):
        return ("-" if value is None else format(value, fmt)).rjust(width)

    for r in rows:
        print(f"{r['variant']:<9}{r['backend'] or '':>13}{cell(r['bucket_mib'], 'g', 7)}{r['compression'] or '':>6}"
              + cell(r.get("step_ms"), ".1f", 9) + cell(r.get("p25_ms"), ".1f", 8) + cell(r.get("p75_ms"), ".1f", 8)
              + cell(r.get("exposed_ms"), ".1f", 9) + cell(r.get("vs_gloo"), ".2f", 8)
              + cell(r.get("exposed_vs_gloo"), ".2f", 12))
