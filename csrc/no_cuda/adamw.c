/* AdamW's CUDA launchers in a build without nvcc: they exist, and say so. */
#include "internal/adamw.h"

opsmith_status opsmith_adamw_step_cuda(int64_t count, const int64_t *numels, opsmith_dtype param_dtype,
                                       opsmith_dtype grad_dtype, void *const *params, const void *const *grads,
                                       float *const *exp_avgs, float *const *exp_avg_sqs,
                                       float *const *max_exp_avg_sqs, float *const *master_params,
                                       const float *const *steps, double lr, const float *lr_tensor, double beta1,
                                       double beta2, double eps, double weight_decay, int amsgrad, int maximize,
                                       const float *clip_coef, opsmith_cuda_stream stream) {
    (void)count, (void)numels, (void)param_dtype, (void)grad_dtype, (void)params, (void)grads, (void)exp_avgs;
    (void)exp_avg_sqs, (void)max_exp_avg_sqs, (void)master_params, (void)steps, (void)lr, (void)lr_tensor;
    (void)beta1, (void)beta2, (void)eps, (void)weight_decay, (void)amsgrad, (void)maximize, (void)clip_coef;
    (void)stream;
    return opsmith_internal_fail(OPSMITH_STATUS_CUDA_UNAVAILABLE, "adamw_step_cuda: the library was built without CUDA");
}

opsmith_status opsmith_adamw_increment_steps_cuda(int64_t count, float *const *steps, opsmith_cuda_stream stream) {
    (void)count, (void)steps, (void)stream;
    return opsmith_internal_fail(OPSMITH_STATUS_CUDA_UNAVAILABLE,
                                 "adamw_increment_steps_cuda: the library was built without CUDA");
}

size_t opsmith_adamw_grad_norm_cuda_workspace_size(int64_t count, const int64_t *numels) {
    return (size_t)opsmith_internal_adamw_total_chunks(count, numels) * sizeof(float);
}

opsmith_status opsmith_adamw_grad_norm_cuda(int64_t count, const int64_t *numels, opsmith_dtype grad_dtype,
                                            const void *const *grads, double max_norm, float *norm, float *clip_coef,
                                            void *workspace, size_t workspace_bytes, opsmith_cuda_stream stream) {
    (void)count, (void)numels, (void)grad_dtype, (void)grads, (void)max_norm, (void)norm, (void)clip_coef;
    (void)workspace, (void)workspace_bytes, (void)stream;
    return opsmith_internal_fail(OPSMITH_STATUS_CUDA_UNAVAILABLE,
                                 "adamw_grad_norm_cuda: the library was built without CUDA");
}
