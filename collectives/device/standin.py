"""A CPU stand-in for a GPU, adversarial by design, so that the device path is tested
on machines without one (CI, the development machine).

It implements the same narrow device interface as the CuPy backend
(:mod:`collectives.device`): device memory, pinned host memory, streams, events,
asynchronous copies, kernel launches and CUDA IPC, with CUDA's semantics where they
matter for correctness, and the worst timing those semantics allow:

- **Lazy.** A copy or a kernel launch only queues work on its stream. Nothing runs
  until something waits for it: ``synchronize`` on an event or stream, or a query,
  poll or host wait that happens to run it. So a missing wait reads stale data here,
  every time, where on a GPU it would be a rare race.
- **Shuffled.** When work runs, the stand-in picks at random among the streams whose
  next operation may run (an operation waiting on an event may not, until that
  event's work has run), so streams interleave in every order CUDA allows.
- **Garbage.** New device and pinned memory is filled with the byte 0xA5, so reading
  memory before the copy that should have filled it shows up as wrong values.
- **Opaque.** Device arrays (:class:`StandInArray`) have no ``__array__`` and no
  buffer protocol: the host cannot read them by accident. :func:`asarray` and
  :func:`asnumpy` move data the way ``cupy.asarray``/``cupy.asnumpy`` do (the latter
  synchronizes the current stream first).
- **IPC across processes.** Interprocess memory and events live in files under
  ``/dev/shm`` that other processes of the node map, so ranks under ``mpiexec`` use
  the library's CUDA-IPC path against each other. A stream waiting on another
  process's event waits until that process has run the work the event marks.
- **CUDA-aware MPI**, emulated: :meth:`StandInDevice.mpi_buffer` hands MPI the
  device memory itself, as it is at that moment.
- **Any array can be opened by the node's other processes**, as any ``cudaMalloc``
  allocation can through CUDA IPC: device memory comes from a pool (as CuPy's and
  torch's), *segments* carved from one sparse file per process in ``/dev/shm``, each
  with a buffer id, and arrays are blocks inside them. :meth:`StandInDevice.allocation`
  says which segment an array lies in (base, size, buffer id), :meth:`export` makes a
  handle for it and :meth:`open_allocation` maps another process's. A segment freed
  (``free_all_blocks``) and carved again at the same base gets a new buffer id, and a
  mapping of the old one raises at its next use instead of reading the new memory: a
  stale mapping on a GPU reads whatever lives there now.
- **Stream memory operations**: :meth:`write_value` and :meth:`wait_value` on 32-bit
  words of host memory (the node's shared window), lazily like everything else; a
  stream waiting on a word another process writes waits for that process. A
  **fence kernel** (:meth:`fence_kernel`, the distinct-GPU fence) writes this rank's
  flag (and digest) and waits for the peers' with a time limit, comparing their
  digests where asked, as ``kernels/collectives.cu``'s does.

The random choices come from ``random.Random(seed)``; the seed is
``COLLECTIVES_STANDIN_SEED`` (default 0) plus the MPI rank, so a run can be repeated
(message timing still varies). Kernels run as NumPy on the memory, through the same op
layer as the CPU path; the CUDA kernels' own arithmetic is tested separately
(``tests/device/test_kernels.py``).
"""

import atexit
import mmap
import os
import random
import struct
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import ops as ops_layer
from ..dtypes import EXTRA_DTYPES
from . import kernels
from .contract import Array, DeviceBackend, DTypeLike, HostWords, Shape

GARBAGE = 0xA5
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
HANDLE_BYTES = 64  # as CUDA's IPC handles
_REMOTE_PATIENCE = 120.0  # seconds a synchronize may wait for another process's work
HEAP_BYTES = 4 << 30  # the address space of one process's device memory (a sparse file)
GRANULE = 64 << 10  # segments are whole granules; the file's head holds a buffer id per granule
SEGMENT_BYTES = 2 << 20  # the smallest segment the pool carves (larger arrays get one their size)
ALIGNMENT = 256  # blocks start on this boundary, as CuPy's do
MAX_COPIES = 16  # copy_n's destinations in one kernel, as kernels/collectives.cu's


class StaleMapping(RuntimeError):
    """A kernel or copy read another process's memory through a mapping of a segment
    that process has freed since (its buffer id changed)."""


class AlreadyMapped(RuntimeError):
    """CUDA's cudaErrorAlreadyMapped: a process opens another's memory while a mapping
    it holds overlaps it (CUDA maps a process's memory once per process)."""


class DeviceDeadlock(RuntimeError):
    """A synchronize waits for work that can never run (a stream waits on an event no
    one will record, or on another process that stopped)."""


