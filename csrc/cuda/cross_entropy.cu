/* cross_entropy on CUDA. Three launches a forward, none of them waiting on
 * the host (so the forward and backward capture in a CUDA graph):
 *   1. prep (one block): the mean's denominator (sum of w[t] over the rows
 *      not ignored) and W = sum_c w[c], into the workspace;
 *   2. rows: with the gradient, for 16-byte aligned rows that fit on chip,
 *      the row is loaded once into the shared memory of a thread-block
 *      cluster (one CTA for narrow rows, up to 8 for wider;
 *      online_softmax.cuh, ring_launch), persistent over the rows with the
 *      next row's slice loading while this one is worked on where one CTA
 *      holds two, reduced
 *      (max, exponential sum; the weighted logit sum when smoothing), the
 *      partials exchanged through distributed shared memory, and - the
 *      fused training path - the gradient of the reduced loss written from
 *      shared memory: logits read once, gradient written once. Otherwise
 *      (no gradient, unaligned rows, rows too wide, no clusters) a block a row streams
 *      through it: sweep 1 for the statistics (16-byte packs with a scalar
 *      tail), sweep 2 reads the row again (from L2 where it still is) for
 *      the gradient. Either way over the logits when dlogits is logits:
 *      each element is read before it is written;
 *   3. finish (one block): the reduced loss and z-loss in a fixed order
 *      (deterministic), or the per-row values for reduction none.
 * A target out of range sets the device-side error flag (row, value) and
 * makes that row's loss and gradient NaN. Arithmetic in Acc (double for
 * f64, float otherwise); exponentials as RowStat/RowNorm take them (a
 * subtraction, a multiply and ex2 an element in float). Formulas in
 * include/opsmith/cross_entropy.h. */
#include "common.cuh"
#include "online_softmax.cuh"
#include "internal/cross_entropy.h"

