"""``bench/gpu_probe.py`` (``make probe-gpu``): where a device call's time goes on a GPU
the ranks share. ``make bench-gpu`` on an H200 on 2026-11-27 (bench/results/NVIDIA-H200)
measured a fixed cost of about 440 us a call at 2 ranks and 820 us at 4, six times the
synchronisation floor; these probes take it apart, each an empty or 4-byte operation,
p50 and p99 over ``--iters`` of the slowest rank's:

    mpiexec -n 2 python -m mpi4py bench/gpu_probe.py --json probe-n2.json   # on a GPU
    mpiexec -n 2 python -m mpi4py bench/gpu_probe.py --device standin --quick

- ``kernel+sync, one rank``: rank 0 launches a one-element kernel and waits for its
  stream, the others idle: a GPU round trip with nobody else on the GPU.
- ``kernel+sync, every rank``: every rank does the same at once, unco-ordinated: the
  round trip while the other processes want the GPU too (time-slicing).
- ``event, every rank``: an event recorded on an idle stream, the host polling it
  (what a host fence waits for), every rank at once.
- ``host epoch barrier``: every rank sets its word in shared memory and waits for
  every other's, no device in it: the host fences' meeting alone.
- ``barrier(device=), host``: the synchronisation floor's host row in parts: to this
  rank's device work seen done (its stream's event), to every rank seen arrived, to
  the return.
- ``host token ring``: the ranks in turn: wait (on the host) for the previous rank's
  word in shared memory, launch the kernel, wait for it, write the next rank's word;
  per hop. A host-fenced call moves through the GPU like this.
- ``stream token ring``: the same ring with no host in it: each stream waits for its
  word (``cuStreamWaitValue32``) and writes the next rank's (``cuStreamWriteValue32``),
  every hop queued up front; per hop. How fast the GPU hands over between processes
  whose streams wait on memory (it may keep a waiting process for its time slice).
- ``one_shot 8 B`` and ``leader 8 B`` (rank 0 alone runs a kernel) by each fence
  mechanism, plain and on a registered array (``Communicator.empty(device=)``), timed
  in parts: from the call to its first fence passed, to its second passed (with stream
  fences: enqueued, the devices' own), to its return, to its stream synchronized.

The stand-in runs all of it (in CI) but its times mean nothing.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from collectives import Communicator
from collectives.tools.bench.devices import BenchDevice
from collectives.tools.bench.timing import combine

RING_TIMEOUT = 10.0  # seconds a token ring may take before it is called stuck (and released)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="bench/gpu_probe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "standin"), default="cuda")
    p.add_argument("--iters", type=int, default=400, help="timed repetitions of each probe")
    p.add_argument("--hops", type=int, default=200, help="rounds of each token ring")
    p.add_argument("--quick", action="store_true", help="few repetitions: checks the code runs")
    p.add_argument("--json", help="write the rows here (rank 0)")
    args = p.parse_args(argv)
    if args.quick:
        args.iters, args.hops = 10, 5
    return args


def _row(world, name, samples):
    """p50/p99 in us of the slowest rank's samples (every rank passes as many)."""
    stats = combine(world, np.asarray(samples, np.float64))
    return {"probe": name, "world_size": world.Get_size(), "p50_us": stats["p50_us"], "p99_us": stats["p99_us"],
            "iters": len(samples)}


