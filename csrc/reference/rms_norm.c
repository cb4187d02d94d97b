/* RMSNorm, the specification: plain loops over double, no threads.
 * x, y, dy, dx are (rows, n) contiguous; weight, dweight are (n) or NULL;
 * inv_rms is (rows). */
#include <math.h>

#include "opsmith.h"

/* x_hat as the LLAMA casting sees it: rounded to x's dtype */
static double rounded(double v, opsmith_dtype dtype) {
    unsigned char cell[8];
    opsmith_store_from_double(dtype, cell, 0, v);
    return opsmith_load_as_double(dtype, cell, 0);
}

static double x_hat(double x, double inv, opsmith_rms_norm_casting casting, opsmith_dtype x_dtype) {
    const double v = x * inv;
    return casting == OPSMITH_RMS_NORM_CASTING_LLAMA ? rounded(v, x_dtype) : v;
}

void opsmith_rms_norm_ex_fwd_reference(int64_t rows, int64_t n, const double *x, const double *weight,
                                       double offset, double eps, opsmith_rms_norm_casting casting,
                                       opsmith_dtype x_dtype, double *y, double *inv_rms) {
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * n;
        double sum_sq = 0.0;
        for (int64_t i = 0; i < n; i++) sum_sq += xr[i] * xr[i];
        double inv = 1.0 / sqrt(sum_sq / (double)n + eps);
        inv_rms[r] = inv;
        for (int64_t i = 0; i < n; i++)
            y[r * n + i] = x_hat(xr[i], inv, casting, x_dtype) * (weight ? offset + weight[i] : 1.0);
    }
}

void opsmith_rms_norm_ex_bwd_reference(int64_t rows, int64_t n, const double *dy, const double *x,
                                       const double *weight, double offset, opsmith_rms_norm_casting casting,
                                       opsmith_dtype x_dtype, const double *inv_rms, double *dx,
                                       double *dweight) {
    if (dweight)
        for (int64_t i = 0; i < n; i++) dweight[i] = 0.0;
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * n, *dyr = dy + r * n;
        double inv = inv_rms[r];
        double dot = 0.0; /* sum_j g_j x_j with g = dy * (offset + weight) */
        for (int64_t i = 0; i < n; i++) dot += dyr[i] * (weight ? offset + weight[i] : 1.0) * xr[i];
        double mean = dot / (double)n;
        for (int64_t i = 0; i < n; i++) {
            double g = dyr[i] * (weight ? offset + weight[i] : 1.0);
            dx[r * n + i] = inv * (g - xr[i] * inv * inv * mean);
            if (dweight) dweight[i] += dyr[i] * x_hat(xr[i], inv, casting, x_dtype);
        }
    }
}

void opsmith_rms_norm_fwd_reference(int64_t rows, int64_t n, const double *x, const double *weight, double eps,
                                    double *y, double *inv_rms) {
    opsmith_rms_norm_ex_fwd_reference(rows, n, x, weight, 0.0, eps, OPSMITH_RMS_NORM_CASTING_NONE,
                                      OPSMITH_DTYPE_F64, y, inv_rms);
}

void opsmith_rms_norm_bwd_reference(int64_t rows, int64_t n, const double *dy, const double *x,
                                    const double *weight, const double *inv_rms, double *dx, double *dweight) {
    opsmith_rms_norm_ex_bwd_reference(rows, n, dy, x, weight, 0.0, OPSMITH_RMS_NORM_CASTING_NONE,
                                      OPSMITH_DTYPE_F64, inv_rms, dx, dweight);
}
