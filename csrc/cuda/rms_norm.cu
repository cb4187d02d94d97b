/* RMSNorm on CUDA.
 * x, dy, y, dx are (rows, n) addressed through row strides; weight,
 * dweight are (n); inv_rms is (rows) in A (double for f64, float otherwise).
 * Every kernel is a template over the storage types of the three tensor
 * roles (common.cuh's Types): T for x and dx, W for weight and dweight, Y
 * for y and dy; a pack of x (Pack<T>::VEC elements) is read with the same
 * number of elements of W and Y (Elems), so a wider dtype takes two packs.
 * The options (offset, LLAMA casting) are run-time arguments in Opts.
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
#include "norm_plan.cuh"
#include "partial_sums.cuh"

namespace opsmith {
namespace {

/* The options every kernel takes: w' = offset + weight, and whether x_hat
 * is rounded to x's dtype before the weight multiply (LLAMA). */
template <typename A> struct Opts {
    A offset;
    bool llama;
};

/* x_hat = x * inv, rounded through T under LLAMA */
template <typename T, typename A> __device__ __forceinline__ A x_hat(A x, A inv, const Opts<A> &o) {
    const A h = x * inv;
    return o.llama ? to_acc(from_acc<T>(h)) : h;
}

template <typename T, typename W, typename Y, typename A, bool PACKED, bool WARP_ROWS>
__global__ void rms_norm_fwd_kernel(int64_t rows, int64_t n, const T *__restrict__ x, int64_t xs,
                                    const W *__restrict__ w, Opts<A> o, A eps, Y *__restrict__ y, int64_t ys,
                                    A *__restrict__ inv_rms) {
    constexpr int S = Step<T, PACKED>::N;
    __shared__ A scratch[32];
    const RowGroup<WARP_ROWS> g;
    const int64_t steps = n / S;
    for (int64_t r = g.first_row(); r < rows; r += g.row_step()) {
        const T *xr = x + r * xs;
        Y *yr = y + r * ys;
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
                load_n<W, A, S>(w + i * S, wv);
#pragma unroll
                for (int k = 0; k < S; k++) v[k] = x_hat<T>(v[k], inv, o) * (o.offset + wv[k]);
            } else {
#pragma unroll
                for (int k = 0; k < S; k++) v[k] = x_hat<T>(v[k], inv, o);
            }
            store_n<Y, A, S>(yr + i * S, v);
        }
    }
}

/* dx for the block's rows; when partial is non-NULL, also the block's
 * weight-gradient partial sums, partial is (gridDim.x, n). */
