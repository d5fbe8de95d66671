"""The lean path of blocking calls (``Communicator._fast_call`` and
``collectives.transport.lean``): it must give what the general path gives, bit for bit,
take only the calls it can, and fail like the engine does. Runs serially and under
``mpiexec -n N``.

The general path is forced with ``timeout=`` (a call that can time out needs the
progress engine); the lean path is what the same call takes without one.
"""

import itertools
import time

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc
from collectives.routes import LeanEntry
from collectives.routes.base import plan_for
from collectives.specs import SPECS
from collectives.transport import lean

from conftest import agree, expected_result, host_algorithms, rank_input

WORLD = MPI.COMM_WORLD
LAST = WORLD.Get_size() - 1


def persistent_limit(comm, algorithm):
    """The most bytes per rank a blocking float32 allreduce of ``algorithm`` (its
    messages as many at every size from here) runs on a persistent program for."""
    program = lean.program(plan_for(comm._ctx, "allreduce", algorithm, lean.PERSISTENT_BYTES, 0, 4, False))
    return lean.persistent_limit(program)


SHAPES = {"allgather": lambda size, shape: (size,) + shape,
          "reduce_scatter": lambda size, shape: (len(np.array_split(np.empty(shape).ravel(), size)[WORLD.Get_rank()]),)}


def call(comm, collective, x, algorithm, op, root, out, timeout=None):
    if collective == "allreduce":
        return comm.allreduce(x, op=op, algorithm=algorithm, out=out, timeout=timeout)
    if collective == "allgather":
        return comm.allgather(x, algorithm=algorithm, out=out, timeout=timeout)
    if collective == "reduce_scatter":
        return comm.reduce_scatter(x, op=op, algorithm=algorithm, out=out, timeout=timeout)
    if collective == "broadcast":
        return comm.broadcast(x, root=root, algorithm=algorithm, timeout=timeout)
    return comm.reduce(x, root=root, op=op, algorithm=algorithm, out=out, timeout=timeout)


def cases():
    for collective in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"):
        for algorithm in host_algorithms(collective):
            if algorithm.startswith("hierarchical"):
                continue  # they need a layout of several nodes; test_hierarchical has them
            yield collective, algorithm


@pytest.mark.parametrize("collective,algorithm", list(cases()))
def test_lean_path_gives_the_general_paths_bits(comm, collective, algorithm):
    """int32 and float32 (integer-valued, so exact), avg on float32; root = the last rank;
    every count and shape (0 included), each fresh, into ``out=`` and in place."""
    problems = []
    root = comm.size - 1
    for (count, shape), how in itertools.product([(1, (1,)), (5, (5,)), (12, (3, 4)), (0, (0,))],
                                                 ["fresh", "out", "inplace"]):
        for dtype, op in ((np.int32, "sum"), (np.float32, "avg"), (np.float32, "max")):
            if collective in ("allgather", "broadcast") and op != "sum":
                continue
            if how == "inplace" and collective not in ("allreduce", "reduce"):
                continue
            xs = [rank_input(r, count, dtype, op).reshape(shape) for r in range(comm.size)]
            results = []
            for timeout in (None, 60):  # lean, then general
                x = xs[comm.rank].copy()
                if collective == "broadcast" and comm.rank != root:
                    x[...] = 0
                out = None
                if how == "out":
                    out = np.full(SHAPES.get(collective, lambda s, sh: sh)(comm.size, shape), 7, dtype)
                elif how == "inplace":
                    out = x
                got = call(comm, collective, x, algorithm, op, root, out, timeout)
                if out is not None and got is not None and got is not out and collective != "broadcast":
                    problems.append(f"{how}: the result is not the out array")
                results.append(None if got is None else got.copy())
            label = f"{collective}/{algorithm} {np.dtype(dtype).name} {op} {shape} {how}"
            lean_result, general = results
            if (lean_result is None) != (general is None):
                problems.append(f"{label}: lean gave {lean_result!r}, general {general!r}")
            elif lean_result is not None:
                if lean_result.shape != general.shape or lean_result.tobytes() != general.tobytes():
                    problems.append(f"{label}: lean {lean_result.ravel()[:6]} != general {general.ravel()[:6]}")
                want = expected_result(collective, comm.rank, comm.size, [x.ravel() for x in xs], op, root)
                if want is not None and not np.array_equal(lean_result.ravel(), np.asarray(want).ravel()):
                    problems.append(f"{label}: lean {lean_result.ravel()[:6]} != NumPy {np.asarray(want).ravel()[:6]}")
    agree(comm.mpi_comm, problems)


