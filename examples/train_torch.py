"""Data-parallel training of a small PyTorch MLP with collectives.torch (Horovod style).

    .venv/bin/python examples/train_torch.py                          # one process
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train_torch.py   # four ranks
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train_torch.py --compression fp16 --accumulate 2
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train_torch.py --optimizer adam
    .venv/bin/python examples/train_torch.py --help

The same model, data, sharding and flags as train_numpy.py, in PyTorch: an
``nn.Sequential(Linear, Tanh, Linear)`` in float64 on scikit-learn's digits. Rank 0's
weights and optimizer state are broadcast once (every rank seeds torch differently, so
this is what makes the replicas equal); ``DistributedOptimizer`` wraps the optimizer
so that autograd hooks hand each gradient to the collectives as soon as backward has
computed it, and ``step()`` applies the gradients averaged over the ranks.
"""

import os
import sys

import torch
from torch import nn

import collectives as cc
import collectives.torch as cct

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _data.py sits next to this file
import _data  # noqa: E402

DEFAULT_LR = {"sgd": 0.5, "adam": 0.005}


def main():
    torch.set_num_threads(1)  # the ranks share the cores: intra-op threads would only fight over them
    comm = cc.Communicator()  # over MPI.COMM_WORLD; a single process is a world of 1
    p = _data.parser(__doc__.splitlines()[0], lr=None)
    p.add_argument("--optimizer", choices=sorted(DEFAULT_LR), default="sgd",
                   help="adam keeps per-parameter state (moments) for broadcast_optimizer_state; --lr defaults to "
                        + ", ".join(f"{lr} for {name}" for name, lr in DEFAULT_LR.items()))
    args = p.parse_args()
    args.lr = DEFAULT_LR[args.optimizer] if args.lr is None else args.lr
    X_train, y_train, X_test, y_test = _data.load_digits()  # NumPy; batches go through torch.from_numpy
    _data.check_args(args, comm.size, comm.rank, len(y_train))
    k = args.accumulate

    # Seeded differently on each rank on purpose: the broadcasts below must make every
    # rank start from rank 0's weights (a serial run's, whose rank is 0 too).
    torch.manual_seed(args.seed + comm.rank)
    model = nn.Sequential(nn.Linear(X_train.shape[1], args.hidden), nn.Tanh(), nn.Linear(args.hidden, 10)).double()
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    cct.broadcast_parameters(model.state_dict(), root=0, comm=comm)
    # Before the first step this moves only the hyperparameters (the state is empty);
    # after rank 0 loads a checkpoint it moves the moments and step counts too.
    cct.broadcast_optimizer_state(optimizer, root=0, comm=comm)
    # k backward passes per step: .grad accumulates them, and only the k-th sends.
    optimizer = cct.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), comm=comm, backward_passes_per_step=k,
        compression=None if args.compression == "none" else args.compression)
    loss_fn = nn.CrossEntropyLoss()  # the mean over the micro-batch

    def predict(x):
        with torch.no_grad():
            return model(torch.from_numpy(x)).argmax(dim=1).numpy()

    report = _data.Report(args, comm, "train_torch.py")
    for epoch in report.epochs():
        loss_sum, steps = 0.0, 0
        for batch in _data.global_batches(len(y_train), args.batch, args.seed, epoch):
            share = _data.my_share(batch, comm.rank, comm.size)
            optimizer.zero_grad()
            for micro in _data.micro_batches(share, k):
                # Scaled by 1/k, the accumulated .grad is the mean over the whole share.
                loss = loss_fn(model(torch.from_numpy(X_train[micro])), torch.from_numpy(y_train[micro])) / k
                loss.backward()  # hooks hand each finished gradient over, last layer first
                loss_sum += loss.item()
            optimizer.step()  # waits for the averaged gradients, then steps
            steps += 1
        report.epoch(epoch, _data.mean_over_ranks(loss_sum, steps, comm),
                     _data.test_accuracy(predict, X_test, y_test, comm))

    # Raises on every rank if any replica drifted.
    cct.check_parameters(model.named_parameters(), comm)
    if comm.rank == 0:
        print(f"parameters bit-for-bit identical on all {comm.size} rank(s)")
    report.finish()
    optimizer.close()


if __name__ == "__main__":
    main()
