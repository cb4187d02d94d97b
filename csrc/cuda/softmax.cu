/* softmax and log_softmax on CUDA: a block a row, streaming through it.
 * Forward: sweep 1 reads the row once for the online max and exponential
 * sum (16-byte packs with a scalar tail; scalar throughout where the row
 * start is not 16-byte aligned), sweep 2 reads it again (from L2 for rows in
 * flight) and writes y. Backward: sweep 1 the row's dot product (sum dy y,
 * or sum dy for log_softmax), sweep 2 writes dx. Each element is read before
 * it is written, by the same thread, so y = x and dx = dy are safe. No host
 * synchronisation. Arithmetic in Acc (double for f64, float otherwise). */
#include "common.cuh"
#include "online_softmax.cuh"
#include "internal/softmax.h"

namespace opsmith {
namespace {

template <typename T, typename A, bool PACKED>
__global__ void fwd_kernel(int64_t n, const T *x, int64_t xs, bool lg, T *y, int64_t ys) {
    __shared__ A scratch[64];
    constexpr int V = PACKED ? Pack<T>::VEC : 1;
    const int64_t r = blockIdx.x, body = PACKED ? n / V * V : 0;
    const T *xr = x + r * xs;
    T *yr = y + r * ys;
    A m = neg_inf<A>(), s = 0;
    if constexpr (PACKED) {
        for (int64_t i = (int64_t)threadIdx.x * V; i < body; i += (int64_t)blockDim.x * V) {
            const Pack<T> p = *reinterpret_cast<const Pack<T> *>(xr + i);
            A pm = neg_inf<A>();
#pragma unroll
            for (int k = 0; k < V; k++) pm = to_acc(p.v[k]) > pm ? to_acc(p.v[k]) : pm;
            if (pm > m) s *= exp_acc(m - pm), m = pm;
            if (m != neg_inf<A>())
#pragma unroll
                for (int k = 0; k < V; k++) s += exp_acc(to_acc(p.v[k]) - m);
        }
    }
    for (int64_t i = body + threadIdx.x; i < n; i += blockDim.x) online(m, s, to_acc(xr[i]));
    block_max_sum(m, s, scratch);
    const A lse = m + log_acc(s);
    if constexpr (PACKED) {
        for (int64_t i = (int64_t)threadIdx.x * V; i < body; i += (int64_t)blockDim.x * V) {
            const Pack<T> p = *reinterpret_cast<const Pack<T> *>(xr + i);
            Pack<T> q;
#pragma unroll
            for (int k = 0; k < V; k++) {
                const A v = to_acc(p.v[k]) - lse;
                q.v[k] = from_acc<T>(lg ? v : exp_acc(v));
            }
            store_pack(yr + i, q);
        }
    }
    for (int64_t i = body + threadIdx.x; i < n; i += blockDim.x) {
        const A v = to_acc(xr[i]) - lse;
        yr[i] = from_acc<T>(lg ? v : exp_acc(v));
    }
}

template <typename T, typename A, bool PACKED>
__global__ void bwd_kernel(int64_t n, const T *g, int64_t gs, const T *__restrict__ y, int64_t ys, bool lg, T *dx,
                           int64_t dxs) {
    __shared__ A scratch[32];
    constexpr int V = PACKED ? Pack<T>::VEC : 1;
    const int64_t r = blockIdx.x, body = PACKED ? n / V * V : 0;
    const T *gr = g + r * gs, *yr = y + r * ys;
    T *dr = dx + r * dxs;
    A s = 0;
    if constexpr (PACKED) {
        for (int64_t i = (int64_t)threadIdx.x * V; i < body; i += (int64_t)blockDim.x * V) {
            const Pack<T> pg = *reinterpret_cast<const Pack<T> *>(gr + i), py = load_pack(yr + i);
#pragma unroll
            for (int k = 0; k < V; k++) s += lg ? to_acc(pg.v[k]) : to_acc(pg.v[k]) * to_acc(py.v[k]);
        }
    }
    for (int64_t i = body + threadIdx.x; i < n; i += blockDim.x)
        s += lg ? to_acc(gr[i]) : to_acc(gr[i]) * to_acc(yr[i]);
    s = block_sum(s, scratch);
    if constexpr (PACKED) {
        for (int64_t i = (int64_t)threadIdx.x * V; i < body; i += (int64_t)blockDim.x * V) {
            const Pack<T> pg = *reinterpret_cast<const Pack<T> *>(gr + i), py = load_pack(yr + i);
            Pack<T> q;
#pragma unroll
            for (int k = 0; k < V; k++) {
                const A gv = to_acc(pg.v[k]), yv = to_acc(py.v[k]);
                q.v[k] = from_acc<T>(lg ? gv - exp_acc(yv) * s : yv * (gv - s));
            }
            store_pack(dr + i, q);
        }
    }
    for (int64_t i = body + threadIdx.x; i < n; i += blockDim.x) {
        const A gv = to_acc(gr[i]), yv = to_acc(yr[i]);
        dr[i] = from_acc<T>(lg ? gv - exp_acc(yv) * s : yv * (gv - s));
    }
}

inline int threads_for(int64_t n, int vec) {
    const int64_t steps = (n + vec - 1) / vec;
    return steps >= 4096 ? 1024 : steps >= 1024 ? 512 : steps >= 256 ? 256 : 64;
}

template <opsmith_dtype D>
opsmith_status fwd(int64_t rows, int64_t n, const void *x, int64_t xs, bool lg, void *y, int64_t ys,
                   cudaStream_t stream) {
    using T = typename Storage<D>::T;
    using A = typename Storage<D>::Acc;
    constexpr int vec = Pack<T>::VEC;
    const bool packed = aligned16(x) && aligned16(y) && (rows == 1 || (xs % vec == 0 && ys % vec == 0));
    const int threads = threads_for(n, packed ? vec : 1);
    const T *xp = static_cast<const T *>(x);
    T *yp = static_cast<T *>(y);
    if (packed) fwd_kernel<T, A, true><<<(unsigned)rows, threads, 0, stream>>>(n, xp, xs, lg, yp, ys);
    else fwd_kernel<T, A, false><<<(unsigned)rows, threads, 0, stream>>>(n, xp, xs, lg, yp, ys);
    return launch_status();
}

template <opsmith_dtype D>
opsmith_status bwd(int64_t rows, int64_t n, const void *g, int64_t gs, const void *y, int64_t ys, bool lg, void *dx,
                   int64_t dxs, cudaStream_t stream) {
    using T = typename Storage<D>::T;
    using A = typename Storage<D>::Acc;
    constexpr int vec = Pack<T>::VEC;
    const bool packed = aligned16(g) && aligned16(y) && aligned16(dx) &&
                        (rows == 1 || (gs % vec == 0 && ys % vec == 0 && dxs % vec == 0));
    const int threads = threads_for(n, packed ? vec : 1);
    const T *gp = static_cast<const T *>(g), *yp = static_cast<const T *>(y);
    T *dp = static_cast<T *>(dx);
    if (packed) bwd_kernel<T, A, true><<<(unsigned)rows, threads, 0, stream>>>(n, gp, gs, yp, ys, lg, dp, dxs);
    else bwd_kernel<T, A, false><<<(unsigned)rows, threads, 0, stream>>>(n, gp, gs, yp, ys, lg, dp, dxs);
    return launch_status();
}

} // namespace
} // namespace opsmith

