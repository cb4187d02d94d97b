/* RMSNorm over the last dimension. Included by opsmith.h; conventions there.
 *
 * Forward:
 *     y[r, i]    = x[r, i] * inv_rms[r] * weight[i]
 *     inv_rms[r] = 1 / sqrt(mean_i(x[r, i]^2) + eps)
 * Shapes: x and y are (rows, n) with their own row strides; weight is (n)
 * contiguous, or NULL for no weight; inv_rms is (rows) contiguous in
 * opsmith_dtype_accumulate(dtype), saved for the backward pass. All float
 * tensors have `dtype` (f64, f32, f16, bf16). Sums run in the accumulate
 * type. rows may be 0 (nothing is done); n must be >= 1; eps >= 0.
 * Aliasing: y may be x (in place).
 *
 * Backward:
 *     g[r, i]    = dy[r, i] * weight[i]            (weight = 1 when NULL)
 *     dx[r, i]   = inv_rms[r] * (g[r, i] - x[r, i] * inv_rms[r]^2 * mean_j(g[r, j] * x[r, j]))
 *     dweight[i] = sum_r dy[r, i] * x[r, i] * inv_rms[r]
 * Shapes: dy, x and dx are (rows, n) with their own row strides; inv_rms is
 * the forward's; dweight is (n), written only when both weight and dweight
 * are non-NULL (zeros when rows == 0). The dweight sum is deterministic:
 * the same inputs give the same bits whatever the thread count.
 * Aliasing: dx may be dy (in place). */
#ifndef OPSMITH_RMS_NORM_H
#define OPSMITH_RMS_NORM_H

#ifdef __cplusplus
extern "C" {
#endif

OPSMITH_API opsmith_status opsmith_rms_norm_fwd_cpu(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                    const void *x, int64_t x_row_stride,
                                                    const void *weight, double eps,
                                                    void *y, int64_t y_row_stride, void *inv_rms);

OPSMITH_API size_t opsmith_rms_norm_bwd_cpu_workspace_size(
    opsmith_dtype dtype, int64_t rows, int64_t n, const void *dy, int64_t dy_row_stride,
    const void *x, int64_t x_row_stride, const void *weight, const void *inv_rms,
    void *dx, int64_t dx_row_stride, void *dweight);

OPSMITH_API opsmith_status opsmith_rms_norm_bwd_cpu(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                    const void *dy, int64_t dy_row_stride,
                                                    const void *x, int64_t x_row_stride,
                                                    const void *weight, const void *inv_rms,
                                                    void *dx, int64_t dx_row_stride, void *dweight,
                                                    void *workspace, size_t workspace_bytes);

/* The CUDA launchers take the same arguments as device pointers, plus the
 * stream they run on. */
OPSMITH_API opsmith_status opsmith_rms_norm_fwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                     const void *x, int64_t x_row_stride,
                                                     const void *weight, double eps,
                                                     void *y, int64_t y_row_stride, void *inv_rms,
                                                     opsmith_cuda_stream stream);

OPSMITH_API size_t opsmith_rms_norm_bwd_cuda_workspace_size(
    opsmith_dtype dtype, int64_t rows, int64_t n, const void *dy, int64_t dy_row_stride,
    const void *x, int64_t x_row_stride, const void *weight, const void *inv_rms,
    void *dx, int64_t dx_row_stride, void *dweight);

OPSMITH_API opsmith_status opsmith_rms_norm_bwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                     const void *dy, int64_t dy_row_stride,
                                                     const void *x, int64_t x_row_stride,
                                                     const void *weight, const void *inv_rms,
                                                     void *dx, int64_t dx_row_stride, void *dweight,
                                                     void *workspace, size_t workspace_bytes,
                                                     opsmith_cuda_stream stream);

/* Scalar references, the specification the kernels are tested against:
 * plain loops over float64 data, double accumulation, no threads; all
 * arrays contiguous; weight and dweight may be NULL. */
OPSMITH_API void opsmith_rms_norm_fwd_reference(int64_t rows, int64_t n, const double *x,
                                                const double *weight, double eps,
                                                double *y, double *inv_rms);
OPSMITH_API void opsmith_rms_norm_bwd_reference(int64_t rows, int64_t n, const double *dy,
                                                const double *x, const double *weight,
                                                const double *inv_rms, double *dx, double *dweight);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_RMS_NORM_H */
