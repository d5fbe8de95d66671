"""What an MPI library does with a message longer than its receive (measured for
collectives.transport.tags): rank 0 sends, rank 1 receives into the first bytes of a
buffer followed by 1 MiB of zeros, by Irecv, Recv and a persistent receive, for a few
sizes; rank 1 prints MPI's error, the count it reports and how many bytes past the
receive changed.

    mpiexec -n 2 python tests/harness/truncation.py

Open MPI 5.0.11: MPI_ERR_TRUNCATE after writing 96 B past a 4000 B receive for 4096 B
sent, 536 B past 65 000 B for 65 536 B (then the heap is corrupted); MPICH 5.0.2 and
Intel MPI 2021.18: the error, nothing written past the receive.
"""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD.Dup()
rank = comm.Get_rank()
GUARD = 1 << 20
for sent, received in [(4096, 4000), (4001, 4000), (300, 200), (16384, 16000), (65536, 65000)]:
    for mode in ("irecv", "recv", "persistent"):
        comm.Barrier()
        if rank == 0:
            comm.Send(np.ones(sent, np.uint8), 1, 5)
        elif rank == 1:
            buffer = np.zeros(received + GUARD, np.uint8)
            view, status, error = buffer[:received], MPI.Status(), None
            try:
                if mode == "irecv":
                    comm.Irecv([view, MPI.BYTE], 0, 5).Wait(status)
                elif mode == "recv":
                    comm.Recv([view, MPI.BYTE], 0, 5, status)
                else:
                    request = comm.Recv_init([view, MPI.BYTE], 0, 5)
                    request.Start()
                    request.Wait(status)
            except MPI.Exception as exc:
                error = exc.Get_error_string().splitlines()[0][:60]
            past = int(np.count_nonzero(buffer[received:]))
            print(f"{mode:10s} {sent} B sent into {received} B: error {error}; count {status.Get_count(MPI.BYTE)}; "
                  f"{past} B written past the receive", flush=True)
