/* LayerNorm over the last dimension. Included by opsmith.h; conventions there.
 *
 * Forward:
 *     mean[r]  = mean_i(x[r, i])
 *     rstd[r]  = 1 / sqrt(mean_i((x[r, i] - mean[r])^2) + eps)
 *     y[r, i]  = (x[r, i] - mean[r]) * rstd[r] * weight[i] + bias[i]
 * (weight = 1 when NULL, bias = 0 when NULL), as
 * torch.nn.functional.layer_norm(x, (n,), weight, bias, eps).
 * Shapes: x and y are (rows, n) with their own row strides, in x_dtype
 * (f64, f32, f16, bf16); weight and bias are (n) contiguous in weight_dtype,
 * which is x_dtype or f32 (norm parameters kept in float32 beside 16-bit
 * activations); mean and rstd are (rows) contiguous in
 * opsmith_dtype_accumulate(x_dtype), saved for the backward pass. Sums run
 * in the accumulate type; the variance is the mean of squared deviations
 * from the mean (two passes over the row), not E[x^2] - E[x]^2. rows may be
 * 0 (nothing is done); n must be >= 1; eps >= 0.
 * Aliasing: y may be x (in place).
 *
 * Backward:
 *     xhat[r, i] = (x[r, i] - mean[r]) * rstd[r]
 *     g[r, i]    = dy[r, i] * weight[i]
 *     dx[r, i]   = rstd[r] * (g[r, i] - mean_j(g[r, j]) - xhat[r, i] * mean_j(g[r, j] * xhat[r, j]))
 *     dweight[i] = sum_r dy[r, i] * xhat[r, i]
 *     dbias[i]   = sum_r dy[r, i]
 * Shapes: dy, x and dx are (rows, n) in x_dtype with their own row strides;
 * mean and rstd are the forward's; dweight (written only when both weight
 * and dweight are non-NULL) and dbias (written when non-NULL) are (n) in
 * weight_dtype, zeros when rows == 0. Both sums are deterministic: the same
 * inputs give the same bits whatever the thread (or block) count.
 * Aliasing: dx may be dy (in place); dweight and dbias apart from every
 * other tensor and from each other.
 *
 * Supported (x_dtype, weight_dtype): (D, D) for D in f64, f32, f16, bf16;
 * (f16, f32), (bf16, f32), (f64, f32). */
#ifndef OPSMITH_LAYER_NORM_H
#define OPSMITH_LAYER_NORM_H

#ifdef __cplusplus
extern "C" {
#endif

OPSMITH_API opsmith_status opsmith_layer_norm_fwd_cpu(opsmith_dtype x_dtype, opsmith_dtype weight_dtype,
                                                      int64_t rows, int64_t n, const void *x, int64_t x_row_stride,
                                                      const void *weight, const void *bias, double eps, void *y,
                                                      int64_t y_row_stride, void *mean, void *rstd);

OPSMITH_API size_t opsmith_layer_norm_bwd_cpu_workspace_size(
    opsmith_dtype x_dtype, opsmith_dtype weight_dtype, int64_t rows, int64_t n, const void *dy,
    int64_t dy_row_stride, const void *x, int64_t x_row_stride, const void *weight, const void *mean,
    const void *rstd, void *dx, int64_t dx_row_stride, void *dweight, void *dbias);

OPSMITH_API opsmith_status opsmith_layer_norm_bwd_cpu(opsmith_dtype x_dtype, opsmith_dtype weight_dtype,
                                                      int64_t rows, int64_t n, const void *dy, int64_t dy_row_stride,
                                                      const void *x, int64_t x_row_stride, const void *weight,
                                                      const void *mean, const void *rstd, void *dx,
                                                      int64_t dx_row_stride, void *dweight, void *dbias,
                                                      void *workspace, size_t workspace_bytes);

/* The CUDA launchers take the same arguments as device pointers, plus the
 * stream they run on. */
OPSMITH_API opsmith_status opsmith_layer_norm_fwd_cuda(opsmith_dtype x_dtype, opsmith_dtype weight_dtype,
                                                       int64_t rows, int64_t n, const void *x, int64_t x_row_stride,
                                                       const void *weight, const void *bias, double eps, void *y,
                                                       int64_t y_row_stride, void *mean, void *rstd,
                                                       opsmith_cuda_stream stream);

OPSMITH_API size_t opsmith_layer_norm_bwd_cuda_workspace_size(
    opsmith_dtype x_dtype, opsmith_dtype weight_dtype, int64_t rows, int64_t n, const void *dy,
    int64_t dy_row_stride, const void *x, int64_t x_row_stride, const void *weight, const void *mean,
    const void *rstd, void *dx, int64_t dx_row_stride, void *dweight, void *dbias);

OPSMITH_API opsmith_status opsmith_layer_norm_bwd_cuda(opsmith_dtype x_dtype, opsmith_dtype weight_dtype,
                                                       int64_t rows, int64_t n, const void *dy,
                                                       int64_t dy_row_stride, const void *x, int64_t x_row_stride,
                                                       const void *weight, const void *mean, const void *rstd,
                                                       void *dx, int64_t dx_row_stride, void *dweight, void *dbias,
                                                       void *workspace, size_t workspace_bytes,
                                                       opsmith_cuda_stream stream);

/* Scalar references, the specification the kernels are tested against:
 * plain loops over float64 data, double accumulation, no threads; all
 * arrays contiguous; weight, bias, dweight and dbias may be NULL. */
OPSMITH_API void opsmith_layer_norm_fwd_reference(int64_t rows, int64_t n, const double *x, const double *weight,
                                                  const double *bias, double eps, double *y, double *mean,
                                                  double *rstd);
OPSMITH_API void opsmith_layer_norm_bwd_reference(int64_t rows, int64_t n, const double *dy, const double *x,
                                                  const double *weight, const double *mean, const double *rstd,
                                                  double *dx, double *dweight, double *dbias);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_LAYER_NORM_H */
