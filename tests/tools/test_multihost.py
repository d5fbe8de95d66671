"""Tests that need the multi-host testbed (collectives.tools.testbed; `make test-multihost`
runs them, as root). Elsewhere every test here skips, saying why.

- Under MPI, in a testbed job (``python -m collectives.tools.testbed run --layout HxR --
  python -m pytest --with-mpi -m "not serial" tests/tools/test_multihost.py``): MPI sees the
  layout, and every allreduce algorithm across real, shaped links equals MPI's own
  Allreduce. The testbed's run checks that the bytes crossed the links.
- Serially, from the root namespace, with the testbed up and
  ``COLLECTIVES_TESTBED_FAULTS=1``: faults on a link in the middle of a job
  (tests/harness/multihost_fault_job.py): a link cut (the library's timeout against MPI's
  stall) and a link throttled to 10 Mbit/s (stall warnings, then correct results).
"""

import dataclasses
import json
import os
import signal
import sys
import time

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc
from collectives.algorithms import PEER_READS
from collectives.tools.testbed import parse_layout

from conftest import HARNESS, agree, rank_input, same

LAYOUT = os.environ.get("COLLECTIVES_TESTBED_LAYOUT")
HERE = str(HARNESS)

in_a_testbed_job = pytest.mark.skipif(
    not LAYOUT, reason="runs inside a testbed job only (make test-multihost; collectives.tools.testbed run sets "
                       "COLLECTIVES_TESTBED_LAYOUT)")


def layout():
    hosts, ranks = LAYOUT.lower().split("x")
    return int(hosts), int(ranks)


# -- inside a testbed job --------------------------------------------------------------------
@in_a_testbed_job
def test_mpi_sees_the_layout(mpi_comm):
    hosts, ranks = layout()
    assert mpi_comm.Get_size() == hosts * ranks, f"layout {LAYOUT} but {mpi_comm.Get_size()} ranks"
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        # Host-major placement: world rank r is on host r // ranks, as local rank r % ranks.
        mine = (node.Get_size(), node.Get_rank(), node.allgather(mpi_comm.Get_rank()))
    finally:
        node.Free()
    problems = []
    rank = mpi_comm.Get_rank()
    host = rank // ranks
    if mine != (ranks, rank % ranks, list(range(host * ranks, (host + 1) * ranks))):
        problems.append(f"node communicator (size, local rank, members) = {mine}; layout {LAYOUT} "
                        f"puts rank {rank} on host {host} with ranks {host * ranks}..{(host + 1) * ranks - 1}")
    agree(mpi_comm, problems)


@in_a_testbed_job
def test_the_communicator_learns_the_layout(comm):
    hosts, ranks = layout()
    assert comm.topology == cc.Topology.uniform(hosts * ranks, ranks)
    assert comm.topology.key() == f"{hosts}x{ranks}"


@in_a_testbed_job
@pytest.mark.parametrize("algorithm", [a for a in cc.algorithms("allreduce") if a != "auto"])
@pytest.mark.parametrize("count", [1 << 20, 300_007])  # 4 MiB, and a count no rank count divides
def test_allreduce_across_hosts_equals_mpi(comm, mpi_comm, algorithm, count):
    x = rank_input(comm.rank, count, "float32")
    want = np.empty_like(x)
    mpi_comm.Allreduce(x, want)
    if algorithm == "shm" and layout()[0] > 1:  # ranks on several hosts share no memory: shm refuses them
        with pytest.raises(ValueError, match="needs every rank on one node"):
            comm.allreduce(x, algorithm=algorithm)
        return
    if ("allreduce", algorithm) in PEER_READS:  # they read device buffers in place: host arrays are refused
        with pytest.raises(ValueError, match="runs on device arrays only"):
            comm.allreduce(x, algorithm=algorithm)
        return
    got = comm.allreduce(x, algorithm=algorithm)
    problems = [] if same(got, want) else [f"{algorithm} n={count}: got {got[:4]}, MPI {want[:4]}"]
    agree(mpi_comm, problems)


# -- faults, driven from outside the job -----------------------------------------------------
FAULT_LAYOUTS = ("2x2", "4x1", "2x4")  # make test-multihost's; the last host of each is cut off
TIMEOUT = 2.0          # the library's timeout in the cut test
STALL = 5.0            # how long plain MPI is watched after the cut

