"""The benchmark harness (``collectives.tools.bench``) and what ``algorithm="auto"`` picks
(``collectives.tuning``): tuning tables, the environment overrides, the tuning file
the harness writes, the statistics and the command line end to end.

Expected values are worked out here independently (the nccl-tests bus-bandwidth
formulas, NumPy statistics over an MPI allgather of the samples, NumPy references for
results); nothing asserts a time. Tests marked ``serial`` send no messages. The others
run under every world size; checks that only rank 0 can make (it alone writes the
harness's files) are shared with ``agree`` so that no rank is left waiting.
"""

import argparse
import contextlib
import csv
import json
import math

import numpy as np
import pytest

import collectives as cc
import collectives.auto as auto
import collectives.routes.base as routes_base
from collectives.algorithms import PEER_READS, SHARED_MEMORY
from collectives.auto import Job, Selector, Settings, TuningTable, cost_model_choice
from collectives.auto import table as auto_table
from collectives.tools.bench import cli, timing, tune
from collectives.tools.bench.cases import Case, bus_factor, element_count

from conftest import agree, expected_result, rank_input, reference

serial = pytest.mark.serial


# -- helpers -------------------------------------------------------------------------

def write_tuning_file(path, tables, fmt=1):
    path.write_text(json.dumps({"format": fmt, "measured": {}, "tables": tables}))
    return path


def row(collective, algorithm, nbytes, time_us, world_size=4):
    return {"collective": collective, "algorithm": algorithm, "bytes": nbytes,
            "world_size": world_size, "time_us": time_us}


@contextlib.contextmanager
def fresh_communicator():
    """A Communicator made now (so it reads the environment as it is now), freed after."""
    comm = cc.Communicator()
    try:
        yield comm
    finally:
        comm.free()


@contextlib.contextmanager
def reported(problems):
    """Turn an exception into a problem, so that a rank checking alone (rank 0 reading
    the files) still reaches ``agree`` and no other rank is left waiting."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001
        problems.append(f"{type(exc).__name__}: {exc}")


def run_main(argv, problems, want=0):
    status = None
    with reported(problems):
        status = cli.main(argv)
    if status != want:
        problems.append(f"main returned {status}, expected {want}")


@pytest.fixture
def no_default_table(monkeypatch, tmp_path):
    """Whatever the package ships in collectives/data/tuning.json, act as if it did not."""
    monkeypatch.setattr(auto_table, "DEFAULT_TABLE", tmp_path / "no-such-default.json")
    for collective in cc.COLLECTIVES:
        monkeypatch.delenv(auto.override_variable(collective), raising=False)
    monkeypatch.delenv(auto.TUNING_ENV, raising=False)


@pytest.fixture
def plans_used(monkeypatch):
    """Records (collective, algorithm) of every plan the Communicator runs."""
    used = []
    real = routes_base.compiled_plan

    def spy(collective, algorithm, *args, **kwargs):
        used.append((collective, algorithm))
        return real(collective, algorithm, *args, **kwargs)

    monkeypatch.setattr(routes_base, "compiled_plan", spy)
    return used


def run_auto(comm, collective, x, root=0):
    if collective == "allreduce":
        return comm.allreduce(x)
    if collective == "reduce_scatter":
        return comm.reduce_scatter(x)
    if collective == "allgather":
        return comm.allgather(x)
    if collective == "broadcast":
        return comm.broadcast(x, root=root)
    if collective == "gather":
        return comm.gather(x, root=root)
    if collective == "scatter":
        return comm.scatter(x, root=root)
    return comm.reduce(x, root=root)


def nccl_bus_factor(collective, p):
    """nccl-tests' PERFORMANCE.md: busbw = algbw * factor."""
    return {"allreduce": 2 * (p - 1) / p, "reduce_scatter": (p - 1) / p,
            "allgather": (p - 1) / p, "broadcast": 1.0, "reduce": 1.0,
            "gather": (p - 1) / p, "scatter": (p - 1) / p, "alltoall": (p - 1) / p,
            "alltoallv": (p - 1) / p}[collective]


def reported_bytes(collective, requested, p, itemsize):
    """The size the harness reports for a requested size: whole elements, and for
    reduce_scatter, allgather, gather and scatter whole elements per rank (at least one each)."""
    unit = itemsize * p if collective in ("reduce_scatter", "allgather", "gather", "scatter", "alltoall",
                                          "alltoallv") else itemsize
    return max(unit, requested - requested % unit)


# == tuning tables ======================================================================

TABLE = {"allreduce": {"4": [[0, "tree"], [1024, "recursive_doubling"], [65536, "ring"]],
                       "2": [[512, "native"], [4096, "ring"]]},
         "broadcast": {"4": [[0, "pipeline"]]}}


@serial
@pytest.mark.parametrize("nbytes,want", [
    (0, "tree"), (1, "tree"), (1023, "tree"),                    # below the first threshold
    (1024, "recursive_doubling"), (1025, "recursive_doubling"),  # exactly at / just above
    (65535, "recursive_doubling"), (65536, "ring"),              # exactly at the last
    (1 << 40, "ring"),                                           # far above the last
])
def test_lookup_at_the_boundaries(nbytes, want):
    assert TuningTable(TABLE).lookup("allreduce", nbytes, 4) == want


@serial
def test_first_entry_covers_everything_below_it_and_missing_sizes_give_none():
    table = TuningTable(TABLE)
    assert [table.lookup("allreduce", n, 2) for n in (0, 511, 512, 4095, 4096)] == \
        ["native", "native", "native", "native", "ring"]
    assert table.lookup("broadcast", 10**9, 4) == "pipeline"
    assert table.lookup("allreduce", 100, 3) is None  # world size not measured
    assert table.lookup("reduce", 100, 4) is None  # collective not in the table
    assert table.world_sizes("allreduce") == [2, 4]
    assert table.world_sizes("reduce") == []


MALFORMED = [
    ({"allreduce": {"4": [[0, "ring"], [0, "tree"]]}}, r"allreduce at world size 4: from_bytes must increase"),
    ({"allreduce": {"4": [[0, "ring"], [100, "tree"], [50, "ring"]]}}, r"allreduce at world size 4: from_bytes"),
    ({"reduce": {"3": [[0, "ring"]]}}, r"reduce at world size 3: algorithm 'ring' is not one of "
     + ", ".join(a for a in cc.algorithms("reduce") if a != "auto")),
    ({"allgather": {"4": [[0, "auto"]]}}, r"allgather at world size 4: algorithm 'auto'"),
    ({"alltoallw": {"4": [[0, "native"]]}}, r"unknown collective 'alltoallw'"),
    ({"allreduce": {"4": []}}, r"allreduce at world size 4: expected a non-empty list"),
    ({"allreduce": {"4": [[0, "ring", 1]]}}, r"allreduce at world size 4: entry \[0, 'ring', 1\]"),
    ({"allreduce": {"4": [["0", "ring"]]}}, r"allreduce at world size 4: entry"),
    ({"allreduce": {"4": [[-1, "ring"]]}}, r"allreduce at world size 4: entry"),
]


@serial
@pytest.mark.parametrize("tables,message", MALFORMED)
def test_malformed_tables_name_the_file_and_collective(tmp_path, tables, message):
    path = write_tuning_file(tmp_path / "bad.json", tables)
    with pytest.raises(ValueError, match=message) as caught:
        TuningTable.load(path)
    assert f"tuning table {path}" in str(caught.value)


