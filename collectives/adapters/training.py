"""Data-parallel training on the collectives: the framework-neutral core.

Every rank keeps a full copy of the model. The parameters are broadcast once from
rank 0; then every step each rank computes gradients on its own shard of the batch,
and the gradients are averaged over the ranks with allreduce, so every replica takes
the same step (as PyTorch DDP and Horovod do)::

    comm = cc.Communicator()
    broadcast_parameters(params, comm=comm)          # rank 0's values, in place
    reducer = GradientReducer(params, comm=comm)
    for batch in my_shard:
        for name, grad in backward(batch):           # as soon as each gradient is complete
            reducer.gradient_ready(name, grad)       # a full bucket starts its allreduce now
        reducer.synchronize()                        # every grad now holds the average
        optimizer_step(params, grads)

``params`` is a mapping (or a sequence of ``(name, array)`` pairs) with the same names,
shapes and dtypes, in the same order, on every rank.

**Buckets** (DDP's gradient buckets, Horovod's tensor fusion): many small gradients
are packed into few flat buffers, each reduced by one allreduce. Parameters are laid
out in *reverse* order, because backward produces the last layer's gradients first;
a bucket holds one dtype; the first bucket of each dtype is capped at
``first_bucket_bytes`` (1 MiB, so communication starts early in backward), the
others at ``bucket_bytes`` (25 MiB); a parameter larger than the cap has a bucket of
its own. The layout depends only on the names, shapes and dtypes, so it is the same
on every rank, and buckets start their allreduce in the same order on every rank
(bucket i waits for bucket i-1 to start) whatever order the gradients arrive in.

**Overlap**: a bucket's allreduce is started as soon as its last gradient arrives and
runs while backward computes the earlier layers. The library's transports progress
only when called, so the reducer polls at every ``gradient_ready``; with
``progress_thread=True`` a background thread also polls while backward is busy in
NumPy or PyTorch kernels (which release the GIL), on a private duplicate of the
communicator.
"""

import contextlib
import hashlib
import threading
import time

import numpy as np
from mpi4py import MPI

from .. import device
from .. import ops as ops_layer
from ..algorithms import check_algorithm, check_ordered
from ..communicator import Communicator
from ..device import DeviceArray
from ..device import ops as device_ops
from ..dtypes import EXTRA_DTYPES, is_extra
from ..options import check_nbytes, check_root

FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20

# compression -> the dtype on the wire (the gradients keep their own dtype); bf16 needs
# ml_dtypes (the collectives then move bfloat16 with their own algorithms)
_BFLOAT16 = next((d for d in EXTRA_DTYPES if d.name == "bfloat16"), None)
COMPRESSIONS = {None: None, "fp16": np.dtype(np.float16), "bf16": _BFLOAT16}


class TrainingError(RuntimeError):
    """Training code used the reducer in a way that cannot give the right gradients
    (the message says how to fix it), or the ranks' parameters disagree."""


def named_arrays(params, what="params", convert=None):
    """``params`` as a list of ``(name, array)``: a mapping, a sequence of
    ``(name, array)`` pairs, or a sequence of arrays (named "0", "1", ...). Host arrays
    stay NumPy arrays; device arrays (CuPy, torch CUDA tensors ...) become
    :class:`~collectives.device.DeviceArray`; all of one kind, on one device.
    ``convert(name, value)``, if given, turns each value into its array first (the
    PyTorch adapter's tensors)."""
    items = list(params.items()) if hasattr(params, "items") else list(params)
    named = []
    for i, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, array = item
        else:
            name, array = str(i), item
        if convert is not None:
            array = convert(name, array)
        if not isinstance(array, np.ndarray):
            if not device.is_device(array):
                raise TypeError(f"{what}[{name!r}] must be a numpy.ndarray or a device array; got "
                                f"{type(array).__name__}")
            array = device.as_device_array(array, f"{what}[{name!r}]")
        named.append((name, array))
    places = {a.where if isinstance(a, DeviceArray) else "the host" for _, a in named}
    if len(places) > 1:
        raise TypeError(f"{what} are on {' and '.join(sorted(places))}: pass them all on the host or all on one "
                        "device")
    names = [name for name, _ in named]
    if len(set(names)) != len(names):
        duplicates = sorted({name for name in names if names.count(name) > 1})
        raise ValueError(f"{what} has duplicate names: {', '.join(duplicates)}")
    return named


