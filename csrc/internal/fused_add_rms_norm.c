/* Residual-add RMSNorm argument validation, shared by the CPU and CUDA
 * launchers; the norm's own arguments go through RMSNorm's checks. */
#include "internal/fused_add_rms_norm.h"

typedef struct tensor_arg {
    const char *name;
    const void *p;
    int64_t stride;
} tensor_arg;

/* a (rows, n) tensor of element size `size`: present, rows apart, aligned */
static opsmith_status check_rows(const char *op, tensor_arg t, int64_t rows, int64_t n, size_t size) {
    if (!t.p) return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT, "%s: %s is NULL", op, t.name);
    if (rows > 1 && t.stride < n)
        return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT,
                                     "%s: %s_row_stride (%lld) must be >= n (%lld) when rows > 1", op, t.name,
                                     (long long)t.stride, (long long)n);
    if (opsmith_internal_misaligned(t.p, size))
        return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: %s (%p) is not aligned to %zu bytes", op,
                                     t.name, t.p, size);
    return OPSMITH_STATUS_SUCCESS;
}

/* out must be apart from t, or (may_be_same) t itself: same pointer and stride */
static opsmith_status check_apart(const char *op, tensor_arg out, size_t out_size, tensor_arg t, size_t t_size,
                                  int64_t rows, int64_t n, int may_be_same) {
    if (!t.p || !out.p) return OPSMITH_STATUS_SUCCESS;
    const opsmith_span a = opsmith_internal_span(out.p, rows, n, out.stride, out_size);
    const opsmith_span b = opsmith_internal_span(t.p, rows, n, t.stride, t_size);
    if (!opsmith_internal_overlap(a, b)) return OPSMITH_STATUS_SUCCESS;
    if (may_be_same && out.p == t.p && out.stride == t.stride && out_size == t_size) return OPSMITH_STATUS_SUCCESS;
    return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT, "%s: %s overlaps %s%s", op, out.name, t.name,
                                 may_be_same ? "; it may only be it exactly (same pointer and row stride)"
                                             : "; they must be apart");
}

opsmith_status opsmith_internal_fused_add_rms_norm_fwd_check(
    const char *op, opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype y_dtype, int64_t rows,
    int64_t n, const void *x, int64_t x_row_stride, const void *residual, int64_t residual_row_stride,
    const void *weight, double offset, double eps, opsmith_rms_norm_casting casting, const void *y,
    int64_t y_row_stride, const void *h, int64_t h_row_stride, const void *inv_rms) {
    opsmith_status s = opsmith_internal_rms_norm_check(op, x_dtype, weight_dtype, y_dtype, rows, n, x, x_row_stride,
                                                       0, NULL, 0, weight, offset, eps, casting, y, y_row_stride,
                                                       inv_rms, NULL);
    if (s != OPSMITH_STATUS_SUCCESS || rows == 0) return s;
    const size_t xs = opsmith_dtype_size(x_dtype), ys = opsmith_dtype_size(y_dtype);
    const tensor_arg tx = {"x", x, x_row_stride}, tr = {"residual", residual, residual_row_stride};
    const tensor_arg th = {"h", h, h_row_stride}, ty = {"y", y, y_row_stride};
    const tensor_arg tw = {"weight", weight, n};
    if ((s = check_rows(op, tr, rows, n, xs)) != OPSMITH_STATUS_SUCCESS) return s;
    if ((s = check_rows(op, th, rows, n, xs)) != OPSMITH_STATUS_SUCCESS) return s;
    /* every block of h is computed from the same block of x and residual
     * before it is stored, so h may be either of them; y is computed from h */
    if ((s = check_apart(op, th, xs, tx, xs, rows, n, 1)) != OPSMITH_STATUS_SUCCESS) return s;
    if ((s = check_apart(op, th, xs, tr, xs, rows, n, 1)) != OPSMITH_STATUS_SUCCESS) return s;
    if (weight && (s = check_apart(op, th, xs, tw, opsmith_dtype_size(weight_dtype), 1, n, 0)) != OPSMITH_STATUS_SUCCESS)
        return s;
    if ((s = check_apart(op, ty, ys, tr, xs, rows, n, 0)) != OPSMITH_STATUS_SUCCESS) return s;
    return check_apart(op, ty, ys, th, xs, rows, n, 0);
}

opsmith_status opsmith_internal_fused_add_rms_norm_bwd_check(
    const char *op, opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype dy_dtype, int64_t rows,
    int64_t n, const void *dy, int64_t dy_row_stride, const void *dh, int64_t dh_row_stride, const void *h,
    int64_t h_row_stride, const void *weight, double offset, opsmith_rms_norm_casting casting,
    const void *inv_rms, const void *dx, int64_t dx_row_stride, const void *dweight) {
    opsmith_status s = opsmith_internal_rms_norm_check_named(op, "h", x_dtype, weight_dtype, dy_dtype, rows, n, h,
                                                             h_row_stride, 1, dy, dy_row_stride, weight, offset, 0.0,
                                                             casting, dx, dx_row_stride, inv_rms, dweight);
    if (s != OPSMITH_STATUS_SUCCESS || rows == 0 || !dh) return s;
    const size_t xs = opsmith_dtype_size(x_dtype);
    const tensor_arg tdh = {"dh", dh, dh_row_stride}, tdx = {"dx", dx, dx_row_stride};
    if ((s = check_rows(op, tdh, rows, n, xs)) != OPSMITH_STATUS_SUCCESS) return s;
    /* dh is read after dx's block is computed, so dx must not be dh */
    return check_apart(op, tdx, xs, tdh, xs, rows, n, 0);
}
