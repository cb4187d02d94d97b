/* softmax and log_softmax on CUDA. Aligned rows of whole packs: up to 256
 * packs a warp a row, up to 4096 packs (32K bf16) a block a row, the row
 * held in registers (fwd_warp_kernel, fwd_block_kernel and their
 * backwards). Wider 16-byte aligned rows that fit on
 * chip: the row is loaded once into the shared memory of a thread-block
 * cluster (one CTA for rows up to ~72 KB, up to 8 for wider;
 * online_softmax.cuh; the forward's clusters persistent over the rows, the
 * next row's slice loading while this one is worked on where two slices
 * fit), reduced, the partials exchanged through distributed
 * shared memory, and the outputs written from shared memory: forward x
 * read once and y written once; backward dy and y read once, dx written
 * once. Otherwise (unaligned rows, rows too wide, no clusters) a block a
 * row streams through it: forward sweep 1 for the max and exponential sum
 * (16-byte packs with a scalar tail), sweep 2 reads the row again (from L2
 * for rows in flight) and writes y; backward sweep 1 the row's dot product
 * (sum dy y, or sum dy for log_softmax), sweep 2 writes dx. Each element
 * is read before it is written, by the same thread or CTA, so y = x and
 * dx = dy are safe. y = exp(x - m) / sum and log y = (x - m) - log(sum)
 * (RowNorm): no lse is formed, whose float32 rounding at |x| ~ 1e4 would
 * be an error of y. No host synchronisation. Arithmetic in Acc (double for
 * f64, float otherwise). */
#include "common.cuh"
#include "online_softmax.cuh"
#include "rows.cuh"
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
    RowStat<A> st;
    if constexpr (PACKED) {
        for (int64_t i = (int64_t)threadIdx.x * V; i < body; i += (int64_t)blockDim.x * V) {
            A v[V];
            unpack(*reinterpret_cast<const Pack<T> *>(xr + i), v);
            st.add(v);
        }
    }
    for (int64_t i = body + threadIdx.x; i < n; i += blockDim.x) st.add1(to_acc(xr[i]));
    st.block_merge(scratch);
    const RowNorm<A> nr(st, lg);
    if constexpr (PACKED) {
        for (int64_t i = (int64_t)threadIdx.x * V; i < body; i += (int64_t)blockDim.x * V) {
            A v[V];
            unpack(*reinterpret_cast<const Pack<T> *>(xr + i), v);
#pragma unroll
            for (int k = 0; k < V; k++) v[k] = lg ? nr.logp(v[k]) : nr.p(v[k]);
            store_pack(yr + i, pack_of<T>(v));
        }
    }
    for (int64_t i = body + threadIdx.x; i < n; i += blockDim.x) {
        const A v = to_acc(xr[i]);
        yr[i] = from_acc<T>(lg ? nr.logp(v) : nr.p(v));
    }
}

/* The on-chip forward (online_softmax.cuh, ring_launch, ring_rows): a
 * persistent cluster of CTAS CTAs walks the rows, each CTA holding its slice
 * of a row of x in shared memory (the next row's loading meanwhile where two
 * slices fit), y written from there; the last CTA also takes the tail
 * (n % VEC) from global memory. y = x is safe: a CTA writes only its own
 * slice of its row, after its reads (the row loading meanwhile is another).
 * The CTAs' partials go through ClusterGather (no release barrier a row). */
