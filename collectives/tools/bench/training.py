"""Benchmark of the data-parallel training adapter: does gradient communication hide
behind backward?

    mpiexec -n 4 python -m collectives.tools.bench.training                      # NumPy MLP, 5 x 1024x1024
    mpiexec -n 4 python -m collectives.tools.bench.training --bucket-mib 25,4 --algorithms auto,direct,ring \\
        --json training-n4.json
    mpiexec -n 4 python -m collectives.tools.bench.training --framework torch   # collectives.torch.DistributedOptimizer
    mpiexec -n 4 python -m collectives.tools.bench.training --ddp --bucket-mib 1,5,25   # DDP: "collectives" vs gloo

``--ddp`` times torch's DistributedDataParallel on the torch.distributed backend
"collectives" against gloo (see :mod:`collectives.tools.bench.ddp`); the rest of this text is
about the adapter's own variants.

The model is an MLP of ``--layers`` dense layers of ``--width`` x ``--width`` (float32,
ReLU, squared loss), ``--batch`` samples per rank, forward and backward computed by
hand with real matmuls (``--framework torch``: the same MLP as ``torch.nn`` with
autograd). BLAS runs single-threaded (threadpoolctl, else the *_NUM_THREADS variables),
so N ranks use N threads. The default, 5 layers of 1024x1024, has 20 MiB of gradients.

Variants (every one timed in the same rounds, in an order that rotates from round to
round, so the drift of a shared machine slows them alike):

- ``compute``: forward + backward, no communication.
- ``comm``: communication only: every gradient handed to the reducer at once, then
  ``synchronize()`` (the allreduces, the copies into and out of the buckets).
- ``after``: forward + backward, then every ``gradient_ready`` and ``synchronize()``:
  communication after backward, nothing overlapped.
- ``overlap``: ``gradient_ready`` for each gradient as soon as backward has computed it
  (last layer first), then ``synchronize()``; the reducer polls in ``gradient_ready``.
- ``overlap+thread``: the same with ``progress_thread=True`` (one row per
  ``--poll-interval``).
- ``overlap+polls/K`` (``--chunks K``): as ``overlap``, each backward matmul cut into K
  row blocks with a poll of the reducer between them (more polls, no thread).

``--offload`` makes every matmul a sleep of its measured length (after the checks), as
if an accelerator ran forward and backward: the CPU is then free to move messages, as a
host is while its GPU computes. Without it, compute and communication share the CPUs.

The communicating variants run for each ``--compression`` (none, fp16), each
``--algorithms`` and each ``--bucket-mib`` (the reducer's ``bucket_bytes``; the first
bucket keeps ``--first-bucket-kib``). Columns of the table:

- ``step_ms``: median over the timed steps of the step time of the slowest rank (each
  step starts after a barrier; a step is done when its last rank is); ``p25``/``p75``
  the quartiles of the same;
- ``hid_after``: the fraction of the communication hidden,
  ``1 - (T - T_compute) / (T_after - T_compute)``, with ``T_after`` from the same
  compression, algorithm and bucket size (1 = free communication, 0 = no better than
  communicating after backward, below 0 = worse);
- ``hid_comm``: the same with ``T_comm`` (communication alone) as the denominator;
- ``exposed``: ``T - T_compute``, the milliseconds communication adds to a step;
- ``sync_ms``: median time in ``synchronize()`` (slowest rank): the communication still
  to do when backward ends;
- ``polls``: calls to the reducer's ``_poll`` during backward per step (its own and the
  progress thread's), mean over ranks;
- ``done%``: the share of the gradient bytes whose allreduce had finished when
  backward ended (mean over ranks);
- ``cpu_ms``: CPU time of a rank's process per step (all its threads, MPI's included),
  median over steps, mean over ranks; ``load``: ``cpu_ms * ranks / (step_ms * CPUs)``,
  the share of the machine's CPUs the step kept busy (near 1: no idle CPU was left
  for communication to hide in).

Before any timing, each reducer averages known per-rank gradients and checks the
result against NumPy's mean over the ranks, and one overlapped training step is
checked against the mean of the ranks' own gradients (exit status 1 if either fails).
``--json FILE`` writes every row and the machine: host, CPUs, world size, MPI library,
NumPy, model bytes, the bucket layouts. ``--probe`` first measures whether the MPI
library moves a large message while neither side calls MPI.
"""

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # in time only if numpy is not imported yet; threadpoolctl below

