"""The options of a communicator and of a call, checked once, here.

A :class:`~collectives.Communicator`'s options come from its keyword arguments, else
from the environment (``COLLECTIVES_*``), else from the defaults below;
:class:`Options` reads and checks them all when the communicator is made, so a bad
value is a ``ValueError``/``TypeError`` naming the argument or the variable before
any message is sent. The per-call arguments that are options too (``timeout``,
``segment_size``) and the arguments every collective shares (``root``, counts,
shapes) are checked by the functions below, which the call path and the adapters use.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from .algorithms.shm import DEFAULT_SLOT_BYTES  # one rank's slot of the shared window; COLLECTIVES_SHM_SLOT overrides

DEFAULT_SEGMENT_SIZE = 256 * 1024  # bytes; COLLECTIVES_SEGMENT_SIZE overrides
DEFAULT_DEVICE_SEGMENT_SIZE = 4 << 20  # bytes; COLLECTIVES_DEVICE_SEGMENT_SIZE overrides
# How the peer-read algorithms' fences meet on the device (collectives.transport.device_node):
# the host watches epochs in the node's shared window, the streams write and wait for
# values there themselves, or a small kernel writes and spins on flags in the GPUs'
# memory (distinct GPUs only); auto: kernel where every rank has a GPU of its own, else
# host. COLLECTIVES_DEVICE_FENCE overrides the default.
DEVICE_FENCES = ("auto", "host", "stream", "kernel")
DEFAULT_DEVICE_FENCE = "auto"
MIN_SLOT_BYTES = 64


class Options:
    """A communicator's options, checked: see :class:`~collectives.Communicator` for
    what each does. ``environ`` (default ``os.environ``) supplies what the keywords
    leave as None."""

    __slots__ = ("check", "cuda_aware", "cuda_ipc", "deterministic", "device_fence", "device_segment_size",
                 "ipc_memory", "segment_size", "shm_slot", "stall_warn", "timeout")

    def __init__(self, *, segment_size: int | None = None, check: bool | None = None, timeout: float | None = None,
                 stall_warn: float | None = None, device_segment_size: int | None = None,
                 cuda_ipc: bool | None = None, cuda_aware: bool | None = None, ipc_memory: int | None = None,
                 deterministic: bool | None = None, device_fence: str | None = None,
                 environ: Mapping[str, str] | None = None):
        env = os.environ if environ is None else environ
        if segment_size is None:
            segment_size = env_bytes("COLLECTIVES_SEGMENT_SIZE", DEFAULT_SEGMENT_SIZE, env)
        self.segment_size = check_nbytes(segment_size, "segment_size")
        self.check = env_flag("COLLECTIVES_CHECK", env) if check is None else check_bool(check, "check")
        self.deterministic = (env_flag("COLLECTIVES_DETERMINISTIC", env) if deterministic is None
                              else check_bool(deterministic, "deterministic"))
        self.timeout = env_seconds("COLLECTIVES_TIMEOUT", env) if timeout is None else check_timeout(timeout)
        self.stall_warn = (env_seconds("COLLECTIVES_STALL_WARN", env) if stall_warn is None
                           else check_timeout(stall_warn, "stall_warn"))
        if device_segment_size is None:
            device_segment_size = env_bytes("COLLECTIVES_DEVICE_SEGMENT_SIZE", DEFAULT_DEVICE_SEGMENT_SIZE, env,
                                            zero=True)
        if device_segment_size != 0:  # 0: whole messages
            check_nbytes(device_segment_size, "device_segment_size")
        self.device_segment_size = int(device_segment_size)
        for name, value in (("cuda_ipc", cuda_ipc), ("cuda_aware", cuda_aware)):
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be True, False or None (the environment's); got {value!r}")
        if ipc_memory is not None and (isinstance(ipc_memory, bool) or not isinstance(ipc_memory, (int, np.integer))
                                       or ipc_memory < 0):
            raise ValueError(f"ipc_memory must be a non-negative number of bytes; got {ipc_memory!r}")
        self.cuda_ipc, self.cuda_aware, self.ipc_memory = cuda_ipc, cuda_aware, ipc_memory
        if device_fence is None:
            device_fence = env.get("COLLECTIVES_DEVICE_FENCE", "").strip() or DEFAULT_DEVICE_FENCE
            if device_fence not in DEVICE_FENCES:
                raise ValueError(f"COLLECTIVES_DEVICE_FENCE must be one of {', '.join(DEVICE_FENCES)}; "
                                 f"got {device_fence!r}")
        elif device_fence not in DEVICE_FENCES:
            raise ValueError(f"device_fence must be one of {', '.join(DEVICE_FENCES)}; got {device_fence!r}")
        self.device_fence = device_fence
        self.shm_slot = slot_bytes(env)

    @property
    def device_options(self) -> dict[str, Any]:
        """The options the device executor's negotiation takes."""
        return dict(cuda_ipc=self.cuda_ipc, cuda_aware=self.cuda_aware, ipc_memory=self.ipc_memory)

    def keywords(self) -> dict[str, Any]:
        """Keyword arguments that make a communicator with these options (``dup``): a
        missing timeout or stall warning given as infinity, so the environment's is not
        read again."""
        return dict(segment_size=self.segment_size, check=self.check, timeout=self.timeout or math.inf,
                    stall_warn=self.stall_warn or math.inf, device_segment_size=self.device_segment_size,
                    deterministic=self.deterministic, device_fence=self.device_fence, **self.device_options)

    def timeout_for(self, timeout: float | None) -> float | None:
        """A call's timeout in seconds (None: none): its own, else the communicator's."""
        return self.timeout if timeout is None else check_timeout(timeout)

    def alone(self, blocking: bool, timeout: float | None) -> bool:
        """Whether a call runs alone: blocking, and neither able to stop (a timeout) nor
        to warn while it waits (a stall warning). Such a call first finishes the calls
        in flight, and a ``native`` one is MPI's blocking collective."""
        return blocking and timeout is None and self.stall_warn is None

    def segment(self, segment_size: int | None, itemsize: int) -> int:
        """Elements per pipelining segment: the call's ``segment_size`` bytes, else the
        communicator's."""
        return max(1, (self.segment_size if segment_size is None else segment_size) // itemsize)


# -- checks ------------------------------------------------------------------------------
def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {value!r}")
    return value


def check_nbytes(value: Any, name: str) -> int:
    """``value`` as an int if it is a positive number of bytes, else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive number of bytes; got {value!r}")
    return int(value)


def check_segment_size(segment_size: Any) -> int:
    return check_nbytes(segment_size, "segment_size")


def check_timeout(timeout: Any, name: str = "timeout") -> float | None:
    """``timeout`` as seconds (None: no limit); a ValueError naming ``name`` unless it
    is None, a positive number, or infinity (no limit)."""
    if timeout is None:
        return None
    if (type(timeout) is float or type(timeout) is int) and 0 < timeout < math.inf:  # the common case, first
        return float(timeout)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"{name} must be a positive number of seconds (or None, or math.inf for none); "
                         f"got {timeout!r}")
    return None if math.isinf(timeout) else float(timeout)


def check_root(root: Any, size: int) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise ValueError(f"root must be a rank in 0..{size - 1}; got {root!r}")
    return int(root)


def check_shape(shape: Any) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints (an int is a 1-d shape), else a ValueError
    naming it."""
    dims = (shape,) if isinstance(shape, (int, np.integer)) else shape
    try:
        dims = tuple(dims)
    except TypeError:
        dims = None
    if dims is None or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ValueError(f"shape must be a non-negative int or a tuple of them; got {shape!r}")
    return tuple(int(d) for d in dims)


def check_counts(counts: Any, name: str, size: int) -> tuple[int, ...]:
    """``counts`` as a tuple of ``size`` non-negative ints, else an error naming ``name``."""
    if isinstance(counts, (str, bytes)) or not hasattr(counts, "__len__"):
        raise TypeError(f"{name} must be a sequence of {size} row counts, one per rank; got {counts!r}")
    if len(counts) != size:
        raise ValueError(f"{name} must have one count per rank ({size}); got {len(counts)}")
    for n in counts:
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"{name} must hold non-negative integers; got {list(counts)!r}")
    return tuple(int(n) for n in counts)


