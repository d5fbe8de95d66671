"""The lean path of blocking peer-read calls on device arrays
(``calls.lean_device_call``, ``routes.peer``), through the stand-in GPU at every world
size the MPI suite runs (``--device cuda``: on a GPU), with each fence mechanism.

A warm blocking call of a kind seen before skips the general path (the checks, the
gate, the Call record, the engine) and runs its kept plan at once. Here: it gives the
general path's bits, call after call; it is really taken (the general path is made to
fail meanwhile); a warm loop makes no event, plan, allocation or MPI call; it leaves
what it cannot take to the general path; and it fails as the general path does: a size
mismatch or a different call raises on every rank at the first fence, a rank that does
not come is named by the timeout. The general path is forced by making
``calls.lean_device_call`` decline.
"""

import gc

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc
from collectives import calls
from collectives.algorithms import PEER_READS, block_bounds
from collectives.device import bfloat16
from collectives.routes import LeanEntry
from collectives.routes.base import compiled_plan
from collectives.routes.peer import PeerRead
from collectives.specs import SPECS
from collectives.transport import peer_memory

from conftest import agree, expected_result, order_sensitive_input, rank_input, serial_fold
from device_under_test import select

D = None  # the device under test: the stand-in, or a GPU with --device cuda
MECHANISMS = ["host", "stream", "kernel"]
# The blocking collectives the device lean path takes.
LEAN_PEERS = sorted((c, a) for c, a in PEER_READS if SPECS[c].lean)


@pytest.fixture(scope="module", autouse=True)
def device_under_test(request):
    global D
    D = select(request.config.getoption("--device"), MPI.COMM_WORLD.Get_rank())
    yield D


def communicator(mechanism, **options):
    """A communicator whose peer-read state is made (the general path's first calls):
    the device negotiated, the node's window, the events pooled."""
    if mechanism == "kernel" and D.name == "cuda" and MPI.COMM_WORLD.Get_size() > D.cupy.cuda.runtime.getDeviceCount():
        pytest.skip("the fence kernel on a GPU the ranks share: test_gpu.py tests it in one process")
    comm = cc.Communicator(device_fence=mechanism, **options)
    comm.allreduce(D.asarray(np.ones(1, np.float32)), algorithm="direct")  # the negotiation
    comm.allreduce(D.asarray(np.ones(1, np.float32)), algorithm="one_shot", timeout=60)  # the peer-read state
    return comm


_COMMS = {}


@pytest.fixture(scope="module", autouse=True)
def _free_communicators():
    yield
    for comm in _COMMS.values():
        comm.free()
    _COMMS.clear()


@pytest.fixture(params=MECHANISMS)
def lcomm(request, device_under_test):
    """A communicator for each fence mechanism, made once per module."""
    if request.param not in _COMMS:
        _COMMS[request.param] = communicator(request.param)
    return _COMMS[request.param]


class Spy:
    """``calls.lean_device_call``, counted: ``taken`` calls it ran, ``declined`` it left
    to the general path; with ``lean = False`` it declines every call (the general path)."""

    def __init__(self, monkeypatch):
        self.real, self.lean, self.taken, self.declined = calls.lean_device_call, True, 0, 0
        monkeypatch.setattr(calls, "lean_device_call", self)

    def __call__(self, *args):
        if not self.lean:
            return calls.NOT_HANDLED
        result = self.real(*args)
        if result is calls.NOT_HANDLED:
            self.declined += 1
        else:
            self.taken += 1
        return result


@pytest.fixture
def spy(monkeypatch):
    return Spy(monkeypatch)


def no_general_path(monkeypatch):
    """Make the general path of a device call fail: what runs meanwhile is the lean path."""
    def general(*args, **kwargs):
        raise AssertionError("the general path ran")

    monkeypatch.setattr(calls, "gate", general)
    monkeypatch.setattr(PeerRead, "run", general)


