"""The parameter server (collectives.ps), serially and under mpiexec.

Synchronous mode is checked against two independent references: NumPy (every rank
computes every worker's gradient itself, sums them in worker order and takes the SGD
step: bit-for-bit the same parameters) and the library's allreduce-based training
(GradientReducer over a communicator of the workers only: within rtol 1e-12, as the
allreduce sums in another order). Asynchronous mode is checked through what is
deterministic whatever the arrival order: a single worker equals serial SGD exactly;
with constant gradients every gradient is applied exactly once; with max_staleness=0
the rounds are lock-step, so the parameters after each pull, the number of held
replies and the staleness histogram are known exactly.

A parameter server needs a server and a worker: at world size 1 construction raises
(tested here); the tests that train skip there and run under mpiexec -n 2..8.
"""

import time

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc
from collectives.ps import SGD, ParameterServer, ParameterServerError
from collectives.training import GradientReducer

from conftest import GLOBAL_BATCH, agree
from numpy_model import backward, data, init_params

STEPS = 3
LR = 0.5
needs_two = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2,
                               reason="a parameter server needs a server and a worker (world size 1 raises: "
                                      "test_world_of_one_rank_has_no_worker)")


def worker_shard(x, y, index, workers):
    """Worker ``index``'s contiguous share of a global batch split over ``workers``."""
    share = GLOBAL_BATCH // workers
    assert share * workers == GLOBAL_BATCH, "unequal shares would weight samples unequally"
    return x[index * share:(index + 1) * share], y[index * share:(index + 1) * share]


def numpy_sync_reference(steps_of, momentum=0.0):
    """Parameters after each step of synchronous SGD computed in NumPy alone: at step t
    the workers still running (``steps_of[i] > t``) each compute the gradient on their
    share, the gradients are summed in worker order and divided by their number."""
    params = init_params(0)
    velocity = {n: np.zeros_like(a) for n, a in params.items()}
    history = []
    for t in range(max(steps_of)):
        x, y = data(t)
        grads = [dict(backward(params, *worker_shard(x, y, i, len(steps_of))))
                 for i in range(len(steps_of)) if steps_of[i] > t]
        for name in params:
            avg = grads[0][name].copy()
            for g in grads[1:]:
                avg += g[name]
            avg /= len(grads)
            if momentum:
                velocity[name] *= momentum
                velocity[name] += avg
                avg = velocity[name]
            params[name] -= LR * avg
        history.append({n: a.copy() for n, a in params.items()})
    return history


def flat(params):
    return np.concatenate([a.reshape(-1) for a in params.values()])


def server_choices(size):
    """(label, servers) pairs for this world size: the first rank, all but one, the last
    rank, and ranks that are neither first nor contiguous."""
    choices = [("first", 1), ("all_but_one", size - 1), ("last", [size - 1])]
    if size >= 4:
        choices.append(("scattered", [1, 3]))
    return choices


