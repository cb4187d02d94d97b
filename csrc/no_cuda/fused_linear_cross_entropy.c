/* fused_linear_cross_entropy's CUDA launcher in a build without nvcc: it exists, and says so. */
#include "internal.h"

opsmith_status opsmith_fused_linear_cross_entropy_fwd_cuda(
    opsmith_dtype dtype, int64_t rows, int64_t dim, int64_t vocab, const void *hidden, int64_t hidden_row_stride,
    const void *weight, const void *bias, const int64_t *target, int64_t target_stride, int64_t ignore_index,
    double label_smoothing, double z_loss, double softcap, opsmith_cross_entropy_reduction reduction,
    int64_t chunk_rows, int fp32_dweight, void *loss, void *z_out, void *dhidden, void *dweight, void *dbias,
    int64_t *error, void *workspace, size_t workspace_bytes, opsmith_cuda_stream stream) {
    (void)dtype, (void)rows, (void)dim, (void)vocab, (void)hidden, (void)hidden_row_stride, (void)weight, (void)bias;
    (void)target, (void)target_stride, (void)ignore_index, (void)label_smoothing, (void)z_loss, (void)softcap;
    (void)reduction, (void)chunk_rows, (void)fp32_dweight, (void)loss, (void)z_out, (void)dhidden, (void)dweight;
    (void)dbias, (void)error, (void)workspace, (void)workspace_bytes, (void)stream;
    return opsmith_internal_fail(OPSMITH_STATUS_CUDA_UNAVAILABLE,
                                 "fused_linear_cross_entropy_fwd_cuda: the library was built without CUDA");
}