def test_lean_path_takes_repeated_calls_and_learns_each_kind_once(comm, monkeypatch):
    """The second call of a kind is served from what the first learnt: native for a tiny
    auto allreduce (here auto's choice), for the library's own a persistent program
    (small calls) or the lean executor (larger ones)."""
    x = np.arange(4, dtype=np.float32)
    big = np.ones(persistent_limit(comm, "ring") // 4 + 1, np.float32)
    ring = comm.allreduce(x, algorithm="ring")
    comm.allreduce(big, algorithm="ring")
    runs = []
    real_run, real_persistent = lean.run, lean.PersistentProgram.run

    def counting_run(*args, **kwargs):
        runs.append("lean")
        return real_run(*args, **kwargs)

    def counting_persistent(self, *args, **kwargs):
        runs.append("persistent")
        return real_persistent(self, *args, **kwargs)

    monkeypatch.setattr(lean, "run", counting_run)
    monkeypatch.setattr(lean.PersistentProgram, "run", counting_persistent)
    again = comm.allreduce(x, algorithm="ring")
    big_again = comm.allreduce(big, algorithm="ring")
    problems = []
    if comm.size > 1 and runs != ["persistent", "lean"]:
        problems.append(f"the executors that ran for a small and a large ring call: {runs}")
    if not np.array_equal(big_again, big * comm.size):
        problems.append("the large ring call gave a wrong result")
    if not np.array_equal(ring, again) or not np.array_equal(again, x * comm.size):
        problems.append(f"ring gave {again}, want {x * comm.size}")
    entry = comm._ctx.lean_entries.get((SPECS["allreduce"], "ring", x.dtype, x.nbytes, "sum", 0, False))
    if not (isinstance(entry, LeanEntry) and entry.algorithm == "ring"):
        problems.append(f"no lean entry for the ring call: {entry!r}")
    agree(comm.mpi_comm, problems)


def test_calls_the_lean_path_refuses_take_the_general_path(comm):
    """Non-contiguous input, an out that overlaps x, a timeout, check mode: correct
    results through the general path, and nothing learnt for them."""
    problems = []
    base = np.arange(16, dtype=np.float64)
    strided = base[::2]
    got = comm.allreduce(strided, algorithm="ring")
    if not np.array_equal(got, strided * comm.size):
        problems.append(f"strided: {got}")
    y = np.arange(8, dtype=np.float64)
    overlapping = comm.allreduce(y[:4], out=y[2:6], algorithm="ring")
    if not np.array_equal(overlapping, np.arange(4) * comm.size):
        problems.append(f"overlapping out: {overlapping}")
    checked = cc.Communicator(check=True)
    if not np.array_equal(checked.allreduce(np.ones(3), algorithm="direct"), np.full(3, comm.size)):
        problems.append("check mode gave a wrong result")
    if checked._ctx.lean_entries:
        problems.append(f"check mode learnt lean entries: {list(checked._ctx.lean_entries)}")
    checked.free()
    agree(comm.mpi_comm, problems)


def test_bad_arguments_still_raise_the_general_paths_errors(comm):
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="algorithm for allreduce"):
        comm.allreduce(x, algorithm="no such")
    with pytest.raises(TypeError, match="op 'band' needs an integer dtype"):
        comm.allreduce(x, op="band")
    with pytest.raises(ValueError, match="root must be a rank"):
        comm.broadcast(x, root=comm.size)
    with pytest.raises(ValueError, match="out must have shape"):
        comm.allreduce(x, out=np.empty(5, np.float32))
    with pytest.raises(ValueError, match="writable"):
        comm.broadcast(_read_only(3))
    comm.broadcast(x, root=0)  # learnt: root 0
    for bad_root in (False, 0.0, np.array(0)):  # equal to 0, or unhashable: refused all the same
        with pytest.raises(ValueError, match="root must be a rank"):
            comm.broadcast(x, root=bad_root)
    agree(comm.mpi_comm, [])


