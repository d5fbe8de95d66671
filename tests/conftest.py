"""Shared helpers. The same suite runs serially and under ``mpiexec -n N``.

Inputs are integer-valued, distinct per rank and per index, and small enough that
every op gives an exact result in every dtype: the NumPy reference, the MPI library's
own collective and ours must then agree bit for bit.
"""

import os
import sys
import time
from pathlib import Path

# auto's calibration (collectives.auto.calibration) measures this machine when a Communicator
# is made where no table matches: the suite keeps to what it used before, deterministic
# choices and no measuring, unless a test asks for it (tests/auto/test_calibration.py). Set
# before the first Communicator; jobs the tests launch inherit it.
os.environ.setdefault("COLLECTIVES_CALIBRATE", "0")

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc
from collectives.algorithms import PEER_READS, SHARED_MEMORY
from collectives.reference import expected, fold
from collectives.specs import SPECS

# Job scripts and harness sources live in tests/harness/, apart from the test files; the
# tests import its helper modules (device_under_test, torch_reference) by name.
HARNESS = Path(__file__).resolve().parent / "harness"
EXAMPLES = HARNESS.parent.parent / "examples"
sys.path.insert(0, str(HARNESS))

ALL_DTYPES = [d.name for d in cc.SUPPORTED_DTYPES]
FLOAT_DTYPES = [d for d in ALL_DTYPES if d.startswith(("float", "complex"))]
UFUNC = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
         "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
BITWISE = ("band", "bor", "bxor")


def ops_for(dtype):
    kind = np.dtype(dtype).kind
    if kind in "iu":
        return ["sum", "prod", "max", "min", *BITWISE]
    if kind == "c":
        return ["sum", "prod", "avg"]
    return ["sum", "prod", "max", "min", "avg"]


def rank_input(rank, count, dtype, op="sum", shape=None):
    """Rank ``rank``'s input: exact under ``op`` for any world size up to 32."""
    dtype = np.dtype(dtype)
    index = np.arange(count)
    if op in BITWISE:  # whole-width bit patterns, the sign bit included
        return _bit_patterns(rank, index, dtype, op).reshape(shape if shape is not None else -1)
    if op == "prod":  # factors 1, 2 and (signed) -1: products stay exact or wrap alike
        values = np.where((index + rank) % 5 == 0, 2, 1)
        if dtype.kind != "u":
            values = np.where((index * 3 + rank) % 7 == 0, -values, values)
    else:
        low = 0 if dtype.kind == "u" else -3
        values = (index * 5 + rank * 3) % 7 + low
    x = values.astype(dtype)
    if dtype.kind == "c" and op != "prod":
        x = x + (1j * values[::-1]).astype(dtype)
    return x.reshape(shape) if shape is not None else x


