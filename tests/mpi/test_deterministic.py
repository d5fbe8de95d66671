"""Deterministic mode: every reduction equals the serial left fold in rank order.

The reference is the fold ``x0 op x1 op … op x(p-1)`` computed here with NumPy on every
rank's input (each rank makes them all from seeds). The inputs are random floats over
several decades, not integers: their sums depend on the order of the additions (checked
below), so a result folded in any other order has other bits. Comparisons are of bytes.
"""

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc
from collectives import reference
from collectives.algorithms import ORDERED, PEER_READS, build
from collectives.schedule import compile_plan
from collectives.transport.local import run_collective

from conftest import order_sensitive_input as rank_input
from conftest import quick_and_deep, serial_fold

try:
    import ml_dtypes
    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # the test extra installs it
    BFLOAT16 = None

DTYPES = ["float16", "float32", "float64", "complex64"] + (["bfloat16"] if BFLOAT16 is not None else [])
REDUCING = ("allreduce", "reduce_scatter", "reduce")


def ops_of(dtype):
    # Not complex prod: NumPy's complex multiply is not correctly rounded, and its bits
    # depend on the vector path it takes (one element or several, in place or not), so
    # no fold computed elsewhere can be the reference (docs/guides/usage.md says so).
    return ["sum", "avg"] if np.dtype(dtype).kind == "c" else ["sum", "prod", "max", "min", "avg"]


def expected(collective, op, inputs, rank, root=0):
    """The serial fold in rank order, as rank ``rank`` gets it (collectives.reference)."""
    return reference.expected(collective, inputs, op, root)[rank]


def same_bits(got, want):
    if want is None:
        return got is None
    return got is not None and got.dtype == want.dtype and np.ascontiguousarray(got).tobytes() == want.tobytes()


# -- in one process, every world size: the schedules themselves ------------------------------
@pytest.mark.serial
def test_the_inputs_are_order_sensitive():
    # Else the tests below could not tell one order from another.
    for dtype in DTYPES:
        inputs = [rank_input(r, 1000, dtype, "sum") for r in range(4)]
        assert serial_fold("sum", inputs).tobytes() != serial_fold("sum", inputs[::-1]).tobytes(), dtype
        inputs = [rank_input(r, 1000, dtype, "prod") for r in range(4)]
        assert serial_fold("prod", inputs).tobytes() != serial_fold("prod", inputs[::-1]).tobytes(), dtype
    zeros = [rank_input(r, 1000, "float32", "max") for r in range(4)]
    assert serial_fold("max", zeros).tobytes() != serial_fold("max", zeros[::-1]).tobytes()


@pytest.mark.serial
@pytest.mark.parametrize("sizes", quick_and_deep([1, 2, 3, 4], [5, 6, 7, 8, 9]))
@pytest.mark.parametrize("collective", REDUCING)
def test_ordered_schedules_equal_the_serial_fold(collective, sizes):
    problems = []
    for algorithm in ORDERED[collective]:
        for size in sizes:
            for count in (0, 1, size - 1, 3 * size + 2, 257):
                for dtype in DTYPES:
                    for op in ops_of(dtype):
                        for inplace in ([False, True] if collective != "reduce_scatter" else [False]):
                            root = size - 1
                            inputs = [rank_input(r, count, dtype, op) for r in range(size)]
                            # shm in slots of 16 elements: several segments, not one per element
                            plans = [compile_plan(build(collective, algorithm, r, size, count, root=root, ordered=True,
                                                        segment=16, inplace=inplace), inplace=inplace)
                                     for r in range(size)]
                            got = run_collective(collective, algorithm, [x.copy() for x in inputs], op, root,
                                                 inplace=inplace, plans=plans)
                            for r in range(size):
                                if not same_bits(got[r], expected(collective, op, inputs, r, root)):
                                    problems.append(f"{algorithm} p={size} n={count} {dtype} {op} "
                                                    f"inplace={inplace} rank {r}")
    assert not problems, problems[:5]


@pytest.mark.serial
def test_the_default_direct_is_not_the_serial_fold():
    # What ordered=True changes: unordered, rank r folds its own block first.
    size, count = 4, 400
    inputs = [rank_input(r, count, "float32", "sum") for r in range(size)]
    got = run_collective("allreduce", "direct", [x.copy() for x in inputs], "sum")
    assert got[0].tobytes() != serial_fold("sum", inputs).tobytes()


