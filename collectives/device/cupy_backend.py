"""The device interface on a real CUDA GPU, through CuPy (``pip install
collectives[cuda12]`` or ``[cuda13]``).

Kernels come from ``kernels/collectives.cu``, compiled by NVRTC through
``cupy.RawModule`` at first use: one module per dtype, cached per device and hash of
the sources (CuPy also keeps the compiled code on disk). Copies are
``cudaMemcpyAsync`` on the executor's streams; the IPC slots are allocations of their
own (``cudaMalloc``, not CuPy's pool), opened by the others as any shared array is.

For the peer-read algorithms, any device array is shared where it lies: its allocation
(base address, size and the driver's buffer id, from ``cuPointerGetAttribute``: CuPy's
and torch's pools sub-allocate) is exported with ``cudaIpcGetMemHandle`` and opened by
the others with ``cudaIpcOpenMemHandle``. The stream fences are the driver's stream
memory operations (``cuStreamWriteValue32``/``cuStreamWaitValue32``) on words of the
node's shared window, registered for the device with ``cudaHostRegister``; the driver
API is reached through ctypes (``libcuda.so.1``), so nothing beyond CuPy is needed.

This module is imported only when a device array is first seen.
"""

import contextlib
import ctypes
import threading
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import cupy
import numpy as np
from cupy.cuda import runtime

from ..dtypes import EXTRA_DTYPES
from . import kernels
from .array import DeviceArray
from .contract import Array, DeviceBackend, DTypeLike, Event, HostWords, Shape, Stream

_BFLOAT16 = next((d for d in EXTRA_DTYPES if d.name == "bfloat16"), None)
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)
_IPC_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
_ALREADY_MAPPED = 208  # cudaErrorAlreadyMapped
_PAGE_2M = 2 << 20  # the driver's large page: what dedicated() allocations are made of
_HOST_REGISTER_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
_HOST_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
_BUFFER_ID, _RANGE_START, _RANGE_SIZE = 7, 11, 12  # CU_POINTER_ATTRIBUTE_*
_WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0
_PAGE = 4096

_backends: dict = {}  # device id -> its backend
_lock = threading.Lock()


def backend(device_id: int) -> "CupyDevice":
    """The backend of CUDA device ``device_id`` (one per device and process)."""
    with _lock:
        if device_id not in _backends:
            _backends[device_id] = CupyDevice(device_id)
        return _backends[device_id]


def device_array(x, name):
    """A user's CuPy array, torch CUDA tensor or ``__cuda_array_interface__`` object as a
    :class:`~collectives.device.DeviceArray` (zero copy)."""
    module = type(x).__module__.split(".", 1)[0]
    if module == "torch":
        return _torch_array(x, name)
    if not isinstance(x, cupy.ndarray):
        try:
            x = cupy.asarray(x)  # __cuda_array_interface__: a view, no copy
        except Exception as exc:  # noqa: BLE001 - reported as a TypeError on the argument
            raise TypeError(f"{name}: CuPy cannot view {type(x).__name__} as a device array: {exc}") from exc
    b = backend(x.device.id)
    stream = b.current_stream()

    def allocate(shape):  # on the user's stream: CuPy's pool then reuses it in the user's order
        b.counters["allocations"] += 1
        with cupy.cuda.Device(b.id), stream:
            return cupy.empty(shape, x.dtype)

    return DeviceArray(b, x, x.dtype, stream, _identity, f"cuda:{b.id}", allocate=allocate)


def _identity(data):
    return data


