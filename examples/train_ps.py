"""Parameter-server training of train_numpy.py's MLP, synchronous or asynchronous.

    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train_ps.py                       # 1 server, 3 workers, sync
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train_ps.py --mode async --max-staleness 2
    .venv/bin/mpiexec -n 6 .venv/bin/python examples/train_ps.py --servers 2 --mode async
    .venv/bin/python examples/train_ps.py --help

The model, data, loss and backward are train_numpy.py's (imported, not copied): a
64 -> --hidden -> 10 MLP on scikit-learn's digits. The first --servers ranks hold the
parameters in shards (collectives.ps.ParameterServer) and apply SGD; the other W ranks
are workers, each taking its share (batch / W) of every global batch, pushing its
gradient and pulling the parameters back.

- ``--mode sync``: a server steps once it has every worker's gradient, with their
  average: the same steps as train_numpy.py with the same --batch (serially or on any
  number of ranks), so the same accuracy.
- ``--mode async``: each gradient is applied as it arrives (divided by W); workers do
  not wait for each other, except that with ``--max-staleness k`` a worker more than k
  steps ahead of the slowest waits. The staleness of the updates is reported.

The first worker prints the loss (mean over the workers) and the test accuracy of its
own current parameters each epoch, and the staleness statistics at the end; ``--json``
writes them (same fields as train_numpy.py's, for same_accuracy.py, plus "ps").
"""

import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import collectives as cc
from collectives.ps import ParameterServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _data.py and train_numpy.py sit next to this file
from train_numpy import backward, init_params, predict  # noqa: E402

import _data  # noqa: E402


def parse_args(size):
    p = _data.parser(__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["sync", "async"], default="sync", help="when the servers apply gradients")
    p.add_argument("--servers", type=int, default=1, metavar="S", help="server ranks (the first S)")
    p.add_argument("--max-staleness", type=int, default=None, metavar="K",
                   help="async: hold a worker more than K steps ahead of the slowest (default: no bound)")
    args = p.parse_args()
    problem = None
    if not 1 <= args.servers < size:
        problem = (f"--servers {args.servers} must leave at least one worker among {size} rank(s): run under "
                   f"mpiexec -n {args.servers + 1} or more")
    elif args.max_staleness is not None and (args.mode != "async" or args.max_staleness < 0):
        problem = "--max-staleness needs --mode async and a non-negative K"
    elif args.compression != "none" or args.accumulate != 1:
        problem = ("--compression and --accumulate are train_numpy.py's; the parameter server sends gradients "
                   "as they are")
    if problem:
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    return args


def main():
    world = MPI.COMM_WORLD
    args = parse_args(world.Get_size())
    X_train, y_train, X_test, y_test = _data.load_digits()
    workers = world.Get_size() - args.servers
    _data.check_args(args, workers, world.Get_rank(), len(y_train))  # the batch is split over the workers

    # Seeded differently on each rank on purpose: the first server's values (rank 0's,
    # a serial train_numpy.py run's) are the starting point everywhere.
    params = init_params(X_train.shape[1], args.hidden, 10, np.random.default_rng(args.seed + world.Get_rank()))
    ps = ParameterServer(params, world, servers=args.servers, mode=args.mode, max_staleness=args.max_staleness,
                         lr=args.lr)
    # The workers' own communicator, for the epoch's loss; the servers are busy serving.
    team = world.Split(0 if ps.is_worker else MPI.UNDEFINED, world.Get_rank())
    if ps.is_server:
        ps.serve()
        ps.close()
        return
    team = cc.Communicator(team)
    index = ps.workers.index(world.Get_rank())
    report = _data.Report(args, team, "train_ps.py")
    report.args = _without_json(args)  # the JSON is written below, with the statistics
    grads = {name: np.zeros_like(p) for name, p in params.items()}
    step_times = []
    for epoch in report.epochs():
        loss_sum, steps = 0.0, 0
        for batch in _data.global_batches(len(y_train), args.batch, args.seed, epoch):
            share = _data.my_share(batch, index, workers)
            start = time.perf_counter()
            for g in grads.values():
                g.fill(0)
            loss_sum += backward(params, X_train[share], y_train[share], 1.0, grads, lambda name, grad: None)
            ps.step(grads)  # this worker's gradient out, the servers' current parameters back
            step_times.append(time.perf_counter() - start)
            steps += 1
        accuracy = np.count_nonzero(predict(params, X_test) == y_test) / len(y_test)  # this worker's parameters
        report.epoch(epoch, _data.mean_over_ranks(loss_sum, steps, team), accuracy)
    stats = ps.close()
    metrics = report.finish()
    metrics.update(world_size=world.Get_size(), workers=workers, ps=stats,
                   step_ms_median=round(1e3 * float(np.median(step_times)), 3))
    if index == 0:
        s = stats["staleness"]
        print(f"{args.mode}, {args.servers} server(s), {workers} worker(s): staleness mean {s['mean']:.2f}, "
              f"max {s['max']}, histogram {dict(sorted(s['histogram'].items()))}; updates per worker "
              f"{stats['updates_per_worker']}; replies held {stats['held']} ({stats['held_s']:.3f} s); "
              f"median step {metrics['step_ms_median']} ms")
        if args.json:
            metrics["ps"]["staleness"]["histogram"] = {str(k): v for k, v in s["histogram"].items()}
            metrics["ps"]["updates_per_worker"] = {str(k): v for k, v in stats["updates_per_worker"].items()}
            with open(args.json, "w") as f:
                json.dump(metrics, f, indent=2)
                f.write("\n")
    team.free()


def _without_json(args):
    quiet = type(args)(**vars(args))
    quiet.json = None
    return quiet


if __name__ == "__main__":
    main()
