"""Registered buffers: host arrays in memory the node's ranks share
(``Communicator.empty``/``zeros``), which the ``shm`` algorithms read in place
(:mod:`collectives.routes.shared`)."""

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


def empty(ctx: Any, shape: Any, dtype: Any) -> np.ndarray:
    """A new registered array (collective; see Communicator.empty)."""
    shape = check_shape(shape)
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must name a NumPy dtype; got {dtype!r}") from None
    check_dtype(dtype, "dtype")
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
    registration = Registration(ctx.node_comm, nbytes, len(ctx.registrations))
    ctx.registrations.append(registration)
    return registration.mine.view(dtype).reshape(shape)
