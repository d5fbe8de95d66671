"""What the two training examples share: the data, how a global batch is split over the
ranks, the command line, the evaluation and the report.

Both scripts train the same 64 -> hidden -> 10 MLP on scikit-learn's digits (8x8 images,
1797 samples, shipped inside scikit-learn: nothing is downloaded). Only the model code
differs (hand-written NumPy in train_numpy.py, PyTorch in train_torch.py).

Data parallelism here means: every rank walks the *same* sequence of global batches (the
shuffle seed is shared), and takes its own contiguous ``batch / size`` slice of each one.
Each rank's loss is the mean over its slice, so the average of the ranks' gradients is
the gradient of the mean over the whole global batch: a run on 4 ranks takes the same
steps as a serial run with the same ``--batch`` (up to floating-point rounding).
"""

import argparse
import json
import sys
import time

import numpy as np

TEST_SIZE = 300  # 1497 training samples, 300 test samples
SPLIT_SEED = 0  # the train/test split is fixed, whatever --seed is


def load_digits():
    """``(X_train, y_train, X_test, y_test)``: float64 features standardised with the
    training set's mean and deviation, int64 labels. The same on every rank."""
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    X, y = sk_load_digits(return_X_y=True)
    X_train, X_test, y_train, y_test = train_test_split(
        X, y, test_size=TEST_SIZE, random_state=SPLIT_SEED, stratify=y)
    scaler = StandardScaler().fit(X_train)  # constant (always blank) pixels get scale 1
    return (scaler.transform(X_train), y_train.astype(np.int64),
            scaler.transform(X_test), y_test.astype(np.int64))


def global_batches(n, batch, seed, epoch):
    """Index arrays of this epoch's global batches over ``n`` training samples.

    The permutation depends only on ``(seed, epoch)``, so every rank sees the same
    batches. The last incomplete batch is dropped (as ``drop_last=True``): every step
    then has exactly ``batch`` samples, which is what makes the ranks' shares equal."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return [order[i:i + batch] for i in range(0, n - batch + 1, batch)]


def my_share(batch_indices, rank, size):
    """This rank's contiguous slice of a global batch (``len(batch) // size`` samples)."""
    per_rank = len(batch_indices) // size
    return batch_indices[rank * per_rank:(rank + 1) * per_rank]


def micro_batches(indices, k):
    """``indices`` split into ``k`` equal micro-batches (gradient accumulation)."""
    return np.split(indices, k)


# -- command line --------------------------------------------------------------------
def parser(description, **defaults):
    """The flags both examples take; ``defaults`` overrides some defaults."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    p.add_argument("--batch", type=int, default=120,
                   help="global batch size, over all ranks (must divide by the number of ranks)")
    p.add_argument("--lr", type=float, default=0.5, help="learning rate")
    p.add_argument("--hidden", type=int, default=64, help="hidden units")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the shuffles")
    p.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none",
                   help="send the gradients as float16 or bfloat16 (halves the bytes on the wire; bf16 needs "
                   "ml_dtypes)")
    p.add_argument("--accumulate", type=int, default=1, metavar="K",
                   help="gradient accumulation: K backward passes (micro-batches) per optimizer step")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", metavar="FILE", help="write the final metrics to FILE (rank 0)")
    p.set_defaults(**defaults)
    return p


def check_args(args, size, rank, n_train):
    """Exit (status 2, on every rank, the message printed once) unless the global batch
    fits in the ``n_train`` training samples and splits evenly into ``size`` shares of
    ``--accumulate`` equal micro-batches."""
    problem = None
    if args.epochs < 1 or args.batch < 1 or args.hidden < 1 or args.accumulate < 1:
        problem = "--epochs, --batch, --hidden and --accumulate must be positive"
    elif args.batch > n_train:
        problem = f"--batch {args.batch} is larger than the training set ({n_train} samples)"
    elif args.batch % size:
        problem = (f"--batch {args.batch} does not divide by the number of ranks ({size}): every rank "
                   f"must get an equal share of each global batch (try --batch {args.batch // size * size or size})")
    elif (args.batch // size) % args.accumulate:
        problem = (f"each rank's share of the batch ({args.batch} / {size} = {args.batch // size}) does not "
                   f"split into --accumulate {args.accumulate} equal micro-batches")
    if problem:
        if rank == 0:
            print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)  # every rank sees the same arguments and size, so all of them leave here


# -- evaluation and report -------------------------------------------------------------
def test_accuracy(predict, X, y, comm):
    """Accuracy on the test set, which the ranks share out (rank r takes every size-th
    sample) and whose correct counts are summed with an allreduce. ``predict`` maps a
    float64 feature array to predicted labels."""
    mine = slice(comm.rank, None, comm.size)
    counts = np.array([np.count_nonzero(predict(X[mine]) == y[mine]), len(y[mine])], np.int64)
    correct, total = comm.allreduce(counts, op="sum")
    return correct / total


def mean_over_ranks(local_sum, local_count, comm):
    """``sum / count`` over all ranks (e.g. the epoch's training loss)."""
    total, count = comm.allreduce(np.array([local_sum, local_count], np.float64), op="sum")
    return total / count


class Report:
    """Rank 0's per-epoch lines, progress bar and final JSON; silent on other ranks."""

    def __init__(self, args, comm, script):
        self.args, self.comm, self.script = args, comm, script
        self.loud = comm.rank == 0
        self.losses, self.accuracies = [], []
        self.start = time.perf_counter()

    def epochs(self):
        """``range(epochs)``, wrapped in a tqdm bar on rank 0 (unless ``--no-progress``).
        Not only on a terminal: under mpiexec rank 0's output reaches the terminal
        through a pipe, so ``isatty`` is false there even when a person is watching."""
        epochs = range(1, self.args.epochs + 1)
        if not self.loud or self.args.no_progress:
            return epochs
        from tqdm import tqdm
        return tqdm(epochs, desc="epochs", unit="epoch", leave=False, mininterval=0)

    def epoch(self, epoch, loss, accuracy):
        self.losses.append(float(loss))
        self.accuracies.append(float(accuracy))
        if self.loud:
            from tqdm import tqdm  # tqdm.write keeps the bar below the lines (plain print without one)
            tqdm.write(f"epoch {epoch:3d}  train loss {loss:.4f}  test accuracy {accuracy:.2%}")

    def finish(self):
        """Print the summary and write ``--json``; returns the metrics. The wall time
        is the training's: from this object's creation (after the broadcasts) to now."""
        wall = time.perf_counter() - self.start
        a = self.args
        flags = {k: v for k, v in vars(a).items() if k not in ("json", "no_progress")}
        metrics = {
            "script": self.script, "world_size": self.comm.size, **flags,
            "train_loss": self.losses, "test_accuracy": self.accuracies,
            "final_test_accuracy": self.accuracies[-1], "wall_time_s": round(wall, 3),
        }
        if self.loud:
            print(f"final test accuracy {self.accuracies[-1]:.2%} on {self.comm.size} rank(s), "
                  f"{a.epochs} epochs in {wall:.2f} s")
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(metrics, f, indent=2)
                    f.write("\n")
        return metrics
