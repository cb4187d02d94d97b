/* RMSNorm on CUDA.
 * x, dy are (rows, n) addressed through a row stride; y, dx are (rows, n)
 * contiguous; weight, dweight are (n); inv_rms is (rows) in Acc (double for
 * f64, float otherwise).
 *
 * Layout of the work: a "row group" of threads owns one row at a time —
 * one warp when the row is short (many rows per block), the whole block
 * when it is long. Each row is read in 16-byte packs when every pointer,
 * stride and n allow it (PACKED), else one element at a time.
 * The weight gradient is reduced without float atomics, so it is
 * deterministic: each block sums its rows into its own workspace row with
 * a fixed column-to-thread map, then a second kernel adds the block rows in
 * order. */
#include "common.cuh"

namespace opsmith {
namespace {

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
        Pack<T> pk = load_pack(p);
#pragma unroll
        for (int k = 0; k < Pack<T>::VEC; k++) out[k] = to_acc(pk.v[k]);
    } else {
        out[0] = to_acc(p[0]);
    }
}

template <typename T, typename A, bool PACKED>
__device__ __forceinline__ void store_acc(T *p, const A (&in)[Step<T, PACKED>::N]) {
    if constexpr (PACKED) {
        Pack<T> pk;
#pragma unroll
        for (int k = 0; k < Pack<T>::VEC; k++) pk.v[k] = from_acc<T>(in[k]);
        store_pack(p, pk);
    } else {
        p[0] = from_acc<T>(in[0]);
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

template <typename T, typename A, bool PACKED, bool WARP_ROWS>
__global__ void rms_norm_fwd_kernel(int64_t rows, int64_t n, const T *__restrict__ x, int64_t xs,
                                    const T *__restrict__ w, A eps, T *__restrict__ y,
                                    A *__restrict__ inv_rms) {
    constexpr int S = Step<T, PACKED>::N;
    __shared__ A scratch[32];
    const RowGroup<WARP_ROWS> g;
    const int64_t steps = n / S;
    for (int64_t r = g.first_row(); r < rows; r += g.row_step()) {
        const T *xr = x + r * xs;
        T *yr = y + r * n;
        A sum_sq = 0;
        OPSMITH_UNROLL_4
        for (int64_t i = g.t; i < steps; i += g.threads) {
            A v[S];
            load_acc<T, A, PACKED>(xr + i * S, v);
#pragma unroll
            for (int k = 0; k < S; k++) sum_sq += v[k] * v[k];
        }
        sum_sq = group_sum<WARP_ROWS>(sum_sq, scratch);
        const A inv = rsqrt_acc(sum_sq / (A)n + eps);
        if (g.t == 0) inv_rms[r] = inv;
        OPSMITH_UNROLL_4
        for (int64_t i = g.t; i < steps; i += g.threads) {
            A v[S];
            load_acc<T, A, PACKED>(xr + i * S, v);
            if (w) {
                A wv[S];
                load_acc<T, A, PACKED>(w + i * S, wv);
#pragma unroll
                for (int k = 0; k < S; k++) v[k] = v[k] * inv * wv[k];
            } else {
#pragma unroll
                for (int k = 0; k < S; k++) v[k] = v[k] * inv;
            }
            store_acc<T, A, PACKED>(yr + i * S, v);
        }
    }
}

/* dx for the block's rows; when partial is non-NULL, also the block's
 * weight-gradient partial sums, partial is (gridDim.x, n). */
template <typename T, typename A, bool PACKED, bool WARP_ROWS>
__global__ void rms_norm_bwd_kernel(int64_t rows, int64_t n, const T *__restrict__ dy, int64_t dys,
                                    const T *__restrict__ x, int64_t xs, const T *__restrict__ w,
                                    const A *__restrict__ inv_rms, T *__restrict__ dx,
                                    A *__restrict__ partial) {
    constexpr int S = Step<T, PACKED>::N;
    __shared__ A scratch[32];
    const RowGroup<WARP_ROWS> g;
    const int64_t steps = n / S;
    /* With warp rows, each warp keeps its own partial row: partial is
     * (gridDim.x * groups_per_block, n). */
    A *my_partial = partial ? partial + g.first_row() * n : nullptr;
    bool first = true;
    for (int64_t r = g.first_row(); r < rows; r += g.row_step()) {
        const T *xr = x + r * xs, *dyr = dy + r * dys;
        T *dxr = dx + r * n;
        const A inv = inv_rms[r];
        A dot = 0;
        OPSMITH_UNROLL_4
        for (int64_t i = g.t; i < steps; i += g.threads) {
            A xv[S], gv[S];
            load_acc<T, A, PACKED>(xr + i * S, xv);
            load_acc<T, A, PACKED>(dyr + i * S, gv);
            if (w) {
                A wv[S];
                load_acc<T, A, PACKED>(w + i * S, wv);
#pragma unroll
                for (int k = 0; k < S; k++) gv[k] *= wv[k];
            }
#pragma unroll
            for (int k = 0; k < S; k++) dot += gv[k] * xv[k];
        }
        dot = group_sum<WARP_ROWS>(dot, scratch);
        const A scale = inv * inv * inv * dot / (A)n;
        OPSMITH_UNROLL_4
        for (int64_t i = g.t; i < steps; i += g.threads) {
            A xv[S], dv[S], out[S];
            load_acc<T, A, PACKED>(xr + i * S, xv);
            load_acc<T, A, PACKED>(dyr + i * S, dv);
            if (w) {
                A wv[S];
                load_acc<T, A, PACKED>(w + i * S, wv);
#pragma unroll
                for (int k = 0; k < S; k++) out[k] = inv * dv[k] * wv[k] - xv[k] * scale;
            } else {
#pragma unroll
                for (int k = 0; k < S; k++) out[k] = inv * dv[k] - xv[k] * scale;
            }
            store_acc<T, A, PACKED>(dxr + i * S, out);
            if (my_partial) {
                /* only this thread ever touches these columns of this row */
#pragma unroll
                for (int k = 0; k < S; k++) {
                    A c = dv[k] * xv[k] * inv;
                    my_partial[i * S + k] = first ? c : my_partial[i * S + k] + c;
                }
            }
        }
        first = false;
    }
    if (my_partial && first) {
        /* this row group had no row: its partial row must still read as zero */
        for (int64_t i = g.t; i < n; i += g.threads) my_partial[i] = 0;
    }
}

/* Register-resident kernels: the packed path for rows of at most
 * kResidentThreads x kResidentIters packs. A block owns one row at a time;
 * each thread keeps its ITERS packs of the row in registers, so x (and dy)
 * are read from memory exactly once. */
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

template <typename T, typename A, int ITERS>
__global__ void __launch_bounds__(kResidentThreads)
rms_norm_fwd_resident_kernel(int64_t rows, int64_t n, const T *__restrict__ x, int64_t xs,
                             const T *__restrict__ w, A eps, T *__restrict__ y,
                             A *__restrict__ inv_rms) {
    constexpr int S = Pack<T>::VEC;
    __shared__ A scratch[32];
    const int64_t steps = n / S;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = x + r * xs;
        Pack<T> xp[ITERS], wp[ITERS];
        A sum_sq = 0;
        /* with few packs a thread (the plan for a short batch), the weight is
         * loaded with x, before the reduction, so the row waits for one round
         * of memory latency, not two; with many it would cost the registers
         * that keep more of x in flight, and it is an L1 hit later anyway */
        constexpr bool kWeightEarly = ITERS <= 2;
        for_my_packs<ITERS>(steps, [&](int it, int64_t i) {
            xp[it] = load_pack(xr + i * S);
            if (kWeightEarly && w) wp[it] = load_pack(w + i * S);
        });
        for_my_packs<ITERS>(steps, [&](int it, int64_t) {
#pragma unroll
            for (int k = 0; k < S; k++) {
                const A v = to_acc(xp[it].v[k]);
                sum_sq += v * v;
            }
        });
        sum_sq = block_sum(sum_sq, scratch);
        const A inv = rsqrt_acc(sum_sq / (A)n + eps);
        if (threadIdx.x == 0) inv_rms[r] = inv;
        for_my_packs<ITERS>(steps, [&](int it, int64_t i) {
            opaque(xp[it]);
            if (!kWeightEarly && w) wp[it] = load_pack(w + i * S);
            Pack<T> out;
#pragma unroll
            for (int k = 0; k < S; k++) {
                const A v = to_acc(xp[it].v[k]) * inv;
                out.v[k] = from_acc<T>(w ? v * to_acc(wp[it].v[k]) : v);
            }
            store_pack(y + r * n + i * S, out);
        });
    }
}

/* partial is (gridDim.x, n): block b's sum of dy * x * inv_rms over its rows.
 * The block keeps that sum in dynamic shared memory (n values of A, column
 * i*S+k at k*steps+i so a warp's accesses hit distinct banks); each thread
 * owns its columns there, so no barrier guards them, and registers stay free
 * for the row's packs. */
template <typename T, typename A, int ITERS>
__global__ void __launch_bounds__(kResidentThreads)
rms_norm_bwd_resident_kernel(int64_t rows, int64_t n, const T *__restrict__ dy, int64_t dys,
                             const T *__restrict__ x, int64_t xs, const T *__restrict__ w,
                             const A *__restrict__ inv_rms, T *__restrict__ dx,
                             A *__restrict__ partial) {
    constexpr int S = Pack<T>::VEC;
    extern __shared__ __align__(16) unsigned char dynamic_smem[];
    A *const dw_sum = reinterpret_cast<A *>(dynamic_smem);
    __shared__ A scratch[32];
    const int64_t steps = n / S;
    if (partial)
        for_my_packs<ITERS>(steps, [&](int, int64_t i) {
#pragma unroll
            for (int k = 0; k < S; k++) dw_sum[k * steps + i] = 0;
        });
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = x + r * xs, *dyr = dy + r * dys;
        Pack<T> xp[ITERS], dp[ITERS], wp[ITERS];
        /* as in the forward: inv_rms, and the weight when few packs a thread,
         * are loaded with the row, so a short batch waits on memory once */
        constexpr bool kWeightEarly = ITERS <= 2;
        const A inv = inv_rms[r];
        for_my_packs<ITERS>(steps, [&](int it, int64_t i) {
            xp[it] = load_pack(xr + i * S);
            dp[it] = load_pack(dyr + i * S);
            if (kWeightEarly && w) wp[it] = load_pack(w + i * S);
        });
        A dot = 0;
        for_my_packs<ITERS>(steps, [&](int it, int64_t i) {
            if (w) {
                const Pack<T> wv = kWeightEarly ? wp[it] : load_pack(w + i * S);
#pragma unroll
                for (int k = 0; k < S; k++)
                    dot += to_acc(dp[it].v[k]) * to_acc(wv.v[k]) * to_acc(xp[it].v[k]);
            } else {
#pragma unroll
                for (int k = 0; k < S; k++) dot += to_acc(dp[it].v[k]) * to_acc(xp[it].v[k]);
            }
        });
        dot = block_sum(dot, scratch);
        const A scale = inv * inv * inv * dot / (A)n;
        for_my_packs<ITERS>(steps, [&](int it, int64_t i) {
            opaque(xp[it]);
            opaque(dp[it]);
            /* with many packs a thread the weight is loaded again (an L1 hit)
             * rather than held across the reduction: holding it took 64 ->
             * 83 registers at 4 packs (bf16), 6 blocks an SM instead of 8 */
            Pack<T> wv;
            if (w && kWeightEarly) opaque(wp[it]), wv = wp[it];
            else if (w) wv = load_pack(w + i * S);
            Pack<T> out;
#pragma unroll
            for (int k = 0; k < S; k++) {
                const A g = to_acc(dp[it].v[k]), xv = to_acc(xp[it].v[k]);
                out.v[k] = from_acc<T>(inv * g * (w ? to_acc(wv.v[k]) : A(1)) - xv * scale);
                if (partial) dw_sum[k * steps + i] += g * xv * inv;
            }
            store_pack(dx + r * n + i * S, out);
        });
    }
    if (partial) {
        A *pr = partial + (int64_t)blockIdx.x * n;
        for_my_packs<ITERS>(steps, [&](int, int64_t i) {
#pragma unroll
            for (int k = 0; k < S; k++) pr[i * S + k] = dw_sum[k * steps + i];
        });
    }
}

