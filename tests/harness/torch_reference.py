"""The single-process PyTorch reference for the training tests (test_torch.py,
test_torch_backend.py): a small float64 model, a global batch per step, and plain
training on the whole batch."""

import torch

from conftest import GLOBAL_BATCH

STEPS = 3


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5)).double()


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(GLOBAL_BATCH, 12, generator=g, dtype=torch.float64),
            torch.randint(0, 5, (GLOBAL_BATCH,), generator=g))


def loss_fn(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def single_process(optimizer_class, steps=STEPS, make=make_model, **options):
    """The parameters after each of ``steps`` steps of plain training on the global batch."""
    model = make(0)
    optimizer = optimizer_class(model.parameters(), **options)
    history = []
    for step in range(steps):
        optimizer.zero_grad()
        loss_fn(model, *batch(step)).backward()
        optimizer.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def close(parameters, reference, rtol=1e-9):
    """Whether ``parameters`` (a model, or tensors) equal ``reference`` within ``rtol``."""
    if isinstance(parameters, torch.nn.Module):
        parameters = parameters.parameters()
    return all(torch.allclose(p, q, rtol=rtol, atol=rtol) for p, q in zip(parameters, reference))
