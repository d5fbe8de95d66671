"""Soak test: many mixed collectives in a row, every result checked, memory watched.

    mpiexec -n 4 python -m collectives.tools.soak --calls 20000 [--seed 0] [--json PATH]
                                            [--no-progress] [--max-growth-mib 64]

Every rank draws the same sequence of calls from one NumPy generator seeded with
``--seed`` (nothing in the draws depends on the rank): the collective, an algorithm
from ``collectives.algorithms(collective)`` (``native`` and ``auto`` included, the
device-only peer reads left out), a dtype, an op defined for it, an element count
(mostly 0..4096, sometimes up to 256K, zero included), a root, sync or async, and for
some allreduce/reduce calls ``out=x`` (in place). Async calls stay in flight in a
window whose depth (1..8) is redrawn now and then; when the window is full one of
them, picked at random, is waited for, some are only ``test()``-ed, and
``comm.poll()`` is called now and then, so up to eight calls of different collectives
and algorithms progress together with the sync calls made meanwhile. The communicator
has a timeout (``--timeout``, 120 s), so a hang ends as a
:class:`~collectives.CollectiveTimeoutError` instead of a stalled job.

Inputs are integer-valued and depend on (call index, rank) only, small enough that
every op is exact in every dtype at up to 32 ranks, so each rank computes the exact
NumPy answer for its own result locally (no communication) and compares it with the
result: every call on every rank is checked (reduce: the root's result, ``None``
elsewhere; reduce_scatter: block ``rank`` of ``np.array_split(total.ravel(), size)``).

"Bounded" memory: the resident set size (``/proc/self/statm``; ``ru_maxrss`` where
there is no ``/proc``) is read after a warm-up of 5% of the calls, when the plan cache
and the kept scratch buffers have reached their steady size, and again at the end.
The growth between the two, per rank, must not exceed ``--max-growth-mib`` (64 MiB):
a leak of anything per call (a buffer, a handle, a request) grows without limit over
tens of thousands of calls, while the library's caches are bounded. Both readings are
taken after ``release_memory()`` and ``gc.collect()``. Run it with
``MALLOC_MMAP_THRESHOLD_=131072`` in the environment (``make soak`` does) so that glibc
hands large arrays back to the system when they are freed: otherwise RSS also holds
the allocator's high-water mark of the largest calls in flight, which wanders by tens
of MiB from run to run (12-51 MiB of "growth" at 4 ranks without it, 6-7 MiB with
it). At the end no
request may be left: the progress engine has no active handle, its request list holds
only ``MPI.REQUEST_NULL`` and no request was abandoned.

The command exits 1 if any result is wrong, the memory grew too much or a request
leaked. ``run(comm, calls, seed=0, progress=False)`` does the same from Python and
returns the report (the same dict on every rank), which ``--json`` writes.
"""

import argparse
import gc
import json
import os
import resource
import sys
import time

import numpy as np
from mpi4py import MPI

import collectives as cc
from collectives.algorithms import PEER_READS, ROOTED
from collectives.reference import expected
from collectives.specs import SPECS

DTYPES = tuple(np.dtype(d) for d in cc.SUPPORTED_DTYPES)
SMALL_MAX = 4096  # elements: most calls
LARGE_MAX = 256 * 1024  # elements: some calls
MAX_WINDOW = 8  # async calls in flight at most
_MIB = 1024 * 1024


class Call:
    """One drawn call (identical on every rank)."""

    __slots__ = ("index", "collective", "algorithm", "dtype", "op", "count", "root", "is_async", "inplace")

    def __init__(self, index, collective, algorithm, dtype, op, count, root, is_async, inplace):
        self.index, self.collective, self.algorithm, self.dtype, self.op = index, collective, algorithm, dtype, op
        self.count, self.root, self.is_async, self.inplace = count, root, is_async, inplace

    def describe(self):
        kind = "async" if self.is_async else "sync"
        extra = " in place" if self.inplace else ""
        root = f", root={self.root}" if self.collective in ROOTED else ""
        op = f", op={self.op!r}" if SPECS[self.collective].reduces else ""
        return (f"call {self.index}: {self.collective}(algorithm={self.algorithm!r}, {self.dtype.name}, "
                f"count={self.count}{op}{root}) {kind}{extra}")