/* dweight[i] = sum over the partial rows, in a fixed order (deterministic).
 * A block covers 32 columns; its 8 thread rows each sum every 8th partial
 * row (coalesced 32-wide reads), then one thread row adds the 8 results. */
constexpr int kReduceCols = 32, kReduceSlices = 8;

template <typename T, typename A>
__global__ void rms_norm_dweight_kernel(int64_t parts, int64_t n, const A *__restrict__ partial,
                                        T *__restrict__ dweight) {
    __shared__ A tile[kReduceSlices][kReduceCols + 1];
    const int64_t col = (int64_t)blockIdx.x * kReduceCols + threadIdx.x;
    A s = 0;
    if (col < n)
        for (int64_t p = threadIdx.y; p < parts; p += kReduceSlices) s += partial[p * n + col];
    tile[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < n) {
        A total = 0;
#pragma unroll
        for (int k = 0; k < kReduceSlices; k++) total += tile[k][threadIdx.x];
        dweight[col] = from_acc<T>(total);
    }
}

/* Launch shape shared by forward and backward. */
struct Shape {
    bool warp_rows; /* one warp per row (short rows) or one block per row */
    int threads;
    int64_t grid;
    int64_t groups; /* row groups in the grid: partial rows for dweight */
};

Shape choose_shape(int64_t rows, int64_t n, int step, int64_t max_groups) {
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

/* Row groups the backward uses when it reduces dweight: bounded so the
 * workspace stays small (at most 2^23 partial elements, 32 MB in f32). */
int64_t bwd_max_groups(int64_t rows, int64_t n) {
    int64_t cap = ((int64_t)1 << 23) / n;
    if (cap < 32) cap = 32;
    if (cap > 512) cap = 512;
    return rows < cap ? rows : cap;
}

int sm_count(void) {
    int device = 0, sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms < 1) {
        cudaGetLastError(); /* leave no error behind for the next launch check */
        return 132;
    }
    return sms;
}

