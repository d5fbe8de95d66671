"""What the CUDA kernels in ``kernels/`` are called, for every dtype and op.

The sources ship inside the package as ``collectives.kernels``. This module is the one
place that names their template instantiations: the CuPy backend asks NVRTC for these
(``cupy.RawModule(name_expressions=...)``) and the tests compile the same list with
nvcc. It imports nothing but NumPy.

One module is compiled per dtype (every kernel that dtype needs, so a first call costs
one NVRTC compile of a few kernels, not of all of them), cached per device and hash of
the sources.
"""

import hashlib
from functools import lru_cache
from importlib import resources

import numpy as np

NAMESPACE = "collectives"
SOURCE = "collectives.cu"
HEADERS = ("elementwise.cuh",)

# NumPy dtype name -> the C++ element type of elementwise.cuh.
CXX_TYPES = {
    "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64",
    "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64",
    "float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64",
    "complex64": "c64", "complex128": "c128",
}
OP_TAGS = {"sum": "Sum", "prod": "Prod", "max": "Max", "min": "Min", "avg": "Sum",  # avg: sum, then divide_by
           "band": "BAnd", "bor": "BOr", "bxor": "BXor"}
ELEMENTS = {1: "b1", 2: "b2", 4: "b4", 8: "b8", 16: "b16"}  # pack/unpack move opaque elements
CASTS = (("float32", "float16"), ("float32", "bfloat16"), ("float64", "float16"), ("float64", "bfloat16"),
         ("float16", "float32"), ("bfloat16", "float32"), ("float16", "float64"), ("bfloat16", "float64"))
MAX_INPUTS = 16  # reduce_n takes up to this many inputs in one pass, copy_n writes this many destinations
FENCE = f"{NAMESPACE}::fence"  # the fence of ranks on distinct GPUs (in every dtype's module: it has no dtype)
MAX_DIMS = 8  # pack/unpack: dimensions of a strided view

# Compile options: C++17; no FMA contraction anywhere (the element ops also use the
# _rn intrinsics, so the arithmetic equals the host's, which the tests check).
NVRTC_OPTIONS = ("-std=c++17", "--fmad=false")


def _q(name):
    return f"{NAMESPACE}::{name}"


def ops_for(dtype):
    """The ops with a reduction kernel for ``dtype`` (complex numbers have no max/min;
    only integers have the bitwise ops)."""
    name = np.dtype(dtype).name
    if name.startswith("complex"):
        return ("sum", "prod")
    if name.startswith(("int", "uint")):
        return ("sum", "prod", "max", "min", "band", "bor", "bxor")
    return ("sum", "prod", "max", "min")


def reduce2(dtype, op):
    t = CXX_TYPES[np.dtype(dtype).name]
    return f"{_q('reduce2')}<{_q(t)}, {_q(OP_TAGS[op])}>"


def _fold(kernel, dtype, op, divide):
    t = CXX_TYPES[np.dtype(dtype).name]
    return f"{_q(kernel)}<{_q(t)}, {_q(OP_TAGS[op])}, {_q('Divide' if divide else 'Keep')}>"


def reduce_n(dtype, op, divide=False):
    """The fold of up to 16 inputs into up to 16 outputs; ``divide``: avg's fold that is
    the call's result, divided by the world size before it is written (floating and
    complex dtypes, op sum or avg: :func:`check_divisor`)."""
    return _fold("reduce_n", dtype, op, divide)


def reduce_blocks(dtype, op, divide=False):
    """Up to 16 folds of the same inputs, each over a block of its own (a leader's
    reduce_scatter); ``divide`` as for :func:`reduce_n`."""
    return _fold("reduce_blocks", dtype, op, divide)


def check_divisor(kernel, op, dtype, divisor):
    """Raise unless a ``divisor`` (None: none) is one the fold kernels take: avg's, of a
    sum of a floating or complex dtype (every backend's ``reduce_n`` and ``reduce_blocks``
    check it alike)."""
    if divisor is not None and (op not in ("sum", "avg") or not divides(dtype)):
        raise ValueError(f"{kernel} divides the fold of op 'avg' on floating or complex dtypes only; got {op!r} "
                         f"on {np.dtype(dtype).name}")


def divide_by(dtype):
    return f"{_q('divide_by')}<{_q(CXX_TYPES[np.dtype(dtype).name])}>"


