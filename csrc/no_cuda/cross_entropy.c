/* cross_entropy's CUDA launchers in a build without nvcc: they exist, and say so. */
#include "internal.h"

opsmith_status opsmith_cross_entropy_fwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n, const void *logits,
                                              int64_t logits_row_stride, const int64_t *target, int64_t target_stride,
                                              const void *weight, int64_t ignore_index, double label_smoothing,
                                              double z_loss, double softcap, opsmith_cross_entropy_reduction reduction,
                                              opsmith_dtype loss_dtype, void *loss, void *z_out, void *lse,
                                              void *dlogits,
                                              int64_t dlogits_row_stride, int64_t *error, void *workspace,
                                              size_t workspace_bytes, opsmith_cuda_stream stream) {
    (void)dtype, (void)rows, (void)n, (void)logits, (void)logits_row_stride, (void)target, (void)target_stride;
    (void)weight, (void)ignore_index, (void)label_smoothing, (void)z_loss, (void)softcap, (void)reduction;
    (void)loss_dtype;
    (void)loss, (void)z_out, (void)lse, (void)dlogits, (void)dlogits_row_stride, (void)error, (void)workspace;
    (void)workspace_bytes, (void)stream;
    return opsmith_internal_fail(OPSMITH_STATUS_CUDA_UNAVAILABLE, "cross_entropy_fwd_cuda: the library was built without CUDA");
}

opsmith_status opsmith_cross_entropy_bwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n,
                                              opsmith_dtype grad_dtype, const void *grad, int64_t grad_stride, const void *dlogits, int64_t dlogits_row_stride,
                                              void *dx, int64_t dx_row_stride, opsmith_cuda_stream stream) {
    (void)dtype, (void)rows, (void)n, (void)grad_dtype, (void)grad, (void)grad_stride, (void)dlogits, (void)dlogits_row_stride;
    (void)dx, (void)dx_row_stride, (void)stream;
    return opsmith_internal_fail(OPSMITH_STATUS_CUDA_UNAVAILABLE, "cross_entropy_bwd_cuda: the library was built without CUDA");
}
