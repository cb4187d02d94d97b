/* What the softmax-style row kernels share (softmax.cu, cross_entropy.cu):
 * exp/log/tanh in the accumulate type, and the online (max, sum of
 * exponentials) pairs a thread keeps and a block merges, so a row is read
 * once for its log-sum-exp. -inf elements (masked logits) add nothing; a NaN
 * makes the row NaN. */
#ifndef OPSMITH_CUDA_ONLINE_SOFTMAX_CUH
#define OPSMITH_CUDA_ONLINE_SOFTMAX_CUH

#include <math_constants.h>

#include "launch_plan.cuh"
#include "row_pipeline.cuh"

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


/* The row statistics of the v2 kernels. For float, exp(y - m) against the
 * row's running max m is taken as 2^((y - m) log2e): one subtraction, one
 * multiply and one ex2.approx (MUFU) an element in place of expf's ~10
 * instructions. y - m is rounded relative to itself, not to |y|, so logits
 * scaled by 1e4 stay accurate, and nothing overflows at any finite |y| (the
 * earlier single-FMA form, 2^(fma(y, log2e, -m log2e)), turned rows with
 * |max| above ~7e8 into NaN). M, the shift, is m itself, as for double. */
template <typename A> struct Ex;
template <> struct Ex<float> {
    static constexpr float kLog2e = 1.4426950408889634f;
    __device__ static __forceinline__ float ex2(float v) {
        float r;
        asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
        return r;
    }
    __device__ static __forceinline__ float shift(float m) { return m; }
    /* exp(y - M) */
    __device__ static __forceinline__ float term(float y, float M) { return ex2((y - M) * kLog2e); }
    /* exp(a - b) for two maxima a and b */
    __device__ static __forceinline__ float ratio(float Ma, float Mb) { return ex2((Ma - Mb) * kLog2e); }
    /* log(sum exp(y - m)) from s = that sum */
    __device__ static __forceinline__ float log_sum(float s, float, float) { return logf(s); }
};
template <> struct Ex<double> {
    __device__ static __forceinline__ double shift(double m) { return m; }
    __device__ static __forceinline__ double term(double y, double M) { return exp(y - M); }
    __device__ static __forceinline__ double ratio(double Ma, double Mb) { return exp(Ma - Mb); }
    __device__ static __forceinline__ double log_sum(double s, double, double) { return log(s); }
};

__device__ __forceinline__ float fmax_acc(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double fmax_acc(double a, double b) { return fmax(a, b); }

/* A running (max m, its shift M, sum s of term(y, M)) over part of a row.
 * -inf elements (masked logits) add nothing; a NaN anywhere makes s NaN
 * (so every output of the row NaN, as PyTorch); an all -inf row keeps
 * m = -inf, s = 0 (its outputs NaN, as before). */
template <typename A> struct RowStat {
    A m, M, s;
    __device__ __forceinline__ RowStat() : m(neg_inf<A>()), M(neg_inf<A>()), s(A(0)) {}
    __device__ __forceinline__ RowStat(A m_, A M_, A s_) : m(m_), M(M_), s(s_) {}

    /* V values: their max first, so the running sum is rescaled once */
    template <int V> __device__ __forceinline__ void add(const A (&y)[V]) {
        /* fmax skips a NaN (one FMNMX; the NaN reaches s through its term) */
        A pm = neg_inf<A>();
#pragma unroll
        for (int k = 0; k < V; k++) pm = fmax_acc(pm, y[k]);
        if (pm > m) {
            const A Mn = Ex<A>::shift(pm);
            s *= Ex<A>::ratio(M, Mn);
            m = pm, M = Mn;
        }
        if (m != neg_inf<A>()) {
#pragma unroll
            for (int k = 0; k < V; k++) s += Ex<A>::term(y[k], M);
        } else {
            /* every value so far is -inf or NaN: only a NaN counts */
#pragma unroll
            for (int k = 0; k < V; k++)
                if (y[k] != y[k]) s = nan_acc<A>();
        }
    }
    __device__ __forceinline__ void add1(A y) {
        const A one[1] = {y};
        add<1>(one);
    }
    /* the side with the larger max keeps its sum unscaled (bit-exact) */
    __device__ __forceinline__ void merge(A m2, A M2, A s2) {
        if (m2 > m) {
            s = s * Ex<A>::ratio(M, M2) + s2;
            m = m2, M = M2;
        } else if (m2 == m) {
            s += s2;
        } else {
            s += s2 * Ex<A>::ratio(M2, M);
        }
    }
    __device__ __forceinline__ void merge(const RowStat &o) { merge(o.m, o.M, o.s); }
    __device__ __forceinline__ void warp_merge() {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const A m2 = __shfl_xor_sync(0xffffffffu, m, off), M2 = __shfl_xor_sync(0xffffffffu, M, off),
                    s2 = __shfl_xor_sync(0xffffffffu, s, off);
            merge(m2, M2, s2);
        }
    }
    /* the block's statistics, returned to every thread; scratch holds 96 A.
     * Every thread ends with the same bits (the lanes merge in one order). */
    __device__ __forceinline__ void block_merge(A *scratch) {
        warp_merge();
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
        __syncthreads();
        if (lane == 0) scratch[warp] = m, scratch[32 + warp] = M, scratch[64 + warp] = s;
        __syncthreads();
        if (lane < warps) m = scratch[lane], M = scratch[32 + lane], s = scratch[64 + lane];
        else m = neg_inf<A>(), M = neg_inf<A>(), s = A(0);
        warp_merge();
    }
};

