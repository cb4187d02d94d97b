/* AdamW on the CPU: one multi-tensor step over a list, and the global
 * gradient norm, in float32 arithmetic (see opsmith/adamw.h).
 *
 * Work is split into chunks of OPSMITH_ADAMW_CHUNK elements numbered across
 * the whole list; chunk k goes to thread k % threads, so thousands of small
 * tensors spread over the threads as evenly as a few large ones, with one
 * parallel region per call. Inside a chunk, blocks of OPSMITH_CPU_BLOCK
 * elements are widened to float (16-bit params and grads), updated in a
 * loop the compiler vectorizes, and narrowed back. */
#pragma GCC optimize("no-trapping-math")
#include <math.h>
#include <omp.h>
#if defined(__SSE__)
#include <immintrin.h>
#endif

#include "cpu_rows.h" /* OPSMITH_CPU_CLONES; convert_block.h */
#include "internal/adamw.h"

#define BLOCK 512


/* The per-tensor constants of the update, computed in double as
 * torch.optim.AdamW does (Python floats) and used as float. */
typedef struct consts {
    float decay, w1, beta2, omb2, step_size, bc2_sqrt, eps, coef;
    int amsgrad;
} consts;

static consts consts_for(double lr, double beta1, double beta2, double eps, double weight_decay, int amsgrad,
                         int maximize, double step, float clip) {
    consts c;
    const double bc1 = 1.0 - pow(beta1, step), bc2 = 1.0 - pow(beta2, step);
    c.decay = (float)(1.0 - lr * weight_decay);
    c.w1 = (float)(1.0 - beta1);
    c.beta2 = (float)beta2;
    c.omb2 = (float)(1.0 - beta2);
    c.step_size = (float)(lr / bc1);
    c.bc2_sqrt = (float)sqrt(bc2);
    c.eps = (float)eps;
    c.coef = maximize ? -clip : clip;
    c.amsgrad = amsgrad;
    return c;
}

/* x[i] = sqrt(x[i]) for n elements. The library is built with math errno
 * on, which keeps sqrtf out of vectorized loops (a branch to set errno);
 * SSE's sqrtps (baseline on x86-64) is the same correctly rounded sqrt. */
static void sqrt_block(float *x, int64_t n) {
    int64_t i = 0;
#if defined(__SSE__)
    for (; i + 4 <= n; i += 4) _mm_storeu_ps(x + i, _mm_sqrt_ps(_mm_loadu_ps(x + i)));
#endif
    for (; i < n; i++) x[i] = sqrtf(x[i]);
}

/* n <= BLOCK elements: p (the weight, updated), g (read), m, v, vmax
 * (updated; vmax NULL without amsgrad). AMS and LOW (1 - beta1 < 0.5:
 * torch's lerp takes m + w (g - m), else g - (g - m)(1 - w)) are constants
 * in each caller, so every loop is branch-free and vectorizes. */
static inline __attribute__((always_inline)) void update_body(const consts *c, int64_t n, float *restrict p,
                                                              const float *restrict g, float *restrict m,
                                                              float *restrict v, float *restrict vmax,
                                                              const int AMS, const int LOW) {
    const float decay = c->decay, w1 = c->w1, beta2 = c->beta2, omb2 = c->omb2, step_size = c->step_size;
    const float bc2_sqrt = c->bc2_sqrt, eps = c->eps, coef = c->coef, w1c = 1.0f - c->w1;
    float root[BLOCK];
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float gi = g[i] * coef;
        const float mi = LOW ? m[i] + w1 * (gi - m[i]) : gi - (gi - m[i]) * w1c;
        const float vi = v[i] * beta2 + omb2 * gi * gi;
        float vv = vi;
        if (AMS) {
            vv = vmax[i] > vi ? vmax[i] : vi;
            vmax[i] = vv;
        }
        m[i] = mi, v[i] = vi, root[i] = vv;
    }
    sqrt_block(root, n);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) p[i] = p[i] * decay + -step_size * (m[i] / (root[i] / bc2_sqrt + eps));
}