import argparse  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from ... import Communicator  # noqa: E402
from ...adapters.training import GradientReducer  # noqa: E402
from .cli import mpi_library  # noqa: E402
from .gradients import mean_gradients  # noqa: E402
from .report import write_json  # noqa: E402

try:
    from threadpoolctl import threadpool_info, threadpool_limits
except ImportError:  # pragma: no cover - the env variables above then do what they can
    threadpool_info = threadpool_limits = None

MiB = 1 << 20


# -- the model ---------------------------------------------------------------------------
class NumpyMLP:
    """``layers`` dense layers ``width -> width``, ReLU between, loss ``0.5 |y - t|^2 / batch``.
    Parameters are named ``w0, b0, w1, b1, ...`` (the same on every rank: one seed);
    the batch differs per rank. All work arrays are allocated once."""

    def __init__(self, layers, width, batch, rank, seed=0):
        rng = np.random.default_rng(seed)
        self.layers, self.width, self.batch = layers, width, batch
        self.params = []
        for i in range(layers):
            w = (rng.standard_normal((width, width), dtype=np.float32) * np.float32(np.sqrt(2.0 / width)))
            self.params += [(f"w{i}", w), (f"b{i}", np.zeros(width, np.float32))]
        self.grads = {name: np.zeros_like(p) for name, p in self.params}
        data = np.random.default_rng(seed + 1 + rank)
        self.x = data.standard_normal((batch, width), dtype=np.float32)
        self.target = data.standard_normal((batch, width), dtype=np.float32)
        self.z = [np.empty((batch, width), np.float32) for _ in range(layers)]  # pre-activations
        self.a = [self.x] + [np.empty((batch, width), np.float32) for _ in range(layers - 1)]  # layer inputs
        self.dz = np.empty((batch, width), np.float32)
        self.da = np.empty((batch, width), np.float32)
        self.by_name = dict(self.params)  # name -> parameter

    @property
    def nbytes(self):
        return sum(p.nbytes for _, p in self.params)

    def ready_order(self):
        """Parameter names in the order backward completes their gradients."""
        return [name for name, _ in reversed(self.params)]

    def forward(self):
        for i in range(self.layers):
            self._matmul(self.a[i], self.by_name[f"w{i}"], self.z[i], None, 1)
            self.z[i] += self.by_name[f"b{i}"]
            if i + 1 < self.layers:
                np.maximum(self.z[i], 0, out=self.a[i + 1])
        return self.z[-1]

    def backward(self, ready=None, poll=None, chunks=1):
        """Gradients into ``self.grads``; ``ready(name, grad)`` as each one is complete.
        ``chunks > 1``: each matmul is computed in that many row blocks, with
        ``poll()`` between them (more chances to progress communication)."""
        np.subtract(self.z[-1], self.target, out=self.dz)
        self.dz *= np.float32(1.0 / self.batch)
        for i in reversed(range(self.layers)):
            gb, gw = self.grads[f"b{i}"], self.grads[f"w{i}"]
            np.sum(self.dz, axis=0, out=gb)
            if ready is not None:
                ready(f"b{i}", gb)
            self._matmul(self.a[i].T, self.dz, gw, poll, chunks)
            if ready is not None:
                ready(f"w{i}", gw)
            if i > 0:
                self._matmul(self.dz, self.by_name[f"w{i}"].T, self.da, poll, chunks)
                np.multiply(self.da, self.z[i - 1] > 0, out=self.dz)

    offload_s = None  # --offload: seconds one matmul takes, slept instead of computed

    def offload(self, world):
        """Emulate an accelerator: from now on every matmul is a sleep of the time it
        takes on this CPU (the mean over the ranks of each one's median, so every rank
        sleeps alike), so the CPU is free while "compute" runs, as the host is while a
        GPU runs backward."""
        a, b = self.a[0], self.by_name["w0"]
        np.matmul(a, b, out=self.z[0])
        times = []
        for _ in range(7):
            t = time.perf_counter()
            np.matmul(a, b, out=self.z[0])
            times.append(time.perf_counter() - t)
        self.offload_s = world.allreduce(float(np.median(times)), op=MPI.SUM) / world.Get_size()

    def _matmul(self, a, b, out, poll, chunks):
        if self.offload_s is not None:
            time.sleep(self.offload_s)
            return
        if chunks <= 1 or poll is None:
            np.matmul(a, b, out=out)
            return
        rows = np.linspace(0, a.shape[0], chunks + 1).astype(int)
        for lo, hi in zip(rows[:-1], rows[1:]):  # row blocks of a C-order out stay BLAS-friendly
            np.matmul(a[lo:hi], b, out=out[lo:hi])
            poll()

    def step(self, ready=None, poll=None, chunks=1):
        self.forward()
        self.backward(ready, poll, chunks)