/* What the writes of a row need once its statistics are final:
 * p(y) = exp(y - m) / sum = term(y, M) * inv_s, and log_s = log(sum), so
 * log p = (y - m) - log_s and lse = m + log_s. Neither forms lse first: at
 * |y| ~ 1e4 in float32 its rounding (ulp ~ 2e-3) would be an error of p. */
template <typename A> struct RowNorm {
    A m, M, inv_s, log_s;
    __device__ __forceinline__ explicit RowNorm(const RowStat<A> &st)
        : m(st.m), M(st.M), inv_s(A(1) / st.s), log_s(Ex<A>::log_sum(st.s, st.m, st.M)) {}
    __device__ __forceinline__ A p(A y) const { return Ex<A>::term(y, M) * inv_s; }
    __device__ __forceinline__ A logp(A y) const { return (y - m) - log_s; }
    __device__ __forceinline__ A lse() const { return m + log_s; }
};

/* Reads value `at` (in shared memory) of CTA `rank` of this cluster. */
template <typename A> __device__ __forceinline__ A cluster_load(const A *at, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned local = (unsigned)__cvta_generic_to_shared(at), remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
    if constexpr (sizeof(A) == 8) {
        double v;
        asm volatile("ld.shared::cluster.f64 %0, [%1];\n" : "=d"(v) : "r"(remote) : "memory");
        return (A)v;
    } else {
        float v;
        asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
        return (A)v;
    }
#else
    (void)rank;
    return *at;
#endif
}

/* The two halves of a cluster barrier, apart: a CTA arrives once it no
 * longer reads the others' shared memory and waits just before it exits,
 * so none leaves while another may still read it, and no CTA waits in
 * between. */
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
#endif
}


/* Rows held on chip: a row (of `tensors` tensors, 16-byte packs) split over
 * a thread-block cluster of CTAS CTAs, each loading its slice of
 * ceil(packs / CTAS) packs into its dynamic shared memory once (cp.async),
 * reducing it, exchanging the partial results through distributed shared
 * memory, then writing its outputs from shared memory: the row is read
 * from HBM once. A cluster of 1 is the same code for rows that fit one
 * CTA. Slices up to kSliceBytes leave room for three CTAs an SM (one
 * computes while the others load); wider rows take more CTAs, up to the
 * portable cluster of 8, then the largest slice a CTA may hold; beyond
 * that (or without clusters, or unaligned rows) the streaming kernels. */
