"""``collectives-run``: the mpiexec line it builds for each MPI family (what ``--dry-run``
prints), the errors that name the argument, and a real job on the MPI the suite runs on
(MPICH, Open MPI): every rank gets the variables, the job's status comes back."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from collectives.tools import run

pytestmark = pytest.mark.serial

RUN = [sys.executable, "-m", "collectives.tools.run"]


def dry_run(*argv, capsys):
    assert run.main(["--dry-run", "--mpiexec", "mpiexec", *argv]) == 0
    return shlex.split(capsys.readouterr().out)


def test_each_familys_line_for_hosts_and_variables(capsys):
    args = ("-np", "3", "-H", "a:2,b:2", "-x", "A=1", "--check", "--timeout", "60", "python", "t.py", "--lr", "1")
    assert dry_run("--family", "mpich", *args, capsys=capsys) == [
        "mpiexec", "-genv", "A", "1", "-genv", "COLLECTIVES_CHECK", "1", "-genv", "COLLECTIVES_TIMEOUT", "60.0",
        "-hosts", "a:2,b:1", "-n", "3", "python", "t.py", "--lr", "1"]
    assert dry_run("--family", "impi", *args, capsys=capsys) == [
        "mpiexec", "-genv", "A", "1", "-genv", "COLLECTIVES_CHECK", "1", "-genv", "COLLECTIVES_TIMEOUT", "60.0",
        "-host", "a", "-n", "2", "python", "t.py", "--lr", "1", ":",
        "-host", "b", "-n", "1", "python", "t.py", "--lr", "1"]
    line = dry_run("--family", "openmpi", *args, capsys=capsys)
    line = [a for a in line if a != "--allow-run-as-root"]  # as root only
    assert line == ["mpiexec", "-n", "3", "-H", "a:2,b:1", "-x", "A=1", "-x", "COLLECTIVES_CHECK=1",
                    "-x", "COLLECTIVES_TIMEOUT=60.0", "python", "t.py", "--lr", "1"]


def test_without_hosts_this_machine_and_open_mpi_oversubscribes_past_its_cores():
    job = run.Job(8, ("python", "t.py"))
    assert run.command_line(job, "mpich") == ["mpiexec", "-n", "8", "python", "t.py"]
    assert run.command_line(job, "impi") == ["mpiexec", "-n", "8", "python", "t.py"]
    assert run.command_line(job, "openmpi", cores=2, root=False) == \
        ["mpiexec", "--oversubscribe", "-n", "8", "python", "t.py"]
    assert run.command_line(job, "openmpi", cores=8, root=True) == \
        ["mpiexec", "--allow-run-as-root", "-n", "8", "python", "t.py"]
    assert run.command_line(job, "mpich", launcher_args=["-bind-to", "core"])[:3] == ["mpiexec", "-bind-to", "core"]


def test_a_hostfile_in_each_form_and_np_from_its_slots(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the nodes\na slots=2\nb:3   # a comment\n\nc\n")
    assert run.read_hostfile(hostfile) == (("a", 2), ("b", 3), ("c", 1))
    line = dry_run("--family", "mpich", "--hostfile", str(hostfile), "python", "t.py", capsys=capsys)
    assert line == ["mpiexec", "-hosts", "a:2,b:3,c:1", "-n", "6", "python", "t.py"]


@pytest.mark.parametrize("argv,named", [
    (["-np", "5", "-H", "a:2,b:2", "python"], "-np 5 is more than the hosts' 4 slots"),
    (["-np", "0", "python"], "-np must be at least 1"),
    (["python"], "-np: give the number of ranks"),
    (["-np", "2", "-H", "a:0", "python"], "-H: 'a:0'"),
    (["-np", "2", "-H", "a:x", "python"], "-H: 'a:x'"),
    (["-np", "2", "-x", "COLLECTIVES_TEST_UNSET_VARIABLE", "python"], "-x COLLECTIVES_TEST_UNSET_VARIABLE: not set"),
    (["-np", "2", "-x", "1BAD=2", "python"], "-x '1BAD=2': not a variable name"),
    (["-np", "2", "--timeout", "0", "python"], "--timeout must be a positive number"),
    (["-np", "2"], "give the command to run"),
])
def test_bad_arguments_are_named_and_nothing_runs(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        run.main(["--family", "mpich", "--dry-run", *argv])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert named in captured.err and captured.out == ""


def test_a_bad_hostfile_line_is_named(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=two\n")
    with pytest.raises(ValueError, match="line 2: 'b slots=two'"):
        run.read_hostfile(hostfile)


JOB = """
import os, sys
import numpy as np
import collectives as cc
from mpi4py import MPI
comm = cc.Communicator()
total = comm.allreduce(np.array([comm.rank], np.int64), algorithm="ring")[0]
seen = (os.environ.get("GREETING"), os.environ.get("COLLECTIVES_CHECK"), os.environ.get("COLLECTIVES_TIMEOUT"))
line = " ".join(map(str, ("RANK", comm.rank, comm.size, total, *seen, comm.check, comm.timeout)))
lines = MPI.COMM_WORLD.gather(line)  # printed by rank 0 alone: the ranks' own prints may interleave
if comm.rank == 0:
    print("\\n".join(lines), flush=True)
sys.exit(int(sys.argv[1]) if comm.rank == 1 else 0)
"""


def start(tmp_path, status):
    import launch  # tests/harness/launch.py: an outer job's variables left out

    script = Path(tmp_path) / "job.py"
    script.write_text(JOB)
    argv = [*RUN, "-np", "2", "-x", "GREETING=hello", "--check", "--timeout", "30", sys.executable, str(script),
            str(status)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=launch.environment())


def test_a_job_runs_on_the_installed_mpi_with_every_ranks_variables(tmp_path):
    done = start(tmp_path, 0)
    assert done.returncode == 0, done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("RANK"))
    assert lines == [f"RANK {r} 2 1 hello 1 30.0 True 30.0" for r in range(2)], done.stdout + done.stderr


def test_the_jobs_failure_is_collectives_runs_exit_status(tmp_path):
    done = start(tmp_path, 3)
    assert done.returncode != 0, done.stdout
