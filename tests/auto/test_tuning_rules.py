"""Which tuning table ``auto`` may trust, and what it does without one
(``collectives.tuning``): fingerprints, the collective agreement on them, the
conservative rule's cost model, the one-line hint; and the noise margin with which
``collectives-bench --tune`` lets an algorithm replace ``native``.

Expected values are written here independently: the fingerprint from /proc/cpuinfo
and mpi4py, the model's times from the closed forms of docs/algorithms.md. Tests
marked ``serial`` send no messages; the others run under every world size and agree
on their findings (``agree``) so that no rank is left waiting.
"""

import dataclasses
import json
import math
import os
import platform

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc
import collectives.auto as auto
from collectives.algorithms import BUILDERS
from collectives.auto import Job, Selector, Settings, TuningTable
from collectives.auto import selector as auto_selector
from collectives.auto import table as auto_table
from collectives.tools.bench import timing, tune
from collectives.topology import Topology
from collectives.transport import peer_fences

from conftest import agree

serial = pytest.mark.serial

try:
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    BFLOAT16 = None

# Another machine: what a table measured elsewhere is stamped with.
ELSEWHERE = {"cpu": "Intel(R) Xeon(R) Platinum 8480+", "cpus": 224, "mpi": "Open MPI v4.1.5, package: Open MPI",
             "nodes": 1, "ranks_per_node": 4}
TABLES = {"allreduce": {"4": [[0, "tree"], [4096, "ring"]]}, "broadcast": {"4": [[0, "pipeline"]]}}


@pytest.fixture
def clean_environment(monkeypatch, tmp_path):
    """No packaged table, no overrides, no tuning file, no rule, the hint not yet shown."""
    monkeypatch.setattr(auto_table, "DEFAULT_TABLE", tmp_path / "no-such-default.json")
    for variable in [auto.override_variable(c) for c in BUILDERS] + [
            auto.TUNING_ENV, auto.RULE_ENV, auto.QUIET_ENV]:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(auto_selector, "_hinted", False)


def stamped_file(path, tables=TABLES, stamps=None, device_tables=None):
    """A tuning file whose ``measured`` entries carry ``stamps`` (key -> fingerprint)."""
    data = {"format": 1, "tables": tables,
            "measured": {key: {"dtype": "float32", "fingerprint": stamp} for key, stamp in (stamps or {}).items()}}
    if device_tables is not None:
        data["device_tables"] = device_tables
    path.write_text(json.dumps(data))
    return path


def here(key="4"):
    return auto.fingerprint_for_key(key)


# == fingerprints =======================================================================

@serial
def test_fingerprint_of_this_machine_and_layout():
    want_cpu = None
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.split(":")[0].strip() == "model name":
                want_cpu = " ".join(line.split(":", 1)[1].split())
                break
    if want_cpu is None:
        want_cpu = platform.processor() or platform.machine()
    vendor, version = MPI.get_vendor()  # mpi4py's own reading: "MPICH", (5, 0, 2)
    machine = {"cpu": want_cpu, "cpus": os.cpu_count(), "mpi": f"{vendor} {'.'.join(map(str, version))}"}
    assert auto.fingerprint(world_size=4) == {**machine, "nodes": 1, "ranks_per_node": 4}
    assert auto.fingerprint(Topology.single(3)) == {**machine, "nodes": 1, "ranks_per_node": 3}
    assert auto.fingerprint(Topology.uniform(8, 4)) == {**machine, "nodes": 2, "ranks_per_node": 4}
    uneven = Topology.from_labels([0, 0, 0, 1])
    assert auto.fingerprint(uneven) == {**machine, "nodes": 2, "ranks_per_node": "3+1"}
    # --tune stamps a table's key with the same fingerprint auto computes for that layout
    for key, topology in [("4", Topology.single(4)), ("2x4", Topology.uniform(8, 4)), ("3+1", uneven),
                          ("3x1", Topology.uniform(3, 1))]:
        assert auto.fingerprint_for_key(key) == auto.fingerprint(topology)
    for bad in ("0", "x4", "2x", "four"):
        with pytest.raises(ValueError):
            auto.fingerprint_for_key(bad)
    assert auto.describe_fingerprint({**machine, "mpi": "MPICH Version: 5.0.2", "nodes": 2, "ranks_per_node": 4}) \
        == f"{want_cpu}, {os.cpu_count()} CPUs, MPICH 5.0.2, 2x4"


@serial
def test_the_packaged_table_is_stamped_with_the_machine_it_was_measured_on():
    """collectives/data/tuning.json was measured on the development machine (2 vCPUs of
    an AMD EPYC, MPICH 5.0.2, one node): every entry says so, and a job with that
    fingerprint gets the table's choices while any other machine's job does not,
    whichever machine runs this test."""
    data = json.loads(auto_table.DEFAULT_TABLE.read_text())
    table = TuningTable.load(auto_table.DEFAULT_TABLE)
    keys = sorted({key for by_size in data["tables"].values() for key in by_size}, key=int)
    assert keys == [str(p) for p in range(2, 9)] and sorted(data["measured"], key=int) == keys
    for key in keys:
        assert data["measured"][key]["fingerprint"] == {"cpu": "AMD EPYC", "cpus": 2, "mpi": "MPICH Version: 5.0.2",
                                                        "nodes": 1, "ranks_per_node": int(key)}
    for p in range(2, 9):
        dev = Selector(Job(p, fingerprint=data["measured"][str(p)]["fingerprint"]), Settings(table, unstamped=False))
        other = Selector(Job(p, fingerprint={**ELSEWHERE, "ranks_per_node": p}), Settings(table, unstamped=False))
        for collective in data["tables"]:
            for nbytes in (8, 4096, 1 << 20, 64 << 20):
                assert dev.explain(collective, nbytes) == (table.lookup(collective, nbytes, p),
                                                           f"measured table {auto_table.DEFAULT_TABLE}")
                choice, why = other.explain(collective, nbytes)
                assert choice == "native" and why.startswith("conservative rule:"), why


