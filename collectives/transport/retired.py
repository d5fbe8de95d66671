"""What a failed call leaves behind, kept for the life of the process instead of freed:
the MPI communicators of communicators that broke, and the requests given up on.

A failed call leaves messages that no receive will take. MPI gives a freed
communicator's context to the next communicator made, so a new one's calls, numbered
from the same start and tagged alike, would take those messages as their own and
return their data (seen with MPICH on the device executor's calls, after a size
mismatch). So a broken communicator's MPI communicators are kept, referenced here, for
the life of the process: a few per failure.

A receive given up on after a failure is cancelled, but a cancel does not take once the
receive has matched its message: MPI then goes on writing the message into the
receive's buffer, at whatever later moment this process next enters MPI (with Intel MPI
on shared memory, inside another communicator's first collective). The request holds
that buffer (mpi4py keeps it referenced), so it is kept here, not with the
communicator, which may be dropped or freed first. Each time another is kept, those
MPI has finished with are let go.
"""

from typing import Any

from mpi4py import MPI

_KEPT: list[Any] = []
_ABANDONED: list[Any] = []


def retire(*comms: Any) -> None:
    """Keep ``comms`` (None and ``MPI.COMM_NULL`` are skipped) instead of freeing them."""
    _KEPT.extend(c for c in comms if c is not None and c != MPI.COMM_NULL)


def kept() -> int:
    """How many communicators have been retired in this process."""
    return len(_KEPT)


def abandon(*requests: Any) -> None:
    """Keep ``requests`` (given up on after a failure: MPI may still write into their
    buffers) until MPI has finished with them."""
    still = []
    for held in _ABANDONED:
        try:
            if held.Test():  # finished (or cancelled): MPI writes no more into its buffer
                if isinstance(held, MPI.Prequest):
                    held.Free()  # a persistent one stays allocated until freed
                continue
        except MPI.Exception:
            continue  # finished in error: the same
        still.append(held)
    _ABANDONED[:] = still + list(requests)


def abandoned() -> tuple[Any, ...]:
    """The requests given up on that MPI may still be using."""
    return tuple(_ABANDONED)