template <typename T, typename W, typename Y, typename A, bool PACKED, bool WARP_ROWS>
__global__ void rms_norm_bwd_kernel(int64_t rows, int64_t n, const Y *__restrict__ dy, int64_t dys,
                                    const T *__restrict__ x, int64_t xs, const W *__restrict__ w, Opts<A> o,
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
        const T *xr = x + r * xs;
        const Y *dyr = dy + r * dys;
        T *dxr = dx + r * dxs;
        const A inv = inv_rms[r];
        A dot = 0;
        OPSMITH_UNROLL_4
        for (int64_t i = g.t; i < steps; i += g.threads) {
            A xv[S], gv[S];
            load_acc<T, A, PACKED>(xr + i * S, xv);
            load_n<Y, A, S>(dyr + i * S, gv);
            if (w) {
                A wv[S];
                load_n<W, A, S>(w + i * S, wv);
#pragma unroll
                for (int k = 0; k < S; k++) gv[k] *= o.offset + wv[k];
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
            load_n<Y, A, S>(dyr + i * S, dv);
            if (w) {
                A wv[S];
                load_n<W, A, S>(w + i * S, wv);
#pragma unroll
                for (int k = 0; k < S; k++) out[k] = inv * dv[k] * (o.offset + wv[k]) - xv[k] * scale;
            } else {
#pragma unroll
                for (int k = 0; k < S; k++) out[k] = inv * dv[k] - xv[k] * scale;
            }
            store_acc<T, A, PACKED>(dxr + i * S, out);
            if (my_partial) {
                /* only this thread ever touches these columns of this row */
#pragma unroll
                for (int k = 0; k < S; k++) {
                    A c = dv[k] * x_hat<T>(xv[k], inv, o);
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

template <typename T, typename W, typename Y, typename A, int ITERS>
__global__ void __launch_bounds__(kResidentThreads)
rms_norm_fwd_resident_kernel(int64_t rows, int64_t n, const T *__restrict__ x, int64_t xs,
                             const W *__restrict__ w, Opts<A> o, A eps, Y *__restrict__ y, int64_t ys,
                             A *__restrict__ inv_rms) {
    constexpr int S = Pack<T>::VEC;
    __shared__ A scratch[32];
    const int64_t steps = n / S;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = x + r * xs;
        Pack<T> xp[ITERS];
        Elems<W, S> wp[ITERS];
        A sum_sq = 0;
        /* with few packs a thread (the plan for a short batch), the weight is
         * loaded with x, before the reduction, so the row waits for one round
         * of memory latency, not two; with many it would cost the registers
         * that keep more of x in flight, and it is an L1 hit later anyway */
        constexpr bool kWeightEarly = ITERS <= 2;
        for_my_packs<ITERS>(steps, [&](int it, int64_t i) {
            xp[it] = load_pack(xr + i * S);
            if (kWeightEarly && w) wp[it] = load_elems<W, S>(w + i * S);
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
            if (!kWeightEarly && w) wp[it] = load_elems<W, S>(w + i * S);
            Elems<Y, S> out;
#pragma unroll
            for (int k = 0; k < S; k++) {
                const A v = x_hat<T>(to_acc(xp[it].v[k]), inv, o);
                out.v[k] = from_acc<Y>(w ? v * (o.offset + to_acc(wp[it].v[k])) : v);
            }
            store_elems<Y, S>(y + r * ys + i * S, out);
        });
    }
}

/* partial is (gridDim.x, n): block b's sum of dy * x * inv_rms over its rows.
 * The block keeps that sum in dynamic shared memory (n values of A, column
 * i*S+k at k*steps+i so a warp's accesses hit distinct banks); each thread
 * owns its columns there, so no barrier guards them, and registers stay free
 * for the row's packs. */
template <typename T, typename W, typename Y, typename A, int ITERS>
__global__ void __launch_bounds__(kResidentThreads)
rms_norm_bwd_resident_kernel(int64_t rows, int64_t n, const Y *__restrict__ dy, int64_t dys,
                             const T *__restrict__ x, int64_t xs, const W *__restrict__ w, Opts<A> o,
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
        const T *xr = x + r * xs;
        const Y *dyr = dy + r * dys;
        Pack<T> xp[ITERS];
        Elems<Y, S> dp[ITERS];
        Elems<W, S> wp[ITERS];
        /* as in the forward: inv_rms, and the weight when few packs a thread,
         * are loaded with the row, so a short batch waits on memory once */
        constexpr bool kWeightEarly = ITERS <= 2;
        const A inv = inv_rms[r];
        for_my_packs<ITERS>(steps, [&](int it, int64_t i) {
            xp[it] = load_pack(xr + i * S);
            dp[it] = load_elems<Y, S>(dyr + i * S);
            if (kWeightEarly && w) wp[it] = load_elems<W, S>(w + i * S);
        });
        A dot = 0;
        for_my_packs<ITERS>(steps, [&](int it, int64_t i) {
            if (w) {
                const Elems<W, S> wv = kWeightEarly ? wp[it] : load_elems<W, S>(w + i * S);
#pragma unroll
                for (int k = 0; k < S; k++)
                    dot += to_acc(dp[it].v[k]) * (o.offset + to_acc(wv.v[k])) * to_acc(xp[it].v[k]);
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
            Elems<W, S> wv;
            if (w && kWeightEarly) opaque(wp[it]), wv = wp[it];
            else if (w) wv = load_elems<W, S>(w + i * S);
            Pack<T> out;
#pragma unroll
            for (int k = 0; k < S; k++) {
                const A g = to_acc(dp[it].v[k]), xv = to_acc(xp[it].v[k]);
                out.v[k] = from_acc<T>(inv * g * (w ? o.offset + to_acc(wv.v[k]) : A(1)) - xv * scale);
                if (partial) dw_sum[k * steps + i] += g * x_hat<T>(xv, inv, o);
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

/* A row of dy takes kUnits<T, Y> ring slots of 16 bytes a pack of x. */
template <typename T, typename Y> constexpr int kUnits = (int)(sizeof(Y) / sizeof(T));

/* partial is (clusters, n): cluster c's sum of dy * x_hat over its rows. */
template <typename T, typename W, typename Y, typename A, int ITERS, int CTAS>
__global__ void __launch_bounds__(kResidentThreads)
rms_norm_bwd_staged_kernel(int64_t rows, int64_t n, const Y *__restrict__ dy, int64_t dys,
                           const T *__restrict__ x, int64_t xs, const W *__restrict__ w, Opts<A> o,
                           const A *__restrict__ inv_rms, T *__restrict__ dx, int64_t dxs,
                           A *__restrict__ partial) {
    constexpr int S = Pack<T>::VEC, U = kUnits<T, Y>;
    extern __shared__ __align__(16) unsigned char dynamic_smem[];
    /* ring slot 0 holds x's pack, slots 1..U the same elements of dy */
    const RowRing<T, kStages, 1 + U, ITERS> ring{reinterpret_cast<Pack<T> *>(dynamic_smem)};
    __shared__ A scratch[32], cluster_slots[2 * CTAS];
    __shared__ uint64_t cluster_barriers[2];
    ClusterSum<CTAS, A> cluster{cluster_slots, cluster_barriers};
    cluster.init();
    const Slice<CTAS> sl(n, S);
    x += sl.col0;
    dy += sl.col0;
    dx += sl.col0;
    Elems<W, S> wp[ITERS];
    if (w) for_my_packs<ITERS>(sl.steps, [&](int it, int64_t i) { wp[it] = load_elems<W, S>(w + sl.col0 + i * S); });
    A dw[ITERS][S];
#pragma unroll
    for (int it = 0; it < ITERS; it++)
#pragma unroll
        for (int k = 0; k < S; k++) dw[it][k] = 0;
    auto issue = [&](int64_t r, int stage) {
        if (r < rows)
            for_my_packs<ITERS>(sl.steps, [&](int it, int64_t i) {
                cp_async16(&ring.at(stage, 0, it), x + r * xs + i * S);
#pragma unroll
                for (int u = 0; u < U; u++) cp_async16(&ring.at(stage, 1 + u, it), dy + r * dys + i * S + u * (S / U));
            });
        cp_async_commit();
    };
    auto dy_at = [&](int stage, int it) {
        Elems<Y, S> e;
#pragma unroll
        for (int u = 0; u < U; u++) reinterpret_cast<Pack<T> *>(&e)[u] = ring.at(stage, 1 + u, it);
        return e;
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
            const Pack<T> xv = ring.at(stage, 0, it);
            const Elems<Y, S> gv = dy_at(stage, it);
#pragma unroll
            for (int k = 0; k < S; k++)
                dot += to_acc(gv.v[k]) * (w ? o.offset + to_acc(wp[it].v[k]) : A(1)) * to_acc(xv.v[k]);
        });
        dot = cluster.sum(block_sum(dot, scratch));
        const A scale = inv * inv * inv * dot / (A)n;
        for_my_packs<ITERS>(sl.steps, [&](int it, int64_t i) {
            const Pack<T> xv = ring.at(stage, 0, it);
            const Elems<Y, S> gv = dy_at(stage, it);
            Pack<T> out;
#pragma unroll
            for (int k = 0; k < S; k++) {
                const A g = to_acc(gv.v[k]), xa = to_acc(xv.v[k]);
                out.v[k] = from_acc<T>(inv * g * (w ? o.offset + to_acc(wp[it].v[k]) : A(1)) - xa * scale);
                if (partial) dw[it][k] += g * x_hat<T>(xa, inv, o);
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


/* the generic backward's partial rows (one weight gradient: at most 2^23 partial elements, 32 MB in f32) */
int64_t bwd_max_groups(int64_t rows, int64_t n) { return partial_row_groups(rows, n, (int64_t)1 << 23); }


/* K is a Types<T, W, Y> bundle (common.cuh): the kernels' storage types. */
template <typename K> using AccK = typename AccOf<typename K::T>::type;

template <typename K> using FwdResidentKernel =
    void (*)(int64_t, int64_t, const typename K::T *, int64_t, const typename K::W *, Opts<AccK<K>>, AccK<K>,
             typename K::Y *, int64_t, AccK<K> *);
template <typename K> using BwdResidentKernel =
    void (*)(int64_t, int64_t, const typename K::Y *, int64_t, const typename K::T *, int64_t,
             const typename K::W *, Opts<AccK<K>>, const AccK<K> *, typename K::T *, int64_t, AccK<K> *);

template <typename K> FwdResidentKernel<K> fwd_resident_kernel(int iters) {
    using T = typename K::T;
    using W = typename K::W;
    using Y = typename K::Y;
    using A = AccK<K>;
    switch (iters) {
    case 1: return rms_norm_fwd_resident_kernel<T, W, Y, A, 1>;
    case 2: return rms_norm_fwd_resident_kernel<T, W, Y, A, 2>;
    case 4: return rms_norm_fwd_resident_kernel<T, W, Y, A, 4>;
    default: return rms_norm_fwd_resident_kernel<T, W, Y, A, 8>;
    }
}

template <typename K> BwdResidentKernel<K> bwd_resident_kernel(int iters) {
    using T = typename K::T;
    using W = typename K::W;
    using Y = typename K::Y;
    using A = AccK<K>;
    switch (iters) {
    case 1: return rms_norm_bwd_resident_kernel<T, W, Y, A, 1>;
    case 2: return rms_norm_bwd_resident_kernel<T, W, Y, A, 2>;
    case 4: return rms_norm_bwd_resident_kernel<T, W, Y, A, 4>;
    default: return rms_norm_bwd_resident_kernel<T, W, Y, A, 8>;
    }
}

template <typename K> BwdResidentKernel<K> bwd_staged_kernel(int iters, int ctas) {
    using T = typename K::T;
    using W = typename K::W;
    using Y = typename K::Y;
    using A = AccK<K>;
    switch (ctas) {
    case 1: return iters == 1 ? rms_norm_bwd_staged_kernel<T, W, Y, A, 1, 1>
                 : iters == 2 ? rms_norm_bwd_staged_kernel<T, W, Y, A, 2, 1>
                              : rms_norm_bwd_staged_kernel<T, W, Y, A, 4, 1>;
    case 2: return rms_norm_bwd_staged_kernel<T, W, Y, A, 4, 2>;
    case 4: return rms_norm_bwd_staged_kernel<T, W, Y, A, 4, 4>;
    default: return rms_norm_bwd_staged_kernel<T, W, Y, A, 4, 8>;
    }
}

template <typename K> Launch bwd_staged_launch(int64_t rows, int64_t n) {
    int iters = 0, ctas = 0;
    Launch l = staged_plan<typename K::T>(n, 1 + kUnits<typename K::T, typename K::Y>, &iters, &ctas);
    if (!l.threads) return l;
    l.kernel = reinterpret_cast<const void *>(bwd_staged_kernel<K>(iters, ctas));
    return fit_grid(l, rows);
}

/* The resident backward (a short batch): its plan, and the shared memory
 * for the weight-gradient sums. */
template <typename K> Launch bwd_resident_launch(int64_t rows, int64_t n, bool with_dw) {
    using T = typename K::T;
    Launch l{nullptr, 0, 1, 0, 0, "resident"};
    const int64_t vec = Pack<T>::VEC;
    if (n % vec != 0) return l;
    const Resident plan = resident_plan(n / vec, kBwdMinThreads, rows <= sm_count(), kResidentIters);
    if (!plan.iters) return l;
    l.kernel = reinterpret_cast<const void *>(bwd_resident_kernel<K>(plan.iters));
    l.threads = plan.threads;
    l.smem = with_dw ? (size_t)n * sizeof(AccK<K>) : 0;
    return fit_grid(l, rows);
}

/* Backward plan for packed rows: a short batch (no more rows than SMs) takes
 * the resident kernel, one memory round trip a row; many rows the staged
 * kernel, then the resident one; grid == 0: the generic kernel. */
template <typename K> Launch bwd_launch(int64_t rows, int64_t n, bool with_dw) {
    const int sms = sm_count();
    if (rows > sms) {
        const Launch l = keep_staged(bwd_staged_launch<K>(rows, n), rows, sms);
        if (l.grid) return l;
    }
    return bwd_resident_launch<K>(rows, n, with_dw);
}

/* Forward plans for packed rows, chosen at run time: a short batch takes the
 * resident kernel's latency plan; many rows the resident throughput plan up
 * to 4 packs a thread (512 x 4 packs); grid == 0: the generic kernel, which
 * for many wider rows beat a staged forward split over a cluster (2048 x
 * 32768 bf16: 0.89 against 0.76 of copy; bench/NOTES.md v4). */
template <typename K> Launch fwd_launch(int64_t rows, int64_t n) {
    const int64_t vec = Pack<typename K::T>::VEC;
    if (n % vec != 0) return Launch{nullptr, 0, 0, 0, 0, "generic"};
    const bool latency = rows <= sm_count();
    const Resident res = resident_plan(n / vec, kFwdMinThreads, latency, latency ? kResidentIters : 4);
    if (res.iters) {
        const int64_t grid = rows < kMaxGrid ? rows : kMaxGrid;
        return Launch{reinterpret_cast<const void *>(fwd_resident_kernel<K>(res.iters)), res.threads, 1, 0, grid,
                      "resident"};
    }
    return Launch{nullptr, 0, 0, 0, 0, "generic"};
}

template <typename K>
opsmith_status fwd(int64_t rows, int64_t n, const void *x, int64_t xs, const void *w, Opts<AccK<K>> o, double eps,
                   void *y, int64_t ys, void *inv_rms, cudaStream_t stream) {
    using T = typename K::T;
    using W = typename K::W;
    using Y = typename K::Y;
    using A = AccK<K>;
    const int vec = Pack<T>::VEC;
    const bool packed = packed_ok(n, vec, {xs, ys}, {x, y, w});
    const T *xp = static_cast<const T *>(x);
    const W *wp = static_cast<const W *>(w);
    Y *yp = static_cast<Y *>(y);
    A *ip = static_cast<A *>(inv_rms);
    const Launch l = packed ? fwd_launch<K>(rows, n) : Launch{nullptr, 0, 0, 0, 0, "generic"};
    if (l.grid) {
        launch<FwdResidentKernel<K>>(l, stream, rows, n, xp, xs, wp, o, (A)eps, yp, ys, ip);
        return launch_status();
    }
    const Shape s = choose_shape(rows, n, packed ? vec : 1, kMaxGrid);
#define OPSMITH_LAUNCH_FWD(P, WR)                                                                       \
    rms_norm_fwd_kernel<T, W, Y, A, P, WR><<<(unsigned)s.grid, s.threads, 0, stream>>>(rows, n, xp, xs, wp, o, \
                                                                                     (A)eps, yp, ys, ip)
    if (packed) { if (s.warp_rows) OPSMITH_LAUNCH_FWD(true, true); else OPSMITH_LAUNCH_FWD(true, false); }
    else { if (s.warp_rows) OPSMITH_LAUNCH_FWD(false, true); else OPSMITH_LAUNCH_FWD(false, false); }
#undef OPSMITH_LAUNCH_FWD
    return launch_status();
}

template <typename K>
opsmith_status bwd(int64_t rows, int64_t n, const void *dy, int64_t dys, const void *x, int64_t xs, const void *w,
                   Opts<AccK<K>> o, const void *inv_rms, void *dx, int64_t dxs, void *dw, void *workspace,
                   cudaStream_t stream) {
    using T = typename K::T;
    using W = typename K::W;
    using Y = typename K::Y;
    using A = AccK<K>;
    const int vec = Pack<T>::VEC;
    const bool packed = packed_ok(n, vec, {xs, dys, dxs}, {x, dy, dx, w});
    const Y *dyp = static_cast<const Y *>(dy);
    const T *xp = static_cast<const T *>(x);
    const W *wp = static_cast<const W *>(w);
    const A *ip = static_cast<const A *>(inv_rms);
    T *dxp = static_cast<T *>(dx);
    A *partial = dw ? static_cast<A *>(workspace) : nullptr;
    int64_t parts;
    const Launch l = packed ? bwd_launch<K>(rows, n, dw != nullptr) : Launch{nullptr, 0, 0, 0, 0, "generic"};
    if (l.grid) {
        parts = l.grid / l.ctas;
        launch<BwdResidentKernel<K>>(l, stream, rows, n, dyp, dys, xp, xs, wp, o, ip, dxp, dxs, partial);
    } else {
        const Shape s = choose_shape(rows, n, packed ? vec : 1, bwd_max_groups(rows, n));
        parts = s.groups;
#define OPSMITH_LAUNCH_BWD(P, WR)                                                                          \
    rms_norm_bwd_kernel<T, W, Y, A, P, WR><<<(unsigned)s.grid, s.threads, 0, stream>>>(rows, n, dyp, dys, xp, xs, \
                                                                                     wp, o, ip, dxp, dxs, partial)
        if (packed) { if (s.warp_rows) OPSMITH_LAUNCH_BWD(true, true); else OPSMITH_LAUNCH_BWD(true, false); }
        else { if (s.warp_rows) OPSMITH_LAUNCH_BWD(false, true); else OPSMITH_LAUNCH_BWD(false, false); }
#undef OPSMITH_LAUNCH_BWD
    }
    opsmith_status st = launch_status();
    if (st != OPSMITH_STATUS_SUCCESS || !dw) return st;
    sum_partial_rows<W, A>(parts, n, partial, partial + parts * n, static_cast<W *>(dw), stream);
    return launch_status();
}

/* Workspace rows the backward may use for dweight: partial rows (the most
 * any of its kernels writes) and the two-pass reduction's chunk sums. */
template <typename K> int64_t bwd_workspace_rows(int64_t rows, int64_t n) {
    const Shape a = choose_shape(rows, n, Pack<typename K::T>::VEC, bwd_max_groups(rows, n));
    const Shape b = choose_shape(rows, n, 1, bwd_max_groups(rows, n));
    int64_t parts = a.groups > b.groups ? a.groups : b.groups;
    const Launch l = bwd_launch<K>(rows, n, true);
    if (l.grid && l.grid / l.ctas > parts) parts = l.grid / l.ctas;
    return parts + reduce_chunks(parts);
}

/* the weight's dtype the kernels are picked by: without a weight, the
 * accumulate type (which also pairs f16/bf16 x with an f32 y) */
opsmith_dtype kernel_weight_dtype(opsmith_dtype x_dtype, opsmith_dtype weight_dtype, const void *weight) {
    return weight ? weight_dtype : opsmith_dtype_accumulate(x_dtype);
}

} // namespace
} // namespace opsmith

using namespace opsmith;

extern "C" opsmith_status opsmith_rms_norm_ex_fwd_cuda(opsmith_dtype x_dtype, opsmith_dtype weight_dtype,
                                                       opsmith_dtype y_dtype, int64_t rows, int64_t n, const void *x,
                                                       int64_t x_row_stride, const void *weight, double offset,
                                                       double eps, opsmith_rms_norm_casting casting, void *y,
                                                       int64_t y_row_stride, void *inv_rms,
                                                       opsmith_cuda_stream stream) {
    weight_dtype = kernel_weight_dtype(x_dtype, weight_dtype, weight);
    opsmith_status st = opsmith_internal_rms_norm_check("rms_norm_fwd_cuda", x_dtype, weight_dtype, y_dtype, rows, n,
                                                        x, x_row_stride, 0, nullptr, 0, weight, offset, eps, casting,
                                                        y, y_row_stride, inv_rms, nullptr);
    if (st != OPSMITH_STATUS_SUCCESS || rows == 0) return st;
    const bool llama = casting == OPSMITH_RMS_NORM_CASTING_LLAMA;
    return dispatch_mixed(x_dtype, weight_dtype, y_dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto k) {
        using K = decltype(k);
        const Opts<AccK<K>> o{(AccK<K>)offset, llama};
        return fwd<K>(rows, n, x, x_row_stride, weight, o, eps, y, y_row_stride, inv_rms, stream);
    });
}

extern "C" opsmith_status opsmith_rms_norm_fwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n, const void *x,
                                                    int64_t x_row_stride, const void *weight, double eps, void *y,
                                                    int64_t y_row_stride, void *inv_rms, opsmith_cuda_stream stream) {
    return opsmith_rms_norm_ex_fwd_cuda(dtype, dtype, dtype, rows, n, x, x_row_stride, weight, 0.0, eps,
                                        OPSMITH_RMS_NORM_CASTING_NONE, y, y_row_stride, inv_rms, stream);
}

/* Which kernel family a contiguous, 16-byte aligned call of this shape
 * takes on the current device: "resident", "staged" (with the CTAs a row
 * in ctas), or "generic". Tests use it to keep each plan reachable. */
extern "C" const char *opsmith_internal_rms_norm_cuda_plan(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                           int backward, int *ctas) {
    const Launch none{nullptr, 0, 0, 0, 0, "generic"};
    Launch l = dispatch_mixed(dtype, dtype, dtype, none, [&](auto k) {
        using K = decltype(k);
        return backward ? bwd_launch<K>(rows, n, true) : fwd_launch<K>(rows, n);
    });
    if (l.grid <= 0) l.family = "generic", l.ctas = 0;
    if (ctas) *ctas = l.ctas;
    return l.family;
}

extern "C" size_t opsmith_rms_norm_ex_bwd_cuda_workspace_size(
    opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype dy_dtype, int64_t rows, int64_t n,
    const void *dy, int64_t dy_row_stride, const void *x, int64_t x_row_stride, const void *weight, double offset,
    opsmith_rms_norm_casting casting, const void *inv_rms, void *dx, int64_t dx_row_stride, void *dweight) {
    (void)dy, (void)dy_row_stride, (void)x, (void)x_row_stride, (void)offset, (void)casting, (void)inv_rms;
    (void)dx, (void)dx_row_stride;
    if (!weight || !dweight || rows <= 0 || n <= 0) return 0;
    const int64_t groups = dispatch_mixed(x_dtype, weight_dtype, dy_dtype, (int64_t)0, [&](auto k) {
        return bwd_workspace_rows<decltype(k)>(rows, n);
    });
    return (size_t)(groups * n) * opsmith_dtype_size(opsmith_dtype_accumulate(x_dtype));
}

extern "C" size_t opsmith_rms_norm_bwd_cuda_workspace_size(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                           const void *dy, int64_t dy_row_stride, const void *x,
                                                           int64_t x_row_stride, const void *weight,
                                                           const void *inv_rms, void *dx, int64_t dx_row_stride,
                                                           void *dweight) {
    return opsmith_rms_norm_ex_bwd_cuda_workspace_size(dtype, dtype, dtype, rows, n, dy, dy_row_stride, x,
                                                       x_row_stride, weight, 0.0, OPSMITH_RMS_NORM_CASTING_NONE,
                                                       inv_rms, dx, dx_row_stride, dweight);
}

extern "C" opsmith_status opsmith_rms_norm_ex_bwd_cuda(opsmith_dtype x_dtype, opsmith_dtype weight_dtype,
                                                       opsmith_dtype dy_dtype, int64_t rows, int64_t n,
                                                       const void *dy, int64_t dy_row_stride, const void *x,
                                                       int64_t x_row_stride, const void *weight, double offset,
                                                       opsmith_rms_norm_casting casting, const void *inv_rms,
                                                       void *dx, int64_t dx_row_stride, void *dweight,
                                                       void *workspace, size_t workspace_bytes,
                                                       opsmith_cuda_stream stream) {
    static const char op[] = "rms_norm_bwd_cuda";
    void *dw = weight ? dweight : nullptr;
    weight_dtype = kernel_weight_dtype(x_dtype, weight_dtype, weight);
    opsmith_status st = opsmith_internal_rms_norm_check(op, x_dtype, weight_dtype, dy_dtype, rows, n, x, x_row_stride,
                                                        1, dy, dy_row_stride, weight, offset, 0.0, casting, dx,
                                                        dx_row_stride, inv_rms, dw);
    if (st != OPSMITH_STATUS_SUCCESS) return st;
    if (rows == 0) {
        /* no rows: the weight gradient is an empty sum */
        if (dw && cudaMemsetAsync(dw, 0, (size_t)n * opsmith_dtype_size(weight_dtype), stream) != cudaSuccess)
            return launch_status();
        return OPSMITH_STATUS_SUCCESS;
    }
    st = opsmith_internal_check_workspace(
        op, workspace, workspace_bytes,
        opsmith_rms_norm_ex_bwd_cuda_workspace_size(x_dtype, weight_dtype, dy_dtype, rows, n, dy, dy_row_stride, x,
                                                    x_row_stride, weight, offset, casting, inv_rms, dx,
                                                    dx_row_stride, dw));
    if (st != OPSMITH_STATUS_SUCCESS) return st;
    const bool llama = casting == OPSMITH_RMS_NORM_CASTING_LLAMA;
    return dispatch_mixed(x_dtype, weight_dtype, dy_dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto k) {
        using K = decltype(k);
        const Opts<AccK<K>> o{(AccK<K>)offset, llama};
        return bwd<K>(rows, n, dy, dy_row_stride, x, x_row_stride, weight, o, inv_rms, dx, dx_row_stride, dw,
                      workspace, stream);
    });
}

extern "C" opsmith_status opsmith_rms_norm_bwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n, const void *dy,
                                                    int64_t dy_row_stride, const void *x, int64_t x_row_stride,
                                                    const void *weight, const void *inv_rms, void *dx,
                                                    int64_t dx_row_stride, void *dweight, void *workspace,
                                                    size_t workspace_bytes, opsmith_cuda_stream stream) {
    return opsmith_rms_norm_ex_bwd_cuda(dtype, dtype, dtype, rows, n, dy, dy_row_stride, x, x_row_stride, weight,
                                        0.0, OPSMITH_RMS_NORM_CASTING_NONE, inv_rms, dx, dx_row_stride, dweight,
                                        workspace, workspace_bytes, stream);
}
