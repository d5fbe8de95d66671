"""The CUDA kernels' arithmetic, checked on the host against NumPy.

``kernels/elementwise.cuh`` holds every element operation the kernels run, as
``__host__ __device__`` functions. ``host_harness.cpp`` compiles them with g++ (the
loop bodies themselves, 16-byte vector path included) into a shared library that these
tests call through ctypes: every op x dtype, float16/bfloat16 rounding, NaN/Inf, signed
zeros and integer wrap-around, against NumPy (and ml_dtypes for bfloat16). Then every
kernel instantiation is compiled with nvcc for sm_80 and sm_90, and the exact source
and instantiations the CuPy backend hands NVRTC are compiled by NVRTC where its
library is installed. Each of those steps skips, with the reason, where its compiler
is missing.
"""

import ctypes
import functools
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from collectives.device import kernels

from conftest import HARNESS

pytestmark = pytest.mark.serial

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
KERNELS = HARNESS.parent.parent / "kernels"
DTYPES = [np.dtype(n) for n in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                                "float32", "float64", "complex64", "complex128")] + [BF16]
UFUNC = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
         "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler (g++) to build the host harness of kernels/elementwise.cuh")
    library = tmp_path_factory.mktemp("harness") / "harness.so"
    command = [compiler, "-O2", "-std=c++17", "-ffp-contract=off", "-fPIC", "-shared", "-Wall", "-Werror",
               f"-I{KERNELS}", str(HARNESS / "host_harness.cpp"), "-o", str(library)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr}"
    lib = ctypes.CDLL(str(library))
    p, i64, c = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_char_p
    lib.cc_reduce2.argtypes = [c, c, p, p, p, i64, ctypes.c_int]
    lib.cc_reduce_n.argtypes = [c, c, ctypes.POINTER(p), ctypes.c_int, ctypes.POINTER(p), ctypes.c_int, i64,
                                ctypes.c_int]
    lib.cc_reduce_n_divide.argtypes = [c, ctypes.POINTER(p), ctypes.c_int, ctypes.POINTER(p), ctypes.c_int, i64,
                                       ctypes.c_int, ctypes.c_double]
    lib.cc_reduce_blocks.argtypes = [c, ctypes.POINTER(p), ctypes.c_int, ctypes.POINTER(p), ctypes.c_int,
                                     ctypes.POINTER(i64), ctypes.POINTER(i64), ctypes.c_int, ctypes.c_double]
    lib.cc_divide.argtypes = [c, p, i64, ctypes.c_double]
    lib.cc_cast_divide.argtypes = [c, c, p, p, i64, ctypes.c_double]
    lib.cc_pack.argtypes = lib.cc_unpack.argtypes = [ctypes.c_int, p, p, i64, ctypes.c_int, p, p]
    lib.cc_copy_n.argtypes = [ctypes.c_int, ctypes.POINTER(p), ctypes.POINTER(p), p, ctypes.c_int, ctypes.c_int]
    for name in ("cc_float_to_half", "cc_half_to_float", "cc_double_to_half", "cc_float_to_bf16"):
        getattr(lib, name).argtypes = [p, p, i64]
        getattr(lib, name).restype = None
    return lib


def ptr(a):
    return a.ctypes.data


def name_of(dtype):
    return np.dtype(dtype).name.encode()


