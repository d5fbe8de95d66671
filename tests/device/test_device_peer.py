"""The peer-read algorithms (``one_shot``, ``two_shot``) on device arrays, through the
stand-in GPU at every world size the MPI suite runs (``--device cuda``: on a GPU,
``make test-gpu``), with each fence mechanism (``host``: epochs the hosts watch in the
node's shared window; ``stream``: stream write/wait values; ``kernel``: the fence
kernel of ranks on distinct GPUs, at the second fence).

Every result is compared, bit for bit, with the host path on the same inputs (MPI's
collective on host arrays), with the same plans run in one process
(``transport.local``, the host executor of the very same schedules) and with NumPy;
the deterministic mode with the serial fold. The stand-in runs queued work only when
something waits for it, in a random order across streams, and fills new memory with
garbage, so a missing synchronisation gives wrong data here, not a rare race: the
mutation tests at the end take each synchronisation of the new path out in turn and
show a test failing for every one.
"""

import functools
import gc
import json
import re
import time
from collections import Counter

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc
from collectives.algorithms import PEER_READS, block_bounds
from collectives.auto import device_model
from collectives.device import as_device_array, bfloat16
from collectives.transport import device_node, local, peer_fences, peer_memory, peer_phases

from conftest import (
    ALL_DTYPES,
    agree,
    counts_for,
    expected_result,
    ops_for,
    order_sensitive_input,
    rank_input,
    serial_fold,
)
from device_under_test import select

D = None  # the device under test: the stand-in, or a GPU with --device cuda
MECHANISMS = ["host", "stream", "kernel"]
PEERS = sorted(PEER_READS)
REDUCING = ("allreduce", "reduce_scatter", "reduce")


@pytest.fixture(scope="module", autouse=True)
def device_under_test(request):
    global D
    D = select(request.config.getoption("--device"), MPI.COMM_WORLD.Get_rank())
    yield D


def stand_in_only(what):
    if D.name != "standin":
        pytest.skip(f"{what}: a property of the stand-in itself")


def communicator(mechanism, **options):
    """A communicator whose peer-read fences are ``mechanism``'s, its device paths agreed.
    The fence kernel is for ranks with a GPU each: on a GPU the ranks share, a kernel
    spinning on a flag holds the others off for its whole time slice (it still works,
    slowly), so there it is left to the stand-in and to test_gpu.py's one-process test."""
    if mechanism == "kernel" and D.name == "cuda" and MPI.COMM_WORLD.Get_size() > D.cupy.cuda.runtime.getDeviceCount():
        pytest.skip("the fence kernel on a GPU the ranks share: test_gpu.py tests it in one process")
    comm = cc.Communicator(device_fence=mechanism, **options)
    comm.allreduce(D.asarray(np.ones(1, np.float32)), algorithm="direct")  # the negotiation
    return comm


_COMMS = {}


@pytest.fixture(scope="module", autouse=True)
def _free_communicators():
    yield
    for comm in _COMMS.values():
        comm.free()
    _COMMS.clear()


@pytest.fixture(params=MECHANISMS)
def pcomm(request, device_under_test):
    """A communicator for each fence mechanism, made once per module."""
    if request.param not in _COMMS:
        _COMMS[request.param] = communicator(request.param)
    return _COMMS[request.param]


def call(comm, collective, x, algorithm, op="sum", root=0, out=None, asynchronous=False, **kw):
    run = getattr(comm, collective + ("_async" if asynchronous else ""))
    if collective in ("allreduce", "reduce_scatter"):
        return run(x, op=op, algorithm=algorithm, out=out, **kw)
    if collective == "allgather":
        return run(x, algorithm=algorithm, out=out, **kw)
    if collective == "broadcast":
        return run(x, root=root, algorithm=algorithm, **kw)
    return run(x, root=root, op=op, algorithm=algorithm, out=out, **kw)


def host_of(x):
    if x is None:
        return None
    return D.asnumpy(x.data).view(np.uint16) if isinstance(x, bfloat16) else D.asnumpy(x)


def differs(want, got):
    """How ``got`` differs from ``want`` bit for bit (None if it does not)."""
    if want is None or got is None:
        return None if want is None and got is None else f"one is None: want {want}, got {got}"
    want, got = np.asarray(want), np.asarray(got)
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    if got.tobytes() != want.tobytes():
        return f"{got.ravel()[:4]} vs {want.ravel()[:4]}"
    return None


def in_one_process(collective, algorithm, xs, op, root):
    """The same plans run for every rank in this process (the in-process runner)."""
    return local.run_collective(collective, algorithm, [np.ascontiguousarray(x).reshape(-1).copy() for x in xs], op,
                                root)


# -- results ------------------------------------------------------------------------------------
@pytest.mark.parametrize("collective,algorithm", PEERS)
def test_every_peer_read_equals_the_host_path_the_same_plans_and_numpy(pcomm, mpi_comm, collective, algorithm):
    comm, problems = pcomm, []
    roots = sorted({0, comm.size - 1}) if collective in ("broadcast", "reduce") else [0]
    for count in counts_for(comm.size, large=False) + [1000]:
        for root in roots:
            xs = [rank_input(r, count, "float32") for r in range(comm.size)]
            x = xs[comm.rank].copy()
            host = call(comm, collective, x.copy(), "native", root=root)  # MPI's collective on host arrays
            device_x = D.asarray(x)
            got = host_of(call(comm, collective, device_x, algorithm, root=root))
            same_plans = in_one_process(collective, algorithm, xs, "sum", root)[comm.rank]
            numpy = expected_result(collective, comm.rank, comm.size, xs, "sum", root)
            label = f"{collective}/{algorithm} n={count} root={root}"
            for what, want in (("host path", host), ("same plans", same_plans), ("numpy", numpy)):
                if want is not None and got is not None:
                    want = np.asarray(want).reshape(got.shape)
                problem = differs(want, got)
                if problem:
                    problems.append(f"{label}: {what}: {problem}")
            if collective != "broadcast" and D.asnumpy(device_x).tobytes() != x.tobytes():
                problems.append(f"{label}: the input was modified")
    agree(mpi_comm, problems)


@pytest.mark.long
@pytest.mark.parametrize("collective,algorithm", [ca for ca in PEERS if ca[0] in REDUCING])
def test_every_dtype_and_op_is_the_same_plans_bits(mpi_comm, collective, algorithm):
    """Once, with host fences: the mechanisms move no data; dtypes matter to the kernels."""
    comm = _COMMS.setdefault("host", communicator("host"))
    problems = []
    for dtype in ALL_DTYPES:
        for op in ops_for(dtype):
            xs = [rank_input(r, 37, dtype, op) for r in range(comm.size)]
            got = call(comm, collective, D.asarray(xs[comm.rank]), algorithm, op, comm.size - 1)
            want = in_one_process(collective, algorithm, xs, op, comm.size - 1)[comm.rank]
            problem = differs(want, host_of(got))
            if problem:
                problems.append(f"{collective}/{algorithm} {dtype} {op}: {problem}")
    agree(mpi_comm, problems)


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot", "leader"])
def test_allreduce_in_place_into_out_strided_and_overlapping(pcomm, mpi_comm, algorithm):
    comm, problems = pcomm, []
    xs = [(rank_input(r, 6 * 7, "int32") + len(algorithm)).reshape(6, 7) for r in range(comm.size)]
    want = comm.allreduce(xs[comm.rank], algorithm="native")
    x = D.asarray(xs[comm.rank])
    if comm.allreduce(x, algorithm=algorithm, out=x) is not x or differs(want, D.asnumpy(x)):
        problems.append("in place")
    out = D.empty((6, 7), np.int32)
    if comm.allreduce(D.asarray(xs[comm.rank]), algorithm=algorithm, out=out) is not out or \
            differs(want, D.asnumpy(out)):
        problems.append("out=")
    wide = D.asarray(np.repeat(xs[comm.rank], 2, axis=1))
    canvas = D.asarray(np.full((6, 14), -1, np.int32))
    got = comm.allreduce(wide[:, ::2], algorithm=algorithm, out=canvas[:, 1::2])
    host = D.asnumpy(canvas)
    if differs(want, np.ascontiguousarray(host[:, 1::2])) or (host[:, ::2] != -1).any() or got.shape != (6, 7):
        problems.append(f"strided in and out: {host[0]}")
    view = D.asarray(np.repeat(xs[comm.rank], 2, axis=0))[::2]
    comm.allreduce(view, algorithm=algorithm, out=view)
    if differs(want, D.asnumpy(view)):
        problems.append("in place, strided")
    both = D.asarray(np.concatenate([xs[comm.rank].ravel(), np.zeros(3, np.int32)]))
    comm.allreduce(both[:42], algorithm=algorithm, out=both[3:45])
    if differs(want.ravel(), D.asnumpy(both)[3:45]):
        problems.append("out overlapping x")
    avg = comm.allreduce(D.asarray(xs[comm.rank].astype(np.float64)), op="avg", algorithm=algorithm)
    if differs(comm.allreduce(xs[comm.rank].astype(np.float64), op="avg", algorithm="native"), D.asnumpy(avg)):
        problems.append("avg")
    agree(mpi_comm, problems)


def test_reduce_in_place_on_every_root(pcomm, mpi_comm):
    comm, problems = pcomm, []
    xs = [rank_input(r, 29, "float64") for r in range(comm.size)]
    for root in range(comm.size):
        x = D.asarray(xs[comm.rank])
        got = comm.reduce(x, root=root, algorithm="one_shot", out=x if comm.rank == root else None)
        if comm.rank == root and (got is not x or differs(sum(xs), D.asnumpy(x))):
            problems.append(f"root {root}")
        if comm.rank != root and (got is not None or differs(xs[comm.rank], D.asnumpy(x))):
            problems.append(f"root {root}: a non-root's input changed or got a result")
    agree(mpi_comm, problems)


