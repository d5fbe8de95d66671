"""The torch.distributed backend "collectives" (collectives.torch_backend), serially and
under mpiexec; skipped when torch is not installed.

The reference for every call is gloo in the same job: a gloo group over the same ranks
(``new_group(backend="gloo")``) runs the same torch.distributed program on the same
integer-valued inputs, and the results must be identical. Where gloo refuses (a
non-contiguous tensor) the reference is NumPy. Training with DDP and FSDP must equal
single-process training on the global batch (tests/harness/torch_reference.py), within the
tolerances of the adapter's tests.
"""

import datetime
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import collectives.torch  # noqa: E402,F401  (registers the backend)
from collectives import torch_backend  # noqa: E402

from conftest import agree, rank_input, reference, shard  # noqa: E402
from torch_reference import STEPS, batch, close, loss_fn, make_model, single_process  # noqa: E402

torch.set_num_threads(1)  # up to 8 ranks share 2 cores
# torch 2.13 renames all_gather_into_tensor and reduce_scatter_tensor (to *_single) with a
# FutureWarning; programs still call them by the old names, and so do these tests.
pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated. Please use:FutureWarning")
TIMEOUT_S = 60  # init_process_group's timeout, which becomes the library's: a hang fails in a minute
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "prod": dist.ReduceOp.PRODUCT,
       "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "band": dist.ReduceOp.BAND,
       "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]


