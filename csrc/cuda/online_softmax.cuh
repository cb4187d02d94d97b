/* What the softmax-style row kernels share (softmax.cu, cross_entropy.cu):
 * exp/log/tanh in the accumulate type, and the online (max, sum of
 * exponentials) pairs a thread keeps and a block merges, so a row is read
 * once for its log-sum-exp. -inf elements (masked logits) add nothing; a NaN
 * makes the row NaN. */
#ifndef OPSMITH_CUDA_ONLINE_SOFTMAX_CUH
#define OPSMITH_CUDA_ONLINE_SOFTMAX_CUH

#include <math_constants.h>

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

/* (max, sum of exp(y - max)) pairs merged */
template <typename A> __device__ __forceinline__ void merge(A &m, A &s, A m2, A s2) {
    const A mm = m > m2 ? m : m2;
    if (mm == neg_inf<A>()) { /* both empty, or only NaN seen: keep a NaN sum */
        s = s + s2;
        return;
    }
    s = s * exp_acc(m - mm) + s2 * exp_acc(m2 - mm);
    m = mm;
}

/* one element into a thread's running (max, sum) */
template <typename A> __device__ __forceinline__ void online(A &m, A &s, A y) {
    if (y > m) {
        s = s * exp_acc(m - y) + A(1);
        m = y;
    } else if (y != y) { /* a NaN makes the row's sum (so every output) NaN, as PyTorch */
        s = nan_acc<A>();
    } else if (m != neg_inf<A>()) { /* -inf logits (masked) add nothing */
        s += exp_acc(y - m);
    }
}

/* the block's (max, sum), returned to every thread; scratch holds 64 A */
template <typename A> __device__ __forceinline__ void block_max_sum(A &m, A &s, A *scratch) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const A m2 = __shfl_xor_sync(0xffffffffu, m, off), s2 = __shfl_xor_sync(0xffffffffu, s, off);
        merge(m, s, m2, s2);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = m, scratch[32 + warp] = s;
    __syncthreads();
    m = lane < warps ? scratch[lane] : neg_inf<A>();
    s = lane < warps ? scratch[32 + lane] : A(0);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const A m2 = __shfl_xor_sync(0xffffffffu, m, off), s2 = __shfl_xor_sync(0xffffffffu, s, off);
        merge(m, s, m2, s2);
    }
}

} // namespace opsmith

#endif /* OPSMITH_CUDA_ONLINE_SOFTMAX_CUH */
