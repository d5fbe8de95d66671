"""Check mode: the ranks agree on what they are calling before any message is sent.

With ``Communicator(check=True)`` (or ``COLLECTIVES_CHECK=1``) every call first
allgathers a fixed-size fingerprint of 19 int64s (152 bytes per rank, one MPI
allgather, no pickling): the call's sequence number, collective, algorithm, op, dtype,
root, shape, where the arrays live (host or device), the reduction order
(deterministic mode or not) and how the call runs (for ``native``, MPI's blocking or
non-blocking collective, which MPI never matches with each other; for the library's own
algorithms, alone on the blocking calls' tag or among the calls in flight, which never
meet either). Every rank gets every fingerprint, so every rank finds the same differences and
raises the same :class:`~collectives.CollectiveMismatchError`, naming the ranks, e.g.

    rank 3 called allreduce(float32, shape (1000,), op 'sum', algorithm 'ring')
    but rank 0 called allreduce(float32, shape (1024,), op 'sum', algorithm 'ring')

Without check mode such a call hangs, fails with a :class:`MessageSizeError`, or (for
equal sizes with different shapes or dtypes) silently mixes data.
"""

import zlib

import numpy as np

from .algorithms import BUILDERS, COLLECTIVES, VARIABLE
from .dtypes import EXTRA_DTYPES, SUPPORTED_DTYPES
from .errors import CollectiveMismatchError
from .ops import OPS
from .transport.liveness import ranks

CALLS = COLLECTIVES + ("barrier", "broadcast_object") + VARIABLE + ("empty",)
ALGORITHMS = ("-", "native") + tuple(sorted({a for table in BUILDERS.values() for a in table}))
OP_NAMES = ("-",) + tuple(OPS)
DTYPES = ("-",) + tuple(d.name for d in SUPPORTED_DTYPES + EXTRA_DTYPES)
SHOWN_DIMS = 8  # dimensions stored as they are; a hash of the whole shape catches the rest
LENGTH = 10 + SHOWN_DIMS + 1

_FIELDS = ("call number", "collective", "algorithm", "op", "dtype", "root", "how it runs", "memory", "order")
# How a call runs, where the ranks must agree on it: a native call is MPI's blocking or
# non-blocking collective (which MPI never matches with each other); a call of the
# library's own message-based algorithms on host arrays either runs alone (blocking,
# no timeout or stall warning: on the tag kept for such calls) or among the others
# (on its call number's tag).
_HOW_IT_RUNS = ("-", "MPI blocking", "MPI non-blocking", "alone (blocking)", "among calls in flight")
MEMORY = ("-", "host", "cuda", "standin")  # where the arrays live
ORDERS = ("-", "any", "rank order (deterministic)")  # how a reduction folds the ranks' contributions


def fingerprint(sequence, collective, algorithm="-", op="-", dtype=None, shape=(), root=-1, how="-", memory="-",
                order="-"):
    """The int64 record the ranks compare (``-`` / -1: not part of this collective).
    ``how`` is one of ``_HOW_IT_RUNS``, ``memory`` one of ``MEMORY``, ``order``
    one of ``ORDERS``."""
    shape = tuple(int(n) for n in shape)
    record = np.full(LENGTH, -1, np.int64)
    record[:10] = (sequence, CALLS.index(collective), ALGORITHMS.index(algorithm), OP_NAMES.index(op),
                   DTYPES.index(np.dtype(dtype).name if dtype is not None else "-"), root,
                   _HOW_IT_RUNS.index(how), len(shape), MEMORY.index(memory), ORDERS.index(order))
    shown = shape[:SHOWN_DIMS]
    record[10 : 10 + len(shown)] = shown
    record[-1] = zlib.crc32(repr(shape).encode())
    return record


def _decode(record):
    """The fields of a record as readable values (shape as far as it was stored)."""
    call, coll, alg, op, dtype, root, how, ndim, memory, order = (int(v) for v in record[:10])
    shape = tuple(int(n) for n in record[10 : 10 + min(ndim, SHOWN_DIMS)])
    shape_text = repr(shape) if ndim <= SHOWN_DIMS else f"({ndim} dims: {', '.join(map(str, shape))}, ...)"
    return {
        "call number": f"#{call}",
        "collective": CALLS[coll],
        "algorithm": ALGORITHMS[alg],
        "op": OP_NAMES[op],
        "dtype": DTYPES[dtype],
        "root": root,
        "how it runs": _HOW_IT_RUNS[how],
        "memory": MEMORY[memory],
        "order": ORDERS[order],
        "shape": shape_text if ndim <= SHOWN_DIMS else f"{shape_text} (hash {int(record[-1])})",
    }


def _call_text(fields):
    """'allreduce(float32, shape (1024,), op 'sum', algorithm 'ring')'."""
    parts = []
    if fields["dtype"] != "-":
        parts += [fields["dtype"], f"shape {fields['shape']}"]
    if fields["memory"] not in ("-", "host"):
        parts.append(f"on {fields['memory']}")
    if fields["op"] != "-":
        parts.append(f"op {fields['op']!r}")
    if fields["root"] >= 0:
        parts.append(f"root {fields['root']}")
    if fields["algorithm"] != "-":
        parts.append(f"algorithm {fields['algorithm']!r}")
    if fields["order"] == ORDERS[2]:
        parts.append("deterministic")
    return f"{fields['collective']}({', '.join(parts)})"


def compare(records):
    """Raise :class:`CollectiveMismatchError` unless every row of ``records`` (one per
    rank, as allgathered) is the same. The message is built from the rows alone, so
    every rank raises the same one."""
    rows = [tuple(r) for r in records]
    if all(row == rows[0] for row in rows):
        return
    groups = {}  # fingerprint -> ranks that sent it, in rank order
    for rank, row in enumerate(rows):
        groups.setdefault(row, []).append(rank)
    decoded = {row: _decode(np.array(row)) for row in groups}  # each distinct fingerprint once
    reference = decoded[rows[0]]
    same_number = all(row[0] == rows[0][0] for row in rows)
    lines = []
    for row, members in groups.items():
        if row == rows[0]:
            continue
        mine = decoded[row]
        if same_number:
            lines.append(f"{ranks(members)} called {_call_text(mine)} but rank 0 called {_call_text(reference)}")
        else:
            lines.append(f"{ranks(members)} called {_call_text(mine)} as call {mine['call number']} but rank 0 "
                         f"called {_call_text(reference)} as call {reference['call number']}")
    for field in _FIELDS + ("shape",):
        values = {}
        for row, fields in decoded.items():
            value = "-" if field == "root" and fields[field] < 0 else fields[field]
            values.setdefault(value, []).extend(groups[row])
        if len(values) > 1:
            lines.append(f"  {field}: " + "; ".join(f"{value} on {ranks(members)}"
                                                     for value, members in values.items()))
    if len({fields["how it runs"] for fields in decoded.values()}) > 1:
        lines.append("  (a blocking call uses MPI's blocking collective ('native'), or runs alone on a tag of its "
                     "own (the library's algorithms), unless a timeout or stall_warn is set; neither meets a "
                     "non-blocking call: call it the same way, with the same timeout and stall_warn, on every rank)")
    raise CollectiveMismatchError("the ranks' calls differ (check mode):\n" + "\n".join(lines))