def check_rank(peer: Any, name: str, size: int, rank: int, blocking: bool, any_rank: bool = False) -> int | None:
    """A peer of a send or receive: a rank of the communicator (None too where
    ``any_rank``); a blocking message to this rank itself is refused (it could only
    wait for ever)."""
    if peer is None and any_rank:
        return None
    if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)) or not 0 <= peer < size:
        allowed = " or None (any rank)" if any_rank else ""
        raise ValueError(f"{name} must be a rank in 0..{size - 1}{allowed}; got {peer!r}")
    if blocking and peer == rank:
        raise ValueError(f"{name} is this rank ({peer}): a blocking message to itself could only wait forever; "
                         "use send_async and recv_async")
    return int(peer)


def check_tag(tag: Any, limit: int) -> int:
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= tag < limit:
        raise ValueError(f"tag must be an integer in 0..{limit - 1}; got {tag!r}")
    return int(tag)


# -- the environment ---------------------------------------------------------------------
def env_seconds(name: str, environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds from environment variable ``name`` (None when unset, empty or 0)."""
    text = (os.environ if environ is None else environ).get(name, "").strip()
    if text in ("", "0"):
        return None
    try:
        return check_timeout(float(text), name)
    except ValueError:
        raise ValueError(f"{name} must be a positive number of seconds; got {text!r}") from None


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    text = (os.environ if environ is None else environ).get(name, "").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name} must be 1 or 0; got {text!r}")


def env_bytes(name: str, default: int, environ: Mapping[str, str] | None = None, zero: bool = False) -> int:
    """A number of bytes from environment variable ``name`` (``default`` when unset or
    empty); 0 is allowed only with ``zero``."""
    text = (os.environ if environ is None else environ).get(name, "").strip()
    if not text:
        return default
    if not text.isdigit() or (int(text) == 0 and not zero):
        raise ValueError(f"{name} must be a {'' if zero else 'positive '}number of bytes; got {text!r}")
    return int(text)


def slot_bytes(environ: Mapping[str, str] | None = None) -> int:
    """One rank's slot of the shared window, in bytes: ``COLLECTIVES_SHM_SLOT``, else
    ``DEFAULT_SLOT_BYTES``; a call longer than a slot runs in segments."""
    text = (os.environ if environ is None else environ).get("COLLECTIVES_SHM_SLOT", "").strip()
    if not text:
        return DEFAULT_SLOT_BYTES
    if not text.isdigit() or int(text) < MIN_SLOT_BYTES:
        raise ValueError(f"COLLECTIVES_SHM_SLOT must be a number of bytes, at least {MIN_SLOT_BYTES}; got {text!r}")
    return int(text)


def check_slot(value: Any) -> int:
    """A ``shm_slot`` set on a communicator: a number of bytes, at least 64."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < MIN_SLOT_BYTES:
        raise ValueError(f"shm_slot must be a number of bytes, at least {MIN_SLOT_BYTES}; got {value!r}")
    return int(value)