# == the fingerprint rule ================================================================

@serial
def test_a_table_measured_elsewhere_gives_the_conservative_rule(tmp_path, clean_environment, monkeypatch):
    path = stamped_file(tmp_path / "t.json", stamps={"4": ELSEWHERE})
    for environ in ({auto.TUNING_ENV: str(path)}, {}):  # named by the user, or as the packaged table
        monkeypatch.setattr(auto_table, "DEFAULT_TABLE", path)
        selector = Selector.from_environment(Job(4), environ)
        choice, why = selector.explain("allreduce", 100)  # the table says tree
        assert choice == "native"
        assert why.startswith(f"conservative rule: no measured table for this machine and layout "
                              f"({auto.describe_fingerprint(here())}; {path} was measured on "
                              "Intel(R) Xeon(R) Platinum 8480+, 224 CPUs, Open MPI v4.1.5, 1x4); native "
                              "(the cost model predicts at most "), why
        assert why.endswith("x gain, recursive_doubling)")
        assert not selector.in_use[0]
    # each field counts: one differing field is another machine or layout
    for field, value in [("cpu", "AMD EPYC 9654"), ("cpus", here()["cpus"] + 1), ("mpi", "MPICH Version: 4.2.0"),
                         ("nodes", 2), ("ranks_per_node", 2)]:
        path = stamped_file(tmp_path / f"{field}.json", stamps={"4": {**here(), field: value}})
        choice, why = Selector.from_environment(Job(4), {auto.TUNING_ENV: str(path)}).explain("broadcast", 100)
        assert (choice, why.split(":")[0]) == ("native", "conservative rule"), field


@serial
def test_a_table_measured_here_is_used(tmp_path, clean_environment, monkeypatch):
    path = stamped_file(tmp_path / "t.json", stamps={"4": here(), "8": ELSEWHERE},
                        tables={**TABLES, "reduce": {"8": [[0, "direct"]]}})
    monkeypatch.setattr(auto_table, "DEFAULT_TABLE", path)  # as the packaged table: a fingerprint is needed, matches
    selector = Selector.from_environment(Job(4), {})
    assert selector.explain("allreduce", 100) == ("tree", f"measured table {path}")
    assert selector.explain("allreduce", 1 << 20) == ("ring", f"measured table {path}")
    assert selector.explain("broadcast", 100) == ("pipeline", f"measured table {path}")
    choice, why = selector.explain("reduce", 100)  # the matching table has no reduce at 4 ranks
    assert choice == "native" and why.startswith(f"conservative rule: {path} has no reduce table for world size 4")
    # world size 8's entry was measured elsewhere
    assert Selector.from_environment(Job(8), {}).explain("reduce", 100)[0] == "native"
    # several nodes: the layout's entry, stamped with the layout
    layout = stamped_file(tmp_path / "layout.json", tables={"allreduce": {"2x4": [[0, "ring"]]}},
                          stamps={"2x4": here("2x4")})
    monkeypatch.setattr(auto_table, "DEFAULT_TABLE", layout)
    two_nodes = Selector.from_environment(Job(8, Topology.uniform(8, 4)), {})
    assert two_nodes.explain("allreduce", 100) == ("ring", f"measured table {layout} (layout 2x4)")


@serial
def test_a_table_without_fingerprints_counts_only_where_the_user_named_it(tmp_path, clean_environment, monkeypatch):
    old = tmp_path / "old.json"  # as written before fingerprints
    old.write_text(json.dumps({"format": 1, "measured": {"4": {"dtype": "float32"}}, "tables": TABLES}))
    named = Selector.from_environment(Job(4), {auto.TUNING_ENV: str(old)})
    assert named.explain("allreduce", 100) == ("tree", f"measured table {old}")
    monkeypatch.setattr(auto_table, "DEFAULT_TABLE", old)
    packaged = Selector.from_environment(Job(4), {})
    choice, why = packaged.explain("allreduce", 100)
    assert choice == "native" and f"{old} has no fingerprint, so only a file named by COLLECTIVES_TUNING" in why


@serial
def test_the_ranks_agree_on_the_table(tmp_path, clean_environment):
    """agree gets this rank's bits (1: host table usable, 2: device table usable) and
    returns every rank's AND: a rank that cannot use the table makes all fall back."""
    device = {"allreduce": {"4": [[0, "ring"]]}}
    path = stamped_file(tmp_path / "t.json", stamps={"4": here(), "4 device": here()}, device_tables=device)
    environ = {auto.TUNING_ENV: str(path)}
    seen = []

    def everyone_agrees(bits):
        seen.append(bits)
        return bits

    selector = Selector.from_environment(Job(4, agree=everyone_agrees), environ)
    assert seen == [3] and selector.explain("allreduce", 100)[0] == "tree"
    assert selector.explain("allreduce", 100, device=True) == ("ring", f"measured table {path} (device_tables)")
    seen.clear()
    Selector.from_environment(Job(4, fingerprint=ELSEWHERE, agree=everyone_agrees), environ)
    assert seen == [0]
    # another rank could not use the host table: nor can this one
    outvoted = Selector.from_environment(Job(4, agree=lambda bits: bits & 2), environ)
    choice, why = outvoted.explain("allreduce", 100)
    assert choice == "native" and f"another rank's machine or layout differs from the one {path} was measured on" in why
    assert outvoted.explain("allreduce", 100, device=True)[0] == "ring"
    # the device tables follow the same rule; without one, device arrays take the device cost model
    outvoted = Selector.from_environment(Job(4, agree=lambda bits: bits & 1), environ)
    choice, why = outvoted.explain("allreduce", 1 << 20, device=True)
    model_choice, model_why = auto.device_choice("allreduce", 1 << 20, 4)
    assert (choice, why) == (model_choice, model_why + " (no measured table for device arrays; the node's ranks "
                             "taken to share one GPU until a device call learns it)")
    assert choice in ("one_shot", "two_shot", "leader") and why.startswith("device cost model on one node (predicted: ")


