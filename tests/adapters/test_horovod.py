"""collectives.horovod.torch (Horovod's PyTorch API), serially and under mpiexec; skipped
when torch is not installed.

Every call is checked against an independent reference: NumPy on every rank's input
(each rank computes all of them: integer-valued, so every result is exact), the MPI
library's own collectives through mpi4py, and, for the Horovod training script
examples/train_horovod.py, single-process PyTorch training on the global batch.
"""

import contextlib
import functools
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")

import collectives.horovod.torch as hvd  # noqa: E402
from collectives import CollectiveMismatchError  # noqa: E402

from conftest import EXAMPLES, GLOBAL_BATCH, UFUNC, agree, identical_everywhere, rank_input, same  # noqa: E402
from torch_reference import close  # noqa: E402

sys.path.insert(0, str(EXAMPLES))
import train_horovod  # noqa: E402

torch.set_num_threads(1)  # up to 8 ranks share 2 cores

WORLD = MPI.COMM_WORLD
P, ME = WORLD.Get_size(), WORLD.Get_rank()
OPS = {"avg": hvd.Average, "sum": hvd.Sum, "min": hvd.Min, "max": hvd.Max, "prod": hvd.Product}


@pytest.fixture(scope="module", autouse=True)
def horovod():
    hvd.init()
    yield
    hvd.shutdown()


def everyones(shape, dtype, op="sum", salt=0):
    """Every rank's input as tensors (integer-valued, exact under ``op``)."""
    count = int(np.prod(shape))
    return [torch.from_numpy(rank_input(r + salt, count, dtype, op, shape)) for r in range(P)]


def expected(op, xs, pre=1.0, post=1.0):
    """NumPy's Horovod result: prescale, reduce, postscale; integers scaled in double and
    truncated, an integer average truncated toward zero."""
    arrays = [x.numpy() for x in xs]
    dtype = arrays[0].dtype
    integer = dtype.kind in "iu"
    if pre != 1.0:
        arrays = [(a.astype(np.float64) * pre).astype(dtype) if integer else a * dtype.type(pre) for a in arrays]
    total = functools.reduce(UFUNC[op], arrays)
    if op == "avg":
        if integer:
            return np.trunc(total.astype(np.float64) * (post / P) if post != 1.0 else total / P).astype(dtype)
        total = (total / P).astype(dtype)
    if post != 1.0:
        total = (total.astype(np.float64) * post).astype(dtype) if integer else total * dtype.type(post)
    return total


def test_topology_against_processor_names():
    names = WORLD.allgather(MPI.Get_processor_name())
    local = [r for r in range(P) if names[r] == names[ME]]
    local_rank_of = [[q for q in range(P) if names[q] == names[r]].index(r) for r in range(P)]
    cross = [r for r in range(P) if local_rank_of[r] == local_rank_of[ME]]
    assert (hvd.size(), hvd.rank()) == (P, ME)
    assert (hvd.local_size(), hvd.local_rank()) == (len(local), local.index(ME))
    assert (hvd.cross_size(), hvd.cross_rank()) == (len(cross), cross.index(ME))
    sizes = {names.count(n) for n in names}
    assert hvd.is_homogeneous() == (len(sizes) == 1)
    assert hvd.is_initialized() and hvd.mpi_built() and hvd.mpi_enabled() and not hvd.nccl_built()
    assert hvd.mpi_threads_supported() == (MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    assert hvd.global_process_set.size() == P and hvd.global_process_set.rank() == ME
    hvd.init()  # again: nothing happens
    assert hvd.size() == P


@pytest.mark.parametrize("dtype", ["float64", "float32", "int32", "int64"])
@pytest.mark.parametrize("op", list(OPS))
def test_allreduce_every_form(dtype, op):
    xs = everyones((3, 5), dtype, op)
    want = expected(op, xs)
    mine = xs[ME].clone()
    problems = []
    results = {
        "allreduce": hvd.allreduce(mine, op=OPS[op], name="x"),
        "allreduce, non-contiguous": hvd.allreduce(mine.t(), op=OPS[op]).t(),
        "allreduce_async": hvd.synchronize(hvd.allreduce_async(mine, op=OPS[op])),
    }
    if not torch.equal(mine, xs[ME]):
        problems.append("the input of an out-of-place allreduce changed")
    inplace = mine.clone()
    handle = hvd.allreduce_async_(inplace, op=OPS[op])
    while not hvd.poll(handle):
        pass
    results["allreduce_async_ (polled)"] = hvd.synchronize(handle)
    if results["allreduce_async_ (polled)"] is not inplace:
        problems.append("allreduce_async_ returned another tensor than its input")
    twice = mine.clone()
    results["allreduce_"] = hvd.allreduce_(twice, op=OPS[op])
    results["allreduce_ result in place"] = twice
    for what, got in results.items():
        if not same(got.numpy(), want):
            problems.append(f"{what}: {got.numpy().ravel()[:6]} != {want.ravel()[:6]}")
    if op in ("sum", "max", "min", "prod"):  # the MPI library's own allreduce
        native = np.empty_like(want)
        WORLD.Allreduce(xs[ME].numpy(), native, op={"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN,
                                                     "prod": MPI.PROD}[op])
        if not same(results["allreduce"].numpy(), native):
            problems.append("allreduce differs from MPI_Allreduce")
    agree(WORLD, problems)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "complex128"])
def test_allreduce_16_bit_and_complex(dtype):
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")  # NumPy's bfloat16, in the test extra
    values = [torch.from_numpy(rank_input(r, 9, "complex128" if dtype == "complex128" else "float64"))
              for r in range(P)]
    xs = [v.to(getattr(torch, dtype)) for v in values]
    total = sum(values)  # small integers: every partial sum is exact in 16 bits
    got = hvd.allreduce(xs[ME], op=hvd.Sum)
    problems = [] if torch.equal(got, total.to(got.dtype)) else [f"{dtype} sum: {got} != {total}"]
    if dtype == "complex128":
        averaged = hvd.allreduce(xs[ME])
        if not same(averaged.numpy(), expected("avg", xs)):
            problems.append("complex average differs from NumPy")
    else:
        largest = hvd.allreduce(xs[ME], op=hvd.Max)
        if not torch.equal(largest, torch.stack(values).max(dim=0).values.to(largest.dtype)):
            problems.append(f"{dtype} max differs")
    agree(WORLD, problems)


@pytest.mark.parametrize("dtype, pre, post", [("float64", 2.0, 0.5), ("float32", 0.5, 3.0), ("int32", 1.5, 3.0),
                                              ("int64", 1.0, 0.5)])