/* The register-resident plan for a packed row of `steps` packs: ITERS packs
 * a thread and a block of `threads`; iters == 0 when the row is too wide.
 * Throughput (many rows): up to 4 packs a thread while a block keeps at
 * least min_threads, so an SM holds many short blocks and many bytes in
 * flight (8 packs a thread take so many registers that fewer bytes are in
 * flight per SM, `-Xptxas -v` in bench/NOTES.md). Latency (a short batch,
 * no more rows than SMs): the widest block and fewest packs a thread, so a
 * row costs about one round of memory latency. Either way rows wider than
 * kResidentThreads x ITERS packs take more ITERS, up to max_iters. */
struct Resident {
    int iters;
    int threads;
};

Resident resident_plan(int64_t steps, int min_threads, bool latency, int max_iters) {
    if (steps < 1 || steps > (int64_t)kResidentThreads * max_iters) return Resident{0, 0};
    int iters = 1;
    if (!latency) {
        iters = 4;
        while (iters > 1 && (steps + iters - 1) / iters < min_threads) iters /= 2;
    }
    while (steps > (int64_t)kResidentThreads * iters) iters *= 2;
    int64_t t = (steps + iters - 1) / iters;
    t = (t + 31) / 32 * 32;
    return Resident{iters, (int)t};
}

