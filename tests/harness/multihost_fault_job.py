"""The job tests/tools/test_multihost.py's fault tests launch on the testbed (at layout
HxR, host-major); the test itself, outside the job, cuts or throttles the last host's
link once rank 0 has written OUTDIR/ready.

    python tests/harness/multihost_fault_job.py MODE OUTDIR SECONDS

MODE ``cut``: ring allreduces of 1 MiB with ``timeout=SECONDS``, one after another,
until one raises; each rank writes what it raised, how long after the failing call
started, and when (``time.time()``: one clock, every host is this machine) to
OUTDIR/rank-R.json, then waits (bounded) for the test to end the job: the ranks on
the cut-off host cannot be reached any more, so the job cannot end by itself.

MODE ``mpi``: the same with the MPI library's own ``Allreduce`` (no timeout is
possible): each rank writes the time of each completed call to OUTDIR/rank-R.json,
so the test can see that nothing completes, and nothing raises, after the cut.

MODE ``slow``: ring allreduces of 2 MiB with ``stall_warn=SECONDS`` (and a 60 s
timeout, so that nothing can hang), each checked against the exact sum, until the
test has written OUTDIR/restored and two more calls have run; the stall warnings
(logger ``collectives``) go to OUTDIR/rank-R.json with the results. Exits 0 when
every result was right.
"""

import json
import logging
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import collectives as cc

mode, outdir, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
LIMIT = 60.0  # no mode runs longer than this, whatever happens to the links


def report(**fields):
    path = os.path.join(outdir, f"rank-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(dict(fields, rank=rank), f)
    os.replace(path + ".tmp", path)  # the test never reads half a file


def ready():
    world.Barrier()
    if rank == 0:
        open(os.path.join(outdir, "ready"), "w").close()


def inputs(count):
    """Rank ``rank``'s input and the exact sum over all ranks (small integers)."""
    base = np.arange(count) % 7
    return (base + rank).astype(np.float32), (size * base + size * (size - 1) // 2).astype(np.float32)


if mode == "cut":
    comm = cc.Communicator(timeout=seconds)
    x, _ = inputs(1 << 18)
    comm.allreduce(x, algorithm="ring")
    ready()
    began = time.monotonic()
    calls = 0
    while time.monotonic() - began < LIMIT:
        start = time.monotonic()
        try:
            comm.allreduce(x, algorithm="ring")
        except cc.CollectiveError as exc:
            report(raised=type(exc).__name__, message=str(exc), seconds=time.monotonic() - start,
                   at=time.time(), calls=calls)
            break
        calls += 1
    else:
        report(raised=None, calls=calls)
    time.sleep(LIMIT)  # the test ends the job (the cut-off ranks can never leave MPI_Finalize)

elif mode == "mpi":
    x, _ = inputs(1 << 18)
    y = np.empty_like(x)
    world.Allreduce(x, y)
    ready()
    began = time.monotonic()
    done = []
    while time.monotonic() - began < LIMIT:
        try:
            world.Allreduce(x, y)
        except MPI.Exception as exc:
            report(completed=done[-50:], raised=str(exc), at=time.time())
            break
        done.append(time.time())
        report(completed=done[-50:], raised=None)
    time.sleep(LIMIT)

elif mode == "slow":
    warnings = []

    class Collect(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("collectives").addHandler(Collect(logging.WARNING))
    comm = cc.Communicator(stall_warn=seconds, timeout=LIMIT)
    x, want = inputs(1 << 19)
    comm.allreduce(x, algorithm="ring")
    ready()
    wrong = calls = after = 0
    began = time.monotonic()
    while time.monotonic() - began < LIMIT:
        got = comm.allreduce(x, algorithm="ring")
        wrong += int(not np.array_equal(got, want))
        calls += 1
        restored = np.array([os.path.exists(os.path.join(outdir, "restored"))], np.int32)
        if comm.allreduce(restored, op="max")[0]:  # every rank stops after the same call
            after += 1
            if after >= 2:
                break
    report(calls=calls, wrong=wrong, after=after, warnings=warnings)
    sys.exit(1 if wrong or after < 2 else 0)

else:
    sys.exit(f"unknown mode {mode!r}: cut, mpi or slow")
