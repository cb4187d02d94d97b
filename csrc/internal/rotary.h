/* What the rotary launchers (CPU and CUDA) share: argument validation. Not
 * exported. */
#ifndef OPSMITH_INTERNAL_ROTARY_H
#define OPSMITH_INTERNAL_ROTARY_H

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Validates a call (opsmith/rotary.h); `op` names the launcher in the
 * message, backward says whether the operands are named q/k or dq/dk.
 * Checks the style, dtypes, sizes, strides, NULL and misaligned pointers and
 * the aliasing rule. Returns SUCCESS with nothing to do when batch or seq is 0. */
OPSMITH_INTERNAL opsmith_status opsmith_internal_rotary_check(const char *op, int backward,
                                                              const opsmith_rotary_params *p, const void *q,
                                                              const void *q_out, const void *k, const void *k_out,
                                                              const void *cos, const void *sin,
                                                              const int64_t *position_ids);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_INTERNAL_ROTARY_H */
