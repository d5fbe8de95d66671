"""The device contract: what the device executors (:mod:`collectives.transport.device`,
:mod:`collectives.transport.device_node`) may ask of a device, and all they may ask.

A *backend* is one object per device. Two implement :class:`DeviceBackend`:
:class:`~collectives.device.cupy_backend.CupyDevice` (a real GPU) and
:class:`~collectives.device.standin.StandInDevice` (the CPU stand-in the tests run
on); each module assigns an instance to a :class:`DeviceBackend` under
``TYPE_CHECKING``, so that mypy compares its signatures with these.

The backend's own objects are opaque to the executors and named here only for
reading: :data:`Array` (device memory: ``cupy.ndarray``, ``StandInArray``; a copy may
also take a host NumPy array, pinned or not), :data:`Stream`, :data:`Event` and
:data:`HostWords` (host words registered for the device by :meth:`~DeviceBackend.map_host`).
Every operation that takes a stream only queues work on it: it runs in the stream's
order, later, unless the method says it waits.
"""

from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

Array = Any  # the backend's device array (or, where a copy allows it, a host NumPy array)
Stream = Any  # the backend's stream
Event = Any  # the backend's event (or another process's, opened by ipc_open_event)
HostWords = Any  # uint32 host memory as the device addresses it (map_host)
Shape = int | tuple[int, ...]
DTypeLike = Any  # what np.dtype() takes


