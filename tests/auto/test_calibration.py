"""``auto`` on a machine with no measured table (collectives.calibration): the cost
model calibrated when a Communicator is made, cached per user, skipped where a table
matches or ``COLLECTIVES_CALIBRATE=0``, the same on every rank, and named by
``comm.choose``.

The suite runs with ``COLLECTIVES_CALIBRATE=0`` (tests/conftest.py); the tests here turn
it on for the communicators they make, with a cache folder of their own. Expected
values are computed here from the calibration's own figures with the closed forms
(the interpolation) or by the independent means named at each test. Tests marked
``serial`` send no messages; the others run under every world size and agree on their
findings.
"""

import json
import multiprocessing
import os

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc
import collectives.auto as auto
from collectives.algorithms import BUILDERS
from collectives.auto import Job, calibration
from collectives.auto import table as auto_table
from collectives.auto.calibration import Calibration

from conftest import agree

WORLD = MPI.COMM_WORLD
serial = pytest.mark.serial
needs_peers = pytest.mark.skipif(WORLD.Get_size() < 2, reason="one rank has nothing to calibrate")

FINGERPRINT = {"cpu": "Test CPU", "cpus": 2, "mpi": "MPICH 5.0.2", "nodes": 1, "ranks_per_node": 4}


def made_up(**kw):
    """A calibration with round figures (as measured on a machine like this one)."""
    figures = dict(alpha=20e-6, beta=0.2e-9, gamma=0.1e-9, mpi_alpha=2e-6, fingerprint=FINGERPRINT, key="4",
                   seconds=0.3, measured_at=1.8e9,
                   native={c: [[64 << 10, 100e-6], [1 << 20, 1e-3], [8 << 20, 12e-3]] for c in calibration.NATIVE})
    figures.update(kw)
    return Calibration(**figures)


@pytest.fixture
def calibrating(monkeypatch, tmp_path):
    """Calibration on, every rank's cache in rank 0's folder, no packaged table, no rule."""
    folder = WORLD.bcast(str(tmp_path), root=0)
    monkeypatch.setenv(calibration.CALIBRATE_ENV, "1")
    monkeypatch.setenv(calibration.CACHE_ENV, folder)
    monkeypatch.setattr(auto_table, "DEFAULT_TABLE", tmp_path / "no-table.json")
    for variable in (auto.TUNING_ENV, auto.RULE_ENV):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv(auto.QUIET_ENV, "1")
    return folder


# == serial: the figures, the choice, the cache =================================================

@serial
def test_native_times_interpolate_between_the_sizes_measured():
    c = made_up(native={"allreduce": [[100, 1.0], [200, 3.0], [400, 4.0]]})
    assert c.native_time("allreduce", 150) == pytest.approx(2.0)
    assert c.native_time("allreduce", 300) == pytest.approx(3.5)
    assert c.native_time("allreduce", 800) == pytest.approx(6.0)  # along the last two beyond them
    assert c.native_time("allreduce", 50) == pytest.approx(0.0)  # clamped at 0 below
    assert c.native_time("gather", 1000) is None


@serial
def test_the_correction_interpolates_in_the_logarithm_of_the_size():
    c = made_up(ours={"allreduce": {"ring": [[1 << 16, 2.0], [1 << 20, 3.0], [1 << 22, 6.0]]},
                      "allgather": {"bruck": [[1 << 16, 5.0]]}})
    predicted = {1 << 16: 1.0, 1 << 20: 1.0, 1 << 22: 2.0}  # factors 2, 3, 3
    factor = c.correction(predicted.__getitem__, 1 << 18)  # halfway between 2^16 and 2^20 in the logarithm
    assert factor == pytest.approx(2.5)
    assert c.correction(predicted.__getitem__, 1 << 10) == pytest.approx(2.0)  # below: the nearest
    assert c.correction(predicted.__getitem__, 1 << 21) == pytest.approx(3.0)
    assert c.correction(lambda b: 1.0, 1 << 30) == pytest.approx(6.0)  # above: the nearest
    assert c.correction(lambda b: 2.0, 1 << 30, "allgather", "bruck") == pytest.approx(2.5)  # another's own
    assert c.correction(lambda b: 1.0, 1 << 20, "allgather", "ring") == 1.0  # not timed: no correction
    assert made_up().correction(lambda b: 1.0, 1 << 20) == 1.0


