/* What AdamW's CPU and CUDA launchers share: argument validation and the
 * chunk count of a list. Not exported. */
#ifndef OPSMITH_INTERNAL_ADAMW_H
#define OPSMITH_INTERNAL_ADAMW_H

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Chunks of OPSMITH_ADAMW_CHUNK elements a tensor of n elements splits into. */
static inline int64_t opsmith_internal_adamw_chunks(int64_t n) {
    return (n + OPSMITH_ADAMW_CHUNK - 1) / OPSMITH_ADAMW_CHUNK;
}

/* Validates a step call; `op` names the launcher in the message. */
OPSMITH_INTERNAL opsmith_status opsmith_internal_adamw_step_check(
    const char *op, int64_t count, const int64_t *numels, opsmith_dtype param_dtype, opsmith_dtype grad_dtype,
    void *const *params, const void *const *grads, float *const *exp_avgs, float *const *exp_avg_sqs,
    float *const *max_exp_avg_sqs, float *const *master_params, const float *const *steps, double lr,
    const float *lr_tensor, double beta1, double beta2, double eps, double weight_decay, int amsgrad);

/* Validates an increment_steps call: count >= 0, every steps[t] non-NULL
 * and float-aligned. */
OPSMITH_INTERNAL opsmith_status opsmith_internal_adamw_increment_check(const char *op, int64_t count,
                                                                       float *const *steps);

/* Validates a grad-norm call (the workspace too); the chunk total goes to
 * *chunks. */
OPSMITH_INTERNAL opsmith_status opsmith_internal_adamw_norm_check(
    const char *op, int64_t count, const int64_t *numels, opsmith_dtype grad_dtype, const void *const *grads,
    double max_norm, const float *norm, const float *clip_coef, const void *workspace, size_t workspace_bytes,
    size_t partial_size, int64_t *chunks);

/* Chunks of the whole list (0 for a bad list: count < 0, NULL numels, a
 * negative numel). */
OPSMITH_INTERNAL int64_t opsmith_internal_adamw_total_chunks(int64_t count, const int64_t *numels);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_INTERNAL_ADAMW_H */
