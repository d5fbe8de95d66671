"""The op layer's 16-bit path: where torch is imported, sums and products of float16 and
bfloat16 go through torch's kernels, which must give NumPy's bits (serial)."""

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