@serial
@pytest.mark.parametrize("content", [
    json.dumps({"format": 2, "tables": {}}),
    json.dumps({"tables": {"allreduce": {"4": [[0, "ring"]]}}}),
    json.dumps([1, 2]),
])
def test_a_file_of_another_format_is_refused(tmp_path, content):
    path = tmp_path / "other.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"tuning file {path}: expected an object with \"format\": 1"):
        TuningTable.load(path)


@serial
def test_unreadable_files_name_the_file(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(ValueError, match=f"cannot read tuning file {missing}"):
        TuningTable.load(missing)
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": 1, "tables": ')
    with pytest.raises(ValueError, match=f"cannot read tuning file {broken}"):
        TuningTable.load(broken)
    nulls = write_tuning_file(tmp_path / "nulls.json", None)
    with pytest.raises(ValueError, match=f"tuning table {nulls}: 'tables' must be an object"):
        TuningTable.load(nulls)


# == Selector: override, then table, then the conservative rule =======================
# (the fingerprint rules, the conservative rule's model and the hint: test_tuning_rules.py)

def conservative(collective, nbytes, size):
    """What the conservative rule picks where no table answers (one node)."""
    return auto.conservative_choice(collective, nbytes, size)[0]


@serial
def test_selector_precedence(tmp_path, no_default_table):
    path = write_tuning_file(tmp_path / "t.json", {"allreduce": {"4": [[0, "tree"]]},
                                                   "broadcast": {"4": [[0, "pipeline"]]}})
    environ = {"COLLECTIVES_TUNING": str(path), "COLLECTIVES_ALLREDUCE_ALGORITHM": "recursive_halving"}
    selector = Selector.from_environment(Job(4), environ)
    # the override beats the table (which says tree)
    assert selector.explain("allreduce", 100) == ("recursive_halving", "forced by COLLECTIVES_ALLREDUCE_ALGORITHM")
    assert selector.explain("allreduce", 1 << 30) == ("recursive_halving", "forced by COLLECTIVES_ALLREDUCE_ALGORITHM")
    # the table beats the conservative rule (which says native)
    assert conservative("broadcast", 100, 4) != "pipeline"
    assert selector.explain("broadcast", 100) == ("pipeline", f"measured table {path}")
    # no override and nothing in the table: the conservative rule
    for collective, nbytes in [("reduce", 100), ("allgather", 1 << 20), ("reduce_scatter", 8192)]:
        choice, why = selector.explain(collective, nbytes)
        assert choice == conservative(collective, nbytes, 4) == "native"
        assert why.startswith(f"conservative rule: {path} has no {collective} table for world size 4; native")
    # the table lacks world size 8: the rule again, override still wins
    other = Selector.from_environment(Job(8), environ)
    choice, why = other.explain("broadcast", 100)
    assert choice == conservative("broadcast", 100, 8) and why.startswith(
        "conservative rule: no measured table for this machine and layout (")
    assert other.explain("allreduce", 100)[0] == "recursive_halving"
    # choose (cached) agrees with explain, also when asked twice
    for collective, nbytes in [("allreduce", 10), ("broadcast", 100), ("reduce", 5), ("broadcast", 100)]:
        assert selector.choose(collective, nbytes) == selector.explain(collective, nbytes)[0]


@serial
def test_cost_model_rule_matches_the_readme_table(no_default_table):
    """docs/algorithms.md, "auto": the rule where no table answers (and native below 4 KiB)."""
    cases = [
        ("allreduce", 100, 4, "native"), ("allreduce", 8192, 4, "recursive_doubling"),
        ("allreduce", 256 * 1024, 4, "recursive_halving"), ("allreduce", 256 * 1024, 3, "ring"),
        ("allreduce", 4 << 20, 4, "ring"), ("reduce_scatter", 8192, 3, "recursive_halving"),
        ("reduce_scatter", 256 * 1024, 4, "ring"), ("allgather", 8192, 4, "recursive_doubling"),
        ("allgather", 8192, 3, "bruck"), ("allgather", 256 * 1024, 3, "ring"),
        ("broadcast", 256 * 1024, 4, "binomial"), ("broadcast", 4 << 20, 4, "scatter_allgather"),
        ("broadcast", 4 << 20, 2, "binomial"), ("reduce", 4 << 20, 5, "binomial"),
        ("gather", 100, 4, "native"), ("gather", 4 << 20, 5, "native"), ("scatter", 4 << 20, 3, "native"),
        ("alltoall", 8192, 4, "native"), ("alltoall", 4 << 20, 3, "native"),
    ]
    assert [cost_model_choice(c, n, p) for c, n, p, _ in cases] == [want for *_, want in cases]
    # Among the library's own algorithms (dtypes MPI cannot move): never native.
    own = [("allreduce", 100, 4, "recursive_doubling"), ("broadcast", 8, 3, "binomial"), ("gather", 8, 4, "binomial"),
           ("scatter", 4 << 20, 4, "binomial"), ("alltoall", 8192, 4, "bruck"), ("alltoall", 4 << 20, 3, "pairwise")]
    assert [cost_model_choice(c, n, p, own=True) for c, n, p, _ in own] == [want for *_, want in own]
    selector = Selector(Job(4), Settings(rule="cost-model"))  # no table, no overrides; COLLECTIVES_AUTO_RULE=cost-model
    assert selector.explain("allreduce", 256 * 1024) == ("recursive_halving", "cost-model rule")
    assert Selector.from_environment(Job(4), {"COLLECTIVES_AUTO_RULE": "cost-model"}).explain("allreduce", 256 * 1024) \
        == ("recursive_halving", "cost-model rule")
    assert Selector(Job(4)).explain("allreduce", 256 * 1024)[0] == "native"  # the conservative rule, by default


@serial
def test_packaged_default_table_is_used_when_present(tmp_path, monkeypatch, no_default_table):
    tables = {"reduce": {"4": [[0, "binomial"]]}, "allgather": {"4": [[0, "bruck"]]}}
    default = tmp_path / "default.json"  # stamped with this machine's fingerprint, as --tune does
    default.write_text(json.dumps({"format": 1, "tables": tables,
                                   "measured": {"4": {"fingerprint": auto.fingerprint_for_key("4")}}}))
    monkeypatch.setattr(auto_table, "DEFAULT_TABLE", default)
    assert Selector.from_environment(Job(4), {}).explain("allgather", 10) == ("bruck", f"measured table {default}")
    # COLLECTIVES_TUNING replaces the default table entirely (a file without fingerprints: the user chose it)
    mine = write_tuning_file(tmp_path / "mine.json", {"allgather": {"4": [[0, "ring"]]}})
    selector = Selector.from_environment(Job(4), {"COLLECTIVES_TUNING": str(mine)})
    assert selector.explain("allgather", 10) == ("ring", f"measured table {mine}")
    choice, why = selector.explain("reduce", 10)
    assert choice == conservative("reduce", 10, 4) and why.startswith("conservative rule:")


@serial
def test_override_values(no_default_table):
    # "auto" and blanks mean no override; surrounding spaces are ignored
    selector = Selector.from_environment(Job(4), {"COLLECTIVES_ALLREDUCE_ALGORITHM": "auto",
                                             "COLLECTIVES_REDUCE_ALGORITHM": "  ",
                                             "COLLECTIVES_ALLGATHER_ALGORITHM": " native "})
    assert selector.overrides == {"allgather": "native"}
    choice, why = selector.explain("allreduce", 1 << 20)
    assert choice == conservative("allreduce", 1 << 20, 4) and why.startswith("conservative rule:")
    for variable, value in [("COLLECTIVES_BROADCAST_ALGORITHM", "ring"),
                            ("COLLECTIVES_ALLREDUCE_ALGORITHM", "fastest"),
                            ("COLLECTIVES_REDUCE_SCATTER_ALGORITHM", "RING")]:
        with pytest.raises(ValueError, match=f"{variable} must be one of .*; got {value!r}"):
            Selector.from_environment(Job(4), {variable: value})
    names = ", ".join(a for a in cc.algorithms("broadcast") if a != "auto")  # the list, without auto
    with pytest.raises(ValueError, match=f"COLLECTIVES_BROADCAST_ALGORITHM must be one of {names}; got 'ring'"):
        Selector.from_environment(Job(4), {"COLLECTIVES_BROADCAST_ALGORITHM": "ring"})


@serial
def test_a_bad_tuning_path_raises_naming_it(tmp_path, no_default_table):
    missing = tmp_path / "nowhere.json"
    with pytest.raises(ValueError, match=f"cannot read tuning file {missing}"):
        Selector.from_environment(Job(4), {"COLLECTIVES_TUNING": str(missing)})


# == the Communicator reads the environment when it is created ==========================

FORCED = [("allreduce", "ring"), ("reduce_scatter", "recursive_halving"), ("allgather", "bruck"),
          ("broadcast", "pipeline"), ("reduce", "binomial"), ("gather", "binomial")]


@pytest.mark.parametrize("collective,algorithm", FORCED)
def test_override_steers_auto(mpi_comm, monkeypatch, no_default_table, plans_used, collective, algorithm):
    monkeypatch.setenv(auto.override_variable(collective), algorithm)
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    count = 1000  # 4000 bytes of float32: below 4 KiB the rule alone would say native
    xs = [rank_input(r, count, "float32") for r in range(size)]
    x = xs[rank].copy()
    if collective == "broadcast" and rank != 0:
        x[...] = 0
    with fresh_communicator() as comm:
        chosen = [comm.choose(collective, n) for n in (8, 4000, 1 << 20)]
        got = run_auto(comm, collective, x)
    problems = []
    want = f"forced by {auto.override_variable(collective)}"
    if chosen != [(algorithm, want)] * 3:
        problems.append(f"choose gave {chosen}")
    if plans_used != [(collective, algorithm)]:
        problems.append(f"ran {plans_used}, expected {[(collective, algorithm)]}")
    expected = expected_result(collective, rank, size, xs)
    if expected is None:
        if got is not None:
            problems.append(f"non-root got {got!r}")
    elif not np.array_equal(got, expected):
        problems.append(f"got {np.ravel(got)[:5]}, numpy {np.ravel(expected)[:5]}")
    agree(mpi_comm, problems)


def test_allreduce_ring_override_as_in_the_docs(mpi_comm, monkeypatch, no_default_table):
    monkeypatch.setenv("COLLECTIVES_ALLREDUCE_ALGORITHM", "ring")
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    xs = [rank_input(r, 12_345, "float64") for r in range(size)]
    with fresh_communicator() as comm:
        choice = comm.choose("allreduce", 1 << 20)
        got = comm.allreduce(xs[rank], algorithm="auto")
        comm.release_memory()  # scratch buffers are made again when needed
        again = comm.allreduce(xs[rank])
    problems = []
    if choice != ("ring", "forced by COLLECTIVES_ALLREDUCE_ALGORITHM"):
        problems.append(f"choose: {choice}")
    want = reference("sum", xs)
    if not (np.array_equal(got, want) and np.array_equal(again, want)):
        problems.append("allreduce under the override differs from numpy")
    agree(mpi_comm, problems)


def test_environment_is_read_at_creation_only(comm, mpi_comm, monkeypatch, no_default_table):
    before = comm.choose("allreduce", 100)
    monkeypatch.setenv("COLLECTIVES_ALLREDUCE_ALGORITHM", "tree")
    assert comm.choose("allreduce", 100) == before  # the session's communicator is unchanged
    with fresh_communicator() as fresh:
        now = fresh.choose("allreduce", 100)
    agree(mpi_comm, [] if now == ("tree", "forced by COLLECTIVES_ALLREDUCE_ALGORITHM") else [f"fresh: {now}"])


def test_bad_environment_raises_at_creation(mpi_comm, monkeypatch, tmp_path, no_default_table):
    monkeypatch.setenv("COLLECTIVES_REDUCE_ALGORITHM", "ring")
    names = ", ".join(a for a in cc.algorithms("reduce") if a != "auto")
    with pytest.raises(ValueError, match=f"COLLECTIVES_REDUCE_ALGORITHM must be one of {names}; got 'ring'"):
        cc.Communicator()
    monkeypatch.delenv("COLLECTIVES_REDUCE_ALGORITHM")
    monkeypatch.setenv("COLLECTIVES_TUNING", str(tmp_path / "absent.json"))
    with pytest.raises(ValueError, match="absent.json"):
        cc.Communicator()
    mpi_comm.Barrier()  # every rank raised and nothing was left in flight


def test_tuning_file_steers_choose(mpi_comm, monkeypatch, tmp_path, no_default_table, plans_used):
    size, rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
    tables = {"allreduce": {str(size): [[0, "tree"], [2048, "recursive_doubling"], [1 << 20, "ring"]],
                            str(size + 1): [[0, "ring"]]},
              "allgather": {str(size + 1): [[0, "ring"]]}}
    path = write_tuning_file(tmp_path / "tuning.json", tables)  # each rank its own copy, same content
    monkeypatch.setenv("COLLECTIVES_TUNING", str(path))
    xs = [rank_input(r, 100, "float32") for r in range(size)]  # 400 bytes: the table says tree
    with fresh_communicator() as comm:
        chosen = {n: comm.choose("allreduce", n) for n in (0, 2047, 2048, (1 << 20) - 1, 1 << 20)}
        gather_choice = comm.choose("allgather", 100)
        got = comm.allreduce(xs[rank])
    problems = []
    source = f"measured table {path}"
    want = {0: "tree", 2047: "tree", 2048: "recursive_doubling", (1 << 20) - 1: "recursive_doubling", 1 << 20: "ring"}
    if chosen != {n: (a, source) for n, a in want.items()}:
        problems.append(f"allreduce choices {chosen}")
    if gather_choice[0] != conservative("allgather", 100, size) or not gather_choice[1].startswith(
            f"conservative rule: {path} has no allgather table for world size {size}"):
        problems.append(f"allgather (not measured at this world size): {gather_choice}")
    if plans_used != [("allreduce", "tree")]:
        problems.append(f"ran {plans_used}")
    if not np.array_equal(got, reference("sum", xs)):
        problems.append("allreduce through the table differs from numpy")
    agree(mpi_comm, problems)


# == tune: rows -> thresholds -> tuning file ============================================

def switch(a, b):
    """The geometric mean of two measured sizes, rounded down."""
    return math.isqrt(a * b)


@serial
def test_thresholds_winners_and_switch_points():
    rows = [row("allreduce", a, b, t) for a, b, t in [
        ("native", 8, 1.0), ("ring", 8, 5.0), ("tree", 8, 3.0),
        ("native", 64, 2.0), ("ring", 64, 1.0), ("tree", 64, 3.0),
        ("native", 512, 9.0), ("ring", 512, 4.0), ("tree", 512, 2.0),
        ("native", 4096, 30.0), ("ring", 4096, 9.0), ("tree", 4096, 8.0),
    ]]
    entries = tune.thresholds(rows[::-1], window=0)  # the order of the rows does not matter
    assert entries == [[0, "native"], [switch(8, 64), "ring"], [switch(64, 512), "tree"]]
    table = TuningTable({"allreduce": {"4": entries}})
    for nbytes, winner in [(8, "native"), (64, "ring"), (512, "tree"), (4096, "tree")]:
        assert table.lookup("allreduce", nbytes, 4) == winner
    assert 8 < entries[1][0] < 64 and 64 < entries[2][0] < 512


@serial
def test_thresholds_ignore_auto_gloo_and_missing_times():
    rows = [row("allreduce", a, b, t) for a, b, t in [
        ("native", 8, 3.0), ("ring", 8, 2.0), ("auto", 8, 0.1), ("gloo", 8, 0.2),
        ("native", 64, 5.0), ("ring", 64, 6.0), ("gloo", 64, 0.1), ("tree", 64, None),
    ]]
    assert tune.thresholds(rows, window=0) == [[0, "ring"], [switch(8, 64), "native"]]
    assert tune.thresholds([row("allreduce", "auto", 8, 1.0), row("allreduce", "gloo", 8, 1.0)]) == []


@serial
def test_thresholds_stickiness():
    assert tune.STICKINESS == 1.05
    rows = [row("broadcast", a, b, t) for a, b, t in [
        ("binomial", 8, 1.0), ("pipeline", 8, 2.0),
        ("binomial", 64, 1.04), ("pipeline", 64, 1.0),      # 4% slower: binomial keeps it
        ("binomial", 512, 1.045), ("pipeline", 512, 1.0),   # still within 5% of the best
        ("binomial", 4096, 1.10), ("pipeline", 4096, 1.0),  # 10% slower: pipeline takes over
        ("binomial", 32768, 1.03), ("pipeline", 32768, 1.0),  # from here on pipeline is sticky
    ]]
    assert tune.thresholds(rows, window=0) == [[0, "binomial"], [switch(512, 4096), "pipeline"]]
    # stickiness is towards the previous winner only: a third contender within 5% does not win
    rows = [row("broadcast", a, b, t) for a, b, t in [
        ("binomial", 8, 1.0), ("pipeline", 8, 2.0),
        ("binomial", 64, 1.2), ("pipeline", 64, 1.0), ("scatter_allgather", 64, 1.01),
    ]]
    assert tune.thresholds(rows, window=0) == [[0, "binomial"], [switch(8, 64), "pipeline"]]


@serial
def test_thresholds_smoothing_ignores_a_lucky_size():
    assert tune.SMOOTHING == 1
    # ring wins everywhere but at 512 B, where tree is 20% faster once: noise, with the
    # neighbours' ratios averaged in (tree 1.5x slower at 64 B and 4 KiB)
    rows = [row("allreduce", a, b, t) for a, b, t in [
        ("ring", 8, 1.0), ("tree", 8, 1.5),
        ("ring", 64, 1.0), ("tree", 64, 1.5),
        ("ring", 512, 1.2), ("tree", 512, 1.0),
        ("ring", 4096, 1.0), ("tree", 4096, 1.5),
        ("ring", 32768, 1.0), ("tree", 32768, 1.5),
    ]]
    assert tune.thresholds(rows) == [[0, "ring"]]
    assert tune.thresholds(rows, window=0) == [[0, "ring"], [switch(64, 512), "tree"], [switch(512, 4096), "ring"]]
    # a real change of winner persists across sizes and survives the smoothing
    rows = [row("allreduce", a, b, t) for a, b, t in [
        ("ring", 8, 1.0), ("tree", 8, 2.0),
        ("ring", 64, 1.0), ("tree", 64, 2.0),
        ("ring", 512, 2.0), ("tree", 512, 1.0),
        ("ring", 4096, 2.0), ("tree", 4096, 1.0),
        ("ring", 32768, 2.0), ("tree", 32768, 1.0),
    ]]
    assert tune.thresholds(rows) == [[0, "ring"], [switch(64, 512), "tree"]]


@serial
def test_tables_from_rows_groups_by_collective_and_world_size():
    rows = ([row("allreduce", "ring", 8, 1.0, 2), row("allreduce", "tree", 8, 2.0, 2)]
            + [row("allreduce", "ring", 8, 2.0, 3), row("allreduce", "tree", 8, 1.0, 3)]
            + [row("reduce", "binomial", 8, 2.0, 3), row("reduce", "native", 8, 1.0, 3)]
            + [row("allgather", "auto", 8, 1.0, 3)])  # nothing tunable: no table
    assert tune.tables_from_rows(rows) == {"allreduce": {"2": [[0, "ring"]], "3": [[0, "tree"]]},
                                           "reduce": {"3": [[0, "native"]]}}


@serial
def test_write_merges_world_sizes(tmp_path):
    path = tmp_path / "sub" / "dir" / "tuning.json"  # parent folders are made
    first = [row("allreduce", "ring", 8, 1.0, 2), row("allreduce", "tree", 8, 2.0, 2),
             row("allreduce", "ring", 1024, 3.0, 2), row("allreduce", "tree", 1024, 1.0, 2),
             row("reduce", "binomial", 8, 1.0, 2), row("reduce", "native", 8, 2.0, 2)]
    assert tune.write(path, first, {"dtype": "float32"}) == {
        "allreduce": {"2": [[0, "ring"], [switch(8, 1024), "tree"]]}, "reduce": {"2": [[0, "binomial"]]}}
    second = [row("allreduce", "native", 8, 1.0, 3), row("allreduce", "ring", 8, 2.0, 3)]
    assert tune.write(path, second, {"dtype": "float64"}) == {"allreduce": {"3": [[0, "native"]]}}

    table = TuningTable.load(path)
    assert table.world_sizes("allreduce") == [2, 3]
    assert table.world_sizes("reduce") == [2]  # not measured the second time: kept
    assert [table.lookup("allreduce", n, 2) for n in (8, 1024)] == ["ring", "tree"]
    assert table.lookup("allreduce", 1024, 3) == "native"
    data = json.loads(path.read_text())
    assert data["format"] == 1
    assert data["measured"]["2"]["dtype"] == "float32" and data["measured"]["3"]["dtype"] == "float64"

    # measuring a world size again replaces its table
    tune.write(path, [row("allreduce", "tree", 8, 1.0, 2)], {})
    table = TuningTable.load(path)
    assert [table.lookup("allreduce", n, 2) for n in (8, 1024)] == ["tree", "tree"]
    assert table.lookup("allreduce", 8, 3) == "native"


@serial
def test_write_refuses_to_merge_into_a_broken_file(tmp_path):
    path = write_tuning_file(tmp_path / "t.json", {"allreduce": {"2": [[0, "fastest"]]}})
    before = path.read_text()
    with pytest.raises(ValueError, match=f"tuning table {path}"):
        tune.write(path, [row("allreduce", "ring", 8, 1.0, 3)], {})
    assert path.read_text() == before


# == cases ==============================================================================

@serial
@pytest.mark.parametrize("p", range(1, 9))
def test_bus_factor_is_nccl_tests(p):
    assert bus_factor("allreduce", p) == pytest.approx(2 * (p - 1) / p)
    assert bus_factor("reduce_scatter", p) == pytest.approx((p - 1) / p)
    assert bus_factor("allgather", p) == pytest.approx((p - 1) / p)
    assert bus_factor("broadcast", p) == 1
    assert bus_factor("reduce", p) == 1


@serial
@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("itemsize", [1, 4, 8])
def test_element_count(p, itemsize):
    for nbytes in [1, 7, 8, 9, 63, 64, 100, 1000, 4096, 12345]:
        # reduce_scatter: the whole buffer, whole elements per rank, at least one each
        whole = element_count("reduce_scatter", nbytes, p, itemsize)
        per_rank = whole // p
        assert whole % p == 0 and per_rank >= 1
        assert per_rank == 1 or whole * itemsize <= nbytes
        assert (per_rank + 1) * p * itemsize > nbytes  # the largest that fits
        # allgather: one rank's share of the gathered buffer
        mine = element_count("allgather", nbytes, p, itemsize)
        assert mine == per_rank
        for collective in ("allreduce", "broadcast", "reduce"):
            count = element_count(collective, nbytes, p, itemsize)
            assert count == max(1, nbytes // itemsize) and count * itemsize > nbytes - itemsize


def test_case_buffers_and_reported_size(mpi_comm):
    rank, p = mpi_comm.Get_rank(), mpi_comm.Get_size()
    for collective in cc.COLLECTIVES:
        for nbytes in (8, 100, 4096):
            case = Case(collective, nbytes, mpi_comm, "float32", "sum", False)
            assert case.nbytes == reported_bytes(collective, nbytes, p, 4)
            if collective in ("allgather", "gather"):
                assert case.out.shape == (p, case.count) and case.x.shape == (case.count,)
            elif collective == "scatter":
                assert case.out.shape == (case.count,) and case.x.shape == (p, case.count)
            elif collective == "alltoall":
                assert case.out.shape == case.x.shape == (p, case.count)
            elif collective == "reduce_scatter":
                assert case.out.shape == (case.count // p,)
            result = case.result()
            assert (result is None) == (collective in ("reduce", "gather") and rank != 0)


# == the command line ===================================================================

@serial
@pytest.mark.parametrize("text,value", [
    ("8", 8), ("64K", 64 * 1024), ("64k", 64 * 1024), ("16M", 16 * 1024**2), ("1G", 1024**3),
    ("1MiB", 1024**2), ("2KB", 2048), ("3 GiB", 3 * 1024**3), ("0", 0), ("5B", 5),
])
def test_parse_bytes(text, value):
    assert cli.parse_bytes(text) == value


@serial
@pytest.mark.parametrize("text", ["", "K", "1.5M", "-1", "8X", "1T", "1e3", "0x10", "MB8"])
def test_parse_bytes_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected a size"):
        cli.parse_bytes(text)


@serial
def test_the_shared_memory_contenders_run_on_one_node_only():
    # Across nodes `shm` raises (it needs every rank to share memory): collectives-bench
    # on a testbed of several hosts had stopped at its first case.
    args = cli.parse_args(["-c", "allreduce"])
    assert "shm" in cli.contenders("allreduce", args)
    across = cli.contenders("allreduce", args, one_node=False)
    assert "shm" not in across and "ring" in across and "hierarchical" in across


@serial
def test_sizes_and_defaults():
    assert cli.sizes(8, 4096, 8) == [8, 64, 512, 4096]
    assert cli.sizes(3, 100, 3) == [3, 9, 27, 81]
    assert cli.sizes(5, 5, 2) == [5]
    args = cli.parse_args(["-c", "allreduce,broadcast", "-b", "64K", "-e", "1M", "-o", "avg", "--tune"])
    assert args.collectives == ["allreduce", "broadcast"] and args.begin == 65536 and args.end == 1 << 20
    assert args.tune == "collectives-tuning.json" and args.algorithms is None
    assert cli.parse_args([]).collectives == list(cc.COLLECTIVES)
    assert cli.parse_args(["-a", "ring,native"]).algorithms == ["ring", "native"]


@serial
@pytest.mark.parametrize("argv,message", [
    (["-c", "alltoallw"], "--collectives: 'alltoallw'"),
    (["-c", "alltoallv", "--tune"], "--collectives: alltoallv has per-peer counts"),
    (["-a", "fastest"], "--algorithms: 'fastest'"),
    (["-c", "broadcast", "-a", "ring"], "--algorithms: 'ring' is not an algorithm of broadcast"),
    (["-f", "1"], "--factor >= 2"),
    (["-b", "1K", "-e", "8"], "--begin <= --end"),
    (["-b", "0"], "1 <= --begin"),
    (["-o", "avg", "-d", "int32"], "--op/--dtype"),
    (["-o", "max", "-d", "complex64"], "--op/--dtype"),
    (["-o", "mean"], "invalid choice"),
    (["-d", "bfloat16"], "invalid choice"),
    (["-b", "12Q"], "expected a size"),
    (["--peers", "nccl"], "--peers"),
    (["--rounds", "0"], "--rounds"),
    (["--min-iters", "5", "--max-iters", "2"], "--max-iters"),
])
def test_bad_arguments_exit_with_2(capsys, argv, message):
    with pytest.raises(SystemExit) as caught:
        cli.parse_args(argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


FAST = ["--budget", "0.002", "--warmup", "1", "--min-iters", "2", "--max-iters", "3", "--rounds", "2",
        "--no-progress", "--no-bound"]  # the memory probe streams 192 MiB per rank: once, in test_main_end_to_end
ROW_KEYS = {"collective", "algorithm", "bytes", "world_size", "dtype", "time_us", "p50_us", "p99_us",
            "algbw_GBps", "busbw_GBps", "wrong"}


def check_rows(rows, p, requested_sizes, problems, tuned=False, checked=True, device=False):
    """The rows of a ``-c all`` run with float32: every contender once per size
    (``auto`` only when not tuning; on ``device`` buffers, not shm, which runs on host
    arrays only), and ``wrong`` 0 (``--check``) or None."""
    groups = {}
    for r in rows:
        missing = ROW_KEYS - set(r)
        if missing:
            problems.append(f"row without {sorted(missing)}: {r}")
            return
        groups.setdefault((r["collective"], r["bytes"]), []).append(r)
    want_groups = {(c, reported_bytes(c, s, p, 4)) for c in cc.COLLECTIVES for s in requested_sizes}
    if set(groups) != want_groups:
        problems.append(f"(collective, bytes) {sorted(groups)}, expected {sorted(want_groups)}")
    for (collective, nbytes), group in groups.items():
        names = sorted(r["algorithm"] for r in group)
        want = sorted(a for a in cc.algorithms(collective) if not (tuned and a == "auto")
                      and not (device and (collective, a) in SHARED_MEMORY)
                      and not (not device and (collective, a) in PEER_READS))
        if names != want:
            problems.append(f"{collective} {nbytes}: algorithms {names}, expected {want}")
        for r in group:
            label = f"{collective}/{r['algorithm']} {nbytes}"
            if r["world_size"] != p or r["dtype"] != "float32":
                problems.append(f"{label}: world_size {r['world_size']}, dtype {r['dtype']}")
            if r["wrong"] != (0 if checked else None):
                problems.append(f"{label}: wrong = {r['wrong']}")
            if not 0 < r["p50_us"] <= r["p99_us"] or not r["time_us"] > 0:
                problems.append(f"{label}: time_us {r['time_us']} p50 {r['p50_us']} p99 {r['p99_us']}")
            if r["algbw_GBps"] != pytest.approx(nbytes / (r["time_us"] * 1e3), rel=1e-9):
                problems.append(f"{label}: algbw {r['algbw_GBps']} for {nbytes} B in {r['time_us']} us")
            if r["busbw_GBps"] != pytest.approx(r["algbw_GBps"] * nccl_bus_factor(collective, p), rel=1e-9):
                problems.append(f"{label}: busbw/algbw = {r['busbw_GBps'] / r['algbw_GBps']}")


def test_main_end_to_end(mpi_comm, tmp_path):
    p = mpi_comm.Get_size()
    json_path, csv_path = tmp_path / "rows.json", tmp_path / "rows.csv"
    problems = []
    run_main(["-c", "all", "-b", "8", "-e", "4K", "-f", "8", "--check",
              "--json", str(json_path), "--csv", str(csv_path)] + [a for a in FAST if a != "--no-bound"], problems)
    if mpi_comm.Get_rank() == 0:
        with reported(problems):
            rows = json.loads(json_path.read_text())
            check_rows(rows, p, [8, 64, 512, 4096], problems)
            with open(csv_path, newline="") as f:
                table = list(csv.DictReader(f))
            if [(r["collective"], r["algorithm"], int(r["bytes"])) for r in table] != \
                    [(r["collective"], r["algorithm"], r["bytes"]) for r in rows]:
                problems.append("the CSV rows differ from the JSON rows")
            for r in rows:
                mem = r.get("extra_mem_bytes")
                if (mem is None) != (r["algorithm"] == "native") or (mem is not None and mem < 0):
                    problems.append(f"{r['collective']}/{r['algorithm']}: extra_mem_bytes {mem}")
                if r["algorithm"] == "auto" and r["chosen"] not in cc.algorithms(r["collective"])[:-1]:
                    problems.append(f"{r['collective']} auto chose {r['chosen']!r}")
                has_bound = p > 1 and r["collective"] in ("allreduce", "reduce_scatter", "allgather", "broadcast")
                if has_bound != (r["bound_us"] is not None) or \
                        (has_bound and r["vs_bound"] != pytest.approx(r["time_us"] / r["bound_us"], rel=1e-9)):
                    problems.append(f"{r['collective']}/{r['algorithm']}: bound_us {r['bound_us']}, "
                                    f"vs_bound {r['vs_bound']}")
    else:
        if json_path.exists() or csv_path.exists():
            problems.append("a rank other than 0 wrote files")
    agree(mpi_comm, problems)


@pytest.mark.parametrize("device", ["host", "standin"])
def test_alltoallv_is_benchmarked_on_request_and_never_tuned(mpi_comm, tmp_path, device):
    """-c alltoallv (uneven blocks, sim.alltoallv_counts) is timed and checked against
    MPI_Alltoallv; 'all' leaves it out, and --tune refuses it."""
    p = mpi_comm.Get_size()
    json_path = tmp_path / "rows.json"
    problems = []
    run_main(["-c", "alltoallv", "-b", "8", "-e", "4K", "-f", "8", "--check", "--device", device,
              "--json", str(json_path)] + FAST, problems)
    if mpi_comm.Get_rank() == 0:
        with reported(problems):
            rows = json.loads(json_path.read_text())
            if sorted({r["bytes"] for r in rows}) != [reported_bytes("alltoallv", s, p, 4) for s in (8, 64, 512, 4096)]:
                problems.append(f"sizes {sorted({r['bytes'] for r in rows})}")
            for r in rows:
                if r["wrong"] != 0 or r["algorithm"] not in cc.algorithms("alltoallv"):
                    problems.append(f"alltoallv/{r['algorithm']} {r['bytes']}: wrong = {r['wrong']}")
                if r["busbw_GBps"] != pytest.approx(r["algbw_GBps"] * nccl_bus_factor("alltoallv", p), rel=1e-9):
                    problems.append(f"alltoallv/{r['algorithm']}: busbw/algbw = {r['busbw_GBps'] / r['algbw_GBps']}")
            if sorted({r["algorithm"] for r in rows}) != sorted(cc.algorithms("alltoallv")):
                problems.append(f"algorithms {sorted({r['algorithm'] for r in rows})}")
    agree(mpi_comm, problems)
    with pytest.raises(SystemExit):
        cli.parse_args(["-c", "alltoallv", "--tune", str(tmp_path / "t.json")])
    assert "alltoallv" not in cli.parse_args([]).collectives


def test_main_plot(mpi_comm, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "busbw.png"
    problems = []
    run_main(["-c", "allreduce,allgather", "-a", "ring,native", "-b", "8", "-e", "64", "-f", "8",
              "--no-memory", "--plot", str(png)] + FAST, problems)
    if mpi_comm.Get_rank() == 0:
        if not png.exists() or png.stat().st_size == 0:
            problems.append(f"{png} missing or empty")
        elif png.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
            problems.append(f"{png} is not a PNG")
    agree(mpi_comm, problems)


def test_main_gloo_peer(mpi_comm, tmp_path):
    """--peers gloo adds torch.distributed's gloo, measured and checked in the same run."""
    pytest.importorskip("torch")
    json_path = tmp_path / "gloo.json"
    problems = []
    run_main(["-c", "allreduce,broadcast,allgather,reduce", "-a", "ring,native", "-b", "64", "-e", "64K",
              "-f", "1024", "--peers", "gloo", "--check", "--no-memory", "--json", str(json_path)] + FAST, problems)
    if mpi_comm.Get_rank() == 0:
        with reported(problems):
            rows = json.loads(json_path.read_text())
            gloo = {(r["collective"], r["bytes"]) for r in rows if r["algorithm"] == "gloo"}
            wanted = {(c, r["bytes"]) for r in rows for c in ("allreduce", "broadcast", "allgather")
                      if r["collective"] == c}
            if gloo != wanted:  # gloo where torch.distributed has the collective, nowhere else
                problems.append(f"gloo rows {sorted(gloo)}, expected {sorted(wanted)}")
            for r in rows:
                if r["wrong"] != 0 or not r["time_us"] > 0:
                    problems.append(f"{r['collective']}/{r['algorithm']}/{r['bytes']}: {r['wrong']} wrong")
    agree(mpi_comm, problems)


def test_main_deterministic_contender(mpi_comm, tmp_path):
    """--deterministic times what deterministic mode runs, checked, in the same run."""
    json_path = tmp_path / "det.json"
    problems = []
    run_main(["-c", "allreduce,allgather,reduce", "-a", "ring,native", "-b", "64", "-e", "64K", "-f", "1024",
              "--deterministic", "--check", "--no-memory", "--json", str(json_path)] + FAST, problems)
    if mpi_comm.Get_rank() == 0:
        with reported(problems):
            rows = json.loads(json_path.read_text())
            det = {(r["collective"], r["bytes"]): r for r in rows if r["algorithm"] == "deterministic"}
            if sorted(det) != sorted((c, b) for c in ("allreduce", "reduce") for b in (64, 65536)):
                problems.append(f"deterministic rows {sorted(det)}")
            for r in det.values():
                if r["chosen"] != "direct" or r["wrong"] != 0 or not r["time_us"] > 0:
                    problems.append(f"{r['collective']} {r['bytes']}: chose {r['chosen']}, {r['wrong']} wrong")
    agree(mpi_comm, problems)


def test_main_tune(mpi_comm, tmp_path, monkeypatch, no_default_table):
    p, rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
    path, json_path = tmp_path / "tuning.json", tmp_path / "rows.json"
    other = str(p + 1)  # a world size measured before: the run must keep it
    if rank == 0:
        write_tuning_file(path, {"allreduce": {other: [[0, "ring"]]}})
    problems = []
    run_main(["-c", "all", "-b", "8", "-e", "4K", "-f", "8", "--no-memory",
              "--tune", str(path), "--json", str(json_path)] + FAST, problems)
    text = None
    if rank == 0:
        with reported(problems):
            table = TuningTable.load(path)
            rows = json.loads(json_path.read_text())
            check_rows(rows, p, [8, 64, 512, 4096], problems, tuned=True, checked=False)
            for collective in cc.COLLECTIVES:
                if p not in table.world_sizes(collective):
                    problems.append(f"{collective}: no table for world size {p}")
            if table.world_sizes("allreduce") != sorted([p, p + 1]):
                problems.append(f"allreduce world sizes {table.world_sizes('allreduce')}: the earlier one was dropped")
            # at every measured size the file picks the rule's winner, a contender measured there
            times = {(r["collective"], r["bytes"], r["algorithm"]): r["time_us"] for r in rows}
            for collective in cc.COLLECTIVES:
                for nbytes, winner in tune.winners([r for r in rows if r["collective"] == collective]):
                    pick = table.lookup(collective, nbytes, p)
                    if pick != winner or (collective, nbytes, pick) not in times:
                        problems.append(f"{collective} {nbytes}: table picks {pick}; the rule says {winner}")
            text = path.read_text()
    agree(mpi_comm, problems)  # every rank stops here if rank 0 found something wrong
    # every rank loads the same file through COLLECTIVES_TUNING: choose follows it
    text = mpi_comm.bcast(text, root=0)
    mine = tmp_path / "copy.json"
    mine.write_text(text)
    monkeypatch.setenv("COLLECTIVES_TUNING", str(mine))
    with fresh_communicator() as comm:
        choices = {c: comm.choose(c, 100) for c in cc.COLLECTIVES}
    table = TuningTable.load(mine)
    for collective, choice in choices.items():
        if choice != (table.lookup(collective, 100, p), f"measured table {mine}"):
            problems.append(f"{collective}: choose gave {choice}")
    agree(mpi_comm, problems)


def test_main_on_the_stand_in_device(mpi_comm, tmp_path, monkeypatch, no_default_table):
    """--device standin: every collective and algorithm on device buffers, checked against
    MPI; native is MPI on host copies; memory is not measured (tracemalloc cannot see a
    device); --tune writes device tables, which choose(device=True) then follows."""
    p, rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
    json_path, path = tmp_path / "rows.json", tmp_path / "tuning.json"
    problems = []
    run_main(["-c", "all", "-b", "8", "-e", "4K", "-f", "8", "--check", "--device", "standin",
              "--json", str(json_path)] + FAST, problems)
    run_main(["-c", "allreduce", "-b", "8", "-e", "4K", "-f", "8", "--device", "standin", "--tune", str(path)]
             + FAST, problems)
    text = None
    if rank == 0:
        with reported(problems):
            rows = json.loads(json_path.read_text())
            check_rows(rows, p, [8, 64, 512, 4096], problems, device=True)
            for r in rows:
                if r["device"] != "standin" or r["extra_mem_bytes"] is not None:
                    problems.append(f"{r['collective']}/{r['algorithm']}: device {r['device']}, "
                                    f"mem {r['extra_mem_bytes']}")
            data = json.loads(path.read_text())
            if data.get("tables") or str(p) not in data.get("device_tables", {}).get("allreduce", {}):
                problems.append(f"--tune --device wrote {sorted(data)}: expected device tables only")
            text = path.read_text()
    agree(mpi_comm, problems)
    text = mpi_comm.bcast(text, root=0)
    mine = tmp_path / "copy.json"
    mine.write_text(text)
    monkeypatch.setenv("COLLECTIVES_TUNING", str(mine))
    with fresh_communicator() as comm:
        chosen, why = comm.choose("allreduce", 100, device=True)
        host = comm.choose("allreduce", 100)
    table = TuningTable.load(mine, "device_tables")
    if (chosen, why) != (table.lookup("allreduce", 100, p), f"measured table {mine} (device_tables)") or \
            not host[1].startswith("conservative rule:"):
        problems.append(f"choose: device {chosen, why}, host {host}")
    agree(mpi_comm, problems)


def test_gpu_benchmark_runs_on_the_stand_in(mpi_comm, tmp_path):
    """bench/gpu_paths.py --quick on the stand-in: kernels against the copy, pipelined
    against whole messages, IPC against staging, written as JSON."""
    from bench_scripts import load

    gpu = load("gpu_paths")

    path = tmp_path / "gpu.json"
    problems = []
    with reported(problems):
        if gpu.main(["--device", "standin", "--quick", "--json", str(path)]) != 0:
            problems.append("bench/gpu_paths.py returned non-zero")
    if mpi_comm.Get_rank() == 0:
        with reported(problems):
            rows = json.loads(path.read_text())["rows"]
            kernels = {r["contender"] for r in rows if r["measure"] == "kernels"}
            if "device-to-device copy" not in kernels or "reduce sum bfloat16" not in kernels:
                problems.append(f"kernel rows {sorted(kernels)}")
            allreduce = {r["contender"] for r in rows if r["measure"] == "allreduce"}
            if mpi_comm.Get_size() > 1 and allreduce != {"staged, pipelined", "staged, whole messages",
                                                          "ipc, pipelined"}:
                problems.append(f"allreduce rows {sorted(allreduce)}")
    agree(mpi_comm, problems)


def test_check_catches_a_wrong_result(mpi_comm, tmp_path, monkeypatch):
    """One algorithm's result is corrupted on rank 0 and on the last rank (one element
    each, every call, after the real call): every rank must report it and exit 1."""
    p, rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
    corrupted = {0, p - 1}
    real = Case.ours

    def ours(self, comm, algorithm):
        call = real(self, comm, algorithm)
        if algorithm != "ring" or self.rank not in corrupted:
            return call

        def wrong():
            call()
            self.result().reshape(-1)[0] += 1

        return wrong

    monkeypatch.setattr(Case, "ours", ours)
    json_path = tmp_path / "rows.json"
    problems = []
    run_main(["-c", "allreduce,allgather", "-a", "ring,tree", "-b", "64", "-e", "64", "--check",
              "--json", str(json_path)] + FAST, problems, want=1)
    if rank == 0:
        with reported(problems):
            rows = json.loads(json_path.read_text())
            got = {(r["collective"], r["algorithm"]): r["wrong"] for r in rows}
            want = {("allreduce", "native"): 0, ("allreduce", "ring"): len(corrupted), ("allreduce", "tree"): 0,
                    ("allgather", "native"): 0, ("allgather", "ring"): len(corrupted)}
            if got != want:
                problems.append(f"wrong per row {got}, expected {want}")
    agree(mpi_comm, problems)


# == timing =============================================================================

def test_combine_against_numpy(mpi_comm):
    rank = mpi_comm.Get_rank()
    rng = np.random.default_rng(1234 + rank)
    samples = rng.uniform(1e-6, 1e-3, 41) * (1 + rank)  # rank-dependent
    stats = timing.combine(mpi_comm, samples)
    everyone = np.array(mpi_comm.allgather(samples))  # (ranks, calls), gathered by pickling
    means = [float(np.mean(s)) for s in everyone]
    slowest = np.max(everyone, axis=0)  # a call is done when its last rank is
    want = {"time_us": np.mean(means) * 1e6, "min_us": min(means) * 1e6, "max_us": max(means) * 1e6,
            "p50_us": np.median(slowest) * 1e6, "p99_us": np.quantile(slowest, 0.99) * 1e6}
    problems = [f"{k}: {stats[k]} != {v}" for k, v in want.items() if stats[k] != pytest.approx(v, rel=1e-12)]
    if stats["iters"] != 41:
        problems.append(f"iters {stats['iters']}")
    if mpi_comm.allgather(stats) != [stats] * mpi_comm.Get_size():
        problems.append("ranks got different statistics")
    agree(mpi_comm, problems)


def test_interleaved_runs_every_call_in_rotating_order(mpi_comm):
    log = []
    calls = {name: (lambda name=name: log.append(name)) for name in "abc"}
    iters = {"a": 7, "b": 3, "c": 4}
    samples = timing.interleaved(mpi_comm, calls, iters, rounds=3)
    problems = []
    if {k: v.size for k, v in samples.items()} != iters or {k: log.count(k) for k in "abc"} != iters:
        problems.append(f"samples {[(k, v.size) for k, v in samples.items()]}, calls {log}")
    # three rounds in the orders abc, bca, cab; shares (a, b, c) 3,1,2 then 2,1,1 then 2,1,1
    want = list("aaabcc") + list("bcaa") + list("caab")
    if log != want:
        problems.append(f"order {''.join(log)}, expected {''.join(want)}")
    n = timing.iterations(mpi_comm, lambda: None, warmup=1, budget_s=0.0, min_iters=4, max_iters=9)
    if mpi_comm.allgather(n) != [4] * mpi_comm.Get_size():
        problems.append(f"iterations with no budget: {n}, expected min_iters")
    n = timing.iterations(mpi_comm, lambda: None, warmup=1, budget_s=1e6, min_iters=4, max_iters=9)
    if n != 9:
        problems.append(f"iterations with a large budget: {n}, expected max_iters")
    agree(mpi_comm, problems)


def test_auto_keeps_float16_reductions_off_native_from_64_kib(comm):
    """MPI reduces float16 in software loops (20x slower than ours here): where the table
    says native, auto hands MPI a float16 reduction only below FLOAT16_NATIVE_UP_TO bytes,
    and choose(dtype=) says so; an override to native is obeyed."""
    from collectives.calls import FLOAT16_NATIVE_UP_TO, resolve

    always_native = comm.dup()
    try:
        always_native._ctx.selector = Selector(Job(comm.size), Settings(overrides={}))
        always_native._ctx.selector.explain = lambda collective, nbytes, device=False: ("native", "stub table")
        always_native._ctx.selector.choose = lambda collective, nbytes, device=False: "native"
        big, f16 = FLOAT16_NATIVE_UP_TO, np.dtype("float16")
        for collective in ("allreduce", "reduce", "reduce_scatter"):
            chosen, why = always_native.choose(collective, big, dtype="float16")
            assert chosen != "native" and "float16" in why
            assert resolve(always_native._ctx, collective, "auto", big, f16) == chosen
            # small: MPI's latency wins
            assert resolve(always_native._ctx, collective, "auto", big - 2, f16) == "native"
            assert always_native.choose(collective, big, dtype="float32")[0] == "native"
            assert resolve(always_native._ctx, collective, "native", big, f16) == "native"  # asked for: given
        assert always_native.choose("broadcast", big, dtype="float16")[0] == "native"  # no reduction
        always_native._ctx.selector.overrides = {"allreduce": "native"}  # COLLECTIVES_ALLREDUCE_ALGORITHM=native
        assert resolve(always_native._ctx, "allreduce", "auto", big, f16) == "native"
    finally:
        always_native.free()


@serial
def test_the_memory_traffic_bounds():
    """Bytes the ranks read and write at the least, per rank (collectives.tools.bench.membound)."""
    from collectives.tools.bench import membound

    n = 1 << 20
    assert membound.traffic("allreduce", n, 2) == 2.5 * n  # its half of both inputs, its half out, the other half in
    assert membound.traffic("allreduce", n, 4) == 2.75 * n
    assert membound.traffic("reduce_scatter", n, 4) == 1.25 * n
    assert membound.traffic("allgather", n, 4) == 2 * n
    assert membound.traffic("broadcast", n, 4) == 1.5 * n  # 3 ranks read and write n; the root idles
    assert membound.traffic("gather", n, 4) is None and membound.traffic("allreduce", n, 1) is None
    assert membound.bound_us("allreduce", n, 2, 2.5e9) == pytest.approx(n / 1e9 * 1e6)
    assert membound.bound_us("allreduce", n, 2, None) is None


# -- the node-to-node link benchmark (collectives.tools.bench.link) ------------------------------------------
def test_link_rate_every_node_to_the_next_and_the_summary(tmp_path):
    """With the ranks declared as nodes (uneven ones too), every node sends to the next
    at once; the rate is positive and finite, agreed by every rank, and the summary sets
    a benchmark row against it. On one node there is no rate."""
    from mpi4py import MPI

    from collectives.tools.bench import link

    world = MPI.COMM_WORLD
    size = world.Get_size()
    if size == 1:
        assert link.measure(cc.Communicator(), 1 << 10, 1) is None
        return
    layouts = [[r for r in range(size)], [r * 3 // size for r in range(size)]]  # one rank per node; uneven
    problems = []
    for labels in layouts:
        comm = cc.Communicator(nodes=labels)
        rate = link.measure(comm, 64 << 10, 2)
        rates = world.allgather(rate)
        if not (rate and math.isfinite(rate) and rate > 0 and all(r == rates[0] for r in rates)):
            problems.append(f"layout {labels}: rates {rates}")
        comm.free()
    agree(world, problems)
    if world.Get_rank() == 0:
        (tmp_path / "link.json").write_text(json.dumps({"layout": "2x2", "link_Bps": 1e8}))
        rows = [{"collective": "allreduce", "algorithm": a, "layout": "2x2", "bytes": 1 << 24,
                 "busbw_GBps": 0.09, "time_us": t} for a, t in (("ring", 2e5), ("hierarchical", 1e5), ("native", 3e5))]
        (tmp_path / "bench.json").write_text(json.dumps(rows))
        table = link.summary([str(tmp_path / "link.json"), str(tmp_path / "bench.json")])
        assert "link 100.0 MB/s" in table and "(90%)" in table and "2.00x" in table and "3.00x hierarchical" in table
