"""A rank that dies or hangs never hangs the job: survivors raise CollectiveTimeoutError
naming it within timeout + 1 s, and the job exits non-zero (tests/harness/dead_rank_job.py).

Runs once, serially: it launches its own ``mpiexec -n 4`` through tests/harness/launch.py,
under whichever MPI the suite runs on (MPICH, Open MPI, Intel MPI). What the launchers
do when a rank dies, measured here with the job below: each ends the whole job within
a second or two (SIGKILL to every survivor) unless told not to (launch.py's
keep-survivors flag: hydra's ``-disable-auto-cleanup``, Open MPI's
``--enable-recovery``); so

- a rank that *hangs* (SIGSTOP: no launcher notices) is the deterministic test, on
  every launcher: the survivors must raise on their own;
- a rank that is *killed* is tested with the flag, every run held to everything. Two
  things hydra does with the flag all the same are kept out of the way: it sends
  SIGUSR1 to every survivor when a rank's PMI connection closes (the job ignores it),
  and SIGKILL to every rank when it reaps a rank that a signal ended (under hydra the
  doomed rank runs under a shell, whose exit is a code: see ``run_job``).
- without the flag, every launcher ends the job promptly and non-zero: tested too.
"""

import json
import sys
import time

import launch
import pytest

from conftest import HARNESS

pytestmark = pytest.mark.serial

TIMEOUT = 3.0
RANKS = 4
JOB = str(HARNESS / "dead_rank_job.py")

# A ring allreduce of 4096 float32s: 4 KiB messages, which MPI sends eagerly, so
# nothing tells MPI that the peer died and the timeout must. (With large messages MPI
# copies straight from the sender's memory, may see it gone first and raise
# TransportError naming it, or abort the job itself: not deterministic enough to test.)
COUNT = 4096


def run_job(outdir, algorithm, how, keep_survivors=True):
    """Launch the job once; returns (exit status, seconds from the rank's death to the
    job's end, the launcher's stderr). Counted from the death, not the launch: starting
    four processes takes seconds more on a busy machine, and says nothing of how
    promptly a job ends once a rank is lost.

    With ``keep_survivors``, under hydra (MPICH, Intel MPI), the doomed last rank runs
    under a shell that outlives it and exits with its status as a code (137 after
    SIGKILL). Hydra's proxy, whatever its flags, sends SIGKILL to every rank when it
    reaps a child that a signal ended (about half the runs here, by the order in which
    it sees the death's events), which would end the survivors before they time out.
    The survivors see the same death either way: the rank's process is gone in the
    middle of the call. (Open MPI's launcher keeps the survivors with its flag, and
    with such a shell would not end the job once they abort.)"""
    argv = [sys.executable, "-m", "mpi4py", JOB, outdir, TIMEOUT, COUNT, algorithm, how]
    if keep_survivors and launch.kind() in ("mpich", "impi"):
        parts = [(RANKS - 1, None, argv), (1, None, ["sh", "-c", '"$@"; exit $?', "sh", *argv])]
    else:
        parts = [(RANKS, None, argv)]
    job = launch.run(parts, keep_survivors=keep_survivors, timeout=120, env={"COLLECTIVES_QUIET": "1"})
    ended = time.time()
    died_at = outdir / "died-at.txt"
    assert died_at.exists(), f"the doomed rank never reached its death (exit {job.returncode}): {job.stderr[-2000:]}"
    return job.returncode, ended - float(died_at.read_text()), job.stderr


def check_reports(outdir, algorithm, stderr):
    dead = RANKS - 1
    for rank in range(dead):
        path = outdir / f"rank-{rank}.json"
        assert path.exists(), f"rank {rank} left no report (killed, or still waiting?): {stderr[-2000:]}\n" \
                              + (outdir / f"stderr-{rank}.txt").read_text()[-2000:]
        report = json.loads(path.read_text())
        assert report["raised"] == "CollectiveTimeoutError", report
        assert f"no answer within 0.5 s from rank {dead}" in report["message"], report["message"]
        if algorithm == "shm" and "barrier call #" not in report["message"]:
            # Raised inside the shm allreduce: it names what it waited for. (A survivor whose
            # allreduce finished before the death, its last peer's part done in that rank's
            # test(), times out in the barrier after it instead: see dead_rank_job.py.)
            assert f"in shared memory for rank {dead} to arrive" in report["message"], report["message"]
        assert report["seconds"] <= TIMEOUT + 1.0, report
    assert not (outdir / f"rank-{dead}.json").exists()


# ring: the survivors wait for its messages; shm: for its counter in the shared window,
# which it left at the call's first fence (its memory stays mapped by the others).
@pytest.mark.parametrize("algorithm", ["ring", "shm"])
def test_survivors_of_a_hung_rank_raise_naming_it_and_the_job_exits_nonzero(tmp_path, algorithm):
    """SIGSTOP: the launcher sees nothing, so this runs alike on every launcher, once."""
    returncode, took, stderr = run_job(tmp_path, algorithm, "stop", keep_survivors=False)
    assert returncode != 0, f"the job exited 0 after a rank hung:\n{stderr}"
    # The survivors re-raise TIMEOUT + 1.5 s after the call started; the first MPI_Abort
    # then ends the job, the stopped rank included.
    assert took < TIMEOUT + 15, f"the job ended {took:.0f} s after the rank hung"
    check_reports(tmp_path, algorithm, stderr)


@pytest.mark.parametrize("algorithm", ["ring", "shm"])
def test_survivors_of_a_killed_rank_raise_naming_it_and_the_job_exits_nonzero(tmp_path, algorithm):
    returncode, took, stderr = run_job(tmp_path, algorithm, "kill")
    assert returncode != 0, f"the job exited 0 after losing a rank:\n{stderr}"
    assert took < TIMEOUT + 15, f"the job ended {took:.0f} s after the rank died"
    check_reports(tmp_path, algorithm, stderr)


def test_without_the_flag_the_launcher_ends_the_job_when_a_rank_dies(tmp_path):
    """What every launcher here does by default: the whole job ends, non-zero, within
    seconds (before any survivor could time out)."""
    returncode, took, stderr = run_job(tmp_path, "ring", "kill", keep_survivors=False)
    assert returncode != 0, f"the job exited 0 after losing a rank:\n{stderr}"
    assert took < TIMEOUT + 15, f"the job ended {took:.0f} s after the rank died"