# -- synchronous mode --------------------------------------------------------------------
@needs_two
@pytest.mark.parametrize("which", ["first", "all_but_one", "last", "scattered"])
@pytest.mark.parametrize("comm_kind", ["communicator", "mpi"])
def test_sync_equals_numpy_and_allreduce_training(comm, which, comm_kind):
    servers = dict(server_choices(comm.size)).get(which)
    if servers is None:
        pytest.skip(f"{which!r} servers need 4 ranks")
    server_ranks = list(range(servers)) if isinstance(servers, int) else servers
    worker_ranks = [r for r in range(comm.size) if r not in server_ranks]
    workers = len(worker_ranks)
    want = numpy_sync_reference([STEPS] * workers)
    is_worker = comm.rank in worker_ranks

    # The library's allreduce training over the workers alone (the servers sit it out).
    sub = MPI.COMM_WORLD.Split(0 if is_worker else 1, comm.rank)
    allreduce_params = None
    if is_worker:
        sub_comm = cc.Communicator(sub)
        allreduce_params = init_params(0)
        with GradientReducer(allreduce_params, sub_comm) as reducer:
            for t in range(STEPS):
                x, y = worker_shard(*data(t), worker_ranks.index(comm.rank), workers)
                for name, g in backward(allreduce_params, x, y):
                    reducer.gradient_ready(name, g)
                for name, g in reducer.synchronize().items():
                    allreduce_params[name] -= LR * g
        sub_comm.free()
    sub.Free()

    params = init_params(comm.rank + 1)  # differs per rank: the first server's values win at construction
    if comm.rank == server_ranks[0]:
        params = init_params(0)
    problems = []
    ps = ParameterServer(params, comm if comm_kind == "communicator" else MPI.COMM_WORLD, servers=servers,
                         lr=LR)
    if ps.is_worker:
        for t in range(STEPS):
            x, y = worker_shard(*data(t), ps.workers.index(comm.rank), workers)
            ps.step(dict(backward(params, x, y)))
            if not all(np.array_equal(params[n], want[t][n]) for n in params):
                problems.append(f"step {t}: differs from NumPy's synchronous SGD")
        if not all(np.allclose(params[n], allreduce_params[n], rtol=1e-12, atol=1e-12) for n in params):
            problems.append("differs from allreduce training (GradientReducer) beyond rtol 1e-12")
    else:
        ps.serve()
        i = ps.servers.index(comm.rank)
        if not np.array_equal(ps.shard, flat(want[-1])[ps.bounds[i]:ps.bounds[i + 1]]):
            problems.append("the server's shard differs from NumPy's final parameters")
    stats = ps.close()
    if stats["versions"] != [STEPS] * len(ps.servers) or stats["staleness"]["histogram"] != {0: STEPS * workers
                                                                                             * len(ps.servers)}:
        problems.append(f"sync statistics wrong: {stats}")
    agree(MPI.COMM_WORLD, problems)


@needs_two
def test_sync_with_momentum_and_workers_stopping_early(comm):
    """Workers stop after different numbers of steps: a step averages the workers still
    running, and nobody is left waiting."""
    servers = 1
    workers = comm.size - servers
    steps_of = [STEPS + (i % 3) for i in range(workers)]
    want = numpy_sync_reference(steps_of, momentum=0.9)
    params = init_params(0)
    problems = []
    with ParameterServer(params, comm, servers=servers, update=SGD(LR, momentum=0.9)) as ps:
        if ps.is_worker:
            index = ps.workers.index(comm.rank)
            for t in range(steps_of[index]):
                x, y = worker_shard(*data(t), index, workers)
                ps.step(dict(backward(params, x, y)))
                if not all(np.array_equal(params[n], want[t][n]) for n in params):
                    problems.append(f"step {t}: differs from NumPy's synchronous SGD with momentum")
        else:
            ps.serve()
            if not np.array_equal(ps.shard, flat(want[-1])[ps.bounds[0]:ps.bounds[1]]):
                problems.append("the server's final shard differs from NumPy's")
    stats = ps.close()  # again: returns the same statistics
    if stats["updates_per_worker"] != dict(zip(ps.workers, steps_of)) or stats["versions"] != [max(steps_of)]:
        problems.append(f"statistics wrong: {stats}")
    agree(MPI.COMM_WORLD, problems)


# -- asynchronous mode -------------------------------------------------------------------
@needs_two
@pytest.mark.parametrize("max_staleness", [None, 0])
def test_async_with_one_worker_equals_serial_sgd(comm, max_staleness):
    want = numpy_sync_reference([STEPS])
    params = init_params(0)
    problems = []
    ps = ParameterServer(params, comm, servers=comm.size - 1, mode="async", max_staleness=max_staleness, lr=LR)
    if ps.is_worker:
        for t in range(STEPS):
            ps.step(dict(backward(params, *data(t))))
            if not all(np.array_equal(params[n], want[t][n]) for n in params):
                problems.append(f"step {t}: differs from serial SGD")
    stats = ps.close()
    if stats["staleness"]["max"] != 0 or stats["held"] != 0:
        problems.append(f"one worker is never stale nor held: {stats}")
    agree(MPI.COMM_WORLD, problems)