# -- inputs --------------------------------------------------------------------------------
def values(dtype, n, rng, integer_valued=False):
    """Random values of ``dtype`` that reach every corner: the whole range of integers
    (so sums and products wrap), and floats of every magnitude with NaN, +-Inf, +-0
    and subnormals mixed in."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    if integer_valued:  # components -1, 0, 1: even a product of 16 stays exact
        real = rng.integers(-1, 2, n).astype(np.float64)
        return (real + 1j * rng.integers(-1, 2, n)).astype(dtype) if dtype.kind == "c" else real.astype(dtype)
    part = np.float32 if dtype in (np.float16, BF16, np.complex64) else np.float64

    def component():
        x = rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))
        special = rng.random(n)
        x[special < 0.02] = np.nan
        x[(special >= 0.02) & (special < 0.04)] = np.inf
        x[(special >= 0.04) & (special < 0.06)] = -np.inf
        x[(special >= 0.06) & (special < 0.09)] = 0.0
        x[(special >= 0.09) & (special < 0.12)] = -0.0
        x[(special >= 0.12) & (special < 0.15)] *= 1e-40  # subnormal in float32, tiny in float16
        return x.astype(part)

    with np.errstate(over="ignore", invalid="ignore"):
        if dtype.kind == "c":
            return (component() + 1j * component().astype(np.complex128)).astype(dtype)
        return component().astype(dtype)


def same_bits(got, want, zero_sign=True):
    """Bitwise equal, except that any NaN equals any NaN (payloads differ between NumPy's
    loops and CPUs) and, with ``zero_sign=False``, +0 equals -0."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype.kind == "c":
        return same_bits(got.real, want.real, zero_sign) and same_bits(got.imag, want.imag, zero_sign)
    if got.dtype.kind in "iu":
        return np.array_equal(got, want)
    with np.errstate(invalid="ignore"):  # ml_dtypes warns when casting a NaN
        g, w = got.astype(np.float64), want.astype(np.float64)
    nan = np.isnan(g)
    if not np.array_equal(nan, np.isnan(w)):
        return False
    bits = got.view(f"u{got.dtype.itemsize}")[~nan] == want.view(f"u{want.dtype.itemsize}")[~nan]
    if zero_sign:
        return bool(bits.all())
    return bool((bits | (g[~nan] == w[~nan])).all())


def numpy_reduce(op, a, b):
    with np.errstate(all="ignore"):
        return UFUNC[op](a, b)


# -- the ops -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("op", list(UFUNC))
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_reduce2_equals_numpy(harness, dtype, op, offset):
    if op not in kernels.ops_for(dtype):  # complex max/min, bitwise ops on non-integers
        assert harness.cc_reduce2(name_of(dtype), op.encode(), None, None, None, 0, 1) == -2
        assert harness.cc_reduce_n(name_of(dtype), op.encode(), pointers_to(), 1, pointers_to(), 1, 0, 1) == -2
        return
    rng = np.random.default_rng([dtype.num, len(op), offset])
    n = 4099  # not a multiple of any vector width: the tail runs too
    exact = dtype.kind == "c" and op == "prod"  # NumPy's own complex product depends on the CPU's FMA
    a = placed(values(dtype, n, rng, exact), offset)
    b = placed(values(dtype, n, rng, exact), offset)
    want = numpy_reduce(op, a, b)
    out = placed(np.zeros(n, dtype), offset)
    a_in_place, b_in_place = placed(a, offset), placed(b, offset)
    cases = ((out, a, b, 1), (a_in_place, a_in_place, b, 7), (b_in_place, a, b_in_place, 256))
    for dst, x, y, threads in cases:  # dst may be a or b; one thread, or a grid of 7 or 256
        assert harness.cc_reduce2(name_of(dtype), op.encode(), ptr(dst), ptr(x), ptr(y), n, threads) == 0
        assert same_bits(dst, want, zero_sign=op not in ("max", "min")), \
            f"{dtype} {op} {threads} threads: {dst[:6]} != {want[:6]}"


def placed(x, offset):
    """A copy of ``x`` starting ``offset`` elements into a fresh (16-byte aligned)
    allocation: offset 1 puts small elements off the 16-byte grid (the scalar path)."""
    buffer = np.empty(x.size + offset, x.dtype)
    buffer[offset:] = x
    return buffer[offset:]


