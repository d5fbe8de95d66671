"""A size mismatch raises MessageSizeError on every rank (a blocking native broadcast: on
the ranks whose buffers differ from the root's) and writes nothing outside the receive
buffers, on every path a call can take (collectives.transport.tags and
.native), whatever the MPI library does with a message longer than its receive
(Open MPI 5.0 writes past it).

Every result buffer here is a view into a larger array whose bytes before and after it
hold a pattern; after the failed call the pattern must be intact on every rank. The
paths: a persistent program (a small blocking call), the lean executor (a larger
one), the lean executor on messages too large for their tag to hold their size (found
by a probe before they are received), the progress engine (a call with a timeout) on
both kinds of messages, and MPI's own collectives, blocking and not, with the ranks'
agreement on the size forced on (``COLLECTIVES_NATIVE_SIZE_CHECK=1``: the default on
Open MPI and Intel MPI for every collective, on MPICH for broadcast, gather and scatter);
a blocking broadcast sends the root's size ahead instead, and only the ranks whose
buffers differ from the root's raise.
Runs under every world size; the serial tests check the tag layout and the MPI family.
"""

import gc
import time
import weakref

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc
from collectives import mpi_library
from collectives.transport import lean, retired, tags

from conftest import agree

WORLD = MPI.COMM_WORLD
LAST = WORLD.Get_size() - 1
needs_peers = pytest.mark.skipif(WORLD.Get_size() < 2, reason="needs two ranks")
GUARD = 4096  # bytes of pattern on each side of a result
PATTERN = 0xA5


def guarded(count, dtype=np.float32):
    """``(whole, view)``: a result array of ``count`` elements inside a guarded buffer."""
    itemsize = np.dtype(dtype).itemsize
    whole = np.full(2 * GUARD + count * itemsize, PATTERN, np.uint8)
    return whole, whole[GUARD:GUARD + count * itemsize].view(dtype)


def guards_intact(whole, count, itemsize=4):
    return bool(np.all(whole[:GUARD] == PATTERN) and np.all(whole[GUARD + count * itemsize:] == PATTERN))


def mismatched(call, counts, make_comm=cc.Communicator):
    """Run ``call(comm, count, out)`` with ``counts[0]`` elements on every rank but the
    last, ``counts[1]`` there; the problems found (this rank's)."""
    comm = make_comm()
    n = counts[1] if comm.rank == LAST else counts[0]
    whole, out = guarded(call.result_count(comm, n) if hasattr(call, "result_count") else n)
    start = time.monotonic()
    try:
        call(comm, n, out)
        kind, message = "no error", ""
    except cc.CollectiveError as exc:
        kind, message = type(exc).__name__, str(exc)
    problems = []
    if kind != "MessageSizeError":
        problems.append(f"got {kind}: {message}")
    if time.monotonic() - start > 20:
        problems.append(f"took {time.monotonic() - start:.1f} s: the ranks waited instead of being told")
    if not guards_intact(whole, out.size):
        before = int(np.count_nonzero(whole[:GUARD] != PATTERN))
        after = int(np.count_nonzero(whole[GUARD + out.nbytes:] != PATTERN))
        problems.append(f"bytes outside the result changed: {before} before it, {after} after it")
    later, _ = _outcome(lambda: comm.allreduce(np.ones(4), timeout=30))
    if later != "CollectiveError":
        problems.append(f"the communicator was not broken: a later call gave {later}")
    return problems


def _outcome(f):
    try:
        f()
        return "no error", ""
    except cc.CollectiveError as exc:
        return type(exc).__name__, str(exc)


def allreduce(algorithm, timeout=None):
    def call(comm, n, out):
        comm.allreduce(np.ones(n, np.float32), algorithm=algorithm, out=out, timeout=timeout)
    return call


