"""A short soak (``collectives.tools.soak``): a few hundred mixed collectives, sync and async
in flight together, every result checked, no request left behind. ``make soak`` runs
the long one (20 000 calls) and also bounds the memory growth, which a short run
cannot measure meaningfully.

Each test makes its own communicator (collective: every rank does) with a timeout, so
a hang fails instead of stalling the suite, and all ranks fail together (``agree``).
"""

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc
from collectives.tools import soak

from conftest import agree

pytestmark = pytest.mark.long

CALLS = 300
SEED = 20240607


def problems_in(report, comm, calls):
    """What is wrong with ``report`` (a list of lines; empty if nothing)."""
    found = []
    if report["wrong"]:
        found.append(f"{report['wrong']} wrong results: {report['wrong_first']}")
    if report["leaks"]:
        found.append(f"leaks: {report['leaks']}")
    if not report["ok"]:
        found.append("report says not ok")
    if report["world_size"] != comm.size or report["calls"] != calls:
        found.append(f"world size / calls {report['world_size']} / {report['calls']}")
    if sum(report["counts"].values()) != calls or min(report["counts"].values()) == 0:
        found.append(f"per-collective counts {report['counts']}")
    for collective, algorithms in report["algorithms"].items():
        if sum(algorithms.values()) != report["counts"][collective]:
            found.append(f"{collective}: algorithm counts {algorithms}")
        if set(algorithms) != set(cc.algorithms(collective)):
            found.append(f"{collective}: algorithms {sorted(algorithms)}")
    if not 0 < report["async"] < calls or report["async"] + report["sync"] != calls:
        found.append(f"async/sync {report['async']}/{report['sync']}")
    if not 2 <= report["max_in_flight"] <= soak.MAX_WINDOW:
        found.append(f"max in flight {report['max_in_flight']}")
    if report["checked"] != calls * comm.size or len(report["wrong_per_rank"]) != comm.size:
        found.append(f"checked {report['checked']}, wrong per rank {report['wrong_per_rank']}")
    if len(report["rss_growth_mib"]) != comm.size or min(report["rss_end_mib"]) <= 0:
        found.append(f"rss {report['rss_start_mib']} -> {report['rss_end_mib']}")
    if not report["elapsed_s"] > 0 or not report["calls_per_s"] > 0:
        found.append(f"elapsed {report['elapsed_s']}, calls/s {report['calls_per_s']}")
    return found


def same_on_every_rank(report):
    """The report is the same dict on every rank (times and RSS are gathered, not local)."""
    blob = repr(sorted(report.items()))
    return all(other == blob for other in MPI.COMM_WORLD.allgather(blob))


def test_short_soak_every_result_right_and_nothing_left_in_flight():
    comm = cc.Communicator(timeout=60)
    report = soak.run(comm, CALLS, seed=SEED)
    problems = problems_in(report, comm, CALLS)
    if not same_on_every_rank(report):
        problems.append("the report differs between ranks")
    if comm.progress.active or comm.progress.leftovers():
        problems.append("the engine holds handles or abandoned requests")
    comm.free()
    agree(MPI.COMM_WORLD, problems)


def test_the_draws_do_not_depend_on_the_rank():
    rng = np.random.default_rng(SEED)
    mine = [soak.draw(rng, i, MPI.COMM_WORLD.Get_size()).describe() for i in range(200)]
    everyone = MPI.COMM_WORLD.allgather(mine)
    agree(MPI.COMM_WORLD, [] if all(d == mine for d in everyone) else ["the draws differ between ranks"])


def test_a_wrong_result_is_caught(monkeypatch):
    """Perturb the reference of the first non-empty allreduce: every rank must count
    exactly that one wrong result, and the report must say not ok."""
    honest = soak.reference
    perturbed = []

    def reference(call, rank, size):
        expected = honest(call, rank, size)
        if not perturbed and call.collective == "allreduce" and call.count > 0:
            perturbed.append(call.index)
            expected = expected.copy()
            expected.flat[0] += 1
        return expected

    monkeypatch.setattr(soak, "reference", reference)
    comm = cc.Communicator(timeout=60)
    report = soak.run(comm, 60, seed=SEED)
    comm.free()
    problems = []
    if not perturbed:
        problems.append("no allreduce drawn")
    if report["ok"] or report["wrong"] != comm.size or report["wrong_per_rank"] != [1] * comm.size:
        problems.append(f"ok {report['ok']}, wrong {report['wrong']} {report['wrong_per_rank']}")
    if perturbed and not all(f"call {perturbed[0]}: allreduce" in w for w in report["wrong_first"]):
        problems.append(f"wrong results described as {report['wrong_first']}")
    agree(MPI.COMM_WORLD, problems)


def test_memory_limit_fails_the_report():
    comm = cc.Communicator(timeout=60)
    report = soak.run(comm, 40, seed=SEED, max_growth_mib=-1e9)  # any growth, even a shrink, is too much
    comm.free()
    agree(MPI.COMM_WORLD, [] if not report["ok"] and report["max_growth_allowed_mib"] == -1e9
          else [f"ok {report['ok']} with a limit of -1e9 MiB"])
