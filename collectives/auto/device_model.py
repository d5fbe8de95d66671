"""The device cost model: the times of the peer-read algorithms, the ring over CUDA
IPC and ``native`` staged through host copies on one node's device arrays
(:func:`predict_device`), and the device rule built on it (:func:`device_choice`)."""

from dataclasses import dataclass

from ..algorithms import BUILDERS
from .cost_model_rule import cost_model_choice


@dataclass(frozen=True)
class DeviceCostModel:
    """The device rule's parameters where no device table was measured, in seconds and
    bytes per second: ``call`` the host's work of one call, ``fence`` one synchronisation
    of the node's ranks, ``launch`` one kernel or copy, ``bandwidth`` the device's copy
    rate B (bytes read plus written per second; ``shared``: the node's ranks share one
    GPU, whose memory carries the sum of their traffic), ``switch`` what each further
    process whose device work a call waits for costs on a GPU the ranks share (the GPU
    runs one process at a time: it switches to each in turn, per round of kernels), for
    the ring over CUDA IPC ``ipc_step`` the host's handshake of one message and
    ``ipc_rate`` its bytes per second, and for ``native`` on device arrays (staged: the
    input device -> pinned host, the MPI library's own collective on the host copies,
    the result back, two switches a process) ``staged_fixed`` its cost beyond ``call``
    and ``staged_rate`` the bytes per second of what crosses the host
    (``STAGED_BYTES``: copied in plus copied back), MPI's own work on the host copies
    included. ``one_gpu``: every rank of the node on one GPU (the leader algorithms
    are for that node alone); ``kernel_fences``: the fences are in-kernel flags (the
    mechanism of ranks with a GPU each), costing ``own_fence``, no host in them.

    The defaults come from the one GPU measured with peer reads
    (bench/results/NVIDIA-H200: 2 and 4 ranks sharing one H200, MPICH 5.0.2 not
    CUDA-aware). B: its copy, 4.0-4.1 TB/s. ``call``, ``fence`` and ``switch`` solve
    one_shot allreduce at 8 B, 440 us at 2 ranks and 820 at 4 (2 fences and p - 1
    switches); they then give two_shot (two rounds of kernels) 630 and 1390 us against
    830 and 1200-1500 measured, and broadcast at 64 MiB (p - 1 processes copy) 280 and
    730 us against 147 and 704. ``ipc_step``: one handshake of a 4-byte ring allgather,
    639 us at 2 ranks and 575 at 4 (the 8 B ring allreduce, 2(p - 1) handshakes, took
    less: 831 and 2228 us, against 1240 and 3640 from it). ``staged_fixed``: native at
    8 B, 470 us at 2 ranks (1142 at 4: the model says 1230); ``staged_rate`` the
    least-squares fit (in relative error) of native allreduce from 1 to 256 MiB at 2 and
    4 ranks, within -60% to +62% of them (42% rms: MPI's reduction on the host slows past
    16 MiB). ``own_fence`` has not been measured (no machine with a GPU per rank was
    lent): 10 us, the order of the whole small allreduces that flag-based
    implementations report on 8 H100s over NVLink (4-25 us); ``fence``, measured with
    host fences on a shared GPU, would make the staged ``native`` win every small call
    there. A device table (``collectives-bench --device cuda --tune``, or ``make
    bench-gpu``'s tuning.json) replaces the whole rule."""

    call: float = 40e-6
    fence: float = 100e-6
    own_fence: float = 10e-6
    launch: float = 6e-6
    bandwidth: float = 4.0e12
    shared: bool = True
    one_gpu: bool = True
    kernel_fences: bool = False
    switch: float = 190e-6
    ipc_step: float = 600e-6
    ipc_rate: float = 15e9
    staged_fixed: float = 50e-6
    staged_rate: float = 4.0e9


SHIPPED_DEVICE_MODEL = DeviceCostModel()