def call(comm, collective, x, algorithm, op="sum", root=0, out=None, **kw):
    if collective == "allreduce":
        return comm.allreduce(x, op=op, algorithm=algorithm, out=out, **kw)
    if collective == "allgather":
        return comm.allgather(x, algorithm=algorithm, out=out, **kw)
    if collective == "reduce_scatter":
        return comm.reduce_scatter(x, op=op, algorithm=algorithm, out=out, **kw)
    if collective == "broadcast":
        return comm.broadcast(x, root=root, algorithm=algorithm, **kw)
    return comm.reduce(x, root=root, op=op, algorithm=algorithm, out=out, **kw)


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


# -- results --------------------------------------------------------------------------------------
@pytest.mark.parametrize("collective,algorithm", LEAN_PEERS)
def test_the_lean_path_gives_the_general_paths_bits(lcomm, mpi_comm, spy, collective, algorithm):
    """Every way of passing the result (a new array, out=, in place), dtypes and ops,
    both ends as roots, two shapes, a few rounds each: lean and general alike, bit for
    bit, and NumPy's answer; every lean call taken."""
    comm, problems = lcomm, []
    size, rank = comm.size, comm.rank
    spy.taken = spy.declined = 0
    roots = sorted({0, size - 1}) if SPECS[collective].rooted else [0]
    kinds = ((np.int32, "sum"), (np.float32, "avg"), (np.float64, "max")) if SPECS[collective].reduces else \
        ((np.int32, "-"), (np.float64, "-"))
    hows = {"allreduce": ("fresh", "out", "inplace"), "reduce": ("fresh", "out", "inplace"),
            "allgather": ("fresh", "out"), "reduce_scatter": ("fresh", "out"),
            "broadcast": ("fresh",)}[collective]  # (broadcast works in x itself)
    for how in hows:
        for dtype, op in kinds:
            for shape in ((37,), (3, 5)):
                for root in roots:
                    for round_ in range(3):
                        xs = [(rank_input(r, int(np.prod(shape)), dtype, op if op != "-" else "sum") + round_)
                              .reshape(shape) for r in range(size)]
                        label = f"{how} {np.dtype(dtype).name} {op} {shape} root {root} round {round_}"
                        results = {}
                        for path in ("lean", "general"):
                            spy.lean = path == "lean"
                            taken = spy.taken
                            x = D.asarray(xs[rank] if collective != "broadcast" or rank == root else 0 * xs[rank])
                            result_shape = SPECS[collective].result_shape(shape, int(np.prod(shape)), size, rank)
                            out = {"fresh": None, "out": D.asarray(np.full(result_shape, 7, dtype)),
                                   "inplace": x}[how]
                            if how == "inplace" and collective == "reduce" and rank != root:
                                out = None
                            got = call(comm, collective, x, algorithm, op, root, out)
                            leaf = SPECS[collective].root_result and rank != root
                            if out is not None and got is not (None if leaf else out):
                                problems.append(f"{path} {label}: the result is not the out array")
                            if collective == "broadcast" and got is not x:
                                problems.append(f"{path} {label}: broadcast did not return x")
                            results[path] = host_of(got)
                            if path == "lean" and spy.taken != taken + 1:
                                problems.append(f"{label}: the lean path did not take it")
                        problem = differs(results["general"], results["lean"])
                        if problem:
                            problems.append(f"{label}: lean vs general: {problem}")
                        want = expected_result(collective, rank, size, xs, op if op != "-" else "sum", root)
                        if want is not None:
                            want = np.asarray(want, dtype).reshape(results["lean"].shape)
                        problem = differs(want, results["lean"])
                        if problem:
                            problems.append(f"{label}: lean vs NumPy: {problem}")
    if spy.declined:
        problems.append(f"the lean path declined {spy.declined} calls")
    agree(mpi_comm, problems)


