"""Every collective and algorithm over real MPI messages, against the MPI library's own
collective and a NumPy reference. Runs serially and under ``mpiexec -n N``.

Each test checks every call and then lets all ranks compare notes (``agree``), so a
failure on one rank fails the test everywhere instead of leaving the others waiting.
"""

import numpy as np
import pytest

import collectives as cc
from collectives.tools.demo import native_result, run_one

from conftest import (
    ALL_DTYPES,
    agree,
    counts_for,
    expected_result,
    host_algorithms,
    ops_for,
    rank_input,
    reference,
    runs_here,
    same,
    shm_long,
)

# shm needs ranks that share memory: skipped in jobs across hosts, where it refuses (test_multihost.py)
pytestmark = pytest.mark.usefixtures("shared_memory_needed")

REDUCING = ["allreduce", "reduce_scatter", "reduce"]
ROOTED = ["broadcast", "reduce", "gather", "scatter"]
ROWS = ["scatter", "alltoall"]  # an input of one row per rank


def inputs_of_all(size, count, dtype, op, shape=None):
    return [rank_input(r, count, dtype, op, shape) for r in range(size)]


def expected(collective, comm, xs, op, root):
    return expected_result(collective, comm.rank, comm.size, xs, op, root)


def call(comm, collective, x, algorithm, op="sum", root=0, out=None, segment_size=None):
    if collective == "allreduce":
        return comm.allreduce(x, op=op, algorithm=algorithm, out=out, segment_size=segment_size)
    if collective == "reduce_scatter":
        return comm.reduce_scatter(x, op=op, algorithm=algorithm, out=out)
    if collective == "allgather":
        return comm.allgather(x, algorithm=algorithm, out=out)
    if collective == "broadcast":
        return comm.broadcast(x, root=root, algorithm=algorithm, segment_size=segment_size)
    if collective == "gather":
        return comm.gather(x, root=root, algorithm=algorithm, out=out)
    if collective == "scatter":
        return comm.scatter(x, root=root, algorithm=algorithm, out=out)
    if collective == "alltoall":
        return comm.alltoall(x, algorithm=algorithm, out=out)
    return comm.reduce(x, root=root, op=op, algorithm=algorithm, out=out)


def run_and_compare(comm, mpi, collective, algorithm, dtype, op, count, root=0, segment_size=None, problems=None):
    """One call, checked against NumPy and against MPI; the input must be unchanged.
    For scatter and alltoall, every rank's input is ``size`` rows of ``count`` elements."""
    rows = (comm.size, count) if collective in ROWS else None
    xs = inputs_of_all(comm.size, count * comm.size if rows else count, dtype, op, rows)
    x = xs[comm.rank].copy()
    if collective == "broadcast" and comm.rank != root:
        x[...] = 0
    x_before = x.copy()
    got = call(comm, collective, x, algorithm, op, root, segment_size=segment_size)
    want = expected(collective, comm, xs, op, root)
    native = native_result(mpi, collective, x_before, op, root)
    label = f"{collective}/{algorithm} {dtype} {op} n={count} root={root}"
    if want is None:
        if got is not None:
            problems.append(f"{label}: non-root got {type(got).__name__}, expected None")
    elif not (same(got, want) and same(got, native)):
        problems.append(f"{label}: got {np.asarray(got).ravel()[:5]}, numpy {want.ravel()[:5]}, "
                        f"mpi {native.ravel()[:5]}")
    if collective != "broadcast" and not same(x, x_before):
        problems.append(f"{label}: the input was modified")
    return got


ALGORITHMS = [(c, a) for c in cc.COLLECTIVES for a in host_algorithms(c)]


@pytest.mark.parametrize("collective,algorithm", shm_long(ALGORITHMS))
def test_every_count_against_mpi_and_numpy(comm, mpi_comm, collective, algorithm):
    problems = []
    roots = sorted({0, comm.size - 1}) if collective in ROOTED else [0]
    for count in counts_for(comm.size):
        # Segments of 16 B cut even the small counts into several; 4 KiB still cuts 100 003
        # elements into 98 (64 B made it 6 251 and cost half a minute per pipelined algorithm).
        segment = 16 if count < 1000 else 4096
        for root in roots:
            run_and_compare(comm, mpi_comm, collective, algorithm, "float32", "sum", count, root, segment, problems)
    agree(mpi_comm, problems)


