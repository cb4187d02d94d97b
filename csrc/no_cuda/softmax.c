/* softmax's CUDA launchers in a build without nvcc: they exist, and say so. */
#include "internal.h"

opsmith_status opsmith_softmax_fwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n, const void *x,
                                        int64_t x_row_stride, int log, void *y, int64_t y_row_stride,
                                        opsmith_cuda_stream stream) {
    (void)dtype, (void)rows, (void)n, (void)x, (void)x_row_stride, (void)log, (void)y, (void)y_row_stride;
    (void)stream;
    return opsmith_internal_fail(OPSMITH_STATUS_CUDA_UNAVAILABLE, "softmax_fwd_cuda: the library was built without CUDA");
}

opsmith_status opsmith_softmax_bwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n, const void *dy,
                                        int64_t dy_row_stride, const void *y, int64_t y_row_stride, int log, void *dx,
                                        int64_t dx_row_stride, opsmith_cuda_stream stream) {
    (void)dtype, (void)rows, (void)n, (void)dy, (void)dy_row_stride, (void)y, (void)y_row_stride, (void)log;
    (void)dx, (void)dx_row_stride, (void)stream;
    return opsmith_internal_fail(OPSMITH_STATUS_CUDA_UNAVAILABLE, "softmax_bwd_cuda: the library was built without CUDA");
}