class Probes:
    def __init__(self, world, device, args):
        from mpi4py import MPI

        self.world, self.device, self.args = world, device, args
        self.backend, self.stream = device.backend, device.backend.stream("probe")
        self.rank, self.size = world.Get_rank(), world.Get_size()
        self.backend.prepare(np.float32)
        self.x = device.empty(1, np.float32)
        device.upload(self.x, np.ones(1, np.float32))
        self.event = self.backend.event()
        node = world.Split_type(MPI.COMM_TYPE_SHARED)
        if node.Get_size() != self.size:
            raise SystemExit("the probes run on one node: every rank on the same machine")
        self.node = node
        self.win = MPI.Win.Allocate_shared(4 * self.size if node.Get_rank() == 0 else 0, 4, comm=node)
        buffer, _ = self.win.Shared_query(0)
        self.words = np.ndarray((self.size,), np.uint32, buffer)
        self.mapping = self.backend.map_host(self.words)

    def free(self):
        self.backend.unmap_host(self.mapping)
        self.win.Free()
        self.node.Free()

    def kernel(self):
        self.backend.reduce2(self.stream, "sum", np.dtype(np.float32), self.x, self.x, self.x)

    def kernel_sync(self):
        self.kernel()
        self.backend.synchronize_stream(self.stream)

    def event_poll(self):
        self.backend.record(self.event, self.stream)
        while not self.backend.query(self.event):
            pass

    def timed(self, action, who=None):
        """``action`` timed ``--iters`` times on the ranks ``who`` (all), after a warm-up."""
        samples = np.zeros(self.args.iters)
        active = who is None or self.rank in who
        for _ in range(min(20, self.args.iters)):
            if active:
                action()
        self.world.Barrier()
        clock = time.perf_counter
        for i in range(self.args.iters):
            if active:
                start = clock()
                action()
                samples[i] = clock() - start
        self.world.Barrier()
        return samples

    def host_ring(self):
        """Per hop: wait for this rank's word, a kernel and its wait, the next rank's word."""
        words, r, p, hops = self.words, self.rank, self.size, self.args.hops
        self._reset()
        start = time.perf_counter()
        for i in range(1, hops + 1):
            want = i - 1 if r == 0 else i
            while int(words[r]) < want:
                pass
            self.kernel_sync()
            words[(r + 1) % p] = i
        if r == 0:  # the last hop comes back to it
            while int(words[0]) < hops:
                pass
        elapsed = time.perf_counter() - start
        self.world.Barrier()
        return elapsed / (hops * p)

    def stream_ring(self):
        """Per hop, the ring queued on the streams up front; None if it did not finish
        within RING_TIMEOUT (its words are then set so that every stream goes on)."""
        backend, stream, mapping = self.backend, self.stream, self.mapping
        r, p, hops = self.rank, self.size, self.args.hops
        self._reset()
        start = time.perf_counter()
        for i in range(1, hops + 1):
            backend.wait_value(stream, mapping, r, i - 1 if r == 0 else i)
            self.kernel()
            backend.write_value(stream, mapping, (r + 1) % p, i)
        if r == 0:
            backend.wait_value(stream, mapping, 0, hops)
        backend.record(self.event, stream)
        deadline = start + RING_TIMEOUT
        while not backend.query(self.event) and time.perf_counter() < deadline:
            pass
        elapsed = time.perf_counter() - start
        stuck = self.world.allreduce(int(not backend.query(self.event)))
        if stuck:
            self.words[:] = hops + 1  # every wait passes: the queued work drains
            backend.synchronize_stream(stream)
        self.world.Barrier()
        return None if stuck else elapsed / (hops * p)

    def epoch_barrier(self):
        """Per round: this rank's word set to the round, then every word awaited (host
        memory only, no device): what a host fence's meeting costs by itself."""
        words, r, rounds = self.words, self.rank, self.args.hops
        self._reset()
        start = time.perf_counter()
        for i in range(1, rounds + 1):
            words[r] = i
            while int(words.min()) < i:
                pass
        elapsed = time.perf_counter() - start
        self.world.Barrier()
        return elapsed / rounds

    def _in_parts(self, cls, wrappers, run, split, rows, name):
        """``run()`` timed ``--iters`` times after a warm-up, each after a barrier of the
        ranks, with the methods of ``cls`` that ``wrappers`` names replaced by ``wrap(real,
        marks)`` meanwhile (they mark when the call got somewhere in ``marks``); ``run``
        returns the times it took after its call, ``split(marks, t0, *times)`` the
        call's parts, ``{part: seconds}``, each a row of ``rows``."""
        marks, parts = {}, {}
        real = {method: getattr(cls, method) for method in wrappers}
        for method, wrap in wrappers.items():
            setattr(cls, method, wrap(real[method], marks))
        try:
            warm = min(20, self.args.iters)
            for i in range(warm + self.args.iters):
                marks.clear()
                self.world.Barrier()
                t0 = time.perf_counter()
                times = run()
                if i >= warm:
                    for key, seconds in split(marks, t0, *times).items():
                        parts.setdefault(key, []).append(seconds)
        finally:
            for method, function in real.items():
                setattr(cls, method, function)
        for key, samples in parts.items():
            rows.append(_row(self.world, f"{name}: {key}", samples))

    def barrier_parts(self, comm, x, rows, name):
        """``comm.barrier(device=x)`` with host fences, timed in parts: to this rank's
        device work seen done (the event its stream recorded), to every rank seen
        arrived, to the return; marked through the host fences' own steps."""
        from collectives.transport.peer_fences import HostFences

        def marking(key):  # marks when the step first says yes
            def wrap(real, marks):
                def step(*args):
                    result = real(*args)
                    if result:
                        marks.setdefault(key, time.perf_counter())
                    return result
                return step
            return wrap

        def run():
            comm.barrier(device=x)
            return (time.perf_counter(),)

        def split(marks, t0, t1):
            a = marks.get("done", t0)
            b = marks.get("arrived", a)
            return {"own work seen done": a - t0, "every rank seen": b - a, "return": t1 - b, "whole": t1 - t0}

        self._in_parts(HostFences, {"_work_done": marking("done"), "_others_arrived": marking("arrived")}, run, split,
                       rows, name)

    def _reset(self):
        self.world.Barrier()
        self.words[:] = 0
        self.world.Barrier()

    def call_parts(self, comm, x, rows, name, algorithm="one_shot"):
        """``algorithm``'s allreduce on ``x``, in place: when each fence passed (the host
        went on to the next phase), the return, the sync; marked through PeerCall's own
        steps."""
        from collectives.transport.device_node import PeerCall

        def wrap_enqueue(real, marks):
            def enqueue(call, k):
                marks.setdefault(f"phase{k}", time.perf_counter())
                real(call, k)
            return enqueue

        def wrap_end(real, marks):
            def end(call):
                marks.setdefault("end", time.perf_counter())
                real(call)
            return end

        def run():
            comm.allreduce(x, out=x, algorithm=algorithm)
            t1 = time.perf_counter()
            self.device.sync()
            return t1, time.perf_counter()

        def split(marks, t0, t1, t2):
            f1 = marks.get("phase1", t0)
            f2 = marks.get("end", f1)
            return {"fence 1": f1 - t0, "fence 2": f2 - f1, "return": t1 - f2, "sync": t2 - t1, "whole": t2 - t0}

        self._in_parts(PeerCall, {"_enqueue": wrap_enqueue, "_end": wrap_end}, run, split, rows, name)


