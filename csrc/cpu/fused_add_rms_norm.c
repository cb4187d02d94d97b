/* Residual add + RMSNorm on the CPU. The row loops are RMSNorm's
 * (csrc/cpu/rms_norm.c) with their residual stage on: each row's block is
 * widened from x and residual, added, stored to h in x's dtype and read
 * back (the rounding a separate add gives), while the row is still in
 * cache, and the norm runs on h; the backward is RMSNorm's on h with dh
 * added to dx. One body for both ops, so their arithmetic cannot drift. */
#include "internal/fused_add_rms_norm.h"

static opsmith_dtype kernel_weight_dtype(opsmith_dtype x_dtype, opsmith_dtype weight_dtype, const void *weight) {
    return weight ? weight_dtype : opsmith_dtype_accumulate(x_dtype);
}

opsmith_status opsmith_fused_add_rms_norm_fwd_cpu(opsmith_dtype x_dtype, opsmith_dtype weight_dtype,
                                                  opsmith_dtype y_dtype, int64_t rows, int64_t n, const void *x,
                                                  int64_t x_row_stride, const void *residual,
                                                  int64_t residual_row_stride, const void *weight, double offset,
                                                  double eps, opsmith_rms_norm_casting casting, void *y,
                                                  int64_t y_row_stride, void *h, int64_t h_row_stride,
                                                  void *inv_rms) {
    weight_dtype = kernel_weight_dtype(x_dtype, weight_dtype, weight);
    const opsmith_status s = opsmith_internal_fused_add_rms_norm_fwd_check(
        "fused_add_rms_norm_fwd_cpu", x_dtype, weight_dtype, y_dtype, rows, n, x, x_row_stride, residual,
        residual_row_stride, weight, offset, eps, casting, y, y_row_stride, h, h_row_stride, inv_rms);
    if (s != OPSMITH_STATUS_SUCCESS || rows == 0) return s;
    const opsmith_internal_rms_norm_cpu_fwd a = {
        x_dtype, weight_dtype, y_dtype, rows, n, x_row_stride, y_row_stride, x, weight, y, inv_rms, offset, eps,
        casting == OPSMITH_RMS_NORM_CASTING_LLAMA, residual, residual_row_stride, h, h_row_stride};
    opsmith_internal_rms_norm_cpu_fwd_run(&a);
    return OPSMITH_STATUS_SUCCESS;
}

size_t opsmith_fused_add_rms_norm_bwd_cpu_workspace_size(opsmith_dtype x_dtype, opsmith_dtype weight_dtype,
                                                         opsmith_dtype dy_dtype, int64_t rows, int64_t n,
                                                         const void *weight, void *dweight) {
    (void)weight_dtype, (void)dy_dtype;
    return opsmith_internal_rms_norm_bwd_cpu_workspace(x_dtype, rows, n, weight && dweight);
}

opsmith_status opsmith_fused_add_rms_norm_bwd_cpu(opsmith_dtype x_dtype, opsmith_dtype weight_dtype,
                                                  opsmith_dtype dy_dtype, int64_t rows, int64_t n, const void *dy,
                                                  int64_t dy_row_stride, const void *dh, int64_t dh_row_stride,
                                                  const void *h, int64_t h_row_stride, const void *weight,
                                                  double offset, opsmith_rms_norm_casting casting,
                                                  const void *inv_rms, void *dx, int64_t dx_row_stride,
                                                  void *dweight, void *workspace, size_t workspace_bytes) {
    static const char op[] = "fused_add_rms_norm_bwd_cpu";
    void *dw = weight ? dweight : NULL;
    weight_dtype = kernel_weight_dtype(x_dtype, weight_dtype, weight);
    opsmith_status s = opsmith_internal_fused_add_rms_norm_bwd_check(
        op, x_dtype, weight_dtype, dy_dtype, rows, n, dy, dy_row_stride, dh, dh_row_stride, h, h_row_stride, weight,
        offset, casting, inv_rms, dx, dx_row_stride, dw);
    if (s != OPSMITH_STATUS_SUCCESS) return s;
    if (rows == 0) {
        /* no rows: the weight gradient is an empty sum */
        if (dw)
            for (int64_t i = 0; i < n; i++) opsmith_store_from_double(weight_dtype, dw, i, 0.0);
        return OPSMITH_STATUS_SUCCESS;
    }
    s = opsmith_internal_check_workspace(op, workspace, workspace_bytes,
                                         opsmith_internal_rms_norm_bwd_cpu_workspace(x_dtype, rows, n, dw != NULL));
    if (s != OPSMITH_STATUS_SUCCESS) return s;
    const opsmith_internal_rms_norm_cpu_bwd a = {
        x_dtype, weight_dtype, dy_dtype, rows, n, dy_row_stride, h_row_stride, dx_row_stride, dy, h, weight,
        inv_rms, dx, offset, casting == OPSMITH_RMS_NORM_CASTING_LLAMA, dh, dh_row_stride};
    opsmith_internal_rms_norm_cpu_bwd_run(&a, dw, workspace);
    return OPSMITH_STATUS_SUCCESS;
}