@pytest.mark.parametrize("op", ["avg", "sum"])
def test_prescale_and_postscale(dtype, pre, post, op):
    xs = everyones((7,), dtype)
    want = expected(op, xs, pre, post)
    got = hvd.allreduce(xs[ME], op=OPS[op], prescale_factor=pre, postscale_factor=post)
    inplace = xs[ME].clone()
    hvd.allreduce_(inplace, op=OPS[op], prescale_factor=pre, postscale_factor=post)
    agree(WORLD, [f"{what}: {g.numpy()} != {want}" for what, g in (("allreduce", got), ("allreduce_", inplace))
                  if not same(g.numpy(), want)])


def test_legacy_average_argument_and_default_op():
    xs = everyones((4,), "float64")
    with pytest.warns(DeprecationWarning, match="average"):
        summed = hvd.allreduce(xs[ME], average=False)
    with pytest.warns(DeprecationWarning):
        averaged = hvd.allreduce(xs[ME], average=True)
    default = hvd.allreduce(xs[ME])
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(xs[ME], average=True, op=hvd.Sum)
    assert same(summed.numpy(), expected("sum", xs))
    assert same(averaged.numpy(), expected("avg", xs)) and same(default.numpy(), expected("avg", xs))


def test_allreduce_compression_and_gradient():
    xs = everyones((6,), "float32")
    got = hvd.allreduce(xs[ME], op=hvd.Sum, compression=hvd.Compression.fp16)  # small integers: exact in fp16
    assert got.dtype == torch.float32 and same(got.numpy(), expected("sum", xs))
    weights = [torch.arange(6, dtype=torch.float64) * (r + 1) for r in range(P)]
    x = xs[ME].double().requires_grad_()
    (hvd.allreduce(x, op=hvd.Sum) * weights[ME]).sum().backward()  # Horovod: the gradients reduced alike
    assert torch.equal(x.grad, sum(weights))
    x.grad = None
    (hvd.allreduce(x) * weights[ME]).sum().backward()
    assert torch.allclose(x.grad, sum(weights) / P, rtol=1e-15)


def test_grouped_allreduce():
    xs = [everyones((3,), "float64"), everyones((2, 2), "int64", salt=1), everyones((5,), "float32", salt=2)]
    mine = [x[ME].clone() for x in xs]
    want = [expected("sum", x) for x in xs]
    blocking = hvd.grouped_allreduce(mine, op=hvd.Sum)
    handle = hvd.grouped_allreduce_async(mine, op=hvd.Sum)
    asynchronous = hvd.synchronize(handle)
    inplace = hvd.grouped_allreduce_(mine, op=hvd.Sum)
    problems = []
    for what, results in (("grouped_allreduce", blocking), ("grouped_allreduce_async", asynchronous),
                          ("grouped_allreduce_", inplace), ("grouped_allreduce_ in place", mine)):
        if not all(same(r.numpy(), w) for r, w in zip(results, want)):
            problems.append(f"{what} differs from NumPy")
    agree(WORLD, problems)


def _rows(r):
    return (2 * r) % 3  # 0, 2, 1, 0, 2 ... rows: some ranks contribute nothing


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool"])
@pytest.mark.parametrize("uneven", [False, True])
def test_allgather_concatenates_along_dimension_0(dtype, uneven):
    rows = [_rows(r) if uneven else 2 for r in range(P)]
    xs = [torch.from_numpy(rank_input(r, rows[r] * 3, "int64", shape=(rows[r], 3))) for r in range(P)]
    xs = [x > 0 if dtype == "bool" else x.to(getattr(torch, dtype)) for x in xs]
    want = torch.cat(xs)
    got = hvd.allgather(xs[ME], name="g")
    handle = hvd.allgather_async(xs[ME])
    other = hvd.grouped_allgather([xs[ME], xs[ME][:, :1]])
    problems = []
    if not torch.equal(got, want):
        problems.append(f"allgather: {got.tolist()} != {want.tolist()}")
    if not torch.equal(hvd.synchronize(handle), want):
        problems.append("allgather_async differs")
    if not (torch.equal(other[0], want) and torch.equal(other[1], want[:, :1])):
        problems.append("grouped_allgather differs")
    if not uneven:  # the MPI library's own allgather
        native = np.empty((P, *xs[ME].shape), xs[ME].numpy().dtype)
        WORLD.Allgather(xs[ME].numpy(), native)
        if not np.array_equal(got.numpy(), native.reshape(want.shape)):
            problems.append("allgather differs from MPI_Allgather")
    agree(WORLD, problems)


def test_allgather_gradient_is_the_averaged_slice():
    x = torch.ones(_rows(ME) + 1, 2, dtype=torch.float64, requires_grad=True)
    y = hvd.allgather(x)
    (y * (torch.arange(y.numel(), dtype=torch.float64).reshape(y.shape) + ME)).sum().backward()
    offset = sum(_rows(r) + 1 for r in range(ME))
    averaged = torch.arange(y.numel(), dtype=torch.float64).reshape(y.shape) + (P - 1) / 2
    assert torch.allclose(x.grad, averaged[offset:offset + x.shape[0]], rtol=1e-15)


@pytest.mark.parametrize("root", sorted({0, P - 1}))
def test_broadcast_every_form(root):
    xs = everyones((2, 3), "float64")
    mine = xs[ME].clone()
    want = xs[root]
    got = hvd.broadcast(mine, root_rank=root, name="b")
    asynchronous = hvd.synchronize(hvd.broadcast_async(mine, root))
    problems = [] if torch.equal(mine, xs[ME]) else ["broadcast changed its input"]
    inplace = mine.clone()
    hvd.broadcast_(inplace, root)
    inplace_async = mine.clone()
    result = hvd.synchronize(hvd.broadcast_async_(inplace_async, root))
    native = xs[ME].numpy().copy()
    WORLD.Bcast(native, root=root)  # the MPI library's own broadcast
    for what, tensor in (("broadcast", got), ("broadcast_async", asynchronous), ("broadcast_", inplace),
                         ("broadcast_async_", inplace_async), ("broadcast_async_ result", result)):
        if not (torch.equal(tensor, want) and np.array_equal(tensor.numpy(), native)):
            problems.append(f"{what} differs")
    x = xs[ME].clone().requires_grad_()
    hvd.broadcast(x, root).sum().backward()  # Horovod: the averaged gradient on the root, zeros elsewhere
    if not torch.equal(x.grad, torch.ones_like(x) if ME == root else torch.zeros_like(x)):
        problems.append(f"broadcast's gradient: {x.grad}")
    agree(WORLD, problems)