@serial
def test_a_device_table_of_other_gpus_is_put_aside_once_a_device_call_learns_the_node(tmp_path, clean_environment):
    """A device table's entry names the GPUs it was measured on (tune.write's ``gpus``):
    a communicator is made without touching the device, so the table answers until the
    first call on a device learns the ranks' GPUs (Selector.learn_gpu_stamp); on other
    GPUs (another model, or as many ranks on more GPUs) the device cost model answers
    from then on, and comm.choose says why; on the same GPUs, or where the entry names
    none (a table written before), the table stays."""
    device = {"allreduce": {"4": [[0, "two_shot"]]}}
    h200 = auto.gpu_stamp(["NVIDIA H200"] * 4, ["gpu-0"] * 4)
    assert h200 == "NVIDIA H200 x1" and auto.gpu_stamp(["B", "A", "B", "A"], "0123") == "A + B x4"
    measured = f"measured table {tmp_path / 't.json'} (device_tables)"
    for stamp, learnt, kept in ((h200, h200, True), (h200, "NVIDIA H100 80GB HBM3 x1", False),
                                (h200, "NVIDIA H200 x4", False), (None, "NVIDIA H100 80GB HBM3 x4", True)):
        path = stamped_file(tmp_path / "t.json", stamps={"4 device": {**here(), **({"gpu": stamp} if stamp else {})}},
                            device_tables=device)
        selector = Selector.from_environment(Job(4), {auto.TUNING_ENV: str(path)})
        assert selector.explain("allreduce", 100, device=True) == ("two_shot", measured), stamp
        assert selector.learn_gpu_stamp(learnt) != kept
        choice, why = selector.explain("allreduce", 100, device=True)
        assert selector.in_use[1] == kept and selector.choose("allreduce", 100, device=True) == choice
        if kept:
            assert (choice, why) == ("two_shot", measured), (stamp, learnt, why)
        else:
            times = auto.predict_device("allreduce", 100, 4, selector.device_model)
            assert choice == min(times, key=times.get), (learnt, why)
            assert f"was measured on GPUs {stamp}, these are {learnt}" in why, why
        assert selector.explain("allreduce", 100)[0] == "tree"  # the host table is another matter
    # the ranks decide alike: where another rank's table (a file of its own) names other GPUs
    seen = []
    selector = Selector.from_environment(Job(4), {auto.TUNING_ENV: str(path)})  # (its entry names none: it fits)
    assert selector.learn_gpu_stamp(h200, agree=lambda fits: seen.append(fits) or False)
    assert seen == [True] and not selector.in_use[1]
    assert "another rank's device table was measured on other GPUs" in selector.explain("allreduce", 100, True)[1]


@serial
def test_a_table_of_several_nodes_is_used_only_over_the_link_it_was_measured_on(tmp_path, clean_environment):
    """An entry of several nodes holds the link --tune measured: the job measures its
    own (only then, and together: both agreements are the ranks' AND) and uses the
    entry within LINK_TOLERANCE of it."""
    layout = Topology.uniform(8, 4)
    stamp = auto.fingerprint_for_key("2x4", 118e6)
    assert stamp == {**here("2x4"), "link_MBps": 118.0}
    assert auto.fingerprint_for_key("4", 118e6) == here("4")  # one node: no link
    assert auto.describe_fingerprint(stamp).endswith("2x4, a 118 MB/s link")
    path = stamped_file(tmp_path / "t.json", tables={"allreduce": {"2x4": [[0, "ring"]]}}, stamps={"2x4": stamp})
    environ = {auto.TUNING_ENV: str(path)}
    for rate, used in ((113e6, True), (118e6 * 1.49, True), (118e6 / 1.49, True), (1.18e9, False), (50e6, False)):
        measured, agreements = [], []
        selector = Selector.from_environment(
            Job(8, layout, agree=lambda bits: agreements.append(bits) or bits,
                measure_link=lambda: measured.append(rate) or rate), environ)
        assert measured == [rate] and agreements == [4, 1 if used else 0] and selector.link == rate
        choice, why = selector.explain("allreduce", 1 << 20)
        if used:
            assert (choice, why) == ("ring", f"measured table {path} (layout 2x4)")
        else:
            assert (f"{path} was measured over a 118 MB/s link; this job's measures {auto.link_stamp(rate):g} MB/s"
                    in why)
    # another rank's entry holds no link (or none of its own): nobody measures, nobody uses it
    measured = []
    outvoted = Selector.from_environment(Job(8, layout, agree=lambda bits: bits & ~4,
                                             measure_link=lambda: measured.append(1) or 118e6), environ)
    assert measured == [] and outvoted.in_use == [False, False]
    assert "another rank's machine or layout differs" in outvoted.explain("allreduce", 1 << 20)[1]
    # nothing to measure with: not used
    blind = Selector.from_environment(Job(8, layout), environ)
    assert blind.in_use == [False, False] and "this job's was not measured" in blind.explain("allreduce", 1 << 20)[1]
    # an entry of several nodes from before link stamps counts as it did; no measurement
    old = stamped_file(tmp_path / "old.json", tables={"allreduce": {"2x4": [[0, "ring"]]}}, stamps={"2x4": here("2x4")})
    measured = []
    selector = Selector.from_environment(Job(8, layout, measure_link=lambda: measured.append(1) or 1.0),
                                         {auto.TUNING_ENV: str(old)})
    assert measured == [] and selector.in_use[0]


