/* Declarations shared by the library's own translation units (C and CUDA),
 * not part of the public ABI. */
#ifndef OPSMITH_INTERNAL_H
#define OPSMITH_INTERNAL_H

#include "opsmith.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Remember the CUDA runtime's message for opsmith_last_cuda_error(). */
void opsmith_internal_set_cuda_error(const char *message);

/* One validator per op, called by both its CPU and CUDA launchers.
 * Forward (backward = 0): dy and dweight are NULL and out is y. Backward:
 * dy is required and out is dx. */
opsmith_status opsmith_internal_rms_norm_check(opsmith_dtype dtype, int64_t rows, int64_t n,
                                               const void *x, int64_t x_row_stride, int backward,
                                               const void *dy, int64_t dy_row_stride,
                                               const void *weight, double eps, const void *out,
                                               const void *inv_rms, const void *dweight);

/* The CUDA kernel family ("resident", "staged", "generic") a contiguous,
 * aligned RMSNorm call of this shape takes on the current device, and the
 * CTAs that share a row (cluster size) in *ctas; for tests. CUDA builds only. */
const char *opsmith_internal_rms_norm_cuda_plan(opsmith_dtype dtype, int64_t rows, int64_t n, int backward,
                                                int *ctas);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_INTERNAL_H */
