/* What cross_entropy's CPU and CUDA launchers share: argument validation and
 * the workspace layout. Not exported. */
#ifndef OPSMITH_INTERNAL_CROSS_ENTROPY_H
#define OPSMITH_INTERNAL_CROSS_ENTROPY_H

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Validates a forward call; `op` names the launcher in the error message;
 * need_error: the error buffer must be given (CUDA). Checks the dtype,
 * sizes, strides, options, NULL and misaligned pointers, the workspace and
 * the aliasing rule (dlogits is logits exactly, or apart from it). */
OPSMITH_INTERNAL opsmith_status opsmith_internal_cross_entropy_fwd_check(
    const char *op, opsmith_dtype dtype, int64_t rows, int64_t n, const void *logits, int64_t logits_row_stride,
    const int64_t *target, double label_smoothing, double z_loss, double softcap, int reduction, const void *loss,
    const void *dlogits, int64_t dlogits_row_stride, const int64_t *error, int need_error, const void *workspace,
    size_t workspace_bytes);

/* Validates a backward call (dx is dlogits exactly, or apart from it). */
OPSMITH_INTERNAL opsmith_status opsmith_internal_cross_entropy_bwd_check(const char *op, opsmith_dtype dtype,
                                                                         int64_t rows, int64_t n, const void *grad,
                                                                         int64_t grad_stride, const void *dlogits,
                                                                         int64_t dlogits_row_stride, const void *dx,
                                                                         int64_t dx_row_stride);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_INTERNAL_CROSS_ENTROPY_H */
