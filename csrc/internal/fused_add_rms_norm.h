/* What the residual-add RMSNorm's CPU and CUDA launchers share: argument
 * validation (RMSNorm's checks on the norm's part, plus those of residual,
 * h and dh). Not exported. */
#ifndef OPSMITH_INTERNAL_FUSED_ADD_RMS_NORM_H
#define OPSMITH_INTERNAL_FUSED_ADD_RMS_NORM_H

#include "internal/rms_norm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The forward's checks: RMSNorm's on (x, weight, y, inv_rms), then residual
 * and h (x's dtype, row strides, alignment) and the aliasing rule: h is
 * residual or x exactly, or apart from them; y apart from residual and h. */
OPSMITH_INTERNAL opsmith_status opsmith_internal_fused_add_rms_norm_fwd_check(
    const char *op, opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype y_dtype, int64_t rows,
    int64_t n, const void *x, int64_t x_row_stride, const void *residual, int64_t residual_row_stride,
    const void *weight, double offset, double eps, opsmith_rms_norm_casting casting, const void *y,
    int64_t y_row_stride, const void *h, int64_t h_row_stride, const void *inv_rms);

/* The backward's: RMSNorm's on (dy, h as its x, weight, dx, dweight), then
 * dh (may be NULL): row stride, alignment, apart from dx. */
OPSMITH_INTERNAL opsmith_status opsmith_internal_fused_add_rms_norm_bwd_check(
    const char *op, opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype dy_dtype, int64_t rows,
    int64_t n, const void *dy, int64_t dy_row_stride, const void *dh, int64_t dh_row_stride, const void *h,
    int64_t h_row_stride, const void *weight, double offset, opsmith_rms_norm_casting casting,
    const void *inv_rms, const void *dx, int64_t dx_row_stride, const void *dweight);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_INTERNAL_FUSED_ADD_RMS_NORM_H */
