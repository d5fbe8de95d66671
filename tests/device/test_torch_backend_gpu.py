"""The torch.distributed backend "collectives" on CUDA tensors, and DDP on a CUDA model.

The reference for every call is the same call on CPU tensors through the same backend,
which tests/adapters/test_torch_backend.py holds equal to gloo bit for bit: a CUDA result must
have the CPU result's dtype, shape and bits, and stay on the GPU. DDP on a CUDA model
must equal single-process training on the global batch. Marked ``gpu``: skipped, with
the reason, where no GPU can run them (``make test-gpu`` runs them).
"""

import datetime

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import collectives.torch  # noqa: E402,F401  (registers the backend)

from conftest import agree, rank_input, shard  # noqa: E402
from torch_reference import STEPS, batch, close, loss_fn, make_model, single_process  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:.*is deprecated. Please use:FutureWarning")]
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "prod": dist.ReduceOp.PRODUCT,
       "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "bxor": dist.ReduceOp.BXOR}


@pytest.fixture(scope="module")
def group():
    """The default group on "collectives" (the world), each rank on a GPU of its node."""
    from mpi4py import MPI

    torch.cuda.set_device(MPI.COMM_WORLD.Get_rank() % torch.cuda.device_count())
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("collectives", timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def tensor(rank, count, dtype, op="sum"):
    """``conftest.rank_input`` as a CPU tensor of ``dtype`` (exact under ``op``)."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.from_numpy(rank_input(rank, count, "float32", op)).to(dtype)
    return torch.from_numpy(rank_input(rank, count, str(dtype).split(".")[-1], op)).clone()


def on_both(call):
    """``call(device)`` with CPU tensors, then with CUDA tensors: the problems found
    comparing the two results (as lists of tensors)."""
    want = call("cpu")
    got = call("cuda")
    torch.cuda.synchronize()
    problems = []
    for w, g in zip(want, got):
        if g.device.type != "cuda":
            problems.append(f"a result on {g.device}, not on the GPU")
        elif w.dtype != g.dtype or w.shape != g.shape or not torch.equal(w, g.cpu()):
            problems.append(f"CUDA gave {g.cpu()}, the CPU gave {w}")
    return problems


def test_all_reduce_every_op_and_dtype(group):
    rank, problems = dist.get_rank(), []
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64):
        for op in OPS:
            if op == "bxor" and dtype.is_floating_point or op == "avg" and not dtype.is_floating_point:
                continue
            for count in (0, 1, 37, 300_001):
                def call(device, dtype=dtype, op=op, count=count):
                    x = tensor(rank, count, dtype, op).to(device)
                    dist.all_reduce(x, op=OPS[op])
                    return [x]
                problems += [f"{dtype} {op} n={count}: {p}" for p in on_both(call)]
    agree_torch(problems)


def test_broadcast_gather_scatter_and_all_to_all(group):
    rank, size = dist.get_rank(), dist.get_world_size()

    def broadcast(device):
        out = []
        for root in range(size):
            x = tensor(rank, 1001, torch.float32).to(device)
            dist.broadcast(x, src=root)
            out.append(x)
        return out

    def all_gather(device):
        x = tensor(rank, 513, torch.bfloat16).to(device)
        into = torch.empty(size * 513, dtype=torch.bfloat16, device=device)
        dist.all_gather_into_tensor(into, x)
        listed = [torch.empty(513, dtype=torch.bfloat16, device=device) for _ in range(size)]
        dist.all_gather(listed, x)
        return [into] + listed

    def reduce_scatter(device):
        x = tensor(rank, size * 257, torch.float32).to(device)
        out = torch.empty(257, device=device)
        dist.reduce_scatter_tensor(out, x)
        return [out]

    def reduce_and_gather(device):
        x = tensor(rank, 99, torch.int64).to(device)
        dist.reduce(x, dst=size - 1)
        rows = [torch.zeros(99, dtype=torch.int64, device=device) for _ in range(size)] if rank == 0 else None
        dist.gather(x, rows, dst=0)
        piece = torch.zeros(99, dtype=torch.int64, device=device)
        dist.scatter(piece, rows if rank == 0 else None, src=0)
        return [x, piece] + (rows or [])

    def all_to_all(device):
        x = tensor(rank, size * 11, torch.float64).to(device)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return [out]

    problems = []
    for call in (broadcast, all_gather, reduce_scatter, reduce_and_gather, all_to_all):
        problems += [f"{call.__name__}: {p}" for p in on_both(call)]
    agree_torch(problems)


def test_send_and_recv_in_a_ring(group):
    rank, size = dist.get_rank(), dist.get_world_size()

    def ring(device):
        if size == 1:
            return []
        x = tensor(rank, 4097, torch.float32).to(device)
        got = torch.empty_like(x)
        right, left = (rank + 1) % size, (rank - 1) % size
        requests = [dist.isend(x, right), dist.irecv(got, left)]
        for r in requests:
            r.wait()
        return [got]

    agree_torch(on_both(ring))


def test_ddp_on_a_cuda_model_equals_single_process(group):
    """DDP over "collectives" with the model and batches on the GPU: each step's
    parameters equal single-process training (float64, rtol 1e-9)."""
    class Comm:  # conftest.shard needs only rank and size
        rank, size = dist.get_rank(), dist.get_world_size()

    want = single_process(torch.optim.SGD, lr=0.5, momentum=0.9)
    model = make_model(dist.get_rank() * 7).cuda()
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5, momentum=0.9)
    problems = []
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = shard(Comm, *batch(step))
        loss_fn(ddp, x.cuda(), y.cuda()).backward()
        optimizer.step()
        if not close([p.detach().cpu() for p in model.parameters()], want[step]):
            problems.append(f"step {step}: differs from single-process training beyond rtol 1e-9")
    agree_torch(problems)


def agree_torch(problems):
    from mpi4py import MPI

    agree(MPI.COMM_WORLD, problems)
