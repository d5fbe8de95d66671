// The kernels' loop bodies (kernels/elementwise.cuh), compiled for the host: the
// tests (test_kernels.py) build this with g++ into a shared library, call it through
// ctypes and compare every op x dtype with NumPy. The reductions run their body as a
// grid of `threads` threads would, one after the other: (start, stride) = (t, threads)
// for t = 0 .. threads-1, vectorised path and tail included.
#include <cstring>

#include "elementwise.cuh"

using namespace collectives;

namespace {

bool is(const char* a, const char* b) { return std::strcmp(a, b) == 0; }

template <class T, class Op>
void reduce2_grid(T* d, const T* x, const T* y, i64 n, int threads) {
    for (int t = 0; t < threads; ++t) reduce2_body<T, Op>(d, x, y, n, t, threads);
}

// Which ops a dtype has: complex numbers sum and prod only, floats also max and min,
// integers also the bitwise ops. (The discarded branches of `if constexpr` are never
// instantiated, so no dtype meets an op it lacks.)
enum Ops { COMPLEX, FLOAT, INTEGER };

template <class T, Ops Has>
int reduce2_op(const char* op, void* dst, const void* a, const void* b, i64 n, int threads) {
    T* d = static_cast<T*>(dst);
    const T* x = static_cast<const T*>(a);
    const T* y = static_cast<const T*>(b);
    if (is(op, "sum")) reduce2_grid<T, Sum>(d, x, y, n, threads);
    else if (is(op, "prod")) reduce2_grid<T, Prod>(d, x, y, n, threads);
    else if constexpr (Has == COMPLEX) return -2;
    else if (is(op, "max")) reduce2_grid<T, Max>(d, x, y, n, threads);
    else if (is(op, "min")) reduce2_grid<T, Min>(d, x, y, n, threads);
    else if constexpr (Has == FLOAT) return -2;
    else if (is(op, "band")) reduce2_grid<T, BAnd>(d, x, y, n, threads);
    else if (is(op, "bor")) reduce2_grid<T, BOr>(d, x, y, n, threads);
    else if (is(op, "bxor")) reduce2_grid<T, BXor>(d, x, y, n, threads);
    else return -2;
    return 0;
}

template <class T, class Op>
void reduce_n_grid(T* const* d, int m, const T* const* s, int k, i64 n, int threads) {
    for (int t = 0; t < threads; ++t) reduce_n_body<T, Op>(d, m, s, k, n, t, threads);
}

// avg's fold that is the call's result (the leader's): the sum divided as it is written.
template <class T>
void reduce_n_divide(void* const* dsts, int m, const void* const* srcs, int k, i64 n, int threads, double divisor) {
    const T* s[16];
    T* d[16];
    for (int q = 0; q < k; ++q) s[q] = static_cast<const T*>(srcs[q]);
    for (int o = 0; o < m; ++o) d[o] = static_cast<T*>(dsts[o]);
    for (int t = 0; t < threads; ++t) reduce_n_body<T, Sum, Divide>(d, m, s, k, n, t, threads, divisor);
}

template <class T, Ops Has>
int reduce_n_op(const char* op, void* const* dsts, int m, const void* const* srcs, int k, i64 n, int threads) {
    const T* s[16];
    T* d[16];
    for (int q = 0; q < k; ++q) s[q] = static_cast<const T*>(srcs[q]);
    for (int o = 0; o < m; ++o) d[o] = static_cast<T*>(dsts[o]);
    if (is(op, "sum")) reduce_n_grid<T, Sum>(d, m, s, k, n, threads);
    else if (is(op, "prod")) reduce_n_grid<T, Prod>(d, m, s, k, n, threads);
    else if constexpr (Has == COMPLEX) return -2;
    else if (is(op, "max")) reduce_n_grid<T, Max>(d, m, s, k, n, threads);
    else if (is(op, "min")) reduce_n_grid<T, Min>(d, m, s, k, n, threads);
    else if constexpr (Has == FLOAT) return -2;
    else if (is(op, "band")) reduce_n_grid<T, BAnd>(d, m, s, k, n, threads);
    else if (is(op, "bor")) reduce_n_grid<T, BOr>(d, m, s, k, n, threads);
    else if (is(op, "bxor")) reduce_n_grid<T, BXor>(d, m, s, k, n, threads);
    else return -2;
    return 0;
}

// reduce_blocks as the kernel runs it: block row j = j, each row's grid of `threads`
// threads one after the other; a sum (divisor 0) or avg's dividing sum.
template <class T, class Last>
void reduce_blocks_grid(void* const* dsts, int m, const void* const* srcs, int k, const i64* offsets,
                        const i64* counts, int threads, double divisor) {
    const T* s[16];
    for (int q = 0; q < k; ++q) s[q] = static_cast<const T*>(srcs[q]);
    for (int j = 0; j < m; ++j)
        for (int t = 0; t < threads; ++t)
            reduce_blocks_row<T, Sum, Last>(static_cast<T*>(dsts[j]), s, k, offsets[j], counts[j], t, threads,
                                            divisor);
}

template <class S, class D>
void cast(void* dst, const void* src, i64 n, double divisor) {
    cast_divide_body<S, D>(static_cast<D*>(dst), static_cast<const S*>(src), n, divisor, 0, 1);
}

template <class E>
void pack_e(void* dst, const void* src, i64 n, int ndim, const i64* shape, const i64* strides) {
    pack_body<E>(static_cast<E*>(dst), static_cast<const char*>(src), n, ndim, shape, strides, 0, 1);
}

template <class E>
void unpack_e(void* dst, const void* src, i64 n, int ndim, const i64* shape, const i64* strides) {
    unpack_body<E>(static_cast<char*>(dst), static_cast<const E*>(src), n, ndim, shape, strides, 0, 1);
}

template <class E>
void copy_e(void* const* dst, const void* const* src, const i64* n, int k, int m) {
    for (int q = 0; q < k; ++q)
        copy_fan_body<E>(reinterpret_cast<E* const*>(dst) + q * m, m, static_cast<const E*>(src[q]), n[q], 0, 1);
}

}  // namespace

