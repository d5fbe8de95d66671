"""Calls of the peer-read algorithms (``one_shot``, ``two_shot``, ``leader``) on device arrays of
ranks that share a node: the device executor of :mod:`collectives.transport.device_node`
runs their plans, reading the other ranks' buffers through CUDA IPC, two fences per
call. Where the node's ranks cannot open each other's memory (``cuda_ipc=False``, no
shared IPC namespace), a call that ``auto`` sent here runs the cost model's
message-based choice instead (every rank alike: the negotiation's answer is the same
everywhere), and one that named the algorithm raises before any message.

A blocking call of a kind seen before, on contiguous arrays of the device's own type,
takes the lean path (``calls.lean_device_call``): its entry keeps what this route finds
per call (the algorithm, the plan and its phases, the call's code, the device's state),
and the call runs its :class:`~collectives.transport.device_node.PeerCall` to its end at
once, outside the engine, with the same fences, signature, timeout and failure
handling. A warm call then makes no event, plan or allocation (``out=`` or in place)."""

from __future__ import annotations

import time
import zlib
from functools import lru_cache
from typing import Any

from ..algorithms import ORDERED, PEER_READS
from ..auto import cost_model_choice
from ..errors import CollectiveError
from ..transport.lean import Patience
from . import base
from .base import LeanEntry, Route, look, time_out
from .device import DEVICE, device_context


def peer_node(ctx: Any, device: Any, timeout: float | None) -> Any:
    """This communicator's peer-read state on ``device`` (made at its first such call:
    collective over the node, within the call's ``timeout``)."""
    if device.peer is None:
        import numpy as np

        from ..transport.peer_node import PeerNode

        def exchange(words):  # every node rank's words, within the call's timeout
            everyone = np.empty((ctx.node_comm.Get_size(), words.size), np.int64)
            ctx.request("the peer-read set-up", lambda: ctx.node_comm.Iallgather(words, everyone), timeout,
                        everyone.nbytes)
            return everyone

        # every rank of the node is here (a timed barrier) before the blocking window set-up
        ctx.request("the peer-read window's set-up", ctx.node_comm.Ibarrier, timeout)
        device.peer = PeerNode(device, ctx.node_comm, ctx.options.device_fence, exchange)
        # auto's device choices from now on know the node's GPUs and fences (the kinds
        # of call resolved before did not: made anew)
        peer = device.peer
        ctx.selector.learn_gpus(peer.gpus, ctx.node_comm.Get_size(), peer.fence)
        ctx.call_kinds.clear()
    return device.peer


def register(ctx: Any, device: Any, array: Any, nbytes: int, timeout: float | None) -> None:
    """Open every node rank's ``array`` (collective: each passes its own, of ``nbytes``)
    in every other, so that calls on it find it open (``Communicator.empty(device=)``),
    and remember every rank's, so that with in-kernel fences a call on it need not ask
    where the others' are. Nothing to do where the node's ranks cannot open each
    other's memory."""
    if not device.ipc_everywhere or ctx.size == 1:
        return
    import numpy as np

    from ..transport.peer_window import check_shareable

    node = peer_node(ctx, device, timeout)
    mine = node.descriptor(array, nbytes)
    everyone = np.empty((ctx.node_comm.Get_size(), mine.size), np.int64)
    ctx.request("empty()", lambda: ctx.node_comm.Iallgather(mine, everyone), timeout, everyone.nbytes)
    check_shareable(everyone, "registered array", "empty()")  # every rank alike, before opening any
    for rank, words in enumerate(everyone):
        if rank != node.window.rank:
            node.open(rank, words, "registered array")
    node.remember(array, everyone)


def _leader_only_on_one_gpu(call: Any, node: Any) -> None:
    """Until the first peer-read call has learnt whether the node's ranks share one GPU
    (``peer_node``), the device cost model takes them to: where they do not
    (``node.one_gpu``, the same answer on every rank), auto's leader, chosen before
    that, becomes one_shot, as rank 0's GPU would carry every rank's traffic alone. A
    named leader runs."""
    if call.auto and call.algorithm == "leader" and not node.one_gpu:
        call.algorithm = "one_shot"


