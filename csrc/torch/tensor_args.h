// Helpers every bridge function uses to turn tensors into C ABI arguments.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "opsmith.h"

#if OPSMITH_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace opsmith {

// Numbers and shapes for error messages are formatted here with snprintf
// rather than streamed: on a machine whose C++ compiler is newer than the
// one torch was built with, streaming an integer or a double through the
// libstdc++ loaded by torch crashed (seen on the GPU machine); strings are safe.
// So every argument of a TORCH_CHECK message is a string (a literal, a
// const char *, text(...)) or a c10 type printed by c10's own operator<<
// (ScalarType, Device): never a bare number such as x.size(1). One bare
// int64 in cross_entropy's weight check (logits.size(1)) was a segmentation
// fault there (Python 3.12) on a wrong weight, where every check around it
// raised. tests/test_bridge_messages.py enforces this over csrc/torch and
// the new-op templates.
inline std::string text(double v) {
    char buf[32];
    snprintf(buf, sizeof buf, "%g", v);
    return buf;
}

inline std::string text(int64_t v) {
    char buf[32];
    snprintf(buf, sizeof buf, "%lld", (long long)v);
    return buf;
}

inline std::string text(at::IntArrayRef shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); i++) s += (i ? ", " : "") + text(shape[i]);
    return s + "]";
}

inline opsmith_dtype dtype_of(const at::Tensor &t, const char *op, const char *arg) {
    switch (t.scalar_type()) {
    case at::kDouble: return OPSMITH_DTYPE_F64;
    case at::kFloat: return OPSMITH_DTYPE_F32;
    case at::kHalf: return OPSMITH_DTYPE_F16;
    case at::kBFloat16: return OPSMITH_DTYPE_BF16;
    default:
        TORCH_CHECK(false, op, ": ", arg, " must be float64, float32, float16 or bfloat16, got ",
                         t.scalar_type());
    }
}

// The dtype statistics are kept in: float64 for float64, else float32.
inline at::ScalarType accumulate_type(const at::Tensor &t) {
    return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

inline void check_same_device(const at::Tensor &t, const at::Tensor &x, const char *op,
                              const char *arg) {
    TORCH_CHECK(t.device() == x.device(), op, ": ", arg, " must be on the same device as x (",
                x.device(), "), got ", t.device());
}

inline void check_same_dtype(const at::Tensor &t, const at::Tensor &x, const char *op,
                             const char *arg) {
    TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", arg,
                     " must have the same dtype as x (", x.scalar_type(), "), got ",
                     t.scalar_type());
}

inline void check_device_supported(const at::Tensor &x, const char *op) {
#if OPSMITH_WITH_CUDA
    TORCH_CHECK(x.is_cpu() || x.is_cuda(), op, ": x must be a CPU or CUDA tensor, got ", x.device());
#else
    TORCH_CHECK(x.is_cpu(), op, ": x must be a CPU tensor (this build has no CUDA), got ",
                x.device());
#endif
}

// A tensor seen as (rows, n): its last dim contiguous and its leading dims
// collapsible into one row stride. Views that are not (transposed last dims,
// overlapping rows) are copied once into a contiguous tensor. Outputs are
// allocated contiguous, so their row stride is n.
struct Rows {
    at::Tensor tensor; // keeps a copy alive when one was made
    int64_t rows;
    int64_t n;
    int64_t stride;
    const void *data() const { return tensor.data_ptr(); }
};

inline Rows as_rows(const at::Tensor &t) {
    const int64_t n = t.size(-1);
    const int64_t rows = n > 0 ? t.numel() / n : 0;
    bool ok = t.stride(-1) == 1 || n == 1;
    int64_t stride = n, expected = -1;
    for (int64_t d = t.dim() - 2; d >= 0 && ok; d--) {
        if (t.size(d) == 1) continue;
        if (expected < 0) stride = t.stride(d);
        else ok = t.stride(d) == expected;
        expected = t.stride(d) * t.size(d);
    }
    if (rows > 1 && stride < n) ok = false;
    if (!ok) return Rows{t.contiguous(), rows, n, n};
    return Rows{t, rows, n, stride};
}