@pytest.mark.parametrize("collective,algorithm", shm_long([ca for ca in ALGORITHMS if ca[0] in REDUCING]))
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_dtype_and_op(comm, mpi_comm, collective, algorithm, dtype):
    problems = []
    for op in ops_for(dtype):
        for count in (comm.size + 1, 37):
            run_and_compare(comm, mpi_comm, collective, algorithm, dtype, op, count, comm.size - 1, 16, problems)
    agree(mpi_comm, problems)


@pytest.mark.parametrize("collective,algorithm", shm_long([ca for ca in ALGORITHMS if ca[0] not in REDUCING]))
def test_data_movement_every_dtype(comm, mpi_comm, collective, algorithm):
    problems = []
    for dtype in ALL_DTYPES:
        run_and_compare(comm, mpi_comm, collective, algorithm, dtype, "sum", 2 * comm.size + 3, 0, 16, problems)
    agree(mpi_comm, problems)


@pytest.mark.parametrize("algorithm", shm_long(host_algorithms("allreduce")))
def test_allreduce_in_place_and_into_out(comm, mpi_comm, algorithm):
    problems = []
    for count in counts_for(comm.size, large=False):
        xs = inputs_of_all(comm.size, count, "int32", "sum")
        want = reference("sum", xs)
        x = xs[comm.rank].copy()
        got = comm.allreduce(x, algorithm=algorithm, out=x, segment_size=8)
        if got is not x or not same(x, want):
            problems.append(f"in place n={count}: {x[:5]} != {want[:5]}")
        out = np.full(count, -1, "int32")
        got = comm.allreduce(xs[comm.rank], algorithm=algorithm, out=out)
        if got is not out or not same(out, want):
            problems.append(f"out= n={count}")
    agree(mpi_comm, problems)


@pytest.mark.parametrize("algorithm", shm_long(host_algorithms("reduce")))
def test_reduce_in_place_on_root(comm, mpi_comm, algorithm):
    problems = []
    for root in sorted({0, comm.size - 1}):
        xs = inputs_of_all(comm.size, 23, "float64", "max")
        x = xs[comm.rank].copy()
        got = comm.reduce(x, root=root, op="max", algorithm=algorithm, out=x if comm.rank == root else None)
        if comm.rank == root and (got is not x or not same(x, reference("max", xs))):
            problems.append(f"root {root}: {x[:5]}")
        if comm.rank != root and (got is not None or not same(x, xs[comm.rank])):
            problems.append(f"root {root}: non-root result or input changed")
    agree(mpi_comm, problems)


def noncontiguous(arr):
    """A strided view of a bigger array holding ``arr``'s values."""
    big = np.zeros((arr.size, 3), arr.dtype)
    view = big[:, 1]
    view[...] = arr.ravel()
    assert not view.flags.c_contiguous or arr.size <= 1
    return view


