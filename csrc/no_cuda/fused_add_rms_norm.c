/* The residual-add RMSNorm's CUDA launchers in a build without nvcc: they exist, and say so. */
#include "internal.h"

opsmith_status opsmith_fused_add_rms_norm_fwd_cuda(opsmith_dtype x_dtype, opsmith_dtype weight_dtype,
                                                   opsmith_dtype y_dtype, int64_t rows, int64_t n, const void *x,
                                                   int64_t x_row_stride, const void *residual,
                                                   int64_t residual_row_stride, const void *weight, double offset,
                                                   double eps, opsmith_rms_norm_casting casting, void *y,
                                                   int64_t y_row_stride, void *h, int64_t h_row_stride,
                                                   void *inv_rms, opsmith_cuda_stream stream) {
    (void)x_dtype, (void)weight_dtype, (void)y_dtype, (void)rows, (void)n, (void)x, (void)x_row_stride;
    (void)residual, (void)residual_row_stride, (void)weight, (void)offset, (void)eps, (void)casting, (void)y;
    (void)y_row_stride, (void)h, (void)h_row_stride, (void)inv_rms, (void)stream;
    return opsmith_internal_fail(OPSMITH_STATUS_CUDA_UNAVAILABLE,
                                 "fused_add_rms_norm_fwd_cuda: the library was built without CUDA");
}

size_t opsmith_fused_add_rms_norm_bwd_cuda_workspace_size(opsmith_dtype x_dtype, opsmith_dtype weight_dtype,
                                                          opsmith_dtype dy_dtype, int64_t rows, int64_t n,
                                                          const void *weight, void *dweight) {
    (void)x_dtype, (void)weight_dtype, (void)dy_dtype, (void)rows, (void)n, (void)weight, (void)dweight;
    return 0;
}

opsmith_status opsmith_fused_add_rms_norm_bwd_cuda(opsmith_dtype x_dtype, opsmith_dtype weight_dtype,
                                                   opsmith_dtype dy_dtype, int64_t rows, int64_t n, const void *dy,
                                                   int64_t dy_row_stride, const void *dh, int64_t dh_row_stride,
                                                   const void *h, int64_t h_row_stride, const void *weight,
                                                   double offset, opsmith_rms_norm_casting casting,
                                                   const void *inv_rms, void *dx, int64_t dx_row_stride,
                                                   void *dweight, void *workspace, size_t workspace_bytes,
                                                   opsmith_cuda_stream stream) {
    (void)x_dtype, (void)weight_dtype, (void)dy_dtype, (void)rows, (void)n, (void)dy, (void)dy_row_stride, (void)dh;
    (void)dh_row_stride, (void)h, (void)h_row_stride, (void)weight, (void)offset, (void)casting, (void)inv_rms;
    (void)dx, (void)dx_row_stride, (void)dweight, (void)workspace, (void)workspace_bytes, (void)stream;
    return opsmith_internal_fail(OPSMITH_STATUS_CUDA_UNAVAILABLE,
                                 "fused_add_rms_norm_bwd_cuda: the library was built without CUDA");
}
