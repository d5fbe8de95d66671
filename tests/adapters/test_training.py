"""The data-parallel training core (collectives.training), serially and under mpiexec.

The reference is single-process training written here in NumPy with no library call:
k SGD steps of a small MLP on the whole global batch. Data-parallel training over the
world must give the same parameters, within a floating-point tolerance (the global
mean gradient is summed in a different order: mean of the ranks' shard means), and
bit-for-bit the same parameters on every rank after every step (checked with mpi4py's
own allgather).

Tolerances (documented in docs/guides/training.md): float64, rtol 1e-9; float32, rtol 1e-5;
float16 compression: the averaged gradient within (p + 1) * 2**-10 of the largest
gradient magnitude; bfloat16 compression: (p + 1) * 2**-7.
"""

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc
from collectives.training import (
    BUCKET_BYTES,
    FIRST_BUCKET_BYTES,
    GradientReducer,
    TrainingError,
    broadcast_parameters,
    check_parameters,
    plan_buckets,
)

from conftest import agree, identical_everywhere, shard
from numpy_model import backward, data, init_params, sgd, single_process

STEPS = 3


def close(a, b, rtol):
    return all(np.allclose(a[n], b[n], rtol=rtol, atol=rtol) for n in a)


# -- equivalence with single-process training ------------------------------------------------
@pytest.mark.parametrize("options", [
    {},
    {"first_bucket_bytes": 64, "bucket_bytes": 512},          # many buckets, mixed
    {"algorithm": "ring", "first_bucket_bytes": 200},
    {"progress_thread": True},
])
def test_data_parallel_sgd_equals_single_process(comm, options):
    want = single_process(STEPS)
    params = init_params(comm.rank * 7)  # rank 0 has the reference's start; the others differ until broadcast
    broadcast_parameters(params, comm=comm)
    problems = []
    with GradientReducer(params, comm, **options) as reducer:
        for step in range(STEPS):
            x, y = shard(comm, *data(step))
            for name, g in backward(params, x, y):
                reducer.gradient_ready(name, g)
            sgd(params, reducer.synchronize())
            if not close(params, want[step], 1e-9):
                problems.append(f"step {step}: differs from single-process training beyond rtol 1e-9")
            if not identical_everywhere(params.values()):
                problems.append(f"step {step}: parameters differ between ranks")
    agree(MPI.COMM_WORLD, problems)


@pytest.mark.parametrize("how", ["backward_passes_per_step", "no_sync"])
def test_gradient_accumulation_equals_single_process(comm, how):
    micro = 2
    want = single_process(STEPS)
    params = init_params(comm.rank * 7)
    broadcast_parameters(params, comm=comm)
    k = micro if how == "backward_passes_per_step" else 1
    reducer = GradientReducer(params, comm, backward_passes_per_step=k, first_bucket_bytes=256)
    problems = []
    for step in range(STEPS):
        x, y = data(step)
        accumulated = {n: np.zeros_like(a) for n, a in params.items()}
        for index in range(micro):
            last = index == micro - 1
            for name, g in backward(params, *shard(comm, x, y, micro, index)):
                accumulated[name] += g / micro  # the caller accumulates, as .grad does
                if how == "no_sync" and not last:
                    with reducer.no_sync():
                        reducer.gradient_ready(name, accumulated[name])
                else:
                    reducer.gradient_ready(name, accumulated[name])
        sgd(params, reducer.synchronize())
        if not close(params, want[step], 1e-9):
            problems.append(f"step {step}: differs from single-process training")
        if not identical_everywhere(params.values()):
            problems.append(f"step {step}: parameters differ between ranks")
    agree(MPI.COMM_WORLD, problems)


def test_float32_training_within_tolerance(comm):
    want = single_process(STEPS, np.float32)
    params = init_params(0, np.float32)
    reducer = GradientReducer(params, comm)
    problems = []
    for step in range(STEPS):
        for name, g in backward(params, *shard(comm, *data(step, np.float32))):
            reducer.gradient_ready(name, g)
        sgd(params, reducer.synchronize())
        if not close(params, want[step], 1e-5):
            problems.append(f"step {step}: float32 differs beyond rtol 1e-5")
        if not identical_everywhere(params.values()):
            problems.append(f"step {step}: parameters differ between ranks")
    agree(MPI.COMM_WORLD, problems)