namespace opsmith {
namespace {

constexpr int kPrepThreads = 1024;

template <typename A> struct Opts {
    A ls_n;        /* label_smoothing / n */
    A one_m_ls;    /* 1 - label_smoothing */
    A z;           /* z_loss */
    A cap, inv_cap; /* softcap, 1 / softcap (0: none) */
};

template <typename A> __device__ __forceinline__ A capped(A v, const Opts<A> &o) {
    return o.cap > A(0) ? o.cap * tanh_acc(v * o.inv_cap) : v;
}

/* dw: denom, wsum (the fused linear op's chunks share one pair); the
 * forward's workspace: loss_rows[rows], z_rows[rows] (only when z_loss > 0;
 * z_rows is NULL otherwise), denom, wsum */
template <typename A>
__global__ void __launch_bounds__(kPrepThreads)
prep_kernel(int64_t rows, int64_t n, const int64_t *__restrict__ tg, int64_t ts, const A *__restrict__ w,
            int64_t ignore, A *__restrict__ dw) {
    __shared__ A scratch[32];
    A d = 0, ww = 0;
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
        const int64_t t = tg[r * ts];
        if (t != ignore && t >= 0 && t < n) d += w ? w[t] : A(1);
    }
    if (w)
        for (int64_t c = threadIdx.x; c < n; c += blockDim.x) ww += w[c];
    d = block_sum(d, scratch);
    ww = w ? block_sum(ww, scratch) : A(n);
    if (threadIdx.x == 0) dw[0] = d, dw[1] = ww;
}

/* Label smoothing's reference logit: the row's first (softcapped; 0 where
 * it is not finite), read by every thread before any write of the row.
 * Smoothing's term sum_c w_c (lse - y_c) is then W ((m - ref) + log_s) -
 * sum_c w_c (y_c - ref): differences from a value near the row's, where
 * W lse - sum w y subtracts two terms of ~1e11 at logits ~1e6 over 128256
 * classes (the CPU, which forms it from the row's max, came back 4.7 off a
 * loss of 14 that way). */
template <typename T, typename A> __device__ __forceinline__ A smooth_ref(const T *xr, const Opts<A> &o) {
    const A v = capped(to_acc(xr[0]), o);
    return isfinite(v) ? v : A(0);
}

/* N logits (a pack, or one element) starting at column c, softcapped, into
 * the row's statistics, and their weighted differences from ref into wy
 * when smoothing */
template <typename A, int N>
__device__ __forceinline__ void add_logits(A (&y)[N], int64_t c, const A *w, bool smooth, A ref, RowStat<A> &st,
                                           A &wy) {
    st.add(y);
    if (smooth)
#pragma unroll
        for (int k = 0; k < N; k++) wy += (w ? w[c + k] : A(1)) * (y[k] - ref);
}

/* What a row's threads share once its statistics are final: the loss
 * (written by one thread) and each element's gradient of the reduced loss. */
template <typename A> struct RowGrad {
    RowNorm<A> nr;
    A coef, tcoef, sm, fill;
    int64_t t;
    bool zero;
    const A *w;
    Opts<A> o;
    /* p(y) * coef as term(y) * (inv_s * coef): one multiply an element */
    __device__ __forceinline__ A p_coef(A y) const { return Ex<A>::term(y, nr.m) * (nr.inv_s * coef); }
    __device__ __forceinline__ A operator()(A v, int64_t c) const {
        if (zero) return fill;
        const A y = capped(v, o);
        A g = p_coef(y) - sm * (w ? w[c] : A(1));
        if (c == t) g -= tcoef;
        if (o.cap > A(0)) g *= A(1) - (y * o.inv_cap) * (y * o.inv_cap);
        return g;
    }
};

/* The row's loss, z-loss and lse (one thread), and its gradient's
 * constants. y_t: the target's capped logit, read before any write. */
template <typename A>
__device__ __forceinline__ RowGrad<A> row_finish(const RowStat<A> &st, A wy, A ref, A y_t, int64_t r, int64_t t,
                                                 bool ignored, bool bad, const A *w, const Opts<A> &o, int reduction,
                                                 const A *dw, A *loss_rows, A *z_rows, int64_t row_offset,
                                                 A *lse_out, int64_t *error, bool writer) {
    const RowNorm<A> nr(st);
    const A lse = nr.lse();
    const bool smooth = o.ls_n > A(0);
    const A W = dw[1];
    const A wt = ignored || bad ? A(0) : w ? w[t] : A(1);
    if (writer) {
        if (lse_out) lse_out[r] = lse;
        A l = 0, zl = 0;
        if (bad) {
            l = zl = nan_acc<A>();
            if (atomicCAS(reinterpret_cast<unsigned long long *>(error), 0ull, 1ull) == 0ull)
                error[1] = row_offset + r, error[2] = t;
        } else if (!ignored) {
            zl = o.z * lse * lse;
            /* (m - y_t) + log_s: lse - y_t without lse's rounding */
            l = o.one_m_ls * wt * ((nr.m - y_t) + nr.log_s) + zl;
            if (smooth) l += o.ls_n * (W * ((nr.m - ref) + nr.log_s) - wy); /* sum_c w_c (lse - y_c), smooth_ref */
        }
        loss_rows[r] = l;
        if (z_rows) z_rows[r] = zl;
    }
    const A scale = reduction == OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN ? A(1) / dw[0] : A(1);
    RowGrad<A> g{nr, (o.one_m_ls * wt + o.ls_n * W + A(2) * o.z * lse) * scale, o.one_m_ls * wt * scale,
                 o.ls_n * scale, bad ? nan_acc<A>() : A(0), t, ignored || bad, w, o};
    return g;
}

template <typename T, typename A, bool PACKED>
__global__ void rows_kernel(int64_t rows, int64_t n, const T *x, int64_t xs, const int64_t *__restrict__ tg,
                            int64_t ts, const A *__restrict__ w, int64_t ignore, Opts<A> o, int reduction,
                            const A *__restrict__ dw, A *__restrict__ loss_rows, A *__restrict__ z_rows,
                            A *__restrict__ lse_out, T *dl, int64_t dls, int64_t *__restrict__ error,
                            int64_t row_offset) {
    __shared__ A scratch[64];
    constexpr int V = PACKED ? Pack<T>::VEC : 1;
    const int64_t r = blockIdx.x;
    const T *xr = x + r * xs;
    const int64_t t = tg[r * ts];
    const bool ignored = t == ignore, bad = !ignored && (t < 0 || t >= n);
    const bool smooth = o.ls_n > A(0);
    const int64_t body = PACKED ? n / V * V : 0;

    /* the target's logit, read before any thread can write over it (in place) */
    A y_t = 0;
    if (threadIdx.x == 0 && !ignored && !bad) y_t = capped(to_acc(xr[t]), o);

    /* sweep 1: max and exponential sum (and sum w (y - ref)), a pack at a time */
    const A ref = smooth ? smooth_ref(xr, o) : A(0);
    RowStat<A> st;
    A wy = 0;
    if constexpr (PACKED) {
        for (int64_t i = (int64_t)threadIdx.x * V; i < body; i += (int64_t)blockDim.x * V) {
            A y[V];
            unpack(load_pack(xr + i), y);
#pragma unroll
            for (int k = 0; k < V; k++) y[k] = capped(y[k], o);
            add_logits(y, i, w, smooth, ref, st, wy);
        }
    }
    for (int64_t i = body + threadIdx.x; i < n; i += blockDim.x) {
        const A y = capped(to_acc(xr[i]), o);
        A one[1] = {y};
        add_logits(one, i, w, smooth, ref, st, wy);
    }
    st.block_merge(scratch);
    if (smooth) wy = block_sum(wy, scratch);
    const RowGrad<A> grad = row_finish(st, wy, ref, y_t, r, t, ignored, bad, w, o, reduction, dw, loss_rows, z_rows,
                                       row_offset, lse_out, error, threadIdx.x == 0);
    if (!dl) return;

    /* sweep 2: the gradient, scaled by the reduction (the row again, from L2 while it is there) */
    T *d = dl + r * dls;
    const bool zero = grad.zero;
    if constexpr (PACKED) {
        for (int64_t i = (int64_t)threadIdx.x * V; i < body; i += (int64_t)blockDim.x * V) {
            A v[V] = {};
            if (!zero) unpack(load_pack(xr + i), v);
#pragma unroll
            for (int k = 0; k < V; k++) v[k] = grad(v[k], i + k);
            store_pack(d + i, pack_of<T>(v));
        }
    }
    for (int64_t i = body + threadIdx.x; i < n; i += blockDim.x) d[i] = from_acc<T>(grad(zero ? A(0) : to_acc(xr[i]), i));
}

/* The on-chip version (online_softmax.cuh, ring_launch): a persistent
 * cluster of CTAS CTAs walks rows blockIdx.x / CTAS, + clusters, ...; each
 * CTA holds its slice of a row's packs in shared memory (rows 16-byte
 * aligned: the packed condition), STAGES slices deep: with two, the next
 * row's slice loads while this one is reduced and written. Every thread
 * loads, reads and writes only its own packs of a slice (the same j), so a
 * stage is free for the next load once the thread itself is done with it:
 * no block barrier for the ring. The last CTA also takes the tail (n % VEC
 * elements) straight from global memory, each element read and written by
 * one thread. In place is safe: a CTA writes only its own slice of its
 * row (and the last CTA the tail), after its own reads of it, and no CTA
 * reads global memory of the row that another CTA writes: the target's
 * logit is read by the thread that holds it (its pack in shared memory, or
 * its tail element), and the row's loss is written by that CTA (thread 0,
 * through shared memory), never read from global memory another CTA may
 * already have overwritten. The row loading meanwhile is another row. The CTAs'
 * partials go through ClusterGather (st.async and an mbarrier a row: no
 * release barrier, so a row never waits for the last row's gradient stores
 * to land). */
template <typename T, typename A, int CTAS, bool PLAIN>
__global__ void __launch_bounds__(kSliceThreads, kSliceMinBlocks)
rows_ring_kernel(int64_t rows, int64_t n, const T *x, int64_t xs, const int64_t *__restrict__ tg, int64_t ts,
                 const A *__restrict__ w, int64_t ignore, Opts<A> o, int reduction, const A *__restrict__ dw,
                 A *__restrict__ loss_rows, A *__restrict__ z_rows, A *__restrict__ lse_out, T *dl, int64_t dls,
                 int64_t *__restrict__ error, int64_t row_offset, int stages) {
    /* part: the gather's slots (m, s, sum w y); yt: the target's logit
     * from the thread that holds it to its CTA's thread 0, the row's writer,
     * by row parity (its holder writes it again two rows later, after a
     * block barrier the writer passes only once it has read it) */
    __shared__ A scratch[64], part[2 * CTAS * 3], yt[2];
    __shared__ uint64_t part_barriers[2];
    ClusterGather<CTAS, A, 3> cluster{part, part_barriers};
    cluster.init();
    constexpr int V = Pack<T>::VEC;
    const int64_t packs = n / V, body = packs * V;
    const RingCta<T, CTAS> c(packs);
    const int rank = c.rank;
    const bool smooth = o.ls_n > A(0);
    const int64_t ti = body + threadIdx.x; /* this thread's tail element, in the last CTA */
    const bool tail = rank == CTAS - 1 && ti < n;
    int parity = 0;
    ring_rows<T, CTAS>(rows, x, xs, stages, c, [&](int64_t r, const Pack<T> *buf) {
        const int par = parity;
        parity ^= 1;
        const T *xr = x + r * xs;
        const int64_t t = tg[r * ts];
        const bool ignored = t == ignore, bad = !ignored && (t < 0 || t >= n);
        A y_tail = 0;
        if (tail) y_tail = capped(to_acc(xr[ti]), o);
        /* the CTA holding the target's column (rank 0 without a target), and
         * in it the thread (recomputed where needed: cheaper than keeping it live) */
        const bool has_t = !ignored && !bad;
        auto owner = [&]() { return !has_t ? 0 : t < body ? (int)(t / V / c.slice) : CTAS - 1; };
        if (has_t && rank == owner()) {
            if (t < body) {
                const int it = (int)(t / V) - c.p0; /* the target's pack in this slice */
                if (it % blockDim.x == threadIdx.x) yt[par] = capped(to_acc(buf[it].v[t % V]), o);
            } else if (tail && ti == t) {
                yt[par] = y_tail;
            }
        }

        /* the row's first logit from global memory: no CTA writes the row before every CTA's partials are gathered */
        const A ref = !PLAIN && smooth ? smooth_ref(xr, o) : A(0);
        RowStat<A> st;
        A wy = 0;
        c.each([&](int i) {
            A y[V];
            unpack(buf[i], y);
            if constexpr (PLAIN) {
                st.add(y);
            } else {
#pragma unroll
                for (int k = 0; k < V; k++) y[k] = capped(y[k], o);
                add_logits(y, (int64_t)(c.p0 + i) * V, w, smooth, ref, st, wy);
            }
        });
        if (tail) {
            A one[1] = {y_tail};
            add_logits(one, ti, w, smooth, ref, st, wy);
        }
        st.block_merge(scratch); /* its block barriers also publish yt[par] */
        if (smooth) wy = block_sum(wy, scratch);
        if constexpr (CTAS > 1) {
            /* every CTA merges the CTAs' partials in rank order: the same bits everywhere */
            const A mine[3] = {st.m, st.s, wy};
            const A *all = cluster.gather(mine);
            st = RowStat<A>(all[0], all[1]);
            wy = all[2];
#pragma unroll
            for (int q = 1; q < CTAS; q++) {
                st.merge(all[3 * q], all[3 * q + 1]);
                wy += all[3 * q + 2];
            }
        }
        const bool writer = threadIdx.x == 0 && rank == owner();
        const A y_t = writer && has_t ? yt[par] : A(0);
        const RowGrad<A> grad = row_finish(st, wy, ref, y_t, r, t, ignored, bad, w, o, reduction, dw, loss_rows,
                                           z_rows, row_offset, lse_out, error, writer);
        if (!dl) return;
        T *d = dl + r * dls;
        T *dc = d + (int64_t)c.p0 * V; /* this CTA's slice of the row's gradient */
        if constexpr (PLAIN) {
            /* grad() without its per-element tests: p * coef, the target's
             * term taken off in the one pack holding it (the same bits) */
            if (grad.zero) { /* an ignored row (0) or a bad target (NaN) */
                A f[V];
#pragma unroll
                for (int k = 0; k < V; k++) f[k] = grad.fill;
                const Pack<T> q = pack_of<T>(f);
                c.each([&](int i) { store_pack(dc + i * V, q); });
                if (tail) d[ti] = q.v[0];
                return;
            }
            const int it = t >= body ? -1 : (int)(t / V) - c.p0;
            const int kt = (int)(t % V);
            c.each([&](int i) {
                A g[V];
                unpack(buf[i], g);
#pragma unroll
                for (int k = 0; k < V; k++) g[k] = grad.p_coef(g[k]);
                if (i == it) {
#pragma unroll
                    for (int k = 0; k < V; k++)
                        if (k == kt) g[k] -= grad.tcoef;
                }
                store_pack(dc + i * V, pack_of<T>(g));
            });
        } else {
            c.each([&](int i) {
                A v[V];
                unpack(buf[i], v);
                const int64_t col = (int64_t)(c.p0 + i) * V;
#pragma unroll
                for (int k = 0; k < V; k++) v[k] = grad(v[k], col + k);
                store_pack(d + col, pack_of<T>(v)); /* d + col: dc would hold two more registers (spills) */
            });
        }
        if (tail) d[ti] = from_acc<T>(grad(to_acc(xr[ti]), ti));
    });
    cluster.finish(); /* no CTA leaves while another may still send to it */
}

/* the reduced loss and z-loss (or the per-row values, reduction none) */
template <typename T, typename A>
__global__ void __launch_bounds__(kPrepThreads)
finish_kernel(int64_t rows, int reduction, const A *__restrict__ loss_rows, const A *__restrict__ z_rows,
              const A *__restrict__ dw, T *__restrict__ loss, T *__restrict__ zout) {
    __shared__ A scratch[32];
    if (reduction == OPSMITH_CROSS_ENTROPY_REDUCTION_NONE) {
        for (int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += (int64_t)gridDim.x * blockDim.x) {
            loss[r] = from_acc<T>(loss_rows[r]);
            if (zout) zout[r] = from_acc<T>(z_rows ? z_rows[r] : A(0));
        }
        return;
    }
    A l = 0, zl = 0;
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) l += loss_rows[r], zl += z_rows ? z_rows[r] : A(0);
    l = block_sum(l, scratch);
    zl = block_sum(zl, scratch);
    if (threadIdx.x == 0) {
        const A d = reduction == OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN ? dw[0] : A(1);
        loss[0] = from_acc<T>(l / d);
        if (zout) zout[0] = from_acc<T>(zl / d);
    }
}