constexpr int kSliceThreads = 512;
/* three 512-thread CTAs an SM: at most 42 registers a thread */
constexpr int kSliceMinBlocks = 3;
constexpr int64_t kSliceBytes = 72 * 1024;

/* the CTA's packs [p0, p1) of a row of `packs` packs */
template <int CTAS> __device__ __forceinline__ void slice_of(int64_t packs, int rank, int64_t &p0, int64_t &p1) {
    const int64_t slice = (packs + CTAS - 1) / CTAS;
    p0 = (int64_t)rank * slice;
    p1 = p0 + slice < packs ? p0 + slice : packs;
    if (p1 < p0) p1 = p0;
}

/* Issues this thread's copies of its slice's packs (j = p0 + threadIdx.x,
 * stepping by blockDim.x) of `tensors` rows into bufs, in two cp.async
 * groups: the first `half` packs, then the rest. The reader waits for the
 * first group (cp_async_wait<1>) before its loop and for the rest
 * (cp_async_wait<0>) at pack number `half`, so the math on the first half
 * overlaps the second half's loads. Each thread reads back only its own
 * packs: no barrier. Returns half. */
template <typename T, int TENSORS>
__device__ __forceinline__ int64_t slice_load(Pack<T> *const (&bufs)[TENSORS], const T *const (&rows)[TENSORS],
                                              int64_t p0, int64_t p1) {
    constexpr int V = Pack<T>::VEC;
    const int64_t first = p0 + threadIdx.x;
    const int64_t mine = first < p1 ? (p1 - first + blockDim.x - 1) / blockDim.x : 0;
    const int64_t half = (mine + 1) / 2;
    int64_t it = 0;
    for (int64_t j = first; j < p1; j += blockDim.x, it++) {
#pragma unroll
        for (int q = 0; q < TENSORS; q++) cp_async16(bufs[q] + (j - p0), rows[q] + j * V);
        if (it + 1 == half) cp_async_commit();
    }
    cp_async_commit();
    return half;
}

/* f(j) for this thread's packs j of [p0, p1), as slice_load issued them,
 * each once its cp.async group has landed: the first `half` after the
 * first group, the rest after the second. */
template <typename F>
__device__ __forceinline__ void for_loaded_packs(int64_t p0, int64_t p1, int64_t half, F f) {
    cp_async_wait<1>();
    int64_t it = 0;
    for (int64_t j = p0 + threadIdx.x; j < p1; j += blockDim.x, it++) {
        if (it == half) cp_async_wait<0>();
        f(j);
    }
}

/* kernels[i] is the kernel for clusters of 1 << i CTAs (i < 4). grid == 0:
 * no on-chip plan (take the streaming kernel). */
inline Launch slice_launch(const void *const kernels[4], int64_t rows, int64_t packs, int tensors) {
    const Launch none{nullptr, 0, 0, 0, 0, "streaming"};
    DeviceInfo d;
    int device;
    if (rows < 1 || packs < 1 || !device_info(&d, &device)) return none;
    const int max_ctas = d.major >= 9 ? 8 : 1; /* clusters: sm_90 and newer */
    for (int i = 0, c = 1; c <= max_ctas; i++, c *= 2) {
        const int64_t slice = (packs + c - 1) / c;
        const int64_t bytes = slice * 16 * tensors;
        if (bytes > kSliceBytes && c < max_ctas) continue;
        if (bytes > (int64_t)d.optin_smem || rows > (int64_t)0x7fffffff / c) return none;
        int64_t threads = (slice + 3) / 4; /* about 4 packs a thread */
        threads = (threads + 31) / 32 * 32;
        threads = threads < 64 ? 64 : threads > kSliceThreads ? kSliceThreads : threads;
        Launch l{kernels[i], (int)threads, c, (size_t)bytes, rows * c, c > 1 ? "cluster" : "slice"};
        if (blocks_that_fit(l.kernel, l.threads, l.smem, c) < 1) return none;
        return l;
    }
    return none;
}

