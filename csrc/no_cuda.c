/* Linked instead of the CUDA objects when the library is built without
 * nvcc: every CUDA launcher exists and says so. */
#include "opsmith.h"

int opsmith_has_cuda(void) { return 0; }

opsmith_status opsmith_rms_norm_fwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n,
                                         const void *x, int64_t x_row_stride, const void *weight,
                                         double eps, void *y, void *inv_rms,
                                         opsmith_cuda_stream stream) {
    (void)dtype, (void)rows, (void)n, (void)x, (void)x_row_stride, (void)weight, (void)eps;
    (void)y, (void)inv_rms, (void)stream;
    return OPSMITH_STATUS_CUDA_UNAVAILABLE;
}

size_t opsmith_rms_norm_bwd_cuda_workspace_size(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                int with_dweight) {
    (void)dtype, (void)rows, (void)n, (void)with_dweight;
    return 0;
}

opsmith_status opsmith_rms_norm_bwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n,
                                         const void *dy, int64_t dy_row_stride, const void *x,
                                         int64_t x_row_stride, const void *weight,
                                         const void *inv_rms, void *dx, void *dweight,
                                         void *workspace, size_t workspace_bytes,
                                         opsmith_cuda_stream stream) {
    (void)dtype, (void)rows, (void)n, (void)dy, (void)dy_row_stride, (void)x, (void)x_row_stride;
    (void)weight, (void)inv_rms, (void)dx, (void)dweight, (void)workspace, (void)workspace_bytes;
    (void)stream;
    return OPSMITH_STATUS_CUDA_UNAVAILABLE;
}