constexpr int kFwdMinThreads = 64, kBwdMinThreads = 128;

template <typename T, typename A> using FwdResidentKernel =
    void (*)(int64_t, int64_t, const T *, int64_t, const T *, A, T *, A *);
template <typename T, typename A> using BwdResidentKernel =
    void (*)(int64_t, int64_t, const T *, int64_t, const T *, int64_t, const T *, const A *, T *, A *);

template <typename T, typename A> FwdResidentKernel<T, A> fwd_resident_kernel(int iters) {
    switch (iters) {
    case 1: return rms_norm_fwd_resident_kernel<T, A, 1>;
    case 2: return rms_norm_fwd_resident_kernel<T, A, 2>;
    case 4: return rms_norm_fwd_resident_kernel<T, A, 4>;
    default: return rms_norm_fwd_resident_kernel<T, A, 8>;
    }
}

template <typename T, typename A> BwdResidentKernel<T, A> bwd_resident_kernel(int iters) {
    switch (iters) {
    case 1: return rms_norm_bwd_resident_kernel<T, A, 1>;
    case 2: return rms_norm_bwd_resident_kernel<T, A, 2>;
    case 4: return rms_norm_bwd_resident_kernel<T, A, 4>;
    default: return rms_norm_bwd_resident_kernel<T, A, 8>;
    }
}