def constant_gradient(params, index, workers):
    """Worker ``index``'s gradient: ``workers * (index + 1)`` everywhere (integers, so
    every sum is exact, and scaled by 1/workers the server applies ``index + 1``)."""
    return {n: np.full_like(a, workers * (index + 1)) for n, a in params.items()}


@needs_two
@pytest.mark.parametrize("max_staleness", [None, 0, 2])
@pytest.mark.parametrize("servers", [1, 2])
def test_async_applies_every_gradient_once(comm, max_staleness, servers):
    """Whatever order the gradients arrive in, the final parameters are the start minus
    every gradient applied once, and nobody waits forever although the workers stop
    after different numbers of steps."""
    if servers >= comm.size:
        pytest.skip(f"{servers} servers need {servers + 1} ranks")
    workers = comm.size - servers
    steps_of = [2 + 3 * i for i in range(workers)]  # unequal: the slow ones finish first
    params = {"w": np.zeros((5, 3)), "b": np.zeros(7)}
    problems = []
    with ParameterServer(params, comm, servers=servers, mode="async", max_staleness=max_staleness, lr=1.0) as ps:
        if ps.is_worker:
            index = ps.workers.index(comm.rank)
            for _ in range(steps_of[index]):
                ps.step(constant_gradient(params, index, workers))
        else:
            ps.serve()
            total = sum(steps * (i + 1) for i, steps in enumerate(steps_of))
            if not np.allclose(ps.shard, -total, rtol=1e-12):
                problems.append(f"server shard {ps.shard} is not -{total}: a gradient was lost or applied twice")
    stats = ps.close()
    histogram = stats["staleness"]["histogram"]
    if stats["updates_per_worker"] != dict(zip(ps.workers, steps_of)):
        problems.append(f"updates per worker {stats['updates_per_worker']}, pushed {steps_of}")
    if stats["versions"] != [sum(steps_of)] * servers or sum(histogram.values()) != sum(steps_of) * servers:
        problems.append(f"versions or histogram do not count every update: {stats}")
    agree(MPI.COMM_WORLD, problems)


@needs_two
def test_async_max_staleness_zero_is_lock_step(comm):
    """With max_staleness=0 no worker starts round n+1 before every worker has pushed
    round n: after the n-th pull a worker sees exactly n rounds of every worker's
    gradient; in each round the first W-1 gradients a server takes are held, and the
    j-th has staleness j."""
    servers = 2 if comm.size >= 3 else 1
    workers = comm.size - servers
    params = {"w": np.zeros((4, 4)), "b": np.zeros(3)}
    per_round = sum(range(1, workers + 1))  # each worker's gradient / W, summed
    problems = []
    with ParameterServer(params, comm, servers=servers, mode="async", max_staleness=0, lr=1.0) as ps:
        if ps.is_worker:
            index = ps.workers.index(comm.rank)
            for n in range(1, STEPS + 1):
                ps.step(constant_gradient(params, index, workers))
                if not all(np.allclose(a, -n * per_round, rtol=1e-12) for a in params.values()):
                    problems.append(f"after pull {n}: {params['b'][0]}, want {-n * per_round}")
        else:
            ps.serve()
    stats = ps.close()
    want_held = servers * (workers - 1) * STEPS
    want_histogram = {j: servers * STEPS for j in range(workers)}
    if stats["held"] != want_held or stats["staleness"]["histogram"] != want_histogram:
        problems.append(f"held {stats['held']} (want {want_held}), histogram {stats['staleness']['histogram']} "
                        f"(want {want_histogram})")
    if stats["staleness"]["max"] != workers - 1:
        problems.append(f"max staleness {stats['staleness']['max']}, want {workers - 1}")
    agree(MPI.COMM_WORLD, problems)


