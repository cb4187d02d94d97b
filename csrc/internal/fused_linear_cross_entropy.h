/* What fused_linear_cross_entropy's CPU and CUDA launchers share: argument
 * validation, the default chunk, the workspace layout. Not exported. */
#ifndef OPSMITH_INTERNAL_FUSED_LINEAR_CROSS_ENTROPY_H
#define OPSMITH_INTERNAL_FUSED_LINEAR_CROSS_ENTROPY_H

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* cuBLASLt's workspace inside ours (the size NVIDIA suggests for Hopper) */
#define OPSMITH_FLCE_CUBLASLT_WORKSPACE ((size_t)32 << 20)

/* Byte offsets into the workspace (each 256-byte aligned); 0 size = absent.
 * CUDA: loss_rows, z_rows (rows, A), denom_wsum (denom, wsum, then for
 *       float16 the gradient products' alpha, 0, 1; A), logits (chunk,
 *       vocab; dtype), dweight32 (vocab, dim; float: 16-bit dtypes under
 *       OPSMITH_FLCE_DWEIGHT_ACC_FLOAT32),
 *       dbias (vocab, A), lt (cuBLASLt's).
 * CPU:  logits, ce (cross_entropy's workspace for a chunk), wf (weight in A,
 *       16-bit only), hf (a chunk of hidden in A, 16-bit only), dh (chunk,
 *       dim; A), dweight (vocab, dim; A), dbias (vocab, A). */
typedef struct opsmith_flce_layout {
    size_t loss_rows, z_rows, denom_wsum, logits, dweight32, dbias, lt, ce, dweight, total;
    size_t ce_bytes;
} opsmith_flce_layout;

/* The gradients' dtype for a launcher's fp32_dweight (opsmith_flce_grads):
 * float32 for OPSMITH_FLCE_GRADS_FLOAT32 on a 16-bit dtype, else dtype. */
OPSMITH_INTERNAL opsmith_dtype opsmith_internal_flce_grad_dtype(opsmith_dtype dtype, int fp32_dweight);

OPSMITH_INTERNAL opsmith_flce_layout opsmith_internal_flce_layout(opsmith_dtype dtype, int64_t rows, int64_t dim,
                                                                  int64_t vocab, int64_t chunk_rows, int fp32_dweight,
                                                                  int cuda);

/* Validates a forward call (`op` names the launcher in the message):
 * dtype, sizes, strides, options, NULL and misaligned pointers, the
 * workspace; *chunk_rows <= 0 is replaced by the default. */
OPSMITH_INTERNAL opsmith_status opsmith_internal_flce_check(
    const char *op, opsmith_dtype dtype, int64_t rows, int64_t dim, int64_t vocab, const void *hidden,
    int64_t hidden_row_stride, const void *weight, const void *bias, const int64_t *target, double label_smoothing,
    double z_loss, double softcap, int reduction, int64_t *chunk_rows, int fp32_dweight, const void *loss,
    const void *z_out, const void *dhidden, const void *dweight, const void *dbias, const int64_t *error, int cuda, const void *workspace,
    size_t workspace_bytes);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_INTERNAL_FUSED_LINEAR_CROSS_ENTROPY_H */
