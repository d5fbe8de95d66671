"""What one communicator keeps: its MPI communicators, options, node layout, ``auto``'s
selector, progress engine, caches and shared memory.

A :class:`Context` is made once per :class:`~collectives.Communicator` (collectively)
and handed to the call path (:mod:`collectives.calls`) and the routes
(:mod:`collectives.routes`), which read and update it; its attributes are theirs to
use, which is why none is private.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from . import calls, mpi_library
from . import topology as topology_module
from .auto import LINK_TOLERANCE, Job, Selector, calibration
from .cache import BoundedCache
from .options import Options
from .routes.base import finish_in_flight
from .topology import Topology
from .transport import liveness as liveness_module
from .transport import native, tags
from .transport.liveness import Liveness
from .transport.mpi import RequestHandle
from .transport.progress import Progress
from .transport.retired import retire


def _nothing() -> None:
    return None


_NO_WORKSPACE = np.empty(0, np.uint8)  # sliced only to length 0 by plans with tmp == 0


class Workspace:
    """Reusable scratch memory, so calls do not allocate their workspace every time.

    A buffer is taken for the duration of one call (async calls in flight hold their
    own) and given back when it finishes. At most ``keep`` buffers are kept.
    """

    def __init__(self, keep: int = 4):
        self.free: list[np.ndarray] = []
        self.keep = keep

    def take(self, count: int, dtype: Any) -> tuple[np.ndarray | None, np.ndarray]:
        """``(raw buffer to give back, count elements of dtype)``."""
        if count == 0:  # most plans need none: nothing to take or give back
            return None, _NO_WORKSPACE
        nbytes = count * np.dtype(dtype).itemsize
        best = None
        for i, b in enumerate(self.free):  # the smallest free buffer that fits
            if b.size >= nbytes and (best is None or b.size < self.free[best].size):
                best = i
        buffer = self.free.pop(best) if best is not None else np.empty(nbytes, np.uint8)
        return buffer, buffer[:nbytes].view(dtype)

    def give(self, buffer: np.ndarray | None) -> None:
        if buffer is None:
            return
        self.free.append(buffer)
        if len(self.free) > self.keep:
            self.free.sort(key=len)
            del self.free[0]

    @property
    def kept_bytes(self) -> int:
        return sum(b.nbytes for b in self.free)


class Context:
    """A communicator's state (see the module's docstring). Making one is collective:
    it duplicates ``mpi_comm`` three times (collectives, liveness probes, sends and
    receives), asks MPI which ranks share memory, learns the node layout and agrees on
    ``auto``'s table."""

    def __init__(self, mpi_comm: MPI.Intracomm, options: Options, nodes: Any = None, calibrate: bool = True):
        self.options = options
        # No check mode, timeout or stall warning: blocking calls may take the lean path.
        self.plain = not (options.check or options.timeout is not None or options.stall_warn is not None)
        self.comm = mpi_comm.Dup()  # the library's collectives: never matched with the caller's messages
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        # The ranks that share memory with this one, asked of MPI once: the topology's
        # nodes (unless ``nodes`` says otherwise) and the shared-memory algorithms' group.
        # Made here: a blocking collective at a call's start could wait forever on an
        # absent rank, with no timeout to stop it.
        self.node_comm = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.topology = self._learn_topology(nodes)
        tag_ub = mpi_library.tag_ub()  # MPI_COMM_WORLD's: Open MPI gives Split's and Create's communicators none
        self.tag_limit = tag_ub  # calls are numbered mod this
        self.tags = tags.layout()  # a call's messages: its base tag (tags.call(sequence)) plus each one's size code
        self.blocking_tag = self.tags.blocking  # the base tag of every call that runs alone: see routes.plans
        self.p2p_tag_limit = tag_ub + 1  # send/recv (their own communicator): any tag MPI allows
        # MPI's own collectives whose ranks agree on the size first (a blocking broadcast:
        # the root's size sent ahead), where MPI would not stop on a mismatch by itself
        # (transport.native); the non-blocking ones then go
        # on a duplicate of their own (deferred), posted in call order once agreed, as
        # do device calls' (posted once their input is on the host).
        self.native_checked = mpi_library.native_checked(native.CHECKED)
        # MPI's own alltoallv, with receive counts the caller gave: they are checked
        # against what the peers send (specs.Alltoallv.agree); no MPI was measured to
        # stop on a wrong one by itself.
        self.native_counts_checked = mpi_library.native_checked(("alltoallv",))
        self.deferred = native.Deferred(mpi_comm.Dup())
        self.sequence = 0  # the newest call's number (its messages' tag)
        self.progress = Progress(Liveness(mpi_comm.Dup()), options.stall_warn)
        self.p2p_comm = mpi_comm.Dup()  # send/recv: never matched with a collective's messages
        self.workspace = Workspace()
        self.devices: dict[Any, Any] = {}  # backend -> DeviceContext, made at the first call on that device
        # The caches of kinds of calls (see collectives.cache):
        self.lean_entries = BoundedCache(4096)  # kind of call -> what the lean path runs (routes.LeanEntry)
        self.call_kinds = BoundedCache(4096)  # kind of call -> (its algorithm, its route): the general path's
        self.native_starters = BoundedCache(256)  # (collective, op, root, blocking) -> MPI's bound collective
        self.persistent = BoundedCache(64, evict=lambda program: program.free())  # small calls' programs
        self.registered_entries = BoundedCache(256)  # a shared-memory fast entry, registered form
        # The shared-memory algorithms need every rank on this node (MPI's view, whatever
        # ``nodes`` says); the window is made at the first such call (see transport.shm).
        self.shares_memory = self.node_comm.Get_size() == self.size
        if not self.shares_memory and self.size <= liveness_module.CONNECT_UP_TO:
            # Every rank on another node, connected now (see Liveness.connect): a timed-out
            # rank's probes must not wait on a TCP connect to a host that is gone.
            node_group, group = self.node_comm.Get_group(), self.comm.Get_group()
            here = set(node_group.Translate_ranks(list(range(node_group.Get_size())), group))
            node_group.Free()
            group.Free()
            self.progress.liveness.connect([r for r in range(self.size) if r not in here])
        self.window: Any = None  # the node's shared window (transport.shm.NodeWindow), made at first use
        self.registrations: list[Any] = []  # what empty() and zeros() made, in the order every rank made them
        # A tuning table counts only if it matches every rank's machine: the ranks AND
        # their verdicts (one allreduce), so all of them choose alike. On several nodes
        # it may also measure the link between them, and where no table matches it
        # calibrates the cost model (collective; made last: calibrating times calls).
        job = Job(self.size, self.topology, agree=lambda bits: self.comm.allreduce(bits, op=MPI.BAND),
                  measure_link=self.measure_link,
                  calibrate=(lambda fingerprint, key, link: self.calibrate(fingerprint, key, link, nodes))
                  if calibrate else None)
        self.selector = Selector.from_environment(job, deterministic=options.deterministic,
                                                  hint=self.rank == 0 and calibrate)

    def calibrate(self, fingerprint: Any, key: Any, link: Any, nodes: Any = None) -> Any:
        """``auto``'s cost model calibrated for these ranks (collective; see
        :mod:`collectives.auto.calibration`), before any call: its own messages use the
        blocking calls' base tag on the private communicator; the calls it times run as
        a user's do, on a context of their own (made at the first, freed at the end:
        its caches and shared window go with it), with this one's options but check
        mode and deterministic mode (every algorithm is timed)."""
        timing: list[Context] = []

        def timer(collective: str, algorithm: str, nbytes: int) -> Any:
            if not timing:
                keywords = dict(self.options.keywords(), check=False, deterministic=False)
                options = Options(**keywords)
                options.shm_slot = self.options.shm_slot
                timing.append(Context(self.comm, options, nodes, calibrate=False))
            return calls.sample(timing[0], collective, algorithm, nbytes)

        try:
            return calibration.obtain(self.comm, self.topology, fingerprint, key, tags.layout().blocking, timer,
                                      link=link, link_tolerance=LINK_TOLERANCE, shares_memory=self.shares_memory)
        finally:
            for context in timing:
                context.free()

    def broken_by(self, error: Exception) -> None:
        """Break the engine with ``error``, which every rank found alike (no notice sent)."""
        self.progress.fail(error, notify=False)

    def measure_link(self) -> float:
        """The node-to-node rate, bytes per second (collective; see ``topology.measure_link``)."""
        return topology_module.measure_link(self.comm, self.topology)

    def _learn_topology(self, nodes: Any) -> Topology:
        """The node layout: MPI's (ranks that share memory), or ``nodes``, one label per
        rank, checked to be the same list on every rank (collective either way)."""
        if nodes is None:
            return topology_module.learn(self.comm, self.node_comm)
        try:
            labels = list(nodes)
            problem = None if len(labels) == self.size else f"has {len(labels)} labels for {self.size} ranks"
            hash(tuple(labels))
        except TypeError:
            labels, problem = None, "is not a sequence of hashable labels, one per rank"
        everyone = self.comm.allgather((problem, labels))  # every rank raises alike, before any call
        for rank, (their_problem, their_labels) in enumerate(everyone):
            if their_problem is not None:
                raise ValueError(f"nodes {their_problem} (on rank {rank}); got {nodes!r}")
            if their_labels != labels:
                raise ValueError(f"nodes must be the same on every rank; rank {rank} gave {their_labels!r}, "
                                 f"rank {self.rank} {labels!r}")
        return Topology.from_labels(labels)

    def release_memory(self) -> None:
        """Drop the scratch buffers kept between calls, on the host and on devices."""
        self.workspace = Workspace()
        for device in self.devices.values():
            device.release_memory()

    def free(self) -> None:
        """Release the private MPI communicators, the shared memory and what the caches
        hold (collective). Nothing is usable after."""
        if self.comm == MPI.COMM_NULL:
            return
        if self.progress.broken is None:
            finish_in_flight(self, sends_and_receives=True)  # shared-memory calls read the window freed below
        for program in self.persistent.values():
            program.free()
        self.persistent.clear()
        for device in self.devices.values():
            device.free(self.comm, self.progress.broken is not None)
        self.devices = {}
        if self.window is not None and self.progress.broken is None:  # (collective: a broken job may hang in it)
            self.window.free()
        if self.progress.broken is None:
            for registration in self.registrations:
                registration.free()
        self.registrations = []
        self.registered_entries.clear()
        if self.progress.broken is not None:  # messages of the failed call may still come (transport.retired)
            retire(self.node_comm, self.comm, self.p2p_comm, self.deferred.comm)
            self.progress.liveness.free(keep=True)
            self.comm = MPI.Intracomm(MPI.COMM_NULL)  # as Free() leaves it: a second free() returns at once
            return
        if self.node_comm is not None:
            self.node_comm.Free()
        self.comm.Free()
        self.p2p_comm.Free()
        self.deferred.comm.Free()
        self.progress.liveness.free()

    def request(self, what: str, start: Any, timeout: float | None, nbytes: int = 0) -> None:
        """Run one MPI non-blocking call (``start()`` returns its request) to completion
        through the progress engine, bounded by ``timeout``: a timeout names it."""
        describe = f"{what} call #{self.sequence}"
        RequestHandle(self.progress, describe, _nothing, start, timeout, self.sequence, nbytes).start().wait()

    def next_call(self) -> int:
        """Number the next call (its messages' tag, mod ``tag_limit``) and return it."""
        self.sequence = (self.sequence + 1) % self.tag_limit
        self.progress.sequence = self.sequence
        return self.sequence