faults = pytest.mark.skipif(
    os.environ.get("COLLECTIVES_TESTBED_FAULTS") != "1",
    reason="fault tests drive a testbed that is up, as root (make test-multihost sets COLLECTIVES_TESTBED_FAULTS=1)")


@dataclasses.dataclass(frozen=True)
class Fault:
    """A layout and the host whose link a test cuts or throttles: the last one."""

    layout: str

    @property
    def host(self):
        return parse_layout(self.layout)[0] - 1

    @property
    def size(self):
        hosts, ranks = parse_layout(self.layout)
        return hosts * ranks

    @property
    def cut(self):
        """The ranks on the host (block placement: host h holds ranks h·k … h·k + k - 1)."""
        ranks = parse_layout(self.layout)[1]
        return list(range(self.host * ranks, (self.host + 1) * ranks))


@pytest.fixture(params=FAULT_LAYOUTS)
def fault(request):
    return Fault(request.param)


@pytest.fixture
def testbed(fault):
    from collectives.tools import testbed
    present = testbed.net.hosts_present()
    assert set(range(fault.host + 1)) <= set(present), \
        f"COLLECTIVES_TESTBED_FAULTS=1 but the testbed has hosts {present}, not the {fault.layout} layout's"
    rate = testbed.net.read_state().get("rates", [10**9] * (fault.host + 1))[fault.host]

    def interrupted(signum, frame):  # a SIGTERM (make's timeout) unwinds too: the jobs get killed
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        yield testbed
    finally:  # the link as it was, whatever the test did to it
        signal.signal(signal.SIGTERM, previous)
        testbed.set_link(fault.host, True)
        testbed.set_rate(fault.host, rate)


def launch(testbed, fault, tmp_path, mode, seconds):
    job = testbed.start(fault.layout, [sys.executable, os.path.join(HERE, "multihost_fault_job.py"), mode,
                                       str(tmp_path), str(seconds)])
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert job.poll() is None, f"the {mode} job ended ({job.poll()}) before it was ready"
        assert time.monotonic() < deadline, f"the {mode} job was not ready within 60 s"
        time.sleep(0.02)
    return job


def reports(tmp_path, ranks):
    return {r: json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in ranks
            if (tmp_path / f"rank-{r}.json").exists()}


@faults
@pytest.mark.serial
def test_a_cut_link_raises_timeout_naming_the_cut_off_ranks(testbed, fault, tmp_path):
    from collectives.transport.liveness import ranks as name_ranks
    cut, size = fault.cut, fault.size
    others = [r for r in range(size) if r not in cut]
    job = launch(testbed, fault, tmp_path, "cut", TIMEOUT)
    try:
        time.sleep(0.3)  # some calls done: the cut falls in the middle of one
        testbed.set_link(fault.host, False)
        cut_at = time.time()
        deadline = time.monotonic() + TIMEOUT + 10
        while len(reports(tmp_path, others)) < len(others) and time.monotonic() < deadline:
            time.sleep(0.05)
        got = reports(tmp_path, range(size))
    finally:
        job.kill()  # the cut-off ranks are stuck for good: the testbed ends the job
    for r in others:
        assert r in got, f"rank {r} did not raise within {TIMEOUT + 10:g} s of the cut: {got}"
        report = got[r]
        assert report["raised"] == "CollectiveTimeoutError", report
        assert report["calls"] > 0, f"rank {r} raised in its first call: the cut was not mid-run"
        assert f"no answer within 0.5 s from {name_ranks(cut)}" in report["message"], report["message"]
        assert report["seconds"] <= TIMEOUT + 1.0, report
        print(f"{fault.layout} rank {r}: raised {report['seconds']:.2f} s after its call began, "
              f"{report['at'] - cut_at:.2f} s after the cut (timeout {TIMEOUT:g} s)")


