"""Check mode, message-size errors, timeouts and stall warnings.

Each test that breaks a communicator makes a fresh one (creating one is collective,
so every rank does), and ends with a barrier on ``MPI.COMM_WORLD`` so the ranks leave
it together. Tests that need two ranks skip at world size 1 (``make test`` runs them
at 2..8). The killed-rank test is in test_dead_rank.py.
"""

import logging
import math
import time

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc
from collectives.transport import retired

from conftest import agree, runs_here

WORLD = MPI.COMM_WORLD
needs_peers = pytest.mark.skipif(WORLD.Get_size() < 2, reason="needs at least two ranks")
LAST = WORLD.Get_size() - 1


def outcome(call):
    """``("ok", result)`` or ``(exception type name, message)``."""
    try:
        return "ok", call()
    except cc.CollectiveError as exc:
        return type(exc).__name__, str(exc)


# -- 1. check mode ---------------------------------------------------------------------
MISMATCHES = {
    # name: (what every rank calls, what the last rank calls instead, a line of the message)
    "shape": (lambda c: c.allreduce(np.ones(1024, np.float32), algorithm="ring"),
              lambda c: c.allreduce(np.ones(1000, np.float32), algorithm="ring"),
              "called allreduce(float32, shape (1000,), op 'sum', algorithm 'ring') but rank 0 called "
              "allreduce(float32, shape (1024,), op 'sum', algorithm 'ring')"),
    "same size, other shape": (lambda c: c.allgather(np.ones((4, 6))), lambda c: c.allgather(np.ones((6, 4))),
                               "shape: (4, 6) on"),
    "dtype": (lambda c: c.allreduce(np.ones(8, np.float32)), lambda c: c.allreduce(np.ones(8, np.int32)),
              "dtype: float32 on"),
    "op": (lambda c: c.allreduce(np.ones(8), op="sum"), lambda c: c.allreduce(np.ones(8), op="max"), "op: sum on"),
    "root": (lambda c: c.broadcast(np.ones(8), root=0), lambda c: c.broadcast(np.ones(8), root=LAST),
             "root: 0 on"),
    "algorithm": (lambda c: c.allreduce(np.ones(8), algorithm="ring"),
                  lambda c: c.allreduce(np.ones(8), algorithm="recursive_doubling"), "algorithm: ring on"),
    "collective": (lambda c: c.allreduce(np.ones(8)), lambda c: c.reduce(np.ones(8)), "collective: allreduce on"),
    "gather root": (lambda c: c.gather(np.ones(8), root=0), lambda c: c.gather(np.ones(8), root=LAST),
                    "root: 0 on"),
    "scatter rows": (lambda c: c.scatter(np.ones((c.size, 4))), lambda c: c.scatter(np.ones((c.size, 5))),
                     "called scatter(float64, shape (5,)"),
    "alltoall algorithm": (lambda c: c.alltoall(np.ones((c.size, 3)), algorithm="bruck"),
                           lambda c: c.alltoall(np.ones((c.size, 3)), algorithm="pairwise"), "algorithm: bruck on"),
    "blocking and async native": (lambda c: c.allreduce(np.ones(8), algorithm="native"),
                                  lambda c: c.allreduce_async(np.ones(8), algorithm="native").wait(),
                                  "how it runs: MPI blocking on"),
    # A blocking call with no timeout runs alone on a tag of its own: it never meets an
    # async one, whose messages carry its call number.
    "blocking and async ring": (lambda c: c.allreduce(np.ones(8), algorithm="ring"),
                                lambda c: c.allreduce_async(np.ones(8), algorithm="ring").wait(),
                                "how it runs: alone (blocking) on"),
    "blocking with and without a timeout": (lambda c: c.reduce(np.ones(8), algorithm="binomial"),
                                            lambda c: c.reduce(np.ones(8), algorithm="binomial", timeout=60),
                                            "how it runs: alone (blocking) on"),
    "empty and a collective": (lambda c: c.allreduce(np.ones(8)), lambda c: c.empty(8), "collective: allreduce on"),
}


@needs_peers
@pytest.mark.parametrize("name", list(MISMATCHES))
def test_check_mode_names_the_difference_on_every_rank(name):
    usual, odd, line = MISMATCHES[name]
    comm = cc.Communicator(check=True)
    kind, message = outcome(lambda: (odd if comm.rank == LAST else usual)(comm))
    problems = []
    if kind != "CollectiveMismatchError":
        problems.append(f"{kind}: {message}")
    elif line not in message or f"rank {LAST} called" not in message and f"ranks {LAST}" not in message:
        problems.append(f"message lacks {line!r}: {message}")
    if len(set(WORLD.allgather(message))) != 1:
        problems.append("the ranks' messages differ")
    # Nothing was sent: the communicator goes on working.
    if not np.array_equal(comm.allreduce(np.arange(4.0)), np.arange(4.0) * comm.size):
        problems.append("allreduce after the mismatch is wrong")
    agree(WORLD, problems)
    comm.free()