def _bit_patterns(rank, index, dtype, op):
    """band: every rank clears one bit of each element (a different one per rank where
    the width allows), so the result keeps most bits; bor: every rank sets one; bxor:
    scrambled patterns."""
    bits = 8 * dtype.itemsize
    one = np.left_shift(np.uint64(1), ((index * 3 + rank) % bits).astype(np.uint64))
    if op == "band":
        raw = ~one
    elif op == "bor":
        raw = one
    else:  # uint64 array products wrap (silently, unlike scalar ones)
        raw = index.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) \
            + np.full(index.shape, rank + 1, np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
    return raw.astype(np.dtype(f"u{dtype.itemsize}")).view(dtype)


def reference(op, inputs):
    """The NumPy answer: the elementwise reduction of all ranks' inputs (collectives.reference)."""
    return fold(op, inputs)


# -- deterministic mode (test_deterministic.py, test_device.py) ---------------------------------
def order_sensitive_input(rank, count, dtype, op, seed=0):
    """Rank ``rank``'s input: values whose sum or product depends on the order of the
    operations; for max/min, zeros of both signs (which of two equal zeros wins depends
    on the order too)."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng([seed, rank, count])
    if op == "prod":
        values = 1 + rng.standard_normal(count) / 8
    elif op in ("max", "min"):
        values = np.where(rng.random(count) < 0.5, rng.choice([0.0, -0.0], count), rng.standard_normal(count))
    else:
        values = rng.standard_normal(count) * 10.0 ** rng.integers(-2, 3, count)
    x = values.astype(dtype)
    if dtype.kind == "c":
        x = x + 1j * (rng.standard_normal(count) * 10.0 ** rng.integers(-2, 3, count)).astype(dtype)
    return x


def serial_fold(op, inputs):
    """``x0 op x1 op … op x(p-1)``, left to right, in the inputs' dtype (avg: then / p)."""
    return fold(op, inputs)


def expected_everywhere(collective, inputs, op="sum", root=0):
    """NumPy's answer for every rank (flat arrays in, a list out; None for the
    non-roots of reduce and gather) given every rank's flat input."""
    return SPECS[collective].reference_flat(inputs, op, root)


def expected_result(collective, rank, size, xs, op="sum", root=0):
    """NumPy's answer for rank ``rank`` given every rank's input ``xs``."""
    return expected(collective, xs, op, root)[rank]


def agree(comm, problems):
    """Fail on every rank if any rank found a problem (so no rank is left waiting)."""
    meet(comm)
    everyone = comm.allgather(problems)
    found = [f"rank {r}: {p}" for r, ps in enumerate(everyone) for p in ps]
    assert not found, "\n".join(found[:20]) + (f"\n... {len(found) - 20} more" if len(found) > 20 else "")


def meet(comm):
    """Wait for every rank of ``comm`` (an mpi4py communicator, or a Communicator's),
    sleeping meanwhile. MPI's own waits spin: with more ranks than cores (5-8 ranks on 2
    cores), the ranks that wait at the end of a test would keep the ones still working
    off the cores."""
    arrived = getattr(comm, "mpi_comm", comm).Ibarrier()
    while not arrived.Test():
        time.sleep(0.0002)


def counts_for(size, large=True):
    counts = sorted({0, 1, max(size - 1, 0), size, size + 1, 13})
    return counts + [100_003] if large else counts


def same(a, b):
    """Exactly equal values, same dtype and shape. (+0 and -0 count as equal: the sign
    of a zero in a complex product depends on the order of the factors, which differs
    between algorithms; bitwise identity across ranks is tested with bytes.)"""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def pytest_addoption(parser):
    parser.addoption("--device", default="standin", choices=("standin", "cuda"),
                     help="the device the device tests run on: the CPU stand-in (default) or a GPU through CuPy")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip, with the reason, where no GPU can run them."""
    from device_under_test import gpu_reason

    marked = [item for item in items if "gpu" in item.keywords]
    reason = gpu_reason() if marked else None
    if reason:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))


def _world_shares_memory():
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size() == MPI.COMM_WORLD.Get_size()
    finally:
        node.Free()


WORLD_SHARES_MEMORY = _world_shares_memory()  # False in a testbed job across hosts (make test-multihost)


def runs_here(comm, collective, algorithm):
    """Whether ``comm`` runs ``algorithm`` on host arrays: the shared-memory ones (``shm``)
    need ranks that share memory (across hosts they raise, which test_multihost.py
    checks); the peer-read ones (``one_shot``, ``two_shot``) run on device arrays only
    (test_device_peer.py)."""
    if (collective, algorithm) in PEER_READS:
        return False
    return (collective, algorithm) not in SHARED_MEMORY or comm.shares_memory


def shm_long(cases):
    """``cases`` for ``parametrize`` (algorithms, or ``(collective, algorithm)`` pairs) with
    the ``shm`` ones marked ``long`` (`make test-long`): each fence is a scheduling round
    when ranks outnumber cores."""
    def algorithm(case):
        return case[-1] if isinstance(case, tuple) else case

    return [pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=pytest.mark.long)
            if algorithm(case) == "shm" else case for case in cases]


def quick_and_deep(quick, deep):
    """Two values for ``parametrize``: ``quick``, for `make test`, and ``deep``, marked
    ``long`` (`make test-long`): a sweep cut in two, which CI runs whole."""
    return [pytest.param(quick, id="quick"), pytest.param(deep, id="deep", marks=pytest.mark.long)]


def host_algorithms(collective):
    """``cc.algorithms(collective)`` less the ones that run on device arrays only."""
    return tuple(a for a in cc.algorithms(collective) if (collective, a) not in PEER_READS)


@pytest.fixture
def shared_memory_needed(request):
    """For tests parametrized by ``algorithm``: skip ``shm`` in a job across hosts
    (``pytestmark = pytest.mark.usefixtures("shared_memory_needed")``)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("algorithm") == "shm" and not WORLD_SHARES_MEMORY:
        pytest.skip("shm needs ranks that share memory; across hosts it refuses (test_multihost.py checks that)")


@pytest.fixture(scope="session")
def mpi_comm():
    return MPI.COMM_WORLD


@pytest.fixture(scope="session")
def comm():
    return cc.Communicator()


# -- data-parallel training tests (test_training.py, test_torch.py) ----------------------
GLOBAL_BATCH = 1680  # divisible by 2 x every world size 1..8: equal shards and equal halves of them


def shard(comm, x, y, micro=1, index=0):
    """Rank ``comm.rank``'s share of a global batch (NumPy arrays or tensors), and
    micro-batch ``index`` of ``micro`` within it."""
    share = GLOBAL_BATCH // comm.size
    assert share * comm.size == GLOBAL_BATCH and share % micro == 0, "unequal shards would weight samples unequally"
    start = comm.rank * share + index * share // micro
    stop = start + share // micro
    return x[start:stop], y[start:stop]


def identical_everywhere(arrays):
    """True on every rank iff every rank's ``arrays`` (NumPy) have the same bits (mpi4py's
    own allgather: independent of the library)."""
    blob = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    meet(MPI.COMM_WORLD)
    return all(other == blob for other in MPI.COMM_WORLD.allgather(blob))