def test_many_calls_give_the_general_paths_bits(lcomm, mpi_comm, spy):
    """A hundred rounds of order-sensitive floats (the fold's order shows in the bits),
    both allreduce algorithms, into a kept out= and in place: the lean path's bits are
    the general path's and the serial fold's, call after call."""
    comm, problems = lcomm, []
    size, rank = comm.size, comm.rank
    spy.taken = spy.declined = 0
    outs = [D.empty(257, np.float32) for _ in range(2)]
    for round_ in range(100):
        inputs = [order_sensitive_input(r, 257, "float32", "sum", seed=round_) for r in range(size)]
        want = serial_fold("sum", inputs)
        algorithm = ("one_shot", "two_shot")[round_ % 2]
        spy.lean = True
        lean_out = comm.allreduce(D.asarray(inputs[rank]), algorithm=algorithm, out=outs[round_ % 2])
        x = D.asarray(inputs[rank])
        comm.allreduce(x, algorithm=algorithm, out=x)
        spy.lean = False
        general = comm.allreduce(D.asarray(inputs[rank]), algorithm=algorithm)
        for what, got in (("out=", lean_out), ("in place", x)):
            problem = differs(host_of(general), host_of(got)) or differs(want, host_of(got))
            if problem:
                problems.append(f"round {round_} {algorithm} {what}: {problem}")
    if spy.taken != 200 or spy.declined:
        problems.append(f"the lean path took {spy.taken} of 200 calls, declined {spy.declined}")
    agree(mpi_comm, problems)


def test_deterministic_mode_and_the_users_stream_on_the_lean_path(mpi_comm, spy):
    """Deterministic mode: the serial fold, 16-bit floats too. The input written by a
    copy still queued on the user's own stream, the result read through it."""
    comm, problems = communicator("host", deterministic=True), []
    size, rank = comm.size, comm.rank
    spy.taken = spy.declined = lean = 0  # (the set-up's calls: before the device was set up)
    mine = D.new_stream()
    with D.use_stream(mine):
        for dtype in ("float32", "float16"):
            for op in ("sum", "max"):
                inputs = [order_sensitive_input(r, 3000, dtype, op) for r in range(size)]
                want = serial_fold(op, inputs)
                for algorithm in ("one_shot", "two_shot", "auto"):
                    if algorithm == "auto":  # (one rank: auto may pick no peer read, and the lean path leaves it)
                        peer = ("allreduce", comm.choose("allreduce", 3000 * np.dtype(dtype).itemsize, True)[0])
                        lean += 2 if peer in PEER_READS else 0
                    else:
                        lean += 2
                    for _ in range(2):  # the second: the kind is known
                        x = D.empty(3000, dtype)
                        D.copy_async(x, inputs[rank], mine)
                        got = comm.allreduce(x, op=op, algorithm=algorithm, out=x)
                        problem = differs(want, D.asnumpy(got, stream=mine))
                        if problem:
                            problems.append(f"{dtype} {op} {algorithm}: {problem}")
    if spy.taken != lean or spy.taken + spy.declined != 24:
        problems.append(f"the lean path took {spy.taken} of 24 calls (not {lean}), declined {spy.declined}")
    comm.free()
    agree(mpi_comm, problems)


# -- what a warm call costs ------------------------------------------------------------------------------
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


