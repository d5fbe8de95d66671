"""One bounded cache type, for every cache a communicator keeps.

Each kind of call a communicator sees leaves something behind to make the next call of
that kind cheaper: the route it takes, MPI's bound collective, a persistent program,
the registered form of a shared-memory plan, a plan's steps on the shared window. A
program that calls with ever new sizes must not grow them without bound, so each is a
:class:`BoundedCache`: a dict that, when full, drops its oldest entries first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class BoundedCache(dict):
    """A dict of at most ``limit`` entries. :meth:`put` adds one, first dropping the
    oldest (the first put) while the cache is full, and handing each one dropped to
    ``evict(value)`` (e.g. to free MPI requests it holds). Lookups are the dict's own
    (``cache.get(key)``), so a hit costs what a dict lookup costs."""

    __slots__ = ("evict", "limit")

    def __init__(self, limit: int, evict: Callable[[Any], None] | None = None):
        super().__init__()
        if limit < 1:
            raise ValueError(f"limit must be at least 1; got {limit!r}")
        self.limit = limit
        self.evict = evict

    def put(self, key: Any, value: Any) -> Any:
        """Add ``value`` under ``key`` and return it."""
        if key not in self:
            while len(self) >= self.limit:
                oldest = next(iter(self))
                dropped = self.pop(oldest)
                if self.evict is not None:
                    self.evict(dropped)
        self[key] = value
        return value

    def drop_all(self) -> None:
        """Empty the cache, each entry through ``evict``."""
        values = list(self.values())
        self.clear()
        if self.evict is not None:
            for value in values:
                self.evict(value)
