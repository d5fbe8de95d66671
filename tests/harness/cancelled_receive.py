"""What MPI does with a receive that is given up on while its message is moving.

Rank 1 sends a message of ``BYTES`` (default 4 MiB); rank 0 has posted the receive,
lets MPI start moving it, and gives up on it as a failed call does: ``Cancel()``, which
does not take once the receive has matched its message. Then, with ``--drop``, it drops
the request and its buffer (NumPy gives the memory back to the system), as an executor
that does not keep given-up requests would; without it, it keeps the request, as
``collectives.transport.retired`` does. Rank 0 then calls into MPI again.

    I_MPI_FABRICS=shm mpiexec -n 2 python tests/harness/cancelled_receive.py --drop

Measured 2026-12-07 on the 2-core development machine, 10 runs each way: with Intel
MPI 2021.18.1 (shared memory) the receive was given up on unfinished in 19 of 20 runs
(about a third of the message moved), and with ``--drop`` rank 0 died of a
segmentation fault in 7 of 10 (in a later call into MPI: MPI went on writing the
message into memory that was gone). That is the crash once seen in a communicator's
first collective after the size-mismatch tests. Kept: 0 of 10. MPICH 5.0.2 had moved
the whole message by then, so it wrote nothing later.
"""

import argparse
import gc

import numpy as np
from mpi4py import MPI


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drop", action="store_true", help="drop the request and its buffer")
    parser.add_argument("--bytes", type=int, default=4 << 20)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    kept = []
    if comm.rank == 0:
        buffer = np.zeros(args.bytes, np.uint8)
        request = comm.Irecv(buffer, source=1)
        comm.Barrier()  # rank 1's send is posted; the barrier's progress starts moving it
        finished = request.Get_status()
        moved = int(np.count_nonzero(buffer))
        if not finished:
            request.Cancel()
        if not args.drop:
            kept.append(request)  # the request holds its buffer
        del request, buffer
        gc.collect()
        print(f"{MPI.Get_library_version().splitlines()[0].strip()}: {moved} of {args.bytes} B moved when given up on"
              f"{' (finished)' if finished else ''}; {'dropped' if args.drop else 'kept'}", flush=True)
        comm.Barrier()  # more progress: where the rest of the message goes
        print("rank 0 went on into MPI and is alive", flush=True)
    else:
        data = np.ones(args.bytes, np.uint8)
        kept.append(comm.Isend(data, dest=0))
        comm.Barrier()
        comm.Barrier()
    comm.Barrier()


if __name__ == "__main__":
    main()
