"""Where every call passes once, after its arguments are checked and before any
message: it gets its number, a broken communicator refuses it, and in check mode the
ranks compare what they are calling (:mod:`collectives.check`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import check as check_mode
from .algorithms import SHARED_MEMORY
from .device import DeviceArray
from .errors import CollectiveError
from .routes.base import finish_in_flight


def gate(ctx: Any, collective: str, timeout: float | None, algorithm: str = "-", op: str = "-", dtype: Any = None,
         shape: tuple[int, ...] = (), root: int = -1, blocking: bool = True, memory: Any = None) -> None:
    """Number the call (its sequence number is its messages' tag); raise if the
    communicator is broken; in check mode, compare fingerprints (one allgather, within
    ``timeout``) and raise on every rank if they differ. Outside check mode it is
    :func:`number` (which the call path calls then, without the arguments)."""
    sequence = number(ctx, collective)
    if ctx.options.check:
        alone = ctx.options.alone(blocking, timeout)
        if algorithm == "native":
            how = "MPI blocking" if alone else "MPI non-blocking"
        elif algorithm == "-" or (collective, algorithm) in SHARED_MEMORY or isinstance(memory, DeviceArray):
            how = "-"  # no tag of its own to agree on (fences, or the device executor's call tags)
        else:
            how = "alone (blocking)" if alone else "among calls in flight"
        kind = "-" if memory is None else memory.backend.kind if isinstance(memory, DeviceArray) else "host"
        order = "-" if op == "-" else "rank order (deterministic)" if ctx.options.deterministic else "any"
        record = check_mode.fingerprint(sequence, collective, algorithm, op, dtype, shape, root, how, kind, order)
        gathered = np.empty((ctx.size, record.size), record.dtype)
        ctx.request(f"the check-mode exchange before {collective}", lambda: ctx.comm.Iallgather(record, gathered),
                    timeout, gathered.nbytes)
        check_mode.compare(gathered)


def number(ctx: Any, collective: str) -> int:
    """:func:`gate` outside check mode: raise if the communicator is broken, else
    number the call and return its number."""
    progress = ctx.progress
    if progress.broken is not None:
        raise CollectiveError(f"{collective}: this communicator is broken by an earlier failure "
                              f"({progress.broken}); make a new Communicator, though after a timeout "
                              "the job usually has to stop")
    sequence = ctx.next_call()
    if len(progress.active) >= ctx.tags.calls - 2:  # its base tag would be a call's in flight
        finish_in_flight(ctx)
    return sequence
