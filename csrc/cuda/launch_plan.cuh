/* Launch plans shared by the row kernels: what the device offers (asked
 * once per device and cached), how many blocks or clusters of a kernel fit
 * at once (cached per kernel), the register-resident plan for a packed row,
 * and a launch that becomes a cluster launch when a plan asks for one.
 * The caches live in launch_plan.cu, one per library. */
#pragma once

#include "common.cuh"

namespace opsmith {

/* What the launch plans ask of the device. */
struct DeviceInfo {
    int sms, major, optin_smem;
};

/* The current device's info; false when it cannot be queried (the error
 * is cleared). *device_out is the current device. */
bool device_info(DeviceInfo *out, int *device_out);

/* The current device's SM count (132 when it cannot be queried). */
int sm_count(void);

/* How many blocks (ctas == 1) or clusters of ctas blocks of `kernel`, with
 * `threads` threads and `smem` bytes of dynamic shared memory, fit on the
 * current device at once; 0 when none fit or the device refuses. Cached. */
int64_t blocks_that_fit(const void *kernel, int threads, size_t smem, int ctas);

/* A launch of a resident or staged kernel. grid == 0: no such plan (the row
 * is too wide, or the device refuses it); the caller takes another kernel.
 * For the backward the grid (in blocks, or clusters x ctas) also fixes the
 * number of weight-gradient partial rows, grid / ctas, so for a device,
 * rows, n and dtype the order dweight is summed in is fixed. */
struct Launch {
    const void *kernel;
    int threads, ctas;
    size_t smem;
    int64_t grid;
    const char *family; /* "resident", "staged"; for tests and notes */
};

/* A tuning variable's value: the fallback when unset, not a number or out
 * of [lo, hi]. For plans read once so a benchmark can compare them in one
 * build. */
long tuning_env(const char *name, long fallback, long lo, long hi);

/* The ring plans' tuning (row_slices.cuh, ring_launch), read once from the
 * environment so a benchmark can compare plans in one build:
 * OPSMITH_RING_STAGES (0: no ring plan; 1: one stage; 2, the default: up to
 * two), OPSMITH_RING_MAX_CTAS (largest cluster, default 8) and
 * OPSMITH_RING_SLICE_KB (shared memory a CTA aims for, default
 * kOnChipSliceBytes), OPSMITH_RING_PACKS (packs a thread a row, which
 * sets the block size up to kSliceThreads; default 4) and
 * OPSMITH_RING_SPECIALISED (0: the general kernel where a specialised one
 * exists, cross-entropy's for the call without weights, smoothing or
 * softcap; default 1), OPSMITH_RING_WARP_PACKS (softmax rows of at most
 * this many packs take a warp a row instead of the ring; default 256,
 * 0: never). */
constexpr int64_t kOnChipSliceBytes = 72 * 1024;
struct RingTuning {
    int stages, max_ctas;
    int64_t slice_bytes;
    int packs_per_thread;
    bool specialised;
    int warp_row_packs;
};
const RingTuning &ring_tuning(void);

/* The grid of as many blocks (clusters) as fit at once, at most one a row:
 * each then walks rows / grid rows; a second wave would only add a tail. */
Launch fit_grid(Launch l, int64_t rows);

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

Resident resident_plan(int64_t steps, int min_threads, bool latency, int max_iters);

/* Launches l.kernel, whose type is K, with args; as a cluster when l.ctas > 1. */
template <typename K, typename... Args> inline void launch(const Launch &l, cudaStream_t stream, Args... args) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = l.ctas;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.gridDim = dim3((unsigned)l.grid);
    cfg.blockDim = dim3(l.threads);
    cfg.dynamicSmemBytes = l.smem;
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = l.ctas > 1 ? 1 : 0;
    cudaLaunchKernelEx(&cfg, reinterpret_cast<K>(const_cast<void *>(l.kernel)), args...);
}

} // namespace opsmith
