/* LayerNorm on CUDA.
 * x, dy are (rows, n) addressed through a row stride; y, dx are (rows, n)
 * with their own row stride; weight, bias, dweight, dbias are (n) in W (the
 * storage type of x, or float); mean and rstd are (rows) in A (double for
 * f64 x, float otherwise).
 *
 * Three kernel families, chosen per call (fwd_launch, bwd_launch), built
 * from the row machinery rms_norm uses (rows.cuh, launch_plan.cuh,
 * norm_plan.cuh, row_pipeline.cuh, partial_sums.cuh):
 * - resident: packed rows held in registers, so x (and dy) are read once;
 *   the forward's kernel (a block a row, or a warp a row for short rows:
 *   "warp"), and the backward's for a short batch. Each thread takes the
 *   mean and the squared deviations of its own packs from its registers
 *   (two passes over them), and one merge of those moments gives the row's
 *   mean and variance (a sum of squared deviations, never E[x^2] - E[x]^2);
 * - split (backward, no more rows than SMs, with dweight or dbias): the
 *   resident rows beside column blocks that sum dweight and dbias from dy
 *   and x in the same launch: no partial rows, no second launch;
 * - staged (backward, many rows): rows of x and dy streamed through shared
 *   memory several rows ahead with cp.async, a row split over a cluster of
 *   CTAs when it is wider than one CTA's share of shared memory;
 * - ring (forward, many wide rows: row_slices.cuh): a persistent cluster
 *   walks the rows, each CTA's slice of a row in shared memory and the next
 *   row's slice loading while this one is reduced (the mean, then the
 *   squared deviations from it: two block sums and two cluster sums a row)
 *   and written;
 * - generic: a row group (a warp for short rows, the block for long ones)
 *   owns a row and reads it again for each pass; any stride, alignment or
 *   width (16-byte packs where every pointer, stride and n allow it).
 * dweight and dbias are reduced without float atomics, so deterministically:
 * each block (row group) sums its rows into its own workspace rows with a
 * fixed column-to-thread map, then fixed-order column sums add the rows (the
 * split plan's column blocks sum in an order fixed by shape). */
#include "internal/layer_norm.h"
#include "norm_plan.cuh"
#include "partial_sums.cuh"
#include "row_slices.cuh"