@lru_cache(maxsize=1024)
def call_code(spec: Any, algorithm: str, dtype: Any, op: str) -> int:
    """A number naming a call's kind, which the ranks compare at its first fence."""
    op = op if spec.reduces else "-"
    return zlib.crc32(f"{spec.name}/{algorithm}/{dtype.name}/{dtype.itemsize}/{op}/peer".encode()) & 0x7FFFFFFF


class PeerRead(Route):
    """A peer-read algorithm's call on device arrays (checked, numbered, resolved); on
    the lean path (``calls.lean_device_call``), a blocking one run to its end at once."""

    name, lean = "device peer reads", True

    def takes(self, ctx, call):
        return call.device and (call.spec.name, call.algorithm) in PEER_READS

    def run(self, ctx, call):
        from ..transport import device_call
        from ..transport.device_node import PeerCall, PeerHandle, PeerWork

        spec, x, out, rank = call.spec, call.where, call.out, ctx.rank
        device = device_context(ctx, x.backend, call.timeout)
        if not device.ipc_everywhere:
            if not call.auto:
                why = "".join(f"; this rank could not open rank {peer}'s ({reason})"
                              for peer, reason in sorted(device.ipc_refusals.items()))
                raise ValueError(f"algorithm {call.algorithm!r} reads the other ranks' device buffers through CUDA "
                                 "IPC, which some ranks of this node cannot open (cuda_ipc=False, or no shared IPC "
                                 f"namespace or peer access{why}); use 'ring' or 'auto'")
            call.algorithm = _instead(ctx, spec.name, call.nbytes)
            return DEVICE.run(ctx, call)
        node = peer_node(ctx, device, call.timeout)
        _leader_only_on_one_gpu(call, node)
        backend = x.backend
        backend.prepare(x.dtype)  # compiles its kernels at the first call on a dtype
        describe = f"{spec.name}(algorithm={call.algorithm!r}, {x.where}) call #{ctx.sequence}"
        work = device_call.DeviceCall(device, x, x.dtype, defer=True)
        started = node.take_event()
        backend.record(started, x.stream)  # the user's work before this call, not after it
        leaf = spec.root_result and rank != call.root  # no result here
        returned = None
        if spec.one_buffer:
            result = inp = work.flat(x.data)
            if not x.data.flags.c_contiguous:
                work.unpack_at_end(x.data, result)
            inplace, returned = True, x.original
        elif leaf:
            inp, result, inplace = work.flat(x.data), None, False
        else:
            result, inplace, returned = work.output(out, call.shape, x, allow_inplace=spec.inplace)
            if inplace:
                inp = result
            elif out is not None and device_call.overlaps(x.data, out.data):
                inp = work.copy_of(x.data)
            else:
                inp = work.flat(x.data)
        plan = base.compiled_plan(spec.name, call.algorithm, rank, ctx.size, call.count, call.root, 1, inplace,
                                  ctx.options.deterministic, 0)
        divisor = None  # avg: the leader's fold divides as it writes every rank's output; else each rank after
        if spec.reduces and call.op == "avg" and result is not None:
            if plan.shared_out:
                divisor = ctx.size
            else:
                work.divide_at_end(result, ctx.size)
        raw, tmp = device.take_workspace(plan.tmp, inp.dtype) if plan.tmp else (None, inp[:0])
        arrays = {"in": inp, "out": result if result is not None else inp[:0], "tmp": tmp}
        signature = (ctx.sequence, call_code(spec, call.algorithm, x.dtype, call.op), inp.nbytes, call.root)
        run = PeerCall(node, PeerWork(plan, arrays, call.count, call.op, x.dtype, signature, describe, started,
                                      before=work.prologue, after=work.epilogue if work.has_epilogue() else None,
                                      # an in-kernel wait gives up first, so that the host can still name who
                                      # did not come
                                      limit=None if call.timeout is None else 0.8 * call.timeout,
                                      divisor=divisor))

        def finish():
            if raw is not None:
                device.workspace.give(raw)
            work.release()
            return returned

        handle = PeerHandle(ctx.progress, describe, finish, run, call.timeout, ctx.sequence).start()
        return handle.wait() if call.blocking else handle

    def set_up(self, ctx, backend):
        """Whether what the lean path needs on ``backend``'s device is made: the device
        negotiated, and the peer-read state too where the node's ranks can open each
        other's memory (the general path makes both, collectively, at its first call)."""
        device = ctx.devices.get(backend)
        return device is not None and (device.peer is not None or not device.ipc_everywhere)

    def lean_entry(self, ctx, call):
        """What the lean path keeps for blocking calls of ``call``'s kind on contiguous
        device arrays (:meth:`set_up` said yes): the plan, its code, the device's
        peer-read state; each call then runs its :class:`PeerCall` here (:func:`_lean_run`)."""
        x = call.where
        device = ctx.devices[x.backend]
        if not device.ipc_everywhere:
            return None  # auto runs a message-based algorithm there, a named one raises: the general path
        x.backend.prepare(x.dtype)  # (compiled already: the general path ran a call on the device)
        _leader_only_on_one_gpu(call, device.peer)
        spec, algorithm = call.spec, call.algorithm
        entry = LeanEntry(self, spec, algorithm, call.count, call.op, call.root)
        entry.plan = base.compiled_plan(spec.name, algorithm, ctx.rank, ctx.size, call.count, call.root, 1,
                                        call.inplace, ctx.options.deterministic, 0)
        entry.code = call_code(spec, algorithm, x.dtype, call.op)
        entry.run = _lean_run(ctx, entry, device, x, call.inplace)
        return entry

    def barrier(self, ctx, backend, timeout):
        """``Communicator.barrier(device=...)`` (numbered already): one fence of this
        executor, a plan of nothing else, where the node's ranks can open each other's
        memory; else each rank waits for its current stream and the ranks meet in MPI."""
        import numpy as np

        from ..transport.device_node import PeerCall, PeerHandle, PeerWork

        device = device_context(ctx, backend, timeout)
        if not device.ipc_everywhere or ctx.size == 1:
            backend.synchronize_stream(backend.current_stream())
            ctx.request("barrier", ctx.comm.Ibarrier, timeout)
            return
        node = peer_node(ctx, device, timeout)
        started = node.take_event()
        backend.record(started, backend.current_stream())
        nothing = node.nothing
        describe = f"barrier(device={backend.kind}) call #{ctx.sequence}"
        run = PeerCall(node, PeerWork(_BARRIER, {"in": nothing, "out": nothing, "tmp": nothing}, 1, "-",
                                      np.dtype(np.uint8), (ctx.sequence, _BARRIER_CODE, 0, 0), describe, started,
                                      limit=None if timeout is None else 0.8 * timeout))
        PeerHandle(ctx.progress, describe, _nothing, run, timeout, ctx.sequence).start().wait()


