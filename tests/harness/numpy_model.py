"""The NumPy reference for the training tests (test_training.py, test_ps.py,
test_device.py): a small MLP, forward and backward by hand, a global batch per step, and
plain SGD on the whole batch."""

import numpy as np

from conftest import GLOBAL_BATCH

LR = 0.5


def init_params(seed, dtype=np.float64, sizes=(12, 16, 5)):
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((sizes[0], sizes[1])) / np.sqrt(sizes[0])).astype(dtype),
        "b1": np.zeros(sizes[1], dtype),
        "w2": (rng.standard_normal((sizes[1], sizes[2])) / np.sqrt(sizes[1])).astype(dtype),
        "b2": np.zeros(sizes[2], dtype),
    }


def data(step, dtype=np.float64):
    """The global batch of ``step``: the same on every rank."""
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((GLOBAL_BATCH, 12)).astype(dtype)
    y = rng.integers(0, 5, GLOBAL_BATCH)
    return x, y


def backward(params, x, y):
    """Gradients of the mean cross-entropy over (x, y), last layer first (as backward
    produces them): a list of (name, grad)."""
    h = np.tanh(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    dlogits = p / len(y)
    grads = [("b2", dlogits.sum(axis=0)), ("w2", h.T @ dlogits)]
    dh = (dlogits @ params["w2"].T) * (1 - h * h)
    grads += [("b1", dh.sum(axis=0)), ("w1", x.T @ dh)]
    return [(name, g.astype(params[name].dtype)) for name, g in grads]


def sgd(params, grads):
    for name, g in grads.items():
        params[name] -= LR * g


def single_process(steps, dtype=np.float64):
    params = init_params(0, dtype)
    history = []
    for step in range(steps):
        x, y = data(step, dtype)
        sgd(params, dict(backward(params, x, y)))
        history.append({n: a.copy() for n, a in params.items()})
    return history