@needs_two
def test_a_worker_that_raises_still_releases_the_servers(comm):
    params = init_params(0)
    outcome = []
    try:
        with ParameterServer(params, comm, mode="async", max_staleness=0) as ps:
            if ps.is_worker:
                ps.push(dict(backward(params, *data(0))))  # left in flight: finish() collects the reply
                raise KeyError("the worker's own bug")
            ps.serve()
            outcome.append("served")
    except KeyError:
        outcome.append("raised")
    want = "raised" if comm.rank not in ps.servers else "served"
    agree(MPI.COMM_WORLD, [] if outcome == [want] else [f"{outcome}, want {want}"])


@needs_two
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_absent_worker_times_out_instead_of_hanging(comm, mode):
    """The last rank (a worker) never pushes: in sync mode the servers wait for its
    gradient and the other workers for their replies; every waiting rank raises
    CollectiveTimeoutError naming whom it did not hear from. (In async mode only the
    servers' wait for the next message can time out: the present workers get replies.)"""
    params = init_params(0)
    ps = ParameterServer(params, comm, mode=mode, timeout=1.0)
    absent = comm.size - 1
    problems, outcome = [], "absent"
    if comm.rank == absent:
        time.sleep(2.5)
    else:
        try:
            if ps.is_server:
                ps.serve()
            else:
                ps.step(dict(backward(params, *data(0))))
                if mode == "async":  # answered at once; done, so only the absent worker is missing
                    ps.finish()
                    outcome = "stepped"
            if outcome != "stepped":
                problems.append("returned instead of timing out")
        except cc.CollectiveTimeoutError as exc:
            outcome, text = "timed out", str(exc)
            if ps.is_server and f"waiting for workers (rank {absent} not heard from)" not in text:
                problems.append(f"the server's message does not name rank {absent} alone: {text}")
            if ps.is_worker and "waiting for servers" not in text:
                problems.append(f"the worker's message does not name the servers: {text}")
        if ps.is_server and outcome != "timed out":
            problems.append(f"server: {outcome}")
    agree(MPI.COMM_WORLD, problems)


@needs_two
def test_a_failing_server_makes_the_workers_time_out_not_hang(comm):
    """The update rule raises on the server: the server's with-block re-raises it, the
    workers' pull() times out naming the server, and nobody waits in close()."""
    def broken_update(param, grad):
        raise FloatingPointError("the update rule's own bug")

    params = init_params(0)
    start, outcome = time.monotonic(), None
    try:
        with ParameterServer(params, comm, update=broken_update, timeout=1.0) as ps:
            if ps.is_server:
                ps.serve()
            else:
                for t in range(3):
                    ps.step(dict(backward(params, *data(t))))
    except FloatingPointError:
        outcome = "update failed"
    except cc.CollectiveTimeoutError as exc:
        outcome = "timed out" if "waiting for servers (rank 0 not heard from)" in str(exc) else str(exc)
    took = time.monotonic() - start
    want = "update failed" if ps.is_server else "timed out"
    problems = [] if outcome == want else [f"{outcome!r}, want {want!r}"]
    if took > 5:
        problems.append(f"took {took:.1f} s")
    if ps.is_worker:
        with pytest.raises(ParameterServerError, match="after a timeout ended this parameter server"):
            ps.pull()
    agree(MPI.COMM_WORLD, problems)


# -- errors --------------------------------------------------------------------------------
def test_world_of_one_rank_has_no_worker(comm):
    """servers covering every rank (at world size 1: the default servers=1) leaves no
    worker: ValueError before any message, on every rank."""
    with pytest.raises(ValueError, match="at least one rank must be a worker"):
        ParameterServer(init_params(0), comm, servers=comm.size)
    if comm.size == 1:
        with pytest.raises(ValueError, match="needs at least 2 ranks"):
            ParameterServer(init_params(0), comm)
    with pytest.raises(ValueError, match="leaving at least one worker"):
        ParameterServer(init_params(0), comm, servers=list(range(comm.size)))


