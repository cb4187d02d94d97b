/* softmax argument validation, shared by the CPU and CUDA launchers. */
#include "internal/softmax.h"

typedef struct span {
    uintptr_t lo, hi;
} span;

static span span_of(const void *p, int64_t rows, int64_t n, int64_t stride, size_t size) {
    span s = {(uintptr_t)p, (uintptr_t)p + (size_t)((rows - 1) * stride + n) * size};
    return s;
}

static int overlap(span a, span b) { return a.lo < b.hi && b.lo < a.hi; }

opsmith_status opsmith_internal_softmax_check(const char *op, opsmith_dtype dtype, int64_t rows, int64_t n,
                                              const void *in, int64_t in_row_stride, int backward, const void *dy,
                                              int64_t dy_row_stride, const void *out, int64_t out_row_stride) {
    const opsmith_status bad = OPSMITH_STATUS_INVALID_ARGUMENT;
    const char *in_name = backward ? "y" : "x", *out_name = backward ? "dx" : "y";
    opsmith_internal_clear_error();
    if ((unsigned)dtype >= OPSMITH_DTYPE_COUNT || !opsmith_dtype_is_float(dtype))
        return opsmith_internal_fail(OPSMITH_STATUS_UNSUPPORTED_DTYPE, "%s: dtype must be f64, f32, f16 or bf16, got %s (%d)",
                                     op, opsmith_dtype_name(dtype), (int)dtype);
    if (rows < 0) return opsmith_internal_fail(bad, "%s: rows (%lld) must be >= 0", op, (long long)rows);
    if (n < 1) return opsmith_internal_fail(bad, "%s: n (%lld) must be >= 1", op, (long long)n);
    if (rows == 0) return OPSMITH_STATUS_SUCCESS;
    if (!in) return opsmith_internal_fail(bad, "%s: %s is NULL", op, in_name);
    if (!out) return opsmith_internal_fail(bad, "%s: %s is NULL", op, out_name);
    if (backward && !dy) return opsmith_internal_fail(bad, "%s: dy is NULL", op);
    const struct { const char *name; int64_t stride; int present; } strides[] = {
        {backward ? "y_row_stride" : "x_row_stride", in_row_stride, 1},
        {"dy_row_stride", dy_row_stride, backward},
        {backward ? "dx_row_stride" : "y_row_stride", out_row_stride, 1},
    };
    for (size_t i = 0; i < sizeof strides / sizeof strides[0]; i++)
        if (strides[i].present && rows > 1 && strides[i].stride < n)
            return opsmith_internal_fail(bad, "%s: %s (%lld) must be >= n (%lld) when rows > 1", op, strides[i].name,
                                         (long long)strides[i].stride, (long long)n);
    const size_t size = opsmith_dtype_size(dtype);
    const struct { const char *name; const void *p; } ptrs[] = {{in_name, in}, {"dy", backward ? dy : NULL}, {out_name, out}};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
        if (opsmith_internal_misaligned(ptrs[i].p, size))
            return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: %s (%p) is not aligned to %zu bytes", op,
                                         ptrs[i].name, ptrs[i].p, size);
    /* the output may be its one permitted input exactly (y = x, dx = dy) */
    const span o = span_of(out, rows, n, out_row_stride, size);
    const void *may = backward ? dy : in;
    const int64_t may_stride = backward ? dy_row_stride : in_row_stride;
    const struct { const char *name; const void *p; int64_t stride; int present; } inputs[] = {
        {in_name, in, in_row_stride, 1}, {"dy", dy, dy_row_stride, backward}};
    for (size_t i = 0; i < sizeof inputs / sizeof inputs[0]; i++) {
        if (!inputs[i].present || !overlap(o, span_of(inputs[i].p, rows, n, inputs[i].stride, size))) continue;
        if (!(inputs[i].p == may && out == may && out_row_stride == may_stride))
            return opsmith_internal_fail(bad, "%s: %s overlaps %s; it may only be %s itself (same pointer and row stride)",
                                         op, out_name, inputs[i].name, backward ? "dy" : "x");
    }
    return OPSMITH_STATUS_SUCCESS;
}