def test_max_min_signed_zeros_follow_numpy(harness):
    """For equal operands (+0 and -0) NumPy's float32/float64 loops return b, its float16
    loop returns a and ml_dtypes' bfloat16 returns b: the kernels do the same."""
    for dtype in (np.float16, np.float32, np.float64, BF16):
        a = np.array([0.0, -0.0, -0.0, 0.0], dtype)
        b = np.array([-0.0, 0.0, -0.0, 0.0], dtype)
        for op in ("max", "min"):
            got = np.empty_like(a)
            harness.cc_reduce2(name_of(dtype), op.encode(), ptr(got), ptr(a), ptr(b), a.size, 1)
            want = numpy_reduce(op, a, b)
            assert np.array_equal(np.signbit(got.astype(np.float32)), np.signbit(want.astype(np.float32))), \
                f"{np.dtype(dtype).name} {op}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_reduce_n_is_the_left_fold(harness, dtype):
    rng = np.random.default_rng(dtype.num)
    n = 1031
    for op in kernels.ops_for(dtype):
        exact = dtype.kind == "c" and op == "prod"
        for k in (1, 2, 3, 7, 16):
            inputs = [values(dtype, n, rng, exact) for _ in range(k)]
            want = functools.reduce(lambda x, y: numpy_reduce(op, x, y), inputs)
            got = np.empty(n, dtype)
            sources = pointers_to(*inputs)
            assert harness.cc_reduce_n(name_of(dtype), op.encode(), pointers_to(got), 1, sources, k, n, k + 2) == 0
            assert same_bits(got, want, zero_sign=op not in ("max", "min")), f"{dtype} {op} k={k}"
            if k >= 2:  # dst may be a later input (the deterministic direct in place): read before written
                inputs[k // 2] = dst = inputs[k // 2].copy()
                assert harness.cc_reduce_n(name_of(dtype), op.encode(), pointers_to(dst), 1, pointers_to(*inputs), k,
                                           n, 7) == 0
                assert same_bits(dst, want, zero_sign=op not in ("max", "min")), f"{dtype} {op} k={k} in place"
            # several outputs (the leader's fold into every rank's), each an input's very elements or apart
            inputs = [x.copy() for x in inputs]  # (one of them may hold the fold now: fold them anew)
            want = functools.reduce(lambda x, y: numpy_reduce(op, x, y), inputs)
            outputs = [np.empty(n, dtype), inputs[0], np.empty(n, dtype), inputs[-1]][: min(k + 2, 4)]
            assert harness.cc_reduce_n(name_of(dtype), op.encode(), pointers_to(*outputs), len(outputs),
                                       pointers_to(*inputs), k, n, 5) == 0
            for j, out in enumerate(outputs):
                assert same_bits(out, want, zero_sign=op not in ("max", "min")), f"{dtype} {op} k={k} output {j}"
    assert harness.cc_reduce_n(name_of(dtype), b"sum", pointers_to(), 1, pointers_to(), 17, 0, 1) == -3
    assert harness.cc_reduce_n(name_of(dtype), b"sum", pointers_to(), 17, pointers_to(), 1, 0, 1) == -3


def pointers_to(*arrays):
    """A C array of 16 pointers: ``arrays``' data, then nulls."""
    return (ctypes.c_void_p * 16)(*[ptr(x) for x in arrays])


@pytest.mark.parametrize("dtype", [d for d in DTYPES if kernels.divides(d)], ids=lambda d: d.name)
def test_divide_equals_numpy(harness, dtype):
    """avg's last step: x / p, as ``numpy.divide(x, p)`` does it (complex numbers
    through NumPy's reciprocal, bfloat16 with p rounded to bfloat16 first)."""
    rng = np.random.default_rng(dtype.num)
    for p in (1, 2, 3, 5, 7, 8, 12, 257, 1000):
        x = values(dtype, 2053, rng)
        with np.errstate(all="ignore"):
            want = np.divide(x, p)
        got = x.copy()
        assert harness.cc_divide(name_of(dtype), ptr(got), got.size, p) == 0
        assert same_bits(got, want), f"{dtype} / {p}: {got[:4]} != {want[:4]}"


@pytest.mark.parametrize("dtype", [d for d in DTYPES if kernels.divides(d)], ids=lambda d: d.name)
def test_reduce_n_dividing_is_the_sum_then_numpys_division(harness, dtype):
    """avg's fold that is the call's result (the leader's, into several outputs, one of
    them an input): the left-fold sum, then ``numpy.divide(sum, p)``, bit for bit: what
    the other paths give, which sum and then divide in two steps."""
    rng = np.random.default_rng(dtype.num + 7)
    n = 1031
    for k in (1, 2, 3, 5, 16):
        for p in (k, 3, 7):
            inputs = [values(dtype, n, rng) for _ in range(k)]
            with np.errstate(all="ignore"):
                want = np.divide(functools.reduce(lambda x, y: numpy_reduce("sum", x, y), inputs), p)
            outputs = [np.empty(n, dtype), inputs[0]] if k > 1 else [np.empty(n, dtype)]
            assert harness.cc_reduce_n_divide(name_of(dtype), pointers_to(*outputs), len(outputs),
                                              pointers_to(*inputs), k, n, k + 2, p) == 0
            for j, out in enumerate(outputs):
                assert same_bits(out, want), f"{dtype} k={k} /{p} output {j}: {out[:4]} != {want[:4]}"
    assert harness.cc_reduce_n_divide(b"int32", pointers_to(), 1, pointers_to(), 1, 0, 1, 2.0) == -1
    assert harness.cc_reduce_n_divide(name_of(dtype), pointers_to(), 1, pointers_to(), 17, 0, 1, 2.0) == -3


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_reduce_blocks_folds_each_block_of_the_inputs(harness, dtype):
    """A leader's reduce_scatter in one kernel: output j is the left fold of block j of
    every input (blocks as ``numpy.array_split`` cuts them: some of one element more,
    some empty), summed, or for avg summed and divided, bit for bit."""
    rng = np.random.default_rng(dtype.num + 11)
    n = 1031
    i64s = ctypes.c_longlong * 16
    for k in (1, 2, 3, 16):
        inputs = [values(dtype, n, rng) for _ in range(k)]
        for m in (1, 2, 5, 16):
            bounds = np.linspace(0, n if m < 16 else 12, m + 1).astype(np.int64)  # (16 outputs: blocks of 0 and 1)
            outputs = [np.full(hi - lo, 7, dtype) for lo, hi in zip(bounds[:-1], bounds[1:])]
            for p in ((0, 3) if kernels.divides(dtype) else (0,)):
                with np.errstate(all="ignore"):
                    wants = [functools.reduce(lambda x, y: numpy_reduce("sum", x, y), [x[lo:hi] for x in inputs])
                             for lo, hi in zip(bounds[:-1], bounds[1:])]
                    wants = [np.divide(w, p) if p else w for w in wants]
                assert harness.cc_reduce_blocks(name_of(dtype), pointers_to(*outputs), m, pointers_to(*inputs), k,
                                                i64s(*bounds[:-1]), i64s(*(len(o) for o in outputs)), 5, p) == 0
                for j, (got, want) in enumerate(zip(outputs, wants)):
                    assert same_bits(got, want), f"{dtype} k={k} m={m} /{p} block {j}: {got[:4]} != {want[:4]}"
    if not kernels.divides(dtype):
        assert harness.cc_reduce_blocks(name_of(dtype), pointers_to(), 1, pointers_to(), 1, i64s(), i64s(), 1, 2) == -1
    assert harness.cc_reduce_blocks(name_of(dtype), pointers_to(), 17, pointers_to(), 1, i64s(), i64s(), 1, 0) == -3


@pytest.mark.parametrize("src,dst", kernels.CASTS)
def test_cast_divide_equals_numpy(harness, src, dst):
    """Compression: dst = (src / p) cast, as NumPy's divide then copyto (ml_dtypes for bf16)."""
    src_t, dst_t = (BF16 if s == "bfloat16" else np.dtype(s) for s in (src, dst))
    rng = np.random.default_rng([src_t.num, dst_t.num])
    for p in (1, 3, 8):
        if src_t.itemsize == 2 and p != 1:
            continue  # the widening casts only ever cast
        x = values(src_t, 5003, rng)
        with np.errstate(all="ignore"):
            want = (np.divide(x, p) if p != 1 else x).astype(dst_t)
        got = np.empty(x.size, dst_t)
        assert harness.cc_cast_divide(src.encode(), dst.encode(), ptr(got), ptr(x), x.size, p) == 0
        assert same_bits(got, want), f"{src}->{dst} /{p}: {got[:4]} != {want[:4]}"


# -- rounding, exhaustively where it decides ---------------------------------------------------
def test_every_float16_widens_exactly(harness):
    halves = np.arange(1 << 16, dtype=np.uint16)
    got = np.empty(1 << 16, np.uint32)
    harness.cc_half_to_float(ptr(halves), ptr(got), halves.size)
    assert same_bits(got.view(np.float32), halves.view(np.float16).astype(np.float32))


def _float_midpoints(half_bits):
    """float32 values at, and one ulp either side of, every midpoint between adjacent
    float16 values (where rounding decides), plus each float16 value itself."""
    h = np.arange(1 << 15, dtype=np.uint16)  # positive halves; signs below
    with np.errstate(invalid="ignore"):  # the NaNs among them
        lo = h.view(np.float16).astype(np.float32)
        hi = (h + 1).view(np.float16).astype(np.float32)
        finite = np.isfinite(hi) & np.isfinite(lo)
        mid = ((lo[finite].astype(np.float64) + hi[finite]) / 2).astype(np.float32)
        below, above = np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))
        edges = np.array([65504, 65519.996, 65520, 65536, 1e30, 5.96e-8, 2.98e-8, 2.99e-8], np.float32)
        x = np.concatenate([lo, mid, below, above, edges])
    return np.concatenate([x, -x])