namespace opsmith {
namespace {

/* S consecutive elements of W at p (S-aligned) as A: with 16-byte (or
 * 8-byte) loads when PACKED, one element at a time otherwise. A float
 * weight beside 16-bit x spans two packs per x pack. HERE: the loads stay
 * where the call is (ldg16_here), for the loads-only loops. */
template <typename W, typename A, int S, bool PACKED, bool HERE = false>
__device__ __forceinline__ void load_param(const W *p, A (&out)[S]) {
    constexpr int BYTES = S * (int)sizeof(W);
    if constexpr (PACKED && BYTES % 16 == 0) {
        constexpr int V = Pack<W>::VEC;
#pragma unroll
        for (int q = 0; q < S / V; q++) {
            A part[V];
            unpack(HERE ? load_pack_here(p + q * V) : load_pack(p + q * V), part);
#pragma unroll
            for (int k = 0; k < V; k++) out[q * V + k] = part[k];
        }
    } else if constexpr (PACKED && BYTES == 8) {
        const uint2 u = HERE ? ldg8_here(p) : __ldg(reinterpret_cast<const uint2 *>(p));
        const W *v = reinterpret_cast<const W *>(&u);
#pragma unroll
        for (int k = 0; k < S; k++) out[k] = (A)to_acc(v[k]);
    } else {
#pragma unroll
        for (int k = 0; k < S; k++) out[k] = (A)to_acc(p[k]);
    }
}

/* Two sums over the block in one round of barriers; scratch holds 64.
 * LEAD: with the barrier that makes a second call on the same scratch
 * safe; without it, a block's consecutive calls alternate two scratch
 * buffers (as block_sum<A, false>). */
template <typename A, bool LEAD = true> __device__ __forceinline__ void block_sum2(A &a, A &b, A *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    if constexpr (LEAD) __syncthreads();
    if (lane == 0) scratch[warp] = a, scratch[32 + warp] = b;
    __syncthreads();
    a = warp_sum(lane < warps ? scratch[lane] : A(0));
    b = warp_sum(lane < warps ? scratch[32 + lane] : A(0));
}

template <bool WARP_ROWS, typename A> __device__ __forceinline__ void group_sum2(A &a, A &b, A *scratch) {
    if constexpr (WARP_ROWS) a = warp_sum(a), b = warp_sum(b);
    else block_sum2(a, b, scratch);
}

/* --- generic kernels ------------------------------------------------------ */

template <typename T, typename W, typename A, bool PACKED, bool WARP_ROWS>
__global__ void layer_norm_fwd_kernel(int64_t rows, int64_t n, const T *__restrict__ x, int64_t xs,
                                      const W *__restrict__ w, const W *__restrict__ b, A eps, T *__restrict__ y,
                                      int64_t ys, A *__restrict__ mean, A *__restrict__ rstd) {
    constexpr int S = Step<T, PACKED>::N;
    __shared__ A scratch[64];
    const RowGroup<WARP_ROWS> g;
    const int64_t steps = n / S;
    for (int64_t r = g.first_row(); r < rows; r += g.row_step()) {
        const T *xr = x + r * xs;
        A sum = 0;
        OPSMITH_UNROLL_4
        for (int64_t i = g.t; i < steps; i += g.threads) {
            A v[S];
            load_acc<T, A, PACKED>(xr + i * S, v);
#pragma unroll
            for (int k = 0; k < S; k++) sum += v[k];
        }
        A unused = 0;
        group_sum2<WARP_ROWS>(sum, unused, scratch);
        const A mu = sum / (A)n;
        A sq = 0;
        OPSMITH_UNROLL_4
        for (int64_t i = g.t; i < steps; i += g.threads) {
            A v[S];
            load_acc<T, A, PACKED>(xr + i * S, v);
#pragma unroll
            for (int k = 0; k < S; k++) sq += (v[k] - mu) * (v[k] - mu);
        }
        unused = 0;
        group_sum2<WARP_ROWS>(sq, unused, scratch);
        const A rs = rsqrt_acc(sq / (A)n + eps);
        if (g.t == 0) mean[r] = mu, rstd[r] = rs;
        OPSMITH_UNROLL_4
        for (int64_t i = g.t; i < steps; i += g.threads) {
            A v[S], wv[S], bv[S];
            load_acc<T, A, PACKED>(xr + i * S, v);
            if (w) load_param<W, A, S, PACKED>(w + i * S, wv);
            if (b) load_param<W, A, S, PACKED>(b + i * S, bv);
#pragma unroll
            for (int k = 0; k < S; k++) v[k] = (v[k] - mu) * rs * (w ? wv[k] : A(1)) + (b ? bv[k] : A(0));
            store_acc<T, A, PACKED>(y + r * ys + i * S, v);
        }
    }
}

/* dx for the row group's rows; when partial is non-NULL, also its dweight
 * and dbias partial sums: partial is (2, parts, n), row group p's at rows p
 * and parts + p. */
template <typename T, typename W, typename A, bool PACKED, bool WARP_ROWS>
__global__ void layer_norm_bwd_kernel(int64_t rows, int64_t n, const T *__restrict__ dy, int64_t dys,
                                      const T *__restrict__ x, int64_t xs, const W *__restrict__ w,
                                      const A *__restrict__ mean, const A *__restrict__ rstd, T *__restrict__ dx,
                                      int64_t dxs, A *__restrict__ partial, int64_t parts) {
    let_next_launch_start(); /* the dweight column sums may launch now; they wait for this launch to end */
    constexpr int S = Step<T, PACKED>::N;
    __shared__ A scratch[64];
    const RowGroup<WARP_ROWS> g;
    const int64_t steps = n / S;
    A *pw = partial ? partial + g.first_row() * n : nullptr;
    A *pb = partial ? partial + (parts + g.first_row()) * n : nullptr;
    bool first = true;
    for (int64_t r = g.first_row(); r < rows; r += g.row_step()) {
        const T *xr = x + r * xs, *dyr = dy + r * dys;
        const A mu = mean[r], rs = rstd[r];
        A sg = 0, sgx = 0;
        OPSMITH_UNROLL_4
        for (int64_t i = g.t; i < steps; i += g.threads) {
            A xv[S], gv[S], wv[S];
            load_acc<T, A, PACKED>(xr + i * S, xv);
            load_acc<T, A, PACKED>(dyr + i * S, gv);
            if (w) load_param<W, A, S, PACKED>(w + i * S, wv);
#pragma unroll
            for (int k = 0; k < S; k++) {
                const A gk = w ? gv[k] * wv[k] : gv[k];
                sg += gk;
                sgx += gk * (xv[k] - mu);
            }
        }
        group_sum2<WARP_ROWS>(sg, sgx, scratch);
        const A mg = sg / (A)n, mgx = sgx * rs / (A)n;
        OPSMITH_UNROLL_4
        for (int64_t i = g.t; i < steps; i += g.threads) {
            A xv[S], dv[S], wv[S], out[S];
            load_acc<T, A, PACKED>(xr + i * S, xv);
            load_acc<T, A, PACKED>(dyr + i * S, dv);
            if (w) load_param<W, A, S, PACKED>(w + i * S, wv);
#pragma unroll
            for (int k = 0; k < S; k++) {
                const A xh = (xv[k] - mu) * rs;
                out[k] = rs * ((w ? dv[k] * wv[k] : dv[k]) - mg - xh * mgx);
                if (pw) {
                    /* only this thread ever touches these columns of its rows */
                    pw[i * S + k] = first ? dv[k] * xh : pw[i * S + k] + dv[k] * xh;
                    pb[i * S + k] = first ? dv[k] : pb[i * S + k] + dv[k];
                }
            }
            store_acc<T, A, PACKED>(dx + r * dxs + i * S, out);
        }
        first = false;
    }
    if (pw && first)
        /* no row for this group: its partial rows must still read as zero */
        for (int64_t i = g.t; i < n; i += g.threads) pw[i] = 0, pb[i] = 0;
}

/* --- register-resident kernels ------------------------------------------- */

/* A row's mean and its sum of squared deviations (m2) from packs a row
 * group holds in registers, never as E[x^2] - E[x]^2: each warp takes the
 * exact two-pass moments of its own elements (two warp sums, no barrier),
 * and the warps' moments are combined by Chan et al.'s parallel formula
 *     mean = sum_w c_w mean_w / n,  m2 = sum_w (m2_w + c_w (mean_w - mean)^2)
 * after one round of barriers (a block a row). The reduction is on each
 * row's critical path, so it is kept as short as RMSNorm's: merging
 * moments at every butterfly step (three shuffles and a division a step)
 * doubled it. sum is the thread's sum of its
 * elements; sq(mean) its sum of squared deviations from mean; c_w the
 * warp's element count (the same in every lane), inv_c_w its reciprocal
 * (0 for a warp with no element), inv_n 1 / n. scratch holds 96, and a
 * block's consecutive calls alternate two such buffers. */
template <bool WARP_ROWS, typename A, typename SQ>
__device__ __forceinline__ void row_moments(A sum, SQ sq, A c_w, A inv_c_w, A inv_n, A *scratch, A &mean, A &m2) {
    const A s_w = warp_sum(sum);
    const A mean_w = s_w * inv_c_w;
    const A m2_w = warp_sum(sq(mean_w));
    if constexpr (WARP_ROWS) {
        mean = mean_w;
        m2 = m2_w;
    } else {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        const int warps = (blockDim.x + 31) >> 5;
        /* no barrier ahead: the caller alternates two scratch buffers
         * between rows (as block_sum<A, false>) */
        if (lane == 0) scratch[warp] = c_w, scratch[32 + warp] = mean_w, scratch[64 + warp] = m2_w;
        __syncthreads();
        /* every warp merges the warps' moments with lane v holding warp v's:
         * two warp sums, where a loop over every warp in each thread was
         * ~40% of a short batch's instructions a row, in all 16 warps */
        const bool mine = lane < warps;
        const A c = mine ? scratch[lane] : A(0), m = mine ? scratch[32 + lane] : A(0);
        const A q = mine ? scratch[64 + lane] : A(0);
        mean = warp_sum(c * m) * inv_n;
        const A d = m - mean;
        m2 = warp_sum(q + c * d * d);
    }
}

/* Elements of a row in warp `warp`'s packs when a row group of `threads`
 * takes pack t + it * threads in thread t (steps packs of S a row). */
template <int ITERS, int S> __device__ __forceinline__ int64_t warp_elements(int64_t steps, int threads, int warp) {
    int64_t c = 0;
#pragma unroll
    for (int it = 0; it < ITERS; it++) {
        const int64_t left = steps - (int64_t)it * threads - (int64_t)warp * 32;
        c += left < 0 ? 0 : left > 32 ? 32 : left;
    }
    return c * S;
}

/* Rows of at most norm_tuning().warp_row_packs packs (kWarpRowPacks,
 * norm_plan.cuh) take a warp a row in the forward's throughput plan: no
 * block barrier, and kWarpRowsBlock / 32 rows in flight a block instead of
 * one short row a block of 64 threads (which capped an SM at 32 rows of
 * 1 KB in flight at n = 512 bf16). */
constexpr int kWarpRowsBlock = 256;

/* Forward for packed rows held in registers: ITERS packs a thread of a row
 * group (WARP_ROWS: a warp a row, blockDim.x / 32 rows a block, for rows of
 * at most 32 x 4 packs; else the block a row). One round of reduction a
 * row (row_moments). EARLY (at most 2 packs a thread of a block): the
 * weight and bias are loaded with x, so the row waits on memory once;
 * otherwise they are L1/L2 hits loaded after the reduction, leaving the
 * registers to x's packs. LEAN (warp rows, by default at 2 packs a lane;
 * OPSMITH_NORM_WARP_ROW_LEAN): at most 48 registers (60-64 otherwise), so
 * an SM holds 5 blocks of kWarpRowsBlock, 40 warps against 32, for more
 * bytes in flight (at 4 packs it spills, and lost on the H100); the row
 * loop's test is a warp vote (r is the same in
 * every lane), so the shuffles need no divergent fallback, whose live
 * registers (62) were the kernel's peak. */
template <typename T, typename W, typename A, int ITERS, bool WARP_ROWS, bool EARLY, bool LEAN = false>
__global__ void __launch_bounds__(LEAN ? kWarpRowsBlock : kResidentThreads, LEAN ? 5 : 0)
layer_norm_fwd_resident_kernel(int64_t rows, int64_t n, const T *__restrict__ x, int64_t xs,
                               const W *__restrict__ w, const W *__restrict__ b, A eps, T *__restrict__ y,
                               int64_t ys, A *__restrict__ mean, A *__restrict__ rstd) {
    constexpr int S = Pack<T>::VEC;
    /* a short batch's plan loads the weight and bias once, before the rows,
     * so they are in flight with the first row's x (in the row loop, the
     * compiler issued them after the reduction had begun) */
    constexpr bool kParamsEarly = EARLY;
    static_assert(!EARLY || (ITERS <= 2 && !WARP_ROWS), "early parameters: at most 2 packs, block rows");
    static_assert(!LEAN || WARP_ROWS, "the lean kernel is a warp-row kernel");
    __shared__ A scratch[2][96]; /* row_moments' alternating halves */
    const RowGroup<WARP_ROWS> g;
    const int64_t steps = n / S;
    /* f(it, i) for each of the thread's packs i = t + it * threads inside the row */
    auto packs = [&](auto f) {
#pragma unroll
        for (int it = 0; it < ITERS; it++) {
            const int64_t i = g.t + (int64_t)it * g.threads;
            if (i < steps) f(it, i);
        }
    };
    /* the loads-only loop: no branch a pack, past the row's end the first
     * pack again (as load_my_packs) */
    auto load_packs = [&](auto f) {
#pragma unroll
        for (int it = 0; it < ITERS; it++) {
            const int64_t i = g.t + (int64_t)it * g.threads;
            f(it, i < steps ? i : (int64_t)0);
        }
    };
    /* kept as loaded (whole 16-byte packs) and converted in the row loop
     * once the row's loads are issued: converted here, the conversion
     * waited for these loads before the first x load was issued (two round
     * trips a row). A float weight beside double x (8 bytes a pack) is
     * converted as loaded (wr, br unused). */
    constexpr bool kRaw = S * sizeof(W) % 16 == 0;
    using Raw = Elems<W, kRaw ? S : (int)(16 / sizeof(W))>;
    Raw wr[kParamsEarly ? ITERS : 1], br[kParamsEarly ? ITERS : 1];
    A wv[kParamsEarly ? ITERS : 1][S], bv[kParamsEarly ? ITERS : 1][S];
    if constexpr (kParamsEarly) {
        load_packs([&](int it, int64_t i) {
            if constexpr (kRaw) {
                if (w) wr[it] = load_elems<W, S, true>(w + i * S);
                if (b) br[it] = load_elems<W, S, true>(b + i * S);
            } else {
                if (w) load_param<W, A, S, true, true>(w + i * S, wv[it]);
                if (b) load_param<W, A, S, true, true>(b + i * S, bv[it]);
            }
        });
    }
    /* whether the thread's pack it is inside the row (the sums below take
     * no branch a pack: behind one, a pack's load was issued only after the
     * previous pack's sum had waited for its own) */
    auto mine = [&](int it) { return g.t + (int64_t)it * g.threads < steps; };
    const A c_w = (A)warp_elements<ITERS, S>(steps, g.threads, WARP_ROWS ? 0 : (int)(threadIdx.x >> 5));
    int half = 0;
    for (int64_t r = g.first_row(); LEAN ? __any_sync(0xffffffffu, r < rows) : r < rows;
         r += g.row_step(), half ^= 1) {
        const T *xr = x + r * xs;
        Pack<T> xp[ITERS];
        load_packs([&](int it, int64_t i) { xp[it] = load_pack_here(xr + i * S); });
        /* the divisions by counts as reciprocals taken while the row loads:
         * on the row's chain each division was a reciprocal, its refinement
         * and a range check (with n and the warps' counts powers of two, the
         * same bits; else within a rounding of the quotient). Loop-invariant,
         * they would be hoisted above the loop and its first load (opaque_acc
         * keeps them here) */
        const A cw = opaque_acc(c_w), inv_c_w = cw > A(0) ? A(1) / cw : A(0), inv_n = A(1) / opaque_acc((A)n);
        if constexpr (kParamsEarly && kRaw) {
#pragma unroll
            for (int it = 0; it < ITERS; it++) {
                if (w) {
                    opaque(wr[it]);
#pragma unroll
                    for (int k = 0; k < S; k++) wv[it][k] = (A)to_acc(wr[it].v[k]);
                }
                if (b) {
                    opaque(br[it]);
#pragma unroll
                    for (int k = 0; k < S; k++) bv[it][k] = (A)to_acc(br[it].v[k]);
                }
            }
        }
        A sum = 0;
#pragma unroll
        for (int it = 0; it < ITERS; it++) {
#pragma unroll
            for (int k = 0; k < S; k++) sum += mine(it) ? (A)to_acc(xp[it].v[k]) : A(0);
        }
        auto sq = [&](A mu_w) {
            A q = 0;
#pragma unroll
            for (int it = 0; it < ITERS; it++) {
#pragma unroll
                for (int k = 0; k < S; k++) {
                    const A d = to_acc(xp[it].v[k]) - mu_w;
                    q += mine(it) ? d * d : A(0);
                }
            }
            return q;
        };
        A mu, m2;
        row_moments<WARP_ROWS>(sum, sq, c_w, inv_c_w, inv_n, scratch[half], mu, m2);
        const A rs = rsqrt_acc(m2 * inv_n + eps);
        if (g.t == 0) mean[r] = mu, rstd[r] = rs;
        packs([&](int it, int64_t i) {
            opaque(xp[it]);
            A wl[S], bl[S];
            if constexpr (kParamsEarly) {
#pragma unroll
                for (int k = 0; k < S; k++) wl[k] = wv[it][k], bl[k] = bv[it][k];
            } else {
                if (w) load_param<W, A, S, true>(w + i * S, wl);
                if (b) load_param<W, A, S, true>(b + i * S, bl);
            }
            Pack<T> out;
#pragma unroll
            for (int k = 0; k < S; k++)
                out.v[k] = from_acc<T>((to_acc(xp[it].v[k]) - mu) * rs * (w ? wl[k] : A(1)) + (b ? bl[k] : A(0)));
            store_pack(y + r * ys + i * S, out);
        });
    }
}

/* The ring forward (see the file's head): rows of packs, mean and rstd
 * written by the first CTA of the cluster. */
template <typename T, typename W, typename A, int CTAS>
__global__ void __launch_bounds__(kSliceThreads, kSliceMinBlocks)
layer_norm_fwd_ring_kernel(int64_t rows, int64_t n, const T *x, int64_t xs, const W *__restrict__ w,
                           const W *__restrict__ b, A eps, T *y, int64_t ys, A *__restrict__ mean,
                           A *__restrict__ rstd, int stages) {
    constexpr int S = Pack<T>::VEC;
    __shared__ A scratch[32];
    ClusterSum<CTAS, A> cluster = cluster_sum_in_smem<CTAS, A>();
    const int64_t packs = n / S;
    const RingCta<T, CTAS> c(packs);
    ring_rows<T, CTAS>(rows, x, xs, stages, c, [&](int64_t r, const Pack<T> *buf) {
        A s = 0;
        c.each([&](int i) {
            A v[S];
            unpack(buf[i], v);
#pragma unroll
            for (int k = 0; k < S; k++) s += v[k];
        });
        const A mu = cluster.sum(block_sum(s, scratch)) / (A)n;
        A q = 0;
        c.each([&](int i) {
            A v[S];
            unpack(buf[i], v);
#pragma unroll
            for (int k = 0; k < S; k++) {
                const A d = v[k] - mu;
                q += d * d;
            }
        });
        const A rs = rsqrt_acc(cluster.sum(block_sum(q, scratch)) / (A)n + eps);
        if (c.rank == 0 && threadIdx.x == 0) mean[r] = mu, rstd[r] = rs;
        /* this CTA's slices of the row and of the parameters (formed a row,
         * not held across rows: the registers are capped at 40) */
        T *yc = y + r * ys + (int64_t)c.p0 * S;
        const W *wc = w ? w + (int64_t)c.p0 * S : nullptr, *bc = b ? b + (int64_t)c.p0 * S : nullptr;
        c.each([&](int i) {
            A v[S], wl[S], bl[S];
            unpack(buf[i], v);
            if (w) load_param<W, A, S, true>(wc + i * S, wl);
            if (b) load_param<W, A, S, true>(bc + i * S, bl);
#pragma unroll
            for (int k = 0; k < S; k++) v[k] = (v[k] - mu) * rs * (w ? wl[k] : A(1)) + (b ? bl[k] : A(0));
            store_pack(yc + i * S, pack_of<T>(v));
        });
    });
    cluster.finish();
}

/* Rows first, first + stride, ... of the resident backward: dx, and with
 * dw_sum (shared memory, 2n values) each column's dweight and dbias sums.
 * scratch holds 128 (block_sum2's two alternating buffers). With few packs
 * a thread the weight is loaded once, before the rows, and the sums take
 * no branch a pack, so a short batch's row waits on memory once (the
 * weight's loads in the sum loop were a second round trip a row). */
template <typename T, typename W, typename A, int ITERS>
__device__ __forceinline__ void bwd_resident_rows(int64_t first, int64_t stride, int64_t rows, int64_t n,
                                                  const T *__restrict__ dy, int64_t dys, const T *__restrict__ x,
                                                  int64_t xs, const W *__restrict__ w, const A *__restrict__ mean,
                                                  const A *__restrict__ rstd, T *__restrict__ dx, int64_t dxs,
                                                  A *dw_sum, A *scratch) {
    constexpr int S = Pack<T>::VEC;
    const int64_t steps = n / S;
    A *const db_sum = dw_sum ? dw_sum + n : nullptr;
    constexpr bool kWeightEarly = ITERS <= 2;
    A we[kWeightEarly ? ITERS : 1][S];
    if (kWeightEarly && w)
        load_my_packs<ITERS>(steps, [&](int it, int64_t i) { load_param<W, A, S, true, true>(w + i * S, we[it]); });
    int half = 0;
    for (int64_t r = first; r < rows; r += stride, half ^= 1) {
        const T *xr = x + r * xs, *dyr = dy + r * dys;
        Pack<T> xp[ITERS], dp[ITERS];
        const A mu = mean[r], rs = rstd[r];
        load_my_packs<ITERS>(steps, [&](int it, int64_t i) {
            xp[it] = load_pack_here(xr + i * S);
            dp[it] = load_pack_here(dyr + i * S);
        });
        A sg = 0, sgx = 0;
        auto add = [&](int it, const A (&wv)[S], bool mine) {
#pragma unroll
            for (int k = 0; k < S; k++) {
                const A gk = w ? to_acc(dp[it].v[k]) * wv[k] : (A)to_acc(dp[it].v[k]);
                sg += mine ? gk : A(0);
                sgx += mine ? gk * (to_acc(xp[it].v[k]) - mu) : A(0);
            }
        };
        if constexpr (kWeightEarly) {
#pragma unroll
            for (int it = 0; it < ITERS; it++) add(it, we[it], threadIdx.x + (int64_t)it * blockDim.x < steps);
        } else {
            /* many packs a thread: the weight loaded here, behind each
             * pack's branch, as before the short batch's plan changed */
            for_my_packs<ITERS>(steps, [&](int it, int64_t i) {
                A wv[S];
                if (w) load_param<W, A, S, true>(w + i * S, wv);
                add(it, wv, true);
            });
        }
        block_sum2<A, false>(sg, sgx, scratch + 64 * half);
        const A mg = sg / (A)n, mgx = sgx * rs / (A)n;
        for_my_packs<ITERS>(steps, [&](int it, int64_t i) {
            opaque(xp[it]);
            opaque(dp[it]);
            A wv[S];
            if (kWeightEarly && w) {
#pragma unroll
                for (int k = 0; k < S; k++) wv[k] = we[it][k];
            } else if (w) {
                load_param<W, A, S, true>(w + i * S, wv);
            }
            Pack<T> out;
#pragma unroll
            for (int k = 0; k < S; k++) {
                const A d = to_acc(dp[it].v[k]), xh = (to_acc(xp[it].v[k]) - mu) * rs;
                out.v[k] = from_acc<T>(rs * ((w ? d * wv[k] : d) - mg - xh * mgx));
                if (dw_sum) dw_sum[k * steps + i] += d * xh, db_sum[k * steps + i] += d;
            }
            store_pack(dx + r * dxs + i * S, out);
        });
    }
}

/* partial is (2, parts, n): block p's dweight and dbias sums over its
 * rows, rows p and parts + p. The block keeps both sums in dynamic
 * shared memory (2n values of A, column i*S+k at k*steps+i so a warp's
 * accesses hit distinct banks); each thread owns its columns there, so no
 * barrier guards them, and registers stay free for the row's packs. */
template <typename T, typename W, typename A, int ITERS>
__global__ void __launch_bounds__(kResidentThreads)
layer_norm_bwd_resident_kernel(int64_t rows, int64_t n, const T *__restrict__ dy, int64_t dys,
                               const T *__restrict__ x, int64_t xs, const W *__restrict__ w,
                               const A *__restrict__ mean, const A *__restrict__ rstd, T *__restrict__ dx,
                               int64_t dxs, A *__restrict__ partial, int64_t parts) {
    let_next_launch_start(); /* the dweight column sums may launch now; they wait for this launch to end */
    constexpr int S = Pack<T>::VEC;
    extern __shared__ __align__(16) unsigned char dynamic_smem[];
    A *const dw_sum = partial ? reinterpret_cast<A *>(dynamic_smem) : nullptr;
    A *const db_sum = dw_sum ? dw_sum + n : nullptr;
    __shared__ A scratch[128];
    const int64_t steps = n / S;
    if (partial)
        for_my_packs<ITERS>(steps, [&](int, int64_t i) {
#pragma unroll
            for (int k = 0; k < S; k++) dw_sum[k * steps + i] = 0, db_sum[k * steps + i] = 0;
        });
    bwd_resident_rows<T, W, A, ITERS>(blockIdx.x, gridDim.x, rows, n, dy, dys, x, xs, w, mean, rstd, dx, dxs, dw_sum,
                                      scratch);
    if (partial) {
        A *pw = partial + (int64_t)blockIdx.x * n, *pb = partial + (parts + blockIdx.x) * n;
        /* 16-byte stores of a thread's S adjacent columns, as rms_norm's */
        for_my_packs<ITERS>(steps, [&](int, int64_t i) {
            Elems<A, S> vw, vb;
#pragma unroll
            for (int k = 0; k < S; k++) vw.v[k] = dw_sum[k * steps + i], vb.v[k] = db_sum[k * steps + i];
            store_elems<A, S>(pw + i * S, vw);
            store_elems<A, S>(pb + i * S, vb);
        });
    }
}

/* S column sums into W: 16-byte stores where S elements of W fill them (an
 * f32 weight beside f64 x takes 8 bytes a pack: element stores). */
template <typename W, int S, typename A> __device__ __forceinline__ void store_sums(W *out, const A (&acc)[S]) {
    if constexpr (S * sizeof(W) % 16 == 0) {
        Elems<W, S> v;
#pragma unroll
        for (int k = 0; k < S; k++) v.v[k] = from_acc<W>(acc[k]);
        store_elems<W, S>(out, v);
    } else {
#pragma unroll
        for (int k = 0; k < S; k++) out[k] = from_acc<W>(acc[k]);
    }
}

/* A short batch's backward in one launch and no workspace (the split plan,
 * rms_norm's): blocks 0 .. rows-1 take a row each, as the resident kernel
 * without sums; the blocks after them take 32 packs of columns each and sum
 * dweight and dbias over every row from dy, x, mean and rstd, which the
 * rows' blocks do not write (the plan is not taken when dx overlaps them).
 * A column block's warps take rows g, g + G, ... and meet in shared memory
 * in a fixed order, so the summation order is fixed by shape. */
template <typename T, typename W, typename A, int ITERS>
__global__ void __launch_bounds__(kResidentThreads)
layer_norm_bwd_split_kernel(int64_t rows, int64_t n, const T *__restrict__ dy, int64_t dys,
                            const T *__restrict__ x, int64_t xs, const W *__restrict__ w,
                            const A *__restrict__ mean, const A *__restrict__ rstd, T *__restrict__ dx, int64_t dxs,
                            W *__restrict__ dw, W *__restrict__ db) {
    constexpr int S = Pack<T>::VEC;
    __shared__ A scratch[128];
    if ((int64_t)blockIdx.x < rows) {
        bwd_resident_rows<T, W, A, ITERS>(blockIdx.x, rows, rows, n, dy, dys, x, xs, w, mean, rstd, dx, dxs,
                                          nullptr, scratch);
        return;
    }
    /* warps 1.. : column k * 32 + lane (2 x 15 KB at bf16) */
    __shared__ A others_w[kResidentThreads / 32 - 1][32 * S], others_b[kResidentThreads / 32 - 1][32 * S];
    const int lane = threadIdx.x & 31, g = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int64_t p = ((int64_t)blockIdx.x - rows) * 32 + lane, steps = n / S;
    A aw[S], ab[S];
#pragma unroll
    for (int k = 0; k < S; k++) aw[k] = 0, ab[k] = 0;
    if (p < steps) {
#pragma unroll 4
        for (int64_t r = g; r < rows; r += warps) {
            const Pack<T> d = load_pack(dy + r * dys + p * S), xv = load_pack(x + r * xs + p * S);
            const A mu = mean[r], rs = rstd[r];
#pragma unroll
            for (int k = 0; k < S; k++) {
                const A dk = to_acc(d.v[k]);
                aw[k] += dk * ((to_acc(xv.v[k]) - mu) * rs);
                ab[k] += dk;
            }
        }
    }
    if (g > 0)
#pragma unroll
        for (int k = 0; k < S; k++) others_w[g - 1][k * 32 + lane] = aw[k], others_b[g - 1][k * 32 + lane] = ab[k];
    __syncthreads();
    if (g > 0 || p >= steps) return;
    for (int j = 0; j < warps - 1; j++)
#pragma unroll
        for (int k = 0; k < S; k++) aw[k] += others_w[j][k * 32 + lane], ab[k] += others_b[j][k * 32 + lane];
    if (dw) store_sums<W, S>(dw + p * S, aw);
    if (db) store_sums<W, S>(db + p * S, ab);
}

/* Staged backward: the path for packed rows when there are many more rows
 * than SMs, rms_norm's structure (norm_plan.cuh, row_pipeline.cuh) with two
 * sums a row. A block (or a cluster of CTAS CTAs, each owning a 1/CTAS slice
 * of the columns) streams rows of x and dy through a ring of kStages row
 * stages in shared memory, filled by cp.async kStages - 1 rows ahead: the
 * next rows' bytes stay in flight while the block reduces and writes the
 * current row, and they take no registers. A thread owns the same packs of
 * every row, so its dweight and dbias sums sit in its registers, and so
 * does the weight when it has x's dtype (an f32 weight beside 16-bit x
 * would take twice the registers: it is read again each row, an L1 hit).
 * partial is (2, parts, n): cluster c's dweight and dbias sums over its
 * rows, rows c and parts + c. */
template <typename T, typename W, typename A, int ITERS, int CTAS>
__global__ void __launch_bounds__(kResidentThreads)
layer_norm_bwd_staged_kernel(int64_t rows, int64_t n, const T *__restrict__ dy, int64_t dys,
                             const T *__restrict__ x, int64_t xs, const W *__restrict__ w,
                             const A *__restrict__ mean, const A *__restrict__ rstd, T *__restrict__ dx,
                             int64_t dxs, A *__restrict__ partial, int64_t parts) {
    let_next_launch_start(); /* the dweight column sums may launch now; they wait for this launch to end */
    constexpr int S = Pack<T>::VEC;
    constexpr bool kHoldWeight = sizeof(W) == sizeof(T);
    extern __shared__ __align__(16) unsigned char dynamic_smem[];
    /* ring slot 0 holds x's pack, slot 1 dy's */
    const RowRing<T, kStages, 2, ITERS> ring{reinterpret_cast<Pack<T> *>(dynamic_smem)};
    __shared__ A scratch[64], cluster_slots[2 * CTAS];
    __shared__ uint64_t cluster_barriers[2];
    ClusterSum<CTAS, A> cluster{cluster_slots, cluster_barriers};
    cluster.init();
    const Slice<CTAS> sl(n, S);
    x += sl.col0;
    dy += sl.col0;
    dx += sl.col0;
    if (w) w += sl.col0;
    Pack<W> wp[kHoldWeight ? ITERS : 1];
    if constexpr (kHoldWeight)
        if (w) for_my_packs<ITERS>(sl.steps, [&](int it, int64_t i) { wp[it] = load_pack(w + i * S); });
    auto weight = [&](int it, int64_t i, A (&out)[S]) {
        if constexpr (kHoldWeight) {
#pragma unroll
            for (int k = 0; k < S; k++) out[k] = (A)to_acc(wp[it].v[k]);
        } else {
            load_param<W, A, S, true>(w + i * S, out);
        }
    };
    A dw[ITERS][S], db[ITERS][S];
#pragma unroll
    for (int it = 0; it < ITERS; it++)
#pragma unroll
        for (int k = 0; k < S; k++) dw[it][k] = 0, db[it][k] = 0;
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
        const A mu = mean[r], rs = rstd[r];
        cp_async_wait<kStages - 1>();
        A sg = 0, sgx = 0;
        for_my_packs<ITERS>(sl.steps, [&](int it, int64_t i) {
            const Pack<T> xv = ring.at(stage, 0, it), gv = ring.at(stage, 1, it);
            A wv[S];
            if (w) weight(it, i, wv);
#pragma unroll
            for (int k = 0; k < S; k++) {
                const A gk = w ? to_acc(gv.v[k]) * wv[k] : (A)to_acc(gv.v[k]);
                sg += gk;
                sgx += gk * (to_acc(xv.v[k]) - mu);
            }
        });
        block_sum2(sg, sgx, scratch);
        if constexpr (CTAS > 1) {
            /* two cluster rounds, which alternate slot sets: the barrier
             * between them keeps the contract that a CTA sends round k + 1
             * only after all its threads read round k (a peer may then
             * send round k + 2 into round k's slots); block_sum2 is that
             * barrier between one row's second round and the next row's
             * first */
            sg = cluster.sum(sg);
            __syncthreads();
            sgx = cluster.sum(sgx);
        }
        const A mg = sg / (A)n, mgx = sgx * rs / (A)n;
        for_my_packs<ITERS>(sl.steps, [&](int it, int64_t i) {
            const Pack<T> xv = ring.at(stage, 0, it), gv = ring.at(stage, 1, it);
            A wv[S];
            if (w) weight(it, i, wv);
            Pack<T> out;
#pragma unroll
            for (int k = 0; k < S; k++) {
                const A d = to_acc(gv.v[k]), xh = (to_acc(xv.v[k]) - mu) * rs;
                out.v[k] = from_acc<T>(rs * ((w ? d * wv[k] : d) - mg - xh * mgx));
                dw[it][k] += d * xh;
                db[it][k] += d;
            }
            store_pack(dx + r * dxs + i * S, out);
        });
        stage = stage + 1 == kStages ? 0 : stage + 1;
    }
    cp_async_wait<0>();
    if (partial) {
        A *pw = partial + sl.first * n + sl.col0, *pb = partial + (parts + sl.first) * n + sl.col0;
        for_my_packs<ITERS>(sl.steps, [&](int it, int64_t i) {
#pragma unroll
            for (int k = 0; k < S; k += 16 / (int)sizeof(A)) {
                store16(pw + i * S + k, dw[it] + k);
                store16(pb + i * S + k, db[it] + k);
            }
        });
    }
    cluster.finish();
}

/* --- plans ------------------------------------------------------------------ */

/* the generic backward's partial rows (dweight and dbias: 2 x 2^22 partial elements) */
int64_t bwd_max_groups(int64_t rows, int64_t n) { return partial_row_groups(rows, n, (int64_t)1 << 22); }

template <typename T, typename W, typename A> using FwdKernel =
    void (*)(int64_t, int64_t, const T *, int64_t, const W *, const W *, A, T *, int64_t, A *, A *);
template <typename T, typename W, typename A> using BwdKernel =
    void (*)(int64_t, int64_t, const T *, int64_t, const T *, int64_t, const W *, const A *, const A *, T *, int64_t,
             A *, int64_t);

template <typename T, typename W, typename A>
FwdKernel<T, W, A> fwd_resident_kernel(int iters, bool warp_rows, bool latency) {
    if (warp_rows) {
        /* 1 pack a lane is at 40 registers already */
        const int lean = norm_tuning().warp_row_lean;
        switch (iters) {
        case 1: return layer_norm_fwd_resident_kernel<T, W, A, 1, true, false>;
        case 2: return lean >= 2 ? layer_norm_fwd_resident_kernel<T, W, A, 2, true, false, true>
                                 : layer_norm_fwd_resident_kernel<T, W, A, 2, true, false>;
        default: return lean >= 4 ? layer_norm_fwd_resident_kernel<T, W, A, 4, true, false, true>
                                  : layer_norm_fwd_resident_kernel<T, W, A, 4, true, false>;
        }
    }
    /* the weight and bias in registers before the rows: in the throughput
     * plan they cost the registers that keep more rows in flight (2 packs a
     * thread: 86 against 63, bf16); OPSMITH_NORM_FWD_EARLY=0 keeps them to
     * the short batch's plan, to time the two (norm_plan.cuh) */
    if (iters <= 2 && (latency || norm_tuning().fwd_early))
        return iters == 1 ? layer_norm_fwd_resident_kernel<T, W, A, 1, false, true>
                          : layer_norm_fwd_resident_kernel<T, W, A, 2, false, true>;
    switch (iters) {
    case 1: return layer_norm_fwd_resident_kernel<T, W, A, 1, false, false>;
    case 2: return layer_norm_fwd_resident_kernel<T, W, A, 2, false, false>;
    case 4: return layer_norm_fwd_resident_kernel<T, W, A, 4, false, false>;
    default: return layer_norm_fwd_resident_kernel<T, W, A, 8, false, false>;
    }
}

template <typename T, typename W, typename A> BwdKernel<T, W, A> bwd_resident_kernel(int iters) {
    switch (iters) {
    case 1: return layer_norm_bwd_resident_kernel<T, W, A, 1>;
    case 2: return layer_norm_bwd_resident_kernel<T, W, A, 2>;
    case 4: return layer_norm_bwd_resident_kernel<T, W, A, 4>;
    default: return layer_norm_bwd_resident_kernel<T, W, A, 8>;
    }
}

template <typename T, typename W, typename A> using BwdSplitKernel =
    void (*)(int64_t, int64_t, const T *, int64_t, const T *, int64_t, const W *, const A *, const A *, T *, int64_t,
             W *, W *);

template <typename T, typename W, typename A> BwdKernel<T, W, A> bwd_staged_kernel(int iters, int ctas) {
    switch (ctas) {
    case 1: return iters == 1 ? layer_norm_bwd_staged_kernel<T, W, A, 1, 1>
                 : iters == 2 ? layer_norm_bwd_staged_kernel<T, W, A, 2, 1>
                              : layer_norm_bwd_staged_kernel<T, W, A, 4, 1>;
    case 2: return layer_norm_bwd_staged_kernel<T, W, A, 4, 2>;
    case 4: return layer_norm_bwd_staged_kernel<T, W, A, 4, 4>;
    default: return layer_norm_bwd_staged_kernel<T, W, A, 4, 8>;
    }
}

const Launch kGeneric{nullptr, 0, 0, 0, 0, "generic"};

/* Forward plan for packed rows: a short batch (no more rows than SMs) the
 * latency plan (widest block, fewest packs a thread); many short rows a
 * warp a row; many other rows the throughput plan up to 4 packs a thread,
 * as rms_norm's; grid == 0: generic. */
template <typename T, typename W, typename A> Launch fwd_launch(int64_t rows, int64_t n) {
    const int64_t vec = Pack<T>::VEC;
    if (n % vec != 0) return kGeneric;
    const int64_t steps = n / vec;
    const bool latency = rows <= sm_count();
    if (!latency && steps <= norm_tuning().warp_row_packs) {
        int iters = 1;
        while (32 * iters < steps) iters *= 2;
        const int64_t per_block = kWarpRowsBlock / 32, blocks = (rows + per_block - 1) / per_block;
        return Launch{reinterpret_cast<const void *>(fwd_resident_kernel<T, W, A>(iters, true, false)),
                      kWarpRowsBlock, 1, 0, blocks < kMaxGrid ? blocks : kMaxGrid, "warp"};
    }
    const Resident res = norm_fwd_resident(steps, latency, latency ? kResidentIters : 4);
    if (!res.iters) return kGeneric;
    const int64_t grid = rows < kMaxGrid ? rows : kMaxGrid;
    return Launch{reinterpret_cast<const void *>(fwd_resident_kernel<T, W, A>(res.iters, false, latency)),
                  res.threads, 1, 0, grid, "resident"};
}

/* The staged backward's launch (ring of x and dy: 2 slots a pack). */
template <typename T, typename W, typename A> Launch bwd_staged_launch(int64_t rows, int64_t n) {
    int iters = 0, ctas = 0;
    Launch l = staged_plan<T>(n, 2, &iters, &ctas);
    if (!l.threads) return l;
    l.kernel = reinterpret_cast<const void *>(bwd_staged_kernel<T, W, A>(iters, ctas));
    return fit_grid(l, rows);
}

/* Backward plan for packed rows, as rms_norm's: many rows the staged kernel
 * (norm_plan.cuh's keep_staged says when it pays); otherwise the resident
 * kernel with as many blocks as fit at once (its shared memory holds 2n
 * sums); grid == 0: generic. */
template <typename T, typename W, typename A> Launch bwd_launch(int64_t rows, int64_t n, bool with_sums) {
    const int64_t vec = Pack<T>::VEC;
    if (n % vec != 0) return kGeneric;
    const int sms = sm_count();
    if (rows > sms) {
        const Launch l = keep_staged(bwd_staged_launch<T, W, A>(rows, n), rows, sms);
        if (l.grid) return l;
    }
    const Resident plan = resident_plan(n / vec, kBwdMinThreads, rows <= sms, kResidentIters);
    if (!plan.iters) return kGeneric;
    Launch l{reinterpret_cast<const void *>(bwd_resident_kernel<T, W, A>(plan.iters)), plan.threads, 1,
             with_sums ? 2 * (size_t)n * sizeof(A) : 0, 0, "resident"};
    l = fit_grid(l, rows);
    if (!l.grid) l.family = "generic";
    return l;
}

/* The split plan (layer_norm_bwd_split_kernel, norm_plan.cuh's split_launch)
 * for a short batch of packed rows with dweight or dbias. */
template <typename T, typename W, typename A> Launch bwd_split_launch(int64_t rows, int64_t n) {
    const void *const kernels[4] = {reinterpret_cast<const void *>(layer_norm_bwd_split_kernel<T, W, A, 1>),
                                    reinterpret_cast<const void *>(layer_norm_bwd_split_kernel<T, W, A, 2>),
                                    reinterpret_cast<const void *>(layer_norm_bwd_split_kernel<T, W, A, 4>),
                                    reinterpret_cast<const void *>(layer_norm_bwd_split_kernel<T, W, A, 8>)};
    return split_launch(kernels, rows, n, Pack<T>::VEC);
}

template <typename T, typename W, typename A> using FwdRing =
    void (*)(int64_t, int64_t, const T *, int64_t, const W *, const W *, A, T *, int64_t, A *, A *, int);

/* The ring forward's launch for packed rows, grid == 0 when it does not apply. */
template <typename T, typename W, typename A> Launch fwd_ring_launch(int64_t rows, int64_t n, int *stages) {
    if (!norm_ring_applies(rows, n, Pack<T>::VEC)) return kGeneric;
    const int64_t packs = n / Pack<T>::VEC;
    const void *const kernels[4] = {reinterpret_cast<const void *>(layer_norm_fwd_ring_kernel<T, W, A, 1>),
                                    reinterpret_cast<const void *>(layer_norm_fwd_ring_kernel<T, W, A, 2>),
                                    reinterpret_cast<const void *>(layer_norm_fwd_ring_kernel<T, W, A, 4>),
                                    reinterpret_cast<const void *>(layer_norm_fwd_ring_kernel<T, W, A, 8>)};
    Launch l = ring_launch(kernels, rows, packs, 1, stages);
    if (l.grid) l.family = "ring";
    return l;
}

/* The forward's plan for packed rows, the launcher's and the plan query's:
 * the ring where it applies (*stages 1 or 2), else the resident or warp
 * plan (*stages 0; grid 0: the generic kernel). */
template <typename T, typename W, typename A> Launch fwd_plan(int64_t rows, int64_t n, int *stages) {
    const Launch ring = fwd_ring_launch<T, W, A>(rows, n, stages);
    if (ring.grid) return ring;
    *stages = 0;
    return fwd_launch<T, W, A>(rows, n);
}

template <typename T, typename W, typename A>
opsmith_status fwd(int64_t rows, int64_t n, const void *x, int64_t xs, const void *w, const void *b, double eps,
                   void *y, int64_t ys, void *mean, void *rstd, cudaStream_t stream) {
    const bool packed = packed_ok(n, Pack<T>::VEC, {xs, ys}, {x, y, w, b});
    const T *xp = static_cast<const T *>(x);
    const W *wp = static_cast<const W *>(w), *bp = static_cast<const W *>(b);
    T *yp = static_cast<T *>(y);
    A *mp = static_cast<A *>(mean), *rp = static_cast<A *>(rstd);
    int stages = 0;
    const Launch l = packed ? fwd_plan<T, W, A>(rows, n, &stages) : kGeneric;
    if (l.grid && stages) {
        launch<FwdRing<T, W, A>>(l, stream, rows, n, xp, xs, wp, bp, (A)eps, yp, ys, mp, rp, stages);
        return launch_status();
    }
    if (l.grid) {
        launch<FwdKernel<T, W, A>>(l, stream, rows, n, xp, xs, wp, bp, (A)eps, yp, ys, mp, rp);
        return launch_status();
    }
    const Shape s = choose_shape(rows, n, packed ? Pack<T>::VEC : 1, kMaxGrid);
#define OPSMITH_LN_FWD(P, WR)                                                                                  \
    layer_norm_fwd_kernel<T, W, A, P, WR><<<(unsigned)s.grid, s.threads, 0, stream>>>(rows, n, xp, xs, wp, bp, \
                                                                                      (A)eps, yp, ys, mp, rp)
    if (packed) { if (s.warp_rows) OPSMITH_LN_FWD(true, true); else OPSMITH_LN_FWD(true, false); }
    else { if (s.warp_rows) OPSMITH_LN_FWD(false, true); else OPSMITH_LN_FWD(false, false); }
#undef OPSMITH_LN_FWD
    return launch_status();
}

/* Partial rows the backward may write per gradient (the most any of its
 * plans writes). */
template <typename T, typename W, typename A> int64_t bwd_parts(int64_t rows, int64_t n) {
    const Shape a = choose_shape(rows, n, Pack<T>::VEC, bwd_max_groups(rows, n));
    const Shape b = choose_shape(rows, n, 1, bwd_max_groups(rows, n));
    int64_t parts = a.groups > b.groups ? a.groups : b.groups;
    const Launch l = bwd_launch<T, W, A>(rows, n, true);
    if (l.grid && l.grid / l.ctas > parts) parts = l.grid / l.ctas;
    return parts;
}

template <typename T, typename W, typename A>
opsmith_status bwd(int64_t rows, int64_t n, const void *dy, int64_t dys, const void *x, int64_t xs, const void *w,
                   const void *mean, const void *rstd, void *dx, int64_t dxs, void *dw, void *db, void *workspace,
                   cudaStream_t stream) {
    const bool packed = packed_ok(n, Pack<T>::VEC, {xs, dys, dxs}, {x, dy, dx, w});
    const T *dyp = static_cast<const T *>(dy), *xp = static_cast<const T *>(x);
    const W *wp = static_cast<const W *>(w);
    const A *mp = static_cast<const A *>(mean), *rp = static_cast<const A *>(rstd);
    T *dxp = static_cast<T *>(dx);
    const bool sums = dw || db;
    if (packed && sums && (!dw || aligned16(dw)) && (!db || aligned16(db)) &&
        !rows_overlap(dx, dxs, sizeof(T), dy, dys, sizeof(T), rows, n) &&
        !rows_overlap(dx, dxs, sizeof(T), x, xs, sizeof(T), rows, n)) {
        const Launch split = bwd_split_launch<T, W, A>(rows, n);
        if (split.grid) {
            launch<BwdSplitKernel<T, W, A>>(split, stream, rows, n, dyp, dys, xp, xs, wp, mp, rp, dxp, dxs,
                                            static_cast<W *>(dw), static_cast<W *>(db));
            return launch_status();
        }
    }
    A *partial = sums ? static_cast<A *>(workspace) : nullptr;
    /* the workspace's layout is fixed by the size query's plan count */
    const int64_t cap = sums ? bwd_parts<T, W, A>(rows, n) : 0;
    int64_t parts;
    const Launch l = packed ? bwd_launch<T, W, A>(rows, n, sums) : kGeneric;
    if (l.grid) {
        parts = l.grid / l.ctas;
        launch<BwdKernel<T, W, A>>(l, stream, rows, n, dyp, dys, xp, xs, wp, mp, rp, dxp, dxs, partial, cap);
    } else {
        const Shape s = choose_shape(rows, n, packed ? Pack<T>::VEC : 1, bwd_max_groups(rows, n));
        parts = s.groups;
#define OPSMITH_LN_BWD(P, WR)                                                                       \
    layer_norm_bwd_kernel<T, W, A, P, WR><<<(unsigned)s.grid, s.threads, 0, stream>>>(            \
        rows, n, dyp, dys, xp, xs, wp, mp, rp, dxp, dxs, partial, cap)
        if (packed) { if (s.warp_rows) OPSMITH_LN_BWD(true, true); else OPSMITH_LN_BWD(true, false); }
        else { if (s.warp_rows) OPSMITH_LN_BWD(false, true); else OPSMITH_LN_BWD(false, false); }
#undef OPSMITH_LN_BWD
    }
    opsmith_status st = launch_status();
    if (st != OPSMITH_STATUS_SUCCESS || !sums) return st;
    /* dweight and dbias in the same launches (one or two, not two or four) */
    sum_partial_row_pair<W, A>(parts, n, partial, cap * n, partial + 2 * cap * n, static_cast<W *>(dw),
                               static_cast<W *>(db), stream);
    return launch_status();
}

/* Calls f(T{}, W{}, A{}) for a checked (x_dtype, weight_dtype) pair. */
template <typename R, typename F> R dispatch_pair(opsmith_dtype xd, opsmith_dtype wd, R fallback, F f) {
    const bool f32w = wd == OPSMITH_DTYPE_F32 && xd != OPSMITH_DTYPE_F32;
    switch (xd) {
    case OPSMITH_DTYPE_F64: return f32w ? f(double{}, float{}, double{}) : f(double{}, double{}, double{});
    case OPSMITH_DTYPE_F32: return f(float{}, float{}, float{});
    case OPSMITH_DTYPE_F16: return f32w ? f(__half{}, float{}, float{}) : f(__half{}, __half{}, float{});
    case OPSMITH_DTYPE_BF16:
        return f32w ? f(__nv_bfloat16{}, float{}, float{}) : f(__nv_bfloat16{}, __nv_bfloat16{}, float{});
    default: return fallback;
    }
}

} // namespace
} // namespace opsmith

