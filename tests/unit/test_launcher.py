"""``collectives.launcher`` in a process started alone: LOCAL_RANK 0 of 1, never over
what is set. (Under mpiexec, against the node split: tests/mpi/test_launcher.py.)"""

import os
import subprocess
import sys

import pytest
from mpi4py import MPI

from collectives import launcher

pytestmark = pytest.mark.serial


def test_a_world_of_one_is_local_rank_0_of_1_and_what_is_set_stays():
    environ = {}
    launcher.export_local_ranks(MPI.COMM_SELF, environ)
    assert environ == {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    environ = {"LOCAL_RANK": "3"}  # torchrun's, or the user's
    launcher.export_local_ranks(MPI.COMM_SELF, environ)
    assert environ == {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "1"}


def test_import_collectives_sets_them_in_a_process_started_alone():
    environ = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    code = "import os, collectives; print(os.environ['LOCAL_RANK'], os.environ['LOCAL_WORLD_SIZE'])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1"]