def _lean_run(ctx: Any, entry: LeanEntry, device: Any, x: Any, inplace: bool) -> Any:
    """``run(array, out, shape, timeout)`` of a lean entry: one blocking call of the
    entry's kind on ``array`` (a DeviceArray of contiguous data, the device's own type)
    into ``out`` (of ``shape``, contiguous, not overlapping it; ``array.data`` itself in
    place; None: a new array, or no result on a non-root), numbered already. What
    PeerRead.run makes or looks up per call is found once here (the route, the
    algorithm, the plan and its phases, the call's code, the device's state, the
    message's prefix); the rest is taken as it takes it: a pooled event recorded on the
    user's stream, the workspace pool's buffer, a :class:`PeerCall` (the call's
    numbers, its buffers), run to its end by :func:`_wait` instead of the engine."""
    from ..transport.device_node import PeerCall, PeerWork

    spec, plan, node, backend = entry.spec, entry.plan, device.peer, x.backend
    dtype, storage, count, op, root, size = x.dtype, x.data.dtype, entry.count, entry.op, entry.root, ctx.size
    code, nbytes = entry.code, x.nbytes
    in_place = spec.one_buffer or inplace  # broadcast, or out=x: the input is the result
    leaf = spec.root_result and ctx.rank != root  # no result here
    average = spec.reduces and op == "avg" and size > 1
    divisor = size if average and plan.shared_out else None  # the leader's fold divides (every rank's output)
    prefix = f"{spec.name}(algorithm={entry.algorithm!r}, {x.where}) call #"
    tmp_bytes = plan.tmp * storage.itemsize

    def run(array, out, shape, timeout):
        data = array.data
        started = node.take_event()
        backend.record(started, array.stream)  # the user's work before this call, not after it
        inp = data if data.ndim == 1 else data.reshape(-1)
        if in_place:
            result, returned = inp, data
        elif leaf:
            result = returned = None
        elif out is None:
            returned = array.allocate(shape)  # (on the user's stream, as the general path allocates it)
            result = returned.reshape(-1)
            returned = array.rewrap(returned)
        else:
            result, returned = (out if out.ndim == 1 else out.reshape(-1)), out
        raw, tmp = None, inp[:0]
        if tmp_bytes:  # the pool's buffer (made once), given back at the end: release_memory() may drop it
            raw = device.workspace.take(tmp_bytes)
            tmp = raw[:tmp_bytes].view(storage)
        after = None
        if average and divisor is None and result is not None and result.size:
            def after(stream):
                backend.divide(stream, dtype, result, size)
        sequence = ctx.sequence
        describe = f"{prefix}{sequence}"
        try:
            work = PeerWork(plan, {"in": inp, "out": inp[:0] if result is None else result, "tmp": tmp}, count, op,
                            dtype, (sequence, code, nbytes, root), describe, started, after=after,
                            limit=None if timeout is None else 0.8 * timeout, divisor=divisor)
            running = PeerCall(node, work)
            _wait(ctx, running, backend, timeout, describe)
        except BaseException as exc:  # the engine breaks as on the general path
            if ctx.progress.broken is None:
                ctx.progress.fail(exc if isinstance(exc, Exception) else CollectiveError(
                    f"{describe} was interrupted ({type(exc).__name__})"))
            node.release()  # its queued device work waits at no fence for ever (PeerHandle._on_break)
            raise
        if raw is not None:
            device.workspace.give(raw)
        return returned

    return run


