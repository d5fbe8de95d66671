"""The op layer: every reduction the library performs goes through here.

On the CPU an op is a NumPy ufunc called with ``out=`` on whole slices, so no Python
loop ever touches elements. ``avg`` is a sum followed by one division by the world
size, applied by the owner of each result element (so every rank gets the same bits).
"""

import sys

import numpy as np

from .dtypes import EXTRA_DTYPES, is_complex, is_floating, is_integer

_UFUNCS = {
    "sum": np.add,
    "prod": np.multiply,
    "max": np.maximum,
    "min": np.minimum,
    "avg": np.add,  # the division by the world size happens once, at the end
    "band": np.bitwise_and,
    "bor": np.bitwise_or,
    "bxor": np.bitwise_xor,
}

OPS = tuple(_UFUNCS)
BITWISE = ("band", "bor", "bxor")  # integer dtypes only


def check_op(op, dtype):
    """Raise if ``op`` is unknown or undefined for ``dtype``; return the op name."""
    if not isinstance(op, str) or op not in _UFUNCS:
        raise ValueError(f"op must be one of {', '.join(OPS)}; got {op!r}")
    if op == "avg" and not _defined(op, dtype):
        raise TypeError(
            f"op 'avg' needs a floating or complex dtype; got {np.dtype(dtype).name} "
            "(use op='sum' and divide, or cast to a float dtype)"
        )
    if op in BITWISE and not _defined(op, dtype):
        raise TypeError(f"op {op!r} needs an integer dtype; got {np.dtype(dtype).name}")
    if not _defined(op, dtype):  # max, min
        raise TypeError(f"op {op!r} is not defined for complex dtype {np.dtype(dtype).name}")
    return op


def ops_for(dtype):
    """The ops defined for ``dtype``, in ``OPS`` order."""
    return tuple(op for op in OPS if _defined(op, dtype))


def _defined(op, dtype):
    if op == "avg":
        return not is_integer(dtype)
    if op in BITWISE:
        return is_integer(dtype)
    return not (op in ("max", "min") and is_complex(dtype))


def combine(op, a, b, out):
    """``out = a op b`` elementwise; ``out`` may alias ``a`` or ``b``."""
    if op in _TORCH_OPS and out.dtype in _SIXTEEN_BIT:
        if _combine_16_bit_with_torch(op, a, b, out):
            return
    _UFUNCS[op](a, b, out=out)


# NumPy's float16 loops (and ml_dtypes' bfloat16 ones) widen and round one element at a
# time: 25x (bfloat16: 8x) slower than torch's vectorised kernels on this machine, which
# give the same bits: each element widened to float32, added or multiplied, rounded once
# to nearest-even (checked against NumPy on a million random bit patterns, infinities
# and zeros of both signs included; a NaN stays a NaN, its payload may differ). So where
# the program has imported torch (the torch adapter and backend, whose fp16 compression
# reduces float16), sums and products of these dtypes go through torch.
_TORCH_OPS = {"sum": "add", "avg": "add", "prod": "mul"}
# float16 and bfloat16 (where ml_dtypes is installed): a set, since comparing a dtype with
# np.float16 or reading its name costs a microsecond, which a small call feels.
_SIXTEEN_BIT = frozenset((np.dtype(np.float16),) + tuple(d for d in EXTRA_DTYPES if d.name == "bfloat16"))


def _torch_views(*arrays):
    """Torch tensors on the very memory of ``arrays`` (float32, float16 or bfloat16; the
    16-bit ones through an int16 view), or None where torch is not imported or cannot
    view one of them without copying (read-only, negative strides)."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "from_numpy"):
        return None
    if any(not x.flags.writeable or min(x.strides, default=0) < 0 for x in arrays):
        return None
    try:
        return [torch.from_numpy(x) if x.dtype == np.float32 else
                torch.from_numpy(x.view(np.int16)).view(torch.float16 if x.dtype == np.float16 else torch.bfloat16)
                for x in arrays]
    except (RuntimeError, TypeError, ValueError):  # e.g. a torch built without NumPy support
        return None


def _combine_16_bit_with_torch(op, a, b, out):
    """``out = a op b`` through torch if it is imported and can view all three arrays
    without copying; returns whether it did."""
    if any(x.dtype != out.dtype or x.shape != out.shape for x in (a, b)):
        return False
    views = _torch_views(a, b, out)
    if views is None:
        return False
    ta, tb, tout = views
    getattr(sys.modules["torch"], _TORCH_OPS[op])(ta, tb, out=tout)  # with torch's intra-op threads, as set
    return True


def cast(dst, src):
    """``dst[...] = src`` converted to ``dst``'s dtype (compression's casts between float32
    and float16/bfloat16, and back). Through torch where it is imported and both arrays
    are float32 and a 16-bit float viewable without a copy: NumPy converts float16 one
    element at a time (18 ms for 5 M elements here, torch 1.6 ms) with the same bits,
    round to nearest even (a NaN stays a NaN; its payload may differ). float64 goes
    through NumPy, which rounds it to float16 directly, as torch may not."""
    if not _cast_with_torch(dst, src):
        np.copyto(dst, src, casting="same_kind")


def _cast_with_torch(dst, src):
    names = {dst.dtype.name, src.dtype.name}
    if dst.shape != src.shape or names not in ({"float32", "float16"}, {"float32", "bfloat16"}):
        return False
    views = _torch_views(dst, src)
    if views is None:
        return False
    views[0].copy_(views[1])
    return True


def finish(op, result, size):
    """Apply the final step of ``op`` in place (the division of ``avg``)."""
    if op == "avg" and size > 1 and result.size:
        assert is_floating(result.dtype) or is_complex(result.dtype)
        np.divide(result, size, out=result)
