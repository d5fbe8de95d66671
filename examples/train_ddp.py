"""Data-parallel training of a small PyTorch MLP with torch's DistributedDataParallel on
the backend "collectives", written as for torchrun.

    .venv/bin/python examples/train_ddp.py                                  # one process
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train_ddp.py           # four ranks
    .venv/bin/collectives-run -np 4 .venv/bin/python examples/train_ddp.py  # the same, horovodrun-style
    .venv/bin/python examples/train_ddp.py --help

The model, data, sharding and flags of train_torch.py, through DDP unchanged:
``init_process_group("collectives")`` (``import collectives.torch`` supplies the
rendezvous variables under an MPI launcher), ``DistributedDataParallel(model)``, the
device from ``LOCAL_RANK`` (set by ``import collectives`` under an MPI launcher, as
torchrun sets it). DDP broadcasts rank 0's weights when it wraps the model and averages
the gradients in buckets during backward; ``no_sync`` holds them back for all but the
last of ``--accumulate`` micro-batches. ``--compression fp16`` uses torch's own
``fp16_compress_hook``.
"""

import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import collectives as cc
import collectives.torch  # noqa: F401  (registers the backend "collectives")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _data.py sits next to this file
import _data  # noqa: E402


def main():
    torch.set_num_threads(1)  # the ranks share the cores: intra-op threads would only fight over them
    p = _data.parser(__doc__.splitlines()[0])
    args = p.parse_args()
    if args.compression == "bf16":
        p.error("--compression: DDP's hooks here are none or fp16")
    dist.init_process_group("collectives")
    comm = cc.Communicator()  # the reports' sums and the test set's shares, over MPI.COMM_WORLD
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    X_train, y_train, X_test, y_test = _data.load_digits()
    _data.check_args(args, size, rank, len(y_train))
    k = args.accumulate

    torch.manual_seed(args.seed + rank)  # different on each rank: DDP's broadcast of rank 0's weights makes them equal
    model = nn.Sequential(nn.Linear(X_train.shape[1], args.hidden), nn.Tanh(), nn.Linear(args.hidden, 10))
    model = DistributedDataParallel(model.double().to(device))
    if args.compression == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    def predict(x):
        with torch.no_grad():
            return model.module(torch.from_numpy(x).to(device)).argmax(dim=1).cpu().numpy()

    report = _data.Report(args, comm, "train_ddp.py")
    for epoch in report.epochs():
        loss_sum, steps = 0.0, 0
        for batch in _data.global_batches(len(y_train), args.batch, args.seed, epoch):
            optimizer.zero_grad()
            micros = _data.micro_batches(_data.my_share(batch, rank, size), k)
            for i, micro in enumerate(micros):
                x, y = torch.from_numpy(X_train[micro]).to(device), torch.from_numpy(y_train[micro]).to(device)
                with model.no_sync() if i < k - 1 else contextlib.nullcontext():
                    loss = loss_fn(model(x), y) / k  # the accumulated .grad: the mean over the share
                    loss.backward()  # the last micro-batch's backward averages every bucket over the ranks
                loss_sum += loss.item()
            optimizer.step()
            steps += 1
        report.epoch(epoch, _data.mean_over_ranks(loss_sum, steps, comm),
                     _data.test_accuracy(predict, X_test, y_test, comm))
    report.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
