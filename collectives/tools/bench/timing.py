"""Timing: warm-up, iteration counts scaled per size, interleaved rounds, and the
statistics combined across ranks (the OSU and nccl-tests methods).

Every rank times each call of a batch on its own clock. Per contender:

- ``time_us`` (avg), ``min_us``, ``max_us``: each rank's mean call time, then the
  average, smallest and largest of those over ranks (OSU's avg/min/max latency);
- ``p50_us``, ``p99_us``: percentiles over the calls of the slowest rank's time for
  each call (a call is done when its last rank is);
- ``round_spread`` (given the rounds' sizes): the spread between the interleaved
  rounds, max/min - 1 of each round's mean call time (averaged over the ranks as
  ``time_us`` is), 0 with one round: how much the machine drifted while this
  contender was measured (``collectives-bench --tune`` wants a larger margin than it).

Contenders are interleaved: each round runs a batch of every contender, in an order
that rotates from round to round, so a machine that drifts (this one is shared) slows
them alike.
"""

import time
import tracemalloc

import numpy as np
from mpi4py import MPI


def _max_over_ranks(world, value):
    return world.allreduce(value, op=MPI.MAX)


def iterations(world, call, warmup, budget_s, min_iters, max_iters):
    """Run ``warmup`` calls and return how many timed calls fit ``budget_s`` seconds
    (the same number on every rank)."""
    elapsed = 0.0
    for _ in range(max(1, warmup)):
        world.Barrier()
        start = time.perf_counter()
        call()
        elapsed = time.perf_counter() - start  # the last warm-up call: caches are warm
    per_call = _max_over_ranks(world, elapsed)
    return int(min(max_iters, max(min_iters, budget_s // max(per_call, 1e-9))))


def run_batch(world, call, iters):
    """Per-call times in seconds of ``iters`` back-to-back calls on this rank."""
    samples = np.empty(iters)
    clock = time.perf_counter
    world.Barrier()
    for i in range(iters):
        start = clock()
        call()
        samples[i] = clock() - start
    return samples


def interleaved_rounds(world, calls, iters, rounds):
    """Time every contender in ``calls`` (name -> callable) with ``iters[name]`` calls in
    all, split over ``rounds`` rounds; return name -> this rank's samples of each round
    that had calls (a list of arrays)."""
    names = list(calls)
    samples = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            share = iters[name] // rounds + (1 if r < iters[name] % rounds else 0)
            if share:
                samples[name].append(run_batch(world, calls[name], share))
    return samples


def interleaved(world, calls, iters, rounds):
    """As :func:`interleaved_rounds`, the rounds' samples one after another."""
    return {name: np.concatenate(parts) for name, parts in interleaved_rounds(world, calls, iters, rounds).items()}


def combine(world, samples, rounds=None):
    """The statistics of one contender's samples over all ranks (every rank gets them);
    ``rounds``: how many of the samples each round took, in order (adds
    ``round_spread``)."""
    gathered = np.empty((world.Get_size(), samples.size))
    world.Allgather(np.ascontiguousarray(samples), gathered)
    means = gathered.mean(axis=1)
    slowest = gathered.max(axis=0)
    stats = {
        "time_us": float(means.mean() * 1e6),
        "min_us": float(means.min() * 1e6),
        "max_us": float(means.max() * 1e6),
        "p50_us": float(np.percentile(slowest, 50) * 1e6),
        "p99_us": float(np.percentile(slowest, 99) * 1e6),
        "iters": int(samples.size),
    }
    if rounds is not None:
        if sum(rounds) != samples.size:
            raise ValueError(f"rounds {rounds} do not add up to the {samples.size} samples")
        bounds = np.cumsum([0] + [n for n in rounds])
        per_round = [gathered[:, a:b].mean() for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        fastest = min(per_round, default=0.0)
        stats["round_spread"] = float(max(per_round) / fastest - 1) if fastest > 0 else 0.0
    return stats


def peak_extra_memory(world, call, release=None):
    """The largest peak of memory allocated through Python (NumPy arrays included) by
    one call on any rank, in bytes. ``release`` first drops cached scratch buffers, so
    the figure includes the workspace a call needs."""
    if release is not None:
        release()
    world.Barrier()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        call()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return int(_max_over_ranks(world, peak))
