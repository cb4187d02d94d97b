/* softmax and log_softmax, the specification: plain loops over double, no
 * threads. x, y, dy, dx are (rows, n) contiguous. */
#include <math.h>

#include "opsmith.h"

void opsmith_softmax_fwd_reference(int64_t rows, int64_t n, const double *x, int log_, double *y) {
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * n;
        double m = -INFINITY, s = 0.0;
        for (int64_t i = 0; i < n; i++) m = fmax(m, xr[i]);
        for (int64_t i = 0; i < n; i++) s += exp(xr[i] - m);
        /* exp(x - m) / s and (x - m) - log(s): forming lse = m + log(s) first
         * would round it (ulp 3.6e-12 at |x| ~ 2e4), an error of every output */
        const double log_s = log(s);
        for (int64_t i = 0; i < n; i++) y[r * n + i] = log_ ? (xr[i] - m) - log_s : exp(xr[i] - m) / s;
    }
}

void opsmith_softmax_bwd_reference(int64_t rows, int64_t n, const double *dy, const double *y, int log_, double *dx) {
    for (int64_t r = 0; r < rows; r++) {
        const double *g = dy + r * n, *yr = y + r * n;
        double s = 0.0;
        for (int64_t i = 0; i < n; i++) s += log_ ? g[i] : g[i] * yr[i];
        for (int64_t i = 0; i < n; i++) dx[r * n + i] = log_ ? g[i] - exp(yr[i]) * s : yr[i] * (g[i] - s);
    }
}
