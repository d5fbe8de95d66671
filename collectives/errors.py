"""The library's own exceptions.

Bad arguments raise the built-in ``ValueError`` / ``TypeError`` (naming the argument)
before any message is sent. Failures of the library itself while a collective runs
derive from :class:`CollectiveError`, so ``except cc.CollectiveError`` catches them all.

After a :class:`CollectiveTimeoutError`, a :class:`MessageSizeError` or a
:class:`TransportError` raised while messages were in flight, the communicator is
*broken*: its other calls in flight were cancelled and fail, and every later call on it
raises :class:`CollectiveError` at once (the ranks no longer agree on which messages
belong to which call). A :class:`CollectiveMismatchError` from check mode leaves it
usable: it is raised on every rank before any message of the call is sent; so does
the :class:`MessageSizeError` of a native broadcast of host arrays that runs alone
(blocking, no timeout or stall warning), raised where a rank's buffer differs from the
root's once every rank has made the same MPI calls. The
shared-memory algorithms (``shm``) find a mismatch themselves, at a call's first fence
(:class:`CollectiveMismatchError`, or :class:`MessageSizeError` for a size), and break
the communicator, since the ranks' fences no longer line up.
"""


class CollectiveError(RuntimeError):
    """Base class of every error the library raises while running a collective."""


class TransportError(CollectiveError):
    """The MPI library reported an error while a collective's messages were in flight."""


class MessageSizeError(TransportError):
    """A message was longer (MPI's truncation error) or shorter than the schedule
    expects: the ranks called the collective with buffers of different sizes."""


class CollectiveMismatchError(CollectiveError):
    """Check mode: the ranks called different collectives, or the same one with a
    different dtype, shape, op, root or algorithm. Raised on every rank alike. (A
    shared-memory call raises it too, where its ranks meet in different calls.)"""


class CollectiveTimeoutError(CollectiveError):
    """A collective did not finish within its ``timeout``. The message names the call,
    its algorithm and step, the peers whose messages are outstanding, the bytes still
    pending, and which ranks did not answer a liveness check."""