def _alltoall_input(r, splits):
    """Rank r's rows: row k holds 100 r + k; one row more than the splits send."""
    return torch.arange(sum(splits) + 1, dtype=torch.float64).unsqueeze(1).repeat(1, 2) + 100 * r


def test_alltoall_equal_parts_against_mpi():
    xs = [torch.arange(2 * P * 3, dtype=torch.int32).reshape(2 * P, 3) + 1000 * r for r in range(P)]
    got = hvd.alltoall(xs[ME])
    native = np.empty((2 * P, 3), np.int32)
    WORLD.Alltoall(xs[ME].numpy(), native)  # the MPI library's own alltoall
    want = torch.cat([xs[r][2 * ME:2 * ME + 2] for r in range(P)])
    output, received = hvd.synchronize(hvd.alltoall_async(xs[ME]))
    assert torch.equal(got, want) and np.array_equal(got.numpy(), native)
    assert torch.equal(output, want) and received.tolist() == [2] * P and received.dtype == torch.int32


@pytest.mark.parametrize("kind", ["list", "tensor"])
def test_alltoall_with_splits(kind):
    splits = [[(r + j) % 3 for j in range(P)] for r in range(P)]
    xs = [_alltoall_input(r, splits[r]) for r in range(P)]
    starts = [np.concatenate([[0], np.cumsum(s)]) for s in splits]
    want = torch.cat([xs[r][starts[r][ME]:starts[r][ME + 1]] for r in range(P)])
    want_splits = [splits[r][ME] for r in range(P)]
    given = splits[ME] if kind == "list" else torch.tensor(splits[ME])  # int64 tensor
    output, received = hvd.alltoall(xs[ME], splits=given)
    assert torch.equal(output, want)
    assert received.tolist() == want_splits
    assert received.dtype == (torch.int32 if kind == "list" else torch.int64)
    x = xs[ME].clone().requires_grad_()
    out, _ = hvd.alltoall(x, splits=given)
    out.sum().backward()  # the gradient's rows go back where they came from; the unsent row gets none
    assert torch.equal(x.grad[:-1], torch.ones_like(x[:-1])) and torch.equal(x.grad[-1], torch.zeros(2).double())


@pytest.mark.parametrize("rows", sorted({2 * P, P + 1}))
@pytest.mark.parametrize("dtype, op", [("float64", "sum"), ("float64", "avg"), ("int32", "avg"), ("float32", "max")])
def test_reducescatter_rows_as_horovod_splits_them(rows, dtype, op):
    xs = everyones((rows, 3), dtype, op)
    total = expected(op, xs)
    mine = np.array_split(total, P)[ME]  # the first rows % P ranks get one row more
    got = hvd.reducescatter(xs[ME], op=OPS[op])
    asynchronous = hvd.synchronize(hvd.reducescatter_async(xs[ME], op=OPS[op]))
    grouped = hvd.grouped_reducescatter([xs[ME]], op=OPS[op])[0]
    agree(WORLD, [f"{what}: {g.numpy().tolist()} != {mine.tolist()}" for what, g in
                  (("reducescatter", got), ("async", asynchronous), ("grouped", grouped)) if not same(g.numpy(), mine)])


def test_objects():
    root = P - 1
    obj = {"rank": ME, "nested": [ME, (ME, "x" * ME)]} if ME == root else None
    assert hvd.broadcast_object(obj, root_rank=root) == {"rank": root, "nested": [root, (root, "x" * root)]}
    assert hvd.broadcast_object(ME) == 0  # root_rank defaults to 0
    everyone = hvd.allgather_object({"rank": ME, "payload": list(range(ME))})
    assert everyone == [{"rank": r, "payload": list(range(r))} for r in range(P)]
    with pytest.raises(TypeError, match="cannot be pickled"):
        hvd.broadcast_object((lambda: 0) if ME == 0 else None)  # the root's object cannot be pickled
    with pytest.raises(TypeError, match=r"rank\(s\) 0 cannot be pickled"):
        hvd.allgather_object((lambda: 0) if ME == 0 else 1)
    hvd.barrier()


def test_handles_in_flight_together_and_waited_in_any_order():
    xs = everyones((64,), "float64")
    handles = [hvd.allreduce_async(xs[ME] * (i + 1), op=hvd.Sum) for i in range(4)]
    handles.append(hvd.allgather_async(xs[ME][:3]))
    gathered = hvd.synchronize(handles[-1])
    results = [hvd.synchronize(h) for h in reversed(handles[:-1])][::-1]
    total = expected("sum", xs)
    assert all(same(r.numpy(), total * (i + 1)) for i, r in enumerate(results))
    assert torch.equal(gathered, torch.cat([x[:3] for x in xs]))
    assert hvd.poll(handles[0]) and hvd.synchronize(handles[0]) is results[0]  # a finished handle stays finished
    with pytest.raises(TypeError, match="handle must be what an hvd"):
        hvd.synchronize(17)
    with pytest.raises(TypeError, match="handle must be"):
        hvd.poll(None)


def test_bad_arguments_raise_before_any_message():
    x = torch.ones(3)
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor; got ndarray"):
        hvd.allreduce(np.ones(3))
    with pytest.raises(ValueError, match="op must be one of hvd.Average"):
        hvd.allreduce(x, op="sum")
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(x, op=hvd.Adasum)
    with pytest.raises(TypeError, match="bool tensor"):
        hvd.allreduce(torch.ones(2, dtype=torch.bool))
    with pytest.raises(TypeError, match="not defined for complex"):
        hvd.allreduce(torch.ones(2, dtype=torch.complex64), op=hvd.Max)
    with pytest.raises(TypeError, match="prescale_factor must be a number"):
        hvd.allreduce(x, prescale_factor="2")
    with pytest.raises(TypeError, match="name must be a string"):
        hvd.allreduce(x, name=3)
    with pytest.raises(TypeError, match="compression must be a Compressor"):
        hvd.allreduce(x, compression="fp16")
    with pytest.raises(ValueError, match=rf"root_rank must be a rank in 0..{P - 1}; got {P}"):
        hvd.broadcast(x, root_rank=P)
    with pytest.raises(ValueError, match="root_rank must be"):
        hvd.broadcast_parameters({"x": x}, root_rank=-1)
    with pytest.raises(ValueError, match="splits must hold integers"):  # Horovod's class for it
        hvd.alltoall(x, splits=torch.ones(P))
    with pytest.raises(TypeError, match="sparse tensor.*sparse_allreduce_async"):
        hvd.allreduce(torch.eye(2).to_sparse())
    with pytest.raises(ValueError, match="op must be hvd.Average or hvd.Sum for a sparse allreduce"):
        hvd.sparse_allreduce_async(torch.eye(2).to_sparse(), "s", hvd.Max)
    with pytest.raises(ValueError, match="reducescatter: tensor must have at least one dimension"):
        hvd.reducescatter(torch.tensor(1.0))
    with pytest.raises(ValueError, match="invalid params of type: Tensor"):
        hvd.broadcast_parameters(x, root_rank=0)
    with pytest.raises(TypeError, match=r"tensors must be a list of torch.Tensor"):
        hvd.grouped_allreduce(x)


