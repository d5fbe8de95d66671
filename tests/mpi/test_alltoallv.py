"""alltoallv over real MPI messages: every algorithm against ``MPI_Alltoallv`` called
directly and a NumPy reference, at every world size (1 serially, 2-8 under mpiexec).

Its per-peer counts keep it out of the sweeps that size every rank's input from one
count (``cc.COLLECTIVES``): the same guarantees are tested here instead.
"""

import time

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc

from conftest import ALL_DTYPES, agree, rank_input

WORLD = MPI.COMM_WORLD
ALGORITHMS = cc.algorithms("alltoallv")
needs_peers = pytest.mark.skipif(WORLD.Get_size() < 2, reason="needs at least two ranks")


def matrices(size):
    """Count matrices every rank draws alike: ``m[i][j]`` rows from rank i to rank j."""
    rng = np.random.default_rng(size)
    i, j = np.indices((size, size))
    return {
        "uneven": (i + 2 * j) % 4,
        "random, zeros included": rng.integers(0, 6, (size, size)) * (rng.random((size, size)) < 0.7),
        "all empty": np.zeros((size, size), int),
        "only to rank 0": np.where(j == 0, 3, 0),
        "large": rng.integers(20_000, 40_000, (size, size)),
    }


def inputs(matrix, dtype, row=()):
    """Every rank's rows, distinct per rank and row (integer-valued: exact anywhere)."""
    return [rank_input(r, int(matrix[r].sum()) * int(np.prod(row)), dtype).reshape((-1,) + row)
            for r in range(len(matrix))]


def numpy_answer(matrix, xs, rank):
    """The rows from every rank to ``rank``, in rank order."""
    blocks = [np.split(x, np.cumsum(counts)[:-1]) for x, counts in zip(xs, matrix)]
    return np.concatenate([blocks[i][rank] for i in range(len(matrix))])


def mpi_answer(matrix, x, rank, row_size):
    """MPI_Alltoallv, called directly."""
    send, recv = matrix[rank] * row_size, matrix[:, rank] * row_size
    out = np.empty((int(matrix[:, rank].sum()),) + x.shape[1:], x.dtype)
    WORLD.Alltoallv([x, (send, np.r_[0, np.cumsum(send)[:-1]])], [out, (recv, np.r_[0, np.cumsum(recv)[:-1]])])
    return out


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_against_mpi_and_numpy(comm, algorithm):
    problems = []
    for name, matrix in matrices(comm.size).items():
        for dtype in ("float64", "int32") if name != "large" else ("float32",):
            for row in ((), (3,), (2, 2)):
                xs = inputs(matrix, dtype, row)
                x, before = xs[comm.rank], xs[comm.rank].copy()
                want = numpy_answer(matrix, xs, comm.rank)
                native = mpi_answer(matrix, x, comm.rank, int(np.prod(row)))
                for recv in (None, matrix[:, comm.rank]):
                    got = comm.alltoallv(x, matrix[comm.rank], recv, algorithm=algorithm)
                    label = f"{name} {dtype} rows {row} recv_counts {'given' if recv is not None else 'None'}"
                    if not (got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
                            and np.array_equal(got, native)):
                        problems.append(f"{label}: got {got.shape} {got.ravel()[:4]}, numpy {want.ravel()[:4]}")
                    if not np.array_equal(x, before):
                        problems.append(f"{label}: the input was modified")
    agree(comm, problems)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_dtype(comm, algorithm):
    problems = []
    matrix = matrices(comm.size)["uneven"]
    for dtype in ALL_DTYPES:
        xs = inputs(matrix, dtype, (2,))
        got = comm.alltoallv(xs[comm.rank], matrix[comm.rank], algorithm=algorithm)
        if got.dtype != dtype or not np.array_equal(got, numpy_answer(matrix, xs, comm.rank)):
            problems.append(f"{dtype}: {got[:2]}")
    agree(comm, problems)