/* The walk of a ring kernel (a persistent cluster of CTAS CTAs, launched by
 * ring_launch): rows blockIdx.x / CTAS, + clusters, ..., each as row(r,
 * buf) once this CTA's slice [p0, p1) of row r of x is in shared memory
 * (pack j at buf[j - p0]). With two stages
 * the next row's slice loads (one cp.async group a row) while row() works;
 * with one it loads after row() returns. Every thread loads only the packs
 * it later reads (j = p0 + threadIdx.x, stepping blockDim.x) and row() must
 * read only those too: a stage is then free for the next load once the
 * thread is done with it, with no block barrier. */
template <typename T, int CTAS, typename Row>
__device__ __forceinline__ void ring_rows(int64_t rows, int64_t packs, const T *x, int64_t xs, int stages,
                                          int64_t p0, int64_t p1, Pack<T> *ring, Row row) {
    constexpr int V = Pack<T>::VEC;
    const int64_t clusters = gridDim.x / CTAS, stage_packs = (packs + CTAS - 1) / CTAS;
    auto issue = [&](int64_t r, int stage) {
        Pack<T> *b = ring + stage * stage_packs;
        const T *xr = x + r * xs;
        for (int64_t j = p0 + threadIdx.x; j < p1; j += blockDim.x) cp_async16(b + (j - p0), xr + j * V);
        cp_async_commit();
    };
    int64_t r = blockIdx.x / CTAS;
    if (r < rows) issue(r, 0);
    for (int it = 0; r < rows; r += clusters, it++) {
        const int stage = stages == 2 ? (it & 1) : 0;
        const int64_t next = r + clusters;
        if (stages == 2) {
            if (next < rows) issue(next, stage ^ 1);
            else cp_async_commit(); /* an empty group: this row's stays the one before the newest */
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        row(r, static_cast<const Pack<T> *>(ring + stage * stage_packs));
        if (stages == 1 && next < rows) issue(next, 0);
    }
}

/* The persistent plan of the ring kernels: a grid of as many clusters as
 * fit at once (fit_grid), each walking rows c, c + clusters, ... . With
 * two stages a CTA holds two slices: the next row's loads (one cp.async
 * group a row) are in flight while this row is reduced and written, and a
 * CTA never waits on its own load once the ring is full. Two stages where
 * both slices fit kSliceBytes (so three CTAs still share an SM); else one
 * stage, sized as slice_launch sizes it (the loads of the next row then
 * start once this row is written). *stages_out: 1 or 2. */
inline Launch ring_launch(const void *const kernels[4], int64_t rows, int64_t packs, int tensors, int *stages_out) {
    const Launch none{nullptr, 0, 0, 0, 0, "streaming"};
    DeviceInfo d;
    int device;
    if (rows < 1 || packs < 1 || !device_info(&d, &device)) return none;
    const int max_ctas = d.major >= 9 ? 8 : 1;
    for (int stages = 2; stages >= 1; stages--) {
        for (int i = 0, c = 1; c <= max_ctas; i++, c *= 2) {
            const int64_t slice = (packs + c - 1) / c;
            const int64_t bytes = slice * 16 * tensors * stages;
            const bool last = c == max_ctas;
            if (bytes > kSliceBytes && (stages == 2 || !last)) continue;
            if (bytes > (int64_t)d.optin_smem) return none;
            int64_t threads = (slice + 3) / 4; /* about 4 packs a thread */
            threads = (threads + 31) / 32 * 32;
            threads = threads < 64 ? 64 : threads > kSliceThreads ? kSliceThreads : threads;
            Launch l{kernels[i], (int)threads, c, (size_t)bytes, 0, c > 1 ? "ring cluster" : "ring"};
            l = fit_grid(l, rows);
            if (l.grid < 1) return none;
            *stages_out = stages;
            return l;
        }
    }
    return none;
}

} // namespace opsmith

#endif /* OPSMITH_CUDA_ONLINE_SOFTMAX_CUH */
