"""The device the device tests run on: the stand-in (``make test``) or a real GPU through
CuPy (``make test-gpu``, ``pytest --device cuda``). Both offer what the tests need, in
the manner of ``cupy.asarray``/``cupy.asnumpy``: arrays to and from the host, empty
arrays, a stream of the user's own, and a copy queued on it."""

import contextlib

import numpy as np


class StandIn:
    name = "standin"
    where = "standin:0"
    device = "standin"  # what Communicator.empty(device=) takes
    native_bfloat16 = True  # stand-in arrays can hold ml_dtypes' bfloat16 (CuPy's cannot)

    def __init__(self):
        from collectives.device import standin

        self.si = standin

    def asarray(self, host, stream=None):
        return self.si.asarray(host, stream)

    def asnumpy(self, x, stream=None):
        return self.si.asnumpy(x, stream)

    def empty(self, shape, dtype):
        return self.si.empty(shape, dtype)

    def new_stream(self):
        return self.si.device().stream("user")

    def use_stream(self, stream):
        return self.si.device().use_stream(stream)

    def copy_async(self, dst, host, stream):
        """``dst`` = ``host``, queued on ``stream`` (it runs when someone waits for it)."""
        self.si.device().copy(dst, np.ascontiguousarray(host).copy().reshape(-1), stream)

    def free_all_blocks(self):
        """Give the pool's unused segments back (they may be allocated again, under new ids)."""
        self.si.device().free_all_blocks()

    def dedicated(self, host):
        """A device array holding ``host`` in an allocation of its own (freed with it)."""
        host = np.ascontiguousarray(host)
        device = self.si.device()
        x = device.dedicated(host.shape, host.dtype)
        device.copy(x.reshape(-1), host.copy().reshape(-1), device.current_stream())
        return x

    def allocation(self, x):
        """``(base, bytes, buffer id)`` of the allocation ``x`` lies in."""
        return self.si.device().allocation(x)

    def unshareable(self, host):
        """A device array holding ``host`` in memory no other process can open: outside
        the stand-in's pool (as CUDA's managed memory is outside what IPC exports)."""
        return self.si.StandInArray(self.si.device(), np.ascontiguousarray(host).copy())

    def counters(self):
        """What the device was asked to make so far (events, allocations ...)."""
        return dict(self.si.device().counters)


class Cuda:
    name = "cuda"
    native_bfloat16 = False

    def __init__(self, rank):
        import cupy

        self.cupy = cupy
        self.id = rank % cupy.cuda.runtime.getDeviceCount()  # ranks share the GPUs there are
        cupy.cuda.Device(self.id).use()
        self.where = self.device = f"cuda:{self.id}"

    def asarray(self, host, stream=None):
        with stream if stream is not None else contextlib.nullcontext():
            return self.cupy.asarray(host)

    def asnumpy(self, x, stream=None):
        stream = stream or self.cupy.cuda.get_current_stream()
        stream.synchronize()
        return self.cupy.asnumpy(x, stream=stream)

    def empty(self, shape, dtype):
        return self.cupy.empty(shape, dtype)

    def new_stream(self):
        return self.cupy.cuda.Stream(non_blocking=True)

    def use_stream(self, stream):
        return stream

    def copy_async(self, dst, host, stream):
        dst.set(np.ascontiguousarray(host), stream=stream)

    def free_all_blocks(self):
        self.cupy.get_default_memory_pool().free_all_blocks()

    def dedicated(self, host):
        """A device array holding ``host`` in an allocation of its own (``cudaMalloc``,
        not the pool's; ``cudaFree`` when it is gone)."""
        host = np.ascontiguousarray(host)
        memory = self.cupy.cuda.Memory(max(host.nbytes, 1))
        x = self.cupy.ndarray(host.shape, host.dtype, self.cupy.cuda.MemoryPointer(memory, 0))
        x.set(host)
        return x

    def allocation(self, x):
        """``(base, bytes, buffer id)`` of the allocation ``x`` lies in (the driver's)."""
        from collectives.device.cupy_backend import backend

        return backend(self.id).allocation(x)

    def unshareable(self, host):
        """A device array holding ``host`` in managed memory, which CUDA IPC cannot export."""
        host = np.ascontiguousarray(host)
        x = self.cupy.ndarray(host.shape, host.dtype, self.cupy.cuda.malloc_managed(max(host.nbytes, 1)))
        x.set(host)
        self.cupy.cuda.get_current_stream().synchronize()
        return x

    def counters(self):
        """What the device was asked to make so far (the CuPy backend counts as the stand-in does)."""
        from collectives.device.cupy_backend import backend

        return dict(backend(self.id).counters)


def select(name, rank):
    """The device named on the command line (``--device``)."""
    if name == "cuda":
        return Cuda(rank)
    return StandIn()


def gpu_reason():
    """Why the GPU tests cannot run here, or None if they can."""
    try:
        import cupy
    except ImportError:
        return "no GPU here: CuPy is not installed (pip install 'collectives[cuda12]' or '[cuda13]')"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver, no device: the reason is the message
        return f"no GPU here: CUDA reports {type(exc).__name__}: {exc}"
    return None if count else "no GPU here: CUDA sees no device"