# (elements on every rank but the last, on the last): each way round, so that the last
# rank's buffers are the shorter ones (messages to it too long) or the longer ones.
SMALL = [(1024, 1000), (1000, 1024)]  # 4 KB: a persistent program
MEDIUM = [(16384, 16000), (16000, 16384)]  # 64 KB: the lean executor, sizes in the tags
LARGE = [(1 << 20, (1 << 20) - 1024), ((1 << 20) - 1024, 1 << 20)]  # 4 MiB: messages probed before received


@needs_peers
@pytest.mark.parametrize("counts", SMALL + MEDIUM + LARGE, ids=lambda c: f"{c[0]}v{c[1]}")
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "direct"])
def test_blocking_calls_lean_and_persistent(algorithm, counts):
    agree(WORLD, mismatched(allreduce(algorithm), counts))


@needs_peers
@pytest.mark.parametrize("counts", SMALL + LARGE, ids=lambda c: f"{c[0]}v{c[1]}")
@pytest.mark.parametrize("algorithm", ["ring", "recursive_halving"])
def test_calls_on_the_progress_engine(algorithm, counts):
    agree(WORLD, mismatched(allreduce(algorithm, timeout=60), counts))


@needs_peers
@pytest.mark.parametrize("counts", LARGE, ids=lambda c: f"{c[0]}v{c[1]}")
def test_async_calls_in_flight_together(counts):
    """Two calls in flight, the second mismatched: the engine names it, and the first
    is cancelled or finishes; nothing is written outside either result."""
    def call(comm, n, out):
        first = comm.allreduce_async(np.ones(1000, np.float32), algorithm="ring")
        second = comm.allreduce_async(np.ones(n, np.float32), algorithm="ring", out=out)
        try:
            second.wait()
        finally:
            try:
                first.wait()
            except cc.CollectiveError:
                pass
    agree(WORLD, mismatched(call, counts))


def native(collective, blocking, counts_per_rank=None):
    """MPI's own ``collective`` on ``n`` elements per rank (scatter: ``n`` each)."""
    timeout = None if blocking else 60

    def call(comm, n, out):
        x = np.ones(n, np.float32)
        if collective == "allreduce":
            comm.allreduce(x, algorithm="native", out=out, timeout=timeout)
        elif collective == "broadcast":
            comm.broadcast(out, root=0, algorithm="native", timeout=timeout)
        elif collective == "allgather":
            comm.allgather(x, algorithm="native", out=out.reshape(comm.size, n), timeout=timeout)
        elif collective == "gather":
            comm.gather(x, root=0, algorithm="native", out=out.reshape(comm.size, n) if comm.rank == 0 else None,
                        timeout=timeout)
        elif collective == "scatter":
            comm.scatter(np.ones((comm.size, n), np.float32), root=0, algorithm="native", out=out, timeout=timeout)

    call.result_count = lambda comm, n: n * comm.size if collective in ("allgather", "gather") else n
    return call


# (collective, blocking): the blocking broadcast sends the root's size ahead instead (below)
AGREEING = [(c, b) for c in ["allreduce", "broadcast", "allgather", "gather", "scatter"] for b in (True, False)
            if (c, b) != ("broadcast", True)]


@needs_peers
@pytest.mark.parametrize("counts", SMALL + LARGE, ids=lambda c: f"{c[0]}v{c[1]}")
@pytest.mark.parametrize("collective, blocking", AGREEING,
                         ids=[f"{c}-{'blocking' if b else 'with-timeout'}" for c, b in AGREEING])
def test_native_calls_agree_on_the_size_first(monkeypatch, collective, blocking, counts):
    monkeypatch.setenv(mpi_library.NATIVE_CHECK_ENV, "1")
    agree(WORLD, mismatched(native(collective, blocking), counts))


# Up to 504 B the root's data travels with its size (transport.native.HEADER): each way
# round, and with one side's data travelling apart.
INLINE = [(100, 90), (90, 100), (100, 200), (200, 100)]


