"""A Horovod PyTorch training script, run on the collectives.

    .venv/bin/python examples/train_horovod.py                          # one process
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train_horovod.py   # four ranks
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train_horovod.py --fp16-allreduce --batches-per-allreduce 2

Written as Horovod's documentation ("Horovod with PyTorch") and its examples
(pytorch_mnist.py, pytorch_imagenet_resnet50.py) write one: hvd.init(), one CPU thread
per worker, the learning rate scaled by hvd.size(), rank 0's weights and optimizer state
broadcast, DistributedOptimizer with named_parameters and compression, the data sharded
with DistributedSampler, metrics averaged with hvd.allreduce. Only the import differs:
with ``import horovod.torch as hvd`` it runs on Horovod.

The data is synthetic and the same on every rank (made from --seed): points in 20
dimensions labelled by a random linear "teacher" with noise, 4 classes. Each rank
takes --batch-size samples per step, so a step's global batch is batch-size x size
(Horovod's convention, hence the learning rate scaled by the number of workers).
"""

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import collectives.horovod.torch as hvd  # with Horovod: import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch synthetic-data example, Horovod API")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per rank for training (default: 32)")
parser.add_argument("--batches-per-allreduce", type=int, default=1,
                    help="number of batches processed locally before executing allreduce across workers; it "
                         "multiplies the total batch size (default: 1)")
parser.add_argument("--epochs", type=int, default=5, help="number of epochs to train (default: 5)")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate per worker (default: 0.05)")
parser.add_argument("--momentum", type=float, default=0.5, help="SGD momentum (default: 0.5)")
parser.add_argument("--seed", type=int, default=42, help="random seed (default: 42)")
parser.add_argument("--samples", type=int, default=4096, help="training samples (default: 4096)")
parser.add_argument("--test-samples", type=int, default=1024, help="test samples (default: 1024)")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--log-interval", type=int, default=10,
                    help="how many batches to wait before logging training status (default: 10)")

FEATURES, CLASSES = 20, 4


def synthetic_datasets(train_samples, test_samples, seed):
    """Training and test sets: points labelled by one random linear teacher plus noise."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=g, dtype=torch.float64)
    x = torch.randn(train_samples + test_samples, FEATURES, generator=g, dtype=torch.float64)
    y = (x @ teacher + 0.5 * torch.randn(len(x), CLASSES, generator=g, dtype=torch.float64)).argmax(dim=1)
    return (torch.utils.data.TensorDataset(x[:train_samples], y[:train_samples]),
            torch.utils.data.TensorDataset(x[train_samples:], y[train_samples:]))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 32)
        self.fc2 = nn.Linear(32, CLASSES)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def train(args):
    """Train as the arguments say; returns the model (the same on every rank)."""
    # Horovod: initialize library.
    hvd.init()
    # A different seed on each rank on purpose: broadcast_parameters gives every rank rank 0's weights.
    torch.manual_seed(args.seed + hvd.rank())

    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())

    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)

    train_dataset, test_dataset = synthetic_datasets(args.samples, args.test_samples, args.seed)
    # Horovod: use DistributedSampler to partition the training data.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed)
    allreduce_batch_size = args.batch_size * args.batches_per_allreduce
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=allreduce_batch_size, sampler=train_sampler)

    # Horovod: use DistributedSampler to partition the test data.
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=256, sampler=test_sampler)

    model = Net().double()
    if args.cuda:
        # Move model to GPU.
        model.cuda()

    # Horovod: scale learning rate by the number of workers.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         backward_passes_per_step=args.batches_per_allreduce,
                                         op=hvd.Average)

    def train_epoch(epoch):
        model.train()
        # Horovod: set epoch to sampler for shuffling.
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            optimizer.zero_grad()
            # Split data into sub-batches of size batch_size
            for i in range(0, len(data), args.batch_size):
                data_batch = data[i:i + args.batch_size]
                target_batch = target[i:i + args.batch_size]
                output = model(data_batch)
                loss = F.cross_entropy(output, target_batch)
                # Average gradients among sub-batches
                loss.div_(math.ceil(float(len(data)) / args.batch_size))
                loss.backward()
            # Gradient is applied across all ranks
            optimizer.step()
            if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                # Horovod: use train_sampler to determine the number of examples in this worker's partition.
                print("Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}".format(
                    epoch, batch_idx * len(data), len(train_sampler), 100. * batch_idx / len(train_loader),
                    loss.item() * args.batches_per_allreduce))

    def metric_average(val, name):
        tensor = torch.tensor(val)
        avg_tensor = hvd.allreduce(tensor, name=name)
        return avg_tensor.item()

    def test():
        model.eval()
        test_loss = 0.
        test_accuracy = 0.
        with torch.no_grad():
            for data, target in test_loader:
                if args.cuda:
                    data, target = data.cuda(), target.cuda()
                output = model(data)
                # sum up batch loss
                test_loss += F.cross_entropy(output, target, reduction="sum").item()
                # get the index of the max log-probability
                pred = output.argmax(dim=1)
                test_accuracy += pred.eq(target).cpu().double().sum().item()

        # Horovod: use test_sampler to determine the number of examples in this worker's partition.
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)

        # Horovod: average metric values across workers.
        test_loss = metric_average(test_loss, "avg_loss")
        test_accuracy = metric_average(test_accuracy, "avg_accuracy")

        # Horovod: print output only on first rank.
        if hvd.rank() == 0:
            print("\nTest set: Average loss: {:.4f}, Accuracy: {:.2f}%\n".format(test_loss, 100. * test_accuracy))

    for epoch in range(1, args.epochs + 1):
        train_epoch(epoch)
        test()
    return model


def parse_args(argv=None):
    args = parser.parse_args(argv)
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    return args


def main(argv=None):
    train(parse_args(argv))


if __name__ == "__main__":
    main()
