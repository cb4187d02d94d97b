/* RMSNorm argument validation, shared by the CPU and CUDA launchers. */
#include <math.h>

#include "internal/rms_norm.h"


static int is_half(opsmith_dtype d) { return d == OPSMITH_DTYPE_F16 || d == OPSMITH_DTYPE_BF16; }

/* The header's combinations: one dtype, or 16-bit x with an f32 weight and
 * an output (y, or dy in the backward) in x's dtype or f32. */
static int supported(opsmith_dtype x, opsmith_dtype w, opsmith_dtype out, int has_weight) {
    if (!has_weight) w = x == OPSMITH_DTYPE_F64 ? x : OPSMITH_DTYPE_F32;
    if (x == w && w == out) return 1;
    return is_half(x) && w == OPSMITH_DTYPE_F32 && (out == x || out == OPSMITH_DTYPE_F32);
}

opsmith_status opsmith_internal_rms_norm_check(const char *op, opsmith_dtype x_dtype, opsmith_dtype weight_dtype,
                                               opsmith_dtype out_dtype, int64_t rows, int64_t n, const void *x,
                                               int64_t x_row_stride, int backward, const void *dy,
                                               int64_t dy_row_stride, const void *weight, double offset, double eps,
                                               opsmith_rms_norm_casting casting, const void *out,
                                               int64_t out_row_stride, const void *inv_rms, const void *dweight) {
    return opsmith_internal_rms_norm_check_named(op, "x", x_dtype, weight_dtype, out_dtype, rows, n, x, x_row_stride,
                                                 backward, dy, dy_row_stride, weight, offset, eps, casting, out,
                                                 out_row_stride, inv_rms, dweight);
}