/* dx[r, :] = grad[r * gs] * dl[r, :]; in place, rows whose grad is exactly 1
 * return at once (the common loss.backward(): no traffic at all). G: the
 * grad's type, T or A (a float32 loss's gradient, read unrounded). */
template <typename T, typename A, bool PACKED, typename G>
__global__ void scale_kernel(int64_t n, const G *__restrict__ g, int64_t gs, const T *dl, int64_t dls, T *dx,
                             int64_t dxs) {
    constexpr int V = PACKED ? Pack<T>::VEC : 1;
    const int64_t r = blockIdx.x;
    const A s = to_acc(g[r * gs]);
    if (dx == dl && s == A(1)) return;
    const T *in = dl + r * dls;
    T *out = dx + r * dxs;
    const int64_t body = PACKED ? n / V * V : 0;
    if constexpr (PACKED) {
        for (int64_t i = (int64_t)threadIdx.x * V; i < body; i += (int64_t)blockDim.x * V) {
            const Pack<T> p = *reinterpret_cast<const Pack<T> *>(in + i);
            Pack<T> q;
#pragma unroll
            for (int k = 0; k < V; k++) q.v[k] = from_acc<T>(to_acc(p.v[k]) * s);
            store_pack(out + i, q);
        }
    }
    for (int64_t i = body + threadIdx.x; i < n; i += blockDim.x) out[i] = from_acc<T>(to_acc(in[i]) * s);
}

