"""The routes a call can take, in the one ordered list the call path tries.

    device peer reads   one_shot/two_shot/leader on device arrays of one node: the ranks read each other's (IPC)
    device              arrays on a device: the device executor (every route below is for host arrays)
    native blocking     native, running alone: MPI's blocking collective
    native non-blocking native otherwise: MPI's non-blocking collective, on the progress engine
    shared memory       the shm algorithms: the node's shared window
    persistent          small calls that run alone: a persistent program
    plan engine         everything else: the library's plans, on the lean executor or the progress engine

The first route whose ``takes`` says yes runs the call (:func:`route_for`); the lean
path keeps, per kind of blocking call, the route chosen for it and what that route
made (:class:`~.base.LeanEntry`); :meth:`collectives.Communicator.choose` names the
route from the same list.
"""

from __future__ import annotations

from typing import Any

from .base import LeanEntry, Route
from .device import DEVICE
from .native import NATIVE, NATIVE_BLOCKING
from .peer import PEER
from .plans import PERSISTENT, PLANS
from .shared import SHARED

ROUTES: tuple[Route, ...] = (PEER, DEVICE, NATIVE_BLOCKING, NATIVE, SHARED, PERSISTENT, PLANS)


def route_for(ctx: Any, call: Any) -> Route:
    """The first route in ``ROUTES`` that takes ``call``."""
    for route in ROUTES:
        if route.takes(ctx, call):
            return route
    raise AssertionError(f"no route takes {call.spec.name}(algorithm={call.algorithm!r})")  # PLANS takes every call


__all__ = ["DEVICE", "NATIVE", "NATIVE_BLOCKING", "PEER", "PERSISTENT", "PLANS", "ROUTES", "SHARED", "LeanEntry",
           "Route", "route_for"]
