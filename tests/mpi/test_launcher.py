"""Under mpiexec (every MPI family the suite runs on), ``import collectives`` has set
torch's LOCAL_RANK and LOCAL_WORLD_SIZE, and they agree with MPI's node split. (The
parsing, and a process started alone: tests/unit/test_launcher.py.)"""

import os

from mpi4py import MPI

from collectives import launcher


def test_local_rank_and_world_size_are_the_node_splits():
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        want = (str(node.Get_rank()), str(node.Get_size()))
    finally:
        node.Free()
    assert (os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")) == want
    if MPI.COMM_WORLD.Get_size() > 1:  # started by mpiexec, which says so in its own variables
        assert launcher.local_ranks() == (int(want[0]), int(want[1]))