def test_shape_errors_raise_on_every_rank():
    """What only the ranks together can see (allgather's and alltoall's shapes beyond
    dimension 0, a 0-d tensor on one rank) raises on every rank, as Horovod's
    negotiation does, with its exception class; what a rank can see alone raises there,
    before anything is queued (Horovod's ValueError)."""
    mismatch = (hvd.HorovodInternalError, RuntimeError, CollectiveMismatchError)
    with pytest.raises(mismatch, match=r"rank\(s\) 0 tried to allgather a rank-zero tensor"):
        hvd.allgather(torch.tensor(1.0) if ME == 0 else torch.ones(1))
    if P > 1:
        with pytest.raises(CollectiveMismatchError, match=rf"Mismatched allgather tensor shapes: rank\(s\) 0.* "
                                                          rf"dimension 1 equal to 3, but rank\(s\) {P - 1} sent a "
                                                          "tensor with dimension 1 equal to 4"):
            hvd.allgather(torch.ones(2, 4 if ME == P - 1 else 3))
        with pytest.raises(CollectiveMismatchError, match="Mismatched alltoall tensor shapes"):
            hvd.alltoall(torch.ones(P, 2 + (ME == 0)))
    with pytest.raises(ValueError, match="splits must have one entry per rank"):
        hvd.alltoall(torch.ones(P, 2), splits=[1] * (P + 1))
    with pytest.raises(ValueError, match="splits add up to"):
        hvd.alltoall(torch.ones(P, 2), splits=[2] * P)
    with pytest.raises(ValueError, match="must be a multiple of the number of ranks" if P > 1 else "0-d"):
        hvd.alltoall(torch.ones(P + 1, 2) if P > 1 else torch.tensor(1.0))
    assert torch.equal(hvd.allgather(torch.ones(1)), torch.ones(P))  # still usable


# -- Horovod's negotiation ----------------------------------------------------------------------
def _others(*ranks):
    """Every rank but ``ranks``, as the messages list them."""
    return ", ".join(str(r) for r in range(P) if r not in ranks)


def test_mismatched_calls_raise_on_every_rank_with_horovods_words():
    """What Horovod's coordinator refuses (its messages: "Mismatched data types: ...")
    raises on every rank, as HorovodInternalError (a RuntimeError), naming the ranks;
    no data moves and the ranks carry on. An async call raises at synchronize."""
    if P == 1:
        return  # one rank cannot disagree with itself
    last = P - 1
    odd = ME == last
    x = torch.ones(3)
    cases = [
        (lambda: hvd.allreduce(torch.ones(5 if odd else 4)),  # the last rank's shape alone differs
         rf"Mismatched allreduce tensor shapes: rank\(s\) {_others(last)} sent a tensor of shape \[4\], but "
         rf"rank\(s\) {last} sent a tensor of shape \[5\]\."),
        (lambda: hvd.allreduce(torch.ones(3, dtype=torch.int32 if odd else torch.float32)),
         rf"Mismatched data types: rank\(s\) {_others(last)} had type float32, but rank\(s\) {last} had type int32\."),
        (lambda: hvd.allreduce(torch.ones(6).reshape((3, 2) if odd else (2, 3))),  # the same elements
         r"Mismatched allreduce tensor shapes: .*\[2, 3\].*\[3, 2\]"),
        (lambda: hvd.allreduce(x, op=hvd.Max if odd else hvd.Sum), "Mismatched reduction operation"),
        (lambda: hvd.allreduce(x, prescale_factor=2.0 if odd else 1.0),
         r"Mismatched prescale and/or postscale factors: .*\(1, 1\).*\(2, 1\)"),
        (lambda: hvd.broadcast(x, root_rank=last if odd else 0),
         rf"Mismatched broadcast root ranks: rank\(s\) {_others(last)} specified root rank 0, but rank\(s\) {last} "
         rf"specified root rank {last}\."),
        (lambda: hvd.broadcast(torch.ones(2, 3 + odd), root_rank=0), "Mismatched broadcast tensor shapes"),
        (lambda: hvd.reducescatter(torch.ones(2 * P + odd)), "Mismatched reducescatter tensor shapes"),
        (lambda: hvd.allgather(x) if odd else hvd.allreduce(x),
         rf"Mismatched operations: rank\(s\) {_others(last)} did an allreduce, but rank\(s\) {last} did an allgather"),
        (lambda: hvd.allreduce(x, name="b" if odd else "a"), rf"Mismatched names: rank\(s\) {last} named this"),
        (lambda: hvd.synchronize(hvd.allreduce_async(torch.ones(5 if odd else 4))), "Mismatched allreduce tensor"),
        (lambda: hvd.broadcast_object(ME, root_rank=last if odd else 0), "Mismatched broadcast_object root ranks"),
    ]
    problems = []
    for i, (call, match) in enumerate(cases):
        try:
            call()
            problems.append(f"case {i}: nothing raised")
        except CollectiveMismatchError as exc:
            if not (isinstance(exc, hvd.HorovodInternalError) and isinstance(exc, RuntimeError)):
                problems.append(f"case {i}: {type(exc).__mro__} is not Horovod's class")
            if not re.search(match, str(exc)):
                problems.append(f"case {i}: {exc} does not match {match!r}")
        if not torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(P))):
            problems.append(f"case {i}: the next call went wrong")
    agree(WORLD, problems)


