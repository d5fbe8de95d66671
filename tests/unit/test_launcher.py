"""``collectives.launcher``: LOCAL_RANK and LOCAL_WORLD_SIZE from each launcher's own
variables, never over what is set, and 0 of 1 for a process started alone. (Under a
real mpiexec: tests/mpi/test_launcher.py.)"""

import os
import subprocess
import sys

import pytest

from collectives import launcher

pytestmark = pytest.mark.serial

HYDRA = {"MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"}
OPEN_MPI = {"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}


@pytest.mark.parametrize("variables,want", [(HYDRA, (2, 4)), (OPEN_MPI, (1, 3)), ({}, None),
                                            ({"MPI_LOCALRANKID": "0"}, None)])
def test_each_launchers_variables_give_the_local_rank_and_count(variables, want):
    assert launcher.local_ranks(dict(variables)) == want


def test_exported_where_unset_and_never_over_what_is_set():
    environ = dict(HYDRA)
    assert launcher.export_local_ranks(environ)
    assert (environ["LOCAL_RANK"], environ["LOCAL_WORLD_SIZE"]) == ("2", "4")
    environ = dict(OPEN_MPI, LOCAL_RANK="0")  # torchrun's, or the user's: kept
    launcher.export_local_ranks(environ)
    assert (environ["LOCAL_RANK"], environ["LOCAL_WORLD_SIZE"]) == ("0", "3")
    environ = {}
    assert not launcher.export_local_ranks(environ) and environ == {}


@pytest.mark.parametrize("variables,named", [
    ({"MPI_LOCALRANKID": "x", "MPI_LOCALNRANKS": "4"}, "MPI_LOCALRANKID='x'"),
    ({"MPI_LOCALRANKID": "4", "MPI_LOCALNRANKS": "4"}, "MPI_LOCALRANKID=4"),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "-1"}, "OMPI_COMM_WORLD_LOCAL_SIZE='-1'"),
])
def test_variables_that_make_no_sense_are_named_and_set_nothing(variables, named):
    with pytest.raises(ValueError, match=named):
        launcher.local_ranks(dict(variables))
    environ = dict(variables)
    with pytest.warns(UserWarning, match=named):
        assert not launcher.export_local_ranks(environ)
    assert "LOCAL_RANK" not in environ and "LOCAL_WORLD_SIZE" not in environ


def test_a_process_started_alone_is_local_rank_0_of_1_and_a_larger_world_is_left_alone():
    environ = {}
    launcher.export_single_process(1, environ)
    assert environ == {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    environ = {}
    launcher.export_single_process(4, environ)
    assert environ == {}


def test_import_collectives_sets_them_in_a_process_started_alone():
    environ = {k: v for k, v in os.environ.items()
               if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", *HYDRA, *OPEN_MPI) and not k.startswith("PMI")}
    code = "import os, collectives; print(os.environ['LOCAL_RANK'], os.environ['LOCAL_WORLD_SIZE'])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1"]
