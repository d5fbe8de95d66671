"""Parameter-server training on the library's point-to-point layer: the architecture
allreduce replaced, so that the trade-off can be measured rather than taken on faith.

    servers  (S ranks, the first S by default)   each holds one shard of the parameters
    workers  (the other W = p - S ranks)         each holds a full copy, computes gradients

        worker w                                  server s (shard s = flat[lo_s:hi_s])
        push(grads): Isend grad[lo_s:hi_s]  --->  receive (one Irecv posted per worker)
                                                  sync:  wait for every active worker,
                                                         sum in worker order, / n, update
                                                  async: update with grad / W at once
        pull():      Irecv flat[lo_s:hi_s]  <---  Isend the shard (async: held while w is
                                                  more than max_staleness steps ahead of
                                                  the slowest active worker)
        finish():    Isend an empty message --->  w is done; serve() returns when all are

The parameters (one floating dtype) are flattened, in the order given, into one buffer
cut into S contiguous shards with ``block_bounds`` (as ``numpy.array_split``: uneven
counts give the first shards one element more; every server needs at least one). Every
message is a NumPy buffer view sent with the upper-case mpi4py calls; the only pickled
messages are the settings and layout compared once at construction and the statistics
gathered once in :meth:`ParameterServer.close`. Everything runs on a private duplicate
of the caller's communicator.

World sizes: any p >= 2 with 1 <= S < p. A world of one rank has no worker, so
construction raises ValueError there (as for ``servers`` covering every rank).

Shutdown: a worker's :meth:`~ParameterServer.finish` (called by ``close``, and by the
``with`` block even when the worker's loop raised) waits for its last reply and then
sends each server an empty message; a server drops a finished worker from every count
(a synchronous step then averages over the workers still active; a held worker is
re-checked against the slowest *active* worker), and :meth:`~ParameterServer.serve`
returns once every worker has finished. So workers may stop after different numbers of
steps without leaving anyone waiting.
"""

import math
import time

import numpy as np
from mpi4py import MPI

from ..algorithms import block_bounds
from ..communicator import Communicator
from ..errors import CollectiveTimeoutError
from .. import device
from ..device import DeviceArray
from ..device import ops as device_ops
from .training import _host_copy, named_arrays
from ..transport.liveness import ranks as rank_list
from ..options import check_timeout, env_seconds
from ..transport.progress import yield_cpu

MODES = ("sync", "async")
TAG_PUSH = 1  # worker -> server: a gradient shard, or an empty message for "finished"
TAG_PARAMS = 2  # server -> worker: the current shard


class ParameterServerError(RuntimeError):
    """A parameter server or worker was used out of protocol order (the message says
    which rank and what to call instead)."""