@pytest.fixture(scope="module")
def gloo():
    """The default group on "collectives" (the world), and a gloo group over the same ranks."""
    if dist.is_initialized():  # an earlier test's default group (the benchmark's gloo world), done with
        dist.destroy_process_group()
    dist.init_process_group("collectives", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


def rank_tensor(rank, count, dtype, op="sum"):
    """``conftest.rank_input`` as a tensor of ``dtype`` (exact under ``op`` at any world size)."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.from_numpy(rank_input(rank, count, "float32", op)).to(dtype)
    return torch.from_numpy(rank_input(rank, count, str(dtype).split(".")[-1], op)).clone()


def both(call, gloo):
    """``call(group)`` under gloo and under collectives (the default group): the two results."""
    return call(gloo), call(None)


def assert_same(want, got):
    """Identical tensors (or lists of them): same dtype, shape and bits."""
    if isinstance(want, (list, tuple)):
        assert len(want) == len(got)
        for w, g in zip(want, got):
            assert_same(w, g)
        return
    assert want.dtype == got.dtype and want.shape == got.shape, (want, got)
    assert torch.equal(want, got), f"gloo gave {want}, collectives gave {got}"


def ops_for(dtype):
    if dtype.is_floating_point:
        return ["sum", "avg", "prod", "max", "min"]
    return ["sum", "prod", "max", "min", "band", "bor", "bxor"]


# -- every call against gloo -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_reduce_every_op(gloo, dtype):
    rank = dist.get_rank()
    for op in ops_for(dtype):
        def call(group, op=op):
            x = rank_tensor(rank, 37, dtype, op)
            dist.all_reduce(x, op=OPS[op], group=group)
            return x
        assert_same(*both(call, gloo))


def test_all_reduce_of_bool_complex_0d_and_empty_tensors(gloo):
    rank = dist.get_rank()
    cases = [(lambda: torch.from_numpy(rank_input(rank, 12, "int8") > 0), op) for op in ("sum", "max", "min", "prod")]
    cases += [(lambda: rank_tensor(rank, 5, torch.complex64), "sum"),
              (lambda: torch.tensor(float(rank + 1)), "sum"),  # 0-d
              (lambda: torch.ones(0, 3), "max")]  # empty
    for make, op in cases:
        def call(group, make=make, op=op):
            x = make()
            dist.all_reduce(x, op=OPS[op], group=group)
            return x
        assert_same(*both(call, gloo))


def test_all_reduce_of_a_non_contiguous_tensor_against_numpy(gloo):
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.from_numpy(rank_input(rank, 60, "float64")).reshape(6, 10).t()  # gloo refuses this
    assert not x.is_contiguous()
    dist.all_reduce(x)
    want = reference("sum", [rank_input(r, 60, "float64").reshape(6, 10).T for r in range(size)])
    np.testing.assert_array_equal(x.numpy(), want)


def test_broadcast_from_every_root(gloo):
    rank = dist.get_rank()
    for root in range(dist.get_world_size()):
        def call(group, root=root):
            x = rank_tensor(rank, 19, torch.float32)
            dist.broadcast(x, src=root, group=group)
            return x
        assert_same(*both(call, gloo))


def test_all_gather_and_all_gather_into_tensor(gloo):
    rank, size = dist.get_rank(), dist.get_world_size()

    def listed(group):
        out = [torch.empty(3, 5, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(out, rank_tensor(rank, 15, torch.int64).reshape(3, 5), group=group)
        return out

    def into_tensor(group):
        out = torch.empty(size * 7, dtype=torch.float64)
        dist.all_gather_into_tensor(out, rank_tensor(rank, 7, torch.float64), group=group)
        return out

    assert_same(*both(listed, gloo))
    assert_same(*both(into_tensor, gloo))


@pytest.mark.parametrize("op", ["sum", "max", "prod"])
def test_reduce_scatter_and_reduce_scatter_tensor(gloo, op):
    rank, size = dist.get_rank(), dist.get_world_size()

    def listed(group):
        out = torch.empty(6, dtype=torch.float32)
        inputs = list(rank_tensor(rank, 6 * size, torch.float32, op).chunk(size))
        dist.reduce_scatter(out, inputs, op=OPS[op], group=group)
        return out

    def single(group):
        out = torch.empty(2, 3, dtype=torch.int32)
        x = rank_tensor(rank, 6 * size, torch.int32, op).reshape(2 * size, 3)
        dist.reduce_scatter_tensor(out, x, op=OPS[op], group=group)
        return out

    assert_same(*both(listed, gloo))
    assert_same(*both(single, gloo))


def test_reduce_gather_and_scatter_at_every_root(gloo):
    rank, size = dist.get_rank(), dist.get_world_size()
    for root in range(size):
        def reduce(group, root=root):
            x = rank_tensor(rank, 11, torch.int64)
            dist.reduce(x, dst=root, group=group)
            return x if rank == root else torch.zeros(0)  # what non-roots hold after reduce is unspecified

        def gather(group, root=root):
            out = [torch.empty(4, dtype=torch.float32) for _ in range(size)] if rank == root else None
            dist.gather(rank_tensor(rank, 4, torch.float32), out, dst=root, group=group)
            return out or []

        def scatter(group, root=root):
            out = torch.empty(2, 3, dtype=torch.float64)
            blocks = list(rank_tensor(rank, 6 * size, torch.float64).reshape(size, 2, 3)) if rank == root else None
            dist.scatter(out, blocks, src=root, group=group)
            return out

        for call in (reduce, gather, scatter):
            assert_same(*both(call, gloo))


def test_all_to_all_equal_blocks_and_uneven_ones(gloo):
    rank, size = dist.get_rank(), dist.get_world_size()

    def equal(group):
        outputs = [torch.empty(3, dtype=torch.int64) for _ in range(size)]
        dist.all_to_all(outputs, list(rank_tensor(rank, 3 * size, torch.int64).chunk(size)), group=group)
        return outputs

    assert_same(*both(equal, gloo))
    # Uneven blocks (NCCL allows them, gloo does not): rank r sends (r + j) % 3 + 1
    # elements to rank j; block i received must be what rank i made for this rank.
    inputs = [rank_tensor(rank * size + j, (rank + j) % 3 + 1, torch.float32) for j in range(size)]
    outputs = [torch.empty((i + rank) % 3 + 1) for i in range(size)]
    dist.all_to_all(outputs, inputs)
    assert_same([rank_tensor(i * size + rank, (i + rank) % 3 + 1, torch.float32) for i in range(size)], outputs)


def test_all_to_all_single_equal_and_with_split_sizes(gloo):
    rank, size = dist.get_rank(), dist.get_world_size()

    def equal(group):
        out = torch.empty(size * 2, 3, dtype=torch.int64)
        dist.all_to_all_single(out, rank_tensor(rank, size * 6, torch.int64).reshape(size * 2, 3), group=group)
        return out

    def split(group):
        send = [(rank + j) % 3 for j in range(size)]  # zero rows included
        recv = [(i + rank) % 3 for i in range(size)]
        x = rank_tensor(rank, sum(send) * 4, torch.float64).reshape(sum(send), 4)
        out = torch.empty(sum(recv), 4, dtype=torch.float64)
        dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    assert_same(*both(equal, gloo))
    assert_same(*both(split, gloo))


def test_point_to_point_in_a_ring(gloo):
    rank, size = dist.get_rank(), dist.get_world_size()
    if size == 1:
        pytest.skip("point-to-point needs a peer")
    right, left = (rank + 1) % size, (rank - 1) % size

    def blocking(group):  # even ranks send first, odd ranks receive first
        x, got = rank_tensor(rank, 8, torch.float32), torch.empty(8)
        if rank % 2 == 0:
            dist.send(x, right, group=group)
            dist.recv(got, left, group=group)
        else:
            dist.recv(got, left, group=group)
            dist.send(x, right, group=group)
        return got

    def nonblocking(group):
        got = torch.empty(5, dtype=torch.int64)
        works = [dist.isend(rank_tensor(rank, 5, torch.int64), right, group=group, tag=3),
                 dist.irecv(got, left, group=group, tag=3)]
        for work in works:
            work.wait()
        return got

    def batched(group):
        got = [torch.empty(4), torch.empty(2)]
        ops = [dist.P2POp(dist.isend, rank_tensor(rank, 4, torch.float32), right, group),
               dist.P2POp(dist.irecv, got[0], left, group),
               dist.P2POp(dist.isend, rank_tensor(rank + 9, 2, torch.float32), left, group),
               dist.P2POp(dist.irecv, got[1], right, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return got

    for call in (blocking, nonblocking, batched):
        assert_same(*both(call, gloo))


def test_recv_from_any_source_reports_the_sender(gloo):
    rank, size = dist.get_rank(), dist.get_world_size()
    if size == 1:
        pytest.skip("point-to-point needs a peer")
    if rank == 0:
        got, senders = torch.empty(1), []
        for _ in range(size - 1):
            sender = dist.recv(got)  # src=None: any source; torch returns the sender
            assert got.item() == 10.0 * sender
            senders.append(sender)
        assert sorted(senders) == list(range(1, size))
    else:
        dist.send(torch.tensor([10.0 * rank]), 0)


def test_objects_and_barrier(gloo):
    rank, size = dist.get_rank(), dist.get_world_size()

    def objects(group):
        listed = [{"rank": rank, "word": "x" * rank}, rank * 1.5] if rank == 0 else [None, None]
        dist.broadcast_object_list(listed, src=0, group=group)
        gathered = [None] * size
        dist.all_gather_object(gathered, ("from", rank, list(range(rank))), group=group)
        return listed, gathered

    want, got = both(objects, gloo)
    assert got == want
    dist.barrier()


# -- Work, groups, timeout, what has no mapping --------------------------------------------------
def test_async_work_wait_is_completed_and_future(gloo):
    rank, size = dist.get_rank(), dist.get_world_size()
    x = rank_tensor(rank, 1000, torch.float64)
    work = dist.all_reduce(x, async_op=True)
    assert work.wait() is True
    assert work.is_completed() and work.is_success()
    want = reference("sum", [rank_input(r, 1000, "float64") for r in range(size)])
    np.testing.assert_array_equal(x.numpy(), want)
    y = rank_tensor(rank, 10, torch.float32)
    future = dist.all_reduce(y, async_op=True).get_future()
    (result,) = future.wait()
    assert result is y and torch.equal(y, torch.from_numpy(reference("sum", [rank_input(r, 10, "float32")
                                                                             for r in range(size)])))
    out = torch.empty(size * 3)
    work = dist.all_gather_into_tensor(out, rank_tensor(rank, 3, torch.float32), async_op=True)
    while not work.is_completed():  # polling drives it to the end
        pass
    assert torch.equal(out, torch.cat([rank_tensor(r, 3, torch.float32) for r in range(size)]))


def test_futures_complete_by_themselves_while_the_program_computes(gloo):
    """The progress thread completes a future nobody waits on (DDP's overlap): after the
    call starts, the program only sleeps, yet the future is done and holds the result;
    then-callbacks run with it, and a Work finished by wait() completes its future too."""
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(size)))
    group.progress_thread = True
    x = rank_tensor(rank, 100_000, torch.float64)
    future = dist.all_reduce(x, group=group, async_op=True).get_future()
    doubled = future.then(lambda f: f.value()[0] * 2)
    deadline = time.monotonic() + 30
    while not future.done() and time.monotonic() < deadline:
        time.sleep(0.01)  # no call into torch.distributed or the library
    assert future.done(), "nothing completed the future within 30 s"
    want = torch.from_numpy(reference("sum", [rank_input(r, 100_000, "float64") for r in range(size)]))
    assert torch.equal(future.value()[0], want) and torch.equal(doubled.wait(), want * 2)
    work = dist.all_reduce(rank_tensor(rank, 5, torch.float32), group=group, async_op=True)
    work.wait()
    assert work.get_future().done() and group._progress is not None
    dist.destroy_process_group(group)


def test_by_default_futures_come_completed_and_the_variable_turns_the_thread_on(gloo, monkeypatch):
    x = torch.ones(10)
    future = dist.all_reduce(x, async_op=True).get_future()
    assert future.done() and torch.equal(future.value()[0], torch.full((10,), float(dist.get_world_size())))
    assert dist.group.WORLD._progress is None
    monkeypatch.setenv("COLLECTIVES_TORCH_PROGRESS_THREAD", "1")
    group = dist.new_group(list(range(dist.get_world_size())))
    assert group.progress_thread
    dist.destroy_process_group(group)


def test_a_failed_call_fails_its_future(gloo):
    """A receive nobody sends to times out: the future raises the library's timeout
    error, set by the progress thread, within the group's timeout and a few seconds."""
    if dist.get_world_size() < 2:
        return
    group = dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=1))
    group.progress_thread = True
    if dist.get_rank() == 0:
        future = group.recv([torch.empty(4)], 1, 99).get_future()  # rank 1 never sends tag 99
        start = time.monotonic()
        with pytest.raises(Exception, match=" Timed out "):
            future.wait()
        assert time.monotonic() - start < 10
    MPI.COMM_WORLD.Barrier()  # the group is broken by the timeout: not reused, only dropped