@serial
def test_the_expected_times_of_the_library_s_algorithms():
    model = {"ring": 1.0, "direct": 2.0, "bruck": 4.0}  # the model's seconds at any size, made up

    def predicted(collective, nbytes):
        return dict(model) if collective == "allgather" else {"ring": 10.0}

    c = made_up(ours={"allreduce": {"ring": [[1 << 16, 20.0], [1 << 20, 40.0]]},  # 2x, then 4x the model
                      "allgather": {"ring": [[1 << 16, 3.0], [1 << 20, 3.0]],  # 3x the model
                                    "shm": [[1 << 16, 1.0], [1 << 20, 4.0]],  # not modelled: interpolated
                                    "bruck": [[1 << 16, 4.0]]}})  # left untimed past 64 KiB as too slow
    at = c.times("allgather", 1 << 16, predicted)
    # direct, not timed: scaled by the ring allreduce's correction
    assert at == pytest.approx({"ring": 3.0, "shm": 1.0, "bruck": 4.0, "direct": 2.0 * 2})
    at = c.times("allgather", 1 << 20, predicted)
    assert at == pytest.approx({"ring": 3.0, "shm": 4.0, "direct": 2.0 * 4})  # bruck is out past its last timing
    half = (1 << 16) + ((1 << 20) - (1 << 16)) // 2
    assert c.times("allgather", half, predicted)["shm"] == pytest.approx(2.5)
    assert made_up().times("allgather", 1 << 20, predicted) == pytest.approx(model)  # nothing timed: the model


@serial
def test_which_calls_are_timed(monkeypatch):
    # A fake clock that only the calls advance, so what is timed is exact: a call of the
    # k-th algorithm below costs k x 0.1 ns per byte, direct's 40x that.
    clock = [0.0]
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock[0])
    order = ["native", "shm", "ring", "recursive_halving", "recursive_doubling", "direct", "bruck", "binomial",
             "scatter_allgather"]
    made = []

    def cost(name, nbytes):
        return nbytes * 0.1e-9 * (order.index(name) + 1) * (40 if name == "direct" else 1)

    def timer(collective, name, nbytes):
        made.append((collective, name, nbytes))

        def call():
            clock[0] += cost(name, nbytes)
        return call

    def timed_sizes(collective, name):
        return sorted({b for c, a, b in made if (c, a) == (collective, name)})

    native, ours = calibration._time_calls(MPI.COMM_SELF, timer, calibration.TIMED)
    KiB, MiB = 1 << 10, 1 << 20
    assert timed_sizes("allreduce", "native") == [64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB]
    assert timed_sizes("reduce", "native") == [64 * KiB, MiB, 4 * MiB]
    # From 4 MiB, the library's two fastest at the size before, where a call would take under 5 ms:
    assert timed_sizes("allreduce", "shm") == [64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB]  # 3.4 ms at 16 MiB
    assert timed_sizes("allreduce", "ring") == [64 * KiB, 256 * KiB, MiB, 4 * MiB]  # 5.0 ms at 16 MiB
    assert timed_sizes("allreduce", "recursive_halving") == [64 * KiB, 256 * KiB, MiB]  # third at 1 MiB
    assert timed_sizes("allreduce", "direct") == [64 * KiB]  # 6.3 ms at 256 KiB: never again
    assert timed_sizes("reduce", "binomial") == [64 * KiB, MiB, 4 * MiB]
    assert ours["allreduce"]["direct"] == [[64 * KiB, pytest.approx(cost("direct", 64 * KiB))]]
    assert native["allreduce"][-1] == [16 * MiB, pytest.approx(cost("native", 16 * MiB))]
    # What BUDGET leaves out, once spent, is the largest sizes, of every collective.
    monkeypatch.setattr(calibration, "BUDGET", 0.05)
    made.clear()
    native, ours = calibration._time_calls(MPI.COMM_SELF, timer, calibration.TIMED)
    for collective, sizes in calibration.NATIVE_AT.items():
        timed = timed_sizes(collective, "native")
        assert timed == list(sizes[:len(timed)]), (collective, timed)
    assert max(b for _, _, b in made) < 16 * MiB


