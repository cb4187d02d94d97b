/* cross_entropy: softmax cross-entropy over the last dim of (rows, n) logits
 * with integer targets, as torch.nn.functional.cross_entropy, plus a z-loss
 * and a logit softcap; the forward can write the logit gradient in the same
 * pass. Included by opsmith.h; conventions there.
 *
 * Per row r with target t = target[r * target_stride] (A = the accumulate
 * type, opsmith_dtype_accumulate(dtype); w = weight, 1 where weight is NULL;
 * W = sum_c w[c]; ls = label_smoothing; c = softcap):
 *     y[c]     = softcap > 0 ? c * tanh(x[c] / c) : x[c]
 *     lse      = log(sum_c exp(y[c]))                       (online max and sum)
 *     loss[r]  = (1 - ls) * w[t] * (lse - y[t]) + ls / n * sum_c w[c] * (lse - y[c])
 *                + z_loss * lse^2                            (PyTorch's smoothing, PaLM's z-loss)
 *     zl[r]    = z_loss * lse^2
 * A row whose target is ignore_index has loss 0, zl 0, gradient 0 (its lse
 * is still computed). The reduction (opsmith_cross_entropy_reduction):
 * NONE gives loss[r] per row; SUM their sum; MEAN their sum divided by
 * denom = sum of w[t] over the rows not ignored (0 / 0 = NaN when every row
 * is ignored, as PyTorch). The z-loss is reduced the same way (not weighted
 * by w[t]) and reported separately in z_out. loss and z_out hold loss_dtype:
 * dtype (as PyTorch without autocast) or A (a float32 loss from 16-bit
 * logits, as PyTorch under autocast: the reduced value is not rounded to
 * 16 bits; ABI 3).
 *
 * The gradient of the reduced loss (an incoming gradient of 1), written by
 * the forward when dlogits is not NULL:
 *     p[c] = exp(y[c] - lse)
 *     g[c] = p[c] * ((1 - ls) * w[t] + ls / n * W + 2 z_loss lse) - (1 - ls) * w[t] * [c == t] - ls / n * w[c]
 *     dlogits[r, c] = scale * g[c] * (softcap > 0 ? 1 - (y[c] / c)^2 : 1),
 *     scale = 1 / denom for MEAN (read from the workspace, on the device), else 1.
 * The backward (opsmith_cross_entropy_bwd_*) multiplies that by the incoming
 * gradient of the loss: dx[r, :] = grad[r * grad_stride] * dlogits[r, :]
 * (grad_stride 0: one value for every row, SUM and MEAN; 1: NONE), in A,
 * rounded once. grad holds grad_dtype: dtype, or A (the gradient of a loss
 * in A, read unrounded; ABI 3).
 *
 * Targets out of range (not ignore_index and not in [0, n)): the CPU
 * launcher fails with OPSMITH_STATUS_INVALID_ARGUMENT naming the row and the
 * value; the CUDA launcher cannot fail on data without a host
 * synchronisation, so it sets error[0] = 1, error[1] = the row, error[2] =
 * the value (one of the bad rows when several are) and makes that row's loss
 * and gradient NaN. `error` (OPSMITH_CROSS_ENTROPY_ERROR_COUNT int64 values,
 * zero before the call) may be NULL on the CPU; the CUDA launcher needs it.
 *
 * Shapes and dtypes: logits (rows, n), row stride logits_row_stride, dtype
 * f64, f32, f16 or bf16 (arithmetic in A); target int64 with element stride
 * target_stride; weight (n) contiguous in A or NULL; loss and z_out in
 * loss_dtype (dtype or opsmith_dtype_accumulate(dtype)), (rows) for NONE
 * and (1) otherwise, z_out may be NULL; lse (rows) in
 * A, may be NULL; dlogits (rows, n) in dtype with its row stride, or NULL
 * (no gradient). rows may be 0 (SUM writes 0, MEAN NaN); n >= 1;
 * label_smoothing in [0, 1], z_loss >= 0 and finite, softcap >= 0 and finite
 * (0: none).
 * Aliasing: dlogits may be logits exactly (same pointer and row stride: the
 * gradient is written over the logits, each row after it was read); dx may
 * be dlogits exactly (then rows whose grad is exactly 1 are neither read nor
 * written). Nothing else may overlap.
 * Workspace: opsmith_cross_entropy_fwd_workspace_size(dtype, rows, z_loss)
 * bytes: the per-row losses (for a reduction in a fixed order), the per-row
 * z-losses only when z_loss > 0, the denominator and W; in A. With z_loss 0
 * that is one A a row (plus 128 bytes), the only memory the op needs beyond
 * its inputs and outputs. */
