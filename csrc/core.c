/* The core of the C ABI: version, status and dtype tables, the last-error
 * message, CPU thread counts, element conversions. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "convert.h"
#include "internal.h"

#define OPSMITH_STR2(x) #x
#define OPSMITH_STR(x) OPSMITH_STR2(x)

int opsmith_abi_version(void) { return OPSMITH_ABI_VERSION; }

const char *opsmith_version(void) {
    return OPSMITH_STR(OPSMITH_VERSION_MAJOR) "." OPSMITH_STR(OPSMITH_VERSION_MINOR) "." OPSMITH_STR(
        OPSMITH_VERSION_PATCH);
}

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

static const struct { const char *name; size_t size; int is_float; opsmith_dtype accumulate; } dtypes[] = {
    [OPSMITH_DTYPE_F64] = {"f64", 8, 1, OPSMITH_DTYPE_F64},
    [OPSMITH_DTYPE_F32] = {"f32", 4, 1, OPSMITH_DTYPE_F32},
    [OPSMITH_DTYPE_F16] = {"f16", 2, 1, OPSMITH_DTYPE_F32},
    [OPSMITH_DTYPE_BF16] = {"bf16", 2, 1, OPSMITH_DTYPE_F32},
    [OPSMITH_DTYPE_I32] = {"i32", 4, 0, OPSMITH_DTYPE_I64},
    [OPSMITH_DTYPE_I64] = {"i64", 8, 0, OPSMITH_DTYPE_I64},
};
_Static_assert(sizeof dtypes / sizeof dtypes[0] == OPSMITH_DTYPE_COUNT,
               "dtypes must describe every opsmith_dtype");

const char *opsmith_dtype_name(opsmith_dtype dtype) {
    return (unsigned)dtype < OPSMITH_DTYPE_COUNT ? dtypes[dtype].name : "?";
}

size_t opsmith_dtype_size(opsmith_dtype dtype) {
    return (unsigned)dtype < OPSMITH_DTYPE_COUNT ? dtypes[dtype].size : 0;
}

int opsmith_dtype_is_float(opsmith_dtype dtype) {
    return (unsigned)dtype < OPSMITH_DTYPE_COUNT ? dtypes[dtype].is_float : 0;
}

opsmith_dtype opsmith_dtype_accumulate(opsmith_dtype dtype) {
    return (unsigned)dtype < OPSMITH_DTYPE_COUNT ? dtypes[dtype].accumulate : OPSMITH_DTYPE_F32;
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
    case OPSMITH_DTYPE_I32: return ((const int32_t *)base)[index];
    case OPSMITH_DTYPE_I64: return (double)((const int64_t *)base)[index];
    default: return 0.0 / 0.0;
    }
}

void opsmith_store_from_double(opsmith_dtype dtype, void *base, int64_t index, double value) {
    switch (dtype) {
    case OPSMITH_DTYPE_F64: ((double *)base)[index] = value; break;
    case OPSMITH_DTYPE_F32: ((float *)base)[index] = (float)value; break;
    case OPSMITH_DTYPE_F16: ((uint16_t *)base)[index] = opsmith_f32_to_f16(float_round_to_odd(value)); break;
    case OPSMITH_DTYPE_BF16: ((uint16_t *)base)[index] = opsmith_f32_to_bf16(float_round_to_odd(value)); break;
    case OPSMITH_DTYPE_I32: ((int32_t *)base)[index] = (int32_t)value; break;
    case OPSMITH_DTYPE_I64: ((int64_t *)base)[index] = (int64_t)value; break;
    default: break;
    }
}

/* Per-thread message of the last failing call, so concurrent callers on
 * different threads do not read each other's errors. */
static _Thread_local char last_error[512];

opsmith_status opsmith_internal_fail(opsmith_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

void opsmith_internal_clear_error(void) { last_error[0] = '\0'; }

void opsmith_internal_set_cuda_error(const char *message) {
    snprintf(last_error, sizeof last_error, "CUDA error: %s", message ? message : "(no message)");
}

const char *opsmith_last_error(void) { return last_error; }

int opsmith_internal_misaligned(const void *p, size_t alignment) {
    return p && alignment > 1 && (uintptr_t)p % alignment != 0;
}

opsmith_status opsmith_internal_check_workspace(const char *op, const void *workspace, size_t workspace_bytes,
                                                size_t needed) {
    if (needed == 0) return OPSMITH_STATUS_SUCCESS;
    if (!workspace)
        return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT, "%s: workspace is NULL, %zu bytes are needed",
                                     op, needed);
    if (workspace_bytes < needed)
        return opsmith_internal_fail(OPSMITH_STATUS_WORKSPACE_TOO_SMALL,
                                     "%s: workspace_bytes (%zu) is smaller than the %zu bytes needed", op,
                                     workspace_bytes, needed);
    if (opsmith_internal_misaligned(workspace, OPSMITH_WORKSPACE_ALIGNMENT))
        return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: workspace (%p) is not aligned to %d bytes", op,
                                     workspace, OPSMITH_WORKSPACE_ALIGNMENT);
    return OPSMITH_STATUS_SUCCESS;
}

/* 0 = the OpenMP runtime's default. Thread-local: a caller sets it for
 * the launches it makes itself (the torch bridge, from at::get_num_threads()). */
static _Thread_local int cpu_threads;

void opsmith_set_num_threads(int n) { cpu_threads = n > 0 ? n : 0; }

int opsmith_internal_threads_for(int64_t work) {
    const int t = opsmith_get_num_threads();
    const int64_t useful = work / OPSMITH_CPU_GRAIN + 1;
    return useful < t ? (int)useful : t;
}

int opsmith_get_num_threads(void) {
    if (cpu_threads > 0) return cpu_threads;
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}