class DeviceBackend(Protocol):
    """One device, as the executors drive it."""

    kind: str  # "cuda", "standin": the device's kind in messages and in ``where``
    id: int  # the device's number among its kind's on this host
    name: str  # the device's model, for messages
    uuid: str  # the same string on every process that sees this device
    ipc_capable: bool  # whether its memory and events can be shared through IPC at all
    counters: Counter  # what it was asked to make (events, allocations, pinned, opened, host_mappings)
    launches: Counter  # copies and kernels queued, by kind

    # -- memory ----------------------------------------------------------------------------
    def empty(self, shape: Shape, dtype: DTypeLike, stream: Stream = None) -> Array:
        """Device memory from the pool (contents undefined); ``stream``: the stream a
        temporary is used on (the pool reuses it in that stream's order)."""
        ...

    def dedicated(self, shape: Shape, dtype: DTypeLike) -> Array:
        """Device memory in an allocation of its own (no other array lies in it)."""
        ...

    def pinned(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory: a NumPy uint8 array of ``nbytes``."""
        ...

    def storage_dtype(self, dtype: DTypeLike) -> np.dtype:
        """The dtype the device stores ``dtype`` in (CuPy keeps bfloat16 in uint16)."""
        ...

    def prepare(self, dtype: DTypeLike) -> None:
        """Compile ``dtype``'s kernels now, ahead of their first launch."""
        ...

    # -- streams and events -------------------------------------------------------------------
    def stream(self, name: str = "stream") -> Stream:
        """A new stream of the device's own (``name``: for messages)."""
        ...

    def current_stream(self) -> Stream:
        """The stream the user's work goes to now."""
        ...

    def event(self, interprocess: bool = False) -> Event:
        """A new event (``interprocess``: one other processes can open)."""
        ...

    def record(self, event: Event, stream: Stream) -> None:
        """``event`` marks the work queued on ``stream`` so far."""
        ...

    def wait(self, stream: Stream, event: Event) -> None:
        """``stream`` runs nothing more until ``event``'s work has run (the device waits,
        not the host)."""
        ...

    def query(self, event: Event) -> bool:
        """Whether ``event``'s work has run (never waits)."""
        ...

    def synchronize(self, event: Event) -> None:
        """The host waits until ``event``'s work has run."""
        ...

    def synchronize_stream(self, stream: Stream) -> None:
        """The host waits until the work queued on ``stream`` has run."""
        ...

    def poll(self) -> None:
        """Let the device progress (a GPU needs nothing; the stand-in runs work here)."""
        ...

    # -- copies and kernels --------------------------------------------------------------------
    def copy(self, dst: Array, src: Array, stream: Stream) -> None:
        """``dst`` = ``src``: contiguous, as many bytes, device or pinned host either side."""
        ...

    def copy_n(self, stream: Stream, dsts: Sequence[Array], srcs: Sequence[Array]) -> None:
        """Each source into ``len(dsts) // len(srcs)`` destinations (source q into
        ``dsts[q * m : q * m + m]``), one kernel, at most 16 destinations."""
        ...

    def reduce2(self, stream: Stream, op: str, dtype: np.dtype, dst: Array, a: Array, b: Array) -> None:
        """``dst = a op b``, elementwise, one kernel."""
        ...

    def reduce_n(self, stream: Stream, op: str, dtype: np.dtype, dst: Array | Sequence[Array],
                 sources: Sequence[Array], divisor: float | None = None) -> None:
        """``dst`` (or each of a list of up to 16) = the left fold of ``sources`` (1 to
        16), divided by ``divisor`` where given, one kernel."""
        ...

    def reduce_blocks(self, stream: Stream, op: str, dtype: np.dtype, dsts: Sequence[Array],
                      sources: Sequence[Array], offsets: Sequence[int], divisor: float | None = None) -> None:
        """``dsts[j]`` = the left fold over ``sources`` of their elements from
        ``offsets[j]``, ``dsts[j].size`` of them; one kernel."""
        ...

    def divide(self, stream: Stream, dtype: np.dtype, x: Array, divisor: float) -> None:
        """``x /= divisor`` in place, one kernel."""
        ...

    def cast_divide(self, stream: Stream, src_dtype: np.dtype, dst_dtype: np.dtype, dst: Array, src: Array,
                    divisor: float) -> None:
        """``dst = src / divisor`` cast to ``dst_dtype``, one kernel."""
        ...

    def pack(self, stream: Stream, dst: Array, src: Array) -> None:
        """Contiguous ``dst`` = the elements of the strided view ``src``, in C order."""
        ...

    def unpack(self, stream: Stream, dst: Array, src: Array) -> None:
        """The elements of the strided view ``dst`` = contiguous ``src``."""
        ...

    # -- MPI and IPC of events --------------------------------------------------------------------
    def mpi_buffer(self, array: Array) -> Any:
        """What a CUDA-aware MPI is given for ``array``."""
        ...

    def ipc_event_handle(self, event: Event) -> bytes:
        """An interprocess event's handle, for another process's :meth:`ipc_open_event`."""
        ...

    def ipc_open_event(self, handle: bytes) -> Event:
        """Another process's event, opened here."""
        ...

    def ipc_close_event(self, event: Event) -> None:
        """Forget an event :meth:`ipc_open_event` opened."""
        ...

    def can_access_peer(self, uuid: str) -> bool:
        """Whether this device can read the memory of the device ``uuid`` (same node)."""
        ...

    # -- any allocation shared where it lies (the peer reads) -------------------------------------
    def allocation(self, array: Array) -> tuple[int, int, int] | None:
        """``(base, size, buffer id)`` of the allocation ``array`` lies in (raises, or
        None, where it is not one this device can export)."""
        ...

    def export(self, base: int) -> bytes:
        """The IPC handle of this process's allocation at ``base``."""
        ...

    def open_allocation(self, handle: bytes, nbytes: int) -> Array:
        """Another process's allocation (an :meth:`export` handle): ``nbytes`` of it, uint8."""
        ...

    def close_allocation(self, array: Array) -> None:
        """Unmap what :meth:`open_allocation` mapped."""
        ...

    def already_mapped(self, error: BaseException) -> bool:
        """Whether ``error`` is an opening refused because a mapping this process holds
        overlaps it (CUDA's cudaErrorAlreadyMapped)."""
        ...

    # -- synchronisation without the host ------------------------------------------------------------
    def map_host(self, words: np.ndarray) -> HostWords:
        """``words`` (uint32 host memory) as the device's streams and kernels address it."""
        ...

    def unmap_host(self, mapping: HostWords) -> None:
        """Undo :meth:`map_host`."""
        ...

    def write_value(self, stream: Stream, mapping: HostWords, index: int, value: int) -> None:
        """Word ``index`` of ``mapping`` = ``value`` (32 bits) once the work queued on
        ``stream`` before it has run."""
        ...

    def wait_value(self, stream: Stream, mapping: HostWords, index: int, value: int) -> None:
        """``stream`` runs nothing more until ``(int32)(word - value) >= 0``."""
        ...

    def pointer_table(self, arrays: Sequence[Array]) -> Any:
        """What :meth:`fence_kernel` takes for the ranks' flags."""
        ...

    def fence_kernel(self, stream: Stream, table: Any, flags: Array, rank: int, epoch: int, limit: float,
                     late: HostWords, late_index: int, digest: int = 0, wait: bool = True,
                     check: bool = False) -> None:
        """The in-kernel fence of distinct GPUs (``kernels/collectives.cu``): writes
        ``digest`` and ``epoch`` into every other rank's flags (``table``), then, where
        ``wait``, waits at most ``limit`` seconds until every other rank has written
        ``epoch`` into ``flags``; a rank it gave up on gets ``late[late_index + q] = 1``,
        one whose digest differs (where ``check``) 2. It stops at once once
        ``late[late_index + rank]`` is set."""
        ...