def test_a_rank_that_does_not_match_makes_every_rank_fall_back(mpi_comm, tmp_path, clean_environment, monkeypatch):
    """Under mpiexec: the table is stamped with this machine's fingerprint, so every
    rank can use it; then the last rank sees another machine, and every rank falls
    back to the conservative rule together (the same algorithm everywhere)."""
    size, rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
    tables = {"allreduce": {str(size): [[0, "direct"]]}}
    path = stamped_file(tmp_path / f"t-{rank}.json", tables=tables, stamps={str(size): here(str(size))})
    monkeypatch.setenv(auto.TUNING_ENV, str(path))
    problems = []
    comm = cc.Communicator(mpi_comm)
    try:
        if comm.choose("allreduce", 1 << 20) != ("direct", f"measured table {path}"):
            problems.append(f"matching table: {comm.choose('allreduce', 1 << 20)}")
    finally:
        comm.free()
    if rank == size - 1:
        real = auto_selector.machine_fingerprint
        monkeypatch.setattr(auto_selector, "machine_fingerprint", lambda *args: {**real(*args), "cpu": "another CPU"})
    comm = cc.Communicator(mpi_comm)
    try:
        choice, why = comm.choose("allreduce", 1 << 20)
        everyone = mpi_comm.allgather(comm.choose("allreduce", 8000)[0])  # what a 1000-float64 call runs
        if len(set(everyone)) == 1:  # (else the call below would hang)
            x = np.arange(1000, dtype=np.float64) + rank
            got = comm.allreduce(x)  # the same algorithm everywhere: the right sum
            if not np.array_equal(got, np.arange(1000) * size + size * (size - 1) / 2):
                problems.append("allreduce after falling back differs from the sum")
        else:
            problems.append(f"the ranks chose differently: {everyone}")
    finally:
        comm.free()
    want = "another CPU" if rank == size - 1 else "another rank's machine or layout differs"
    if choice != "native" or not why.startswith("conservative rule:") or want not in why:
        problems.append(f"with the last rank elsewhere: {choice}, {why}")
    agree(mpi_comm, problems)


# == the conservative rule's cost model ================================================

def closed_forms(collective, p, n, alpha, beta, gamma):
    """docs/algorithms.md's times for p a power of two, one node."""
    lg = int(math.log2(p))
    return {
        ("allreduce", "ring"): 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma,
        ("allreduce", "recursive_halving"): 2 * lg * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma,
        ("allreduce", "recursive_doubling"): lg * (alpha + n * beta + n * gamma),
        ("allreduce", "direct"): 2 * (p - 1) * (alpha + n / p * beta) + (p - 1) / p * n * gamma,
        ("reduce_scatter", "direct"): (p - 1) * (alpha + n / p * beta) + (p - 1) / p * n * gamma,
        ("allgather", "direct"): (p - 1) * (alpha + n / p * beta),
        ("reduce", "direct"): 2 * (p - 1) * (alpha + n / p * beta) + (p - 1) / p * n * gamma,
        ("reduce_scatter", "ring"): (p - 1) * alpha + (p - 1) / p * n * (beta + gamma),
        ("reduce_scatter", "recursive_halving"): lg * alpha + (p - 1) / p * n * (beta + gamma),
        ("allgather", "ring"): (p - 1) * alpha + (p - 1) / p * n * beta,
        ("allgather", "recursive_doubling"): lg * alpha + (p - 1) / p * n * beta,
        ("allgather", "bruck"): lg * alpha + (p - 1) / p * n * beta,
        ("broadcast", "binomial"): lg * (alpha + n * beta),
        ("broadcast", "scatter_allgather"): (lg + p - 1) * alpha + 2 * (p - 1) / p * n * beta,
        ("reduce", "binomial"): lg * (alpha + n * beta + n * gamma),
        ("gather", "binomial"): lg * alpha + (p - 1) / p * n * beta,
        ("alltoall", "pairwise"): (p - 1) * (alpha + n / p * beta),
        ("alltoall", "bruck"): lg * (alpha + n / 2 * beta),
    }


@serial
@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_the_model_is_the_documented_closed_forms_on_one_node(p):
    model = auto.SHIPPED_MODEL
    for n in (8, 65536, 64 << 20):
        want = closed_forms(None, p, n, model.alpha, model.beta, model.gamma)
        for (collective, algorithm), seconds in want.items():
            _, ours = auto.predict(collective, n, p)
            assert ours[algorithm] == pytest.approx(seconds, rel=1e-12), (collective, algorithm, n)
        # native: the best of the same schedules at MPI's own cost per message
        mpi = closed_forms(None, p, n, model.mpi_alpha, model.beta, model.gamma)
        native, _ = auto.predict("allreduce", n, p)
        assert native == pytest.approx(min(mpi["allreduce", a] for a in ("ring", "recursive_halving",
                                                                         "recursive_doubling")), rel=1e-12)


