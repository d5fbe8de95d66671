"""Every algorithm's schedules, run for many virtual ranks in one process.

These need no MPI messages, so they cover world sizes 1-16, 24 and 32 and every kind
of count in seconds; the MPI suite then checks the same plans over real messages.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives.algorithms import BUILDERS, ORDERED, VARIABLE, build
from collectives.schedule import Copy, Recv, Reduce, Schedule, Send, compile_plan, sl
from collectives.sim import alltoallv_counts
from collectives.sim import reference as sim_reference
from collectives.transport.local import run_collective

from conftest import ALL_DTYPES, expected_everywhere, ops_for, quick_and_deep, rank_input, same

pytestmark = pytest.mark.serial

ALGORITHMS = [(c, a) for c, names in BUILDERS.items() for a in names]
SEGMENTED = {("allreduce", "tree"), ("broadcast", "pipeline")}
ROOTED = ("broadcast", "reduce", "gather", "scatter")


def check(collective, algorithm, size, count, dtype="float64", op="sum", root=0, segment=3, inplace=False,
          counts=None):
    """Problems with one call; ``count`` elements per rank (scatter, alltoall: per block;
    alltoallv: ``counts[i][j]`` elements from rank i to rank j, by default the
    simulator's uneven matrix around ``count``)."""
    if collective in VARIABLE and counts is None:
        counts = alltoallv_counts(size, count)
    lengths = [count * (size if collective in ("scatter", "alltoall") else 1)] * size if counts is None \
        else [int(row.sum()) for row in counts]
    inputs = [rank_input(r, lengths[r], dtype, op) for r in range(size)]
    kept = [x.copy() for x in inputs]
    got = run_collective(collective, algorithm, inputs, op, root, segment, inplace, counts=counts)
    want = sim_reference(collective, kept, counts=counts) if counts is not None \
        else expected_everywhere(collective, kept, op, root)
    problems = []
    for r in range(size):
        if want[r] is None:
            if got[r] is not None:
                problems.append(f"rank {r} got a result")
        elif not same(got[r], want[r]):
            problems.append(f"rank {r}: {got[r][:6]} != {want[r][:6]}")
    assert all(same(a, b) for a, b in zip(inputs, kept)), "an input was modified"
    return problems


@pytest.mark.parametrize("sizes", quick_and_deep([1, 2, 3, 4, 5, 6, 7, 8, 13, 16], [9, 10, 11, 12, 14, 15, 24, 32]))
@pytest.mark.parametrize("collective,algorithm", ALGORITHMS)
def test_every_size_count_root_and_mode(collective, algorithm, sizes):
    problems = []
    for size in sizes:
        counts = sorted({0, 1, size - 1, size, size + 1, 37, 3 * size + 2})
        roots = sorted({0, size // 2, size - 1}) if collective in ROOTED else [0]
        modes = [False, True] if collective in ("allreduce", "reduce") else [False]
        segments = [1, 4] if (collective, algorithm) in SEGMENTED else [1]
        for count in counts:
            for root in roots:
                for inplace in modes:
                    for segment in segments:
                        for p in check(collective, algorithm, size, count, root=root, inplace=inplace, segment=segment):
                            problems.append(f"p={size} n={count} root={root} inplace={inplace} seg={segment}: {p}")
    assert not problems, "\n".join(problems[:10])


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_alltoallv_with_any_counts(data):
    """Random per-peer counts, zeros and a lone non-empty peer included."""
    size = data.draw(st.integers(1, 12))
    counts = np.array(data.draw(st.lists(st.lists(st.integers(0, 9) | st.just(0), min_size=size, max_size=size),
                                         min_size=size, max_size=size)))
    dtype = data.draw(st.sampled_from(["float64", "int8", "complex64"]))
    assert not check("alltoallv", "pairwise", size, 0, dtype, counts=counts)


@pytest.mark.parametrize("collective,algorithm",
                         [ca for ca in ALGORITHMS if ca[0] in ("allreduce", "reduce_scatter", "reduce")])
def test_every_dtype_and_op(collective, algorithm):
    problems = []
    for dtype in ALL_DTYPES:
        for op in ops_for(dtype):
            for size in (3, 4, 8):
                problems += [f"{dtype} {op} p={size}: {p}" for p in check(collective, algorithm, size, 29, dtype, op)]
    assert not problems, "\n".join(problems[:10])


@pytest.mark.parametrize("algorithm", list(BUILDERS["allreduce"]))
@pytest.mark.parametrize("size", [2, 3, 5, 6, 7, 8, 12, 16])
def test_allreduce_bits_identical_on_every_rank(algorithm, size):
    # Inputs mixing ±3e4 and 1e-2 make the sum depend on its order: every rank must
    # still get the same bits (each element reduced once, in one order, then copied).
    rng = np.random.default_rng(size)
    for dtype in ("float16", "float32", "float64", "complex128"):
        inputs = [(rng.choice([-3e4, 3e4, 1e-2, -1e-2, 3.3], 257) * rng.random(257)).astype(dtype) for _ in range(size)]
        for op in ("sum", "prod", "avg"):
            # The values are ill-conditioned on purpose (cancellation, float16
            # overflow): exactness is tested elsewhere, agreement between ranks here.
            with np.errstate(over="ignore", invalid="ignore"):
                got = run_collective("allreduce", algorithm, inputs, op, segment=16)
            assert all(g.tobytes() == got[0].tobytes() for g in got), f"{dtype} {op}: ranks differ"


def bytes_sent(collective, algorithm, rank, size, count, itemsize=4):
    plan = compile_plan(build(collective, algorithm, rank, size, count, segment=max(1, count)))
    sends = [op for op in plan.ops if isinstance(op, Send)]
    return len(sends), sum(op.src.hi - op.src.lo for op in sends) * itemsize


@pytest.mark.parametrize("size", range(2, 17))
def test_ring_direct_and_rabenseifner_send_the_bandwidth_bound(size):
    count = 64 * 9 * 5 * 7 * 11 * 13  # divisible by every size here
    n = count * 4
    bound = 2 * (size - 1) * n // size
    for rank in range(size):
        for algorithm in ("ring", "direct"):
            messages, sent = bytes_sent("allreduce", algorithm, rank, size, count)
            assert (messages, sent) == (2 * (size - 1), bound)
        for collective in ("reduce_scatter", "allgather"):
            per_rank = count if collective == "reduce_scatter" else count // size
            messages, sent = bytes_sent(collective, "direct", rank, size, per_rank)
            assert (messages, sent) == (size - 1, bound // 2)
    if size & (size - 1) == 0:  # Rabenseifner meets the bound for powers of two
        for rank in range(size):
            messages, sent = bytes_sent("allreduce", "recursive_halving", rank, size, count)
            assert (messages, sent) == (2 * int(math.log2(size)), bound)


@pytest.mark.parametrize("size", [2, 3, 4, 7, 8, 16])
def test_workspace_is_a_fraction_of_the_buffer(size):
    count = 10_007
    chunk = -(-count // size)
    for rank in range(size):
        assert build("allreduce", "ring", rank, size, count).tmp <= 2 * chunk
        assert build("reduce_scatter", "ring", rank, size, count).tmp <= 2 * chunk
        assert build("allreduce", "tree", rank, size, count, segment=100).tmp <= 4 * 100
        assert build("broadcast", "pipeline", rank, size, count, segment=100).tmp == 0
        assert build("broadcast", "scatter_allgather", rank, size, count).tmp == 0
        assert build("allreduce", "direct", rank, size, count).tmp <= (size - 1) * chunk
        assert build("reduce_scatter", "direct", rank, size, count).tmp <= (size - 1) * chunk
        assert build("broadcast", "direct", rank, size, count).tmp == 0


def test_plan_waits_only_for_the_data_it_touches():
    s = Schedule([], tmp=4)
    s.recv(1, sl("tmp", 0, 2))  # 0
    s.recv(2, sl("tmp", 2, 4))  # 1: independent of 0
    s.reduce(sl("out", 0, 2), sl("in", 0, 2), sl("tmp", 0, 2))  # 2: after 0
    s.send(1, sl("out", 0, 2))  # 3: after 2
    s.recv(1, sl("tmp", 0, 2))  # 4: after 2 read tmp[0:2] (write after read); after 0 by order
    s.copy(sl("out", 2, 4), sl("tmp", 2, 4))  # 5: after 1
    plan = compile_plan(s)
    waits = {i: sorted(j for j, deps in enumerate(plan.dependents) if i in deps) for i in range(6)}
    assert waits == {0: [], 1: [], 2: [0], 3: [2], 4: [0, 2], 5: [1]}
    assert plan.fifo_prev[4] == 0 and plan.fifo_next[0] == 4  # messages from rank 1 keep their order
    assert [type(op) for op in plan.ops] == [Recv, Recv, Reduce, Send, Recv, Copy]


def test_inplace_plans_respect_that_in_is_out():
    s = Schedule([])
    s.send(1, sl("in", 0, 4))
    s.recv(1, sl("out", 0, 4))
    assert compile_plan(s).waits == (0, 0)
    assert compile_plan(s, inplace=True).waits == (0, 1)


def test_slices_outside_the_workspace_are_refused():
    s = Schedule([], tmp=2)
    s.recv(1, sl("tmp", 0, 3))
    with pytest.raises(ValueError, match="outside"):
        compile_plan(s)


@settings(max_examples=150, deadline=None)
@given(
    algorithm=st.sampled_from(ALGORITHMS),
    size=st.integers(1, 20),
    count=st.integers(0, 300),
    dtype=st.sampled_from(ALL_DTYPES),
    data=st.data(),
)
def test_property_results_equal_numpy(algorithm, size, count, dtype, data):
    collective, name = algorithm
    op = data.draw(st.sampled_from(ops_for(dtype)))
    root = data.draw(st.integers(0, size - 1))
    segment = data.draw(st.integers(1, 64))
    inplace = data.draw(st.booleans()) and collective in ("allreduce", "reduce")
    assert not check(collective, name, size, count, dtype, op, root, segment, inplace)


@pytest.mark.parametrize("collective,algorithm,ordered",
                         [(c, a, False) for c, a in ALGORITHMS] + [(c, a, True) for c, names in ORDERED.items()
                                                                    for a in names])
def test_device_plans_equal_the_plain_ones_bit_for_bit(collective, algorithm, ordered):
    """The device runs each plan with its reduction chains fused (``fuse_reductions``) and
    cut into segments (``split_schedule``): the same values, bit for bit (random floats,
    so any change in the order of the operations would show), in place too; and
    ``direct``'s p-1 reductions, in either order, become one multi-input reduction."""
    from collectives.schedule import Reduce, ReduceMany, fuse_reductions, split_schedule

    rng = np.random.default_rng(len(algorithm))
    problems = []
    for size in (1, 2, 3, 5, 8, 17):
        for count in (0, 1, size + 1, 100):
            for inplace in ([False, True] if collective in ("allreduce", "reduce") else [False]):
                matrix = alltoallv_counts(size, count) if collective in VARIABLE else None
                lengths = [count * (size if collective in ("scatter", "alltoall") else 1)] * size if matrix is None \
                    else [int(row.sum()) for row in matrix]
                inputs = [rng.standard_normal(n) for n in lengths]

                def schedule_of(r):
                    mine = None if matrix is None else (tuple(matrix[r].tolist()), tuple(matrix[:, r].tolist()))
                    return build(collective, algorithm, r, size, count, root=size - 1, segment=3, ordered=ordered,
                                 counts=mine, inplace=inplace)

                plain_plans = [compile_plan(schedule_of(r), inplace=inplace) for r in range(size)]
                plain = run_collective(collective, algorithm, [x.copy() for x in inputs], "sum", size - 1, 3,
                                       inplace, plans=plain_plans, counts=matrix)
                plans = []
                for r in range(size):
                    schedule = fuse_reductions(schedule_of(r), inplace=inplace)
                    reductions = [op for op in schedule.ops if isinstance(op, (Reduce, ReduceMany))]
                    if algorithm == "direct" and 2 <= size <= 16 and collective != "allgather" \
                            and collective != "broadcast":
                        assert len(reductions) == 1 and (size == 2 or isinstance(reductions[0], ReduceMany)), (size, r)
                    plans.append(compile_plan(split_schedule(schedule, 7), inplace=inplace))
                device = run_collective(collective, algorithm, [x.copy() for x in inputs], "sum", size - 1, 3,
                                        inplace, plans=plans, counts=matrix)
                for r in range(size):
                    if (plain[r] is None) != (device[r] is None) or \
                            (plain[r] is not None and plain[r].tobytes() != device[r].tobytes()):
                        problems.append(f"p={size} n={count} inplace={inplace} rank {r}")
    assert not problems, problems[:5]


def test_fusion_keeps_a_fold_apart_from_memory_it_would_overwrite():
    from collectives.schedule import ReduceMany, fuse_reductions

    # t = a op b; d = t op c: fused only while nothing later reads t.
    s = Schedule([], tmp=4)
    s.reduce(sl("tmp", 0, 1), sl("tmp", 0, 1), sl("tmp", 1, 2))
    s.reduce(sl("out", 0, 1), sl("tmp", 0, 1), sl("in", 0, 1))
    assert fuse_reductions(s).ops == [ReduceMany(sl("out", 0, 1), (sl("tmp", 0, 1), sl("tmp", 1, 2), sl("in", 0, 1)))]
    s.send(1, sl("tmp", 0, 1))
    assert len(fuse_reductions(s).ops) == 3
    # An input that overlaps the destination without being its very elements: the
    # one-pass kernel would read elements it has already written. In place, in is out.
    s = Schedule([], tmp=4)
    s.reduce(sl("out", 0, 2), sl("tmp", 0, 2), sl("tmp", 2, 4))
    s.reduce(sl("out", 0, 2), sl("out", 0, 2), sl("in", 1, 3))
    assert len(fuse_reductions(s).ops) == 1
    assert len(fuse_reductions(s, inplace=True).ops) == 2
    # A fold into tmp copied out right after (an in-place reduce's root): one fold into
    # out, unless tmp is read later or an input overlaps out but is not its elements.
    for later, second, fused in ((False, sl("in", 0, 2), True), (True, sl("in", 0, 2), False),
                                 (False, sl("in", 1, 3), False)):
        s = Schedule([], tmp=4)
        s.reduce(sl("tmp", 0, 2), sl("reg", 0, 2), second)
        s.reduce(sl("tmp", 0, 2), sl("tmp", 0, 2), sl("reg", 4, 6))
        s.copy(sl("out", 0, 2), sl("tmp", 0, 2))
        if later:
            s.send(1, sl("tmp", 0, 2))
        ops = fuse_reductions(s, inplace=True).ops
        want = [ReduceMany(sl("out", 0, 2), (sl("reg", 0, 2), second, sl("reg", 4, 6)))]
        assert (ops == want) == fused, (later, second, ops)


def _one_call(blocking, rng):
    """One call's takes from ``blocking`` (a BlockingScheduler), made as the blocking
    executors make them, beside a fresh Scheduler's, its posted messages finishing a
    random few at a time; returns (blocking's takes, the Scheduler's, blocking's pending
    counts, the Scheduler's)."""
    from collectives.transport.scheduler import LOCAL, Scheduler

    program = blocking.program
    reference = Scheduler(program)
    blocking.restart()
    done = at = 0
    got, want, got_pending, want_pending = [program.opening], [tuple(reference.take())], [], []
    posted = []
    while True:
        got_pending.append(list(blocking.pending(at)))
        want_pending.append(list(reference.pending))
        posted += [i for i in got[-1] if program.kinds[i] < LOCAL]
        if done == program.all_messages:
            return got, want, got_pending, want_pending
        assert posted, "messages remain, none posted"
        finishing = rng.choice(len(posted), size=rng.integers(1, len(posted) + 1), replace=False)
        for k in sorted(finishing, reverse=True):
            i = posted.pop(k)
            reference.complete(i)
            done |= 1 << i
        taken = blocking.remembered.get((at, done))
        got.append(blocking.take(at, done) if taken is None else taken)
        want.append(tuple(reference.take()))
        at = done


@pytest.mark.parametrize("memo", [256, 3])
@pytest.mark.parametrize("collective,algorithm", [("allreduce", "ring"), ("allreduce", "recursive_doubling"),
                                                  ("allreduce", "recursive_halving"), ("allreduce", "direct"),
                                                  ("allreduce", "tree"),
                                                  ("broadcast", "pipeline"), ("alltoall", "pairwise")])
def test_blocking_scheduler_takes_what_the_scheduler_takes(collective, algorithm, memo, monkeypatch):
    """The blocking executors' scheduler, which remembers each transition, hands out
    what the scheduling rule does in every order of completions: when it remembers
    the transition, when it does not, and once it has stopped remembering (``memo`` 3)."""
    from collectives.transport.scheduler import BlockingScheduler, program_of

    monkeypatch.setattr(BlockingScheduler, "MEMO", memo)
    rng = np.random.default_rng(7)
    for size in (2, 3, 4, 6):
        for rank in (0, size - 1):
            plan = compile_plan(build(collective, algorithm, rank, size, 5 * size, segment=2))
            program = program_of(plan)
            blocking = BlockingScheduler(program)
            for call in range(12):
                got, want, got_pending, want_pending = _one_call(blocking, rng)
                assert got == want, (size, rank, call)
                assert got_pending == want_pending, (size, rank, call)
                assert sorted(i for taken in got for i in taken) == list(range(len(plan.ops)))
            if memo == 3 and program.messages > 2:
                assert not blocking.remembering and not blocking.remembered  # more orders than it keeps