/* The resident backward's launch: its plan, the shared memory for the
 * weight-gradient sums, and a grid of as many blocks as fit on the device at
 * once (each block then walks rows / grid rows; a second wave of blocks
 * would only add a tail), at most one a row. The grid is the number of
 * partial rows, so it is fixed for a device, rows, n and dtype, and so is
 * the order dweight is summed in. grid == 0: take the generic kernel. */
struct BwdLaunch {
    Resident plan;
    size_t smem;
    int64_t grid;
};

template <typename T, typename A> BwdLaunch bwd_resident_launch(int64_t rows, int64_t n, bool with_dw) {
    BwdLaunch l{Resident{0, 0}, 0, 0};
    const int64_t vec = Pack<T>::VEC;
    if (n % vec != 0) return l;
    const int sms = sm_count();
    l.plan = resident_plan(n / vec, kBwdMinThreads, rows <= sms, kResidentIters);
    if (!l.plan.iters) return l;
    l.smem = with_dw ? (size_t)n * sizeof(A) : 0;
    int device = 0, optin = 0, per_sm = 0;
    const BwdResidentKernel<T, A> k = bwd_resident_kernel<T, A>(l.plan.iters);
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
        l.smem > (size_t)optin ||
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)l.smem) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, l.plan.threads, l.smem) != cudaSuccess ||
        per_sm < 1) {
        cudaGetLastError(); /* the generic kernel is taken; leave no error behind */
        return BwdLaunch{Resident{0, 0}, 0, 0};
    }
    const int64_t g = (int64_t)sms * per_sm;
    l.grid = rows < g ? rows : g;
    return l;
}

template <opsmith_dtype D>
opsmith_status fwd(int64_t rows, int64_t n, const void *x, int64_t xs, const void *w, double eps,
                   void *y, void *inv_rms, cudaStream_t stream) {
    using T = typename Storage<D>::T;
    using A = typename Storage<D>::Acc;
    const int vec = Pack<T>::VEC;
    const bool packed = n % vec == 0 && xs % vec == 0 && aligned16(x) && aligned16(y) &&
                        (!w || aligned16(w));
    const T *xp = static_cast<const T *>(x), *wp = static_cast<const T *>(w);
    T *yp = static_cast<T *>(y);
    A *ip = static_cast<A *>(inv_rms);
    /* a forward over many wide rows reads them twice through L1/L2 in the
     * generic kernel instead of holding them: 8 packs a thread would leave
     * one 512-thread block an SM (measured 0.71 of copy at 2048 x 32768 bf16
     * against the generic kernel's 0.78) */
    const bool latency = rows <= sm_count();
    const Resident res = packed ? resident_plan(n / vec, kFwdMinThreads, latency,
                                                latency ? kResidentIters : 4)
                                : Resident{0, 0};
    if (res.iters) {
        const unsigned grid = (unsigned)(rows < kMaxGrid ? rows : kMaxGrid);
        fwd_resident_kernel<T, A>(res.iters)<<<grid, res.threads, 0, stream>>>(rows, n, xp, xs, wp,
                                                                                (A)eps, yp, ip);
        return launch_status();
    }
    const Shape s = choose_shape(rows, n, packed ? vec : 1, kMaxGrid);
#define OPSMITH_LAUNCH_FWD(P, WR) \
    rms_norm_fwd_kernel<T, A, P, WR><<<(unsigned)s.grid, s.threads, 0, stream>>>(rows, n, xp, xs, wp, (A)eps, yp, ip)
    if (packed) { if (s.warp_rows) OPSMITH_LAUNCH_FWD(true, true); else OPSMITH_LAUNCH_FWD(true, false); }
    else { if (s.warp_rows) OPSMITH_LAUNCH_FWD(false, true); else OPSMITH_LAUNCH_FWD(false, false); }
#undef OPSMITH_LAUNCH_FWD
    return launch_status();
}