def draw(rng, index, size):
    """The next call from ``rng`` (the same draws on every rank)."""
    collective = cc.COLLECTIVES[int(rng.integers(len(cc.COLLECTIVES)))]
    names = [a for a in cc.algorithms(collective) if (collective, a) not in PEER_READS]  # host arrays here
    algorithm = names[int(rng.integers(len(names)))]
    dtype = DTYPES[int(rng.integers(len(DTYPES)))]
    choices = cc.ops_for(dtype)
    op = choices[int(rng.integers(len(choices)))]
    u = rng.random()
    if u < 0.04:
        count = 0
    elif u < 0.10:
        count = int(rng.integers(1, 2 * size + 2))  # around the world size: uneven blocks
    elif u < 0.92:
        count = int(rng.integers(1, SMALL_MAX + 1))
    else:  # log-uniform 4K..256K
        count = int(np.exp(rng.uniform(np.log(SMALL_MAX), np.log(LARGE_MAX))))
    root = int(rng.integers(size))
    is_async = bool(rng.random() < 0.5)
    inplace = bool(rng.random() < 0.15) and SPECS[collective].inplace
    return Call(index, collective, algorithm, dtype, op, count, root, is_async, inplace)


def rank_input(index, rank, count, dtype, op):
    """Rank ``rank``'s input for call ``index``: integer values (complex: both parts)
    for which ``op`` is exact in ``dtype`` at up to 32 ranks."""
    dtype = np.dtype(dtype)
    i = np.arange(count)
    if op == "prod":  # factors 1, 2 (at most 7 of 32 ranks) and, signed, -1
        values = np.where((i + rank + index) % 5 == 0, 2, 1)
        if dtype.kind != "u":
            values = np.where((i * 3 + rank + index) % 7 == 0, -values, values)
    else:
        low = 0 if dtype.kind == "u" else -3
        values = (i * 5 + rank * 3 + index) % 7 + low
    x = values.astype(dtype)
    if dtype.kind == "c" and op != "prod":
        x = x + (1j * values[::-1]).astype(dtype)
    return x


def reference(call, rank, size):
    """NumPy's exact answer for ``rank``'s result of ``call`` (None: no result), from
    :mod:`collectives.reference` given every rank's input."""
    spec = SPECS[call.collective]
    inputs = [scatter_rows(call, r, size) if spec.root_input or spec.blocked
              else rank_input(call.index, r, call.count, call.dtype, call.op) for r in range(size)]
    return expected(call.collective, inputs, call.op, call.root)[rank]


def scatter_rows(call, rank, size):
    """Rank ``rank``'s input to a scatter or alltoall: ``size`` rows of ``count`` elements
    (of a scatter, only the root's are sent)."""
    return rank_input(call.index, rank, size * call.count, call.dtype, call.op).reshape(size, call.count)


def start(comm, call):
    """Make ``call`` on ``comm``: ``(handle or result, the input kept alive)``."""
    rank, spec = comm.rank, SPECS[call.collective]
    if spec.one_buffer and rank != call.root:
        x = np.full(call.count, 100, call.dtype)  # outside the inputs' range: a broadcast that did nothing shows
    elif spec.root_input or spec.blocked:
        x = scatter_rows(call, rank, comm.size)
    else:
        x = rank_input(call.index, rank, call.count, call.dtype, call.op)
    suffix = "_async" if call.is_async else ""
    method = getattr(comm, call.collective + suffix)
    kw = {"root": call.root} if spec.rooted else {}  # the arguments the spec takes
    if spec.reduces:
        kw["op"] = call.op
    if call.inplace:  # drawn for the collectives that run in place only
        kw["out"] = x
    return method(x, algorithm=call.algorithm, **kw), x


def compare(call, rank, size, result):
    """None if ``result`` is ``rank``'s exact answer to ``call``, else what differs."""
    expected = reference(call, rank, size)
    if expected is None:
        return None if result is None else f"expected None, got {type(result).__name__}"
    if not isinstance(result, np.ndarray):
        return f"expected an array, got {type(result).__name__}"
    if result.dtype != expected.dtype or result.shape != expected.shape:
        return f"expected {expected.dtype} {expected.shape}, got {result.dtype} {result.shape}"
    if np.array_equal(result, expected):
        return None
    bad = np.flatnonzero(result.ravel() != expected.ravel())
    first = int(bad[0])
    return (f"{bad.size} of {expected.size} elements differ; first at flat index {first}: "
            f"got {result.ravel()[first]!r}, expected {expected.ravel()[first]!r}")


