"""The device path, through the stand-in GPU (``collectives.device.standin``), at every
world size the MPI suite runs (1 serially, 2-8 under mpiexec); ``--device cuda`` runs
the same tests on a GPU (``make test-gpu``).

The stand-in runs queued copies and kernels only when something waits for them, and
then in a random order across streams; new memory holds garbage. So a wait missing
from the executor gives wrong data here, every run, instead of a rare race on a GPU.
Every result is compared with the host path's, bit for bit, on the same inputs, and
with NumPy; the three ways of moving device messages (CUDA IPC between ranks of a
node, staging through pinned host memory, and CUDA-aware MPI) each run everything.
"""

import json
import re

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc
from collectives import mpi_library
from collectives.algorithms import PEER_READS, SHARED_MEMORY, block_bounds
from collectives.device import bfloat16
from collectives.transport import retired
from collectives.transport.liveness import Liveness

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


@pytest.fixture(scope="module", autouse=True)
def device_under_test(request):
    global D
    D = select(request.config.getoption("--device"), MPI.COMM_WORLD.Get_rank())
    if D.name == "cuda":  # on a GPU, the paths the machine has
        from collectives.transport.device import cuda_aware_mpi
        if not cuda_aware_mpi():
            PATHS.pop("cuda-aware", None)
    yield D


def stand_in_only(what):
    if D.name != "standin":
        pytest.skip(f"{what}: a property of the stand-in itself")

PATHS = {  # Communicator options for each way of moving device messages
    "ipc": {},
    "ipc-capped": {"ipc_memory": 128 << 10},  # two slots: most segments go staged beside them
    "staged": {"cuda_ipc": False},
    "cuda-aware": {"cuda_ipc": False, "cuda_aware": True},
}
SEGMENT = 256  # bytes per device segment: the larger calls here are cut into several
# shm runs on host arrays only (it reduces in a shared window of host memory): left
# out here; test_shm_refuses_device_arrays checks that it says so.
# The peer-read algorithms (one_shot, two_shot) need CUDA IPC between every pair of
# ranks, so the staged and CUDA-aware paths cannot run them: test_device_peer.py has
# them.
ALGORITHMS = [(c, a) for c in cc.COLLECTIVES for a in cc.algorithms(c)
              if (c, a) not in SHARED_MEMORY and (c, a) not in PEER_READS]
ALLREDUCE = [a for c, a in ALGORITHMS if c == "allreduce"]
REDUCING = ("allreduce", "reduce_scatter", "reduce")


def device_communicator(path, **options):
    """A communicator whose device messages go ``path``'s way (agreed by the ranks at its
    first device call, made here)."""
    comm = cc.Communicator(device_segment_size=options.pop("device_segment_size", SEGMENT), **PATHS[path], **options)
    comm.allreduce(D.asarray(np.ones(1, np.float32)))  # the negotiation
    comm.test_path = path
    return comm


_COMMS = {}  # path -> its communicator, made once per module run


def _communicator_for(path):
    if path not in PATHS:
        pytest.skip(f"MPI here is not CUDA-aware: no {path} path to test")
    if path not in _COMMS:
        comm = _COMMS[path] = device_communicator(path)
        expected = "ipc" if path.startswith("ipc") else path
        ctx = next(iter(comm._ctx.devices.values()))
        assert all(p == expected for peer, p in ctx.paths.items() if peer != comm.rank), ctx.paths
    return _COMMS[path]


@pytest.fixture(scope="module", autouse=True)
def _free_communicators():
    yield
    for comm in _COMMS.values():
        comm.free()
    _COMMS.clear()


@pytest.fixture(params=["ipc", "staged", "cuda-aware"])
def dcomm(request, device_under_test):
    """A device communicator for each way of moving device messages."""
    return _communicator_for(request.param)


@pytest.fixture(params=["ipc", "ipc-capped", "staged", "cuda-aware"])
def dcomm_sweep(request, device_under_test):
    """Those, and IPC with slots for two segments only (the rest go staged beside them)."""
    return _communicator_for(request.param)


@pytest.fixture
def dcomm_ipc(device_under_test):
    """The IPC communicator alone: where dtypes, not message paths, are what is tested."""
    return _communicator_for("ipc")


def call(comm, collective, x, algorithm, op="sum", root=0, out=None):
    if collective == "allreduce":
        return comm.allreduce(x, op=op, algorithm=algorithm, out=out)
    if collective == "reduce_scatter":
        return comm.reduce_scatter(x, op=op, algorithm=algorithm, out=out)
    if collective == "allgather":
        return comm.allgather(x, algorithm=algorithm, out=out)
    if collective == "broadcast":
        return comm.broadcast(x, root=root, algorithm=algorithm)
    if collective in ("gather", "scatter"):
        return getattr(comm, collective)(x, root=root, algorithm=algorithm, out=out)
    if collective == "alltoall":
        return comm.alltoall(x, algorithm=algorithm, out=out)
    return comm.reduce(x, root=root, op=op, algorithm=algorithm, out=out)


def host_and_device(comm, collective, algorithm, host_x, op="sum", root=0):
    """The same call on the host and on the stand-in device: (host result, device
    result on the host, the device input afterwards)."""
    want = call(comm, collective, host_x.copy(), algorithm, op, root)
    x = D.asarray(host_x)
    got = call(comm, collective, x, algorithm, op, root)
    got = None if got is None else D.asnumpy(got)
    return want, got, D.asnumpy(x)


