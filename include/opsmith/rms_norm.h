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
 * Aliasing: dx may be dy (in place); dweight apart from every other tensor.
 * These launchers are the options' below with one dtype, offset 0, NONE. */
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

/* --- RMSNorm with options (ABI 1.1) --------------------------------------
 * What Hugging Face models need beyond the plain op: a weight offset, the
 * casting of Llama's module, and mixed dtypes.
 *
 *     w'[i] = offset + weight[i]          (no weight: 1, and offset must be 0)
 *     x_hat = x * inv_rms                  (inv_rms as above)
 *     NONE, GEMMA: y = x_hat * w'          (float math, one rounding to y's dtype)
 *     LLAMA:       y = round_x(x_hat) * w' (x_hat rounded to x's dtype first, as
 *                                           LlamaRMSNorm does: weight * x_hat.to(x.dtype))
 * Backward (dy has y's dtype, dx x's, dweight the weight's):
 *     g = dy * w';  dx = inv_rms * (g - x * inv_rms^2 * mean_j(g * x))
 *     dweight[i] = sum_r dy * x_hat  (LLAMA: the rounded x_hat the forward used)
 * Dtypes (x_dtype, weight_dtype, y_dtype; the backward's dy_dtype is the
 * forward's y_dtype): all the same (f64, f32, f16, bf16); or x f16/bf16 with
 * an f32 weight and y either x's dtype or f32 (fp32 norm weights under mixed
 * precision). Any other combination is OPSMITH_STATUS_UNSUPPORTED_DTYPE.
 * Without a weight, weight_dtype is ignored and y_dtype is x's or f32.
 * inv_rms is f64 for f64 x, else f32. Aliasing: y may be x, and dx may be
 * dy, when their dtypes are the same; dweight apart from every other tensor. */
typedef enum opsmith_rms_norm_casting {
    OPSMITH_RMS_NORM_CASTING_NONE = 0,
    OPSMITH_RMS_NORM_CASTING_LLAMA = 1,
    OPSMITH_RMS_NORM_CASTING_GEMMA = 2, /* GemmaRMSNorm's: float throughout, the arithmetic of NONE */
    OPSMITH_RMS_NORM_CASTING_COUNT
} opsmith_rms_norm_casting;

/* "none", "llama", "gemma"; "?" outside the enum. */
OPSMITH_API const char *opsmith_rms_norm_casting_name(opsmith_rms_norm_casting casting);

OPSMITH_API opsmith_status opsmith_rms_norm_ex_fwd_cpu(
    opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype y_dtype, int64_t rows, int64_t n,
    const void *x, int64_t x_row_stride, const void *weight, double offset, double eps,
    opsmith_rms_norm_casting casting, void *y, int64_t y_row_stride, void *inv_rms);

OPSMITH_API size_t opsmith_rms_norm_ex_bwd_cpu_workspace_size(
    opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype dy_dtype, int64_t rows, int64_t n,
    const void *dy, int64_t dy_row_stride, const void *x, int64_t x_row_stride, const void *weight,
    double offset, opsmith_rms_norm_casting casting, const void *inv_rms, void *dx, int64_t dx_row_stride,
    void *dweight);

OPSMITH_API opsmith_status opsmith_rms_norm_ex_bwd_cpu(
    opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype dy_dtype, int64_t rows, int64_t n,
    const void *dy, int64_t dy_row_stride, const void *x, int64_t x_row_stride, const void *weight,
    double offset, opsmith_rms_norm_casting casting, const void *inv_rms, void *dx, int64_t dx_row_stride,
    void *dweight, void *workspace, size_t workspace_bytes);

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

OPSMITH_API opsmith_status opsmith_rms_norm_ex_fwd_cuda(
    opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype y_dtype, int64_t rows, int64_t n,
    const void *x, int64_t x_row_stride, const void *weight, double offset, double eps,
    opsmith_rms_norm_casting casting, void *y, int64_t y_row_stride, void *inv_rms, opsmith_cuda_stream stream);

OPSMITH_API size_t opsmith_rms_norm_ex_bwd_cuda_workspace_size(
    opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype dy_dtype, int64_t rows, int64_t n,
    const void *dy, int64_t dy_row_stride, const void *x, int64_t x_row_stride, const void *weight,
    double offset, opsmith_rms_norm_casting casting, const void *inv_rms, void *dx, int64_t dx_row_stride,
    void *dweight);

OPSMITH_API opsmith_status opsmith_rms_norm_ex_bwd_cuda(
    opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype dy_dtype, int64_t rows, int64_t n,
    const void *dy, int64_t dy_row_stride, const void *x, int64_t x_row_stride, const void *weight,
    double offset, opsmith_rms_norm_casting casting, const void *inv_rms, void *dx, int64_t dx_row_stride,
    void *dweight, void *workspace, size_t workspace_bytes, opsmith_cuda_stream stream);

/* Scalar references, the specification the kernels are tested against:
 * plain loops over float64 data, double accumulation, no threads; all
 * arrays contiguous; weight and dweight may be NULL. */
OPSMITH_API void opsmith_rms_norm_fwd_reference(int64_t rows, int64_t n, const double *x,
                                                const double *weight, double eps,
                                                double *y, double *inv_rms);
OPSMITH_API void opsmith_rms_norm_bwd_reference(int64_t rows, int64_t n, const double *dy,
                                                const double *x, const double *weight,
                                                const double *inv_rms, double *dx, double *dweight);
/* The options' references: x_dtype is the dtype LLAMA rounds x_hat to. */
OPSMITH_API void opsmith_rms_norm_ex_fwd_reference(int64_t rows, int64_t n, const double *x,
                                                   const double *weight, double offset, double eps,
                                                   opsmith_rms_norm_casting casting, opsmith_dtype x_dtype,
                                                   double *y, double *inv_rms);
OPSMITH_API void opsmith_rms_norm_ex_bwd_reference(int64_t rows, int64_t n, const double *dy,
                                                   const double *x, const double *weight, double offset,
                                                   opsmith_rms_norm_casting casting, opsmith_dtype x_dtype,
                                                   const double *inv_rms, double *dx, double *dweight);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_RMS_NORM_H */