@pytest.mark.parametrize("compression, thread", [("fp16", False), ("fp16", True), ("bf16", False)])
def test_compression_within_its_tolerance(comm, compression, thread):
    """Each gradient averaged over ranks through float16 (bfloat16): within
    (p + 1) * 2**-10 (2**-7) of the largest magnitude of the exact mean, and
    bit-identical on every rank; gradients near float16's limit do not overflow,
    because each rank divides by the world size before the sum."""
    if compression == "bf16":
        pytest.importorskip("ml_dtypes")  # in the test extra: runs wherever make test installed
    epsilon = 2.0**-10 if compression == "fp16" else 2.0**-7
    shapes = {"a": (1000,), "b": (33, 7), "c": (), "large": (50,)}
    scale = {"a": 4, "b": 4, "c": 4, "large": 40000}  # 'large': p * 40000 overflows float16 unless divided first
    grads_of = {r: {n: np.random.default_rng(r * 10 + i).uniform(-scale[n], scale[n], s)
                    for i, (n, s) in enumerate(shapes.items())}
                for r in range(comm.size)}
    params = {n: np.zeros(s) for n, s in shapes.items()}
    problems = []
    with GradientReducer(params, comm, compression=compression, first_bucket_bytes=1000,
                         progress_thread=thread) as reducer:
        for name, g in grads_of[comm.rank].items():
            reducer.gradient_ready(name, g.copy())
        got = reducer.synchronize()
    for name in shapes:
        exact = sum(grads_of[r][name] for r in range(comm.size)) / comm.size
        bound = (comm.size + 1) * epsilon * max(np.abs(exact).max(), 1e-3)
        error = np.abs(got[name] - exact).max()
        if got[name].dtype != np.float64 or error > bound:
            problems.append(f"{name}: error {error:.3g} > bound {bound:.3g} (dtype {got[name].dtype})")
    if not identical_everywhere(got.values()):
        problems.append("compressed gradients differ between ranks")
    agree(MPI.COMM_WORLD, problems)


def test_gradients_in_any_order_start_buckets_in_bucket_order(comm):
    """Ranks hand gradients over in different orders; buckets still start in one order
    everywhere (else their messages would cross), and a full bucket starts before
    synchronize (that is the overlap)."""
    params = {f"p{i}": np.zeros(50) for i in range(8)}
    reducer = GradientReducer(params, comm, first_bucket_bytes=800, bucket_bytes=800)
    assert len(reducer.buckets) == 4
    order = list(params)
    np.random.default_rng(comm.rank).shuffle(order)
    problems = []
    first = reducer.buckets[0].names
    for name in first:  # the first bucket alone: it starts at once
        reducer.gradient_ready(name, np.full(50, float(comm.rank)))
    if len(reducer._handles) != 1:
        problems.append(f"the full first bucket did not start: {len(reducer._handles)} started")
    for name in order:
        if name not in first:
            reducer.gradient_ready(name, np.full(50, float(comm.rank + int(name[1:]))))
    got = reducer.synchronize()
    for name, g in got.items():
        shift = 0 if name in first else int(name[1:])
        want = np.full(50, (comm.size - 1) / 2 + shift)
        if not np.array_equal(g, want):
            problems.append(f"{name}: got {g[:3]}, want {want[:3]}")
    agree(MPI.COMM_WORLD, problems)


def test_read_only_gradient_gets_a_copy_and_zero_sized_params(comm):
    params = {"w": np.zeros(6), "empty": np.zeros((0, 3))}
    reducer = GradientReducer(params, comm)
    g = np.arange(6.0) * (comm.rank + 1)
    g.flags.writeable = False
    reducer.gradient_ready("w", g)
    reducer.gradient_ready("empty", np.zeros((0, 3)))
    got = reducer.synchronize()
    want = np.arange(6.0) * (comm.size + 1) / 2
    agree(MPI.COMM_WORLD, [] if np.array_equal(got["w"], want) and got["empty"].shape == (0, 3) else [f"got {got}"])