static inline __attribute__((always_inline)) void update(const consts *c, int64_t n, float *restrict p,
                                                         const float *restrict g, float *restrict m,
                                                         float *restrict v, float *restrict vmax) {
    const int low = c->w1 < 0.5f;
    if (c->amsgrad) {
        if (low) update_body(c, n, p, g, m, v, vmax, 1, 1);
        else update_body(c, n, p, g, m, v, vmax, 1, 0);
    } else {
        if (low) update_body(c, n, p, g, m, v, NULL, 0, 1);
        else update_body(c, n, p, g, m, v, NULL, 0, 0);
    }
}

/* Elements [off, off + n) of tensor t; compiled for AVX-512, AVX2 and the
 * baseline (cpu_rows.h), picked at load time: the same bits in each (no FMA
 * contraction). */
OPSMITH_CPU_CLONES static void step_span(const consts *c, opsmith_dtype pdt, opsmith_dtype gdt, void *param, const void *grad,
                      float *m, float *v, float *vmax, float *master, int64_t off, int64_t n) {
    float gbuf[BLOCK], pbuf[BLOCK];
    for (int64_t b = 0; b < n; b += BLOCK) {
        const int64_t len = n - b < BLOCK ? n - b : BLOCK, at = off + b;
        const float *g = opsmith_widen_f32(gdt, grad, at, len, gbuf);
        float *vm = vmax ? vmax + at : NULL;
        if (master) {
            update(c, len, master + at, g, m + at, v + at, vm);
            opsmith_narrow_f32(pdt, master + at, param, at, len);
        } else if (pdt == OPSMITH_DTYPE_F32) {
            update(c, len, (float *)param + at, g, m + at, v + at, vm);
        } else {
            const float *pw = opsmith_widen_f32(pdt, param, at, len, pbuf);
            if (pw != pbuf)
                for (int64_t i = 0; i < len; i++) pbuf[i] = pw[i];
            update(c, len, pbuf, g, m + at, v + at, vm);
            opsmith_narrow_f32(pdt, pbuf, param, at, len);
        }
    }
}

opsmith_status opsmith_adamw_step_cpu(int64_t count, const int64_t *numels, opsmith_dtype param_dtype,
                                      opsmith_dtype grad_dtype, void *const *params, const void *const *grads,
                                      float *const *exp_avgs, float *const *exp_avg_sqs,
                                      float *const *max_exp_avg_sqs, float *const *master_params,
                                      const float *const *steps, double lr, const float *lr_tensor, double beta1,
                                      double beta2, double eps, double weight_decay, int amsgrad, int maximize,
                                      const float *clip_coef) {
    opsmith_status s = opsmith_internal_adamw_step_check("adamw_step_cpu", count, numels, param_dtype, grad_dtype,
                                                         params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                                         master_params, steps, lr, lr_tensor, beta1, beta2, eps,
                                                         weight_decay, amsgrad);
    if (s != OPSMITH_STATUS_SUCCESS || count == 0) return s;
    const double lr_v = lr_tensor ? (double)*lr_tensor : lr;
    const float clip = clip_coef ? *clip_coef : 1.0f;
    int64_t total = 0;
    for (int64_t t = 0; t < count; t++) total += numels[t];
    const int threads = opsmith_internal_threads_for(total);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int nth = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t k = 0; /* the list-wide number of the tensor's first chunk */
        for (int64_t t = 0; t < count; t++) {
            const int64_t n = numels[t], chunks = opsmith_internal_adamw_chunks(n);
            int64_t c0 = ((me - k) % nth + nth) % nth; /* the first chunk of t that is this thread's */
            if (c0 < chunks) {
                const consts c = consts_for(lr_v, beta1, beta2, eps, weight_decay, amsgrad, maximize,
                                            (double)*steps[t], clip);
                for (int64_t ch = c0; ch < chunks; ch += nth) {
                    const int64_t off = ch * OPSMITH_ADAMW_CHUNK;
                    const int64_t len = n - off < OPSMITH_ADAMW_CHUNK ? n - off : OPSMITH_ADAMW_CHUNK;
                    step_span(&c, param_dtype, grad_dtype, params[t], grads[t], exp_avgs[t], exp_avg_sqs[t],
                              amsgrad ? max_exp_avg_sqs[t] : NULL, master_params ? master_params[t] : NULL, off,
                              len);
                }
            }
            k = (k + chunks) % nth;
        }
    }
    return OPSMITH_STATUS_SUCCESS;
}

