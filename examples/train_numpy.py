"""Data-parallel training of a small MLP, written in plain NumPy, on the collectives.

    .venv/bin/python examples/train_numpy.py                          # one process
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train_numpy.py   # four ranks
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train_numpy.py --compression fp16 --accumulate 2
    .venv/bin/python examples/train_numpy.py --help

The model is 64 -> --hidden -> 10 (tanh, softmax cross-entropy) on scikit-learn's digits,
forward and backward by hand, plain SGD. Every rank holds all the parameters; rank 0's
are broadcast once; each step every rank computes the gradient on its share of the
global batch, and :class:`~collectives.training.GradientReducer` averages the gradients
over the ranks while backward is still running (each gradient is handed over as soon as
it is computed, last layer first; a bucket's allreduce starts when its last gradient
arrives). The ranks therefore take identical steps, and the run gives the same accuracy
as a serial run with the same flags.

This model's gradients (38 KB) all fit in the reducer's first bucket (1 MiB), so here
the one allreduce starts when the first layer's gradient arrives; with a model of
many megabytes, the later layers' buckets are reduced while backward is still busy.
"""

import os
import sys

import numpy as np

import collectives as cc
from collectives.training import GradientReducer, broadcast_parameters, check_parameters

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _data.py sits next to this file
import _data  # noqa: E402


def init_params(n_in, hidden, n_out, rng):
    """Parameters named and laid out as ``nn.Sequential(Linear, Tanh, Linear)``'s
    state_dict (weights are ``(out, in)``), initialised as ``nn.Linear`` does:
    uniform in +-1/sqrt(fan_in). Float64, so runs compare closely."""
    params = {}
    for layer, fan_in, fan_out in (("0", n_in, hidden), ("2", hidden, n_out)):
        bound = 1 / np.sqrt(fan_in)
        params[f"{layer}.weight"] = rng.uniform(-bound, bound, (fan_out, fan_in))
        params[f"{layer}.bias"] = rng.uniform(-bound, bound, fan_out)
    return params


def forward(params, x):
    """``(hidden activations, logits)`` for the rows of ``x``."""
    h = np.tanh(x @ params["0.weight"].T + params["0.bias"])
    return h, h @ params["2.weight"].T + params["2.bias"]


def predict(params, x):
    return forward(params, x)[1].argmax(axis=1)


def backward(params, x, y, scale, grads, gradient_ready):
    """The mean softmax cross-entropy over ``(x, y)``, whose gradient times ``scale`` is
    *added* to ``grads`` (so micro-batches accumulate, like PyTorch's ``.grad``).

    Each gradient goes to ``gradient_ready`` the moment it is final, last layer first:
    the reducer starts a bucket's allreduce as soon as the bucket is full, so it runs
    while the earlier layers' gradients are still being computed."""
    rows = np.arange(len(y))
    h, logits = forward(params, x)
    logits -= logits.max(axis=1, keepdims=True)  # a stable softmax
    log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    loss = -log_p[rows, y].mean()

    d_logits = np.exp(log_p)  # d loss / d logits = (softmax - one_hot) / batch
    d_logits[rows, y] -= 1
    d_logits *= scale / len(y)
    grads["2.bias"] += d_logits.sum(axis=0)
    gradient_ready("2.bias", grads["2.bias"])
    grads["2.weight"] += d_logits.T @ h
    gradient_ready("2.weight", grads["2.weight"])

    d_pre = (d_logits @ params["2.weight"]) * (1 - h * h)  # through tanh
    grads["0.bias"] += d_pre.sum(axis=0)
    gradient_ready("0.bias", grads["0.bias"])
    grads["0.weight"] += d_pre.T @ x
    gradient_ready("0.weight", grads["0.weight"])
    return loss


def main():
    comm = cc.Communicator()  # over MPI.COMM_WORLD; a single process is a world of 1
    args = _data.parser(__doc__.splitlines()[0]).parse_args()
    X_train, y_train, X_test, y_test = _data.load_digits()
    _data.check_args(args, comm.size, comm.rank, len(y_train))
    k = args.accumulate

    # Seeded differently on each rank on purpose: broadcast_parameters makes every rank
    # start from rank 0's values (which are a serial run's, whose rank is 0 too).
    params = init_params(X_train.shape[1], args.hidden, 10, np.random.default_rng(args.seed + comm.rank))
    broadcast_parameters(params, root=0, comm=comm)
    grads = {name: np.zeros_like(p) for name, p in params.items()}
    # k backward passes per step: the reducer sends only on the k-th pass of each
    # parameter, the accumulated gradient we hand it then.
    reducer = GradientReducer(params, comm, backward_passes_per_step=k,
                              compression=None if args.compression == "none" else args.compression)

    report = _data.Report(args, comm, "train_numpy.py")
    for epoch in report.epochs():
        loss_sum, steps = 0.0, 0
        for batch in _data.global_batches(len(y_train), args.batch, args.seed, epoch):
            share = _data.my_share(batch, comm.rank, comm.size)
            for g in grads.values():
                g.fill(0)
            # The shard's gradient is the mean of the k micro-batch means (equal sizes).
            for micro in _data.micro_batches(share, k):
                loss_sum += backward(params, X_train[micro], y_train[micro], 1 / k, grads,
                                     reducer.gradient_ready) / k
            reducer.synchronize()  # waits; grads now hold the average over the ranks
            for name, p in params.items():
                p -= args.lr * grads[name]
            steps += 1
        report.epoch(epoch, _data.mean_over_ranks(loss_sum, steps, comm),
                     _data.test_accuracy(lambda x: predict(params, x), X_test, y_test, comm))

    check_parameters(params, comm)  # raises on every rank if any replica drifted
    if comm.rank == 0:
        print(f"parameters bit-for-bit identical on all {comm.size} rank(s)")
    report.finish()
    reducer.close()


if __name__ == "__main__":
    main()