# -- buckets ------------------------------------------------------------------------------------
@pytest.mark.serial
def test_bucket_layout():
    kib = 1024
    entries = [("last", (256,), "float32"), ("mid", (512 * kib,), "float32"), ("half", (8,), "float16"),
               ("big", (6 * 1024 * kib,), "float32"), ("first", (4,), "float32")]
    buckets = plan_buckets(entries)
    assert [(b.dtype.name, b.names) for b in buckets] == [
        ("float32", ["last"]),              # 'mid' would take the first bucket past 1 MiB
        ("float32", ["mid"]),
        ("float16", ["half"]),
        ("float32", ["big", "first"]),      # 2 MiB + 24 MiB is past the later buckets' 25 MiB cap
    ]
    assert [b.cap for b in buckets] == [FIRST_BUCKET_BYTES, BUCKET_BYTES, FIRST_BUCKET_BYTES, BUCKET_BYTES]
    assert buckets[3].slices == {"big": (0, 6 * 1024 * kib), "first": (6 * 1024 * kib, 6 * 1024 * kib + 4)}
    # buckets are numbered by when they fill: float32 norms between float16 weights
    # share one bucket, which fills only with the last norm
    mixed = plan_buckets([("n2", (4,), "float32"), ("w2", (1 << 20,), "float16"), ("n1", (4,), "float32"),
                          ("w1", (1 << 20,), "float16"), ("n0", (4,), "float32")], 1 << 20, 1 << 20)
    assert [b.names for b in mixed] == [["w2"], ["w1"], ["n2", "n1", "n0"]]
    assert [b.index for b in mixed] == [0, 1, 2]
    # an array larger than the cap has a bucket of its own
    alone = plan_buckets([("a", (10,), "float64"), ("huge", (1000,), "float64"), ("b", (10,), "float64")], 100, 100)
    assert [b.names for b in alone] == [["a"], ["huge"], ["b"]]


@pytest.mark.serial
def test_reducer_lays_out_parameters_in_reverse_order(comm):
    params = {"first": np.zeros(3, np.float32), "second": np.zeros(2), "third": np.zeros(4, np.float32)}
    reducer = GradientReducer(params, comm)
    # float64's bucket fills (with 'second') before float32's (with 'first'): it goes first
    assert [b.names for b in reducer.buckets] == [["second"], ["third", "first"]]


# -- broadcast and checks -----------------------------------------------------------------------
@pytest.mark.parametrize("root", [0, "last"])
def test_broadcast_parameters_of_every_kind(comm, root):
    root = comm.size - 1 if root == "last" else root

    def make(rank):
        rng = np.random.default_rng(rank)
        return {
            "float": rng.standard_normal((5, 3)),
            "int": rng.integers(-9, 9, 7).astype(np.int64),
            "half": rng.standard_normal(4).astype(np.float16),
            "complex": rng.standard_normal(3) + 1j * rng.standard_normal(3),
            "scalar": np.array(float(rank)),
            "strided": rng.standard_normal((6, 4))[:, ::2],
            "empty": np.zeros((0,)),
        }

    params, want = make(comm.rank), make(root)
    broadcast_parameters(params, root=root, comm=comm, bucket_bytes=64)  # several buckets
    bad = [n for n in want if not np.array_equal(params[n], want[n])]
    agree(MPI.COMM_WORLD, [f"{bad} differ from root {root}'s"] if bad else [])


def test_broadcast_parameters_rejects_bad_input(comm):
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match=r"params\['w'\] must be writable"):
        broadcast_parameters({"w": frozen}, comm=comm)
    with pytest.raises(TypeError, match=r"params\['w'\] must be a numpy.ndarray"):
        broadcast_parameters({"w": [1.0, 2.0]}, comm=comm)
    with pytest.raises(ValueError, match="root must be a rank"):
        broadcast_parameters({"w": np.zeros(3)}, root=comm.size, comm=comm)
    with pytest.raises(TypeError, match="comm must be a collectives.Communicator"):
        broadcast_parameters({"w": np.zeros(3)}, comm=MPI.COMM_WORLD)


def test_check_parameters_names_the_parameter_and_the_ranks(comm):
    params = {"same": np.arange(4.0), "drift": np.arange(3.0)}
    check_parameters(params, comm)  # identical: no error
    if comm.size == 1:
        return
    params["drift"][0] += comm.rank % 2  # odd ranks drift
    odd = ", ".join(str(r) for r in range(1, comm.size, 2))
    with pytest.raises(TrainingError, match=rf"'drift' on rank\(s\) {odd}\. Broadcast"):
        check_parameters(params, comm)


def test_layout_mismatch_raises_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to differ")  # runs under every mpiexec world size
    shape = (4,) if comm.rank != comm.size - 1 else (5,)
    with pytest.raises(TrainingError, match=rf"rank\(s\) {comm.size - 1} passed other names, shapes") as info:
        GradientReducer({"w": np.zeros(shape)}, comm)
    if comm.rank == comm.size - 1:
        assert "entry 0 is 'w' shape (5,) dtype float64, rank 0 has 'w' shape (4,)" in str(info.value)


