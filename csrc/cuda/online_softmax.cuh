/* What the softmax-style row kernels share (softmax.cu, cross_entropy.cu):
 * exp/log/tanh in the accumulate type, and the online (max, sum of
 * exponentials) pairs a thread keeps and a block merges, so a row is read
 * once for its log-sum-exp. -inf elements (masked logits) add nothing; a NaN
 * makes the row NaN. */
#ifndef OPSMITH_CUDA_ONLINE_SOFTMAX_CUH
#define OPSMITH_CUDA_ONLINE_SOFTMAX_CUH

#include <math_constants.h>

#include "row_slices.cuh"

namespace opsmith {

__device__ __forceinline__ double exp_acc(double v) { return exp(v); }
/* expf, not __expf: the approximate one is off by up to ~1e-4 relative for
 * the large |y - max| of float32 logits scaled by 1e4 (the harnesses' sweep) */
__device__ __forceinline__ float exp_acc(float v) { return expf(v); }
__device__ __forceinline__ double log_acc(double v) { return log(v); }
__device__ __forceinline__ float log_acc(float v) { return logf(v); }
__device__ __forceinline__ double tanh_acc(double v) { return tanh(v); }
__device__ __forceinline__ float tanh_acc(float v) { return tanhf(v); }
template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return -CUDART_INF_F; }
template <> __device__ __forceinline__ double neg_inf<double>() { return -CUDART_INF; }
template <typename A> __device__ __forceinline__ A nan_acc();
template <> __device__ __forceinline__ float nan_acc<float>() { return CUDART_NAN_F; }
template <> __device__ __forceinline__ double nan_acc<double>() { return CUDART_NAN; }

/* The row statistics of the v2 kernels. For float, exp(y - m) against the
 * row's running max m is taken as 2^((y - m) log2e): one subtraction, one
 * multiply and one ex2.approx (MUFU) an element in place of expf's ~10
 * instructions. y - m is rounded relative to itself, not to |y|, so logits
 * scaled by 1e4 stay accurate, and nothing overflows at any finite |y| (the
 * earlier single-FMA form, 2^(fma(y, log2e, -m log2e)), turned rows with
 * |max| above ~7e8 into NaN). The shift is the running max m itself. */
template <typename A> struct Ex;
template <> struct Ex<float> {
    /* exp(y - m) */
    __device__ static __forceinline__ float term(float y, float m) { return ex2_ftz((y - m) * kLog2e); }
    /* exp(a - b) for two maxima a and b */
    __device__ static __forceinline__ float ratio(float Ma, float Mb) { return ex2_ftz((Ma - Mb) * kLog2e); }
    /* log(sum exp(y - m)) from s = that sum */
    __device__ static __forceinline__ float log_sum(float s) { return logf(s); }
};
template <> struct Ex<double> {
    __device__ static __forceinline__ double term(double y, double m) { return exp(y - m); }
    __device__ static __forceinline__ double ratio(double Ma, double Mb) { return exp(Ma - Mb); }
    __device__ static __forceinline__ double log_sum(double s) { return log(s); }
};

