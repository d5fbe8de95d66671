"""Device (GPU) arrays in the collectives: which arrays live on a device, and the narrow
interface the device executor (:mod:`collectives.transport.device`) drives.

Users pass ``cupy.ndarray``, torch CUDA tensors (shared zero-copy through DLPack),
anything with ``__cuda_array_interface__``, or arrays of the stand-in device used by
the tests (:mod:`collectives.device.standin`). CuPy has no bfloat16 dtype: a torch
bfloat16 CUDA tensor works as it is, and a CuPy ``uint16`` array holding bfloat16
bits is passed as :func:`bfloat16` ``(x)``. Importing this module imports neither
CuPy nor torch; they are imported when such an array is first seen.

The device interface (a *backend*: one object per device) is what the executor may
use, and all it may use:

- memory: ``empty(shape, dtype, stream=None)`` (device, from the pool),
  ``dedicated(shape, dtype)`` (device, an allocation of its own), ``pinned(nbytes)``
  (page-locked host, a NumPy uint8 array), ``storage_dtype(dtype)`` (what it stores a
  dtype in: CuPy keeps bfloat16 in uint16);
- streams and events: ``stream()``, ``current_stream()``, ``event(interprocess)``,
  ``record(event, stream)``, ``wait(stream, event)`` (the GPU waits, not the host),
  ``query(event)``, ``synchronize(event)``, ``synchronize_stream(stream)``, ``poll()``;
- asynchronous copies on a stream: ``copy(dst, src, stream)``, device or pinned host
  on either side, contiguous;
- kernel launches on a stream, one method per kernel of ``kernels/collectives.cu``:
  ``reduce2``, ``reduce_n``, ``divide``, ``cast_divide``, ``pack``, ``unpack``; and
  ``prepare(dtype)``, which compiles a dtype's kernels ahead of their first launch;
- MPI and IPC: ``mpi_buffer(array)`` (what a CUDA-aware MPI is given),
  ``ipc_event_handle(event)``, ``ipc_open_event(handle)``, ``ipc_close_event(event)``,
  ``can_access_peer(uuid)``, and the attributes
  ``kind``, ``id``, ``name``, ``uuid``, ``ipc_capable``;
- any array shared where it lies (the peer-read algorithms): ``allocation(array)``
  (base, size and buffer id of the allocation it lies in), ``export(base)`` (its IPC
  handle), ``open_allocation(handle, nbytes)``, ``close_allocation(array)``,
  ``already_mapped(error)`` (whether an opening failed as CUDA's
  cudaErrorAlreadyMapped: a mapping the process holds overlaps it);
- synchronisation without the host: ``map_host(words)`` / ``unmap_host(mapping)``
  (uint32 host memory the device writes and waits on), ``write_value(stream, mapping,
  index, value)`` and ``wait_value(...)`` (stream memory operations),
  ``pointer_table(arrays)`` and ``fence_kernel(stream, table, flags, rank, epoch,
  limit, late, late_index)`` (the in-kernel fence of distinct GPUs).

Two backends implement it: :mod:`.cupy_backend` (a real GPU) and :mod:`.standin`.
"""

from ..dtypes import BFLOAT16 as _BFLOAT16
from ..dtypes import check_dtype
from .array import DeviceArray, bfloat16, is_device

__all__ = ["DeviceArray", "as_device_array", "bfloat16", "is_device"]


def as_device_array(x, name="x"):
    """``x`` as a :class:`DeviceArray` (no copy). Raises TypeError naming ``name`` for
    an unsupported dtype."""
    if isinstance(x, DeviceArray):
        return x
    marked = isinstance(x, bfloat16)
    raw = x.data if marked else x
    if getattr(type(raw), "__collectives_device__", False):  # the stand-in's arrays
        backend = raw.device
        array = DeviceArray(backend, raw, raw.dtype, backend.current_stream(), _identity, "standin:0")
    else:
        from . import cupy_backend
        array = cupy_backend.device_array(raw, name)
    array.original = x
    if marked:
        if _BFLOAT16 is None:
            raise TypeError(f"{name} is marked bfloat16, which needs ml_dtypes (pip install ml_dtypes)")
        array.dtype = _BFLOAT16
        rewrap = array.rewrap
        array.rewrap = lambda data: bfloat16(rewrap(data))
    check_dtype(array.dtype, name)
    return array


def _identity(data):
    return data