def _torch_array(tensor, name):
    import torch

    if tensor.dtype == torch.bfloat16:
        if _BFLOAT16 is None:
            raise TypeError(f"{name} is a bfloat16 tensor: the collectives need ml_dtypes for it "
                            "(pip install ml_dtypes)")
        data, dtype = cupy.from_dlpack(tensor.detach().view(torch.int16)), _BFLOAT16

        def rewrap(result):
            return torch.from_dlpack(result).view(torch.bfloat16)
    elif tensor.dtype == torch.bool:
        raise TypeError(f"{name} has dtype torch.bool, which the collectives do not reduce")
    else:
        data, dtype = cupy.from_dlpack(tensor.detach()), None
        rewrap = torch.from_dlpack
    b = backend(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())
    stream = external_stream(torch.cuda.current_stream(tensor.device).cuda_stream, b.id)

    def allocate(shape):  # torch's caching allocator owns results, on torch's current stream
        b.counters["allocations"] += 1
        made = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        return cupy.from_dlpack(made.view(torch.int16) if made.dtype == torch.bfloat16 else made)

    return DeviceArray(b, data, dtype if dtype is not None else data.dtype, stream, rewrap, f"cuda:{b.id}",
                       allocate=allocate)


class _StreamPointer:
    """A raw cudaStream_t in the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def external_stream(ptr, device_id):
    """A CuPy stream for someone else's ``cudaStream_t`` (torch's current stream)."""
    if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy 14: ExternalStream is deprecated
        return cupy.cuda.Stream.from_external(_StreamPointer(ptr))
    return cupy.cuda.ExternalStream(ptr, device_id)


class _OpenedEvent:
    """Another process's interprocess event, opened here (a raw cudaEvent_t)."""

    def __init__(self, ptr):
        self.ptr = ptr