_default_comm = None


def default_communicator():
    """The communicator over ``MPI.COMM_WORLD`` that training calls use when given none
    (made on first use: collective, like every call here)."""
    global _default_comm
    if _default_comm is None:
        _default_comm = Communicator()
    return _default_comm


def _communicator(comm):
    if comm is None:
        return default_communicator()
    if not isinstance(comm, Communicator):
        raise TypeError(f"comm must be a collectives.Communicator or None; got {type(comm).__name__}")
    return comm


class Bucket:
    """Arrays of one dtype packed into one flat buffer, moved by one collective call."""

    def __init__(self, index, dtype, cap):
        self.index = index
        self.dtype = np.dtype(dtype)
        self.cap = cap  # bytes
        self.names = []
        self.slices = {}  # name -> (start, stop) in the flat buffer
        self.shapes = {}
        self.count = 0
        self.data = None  # the flat buffer, once allocate() is called

    @property
    def nbytes(self):
        return self.count * self.dtype.itemsize

    def add(self, name, shape, size):
        self.names.append(name)
        self.slices[name] = (self.count, self.count + size)
        self.shapes[name] = tuple(shape)
        self.count += size

    def allocate(self, like=None):
        """Allocate the flat buffer: on the host, or on the device of ``like`` (a
        :class:`~collectives.device.DeviceArray`)."""
        self.data = np.empty(self.count, self.dtype) if like is None else device_ops.empty(like, (self.count,),
                                                                                           self.dtype)
        return self

    def view(self, name):
        """The slot of ``name`` in the flat buffer, shaped like its array."""
        start, stop = self.slices[name]
        if isinstance(self.data, DeviceArray):
            return device_ops.part(self.data, start, stop, self.shapes[name])
        return self.data[start:stop].reshape(self.shapes[name])


def plan_buckets(entries, first_bucket_bytes=FIRST_BUCKET_BYTES, bucket_bytes=BUCKET_BYTES):
    """Buckets for ``entries`` (``(name, shape, dtype)``, in the order their arrays are
    expected to become ready), in the order they are to be reduced.

    One dtype per bucket. The first bucket of each dtype is capped at
    ``first_bucket_bytes``, later ones at ``bucket_bytes``; an array larger than the
    cap gets a bucket of its own. Deterministic: the same entries give the same buckets
    on every rank. Buffers are not allocated here (``Bucket.allocate``).
    """
    entries = list(entries)
    buckets = []
    filling = {}  # dtype -> the bucket being filled
    for name, shape, dtype in entries:
        dtype = np.dtype(dtype)
        size = int(np.prod(shape, dtype=np.int64))
        bucket = filling.get(dtype)
        if bucket is None or (bucket.count and bucket.nbytes + size * dtype.itemsize > bucket.cap):
            cap = bucket_bytes if bucket is not None else first_bucket_bytes
            bucket = Bucket(len(buckets), dtype, cap)
            buckets.append(bucket)
            filling[dtype] = bucket
        bucket.add(name, shape, size)
    # A bucket is full when its last entry is ready; buckets of different dtypes fill
    # in interleaved order, so number them by that (a dtype's first bucket may stay
    # open long after later buckets of another dtype are full).
    position = {name: i for i, (name, _, _) in enumerate(entries)}
    buckets.sort(key=lambda b: position[b.names[-1]])
    for index, bucket in enumerate(buckets):
        bucket.index = index
    return buckets


# -- checks across ranks ---------------------------------------------------------------
def _digest_rows(comm, rows):
    """Every rank's 16-byte digests of ``rows`` (one per row): shape ``(size, len(rows), 16)``."""
    mine = np.array([np.frombuffer(hashlib.blake2b(row, digest_size=16).digest(), np.uint8) for row in rows],
                    dtype=np.uint8).reshape(len(rows), 16)
    return comm.allgather(mine)