def test_subgroups_are_sub_communicators(gloo):
    rank, size = dist.get_rank(), dist.get_world_size()
    members = list(range(0, size, 2))  # new_group is collective over the world: every rank calls it
    ours, theirs = dist.new_group(members), dist.new_group(members, backend="gloo")
    if rank not in members:
        return
    assert isinstance(ours, torch_backend.ProcessGroup) and ours.comm.size == len(members)
    for op in ("sum", "max"):
        results = []
        for group in (theirs, ours):
            x = rank_tensor(rank, 9, torch.int32, op)
            dist.all_reduce(x, op=OPS[op], group=group)
            results.append(x)
        assert_same(*results)
    out = [torch.empty(2) for _ in members]
    dist.all_gather(out, torch.full((2,), float(rank)), group=ours)
    assert [int(o[0]) for o in out] == members


def test_the_init_timeout_becomes_the_library_timeout(gloo):
    group = dist.group.WORLD
    assert isinstance(group, torch_backend.ProcessGroup) and group.getBackendName() == "collectives"
    assert group.comm.timeout == TIMEOUT_S


def test_what_has_no_mapping_says_so(gloo):
    with pytest.raises(NotImplementedError, match="PREMUL_SUM"):
        dist.all_reduce(torch.ones(3), op=dist._make_nccl_premul_sum(2.0))
    # torch itself allows monitored_barrier on gloo only; comm.barrier(timeout=...) is ours.
    with pytest.raises(ValueError, match="only implemented for GLOO"):
        dist.monitored_barrier()
    with pytest.raises(ValueError, match="split sizes must have one entry per rank"):
        dist.all_to_all_single(torch.empty(1), torch.ones(1), [1] * (dist.get_world_size() + 1),
                               [1] * (dist.get_world_size() + 1))