class StandInArray:
    """Memory of the stand-in device: shape, dtype and views like a CuPy array, but no
    way for the host to read or write it except through the device's copies and kernels."""

    __collectives_device__ = True  # how the collectives recognise a stand-in array

    def __init__(self, device, memory, owner=None, valid=None):
        self._device = device
        self._memory = memory  # a NumPy array: the device memory (or a view of it)
        self._owner = owner  # the pool block it lies in: freed when no array refers to it
        self._valid = valid  # for another process's memory: raises StaleMapping once it is freed

    def _like(self, memory):
        return StandInArray(self._device, memory, self._owner, self._valid)

    # -- what a CuPy array tells about itself ---------------------------------------------
    shape = property(lambda self: self._memory.shape)
    dtype = property(lambda self: self._memory.dtype)
    size = property(lambda self: self._memory.size)
    ndim = property(lambda self: self._memory.ndim)
    nbytes = property(lambda self: self._memory.nbytes)
    itemsize = property(lambda self: self._memory.itemsize)
    strides = property(lambda self: self._memory.strides)
    flags = property(lambda self: self._memory.flags)
    device = property(lambda self: self._device)

    @property
    def ptr(self):
        return self._memory.__array_interface__["data"][0]

    def extent(self):
        """``(first byte, one past the last byte)`` this array may touch."""
        return np.byte_bounds(self._memory) if self._memory.size else (self.ptr, self.ptr)

    def __getitem__(self, key):
        return self._like(self._memory[key])

    def __len__(self):
        return len(self._memory)

    def reshape(self, *shape):
        return self._like(self._memory.reshape(*shape))

    def view(self, dtype):
        return self._like(self._memory.view(dtype))

    def transpose(self, *axes):
        return self._like(self._memory.transpose(*axes))

    @property
    def T(self):
        return self.transpose()

    def __repr__(self):
        return f"<StandInArray shape={self.shape} dtype={self.dtype.name}>"

    def __array__(self, *args, **kwargs):
        raise TypeError("a StandInArray lives in (stand-in) device memory: use collectives.device.standin.asnumpy")

    def __eq__(self, other):  # like a device array, no silent host comparison
        raise TypeError("compare StandInArrays on the host: collectives.device.standin.asnumpy(x)")

    __hash__ = object.__hash__


class Stream:
    def __init__(self, device, name):
        self.device = device
        self.name = name
        self.queue = deque()

    def __repr__(self):
        return f"<stand-in stream {self.name}>"


class Event:
    """CUDA's event: ``record`` captures the work queued on a stream so far; the event is
    complete once that work has run. A wait captures the latest record at its call."""

    def __init__(self, device):
        self.device = device
        self._recorded = 0  # generations: record() calls so far
        self._completed = 0  # the generation whose marker has run

    def _generation(self):
        return self._recorded

    def _reached(self, generation):
        return self._completed >= generation

    def _bump(self):
        self._recorded += 1
        return self._recorded

    def _complete(self, generation):
        self._completed = max(self._completed, generation)


class SharedEvent(Event):
    """An interprocess event: its two counters live in a file that other processes map."""

    def __init__(self, device, path=None):
        super().__init__(device)
        self.owner = path is None
        if self.owner:
            fd, path = tempfile.mkstemp(prefix="collectives-standin-event-", dir=SHM_DIR)
            os.ftruncate(fd, 16)
            device._owned_files.append(path)
        else:
            fd = os.open(path, os.O_RDWR)
        self.path = path
        self._map = mmap.mmap(fd, 16)
        os.close(fd)
        self._counters = np.frombuffer(self._map, np.int64)  # [recorded, completed]

    def _generation(self):
        return int(self._counters[0])

    def _reached(self, generation):
        return int(self._counters[1]) >= generation

    def _bump(self):
        self._counters[0] += 1
        return int(self._counters[0])

    def _complete(self, generation):
        if self._counters[1] < generation:
            self._counters[1] = generation



class _FenceKernel:
    """A fence kernel queued on a stand-in stream: it starts (writes its flags) when it
    reaches the head of its stream, and is done once every peer's flag has come, its
    time limit has passed, or the host has set its stop word (``late[late_index +
    rank]``, which no fence writes)."""

    def __init__(self, table, flags, rank, epoch, limit, late, late_index, digest, wait, check):
        self.table, self.flags, self.rank, self.epoch, self.limit = table, flags, rank, epoch, limit
        self.late, self.late_index, self.digest, self.wait, self.check = late, late_index, digest, wait, check
        self.started = None

    def _waiting(self):
        mine = self.flags._memory.view(np.uint32)
        return [q for q in range(len(self.table)) if q != self.rank and not _cyclic_geq(mine[q], self.epoch)]

    def ready(self):
        if self.started is None:  # the kernel runs: its writes first (the digest before the epoch)
            size = len(self.table)
            for q, flags in enumerate(self.table):
                if q != self.rank:
                    _check(flags)
                    words = flags._memory.view(np.uint32)
                    words[size + self.rank] = self.digest
                    words[self.rank] = self.epoch
            self.started = time.monotonic()
        if not self.wait:
            return True
        return not self._waiting() or self._stopped() or time.monotonic() - self.started > self.limit

    def _stopped(self):
        return bool(self.late[self.late_index + self.rank])

    def finish(self):
        if self._stopped() or not self.wait:  # released, or signalling only: it sets nothing
            return
        waiting = self._waiting()
        for q in waiting:
            self.late[self.late_index + q] = 1
        if self.check:
            mine, size = self.flags._memory.view(np.uint32), len(self.table)
            for q in range(size):
                if q != self.rank and q not in waiting and mine[size + q] != self.digest:
                    self.late[self.late_index + q] = 2


