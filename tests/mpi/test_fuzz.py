"""Property tests (hypothesis) over random shapes, dtypes, strides, ops, roots and
algorithms, over real MPI messages. Runs serially and under ``mpiexec -n N``.

- valid calls equal the NumPy reference exactly, every rank's result has the same bits,
  inputs of out-of-place calls are left alone, and memory around a strided ``out`` too;
- invalid calls raise the documented exception, with the same message on every rank,
  and leave nothing in flight (a small allreduce afterwards works);
- NaN and ±Inf propagate as NumPy's ufuncs do (and, for ``native`` max/min, as MPICH
  does: see ``test_nan_and_inf``);
- integer sums and products wrap as NumPy's do, in every algorithm including native.

Every rank runs every example in the same order: the examples are derandomized, drawn
from nothing rank-dependent, and never shrunk (a shrink after a failure seen by one
rank would make the ranks' examples diverge). Roots are drawn as integers and taken
modulo the world size; each rank's input comes from a drawn seed and its rank, so every
rank can rebuild everyone's input and compute the reference locally. Each example ends
with an agreement (``lockstep``): if any rank found a problem, every rank raises, at
the same line, so hypothesis takes the same path everywhere and no rank is left waiting
in the next collective. A communicator with a 60 s timeout turns a real hang into a
``CollectiveTimeoutError`` (reported by the agreement) instead of a stuck CI job.
"""

import hashlib
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import collectives as cc
from collectives import reference

from conftest import host_algorithms, ops_for

pytestmark = pytest.mark.long

WORLD = MPI.COMM_WORLD

try:
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # the library then refuses bfloat16; it is simply not drawn
    BFLOAT16 = None

DTYPES = {d.name: d for d in cc.SUPPORTED_DTYPES}
if BFLOAT16 is not None:
    DTYPES["bfloat16"] = BFLOAT16
DTYPE_NAMES = list(DTYPES)
INT_NAMES = [n for n in DTYPE_NAMES if DTYPES[n].kind in "iu"]
FLOAT_NAMES = [n for n in DTYPE_NAMES if DTYPES[n].kind in "fc" or DTYPES[n] == BFLOAT16]
REDUCING = ("allreduce", "reduce_scatter", "reduce")
ROWS = ("scatter", "alltoall")  # an input of one row per rank


def fuzz(examples):
    """Identical examples on every rank, in the same order; no shrinking, no database."""
    return settings(max_examples=examples, derandomize=True, database=None, phases=[Phase.generate],
                    deadline=None, suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
                    print_blob=False)


@pytest.fixture
def fcomm():
    """A fresh communicator per test: a hang becomes a CollectiveTimeoutError after 60 s,
    and a communicator broken by one test does not break the next."""
    comm = cc.Communicator(timeout=60)
    yield comm
    comm.free()


