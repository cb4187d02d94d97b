/* LayerNorm argument validation, shared by the CPU and CUDA launchers. */
#include "internal/layer_norm.h"

#include <string.h>


static int is_float(opsmith_dtype d) { return (unsigned)d < OPSMITH_DTYPE_COUNT && opsmith_dtype_is_float(d); }

opsmith_status opsmith_internal_layer_norm_check(const opsmith_layer_norm_args *a) {
    const opsmith_status bad = OPSMITH_STATUS_INVALID_ARGUMENT;
    const char *op = a->op;
    const char *out_name = a->backward ? "dx" : "y";
    const int64_t rows = a->rows, n = a->n;
    opsmith_internal_clear_error();
    if (!is_float(a->x_dtype))
        return opsmith_internal_fail(OPSMITH_STATUS_UNSUPPORTED_DTYPE,
                                     "%s: x_dtype must be f64, f32, f16 or bf16, got %s (%d)", op,
                                     opsmith_dtype_name(a->x_dtype), (int)a->x_dtype);
    if (a->weight_dtype != a->x_dtype && a->weight_dtype != OPSMITH_DTYPE_F32)
        return opsmith_internal_fail(OPSMITH_STATUS_UNSUPPORTED_DTYPE,
                                     "%s: weight_dtype must be x_dtype (%s) or f32, got %s (%d)", op,
                                     opsmith_dtype_name(a->x_dtype), opsmith_dtype_name(a->weight_dtype),
                                     (int)a->weight_dtype);
    if (rows < 0) return opsmith_internal_fail(bad, "%s: rows (%lld) must be >= 0", op, (long long)rows);
    if (n < 1) return opsmith_internal_fail(bad, "%s: n (%lld) must be >= 1", op, (long long)n);
    if (!(a->eps >= 0.0)) /* also rejects NaN */
        return opsmith_internal_fail(bad, "%s: eps (%g) must be >= 0", op, a->eps);
    const size_t xsz = opsmith_dtype_size(a->x_dtype), wsz = opsmith_dtype_size(a->weight_dtype);
    const size_t acc = opsmith_dtype_size(opsmith_dtype_accumulate(a->x_dtype));
    const void *bias = a->backward ? NULL : a->bias;
    const void *dweight = a->backward ? a->dweight : NULL, *dbias = a->backward ? a->dbias : NULL;
    const void *dy = a->backward ? a->dy : NULL;
    /* before the rows == 0 return: with no rows dweight and dbias are still written (zeros) */
    const struct { const char *name; const void *p; size_t align; } ptrs[] = {
        {"x", a->x, xsz}, {"dy", dy, xsz}, {"weight", a->weight, wsz}, {"bias", bias, wsz},
        {out_name, a->out, xsz}, {"dweight", dweight, wsz}, {"dbias", dbias, wsz},
        {"mean", a->mean, acc}, {"rstd", a->rstd, acc},
    };
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
        if (opsmith_internal_misaligned(ptrs[i].p, ptrs[i].align))
            return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: %s (%p) is not aligned to %zu bytes", op,
                                         ptrs[i].name, ptrs[i].p, ptrs[i].align);
    if (rows == 0) return OPSMITH_STATUS_SUCCESS;
    if (!a->x) return opsmith_internal_fail(bad, "%s: x is NULL", op);
    if (!a->out) return opsmith_internal_fail(bad, "%s: %s is NULL", op, out_name);
    if (!a->mean) return opsmith_internal_fail(bad, "%s: mean is NULL", op);
    if (!a->rstd) return opsmith_internal_fail(bad, "%s: rstd is NULL", op);
    if (a->backward && !a->dy) return opsmith_internal_fail(bad, "%s: dy is NULL", op);
    /* rows may share storage (stride 0) only if there is one row */
    const struct { const char *name; int64_t stride; int present; } strides[] = {
        {"x_row_stride", a->x_row_stride, 1},
        {"dy_row_stride", a->dy_row_stride, a->backward},
        {a->backward ? "dx_row_stride" : "y_row_stride", a->out_row_stride, 1},
    };
    for (size_t i = 0; i < sizeof strides / sizeof strides[0]; i++)
        if (strides[i].present && rows > 1 && strides[i].stride < n)
            return opsmith_internal_fail(bad, "%s: %s (%lld) must be >= n (%lld) when rows > 1", op,
                                         strides[i].name, (long long)strides[i].stride, (long long)n);
    /* the output may be its one permitted input exactly (y = x forward,
     * dx = dy backward), and must be apart from every other tensor */
    const opsmith_span o = opsmith_internal_span(a->out, rows, n, a->out_row_stride, xsz);
    const void *may_alias = a->backward ? dy : a->x;
    const int64_t alias_stride = a->backward ? a->dy_row_stride : a->x_row_stride;
    const struct { const char *name; opsmith_span s; int present; } others[] = {
        {"x", opsmith_internal_span(a->x, rows, n, a->x_row_stride, xsz), 1},
        {"dy", dy ? opsmith_internal_span(dy, rows, n, a->dy_row_stride, xsz) : o, dy != NULL},
        {"weight", a->weight ? opsmith_internal_span(a->weight, 1, n, n, wsz) : o, a->weight != NULL},
        {"bias", bias ? opsmith_internal_span(bias, 1, n, n, wsz) : o, bias != NULL},
        {"mean", opsmith_internal_span(a->mean, 1, rows, rows, acc), 1},
        {"rstd", opsmith_internal_span(a->rstd, 1, rows, rows, acc), 1},
        {"dweight", dweight ? opsmith_internal_span(dweight, 1, n, n, wsz) : o, dweight != NULL},
        {"dbias", dbias ? opsmith_internal_span(dbias, 1, n, n, wsz) : o, dbias != NULL},
    };
    const size_t permitted = a->backward ? 1 : 0; /* others[] index of the tensor the output may be */
    for (size_t i = 0; i < sizeof others / sizeof others[0]; i++) {
        if (!others[i].present || !opsmith_internal_overlap(o, others[i].s)) continue;
        const int exact = i == permitted && a->out == may_alias && a->out_row_stride == alias_stride;
        if (!exact)
            return opsmith_internal_fail(bad, "%s: %s overlaps %s; it may only be %s itself (same pointer and row stride)",
                                         op, out_name, others[i].name, a->backward ? "dy" : "x");
    }
    /* the forward writes mean and rstd while x, weight and bias are read: apart from them and each other */
    if (!a->backward)
        for (size_t w = 4; w <= 5; w++)
            for (size_t i = 0; i < w; i++)
                if (others[i].present && opsmith_internal_overlap(others[w].s, others[i].s))
                    return opsmith_internal_fail(bad, "%s: %s overlaps %s; they must be apart", op, others[w].name,
                                                 others[i].name);
    /* dweight and dbias are written while the inputs are still read (on
     * CUDA a short batch's column blocks run beside the rows' blocks):
     * apart from every input, from dx and from each other */
    const struct { const char *name; const void *p; } grads[] = {{"dweight", dweight}, {"dbias", dbias}};
    for (size_t g = 0; g < 2; g++) {
        if (!grads[g].p) continue;
        const opsmith_span gs = opsmith_internal_span(grads[g].p, 1, n, n, wsz);
        for (size_t i = 0; i < sizeof others / sizeof others[0]; i++)
            if (others[i].present && strcmp(others[i].name, grads[g].name) != 0 &&
                opsmith_internal_overlap(gs, others[i].s))
                return opsmith_internal_fail(bad, "%s: %s overlaps %s; they must be apart", op, grads[g].name,
                                             others[i].name);
        if (opsmith_internal_overlap(gs, o))
            return opsmith_internal_fail(bad, "%s: %s overlaps %s; they must be apart", op, grads[g].name, out_name);
    }
    return OPSMITH_STATUS_SUCCESS;
}

size_t opsmith_internal_layer_norm_bwd_cpu_workspace(opsmith_dtype x_dtype, int64_t rows, int64_t n, int with_dweight,
                                                     int with_dbias) {
    /* both partial rows whenever either gradient is asked for: the loops
     * that fill them then have one shape */
    const int parts = with_dweight || with_dbias ? 2 : 0;
    if (!parts || rows <= 0 || n <= 0 || !is_float(x_dtype)) return 0;
    const int64_t chunks = opsmith_internal_layer_norm_cpu_chunks(rows);
    return (size_t)(parts * chunks * n) * opsmith_dtype_size(opsmith_dtype_accumulate(x_dtype));
}