def test_a_name_in_flight_twice_is_an_error_and_calls_meet_across_a_barrier():
    """Horovod's test pattern: rank 0 queues a named call and passes a barrier before
    the others make theirs (a barrier does not start queued calls); a second call with
    the name still in flight raises ValueError; the named calls still meet."""
    x = torch.full((3,), float(ME + 1))
    handle = None
    problems = []
    for turn in (0, 1):
        if (ME == 0) == (turn == 0):
            handle = hvd.allreduce_async(x, name="twice", op=hvd.Sum)
            try:
                hvd.allreduce_async(x, name="twice")
                problems.append("a second call named 'twice' raised nothing")
            except ValueError as exc:
                if "already in flight" not in str(exc):
                    problems.append(str(exc))
        hvd.barrier()
    if not torch.equal(hvd.synchronize(handle), torch.full((3,), P * (P + 1) / 2)):
        problems.append(f"the calls paired wrongly: {hvd.synchronize(handle)}")
    hvd.synchronize(hvd.allreduce_async(x, name="twice"))  # finished: the name is free again
    agree(WORLD, problems)


def test_negotiation_can_be_turned_off(monkeypatch):
    """COLLECTIVES_HOROVOD_CHECK=0: no negotiation (calls are matched by order alone) and
    no join; the calls still give Horovod's results."""
    hvd.shutdown()
    monkeypatch.setenv("COLLECTIVES_HOROVOD_CHECK", "0")
    hvd.init()
    try:
        xs = everyones((4, 2), "float64")
        assert same(hvd.allreduce(xs[ME]).numpy(), expected("avg", xs))
        rows = hvd.allgather(torch.ones(ME + 1, 2))  # uneven: the sizes still travel
        assert rows.shape == (P * (P + 1) // 2, 2)
        with pytest.raises(ValueError, match="hvd.join needs negotiation"):
            hvd.join()
    finally:
        hvd.shutdown()
        monkeypatch.delenv("COLLECTIVES_HOROVOD_CHECK")
        hvd.init()


# -- process sets -------------------------------------------------------------------------------
def test_process_sets_run_every_call_on_their_ranks():
    """Every call with ``process_set=`` reduces, gathers, scatters over the set's ranks
    only: NumPy on the members' inputs is the reference. ``root_rank`` is a global rank."""
    evens, odds = list(range(0, P, 2)), list(range(1, P, 2))
    if P == 1:  # the even ranks are every rank: the global set, which exists
        with pytest.raises(ValueError, match="Attempted to add a duplicate process set"):
            hvd.add_process_set(evens)
        return
    even = hvd.add_process_set(evens)
    odd = hvd.add_process_set(hvd.ProcessSet(odds))
    mine, members = (even, evens) if ME % 2 == 0 else (odd, odds)
    other = odd if mine is even else even
    problems = []
    if not (mine.included() and mine.size() == len(members) and mine.rank() == members.index(ME)):
        problems.append(f"{mine}: included {mine.included()}, size {mine.size()}, rank {mine.rank()}")
    with pytest.raises(ValueError, match="Process is not part of provided process set"):
        other.rank()
    with pytest.raises(ValueError, match=f"rank {ME} is not part of"):
        hvd.allreduce(torch.ones(1), process_set=other)
    xs = everyones((len(members) * 2, 3), "int64")
    ours = [xs[r] for r in members]
    total = functools.reduce(np.add, [x.numpy() for x in ours])
    root = members[-1]
    results = {
        "allreduce Sum": (hvd.allreduce(xs[ME], op=hvd.Sum, process_set=mine), total),
        "allreduce Average": (hvd.allreduce(xs[ME], process_set=mine), np.trunc(total / len(members))),
        "grouped_allreduce": (hvd.grouped_allreduce([xs[ME]], op=hvd.Sum, process_set=mine)[0], total),
        "allgather": (hvd.allgather(xs[ME], process_set=mine), np.concatenate([x.numpy() for x in ours])),
        "broadcast": (hvd.broadcast(xs[ME], root_rank=root, process_set=mine), xs[root].numpy()),
        "alltoall": (hvd.alltoall(xs[ME], process_set=mine),
                     np.concatenate([x.numpy()[2 * members.index(ME):2 * members.index(ME) + 2] for x in ours])),
        "reducescatter": (hvd.reducescatter(xs[ME], op=hvd.Sum, process_set=mine),
                          total[2 * members.index(ME):2 * members.index(ME) + 2]),
    }
    for what, (got, want) in results.items():
        if not same(got.numpy(), want.astype(got.numpy().dtype)):
            problems.append(f"{what}: {got.numpy().ravel()[:6]} != {want.ravel()[:6]}")
    if hvd.broadcast_object({"from": ME}, root_rank=root, process_set=mine) != {"from": root}:
        problems.append("broadcast_object")
    if hvd.allgather_object(ME, process_set=mine) != members:
        problems.append("allgather_object")
    sparse = torch.sparse_coo_tensor([[ME % 3]], [float(ME + 1)], (3,), check_invariants=True)
    summed = hvd.sparse_allreduce_async(sparse, "s", hvd.Sum, process_set=mine)().to_dense()
    if not torch.equal(summed, sum(torch.sparse_coo_tensor([[r % 3]], [float(r + 1)], (3,), check_invariants=True)
                                   .to_dense() for r in members)):
        problems.append(f"sparse_allreduce_async: {summed}")
    hvd.barrier(process_set=mine)
    with pytest.raises(ValueError, match="Attempted to add a duplicate process set"):
        hvd.add_process_set(evens)
    assert hvd.remove_process_set(even) and not hvd.remove_process_set(even) and even.process_set_id is None
    assert hvd.remove_process_set(odd)
    assert not hvd.remove_process_set(hvd.global_process_set)
    with pytest.raises(ValueError, match="is not registered"):
        hvd.allreduce(torch.ones(1), process_set=mine)
    agree(WORLD, problems)


def test_init_registers_the_process_sets_it_is_given():
    hvd.shutdown()
    alone = hvd.ProcessSet([P - 1])  # the last rank by itself
    try:
        if P == 1:  # the last rank is every rank: the global set's ranks
            with pytest.raises(ValueError, match="duplicate process set"):
                hvd.init(process_sets=[alone])
        else:
            hvd.init(process_sets=[alone])
            assert alone.process_set_id == 1 and alone.size() == 1 and alone.included() == (ME == P - 1)
            if ME == P - 1:
                assert torch.equal(hvd.allreduce(torch.full((2,), 5.0), op=hvd.Sum, process_set=alone),
                                   torch.full((2,), 5.0))
            hvd.barrier()
    finally:
        hvd.shutdown()
        hvd.init()


def test_horovods_own_variables_get_a_one_line_warning_on_rank_0(monkeypatch):
    hvd.shutdown()
    try:
        monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")
        monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hvd.init()
        said = [str(w.message) for w in caught if "HOROVOD_" in str(w.message)]
        if ME == 0:
            assert len(said) == 1 and said[0].startswith("HOROVOD_CYCLE_TIME, HOROVOD_FUSION_THRESHOLD: "), said
            assert "\n" not in said[0]
        else:
            assert said == []
    finally:
        hvd.shutdown()
        monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD")
        monkeypatch.delenv("HOROVOD_CYCLE_TIME")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hvd.init()
        assert not [w for w in caught if "HOROVOD_" in str(w.message)]


def test_distributed_optimizer_on_a_process_set():
    """The set's ranks average their gradients over the set (single-process training on
    their shards together); the others step alone on their own shard."""
    evens = list(range(0, P, 2))
    even = hvd.add_process_set(evens) if P > 1 else hvd.global_process_set  # one rank: every rank, the global set
    model = _model(0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), process_set=even)
    x, y = _data(0)
    share = GLOBAL_BATCH // P
    mine = slice(ME * share, (ME + 1) * share)
    optimizer.zero_grad()
    _loss(model, x[mine], y[mine]).backward()
    optimizer.step()
    reference = _model(0)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    together = [r for r in evens] if ME in evens else [ME]
    rows = torch.cat([torch.arange(r * share, (r + 1) * share) for r in together])
    _loss(reference, x[rows], y[rows]).backward()
    plain.step()
    problems = [] if close(model, list(reference.parameters())) else ["differs from training on the set's shards"]
    optimizer.close()
    assert hvd.remove_process_set(even) == (P > 1)
    agree(WORLD, problems)