class CupyDevice:
    kind = "cuda"

    def __init__(self, device_id):
        self.id = int(device_id)
        with cupy.cuda.Device(self.id):
            props = runtime.getDeviceProperties(self.id)
        self.name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.multiprocessors = int(props["multiProcessorCount"])
        self.pci = (int(props.get("pciDomainID", 0)), int(props["pciBusID"]), int(props["pciDeviceID"]))
        self.uuid = "pci:%04x:%02x:%02x" % self.pci
        self.ipc_capable = True
        self._modules = {}
        # What the device was asked to make, as the stand-in counts it (integer increments,
        # for tests that a warm call makes nothing): events, allocations (device memory, the
        # results made for the user included), pinned host buffers, other processes'
        # allocations opened, host memory registered.
        self.counters = Counter()
        self.launches = Counter()  # copies and kernels launched, by kind (what a phase launches, for tests)

    def __repr__(self):
        return f"<cuda:{self.id} {self.name}>"

    # -- memory ---------------------------------------------------------------------------------
    def empty(self, shape: Shape, dtype: DTypeLike, stream: Stream = None) -> Array:
        """Device memory from CuPy's pool. ``stream``: the stream it is used on, if not
        the library's long-lived buffers: the pool hands freed memory out again only in
        that stream's order, so a temporary freed while its work is queued stays safe."""
        self.counters["allocations"] += 1
        with cupy.cuda.Device(self.id), (stream if stream is not None else contextlib.nullcontext()):
            return cupy.empty(shape, dtype)

    def dedicated(self, shape: Shape, dtype: DTypeLike) -> Array:
        """Device memory in an allocation of its own (``cudaMalloc``, not CuPy's pool,
        which carves arrays out of shared chunks): what ``Communicator.empty(device=)``
        returns, which the node's ranks open whole. ``cudaFree`` when it is gone. Whole
        2 MiB pages: the driver may serve small ``cudaMalloc``s from one page, and a
        process maps another's memory once (a second mapping of it is refused); an
        allocation of whole pages shares none with another."""
        self.counters["allocations"] += 1
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        with cupy.cuda.Device(self.id):
            memory = cupy.cuda.Memory(-(-max(int(nbytes), 1) // _PAGE_2M) * _PAGE_2M)
            return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))

    def prepare(self, dtype: DTypeLike) -> None:
        """Compile ``dtype``'s kernels now (NVRTC, at the first call on a dtype), before
        the call sends anything, not inside the progress engine."""
        self._module(np.dtype(dtype))

    def storage_dtype(self, dtype: DTypeLike) -> np.dtype:
        """CuPy has no bfloat16: its bits live in uint16."""
        dtype = np.dtype(dtype)
        return np.dtype(np.uint16) if dtype.name == "bfloat16" else dtype

    def pinned(self, nbytes: int) -> np.ndarray:
        self.counters["pinned"] += 1
        memory = cupy.cuda.alloc_pinned_memory(max(int(nbytes), 1))
        return np.frombuffer(memory, np.uint8, int(nbytes))  # keeps the pinned block alive

    # -- streams and events -----------------------------------------------------------------------
    def stream(self, name: str = "stream") -> Stream:
        with cupy.cuda.Device(self.id):
            return cupy.cuda.Stream(non_blocking=True)

    def current_stream(self) -> Stream:
        with cupy.cuda.Device(self.id):
            return cupy.cuda.get_current_stream()

    def event(self, interprocess: bool = False) -> Event:
        self.counters["events"] += 1
        with cupy.cuda.Device(self.id):
            return cupy.cuda.Event(block=False, disable_timing=True, interprocess=interprocess)

    # Each under this device: a stream handle 0 (CuPy's and torch's default stream) means
    # the null stream of the calling thread's current device, and a progress thread
    # starts on device 0.
    def record(self, event: Event, stream: Stream) -> None:
        with cupy.cuda.Device(self.id):
            runtime.eventRecord(event.ptr, stream.ptr)

    def wait(self, stream: Stream, event: Event) -> None:
        with cupy.cuda.Device(self.id):
            runtime.streamWaitEvent(stream.ptr, event.ptr, 0)

    def query(self, event: Event) -> bool:
        with cupy.cuda.Device(self.id):
            return runtime.eventQuery(event.ptr) == 0

    def synchronize(self, event: Event) -> None:
        with cupy.cuda.Device(self.id):
            runtime.eventSynchronize(event.ptr)

    def synchronize_stream(self, stream: Stream) -> None:
        with cupy.cuda.Device(self.id):
            runtime.streamSynchronize(stream.ptr)

    def poll(self) -> None:
        """A GPU progresses by itself: nothing to do."""

    # -- copies and kernels -----------------------------------------------------------------------------
    def copy(self, dst: Array, src: Array, stream: Stream) -> None:
        nbytes = _nbytes(dst)
        if nbytes != _nbytes(src):
            raise ValueError(f"copy of {_nbytes(src)} bytes into {nbytes}")
        self.launches["copy"] += 1
        if nbytes:
            with cupy.cuda.Device(self.id):  # the stream's device (a progress thread starts on device 0)
                runtime.memcpyAsync(_ptr(dst), _ptr(src), nbytes, _MEMCPY_DEFAULT, stream.ptr)

    def copy_n(self, stream: Stream, dsts: Sequence[Array], srcs: Sequence[Array]) -> None:
        """Each of ``srcs`` into ``len(dsts) // len(srcs)`` destinations, in one kernel
        (contiguous device arrays of one itemsize, each destination as large as its
        source; at most 16 destinations): source q into ``dsts[q * m : q * m + m]``,
        read once (block row q copies it)."""
        k, total = len(srcs), len(dsts)
        if not 1 <= k <= total <= kernels.MAX_INPUTS or total % k:
            raise ValueError(f"copy_n takes 1 to {kernels.MAX_INPUTS} destinations, as many for each source")
        m = total // k
        itemsize = dsts[0].dtype.itemsize
        counts = [int(dsts[q * m].size) for q in range(k)]
        if any(d.dtype.itemsize != itemsize or _nbytes(d) != _nbytes(srcs[i // m]) for i, d in enumerate(dsts)):
            raise ValueError("copy_n: the copies must be of one itemsize, each source as large as its destinations")
        self.launches["copy_n"] += 1
        if not max(counts):
            return
        null = np.uint64(0)
        args = (np.int32(k), np.int32(m), *dsts, *[null] * (kernels.MAX_INPUTS - total), *srcs,
                *[null] * (kernels.MAX_INPUTS - k), *(np.int64(n) for n in counts),
                *[np.int64(0)] * (kernels.MAX_INPUTS - k))
        kernel = self._module(dsts[0].dtype).get_function(kernels.copy_n(itemsize))
        grid = (kernels.blocks(kernels.vector_items(max(counts), itemsize), self.multiprocessors), k)
        with cupy.cuda.Device(self.id), stream:  # a RawKernel launches on the current stream
            kernel(grid, (kernels.THREADS,), args)

    def reduce2(self, stream: Stream, op: str, dtype: np.dtype, dst: Array, a: Array, b: Array) -> None:
        n = int(dst.size)
        self.launches["reduce2"] += 1
        if n:
            self._launch(dtype, kernels.reduce2(dtype, op), kernels.vector_items(n, dtype.itemsize), stream,
                         (dst, a, b, np.int64(n)))

    def reduce_n(self, stream: Stream, op: str, dtype: np.dtype, dst: Array | Sequence[Array],
                 sources: Sequence[Array], divisor: float | None = None) -> None:
        """``dst`` = the left fold of ``sources`` (1 to 16), in one kernel; ``dst`` may be
        a list of up to 16 arrays, each given the fold (one may be an input itself).
        ``divisor`` (avg's fold that is the call's result): the fold divided by it."""
        dsts: list[Array] = list(dst) if isinstance(dst, (list, tuple)) else [dst]
        n = int(dsts[0].size)
        kernels.check_divisor("reduce_n", op, dtype, divisor)
        self.launches["reduce_n"] += 1
        if not 1 <= len(sources) <= kernels.MAX_INPUTS or not 1 <= len(dsts) <= kernels.MAX_INPUTS:
            raise ValueError(f"reduce_n takes 1 to {kernels.MAX_INPUTS} inputs and outputs; got {len(sources)} "
                             f"and {len(dsts)}")
        if not n:
            return
        null = np.uint64(0)
        inputs = list(sources) + [null] * (kernels.MAX_INPUTS - len(sources))
        outputs = dsts + [null] * (kernels.MAX_INPUTS - len(dsts))
        name = kernels.reduce_n(dtype, op, divide=divisor is not None)
        self._launch(dtype, name, kernels.vector_items(n, dtype.itemsize), stream,
                     (np.int64(n), np.int32(len(sources)), np.int32(len(dsts)),
                      np.float64(1.0 if divisor is None else divisor), *inputs, *outputs))

    def reduce_blocks(self, stream: Stream, op: str, dtype: np.dtype, dsts: Sequence[Array],
                      sources: Sequence[Array], offsets: Sequence[int], divisor: float | None = None) -> None:
        """``dsts[j]`` = the left fold of ``sources[q][offsets[j] : offsets[j] +
        dsts[j].size]`` over q (1 to 16 sources, 1 to 16 outputs), in one kernel: block
        row j folds output j; ``divisor`` as for :meth:`reduce_n`."""
        m, k = len(dsts), len(sources)
        if not 1 <= k <= kernels.MAX_INPUTS or not 1 <= m == len(offsets) <= kernels.MAX_INPUTS:
            raise ValueError(f"reduce_blocks takes 1 to {kernels.MAX_INPUTS} inputs and outputs, an offset each; "
                             f"got {k} and {m}, {len(offsets)} offsets")
        counts = [int(d.size) for d in dsts]
        if any(o < 0 or o + n > int(x.size) for o, n in zip(offsets, counts) for x in sources):
            raise ValueError("reduce_blocks: a block lies outside its inputs")
        kernels.check_divisor("reduce_blocks", op, dtype, divisor)
        self.launches["reduce_blocks"] += 1
        if not max(counts):
            return
        pad = kernels.MAX_INPUTS
        null = np.uint64(0)
        args = (np.int32(k), np.int32(m), np.float64(1.0 if divisor is None else divisor),
                *sources, *[null] * (pad - k), *dsts, *[null] * (pad - m),
                *(np.int64(o) for o in offsets), *[np.int64(0)] * (pad - m),
                *(np.int64(n) for n in counts), *[np.int64(0)] * (pad - m))
        kernel = self._module(dtype).get_function(kernels.reduce_blocks(dtype, op, divide=divisor is not None))
        grid = (kernels.blocks(kernels.vector_items(max(counts), dtype.itemsize), self.multiprocessors), m)
        with cupy.cuda.Device(self.id), stream:  # a RawKernel launches on the current stream
            kernel(grid, (kernels.THREADS,), args)

    def divide(self, stream: Stream, dtype: np.dtype, x: Array, divisor: float) -> None:
        n = int(x.size)
        self.launches["divide"] += 1
        if n:
            self._launch(dtype, kernels.divide_by(dtype), n, stream, (x, np.int64(n), np.float64(divisor)))

    def cast_divide(self, stream: Stream, src_dtype: np.dtype, dst_dtype: np.dtype, dst: Array, src: Array,
                    divisor: float) -> None:
        n = int(dst.size)
        if n:
            self._launch(src_dtype, kernels.cast_divide(src_dtype, dst_dtype), n, stream,
                         (dst, src, np.int64(n), np.float64(divisor)))

    def pack(self, stream: Stream, dst: Array, src: Array) -> None:
        self._strided(kernels.pack, stream, dst, src, src)

    def unpack(self, stream: Stream, dst: Array, src: Array) -> None:
        self._strided(kernels.unpack, stream, dst, src, dst)

    def _strided(self, which, stream, dst, src, view):
        n = int(view.size)
        if not n:
            return
        if view.ndim > kernels.MAX_DIMS:
            raise ValueError(f"arrays of more than {kernels.MAX_DIMS} dimensions cannot be packed on the device")
        shape = [np.int64(s) for s in view.shape] + [np.int64(1)] * (kernels.MAX_DIMS - view.ndim)
        strides = [np.int64(s) for s in view.strides] + [np.int64(0)] * (kernels.MAX_DIMS - view.ndim)
        dtype = view.dtype
        args = (dst, src, np.int64(n), np.int32(view.ndim), *shape, *strides)
        # the strided side goes as a byte pointer to its first element
        args = tuple(np.uint64(a.data.ptr) if a is view else a for a in args)
        self._launch(dtype, which(dtype.itemsize), n, stream, args)

    def _launch(self, dtype, name, work_items, stream, args):
        kernel = self._module(dtype).get_function(name)
        with cupy.cuda.Device(self.id), stream:  # a RawKernel launches on the current stream
            kernel((kernels.blocks(work_items, self.multiprocessors),), (kernels.THREADS,), args)

    def _module(self, dtype):
        key = (dtype.name, kernels.source_hash())
        module = self._modules.get(key)
        if module is None:
            with cupy.cuda.Device(self.id):
                module = cupy.RawModule(code=kernels.inlined_source(), options=kernels.NVRTC_OPTIONS,
                                        name_expressions=kernels.for_dtype(dtype))
                module.compile()
            self._modules[key] = module
        return module

    # -- MPI and IPC -------------------------------------------------------------------------------------
    def mpi_buffer(self, array: Array) -> Any:
        return array  # a CUDA-aware MPI takes __cuda_array_interface__ objects

    def ipc_close_event(self, event: Event) -> None:
        with cupy.cuda.Device(self.id):
            runtime.eventDestroy(event.ptr)

    def ipc_event_handle(self, event: Event) -> bytes:
        return bytes(runtime.ipcGetEventHandle(event.ptr))

    def ipc_open_event(self, handle: bytes) -> Event:
        with cupy.cuda.Device(self.id):
            return _OpenedEvent(runtime.ipcOpenEventHandle(bytes(handle)))

    # -- peer reads: any allocation shared, stream memory operations --------------------------
    def allocation(self, array: Array) -> tuple[int, int, int] | None:
        """``(base, size, buffer id)`` of the allocation ``array`` lies in."""
        with cupy.cuda.Device(self.id):
            return driver().allocation(_ptr(array))

    def export(self, base: int) -> bytes:
        """An IPC handle of the allocation at ``base`` (64 bytes)."""
        with cupy.cuda.Device(self.id):
            return bytes(runtime.ipcGetMemHandle(int(base)))

    def open_allocation(self, handle: bytes, nbytes: int) -> Array:
        """Another process's allocation (an :meth:`export` handle), ``nbytes`` of it."""
        self.counters["opened"] += 1
        with cupy.cuda.Device(self.id):
            ptr = runtime.ipcOpenMemHandle(bytes(handle), _IPC_LAZY_PEER_ACCESS)
            return _wrap(ptr, int(nbytes), self.id)

    def close_allocation(self, array: Array) -> None:
        with cupy.cuda.Device(self.id):
            runtime.ipcCloseMemHandle(array.data.ptr)

    def already_mapped(self, error: BaseException) -> bool:
        """Whether ``error`` is cudaIpcOpenMemHandle's cudaErrorAlreadyMapped: a mapping
        this process holds overlaps the allocation it opens."""
        return isinstance(error, runtime.CUDARuntimeError) and error.status == _ALREADY_MAPPED

    def map_host(self, words: np.ndarray) -> HostWords:
        """``words`` (uint32 host memory) registered for the device: what
        :meth:`write_value` and :meth:`wait_value` take."""
        self.counters["host_mappings"] += 1
        start = words.ctypes.data
        first = start - start % _PAGE
        length = -(-(start + words.nbytes - first) // _PAGE) * _PAGE
        with cupy.cuda.Device(self.id):
            try:
                runtime.hostRegister(first, length, _HOST_REGISTER_PORTABLE_MAPPED)
                registered = first
            except runtime.CUDARuntimeError as exc:
                if exc.status != _HOST_ALREADY_REGISTERED:
                    raise
                registered = None  # someone registered it already: theirs to undo
            d, device = driver(), ctypes.c_uint64()
            d.check(d.host_device_pointer(ctypes.byref(device), ctypes.c_void_p(start), 0), "the device address")
        return _HostWords(words, int(device.value), registered)

    def unmap_host(self, mapping: HostWords) -> None:
        if mapping.registered is not None:
            with cupy.cuda.Device(self.id):
                runtime.hostUnregister(mapping.registered)
            mapping.registered = None

    def write_value(self, stream: Stream, mapping: HostWords, index: int, value: int) -> None:
        """``mapping``'s word ``index`` = ``value`` once ``stream`` gets there (the driver
        fences memory first: what the stream did before is visible before the word)."""
        d = driver()
        with cupy.cuda.Device(self.id):
            d.check(d.write_value(stream.ptr, mapping.device + 4 * index, value & 0xFFFFFFFF, 0),
                    "cuStreamWriteValue32")

    def wait_value(self, stream: Stream, mapping: HostWords, index: int, value: int) -> None:
        """``stream`` waits until ``(int32)(word - value) >= 0``."""
        d = driver()
        with cupy.cuda.Device(self.id):
            d.check(d.wait_value(stream.ptr, mapping.device + 4 * index, value & 0xFFFFFFFF, _WAIT_GEQ),
                    "cuStreamWaitValue32")

    def pointer_table(self, arrays: Sequence[Array]) -> Any:
        """The device addresses of ``arrays``, in device memory (the fence kernel's table)."""
        self.counters["allocations"] += 1
        with cupy.cuda.Device(self.id):
            return cupy.asarray(np.array([_ptr(a) for a in arrays], np.uint64))

    def fence_kernel(self, stream: Stream, table: Any, flags: Array, rank: int, epoch: int, limit: float,
                     late: HostWords, late_index: int, digest: int = 0, wait: bool = True,
                     check: bool = False) -> None:
        """The fence kernel (``kernels/collectives.cu``): one block of a thread per rank;
        ``flags`` 2 words a rank (epoch, digest)."""
        self.launches["fence" if wait else "fence signal"] += 1
        size = int(table.size)
        kernel = self._module(np.dtype(np.uint32)).get_function(kernels.FENCE)  # every dtype's module has it
        limit_ns = int(min(limit, 1e9) * 1e9)
        args = (table, flags, np.int32(rank), np.int32(size), np.uint32(epoch & 0xFFFFFFFF), np.uint64(limit_ns),
                np.uint64(late.device + 4 * late_index), np.uint32(digest & 0xFFFFFFFF), np.int32(bool(wait)),
                np.int32(bool(check)))
        with cupy.cuda.Device(self.id), stream:
            kernel((1,), (32 * -(-size // 32),), args)

    def can_access_peer(self, uuid: str) -> bool:
        """Whether this device can read the memory of the device ``uuid`` (same node)."""
        if uuid == self.uuid:
            return True
        for other in range(runtime.getDeviceCount()):
            props = runtime.getDeviceProperties(other)
            pci = (int(props.get("pciDomainID", 0)), int(props["pciBusID"]), int(props["pciDeviceID"]))
            if "pci:%04x:%02x:%02x" % pci == uuid:
                return bool(runtime.deviceCanAccessPeer(self.id, other))
        return False


if TYPE_CHECKING:  # mypy compares the CuPy backend with the device contract
    _conforms: DeviceBackend = CupyDevice(0)


class _Driver:
    """The few CUDA driver functions CuPy does not wrap, through ctypes (loaded once)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        u64, u32, c_uint = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint
        self.pointer_attributes = lib.cuPointerGetAttributes
        self.pointer_attributes.argtypes = [c_uint, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_void_p), u64]
        self.write_value = _first(lib, "cuStreamWriteValue32_v2", "cuStreamWriteValue32")
        self.write_value.argtypes = [ctypes.c_void_p, u64, u32, c_uint]
        self.wait_value = _first(lib, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        self.wait_value.argtypes = [ctypes.c_void_p, u64, u32, c_uint]
        self.host_device_pointer = _first(lib, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
        self.host_device_pointer.argtypes = [ctypes.POINTER(u64), ctypes.c_void_p, c_uint]
        for function in (self.pointer_attributes, self.write_value, self.wait_value, self.host_device_pointer):
            function.restype = ctypes.c_int
        # cuPointerGetAttributes' arguments, made once: where the start, size and buffer id land
        self.base, self.size, self.buffer_id = ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_uint64()
        self.attributes = (ctypes.c_int * 3)(_RANGE_START, _RANGE_SIZE, _BUFFER_ID)
        self.into = (ctypes.c_void_p * 3)(*(ctypes.cast(ctypes.byref(v), ctypes.c_void_p)
                                            for v in (self.base, self.size, self.buffer_id)))
        self.lock = threading.Lock()  # ctypes lets go of the GIL: one caller of those at a time

    def allocation(self, ptr):
        """``(start, size, buffer id)`` of the allocation holding device address ``ptr``."""
        with self.lock:
            self.check(self.pointer_attributes(3, self.attributes, self.into, ptr), "cuPointerGetAttributes")
            return int(self.base.value), int(self.size.value), int(self.buffer_id.value)

    def check(self, result, what):
        if result != 0:
            raise RuntimeError(f"CUDA driver: {what} failed with CUresult {result}")


def _first(lib, *names):
    for name in names:
        try:
            return getattr(lib, name)
        except AttributeError:
            continue
    raise RuntimeError(f"the CUDA driver has none of {', '.join(names)}")


_driver = None


def driver():
    """The driver functions (loaded at the first use)."""
    global _driver
    if _driver is None:
        _driver = _Driver()
    return _driver


class _HostWords:
    """32-bit words of host memory (the node's shared window) registered for the device:
    ``device`` is their device address, ``registered`` the page range registered."""

    def __init__(self, words, device, registered):
        self.words, self.device, self.registered = words, device, registered


def _wrap(ptr, nbytes, device_id):
    memory = cupy.cuda.UnownedMemory(ptr, max(nbytes, 1), None, device_id)
    return cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))


def _ptr(x):
    return x.ctypes.data if isinstance(x, np.ndarray) else x.data.ptr


def _nbytes(x):
    return int(x.nbytes)
