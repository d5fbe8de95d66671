"""The array layer: turns what users pass into flat contiguous buffers, and back.

Everything above this module sees 1-D contiguous NumPy arrays. Inputs are viewed
without copying when they are already contiguous; non-contiguous ones are packed into
a contiguous copy (and results are unpacked back), never rejected. Device arrays
(CuPy, torch CUDA tensors, ``__cuda_array_interface__``) come out of :func:`as_array`
as :class:`collectives.device.DeviceArray`, which the device executor flattens the
same way with kernels.
"""

import numpy as np

from . import device
from .dtypes import check_dtype


def as_array(x, name="x"):
    """View ``x`` as a NumPy array (no copy for ndarrays, buffers, array interfaces), or
    as a :class:`~collectives.device.DeviceArray` if it lives on a device."""
    if isinstance(x, np.ndarray):
        arr = x
    else:
        if device.is_device(x):
            return device.as_device_array(x, name)
        try:
            arr = np.asarray(x)
        except Exception as exc:  # noqa: BLE001 - reported as a TypeError on the argument
            raise TypeError(f"{name} must be an array or buffer; got {type(x).__name__}") from exc
        if arr.dtype == object:
            raise TypeError(f"{name} must be an array or buffer of numbers; got {type(x).__name__}")
    check_dtype(arr.dtype, name)
    return arr


def check_out(out, shape, dtype, name="out", like=None):
    """Check a user-supplied output array; return it as an ndarray, or as a
    :class:`~collectives.device.DeviceArray` on the device of ``like`` (the input)."""
    on_device = device.is_device(out)
    if like is not None and on_device != isinstance(like, device.DeviceArray):
        where = like.where if isinstance(like, device.DeviceArray) else "the host"
        kind = "a device array" if on_device else "a host array"
        raise TypeError(f"{name} is {kind} but x is on {where}: x and {name} must both be host arrays or both "
                        "device arrays (on the same device)")
    if on_device:
        array = device.as_device_array(out, name)
        if array.backend is not like.backend:
            raise TypeError(f"{name} is on {array.where} but x is on {like.where}: pass both on the same device")
        if array.shape != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)}; got {array.shape}")
        if array.dtype != dtype:
            raise TypeError(f"{name} must have dtype {np.dtype(dtype).name}; got {array.dtype.name}")
        return array
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray; got {type(out).__name__}")
    if out.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}; got {out.shape}")
    if out.dtype != dtype:
        raise TypeError(f"{name} must have dtype {np.dtype(dtype).name}; got {out.dtype.name}")
    if not out.flags.writeable:
        raise ValueError(f"{name} must be writable")
    return out


def flat_view(arr):
    """A 1-D view of ``arr`` if it is C-contiguous, else None."""
    if arr.ndim == 1 and arr.strides[0] == arr.itemsize:
        return arr
    if arr.flags.c_contiguous:
        return arr.reshape(-1)
    return None


def flat_input(arr):
    """A 1-D contiguous array with the elements of ``arr`` (a view when possible)."""
    view = flat_view(arr)
    return view if view is not None else np.ascontiguousarray(arr).reshape(-1)


def same_memory(a, b):
    """True if ``a`` and ``b`` are the very same elements (same start, shape, strides)."""
    if a is b:
        return True
    return (
        a.shape == b.shape
        and a.strides == b.strides
        and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    )


def overlaps(a, b):
    """True if ``a`` and ``b`` may share memory (a cheap bounds check: when unsure, a
    caller makes a copy it might not have needed)."""
    return np.may_share_memory(a, b)