#ifndef OPSMITH_CROSS_ENTROPY_H
#define OPSMITH_CROSS_ENTROPY_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum opsmith_cross_entropy_reduction {
    OPSMITH_CROSS_ENTROPY_REDUCTION_NONE = 0,
    OPSMITH_CROSS_ENTROPY_REDUCTION_SUM = 1,
    OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN = 2,
} opsmith_cross_entropy_reduction;

/* int64 values of the error buffer: flag, row, target value */
#define OPSMITH_CROSS_ENTROPY_ERROR_COUNT 3

/* ABI 2: z_loss added (the z-loss rows exist only when it is > 0); ABI 3:
 * loss_dtype added to the forward launchers, grad_dtype to the backward's */
OPSMITH_API size_t opsmith_cross_entropy_fwd_workspace_size(opsmith_dtype dtype, int64_t rows, double z_loss);

OPSMITH_API opsmith_status opsmith_cross_entropy_fwd_cpu(
    opsmith_dtype dtype, int64_t rows, int64_t n, const void *logits, int64_t logits_row_stride, const int64_t *target,
    int64_t target_stride, const void *weight, int64_t ignore_index, double label_smoothing, double z_loss,
    double softcap, opsmith_cross_entropy_reduction reduction, opsmith_dtype loss_dtype, void *loss, void *z_out,
    void *lse, void *dlogits, int64_t dlogits_row_stride, int64_t *error, void *workspace, size_t workspace_bytes);

OPSMITH_API opsmith_status opsmith_cross_entropy_bwd_cpu(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                         opsmith_dtype grad_dtype, const void *grad,
                                                         int64_t grad_stride, const void *dlogits,
                                                         int64_t dlogits_row_stride, void *dx, int64_t dx_row_stride);

/* The CUDA launchers take the same arguments as device pointers, plus the
 * stream they run on. No host synchronisation: they capture in CUDA graphs. */
OPSMITH_API opsmith_status opsmith_cross_entropy_fwd_cuda(
    opsmith_dtype dtype, int64_t rows, int64_t n, const void *logits, int64_t logits_row_stride, const int64_t *target,
    int64_t target_stride, const void *weight, int64_t ignore_index, double label_smoothing, double z_loss,
    double softcap, opsmith_cross_entropy_reduction reduction, opsmith_dtype loss_dtype, void *loss, void *z_out,
    void *lse, void *dlogits, int64_t dlogits_row_stride, int64_t *error, void *workspace, size_t workspace_bytes,
    opsmith_cuda_stream stream);

OPSMITH_API opsmith_status opsmith_cross_entropy_bwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                          opsmith_dtype grad_dtype, const void *grad,
                                                          int64_t grad_stride, const void *dlogits,
                                                          int64_t dlogits_row_stride, void *dx, int64_t dx_row_stride,
                                                          opsmith_cuda_stream stream);

/* Scalar references, the specification the kernels are tested against:
 * plain loops over float64 data, no threads; all arrays contiguous, target
 * contiguous and in range; weight and dlogits may be NULL; loss and z_out
 * as above. */
OPSMITH_API void opsmith_cross_entropy_fwd_reference(int64_t rows, int64_t n, const double *logits,
                                                     const int64_t *target, const double *weight, int64_t ignore_index,
                                                     double label_smoothing, double z_loss, double softcap,
                                                     opsmith_cross_entropy_reduction reduction, double *loss,
                                                     double *z_out, double *lse, double *dlogits);
OPSMITH_API void opsmith_cross_entropy_bwd_reference(int64_t rows, int64_t n, const double *grad, int64_t grad_stride,
                                                     const double *dlogits, double *dx);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_CROSS_ENTROPY_H */