class TorchMLP:
    """The same MLP in ``torch.nn`` (autograd computes backward); ``--framework torch``."""

    def __init__(self, layers, width, batch, rank, seed=0, device="cpu"):
        import torch

        self.torch = torch
        torch.manual_seed(seed)
        mods = []
        for i in range(layers):
            mods.append(torch.nn.Linear(width, width))
            if i + 1 < layers:
                mods.append(torch.nn.ReLU())
        self.device = torch.device(device)
        self.model = torch.nn.Sequential(*mods).to(self.device)
        gen = torch.Generator().manual_seed(seed + 1 + rank)
        self.x = torch.randn(batch, width, generator=gen).to(self.device)
        self.target = torch.randn(batch, width, generator=gen).to(self.device)
        self.batch = batch

    @property
    def nbytes(self):
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def step(self, module=None):
        """Forward and backward on this rank's batch, through ``module`` (default the
        model; e.g. a DistributedDataParallel wrapping a copy of it)."""
        module = self.model if module is None else module
        for p in module.parameters():
            p.grad = None
        out = module(self.x)
        loss = 0.5 * ((out - self.target) ** 2).sum() / self.batch
        loss.backward()
        if self.device.type == "cuda":  # a step is over once the device has run it
            self.torch.cuda.synchronize(self.device)


# -- instrumentation ---------------------------------------------------------------------
class MeasuredReducer(GradientReducer):
    """A GradientReducer that counts its polls (the library is unchanged)."""

    polls = 0

    def _poll(self):
        self.polls += 1
        return super()._poll()

    def done_fraction(self):
        """Share of the bytes whose allreduce has finished (read without polling)."""
        total = sum(b.nbytes for b in self.buckets)
        done = sum(b.nbytes for b, h in zip(self.buckets, list(self._handles)) if getattr(h, "_finished", False))
        return done / total


class Stats:
    """Per-step samples of one variant on this rank."""

    def __init__(self):
        self.step, self.cpu, self.sync, self.polls, self.done = [], [], [], [], []


# -- checks ------------------------------------------------------------------------------
def _close(got, want, compression):
    """Within rounding: the largest error at most ``tol`` times the largest magnitude
    (fp16 rounds every rank's share to 11 bits, and the sum again)."""
    tol = {None: 1e-5, "fp16": 5e-3}.get(compression, 3e-2)  # bf16: 8-bit mantissa
    return float(np.max(np.abs(got - want))) <= tol * float(np.max(np.abs(want)))


def check_known_inputs(reducer, named, rank, size, compression):
    """Rank r hands ``base + r * delta`` for every parameter (in backward order, in two
    batches with a poll in between); the result must be ``base + delta * (size-1)/2``."""
    bad = []
    grads = {}
    for k, (name, p) in enumerate(named):
        rng = np.random.default_rng(1000 + k)
        base = rng.standard_normal(p.shape).astype(np.float32)
        delta = rng.standard_normal(p.shape).astype(np.float32)
        grads[name] = (base + np.float32(rank) * delta).astype(p.dtype)
        grads[name + "/want"] = base.astype(np.float64) + delta.astype(np.float64) * (size - 1) / 2
    for name, _ in reversed(named):
        reducer.gradient_ready(name, grads[name])
    out = reducer.synchronize()
    for name, _ in named:
        if not (out[name] is grads[name] and _close(grads[name], grads[name + "/want"], compression)):
            bad.append(name)
    return bad


