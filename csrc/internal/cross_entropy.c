/* cross_entropy argument validation, shared by the CPU and CUDA launchers. */
#include <float.h>
#include <math.h>

#include "internal/cross_entropy.h"

/* Byte range [lo, hi) of a (rows, n) tensor with a row stride. */
typedef struct span {
    uintptr_t lo, hi;
} span;

static span span_of(const void *p, int64_t rows, int64_t n, int64_t stride, size_t size) {
    span s = {(uintptr_t)p, (uintptr_t)p + (size_t)((rows - 1) * stride + n) * size};
    return s;
}

static int overlap(span a, span b) { return a.lo < b.hi && b.lo < a.hi; }

size_t opsmith_cross_entropy_fwd_workspace_size(opsmith_dtype dtype, int64_t rows, double z_loss) {
    /* loss per row, z-loss per row when there is one, the mean's denominator
     * and the weights' sum; in the accumulate type */
    const size_t acc = dtype == OPSMITH_DTYPE_F64 ? 8 : 4;
    const size_t per_row = z_loss > 0.0 ? 2 : 1;
    const size_t bytes = (per_row * (size_t)(rows > 0 ? rows : 0) + 2) * acc;
    return (bytes + OPSMITH_WORKSPACE_ALIGNMENT - 1) / OPSMITH_WORKSPACE_ALIGNMENT * OPSMITH_WORKSPACE_ALIGNMENT;
}

opsmith_status opsmith_internal_cross_entropy_check_options(const char *op, opsmith_dtype dtype, double ls,
                                                           double z_loss, double softcap) {
    const opsmith_status bad = OPSMITH_STATUS_INVALID_ARGUMENT;
    if (!(ls >= 0.0 && ls <= 1.0))
        return opsmith_internal_fail(bad, "%s: label_smoothing (%g) must be in [0, 1]", op, ls);
    if (!(z_loss >= 0.0 && isfinite(z_loss)))
        return opsmith_internal_fail(bad, "%s: z_loss (%g) must be finite and >= 0", op, z_loss);
    if (!(softcap >= 0.0 && isfinite(softcap)))
        return opsmith_internal_fail(bad, "%s: softcap (%g) must be finite and > 0 (or 0: none)", op, softcap);
    /* narrowed to float where the arithmetic is in float: a finite double past
     * FLT_MAX becomes inf, one under FLT_MIN a subnormal whose reciprocal is inf */
    if (dtype == OPSMITH_DTYPE_F64) return OPSMITH_STATUS_SUCCESS;
    if (softcap != 0.0 && !(softcap >= FLT_MIN && softcap <= FLT_MAX))
        return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT,
                                     "%s: softcap (%g) must be 0 or within float's normal range [%g, %g] for %s "
                                     "logits (their arithmetic is in float)",
                                     op, softcap, (double)FLT_MIN, (double)FLT_MAX, opsmith_dtype_name(dtype));
    if (!(z_loss <= FLT_MAX))
        return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT,
                                     "%s: z_loss (%g) must be <= %g for %s logits (their arithmetic is in float)", op,
                                     z_loss, (double)FLT_MAX, opsmith_dtype_name(dtype));
    return OPSMITH_STATUS_SUCCESS;
}

static opsmith_status check_float(const char *op, opsmith_dtype dtype, int64_t rows, int64_t n) {
    if ((unsigned)dtype >= OPSMITH_DTYPE_COUNT || !opsmith_dtype_is_float(dtype))
        return opsmith_internal_fail(OPSMITH_STATUS_UNSUPPORTED_DTYPE,
                                     "%s: dtype must be f64, f32, f16 or bf16, got %s (%d)", op,
                                     opsmith_dtype_name(dtype), (int)dtype);
    if (rows < 0) return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT, "%s: rows (%lld) must be >= 0", op, (long long)rows);
    if (n < 1) return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT, "%s: n (%lld) must be >= 1", op, (long long)n);
    return OPSMITH_STATUS_SUCCESS;
}