# -- under MPI: the Communicator ---------------------------------------------------------------
@pytest.fixture(scope="module")
def dcomm():
    comm = cc.Communicator(deterministic=True)
    yield comm
    comm.free()


def call(comm, collective, x, op, algorithm="auto", root=0, out=None, **kw):
    if collective == "allreduce":
        return comm.allreduce(x, op=op, algorithm=algorithm, out=out, **kw)
    if collective == "reduce_scatter":
        return comm.reduce_scatter(x, op=op, algorithm=algorithm, out=out, **kw)
    return comm.reduce(x, root=root, op=op, algorithm=algorithm, out=out, **kw)


def agree(problems):
    everyone = MPI.COMM_WORLD.allgather(problems)
    return [p for rank_problems in everyone for p in rank_problems]


@pytest.mark.parametrize("collective", REDUCING)
def test_every_reduction_equals_the_serial_fold(dcomm, collective):
    size, rank = dcomm.size, dcomm.rank
    problems = []
    for count in (0, 1, 2 * size + 1, 5000):
        for dtype in DTYPES:
            for op in ops_of(dtype):
                for algorithm in ("auto",) + tuple(a for a in ORDERED[collective] if (collective, a) not in PEER_READS):
                    root = (count + 1) % size
                    inputs = [rank_input(r, count, dtype, op) for r in range(size)]
                    got = call(dcomm, collective, inputs[rank].copy(), op, algorithm, root)
                    if not same_bits(got, expected(collective, op, inputs, rank, root)):
                        problems.append(f"{algorithm} n={count} {dtype} {op}")
    assert not agree(problems), agree(problems)[:5]


def test_in_place_strided_out_and_async_calls_keep_the_order(dcomm):
    size, rank = dcomm.size, dcomm.rank
    inputs = [rank_input(r, 2 * 3001, "float32", "sum", seed=1) for r in range(size)]
    want = serial_fold("sum", [x[::2] for x in inputs])
    problems = []
    x = inputs[rank].copy()
    got = dcomm.allreduce(x[::2], op="sum")  # non-contiguous input
    problems += [] if same_bits(got, want) else ["strided input"]
    y = np.ascontiguousarray(inputs[rank][::2])
    dcomm.allreduce(y, op="sum", out=y)  # in place
    problems += [] if same_bits(y, want) else ["in place"]
    out = np.empty(2 * want.size, np.float32)
    dcomm.allreduce(inputs[rank][::2], op="sum", out=out[1::2])  # strided out
    problems += [] if same_bits(out[1::2], want) else ["strided out"]
    handles = [dcomm.allreduce_async(inputs[rank][::2] * k, op="sum") for k in (1, 2, 3)]
    for k, handle in zip((1, 2, 3), handles):  # several calls in flight
        scaled = serial_fold("sum", [x[::2] * k for x in inputs])
        problems += [] if same_bits(handle.wait(), scaled) else [f"in flight {k}"]
    assert not agree(problems), agree(problems)


def test_auto_keeps_to_ordered_algorithms_at_every_size(dcomm):
    for collective in REDUCING:
        for nbytes in (0, 8, 4096, 65536, 1 << 20, 64 << 20):
            choice, why = dcomm.choose(collective, nbytes)
            assert choice in ORDERED[collective], (collective, nbytes, choice)
    plain = cc.Communicator()
    assert plain.choose("allreduce", 8)[0] == "native"
    choice, why = dcomm.choose("allreduce", 8)
    assert choice == "direct" and why.startswith("deterministic mode") and "else native" in why
    # Collectives that reduce nothing keep their usual choices, native included.
    assert dcomm.choose("allgather", 8) == plain.choose("allgather", 8)
    assert dcomm.choose("broadcast", 64 << 20) == plain.choose("broadcast", 64 << 20)
    plain.free()


def test_large_buffers_equal_the_serial_fold(dcomm):
    # Where auto would otherwise pick ring or the MPI library's own.
    size, rank = dcomm.size, dcomm.rank
    inputs = [rank_input(r, 1 << 20, "float32", "avg", seed=2) for r in range(size)]
    got = dcomm.allreduce(inputs[rank], op="avg")
    assert agree([] if same_bits(got, serial_fold("avg", inputs)) else [rank]) == []


