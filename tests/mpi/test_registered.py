"""Registered buffers: ``Communicator.empty``/``zeros`` make arrays in memory the node's
ranks share, and the ``shm`` algorithms read the other ranks' inputs there instead of
copying them into the window first (allreduce in place, reduce_scatter, allgather,
broadcast). Results against NumPy and the serial fold; the window's data area unused;
mismatches, bad arguments and the other forms of call on registered arrays."""

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc
import collectives.sim as sim
from collectives.algorithms.shm import REGISTERED

from conftest import ALL_DTYPES, agree, expected_result, ops_for, rank_input, serial_fold

WORLD = MPI.COMM_WORLD
LAST = WORLD.Get_size() - 1
needs_peers = pytest.mark.skipif(WORLD.Get_size() < 2, reason="needs at least two ranks")


def registered_call(comm, collective, x, op="sum", root=0):
    """``collective`` with ``shm`` on the registered array ``x``, in its registered form
    (allreduce in place); returns the result (broadcast: ``x`` itself)."""
    if collective == "allreduce":
        return comm.allreduce(x, op=op, out=x, algorithm="shm")
    if collective == "reduce_scatter":
        return comm.reduce_scatter(x, op=op, algorithm="shm")
    if collective == "allgather":
        return comm.allgather(x, algorithm="shm")
    comm.broadcast(x, root=root, algorithm="shm")
    return x


def window_data(comm):
    """Bytes of the shared window's data area (0 before the first shm call)."""
    return comm._ctx.window.capacity if comm._ctx.window is not None else 0


@pytest.mark.long
@pytest.mark.parametrize("collective", REGISTERED)
def test_every_dtype_op_and_size(collective):
    comm = cc.Communicator()
    problems = []
    for dtype in ALL_DTYPES:
        ops = ops_for(dtype) if collective in ("allreduce", "reduce_scatter") else ["sum"]
        space = comm.empty(200_000 if dtype == "float64" else 1001, dtype)  # calls on its first elements
        for op in ops:
            for count in (0, 1, 7, 1001) + ((200_000,) if dtype == "float64" and op == "sum" else ()):
                xs = [rank_input(r, count, dtype, op) for r in range(comm.size)]
                for root in sorted({0, LAST}) if collective == "broadcast" else [0]:
                    x = space[:count]
                    x[...] = xs[comm.rank]
                    got = registered_call(comm, collective, x, op, root)
                    want = expected_result(collective, comm.rank, comm.size, xs, op, root)
                    if not np.array_equal(got, want):
                        problems.append(f"{dtype} {op} count {count} root {root}: got {got!r}, want {want!r}")
    # The inputs were read where they are: the window's data area stayed at its smallest
    # (copied in, 1.6 MB would have needed two banks of p slots of 1 MiB).
    if comm.size > 1 and window_data(comm) > 64 << 10:
        problems.append(f"the window grew to {window_data(comm)} B: the inputs were copied in")
    agree(WORLD, problems)
    comm.free()


