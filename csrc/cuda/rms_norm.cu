/* RMSNorm on CUDA.
 * x, dy are (rows, n) addressed through a row stride; y, dx are (rows, n)
 * contiguous; weight, dweight are (n); inv_rms is (rows) in Acc (double for
 * f64, float otherwise).
 *
 * Three kernel families, chosen per call (fwd_launch, bwd_launch):
 * - generic: a "row group" of threads owns one row at a time — one warp
 *   when the row is short, the whole block when it is long — and reads it
 *   twice; any stride, alignment or width (16-byte packs where every
 *   pointer, stride and n allow it, PACKED, else one element at a time);
 * - resident: packed rows held in registers, one block a row, so x (and
 *   dy) are read once; the forward's kernel, and the backward's for a short
 *   batch;
 * - staged (backward, many rows): rows streamed through shared memory
 *   several rows ahead with cp.async, a row split over a cluster of CTAs
 *   when it is wider than one CTA's share of shared memory.
 * The weight gradient is reduced without float atomics, so it is
 * deterministic: each block (cluster) sums its rows into its own workspace
 * row with a fixed column-to-thread map, then one or two reduction launches
 * add the rows in a fixed order. */
#include "internal/rms_norm.h"
#include "launch_plan.cuh"
#include "partial_sums.cuh"
#include "row_pipeline.cuh"
#include "rows.cuh"

