/* Residual add + RMSNorm on CUDA: RMSNorm's kernels and launch plans
 * (rms_norm_kernels.cuh) with their residual stage on. The forward reads x
 * and the residual once each (16-byte packs, rows in registers), stores h =
 * x + residual rounded to x's dtype and normalises it in the same pass; the
 * backward is RMSNorm's on h (resident or staged, the cluster split for wide
 * rows) with dh read beside dy and added to dx. Same plans, same
 * deterministic weight gradient; int64 indexing; the stream given. */
#include "internal/fused_add_rms_norm.h"
#include "rms_norm_kernels.cuh"

using namespace opsmith;

extern "C" opsmith_status opsmith_fused_add_rms_norm_fwd_cuda(
    opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype y_dtype, int64_t rows, int64_t n, const void *x,
    int64_t x_row_stride, const void *residual, int64_t residual_row_stride, const void *weight, double offset,
    double eps, opsmith_rms_norm_casting casting, void *y, int64_t y_row_stride, void *h, int64_t h_row_stride,
    void *inv_rms, opsmith_cuda_stream stream) {
    weight_dtype = kernel_weight_dtype(x_dtype, weight_dtype, weight);
    opsmith_status st = opsmith_internal_fused_add_rms_norm_fwd_check(
        "fused_add_rms_norm_fwd_cuda", x_dtype, weight_dtype, y_dtype, rows, n, x, x_row_stride, residual,
        residual_row_stride, weight, offset, eps, casting, y, y_row_stride, h, h_row_stride, inv_rms);
    if (st != OPSMITH_STATUS_SUCCESS || rows == 0) return st;
    const bool llama = casting == OPSMITH_RMS_NORM_CASTING_LLAMA;
    return dispatch_mixed(x_dtype, weight_dtype, y_dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto k) {
        using K = decltype(k);
        using T = typename K::T;
        const Opts<AccK<K>> o{(AccK<K>)offset, llama};
        const AddIn<T> add{static_cast<const T *>(residual), residual_row_stride, static_cast<T *>(h), h_row_stride};
        return fwd<K, true>(rows, n, x, x_row_stride, weight, o, eps, y, y_row_stride, inv_rms, stream, add);
    });
}

extern "C" size_t opsmith_fused_add_rms_norm_bwd_cuda_workspace_size(opsmith_dtype x_dtype,
                                                                     opsmith_dtype weight_dtype,
                                                                     opsmith_dtype dy_dtype, int64_t rows, int64_t n,
                                                                     const void *weight, void *dweight) {
    if (!weight || !dweight || rows <= 0 || n <= 0) return 0;
    /* enough for the plans with and without dh (the staged ring's width,
     * hence its plan, depends on it) */
    const int64_t groups = dispatch_mixed(x_dtype, weight_dtype, dy_dtype, (int64_t)0, [&](auto k) {
        const int64_t a = bwd_workspace_rows<decltype(k), true>(rows, n);
        const int64_t b = bwd_workspace_rows<decltype(k), false>(rows, n);
        return a > b ? a : b;
    });
    return (size_t)(groups * n) * opsmith_dtype_size(opsmith_dtype_accumulate(x_dtype));
}

extern "C" opsmith_status opsmith_fused_add_rms_norm_bwd_cuda(
    opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype dy_dtype, int64_t rows, int64_t n,
    const void *dy, int64_t dy_row_stride, const void *dh, int64_t dh_row_stride, const void *h,
    int64_t h_row_stride, const void *weight, double offset, opsmith_rms_norm_casting casting, const void *inv_rms,
    void *dx, int64_t dx_row_stride, void *dweight, void *workspace, size_t workspace_bytes,
    opsmith_cuda_stream stream) {
    static const char op[] = "fused_add_rms_norm_bwd_cuda";
    void *dw = weight ? dweight : nullptr;
    weight_dtype = kernel_weight_dtype(x_dtype, weight_dtype, weight);
    opsmith_status st = opsmith_internal_fused_add_rms_norm_bwd_check(
        op, x_dtype, weight_dtype, dy_dtype, rows, n, dy, dy_row_stride, dh, dh_row_stride, h, h_row_stride, weight,
        offset, casting, inv_rms, dx, dx_row_stride, dw);
    if (st != OPSMITH_STATUS_SUCCESS) return st;
    if (rows == 0) {
        /* no rows: the weight gradient is an empty sum */
        if (dw && cudaMemsetAsync(dw, 0, (size_t)n * opsmith_dtype_size(weight_dtype), stream) != cudaSuccess)
            return launch_status();
        return OPSMITH_STATUS_SUCCESS;
    }
    st = opsmith_internal_check_workspace(
        op, workspace, workspace_bytes,
        opsmith_fused_add_rms_norm_bwd_cuda_workspace_size(x_dtype, weight_dtype, dy_dtype, rows, n, weight, dw));
    if (st != OPSMITH_STATUS_SUCCESS) return st;
    const bool llama = casting == OPSMITH_RMS_NORM_CASTING_LLAMA;
    return dispatch_mixed(x_dtype, weight_dtype, dy_dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto k) {
        using K = decltype(k);
        using T = typename K::T;
        const Opts<AccK<K>> o{(AccK<K>)offset, llama};
        if (!dh) /* no gradient reaches h directly: RMSNorm's own kernels */
            return bwd<K>(rows, n, dy, dy_row_stride, h, h_row_stride, weight, o, inv_rms, dx, dx_row_stride, dw,
                          workspace, stream);
        const DhIn<T> dhin{static_cast<const T *>(dh), dh_row_stride};
        return bwd<K, true>(rows, n, dy, dy_row_stride, h, h_row_stride, weight, o, inv_rms, dx, dx_row_stride, dw,
                            workspace, stream, dhin);
    });
}