@pytest.mark.parametrize("algorithm", ["ring", "tree", "recursive_halving", "recursive_doubling", "native"])
def test_algorithms_that_cannot_keep_the_order_are_refused(dcomm, algorithm):
    x = np.ones(10, np.float32)
    with pytest.raises(ValueError, match=f"algorithm '{algorithm}' cannot reduce in rank order"):
        dcomm.allreduce(x, algorithm=algorithm)
    if algorithm in cc.algorithms("reduce_scatter"):
        with pytest.raises(ValueError, match="cannot reduce in rank order"):
            dcomm.reduce_scatter(x, algorithm=algorithm)
    # A refused call sends nothing: the next one works.
    assert dcomm.allreduce(x).tolist() == [float(dcomm.size)] * 10
    # Allgather and broadcast reduce nothing: every algorithm is allowed.
    assert dcomm.allgather(x, algorithm="ring").shape == (dcomm.size, 10)
    dcomm.broadcast(x, algorithm="native")


def test_the_environment_sets_the_mode(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_DETERMINISTIC", "1")
    comm = cc.Communicator()
    same, plain = comm.dup(), comm.dup(deterministic=False)
    assert comm.deterministic and same.deterministic and not plain.deterministic
    for c in (comm, same, plain):
        c.free()
    monkeypatch.setenv("COLLECTIVES_DETERMINISTIC", "maybe")
    with pytest.raises(ValueError, match="COLLECTIVES_DETERMINISTIC must be 1 or 0"):
        cc.Communicator()
    monkeypatch.setenv("COLLECTIVES_DETERMINISTIC", "1")
    monkeypatch.setenv("COLLECTIVES_ALLREDUCE_ALGORITHM", "ring")
    with pytest.raises(ValueError, match="COLLECTIVES_ALLREDUCE_ALGORITHM=ring: algorithm 'ring' cannot reduce"):
        cc.Communicator()
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        cc.Communicator(deterministic="yes")


def test_check_mode_names_ranks_in_another_mode():
    comm = cc.Communicator(check=True, deterministic=MPI.COMM_WORLD.Get_rank() == 0)
    x = np.ones(8, np.float32)
    if comm.size == 1:
        comm.allreduce(x, algorithm="direct")
    else:
        with pytest.raises(cc.CollectiveMismatchError, match=r"order: rank order \(deterministic\) on rank 0"):
            comm.allreduce(x, algorithm="direct")
    comm.allgather(x)  # reduces nothing: the modes need not agree
    comm.free()


@pytest.mark.parametrize("compression", [None, "fp16", "bf16"])
def test_training_with_deterministic_reproduces_the_serial_fold(compression):
    from collectives.training import GradientReducer

    if compression == "bf16" and BFLOAT16 is None:
        pytest.skip("ml_dtypes is not installed")
    comm = cc.Communicator()
    size, rank = comm.size, comm.rank
    shapes = {"w1": (300, 7), "b1": (7,), "w2": (7, 1000)}
    params = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
    reducer = GradientReducer(params, comm, deterministic=True, compression=compression, bucket_bytes=16 << 10,
                              first_bucket_bytes=4 << 10)
    grads = {name: [rank_input(r, int(np.prod(shape)), "float32", "sum", seed=i).reshape(shape)
                    for r in range(size)] for i, (name, shape) in enumerate(shapes.items())}
    mine = {name: grads[name][rank].copy() for name in shapes}
    for name in reversed(list(shapes)):
        reducer.gradient_ready(name, mine[name])
    reducer.synchronize()
    wire = {"fp16": np.float16, "bf16": BFLOAT16}.get(compression)
    problems = []
    for name in shapes:
        if wire is None:
            want = serial_fold("avg", grads[name])
        else:  # each rank divides by p, casts to 16 bits; summed in 16 bits, cast back
            want = serial_fold("sum", [(g / np.float32(size)).astype(wire) for g in grads[name]]).astype(np.float32)
        if not same_bits(mine[name], want):
            problems.append(name)
    reducer.close()
    comm.free()
    assert not agree(problems), agree(problems)


def test_training_refuses_an_algorithm_that_cannot_keep_the_order():
    from collectives.training import GradientReducer

    comm = cc.Communicator()
    with pytest.raises(ValueError, match="'ring' cannot reduce in rank order"):
        GradientReducer({"w": np.zeros(4, np.float32)}, comm, deterministic=True, algorithm="ring")
    comm.free()


@pytest.mark.any_size
def test_torch_distributed_optimizer_takes_deterministic():
    torch = pytest.importorskip("torch")
    from collectives.torch import DistributedOptimizer

    model = torch.nn.Linear(3, 2)
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), deterministic=True)
    assert optimizer._reducer._comm.deterministic
    optimizer.close()
