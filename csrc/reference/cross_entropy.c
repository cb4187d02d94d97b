/* cross_entropy, the specification: plain loops over double, no threads.
 * logits, dlogits, dx are (rows, n) contiguous; formulas in
 * include/opsmith/cross_entropy.h. */
#include <math.h>
#include <stdlib.h>

#include "opsmith.h"

void opsmith_cross_entropy_fwd_reference(int64_t rows, int64_t n, const double *logits, const int64_t *target,
                                         const double *weight, int64_t ignore_index, double ls, double z_loss,
                                         double softcap, opsmith_cross_entropy_reduction reduction, double *loss,
                                         double *z_out, double *lse_out, double *dlogits) {
    double total = 0.0, z_total = 0.0, denom = 0.0, wsum = 0.0;
    for (int64_t c = 0; c < n; c++) wsum += weight ? weight[c] : 1.0;
    double *y = malloc(sizeof(double) * (size_t)n);
    for (int64_t r = 0; r < rows; r++) {
        const double *x = logits + r * n;
        const int64_t t = target[r];
        for (int64_t c = 0; c < n; c++) y[c] = softcap > 0 ? softcap * tanh(x[c] / softcap) : x[c];
        double m = -INFINITY, s = 0.0;
        for (int64_t c = 0; c < n; c++) m = fmax(m, y[c]);
        for (int64_t c = 0; c < n; c++) s += exp(y[c] - m);
        const double lse = m + log(s);
        if (lse_out) lse_out[r] = lse;
        double l = 0.0, zl = 0.0;
        const int ignored = t == ignore_index;
        const double wt = ignored ? 0.0 : weight ? weight[t] : 1.0;
        if (!ignored) {
            double smooth = 0.0; /* only when smoothing: a -inf (masked) logit makes it inf */
            if (ls > 0)
                for (int64_t c = 0; c < n; c++) smooth += (weight ? weight[c] : 1.0) * (lse - y[c]);
            zl = z_loss * lse * lse;
            l = (1.0 - ls) * wt * (lse - y[t]) + ls / (double)n * smooth + zl;
            denom += wt;
        }
        total += l, z_total += zl;
        if (reduction == OPSMITH_CROSS_ENTROPY_REDUCTION_NONE) {
            loss[r] = l;
            if (z_out) z_out[r] = zl;
        }
        if (dlogits)
            for (int64_t c = 0; c < n; c++) {
                if (ignored) {
                    dlogits[r * n + c] = 0.0;
                    continue;
                }
                const double p = exp(y[c] - m) / s, wc = weight ? weight[c] : 1.0;
                double g = p * ((1.0 - ls) * wt + ls / (double)n * wsum + 2.0 * z_loss * lse) - ls / (double)n * wc;
                if (c == t) g -= (1.0 - ls) * wt;
                if (softcap > 0) g *= 1.0 - (y[c] / softcap) * (y[c] / softcap);
                dlogits[r * n + c] = g;
            }
    }
    if (reduction != OPSMITH_CROSS_ENTROPY_REDUCTION_NONE) {
        const double d = reduction == OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN ? denom : 1.0;
        loss[0] = total / d;
        if (z_out) z_out[0] = z_total / d;
        if (dlogits && reduction == OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN)
            for (int64_t r = 0; r < rows; r++) /* ignored rows stay 0, also when denom is 0 */
                if (target[r] != ignore_index)
                    for (int64_t c = 0; c < n; c++) dlogits[r * n + c] /= denom;
    }
    free(y);
}

void opsmith_cross_entropy_bwd_reference(int64_t rows, int64_t n, const double *grad, int64_t grad_stride,
                                         const double *dlogits, double *dx) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < n; c++) dx[r * n + c] = grad[r * grad_stride] * dlogits[r * n + c];
}
