"""Negotiation: before a call moves data, the ranks of its process set compare what
they are about to call (one fixed-size int64 record per rank and call, allgathered
over the call's process set, as Horovod's coordinator compares requests), and every
rank raises the same :class:`~collectives.CollectiveMismatchError` where they differ."""

import struct
import zlib

import numpy as np
import torch

from ....errors import CollectiveMismatchError
from . import runtime
from .basics import _OPS

_KINDS = ("-", "allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier", "join",
          "broadcast_object", "allgather_object", "broadcast_parameters", "optimizer step")
_DTYPES = (None, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
           torch.float32, torch.float64, torch.complex64, torch.complex128, torch.bool)
_SHOWN_DIMS = 8
KIND, DTYPE, DEVICE, NDIM, SHAPE = 0, 1, 2, 3, 4  # SHAPE .. SHAPE + 7: the first eight dimensions
SHAPE_HASH, NUMEL, ROOT, OP, PRESCALE, POSTSCALE, NAME, JOINED, EXTRA = range(12, 21)
RECORD_LENGTH = 21  # 168 bytes per rank
# Calls a rank that joined cannot take part in (Horovod's words for them)
_NOT_WITH_JOIN = {
    "allgather": "Allgather is not supported with Join at this time. Specify sparse_to_dense=True if using "
                 "DistributedOptimizer",
    "alltoall": "Alltoall is not supported with Join at this time.",
    "reducescatter": "Reducescatter is not supported with Join at this time.",
    "broadcast": "Broadcast is not supported with Join at this time.",
    "broadcast_object": "Broadcast is not supported with Join at this time.",
    "allgather_object": "Allgather is not supported with Join at this time.",
    "broadcast_parameters": "Broadcast is not supported with Join at this time.",
}


_ALONG_DIMENSION_0 = (_KINDS.index("allgather"), _KINDS.index("alltoall"))  # a 0-d tensor is an error there