// A failed launch: the C library's message names the argument (or carries
// the CUDA runtime's); the bridge's own checks normally catch bad input first.
inline void check_status(opsmith_status status, const char *op) {
    TORCH_CHECK(status == OPSMITH_STATUS_SUCCESS, op, ": ", opsmith_status_string(status), ": ",
                opsmith_last_error());
}

// The CPU kernels run on as many threads as torch.set_num_threads says.
// opsmith's OpenMP runtime may not be the one PyTorch's wheel bundles, so
// omp_set_num_threads in one does not reach the other: pass the count along.
inline void use_torch_cpu_threads() { opsmith_set_num_threads(at::get_num_threads()); }

// A tensor an opsmith kernel writes first (an output, a gradient, a
// workspace): at::empty, and on the CPU its whole 2 MB pages asked for as
// transparent huge pages before that first write (Linux madvise; where THP
// is "madvise", the default of many distributions). A fresh 64 MB output
// otherwise costs 16384 page faults on its first touch: 12.8 ms against
// 4.0 ms with huge pages to fill one on the 2-core development machine,
// more than LayerNorm's own work at 4096 x 4096 (bench/NOTES.md). PyTorch's
// allocator does the same for every allocation under THP_MEM_ALLOC_ENABLE=1.
// OPSMITH_CPU_HUGE_PAGES=0 turns it off.
inline void advise_huge_pages(const at::Tensor &t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    static const bool enabled = [] {
        const char *v = getenv("OPSMITH_CPU_HUGE_PAGES");
        return !(v && v[0] == '0' && v[1] == 0);
    }();
    constexpr uintptr_t kHuge = uintptr_t(1) << 21;
    if (!enabled || !t.device().is_cpu()) return;
    const size_t bytes = t.nbytes();
    if (bytes < 2 * kHuge) return;
    const uintptr_t p = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t first = (p + kHuge - 1) & ~(kHuge - 1), end = (p + bytes) & ~(kHuge - 1);
    if (end > first) madvise(reinterpret_cast<void *>(first), end - first, MADV_HUGEPAGE); // a hint: errors ignored
#else
    (void)t;
#endif
}

inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions &options) {
    at::Tensor t = at::empty(sizes, options);
    advise_huge_pages(t);
    return t;
}

// The per-row statistics (mean, rstd, inv_rms) of rows with no elements:
// NaN, a mean over nothing (PyTorch's layer norm gives a NaN rstd for a
// [..., 0] input too). Rows of width 0 run no kernel (their outputs and
// gradients are empty), so this is the statistics' only writer.
inline at::Tensor empty_row_stats(at::Tensor t) {
    if (t.numel() > 0) t.fill_(std::numeric_limits<double>::quiet_NaN());
    return t;
}

// Workspace on the tensor's device from PyTorch's allocator (so a CUDA graph
// capture and stream ordering hold); aligned as the ABI asks (both of
// PyTorch's allocators align to at least 64 bytes).
inline at::Tensor workspace(size_t bytes, const at::Tensor &like) {
    return empty_output({(int64_t)bytes}, like.options().dtype(at::kByte));
}

inline void *data_or_null(at::Tensor &t) { return t.numel() ? t.data_ptr() : nullptr; }

// What a call may still take on like's device: its memory less what
// PyTorch's tensors hold there (the caching allocator's live bytes; blocks
// it caches unused count as free). Host bookkeeping only: no driver call,
// so it is safe inside a CUDA-graph capture and never synchronises; memory
// other processes hold is not seen. SIZE_MAX on the CPU.
inline size_t device_free_bytes(const at::Tensor &like) {
#if OPSMITH_WITH_CUDA
    if (like.is_cuda()) {
        const auto index = like.device().index();
        const size_t total = at::cuda::getDeviceProperties(index)->totalGlobalMem;
        const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
        const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
        const size_t live = (size_t)std::max<int64_t>(0, stats.allocated_bytes[all].current);
        return live < total ? total - live : 0;
    }
#endif
    (void)like;
    return SIZE_MAX;
}

} // namespace opsmith
