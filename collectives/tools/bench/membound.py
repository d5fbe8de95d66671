"""The memory-traffic bound of a collective on one node (``collectives-bench``'s
``bound`` column).

On one machine a collective is copies and reductions through memory: the time it
cannot beat is the bytes each rank must read and write, over the memory bandwidth a
rank gets while every rank streams at once. Both are here:

- :func:`probe` measures that bandwidth in the benchmark's own run: every rank adds two
  large float32 arrays into a third (``np.add(a, b, out=c)``: two streams read, one
  written, as a reduction does), at the same moment, after a barrier. The figure is
  the slowest rank's median, in bytes read + written per second.
- :func:`traffic` is the least number of bytes the ranks move through memory for a
  collective of ``n`` bytes at ``p`` ranks, by the best schedule shared memory allows
  (every rank reads the others' buffers in place; nothing is copied twice), divided
  by ``p``: the machine's memory is shared, so the bound is the ranks' total traffic
  over their total bandwidth (where one rank idles, as broadcast's root does, the
  others can use its share):

  ========================  ===============================  ==========================
  collective (n: as the     one rank's share of the work     bytes read + written
  benchmark reports it)
  ========================  ===============================  ==========================
  allreduce (n: input)      read its 1/p of every input,     (2 + (p-1)/p) n
                            write that reduced 1/p into its  (2.5 n at p = 2,
                            output, copy the p-1 others'     2.75 n at 4)
                            reduced shares into its output
  reduce_scatter (n: input) read its 1/p of every input,     n + n/p
                            write its 1/p result
  allgather (n: output)     read every block, write all      2 n
  broadcast (n)             each of the p-1 others: read     2 n (p-1)/p
                            the root's buffer, write its own
  ========================  ===============================  ==========================

  Other collectives have no row (their bound column is empty). The bound is
  ``traffic / bandwidth``: ``time / bound`` is how far a contender is from it (1 would
  be at the limit).

The probe's arrays are far larger than the caches, so the bound is the memory's: it
holds for buffers beyond the caches (16 MiB and up here). Smaller ones stay in the
caches, which are faster, and there a contender can show a ratio below 1.
"""

import time

import numpy as np

PROBE_BYTES = 64 << 20  # per array: well past the caches


def probe(world, nbytes=PROBE_BYTES, repeats=5):
    """Bytes per second one rank moves (read + written) while every rank of ``world``
    runs ``np.add`` on ``nbytes`` arrays at once: the slowest rank's median (collective)."""
    n = max(1, nbytes // 4)
    a, b = np.ones(n, np.float32), np.ones(n, np.float32)
    c = np.empty_like(a)
    np.add(a, b, out=c)  # touch every page first
    times = []
    for _ in range(repeats):
        world.Barrier()
        start = time.perf_counter()
        np.add(a, b, out=c)
        times.append(time.perf_counter() - start)
    rate = 3 * a.nbytes / float(np.median(times))
    return world.allreduce(rate, op=_min())


def _min():
    from mpi4py import MPI

    return MPI.MIN


# The table above: each collective's bytes read + written per rank, for ``n`` bytes (the
# benchmark's size) at ``p`` ranks.
TRAFFIC = {
    "allreduce": lambda n, p: (2 + (p - 1) / p) * n,
    "reduce_scatter": lambda n, p: n + n / p,
    "allgather": lambda n, p: 2 * n,
    "broadcast": lambda n, p: 2 * n * (p - 1) / p,
}


def traffic(collective, nbytes, world_size):
    """Bytes the ranks must read and write for ``collective`` on ``nbytes`` (the
    benchmark's size) at ``world_size`` ranks, per rank, or None where there is no row."""
    n, p = float(nbytes), world_size
    if p == 1:
        return None  # nothing to move: MPI and ours copy or do nothing
    formula = TRAFFIC.get(collective)
    return None if formula is None else formula(n, p)


def bound_us(collective, nbytes, world_size, bandwidth):
    """The memory-traffic bound in microseconds, or None."""
    moved = traffic(collective, nbytes, world_size)
    if moved is None or not bandwidth:
        return None
    return moved / bandwidth * 1e6