def check_training_step(model, reducer, world, compression):
    """One overlapped step: the averaged gradients must equal the mean over ranks of
    each rank's own gradients (computed here without the reducer, summed by MPI)."""
    model.step()
    want = {}
    for name, g in model.grads.items():
        total = np.empty(g.shape, np.float64)
        world.Allreduce(g.astype(np.float64), total, op=MPI.SUM)
        want[name] = total / world.Get_size()
    model.step(reducer.gradient_ready)
    reducer.synchronize()
    return [name for name, g in model.grads.items() if not _close(g, want[name], compression)]


# -- the probe: does MPI move a message nobody polls? ------------------------------------
def probe_progress(world, sizes=(64 << 10, 1 << 20, 4 << 20, 16 << 20), busy_s=0.02):
    """Ranks pair up (0-1, 2-3, ...) and exchange one message of each size, waiting as
    the library does (``Testall``, yielding the CPU between polls). ``direct``: wait
    right after posting. ``sleep`` / ``compute``: after posting, sleep / compute for
    ``busy_s`` without calling MPI, then wait. If the MPI library moves a message
    nobody polls, the wait after ``sleep`` is near 0; if not, near ``direct``. Returns
    the medians of 3 tries, slowest rank, in ms."""
    rank, size = world.Get_rank(), world.Get_size()
    peer = rank ^ 1 if (rank ^ 1) < size else None
    a = np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32)

    def compute():
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:
            a @ a

    pause = {"direct": lambda: None, "sleep": lambda: time.sleep(busy_s), "compute": compute}
    rows = []
    for nbytes in sizes:
        send, recv = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        waits = {mode: [] for mode in pause}
        for _ in range(3):
            for mode, fn in pause.items():
                world.Barrier()
                reqs = [] if peer is None else [world.Irecv(recv, peer, 7), world.Isend(send, peer, 7)]
                fn()
                t0 = time.perf_counter()
                while not MPI.Request.Testall(reqs):
                    os.sched_yield()
                waits[mode].append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX) * 1e3)
        rows.append(dict({"bytes": nbytes, "busy_ms": busy_s * 1e3},
                         **{f"{mode}_wait_ms": float(np.median(w)) for mode, w in waits.items()}))
    return rows


# -- the benchmark -----------------------------------------------------------------------
def bucket_layout(reducer):
    return [{"bucket": b.index, "bytes": b.nbytes, "dtype": b.dtype.name, "params": list(b.names)}
            for b in reducer.buckets]


def _group_key(compression, algorithm, bucket_mib):
    return (compression or "none", algorithm, bucket_mib)


def reducer_settings(args):
    """``(group, reducer keywords)`` for every compression x algorithm x bucket size."""
    for compression in args.compression:
        for algorithm in args.algorithms:
            for bucket_mib in args.bucket_mib:
                kw = dict(compression=compression, algorithm=algorithm, bucket_bytes=int(bucket_mib * MiB),
                          first_bucket_bytes=int(args.first_bucket_kib * 1024))
                yield _group_key(compression, algorithm, bucket_mib), kw


