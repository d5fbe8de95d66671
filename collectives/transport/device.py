"""The device executor: the same compiled plans as the MPI transport, on device buffers.

A plan's local operations become kernels; each message goes one of three ways, chosen
per peer once per communicator (:func:`negotiate`), every rank agreeing:

    staged      Send: copy the segment device -> pinned host (stream d2h), then Isend.
                Recv: Irecv into pinned host, then host -> device (stream h2d); the
                kernel that reduces it runs on the device (stream compute).
    cuda-aware  the device memory goes to MPI itself, once the work that produces
                (or last reads) it has finished (COLLECTIVES_CUDA_AWARE, or detected).
    ipc         ranks of one node: the sender copies the segment into a slot of its own
                IPC memory (stream p2p) and records an interprocess event; a 176-byte
                control message tells the receiver the slot, its handles and the size;
                the receiver's stream waits for that event, and the reduction that
                alone reads the segment reads it straight from the sender's memory (or,
                where more than a reduction reads it, it is copied out first); then an
                acknowledgement frees the slot. Slots are pooled up to
                COLLECTIVES_IPC_MEMORY bytes (256 MiB); a segment that finds none free
                goes staged, on a communicator of its own, instead of waiting.

Plans for the device are cut into segments (``split_schedule``: any algorithm, each
message and reduction in pieces of ``device_segment_size`` bytes), and every
operation waits only for the operations it depends on, each on the stream it runs
on, through events: so the copy of segment k+1, the message of segment k and the
reduction of segment k-1 run at once. Nothing ever copies a whole buffer to the
host to reduce it there.

The user's stream: a call starts by making its streams wait for the work the user
queued so far on their current stream (an event), and ends by making that stream wait
for its own work; so a blocking call's result, or a handle's once it completes, is
ready on the user's stream, as NCCL's are.

The host learns that device work has finished by querying events from the progress
engine (:class:`~collectives.transport.mpi.Progress`), never by blocking on them, so
timeouts, stall warnings, liveness probes and the broken-communicator rules hold as
on the host.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from ..device.gpus import GPU_NAME_BYTES, gpu_stamp
from ..errors import MessageSizeError, TransportError
from ..schedule import Copy, Reduce, ReduceMany, Send
from .mpi import PlanHandle
from .native import mismatch
from .peer_memory import peer_memory
from .progress import Handle, at
from .retired import retire

_CONTROL_WORDS = 22  # int64s of an IPC control message: slot, bytes, its allocation's size, -, handles, base, id
_HANDLE_BYTES = 64  # a CUDA IPC memory or event handle
_CONTROL_BYTES = 8 * _CONTROL_WORDS
_NAME_BYTES = GPU_NAME_BYTES  # a device's uuid, and its model's name, as negotiate exchanges them
_PROBE_WORDS = 4 + 2 * _HANDLE_BYTES // 8  # negotiate's row per rank: pid, base, buffer id, bytes, handles
_ROW_WORDS = _PROBE_WORDS + 2 * _NAME_BYTES // 8  # ... then the device's uuid and model
_KEPT_MEMORY: list = []  # broken communicators' IPC slots and their mappings of the peers' (DeviceContext.free)
_STAGED = 1  # control word 3: the segment comes staged on the bulk communicator, not in a slot


def cuda_aware_mpi():
    """Whether MPI takes device pointers: ``COLLECTIVES_CUDA_AWARE=0/1`` if set, else
    ``MPIX_Query_cuda_support()`` of the MPI library this process has loaded."""
    text = os.environ.get("COLLECTIVES_CUDA_AWARE", "").strip().lower()
    if text in ("0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    if text not in ("", "auto"):
        raise ValueError(f"COLLECTIVES_CUDA_AWARE must be 0, 1 or auto; got {text!r}")
    return _query_cuda_support()


def _query_cuda_support():
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libmpi" in line and "/" in line})
    except OSError:
        return False
    for path in paths:
        try:
            query = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        query.restype = ctypes.c_int
        return bool(query())
    return False


DEFAULT_IPC_MEMORY = 256 << 20  # bytes of IPC slots per communicator and device


def ipc_memory_limit():
    """Bytes of device memory a communicator may hold in IPC send slots
    (``COLLECTIVES_IPC_MEMORY``, default 256 MiB); a segment that finds none free
    beyond that goes staged through host memory instead of waiting."""
    text = os.environ.get("COLLECTIVES_IPC_MEMORY", "").strip()
    if not text:
        return DEFAULT_IPC_MEMORY
    if not text.isdigit():
        raise ValueError(f"COLLECTIVES_IPC_MEMORY must be a number of bytes; got {text!r}")
    return int(text)


def _ipc_wanted():
    text = os.environ.get("COLLECTIVES_CUDA_IPC", "").strip().lower()
    if text in ("0", "false", "no", "off"):
        return False
    if text not in ("", "1", "true", "yes", "on", "auto"):
        raise ValueError(f"COLLECTIVES_CUDA_IPC must be 0, 1 or auto; got {text!r}")
    return True


class _Pool:
    """Buffers reused between messages and calls (pinned host memory, or device
    workspace), in power-of-two size classes. A buffer comes back either at once or
    once an event says the device has stopped using it."""

    def __init__(self, backend, allocate, keep=64):
        self._backend = backend
        self._allocate = allocate  # nbytes -> a uint8 buffer
        self._free = {}  # size class -> [buffer]
        self._pending = []  # (buffer, event): free once the event completes
        self._keep = keep

    def take(self, nbytes):
        size = 1 << max(int(nbytes) - 1, 0).bit_length() if nbytes > 0 else 1
        if self._pending:
            still = []
            for buffer, event in self._pending:
                if self._backend.query(event):
                    self._give(buffer)
                else:
                    still.append((buffer, event))
            self._pending = still
        free = self._free.get(size)
        buffer = free.pop() if free else self._allocate(size)
        return buffer

    def give(self, buffer, after=None):
        if after is None:
            self._give(buffer)
        else:
            self._pending.append((buffer, after))

    def _give(self, buffer):
        free = self._free.setdefault(len(buffer), [])
        if len(free) < self._keep:
            free.append(buffer)


class _Slot:
    """One IPC send buffer of this rank, an allocation of its own that the peers open as
    any shared array (``peer_memory.PeerMemory``: one mapping per process, whatever
    communicator asks), and the interprocess event that marks its data."""

    def __init__(self, backend, index, capacity):
        self.index, self.capacity = index, capacity
        self.array = backend.dedicated(capacity, np.uint8)
        # size: the whole allocation (a GPU's is whole 2 MiB pages), which the peers open
        self.base, self.size, self.buffer_id = backend.allocation(self.array)
        self.handle = peer_memory(backend).handle_of(self.base, self.buffer_id)
        self.event = backend.event(interprocess=True)
        self.event_handle = backend.ipc_event_handle(self.event)


class DeviceContext:
    """What one communicator keeps per device: its four streams, pools, and the path to
    every peer. Made by :func:`negotiate` (collectively) at the first device call."""

    def __init__(self, backend, paths, ack_comm, bulk_comm=None, cuda_aware=False, ipc_memory=None,
                 ipc_everywhere=False, pids=None):
        self.backend = backend
        self.pids = pids  # rank -> its process id (whose memory this process opens, for IPC peers)
        # Every pair of ranks opened each other's IPC memory (so the peer-read algorithms
        # can run: transport.device_node); the same answer on every rank.
        self.ipc_everywhere = ipc_everywhere
        self.ipc_refusals = {}  # peer -> why this rank could not open its IPC memory (negotiate's probe)
        self.gpus = None  # every rank's GPU, device.gpus.gpu_stamp (negotiate): its model, how many there are
        self.node_gpus = None  # the node's ranks' GPUs, their uuids as bytes (negotiate; the same on every one)
        self.peer = None  # the peer-read calls' state (peer_node.PeerNode), made at the first such call
        self.cuda_aware = cuda_aware  # MPI takes device memory (for native, and the non-IPC peers)
        self.paths = paths  # rank -> "staged" | "cuda-aware" | "ipc" ("self" for this rank)
        self.ack_comm = ack_comm  # IPC acknowledgements travel here (their own matching)
        self.bulk_comm = bulk_comm  # IPC segments that found no slot travel here, staged
        self.ipc_memory = ipc_memory if ipc_memory is not None else ipc_memory_limit()
        self._ipc_bytes = 0  # in slots so far
        self.compute = backend.stream("compute")
        self.d2h = backend.stream("d2h")
        self.h2d = backend.stream("h2d")
        self.p2p = backend.stream("p2p")
        self.streams = (self.compute, self.d2h, self.h2d, self.p2p)
        self.pinned = _Pool(backend, backend.pinned)
        self.workspace = _Pool(backend, lambda n: backend.empty(n, np.uint8))
        self._slots = []  # this rank's IPC send slots
        self._free_slots = []
        self._opened = {}  # (peer, slot index) -> (its base, array, event) of a peer's slot
        self.last_end = None  # the event after the latest finished call's work

    # -- calls --------------------------------------------------------------------------------
    def begin(self, user_stream):
        """Order this call's device work after what the user queued on ``user_stream``
        and after the calls that finished before (whose workspace it may reuse).
        Returns the event a host must wait for before MPI may touch the call's device
        memory itself (CUDA-aware)."""
        started = self.backend.event()
        self.backend.record(started, user_stream)
        for stream in self.streams:
            self.backend.wait(stream, started)
            if self.last_end is not None:
                self.backend.wait(stream, self.last_end)
        if self.last_end is None:
            return started
        ready = self.backend.event()  # after the user's work and the previous calls'
        self.backend.record(ready, self.compute)
        return ready

    def fan_out(self):
        """Make the other streams wait for what is queued on the compute stream (the
        packing of a non-contiguous input, before the plan's copies read it). Returns
        the event that marks it (the call's inputs are ready)."""
        marker = self.backend.event()
        self.backend.record(marker, self.compute)
        for stream in self.streams[1:]:
            self.backend.wait(stream, marker)
        return marker

    def join(self):
        """Make the compute stream wait for everything queued on the other streams."""
        for stream in self.streams[1:]:
            marker = self.backend.event()
            self.backend.record(marker, stream)
            self.backend.wait(self.compute, marker)

    def end(self, user_stream):
        """After :meth:`join` and the call's last kernels: the user's stream waits for them."""
        done = self.backend.event()
        self.backend.record(done, self.compute)
        self.backend.wait(user_stream, done)
        self.last_end = done

    def release_memory(self):
        """Drop the pooled pinned and device buffers (new ones are made when needed),
        once the device has stopped using them."""
        for stream in self.streams:
            self.backend.synchronize_stream(stream)
        self.pinned = _Pool(self.backend, self.backend.pinned)
        self.workspace = _Pool(self.backend, lambda n: self.backend.empty(n, np.uint8))

    def take_workspace(self, count, dtype):
        """A device buffer of ``count`` elements of ``dtype`` (and the raw buffer to give back)."""
        if count == 0:
            return None, self.backend.empty(0, dtype)
        raw = self.workspace.take(count * np.dtype(dtype).itemsize)
        return raw, raw[: count * np.dtype(dtype).itemsize].view(dtype)

    # -- IPC slots -------------------------------------------------------------------------------
    def take_slot(self, nbytes):
        """A free IPC slot of at least ``nbytes``, a new one if the slots stay within
        ``ipc_memory`` bytes, else None (the segment then goes staged)."""
        for k, slot in enumerate(self._free_slots):
            if slot.capacity >= nbytes:
                return self._free_slots.pop(k)
        capacity = max(1 << max(int(nbytes) - 1, 0).bit_length(), 64 << 10)
        if self._ipc_bytes + capacity > self.ipc_memory:
            return None
        slot = _Slot(self.backend, len(self._slots), capacity)
        self._slots.append(slot)
        self._ipc_bytes += slot.size  # (at most one slot's rounding past the limit)
        return slot

    def give_slot(self, slot):
        self._free_slots.append(slot)

    def slot(self, index):
        return self._slots[index]

    def open_peer_slot(self, peer, index, size, handle, event_handle, base, buffer_id):
        """``(array, event)`` of rank ``peer``'s slot ``index``, its whole allocation of
        ``size`` bytes (opened at its first use)."""
        key = (peer, index)
        if key not in self._opened:
            array = peer_memory(self.backend).view(self.pids[peer], base, buffer_id, handle, size, 0, size)
            self._opened[key] = (base, array, self.backend.ipc_open_event(event_handle))
        return self._opened[key][1:]

    def free(self, comm, broken=False):
        """Give back the IPC memory (the peers' it opened, then, once every rank of
        ``comm`` has, its own slots) and the acknowledgement communicator. Collective,
        as Communicator.free (``broken``: the communicator is, on this rank; the ranks
        agree: broken on one is broken on all)."""
        if self.peer is not None:
            self.peer.free(broken)  # its window: collective too
            self.peer = None
        broken = not comm.allreduce(not broken, op=MPI.LAND)
        if broken:
            # The failed call's device work may still be queued, reading the peers'
            # slots (and theirs this rank's): a slot freed under it would be read freed
            # (the stand-in raises StaleMapping). So a broken communicator's IPC memory
            # is kept, mapped, for the life of the process, as its MPI communicators are.
            _KEPT_MEMORY.append((self._slots, self._opened))
        else:
            memory = peer_memory(self.backend)
            for (peer, _), (base, _, event) in self._opened.items():
                memory.close(self.pids[peer], base)
                self.backend.ipc_close_event(event)
        comm.Barrier()  # (each slot goes with its array, below: no peer has it open now, or it is kept)
        self._opened, self._slots, self._free_slots, self._ipc_bytes = {}, [], [], 0
        if broken:  # messages of the failed call may still come (see .retired)
            retire(self.ack_comm, self.bulk_comm)
            self.ack_comm = self.bulk_comm = None
            return
        for comm in (self.ack_comm, self.bulk_comm):
            if comm is not None and comm != MPI.COMM_NULL:
                comm.Free()


def negotiate(comm, node_comm, backend, request, cuda_ipc=None, cuda_aware=None, ipc_memory=None):
    """The device context of ``comm`` (an mpi4py communicator, the library's private
    one) for ``backend``. Collective; ``request(start, nbytes)`` runs one non-blocking
    MPI call to completion through the communicator's progress engine, bounded by the
    call's timeout, and ``node_comm()`` gives the communicator of this rank's node.

    1. Every rank says whether it may use CUDA IPC (a timed exchange: a rank that never
       makes the call times the others out here, as in any call).
    2. Ranks of one node that may, try it: each exports a small IPC buffer and event,
       and opens every same-node peer's. A pair uses IPC only where both ranks opened
       the other's, so a node where IPC cannot work (no shared IPC namespace, no peer
       access between the GPUs) falls back to staging instead of failing later.
    3. Every other pair is staged, or CUDA-aware where MPI takes device memory.

    ``cuda_ipc``, ``cuda_aware`` (bools) and ``ipc_memory`` (bytes) override the
    environment's ``COLLECTIVES_CUDA_IPC``, ``COLLECTIVES_CUDA_AWARE`` and
    ``COLLECTIVES_IPC_MEMORY``.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    ipc = _ipc_wanted() if cuda_ipc is None else cuda_ipc
    wanted = np.array([bool(backend.ipc_capable and ipc)], np.uint8)
    everyone = np.empty(size, np.uint8)
    request(lambda: comm.Iallgather(wanted, everyone), everyone.nbytes)  # every rank is here from now on
    node = node_comm()
    same_node = set(node.Get_group().Translate_ranks(list(range(node.Get_size())), comm.Get_group()))
    probe, reach = None, np.zeros(size, np.uint8)
    # pid, then the probe's base, buffer id and size and its memory and event handles (none: zeros)
    mine = np.zeros(_ROW_WORDS, np.int64)
    mine[0] = os.getpid()
    mine[_PROBE_WORDS:] = np.frombuffer(b"".join(str(v).encode().ljust(_NAME_BYTES, b"\0")[:_NAME_BYTES]
                                                 for v in (backend.uuid, backend.name)), np.int64)
    if wanted[0]:
        try:
            probe = _Slot(backend, -1, 64)
            mine[1:4] = probe.base, np.uint64(probe.buffer_id).view(np.int64), probe.size
            mine[4:_PROBE_WORDS] = np.frombuffer(probe.handle + probe.event_handle, np.int64)
        except Exception:  # noqa: BLE001 - this GPU or process cannot export: no IPC from here
            probe, wanted[0] = None, 0
    probes = np.empty((size, mine.size), np.int64)
    request(lambda: comm.Iallgather(mine, probes), probes.nbytes)
    refusals = {}  # peer -> why this rank could not open its probe
    for peer in same_node:
        if peer != rank and probe is not None and probes[peer, 4:_PROBE_WORDS].any():
            refusals[peer] = _can_open(backend, probes[peer])
            reach[peer] = refusals[peer] is None
    reaches = np.empty((size, size), np.uint8)
    request(lambda: comm.Iallgather(reach, reaches), reaches.nbytes)  # every peer has closed ours
    probe = None  # (freed with its array: no peer has it open now)
    aware = cuda_aware_mpi() if cuda_aware is None else cuda_aware
    paths = {}
    for peer in range(size):
        if peer == rank:
            paths[peer] = "self"
        elif reaches[rank, peer] and reaches[peer, rank]:
            paths[peer] = "ipc"
        else:
            paths[peer] = "cuda-aware" if aware else "staged"
    ack_comm = comm.Dup() if size > 1 else None  # blocking, but every rank is here
    bulk_comm = comm.Dup() if size > 1 else None
    everywhere = all(reaches[i, j] for i in range(size) for j in range(size) if i != j)
    context = DeviceContext(backend, paths, ack_comm, bulk_comm, aware, ipc_memory, everywhere,
                            [int(pid) for pid in probes[:, 0]])
    context.ipc_refusals = {peer: why for peer, why in refusals.items() if why is not None}
    named = [(row[:_NAME_BYTES], row[_NAME_BYTES:]) for row in (r[_PROBE_WORDS:].tobytes() for r in probes)]
    context.gpus = gpu_stamp([name.rstrip(b"\0").decode(errors="replace") for _, name in named],
                             [uuid for uuid, _ in named])  # every rank's GPU: the same everywhere
    context.node_gpus = {named[q][0] for q in same_node}
    return context


def _can_open(backend, words):
    """None if this process can open another's IPC buffer and event, as ``words`` (its
    row of the probes) describe them (both closed again), else what the driver said."""
    pid, base, buffer_id, nbytes = int(words[0]), int(words[1]), int(words[2]) & (2 ** 64 - 1), int(words[3])
    handles = words[4:_PROBE_WORDS].tobytes()
    memory, event = peer_memory(backend), None
    try:
        memory.view(pid, base, buffer_id, handles[:_HANDLE_BYTES], nbytes, 0, nbytes)
        event = backend.ipc_open_event(handles[_HANDLE_BYTES:])
    except Exception as exc:  # noqa: BLE001 - whatever the driver says, the answer is no
        return f"{type(exc).__name__}: {exc}"
    finally:
        memory.close(pid, base)
        if event is not None:
            backend.ipc_close_event(event)
    return None


# -- running a plan on device buffers ---------------------------------------------------------------
class DevicePlanHandle(PlanHandle):
    """Runs a compiled plan (cut into device segments) on device buffers.

    MPI matches messages between two ranks in the order they are posted, so this
    handle posts its sends (and receives) to each peer in schedule order even where
    they become ready out of order (a later segment's device copy can finish first):
    each waits in ``_order`` until those before it are posted."""

    def __init__(self, progress, describe, finish, comm, tag, plan, buffers, op, work, timeout=None, sequence=0):
        """``work``: the call's device side (:class:`~.device_call.DeviceCall`): its
        device context, dtype and the event its inputs are ready at."""
        self._ctx, self._dtype, self._backend = work.ctx, work.dtype, work.ctx.backend
        self._inputs_ready = work.inputs_ready  # the event before which MPI must not touch the buffers (None: passed)
        self._done_on = [None] * len(plan.ops)  # (stream, event) of op i's device work, once queued
        self._order = {}  # (kind, peer) -> deque of [op, post or None] in schedule order
        self._waiting_for = {}  # op -> device events the host still waits for before posting it
        self._parts = {}  # IPC send op -> completions missing (control message sent, acknowledgement back)
        self._slot_of = {}  # IPC send op -> its slot
        self._op_of_slot = {}  # slot index -> the IPC send op using it
        self._aux = 0  # messages beside the plan's (IPC acknowledgements) still in flight
        self._pinned = {}  # op -> the whole pinned buffer it stages through
        self._messages = {}  # token -> small host buffers of IPC control messages and acknowledgements
        self._remote = {}  # workspace slice -> (receive, slot, the peer's slot, its event) read in its place
        super().__init__(progress, describe, finish, comm, tag, plan, buffers, op, timeout, sequence)

    # -- device work ordered after what it depends on --------------------------------------------
    def _after_predecessors(self, i, stream):
        """Make ``stream`` wait for the device work of every operation ``i`` depends on."""
        for p in self._plan.predecessors[i]:
            queued = self._done_on[p]
            if queued is not None and queued[0] is not stream:
                self._backend.wait(stream, queued[1])

    def _queued(self, i, stream):
        event = self._backend.event()
        self._backend.record(event, stream)
        self._done_on[i] = (stream, event)
        return event

    def _run_local(self, i):
        op = self._plan.ops[i]
        stream = self._ctx.compute
        self._after_predecessors(i, stream)
        view = self._buffers.view
        remote = []  # (receive, slot) of operands read straight from a peer's IPC slot
        if isinstance(op, Copy):
            self._backend.copy(view(op.dst), view(op.src), stream)
        elif isinstance(op, ReduceMany):  # one kernel, one pass over every input
            sources = [self._operand(s, stream, remote) for s in op.srcs]
            self._backend.reduce_n(stream, self._op, self._dtype, view(op.dst), sources)
        else:
            a, b = self._operand(op.a, stream, remote), self._operand(op.b, stream, remote)
            self._backend.reduce2(stream, self._op, self._dtype, view(op.dst), a, b)
        event = self._queued(i, stream)
        for receive, index in remote:  # the slots are free once this kernel has read them
            self._progress.add_device(self, ("ipc-copied", receive, index), self._backend, event)

    # -- posting, in schedule order per peer ------------------------------------------------------
    def _enlist(self, kind, peer, i):
        """Reserve ``i``'s place among the MPI posts of ``kind`` to ``peer``."""
        self._order.setdefault((kind, peer), []).append([i, None])

    def _ready(self, kind, peer, i, post):
        """``i`` may be posted (``post()``); post it and whatever it held up, in order."""
        queue = self._order[(kind, peer)]
        for entry in queue:
            if entry[0] == i:
                entry[1] = post
                break
        while queue and queue[0][1] is not None:
            queue.pop(0)[1]()

    def _post(self, i):
        op = self._plan.ops[i]
        path = self._ctx.paths[op.peer]
        view = self._buffers.view(op.src if isinstance(op, Send) else op.dst)
        self._in_flight[i] = view.nbytes
        if path == "ipc":
            (self._ipc_send if isinstance(op, Send) else self._ipc_recv_post)(i, op, view)
            return
        kind = "send" if isinstance(op, Send) else "recv"
        self._enlist(kind, op.peer, i)
        if path == "cuda-aware":  # MPI touches the device memory: first the work it depends on
            events = [self._done_on[p][1] for p in self._plan.predecessors[i]
                      if self._done_on[p] is not None]
            if self._inputs_ready is not None:  # and the user's work, the packing, earlier calls
                if self._backend.query(self._inputs_ready):
                    self._inputs_ready = None
                else:
                    events.append(self._inputs_ready)
            if not events:
                self._ready(kind, op.peer, i, lambda: self._post_device_memory(i))
                return
            self._waiting_for[i] = len(events)
            for event in events:
                self._progress.add_device(self, ("ready", i), self._backend, event)
        elif isinstance(op, Send):  # staged: device -> pinned host, then the message
            stream = self._ctx.d2h
            self._after_predecessors(i, stream)
            pinned = self._pinned[i] = self._ctx.pinned.take(view.nbytes)
            self._backend.copy(pinned[: view.nbytes], view, stream)
            self._progress.add_device(self, ("staged", i), self._backend, self._queued(i, stream))
        else:
            pinned = self._pinned[i] = self._ctx.pinned.take(view.nbytes)
            self._ready(kind, op.peer, i, lambda: self._message(self._comm, False, pinned[: view.nbytes], op.peer,
                                                                ("recv", i)))

    def _message_bytes(self, op):
        # On an IPC path the segment itself never travels on this communicator: its
        # control message does, and says the segment's size (checked on arrival).
        return _CONTROL_BYTES if self._ctx.paths[op.peer] == "ipc" else self._buffers.view(op.dst).nbytes

    def _wrong_size(self, token, got, source=None):
        i = token[1]
        return self._size_error(i, self._plan.ops[i], got, f"{self._in_flight[i]} B")

    def _post_device_memory(self, i):
        op = self._plan.ops[i]
        if isinstance(op, Send):
            self._message(self._comm, True, self._backend.mpi_buffer(self._buffers.view(op.src)), op.peer, ("send", i))
        else:
            self._message(self._comm, False, self._backend.mpi_buffer(self._buffers.view(op.dst)), op.peer, ("recv", i))

    # -- IPC --------------------------------------------------------------------------------------------
    def _ipc_send(self, i, op, view):
        ctx = self._ctx
        slot = ctx.take_slot(view.nbytes)
        control = np.zeros(_CONTROL_WORDS, np.int64)
        control[1] = view.nbytes
        self._messages[("control", i)] = control
        self._parts[i] = 2  # the control message sent, and the acknowledgement (or the staged copy) done
        if slot is None:  # the slots are at their limit: this segment goes staged, on the bulk communicator
            control[3] = _STAGED
            stream = ctx.d2h
            self._after_predecessors(i, stream)
            pinned = self._pinned[i] = ctx.pinned.take(view.nbytes)
            self._backend.copy(pinned[: view.nbytes], view, stream)
            self._enlist("bulk", op.peer, i)
            self._message(self._comm, True, control, op.peer, ("ipc-sent", i))
            self._progress.add_device(self, ("staged-bulk", i), self._backend, self._queued(i, stream))
            return
        stream = ctx.p2p
        self._after_predecessors(i, stream)
        self._backend.copy(slot.array[: view.nbytes], view, stream)
        self._backend.record(slot.event, stream)  # before the control message: the receiver waits for it
        control[0], control[2] = slot.index, slot.size  # (the peer opens the whole allocation)
        control[4:12] = np.frombuffer(slot.handle, np.int64)
        control[12:20] = np.frombuffer(slot.event_handle, np.int64)
        control[20], control[21] = slot.base, np.uint64(slot.buffer_id).view(np.int64)
        # The send is done once its data is in the slot (its source may then be
        # overwritten) and the control message is out. The acknowledgement only frees the
        # slot: nothing in the plan waits for it, else a reduction that reads a peer's
        # slot in place and this rank's own send could wait for each other.
        self._slot_of[i], self._op_of_slot[slot.index] = slot, i
        self._progress.add_device(self, ("slot-filled", i), self._backend, self._queued(i, stream))
        self._message(self._comm, True, control, op.peer, ("ipc-sent", i))
        ack = self._messages[("ack", i)] = np.empty(1, np.int64)
        self._aux += 1
        self._message(ctx.ack_comm, False, ack, op.peer, ("ipc-ack", i))

    def _ipc_recv_post(self, i, op, view):
        control = self._messages[("control", i)] = np.empty(_CONTROL_WORDS, np.int64)
        self._message(self._comm, False, control, op.peer, ("ipc-recv", i))

    def _ipc_received(self, i, status):
        """A control message: the segment is in the peer's slot (or comes staged). Where
        one reduction alone reads this receive's data, it reads the peer's slot itself
        (no copy); else the segment is copied out of it. Either way the slot is
        acknowledged once the device has read it."""
        op = self._plan.ops[i]
        control = self._messages.pop(("control", i))
        got, expected = status.Get_count(MPI.BYTE), self._in_flight[i]
        if got != control.nbytes:
            raise self._size_error(i, op, got, f"a {control.nbytes}-byte IPC control message")
        if int(control[1]) != expected:
            raise self._size_error(i, op, int(control[1]), f"{expected} B")
        if control[3] == _STAGED:
            pinned = self._pinned[i] = self._ctx.pinned.take(expected)
            self._message(self._ctx.bulk_comm, False, pinned[:expected], op.peer, ("recv", i))
            return
        index, nbytes, size = (int(v) for v in control[:3])
        peer_array, peer_event = self._ctx.open_peer_slot(op.peer, index, size, control[4:12].tobytes(),
                                                          control[12:20].tobytes(), int(control[20]),
                                                          int(control[21]) & (2 ** 64 - 1))
        self._aux += 1  # the acknowledgement, sent in order once the device has read the slot
        self._enlist("ack", op.peer, i)
        local = self._buffers.view(op.dst)
        reader = self._direct_reader(i, op)
        if reader is not None:
            self._remote[op.dst] = (i, index, peer_array[:nbytes].view(local.dtype), peer_event)
            self._complete(i)
            return
        stream = self._ctx.p2p
        self._backend.wait(stream, peer_event)  # the sender's copy into its slot has run
        self._after_predecessors(i, stream)
        self._backend.copy(local, peer_array[:nbytes], stream)
        self._progress.add_device(self, ("ipc-copied", i, index), self._backend, self._queued(i, stream))
        self._complete(i)

    def _direct_reader(self, i, op):
        """The reduction that alone reads receive ``i``'s data, as one whole operand, in
        workspace; else None."""
        plan = self._plan
        readers = plan.readers[i] if plan.readers else ()
        if op.dst.buf != "tmp" or len(readers) != 1:
            return None
        reader = plan.ops[readers[0]]
        if isinstance(reader, Reduce) and op.dst in (reader.a, reader.b):
            return readers[0]
        if isinstance(reader, ReduceMany) and op.dst in reader.srcs:
            return readers[0]
        return None

    def _operand(self, s, stream, remote):
        """The view a kernel reads for slice ``s``: a peer's slot where it stands in for a
        receive (``stream`` waits for the peer's event; noted in ``remote``)."""
        standing_in = self._remote.pop(s, None)
        if standing_in is None:
            return self._buffers.view(s)
        i, index, view, event = standing_in
        self._backend.wait(stream, event)
        remote.append((i, index))
        return view

    def _ipc_acknowledge(self, i, index):
        op = self._plan.ops[i]
        ack = self._messages[("sent ack", i)] = np.array([index], np.int64)
        self._ready("ack", op.peer, i, lambda: self._message(self._ctx.ack_comm, True, ack, op.peer, ("ack-sent", i)))

    def _ipc_part_done(self, i):
        self._parts[i] -= 1
        if self._parts[i] == 0:
            del self._parts[i]
            self._complete(i)

    # -- completions ------------------------------------------------------------------------------------
    def _on_request_done(self, token, status):
        kind, i = token
        if kind == "send":
            if i in self._pinned:
                self._ctx.pinned.give(self._pinned.pop(i))
            self._complete(i)
        elif kind == "recv":
            op = self._plan.ops[i]
            got, expected = status.Get_count(MPI.BYTE), self._in_flight[i]
            if got != expected:
                raise self._size_error(i, op, got, f"{expected} B")
            pinned = self._pinned.pop(i, None)
            if pinned is not None:  # staged: host -> device, after what the slice waits for
                stream = self._ctx.h2d
                self._after_predecessors(i, stream)
                self._backend.copy(self._buffers.view(op.dst), pinned[:expected], stream)
                self._ctx.pinned.give(pinned, after=self._queued(i, stream))
            self._complete(i)
        elif kind == "ipc-recv":
            self._ipc_received(i, status)
        elif kind == "ipc-sent":
            self._messages.pop(("control", i))
            self._ipc_part_done(i)
        elif kind == "bulk-sent":  # a staged segment to an IPC peer (no slot was free)
            self._ctx.pinned.give(self._pinned.pop(i))
            self._ipc_part_done(i)
        elif kind == "ipc-ack":  # the receiver has read the slot: it is free again
            ack = self._messages.pop(("ack", i))
            op = self._plan.ops[i]
            if status.Get_count(MPI.BYTE) != ack.nbytes or int(ack[0]) not in self._op_of_slot:
                raise self._size_error(i, op, status.Get_count(MPI.BYTE), "an acknowledgement of an IPC slot in use")
            slot = self._slot_of.pop(self._op_of_slot.pop(int(ack[0])))
            self._ctx.give_slot(slot)
            self._aux -= 1
        elif kind == "ack-sent":
            self._messages.pop(("sent ack", i))
            self._aux -= 1

    def _on_device_done(self, token):
        kind, i = token[0], token[1]
        op = self._plan.ops[i]
        if kind == "staged":  # the segment is in pinned memory: send it (in order)
            buffer = self._pinned[i][: self._in_flight[i]]
            self._ready("send", op.peer, i, lambda: self._message(self._comm, True, buffer, op.peer, ("send", i)))
        elif kind == "ready":
            self._waiting_for[i] -= 1
            if self._waiting_for[i] == 0:
                del self._waiting_for[i]
                kind = "send" if isinstance(op, Send) else "recv"
                self._ready(kind, op.peer, i, lambda: self._post_device_memory(i))
        elif kind == "ipc-copied":
            self._ipc_acknowledge(i, token[2])
        elif kind == "slot-filled":
            self._ipc_part_done(i)
        elif kind == "staged-bulk":  # in pinned memory: send it on the bulk communicator, in order
            buffer = self._pinned[i][: self._in_flight[i]]
            self._ready("bulk", op.peer, i, lambda: self._message(self._ctx.bulk_comm, True, buffer, op.peer,
                                                                  ("bulk-sent", i)))

    def _complete(self, i):
        self._bytes_done += self._in_flight.pop(i, 0)
        super()._complete(i)

    def _size_error(self, i, op, got, expected):
        return at(MessageSizeError(f"{self._describe}: step {self._step(i)}: received {got} B from rank {op.peer} "
                                    f"where the schedule expects {expected}; the ranks called it with buffers of "
                                    "different sizes, or some with host and some with device arrays"), op.peer, i + 1)

    def _is_done(self):
        return self._scheduler.done and self._aux == 0

    def _cancel(self, request, token):
        if token[0] in ("recv", "ipc-recv", "ipc-ack"):
            request.Cancel()

    def _outstanding(self):
        text = super()._outstanding()
        device = self._progress.device_work(self)
        if device:
            text += f"; {device} device operation(s) the host waits for"
        return text


@dataclass(slots=True)
class NativeOnDevice:
    """What a ``native`` call on device buffers posts (:class:`DeviceNativeHandle`)."""

    start_mpi: Callable  # (send buffer, receive buffer) -> request, on deferred.comm
    dev_in: Any  # the device input (None: none here)
    dev_out: Any  # the device output (None: no result here)
    host_in: Any  # their pinned host copies (None: a CUDA-aware MPI takes the device buffers)
    host_out: Any
    nbytes: int  # the call's size, for messages
    deferred: Any  # native.Deferred: posted on its communicator, in call order
    agree_comm: Any = None  # where the ranks agree on the call's size first (None: no agreement)
    unit: int = 0  # the bytes they agree on


class DeviceNativeHandle(Handle):
    """``native`` on device buffers: the MPI library's own collective on host copies
    (staged: the input device -> pinned host, MPI, the result back), or on the device
    buffers themselves where MPI is CUDA-aware.

    MPI's collective can only be posted once the input is in host memory (or the
    device work that produces it has run), which each rank learns at its own moment:
    so, like the size-agreed host calls, it goes on ``deferred.comm`` (a duplicate of
    its own, :class:`~.native.Deferred`), in call order, never beside the collectives
    posted at call time on the communicator's own. Where this MPI needs it
    (``agree_comm`` given), the ranks first agree on the call's size there, at call
    time, as :class:`~.native.AgreedHandle` does."""

    def __init__(self, progress, describe, finish, ctx, native, timeout, sequence):
        """``native``: what the call posts (a :class:`NativeOnDevice`)."""
        super().__init__(progress, describe, finish, timeout, sequence)
        self._ctx, self._backend = ctx, ctx.backend
        self._start_mpi = native.start_mpi
        self._host_in, self._host_out = native.host_in, native.host_out
        self._dev_in, self._dev_out = native.dev_in, native.dev_out
        self._nbytes = native.nbytes
        self._pending = 1
        self._deferred = native.deferred
        self._agree_comm = agree_comm = native.agree_comm
        self._sizes = np.array([native.unit, -native.unit], np.int64)
        self._waiting_for = 2 if agree_comm is not None else 1  # the input copied (and the sizes agreed)
        self._agreed = False  # ready to post (what Deferred.post_ready reads)
        self._posted = False

    def start(self):
        ctx = self._ctx
        self._deferred.waiting.append(self)
        if self._agree_comm is not None:
            try:
                self._add_request(self._agree_comm.Iallreduce(MPI.IN_PLACE, self._sizes, MPI.MAX), "agree")
            except MPI.Exception as exc:
                raise TransportError(f"{self._describe}: the MPI library refused the call: {exc}") from exc
        stream = ctx.d2h
        if self._host_in is not None and self._dev_in is not None:
            ctx.backend.copy(self._host_in, self._dev_in, stream)
        event = ctx.backend.event()
        ctx.backend.record(event, stream)
        self._begin_waiting(event)
        self._begin()
        return self

    def _begin_waiting(self, event):
        self._progress.add_device(self, ("input", 0), self._backend, event)

    def _on_device_done(self, token):
        self._one_less()

    def _one_less(self):
        self._waiting_for -= 1
        if self._waiting_for == 0:
            self._agreed = True
            self._deferred.post_ready()

    def _post_collective(self):
        if self._host_in is not None:
            send, receive = self._host_in, self._host_out
        else:
            send = None if self._dev_in is None else self._backend.mpi_buffer(self._dev_in)
            receive = None if self._dev_out is None else self._backend.mpi_buffer(self._dev_out)
        self._posted = True
        try:
            request = self._start_mpi(send, receive)
        except MPI.Exception as exc:
            raise TransportError(f"{self._describe}: the MPI library refused the call: {exc}") from exc
        self._add_request(request, 0)

    def _on_request_done(self, token, _status):
        if token == "agree":
            error = mismatch(self._describe, self._sizes)
            if error is not None:
                self._deferred.waiting.clear()  # the engine breaks: nothing after it is posted
                raise error
            self._one_less()
            return
        if self._host_out is not None and self._dev_out is not None:
            self._backend.copy(self._dev_out, self._host_out, self._ctx.h2d)
        self._pending = 0

    def _is_done(self):
        return self._pending == 0

    def _outstanding(self):
        if not self._posted:
            return ("before the MPI library's own collective: waiting for its input on the device, for the ranks' "
                    "agreement on its size, or for the calls before it to be posted")
        return (f"inside the MPI library's own collective ({self._nbytes} B on host copies of device buffers; it "
                "does not say which peers it waits for)")
