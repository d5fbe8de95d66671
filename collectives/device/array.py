"""What a device array is to the library: :class:`DeviceArray` (the user's array as
the collectives see it), the :class:`bfloat16` marker, and :func:`is_device`."""

import numpy as np


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


def is_own_array_type(kind):
    """Whether arrays of type ``kind`` are a device backend's own (``cupy.ndarray``, the
    stand-in's), which the library uses as they are. A torch tensor, a marked bfloat16
    array, a :class:`DeviceArray` or another ``__cuda_array_interface__`` object is not
    (:func:`is_device` says which of those live in device memory)."""
    return kind is not DeviceArray and (bool(getattr(kind, "__collectives_device__", False))
                                        or (kind.__module__.split(".", 1)[0] == "cupy" and kind.__name__ == "ndarray"))


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