def _dtype_and_nbytes(shape, dtype):
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64)) if np.ndim(shape) else int(shape)
    return dtype, count * dtype.itemsize


class _Heap:
    """One process's stand-in device memory: a sparse file in ``/dev/shm`` mapped once,
    whose head holds a buffer id per granule (0: free) that other processes read to
    tell a live segment from a freed one. Segments (``cudaMalloc``'s) are carved from
    it first fit; a freed segment's range is carved again later, under a new id."""

    def __init__(self, device):
        fd, self.path = tempfile.mkstemp(prefix="cc-heap-", dir=SHM_DIR)
        device._owned_files.append(self.path)
        try:
            os.ftruncate(fd, HEAP_BYTES)
            self.map = mmap.mmap(fd, HEAP_BYTES)
        finally:
            os.close(fd)
        self.bytes = np.frombuffer(self.map, np.uint8)
        granules = HEAP_BYTES // GRANULE
        self.start = -(-granules * 8 // GRANULE) * GRANULE  # data after the table, granule-aligned
        self.ids = self.bytes[: granules * 8].view(np.int64)  # buffer id per granule of the whole file
        self.free = [(self.start, HEAP_BYTES - self.start)]  # (offset, length), by offset
        self.next_id = 1

    def carve(self, nbytes):
        """A new segment of at least ``nbytes``: ``(offset, length, buffer id)``."""
        length = -(-max(nbytes, 1) // GRANULE) * GRANULE
        for k, (offset, free) in enumerate(self.free):
            if free >= length:
                self.free[k:k + 1] = [(offset + length, free - length)] if free > length else []
                buffer_id, self.next_id = self.next_id, self.next_id + 1
                self.ids[offset // GRANULE : (offset + length) // GRANULE] = buffer_id
                self.bytes[offset : offset + length] = GARBAGE
                return offset, length, buffer_id
        raise MemoryError(f"stand-in device: out of memory ({nbytes} B asked, {HEAP_BYTES} B in all)")

    def release(self, offset, length):
        self.ids[offset // GRANULE : (offset + length) // GRANULE] = 0
        self.free.append((offset, length))
        self.free.sort()
        merged = []
        for start, size in self.free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self.free = merged


class _Segment:
    """One allocation of the pool, with its free blocks (``(offset, length)`` within it)."""

    def __init__(self, heap, nbytes):
        self.offset, self.length, self.buffer_id = heap.carve(nbytes)
        self.memory = heap.bytes[self.offset : self.offset + self.length]
        self.free = [(0, self.length)]
        self.used = 0
        self.dedicated = False  # one array's alone (StandInDevice.dedicated): back to the heap with it

    def take(self, nbytes):
        for k, (start, free) in enumerate(self.free):
            if free >= nbytes:
                self.free[k:k + 1] = [(start + nbytes, free - nbytes)] if free > nbytes else []
                self.used += 1
                return start
        return None

    def give(self, start, nbytes):
        self.used -= 1
        self.free.append((start, nbytes))
        self.free.sort()
        merged = []
        for begin, size in self.free:
            if merged and merged[-1][0] + merged[-1][1] == begin:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((begin, size))
        self.free = merged


class _Block:
    """An array's memory in the pool; given back when the last array on it goes, once
    the last operation queued on it (``last_use``, its number) has run."""

    __slots__ = ("device", "segment", "start", "nbytes", "last_use")

    def __init__(self, device, segment, start, nbytes):
        self.device, self.segment, self.start, self.nbytes = device, segment, start, nbytes
        self.last_use = 0

    def __del__(self):
        try:
            self.device._free(self)
        except Exception:  # noqa: BLE001 - at interpreter exit the device may be half torn down
            pass


class StandInDevice:
    """One stand-in GPU (per process). See the module docstring for how it behaves."""

    kind = "standin"
    ipc_capable = True

    def __init__(self, seed=None):
        if seed is None:
            seed = int(os.environ.get("COLLECTIVES_STANDIN_SEED", "0")) + _mpi_rank()
        self.id = 0
        self.name = "stand-in device 0"
        self.uuid = "standin-0"  # one device per node, as ranks sharing one GPU
        self.multiprocessors = 4
        self._rng = random.Random(seed)
        self._lock = threading.RLock()
        self._streams = []
        self.null_stream = self.stream("default")
        self._current = threading.local()
        self._owned_files = []
        self._heap = None  # made at the first allocation
        self._segments = []
        self._queued = 0  # operations queued so far (each is numbered)
        self._pending = {}  # the numbers of the queued operations not run yet, oldest first
        self._freed = deque()  # blocks no array refers to, not reusable yet
        self._peer_heaps = {}  # path -> (mapping, bytes) of another process's heap
        self._mapped = {}  # id of an open_allocation array -> (heap path, first byte, end): open now
        self.copies = deque(maxlen=1 << 16)  # (direction, bytes) of the latest copies queued, for tests
        # What the device was asked to make, for tests that a warm call makes nothing:
        # events, allocations (device and pinned), openings of other processes' memory.
        self.counters = Counter()
        self.launches = Counter()  # copies and kernels queued, by kind: what a phase launches, for tests
        atexit.register(self._remove_files)

    def __repr__(self):
        return f"<{self.name}>"

    # -- memory -------------------------------------------------------------------------------
    def empty(self, shape: Shape, dtype: DTypeLike, stream: Stream | None = None) -> Array:
        """Device memory (contents: garbage), a block of the pool. ``stream``: the stream
        it will be used on (CuPy's pool cares; the stand-in does not)."""
        dtype, nbytes = _dtype_and_nbytes(shape, dtype)
        self.counters["allocations"] += 1
        if nbytes == 0:
            return StandInArray(self, np.empty(shape, dtype))
        with self._lock:
            self._reuse()
            size = -(-nbytes // ALIGNMENT) * ALIGNMENT
            for segment in self._segments:
                start = segment.take(size)
                if start is not None:
                    break
            else:
                if self._heap is None:
                    self._heap = _Heap(self)
                segment = _Segment(self._heap, max(size, SEGMENT_BYTES))
                self._segments.append(segment)
                start = segment.take(size)
            memory = segment.memory[start : start + nbytes]
            memory[...] = GARBAGE
        block = _Block(self, segment, start, size)
        return StandInArray(self, memory.view(dtype).reshape(shape), block)

    def dedicated(self, shape: Shape, dtype: DTypeLike) -> Array:
        """Device memory (contents: garbage) in an allocation of its own, a segment no
        other array lies in (CUDA's ``cudaMalloc``, not the pool's): what
        ``Communicator.empty(device=)`` returns, which the node's ranks open whole. Its
        range goes back to the heap once the array is gone and the work queued on it has
        run (``cudaFree`` waits for the device)."""
        dtype, nbytes = _dtype_and_nbytes(shape, dtype)
        self.counters["allocations"] += 1
        if nbytes == 0:
            return StandInArray(self, np.empty(shape, dtype))
        with self._lock:
            if self._heap is None:
                self._heap = _Heap(self)
            segment = _Segment(self._heap, nbytes)
            segment.dedicated = True
            start = segment.take(segment.length)
        block = _Block(self, segment, start, segment.length)
        return StandInArray(self, segment.memory[:nbytes].view(dtype).reshape(shape), block)

    def free_all_blocks(self):
        """Give the segments no array lies in back to the heap (``cupy``'s
        ``MemoryPool.free_all_blocks``): their ranges may be carved again, under new ids."""
        with self._lock:
            self._reuse()
            keep = []
            for segment in self._segments:
                if segment.used:
                    keep.append(segment)
                else:
                    self._heap.release(segment.offset, segment.length)
            self._segments = keep

    def _free(self, block):
        """A block no array refers to any more: reusable once the last operation queued
        on it has run (a pool hands memory out again in stream order, never under work
        still queued on it)."""
        with self._lock:
            self._freed.append(block)

    def _reuse(self):
        """Give back the freed blocks that no queued operation touches any more."""
        # Each block is taken off the queue before it is looked at, and the ones kept go
        # back at its end: a block freed meanwhile (an array's __del__, run by the garbage
        # collector inside this loop, re-entering the lock) joins the queue instead of
        # changing it under an iterator ("deque mutated during iteration", seen under load).
        freed = self._freed
        for _ in range(len(freed)):
            block = freed.popleft()
            if block.last_use in self._pending:
                freed.append(block)
            else:
                block.segment.give(block.start, block.nbytes)
                if block.segment.dedicated:
                    self._heap.release(block.segment.offset, block.segment.length)

    def allocation(self, array: Array) -> tuple[int, int, int] | None:
        """``(base, nbytes, buffer id)`` of the segment ``array`` lies in (the allocation
        CUDA's ``cuPointerGetAttribute`` names), or None for memory that is not the
        pool's (an empty array, another process's)."""
        block = array._owner
        if block is None:
            return None
        segment = block.segment
        return self._heap.bytes[segment.offset:].__array_interface__["data"][0], segment.length, segment.buffer_id

    def export(self, base: int) -> bytes:
        """A handle other processes of the node open the allocation at ``base`` with."""
        offset = base - self._heap.bytes.__array_interface__["data"][0]
        buffer_id = int(self._heap.ids[offset // GRANULE])
        return _handle(self._heap.path, struct.pack("<qq", offset, buffer_id))

    def open_allocation(self, handle: bytes, nbytes: int) -> Array:
        """Map another process's allocation (an :meth:`export` handle): a uint8 array of
        its ``nbytes``, which raises :class:`StaleMapping` at its first use once that
        process has freed it. Raises :class:`AlreadyMapped` while a mapping this
        process holds (not closed) overlaps it: the same allocation, or one freed since
        whose range the new one reuses. CUDA refuses so in some such cases (an H200
        refused a new allocation over a freed one still mapped), not in all: the
        stand-in keeps the stricter rule, so that the tests meet every refusal."""
        path, extra = _path_and_extra(handle)
        offset, buffer_id = struct.unpack("<qq", extra)
        with self._lock:
            clash = [held for held in self._mapped.values()
                     if held[0] == path and held[1] < offset + nbytes and offset < held[2]]
            if clash:
                raise AlreadyMapped(f"stand-in device: the allocation at {offset:#x} of {path} overlaps a "
                                    f"mapping this process holds ({clash[0][1]:#x}..{clash[0][2]:#x})")
            self.counters["opened"] += 1
            if path not in self._peer_heaps:
                fd = os.open(path, os.O_RDWR)
                try:
                    mapping = mmap.mmap(fd, HEAP_BYTES)
                finally:
                    os.close(fd)
                self._peer_heaps[path] = (mapping, np.frombuffer(mapping, np.uint8))
            memory = self._peer_heaps[path][1]
        ids = memory[: (HEAP_BYTES // GRANULE) * 8].view(np.int64)
        granule = offset // GRANULE

        def valid():
            if ids[granule] != buffer_id:
                raise StaleMapping(f"stand-in device: read through a mapping of another process's allocation "
                                   f"{buffer_id} (at {offset:#x}), which that process has freed since")

        valid()
        array = StandInArray(self, memory[offset : offset + nbytes], valid=valid)
        with self._lock:
            self._mapped[id(array)] = (path, offset, offset + nbytes)
        return array

    def close_allocation(self, array: Array) -> None:
        """Unmap what :meth:`open_allocation` mapped (the heap stays mapped here: only
        the range is free to open again)."""
        with self._lock:
            self._mapped.pop(id(array), None)

    def already_mapped(self, error: BaseException) -> bool:
        """Whether ``error`` is :meth:`open_allocation`'s refusal of an overlapping mapping."""
        return isinstance(error, AlreadyMapped)

    def prepare(self, dtype: DTypeLike) -> None:
        """Get ``dtype``'s kernels ready (the stand-in's are NumPy: nothing to do)."""

    def storage_dtype(self, dtype: DTypeLike) -> np.dtype:
        return np.dtype(dtype)  # NumPy (with ml_dtypes) has every dtype, bfloat16 included

    def pinned(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory (here: ordinary memory, filled with garbage)."""
        self.counters["pinned"] += 1
        memory = np.empty(nbytes, np.uint8)
        memory[...] = GARBAGE
        return memory

    # -- streams and events -----------------------------------------------------------------
    def stream(self, name: str = "stream") -> Stream:
        with self._lock:
            stream = Stream(self, f"{name}#{len(self._streams)}")
            self._streams.append(stream)
            return stream

    def current_stream(self) -> Stream:
        """The stream user work goes to now (``use_stream`` sets it; else the default)."""
        return getattr(self._current, "stream", None) or self.null_stream

    def event(self, interprocess: bool = False) -> Event:
        self.counters["events"] += 1
        return SharedEvent(self) if interprocess else Event(self)

    def record(self, event: Event, stream: Stream) -> None:
        with self._lock:
            generation = event._bump()
            self._push(stream, ("record", event, generation))

    def wait(self, stream: Stream, event: Event) -> None:
        """``stream`` runs nothing more until the work ``event`` marks now has run."""
        with self._lock:
            self._push(stream, ("wait", event, event._generation()))

    def query(self, event: Event) -> bool:
        """Whether ``event``'s work has run. Runs a few queued operations first, chosen
        at random, as a GPU would have progressed meanwhile."""
        with self._lock:
            self._progress(self._rng.randint(0, 2))
            return event._reached(event._generation())

    def synchronize(self, event: Event) -> None:
        with self._lock:
            generation = event._generation()
            self._run_until(lambda: event._reached(generation), "an event")

    def synchronize_stream(self, stream: Stream) -> None:
        with self._lock:
            marker = Event(self)
            self.record(marker, stream)
            self._run_until(lambda: marker._reached(1), f"stream {stream.name}")

    def poll(self) -> None:
        """Let the device make a little progress (a GPU runs without the host; the
        stand-in only when called). The collectives' progress engine calls this."""
        with self._lock:
            self._progress(self._rng.randint(0, 2))

    # -- copies and kernels -----------------------------------------------------------------------
    def copy(self, dst: Array, src: Array, stream: Stream) -> None:
        """Copy ``src`` to ``dst`` (contiguous, the same number of bytes; each a
        StandInArray or a host NumPy array) when the stream gets there."""
        dst_memory, src_memory = self._bytes(dst, "dst"), self._bytes(src, "src")
        if dst_memory.size != src_memory.size:
            raise ValueError(f"copy of {src_memory.size} bytes into {dst_memory.size}")
        where = tuple("device" if isinstance(x, StandInArray) else "host" for x in (src, dst))
        self.copies.append(("->".join(where), dst_memory.size))
        self.launches["copy"] += 1
        self._enqueue(stream, lambda: np.copyto(dst_memory, src_memory), dst, src)

    def copy_n(self, stream: Stream, dsts: Sequence[Array], srcs: Sequence[Array]) -> None:
        """Each of ``srcs`` into ``len(dsts) // len(srcs)`` destinations (device arrays,
        each alike in bytes to its source): source q into ``dsts[q * m : q * m + m]``; one
        kernel (``copy_n`` of ``kernels/collectives.cu``), so one queued operation."""
        k, total = len(srcs), len(dsts)
        if not 1 <= k <= total <= MAX_COPIES or total % k:
            raise ValueError(f"copy_n takes 1 to {MAX_COPIES} destinations, as many for each source")
        m = total // k
        pairs = [(self._bytes(d, "dst"), self._bytes(srcs[i // m], "src")) for i, d in enumerate(dsts)]
        if any(d.size != s.size for d, s in pairs):
            raise ValueError("copy_n: a source and its destination differ in size")
        self.launches["copy_n"] += 1

        def run():  # in any order, as the kernel's blocks run
            for d, s in self._rng.sample(pairs, len(pairs)):
                np.copyto(d, s)

        self._enqueue(stream, run, *dsts, *srcs)

    def reduce2(self, stream: Stream, op: str, dtype: np.dtype, dst: Array, a: Array, b: Array) -> None:
        d, x, y = (self._typed(v, dtype) for v in (dst, a, b))
        self.launches["reduce2"] += 1
        self._enqueue(stream, lambda: ops_layer.combine(op, x, y, d), dst, a, b)

    def reduce_n(self, stream: Stream, op: str, dtype: np.dtype, dst: Array | Sequence[Array],
                 sources: Sequence[Array], divisor: float | None = None) -> None:
        """``dst`` = the left fold of ``sources``; ``dst`` may be a list of arrays, each
        given the fold (one kernel, as CUDA's); ``divisor``: the fold divided by it first."""
        kernels.check_divisor("reduce_n", op, dtype, divisor)
        dsts: list[Array] = list(dst) if isinstance(dst, (list, tuple)) else [dst]
        outputs, inputs = [self._typed(d, dtype) for d in dsts], [self._typed(s, dtype) for s in sources]
        self.launches["reduce_n"] += 1

        def run():
            acc = _fold(op, inputs, divisor)
            for d in outputs:
                np.copyto(d, acc)

        self._enqueue(stream, run, *dsts, *sources)

    def reduce_blocks(self, stream: Stream, op: str, dtype: np.dtype, dsts: Sequence[Array],
                      sources: Sequence[Array], offsets: Sequence[int], divisor: float | None = None) -> None:
        """``dsts[j]`` = the left fold of ``sources[q][offsets[j] : offsets[j] +
        dsts[j].size]`` over q, ``divisor`` as for :meth:`reduce_n`: one kernel, as CUDA's
        (``reduce_blocks`` of ``kernels/collectives.cu``), its rows in any order."""
        if not 1 <= len(sources) <= MAX_COPIES or not 1 <= len(dsts) == len(offsets) <= MAX_COPIES:
            raise ValueError(f"reduce_blocks takes 1 to {MAX_COPIES} inputs and outputs, an offset each")
        kernels.check_divisor("reduce_blocks", op, dtype, divisor)
        outputs, inputs = [self._typed(d, dtype) for d in dsts], [self._typed(s, dtype) for s in sources]
        if any(o < 0 or o + d.size > x.size for o, d in zip(offsets, outputs) for x in inputs):
            raise ValueError("reduce_blocks: a block lies outside its inputs")
        self.launches["reduce_blocks"] += 1

        def run():
            for j in self._rng.sample(range(len(outputs)), len(outputs)):
                lo, hi = offsets[j], offsets[j] + outputs[j].size
                np.copyto(outputs[j], _fold(op, [x[lo:hi] for x in inputs], divisor))

        self._enqueue(stream, run, *dsts, *sources)

    def divide(self, stream: Stream, dtype: np.dtype, x: Array, divisor: float) -> None:
        target = self._typed(x, dtype)
        self.launches["divide"] += 1
        self._enqueue(stream, lambda: np.divide(target, divisor, out=target) if target.size else None, x)

    def cast_divide(self, stream: Stream, src_dtype: np.dtype, dst_dtype: np.dtype, dst: Array, src: Array,
                    divisor: float) -> None:
        d, s = self._typed(dst, dst_dtype), self._typed(src, src_dtype)

        def run():
            value = np.divide(s, divisor) if divisor != 1 else s
            np.copyto(d, value, casting="unsafe")

        self._enqueue(stream, run, dst, src)

    def pack(self, stream: Stream, dst: Array, src: Array) -> None:
        """dst (contiguous) = the elements of the strided view ``src``, in C order."""
        d, s = dst._memory, src._memory
        self._enqueue(stream, lambda: np.copyto(d, s.reshape(-1) if s.flags.c_contiguous else s.ravel()), dst, src)

    def unpack(self, stream: Stream, dst: Array, src: Array) -> None:
        """The elements of the strided view ``dst`` = contiguous ``src``."""
        d, s = dst._memory, src._memory
        self._enqueue(stream, lambda: np.copyto(d, s.reshape(d.shape)), dst, src)

    def enqueue(self, stream, function):
        """Queue arbitrary "device work" on ``stream`` (for tests that play a user
        computing on their stream)."""
        self._enqueue(stream, function)

    # -- stream memory operations --------------------------------------------------------------
    def map_host(self, words: np.ndarray) -> HostWords:
        """``words`` (uint32 host memory: the node's shared window) as streams address it:
        here the array itself (a GPU registers it and gets a device pointer)."""
        self.counters["host_mappings"] += 1
        return words

    def unmap_host(self, mapping: HostWords) -> None:
        """Undo :meth:`map_host`."""

    def write_value(self, stream: Stream, mapping: HostWords, index: int, value: int) -> None:
        """``mapping[index] = value`` (32 bits) once ``stream`` gets there, after all the
        work queued on it before (CUDA's ``cuStreamWriteValue32``, which fences memory first).
        ``mapping``: the words themselves (:meth:`map_host`)."""
        value &= 0xFFFFFFFF
        self._enqueue(stream, lambda: mapping.__setitem__(index, value))

    def pointer_table(self, arrays: Sequence[Array]) -> Any:
        """What :meth:`fence_kernel` takes for the ranks' flags (a GPU: their device
        addresses in device memory; here the arrays)."""
        return list(arrays)

    def fence_kernel(self, stream: Stream, table: Any, flags: Array, rank: int, epoch: int, limit: float,
                     late: HostWords, late_index: int, digest: int = 0, wait: bool = True,
                     check: bool = False) -> None:
        """The fence kernel of ``kernels/collectives.cu``, once ``stream`` gets there:
        writes ``digest`` into word ``size + rank`` and ``epoch`` into word ``rank`` of
        every other rank's flags (``table[q]``, 2 words a rank), then waits until every
        other rank q has written it into word q of ``flags``, at most ``limit`` seconds
        from its start (unless ``wait`` is false: it only writes); a rank it gave up on
        gets ``late[late_index + q] = 1``, and where ``check`` is set, one whose digest
        differs from ``digest`` gets 2. It stops at once, setting nothing, once
        ``late[late_index + rank]`` is set (the host's word to stop)."""
        self.launches["fence" if wait else "fence signal"] += 1
        with self._lock:
            self._push(stream, ("fence", _FenceKernel(table, flags, rank, epoch & 0xFFFFFFFF, limit, late,
                                                      late_index, digest & 0xFFFFFFFF, wait, check), None))

    def wait_value(self, stream: Stream, mapping: HostWords, index: int, value: int) -> None:
        """``stream`` runs nothing more until ``(int32)(mapping[index] - value) >= 0``
        (``cuStreamWaitValue32`` with ``CU_STREAM_WAIT_VALUE_GEQ``); the word may be
        written by another process."""
        with self._lock:
            self._push(stream, ("value", (mapping, index), value & 0xFFFFFFFF))

    # -- MPI and IPC -----------------------------------------------------------------------------
    def mpi_buffer(self, array: Array) -> Any:
        """The memory a CUDA-aware MPI reads or writes for ``array``: the device memory
        itself, with whatever it holds at the moment MPI touches it."""
        return array._memory

    def ipc_close_event(self, event: Event) -> None:
        """Forget another process's event (its mapping goes with the object)."""

    def ipc_event_handle(self, event: "SharedEvent") -> bytes:
        return _handle(event.path)

    def ipc_open_event(self, handle: bytes) -> Event:
        return SharedEvent(self, _path(handle))

    def can_access_peer(self, uuid: str) -> bool:
        return True  # every stand-in of a node is "the same GPU"

    # -- machinery ---------------------------------------------------------------------------------
    def _bytes(self, x, name):
        if isinstance(x, StandInArray):
            memory = x._memory
        elif isinstance(x, np.ndarray):
            memory = x
        else:
            raise TypeError(f"{name}: expected a StandInArray or a NumPy array; got {type(x).__name__}")
        if not memory.flags.c_contiguous:
            raise ValueError(f"{name} must be contiguous for a copy")
        return memory.reshape(-1).view(np.uint8)

    @staticmethod
    def _typed(x, dtype):
        memory = x._memory
        return memory.view(dtype) if memory.dtype != dtype else memory

    def _push(self, stream, entry):
        """Queue ``entry`` on ``stream``, numbered: memory freed after it is reused only
        once it has run (see :meth:`_reuse`)."""
        self._queued += 1
        self._pending[self._queued] = None
        stream.queue.append(entry + (self._queued,))

    def _enqueue(self, stream, function, *operands):
        """Queue ``function`` on ``stream``. The pool blocks of the device arrays among
        its ``operands`` are not handed out again before it has run; the operands that
        map another process's memory are checked (not freed since) when it runs."""
        if any(isinstance(x, StandInArray) and x._valid is not None for x in operands):
            inner = function

            def function():
                for x in operands:
                    _check(x)
                inner()

        with self._lock:
            self._push(stream, ("run", function, None))
            for x in operands:
                if isinstance(x, StandInArray) and x._owner is not None:
                    x._owner.last_use = self._queued

    def _ready(self, entry):
        kind = entry[0]
        if kind == "wait":
            return entry[1]._reached(entry[2])
        if kind == "value":  # (int32)(word - value) >= 0, CUDA's cyclic GEQ
            words, index = entry[1]
            return _cyclic_geq(int(words[index]), entry[2])
        if kind == "fence":
            return entry[1].ready()
        return True

    def _step(self):
        """Run one queued operation from a stream chosen at random among those that can
        go on; False if none can."""
        ready = [s for s in self._streams if s.queue and self._ready(s.queue[0])]
        if not ready:
            return False
        stream = self._rng.choice(ready)
        kind, what, generation, number = stream.queue.popleft()
        del self._pending[number]
        if kind == "run":
            what()
        elif kind == "record":
            what._complete(generation)
        elif kind == "fence":
            what.finish()
        return True

    def _progress(self, steps):
        for _ in range(steps):
            if not self._step():
                return

    def _run_until(self, condition, what):
        deadline = None
        while not condition():
            if self._step():
                continue
            # Nothing here can run: only another process's work (an IPC event, a word it
            # writes, a fence kernel's peers) can help.
            waiting = [s for s in self._streams if s.queue and s.queue[0][0] in ("wait", "value", "fence")]
            if not any(s.queue[0][0] != "wait" or isinstance(s.queue[0][1], SharedEvent) for s in waiting):
                raise DeviceDeadlock(f"stand-in device: waiting for {what}, whose work can never run "
                                     f"(streams blocked: {[s.name for s in waiting]})")
            deadline = deadline or time.monotonic() + _REMOTE_PATIENCE
            if time.monotonic() > deadline:
                raise DeviceDeadlock(f"stand-in device: waited {_REMOTE_PATIENCE:.0f} s for another process's "
                                     f"work before {what}")
            self._lock.release()  # let a progress thread in meanwhile
            try:
                time.sleep(0.0005)
            finally:
                self._lock.acquire()

    def _remove_files(self):
        for path in self._owned_files:
            try:
                os.unlink(path)
            except OSError:
                pass
        self._owned_files = []

    # -- the user's stream ---------------------------------------------------------------------------
    def use_stream(self, stream):
        """``with device.use_stream(s):`` makes ``s`` the current stream (as
        ``with cupy.cuda.Stream():``)."""
        device = self

        class _Use:
            def __enter__(self):
                self.previous = getattr(device._current, "stream", None)
                device._current.stream = stream
                return stream

            def __exit__(self, *exc):
                device._current.stream = self.previous

        return _Use()


def _handle(path, extra=b""):
    raw = path.encode()
    if len(raw) + 1 + len(extra) > HANDLE_BYTES:
        raise ValueError(f"stand-in IPC path too long for a handle: {path}")
    return (raw + b"\0").ljust(HANDLE_BYTES - len(extra), b"\0") + extra


def _path(handle):
    return bytes(handle).split(b"\0", 1)[0].decode()


def _path_and_extra(handle):
    """The path and the 16 bytes after it of an allocation's handle."""
    raw = bytes(handle)
    return _path(raw), raw[HANDLE_BYTES - 16:]


def _check(x):
    if isinstance(x, StandInArray) and x._valid is not None:
        x._valid()


def _cyclic_geq(word, value):
    """``(int32)(word - value) >= 0``: the comparison of CUDA's ``CU_STREAM_WAIT_VALUE_GEQ``."""
    return ((int(word) - int(value)) & 0xFFFFFFFF) < 0x80000000


def _mpi_rank():
    try:
        from mpi4py import MPI
        return MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else 0
    except ImportError:  # pragma: no cover - mpi4py is a dependency
        return 0


if TYPE_CHECKING:  # mypy compares the stand-in with the device contract
    _conforms: DeviceBackend = StandInDevice()

_device: StandInDevice | None = None


def device() -> StandInDevice:
    """This process's stand-in device (made on first use)."""
    global _device
    if _device is None:
        _device = StandInDevice()
    return _device


# -- what tests use, in the manner of cupy.asarray / cupy.asnumpy ------------------------------------
def asarray(host, stream=None):
    """A new device array holding ``host`` (copied when the stream gets there; the host
    array may change meanwhile, as a pageable copy would allow)."""
    host = np.asarray(host)
    dev = device()
    array = dev.empty(host.shape, host.dtype)
    snapshot = np.ascontiguousarray(host).copy()
    dev.copy(array.reshape(-1) if array.size else array, snapshot.reshape(-1), stream or dev.current_stream())
    return array


def asnumpy(array, stream=None):
    """``array``'s values on the host, after the work queued on ``stream`` (default:
    the current stream) has run, as ``cupy.asnumpy``."""
    dev = device()
    dev.synchronize_stream(stream or dev.current_stream())
    return array._memory.copy()


def empty(shape, dtype):
    return device().empty(shape, dtype)


def zeros(shape, dtype, stream=None):
    return asarray(np.zeros(shape, dtype), stream)


def bfloat16():
    """NumPy's bfloat16 (ml_dtypes), for stand-in arrays of it."""
    return next(d for d in EXTRA_DTYPES if d.name == "bfloat16")


def _fold(op, inputs, divisor):
    """The left fold of ``inputs`` by ``op``, a new array, divided by ``divisor`` where
    given (the fold kernels' arithmetic, by the host's op layer)."""
    acc = inputs[0].copy()
    for x in inputs[1:]:
        ops_layer.combine(op, acc, x, acc)
    if divisor is not None and acc.size:
        np.divide(acc, divisor, out=acc)
    return acc
