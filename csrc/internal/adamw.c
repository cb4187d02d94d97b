/* AdamW argument validation, shared by the CPU and CUDA launchers. */
#include <math.h>

#include "internal/adamw.h"

static int is_storage(opsmith_dtype dt) {
    return dt == OPSMITH_DTYPE_F32 || dt == OPSMITH_DTYPE_BF16 || dt == OPSMITH_DTYPE_F16;
}

int64_t opsmith_internal_adamw_total_chunks(int64_t count, const int64_t *numels) {
    if (count <= 0 || !numels) return 0;
    int64_t total = 0;
    for (int64_t t = 0; t < count; t++) {
        if (numels[t] < 0) return 0;
        total += opsmith_internal_adamw_chunks(numels[t]);
    }
    return total;
}

/* Checks the list header and one role's pointers: non-NULL and aligned for
 * every non-empty tensor. */
static opsmith_status check_role(const char *op, const char *name, int64_t count, const int64_t *numels,
                                 const void *const *list, size_t size) {
    if (!list) return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT, "%s: %s is NULL", op, name);
    for (int64_t t = 0; t < count; t++) {
        if (numels[t] == 0) continue;
        if (!list[t])
            return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT, "%s: %s[%lld] is NULL", op, name,
                                         (long long)t);
        if (opsmith_internal_misaligned(list[t], size))
            return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: %s[%lld] (%p) is not aligned to %zu bytes",
                                         op, name, (long long)t, list[t], size);
    }
    return OPSMITH_STATUS_SUCCESS;
}

static opsmith_status check_list(const char *op, int64_t count, const int64_t *numels) {
    if (count < 0)
        return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT, "%s: count (%lld) must be >= 0", op,
                                     (long long)count);
    if (count > 0 && !numels) return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT, "%s: numels is NULL", op);
    for (int64_t t = 0; t < count; t++)
        if (numels[t] < 0)
            return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT, "%s: numels[%lld] (%lld) must be >= 0", op,
                                         (long long)t, (long long)numels[t]);
    return OPSMITH_STATUS_SUCCESS;
}

#define TRY(expr)                                                                                                  \
    do {                                                                                                           \
        opsmith_status s_ = (expr);                                                                                \
        if (s_ != OPSMITH_STATUS_SUCCESS) return s_;                                                               \
    } while (0)

opsmith_status opsmith_internal_adamw_step_check(const char *op, int64_t count, const int64_t *numels,
                                                 opsmith_dtype param_dtype, opsmith_dtype grad_dtype,
                                                 void *const *params, const void *const *grads,
                                                 float *const *exp_avgs, float *const *exp_avg_sqs,
                                                 float *const *max_exp_avg_sqs, float *const *master_params,
                                                 const float *const *steps, double lr, const float *lr_tensor,
                                                 double beta1, double beta2, double eps, double weight_decay,
                                                 int amsgrad) {
    const opsmith_status bad = OPSMITH_STATUS_INVALID_ARGUMENT;
    opsmith_internal_clear_error();
    if ((unsigned)param_dtype >= OPSMITH_DTYPE_COUNT || !is_storage(param_dtype))
        return opsmith_internal_fail(OPSMITH_STATUS_UNSUPPORTED_DTYPE,
                                     "%s: param_dtype must be f32, bf16 or f16, got %s (%d)", op,
                                     opsmith_dtype_name(param_dtype), (int)param_dtype);
    if ((unsigned)grad_dtype >= OPSMITH_DTYPE_COUNT || !is_storage(grad_dtype))
        return opsmith_internal_fail(OPSMITH_STATUS_UNSUPPORTED_DTYPE,
                                     "%s: grad_dtype must be f32, bf16 or f16, got %s (%d)", op,
                                     opsmith_dtype_name(grad_dtype), (int)grad_dtype);
    if (master_params && param_dtype == OPSMITH_DTYPE_F32)
        return opsmith_internal_fail(bad, "%s: master_params must be NULL for f32 params (they are the masters)", op);
    if (!lr_tensor && !(lr >= 0.0)) return opsmith_internal_fail(bad, "%s: lr (%g) must be >= 0", op, lr);
    if (!(beta1 >= 0.0 && beta1 < 1.0)) return opsmith_internal_fail(bad, "%s: beta1 (%g) must be in [0, 1)", op, beta1);
    if (!(beta2 >= 0.0 && beta2 < 1.0)) return opsmith_internal_fail(bad, "%s: beta2 (%g) must be in [0, 1)", op, beta2);
    if (!(eps >= 0.0)) return opsmith_internal_fail(bad, "%s: eps (%g) must be >= 0", op, eps);
    if (!(weight_decay >= 0.0))
        return opsmith_internal_fail(bad, "%s: weight_decay (%g) must be >= 0", op, weight_decay);
    if (!amsgrad && max_exp_avg_sqs)
        return opsmith_internal_fail(bad, "%s: max_exp_avg_sqs must be NULL without amsgrad", op);
    TRY(check_list(op, count, numels));
    if (count == 0) return OPSMITH_STATUS_SUCCESS;
    TRY(check_role(op, "params", count, numels, (const void *const *)params, opsmith_dtype_size(param_dtype)));
    TRY(check_role(op, "grads", count, numels, grads, opsmith_dtype_size(grad_dtype)));
    TRY(check_role(op, "exp_avgs", count, numels, (const void *const *)exp_avgs, 4));
    TRY(check_role(op, "exp_avg_sqs", count, numels, (const void *const *)exp_avg_sqs, 4));
    TRY(check_role(op, "steps", count, numels, (const void *const *)steps, 4));
    if (amsgrad) TRY(check_role(op, "max_exp_avg_sqs", count, numels, (const void *const *)max_exp_avg_sqs, 4));
    if (master_params) TRY(check_role(op, "master_params", count, numels, (const void *const *)master_params, 4));
    return OPSMITH_STATUS_SUCCESS;
}

