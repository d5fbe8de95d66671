"""Registered buffers: host arrays in memory the node's ranks share
(``Communicator.empty``/``zeros``), which the ``shm`` algorithms read in place
(:mod:`collectives.routes.shared`); and device arrays the node's ranks have opened
each other's of (``device=``), which the peer-read algorithms read in place
(:mod:`collectives.routes.peer`)."""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np
from mpi4py import MPI

from .dtypes import check_dtype
from .gate import gate
from .options import check_shape
from .transport.shm import Registration


def empty(ctx: Any, shape: Any, dtype: Any, device: Any = None) -> Any:
    """A new registered array (collective; see Communicator.empty)."""
    shape = check_shape(shape)
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must name a NumPy dtype; got {dtype!r}") from None
    check_dtype(dtype, "dtype")
    backend = None if device is None else device_backend(device)
    nbytes = math.prod(shape) * dtype.itemsize
    gate(ctx, "empty", ctx.options.timeout, dtype=dtype, shape=shape)  # numbered; compared in check mode
    # Every rank must ask for the same: compare a digest (max and min of it) first.
    digest = zlib.crc32(f"{shape}/{dtype.str}".encode())
    agree = np.array([digest, -digest], np.int64)
    ctx.request("empty()", lambda: ctx.comm.Iallreduce(MPI.IN_PLACE, agree, MPI.MAX), ctx.options.timeout,
                agree.nbytes)
    if agree[0] != -agree[1]:
        raise ValueError(f"shape and dtype must be the same on every rank: this rank asked for {shape} "
                         f"{dtype.name}, another rank for something else")
    if backend is not None:
        return _device_empty(ctx, backend, shape, dtype, nbytes)
    registration = Registration(ctx.node_comm, nbytes, len(ctx.registrations))
    ctx.registrations.append(registration)
    return registration.mine.view(dtype).reshape(shape)


def device_backend(device: Any) -> Any:
    """The device backend ``device`` names: ``"cuda"`` or ``"cuda:N"`` (CuPy), or
    ``"standin"`` (the tests' CPU stand-in); a ValueError naming it otherwise."""
    if device == "standin":
        from .device import standin

        return standin.device()
    if isinstance(device, str) and (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        from .device import cupy_backend

        if device == "cuda":
            import cupy

            return cupy_backend.backend(cupy.cuda.Device().id)
        return cupy_backend.backend(int(device[5:]))
    raise ValueError(f"device must be None (host memory), 'cuda', 'cuda:N' or 'standin'; got {device!r}")


def _device_empty(ctx: Any, backend: Any, shape: tuple[int, ...], dtype: Any, nbytes: int) -> Any:
    """A new device array, registered at once: where the node's ranks can open each
    other's device memory, every rank opens every other's now, so that the first
    peer-read call on it opens nothing (collective, after the agreement above)."""
    from .device import bfloat16
    from .routes.device import device_context
    from .routes.peer import register

    storage = backend.storage_dtype(dtype)
    # An allocation of its own, not the pool's: the peers open exactly this array (a pool's
    # chunk would open to them whatever else lies in it), and its id changes only with it.
    array = backend.dedicated(shape, storage)
    register(ctx, device_context(ctx, backend, ctx.options.timeout), array, nbytes, ctx.options.timeout)
    return bfloat16(array) if storage != dtype else array


def fill_zeros(array: Any, device: Any) -> None:
    """Zero a device array of :func:`empty` on the current stream."""
    from .device import bfloat16

    data = array.data if isinstance(array, bfloat16) else array
    backend = device_backend(device)
    flat = data.reshape(-1).view(np.uint8)
    backend.copy(flat, np.zeros(flat.size, np.uint8), backend.current_stream())
