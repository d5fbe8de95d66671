"""What an MPI library's own collectives do when the ranks pass different sizes
(measured for collectives.mpi_library.NATIVE_STOPS_ON_MISMATCH): every rank but WHO
passes BIG float32s, WHO passes SMALL, and each prints MPI's error and how many bytes
after its result buffer changed (64 KiB of guard after each).

    mpiexec -n 2 python tests/harness/native_mismatch.py COLLECTIVE SMALL BIG WHO
    # COLLECTIVE: allreduce, bcast, allgather, reduce, gather, scatter, alltoall, reduce_scatter

Run each collective both ways round (WHO 0 and 1), 250000 against 262144: see
collectives/mpi_library.py for what MPICH 5.0.2, Open MPI 5.0.11 and Intel MPI 2021.18
did (a job that ends, hangs or prints nothing is part of the answer).
"""

import sys

import numpy as np
from mpi4py import MPI

GUARD = 1 << 16  # float32s after each result


def guarded(count):
    """``(whole, result)``: a result of ``count`` float32s followed by the guard (7s)."""
    whole = np.full(count + GUARD, 7, np.float32)
    return whole, whole[:count]


def main():
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    collective, small, big, who = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    n = small if rank == who else big
    x = np.ones(n, np.float32)
    calls = {
        "allreduce": (n, lambda out: comm.Allreduce(x, out, MPI.SUM)),
        "bcast": (n, lambda out: comm.Bcast(out, 0)),
        "allgather": (n * size, lambda out: comm.Allgather(x, out)),
        "reduce": (n, lambda out: comm.Reduce(x, out, MPI.SUM, 0)),
        "gather": (n * size, lambda out: comm.Gather(x, out if rank == 0 else None, 0)),
        "scatter": (n, lambda out: comm.Scatter(np.ones(n * size, np.float32) if rank == 0 else None, out, 0)),
        "alltoall": (n * size, lambda out: comm.Alltoall(np.ones(n * size, np.float32), out)),
        "reduce_scatter": (n // size, lambda out: comm.Reduce_scatter(np.ones(n, np.float32), out, [n // size] * size,
                                                                      MPI.SUM)),
    }
    count, call = calls[collective]
    whole, out = guarded(count)
    error = None
    try:
        call(out)
    except MPI.Exception as exc:
        error = exc.Get_error_string().splitlines()[0][:60]
    changed = int(np.count_nonzero(whole[count:] != 7)) * 4
    print(f"rank {rank} ({n} float32s): error {error}; {changed} B after the result changed", flush=True)


if __name__ == "__main__":
    main()
