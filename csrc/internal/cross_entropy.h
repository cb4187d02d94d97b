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
 * sizes, strides, options, the loss dtype (dtype or its accumulate type),
 * NULL and misaligned pointers, the workspace and
 * the aliasing rule (dlogits is logits exactly, or apart from it). */
OPSMITH_INTERNAL opsmith_status opsmith_internal_cross_entropy_fwd_check(
    const char *op, opsmith_dtype dtype, int64_t rows, int64_t n, const void *logits, int64_t logits_row_stride,
    const int64_t *target, double label_smoothing, double z_loss, double softcap, int reduction,
    opsmith_dtype loss_dtype, const void *loss, const void *dlogits, int64_t dlogits_row_stride, const int64_t *error,
    int need_error, const void *workspace,
    size_t workspace_bytes, const void *weight, const void *z_out, const void *lse);

/* The options cross_entropy and fused_linear_cross_entropy share:
 * label_smoothing in [0, 1], z_loss and softcap finite and >= 0, and both
 * within float's range where the arithmetic is in float (dtype other than
 * f64). */
OPSMITH_INTERNAL opsmith_status opsmith_internal_cross_entropy_check_options(const char *op, opsmith_dtype dtype,
                                                                            double ls, double z_loss, double softcap);

/* Validates a backward call (grad in dtype or its accumulate type; dx is
 * dlogits exactly, or apart from it). */
OPSMITH_INTERNAL opsmith_status opsmith_internal_cross_entropy_bwd_check(const char *op, opsmith_dtype dtype,
                                                                         int64_t rows, int64_t n,
                                                                         opsmith_dtype grad_dtype, const void *grad,
                                                                         int64_t grad_stride, const void *dlogits,
                                                                         int64_t dlogits_row_stride, const void *dx,
                                                                         int64_t dx_row_stride);

/* The CUDA forward's three launches, for fused_linear_cross_entropy (which
 * runs the rows pass on each chunk of logits it computes, against one
 * denominator counted over every row first). A = the accumulate type.
 *   prep:   denom_wsum[0] = sum of w[t] over the rows not ignored (targets in
 *           range), denom_wsum[1] = sum_c w[c] (weight NULL: n);
 *   rows:   per-row losses and z-losses into loss_rows[r], z_rows[r] (A), the
 *           gradient (scaled by 1 / denom_wsum[0] for MEAN) into dlogits; a
 *           bad target's row is reported as row_offset + r (the chunk's first
 *           row in the caller's numbering);
 *   finish: the reduced loss and z-loss from `rows` per-row values (SUM or
 *           MEAN; loss and z_out in dtype, z_out may be NULL).
 * No argument checks: the caller's launcher has made them. */
OPSMITH_INTERNAL opsmith_status opsmith_internal_cross_entropy_prep_cuda(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                                         const int64_t *target, int64_t target_stride,
                                                                         const void *weight, int64_t ignore_index,
                                                                         void *denom_wsum, opsmith_cuda_stream stream);
OPSMITH_INTERNAL opsmith_status opsmith_internal_cross_entropy_rows_cuda(
    opsmith_dtype dtype, int64_t rows, int64_t n, const void *logits, int64_t logits_row_stride,
    const int64_t *target, int64_t target_stride, const void *weight, int64_t ignore_index, double label_smoothing,
    double z_loss, double softcap, int reduction, const void *denom_wsum, void *loss_rows, void *z_rows,
    void *dlogits, int64_t dlogits_row_stride, int64_t *error, int64_t row_offset, opsmith_cuda_stream stream);
OPSMITH_INTERNAL opsmith_status opsmith_internal_cross_entropy_finish_cuda(opsmith_dtype dtype, int64_t rows,
                                                                           int reduction, const void *loss_rows,
                                                                           const void *z_rows, const void *denom_wsum,
                                                                           void *loss, void *z_out,
                                                                           opsmith_cuda_stream stream);

/* The forward's workspace, in A (acc bytes each): the per-row losses at
 * [0, rows), the per-row z-losses at [rows, 2 rows) only when z_loss > 0,
 * then the denominator and W (opsmith_cross_entropy_fwd_workspace_size).
 * The z-loss rows, or NULL when there are none. After
 * opsmith_cross_entropy_fwd_cpu returns, both hold that call's rows (what
 * fused_linear_cross_entropy's CPU path reduces over every chunk). */
static inline void *opsmith_internal_cross_entropy_z_rows(void *workspace, int64_t rows, double z_loss, size_t acc) {
    return z_loss > 0.0 ? (void *)((char *)workspace + (size_t)rows * acc) : NULL;
}

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_INTERNAL_CROSS_ENTROPY_H */