def sparse_rank_tensor(rank, dtype, dense=(), size=7):
    """A sparse COO tensor of rank ``rank``, not coalesced: repeated indices (rank 1's
    twice), some shared with other ranks, none at all on rank 2; ``dense``: the shape
    of each entry (a hybrid tensor)."""
    rows = [] if rank == 2 else [rank % size, (rank * 3 + 1) % size, 0, rank % size]
    values = torch.from_numpy(rank_input(rank, len(rows) * int(np.prod(dense, dtype=np.int64)), "float32"))
    values = values.reshape(len(rows), *dense).to(dtype)
    return torch.sparse_coo_tensor(torch.tensor([rows], dtype=torch.int64).reshape(1, len(rows)), values,
                                   (size, *dense), check_invariants=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dense", [(), (3,)], ids=["1-d", "hybrid"])
def test_sparse_all_reduce_against_gloo(gloo, dtype, dense):
    """gloo's semantics: the sum, coalesced, written into the tensor itself."""
    rank = dist.get_rank()
    results, problems = [], []
    for group in (gloo, None):
        x = sparse_rank_tensor(rank, dtype, dense)
        handle = id(x)
        dist.all_reduce(x, group=group, async_op=True).wait()
        if not (id(x) == handle and x.is_sparse and x.is_coalesced()):
            problems.append(f"{'gloo' if group else 'collectives'}: not a coalesced sparse tensor in place: {x}")
        results.append(x)
    want, got = results
    for part in ("_indices", "_values", "to_dense"):
        w, g = getattr(want, part)(), getattr(got, part)()
        if not (w.dtype == g.dtype and w.shape == g.shape and torch.equal(w, g)):
            problems.append(f"{part}: gloo gave {w}, collectives gave {g}")
    agree(MPI.COMM_WORLD, problems)


def test_sparse_all_reduce_refusals_raise_before_data_moves(gloo):
    rank, size = dist.get_rank(), dist.get_world_size()
    with pytest.raises(ValueError, match="op must be SUM \\(as with gloo\\); got AVG"):
        dist.all_reduce(sparse_rank_tensor(rank, torch.float32), op=dist.ReduceOp.AVG)
    with pytest.raises(ValueError, match="one sparse COO tensor per call"):
        dist.distributed_c10d._get_default_group().allreduce([sparse_rank_tensor(rank, torch.float32),
                                                              torch.ones(3)])
    if size > 1:  # the last rank's tensor is longer: every rank hears of it
        x = sparse_rank_tensor(rank, torch.float32, size=7 + (rank == size - 1))
        with pytest.raises(ValueError, match=f"same size, dtype and sparse dimensions; rank\\(s\\) {size - 1} differ"):
            dist.all_reduce(x)
    x = sparse_rank_tensor(rank, torch.float32)  # the group is fine after
    dist.all_reduce(x)
    assert torch.equal(x.to_dense(), sum(sparse_rank_tensor(r, torch.float32).to_dense() for r in range(size)))


class SparseEmbeddingModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.embedding = torch.nn.Embedding(10, 4, sparse=True).double()
        self.head = torch.nn.Linear(4, 3).double()

    def forward(self, x):
        return self.head(self.embedding(x).sum(dim=1))


def test_ddp_with_sparse_gradients_equals_gloo(gloo):
    """DDP with ``nn.Embedding(sparse=True)``: its gradient is a sparse tensor, all_reduced
    as one; the parameters after each step equal DDP's on gloo (same inputs, same
    initial weights), and so does every sparse gradient (bit for bit at the first step,
    where the weights are the same)."""
    rank = dist.get_rank()
    histories, sparse_grads = [], []
    for group in (gloo, None):
        model = DDP(SparseEmbeddingModel(), process_group=group)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        history = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randint(0, 10, (4, 3), generator=g), torch.randint(0, 3, (4,), generator=g)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            grad = model.module.embedding.weight.grad
            assert grad.is_sparse and grad.is_coalesced()
            sparse_grads.append(grad.clone())
            optimizer.step()
            history.append([p.detach().clone() for p in model.parameters()])
        histories.append(history)
    for step, (want, got) in enumerate(zip(*histories)):  # the dense layer's sums may round in another order
        assert close(got, want, rtol=1e-12), f"step {step}: DDP on collectives differs from gloo beyond rtol 1e-12"
    for step, (want, got) in enumerate(zip(sparse_grads[:STEPS], sparse_grads[STEPS:])):
        assert torch.equal(want._indices(), got._indices())
        if step == 0:  # the same weights everywhere: the same sums, bit for bit
            assert torch.equal(want._values(), got._values())
        assert torch.allclose(want._values(), got._values(), rtol=1e-12, atol=1e-12)


def test_monitored_barrier_on_the_group_says_what_to_use(gloo):
    with pytest.raises(NotImplementedError, match="monitored_barrier is gloo's.*use barrier\\(\\)"):
        dist.group.WORLD.monitored_barrier(datetime.timedelta(seconds=1))


def test_a_timed_out_barrier_says_timed_out_as_gloo_does(gloo):
    """torch's own tests (and users) match " (Timed out|closed|timeout) " in a timeout
    error: the library's CollectiveTimeoutError says "Timed out", as gloo's errors do."""
    if dist.get_world_size() < 2:
        return
    group = dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=1))
    if dist.get_rank() == 0:  # the others never come
        start = time.monotonic()
        with pytest.raises(collectives.CollectiveTimeoutError, match=" (Timed out|closed|timeout) ") as caught:
            dist.barrier(group=group)
        assert time.monotonic() - start >= 1.0
        assert "Timed out after 1.0 s" in str(caught.value)
    MPI.COMM_WORLD.Barrier()  # the group is broken by the timeout: not reused, only dropped