def build_numpy_variants(args, model, comm, world, failures):
    """name -> (step callable taking a Stats, info dict); also the bucket layouts."""
    named = model.params
    order = model.ready_order()
    grads = model.grads
    variants = {"compute": (lambda st: model.step(), {"variant": "compute"})}
    layouts = {}
    reducers = []
    for group, kw in reducer_settings(args):
        plain = MeasuredReducer(named, comm, **kw)
        threaded = [(pi, MeasuredReducer(named, comm, progress_thread=True, poll_interval=pi, **kw))
                    for pi in args.poll_interval]
        reducers += [plain] + [r for _, r in threaded]
        layouts["/".join(map(str, group))] = bucket_layout(plain)
        for label, r in [("plain", plain)] + [(f"thread {pi}", r) for pi, r in threaded]:
            bad = check_known_inputs(r, named, comm.rank, comm.size, kw["compression"])
            bad += check_training_step(model, r, world, kw["compression"])
            if bad:
                failures.append(f"{group} {label}: wrong averaged gradients for {bad[:5]}")
        info = dict(zip(("compression", "algorithm", "bucket_mib"), group))

        def comm_only(st, r=plain):
            for name in order:
                r.gradient_ready(name, grads[name])
            r.synchronize()

        def after(st, r=plain):
            model.step()
            for name in order:
                r.gradient_ready(name, grads[name])
            r.synchronize()

        def overlap(st, r=plain, chunks=1):
            p0 = r.polls
            model.step(r.gradient_ready, r._poll, chunks)
            st.polls.append(r.polls - p0)
            st.done.append(r.done_fraction())
            t = time.perf_counter()
            r.synchronize()
            st.sync.append(time.perf_counter() - t)

        variants[("comm",) + group] = (comm_only, dict(info, variant="comm"))
        variants[("after",) + group] = (after, dict(info, variant="after"))
        variants[("overlap",) + group] = (overlap, dict(info, variant="overlap"))
        if args.chunks > 1:
            label = f"overlap+polls/{args.chunks}"
            variants[(label,) + group] = (lambda st, f=overlap: f(st, chunks=args.chunks),
                                          dict(info, variant=label, chunks=args.chunks))
        for pi, r in threaded:
            label = "overlap+thread" if len(args.poll_interval) == 1 else f"overlap+thread@{pi * 1e6:g}us"
            variants[(label,) + group] = (
                lambda st, r=r, f=overlap: f(st, r), dict(info, variant=label, poll_interval_s=pi))
    return variants, layouts, reducers


def build_torch_variants(args, model, comm, world, failures):
    """--framework torch: ``after`` hands ``.grad`` to a GradientReducer after backward;
    ``overlap`` is ``collectives.torch.DistributedOptimizer`` (autograd hooks), its
    ``synchronize()`` timed (the optimizer's step itself, SGD, is not taken)."""
    variants = {"compute": (lambda st: model.step(), {"variant": "compute"})}
    layouts, closers = {}, []
    params = list(model.model.named_parameters())
    model.step()  # .grad exists: the GradientReducer of "after" and "comm" works on its arrays
    grad_np = lambda: [(n, p.grad.numpy()) for n, p in params]  # noqa: E731
    for group, kw in reducer_settings(args):
        info = dict(zip(("compression", "algorithm", "bucket_mib"), group))
        plain = MeasuredReducer([(n, p.detach().numpy()) for n, p in params], comm, **kw)
        closers.append(plain)
        layouts["/".join(map(str, group))] = bucket_layout(plain)
        bad = check_known_inputs(plain, [(n, p.detach().numpy()) for n, p in params], comm.rank, comm.size,
                                 kw["compression"])
        if bad:
            failures.append(f"{group} torch reducer: wrong averaged gradients for {bad[:5]}")

        def comm_only(st, r=plain):
            for name, g in reversed(grad_np()):
                r.gradient_ready(name, g)
            r.synchronize()

        def after(st, r=plain):
            model.step()
            for name, g in reversed(grad_np()):
                r.gradient_ready(name, g)
            r.synchronize()

        variants[("comm",) + group] = (comm_only, dict(info, variant="comm"))
        variants[("after",) + group] = (after, dict(info, variant="after"))
        for thread in (False, True):
            bad = check_torch_optimizer(model, comm, world, thread, kw)
            if bad:
                failures.append(f"{group} DistributedOptimizer(progress_thread={thread}): wrong averaged "
                                f"gradients for {bad[:5]}")
            label = "overlap+thread" if thread else "overlap"
            variants[(label,) + group] = (None, dict(info, variant=label, _torch_opt=(thread, kw)))
    # DistributedOptimizer hooks the shared parameters: live ones of every variant would
    # all fire, so each overlap variant makes its optimizer for its batch of steps.
    return variants, layouts, closers


def check_torch_optimizer(model, comm, world, thread, kw):
    """One step through DistributedOptimizer against the mean of the ranks' own .grad."""
    import torch

    from ...adapters import torch as cct

    model.step()
    want = mean_gradients(model.model.named_parameters(), world)
    opt = cct.DistributedOptimizer(torch.optim.SGD(model.model.parameters(), lr=0.0),
                                   named_parameters=model.model.named_parameters(), comm=comm,
                                   progress_thread=thread, **kw)
    try:
        model.step()
        opt.synchronize()
    finally:
        opt.close()
    return [n for n, p in model.model.named_parameters() if not _close(p.grad.numpy(), want[n], kw["compression"])]


