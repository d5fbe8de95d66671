"""The dtypes the collectives accept, and what kind each is."""

import numpy as np

# Every dtype the collectives accept. bool, object, datetime, structured and
# long double types are refused with a TypeError that lists these.
SUPPORTED_DTYPES = tuple(
    np.dtype(name)
    for name in (
        "int8", "int16", "int32", "int64",
        "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64",
        "complex64", "complex128",
    )
)


def _optional_dtypes():
    try:
        import ml_dtypes
    except ImportError:
        return ()
    return (np.dtype(ml_dtypes.bfloat16),)


# Accepted when ml_dtypes is installed (``pip install ml_dtypes``): bfloat16. The
# library's own algorithms move them as bytes and reduce them with NumPy ufuncs;
# the MPI library has no type for them, so ``native`` is never used for them.
EXTRA_DTYPES = _optional_dtypes()
BFLOAT16 = next((d for d in EXTRA_DTYPES if d.name == "bfloat16"), None)  # None without ml_dtypes


def is_extra(dtype):
    """True for a dtype the MPI library cannot reduce (see ``EXTRA_DTYPES``)."""
    return dtype in EXTRA_DTYPES


def is_integer(dtype):
    return np.dtype(dtype).kind in "iu"


def is_floating(dtype):
    return np.dtype(dtype).kind == "f" or is_extra(dtype)


def is_complex(dtype):
    return np.dtype(dtype).kind == "c"


_SUPPORTED = frozenset(SUPPORTED_DTYPES)  # native byte order only


def check_dtype(dtype, name="x"):
    if dtype in _SUPPORTED or dtype in EXTRA_DTYPES:  # the common case, without building anything
        return
    dtype = np.dtype(dtype)
    if dtype.newbyteorder("=") != dtype:
        raise TypeError(f"{name} has a non-native byte order ({dtype.str}); convert it first")
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES + EXTRA_DTYPES)
        if dtype.name == "bfloat16":
            names += " (bfloat16 needs ml_dtypes: pip install ml_dtypes)"
        raise TypeError(f"{name} has unsupported dtype {dtype.name}; supported: {names}")