/* rows_ring_kernel for clusters of 1, 2, 4, 8 CTAs (ring_launch's table) */
template <typename T, typename A, bool PLAIN> const void *const *ring_kernels() {
    static const void *const k[4] = {reinterpret_cast<const void *>(rows_ring_kernel<T, A, 1, PLAIN>),
                                     reinterpret_cast<const void *>(rows_ring_kernel<T, A, 2, PLAIN>),
                                     reinterpret_cast<const void *>(rows_ring_kernel<T, A, 4, PLAIN>),
                                     reinterpret_cast<const void *>(rows_ring_kernel<T, A, 8, PLAIN>)};
    return k;
}

template <typename T, typename A>
using RingKernel = void (*)(int64_t, int64_t, const T *, int64_t, const int64_t *, int64_t, const A *, int64_t, Opts<A>,
                            int, const A *, A *, A *, A *, T *, int64_t, int64_t *, int64_t, int);

inline int threads_for(int64_t n, int vec) {
    const int64_t steps = (n + vec - 1) / vec;
    return steps >= 4096 ? 1024 : steps >= 1024 ? 512 : steps >= 256 ? 256 : 64;
}

template <opsmith_dtype D>
opsmith_status prep(int64_t rows, int64_t n, const int64_t *tg, int64_t ts, const void *w, int64_t ignore, void *dw,
                    cudaStream_t stream) {
    using A = typename Storage<D>::Acc;
    prep_kernel<A><<<1, kPrepThreads, 0, stream>>>(rows, n, tg, ts, static_cast<const A *>(w), ignore,
                                                   static_cast<A *>(dw));
    return launch_status();
}

