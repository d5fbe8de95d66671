// Element operations of the GPU kernels: one definition, compiled for the device
// (NVRTC through CuPy, or nvcc) and for the host (g++, by the test harness
// host_harness.cpp), so that the kernels' arithmetic is checked against NumPy in
// `make test` on a machine without a GPU.
//
// Everything here is a __host__ __device__ function. Nothing is #included: NVRTC
// then needs no include path, and the host build needs no CUDA headers. The 16-bit
// floats are storage structs whose arithmetic is done in float, as NumPy (float16)
// and ml_dtypes (bfloat16) do it, then rounded to nearest even; since float has
// more than twice their precision plus two bits, that equals the correctly rounded
// 16-bit operation. On the device the f32 <-> f16/bf16 conversions are single PTX
// instructions (same rounding; only NaN payloads may differ); on the host they are
// the software conversions below, which follow NumPy and ml_dtypes bit for bit.
//
// Semantics follow NumPy on x86-64 (the reference the tests compare with):
//   sum, prod   integers wrap around (two's complement); floats in their own precision
//   max, min    a NaN operand is returned; for equal operands (+0 and -0) float32,
//               float64 and bfloat16 return b, float16 returns a (as NumPy's loops do)
//   band, bor, bxor   integers only, on the two's-complement bits
//   complex     prod = (ar*br - ai*bi, ar*bi + ai*br), never contracted into an FMA
//   divide      x / d in x's precision; complex by (d + 0j) as NumPy does it:
//               multiply by scl = 1/d after adding the zero terms
//   subnormals  kept, as on the CPU. CuPy compiles every RawModule with -ftz=true
//               appended after the caller's options, and NVRTC honours the last one, so
//               any float instruction the compiler emits would flush float32 (and
//               bfloat16-as-float) subnormals to zero. Every float32 operation below is
//               therefore a PTX instruction written without .ftz (the f32 helpers);
//               test_kernels.py compiles with -ftz=true and checks the PTX has no .ftz.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define COLLECTIVES_ON_GPU_COMPILER 1
#else
// A host compiler: the CUDA qualifiers mean nothing here.
#define __host__
#define __device__
#define __global__
#endif

#define COLLECTIVES_HD __host__ __device__ inline