def run_torch_overlap(model, comm, thread, kw, steps, stats):
    import torch

    from ...adapters import torch as cct

    opt = cct.DistributedOptimizer(torch.optim.SGD(model.model.parameters(), lr=0.0),
                                   named_parameters=model.model.named_parameters(), comm=comm,
                                   progress_thread=thread, **kw)
    try:
        world = MPI.COMM_WORLD
        for _ in range(steps):
            world.Barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            model.step()
            t = time.perf_counter()
            opt.synchronize()
            end = time.perf_counter()
            stats.step.append(end - t0)
            stats.cpu.append(time.process_time() - c0)
            stats.sync.append(end - t)
    finally:
        opt.close()


def timed(world, fn, steps, stats):
    for _ in range(steps):
        world.Barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fn(stats)
        stats.step.append(time.perf_counter() - t0)
        stats.cpu.append(time.process_time() - c0)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m collectives.tools.bench.training", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--framework", choices=("numpy", "torch"), default="numpy")
    p.add_argument("--ddp", action="store_true", help="time torch DDP on the 'collectives' backend against gloo "
                   "(implies --framework torch; see collectives.tools.bench.ddp)")
    p.add_argument("--layers", type=int, default=5, help="dense layers (default 5)")
    p.add_argument("--width", type=int, default=1024, help="layer width (default 1024: 4 MiB per weight)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank (default 64)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant per round (default 10)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    p.add_argument("--compression", default="none,fp16", help="comma-separated: none, fp16 (or any other the "
                   "reducer accepts, e.g. bf16; default none,fp16)")
    p.add_argument("--algorithms", default="auto", help="comma-separated allreduce algorithms (default auto)")
    p.add_argument("--bucket-mib", default="25", help="comma-separated bucket_bytes in MiB (default 25, the "
                   "library's)")
    p.add_argument("--first-bucket-kib", type=float, default=1024, help="first_bucket_bytes in KiB (default 1024)")
    p.add_argument("--poll-interval", default="50e-6", help="comma-separated poll_interval seconds of the "
                   "progress thread (default 50e-6, the library's)")
    p.add_argument("--chunks", type=int, default=1, help="if > 1, also a variant 'overlap+polls/K' that computes "
                   "each backward matmul in K row blocks and polls the reducer between them (NumPy only)")
    p.add_argument("--probe", action="store_true", help="first measure whether MPI progresses unpolled messages")
    p.add_argument("--offload", action="store_true", help="NumPy only: after the correctness checks, replace every "
                   "matmul by a sleep of its measured length, as if an accelerator computed and the CPU were free "
                   "for the communication (the values of the gradients are then meaningless; the messages are real)")
    p.add_argument("--device", default="cpu", help="--ddp only: where the model and its gradients live: cpu, or "
                   "cuda (rank r on GPU r mod the GPUs; gloo then reduces the same CUDA tensors)")
    p.add_argument("--json", help="write rows and machine info here (rank 0)")
    args = p.parse_args(argv)
    if args.device != "cpu" and not args.ddp:
        p.error("--device: only with --ddp")
    args.compression = [None if c.strip() == "none" else c.strip() for c in args.compression.split(",")]
    args.algorithms = [a.strip() for a in args.algorithms.split(",")]
    args.bucket_mib = [float(b) if "." in b else int(b) for b in args.bucket_mib.split(",")]
    args.poll_interval = [float(x) for x in args.poll_interval.split(",")]
    return args


def _cell(value, fmt, width):
    return ("-" if value is None else format(value, fmt)).rjust(width)


def print_table(rows, model_bytes, world_size, framework):
    print(f"\n# training step, {framework} MLP, {model_bytes / MiB:.1f} MiB of float32 gradients, world size "
          f"{world_size}; times: median over steps of the slowest rank's; hid = hidden fraction of the communication")
    head = (f"{'variant':<30}{'compr':>6}{'algo':>8}{'bkt':>5}{'step_ms':>9}{'p25':>8}{'p75':>8}{'exposed':>9}"
            f"{'hid_after':>10}{'hid_comm':>9}{'sync_ms':>8}{'polls':>7}{'done%':>7}{'cpu_ms':>8}{'load':>6}")
    print(head)
    for r in rows:
        if r["variant"] == "compute":
            grp = ("", "", "")
        else:
            grp = (r["compression"], r["algorithm"], f"{r['bucket_mib']:g}")
        print(f"{r['variant']:<30}{grp[0]:>6}{grp[1]:>8}{grp[2]:>5}"
              + _cell(r["step_ms"], ".1f", 9) + _cell(r["p25_ms"], ".1f", 8) + _cell(r["p75_ms"], ".1f", 8)
              + _cell(r.get("exposed_ms"), ".1f", 9) + _cell(r.get("hidden_vs_after"), ".2f", 10)
              + _cell(r.get("hidden_vs_comm"), ".2f", 9) + _cell(r.get("sync_ms"), ".1f", 8)
              + _cell(r.get("polls"), ".1f", 7)
              + _cell(None if r.get("done_fraction") is None else 100 * r["done_fraction"], ".0f", 7)
              + _cell(r.get("cpu_ms"), ".1f", 8) + _cell(r.get("cpu_load"), ".2f", 6))


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    limits = threadpool_limits(1) if threadpool_limits is not None else None  # noqa: F841 (kept alive)
    if args.ddp:
        args.framework = "torch"
    if args.framework == "torch":
        import torch

        torch.set_num_threads(1)
    if args.ddp:
        return main_ddp(args, world)
    probe = probe_progress(world) if args.probe else None
    comm = Communicator()
    failures = []
    if args.framework == "numpy":
        model = NumpyMLP(args.layers, args.width, args.batch, rank)
        variants, layouts, reducers = build_numpy_variants(args, model, comm, world, failures)
    else:
        model = TorchMLP(args.layers, args.width, args.batch, rank)
        variants, layouts, reducers = build_torch_variants(args, model, comm, world, failures)
    failures = world.allgather(failures)
    failures = [f for per_rank in failures for f in per_rank]
    if failures:
        if rank == 0:
            print("correctness check FAILED, nothing timed:\n  " + "\n  ".join(sorted(set(failures))), flush=True)
        return 1
    if rank == 0:
        print(f"correctness: every reducer's average matches NumPy's mean over {size} ranks "
              f"({len(variants) - 1} communicating variants)", flush=True)
    if args.offload:
        model.offload(world)  # after the checks: from here on the gradients' values are meaningless
        if rank == 0:
            print(f"offload: each matmul is a {model.offload_s * 1e3:.2f} ms sleep (the CPU is free meanwhile)",
                  flush=True)

    names = list(variants)
    stats = {name: Stats() for name in names}

    def run(name, steps, st):
        fn, info = variants[name]
        if fn is None:  # torch overlap: a DistributedOptimizer for this batch
            run_torch_overlap(model, comm, *info["_torch_opt"], steps, st)
        else:
            timed(world, fn, steps, st)

    for name in names:
        run(name, args.warmup, Stats())
    for rnd in range(args.rounds):
        shift = rnd % len(names)
        for name in names[shift:] + names[:shift]:
            run(name, args.steps, stats[name])
        if rank == 0:
            print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    rows = []
    for name in names:
        st, info = stats[name], variants[name][1]
        steps = np.array(st.step)
        slowest = np.empty_like(steps)
        world.Allreduce(steps, slowest, op=MPI.MAX)
        row = {k: v for k, v in info.items() if not k.startswith("_")}
        row.update(step_ms=float(np.median(slowest) * 1e3), p25_ms=float(np.percentile(slowest, 25) * 1e3),
                   p75_ms=float(np.percentile(slowest, 75) * 1e3), steps=int(steps.size))
        cpu = np.array(st.cpu)
        row["cpu_ms"] = float(world.allreduce(float(np.median(cpu)), op=MPI.SUM) / size * 1e3)
        row["cpu_load"] = row["cpu_ms"] * size / (row["step_ms"] * (os.cpu_count() or 1))
        if st.sync:
            sync = np.array(st.sync)
            world.Allreduce(MPI.IN_PLACE, sync, op=MPI.MAX)
            row["sync_ms"] = float(np.median(sync) * 1e3)
        if st.polls:
            row["polls"] = float(world.allreduce(float(np.mean(st.polls)), op=MPI.SUM) / size)
            row["done_fraction"] = float(world.allreduce(float(np.mean(st.done)), op=MPI.SUM) / size)
        rows.append(row)

    t_compute = rows[0]["step_ms"]
    ref = {(r["variant"], r["compression"], r["algorithm"], r["bucket_mib"]): r["step_ms"]
           for r in rows if r["variant"] in ("after", "comm")}
    for r in rows[1:]:
        g = (r["compression"], r["algorithm"], r["bucket_mib"])
        t_after, t_comm = ref[("after",) + g], ref[("comm",) + g]
        if r["variant"] != "comm":
            r["exposed_ms"] = r["step_ms"] - t_compute
            r["hidden_vs_after"] = 1 - r["exposed_ms"] / (t_after - t_compute) if t_after != t_compute else None
            r["hidden_vs_comm"] = 1 - r["exposed_ms"] / t_comm
    for r in reducers:
        if r is not None:
            r.close()

    if rank == 0:
        print_table(rows, model.nbytes, size, args.framework)
        if probe:
            print("\n# probe: one message between rank pairs; ms waiting for it right after posting (direct), "
                  f"or after {probe[0]['busy_ms']:.0f} ms of sleeping / computing without MPI calls (slowest rank)")
            for p in probe:
                print(f"  {p['bytes'] / MiB:8.3f} MiB   direct {p['direct_wait_ms']:7.2f}   sleep "
                      f"{p['sleep_wait_ms']:7.2f}   compute {p['compute_wait_ms']:7.2f}")
        for group, layout in layouts.items():
            sizes = ", ".join(f"{b['bytes'] / MiB:.2f}" for b in layout)
            print(f"# buckets {group} (MiB, in start order): {sizes}")
        sys.stdout.flush()
        if args.json:
            info = {
                "hostname": socket.gethostname(), "cpu_count": os.cpu_count(),
                "sched_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                "world_size": size, "mpi_library": mpi_library(),
                "mpi4py": __import__("mpi4py").__version__, "numpy": np.__version__,
                "python": platform.python_version(), "machine": platform.machine(),
                "framework": args.framework, "model_bytes": int(model.nbytes),
                "layers": args.layers, "width": args.width, "batch_per_rank": args.batch,
                "steps_per_round": args.steps, "rounds": args.rounds, "warmup": args.warmup,
                "argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                "blas_threads": [{"api": d.get("internal_api"), "threads": d.get("num_threads")}
                                 for d in threadpool_info()] if threadpool_info else None,
                "bucket_layouts": layouts, "probe": probe,
            }
            if args.framework == "torch":
                import torch

                info["torch"] = torch.__version__
                info["torch_threads"] = torch.get_num_threads()
            write_json(args.json, {"machine": info, "rows": rows})
    return 0