__device__ __forceinline__ float fmax_acc(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double fmax_acc(double a, double b) { return fmax(a, b); }

/* The max over a warp, in every lane (a max is exact in any order) */
template <typename A> __device__ __forceinline__ A warp_max(A v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmax_acc(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

/* A running (max m, sum s of term(y, m)) over part of a row. -inf
 * elements (masked logits) add nothing; a NaN anywhere makes s NaN (so
 * every output of the row NaN, as PyTorch); an all -inf row keeps
 * m = -inf, s = 0 (its outputs NaN, as before). */
template <typename A> struct RowStat {
    A m, s;
    __device__ __forceinline__ RowStat() : m(neg_inf<A>()), s(A(0)) {}
    __device__ __forceinline__ RowStat(A m_, A s_) : m(m_), s(s_) {}

    /* V values: their max first, so the running sum is rescaled once */
    template <int V> __device__ __forceinline__ void add(const A (&y)[V]) {
        /* fmax skips a NaN (one FMNMX; the NaN reaches s through its term) */
        A pm = neg_inf<A>();
#pragma unroll
        for (int k = 0; k < V; k++) pm = fmax_acc(pm, y[k]);
        if (pm > m) {
            s *= Ex<A>::ratio(m, pm);
            m = pm;
        }
        if (m != neg_inf<A>()) {
#pragma unroll
            for (int k = 0; k < V; k++) s += Ex<A>::term(y[k], m);
        } else {
            /* every value so far is -inf or NaN: only a NaN counts */
#pragma unroll
            for (int k = 0; k < V; k++)
                if (y[k] != y[k]) s = nan_acc<A>();
        }
    }
    __device__ __forceinline__ void add1(A y) {
        const A one[1] = {y};
        add<1>(one);
    }
    /* the side with the larger max keeps its sum unscaled (bit-exact) */
    __device__ __forceinline__ void merge(A m2, A s2) {
        if (m2 > m) {
            s = s * Ex<A>::ratio(m, m2) + s2;
            m = m2;
        } else if (m2 == m) {
            s += s2;
        } else {
            s += s2 * Ex<A>::ratio(m2, m);
        }
    }
    __device__ __forceinline__ void merge(const RowStat &o) { merge(o.m, o.s); }
    /* This thread's sum rescaled to a max bm >= m (m == bm also where both
     * are -inf: nothing but masked logits) */
    __device__ __forceinline__ A sum_at(A bm) const { return m == bm ? s : s * Ex<A>::ratio(m, bm); }
    /* The warp's statistics, returned to every lane, the same bits in each:
     * block_merge's two butterflies within one warp (no shared memory) */
    __device__ __forceinline__ void warp_merge() {
        const A wm = warp_max(m);
        s = warp_sum(sum_at(wm));
        m = wm;
    }
    /* The block's statistics, returned to every thread, the same bits in
     * each: the block's max first (exact in any order), then each thread's
     * sum rescaled to it once and the sums added, each round a butterfly
     * (a + b = b + a, so every lane forms the same sums). One instruction
     * a shuffle level where merging (max, sum) pairs level by level takes a
     * compare, a branch and an exponential. scratch holds 64 A. */
    __device__ __forceinline__ void block_merge(A *scratch) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
        A bm = warp_max(m);
        __syncthreads(); /* scratch is free (a previous call's readers are done) */
        if (lane == 0) scratch[warp] = bm;
        __syncthreads();
        bm = warp_max(lane < warps ? scratch[lane] : neg_inf<A>());
        A bs = warp_sum(sum_at(bm));
        if (lane == 0) scratch[32 + warp] = bs;
        __syncthreads();
        bs = lane < warps ? scratch[32 + lane] : A(0);
        m = bm;
        s = warp_sum(bs);
    }
};

/* What the writes of a row need once its statistics are final:
 * p(y) = exp(y - m) / sum = term(y, m) * inv_s, and log_s = log(sum), so
 * log p = (y - m) - log_s and lse = m + log_s. Neither forms lse first: at
 * |y| ~ 1e4 in float32 its rounding (ulp ~ 2e-3) would be an error of p. */
template <typename A> struct RowNorm {
    A m, inv_s, log_s;
    /* with_log: log_s is wanted (log p, lse); a softmax skips the log */
    __device__ __forceinline__ explicit RowNorm(const RowStat<A> &st, bool with_log = true)
        : m(st.m), inv_s(A(1) / st.s), log_s(with_log ? Ex<A>::log_sum(st.s) : A(0)) {}
    __device__ __forceinline__ A p(A y) const { return Ex<A>::term(y, m) * inv_s; }
    __device__ __forceinline__ A logp(A y) const { return (y - m) - log_s; }
    __device__ __forceinline__ A lse() const { return m + log_s; }
};

} // namespace opsmith

#endif /* OPSMITH_CUDA_ONLINE_SOFTMAX_CUH */