def _bits(value):
    """A float as the int64 with its bits (a record holds int64s only)."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _from_bits(bits):
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def _record(kind, name=None, tensor=None, root=-1, op=None, prescale=1.0, postscale=1.0, extra=-1):
    """This rank's record of a call (-1: not part of it). Built as a list, then one
    array: it is made before every call."""
    record = [-1] * RECORD_LENGTH
    record[KIND] = _KINDS.index(kind)
    if tensor is not None:
        record[DTYPE] = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
        record[DEVICE] = 0 if tensor.device.type == "cpu" else 1
        shape = tuple(tensor.shape)
        record[NDIM] = len(shape)
        record[SHAPE:SHAPE + min(len(shape), _SHOWN_DIMS)] = shape[:_SHOWN_DIMS]
        record[SHAPE_HASH] = zlib.crc32(repr(shape).encode())
        record[NUMEL] = tensor.numel()
    record[ROOT] = root
    if op is not None:
        record[OP] = _OPS.index(op)
    record[PRESCALE], record[POSTSCALE] = _bits(prescale), _bits(postscale)
    record[NAME] = -1 if name is None else zlib.crc32(name.encode())
    record[EXTRA] = extra
    return np.array(record, np.int64)


def _shape_text(record):
    ndim = int(record[NDIM])
    shown = [int(n) for n in record[SHAPE:SHAPE + min(ndim, _SHOWN_DIMS)]]
    return str(shown) if ndim <= _SHOWN_DIMS else f"[{', '.join(map(str, shown))}, ...] ({ndim} dimensions)"


def _dtype_text(code):
    return str(_DTYPES[code]).replace("torch.", "") if 0 < code < len(_DTYPES) else "another dtype"


def _differ(hset, everyone, active, value, label, show):
    """Raise if ``value(record)`` is not the same on every rank in ``active``:
    "Mismatched <label>: rank(s) A <show(a)>, but rank(s) B <show(b)>, ..." (Horovod's
    wording, with the ranks of each value)."""
    groups = {}
    for i in active:
        groups.setdefault(value(everyone[i]), []).append(i)
    if len(groups) > 1:
        (_, first), *others = list(groups.items())
        rest = ", ".join(f"rank(s) {hset.where(members)} {show(everyone[members[0]])}" for _, members in others)
        raise CollectiveMismatchError(
            f"Mismatched {label}: rank(s) {hset.where(first)} {show(everyone[first[0]])}, but {rest}.")


def _agree(hset, everyone):
    """Raise :class:`CollectiveMismatchError` on every rank of ``hset`` unless the
    records of the ranks that have not joined (``everyone``: every rank's) describe one
    call Horovod would run. The message is built from the records alone, so every rank
    raises the same one."""
    if (everyone == everyone[0]).all() and not (everyone[0, NDIM] == 0 and everyone[0, KIND] in _ALONG_DIMENSION_0):
        return  # the common case: every rank made the very same call
    joined = [i for i in range(len(everyone)) if everyone[i, KIND] == _KINDS.index("join")]
    active = [i for i in range(len(everyone)) if i not in joined]
    kinds = {int(everyone[i, KIND]) for i in active}
    _differ(hset, everyone, active, lambda r: int(r[KIND]), "operations",
            lambda r: f"did an {_KINDS[int(r[KIND])]}")
    kind = _KINDS[kinds.pop()]
    if joined and kind in _NOT_WITH_JOIN:
        raise CollectiveMismatchError(f"{_NOT_WITH_JOIN[kind]} (rank(s) {hset.where(joined)} joined)")
    named = [i for i in active if everyone[i, NAME] != -1]
    if len({int(everyone[i, NAME]) for i in named}) > 1:
        differ = [i for i in named if everyone[i, NAME] != everyone[named[0], NAME]]
        raise CollectiveMismatchError(
            f"Mismatched names: rank(s) {hset.where(differ)} named this {kind} otherwise than rank "
            f"{hset.where(named[:1])} (collectives.horovod matches calls in the order each rank makes them, per "
            "process set; make them in the same order on every rank)")
    if everyone[active[0], DTYPE] == -1:  # no tensor: barrier, join, objects, optimizer step
        _differ(hset, everyone, active, lambda r: int(r[ROOT]), f"{kind} root ranks",
                lambda r: f"specified root rank {hset.ranks[int(r[ROOT])]}")
        _differ(hset, everyone, active, lambda r: int(r[EXTRA]), f"{kind} calls", lambda r: f"made call {r[EXTRA]}")
        return
    _differ(hset, everyone, active, lambda r: int(r[DTYPE]), "data types",
            lambda r: f"had type {_dtype_text(int(r[DTYPE]))}")
    if kind in ("allreduce", "broadcast", "reducescatter"):
        _differ(hset, everyone, active, lambda r: (int(r[NDIM]), tuple(r[SHAPE:SHAPE_HASH + 1])),
                f"{kind} tensor shapes", lambda r: f"sent a tensor of shape {_shape_text(r)}")
    if kind in ("allreduce", "reducescatter"):
        _differ(hset, everyone, active, lambda r: (int(r[PRESCALE]), int(r[POSTSCALE])),
                "prescale and/or postscale factors",
                lambda r: f"sent factors ({_from_bits(r[PRESCALE]):g}, {_from_bits(r[POSTSCALE]):g})")
        _differ(hset, everyone, active, lambda r: int(r[OP]), "reduction operation",
                lambda r: f"sent reduction op {_OPS[int(r[OP])]!r}")
    if kind in ("allgather", "alltoall"):
        zero = [i for i in active if everyone[i, NDIM] == 0]
        if zero:
            raise CollectiveMismatchError(f"rank(s) {hset.where(zero)} tried to {kind} a rank-zero tensor ({kind} "
                                          "works along dimension 0)")
        _differ(hset, everyone, active, lambda r: int(r[NDIM]), f"{kind} tensor shapes",
                lambda r: f"sent a tensor of rank {int(r[NDIM])}")
        ndim = int(everyone[active[0], NDIM])
        for dim in range(1, min(ndim, _SHOWN_DIMS)):
            _differ(hset, everyone, active, lambda r, d=dim: int(r[SHAPE + d]), f"{kind} tensor shapes",
                    lambda r, d=dim: f"sent a tensor with dimension {d} equal to {int(r[SHAPE + d])}")
        if ndim > _SHOWN_DIMS:  # beyond what the record shows: the shape without dimension 0, as a hash
            _differ(hset, everyone, active, lambda r: int(r[EXTRA]), f"{kind} tensor shapes",
                    lambda r: "sent a tensor of another shape beyond dimension 0")
    if kind == "broadcast":
        _differ(hset, everyone, active, lambda r: int(r[ROOT]), "broadcast root ranks",
                lambda r: f"specified root rank {hset.ranks[int(r[ROOT])]}")
    _differ(hset, everyone, active, lambda r: int(r[DEVICE]), f"{kind} CPU/GPU device selection",
            lambda r: f"specified device {'CPU' if r[DEVICE] == 0 else 'GPU'}")


def _negotiate(hset, record):
    """Every rank's record of the call (an allgather over ``hset``), checked; None
    where negotiation is off. Raises CollectiveMismatchError on every rank alike."""
    if not runtime.current().check:
        return None
    everyone = hset.comm.allgather(record)
    hset.rounds += 1
    _agree(hset, everyone)
    return everyone

