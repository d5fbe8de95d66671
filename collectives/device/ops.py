"""Whole-array operations on device arrays for the training adapter and the parameter
server: allocate, copy, cast with the 1/p of compression, and move to and from the
host. Each is queued on a stream, by default the ``stream`` of its destination (a
:class:`DeviceArray` carries the user's current stream from when it was wrapped), so it
follows the user's work and precedes the collectives started after it, which wait for
that stream. They run the kernels of ``kernels/`` through the device interface;
nothing here touches elements from Python.
"""

import numpy as np

from . import DeviceArray, as_device_array


def wrap(x, name):
    """``x`` (a device array of any supported kind) as a :class:`DeviceArray`."""
    return as_device_array(x, name)


def empty(like, shape, dtype=None, stream=None):
    """A new device array on ``like``'s device, of ``dtype`` (default: ``like``'s),
    returned as a :class:`DeviceArray` (collectives on it return DeviceArrays too). Its
    ``stream`` is ``like``'s: set it to the stream the next call should follow. Give
    ``stream`` for a temporary that may be freed while work on it is queued there."""
    dtype = like.dtype if dtype is None else np.dtype(dtype)
    data = like.backend.empty(shape, like.backend.storage_dtype(dtype), stream)
    return DeviceArray(like.backend, data, dtype, like.stream, _same_kind(like.backend, dtype), like.where)


def part(array, start, stop, shape):
    """Elements ``start:stop`` of a flat DeviceArray, shaped ``shape`` (a view)."""
    data = array.data[start:stop].reshape(shape)
    return DeviceArray(array.backend, data, array.dtype, array.stream, array.rewrap, array.where)


def copy(dst, src, stream=None):
    """``dst[...] = src`` (same shape and dtype), on ``stream`` (default ``dst``'s)."""
    backend, stream = dst.backend, stream or dst.stream
    if dst.data.flags.c_contiguous and src.data.flags.c_contiguous:
        backend.copy(dst.data.reshape(-1), src.data.reshape(-1), stream)
    elif dst.data.flags.c_contiguous:
        backend.pack(stream, dst.data.reshape(-1), src.data)
    elif src.data.flags.c_contiguous:
        backend.unpack(stream, dst.data, src.data.reshape(-1))
    else:  # both strided: through a contiguous buffer (of this stream: freed while queued)
        flat = backend.empty(src.size, src.data.dtype, stream)
        backend.pack(stream, flat, src.data)
        backend.unpack(stream, dst.data, flat)


def follow(later, earlier, backend):
    """Make stream ``later`` wait for the work queued on ``earlier`` so far (nothing if
    they are the same stream)."""
    if getattr(later, "ptr", later) is not getattr(earlier, "ptr", earlier) and \
            getattr(later, "ptr", later) != getattr(earlier, "ptr", earlier):
        event = backend.event()
        backend.record(event, earlier)
        backend.wait(later, event)


def cast(dst, src, divisor=1, stream=None):
    """``dst = (src / divisor)`` in ``dst``'s dtype (fp32/fp64 <-> fp16/bf16), one kernel
    on ``stream`` (default ``dst``'s); both contiguous."""
    backend = dst.backend
    backend.cast_divide(stream or dst.stream, src.dtype, dst.dtype, dst.data.reshape(-1), src.data.reshape(-1),
                        divisor)


def to_host(src, host):
    """Copy a contiguous DeviceArray into the host array ``host`` (on ``src``'s stream)
    and wait for it."""
    backend, stream = src.backend, src.stream
    pinned = backend.pinned(src.nbytes)
    backend.copy(pinned, src.data.reshape(-1), stream)
    backend.synchronize_stream(stream)
    host.reshape(-1).view(np.uint8)[...] = pinned


def from_host(dst, host):
    """Copy the host array ``host`` into a contiguous DeviceArray (on ``dst``'s stream;
    the host array may change once this returns)."""
    backend, stream = dst.backend, dst.stream
    pinned = backend.pinned(dst.nbytes)
    pinned[...] = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
    backend.copy(dst.data.reshape(-1), pinned, stream)
    event = backend.event()
    backend.record(event, stream)
    backend.synchronize(event)  # the pinned buffer is read by the copy: keep it until then


def _same_kind(backend, dtype):
    def rewrap(data):
        return DeviceArray(backend, data, dtype, backend.current_stream(), rewrap, f"{backend.kind}:{backend.id}")
    return rewrap