using namespace opsmith;

extern "C" opsmith_status opsmith_layer_norm_fwd_cuda(opsmith_dtype x_dtype, opsmith_dtype weight_dtype, int64_t rows,
                                                      int64_t n, const void *x, int64_t x_row_stride,
                                                      const void *weight, const void *bias, double eps, void *y,
                                                      int64_t y_row_stride, void *mean, void *rstd,
                                                      opsmith_cuda_stream stream) {
    const opsmith_layer_norm_args a = {"layer_norm_fwd_cuda", 0, x_dtype, weight_dtype, rows, n, x, x_row_stride,
                                       nullptr, 0, weight, bias, eps, y, y_row_stride, mean, rstd, nullptr, nullptr};
    opsmith_status st = opsmith_internal_layer_norm_check(&a);
    if (st != OPSMITH_STATUS_SUCCESS || rows == 0) return st;
    return dispatch_pair(x_dtype, weight_dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto t, auto w, auto acc) {
        return fwd<decltype(t), decltype(w), decltype(acc)>(rows, n, x, x_row_stride, weight, bias, eps, y,
                                                            y_row_stride, mean, rstd, stream);
    });
}

extern "C" const char *opsmith_internal_layer_norm_cuda_plan(opsmith_dtype x_dtype, opsmith_dtype weight_dtype,
                                                             int64_t rows, int64_t n, int backward) {
    Launch l = dispatch_pair(x_dtype, weight_dtype, kGeneric, [&](auto t, auto w, auto acc) {
        using T = decltype(t);
        using W = decltype(w);
        using A = decltype(acc);
        if (backward) {
            const Launch split = bwd_split_launch<T, W, A>(rows, n);
            return split.grid ? split : bwd_launch<T, W, A>(rows, n, true);
        }
        int stages = 0;
        return fwd_plan<T, W, A>(rows, n, &stages);
    });
    return l.grid > 0 ? l.family : "generic";
}

