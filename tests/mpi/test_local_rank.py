"""Under mpiexec (every MPI family the suite runs on), ``import collectives`` has set
torch's LOCAL_RANK and LOCAL_WORLD_SIZE to MPI's node split, and never overwrites what
is set; alone, it sets nothing. (tests/unit/test_local_rank_alone.py: a process started alone.)"""

import os

import pytest
from mpi4py import MPI

from collectives import launcher


def node_split():
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return str(node.Get_rank()), str(node.Get_size())
    finally:
        node.Free()


def test_local_rank_and_world_size_are_the_node_splits():
    want = node_split() if MPI.COMM_WORLD.Get_size() > 1 else (None, None)  # alone: nothing set
    assert (os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")) == want


def test_what_is_set_stays_on_the_ranks_that_set_it():
    """Set on rank 0 only: every rank still takes part in the split (nothing hangs),
    rank 0 keeps its value, the others get the split's."""
    if MPI.COMM_WORLD.Get_size() == 1:
        pytest.skip("a world of one sets nothing (tests/unit/test_local_rank_alone.py)")
    environ = {"LOCAL_RANK": "7"} if MPI.COMM_WORLD.Get_rank() == 0 else {}
    launcher.export_local_ranks(environ=environ)
    rank, size = node_split()
    assert environ == {"LOCAL_RANK": "7" if MPI.COMM_WORLD.Get_rank() == 0 else rank, "LOCAL_WORLD_SIZE": size}
