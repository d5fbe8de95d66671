"""The PyTorch adapter (collectives.torch), serially and under mpiexec; skipped when torch
is not installed.

The reference is single-process PyTorch training on the whole global batch with the
plain optimizer. DistributedOptimizer over the world must give the same parameters
(float64, rtol 1e-9) and the same bits on every rank after every step.
"""

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")

import collectives.torch as cct  # noqa: E402
from collectives.training import TrainingError  # noqa: E402

from conftest import agree, identical_everywhere, shard  # noqa: E402
from torch_reference import STEPS, batch, close, loss_fn, make_model, single_process  # noqa: E402

torch.set_num_threads(1)  # up to 8 ranks share 2 cores


@pytest.mark.parametrize("optimizer_class, options, extra", [
    (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}, {}),
    (torch.optim.Adam, {"lr": 0.01}, {"first_bucket_bytes": 256, "bucket_bytes": 1024}),
    (torch.optim.SGD, {"lr": 0.5}, {"progress_thread": True, "algorithm": "ring"}),
])
def test_distributed_optimizer_equals_single_process(comm, optimizer_class, options, extra):
    want = single_process(optimizer_class, **options)
    model = make_model(comm.rank * 7)  # rank 0 starts as the reference; the others differ until broadcast
    cct.broadcast_parameters(model.state_dict(), comm=comm)
    optimizer = cct.DistributedOptimizer(optimizer_class(model.parameters(), **options),
                                         named_parameters=model.named_parameters(), comm=comm, **extra)
    assert isinstance(optimizer, optimizer_class)
    problems = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_fn(model, *shard(comm, *batch(step))).backward()
        optimizer.step()
        if not close(model, want[step]):
            problems.append(f"step {step}: differs from single-process training beyond rtol 1e-9")
        if not identical_everywhere(p.detach().numpy() for p in model.parameters()):
            problems.append(f"step {step}: parameters differ between ranks")
    optimizer.close()
    agree(MPI.COMM_WORLD, problems)


@pytest.mark.parametrize("how", ["backward_passes_per_step", "no_sync"])
def test_gradient_accumulation_equals_single_process(comm, how):
    micro = 2
    want = single_process(torch.optim.SGD, lr=0.5)
    model = make_model(0)
    k = micro if how == "backward_passes_per_step" else 1
    optimizer = cct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                         named_parameters=model.named_parameters(), comm=comm,
                                         backward_passes_per_step=k)
    problems = []
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = batch(step)
        for index in range(micro):
            loss = loss_fn(model, *shard(comm, x, y, micro, index)) / micro  # a mean over the micro-batches
            if how == "no_sync" and index < micro - 1:
                with optimizer.no_sync():
                    loss.backward()
            else:
                loss.backward()
        optimizer.step()
        if not close(model, want[step]):
            problems.append(f"step {step}: differs from single-process training")
        if not identical_everywhere(p.detach().numpy() for p in model.parameters()):
            problems.append(f"step {step}: parameters differ between ranks")
    optimizer.close()
    agree(MPI.COMM_WORLD, problems)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compression_trains_within_tolerance(comm, compression):
    if compression == "bf16":
        pytest.importorskip("ml_dtypes")  # in the test extra: runs wherever make test installed
    rtol = 1e-3 if compression == "fp16" else 1e-2  # lr * gradient error of about 2**-11 (2**-8) per step
    want = single_process(torch.optim.SGD, lr=0.5)
    model = make_model(0)
    optimizer = cct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                         named_parameters=model.named_parameters(), comm=comm, compression=compression)
    problems = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_fn(model, *shard(comm, *batch(step))).backward()
        optimizer.step()
        if not close(model, want[step], rtol=rtol):
            problems.append(f"step {step}: {compression} compression drifts beyond {rtol}")
        if not identical_everywhere(p.detach().numpy() for p in model.parameters()):
            problems.append(f"step {step}: parameters differ between ranks")
    optimizer.close()
    agree(MPI.COMM_WORLD, problems)