template <opsmith_dtype D>
opsmith_status rows_pass(int64_t rows, int64_t n, const void *x, int64_t xs, const int64_t *tg, int64_t ts,
                         const void *w, int64_t ignore, double ls, double z, double cap, int red, const void *dw,
                         void *loss_rows, void *z_rows, void *lse, void *dl, int64_t dls, int64_t *error,
                         int64_t row_offset, cudaStream_t stream) {
    using T = typename Storage<D>::T;
    using A = typename Storage<D>::Acc;
    constexpr int vec = Pack<T>::VEC;
    if (rows == 0) return OPSMITH_STATUS_SUCCESS;
    Opts<A> o;
    o.ls_n = (A)(ls / (double)n), o.one_m_ls = (A)(1.0 - ls), o.z = (A)z, o.cap = (A)cap;
    o.inv_cap = cap > 0 ? (A)(1.0 / cap) : A(0);
    const T *xp = static_cast<const T *>(x);
    T *dp = static_cast<T *>(dl);
    const A *wp = static_cast<const A *>(w), *dwp = static_cast<const A *>(dw);
    A *lr = static_cast<A *>(loss_rows), *zr = static_cast<A *>(z_rows), *lp = static_cast<A *>(lse);
    const bool packed = aligned16(x) && (rows == 1 || xs % vec == 0) &&
                        (!dl || (aligned16(dl) && (rows == 1 || dls % vec == 0)));
    const int threads = threads_for(n, packed ? vec : 1);
    Launch l{nullptr, 0, 0, 0, 0, "streaming"};
    int stages = 1;
    /* a forward without the gradient reads each row once either way: the
     * streaming kernel, 0.56 of copy at 8192 x 128256 bf16 on the H200
     * against the ring's 0.51 (bench/NOTES.md, 2026-12-05) */
    if (packed && dl) {
        /* the common call (no class weights, no smoothing, no softcap) takes
         * the kernel without their per-element work (bench/NOTES.md) */
        const bool plain = !w && ls == 0.0 && !(cap > 0.0) && ring_tuning().specialised;
        l = ring_launch(plain ? ring_kernels<T, A, true>() : ring_kernels<T, A, false>(), rows, n / vec, 1, &stages);
    }
    if (l.grid)
        launch<RingKernel<T, A>>(l, stream, rows, n, xp, xs, tg, ts, wp, ignore, o, red, dwp, lr, zr, lp, dp, dls,
                                 error, row_offset, stages);
    else if (packed)
        rows_kernel<T, A, true><<<(unsigned)rows, threads, 0, stream>>>(rows, n, xp, xs, tg, ts, wp, ignore, o, red,
                                                                       dwp, lr, zr, lp, dp, dls, error, row_offset);
    else
        rows_kernel<T, A, false><<<(unsigned)rows, threads, 0, stream>>>(rows, n, xp, xs, tg, ts, wp, ignore, o, red,
                                                                        dwp, lr, zr, lp, dp, dls, error, row_offset);
    return launch_status();
}