def test_float32_to_float16_rounds_as_numpy(harness):
    rng = np.random.default_rng(16)
    x = np.concatenate([_float_midpoints(None), rng.standard_normal(1 << 18).astype(np.float32) *
                        np.exp2(rng.integers(-30, 20, 1 << 18)).astype(np.float32),
                        np.array([np.nan, -np.nan, np.inf, -np.inf], np.float32)])
    x = np.concatenate([x, np.uint32([0x7f800001, 0xffc00000, 0x7fa00000]).view(np.float32)])  # NaN payloads
    got = np.empty(x.size, np.uint16)
    harness.cc_float_to_half(ptr(x), ptr(got), x.size)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:10]


def test_float64_to_float16_rounds_directly_as_numpy(harness):
    rng = np.random.default_rng(64)
    with np.errstate(invalid="ignore"):
        mids = _float_midpoints(None).astype(np.float64)
    x = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf),
                        rng.standard_normal(1 << 16) * np.exp2(rng.integers(-30, 20, 1 << 16)),
                        [np.nan, np.inf, -np.inf, 1 + 2.0**-11 + 2.0**-40]])
    got = np.empty(x.size, np.uint16)
    harness.cc_double_to_half(ptr(x), ptr(got), x.size)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:10]


def test_float32_to_bfloat16_rounds_as_ml_dtypes(harness):
    rng = np.random.default_rng(8)
    base = rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 1 << 16, 4096).astype(np.uint32) << 16) | 0x8000  # exact midpoints
    x = np.concatenate([base, ties, ties + 1, ties - 1, np.uint32([0x7f800000, 0xff800000, 0x7f7fffff, 0x7fc00001])])
    got = np.empty(x.size, np.uint16)
    harness.cc_float_to_bf16(ptr(x), ptr(got), x.size)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.view(np.float32).astype(BF16).view(np.uint16)
    nan = np.isnan(x.view(np.float32))
    assert np.array_equal(got[~nan], want[~nan])
    assert np.all(np.isnan(got[nan].view(BF16).astype(np.float32)))