template <typename T, typename A, int CTAS>
__global__ void __launch_bounds__(kSliceThreads, kSliceMinBlocks)
fwd_ring_kernel(int64_t rows, int64_t n, const T *x, int64_t xs, bool lg, T *y, int64_t ys, int stages) {
    __shared__ A scratch[64], part[2 * CTAS * 2];
    __shared__ uint64_t part_barriers[2];
    ClusterGather<CTAS, A, 2> cluster{part, part_barriers};
    cluster.init();
    constexpr int V = Pack<T>::VEC;
    const int64_t packs = n / V, body = packs * V;
    const RingCta<T, CTAS> c(packs);
    const int64_t ti = body + threadIdx.x;
    const bool tail = c.rank == CTAS - 1 && ti < n;
    ring_rows<T, CTAS>(rows, x, xs, stages, c, [&](int64_t r, const Pack<T> *buf) {
        const T *xr = x + r * xs;
        T *yr = y + r * ys;
        const A x_tail = tail ? to_acc(xr[ti]) : A(0);
        RowStat<A> st;
        c.each([&](int i) {
            A v[V];
            unpack(buf[i], v);
            st.add(v);
        });
        if (tail) st.add1(x_tail);
        st.block_merge(scratch);
        if constexpr (CTAS > 1) {
            const A mine[2] = {st.m, st.s};
            const A *all = cluster.gather(mine);
            st = RowStat<A>(all[0], all[1]);
#pragma unroll
            for (int q = 1; q < CTAS; q++) st.merge(all[2 * q], all[2 * q + 1]);
        }
        const RowNorm<A> nr(st, lg);
        T *yc = yr + (int64_t)c.p0 * V; /* this CTA's slice of the row */
        c.each([&](int i) {
            A v[V];
            unpack(buf[i], v);
#pragma unroll
            for (int k = 0; k < V; k++) v[k] = lg ? nr.logp(v[k]) : nr.p(v[k]);
            store_pack(yc + i * V, pack_of<T>(v));
        });
        if (tail) yr[ti] = from_acc<T>(lg ? nr.logp(x_tail) : nr.p(x_tail));
    });
    cluster.finish(); /* no CTA leaves while another may still send to it */
}

/* Narrow rows (at most 32 x P packs, n % VEC == 0): a warp a row, the row
 * in its lanes' registers (lane l holds packs l, l + 32, ...), the row's
 * statistics by shuffles alone (RowStat::warp_merge: no shared memory, no
 * block barrier), y written from the registers. The ring's CTA a row pays
 * a block merge and its barriers every row, over as few as 16 elements a
 * thread at n = 1024 bf16. y = x is safe: a lane writes only the packs it
 * has read. */
constexpr int kWarpRowThreads = 256;

template <typename T, typename A, int P>
__global__ void __launch_bounds__(kWarpRowThreads)
fwd_warp_kernel(int64_t rows, int packs, const T *x, int64_t xs, bool lg, T *y, int64_t ys) {
    constexpr int V = Pack<T>::VEC;
    const int lane = threadIdx.x & 31;
    const int64_t per_block = kWarpRowThreads / 32, step = (int64_t)gridDim.x * per_block;
    for (int64_t r = (int64_t)blockIdx.x * per_block + (threadIdx.x >> 5); r < rows; r += step) {
        const Pack<T> *xr = reinterpret_cast<const Pack<T> *>(x + r * xs);
        Pack<T> p[P];
#pragma unroll
        for (int q = 0; q < P; q++)
            if (lane + 32 * q < packs) p[q] = xr[lane + 32 * q];
        RowStat<A> st;
#pragma unroll
        for (int q = 0; q < P; q++)
            if (lane + 32 * q < packs) {
                A v[V];
                unpack(p[q], v);
                st.add(v);
            }
        st.warp_merge();
        const RowNorm<A> nr(st, lg);
        T *yr = y + r * ys;
#pragma unroll
        for (int q = 0; q < P; q++)
            if (lane + 32 * q < packs) {
                A v[V];
                unpack(p[q], v);
#pragma unroll
                for (int k = 0; k < V; k++) v[k] = lg ? nr.logp(v[k]) : nr.p(v[k]);
                store_pack(yr + (lane + 32 * q) * V, pack_of<T>(v));
            }
    }
}

/* The backward's two steps (dy in g, the forward's output in y): an
 * element's part of the row's sum (softmax: dy . y; log_softmax: the sum of
 * dy), and its dx given the row's sum s; then the same over a pack's V. */