@serial
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_direct_s_messages_of_a_round_cost_message_after_the_first(p):
    """CostModel.message: a round of direct pays alpha for its first message and
    ``message`` for each other; the ring's messages each wait (alpha)."""
    alpha, message, beta, gamma, n = 300e-6, 20e-6, 0.2e-9, 0.1e-9, 4 << 20
    model = auto.CostModel(alpha=alpha, message=message, beta=beta, gamma=gamma)
    _, ours = auto.predict("allreduce", n, p, model=model)
    rounds = 2 * (alpha + (p - 2) * message + (p - 1) * n / p * beta)
    assert ours["direct"] == pytest.approx(rounds + (p - 1) / p * n * gamma, rel=1e-12)
    assert ours["ring"] == pytest.approx(closed_forms(None, p, n, alpha, beta, gamma)["allreduce", "ring"], rel=1e-12)
    if p > 2:
        assert ours["direct"] < ours["ring"]


@serial
def test_the_conservative_rule_picks_ours_only_for_a_predicted_2x():
    # On one node MPI runs our schedules at a tenth of the cost per message: native always.
    for p in range(2, 17):
        for collective in BUILDERS:
            for e in range(0, 27, 2):
                choice, gain, _ = auto.conservative_choice(collective, 1 << e, p)
                assert choice == "native" and gain < auto.GAIN_NEEDED, (collective, p, 1 << e, gain)
    # Two nodes x 4, ranks dealt out in turn: MPI's flat schedules cross the network at
    # nearly every step, the two-level algorithm twice.
    interleaved = Topology.from_labels([r % 2 for r in range(8)])
    choice, gain, best = auto.conservative_choice("allreduce", 16 << 20, 8, interleaved)
    native, ours = auto.predict("allreduce", 16 << 20, 8, interleaved)
    assert (choice, best) == ("hierarchical", "hierarchical") and gain == pytest.approx(native / ours[best])
    assert gain >= 2 and ours[best] == min(ours.values())
    # the threshold itself: the same prediction, asked for a little more, stays native
    assert auto.conservative_choice("allreduce", 16 << 20, 8, interleaved, needed=gain * 1.001)[0] == "native"
    assert auto.conservative_choice("allreduce", 16 << 20, 8, interleaved, needed=gain * 0.999)[0] == "hierarchical"
    # node by node, the same layout: MPI's schedules cross the network little: native
    blocked = Topology.uniform(8, 4)
    assert auto.conservative_choice("allreduce", 16 << 20, 8, blocked)[0] == "native"
    # a model where MPI's messages cost ten times ours: small buffers leave native
    slow_mpi = auto.CostModel(alpha=2e-6, mpi_alpha=20e-6)
    choice, gain, best = auto.conservative_choice("allreduce", 8, 4, model=slow_mpi)
    assert (choice, best) == ("recursive_doubling", "recursive_doubling") and gain == pytest.approx(10, rel=0.01)
    assert auto.conservative_choice("allreduce", 64 << 20, 4, model=slow_mpi)[0] == "native"  # bytes dominate


@serial
def test_choose_says_which_rule_decided_and_the_predicted_gain(clean_environment):
    interleaved = Topology.from_labels([r % 2 for r in range(8)])
    selector = Selector.from_environment(Job(8, interleaved), {})
    _, gain, _ = auto.conservative_choice("allreduce", 16 << 20, 8, interleaved)
    choice, why = selector.explain("allreduce", 16 << 20)
    assert choice == "hierarchical"
    assert why == (f"conservative rule: no measured table for this machine and layout "
                   f"({auto.describe_fingerprint(auto.fingerprint(interleaved))}); "
                   f"hierarchical (the cost model predicts {gain:.2f}x gain over native)")
    # deterministic mode still reduces in rank order, saying what it overrode
    ordered = Selector.from_environment(Job(8, interleaved), {}, deterministic=True)
    choice, why = ordered.explain("allreduce", 16 << 20)
    assert choice == "direct" and why.startswith("deterministic mode (reduces in rank order; else hierarchical, by "
                                                 "the conservative rule:")
    # an override still wins; the cost-model rule on request
    forced = Selector.from_environment(Job(8, interleaved), {"COLLECTIVES_ALLREDUCE_ALGORITHM": "ring"})
    assert forced.explain("allreduce", 16 << 20) == ("ring", "forced by COLLECTIVES_ALLREDUCE_ALGORITHM")
    asked = Selector.from_environment(Job(8, interleaved), {auto.RULE_ENV: "cost-model"})
    assert asked.explain("allreduce", 100)[1] == f"cost-model rule for {interleaved.describe()}"
    with pytest.raises(ValueError, match="COLLECTIVES_AUTO_RULE must be one of conservative, cost-model; got 'fast'"):
        Selector.from_environment(Job(8), {auto.RULE_ENV: "fast"})


# What a staged native call copies device -> host, then host -> device, of n a table's
# bytes at p ranks (allgather: n the gathered size), written here from what each rank
# holds: the input goes to the host, the result comes back.
STAGED_IN_AND_BACK = {"allreduce": lambda p, n: (n, n), "reduce_scatter": lambda p, n: (n, n / p),
                      "allgather": lambda p, n: (n / p, n), "broadcast": lambda p, n: (n, n),
                      "reduce": lambda p, n: (n, n)}
PEER_READ_NAMES = ("one_shot", "two_shot", "leader")
STAGED_SAID = "native (staged: MPI's own on host copies)"