#define COLLECTIVES_INTEGER_TYPES(X) \
    X(int8, i8) X(int16, i16) X(int32, i32) X(int64, i64) X(uint8, u8) X(uint16, u16) X(uint32, u32) X(uint64, u64)
#define COLLECTIVES_FLOAT_TYPES(X) X(float16, f16) X(bfloat16, bf16) X(float32, f32) X(float64, f64)

extern "C" {

// 0: done; -1: unknown dtype; -2: op not defined for it (complex max/min, bitwise on non-integers).
int cc_reduce2(const char* dtype, const char* op, void* dst, const void* a, const void* b, i64 n, int threads) {
#define X(name, T) if (is(dtype, #name)) return reduce2_op<T, INTEGER>(op, dst, a, b, n, threads);
    COLLECTIVES_INTEGER_TYPES(X)
#undef X
#define X(name, T) if (is(dtype, #name)) return reduce2_op<T, FLOAT>(op, dst, a, b, n, threads);
    COLLECTIVES_FLOAT_TYPES(X)
#undef X
    if (is(dtype, "complex64")) return reduce2_op<c64, COMPLEX>(op, dst, a, b, n, threads);
    if (is(dtype, "complex128")) return reduce2_op<c128, COMPLEX>(op, dst, a, b, n, threads);
    return -1;
}

int cc_reduce_n(const char* dtype, const char* op, void* const* dsts, int m, const void* const* srcs, int k, i64 n,
                int threads) {
    if (k < 1 || k > 16 || m < 1 || m > 16) return -3;
#define X(name, T) if (is(dtype, #name)) return reduce_n_op<T, INTEGER>(op, dsts, m, srcs, k, n, threads);
    COLLECTIVES_INTEGER_TYPES(X)
#undef X
#define X(name, T) if (is(dtype, #name)) return reduce_n_op<T, FLOAT>(op, dsts, m, srcs, k, n, threads);
    COLLECTIVES_FLOAT_TYPES(X)
#undef X
    if (is(dtype, "complex64")) return reduce_n_op<c64, COMPLEX>(op, dsts, m, srcs, k, n, threads);
    if (is(dtype, "complex128")) return reduce_n_op<c128, COMPLEX>(op, dsts, m, srcs, k, n, threads);
    return -1;
}

// 0: done; -1: a dtype avg does not take; -3: k or m out of range.
int cc_reduce_n_divide(const char* dtype, void* const* dsts, int m, const void* const* srcs, int k, i64 n,
                       int threads, double divisor) {
    if (k < 1 || k > 16 || m < 1 || m > 16) return -3;
#define X(name, T) if (is(dtype, #name)) return reduce_n_divide<T>(dsts, m, srcs, k, n, threads, divisor), 0;
    COLLECTIVES_FLOAT_TYPES(X)
    X(complex64, c64) X(complex128, c128)
#undef X
    return -1;
}

// 0: done; -1: unknown dtype (or a division asked of an integer one); -3: k or m out of range.
int cc_reduce_blocks(const char* dtype, void* const* dsts, int m, const void* const* srcs, int k,
                     const i64* offsets, const i64* counts, int threads, double divisor) {
    if (k < 1 || k > 16 || m < 1 || m > 16) return -3;
#define X(name, T) \
    if (is(dtype, #name)) { \
        if (divisor != 0) return -1; \
        reduce_blocks_grid<T, Keep>(dsts, m, srcs, k, offsets, counts, threads, 1.0); \
        return 0; \
    }
    COLLECTIVES_INTEGER_TYPES(X)
#undef X
#define X(name, T) \
    if (is(dtype, #name)) { \
        if (divisor != 0) reduce_blocks_grid<T, Divide>(dsts, m, srcs, k, offsets, counts, threads, divisor); \
        else reduce_blocks_grid<T, Keep>(dsts, m, srcs, k, offsets, counts, threads, 1.0); \
        return 0; \
    }
    COLLECTIVES_FLOAT_TYPES(X)
    X(complex64, c64) X(complex128, c128)
#undef X
    return -1;
}

int cc_divide(const char* dtype, void* x, i64 n, double divisor) {
    if (is(dtype, "float16")) divide_body<f16>(static_cast<f16*>(x), n, divisor, 0, 1);
    else if (is(dtype, "bfloat16")) divide_body<bf16>(static_cast<bf16*>(x), n, divisor, 0, 1);
    else if (is(dtype, "float32")) divide_body<f32>(static_cast<f32*>(x), n, divisor, 0, 1);
    else if (is(dtype, "float64")) divide_body<f64>(static_cast<f64*>(x), n, divisor, 0, 1);
    else if (is(dtype, "complex64")) divide_body<c64>(static_cast<c64*>(x), n, divisor, 0, 1);
    else if (is(dtype, "complex128")) divide_body<c128>(static_cast<c128*>(x), n, divisor, 0, 1);
    else return -1;
    return 0;
}

int cc_cast_divide(const char* src_dtype, const char* dst_dtype, void* dst, const void* src, i64 n, double divisor) {
    if (is(src_dtype, "float32") && is(dst_dtype, "float16")) cast<f32, f16>(dst, src, n, divisor);
    else if (is(src_dtype, "float32") && is(dst_dtype, "bfloat16")) cast<f32, bf16>(dst, src, n, divisor);
    else if (is(src_dtype, "float64") && is(dst_dtype, "float16")) cast<f64, f16>(dst, src, n, divisor);
    else if (is(src_dtype, "float64") && is(dst_dtype, "bfloat16")) cast<f64, bf16>(dst, src, n, divisor);
    else if (is(src_dtype, "float16") && is(dst_dtype, "float32")) cast<f16, f32>(dst, src, n, divisor);
    else if (is(src_dtype, "bfloat16") && is(dst_dtype, "float32")) cast<bf16, f32>(dst, src, n, divisor);
    else if (is(src_dtype, "float16") && is(dst_dtype, "float64")) cast<f16, f64>(dst, src, n, divisor);
    else if (is(src_dtype, "bfloat16") && is(dst_dtype, "float64")) cast<bf16, f64>(dst, src, n, divisor);
    else return -1;
    return 0;
}

int cc_pack(int itemsize, void* dst, const void* src, i64 n, int ndim, const i64* shape, const i64* strides) {
    switch (itemsize) {
        case 1: pack_e<b1>(dst, src, n, ndim, shape, strides); return 0;
        case 2: pack_e<b2>(dst, src, n, ndim, shape, strides); return 0;
        case 4: pack_e<b4>(dst, src, n, ndim, shape, strides); return 0;
        case 8: pack_e<b8>(dst, src, n, ndim, shape, strides); return 0;
        case 16: pack_e<b16>(dst, src, n, ndim, shape, strides); return 0;
    }
    return -1;
}

int cc_unpack(int itemsize, void* dst, const void* src, i64 n, int ndim, const i64* shape, const i64* strides) {
    switch (itemsize) {
        case 1: unpack_e<b1>(dst, src, n, ndim, shape, strides); return 0;
        case 2: unpack_e<b2>(dst, src, n, ndim, shape, strides); return 0;
        case 4: unpack_e<b4>(dst, src, n, ndim, shape, strides); return 0;
        case 8: unpack_e<b8>(dst, src, n, ndim, shape, strides); return 0;
        case 16: unpack_e<b16>(dst, src, n, ndim, shape, strides); return 0;
    }
    return -1;
}

// copy_n's copies, each as one block row runs it: source q into destinations q*m ... q*m+m-1.
int cc_copy_n(int itemsize, void* const* dst, const void* const* src, const i64* n, int k, int m) {
    switch (itemsize) {
        case 1: copy_e<b1>(dst, src, n, k, m); return 0;
        case 2: copy_e<b2>(dst, src, n, k, m); return 0;
        case 4: copy_e<b4>(dst, src, n, k, m); return 0;
        case 8: copy_e<b8>(dst, src, n, k, m); return 0;
        case 16: copy_e<b16>(dst, src, n, k, m); return 0;
    }
    return -1;
}

// The scalar conversions themselves, for exhaustive checks of the rounding.
void cc_float_to_half(const u32* src, u16* dst, i64 n) {
    for (i64 i = 0; i < n; ++i) dst[i] = float_bits_to_half(src[i]);
}
void cc_half_to_float(const u16* src, u32* dst, i64 n) {
    for (i64 i = 0; i < n; ++i) dst[i] = half_to_float_bits(src[i]);
}
void cc_double_to_half(const u64* src, u16* dst, i64 n) {
    for (i64 i = 0; i < n; ++i) dst[i] = double_bits_to_half(src[i]);
}
void cc_float_to_bf16(const u32* src, u16* dst, i64 n) {
    for (i64 i = 0; i < n; ++i) dst[i] = float_bits_to_bf16(src[i]);
}

}  // extern "C"