def test_broadcast_state_dict_with_buffers_and_optimizer_state(comm):
    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
        model(torch.randn(8, 4)).sum().backward()  # gives BatchNorm running stats and grads
        optimizer = torch.optim.Adam(model.parameters(), lr=0.001 * (seed + 1))
        if seed == 0:
            optimizer.step()  # only the root has optimizer state
        return model, optimizer

    model, optimizer = build(comm.rank)
    want_model, want_optimizer = build(0)
    cct.broadcast_parameters(model.state_dict(), comm=comm)
    cct.broadcast_optimizer_state(optimizer, comm=comm)
    problems = []
    for (name, got), want in zip(model.state_dict().items(), want_model.state_dict().values()):
        if not torch.equal(got, want):
            problems.append(f"state_dict[{name!r}] differs from the root's")
    got_state, want_state = optimizer.state_dict(), want_optimizer.state_dict()
    if got_state["param_groups"] != want_state["param_groups"]:
        problems.append("optimizer hyperparameters differ from the root's")
    for index, state in want_state["state"].items():
        for key, value in state.items():
            if not torch.equal(got_state["state"].get(index, {}).get(key, torch.tensor(float("nan"))), value):
                problems.append(f"optimizer state[{index}][{key!r}] differs from the root's")
    agree(MPI.COMM_WORLD, problems)


def test_lr_scheduler_and_manual_synchronize(comm):
    """A scheduler accepts the wrapped optimizer; synchronize() before step() (to clip the
    averaged gradients) makes step() not synchronize again."""
    model = make_model(0)
    optimizer = cct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                         named_parameters=model.named_parameters(), comm=comm)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for step in range(2):
        optimizer.zero_grad()
        loss_fn(model, *shard(comm, *batch(step))).backward()
        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        optimizer.step()
        scheduler.step()
    cct.check_parameters(model.named_parameters(), comm)
    assert optimizer.param_groups[0]["lr"] == 0.25
    optimizer.close()


def test_unused_parameter_is_reported(comm):
    model = make_model(0)
    unused = torch.nn.Linear(3, 3).double()
    params = list(model.named_parameters()) + [("unused." + n, p) for n, p in unused.named_parameters()]
    optimizer = cct.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1), named_parameters=params,
                                         comm=comm)
    loss_fn(model, *shard(comm, *batch(0))).backward()
    with pytest.raises(TrainingError, match=r"'unused.weight', 'unused.bias'.*left out of the reducer's params"):
        optimizer.step()
    optimizer.close()


def test_misuse(comm):
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="named_parameters leaves out 2 parameter"):
        cct.DistributedOptimizer(optimizer, named_parameters=list(model.named_parameters())[:2], comm=comm)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        cct.DistributedOptimizer(object(), comm=comm)
    with pytest.raises(TypeError, match=r"params\['w'\] must be a torch.Tensor"):
        cct.broadcast_parameters({"w": np.zeros(3)}, comm=comm)
    with pytest.raises(TypeError, match=r"params\['w'\] is on meta"):
        cct.broadcast_parameters({"w": torch.zeros(3, device="meta")}, comm=comm)
    with pytest.raises(ValueError, match="LR scheduler created before"):
        cct.DistributedOptimizer(_with_scheduler(model), comm=comm)
    distributed = cct.DistributedOptimizer(optimizer, comm=comm)  # names made up from the parameter groups
    with pytest.raises(ValueError, match="add every parameter group to the optimizer before wrapping"):
        distributed.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        cct.DistributedOptimizer(distributed, comm=comm)
    with pytest.raises(ValueError, match="closure"):
        distributed.step(lambda: 0.0)
    distributed.close()


def test_check_parameters_on_tensors(comm):
    model = make_model(0)
    cct.check_parameters(model.state_dict(), comm)
    if comm.size == 1:
        return
    with torch.no_grad():
        model[0].bias[0] += comm.rank
    with pytest.raises(TrainingError, match=r"'0.bias' on rank\(s\) 1"):
        cct.check_parameters(model.named_parameters(), comm)


def _with_scheduler(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)  # patches optimizer.step
    return optimizer


def test_load_state_dict_keeps_the_wrapper_and_the_optimizer_in_step(comm):
    """load_state_dict assigns new param_groups: the wrapped optimizer (which a user may
    still hold, e.g. in a scheduler) must see them too."""
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    distributed = cct.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), comm=comm)
    state = distributed.state_dict()
    state["param_groups"][0]["lr"] = 0.05
    distributed.load_state_dict(state)
    assert optimizer.param_groups is distributed.param_groups and optimizer.param_groups[0]["lr"] == 0.05
    distributed.close()
