"""The public entry point: :class:`Communicator`, a thin face over the call path.

Each collective hands its arguments, with the collective's spec
(:mod:`collectives.specs`), to the call path (:func:`collectives.calls.run`), which
checks them, resolves the algorithm, numbers the call and runs it on the first route
that takes it (:mod:`collectives.routes`). What a communicator keeps between calls is
its :class:`~collectives.context.Context`. How a call goes from here to the wire:
docs/architecture.md.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from . import calls, point, registered
from .context import Context
from .options import Options, check_bool, check_slot
from .specs import SPECS
from .topology import Topology
from .transport.progress import Handle, Progress

ALLREDUCE, REDUCE_SCATTER, ALLGATHER, BROADCAST, REDUCE, GATHER, SCATTER, ALLTOALL, ALLTOALLV = (
    SPECS[name] for name in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "gather", "scatter",
                             "alltoall", "alltoallv"))

Array = Any  # a NumPy array (or anything numpy.asarray takes), or a device array: CuPy, a torch CUDA tensor


class Communicator:
    """Collectives over the ranks of an MPI intracommunicator.

    ``Communicator()`` uses ``MPI.COMM_WORLD``; ``Communicator(mpi_comm)`` any
    intracommunicator. Creating one is collective (it duplicates ``mpi_comm``, so the
    library's messages never match the caller's). ``segment_size`` is the default
    pipelining segment in bytes for the ``tree`` allreduce and the ``pipeline``
    broadcast (``COLLECTIVES_SEGMENT_SIZE``, else 256 KiB).

    ``algorithm="auto"`` (the default) picks per call from the collective, the buffer
    size and the world size: see :mod:`collectives.auto` for the measured table and
    the ``COLLECTIVES_<COLLECTIVE>_ALGORITHM`` overrides.

    Every collective also takes device arrays (CuPy, torch CUDA tensors, anything with
    ``__cuda_array_interface__``): see :mod:`collectives.transport.device`. Messages on
    the device are pipelined in segments of ``device_segment_size`` bytes
    (``COLLECTIVES_DEVICE_SEGMENT_SIZE``, else 4 MiB; 0: whole messages). ``cuda_ipc``
    and ``cuda_aware`` (True/False; None: ``COLLECTIVES_CUDA_IPC``,
    ``COLLECTIVES_CUDA_AWARE``, else detected) choose how device messages move, and
    ``ipc_memory`` bounds the IPC send slots (``COLLECTIVES_IPC_MEMORY``, 256 MiB). Every
    rank passes device arrays to a call, or every rank host arrays. On one node whose
    ranks can open each other's device memory, the peer-read algorithms (``one_shot``,
    ``two_shot``, ``leader``) read the others' buffers in place, two fences a call; ``device_fence``
    (``COLLECTIVES_DEVICE_FENCE``: ``auto``, ``host``, ``stream`` or ``kernel``) says how
    a fence meets (see :mod:`collectives.transport.device_node`).

    Every rank must call the same collectives in the same order, as with MPI. What
    protects against the ways that goes wrong (see docs/guides/troubleshooting.md):

    - ``check=True`` (``COLLECTIVES_CHECK=1``): before each call the ranks compare what
      they are calling (one 152-byte allgather) and all raise
      :class:`~collectives.CollectiveMismatchError` if it differs. Set it on every rank.
    - ``timeout`` seconds (``COLLECTIVES_TIMEOUT``; each call's ``timeout=`` overrides):
      a call that has not finished by then raises
      :class:`~collectives.CollectiveTimeoutError` naming the peers it waits for and the
      ranks that did not answer; the communicator is then broken (every later call
      raises). The timeout bounds each wait inside a call: the check-mode exchange
      and the call itself each get it, and a call that first finishes the calls in
      flight waits for each of those up to its own timeout.
    - ``stall_warn`` seconds (``COLLECTIVES_STALL_WARN``): while a call waits, log a
      warning (logger ``collectives``) naming the peers every ``stall_warn`` seconds.
    - Give every rank the same ``timeout`` and ``stall_warn``: with either, a blocking
      call that resolves to ``native`` uses MPI's non-blocking collective (so that it
      can stop or warn), which MPI never matches with the blocking one.

    ``deterministic=True`` (``COLLECTIVES_DETERMINISTIC=1``; set it on every rank): every
    reduction (allreduce, reduce_scatter, reduce) equals, bit for bit, the serial left
    fold ``x0 op x1 op … op x(p-1)`` in rank order, whatever the algorithm ``auto``
    picks, the segment size or the timing, so results reproduce across runs, machines
    and tunings at one world size. ``auto`` then picks among the algorithms that can
    keep that order (``direct``); naming another one is a ``ValueError``.

    The ``shm`` algorithms (ranks that share memory, host arrays) run through a shared
    window of the node made at the first such call; ``comm.shm_slot`` is one rank's
    slot in it, in bytes (``COLLECTIVES_SHM_SLOT``, else 1 MiB; ``dup()`` keeps it): a
    longer call runs slot by slot. Set it alike on every rank (ranks that differ raise
    at the call's first fence). See :mod:`collectives.transport.shm`.

    ``comm.topology`` (a :class:`~collectives.Topology`) is the node layout, learned
    once at creation: ranks that MPI says can share memory are one node. The two-level
    algorithms (``hierarchical``, ``hierarchical_leader``) and ``auto`` use it. ``nodes``
    (one label per rank, the same list on every rank) replaces MPI's view, e.g. where
    ranks of one host should act as several nodes, or in tests.

    For the modules built on it: ``comm.mpi_comm`` is the library's private MPI
    communicator (a duplicate of ``mpi_comm``; MPI's own calls on it never meet the
    library's while nothing is in flight), ``comm.shares_memory`` whether every rank is
    on this node (MPI's view), ``comm.in_flight`` the calls in flight and
    ``comm.progress`` the progress engine that drives them.
    """

    def __init__(self, mpi_comm: MPI.Intracomm | None = None, *, segment_size: int | None = None,
                 check: bool | None = None, timeout: float | None = None, stall_warn: float | None = None,
                 device_segment_size: int | None = None, cuda_ipc: bool | None = None, cuda_aware: bool | None = None,
                 ipc_memory: int | None = None, deterministic: bool | None = None, nodes: Any = None,
                 device_fence: str | None = None) -> None:
        if mpi_comm is None:
            mpi_comm = MPI.COMM_WORLD
        if not isinstance(mpi_comm, MPI.Intracomm) or mpi_comm == MPI.COMM_NULL:
            raise TypeError(f"mpi_comm must be an mpi4py intracommunicator; got {mpi_comm!r}")
        options = Options(segment_size=segment_size, check=check, timeout=timeout, stall_warn=stall_warn,
                          device_segment_size=device_segment_size, cuda_ipc=cuda_ipc, cuda_aware=cuda_aware,
                          ipc_memory=ipc_memory, deterministic=deterministic, device_fence=device_fence)
        self._ctx = Context(mpi_comm, options, nodes)
        self.rank: int = self._ctx.rank
        self.size: int = self._ctx.size
        self.topology: Topology = self._ctx.topology

    def __repr__(self) -> str:
        return f"<collectives.Communicator rank {self.rank} of {self.size}>"

    # -- options and state ------------------------------------------------------------------
    segment_size = property(lambda self: self._ctx.options.segment_size, doc="Bytes per pipelining segment.")
    check = property(lambda self: self._ctx.options.check, doc="Whether check mode is on.")
    deterministic = property(lambda self: self._ctx.options.deterministic, doc="Whether reductions fold in rank order.")
    timeout = property(lambda self: self._ctx.options.timeout, doc="Seconds a call may wait (None: no limit).")
    stall_warn = property(lambda self: self._ctx.options.stall_warn, doc="Seconds between stall warnings, or None.")
    device_segment_size = property(lambda self: self._ctx.options.device_segment_size,
                                   doc="Bytes per device segment (0: whole messages).")
    mpi_comm = property(lambda self: self._ctx.comm, doc="The library's private MPI communicator.")
    shares_memory = property(lambda self: self._ctx.shares_memory, doc="Whether every rank is on this node.")
    progress = property(lambda self: self._ctx.progress, doc="The progress engine of this communicator's calls.")
    in_flight = property(lambda self: tuple(self._ctx.progress.active), doc="The calls in flight (their handles).")
    scratch_bytes = property(lambda self: self._ctx.workspace.kept_bytes,
                             doc="Bytes of host scratch buffers kept between calls (release_memory() drops them).")

    @property
    def shm_slot(self) -> int:
        """One rank's slot of the shared window, in bytes (set it alike on every rank)."""
        return self._ctx.options.shm_slot

    @shm_slot.setter
    def shm_slot(self, value: int) -> None:
        self._ctx.options.shm_slot = check_slot(value)
        self._ctx.lean_entries.drop_all()  # their shared-memory plans were cut for the old slot

    def choose(self, collective: str, nbytes: int, device: bool = False, dtype: Any = None) -> calls.Choice:
        """``(algorithm, why)``: what ``auto`` picks for ``collective`` on ``nbytes`` bytes
        (allgather and gather: the gathered size; scatter: the root's whole buffer;
        alltoall: a rank's whole input) at this world size, and which rule decided; its
        ``route`` names the route a blocking call of that size takes with this
        communicator's options (see :mod:`collectives.routes`). ``device=True`` for
        device arrays; ``dtype`` where it matters (float16 reductions and dtypes MPI has
        no type for stay off ``native``)."""
        return calls.explain(self._ctx, collective, nbytes, device, dtype)

    def release_memory(self) -> None:
        """Drop the scratch buffers kept between calls (they are made again when needed),
        on the host and on devices (pinned staging memory and device workspace)."""
        self._ctx.release_memory()

    def dup(self, *, deterministic: bool | None = None) -> Communicator:
        """A new :class:`Communicator` over the same ranks with its own private MPI
        communicator (collective), e.g. for a thread that must not share this one's
        calls in flight. It keeps this one's options, ``deterministic`` too unless given."""
        if deterministic is not None:
            check_bool(deterministic, "deterministic")
        calls.finish_in_flight(self._ctx)
        keywords = self._ctx.options.keywords()
        if deterministic is not None:
            keywords["deterministic"] = deterministic
        twin = Communicator(self._ctx.comm, nodes=self.topology.node_of, **keywords)
        twin.shm_slot = self.shm_slot
        return twin

    def empty(self, shape: Any, dtype: Any = "float32", device: Any = None) -> Any:
        """A new host array, uninitialised, in memory that the ranks of this node share: a
        *registered buffer* (as NCCL's user-buffer registration). Collective: every rank
        calls it, in the same order, with the same ``shape`` and ``dtype``.

        A call of the ``shm`` algorithm whose input is a registered array on every rank
        (the same array of every rank's ``empty``, or the same slice of it) copies
        nothing into the shared window: the ranks read each other's inputs where they
        are. That holds for allreduce called in place (``out=x``), reduce_scatter,
        allgather and broadcast; any other call on a registered array (reduce, another
        algorithm, allreduce out of place) runs as on any array. Ranks that mix
        registered and unregistered inputs in one ``shm`` call all raise
        :class:`~collectives.CollectiveMismatchError`.

        Lifetime: the array is valid until ``comm.free()``, which releases its memory
        (using it afterwards is undefined, as with freed MPI memory); keep no view of
        it past that. Each ``empty`` makes one shared window, so make a few large
        arrays (buckets) rather than many small ones. Across nodes each node shares
        its own ranks' arrays; the ``shm`` algorithms need one node.

        ``device="cuda"`` (``"cuda:N"``; ``"standin"`` in the tests) makes a device array
        instead (a CuPy array; bfloat16 comes marked, as :func:`collectives.device.bfloat16`),
        which every rank of the node opens in every other's process at once (CUDA IPC),
        so that the peer-read algorithms (``one_shot``, ``two_shot``, ``leader``) read it in place
        from their first call. Any other device array is registered the same way at
        its first such call; this only does it ahead of time. Its lifetime is the
        array's own. With in-kernel fences (ranks on distinct GPUs) a peer read (all but
        ``two_shot``) whose input is the whole array asks no host where the other ranks'
        inputs are: each rank reads the others' arrays of the same ``empty``, so every
        rank must pass its own (else every rank raises
        :class:`~collectives.CollectiveMismatchError`, and the result is undefined), and
        keep it alive as long as the others keep theirs. A slice of it asks, as any
        other array."""
        return registered.empty(self._ctx, shape, dtype, device)

    def zeros(self, shape: Any, dtype: Any = "float32", device: Any = None) -> Any:
        """:meth:`empty`, filled with zeros (each rank writes its own array, so its memory
        is placed near it; on a device, on the current stream). Collective, like :meth:`empty`."""
        array = self.empty(shape, dtype, device)
        if device is None:
            array[...] = 0
        else:
            registered.fill_zeros(array, device)
        return array

    def broadcast_object(self, obj: Any, root: int = 0, *, timeout: float | None = None) -> Any:
        """``obj`` from ``root`` on every rank: a small picklable Python object (metadata
        such as names, shapes and hyperparameters), never array data — arrays go through
        :meth:`broadcast`. Collective; finishes this rank's calls in flight first."""
        return calls.broadcast_object(self._ctx, obj, root, timeout)

    def free(self) -> None:
        """Release the private MPI communicators (collective). The object is unusable after."""
        self._ctx.free()

    # -- collectives ------------------------------------------------------------------------
    # Each is its spec handed to the call path: blocking (the result) or *_async (a Handle).
    def allreduce(self, x: Array, op: str = "sum", algorithm: str = "auto", out: Array | None = None, *,
                  segment_size: int | None = None, timeout: float | None = None) -> Any:
        """Reduce ``x`` elementwise over all ranks; every rank gets the result (shaped like
        ``x``; ``out=x`` works in place). Every rank's result has the same bits.
        ``timeout``: seconds (see :class:`Communicator`); every collective takes it."""
        return calls.run(self._ctx, ALLREDUCE, x, out, op, 0, algorithm, segment_size, timeout, True)

    def allreduce_async(self, x: Array, op: str = "sum", algorithm: str = "auto", out: Array | None = None, *,
                        segment_size: int | None = None, timeout: float | None = None) -> Handle:
        """Start :meth:`allreduce`; returns a :class:`~collectives.Handle` whose ``wait()``
        returns the result (``timeout`` becomes the default of ``wait``). So do all
        ``*_async`` calls."""
        return calls.run(self._ctx, ALLREDUCE, x, out, op, 0, algorithm, segment_size, timeout, False)

    def reduce_scatter(self, x: Array, op: str = "sum", algorithm: str = "auto", out: Array | None = None, *,
                       timeout: float | None = None) -> Any:
        """Reduce ``x`` over all ranks and return block ``rank`` of the result, the blocks
        cut from ``x.ravel()`` as ``numpy.array_split(x.ravel(), size)`` cuts them."""
        return calls.run(self._ctx, REDUCE_SCATTER, x, out, op, 0, algorithm, None, timeout, True)

    def reduce_scatter_async(self, x: Array, op: str = "sum", algorithm: str = "auto", out: Array | None = None, *,
                             timeout: float | None = None) -> Handle:
        return calls.run(self._ctx, REDUCE_SCATTER, x, out, op, 0, algorithm, None, timeout, False)

    def allgather(self, x: Array, algorithm: str = "auto", out: Array | None = None, *,
                  timeout: float | None = None) -> Any:
        """Gather ``x`` from every rank: returns shape ``(size, *x.shape)``, row r from rank r."""
        return calls.run(self._ctx, ALLGATHER, x, out, "-", 0, algorithm, None, timeout, True)

    def allgather_async(self, x: Array, algorithm: str = "auto", out: Array | None = None, *,
                        timeout: float | None = None) -> Handle:
        return calls.run(self._ctx, ALLGATHER, x, out, "-", 0, algorithm, None, timeout, False)

    def broadcast(self, x: Array, root: int = 0, algorithm: str = "auto", *, segment_size: int | None = None,
                  timeout: float | None = None) -> Any:
        """Fill ``x`` on every rank with ``x`` from ``root``, in place; returns ``x``."""
        return calls.run(self._ctx, BROADCAST, x, None, "-", root, algorithm, segment_size, timeout, True)

    def broadcast_async(self, x: Array, root: int = 0, algorithm: str = "auto", *, segment_size: int | None = None,
                        timeout: float | None = None) -> Handle:
        return calls.run(self._ctx, BROADCAST, x, None, "-", root, algorithm, segment_size, timeout, False)

    def reduce(self, x: Array, root: int = 0, op: str = "sum", algorithm: str = "auto", out: Array | None = None, *,
               timeout: float | None = None) -> Any:
        """Reduce ``x`` over all ranks onto ``root``: the result on root (``out=x`` works
        in place there), ``None`` on the other ranks (whose ``out`` is left alone)."""
        return calls.run(self._ctx, REDUCE, x, out, op, root, algorithm, None, timeout, True)

    def reduce_async(self, x: Array, root: int = 0, op: str = "sum", algorithm: str = "auto",
                     out: Array | None = None, *, timeout: float | None = None) -> Handle:
        return calls.run(self._ctx, REDUCE, x, out, op, root, algorithm, None, timeout, False)

    def gather(self, x: Array, root: int = 0, algorithm: str = "auto", out: Array | None = None, *,
               timeout: float | None = None) -> Any:
        """Gather ``x`` from every rank onto ``root``: there, shape ``(size, *x.shape)``,
        row r from rank r; ``None`` on the other ranks (whose ``out`` is left alone).
        Every rank's ``x`` has the same shape and dtype."""
        return calls.run(self._ctx, GATHER, x, out, "-", root, algorithm, None, timeout, True)

    def gather_async(self, x: Array, root: int = 0, algorithm: str = "auto", out: Array | None = None, *,
                     timeout: float | None = None) -> Handle:
        return calls.run(self._ctx, GATHER, x, out, "-", root, algorithm, None, timeout, False)

    def scatter(self, x: Array | None, root: int = 0, algorithm: str = "auto", out: Array | None = None, *,
                timeout: float | None = None) -> Any:
        """Row ``rank`` of ``x`` on ``root`` (shape ``(size, *s)``), on every rank: returns
        an array of shape ``s`` (or ``out``). The other ranks' ``x`` only gives the shape
        and dtype (its contents are not read): pass the same shape, or ``x=None`` with
        ``out`` of shape ``s``."""
        return calls.run(self._ctx, SCATTER, x, out, "-", root, algorithm, None, timeout, True)

    def scatter_async(self, x: Array | None, root: int = 0, algorithm: str = "auto", out: Array | None = None, *,
                      timeout: float | None = None) -> Handle:
        return calls.run(self._ctx, SCATTER, x, out, "-", root, algorithm, None, timeout, False)

    def alltoall(self, x: Array, algorithm: str = "auto", out: Array | None = None, *,
                 timeout: float | None = None) -> Any:
        """Row j of ``x`` (shape ``(size, *s)``) to rank j: returns shape ``(size, *s)``,
        row i from rank i (``MPI_Alltoall``, torch's ``all_to_all_single`` with equal
        splits). Every rank's ``x`` has the same shape and dtype."""
        return calls.run(self._ctx, ALLTOALL, x, out, "-", 0, algorithm, None, timeout, True)

    def alltoall_async(self, x: Array, algorithm: str = "auto", out: Array | None = None, *,
                       timeout: float | None = None) -> Handle:
        return calls.run(self._ctx, ALLTOALL, x, out, "-", 0, algorithm, None, timeout, False)

    def alltoallv(self, x: Array, send_counts: Any, recv_counts: Any = None, algorithm: str = "auto",
                  out: Array | None = None, *, timeout: float | None = None) -> Any:
        """Rows of ``x`` (shape ``(n, *s)``) to every rank, a different number to each
        (``MPI_Alltoallv``; torch's ``all_to_all_single`` with split sizes): the first
        ``send_counts[0]`` rows go to rank 0, the next ``send_counts[1]`` to rank 1, and
        so on (they add up to n). Returns shape ``(sum(recv_counts), *s)``: the rows from
        rank 0 first, then rank 1's, and so on. ``recv_counts[i]`` must equal rank i's
        ``send_counts[rank]``; with ``None`` the ranks learn them from each other (one
        MPI_Alltoall of the counts, waited for before the call returns, async or not).
        Every rank's rows have the same shape ``s`` and dtype. In check mode the ranks
        also compare the counts and all raise if any pair disagrees."""
        return calls.run(self._ctx, ALLTOALLV, x, out, "-", 0, algorithm, None, timeout, True, send_counts,
                         recv_counts)

    def alltoallv_async(self, x: Array, send_counts: Any, recv_counts: Any = None, algorithm: str = "auto",
                        out: Array | None = None, *, timeout: float | None = None) -> Handle:
        return calls.run(self._ctx, ALLTOALLV, x, out, "-", 0, algorithm, None, timeout, False, send_counts,
                         recv_counts)

    # -- point to point ---------------------------------------------------------------------
    def send(self, x: Array, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send ``x`` to rank ``dst``; returns once ``x`` may be changed again. Not
        collective: ``dst`` alone takes part, with a :meth:`recv` of the same ``tag`` into
        an array of the same size in bytes. Messages from one rank to another with one
        tag arrive in the order they were sent. They travel on a private MPI
        communicator, apart from every collective's messages and the caller's own.
        ``timeout`` as for collectives (the communicator is broken after it)."""
        return point.send(self._ctx, x, dst, tag, timeout, blocking=True).wait()

    def send_async(self, x: Array, dst: int, tag: int = 0, *, timeout: float | None = None) -> Handle:
        """Start :meth:`send`: returns a :class:`~collectives.Handle` (``wait()`` gives
        None). Leave ``x`` alone until it has finished. A message to this rank itself
        is allowed here (with a :meth:`recv_async` to match it), not in :meth:`send`."""
        return point.send(self._ctx, x, dst, tag, timeout, blocking=False)

    def recv(self, out: Array, src: int | None = None, tag: int = 0, *, timeout: float | None = None) -> Any:
        """Receive a message from rank ``src`` (None: any rank) with ``tag`` into ``out``
        (an array of exactly the message's size in bytes, any shape; filled in place) and
        return ``out``. A message of another size raises
        :class:`~collectives.MessageSizeError`. To learn which rank a message from any
        rank came from, use :meth:`recv_async`: its handle's ``source``."""
        return point.recv(self._ctx, out, src, tag, timeout, blocking=True).wait()

    def recv_async(self, out: Array, src: int | None = None, tag: int = 0, *, timeout: float | None = None) -> Handle:
        """Start :meth:`recv`: returns a handle whose ``wait()`` gives ``out`` and whose
        ``source`` is then the sending rank."""
        return point.recv(self._ctx, out, src, tag, timeout, blocking=False)

    def poll(self) -> int:
        """Advance this communicator's calls in flight without blocking, as far as their
        messages allow now (each finished message posts the next step's), and return how
        many calls are still in flight. Call it between pieces of other work to overlap
        async collectives with it: the library's messages move only when it is called
        (or ``test``/``wait``). Raises, and breaks the communicator, if a call in flight
        fails here or another rank reports that its call failed."""
        progress: Progress = self._ctx.progress
        progress.drain()
        return len(progress.active)

    def barrier(self, *, timeout: float | None = None, device: Any = None) -> None:
        """Block until every rank has called ``barrier`` (collectives in flight go on).

        ``device`` (a device array, or ``"cuda"``, ``"cuda:N"``, ``"standin"``): a barrier of
        the devices' work too: it returns once every rank's device work queued on its
        current stream before the call has run. On one node whose ranks can open each
        other's device memory it is one fence of the peer-read executor (what
        ``make bench-gpu`` times as the synchronisation floor); elsewhere each rank
        waits for its stream, then the ranks meet in MPI. Every rank passes ``device``."""
        calls.barrier(self._ctx, timeout, device)