template <opsmith_dtype D>
opsmith_status finish(int64_t rows, int red, const void *loss_rows, const void *z_rows, const void *dw, void *loss,
                      void *zout, cudaStream_t stream) {
    using T = typename Storage<D>::T;
    using A = typename Storage<D>::Acc;
    const unsigned fin = red == OPSMITH_CROSS_ENTROPY_REDUCTION_NONE
                             ? (unsigned)(rows / kPrepThreads + 1 < 4096 ? rows / kPrepThreads + 1 : 4096)
                             : 1u;
    finish_kernel<T, A><<<fin, kPrepThreads, 0, stream>>>(rows, red, static_cast<const A *>(loss_rows),
                                                          static_cast<const A *>(z_rows), static_cast<const A *>(dw),
                                                          static_cast<T *>(loss), static_cast<T *>(zout));
    return launch_status();
}

template <opsmith_dtype D>
opsmith_status fwd(int64_t rows, int64_t n, const void *x, int64_t xs, const int64_t *tg, int64_t ts, const void *w,
                   int64_t ignore, double ls, double z, double cap, int red, bool loss_acc, void *loss, void *zout,
                   void *lse, void *dl, int64_t dls, int64_t *error, void *workspace, cudaStream_t stream) {
    using A = typename Storage<D>::Acc;
    A *ws = static_cast<A *>(workspace);
    A *zr = static_cast<A *>(opsmith_internal_cross_entropy_z_rows(ws, rows, z, sizeof(A)));
    A *dw = ws + (zr ? 2 : 1) * rows;
    opsmith_status st = prep<D>(rows, n, tg, ts, w, ignore, dw, stream);
    if (st == OPSMITH_STATUS_SUCCESS)
        st = rows_pass<D>(rows, n, x, xs, tg, ts, w, ignore, ls, z, cap, red, dw, ws, zr, lse, dl, dls, error,
                          0, stream);
    /* a loss in the accumulate type: the finish of the accumulate type's own
     * forward (it reads the same A rows), as fused_linear_cross_entropy's */
    constexpr opsmith_dtype acc = D == OPSMITH_DTYPE_F64 ? OPSMITH_DTYPE_F64 : OPSMITH_DTYPE_F32;
    if (st == OPSMITH_STATUS_SUCCESS)
        st = loss_acc ? finish<acc>(rows, red, ws, zr, dw, loss, zout, stream)
                      : finish<D>(rows, red, ws, zr, dw, loss, zout, stream);
    return st;
}

