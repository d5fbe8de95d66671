"""The public entry point: :class:`Communicator` and its collectives.

Each collective checks its arguments (before any message is sent), turns the user's
arrays into flat contiguous buffers (array layer), picks the algorithm, fetches the
compiled plan for this rank (cached), and hands it to the MPI transport. The blocking
calls are the ``*_async`` calls followed by ``wait()``.
"""

import itertools
import math
import os
import pickle
import zlib
from functools import lru_cache

import numpy as np
from mpi4py import MPI

from . import calibration
from . import check as check_mode
from . import mpi_library, ops
from . import topology as topology_module
from .algorithms import (ORDERED, SEGMENTED, SHARED_MEMORY, TOPOLOGICAL, VARIABLE, block_bounds, build, check_algorithm,
                         check_ordered, cost_model_choice)
from .algorithms.shm import DEFAULT_SLOT_BYTES, REGISTERED
from .errors import CollectiveError, CollectiveMismatchError, TransportError
from .arrays import as_array, check_out, flat_input, flat_view, overlaps, same_memory
from .dtypes import check_dtype, is_extra
from .device import DeviceArray, is_device
from .schedule import Fence, Schedule, compile_plan, fuse_reductions, split_schedule
from .transport import lean, native, p2p, tags
from .transport.buffers import Buffers
from .transport import liveness as liveness_module
from .transport.liveness import Liveness
from .transport.mpi import PlanHandle, Progress, RequestHandle, check_timeout
from .transport.shm import NodeWindow, Registration, ShmCall, ShmHandle
from .tuning import LINK_TOLERANCE, Selector

# MPI libraries reduce float16 in scalar software loops: MPICH 5's allreduce of float16
# ran at 0.07 GB/s busbw at 4 ranks here, 4-20x slower than the library's own algorithms
# from 64 KiB on (bench/results/epyc-2vcpu-mpich5/float16-n4.txt). The tuning tables are
# measured in float32, so ``auto`` does not hand float16 reductions of this many bytes
# or more to MPI; below it MPI's lower latency wins.
FLOAT16_NATIVE_UP_TO = 64 << 10

DEFAULT_SEGMENT_SIZE = 256 * 1024  # bytes; COLLECTIVES_SEGMENT_SIZE overrides
DEFAULT_DEVICE_SEGMENT_SIZE = 4 << 20  # bytes; COLLECTIVES_DEVICE_SEGMENT_SIZE overrides

_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN,
            "band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR}


@lru_cache(maxsize=512)
def _plan(collective, algorithm, rank, size, count, root, segment, inplace, ordered, device_split=None, counts=None,
          topology=None, registered=None):
    """The compiled plan of one rank (``ordered``: reductions in rank order; ``counts``:
    the per-peer ``(send, recv)`` element counts of alltoallv; ``topology``: the node
    layout, for the two-level algorithms only, so the others share plans). For device
    buffers (``device_split`` not None) its chains of reductions are fused into
    multi-input kernels and it is cut into segments of ``device_split`` elements (0:
    not cut). ``registered``: ``(stride, offset)`` of registered inputs (``shm``)."""
    schedule = build(collective, algorithm, rank, size, count, root=root, segment=segment, ordered=ordered,
                     counts=counts, topology=topology, registered=registered)
    if device_split is not None:
        schedule = fuse_reductions(schedule, inplace=inplace)
        if device_split:
            schedule = split_schedule(schedule, device_split)
    return compile_plan(schedule, inplace=inplace)


def _call_code(collective, algorithm, dtype, op, slot, registered=None):
    """A number naming a call's kind (collective, algorithm, dtype, op, and the slot
    size, which sets its segments and fences; for registered buffers, which
    registration and where in it): ranks compare it in shared memory before they read
    each other's data (``transport.shm``)."""
    op = op if collective in ("allreduce", "reduce", "reduce_scatter") else "-"  # as every path names it
    return zlib.crc32(f"{collective}/{algorithm}/{dtype.name}/{dtype.itemsize}/{op}/{slot}/{registered}".encode())


def _slot_bytes():
    """One rank's slot of the shared window, in bytes: ``COLLECTIVES_SHM_SLOT``, else
    ``algorithms.shm.DEFAULT_SLOT_BYTES``; a call longer than a slot runs in segments."""
    text = os.environ.get("COLLECTIVES_SHM_SLOT", "").strip()
    if not text:
        return DEFAULT_SLOT_BYTES
    if not text.isdigit() or int(text) < 64:
        raise ValueError(f"COLLECTIVES_SHM_SLOT must be a number of bytes, at least 64; got {text!r}")
    return int(text)