opsmith_status opsmith_adamw_increment_steps_cpu(int64_t count, float *const *steps) {
    opsmith_status s = opsmith_internal_adamw_increment_check("adamw_increment_steps_cpu", count, steps);
    if (s != OPSMITH_STATUS_SUCCESS) return s;
    for (int64_t t = 0; t < count; t++) *steps[t] += 1.0f;
    return OPSMITH_STATUS_SUCCESS;
}

size_t opsmith_adamw_grad_norm_cpu_workspace_size(int64_t count, const int64_t *numels) {
    return (size_t)opsmith_internal_adamw_total_chunks(count, numels) * sizeof(double);
}

/* Sum of squares of n elements in 8 fixed lanes (the same bits at any
 * thread count and ISA). */
static double sum_squares(opsmith_dtype gdt, const void *grad, int64_t off, int64_t n) {
    float buf[BLOCK];
    double lanes[8] = {0};
    for (int64_t b = 0; b < n; b += BLOCK) {
        const int64_t len = n - b < BLOCK ? n - b : BLOCK;
        const float *g = opsmith_widen_f32(gdt, grad, off + b, len, buf);
        float fl[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= len; i += 8)
            for (int k = 0; k < 8; k++) fl[k] += g[i + k] * g[i + k];
        for (; i < len; i++) fl[i % 8] += g[i] * g[i];
        for (int k = 0; k < 8; k++) lanes[k] += fl[k];
    }
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

opsmith_status opsmith_adamw_grad_norm_cpu(int64_t count, const int64_t *numels, opsmith_dtype grad_dtype,
                                           const void *const *grads, double max_norm, float *norm, float *clip_coef,
                                           void *workspace, size_t workspace_bytes) {
    int64_t chunks = 0;
    opsmith_status s = opsmith_internal_adamw_norm_check("adamw_grad_norm_cpu", count, numels, grad_dtype, grads,
                                                         max_norm, norm, clip_coef, workspace, workspace_bytes,
                                                         sizeof(double), &chunks);
    if (s != OPSMITH_STATUS_SUCCESS) return s;
    double *partial = (double *)workspace;
    int64_t total = 0;
    for (int64_t t = 0; t < count; t++) total += numels[t];
    const int threads = opsmith_internal_threads_for(total);
#pragma omp parallel num_threads(threads) if (threads > 1 && chunks > 1)
    {
        const int nth = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t k = 0;
        for (int64_t t = 0; t < count; t++) {
            const int64_t n = numels[t], nc = opsmith_internal_adamw_chunks(n);
            for (int64_t ch = 0; ch < nc; ch++) {
                if ((k + ch) % nth != me) continue;
                const int64_t off = ch * OPSMITH_ADAMW_CHUNK;
                partial[k + ch] = sum_squares(grad_dtype, grads[t], off,
                                              n - off < OPSMITH_ADAMW_CHUNK ? n - off : OPSMITH_ADAMW_CHUNK);
            }
            k += nc;
        }
    }
    double sum = 0.0;
    for (int64_t c = 0; c < chunks; c++) sum += partial[c];
    const float nrm = (float)sqrt(sum);
    *norm = nrm;
    if (clip_coef) {
        const float coef = (float)max_norm / (nrm + 1e-6f);
        *clip_coef = coef > 1.0f ? 1.0f : coef; /* NaN stays NaN, as torch.clamp */
    }
    return OPSMITH_STATUS_SUCCESS;
}