def differs(want, got, bits=True):
    """A description of how ``got`` differs from ``want`` (None if not): bit for bit, or
    with ``bits=False`` by value, where only a zero's sign may differ.

    Value is for ``auto``, where the host and the device may each choose another
    schedule: integer-valued inputs make every fold order give the same values, but the
    sign of a complex product's zero imaginary part follows the order ((-1)(-1) gives -0
    one way round and +0 the other)."""
    if want is None or got is None:
        return None if want is None and got is None else f"one is None: host {want}, device {got}"
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"device {got.dtype}{got.shape} vs host {want.dtype}{want.shape}"
    same = got.tobytes() == want.tobytes() if bits else np.array_equal(got, want, equal_nan=want.dtype.kind in "fc")
    if not same:
        return f"device {got.ravel()[:4]} vs host {want.ravel()[:4]}"
    return None


@pytest.mark.long
@pytest.mark.parametrize("collective,algorithm", ALGORITHMS)
def test_every_collective_and_algorithm_equals_the_host_path(dcomm_sweep, mpi_comm, collective, algorithm):
    comm, problems = dcomm_sweep, []
    roots = sorted({0, comm.size - 1}) if collective in ("broadcast", "reduce", "gather", "scatter") else [0]
    # every count on the IPC path; the other two move the same segments, so fewer there
    counts = counts_for(comm.size, large=False) + [1000] if comm.test_path == "ipc" else [0, comm.size + 1, 1000]
    for count in counts:
        for root in roots:
            rows = (comm.size, count) if collective in ("scatter", "alltoall") else None  # a row per rank
            xs = [rank_input(r, count * comm.size if rows else count, "float32", shape=rows)
                  for r in range(comm.size)]
            x = xs[comm.rank].copy()
            if collective == "broadcast" and comm.rank != root:
                x[...] = 0
            want, got, after = host_and_device(comm, collective, algorithm, x, "sum", root)
            label = f"{collective}/{algorithm} n={count} root={root}"
            problem = differs(want, got)
            numpy = expected_result(collective, comm.rank, comm.size, xs, "sum", root)
            if problem:
                problems.append(f"{label}: {problem}")
            elif numpy is not None and not np.array_equal(got, numpy):
                problems.append(f"{label}: {got[:4]} != numpy {numpy[:4]}")
            if collective != "broadcast" and after.tobytes() != x.tobytes():
                problems.append(f"{label}: the device input was modified")
    agree(mpi_comm, problems)


@pytest.mark.long
@pytest.mark.parametrize("collective,algorithm", [ca for ca in ALGORITHMS if ca[0] in REDUCING])
def test_every_dtype_and_op_equals_the_host_path(dcomm_ipc, mpi_comm, collective, algorithm):
    """Once, on the IPC path: the paths move bytes, dtypes matter to the kernels."""
    comm, problems = dcomm_ipc, []
    for dtype in ALL_DTYPES:
        for op in ops_for(dtype):
            xs = [rank_input(r, 37, dtype, op) for r in range(comm.size)]
            want, got, _ = host_and_device(comm, collective, algorithm, xs[comm.rank], op, comm.size - 1)
            problem = differs(want, got, bits=algorithm != "auto")
            if problem:
                problems.append(f"{collective}/{algorithm} {dtype} {op}: {problem}")
    agree(mpi_comm, problems)


@pytest.mark.long
@pytest.mark.parametrize("algorithm", ALLREDUCE)
def test_allreduce_in_place_out_and_strided(dcomm_sweep, mpi_comm, algorithm):
    comm, problems = dcomm_sweep, []
    shift = len(algorithm)  # other values than the previous algorithm's: stale workspace cannot pass
    xs = [(rank_input(r, 6 * 7, "int32") + shift).reshape(6, 7) for r in range(comm.size)]
    want = comm.allreduce(xs[comm.rank], algorithm="native")
    # in place
    x = D.asarray(xs[comm.rank])
    if comm.allreduce(x, algorithm=algorithm, out=x) is not x or differs(want, D.asnumpy(x)):
        problems.append("in place")
    # into a given out
    out = D.empty((6, 7), np.int32)
    if comm.allreduce(D.asarray(xs[comm.rank]), algorithm=algorithm, out=out) is not out or \
            differs(want, D.asnumpy(out)):
        problems.append("out=")
    # a strided input and a strided out (every other column of a wider array)
    wide = D.asarray(np.repeat(xs[comm.rank], 2, axis=1))
    canvas = D.asarray(np.full((6, 14), -1, np.int32))
    got = comm.allreduce(wide[:, ::2], algorithm=algorithm, out=canvas[:, 1::2])
    host = D.asnumpy(canvas)
    if differs(want, np.ascontiguousarray(host[:, 1::2])) or (host[:, ::2] != -1).any():
        problems.append(f"strided in and out: {host[0]}")
    if got is None or got.shape != (6, 7):
        problems.append("strided out: not returned")
    # in place on a strided view
    view = D.asarray(np.repeat(xs[comm.rank], 2, axis=0))[::2]
    comm.allreduce(view, algorithm=algorithm, out=view)
    if differs(want, D.asnumpy(view)):
        problems.append("in place, strided")
    # out overlapping x without being x: x is read before out is written
    both = D.asarray(np.concatenate([xs[comm.rank].ravel(), np.zeros(3, np.int32)]))
    comm.allreduce(both[:42], algorithm=algorithm, out=both[3:45])
    if differs(want.ravel(), D.asnumpy(both)[3:45]):
        problems.append("out overlapping x")
    agree(mpi_comm, problems)


