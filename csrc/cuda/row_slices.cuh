/* Rows held on chip a slice a CTA: a row split over a thread-block cluster,
 * each CTA's slice of 16-byte packs in its shared memory, loaded once with
 * cp.async, the CTAs' partial results exchanged through distributed shared
 * memory (softmax.cu, cross_entropy.cu, layer_norm.cu). The one-shot plan
 * (slice_launch: a CTA a row slice) and the persistent one (ring_launch,
 * ring_rows: a cluster walks rows, the next row's slice loading while this
 * one is worked on). */
#ifndef OPSMITH_CUDA_ROW_SLICES_CUH
#define OPSMITH_CUDA_ROW_SLICES_CUH

#include "launch_plan.cuh"
#include "row_pipeline.cuh"

namespace opsmith {

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
__device__ __forceinline__ void cluster_arrive_relaxed() { OPSMITH_SM90_ASM("barrier.cluster.arrive.relaxed.aligned;"); }
__device__ __forceinline__ void cluster_wait() { OPSMITH_SM90_ASM("barrier.cluster.wait.aligned;"); }


/* Rows held on chip: a row (of `tensors` tensors, 16-byte packs) split over
 * a thread-block cluster of CTAS CTAs, each loading its slice of
 * ceil(packs / CTAS) packs into its dynamic shared memory once (cp.async),
 * reducing it, exchanging the partial results through distributed shared
 * memory, then writing its outputs from shared memory: the row is read
 * from HBM once. A cluster of 1 is the same code for rows that fit one
 * CTA. Slices up to kOnChipSliceBytes leave room for three CTAs an SM (one
 * computes while the others load); wider rows take more CTAs, up to the
 * portable cluster of 8, then the largest slice a CTA may hold; beyond
 * that (or without clusters, or unaligned rows) the streaming kernels. */
constexpr int kSliceThreads = 512;
/* three 512-thread CTAs an SM: at most 42 registers a thread */
constexpr int kSliceMinBlocks = 3;

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
        if (bytes > kOnChipSliceBytes && c < max_ctas) continue;
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

/* What every ring kernel starts from: the dynamic shared memory as its
 * ring, this CTA's rank in its cluster and its slice of a row: packs
 * [p0, p0 + count), a stage's stride in the ring `slice`. 32-bit: a ring
 * row fits shared memory (ring_launch refuses rows of 2^31 packs or more),
 * so the pack loops' counters and offsets take one instruction each where
 * 64-bit ones take two or three. */
template <typename T, int CTAS> struct RingCta {
    Pack<T> *ring;
    int rank, p0, count, slice;
    __device__ explicit RingCta(int64_t packs) {
        extern __shared__ __align__(16) unsigned char slice_smem[];
        ring = reinterpret_cast<Pack<T> *>(slice_smem);
        rank = cluster_rank<CTAS>();
        slice = (int)((packs + CTAS - 1) / CTAS);
        const int64_t first = (int64_t)rank * slice, rest = packs - first;
        p0 = (int)(first < packs ? first : packs);
        count = rest <= 0 ? 0 : rest < slice ? (int)rest : slice;
    }
    /* f(i) for this thread's packs of the slice: i = threadIdx.x, stepping
     * blockDim.x; pack i of the slice is the row's pack p0 + i */
    template <typename F> __device__ __forceinline__ void each(F f) const {
        for (int i = threadIdx.x; i < count; i += blockDim.x) f(i);
    }
};

/* A stage of a ring kernel: this CTA's slice of each of TENSORS rows (pack
 * p0 + i of tensor q at t[q][i]). */
template <typename T, int TENSORS> struct Stage {
    const Pack<T> *t[TENSORS];
};

/* The walk of a ring kernel (a persistent cluster of CTAS CTAs, launched by
 * ring_launch): rows blockIdx.x / CTAS, + clusters, ..., each as row(r,
 * stage) once this CTA's slice of row r of every tensor q < TENSORS
 * (srcs[q] with row stride strides[q]) is in shared memory. With two stages the next
 * row's slices load (one cp.async group a row) while row() works; with one
 * they load after row() returns. Every thread loads only the packs it later
 * reads (c.each's) and row() must read only those too: a stage is then free
 * for the next load once the thread is done with it, with no block barrier. */
template <typename T, int CTAS, int TENSORS, typename Row>
__device__ __forceinline__ void ring_rows(int64_t rows, const T *const *srcs, const int64_t *strides, int stages,
                                          const RingCta<T, CTAS> &c, Row row) {
    constexpr int V = Pack<T>::VEC;
    const int64_t clusters = gridDim.x / CTAS;
    auto at = [&](int stage, int q) { return c.ring + (stage * TENSORS + q) * c.slice; };
    auto issue = [&](int64_t r, int stage) {
#pragma unroll
        for (int q = 0; q < TENSORS; q++) {
            Pack<T> *b = at(stage, q);
            const T *src = srcs[q] + r * strides[q] + (int64_t)c.p0 * V;
            c.each([&](int i) { cp_async16(b + i, src + i * V); });
        }
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
        Stage<T, TENSORS> st;
#pragma unroll
        for (int q = 0; q < TENSORS; q++) st.t[q] = at(stage, q);
        row(r, st);
        if (stages == 1 && next < rows) issue(next, 0);
    }
}

/* One tensor: row(r, buf), pack p0 + i at buf[i]. */
template <typename T, int CTAS, typename Row>
__device__ __forceinline__ void ring_rows(int64_t rows, const T *x, int64_t xs, int stages, const RingCta<T, CTAS> &c,
                                          Row row) {
    const T *const srcs[1] = {x};
    const int64_t strides[1] = {xs};
    ring_rows<T, CTAS, 1>(rows, srcs, strides, stages, c,
                          [&](int64_t r, const Stage<T, 1> &st) { row(r, st.t[0]); });
}

/* The persistent plan of the ring kernels: a grid of as many clusters as
 * fit at once (fit_grid), each walking rows c, c + clusters, ... . The
 * cluster is the smallest whose one-stage slice fits the aimed-for shared
 * memory (kOnChipSliceBytes: three CTAs an SM), else the largest. A second
 * stage (the next row's loads in flight while this row is reduced and
 * written) is taken only where it fits without a larger cluster, that is
 * where one CTA holds the row twice: measured on the H200 (bench/NOTES.md,
 * 2026-12-05), doubling the cluster for a second stage lost 10-35% (CE at
 * 8192 x 128256: 0.33 of copy forward with two stages in 8-CTA clusters,
 * 0.51 with one in 4-CTA clusters), while three CTAs an SM already overlap
 * one CTA's loads with another's math. *stages_out: 1 or 2. */
inline Launch ring_launch(const void *const kernels[4], int64_t rows, int64_t packs, int tensors, int *stages_out) {
    const Launch none{nullptr, 0, 0, 0, 0, "streaming"};
    DeviceInfo d;
    int device;
    const RingTuning &tune = ring_tuning();
    if (rows < 1 || packs < 1 || packs > 0x7fffffff || tune.stages < 1 || !device_info(&d, &device)) return none;
    const int max_ctas = d.major >= 9 ? tune.max_ctas : 1;
    auto slice_bytes = [&](int c) { return (packs + c - 1) / c * 16 * tensors; };
    int i = 0, c = 1;
    while (c * 2 <= max_ctas && slice_bytes(c) > tune.slice_bytes) c *= 2, i++;
    const int64_t slice = (packs + c - 1) / c;
    const int per = tune.packs_per_thread; /* about 4 packs a thread by default */
    int64_t threads = (slice + per - 1) / per;
    threads = (threads + 31) / 32 * 32;
    threads = threads < 64 ? 64 : threads > kSliceThreads ? kSliceThreads : threads;
    for (int stages = tune.stages == 2 && 2 * slice_bytes(c) <= tune.slice_bytes ? 2 : 1; stages >= 1; stages--) {
        const int64_t bytes = slice_bytes(c) * stages;
        if (bytes > (int64_t)d.optin_smem) continue;
        Launch l{kernels[i], (int)threads, c, (size_t)bytes, 0, c > 1 ? "ring cluster" : "ring"};
        l = fit_grid(l, rows);
        if (l.grid < 1) continue; /* the device refuses it: one stage, else none */
        *stages_out = stages;
        return l;
    }
    return none;
}

} // namespace opsmith

#endif /* OPSMITH_CUDA_ROW_SLICES_CUH */