# -- join -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float64", "int32"])
def test_join_ranks_that_joined_contribute_zeros(dtype):
    """Horovod's join: while a rank has joined, the others' allreduces count it as zeros
    (an Average still divides by every rank), barriers include it, and allgather and
    broadcast raise on the others with Horovod's words; every rank gets the rank that
    joined last, not the first one."""
    problems = []
    xs = everyones((5,), dtype)
    for first in range(P):
        if ME == first:
            last = hvd.join()
        else:
            total = functools.reduce(np.add, [xs[r].numpy() for r in range(P) if r != first])
            want = (total / P).astype(dtype) if dtype == "float64" else np.trunc(total / P).astype(dtype)
            got = hvd.allreduce(xs[ME])
            if not same(got.numpy(), want):
                problems.append(f"first {first}: Average {got.numpy()} != {want}")
            got = hvd.synchronize(hvd.allreduce_async(xs[ME], op=hvd.Sum, name="with join"))
            if not same(got.numpy(), total):
                problems.append(f"first {first}: Sum {got.numpy()} != {total}")
            for call, words in ((lambda: hvd.allgather(xs[ME]), "Allgather is not supported with Join"),
                                (lambda: hvd.broadcast(xs[ME], root_rank=ME), "Broadcast is not supported with Join")):
                try:
                    call()
                    problems.append(f"first {first}: {words!r} not raised")
                except CollectiveMismatchError as exc:
                    if words not in str(exc):
                        problems.append(str(exc))
            hvd.barrier()
            last = hvd.join()
        lasts = hvd.allgather_object(last)
        if len(set(lasts)) != 1 or (P > 1 and last == first):
            problems.append(f"first {first}: join returned {lasts}")
    agree(WORLD, problems)


def test_join_with_uneven_data_and_the_distributed_optimizer():
    """Rank r has r % 3 + 1 batches: the ranks still stepping average their gradients
    with zeros from the ranks that joined (Horovod's semantics: divided by every rank);
    each rank ends with the parameters of that computation after its own steps."""
    steps = [r % 3 + 1 for r in range(P)]
    model = _model(0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2),
                                         named_parameters=model.named_parameters())
    for step in range(steps[ME]):
        optimizer.zero_grad()
        _loss(model, *_shard(*_data(step))).backward()
        optimizer.step()
    hvd.join()
    optimizer.close()
    reference = _model(0)
    plain = torch.optim.SGD(reference.parameters(), lr=0.2)
    share = GLOBAL_BATCH // P
    for step in range(steps[ME]):
        x, y = _data(step)
        plain.zero_grad()
        for r in range(P):
            if steps[r] > step:  # rank r still had data: its shard's mean loss, a P-th of the step
                (_loss(reference, x[r * share:(r + 1) * share], y[r * share:(r + 1) * share]) / P).backward()
        plain.step()
    agree(WORLD, [] if close(model, list(reference.parameters())) else ["differs from the zeros-for-joined step"])


# -- sparse -------------------------------------------------------------------------------------
def _sparse_of(rank, shape=(9, 2)):
    g = torch.Generator().manual_seed(rank)
    dense = torch.randint(-3, 4, shape, generator=g).double() * (torch.rand(shape[0], 1, generator=g) < 0.4)
    return dense.to_sparse(1)  # rows as entries (a hybrid tensor, like an embedding's gradient)


def test_sparse_allreduce_async_equals_the_dense_reduction():
    """Horovod's sparse allreduce (allgather of indices and values) gives the dense sum
    or mean, as a sparse tensor; its name is in flight until the handle is called."""
    dense = [_sparse_of(r).to_dense().numpy() for r in range(P)]
    total = functools.reduce(np.add, dense)
    problems = []
    for op, want in ((hvd.Sum, total), (hvd.Average, total / P)):
        handle = hvd.sparse_allreduce_async(_sparse_of(ME), name="grad", op=op)
        with pytest.raises(ValueError, match="already in flight"):
            hvd.sparse_allreduce_async(_sparse_of(ME), name="grad", op=op)
        got = handle()
        if not (got.is_sparse and np.allclose(got.to_dense().numpy(), want, rtol=1e-12, atol=0)):
            problems.append(f"{op}: {got.to_dense().numpy().ravel()[:6]} != {want.ravel()[:6]}")
    agree(WORLD, problems)


