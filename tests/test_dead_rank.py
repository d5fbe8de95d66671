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
- a rank that is *killed* is tested with the flag. MPICH's hydra kills the survivors
  all the same in about half the runs here (in every run where they wait in shared
  memory, shm): such a run ends within a second with no survivor's report, which is
  the launcher's doing, so it is run again (at most ``ATTEMPTS`` times). A run in which
  a survivor lived long enough to report is held to everything; so is every run's end
  (non-zero, prompt).
- without the flag, every launcher ends the job promptly and non-zero: tested too.
"""

import json
import os
import sys
import time

import pytest

import launch

pytestmark = pytest.mark.serial

TIMEOUT = 3.0
RANKS = 4
ATTEMPTS = 8  # killed runs that the launcher ended before anyone could time out are run again
JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness", "dead_rank_job.py")

# A ring allreduce of 4096 float32s: 4 KiB messages, which MPI sends eagerly, so
# nothing tells MPI that the peer died and the timeout must. (With large messages MPI
# copies straight from the sender's memory, may see it gone first and raise
# TransportError naming it, or abort the job itself: not deterministic enough to test.)
COUNT = 4096


def run_job(outdir, algorithm, how, keep_survivors=True):
    """Launch the job once; returns (exit status, seconds, the launcher's stderr)."""
    parts = [(RANKS, None, [sys.executable, "-m", "mpi4py", JOB, outdir, TIMEOUT, COUNT, algorithm, how])]
    start = time.monotonic()
    job = launch.run(parts, keep_survivors=keep_survivors, timeout=120, env={"COLLECTIVES_QUIET": "1"})
    return job.returncode, time.monotonic() - start, job.stderr


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
    assert took < TIMEOUT + 15, f"the job took {took:.0f} s to end"
    check_reports(tmp_path, algorithm, stderr)


@pytest.mark.parametrize("algorithm", ["ring", "shm"])
def test_survivors_of_a_killed_rank_raise_naming_it_and_the_job_exits_nonzero(tmp_path, algorithm):
    for attempt in range(ATTEMPTS):
        outdir = tmp_path / f"attempt-{attempt}"
        outdir.mkdir()
        returncode, took, stderr = run_job(outdir, algorithm, "kill")
        assert returncode != 0, f"the job exited 0 after losing a rank:\n{stderr}"
        assert took < TIMEOUT + 15, f"the job took {took:.0f} s to end"
        if any(outdir.glob("rank-*.json")) or took >= TIMEOUT:
            break  # a survivor lived to time out (or should have): held to the reports below
    else:
        # Every run ended before anyone could time out, with no report: the launcher
        # killed the survivors despite its flag (MPICH 5.0.2's hydra always does with
        # shm: while they wait at a fence, their first probe for liveness messages, an
        # MPI_Iprobe 20 ms in, is followed within milliseconds by SIGKILL; plain mpi4py
        # does the same). Nobody hung: that is what can be held to there.
        assert launch.kind() == "hydra", f"{launch.kind()}'s launcher killed the survivors in {ATTEMPTS} runs"
        return
    check_reports(outdir, algorithm, stderr)


def test_without_the_flag_the_launcher_ends_the_job_when_a_rank_dies(tmp_path):
    """What every launcher here does by default: the whole job ends, non-zero, within
    seconds (before any survivor could time out)."""
    returncode, took, stderr = run_job(tmp_path, "ring", "kill", keep_survivors=False)
    assert returncode != 0, f"the job exited 0 after losing a rank:\n{stderr}"
    assert took < TIMEOUT + 15, f"the job took {took:.0f} s to end"