namespace opsmith {
namespace {

template <typename T, typename A, bool PACKED, bool WARP_ROWS>
__global__ void rms_norm_fwd_kernel(int64_t rows, int64_t n, const T *__restrict__ x, int64_t xs,
                                    const T *__restrict__ w, A eps, T *__restrict__ y, int64_t ys,
                                    A *__restrict__ inv_rms) {
    constexpr int S = Step<T, PACKED>::N;
    __shared__ A scratch[32];
    const RowGroup<WARP_ROWS> g;
    const int64_t steps = n / S;
    for (int64_t r = g.first_row(); r < rows; r += g.row_step()) {
        const T *xr = x + r * xs;
        T *yr = y + r * ys;
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
                                    const A *__restrict__ inv_rms, T *__restrict__ dx, int64_t dxs,
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
        T *dxr = dx + r * dxs;
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

template <typename T, typename A, int ITERS>
__global__ void __launch_bounds__(kResidentThreads)
rms_norm_fwd_resident_kernel(int64_t rows, int64_t n, const T *__restrict__ x, int64_t xs,
                             const T *__restrict__ w, A eps, T *__restrict__ y, int64_t ys,
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
            store_pack(y + r * ys + i * S, out);
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
                             const A *__restrict__ inv_rms, T *__restrict__ dx, int64_t dxs,
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
            store_pack(dx + r * dxs + i * S, out);
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

/* Staged kernel: the backward's path for packed rows when there are many
 * more rows than SMs. A block (or a cluster of CTAS CTAs, each owning a 1/CTAS
 * slice of the columns) streams rows through a ring of kStages row stages in
 * shared memory, filled by cp.async kStages - 1 rows ahead (row_pipeline.cuh):
 * the next rows' bytes stay in flight while the block waits at its reduction
 * and writes the current row, and they take no registers. A thread owns the
 * same packs of every row, so the weight sits in its registers and so do
 * its weight-gradient sums. */
constexpr int kStages = 3;

/* Shifts the row pointers to this CTA's slice and names its rows: cluster
 * c of the grid takes rows c, c + clusters, ... */
template <int CTAS> struct Slice {
    int64_t steps, col0, first, stride;
    int rank;
    __device__ Slice(int64_t n, int S) {
        rank = cluster_rank<CTAS>();
        steps = n / CTAS / S;
        col0 = rank * (n / CTAS);
        first = blockIdx.x / CTAS;
        stride = gridDim.x / CTAS;
    }
};

/* partial is (clusters, n): cluster c's sum of dy * x * inv_rms over its rows. */
template <typename T, typename A, int ITERS, int CTAS>
__global__ void __launch_bounds__(kResidentThreads)
rms_norm_bwd_staged_kernel(int64_t rows, int64_t n, const T *__restrict__ dy, int64_t dys,
                           const T *__restrict__ x, int64_t xs, const T *__restrict__ w,
                           const A *__restrict__ inv_rms, T *__restrict__ dx, int64_t dxs,
                           A *__restrict__ partial) {
    constexpr int S = Pack<T>::VEC;
    extern __shared__ __align__(16) unsigned char dynamic_smem[];
    const RowRing<T, kStages, 2, ITERS> ring{reinterpret_cast<Pack<T> *>(dynamic_smem)};
    __shared__ A scratch[32], cluster_slots[2 * CTAS];
    __shared__ uint64_t cluster_barriers[2];
    ClusterSum<CTAS, A> cluster{cluster_slots, cluster_barriers};
    cluster.init();
    const Slice<CTAS> sl(n, S);
    x += sl.col0;
    dy += sl.col0;
    dx += sl.col0;
    Pack<T> wp[ITERS];
    if (w) for_my_packs<ITERS>(sl.steps, [&](int it, int64_t i) { wp[it] = load_pack(w + sl.col0 + i * S); });
    A dw[ITERS][S];
#pragma unroll
    for (int it = 0; it < ITERS; it++)
#pragma unroll
        for (int k = 0; k < S; k++) dw[it][k] = 0;
    auto issue = [&](int64_t r, int stage) {
        if (r < rows)
            for_my_packs<ITERS>(sl.steps, [&](int it, int64_t i) {
                cp_async16(&ring.at(stage, 0, it), x + r * xs + i * S);
                cp_async16(&ring.at(stage, 1, it), dy + r * dys + i * S);
            });
        cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < kStages - 1; s++) issue(sl.first + s * sl.stride, s);
    int stage = 0;
    for (int64_t r = sl.first; r < rows; r += sl.stride) {
        issue(r + (kStages - 1) * sl.stride, stage == 0 ? kStages - 1 : stage - 1);
        const A inv = inv_rms[r];
        cp_async_wait<kStages - 1>();
        A dot = 0;
        for_my_packs<ITERS>(sl.steps, [&](int it, int64_t) {
            const Pack<T> xv = ring.at(stage, 0, it), gv = ring.at(stage, 1, it);
#pragma unroll
            for (int k = 0; k < S; k++)
                dot += to_acc(gv.v[k]) * (w ? to_acc(wp[it].v[k]) : A(1)) * to_acc(xv.v[k]);
        });
        dot = cluster.sum(block_sum(dot, scratch));
        const A scale = inv * inv * inv * dot / (A)n;
        for_my_packs<ITERS>(sl.steps, [&](int it, int64_t i) {
            const Pack<T> xv = ring.at(stage, 0, it), gv = ring.at(stage, 1, it);
            Pack<T> out;
#pragma unroll
            for (int k = 0; k < S; k++) {
                const A g = to_acc(gv.v[k]), xa = to_acc(xv.v[k]);
                out.v[k] = from_acc<T>(inv * g * (w ? to_acc(wp[it].v[k]) : A(1)) - xa * scale);
                if (partial) dw[it][k] += g * xa * inv;
            }
            store_pack(dx + r * dxs + i * S, out);
        });
        stage = stage + 1 == kStages ? 0 : stage + 1;
    }
    cp_async_wait<0>();
    if (partial) {
        A *pr = partial + sl.first * n + sl.col0;
        for_my_packs<ITERS>(sl.steps, [&](int it, int64_t i) {
#pragma unroll
            for (int k = 0; k < S; k++) pr[i * S + k] = dw[it][k];
        });
    }
    cluster.finish();
}


/* Row groups the backward uses when it reduces dweight: bounded so the
 * workspace stays small (at most 2^23 partial elements, 32 MB in f32). */
int64_t bwd_max_groups(int64_t rows, int64_t n) {
    int64_t cap = ((int64_t)1 << 23) / n;
    if (cap < 32) cap = 32;
    if (cap > 512) cap = 512;
    return rows < cap ? rows : cap;
}


constexpr int kFwdMinThreads = 64, kBwdMinThreads = 128;

template <typename T, typename A> using FwdResidentKernel =
    void (*)(int64_t, int64_t, const T *, int64_t, const T *, A, T *, int64_t, A *);
template <typename T, typename A> using BwdResidentKernel =
    void (*)(int64_t, int64_t, const T *, int64_t, const T *, int64_t, const T *, const A *, T *, int64_t, A *);

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

template <typename T, typename A> BwdResidentKernel<T, A> bwd_staged_kernel(int iters, int ctas) {
    switch (ctas) {
    case 1: return iters == 1 ? rms_norm_bwd_staged_kernel<T, A, 1, 1>
                 : iters == 2 ? rms_norm_bwd_staged_kernel<T, A, 2, 1>
                              : rms_norm_bwd_staged_kernel<T, A, 4, 1>;
    case 2: return rms_norm_bwd_staged_kernel<T, A, 4, 2>;
    case 4: return rms_norm_bwd_staged_kernel<T, A, 4, 4>;
    default: return rms_norm_bwd_staged_kernel<T, A, 4, 8>;
    }
}

/* Staged plan for packed rows of n elements of T, `tensors` streamed a row
 * (x and dy for the backward). A CTA's slice of a row is at most kSliceBytes
 * a tensor, so kStages stages of it fit in one SM's shared memory (192 KB
 * at the largest slice); wider rows are split over a cluster of 2, 4 or 8
 * CTAs (sm_90). */
constexpr size_t kSliceBytes = 32 << 10;

constexpr int kStagedMinThreads = 64;
constexpr int64_t kStagedMinRowsPerBlock = 4;

template <typename T> Launch staged_plan(int64_t n, int tensors, int *iters, int *ctas) {
    Launch l{nullptr, 0, 0, 0, 0, "staged"};
    DeviceInfo d;
    int device;
    const int64_t vec = Pack<T>::VEC;
    int c = 1;
    while ((size_t)n * sizeof(T) > kSliceBytes * c && c < 8) c *= 2;
    if ((size_t)n * sizeof(T) > kSliceBytes * c || n % (c * vec) != 0 || !device_info(&d, &device) ||
        (c > 1 && d.major < 9))
        return l;
    const Resident plan = resident_plan(n / c / vec, kStagedMinThreads, false, 4);
    if (!plan.iters || (c > 1 && plan.iters != 4)) return l;
    *iters = plan.iters;
    *ctas = c;
    l.threads = plan.threads;
    l.ctas = c;
    l.smem = (size_t)kStages * tensors * plan.iters * plan.threads * sizeof(Pack<T>); /* the RowRing */
    return l;
}

template <typename T, typename A> Launch bwd_staged_launch(int64_t rows, int64_t n) {
    int iters = 0, ctas = 0;
    Launch l = staged_plan<T>(n, 2, &iters, &ctas);
    if (!l.threads) return l;
    l.kernel = reinterpret_cast<const void *>(bwd_staged_kernel<T, A>(iters, ctas));
    return fit_grid(l, rows);
}

/* The resident backward (a short batch): its plan, and the shared memory
 * for the weight-gradient sums. */
template <typename T, typename A> Launch bwd_resident_launch(int64_t rows, int64_t n, bool with_dw) {
    Launch l{nullptr, 0, 1, 0, 0, "resident"};
    const int64_t vec = Pack<T>::VEC;
    if (n % vec != 0) return l;
    const Resident plan = resident_plan(n / vec, kBwdMinThreads, rows <= sm_count(), kResidentIters);
    if (!plan.iters) return l;
    l.kernel = reinterpret_cast<const void *>(bwd_resident_kernel<T, A>(plan.iters));
    l.threads = plan.threads;
    l.smem = with_dw ? (size_t)n * sizeof(A) : 0;
    return fit_grid(l, rows);
}

/* Backward plan for packed rows: a short batch (no more rows than SMs) takes
 * the resident kernel, one memory round trip a row; many rows the staged
 * kernel, then the resident one; grid == 0: the generic kernel. */
template <typename T, typename A> Launch bwd_launch(int64_t rows, int64_t n, bool with_dw) {
    const int sms = sm_count();
    if (rows > sms) {
        Launch l = bwd_staged_launch<T, A>(rows, n);
        /* at least kStagedMinRowsPerBlock rows a block (or cluster) while the
         * grid still covers every SM: each block writes a weight-gradient
         * partial row of n floats, which at one or two rows a block costs
         * more traffic than the rows themselves (1024 x 4096 bf16: 28.4 ->
         * 26.1 us; large shapes unchanged) */
        int64_t cap = (rows + kStagedMinRowsPerBlock - 1) / kStagedMinRowsPerBlock;
        if (cap < sms) cap = sms;
        if (l.grid && l.grid / l.ctas > cap) l.grid = cap * l.ctas;
        /* just over one row an SM, the ring has nothing to overlap and the
         * resident kernel is faster (140 x 4096: 17.3 against 19.2 us) */
        if (l.grid && (l.ctas > 1 || rows >= 2 * (int64_t)sms)) return l;
    }
    return bwd_resident_launch<T, A>(rows, n, with_dw);
}

/* Forward plans for packed rows, chosen at run time: a short batch takes the
 * resident kernel's latency plan; many rows the resident throughput plan up
 * to 4 packs a thread (512 x 4 packs); grid == 0: the generic kernel, which
 * for many wider rows beat a staged forward split over a cluster (2048 x
 * 32768 bf16: 0.89 against 0.76 of copy; bench/NOTES.md v4). */
template <typename T, typename A> Launch fwd_launch(int64_t rows, int64_t n) {
    const int64_t vec = Pack<T>::VEC;
    if (n % vec != 0) return Launch{nullptr, 0, 0, 0, 0, "generic"};
    const bool latency = rows <= sm_count();
    const Resident res = resident_plan(n / vec, kFwdMinThreads, latency, latency ? kResidentIters : 4);
    if (res.iters) {
        const int64_t grid = rows < kMaxGrid ? rows : kMaxGrid;
        return Launch{reinterpret_cast<const void *>(fwd_resident_kernel<T, A>(res.iters)), res.threads, 1, 0,
                      grid, "resident"};
    }
    return Launch{nullptr, 0, 0, 0, 0, "generic"};
}

template <opsmith_dtype D>
opsmith_status fwd(int64_t rows, int64_t n, const void *x, int64_t xs, const void *w, double eps,
                   void *y, int64_t ys, void *inv_rms, cudaStream_t stream) {
    using T = typename Storage<D>::T;
    using A = typename Storage<D>::Acc;
    const int vec = Pack<T>::VEC;
    const bool packed = n % vec == 0 && xs % vec == 0 && ys % vec == 0 && aligned16(x) && aligned16(y) &&
                        (!w || aligned16(w));
    const T *xp = static_cast<const T *>(x), *wp = static_cast<const T *>(w);
    T *yp = static_cast<T *>(y);
    A *ip = static_cast<A *>(inv_rms);
    const Launch l = packed ? fwd_launch<T, A>(rows, n) : Launch{nullptr, 0, 0, 0, 0, "generic"};
    if (l.grid) {
        launch<FwdResidentKernel<T, A>>(l, stream, rows, n, xp, xs, wp, (A)eps, yp, ys, ip);
        return launch_status();
    }
    const Shape s = choose_shape(rows, n, packed ? vec : 1, kMaxGrid);
#define OPSMITH_LAUNCH_FWD(P, WR) \
    rms_norm_fwd_kernel<T, A, P, WR><<<(unsigned)s.grid, s.threads, 0, stream>>>(rows, n, xp, xs, wp, (A)eps, yp, ys, ip)
    if (packed) { if (s.warp_rows) OPSMITH_LAUNCH_FWD(true, true); else OPSMITH_LAUNCH_FWD(true, false); }
    else { if (s.warp_rows) OPSMITH_LAUNCH_FWD(false, true); else OPSMITH_LAUNCH_FWD(false, false); }
#undef OPSMITH_LAUNCH_FWD
    return launch_status();
}

template <opsmith_dtype D>
opsmith_status bwd(int64_t rows, int64_t n, const void *dy, int64_t dys, const void *x, int64_t xs,
                   const void *w, const void *inv_rms, void *dx, int64_t dxs, void *dw, void *workspace,
                   cudaStream_t stream) {
    using T = typename Storage<D>::T;
    using A = typename Storage<D>::Acc;
    const int vec = Pack<T>::VEC;
    const bool packed = n % vec == 0 && xs % vec == 0 && dys % vec == 0 && dxs % vec == 0 && aligned16(x) &&
                        aligned16(dy) && aligned16(dx) && (!w || aligned16(w));
    const T *dyp = static_cast<const T *>(dy), *xp = static_cast<const T *>(x),
            *wp = static_cast<const T *>(w);
    const A *ip = static_cast<const A *>(inv_rms);
    T *dxp = static_cast<T *>(dx);
    A *partial = dw ? static_cast<A *>(workspace) : nullptr;
    int64_t parts;
    const Launch l = packed ? bwd_launch<T, A>(rows, n, dw != nullptr) : Launch{nullptr, 0, 0, 0, 0, "generic"};
    if (l.grid) {
        parts = l.grid / l.ctas;
        launch<BwdResidentKernel<T, A>>(l, stream, rows, n, dyp, dys, xp, xs, wp, ip, dxp, dxs, partial);
    } else {
    const Shape s = choose_shape(rows, n, packed ? vec : 1, bwd_max_groups(rows, n));
    parts = s.groups;
#define OPSMITH_LAUNCH_BWD(P, WR) \
    rms_norm_bwd_kernel<T, A, P, WR><<<(unsigned)s.grid, s.threads, 0, stream>>>(rows, n, dyp, dys, xp, xs, wp, ip, dxp, dxs, partial)
    if (packed) { if (s.warp_rows) OPSMITH_LAUNCH_BWD(true, true); else OPSMITH_LAUNCH_BWD(true, false); }
    else { if (s.warp_rows) OPSMITH_LAUNCH_BWD(false, true); else OPSMITH_LAUNCH_BWD(false, false); }
#undef OPSMITH_LAUNCH_BWD
    }
    opsmith_status st = launch_status();
    if (st != OPSMITH_STATUS_SUCCESS || !dw) return st;
    sum_partial_rows<T, A>(parts, n, partial, partial + parts * n, static_cast<T *>(dw), stream);
    return launch_status();
}

/* Workspace rows the backward may use for dweight: partial rows (the most
 * any of its kernels writes) and the two-pass reduction's chunk sums. */
template <opsmith_dtype D> int64_t bwd_workspace_rows(int64_t rows, int64_t n) {
    using T = typename Storage<D>::T;
    using A = typename Storage<D>::Acc;
    const Shape a = choose_shape(rows, n, Pack<T>::VEC, bwd_max_groups(rows, n));
    const Shape b = choose_shape(rows, n, 1, bwd_max_groups(rows, n));
    int64_t parts = a.groups > b.groups ? a.groups : b.groups;
    const Launch l = bwd_launch<T, A>(rows, n, true);
    if (l.grid && l.grid / l.ctas > parts) parts = l.grid / l.ctas;
    return parts + reduce_chunks(parts);
}

} // namespace
} // namespace opsmith

using namespace opsmith;

extern "C" opsmith_status opsmith_rms_norm_fwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n, const void *x,
                                                    int64_t x_row_stride, const void *weight, double eps, void *y,
                                                    int64_t y_row_stride, void *inv_rms, opsmith_cuda_stream stream) {
    opsmith_status st = opsmith_internal_rms_norm_check("rms_norm_fwd_cuda", dtype, rows, n, x, x_row_stride, 0,
                                                        nullptr, 0, weight, eps, y, y_row_stride, inv_rms, nullptr);
    if (st != OPSMITH_STATUS_SUCCESS || rows == 0) return st;
    return dispatch_float(dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto tag) {
        return fwd<decltype(tag)::value>(rows, n, x, x_row_stride, weight, eps, y, y_row_stride, inv_rms, stream);
    });
}

/* Which kernel family a contiguous, 16-byte aligned call of this shape
 * takes on the current device: "resident", "staged" (with the CTAs a row
 * in ctas), or "generic". Tests use it to keep each plan reachable. */
extern "C" const char *opsmith_internal_rms_norm_cuda_plan(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                           int backward, int *ctas) {
    const Launch none{nullptr, 0, 0, 0, 0, "generic"};
    Launch l = dispatch_float(dtype, none, [&](auto tag) {
        using T = typename Storage<decltype(tag)::value>::T;
        using A = typename Storage<decltype(tag)::value>::Acc;
        return backward ? bwd_launch<T, A>(rows, n, true) : fwd_launch<T, A>(rows, n);
    });
    if (l.grid <= 0) l.family = "generic", l.ctas = 0;
    if (ctas) *ctas = l.ctas;
    return l.family;
}

extern "C" size_t opsmith_rms_norm_bwd_cuda_workspace_size(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                           const void *dy, int64_t dy_row_stride, const void *x,
                                                           int64_t x_row_stride, const void *weight,
                                                           const void *inv_rms, void *dx, int64_t dx_row_stride,
                                                           void *dweight) {
    (void)dy, (void)dy_row_stride, (void)x, (void)x_row_stride, (void)inv_rms, (void)dx, (void)dx_row_stride;
    if (!weight || !dweight || rows <= 0 || n <= 0) return 0;
    const int64_t groups = dispatch_float(dtype, (int64_t)0, [&](auto tag) {
        return bwd_workspace_rows<decltype(tag)::value>(rows, n);
    });
    return (size_t)(groups * n) * opsmith_dtype_size(opsmith_dtype_accumulate(dtype));
}

extern "C" opsmith_status opsmith_rms_norm_bwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n, const void *dy,
                                                    int64_t dy_row_stride, const void *x, int64_t x_row_stride,
                                                    const void *weight, const void *inv_rms, void *dx,
                                                    int64_t dx_row_stride, void *dweight, void *workspace,
                                                    size_t workspace_bytes, opsmith_cuda_stream stream) {
    static const char op[] = "rms_norm_bwd_cuda";
    void *dw = weight ? dweight : nullptr;
    opsmith_status st = opsmith_internal_rms_norm_check(op, dtype, rows, n, x, x_row_stride, 1, dy, dy_row_stride,
                                                        weight, 0.0, dx, dx_row_stride, inv_rms, dw);
    if (st != OPSMITH_STATUS_SUCCESS) return st;
    if (rows == 0) {
        /* no rows: the weight gradient is an empty sum */
        if (dw && cudaMemsetAsync(dw, 0, (size_t)n * opsmith_dtype_size(dtype), stream) != cudaSuccess)
            return launch_status();
        return OPSMITH_STATUS_SUCCESS;
    }
    st = opsmith_internal_check_workspace(op, workspace, workspace_bytes,
                                          opsmith_rms_norm_bwd_cuda_workspace_size(dtype, rows, n, dy, dy_row_stride, x,
                                                                                   x_row_stride, weight, inv_rms, dx,
                                                                                   dx_row_stride, dw));
    if (st != OPSMITH_STATUS_SUCCESS) return st;
    return dispatch_float(dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto tag) {
        return bwd<decltype(tag)::value>(rows, n, dy, dy_row_stride, x, x_row_stride, weight, inv_rms, dx,
                                         dx_row_stride, dw, workspace, stream);
    });
}