def _kernels(inputs):
    """Kernels a phase of the peer reads launches over ``inputs`` buffers: a fold or a
    copy kernel takes 16 (``collectives.transport.peer_phases``)."""
    return -(-inputs // 16)


def _fanned_kernels(p):
    """Kernels of the allgather leader's copies: each of the p inputs read once into the p
    outputs, 16 // p inputs a kernel; past 16 ranks a copy each, 16 a kernel
    (``collectives.transport.peer_phases``)."""
    return -(-p // (16 // p)) if p <= 16 else _kernels(p * p)


# Per collective, for predict_device: each peer-read algorithm's memory traffic (bytes,
# of n the table's bytes at p ranks), kernel launches, how many ranks run device work
# and in how many rounds (the kernels before, between and after its fences); then the
# message-based contender over CUDA IPC, its rounds of p - 1 handshakes and the bytes of
# one step.
DEVICE_COSTS = {
    # leader: rank 0 reads p·n and writes p·n, 2n a rank on average; one kernel to 16 ranks
    "allreduce": ({"one_shot": (lambda p, n: (p + 1) * n, lambda p: _kernels(p), lambda p: p, 1),
                   "two_shot": (lambda p, n: (3 + 1 / p) * n, lambda p: 2 * _kernels(p), lambda p: p, 2),
                   "leader": (lambda p, n: 2 * n, lambda p: _kernels(p) * (1 if p <= 16 else 2), lambda p: 1, 1)},
                  "ring", 2, lambda p, n: n / p),
    # the leaders (rank 0, broadcast's root) move what every rank of one_shot does, alone
    "reduce_scatter": ({"one_shot": (lambda p, n: (1 + 1 / p) * n, lambda p: _kernels(p), lambda p: p, 1),
                        "leader": (lambda p, n: (1 + 1 / p) * n, lambda p: 1 if p <= 16 else p * _kernels(p),
                                   lambda p: 1, 1)},
                       "ring", 1, lambda p, n: n / p),
    # its own row before the first fence, the others' after it; the leader reads each input
    # once into the p outputs (n read, pn written), 16 // p inputs a kernel
    "allgather": ({"one_shot": (lambda p, n: 2 * n, lambda p: 1 + _kernels(p - 1), lambda p: p, 2),
                   "leader": (lambda p, n: (1 + 1 / p) * n, _fanned_kernels, lambda p: 1, 1)}, "ring", 1,
                  lambda p, n: n / p),
    # the root reads nothing: p - 1 ranks copy (the leader: the root reads n once and writes
    # it p - 1 times); broadcast has no ring, its tree moves as much here
    "broadcast": ({"one_shot": (lambda p, n: 2 * n * (p - 1) / p, lambda p: 1, lambda p: p - 1, 1),
                   "leader": (lambda p, n: n, lambda p: _kernels(p - 1), lambda p: 1, 1)},
                  "binomial", 1, lambda p, n: n),
    # the root folds every input
    "reduce": ({"one_shot": (lambda p, n: (p + 1) * n / p, lambda p: _kernels(p), lambda p: 1, 1)}, "direct", 2,
               lambda p, n: n / p),
}

# Per collective, for predict_device: the bytes of a staged ``native`` call that cross
# between device and host one after the other (of n the table's bytes at p ranks): the
# input copied to the host, then the result copied back (a broadcast's root copies in,
# the others back; a reduce's ranks copy in, the root back).
STAGED_BYTES = {
    "allreduce": lambda p, n: n + n,
    "reduce_scatter": lambda p, n: n + n / p,
    "allgather": lambda p, n: n / p + n,  # n: the gathered size
    "broadcast": lambda p, n: n + n,
    "reduce": lambda p, n: n + n,
}

# How device_choice's explanation names each contender where the name alone would not say.
DEVICE_NAMES = {"native": "native (staged: MPI's own on host copies)"}


def predict_device(collective, nbytes, size, model=SHIPPED_DEVICE_MODEL):
    """``{algorithm: seconds}`` of the peer-read algorithms of ``collective``, its ring
    (over CUDA IPC) and ``native`` (staged: the MPI library's own collective on host
    copies) on one node of ``size`` ranks, ``nbytes`` as a tuning table counts them
    (allgather: the gathered size). The peer reads cost ``call`` + two fences (``fence``;
    ``own_fence`` where they are in-kernel flags) + their
    launches + their memory traffic (:mod:`collectives.algorithms.peer`'s docstring;
    all ranks' where they share a GPU, one rank's where each has its own) + where they
    share one, a ``switch`` per further rank with device work, per round of it; the ring
    2(p-1) (allreduce) or p-1 handshakes and its bytes at ``ipc_rate``; ``native``
    ``call`` + ``staged_fixed`` + its ``STAGED_BYTES`` at ``staged_rate`` (+ two rounds
    of switches on a shared GPU)."""
    p, n, m = size, float(nbytes), model
    ranks = p if m.shared else 1  # whose traffic one device's memory carries

    def switches(working, rounds):  # a GPU the ranks share runs one process's work at a time
        return m.switch * rounds * max(working - 1, 0) if m.shared else 0.0

    fence = m.own_fence if m.kernel_fences else m.fence

    def peer(traffic, launches, working, rounds):
        return (m.call + 2 * fence + launches * m.launch + ranks * traffic / m.bandwidth
                + switches(working, rounds))

    if collective not in DEVICE_COSTS:
        return {}
    reads, other, rounds, step = DEVICE_COSTS[collective]
    times = {algorithm: peer(traffic(p, n), launches(p), working(p), kernel_rounds)
             for algorithm, (traffic, launches, working, kernel_rounds) in reads.items()}
    times[other] = m.call + rounds * (p - 1) * (m.ipc_step + step(p, n) / m.ipc_rate)
    if not (m.shared and m.one_gpu):  # the leader's GPU would carry every rank's traffic alone: for ranks on one
        times.pop("leader", None)
    times = {a: t for a, t in times.items() if a in BUILDERS[collective]}
    # native is no builder: MPI's own collective, which every collective has; its copy in
    # and its copy back are a round each on every rank's device
    times["native"] = m.call + m.staged_fixed + STAGED_BYTES[collective](p, n) / m.staged_rate + switches(p, 2)
    return times


def device_choice(collective, nbytes, size, topology=None, model=SHIPPED_DEVICE_MODEL):
    """``(algorithm, why)``: the device rule where no device table answers. On one node,
    the fastest of :func:`predict_device` (the peer reads, the ring over CUDA IPC, or
    ``native`` staged through host copies); elsewhere (several nodes, or a collective
    without peer-read algorithms) the cost-model rule."""
    one_node = topology is None or topology.node_count == 1
    times = predict_device(collective, nbytes, size, model) if one_node and size > 1 else {}
    if not times:
        return cost_model_choice(collective, nbytes, size, topology=topology), "cost-model rule"
    best = min(times, key=times.get)
    said = ", ".join(f"{DEVICE_NAMES.get(a, a)} {t * 1e6:.0f} us"
                     for a, t in sorted(times.items(), key=lambda item: item[1]))
    return best, f"device cost model on one node (predicted: {said})"