@pytest.mark.parametrize("collective,algorithm", shm_long(ALGORITHMS))
def test_noncontiguous_and_readonly_inputs_and_outputs(comm, mpi_comm, collective, algorithm):
    problems = []
    count = 3 * comm.size + 2
    xs = inputs_of_all(comm.size, count, "int64", "sum")
    want = expected(collective, comm, xs, "sum", 0)
    # A transposed 2-D input (non-contiguous, read-only): results in C order of x.
    x2 = xs[comm.rank].reshape(1, count).repeat(2, axis=0).T  # shape (count, 2)
    x2.flags.writeable = False
    x2_want = expected(collective, comm, [xi.reshape(1, count).repeat(2, axis=0).T for xi in xs], "sum", 0)
    if collective == "broadcast":
        x = noncontiguous(xs[comm.rank] if comm.rank == 0 else np.zeros(count, "int64"))
        got = comm.broadcast(x, 0, algorithm, segment_size=16)
        if got is not x or not same(x, want):
            problems.append(f"strided broadcast: {x[:5]}")
    elif collective in ROWS:  # rows of a transposed read-only array, into a strided out
        rows = [rank_input(r, comm.size * count, "int64").reshape(count, comm.size).T for r in range(comm.size)]
        rows[comm.rank].flags.writeable = False
        if collective == "scatter":
            out, want = noncontiguous(np.zeros(count, "int64")), rows[0][comm.rank]
        else:
            out, want = np.zeros((count, comm.size), "int64").T, np.stack([r[comm.rank] for r in rows])
        got = call(comm, collective, rows[comm.rank], algorithm, out=out)
        if got is not out or not same(out, want):
            problems.append(f"strided {collective}: {out.ravel()[:5]} != {want.ravel()[:5]}")
    else:
        got = call(comm, collective, x2, algorithm)
        if not (got is None and x2_want is None) and not same(got, x2_want):
            problems.append(f"transposed read-only input: {np.asarray(got).ravel()[:6]}")
        shape = {"allgather": (comm.size, count), "gather": (comm.size, count),
                 "reduce_scatter": want.shape if want is not None else None}.get(collective, (count,))
        out = noncontiguous(np.zeros(int(np.prod(shape)), "int64")).reshape(shape) if shape else None
        if collective in ("allgather", "gather"):
            out = np.zeros((count, comm.size), "int64").T  # a non-contiguous (size, count) view
        got = call(comm, collective, noncontiguous(xs[comm.rank]), algorithm, out=out)
        if want is not None and (got is not out or not same(out, want)):
            problems.append(f"strided input and out: {np.asarray(got).ravel()[:6]} != {want.ravel()[:6]}")
    agree(mpi_comm, problems)


def test_out_overlapping_the_input_gets_a_snapshot(comm, mpi_comm):
    problems = []
    n = 2 * comm.size + 1
    buffer = np.concatenate([rank_input(comm.rank, n, "float64"), np.zeros(1)])
    xs = inputs_of_all(comm.size, n, "float64", "sum")
    got = comm.allreduce(buffer[:n], algorithm="ring", out=buffer[1:])  # shifted by one element
    if not same(got, reference("sum", xs)):
        problems.append(f"{got[:4]}")
    agree(mpi_comm, problems)


@pytest.mark.parametrize("algorithm", shm_long([a for a in host_algorithms("allreduce") if a != "native"]))
def test_allreduce_bits_identical_across_ranks(comm, mpi_comm, algorithm):
    rng = np.random.default_rng(1234 + comm.rank)
    problems = []
    for dtype in ("float32", "float64", "complex64"):
        x = (rng.choice([-1e6, 1e6, 1e-2, -1e-2], 1001) * rng.random(1001)).astype(dtype)
        for op in ("sum", "avg", "prod"):
            with np.errstate(over="ignore", invalid="ignore"):
                got = comm.allreduce(x, op=op, algorithm=algorithm, segment_size=512)
            everyone = mpi_comm.allgather(got.tobytes())
            if any(b != everyone[0] for b in everyone):
                problems.append(f"{dtype} {op}: results differ between ranks")
    agree(mpi_comm, problems)


@pytest.mark.parametrize("collective", cc.COLLECTIVES)
def test_blocking_native_while_some_ranks_have_calls_in_flight(comm, mpi_comm, collective):
    """A blocking call that goes to MPI's blocking collective must make the same kind
    of MPI call on every rank, whatever each rank still has in flight (here rank 0 has
    finished its async broadcast and the others have not), and must not leave a call
    in flight unfinished on a rank that blocks inside MPI."""
    problems = []
    root = comm.size - 1
    y = np.arange(8.0) * (comm.rank == root)
    h = comm.broadcast_async(y, root=root, algorithm="binomial")
    if comm.rank == 0:
        while not h.test():
            pass
    rows = (comm.size, 3) if collective in ROWS else None
    xs = inputs_of_all(comm.size, 3 * comm.size if rows else 3, "float32", "sum", rows)
    got = run_one(comm, collective, "native", xs[comm.rank], "sum", 0)
    want = expected(collective, comm, xs, "sum", 0)
    if not (got is None and want is None) and not same(got, want):
        problems.append(f"{collective}: {got} != {want}")
    if not same(h.wait(), np.arange(8.0)):
        problems.append("the broadcast in flight went wrong")
    agree(mpi_comm, problems)