def test_all_gather_coalesced_is_rank_major(gloo):
    rank, size = dist.get_rank(), dist.get_world_size()

    def call(group):
        inputs = [rank_tensor(rank, 3, torch.float32), rank_tensor(rank + 5, 2, torch.float32)]
        outputs = [[torch.empty(3), torch.empty(2)] for _ in range(size)]
        dist.all_gather_coalesced(outputs, inputs, group=group)
        return [t for per_rank in outputs for t in per_rank]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates all_gather_coalesced
        assert_same(*both(call, gloo))


def test_non_contiguous_outputs_and_inputs_against_numpy(gloo):
    rank, size = dist.get_rank(), dist.get_world_size()
    inputs = [rank_input(r, 6 * size, "float64") for r in range(size)]
    got = torch.zeros(3, 2, dtype=torch.float64).t()  # (2, 3), non-contiguous
    dist.reduce_scatter_tensor(got, torch.from_numpy(inputs[rank]).reshape(2 * size, 3))
    want = reference("sum", inputs).reshape(size, 6)[rank].reshape(2, 3)
    np.testing.assert_array_equal(got.numpy(), want)
    gathered = torch.zeros(3, size * 2, dtype=torch.float64).t()  # (size 2, 3) non-contiguous
    dist.all_gather_into_tensor(gathered, torch.from_numpy(inputs[rank][:6]).reshape(2, 3))
    np.testing.assert_array_equal(gathered.numpy(), np.concatenate([x[:6].reshape(2, 3) for x in inputs]))
    x = torch.from_numpy(rank_input(rank, 12, "int64")).reshape(3, 4).t()
    dist.broadcast(x, src=0)
    np.testing.assert_array_equal(x.numpy(), rank_input(0, 12, "int64").reshape(3, 4).T)