@pytest.mark.parametrize("algorithm", cc.algorithms("scatter"))
def test_scatter_into_a_device_out_with_no_x_on_the_other_ranks(dcomm, mpi_comm, algorithm):
    comm, problems = dcomm, []
    root = comm.size - 1
    rows = np.arange(comm.size * 7, dtype=np.float32).reshape(comm.size, 7)
    out = D.asarray(np.full(7, -1, np.float32))
    got = comm.scatter(D.asarray(rows) if comm.rank == root else None, root=root, algorithm=algorithm, out=out)
    if differs(rows[comm.rank], D.asnumpy(got)) or differs(rows[comm.rank], D.asnumpy(out)):
        problems.append(f"{D.asnumpy(out)} != {rows[comm.rank]}")
    agree(mpi_comm, problems)


@pytest.mark.parametrize("algorithm", cc.algorithms("alltoallv"))
def test_alltoallv_equals_the_host_path(dcomm, mpi_comm, algorithm):
    """Uneven blocks, empty ones included, in a fresh result and in a given device out."""
    comm, problems = dcomm, []
    i, j = np.indices((comm.size, comm.size))
    for matrix in ((i + 2 * j) % 4 * 97, np.where(j == 0, 5, 0)):
        xs = [rank_input(r, int(matrix[r].sum()) * 3, "float32").reshape(-1, 3) for r in range(comm.size)]
        send, recv = matrix[comm.rank], matrix[:, comm.rank]
        want = comm.alltoallv(xs[comm.rank], send, algorithm=algorithm)
        got = D.asnumpy(comm.alltoallv(D.asarray(xs[comm.rank]), send, algorithm=algorithm))
        out = D.empty((int(recv.sum()), 3), np.float32)
        given = comm.alltoallv(D.asarray(xs[comm.rank]), send, recv, algorithm=algorithm, out=out)
        blocks = [np.split(x, np.cumsum(counts)[:-1]) for x, counts in zip(xs, matrix)]
        numpy = np.concatenate([blocks[r][comm.rank] for r in range(comm.size)])
        for label, result in (("fresh", got), ("out", D.asnumpy(given) if given is out else None)):
            problem = differs(want, result) or (None if np.array_equal(want, numpy) else "host differs from numpy")
            if problem:
                problems.append(f"{label} {matrix[comm.rank]}: {problem}")
    agree(mpi_comm, problems)


def test_send_and_recv_device_arrays(dcomm, mpi_comm):
    """Device to device, device to host and host to device, strided on both sides."""
    comm, problems = dcomm, []
    to, frm = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    mine = rank_input(comm.rank, 6 * 8, "float32").reshape(6, 8)
    want = rank_input(frm, 6 * 8, "float32").reshape(6, 8)[:, ::2]
    out = D.asarray(np.full((6, 8), -1, np.float32))
    cases = {
        "device to device": (D.asarray(mine)[:, ::2], D.empty((6, 4), np.float32)),
        "device to a strided device out": (D.asarray(mine[:, ::2].copy()), out[:, ::2]),
        "host to device": (mine[:, ::2], D.empty((24,), np.float32)),
        "device to host": (D.asarray(mine)[:, ::2], np.empty((4, 6), np.float32)),
    }
    for name, (x, target) in cases.items():
        sending = comm.send_async(x, to, tag=4)
        got = comm.recv_async(target, frm, tag=4).wait()
        sending.wait()
        host = got if isinstance(got, np.ndarray) else D.asnumpy(got)
        if got is not target or not np.array_equal(host.reshape(6, 4), want):
            problems.append(f"{name}: {host.ravel()[:4]} != {want.ravel()[:4]}")
    if not (D.asnumpy(out)[:, 1::2] == -1).all():
        problems.append("the strided out's other columns were written")
    agree(mpi_comm, problems)


def test_results_are_ready_on_the_users_stream(dcomm, mpi_comm):
    """The input is written by work queued on the user's own stream (not run yet), and
    the result is read through that stream: the collective waited for the first and
    the stream for the second. The stand-in runs neither unless someone waits."""
    comm, problems = dcomm, []
    mine = D.new_stream()
    with D.use_stream(mine):
        for algorithm in ALLREDUCE:
            x = D.empty(1001, np.float64)
            values = rank_input(comm.rank, 1001, "float64")
            D.copy_async(x, values, mine)  # queued on the user's stream (the stand-in runs it only when waited for)
            got = comm.allreduce(x, algorithm=algorithm)
            want = comm.allreduce(values, algorithm="native")
            if differs(want, D.asnumpy(got, stream=mine)):
                problems.append(algorithm)
            handle = comm.allreduce_async(x, op="max", algorithm=algorithm)
            result = handle.wait()
            if differs(comm.allreduce(values, op="max", algorithm="native"), D.asnumpy(result, stream=mine)):
                problems.append(f"{algorithm} async")
    agree(mpi_comm, problems)