def split_groups():
    """(color, key) per way of splitting COMM_WORLD: the whole world in reverse rank
    order, odd and even ranks, and two unequal parts with reversed ranks."""
    rank, size = WORLD.rank, WORLD.size
    return [(0, size - rank), (rank % 2, rank), (int(rank >= max(1, size // 3)), -rank)]


@pytest.fixture
def fcomms():
    """[world, and each split of split_groups()] as (communicator, group label), fresh per test."""
    made = [(cc.Communicator(timeout=60), "world", None)]
    for i, (color, key) in enumerate(split_groups()):
        sub = WORLD.Split(color, key)
        made.append((cc.Communicator(sub, timeout=60), f"split {i} color {color}", sub))
    yield [(comm, label) for comm, label, _ in made]
    for comm, _, sub in made:
        comm.free()
        if sub is not None:
            sub.Free()


def lockstep(problem, same=None, group=None):
    """Every rank learns every rank's ``problem`` (None: none) and raises if there is any;
    ``same`` (e.g. a result's digest or an error message) must be equal on every rank of
    the same ``group`` (the sub-communicator the call ran on)."""
    everyone = WORLD.allgather((problem, same, group))
    found = [f"rank {r}: {p}" for r, (p, _, _) in enumerate(everyone) if p is not None]
    for g in {g for _, _, g in everyone}:
        values = [s for _, s, h in everyone if h == g]
        if len(set(values)) > 1:
            found.append(f"differs between the ranks of group {g}: {values}")
    if found:
        raise AssertionError("\n".join(found[:8]) + (f"\n... {len(found) - 8} more" if len(found) > 8 else ""))


def guarded(body):
    """Run ``body()`` (returns ``same`` for lockstep) and turn any exception into a problem,
    so that every rank reaches the agreement."""
    try:
        return None, body()
    except Exception as exc:  # noqa: BLE001 - reported by lockstep on every rank
        return f"{type(exc).__name__}: {exc}"[:2000], None


# -- inputs ---------------------------------------------------------------------------
def rank_values(seed, rank, shape, dtype, op, full=False):
    """Rank ``rank``'s input, contiguous: integer-valued and small enough that every op is
    exact in every dtype up to 8 ranks (sums within ±24, products of at most 8 factors of
    magnitude <= 2, so within 256 even in bfloat16); with ``full``, integer dtypes span
    their whole range (sums and products then wrap, exactly, in any order)."""
    rng = np.random.default_rng([seed, rank])
    n = math.prod(shape)
    if dtype.kind in "iu" and full:
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=n, endpoint=True, dtype=dtype).reshape(shape)
    unsigned = dtype.kind == "u"
    if op == "prod":
        choices = [1, 1, 1, 2, 3] if unsigned else [1, 1, 1, 2, -1, -2, 0]
        if dtype.kind == "c":
            choices = [1, 1, -1, 1j, -1j, 1 + 1j, 2, 0]
    else:
        choices = list(range(0, 7)) if unsigned else list(range(-3, 4))
        if dtype.kind == "c":
            choices = [a + 1j * b for a in range(-3, 4) for b in (-2, 0, 1, 3)]
    values = np.array(choices)[rng.integers(0, len(choices), size=n)]
    return values.astype(dtype).reshape(shape)


def laid_out(values, steps, perm, fill=0):
    """``values`` in a (usually) non-contiguous view: each axis taken with a step (negative
    steps reverse it) out of a bigger array, the axes permuted. Returns (view, base)."""
    shape = values.shape
    if not shape:
        base = values.copy()
        return base, base
    parent = [0] * len(shape)
    for i, p in enumerate(perm):
        parent[p] = shape[i]
    base = np.full([abs(s) * n for s, n in zip(steps, parent)], fill, values.dtype)
    view = base[tuple(slice(None, None, s) for s in steps)].transpose(perm)
    assert view.shape == shape
    view[...] = values
    return view, base


def outside(view, base):
    """``base`` with the elements of ``view`` zeroed: what must survive a call into ``view``."""
    copy = base.copy()
    offset = (view.__array_interface__["data"][0] - base.__array_interface__["data"][0])
    np.lib.stride_tricks.as_strided(copy.reshape(-1)[offset // base.itemsize:], view.shape, view.strides)[...] = 0
    return copy


def expected(collective, rank, size, xs, op, root):
    """NumPy's answer for rank ``rank`` (collectives.reference), given every rank's ``xs``."""
    return reference.expected(collective, xs, op, root)[rank]


def comparable(a):
    """``a`` as floats NumPy's testing compares exactly (complex as (real, imag) pairs)."""
    a = np.asarray(a)
    if a.dtype == BFLOAT16:
        return a.astype(np.float32)
    if a.dtype.kind == "c":
        return np.stack([a.real, a.imag], axis=-1)
    return a


def mismatch(got, want, label):
    """None if ``got`` is ``want`` exactly (dtype, shape, values; NaN equals NaN, +0 equals -0)."""
    if want is None:
        return None if got is None else f"{label}: expected None, got {type(got).__name__}"
    if not isinstance(got, np.ndarray):
        return f"{label}: expected an ndarray, got {type(got).__name__}"
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{label}: got {got.dtype}{got.shape}, expected {want.dtype}{want.shape}"
    try:
        np.testing.assert_array_equal(comparable(got), comparable(want), err_msg=label)
    except AssertionError as exc:
        return str(exc)[:1500]
    return None


def digest(a):
    return None if a is None else hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()


def call(comm, collective, x, *, op="sum", algorithm="auto", root=0, out=None, segment_size=None,
         timeout=None, use_async=False):
    """One call in its blocking or ``*_async(...).wait()`` form."""
    fn = getattr(comm, collective + ("_async" if use_async else ""))
    extra = {} if timeout is None else {"timeout": timeout}
    if collective == "allreduce":
        result = fn(x, op=op, algorithm=algorithm, out=out, segment_size=segment_size, **extra)
    elif collective == "reduce_scatter":
        result = fn(x, op=op, algorithm=algorithm, out=out, **extra)
    elif collective == "allgather":
        result = fn(x, algorithm=algorithm, out=out, **extra)
    elif collective == "broadcast":
        result = fn(x, root=root, algorithm=algorithm, segment_size=segment_size, **extra)
    elif collective in ("gather", "scatter"):
        result = fn(x, root=root, algorithm=algorithm, out=out, **extra)
    elif collective == "alltoall":
        result = fn(x, algorithm=algorithm, out=out, **extra)
    else:
        result = fn(x, root=root, op=op, algorithm=algorithm, out=out, **extra)
    return result.wait() if use_async else result


def result_shape(collective, shape, size, rank):
    """The result's shape for an input of ``shape`` (scatter, alltoall: of one row)."""
    if collective in ("allgather", "gather", "alltoall"):
        return (size,) + tuple(shape)
    if collective == "reduce_scatter":
        return np.array_split(np.empty(math.prod(shape)), size)[rank].shape
    return tuple(shape)


# -- strategies -----------------------------------------------------------------------
STEPS = [1, 1, 2, -1, -2, 3]
MAX_DIM = {0: 1, 1: 300, 2: 40, 3: 12}


@st.composite
def shapes(draw):
    ndim = draw(st.integers(0, 3))
    return tuple(draw(st.lists(st.integers(0, MAX_DIM[ndim]), min_size=ndim, max_size=ndim)))


@st.composite
def layouts(draw, ndim):
    """(steps, axis permutation): identity, strided, reversed and/or transposed."""
    kind = draw(st.sampled_from(["contiguous", "strided", "strided"]))
    if kind == "contiguous" or ndim == 0:
        return [1] * ndim, list(range(ndim))
    steps = draw(st.lists(st.sampled_from(STEPS), min_size=ndim, max_size=ndim))
    perm = draw(st.permutations(range(ndim)))
    return steps, list(perm)


def capped_segment(segment_size, nbytes):
    """At most 64 segments per call (tiny segments on big buffers are slow, not harder)."""
    if segment_size is None:
        return None
    return max(segment_size, -(-nbytes // 64))


@st.composite
def valid_cases(draw):
    collective = draw(st.sampled_from(cc.COLLECTIVES))
    dtype = draw(st.sampled_from(DTYPE_NAMES))
    algorithms = [a for a in host_algorithms(collective) if not (a == "native" and DTYPES[dtype] == BFLOAT16)]
    algorithm = draw(st.sampled_from(algorithms))
    op = draw(st.sampled_from(ops_for(DTYPES[dtype]))) if collective in REDUCING else "sum"
    shape = draw(shapes())
    # "overlap": out shares memory with x without being x (allreduce, reduce: x reversed;
    # allgather: x is a row of out, as MPI's in-place allgather; reduce_scatter: out is
    # the start of x): the library must read x before writing out.
    outs = ["none", "contiguous", "strided", "overlap"] + (["inplace"] if collective in ("allreduce", "reduce") else [])
    out = draw(st.sampled_from(outs if collective != "broadcast" else ["none"]))
    read_only = collective != "broadcast" and out not in ("inplace", "overlap") and draw(st.booleans())
    return dict(
        collective=collective, algorithm=algorithm, dtype=dtype, op=op, shape=shape,
        layout=draw(layouts(len(shape))), out=out, out_layout=draw(layouts(len(shape) + 1)), read_only=read_only,
        root=draw(st.integers(0, 63)), seed=draw(st.integers(0, 2**32 - 1)), full=draw(st.booleans()),
        use_async=draw(st.booleans()), group=draw(st.sampled_from([0, 0, 1, 2, 3])),
        segment_size=(draw(st.sampled_from([None, None, 1, 8, 100, 4096]))
                      if collective in ("allreduce", "broadcast") else None),
        # timeout=inf: no limit, so a blocking native call takes MPI's blocking collective
        # (the latency path) instead of the non-blocking one the 60 s timeout needs.
        no_timeout=algorithm == "native" and draw(st.booleans()),
    )


# -- valid calls ----------------------------------------------------------------------
@fuzz(200)
@given(case=valid_cases())
def test_valid_calls_equal_numpy(fcomms, case):
    """A random valid call equals NumPy's answer exactly on every rank (on COMM_WORLD or
    on a sub-communicator from Split, every rank in one)."""
    fcomm, group = fcomms[case["group"]]
    rank, size = fcomm.rank, fcomm.size
    c, dtype, op, shape = case["collective"], DTYPES[case["dtype"]], case["op"], case["shape"]
    root = case["root"] % size
    label = f"{case} (root {root}, {group}: rank {rank} of {size}; world size {WORLD.size})"

    def body():
        xshape = (size,) + tuple(shape) if c in ROWS else shape  # scatter, alltoall: shape is a row's
        xs = [rank_values(case["seed"], r, xshape, dtype, op, case["full"]) for r in range(size)]
        want = expected(c, rank, size, xs, op, root)
        x, _ = laid_out(xs[rank], *(case["out_layout"] if c in ROWS else case["layout"]), fill=1)
        x.flags.writeable = not case["read_only"]
        rshape = result_shape(c, shape, size, rank)
        out = base = None
        if case["out"] == "inplace":
            out = x
        elif case["out"] == "contiguous":
            out = np.full(rshape, 5, dtype)
        elif case["out"] == "strided":
            steps, perm = case["out_layout"]
            out, base = laid_out(np.full(rshape, 5, dtype), steps[:len(rshape)],
                                 [p for p in perm if p < len(rshape)], fill=3)
        elif case["out"] == "overlap":
            if c == "scatter":  # out is a row of x: the root must read its rows first
                x = xs[rank].copy()
                out = x[(root + 1) % size, ...]
            elif c == "alltoall":  # out is x reversed: every row must be read before written
                x = xs[rank].copy()
                out = x[::-1]
            elif c in ("allgather", "gather"):
                out = np.full(rshape, 5, dtype)
                x = out[case["root"] % size, ...]  # a view, even of a 0-d row
                x[...] = xs[rank]
            elif c == "reduce_scatter":
                x = xs[rank].copy()
                out = x.reshape(-1)[:math.prod(rshape)]
            else:
                out = x[(slice(None, None, -1),) * x.ndim + (Ellipsis,)]  # a view even for 0-d
        out_before = None if out is None else out.copy()
        base_outside = None if base is None else outside(out, base)
        got = call(fcomm, c, x, op=op, algorithm=case["algorithm"], root=root, out=out,
                   segment_size=capped_segment(case["segment_size"], xs[0].nbytes),
                   timeout=math.inf if case["no_timeout"] else None, use_async=case["use_async"])
        problems = [mismatch(got, want, "result")]
        if c == "broadcast":
            if got is not x:
                problems.append("broadcast did not return x")
            problems.append(mismatch(x, want, "broadcast's x"))
        elif out is not None:
            if c in ("reduce", "gather") and rank != root:
                problems.append(mismatch(out, out_before, "a non-root's out (must be left alone)"))
            elif got is not out:
                problems.append("the result is not out")
        overwritten = case["out"] == "overlap" and not (c in ("reduce", "gather") and rank != root)
        if out is not x and c != "broadcast" and not overwritten:
            problems.append(mismatch(x, xs[rank], "x after an out-of-place call (must be left alone)"))
        if base is not None:
            problems.append(mismatch(outside(out, base), base_outside, "memory around the strided out"))
        problems = [p for p in problems if p]
        if problems:
            raise AssertionError("; ".join(problems))
        # every rank's result has the same bits (reduce: only root has one; reduce_scatter: a block each)
        return digest(got) if c in ("allreduce", "allgather", "broadcast") else None

    problem, same = guarded(body)
    lockstep(None if problem is None else f"{label}: {problem}", same, group)


# -- invalid calls --------------------------------------------------------------------
BAD_DTYPES = ["bool", "object", "longdouble", ">f4", "<U3", "datetime64[s]"]
DEFECTS = {  # defect: the collectives it applies to
    "unknown op": REDUCING,
    "avg on integers": REDUCING,
    "max/min on complex": REDUCING,
    "bitwise op on a non-integer": REDUCING,
    "root out of range": ("broadcast", "reduce", "gather", "scatter"),
    "unknown algorithm": cc.COLLECTIVES,
    "out of the wrong shape": ("allreduce", "reduce_scatter", "allgather", "reduce", "scatter", "alltoall"),
    "out of the wrong dtype": ("allreduce", "reduce_scatter", "allgather", "reduce", "scatter", "alltoall"),
    "read-only out": ("allreduce", "reduce_scatter", "allgather", "reduce", "scatter", "alltoall"),
    "out not an ndarray": ("allreduce", "reduce_scatter", "allgather", "reduce", "scatter", "alltoall"),
    "rows other than the world size": ("scatter", "alltoall"),
    "broadcast into a read-only array": ("broadcast",),
    "bad segment_size": ("allreduce", "broadcast"),
    "bad timeout": cc.COLLECTIVES,
    "unsupported dtype": cc.COLLECTIVES,
    "x not an array": cc.COLLECTIVES,
}
if BFLOAT16 is not None:
    DEFECTS["native with bfloat16"] = cc.COLLECTIVES


@st.composite
def invalid_cases(draw):
    defect = draw(st.sampled_from(sorted(DEFECTS)))
    collective = draw(st.sampled_from(DEFECTS[defect]))
    algorithms = [a for a in host_algorithms(collective) if a != "native"]
    return dict(defect=defect, collective=collective, algorithm=draw(st.sampled_from(algorithms)),
                count=draw(st.integers(0, 20)), pick=draw(st.integers(0, 1000)), use_async=draw(st.booleans()),
                after=draw(st.sampled_from(host_algorithms("allreduce"))))


def invalid_call(comm, case):
    """(call, exception type, a substring of its message) for ``case``'s defect."""
    c, defect, pick, size = case["collective"], case["defect"], case["pick"], comm.size
    count = case["count"] * (size if c == "reduce_scatter" else 1)  # equal blocks: the same message everywhere
    kw = dict(algorithm=case["algorithm"], use_async=case["use_async"])
    x = np.ones((size, count) if c in ROWS else count, np.float32)  # scatter, alltoall: a row per rank

    def choose(options):
        return options[pick % len(options)]

    def make(**changes):
        args = dict(kw, **changes)
        return lambda: call(comm, c, args.pop("x", x), **args)

    if defect == "unknown op":
        return (make(op=choose(["mean", "SUM", "", None, 3, "avg "])), ValueError,
                "op must be one of sum, prod, max, min, avg, band, bor, bxor; got")
    if defect == "avg on integers":
        dtype = choose(INT_NAMES)
        return (make(x=np.ones(count, dtype), op="avg"), TypeError,
                f"op 'avg' needs a floating or complex dtype; got {dtype}")
    if defect == "max/min on complex":
        op, dtype = choose([("max", "complex64"), ("min", "complex64"), ("max", "complex128"), ("min", "complex128")])
        return make(x=np.ones(count, dtype), op=op), TypeError, f"op '{op}' is not defined for complex dtype {dtype}"
    if defect == "bitwise op on a non-integer":
        op, dtype = choose([(op, d) for op in ("band", "bor", "bxor") for d in FLOAT_NAMES])
        return make(x=np.ones(count, DTYPES[dtype]), op=op), TypeError, f"op '{op}' needs an integer dtype; got {dtype}"
    if defect == "rows other than the world size":
        rows = choose([size + 1, 2 * size + 1]) if size > 1 else 2
        return (make(x=np.ones((rows, count), np.float32)), ValueError,
                f"x must have shape (size, *s) = ({size}, ...), one row per rank; got ({rows}, {count})")
    if defect == "root out of range":
        root = choose([size, -1, 1.5, True, None, size + 3, "0", np.int64(size)])
        return make(root=root), ValueError, f"root must be a rank in 0..{size - 1}; got"
    if defect == "unknown algorithm":
        other = {"allreduce": "bruck", "reduce_scatter": "tree", "allgather": "binomial", "broadcast": "ring",
                 "reduce": "ring", "gather": "ring", "scatter": "direct", "alltoall": "ring"}[c]
        algorithm = choose(["fastest", "RING", None, 3, ("ring",), "", other])
        return (make(algorithm=algorithm), ValueError,
                f"algorithm for {c} must be one of {', '.join(cc.algorithms(c))}; got")
    if defect == "out of the wrong shape":
        want = result_shape(c, (count,), size, comm.rank)
        shape = choose([(want[0] + 1,) + want[1:], want + (1,), (), (math.prod(want) + 2,)])
        return make(out=np.zeros(shape, np.float32)), ValueError, f"out must have shape {want}; got {shape}"
    shape = result_shape(c, (count,), size, comm.rank)
    if defect == "out of the wrong dtype":
        dtype = choose([n for n in DTYPE_NAMES if n != "float32"])
        return (make(out=np.zeros(shape, DTYPES[dtype])), TypeError,
                f"out must have dtype float32; got {DTYPES[dtype].name}")
    if defect == "read-only out":
        out = np.zeros(shape, np.float32)
        out.flags.writeable = False
        return make(out=out), ValueError, "out must be writable"
    if defect == "out not an ndarray":
        return make(out=np.zeros(shape, np.float32).tolist()), TypeError, "out must be a numpy.ndarray; got list"
    if defect == "broadcast into a read-only array":
        if pick % 2:
            return make(x=memoryview(bytes(count))), ValueError, "x must be a writable array"
        x.flags.writeable = False
        return make(), ValueError, "x must be a writable array: broadcast fills it in place"
    if defect == "bad segment_size":
        return (make(segment_size=choose([0, -8, 2.5, "big", True, 0.0])), ValueError,
                "segment_size must be a positive number of bytes; got")
    if defect == "bad timeout":
        return (make(timeout=choose([0, -1, "1", True, math.nan, -math.inf, 0.0])), ValueError,
                "timeout must be a positive number of seconds")
    if defect == "unsupported dtype":
        dtype = np.dtype(choose(BAD_DTYPES))
        return make(x=np.zeros(x.shape, dtype)), TypeError, "x has "
    if defect == "x not an array":
        return make(x=choose([object(), {"a": 1}, [object(), 1]])), TypeError, "x must be an array or buffer"
    assert defect == "native with bfloat16"
    return (make(x=np.ones(x.shape, BFLOAT16), algorithm="native"), ValueError,
            "algorithm 'native' cannot move bfloat16")


@fuzz(100)
@given(case=invalid_cases())
def test_invalid_calls_raise_everywhere(fcomm, case):
    """Every rank makes the same invalid call: each raises the documented exception with
    the same message, and a valid allreduce afterwards still works (nothing in flight)."""
    def body():
        fn, kind, text = invalid_call(fcomm, case)
        try:
            fn()
        except (ValueError, TypeError) as exc:
            if type(exc) is not kind or text not in str(exc):
                raise AssertionError(f"raised {type(exc).__name__}({exc}), expected {kind.__name__} "
                                     f"containing {text!r}") from None
            message = f"{type(exc).__name__}: {exc}"
        else:
            raise AssertionError(f"no exception, expected {kind.__name__} containing {text!r}")
        x = np.array([fcomm.rank + 1, 1], np.int64)
        got = fcomm.allreduce(x, algorithm=case["after"])
        if got.tolist() != [fcomm.size * (fcomm.size + 1) // 2, fcomm.size]:
            raise AssertionError(f"the allreduce after the invalid call gave {got.tolist()}")
        return message

    problem, message = guarded(body)
    lockstep(None if problem is None else f"{case} (world size {fcomm.size}): {problem}", message)


# -- NaN and Inf -----------------------------------------------------------------------
SPECIALS = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


@st.composite
def special_cases(draw):
    collective = draw(st.sampled_from(REDUCING + ("allgather", "broadcast")))
    dtype = draw(st.sampled_from(FLOAT_NAMES))
    algorithms = [a for a in host_algorithms(collective) if not (a == "native" and DTYPES[dtype] == BFLOAT16)]
    return dict(collective=collective, dtype=dtype, algorithm=draw(st.sampled_from(algorithms)),
                count=draw(st.integers(1, 40)), seed=draw(st.integers(0, 2**32 - 1)), root=draw(st.integers(0, 63)),
                specials=draw(st.lists(st.tuples(st.integers(0, 63), st.integers(0, 10**6),
                                                 st.sampled_from(["nan", "nan", "inf", "-inf"]), st.booleans()),
                                       min_size=1, max_size=12)),
                use_async=draw(st.booleans()))


def special_ops(collective, dtype):
    """The ops a NaN/Inf example runs (each with the same specials)."""
    if collective not in REDUCING:
        return ["sum"]  # data movement: op unused
    if dtype.kind == "c":
        # left out: complex prod. Complex products with infinities are not associative
        # (inf - inf = nan inside (a+bi)(c+di) appears or not depending on the order of
        # the factors), so there is no order-free answer to compare with.
        return ["sum", "avg"]
    return ops_for(dtype)


def with_specials(values, rank, size, specials):
    """``values`` with NaN/±Inf written where ``specials`` put them on ``rank``
    ((rank token, position, kind, imaginary part?); the token is taken modulo the size)."""
    x = values.copy()
    for who, where, kind, imag in specials:
        if who % size == rank and x.size:
            i = where % x.size
            if x.dtype.kind == "c":
                x[i] = (x[i].real + 1j * SPECIALS[kind]) if imag else (SPECIALS[kind] + 1j * x[i].imag)
            else:
                x[i] = SPECIALS[kind]
    return x


def native_selects(got, xs):
    """For MPICH's max/min on floats. What it guarantees, observed with MPICH 5 at world
    sizes 2-4 (Allreduce, Iallreduce, Reduce; float16/32/64): its op is the C expression
    ``a > b ? a : b`` (min: ``<``), which does not propagate NaN: a NaN on some ranks is
    kept or dropped depending on where it enters the combining order (e.g. at -n 3, a
    NaN on rank 2 gave NaN, on rank 0 or 1 it gave 2.0 = the max of the others, and for
    min a NaN on rank 0 gave 2.0, not the min of the others' values 1.0 and 2.0, because
    the NaN replaced a partial result). So for NaN-free elements the result is exact
    (±Inf included), where every rank has NaN it is NaN, and otherwise it is NaN or one of
    the ranks' values there (a select never invents a value). Returns a problem or None."""
    got = np.asarray(got, np.float64).reshape(-1)
    stack = np.stack([np.asarray(x, np.float64).reshape(-1) for x in xs])
    nan = np.isnan(stack)
    mixed = nan.any(axis=0) & ~nan.all(axis=0)
    bad = []
    for i in np.flatnonzero(mixed):
        if not (np.isnan(got[i]) or (got[i] == stack[~nan[:, i], i]).any()):
            bad.append((int(i), float(got[i]), stack[:, i].tolist()))
    return f"native max/min invented a value: {bad[:5]}" if bad else None


@fuzz(80)
@given(case=special_cases())
def test_nan_and_inf(fcomm, case):
    """NaN and ±Inf go through as in NumPy's ufuncs (np.maximum/np.minimum propagate NaN,
    inf + -inf = nan, inf * 0 = nan); data movement keeps every bit (NaN payloads too).
    Each example runs every op of its dtype on the same inputs."""
    rank, size = fcomm.rank, fcomm.size
    c, dtype, algorithm = case["collective"], DTYPES[case["dtype"]], case["algorithm"]
    root = case["root"] % size
    label = f"{case} (root {root}, world size {size})"

    def one(op):
        xs = [with_specials(rank_values(case["seed"], r, (case["count"],), dtype, op), r, size, case["specials"])
              for r in range(size)]
        nbytes = xs[0].nbytes * (size if c == "allgather" else 1)
        native = algorithm == "native" or (algorithm == "auto" and dtype != BFLOAT16
                                           and fcomm.choose(c, nbytes)[0] == "native")
        got = call(fcomm, c, xs[rank].copy(), op=op, algorithm=algorithm, root=root, use_async=case["use_async"])
        want = expected(c, rank, size, xs, op, root)
        if c in ("allgather", "broadcast"):
            if got.dtype != want.dtype or got.tobytes() != want.tobytes():
                raise AssertionError(f"bits changed: {got} != {want}")
            return digest(got)
        if want is None or got is None:
            if got is not want:
                raise AssertionError(f"{op}: got {type(got).__name__}, expected {type(want).__name__}")
            return None
        if native and op in ("max", "min"):
            # MPICH's max/min do not propagate NaN (see native_selects): compare exactly
            # where no rank has a NaN, and check the rest for what MPICH does guarantee.
            flat = [x.reshape(-1) for x in xs]
            if c == "reduce_scatter":
                lo = sum(len(b) for b in np.array_split(np.empty(xs[0].size), size)[:rank])
                flat = [f[lo:lo + want.size] for f in flat]
            clean = ~np.isnan(np.stack([f.astype(np.float64) for f in flat])).any(axis=0)
            problem = mismatch(got[clean], want[clean], f"{op}: NaN-free elements") or native_selects(got, flat)
        else:
            problem = mismatch(got, want, op)
        if problem:
            raise AssertionError(problem)
        return digest(got) if c == "allreduce" and not (native and op in ("max", "min")) else None

    def body():
        return [one(op) for op in special_ops(c, dtype)]

    problem, same = guarded(body)
    lockstep(None if problem is None else f"{label}: {problem}", None if same is None else tuple(same))


# -- integer overflow --------------------------------------------------------------------
@st.composite
def overflow_cases(draw):
    collective = draw(st.sampled_from(REDUCING))
    return dict(collective=collective, dtype=draw(st.sampled_from(INT_NAMES)),
                algorithm=draw(st.sampled_from(host_algorithms(collective))), count=draw(st.integers(0, 50)),
                seed=draw(st.integers(0, 2**32 - 1)), root=draw(st.integers(0, 63)), use_async=draw(st.booleans()))


def near_limits(seed, rank, count, dtype):
    """Values at and near the dtype's limits (and small factors, so products wrap too)."""
    info = np.iinfo(dtype)
    rng = np.random.default_rng([seed, rank])
    candidates = np.array([info.min, info.min + 1, info.max, info.max - 1, info.max // 2 + 1, 2, 3, 0, 1],
                          dtype=dtype)
    if dtype.kind == "i":
        candidates = np.concatenate([candidates, np.array([-1, -2, info.min // 2 - 1], dtype=dtype)])
    return candidates[rng.integers(0, len(candidates), size=count)]


@fuzz(50)
@given(case=overflow_cases())
def test_integer_overflow_wraps_as_numpy(fcomm, case):
    """Sums and products near the limits wrap exactly as NumPy's reductions in that dtype
    (np.add.reduce / np.multiply.reduce with dtype=), in every algorithm, native included.
    Each example runs both ops on the same inputs."""
    rank, size = fcomm.rank, fcomm.size
    c, dtype = case["collective"], DTYPES[case["dtype"]]
    root = case["root"] % size
    label = f"{case} (root {root}, world size {size})"

    def one(op):
        xs = [near_limits(case["seed"], r, case["count"], dtype) for r in range(size)]
        ufunc = np.add if op == "sum" else np.multiply
        total = ufunc.reduce(np.stack(xs), axis=0, dtype=dtype)
        want = {"allreduce": total, "reduce": total if rank == root else None,
                "reduce_scatter": np.array_split(total, size)[rank]}[c]
        got = call(fcomm, c, xs[rank], op=op, algorithm=case["algorithm"], root=root, use_async=case["use_async"])
        problem = mismatch(got, want, op)
        if problem:
            raise AssertionError(problem)
        return digest(got) if c == "allreduce" else None

    def body():
        return (one("sum"), one("prod"))

    problem, same = guarded(body)
    lockstep(None if problem is None else f"{label}: {problem}", same)


# -- several calls in flight together ----------------------------------------------------
@st.composite
def flight_cases(draw):
    calls = []
    for _ in range(draw(st.integers(2, 4))):
        collective = draw(st.sampled_from(cc.COLLECTIVES))
        dtype = draw(st.sampled_from(DTYPE_NAMES))
        algorithms = [a for a in host_algorithms(collective) if not (a == "native" and DTYPES[dtype] == BFLOAT16)]
        algorithm = draw(st.sampled_from(algorithms))
        blocking = draw(st.booleans())
        calls.append(dict(collective=collective, dtype=dtype, algorithm=algorithm,
                          op=draw(st.sampled_from(ops_for(DTYPES[dtype]))) if collective in REDUCING else "sum",
                          count=draw(st.integers(0, 300)), root=draw(st.integers(0, 63)), blocking=blocking,
                          # a blocking native call without a time limit is MPI's blocking collective,
                          # which first finishes this rank's calls in flight
                          no_timeout=blocking and algorithm == "native" and draw(st.booleans())))
    return dict(calls=calls, order=draw(st.permutations(range(len(calls)))), seed=draw(st.integers(0, 2**32 - 1)))


@fuzz(60)
@given(case=flight_cases())
def test_calls_in_flight_together(fcomm, case):
    """2-4 calls started one after the other (async ones left in flight, blocking ones in
    between), the async ones waited for in a drawn order: every result equals NumPy's."""
    rank, size = fcomm.rank, fcomm.size
    label = f"{case} (world size {size})"

    def body():
        handles, wants, results = {}, {}, {}
        for i, spec in enumerate(case["calls"]):
            c, dtype, op, root = spec["collective"], DTYPES[spec["dtype"]], spec["op"], spec["root"] % size
            shape = (size, spec["count"]) if c in ROWS else (spec["count"],)  # a row per rank
            xs = [rank_values(case["seed"] + i, r, shape, dtype, op) for r in range(size)]
            wants[i] = expected(c, rank, size, xs, op, root)
            fn = getattr(fcomm, c if spec["blocking"] else c + "_async")
            kw = dict(algorithm=spec["algorithm"])
            if spec["no_timeout"]:
                kw["timeout"] = math.inf
            if c in REDUCING:
                kw["op"] = op
            if c in ("broadcast", "reduce", "gather", "scatter"):
                kw["root"] = root
            got = fn(xs[rank].copy(), **kw)
            if spec["blocking"]:
                results[i] = got
            else:
                handles[i] = got
        for i in case["order"]:
            if i in handles:
                results[i] = handles[i].wait()
        problems = [mismatch(results[i], wants[i], f"call {i}") for i in range(len(case["calls"]))]
        problems = [p for p in problems if p]
        if problems:
            raise AssertionError("; ".join(problems))
        return None

    problem, same = guarded(body)
    lockstep(None if problem is None else f"{label}: {problem}", same)