@pytest.mark.parametrize("algorithm", shm_long(cc.algorithms("scatter")))
def test_scatter_with_no_x_on_the_other_ranks(comm, mpi_comm, algorithm):
    """The ranks other than the root may pass x=None and out (the row's shape and dtype)."""
    problems = []
    for root in sorted({0, comm.size - 1}):
        rows = np.arange(comm.size * 5, dtype=np.int32).reshape(comm.size, 5) + 100 * root
        out = np.full(5, -1, np.int32)
        got = comm.scatter(rows if comm.rank == root else None, root=root, algorithm=algorithm, out=out)
        if got is not out or not same(out, rows[comm.rank]):
            problems.append(f"root {root}: {out} != {rows[comm.rank]}")
        handle = comm.scatter_async(rows if comm.rank == root else None, root=root, algorithm=algorithm,
                                    out=np.empty((5,), np.int32))
        if not same(handle.wait(), rows[comm.rank]):
            problems.append(f"root {root}, async: wrong row")
    agree(mpi_comm, problems)


def test_two_async_collectives_in_flight(comm, mpi_comm):
    problems = []
    n = 50_000
    xs = inputs_of_all(comm.size, n, "float64", "sum")
    a = comm.allreduce_async(xs[comm.rank], algorithm="ring")
    b = comm.allgather_async(xs[comm.rank][:7], algorithm="bruck")
    c = comm.reduce_scatter_async(xs[comm.rank], algorithm="recursive_halving")
    d = comm.broadcast_async(np.arange(9.0) * (comm.rank == 0), root=0, algorithm="pipeline", segment_size=8)
    e = comm.reduce_async(xs[comm.rank], root=comm.size - 1, algorithm="native")
    f = comm.allreduce_async(xs[comm.rank], op="max", algorithm="tree", segment_size=4096)
    g = comm.gather_async(xs[comm.rank][:5], root=comm.size - 1, algorithm="binomial")
    rows = np.stack([x[:3] for x in xs]) * (comm.rank == 0)
    k = comm.scatter_async(rows, root=0, algorithm="binomial")
    mine = np.stack([x[:2] for x in xs]) + comm.rank  # row j for rank j
    m = comm.alltoall_async(mine, algorithm="bruck")
    handles = [a, b, c, d, e, f, g, k, m]
    while not handles[-1].test():  # test() drives progress without blocking
        pass
    order = handles if comm.rank % 2 == 0 else handles[::-1]  # ranks wait in different orders
    results = {id(h): h.wait() for h in order}
    total = reference("sum", xs)
    checks = [
        same(results[id(a)], total),
        same(results[id(b)], np.stack([x[:7] for x in xs])),
        same(results[id(c)], np.array_split(total, comm.size)[comm.rank]),
        same(results[id(d)], np.arange(9.0)),
        same(results[id(e)], total) if comm.rank == comm.size - 1 else results[id(e)] is None,
        same(results[id(f)], reference("max", xs)),
        same(results[id(g)], np.stack([x[:5] for x in xs])) if comm.rank == comm.size - 1 else results[id(g)] is None,
        same(results[id(k)], xs[comm.rank][:3]),
        same(results[id(m)], np.stack([xs[comm.rank][:2] + r for r in range(comm.size)])),
        all(h.test() for h in handles),
    ]
    if not all(checks):
        problems.append(f"async results wrong: {checks}")
    comm.barrier()
    agree(mpi_comm, problems)