@pytest.mark.any_size
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_warm_lean_loop_allocates_builds_and_sends_nothing(mpi_comm, monkeypatch, mechanism):
    """With the general path made to fail: every lean collective, in place and into
    out=, forty calls; no device allocation, no event, no plan built or even looked up,
    no IPC handle opened, no MPI call on any of the communicator's MPI communicators, no
    request in the engine; two fences per call; the results right."""
    comm = communicator(mechanism)
    size, rank, last = comm.size, comm.rank, comm.size - 1
    xs = [rank_input(r, 1000, "float32", "max") for r in range(size)]
    y, z = D.asarray(xs[rank]), D.asarray(xs[rank])
    gathered, total = D.empty((size, 100), np.float32), D.empty(1000, np.float32)
    root_in = D.asarray(xs[rank])
    lo, hi = block_bounds(1000, size)[rank : rank + 2]
    block = D.empty(hi - lo, np.float32)

    def loop():
        comm.allreduce(y, out=y, op="max", algorithm="one_shot")
        comm.allreduce(z, out=total, algorithm="two_shot")
        comm.allgather(z[:100], out=gathered, algorithm="one_shot")
        comm.broadcast(root_in, root=last, algorithm="one_shot")
        comm.reduce(z, root=0, out=total if rank == 0 else None, algorithm="one_shot")
        comm.reduce_scatter(z, out=block, algorithm="one_shot")

    loop()  # warm: the lean entries made, every buffer opened, the window slot made
    gc.collect()
    device = next(iter(comm._ctx.devices.values()))
    node, memory = device.peer, peer_memory.peer_memory(device.backend)
    plans = compiled_plan.cache_info()
    before = (memory.counters.copy(), D.counters(), node.counters.copy(), len(comm._ctx.lean_entries))
    ctx = comm._ctx
    proxies = {name: Counting(getattr(ctx, name)) for name in ("comm", "node_comm", "p2p_comm")}
    for name, proxy in proxies.items():
        setattr(ctx, name, proxy)
    requests = ctx.progress.entries
    rounds = 8
    no_general_path(monkeypatch)
    try:
        for _ in range(rounds):
            loop()
    finally:
        for name, proxy in proxies.items():
            setattr(ctx, name, proxy.comm)
        monkeypatch.undo()
    after = (memory.counters.copy(), D.counters(), node.counters.copy(), len(comm._ctx.lean_entries))
    problems = []
    if after[0] != before[0]:
        problems.append(f"IPC: {dict(before[0])} -> {dict(after[0])}")
    if after[1] != before[1]:
        problems.append(f"device: {before[1]} -> {after[1]}")
    if compiled_plan.cache_info() != plans:
        problems.append(f"plans: {plans} -> {compiled_plan.cache_info()}")
    if after[3] != before[3]:
        problems.append(f"lean entries: {before[3]} -> {after[3]}")
    mpi = {name: proxy.calls for name, proxy in proxies.items() if proxy.calls}
    if mpi or ctx.progress.entries != requests:
        problems.append(f"MPI: {mpi}, requests {requests} -> {ctx.progress.entries}")
    calls_made = 6 * rounds
    fences = after[2]["fences"] - before[2]["fences"]
    host = after[2]["host meetings"] - before[2]["host meetings"]
    if after[2]["calls"] - before[2]["calls"] != calls_made:
        problems.append(f"{after[2]['calls'] - before[2]['calls']} peer-read calls, not {calls_made}")
    # two fences a call (and no MPI call, above); the hosts wait at both with host
    # fences, at the first only (to see where the buffers are) with stream and kernel ones
    if size > 1 and (fences != 2 * calls_made or host != (2 if mechanism == "host" else 1) * calls_made):
        problems.append(f"{fences} fences, {host} meetings of the hosts, in {calls_made} calls")
    if differs(np.maximum.reduce(xs), D.asnumpy(y)):
        problems.append("allreduce one_shot in place: wrong result")
    if differs(np.stack([x[:100] for x in xs]), D.asnumpy(gathered)):
        problems.append("allgather: wrong result")
    if differs(xs[last], D.asnumpy(root_in)):
        problems.append("broadcast: wrong result")
    if rank == 0 and differs(sum(xs), D.asnumpy(total)):
        problems.append("reduce: wrong result")
    if differs(sum(xs)[lo:hi], D.asnumpy(block)):
        problems.append("reduce_scatter: wrong result")
    comm.free()
    agree(mpi_comm, problems)


