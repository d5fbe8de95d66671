"""The shared-memory algorithms (``shm``) on their own executor: segments and banks,
the window growing, calls in flight, in place and strided arrays, mismatched calls,
timeouts and stall warnings. (test_collectives.py checks them with every other
algorithm, at every dtype and op; test_deterministic.py, in rank order; the killed
rank is in test_dead_rank.py.)"""

import logging
import time

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc
from collectives.algorithms import SHARED_MEMORY

from conftest import agree, expected_result, ops_for, rank_input

WORLD = MPI.COMM_WORLD
LAST = WORLD.Get_size() - 1
needs_peers = pytest.mark.skipif(WORLD.Get_size() < 2, reason="needs at least two ranks")
COLLECTIVES = sorted(c for c, _ in SHARED_MEMORY)


def call(comm, collective, x, root=0, op="sum", **kwargs):
    """``collective`` with the shm algorithm, as the Communicator's method takes it."""
    method = getattr(comm, collective)
    if collective == "broadcast":
        return method(x, root=root, algorithm="shm", **kwargs)
    if collective == "reduce":
        return method(x, root=root, op=op, algorithm="shm", **kwargs)
    if collective == "allgather":
        return method(x, algorithm="shm", **kwargs)
    return method(x, op=op, algorithm="shm", **kwargs)


def check(collective, comm, count, dtype, op="sum", root=0, problems=None):
    xs = [rank_input(r, count, dtype, op) for r in range(comm.size)]
    x = xs[comm.rank].copy()
    got = call(comm, collective, x, root, op)
    want = expected_result(collective, comm.rank, comm.size, xs, op, root)
    if collective == "broadcast":
        got = x
    if (want is None) != (got is None) or (want is not None and not np.array_equal(got, want)):
        problems.append(f"{collective} count {count} {dtype} {op} root {root}: got {got!r}, want {want!r}")


@pytest.mark.long
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_segments_and_banks(collective):
    # A slot of 64 bytes: each call runs in many segments, through both banks in turn,
    # and the next calls start from wherever the last one left the banks.
    comm = cc.Communicator()
    comm.shm_slot = 64
    problems = []
    for count in (0, 1, 7, 16, 17, 100, 1001):
        for root in sorted({0, LAST}):
            check(collective, comm, count, "int32", "sum", root, problems)
            check(collective, comm, count, "float64", "max", root, problems)
    agree(WORLD, problems)
    comm.free()


@pytest.mark.long
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_every_dtype_and_op_across_segments(collective):
    comm = cc.Communicator()
    comm.shm_slot = 256
    problems = []
    for dtype in [d.name for d in cc.SUPPORTED_DTYPES]:
        for op in (ops_for(dtype) if collective in ("allreduce", "reduce", "reduce_scatter") else ["sum"]):
            check(collective, comm, 333, dtype, op, LAST, problems)
    agree(WORLD, problems)
    comm.free()