def test_user_messages_never_match_library_messages(comm, mpi_comm):
    # A user message on the same communicator with tag 1 is posted before a
    # collective and received after it: the library works on its own duplicate.
    problems = []
    if comm.size > 1:
        peer = (comm.rank + 1) % comm.size
        note = np.full(4, comm.rank, "int64")
        request = mpi_comm.Isend(note, peer, tag=1)
        got = comm.allreduce(np.ones(10, "int64"), algorithm="ring")
        received = np.empty(4, "int64")
        mpi_comm.Recv(received, (comm.rank - 1) % comm.size, tag=1)
        request.Wait()
        if not same(got, np.full(10, comm.size, "int64")) or \
                not same(received, np.full(4, (comm.rank - 1) % comm.size)):
            problems.append("user and library messages got mixed")
    agree(mpi_comm, problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", ["split", "dup"])
def test_sub_communicators(mpi_comm, how):
    mpi_sub = mpi_comm.Split(mpi_comm.rank % 2, mpi_comm.rank) if how == "split" else mpi_comm.Dup()
    sub = cc.Communicator(mpi_sub)
    problems = []
    for collective, algorithm in ALGORITHMS:
        if runs_here(sub, collective, algorithm):
            run_and_compare(sub, mpi_sub, collective, algorithm, "int32", "sum", sub.size + 2, sub.size - 1, 8,
                            problems)
    sub.free()
    mpi_sub.Free()
    agree(mpi_comm, problems)


@pytest.mark.parametrize("collective", cc.COLLECTIVES)
def test_bfloat16_with_the_library_algorithms(comm, mpi_comm, collective):
    """bfloat16 (with ml_dtypes) through every algorithm but native, which MPI cannot do:
    'auto' never picks it for bfloat16 and asking for it is a clear error."""
    ml_dtypes = pytest.importorskip("ml_dtypes")  # in the test extra: runs wherever make test installed
    problems = []
    for algorithm in [a for a in cc.algorithms(collective) if runs_here(comm, collective, a)]:
        for count in counts_for(comm.size):
            rows = (comm.size, count) if collective in ROWS else None
            xs = [rank_input(r, count * comm.size if rows else count, "float32", shape=rows)  # exact in bfloat16
                  for r in range(comm.size)]
            x = xs[comm.rank].astype(ml_dtypes.bfloat16)
            if collective == "broadcast" and comm.rank != 0:
                x[...] = 0
            if algorithm == "native":
                with pytest.raises(ValueError, match="'native' cannot move bfloat16"):
                    call(comm, collective, x, algorithm)
                continue
            got = call(comm, collective, x, algorithm)
            want = expected(collective, comm, xs, "sum", 0)
            if want is not None and (got.dtype != x.dtype or not np.array_equal(got.astype(np.float32), want)):
                problems.append(f"{collective}/{algorithm} n={count}: got {got.ravel()[:4]}, want {want.ravel()[:4]}")
    agree(mpi_comm, problems)


def test_poll_advances_calls_in_flight_until_done(comm, mpi_comm):
    x = rank_input(comm.rank, 100_003, "float64")
    handles = [comm.allreduce_async(x, algorithm="ring"), comm.allgather_async(x[:5], algorithm="bruck")]
    while comm.poll():  # never blocks; every rank polls until its calls are done
        pass
    xs = [rank_input(r, 100_003, "float64") for r in range(comm.size)]
    problems = [] if all(h.test() for h in handles) else ["poll() returned 0 with calls unfinished"]
    if not same(handles[0].wait(), reference("sum", xs)):
        problems.append("allreduce driven by poll() is wrong")
    agree(mpi_comm, problems)


def test_dup_and_broadcast_object(comm, mpi_comm):
    other = comm.dup()
    assert (other.size, other.rank, other.segment_size) == (comm.size, comm.rank, comm.segment_size)
    root = comm.size - 1
    got = other.broadcast_object({"lr": 0.1, "rank": comm.rank} if comm.rank == root else None, root=root)
    problems = [] if got == {"lr": 0.1, "rank": root} else [f"broadcast_object gave {got}"]
    with pytest.raises(ValueError, match="root must be a rank"):
        other.broadcast_object(1, root=comm.size)
    other.free()
    agree(mpi_comm, problems)
