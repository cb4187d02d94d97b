/* LayerNorm's CUDA launchers in a build without nvcc: they exist, and say so. */
#include "internal.h"

opsmith_status opsmith_layer_norm_fwd_cuda(opsmith_dtype x_dtype, opsmith_dtype weight_dtype, int64_t rows, int64_t n,
                                           const void *x, int64_t x_row_stride, const void *weight, const void *bias,
                                           double eps, void *y, int64_t y_row_stride, void *mean, void *rstd,
                                           opsmith_cuda_stream stream) {
    (void)x_dtype, (void)weight_dtype, (void)rows, (void)n, (void)x, (void)x_row_stride, (void)weight, (void)bias;
    (void)eps, (void)y, (void)y_row_stride, (void)mean, (void)rstd, (void)stream;
    return opsmith_internal_fail(OPSMITH_STATUS_CUDA_UNAVAILABLE, "layer_norm_fwd_cuda: the library was built without CUDA");
}

size_t opsmith_layer_norm_bwd_cuda_workspace_size(opsmith_dtype x_dtype, opsmith_dtype weight_dtype, int64_t rows,
                                                  int64_t n, const void *dy, int64_t dy_row_stride, const void *x,
                                                  int64_t x_row_stride, const void *weight, const void *mean,
                                                  const void *rstd, void *dx, int64_t dx_row_stride, void *dweight,
                                                  void *dbias) {
    (void)x_dtype, (void)weight_dtype, (void)rows, (void)n, (void)dy, (void)dy_row_stride, (void)x;
    (void)x_row_stride, (void)weight, (void)mean, (void)rstd, (void)dx, (void)dx_row_stride, (void)dweight, (void)dbias;
    return 0;
}

opsmith_status opsmith_layer_norm_bwd_cuda(opsmith_dtype x_dtype, opsmith_dtype weight_dtype, int64_t rows, int64_t n,
                                           const void *dy, int64_t dy_row_stride, const void *x, int64_t x_row_stride,
                                           const void *weight, const void *mean, const void *rstd, void *dx,
                                           int64_t dx_row_stride, void *dweight, void *dbias, void *workspace,
                                           size_t workspace_bytes, opsmith_cuda_stream stream) {
    (void)x_dtype, (void)weight_dtype, (void)rows, (void)n, (void)dy, (void)dy_row_stride, (void)x;
    (void)x_row_stride, (void)weight, (void)mean, (void)rstd, (void)dx, (void)dx_row_stride, (void)dweight;
    (void)dbias, (void)workspace, (void)workspace_bytes, (void)stream;
    return opsmith_internal_fail(OPSMITH_STATUS_CUDA_UNAVAILABLE, "layer_norm_bwd_cuda: the library was built without CUDA");
}