def measure(args):
    from mpi4py import MPI


    world = MPI.COMM_WORLD
    device = BenchDevice(args.device, world.Get_rank())
    info = {"device": device.versions(), "mpi": MPI.Get_library_version().split("\n")[0],
            "world_size": world.Get_size(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}
    rows = []

    def save():
        if world.Get_rank() == 0 and args.json:
            Path(args.json).write_text(json.dumps({"info": info, "rows": rows}, indent=1) + "\n")

    probes = Probes(world, device, args)
    rows.append(_row(world, "kernel+sync, one rank", probes.timed(probes.kernel_sync, who=(0,))))
    rows.append(_row(world, "kernel+sync, every rank", probes.timed(probes.kernel_sync)))
    rows.append(_row(world, "event, every rank", probes.timed(probes.event_poll)))
    rows.append(_row(world, "host epoch barrier (no device), a round", [probes.epoch_barrier() for _ in range(3)]))
    hop = [probes.host_ring() for _ in range(3)]
    rows.append(_row(world, "host token ring, a hop", hop))
    hop = [probes.stream_ring() for _ in range(3)]
    if any(h is None for h in hop):
        rows.append({"probe": "stream token ring, a hop", "world_size": world.Get_size(), "stuck": True})
    else:
        rows.append(_row(world, "stream token ring, a hop", hop))
    save()
    for mechanism in ("host", "stream"):
        comm = Communicator(device_fence=mechanism)
        plain = device.empty(2, np.float32)
        device.upload(plain, np.ones(2, np.float32))
        registered = comm.zeros(2, "float32", device=device.kind)
        if mechanism == "host":
            comm.allreduce(plain, algorithm="one_shot")  # the peer-read state: a barrier is then one fence
            probes.barrier_parts(comm, plain, rows, "barrier(device=), host")
        for algorithm in ("one_shot", "leader"):
            for name, x in (("plain", plain), ("registered", registered)):
                probes.call_parts(comm, x, rows, f"{algorithm} 8 B, {mechanism}, {name}", algorithm)
                save()
        comm.free()
    probes.free()
    if world.Get_rank() == 0:
        for row in rows:
            if row.get("stuck"):
                print(f"  {row['probe']:<44} stuck (did not finish in {RING_TIMEOUT:g} s)")
            else:
                print(f"  {row['probe']:<44} p50 {row['p50_us']:9.1f} us  p99 {row['p99_us']:9.1f} us")
    return 0


def main(argv=None):
    return measure(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
