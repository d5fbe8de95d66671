"""send and recv (and their async twins): point-to-point messages at every world size
(1 serially: a rank's messages to itself; 2-8 under mpiexec)."""

import time

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc

from conftest import ALL_DTYPES, agree, rank_input

WORLD = MPI.COMM_WORLD
needs_peers = pytest.mark.skipif(WORLD.Get_size() < 2, reason="needs at least two ranks")


def neighbours(comm):
    return (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size


def test_a_ring_of_messages_in_every_dtype_and_shape(comm):
    """Each rank sends to the next and receives from the one before (async on both
    sides, so one rank alone talks to itself)."""
    problems = []
    to, frm = neighbours(comm)
    for dtype in ALL_DTYPES:
        for shape in ((0,), (1,), (7,), (3, 5), (100_003,)):
            count = int(np.prod(shape))
            mine = rank_input(comm.rank, count, dtype).reshape(shape)
            want = rank_input(frm, count, dtype).reshape(shape)
            out = np.empty(shape, dtype)
            sending = comm.send_async(mine, to, tag=3)
            got = comm.recv_async(out, frm, tag=3).wait()
            sending.wait()
            if got is not out or not np.array_equal(out, want):
                problems.append(f"{dtype} {shape}: {out.ravel()[:4]} != {want.ravel()[:4]}")
    agree(comm, problems)


def test_strided_arrays_and_other_shapes_of_the_same_size(comm):
    problems = []
    to, frm = neighbours(comm)
    wide = np.arange(24, dtype=np.int32).reshape(4, 6) + 100 * comm.rank
    canvas = np.full((3, 8), -1, np.int32)
    sending = comm.send_async(wide[:, ::2], to)  # 12 elements, strided: packed
    comm.recv_async(canvas[:, ::2], frm).wait()  # 12 elements of another shape, strided: unpacked
    sending.wait()
    want = (np.arange(24, dtype=np.int32).reshape(4, 6) + 100 * frm)[:, ::2].reshape(3, 4)
    if not np.array_equal(canvas[:, ::2], want) or not (canvas[:, 1::2] == -1).all():
        problems.append(f"{canvas}")
    agree(comm, problems)


def test_order_is_kept_per_tag_and_tags_keep_messages_apart(comm):
    problems = []
    to, frm = neighbours(comm)
    sends = [comm.send_async(np.array([k, comm.rank]), to, tag=k % 2) for k in range(6)]
    odd = [comm.recv_async(np.empty(2, np.int64), frm, tag=1) for _ in range(3)]  # posted first, matched by tag
    even = [comm.recv_async(np.empty(2, np.int64), frm, tag=0) for _ in range(3)]
    got = [h.wait().tolist() for h in odd + even]
    for h in sends:
        h.wait()
    if got != [[1, frm], [3, frm], [5, frm], [0, frm], [2, frm], [4, frm]]:
        problems.append(f"{got}")
    agree(comm, problems)


def test_messages_never_match_a_collective_in_flight(comm):
    """A send whose tag equals the collective's call number (its tag) goes to the recv,
    not to the collective."""
    problems = []
    to, frm = neighbours(comm)
    total = comm.allreduce_async(np.full(1000, 1.0), algorithm="ring")
    tag = comm._ctx.sequence  # the tag of the allreduce's own messages
    sending = comm.send_async(np.full(1000, -5.0), to, tag=tag)
    got = comm.recv_async(np.empty(1000), frm, tag=tag).wait()
    sending.wait()
    if not (total.wait() == comm.size).all() or not (got == -5.0).all():
        problems.append("a message crossed over")
    agree(comm, problems)


def test_any_source_says_who_sent(comm):
    problems = []
    if comm.rank == 0:
        seen = set()
        for _ in range(comm.size - 1):
            handle = comm.recv_async(np.empty(1, np.int64), src=None, tag=7)
            value = handle.wait()
            if value[0] != 10 * handle.source:
                problems.append(f"{value} from {handle.source}")
            seen.add(handle.source)
        if seen != set(range(1, comm.size)):
            problems.append(f"sources {seen}")
    else:
        comm.send(np.array([10 * comm.rank]), 0, tag=7)
    agree(comm, problems)


def test_receives_from_any_rank_and_from_one_rank_match_in_the_order_posted(comm):
    """MPI's rule, kept although receives are posted only once a probe finds their
    message: receives of one tag that could take the same message take the messages
    in the order the receives were made, whether they name the rank or not; half of
    the messages are sent before the receives are made, half after."""
    problems = []
    last = comm.size - 1
    sends = []
    if comm.rank == last:
        sends = [comm.send_async(np.array([k]), 0, tag=4) for k in range(3)]
    comm.barrier()
    if comm.rank == 0:
        receives = [comm.recv_async(np.empty(1, np.int64), src, tag=4)
                    for src in (None, last, None, last, None, None)]
    comm.barrier()
    if comm.rank == last:
        sends += [comm.send_async(np.array([k]), 0, tag=4) for k in range(3, 6)]
    if comm.rank == 0:
        got = [int(h.wait()[0]) for h in receives]
        if got != list(range(6)) or {h.source for h in receives} != {last}:
            problems.append(f"{got} from {[h.source for h in receives]}")
    for h in sends:
        h.wait()
    agree(comm, problems)


@needs_peers
def test_blocking_send_and_recv_between_two_ranks(comm):
    """A pipeline's pattern: each stage receives from the one before and sends on."""
    problems = []
    x = np.zeros(5000)
    if comm.rank > 0:
        comm.recv(x, comm.rank - 1)
    x += 1
    if comm.rank < comm.size - 1:
        comm.send(x, comm.rank + 1)
    if not (x == comm.rank + 1).all():
        problems.append(f"{x[:3]}")
    agree(comm, problems)


def test_bad_arguments_raise_before_any_message(comm):
    to = (comm.rank + 1) % comm.size
    x = np.ones(4)
    cases = [
        (lambda: comm.send(x, comm.size), ValueError, "dst must be a rank in"),
        (lambda: comm.send(x, -1), ValueError, "dst must be a rank in"),
        (lambda: comm.send(x, None), ValueError, "dst must be a rank in"),
        (lambda: comm.send(x, comm.rank), ValueError, "dst is this rank"),
        (lambda: comm.recv(x, comm.rank), ValueError, "src is this rank"),
        (lambda: comm.send_async(x, to, tag=-1), ValueError, "tag must be an integer"),
        (lambda: comm.send_async(x, to, tag=1.5), ValueError, "tag must be an integer"),
        (lambda: comm.send_async("text", to), TypeError, "x has unsupported dtype"),
        (lambda: comm.recv_async(None, to), ValueError, "out must be the array"),
        (lambda: comm.recv_async([1.0, 2.0], to), TypeError, "out must be a numpy.ndarray"),
        (lambda: comm.recv_async(np.ones(4), comm.size), ValueError, "src must be a rank in"),
        (lambda: comm.send_async(x, to, timeout=0), ValueError, "timeout"),
    ]
    read_only = np.ones(4)
    read_only.flags.writeable = False
    cases.append((lambda: comm.recv_async(read_only, to), ValueError, "out must be writable"))
    for call, kind, text in cases:
        with pytest.raises(kind, match=text):
            call()
    # nothing was sent: a collective afterwards still matches
    agree(comm, [] if comm.allreduce(np.ones(2))[0] == comm.size else ["the allreduce after"])


@needs_peers
@pytest.mark.parametrize("sent,held", [(10, 12), (12, 10)], ids=["shorter", "longer"])
def test_a_message_of_the_wrong_size_is_an_error_on_the_receiver(sent, held):
    comm = cc.Communicator()
    problems = []
    if comm.rank == 0:
        comm.send(np.ones(sent), 1)
    elif comm.rank == 1:
        memory = np.full(held + 4, -1.0)  # the receive, and what lies past it
        try:
            comm.recv(memory[:held], 0)
            problems.append("no error")
        except cc.MessageSizeError as exc:
            if "recv from rank 0 (tag 0)" not in str(exc) or f"{held * 8} B" not in str(exc) or \
                    f"rank 0 sent {sent * 8} B" not in str(exc):
                problems.append(str(exc))
        if not (memory == -1.0).all():  # not relying on MPI's truncation (Open MPI writes past the buffer)
            problems.append(f"the message was written into the receive's memory: {memory}")
        later = "no error"
        try:
            comm.barrier()
        except cc.CollectiveError as exc:
            later = str(exc)
        if "broken" not in later:
            problems.append(f"the communicator is not broken: {later}")
    agree(WORLD, problems)


@needs_peers
def test_a_recv_from_a_rank_that_never_sends_times_out_naming_it():
    comm = cc.Communicator()
    problems = []
    last = comm.size - 1
    if comm.rank == 0:
        start = time.monotonic()
        try:
            comm.recv(np.empty(3), last, tag=9, timeout=1.0)
            problems.append("no timeout")
        except cc.CollectiveTimeoutError as exc:
            text = str(exc)
            if f"recv from rank {last} (tag 9): Timed out after 1.0 s" not in text or \
                    f"waiting for a message from rank {last} (24 B)" not in text:
                problems.append(text)
        if time.monotonic() - start > 2.0:
            problems.append("raised more than timeout + 1 s after")
    agree(WORLD, problems)


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="needs two ranks")
def test_a_receive_in_flight_does_not_hold_up_a_blocking_collective():
    # Rank 0 posts a receive that rank 1 answers only after the allreduce: the blocking
    # collective runs alone after the collectives in flight, but not after the sends and
    # receives, which would wait for ever here.
    comm = cc.Communicator()
    buf = np.zeros(4)
    pending = comm.recv_async(buf, 1, tag=3) if comm.rank == 0 else None
    strided = np.ones(8)[::2]  # not contiguous: the general path
    results = [comm.allreduce(strided, algorithm="ring"),
               comm.allreduce(strided[:2]),  # auto: native, MPI's blocking call
               comm.allreduce(np.ones(4), algorithm="ring")]  # contiguous: the lean path
    if comm.shares_memory:  # the shared window made at the first shm call: a collective point too
        results.append(comm.allreduce(np.ones(4), algorithm="shm"))
    if comm.rank == 1:
        comm.send(np.full(4, 7.0), 0, tag=3)
    problems = [f"allreduce {k}: {got}" for k, got in enumerate(results) if not (got == comm.size).all()]
    if pending is not None:
        pending.wait()
        if not np.array_equal(buf, np.full(4, 7.0)):
            problems.append(f"the receive got {buf}")
    agree(MPI.COMM_WORLD, problems)
    comm.free()