@needs_peers
@pytest.mark.parametrize("counts", INLINE + SMALL + LARGE, ids=lambda c: f"{c[0]}v{c[1]}")
def test_a_blocking_broadcast_sends_the_root_s_size_first(monkeypatch, counts):
    """MPI's blocking broadcast, checked (the default on every MPI measured): the last
    rank's buffer differs from the root's (rank 0), so it raises MessageSizeError naming
    both sizes and writes nothing to its buffer or around it, on the lean path (a
    contiguous buffer: its entry, made at the first call and run at once) and on the
    general path (every other element: packed first); the root and the others get the
    root's data. Every rank made the same MPI calls: the communicator works on."""
    monkeypatch.setenv(mpi_library.NATIVE_CHECK_ENV, "1")
    comm = cc.Communicator()
    mine = counts[1] if comm.rank == LAST else counts[0]
    sent = np.arange(counts[0], dtype=np.float32) + 1
    problems = []
    for path, stride in (("lean", 1), ("general", 2)):
        whole, span = guarded(mine * stride)
        out = span[::stride]
        if comm.rank == 0:
            out[...] = sent
        before = whole.copy()
        kind, message = _outcome(lambda out=out: comm.broadcast(out, root=0, algorithm="native"))
        if comm.rank == LAST:
            if kind != "MessageSizeError" or f"holds {mine * 4} B where the root, rank 0, broadcast " \
                                              f"{counts[0] * 4} B" not in message:
                problems.append(f"{path}: {kind}: {message}")
            if np.any(whole != PATTERN):
                problems.append(f"{path}: {int(np.count_nonzero(whole != PATTERN))} bytes written")
        else:
            if kind != "no error" or not np.array_equal(out, sent):
                problems.append(f"{path}: {kind} {message}, or not the root's data")
            written = whole.copy()
            written[GUARD:GUARD + span.nbytes].view(np.float32)[::stride] = before[GUARD:GUARD + span.nbytes].view(
                np.float32)[::stride]  # all but the buffer's own elements as they were
            if not np.array_equal(written, before):
                problems.append(f"{path}: bytes outside the buffer changed")
    got = comm.allreduce(np.full(4, comm.rank, np.int64))
    if not np.array_equal(got, np.full(4, comm.size * (comm.size - 1) // 2)):
        problems.append(f"a later call gave {got}")
    comm.free()
    agree(WORLD, problems)


@needs_peers
def test_native_calls_of_equal_sizes_agree_and_run(monkeypatch):
    """With the agreement on, equal sizes run MPI's collective and give its result (the
    non-blocking ones posted in call order, interleaved with other collectives)."""
    monkeypatch.setenv(mpi_library.NATIVE_CHECK_ENV, "1")
    comm = cc.Communicator()
    p = comm.size
    problems = []
    handles = [comm.allreduce_async(np.full(100, k, np.int64), algorithm="native") for k in range(3)]
    comm.barrier()  # an MPI collective posted while the three wait for their agreement
    rows = comm.allgather(np.full(3, comm.rank, np.int64), algorithm="native")
    for k, handle in enumerate(handles):
        if not np.array_equal(handle.wait(), np.full(100, k * p)):
            problems.append(f"async allreduce {k}")
    if not np.array_equal(rows, np.repeat(np.arange(p), 3).reshape(p, 3)):
        problems.append("allgather")
    if not np.array_equal(comm.scatter(np.arange(p * 2).reshape(p, 2), algorithm="native"), [2 * comm.rank,
                                                                                            2 * comm.rank + 1]):
        problems.append("scatter")
    comm.free()
    agree(WORLD, problems)


@needs_peers
@pytest.mark.parametrize("algorithm,timeout", [("ring", None), ("ring", 60), ("recursive_doubling", None)],
                         ids=["lean", "engine", "persistent"])
def test_a_new_communicator_never_receives_a_broken_one_s_messages(algorithm, timeout):
    """A failed call leaves messages no rank will receive (here the last rank's too
    short receives never take the others' messages). The user makes a new communicator
    and calls the same again, as told; MPI would give the new communicator the freed
    one's context, so its calls, numbered alike, would match those messages: the
    result would be the old call's data. Three broken ones, then a correct call."""
    for _ in range(3):
        comm = cc.Communicator()
        n = 1000 if comm.rank == LAST else 1024
        kind, _ = _outcome(lambda: comm.allreduce(np.ones(n, np.float32), algorithm=algorithm, timeout=timeout))
        comm.free()
        if kind != "MessageSizeError":
            agree(WORLD, [f"the mismatch gave {kind}"])
    comm = cc.Communicator()
    problems = []
    for call in range(2):
        got = comm.allreduce(np.full(1024, comm.rank + call, np.float32), algorithm=algorithm, timeout=timeout)
        want = sum(range(comm.size)) + call * comm.size
        if not (got == want).all():
            problems.append(f"call {call}: {sorted(set(got.tolist()))} where {want} was due")
    comm.free()
    agree(WORLD, problems)


# -- serial: the tag layout and the MPI family ------------------------------------------
@pytest.mark.serial
@pytest.mark.parametrize("tag_ub", [32767, (1 << 29) - 1, (1 << 30) - 1, (1 << 31) - 1, 40000])
def test_the_tag_layout_fits_the_mpi_and_tells_sizes_apart(tag_ub):
    layout = tags.Layout(tag_ub)
    assert layout.blocking + layout.span - 1 <= tag_ub  # every tag allowed
    assert layout.calls == 4096 and layout.span * layout.calls <= tag_ub + 1
    bases = {layout.call(s) for s in range(10_000)}
    assert len(bases) == layout.calls - 1 and layout.blocking not in bases  # blocking calls' base is their own
    assert {layout.call(s) for s in range(4095)} == bases  # 4095 consecutive calls: distinct bases
    sizes = sorted(set(range(min(layout.large, 5000))) | {layout.large - 1})
    assert len({layout.tag(0, n) for n in sizes}) == len(sizes)  # each size below large: its own tag
    assert layout.tag(0, layout.large) == layout.tag(0, 1 << 40) == layout.large  # larger: probed


@pytest.mark.serial
def test_the_job_s_tag_layout_leaves_small_calls_on_persistent_programs():
    layout = tags.layout()
    assert layout.large > 8 * lean.PERSISTENT_BYTES  # a small call's messages never need a probe
    assert tags.Layout(mpi_library.tag_ub()).large == layout.large


@pytest.mark.serial
@pytest.mark.parametrize("text, family, version, shown", [
    ("MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 2026\n", "mpich", "5.0.2", "MPICH 5.0.2"),
    ("MPICH Version: 5.0.2", "mpich", "5.0.2", "MPICH 5.0.2"),  # a fingerprint written before families
    ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11, repo rev: v5.0.11rc1, "
     "Sep 16, 2026\x00", "openmpi", "5.0.11", "Open MPI 5.0.11"),
    ("Intel(R) MPI Library 2021.18.1 for Linux* OS\n", "impi", "2021.18.1", "Intel MPI 2021.18.1"),
    ("MVAPICH2 Version      :\t2.3.7\nMVAPICH2 Release date", "mvapich", "2.3.7", "MVAPICH 2.3.7"),
    ("MPI VERSION    : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)", "cray", "8.1.28.2", "Cray MPICH 8.1.28.2"),
    ("Open MPI 5.0.11", "openmpi", "5.0.11", "Open MPI 5.0.11"),  # as fingerprints write it now
    ("Some MPI 1.0", "unknown", "", "Some MPI 1.0"),
])
def test_the_mpi_family_and_version(text, family, version, shown):
    library = mpi_library.parse(text)
    assert (library.family, library.version, str(library)) == (family, version, shown)


@pytest.mark.serial
def test_this_mpi_is_read_once_and_named_as_mpi4py_names_it():
    """mpi4py's own reading of the vendor is the independent reference."""
    vendor, version = MPI.get_vendor()
    library = mpi_library.library()
    assert str(library) == f"{vendor} {'.'.join(map(str, version))}"
    assert mpi_library.library() is library
    assert mpi_library.tag_ub() == WORLD.Get_attr(MPI.TAG_UB)


@pytest.mark.serial
def test_native_checks_by_family_and_environment(monkeypatch):
    monkeypatch.delenv(mpi_library.NATIVE_CHECK_ENV, raising=False)
    collectives = ("allreduce", "gather", "scatter", "broadcast")
    checked = mpi_library.native_checked(collectives)
    if mpi_library.library().family == "mpich":
        assert checked == {"gather", "scatter", "broadcast"}
    else:
        assert checked == set(collectives)
    assert mpi_library.native_checked(collectives, {mpi_library.NATIVE_CHECK_ENV: "1"}) == set(collectives)
    assert mpi_library.native_checked(collectives, {mpi_library.NATIVE_CHECK_ENV: "0"}) == set()
    with pytest.raises(ValueError, match="COLLECTIVES_NATIVE_SIZE_CHECK must be 1 or 0; got 'yes'"):
        mpi_library.native_checked(collectives, {mpi_library.NATIVE_CHECK_ENV: "yes"})


@pytest.mark.serial
def test_the_ucx_warning_is_quieted_only_where_osc_ucx_cannot_run(tmp_path, monkeypatch):
    environ = {}
    monkeypatch.setattr(mpi_library, "UCX_DEVICE_DIRS", (str(tmp_path / "none"),))
    monkeypatch.setattr(mpi_library, "GPU_DEVICES", (str(tmp_path / "nvidia0"),))
    assert mpi_library.quiet_ucx(environ) and environ == {"OMPI_MCA_osc": "^ucx"}
    chosen = {"OMPI_MCA_osc": "ucx"}
    assert not mpi_library.quiet_ucx(chosen) and chosen == {"OMPI_MCA_osc": "ucx"}  # the user's choice stays
    (tmp_path / "ib").mkdir()
    (tmp_path / "ib" / "mlx5_0").mkdir()
    monkeypatch.setattr(mpi_library, "UCX_DEVICE_DIRS", (str(tmp_path / "ib"),))
    environ = {}
    assert not mpi_library.quiet_ucx(environ) and environ == {}  # an InfiniBand device: osc/ucx may run
    (tmp_path / "nvidia0").write_text("")
    monkeypatch.setattr(mpi_library, "UCX_DEVICE_DIRS", (str(tmp_path / "none"),))
    assert not mpi_library.quiet_ucx(environ) and environ == {}  # a GPU: UCX may use its IPC


@pytest.mark.serial
def test_a_receive_given_up_on_keeps_its_buffer_until_mpi_has_finished_with_it():
    """A cancel does not take on a receive that has matched its message: MPI goes on
    writing into its buffer. Given up on, the request (and so its buffer) is kept for
    the process, not with its communicator, until MPI has finished with it."""
    comm = MPI.COMM_SELF.Dup()
    buffer = np.zeros(4)
    alive = weakref.ref(buffer)
    retired.abandon(comm.Irecv(buffer, source=0, tag=7))  # never cancelled: as one whose cancel did not take
    del buffer
    comm.Free()
    gc.collect()
    assert alive() is not None, "the buffer went while MPI could still write into it"
    comm = MPI.COMM_SELF.Dup()
    second = np.zeros(4)
    finished = weakref.ref(second)
    request = comm.Irecv(second, source=0, tag=7)
    comm.Send(np.arange(4.0), dest=0, tag=7)  # this one finishes
    retired.abandon(request)
    assert np.array_equal(second, np.arange(4.0))
    del request, second
    cancelled = comm.Irecv(np.zeros(1), source=0, tag=8)
    cancelled.Cancel()
    retired.abandon(cancelled)  # each one kept lets go of those MPI has finished with
    gc.collect()
    assert finished() is None and alive() is not None
    comm.Free()