def test_mismatched_dtypes_are_refused_not_cast(gloo):
    size = dist.get_world_size()
    with pytest.raises((ValueError, RuntimeError), match="dtype"):
        dist.all_gather_into_tensor(torch.empty(size * 4, dtype=torch.float16), torch.ones(4))
    with pytest.raises((ValueError, RuntimeError), match="dtype"):
        dist.reduce_scatter_tensor(torch.empty(2, dtype=torch.int32), torch.ones(2 * size, dtype=torch.float64))
    with pytest.raises((ValueError, RuntimeError), match="dtype"):
        dist.all_to_all_single(torch.empty(size, dtype=torch.int64), torch.ones(size))
    dist.barrier()  # nothing was left in flight: the group still works
    x = torch.ones(3)
    dist.all_reduce(x)
    assert torch.equal(x, torch.full((3,), float(size)))


def test_bfloat16_reductions_without_ml_dtypes_are_refused(gloo, monkeypatch):
    monkeypatch.setattr(collectives.torch_backend, "BFLOAT16", None)
    with pytest.raises(NotImplementedError, match="ml_dtypes"):
        dist.all_reduce(torch.ones(4, dtype=torch.bfloat16))
    x = torch.full((4,), float(dist.get_rank()), dtype=torch.bfloat16)
    dist.broadcast(x, src=0)  # moving bytes needs no arithmetic
    assert torch.equal(x, torch.zeros(4, dtype=torch.bfloat16))