def test_bad_arguments(comm):
    p = init_params(0)
    size = comm.size
    cases = [
        (ValueError, "servers must be between", dict(servers=0)),
        (TypeError, "servers must be a number", dict(servers="0")),
        (ValueError, "distinct ranks", dict(servers=[size, size])),
        (ValueError, "mode must be one of", dict(mode="hogwild")),
        (ValueError, "needs mode='async'", dict(max_staleness=1)),
        (ValueError, "non-negative integer", dict(mode="async", max_staleness=-1)),
        (TypeError, "update must be a callable", dict(update=0.1)),
        (ValueError, "lr must be a non-negative", dict(lr=-1)),
        (TypeError, "must be a collectives.Communicator", dict(comm="world")),
    ]
    for error, match, kwargs in cases:
        kw = dict(kwargs)
        target = kw.pop("comm", comm)
        with pytest.raises(error, match=match):
            ParameterServer(p, target, **kw)
    with pytest.raises(TypeError, match="share one dtype"):
        ParameterServer({"a": np.zeros(3), "b": np.zeros(3, np.float32)}, comm)
    with pytest.raises(TypeError, match="must be floating"):
        ParameterServer({"a": np.zeros(3, np.int64)}, comm)
    with pytest.raises(ValueError, match="writable"):
        ro = np.zeros(3)
        ro.flags.writeable = False
        ParameterServer({"a": ro}, comm)
    with pytest.raises(ValueError, match="empty"):
        ParameterServer({}, comm)
    if size >= 3:  # 1 element cannot be cut into 2 shards
        with pytest.raises(ValueError, match="too few for 2 servers"):
            ParameterServer({"a": np.zeros(1)}, comm, servers=2)
    # nothing was sent: the next collective call still matches on every rank
    agree(MPI.COMM_WORLD, [])


@needs_two
def test_layout_or_settings_mismatch_raises_on_every_rank(comm):
    shape = (3,) if comm.rank != 1 else (4,)
    with pytest.raises(ValueError, match=r"rank\(s\) 1 passed other settings or parameter layout") as e:
        ParameterServer({"a": np.zeros(shape)}, comm)
    if comm.rank == 1:
        assert "Here (rank 1): layout" in str(e.value)
    mode = "async" if comm.rank == comm.size - 1 else "sync"
    with pytest.raises(ValueError, match=rf"rank\(s\) {comm.size - 1} passed other settings"):
        ParameterServer({"a": np.zeros(3)}, comm, mode=mode)


@needs_two
def test_protocol_misuse_names_the_rank(comm):
    params = {"a": np.zeros((2, 3)), "b": np.zeros(4)}
    problems = []
    with ParameterServer(params, comm) as ps:
        if ps.is_worker:
            with pytest.raises(ParameterServerError, match=rf"rank {comm.rank}: pull\(\) without a push"):
                ps.pull()
            with pytest.raises(ParameterServerError, match=rf"rank {comm.rank} is a worker"):
                ps.serve()
            with pytest.raises(ValueError, match=r"grads\['a'\] must be an array of shape \(2, 3\)"):
                ps.push({"a": np.zeros(6), "b": np.zeros(4)})
            with pytest.raises(ValueError, match="missing"):
                ps.push({"a": np.zeros((2, 3))})
            ps.push({"a": np.ones((2, 3)), "b": np.ones(4)})  # the failed pushes sent nothing
            with pytest.raises(ParameterServerError, match="push\\(\\) twice without pull"):
                ps.push({"a": np.ones((2, 3)), "b": np.ones(4)})
            ps.pull()
            if not np.allclose(params["a"], -0.01):
                problems.append(f"after one step {params['a']}")
            ps.finish()
            with pytest.raises(ParameterServerError, match="after finish"):
                ps.push({"a": np.ones((2, 3)), "b": np.ones(4)})
        else:
            with pytest.raises(ParameterServerError, match=rf"rank {comm.rank} is a server"):
                ps.push({"a": np.ones((2, 3)), "b": np.ones(4)})
            ps.serve()
            with pytest.raises(ParameterServerError, match="already ran"):
                ps.serve()
    agree(MPI.COMM_WORLD, problems)