template <opsmith_dtype D>
opsmith_status bwd(int64_t rows, int64_t n, const void *dy, int64_t dys, const void *x, int64_t xs,
                   const void *w, const void *inv_rms, void *dx, void *dw, void *workspace,
                   cudaStream_t stream) {
    using T = typename Storage<D>::T;
    using A = typename Storage<D>::Acc;
    const int vec = Pack<T>::VEC;
    const bool packed = n % vec == 0 && xs % vec == 0 && dys % vec == 0 && aligned16(x) &&
                        aligned16(dy) && aligned16(dx) && (!w || aligned16(w));
    const T *dyp = static_cast<const T *>(dy), *xp = static_cast<const T *>(x),
            *wp = static_cast<const T *>(w);
    const A *ip = static_cast<const A *>(inv_rms);
    T *dxp = static_cast<T *>(dx);
    A *partial = dw ? static_cast<A *>(workspace) : nullptr;
    int64_t parts;
    const BwdLaunch res = packed ? bwd_resident_launch<T, A>(rows, n, dw != nullptr)
                                 : BwdLaunch{Resident{0, 0}, 0, 0};
    if (res.grid) {
        parts = res.grid;
        bwd_resident_kernel<T, A>(res.plan.iters)<<<(unsigned)parts, res.plan.threads, res.smem, stream>>>(
            rows, n, dyp, dys, xp, xs, wp, ip, dxp, partial);
    } else {
    const Shape s = choose_shape(rows, n, packed ? vec : 1, bwd_max_groups(rows, n));
    parts = s.groups;
#define OPSMITH_LAUNCH_BWD(P, WR) \
    rms_norm_bwd_kernel<T, A, P, WR><<<(unsigned)s.grid, s.threads, 0, stream>>>(rows, n, dyp, dys, xp, xs, wp, ip, dxp, partial)
    if (packed) { if (s.warp_rows) OPSMITH_LAUNCH_BWD(true, true); else OPSMITH_LAUNCH_BWD(true, false); }
    else { if (s.warp_rows) OPSMITH_LAUNCH_BWD(false, true); else OPSMITH_LAUNCH_BWD(false, false); }
#undef OPSMITH_LAUNCH_BWD
    }
    opsmith_status st = launch_status();
    if (st != OPSMITH_STATUS_SUCCESS || !dw) return st;
    const int64_t grid = (n + kReduceCols - 1) / kReduceCols;
    rms_norm_dweight_kernel<T, A><<<(unsigned)grid, dim3(kReduceCols, kReduceSlices), 0, stream>>>(
        parts, n, partial, static_cast<T *>(dw));
    return launch_status();
}

/* Partial rows the backward may write for dweight: the larger of the
 * generic kernel's (packed or element path) and the resident kernel's. */
template <opsmith_dtype D> int64_t bwd_partial_rows(int64_t rows, int64_t n) {
    using T = typename Storage<D>::T;
    using A = typename Storage<D>::Acc;
    const Shape a = choose_shape(rows, n, Pack<T>::VEC, bwd_max_groups(rows, n));
    const Shape b = choose_shape(rows, n, 1, bwd_max_groups(rows, n));
    int64_t groups = a.groups > b.groups ? a.groups : b.groups;
    const int64_t g = bwd_resident_launch<T, A>(rows, n, true).grid;
    return g > groups ? g : groups;
}

} // namespace
} // namespace opsmith

using namespace opsmith;

extern "C" int opsmith_has_cuda(void) { return 1; }

