"""One collective call on device arrays: its flat buffers, its plan, its result.

The device twin of the host routes (``collectives.call.host_buffers`` and ``collectives.routes``):
the same checks have run and the same algorithm was chosen; here the user's arrays
become flat contiguous device buffers (a non-contiguous one is packed by a kernel into
workspace, and a non-contiguous ``out`` unpacked at the end), the plan is cut into
device segments and run by :class:`~.device.DevicePlanHandle` (or, for ``native``, the
MPI library's collective on host copies), and the result comes back as the kind of
array the user passed, ready on the user's stream.
"""

from .buffers import Buffers
from .device import DeviceNativeHandle, DevicePlanHandle, NativeOnDevice


def extent(data):
    """``(lo, hi)``: the bytes a device array may touch."""
    ptr = data.ptr if hasattr(data, "ptr") else data.data.ptr
    if data.flags.c_contiguous:  # (a call's arrays mostly are: no walk over the dimensions)
        return ptr, ptr + data.nbytes
    lo = hi = ptr
    for n, stride in zip(data.shape, data.strides):
        if n == 0:
            return ptr, ptr
        lo += min(0, (n - 1) * stride)
        hi += max(0, (n - 1) * stride)
    return lo, hi + data.itemsize


def same_memory(a, b):
    return a is b or (a.shape == b.shape and a.strides == b.strides and extent(a) == extent(b))


def overlaps(a, b):
    (lo1, hi1), (lo2, hi2) = extent(a), extent(b)
    return lo1 < hi2 and lo2 < hi1 and a.size and b.size


class DeviceCall:
    """Buffers and finishing steps of one call (see the module docstring)."""

    def __init__(self, ctx, x, dtype, defer=False):
        self.ctx, self.backend, self.dtype = ctx, ctx.backend, dtype
        self.user_stream = x.stream
        self.storage = x.data.dtype
        self._workspace = []  # raw buffers to give back when the call is over
        self._after = []  # kernels at the end: (kind, args)
        self._before = [] if defer else None  # with ``defer``: the packing, run by prologue(stream)
        self._packed = False
        self.pinned = []  # pinned buffers of a native call
        self.inputs_ready = None  # event: the call's inputs are in place (begin, then packing)

    def flat(self, array):
        """A contiguous flat view of a device array's data, packing it into workspace if
        it is not contiguous (a kernel queued now, on the compute stream)."""
        if array.flags.c_contiguous:
            return array.reshape(-1)
        buffer = self.workspace(array.size)
        self._queue(lambda stream: self.backend.pack(stream, buffer, array))
        self._packed = True
        return buffer

    def _queue(self, work):
        """Run ``work(stream)`` on the compute stream now, or (``defer``) in :meth:`prologue`."""
        if self._before is None:
            work(self.ctx.compute)
        else:
            self._before.append(work)

    def prologue(self, stream):
        """The packing a deferred call queued, on ``stream`` (once it waits for the user's)."""
        for work in self._before:
            work(stream)

    def workspace(self, count):
        raw, buffer = self.ctx.take_workspace(count, self.storage)
        if raw is not None:
            self._workspace.append(raw)
        return buffer

    def copy_of(self, array):
        """A snapshot of ``array`` (it overlaps the output)."""
        buffer = self.workspace(array.size)
        if array.flags.c_contiguous:
            self._queue(lambda stream: self.backend.copy(buffer, array.reshape(-1), stream))
        else:
            self._queue(lambda stream: self.backend.pack(stream, buffer, array))
        self._packed = True
        return buffer

    def output(self, out, shape, x=None, allow_inplace=True):
        """``(result flat buffer, inplace, what to return)`` for an output of ``shape``:
        ``out`` (a DeviceArray) if given, else a new array like ``x``."""
        if out is None:
            data = x.allocate(shape)
            return data.reshape(-1), False, x.rewrap(data)
        inplace = allow_inplace and x is not None and same_memory(x.data, out.data)
        if out.data.flags.c_contiguous:
            return out.data.reshape(-1), inplace, out.original
        buffer = self.flat(out.data) if inplace else self.workspace(out.size)
        self._after.append(("unpack", out.data, buffer))
        return buffer, inplace, out.original

    def unpack_at_end(self, data, buffer):
        """Write ``buffer`` back into the non-contiguous ``data`` once the call is over."""
        self._after.append(("unpack", data, buffer))

    def divide_at_end(self, buffer, divisor):
        self._after.append(("divide", buffer, divisor))

    def begin(self):
        """Order the call after the user's work on their stream (see DeviceContext.begin)."""
        self.inputs_ready = self.ctx.begin(self.user_stream)

    def ready(self):
        """After the packing kernels: the other streams wait for them."""
        if self._packed:
            self.inputs_ready = self.ctx.fan_out()

    def finish(self):
        """The last kernels (avg's division, unpacking), then the user's stream waits for
        the call's work; workspace goes back to the pool."""
        self.ctx.join()
        self.epilogue(self.ctx.compute)
        self.ctx.end(self.user_stream)
        self.release()

    def has_epilogue(self):
        """Whether :meth:`epilogue` has anything to queue."""
        return bool(self._after)

    def epilogue(self, stream):
        """The call's last kernels on ``stream``: avg's division, then the unpacking of a
        strided result (which copies the final values)."""
        for kind, a, b in self._after:
            if kind == "divide" and b > 1 and a.size:
                self.backend.divide(stream, self.dtype, a, b)
        for kind, a, b in self._after:
            if kind == "unpack":
                self.backend.unpack(stream, a, b)

    def release(self):
        """Give the call's workspace back to the pool (its last work is queued)."""
        for raw in self._workspace:
            self.ctx.workspace.give(raw)
        self._workspace = []


