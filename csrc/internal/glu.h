/* What the gated activations' CPU and CUDA launchers share: argument
 * validation. Not exported. */
#ifndef OPSMITH_INTERNAL_GLU_H
#define OPSMITH_INTERNAL_GLU_H

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Validates a forward call (backward = 0: dy, dup, h ignored, dgate = y) or
 * a backward call; `op` names the launcher in the error message. Checks the
 * activation, dtype, sizes, strides, NULL and misaligned pointers, and the
 * aliasing rule of opsmith/glu.h. */
OPSMITH_INTERNAL opsmith_status opsmith_internal_glu_check(
    const char *op, opsmith_glu_activation activation, opsmith_dtype dtype, int64_t rows, int64_t n, int backward,
    const void *dy, int64_t dy_row_stride, const void *gate, int64_t gate_row_stride, const void *up,
    int64_t up_row_stride, const void *out, int64_t out_row_stride, const void *dup, int64_t dup_row_stride,
    const void *h, int64_t h_row_stride);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_INTERNAL_GLU_H */