def _layout(named):
    return [(name, tuple(array.shape), str(array.dtype)) for name, array in named]  # str: 'bfloat16', '>f4'...


def check_same_layout(named, comm, what="params"):
    """Raise :class:`TrainingError` on every rank unless every rank passed the same names,
    shapes and dtypes in the same order. Collective: one small allgather (and, only on
    a mismatch, rank 0's layout broadcast so each rank can say what differs)."""
    layout = _layout(named)
    everyone = _digest_rows(comm, [repr(layout).encode()])
    differ = [r for r in range(comm.size) if not np.array_equal(everyone[r], everyone[0])]
    if not differ:
        return
    reference = comm.broadcast_object(layout, root=0)
    detail = ""
    if comm.rank in differ:
        detail = f" Here (rank {comm.rank}): {_first_difference(reference, layout)}."
    raise TrainingError(
        f"{what} differ between ranks: rank(s) {', '.join(map(str, differ))} passed other names, shapes or "
        f"dtypes than rank 0.{detail} Every rank must build the same model and pass its parameters in the "
        "same order."
    )


def _first_difference(reference, layout):
    for i, (want, got) in enumerate(zip(reference, layout)):
        if want != got:
            return (f"entry {i} is {got[0]!r} shape {got[1]} dtype {got[2]}, rank 0 has "
                    f"{want[0]!r} shape {want[1]} dtype {want[2]}")
    return f"{len(layout)} entries, rank 0 has {len(reference)}"


def check_parameters(params, comm=None):
    """Raise :class:`TrainingError` on every rank if the ranks' parameters are not
    identical: the same names, shapes and dtypes, and bit-for-bit the same values.
    The message names the parameters and the ranks that differ from rank 0.
    Collective; costs two small allgathers (16 bytes per parameter)."""
    comm = _communicator(comm)
    named = named_arrays(params)
    check_same_layout(named, comm)
    everyone = _digest_rows(comm, [_host_copy(array).tobytes() for _, array in named])
    problems = []
    for i, (name, _) in enumerate(named):
        ranks = [r for r in range(comm.size) if not np.array_equal(everyone[r, i], everyone[0, i])]
        if ranks:
            problems.append(f"{name!r} on rank(s) {', '.join(map(str, ranks))}")
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise TrainingError(
            f"parameters differ from rank 0's: {shown}. Broadcast them from one rank "
            "(broadcast_parameters) before training, and make every rank take the same steps."
        )


# -- broadcast ---------------------------------------------------------------------------
def broadcast_parameters(params, root=0, comm=None, bucket_bytes=BUCKET_BYTES):
    """Overwrite ``params`` (arrays, in place) on every rank with ``root``'s values.

    Arrays of any dtype are packed as bytes into few buffers of at most
    ``bucket_bytes`` and broadcast bucket by bucket. Collective: every rank must pass
    the same names, shapes and dtypes (checked first; a mismatch raises
    :class:`TrainingError` everywhere). Returns ``params``.
    """
    comm = _communicator(comm)
    root = check_root(root, comm.size)
    named = named_arrays(params)
    for name, array in named:
        if isinstance(array, np.ndarray) and not array.flags.writeable:
            raise ValueError(f"params[{name!r}] must be writable: broadcast_parameters fills it in place")
        if array.dtype.hasobject:
            raise TypeError(f"params[{name!r}] holds Python objects (dtype {array.dtype}): only arrays of numbers "
                            "and other plain data can be broadcast")
    check_nbytes(bucket_bytes, "bucket_bytes")
    check_same_layout(named, comm)
    if named and isinstance(named[0][1], DeviceArray):  # in place on the device, one call per array
        for _, array in named:
            comm.broadcast(array, root=root)
        return params
    arrays = dict(named)
    entries = [(name, (array.nbytes,), np.uint8) for name, array in named]
    for bucket in plan_buckets(entries, bucket_bytes, bucket_bytes):
        bucket.allocate()
        if comm.rank == root:
            for name in bucket.names:
                bucket.view(name)[...] = _bytes_of(arrays[name])
        comm.broadcast(bucket.data, root=root)
        if comm.rank != root:
            for name in bucket.names:
                array = arrays[name]
                array[...] = bucket.view(name).view(array.dtype).reshape(array.shape)
        bucket.data = None  # one bucket's buffer at a time, not a second copy of the model
    return params


