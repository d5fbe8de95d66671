"""The library's own exceptions.

Bad arguments raise the built-in ``ValueError`` / ``TypeError`` (naming the argument)
before any message is sent. Failures of the library itself while a collective runs
derive from :class:`CollectiveError`, so ``except cc.CollectiveError`` catches them all.
"""


class CollectiveError(RuntimeError):
    """Base class of every error the library raises while running a collective."""


class TransportError(CollectiveError):
    """The MPI library reported an error while a collective's messages were in flight."""