opsmith_status opsmith_internal_rms_norm_check_named(const char *op, const char *x_name, opsmith_dtype x_dtype,
                                                     opsmith_dtype weight_dtype, opsmith_dtype out_dtype, int64_t rows,
                                                     int64_t n, const void *x, int64_t x_row_stride, int backward,
                                                     const void *dy, int64_t dy_row_stride, const void *weight,
                                                     double offset, double eps, opsmith_rms_norm_casting casting,
                                                     const void *out, int64_t out_row_stride, const void *inv_rms,
                                                     const void *dweight) {
    const opsmith_status bad = OPSMITH_STATUS_INVALID_ARGUMENT;
    const char *out_name = backward ? "dx" : "y";
    const char *out_dtype_name = backward ? "dy_dtype" : "y_dtype";
    opsmith_internal_clear_error();
    const struct { const char *name; opsmith_dtype d; int present; } dtypes[] = {
        {"x_dtype", x_dtype, 1}, {"weight_dtype", weight_dtype, weight != NULL}, {out_dtype_name, out_dtype, 1},
    };
    for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++)
        if (dtypes[i].present && ((unsigned)dtypes[i].d >= OPSMITH_DTYPE_COUNT || !opsmith_dtype_is_float(dtypes[i].d)))
            return opsmith_internal_fail(OPSMITH_STATUS_UNSUPPORTED_DTYPE,
                                         "%s: %s must be f64, f32, f16 or bf16, got %s (%d)", op, dtypes[i].name,
                                         opsmith_dtype_name(dtypes[i].d), (int)dtypes[i].d);
    if (!supported(x_dtype, weight_dtype, out_dtype, weight != NULL))
        return opsmith_internal_fail(OPSMITH_STATUS_UNSUPPORTED_DTYPE,
                                     "%s: x_dtype %s, weight_dtype %s, %s %s is not a supported combination "
                                     "(one dtype; or f16/bf16 x, f32 weight, %s x's or f32)",
                                     op, opsmith_dtype_name(x_dtype), weight ? opsmith_dtype_name(weight_dtype) : "none",
                                     out_dtype_name, opsmith_dtype_name(out_dtype), out_dtype_name);
    if ((unsigned)casting >= OPSMITH_RMS_NORM_CASTING_COUNT)
        return opsmith_internal_fail(bad, "%s: casting (%d) must be NONE, LLAMA or GEMMA", op, (int)casting);
    if (!isfinite(offset)) return opsmith_internal_fail(bad, "%s: offset (%g) must be finite", op, offset);
    if (offset != 0.0 && !weight)
        return opsmith_internal_fail(bad, "%s: offset (%g) needs a weight (weight is NULL)", op, offset);
    if (rows < 0) return opsmith_internal_fail(bad, "%s: rows (%lld) must be >= 0", op, (long long)rows);
    if (n < 1) return opsmith_internal_fail(bad, "%s: n (%lld) must be >= 1", op, (long long)n);
    if (!(eps >= 0.0)) /* also rejects NaN */
        return opsmith_internal_fail(bad, "%s: eps (%g) must be >= 0", op, eps);
    const size_t x_size = opsmith_dtype_size(x_dtype), w_size = opsmith_dtype_size(weight_dtype);
    const size_t o_size = opsmith_dtype_size(out_dtype);
    /* the sizes of y (forward) or dy (backward), and of the output written */
    const size_t dy_size = backward ? o_size : x_size, out_size = backward ? x_size : o_size;
    const size_t acc_size = opsmith_dtype_size(opsmith_dtype_accumulate(x_dtype));
    /* before the rows == 0 return: with no rows dweight is still written (zeros) */
    const struct { const char *name; const void *p; size_t align; } ptrs[] = {
        {x_name, x, x_size}, {"dy", dy, dy_size}, {"weight", weight, w_size}, {out_name, out, out_size},
        {"dweight", dweight, w_size}, {"inv_rms", inv_rms, acc_size},
    };
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
        if (opsmith_internal_misaligned(ptrs[i].p, ptrs[i].align))
            return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: %s (%p) is not aligned to %zu bytes",
                                         op, ptrs[i].name, ptrs[i].p, ptrs[i].align);
    if (rows == 0) return OPSMITH_STATUS_SUCCESS;
    if (!x) return opsmith_internal_fail(bad, "%s: %s is NULL", op, x_name);
    if (!out) return opsmith_internal_fail(bad, "%s: %s is NULL", op, out_name);
    if (!inv_rms) return opsmith_internal_fail(bad, "%s: inv_rms is NULL", op);
    if (backward && !dy) return opsmith_internal_fail(bad, "%s: dy is NULL", op);
    /* rows may share storage (stride 0, as in an expanded tensor) only if
     * there is one row; otherwise a row must not overlap the next */
    const struct { const char *name; int64_t stride; int present; } strides[] = {
        {x_name, x_row_stride, 1},
        {"dy", dy_row_stride, backward},
        {out_name, out_row_stride, 1},
    };
    for (size_t i = 0; i < sizeof strides / sizeof strides[0]; i++)
        if (strides[i].present && rows > 1 && strides[i].stride < n)
            return opsmith_internal_fail(bad, "%s: %s_row_stride (%lld) must be >= n (%lld) when rows > 1", op,
                                         strides[i].name, (long long)strides[i].stride, (long long)n);
    /* the output may be its one permitted input exactly (y = x forward,
     * dx = dy backward) when the two have one dtype, and must be apart from
     * every other */
    const opsmith_span o = opsmith_internal_span(out, rows, n, out_row_stride, out_size);
    const void *may_alias = backward ? dy : x;
    const int64_t alias_stride = backward ? dy_row_stride : x_row_stride;
    const int same_dtype = out_dtype == x_dtype; /* y and x, or dx and dy */
    const struct { const char *name; opsmith_span s; int present; } inputs[] = {
        {x_name, opsmith_internal_span(x, rows, n, x_row_stride, x_size), 1},
        {"dy", backward ? opsmith_internal_span(dy, rows, n, dy_row_stride, dy_size) : o, backward},
        {"weight", weight ? opsmith_internal_span(weight, 1, n, n, w_size) : o, weight != NULL},
    };
    const size_t permitted = backward ? 1 : 0; /* inputs[] index of the tensor the output may be */
    for (size_t i = 0; i < sizeof inputs / sizeof inputs[0]; i++) {
        if (!inputs[i].present || !opsmith_internal_overlap(o, inputs[i].s)) continue;
        const int exact = i == permitted && same_dtype && out == may_alias && out_row_stride == alias_stride;
        if (!exact)
            return opsmith_internal_fail(bad, "%s: %s overlaps %s; it may only be %s itself (same pointer, row stride and dtype)",
                                         op, out_name, inputs[i].name, backward ? "dy" : x_name);
    }
    /* the forward writes inv_rms while x and the weight are read and y written */
    if (!backward) {
        const opsmith_span r = opsmith_internal_span(inv_rms, 1, rows, rows, acc_size);
        const struct { const char *name; opsmith_span s; int present; } apart[] = {
            {x_name, inputs[0].s, 1}, {"weight", inputs[2].s, weight != NULL}, {out_name, o, 1},
        };
        for (size_t i = 0; i < sizeof apart / sizeof apart[0]; i++)
            if (apart[i].present && opsmith_internal_overlap(r, apart[i].s))
                return opsmith_internal_fail(bad, "%s: inv_rms overlaps %s; they must be apart", op, apart[i].name);
    }
    /* dweight is written while the inputs are still read (on CUDA a short
     * batch's column blocks run beside the rows' blocks): apart from all */
    if (backward && weight && dweight) {
        const opsmith_span dw = opsmith_internal_span(dweight, 1, n, n, w_size);
        const struct { const char *name; opsmith_span s; } read[] = {
            {x_name, inputs[0].s}, {"dy", inputs[1].s}, {"weight", inputs[2].s}, {out_name, o},
            {"inv_rms", opsmith_internal_span(inv_rms, 1, rows, rows, acc_size)},
        };
        for (size_t i = 0; i < sizeof read / sizeof read[0]; i++)
            if (opsmith_internal_overlap(dw, read[i].s))
                return opsmith_internal_fail(bad, "%s: dweight overlaps %s; they must be apart", op, read[i].name);
    }
    return OPSMITH_STATUS_SUCCESS;
}

size_t opsmith_internal_rms_norm_bwd_cpu_workspace(opsmith_dtype x_dtype, int64_t rows, int64_t n, int with_dweight) {
    if (!with_dweight || rows <= 0 || n <= 0 || (unsigned)x_dtype >= OPSMITH_DTYPE_COUNT) return 0;
    const int64_t chunks = rows < OPSMITH_RMS_NORM_CPU_DWEIGHT_CHUNKS ? rows : OPSMITH_RMS_NORM_CPU_DWEIGHT_CHUNKS;
    return (size_t)(chunks * n) * opsmith_dtype_size(opsmith_dtype_accumulate(x_dtype));
}

const char *opsmith_rms_norm_casting_name(opsmith_rms_norm_casting casting) {
    static const char *const names[] = {"none", "llama", "gemma"};
    _Static_assert(sizeof names / sizeof names[0] == OPSMITH_RMS_NORM_CASTING_COUNT, "a name for every casting");
    return (unsigned)casting < OPSMITH_RMS_NORM_CASTING_COUNT ? names[casting] : "?";
}