@serial
def test_the_calibrated_choice():
    c = made_up()
    size = 4
    for collective in ("gather", "scatter", "alltoall", "alltoallv"):  # MPI's own: not timed, not modelled
        assert auto.calibrated_choice(c, collective, 64 << 20, size)[0] == "native"
    choice, why = auto.calibrated_choice(c, "allreduce", (64 << 10) - 1, size)
    assert choice == "native" and "native below 64 KiB" in why
    assert why.startswith("calibrated model (Test CPU, 2 CPUs, MPICH 5.0.2, 1x4): this machine and layout")
    # Above: the fastest expected of ours against MPI's timed time, 1.1x needed.
    c.ours = {"allreduce": {"ring": [[64 << 10, 300e-6], [1 << 20, 1.5e-3], [8 << 20, 10e-3]],
                            "shm": [[64 << 10, 200e-6], [1 << 20, 0.9e-3], [8 << 20, 9e-3]]}}
    model = auto.CostModel(**c.parameters())
    for nbytes in (64 << 10, 1 << 20, 16 << 20):
        ours = c.times("allreduce", nbytes, lambda k, b: auto.predict(k, b, size, model=model)[1])
        modelled = {"ring", "direct", "recursive_doubling", "recursive_halving"}
        assert set(ours) == (modelled | {"shm"} if nbytes <= 8 << 20 else modelled)  # shm: not past its timings
        best = min(ours, key=ours.get)
        gain = c.native_time("allreduce", nbytes) / ours[best]
        choice, why = auto.calibrated_choice(c, "allreduce", nbytes, size)
        assert choice == (best if gain >= calibration.MARGIN else "native"), (nbytes, gain, why)
        assert f"({gain:.2f}x)" in why
    assert auto.calibrated_choice(c, "allreduce", 1 << 20, size)[0] == "shm"  # 1.1x faster than native's 1 ms
    slow_mpi = made_up(native={"allreduce": [[64 << 10, 1.0], [1 << 20, 16.0]]})
    assert auto.calibrated_choice(slow_mpi, "allreduce", 1 << 20, size)[0] != "native"
    fast_mpi = made_up(native={"allreduce": [[64 << 10, 1e-9], [1 << 20, 2e-9]]})
    assert auto.calibrated_choice(fast_mpi, "allreduce", 1 << 20, size)[0] == "native"


@serial
def test_the_cache_round_trip_and_what_it_refuses(tmp_path):
    environ = {calibration.CACHE_ENV: str(tmp_path)}
    c = made_up()
    path = calibration.cache_path(FINGERPRINT, "4", environ)
    assert path.parent == tmp_path and path.name.startswith("calibration-4-")
    assert calibration.cache_path({**FINGERPRINT, "cpus": 4}, "4", environ) != path  # per fingerprint
    assert calibration.cache_path(FINGERPRINT, "2x2", environ) != path  # and per layout
    assert calibration.save(c, path)
    back = calibration.load(path, FINGERPRINT, "4")
    assert back.to_json() == c.to_json() and back.source == str(path)
    assert calibration.load(path, {**FINGERPRINT, "cpus": 4}, "4") is None  # another machine's
    assert calibration.load(path, FINGERPRINT, "8") is None
    assert calibration.load(tmp_path / "missing.json", FINGERPRINT, "4") is None
    path.write_text('{"format": 1, "alpha": ')  # half a file
    assert calibration.load(path, FINGERPRINT, "4") is None
    path.write_text(json.dumps({**c.to_json(), "format": 99}))
    assert calibration.load(path, FINGERPRINT, "4") is None
    path.write_text(json.dumps({**c.to_json(), "beta": -1}))
    assert calibration.load(path, FINGERPRINT, "4") is None
    (tmp_path / "a-file").write_text("")
    assert not calibration.save(c, tmp_path / "a-file" / "x.json")  # no folder can be made there: no error


@serial
def test_the_cache_folder():
    assert calibration.cache_dir({calibration.CACHE_ENV: "/x/y"}) == calibration.Path("/x/y")
    assert calibration.cache_dir({"XDG_CACHE_HOME": "/c"}) == calibration.Path("/c/collectives")
    assert calibration.cache_dir({}) == calibration.Path(os.path.expanduser("~")) / ".cache" / "collectives"