@serial
@pytest.mark.parametrize("p", [2, 4])
def test_the_device_model_predicts_staged_native_for_every_collective(p):
    """auto on device arrays chooses among the peer reads, the ring over CUDA IPC and
    native staged through host copies: call + staged_fixed + the bytes in and back at
    staged_rate + on a GPU the ranks share, two rounds of switches between the p
    processes (the copy in, the copy back). auto picks the fastest predicted; for an
    allreduce on one node that is a peer read at every size, as the H200 measured."""
    model = auto.SHIPPED_DEVICE_MODEL
    assert set(auto.DEVICE_COSTS) == set(STAGED_IN_AND_BACK)
    for collective, in_and_back in STAGED_IN_AND_BACK.items():
        for n in (8, 4096, 1 << 20, 64 << 20):
            times = auto.predict_device(collective, n, p)
            assert "native" in times, (collective, p, n)
            want = (model.call + model.staged_fixed + sum(in_and_back(p, n)) / model.staged_rate
                    + 2 * (p - 1) * model.switch)
            assert times["native"] == pytest.approx(want, rel=1e-12), (collective, p, n)
            assert set(times) - {"native"} <= set(BUILDERS[collective]) and len(times) >= 3
            choice, why = auto.device_choice(collective, n, p)
            assert choice == min(times, key=times.get), (collective, p, n)
            assert f"{STAGED_SAID} {times['native'] * 1e6:.0f} us" in why, why
            if collective == "allreduce":
                assert choice in PEER_READ_NAMES, (p, n, times)
    # the leader only where the ranks share a GPU (with a GPU each, its would carry every rank's traffic)
    assert "leader" in auto.predict_device("allreduce", 8, p)
    assert "leader" not in auto.predict_device("allreduce", 8, p, dataclasses.replace(model, shared=False))
    # the measured staged allreduce (bench/results/NVIDIA-H200, peer-n2/n4.json): 470 us
    # at 8 B at 2 ranks, 1142 at 4; 7.1 ms at 16 MiB at 2 ranks, 13.7 at 4
    small, large = {2: 470e-6, 4: 1142e-6}[p], {2: 7.09e-3, 4: 13.7e-3}[p]
    assert auto.predict_device("allreduce", 8, p)["native"] == pytest.approx(small, rel=0.1)
    assert auto.predict_device("allreduce", 16 << 20, p)["native"] == pytest.approx(large, rel=0.3)


@serial
@pytest.mark.parametrize("p", [2, 4])
def test_the_device_model_fits_the_h200s_peer_reads(p):
    """one_shot allreduce at 8 B (440 us at 2 ranks, 820 at 4: two fences and p - 1
    switches between the processes sharing the GPU) and at 256 MiB (857 and 2311 us);
    the ring allgather of 8 B, a handshake a step (the floor's ipc row: 639 and 575 us a
    handshake); and two_shot, slower than one_shot at every size measured, predicted
    slower too."""
    one_shot = {2: (440e-6, 857e-6), 4: (820e-6, 2311e-6)}[p]
    handshake = {2: 639e-6, 4: 575e-6}[p]
    small, large = auto.predict_device("allreduce", 8, p), auto.predict_device("allreduce", 256 << 20, p)
    assert small["one_shot"] == pytest.approx(one_shot[0], rel=0.05)
    assert large["one_shot"] == pytest.approx(one_shot[1], rel=0.1)
    ring = auto.predict_device("allgather", 8, p)["ring"] - auto.SHIPPED_DEVICE_MODEL.call
    assert ring / (p - 1) == pytest.approx(handshake, rel=0.1)
    for n in (8, 4096, 1 << 20, 64 << 20, 256 << 20):
        times = auto.predict_device("allreduce", n, p)
        assert times["two_shot"] > times["one_shot"], (p, n, times)
    # with a GPU each (nothing shared, no switches) two_shot's smaller traffic wins at 256
    # MiB from 3 ranks on ((3 + 1/p)·n read and written against (p + 1)·n)
    if p > 2:
        own = auto.DeviceCostModel(shared=False, bandwidth=2e11)
        times = auto.predict_device("allreduce", 256 << 20, p, own)
        assert times["two_shot"] < times["one_shot"], times
    # and their in-kernel fences have no host and no switch in them: a small call does
    # not go staged (own_fence, unmeasured, against the shared GPU's host fence)
    own = auto.DeviceCostModel(shared=False, one_gpu=False, kernel_fences=True)
    times = auto.predict_device("allreduce", 8, p, own)
    assert min(times, key=times.get) == "one_shot" and "leader" not in times, times


@serial
def test_the_selector_predicts_for_the_node_its_first_device_call_learnt(clean_environment):
    """Selector.learn_gpus: before it, the ranks are taken to share one GPU (the leader
    offered); after it, the model is the node's: one GPU (the leader), a GPU each (no
    leader, no switches; in-kernel fences cost own_fence, host fences fence), or GPUs
    some ranks share (no leader: rank 0's GPU would carry the others' traffic; switches
    and host fences as on one GPU). comm.choose says which."""
    selector = Selector.from_environment(Job(4), {})
    choice, why = selector.explain("allreduce", 4096, device=True)
    assert choice == "leader" and "taken to share one GPU until a device call learns it" in why, why
    host, kernel = peer_fences.HostFences, peer_fences.KernelFences
    cases = {(1, host): ("the node's ranks share one GPU, host fences", True),
             (4, kernel): ("each of the node's ranks has a GPU of its own, kernel fences", False),
             (4, host): ("each of the node's ranks has a GPU of its own, host fences", False),
             (2, host): ("the node's 4 ranks share 2 GPUs, host fences", False)}
    for (gpus, fences), (said, leader) in cases.items():
        selector.learn_gpus(gpus, 4, fences)
        model = selector.device_model
        assert (model.shared, model.one_gpu, model.kernel_fences) == (gpus < 4, gpus == 1, fences is kernel)
        times = auto.predict_device("allreduce", 4096, 4, model)
        choice, why = selector.explain("allreduce", 4096, device=True)
        assert said in why and choice == min(times, key=times.get) and ("leader" in times) == leader, (gpus, why)
        assert selector.choose("allreduce", 4096, device=True) == choice  # the cache emptied as it learnt
    fences = {m: auto.predict_device("allreduce", 8, 4, auto.DeviceCostModel(shared=False, one_gpu=False,
                                                                                   kernel_fences=m == "kernel"))
              for m in ("host", "kernel")}
    assert fences["host"]["one_shot"] - fences["kernel"]["one_shot"] == pytest.approx(
        2 * (auto.SHIPPED_DEVICE_MODEL.fence - auto.SHIPPED_DEVICE_MODEL.own_fence))


