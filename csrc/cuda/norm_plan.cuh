/* What the row norms (rms_norm.cu, layer_norm.cu) share beyond the row
 * machinery: the packed-path test, the block sizes their resident plans
 * start from, and the staged backward's plan (ring depth, a CTA's slice of
 * a row, clusters for wide rows, when it pays over the resident kernel).
 * Header-only (templates, inline and constexpr), safe in any number of .cu
 * files. */
#pragma once

#include <initializer_list>

#include "internal.h"
#include "launch_plan.cuh"
#include "row_pipeline.cuh"
#include "rows.cuh"

namespace opsmith {

/* the packed paths need every pointer 16-byte aligned and every row stride
 * a whole number of x's packs */
inline bool packed_ok(int64_t n, int vec, std::initializer_list<int64_t> strides,
                      std::initializer_list<const void *> ptrs) {
    if (n % vec != 0) return false;
    for (int64_t s : strides)
        if (s % vec != 0) return false;
    for (const void *p : ptrs)
        if (p && !aligned16(p)) return false;
    return true;
}

/* whether two row sets (rows rows of n elements, row strides in elements)
 * may share bytes, over their whole extents: the split backward plans read
 * dy and x in blocks that run beside the blocks writing dx, so dx written
 * over dy (in-place backward) takes another plan (the C checks' byte spans) */
inline bool rows_overlap(const void *a, int64_t as, size_t asize, const void *b, int64_t bs, size_t bsize,
                         int64_t rows, int64_t n) {
    return opsmith_internal_overlap(opsmith_internal_span(a, rows, n, as, asize),
                                    opsmith_internal_span(b, rows, n, bs, bsize));
}

/* the fewest threads a block of the resident throughput plans keeps */
constexpr int kFwdMinThreads = 64, kBwdMinThreads = 128;

/* The split backward plans' launch (rms_norm's and layer_norm's
 * bwd_split_kernel) for a short batch of packed rows: the resident latency
 * plan's blocks, one a row, and a block for each 32 packs of columns;
 * kernels[i] holds the kernel of 1 << i packs a thread. grid == 0 where it
 * does not apply (more rows than SMs, rows too wide for the resident plan). */
inline Launch split_launch(const void *const kernels[4], int64_t rows, int64_t n, int vec) {
    Launch l{nullptr, 0, 1, 0, 0, "split"};
    if (rows < 1 || rows > sm_count() || n % vec != 0) return l;
    const Resident plan = resident_plan(n / vec, kBwdMinThreads, true, kResidentIters);
    if (!plan.iters) return l;
    l.kernel = kernels[plan.iters == 1 ? 0 : plan.iters == 2 ? 1 : plan.iters == 4 ? 2 : 3];
    l.threads = plan.threads;
    l.grid = rows + (n / vec + 31) / 32;
    return l;
}

/* Staged backward: rows streamed through a ring of kStages row stages in
 * shared memory, filled by cp.async kStages - 1 rows ahead. */
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

/* Staged plan for packed rows of n elements of T, `units` 16-byte slots a
 * pack of x streamed a row (x and dy: 2, or 3 when dy is twice as wide as
 * x). A CTA's slice of a row is at most 2 x kSliceBytes over all units, so
 * kStages stages of it fit in one SM's shared memory (192 KB at the largest
 * slice); wider rows are split over a cluster of 2, 4 or 8 CTAs (sm_90). */
constexpr size_t kSliceBytes = 32 << 10;

constexpr int kStagedMinThreads = 64;
constexpr int64_t kStagedMinRowsPerBlock = 4;

template <typename T> Launch staged_plan(int64_t n, int units, int *iters, int *ctas) {
    Launch l{nullptr, 0, 0, 0, 0, "staged"};
    DeviceInfo d;
    int device;
    const int64_t vec = Pack<T>::VEC;
    const size_t row_bytes = (size_t)n * sizeof(T) * units, budget = 2 * kSliceBytes;
    int c = 1;
    while (row_bytes > budget * c && c < 8) c *= 2;
    if (row_bytes > budget * c || n % (c * vec) != 0 || !device_info(&d, &device) || (c > 1 && d.major < 9))
        return l;
    const Resident plan = resident_plan(n / c / vec, kStagedMinThreads, false, 4);
    if (!plan.iters || (c > 1 && plan.iters != 4)) return l;
    *iters = plan.iters;
    *ctas = c;
    l.threads = plan.threads;
    l.ctas = c;
    l.smem = (size_t)kStages * units * plan.iters * plan.threads * sizeof(Pack<T>); /* the RowRing */
    return l;
}

/* The staged launch l (grid from fit_grid) when it pays for `rows` rows on
 * `sms` SMs, else grid == 0 (the caller takes the resident kernel). At least
 * kStagedMinRowsPerBlock rows a block (or cluster) while the grid still
 * covers every SM: each block writes a weight-gradient partial row of n
 * floats, which at one or two rows a block costs more traffic than the rows
 * themselves (rms_norm 1024 x 4096 bf16: 28.4 -> 26.1 us; large shapes
 * unchanged). Just over one row an SM, the ring has nothing to overlap and
 * the resident kernel is faster (rms_norm 140 x 4096: 17.3 against 19.2 us). */
inline Launch keep_staged(Launch l, int64_t rows, int sms) {
    int64_t cap = (rows + kStagedMinRowsPerBlock - 1) / kStagedMinRowsPerBlock;
    if (cap < sms) cap = sms;
    if (l.grid && l.grid / l.ctas > cap) l.grid = cap * l.ctas;
    if (l.grid && (l.ctas > 1 || rows >= 2 * (int64_t)sms)) return l;
    l.grid = 0;
    return l;
}

/* The norms' ring forward (row_slices.cuh) takes packed rows of at least
 * kRingMinPacks packs (16 KB of bf16) when there are more rows than SMs:
 * its next row loads while this one is reduced, where the resident forward
 * holds one or two such rows an SM (64-106 registers a thread) and waits on
 * each (0.65-0.77 of copy at 4096 x 8192 and wider, bf16, 2026-12-05). */
constexpr int64_t kRingMinPacks = 1024;

/* The norm forwards' plan choices, read once from the environment (as
 * ring_tuning) so a benchmark can compare them in one build:
 * OPSMITH_NORM_FWD_PACKS (packs a thread of the resident throughput plan,
 * 1, 2 or 4; 0, the default: resident_plan's choice),
 * OPSMITH_NORM_LATENCY_PACKS (the same for the latency plan of a short
 * batch, 1, 2, 4 or 8; 0, the default: one pack a thread, the widest
 * block), OPSMITH_NORM_RING_MIN_PACKS (the ring forward's narrowest
 * row, default kRingMinPacks), OPSMITH_NORM_WARP_ROW_PACKS (below),
 * OPSMITH_NORM_FWD_EARLY (LayerNorm's forward at 1-2 packs a thread of a
 * block: 1, the default, its weight and bias in registers before the rows
 * in every plan; 0, in the short batch's plan only) and
 * OPSMITH_NORM_WARP_ROW_LEAN (the most packs a lane at which LayerNorm's
 * warp-row forward takes its kernel capped at 48 registers, 40 warps an SM
 * against 32: 0 none, 2 the default, 4; on the H100 the lean kernel gained
 * 0.87 -> 0.91 of copy at 2 packs, 131072 x 512 bf16, and lost 0.91 ->
 * 0.83 at 4, where it spills: bench/NOTES.md). Defined in launch_plan.cu. */
struct NormTuning {
    int fwd_packs, latency_packs;
    int64_t ring_min_packs, warp_row_packs;
    bool fwd_early;
    int warp_row_lean;
};

/* LayerNorm's forward takes a warp a row for many rows of at most this many
 * packs (OPSMITH_NORM_WARP_ROW_PACKS: 0 turns it off, up to 128) */
constexpr int64_t kWarpRowPacks = 32 * 4;
const NormTuning &norm_tuning(void);

inline bool norm_ring_applies(int64_t rows, int64_t n, int vec) {
    return n % vec == 0 && n / vec >= norm_tuning().ring_min_packs && rows > sm_count();
}

/* The resident forward's plan for rows of `steps` packs (resident_plan
 * with kFwdMinThreads, or the packs a thread the tuning variables ask for
 * where the row fits a block at that many and the kernel has that many: a
 * power of two, at most max_iters). */
inline Resident norm_fwd_resident(int64_t steps, bool latency, int max_iters) {
    const int p = latency ? norm_tuning().latency_packs : norm_tuning().fwd_packs;
    if (p < 1 || (p & (p - 1)) != 0 || p > max_iters || steps < 1 || steps > (int64_t)kResidentThreads * p)
        return resident_plan(steps, kFwdMinThreads, latency, max_iters);
    const int64_t t = ((steps + p - 1) / p + 31) / 32 * 32;
    return Resident{p, (int)t};
}

} // namespace opsmith