template <typename A> __device__ __forceinline__ A row_sum_term(bool lg, A g, A y) { return lg ? g : g * y; }
template <typename A> __device__ __forceinline__ A grad_of(bool lg, A g, A y, A s) {
    return lg ? g - exp_acc(y) * s : y * (g - s);
}
template <typename A, int V> __device__ __forceinline__ void add_row_sum(A &s, bool lg, const A (&g)[V], const A (&y)[V]) {
#pragma unroll
    for (int k = 0; k < V; k++) s += row_sum_term(lg, g[k], y[k]);
}
template <typename A, int V> __device__ __forceinline__ void grad_in_place(A (&g)[V], bool lg, const A (&y)[V], A s) {
#pragma unroll
    for (int k = 0; k < V; k++) g[k] = grad_of(lg, g[k], y[k], s);
}

/* The backward of narrow rows, as fwd_warp_kernel: dy and y of the row in
 * the lanes' registers, their dot product by shuffles. dx = dy is safe. */
template <typename T, typename A, int P>
__global__ void __launch_bounds__(kWarpRowThreads)
bwd_warp_kernel(int64_t rows, int packs, const T *g, int64_t gs, const T *y, int64_t ys, bool lg, T *dx,
                int64_t dxs) {
    constexpr int V = Pack<T>::VEC;
    const int lane = threadIdx.x & 31;
    const int64_t per_block = kWarpRowThreads / 32, step = (int64_t)gridDim.x * per_block;
    for (int64_t r = (int64_t)blockIdx.x * per_block + (threadIdx.x >> 5); r < rows; r += step) {
        const Pack<T> *gr = reinterpret_cast<const Pack<T> *>(g + r * gs);
        const Pack<T> *yr = reinterpret_cast<const Pack<T> *>(y + r * ys);
        Pack<T> pg[P], py[P];
#pragma unroll
        for (int q = 0; q < P; q++)
            if (lane + 32 * q < packs) pg[q] = gr[lane + 32 * q], py[q] = yr[lane + 32 * q];
        /* f(q, dy's values, y's values) over the lane's packs */
        auto each = [&](auto f) {
#pragma unroll
            for (int q = 0; q < P; q++)
                if (lane + 32 * q < packs) {
                    A gv[V], yv[V];
                    unpack(pg[q], gv);
                    unpack(py[q], yv);
                    f(q, gv, yv);
                }
        };
        A s = 0;
        each([&](int, A(&gv)[V], A(&yv)[V]) { add_row_sum(s, lg, gv, yv); });
        s = warp_sum(s);
        T *dr = dx + r * dxs;
        each([&](int q, A(&gv)[V], A(&yv)[V]) {
            grad_in_place(gv, lg, yv, s);
            store_pack(dr + (lane + 32 * q) * V, pack_of<T>(gv));
        });
    }
}

/* Rows wider than a warp's, up to kBlockRowMaxPacks packs (32K bf16):
 * a block a row, the row in its threads' registers (thread t holds packs
 * t, t + blockDim.x, ... of kBlockRowPacks), the statistics by one block merge, y
 * written from the registers; a block for each row, so while one block of
 * an SM merges, the SM's others have their loads in flight (the norms'
 * resident forward, here without weights). The loads first, branch-free
 * (load_my_packs: a pack past the row's end loads the row's first again,
 * unused). y = x is safe: a thread writes only packs it has read, after
 * the block merge's barriers. */
constexpr int kBlockRowPacks = 4, kBlockRowMaxPacks = kMaxThreads * kBlockRowPacks;

template <typename T, typename A, int P>
__global__ void __launch_bounds__(kMaxThreads)
fwd_block_kernel(int packs, const T *x, int64_t xs, bool lg, T *y, int64_t ys) {
    __shared__ A scratch[64];
    constexpr int V = Pack<T>::VEC;
    const int64_t r = blockIdx.x;
    const T *xr = x + r * xs;
    Pack<T> p[P];
    load_my_packs<P>(packs, [&](int q, int64_t i) { p[q] = load_pack_here(xr + i * V); });
    RowStat<A> st;
    for_my_packs<P>(packs, [&](int q, int64_t) {
        A v[V];
        unpack(p[q], v);
        st.add(v);
    });
    st.block_merge(scratch);
    const RowNorm<A> nr(st, lg);
    T *yr = y + r * ys;
    for_my_packs<P>(packs, [&](int q, int64_t i) {
        A v[V];
        unpack(p[q], v);
#pragma unroll
        for (int k = 0; k < V; k++) v[k] = lg ? nr.logp(v[k]) : nr.p(v[k]);
        store_pack(yr + i * V, pack_of<T>(v));
    });
}

