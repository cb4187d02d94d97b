/* The gated activations' CUDA launchers in a build without nvcc: they exist, and say so. */
#include "internal.h"

opsmith_status opsmith_glu_fwd_cuda(opsmith_glu_activation activation, opsmith_dtype dtype, int64_t rows, int64_t n,
                                    const void *gate, int64_t gate_row_stride, const void *up, int64_t up_row_stride,
                                    void *y, int64_t y_row_stride, opsmith_cuda_stream stream) {
    (void)activation, (void)dtype, (void)rows, (void)n, (void)gate, (void)gate_row_stride, (void)up;
    (void)up_row_stride, (void)y, (void)y_row_stride, (void)stream;
    return opsmith_internal_fail(OPSMITH_STATUS_CUDA_UNAVAILABLE, "glu_fwd_cuda: the library was built without CUDA");
}

opsmith_status opsmith_glu_bwd_cuda(opsmith_glu_activation activation, opsmith_dtype dtype, int64_t rows, int64_t n,
                                    const void *dy, int64_t dy_row_stride, const void *gate, int64_t gate_row_stride,
                                    const void *up, int64_t up_row_stride, void *dgate, int64_t dgate_row_stride,
                                    void *dup, int64_t dup_row_stride, void *h, int64_t h_row_stride,
                                    opsmith_cuda_stream stream) {
    (void)activation, (void)dtype, (void)rows, (void)n, (void)dy, (void)dy_row_stride, (void)gate;
    (void)gate_row_stride, (void)up, (void)up_row_stride, (void)dgate, (void)dgate_row_stride, (void)dup;
    (void)dup_row_stride, (void)h, (void)h_row_stride, (void)stream;
    return opsmith_internal_fail(OPSMITH_STATUS_CUDA_UNAVAILABLE, "glu_bwd_cuda: the library was built without CUDA");
}
