"""Calls on device arrays (CuPy, torch CUDA tensors, the stand-in): the device
executor (:mod:`collectives.transport.device`) runs the same plans, cut into device
segments, or the MPI library's collective on host copies (``native``)."""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from ..algorithms import SEGMENTED, TOPOLOGICAL
from ..transport import native as agreement
from . import base
from .base import Route, finish_in_flight


def device_context(ctx: Any, backend: Any, timeout: float | None) -> Any:
    """This communicator's state for ``backend``'s device, negotiated with the other
    ranks at the first call on a device (collective: every rank makes that call;
    bounded by its ``timeout`` like the call itself)."""
    device = ctx.devices.get(backend)
    if device is None:
        from ..transport.device import negotiate

        finish_in_flight(ctx)  # the negotiation blocks in MPI once every rank is in it

        def request(start, nbytes):
            ctx.request("the device set-up", start, timeout, nbytes)

        def node_comm():
            if ctx.node_comm is None:
                ctx.node_comm = ctx.comm.Split_type(MPI.COMM_TYPE_SHARED)
            return ctx.node_comm

        device = negotiate(ctx.comm, node_comm, backend, request, **ctx.options.device_options)
        ctx.devices[backend] = device
        ctx.progress.backends.append(backend)
        def agree(fits):  # every rank's verdict on the device table, ANDed within the call's timeout
            verdict = np.array([fits], np.uint8)
            ctx.request("the device set-up", lambda: ctx.comm.Iallreduce(MPI.IN_PLACE, verdict, MPI.BAND), timeout, 1)
            return bool(verdict[0])

        if ctx.selector.learn_gpu_stamp(device.gpus, agree):  # a device table of other GPUs: put aside
            ctx.call_kinds.clear()  # (every rank alike: the kinds resolved from it are resolved anew)
    return device


class Device(Route):
    """Every call whose arrays are on a device (checked, numbered and resolved already):
    returns the result (the kind of array the user passed) or, if not ``blocking``,
    its :class:`~collectives.Handle`."""

    name = "device"

    def takes(self, ctx, call):
        return call.device

    def run(self, ctx, call):
        from ..transport import device_call

        spec, x, out, rank = call.spec, call.where, call.out, ctx.rank
        device = device_context(ctx, x.backend, call.timeout)
        x.backend.prepare(x.dtype)  # compiles its kernels at the first call on a dtype, before any message
        describe = f"{spec.name}(algorithm={call.algorithm!r}, {x.where}) call #{ctx.sequence}"
        work = device_call.DeviceCall(device, x, x.dtype)
        work.begin()
        leaf = spec.root_result and rank != call.root  # no result here
        returned = None
        if spec.root_input and rank != call.root:  # no input here
            result, _, returned = work.output(out, call.shape, x, allow_inplace=False)
            inp, inplace = result[:0], False
        elif spec.one_buffer:
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
        work.ready()
        if spec.reduces and call.op == "avg" and result is not None:
            work.divide_at_end(result, ctx.size)

        def finish():
            work.finish()
            return returned

        if call.algorithm == "native":
            # Posted once the input is on the host: on the deferred calls' communicator, in call order.
            start_mpi = spec.native(ctx.deferred.comm, call.op, call.root, call.counts)
            checked = spec.name in ctx.native_checked  # the ranks agree on the size first
            handle = device_call.start_native(ctx.progress, describe, finish, work, start_mpi, inp, result,
                                              spec.one_buffer, call.timeout, ctx.sequence, inp.nbytes, ctx.deferred,
                                              ctx.comm if checked else None,
                                              agreement.unit(spec, inp, result) if checked else 0)
        else:
            name, algorithm = spec.name, call.algorithm
            segment = ctx.options.segment(call.segment_size, x.itemsize) if (name, algorithm) in SEGMENTED else 1
            options = ctx.options
            split = max(options.device_segment_size // x.itemsize, 1) if options.device_segment_size else 0
            counts = call.counts if spec.variable else None
            plan = base.compiled_plan(name, algorithm, rank, ctx.size, call.count, call.root, segment, inplace,
                                 options.deterministic, split, counts,
                                 ctx.topology if (name, algorithm) in TOPOLOGICAL else None)
            handle = device_call.start_plan(ctx.progress, describe, finish, ctx.comm, ctx.tags.call(ctx.sequence),
                                            plan, inp, result if result is not None else inp[:0], call.op, work,
                                            call.timeout, ctx.sequence)
        return handle.wait() if call.blocking else handle


DEVICE = Device()