def test_the_other_peer_reads_take_strided_out_overlapping_and_in_place_arrays(pcomm, mpi_comm):
    """reduce_scatter, allgather, broadcast and reduce (``one_shot``) on strided inputs,
    into strided ``out=`` arrays (the elements between them untouched), into ``out=``
    arrays that overlap the input, and in place where the collective is (broadcast
    always; reduce at the root with ``out=x``), every root of broadcast and reduce."""
    comm, problems = pcomm, []
    size, rank, n = pcomm.size, pcomm.rank, 6 * pcomm.size
    xs = [rank_input(r, n, "int32") + 1 for r in range(size)]  # never -1: the canvas shows through
    mine = xs[rank]

    def interleaved(v):
        """A device array holding ``v`` at the even places and -1 at the odd ones."""
        return D.asarray(np.stack([v, np.full_like(v, -1)], axis=-1).reshape(*v.shape[:-1], -1))

    def check(what, want, canvas, picked, got=None, returned=None):
        host = D.asnumpy(canvas)
        inside, outside = host[..., picked::2], host[..., 1 - picked::2]
        if differs(np.asarray(want), np.ascontiguousarray(inside)) or (outside != -1).any():
            problems.append(f"{what}: {host.ravel()[:8]}")
        if returned is not None and got is not returned:
            problems.append(f"{what}: did not return out=")

    want = expected_result("reduce_scatter", rank, size, xs)
    canvas = D.asarray(np.full(2 * want.size, -1, np.int32))
    got = comm.reduce_scatter(interleaved(mine)[::2], algorithm="one_shot", out=canvas[1::2])
    check("reduce_scatter, strided in and out", want, canvas, 1)
    both = D.asarray(np.concatenate([mine, np.zeros(3, np.int32)]))
    comm.reduce_scatter(both[:n], algorithm="one_shot", out=both[2 : 2 + want.size])
    if differs(want, D.asnumpy(both)[2 : 2 + want.size]):
        problems.append("reduce_scatter, out overlapping x")

    want = expected_result("allgather", rank, size, xs)
    canvas = D.asarray(np.full((size, 2 * n), -1, np.int32))
    out = canvas[:, 1::2]
    got = comm.allgather(interleaved(mine)[::2], algorithm="one_shot", out=out)
    check("allgather, strided in and out", want, canvas, 1, got, out)
    both = D.asarray(np.concatenate([mine, np.zeros(size * n, np.int32)]))
    comm.allgather(both[:n], algorithm="one_shot", out=both[3 : 3 + size * n].reshape(size, n))
    if differs(want.ravel(), D.asnumpy(both)[3 : 3 + size * n]):
        problems.append("allgather, out overlapping x")

    for root in range(size):
        canvas = interleaved(mine)
        got = comm.broadcast(canvas[::2], root=root, algorithm="one_shot")
        check(f"broadcast from {root}, strided, in place", xs[root], canvas, 0)
        want = expected_result("reduce", rank, size, xs, root=root)
        canvas = D.asarray(np.full(2 * n, -1, np.int32))
        out = canvas[1::2] if rank == root else None
        got = comm.reduce(interleaved(mine)[::2], root=root, algorithm="one_shot", out=out)
        if rank == root:
            check(f"reduce to {root}, strided in and out", want, canvas, 1, got, out)
        elif got is not None:
            problems.append(f"reduce to {root}: a result on a non-root")
        canvas = interleaved(mine)
        got = comm.reduce(canvas[::2], root=root, algorithm="one_shot", out=canvas[::2] if rank == root else None)
        check(f"reduce to {root}, strided, in place", want if rank == root else mine, canvas, 0)
    agree(mpi_comm, problems)


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_deterministic_mode_is_the_serial_fold(mpi_comm, mechanism):
    """One left fold in rank order on every rank, 16-bit floats included (each step
    rounds), in place too; auto keeps to the peer reads, which all fold so."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    comm = communicator(mechanism, deterministic=True)
    size, rank, problems = comm.size, comm.rank, []
    for dtype in ("float32", "float16", ml_dtypes.bfloat16):
        for op in ("sum", "max"):
            inputs = [order_sensitive_input(r, 3000, dtype, op) for r in range(size)]
            want = serial_fold(op, inputs)
            bounds = block_bounds(want.size, size)

            def device(x):
                if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16) and not D.native_bfloat16:
                    return bfloat16(D.asarray(x.view(np.uint16)))
                return D.asarray(x)

            def host(y):
                return None if y is None else host_of(y).view(want.dtype)

            got = {f"allreduce {a}": host(comm.allreduce(device(inputs[rank]), op=op, algorithm=a))
                   for a in ("one_shot", "two_shot", "auto")}
            got["reduce_scatter"] = host(comm.reduce_scatter(device(inputs[rank]), op=op, algorithm="one_shot"))
            got["reduce"] = host(comm.reduce(device(inputs[rank]), root=size - 1, op=op, algorithm="one_shot"))
            x = device(inputs[rank])
            comm.allreduce(x, op=op, out=x, algorithm="one_shot")
            got["in place"] = host(x)
            for what, value in got.items():
                expect = want[bounds[rank]:bounds[rank + 1]] if what == "reduce_scatter" else \
                    (None if what == "reduce" and rank != size - 1 else want)
                if differs(expect, value):
                    problems.append(f"{what} {np.dtype(dtype).name} {op}")
    comm.free()
    agree(mpi_comm, problems)


def test_the_users_stream_order(pcomm, mpi_comm):
    """The input is written by work queued on the user's own stream (not run yet), the
    result read through it; and several calls in flight at once, async, among calls of
    other routes."""
    comm, problems = pcomm, []
    mine = D.new_stream()
    with D.use_stream(mine):
        for algorithm in ("one_shot", "two_shot"):
            x = D.empty(1001, np.float64)
            values = rank_input(comm.rank, 1001, "float64")
            D.copy_async(x, values, mine)
            got = comm.allreduce(x, algorithm=algorithm)
            if differs(comm.allreduce(values, algorithm="native"), D.asnumpy(got, stream=mine)):
                problems.append(algorithm)
            handle = comm.allreduce_async(x, op="max", algorithm=algorithm)
            if differs(comm.allreduce(values, op="max", algorithm="native"), D.asnumpy(handle.wait(), stream=mine)):
                problems.append(f"{algorithm} async")
        xs = [rank_input(r, 501, "float32") for r in range(comm.size)]
        x = D.asarray(xs[comm.rank], stream=mine)
        handles = [comm.allreduce_async(x, algorithm=a) for a in ("one_shot", "ring", "two_shot", "direct")]
        handles += [comm.allgather_async(x[:7], algorithm="one_shot"),
                    comm.reduce_scatter_async(x, algorithm="one_shot")]
        results = [h.wait() for h in reversed(handles)][::-1]
        total = sum(xs)
        for k, result in enumerate(results[:4]):
            if differs(total, D.asnumpy(result, stream=mine)):
                problems.append(f"in flight: allreduce {k}")
        if differs(np.stack([v[:7] for v in xs]), D.asnumpy(results[4], stream=mine)):
            problems.append("in flight: allgather")
        if differs(np.array_split(total, comm.size)[comm.rank], D.asnumpy(results[5], stream=mine)):
            problems.append("in flight: reduce_scatter")
    agree(mpi_comm, problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_peer_reads_in_flight_among_calls_of_the_other_routes(mpi_comm, mechanism):
    """Rounds of async calls of every device route at once (ring, direct and the peer
    reads, on strided inputs: packed into workspace, which they hand on to each other),
    each right. Were the peer calls to run on the stream the other routes' calls share,
    their waits for the other ranks there (stream and kernel fences) would hold up work
    of an earlier ring call that another rank had queued before them, which that rank's
    peer call waits for: a deadlock across ranks (at 3 ranks and more, within a few
    rounds). The calls' timeout makes that fail here instead of hanging."""
    comm, problems = communicator(mechanism), []
    user = D.new_stream()
    with D.use_stream(user):
        for k in range(40):
            n = 1000 + 7 * k
            xs = [rank_input(r, 2 * n, "float32") + k for r in range(comm.size)]
            total = sum(x[::2] for x in xs)
            handles = []
            try:
                for algorithm in ("ring", "one_shot", "direct", "two_shot", "ring", "one_shot"):
                    x = D.asarray(xs[comm.rank], stream=user)[::2]
                    handles.append((algorithm, comm.allreduce_async(x, algorithm=algorithm, timeout=20)))
                y = D.asarray(xs[comm.rank], stream=user)[::2]
                handles.append(("one_shot in place", comm.allreduce_async(y, out=y, algorithm="one_shot", timeout=20)))
                for algorithm, handle in handles:
                    if differs(total, D.asnumpy(handle.wait(), stream=user)):
                        problems.append(f"round {k}: {algorithm}")
            except cc.CollectiveError as exc:
                problems.append(f"round {k}: {type(exc).__name__}: {exc}"[:300])
            if mpi_comm.allreduce(len(problems)):
                break
    if not problems:
        comm.free()  # (a broken one is left unfreed: see test_mismatched_calls_raise_on_every_rank)
    agree(mpi_comm, problems)


# -- registration, and what a warm call costs -----------------------------------------------------
class Counting:
    """An MPI communicator that counts the calls made on it (a proxy)."""

    def __init__(self, comm):
        self.comm, self.calls = comm, 0

    def __getattr__(self, name):
        attribute = getattr(self.comm, name)
        if callable(attribute):
            def counted(*args, **kwargs):
                self.calls += 1
                return attribute(*args, **kwargs)
            return counted
        return attribute


def _peer_state(comm):
    device = next(iter(comm._ctx.devices.values()))
    return device.peer, peer_memory.peer_memory(device.backend)