@needs_peers
def test_check_mode_catches_a_rank_that_skipped_a_call():
    comm = cc.Communicator(check=True)

    def calls():
        if comm.rank != LAST:
            comm.barrier()  # the last rank skips it: its allreduce meets the others' barrier
        comm.allreduce(np.ones(4))

    kind, message = outcome(calls)
    expected = f"rank {LAST} called allreduce(float64, shape (4,), op 'sum', algorithm "
    problems = [] if kind == "CollectiveMismatchError" and expected in message and "but rank 0 called barrier()" \
        in message else [f"{kind}: {message}"]
    agree(WORLD, problems)
    comm.free()


def test_check_mode_passes_every_valid_call(mpi_comm):
    comm = cc.Communicator(check=True, timeout=60)
    p, r = comm.size, comm.rank
    x = np.arange(10, dtype=np.int64) + r
    total = np.arange(10, dtype=np.int64) * p + p * (p - 1) // 2
    problems = []
    for algorithm in [a for a in cc.algorithms("allreduce") if runs_here(comm, "allreduce", a)]:
        if not np.array_equal(comm.allreduce(x, algorithm=algorithm), total):
            problems.append(f"allreduce {algorithm}")
    if not np.array_equal(comm.allgather(x, algorithm="bruck")[-1], np.arange(10) + p - 1):
        problems.append("allgather")
    if not np.array_equal(comm.broadcast(x.copy(), root=p - 1), np.arange(10) + p - 1):
        problems.append("broadcast")
    got = comm.reduce(x, root=0)
    if r == 0 and not np.array_equal(got, total):
        problems.append("reduce")
    if not np.array_equal(comm.reduce_scatter_async(x).wait(), np.array_split(total, p)[r]):
        problems.append("reduce_scatter")
    rows = np.stack([x + q for q in range(p)])  # row q for rank q
    got = comm.gather(x, root=p - 1, algorithm="binomial")
    if r == p - 1 and not np.array_equal(got, np.stack([np.arange(10) + q for q in range(p)])):
        problems.append("gather")
    if not np.array_equal(comm.scatter(rows, root=0), np.arange(10) + r):
        problems.append("scatter")
    if not np.array_equal(comm.alltoall(rows, algorithm="bruck"), np.stack([np.arange(10) + q + r for q in range(p)])):
        problems.append("alltoall")
    if comm.broadcast_object({"k": [1, 2]} if r == 0 else None) != {"k": [1, 2]}:
        problems.append("broadcast_object")
    comm.barrier()
    agree(mpi_comm, problems)
    comm.free()


def test_check_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_CHECK", "1")
    comm = cc.Communicator()
    assert comm.check is True
    monkeypatch.setenv("COLLECTIVES_CHECK", "maybe")
    with pytest.raises(ValueError, match="COLLECTIVES_CHECK must be 1 or 0; got 'maybe'"):
        cc.Communicator()
    comm.free()


# -- message sizes without check mode ---------------------------------------------------
@needs_peers
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "direct"])
def test_a_size_mismatch_is_an_error_on_every_rank_never_wrong_data(algorithm):
    """No timeout: ranks that received a message of the wrong size raise naming the peer
    and the step, and tell the others, which stop too (instead of waiting for them)."""
    comm = cc.Communicator(timeout=60)  # only so that a regression fails instead of hanging
    n = 1000 if comm.rank == LAST else 1024
    start = time.monotonic()
    kind, message = outcome(lambda: comm.allreduce(np.ones(n, np.float32), algorithm=algorithm))
    took = time.monotonic() - start
    problems = []
    if kind != "MessageSizeError":
        problems.append(f"{kind}: {message}")
    elif not ("step" in message and "from rank" in message) and "found a message of the wrong size" not in message:
        problems.append(f"the message names no peer, step or reporting rank: {message}")
    if took > 10:
        problems.append(f"took {took:.1f} s: the ranks waited instead of being told")
    if "step" not in "".join(WORLD.allgather(message)):
        problems.append("no rank named the step")
    later, text = outcome(lambda: comm.allreduce(np.ones(4)))
    if later != "CollectiveError" or "broken" not in text:
        problems.append(f"a broken communicator accepted a call: {later} {text}")
    agree(WORLD, problems)