namespace collectives {

typedef signed char i8;
typedef short i16;
typedef int i32;
typedef long long i64;
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef float f32;
typedef double f64;

struct f16 { u16 bits; };   // IEEE binary16 (NumPy float16)
struct bf16 { u16 bits; };  // bfloat16 (ml_dtypes; torch.bfloat16)
struct alignas(8) c64 { float re, im; };
struct alignas(16) c128 { double re, im; };

// Opaque elements of each size, for the byte-moving kernels (pack, unpack).
struct b1 { u8 v; };
struct b2 { u16 v; };
struct b4 { u32 v; };
struct alignas(8) b8 { u64 v; };
struct alignas(8) b16 { u64 lo, hi; };

// 16 bytes, loaded and stored in one instruction where the address is aligned.
struct alignas(16) Vec16 { u32 w[4]; };

// -- bit casts -----------------------------------------------------------------------
COLLECTIVES_HD u32 float_bits(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    union { float f; u32 u; } v;
    v.f = f;
    return v.u;
#endif
}

COLLECTIVES_HD float bits_float(u32 u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    union { float f; u32 u; } v;
    v.u = u;
    return v.f;
#endif
}

COLLECTIVES_HD u64 double_bits(double d) {
#ifdef __CUDA_ARCH__
    return (u64)__double_as_longlong(d);
#else
    union { double d; u64 u; } v;
    v.d = d;
    return v.u;
#endif
}

// -- IEEE arithmetic that is never contracted into an FMA ------------------------------
// float32 on the device: explicit PTX without .ftz (see "subnormals" above).
#ifdef __CUDA_ARCH__
#define COLLECTIVES_F32_BINARY(name, instruction)                                       \
    COLLECTIVES_HD float name(float a, float b) {                                       \
        float r;                                                                        \
        asm(instruction " %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));                     \
        return r;                                                                       \
    }
#define COLLECTIVES_F32_COMPARE(name, instruction)                                      \
    COLLECTIVES_HD bool name(float a, float b) {                                        \
        u32 r;                                                                          \
        asm("{ .reg .pred p; " instruction " p, %1, %2; selp.u32 %0, 1, 0, p; }"        \
            : "=r"(r) : "f"(a), "f"(b));                                                \
        return r != 0;                                                                  \
    }
#else
#define COLLECTIVES_F32_BINARY(name, instruction)                                       \
    COLLECTIVES_HD float name(float a, float b) { return a COLLECTIVES_OP_##name b; }
#define COLLECTIVES_F32_COMPARE(name, instruction)                                      \
    COLLECTIVES_HD bool name(float a, float b) { return a COLLECTIVES_OP_##name b; }
#endif
#define COLLECTIVES_OP_mul_rn *
#define COLLECTIVES_OP_add_rn +
#define COLLECTIVES_OP_sub_rn -
#define COLLECTIVES_OP_div_rn /
#define COLLECTIVES_OP_gt >
#define COLLECTIVES_OP_lt <
#define COLLECTIVES_OP_ge >=
#define COLLECTIVES_OP_le <=
COLLECTIVES_F32_BINARY(mul_rn, "mul.rn.f32")
COLLECTIVES_F32_BINARY(add_rn, "add.rn.f32")
COLLECTIVES_F32_BINARY(sub_rn, "sub.rn.f32")  // not add of -b: neg.f32 has an .ftz form too
COLLECTIVES_F32_BINARY(div_rn, "div.rn.f32")
COLLECTIVES_F32_COMPARE(gt, "setp.gt.f32")
COLLECTIVES_F32_COMPARE(lt, "setp.lt.f32")
COLLECTIVES_F32_COMPARE(ge, "setp.ge.f32")
COLLECTIVES_F32_COMPARE(le, "setp.le.f32")
#undef COLLECTIVES_F32_BINARY
#undef COLLECTIVES_F32_COMPARE

// float32 <-> float64 without a flush (cvt.f64.f32 and cvt.rn.f32.f64, no .ftz).
COLLECTIVES_HD double widen(float f) {
#ifdef __CUDA_ARCH__
    double d;
    asm("cvt.f64.f32 %0, %1;" : "=d"(d) : "f"(f));
    return d;
#else
    return (double)f;
#endif
}
COLLECTIVES_HD float narrow(double d) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(f) : "d"(d));
    return f;
#else
    return (float)d;
#endif
}

// float64 has no flush: plain operators would do, the intrinsics keep FMA contraction out.
COLLECTIVES_HD bool gt(double a, double b) { return a > b; }
COLLECTIVES_HD bool lt(double a, double b) { return a < b; }
COLLECTIVES_HD double mul_rn(double a, double b) {
#ifdef __CUDA_ARCH__
    return __dmul_rn(a, b);
#else
    return a * b;
#endif
}
COLLECTIVES_HD double add_rn(double a, double b) {
#ifdef __CUDA_ARCH__
    return __dadd_rn(a, b);
#else
    return a + b;
#endif
}
COLLECTIVES_HD double sub_rn(double a, double b) { return add_rn(a, -b); }

// -- float16 -------------------------------------------------------------------------
// Software conversions, as NumPy's npy_halfbits_to_floatbits / npy_floatbits_to_halfbits
// / npy_doublebits_to_halfbits: round to nearest even, overflow to infinity, NaN
// payloads kept (a NaN never becomes an infinity).
COLLECTIVES_HD u32 half_to_float_bits(u16 h) {
    u32 sign = (u32)(h & 0x8000u) << 16;
    u32 exponent = (h >> 10) & 0x1fu;
    u32 mantissa = h & 0x3ffu;
    if (exponent == 0x1fu) return sign | 0x7f800000u | (mantissa << 13);  // inf, NaN
    if (exponent != 0) return sign | ((exponent + 112u) << 23) | (mantissa << 13);
    if (mantissa == 0) return sign;  // +-0
    u32 shift = 0;  // a subnormal: normalise
    while (!(mantissa & 0x400u)) {
        mantissa <<= 1;
        ++shift;
    }
    return sign | ((113u - shift) << 23) | ((mantissa & 0x3ffu) << 13);
}

COLLECTIVES_HD u16 float_bits_to_half(u32 f) {
    u16 sign = (u16)((f >> 16) & 0x8000u);
    u32 magnitude = f & 0x7fffffffu;
    if (magnitude >= 0x7f800000u) {  // inf or NaN
        if (magnitude == 0x7f800000u) return sign | 0x7c00u;
        u16 nan = (u16)(0x7c00u + ((magnitude & 0x007fffffu) >> 13));
        return sign | (nan == 0x7c00u ? (u16)0x7c01u : nan);
    }
    if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520: rounds to infinity
    if (magnitude < 0x38800000u) {  // below 2^-14: a subnormal half or zero
        if (magnitude <= 0x33000000u) return sign;  // <= 2^-25 (a tie with 0 goes to 0)
        u32 exponent = magnitude >> 23;
        u32 mantissa = (magnitude & 0x7fffffu) | 0x800000u;
        u32 shift = 126u - exponent;  // 14 .. 24
        u32 h = mantissa >> shift;
        u32 rest = mantissa & ((1u << shift) - 1u);
        u32 halfway = 1u << (shift - 1u);
        if (rest > halfway || (rest == halfway && (h & 1u))) ++h;
        return sign | (u16)h;
    }
    u32 h = (magnitude - 0x38000000u) >> 13;  // rebias the exponent (127 - 15 = 112)
    u32 rest = magnitude & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry may reach the exponent
    return sign | (u16)h;
}

COLLECTIVES_HD u16 double_bits_to_half(u64 d) {
    u16 sign = (u16)((d >> 48) & 0x8000u);
    u64 magnitude = d & 0x7fffffffffffffffull;
    if (magnitude >= 0x7ff0000000000000ull) {
        if (magnitude == 0x7ff0000000000000ull) return sign | 0x7c00u;
        u16 nan = (u16)(0x7c00u + ((magnitude & 0x000fffffffffffffull) >> 42));
        return sign | (nan == 0x7c00u ? (u16)0x7c01u : nan);
    }
    if (magnitude >= 0x40effe0000000000ull) return sign | 0x7c00u;  // >= 65520
    if (magnitude < 0x3f10000000000000ull) {  // below 2^-14
        if (magnitude <= 0x3e60000000000000ull) return sign;  // <= 2^-25
        u64 exponent = magnitude >> 52;
        u64 mantissa = (magnitude & 0xfffffffffffffull) | 0x10000000000000ull;
        u64 shift = 1051ull - exponent;  // 43 .. 53
        u64 h = mantissa >> shift;
        u64 rest = mantissa & ((1ull << shift) - 1ull);
        u64 halfway = 1ull << (shift - 1ull);
        if (rest > halfway || (rest == halfway && (h & 1ull))) ++h;
        return sign | (u16)h;
    }
    u64 h = (magnitude - 0x3f00000000000000ull) >> 42;  // 1023 - 15 = 1008 = 0x3f0
    u64 rest = magnitude & 0x3ffffffffffull;
    if (rest > 0x20000000000ull || (rest == 0x20000000000ull && (h & 1ull))) ++h;
    return sign | (u16)h;
}

COLLECTIVES_HD float to_float(f16 h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
    return f;
#else
    return bits_float(half_to_float_bits(h.bits));
#endif
}

COLLECTIVES_HD f16 make_f16(float f) {
    f16 h;
#ifdef __CUDA_ARCH__
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
#else
    h.bits = float_bits_to_half(float_bits(f));
#endif
    return h;
}

COLLECTIVES_HD f16 make_f16(double d) {
    f16 h;
    h.bits = double_bits_to_half(double_bits(d));  // direct rounding, as NumPy (no detour via float)
    return h;
}

// -- bfloat16 ------------------------------------------------------------------------
// As ml_dtypes (Eigen): round to nearest even; a NaN becomes the quiet NaN 0x7fc0
// with its sign; a double goes through float first.
COLLECTIVES_HD u16 float_bits_to_bf16(u32 f) {
    if ((f & 0x7fffffffu) > 0x7f800000u) return (f & 0x80000000u) ? (u16)0xffc0u : (u16)0x7fc0u;
    return (u16)((f + 0x7fffu + ((f >> 16) & 1u)) >> 16);
}

COLLECTIVES_HD float to_float(bf16 b) { return bits_float((u32)b.bits << 16); }

COLLECTIVES_HD bf16 make_bf16(float f) {
    bf16 b;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.bits) : "f"(f));
#else
    b.bits = float_bits_to_bf16(float_bits(f));
#endif
    return b;
}

COLLECTIVES_HD bf16 make_bf16(double d) { return make_bf16(narrow(d)); }


// -- the reduction ops -------------------------------------------------------------------
// Integers are computed in the unsigned type of their width: wrap-around without the
// undefined behaviour of signed overflow (and u16 * u16 does not overflow an int).
#define COLLECTIVES_INTEGER_OPS(T, U)                                                   \
    COLLECTIVES_HD T op_sum(T a, T b) { return (T)(U)((U)a + (U)b); }                    \
    COLLECTIVES_HD T op_prod(T a, T b) { return (T)(U)((U)a * (U)b); }                   \
    COLLECTIVES_HD T op_max(T a, T b) { return a >= b ? a : b; }                         \
    COLLECTIVES_HD T op_min(T a, T b) { return a <= b ? a : b; }                         \
    COLLECTIVES_HD T op_band(T a, T b) { return (T)(a & b); }                            \
    COLLECTIVES_HD T op_bor(T a, T b) { return (T)(a | b); }                             \
    COLLECTIVES_HD T op_bxor(T a, T b) { return (T)(a ^ b); }

COLLECTIVES_INTEGER_OPS(i8, u32)
COLLECTIVES_INTEGER_OPS(u8, u32)
COLLECTIVES_INTEGER_OPS(i16, u32)
COLLECTIVES_INTEGER_OPS(u16, u32)
COLLECTIVES_INTEGER_OPS(i32, u32)
COLLECTIVES_INTEGER_OPS(u32, u32)
COLLECTIVES_INTEGER_OPS(i64, u64)
COLLECTIVES_INTEGER_OPS(u64, u64)
#undef COLLECTIVES_INTEGER_OPS

#define COLLECTIVES_FLOAT_OPS(T)                                                        \
    COLLECTIVES_HD T op_sum(T a, T b) { return add_rn(a, b); }                          \
    COLLECTIVES_HD T op_prod(T a, T b) { return mul_rn(a, b); }                         \
    COLLECTIVES_HD T op_max(T a, T b) { return (gt(a, b) || a != a) ? a : b; }          \
    COLLECTIVES_HD T op_min(T a, T b) { return (lt(a, b) || a != a) ? a : b; }

COLLECTIVES_FLOAT_OPS(f32)
COLLECTIVES_FLOAT_OPS(f64)
#undef COLLECTIVES_FLOAT_OPS

COLLECTIVES_HD f16 op_sum(f16 a, f16 b) { return make_f16(add_rn(to_float(a), to_float(b))); }
COLLECTIVES_HD f16 op_prod(f16 a, f16 b) { return make_f16(mul_rn(to_float(a), to_float(b))); }
COLLECTIVES_HD f16 op_max(f16 a, f16 b) {
    float x = to_float(a), y = to_float(b);
    return (ge(x, y) || x != x) ? a : b;
}
COLLECTIVES_HD f16 op_min(f16 a, f16 b) {
    float x = to_float(a), y = to_float(b);
    return (le(x, y) || x != x) ? a : b;
}

// bfloat16 has float32's exponent range, so its subnormals are float32 subnormals.
COLLECTIVES_HD bf16 op_sum(bf16 a, bf16 b) { return make_bf16(add_rn(to_float(a), to_float(b))); }
COLLECTIVES_HD bf16 op_prod(bf16 a, bf16 b) { return make_bf16(mul_rn(to_float(a), to_float(b))); }
COLLECTIVES_HD bf16 op_max(bf16 a, bf16 b) {
    float x = to_float(a), y = to_float(b);
    return (gt(x, y) || x != x) ? a : b;
}
COLLECTIVES_HD bf16 op_min(bf16 a, bf16 b) {
    float x = to_float(a), y = to_float(b);
    return (lt(x, y) || x != x) ? a : b;
}

#define COLLECTIVES_COMPLEX_OPS(C)                                                       \
    COLLECTIVES_HD C op_sum(C a, C b) {                                                  \
        C r;                                                                             \
        r.re = add_rn(a.re, b.re);                                                       \
        r.im = add_rn(a.im, b.im);                                                       \
        return r;                                                                        \
    }                                                                                    \
    COLLECTIVES_HD C op_prod(C a, C b) {                                                 \
        C r;                                                                             \
        r.re = sub_rn(mul_rn(a.re, b.re), mul_rn(a.im, b.im));                           \
        r.im = add_rn(mul_rn(a.re, b.im), mul_rn(a.im, b.re));                           \
        return r;                                                                        \
    }

COLLECTIVES_COMPLEX_OPS(c64)
COLLECTIVES_COMPLEX_OPS(c128)
#undef COLLECTIVES_COMPLEX_OPS

// The op tags the kernels are instantiated with (complex max/min do not exist; the
// bitwise ops exist for integers only).
struct Sum { template <class T> static COLLECTIVES_HD T apply(T a, T b) { return op_sum(a, b); } };
struct Prod { template <class T> static COLLECTIVES_HD T apply(T a, T b) { return op_prod(a, b); } };
struct Max { template <class T> static COLLECTIVES_HD T apply(T a, T b) { return op_max(a, b); } };
struct Min { template <class T> static COLLECTIVES_HD T apply(T a, T b) { return op_min(a, b); } };
struct BAnd { template <class T> static COLLECTIVES_HD T apply(T a, T b) { return op_band(a, b); } };
struct BOr { template <class T> static COLLECTIVES_HD T apply(T a, T b) { return op_bor(a, b); } };
struct BXor { template <class T> static COLLECTIVES_HD T apply(T a, T b) { return op_bxor(a, b); } };

// -- divide (avg's last step, and the 1/p of compression) ---------------------------------
// x / d with d the world size, converted to x's type first (NumPy's weak Python int).
COLLECTIVES_HD f32 divide(f32 x, double d) { return div_rn(x, narrow(d)); }
COLLECTIVES_HD f64 divide(f64 x, double d) { return x / d; }
COLLECTIVES_HD f16 divide(f16 x, double d) { return make_f16(div_rn(to_float(x), to_float(make_f16(d)))); }
COLLECTIVES_HD bf16 divide(bf16 x, double d) { return make_bf16(div_rn(to_float(x), to_float(make_bf16(d)))); }
COLLECTIVES_HD c64 divide(c64 x, double d) {
    // NumPy: (xr + xi*rat)*scl, (xi - xr*rat)*scl with rat = 0/d, scl = 1/(d + 0*rat).
    float dr = narrow(d), rat = div_rn(0.0f, dr), scl = div_rn(1.0f, add_rn(dr, mul_rn(0.0f, rat)));
    c64 r;
    r.re = mul_rn(add_rn(x.re, mul_rn(x.im, rat)), scl);
    r.im = mul_rn(sub_rn(x.im, mul_rn(x.re, rat)), scl);
    return r;
}
COLLECTIVES_HD c128 divide(c128 x, double d) {
    double rat = 0.0 / d, scl = 1.0 / add_rn(d, mul_rn(0.0, rat));
    c128 r;
    r.re = mul_rn(add_rn(x.re, mul_rn(x.im, rat)), scl);
    r.im = mul_rn(sub_rn(x.im, mul_rn(x.re, rat)), scl);
    return r;
}

// -- casts between float widths (compression) ---------------------------------------------
template <class D> struct Cast;
template <> struct Cast<f16> {
    static COLLECTIVES_HD f16 from(f32 x) { return make_f16(x); }
    static COLLECTIVES_HD f16 from(f64 x) { return make_f16(x); }
};
template <> struct Cast<bf16> {
    static COLLECTIVES_HD bf16 from(f32 x) { return make_bf16(x); }
    static COLLECTIVES_HD bf16 from(f64 x) { return make_bf16(x); }
};
template <> struct Cast<f32> {
    static COLLECTIVES_HD f32 from(f16 x) { return to_float(x); }
    static COLLECTIVES_HD f32 from(bf16 x) { return to_float(x); }
};
template <> struct Cast<f64> {
    static COLLECTIVES_HD f64 from(f16 x) { return widen(to_float(x)); }
    static COLLECTIVES_HD f64 from(bf16 x) { return widen(to_float(x)); }
};

// dst = D(src / divisor): the division in src's precision, then one rounding (a
// divisor of 1 only casts). Equals NumPy's divide(src, p) then copyto(dst, ...).
template <class S> COLLECTIVES_HD S divide_or_keep(S x, double divisor) {
    return divisor == 1.0 ? x : divide(x, divisor);
}

// -- the loop bodies ------------------------------------------------------------------------
// Each kernel is one of these bodies run with (start, stride) = (global thread index,
// threads in the grid); the host harness runs the same body with (0, 1). Where every
// pointer is 16-byte aligned the elements go through Vec16: one load or store per 16
// bytes; the rest (and unaligned buffers) element by element.
template <class T> COLLECTIVES_HD bool aligned16(const T* p) { return ((u64)p & 15u) == 0; }

template <class T> struct Lanes {
    enum { N = sizeof(T) <= 16 ? 16 / sizeof(T) : 1 };
    union Pack {
        Vec16 v;
        T e[N];
    };
};

template <class T, class Op>
COLLECTIVES_HD void reduce2_body(T* dst, const T* a, const T* b, i64 n, i64 start, i64 stride) {
    i64 done = 0;
    if (sizeof(T) < 16 && aligned16(dst) && aligned16(a) && aligned16(b)) {
        typedef typename Lanes<T>::Pack Pack;
        const i64 lanes = Lanes<T>::N, vectors = n / lanes;
        for (i64 j = start; j < vectors; j += stride) {
            Pack x, y, z;
            x.v = reinterpret_cast<const Vec16*>(a)[j];
            y.v = reinterpret_cast<const Vec16*>(b)[j];
            for (int l = 0; l < lanes; ++l) z.e[l] = Op::apply(x.e[l], y.e[l]);
            reinterpret_cast<Vec16*>(dst)[j] = z.v;
        }
        done = vectors * lanes;
    }
    for (i64 i = done + start; i < n; i += stride) dst[i] = Op::apply(a[i], b[i]);
}

// What reduce_n does to the fold before it writes it: nothing, or avg's division by the
// world size (the leader's fold of avg is the call's result: no rank divides after it).
struct Keep { template <class T> static COLLECTIVES_HD T apply(T x, double) { return x; } };
struct Divide { template <class T> static COLLECTIVES_HD T apply(T x, double d) { return divide(x, d); } };

// d[j] = Last(s[0] op s[1] op ... op s[k-1], divisor) for every j < m, folded left in
// index order (1 <= k, m <= 16). Each element's inputs are all read before its outputs
// are written, so an output may be an input's very elements (in place), though no other
// of its elements.
template <class T, class Op, class Last = Keep>
COLLECTIVES_HD void reduce_n_body(T* const* d, int m, const T* const* s, int k, i64 n, i64 start, i64 stride,
                                  double divisor = 1.0) {
    bool vector = sizeof(T) < 16;
    for (int o = 0; o < m; ++o) vector = vector && aligned16(d[o]);
    for (int q = 0; q < k; ++q) vector = vector && aligned16(s[q]);
    i64 done = 0;
    if (vector) {
        typedef typename Lanes<T>::Pack Pack;
        const i64 lanes = Lanes<T>::N, vectors = n / lanes;
        for (i64 j = start; j < vectors; j += stride) {
            Pack acc, x;
            acc.v = reinterpret_cast<const Vec16*>(s[0])[j];
            for (int q = 1; q < k; ++q) {
                x.v = reinterpret_cast<const Vec16*>(s[q])[j];
                for (int l = 0; l < lanes; ++l) acc.e[l] = Op::apply(acc.e[l], x.e[l]);
            }
            for (int l = 0; l < lanes; ++l) acc.e[l] = Last::apply(acc.e[l], divisor);
            for (int o = 0; o < m; ++o) reinterpret_cast<Vec16*>(d[o])[j] = acc.v;
        }
        done = vectors * lanes;
    }
    for (i64 i = done + start; i < n; i += stride) {
        T acc = s[0][i];
        for (int q = 1; q < k; ++q) acc = Op::apply(acc, s[q][i]);
        acc = Last::apply(acc, divisor);
        for (int o = 0; o < m; ++o) d[o][i] = acc;
    }
}

// One row of reduce_blocks: dst = s[0][offset + i] op ... op s[k-1][offset + i] for i < n
// (reduce_n_body's fold into one output, of the inputs shifted by ``offset`` elements).
template <class T, class Op, class Last>
COLLECTIVES_HD void reduce_blocks_row(T* dst, const T* const* s, int k, i64 offset, i64 n, i64 start, i64 stride,
                                      double divisor) {
    const T* shifted[16];
    for (int q = 0; q < k; ++q) shifted[q] = s[q] + offset;
    T* const d[1] = {dst};
    reduce_n_body<T, Op, Last>(d, 1, shifted, k, n, start, stride, divisor);
}

template <class T>
COLLECTIVES_HD void divide_body(T* x, i64 n, double divisor, i64 start, i64 stride) {
    for (i64 i = start; i < n; i += stride) x[i] = divide(x[i], divisor);
}

template <class S, class D>
COLLECTIVES_HD void cast_divide_body(D* dst, const S* src, i64 n, double divisor, i64 start, i64 stride) {
    for (i64 i = start; i < n; i += stride) dst[i] = Cast<D>::from(divide_or_keep(src[i], divisor));
}

// d_j = src for every j < m, n elements: src read once, written m times (one block row
// of copy_n's: a copy phase of the peer reads, where a leader writes one input into
// several ranks' outputs).
template <class E>
COLLECTIVES_HD void copy_fan_body(E* const* d, int m, const E* src, i64 n, i64 start, i64 stride) {
    bool vector = sizeof(E) < 16 && aligned16(src);
    for (int o = 0; o < m; ++o) vector = vector && aligned16(d[o]);
    i64 done = 0;
    if (vector) {
        const i64 lanes = Lanes<E>::N, vectors = n / lanes;
        for (i64 j = start; j < vectors; j += stride) {
            const Vec16 v = reinterpret_cast<const Vec16*>(src)[j];
            for (int o = 0; o < m; ++o) reinterpret_cast<Vec16*>(d[o])[j] = v;
        }
        done = vectors * lanes;
    }
    for (i64 i = done + start; i < n; i += stride) {
        const E v = src[i];
        for (int o = 0; o < m; ++o) d[o][i] = v;
    }
}

// The byte offset of element i of a C-ordered view with ``ndim`` dimensions.
COLLECTIVES_HD i64 strided_offset(i64 i, int ndim, const i64* shape, const i64* strides) {
    i64 offset = 0;
    for (int d = ndim - 1; d >= 0; --d) {
        i64 index = i % shape[d];
        i /= shape[d];
        offset += index * strides[d];
    }
    return offset;
}

// pack: dst (contiguous) = the elements of a strided view; unpack: the reverse.
template <class E>
COLLECTIVES_HD void pack_body(E* dst, const char* src, i64 n, int ndim, const i64* shape, const i64* strides,
                              i64 start, i64 stride) {
    for (i64 i = start; i < n; i += stride)
        dst[i] = *reinterpret_cast<const E*>(src + strided_offset(i, ndim, shape, strides));
}

template <class E>
COLLECTIVES_HD void unpack_body(char* dst, const E* src, i64 n, int ndim, const i64* shape, const i64* strides,
                                i64 start, i64 stride) {
    for (i64 i = start; i < n; i += stride)
        *reinterpret_cast<E*>(dst + strided_offset(i, ndim, shape, strides)) = src[i];
}

}  // namespace collectives