class _Embedded(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(3)
        self.embedding = torch.nn.Embedding(12, 4, sparse=sparse).double()
        self.head = torch.nn.Linear(4, 3).double()

    def forward(self, x):
        return self.head(self.embedding(x).mean(dim=1))


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_distributed_optimizer_with_sparse_gradients(sparse_as_dense):
    """nn.Embedding(sparse=True) under DistributedOptimizer trains as the same model with
    dense gradients does in one process on the global batch; the embedding's gradient
    stays sparse (sent as indices and values, or densified with sparse_as_dense)."""
    model = _Embedded(sparse=True)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.3),
                                         named_parameters=model.named_parameters(), sparse_as_dense=sparse_as_dense)
    reference = _Embedded(sparse=False)
    plain = torch.optim.SGD(reference.parameters(), lr=0.3)
    problems = []
    for step in range(3):
        g = torch.Generator().manual_seed(50 + step)
        x, y = torch.randint(0, 12, (GLOBAL_BATCH, 3), generator=g), torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)
        plain.zero_grad()
        _loss(reference, x, y).backward()
        plain.step()
        optimizer.zero_grad()
        _loss(model, *_shard(x, y)).backward()
        optimizer.step()
        if not model.embedding.weight.grad.is_sparse:
            problems.append(f"step {step}: the embedding's gradient is no longer sparse")
        if not close(model, list(reference.parameters())):
            problems.append(f"step {step}: differs from dense single-process training")
    optimizer.close()
    agree(WORLD, problems)


# -- Horovod's optimizer details -----------------------------------------------------------------
def test_broadcast_optimizer_state_takes_horovods_zero_gradient_step():
    """A fresh optimizer first takes one step on zero gradients (its own, not averaged),
    which creates its state: Adam's step count is 1 on every rank and the moments
    zero; a frozen parameter gets no gradient; the parameters do not move."""
    model = _model(ME)
    model[0].bias.requires_grad_(False)
    before = [p.detach().clone() for p in model.parameters()]
    for wrap in (False, True):
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        if wrap:
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        state = optimizer.state_dict()["state"]
        trainable = [i for i, p in enumerate(model.parameters()) if p.requires_grad]
        assert sorted(state) == trainable
        assert all(float(state[i]["step"]) == 1 and not state[i]["exp_avg"].any() for i in trainable)
        assert model[0].bias.grad is None
        assert all(not p.grad.any() for p in model.parameters() if p.requires_grad)
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        if wrap:
            optimizer.close()


def test_step_after_synchronize_warns_as_horovod_does():
    model = _model(0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    for skip in (False, True):
        optimizer.zero_grad()
        _loss(model, *_shard(*_data(0))).backward()
        optimizer.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with optimizer.skip_synchronize() if skip else contextlib.nullcontext():
                optimizer.step()
        texts = [str(w.message) for w in caught]
        warned = any("optimizer.step() called without optimizer.skip_synchronize()" in t for t in texts)
        assert warned != skip, texts
    _loss(model, *_shard(*_data(1))).backward()
    with pytest.raises(AssertionError, match="zero_grad\\(\\) was called after loss.backward\\(\\) but before"):
        optimizer.zero_grad()
    optimizer.step()
    optimizer.close()


@pytest.mark.serial
def test_compression_classes():
    x = torch.arange(4, dtype=torch.float64) / 3
    compressed, ctx = hvd.Compression.fp16.compress(x)
    assert compressed.dtype == torch.float16 and ctx == torch.float64
    back = hvd.Compression.fp16.decompress(compressed, ctx)
    assert back.dtype == torch.float64 and torch.allclose(back, x, rtol=1e-3)
    ints = torch.arange(3)
    assert hvd.Compression.fp16.compress(ints)[0] is ints and hvd.Compression.fp16.decompress(ints, ints.dtype) is ints
    assert hvd.Compression.none.compress(x) == (x, None) and hvd.Compression.none.decompress(x, None) is x
    assert issubclass(hvd.Compression.fp16, hvd.Compressor)


@pytest.mark.serial
def test_what_is_not_implemented_says_so():
    for call in (lambda: hvd.SyncBatchNorm(4), lambda: hvd.start_timeline("t.json"), lambda: hvd.stop_timeline(),
                 lambda: hvd.elastic, lambda: hvd.init(comm=[0]),
                 lambda: hvd.add_process_set(hvd.ProcessSet(MPI.COMM_SELF)),
                 lambda: hvd.init(process_sets=[hvd.ProcessSet(MPI.COMM_SELF)])):
        with pytest.raises(NotImplementedError, match="not implemented by collectives.horovod"):
            call()
    assert not hasattr(hvd, "elastic")


@pytest.mark.serial
def test_importing_collectives_does_not_import_torch():
    code = "import sys, collectives, collectives.horovod; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_uninitialized_calls_say_so_and_init_again():
    hvd.shutdown()
    try:
        assert not hvd.is_initialized()
        for call in (hvd.size, hvd.rank, hvd.local_rank, hvd.cross_size, lambda: hvd.allreduce(torch.ones(1))):
            with pytest.raises(ValueError, match=r"Horovod has not been initialized; use hvd.init\(\)"):
                call()
    finally:
        hvd.init()
    assert hvd.size() == P


# -- training ----------------------------------------------------------------------------------
def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def _data(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)


def _shard(x, y):
    share = GLOBAL_BATCH // P
    return x[ME * share:(ME + 1) * share], y[ME * share:(ME + 1) * share]


def _loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize("compression, rtol", [("none", 1e-9), ("fp16", 1e-3)])
def test_distributed_optimizer_sum_accumulation_and_skip_synchronize(compression, rtol):
    """op=Sum takes the step of the summed gradients (the serial step with lr x P), with
    fp16 compression too (the sum undivided); backward_passes_per_step=2 over two halves
    of the shard, then synchronize(), a clip of the reduced gradients and step() inside
    skip_synchronize() equal the same done serially."""
    serial = _model(0)
    plain = torch.optim.SGD(serial.parameters(), lr=0.1 * P)
    model = _model(ME)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), op=hvd.Sum,
                                         backward_passes_per_step=2, compression=getattr(hvd.Compression, compression))
    assert optimizer.backward_passes_per_step == 2
    problems = []
    for step in range(2):
        x, y = _data(step)
        plain.zero_grad()
        _loss(serial, x, y).backward()
        torch.nn.utils.clip_grad_value_(serial.parameters(), 0.02 / P)  # the summed gradient is P x the mean's
        plain.step()
        optimizer.zero_grad()
        xs, ys = _shard(x, y)
        half = len(xs) // 2
        for part in (slice(0, half), slice(half, None)):
            (_loss(model, xs[part], ys[part]) / 2).backward()
        optimizer.synchronize()
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.02)
        with optimizer.skip_synchronize():
            optimizer.step()
        if not close(model, list(serial.parameters()), rtol=rtol):
            problems.append(f"step {step}: differs from single-process training beyond rtol {rtol}")
        if not identical_everywhere(p.detach().numpy() for p in model.parameters()):
            problems.append(f"step {step}: parameters differ between ranks")
    optimizer.set_backward_passes_per_step(1)
    assert optimizer.backward_passes_per_step == 1
    optimizer.close()
    agree(WORLD, problems)