extern "C" opsmith_status opsmith_rms_norm_fwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                    const void *x, int64_t x_row_stride,
                                                    const void *weight, double eps, void *y,
                                                    void *inv_rms, opsmith_cuda_stream stream) {
    opsmith_status st = opsmith_internal_rms_norm_check(dtype, rows, n, x, x_row_stride, 0, nullptr, 0,
                                                        weight, eps, y, inv_rms, nullptr);
    if (st != OPSMITH_STATUS_SUCCESS || rows == 0) return st;
    switch (dtype) {
    case OPSMITH_DTYPE_F64: return fwd<OPSMITH_DTYPE_F64>(rows, n, x, x_row_stride, weight, eps, y, inv_rms, stream);
    case OPSMITH_DTYPE_F32: return fwd<OPSMITH_DTYPE_F32>(rows, n, x, x_row_stride, weight, eps, y, inv_rms, stream);
    case OPSMITH_DTYPE_F16: return fwd<OPSMITH_DTYPE_F16>(rows, n, x, x_row_stride, weight, eps, y, inv_rms, stream);
    case OPSMITH_DTYPE_BF16: return fwd<OPSMITH_DTYPE_BF16>(rows, n, x, x_row_stride, weight, eps, y, inv_rms, stream);
    default: return OPSMITH_STATUS_UNSUPPORTED_DTYPE;
    }
}

extern "C" size_t opsmith_rms_norm_bwd_cuda_workspace_size(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                           int with_dweight) {
    if (!with_dweight || rows <= 0 || n <= 0 || (unsigned)dtype >= OPSMITH_DTYPE_COUNT) return 0;
    int64_t groups;
    switch (dtype) {
    case OPSMITH_DTYPE_F64: groups = bwd_partial_rows<OPSMITH_DTYPE_F64>(rows, n); break;
    case OPSMITH_DTYPE_F32: groups = bwd_partial_rows<OPSMITH_DTYPE_F32>(rows, n); break;
    case OPSMITH_DTYPE_F16: groups = bwd_partial_rows<OPSMITH_DTYPE_F16>(rows, n); break;
    default: groups = bwd_partial_rows<OPSMITH_DTYPE_BF16>(rows, n); break;
    }
    return (size_t)(groups * n) * opsmith_dtype_size(opsmith_dtype_accumulate(dtype));
}

extern "C" opsmith_status opsmith_rms_norm_bwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                    const void *dy, int64_t dy_row_stride,
                                                    const void *x, int64_t x_row_stride,
                                                    const void *weight, const void *inv_rms,
                                                    void *dx, void *dweight, void *workspace,
                                                    size_t workspace_bytes,
                                                    opsmith_cuda_stream stream) {
    opsmith_status st = opsmith_internal_rms_norm_check(dtype, rows, n, x, x_row_stride, 1, dy,
                                                        dy_row_stride, weight, 0.0, dx, inv_rms,
                                                        weight ? dweight : nullptr);
    if (st != OPSMITH_STATUS_SUCCESS) return st;
    void *dw = weight ? dweight : nullptr;
    if (rows == 0) {
        /* no rows: the weight gradient is an empty sum */
        if (dw && cudaMemsetAsync(dw, 0, (size_t)n * opsmith_dtype_size(dtype), stream) != cudaSuccess)
            return launch_status();
        return OPSMITH_STATUS_SUCCESS;
    }
    if (dw) {
        if (workspace_bytes < opsmith_rms_norm_bwd_cuda_workspace_size(dtype, rows, n, 1))
            return OPSMITH_STATUS_WORKSPACE_TOO_SMALL;
        if (!workspace || !aligned16(workspace)) return OPSMITH_STATUS_MISALIGNED;
    }
    switch (dtype) {
    case OPSMITH_DTYPE_F64:
        return bwd<OPSMITH_DTYPE_F64>(rows, n, dy, dy_row_stride, x, x_row_stride, weight, inv_rms, dx, dw, workspace, stream);
    case OPSMITH_DTYPE_F32:
        return bwd<OPSMITH_DTYPE_F32>(rows, n, dy, dy_row_stride, x, x_row_stride, weight, inv_rms, dx, dw, workspace, stream);
    case OPSMITH_DTYPE_F16:
        return bwd<OPSMITH_DTYPE_F16>(rows, n, dy, dy_row_stride, x, x_row_stride, weight, inv_rms, dx, dw, workspace, stream);
    case OPSMITH_DTYPE_BF16:
        return bwd<OPSMITH_DTYPE_BF16>(rows, n, dy, dy_row_stride, x, x_row_stride, weight, inv_rms, dx, dw, workspace, stream);
    default: return OPSMITH_STATUS_UNSUPPORTED_DTYPE;
    }
}