def test_groups_free_their_communicators_when_destroyed(gloo):
    size = dist.get_world_size()
    members = list(range(0, size, 2))
    for _ in range(3):
        group = dist.new_group(members, timeout=datetime.timedelta(seconds=17))
        if dist.get_rank() in members:
            assert group.comm.timeout == 17  # new_group's timeout is the library's
            x = torch.ones(2)
            dist.all_reduce(x, group=group)
            assert torch.equal(x, torch.full((2,), float(len(members))))
            dist.destroy_process_group(group)
            assert group.comm.mpi_comm == MPI.COMM_NULL


# -- training: DDP and FSDP unchanged --------------------------------------------------------------
class WithUnused(torch.nn.Module):
    """``make_model``'s layers plus a layer the forward pass never uses."""

    def __init__(self, seed):
        super().__init__()
        self.body = make_model(seed)
        self.unused = torch.nn.Linear(12, 5).double()

    def forward(self, x):
        return self.body(x)


def train_ddp(micro=1, hook=None, model=None, **ddp_options):
    """DDP over the default ("collectives") group, from rank-dependent initial weights
    (DDP broadcasts rank 0's), SGD with momentum, ``micro`` micro-batches per step
    (all but the last under ``no_sync()``); the parameters after each step."""
    class Comm:  # conftest.shard needs only rank and size
        rank, size = dist.get_rank(), dist.get_world_size()

    model = model or make_model(dist.get_rank() * 7)
    ddp = DDP(model, **ddp_options)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5, momentum=0.9)
    history = []
    for step in range(STEPS):
        optimizer.zero_grad()
        for index in range(micro):
            x, y = shard(Comm, *batch(step), micro=micro, index=index)
            if index < micro - 1:
                with ddp.no_sync():
                    (loss_fn(ddp, x, y) / micro).backward()
            else:
                (loss_fn(ddp, x, y) / micro).backward()
        optimizer.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


@pytest.mark.parametrize("micro", [1, 2])
def test_ddp_trains_equal_to_single_process(gloo, micro):
    want = single_process(torch.optim.SGD, lr=0.5, momentum=0.9)
    for step, got in enumerate(train_ddp(micro=micro)):
        assert close(got, want[step]), f"step {step}: DDP differs from single-process training beyond rtol 1e-9"