@pytest.mark.parametrize("algorithm", ["ring", "bruck", "direct"])
def test_calls_from_two_user_streams_share_workspace_safely(dcomm, mpi_comm, algorithm):
    """Two calls in a row from different user streams, each unpacking into a strided
    out: the second reuses the first's workspace, so it must wait for the first call's
    device work, not only for its own stream's."""
    comm, problems = dcomm, []
    first, second = D.new_stream(), D.new_stream()
    p = comm.size
    for k in range(6):
        xs = [rank_input(r, 70, "int32") + k for r in range(p)]
        ys = [rank_input(r, 70, "int32") * 3 - k for r in range(p)]
        results = []
        for stream, values in ((first, xs), (second, ys)):
            with D.use_stream(stream):
                canvas = D.asarray(np.full((p, 140), -1, np.int32), stream=stream)
                comm.allgather(D.asarray(values[comm.rank], stream=stream), algorithm=algorithm, out=canvas[:, 1::2])
                results.append((canvas, stream, values))
        for canvas, stream, values in results:
            if not np.array_equal(D.asnumpy(canvas, stream=stream)[:, 1::2], np.stack(values)):
                problems.append(f"round {k}: a call's result was overwritten")
    agree(mpi_comm, problems)


def test_several_calls_in_flight_together(dcomm, mpi_comm):
    comm, problems = dcomm, []
    xs = [rank_input(r, 501, "float32") for r in range(comm.size)]
    x = D.asarray(xs[comm.rank])
    handles = [comm.allreduce_async(x, algorithm=a) for a in ("ring", "direct", "recursive_halving", "tree")]
    handles.append(comm.allgather_async(x[:7], algorithm="bruck"))
    handles.append(comm.reduce_scatter_async(x, algorithm="ring"))
    results = [h.wait() for h in reversed(handles)][::-1]
    total = sum(xs)
    for k, result in enumerate(results[:4]):
        if not np.array_equal(D.asnumpy(result), total):
            problems.append(f"allreduce {k}")
    if not np.array_equal(D.asnumpy(results[4]), np.stack([v[:7] for v in xs])):
        problems.append("allgather")
    if not np.array_equal(D.asnumpy(results[5]), np.array_split(total, comm.size)[comm.rank]):
        problems.append("reduce_scatter")
    agree(mpi_comm, problems)


