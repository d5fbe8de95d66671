"""Run every collective with every algorithm, check each against native MPI, and print
a table.

    mpiexec -n 4 python -m collectives.tools.demo [--count N] [--dtype float32]

Each algorithm is checked over several element counts (0, 1, p+1, a prime and
``--count``) and every op valid for the dtype: its result must equal, bit for bit, the
one the MPI library's own collective gives on the same input (integer-valued, so the
order of the additions does not matter). The time column is the median of a few calls
at ``--count`` elements, and "vs native" is native's time divided by it (above 1 is
faster than MPI's own), measured in the same run. The exit status is non-zero if any
result was wrong.
"""

import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

import collectives as cc
from collectives.algorithms import PEER_READS
from collectives.reference import mpi_result
from collectives.specs import SPECS


def make_input(rank, count, dtype, op):
    index = np.arange(count)
    if op == "prod":
        values = np.where((index + rank) % 5 == 0, 2, 1)
    else:
        values = (index * 5 + rank * 3) % 7
    return values.astype(dtype)


def collective_input(rank, size, collective, count, dtype, op):
    """Rank ``rank``'s input of ``count`` elements, for scatter and alltoall ``size`` rows
    of them."""
    spec = SPECS[collective]
    if spec.root_input or spec.blocked:
        return make_input(rank, size * count, dtype, op).reshape(size, count)
    return make_input(rank, count, dtype, op)


def native_result(mpi, collective, x, op="sum", root=0):
    """What MPI's own collective gives for ``x``, through mpi4py directly (the reference
    the demo compares with), shaped as the Communicator shapes results."""
    return mpi_result(mpi, collective, x, op, root)


def run_one(comm, collective, algorithm, x, op, root):
    """``comm.<collective>`` on ``x`` with the arguments its spec takes (root, op);
    broadcast on a copy, since it fills its x (not alltoallv: no counts here)."""
    spec = SPECS[collective]
    kw = {"root": root} if spec.rooted else {}
    if spec.reduces:
        kw["op"] = op
    return getattr(comm, collective)(x.copy() if spec.one_buffer else x, algorithm=algorithm, **kw)


def ops_for(collective, dtype):
    if not SPECS[collective].reduces:
        return ["sum"]
    return [op for op in cc.ops_for(dtype) if op != "avg" or np.dtype(dtype).kind == "f"]


def verify(comm, mpi, collective, algorithm, counts, dtype):
    """Number of wrong elements on this rank over every count and op."""
    wrong = 0
    root = comm.size - 1
    for count in counts:
        for op in ops_for(collective, dtype):
            x = collective_input(comm.rank, comm.size, collective, count, dtype, op)
            got = run_one(comm, collective, algorithm, x, op, root)
            want = native_result(mpi, collective, x, op, root)
            if want is None:
                wrong += got is not None
            elif got is None or got.shape != want.shape:
                wrong += max(want.size, 1)
            else:
                wrong += int(np.count_nonzero(got != want))
    return wrong


def median_time(comm, mpi, collective, algorithm, count, dtype, repeats):
    x = collective_input(comm.rank, comm.size, collective, count, dtype, "sum")
    times = []
    for _ in range(repeats + 1):
        mpi.Barrier()
        start = time.perf_counter()
        run_one(comm, collective, algorithm, x, "sum", 0)
        times.append(time.perf_counter() - start)
    # The slowest rank decides when a collective is done.
    slowest = mpi.allreduce(float(np.median(times[1:])), op=MPI.MAX)
    return slowest


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m collectives.tools.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1 << 18, help="elements for the timing (default 262144)")
    parser.add_argument("--dtype", default="float32", help="element type (default float32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per algorithm (default 5)")
    args = parser.parse_args(argv)

    mpi = MPI.COMM_WORLD
    comm = cc.Communicator()
    counts = sorted({0, 1, comm.size + 1, 10_007, args.count})
    rows = []
    for collective in cc.COLLECTIVES:
        native_time = median_time(comm, mpi, collective, "native", args.count, args.dtype, args.repeats)
        for algorithm in cc.algorithms(collective):
            if (collective, algorithm) in PEER_READS:
                continue  # device arrays only
            wrong = mpi.allreduce(verify(comm, mpi, collective, algorithm, counts, args.dtype))
            seconds = median_time(comm, mpi, collective, algorithm, args.count, args.dtype, args.repeats)
            rows.append((collective, algorithm, wrong, seconds, native_time / seconds))

    if comm.rank == 0:
        nbytes = args.count * np.dtype(args.dtype).itemsize
        print(f"collectives demo: {comm.size} ranks, {args.dtype}, checked against native MPI at counts "
              f"{', '.join(map(str, counts))}; timed at {args.count} elements ({nbytes / 2**20:.2f} MiB) per rank, "
              f"per row for scatter and alltoall")
        print(f"{'collective':<15} {'algorithm':<19} {'check':<10} {'#wrong':>7} {'time (us)':>11} {'vs native':>10}")
        for collective, algorithm, wrong, seconds, ratio in rows:
            status = "verified" if wrong == 0 else "WRONG"
            print(f"{collective:<15} {algorithm:<19} {status:<10} {wrong:>7} {seconds * 1e6:>11.1f} {ratio:>9.2f}x")
        total_wrong = sum(row[2] for row in rows)
        print(f"{len(rows)} collective/algorithm pairs, {total_wrong} wrong elements")
    comm.free()
    return 1 if any(row[2] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
