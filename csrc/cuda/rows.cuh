/* Row kernels' building blocks: the elements a thread handles per step
 * (a 16-byte pack or one element), the row groups that own rows (a warp
 * for short rows, the whole block for long ones), the generic kernels'
 * launch shape, and the per-thread pack loop of register-resident kernels.
 * Header-only (templates and constexpr), safe in any number of .cu files. */
#pragma once

#include "common.cuh"

namespace opsmith {

constexpr int kMaxThreads = 1024;
constexpr int kMaxGrid = 1 << 16;

/* The generic kernels' row loops run a trip count known only at run time;
 * unrolling them by 4 lets a thread issue 4 loads before it waits on any,
 * which is what keeps enough bytes in flight on wide rows. */
#define OPSMITH_UNROLL_4 _Pragma("unroll 4")

/* Elements a thread handles per step: a pack, or one element. */
template <typename T, bool PACKED> struct Step {
    static constexpr int N = PACKED ? Pack<T>::VEC : 1;
};

/* Read N consecutive elements starting at p into accumulate type. */
template <typename T, typename A, bool PACKED>
__device__ __forceinline__ void load_acc(const T *p, A (&out)[Step<T, PACKED>::N]) {
    if constexpr (PACKED) {
        unpack(load_pack(p), out);
    } else {
        out[0] = to_acc(p[0]);
    }
}

template <typename T, typename A, bool PACKED>
__device__ __forceinline__ void store_acc(T *p, const A (&in)[Step<T, PACKED>::N]) {
    if constexpr (PACKED) {
        store_pack(p, pack_of<T>(in));
    } else {
        p[0] = from_acc<T>(in[0]);
    }
}

/* N elements of U at p into accumulate type: 16-byte packs when N > 1
 * (N * sizeof(U) a multiple of 16), else one element. For tensors whose
 * dtype differs from x's, read in step with x's Step<T, PACKED>::N. */
template <typename U, typename A, int N> __device__ __forceinline__ void load_n(const U *p, A (&out)[N]) {
    if constexpr (N == 1) {
        out[0] = to_acc(p[0]);
    } else {
        const Elems<U, N> e = load_elems<U, N>(p);
        constexpr int per = Pack<U>::VEC;
#pragma unroll
        for (int q = 0; q < N / per; q++) {
            A part[per];
            unpack(reinterpret_cast<const Pack<U> *>(&e)[q], part);
#pragma unroll
            for (int k = 0; k < per; k++) out[q * per + k] = part[k];
        }
    }
}

template <typename U, typename A, int N> __device__ __forceinline__ void store_n(U *p, const A (&in)[N]) {
    if constexpr (N == 1) {
        p[0] = from_acc<U>(in[0]);
    } else {
        constexpr int per = Pack<U>::VEC;
#pragma unroll
        for (int q = 0; q < N / per; q++) {
            A part[per];
#pragma unroll
            for (int k = 0; k < per; k++) part[k] = in[q * per + k];
            store_pack(p + q * per, pack_of<U>(part));
        }
    }
}

/* Sum across a row group: a warp, or the whole block. */
template <bool WARP_ROWS, typename A> __device__ __forceinline__ A group_sum(A v, A *scratch) {
    if constexpr (WARP_ROWS) return warp_sum(v);
    else return block_sum(v, scratch);
}

/* Which rows a thread's row group owns: group g of the grid takes rows
 * g, g + groups, ...; t is the thread's index inside its group. */
template <bool WARP_ROWS> struct RowGroup {
    const int threads = WARP_ROWS ? 32 : blockDim.x;
    const int t = WARP_ROWS ? (threadIdx.x & 31) : threadIdx.x;
    const int per_block = WARP_ROWS ? blockDim.x / 32 : 1;
    const int index = WARP_ROWS ? threadIdx.x / 32 : 0;
    __device__ int64_t first_row() const { return (int64_t)blockIdx.x * per_block + index; }
    __device__ int64_t row_step() const { return (int64_t)gridDim.x * per_block; }
};

/* Launch shape of the generic row kernels. */
struct Shape {
    bool warp_rows; /* one warp per row (short rows) or one block per row */
    int threads;
    int64_t grid;
    int64_t groups; /* row groups in the grid: partial rows for dweight */
};

inline Shape choose_shape(int64_t rows, int64_t n, int step, int64_t max_groups) {
    Shape s;
    const int64_t steps = n / step;
    s.warp_rows = steps <= 32 * 4; /* a warp covers the row in at most 4 steps */
    if (s.warp_rows) {
        s.threads = 256;
        const int64_t per_block = s.threads / 32;
        int64_t groups = rows < max_groups ? rows : max_groups;
        s.grid = (groups + per_block - 1) / per_block;
        if (s.grid < 1) s.grid = 1;
        s.groups = s.grid * per_block;
    } else {
        /* about 4 steps a thread, a whole number of warps, at most 1024 */
        int64_t t = (steps + 3) / 4;
        t = (t + 31) / 32 * 32;
        s.threads = (int)(t < 128 ? 128 : t > kMaxThreads ? kMaxThreads : t);
        s.grid = rows < max_groups ? rows : max_groups;
        if (s.grid < 1) s.grid = 1;
        s.groups = s.grid;
    }
    return s;
}

/* Row groups a generic backward uses when it reduces weight gradients into
 * partial rows of n: at most max_elements partial elements (the workspace
 * stays small), between 32 and 512 groups, never more than rows. */
inline int64_t partial_row_groups(int64_t rows, int64_t n, int64_t max_elements) {
    int64_t cap = max_elements / n;
    if (cap < 32) cap = 32;
    if (cap > 512) cap = 512;
    return rows < cap ? rows : cap;
}

/* Register-resident kernels keep a thread's packs of a row in registers:
 * at most kResidentThreads x kResidentIters packs a row. */
constexpr int kResidentThreads = 512, kResidentIters = 8;

/* Calls f(it, i) for each of a thread's ITERS packs that lies inside the
 * row: pack i = threadIdx.x + it * blockDim.x of `steps`. Unrolled, so the
 * per-pack arrays f indexes stay in registers. */
template <int ITERS, typename F> __device__ __forceinline__ void for_my_packs(int64_t steps, F f) {
#pragma unroll
    for (int it = 0; it < ITERS; it++) {
        const int64_t i = threadIdx.x + (int64_t)it * blockDim.x;
        if (i < steps) f(it, i);
    }
}

/* The loads-only loop of a row held in registers: f(it, i) for each of the
 * thread's ITERS packs with no branch around it, i clamped to the row's
 * first pack past the row's end (that pack is loaded again and never used:
 * the loops after it take for_my_packs). Behind a branch a pack, the
 * compiler moved a pack's byte shuffles (a bfloat16 weight's) into the
 * branch, so the thread waited for that pack's load before it issued the
 * next one: a memory round trip a pack (RMSNorm 1 x 8192 bf16, 2 packs a
 * thread: 2.27 us of kernel against Liger's 1.86, H100). The loads in f
 * are the *_here ones (common.cuh), which the compiler cannot sink into the
 * later loops' branches either. */
template <int ITERS, typename F> __device__ __forceinline__ void load_my_packs(int64_t steps, F f) {
#pragma unroll
    for (int it = 0; it < ITERS; it++) {
        const int64_t i = threadIdx.x + (int64_t)it * blockDim.x;
        f(it, i < steps ? i : (int64_t)0);
    }
}

} // namespace opsmith
