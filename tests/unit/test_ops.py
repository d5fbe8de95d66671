"""The op layer's 16-bit path: where torch is imported, sums and products of float16 and
bfloat16, and compression's casts from and to float32, go through torch's kernels,
which must give NumPy's bits (serial)."""

import numpy as np
import pytest

from collectives import ops

pytestmark = pytest.mark.serial
torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "prod"])
def test_torch_kernels_give_numpy_bits(dtype, op):
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 1 << 16, size=(2, 1 << 16), dtype=np.uint16)  # every class: zeros, subnormals, inf, NaN
    a, b = bits[0].view(dtype), bits[1].view(dtype)
    with np.errstate(all="ignore"):
        want = {"sum": np.add, "prod": np.multiply}[op](a, b)
    got = np.empty_like(a)
    assert ops._combine_16_bit_with_torch(op, a, b, got)  # the torch path was taken
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
    assert np.array_equal(want.view(np.uint16)[~nan], got.view(np.uint16)[~nan])


def test_in_place_strided_and_the_numpy_fallbacks():
    a = np.arange(24, dtype=np.float16).reshape(4, 6)
    b = np.ones((4, 6), np.float16)
    want = a[:, ::2] + b[:, ::2]
    assert ops._combine_16_bit_with_torch("sum", a[:, ::2], b[:, ::2], a[:, ::2])  # in place, strided: torch
    assert np.array_equal(a[:, ::2], want)
    read_only = np.full(6, 2, np.float16)
    read_only.flags.writeable = False
    assert not ops._combine_16_bit_with_torch("prod", read_only, b[0], b[0].copy())  # torch would warn: NumPy
    out = np.empty(6, np.float16)
    ops.combine("prod", read_only, b[0][::-1], out)  # read-only, negative strides: NumPy
    assert np.array_equal(out, np.full(6, 2, np.float16))
    ops.combine("max", a[0], b[0], out)  # max and min stay NumPy's
    assert np.array_equal(out, np.maximum(a[0], b[0]))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_torch_casts_give_numpy_bits(dtype):
    """float32 -> 16 bits on random float32 bit patterns (every class, ties included by
    the patterns' low bits), and 16 bits -> float32 on every 16-bit pattern."""
    rng = np.random.default_rng(11)
    wide = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint32).view(np.float32)
    wide[:4] = [0.0, -0.0, np.inf, -np.inf]
    with np.errstate(all="ignore"):
        want = wide.astype(dtype)
    got = np.empty(wide.size, dtype)
    assert ops._cast_with_torch(got, wide)
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
    assert np.array_equal(want.view(np.uint16)[~nan], got.view(np.uint16)[~nan])
    narrow = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)
    back = np.empty(narrow.size, np.float32)
    assert ops._cast_with_torch(back, narrow)
    want_back = narrow.astype(np.float32)
    nan = np.isnan(want_back)
    assert np.array_equal(np.isnan(back), nan) and np.array_equal(want_back.view(np.uint32)[~nan],
                                                                  back.view(np.uint32)[~nan])


def test_casts_fall_back_to_numpy_where_torch_cannot():
    x = np.linspace(-3, 3, 12)  # float64: NumPy's direct rounding
    out = np.empty(12, np.float16)
    assert not ops._cast_with_torch(out, x)
    ops.cast(out, x)
    assert np.array_equal(out, x.astype(np.float16))
    read_only = np.ones(6, np.float32)
    read_only.flags.writeable = False
    assert not ops._cast_with_torch(np.empty(6, np.float16), read_only)
    strided = np.empty(12, np.float16)[::-2]
    ops.cast(strided, np.arange(6, dtype=np.float32))
    assert np.array_equal(strided, np.arange(6, dtype=np.float16))