def _wait(ctx: Any, running: Any, backend: Any, timeout: float | None, describe: str) -> None:
    """Run ``running`` (a PeerCall) to its end, waiting as the host's lean path waits
    (``transport.lean.Patience``): the device polled and the call stepped; once it
    moves no more, polled without yielding for ``SPIN`` seconds, then yielding the CPU
    between polls; every ``LOOK_EVERY`` seconds of waiting the other ranks' failure
    notices read and liveness probes answered, and past ``timeout`` seconds the
    engine's timeout error, naming what the call waits for."""
    poll, step = backend.poll, running.step
    start = time.monotonic()
    patience = Patience(lambda: look(ctx, describe))
    while True:
        poll()
        if step():
            if running.done:
                return
            patience.progressed()
        elif patience.idle() and timeout is not None and time.monotonic() - start >= timeout:
            time_out(ctx, describe, running.outstanding, time.monotonic() - start)


def _barrier_plan() -> Any:
    from ..schedule import Fence, Schedule, compile_plan

    return compile_plan(Schedule([Fence()]))


def _instead(ctx: Any, collective: str, nbytes: int) -> str:
    """What ``auto`` runs where the peer-read algorithms cannot: the cost model's
    message-based choice (deterministic mode: one that folds in rank order)."""
    if ctx.options.deterministic and collective in ORDERED:
        return ORDERED[collective][0]
    return cost_model_choice(collective, nbytes, ctx.size, own=True, topology=ctx.topology)


def _nothing() -> None:
    return None


_BARRIER = _barrier_plan()  # a fence and nothing else
_BARRIER_CODE = zlib.crc32(b"barrier/peer") & 0x7FFFFFFF
PEER = PeerRead()