def test_a_lean_entry_keeps_the_route_algorithm_plan_and_code(mpi_comm, spy):
    """auto resolved once (its choice kept, as comm.choose names it), the plan and the
    call's code kept beside it."""
    comm = communicator("host")
    choice = comm.choose("allreduce", 8, device=True)
    if ("allreduce", choice[0]) not in PEER_READS:  # (the same on every rank)
        comm.free()
        pytest.skip(f"auto picks {choice[0]} here, no peer read")
    spy.taken = spy.declined = 0
    x = D.asarray(np.ones(2, np.float32))
    comm.allreduce(x, out=x)
    comm.allreduce(x, out=x)
    entries = [e for key, e in comm._ctx.lean_entries.items()
               if key[1] is SPECS["allreduce"] and key[2] == "auto" and isinstance(e, LeanEntry)]
    problems = []
    if len(entries) != 1 or entries[0].route is not calls.PEER or entries[0].algorithm != choice[0]:
        problems.append(f"entries {entries!r}, auto chose {choice}")
    elif entries[0].plan is None or not entries[0].code:
        problems.append("no plan or code kept")
    if spy.taken != 2 or differs(np.full(2, comm.size ** 2, np.float32), D.asnumpy(x)):
        problems.append(f"taken {spy.taken}, result {D.asnumpy(x)}")
    comm.free()
    agree(mpi_comm, problems)


# -- what the lean path leaves to the general path -------------------------------------------------------
def test_calls_the_lean_path_refuses_take_the_general_path(mpi_comm, spy):
    """A strided input, an out that overlaps x, a call in flight, a bfloat16-marked
    array, check mode, stall warnings, no CUDA IPC: right results through the general
    path, nothing learnt for them."""
    comm, problems = communicator("host"), []
    size, rank = comm.size, comm.rank
    spy.taken = spy.declined = 0
    xs = [rank_input(r, 64, "float64") for r in range(size)]
    total = sum(xs)
    wide = D.asarray(np.repeat(xs[rank], 2))
    if differs(total, D.asnumpy(comm.allreduce(wide[::2], algorithm="one_shot"))):
        problems.append("strided")
    both = D.asarray(np.concatenate([xs[rank], np.zeros(3)]))
    comm.allreduce(both[:64], algorithm="one_shot", out=both[3:67])
    if differs(total, D.asnumpy(both)[3:67]):
        problems.append("out overlapping x")
    handle = comm.allreduce_async(D.asarray(xs[rank]), algorithm="two_shot")
    blocking = comm.allreduce(D.asarray(xs[rank]), algorithm="one_shot")
    if differs(total, D.asnumpy(blocking)) or differs(total, D.asnumpy(handle.wait())):
        problems.append("a blocking call after one in flight")
    if spy.taken or spy.declined != 3:
        problems.append(f"taken {spy.taken}, declined {spy.declined} (not 0 and 3)")
    one = np.array([1.0], np.float32).view(np.uint32) >> 16  # bfloat16's 1.0, and the sum's bits
    want = (np.array([float(size)], np.float32).view(np.uint32) >> 16).astype(np.uint16)
    marked = comm.allreduce(bfloat16(D.asarray(np.repeat(one.astype(np.uint16), 4))), algorithm="one_shot")
    if not isinstance(marked, bfloat16) or differs(np.repeat(want, 4), host_of(marked)):
        problems.append(f"bfloat16: {host_of(marked)}")
    if spy.taken or spy.declined != 3:
        problems.append("a bfloat16-marked array reached the lean path")
    for options in ({"check": True}, {"stall_warn": 3600.0}):
        other = communicator("host", **options)
        for _ in range(2):
            if differs(total, D.asnumpy(other.allreduce(D.asarray(xs[rank]), algorithm="one_shot"))):
                problems.append(f"{options}: wrong result")
        learnt = [e for e in other._ctx.lean_entries.values() if e is not False]
        if learnt or spy.taken:
            problems.append(f"{options}: learnt {learnt}, taken {spy.taken}")
        other.free()
    if size > 1:  # without CUDA IPC auto takes a message-based algorithm, and one_shot raises
        other = cc.Communicator(device_fence="host", cuda_ipc=False)
        other.allreduce(D.asarray(np.ones(1, np.float32)), algorithm="direct")
        declined = spy.declined
        for _ in range(2):
            if differs(total, D.asnumpy(other.allreduce(D.asarray(xs[rank])))):
                problems.append("no IPC: auto gave a wrong result")
        with pytest.raises(ValueError, match="which some ranks of this node cannot open"):
            other.allreduce(D.asarray(xs[rank]), algorithm="one_shot")
        if spy.taken or spy.declined != declined + 3:
            problems.append(f"no IPC: taken {spy.taken}, declined {spy.declined - declined} (not 0 and 3)")
        other.free()
    comm.free()
    agree(mpi_comm, problems)


