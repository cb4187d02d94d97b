/* LayerNorm, the specification: plain loops over double, no threads.
 * x, y, dy, dx are (rows, n) contiguous; weight, bias, dweight, dbias are
 * (n) or NULL; mean and rstd are (rows). */
#include <math.h>

#include "opsmith.h"

void opsmith_layer_norm_fwd_reference(int64_t rows, int64_t n, const double *x, const double *weight,
                                      const double *bias, double eps, double *y, double *mean, double *rstd) {
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * n;
        double sum = 0.0;
        for (int64_t i = 0; i < n; i++) sum += xr[i];
        const double mu = sum / (double)n;
        double sq = 0.0;
        for (int64_t i = 0; i < n; i++) sq += (xr[i] - mu) * (xr[i] - mu);
        const double rs = 1.0 / sqrt(sq / (double)n + eps);
        mean[r] = mu;
        rstd[r] = rs;
        for (int64_t i = 0; i < n; i++)
            y[r * n + i] = (xr[i] - mu) * rs * (weight ? weight[i] : 1.0) + (bias ? bias[i] : 0.0);
    }
}

void opsmith_layer_norm_bwd_reference(int64_t rows, int64_t n, const double *dy, const double *x,
                                      const double *weight, const double *mean, const double *rstd, double *dx,
                                      double *dweight, double *dbias) {
    for (int64_t i = 0; i < n; i++) {
        if (dweight) dweight[i] = 0.0;
        if (dbias) dbias[i] = 0.0;
    }
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * n, *dyr = dy + r * n;
        const double mu = mean[r], rs = rstd[r];
        double sum_g = 0.0, sum_gx = 0.0; /* sums of g and g * xhat, g = dy * weight */
        for (int64_t i = 0; i < n; i++) {
            const double g = dyr[i] * (weight ? weight[i] : 1.0);
            sum_g += g;
            sum_gx += g * (xr[i] - mu) * rs;
        }
        const double mg = sum_g / (double)n, mgx = sum_gx / (double)n;
        for (int64_t i = 0; i < n; i++) {
            const double g = dyr[i] * (weight ? weight[i] : 1.0), xhat = (xr[i] - mu) * rs;
            dx[r * n + i] = rs * (g - mg - xhat * mgx);
            if (dweight) dweight[i] += dyr[i] * xhat;
            if (dbias) dbias[i] += dyr[i];
        }
    }
}
