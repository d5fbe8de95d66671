"""What only a real GPU can show: the CUDA kernels' arithmetic on the device against
NumPy, torch CUDA tensors through every collective, a CUDA model trained through the
training adapter, and torch's side streams. Marked ``gpu``: they skip, with the reason,
where CuPy sees no GPU (as on the development machine and in CI). ``make test-gpu``
runs them with the device suite (``tests/device/test_device.py --device cuda``) at 1-4 ranks
sharing one GPU.
"""

import time

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc
from collectives.algorithms import SHARED_MEMORY

from conftest import agree, expected_result, ops_for, rank_input

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cupy():
    import cupy

    cupy.cuda.Device(MPI.COMM_WORLD.Get_rank() % cupy.cuda.runtime.getDeviceCount()).use()
    return cupy


@pytest.fixture(scope="module")
def backend(cupy):
    from collectives.device import cupy_backend

    return cupy_backend.backend(cupy.cuda.Device().id)


# -- the kernels on the device ---------------------------------------------------------------------
KERNEL_DTYPES = ["int8", "uint16", "int32", "int64", "uint64", "float16", "bfloat16", "float32", "float64",
                 "complex64", "complex128"]


@pytest.mark.serial
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_reduce_kernels_on_the_device_equal_numpy(cupy, backend, dtype):
    from test_kernels import numpy_reduce, same_bits, values

    from collectives.device.kernels import BFLOAT16

    dtype = BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
    storage = backend.storage_dtype(dtype)  # bfloat16 lives in uint16 on the device
    rng = np.random.default_rng(dtype.num)
    stream = cupy.cuda.Stream(non_blocking=True)
    for op in ops_for(dtype):
        if op == "avg":
            continue
        exact = dtype.kind == "c" and op == "prod"
        for n, offset in ((1 << 20, 0), (4099, 1)):  # vector path and tail; unaligned
            a, b = values(dtype, n, rng, exact), values(dtype, n, rng, exact)
            da = cupy.asarray(np.concatenate([a[:offset], a]).view(storage))[offset:]
            db = cupy.asarray(np.concatenate([b[:offset], b]).view(storage))[offset:]
            dst = cupy.empty(n + offset, storage)[offset:]
            backend.reduce2(stream, op, dtype, dst, da, db)
            stream.synchronize()
            want = numpy_reduce(op, a, b)
            got = cupy.asnumpy(dst).view(dtype)
            assert same_bits(got, want, zero_sign=op not in ("max", "min")), f"{dtype} {op} n={n}"


