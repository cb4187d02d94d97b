/* What softmax's CPU and CUDA launchers share: argument validation. Not
 * exported. */
#ifndef OPSMITH_INTERNAL_SOFTMAX_H
#define OPSMITH_INTERNAL_SOFTMAX_H

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Validates a forward call (backward = 0: in = x, out = y; dy is ignored) or
 * a backward call (in = y, out = dx); `op` names the launcher in the error
 * message. Checks the dtype, sizes, strides, NULL and misaligned pointers
 * and the aliasing rule (y may be x, dx may be dy, exactly). */
OPSMITH_INTERNAL opsmith_status opsmith_internal_softmax_check(const char *op, opsmith_dtype dtype, int64_t rows,
                                                               int64_t n, const void *in, int64_t in_row_stride,
                                                               int backward, const void *dy, int64_t dy_row_stride,
                                                               const void *out, int64_t out_row_stride);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_INTERNAL_SOFTMAX_H */