@pytest.mark.skipif(WORLD.Get_size() < 2, reason="needs two ranks")
def test_a_reduction_that_raises_breaks_the_communicator_on_the_lean_path():
    """A failed local reduction (float overflow under np.errstate(over="raise")) raises
    and breaks the communicator, as on the general path; nothing is left to MPI."""
    comm = cc.Communicator()
    x = np.full(8, np.finfo(np.float32).max, np.float32)
    problems = []
    with np.errstate(over="raise"):
        try:
            comm.allreduce(x, algorithm="ring")
            problems.append("no error")
        except FloatingPointError:
            pass
        except cc.CollectiveError as exc:  # a rank that reduced nothing hears of it, or waits: both fine
            if "broken" in str(exc):
                problems.append(f"broken before the call: {exc}")
    try:
        comm.allreduce(np.ones(4, np.float32), algorithm="ring", timeout=5)
        problems.append("a call after the failure was accepted")
    except cc.CollectiveError:
        pass
    agree(WORLD, problems)


def _read_only(n):
    x = np.ones(n)
    x.setflags(write=False)
    return x


@pytest.mark.skipif(WORLD.Get_size() < 2, reason="needs two ranks")
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "direct"])
def test_a_size_mismatch_on_the_lean_path_stops_every_rank(algorithm):
    """No timeout anywhere, so the lean path runs: ranks that received a message of the
    wrong size raise and tell the others, which stop too (the lean wait reads the
    notices as the engine does) instead of waiting for ever."""
    comm = cc.Communicator()
    n = 1000 if comm.rank == LAST else 1024
    start = time.monotonic()
    try:
        comm.allreduce(np.ones(n, np.float32), algorithm=algorithm)
        kind = "no error"
    except cc.CollectiveError as exc:
        kind = type(exc).__name__
    problems = []
    if kind != "MessageSizeError":  # a longer message (MPI's truncation) too, as the engine names it
        problems.append(f"got {kind}")
    if time.monotonic() - start > 10:
        problems.append("the ranks waited instead of being told")
    try:
        comm.allreduce(np.ones(4))
        problems.append("a broken communicator accepted a call")
    except cc.CollectiveError as exc:
        if "broken" not in str(exc):
            problems.append(f"later call: {exc}")
    agree(WORLD, problems)


def test_small_calls_allocate_nothing_per_call(comm):
    """A persistent program's call copies into buffers made once: what a call allocates
    does not grow with the message (Python's few small objects at most)."""
    import tracemalloc

    peaks = {}
    for count in (16, 8192):
        x = np.ones(count, np.float32)
        out = np.empty_like(x)
        for _ in range(3):  # the first call learns and makes the program
            comm.allreduce(x, out=out, algorithm="recursive_doubling")
        tracemalloc.start()
        for _ in range(20):
            comm.allreduce(x, out=out, algorithm="recursive_doubling")
        peaks[count] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    # A buffer made per call would add 32 KiB at 8192; Python's objects per message
    # (the lean executor's, above the persistent programs' limit) stay well below a
    # quarter of that.
    problems = [] if peaks[8192] < peaks[16] + 8192 else [f"traced peak by count: {peaks}"]
    agree(comm.mpi_comm, problems)


@pytest.mark.skipif(WORLD.Get_size() < 2, reason="needs two ranks")
def test_a_size_mismatch_across_the_persistent_threshold_stops_every_rank():
    """One rank's call is small enough for a persistent program, another's is not: they
    still meet on one tag, and both raise."""
    comm = cc.Communicator()
    n = persistent_limit(comm, "ring") // 4 + (1 if comm.rank == LAST else 0)
    try:
        comm.allreduce(np.ones(n, np.float32), algorithm="ring")
        kind = "no error"
    except cc.CollectiveError as exc:
        kind = type(exc).__name__
    agree(WORLD, [] if kind == "MessageSizeError" else [f"got {kind}"])


def test_a_blocking_call_finishes_the_calls_in_flight_first(comm):
    """Blocking calls that cannot time out run alone (on a tag of their own): the async
    calls in flight finish first, and every result is right."""
    p, r = comm.size, comm.rank
    handles = [comm.allreduce_async(np.full(1000, k + r, np.int64), algorithm="ring") for k in range(3)]
    small = comm.allreduce(np.full(5, r, np.int64), algorithm="direct")
    problems = [] if np.array_equal(small, np.full(5, p * (p - 1) // 2)) else [f"blocking call: {small}"]
    for k, handle in enumerate(handles):
        if not handle.test():
            problems.append(f"async call {k} not finished by the blocking call")
        if not np.array_equal(handle.wait(), np.full(1000, k * p + p * (p - 1) // 2)):
            problems.append(f"async call {k}: wrong result")
    agree(comm.mpi_comm, problems)
