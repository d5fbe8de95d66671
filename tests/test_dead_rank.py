"""A rank that dies never hangs the job: survivors raise CollectiveTimeoutError naming
it within timeout + 1 s, and the job exits non-zero (tests/harness/dead_rank_job.py).

Runs once, serially: it launches its own ``mpiexec -n 4``. MPICH's launcher (hydra)
tears the whole job down the moment a rank dies, before anyone could time out; the
test passes ``-disable-auto-cleanup`` so that the survivors are left running, which
is what happens when a launcher does not notice (a hung rank, a lost node).
"""

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.serial

TIMEOUT = 3.0
RANKS = 4
HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness")


def mpiexec():
    path = os.environ.get("MPIEXEC") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    if "HYDRA" not in version:
        pytest.skip(f"{path} is not MPICH's hydra: the flag that keeps survivors running differs")
    return path


# A ring allreduce of 4096 float32s: 4 KiB messages, which MPICH sends eagerly, so
# nothing tells MPI that the peer died and the timeout must. (With large messages MPICH
# copies straight from the sender's memory, may see it gone first and raise
# TransportError naming it, or abort the job itself: not deterministic enough to test.)
COUNT = 4096


def run_job(outdir, algorithm):
    """Launch the job once; returns (exit status, seconds, stderr)."""
    command = [mpiexec(), "-disable-auto-cleanup", "-n", str(RANKS), sys.executable, "-m", "mpi4py",
               os.path.join(HERE, "dead_rank_job.py"), str(outdir), str(TIMEOUT), str(COUNT), algorithm]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "MPIR_", "HYDRA_"))}
    start = time.monotonic()
    job = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    return job.returncode, time.monotonic() - start, job.stderr


# ring: the survivors wait for its messages; shm: for its counter in the shared window,
# which it left at the call's first fence (its memory stays mapped by the others).
@pytest.mark.parametrize("algorithm", ["ring", "shm"])
def test_survivors_raise_naming_the_dead_rank_and_the_job_exits_nonzero(tmp_path, algorithm):
    dead = RANKS - 1
    # Despite -disable-auto-cleanup, hydra now and then (about 1 run in 8 here) kills
    # every survivor within a second of the death, before any could time out: such a
    # run ends non-zero with no report and says nothing about the library, so it is
    # run again, at most 5 times in all (a CI run on 2026-11-25 lost 3 in a row, with
    # ring, which passed 12 runs out of 12 on the same machine right after).
    for attempt in range(5):
        outdir = tmp_path / f"attempt-{attempt}"
        outdir.mkdir()
        returncode, took, stderr = run_job(outdir, algorithm)
        assert returncode != 0, f"the job exited 0 after losing a rank:\n{stderr}"
        reports = sorted(outdir.glob("rank-*.json"))
        if reports or took >= TIMEOUT:
            break
    # The survivors re-raise TIMEOUT + 1.5 s after the call started; the first MPI_Abort
    # then ends the job (the killed rank alone would already make hydra's exit non-zero,
    # so it is the prompt end that shows the survivors do not hang).
    assert took < TIMEOUT + 15, f"the job took {took:.0f} s to end"
    if algorithm == "shm" and not any(outdir.glob("rank-*.json")):
        # What happens here with MPICH 5.0.2's hydra: while the survivors wait at a fence,
        # their first look for probes (an MPI_Iprobe on the liveness communicator, 20 ms
        # in) is followed within milliseconds by hydra killing them (SIGKILL, no message),
        # -disable-auto-cleanup notwithstanding; with ring it is not. Plain mpi4py does the
        # same (Dup, Barrier, a rank kills itself, the others' first Iprobe: all killed),
        # so it is the MPI library's and launcher's doing. The job still ends
        # at once, non-zero, and nobody hangs: the test holds the library to that, and
        # to the report below wherever a survivor lived to write one.
        assert took < TIMEOUT, f"the survivors were not ended by the launcher, yet left no report: {stderr[-2000:]}"
        return
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