template <typename T, typename A, typename G>
void scale(int64_t rows, int64_t n, const void *g, int64_t gs, const void *dl, int64_t dls, void *dx, int64_t dxs,
           cudaStream_t stream) {
    constexpr int vec = Pack<T>::VEC;
    const bool packed = aligned16(dl) && aligned16(dx) && (rows == 1 || (dls % vec == 0 && dxs % vec == 0));
    const int threads = threads_for(n, packed ? vec : 1);
    const G *gp = static_cast<const G *>(g);
    const T *dp = static_cast<const T *>(dl);
    T *xp = static_cast<T *>(dx);
    if (packed)
        scale_kernel<T, A, true, G><<<(unsigned)rows, threads, 0, stream>>>(n, gp, gs, dp, dls, xp, dxs);
    else
        scale_kernel<T, A, false, G><<<(unsigned)rows, threads, 0, stream>>>(n, gp, gs, dp, dls, xp, dxs);
}

template <opsmith_dtype D>
opsmith_status bwd(int64_t rows, int64_t n, bool grad_acc, const void *g, int64_t gs, const void *dl, int64_t dls,
                   void *dx, int64_t dxs, cudaStream_t stream) {
    using T = typename Storage<D>::T;
    using A = typename Storage<D>::Acc;
    if (grad_acc) scale<T, A, A>(rows, n, g, gs, dl, dls, dx, dxs, stream);
    else scale<T, A, T>(rows, n, g, gs, dl, dls, dx, dxs, stream);
    return launch_status();
}

} // namespace
} // namespace opsmith

using namespace opsmith;

