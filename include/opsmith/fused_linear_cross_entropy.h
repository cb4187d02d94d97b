/* fused_linear_cross_entropy: the LM head and its softmax cross-entropy in
 * one call, without the (rows, vocab) logits ever existing whole. Included by
 * opsmith.h; conventions there.
 *
 *     logits[r, v] = sum_k hidden[r, k] * weight[v, k] + bias[v]     (bias may be NULL)
 *     loss, z_out  = cross_entropy(logits, target, ...)             (include/opsmith/cross_entropy.h:
 *                    ignore_index, label_smoothing, z_loss, softcap; reduction SUM or MEAN; no class weights)
 *
 * The forward runs over chunks of chunk_rows tokens: the chunk's logits are
 * computed into the workspace, the cross-entropy row pass writes their
 * gradient over them (the gradient of the reduced loss, an incoming gradient
 * of 1; the mean's denominator counted on the device before the chunks), and
 * the gradients follow from it:
 *     dhidden[r, :] = sum_v dlogits[r, v] * weight[v, :]
 *     dweight[v, :] = sum_r dlogits[r, v] * hidden[r, :]   (accumulated over the chunks)
 *     dbias[v]      = sum_r dlogits[r, v]
 * The backward is the cross-entropy backward applied to each of them:
 * opsmith_cross_entropy_bwd_{cpu,cuda}(dtype, rows, n, grad, 0, g, n, g, n)
 * scales a gradient g (rows, n) in place by the incoming gradient (one
 * value), and leaves it alone where that value is exactly 1.
 *
 * Shapes and dtypes (one dtype for every float tensor but the loss: f64, f32,
 * f16 or bf16; arithmetic in A = opsmith_dtype_accumulate(dtype)): hidden
 * (rows, dim) with row stride hidden_row_stride (>= dim); weight (vocab,
 * dim) contiguous; bias (vocab) or NULL; target int64 with element stride
 * target_stride; loss and z_out (z_out may be NULL) one value each in A (a
 * float32 loss for 16-bit inputs, as the float32 cross-entropy of an LM head
 * gives); dhidden (rows, dim), dweight (vocab, dim) and dbias (vocab)
 * contiguous, in dtype (or float32: fp32_dweight below), each NULL when not
 * wanted (all three NULL: the loss alone, no gradient pass). rows >= 0
 * (0: SUM gives 0, MEAN NaN, gradients zero), dim >= 1, vocab >= 1.
 * chunk_rows <= 0 takes
 * opsmith_fused_linear_cross_entropy_chunk_rows(dtype, rows, vocab, 0).
 * fp32_dweight, an opsmith_flce_grads value, for the 16-bit dtypes (f32 and
 * f64 ignore it): OPSMITH_FLCE_GRADS_IN_DTYPE, the gradients in dtype;
 * OPSMITH_FLCE_DWEIGHT_ACC_FLOAT32 (CUDA; the CPU always accumulates in the
 * accumulate type), the same, dweight accumulated over the chunks in a
 * float32 buffer in the workspace (vocab * dim * 4 bytes) rather than in
 * dweight's own 16-bit storage; OPSMITH_FLCE_GRADS_FLOAT32, dhidden,
 * dweight and dbias float32 arrays (dweight accumulated in place), so a
 * caller that scales them afterwards (a loss scaler's incoming gradient)
 * rounds to 16 bits once, after the scale: a mean's gradient over
 * thousands of tokens has elements under float16's normal range.
 * Targets out of range: as cross_entropy (CPU: OPSMITH_STATUS_INVALID_ARGUMENT
 * before anything is written; CUDA: error[] set, NaN loss; `error` needed on
 * CUDA, zero before the call).
 * Aliasing: nothing may overlap, except that hidden/weight/bias/target are
 * only read.
 * Workspace: opsmith_fused_linear_cross_entropy_workspace_size(...) bytes with
 * the same chunk_rows and fp32_dweight (cuda != 0 for the CUDA launcher,
 * whose matrix products run through cuBLASLt, its workspace included). */
#ifndef OPSMITH_FUSED_LINEAR_CROSS_ENTROPY_H
#define OPSMITH_FUSED_LINEAR_CROSS_ENTROPY_H

#ifdef __cplusplus
extern "C" {
#endif

/* The gradients' storage (the launchers' fp32_dweight argument, above) */
typedef enum opsmith_flce_grads {
    OPSMITH_FLCE_GRADS_IN_DTYPE = 0,
    OPSMITH_FLCE_DWEIGHT_ACC_FLOAT32 = 1,
    OPSMITH_FLCE_GRADS_FLOAT32 = 2,
} opsmith_flce_grads;

/* Tokens a chunk: the most whose logits (chunk_rows * vocab elements of
 * dtype) fit in budget_bytes (0: 512 MiB), a multiple of 128 when >= 256,
 * at least 1 and at most rows (1 when rows is 0). */
OPSMITH_API int64_t opsmith_fused_linear_cross_entropy_chunk_rows(opsmith_dtype dtype, int64_t rows, int64_t vocab,
                                                                  size_t budget_bytes);

OPSMITH_API size_t opsmith_fused_linear_cross_entropy_workspace_size(opsmith_dtype dtype, int64_t rows, int64_t dim,
                                                                     int64_t vocab, int64_t chunk_rows,
                                                                     int fp32_dweight, int cuda);

OPSMITH_API opsmith_status opsmith_fused_linear_cross_entropy_fwd_cpu(
    opsmith_dtype dtype, int64_t rows, int64_t dim, int64_t vocab, const void *hidden, int64_t hidden_row_stride,
    const void *weight, const void *bias, const int64_t *target, int64_t target_stride, int64_t ignore_index,
    double label_smoothing, double z_loss, double softcap, opsmith_cross_entropy_reduction reduction,
    int64_t chunk_rows, int fp32_dweight, void *loss, void *z_out, void *dhidden, void *dweight, void *dbias,
    int64_t *error, void *workspace, size_t workspace_bytes);

/* The same with device pointers, on `stream`; no host synchronisation
 * (captures in CUDA graphs). */
OPSMITH_API opsmith_status opsmith_fused_linear_cross_entropy_fwd_cuda(
    opsmith_dtype dtype, int64_t rows, int64_t dim, int64_t vocab, const void *hidden, int64_t hidden_row_stride,
    const void *weight, const void *bias, const int64_t *target, int64_t target_stride, int64_t ignore_index,
    double label_smoothing, double z_loss, double softcap, opsmith_cross_entropy_reduction reduction,
    int64_t chunk_rows, int fp32_dweight, void *loss, void *z_out, void *dhidden, void *dweight, void *dbias,
    int64_t *error, void *workspace, size_t workspace_bytes, opsmith_cuda_stream stream);

/* Scalar reference, the specification: plain loops over float64 data, no
 * threads, no chunks; all arrays contiguous, targets in range; bias, z_out
 * and the three gradients may be NULL. */
OPSMITH_API void opsmith_fused_linear_cross_entropy_fwd_reference(
    int64_t rows, int64_t dim, int64_t vocab, const double *hidden, const double *weight, const double *bias,
    const int64_t *target, int64_t ignore_index, double label_smoothing, double z_loss, double softcap,
    opsmith_cross_entropy_reduction reduction, double *loss, double *z_out, double *dhidden, double *dweight,
    double *dbias);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_FUSED_LINEAR_CROSS_ENTROPY_H */