@pytest.mark.any_size
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_warm_loop_opens_allocates_builds_and_sends_nothing(mpi_comm, mechanism):
    """Registration once, then: no IPC handle opened or exported, no device memory, no
    event, no plan (the device's counters: the stand-in's or the CuPy backend's), no MPI
    call on any of the communicator's MPI communicators; two fences per call. The
    synchronisations between the ranks: the two fences, by every mechanism; with host
    fences the hosts meet at both, with stream and kernel fences at the first (where
    the streams' signals say that the peers' inputs are ready, and the host reads where
    they are), the second being the devices' own."""
    from collectives.routes.base import compiled_plan

    comm = communicator(mechanism)
    memory = peer_memory.peer_memory(next(iter(comm._ctx.devices.values())).backend)
    comm.allreduce(D.asarray(np.ones(1, np.float32)), algorithm="one_shot")  # the peer state (kernel: the flags)
    gc.collect()
    D.free_all_blocks()  # what earlier tests freed: so x is a new allocation, not one the peers have open
    opened = memory.counters["opened"]
    n = 1 << 20  # 4 MiB: an allocation of its own
    x = comm.zeros(n, "float32", device=D.device)  # registered now: every rank opens every other's
    registered = memory.counters["opened"] - opened
    comm.allreduce(x, out=x, algorithm="one_shot")  # (two_shot would open the peers' window slots too)
    first_call = memory.counters["opened"] - opened - registered
    xs = [rank_input(r, 4096, "float32", "max") for r in range(comm.size)]
    y = D.asarray(xs[comm.rank])
    for algorithm in ("one_shot", "two_shot"):  # warm: y is registered lazily, the window slot made
        comm.allreduce(x, out=x, algorithm=algorithm)
        comm.allreduce(y, out=y, op="max", algorithm=algorithm)
    comm.allgather(y[:100], out=D.empty((comm.size, 100), np.float32), algorithm="one_shot")
    node, memory = _peer_state(comm)
    before = (memory.counters.copy(), D.counters(), compiled_plan.cache_info().misses, node.counters.copy())
    ctx = comm._ctx
    proxies = {name: Counting(getattr(ctx, name)) for name in ("comm", "node_comm", "p2p_comm")}
    for name, proxy in proxies.items():
        setattr(ctx, name, proxy)
    requests = ctx.progress.entries
    calls = 20
    try:
        for _ in range(calls // 2):
            comm.allreduce(y, out=y, op="max", algorithm="one_shot")
            comm.allreduce(x, out=x, algorithm="two_shot")
    finally:
        for name, proxy in proxies.items():
            setattr(ctx, name, proxy.comm)
    after = (memory.counters.copy(), D.counters(), compiled_plan.cache_info().misses, node.counters.copy())
    problems = []
    if comm.size > 1 and (registered != comm.size - 1 or first_call != 0):
        problems.append(f"empty(device=) opened {registered} allocations (not one per peer), the first call on "
                        f"it {first_call}")
    if after[0] != before[0]:
        problems.append(f"IPC: {dict(before[0])} -> {dict(after[0])}")
    if not before[1] or after[1] != before[1]:  # (the device counts something: the counters are read)
        problems.append(f"device: {before[1]} -> {after[1]}")
    if after[2] != before[2]:
        problems.append(f"plans built: {after[2] - before[2]}")
    mpi = {name: proxy.calls for name, proxy in proxies.items() if proxy.calls}
    if mpi or ctx.progress.entries != requests:
        problems.append(f"MPI: {mpi}, requests {requests} -> {ctx.progress.entries}")
    fences, meetings = (after[3][k] - before[3][k] for k in ("fences", "host meetings"))
    want = (2, 2) if mechanism == "host" else (2, 1)
    if comm.size > 1 and (fences, meetings) != tuple(calls * w for w in want):
        problems.append(f"{fences} fences, {meetings} host meetings in {calls} calls; want {want} a call")
    if differs(np.maximum.reduce(xs), D.asnumpy(y)) or differs(np.zeros(n, np.float32), D.asnumpy(x)):
        problems.append("wrong result")
    comm.free()
    agree(mpi_comm, problems)


@pytest.mark.mpi(min_size=2)
def test_calls_on_registered_arrays_with_fence_kernels_wait_on_no_host(mpi_comm):
    """kernel fences (ranks on distinct GPUs): a call whose input is a whole registered
    array (``Communicator.empty(device=)``) and that needs no window slot reads every
    peer's array of the same ``empty`` without the hosts' meeting: the devices' two
    fences are the call's only synchronisations, and no host waits for another. Every
    one_shot collective, allreduce in place too, each bit for bit the NumPy reference;
    then slices of it, at a place that differs from rank to rank (each rank's row of an
    allgather's output) or not, which ask as any array does."""
    comm = communicator("kernel")
    p, n = comm.size, 1000 * comm.size
    x = comm.empty(n, np.float64, device=D.device)
    user = D.new_stream()
    node = _peer_state(comm)[0]
    problems = []

    def run(collective, part, k, root):
        xs = [rank_input(r, n, "float64") + k for r in range(p)]
        D.copy_async(x, xs[comm.rank], user)
        name = collective.split()[0]
        view = x[part(comm.rank)]
        got = call(comm, name, view, "one_shot", root=root, out=view if "in place" in collective else None)
        want = expected_result(name, comm.rank, p, [xs[r][part(r)] for r in range(p)], "sum", root)
        wrong = differs(want, None if got is None else D.asnumpy(got, stream=user))
        if wrong:
            problems.append(f"{collective}: {wrong}")

    def counted(before):  # (fence kernels launched: waiting ones, and ones that only signal)
        return {k: node.counters[k] - before[k] for k in ("fences", "host meetings", "registered calls")} | {
            k: node.backend.launches[k] - before[k] for k in ("fence", "fence signal")}

    def now():
        return node.counters | node.backend.launches

    collectives = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "allreduce in place")
    with D.use_stream(user):
        before = now()
        for k, collective in enumerate(collectives):
            run(collective, lambda r: slice(None), k, k % p)
        calls = len(collectives)
        if counted(before) != {"fences": 2 * calls, "host meetings": 0, "registered calls": calls,
                               "fence": 2 * calls, "fence signal": 0}:
            problems.append(f"whole arrays, {calls} calls: {counted(before)}")
        before = now()  # (every rank asks: no signal kernel at the first fence, the second fence's kernel)
        for k, part in enumerate((lambda r: slice(8, 8 + 5 * p), lambda r: slice(r * 1000, (r + 1) * 1000))):
            run("allgather", part, k, 0)
        if counted(before) != {"fences": 4, "host meetings": 2, "registered calls": 0, "fence": 2,
                               "fence signal": 0}:
            problems.append(f"slices, 2 calls: {counted(before)}")
    comm.free()
    agree(mpi_comm, problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", ["another registered array", "an array not registered", "a slice of another",
                                  "another collective", "another collective on an array not registered"])
def test_a_registered_call_where_a_rank_passes_something_else_raises_on_every_rank(mpi_comm, case):
    """kernel fences: the ranks read each other's registered arrays without asking where
    they are, so the first fence kernels compare a digest of the call and of where every
    rank's input is; where the last rank passed another array or made another call,
    every rank raises the mismatch (the results are undefined; the communicator is
    broken, left unfreed). A rank that passed an array not registered, or a slice, asks
    where the others' are, and raises at its host's meeting (or while it waits there);
    it signals its fences first, so that the others' fence kernels see its digest,
    pass, and raise too."""
    comm = communicator("kernel")
    x, other, big = (comm.empty(n, np.float32, device=D.device) for n in (64, 64, 128))
    user = D.new_stream()
    with D.use_stream(user):
        for array in (x, other, big):
            D.copy_async(array, np.ones(array.size, np.float32), user)
        mine, collective = x, "allreduce"
        if comm.rank == comm.size - 1:
            if case.startswith("another collective"):
                collective = "reduce_scatter"
                if case.endswith("not registered"):  # (its host meets the others', and raises there)
                    mine = D.asarray(np.ones(64, np.float32), stream=user)
            else:
                mine = {"another registered array": other, "a slice of another": big[:64],
                        "an array not registered": D.asarray(np.ones(64, np.float32), stream=user)}[case]
        start = time.monotonic()
        with pytest.raises(cc.CollectiveMismatchError, match="another call|another buffer|a different call"):
            call(comm, collective, mine, "one_shot", timeout=20)
    took = time.monotonic() - start
    assert took < 10, f"raised after {took:.1f} s (not signalled: a fence kernel spun to its limit)"
    mpi_comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_raises_while_it_waits_at_the_first_fence_signals_the_others(mpi_comm):
    """kernel fences: rank 0 takes its registered array without asking, but its stream
    holds its signals back (its user's work before the call waits for a word); the last
    rank made another call, on an array not registered, and so sees every rank's
    announcement while it waits at the first fence, and raises there. It signals its
    fences first, so that rank 0's fence kernels see its digest, pass, and raise the
    mismatch too, well within the timeout (not after their time limit)."""
    stand_in_only("the user's stream is held back by a stand-in wait")
    comm = communicator("kernel")
    x = comm.empty(64, np.float32, device=D.device)
    user, dev = D.new_stream(), D.si.device()
    gate = np.zeros(1, np.uint32)
    last = comm.rank == comm.size - 1
    with D.use_stream(user):
        D.copy_async(x, np.ones(64, np.float32), user)
        mine = D.asarray(np.ones(64, np.float32), stream=user) if last else x
        if comm.rank == 0:
            dev.wait_value(user, gate, 0, 1)
        start = time.monotonic()
        handle = call(comm, "reduce_scatter" if last else "allreduce", mine, "one_shot", asynchronous=True,
                      timeout=20)
        if comm.rank == 0:
            time.sleep(0.5)  # (the others announced meanwhile; rank 0's stream has signalled nothing)
            gate[0] = 1
        with pytest.raises(cc.CollectiveMismatchError):
            handle.wait()
    took = time.monotonic() - start
    assert took < 10, f"raised after {took:.1f} s"
    mpi_comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_a_rank_whose_registered_array_is_gone_asks_and_the_call_holds(mpi_comm):
    """kernel fences: a rank that no longer holds its registered array (a view of all
    of it kept) finds no registration and meets the others' hosts to see where their
    inputs are, while they take its input as their counterpart without asking: it is
    that very array, so the digests agree and every rank gets the right result."""
    comm = communicator("kernel")
    p = comm.size
    x = comm.empty(64, np.float32, device=D.device)
    view = x[:]
    if comm.rank == p - 1:
        del x
        gc.collect()
    xs = [rank_input(r, 64, "float32") for r in range(p)]
    user = D.new_stream()
    node = _peer_state(comm)[0]
    before = node.counters.copy(), node.backend.launches.copy()
    with D.use_stream(user):
        D.copy_async(view, xs[comm.rank], user)
        got = D.asnumpy(comm.allreduce(view, algorithm="one_shot", timeout=20), stream=user)
    problems = [] if differs(sum(xs), got) is None else [differs(sum(xs), got)]
    asked = node.counters["host meetings"] - before[0]["host meetings"]
    signalled = node.backend.launches["fence signal"] - before[1]["fence signal"]
    mine = (comm.rank == p - 1, comm.rank == p - 1)  # the rank that asks signals the first fence to the others
    if D.name != "cuda" and (asked, signalled) != mine:  # (a CuPy view keeps its array alive: none asks)
        problems.append(f"{asked} host meetings, {signalled} signal kernels")
    comm.free()
    agree(mpi_comm, problems)


@pytest.mark.any_size
@pytest.mark.mpi(min_size=2)
def test_a_registered_call_names_the_rank_that_does_not_come(mpi_comm):
    """kernel fences, registered arrays: no host waits at the first fence, so it is the
    devices' first fence that waits for the rank that never called, and the timeout
    names that rank (read from the fence kernel's flags)."""
    comm = communicator("kernel")
    x = comm.empty(1000, np.float32, device=D.device)
    user = D.new_stream()
    with D.use_stream(user):
        D.copy_async(x, np.ones(1000, np.float32), user)
        if comm.rank != 0:
            with pytest.raises(cc.CollectiveTimeoutError, match="waits? for rank 0 to arrive"):
                comm.allreduce(x, algorithm="one_shot", timeout=1.0)
    mpi_comm.Barrier()  # (the communicator is broken on the ranks that waited: not freed)


