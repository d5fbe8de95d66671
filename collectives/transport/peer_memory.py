"""The other processes' device allocations this process has opened (CUDA IPC), and its
own exported (:class:`PeerMemory`, one per device and process); :class:`Sliced`, an
opened buffer and its slices."""

from collections import Counter


class PeerMemory:
    """The other processes' device allocations this process has opened (CUDA IPC),
    one per owner process, base address and buffer id; and this process's own
    allocations exported so far. One per device backend and process, shared by its
    communicators (CUDA opens a handle once per process)."""

    def __init__(self, backend):
        self.backend = backend
        self.opened = {}  # (owner pid, base) -> (buffer id, the whole allocation, uint8)
        self.exported = {}  # base -> (buffer id, handle)
        self.counters = Counter()  # opened, closed, exported

    def handle_of(self, base, buffer_id):
        """This process's allocation at ``base`` as an IPC handle (exported once)."""
        known = self.exported.get(base)
        if known is None or known[0] != buffer_id:
            known = self.exported[base] = (buffer_id, bytes(self.backend.export(base)))
            self.counters["exported"] += 1
        return known[1]

    def view(self, pid, base, buffer_id, handle, size, offset, nbytes):
        """Bytes ``[offset, offset + nbytes)`` of process ``pid``'s allocation at ``base``
        (``size`` bytes, ``buffer_id``), opened here through ``handle`` unless it is open
        already; a mapping of an older allocation at that base is closed first."""
        key = (pid, base)
        known = self.opened.get(key)
        if known is None or known[0] != buffer_id:
            if known is not None:  # freed and allocated again there: never read the old mapping
                self.close(pid, base)
            known = self.opened[key] = (buffer_id, self._open(pid, base, size, handle))
            self.counters["opened"] += 1
        return known[1][offset : offset + nbytes]

    def close(self, pid, base):
        """Close the mapping of process ``pid``'s allocation at ``base``, if one is open."""
        known = self.opened.pop((pid, base), None)
        if known is not None:
            self.backend.close_allocation(known[1])
            self.counters["closed"] += 1

    def _open(self, pid, base, size, handle):
        """Map ``pid``'s allocation ``[base, base + size)``. CUDA maps another process's
        memory once per process: it refuses (cudaErrorAlreadyMapped) while a mapping
        of ours overlaps the range, and one that does can only be of memory that
        process has freed since (its live allocations never overlap), which we never
        read again. So those are closed, and the opening tried once more."""
        try:
            return self.backend.open_allocation(handle, size)
        except Exception as exc:
            if not self.backend.already_mapped(exc):
                raise
        for key, (_, array) in list(self.opened.items()):
            if key[0] == pid and key[1] < base + size and base < key[1] + array.nbytes:
                self.close(*key)
        return self.backend.open_allocation(handle, size)


_MEMORY: dict = {}  # backend -> its PeerMemory


def peer_memory(backend):
    """The :class:`PeerMemory` of ``backend``'s device in this process."""
    memory = _MEMORY.get(backend)
    if memory is None:
        memory = _MEMORY[backend] = PeerMemory(backend)
    return memory


class Sliced:
    """A device array and the slices of it asked for so far (slicing a CuPy array costs
    microseconds; a peer's buffer is sliced alike call after call)."""

    __slots__ = ("array", "parts")

    def __init__(self, array):
        self.array, self.parts = array, {}

    def part(self, lo, hi):
        if lo == 0 and hi == self.array.size:
            return self.array
        found = self.parts.get((lo, hi))
        if found is None:
            if len(self.parts) >= 64:
                self.parts.clear()
            found = self.parts[(lo, hi)] = self.array[lo:hi]
        return found
