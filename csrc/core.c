/* Status and dtype tables, and element conversions, of the C ABI. */
#include <math.h>

#include "opsmith.h"
#include "convert.h"

static const char *const status_strings[] = {
    [OPSMITH_STATUS_SUCCESS] = "success",
    [OPSMITH_STATUS_INVALID_ARGUMENT] = "invalid argument",
    [OPSMITH_STATUS_UNSUPPORTED_DTYPE] = "unsupported dtype",
    [OPSMITH_STATUS_MISALIGNED] = "pointer not aligned to its element size",
    [OPSMITH_STATUS_OUT_OF_MEMORY] = "out of host memory",
    [OPSMITH_STATUS_WORKSPACE_TOO_SMALL] = "workspace too small",
    [OPSMITH_STATUS_CUDA_ERROR] = "CUDA error",
    [OPSMITH_STATUS_CUDA_UNAVAILABLE] = "built without CUDA",
};
_Static_assert(sizeof status_strings / sizeof status_strings[0] == OPSMITH_STATUS_COUNT,
               "status_strings must name every opsmith_status");

const char *opsmith_status_string(opsmith_status status) {
    if ((unsigned)status >= OPSMITH_STATUS_COUNT) return "unknown status";
    return status_strings[status];
}

static const struct { const char *name; size_t size; } dtypes[] = {
    [OPSMITH_DTYPE_F64] = {"f64", 8},
    [OPSMITH_DTYPE_F32] = {"f32", 4},
    [OPSMITH_DTYPE_F16] = {"f16", 2},
    [OPSMITH_DTYPE_BF16] = {"bf16", 2},
};
_Static_assert(sizeof dtypes / sizeof dtypes[0] == OPSMITH_DTYPE_COUNT,
               "dtypes must describe every opsmith_dtype");

const char *opsmith_dtype_name(opsmith_dtype dtype) {
    return (unsigned)dtype < OPSMITH_DTYPE_COUNT ? dtypes[dtype].name : "?";
}

size_t opsmith_dtype_size(opsmith_dtype dtype) {
    return (unsigned)dtype < OPSMITH_DTYPE_COUNT ? dtypes[dtype].size : 0;
}

opsmith_dtype opsmith_dtype_accumulate(opsmith_dtype dtype) {
    return dtype == OPSMITH_DTYPE_F64 ? OPSMITH_DTYPE_F64 : OPSMITH_DTYPE_F32;
}

/* double -> float rounded to odd: an inexact result keeps its last bit set,
 * so the second rounding (float -> 16 bits, 13+ bits narrower) cannot land
 * on a false tie. Together the two steps round double to 16 bits correctly. */
static float float_round_to_odd(double d) {
    float f = (float)d;
    if ((double)f == d || f != f) return f;
    if (fabs((double)f) > fabs(d)) f = nextafterf(f, 0.0f); /* truncate towards zero */
    return opsmith_f32_from_bits(opsmith_f32_bits(f) | 1u);
}

double opsmith_load_as_double(opsmith_dtype dtype, const void *base, int64_t index) {
    switch (dtype) {
    case OPSMITH_DTYPE_F64: return ((const double *)base)[index];
    case OPSMITH_DTYPE_F32: return ((const float *)base)[index];
    case OPSMITH_DTYPE_F16: return opsmith_f16_to_f32(((const uint16_t *)base)[index]);
    case OPSMITH_DTYPE_BF16: return opsmith_bf16_to_f32(((const uint16_t *)base)[index]);
    default: return 0.0 / 0.0;
    }
}

void opsmith_store_from_double(opsmith_dtype dtype, void *base, int64_t index, double value) {
    switch (dtype) {
    case OPSMITH_DTYPE_F64: ((double *)base)[index] = value; break;
    case OPSMITH_DTYPE_F32: ((float *)base)[index] = (float)value; break;
    case OPSMITH_DTYPE_F16: ((uint16_t *)base)[index] = opsmith_f32_to_f16(float_round_to_odd(value)); break;
    case OPSMITH_DTYPE_BF16: ((uint16_t *)base)[index] = opsmith_f32_to_bf16(float_round_to_odd(value)); break;
    default: break;
    }
}

/* Per-thread copy of the last CUDA runtime message, so concurrent callers
 * on different threads do not read each other's errors. */
static _Thread_local char last_cuda_error[256];

void opsmith_internal_set_cuda_error(const char *message) {
    size_t i = 0;
    for (; message && message[i] && i + 1 < sizeof last_cuda_error; i++) last_cuda_error[i] = message[i];
    last_cuda_error[i] = '\0';
}

const char *opsmith_last_cuda_error(void) { return last_cuda_error; }