def start_plan(progress, describe, finish, comm, tag, plan, inp, out, op, work, timeout, sequence):
    """Start a device plan handle for ``work`` (a :class:`DeviceCall`), whose workspace
    gives ``tmp``, as the call numbered ``sequence``."""
    buffers = Buffers(inp, out, work.workspace(plan.tmp))
    return DevicePlanHandle(progress, describe, finish, comm, tag, plan, buffers, op, work, timeout, sequence).start()


def start_native(progress, describe, finish, call, start_mpi, dev_in, dev_out, one_buffer, timeout, sequence,
                 nbytes, deferred, agree_comm=None, unit=0):
    """Start ``native`` on device buffers: MPI's collective on pinned host copies of
    ``dev_in``/``dev_out`` (``dev_out`` None: no result here; ``one_buffer``: the
    collective works in one buffer, as broadcast), or on the device buffers themselves
    with a CUDA-aware MPI; posted on ``deferred``'s communicator in call order, after
    the ranks agree on ``unit`` bytes on ``agree_comm`` where it is given
    (:class:`~.device.DeviceNativeHandle`)."""
    ctx = call.ctx
    host_in = host_out = None
    if not ctx.cuda_aware:
        if dev_in is not None:
            raw = ctx.pinned.take(dev_in.nbytes)
            call.pinned.append(raw)
            host_in = raw[: dev_in.nbytes].view(dev_in.dtype)
        if one_buffer:
            host_out = host_in
        elif dev_out is not None:
            raw = ctx.pinned.take(dev_out.nbytes)
            call.pinned.append(raw)
            host_out = raw[: dev_out.nbytes].view(dev_out.dtype)

    def finish_then_release():
        result = finish()
        for raw in call.pinned:  # the last copy out of it runs on the device: free once that has
            ctx.pinned.give(raw, after=ctx.last_end)
        return result

    native = NativeOnDevice(start_mpi, dev_in, dev_out, host_in, host_out, nbytes, deferred, agree_comm, unit)
    handle = DeviceNativeHandle(progress, describe, finish_then_release, ctx, native, timeout, sequence)
    return handle.start()
