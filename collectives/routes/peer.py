"""Calls of the peer-read algorithms (``one_shot``, ``two_shot``) on device arrays of
ranks that share a node: the device executor of :mod:`collectives.transport.device_node`
runs their plans, reading the other ranks' buffers through CUDA IPC, two fences per
call. Where the node's ranks cannot open each other's memory (``cuda_ipc=False``, no
shared IPC namespace), a call that ``auto`` sent here runs the cost model's
message-based choice instead (every rank alike: the negotiation's answer is the same
everywhere), and one that named the algorithm raises before any message."""

from __future__ import annotations

import zlib
from functools import lru_cache
from typing import Any

from ..algorithms import ORDERED, PEER_READS, cost_model_choice
from . import base
from .base import Route
from .device import DEVICE, device_context


def peer_node(ctx: Any, device: Any, timeout: float | None) -> Any:
    """This communicator's peer-read state on ``device`` (made at its first such call:
    collective over the node, within the call's ``timeout``)."""
    if device.peer is None:
        import numpy as np

        from ..transport.device_node import PeerNode

        def exchange(words):  # every node rank's words, within the call's timeout
            everyone = np.empty((ctx.node_comm.Get_size(), words.size), np.int64)
            ctx.request("the peer-read set-up", lambda: ctx.node_comm.Iallgather(words, everyone), timeout,
                        everyone.nbytes)
            return everyone

        # every rank of the node is here (a timed barrier) before the blocking window set-up
        ctx.request("the peer-read window's set-up", ctx.node_comm.Ibarrier, timeout)
        device.peer = PeerNode(device, ctx.node_comm, ctx.options.device_fence, exchange)
    return device.peer


def register(ctx: Any, device: Any, array: Any, nbytes: int, timeout: float | None) -> None:
    """Open every node rank's ``array`` (collective: each passes its own, of ``nbytes``)
    in every other, so that calls on it find it open (``Communicator.empty(device=)``).
    Nothing to do where the node's ranks cannot open each other's memory."""
    if not device.ipc_everywhere or ctx.size == 1:
        return
    import numpy as np

    from ..transport.device_node import check_shareable

    node = peer_node(ctx, device, timeout)
    mine = node.descriptor(array, nbytes)
    everyone = np.empty((ctx.node_comm.Get_size(), mine.size), np.int64)
    ctx.request("empty()", lambda: ctx.node_comm.Iallgather(mine, everyone), timeout, everyone.nbytes)
    check_shareable(everyone, "registered array", "empty()")  # every rank alike, before opening any
    for rank, words in enumerate(everyone):
        if rank != node.window.rank:
            node.open(rank, words, "registered array")


@lru_cache(maxsize=1024)
def call_code(spec: Any, algorithm: str, dtype: Any, op: str) -> int:
    """A number naming a call's kind, which the ranks compare at its first fence."""
    op = op if spec.reduces else "-"
    return zlib.crc32(f"{spec.name}/{algorithm}/{dtype.name}/{dtype.itemsize}/{op}/peer".encode()) & 0x7FFFFFFF


class PeerRead(Route):
    """A peer-read algorithm's call on device arrays (checked, numbered, resolved)."""

    name = "device peer reads"

    def takes(self, ctx, call):
        return call.device and (call.spec.name, call.algorithm) in PEER_READS

    def run(self, ctx, call):
        from ..transport import device_call
        from ..transport.device_node import PeerCall, PeerHandle

        spec, x, out, rank = call.spec, call.where, call.out, ctx.rank
        device = device_context(ctx, x.backend, call.timeout)
        if not device.ipc_everywhere:
            if not call.auto:
                raise ValueError(f"algorithm {call.algorithm!r} reads the other ranks' device buffers through CUDA "
                                 "IPC, which some ranks of this node cannot open (cuda_ipc=False, or no shared IPC "
                                 "namespace or peer access); use 'ring' or 'auto'")
            call.algorithm = _instead(ctx, spec.name, call.nbytes)
            return DEVICE.run(ctx, call)
        node = peer_node(ctx, device, call.timeout)
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
        if spec.reduces and call.op == "avg" and result is not None:
            work.divide_at_end(result, ctx.size)
        plan = base.compiled_plan(spec.name, call.algorithm, rank, ctx.size, call.count, call.root, 1, inplace,
                                  ctx.options.deterministic, 0)
        raw, tmp = device.take_workspace(plan.tmp, inp.dtype) if plan.tmp else (None, inp[:0])
        arrays = {"in": inp, "out": result if result is not None else inp[:0], "tmp": tmp}
        signature = (ctx.sequence, call_code(spec, call.algorithm, x.dtype, call.op), inp.nbytes, call.root)
        run = PeerCall(node, plan, arrays, call.count, call.op, x.dtype, signature, describe, started,
                       before=work.prologue, after=work.epilogue,
                       # an in-kernel wait gives up first, so that the host can still name who did not come
                       limit=None if call.timeout is None else 0.8 * call.timeout)

        def finish():
            if raw is not None:
                device.workspace.give(raw)
            work.release()
            return returned

        handle = PeerHandle(ctx.progress, describe, finish, run, call.timeout, ctx.sequence).start()
        return handle.wait() if call.blocking else handle

    def barrier(self, ctx, backend, timeout):
        """``Communicator.barrier(device=...)`` (numbered already): one fence of this
        executor, a plan of nothing else, where the node's ranks can open each other's
        memory; else each rank waits for its current stream and the ranks meet in MPI."""
        import numpy as np

        from ..transport.device_node import PeerCall, PeerHandle

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
        run = PeerCall(node, _BARRIER, {"in": nothing, "out": nothing, "tmp": nothing}, 1, "-", np.dtype(np.uint8),
                       (ctx.sequence, _BARRIER_CODE, 0, 0), describe, started,
                       limit=None if timeout is None else 0.8 * timeout)
        PeerHandle(ctx.progress, describe, _nothing, run, timeout, ctx.sequence).start().wait()


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