@serial
def test_a_slow_fence_makes_auto_stage_small_buffers(clean_environment):
    """Where the ranks' synchronisation is slow (their fences and the ring's handshakes),
    small buffers go to MPI's own on host copies (one host round trip, no fences) and
    large ones still to a peer read."""
    slow = auto.DeviceCostModel(fence=1e-3, ipc_step=1e-3)
    for p, collectives in ((4, list(STAGED_IN_AND_BACK)), (2, ["allreduce", "reduce"])):
        for collective in collectives:
            choice, why = auto.device_choice(collective, 4096, p, model=slow)
            assert choice == "native", (collective, p, why)
            assert why.startswith(f"device cost model on one node (predicted: {STAGED_SAID} "), why
            assert auto.device_choice(collective, 256 << 20, p, model=slow)[0] in PEER_READ_NAMES, (collective, p)
    # auto without a device table: the selector says so, naming the staged path
    selector = Selector.from_environment(Job(4), {})
    selector.device_model = slow
    choice, why = selector.explain("allreduce", 4096, device=True)
    times = auto.predict_device("allreduce", 4096, 4, slow)
    assert choice == "native" and " (no measured table for device arrays; " in why
    assert f"predicted: {STAGED_SAID} {times['native'] * 1e6:.0f} us, " in why
    assert selector.explain("allreduce", 256 << 20, device=True)[0] in PEER_READ_NAMES
    assert selector.explain("allreduce", 4096)[0] == "native"  # host arrays: the conservative rule, as before


@serial
def test_a_slow_staged_path_is_never_picked():
    """The same slow fence, but a staged path slower still (a second, or just over the
    two slow fences): auto never stages, at any size, at 2 to 8 ranks."""
    for staged_fixed in (1.0, 2.5e-3):
        slow_staging = auto.DeviceCostModel(fence=1e-3, staged_fixed=staged_fixed)
        for p in (2, 3, 4, 8):
            for collective in STAGED_IN_AND_BACK:
                for e in range(0, 31, 2):
                    times = auto.predict_device(collective, 1 << e, p, slow_staging)
                    choice, why = auto.device_choice(collective, 1 << e, p, model=slow_staging)
                    assert "native" in times and choice != "native", (collective, p, 1 << e)
                    assert STAGED_SAID in why  # still a contender, named


def test_float16_and_bfloat16_stay_off_native_under_the_conservative_rule(mpi_comm, clean_environment):
    """The conservative rule says native; communicator's own rule for the dtypes MPI
    reduces slowly or cannot move still takes the library's algorithms."""
    comm = cc.Communicator(mpi_comm)
    try:
        choice, why = comm.choose("allreduce", 1 << 20, dtype="float16")
        plain = comm.choose("allreduce", 1 << 20, dtype="float32")
        bf16 = comm.choose("allreduce", 8, dtype=BFLOAT16) if BFLOAT16 is not None else None
    finally:
        comm.free()
    problems = []
    if plain[0] != "native" or not plain[1].startswith("conservative rule:"):
        problems.append(f"float32: {plain}")
    if choice == "native" or "float16" not in why:
        problems.append(f"float16: {choice}, {why}")
    if bf16 is not None and bf16[0] == "native":
        problems.append(f"bfloat16: {bf16}")
    agree(mpi_comm, problems)


# == the hint ==========================================================================

@serial
def test_the_hint_is_printed_once_where_no_table_matches(tmp_path, clean_environment, capsys):
    Selector.from_environment(Job(4), {}, hint=False)
    assert capsys.readouterr().err == ""  # not rank 0 of its communicator
    Selector.from_environment(Job(4), {}, hint=True)
    err = capsys.readouterr().err
    assert err == (f"collectives: no tuning table measured on this machine and layout "
                   f"({auto.describe_fingerprint(here())}); auto uses MPI's own collectives unless the cost model "
                   "predicts a 2x gain. Run `make tune` (or collectives-bench --tune FILE, then "
                   "COLLECTIVES_TUNING=FILE) to tune; COLLECTIVES_QUIET=1 hides this.\n")
    Selector.from_environment(Job(4), {}, hint=True)
    Selector.from_environment(Job(8), {}, hint=True)
    assert capsys.readouterr().err == ""  # once per process


@serial
@pytest.mark.parametrize("case", ["matching table", "quiet", "rule chosen", "one rank", "all forced"])
def test_no_hint_where_a_table_matches_or_it_was_silenced(tmp_path, clean_environment, capsys, case):
    environ, size = {}, 4
    if case == "matching table":
        environ[auto.TUNING_ENV] = str(stamped_file(tmp_path / "t.json", stamps={"4": here()}))
    elif case == "quiet":
        environ[auto.QUIET_ENV] = "1"
    elif case == "rule chosen":
        environ[auto.RULE_ENV] = "conservative"
    elif case == "one rank":
        size = 1
    else:
        environ.update({auto.override_variable(c): "native" for c in BUILDERS})
    Selector.from_environment(Job(size), environ, hint=True)
    assert capsys.readouterr().err == ""
    assert not auto_selector._hinted
    # the same with a table measured elsewhere: shown
    if case == "matching table":
        environ[auto.TUNING_ENV] = str(stamped_file(tmp_path / "t.json", stamps={"4": ELSEWHERE}))
        Selector.from_environment(Job(size), environ, hint=True)
        assert "no tuning table measured on this machine" in capsys.readouterr().err