class SGD:
    """The default update rule: ``param -= lr * grad`` (with ``momentum``:
    ``v = momentum * v + grad; param -= lr * v``), in place on a server's shard.

    Any callable ``update(param, grad)`` that changes the 1-D ``param`` in place may be
    used instead. Each server rank calls its own copy on its own shard, so state kept
    per call site (as the momentum buffer here) is per shard."""

    def __init__(self, lr, momentum=0.0):
        for name, value in (("lr", lr), ("momentum", momentum)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a non-negative number; got {value!r}")
        self.lr, self.momentum = float(lr), float(momentum)
        self._velocity = None

    def __call__(self, param, grad):
        if self.momentum:
            if self._velocity is None:
                self._velocity = np.zeros_like(param)
            self._velocity *= self.momentum
            self._velocity += grad
            grad = self._velocity
        param -= self.lr * grad

    def __repr__(self):
        return f"SGD(lr={self.lr}, momentum={self.momentum})"


class ParameterServer:
    """One rank's part in parameter-server training over ``comm`` (a
    :class:`collectives.Communicator`, an mpi4py intracommunicator, or None for
    ``MPI.COMM_WORLD``). Collective: every rank constructs it with the same settings and
    the same parameter layout (checked; a mismatch raises ValueError on every rank,
    naming the ranks that differ from rank 0).

    - ``params``: a mapping (or ``(name, array)`` pairs) of arrays of one floating
      dtype, NumPy or device arrays (CuPy, torch CUDA tensors: every worker copies its
      parameters and gradients through host memory, one copy each way per step; the
      servers keep their shards and run ``update`` on the host). The first server's
      values are the starting point: they are copied into every rank's arrays here. On
      workers :meth:`pull` writes the current values into them.
    - ``servers``: how many server ranks (the first ones) or which ranks.
    - ``mode``: ``"sync"`` (every step averages all active workers' gradients: data-
      parallel SGD) or ``"async"`` (each gradient, divided by the number of workers, is
      applied as it arrives).
    - ``max_staleness=k`` (async only): a worker more than ``k`` steps ahead of the
      slowest active worker is not sent its parameters until that one catches up.
    - ``update``: ``update(param_shard, grad_shard)``, in place; default ``SGD(lr)``.
    - ``timeout``: seconds any one wait may take (a worker's for its reply, a server's
      for the next gradient, so more than a step's compute), else
      ``COLLECTIVES_TIMEOUT``, else none. On expiry
      :class:`~collectives.CollectiveTimeoutError` names the ranks not heard from.

    Workers call :meth:`push` then :meth:`pull` (or :meth:`step`) each step and
    :meth:`finish` at the end; servers call :meth:`serve` (a server's current shard is
    ``shard``, flat elements ``bounds[i]:bounds[i + 1]`` for the i-th server; its
    ``params`` keep the starting values). Every rank then calls :meth:`close`, which
    returns the statistics; or use :meth:`run`, or a ``with`` block.

    A failure inside :meth:`serve` (the update rule raising, an MPI error) leaves the
    workers waiting for their replies until their ``timeout`` (or, without one, until
    the failed rank's exit ends the job under ``mpiexec``).

    Waiting polls and yields the CPU between polls, as the collectives do (see
    :class:`collectives.transport.mpi.Progress`): spinning inside ``MPI_Wait*`` would keep
    the very rank it waits for off the CPU when there are more ranks than cores.
    """

    def __init__(self, params, comm=None, *, servers=1, mode="sync", max_staleness=None, update=None, lr=0.01,
                 timeout=None):
        # Every argument is checked before the first message (the settings themselves
        # first, so that a world of one rank reports a bad mode as such).
        mpi_comm = _mpi_comm(comm)
        rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.mode = _check_mode(mode)
        self.max_staleness = _check_staleness(max_staleness, self.mode)
        self.timeout = env_seconds("COLLECTIVES_TIMEOUT") if timeout is None else check_timeout(timeout)
        self.update = SGD(lr) if update is None else update
        if not callable(self.update):
            raise TypeError(f"update must be a callable update(param, grad); got {type(update).__name__}")
        self._named = _check_params(params, writable=True)
        self.dtype = self._named[0][1].dtype
        self._slices, self.count = _flat_layout(self._named)
        self.servers = _check_servers(servers, size)
        self.workers = tuple(r for r in range(size) if r not in self.servers)
        self.rank, self.size = rank, size
        self.is_server = rank in self.servers
        self.is_worker = not self.is_server
        if self.count < len(self.servers):
            raise ValueError(f"params hold {self.count} elements: too few for {len(self.servers)} servers "
                             "(each server needs a shard of at least one element)")
        self.bounds = block_bounds(self.count, len(self.servers))

        # The first message: every rank compares its settings and layout with rank 0's.
        self._comm = mpi_comm.Dup()
        try:
            _check_same_everywhere(self._comm, self._settings())
        except ValueError:
            self._comm.Free()  # every rank raised: every rank frees it
            raise

        self._flat = np.empty(self.count, self.dtype)  # workers: the parameters as last pulled
        if rank == self.servers[0]:
            self._pack(self._flat, dict(self._named))
        self._comm.Bcast(self._flat, root=self.servers[0])
        self._unpack(self._flat)
        self._served = self._serving = self._finished = self._closed = False
        self._broken = None  # the timeout that ended this rank's part, once one has
        if self.is_server:
            self._index = self.servers.index(rank)
            lo, hi = self.bounds[self._index], self.bounds[self._index + 1]
            self.shard = self._flat[lo:hi].copy()
            self._flat = None
        else:
            self._grad = np.empty(self.count, self.dtype)
            self._pending = []  # requests of the push in flight (sends and the posted receives)
            self.steps = 0  # pushes made

    # -- workers -------------------------------------------------------------------
    def push(self, grads):
        """Send ``grads`` (a mapping name -> array shaped and typed like the parameter)
        to the servers, shard s to server s; returns at once (the sends and the
        receives of the reply are in flight until :meth:`pull`). Checked before anything
        is sent."""
        self._require_worker("push")
        self._require_intact("push")
        if self._pending:
            raise ParameterServerError(f"rank {self.rank}: push() twice without pull(): pull the parameters "
                                       "that answer the last push first")
        self._pack(self._grad, self._check_grads(grads))
        # Post the receives first: a server's reply then never waits for this worker.
        self._pending = [self._comm.Irecv(self._flat[lo:hi], source=server, tag=TAG_PARAMS)
                         for server, lo, hi in self._shards()]
        self._pending += [self._comm.Isend(self._grad[lo:hi], dest=server, tag=TAG_PUSH)
                          for server, lo, hi in self._shards()]
        self.steps += 1

    def pull(self):
        """Wait for every server's reply to the last :meth:`push` and write the
        parameters into the arrays given at construction; returns them (name -> array)."""
        self._require_worker("pull")
        self._require_intact("pull")
        if not self._pending:
            raise ParameterServerError(f"rank {self.rank}: pull() without a push(): every pull answers a push")
        peers = [server for server, _, _ in self._shards()] * 2
        try:
            wait_all(self._pending, peers, self.timeout,
                     f"rank {self.rank}: ParameterServer pull() after push #{self.steps}", "servers",
                     receives=len(self.servers))
        except CollectiveTimeoutError as exc:
            self._broken, self._pending = exc, []  # the replies will not come: never unpack them
            raise
        self._pending = []
        self._unpack(self._flat)
        return {name: array.original if isinstance(array, DeviceArray) else array for name, array in self._named}

    def step(self, grads):
        """:meth:`push` then :meth:`pull`."""
        self.push(grads)
        return self.pull()

    def finish(self):
        """Tell every server this worker is done (after waiting for the reply to a push
        still in flight). Idempotent."""
        if self.is_worker and self._finished:
            return
        self._require_worker("finish")
        self._require_intact("finish")
        if self._pending:
            self.pull()
        done = np.empty(0, self.dtype)
        sends = [self._comm.Isend(done, dest=server, tag=TAG_PUSH) for server in self.servers]
        try:
            wait_all(sends, self.servers, self.timeout, f"rank {self.rank}: ParameterServer finish()", "servers")
        except CollectiveTimeoutError as exc:
            self._broken = exc
            raise
        self._finished = True

    # -- servers -------------------------------------------------------------------
    def serve(self):
        """Apply the workers' gradients to this server's shard until every worker has
        finished; returns this server's statistics (see :meth:`close`)."""
        if not self.is_server:
            raise ParameterServerError(f"rank {self.rank} is a worker (servers are ranks {list(self.servers)}): "
                                       "only servers serve(); workers push(), pull() and finish()")
        if self._served:
            raise ParameterServerError(f"rank {self.rank}: serve() already ran to the end")
        self._serving = True
        loop = _SyncLoop(self) if self.mode == "sync" else _AsyncLoop(self)
        try:
            self._stats = loop.run()
        except CollectiveTimeoutError as exc:
            self._broken = exc
            raise
        self._served = True
        return self._stats

    # -- everyone ------------------------------------------------------------------
    def close(self):
        """Finish (workers) or serve to the end (servers, if not done yet), gather the
        statistics and free the private communicator. Collective; returns on every rank::

            {"mode", "servers", "workers", "max_staleness",
             "versions": updates applied by each server,
             "updates_per_worker": {worker rank: gradients applied (by each server)},
             "staleness": {"mean", "max", "histogram": {staleness: count}} over every
                          server's updates (staleness = the server's version when the
                          gradient is applied minus the version the worker's parameters
                          came from; 0 throughout in sync mode),
             "held": replies delayed by max_staleness, "held_s": their total delay}
        """
        if self._closed:
            return self._summary
        self._require_intact("close")
        if self.is_worker:
            self.finish()
            mine = None
        else:
            mine = self._stats if self._served else self.serve()
        # Everyone arrives first (bounded by the timeout: a server that failed never
        # does), then the small dicts are gathered, once.
        wait_all([self._comm.Ibarrier()], [], self.timeout, f"rank {self.rank}: ParameterServer close()",
                 "every rank")
        everyone = self._comm.allgather(mine)
        self._summary = _summarize(self, [s for s in everyone if s is not None])
        self._comm.Free()
        self._closed = True
        return self._summary

    def run(self, train):
        """Servers serve, workers call ``train(self)`` (which pushes and pulls); then
        :meth:`close` on every rank, even when ``train`` raised. Returns the statistics."""
        with self:
            if self.is_worker:
                train(self)
        return self._summary

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if self._broken is not None:  # a wait timed out: the protocol is over, re-raise
            return
        if self.is_server and exc_type is not None and self._serving and not self._served:
            # serve() itself failed (e.g. the update rule raised): its loop is gone, so
            # the workers' replies are too; re-raise rather than serve again from scratch.
            return
        if self.is_worker and not self._closed:
            # A worker that raised mid-step still tells the servers it is done, so they
            # (and close) do not wait for it forever.
            self.finish()
        self.close()

    # -- machinery -----------------------------------------------------------------
    def _settings(self):
        layout = [(name, tuple(a.shape)) for name, a in self._named]
        return dict(servers=self.servers, mode=self.mode, max_staleness=self.max_staleness, dtype=str(self.dtype),
                    layout=layout)

    def _shards(self):
        return [(server, self.bounds[i], self.bounds[i + 1]) for i, server in enumerate(self.servers)]

    def _pack(self, flat, arrays):
        for name, (lo, hi) in self._slices.items():
            array = arrays[name]
            flat[lo:hi] = (_host_copy(array) if isinstance(array, DeviceArray) else array).reshape(-1)

    def _unpack(self, flat):
        for name, array in self._named:
            lo, hi = self._slices[name]
            if not isinstance(array, DeviceArray):
                array[...] = flat[lo:hi].reshape(array.shape)
            elif array.contiguous:  # device parameters: one host -> device copy each
                device_ops.from_host(array, flat[lo:hi])
            else:
                staging = device_ops.empty(array, array.shape, stream=array.stream)
                device_ops.from_host(staging, flat[lo:hi])
                device_ops.copy(array, staging)

    def _check_grads(self, grads):
        if not hasattr(grads, "items"):
            raise TypeError(f"grads must be a mapping name -> array; got {type(grads).__name__}")
        missing = [name for name, _ in self._named if name not in grads]
        extra = [name for name in grads if name not in self._slices]
        if missing or extra:
            raise ValueError(f"grads must name exactly the parameters; missing {missing}, unknown {extra}")
        on_device = isinstance(self._named[0][1], DeviceArray)
        grads = dict(grads)
        for name, array in self._named:
            g = grads[name]
            if on_device and device.is_device(g):
                g = grads[name] = device.as_device_array(g, f"grads[{name!r}]")
            if not isinstance(g, DeviceArray if on_device else np.ndarray) or g.shape != array.shape or \
                    g.dtype != array.dtype:
                got = f"shape {g.shape}, dtype {g.dtype}" if hasattr(g, "dtype") else type(g).__name__
                raise ValueError(f"grads[{name!r}] must be an array of shape {array.shape} and dtype {array.dtype} "
                                 f"like the parameter; got {got}")
        return grads

    def _require_intact(self, what):
        if self._broken is not None:
            raise ParameterServerError(f"rank {self.rank}: {what}() after a timeout ended this parameter "
                                       f"server ({self._broken})")

    def _require_worker(self, what):
        if not self.is_worker:
            raise ParameterServerError(f"rank {self.rank} is a server (servers are ranks {list(self.servers)}): "
                                       f"only workers {what}(); servers serve()")
        if self._finished:
            raise ParameterServerError(f"rank {self.rank}: {what}() after finish()")


# -- the server loops ----------------------------------------------------------------------
class _ServerLoop:
    """What both modes share: one receive posted per active worker, the shard, the
    version (updates applied), the replies and the statistics."""

    def __init__(self, ps):
        self.ps = ps
        self.comm, self.shard, self.update = ps._comm, ps.shard, ps.update
        self.workers = ps.workers
        self.slot = {w: np.empty_like(self.shard) for w in self.workers}
        self.requests = {}
        self.active = set(self.workers)
        self.version = 0
        self.sent_version = dict.fromkeys(self.workers, 0)  # the version each worker's parameters came from
        self.updates = dict.fromkeys(self.workers, 0)
        self.staleness = []
        self.held, self.held_s = 0, 0.0
        for w in self.workers:
            self.post(w)

    def post(self, worker):
        self.requests[worker] = self.comm.Irecv(self.slot[worker], source=worker, tag=TAG_PUSH)

    def next_message(self):
        """``(worker, finished)`` for the next worker message to arrive."""
        order = sorted(self.requests)
        status = MPI.Status()
        index = wait_any([self.requests[w] for w in order], order, status, self.ps.timeout,
                         f"rank {self.ps.rank}: ParameterServer server at version {self.version}", "workers")
        worker = order[index]
        del self.requests[worker]
        if status.Get_count(MPI.BYTE) == 0:
            self.active.discard(worker)  # an empty message: the worker has finished
            return worker, True
        return worker, False

    def record(self, worker):
        self.staleness.append(self.version - self.sent_version[worker])
        self.updates[worker] += 1

    def reply(self, workers):
        """Send the current shard to ``workers`` (their receives are posted already, so
        this completes without waiting on them) and listen for their next message."""
        sends = [self.comm.Isend(self.shard, dest=w, tag=TAG_PARAMS) for w in workers]
        wait_all(sends, workers, self.ps.timeout, f"rank {self.ps.rank}: ParameterServer reply", "workers")
        for w in workers:
            self.sent_version[w] = self.version
            self.post(w)

    def stats(self):
        return dict(server=self.ps.rank, version=self.version, updates=self.updates,
                    staleness=np.bincount(np.asarray(self.staleness, np.int64), minlength=1).tolist(),
                    held=self.held, held_s=self.held_s)


class _SyncLoop(_ServerLoop):
    def run(self):
        """One step at a time: a gradient from every active worker (or its finishing),
        then the update with their average, then the replies."""
        while self.active:
            arrived = []
            while set(arrived) != self.active:
                worker, finished = self.next_message()
                if not finished:
                    arrived.append(worker)
            if arrived:
                self.apply(sorted(arrived))
                self.reply(sorted(arrived))
        return self.stats()

    def apply(self, workers):
        # Summed in worker order, whatever order they arrived in: the same rounding every run.
        total = self.slot[workers[0]].copy()
        for w in workers[1:]:
            total += self.slot[w]
        total /= len(workers)
        for w in workers:
            self.record(w)
        self.update(self.shard, total)
        self.version += 1


class _AsyncLoop(_ServerLoop):
    def run(self):
        """Each gradient is applied as it arrives (divided by the number of workers, so
        W pushes move the parameters as far as one synchronous step) and answered at
        once, unless ``max_staleness`` holds the reply back."""
        self.waiting = {}  # held worker -> when its reply became due
        scale = 1 / len(self.workers)
        while self.active:
            worker, finished = self.next_message()
            if not finished:
                self.record(worker)
                self.slot[worker] *= scale
                self.update(self.shard, self.slot[worker])
                self.version += 1
                self.waiting[worker] = time.perf_counter()
            self.release(arrived=None if finished else worker)
        return self.stats()

    def release(self, arrived):
        """Reply to every waiting worker that is at most ``max_staleness`` steps ahead of
        the slowest active worker (the slowest itself always is: no one waits forever).
        A reply not sent as soon as its gradient ``arrived`` counts as held."""
        k = self.ps.max_staleness
        slowest = min((self.updates[w] for w in self.active), default=0)
        ready = sorted(w for w in self.waiting if k is None or self.updates[w] - slowest <= k)
        now = time.perf_counter()
        for w in ready:
            due = self.waiting.pop(w)
            if w != arrived:  # it waited for another worker's message
                self.held += 1
                self.held_s += now - due
        if ready:
            self.reply(ready)


# -- waiting -------------------------------------------------------------------------------
def wait_all(requests, peers, timeout, what, kind, receives=0):
    """``MPI.Request.Waitall(requests)`` that yields the CPU between polls and, after
    ``timeout`` seconds (None: never), raises CollectiveTimeoutError naming the
    ``peers`` (``kind``: "servers" / "workers") of the requests still pending; the
    first ``receives`` requests are receives, cancelled then."""
    deadline = time.monotonic() + timeout if timeout is not None else math.inf
    while not MPI.Request.Testall(requests):
        yield_cpu()
        if time.monotonic() > deadline:
            _time_out(requests, peers, timeout, what, kind, requests[:receives])


def wait_any(requests, peers, status, timeout, what, kind):
    """The index of the first of ``requests`` to complete (``MPI.Request.Waitany``),
    polling and yielding as :func:`wait_all` does."""
    deadline = time.monotonic() + timeout if timeout is not None else math.inf
    while True:
        index, done = MPI.Request.Testany(requests, status)
        if done:
            return index
        yield_cpu()
        if time.monotonic() > deadline:
            _time_out(requests, peers, timeout, what, kind, requests)  # all receives


def _time_out(requests, peers, timeout, what, kind, receives):
    """Cancel the pending ``receives`` and raise. Sends stay pending (a send's cancel
    needs the peer) and referenced by their owner (the parameter server is unusable
    after a timeout), so MPI never reads freed memory."""
    pending = sorted({peer for peer, request in zip(peers, requests) if not request.Test()})
    for request in receives:
        if request != MPI.REQUEST_NULL:
            request.Cancel()
    missing = f"{rank_list(pending)} not heard from" if pending else "not all of them arrived"
    raise CollectiveTimeoutError(f"{what}: Timed out after {timeout:g} s waiting for {kind} ({missing})")


# -- checks --------------------------------------------------------------------------------
def _mpi_comm(comm):
    if comm is None:
        return MPI.COMM_WORLD
    if isinstance(comm, Communicator):
        return comm.mpi_comm  # the library's private duplicate; duplicated again below
    if isinstance(comm, MPI.Intracomm) and comm != MPI.COMM_NULL:
        return comm
    raise TypeError(f"comm must be a collectives.Communicator, an mpi4py intracommunicator or None; "
                    f"got {type(comm).__name__}")


def _check_servers(servers, size):
    if isinstance(servers, (int, np.integer)) and not isinstance(servers, bool):
        if not 1 <= servers < size:
            raise ValueError(f"servers must be between 1 and {size - 1} (at least one rank must be a worker) in a "
                             f"world of {size}; got {servers!r}"
                             + (": a parameter server needs at least 2 ranks" if size == 1 else ""))
        return tuple(range(int(servers)))
    try:
        if isinstance(servers, (str, bytes)):
            raise TypeError
        ranks = [int(r) for r in servers if not isinstance(r, bool) and int(r) == r]
        valid = len(ranks) == len(list(servers))
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise TypeError(f"servers must be a number of ranks or a sequence of ranks; got {servers!r}")
    if len(set(ranks)) != len(ranks) or not all(0 <= r < size for r in ranks) or not 1 <= len(ranks) < size:
        raise ValueError(f"servers must be distinct ranks in 0..{size - 1}, at least one and leaving at least one "
                         f"worker; got {list(servers)!r}")
    return tuple(sorted(ranks))


def _check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}; got {mode!r}")
    return mode