# -- 2. timeouts and stalls ---------------------------------------------------------------
@pytest.mark.parametrize("timeout", [0, -1, "1", True, float("nan")])
def test_bad_timeout_is_refused_before_any_message(comm, timeout):
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        comm.allreduce(np.ones(4), timeout=timeout)
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        comm.allreduce_async(np.ones(4)).wait(timeout=timeout)
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        cc.Communicator(timeout=timeout)
    comm.barrier()


def test_timeout_from_the_environment(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_TIMEOUT", "7.5")
    monkeypatch.setenv("COLLECTIVES_STALL_WARN", "2")
    comm = cc.Communicator()
    assert (comm.timeout, comm.stall_warn) == (7.5, 2.0)
    dup = comm.dup()
    assert (dup.timeout, dup.stall_warn, dup.check) == (7.5, 2.0, False)
    assert np.array_equal(comm.allreduce(np.ones(3), timeout=math.inf), np.full(3, comm.size))
    monkeypatch.setenv("COLLECTIVES_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="COLLECTIVES_TIMEOUT must be a positive number of seconds; got 'soon'"):
        cc.Communicator()
    dup.free()
    comm.free()


def skipping_last_rank(call, timeout):
    """Every rank but the last makes ``call`` (with ``timeout``); the last rank stays
    away until they have given up. Returns this rank's (kind, message, seconds)."""
    start = time.monotonic()
    if WORLD.Get_rank() == LAST:
        time.sleep(timeout + 1.0)
        return "absent", "", 0.0
    kind, message = outcome(call)
    return kind, message, time.monotonic() - start


@needs_peers
@pytest.mark.parametrize("algorithm", ["ring", pytest.param("recursive_halving", marks=pytest.mark.long), "native"])
def test_timeout_names_step_peers_bytes_and_the_absent_rank(algorithm):
    comm = cc.Communicator()
    kind, message, took = skipping_last_rank(
        lambda: comm.allreduce(np.ones(3000), algorithm=algorithm, timeout=1.0), 1.0)
    problems = []
    if comm.rank != LAST:
        if kind != "CollectiveTimeoutError":
            problems.append(f"{kind}: {message}")
        for part in (f"rank {comm.rank}: allreduce(algorithm={algorithm!r}) call #1: Timed out after 1.0 s",
                     f"no answer within 0.5 s from rank {LAST}"):
            if part not in message:
                problems.append(f"message lacks {part!r}: {message}")
        if algorithm != "native" and not ("at step" in message and "waiting for messages from rank" in message
                                          and "B in flight" in message):
            problems.append(f"message lacks the step, peers or bytes: {message}")
        if not took < 1.0 + 1.0:
            problems.append(f"raised after {took:.2f} s, more than timeout + 1 s")
        later, text = outcome(lambda: comm.barrier())
        if later != "CollectiveError" or "broken" not in text:
            problems.append(f"the broken communicator accepted a call: {later} {text}")
    agree(WORLD, problems)


# (elements, blocking): a persistent program (4 KB), the lean executor (64 KB), the
# engine (a non-blocking call of 64 KB: its receives are posted, not probed for).
GIVEN_UP = [(1024, True), (16384, True), (16384, False)]


@needs_peers
@pytest.mark.parametrize("count,blocking", GIVEN_UP, ids=["persistent", "lean", "engine"])
def test_receives_given_up_on_keep_their_buffers(count, blocking):
    """A call that times out gives up on the receives it has posted. A cancel does not
    take on a receive that has matched its message and MPI goes on writing into its
    buffer (Intel MPI on shared memory: at the next call into MPI, a segmentation
    fault once the buffer's memory is gone), so every executor keeps them
    (``retired``) instead of dropping them with their buffers."""
    comm = cc.Communicator()
    before = retired.abandoned()  # held here, so that no new request takes one's id

    def allreduce():
        x = np.ones(count, np.float32)
        if blocking:
            return comm.allreduce(x, algorithm="ring", timeout=1.0)
        return comm.allreduce_async(x, algorithm="ring", timeout=1.0).wait()

    kind, message, _ = skipping_last_rank(allreduce, 1.0)
    problems = []
    if comm.rank != LAST:
        if kind != "CollectiveTimeoutError":
            problems.append(f"{kind}: {message}")
        elif not [r for r in retired.abandoned() if all(r is not old for old in before)]:
            problems.append("the receives given up on were dropped, and their buffers with them")
    agree(WORLD, problems)


@needs_peers
@pytest.mark.parametrize("collective,algorithm", [("alltoall", "pairwise"),
                                                  pytest.param("alltoall", "bruck", marks=pytest.mark.long),
                                                  ("alltoall", "native"),
                                                  pytest.param("scatter", "binomial", marks=pytest.mark.long)])
def test_new_collectives_time_out_naming_the_absent_rank(collective, algorithm):
    """Every other rank needs something from the absent last rank (it is the scatter's
    root), so every other rank raises within timeout + 1 s."""
    comm = cc.Communicator()
    rows = np.ones((comm.size, 500))
    if collective == "alltoall":
        call = lambda: comm.alltoall(rows, algorithm=algorithm, timeout=1.0)  # noqa: E731
    else:
        call = lambda: comm.scatter(rows, root=LAST, algorithm=algorithm, timeout=1.0)  # noqa: E731
    kind, message, took = skipping_last_rank(call, 1.0)
    problems = []
    if comm.rank != LAST:
        wanted = (f"rank {comm.rank}: {collective}(algorithm={algorithm!r}) call #1: Timed out after 1.0 s",
                  f"no answer within 0.5 s from rank {LAST}")
        if kind != "CollectiveTimeoutError" or not all(part in message for part in wanted):
            problems.append(f"{kind}: {message}")
        if not took < 1.0 + 1.0:
            problems.append(f"raised after {took:.2f} s, more than timeout + 1 s")
    agree(WORLD, problems)


@needs_peers
def test_handle_wait_timeout_and_test_after_it():
    comm = cc.Communicator(timeout=60)  # wait(timeout=) overrides the call's
    handles = []

    def call():
        handles.append(comm.broadcast_async(np.ones(100), root=LAST))
        return handles[0].wait(timeout=0.5)

    kind, message, _ = skipping_last_rank(call, 0.5)
    problems = []
    if comm.rank != LAST:
        if kind != "CollectiveTimeoutError" or "broadcast(algorithm=" not in message \
                or f"no answer within 0.5 s from rank {LAST}" not in message:
            problems.append(f"{kind}: {message}")
        again, text = outcome(handles[0].test)  # the handle keeps its error
        if (again, text) != (kind, message):
            problems.append(f"test() after the timeout gave {again}: {text}")
    agree(WORLD, problems)


@needs_peers
@pytest.mark.parametrize("algorithm", ["direct", "native"])
def test_stall_warning_names_the_late_rank_and_the_call_still_finishes(caplog, algorithm):
    comm = cc.Communicator(stall_warn=0.2)
    caplog.set_level(logging.WARNING, logger="collectives")
    if comm.rank == LAST:
        time.sleep(0.7)
    got = comm.allreduce(np.ones(64), algorithm=algorithm)  # direct: every rank waits for the late one itself
    problems = [] if np.array_equal(got, np.full(64, comm.size)) else ["wrong result"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "collectives"]
    if comm.rank != LAST:
        if algorithm == "native":  # MPI's own collective: it does not say whom it waits for
            if not any("has waited" in w and "MPI library's own collective" in w for w in warnings):
                problems.append(f"no stall warning for the native call: {warnings}")
        elif not any(LAST in peers_waited_for(w) for w in warnings):
            problems.append(f"no stall warning naming rank {LAST}: {warnings}")
    agree(WORLD, problems)
    comm.free()


def peers_waited_for(message):
    """The ranks after "waiting for messages from" in a message ("ranks 0-2, 5" -> {0, 1, 2, 5})."""
    if "waiting for messages from " not in message:
        return set()
    text = message.split("waiting for messages from ")[1].split(" (")[0].split(" and ")[0]
    found = set()
    for part in text.replace("ranks ", "").replace("rank ", "").split(", "):
        first, _, last = part.partition("-")
        found.update(range(int(first), int(last or first) + 1))
    return found


def test_broadcast_object_that_cannot_be_pickled_raises_everywhere(comm):
    unpicklable = (lambda: None) if comm.rank == 0 else None
    with pytest.raises(TypeError, match="broadcast_object: .*cannot be pickled"):
        comm.broadcast_object(unpicklable, root=0)
    assert comm.broadcast_object("fine" if comm.rank == 0 else None) == "fine"


def test_liveness_connect_meets_every_peer_and_leaves_no_message_behind(mpi_comm):
    # What a communicator across nodes does when it is made, so that a timed-out rank's
    # probes never wait on a TCP connect to a host that is gone (test_multihost's cut
    # link at 2x4 hung there before).
    from collectives.transport.liveness import Liveness

    live = Liveness(mpi_comm.Dup())
    try:
        rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        live.connect([r for r in range(size) if r != rank])
        live.connect([(rank + 1) % size, (rank - 1) % size] if size > 2 else [])  # ring neighbours: symmetric too
        live._comm.Barrier()
        problems = ["a message is left unreceived"] if live._comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG) else []
        live._comm.Barrier()
    finally:
        live.free()
    agree(mpi_comm, problems)