def test_every_call_has_at_most_two_fences_at_any_size():
    """In the plans themselves: no segments, two fences (none for one rank or nothing)."""
    from collectives.routes.base import compiled_plan
    from collectives.schedule import Fence

    for collective, algorithm in PEERS:
        for size in (1, 2, 3, 4, 8):
            for count in (0, 1, size + 1, 1 << 20, 1 << 28):
                for inplace in (False, True) if collective in ("allreduce", "reduce") else (False,):
                    plan = compiled_plan(collective, algorithm, size - 1, size, count, 0, 1, inplace, False, 0)
                    fences = sum(isinstance(op, Fence) for op in plan.ops)
                    assert fences == (0 if size == 1 or count == 0 else 2), (collective, algorithm, size, count)
                    assert len(plan.ops) <= 2 * size + 3, (collective, algorithm, size, count, len(plan.ops))


@pytest.mark.serial
def test_every_phase_is_one_kernel_for_up_to_16_ranks():
    """As the device executor runs the plans (peer_phases.phases): every phase between
    fences launches one kernel or copy, for every rank of up to 16 (a fold of up to 16
    inputs, a copy of up to 16 peers' buffers, the leader's fold written into up to 16
    outputs, its reduce_scatter's p folds one kernel); beyond, one per 16 (the
    allreduce leader: one per 16 inputs, and per 16 outputs; its reduce_scatter: one
    per block per 16 inputs). The allgather leader reads each of the p inputs once into
    the p outputs, 16 // p inputs a kernel: one up to 4 ranks (past 16 ranks, its p²
    copies one kernel per 16)."""
    from collectives.routes.base import compiled_plan

    launches_of = {peer_phases._COPY: lambda specs: 1, peer_phases._REDUCE: lambda specs: 1,
                   peer_phases._REDUCE_MANY: lambda specs: -(-(len(specs) - 1) // 16),
                   peer_phases._COPY_KERNELS: lambda specs: len(specs),
                   peer_phases._FOLD_TO_ALL: lambda specs: 1, peer_phases._FOLD_BLOCKS: lambda specs: 1}

    def allowed(collective, algorithm, size):
        sixteens = -(-size // 16)
        if algorithm != "leader":
            return sixteens
        return {"allreduce": sixteens * (2 if size > 16 else 1), "allgather": device_model._fanned_kernels(size),
                "reduce_scatter": 1 if size <= 16 else size * sixteens}.get(collective, sixteens)

    for collective, algorithm in PEERS:
        for size in (2, 3, 4, 8, 16, 17, 40):
            for inplace in (False, True) if collective in ("allreduce", "reduce") else (False,):
                for rank, root in ((r, root) for r in range(size) for root in sorted({0, 2 % size, size - 1})):
                    count = 3 * size + 1
                    plan = compiled_plan(collective, algorithm, rank, size, count, root, 1, inplace, False, 0)
                    slot = plan.shm // size if plan.shm else 0
                    for k, phase in enumerate(peer_phases.phases(plan, rank, count, slot)):
                        launches = sum(launches_of[kind](specs) for kind, specs in phase)
                        assert launches <= allowed(collective, algorithm, size), \
                            (collective, algorithm, size, inplace, rank, k, phase)


def test_the_copying_leaders_read_each_input_once():
    """The allgather and broadcast leaders write each input into several ranks' outputs:
    up to 16 ranks each input is read once, by one kernel row that writes all of its
    destinations (copy_n's fan), and every rank's output is written, once."""
    from collectives.routes.base import compiled_plan

    for collective in ("allgather", "broadcast"):
        for size in (2, 3, 4, 5, 8, 16):
            count = 3 * size + 1
            plan = compiled_plan(collective, "leader", 0, size, count, 0, 1, False, False, 0)
            made = peer_phases.phases(plan, 0, count, 0)
            reads, writes = Counter(), Counter()
            for phase in made:
                for kind, specs in phase:
                    launches = specs if kind == peer_phases._COPY_KERNELS else \
                        (((specs[0],), (specs[1],)),) if kind == peer_phases._COPY else ()
                    assert launches or not specs, (collective, size, kind)
                    for dsts, srcs in launches:
                        assert len(dsts) <= 16 and len(dsts) % len(srcs) == 0, (collective, size, dsts, srcs)
                        reads.update(srcs)
                        writes.update(dst[:2] for dst in dsts)
            assert set(reads.values()) == {1}, (collective, size, reads)
            outputs = [("out", -1)] * (collective == "allgather") + [("rout", q) for q in range(1, size)]
            per = size if collective == "allgather" else 1  # (allgather: a row from each rank)
            assert writes == {o: per for o in outputs}, (collective, size, writes)


def test_avg_divides_once_on_every_output_of_a_leader():
    """Where a leader's fold divides (avg), the executor divides in the folds whose
    outputs no later fold reads (device_node's final folds), each rank's output in one
    of them, once, at any p: past 16 ranks the fold of an output is a chain of kernels,
    of which only the last divides (and the copies of the result after it copy
    divided values)."""
    from collectives.routes.base import compiled_plan

    for collective in ("allreduce", "reduce_scatter"):
        for size in (2, 3, 16, 17, 40):
            count = 3 * size + 1
            plan = compiled_plan(collective, "leader", 0, size, count, 0, 1, False, False, 0)
            made, written, final = peer_phases.phases_and_facts(plan, 0, count, 0)
            folds = {(k, i): entry for k, phase in enumerate(made) for i, entry in enumerate(phase)
                     if entry[0] in (peer_phases._REDUCE, peer_phases._REDUCE_MANY, peer_phases._FOLD_TO_ALL,
                                     peer_phases._FOLD_BLOCKS)}
            assert final and final <= set(folds), (collective, size, final)

            def outputs(entry):
                kind, specs = entry
                return specs[0] if kind in (peer_phases._FOLD_TO_ALL, peer_phases._FOLD_BLOCKS) else (specs[0],)

            divided = Counter((o[0], o[1]) for where in final for o in outputs(folds[where]))
            assert all(n == 1 for n in divided.values()), (collective, size, divided)
            assert ("out", -1) in divided, (collective, size, divided)
            copied = {dst[:2] for phase in made for kind, specs in phase if kind == peer_phases._COPY_KERNELS
                      for dsts, _ in specs for dst in dsts}
            if collective == "reduce_scatter":  # every rank's block, its own fold
                assert set(divided) == {("out", -1)} | {("rout", q) for q in range(1, size)}, (size, divided)
            else:  # rank 0's fold into its output, and into the others' in it or copied from it after it
                assert set(divided) | copied == {("out", -1)} | {("rout", q) for q in range(1, size)}, size
            assert written == {q for buf, q in set(divided) | copied if buf == "rout"}, (collective, size)


@pytest.mark.mpi(min_size=2)
def test_a_call_launches_one_kernel_a_phase(mpi_comm):
    """On the device (the stand-in's or the CuPy backend's launch counts): a warm call of
    every peer read launches one kernel or copy per phase that has work, so at most
    three; allgather's reads of the peers and two_shot's copies out of the slots are one
    kernel each, not one copy per rank."""
    comm = communicator("host")
    backend = next(iter(comm._ctx.devices.values())).backend
    problems = []
    n = 4 * comm.size + 3
    fanned = device_model._fanned_kernels(comm.size)  # the allgather leader's: each input read once, 16 // p a kernel
    for collective, algorithm in PEERS:
        x = D.asarray(rank_input(comm.rank, n, "float32"))
        call(comm, collective, x, algorithm)  # warm: registered, plans made
        before = backend.launches.copy()
        call(comm, collective, x, algorithm)
        launched = backend.launches - before
        want = {("allreduce", "one_shot"): 1, ("allreduce", "two_shot"): 2,
                ("allreduce", "leader"): int(comm.rank == 0), ("reduce_scatter", "one_shot"): 1,
                ("allgather", "one_shot"): 2, ("broadcast", "one_shot"): int(comm.rank != 0),
                ("reduce", "one_shot"): int(comm.rank == 0),
                # the leaders: rank 0 (broadcast's root) alone
                ("reduce_scatter", "leader"): int(comm.rank == 0), ("broadcast", "leader"): int(comm.rank == 0),
                ("allgather", "leader"): fanned if comm.rank == 0 else 0}[(collective, algorithm)]
        if comm.size <= 16 and sum(launched.values()) != want:
            problems.append(f"{collective} {algorithm}: {dict(launched)}, want {want} launches")
        # (allgather at 2 ranks reads one peer: one copy)
        gathers = algorithm == "two_shot" or (collective == "allgather" and comm.size > 2 and
                                              (algorithm == "one_shot" or comm.rank == 0))
        copies = fanned if algorithm == "leader" else 1
        if gathers and launched["copy_n"] != copies:
            problems.append(f"{collective} {algorithm}: its copy phase was not {copies} kernel(s): {dict(launched)}")
    comm.free()
    agree(mpi_comm, problems)


@pytest.mark.any_size
def test_freed_and_reallocated_memory_is_opened_anew(pcomm, mpi_comm):
    """A buffer freed and allocated again at the same base gets a new buffer id: the
    peers close their mapping of the old allocation and open the new one (the stand-in
    raises where a stale mapping is read). Each round's x is an allocation of its own: a
    pool's block may lie in a chunk the peers have open already (CuPy's does, on a GPU)."""
    comm, problems = pcomm, []
    comm.allreduce(D.asarray(np.ones(3, np.float32)), algorithm="one_shot")  # the window: made before the rounds
    memory = _peer_state(comm)[1]
    count = (3 << 20) // 4  # a segment of its own
    bases = []
    gc.collect()
    D.free_all_blocks()  # what earlier tests freed: so every round's x is a new allocation
    for round_ in range(3):
        x = D.dedicated(rank_input(comm.rank, count, "float32") + round_)
        bases.append(getattr(x, "ptr", None) or x.data.ptr)
        before = memory.counters.copy()
        got = comm.allreduce(x, algorithm="one_shot")
        want = sum(rank_input(r, count, "float32") + round_ for r in range(comm.size))
        if differs(want, D.asnumpy(got)):
            problems.append(f"round {round_}: wrong result")
        opened, closed = (memory.counters[k] - before[k] for k in ("opened", "closed"))
        if comm.size > 1 and opened != comm.size - 1:
            problems.append(f"round {round_}: the peers opened {opened} allocations, not the new one each")
        if comm.size > 1 and round_ > 0 and bases[round_] == bases[0] and closed != comm.size - 1:
            problems.append(f"round {round_}: {closed} mappings of the freed allocation closed")
        del x, got
        gc.collect()
        D.free_all_blocks()
    if D.name == "standin" and len(set(bases)) != 1:
        problems.append(f"the stand-in did not reuse the base ({bases}): the test tests nothing")
    agree(mpi_comm, problems)


@pytest.mark.any_size
def test_a_new_allocation_over_a_freed_one_opened_elsewhere_is_opened(pcomm, mpi_comm):
    """CUDA maps a process's memory once per process: opening an allocation that a
    mapping still held overlaps may fail (cudaErrorAlreadyMapped: seen on an H200 for a
    new allocation over a freed one, though not for every such one; the stand-in
    always refuses, the stricter rule). A peer's allocation freed and a new one made
    over its range at another base (its old mapping is not replaced by base, as in the
    test above): the call on the new one gives the right sum, and on the stand-in the
    peers closed the stale mapping to open it."""
    comm, problems = pcomm, []
    comm.allreduce(D.asarray(np.ones(3, np.float32)), algorithm="one_shot")  # the window: made before
    memory = _peer_state(comm)[1]
    count = 2 << 20  # 8 MiB of float32: larger than the holes earlier tests leave
    gc.collect()
    D.free_all_blocks()
    before, after = D.dedicated(rank_input(comm.rank, count, "float32")), None
    x = D.dedicated(rank_input(comm.rank, count, "float32"))
    if differs(sum(rank_input(r, count, "float32") for r in range(comm.size)),
               D.asnumpy(comm.allreduce(x, algorithm="one_shot"))):
        problems.append("the first allocation: wrong result")
    old = _extent(x)
    del before, x
    gc.collect()
    D.free_all_blocks()
    closed = memory.counters["closed"]
    after = D.dedicated(rank_input(comm.rank, 2 * count, "float32") + 1)
    new = _extent(after)
    want = sum(rank_input(r, 2 * count, "float32") + 1 for r in range(comm.size))
    if differs(want, D.asnumpy(comm.allreduce(after, algorithm="one_shot"))):
        problems.append("the new allocation over the freed one: wrong result")
    overlaps = new[0] != old[0] and new[0] < old[1] and old[0] < new[1]
    if D.name == "standin" and not overlaps:
        problems.append(f"the new allocation {new} does not overlap the freed {old} elsewhere: the test tests nothing")
    if D.name == "standin" and overlaps and comm.size > 1 and memory.counters["closed"] - closed < 1:
        problems.append("no stale mapping closed")
    agree(mpi_comm, problems)


def _extent(array):
    """``(first byte, end)`` of the allocation ``array`` lies in."""
    base, size, _ = D.allocation(array)
    return base, base + size


def test_empty_on_a_device_is_registered_and_usable(mpi_comm):
    comm = communicator("host")
    x = comm.zeros((3, 5), "float64", device=D.device)
    problems = [] if np.array_equal(D.asnumpy(x), np.zeros((3, 5))) else ["zeros() is not zero"]
    D.copy_async(x, np.full((3, 5), comm.rank + 1.0), x_stream())
    got = comm.allreduce(x, algorithm="two_shot")
    if differs(np.full((3, 5), comm.size * (comm.size + 1) / 2), D.asnumpy(got)):
        problems.append(f"allreduce on it: {D.asnumpy(got)[0]}")
    with pytest.raises(ValueError, match="device must be None .* got 'gpu'"):
        comm.empty(4, device="gpu")
    comm.free()
    agree(mpi_comm, problems)


@pytest.mark.any_size
def test_empty_on_a_device_is_an_allocation_of_its_own(mpi_comm):
    """comm.empty(device=) does not come out of the pool: where the pool has room in a
    chunk the peers opened before (a block freed in it, another array still there, as
    CuPy's pool leaves them on a GPU), a pool's array would lie in that chunk, and the
    peers would open nothing new, their mapping of it shared with whatever else lies
    there. Each peer opens the new array, once, and nothing more on the first call."""
    comm = communicator("host")
    memory = _peer_state(comm)[1] if comm.size > 1 else None
    gc.collect()
    D.free_all_blocks()
    chunk = D.asarray(np.ones(3 << 20, np.float32))  # 12 MiB: a chunk of its own in the pool
    comm.allreduce(chunk, algorithm="one_shot")  # the peers open that chunk
    del chunk
    gc.collect()
    kept = D.asarray(np.ones(256, np.float32))  # lands in the freed chunk, which stays in the pool
    problems = []
    opened = memory.counters["opened"] if memory else 0
    x = comm.zeros(1 << 20, "float32", device=D.device)  # 4 MiB: would fit in the chunk's free room
    registered = (memory.counters["opened"] - opened) if memory else 0
    if comm.size > 1 and registered != comm.size - 1:
        problems.append(f"empty(device=) made the peers open {registered} allocations, not {comm.size - 1}")
    before = memory.counters["opened"] if memory else 0
    comm.allreduce(x, out=x, algorithm="one_shot")
    if memory and memory.counters["opened"] != before:
        problems.append(f"the first call on it opened {memory.counters['opened'] - before} allocations")
    if differs(np.zeros(1 << 20, np.float32), D.asnumpy(x)):
        problems.append("wrong result")
    del kept
    comm.free()
    agree(mpi_comm, problems)


def x_stream():
    """The current stream of the device under test (the stand-in's, or CuPy's)."""
    if D.name == "standin":
        return D.si.device().current_stream()
    return D.cupy.cuda.get_current_stream()


# -- errors ----------------------------------------------------------------------------------------------
def test_host_arrays_and_missing_ipc_are_refused_before_any_message(mpi_comm):
    comm = communicator("host", cuda_ipc=False)  # the device paths: staged, no IPC
    with pytest.raises(ValueError, match="'one_shot' reads the other ranks' device buffers in place .* device "
                                         "arrays only"):
        comm.allreduce(np.ones(4, np.float32), algorithm="one_shot")
    if comm.size > 1:
        with pytest.raises(ValueError, match="'two_shot' reads the other ranks' device buffers through CUDA IPC, "
                                             "which some ranks of this node cannot open"):
            comm.allreduce(D.asarray(np.ones(4, np.float32)), algorithm="two_shot")
    # auto would pick a peer read here; without IPC it runs the cost model's message-based choice
    got = comm.allreduce(D.asarray(np.ones(4, np.float32)))
    assert np.array_equal(D.asnumpy(got), np.full(4, comm.size, np.float32))
    comm.free()
    mpi_comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_an_ipc_opening_the_driver_refuses_is_named_in_the_error(mpi_comm, monkeypatch):
    """Where rank 1 cannot open rank 0's memory when the communicator negotiates its
    paths, a peer read raises on every rank before any message, and rank 1's error says
    what the driver said."""
    stand_in_only("a refusal made to order")
    from collectives.device import standin

    def refuse(handle, nbytes):
        raise RuntimeError("peer access refused (made to order)")

    if mpi_comm.rank == 1:
        monkeypatch.setattr(standin.device(), "open_allocation", refuse)
    comm = communicator("host")  # the negotiation: rank 1 cannot open rank 0's probe
    monkeypatch.undo()
    with pytest.raises(ValueError, match="cannot open") as raised:
        comm.allreduce(D.asarray(np.ones(4, np.float32)), algorithm="one_shot")
    named = "this rank could not open rank 0's (RuntimeError: peer access refused (made to order))"
    assert (named in str(raised.value)) == (comm.rank == 1), str(raised.value)
    got = comm.allreduce(D.asarray(np.ones(4, np.float32)), algorithm="ring")  # staged between them
    assert np.array_equal(D.asnumpy(got), np.full(4, comm.size, np.float32))
    comm.free()
    mpi_comm.Barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_mismatched_calls_raise_on_every_rank(mpi_comm, mechanism):
    # The broken communicators are not freed: a failure notice the ranks sent each other
    # may still be unreceived, and MPI hands a freed communicator's context to the next.
    comm = communicator(mechanism)
    count = 64 if comm.rank else 96
    with pytest.raises(cc.MessageSizeError, match="rank 0 called it with 384 B|this rank has 384 B"):
        comm.allreduce(D.asarray(np.ones(count, np.float32)), algorithm="one_shot", timeout=30)
    comm = communicator(mechanism)
    x = D.asarray(np.ones(60, np.float32))
    with pytest.raises(cc.CollectiveMismatchError, match="is in a different call"):
        if comm.rank == 0:
            comm.allreduce(x, algorithm="one_shot", timeout=30)
        else:
            comm.reduce_scatter(x, algorithm="one_shot", timeout=30)
    mpi_comm.Barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_memory_that_cannot_be_shared_makes_every_rank_raise_alike(mpi_comm, mechanism):
    """Rank 0's input lies where no other process can open it (the stand-in: outside its
    pool; a GPU: managed memory, which CUDA IPC cannot export): every rank raises at the
    first fence the same error, naming rank 0 and the argument, rank 0 too, rather than
    wait at the second fence for the ranks that had raised until its timeout (here 20 s:
    so that a regression fails instead of hanging). ``auto`` alike: it chooses a peer read
    there. Broken communicators are left unfreed (see above)."""
    problems = []
    for algorithm in ("one_shot", "two_shot", "auto"):
        comm = communicator(mechanism)
        host = rank_input(comm.rank, 1000, "float32")
        x = D.unshareable(host) if comm.rank == 0 else D.asarray(host)
        start = time.monotonic()
        try:
            comm.allreduce(x, algorithm=algorithm, timeout=20)
            said = "no error"
        except cc.CollectiveError as exc:
            said = f"{type(exc).__name__}: {str(exc).split(': ', 1)[-1]}"  # (less the call's description)
        waited = time.monotonic() - start
        everyone = mpi_comm.allgather(said)
        if len(set(everyone)) != 1:
            problems.append(f"{algorithm}: the ranks said different things: {everyone}")
        if not said.startswith("CollectiveError: the input x of rank 0 is in device memory this library cannot "
                               "share through CUDA IPC") or "algorithm='ring'" not in said:
            problems.append(f"{algorithm}: {said}")
        if waited > 10:
            problems.append(f"{algorithm}: raised after {waited:.1f} s")
    agree(mpi_comm, problems)


@pytest.mark.any_size
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_rank_that_does_not_call_is_named_by_the_others_timeout(mpi_comm, mechanism):
    comm = communicator(mechanism)
    comm.allreduce(D.asarray(np.ones(10, np.float32)), algorithm="one_shot")  # the window is made
    if comm.rank != 0:
        wait = "waiting at fence 1 of 2 for rank 0 to arrive"
        # (every mechanism: the host waits at the first fence, to see where the buffers are)
        with pytest.raises(cc.CollectiveTimeoutError, match=f"Timed out after .*{wait}"):
            comm.allreduce(D.asarray(np.ones(1000, np.float32)), algorithm="two_shot", timeout=1.0)
    mpi_comm.Barrier()  # (the communicator is broken on the ranks that waited: not freed)


def test_check_mode_runs_them_and_names_a_different_algorithm(mpi_comm):
    comm = communicator("stream", check=True)
    got = comm.allreduce(D.asarray(np.ones(8, np.float32)), algorithm="two_shot")
    problems = [] if np.array_equal(D.asnumpy(got), np.full(8, comm.size, np.float32)) else ["wrong"]
    if comm.size > 1:
        with pytest.raises(cc.CollectiveMismatchError, match="algorithm"):
            comm.allreduce(D.asarray(np.ones(8, np.float32)), algorithm="one_shot" if comm.rank else "two_shot")
    comm.free()
    agree(mpi_comm, problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("one_gpu", [True, False], ids=["one-gpu", "a-gpu-each"])
def test_auto_runs_the_leader_only_where_the_ranks_share_one_gpu(mpi_comm, one_gpu):
    """The device cost model picks the leader for an allreduce where the node's ranks
    share one GPU, as it takes them to until a peer-read call has learnt it; where each
    has its own (the stand-in made to say so), the first call, chosen before, runs
    one_shot instead (every rank launches its fold, not rank 0 alone), and from then on
    the model predicts for a GPU each: ``comm.choose`` says so, never names the leader,
    and the calls run what it names."""
    x = D.asarray(rank_input(mpi_comm.rank, 64, "float32"))
    backend = as_device_array(x).backend
    uuid = backend.uuid
    if not one_gpu:  # before the negotiation, which exchanges the ranks' GPUs
        backend.uuid = f"{uuid}-rank-{mpi_comm.rank}"  # a GPU each
    try:
        comm = communicator("host")  # the device negotiated; no peer-read call yet
        problems = []
        want = sum(rank_input(r, 64, "float32") for r in range(comm.size))
        before_learning = comm.choose("allreduce", x.nbytes, device=True)
        if before_learning[0] != "leader" or "taken to share one GPU" not in before_learning[1]:
            problems.append(f"before the first peer-read call: {tuple(before_learning)}")
        for round_ in range(3):  # the general path, then the lean one
            before = backend.launches.copy()
            if differs(want, D.asnumpy(comm.allreduce(x))):
                problems.append(f"round {round_}: wrong result")
            launched = sum((backend.launches - before).values())
            expected = int(comm.rank == 0) if one_gpu else 1
            if (one_gpu or round_ == 0) and launched != expected:
                problems.append(f"round {round_}: {launched} launches, want {expected}")
    finally:
        backend.uuid = uuid
    choice = comm.choose("allreduce", x.nbytes, device=True)
    model = device_model.DeviceCostModel(shared=one_gpu, one_gpu=one_gpu)  # (host fences either way)
    times = device_model.predict_device("allreduce", x.nbytes, comm.size, model)
    said = "the node's ranks share one GPU" if one_gpu else "each of the node's ranks has a GPU of its own"
    if choice[0] != min(times, key=times.get) or said not in choice[1] or (choice[0] == "leader") != one_gpu:
        problems.append(f"once learnt: {tuple(choice)}, predicted {times}")
    ctx = comm._ctx  # what the calls after the first ran: the general path's kinds, the lean path's entries
    ran = {known[0] for kind, known in ctx.call_kinds.items() if kind[0].name == "allreduce" and kind[5]}
    ran |= {entry.algorithm for key, entry in ctx.lean_entries.items() if entry and key[0] is backend}
    if ran != {choice[0]}:
        problems.append(f"once learnt, the calls ran {ran}, not {choice[0]}")
    comm.free()
    agree(mpi_comm, problems)


@pytest.mark.mpi(min_size=2)
def test_host_fences_record_no_event_where_nothing_was_queued_since_the_last(mpi_comm, monkeypatch):
    """With host fences a fence's event covers everything queued before it: a later
    fence, or the call's end, with nothing queued since records none and waits for
    none. So on the leader the other ranks touch the device twice a call (the event
    on the user's stream, and their first fence's after their stream waits for it),
    rank 0 once more after its kernel; a device barrier records two events."""
    comm = communicator("host")
    backend = next(iter(comm._ctx.devices.values())).backend
    x = D.asarray(rank_input(comm.rank, 64, "float32"))
    comm.allreduce(x, algorithm="leader")  # warm: the peer state, the lean entry
    comm.barrier(device=x)
    recorded = []
    record = backend.record
    monkeypatch.setattr(backend, "record", lambda event, stream: (recorded.append(event), record(event, stream)))
    problems = []
    leader = 3 if comm.rank == 0 else 2
    for what, run, want in (("leader, lean path", lambda: comm.allreduce(x, algorithm="leader"), leader),
                            ("leader, general path", lambda: comm.allreduce_async(x, algorithm="leader").wait(),
                             leader),
                            ("barrier", lambda: comm.barrier(device=x), 2)):
        recorded.clear()
        run()
        if len(recorded) != want:
            problems.append(f"{what}: {len(recorded)} events recorded, want {want}")
    monkeypatch.undo()
    if differs(sum(rank_input(r, 64, "float32") for r in range(comm.size)), D.asnumpy(comm.allreduce(x))):
        problems.append("wrong result")
    comm.free()
    agree(mpi_comm, problems)


@pytest.mark.mpi(min_size=2)
def test_the_leaders_fold_divides_for_avg(mpi_comm):
    """avg on the leader: rank 0's fold divides by the world size as it writes every
    rank's output (one kernel; reduce_scatter's: every rank's block), so the other ranks
    launch nothing, no division either; the results are the host path's bits (its sum,
    then its division), on the general and the lean path, into new, ``out=`` and
    strided arrays, in every floating dtype."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    comm = communicator("host")
    backend = next(iter(comm._ctx.devices.values())).backend
    problems = []
    for dtype in (np.float32, np.float64, np.float16, np.complex64, ml_dtypes.bfloat16):
        name, marked = np.dtype(dtype).name, np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16)
        xs = [rank_input(r, 45, dtype, "avg") * (r + 1) for r in range(comm.size)]  # sums not divisible by p
        # (MPI has no bfloat16: the host path's own algorithm; the sums are exact, so any fold's)
        want = comm.allreduce(xs[comm.rank], op="avg", algorithm="direct" if marked else "native")
        if marked and not D.native_bfloat16:
            x, want = bfloat16(D.asarray(xs[comm.rank].view(np.uint16))), want.view(np.uint16)
        else:
            x = D.asarray(xs[comm.rank])
        for round_ in range(3):  # the general path, then the lean one
            before = backend.launches.copy()
            got = host_of(comm.allreduce(x, op="avg", algorithm="leader"))
            launched = backend.launches - before
            expected = {"reduce_n": 1} if comm.rank == 0 else {}
            if dict(launched) != expected:
                problems.append(f"{name} round {round_}: launched {dict(launched)}, want {expected}")
            problem = differs(want, got)
            if problem:
                problems.append(f"{name} round {round_}: {problem}")
        # reduce_scatter's leader: every rank's block, divided, in one kernel
        want_block = comm.reduce_scatter(xs[comm.rank], op="avg", algorithm="direct" if marked else "native")
        for round_ in range(2):
            before = backend.launches.copy()
            got = host_of(comm.reduce_scatter(x, op="avg", algorithm="leader"))
            launched = backend.launches - before
            expected = {"reduce_blocks": 1} if comm.rank == 0 else {}
            if dict(launched) != expected:
                problems.append(f"{name} reduce_scatter round {round_}: launched {dict(launched)}, want {expected}")
            problem = differs(want_block.view(np.uint16) if marked and not D.native_bfloat16 else want_block, got)
            if problem:
                problems.append(f"{name} reduce_scatter round {round_}: {problem}")
        if marked:
            continue
        canvas = D.asarray(np.zeros((2, 45), xs[0].dtype))
        comm.allreduce(x, op="avg", algorithm="leader", out=canvas[1])
        comm.allreduce(D.asarray(np.stack([xs[comm.rank]] * 2, axis=-1))[:, 1], op="avg", algorithm="leader",
                       out=canvas[0, ::-1])
        host = D.asnumpy(canvas)
        if differs(want, host[1]) or differs(want, np.ascontiguousarray(host[0, ::-1])):
            problems.append(f"{name}: out= or strided")
    comm.free()
    agree(mpi_comm, problems)


def test_auto_picks_a_peer_read_and_says_why(pcomm, mpi_comm):
    comm, problems = pcomm, []
    for nbytes in (8, 64 << 10, 1 << 20, 64 << 20):
        choice = comm.choose("allreduce", nbytes, device=True)
        if comm.size > 1 and (choice[0] not in ("one_shot", "two_shot", "leader")
                              or choice.route != "device peer reads"
                              or "device cost model on one node" not in choice[1]):
            problems.append(f"{nbytes} B: {tuple(choice)} by {choice.route}")
    for collective in ("reduce_scatter", "allgather", "broadcast", "reduce"):
        # the fastest the device model predicts, saying so: on a GPU the ranks share, the
        # leader (one process with device work) where there is one, else one_shot (at 2
        # ranks broadcast's one_shot ties with it: one rank copies either way)
        choice = comm.choose(collective, 4096, device=True)
        times = device_model.predict_device(collective, 4096, comm.size)
        if comm.size > 1 and (choice[0] != min(times, key=times.get) or "device cost model" not in choice[1]):
            problems.append(f"{collective}: {tuple(choice)}, predicted {times}")
        if comm.size > 1 and choice[0] not in ("leader", "one_shot"):
            problems.append(f"{collective}: {tuple(choice)}")
    xs = [rank_input(r, 5000, "float32") for r in range(comm.size)]
    if differs(sum(xs), D.asnumpy(comm.allreduce(D.asarray(xs[comm.rank])))):
        problems.append("auto's result")
    if comm.choose("allreduce", 1 << 20)[0] in ("one_shot", "two_shot", "leader"):
        problems.append("host arrays got a peer read")
    agree(mpi_comm, problems)


# -- every synchronisation is needed: take each out in turn, and a test fails ----------------------
def _only_at(fence, value):
    """A replacement for a fence step (a method of a fence mechanism, given the call,
    the fence and its number) that returns ``value`` at fence ``fence`` (None: does
    nothing) and behaves as before at the other."""
    def replace(real):
        def patched(self, call, k, epoch):
            return value if k == fence else real(self, call, k, epoch)
        return patched
    return replace


def _passes(real):
    return lambda self, call, epoch: True  # the host goes on as if every peer's stream had signalled


def _give_the_event_back(real):
    return lambda self: self.node.give_event(self.started)  # the stream no longer waits for the user's work


HOST, STREAM, KERNEL = peer_fences.HostFences, peer_fences.StreamFences, peer_fences.KernelFences
CALL = device_node.PeerCall
MUTATIONS = {  # name: (mechanism, the class of the step, the step, its replacement given the real one)
    "host: arrive before this rank's own work has run": ("host", HOST, "_work_done",
                                                         lambda real: lambda self, call: True),
    "host: pass fence 1 without the others": ("host", HOST, "_others_arrived", _only_at(1, True)),
    "host: pass fence 2 without the others": ("host", HOST, "_others_arrived", _only_at(2, True)),
    "stream: pass fence 1 without the others' signals": ("stream", STREAM, "_others_signalled", _passes),
    "stream: no signal at fence 1": ("stream", STREAM, "_signal", _only_at(1, None)),
    "stream: no signal at fence 2": ("stream", STREAM, "_signal", _only_at(2, None)),
    "stream: no wait at fence 2": ("stream", STREAM, "_wait_for_others", _only_at(2, None)),
    "host: the call does not wait for the user's stream": ("host", CALL, "_wait_for_user", _give_the_event_back),
    "stream: the call does not wait for the user's stream": ("stream", CALL, "_wait_for_user", _give_the_event_back),
    "kernel: pass fence 1 without the others' signals": ("kernel", KERNEL, "_others_signalled", _passes),
    "kernel: no signal at fence 1": ("kernel", KERNEL, "_signal", _only_at(1, None)),
    "kernel: no fence kernel at fence 2": ("kernel", KERNEL, "_fence_kernel", _only_at(2, None)),
    "kernel, registered arrays: no fence kernel at fence 1": ("kernel", KERNEL, "_fence_kernel", _only_at(1, None)),
    "kernel: the call does not wait for the user's stream": ("kernel", CALL, "_wait_for_user", _give_the_event_back),
    "no wait for the other routes' calls before": ("host", CALL, "_wait_for_other_routes",
                                                   lambda real: lambda self: None),
}
WORKLOAD = [("allreduce", "one_shot"), ("allreduce", "two_shot"), ("reduce_scatter", "one_shot"),
            ("allgather", "one_shot"), ("broadcast", "one_shot"), ("reduce", "one_shot")]
LEADERS = [(c, a) for c, a in PEERS if a == "leader"]


def _workload(comm, mpi_comm, rounds, registered=False, collectives=WORKLOAD, held=0):
    """``rounds`` of every peer-read collective of ``collectives``, each input written by
    work queued on the user's stream just before the call (on rank ``held`` held back
    for 20 ms by a word the stream waits for, while every rank polls the call: the
    others would read its input too early), and overwritten just after it returns, as
    a caller may (the others then wait 10 ms before they go on: they would read its
    input too late); returns (wrong results, an error) as every rank saw them, at the first
    call where any rank saw either.
    ``registered``: every input is one registered array (``Communicator.empty(device=)``),
    which with kernel fences the calls that need no window slot read without the
    host's meeting."""
    wrong, error = 0, None
    user, dev = D.new_stream(), D.si.device()
    gate = np.zeros(1, np.uint32)  # host memory the user's stream waits on (a stream wait value)
    n = 3000
    kept = comm.empty(n, np.float32, device=D.device) if registered else None
    with D.use_stream(user):
        for k in range(rounds):
            for collective, algorithm in collectives:
                root = k % comm.size
                xs = [rank_input(r, n, "float32") + k for r in range(comm.size)]
                try:
                    x = kept if registered else D.empty(n, np.float32)
                    if comm.rank == held:
                        dev.wait_value(user, gate, 0, gate[0] + 1)
                    D.copy_async(x, xs[comm.rank], user)
                    handle = call(comm, collective, x, algorithm, root=root, asynchronous=True, timeout=3)
                    until = time.monotonic() + 0.02
                    while time.monotonic() < until:
                        comm.poll()
                    gate[0] += 1
                    if comm.rank != held:  # the held rank may now finish and write its input again while the
                        time.sleep(0.01)  # others do nothing: their reads of it run after that, unless a fence holds it
                    got = handle.wait()
                    host = None if got is None else D.asnumpy(got, stream=user)
                    D.copy_async(x, np.full(n, -7.0, np.float32), user)  # the caller writes its input again
                    D.asnumpy(x[:1], stream=user)  # (and the stand-in runs that now)
                    want = expected_result(collective, comm.rank, comm.size, xs, "sum", root)
                    wrong += differs(want, host) is not None
                except (cc.CollectiveError, D.si.StaleMapping) as exc:  # a timeout, a mismatch, a stale read
                    error = error or f"{type(exc).__name__}: {exc}"[:300]
                seen = _seen(mpi_comm, wrong, error)
                if seen:
                    return seen
    return mpi_comm.allreduce(wrong), error


def _seen(mpi_comm, wrong, error):
    """(wrong results, an error) as every rank saw them, once any rank has seen either
    (a workload need go no further), else None."""
    if mpi_comm.allreduce(error is not None, op=MPI.LOR):
        return mpi_comm.allreduce(wrong), error or "another rank's call failed"
    if mpi_comm.allreduce(wrong > 0, op=MPI.LOR):
        return mpi_comm.allreduce(wrong), error
    return None


def _after_a_ring_call(comm, mpi_comm, rounds):
    """``rounds`` of: a ring allreduce into a strided ``out=``, async, whose last kernel
    (the unpacking of the result from workspace) the stand-in holds back for 20 ms (a
    word its stream waits for), polled until it has queued all its work and handed its
    workspace back; then, on another stream of the user's (the user's stream would order
    it after the ring call), a peer read with a strided input and a strided ``out=`` as
    large, while every rank polls: it takes that very workspace (the last buffer of its
    size class handed back, or the one before: for its result, or for its input) and
    writes it, and unless it waits for the ring call's work, the ring call unpacks what
    the peer call wrote. Returns (wrong results, an error) as every rank saw them."""
    from collectives.transport.device_call import DeviceCall

    wrong, error = 0, None
    device, dev = next(iter(comm._ctx.devices.values())), D.si.device()
    streams, gate = (D.new_stream(), D.new_stream()), np.zeros(1, np.uint32)
    n = 4097  # 16388 B: a size class of its own but for the ring call's tmp at 2 ranks
    real = DeviceCall.epilogue

    def held(call, stream):  # the ring call's last kernel (on the compute stream) waits for the gate
        if stream is device.compute:
            dev.wait_value(stream, gate, 0, gate[0] + 1)
        real(call, stream)

    DeviceCall.epilogue = held
    try:
        for k in range(rounds):
            xs = [rank_input(r, n, "float32") + k for r in range(comm.size)]
            try:
                ended, canvas = device.last_end, D.empty(2 * n, np.float32)
                with D.use_stream(streams[0]):
                    x = D.asarray(xs[comm.rank], stream=streams[0])
                    ring = comm.allreduce_async(x, out=canvas[::2], algorithm="ring", timeout=10)
                until = time.monotonic() + 10
                while device.last_end is ended and time.monotonic() < until:
                    comm.poll()
                with D.use_stream(streams[1]):
                    y = D.asarray(np.repeat(2 * xs[comm.rank], 2), stream=streams[1])[::2]
                    result = D.empty(2 * n, np.float32)
                    peer = comm.allreduce_async(y, out=result[::2], algorithm="one_shot", timeout=10)
                until = time.monotonic() + 0.02
                while time.monotonic() < until:
                    comm.poll()
                gate[0] += 1
                want = sum(xs)
                ring.wait()
                peer.wait()
                wrong += differs(want, D.asnumpy(canvas, stream=streams[0])[::2]) is not None
                wrong += differs(2 * want, D.asnumpy(result, stream=streams[1])[::2]) is not None
            except (cc.CollectiveError, D.si.StaleMapping) as exc:
                error = error or f"{type(exc).__name__}: {exc}"[:300]
            seen = _seen(mpi_comm, wrong, error)
            if seen:
                return seen
    finally:
        DeviceCall.epilogue = real
    return mpi_comm.allreduce(wrong), error


WORKLOAD_OF = {"no wait for the other routes' calls before": _after_a_ring_call,  # (the others: _workload)
               "kernel, registered arrays: no fence kernel at fence 1": functools.partial(_workload, registered=True)}


@pytest.mark.any_size
@pytest.mark.mpi(min_size=2)
def test_the_workload_passes_with_every_synchronisation(mpi_comm):
    """The mutation tests' workloads, unchanged: no wrong result, no error (so that their
    failures are the mutations', not the workloads')."""
    stand_in_only("the workload holds a stand-in stream back")
    for mechanism in MECHANISMS:
        comm = communicator(mechanism)
        assert _workload(comm, mpi_comm, 3) == (0, None), mechanism
        assert _workload(comm, mpi_comm, 3, collectives=LEADERS, held=comm.size - 1) == (0, None), mechanism
        assert _workload(comm, mpi_comm, 3, registered=True) == (0, None), mechanism
        assert _after_a_ring_call(comm, mpi_comm, 3) == (0, None), mechanism
        comm.free()


@pytest.mark.long
@pytest.mark.any_size
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_taking_out_any_synchronisation_makes_the_workload_fail(mpi_comm, monkeypatch, mutation):
    """With any one synchronisation of the peer-read path taken out, the
    stand-in gives wrong results or the call fails (a missing signal: the others time
    out, naming the rank). Broken communicators are left unfreed (see above)."""
    stand_in_only("a GPU may run the racing work in time")
    mechanism, owner, method, replacement = MUTATIONS[mutation]
    comm = communicator(mechanism)
    monkeypatch.setattr(owner, method, replacement(getattr(owner, method)))
    wrong, error = WORKLOAD_OF.get(mutation, _workload)(comm, mpi_comm, 6)
    monkeypatch.undo()
    assert wrong or error, f"{mutation}: every result right, no error: the stand-in let it pass"
    if error and "Timed out" in error and "another rank" not in error:
        assert " for rank" in error, f"{mutation}: a timeout that names no rank: {error}"


@pytest.mark.long
@pytest.mark.any_size
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mutation", sorted(set(MUTATIONS) - set(WORKLOAD_OF)))
def test_taking_out_any_synchronisation_makes_the_leaders_fail(mpi_comm, monkeypatch, mutation):
    """The same for the leaders (rank 0, broadcast's root, reads every input and writes
    every output; the others run no device work in the call): the last rank's input
    is the one held back, so the leader would read it too early, and the others would
    return before their outputs are written. (The leaders take no registered-array
    path, whose outputs another rank writes, and the ring call's workspace is
    one_shot's case alone.)"""
    stand_in_only("a GPU may run the racing work in time")
    mechanism, owner, method, replacement = MUTATIONS[mutation]
    comm = communicator(mechanism)
    monkeypatch.setattr(owner, method, replacement(getattr(owner, method)))
    wrong, error = _workload(comm, mpi_comm, 6, collectives=LEADERS, held=comm.size - 1)
    monkeypatch.undo()
    assert wrong or error, f"{mutation}: every result right, no error: the stand-in let it pass"
    if error and "Timed out" in error and "another rank" not in error:
        assert " for rank" in error, f"{mutation}: a timeout that names no rank: {error}"


@pytest.mark.any_size
@pytest.mark.mpi(min_size=2)
def test_an_in_kernel_wait_gives_up_and_names_the_rank(mpi_comm, monkeypatch):
    """kernel fences: rank 0 starts the call but never runs its second fence kernel; the
    others' fence kernels give up at their time limit (80% of the call's timeout) and
    the host raises naming rank 0."""
    comm = communicator("kernel")
    comm.allreduce(D.asarray(np.ones(10, np.float32)), algorithm="one_shot")
    if comm.rank == 0:
        monkeypatch.setattr(KERNEL, "_fence_kernel", _only_at(2, None)(KERNEL._fence_kernel))
    x = D.asarray(np.ones(1000, np.float32))
    if comm.rank == 0:
        comm.allreduce(x, algorithm="one_shot", timeout=20)  # it waits for nobody at fence 2
    else:
        with pytest.raises(cc.CollectiveTimeoutError, match="in-kernel fences waited 1.6 s for rank 0 to arrive"):
            comm.allreduce(x, algorithm="one_shot", timeout=2.0)
    mpi_comm.Barrier()


@pytest.mark.any_size
@pytest.mark.mpi(min_size=2)
def test_a_broken_communicator_stops_its_fence_kernels(mpi_comm, monkeypatch):
    """kernel fences: rank 0 never runs its second fence kernel; the others' would wait
    for it up to their time limit (here 300 s), but their host times out first (1.5 s):
    the communicator breaks, which stops them (PeerNode.release sets the word they
    look at), and their stream runs on within seconds, not minutes."""
    comm = communicator("kernel")
    comm.allreduce(D.asarray(np.ones(10, np.float32)), algorithm="one_shot")
    real = KERNEL._fence_kernel
    if comm.rank == 0:
        monkeypatch.setattr(KERNEL, "_fence_kernel", _only_at(2, None)(real))
    else:
        def patient(self, call, k, epoch):
            call.limit = 300.0
            return real(self, call, k, epoch)
        monkeypatch.setattr(KERNEL, "_fence_kernel", patient)
    x = D.asarray(np.ones(1000, np.float32))
    problems = []
    if comm.rank == 0:
        comm.allreduce(x, algorithm="one_shot", timeout=20)  # it waits for nobody at fence 2
    else:
        try:
            comm.allreduce(x, algorithm="one_shot", timeout=1.5)
            problems.append("no timeout")
        except cc.CollectiveTimeoutError as exc:
            if not re.search(r"Timed out after .*\(at fence 2 of 2 it waits for rank 0 to arrive\)", str(exc)):
                problems.append(f"another timeout: {exc}")
        node = _peer_state(comm)[0]
        until = time.monotonic() + 10
        while not node.backend.query(node.end_event) and time.monotonic() < until:
            time.sleep(0.01)
        if not node.backend.query(node.end_event):
            problems.append("the fence kernel still waits for rank 0 10 s after the communicator broke")
    monkeypatch.undo()
    agree(mpi_comm, problems)


# -- make bench-gpu's tool, on the stand-in -----------------------------------------------------------
@pytest.mark.any_size
def test_the_benchmark_measures_tunes_and_reports_on_the_stand_in(mpi_comm, tmp_path_factory):
    """bench/gpu_peer.py --quick: the floor of every mechanism, the copy, every
    contender; a device table auto can read; and --report's targets.md with every
    target (the ones without figures: not measured), its peer-report.md the same when it
    runs again, and no other file of the folder touched (a README stays as it was)."""
    stand_in_only("the benchmark's own check (make bench-gpu measures on a GPU)")
    from collectives.auto import TuningTable

    from bench_scripts import load

    peer = load("gpu_peer")

    folder = mpi_comm.bcast(str(tmp_path_factory.mktemp("bench")) if mpi_comm.rank == 0 else None)
    size = mpi_comm.Get_size()
    json_path, tuning = f"{folder}/peer-n{size}.json", f"{folder}/tuning.json"
    assert peer.main(["--device", "standin", "--quick", "--json", json_path, "--tune", tuning]) == 0
    problems = []
    if mpi_comm.rank == 0:
        rows = json.loads(open(json_path).read())["rows"]
        floors = {r["mechanism"] for r in rows if r["measure"] == "floor"}
        if floors != {"ipc", "host", "stream", "kernel"}:
            problems.append(f"floor rows {floors}")
        names = {(r["collective"], r["contender"]) for r in rows if r["measure"] == "collective"}
        for collective in ("allreduce", "allgather", "broadcast", "reduce_scatter"):
            for contender, _, _ in peer.contenders(collective):
                if (collective, contender) not in names:
                    problems.append(f"no {collective} {contender} row")
        if size > 1 and TuningTable.load(tuning, "device_tables").lookup("allreduce", 8, size) is None:
            problems.append("no device table for allreduce")
        if peer.FENCED_MARK in open(tuning).read():  # a call cannot choose its fences
            problems.append("the device tables name a stream-fenced contender")
        readme = f"{folder}/README.md"
        open(readme, "w").write("# results\n\nkept\n")
        reports = []
        for _ in range(2):
            peer.report(folder)
            reports.append(open(f"{folder}/{peer.REPORT}").read())
        text = reports[-1]
        targets = open(f"{folder}/targets.md").read()
        if open(readme).read() != "# results\n\nkept\n":
            problems.append(f"--report changed README.md: {open(readme).read()[:300]}")
        if reports[0] != reports[1] or text.count("| target | measured | bound |") != 1:
            problems.append(f"{peer.REPORT}: {text[:300]}")
        for needle in ("allreduce 64-256 MiB, 4 ranks", "allreduce 8 B-256 KiB, 2 ranks", "DDP on a CUDA model",
                       "auto on device arrays", "not measured"):
            if needle not in targets:
                problems.append(f"targets.md has no {needle!r}")
        judged = [line for line in targets.splitlines() if f"{size} ranks" in line
                  and re.search(r"\| (held|missed) \|$", line)]
        floor = open(f"{folder}/sync-floor.md").read()
        if not re.search(rf"\| {size} \| allreduce \| 8B \| \d+\.\d\d \|", floor):
            problems.append(f"sync-floor.md sets no stream-fenced leader beside the host-fenced: {floor[-600:]}")
        if size in (2, 4) and not judged:  # (the stand-in's figures: the floor, the small allreduces, auto)
            problems.append(f"targets.md judges no target at {size} ranks: {targets[:600]}")
    agree(mpi_comm, problems)


@pytest.mark.any_size
def test_the_probe_of_a_calls_parts_runs_on_the_stand_in(mpi_comm, tmp_path_factory):
    """bench/gpu_probe.py --quick: every probe's row, the token
    rings going round (not stuck), each part of a one_shot and a leader call timed, by
    each mechanism, on a plain and on a registered array, and of a host-fenced barrier."""
    stand_in_only("the probe's own check (make probe-gpu measures on a GPU)")
    from bench_scripts import load

    probe = load("gpu_probe")

    folder = mpi_comm.bcast(str(tmp_path_factory.mktemp("probe")) if mpi_comm.rank == 0 else None)
    path = f"{folder}/probe-n{mpi_comm.size}.json"
    assert probe.main(["--device", "standin", "--quick", "--json", path]) == 0
    problems = []
    if mpi_comm.rank == 0:
        rows = {r["probe"]: r for r in json.loads(open(path).read())["rows"]}
        for name in ("kernel+sync, one rank", "kernel+sync, every rank", "event, every rank",
                     "host epoch barrier (no device), a round", "host token ring, a hop",
                     "stream token ring, a hop"):
            if name not in rows or rows[name].get("stuck") or not rows[name]["p50_us"] > 0:
                problems.append(f"{name}: {rows.get(name)}")
        split = {f"{algorithm} 8 B, {mechanism}, {kind}": ("fence 1", "fence 2", "return", "sync", "whole")
                 for algorithm in ("one_shot", "leader") for mechanism in ("host", "stream")
                 for kind in ("plain", "registered")}
        split["barrier(device=), host"] = ("own work seen done", "every rank seen", "return", "whole")
        for name, names in split.items():
            parts = [rows.get(f"{name}: {part}") for part in names]
            if None in parts:
                problems.append(f"{name}: missing parts")
            elif not all(part["p50_us"] >= 0 for part in parts) or parts[-1]["p50_us"] <= 0:
                problems.append(f"{name}: {parts}")
    agree(mpi_comm, problems)


@pytest.mark.any_size
@pytest.mark.mpi(min_size=2)
def test_a_stall_warning_names_the_rank_a_fence_waits_for(mpi_comm, caplog):
    """stall_warn: while rank 0 keeps the others waiting at the first fence, they log
    which rank they wait for, and the call then completes with the right result."""
    import logging

    comm = communicator("host", stall_warn=0.2)
    comm.allreduce(D.asarray(np.ones(10, np.float32)), algorithm="one_shot")  # the window is made
    x = D.asarray(np.full(100, comm.rank + 1.0, np.float32))
    if comm.rank == 0:
        time.sleep(0.8)
    with caplog.at_level(logging.WARNING, logger="collectives"):
        got = comm.allreduce(x, algorithm="one_shot")
    problems = [] if np.array_equal(D.asnumpy(got), np.full(100, comm.size * (comm.size + 1) / 2)) else ["wrong"]
    if comm.rank != 0 and not any("waiting at fence 1 of 2 for rank 0 to arrive" in r.getMessage()
                                  for r in caplog.records):
        problems.append(f"no stall warning naming rank 0: {[r.getMessage() for r in caplog.records]}")
    comm.free()
    agree(mpi_comm, problems)
