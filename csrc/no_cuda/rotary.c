/* The rotary CUDA launchers in a build without nvcc: they exist, and say so. */
#include "internal.h"

opsmith_status opsmith_rotary_fwd_cuda(const opsmith_rotary_params *p, const void *q, void *q_out, const void *k,
                                       void *k_out, const void *cos, const void *sin, const int64_t *position_ids,
                                       opsmith_cuda_stream stream) {
    (void)p, (void)q, (void)q_out, (void)k, (void)k_out, (void)cos, (void)sin, (void)position_ids, (void)stream;
    return opsmith_internal_fail(OPSMITH_STATUS_CUDA_UNAVAILABLE, "rotary_fwd_cuda: the library was built without CUDA");
}

opsmith_status opsmith_rotary_bwd_cuda(const opsmith_rotary_params *p, const void *dq_out, void *dq,
                                       const void *dk_out, void *dk, const void *cos, const void *sin,
                                       const int64_t *position_ids, opsmith_cuda_stream stream) {
    (void)p, (void)dq_out, (void)dq, (void)dk_out, (void)dk, (void)cos, (void)sin, (void)position_ids, (void)stream;
    return opsmith_internal_fail(OPSMITH_STATUS_CUDA_UNAVAILABLE, "rotary_bwd_cuda: the library was built without CUDA");
}
