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

- memory: ``empty(shape, dtype, stream=None)`` (device), ``pinned(nbytes)``
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
  ``ipc_alloc(nbytes)``, ``ipc_open(handle, nbytes)``, ``ipc_event_handle(event)``,
  ``ipc_open_event(handle)``, ``ipc_free(array)``, ``ipc_close(array)``,
  ``ipc_close_event(event)``,
  ``can_access_peer(uuid)``, and the attributes
  ``kind``, ``id``, ``name``, ``uuid``, ``ipc_capable``.

Two backends implement it: :mod:`.cupy_backend` (a real GPU) and :mod:`.standin`.
"""

import numpy as np

from ..arrays import EXTRA_DTYPES, check_dtype

_BFLOAT16 = next((d for d in EXTRA_DTYPES if d.name == "bfloat16"), None)


class bfloat16:
    """Marks a device ``uint16`` array (CuPy has no bfloat16 dtype) as holding bfloat16
    values: ``comm.allreduce(cc.bfloat16(x))``. Results come back marked the same way
    (``result.data`` is the uint16 array). torch bfloat16 tensors need no marking."""

    def __init__(self, data):
        self.data = data
        dtype = np.dtype(getattr(data, "dtype", None))
        if dtype.itemsize != 2 or dtype.kind not in "iu":
            raise TypeError(f"bfloat16() marks a 16-bit integer device array holding bfloat16 bits; got dtype {dtype}")

    shape = property(lambda self: self.data.shape)

    def __repr__(self):
        return f"bfloat16({self.data!r})"


class DeviceArray:
    """A user's device array as the collectives see it.

    ``data`` is the backend's own array (``cupy.ndarray`` or ``StandInArray``) with the
    storage dtype; ``dtype`` is the logical dtype (bfloat16 where the storage is
    uint16); ``stream`` the user's current stream at the call; ``rewrap(data)`` turns a
    result back into what the user passed (a torch tensor for a torch tensor ...);
    ``original`` is the object the user passed; ``allocate(shape)`` makes the data of a
    new result on the user's stream (``rewrap`` makes it what the user gets)."""

    __slots__ = ("backend", "data", "dtype", "stream", "rewrap", "where", "original", "allocate")
    __collectives_device__ = True

    def __init__(self, backend, data, dtype, stream, rewrap, where, original=None, allocate=None):
        self.backend, self.data, self.dtype, self.stream, self.rewrap = backend, data, np.dtype(dtype), stream, rewrap
        self.where = where  # "cuda:0", "standin:0": for messages
        self.original = self if original is None else original
        self.allocate = allocate or (lambda shape: backend.empty(shape, data.dtype))

    shape = property(lambda self: tuple(self.data.shape))
    size = property(lambda self: int(self.data.size))
    ndim = property(lambda self: self.data.ndim)
    nbytes = property(lambda self: int(self.data.size) * self.dtype.itemsize)
    itemsize = property(lambda self: self.dtype.itemsize)

    @property
    def contiguous(self):
        return bool(self.data.flags.c_contiguous)

    def __repr__(self):
        return f"<device array {self.where} shape={self.shape} dtype={self.dtype.name}>"


def is_device(x):
    """Whether ``x`` (as given by a user) lives in device memory, without importing
    anything: a cheap test on its type."""
    if isinstance(x, (np.ndarray, bfloat16)):
        return isinstance(x, bfloat16)
    t = type(x)
    if getattr(t, "__collectives_device__", False):
        return True
    module = t.__module__.split(".", 1)[0]
    if module == "cupy":
        return True
    if module == "torch":
        device = getattr(x, "device", None)
        return getattr(device, "type", "cpu") == "cuda"
    return hasattr(x, "__cuda_array_interface__")


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