opsmith_status opsmith_internal_adamw_increment_check(const char *op, int64_t count, float *const *steps) {
    opsmith_internal_clear_error();
    if (count < 0)
        return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT, "%s: count (%lld) must be >= 0", op,
                                     (long long)count);
    if (count > 0 && !steps) return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT, "%s: steps is NULL", op);
    for (int64_t t = 0; t < count; t++) {
        if (!steps[t])
            return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT, "%s: steps[%lld] is NULL", op, (long long)t);
        if (opsmith_internal_misaligned(steps[t], sizeof(float)))
            return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: steps[%lld] (%p) is not aligned to 4 bytes",
                                         op, (long long)t, (void *)steps[t]);
    }
    return OPSMITH_STATUS_SUCCESS;
}

opsmith_status opsmith_internal_adamw_norm_check(const char *op, int64_t count, const int64_t *numels,
                                                 opsmith_dtype grad_dtype, const void *const *grads,
                                                 double max_norm, const float *norm, const float *clip_coef,
                                                 const void *workspace, size_t workspace_bytes, size_t partial_size,
                                                 int64_t *chunks) {
    const opsmith_status bad = OPSMITH_STATUS_INVALID_ARGUMENT;
    opsmith_internal_clear_error();
    *chunks = 0;
    if ((unsigned)grad_dtype >= OPSMITH_DTYPE_COUNT || !is_storage(grad_dtype))
        return opsmith_internal_fail(OPSMITH_STATUS_UNSUPPORTED_DTYPE,
                                     "%s: grad_dtype must be f32, bf16 or f16, got %s (%d)", op,
                                     opsmith_dtype_name(grad_dtype), (int)grad_dtype);
    if (!norm) return opsmith_internal_fail(bad, "%s: norm is NULL", op);
    if (opsmith_internal_misaligned(norm, 4)) return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: norm is misaligned", op);
    if (clip_coef && opsmith_internal_misaligned(clip_coef, 4))
        return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: clip_coef is misaligned", op);
    if (clip_coef && !(max_norm > 0.0))
        return opsmith_internal_fail(bad, "%s: max_norm (%g) must be > 0 when clip_coef is asked for", op, max_norm);
    TRY(check_list(op, count, numels));
    if (count > 0) TRY(check_role(op, "grads", count, numels, grads, opsmith_dtype_size(grad_dtype)));
    *chunks = opsmith_internal_adamw_total_chunks(count, numels);
    const size_t need = (size_t)*chunks * partial_size;
    if (need == 0) return OPSMITH_STATUS_SUCCESS;
    if (!workspace)
        return opsmith_internal_fail(bad, "%s: workspace is NULL but %zu bytes are needed", op, need);
    if (workspace_bytes < need)
        return opsmith_internal_fail(OPSMITH_STATUS_WORKSPACE_TOO_SMALL,
                                     "%s: workspace_bytes (%zu) must be >= %zu (opsmith_adamw_grad_norm_*_workspace_size)",
                                     op, workspace_bytes, need);
    if (opsmith_internal_misaligned(workspace, OPSMITH_WORKSPACE_ALIGNMENT))
        return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: workspace (%p) is not aligned to %d bytes", op,
                                     workspace, OPSMITH_WORKSPACE_ALIGNMENT);
    return OPSMITH_STATUS_SUCCESS;
}
