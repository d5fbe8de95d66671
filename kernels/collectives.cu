// The GPU kernels of the collectives: reductions, the average's division, the casts of
// compression, the packing of non-contiguous arrays, and the peer reads' gathering
// copies. Compiled at first use by NVRTC through cupy.RawModule
// (collectives/device/kernels.py names the instantiations it needs); `make test-long`
// also compiles every instantiation with nvcc for sm_80 and sm_90.
//
// Every kernel is a grid-stride loop over a body from elementwise.cuh, which the host
// test harness runs too. One launch covers one segment of any length.
#include "elementwise.cuh"

namespace collectives {

__device__ __forceinline__ i64 thread_start() { return (i64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ i64 thread_stride() { return (i64)blockDim.x * gridDim.x; }

// dst = a op b (dst may be a or b).
template <class T, class Op>
__global__ void reduce2(T* dst, const T* a, const T* b, i64 n) {
    reduce2_body<T, Op>(dst, a, b, n, thread_start(), thread_stride());
}

// d_j = s0 op s1 op ... op s(k-1), left to right, for every j < m (a fold written to
// several outputs at once: the leader algorithm's, into every rank's); the unused
// pointers are null. Last = Divide (avg's fold that is the call's result) divides it by
// ``divisor`` before writing; Keep ignores it.
template <class T, class Op, class Last>
__global__ void reduce_n(i64 n, int k, int m, double divisor, const T* s0, const T* s1, const T* s2, const T* s3, const T* s4,
                         const T* s5, const T* s6, const T* s7, const T* s8, const T* s9, const T* s10,
                         const T* s11, const T* s12, const T* s13, const T* s14, const T* s15, T* d0, T* d1, T* d2,
                         T* d3, T* d4, T* d5, T* d6, T* d7, T* d8, T* d9, T* d10, T* d11, T* d12, T* d13, T* d14,
                         T* d15) {
    const T* s[16] = {s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15};
    T* const d[16] = {d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15};
    reduce_n_body<T, Op, Last>(d, m, s, k, n, thread_start(), thread_stride(), divisor);
}

// Up to 16 folds of the same k inputs, each over a block of its own, in one launch (a
// leader's reduce_scatter: every rank's block of the fold, into its output): block row
// j = blockIdx.y writes d_j = s_0[o_j + i] op ... op s_(k-1)[o_j + i] for i < n_j, as
// reduce_n does (Last: Divide for avg's fold that is the call's result, else Keep).
template <class T, class Op, class Last>
__global__ void reduce_blocks(int k, int m, double divisor, const T* s0, const T* s1, const T* s2, const T* s3,
                              const T* s4, const T* s5, const T* s6, const T* s7, const T* s8, const T* s9,
                              const T* s10, const T* s11, const T* s12, const T* s13, const T* s14, const T* s15,
                              T* d0, T* d1, T* d2, T* d3, T* d4, T* d5, T* d6, T* d7, T* d8, T* d9, T* d10, T* d11,
                              T* d12, T* d13, T* d14, T* d15, i64 o0, i64 o1, i64 o2, i64 o3, i64 o4, i64 o5,
                              i64 o6, i64 o7, i64 o8, i64 o9, i64 o10, i64 o11, i64 o12, i64 o13, i64 o14, i64 o15,
                              i64 n0, i64 n1, i64 n2, i64 n3, i64 n4, i64 n5, i64 n6, i64 n7, i64 n8, i64 n9,
                              i64 n10, i64 n11, i64 n12, i64 n13, i64 n14, i64 n15) {
    const int j = blockIdx.y;
    if (j >= m) return;
    const T* const base[16] = {s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15};
    T* const d[16] = {d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15};
    const i64 o[16] = {o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11, o12, o13, o14, o15};
    const i64 n[16] = {n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15};
    reduce_blocks_row<T, Op, Last>(d[j], base, k, o[j], n[j], thread_start(), thread_stride(), divisor);
}

// x = x / divisor, in place (avg: the sum divided by the world size).
template <class T>
__global__ void divide_by(T* x, i64 n, double divisor) {
    divide_body<T>(x, n, divisor, thread_start(), thread_stride());
}

// dst = D(src / divisor): fp32/fp64 <-> fp16/bf16 with compression's 1/p fused in.
template <class S, class D>
__global__ void cast_divide(D* dst, const S* src, i64 n, double divisor) {
    cast_divide_body<S, D>(dst, src, n, divisor, thread_start(), thread_stride());
}

// Gather the n elements of a strided view (up to 8 dimensions, byte strides) into dst.
template <class E>
__global__ void pack(E* dst, const char* src, i64 n, int ndim, i64 n0, i64 n1, i64 n2, i64 n3, i64 n4, i64 n5,
                     i64 n6, i64 n7, i64 t0, i64 t1, i64 t2, i64 t3, i64 t4, i64 t5, i64 t6, i64 t7) {
    const i64 shape[8] = {n0, n1, n2, n3, n4, n5, n6, n7};
    const i64 strides[8] = {t0, t1, t2, t3, t4, t5, t6, t7};
    pack_body<E>(dst, src, n, ndim, shape, strides, thread_start(), thread_stride());
}

// Scatter contiguous src into the n elements of a strided view.
template <class E>
__global__ void unpack(char* dst, const E* src, i64 n, int ndim, i64 n0, i64 n1, i64 n2, i64 n3, i64 n4, i64 n5,
                       i64 n6, i64 n7, i64 t0, i64 t1, i64 t2, i64 t3, i64 t4, i64 t5, i64 t6, i64 t7) {
    const i64 shape[8] = {n0, n1, n2, n3, n4, n5, n6, n7};
    const i64 strides[8] = {t0, t1, t2, t3, t4, t5, t6, t7};
    unpack_body<E>(dst, src, n, ndim, shape, strides, thread_start(), thread_stride());
}

// Up to 16 copies in one launch (a copy phase of the peer reads: every peer's buffer
// gathered into this rank's, one kernel, not one copy each), m destinations a source
// (k * m <= 16; a leader writes each input into m ranks' outputs, reading it once):
// block row q = blockIdx.y copies n_q elements from s_q to d_(q*m) ... d_(q*m+m-1); the
// unused pointers are null with n_q = 0.
template <class E>
__global__ void copy_n(int k, int m, E* d0, E* d1, E* d2, E* d3, E* d4, E* d5, E* d6, E* d7, E* d8, E* d9,
                       E* d10, E* d11, E* d12, E* d13, E* d14, E* d15, const E* s0, const E* s1, const E* s2,
                       const E* s3, const E* s4, const E* s5, const E* s6, const E* s7, const E* s8, const E* s9,
                       const E* s10, const E* s11, const E* s12, const E* s13, const E* s14, const E* s15,
                       i64 n0, i64 n1, i64 n2, i64 n3, i64 n4, i64 n5, i64 n6, i64 n7, i64 n8, i64 n9, i64 n10,
                       i64 n11, i64 n12, i64 n13, i64 n14, i64 n15) {
    const int q = blockIdx.y;
    if (q >= k) return;
    E* const d[16] = {d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15};
    const E* const s[16] = {s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15};
    const i64 n[16] = {n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15};
    copy_fan_body<E>(d + q * m, m, s[q], n[q], thread_start(), thread_stride());
}

// -- the fence of ranks on distinct GPUs with peer access ----------------------------------------
// Every in-kernel wait has a time limit, read from %globaltimer (nanoseconds): a kernel
// cannot be cancelled, and the host must learn who did not come.

__device__ __forceinline__ u64 global_time_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void store_release_system(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u32 load_acquire_system(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// One fence of `size` ranks, one block of at least `size` threads. An inbox is 2 * size
// words: word q the epoch rank q reached, word size + q the digest it wrote with it.
// Thread q (q != rank) writes `digest` into word size + rank and `epoch` into word
// `rank` of rank q's inbox (`inboxes[q]`, its device memory opened here), after
// everything this rank's stream did before (fence, then a release at system scope),
// and waits until rank q has written `epoch` (or later: the comparison is cyclic, as
// the epochs wrap) into word q of this rank's own inbox, acquiring what rank q did
// before; unless `wait` is 0: then it only signals (a rank whose host has met the
// others already, so that ranks whose kernels wait there can pass). Where `check` is
// set, a digest of rank q's other than `digest` sets late[q] to 2: the ranks disagree
// on the call or on where its buffers are (the digest names both), which the host
// raises; the work after it runs all the same. After `limit_ns`
// it gives up and sets late[q] (host memory, which the host reads to name the ranks) to
// 1; the work after it then runs on whatever is there, and the host raises. late[rank],
// which no fence writes, is the host's word to stop: once the host has set it (the
// communicator broke), a waiting fence returns within about 0.1 ms (it looks that
// often), setting nothing.
__global__ void fence(u32* const* inboxes, const u32* inbox, int rank, int size, u32 epoch, u64 limit_ns,
                      u32* late, u32 digest, int wait, int check) {
    const int q = threadIdx.x;
    if (q >= size || q == rank) return;
    inboxes[q][size + rank] = digest;  // (ordered before the epoch by the release below)
    __threadfence_system();
    store_release_system(inboxes[q] + rank, epoch);
    if (!wait) return;
    const u64 start = global_time_ns();
    u64 looked = start;
    while ((int)(load_acquire_system(inbox + q) - epoch) < 0) {
        const u64 now = global_time_ns();
        if (now - start > limit_ns) {
            late[q] = 1u;
            __threadfence_system();
            return;
        }
        if (now - looked > 100000) {  // host memory is far: look at the stop word every 0.1 ms only
            looked = now;
            if (load_acquire_system(late + rank) != 0u) return;
        }
        __nanosleep(200);
    }
    if (check && load_acquire_system(inbox + size + q) != digest) {
        late[q] = 2u;
        __threadfence_system();
    }
}

}  // namespace collectives