def main_ddp(args, world):
    """--ddp: DDP on "collectives" against gloo (collectives.tools.bench.ddp)."""
    from . import ddp

    rank, size = world.Get_rank(), world.Get_size()
    device = args.device
    if device == "cuda":
        import torch

        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(torch.device(device))
    model = TorchMLP(args.layers, args.width, args.batch, rank, device=device)
    rows, failures, ddp_info = ddp.run(args, model, world)
    ddp_info["device"] = device
    failures = [f for per_rank in world.allgather(failures) for f in per_rank]
    if rank != 0:
        return 1 if failures else 0
    if failures:
        print("correctness check FAILED, nothing timed:\n  " + "\n  ".join(sorted(set(failures))), flush=True)
        return 1
    print(f"correctness: every DDP variant's gradients match the mean over {size} ranks", flush=True)
    ddp.print_table(rows, model.nbytes, size)
    sys.stdout.flush()
    if args.json:
        info = {"hostname": socket.gethostname(), "cpu_count": os.cpu_count(), "world_size": size,
                "mpi_library": mpi_library(), "mpi4py": __import__("mpi4py").__version__,
                "numpy": np.__version__, "python": platform.python_version(), "machine": platform.machine(),
                "model_bytes": int(model.nbytes), "layers": args.layers, "width": args.width,
                "batch_per_rank": args.batch, "steps_per_round": args.steps, "rounds": args.rounds,
                "warmup": args.warmup, "argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M:%S"), **ddp_info}
        write_json(args.json, {"machine": info, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
