/* AdamW: one optimizer step over a list of tensors (a multi-tensor launch),
 * with optional global gradient-norm clipping fused into it.
 * Included by opsmith.h; conventions there (tensor lists, workspace).
 *
 * For every tensor t of the list and every element i, with g = grad[t][i]
 * (negated when maximize) times clip_coef, s = step of tensor t (the count
 * after this step's increment, s >= 1) and p the weight (the fp32 master
 * when there is one, else the param widened to float):
 *     p    = p * (1 - lr * weight_decay)                 (decoupled decay)
 *     m    = m + (1 - beta1) * (g - m)                    (exp_avg)
 *     v    = beta2 * v + (1 - beta2) * g * g              (exp_avg_sq)
 *     vmax = max(vmax, v), v' = vmax   when amsgrad, else v' = v
 *     p    = p - lr / (1 - beta1^s) * m / (sqrt(v') / sqrt(1 - beta2^s) + eps)
 * then the param (and the master) get p, the param rounded to its dtype.
 * This is torch.optim.AdamW's update; the arithmetic is float32.
 *
 * Precisions: params f32, bf16 or f16; grads f32, bf16 or f16; exp_avg,
 * exp_avg_sq, max_exp_avg_sq and master weights are always f32. A 16-bit
 * param may have an f32 master weight (master_params non-NULL): the update
 * runs on the master and the param is written as the rounded master (the
 * weights the model sees). Without one the update runs on the param widened
 * to float and is rounded back each step.
 *
 * Lists: count tensors; numels[t] >= 0 elements each (0: skipped), every
 * role of tensor t has numels[t] contiguous elements. params, grads,
 * exp_avgs, exp_avg_sqs and steps are required host arrays of count
 * pointers (the pointers are device pointers for the CUDA launchers);
 * max_exp_avg_sqs is required exactly when amsgrad, master_params may be
 * NULL (every entry non-NULL otherwise; only for 16-bit params). steps[t]
 * points at one float, the step count of tensor t (what torch keeps in
 * state['step']), read, never written: the caller increments it before the
 * step (opsmith_adamw_increment_steps_*: one pass over the list). Tensors of one role never overlap each other or another role.
 *
 * Device scalars, so a CUDA graph can capture a whole training step: lr is
 * read from *lr_tensor when lr_tensor is non-NULL (else the lr argument is
 * used); clip_coef, when non-NULL, points at one float that scales every
 * gradient (what opsmith_adamw_grad_norm writes); NULL means 1. Grads are
 * only read: clipping does not rewrite them.
 *
 * Alignment: pointers need only their element alignment; 16-byte vector
 * loads are taken where every pointer of a chunk allows, scalar otherwise. */
#ifndef OPSMITH_ADAMW_H
#define OPSMITH_ADAMW_H

#ifdef __cplusplus
extern "C" {
#endif

/* Elements one chunk of the multi-tensor launch covers: the unit of work of
 * a CUDA block and of a CPU thread, and of the norm's partial sums. Small
 * enough that a launch over thousands of small tensors spreads over every
 * SM instead of waiting on the one block of its largest tensor. */
#define OPSMITH_ADAMW_CHUNK 8192

/* Adds 1 to *steps[t] for every t < count (the step counts, before a step):
 * what torch does with _foreach_add_(state_steps, 1), in one pass (CUDA: a
 * launch per few thousand counters, no host synchronisation). */
OPSMITH_API opsmith_status opsmith_adamw_increment_steps_cpu(int64_t count, float *const *steps);
OPSMITH_API opsmith_status opsmith_adamw_increment_steps_cuda(int64_t count, float *const *steps,
                                                              opsmith_cuda_stream stream);

OPSMITH_API opsmith_status opsmith_adamw_step_cpu(
    int64_t count, const int64_t *numels, opsmith_dtype param_dtype, opsmith_dtype grad_dtype,
    void *const *params, const void *const *grads, float *const *exp_avgs, float *const *exp_avg_sqs,
    float *const *max_exp_avg_sqs, float *const *master_params, const float *const *steps,
    double lr, const float *lr_tensor, double beta1, double beta2, double eps, double weight_decay,
    int amsgrad, int maximize, const float *clip_coef);

/* The global L2 norm of all the grads, computed in one multi-tensor pass
 * (per-chunk sums of squares in the workspace, summed in a fixed order: the
 * same bits whatever the thread count), written to *norm as float; when
 * clip_coef is non-NULL also min(1, max_norm / (norm + 1e-6)) to it, the
 * coefficient torch.nn.utils.clip_grad_norm_ scales by. norm and clip_coef
 * are device pointers for the CUDA launcher, host pointers for the CPU one.
 * A NaN or Inf gradient gives a NaN or Inf norm (and a NaN or 0 coefficient). */
OPSMITH_API size_t opsmith_adamw_grad_norm_cpu_workspace_size(int64_t count, const int64_t *numels);
OPSMITH_API opsmith_status opsmith_adamw_grad_norm_cpu(int64_t count, const int64_t *numels, opsmith_dtype grad_dtype,
                                                       const void *const *grads, double max_norm, float *norm,
                                                       float *clip_coef, void *workspace, size_t workspace_bytes);

/* The CUDA launchers: the same arguments as device pointers in host arrays,
 * plus the stream. The lists are copied into kernel arguments before the
 * call returns (batches of tensors and chunks: a handful of launches for
 * thousands of tensors, no host synchronisation, no allocation). */
OPSMITH_API opsmith_status opsmith_adamw_step_cuda(
    int64_t count, const int64_t *numels, opsmith_dtype param_dtype, opsmith_dtype grad_dtype,
    void *const *params, const void *const *grads, float *const *exp_avgs, float *const *exp_avg_sqs,
    float *const *max_exp_avg_sqs, float *const *master_params, const float *const *steps,
    double lr, const float *lr_tensor, double beta1, double beta2, double eps, double weight_decay,
    int amsgrad, int maximize, const float *clip_coef, opsmith_cuda_stream stream);

OPSMITH_API size_t opsmith_adamw_grad_norm_cuda_workspace_size(int64_t count, const int64_t *numels);
OPSMITH_API opsmith_status opsmith_adamw_grad_norm_cuda(int64_t count, const int64_t *numels, opsmith_dtype grad_dtype,
                                                        const void *const *grads, double max_norm, float *norm,
                                                        float *clip_coef, void *workspace, size_t workspace_bytes,
                                                        opsmith_cuda_stream stream);

/* Scalar references, the specification, in float64: the same step on
 * float64 lists (params are the weights: the masters in master mode),
 * steps[t] the step count of tensor t, lr and clip_coef plain numbers; and
 * the global norm of the grads. */
OPSMITH_API void opsmith_adamw_step_reference(int64_t count, const int64_t *numels, double *const *params,
                                              const double *const *grads, double *const *exp_avgs,
                                              double *const *exp_avg_sqs, double *const *max_exp_avg_sqs,
                                              const double *steps, double lr, double beta1, double beta2,
                                              double eps, double weight_decay, int amsgrad, int maximize,
                                              double clip_coef);
OPSMITH_API double opsmith_adamw_grad_norm_reference(int64_t count, const int64_t *numels,
                                                     const double *const *grads);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_ADAMW_H */
