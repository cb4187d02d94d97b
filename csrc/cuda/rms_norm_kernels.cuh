/* RMSNorm's CUDA kernels and launch plans, shared by csrc/cuda/rms_norm.cu
 * and csrc/cuda/fused_add_rms_norm.cu (each instantiates what it launches).
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
 *   when it is wider than one CTA's share of shared memory;
 * - ring (forward, many rows of at least kRingMinPacks packs:
 *   row_slices.cuh): a persistent cluster walks the rows, each CTA's slice
 *   of a row (and of the residual's, ADD) in shared memory, the next row's
 *   loading while this one is reduced and written.
 * The weight gradient is reduced without float atomics, so it is
 * deterministic: each block (cluster) sums its rows into its own workspace
 * row with a fixed column-to-thread map, then one or two reduction launches
 * add the rows in a fixed order.
 *
 * The residual-add op takes the same kernels with one more template flag:
 * ADD (forward) loads x and the residual, stores h = x + r rounded to T and
 * normalises h; DH (backward) adds dh to the rounded dx, and the staged
 * kernel streams dh through its ring beside x and dy. With the flags off
 * (RMSNorm) every `if constexpr` branch is gone: the same code as before. */
#pragma once

#include "internal/rms_norm.h"
#include "norm_plan.cuh"
#include "partial_sums.cuh"
#include "row_slices.cuh"

