/* Residual add + RMSNorm, the specification: h = x + residual rounded to
 * x's dtype, then RMSNorm's reference on h. All arrays contiguous double. */
#include "opsmith.h"

void opsmith_fused_add_rms_norm_fwd_reference(int64_t rows, int64_t n, const double *x, const double *residual,
                                              const double *weight, double offset, double eps,
                                              opsmith_rms_norm_casting casting, opsmith_dtype x_dtype, double *y,
                                              double *h, double *inv_rms) {
    unsigned char cell[8];
    for (int64_t i = 0; i < rows * n; i++) {
        /* h is stored in x's dtype: the add rounds once, as PyTorch's does */
        opsmith_store_from_double(x_dtype, cell, 0, x[i] + residual[i]);
        h[i] = opsmith_load_as_double(x_dtype, cell, 0);
    }
    opsmith_rms_norm_ex_fwd_reference(rows, n, h, weight, offset, eps, casting, x_dtype, y, inv_rms);
}

void opsmith_fused_add_rms_norm_bwd_reference(int64_t rows, int64_t n, const double *dy, const double *dh,
                                              const double *h, const double *weight, double offset,
                                              opsmith_rms_norm_casting casting, opsmith_dtype x_dtype,
                                              const double *inv_rms, double *dx, double *dweight) {
    if (dy) {
        opsmith_rms_norm_ex_bwd_reference(rows, n, dy, h, weight, offset, casting, x_dtype, inv_rms, dx, dweight);
    } else {
        /* no gradient reaches y: none flows through the norm */
        for (int64_t i = 0; i < rows * n; i++) dx[i] = 0.0;
        if (dweight)
            for (int64_t i = 0; i < n; i++) dweight[i] = 0.0;
    }
    if (dh)
        for (int64_t i = 0; i < rows * n; i++) dx[i] += dh[i];
}