def _write_many(path, alpha, rounds):
    c = made_up(alpha=alpha)
    for _ in range(rounds):
        assert calibration.save(c, path)


@serial
def test_two_jobs_writing_the_cache_at_once_leave_one_whole_file(tmp_path):
    """Four processes write their own calibration to the same file 100 times each while
    this one reads it: every read is one writer's whole calibration, and no temporary
    file is left behind."""
    path = tmp_path / "calibration.json"
    alphas = [1e-6, 2e-6, 3e-6, 4e-6]
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_many, args=(path, a, 100)) for a in alphas]
    for w in writers:
        w.start()
    reads = []
    while any(w.is_alive() for w in writers):
        if path.exists():
            read = calibration.load(path, FINGERPRINT, "4")
            assert read is not None, "a reader saw a broken file"
            reads.append(read.alpha)
    for w in writers:
        w.join()
        assert w.exitcode == 0
    assert set(reads) <= set(alphas)
    assert calibration.load(path, FINGERPRINT, "4").alpha in alphas
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibration.json"]


@serial
@pytest.mark.parametrize("value, wanted", [("", True), ("1", True), ("0", False)])
def test_the_switch(value, wanted):
    assert calibration.wanted({calibration.CALIBRATE_ENV: value}) is wanted
    with pytest.raises(ValueError, match="COLLECTIVES_CALIBRATE must be 1 or 0; got 'off'"):
        calibration.wanted({calibration.CALIBRATE_ENV: "off"})


@serial
def test_the_selector_calibrates_only_without_a_table_and_when_asked(tmp_path, monkeypatch):
    asked = []

    def calibrate(fingerprint, key, link):
        asked.append((fingerprint, key))
        return made_up()

    monkeypatch.setattr(auto_table, "DEFAULT_TABLE", tmp_path / "none.json")
    plain = auto.Selector.from_environment(Job(4, calibrate=calibrate), {})
    assert plain.calibration is not None and asked == [(plain.fingerprint, 4)]
    assert plain.explain("allreduce", 100)[1].startswith("calibrated model (")
    assert auto.Selector.from_environment(Job(4, calibrate=calibrate), {calibration.CALIBRATE_ENV: "0"}).calibration \
        is None
    assert auto.Selector.from_environment(Job(4, calibrate=calibrate), {auto.RULE_ENV: "conservative"}).calibration \
        is None  # a rule chosen: that rule
    assert auto.Selector.from_environment(Job(1, calibrate=calibrate), {}).calibration is None  # one rank
    forced = {auto.override_variable(c): auto.concrete(c)[0] for c in BUILDERS}
    assert auto.Selector.from_environment(Job(4, calibrate=calibrate), forced).calibration is None  # nothing to choose
    # Another rank does not want it (the agreement's bit 16 cleared): nobody calibrates.
    assert auto.Selector(Job(4, agree=lambda bits: bits & ~16, calibrate=calibrate)).calibration is None
    # A matching table: no calibration, the table decides.
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"format": 1, "tables": {"allreduce": {"4": [[0, "ring"]]}},
                                 "measured": {"4": {"fingerprint": auto.fingerprint_for_key("4")}}}))
    asked.clear()
    measured = auto.Selector.from_environment(Job(4, calibrate=calibrate), {auto.TUNING_ENV: str(table)})
    assert measured.calibration is None and asked == []
    assert measured.explain("allreduce", 1 << 20) == ("ring", f"measured table {table}")


# == under mpiexec: made when the communicator is ===============================================

