/* The launch-plan queries and their caches (declared in launch_plan.cuh):
 * the runtime queries cost microseconds, the launches they shape about as
 * much, so each is asked once per device and kernel. */
#include "launch_plan.cuh"
#include "norm_plan.cuh"
#include "rows.cuh"

#include <cstdlib>
#include <mutex>
#include <vector>

namespace opsmith {
namespace {

constexpr int kMaxDevices = 64;
std::mutex plan_cache_mutex;

} // namespace

/* false when the current device cannot be queried (the error is cleared). */
bool device_info(DeviceInfo *out, int *device_out) {
    static DeviceInfo cache[kMaxDevices];
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess || device < 0) {
        cudaGetLastError(); /* leave no error behind for the next launch check */
        return false;
    }
    *device_out = device;
    std::lock_guard<std::mutex> lock(plan_cache_mutex);
    if (device < kMaxDevices && cache[device].sms > 0) {
        *out = cache[device];
        return true;
    }
    DeviceInfo d{0, 0, 0};
    if (cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&d.optin_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
        d.sms < 1) {
        cudaGetLastError();
        return false;
    }
    if (device < kMaxDevices) cache[device] = d;
    *out = d;
    return true;
}

int sm_count(void) {
    DeviceInfo d;
    int device;
    return device_info(&d, &device) ? d.sms : 132;
}

/* How many blocks (ctas == 1) or clusters of ctas blocks of `kernel`, with
 * `threads` threads and `smem` bytes of dynamic shared memory, fit on the
 * current device at once; 0 when none fit or the device refuses. Cached. */
int64_t blocks_that_fit(const void *kernel, int threads, size_t smem, int ctas) {
    struct Entry {
        int device;
        const void *kernel;
        int threads, ctas;
        size_t smem;
        int64_t fit;
    };
    static std::vector<Entry> cache;
    DeviceInfo d;
    int device;
    if (!device_info(&d, &device) || smem > (size_t)d.optin_smem) return 0;
    std::lock_guard<std::mutex> lock(plan_cache_mutex);
    for (const Entry &e : cache)
        if (e.device == device && e.kernel == kernel && e.threads == threads && e.smem == smem && e.ctas == ctas)
            return e.fit;
    int64_t fit = 0;
    /* the limit is set to the most the device allows beside the kernel's
     * static shared memory, not to smem: it is one value a kernel, and a
     * launch of the same kernel with more (another n) must not find it
     * lowered by this one. A cluster plan also needs code compiled for
     * sm_90 or newer: from older PTX its cluster instructions are absent. */
    cudaFuncAttributes fa;
    cudaError_t e = cudaFuncGetAttributes(&fa, kernel);
    bool ok = e == cudaSuccess && smem + fa.sharedSizeBytes <= (size_t)d.optin_smem &&
              (ctas == 1 || fa.ptxVersion >= 90);
    if (ok) {
        e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 d.optin_smem - (int)fa.sharedSizeBytes);
        ok = e == cudaSuccess;
    }
    if (ok && ctas == 1) {
        int per_sm = 0;
        e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
        if (e == cudaSuccess) fit = (int64_t)per_sm * d.sms;
    } else if (ok) {
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeClusterDimension;
        attr.val.clusterDim.x = ctas;
        attr.val.clusterDim.y = 1;
        attr.val.clusterDim.z = 1;
        cfg.gridDim = dim3(ctas);
        cfg.blockDim = dim3(threads);
        cfg.dynamicSmemBytes = smem;
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        int clusters = 0;
        e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg);
        if (e == cudaSuccess) fit = clusters;
    }
    /* a refusal means "take another plan", not an error: clear it, and only
     * it (an error the caller left pending is not ours to take) */
    if (e != cudaSuccess) cudaGetLastError();
    if (fit < 0) fit = 0;
    if (cache.size() < 4096) cache.push_back(Entry{device, kernel, threads, ctas, smem, fit});
    return fit;
}


Resident resident_plan(int64_t steps, int min_threads, bool latency, int max_iters) {
    if (steps < 1 || steps > (int64_t)kResidentThreads * max_iters) return Resident{0, 0};
    int iters = 1;
    if (!latency) {
        iters = 4;
        while (iters > 1 && (steps + iters - 1) / iters < min_threads) iters /= 2;
    }
    while (steps > (int64_t)kResidentThreads * iters) iters *= 2;
    int64_t t = (steps + iters - 1) / iters;
    t = (t + 31) / 32 * 32;
    return Resident{iters, (int)t};
}

long tuning_env(const char *name, long fallback, long lo, long hi) {
    const char *v = getenv(name);
    char *end = nullptr;
    const long x = v && *v ? strtol(v, &end, 10) : fallback;
    return v && *v && (*end || x < lo || x > hi) ? fallback : x;
}

const NormTuning &norm_tuning(void) {
    static const NormTuning t{(int)tuning_env("OPSMITH_NORM_FWD_PACKS", 0, 0, 4),
                              (int)tuning_env("OPSMITH_NORM_LATENCY_PACKS", 0, 0, 8),
                              (int64_t)tuning_env("OPSMITH_NORM_RING_MIN_PACKS", kRingMinPacks, 1, 1L << 30),
                              (int64_t)tuning_env("OPSMITH_NORM_WARP_ROW_PACKS", kWarpRowPacks, 0, kWarpRowPacks),
                              tuning_env("OPSMITH_NORM_FWD_EARLY", 1, 0, 1) != 0,
                              (int)tuning_env("OPSMITH_NORM_WARP_ROW_LEAN", 2, 0, 4)};
    return t;
}

const RingTuning &ring_tuning(void) {
    static const RingTuning t = [] {
        auto env = tuning_env;
        return RingTuning{(int)env("OPSMITH_RING_STAGES", 2, 0, 2), (int)env("OPSMITH_RING_MAX_CTAS", 8, 1, 8),
                          (int64_t)env("OPSMITH_RING_SLICE_KB", kOnChipSliceBytes / 1024, 1, 227) * 1024,
                          (int)env("OPSMITH_RING_PACKS", 4, 1, 64), env("OPSMITH_RING_SPECIALISED", 1, 0, 1) != 0,
                          (int)env("OPSMITH_RING_WARP_PACKS", 256, 0, 256)};
    }();
    return t;
}

Launch fit_grid(Launch l, int64_t rows) {
    const int64_t fit = blocks_that_fit(l.kernel, l.threads, l.smem, l.ctas);
    l.grid = (rows < fit ? rows : fit) * l.ctas;
    return l;
}

} // namespace opsmith

extern "C" int opsmith_has_cuda(void) { return 1; }