/* The backward of those rows: dy and y of the row in registers, their dot
 * product by one block sum. dx = dy is safe, as above. */
template <typename T, typename A, int P>
__global__ void __launch_bounds__(kMaxThreads)
bwd_block_kernel(int packs, const T *g, int64_t gs, const T *y, int64_t ys, bool lg, T *dx, int64_t dxs) {
    __shared__ A scratch[32];
    constexpr int V = Pack<T>::VEC;
    const int64_t r = blockIdx.x;
    const T *gr = g + r * gs, *yr = y + r * ys;
    Pack<T> pg[P], py[P];
    load_my_packs<P>(packs, [&](int q, int64_t i) {
        pg[q] = load_pack_here(gr + i * V);
        py[q] = load_pack_here(yr + i * V);
    });
    A s = 0;
    for_my_packs<P>(packs, [&](int q, int64_t) {
        A gv[V], yv[V];
        unpack(pg[q], gv);
        unpack(py[q], yv);
        add_row_sum(s, lg, gv, yv);
    });
    s = block_sum(s, scratch);
    T *dr = dx + r * dxs;
    for_my_packs<P>(packs, [&](int q, int64_t i) {
        A gv[V], yv[V];
        unpack(pg[q], gv);
        unpack(py[q], yv);
        grad_in_place(gv, lg, yv, s);
        store_pack(dr + i * V, pack_of<T>(gv));
    });
}

/* The widest row, in packs, that takes a block a row: OPSMITH_SOFTMAX_BLOCK_PACKS
 * (default kBlockRowMaxPacks; 0: none, the ring takes them), read once, so a
 * benchmark compares the plans in one build. On the H100 the block rows
 * beat the ring at every width they take (16384 x 16384 bf16 forward 0.94
 * -> 0.99 of copy, 8192 x 32768 0.93 -> 0.96; bench/NOTES.md). */
inline int64_t block_row_max_packs() {
    static const int64_t v = tuning_env("OPSMITH_SOFTMAX_BLOCK_PACKS", kBlockRowMaxPacks, 0, kBlockRowMaxPacks);
    return v;
}

/* The block-row kernels' threads for rows of `packs` packs (a whole
 * number of warps, at least 64), 0 where the rows take another plan (packs
 * 0: not rows of whole aligned packs). At
 * 8 packs a thread the backward's two tensors spill (ptxas, sm_90: 296
 * bytes in bf16), so the plan ends at 4 a thread. */
inline int block_row_threads(int64_t packs) {
    if (packs < 1 || packs > block_row_max_packs()) return 0;
    const int64_t t = (packs + kBlockRowPacks - 1) / kBlockRowPacks;
    return (int)((t < 64 ? 64 : t + 31) / 32 * 32);
}

/* The warp-row kernels' P for rows of `packs` packs: the smallest of 1, 2,
 * 4, 8 with 32 x P >= packs; 0 when the row is wider than
 * OPSMITH_RING_WARP_PACKS (default 256 packs, 2048 bf16) allows. */
inline int warp_row_p(int64_t packs) {
    if (packs < 1 || packs > ring_tuning().warp_row_packs || packs > 256) return 0;
    return packs <= 32 ? 1 : packs <= 64 ? 2 : packs <= 128 ? 4 : 8;
}

template <typename T> using FwdWarp = void (*)(int64_t, int, const T *, int64_t, bool, T *, int64_t);
template <typename T> using BwdWarp = void (*)(int64_t, int, const T *, int64_t, const T *, int64_t, bool, T *, int64_t);

