"""The job test_dead_rank.py launches: the last rank kills itself (SIGKILL), or stops
itself (SIGSTOP: a hung rank, which no launcher notices), in the middle of an
allreduce of COUNT float32s (ALGORITHM: ring, whose messages go through MPI, or shm,
whose ranks wait on each other's counters in shared memory); every survivor must
raise, naming it, within timeout + 1 s, and the job must end with a non-zero exit. The
doomed rank writes the time it dies at to OUTDIR/died-at.txt.

    mpiexec -disable-auto-cleanup -n 4 python -m mpi4py tests/harness/dead_rank_job.py OUTDIR TIMEOUT COUNT \
        [ALGORITHM [kill|stop]]

(tests/harness/launch.py gives each launcher's flag that leaves survivors running.)

Run under ``python -m mpi4py`` as users should: an uncaught exception then aborts the
job (MPI_Abort) instead of leaving it waiting in MPI_Finalize. Each survivor writes
what it raised and when to OUTDIR/rank-R.json, and re-raises only once every
survivor has had time to time out by itself (the first MPI_Abort ends the whole job).
Under MPICH's launcher a survivor's output may not reach the terminal once a rank has
died, hence the files.
"""

import json
import os
import signal
import sys
import time

import numpy as np

import collectives as cc

outdir, timeout, count = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
algorithm = sys.argv[4] if len(sys.argv) > 4 else "ring"
how = sys.argv[5] if len(sys.argv) > 5 else "kill"
from mpi4py import MPI  # noqa: E402

# MPICH's hydra, told to keep the survivors (-disable-auto-cleanup), sends SIGUSR1 to every
# remaining rank a few milliseconds after any rank exits (its notice of a failed process);
# a process with no handler for it dies. The survivors must live to time out, so this job
# ignores it, as a program that keeps running after a failure must.
signal.signal(signal.SIGUSR1, signal.SIG_IGN)

# Each rank's stderr to a file: once a rank has died the launcher may stop forwarding it.
_stderr = open(os.path.join(outdir, f"stderr-{MPI.COMM_WORLD.Get_rank()}.txt"), "w")
os.dup2(_stderr.fileno(), 2)
comm = cc.Communicator(timeout=timeout)
doomed = comm.size - 1
x = np.ones(count, np.float32)
comm.allreduce(x, algorithm=algorithm)  # everyone alive: a warm-up that must succeed
comm.barrier()

if comm.rank == doomed:
    handle = comm.allreduce_async(x, algorithm=algorithm)  # its first sends go out
    handle.test()
    with open(os.path.join(outdir, "died-at.txt"), "w") as f:  # when the job lost it (the clock all ranks share)
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)  # stopped: the launcher's abort kills it

start = time.monotonic()
try:
    comm.allreduce(x, algorithm=algorithm)
    # A survivor may get its whole result before the doomed rank died (its test() can
    # take the call several steps on). It then waits here, inside the library, where it
    # answers the others' probes and times out itself, instead of sleeping below
    # (outside the library, where the others would count it as unresponsive too).
    comm.barrier()
    report = {"raised": None}
except cc.CollectiveError as exc:
    report = {"raised": type(exc).__name__, "message": str(exc)}
    raise
finally:
    report.update(rank=comm.rank, doomed=doomed, seconds=time.monotonic() - start)
    with open(os.path.join(outdir, f"rank-{comm.rank}.json"), "w") as f:
        json.dump(report, f)
    time.sleep(max(0.0, start + timeout + 1.5 - time.monotonic()))  # let the other survivors raise too