# -- failures ------------------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_mismatched_calls_raise_on_every_rank_on_the_lean_path(mpi_comm, monkeypatch, mechanism):
    """Both kinds known on every rank, so each rank's call takes the lean path (the
    general one fails if it runs): a size mismatch and a different call raise on every
    rank at the first fence, and the communicator is broken after."""
    # The broken communicators are not freed: a failure notice the ranks sent each other
    # may still be unreceived, and MPI hands a freed communicator's context to the next.
    problems = []
    comm = communicator(mechanism)
    for count in (64, 96):
        comm.allreduce(D.asarray(np.ones(count, np.float32)), algorithm="one_shot")
    no_general_path(monkeypatch)
    count = 64 if comm.rank else 96
    with pytest.raises(cc.MessageSizeError, match="rank 0 called it with 384 B|this rank has 384 B"):
        comm.allreduce(D.asarray(np.ones(count, np.float32)), algorithm="one_shot")
    monkeypatch.undo()
    with pytest.raises(cc.CollectiveError, match="broken"):
        comm.allreduce(D.asarray(np.ones(64, np.float32)), algorithm="one_shot")
    comm = communicator(mechanism)
    x = D.asarray(np.ones(60, np.float32))
    comm.allreduce(x, algorithm="one_shot", timeout=30)
    comm.allgather(x, algorithm="one_shot", timeout=30)
    no_general_path(monkeypatch)
    with pytest.raises(cc.CollectiveMismatchError, match="is in a different call"):
        if comm.rank == 0:
            comm.allreduce(x, algorithm="one_shot", timeout=30)
        else:
            comm.allgather(x, algorithm="one_shot", timeout=30)
    monkeypatch.undo()
    agree(mpi_comm, problems)


@pytest.mark.any_size
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mechanism,where", [(m, "call") for m in MECHANISMS] + [("host", "communicator")])
def test_a_rank_that_does_not_call_is_named_by_the_lean_timeout(mpi_comm, monkeypatch, mechanism, where):
    """The kind known everywhere, then rank 0 stays away: the others' lean call times
    out (its own timeout, or the communicator's) naming rank 0 and where it waits."""
    options = {"timeout": 2.0} if where == "communicator" else {}
    timeout = {} if where == "communicator" else {"timeout": 1.0}
    comm = communicator(mechanism, **options)
    comm.allreduce(D.asarray(np.ones(1000, np.float32)), algorithm="two_shot", **timeout)
    if comm.rank != 0:
        no_general_path(monkeypatch)
        wait = "waiting at fence 1 of 2 for rank 0 to arrive"
        with pytest.raises(cc.CollectiveTimeoutError, match=f"two_shot.*Timed out after .*{wait}"):
            comm.allreduce(D.asarray(np.ones(1000, np.float32)), algorithm="two_shot", **timeout)
        monkeypatch.undo()
        with pytest.raises(cc.CollectiveError, match="broken"):
            comm.allreduce(D.asarray(np.ones(1000, np.float32)), algorithm="two_shot", **timeout)
    mpi_comm.Barrier()  # (the communicator is broken on the ranks that waited: not freed)