def test_bfloat16_uses_the_library_s_own_exchange(comm):
    matrix = matrices(comm.size)["uneven"]
    ml_dtypes = pytest.importorskip("ml_dtypes")
    xs = [x.astype(ml_dtypes.bfloat16) for x in inputs(matrix, "float32")]  # small integers: exact
    got = comm.alltoallv(xs[comm.rank], matrix[comm.rank])  # auto: MPI has no bfloat16
    problems = [] if np.array_equal(got.astype(np.float32), numpy_answer(matrix, xs, comm.rank).astype(np.float32)) \
        else [f"{got[:4]}"]
    with pytest.raises(ValueError, match="'native' cannot move bfloat16"):
        comm.alltoallv(xs[comm.rank], matrix[comm.rank], algorithm="native")
    agree(comm, problems)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_strided_read_only_and_overlapping_arrays(comm, algorithm):
    problems = []
    i, j = np.indices((comm.size, comm.size))
    matrix = (i + j) % 4 + 1  # symmetric: each rank receives as many rows as it sends
    xs = inputs(matrix, "int64", (3,))
    want = numpy_answer(matrix, xs, comm.rank)
    send = matrix[comm.rank]
    # every other row of a wider array, read-only
    wide = np.repeat(xs[comm.rank], 2, axis=0)
    strided = wide[::2]
    strided.flags.writeable = False
    if not np.array_equal(comm.alltoallv(strided, send, algorithm=algorithm), want):
        problems.append("strided read-only input")
    # a strided out (every other column of a wider array), filled in place
    canvas = np.full((len(want), 6), -1, np.int64)
    got = comm.alltoallv(xs[comm.rank], send, matrix[:, comm.rank], algorithm=algorithm, out=canvas[:, ::2])
    if got.base is not canvas or not np.array_equal(canvas[:, ::2], want) or not (canvas[:, 1::2] == -1).all():
        problems.append("strided out")
    # out overlapping x: every row must be read before it is overwritten
    x = xs[comm.rank].copy()
    if not np.array_equal(comm.alltoallv(x, send, algorithm=algorithm, out=x[::-1]), want):
        problems.append("out = x reversed")
    # a list of lists is an array too
    if not np.array_equal(comm.alltoallv(xs[comm.rank].tolist(), list(send), algorithm=algorithm), want):
        problems.append("nested lists")
    agree(comm, problems)


def test_several_in_flight_with_other_collectives(comm):
    problems = []
    ms = matrices(comm.size)
    calls = []
    for k, name in enumerate(("uneven", "random, zeros included", "large")):
        xs = inputs(ms[name], "float64")
        calls.append((name, numpy_answer(ms[name], xs, comm.rank),
                      comm.alltoallv_async(xs[comm.rank] + 0, ms[name][comm.rank], ms[name][:, comm.rank],
                                           algorithm="pairwise")))
        if k == 0:
            total = comm.allreduce_async(np.full(10, comm.rank + 1.0), algorithm="ring")
    for name, want, handle in reversed(calls):
        if not np.array_equal(handle.wait(), want):
            problems.append(name)
    if not np.array_equal(total.wait(), np.full(10, comm.size * (comm.size + 1) / 2)):
        problems.append("the allreduce in between")
    agree(comm, problems)


def test_bad_arguments_raise_before_any_message(comm):
    size, rank = comm.size, comm.rank
    x = np.ones((size, 2))
    ones = [1] * size
    cases = [
        (lambda: comm.alltoallv(x, ones[:-1] if size > 1 else [1, 0]), ValueError,
         "send_counts must have one count per rank"),
        (lambda: comm.alltoallv(x, [-1] + ones[1:] if size > 1 else [-1]), ValueError, "non-negative integers"),
        (lambda: comm.alltoallv(x, [1.5] * size), ValueError, "non-negative integers"),
        (lambda: comm.alltoallv(x, 3), TypeError, "send_counts must be a sequence"),
        (lambda: comm.alltoallv(x, [2] * size), ValueError, f"must add up to the rows of x \\({size}\\)"),
        (lambda: comm.alltoallv(np.float64(1), [1] * size), ValueError, "0-d"),
        (lambda: comm.alltoallv(x, ones, [2] * size), ValueError, f"recv_counts\\[{rank}\\] must equal"),
        (lambda: comm.alltoallv(x, ones, ones, out=np.empty((size + 1, 2))), ValueError, "out must have shape"),
        (lambda: comm.alltoallv(x, ones, ones, out=np.empty((size, 2), np.float32)), TypeError, "dtype float64"),
        (lambda: comm.alltoallv(x, ones, out=np.empty((size, 3))), ValueError, "out must have shape"),
        (lambda: comm.alltoallv(x, ones, algorithm="bruck"), ValueError, "algorithm for alltoallv must be one of"),
        (lambda: comm.alltoallv(x, ones, timeout=-1), ValueError, "timeout"),
    ]
    problems = []
    for call, kind, text in cases:
        with pytest.raises(kind, match=text):
            call()
    # nothing was sent: the next call matches on every rank
    if not np.array_equal(comm.alltoallv(x, ones), np.ones((size, 2))):
        problems.append("the call after the errors")
    agree(comm, problems)


