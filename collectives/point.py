"""Sends and receives (``Communicator.send``/``recv`` and their ``_async`` twins): their
arguments checked, their buffers staged, their handles on the progress engine
(:mod:`collectives.transport.p2p`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import as_array
from .device import DeviceArray, is_device
from .errors import CollectiveError
from .options import check_rank, check_tag
from .transport import p2p


def _nothing() -> None:
    return None


def _open(ctx: Any, what: str) -> None:
    if ctx.progress.broken is not None:
        raise CollectiveError(f"{what}: this communicator is broken by an earlier failure "
                              f"({ctx.progress.broken}); make a new Communicator")


def send(ctx: Any, x: Any, dst: Any, tag: Any, timeout: Any, blocking: bool) -> Any:
    """Start a send of ``x`` to ``dst``; its handle."""
    x = as_array(x, "x")
    dst = check_rank(dst, "dst", ctx.size, ctx.rank, blocking)
    tag = check_tag(tag, ctx.p2p_tag_limit)
    timeout = ctx.options.timeout_for(timeout)
    describe = f"send to rank {dst} (tag {tag})"
    _open(ctx, describe)
    payload = p2p.device_to_host(x) if isinstance(x, DeviceArray) else p2p.as_bytes(x)
    handle = p2p.PointHandle(ctx.progress, describe, _nothing, ctx.p2p_comm, payload, dst, tag, False, timeout,
                             ctx.sequence)
    return handle.start()


def recv(ctx: Any, out: Any, src: Any, tag: Any, timeout: Any, blocking: bool) -> Any:
    """Start a receive into ``out`` from ``src`` (None: any rank); its handle."""
    if out is None:
        raise ValueError("out must be the array that receives the message; got None")
    if not isinstance(out, np.ndarray) and not is_device(out):
        raise TypeError(f"out must be a numpy.ndarray or a device array; got {type(out).__name__}")
    target = as_array(out, "out")
    if not isinstance(target, DeviceArray) and not target.flags.writeable:
        raise ValueError("out must be writable: the message is received into it")
    src = check_rank(src, "src", ctx.size, ctx.rank, blocking, any_rank=True)
    tag = check_tag(tag, ctx.p2p_tag_limit)
    timeout = ctx.options.timeout_for(timeout)
    describe = f"recv from {'any rank' if src is None else f'rank {src}'} (tag {tag})"
    _open(ctx, describe)
    if isinstance(target, DeviceArray):
        landing = np.empty(0, np.uint8) if not target.nbytes else target.backend.pinned(target.nbytes)

        def finish() -> Any:
            p2p.host_to_device(landing, target)
            return out
    elif target.flags.c_contiguous:
        landing, finish = p2p.as_bytes(target), lambda: out
    else:
        staged = np.empty(target.shape, target.dtype)
        landing = p2p.as_bytes(staged)

        def finish() -> Any:
            target[...] = staged
            return out
    handle = p2p.PointHandle(ctx.progress, describe, finish, ctx.p2p_comm, landing, src, tag, True, timeout,
                             ctx.sequence)
    return handle.start()