def _check_nbytes(value, name):
    """``value`` as an int if it is a positive number of bytes, else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive number of bytes; got {value!r}")
    return int(value)


def _check_segment_size(segment_size):
    return _check_nbytes(segment_size, "segment_size")


def _check_counts(counts, name, size):
    """``counts`` as a tuple of ``size`` non-negative ints, else an error naming ``name``."""
    if isinstance(counts, (str, bytes)) or not hasattr(counts, "__len__"):
        raise TypeError(f"{name} must be a sequence of {size} row counts, one per rank; got {counts!r}")
    if len(counts) != size:
        raise ValueError(f"{name} must have one count per rank ({size}); got {len(counts)}")
    for n in counts:
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"{name} must hold non-negative integers; got {list(counts)!r}")
    return tuple(int(n) for n in counts)


def _starts(lengths):
    """Where each block begins when blocks of ``lengths`` are packed one after another."""
    return tuple(itertools.accumulate(lengths[:-1], initial=0)) if lengths else ()  # (NumPy's cumsum costs µs)


def _needs_window(plan):
    """Whether a shared-memory plan uses the node's window: its data area, or its flags
    for fences (registered plans have fences and no data); kept beside the plan."""
    needs = plan.__dict__.get("_needs_window")
    if needs is None:
        needs = bool(plan.shm) or any(type(op) is Fence for op in plan.ops)
        object.__setattr__(plan, "_needs_window", needs)  # the plan is frozen; a cache beside it
    return needs


def _persistent_kind(collective, count, itemsize):
    """Whether a blocking call (no timeout or stall warning) of one of the library's own
    message-based algorithms runs on a persistent program (``lean.PersistentProgram``):
    small ones, by what every rank knows alike (the collective and its ``count``, the
    element count the plan is built for), so that every rank decides the same."""
    return collective not in VARIABLE and count * itemsize <= lean.PERSISTENT_BYTES


def _check_shape(shape):
    """``shape`` as a tuple of non-negative ints (an int is a 1-d shape), else a ValueError
    naming it."""
    dims = (shape,) if isinstance(shape, (int, np.integer)) else shape
    try:
        dims = tuple(dims)
    except TypeError:
        dims = None
    if dims is None or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ValueError(f"shape must be a non-negative int or a tuple of them; got {shape!r}")
    return tuple(int(d) for d in dims)


def _check_root(root, size):
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise ValueError(f"root must be a rank in 0..{size - 1}; got {root!r}")
    return int(root)


def _env_seconds(name):
    """Seconds from environment variable ``name`` (None when unset, empty or 0)."""
    text = os.environ.get(name, "").strip()
    if text in ("", "0"):
        return None
    try:
        return check_timeout(float(text), name)
    except ValueError:
        raise ValueError(f"{name} must be a positive number of seconds; got {text!r}") from None


def _env_flag(name):
    text = os.environ.get(name, "").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name} must be 1 or 0; got {text!r}")


_NO_WORKSPACE = np.empty(0, np.uint8)  # sliced only to length 0 by plans with tmp == 0


class _Workspace:
    """Reusable scratch memory, so calls do not allocate their workspace every time.

    A buffer is taken for the duration of one call (async calls in flight hold their
    own) and given back when it finishes. At most ``keep`` buffers are kept.
    """

    def __init__(self, keep=4):
        self._free = []
        self._keep = keep

    def take(self, count, dtype):
        if count == 0:  # most plans need none: nothing to take or give back
            return None, _NO_WORKSPACE
        nbytes = count * np.dtype(dtype).itemsize
        best = None
        for i, b in enumerate(self._free):  # the smallest free buffer that fits
            if b.size >= nbytes and (best is None or b.size < self._free[best].size):
                best = i
        buffer = self._free.pop(best) if best is not None else np.empty(nbytes, np.uint8)
        return buffer, buffer[:nbytes].view(dtype)

    def give(self, buffer):
        if buffer is None:
            return
        self._free.append(buffer)
        if len(self._free) > self._keep:
            self._free.sort(key=len)
            del self._free[0]


class Communicator:
    """Collectives over the ranks of an MPI intracommunicator.

    ``Communicator()`` uses ``MPI.COMM_WORLD``; ``Communicator(mpi_comm)`` any
    intracommunicator. Creating one is collective (it duplicates ``mpi_comm``, so the
    library's messages never match the caller's). ``segment_size`` is the default
    pipelining segment in bytes for the ``tree`` allreduce and the ``pipeline``
    broadcast (``COLLECTIVES_SEGMENT_SIZE``, else 256 KiB).

    ``algorithm="auto"`` (the default) picks per call from the collective, the buffer
    size and the world size: see :mod:`collectives.tuning` for the measured table and
    the ``COLLECTIVES_<COLLECTIVE>_ALGORITHM`` overrides.

    Every collective also takes device arrays (CuPy, torch CUDA tensors, anything with
    ``__cuda_array_interface__``): see :mod:`collectives.transport.device`. Messages on
    the device are pipelined in segments of ``device_segment_size`` bytes
    (``COLLECTIVES_DEVICE_SEGMENT_SIZE``, else 4 MiB; 0: whole messages). ``cuda_ipc``
    and ``cuda_aware`` (True/False; None: ``COLLECTIVES_CUDA_IPC``,
    ``COLLECTIVES_CUDA_AWARE``, else detected) choose how device messages move, and
    ``ipc_memory`` bounds the IPC send slots (``COLLECTIVES_IPC_MEMORY``, 256 MiB). Every
    rank passes device arrays to a call, or every rank host arrays.

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
    """

    def __init__(self, mpi_comm=None, *, segment_size=None, check=None, timeout=None, stall_warn=None,
                 device_segment_size=None, cuda_ipc=None, cuda_aware=None, ipc_memory=None, deterministic=None,
                 nodes=None):
        if mpi_comm is None:
            mpi_comm = MPI.COMM_WORLD
        if not isinstance(mpi_comm, MPI.Intracomm) or mpi_comm == MPI.COMM_NULL:
            raise TypeError(f"mpi_comm must be an mpi4py intracommunicator; got {mpi_comm!r}")
        if segment_size is None:
            segment_size = int(os.environ.get("COLLECTIVES_SEGMENT_SIZE", DEFAULT_SEGMENT_SIZE))
        self.segment_size = _check_segment_size(segment_size)
        if check is None:
            check = _env_flag("COLLECTIVES_CHECK")
        if not isinstance(check, bool):
            raise TypeError(f"check must be True or False; got {check!r}")
        self.check = check
        if deterministic is None:
            deterministic = _env_flag("COLLECTIVES_DETERMINISTIC")
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic must be True or False; got {deterministic!r}")
        self.deterministic = deterministic
        self.timeout = _env_seconds("COLLECTIVES_TIMEOUT") if timeout is None else check_timeout(timeout)
        self.stall_warn = (_env_seconds("COLLECTIVES_STALL_WARN") if stall_warn is None
                           else check_timeout(stall_warn, "stall_warn"))
        if device_segment_size is None:
            text = os.environ.get("COLLECTIVES_DEVICE_SEGMENT_SIZE", "").strip()
            if text and not text.isdigit():
                raise ValueError(f"COLLECTIVES_DEVICE_SEGMENT_SIZE must be a number of bytes; got {text!r}")
            device_segment_size = int(text) if text else DEFAULT_DEVICE_SEGMENT_SIZE
        if device_segment_size != 0:  # 0: whole messages
            _check_nbytes(device_segment_size, "device_segment_size")
        self.device_segment_size = int(device_segment_size)
        for name, value in (("cuda_ipc", cuda_ipc), ("cuda_aware", cuda_aware)):
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be True, False or None (the environment's); got {value!r}")
        if ipc_memory is not None and (isinstance(ipc_memory, bool) or not isinstance(ipc_memory, (int, np.integer))
                                       or ipc_memory < 0):
            raise ValueError(f"ipc_memory must be a non-negative number of bytes; got {ipc_memory!r}")
        self._device_options = dict(cuda_ipc=cuda_ipc, cuda_aware=cuda_aware, ipc_memory=ipc_memory)
        self._comm = mpi_comm.Dup()
        self.rank = self._comm.Get_rank()
        self.size = self._comm.Get_size()
        # The ranks that share memory with this one, asked of MPI once: the topology's
        # nodes (unless ``nodes`` says otherwise) and the shared-memory algorithms' group.
        # Made here: a blocking collective at a call's start could wait forever on an
        # absent rank, with no timeout to stop it.
        self._node_comm = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.topology = self._learn_topology(nodes)
        # A tuning table counts only if it matches every rank's machine: the ranks AND
        # their verdicts (one allreduce), so all of them choose alike.
        # On several nodes it may also measure the link between them (collective).
        # Where no table matches, it calibrates auto's cost model on these ranks (collective; cached).
        self._selector = Selector.from_environment(self.size, deterministic=deterministic, topology=self.topology,
                                                   agree=lambda bits: self._comm.allreduce(bits, op=MPI.BAND),
                                                   hint=self.rank == 0, measure_link=self._measure_link,
                                                   calibrate=self._calibrate)
        tag_ub = mpi_library.tag_ub()  # MPI_COMM_WORLD's: Open MPI gives Split's and Create's communicators none
        self._tag_limit = tag_ub  # calls are numbered mod this
        self._tags = tags.layout()  # a call's messages: its base tag plus each message's size code
        self._blocking_tag = self._tags.blocking  # the base of every blocking call that cannot time out: see _start
        self._p2p_tag_limit = tag_ub + 1  # send/recv (their own communicator): any tag MPI allows
        self._sequence = 0
        # MPI's own collectives told of a size mismatch first, where MPI would not stop on it (transport.native)
        self._native_checked = mpi_library.native_checked(native.CHECKED)
        # Where they agree first, MPI's non-blocking collectives go on a duplicate of their own, posted in call
        # order once agreed (native.Deferred); the agreements themselves on _comm, at call time.
        self._deferred = native.Deferred(mpi_comm.Dup()) if self._native_checked else None
        self._progress = Progress(Liveness(mpi_comm.Dup()), self.stall_warn)
        self._p2p_comm = mpi_comm.Dup()  # send/recv: never matched with a collective's messages
        self._workspace = _Workspace()
        self._devices = {}  # backend -> DeviceContext, made at the first call on that device
        self._fast_entries = {}  # what the lean path knows of a kind of call: see _fast_call
        self._native_starters = {}  # _native's MPI calls, made once per kind of call
        self._persistent = {}  # small blocking calls' PersistentPrograms, by plan, dtype and sizes: see _run_persistent
        # The shared-memory algorithms need every rank on this node (MPI's view, whatever
        # ``nodes`` says); the window is made at the first such call (see transport.shm).
        self._shares_memory = self._node_comm.Get_size() == self.size
        if not self._shares_memory and self.size <= liveness_module.CONNECT_UP_TO:
            # Every rank on another node, connected now (see Liveness.connect): a timed-out
            # rank's probes must not wait on a TCP connect to a host that is gone.
            node_group, group = self._node_comm.Get_group(), self._comm.Get_group()
            here = set(node_group.Translate_ranks(list(range(node_group.Get_size())), group))
            node_group.Free()
            group.Free()
            self._progress.liveness.connect([r for r in range(self.size) if r not in here])
        self.shm_slot = _slot_bytes()
        self._window = None
        self._registrations = []  # what empty() and zeros() made, in the order every rank made them
        self._registered_entries = {}  # the lean path's shm entries for registered inputs: see _registered_entry

    def __repr__(self):
        return f"<collectives.Communicator rank {self.rank} of {self.size}>"

    def _calibrate(self, fingerprint, key, link):
        """auto's cost model calibrated for these ranks (collective; see collectives.calibration),
        before any call: its messages use the blocking calls' base tag on the private communicator."""
        return calibration.obtain(self._comm, self.topology, fingerprint, key, tags.layout().blocking, link=link,
                                  link_tolerance=LINK_TOLERANCE)

    def _measure_link(self):
        """The node-to-node rate, bytes per second (collective; see ``topology.measure_link``)."""
        return topology_module.measure_link(self._comm, self.topology)

    def _learn_topology(self, nodes):
        """The node layout: MPI's (ranks that share memory), or ``nodes``, one label per
        rank, checked to be the same list on every rank (collective either way)."""
        if nodes is None:
            return topology_module.learn(self._comm, self._node_comm)
        try:
            labels = list(nodes)
            problem = None if len(labels) == self.size else f"has {len(labels)} labels for {self.size} ranks"
            hash(tuple(labels))
        except TypeError:
            labels, problem = None, "is not a sequence of hashable labels, one per rank"
        everyone = self._comm.allgather((problem, labels))  # every rank raises alike, before any call
        for rank, (their_problem, their_labels) in enumerate(everyone):
            if their_problem is not None:
                raise ValueError(f"nodes {their_problem} (on rank {rank}); got {nodes!r}")
            if their_labels != labels:
                raise ValueError(f"nodes must be the same on every rank; rank {rank} gave {their_labels!r}, "
                                 f"rank {self.rank} {labels!r}")
        return topology_module.Topology.from_labels(labels)

    def _layout_for(self, collective, algorithm):
        return self.topology if (collective, algorithm) in TOPOLOGICAL else None

    def choose(self, collective, nbytes, device=False, dtype=None):
        """``(algorithm, why)``: what ``auto`` picks for ``collective`` on ``nbytes`` bytes
        (allgather and gather: the gathered size; scatter: the root's whole buffer;
        alltoall: a rank's whole input) at this world size, and which rule decided
        (an override, a measured table, the model calibrated here, or the conservative
        rule; the last two name the machine, the MPI library and its version);
        ``device=True`` for device arrays; ``dtype`` where it matters (float16
        reductions and dtypes MPI has no type for stay off ``native``)."""
        check_algorithm(collective, "auto")
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative number of bytes; got {nbytes!r}")
        choice, why = self._selector.explain(collective, int(nbytes), bool(device))
        if (collective, choice) in SHARED_MEMORY and (device or not self._shares_memory):
            choice = self._instead_of_shared(collective, int(nbytes))
            why = f"{why}, but shm runs on host arrays of ranks that share memory: so {choice}"
        if choice == "native" and dtype is not None:
            instead = self._instead_of_native(collective, int(nbytes), np.dtype(dtype), bool(device))
            if instead is not None:
                return instead
        return choice, why

    def _instead_of_native(self, collective, nbytes, dtype, device):
        """``(algorithm, why)`` where ``auto`` must not hand ``dtype`` to MPI, else None."""
        if is_extra(dtype):
            return (cost_model_choice(collective, nbytes, self.size, own=True, topology=self.topology),
                    f"the cost model among the library's own algorithms (MPI has no type for {dtype.name})")
        if (dtype == np.float16 and not device and collective in ("allreduce", "reduce", "reduce_scatter")
                and nbytes >= FLOAT16_NATIVE_UP_TO and collective not in self._selector.overrides):
            return (cost_model_choice(collective, nbytes, self.size, own=True, topology=self.topology),
                    "the cost model among the library's own algorithms (MPI reduces float16 in slow software loops)")
        return None

    def release_memory(self):
        """Drop the scratch buffers kept between calls (they are made again when needed),
        on the host and on devices (pinned staging memory and device workspace)."""
        self._workspace = _Workspace()
        for ctx in self._devices.values():
            ctx.release_memory()

    def dup(self, *, deterministic=None):
        """A new :class:`Communicator` over the same ranks with its own private MPI
        communicator (collective), e.g. for a thread that must not share this one's
        calls in flight. It keeps this one's options, ``deterministic`` too unless given."""
        if deterministic is not None and not isinstance(deterministic, bool):
            raise TypeError(f"deterministic must be True, False or None (this communicator's); got {deterministic!r}")
        self._finish_in_flight()
        twin = Communicator(self._comm, segment_size=self.segment_size, check=self.check,
                            timeout=self.timeout or math.inf, stall_warn=self.stall_warn or math.inf,
                            device_segment_size=self.device_segment_size,
                            deterministic=self.deterministic if deterministic is None else deterministic,
                            nodes=self.topology.node_of, **self._device_options)
        twin.shm_slot = self.shm_slot
        return twin

    def empty(self, shape, dtype="float32"):
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
        its own ranks' arrays; the ``shm`` algorithms need one node."""
        shape = _check_shape(shape)
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"dtype must name a NumPy dtype; got {dtype!r}") from None
        check_dtype(dtype, "dtype")
        nbytes = math.prod(shape) * dtype.itemsize
        self._gate("empty", self.timeout, dtype=dtype, shape=shape)  # numbered; compared in check mode
        # Every rank must ask for the same: compare a digest (max and min of it) first.
        digest = zlib.crc32(f"{shape}/{dtype.str}".encode())
        agree = np.array([digest, -digest], np.int64)
        self._request("empty()", lambda: self._comm.Iallreduce(MPI.IN_PLACE, agree, MPI.MAX), self.timeout,
                      agree.nbytes)
        if agree[0] != -agree[1]:
            raise ValueError(f"shape and dtype must be the same on every rank: this rank asked for {shape} "
                             f"{dtype.name}, another rank for something else")
        registration = Registration(self._node_comm, nbytes, len(self._registrations))
        self._registrations.append(registration)
        return registration.mine.view(dtype).reshape(shape)

    def zeros(self, shape, dtype="float32"):
        """:meth:`empty`, filled with zeros (each rank writes its own array, so its memory
        is placed near it). Collective, like :meth:`empty`."""
        array = self.empty(shape, dtype)
        array[...] = 0
        return array

    def _registered(self, inp, out, inplace, collective):
        """``(registration, (stride, offset))`` in elements where ``inp`` lies in one of
        this rank's registered arrays and the call has a registered form (allreduce:
        only in place), else None."""
        if not self._registrations or collective not in REGISTERED or (collective == "allreduce" and not inplace):
            return None
        itemsize = inp.itemsize
        for registration in self._registrations:
            offset = registration.offset_of(inp)
            if offset is not None:
                if offset % itemsize:
                    return None
                return registration, (registration.stride // itemsize, offset // itemsize)
        return None

    def broadcast_object(self, obj, root=0, *, timeout=None):
        """``obj`` from ``root`` on every rank: a small picklable Python object (metadata
        such as names, shapes and hyperparameters), never array data — arrays go through
        :meth:`broadcast`. Collective; finishes this rank's calls in flight first."""
        root = _check_root(root, self.size)
        timeout = self._timeout_for(timeout)
        payload, problem = b"", None
        if self.rank == root:
            try:
                payload = pickle.dumps(obj)
            except Exception as exc:  # the other ranks must hear of it, not wait for data
                problem = exc
        self._gate("broadcast_object", timeout, root=root)
        self._finish_in_flight()
        length = np.array([len(payload) if problem is None else -1], np.int64)
        self._request("broadcast_object", lambda: self._comm.Ibcast(length, root), timeout, length.nbytes)
        if length[0] < 0:  # the same message everywhere; the root's names the cause too
            raise TypeError(f"broadcast_object: the object on rank {root} (the root) cannot be pickled") \
                from problem
        data = np.frombuffer(payload, np.uint8) if self.rank == root else np.empty(int(length[0]), np.uint8)
        self._request("broadcast_object", lambda: self._comm.Ibcast([data, MPI.BYTE], root), timeout, data.nbytes)
        return obj if self.rank == root else pickle.loads(data.tobytes())

    def free(self):
        """Release the private MPI communicators (collective). The object is unusable after."""
        if self._comm != MPI.COMM_NULL:
            if self._progress.broken is None:
                self._finish_in_flight(sends_and_receives=True)  # shared-memory calls read the window freed below
            for program in self._persistent.values():
                if program.broken:  # MPI may still match its receives: it keeps them, and their buffers
                    self._progress._abandoned.append(program)
                else:
                    program.free()
            self._persistent = {}
            for ctx in self._devices.values():
                ctx.free(self._comm.Barrier)
            self._devices = {}
            if self._window is not None and self._progress.broken is None:  # (collective: a broken job may hang in it)
                self._window.free()
            if self._progress.broken is None:
                for registration in self._registrations:
                    registration.free()
            self._registrations, self._registered_entries = [], {}
            if self._node_comm is not None:
                self._node_comm.Free()
            self._comm.Free()
            self._p2p_comm.Free()
            if self._deferred is not None:
                self._deferred.comm.Free()
            self._progress.liveness.free()

    # -- collectives ------------------------------------------------------------
    # Each blocking call is its *_async call followed by wait(), except that a call
    # that resolves to ``native`` calls MPI's blocking collective (the cheapest path
    # for tiny buffers), after finishing the calls this rank has in flight.
    def allreduce(self, x, op="sum", algorithm="auto", out=None, *, segment_size=None, timeout=None):
        """Reduce ``x`` elementwise over all ranks; every rank gets the result (shaped like
        ``x``; ``out=x`` works in place). Every rank's result has the same bits.
        ``timeout``: seconds (see :class:`Communicator`); every collective takes it."""
        if timeout is None and segment_size is None and type(x) is np.ndarray and type(algorithm) is str:
            result = self._fast_call("allreduce", algorithm, x, out, op, 0)
            if result is not _NOT_HANDLED:
                return result
        return self._allreduce(x, op, algorithm, out, segment_size, timeout, True)

    def allreduce_async(self, x, op="sum", algorithm="auto", out=None, *, segment_size=None, timeout=None):
        """Start :meth:`allreduce`; returns a :class:`~collectives.Handle` whose ``wait()``
        returns the result (``timeout`` becomes the default of ``wait``). So do all
        ``*_async`` calls."""
        return self._allreduce(x, op, algorithm, out, segment_size, timeout, False)

    def _allreduce(self, x, op, algorithm, out, segment_size, timeout, blocking):
        x = as_array(x, "x")
        ops.check_op(op, x.dtype)
        algorithm = check_algorithm("allreduce", algorithm)
        if out is not None:
            out = check_out(out, x.shape, x.dtype, like=x)
        if segment_size is not None:
            _check_segment_size(segment_size)
        timeout = self._timeout_for(timeout)
        algorithm = self._resolve("allreduce", algorithm, x.nbytes, x.dtype, isinstance(x, DeviceArray))
        self._gate("allreduce", timeout, algorithm, op, x.dtype, x.shape, blocking=blocking, memory=x)
        if isinstance(x, DeviceArray):
            return self._device_call("allreduce", algorithm, x, out, x.shape, op, 0, segment_size, timeout, blocking)
        if algorithm == "native" and blocking and self._mpi_blocks(timeout):
            result = self._native_now("allreduce", x, out, x.shape, op)
            if result is not _NOT_HANDLED:
                return result
        inp, result, inplace, unpack = _prepare(x, out, x.shape)

        def finish():
            ops.finish(op, result, self.size)
            return unpack()

        return self._start("allreduce", algorithm, x.size, inp, result, inplace, op, 0, segment_size, finish, blocking,
                           timeout)

    def reduce_scatter(self, x, op="sum", algorithm="auto", out=None, *, timeout=None):
        """Reduce ``x`` over all ranks and return block ``rank`` of the result, the blocks
        cut from ``x.ravel()`` as ``numpy.array_split(x.ravel(), size)`` cuts them."""
        return self._reduce_scatter(x, op, algorithm, out, timeout, True)

    def reduce_scatter_async(self, x, op="sum", algorithm="auto", out=None, *, timeout=None):
        return self._reduce_scatter(x, op, algorithm, out, timeout, False)

    def _reduce_scatter(self, x, op, algorithm, out, timeout, blocking):
        x = as_array(x, "x")
        ops.check_op(op, x.dtype)
        algorithm = check_algorithm("reduce_scatter", algorithm)
        bounds = block_bounds(x.size, self.size)
        shape = (bounds[self.rank + 1] - bounds[self.rank],)
        if out is not None:
            out = check_out(out, shape, x.dtype, like=x)
        timeout = self._timeout_for(timeout)
        algorithm = self._resolve("reduce_scatter", algorithm, x.nbytes, x.dtype, isinstance(x, DeviceArray))
        self._gate("reduce_scatter", timeout, algorithm, op, x.dtype, x.shape, blocking=blocking, memory=x)
        counts = [bounds[r + 1] - bounds[r] for r in range(self.size)]
        if isinstance(x, DeviceArray):
            return self._device_call("reduce_scatter", algorithm, x, out, shape, op, 0, None, timeout, blocking,
                                     counts)
        if algorithm == "native" and blocking and self._mpi_blocks(timeout):
            result = self._native_now("reduce_scatter", x, out, shape, op, counts=counts)
            if result is not _NOT_HANDLED:
                return result
        inp, result, _, unpack = _prepare(x, out, shape, allow_inplace=False)

        def finish():
            ops.finish(op, result, self.size)
            return unpack()

        return self._start("reduce_scatter", algorithm, x.size, inp, result, False, op, 0, None, finish, blocking,
                           timeout, counts)

    def allgather(self, x, algorithm="auto", out=None, *, timeout=None):
        """Gather ``x`` from every rank: returns shape ``(size, *x.shape)``, row r from rank r."""
        if timeout is None and type(x) is np.ndarray and type(algorithm) is str:
            result = self._fast_call("allgather", algorithm, x, out, "-", 0)
            if result is not _NOT_HANDLED:
                return result
        return self._allgather(x, algorithm, out, timeout, True)

    def allgather_async(self, x, algorithm="auto", out=None, *, timeout=None):
        return self._allgather(x, algorithm, out, timeout, False)

    def _allgather(self, x, algorithm, out, timeout, blocking):
        x = as_array(x, "x")
        algorithm = check_algorithm("allgather", algorithm)
        shape = (self.size,) + x.shape
        if out is not None:
            out = check_out(out, shape, x.dtype, like=x)
        timeout = self._timeout_for(timeout)
        algorithm = self._resolve("allgather", algorithm, x.nbytes * self.size, x.dtype,
                                  isinstance(x, DeviceArray))
        self._gate("allgather", timeout, algorithm, "-", x.dtype, x.shape, blocking=blocking, memory=x)
        if isinstance(x, DeviceArray):
            return self._device_call("allgather", algorithm, x, out, shape, "sum", 0, None, timeout, blocking)
        if algorithm == "native" and blocking and self._mpi_blocks(timeout):
            result = self._native_now("allgather", x, out, shape)
            if result is not _NOT_HANDLED:
                return result
        inp, result, _, unpack = _prepare(x, out, shape, allow_inplace=False)
        return self._start("allgather", algorithm, x.size, inp, result, False, "sum", 0, None, unpack, blocking,
                           timeout)

    def broadcast(self, x, root=0, algorithm="auto", *, segment_size=None, timeout=None):
        """Fill ``x`` on every rank with ``x`` from ``root``, in place; returns ``x``."""
        if timeout is None and segment_size is None and type(x) is np.ndarray and type(algorithm) is str:
            result = self._fast_call("broadcast", algorithm, x, None, "-", root)
            if result is not _NOT_HANDLED:
                return result
        return self._broadcast(x, root, algorithm, segment_size, timeout, True)

    def broadcast_async(self, x, root=0, algorithm="auto", *, segment_size=None, timeout=None):
        return self._broadcast(x, root, algorithm, segment_size, timeout, False)

    def _broadcast(self, x, root, algorithm, segment_size, timeout, blocking):
        x = as_array(x, "x")
        root = _check_root(root, self.size)
        algorithm = check_algorithm("broadcast", algorithm)
        if not isinstance(x, DeviceArray) and (not isinstance(x, np.ndarray) or not x.flags.writeable):
            raise ValueError("x must be a writable array: broadcast fills it in place")
        if segment_size is not None:
            _check_segment_size(segment_size)
        timeout = self._timeout_for(timeout)
        algorithm = self._resolve("broadcast", algorithm, x.nbytes, x.dtype, isinstance(x, DeviceArray))
        self._gate("broadcast", timeout, algorithm, "-", x.dtype, x.shape, root, blocking, memory=x)
        if isinstance(x, DeviceArray):
            return self._device_call("broadcast", algorithm, x, None, x.shape, "sum", root, segment_size, timeout,
                                     blocking)
        if algorithm == "native" and blocking and self._mpi_blocks(timeout):
            result = self._native_now("broadcast", x, None, x.shape, root=root)
            if result is not _NOT_HANDLED:
                return result
        _, result, _, unpack = _prepare(x, x, x.shape)
        return self._start("broadcast", algorithm, x.size, result, result, True, "sum", root, segment_size, unpack,
                           blocking, timeout)

    def reduce(self, x, root=0, op="sum", algorithm="auto", out=None, *, timeout=None):
        """Reduce ``x`` over all ranks onto ``root``: the result on root (``out=x`` works
        in place there), ``None`` on the other ranks (whose ``out`` is left alone)."""
        if timeout is None and type(x) is np.ndarray and type(algorithm) is str:
            result = self._fast_call("reduce", algorithm, x, out, op, root)
            if result is not _NOT_HANDLED:
                return result
        return self._reduce(x, root, op, algorithm, out, timeout, True)

    def reduce_async(self, x, root=0, op="sum", algorithm="auto", out=None, *, timeout=None):
        return self._reduce(x, root, op, algorithm, out, timeout, False)

    def _reduce(self, x, root, op, algorithm, out, timeout, blocking):
        x = as_array(x, "x")
        root = _check_root(root, self.size)
        ops.check_op(op, x.dtype)
        algorithm = check_algorithm("reduce", algorithm)
        if out is not None:
            out = check_out(out, x.shape, x.dtype, like=x)
        timeout = self._timeout_for(timeout)
        algorithm = self._resolve("reduce", algorithm, x.nbytes, x.dtype, isinstance(x, DeviceArray))
        self._gate("reduce", timeout, algorithm, op, x.dtype, x.shape, root, blocking, memory=x)
        if isinstance(x, DeviceArray):
            return self._device_call("reduce", algorithm, x, out, x.shape, op, root, None, timeout, blocking)
        if algorithm == "native" and blocking and self._mpi_blocks(timeout):
            result = self._native_now("reduce", x, out, x.shape, op, root)
            if result is not _NOT_HANDLED:
                return result
        if self.rank != root:
            inp = flat_input(x)
            return self._start("reduce", algorithm, x.size, inp, inp[:0], False, op, root, None, _nothing, blocking,
                               timeout)
        inp, result, inplace, unpack = _prepare(x, out, x.shape)

        def finish():
            ops.finish(op, result, self.size)
            return unpack()

        return self._start("reduce", algorithm, x.size, inp, result, inplace, op, root, None, finish, blocking,
                           timeout)

    def gather(self, x, root=0, algorithm="auto", out=None, *, timeout=None):
        """Gather ``x`` from every rank onto ``root``: there, shape ``(size, *x.shape)``,
        row r from rank r; ``None`` on the other ranks (whose ``out`` is left alone).
        Every rank's ``x`` has the same shape and dtype."""
        return self._gather(x, root, algorithm, out, timeout, True)

    def gather_async(self, x, root=0, algorithm="auto", out=None, *, timeout=None):
        return self._gather(x, root, algorithm, out, timeout, False)

    def _gather(self, x, root, algorithm, out, timeout, blocking):
        x = as_array(x, "x")
        root = _check_root(root, self.size)
        algorithm = check_algorithm("gather", algorithm)
        shape = (self.size,) + x.shape
        if out is not None and self.rank == root:
            out = check_out(out, shape, x.dtype, like=x)
        else:
            out = None
        timeout = self._timeout_for(timeout)
        algorithm = self._resolve("gather", algorithm, x.nbytes * self.size, x.dtype, isinstance(x, DeviceArray))
        self._gate("gather", timeout, algorithm, "-", x.dtype, x.shape, root, blocking, memory=x)
        if isinstance(x, DeviceArray):
            return self._device_call("gather", algorithm, x, out, shape, "sum", root, None, timeout, blocking)
        if algorithm == "native" and blocking and self._mpi_blocks(timeout):
            result = self._native_now("gather", x, out, shape, root=root)
            if result is not _NOT_HANDLED:
                return result
        if self.rank != root:
            inp = flat_input(x)
            return self._start("gather", algorithm, x.size, inp, inp[:0], False, "sum", root, None, _nothing,
                               blocking, timeout)
        inp, result, _, unpack = _prepare(x, out, shape, allow_inplace=False)
        return self._start("gather", algorithm, x.size, inp, result, False, "sum", root, None, unpack, blocking,
                           timeout)

    def scatter(self, x, root=0, algorithm="auto", out=None, *, timeout=None):
        """Row ``rank`` of ``x`` on ``root`` (shape ``(size, *s)``), on every rank: returns
        an array of shape ``s`` (or ``out``). The other ranks' ``x`` only gives the shape
        and dtype (its contents are not read): pass the same shape, or ``x=None`` with
        ``out`` of shape ``s``."""
        return self._scatter(x, root, algorithm, out, timeout, True)

    def scatter_async(self, x, root=0, algorithm="auto", out=None, *, timeout=None):
        return self._scatter(x, root, algorithm, out, timeout, False)

    def _scatter(self, x, root, algorithm, out, timeout, blocking):
        root = _check_root(root, self.size)
        algorithm = check_algorithm("scatter", algorithm)
        if x is None and self.rank == root:
            raise ValueError(f"x must be an array on the root (rank {root}): its rows are scattered; got None")
        if x is None and out is None:
            raise ValueError("x is None: pass out, the array of shape s that receives this rank's row")
        if x is None:  # out alone says the row's shape and dtype: an array, not a list to convert
            if not isinstance(out, np.ndarray) and not is_device(out):
                raise TypeError(f"out must be a numpy.ndarray or a device array; got {type(out).__name__}")
            out = as_array(out, "out")
            x, shape, where = None, out.shape, out
        else:
            x = as_array(x, "x")
            if x.ndim == 0 or x.shape[0] != self.size:
                raise ValueError(f"x must have shape (size, *s) = ({self.size}, ...), one row per rank; got {x.shape}")
            shape, where = x.shape[1:], x
        if out is not None:
            out = check_out(out, shape, where.dtype, like=where)
        timeout = self._timeout_for(timeout)
        count = math.prod(shape)
        algorithm = self._resolve("scatter", algorithm, count * self.size * where.itemsize, where.dtype,
                                  isinstance(where, DeviceArray))
        self._gate("scatter", timeout, algorithm, "-", where.dtype, shape, root, blocking, memory=where)
        if isinstance(where, DeviceArray):
            return self._device_call("scatter", algorithm, x if x is not None else out, out, shape, "sum", root,
                                     None, timeout, blocking)
        if algorithm == "native" and blocking and self._mpi_blocks(timeout):
            mine = x if self.rank == root else np.empty(0, where.dtype)  # the other ranks' x is not read
            result = self._native_now("scatter", mine, out, shape, root=root)
            if result is not _NOT_HANDLED:
                return result
        target = np.empty(shape, where.dtype) if out is None else out
        _, result, _, unpack = _prepare(target, target, shape)  # packed and written back if strided
        if self.rank != root:
            inp = result[:0]  # nothing is read here
        else:
            inp = flat_input(x)
            if overlaps(x, target):  # out inside x: the root's own row lands in it early
                inp = inp.copy()
        return self._start("scatter", algorithm, count, inp, result, False, "sum", root, None, unpack, blocking,
                           timeout)

    def alltoall(self, x, algorithm="auto", out=None, *, timeout=None):
        """Row j of ``x`` (shape ``(size, *s)``) to rank j: returns shape ``(size, *s)``,
        row i from rank i (``MPI_Alltoall``, torch's ``all_to_all_single`` with equal
        splits). Every rank's ``x`` has the same shape and dtype."""
        return self._alltoall(x, algorithm, out, timeout, True)

    def alltoall_async(self, x, algorithm="auto", out=None, *, timeout=None):
        return self._alltoall(x, algorithm, out, timeout, False)

    def _alltoall(self, x, algorithm, out, timeout, blocking):
        x = as_array(x, "x")
        algorithm = check_algorithm("alltoall", algorithm)
        if x.ndim == 0 or x.shape[0] != self.size:
            raise ValueError(f"x must have shape (size, *s) = ({self.size}, ...), one row per rank; got {x.shape}")
        if out is not None:
            out = check_out(out, x.shape, x.dtype, like=x)
        timeout = self._timeout_for(timeout)
        algorithm = self._resolve("alltoall", algorithm, x.nbytes, x.dtype, isinstance(x, DeviceArray))
        self._gate("alltoall", timeout, algorithm, "-", x.dtype, x.shape, blocking=blocking, memory=x)
        if isinstance(x, DeviceArray):
            return self._device_call("alltoall", algorithm, x, out, x.shape, "sum", 0, None, timeout, blocking)
        if algorithm == "native" and blocking and self._mpi_blocks(timeout):
            result = self._native_now("alltoall", x, out, x.shape)
            if result is not _NOT_HANDLED:
                return result
        inp, result, _, unpack = _prepare(x, out, x.shape, allow_inplace=False)
        return self._start("alltoall", algorithm, x.size // self.size, inp, result, False, "sum", 0, None, unpack,
                           blocking, timeout)

    def alltoallv(self, x, send_counts, recv_counts=None, algorithm="auto", out=None, *, timeout=None):
        """Rows of ``x`` (shape ``(n, *s)``) to every rank, a different number to each
        (``MPI_Alltoallv``; torch's ``all_to_all_single`` with split sizes): the first
        ``send_counts[0]`` rows go to rank 0, the next ``send_counts[1]`` to rank 1, and
        so on (they add up to n). Returns shape ``(sum(recv_counts), *s)``: the rows from
        rank 0 first, then rank 1's, and so on. ``recv_counts[i]`` must equal rank i's
        ``send_counts[rank]``; with ``None`` the ranks learn them from each other (one
        MPI_Alltoall of the counts, waited for before the call returns, async or not).
        Every rank's rows have the same shape ``s`` and dtype. In check mode the ranks
        also compare the counts and all raise if any pair disagrees."""
        return self._alltoallv(x, send_counts, recv_counts, algorithm, out, timeout, True)

    def alltoallv_async(self, x, send_counts, recv_counts=None, algorithm="auto", out=None, *, timeout=None):
        return self._alltoallv(x, send_counts, recv_counts, algorithm, out, timeout, False)

    def _alltoallv(self, x, send_counts, recv_counts, algorithm, out, timeout, blocking):
        x = as_array(x, "x")
        algorithm = check_algorithm("alltoallv", algorithm)
        if x.ndim == 0:
            raise ValueError("x must have shape (n, *s): its rows are sent; got a 0-d array")
        send = _check_counts(send_counts, "send_counts", self.size)
        if sum(send) != x.shape[0]:
            raise ValueError(f"send_counts must add up to the rows of x ({x.shape[0]}); they add up to {sum(send)}")
        recv = None
        if recv_counts is not None:
            recv = _check_counts(recv_counts, "recv_counts", self.size)
            if recv[self.rank] != send[self.rank]:
                raise ValueError(f"recv_counts[{self.rank}] must equal send_counts[{self.rank}], the rows this rank "
                                 f"sends itself; got {recv[self.rank]} and {send[self.rank]}")
        row = x.shape[1:]
        if out is not None:  # with recv_counts=None, its number of rows is checked once the counts are known
            if recv is None and getattr(out, "ndim", 1) == 0:
                raise ValueError(f"out must have shape (rows, *s) with s = {row}; got a 0-d array")
            rows = sum(recv) if recv is not None else getattr(out, "shape", (0,))[0]
            out = check_out(out, (rows,) + row, x.dtype, like=x)
        timeout = self._timeout_for(timeout)
        # Every rank must pick the same algorithm, and their input sizes differ: the
        # rule for alltoallv does not look at the size.
        algorithm = self._resolve("alltoallv", algorithm, x.nbytes, x.dtype, isinstance(x, DeviceArray))
        self._gate("alltoallv", timeout, algorithm, "-", x.dtype, row, blocking=blocking, memory=x)
        if recv is None or self.check:
            recv = self._exchange_counts(send, recv, out, timeout)
        shape = (sum(recv),) + row
        size_of_row = math.prod(row)
        counts = (tuple(n * size_of_row for n in send), tuple(n * size_of_row for n in recv))
        if isinstance(x, DeviceArray):
            return self._device_call("alltoallv", algorithm, x, out, shape, "sum", 0, None, timeout, blocking, counts)
        if algorithm == "native" and blocking and self._mpi_blocks(timeout):
            result = self._native_now("alltoallv", x, out, shape, counts=counts)
            if result is not _NOT_HANDLED:
                return result
        inp, result, _, unpack = _prepare(x, out, shape, allow_inplace=False)
        return self._start("alltoallv", algorithm, 0, inp, result, False, "sum", 0, None, unpack, blocking, timeout,
                           counts)

    def _exchange_counts(self, send, recv, out, timeout):
        """alltoallv's receive counts, from every rank's ``send``: exchanged (one
        MPI_Alltoall), then, where a rank could find a problem the others cannot see (its
        ``recv`` disagrees with them, its ``out`` has the wrong number of rows), agreed on
        (one allgather) so that every rank raises before any data moves."""
        theirs = np.empty(self.size, np.int64)
        mine = np.array(send, np.int64)
        self._request("alltoallv's exchange of counts", lambda: self._comm.Ialltoall(mine, theirs), timeout,
                      theirs.nbytes)
        learned = tuple(int(n) for n in theirs)
        if not (self.check or out is not None):
            return learned
        problem = np.full(3, -1, np.int64)  # (peer, rows it sends, rows expected) or (-2, rows, out's rows)
        if recv is not None and recv != learned:
            peer = next(i for i in range(self.size) if recv[i] != learned[i])
            problem[:] = (peer, learned[peer], recv[peer])
        elif out is not None and out.shape[0] != sum(learned):
            problem[:] = (-2, sum(learned), out.shape[0])
        problems = np.empty((self.size, 3), np.int64)
        self._request("alltoallv's agreement on counts", lambda: self._comm.Iallgather(problem, problems), timeout,
                      problems.nbytes)
        for rank, (peer, sent, expected) in enumerate(problems.tolist()):
            if peer >= 0:
                raise CollectiveMismatchError(
                    f"alltoallv: rank {rank} expects {expected} rows from rank {peer} (its recv_counts[{peer}]), "
                    f"but rank {peer} sends it {sent} (its send_counts[{rank}])")
            if peer == -2:
                message = (f"out on rank {rank} must have {sent} rows (the sum of what the ranks send it); "
                           f"got {expected}")
                if rank == self.rank:
                    raise ValueError(message)
                raise CollectiveError(f"alltoallv: no data moved, since {message}")
        return learned

    # -- point to point ----------------------------------------------------------------
    def send(self, x, dst, tag=0, *, timeout=None):
        """Send ``x`` to rank ``dst``; returns once ``x`` may be changed again. Not
        collective: ``dst`` alone takes part, with a :meth:`recv` of the same ``tag`` into
        an array of the same size in bytes. Messages from one rank to another with one
        tag arrive in the order they were sent. They travel on a private MPI
        communicator, apart from every collective's messages and the caller's own.
        ``timeout`` as for collectives (the communicator is broken after it)."""
        handle = self._send(x, dst, tag, timeout, blocking=True)
        return handle.wait()

    def send_async(self, x, dst, tag=0, *, timeout=None):
        """Start :meth:`send`: returns a :class:`~collectives.Handle` (``wait()`` gives
        None). Leave ``x`` alone until it has finished. A message to this rank itself
        is allowed here (with a :meth:`recv_async` to match it), not in :meth:`send`."""
        return self._send(x, dst, tag, timeout, blocking=False)

    def recv(self, out, src=None, tag=0, *, timeout=None):
        """Receive a message from rank ``src`` (None: any rank) with ``tag`` into ``out``
        (an array of exactly the message's size in bytes, any shape; filled in place) and
        return ``out``. A message of another size raises
        :class:`~collectives.MessageSizeError`. To learn which rank a message from any
        rank came from, use :meth:`recv_async`: its handle's ``source``."""
        return self._recv(out, src, tag, timeout, blocking=True).wait()

    def recv_async(self, out, src=None, tag=0, *, timeout=None):
        """Start :meth:`recv`: returns a handle whose ``wait()`` gives ``out`` and whose
        ``source`` is then the sending rank."""
        return self._recv(out, src, tag, timeout, blocking=False)

    def _check_peer(self, peer, name, blocking, any_rank=False):
        if peer is None and any_rank:
            return None
        if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.size:
            allowed = " or None (any rank)" if any_rank else ""
            raise ValueError(f"{name} must be a rank in 0..{self.size - 1}{allowed}; got {peer!r}")
        if blocking and peer == self.rank:
            raise ValueError(f"{name} is this rank ({peer}): a blocking message to itself could only wait forever; "
                             "use send_async and recv_async")
        return int(peer)

    def _check_tag(self, tag):
        if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= tag < self._p2p_tag_limit:
            raise ValueError(f"tag must be an integer in 0..{self._p2p_tag_limit - 1}; got {tag!r}")
        return int(tag)

    def _p2p_open(self, what):
        if self._progress.broken is not None:
            raise CollectiveError(f"{what}: this communicator is broken by an earlier failure "
                                  f"({self._progress.broken}); make a new Communicator")

    def _send(self, x, dst, tag, timeout, blocking):

        x = as_array(x, "x")
        dst = self._check_peer(dst, "dst", blocking)
        tag = self._check_tag(tag)
        timeout = self._timeout_for(timeout)
        describe = f"send to rank {dst} (tag {tag})"
        self._p2p_open(describe)
        payload = p2p.device_to_host(x) if isinstance(x, DeviceArray) else p2p.as_bytes(x)
        handle = p2p.PointHandle(self._progress, describe, _nothing,
                                 lambda: self._p2p_comm.Isend([payload, MPI.BYTE], dst, tag), dst, tag, payload.nbytes,
                                 False, timeout, self._sequence)
        return handle.start()

    def _recv(self, out, src, tag, timeout, blocking):

        if out is None:
            raise ValueError("out must be the array that receives the message; got None")
        if not isinstance(out, np.ndarray) and not is_device(out):
            raise TypeError(f"out must be a numpy.ndarray or a device array; got {type(out).__name__}")
        target = as_array(out, "out")
        if not isinstance(target, DeviceArray) and not target.flags.writeable:
            raise ValueError("out must be writable: the message is received into it")
        src = self._check_peer(src, "src", blocking, any_rank=True)
        tag = self._check_tag(tag)
        timeout = self._timeout_for(timeout)
        describe = f"recv from {'any rank' if src is None else f'rank {src}'} (tag {tag})"
        self._p2p_open(describe)
        if isinstance(target, DeviceArray):
            landing = np.empty(0, np.uint8) if not target.nbytes else target.backend.pinned(target.nbytes)

            def finish():
                p2p.host_to_device(landing, target)
                return out
        elif target.flags.c_contiguous:
            landing, finish = p2p.as_bytes(target), lambda: out
        else:
            staged = np.empty(target.shape, target.dtype)
            landing = p2p.as_bytes(staged)

            def finish():
                target[...] = staged
                return out
        source = MPI.ANY_SOURCE if src is None else src
        handle = p2p.PointHandle(self._progress, describe, finish,
                                 lambda: self._p2p_comm.Irecv([landing, MPI.BYTE], source, tag), src, tag,
                                 landing.nbytes, True, timeout, self._sequence)
        return handle.start()

    def poll(self):
        """Advance this communicator's calls in flight without blocking, as far as their
        messages allow now (each finished message posts the next step's), and return how
        many calls are still in flight. Call it between pieces of other work to overlap
        async collectives with it: the library's messages move only when it is called
        (or ``test``/``wait``). Raises, and breaks the communicator, if a call in flight
        fails here or another rank reports that its call failed."""
        self._progress.drain()
        return len(self._progress.active)

    def barrier(self, *, timeout=None):
        """Block until every rank has called ``barrier`` (collectives in flight go on)."""
        timeout = self._timeout_for(timeout)
        self._gate("barrier", timeout)
        self._request("barrier", self._comm.Ibarrier, timeout)

    # -- machinery ----------------------------------------------------------------
    def _mpi_blocks(self, timeout):
        """Whether a blocking ``native`` call may be MPI's blocking collective: not when
        it must be able to stop (a timeout) or to warn while it waits (``stall_warn``)."""
        return timeout is None and self.stall_warn is None

    def _timeout_for(self, timeout):
        """A call's timeout in seconds (None: none): its own, else the communicator's."""
        return self.timeout if timeout is None else check_timeout(timeout)

    def _gate(self, collective, timeout, algorithm="-", op="-", dtype=None, shape=(), root=-1, blocking=True,
              memory=None):
        """Every call passes here once, after its arguments are checked and before any
        message: it gets its sequence number; a broken communicator refuses it; in check
        mode the ranks compare fingerprints and all raise if they differ."""
        if self._progress.broken is not None:
            raise CollectiveError(f"{collective}: this communicator is broken by an earlier failure "
                                  f"({self._progress.broken}); make a new Communicator, though after a timeout "
                                  "the job usually has to stop")
        self._sequence = (self._sequence + 1) % self._tag_limit  # its tags: self._tags.call(self._sequence)
        self._progress.call = self._sequence
        if len(self._progress.active) >= self._tags.calls - 2:  # its base tag would be a call's in flight
            self._finish_in_flight()
        if self.check:
            alone = blocking and self._mpi_blocks(timeout)
            if algorithm == "native":
                how = "MPI blocking" if alone else "MPI non-blocking"
            elif algorithm == "-" or (collective, algorithm) in SHARED_MEMORY or isinstance(memory, DeviceArray):
                how = "-"  # no tag of its own to agree on (fences, or the device executor's call tags)
            else:
                how = "alone (blocking)" if alone else "among calls in flight"
            kind = "-" if memory is None else memory.backend.kind if isinstance(memory, DeviceArray) else "host"
            order = "-" if op == "-" else "rank order (deterministic)" if self.deterministic else "any"
            record = check_mode.fingerprint(self._sequence, collective, algorithm, op, dtype, shape, root, how, kind,
                                            order)
            gathered = np.empty((self.size, record.size), record.dtype)
            self._request(f"the check-mode exchange before {collective}",
                          lambda: self._comm.Iallgather(record, gathered), timeout, gathered.nbytes)
            check_mode.compare(gathered)

    def _request(self, what, start, timeout, nbytes=0):
        """Run one MPI non-blocking call to completion, bounded by ``timeout``."""
        describe = f"{what} call #{self._sequence}"
        RequestHandle(self._progress, describe, _nothing, start, timeout, self._sequence, nbytes).start().wait()

    def _segment(self, segment_size, itemsize):
        return max(1, (self.segment_size if segment_size is None else segment_size) // itemsize)

    def _resolve(self, collective, algorithm, nbytes, dtype, device=False):
        if algorithm != "auto" and self.deterministic:
            check_ordered(collective, algorithm)
        if (collective, algorithm) in SHARED_MEMORY:
            self._check_shared_memory(algorithm, device)
        if algorithm == "native" and is_extra(dtype):
            raise ValueError(f"algorithm 'native' cannot move {dtype.name} (the MPI library has no type for it); "
                             "use one of the library's algorithms or 'auto'")
        if algorithm != "auto":
            return algorithm
        chosen = self._selector.choose(collective, nbytes, device)
        if (collective, chosen) in SHARED_MEMORY and (device or not self._shares_memory):
            if collective in self._selector.overrides:  # COLLECTIVES_<COLLECTIVE>_ALGORITHM names it
                self._check_shared_memory(chosen, device)
            chosen = self._instead_of_shared(collective, nbytes)  # a table measured where memory was shared
        if chosen == "native":
            instead = self._instead_of_native(collective, nbytes, dtype, device)
            if instead is not None:
                return instead[0]
        return chosen

    def _instead_of_shared(self, collective, nbytes):
        """What ``auto`` picks where its table names ``shm`` but this call cannot run it."""
        if self.deterministic and collective in ORDERED:
            return ORDERED[collective][0]
        return cost_model_choice(collective, nbytes, self.size, topology=self.topology)

    def _check_shared_memory(self, algorithm, device):
        if device:
            raise ValueError(f"algorithm {algorithm!r} runs on host arrays only (it reduces in a shared window of "
                             "host memory); for device arrays use another algorithm or 'auto'")
        if not self._shares_memory:
            raise ValueError(f"algorithm {algorithm!r} needs every rank on one node (ranks that share memory); "
                             f"this communicator spans {self.topology.describe()}: use 'hierarchical' or 'auto'")

    def _window_for(self, nbytes, timeout, signature, describe):
        """The node's shared window, holding ``nbytes`` of data (made or grown here:
        collective; the ranks agree on the size first, within ``timeout``). Before it
        grows, the ranks pass a fence signed with the call's ``signature``: a rank whose
        call differs (in size, say, and fits the window as it is) meets it at its own
        first fence, and both raise there instead of waiting for each other."""
        window = self._window
        if window is not None and nbytes <= window.capacity:
            return window
        self._finish_in_flight()  # nothing may use the old window, nor wait on this rank meanwhile
        if window is None:  # the first call on it: nothing to sign yet, only the size to agree on
            window = self._window = NodeWindow(self._node_comm)
        else:
            grow = ShmCall(window, _GROW_PLAN, *([np.empty(0, np.uint8)] * 3), "-", signature, describe)
            ShmHandle(self._progress, describe, _nothing, grow, timeout, self._sequence).start().wait()
        need = np.array([nbytes], np.int64)
        self._request("the shared window's set-up",
                      lambda: self._node_comm.Iallreduce(MPI.IN_PLACE, need, MPI.MAX), timeout, need.nbytes)
        window.ensure(int(need[0]))
        return window

    def _start_shared(self, collective, algorithm, count, inp, out, inplace, op, root, finish, blocking, timeout,
                      describe):
        """Run a shared-memory algorithm's call (see ``transport.shm``)."""
        registration, plan, code = self._shm_plan(collective, algorithm, count, root, inplace, inp.dtype, op,
                                                  self._registered(inp, out, inplace, collective))
        signature = (self._sequence, code, inp.nbytes, root)
        window = (self._window_for(plan.shm * inp.itemsize, timeout, signature, describe) if _needs_window(plan)
                  else None)
        raw, tmp = self._workspace.take(plan.tmp, inp.dtype)

        def done():
            self._workspace.give(raw)
            return finish()

        call = ShmCall(window, plan, inp, out, tmp, op, signature, describe, registration)
        handle = ShmHandle(self._progress, describe, done, call, timeout, self._sequence).start()
        return handle.wait() if blocking else handle

    def _shm_plan(self, collective, algorithm, count, root, inplace, dtype, op, found=None):
        """``(registration, plan, call code)`` of a shared-memory call; ``found``: what
        :meth:`_registered` says of its input (None: a plain one)."""
        registration, registered = found or (None, None)
        plan = _plan(collective, algorithm, self.rank, self.size, count, root, max(1, self.shm_slot // dtype.itemsize),
                     inplace, self.deterministic, registered=registered)
        code = _call_code(collective, algorithm, dtype, op, self.shm_slot,
                          registered and (registration.number, registered[1]))
        return registration, plan, code

    def _registered_entry(self, entry, x, out, inplace):
        """The lean path's shm ``entry`` for a call whose input may be a registered
        buffer: ``entry`` itself where it is not, else one with the registered plan, call
        code and registration (kept per kind of call, registration and offset)."""
        name, collective, (count, root, op) = entry[2], entry[4], entry[6]
        found = self._registered(x, out, inplace, collective)
        if found is None:
            return entry
        key = (collective, name, x.dtype, count, root, inplace, op, self.shm_slot, self.deterministic,
               found[0].number, found[1])
        made = self._registered_entries.get(key)
        if made is None:
            if len(self._registered_entries) > 256:
                self._registered_entries.clear()
            registration, plan, code = self._shm_plan(collective, name, count, root, inplace, x.dtype, op, found)
            made = self._registered_entries[key] = ("shm", plan, name, code, collective, registration, entry[6])
        return made

    def _run_shared_now(self, entry, x, inp, result, op, root):
        """A blocking shared-memory call on the lean path (``entry`` from
        ``_fast_entry``), run to its end here; on any failure the engine breaks as on
        the general path."""
        _, plan, name, code, _, registration = entry[:6]
        raw, tmp = self._workspace.take(plan.tmp, x.dtype)
        describe = f"{entry[4]}(algorithm={name!r}) call #{self._sequence}"
        call = ShmCall(self._window, plan, inp, result, tmp, op, (self._sequence, code, x.nbytes, root), describe,
                       registration)
        self._breaking_on_failure(lambda: call.run(lambda: self._lean_look(describe)), lambda: describe)
        self._workspace.give(raw)

    def _start(self, collective, algorithm, count, inp, out, inplace, op, root, segment_size, finish, blocking,
               timeout, counts=None):
        """Run the call: returns its result if ``blocking``, else its :class:`Handle`.
        ``segment_size`` (bytes, None for the communicator's) matters to segmented
        algorithms only. A blocking ``native`` call without a timeout is MPI's blocking
        collective; with one, MPI's non-blocking collective, waited for up to it."""
        describe = f"{collective}(algorithm={algorithm!r}) call #{self._sequence}"
        if algorithm == "native":
            if blocking and self._mpi_blocks(timeout):
                self._native_blocking(collective, inp, out, inplace, op, root, counts)
                return finish()
            start = lambda: self._native(collective, inp, out, inplace, op, root, counts)  # noqa: E731
            if collective in self._native_checked:  # the ranks agree on the size first
                handle = native.AgreedHandle(
                    self._progress, describe, finish, self._comm, self._deferred, native.unit(collective, inp, out),
                    lambda comm: self._native(collective, inp, out, inplace, op, root, counts, comm=comm), timeout,
                    self._sequence, inp.nbytes)
            else:
                handle = RequestHandle(self._progress, describe, finish, start, timeout, self._sequence, inp.nbytes)
            handle.start()
            return handle.wait() if blocking else handle
        if (collective, algorithm) in SHARED_MEMORY:
            return self._start_shared(collective, algorithm, count, inp, out, inplace, op, root, finish, blocking,
                                      timeout, describe)
        segment = self._segment(segment_size, out.itemsize) if (collective, algorithm) in SEGMENTED else 1
        plan = _plan(collective, algorithm, self.rank, self.size, count, root, segment, inplace, self.deterministic,
                     counts=counts if collective in VARIABLE else None,
                     topology=self._layout_for(collective, algorithm))
        alone = blocking and self._mpi_blocks(timeout)
        tag = self._tags.call(self._sequence)
        if alone:
            # A blocking call that cannot time out runs alone, after this rank's calls in
            # flight, on one tag kept for such calls (persistent requests have a fixed
            # tag). Every rank does so for the same calls, whichever executor each one
            # takes (a persistent program for a small call, the lean one, the engine),
            # so their messages meet; a size mismatch across the persistent program's
            # threshold is then still a size error, not a wait on two tags.
            self._finish_in_flight()
            tag = self._blocking_tag
            if _persistent_kind(collective, count, out.itemsize):
                self._run_persistent(plan, inp, out, inplace, op, lambda: describe)
                return finish()
        raw, tmp = self._workspace.take(plan.tmp, out.dtype)
        buffers = Buffers(inp, out, tmp)
        if alone:
            program = lean.program(plan)
            if program is not None:  # nothing else to serve while it runs: the lean executor
                self._run_lean(program, buffers, op, lambda: describe, tag)
                self._workspace.give(raw)
                return finish()

        def done():
            self._workspace.give(raw)
            return finish()

        handle = PlanHandle(self._progress, describe, done, self._comm, tag, plan, buffers, op,
                            timeout, self._sequence).start()
        return handle.wait() if blocking else handle

    # -- device arrays ---------------------------------------------------------------------
    def _device_context(self, backend, timeout):
        """This communicator's state for ``backend``'s device, negotiated with the other
        ranks at the first call on a device (collective: every rank makes that call;
        bounded by its ``timeout`` like the call itself)."""
        ctx = self._devices.get(backend)
        if ctx is None:
            from .transport.device import negotiate

            self._finish_in_flight()  # the negotiation blocks in MPI once every rank is in it

            def request(start, nbytes):
                self._request("the device set-up", start, timeout, nbytes)

            def node_comm():
                if self._node_comm is None:
                    self._node_comm = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
                return self._node_comm

            ctx = negotiate(self._comm, node_comm, backend, request, **self._device_options)
            self._devices[backend] = ctx
            self._progress.backends.append(backend)
        return ctx

    def _device_call(self, collective, algorithm, x, out, shape, op, root, segment_size, timeout, blocking,
                     counts=None):
        """Run a call whose arrays are on a device (checked, gated and resolved already):
        returns the result (the kind of array the user passed) or, if not ``blocking``,
        its :class:`Handle`. See :mod:`collectives.transport.device`."""
        from .transport import device_call

        ctx = self._device_context(x.backend, timeout)
        x.backend.prepare(x.dtype)  # compiles its kernels at the first call on a dtype, before any message
        describe = f"{collective}(algorithm={algorithm!r}, {x.where}) call #{self._sequence}"
        call = device_call.DeviceCall(ctx, x, x.dtype)
        call.begin()
        leaf = collective in ("reduce", "gather") and self.rank != root  # no result here
        returned = None
        if collective == "scatter" and self.rank != root:  # no input here
            result, _, returned = call.output(out, shape, x, allow_inplace=False)
            inp, inplace = result[:0], False
        elif collective == "broadcast":
            result = inp = call.flat(x.data)
            if not x.data.flags.c_contiguous:
                call._after.append(("unpack", x.data, result))
            inplace, returned = True, x.original
        elif leaf:
            inp, result, inplace = call.flat(x.data), None, False
        else:
            result, inplace, returned = call.output(out, shape, x, allow_inplace=collective in ("allreduce", "reduce"))
            if inplace:
                inp = result
            elif out is not None and device_call.overlaps(x.data, out.data):
                inp = call.copy_of(x.data)
            else:
                inp = call.flat(x.data)
        call.ready()
        if collective in ("allreduce", "reduce_scatter", "reduce") and op == "avg" and result is not None:
            call.divide_at_end(result, self.size)

        def finish():
            call.finish()
            return returned

        tag = self._tags.call(self._sequence)
        if algorithm == "native":
            start_mpi = self._native_starter(collective, op, root, counts)
            handle = device_call.start_native(self._progress, describe, finish, call, start_mpi, inp, result,
                                              collective == "broadcast", timeout, tag, inp.nbytes)
        else:
            segment = self._segment(segment_size, x.itemsize) if (collective, algorithm) in SEGMENTED else 1
            split = max(self.device_segment_size // x.itemsize, 1) if self.device_segment_size else 0
            count = math.prod(shape) if collective == "scatter" else x.size  # scatter: one row
            if collective == "alltoall":  # one block of the size in x
                count = x.size // self.size
            count = 0 if collective in VARIABLE else count  # counts say it all
            plan = _plan(collective, algorithm, self.rank, self.size, count, root, segment, inplace,
                         self.deterministic, split, counts if collective in VARIABLE else None,
                         self._layout_for(collective, algorithm))
            handle = device_call.start_plan(self._progress, describe, finish, self._comm, tag, plan, inp,
                                            result if result is not None else inp[:0], op, x.dtype, call, timeout)
        return handle.wait() if blocking else handle

    def _fast_call(self, collective, algorithm, x, out, op, root):
        """The lean path of a blocking host call: the result, or ``_NOT_HANDLED``
        (nothing done, no message sent) where the general path must run instead.

        It takes the common case only: ``x`` and ``out`` contiguous NumPy arrays that
        need no packing and do not overlap (or ``out is x``, in place), no timeout,
        stall warning or check mode, no call of this communicator in flight, and a
        call whose (algorithm, dtype, size, op, root, in place) the lean path has seen
        before. What it learnt then is kept (``_fast_entry``): the algorithm ``auto``
        resolved to and, for the library's own, the plan's :class:`LeanProgram`, run by
        :func:`collectives.transport.lean.run`; for ``native``, MPI's blocking call.
        What the general path would refuse falls through to it, so errors are its own.
        """
        progress = self._progress
        flags = x.flags
        if (self.check or self.stall_warn is not None or self.timeout is not None or progress.broken is not None
                or type(op) is not str or not flags.c_contiguous):
            return _NOT_HANDLED
        if progress.active and self._collectives_in_flight():
            return _NOT_HANDLED  # the general path finishes them first
        if type(root) is not int or not 0 <= root < self.size:  # False, 0.0: the general path refuses them
            return _NOT_HANDLED
        leaf = root != self.rank and collective == "reduce"  # gets no result; out is left alone
        shape = (self.size,) + x.shape if collective == "allgather" else x.shape
        if collective == "broadcast":
            if not flags.writeable:
                return _NOT_HANDLED
            out = x
        elif out is None:
            if not leaf:
                out = np.empty(shape, x.dtype)
        elif out is x and collective != "allgather":  # in place
            if not flags.writeable:  # the general path refuses it
                return _NOT_HANDLED
        else:
            if type(out) is not np.ndarray or out.shape != shape or out.dtype != x.dtype:
                return _NOT_HANDLED
            out_flags = out.flags
            if not (out_flags.writeable and out_flags.c_contiguous):
                return _NOT_HANDLED
            # Arrays that own their memory are distinct; views may overlap (a bounds check).
            if (x.base is not None or out.base is not None) and np.may_share_memory(x, out):
                return _NOT_HANDLED
        if leaf:
            out = None
        inplace = out is x
        key = (collective, algorithm, x.dtype, x.nbytes, op, root, inplace, self.segment_size, self.deterministic,
               self.shm_slot)
        entry = self._fast_entries.get(key)
        if entry is None:
            entry = self._fast_entry(collective, algorithm, x, op, root, inplace)
            if len(self._fast_entries) > 4096:  # many distinct sizes: do not grow without bound
                self._fast_entries.clear()
            self._fast_entries[key] = entry
        if entry is False:
            return _NOT_HANDLED
        if entry[0] == "shm":
            if self._registrations:  # the input may be a registered buffer: its own plan then
                entry = self._registered_entry(entry, x, out, inplace)
            if _needs_window(entry[1]) and (self._window is None or entry[1].shm * x.itemsize > self._window.capacity):
                return _NOT_HANDLED  # the general path makes the window (collective)
        self._sequence = (self._sequence + 1) % self._tag_limit  # as _gate numbers every call
        progress.call = self._sequence
        if entry[0] == "native":
            try:  # MPI's blocking collective, made once for this kind (nothing in flight to finish first)
                entry[1](x, out)
            except MPI.Exception as exc:
                raise TransportError(f"{collective}(algorithm='native'): the MPI library failed: {exc}") from exc
        elif entry[0] == "shm":
            inp = x if x.ndim == 1 else x.reshape(-1)
            result = inp if inplace else inp[:0] if out is None else out if out.ndim == 1 else out.reshape(-1)
            self._run_shared_now(entry, x, inp, result, op, root)
        else:
            program, name, persistent, _ = entry
            inp = x if x.ndim == 1 else x.reshape(-1)
            result = inp if inplace else inp[:0] if out is None else out if out.ndim == 1 else out.reshape(-1)
            sequence = self._sequence
            describe = lambda: f"{collective}(algorithm={name!r}) call #{sequence}"  # noqa: E731
            if persistent:  # nothing in flight to finish first (checked above)
                self._run_persistent(program.plan, inp, result, inplace, op, describe, entry)
            else:
                raw, tmp = self._workspace.take(program.plan.tmp, x.dtype)
                self._run_lean(program, Buffers(inp, result, tmp), op, describe, self._blocking_tag)
                self._workspace.give(raw)
        if op == "avg" and out is not None:
            ops.finish(op, out, self.size)
        return out

    def _run_persistent(self, plan, inp, result, inplace, op, describe, entry=None):
        """Run a small blocking call's ``plan`` on its :class:`~.lean.PersistentProgram`
        (made at its first call, kept): ``inp`` copied in, ``result`` copied out. On a
        failure the engine breaks, as on the general path.

        Every rank takes this path for the same calls (:func:`_persistent_kind`, a
        blocking call with no timeout or stall warning, after the collectives in flight),
        since its messages travel on a tag of their own that a call on any other path
        would never receive. ``entry``: the lean path's entry for the call's kind, a list
        whose last item keeps the program (the call then skips the lookup)."""

        def run():
            program = entry[3] if entry is not None else None
            if program is None or program.requests is None:
                key = (id(plan), inp.dtype, inp.size, result.size)
                program = self._persistent.get(key)
                if program is None:
                    if len(self._persistent) >= 64:  # a bounded set: free the oldest
                        self._persistent.pop(next(iter(self._persistent))).free()
                    program = self._persistent[key] = lean.PersistentProgram(
                        plan, self._comm, self._blocking_tag, inp.dtype, inp.size, result.size, inplace)
                if entry is not None:
                    entry[3] = program
            if inp.size:
                np.copyto(program.inp, inp)
            program.run(op, describe, lambda: self._lean_look(describe()))
            if result.size:
                np.copyto(result, program.out)

        self._breaking_on_failure(run, describe)

    def _run_lean(self, program, buffers, op, describe, tag):
        """Run a blocking call's plan on the lean executor (``describe()`` names the
        call), its messages on ``tag``. If it fails, its requests are given up and the
        engine breaks as on the general path, telling the other ranks of a message-size
        or MPI error; an interrupt (KeyboardInterrupt) breaks it too, since the ranks no
        longer agree on which message belongs to which call."""
        self._breaking_on_failure(
            lambda: lean.run(program, self._comm, tag, buffers, op, describe,
                             self._progress._abandoned.append, lambda: self._lean_look(describe())),
            describe)

    def _breaking_on_failure(self, run, describe):
        """``run()`` a call outside the engine (the lean path); if anything escapes it, an
        interrupt too, the engine breaks as it would have (``describe()`` names the call)."""
        try:
            run()
        except BaseException as exc:
            if self._progress.broken is None:
                self._progress.fail(exc if isinstance(exc, Exception) else CollectiveError(
                    f"{describe()} was interrupted ({type(exc).__name__})"))
            raise

    def _lean_look(self, describe):
        """What the engine does every 20 ms of waiting, for a call on the lean path: read
        other ranks' failure notices (and raise if one came) and answer liveness probes."""
        self._progress._look_around(_LeanCall(describe, self._sequence))

    def _fast_entry(self, collective, algorithm, x, op, root, inplace):
        """What the lean path keeps for a call: ``("native", caller)``, ``("shm", plan,
        …)``, ``(LeanProgram, algorithm, persistent)``, or False where the general path
        must take it (bad arguments, which it reports; a plan too large for the lean
        executor)."""
        try:
            check_algorithm(collective, algorithm)
            check_dtype(x.dtype, "x")
            if op != "-":
                ops.check_op(op, x.dtype)
            _check_root(root, self.size)
            name = self._resolve(collective, algorithm, x.nbytes * (self.size if collective == "allgather" else 1),
                                 x.dtype)
        except (TypeError, ValueError):
            return False  # the general path raises it
        if name == "native":
            if x.size == 0:  # _native gives an empty out an address of its own (MPI refuses the alias)
                def call(x, out):
                    return self._native(collective, x, out, inplace, op, root, None, blocking=True)
            else:
                call = self._native_starter(collective, op, root, None, blocking=True)
            if collective in self._native_checked:  # the ranks agree on the size first (transport.native)
                call = native.agreeing(self._comm, call, x.nbytes,
                                       lambda: f"{collective}(algorithm='native') call #{self._sequence}",
                                       self._broken_by)
            return ("native", call)
        if (collective, name) in SHARED_MEMORY:  # its own executor, run here (_run_shared_now)
            _, plan, code = self._shm_plan(collective, name, x.size, root, inplace, x.dtype, op)
            return ("shm", plan, name, code, collective, None, (x.size, root, op))
        segment = self._segment(None, x.itemsize) if (collective, name) in SEGMENTED else 1
        plan = _plan(collective, name, self.rank, self.size, x.size, root, segment, inplace, self.deterministic,
                     topology=self._layout_for(collective, name))
        persistent = _persistent_kind(collective, x.size, x.itemsize)
        program = lean.LeanProgram(plan) if persistent else lean.program(plan)
        return False if program is None else [program, name, persistent, None]  # last: its PersistentProgram

    def _native_starter(self, collective, op, root, counts, blocking=False, comm=None):
        """``(send, receive) -> request``: MPI's non-blocking collective on whole buffers
        (host copies of the device buffers, or the device buffers themselves); with
        ``blocking``, MPI's blocking collective (returning nothing: the lean path's
        ``native`` calls, their arguments bound once per kind). On ``comm`` (default:
        the communicator's own)."""
        comm = self._comm if comm is None else comm
        mpi_op = _MPI_OPS.get(op)  # None for the calls without one (allgather: "-")

        def mpi(name):  # Allreduce, or Iallreduce
            return getattr(comm, name if blocking else "I" + name[0].lower() + name[1:])

        def in_place(send, recv):  # one buffer for both (in place, CUDA-aware): MPI_IN_PLACE
            return MPI.IN_PLACE if send is recv else send

        if collective == "allreduce":
            allreduce = mpi("Allreduce")
            return lambda send, recv: allreduce(in_place(send, recv), recv, mpi_op)
        if collective == "reduce_scatter":
            reduce_scatter = mpi("Reduce_scatter")
            return lambda send, recv: reduce_scatter(send, recv, counts, mpi_op)
        if collective == "allgather":
            return mpi("Allgather")
        if collective == "broadcast":
            bcast = mpi("Bcast")
            return lambda send, recv: bcast(send, root)
        if collective == "gather":
            gather = mpi("Gather")
            return lambda send, recv: gather(send, recv if self.rank == root else None, root)
        if collective == "scatter":
            scatter = mpi("Scatter")
            return lambda send, recv: scatter(send if self.rank == root else None, recv, root)
        if collective == "alltoall":
            return mpi("Alltoall")
        if collective == "alltoallv":
            alltoallv = mpi("Alltoallv")
            return lambda send, recv: alltoallv(*_vector_messages(send, recv, counts))
        reduce = mpi("Reduce")
        return lambda send, recv: reduce(in_place(send, recv), recv if self.rank == root else None, mpi_op, root)

    def _native_now(self, collective, x, out, shape, op="sum", root=0, counts=None):
        """The latency path (what ``auto`` picks for tiny buffers): MPI's blocking
        collective straight on the caller's contiguous arrays, and its result. Returns
        ``_NOT_HANDLED``, having done nothing, if the arrays need packing or ``x``
        overlaps ``out`` (then ``_start`` packs them and makes the same blocking call)."""
        if not x.flags.c_contiguous:
            return _NOT_HANDLED
        leaf = collective in ("reduce", "gather") and self.rank != root  # gets no result; out is left alone
        inplace = out is x and collective in ("allreduce", "reduce") and not leaf
        if collective == "broadcast":
            out = x
        elif leaf:
            out = None
        elif out is None:
            out = np.empty(shape, x.dtype)
        elif not inplace and (not out.flags.c_contiguous or overlaps(x, out)):
            return _NOT_HANDLED
        self._native_blocking(collective, x, out, inplace, op, root, counts)
        if out is not None:
            ops.finish(op, out, self.size)
        return out

    def _native_blocking(self, collective, inp, out, inplace, op, root, counts):
        """MPI's blocking collective, after this rank's calls in flight have finished.

        Every rank makes a blocking native call with MPI's blocking collective (a
        blocking and a non-blocking collective never match each other in MPI, so the
        choice must not depend on what this rank happens to have in flight). Our own
        calls in flight need this rank's Python to progress them, which a rank blocked
        inside MPI cannot do, so they are finished first; every rank started them
        before this call, so every rank can finish them.
        """
        self._finish_in_flight()
        try:
            if collective in self._native_checked:
                native.agree(self._comm, native.unit(collective, inp, out), f"{collective}(algorithm='native') call "
                             f"#{self._sequence}", self._broken_by)
            self._native(collective, inp, out, inplace, op, root, counts, blocking=True)
        except MPI.Exception as exc:
            raise TransportError(f"{collective}(algorithm='native'): the MPI library failed: {exc}") from exc

    def _broken_by(self, error):
        """Break the engine with ``error``, which every rank found alike (no notice sent)."""
        self._progress.fail(error, notify=False)

    def _finish_in_flight(self, sends_and_receives=False):
        """Finish this rank's collectives in flight: before a blocking MPI call, during
        which this rank's Python cannot progress them, or a call that runs alone. Every
        rank started them before this call, so every rank can finish them. Sends and
        receives (``send_async``/``recv_async``) stay in flight unless
        ``sends_and_receives`` (``free()``): they travel on a communicator of their own,
        each is one MPI request that MPI progresses by itself, and the message a pending
        receive waits for may be sent only after this call."""
        while True:
            waiting = self._collectives_in_flight() if not sends_and_receives else self._progress.active
            if not waiting:
                return
            waiting[0].wait()  # waited for up to its own timeout; the engine advances the others meanwhile

    def _collectives_in_flight(self):
        """This rank's calls in flight other than sends and receives."""
        return [h for h in self._progress.active if not isinstance(h, p2p.PointHandle)]

    def _native(self, collective, inp, out, inplace, op, root, counts, blocking=False, comm=None):
        """Start MPI's own non-blocking collective (return its request), or with
        ``blocking`` run the blocking one: :meth:`_native_starter`'s call, kept per kind
        of call, on ``comm`` (default: the communicator's own; the size-agreed ones go
        on ``transport.native.Deferred``'s). Arrays go to mpi4py as they are: it maps
        the dtype to MPI's predefined type."""
        if out is not None and out.size == 0 and not inplace:
            # An empty result (a reduce_scatter block of 0 elements) may sit at x's own
            # address: NumPy says they share nothing, MPI refuses the alias all the same.
            out = np.empty(0, out.dtype)
        if counts is None:
            key = (collective, op, root, blocking, comm is None)
            start = self._native_starters.get(key)
            if start is None:
                if len(self._native_starters) > 256:
                    self._native_starters.clear()
                start = self._native_starters[key] = self._native_starter(collective, op, root, None, blocking, comm)
        else:  # per call: the counts are its own
            start = self._native_starter(collective, op, root, counts, blocking, comm)
        # The starter reads one buffer for both as MPI_IN_PLACE; broadcast's is out.
        send = out if collective == "broadcast" or (inplace and collective in ("allreduce", "reduce")) else inp
        return start(send, out)

def _nothing():
    return None


class _LeanCall:
    """A call on the lean path, as the engine's failure handling names it."""

    __slots__ = ("_describe", "_call", "_error")

    def __init__(self, describe, call):
        self._describe, self._call, self._error = describe, call, None


def _vector_messages(send, recv, counts):
    """mpi4py's ``[buffer, (counts, displacements)]`` pair for MPI_Alltoallv, from the
    ``(send, recv)`` element counts."""
    send_counts, recv_counts = counts
    return [send, (send_counts, _starts(send_counts))], [recv, (recv_counts, _starts(recv_counts))]


# A fence and nothing else, on the window: what the ranks pass before it grows (_window_for).
_GROW_PLAN = compile_plan(Schedule([Fence()], shm=1))

_NOT_HANDLED = object()  # _native_now's and _fast_call's "take the general path"


def _prepare(x, out, shape, allow_inplace=True):
    """Flat contiguous buffers for a call: ``(input, result, inplace, unpack)``.

    ``unpack()`` puts the result where the caller wants it and returns it: a
    non-contiguous ``out`` is computed in a contiguous copy and written back at the end;
    an ``out`` that overlaps ``x`` without being ``x`` gets a snapshot of ``x`` first.
    """
    if out is None:  # a fresh output shares nothing with x
        out = np.empty(shape, x.dtype)
        result = flat_view(out)
        return flat_input(x), result, False, lambda: out
    shares = overlaps(x, out)
    inplace = allow_inplace and shares and same_memory(x, out)
    result = flat_view(out)
    packed = result is None
    if packed:
        result = np.ascontiguousarray(out).reshape(-1) if inplace else np.empty(out.size, out.dtype)
    if inplace:
        inp = result
    else:
        inp = flat_input(x)
        if shares:
            inp = inp.copy()

    def unpack():
        if packed:
            out[...] = result.reshape(shape)
        return out

    return inp, result, inplace, unpack
