/* RMSNorm, the specification: plain loops over double, no threads.
 * x, y, dy, dx are (rows, n) contiguous; weight, dweight are (n) or NULL;
 * inv_rms is (rows). */
#include <math.h>

#include "opsmith.h"

void opsmith_rms_norm_fwd_reference(int64_t rows, int64_t n, const double *x,
                                    const double *weight, double eps,
                                    double *y, double *inv_rms) {
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * n;
        double sum_sq = 0.0;
        for (int64_t i = 0; i < n; i++) sum_sq += xr[i] * xr[i];
        double inv = 1.0 / sqrt(sum_sq / (double)n + eps);
        inv_rms[r] = inv;
        for (int64_t i = 0; i < n; i++) y[r * n + i] = xr[i] * inv * (weight ? weight[i] : 1.0);
    }
}

void opsmith_rms_norm_bwd_reference(int64_t rows, int64_t n, const double *dy,
                                    const double *x, const double *weight,
                                    const double *inv_rms, double *dx, double *dweight) {
    if (dweight)
        for (int64_t i = 0; i < n; i++) dweight[i] = 0.0;
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * n, *dyr = dy + r * n;
        double inv = inv_rms[r];
        double dot = 0.0; /* sum_j g_j x_j with g = dy * weight */
        for (int64_t i = 0; i < n; i++) dot += dyr[i] * (weight ? weight[i] : 1.0) * xr[i];
        double mean = dot / (double)n;
        for (int64_t i = 0; i < n; i++) {
            double g = dyr[i] * (weight ? weight[i] : 1.0);
            dx[r * n + i] = inv * (g - xr[i] * inv * inv * mean);
            if (dweight) dweight[i] += dyr[i] * xr[i] * inv;
        }
    }
}