extern "C" opsmith_status opsmith_cross_entropy_fwd_cuda(
    opsmith_dtype dtype, int64_t rows, int64_t n, const void *logits, int64_t logits_row_stride, const int64_t *target,
    int64_t target_stride, const void *weight, int64_t ignore_index, double label_smoothing, double z_loss,
    double softcap, opsmith_cross_entropy_reduction reduction, opsmith_dtype loss_dtype, void *loss, void *z_out,
    void *lse, void *dlogits, int64_t dlogits_row_stride, int64_t *error, void *workspace, size_t workspace_bytes,
    opsmith_cuda_stream stream) {
    opsmith_status st = opsmith_internal_cross_entropy_fwd_check(
        "cross_entropy_fwd_cuda", dtype, rows, n, logits, logits_row_stride, target, label_smoothing, z_loss, softcap,
        (int)reduction, loss_dtype, loss, dlogits, dlogits_row_stride, error, 1, workspace, workspace_bytes, weight, z_out,
        lse);
    if (st != OPSMITH_STATUS_SUCCESS) return st;
    if (rows > 0x7fffffffLL)
        return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT, "cross_entropy_fwd_cuda: rows (%lld) must be < 2^31",
                                     (long long)rows);
    return dispatch_float(dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto tag) {
        return fwd<decltype(tag)::value>(rows, n, logits, logits_row_stride, target, target_stride, weight,
                                         ignore_index, label_smoothing, z_loss, softcap, (int)reduction,
                                         loss_dtype != dtype, loss, z_out, lse, dlogits, dlogits_row_stride, error,
                                         workspace, stream);
    });
}

extern "C" opsmith_status opsmith_cross_entropy_bwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                         opsmith_dtype grad_dtype, const void *grad,
                                                         int64_t grad_stride, const void *dlogits,
                                                         int64_t dlogits_row_stride, void *dx, int64_t dx_row_stride,
                                                         opsmith_cuda_stream stream) {
    opsmith_status st = opsmith_internal_cross_entropy_bwd_check("cross_entropy_bwd_cuda", dtype, rows, n, grad_dtype,
                                                                 grad, grad_stride, dlogits, dlogits_row_stride, dx,
                                                                 dx_row_stride);
    if (st != OPSMITH_STATUS_SUCCESS || rows == 0) return st;
    if (rows > 0x7fffffffLL)
        return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT, "cross_entropy_bwd_cuda: rows (%lld) must be < 2^31",
                                     (long long)rows);
    return dispatch_float(dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto tag) {
        return bwd<decltype(tag)::value>(rows, n, grad_dtype != dtype, grad, grad_stride, dlogits, dlogits_row_stride,
                                         dx, dx_row_stride, stream);
    });
}

extern "C" opsmith_status opsmith_internal_cross_entropy_prep_cuda(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                                  const int64_t *target, int64_t target_stride,
                                                                  const void *weight, int64_t ignore_index,
                                                                  void *denom_wsum, opsmith_cuda_stream stream) {
    return dispatch_float(dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto tag) {
        return prep<decltype(tag)::value>(rows, n, target, target_stride, weight, ignore_index, denom_wsum, stream);
    });
}

extern "C" opsmith_status opsmith_internal_cross_entropy_rows_cuda(
    opsmith_dtype dtype, int64_t rows, int64_t n, const void *logits, int64_t logits_row_stride,
    const int64_t *target, int64_t target_stride, const void *weight, int64_t ignore_index, double label_smoothing,
    double z_loss, double softcap, int reduction, const void *denom_wsum, void *loss_rows, void *z_rows,
    void *dlogits, int64_t dlogits_row_stride, int64_t *error, int64_t row_offset, opsmith_cuda_stream stream) {
    if (rows > 0x7fffffffLL)
        return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT,
                                     "cross_entropy rows pass: rows (%lld) must be < 2^31", (long long)rows);
    return dispatch_float(dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto tag) {
        return rows_pass<decltype(tag)::value>(rows, n, logits, logits_row_stride, target, target_stride, weight,
                                               ignore_index, label_smoothing, z_loss, softcap, reduction, denom_wsum,
                                               loss_rows, z_rows, nullptr, dlogits, dlogits_row_stride, error, row_offset,
                                               stream);
    });
}

extern "C" opsmith_status opsmith_internal_cross_entropy_finish_cuda(opsmith_dtype dtype, int64_t rows, int reduction,
                                                                    const void *loss_rows, const void *z_rows,
                                                                    const void *denom_wsum, void *loss, void *z_out,
                                                                    opsmith_cuda_stream stream) {
    return dispatch_float(dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto tag) {
        return finish<decltype(tag)::value>(rows, reduction, loss_rows, z_rows, denom_wsum, loss, z_out, stream);
    });
}
