"""Device (GPU) arrays in the collectives: which arrays live on a device, and the narrow
interface the device executor (:mod:`collectives.transport.device`) drives.

Users pass ``cupy.ndarray``, torch CUDA tensors (shared zero-copy through DLPack),
anything with ``__cuda_array_interface__``, or arrays of the stand-in device used by
the tests (:mod:`collectives.device.standin`). CuPy has no bfloat16 dtype: a torch
bfloat16 CUDA tensor works as it is, and a CuPy ``uint16`` array holding bfloat16
bits is passed as :func:`bfloat16` ``(x)``. Importing this module imports neither
CuPy nor torch; they are imported when such an array is first seen.

The device interface (a *backend*: one object per device) is what the executor may
use, and all it may use: memory (device, pooled or dedicated; pinned host), streams and
events, asynchronous copies, the kernels of ``kernels/collectives.cu``, MPI and IPC
buffers and events, any allocation shared where it lies (the peer reads), and
synchronisation without the host (stream memory operations, the fence kernel). Its
signatures are :class:`~.contract.DeviceBackend` (:mod:`.contract`), which mypy checks
both backends against: :mod:`.cupy_backend` (a real GPU) and :mod:`.standin`.
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