opsmith_status opsmith_internal_cross_entropy_fwd_check(const char *op, opsmith_dtype dtype, int64_t rows, int64_t n,
                                                        const void *logits, int64_t logits_row_stride,
                                                        const int64_t *target, double ls, double z_loss,
                                                        double softcap, int reduction, opsmith_dtype loss_dtype,
                                                        const void *loss, const void *dlogits,
                                                        int64_t dlogits_row_stride, const int64_t *error,
                                                        int need_error, const void *workspace, size_t workspace_bytes,
                                                        const void *weight, const void *z_out, const void *lse) {
    const opsmith_status bad = OPSMITH_STATUS_INVALID_ARGUMENT;
    opsmith_internal_clear_error();
    opsmith_status s = check_float(op, dtype, rows, n);
    if (s != OPSMITH_STATUS_SUCCESS) return s;
    if ((s = opsmith_internal_cross_entropy_check_options(op, dtype, ls, z_loss, softcap)) != OPSMITH_STATUS_SUCCESS)
        return s;
    if (reduction < OPSMITH_CROSS_ENTROPY_REDUCTION_NONE || reduction > OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN)
        return opsmith_internal_fail(bad, "%s: reduction (%d) must be 0 (none), 1 (sum) or 2 (mean)", op, reduction);
    if (loss_dtype != dtype && loss_dtype != opsmith_dtype_accumulate(dtype))
        return opsmith_internal_fail(bad,
                                     "%s: loss_dtype (%s) must be the logits' dtype (%s) or its accumulate type (%s)",
                                     op, opsmith_dtype_name(loss_dtype), opsmith_dtype_name(dtype),
                                     opsmith_dtype_name(opsmith_dtype_accumulate(dtype)));
    if (!loss && (rows > 0 || reduction != OPSMITH_CROSS_ENTROPY_REDUCTION_NONE))
        return opsmith_internal_fail(bad, "%s: loss is NULL", op);
    if (need_error && !error) return opsmith_internal_fail(bad, "%s: error is NULL", op);
    {
        const size_t ls_size = opsmith_dtype_size(loss_dtype), acc = opsmith_dtype_size(opsmith_dtype_accumulate(dtype));
        const struct { const char *name; const void *p; size_t align; } ptrs[] = {
            {"loss", loss, ls_size}, {"z_out", z_out, ls_size}, {"lse", lse, acc}, {"weight", weight, acc},
            {"error", error, 8},
        };
        for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
            if (opsmith_internal_misaligned(ptrs[i].p, ptrs[i].align))
                return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: %s (%p) is not aligned to %zu bytes", op,
                                             ptrs[i].name, ptrs[i].p, ptrs[i].align);
    }
    s = opsmith_internal_check_workspace(op, workspace, workspace_bytes,
                                         opsmith_cross_entropy_fwd_workspace_size(dtype, rows, z_loss));
    if (s != OPSMITH_STATUS_SUCCESS) return s;
    if (rows == 0) return OPSMITH_STATUS_SUCCESS;
    if (!logits) return opsmith_internal_fail(bad, "%s: logits is NULL", op);
    if (!target) return opsmith_internal_fail(bad, "%s: target is NULL", op);
    if (rows > 1 && logits_row_stride < n)
        return opsmith_internal_fail(bad, "%s: logits_row_stride (%lld) must be >= n (%lld) when rows > 1", op,
                                     (long long)logits_row_stride, (long long)n);
    if (dlogits && rows > 1 && dlogits_row_stride < n)
        return opsmith_internal_fail(bad, "%s: dlogits_row_stride (%lld) must be >= n (%lld) when rows > 1", op,
                                     (long long)dlogits_row_stride, (long long)n);
    const size_t size = opsmith_dtype_size(dtype);
    if (opsmith_internal_misaligned(logits, size))
        return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: logits (%p) is not aligned to %zu bytes", op,
                                     logits, size);
    if (opsmith_internal_misaligned(dlogits, size))
        return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: dlogits (%p) is not aligned to %zu bytes", op,
                                     dlogits, size);
    if (opsmith_internal_misaligned(target, 8))
        return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: target (%p) is not aligned to 8 bytes", op,
                                     (const void *)target);
    if (dlogits && overlap(span_of(dlogits, rows, n, dlogits_row_stride, size),
                           span_of(logits, rows, n, logits_row_stride, size)) &&
        !(dlogits == logits && dlogits_row_stride == logits_row_stride))
        return opsmith_internal_fail(bad, "%s: dlogits overlaps logits; it may only be logits itself (same pointer and row stride)", op);
    return OPSMITH_STATUS_SUCCESS;
}

opsmith_status opsmith_internal_cross_entropy_bwd_check(const char *op, opsmith_dtype dtype, int64_t rows, int64_t n,
                                                        opsmith_dtype grad_dtype, const void *grad,
                                                        int64_t grad_stride, const void *dlogits,
                                                        int64_t dlogits_row_stride, const void *dx,
                                                        int64_t dx_row_stride) {
    const opsmith_status bad = OPSMITH_STATUS_INVALID_ARGUMENT;
    opsmith_internal_clear_error();
    opsmith_status s = check_float(op, dtype, rows, n);
    if (s != OPSMITH_STATUS_SUCCESS) return s;
    if (grad_stride != 0 && grad_stride != 1)
        return opsmith_internal_fail(bad, "%s: grad_stride (%lld) must be 0 or 1", op, (long long)grad_stride);
    if (grad_dtype != dtype && grad_dtype != opsmith_dtype_accumulate(dtype))
        return opsmith_internal_fail(bad,
                                     "%s: grad_dtype (%s) must be the logits' dtype (%s) or its accumulate type (%s)",
                                     op, opsmith_dtype_name(grad_dtype), opsmith_dtype_name(dtype),
                                     opsmith_dtype_name(opsmith_dtype_accumulate(dtype)));
    if (rows == 0) return OPSMITH_STATUS_SUCCESS;
    if (!grad) return opsmith_internal_fail(bad, "%s: grad is NULL", op);
    if (!dlogits) return opsmith_internal_fail(bad, "%s: dlogits is NULL", op);
    if (!dx) return opsmith_internal_fail(bad, "%s: dx is NULL", op);
    if (rows > 1 && (dlogits_row_stride < n || dx_row_stride < n))
        return opsmith_internal_fail(bad, "%s: %s (%lld) must be >= n (%lld) when rows > 1", op,
                                     dlogits_row_stride < n ? "dlogits_row_stride" : "dx_row_stride",
                                     (long long)(dlogits_row_stride < n ? dlogits_row_stride : dx_row_stride),
                                     (long long)n);
    const size_t size = opsmith_dtype_size(dtype);
    const struct { const char *name; const void *p; size_t size; } ptrs[] = {
        {"grad", grad, opsmith_dtype_size(grad_dtype)}, {"dlogits", dlogits, size}, {"dx", dx, size}};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
        if (opsmith_internal_misaligned(ptrs[i].p, ptrs[i].size))
            return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: %s (%p) is not aligned to %zu bytes", op,
                                         ptrs[i].name, ptrs[i].p, ptrs[i].size);
    if (overlap(span_of(dx, rows, n, dx_row_stride, size), span_of(dlogits, rows, n, dlogits_row_stride, size)) &&
        !(dx == dlogits && dx_row_stride == dlogits_row_stride))
        return opsmith_internal_fail(bad, "%s: dx overlaps dlogits; it may only be dlogits itself (same pointer and row stride)", op);
    return OPSMITH_STATUS_SUCCESS;
}
