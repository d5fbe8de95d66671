"""The MPI communicators of communicators that broke, kept instead of freed.

A failed call leaves messages that no receive will take. MPI gives a freed
communicator's context to the next communicator made, so a new one's calls, numbered
from the same start and tagged alike, would take those messages as their own and
return their data (seen with MPICH on the device executor's calls, after a size
mismatch). So a broken communicator's MPI communicators are kept, referenced here, for
the life of the process: a few per failure.
"""

from typing import Any

from mpi4py import MPI

_KEPT: list[Any] = []


def retire(*comms: Any) -> None:
    """Keep ``comms`` (None and ``MPI.COMM_NULL`` are skipped) instead of freeing them."""
    _KEPT.extend(c for c in comms if c is not None and c != MPI.COMM_NULL)


def kept() -> int:
    """How many communicators have been retired in this process."""
    return len(_KEPT)