namespace opsmith {
namespace {

/* The options every kernel takes: w' = offset + weight, and whether x_hat
 * is rounded to x's dtype before the weight multiply (LLAMA). */
template <typename A> struct Opts {
    A offset;
    bool llama;
};

/* The residual stage of the forward (ADD): h = x + r rounded to T is
 * stored (h may be r itself: each element is read before it is written, by
 * the thread that writes it) and normalised in place of x. */
template <typename T> struct AddIn {
    const T *r;
    int64_t rs;
    T *h;
    int64_t hs;
};

/* The backward's dh (DH): dx = round_T(the norm's dx) + dh, how autograd
 * sums the two gradients of h. */
template <typename T> struct DhIn {
    const T *dh;
    int64_t dhs;
};

/* N elements at p this thread stored earlier in the same kernel: a plain
 * (coherent) load, not load_pack's read-only path. */
template <typename T, typename A, bool PACKED>
__device__ __forceinline__ void load_acc_own(const T *p, A (&out)[Step<T, PACKED>::N]) {
    if constexpr (PACKED) {
        Pack<T> pk;
        *reinterpret_cast<uint4 *>(&pk) = *reinterpret_cast<const uint4 *>(p);
#pragma unroll
        for (int k = 0; k < Pack<T>::VEC; k++) out[k] = to_acc(pk.v[k]);
    } else {
        out[0] = to_acc(p[0]);
    }
}

/* x_hat = x * inv, rounded through T under LLAMA */
template <typename T, typename A> __device__ __forceinline__ A x_hat(A x, A inv, const Opts<A> &o) {
    const A h = x * inv;
    return o.llama ? to_acc(from_acc<T>(h)) : h;
}

template <typename T, typename W, typename Y, typename A, bool PACKED, bool WARP_ROWS, bool ADD>
__global__ void rms_norm_fwd_kernel(int64_t rows, int64_t n, const T *__restrict__ x, int64_t xs,
                                    const W *__restrict__ w, Opts<A> o, A eps, Y *__restrict__ y, int64_t ys,
                                    A *__restrict__ inv_rms, AddIn<T> add) {
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
            if constexpr (ADD) {
                A rv[S];
                load_acc<T, A, PACKED>(add.r + r * add.rs + i * S, rv);
#pragma unroll
                for (int k = 0; k < S; k++) v[k] = to_acc(from_acc<T>(v[k] + rv[k]));
                store_acc<T, A, PACKED>(add.h + r * add.hs + i * S, v);
            }
#pragma unroll
            for (int k = 0; k < S; k++) sum_sq += v[k] * v[k];
        }
        sum_sq = group_sum<WARP_ROWS>(sum_sq, scratch);
        const A inv = rsqrt_acc(sum_sq / (A)n + eps);
        if (g.t == 0) inv_rms[r] = inv;
        OPSMITH_UNROLL_4
        for (int64_t i = g.t; i < steps; i += g.threads) {
            A v[S];
            /* with ADD the second pass reads back h (x and r may be gone: h may be r) */
            if constexpr (ADD) load_acc_own<T, A, PACKED>(add.h + r * add.hs + i * S, v);
            else load_acc<T, A, PACKED>(xr + i * S, v);
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
template <typename T, typename W, typename Y, typename A, bool PACKED, bool WARP_ROWS, bool DH>
__global__ void rms_norm_bwd_kernel(int64_t rows, int64_t n, const Y *__restrict__ dy, int64_t dys,
                                    const T *__restrict__ x, int64_t xs, const W *__restrict__ w, Opts<A> o,
                                    const A *__restrict__ inv_rms, T *__restrict__ dx, int64_t dxs,
                                    A *__restrict__ partial, DhIn<T> dhin) {
    let_next_launch_start(); /* the dweight column sums may launch now; they wait for this launch to end */
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
            if constexpr (DH) {
                A hv[S];
                load_acc<T, A, PACKED>(dhin.dh + r * dhin.dhs + i * S, hv);
#pragma unroll
                for (int k = 0; k < S; k++) out[k] = to_acc(from_acc<T>(out[k])) + hv[k];
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

template <typename T, typename W, typename Y, typename A, int ITERS, bool ADD>
__global__ void __launch_bounds__(kResidentThreads)
rms_norm_fwd_resident_kernel(int64_t rows, int64_t n, const T *__restrict__ x, int64_t xs,
                             const W *__restrict__ w, Opts<A> o, A eps, Y *__restrict__ y, int64_t ys,
                             A *__restrict__ inv_rms, AddIn<T> add) {
    constexpr int S = Pack<T>::VEC;
    /* with few packs a thread (the plan for a short batch) the weight is
     * loaded once, before the rows, with no predicate (HW: the row loop
     * twice, with and without a weight), so it is in flight with the first
     * row's x and the row waits on memory once: loaded in the row loop, the
     * compiler issued it after the reduction's first shuffles. With many
     * packs it would cost the registers that keep more of x in flight, and
     * it is an L1 hit later anyway. */
    constexpr bool kWeightEarly = ITERS <= 2;
    __shared__ A scratch[2][32]; /* block_sum<A, false>'s alternating halves */
    const int64_t steps = n / S;
    auto row_loop = [&](auto has_w) {
        constexpr bool HW = decltype(has_w)::value;
        Elems<W, S> wp[ITERS];
        if constexpr (HW && kWeightEarly)
            load_my_packs<ITERS>(steps, [&](int it, int64_t i) { wp[it] = load_elems<W, S, true>(w + i * S); });
        int half = 0;
        for (int64_t r = blockIdx.x; r < rows; r += gridDim.x, half ^= 1) {
            const T *xr = x + r * xs;
            Pack<T> xp[ITERS];
            Pack<T> rp[ADD ? ITERS : 1]; /* the residual's packs */
            (void)rp;
            /* this loop only loads, with no branch a pack (load_my_packs):
             * math on a loaded pack before the next pack's load is issued
             * waits for it (the residual's add did: four round trips a row
             * at 4 packs a thread) */
            load_my_packs<ITERS>(steps, [&](int it, int64_t i) {
                xp[it] = load_pack_here(xr + i * S);
                if constexpr (ADD) rp[it] = load_pack_here(add.r + r * add.rs + i * S);
            });
            /* the early weight is used only after this row's loads are
             * issued: left loop-invariant, its conversion (offset + w) was
             * hoisted above the row loop, where it waited for the weight's
             * load before the first x load was issued (two round trips a
             * row) */
            if constexpr (HW && kWeightEarly) {
#pragma unroll
                for (int it = 0; it < ITERS; it++) opaque(wp[it]);
            }
            /* the sum with no branch a pack either (a pack past the row's end
             * counts zero): behind one, a pack's load was issued after the
             * previous pack's sum had waited for its own */
            A sum_sq = 0;
#pragma unroll
            for (int it = 0; it < ITERS; it++) {
                const int64_t i = threadIdx.x + (int64_t)it * blockDim.x;
                const bool mine = i < steps;
                if constexpr (ADD) {
                    /* h = x + r rounded to T takes x's registers */
#pragma unroll
                    for (int k = 0; k < S; k++)
                        xp[it].v[k] = from_acc<T>(to_acc(xp[it].v[k]) + to_acc(rp[it].v[k]));
                    if (mine) store_pack(add.h + r * add.hs + i * S, xp[it]);
                }
#pragma unroll
                for (int k = 0; k < S; k++) {
                    const A v = to_acc(xp[it].v[k]);
                    sum_sq += mine ? v * v : A(0);
                }
            }
            sum_sq = block_sum<A, false>(sum_sq, scratch[half]);
            const A inv = rsqrt_acc(sum_sq / (A)n + eps);
            if (threadIdx.x == 0) inv_rms[r] = inv;
            for_my_packs<ITERS>(steps, [&](int it, int64_t i) {
                opaque(xp[it]);
                Elems<W, S> wv;
                if constexpr (HW) wv = kWeightEarly ? wp[it] : load_elems<W, S>(w + i * S);
                Elems<Y, S> out;
#pragma unroll
                for (int k = 0; k < S; k++) {
                    const A v = x_hat<T>(to_acc(xp[it].v[k]), inv, o);
                    if constexpr (HW) out.v[k] = from_acc<Y>(v * (o.offset + to_acc(wv.v[k])));
                    else out.v[k] = from_acc<Y>(v);
                }
                store_elems<Y, S>(y + r * ys + i * S, out);
            });
        }
    };
    if (w) row_loop(std::true_type{});
    else row_loop(std::false_type{});
}

/* The ring forward (see the file's head). ADD: x's and the residual's
 * slices in the ring; h = x + r rounded to T is formed from them twice (the
 * same bits), stored once by the thread that owns it (h may be r: row r of
 * the residual is in shared memory before any of its h is stored; the row
 * loading meanwhile is another) and normalised. inv_rms is written by the
 * first CTA of the cluster. */
template <typename T, typename W, typename Y, typename A, int CTAS, bool ADD>
__global__ void __launch_bounds__(kSliceThreads, kSliceMinBlocks)
rms_norm_fwd_ring_kernel(int64_t rows, int64_t n, const T *x, int64_t xs, const W *__restrict__ w, Opts<A> o,
                         A eps, Y *y, int64_t ys, A *__restrict__ inv_rms, AddIn<T> add, int stages) {
    constexpr int S = Pack<T>::VEC;
    constexpr int TENSORS = ADD ? 2 : 1;
    __shared__ A scratch[32];
    ClusterSum<CTAS, A> cluster = cluster_sum_in_smem<CTAS, A>();
    const int64_t packs = n / S;
    const RingCta<T, CTAS> c(packs);
    const W *wc = w ? w + (int64_t)c.p0 * S : nullptr;
    /* x, then the residual (ADD) */
    const T *const srcs[2] = {x, add.r};
    const int64_t strides[2] = {xs, add.rs};
    ring_rows<T, CTAS, TENSORS>(rows, srcs, strides, stages, c, [&](int64_t r, const Stage<T, TENSORS> &st) {
        /* the pack normalised: x's, or h = x + r rounded to T */
        auto h_of = [&](int i) {
            if constexpr (ADD) {
                A a[S], b[S];
                unpack(st.t[0][i], a);
                unpack(st.t[TENSORS - 1][i], b);
#pragma unroll
                for (int k = 0; k < S; k++) a[k] += b[k];
                return pack_of<T>(a);
            } else {
                return st.t[0][i];
            }
        };
        T *hc = ADD ? add.h + r * add.hs + (int64_t)c.p0 * S : nullptr; /* this CTA's slice of h's row */
        A sum_sq = 0;
        c.each([&](int i) {
            const Pack<T> p = h_of(i);
            if constexpr (ADD) store_pack(hc + i * S, p);
            A v[S];
            unpack(p, v);
#pragma unroll
            for (int k = 0; k < S; k++) sum_sq += v[k] * v[k];
        });
        const A inv = rsqrt_acc(cluster.sum(block_sum(sum_sq, scratch)) / (A)n + eps);
        if (c.rank == 0 && threadIdx.x == 0) inv_rms[r] = inv;
        Y *yc = y + r * ys + (int64_t)c.p0 * S; /* this CTA's slice of the row */
        c.each([&](int i) {
            A v[S], wv[S];
            unpack(h_of(i), v);
            if (w) load_n<W, A, S>(wc + i * S, wv);
#pragma unroll
            for (int k = 0; k < S; k++) {
                const A xh = x_hat<T>(v[k], inv, o);
                v[k] = w ? xh * (o.offset + wv[k]) : xh;
            }
            store_n<Y, A, S>(yc + i * S, v);
        });
    });
    cluster.finish();
}

/* partial is (gridDim.x, n): block b's sum of dy * x * inv_rms over its rows.
 * The block keeps that sum in dynamic shared memory (n values of A, column
 * i*S+k at k*steps+i so a warp's accesses hit distinct banks); each thread
 * owns its columns there, so no barrier guards them, and registers stay free
 * for the row's packs. */
template <typename T, typename W, typename Y, typename A, int ITERS, bool DH>
__device__ __forceinline__ void bwd_resident_rows(int64_t first, int64_t step, int64_t rows, int64_t n,
                                                  const Y *__restrict__ dy, int64_t dys, const T *__restrict__ x,
                                                  int64_t xs, const W *__restrict__ w, const Opts<A> &o,
                                                  const A *__restrict__ inv_rms, T *__restrict__ dx, int64_t dxs,
                                                  A *__restrict__ partial, DhIn<T> dhin) {
    constexpr int S = Pack<T>::VEC;
    extern __shared__ __align__(16) unsigned char dynamic_smem[];
    A *const dw_sum = reinterpret_cast<A *>(dynamic_smem);
    __shared__ A scratch[2][32]; /* block_sum<A, false>'s alternating halves */
    const int64_t steps = n / S;
    /* with few packs a thread the weight is loaded once, before the rows
     * (and inv_rms with each row), so a short batch waits on memory once */
    constexpr bool kWeightEarly = ITERS <= 2;
    Elems<W, S> wp[ITERS];
    if (kWeightEarly && w)
        load_my_packs<ITERS>(steps, [&](int it, int64_t i) { wp[it] = load_elems<W, S, true>(w + i * S); });
    if (partial)
        for_my_packs<ITERS>(steps, [&](int, int64_t i) {
#pragma unroll
            for (int k = 0; k < S; k++) dw_sum[k * steps + i] = 0;
        });
    int half = 0;
    for (int64_t r = first; r < rows; r += step, half ^= 1) {
        const T *xr = x + r * xs;
        const Y *dyr = dy + r * dys;
        Pack<T> xp[ITERS];
        Elems<Y, S> dp[ITERS];
        /* dh with the row while that costs few registers (a short batch's
         * plans); with 8 packs a thread, in the write pass */
        constexpr bool kDhEarly = DH && ITERS <= 4;
        Pack<T> hp[kDhEarly ? ITERS : 1];
        const A inv = inv_rms[r];
        load_my_packs<ITERS>(steps, [&](int it, int64_t i) {
            xp[it] = load_pack_here(xr + i * S);
            dp[it] = load_elems<Y, S, true>(dyr + i * S);
            if constexpr (kDhEarly) hp[it] = load_pack_here(dhin.dh + r * dhin.dhs + i * S);
        });
        /* with few packs a thread, no branch a pack in the sum either (a
         * pack past the row's end counts zero): behind one, a pack's load
         * was issued after the previous pack's sum had waited for its own */
        A dot = 0;
        if constexpr (kWeightEarly) {
#pragma unroll
            for (int it = 0; it < ITERS; it++) {
                const bool mine = threadIdx.x + (int64_t)it * blockDim.x < steps;
#pragma unroll
                for (int k = 0; k < S; k++) {
                    const A g = w ? to_acc(dp[it].v[k]) * (o.offset + to_acc(wp[it].v[k])) : to_acc(dp[it].v[k]);
                    dot += mine ? g * to_acc(xp[it].v[k]) : A(0);
                }
            }
        } else {
            /* many packs a thread: the weight loaded here, behind each pack's
             * branch (branchless, its loads were all hoisted: 64 -> 128
             * registers at 4 packs) */
            for_my_packs<ITERS>(steps, [&](int it, int64_t i) {
                if (w) {
                    const Elems<W, S> wv = load_elems<W, S>(w + i * S);
#pragma unroll
                    for (int k = 0; k < S; k++)
                        dot += to_acc(dp[it].v[k]) * (o.offset + to_acc(wv.v[k])) * to_acc(xp[it].v[k]);
                } else {
#pragma unroll
                    for (int k = 0; k < S; k++) dot += to_acc(dp[it].v[k]) * to_acc(xp[it].v[k]);
                }
            });
        }
        dot = block_sum<A, false>(dot, scratch[half]);
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
            Pack<T> out, dh;
            if constexpr (kDhEarly) opaque(hp[it]), dh = hp[it];
            else if constexpr (DH) dh = load_pack(dhin.dh + r * dhin.dhs + i * S);
#pragma unroll
            for (int k = 0; k < S; k++) {
                const A g = to_acc(dp[it].v[k]), xv = to_acc(xp[it].v[k]);
                out.v[k] = from_acc<T>(inv * g * (w ? o.offset + to_acc(wv.v[k]) : A(1)) - xv * scale);
                if constexpr (DH) out.v[k] = from_acc<T>(to_acc(out.v[k]) + to_acc(dh.v[k]));
                if (partial) dw_sum[k * steps + i] += g * x_hat<T>(xv, inv, o);
            }
            store_pack(dx + r * dxs + i * S, out);
        });
    }
    if (partial) {
        A *pr = partial;
        /* a thread's S columns are adjacent in the partial row: 16-byte
         * stores (one store a column had a warp's store span 32 sectors) */
        for_my_packs<ITERS>(steps, [&](int, int64_t i) {
            Elems<A, S> v;
#pragma unroll
            for (int k = 0; k < S; k++) v.v[k] = dw_sum[k * steps + i];
            store_elems<A, S>(pr + i * S, v);
        });
    }
}

/* partial is (gridDim.x, n): block b's sum of dy * x_hat over its rows. */
template <typename T, typename W, typename Y, typename A, int ITERS, bool DH>
__global__ void __launch_bounds__(kResidentThreads)
rms_norm_bwd_resident_kernel(int64_t rows, int64_t n, const Y *__restrict__ dy, int64_t dys,
                             const T *__restrict__ x, int64_t xs, const W *__restrict__ w, Opts<A> o,
                             const A *__restrict__ inv_rms, T *__restrict__ dx, int64_t dxs,
                             A *__restrict__ partial, DhIn<T> dhin) {
    let_next_launch_start(); /* the dweight column sums may launch now; they wait for this launch to end */
    bwd_resident_rows<T, W, Y, A, ITERS, DH>(blockIdx.x, gridDim.x, rows, n, dy, dys, x, xs, w, o, inv_rms, dx, dxs,
                                             partial ? partial + (int64_t)blockIdx.x * n : nullptr, dhin);
}

/* A short batch's backward in one launch and no workspace (the split
 * plan): blocks 0 .. rows-1 take a row each, as the resident kernel without
 * partial rows; the blocks after them take 32 packs of columns each and
 * sum dweight over every row from dy, x and inv_rms, which the rows' blocks
 * do not write, so both halves run at once. A column block's warps take
 * rows g, g + G, ... (G warps) and meet in shared memory in a fixed order,
 * so dweight's summation order is fixed by rows, n and the block size. At
 * decode sizes the partial rows this replaces were as large as the rows,
 * and their column sums a second launch. */
template <typename T, typename W, typename Y, typename A, int ITERS, bool DH>
__global__ void __launch_bounds__(kResidentThreads)
rms_norm_bwd_split_kernel(int64_t rows, int64_t n, const Y *__restrict__ dy, int64_t dys,
                          const T *__restrict__ x, int64_t xs, const W *__restrict__ w, Opts<A> o,
                          const A *__restrict__ inv_rms, T *__restrict__ dx, int64_t dxs, W *__restrict__ dw,
                          DhIn<T> dhin) {
    constexpr int S = Pack<T>::VEC;
    if ((int64_t)blockIdx.x < rows) {
        bwd_resident_rows<T, W, Y, A, ITERS, DH>(blockIdx.x, rows, rows, n, dy, dys, x, xs, w, o, inv_rms, dx, dxs,
                                                 nullptr, dhin);
        return;
    }
    __shared__ A others[kResidentThreads / 32 - 1][32 * S]; /* warps 1.. : column k * 32 + lane */
    const int lane = threadIdx.x & 31, g = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int64_t p = ((int64_t)blockIdx.x - rows) * 32 + lane, steps = n / S;
    A acc[S];
#pragma unroll
    for (int k = 0; k < S; k++) acc[k] = 0;
    if (p < steps) {
#pragma unroll 4
        for (int64_t r = g; r < rows; r += warps) {
            const Elems<Y, S> d = load_elems<Y, S>(dy + r * dys + p * S);
            const Pack<T> xv = load_pack(x + r * xs + p * S);
            const A inv = inv_rms[r];
#pragma unroll
            for (int k = 0; k < S; k++) acc[k] += to_acc(d.v[k]) * x_hat<T>(to_acc(xv.v[k]), inv, o);
        }
    }
    if (g > 0)
#pragma unroll
        for (int k = 0; k < S; k++) others[g - 1][k * 32 + lane] = acc[k];
    __syncthreads();
    if (g > 0 || p >= steps) return;
    for (int j = 0; j < warps - 1; j++)
#pragma unroll
        for (int k = 0; k < S; k++) acc[k] += others[j][k * 32 + lane];
    Elems<W, S> out;
#pragma unroll
    for (int k = 0; k < S; k++) out.v[k] = from_acc<W>(acc[k]);
    store_elems<W, S>(dw + p * S, out);
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
template <typename T, typename W, typename Y, typename A, int ITERS, int CTAS, bool DH>
__global__ void __launch_bounds__(kResidentThreads)
rms_norm_bwd_staged_kernel(int64_t rows, int64_t n, const Y *__restrict__ dy, int64_t dys,
                           const T *__restrict__ x, int64_t xs, const W *__restrict__ w, Opts<A> o,
                           const A *__restrict__ inv_rms, T *__restrict__ dx, int64_t dxs,
                           A *__restrict__ partial, DhIn<T> dhin) {
    let_next_launch_start(); /* the dweight column sums may launch now; they wait for this launch to end */
    constexpr int S = Pack<T>::VEC, U = kUnits<T, Y>;
    extern __shared__ __align__(16) unsigned char dynamic_smem[];
    /* ring slot 0 holds x's pack, slots 1..U the same elements of dy, and
     * with DH slot 1 + U those of dh */
    const RowRing<T, kStages, 1 + U + (DH ? 1 : 0), ITERS> ring{reinterpret_cast<Pack<T> *>(dynamic_smem)};
    __shared__ A scratch[32], cluster_slots[2 * CTAS];
    __shared__ uint64_t cluster_barriers[2];
    ClusterSum<CTAS, A> cluster{cluster_slots, cluster_barriers};
    cluster.init();
    const Slice<CTAS> sl(n, S);
    x += sl.col0;
    dy += sl.col0;
    dx += sl.col0;
    const T *dhp = DH ? dhin.dh + sl.col0 : nullptr;
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
                if constexpr (DH) cp_async16(&ring.at(stage, 1 + U, it), dhp + r * dhin.dhs + i * S);
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
            Pack<T> out, dh;
            if constexpr (DH) dh = ring.at(stage, 1 + U, it);
#pragma unroll
            for (int k = 0; k < S; k++) {
                const A g = to_acc(gv.v[k]), xa = to_acc(xv.v[k]);
                out.v[k] = from_acc<T>(inv * g * (w ? o.offset + to_acc(wp[it].v[k]) : A(1)) - xa * scale);
                if constexpr (DH) out.v[k] = from_acc<T>(to_acc(out.v[k]) + to_acc(dh.v[k]));
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
            for (int k = 0; k < S; k += 16 / (int)sizeof(A)) store16(pr + i * S + k, dw[it] + k);
        });
    }
    cluster.finish();
}


/* the generic backward's partial rows (one weight gradient: at most 2^23 partial elements, 32 MB in f32) */
inline int64_t bwd_max_groups(int64_t rows, int64_t n) { return partial_row_groups(rows, n, (int64_t)1 << 23); }


/* K is a Types<T, W, Y> bundle (common.cuh): the kernels' storage types. */
template <typename K> using AccK = typename AccOf<typename K::T>::type;

template <typename K> using FwdResidentKernel =
    void (*)(int64_t, int64_t, const typename K::T *, int64_t, const typename K::W *, Opts<AccK<K>>, AccK<K>,
             typename K::Y *, int64_t, AccK<K> *, AddIn<typename K::T>);
template <typename K> using BwdResidentKernel =
    void (*)(int64_t, int64_t, const typename K::Y *, int64_t, const typename K::T *, int64_t,
             const typename K::W *, Opts<AccK<K>>, const AccK<K> *, typename K::T *, int64_t, AccK<K> *,
             DhIn<typename K::T>);

/* ADD / DH: with the residual stage (fused_add_rms_norm), else RMSNorm's
 * own kernels, which compile as before the stage existed. */
template <typename K, bool ADD> FwdResidentKernel<K> fwd_resident_kernel(int iters) {
    using T = typename K::T;
    using W = typename K::W;
    using Y = typename K::Y;
    using A = AccK<K>;
    switch (iters) {
    case 1: return rms_norm_fwd_resident_kernel<T, W, Y, A, 1, ADD>;
    case 2: return rms_norm_fwd_resident_kernel<T, W, Y, A, 2, ADD>;
    case 4: return rms_norm_fwd_resident_kernel<T, W, Y, A, 4, ADD>;
    default: return rms_norm_fwd_resident_kernel<T, W, Y, A, 8, ADD>;
    }
}

template <typename K, bool DH> BwdResidentKernel<K> bwd_resident_kernel(int iters) {
    using T = typename K::T;
    using W = typename K::W;
    using Y = typename K::Y;
    using A = AccK<K>;
    switch (iters) {
    case 1: return rms_norm_bwd_resident_kernel<T, W, Y, A, 1, DH>;
    case 2: return rms_norm_bwd_resident_kernel<T, W, Y, A, 2, DH>;
    case 4: return rms_norm_bwd_resident_kernel<T, W, Y, A, 4, DH>;
    default: return rms_norm_bwd_resident_kernel<T, W, Y, A, 8, DH>;
    }
}

template <typename K, bool DH> BwdResidentKernel<K> bwd_staged_kernel(int iters, int ctas) {
    using T = typename K::T;
    using W = typename K::W;
    using Y = typename K::Y;
    using A = AccK<K>;
    switch (ctas) {
    case 1: return iters == 1 ? rms_norm_bwd_staged_kernel<T, W, Y, A, 1, 1, DH>
                 : iters == 2 ? rms_norm_bwd_staged_kernel<T, W, Y, A, 2, 1, DH>
                              : rms_norm_bwd_staged_kernel<T, W, Y, A, 4, 1, DH>;
    case 2: return rms_norm_bwd_staged_kernel<T, W, Y, A, 4, 2, DH>;
    case 4: return rms_norm_bwd_staged_kernel<T, W, Y, A, 4, 4, DH>;
    default: return rms_norm_bwd_staged_kernel<T, W, Y, A, 4, 8, DH>;
    }
}

template <typename K, bool DH> Launch bwd_staged_launch(int64_t rows, int64_t n) {
    int iters = 0, ctas = 0;
    Launch l = staged_plan<typename K::T>(n, 1 + kUnits<typename K::T, typename K::Y> + (DH ? 1 : 0), &iters, &ctas);
    if (!l.threads) return l;
    l.kernel = reinterpret_cast<const void *>(bwd_staged_kernel<K, DH>(iters, ctas));
    return fit_grid(l, rows);
}

/* The resident backward (a short batch): its plan, and the shared memory
 * for the weight-gradient sums. */
template <typename K, bool DH> Launch bwd_resident_launch(int64_t rows, int64_t n, bool with_dw) {
    using T = typename K::T;
    Launch l{nullptr, 0, 1, 0, 0, "resident"};
    const int64_t vec = Pack<T>::VEC;
    if (n % vec != 0) return l;
    const Resident plan = resident_plan(n / vec, kBwdMinThreads, rows <= sm_count(), kResidentIters);
    if (!plan.iters) return l;
    l.kernel = reinterpret_cast<const void *>(bwd_resident_kernel<K, DH>(plan.iters));
    l.threads = plan.threads;
    l.smem = with_dw ? (size_t)n * sizeof(AccK<K>) : 0;
    return fit_grid(l, rows);
}

template <typename K> using BwdSplitKernel =
    void (*)(int64_t, int64_t, const typename K::Y *, int64_t, const typename K::T *, int64_t,
             const typename K::W *, Opts<AccK<K>>, const AccK<K> *, typename K::T *, int64_t, typename K::W *,
             DhIn<typename K::T>);

/* The split plan (rms_norm_bwd_split_kernel, norm_plan.cuh's split_launch)
 * for a short batch of packed rows with dweight. */
template <typename K, bool DH> Launch bwd_split_launch(int64_t rows, int64_t n) {
    using T = typename K::T;
    using W = typename K::W;
    using Y = typename K::Y;
    using A = AccK<K>;
    const void *const kernels[4] = {reinterpret_cast<const void *>(rms_norm_bwd_split_kernel<T, W, Y, A, 1, DH>),
                                    reinterpret_cast<const void *>(rms_norm_bwd_split_kernel<T, W, Y, A, 2, DH>),
                                    reinterpret_cast<const void *>(rms_norm_bwd_split_kernel<T, W, Y, A, 4, DH>),
                                    reinterpret_cast<const void *>(rms_norm_bwd_split_kernel<T, W, Y, A, 8, DH>)};
    return split_launch(kernels, rows, n, Pack<T>::VEC);
}

/* Backward plan for packed rows: a short batch (no more rows than SMs) takes
 * the resident kernel, one memory round trip a row; many rows the staged
 * kernel, then the resident one; grid == 0: the generic kernel. */
template <typename K, bool DH = false> Launch bwd_launch(int64_t rows, int64_t n, bool with_dw) {
    const int sms = sm_count();
    if (rows > sms) {
        const Launch l = keep_staged(bwd_staged_launch<K, DH>(rows, n), rows, sms);
        if (l.grid) return l;
    }
    return bwd_resident_launch<K, DH>(rows, n, with_dw);
}

/* Forward plans for packed rows, chosen at run time: a short batch takes the
 * resident kernel's latency plan; many rows the resident throughput plan up
 * to 4 packs a thread (512 x 4 packs; with the residual stage 2, 512 x 2);
 * grid == 0: the generic kernel, which for many wider rows beat a staged
 * forward split over a cluster (2048 x 32768 bf16: 0.89 against 0.76 of
 * copy; bench/NOTES.md v4). The residual stage's resident kernel needs ~96
 * registers at 4 packs, so a 16384-wide bf16 row (a block of 512) left one
 * row in flight an SM: the generic kernel, which reads h back from L2, ran
 * 4096 x 16384 at 0.91 of copy against 0.68 (narrower rows unchanged). */
template <typename K, bool ADD = false> Launch fwd_launch(int64_t rows, int64_t n) {
    const int64_t vec = Pack<typename K::T>::VEC;
    if (n % vec != 0) return Launch{nullptr, 0, 0, 0, 0, "generic"};
    const bool latency = rows <= sm_count();
    const int max_iters = latency ? kResidentIters : ADD ? 2 : 4;
    const Resident res = norm_fwd_resident(n / vec, latency, max_iters);
    if (res.iters) {
        const int64_t grid = rows < kMaxGrid ? rows : kMaxGrid;
        return Launch{reinterpret_cast<const void *>(fwd_resident_kernel<K, ADD>(res.iters)), res.threads, 1, 0, grid,
                      "resident"};
    }
    return Launch{nullptr, 0, 0, 0, 0, "generic"};
}

template <typename K> using FwdRingKernel =
    void (*)(int64_t, int64_t, const typename K::T *, int64_t, const typename K::W *, Opts<AccK<K>>, AccK<K>,
             typename K::Y *, int64_t, AccK<K> *, AddIn<typename K::T>, int);

/* The ring forward's launch for packed rows (x and, ADD, the residual in the
 * ring), grid == 0 when it does not apply. */
template <typename K, bool ADD = false> Launch fwd_ring_launch(int64_t rows, int64_t n, int *stages) {
    using T = typename K::T;
    using W = typename K::W;
    using Y = typename K::Y;
    using A = AccK<K>;
    const Launch none{nullptr, 0, 0, 0, 0, "generic"};
    if (!norm_ring_applies(rows, n, Pack<T>::VEC)) return none;
    const int64_t packs = n / Pack<T>::VEC;
    const void *const kernels[4] = {reinterpret_cast<const void *>(rms_norm_fwd_ring_kernel<T, W, Y, A, 1, ADD>),
                                    reinterpret_cast<const void *>(rms_norm_fwd_ring_kernel<T, W, Y, A, 2, ADD>),
                                    reinterpret_cast<const void *>(rms_norm_fwd_ring_kernel<T, W, Y, A, 4, ADD>),
                                    reinterpret_cast<const void *>(rms_norm_fwd_ring_kernel<T, W, Y, A, 8, ADD>)};
    Launch l = ring_launch(kernels, rows, packs, ADD ? 2 : 1, stages);
    if (!l.grid) return none;
    l.family = "ring";
    return l;
}

/* The forward's plan for packed rows, the launcher's and the plan query's:
 * the ring where it applies (*stages 1 or 2), else the resident plan
 * (*stages 0; grid 0: the generic kernel). */
template <typename K, bool ADD = false> Launch fwd_plan(int64_t rows, int64_t n, int *stages) {
    const Launch ring = fwd_ring_launch<K, ADD>(rows, n, stages);
    if (ring.grid) return ring;
    *stages = 0;
    return fwd_launch<K, ADD>(rows, n);
}

/* ADD: the forward of fused_add_rms_norm (add: residual and h), else RMSNorm's. */
template <typename K, bool ADD = false>
opsmith_status fwd(int64_t rows, int64_t n, const void *x, int64_t xs, const void *w, Opts<AccK<K>> o, double eps,
                   void *y, int64_t ys, void *inv_rms, cudaStream_t stream, AddIn<typename K::T> add = {}) {
    using T = typename K::T;
    using W = typename K::W;
    using Y = typename K::Y;
    using A = AccK<K>;
    const int vec = Pack<T>::VEC;
    const bool packed = ADD ? packed_ok(n, vec, {xs, ys, add.rs, add.hs}, {x, y, w, add.r, add.h})
                            : packed_ok(n, vec, {xs, ys}, {x, y, w});
    const T *xp = static_cast<const T *>(x);
    const W *wp = static_cast<const W *>(w);
    Y *yp = static_cast<Y *>(y);
    A *ip = static_cast<A *>(inv_rms);
    int stages = 0;
    const Launch l = packed ? fwd_plan<K, ADD>(rows, n, &stages) : Launch{nullptr, 0, 0, 0, 0, "generic"};
    if (l.grid && stages) {
        launch<FwdRingKernel<K>>(l, stream, rows, n, xp, xs, wp, o, (A)eps, yp, ys, ip, add, stages);
        return launch_status();
    }
    if (l.grid) {
        launch<FwdResidentKernel<K>>(l, stream, rows, n, xp, xs, wp, o, (A)eps, yp, ys, ip, add);
        return launch_status();
    }
    const Shape s = choose_shape(rows, n, packed ? vec : 1, kMaxGrid);
#define OPSMITH_LAUNCH_FWD(P, WR)                                                                       \
    rms_norm_fwd_kernel<T, W, Y, A, P, WR, ADD><<<(unsigned)s.grid, s.threads, 0, stream>>>(rows, n, xp, xs, wp, o, \
                                                                                          (A)eps, yp, ys, ip, add)
    if (packed) { if (s.warp_rows) OPSMITH_LAUNCH_FWD(true, true); else OPSMITH_LAUNCH_FWD(true, false); }
    else { if (s.warp_rows) OPSMITH_LAUNCH_FWD(false, true); else OPSMITH_LAUNCH_FWD(false, false); }
#undef OPSMITH_LAUNCH_FWD
    return launch_status();
}

/* DH: dh added to dx (fused_add_rms_norm's backward), else RMSNorm's. */
template <typename K, bool DH = false>
opsmith_status bwd(int64_t rows, int64_t n, const void *dy, int64_t dys, const void *x, int64_t xs, const void *w,
                   Opts<AccK<K>> o, const void *inv_rms, void *dx, int64_t dxs, void *dw, void *workspace,
                   cudaStream_t stream, DhIn<typename K::T> dhin = {}) {
    using T = typename K::T;
    using W = typename K::W;
    using Y = typename K::Y;
    using A = AccK<K>;
    const int vec = Pack<T>::VEC;
    const bool packed = DH ? packed_ok(n, vec, {xs, dys, dxs, dhin.dhs}, {x, dy, dx, w, dhin.dh})
                           : packed_ok(n, vec, {xs, dys, dxs}, {x, dy, dx, w});
    const Y *dyp = static_cast<const Y *>(dy);
    const T *xp = static_cast<const T *>(x);
    const W *wp = static_cast<const W *>(w);
    const A *ip = static_cast<const A *>(inv_rms);
    T *dxp = static_cast<T *>(dx);
    A *partial = dw ? static_cast<A *>(workspace) : nullptr;
    if (packed && dw && aligned16(dw) && !rows_overlap(dx, dxs, sizeof(T), dy, dys, sizeof(Y), rows, n) &&
        !rows_overlap(dx, dxs, sizeof(T), x, xs, sizeof(T), rows, n)) {
        const Launch split = bwd_split_launch<K, DH>(rows, n);
        if (split.grid) {
            launch<BwdSplitKernel<K>>(split, stream, rows, n, dyp, dys, xp, xs, wp, o, ip, dxp, dxs,
                                      static_cast<W *>(dw), dhin);
            return launch_status();
        }
    }
    int64_t parts;
    const Launch l = packed ? bwd_launch<K, DH>(rows, n, dw != nullptr) : Launch{nullptr, 0, 0, 0, 0, "generic"};
    if (l.grid) {
        parts = l.grid / l.ctas;
        launch<BwdResidentKernel<K>>(l, stream, rows, n, dyp, dys, xp, xs, wp, o, ip, dxp, dxs, partial, dhin);
    } else {
        const Shape s = choose_shape(rows, n, packed ? vec : 1, bwd_max_groups(rows, n));
        parts = s.groups;
#define OPSMITH_LAUNCH_BWD(P, WR)                                                                          \
    rms_norm_bwd_kernel<T, W, Y, A, P, WR, DH><<<(unsigned)s.grid, s.threads, 0, stream>>>(               \
        rows, n, dyp, dys, xp, xs, wp, o, ip, dxp, dxs, partial, dhin)
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
template <typename K, bool DH = false> int64_t bwd_workspace_rows(int64_t rows, int64_t n) {
    const Shape a = choose_shape(rows, n, Pack<typename K::T>::VEC, bwd_max_groups(rows, n));
    const Shape b = choose_shape(rows, n, 1, bwd_max_groups(rows, n));
    int64_t parts = a.groups > b.groups ? a.groups : b.groups;
    const Launch l = bwd_launch<K, DH>(rows, n, true);
    if (l.grid && l.grid / l.ctas > parts) parts = l.grid / l.ctas;
    return parts + reduce_chunks(parts);
}

/* the weight's dtype the kernels are picked by: without a weight, the
 * accumulate type (which also pairs f16/bf16 x with an f32 y) */
inline opsmith_dtype kernel_weight_dtype(opsmith_dtype x_dtype, opsmith_dtype weight_dtype, const void *weight) {
    return weight ? weight_dtype : opsmith_dtype_accumulate(x_dtype);
}

} // namespace
} // namespace opsmith