@pytest.mark.serial
def test_multi_input_divide_cast_and_pack_kernels_on_the_device(cupy, backend):
    import functools

    from test_kernels import BF16, numpy_reduce, same_bits, values

    rng = np.random.default_rng(1)
    stream = cupy.cuda.Stream(non_blocking=True)
    for dtype in (np.dtype("float32"), np.dtype("float16"), np.dtype("int64")):
        inputs = [values(dtype, 10_001, rng) for _ in range(16)]
        dst = cupy.empty(10_001, dtype)
        backend.reduce_n(stream, "sum", dtype, dst, [cupy.asarray(x) for x in inputs])
        stream.synchronize()
        assert same_bits(cupy.asnumpy(dst), functools.reduce(lambda x, y: numpy_reduce("sum", x, y), inputs))
        if dtype.kind == "f":  # avg's fold that is the call's result (the leader's): divided as it is written
            outputs = [cupy.empty(10_001, dtype), cupy.empty(10_001, dtype)]
            backend.reduce_n(stream, "avg", dtype, outputs, [cupy.asarray(x) for x in inputs[:5]], divisor=3)
            stream.synchronize()
            with np.errstate(all="ignore"):
                want = np.divide(functools.reduce(lambda x, y: numpy_reduce("sum", x, y), inputs[:5]), 3)
            assert all(same_bits(cupy.asnumpy(out), want) for out in outputs), f"{dtype}: the dividing fold"
        # a leader's reduce_scatter: block j of the fold into output j, one kernel (uneven, misaligned blocks)
        bounds = [0, 3, 3337, 3338, 10_001]
        blocks = [cupy.empty(hi - lo, dtype) for lo, hi in zip(bounds[:-1], bounds[1:])]
        backend.reduce_blocks(stream, "sum", dtype, blocks, [cupy.asarray(x) for x in inputs[:7]], bounds[:-1])
        stream.synchronize()
        whole = functools.reduce(lambda x, y: numpy_reduce("sum", x, y), inputs[:7])
        for j, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            assert same_bits(cupy.asnumpy(blocks[j]), whole[lo:hi]), f"{dtype}: reduce_blocks' block {j}"
        if dtype.kind == "f":  # and avg's, divided as it is written
            backend.reduce_blocks(stream, "avg", dtype, blocks, [cupy.asarray(x) for x in inputs[:7]], bounds[:-1],
                                  divisor=7)
            stream.synchronize()
            with np.errstate(all="ignore"):
                for j, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
                    assert same_bits(cupy.asnumpy(blocks[j]), np.divide(whole[lo:hi], 7)), f"{dtype}: block {j} /7"
    # complex: the dividing fold's own division (NumPy's, through its reciprocal)
    inputs = [values(np.dtype("complex64"), 1001, rng) for _ in range(3)]
    out = cupy.empty(1001, np.complex64)
    backend.reduce_n(stream, "avg", np.dtype("complex64"), [out], [cupy.asarray(x) for x in inputs], divisor=3)
    stream.synchronize()
    with np.errstate(all="ignore"):
        want = np.divide(functools.reduce(lambda x, y: numpy_reduce("sum", x, y), inputs), 3)
    assert same_bits(cupy.asnumpy(out), want), "complex64: the dividing fold"
    x = values(np.dtype("float32"), 100_003, rng)
    device_x = cupy.asarray(x)
    backend.divide(stream, np.dtype("float32"), device_x, 3)
    stream.synchronize()
    with np.errstate(all="ignore"):
        assert same_bits(cupy.asnumpy(device_x), np.divide(x, 3))
    for wire in (np.dtype("float16"), BF16):
        out = cupy.empty(x.size, backend.storage_dtype(wire))
        backend.cast_divide(stream, np.dtype("float32"), wire, out, cupy.asarray(x), 4)
        stream.synchronize()
        with np.errstate(all="ignore"):
            want = np.divide(x, 4).astype(wire)
        assert same_bits(cupy.asnumpy(out).view(wire), want), wire
    # copy_n: each source into m destinations, read once (a leader's allgather and broadcast),
    # destinations 16-byte aligned or not, each source a length of its own; nothing else written
    for itemsize in (1, 2, 4, 8, 16):
        dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.complex128}[itemsize]
        lengths, m = (1001, 7, 4096), 5
        sources = [cupy.asarray(rng.integers(0, 255, n * itemsize, dtype=np.uint8).view(dtype)) for n in lengths]
        canvas = cupy.zeros(m * sum(lengths) + 3 * m, dtype)
        starts = np.cumsum([0] + [n + 1 for n in lengths for _ in range(m)])  # (odd gaps: misaligned ones too)
        dsts = [canvas[at : at + lengths[i // m]] for i, at in enumerate(starts[:-1])]
        backend.copy_n(stream, dsts, sources)
        stream.synchronize()
        want = np.zeros(canvas.size, dtype)
        for i, at in enumerate(starts[:-1]):
            want[at : at + lengths[i // m]] = cupy.asnumpy(sources[i // m])
        assert np.array_equal(cupy.asnumpy(canvas), want), f"copy_n with a fan of {m}, {itemsize}-byte elements"
    base = cupy.arange(2 * 3 * 5 * 7, dtype=cupy.float64).reshape(2, 3, 5, 7)
    view = base[:, ::2, 1:4, ::-3]
    packed = cupy.empty(view.size, cupy.float64)
    backend.pack(stream, packed, view)
    stream.synchronize()
    assert np.array_equal(cupy.asnumpy(packed), cupy.asnumpy(view).reshape(-1))


# -- torch ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_torch_cuda_tensors_through_every_collective(comm, mpi_comm, dtype):
    """Every collective and algorithm on torch CUDA tensors: the results are CUDA tensors
    of the input's dtype with the host path's values (bfloat16 included: CuPy has no
    such dtype, so the library carries its bits)."""
    import torch

    problems = []
    for collective in cc.COLLECTIVES:
        for algorithm in cc.algorithms(collective):
            if dtype == "bfloat16" and algorithm == "native":
                continue
            if (collective, algorithm) in SHARED_MEMORY:  # host arrays only (test_device.py checks it refuses)
                continue
            rows = (comm.size, 1001) if collective in ("scatter", "alltoall") else None  # a row per rank
            xs = [rank_input(r, 1001 * comm.size if rows else 1001, "float32", shape=rows) for r in range(comm.size)]
            x = torch.tensor(xs[comm.rank]).to(getattr(torch, dtype)).cuda()
            root = comm.size - 1
            if collective in ("broadcast", "gather", "scatter"):
                got = getattr(comm, collective)(x, root=root, algorithm=algorithm)
            else:
                got = getattr(comm, collective)(x, algorithm=algorithm)
            want = expected_result(collective, comm.rank, comm.size, xs, "sum",
                                   root if collective in ("broadcast", "gather", "scatter") else 0)
            if want is None:
                if got is not None:
                    problems.append(f"{collective}/{algorithm}: a non-root got a result")
                continue
            if not isinstance(got, torch.Tensor) or got.device.type != "cuda" or got.dtype != x.dtype:
                problems.append(f"{collective}/{algorithm}: got {type(got).__name__}")
            elif not np.array_equal(got.float().cpu().numpy(), want.astype(np.float32)):
                problems.append(f"{collective}/{algorithm}: wrong values")
    agree(mpi_comm, problems)


def test_a_torch_side_stream_is_respected(comm, mpi_comm):
    import torch

    side = torch.cuda.Stream()
    problems = []
    with torch.cuda.stream(side):
        for algorithm in cc.algorithms("allreduce"):
            if ("allreduce", algorithm) in SHARED_MEMORY:  # host arrays only
                continue
            x = torch.full((1 << 20,), float(comm.rank + 1), device="cuda")
            x.mul_(2)  # queued on the side stream
            got = comm.allreduce(x, algorithm=algorithm)
            got.add_(1)  # after the collective, on the same stream
            side.synchronize()
            want = 2 * comm.size * (comm.size + 1) / 2 + 1
            if not torch.all(got == want):
                problems.append(algorithm)
    agree(mpi_comm, problems)


def test_a_cuda_model_trains_as_on_one_process(comm, mpi_comm):
    """DistributedOptimizer on a CUDA model (buckets on the GPU) gives, step after step,
    what single-process training gives (float64, rtol 1e-9), the same bits on every rank."""
    import torch

    import collectives.torch as cct

    from conftest import identical_everywhere, shard
    from torch_reference import batch, loss_fn, make_model, single_process

    want = single_process(torch.optim.SGD, lr=0.5, momentum=0.9)
    model = make_model(comm.rank * 7).cuda()
    cct.broadcast_parameters(model.state_dict(), comm=comm)
    optimizer = cct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                                         named_parameters=model.named_parameters(), comm=comm,
                                         first_bucket_bytes=256)
    problems = []
    for step in range(3):
        optimizer.zero_grad()
        x, y = shard(comm, *batch(step))
        loss_fn(model, x.cuda(), y.cuda()).backward()
        optimizer.step()
        if not all(torch.allclose(p.cpu(), q, rtol=1e-9, atol=1e-9) for p, q in zip(model.parameters(), want[step])):
            problems.append(f"step {step}: differs from single-process training")
        if not identical_everywhere(p.detach().cpu().numpy() for p in model.parameters()):
            problems.append(f"step {step}: parameters differ between ranks")
    optimizer.close()
    agree(mpi_comm, problems)


def test_cuda_array_interface_objects(comm, mpi_comm, cupy):
    class Exported:  # any producer of __cuda_array_interface__ (Numba, PyCUDA ...)
        def __init__(self, array):
            self.array = array
            self.__cuda_array_interface__ = array.__cuda_array_interface__

    x = cupy.arange(1000, dtype=cupy.float32) * (comm.rank + 1)
    got = comm.allreduce(Exported(x))
    problems = [] if isinstance(got, cupy.ndarray) and np.array_equal(
        cupy.asnumpy(got), np.arange(1000, dtype=np.float32) * comm.size * (comm.size + 1) / 2) else ["CAI"]
    agree(mpi_comm, problems)


# -- the peer reads' device pieces, in one process ----------------------------------------------
@pytest.mark.serial
def test_the_fence_kernel_meets_and_gives_up_on_one_gpu_with_several_streams(cupy, backend):
    """The distinct-GPU fence (kernels/collectives.cu) as four "ranks" of one process, one
    stream each (blocks of 32 threads: co-resident): every fence passes with every
    flag written; then rank 3 never comes, and the others give up at their limit and
    set its late word (host memory the host reads) only; then it never comes again, and
    the others, given 10 s, stop within a moment once the host sets their own words (the
    stop word PeerNode.release sets), setting nothing. Before that, a fence where rank 3
    writes another digest than the others: every rank marks the ranks whose digest
    differs from its own with 2, and only where it checks; and one where the others
    only signal (``wait=False``) and rank 3 passes."""
    p = 4
    flags = [cupy.zeros(2 * p, cupy.uint32) for _ in range(p)]
    table = backend.pointer_table(flags)
    late_words = np.zeros(p * p, np.uint32)
    late = backend.map_host(late_words)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(p)]
    try:
        for epoch in (1, 2, 3):
            for r in range(p):
                backend.fence_kernel(streams[r], table, flags[r], r, epoch, 10.0, late, r * p)
            for stream in streams:
                stream.synchronize()
            assert not late_words.any(), late_words.reshape(p, p)
            for r in range(p):
                got = cupy.asnumpy(flags[r])
                assert all(got[q] == epoch for q in range(p) if q != r), (epoch, r, got)
        for epoch, check in ((4, False), (5, True)):  # rank 3 disagrees
            for r in range(p):
                backend.fence_kernel(streams[r], table, flags[r], r, epoch, 10.0, late, r * p,
                                     digest=8 if r == p - 1 else 7, check=check)
            for stream in streams:
                stream.synchronize()
            want = np.zeros((p, p), np.uint32)
            if check:
                want[: p - 1, p - 1] = 2
                want[p - 1, : p - 1] = 2
            assert np.array_equal(late_words.reshape(p, p), want), (check, late_words.reshape(p, p))
            late_words[...] = 0
        for r in range(p):  # the others only signal (their hosts met already): rank 3's wait passes
            backend.fence_kernel(streams[r], table, flags[r], r, 6, 10.0, late, r * p, wait=r == p - 1)
        for stream in streams:
            stream.synchronize()
        assert not late_words.any(), late_words.reshape(p, p)
        start = time.perf_counter()
        for r in range(p - 1):
            backend.fence_kernel(streams[r], table, flags[r], r, 7, 0.2, late, r * p)
        for stream in streams:
            stream.synchronize()
        waited = time.perf_counter() - start
        assert 0.2 <= waited < 5, waited
        want = np.zeros((p, p), np.uint32)
        want[: p - 1, p - 1] = 1
        assert np.array_equal(late_words.reshape(p, p), want)
        late_words[...] = 0
        start = time.perf_counter()
        for r in range(p - 1):
            backend.fence_kernel(streams[r], table, flags[r], r, 8, 10.0, late, r * p)
        time.sleep(0.05)  # they spin
        for r in range(p - 1):
            late_words[r * p + r] = 1  # the stop word
        for stream in streams:
            stream.synchronize()
        waited = time.perf_counter() - start
        assert waited < 2, waited
        want = np.zeros((p, p), np.uint32)
        want[np.arange(p - 1), np.arange(p - 1)] = 1  # the stop words only: no rank is named late
        assert np.array_equal(late_words.reshape(p, p), want)
    finally:
        backend.unmap_host(late)


@pytest.mark.serial
def test_stream_write_and_wait_values_order_two_streams(cupy, backend):
    """cuStreamWaitValue32 holds a stream until another writes the word
    (cuStreamWriteValue32, after the work before it): a copy on the waiting stream
    sees the data the writing stream's kernel wrote first."""
    words = np.zeros(32, np.uint32)
    mapping = backend.map_host(words)
    first, second = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    try:
        src, dst = cupy.zeros(1 << 22, cupy.float32), cupy.zeros(1 << 22, cupy.float32)
        src += 0  # the kernel loaded now: loading a module waits for every stream, the held one too
        cupy.cuda.Device().synchronize()
        backend.wait_value(second, mapping, 5, 7)
        backend.copy(dst, src, second)
        with first:
            src += 3  # a kernel on the first stream
        backend.write_value(first, mapping, 5, 7)
        second.synchronize()
        assert words[5] == 7 and float(cupy.asnumpy(dst).min()) == 3.0
    finally:
        backend.unmap_host(mapping)


@pytest.mark.serial
def test_allocations_of_the_pools_are_base_plus_offset_with_a_buffer_id(cupy, backend):
    """CuPy's pool and torch's caching allocator sub-allocate: an array's allocation
    (cuPointerGetAttribute) holds it, two arrays may share one; freed and allocated
    again, an allocation gets a new buffer id."""
    import torch

    pool = cupy.get_default_memory_pool()
    a, b = cupy.empty(1000, cupy.float32), cupy.empty(1000, cupy.float32)
    for array in (a, b, a[10:]):
        base, size, buffer_id = backend.allocation(array)
        assert base <= array.data.ptr < base + size and buffer_id > 0
    t = torch.empty(1000, device="cuda")
    base, size, _ = backend.allocation(cupy.from_dlpack(t))
    assert base <= t.data_ptr() < base + size
    big = cupy.empty(64 << 20, cupy.uint8)
    first = backend.allocation(big)
    del big, a, b
    pool.free_all_blocks()
    again = backend.allocation(cupy.empty(64 << 20, cupy.uint8))
    assert again[2] != first[2]