# -- pack / unpack of strided views --------------------------------------------------------------
LAYOUTS = [  # (base shape, the view of it)
    ((2, 3, 5, 7), lambda a: a[:, ::2, 1:4, ::-3]),
    ((2, 3, 5, 7), lambda a: a.transpose(3, 1, 0, 2)),
    ((2, 3, 5, 7), lambda a: a[..., 0]),
    ((2, 3, 5, 7), lambda a: a[::-1, :, ::2]),
    ((40,), lambda a: a[::3]),
    ((1,), lambda a: a[::1]),
    ((2, 3, 4), lambda a: a[:, :0]),
]


@pytest.mark.parametrize("dtype", ["int8", "float16", "float32", "float64", "complex128"])
@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
def test_pack_and_unpack_strided_views(harness, dtype, layout):
    shape, view_of = LAYOUTS[layout]
    source = np.arange(int(np.prod(shape))).astype(dtype).reshape(shape)
    view = view_of(source)
    dims, strides = np.zeros(8, np.int64), np.zeros(8, np.int64)
    dims[:view.ndim], strides[:view.ndim] = view.shape, view.strides
    packed = np.full(view.size, -1, dtype)
    assert harness.cc_pack(view.itemsize, ptr(packed), view.ctypes.data, view.size, view.ndim, ptr(dims),
                           ptr(strides)) == 0
    assert np.array_equal(packed, view.reshape(-1))
    target = np.zeros(shape, dtype)
    fresh = (np.arange(view.size) + 1).astype(dtype)
    assert harness.cc_unpack(view.itemsize, view_of(target).ctypes.data, ptr(fresh), view.size, view.ndim,
                             ptr(dims), ptr(strides)) == 0
    assert np.array_equal(view_of(target).reshape(-1), fresh)
    outside = np.ones(shape, bool)
    view_of(outside)[...] = False
    assert not target[outside].any(), "unpack wrote outside the view"