# -- misuse -----------------------------------------------------------------------------------------
def test_stepping_before_every_gradient_arrived(comm):
    params = {"a": np.zeros(3), "b": np.zeros(3)}
    reducer = GradientReducer(params, comm, first_bucket_bytes=8)
    reducer.gradient_ready("b", np.ones(3))  # 'b' is laid out first and starts at once
    with pytest.raises(TrainingError, match=r"1 of 2 parameters \('a'\) were not handed over 1 time"):
        reducer.synchronize()
    # the reducer is usable again for the next step
    reducer.gradient_ready("a", np.ones(3))
    reducer.gradient_ready("b", np.ones(3))
    got = reducer.synchronize()
    agree(MPI.COMM_WORLD, [] if np.array_equal(got["a"], np.ones(3)) else [f"after the error: {got}"])


def test_gradient_arriving_too_often(comm):
    reducer = GradientReducer({"a": np.zeros(2), "b": np.zeros(2)}, comm, backward_passes_per_step=2)
    reducer.gradient_ready("a", np.ones(2))
    reducer.gradient_ready("a", np.ones(2))
    with pytest.raises(TrainingError, match="increase backward_passes_per_step"):
        reducer.gradient_ready("a", np.ones(2))
    with pytest.raises(TrainingError, match="synchronize.. inside no_sync"):
        with reducer.no_sync():
            reducer.synchronize()
    reducer.gradient_ready("b", np.ones(2))
    reducer.gradient_ready("b", np.ones(2))
    reducer.synchronize()


def test_bad_arguments(comm):
    params = {"w": np.zeros((2, 3))}
    reducer = GradientReducer(params, comm)
    with pytest.raises(ValueError, match="name 'v' is not one of"):
        reducer.gradient_ready("v", np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"grad for 'w' must have shape \(2, 3\) and dtype float64"):
        reducer.gradient_ready("w", np.zeros(6))
    with pytest.raises(ValueError, match="grad for 'w' must have shape"):
        reducer.gradient_ready("w", np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match="grad for 'w' must be a numpy.ndarray"):
        reducer.gradient_ready("w", [[0.0] * 3] * 2)
    with pytest.raises(TypeError, match=r"params\['n'\] has dtype int64"):
        GradientReducer({"n": np.zeros(2, np.int64)}, comm)
    with pytest.raises(ValueError, match="compression must be one of"):
        GradientReducer(params, comm, compression="int8")
    with pytest.raises(TypeError, match=r"sends 16-bit floats.*params\['z'\] is complex128"):
        GradientReducer({"z": np.zeros(2, complex)}, comm, compression="fp16")
    with pytest.raises(TypeError, match=r"params\['h'\] is float16: leave compression off"):
        GradientReducer({"h": np.zeros(2, np.float16)}, comm, compression="fp16")
    with pytest.raises(ValueError, match="backward_passes_per_step must be a positive integer"):
        GradientReducer(params, comm, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="bucket_bytes must be a positive number of bytes"):
        GradientReducer(params, comm, bucket_bytes=0)
    with pytest.raises(ValueError, match="unknown algorithm|algorithm"):
        GradientReducer(params, comm, algorithm="bruck")
    with pytest.raises(ValueError, match="duplicate names: w"):
        GradientReducer([("w", np.zeros(2)), ("w", np.zeros(2))], comm)
    reducer.close()
    with pytest.raises(TrainingError, match="closed"):
        reducer.gradient_ready("w", np.zeros((2, 3)))


def test_native_cannot_reduce_bfloat16(comm):
    ml_dtypes = pytest.importorskip("ml_dtypes")  # in the test extra: runs wherever make test installed
    with pytest.raises(ValueError, match="'native' cannot reduce bfloat16"):
        GradientReducer({"w": np.zeros(3, ml_dtypes.bfloat16)}, comm, algorithm="native")
    with pytest.raises(ValueError, match="'native' cannot reduce bfloat16"):
        GradientReducer({"w": np.zeros(3, np.float32)}, comm, algorithm="native", compression="bf16")


def test_a_failed_allreduce_breaks_the_reducer(comm, monkeypatch):
    """If starting a bucket fails (as when MPI refuses), no later call returns gradients
    that were never reduced: every call raises, naming the first error."""
    reducer = GradientReducer({"w": np.zeros(3)}, comm)

    def refuse(*args, **kwargs):
        raise cc.TransportError("the MPI library refused the call")

    monkeypatch.setattr(reducer._comm, "allreduce_async", refuse)
    with pytest.raises(cc.TransportError, match="refused"):
        reducer.gradient_ready("w", np.ones(3))
    with pytest.raises(TrainingError, match="broken by an earlier error: the MPI library refused"):
        reducer.synchronize()
    with pytest.raises(TrainingError, match="broken"):
        reducer.gradient_ready("w", np.ones(3))
    reducer.close()