/* kernels[i]: the warp-row kernel of P = 1 << i, launched for `rows` rows a
 * warp a row, at most 2^20 blocks (the kernels step through the rest) */
template <typename K, typename... Args>
opsmith_status launch_warp_rows(const K (&kernels)[4], int p, int64_t rows, cudaStream_t stream, Args... args) {
    const int64_t per_block = kWarpRowThreads / 32, need = (rows + per_block - 1) / per_block;
    const K kernel = kernels[p == 1 ? 0 : p == 2 ? 1 : p == 4 ? 2 : 3];
    kernel<<<(unsigned)(need < (1 << 20) ? need : (1 << 20)), kWarpRowThreads, 0, stream>>>(rows, args...);
    return launch_status();
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
            A gv[V], yv[V];
            unpack(*reinterpret_cast<const Pack<T> *>(gr + i), gv);
            unpack(load_pack(yr + i), yv);
            add_row_sum(s, lg, gv, yv);
        }
    }
    for (int64_t i = body + threadIdx.x; i < n; i += blockDim.x)
        s += row_sum_term(lg, to_acc(gr[i]), to_acc(yr[i]));
    s = block_sum(s, scratch);
    if constexpr (PACKED) {
        for (int64_t i = (int64_t)threadIdx.x * V; i < body; i += (int64_t)blockDim.x * V) {
            A gv[V], yv[V];
            unpack(*reinterpret_cast<const Pack<T> *>(gr + i), gv);
            unpack(load_pack(yr + i), yv);
            grad_in_place(gv, lg, yv, s);
            store_pack(dr + i, pack_of<T>(gv));
        }
    }
    for (int64_t i = body + threadIdx.x; i < n; i += blockDim.x) {
        const A gv = to_acc(gr[i]), yv = to_acc(yr[i]);
        dr[i] = from_acc<T>(grad_of(lg, gv, yv, s));
    }
}

/* The on-chip backward: dy and y of the CTA's slice in shared memory (two
 * tensors: the slice's dy packs, then its y packs), the dot product summed
 * over the cluster in rank order, dx written from shared memory. dx = dy
 * is safe: a CTA writes only its own slice, after its reads. */
template <typename T, typename A, int CTAS>
__global__ void __launch_bounds__(kSliceThreads, kSliceMinBlocks)
bwd_slice_kernel(int64_t n, const T *g, int64_t gs, const T *__restrict__ y, int64_t ys, bool lg, T *dx, int64_t dxs) {
    extern __shared__ __align__(16) unsigned char slice_smem[];
    __shared__ A scratch[32], part[1];
    constexpr int V = Pack<T>::VEC;
    const int rank = cluster_rank<CTAS>();
    const int64_t r = blockIdx.x / CTAS, packs = n / V, body = packs * V;
    const T *gr = g + r * gs, *yr = y + r * ys;
    T *dr = dx + r * dxs;
    int64_t p0, p1;
    slice_of<CTAS>(packs, rank, p0, p1);
    Pack<T> *gb = reinterpret_cast<Pack<T> *>(slice_smem), *yb = gb + (p1 - p0);
    Pack<T> *const bufs[2] = {gb, yb};
    const T *const srcs[2] = {gr, yr};
    const int64_t half = slice_load<T, 2>(bufs, srcs, p0, p1);
    const int64_t ti = body + threadIdx.x;
    const bool tail = rank == CTAS - 1 && ti < n;
    const A g_tail = tail ? to_acc(gr[ti]) : A(0), y_tail = tail ? to_acc(yr[ti]) : A(0);
    A s = tail ? row_sum_term(lg, g_tail, y_tail) : A(0);
    for_loaded_packs(p0, p1, half, [&](int64_t j) {
        A gv[V], yv[V];
        unpack(gb[j - p0], gv);
        unpack(yb[j - p0], yv);
        add_row_sum(s, lg, gv, yv);
    });
    s = block_sum(s, scratch);
    if constexpr (CTAS > 1) {
        if (threadIdx.x == 0) part[0] = s;
        cluster_barrier();
        s = cluster_load(part, 0);
#pragma unroll
        for (int q = 1; q < CTAS; q++) s += cluster_load(part, q);
        cluster_arrive_relaxed();
    }
    for (int64_t j = p0 + threadIdx.x; j < p1; j += blockDim.x) {
        A gv[V], yv[V];
        unpack(gb[j - p0], gv);
        unpack(yb[j - p0], yv);
        grad_in_place(gv, lg, yv, s);
        store_pack(dr + j * V, pack_of<T>(gv));
    }
    if (tail) dr[ti] = from_acc<T>(grad_of(lg, g_tail, y_tail, s));
    if constexpr (CTAS > 1) cluster_wait();
}