def test_bfloat16_device_arrays(dcomm, mpi_comm):
    """bfloat16 as a stand-in bfloat16 array, and as uint16 bits marked with
    ``cc.device.bfloat16`` (CuPy's case), through every allreduce algorithm; native
    moves it through MPI on the host, which has no bfloat16 type: refused as on the host."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    comm, problems = dcomm, []
    xs = [rank_input(r, 99, "float32") for r in range(comm.size)]
    total = sum(xs)
    for algorithm in ALLREDUCE:
        host = xs[comm.rank].astype(ml_dtypes.bfloat16)
        if algorithm == "native":
            with pytest.raises(ValueError, match="'native' cannot move bfloat16"):
                comm.allreduce(bfloat16(D.asarray(host.view(np.uint16))), algorithm=algorithm)
            continue
        if D.native_bfloat16:
            got = comm.allreduce(D.asarray(host), algorithm=algorithm)
            if got.dtype != host.dtype or not np.array_equal(D.asnumpy(got).astype(np.float32), total):
                problems.append(f"{algorithm}: bfloat16 array")
        marked = comm.allreduce(bfloat16(D.asarray(host.view(np.uint16))), algorithm=algorithm)
        if not isinstance(marked, bfloat16) or \
                not np.array_equal(D.asnumpy(marked.data).view(ml_dtypes.bfloat16).astype(np.float32), total):
            problems.append(f"{algorithm}: marked uint16")
    agree(mpi_comm, problems)


@pytest.mark.parametrize("path", list(PATHS))
def test_deterministic_mode_on_the_device_is_the_serial_fold(mpi_comm, path):
    """Every reduction equals the serial left fold in rank order, bit for bit, as on the
    host: the fused multi-input kernels and the segments keep the order (16-bit floats
    included, where each step rounds), in place too."""
    if path not in PATHS:
        pytest.skip(f"MPI here is not CUDA-aware: no {path} path to test")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    comm = device_communicator(path, deterministic=True)
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
                return D.asnumpy(y.data).view(want.dtype) if isinstance(y, bfloat16) else D.asnumpy(y)

            got = {"allreduce": host(comm.allreduce(device(inputs[rank]), op=op)),
                   "reduce_scatter": host(comm.reduce_scatter(device(inputs[rank]), op=op)),
                   "reduce": comm.reduce(device(inputs[rank]), root=size - 1, op=op)}
            x = device(inputs[rank])
            comm.allreduce(x, op=op, out=x)
            got["in place"] = host(x)
            expect = {"allreduce": want, "reduce_scatter": want[bounds[rank]:bounds[rank + 1]], "in place": want,
                      "reduce": want if rank == size - 1 else None}
            if got["reduce"] is not None:
                got["reduce"] = host(got["reduce"])
            for what, value in got.items():
                if (value is None) != (expect[what] is None) or \
                        (value is not None and value.tobytes() != expect[what].tobytes()):
                    problems.append(f"{what} {np.dtype(dtype).name} {op}")
    comm.free()
    agree(mpi_comm, problems)


def test_shm_refuses_device_arrays(dcomm, mpi_comm):
    """shm reduces in a shared window of host memory: on a device array every rank
    refuses it, before any message (the communicator still works afterwards)."""
    comm = dcomm
    for collective in sorted(c for c, _ in SHARED_MEMORY):
        with pytest.raises(ValueError, match="runs on host arrays only"):
            call(comm, collective, D.asarray(np.ones(4, np.float32)), "shm")
    got = comm.allreduce(D.asarray(np.ones(4, np.float32)), algorithm="ring")
    agree(mpi_comm, [] if np.array_equal(D.asnumpy(got), np.full(4, comm.size, np.float32)) else ["broken after"])


def test_host_and_device_arrays_mixed_in_one_call_is_a_type_error(dcomm):
    comm = dcomm
    with pytest.raises(TypeError, match=f"out is a host array but x is on {D.where}"):
        comm.allreduce(D.asarray(np.ones(4)), out=np.ones(4))
    with pytest.raises(TypeError, match="out is a device array but x is on the host"):
        comm.allreduce(np.ones(4), out=D.empty(4, np.float64))
    with pytest.raises(ValueError, match=r"out must have shape \(4,\); got \(5,\)"):
        comm.allreduce(D.asarray(np.ones(4)), out=D.empty(5, np.float64))
    with pytest.raises(TypeError, match="out must have dtype float64; got float32"):
        comm.allreduce(D.asarray(np.ones(4)), out=D.empty(4, np.float32))
    with pytest.raises(TypeError, match="x has unsupported dtype bool"):
        comm.allreduce(D.asarray(np.ones(4, bool)))
    with pytest.raises(TypeError, match="op 'max' is not defined for complex"):
        comm.allreduce(D.asarray(np.ones(4, np.complex64)), op="max")
    comm.barrier()  # nothing was sent: every rank is here, with no message left over
    assert np.array_equal(D.asnumpy(comm.allreduce(D.asarray(np.ones(3)))), np.full(3, comm.size))


def test_bad_device_options_are_refused_before_any_message(mpi_comm, monkeypatch):
    with pytest.raises(TypeError, match="cuda_ipc must be True, False or None"):
        cc.Communicator(cuda_ipc="yes")
    with pytest.raises(ValueError, match="ipc_memory must be a non-negative number of bytes"):
        cc.Communicator(ipc_memory=-1)
    with pytest.raises(ValueError, match="device_segment_size must be a positive number of bytes"):
        cc.Communicator(device_segment_size=-4)
    monkeypatch.setenv("COLLECTIVES_DEVICE_SEGMENT_SIZE", "4M")
    with pytest.raises(ValueError, match="COLLECTIVES_DEVICE_SEGMENT_SIZE must be a number of bytes"):
        cc.Communicator()
    mpi_comm.Barrier()


def test_no_reduction_copies_a_whole_buffer_to_the_host(mpi_comm):
    """Staged ring allreduce: every device -> host copy is one segment of a message the
    schedule sends, and all of them together are the bytes it sends, 2(p-1)/p of the
    buffer: never the whole buffer at once."""
    stand_in_only("it counts the stand-in's copies")
    comm = device_communicator("staged", device_segment_size=4096)
    dev = D.si.device()
    x = D.asarray(np.ones(100_000, np.float32))
    dev.copies.clear()
    comm.allreduce(x, algorithm="ring")
    to_host = [nbytes for direction, nbytes in dev.copies if direction == "device->host"]
    problems = []
    if comm.size > 1:
        sent = cc.sim.costs("allreduce", "ring", comm.size, 100_000).bytes_sent[comm.rank]
        if sum(to_host) != sent or max(to_host) > 4096:
            problems.append(f"device->host copies {len(to_host)}, {sum(to_host)} B, largest {max(to_host)}; "
                            f"the schedule sends {sent} B")
    elif to_host:
        problems.append(f"one rank copied {sum(to_host)} B to the host")
    comm.free()
    agree(mpi_comm, problems)


@pytest.mark.mpi(min_size=2)
def test_check_mode_names_a_rank_on_the_host(mpi_comm):
    comm = device_communicator("ipc", check=True)
    x = np.ones(8, np.float32) if comm.rank == 0 else D.asarray(np.ones(8, np.float32))
    with pytest.raises(cc.CollectiveMismatchError, match=f"memory: host on rank 0; {D.name} on"):
        comm.allreduce(x)
    got = comm.allreduce(D.asarray(np.ones(8, np.float32)))  # the communicator stays usable
    assert np.array_equal(D.asnumpy(got), np.full(8, comm.size, np.float32))
    comm.free()


GUARD = 512  # elements of a pattern on each side of a result, which a failed call must leave alone


MISMATCHES = [(path, "ring", segment) for path in PATHS for segment in (SEGMENT, 0)] + [("staged", "native", 0)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path,algorithm,segment", MISMATCHES,
                         ids=[f"{p}-{a}-{'sizes-in-tags' if s else 'probed'}" for p, a, s in MISMATCHES])
def test_a_size_mismatch_raises_on_every_rank_and_writes_nothing_outside(mpi_comm, monkeypatch, path, algorithm,
                                                                        segment):
    """Rank 0 passes a larger buffer. The device executor's messages carry their size
    in their tag (segments of 256 B) or are probed before they are received (whole
    256 KiB messages), as the host's do, and MPI's own collective is told first (the
    agreement forced on, as on Open MPI; its messages go on the host whatever the
    path): nothing relies on MPI's truncation, and nothing around the result is
    written."""
    if path not in PATHS:
        pytest.skip(f"MPI here is not CUDA-aware: no {path} path to test")
    monkeypatch.setenv(mpi_library.NATIVE_CHECK_ENV, "1")
    mismatch_raises(path, segment, algorithm)


def mismatch_raises(path, segment, algorithm="ring", timeout=30):
    """On a new communicator whose device messages go ``path``'s way, an allreduce where
    rank 0 passes 32 elements more (``segment``: the device segment size, 0: whole
    messages) raises MessageSizeError on this rank and writes nothing around its result;
    the broken communicator is then freed."""
    comm = device_communicator(path, device_segment_size=segment)
    count = (64 if segment else 1 << 16) + (0 if comm.rank else 32)
    whole = D.asarray(np.full(count + 2 * GUARD, -7, np.float32))
    with pytest.raises(cc.MessageSizeError):
        comm.allreduce(D.asarray(np.ones(count, np.float32)), algorithm=algorithm, out=whole[GUARD:GUARD + count],
                       timeout=timeout)
    around = np.concatenate([D.asnumpy(whole)[:GUARD], D.asnumpy(whole)[GUARD + count:]])
    assert (around == -7).all(), f"{np.count_nonzero(around != -7)} elements outside the result were written"
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_a_failed_device_call_tells_the_others_its_own_number(mpi_comm, monkeypatch, algorithm):
    """A rank whose device call fails on a message of the wrong size tells the other
    ranks which call it was: the number its own error names (``call #N``), which is
    what the others' errors then name (``in its call #N``)."""
    told = []
    real = Liveness.notify
    monkeypatch.setattr(Liveness, "notify", lambda self, sequence, *rest: (told.append(sequence),
                                                                            real(self, sequence, *rest))[1])
    monkeypatch.setenv(mpi_library.NATIVE_CHECK_ENV, "1")
    comm = device_communicator("staged", device_segment_size=SEGMENT)
    comm.allreduce(D.asarray(np.ones(4, np.float32)), algorithm=algorithm)  # a call before: the numbers differ
    count = 64 + (0 if comm.rank else 32)
    with pytest.raises(cc.MessageSizeError) as raised:
        comm.allreduce(D.asarray(np.ones(count, np.float32)), algorithm=algorithm, timeout=30)
    comm.free()
    own = int(re.search(r"\) call #(\d+)", str(raised.value)).group(1))
    problems = [f"told the others call #{n}, its error names call #{own}" for n in told if n != own]
    named = re.search(r"in its call #(\d+)", str(raised.value))
    if named and int(named.group(1)) != own:
        problems.append(f"another rank named its call #{named.group(1)}, this rank's is #{own}")
    if not mpi_comm.allreduce(len(told)):
        problems.append("no rank told the others of its failure")
    agree(mpi_comm, problems)


@pytest.mark.mpi(min_size=2)
def test_a_new_communicator_never_takes_a_broken_one_s_messages(mpi_comm):
    """Failed calls leave messages no rank receives, and MPI gives a freed
    communicator's context to the next one made, whose calls (numbered alike) would
    take them: so a broken communicator's MPI communicators are kept, not freed. With
    MPICH at 2 ranks this sequence (two broken IPC communicators, then a mismatch and
    calls on a staged one) hung the third until its timeout when they were freed."""
    kept = retired.kept()
    mismatch_raises("ipc", SEGMENT, timeout=10)
    mismatch_raises("ipc", 0, timeout=10)
    assert retired.kept() > kept  # not freed
    mismatch_raises("staged", SEGMENT, timeout=10)
    comm = device_communicator("staged")
    for call in range(2):
        got = comm.allreduce(D.asarray(np.full(64, comm.rank + call, np.float32)), algorithm="ring", timeout=10)
        assert (D.asnumpy(got) == sum(range(comm.size)) + call * comm.size).all(), D.asnumpy(got)
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", ["0", "1"], ids=["no-agreement", "agreement"])
def test_a_native_device_call_matches_itself_whatever_follows_it(mpi_comm, monkeypatch, check):
    """MPI's collective of a device call can only be posted once its input is on the
    host, which each rank learns at its own moment; it must still meet the same call on
    every rank, never a host call made after it. Rank 0 waits for it before its next
    call; the others make their next call first."""
    monkeypatch.setenv(mpi_library.NATIVE_CHECK_ENV, check)
    comm = device_communicator("staged")
    first = comm.allreduce_async(D.asarray(np.ones(8, np.float32)), algorithm="native")
    host = np.full(8, 100.0, np.float32)
    if comm.rank == 0:
        on_device = first.wait()
        second = comm.allreduce_async(host, algorithm="native")
    else:
        second = comm.allreduce_async(host, algorithm="native")
        on_device = first.wait()
    on_host = second.wait()
    assert np.array_equal(D.asnumpy(on_device), np.full(8, comm.size, np.float32)), D.asnumpy(on_device)
    assert np.array_equal(on_host, np.full(8, 100.0 * comm.size, np.float32)), on_host
    comm.free()


@pytest.mark.any_size
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("first", [False, True], ids=["later-call", "first-device-call"])
def test_a_rank_that_does_not_call_times_out_the_others(mpi_comm, first):
    """Also when the missing call is a communicator's first on a device, whose set-up
    (the ranks agreeing on the paths) is part of the call and bounded by its timeout."""
    comm = cc.Communicator() if first else device_communicator("ipc")
    if comm.rank != 0:
        match = "the device set-up" if first else "allreduce"
        with pytest.raises(cc.CollectiveTimeoutError, match=f"{match}.*: Timed out"):
            comm.allreduce(D.asarray(np.ones(1000, np.float32)), algorithm="ring", timeout=1.0)
    mpi_comm.Barrier()
    if not first:
        comm.free()  # (a communicator broken in its set-up holds requests that never complete: not freed)


def test_the_stand_in_catches_a_missing_wait(mpi_comm, monkeypatch):
    """The stand-in's purpose, shown: an executor that forgets to wait for the user's
    stream (its begin() dropped) reads the input before the copy that fills it has run,
    and the results are wrong."""
    from collectives.transport.device import DeviceContext

    stand_in_only("a GPU may well run the copy in time")
    comm = device_communicator("staged")
    monkeypatch.setattr(DeviceContext, "begin", lambda self, user_stream: None)
    wrong = 0
    for _ in range(20):
        values = rank_input(comm.rank, 2000, "float32")
        got = D.asnumpy(comm.allreduce(D.asarray(values), algorithm="ring"))
        wrong += not np.array_equal(got, comm.allreduce(values, algorithm="native"))
    monkeypatch.undo()
    comm.free()
    assert wrong > 0, "the stand-in let a missing wait pass: it is not adversarial enough"


@pytest.mark.serial
def test_an_array_freed_while_the_stand_in_s_pool_gives_blocks_back(monkeypatch):
    """An array's last reference dropped while the pool gives freed blocks back (the
    garbage collector runs finalizers anywhere, re-entering the pool's lock) joins the
    freed blocks; none is lost and nothing raises. Seen once under load in the suite:
    "deque mutated during iteration"."""
    from collectives.device import standin

    stand_in_only("the stand-in's pool")
    dev = standin.device()
    first, later = dev.empty(100, np.float32), [dev.empty(100, np.float32)]
    starts = (first._owner.start, later[0]._owner.start)
    given = []
    real_give = standin._Segment.give

    def give(segment, start, nbytes):
        given.append(start)
        later.clear()  # the other array's last reference goes, here, inside the pool's loop
        real_give(segment, start, nbytes)

    monkeypatch.setattr(standin._Segment, "give", give)
    del first
    kept = [dev.empty(10, np.float32)]  # gives the first block back, and frees the second meanwhile
    kept.append(dev.empty(10, np.float32))  # gives the second back
    assert set(starts) <= set(given)  # (with blocks earlier tests freed, perhaps)


# -- the training adapter and the parameter server on device arrays ---------------------------------
def _reduce_steps(comm, params, on_device, steps=2, **options):
    """Data-parallel SGD steps (test_training's MLP) with the reducer on host or device
    parameters; returns the parameters after each step, on the host."""
    from collectives.training import GradientReducer

    from conftest import shard
    from numpy_model import LR, backward, data

    host = {n: a.copy() for n, a in params.items()}
    device_params = {n: D.asarray(a) for n, a in host.items()} if on_device else None
    history = []
    with GradientReducer(device_params if on_device else host, comm, **options) as reducer:
        k = options.get("backward_passes_per_step", 1)
        for step in range(steps):
            x, y = shard(comm, *data(step))
            for _ in range(k):
                for name, g in backward(host, x, y):
                    reducer.gradient_ready(name, D.asarray(g) if on_device else g)
            averaged = reducer.synchronize()
            for name, g in averaged.items():
                host[name] -= LR * (D.asnumpy(g) if on_device else g)
            history.append({n: a.copy() for n, a in host.items()})
            if on_device:
                for name in host:  # keep the device parameters in step (the reducer averages grads only)
                    device_params[name] = D.asarray(host[name])
    return history


@pytest.mark.parametrize("options", [
    {},
    {"first_bucket_bytes": 64, "bucket_bytes": 512, "algorithm": "ring"},
    {"compression": "fp16", "first_bucket_bytes": 300},
    {"compression": "bf16"},
    {"backward_passes_per_step": 2},
    {"progress_thread": True},
], ids=["default", "many-buckets", "fp16", "bf16", "accumulate", "thread"])
def test_gradient_reducer_on_the_device_equals_the_host(mpi_comm, options):
    """Gradient buckets on the device (copies and casts as kernels on the gradients'
    stream), bit for bit what the host reducer gives. Where the reducer's algorithm is
    auto's, in deterministic mode: auto picks on device arrays what the host has not
    (the peer reads), and sums in another order round differently; in rank order both
    fold alike."""
    from numpy_model import init_params

    if options.get("compression") == "bf16":
        pytest.importorskip("ml_dtypes")
    comm = device_communicator("ipc", deterministic="algorithm" not in options)
    params = init_params(0)
    want = _reduce_steps(comm, params, False, **options)
    got = _reduce_steps(comm, params, True, **options)
    problems = [f"step {t} {n}" for t in range(len(want)) for n in want[t]
                if want[t][n].tobytes() != got[t][n].tobytes()]
    comm.free()
    agree(mpi_comm, problems)


def test_broadcast_and_check_parameters_on_the_device(mpi_comm):
    from collectives.training import TrainingError, broadcast_parameters, check_parameters

    comm = device_communicator("staged")
    host = {"w": rank_input(comm.rank, 30, "float32").reshape(5, 6), "n": np.arange(4, dtype=np.int64) * comm.rank}
    params = {n: D.asarray(a) for n, a in host.items()}
    root = comm.size - 1
    broadcast_parameters(params, root=root, comm=comm)
    problems = []
    if not np.array_equal(D.asnumpy(params["w"]), rank_input(root, 30, "float32").reshape(5, 6)) or \
            not np.array_equal(D.asnumpy(params["n"]), np.arange(4) * root):
        problems.append("broadcast_parameters")
    check_parameters(params, comm)
    if comm.size > 1:
        if comm.rank == 1:
            params["w"] = D.asarray(np.zeros((5, 6), np.float32))
        with pytest.raises(TrainingError, match="'w' on rank"):
            check_parameters(params, comm)
    with pytest.raises(TypeError, match="all on the host or all on one device"):
        broadcast_parameters({"a": np.ones(2), "b": D.asarray(np.ones(2))}, comm=comm)
    comm.free()
    agree(mpi_comm, problems)


@pytest.mark.mpi(min_size=2)
def test_parameter_server_with_device_parameters_equals_the_host(mpi_comm):
    from collectives.ps import ParameterServer

    from numpy_model import LR, backward, data, init_params

    comm = device_communicator("ipc")
    results = []
    for on_device in (False, True):
        host = init_params(0)
        params = {n: D.asarray(a) for n, a in host.items()} if on_device else host
        ps = ParameterServer(params, comm, servers=1, lr=LR)
        if ps.is_worker:
            workers = len(ps.workers)
            index = ps.workers.index(comm.rank)
            for t in range(2):
                x, y = data(t)
                share = len(y) // workers
                grads = dict(backward(host, x[index * share:(index + 1) * share], y[index * share:(index + 1) * share]))
                pulled = ps.step({n: D.asarray(g) for n, g in grads.items()} if on_device else grads)
                host = {n: D.asnumpy(a) if on_device else a.copy() for n, a in pulled.items()}
        else:
            ps.serve()
        ps.close()
        results.append(host)
    comm.free()
    problems = [n for n in results[0] if results[0][n].tobytes() != results[1][n].tobytes()]
    agree(mpi_comm, problems)


@pytest.mark.serial
def test_importing_collectives_imports_neither_cupy_nor_torch():
    import subprocess
    import sys

    code = ("import sys, collectives, collectives.training, collectives.ps, collectives.device.ops; "
            "print(sorted(m for m in ('cupy', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_gradients_from_two_streams(mpi_comm):
    """Gradients handed over on two different streams (each copy queued there, not yet
    run): the buckets' allreduce follows both, and each gradient gets its average on
    its own stream."""
    from collectives.training import GradientReducer

    comm = device_communicator("ipc")
    streams = [D.new_stream(), D.new_stream()]
    names = [f"p{i}" for i in range(6)]
    host = {n: rank_input(comm.rank, 50 + i, "float64") for i, n in enumerate(names)}
    problems = []
    with GradientReducer({n: D.asarray(np.zeros_like(a)) for n, a in host.items()}, comm,
                         first_bucket_bytes=400, bucket_bytes=800) as reducer:
        grads = {}
        for i, name in enumerate(names):
            stream = streams[i % 2]
            with D.use_stream(stream):
                grads[name] = D.empty(host[name].shape, np.float64)
                D.copy_async(grads[name], host[name], stream)
                reducer.gradient_ready(name, grads[name])
        reducer.synchronize()
        for i, name in enumerate(names):
            want = comm.allreduce(host[name], op="avg", algorithm="native")
            if D.asnumpy(grads[name], stream=streams[i % 2]).tobytes() != want.tobytes():
                problems.append(name)
    comm.free()
    agree(mpi_comm, problems)


@pytest.mark.mpi(min_size=2)
def test_a_device_table_of_other_gpus_is_put_aside_at_the_first_device_call(mpi_comm, tmp_path, monkeypatch):
    """A device table's entry names the GPUs it was measured on: a communicator is made
    without touching the device, so ``auto`` follows the table until the first call on a
    device learns every rank's GPU (the negotiation); where the table's are others, the
    device cost model answers from then on, on every rank alike, and comm.choose says
    why; on the same GPUs the table stays."""
    from collectives import auto
    from collectives.tools.bench.devices import BenchDevice

    probe = cc.Communicator()
    probe.allreduce(D.asarray(np.ones(1, np.float32)))
    ours = next(iter(probe._ctx.devices.values())).gpus
    probe.free()
    # what the negotiation learnt is what the benchmarks stamp their device tables with
    assert ours == BenchDevice(D.name, mpi_comm.Get_rank()).gpus(mpi_comm)
    if D.name == "standin":
        assert ours == "stand-in device 0 x1"
    size = mpi_comm.Get_size()
    path = tmp_path / "device-table.json"
    for measured_on, kept in ((ours, True), ("Another GPU x1", False)):
        stamp = {**auto.fingerprint_for_key(size), "gpu": measured_on}
        tables = {"allreduce": {str(size): [[0, "ring"]]}}
        path.write_text(json.dumps({"format": 1, "tables": {}, "device_tables": tables,
                                    "measured": {f"{size} device": {"fingerprint": stamp}}}))
        monkeypatch.setenv(auto.TUNING_ENV, str(path))
        comm = cc.Communicator()
        assert comm.choose("allreduce", 64, device=True)[0] == "ring"
        xs = [rank_input(r, 16, "float32") for r in range(size)]
        got = D.asnumpy(comm.allreduce(D.asarray(xs[comm.rank])))
        assert np.array_equal(got, expected_result("allreduce", comm.rank, size, xs))
        choice, why = comm.choose("allreduce", 64, device=True)
        if kept:
            assert choice == "ring" and why.startswith("measured table"), why
        else:
            assert f"was measured on GPUs Another GPU x1, these are {ours}" in why, why
        assert mpi_comm.allgather(choice) == [choice] * size
        comm.free()
