/* AdamW's scalar reference: plain loops in float64, the specification the
 * CPU and CUDA launchers are tested against. */
#include <math.h>

#include "internal.h"

void opsmith_adamw_step_reference(int64_t count, const int64_t *numels, double *const *params,
                                  const double *const *grads, double *const *exp_avgs, double *const *exp_avg_sqs,
                                  double *const *max_exp_avg_sqs, const double *steps, double lr, double beta1,
                                  double beta2, double eps, double weight_decay, int amsgrad, int maximize,
                                  double clip_coef) {
    for (int64_t t = 0; t < count; t++) {
        const double bc1 = 1.0 - pow(beta1, steps[t]), bc2 = 1.0 - pow(beta2, steps[t]);
        for (int64_t i = 0; i < numels[t]; i++) {
            const double g = (maximize ? -grads[t][i] : grads[t][i]) * clip_coef;
            double p = params[t][i] * (1.0 - lr * weight_decay);
            const double m = exp_avgs[t][i] + (1.0 - beta1) * (g - exp_avgs[t][i]);
            const double v = beta2 * exp_avg_sqs[t][i] + (1.0 - beta2) * g * g;
            double vv = v;
            if (amsgrad) {
                if (max_exp_avg_sqs[t][i] > v) vv = max_exp_avg_sqs[t][i];
                max_exp_avg_sqs[t][i] = vv;
            }
            p -= lr / bc1 * m / (sqrt(vv) / sqrt(bc2) + eps);
            params[t][i] = p;
            exp_avgs[t][i] = m;
            exp_avg_sqs[t][i] = v;
        }
    }
}

double opsmith_adamw_grad_norm_reference(int64_t count, const int64_t *numels, const double *const *grads) {
    double s = 0.0;
    for (int64_t t = 0; t < count; t++)
        for (int64_t i = 0; i < numels[t]; i++) s += grads[t][i] * grads[t][i];
    return sqrt(s);
}
