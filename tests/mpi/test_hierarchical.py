"""The node layout (``comm.topology``) and the two-level algorithms over real MPI
messages, at every layout a world size allows: node by node, uneven, interleaved.

One machine is one node to MPI, so the layouts here are given with ``nodes=``: the
schedules are the ones a real cluster runs (``make test-multihost`` runs them across
real links too); only the wires differ. Results are checked against the MPI library's
own collective and NumPy, as in ``test_collectives.py``.
"""

import json

import numpy as np
import pytest
from mpi4py import MPI
from test_collectives import run_and_compare

import collectives as cc
from collectives.auto import fingerprint
from collectives.auto import table as auto_table
from collectives.topology import Topology

from conftest import agree, counts_for, ops_for

TWO_LEVEL = [(c, a) for c in cc.COLLECTIVES for a in cc.algorithms(c) if a.startswith("hierarchical")]


def layouts(size):
    """Name -> per-rank node labels: every even split, one uneven, one interleaved."""
    found = {f"{-(-size // k)}x{k}": [r // k for r in range(size)] for k in range(1, size + 1)}
    if size >= 3:
        found["uneven"] = [0] * (size - 1) + [1]
        found["interleaved"] = [r % 2 for r in range(size)]
    return found


_COMMS = {}


def comm_with(mpi_comm, name):
    """A communicator that sees layout ``name`` (made once per layout: it is collective)."""
    if name not in _COMMS:
        _COMMS[name] = cc.Communicator(mpi_comm, nodes=layouts(mpi_comm.Get_size())[name])
    return _COMMS[name]


def test_topology_is_what_mpi_says(comm, mpi_comm):
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
    try:
        mine = node.allgather(mpi_comm.Get_rank())
    finally:
        node.Free()
    topology = comm.topology
    assert topology.size == comm.size
    assert topology.nodes[topology.node_of[comm.rank]] == tuple(mine)
    assert topology.local_rank[comm.rank] == mine.index(comm.rank)
    assert mpi_comm.allgather(topology) == [topology] * comm.size


@pytest.mark.parametrize("collective,algorithm", TWO_LEVEL)
def test_two_level_algorithms_at_every_layout(mpi_comm, collective, algorithm):
    problems = []
    for name in layouts(mpi_comm.Get_size()):
        comm = comm_with(mpi_comm, name)
        roots = range(comm.size) if collective == "broadcast" else [0]
        for count in counts_for(comm.size, large=False) + [4099]:
            for root in roots:
                run_and_compare(comm, mpi_comm, collective, algorithm, "float32", "sum", count, root, None, problems)
    agree(mpi_comm, [f"{p}" for p in problems])


def test_two_level_allreduce_in_pieces_at_every_layout(mpi_comm, monkeypatch):
    """Large buffers go through the two-level allreduce in pieces (pipelined): with the
    piece size made small, every layout's result equals MPI's and NumPy's, in and out of
    place, for every count around the piece boundaries."""
    from collectives.algorithms import hierarchical

    monkeypatch.setattr(hierarchical, "PIPELINE_MIN", 5)
    problems = []
    for name in layouts(mpi_comm.Get_size()):
        comm = cc.Communicator(mpi_comm, nodes=layouts(mpi_comm.Get_size())[name])  # plans made under the patch
        for count in (9, 10, 21, 5 * 4 * comm.size + 3):
            for dtype, op in (("float64", "sum"), ("int32", "max")):
                run_and_compare(comm, mpi_comm, "allreduce", "hierarchical", dtype, op, count, 0, None, problems)
        x = np.arange(103, dtype=np.float64) * (comm.rank + 1)
        comm.allreduce(x, algorithm="hierarchical", out=x)
        if not np.array_equal(x, np.arange(103) * comm.size * (comm.size + 1) / 2):
            problems.append(f"{name}: in place")
        comm.free()
    agree(mpi_comm, problems)


@pytest.mark.parametrize("collective,algorithm", [ca for ca in TWO_LEVEL if ca[0] != "broadcast" and
                                                  ca[0] != "allgather"])
@pytest.mark.parametrize("dtype", ["int32", "float64", "complex64", "uint8"])
def test_two_level_reductions_every_op(mpi_comm, collective, algorithm, dtype):
    problems = []
    for name in ("uneven", "interleaved") if mpi_comm.Get_size() >= 3 else layouts(mpi_comm.Get_size()):
        comm = comm_with(mpi_comm, name)
        for op in ops_for(dtype):
            run_and_compare(comm, mpi_comm, collective, algorithm, dtype, op, 2 * comm.size + 3, 0, None, problems)
    agree(mpi_comm, problems)


@pytest.mark.parametrize("algorithm", ["hierarchical", "hierarchical_leader"])
def test_two_level_allreduce_in_place_and_non_contiguous(mpi_comm, algorithm):
    problems = []
    size = mpi_comm.Get_size()
    for name in layouts(size):
        comm = comm_with(mpi_comm, name)
        base = np.arange(2 * 37 * 3, dtype=np.int64).reshape(2 * 37, 3) * (comm.rank + 1)
        x = base[::2, 1]  # strided
        want = x * sum(range(1, size + 1)) // (comm.rank + 1)
        got = comm.allreduce(x, algorithm=algorithm)
        if not np.array_equal(got, want):
            problems.append(f"{name}: strided input")
        y = x.copy()
        if comm.allreduce(y, algorithm=algorithm, out=y) is not y or not np.array_equal(y, want):
            problems.append(f"{name}: in place")
    agree(mpi_comm, problems)


def test_auto_picks_two_level_algorithms_on_several_nodes(mpi_comm, monkeypatch):
    """With COLLECTIVES_AUTO_RULE=cost-model; by default, with no table for the layout,
    the conservative rule keeps native (ranks node by node: flat MPI schedules cross
    the network little, test_tuning_rules.py)."""
    size = mpi_comm.Get_size()
    if size == 1:
        comm = comm_with(mpi_comm, "1x1")
        assert comm.choose("allreduce", 1 << 20)[0] != "hierarchical"
        return
    name = f"{-(-size // 2)}x2" if size > 2 else "1x2"
    monkeypatch.setenv("COLLECTIVES_AUTO_RULE", "cost-model")
    comm = cc.Communicator(mpi_comm, nodes=layouts(size)[name])
    monkeypatch.delenv("COLLECTIVES_AUTO_RULE")
    plain = cc.Communicator(mpi_comm, nodes=layouts(size)[name])
    try:
        several = comm.topology.node_count > 1 and max(comm.topology.ranks_per_node) > 1
        choice, why = comm.choose("allreduce", 1 << 20)
        if several:
            assert choice == "hierarchical" and comm.topology.describe() in why
            assert comm.choose("allreduce", 16 << 10)[0] == "hierarchical_leader"
            assert comm.choose("allgather", 1 << 20)[0] == "hierarchical"
            default, why = plain.choose("allreduce", 1 << 20)
            assert default == "native" and why.startswith("conservative rule:"), why
        else:  # one node: the packaged single-node table or the flat rule
            assert not choice.startswith("hierarchical")
    finally:
        comm.free()
        plain.free()


def test_a_layout_table_is_used_only_for_its_layout(mpi_comm, tmp_path, monkeypatch):
    size = mpi_comm.Get_size()
    if size < 4:
        pytest.skip("needs a layout of 2 nodes x 2 or more")
    k = size // 2
    labels = [min(r // k, 1) for r in range(size)]
    key = Topology.from_labels(labels).key()
    path = tmp_path / f"tuning-{mpi_comm.Get_rank()}.json"
    path.write_text('{"format": 1, "tables": {"allreduce": {"%s": [[0, "ring"]], "%d": [[0, "direct"]]}}}'
                    % (key, size))
    monkeypatch.setenv("COLLECTIVES_TUNING", str(path))
    several = cc.Communicator(mpi_comm, nodes=labels)
    one = cc.Communicator(mpi_comm, nodes=[0] * size)
    try:
        assert several.choose("allreduce", 1 << 20) == ("ring", f"measured table {path} (layout {key})")
        assert one.choose("allreduce", 1 << 20) == ("direct", f"measured table {path}")
    finally:
        several.free()
        one.free()


def test_a_layout_table_is_used_only_over_its_link(mpi_comm, tmp_path, monkeypatch):
    # The entry holds the link --tune measured; the job measures its own between the
    # declared nodes (here over shared memory), every rank the same rate.
    size = mpi_comm.Get_size()
    if size < 2:
        pytest.skip("needs two nodes")
    labels = [r * 2 // size for r in range(size)]
    topology = Topology.from_labels(labels)
    key = topology.key()
    path = tmp_path / f"tuning-{mpi_comm.Get_rank()}.json"
    path.write_text(json.dumps({"format": 1, "tables": {"allreduce": {key: [[0, "ring"]]}},
                                "measured": {key: {"fingerprint": {**fingerprint(topology),
                                                                   "link_MBps": 0.001}}}}))
    monkeypatch.setenv("COLLECTIVES_TUNING", str(path))
    problems = []
    slow = cc.Communicator(mpi_comm, nodes=labels)
    choice, why = slow.choose("allreduce", 1 << 20)
    rates = mpi_comm.allgather(slow._ctx.selector.link)
    slow.free()
    if choice == "ring" or f"{path} was measured over a 0.001 MB/s link; this job's measures" not in why:
        problems.append(f"a 0.001 MB/s table: {choice}, {why}")
    if not (rates[0] > 0 and len(set(rates)) == 1):
        problems.append(f"measured rates {rates}")
    monkeypatch.setattr(auto_table, "LINK_TOLERANCE", float("inf"))  # any link counts: the table is used
    anything = cc.Communicator(mpi_comm, nodes=labels)
    got = anything.choose("allreduce", 1 << 20)
    anything.free()
    if got != ("ring", f"measured table {path} (layout {key})"):
        problems.append(f"any link: {got}")
    agree(mpi_comm, problems)


def test_nodes_must_be_one_label_per_rank_and_the_same_everywhere(mpi_comm):
    size = mpi_comm.Get_size()
    with pytest.raises(ValueError, match=f"nodes has {size + 1} labels for {size} ranks"):
        cc.Communicator(mpi_comm, nodes=list(range(size + 1)))
    if size > 1:
        with pytest.raises(ValueError, match="nodes must be the same on every rank"):
            cc.Communicator(mpi_comm, nodes=[mpi_comm.Get_rank()] * size)
    comm = cc.Communicator(mpi_comm, nodes=[r % 2 for r in range(size)])
    try:
        assert comm.topology == Topology.from_labels([r % 2 for r in range(size)])
        assert comm.dup().topology == comm.topology
    finally:
        comm.free()


def test_topology_helpers():
    t = Topology.from_labels(["b", "a", "b", "c", "a"])
    assert t.nodes == ((0, 2), (1, 4), (3,))
    assert t.node_of == (0, 1, 0, 2, 1) and t.local_rank == (0, 0, 1, 0, 1)
    assert t.ranks_per_node == (2, 2, 1) and not t.contiguous
    assert t.key() == "2+2+1" and t.describe() == "3 nodes (2+2+1 ranks)"
    u = Topology.uniform(8, 4)
    assert u.nodes == ((0, 1, 2, 3), (4, 5, 6, 7)) and u.contiguous and u.key() == "2x4"
    assert Topology.single(3).describe() == "1 node x 3 ranks"
    with pytest.raises(ValueError, match="nodes must split ranks"):
        Topology(((0, 1), (1, 2)))
    with pytest.raises(ValueError, match="ranks_per_node must be a positive integer"):
        Topology.uniform(4, 0)


@pytest.mark.serial
def test_the_cross_node_groups_hold_one_rank_of_each_local_rank_per_node():
    shuffled = Topology.from_labels([1, 0, 0, 1, 1, 0, 2, 2])  # nodes (0, 3, 4), (1, 2, 5), (6, 7)
    assert shuffled.nodes == ((0, 3, 4), (1, 2, 5), (6, 7))
    assert shuffled.across == ((0, 1, 6), (3, 2, 7))  # local ranks 0 and 1; local rank 2 is not on every node
    assert Topology.uniform(8, 4).across == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert Topology.single(3).across == ((0,), (1,), (2,))