def test_the_window_grows_and_is_reused():
    comm = cc.Communicator()
    sizes, problems = [], []
    for count in (10, 100_000, 10, 1_000_000, 10):
        x = np.full(count, comm.rank + 1, np.float32)
        got = comm.allreduce(x, algorithm="shm")
        if not np.array_equal(got, np.full(count, comm.size * (comm.size + 1) // 2, np.float32)):
            problems.append(f"count {count}: wrong result")
        sizes.append(comm._ctx.window.capacity if comm._ctx.window is not None else 0)
    if comm.size > 1:
        if not (sizes[0] < sizes[1] < sizes[3] and sizes[1] == sizes[2] and sizes[3] == sizes[4]):
            problems.append(f"window sizes {sizes}: not grown on demand and kept")
        # two banks of p slots, rounded up to a power of two
        if sizes[3] >= 2 * (2 * comm.size * comm.shm_slot):
            problems.append(f"window of {sizes[3]} B for slots of {comm.shm_slot} B")
    agree(WORLD, problems)
    comm.free()


def test_a_new_slot_size_reaches_calls_already_learnt():
    # The lean path keeps what it learnt per kind of call; a plan cut for the old slot
    # must not outlive a change of it (the window grows for the new one's segments).
    comm = cc.Communicator()
    comm.shm_slot = 64
    x = np.full(8192, comm.rank + 1, np.float32)  # 32 KiB: one segment of the larger slot, 512 of the smaller
    want = np.full(8192, comm.size * (comm.size + 1) // 2, np.float32)
    problems = []
    for slot in (64, 64, 64 << 10, 64 << 10):
        comm.shm_slot = slot
        if not np.array_equal(comm.allreduce(x, algorithm="shm"), want):
            problems.append(f"slot {slot}: wrong result")
    if comm.size > 1 and comm._ctx.window.capacity < 2 * comm.size * x.nbytes:
        problems.append(f"window of {comm._ctx.window.capacity} B: the calls kept the 64-byte slot's segments")
    agree(WORLD, problems)
    comm.free()


def test_in_place_and_strided_arrays():
    comm = cc.Communicator()
    comm.shm_slot = 512
    p, r = comm.size, comm.rank
    problems = []
    x = np.arange(3000, dtype=np.float64) + r
    total = sum(np.arange(3000, dtype=np.float64) + q for q in range(p))
    y = x.copy()
    if comm.allreduce(y, out=y, algorithm="shm") is not y or not np.array_equal(y, total):
        problems.append("allreduce in place")
    wide = np.zeros((3000, 2))
    wide[:, 0] = x
    got = comm.allreduce(wide[:, 0], algorithm="shm")  # strided input
    if not np.array_equal(got, total):
        problems.append("allreduce of a strided input")
    out = np.zeros((3000, 3))
    comm.allreduce(x, out=out[:, 1], algorithm="shm")  # strided output
    if not np.array_equal(out[:, 1], total) or out[:, 0].any() or out[:, 2].any():
        problems.append("allreduce into a strided out")
    z = x.copy()
    result = comm.reduce(z, root=LAST, out=z, algorithm="shm")
    if r == LAST and (result is not z or not np.array_equal(z, total)):
        problems.append("reduce in place at the root")
    if r != LAST and (result is not None or not np.array_equal(z, x)):
        problems.append("reduce changed a non-root's input")
    matrix = np.arange(40, dtype=np.int64).reshape(4, 10) * (r + 1)
    gathered = comm.allgather(matrix.T, algorithm="shm")  # transposed: not contiguous
    if not np.array_equal(gathered, np.stack([matrix.T // (r + 1) * (q + 1) for q in range(p)])):
        problems.append("allgather of a transposed array")
    b = np.full((50, 4), r, np.int16)[:, ::2]
    comm.broadcast(b, root=LAST, algorithm="shm")
    if not (b == LAST).all():
        problems.append("broadcast into a strided array")
    agree(WORLD, problems)
    comm.free()


def test_several_calls_in_flight_with_other_algorithms():
    comm = cc.Communicator()
    comm.shm_slot = 1024
    p, r = comm.size, comm.rank
    handles, wants = [], []
    for k in range(6):
        x = np.full(700 + 300 * k, k + r, np.int64)
        algorithm = "ring" if k == 2 else "shm"
        handles.append(comm.allreduce_async(x, algorithm=algorithm))
        wants.append(np.full(x.size, k * p + p * (p - 1) // 2, np.int64))
    gathered = comm.allgather_async(np.full(5, r), algorithm="shm")
    problems = []
    for k in reversed(range(6)):  # waited for out of order
        if not np.array_equal(handles[k].wait(), wants[k]):
            problems.append(f"call {k}: wrong result")
    if not np.array_equal(gathered.wait(), np.repeat(np.arange(p), 5).reshape(p, 5)):
        problems.append("allgather in flight")
    h = comm.reduce_scatter_async(np.ones(100), algorithm="shm")
    while not h.test():
        comm.poll()
    if not np.array_equal(h.wait(), np.full(np.array_split(np.ones(100), p)[r].size, float(p))):
        problems.append("reduce_scatter by polling")
    agree(WORLD, problems)
    comm.free()


def test_deterministic_mode_allows_them():
    comm = cc.Communicator(deterministic=True)
    x = np.random.default_rng(comm.rank).standard_normal(5000).astype(np.float32)
    xs = WORLD.allgather(x)
    fold = xs[0].copy()
    for y in xs[1:]:
        fold = fold + y
    got = comm.allreduce(x, algorithm="shm")
    agree(WORLD, [] if got.tobytes() == fold.tobytes() else ["not the serial fold, bit for bit"])
    comm.free()


def test_refused_for_device_arrays_and_across_nodes():
    comm = cc.Communicator()
    with pytest.raises(ValueError, match="every rank on one node"):
        comm._ctx.shares_memory = False  # as on a communicator that spans several hosts
        comm.allreduce(np.ones(4), algorithm="shm")
    comm._ctx.shares_memory = True
    from collectives.device import standin

    x = standin.asarray(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="host arrays only"):
        comm.allreduce(x, algorithm="shm")
    with pytest.raises(ValueError, match="COLLECTIVES_SHM_SLOT"):
        import os

        os.environ["COLLECTIVES_SHM_SLOT"] = "lots"
        try:
            cc.Communicator()
        finally:
            del os.environ["COLLECTIVES_SHM_SLOT"]
    comm.free()


def outcome(function):
    try:
        return "ok", function()
    except cc.CollectiveError as exc:
        return type(exc).__name__, str(exc)


@needs_peers
def test_a_size_mismatch_is_an_error_on_every_rank():
    comm = cc.Communicator()
    count = 1000 if comm.rank != LAST else 999
    kind, message = outcome(lambda: comm.allreduce(np.ones(count), algorithm="shm"))
    problems = []
    if kind != "MessageSizeError" or "buffers of different sizes" not in message:
        problems.append(f"{kind}: {message}")
    later, text = outcome(lambda: comm.allreduce(np.ones(4), algorithm="shm"))
    if later != "CollectiveError" or "broken" not in text:
        problems.append(f"the broken communicator accepted a call: {later} {text}")
    agree(WORLD, problems)


@needs_peers
def test_a_size_mismatch_that_grows_the_window_on_one_rank_is_an_error_on_every_rank():
    # The last rank's call needs a larger window; the others' fits the one they have:
    # the last rank's growth fence meets their first fence, and all of them raise.
    comm = cc.Communicator()
    comm.allreduce(np.ones(1000), algorithm="shm")  # the window is made
    count = 1_000_000 if comm.rank == LAST else 1000
    kind, message = outcome(lambda: comm.allreduce(np.ones(count), algorithm="shm", timeout=30))
    agree(WORLD, [] if kind == "MessageSizeError" and "different sizes" in message else [f"{kind}: {message}"])


@needs_peers
def test_ranks_with_different_slots_are_an_error_on_every_rank():
    # The slot sets the segments and fences: ranks that disagree on it must not go on.
    comm = cc.Communicator()
    comm.shm_slot = 256 if comm.rank == LAST else 512
    kind, message = outcome(lambda: comm.allreduce(np.ones(1000), algorithm="shm", timeout=30))
    agree(WORLD, [] if kind == "CollectiveMismatchError" else [f"{kind}: {message}"])


def test_auto_and_overrides_where_memory_is_not_shared(monkeypatch):
    comm = cc.Communicator()
    comm._ctx.shares_memory = False  # as on a communicator that spans hosts
    monkeypatch.setattr(comm._ctx.selector, "explain", lambda collective, nbytes, device: ("shm", "a stub table"))
    monkeypatch.setattr(comm._ctx.selector, "choose", lambda collective, nbytes, device: "shm")
    choice, why = comm.choose("allreduce", 1 << 20)
    problems = ([] if choice != "shm" and "host arrays of ranks that share memory" in why
                else [f"choose: {choice}, {why}"])
    # bfloat16 (ml_dtypes): MPI has no type for it, so the fallback must not be native either
    ml_dtypes = pytest.importorskip("ml_dtypes")
    got = comm.allreduce(np.ones(8, dtype=ml_dtypes.bfloat16))
    if not np.array_equal(got.astype(np.float64), np.full(8, float(comm.size))):
        problems.append(f"auto's fallback gave {got}")
    comm._ctx.selector.overrides["allreduce"] = "shm"  # COLLECTIVES_ALLREDUCE_ALGORITHM=shm names it
    try:
        comm.allreduce(np.ones(8))
        problems.append("an override naming shm ran where memory is not shared")
    except ValueError as exc:
        if "every rank on one node" not in str(exc):
            problems.append(str(exc))
    finally:
        del comm._ctx.selector.overrides["allreduce"]
    agree(WORLD, problems)


@needs_peers
def test_different_collectives_are_an_error_on_every_rank():
    comm = cc.Communicator()
    x = np.ones(64)
    if comm.rank == LAST:
        kind, message = outcome(lambda: comm.broadcast(x, algorithm="shm"))
    else:
        kind, message = outcome(lambda: comm.allgather(x, algorithm="shm"))
    problems = [] if kind == "CollectiveMismatchError" and "different call" in message else [f"{kind}: {message}"]
    agree(WORLD, problems)


@pytest.mark.any_size
@needs_peers
@pytest.mark.parametrize("collective", ["allreduce", "broadcast"])
def test_timeout_names_the_absent_rank(collective):
    comm = cc.Communicator()
    call(comm, collective, np.ones(3000))  # the window is made (the call waits for every rank)
    start = time.monotonic()
    if comm.rank == LAST:
        time.sleep(2.0)
        kind, message = "absent", ""
    else:
        kind, message = outcome(lambda: call(comm, collective, np.ones(3000), root=0, timeout=1.0))
    took = time.monotonic() - start
    problems = []
    if comm.rank != LAST:
        for part in (f"{collective}(algorithm='shm') call #2: Timed out after 1.0 s",
                     f"in shared memory for rank {LAST} to arrive", f"no answer within 0.5 s from rank {LAST}"):
            if part not in message:
                problems.append(f"{kind}: message lacks {part!r}: {message}")
        if not took < 2.0:
            problems.append(f"raised after {took:.2f} s, more than timeout + 1 s")
    agree(WORLD, problems)


@needs_peers
def test_stall_warning_names_the_late_rank(caplog):
    comm = cc.Communicator(stall_warn=0.2)
    comm.allreduce(np.ones(64), algorithm="shm")  # the window is made
    caplog.set_level(logging.WARNING, logger="collectives")
    if comm.rank == LAST:
        time.sleep(0.7)
    got = comm.allreduce(np.ones(64), algorithm="shm")
    problems = [] if np.array_equal(got, np.full(64, comm.size)) else ["wrong result"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "collectives"]
    if comm.rank != LAST and not any(f"for rank {LAST} to arrive" in w for w in warnings):
        problems.append(f"no stall warning naming rank {LAST}: {warnings}")
    agree(WORLD, problems)
    comm.free()


def test_check_mode_and_liveness_answers():
    # Check mode compares the calls before the window is touched; a rank waiting at a
    # fence answers the others' liveness probes (the timeout test relies on it too).
    comm = cc.Communicator(check=True)
    got = comm.allreduce(np.arange(10.0), algorithm="shm")
    agree(WORLD, [] if np.array_equal(got, np.arange(10.0) * comm.size) else ["wrong result in check mode"])
    comm.free()
