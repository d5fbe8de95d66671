"""The calls: each collective of one tensor is queued when made, started at the next
wait (negotiated, then handed to the library) and finished once, its result kept for
the handle that waits for it."""

from . import runtime
from .negotiation import _negotiate


class _Call:
    """One collective of one tensor: made by an hvd call (queued), started at the next
    wait (negotiated, then handed to the library), finished once (its result kept).
    ``starter(everyone)`` starts it: every rank's records (None without negotiation)
    -> (the library's handles, a function giving the result once they are done)."""

    __slots__ = ("what", "set", "key", "record", "starter", "parts", "finish", "result", "error", "state")

    def __init__(self, what, hset, name, record, starter):
        self.what, self.set, self.record, self.starter = what, hset, record, starter
        self.key = None if name is None else (hset.process_set.process_set_id, name)
        self.parts, self.finish, self.result, self.error = [], None, None, None
        self.state = "queued"

    def start(self):
        try:
            everyone = _negotiate(self.set, self.record)
            self.parts, self.finish = self.starter(everyone)
        except Exception as exc:  # noqa: BLE001 - kept: raised by synchronize, as Horovod raises there
            self.fail(exc)
            return
        self.state = "started"
        runtime.current().running.append(self)

    def done(self):
        """Whether it has finished (advancing it; finishing it if its messages are in)."""
        if self.state == "started":
            try:
                ready = all(part.test() for part in self.parts)
            except Exception as exc:  # noqa: BLE001 - kept for synchronize
                self.fail(exc)
                return True
            if ready:
                self.complete()
        return self.state in ("done", "failed")

    def complete(self):
        """Wait for it (started already) and keep its result or error."""
        if self.state != "started":
            return
        try:
            for part in self.parts:
                part.wait()
            self.result = self.finish()
        except Exception as exc:  # noqa: BLE001 - kept for synchronize
            self.fail(exc)
            return
        self._settle("done")

    def fail(self, error):
        self.error = error
        self._settle("failed")

    def _settle(self, state):
        self.state = state
        self.parts, self.starter = [], None
        process = runtime.current()
        if self in process.running:
            process.running.remove(self)
        if self.key is not None and process.names.get(self.key) is self:
            del process.names[self.key]


def _enqueue(what, hset, name, record, starter):
    """Queue a call (after its arguments were checked); its name is in flight from now
    until it finishes."""
    state = runtime.current()
    call = _Call(what, hset, name, record, starter)
    if call.key is not None:
        if call.key in state.names:
            raise ValueError(f"{what}: a call named {name!r} is already in flight in this process set (Horovod "
                             "refuses a second call with the name of a call that has not finished: use another "
                             "name, or synchronize the first)")
        state.names[call.key] = call
    state.queue.append(call)
    return call
