/* Gated activations on CUDA: elementwise and memory bound, so the whole
 * job is moving bytes: one pass, 16-byte vector loads and stores where
 * every pointer and row stride allows them (a scalar kernel otherwise),
 * enough blocks to keep every SM's memory pipe full, int64 indexing.
 *
 * Shapes: gate, up, y, dy, dgate, dup, h are (rows, n) with their own row
 * strides; the packed form is two pointers into one buffer. When every
 * operand is contiguous the rows are one long row, so no block idles on a
 * row tail. Grid: x over a row's packs (one pack a thread), y over rows
 * (looping past 65535); one row takes a kernel without either loop. Each
 * element is loaded before the same element is stored by the same thread,
 * and plain (coherent) loads are used, so an output that is exactly an
 * input (in place) is safe. */
#include <type_traits>

#include "common.cuh"
#include "internal/glu.h"

namespace opsmith {
namespace {

constexpr int kThreads = 256;

/* act(g) with its slope, in the accumulate type. */
template <int A> struct Act;

template <> struct Act<OPSMITH_GLU_ACTIVATION_SILU> {
    static __device__ __forceinline__ float value(float g, float *slope) {
        const float s = 1.0f / (1.0f + expf(-g));
        *slope = s * (1.0f + g * (1.0f - s));
        return g * s;
    }
    /* for 16-bit storage: the hardware exp and divide (about 1e-6 relative,
     * far inside a 16-bit result's rounding) shorten the per-element chain,
     * which is what a decode-sized call waits on; e^-g flushed to zero where
     * it is denormal only ever adds to 1, where it rounds away */
    static __device__ __forceinline__ float fast(float g, float *slope) {
        const float s = __fdividef(1.0f, 1.0f + ex2_ftz(-g * kLog2e));
        *slope = s * (1.0f + g * (1.0f - s));
        return g * s;
    }
    static __device__ __forceinline__ double value(double g, double *slope) {
        const double s = 1.0 / (1.0 + exp(-g));
        *slope = s * (1.0 + g * (1.0 - s));
        return g * s;
    }
};

template <> struct Act<OPSMITH_GLU_ACTIVATION_GELU> {
    static __device__ __forceinline__ float value(float g, float *slope) {
        const float cdf = 0.5f * erfcf(-g * 0.70710678118654752f);
        *slope = cdf + g * 0.39894228040143268f * expf(-0.5f * g * g);
        return g * cdf;
    }
    static __device__ __forceinline__ double value(double g, double *slope) {
        const double cdf = 0.5 * erfc(-g * 0.70710678118654752);
        *slope = cdf + g * 0.39894228040143268 * exp(-0.5 * g * g);
        return g * cdf;
    }
    /* erfc keeps the far negative tail accurate; no shortcut here */
    static __device__ __forceinline__ float fast(float g, float *slope) { return value(g, slope); }
};

template <> struct Act<OPSMITH_GLU_ACTIVATION_GELU_TANH> {
    template <typename A> static __device__ __forceinline__ A value(A g, A *slope) {
        const A k = A(0.79788456080286536), c = A(0.044715);
        const A th = tanh_acc(k * (g + c * g * g * g));
        *slope = A(0.5) * (A(1) + th) + A(0.5) * g * (A(1) - th * th) * k * (A(1) + A(3) * c * g * g);
        return A(0.5) * g * (A(1) + th);
    }
    static __device__ __forceinline__ float tanh_acc(float v) { return tanhf(v); }
    static __device__ __forceinline__ double tanh_acc(double v) { return tanh(v); }
    /* for 16-bit storage: tanh(v) = 1 - 2 / (1 + e^(2v)) on the hardware exp
     * and divide (absolute error about 1e-7; y and the slope use 1 + th and
     * 1 - th^2, so no relative error is amplified) */
    static __device__ __forceinline__ float fast(float g, float *slope) {
        const float k = 0.79788456080286536f, c = 0.044715f;
        const float th = 1.0f - __fdividef(2.0f, 1.0f + ex2_ftz(2.0f * k * (g + c * g * g * g) * kLog2e));
        *slope = 0.5f * (1.0f + th) + 0.5f * g * (1.0f - th * th) * k * (1.0f + 3.0f * c * g * g);
        return 0.5f * g * (1.0f + th);
    }
};

/* act(g) for storage type T: the fast float forms for 16-bit T. */
template <int A, typename T, typename Acc> __device__ __forceinline__ Acc act(Acc g, Acc *slope) {
    if constexpr (sizeof(T) == 2) return Act<A>::fast(g, slope);
    else return Act<A>::value(g, slope);
}

/* V elements a thread step: Pack<T>::VEC (16 bytes) or 1 (scalar path). */
template <typename T, int V> struct Chunk {
    T v[V];
};

template <typename T, int V> __device__ __forceinline__ Chunk<T, V> load_chunk(const T *p) {
    Chunk<T, V> c;
    if constexpr (V * sizeof(T) == 16) {
        *reinterpret_cast<uint4 *>(&c) = *reinterpret_cast<const uint4 *>(p);
    } else {
#pragma unroll
        for (int k = 0; k < V; k++) c.v[k] = p[k];
    }
    return c;
}

template <typename T, int V> __device__ __forceinline__ void store_chunk(T *p, const Chunk<T, V> &c) {
    if constexpr (V * sizeof(T) == 16) {
        store16(p, c.v);
    } else {
#pragma unroll
        for (int k = 0; k < V; k++) p[k] = c.v[k];
    }
}

/* One step: V elements of y = act(gate) * up. */
template <typename T, typename Acc, int A, int V>
__device__ __forceinline__ void fwd_step(const T *gate, const T *up, T *y) {
    const Chunk<T, V> g = load_chunk<T, V>(gate);
    const Chunk<T, V> u = load_chunk<T, V>(up);
    Acc gv[V], uv[V];
    unpack_n(g.v, gv), unpack_n(u.v, uv);
    Chunk<T, V> out;
#pragma unroll
    for (int k = 0; k < V; k++) {
        Acc slope;
        const Acc v = act<A, T>(gv[k], &slope);
        out.v[k] = from_acc<T>(v * uv[k]);
    }
    store_chunk<T, V>(y, out);
}

/* One step: V elements of dgate = dy * up * act'(gate), dup = dy * act(gate),
 * h = act(gate) * up (when H). */
template <typename T, typename Acc, int A, int V, bool H>
__device__ __forceinline__ void bwd_step(const T *dy, const T *gate, const T *up, T *dgate, T *dup, T *h) {
    const Chunk<T, V> d = load_chunk<T, V>(dy);
    const Chunk<T, V> g = load_chunk<T, V>(gate);
    const Chunk<T, V> u = load_chunk<T, V>(up);
    Acc dv[V], gv[V], uv[V];
    unpack_n(d.v, dv), unpack_n(g.v, gv), unpack_n(u.v, uv);
    Chunk<T, V> dg, du, hv;
#pragma unroll
    for (int k = 0; k < V; k++) {
        Acc slope;
        const Acc v = act<A, T>(gv[k], &slope);
        dg.v[k] = from_acc<T>(dv[k] * uv[k] * slope);
        du.v[k] = from_acc<T>(dv[k] * v);
        if (H) hv.v[k] = from_acc<T>(v * uv[k]);
    }
    store_chunk<T, V>(dgate, dg);
    store_chunk<T, V>(dup, du);
    if (H) store_chunk<T, V>(h, hv);
}

/* y = act(gate) * up over (rows, steps * V) elements. */
template <typename T, typename Acc, int A, int V>
__global__ void __launch_bounds__(kThreads)
glu_fwd_kernel(int64_t rows, int64_t steps, const T *gate, int64_t gs, const T *up, int64_t us, T *y,
               int64_t ys) {
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
        for (int64_t s = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; s < steps;
             s += (int64_t)gridDim.x * blockDim.x)
            fwd_step<T, Acc, A, V>(gate + r * gs + s * V, up + r * us + s * V, y + r * ys + s * V);
}

/* The same over one row (every operand contiguous, or one row) of at most
 * kThreads x 2^31 steps: a step a thread, no loop and fewer parameters, so
 * a decode-sized call's one pass starts its loads sooner (its time is the
 * chain of a thread's instructions, kernel parameters read included). */
template <typename T, typename Acc, int A, int V>
__global__ void __launch_bounds__(kThreads) glu_fwd_row_kernel(int64_t steps, const T *gate, const T *up, T *y) {
    const int64_t s = (int64_t)blockIdx.x * kThreads + threadIdx.x;
    if (s < steps) fwd_step<T, Acc, A, V>(gate + s * V, up + s * V, y + s * V);
}

template <typename T, typename Acc, int A, int V, bool H>
__global__ void __launch_bounds__(kThreads)
glu_bwd_kernel(int64_t rows, int64_t steps, const T *dy, int64_t dys, const T *gate, int64_t gs, const T *up,
               int64_t us, T *dgate, int64_t dgs, T *dup, int64_t dus, T *h, int64_t hs) {
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
        for (int64_t s = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; s < steps;
             s += (int64_t)gridDim.x * blockDim.x)
            bwd_step<T, Acc, A, V, H>(dy + r * dys + s * V, gate + r * gs + s * V, up + r * us + s * V,
                                      dgate + r * dgs + s * V, dup + r * dus + s * V, H ? h + r * hs + s * V : h);
}

template <typename T, typename Acc, int A, int V, bool H>
__global__ void __launch_bounds__(kThreads)
glu_bwd_row_kernel(int64_t steps, const T *dy, const T *gate, const T *up, T *dgate, T *dup, T *h) {
    const int64_t s = (int64_t)blockIdx.x * kThreads + threadIdx.x;
    if (s < steps)
        bwd_step<T, Acc, A, V, H>(dy + s * V, gate + s * V, up + s * V, dgate + s * V, dup + s * V,
                                  H ? h + s * V : h);
}

/* The operands of one call, and how the launch sees them. */
struct Shape {
    int64_t rows, n;
    bool vec; /* every pointer 16-byte aligned, every row stride and n whole packs */
};

/* rows x n as the kernels see it: one long row when every operand is
 * contiguous (or there is one row), and whether 16-byte steps fit. */
template <typename T>
Shape shape_of(int64_t rows, int64_t n, const void *const *ptrs, const int64_t *strides, int count) {
    constexpr int V = Pack<T>::VEC;
    bool contiguous = true;
    for (int i = 0; i < count; i++) contiguous = contiguous && (!ptrs[i] || strides[i] == n);
    Shape s = {rows, n, false};
    if (contiguous || rows == 1) s.n = rows * n, s.rows = 1;
    bool vec = true;
    for (int i = 0; i < count; i++)
        if (ptrs[i]) vec = vec && aligned16(ptrs[i]) && (s.rows == 1 || strides[i] % V == 0);
    s.vec = vec && s.n % V == 0;
    return s;
}

dim3 grid_of(int64_t rows, int64_t steps) {
    /* one step a thread, one pass: a flat grid measured 5% faster than 64
     * blocks an SM looping (bench/NOTES.md); a second dimension over rows
     * keeps the 64-bit row offset out of the per-thread arithmetic */
    const int64_t x = (steps + kThreads - 1) / kThreads;
    const int64_t max_x = 2147483647; /* past that, threads loop */
    return dim3((unsigned)(x < max_x ? x : max_x), (unsigned)(rows < kMaxGridY ? rows : kMaxGridY));
}

/* a grid of one step a thread over one row, when the row plan fits */
bool row_plan(const Shape &sh, int64_t steps) { return sh.rows == 1 && (steps + kThreads - 1) / kThreads <= 2147483647; }

template <typename T, typename Acc, int A, int V>
void fwd_launch_v(const Shape &sh, int64_t steps, const void *gate, int64_t gs, const void *up, int64_t us, void *y,
                  int64_t ys, cudaStream_t stream) {
    if (row_plan(sh, steps))
        glu_fwd_row_kernel<T, Acc, A, V><<<(unsigned)((steps + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
            steps, (const T *)gate, (const T *)up, (T *)y);
    else
        glu_fwd_kernel<T, Acc, A, V><<<grid_of(sh.rows, steps), kThreads, 0, stream>>>(
            sh.rows, steps, (const T *)gate, gs, (const T *)up, us, (T *)y, ys);
}

template <typename T, typename Acc, int A>
void fwd_launch(const Shape &sh, const void *gate, int64_t gs, const void *up, int64_t us, void *y, int64_t ys,
                cudaStream_t stream) {
    constexpr int V = Pack<T>::VEC;
    if (sh.vec) fwd_launch_v<T, Acc, A, V>(sh, sh.n / V, gate, gs, up, us, y, ys, stream);
    else fwd_launch_v<T, Acc, A, 1>(sh, sh.n, gate, gs, up, us, y, ys, stream);
}

template <typename T, typename Acc, int A, bool H, int V>
void bwd_launch_v(const Shape &sh, int64_t steps, const void *dy, int64_t dys, const void *gate, int64_t gs,
                  const void *up, int64_t us, void *dgate, int64_t dgs, void *dup, int64_t dus, void *h, int64_t hs,
                  cudaStream_t stream) {
    if (row_plan(sh, steps))
        glu_bwd_row_kernel<T, Acc, A, V, H><<<(unsigned)((steps + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
            steps, (const T *)dy, (const T *)gate, (const T *)up, (T *)dgate, (T *)dup, (T *)h);
    else
        glu_bwd_kernel<T, Acc, A, V, H><<<grid_of(sh.rows, steps), kThreads, 0, stream>>>(
            sh.rows, steps, (const T *)dy, dys, (const T *)gate, gs, (const T *)up, us, (T *)dgate, dgs,
            (T *)dup, dus, (T *)h, hs);
}

template <typename T, typename Acc, int A, bool H>
void bwd_launch(const Shape &sh, const void *dy, int64_t dys, const void *gate, int64_t gs, const void *up,
                int64_t us, void *dgate, int64_t dgs, void *dup, int64_t dus, void *h, int64_t hs,
                cudaStream_t stream) {
    constexpr int V = Pack<T>::VEC;
    if (sh.vec)
        bwd_launch_v<T, Acc, A, H, V>(sh, sh.n / V, dy, dys, gate, gs, up, us, dgate, dgs, dup, dus, h, hs, stream);
    else
        bwd_launch_v<T, Acc, A, H, 1>(sh, sh.n, dy, dys, gate, gs, up, us, dgate, dgs, dup, dus, h, hs, stream);
}

/* The one activation dispatch: f(std::integral_constant<int, A>{}). */
template <typename F> void dispatch_activation(opsmith_glu_activation a, F f) {
    switch (a) {
    case OPSMITH_GLU_ACTIVATION_SILU: f(std::integral_constant<int, OPSMITH_GLU_ACTIVATION_SILU>{}); break;
    case OPSMITH_GLU_ACTIVATION_GELU: f(std::integral_constant<int, OPSMITH_GLU_ACTIVATION_GELU>{}); break;
    default: f(std::integral_constant<int, OPSMITH_GLU_ACTIVATION_GELU_TANH>{}); break;
    }
}

} // namespace
} // namespace opsmith

extern "C" opsmith_status opsmith_glu_fwd_cuda(opsmith_glu_activation activation, opsmith_dtype dtype, int64_t rows,
                                               int64_t n, const void *gate, int64_t gate_row_stride, const void *up,
                                               int64_t up_row_stride, void *y, int64_t y_row_stride,
                                               opsmith_cuda_stream stream) {
    using namespace opsmith;
    opsmith_status s = opsmith_internal_glu_check("glu_fwd_cuda", activation, dtype, rows, n, 0, NULL, 0, gate,
                                                  gate_row_stride, up, up_row_stride, y, y_row_stride, NULL, 0,
                                                  NULL, 0);
    if (s != OPSMITH_STATUS_SUCCESS || rows == 0) return s;
    return dispatch_float(dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto tag) {
        using St = Storage<decltype(tag)::value>;
        const void *ptrs[] = {gate, up, y};
        const int64_t strides[] = {gate_row_stride, up_row_stride, y_row_stride};
        const Shape sh = shape_of<typename St::T>(rows, n, ptrs, strides, 3);
        dispatch_activation(activation, [&](auto act) {
            fwd_launch<typename St::T, typename St::Acc, decltype(act)::value>(
                sh, gate, gate_row_stride, up, up_row_stride, y, y_row_stride, (cudaStream_t)stream);
        });
        return launch_status();
    });
}

extern "C" opsmith_status opsmith_glu_bwd_cuda(opsmith_glu_activation activation, opsmith_dtype dtype, int64_t rows,
                                               int64_t n, const void *dy, int64_t dy_row_stride, const void *gate,
                                               int64_t gate_row_stride, const void *up, int64_t up_row_stride,
                                               void *dgate, int64_t dgate_row_stride, void *dup,
                                               int64_t dup_row_stride, void *h, int64_t h_row_stride,
                                               opsmith_cuda_stream stream) {
    using namespace opsmith;
    opsmith_status s = opsmith_internal_glu_check("glu_bwd_cuda", activation, dtype, rows, n, 1, dy, dy_row_stride,
                                                  gate, gate_row_stride, up, up_row_stride, dgate, dgate_row_stride,
                                                  dup, dup_row_stride, h, h_row_stride);
    if (s != OPSMITH_STATUS_SUCCESS || rows == 0) return s;
    return dispatch_float(dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto tag) {
        using St = Storage<decltype(tag)::value>;
        const void *ptrs[] = {dy, gate, up, dgate, dup, h};
        const int64_t strides[] = {dy_row_stride, gate_row_stride, up_row_stride,
                                   dgate_row_stride, dup_row_stride, h_row_stride};
        const Shape sh = shape_of<typename St::T>(rows, n, ptrs, strides, 6);
        const cudaStream_t st = (cudaStream_t)stream;
        dispatch_activation(activation, [&](auto act) {
            constexpr int A = decltype(act)::value;
            using T = typename St::T;
            using Acc = typename St::Acc;
            if (h)
                bwd_launch<T, Acc, A, true>(sh, dy, dy_row_stride, gate, gate_row_stride, up, up_row_stride, dgate,
                                            dgate_row_stride, dup, dup_row_stride, h, h_row_stride, st);
            else
                bwd_launch<T, Acc, A, false>(sh, dy, dy_row_stride, gate, gate_row_stride, up, up_row_stride, dgate,
                                             dgate_row_stride, dup, dup_row_stride, h, h_row_stride, st);
        });
        return launch_status();
    });
}