extern "C" size_t opsmith_layer_norm_bwd_cuda_workspace_size(opsmith_dtype x_dtype, opsmith_dtype weight_dtype,
                                                             int64_t rows, int64_t n, const void *dy,
                                                             int64_t dy_row_stride, const void *x,
                                                             int64_t x_row_stride, const void *weight,
                                                             const void *mean, const void *rstd, void *dx,
                                                             int64_t dx_row_stride, void *dweight, void *dbias) {
    (void)dy, (void)dy_row_stride, (void)x, (void)x_row_stride, (void)mean, (void)rstd, (void)dx, (void)dx_row_stride;
    if (!((weight && dweight) || dbias) || rows <= 0 || n <= 0) return 0;
    if (weight_dtype != x_dtype && weight_dtype != OPSMITH_DTYPE_F32) return 0;
    const int64_t parts = dispatch_pair(x_dtype, weight_dtype, (int64_t)0, [&](auto t, auto w, auto acc) {
        return bwd_parts<decltype(t), decltype(w), decltype(acc)>(rows, n);
    });
    const int64_t total = 2 * (parts + reduce_chunks(parts)); /* both sets' partial rows and chunk sums */
    return (size_t)(total * n) * opsmith_dtype_size(opsmith_dtype_accumulate(x_dtype));
}