def test_ddp_with_the_progress_thread_trains_equal_to_single_process(gloo):
    """The allreduces overlap backward (futures completed by the thread), no_sync too."""
    group = dist.new_group(list(range(dist.get_world_size())))
    group.progress_thread = True
    want = single_process(torch.optim.SGD, lr=0.5, momentum=0.9)
    for step, got in enumerate(train_ddp(micro=2, process_group=group)):
        assert close(got, want[step]), f"step {step}: DDP differs from single-process training beyond rtol 1e-9"
    dist.destroy_process_group(group)


def test_ddp_with_unused_parameters(gloo):
    want = single_process(torch.optim.SGD, lr=0.5, momentum=0.9)
    model = WithUnused(dist.get_rank() * 7)
    before = model.unused.weight.detach().clone()
    dist.broadcast(before, 0)  # DDP starts every rank from rank 0's weights
    history = train_ddp(model=model, find_unused_parameters=True)
    for step, got in enumerate(history):
        assert close(got[:len(want[step])], want[step]), f"step {step}: differs from single-process training"
    assert torch.equal(model.unused.weight, before)  # no gradient, no step


def test_ddp_fp16_compress_hook(gloo):
    want = single_process(torch.optim.SGD, lr=0.5, momentum=0.9)
    for step, got in enumerate(train_ddp(hook=default_hooks.fp16_compress_hook)):
        assert close(got, want[step], rtol=1e-3), f"step {step}: fp16-compressed DDP drifts beyond 1e-3"


def test_fsdp2_trains_equal_to_single_process(gloo):
    from torch.distributed.fsdp import fully_shard

    class Comm:
        rank, size = dist.get_rank(), dist.get_world_size()

    want = single_process(torch.optim.SGD, lr=0.5)
    model = make_model(0)  # FSDP shards rank-identical weights; it does not broadcast
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_fn(model, *shard(Comm, *batch(step))).backward()
        optimizer.step()
        got = [p.full_tensor() for p in model.parameters()]
        assert close(got, want[step]), f"step {step}: FSDP differs from single-process training beyond rtol 1e-9"


# -- rendezvous --------------------------------------------------------------------------------------
JOB = """
import datetime, sys, warnings, torch.distributed as dist
warnings.simplefilter("ignore")
import collectives.torch
try:
    dist.init_process_group("collectives", timeout=datetime.timedelta(seconds=20))
except (RuntimeError, ValueError) as error:
    print("RAISED", str(error).replace("\\n", " "))
    sys.exit(0)
print("NO ERROR")
"""


@pytest.mark.serial
@pytest.mark.parametrize("views, message", [
    ([(1, 2), (0, 2)], "MPI rank 0 is torch rank 1"),  # swapped
    ([(1, 3), (0, 3), (2, 3)], "MPI rank 1 is torch rank 0"),  # rank 2 agrees, and still hears of it
    ([(0, 1), (0, 1)], "torch's world size is 1"),  # too small: no store waits for anyone
], ids=["swapped", "partly", "world-size"])
def test_ranks_disagreeing_with_mpi_are_a_clear_error_on_every_rank(tmp_path, views, message):
    """RANK/WORLD_SIZE set per process against MPI's: init_process_group raises on every
    rank, naming the disagreement, and nothing hangs."""
    import launch  # tests/harness/launch.py: each launcher's flags

    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = launch.environment()
    env.pop("MASTER_ADDR", None), env.pop("MASTER_PORT", None)
    parts = [(1, {"RANK": rank, "WORLD_SIZE": size}, [sys.executable, script]) for rank, size in views]
    job = subprocess.run(launch.command(parts), capture_output=True, text=True, timeout=120, env=env)
    assert job.returncode == 0, job.stderr
    # (the ranks' lines may interleave in the launcher's output: count, do not split)
    assert job.stdout.count("RAISED") == len(views) and "NO ERROR" not in job.stdout, job.stdout + job.stderr
    assert message in job.stdout, job.stdout