def test_the_hint_shows_on_rank_0_only(mpi_comm, clean_environment, capsys):
    first = cc.Communicator(mpi_comm)
    second = cc.Communicator(mpi_comm)
    first.free()
    second.free()
    err = capsys.readouterr().err
    shown = err.count("collectives: no tuning table measured on this machine")
    want = 1 if mpi_comm.Get_rank() == 0 and mpi_comm.Get_size() > 1 else 0
    agree(mpi_comm, [] if shown == want else [f"hint shown {shown} times, expected {want}: {err!r}"])


# == --tune: fingerprints written, and the noise margin ================================

def row(algorithm, nbytes, time_us, spread=None, collective="allreduce", world_size=4):
    r = {"collective": collective, "algorithm": algorithm, "bytes": nbytes, "world_size": world_size,
         "time_us": time_us}
    if spread is not None:
        r["round_spread"] = spread
    return r


@serial
@pytest.mark.parametrize("faster,spread,winner", [
    (1.08, 0.20, "native"),   # 8% faster, rounds 20% apart: within the noise
    (1.40, 0.20, "ring"),     # 40% faster: beyond it
    (1.08, 0.0, "ring"),      # no spread measured: the 5% floor
    (1.04, 0.0, "native"),    # within the floor
    (1.15, 0.10, "ring"),
    (1.15, 0.20, "native"),
])
def test_a_candidate_replaces_native_only_beyond_the_noise(faster, spread, winner):
    assert tune.NOISE_FLOOR == 0.05
    for noisy in ("native", "ring"):  # the spread of either row counts
        rows = []
        for nbytes in (1024, 2048, 4096):  # the same at every size: the smoothing changes nothing
            rows += [row("native", nbytes, 100.0 * faster, spread if noisy == "native" else 0.01),
                     row("ring", nbytes, 100.0, spread if noisy == "ring" else 0.01),
                     row("tree", nbytes, 300.0, 0.5)]
        assert tune.winners(rows) == [(n, winner) for n in (1024, 2048, 4096)], (faster, spread, noisy)
        assert tune.thresholds(rows) == [[0, winner]]


@serial
def test_the_margin_applies_size_by_size():
    rows = [row("native", 8, 1.0, 0.3), row("ring", 8, 2.0, 0.3),
            row("native", 64, 1.3, 0.3), row("ring", 64, 1.0, 0.3),    # 30% faster, 30% spread: native
            row("native", 512, 1.3, 0.02), row("ring", 512, 1.0, 0.02),  # 30% faster, quiet: ring
            row("native", 4096, 1.3, 0.02), row("ring", 4096, 1.0, 0.02)]
    assert tune.winners(rows, window=0) == [(8, "native"), (64, "native"), (512, "ring"), (4096, "ring")]


def test_the_rounds_spread_is_measured(mpi_comm):
    """combine's round_spread: max/min - 1 of the rounds' mean times over all ranks."""
    rank = mpi_comm.Get_rank()
    rounds = [3, 2, 4]
    samples = np.concatenate([np.full(3, 1e-4), np.full(2, 1.5e-4), np.full(4, 1.2e-4)]) * (1 + rank)
    stats = timing.combine(mpi_comm, samples, rounds)
    factors = np.arange(1, mpi_comm.Get_size() + 1)
    means = [m * factors.mean() for m in (1e-4, 1.5e-4, 1.2e-4)]
    problems = []
    if stats["round_spread"] != pytest.approx(max(means) / min(means) - 1, rel=1e-9):
        problems.append(f"round_spread {stats['round_spread']}")
    if timing.combine(mpi_comm, samples, [9])["round_spread"] != 0.0 or "round_spread" in timing.combine(
            mpi_comm, samples):
        problems.append("one round should give 0, no rounds no field")
    parts = timing.interleaved_rounds(mpi_comm, {"a": lambda: None}, {"a": 7}, rounds=3)
    if [p.size for p in parts["a"]] != [3, 2, 2]:
        problems.append(f"rounds {[p.size for p in parts['a']]}")
    agree(mpi_comm, problems)


@serial
def test_tune_write_stamps_every_entry(tmp_path):
    path = tmp_path / "t.json"
    rows = [row("native", 8, 1.0, world_size=2), row("ring", 8, 2.0, world_size=2)]
    layout_rows = [{**r, "world_size": 8, "layout": "2x4"} for r in rows]
    tune.write(path, rows + layout_rows, {"dtype": "float32"}, link=117.4e6)
    tune.write(path, rows, {"dtype": "float32"}, key="device_tables", gpus="NVIDIA H200 x1")
    measured = json.loads(path.read_text())["measured"]
    assert measured["2"]["fingerprint"] == here("2")  # one node: no link in its key
    assert measured["2x4"]["fingerprint"] == {**here("2x4"), "link_MBps": 117.0} and here("2x4")["nodes"] == 2
    assert measured["2 device"]["fingerprint"] == {**here("2"), "gpu": "NVIDIA H200 x1"}
    # and auto uses what it wrote, here
    selector = Selector.from_environment(Job(2), {auto.TUNING_ENV: str(path)})
    assert selector.in_use == [True, True]
