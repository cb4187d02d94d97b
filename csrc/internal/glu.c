/* Gated-activation argument validation, shared by the CPU and CUDA launchers. */
#include "internal/glu.h"

const char *opsmith_glu_activation_name(opsmith_glu_activation activation) {
    static const char *const names[] = {"silu", "gelu", "gelu_tanh"};
    _Static_assert(sizeof names / sizeof names[0] == OPSMITH_GLU_ACTIVATION_COUNT,
                   "one name per opsmith_glu_activation");
    return (unsigned)activation < OPSMITH_GLU_ACTIVATION_COUNT ? names[activation] : "?";
}

/* One (rows, n) operand: name, pointer, row stride. */
typedef struct operand {
    const char *name;
    const void *p;
    int64_t stride;
} operand;

/* 1 when a and b (both (rows, n), elements of `size` bytes) share no
 * element. Beyond disjoint byte ranges this accepts interleaved rows: with
 * one row stride S and b starting m elements (mod S) after a, rows of n
 * elements miss each other when n <= m and n <= S - m (the packed halves). */
static int apart(const operand *a, const operand *b, int64_t rows, int64_t n, size_t size) {
    const uintptr_t alo = (uintptr_t)a->p, blo = (uintptr_t)b->p;
    const uintptr_t ahi = alo + (size_t)((rows - 1) * a->stride + n) * size;
    const uintptr_t bhi = blo + (size_t)((rows - 1) * b->stride + n) * size;
    if (ahi <= blo || bhi <= alo) return 1;
    if (rows == 1 || a->stride != b->stride || a->stride <= 0) return 0;
    const uintptr_t lo = alo < blo ? alo : blo, hi = alo < blo ? blo : alo;
    if ((hi - lo) % size) return 0;
    const int64_t m = (int64_t)(((hi - lo) / size) % (uintptr_t)a->stride);
    return n <= m && n <= a->stride - m;
}

static int exactly(const operand *a, const operand *b) { return a->p == b->p && a->stride == b->stride; }

opsmith_status opsmith_internal_glu_check(const char *op, opsmith_glu_activation activation, opsmith_dtype dtype,
                                          int64_t rows, int64_t n, int backward, const void *dy,
                                          int64_t dy_row_stride, const void *gate, int64_t gate_row_stride,
                                          const void *up, int64_t up_row_stride, const void *out,
                                          int64_t out_row_stride, const void *dup, int64_t dup_row_stride,
                                          const void *h, int64_t h_row_stride) {
    const opsmith_status bad = OPSMITH_STATUS_INVALID_ARGUMENT;
    opsmith_internal_clear_error();
    if ((unsigned)activation >= OPSMITH_GLU_ACTIVATION_COUNT)
        return opsmith_internal_fail(bad, "%s: activation must be silu (0), gelu (1) or gelu_tanh (2), got %d", op,
                                     (int)activation);
    if ((unsigned)dtype >= OPSMITH_DTYPE_COUNT || !opsmith_dtype_is_float(dtype))
        return opsmith_internal_fail(OPSMITH_STATUS_UNSUPPORTED_DTYPE,
                                     "%s: dtype must be f64, f32, f16 or bf16, got %s (%d)", op,
                                     opsmith_dtype_name(dtype), (int)dtype);
    if (rows < 0) return opsmith_internal_fail(bad, "%s: rows (%lld) must be >= 0", op, (long long)rows);
    if (n < 1) return opsmith_internal_fail(bad, "%s: n (%lld) must be >= 1", op, (long long)n);
    if (rows == 0) return OPSMITH_STATUS_SUCCESS;
    const operand inputs[] = {
        {"gate", gate, gate_row_stride}, {"up", up, up_row_stride}, {"dy", dy, dy_row_stride}};
    const operand outputs[] = {
        {backward ? "dgate" : "y", out, out_row_stride}, {"dup", dup, dup_row_stride}, {"h", h, h_row_stride}};
    const int n_inputs = backward ? 3 : 2, n_outputs = backward ? 3 : 1;
    for (int i = 0; i < n_inputs; i++)
        if (!inputs[i].p) return opsmith_internal_fail(bad, "%s: %s is NULL", op, inputs[i].name);
    for (int i = 0; i < n_outputs - (backward ? 1 : 0); i++) /* h alone may be NULL */
        if (!outputs[i].p) return opsmith_internal_fail(bad, "%s: %s is NULL", op, outputs[i].name);
    const size_t size = opsmith_dtype_size(dtype);
    /* rows may share storage (stride 0) only when there is one row;
     * otherwise a row must not overlap the next */
    for (int k = 0; k < n_inputs + n_outputs; k++) {
        const operand *t = k < n_inputs ? &inputs[k] : &outputs[k - n_inputs];
        if (!t->p) continue;
        if (rows > 1 && t->stride < n)
            return opsmith_internal_fail(bad, "%s: %s_row_stride (%lld) must be >= n (%lld) when rows > 1", op,
                                         t->name, (long long)t->stride, (long long)n);
        if (opsmith_internal_misaligned(t->p, size))
            return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: %s (%p) is not aligned to %zu bytes", op,
                                         t->name, t->p, size);
    }
    for (int o = 0; o < n_outputs; o++) {
        const operand *t = &outputs[o];
        if (!t->p) continue;
        /* for each input: exactly it (in place) or apart from it */
        for (int i = 0; i < n_inputs; i++)
            if (!exactly(t, &inputs[i]) && !apart(t, &inputs[i], rows, n, size))
                return opsmith_internal_fail(
                    bad, "%s: %s overlaps %s; an output may only be an input itself (same pointer and row stride) "
                    "or apart from it", op, t->name, inputs[i].name);
        for (int p = 0; p < o; p++)
            if (outputs[p].p && !apart(t, &outputs[p], rows, n, size))
                return opsmith_internal_fail(bad, "%s: %s overlaps %s; outputs must be apart", op, t->name,
                                             outputs[p].name);
    }
    return OPSMITH_STATUS_SUCCESS;
}