@needs_peers
def test_a_communicator_calibrates_once_caches_and_every_rank_agrees(calibrating):
    comm = cc.Communicator()
    first = comm._ctx.selector.calibration
    problems = []
    if first is None or first.source != "measured now":
        problems.append(f"not measured: {first}")
    mine = json.dumps({k: v for k, v in first.to_json().items()}, sort_keys=True)
    if any(other != mine for other in WORLD.allgather(mine)):
        problems.append("the ranks' calibrations differ")
    expected_path = calibration.cache_path(comm._ctx.selector.fingerprint, comm._ctx.selector.key,
                                           {calibration.CACHE_ENV: calibrating})
    if comm.rank == 0 and not expected_path.exists():
        problems.append(f"nothing cached at {expected_path}")
    for name in ("alpha", "beta", "gamma", "mpi_alpha"):
        if not getattr(first, name) > 0:
            problems.append(f"{name} = {getattr(first, name)}")
    if sorted(first.native) != sorted(calibration.NATIVE) or any(len(p) < 2 for p in first.native.values()):
        problems.append(f"MPI's own collectives measured at too few sizes: {first.native}")
    timed = first.ours.get("allreduce", {})
    if set(timed) != set(calibration.TIMED["allreduce"]) - (set() if comm.shares_memory else {"shm"}):
        problems.append(f"the library's allreduce algorithms timed: {sorted(timed)}")
    if any(b <= a for points in timed.values() for (a, _), (b, _) in zip(points, points[1:])):
        problems.append(f"timings not in ascending sizes: {timed}")
    choice, why = comm.choose("allreduce", 16 << 20)
    if not why.startswith("calibrated model (") or "measured now" not in why:
        problems.append(f"choose: {why}")
    if comm.choose("allreduce", 1000)[0] != "native" or comm.choose("gather", 64 << 20)[0] != "native":
        problems.append("below 64 KiB, or for gather, auto left native")
    # the next communicator reads the cache (rank 0's, told to the others)
    again = cc.Communicator()
    second = again._ctx.selector.calibration
    if second is None or second.source != str(expected_path) or second.alpha != first.alpha:
        problems.append(f"the second communicator did not use the cache: {second and second.source}")
    if "cached in" not in again.choose("allreduce", 16 << 20)[1]:
        problems.append(f"choose does not say it was cached: {again.choose('allreduce', 16 << 20)[1]}")
    # auto's choices run and give MPI's answer
    x = np.arange(1 << 18, dtype=np.float32) % 7 + comm.rank
    got = comm.allreduce(x)
    want = np.empty_like(x)
    WORLD.Allreduce(x, want, MPI.SUM)
    if not np.array_equal(got, want):
        problems.append(f"auto ({choice}) gave a wrong result")
    comm.free()
    again.free()
    agree(WORLD, problems)


@needs_peers
def test_no_calibration_where_switched_off_or_a_table_matches(calibrating, monkeypatch, tmp_path):
    problems = []
    monkeypatch.setenv(calibration.CALIBRATE_ENV, "0")
    off = cc.Communicator()
    if off._ctx.selector.calibration is not None or not off.choose("allreduce", 16 << 20)[1].startswith("conservative"):
        problems.append(f"COLLECTIVES_CALIBRATE=0: {off.choose('allreduce', 16 << 20)}")
    off.free()
    monkeypatch.setenv(calibration.CALIBRATE_ENV, "1")
    table = WORLD.bcast(str(tmp_path / "t.json"), root=0)
    if WORLD.Get_rank() == 0:
        with open(table, "w") as f:
            json.dump({"format": 1, "tables": {"allreduce": {str(WORLD.Get_size()): [[0, "ring"]]}},
                       "measured": {str(WORLD.Get_size()): {"fingerprint": auto.fingerprint(
                           world_size=WORLD.Get_size())}}}, f)
    WORLD.Barrier()
    monkeypatch.setenv(auto.TUNING_ENV, table)
    tuned = cc.Communicator()
    if tuned._ctx.selector.calibration is not None or tuned.choose("allreduce", 16 << 20) != ("ring",
                                                                                          f"measured table {table}"):
        problems.append(f"a matching table: {tuned.choose('allreduce', 16 << 20)}")
    cached = [n for n in os.listdir(calibrating) if n.startswith("calibration-")] if WORLD.Get_rank() == 0 else []
    if cached:
        problems.append(f"something was cached: {cached}")
    tuned.free()
    agree(WORLD, problems)


@needs_peers
def test_ranks_that_disagree_on_calibrating_do_not_calibrate_nor_hang(calibrating, monkeypatch):
    if WORLD.Get_rank() == WORLD.Get_size() - 1:
        monkeypatch.setenv(calibration.CALIBRATE_ENV, "0")
    comm = cc.Communicator()
    problems = [] if comm._ctx.selector.calibration is None else ["a rank calibrated"]
    comm.free()
    agree(WORLD, problems)