def test_slices_of_one_registered_array_and_zeros():
    # A bucket and views of it at an offset: every rank's view is the same slice.
    comm = cc.Communicator()
    p, r = comm.size, comm.rank
    bucket = comm.zeros((3, 5000), "float32")
    problems = [] if bucket.shape == (3, 5000) and bucket.dtype == np.float32 and not bucket.any() else [
        f"zeros gave {bucket.shape} {bucket.dtype}, any={bucket.any()}"]
    bucket[1] = np.arange(5000) + r
    row = bucket[1]
    comm.allreduce(row, out=row, algorithm="shm")
    if not np.array_equal(row, (np.arange(5000) * p + p * (p - 1) // 2).astype(np.float32)):
        problems.append("allreduce of a row")
    if bucket[0].any() or bucket[2].any():
        problems.append("allreduce of a row wrote the other rows")
    part = bucket[2, 17:1017]
    part[...] = r
    gathered = comm.allgather(part, algorithm="shm")
    if not np.array_equal(gathered, np.repeat(np.arange(p, dtype=np.float32), 1000).reshape(p, 1000)):
        problems.append("allgather of an offset slice")
    agree(WORLD, problems)
    comm.free()


def test_deterministic_allreduce_is_the_serial_fold_bit_for_bit():
    # Random floats: the rank-order fold is the only way to get these bits.
    comm = cc.Communicator(deterministic=True)
    problems = []
    dtypes = ["float32", "float64", "float16"]
    try:
        import ml_dtypes  # noqa: F401

        dtypes.append("bfloat16")
    except ImportError:
        pass
    for dtype in dtypes:
        x_mine = np.random.default_rng(comm.rank).standard_normal(4099).astype(dtype)
        xs = WORLD.allgather(x_mine)
        x = comm.empty(x_mine.size, dtype)
        x[...] = x_mine
        comm.allreduce(x, out=x, algorithm="shm")
        if x.tobytes() != serial_fold("sum", xs).tobytes():
            problems.append(f"{dtype}: not the serial fold, bit for bit")
        y = comm.empty(x_mine.size, dtype)
        y[...] = x_mine
        block = comm.reduce_scatter(y, algorithm="shm")
        if block.tobytes() != np.array_split(serial_fold("sum", xs), comm.size)[comm.rank].tobytes():
            problems.append(f"{dtype}: reduce_scatter is not the serial fold's block")
    agree(WORLD, problems)
    comm.free()


def test_other_calls_on_registered_arrays_run_as_on_any_array():
    # reduce, allreduce out of place, other algorithms and async calls: no registered
    # form, the same results.
    comm = cc.Communicator()
    p, r = comm.size, comm.rank
    total = np.arange(2000.0) * p + p * (p - 1) / 2
    problems = []
    x = comm.empty(2000, "float64")
    for algorithm in ("shm", "ring", "direct", "native", "auto"):
        x[...] = np.arange(2000.0) + r
        if not np.array_equal(comm.allreduce(x, algorithm=algorithm), total):
            problems.append(f"allreduce out of place with {algorithm}")
        got = comm.reduce(x, root=LAST, algorithm=algorithm if algorithm != "ring" else "binomial")
        if r == LAST and not np.array_equal(got, total):
            problems.append(f"reduce with {algorithm}")
    handles = []
    for k in range(3):
        y = comm.empty(1000, "int64")
        y[...] = k + r
        handles.append((comm.allreduce_async(y, out=y, algorithm="shm"), y, k))
    ring = comm.allreduce_async(np.full(10, r), algorithm="ring")
    for handle, y, k in reversed(handles):
        handle.wait()
        if not np.array_equal(y, np.full(1000, k * p + p * (p - 1) // 2)):
            problems.append(f"registered allreduce {k} in flight")
    if not np.array_equal(ring.wait(), np.full(10, p * (p - 1) // 2)):
        problems.append("a ring allreduce in flight beside them")
    agree(WORLD, problems)
    comm.free()


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather", "broadcast"])
def test_shm_chosen_by_auto_runs_alike_whichever_ranks_inputs_are_registered(collective, monkeypatch):
    # Whether an input is registered is one rank's business; auto's choice must run
    # alike on every rank: where auto chose shm (here forced by the environment), a
    # registered input copies in as any other, so ranks whose inputs differ in that
    # agree (the registered form on rank 0 alone would refuse the others' calls).
    monkeypatch.setenv(f"COLLECTIVES_{collective.upper()}_ALGORITHM", "shm")
    comm = cc.Communicator()
    p, r = comm.size, comm.rank
    problems = []
    for calls in range(2):  # the general path, then the lean one
        pool = comm.empty(600, "float64")  # collective; only rank 0 puts its input there
        x = pool if r == 0 else np.empty(600)
        x[...] = np.arange(600.0) + r + calls
        fresh = x.copy()
        if collective == "allreduce":
            got = comm.allreduce(x, out=x, algorithm="auto")
            want = sum(np.arange(600.0) + q + calls for q in range(p))
        elif collective == "reduce_scatter":
            got = comm.reduce_scatter(x, algorithm="auto")
            want = np.array_split(sum(np.arange(600.0) + q + calls for q in range(p)), p)[r]
        elif collective == "allgather":
            got = comm.allgather(x, algorithm="auto")
            want = np.stack([np.arange(600.0) + q + calls for q in range(p)])
        else:
            comm.broadcast(x, root=0, algorithm="auto")
            got, want = x, np.arange(600.0) + calls
        if not np.array_equal(got, want):
            problems.append(f"{collective}, call {calls}: wrong result")
        if collective in ("reduce_scatter", "allgather") and not np.array_equal(x, fresh):
            problems.append(f"{collective}, call {calls}: x written")
    if comm.choose(collective, 600 * 8)[0] != "shm":
        problems.append(f"auto did not choose shm: {comm.choose(collective, 600 * 8)}")
    comm.free()
    agree(WORLD, problems)


def test_bad_arguments_are_refused():
    comm = cc.Communicator()
    for shape in (-1, (3, -2), 2.5, "x", (True,)):
        with pytest.raises(ValueError, match="shape must be"):
            comm.empty(shape)
    with pytest.raises(TypeError, match="dtype"):
        comm.empty(4, "object")
    with pytest.raises(TypeError, match="dtype"):
        comm.empty(4, 3.5)
    comm.free()


@needs_peers
def test_ranks_that_ask_for_different_shapes_all_raise():
    comm = cc.Communicator()
    with pytest.raises(ValueError, match="same on every rank"):
        comm.empty(100 if comm.rank != LAST else 101, "float32")
    x = comm.empty(100, "float32")  # the communicator still works
    x[...] = 1
    comm.allreduce(x, out=x, algorithm="shm")
    agree(WORLD, [] if (x == comm.size).all() else ["wrong result after the refused empty()"])
    comm.free()


@needs_peers
def test_registered_on_some_ranks_only_is_an_error_on_every_rank():
    comm = cc.Communicator()
    x = comm.empty(500, "float64")
    x[...] = 1
    y = x if comm.rank != LAST else np.ones(500)
    try:
        comm.allgather(y, algorithm="shm", timeout=30)
        kind, message = "ok", ""
    except cc.CollectiveError as exc:
        kind, message = type(exc).__name__, str(exc)
    agree(WORLD, [] if kind == "CollectiveMismatchError" and "registered" in message else [f"{kind}: {message}"])


@pytest.mark.serial
@pytest.mark.parametrize("collective", REGISTERED)
def test_the_simulator_runs_the_registered_forms(collective):
    # The in-process runner checks every rank's result against NumPy (sim.run raises
    # otherwise); the registered form moves less than the copy-in one.
    for p in range(1, 9):
        for count in (0, 1, p - 1, 13, 1000):
            for root in sorted({0, p - 1}) if collective == "broadcast" else [0]:
                sim.run(collective, "shm", p, count, "float32", root=root, registered=True)
                if collective in ("allreduce", "reduce_scatter"):
                    sim.run(collective, "shm", p, count, "int32", op="max", registered=True)
    model = dict(alpha=2e-6, beta=1 / 10e9, gamma=1 / 10e9)
    for p in (2, 4):
        plain = sim.costs(collective, "shm", p, 1 << 20).time(**model)
        registered = sim.costs(collective, "shm", p, 1 << 20, registered=True).time(**model)
        assert registered < plain, (p, registered, plain)
    with pytest.raises(ValueError, match="registered"):
        sim.costs(collective, "ring" if collective != "broadcast" else "binomial", 4, 100, registered=True)
    with pytest.raises(ValueError, match="registered"):
        sim.costs("reduce", "shm", 4, 100, registered=True)


def test_repeated_calls_on_the_lean_path_tell_registered_from_plain_arrays():
    # The same kind of call (collective, dtype, size) on a registered array, on another
    # registration, on a plain array, in turns: the lean path picks each one's plan.
    comm = cc.Communicator()
    p, r = comm.size, comm.rank
    first, second = comm.empty(300_000, "float64"), comm.empty(300_000, "float64")
    plain = np.empty(300_000)
    problems = []
    for k in range(4):
        for name, x in (("first", first), ("second", second), ("plain", plain)):
            x[...] = k + r
            comm.allreduce(x, out=x, algorithm="shm")
            if not (x == k * p + p * (p - 1) / 2).all():
                problems.append(f"round {k}, {name}: allreduce in place gave {x[:3]}")
            x[...] = r
            got = comm.allgather(x[:1000], algorithm="shm")
            if not np.array_equal(got, np.repeat(np.arange(p, dtype=np.float64), 1000).reshape(p, 1000)):
                problems.append(f"round {k}, {name}: allgather")
    # Copied in, the plain array's 2.4 MB needs two banks of p slots of 1 MiB; the
    # registered calls alone would have left the window at its smallest.
    if comm.size > 1 and window_data(comm) <= 64 << 10:
        problems.append("the plain array's calls did not use the window")
    agree(WORLD, problems)
    comm.free()


@pytest.mark.any_size
@needs_peers
def test_a_timeout_names_the_rank_that_never_came():
    # The registered plans wait at the same fences as the others: a rank that does not
    # arrive is named, within the timeout plus the liveness probe's half second.
    import time

    comm = cc.Communicator()
    x = comm.empty(3000, "float64")
    x[...] = 1
    comm.allreduce(x, out=x, algorithm="shm")  # the window is made (every rank waits for the others)
    start = time.monotonic()
    if comm.rank == LAST:
        time.sleep(2.0)
        kind, message = "absent", ""
    else:
        try:
            comm.allreduce(x, out=x, algorithm="shm", timeout=1.0)
            kind, message = "ok", ""
        except cc.CollectiveError as exc:
            kind, message = type(exc).__name__, str(exc)
    took = time.monotonic() - start
    problems = []
    if comm.rank != LAST:
        if kind != "CollectiveTimeoutError" or f"in shared memory for rank {LAST} to arrive" not in message:
            problems.append(f"{kind}: {message}")
        if not took < 2.0:
            problems.append(f"raised after {took:.2f} s, more than timeout + 1 s")
    agree(WORLD, problems)