def rss_bytes():
    """This process's resident set size now (``/proc/self/statm``), else its peak
    (``ru_maxrss``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def kept_workspace(comm):
    """Bytes of scratch buffers the communicator keeps between calls (its largest few)."""
    return comm.scratch_bytes


def settled_rss(comm):
    """RSS after dropping what is deliberately kept (the communicator's scratch
    buffers, made again when needed) and collecting garbage: what a leak would grow."""
    comm.release_memory()
    gc.collect()
    return rss_bytes()


def leaks(comm):
    """What the communicator's progress engine still holds after every call finished."""
    return comm.progress.leftovers()


def run(comm, calls, seed=0, progress=False, *, max_growth_mib=None, warmup=None):
    """Make ``calls`` drawn calls on ``comm`` (a :class:`collectives.Communicator`;
    collective) and return the report, the same dict on every rank. ``ok`` is False if
    any result was wrong, a request leaked, or (with ``max_growth_mib``) some rank's
    resident memory grew by more than that many MiB after the warm-up (``warmup``
    calls; default 5% of ``calls``)."""
    rank, size = comm.rank, comm.size
    rng = np.random.default_rng(seed)
    warmup = max(1, calls // 20) if warmup is None else warmup
    counts = {c: 0 for c in cc.COLLECTIVES}
    by_algorithm = {c: {a: 0 for a in cc.algorithms(c)} for c in cc.COLLECTIVES}
    n_async = n_inplace = n_polls = n_tests = elements = 0
    max_in_flight = 0
    wrong = []
    pending = []  # (call, handle, input)
    depth = int(rng.integers(1, MAX_WINDOW + 1))

    def finish(i):
        call, handle, _ = pending.pop(i)
        check(call, handle.wait())

    def check(call, result):
        problem = compare(call, rank, size, result)
        if problem is not None:
            wrong.append(f"{call.describe()}: {problem}")

    bar = None
    if progress and rank == 0:
        try:
            from tqdm import tqdm
            bar = tqdm(total=calls, unit="call", desc=f"soak n={size}", mininterval=0.5)
        except ImportError:
            bar = None
    gc.collect()
    rss_start = rss_bytes()  # replaced after the warm-up
    objects_start = len(gc.get_objects())
    trace = []  # (calls made, RSS MiB) every 5% of the calls
    every = max(1, calls // 20)
    started = time.perf_counter()
    for index in range(calls):
        if index == warmup:
            rss_start = settled_rss(comm)
            objects_start = len(gc.get_objects())
        if index % every == 0:
            trace.append((index, round(rss_bytes() / _MIB, 1)))
        call = draw(rng, index, size)
        counts[call.collective] += 1
        by_algorithm[call.collective][call.algorithm] += 1
        n_inplace += call.inplace
        elements += call.count
        result, x = start(comm, call)
        if call.is_async:
            n_async += 1
            pending.append((call, result, x))
            max_in_flight = max(max_in_flight, len(pending))
            while len(pending) >= depth:
                finish(int(rng.integers(len(pending))))
        else:
            check(call, result)
        u = rng.random()
        if u < 0.1:
            n_polls += 1
            comm.poll()
        elif u < 0.2 and pending:
            n_tests += 1
            j = int(rng.integers(len(pending)))
            pending[j][1].test()  # advances it; it may finish here and not elsewhere, so it stays
            # in the window (waited for later) and the window stays the same on every rank
        if rng.random() < 0.02:  # a new window depth now and then
            depth = int(rng.integers(1, MAX_WINDOW + 1))
        if bar is not None:
            bar.update(1)
    while pending:  # the rest, in random order
        finish(int(rng.integers(len(pending))))
    elapsed = time.perf_counter() - started
    if bar is not None:
        bar.close()
    workspace = kept_workspace(comm)
    rss_raw = rss_bytes()
    rss_end = settled_rss(comm)
    trace.append((calls, round(rss_end / _MIB, 1)))
    objects = len(gc.get_objects()) - objects_start
    local = {"objects": objects, "trace": trace, "workspace": workspace, "rss_raw": rss_raw, "wrong": len(wrong),
             "wrong_first": wrong[:5], "leaks": leaks(comm), "rss_start": rss_start, "rss_end": rss_end,
             "elapsed": elapsed, "engine_entries": comm.progress.entries}
    everyone = comm.mpi_comm.allgather(local)  # nothing is in flight: MPI's own allgather is safe here
    growth = [(r["rss_end"] - r["rss_start"]) / _MIB for r in everyone]
    elapsed = max(r["elapsed"] for r in everyone)
    total_wrong = sum(r["wrong"] for r in everyone)
    leak_list = [f"rank {i}: {p}" for i, r in enumerate(everyone) for p in r["leaks"]]
    wrong_first = [f"rank {i}: {w}" for i, r in enumerate(everyone) for w in r["wrong_first"]][:10]
    too_much = max_growth_mib is not None and max(growth) > max_growth_mib
    return {
        "ok": total_wrong == 0 and not leak_list and not too_much,
        "world_size": size,
        "calls": calls,
        "seed": seed,
        "warmup_calls": warmup,
        "counts": counts,
        "algorithms": by_algorithm,
        "async": n_async,
        "sync": calls - n_async,
        "inplace": n_inplace,
        "polls": n_polls,
        "tests": n_tests,
        "max_in_flight": max_in_flight,
        "elements": elements,
        "checked": calls * size,  # every call's result on every rank (reduce: None off the root)
        "wrong": total_wrong,
        "wrong_per_rank": [r["wrong"] for r in everyone],
        "wrong_first": wrong_first,
        "leaks": leak_list,
        "engine_entries_left": [r["engine_entries"] for r in everyone],
        "rss_start_mib": [round(r["rss_start"] / _MIB, 2) for r in everyone],
        "rss_end_mib": [round(r["rss_end"] / _MIB, 2) for r in everyone],
        "rss_growth_mib": [round(g, 2) for g in growth],
        "rss_end_before_release_mib": [round(r["rss_raw"] / _MIB, 2) for r in everyone],
        "workspace_kept_mib": [round(r["workspace"] / _MIB, 2) for r in everyone],
        "max_growth_mib": round(max(growth), 2),
        "max_growth_allowed_mib": max_growth_mib,
        "rss_trace_mib": [r["trace"] for r in everyone],  # per rank: [calls made, RSS] every 5%
        "python_objects_growth": [r["objects"] for r in everyone],  # gc-tracked objects, end - after warm-up
        "elapsed_s": round(elapsed, 3),
        "calls_per_s": round(calls / elapsed, 1) if elapsed > 0 else None,
    }


def summary(report):
    """The report as a short text table."""
    lines = [f"soak: {report['calls']} calls at {report['world_size']} ranks, seed {report['seed']}: "
             f"{report['elapsed_s']:.1f} s, {report['calls_per_s']} calls/s",
             f"{'collective':<16}{'calls':>7}  algorithms"]
    for c, n in report["counts"].items():
        algs = " ".join(f"{a}={k}" for a, k in report["algorithms"][c].items())
        lines.append(f"{c:<16}{n:>7}  {algs}")
    lines.append(f"async {report['async']} (at most {report['max_in_flight']} in flight), sync {report['sync']}, "
                 f"in place {report['inplace']}, polls {report['polls']}, tests {report['tests']}, "
                 f"elements {report['elements']}")
    lines.append(f"results checked {report['checked']}, wrong {report['wrong']}")
    lines.extend("  " + w for w in report["wrong_first"])
    limit = report["max_growth_allowed_mib"]
    lines.append(f"RSS after warm-up (MiB) {report['rss_start_mib']}; end {report['rss_end_mib']}; "
                 f"growth {report['rss_growth_mib']} (max {report['max_growth_mib']}"
                 + (f", allowed {limit})" if limit is not None else ")"))
    lines.append(f"RSS at the end before release_memory() (MiB) {report['rss_end_before_release_mib']}; "
                 f"scratch buffers kept then {report['workspace_kept_mib']}")
    lines.append(f"gc-tracked Python objects, growth after warm-up: {report['python_objects_growth']}")
    lines.append("leaks: " + ("; ".join(report["leaks"]) if report["leaks"] else "none"))
    lines.append("OK" if report["ok"] else "FAILED")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m collectives.tools.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000, help="collective calls (default 20000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws, the same on every rank")
    parser.add_argument("--json", metavar="PATH", help="write the report here (rank 0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--max-growth-mib", type=float, default=64.0,
                        help="fail if a rank's RSS grows more after the warm-up (default 64)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a call counts as hung")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error("--calls must be positive")
    comm = cc.Communicator(timeout=args.timeout)
    try:
        report = run(comm, args.calls, args.seed, progress=not args.no_progress, max_growth_mib=args.max_growth_mib)
    except Exception as exc:  # a hang (timeout) or a library error: stop every rank
        print(f"rank {comm.rank}: soak failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)
        raise
    if comm.rank == 0:
        print(summary(report), flush=True)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    comm.free()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