# -- copy_n: a copy phase's copies in one kernel ------------------------------------------------
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("fan", [1, 3])
def test_copy_n_copies_each_source_to_its_destinations_and_nothing_else(harness, itemsize, fan):
    """Copies of different lengths (the vector path's whole vectors and tails) from
    sources 16-byte aligned or not into ``fan`` destinations each, aligned or not, as a
    copy phase gives them (a leader writes one input into several ranks' outputs);
    every byte outside the destinations untouched."""
    rng = np.random.default_rng(itemsize * fan)
    lengths = [0, 1, 7, 64, 1000, 1001, 333]
    shifts = [0, itemsize, 0, 3 * itemsize, 0, 16, itemsize]  # bytes past a 16-byte boundary
    room = [16 * -(-(s + n * itemsize) // 16) + 16 for s, n in zip(shifts, lengths)]
    target = np.zeros(fan * sum(room) + 16, np.uint8)
    first = target.ctypes.data + (-target.ctypes.data % 16)
    starts = first + np.cumsum([0] + [r for r in room for _ in range(fan)][:-1])
    # source q's destinations: q * fan ... q * fan + fan - 1, each shifted alike or not
    dst = [int(at) + ((shifts[i // fan] + 4 * (i % fan)) // 2 // itemsize) * itemsize
           for i, at in enumerate(starts)]
    sources = [rng.integers(0, 256, r + 16, dtype=np.uint8) for r in room]
    src = [a.ctypes.data + (-a.ctypes.data % 16) + s for a, s in zip(sources, shifts)]
    k = len(lengths)
    counts = np.array(lengths, np.int64)
    assert harness.cc_copy_n(itemsize, (ctypes.c_void_p * (k * fan))(*dst), (ctypes.c_void_p * k)(*src),
                             ptr(counts), k, fan) == 0
    expected = np.zeros_like(target)
    for i, d in enumerate(dst):
        n, s = lengths[i // fan], src[i // fan]
        at = d - target.ctypes.data
        expected[at : at + n * itemsize] = np.ctypeslib.as_array((ctypes.c_uint8 * (n * itemsize)).from_address(s))
    assert np.array_equal(target, expected)


# -- the compilers the GPU will use ------------------------------------------------------------------
@pytest.mark.long
def test_every_kernel_compiles_with_nvcc_for_sm80_and_sm90(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed: the kernels are compiled at first use on the GPU machine instead")
    source = tmp_path / "every_kernel.cu"
    source.write_text('#include "collectives.cu"\n' + kernels.explicit_instantiations())
    command = [nvcc, "-std=c++17", "--fmad=false", "-Werror", "all-warnings", f"-I{KERNELS}",
               "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
               "--threads", "2", "-c", str(source), "-o", str(tmp_path / "every_kernel.o")]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "every_kernel.o").stat().st_size > 0


def _nvrtc():
    """libnvrtc through ctypes, from the ``nvidia-cuda-nvrtc`` wheel (the ``test`` extra)
    or a CUDA installation; None if there is none."""
    candidates = []
    try:
        import nvidia
        for root in nvidia.__path__:
            candidates += sorted(Path(root).glob("*/lib/libnvrtc.so*"))
    except ImportError:
        pass
    for root in ("/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu"):
        candidates += sorted(Path(root).glob("libnvrtc.so*"))
    for path in candidates:
        if "builtins" in path.name or "alt" in path.name:
            continue
        try:
            return ctypes.CDLL(str(path))
        except OSError:
            continue
    return None


@pytest.mark.long  # NVRTC takes half a minute a module set on 2 cores
@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_nvrtc_compiles_what_the_cupy_backend_asks_for(arch):
    """The exact text (headers inlined), options and name expressions the CuPy backend
    gives NVRTC at run time, one module per dtype, every lowered name resolved.

    CuPy appends ``-ftz=true`` to every RawModule's options, and NVRTC honours the last
    option, so the kernels are compiled with it here too. Then no float instruction may
    carry ``.ftz`` (which flushes float32 and bfloat16 subnormals to zero, where NumPy
    keeps them: seen on an H100), except ``setp.nan``, whose answer a flush cannot change."""
    lib = _nvrtc()
    if lib is None:
        pytest.skip("libnvrtc is not installed (pip install nvidia-cuda-nvrtc, in the test extra on Linux)")
    char_pp = ctypes.POINTER(ctypes.c_char_p)
    source = kernels.inlined_source().encode()

    def compile_module(dtype):  # NVRTC is thread-safe and ctypes lets go of the GIL: two at a time
        names = kernels.for_dtype(dtype)
        program = ctypes.c_void_p()
        assert lib.nvrtcCreateProgram(ctypes.byref(program), source, b"collectives.cu", 0, None, None) == 0
        for name in names:
            assert lib.nvrtcAddNameExpression(program, name.encode()) == 0
        options = [o.encode() for o in kernels.NVRTC_OPTIONS + (f"-arch={arch}", "-ftz=true")]
        status = lib.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(program, log)
        assert status == 0, f"{dtype.name}: {log.value.decode(errors='replace')}"
        for name in names:
            lowered = ctypes.c_char_p()
            assert lib.nvrtcGetLoweredName(program, name.encode(), char_pp(lowered)) == 0 and lowered.value, name
        lib.nvrtcGetPTXSize(program, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        assert lib.nvrtcGetPTX(program, ptx) == 0
        lib.nvrtcDestroyProgram(ctypes.byref(program))
        flushing = sorted({line.split()[0] for line in ptx.value.decode().splitlines()
                           if ".ftz" in line and not line.split()[0].startswith("setp.nan")})
        assert not flushing, f"{dtype.name}: instructions that flush subnormals: {flushing}"

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(compile_module, DTYPES))