def test_a_parameter_unused_on_some_ranks_is_reduced_as_zeros():
    """Horovod's semantics: a gradient backward did not produce on a rank counts as zeros,
    so ranks whose forward passes differ still take one step together."""
    model = _model(0)
    extra = torch.nn.Linear(6, 1).double()
    params = list(model.named_parameters()) + [("extra." + n, p) for n, p in extra.named_parameters()]
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1), named_parameters=params)
    x, y = _shard(*_data(0))
    loss = _loss(model, x, y) + (extra(x).sum() if ME == 0 else 0)
    optimizer.zero_grad()
    loss.backward()
    optimizer.synchronize()
    reference = torch.nn.Linear(6, 1).double()  # rank 0's gradient of the extra layer, computed here
    reference.load_state_dict(extra.state_dict())
    x0 = _data(0)[0][:GLOBAL_BATCH // P]
    grads = torch.autograd.grad(reference(x0).sum(), list(reference.parameters()))
    assert all(torch.allclose(p.grad, g / P, rtol=1e-12) for p, g in zip(extra.parameters(), grads))
    with optimizer.skip_synchronize():
        optimizer.step()
    optimizer.close()
    assert identical_everywhere(p.detach().numpy() for _, p in params)


def test_broadcast_optimizer_state_from_the_last_rank():
    root = P - 1

    def build(seed):
        model = _model(seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.001 * (seed + 1))
        if seed == root:
            _loss(model, *_data(1)).backward()
            optimizer.step()  # only the root has state
        return model, optimizer

    model, optimizer = build(ME)
    want_model, want_optimizer = build(root)
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    hvd.broadcast_optimizer_state(optimizer, root_rank=root)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), want_model.state_dict().values()))
    got, want = optimizer.state_dict(), want_optimizer.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert all(torch.equal(got["state"][i][k], v) for i, s in want["state"].items() for k, v in s.items())


def test_distributed_optimizer_misuse():
    model = _model(0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)

    class Custom(hvd.Compressor):
        pass

    with pytest.raises(ValueError, match="compression must be hvd.Compression.none or hvd.Compression.fp16"):
        hvd.DistributedOptimizer(sgd, compression=Custom)
    with pytest.raises(ValueError, match="op must be hvd.Average or hvd.Sum"):
        hvd.DistributedOptimizer(sgd, op=hvd.Min)
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.DistributedOptimizer(sgd, op=hvd.Adasum)
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported with op != Average"):
        hvd.DistributedOptimizer(sgd, op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="named_parameters should be a sequence of tuples"):
        hvd.DistributedOptimizer(sgd, named_parameters=list(model.parameters()))
    with pytest.raises(ValueError, match="backward_passes_per_step must be a positive integer"):
        hvd.DistributedOptimizer(sgd, backward_passes_per_step=0)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        hvd.DistributedOptimizer(object())
    with pytest.raises(TypeError, match="process_set must be an hvd.ProcessSet"):
        hvd.DistributedOptimizer(sgd, process_set=object())
    with pytest.raises(ValueError, match="names in named_parameters must be unique. Found duplicates: 0.bias"):
        hvd.DistributedOptimizer(sgd, named_parameters=list(model.named_parameters())[:2] * 2)
    with pytest.raises(ValueError, match="named_parameters was specified, but 2 model parameter"):
        hvd.DistributedOptimizer(sgd, named_parameters=list(model.named_parameters())[:2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        optimizer = hvd.DistributedOptimizer(sgd, num_groups=2, gradient_predivide_factor=2.0)  # names made up
    with pytest.raises(ValueError, match="backward_passes_per_step must be > 0"):
        optimizer.set_backward_passes_per_step(0)
    optimizer.close()


# -- the Horovod training script ------------------------------------------------------------------
EPOCHS, SAMPLES, LR, MOMENTUM, SEED = 2, 2 * GLOBAL_BATCH, 0.2, 0.5, 7


def _single_process():
    """Plain PyTorch on the global batch of GLOBAL_BATCH samples with learning rate LR: the
    batches the ranks' DistributedSamplers make together, in one process."""
    torch.manual_seed(SEED)  # the script's model on rank 0
    model = train_horovod.Net().double()
    dataset, _ = train_horovod.synthetic_datasets(SAMPLES, 840, SEED)
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=1, rank=0, seed=SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for epoch in range(1, EPOCHS + 1):
        sampler.set_epoch(epoch)
        for x, y in torch.utils.data.DataLoader(dataset, batch_size=GLOBAL_BATCH, sampler=sampler):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("compression, passes, rtol", [("none", 1, 1e-9), ("fp16", 1, 1e-3), ("none", 2, 1e-9)])
def test_horovod_training_script_equals_single_process(compression, passes, rtol):
    """examples/train_horovod.py, a Horovod script with only its import changed, run at this
    world size (each rank GLOBAL_BATCH / P samples a step, the learning rate LR / P scaled
    by hvd.size() as Horovod scripts do) ends with the parameters of single-process
    training on the global batch, on every rank."""
    argv = ["--batch-size", str(GLOBAL_BATCH // P // passes), "--batches-per-allreduce", str(passes),
            "--lr", repr(LR / P), "--momentum", str(MOMENTUM), "--epochs", str(EPOCHS), "--samples", str(SAMPLES),
            "--test-samples", "840", "--seed", str(SEED), "--no-cuda", "--log-interval", "1000"]
    if compression == "fp16":
        argv.append("--fp16-allreduce")
    model = train_horovod.train(train_horovod.parse_args(argv))
    want = _single_process()
    problems = []
    if not close(model, want, rtol=rtol):
        worst = max(float(((p.detach() - q).abs() / q.abs().clamp_min(rtol)).max()) for p, q in
                    zip(model.parameters(), want))
        problems.append(f"differs from single-process training beyond rtol {rtol} (worst relative {worst:.2e})")
    if compression == "fp16" and close(model, want, rtol=1e-12):
        problems.append("fp16 compression left no trace: were the gradients sent as float16?")
    if not identical_everywhere(p.detach().numpy() for p in model.parameters()):
        problems.append("parameters differ between ranks")
    agree(WORLD, problems)
