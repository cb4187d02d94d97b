/* Residual add fused with RMSNorm. Included by opsmith.h; conventions there,
 * the RMSNorm options (offset, casting, dtypes) in opsmith/rms_norm.h.
 *
 * Forward, one pass over the rows:
 *     h[r, i] = round_x(x[r, i] + residual[r, i])     (rounded to x's dtype)
 *     y, inv_rms = rms_norm_ex(h, weight, offset, eps, casting)
 * exactly what `h = x + residual` followed by opsmith_rms_norm_ex_fwd_* on h
 * computes. x, residual and h are (rows, n) in x_dtype with their own row
 * strides; y is (rows, n) in y_dtype; weight is (n) or NULL; inv_rms is
 * (rows), f64 for f64 x, else f32. The dtype combinations are RMSNorm's.
 * Aliasing: h may be residual or x (the in-place form writes h over
 * residual); y may be x; nothing else may overlap.
 *
 * Backward (dy in dy_dtype = the forward's y_dtype; dh, h, dx in x_dtype):
 *     dx = round_x(rms_norm_ex_bwd(dy; h)) + dh        (dh NULL: no add)
 *     dweight = rms_norm_ex_bwd's weight gradient on h
 * the gradient both x and residual receive, rounded as autograd sums the two
 * gradients of h. dh may be NULL; dy must be given (a caller without dy has
 * dx = dh and a zero dweight). Aliasing: dx may be dy (same dtype); dx must
 * be apart from dh and h; dweight apart from every other tensor. The dweight sum is deterministic, as RMSNorm's. */
#ifndef OPSMITH_FUSED_ADD_RMS_NORM_H
#define OPSMITH_FUSED_ADD_RMS_NORM_H

#ifdef __cplusplus
extern "C" {
#endif

OPSMITH_API opsmith_status opsmith_fused_add_rms_norm_fwd_cpu(
    opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype y_dtype, int64_t rows, int64_t n,
    const void *x, int64_t x_row_stride, const void *residual, int64_t residual_row_stride, const void *weight,
    double offset, double eps, opsmith_rms_norm_casting casting, void *y, int64_t y_row_stride, void *h,
    int64_t h_row_stride, void *inv_rms);

OPSMITH_API size_t opsmith_fused_add_rms_norm_bwd_cpu_workspace_size(
    opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype dy_dtype, int64_t rows, int64_t n,
    const void *weight, void *dweight);

OPSMITH_API opsmith_status opsmith_fused_add_rms_norm_bwd_cpu(
    opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype dy_dtype, int64_t rows, int64_t n,
    const void *dy, int64_t dy_row_stride, const void *dh, int64_t dh_row_stride, const void *h,
    int64_t h_row_stride, const void *weight, double offset, opsmith_rms_norm_casting casting,
    const void *inv_rms, void *dx, int64_t dx_row_stride, void *dweight, void *workspace, size_t workspace_bytes);

/* The CUDA launchers: the same arguments as device pointers, plus the stream. */
OPSMITH_API opsmith_status opsmith_fused_add_rms_norm_fwd_cuda(
    opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype y_dtype, int64_t rows, int64_t n,
    const void *x, int64_t x_row_stride, const void *residual, int64_t residual_row_stride, const void *weight,
    double offset, double eps, opsmith_rms_norm_casting casting, void *y, int64_t y_row_stride, void *h,
    int64_t h_row_stride, void *inv_rms, opsmith_cuda_stream stream);

OPSMITH_API size_t opsmith_fused_add_rms_norm_bwd_cuda_workspace_size(
    opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype dy_dtype, int64_t rows, int64_t n,
    const void *weight, void *dweight);

OPSMITH_API opsmith_status opsmith_fused_add_rms_norm_bwd_cuda(
    opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype dy_dtype, int64_t rows, int64_t n,
    const void *dy, int64_t dy_row_stride, const void *dh, int64_t dh_row_stride, const void *h,
    int64_t h_row_stride, const void *weight, double offset, opsmith_rms_norm_casting casting,
    const void *inv_rms, void *dx, int64_t dx_row_stride, void *dweight, void *workspace, size_t workspace_bytes,
    opsmith_cuda_stream stream);

/* Scalar references: float64 arrays, contiguous. h is x + residual rounded
 * to x_dtype (as the kernels store it); dy and dh may be NULL (zero). */
OPSMITH_API void opsmith_fused_add_rms_norm_fwd_reference(
    int64_t rows, int64_t n, const double *x, const double *residual, const double *weight, double offset,
    double eps, opsmith_rms_norm_casting casting, opsmith_dtype x_dtype, double *y, double *h, double *inv_rms);
OPSMITH_API void opsmith_fused_add_rms_norm_bwd_reference(
    int64_t rows, int64_t n, const double *dy, const double *dh, const double *h, const double *weight,
    double offset, opsmith_rms_norm_casting casting, opsmith_dtype x_dtype, const double *inv_rms, double *dx,
    double *dweight);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_FUSED_ADD_RMS_NORM_H */