def _check_staleness(k, mode):
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"max_staleness must be a non-negative integer or None; got {k!r}")
    if mode != "async":
        raise ValueError("max_staleness bounds asynchronous updates: it needs mode='async' (sync mode has none)")
    return int(k)


def _check_params(params, writable):
    named = named_arrays(params)
    if not named:
        raise ValueError("params is empty: a parameter server needs at least one parameter")
    dtypes = {a.dtype for _, a in named}
    if len(dtypes) > 1:
        raise TypeError(f"params must share one dtype (they are flattened into one buffer); got "
                        f"{', '.join(sorted(str(d) for d in dtypes))}")
    for name, array in named:
        if array.dtype.kind not in "fc":
            raise TypeError(f"params[{name!r}] has dtype {array.dtype}: gradients are averaged, so parameters must "
                            "be floating or complex")
        if writable and isinstance(array, np.ndarray) and not array.flags.writeable:
            raise ValueError(f"params[{name!r}] must be writable: the parameter server writes it in place")
    return named


def _flat_layout(named):
    slices, count = {}, 0
    for name, array in named:
        slices[name] = (count, count + array.size)
        count += array.size
    return slices, count


def _check_same_everywhere(mpi_comm, settings):
    """Raise ValueError on every rank unless every rank passed rank 0's settings and
    parameter layout, naming the ranks that differ and, on each, what."""
    everyone = mpi_comm.allgather(settings)  # small metadata, once
    differ = [r for r, s in enumerate(everyone) if s != everyone[0]]
    if not differ:
        return
    mine = settings
    detail = ""
    if mine != everyone[0]:
        keys = [k for k in mine if mine[k] != everyone[0][k]]
        detail = " Here (rank {}): {}.".format(
            mpi_comm.Get_rank(), "; ".join(f"{k} {mine[k]!r}, rank 0 has {everyone[0][k]!r}" for k in keys))
    raise ValueError(f"ParameterServer: rank(s) {', '.join(map(str, differ))} passed other settings or parameter "
                     f"layout (names, shapes, dtype) than rank 0.{detail} Every rank must pass the same.")


def _summarize(ps, per_server):
    histogram = {}
    for s in per_server:
        for staleness, n in enumerate(s["staleness"]):
            if n:
                histogram[staleness] = histogram.get(staleness, 0) + n
    total = sum(histogram.values())
    first = min(per_server, key=lambda s: s["server"])
    return dict(
        mode=ps.mode, servers=list(ps.servers), workers=list(ps.workers), max_staleness=ps.max_staleness,
        versions=[s["version"] for s in sorted(per_server, key=lambda s: s["server"])],
        updates_per_worker=dict(first["updates"]),
        staleness=dict(mean=sum(k * n for k, n in histogram.items()) / total if total else 0.0,
                       max=max(histogram, default=0), histogram=histogram),
        held=sum(s["held"] for s in per_server), held_s=sum(s["held_s"] for s in per_server),
    )