@needs_peers
def test_a_wrong_out_found_once_the_counts_are_known_stops_every_rank():
    """With recv_counts=None only the counts tell how many rows arrive: a rank whose out
    has the wrong number raises ValueError, the others CollectiveError, no data moved."""
    comm = cc.Communicator()
    size, rank = comm.size, comm.rank
    rows = size + 1 if rank == size - 1 else size
    kind, text = "ok", ""
    try:
        comm.alltoallv(np.ones((size, 2)), [1] * size, out=np.empty((rows, 2)))
    except (ValueError, cc.CollectiveError) as exc:
        kind, text = type(exc).__name__, str(exc)
    problems = []
    want = ("ValueError", f"out on rank {size - 1} must have {size} rows") if rank == size - 1 else \
        ("CollectiveError", f"no data moved, since out on rank {size - 1} must have {size} rows")
    if kind != want[0] or want[1] not in text:
        problems.append(f"{kind}: {text}")
    if not np.array_equal(comm.alltoallv(np.full((size, 1), rank), [1] * size), np.arange(size)[:, None]):
        problems.append("the next call")
    agree(WORLD, problems)


@needs_peers
def test_check_mode_catches_counts_that_disagree():
    comm = cc.Communicator(check=True)
    size, rank = comm.size, comm.rank
    recv = [1] * size
    if rank == size - 1:
        recv[0] = 2  # rank 0 sends it one row
    kind, text = "ok", ""
    try:
        comm.alltoallv(np.ones((size, 2)), [1] * size, recv)
    except cc.CollectiveError as exc:
        kind, text = type(exc).__name__, str(exc)
    problems = []
    wanted = f"rank {size - 1} expects 2 rows from rank 0 (its recv_counts[0]), but rank 0 sends it 1"
    if kind != "CollectiveMismatchError" or wanted not in text:
        problems.append(f"{kind}: {text}")
    if not np.array_equal(comm.alltoallv(np.full((size, 1), rank), [1] * size, [1] * size),
                          np.arange(size)[:, None]):
        problems.append("the next call")
    agree(WORLD, problems)


@needs_peers
@pytest.mark.parametrize("algorithm", ["native", "pairwise"])
def test_counts_that_disagree_raise_on_every_rank_without_check_mode(algorithm):
    """MPI's own alltoallv may write past a buffer or return short rows on a wrong
    receive count, silently: the counts are checked first, and every rank raises. The
    library's algorithms find the wrong size in the message: the rank that receives it
    raises a MessageSizeError (the others may have finished their part by then)."""
    comm = cc.Communicator()
    size, rank = comm.size, comm.rank
    recv = [1] * size
    if rank == size - 1:
        recv[0] = 2  # rank 0 sends it one row
    out = np.full((sum(recv), 2), -1.0)
    kind, text = "ok", ""
    try:
        comm.alltoallv(np.ones((size, 2)), [1] * size, recv, out=out, algorithm=algorithm)
    except cc.CollectiveError as exc:
        kind, text = type(exc).__name__, str(exc)
    problems = []
    if algorithm == "native":
        wanted = f"rank {size - 1} expects 2 rows from rank 0 (its recv_counts[0]), but rank 0 sends it 1"
        if kind != "CollectiveMismatchError" or wanted not in text:
            problems.append(f"{kind}: {text}")
        if (out != -1).any():
            problems.append("data moved")
    elif rank == size - 1 and kind != "MessageSizeError":  # the rank that receives the short message finds it
        problems.append(f"{kind}: {text}")
    agree(WORLD, problems)


@pytest.mark.any_size
@needs_peers
@pytest.mark.parametrize("algorithm", ["pairwise", "native"])
def test_a_timeout_names_the_absent_rank(algorithm):
    comm = cc.Communicator()
    size, rank, last = comm.size, comm.rank, comm.size - 1
    problems = []
    if rank == last:  # stays away until the others have given up
        time.sleep(2.0)
    else:
        start = time.monotonic()
        kind, text = "ok", ""
        try:
            comm.alltoallv(np.ones((size, 500)), [1] * size, [1] * size, algorithm=algorithm, timeout=1.0)
        except cc.CollectiveError as exc:
            kind, text = type(exc).__name__, str(exc)
        took = time.monotonic() - start
        if kind != "CollectiveTimeoutError" or f"no answer within 0.5 s from rank {last}" not in text:
            problems.append(f"{kind}: {text}")
        if not took < 2.0:
            problems.append(f"raised after {took:.2f} s, more than timeout + 1 s")
    agree(WORLD, problems)