using namespace opsmith;

extern "C" opsmith_status opsmith_softmax_fwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n, const void *x,
                                                   int64_t x_row_stride, int log, void *y, int64_t y_row_stride,
                                                   opsmith_cuda_stream stream) {
    opsmith_status st = opsmith_internal_softmax_check("softmax_fwd_cuda", dtype, rows, n, x, x_row_stride, 0, nullptr,
                                                       0, y, y_row_stride);
    if (st != OPSMITH_STATUS_SUCCESS || rows == 0) return st;
    if (rows > 0x7fffffffLL)
        return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT, "softmax_fwd_cuda: rows (%lld) must be < 2^31",
                                     (long long)rows);
    return dispatch_float(dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto tag) {
        return fwd<decltype(tag)::value>(rows, n, x, x_row_stride, log != 0, y, y_row_stride, stream);
    });
}

extern "C" opsmith_status opsmith_softmax_bwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n, const void *dy,
                                                   int64_t dy_row_stride, const void *y, int64_t y_row_stride, int log,
                                                   void *dx, int64_t dx_row_stride, opsmith_cuda_stream stream) {
    opsmith_status st = opsmith_internal_softmax_check("softmax_bwd_cuda", dtype, rows, n, y, y_row_stride, 1, dy,
                                                       dy_row_stride, dx, dx_row_stride);
    if (st != OPSMITH_STATUS_SUCCESS || rows == 0) return st;
    if (rows > 0x7fffffffLL)
        return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT, "softmax_bwd_cuda: rows (%lld) must be < 2^31",
                                     (long long)rows);
    return dispatch_float(dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto tag) {
        return bwd<decltype(tag)::value>(rows, n, dy, dy_row_stride, y, y_row_stride, log != 0, dx, dx_row_stride,
                                         stream);
    });
}