def cast_divide(src, dst):
    return f"{_q('cast_divide')}<{_q(CXX_TYPES[np.dtype(src).name])}, {_q(CXX_TYPES[np.dtype(dst).name])}>"


def pack(itemsize):
    return f"{_q('pack')}<{_q(ELEMENTS[itemsize])}>"


def unpack(itemsize):
    return f"{_q('unpack')}<{_q(ELEMENTS[itemsize])}>"


def copy_n(itemsize):
    return f"{_q('copy_n')}<{_q(ELEMENTS[itemsize])}>"


def divides(dtype):
    """Whether ``dtype`` has a ``divide_by`` kernel (avg: floating and complex)."""
    return np.dtype(dtype).name in ("float16", "bfloat16", "float32", "float64", "complex64", "complex128")


def for_dtype(dtype):
    """Every instantiation a call on ``dtype`` may launch: one NVRTC module."""
    dtype = np.dtype(dtype)
    names = [reduce2(dtype, op) for op in ops_for(dtype)] + [reduce_n(dtype, op) for op in ops_for(dtype)]
    names += [reduce_blocks(dtype, op) for op in ops_for(dtype)]
    if divides(dtype):
        names += [divide_by(dtype), reduce_n(dtype, "avg", divide=True), reduce_blocks(dtype, "avg", divide=True)]
    names += [pack(dtype.itemsize), unpack(dtype.itemsize), copy_n(dtype.itemsize)]
    names += [cast_divide(_dtype(s), _dtype(d)) for s, d in CASTS if s == dtype.name]  # compression from dtype
    names.append(FENCE)
    return tuple(names)


def everything():
    """Every instantiation of every kernel (the nvcc compile test builds them all)."""
    names = []
    for name in CXX_TYPES:
        for n in for_dtype(_dtype(name)):
            if n not in names:
                names.append(n)
    return tuple(names)


def _dtype(name):
    if name == "bfloat16":
        return BFLOAT16
    return np.dtype(name)


class _BFloat16Name:
    """Stands for bfloat16 where ml_dtypes is not installed: only its name is needed."""

    name = "bfloat16"
    itemsize = 2


def _bfloat16():
    try:
        import ml_dtypes
    except ImportError:
        return _BFloat16Name()
    return np.dtype(ml_dtypes.bfloat16)


BFLOAT16 = _bfloat16()


def explicit_instantiations():
    """C++ that instantiates every kernel: nvcc compiles no template that is not used,
    and taking each one's address uses it."""
    entries = "".join(f"    (const void*)&{name},\n" for name in everything())
    return f"extern const void* const collectives_every_kernel[] = {{\n{entries}}};\n"


@lru_cache(maxsize=None)
def sources():
    """``{file name: text}`` of the kernel sources, as installed."""
    folder = resources.files("collectives.kernels")
    return {name: (folder / name).read_text(encoding="utf-8") for name in (SOURCE,) + HEADERS}


@lru_cache(maxsize=None)
def source_hash():
    """A hash of the kernel sources (the compile cache's key, with the device)."""
    digest = hashlib.sha256()
    for name, text in sorted(sources().items()):
        digest.update(name.encode() + b"\0" + text.encode())
    return digest.hexdigest()[:16]


def inlined_source():
    """``collectives.cu`` with its ``#include "..."`` of our headers replaced by their
    text: NVRTC then needs no include path at all."""
    texts = sources()
    out = []
    for line in texts[SOURCE].splitlines():
        stripped = line.strip()
        if stripped.startswith("#include"):
            target = stripped.split('"')[1] if '"' in stripped else None
            if target in texts:
                out.append(texts[target])
                continue
        out.append(line)
    return "\n".join(out) + "\n"


# -- launch geometry ------------------------------------------------------------------------
THREADS = 256


def blocks(work_items, multiprocessors=132):
    """Blocks for a grid-stride loop over ``work_items``: enough to fill the device
    (8 blocks of 256 threads per multiprocessor), never more than there is work."""
    return max(1, min((int(work_items) + THREADS - 1) // THREADS, 8 * int(multiprocessors)))


def vector_items(count, itemsize):
    """The loop's work items for ``count`` elements: 16-byte vectors where they fit."""
    lanes = 16 // itemsize if itemsize < 16 else 1
    return max(count // lanes, count % lanes, 1)