template <typename T> using FwdRing = void (*)(int64_t, int64_t, const T *, int64_t, bool, T *, int64_t, int);
template <typename T> using BwdSlice = void (*)(int64_t, const T *, int64_t, const T *, int64_t, bool, T *, int64_t);

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
    /* rows of whole packs held in registers: a warp a row, else a block a row */
    const int64_t packs = packed && n % vec == 0 ? n / vec : 0;
    const int p = warp_row_p(packs);
    if (p) {
        const FwdWarp<T> kernels[4] = {fwd_warp_kernel<T, A, 1>, fwd_warp_kernel<T, A, 2>, fwd_warp_kernel<T, A, 4>,
                                       fwd_warp_kernel<T, A, 8>};
        return launch_warp_rows(kernels, p, rows, stream, (int)packs, xp, xs, lg, yp, ys);
    }
    if (const int bt = block_row_threads(packs)) {
        fwd_block_kernel<T, A, kBlockRowPacks><<<(unsigned)rows, bt, 0, stream>>>((int)packs, xp, xs, lg, yp, ys);
        return launch_status();
    }
    if (packed) {
        const void *const kernels[4] = {reinterpret_cast<const void *>(fwd_ring_kernel<T, A, 1>),
                                        reinterpret_cast<const void *>(fwd_ring_kernel<T, A, 2>),
                                        reinterpret_cast<const void *>(fwd_ring_kernel<T, A, 4>),
                                        reinterpret_cast<const void *>(fwd_ring_kernel<T, A, 8>)};
        int stages = 1;
        const Launch l = ring_launch(kernels, rows, n / vec, 1, &stages);
        if (l.grid) {
            launch<FwdRing<T>>(l, stream, rows, n, xp, xs, lg, yp, ys, stages);
            return launch_status();
        }
    }
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
    const int64_t packs = packed && n % vec == 0 ? n / vec : 0;
    const int p = warp_row_p(packs);
    if (p) {
        const BwdWarp<T> kernels[4] = {bwd_warp_kernel<T, A, 1>, bwd_warp_kernel<T, A, 2>, bwd_warp_kernel<T, A, 4>,
                                       bwd_warp_kernel<T, A, 8>};
        return launch_warp_rows(kernels, p, rows, stream, (int)packs, gp, gs, yp, ys, lg, dp, dxs);
    }
    if (const int bt = block_row_threads(packs)) {
        bwd_block_kernel<T, A, kBlockRowPacks><<<(unsigned)rows, bt, 0, stream>>>((int)packs, gp, gs, yp, ys, lg, dp,
                                                                                   dxs);
        return launch_status();
    }
    if (packed) {
        const void *const kernels[4] = {reinterpret_cast<const void *>(bwd_slice_kernel<T, A, 1>),
                                        reinterpret_cast<const void *>(bwd_slice_kernel<T, A, 2>),
                                        reinterpret_cast<const void *>(bwd_slice_kernel<T, A, 4>),
                                        reinterpret_cast<const void *>(bwd_slice_kernel<T, A, 8>)};
        const Launch l = slice_launch(kernels, rows, n / vec, 2);
        if (l.grid) {
            launch<BwdSlice<T>>(l, stream, n, gp, gs, yp, ys, lg, dp, dxs);
            return launch_status();
        }
    }
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