def _bytes_of(array):
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _host_copy(array):
    """A host NumPy copy of a device array (a view of a host one)."""
    if not isinstance(array, DeviceArray):
        return np.ascontiguousarray(array)
    flat = array if array.contiguous else _contiguous(array)
    host = np.empty(array.shape, array.dtype)
    device_ops.to_host(flat, host)
    return host


def _contiguous(array):
    flat = device_ops.empty(array, array.shape)
    device_ops.copy(flat, array)
    return flat


# -- gradient reduction ------------------------------------------------------------------
class GradientReducer:
    """Averages gradients over the ranks in fused buckets, overlapped with backward.

    Call :meth:`gradient_ready` for each parameter as soon as its gradient is complete
    (in any order), then :meth:`synchronize`, which waits for the allreduces and writes
    the average over the ranks back into the gradient arrays. Construction is
    collective and checks that every rank passed the same parameter layout.

    - ``backward_passes_per_step=k``: gradient accumulation. Each parameter is expected
      ``k`` times per step; the first ``k-1`` calls only count (the caller accumulates,
      as PyTorch does in ``.grad``), the ``k``-th hands over the accumulated gradient.
      :meth:`no_sync` does the same for the backward passes inside it.
    - ``compression="fp16"`` or ``"bf16"`` (needs ml_dtypes): each bucket is divided by
      the world size first (so the sum cannot overflow), sent and summed as float16 or
      bfloat16, and cast back; the gradients keep their dtype. ``None`` sends them as
      they are, summed then divided.
    - ``op="sum"``: the gradients are summed over the ranks instead of averaged
      (Horovod's ``op=Sum``); compression then sends each bucket undivided.
    - ``algorithm``: the allreduce algorithm ("auto" picks per bucket size).
    - ``deterministic=True``: every bucket's sum is the left fold over the ranks in rank
      order (see :class:`~collectives.Communicator`), so the averaged gradients, and the
      training, reproduce bit for bit across runs at one world size. None: ``comm``'s.
    - ``progress_thread=True``: a background thread advances the allreduces while the
      caller computes (needs ``MPI_THREAD_MULTIPLE``, mpi4py's default).

    The reducer works on a private duplicate of ``comm``; :meth:`close` frees it. If
    starting or advancing an allreduce fails, the reducer is broken: every later call
    raises that error (its buckets may be partly reduced, so no result is given).
    Every rank must hand over every gradient: a rank that raises (e.g. a gradient
    missing in :meth:`synchronize`) leaves the others waiting for its buckets.
    """

    def __init__(self, params, comm=None, *, first_bucket_bytes=FIRST_BUCKET_BYTES, bucket_bytes=BUCKET_BYTES,
                 backward_passes_per_step=1, compression=None, algorithm="auto", progress_thread=False,
                 poll_interval=50e-6, deterministic=None, op="avg"):
        named = named_arrays(params)
        for name, array in named:
            if array.dtype.kind not in "fc" and array.dtype not in EXTRA_DTYPES:
                raise TypeError(f"params[{name!r}] has dtype {array.dtype.name}: gradients are averaged, so "
                                "parameters must be floating or complex (leave integer state out of params)")
        check_nbytes(first_bucket_bytes, "first_bucket_bytes")
        check_nbytes(bucket_bytes, "bucket_bytes")
        k = backward_passes_per_step
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"backward_passes_per_step must be a positive integer; got {k!r}")
        if not isinstance(op, str) or op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' (the mean over the ranks) or 'sum'; got {op!r}")
        if not isinstance(compression, (str, type(None))) or compression not in COMPRESSIONS:
            names = ", ".join(repr(c) for c in COMPRESSIONS)
            raise ValueError(f"compression must be one of {names}; got {compression!r}")
        if compression == "bf16" and _BFLOAT16 is None:
            raise ValueError("compression='bf16' needs ml_dtypes for NumPy's bfloat16: pip install ml_dtypes")
        wire = COMPRESSIONS[compression]
        for name, array in named if wire is not None else ():
            if array.dtype.kind != "f" or array.dtype.itemsize <= wire.itemsize:
                raise TypeError(f"compression={compression!r} sends 16-bit floats, for float32 or float64 gradients; "
                                f"params[{name!r}] is {array.dtype}: leave compression off")
        self.algorithm = check_algorithm("allreduce", algorithm)
        if self.algorithm == "native" and (
                (wire is not None and is_extra(wire)) or any(is_extra(a.dtype) for _, a in named)):
            raise ValueError("algorithm 'native' cannot reduce bfloat16 (the MPI library has no type for it); "
                             "use one of the library's algorithms or 'auto'")
        if isinstance(poll_interval, bool) or not isinstance(poll_interval, (int, float)) or not poll_interval >= 0:
            raise ValueError(f"poll_interval must be a non-negative number of seconds; got {poll_interval!r}")
        if progress_thread and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise ValueError("progress_thread=True needs MPI initialised with MPI_THREAD_MULTIPLE (the thread calls "
                             "MPI while yours may too); this MPI provides less: leave progress_thread off")
        comm = _communicator(comm)
        if deterministic is not None and not isinstance(deterministic, bool):
            raise TypeError(f"deterministic must be True, False or None (comm's); got {deterministic!r}")
        if (comm.deterministic if deterministic is None else deterministic) and self.algorithm != "auto":
            check_ordered("allreduce", self.algorithm)
        check_same_layout(named, comm)

        self.backward_passes_per_step = int(k)
        self.compression = compression
        self.op = op
        self.names = [name for name, _ in named]
        # Backward produces the last parameters' gradients first: lay them out first.
        entries = [(name, array.shape, array.dtype) for name, array in reversed(named)]
        # On a device, the buckets (and compression's wire buffers) live on that device.
        self._on_device = named[0][1] if named and isinstance(named[0][1], DeviceArray) else None
        like = self._on_device
        self.buckets = [b.allocate(like) for b in plan_buckets(entries, first_bucket_bytes, bucket_bytes)]
        self._bucket_of = {name: b for b in self.buckets for name in b.names}
        self._wire = [None if wire is None else np.empty(b.count, wire) if like is None
                      else device_ops.empty(like, (b.count,), wire) for b in self.buckets]
        # A private communicator: the buckets' calls start when gradients arrive, which
        # may interleave differently with the caller's own async calls on each rank.
        self._comm = comm.dup(deterministic=deterministic)
        self._no_sync = False
        self._reset()

        self._lock = threading.Condition()
        self._error = None  # set when starting or advancing a bucket failed: every later call raises it
        self._closed = False
        self._thread = None
        if progress_thread:
            self._poll_interval = float(poll_interval)
            self._thread = threading.Thread(target=self._progress_loop, name="collectives-progress", daemon=True)
            self._thread.start()

    # -- the step ------------------------------------------------------------------
    def gradient_ready(self, name, grad):
        """Hand over ``name``'s gradient (an array shaped and typed like the parameter),
        complete for this backward pass. On the pass that completes a step, it is copied
        into its bucket, and every bucket that is now full starts its allreduce (in
        bucket order). ``grad`` receives the averaged gradient once its bucket has
        finished (at the latest in :meth:`synchronize`): leave it alone until then."""
        bucket = self._bucket_of.get(name)
        if bucket is None:
            raise ValueError(f"name {name!r} is not one of the reducer's parameters")
        if self._on_device is None:
            if not isinstance(grad, np.ndarray):
                raise TypeError(f"grad for {name!r} must be a numpy.ndarray; got {type(grad).__name__}")
        elif not isinstance(grad, DeviceArray):
            if not device.is_device(grad):
                raise TypeError(f"grad for {name!r} must be a device array on {self._on_device.where} like the "
                                f"parameters; got {type(grad).__name__}")
            grad = device.as_device_array(grad, f"grad for {name!r}")
        if grad.shape != bucket.shapes[name] or grad.dtype != bucket.dtype:
            raise ValueError(f"grad for {name!r} must have shape {bucket.shapes[name]} and dtype {bucket.dtype.name} "
                             f"like the parameter; got shape {grad.shape}, dtype {grad.dtype.name}")
        self._check_usable()
        if self._no_sync:
            return
        passes = self._passes[name] + 1
        if passes > self.backward_passes_per_step:
            raise TrainingError(
                f"the gradient of {name!r} arrived {passes} times before synchronize(), but "
                f"backward_passes_per_step={self.backward_passes_per_step}: call synchronize() (the optimizer's "
                "step) after each step's backward passes, or increase backward_passes_per_step to accumulate "
                "gradients locally over more passes"
            )
        self._passes[name] = passes
        if passes == self.backward_passes_per_step:
            if isinstance(grad, DeviceArray):  # on the stream the gradient was computed on
                if self._stream is None:
                    self._stream = grad.stream  # the step's stream: the buckets' calls follow it
                device_ops.copy(bucket.view(name), grad, grad.stream)
                device_ops.follow(self._stream, grad.stream, grad.backend)  # a gradient of another stream
            else:
                np.copyto(bucket.view(name), grad)
            self._grads[name] = grad
            self._waiting[bucket.index] -= 1
            if self._waiting[bucket.index] == 0:
                self._start_full_buckets()
        if self._thread is None:
            self._poll()

    def synchronize(self):
        """Wait for every bucket's allreduce and write the averaged gradients into the
        arrays given to :meth:`gradient_ready` (a read-only one gets a copy; buckets
        that finished while backward ran were written back already). Returns
        ``{name: averaged gradient}`` in parameter order. Raises :class:`TrainingError`
        if some gradient has not arrived ``backward_passes_per_step`` times."""
        if self._no_sync:
            raise TrainingError("synchronize() inside no_sync(): leave the no_sync() block first, and run the "
                                "backward pass that completes the step outside it")
        self._check_usable()
        missing = [name for name in self.names if self._passes[name] < self.backward_passes_per_step]
        if missing:
            self._wait_started()  # every rank started these: finishing them keeps the ranks matched
            self._reset()
            shown = ", ".join(repr(n) for n in missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise TrainingError(
                f"synchronize() before every gradient arrived: {len(missing)} of {len(self.names)} parameters "
                f"({shown}) were not handed over {self.backward_passes_per_step} time(s) this step. Run the "
                "backward pass(es) and call gradient_ready for every parameter before stepping; a parameter "
                "that takes no part in the loss must be left out of the reducer's params."
            )
        if self._next < len(self.buckets):  # every gradient arrived, so every bucket must have started
            raise TrainingError(f"bucket {self._next} never started its allreduce")
        self._unpack_finished(wait=True)
        averaged = self._averaged
        self._reset()
        return {name: averaged[name] for name in self.names}

    def missing(self):
        """``{name: hand-overs still expected}`` for every parameter whose gradient has not
        yet arrived ``backward_passes_per_step`` times this step (empty once all have:
        :meth:`synchronize` raises for the others)."""
        k = self.backward_passes_per_step
        return {name: k - passes for name, passes in self._passes.items() if passes < k}

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside do not communicate: :meth:`gradient_ready` ignores them
        and the caller accumulates (as ``.grad`` does in PyTorch). The next pass outside
        hands over the accumulated gradients, as DDP's ``no_sync``."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield self
        finally:
            self._no_sync = previous

    def close(self):
        """Stop the progress thread and free the private communicator (collective).
        Unfinished allreduces are waited for first (unless the reducer is broken)."""
        if self._closed:
            return
        if self._error is None:
            self._wait_started()
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._comm.free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- machinery -------------------------------------------------------------------
    def _reset(self):
        self._stream = None  # device: the stream of the step's first gradient, which the buckets follow
        self._passes = dict.fromkeys(self.names, 0)
        self._grads = {}
        self._waiting = [len(b.names) for b in self.buckets]
        self._handles = []  # started allreduces, in bucket order
        self._next = 0  # the next bucket to start
        self._unpacked = 0  # buckets whose averages are written back
        self._averaged = {}  # name -> the array holding its averaged gradient

    def _start_full_buckets(self):
        """Start the allreduce of every full bucket whose predecessors have started: the
        same order on every rank, whatever order the gradients came in."""
        with self._lock:
            while self._next < len(self.buckets) and self._waiting[self._next] == 0:
                bucket, wire = self.buckets[self._next], self._wire[self._next]
                try:
                    if isinstance(bucket.data, DeviceArray):  # the calls follow the gradients' stream
                        bucket.data.stream = self._stream
                        if wire is not None:
                            wire.stream = self._stream
                    if wire is None:
                        handle = self._comm.allreduce_async(bucket.data, op=self.op, algorithm=self.algorithm,
                                                            out=bucket.data)
                    else:  # divide first: the sum of the ranks' shares cannot overflow 16 bits
                        divisor = self._comm.size if self.op == "avg" else 1
                        if isinstance(wire, DeviceArray):
                            device_ops.cast(wire, bucket.data, divisor)  # one kernel: divide and cast
                        else:
                            if divisor != 1:
                                np.divide(bucket.data, divisor, out=bucket.data)
                            ops_layer.cast(wire, bucket.data)
                        handle = self._comm.allreduce_async(wire, op="sum", algorithm=self.algorithm, out=wire)
                except Exception as exc:
                    self._error = exc
                    raise
                self._handles.append(handle)
                self._next += 1
            self._lock.notify_all()

    def _poll(self):
        """Advance the allreduces in flight without blocking, as far as they can go, and
        write back the buckets that have finished; returns how many are still in flight."""
        if not self._handles:
            return 0
        try:
            in_flight = self._comm.poll()
        except Exception as exc:
            self._error = exc
            raise
        self._unpack_finished()
        return in_flight

    def _unpack_finished(self, wait=False):
        """Write back the averages of the started buckets that have finished, in bucket
        order (while backward still runs, where polled); with ``wait``, of all of them."""
        with self._lock:
            while self._unpacked < len(self._handles):
                handle = self._handles[self._unpacked]
                try:
                    if wait:
                        handle.wait()
                    elif not handle.test():
                        return
                except Exception as exc:
                    self._error = exc
                    raise
                self._unpack(self.buckets[self._unpacked], self._wire[self._unpacked])
                self._unpacked += 1

    def _unpack(self, bucket, wire):
        if isinstance(bucket.data, DeviceArray):  # kernels on the step's stream, then each gradient's
            if wire is not None:
                device_ops.cast(bucket.data, wire)
            for name in bucket.names:
                grad = self._grads[name]
                device_ops.follow(grad.stream, bucket.data.stream, grad.backend)
                device_ops.copy(grad, bucket.view(name), grad.stream)
                self._averaged[name] = grad.original
            return
        if wire is not None:
            ops_layer.cast(bucket.data, wire)
        for name in bucket.names:
            grad = self._grads[name]
            if grad.flags.writeable:
                np.copyto(grad, bucket.view(name))
            else:
                grad = bucket.view(name).copy()
            self._averaged[name] = grad

    def _wait_started(self):
        with self._lock:
            try:
                for handle in self._handles:
                    handle.wait()
            except Exception as exc:
                self._error = exc
                raise

    def _check_usable(self):
        if self._closed:
            raise TrainingError("the reducer is closed")
        if self._error is not None:
            raise TrainingError(f"the reducer is broken by an earlier error: {self._error}") from self._error

    def _progress_loop(self):
        """The progress thread: poll the allreduces in flight until the reducer closes."""
        while True:
            with self._lock:
                if self._closed:
                    return
                try:
                    in_flight = self._poll()  # this private communicator carries only our buckets
                except Exception:  # noqa: BLE001 - _poll kept it: the caller's next call raises it
                    in_flight = 0
                if in_flight == 0 or self._error is not None:
                    self._lock.wait()  # until a bucket starts or the reducer closes
                    continue
            time.sleep(self._poll_interval)  # lets the caller's thread have the GIL