extern "C" opsmith_status opsmith_layer_norm_bwd_cuda(opsmith_dtype x_dtype, opsmith_dtype weight_dtype, int64_t rows,
                                                      int64_t n, const void *dy, int64_t dy_row_stride, const void *x,
                                                      int64_t x_row_stride, const void *weight, const void *mean,
                                                      const void *rstd, void *dx, int64_t dx_row_stride,
                                                      void *dweight, void *dbias, void *workspace,
                                                      size_t workspace_bytes, opsmith_cuda_stream stream) {
    static const char op[] = "layer_norm_bwd_cuda";
    void *dw = weight ? dweight : nullptr;
    const opsmith_layer_norm_args a = {op, 1, x_dtype, weight_dtype, rows, n, x, x_row_stride, dy, dy_row_stride,
                                       weight, nullptr, 0.0, dx, dx_row_stride, mean, rstd, dw, dbias};
    opsmith_status st = opsmith_internal_layer_norm_check(&a);
    if (st != OPSMITH_STATUS_SUCCESS) return st;
    if (rows == 0) {
        /* no rows: the parameter gradients are empty sums */
        const size_t bytes = (size_t)n * opsmith_dtype_size(weight_dtype);
        if ((dw && cudaMemsetAsync(dw, 0, bytes, stream) != cudaSuccess) ||
            (dbias && cudaMemsetAsync(dbias, 0, bytes, stream) != cudaSuccess))
            return launch_status();
        return OPSMITH_STATUS_SUCCESS;
    }
    st = opsmith_internal_check_workspace(
        op, workspace, workspace_bytes,
        opsmith_layer_norm_bwd_cuda_workspace_size(x_dtype, weight_dtype, rows, n, dy, dy_row_stride, x, x_row_stride,
                                                   weight, mean, rstd, dx, dx_row_stride, dw, dbias));
    if (st != OPSMITH_STATUS_SUCCESS) return st;
    return dispatch_pair(x_dtype, weight_dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto t, auto w, auto acc) {
        return bwd<decltype(t), decltype(w), decltype(acc)>(rows, n, dy, dy_row_stride, x, x_row_stride, weight, mean,
                                                            rstd, dx, dx_row_stride, dw, dbias, workspace, stream);
    });
}
