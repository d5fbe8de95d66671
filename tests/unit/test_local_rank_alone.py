"""``collectives.launcher`` in a process started alone: it sets nothing, so a driver
that imports collectives and launches jobs hands its ranks no LOCAL_RANK. (Under
mpiexec, against the node split: tests/mpi/test_local_rank.py.)"""

import os
import subprocess
import sys

import pytest
from mpi4py import MPI

from collectives import launcher

pytestmark = pytest.mark.serial


def test_a_world_of_one_sets_nothing():
    environ = {}
    launcher.export_local_ranks(MPI.COMM_SELF, environ)
    assert environ == {}


def test_import_collectives_sets_nothing_in_a_process_started_alone():
    environ = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    code = "import os, collectives; print(os.environ.get('LOCAL_RANK'), os.environ.get('LOCAL_WORLD_SIZE'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "None"]


def test_import_collectives_leaves_mpi_alone_where_the_program_initialises_it():
    code = ("import mpi4py; mpi4py.rc.initialize = False\n"
            "import os, collectives\n"
            "from mpi4py import MPI\n"
            "print(MPI.Is_initialized(), os.environ.get('LOCAL_RANK'))")
    environ = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "None"]