@faults
@pytest.mark.serial
def test_a_cut_link_stalls_plain_mpi_without_an_error(testbed, fault, tmp_path):
    """What the library's timeout is for: MPI's own Allreduce neither finishes nor
    raises once a host is cut off (TCP backs off); watched for STALL seconds."""
    size = fault.size
    job = launch(testbed, fault, tmp_path, "mpi", 0)
    try:
        time.sleep(0.3)
        testbed.set_link(fault.host, False)
        cut_at = time.time()
        time.sleep(STALL)
        got = reports(tmp_path, range(size))
        still_running = job.poll() is None
    finally:
        job.kill()
    assert still_running, "the job ended by itself after the cut"
    for r in range(size):
        assert got.get(r, {}).get("raised") is None, f"MPI raised on rank {r}: {got[r]}"
        assert got[r]["completed"], f"rank {r} completed no Allreduce before the cut"
        late = [t - cut_at for t in got[r]["completed"] if t > cut_at + 0.5]
        assert not late, f"rank {r} completed Allreduces {late} s after the cut"
        print(f"{fault.layout} rank {r}: last Allreduce done {got[r]['completed'][-1] - cut_at:+.2f} s from the cut; "
              f"nothing since, no error, for {STALL:g} s")


@faults
@pytest.mark.serial
def test_a_throttled_link_warns_naming_slow_peers_and_ends_correct(testbed, fault, tmp_path):
    from collectives.transport.liveness import ranks as name_ranks
    slow, size = fault.cut, fault.size
    job = launch(testbed, fault, tmp_path, "slow", 0.5)
    try:
        time.sleep(0.2)
        testbed.set_rate(fault.host, "10mbit")
        time.sleep(3.0)
        testbed.set_rate(fault.host, "1gbit")
        (tmp_path / "restored").touch()
        code = job.wait(60)
    finally:
        job.kill()
    assert code == 0, f"the job exited {code}"
    got = reports(tmp_path, range(size))
    assert sorted(got) == list(range(size)), got
    assert all(g["wrong"] == 0 for g in got.values()), got
    warnings = [w for g in got.values() for w in g["warnings"]]
    assert warnings, "no stall warning while a link ran at 10 Mbit/s"
    named = [w for w in warnings if any(f"from {name_ranks([r])}" in w or f"for {name_ranks([r])} to" in w
                                        for r in slow)]
    assert named, f"no stall warning names a rank of the throttled host {slow}: {warnings[:5]}"
    print(f"{fault.layout}: {len(warnings)} stall warnings, {len(named)} naming ranks {slow}; e.g. {named[0]}")


@faults
@pytest.mark.serial
def test_a_job_whose_messages_do_not_cross_the_links_fails_naming_the_hosts():
    # The check every testbed job passes: a job on two hosts that sends nothing between
    # them (as MPICH does when it carries "inter-host" messages over shared memory).
    import re
    import subprocess

    from collectives.tools import testbed

    result = testbed.run("2x1", [sys.executable, "-c", "pass"], timeout=60)
    assert result.returncode == 0 and re.match(r"the job ran on 2 hosts but host 0 \(cctb-h0\) sent \d+ B",
                                               result.link_error), \
        vars(result)
    command = subprocess.run([sys.executable, "-m", "collectives.tools.testbed", "run", "--layout", "2x1", "--",
                              sys.executable,
                              "-c", "pass"], capture_output=True, text=True, timeout=120)
    assert command.returncode != 0 and "testbed: FAILED: the job ran on 2 hosts" in command.stderr, command


@faults
@pytest.mark.serial
def test_up_again_keeps_the_testbed_and_a_job_ends_only_its_own_processes(monkeypatch):
    import subprocess

    from collectives.tools import testbed

    state = testbed.net.read_state()
    hosts = testbed.net.hosts_present()
    assert len(set(state["rates"])) == 1, state  # make test-multihost's: one rate for every host
    for name in ("down", "_build"):  # up rebuilds by tearing down first: fail before anything is torn down
        monkeypatch.setattr(testbed.net, name, lambda *args, name=name: pytest.fail(f"up called {name}: it rebuilt "
                                                                                   "the testbed that was up"))
    again = testbed.net.up(len(hosts), rate=state["rates"][0])  # idempotent: nothing rebuilt
    assert testbed.net.hosts_present() == hosts and again["addresses"] == state["addresses"]
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # not the job's
    try:
        result = testbed.run("2x1", [sys.executable, "-c", "import time; time.sleep(0.2)"], timeout=60,
                             min_link_bytes=0)
        assert result.returncode == 0 and bystander.poll() is None, "the job's end took a process it did not start"
    finally:
        bystander.kill()
        bystander.wait()
