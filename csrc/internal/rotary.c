/* Rotary argument validation, shared by the CPU and CUDA launchers. */
#include "internal/rotary.h"

const char *opsmith_rotary_style_name(opsmith_rotary_style style) {
    static const char *const names[] = {"half", "interleaved"};
    _Static_assert(sizeof names / sizeof names[0] == OPSMITH_ROTARY_STYLE_COUNT,
                   "one name per opsmith_rotary_style");
    return (unsigned)style < OPSMITH_ROTARY_STYLE_COUNT ? names[style] : "?";
}

/* One of q, k, q_out, k_out. */
typedef struct operand {
    const char *name;
    const void *p;
    const opsmith_rotary_view *v;
} operand;

/* Lowest and one-past-highest byte a view touches (strides may be any sign). */
static void extent(const operand *t, const opsmith_rotary_params *p, size_t es, uintptr_t *lo, uintptr_t *hi) {
    const int64_t n[3] = {p->batch, p->seq, t->v->heads};
    const int64_t s[3] = {t->v->batch_stride, t->v->seq_stride, t->v->head_stride};
    int64_t mn = 0, mx = 0;
    for (int d = 0; d < 3; d++) {
        const int64_t step = (n[d] - 1) * s[d];
        if (step < 0) mn += step;
        else mx += step;
    }
    *lo = (uintptr_t)t->p + (intptr_t)(mn * (int64_t)es);
    *hi = (uintptr_t)t->p + (uintptr_t)((mx + p->head_dim) * (int64_t)es);
}

static int same_view(const opsmith_rotary_view *a, const opsmith_rotary_view *b) {
    return a->heads == b->heads && a->batch_stride == b->batch_stride && a->seq_stride == b->seq_stride &&
           a->head_stride == b->head_stride;
}

/* 1 when a and b share no element. Beyond disjoint byte ranges this accepts
 * the heads of q and k inside one fused qkv row: the same (batch, seq)
 * strides, positions on one lattice of the seq stride, and each one's heads
 * inside its own part [m, m + extent) of every row. */
static int apart(const operand *a, const operand *b, const opsmith_rotary_params *p, size_t es) {
    uintptr_t alo, ahi, blo, bhi;
    extent(a, p, es, &alo, &ahi);
    extent(b, p, es, &blo, &bhi);
    if (ahi <= alo || bhi <= blo || ahi <= blo || bhi <= alo) return 1;
    const int64_t S = a->v->seq_stride;
    if (S <= 0 || b->v->seq_stride != S) return 0;
    if (p->batch > 1 && (a->v->batch_stride != b->v->batch_stride || a->v->batch_stride % S)) return 0;
    if (a->v->head_stride < 0 || b->v->head_stride < 0) return 0;
    const uintptr_t lo = (uintptr_t)a->p < (uintptr_t)b->p ? (uintptr_t)a->p : (uintptr_t)b->p;
    const uintptr_t hi = (uintptr_t)a->p < (uintptr_t)b->p ? (uintptr_t)b->p : (uintptr_t)a->p;
    if ((hi - lo) % es) return 0;
    const int64_t m = (int64_t)(((hi - lo) / es) % (uintptr_t)S);
    const int64_t ea = (a->v->heads - 1) * a->v->head_stride + p->head_dim;
    const int64_t eb = (b->v->heads - 1) * b->v->head_stride + p->head_dim;
    const int64_t first = (uintptr_t)a->p <= (uintptr_t)b->p ? ea : eb, second = first == ea ? eb : ea;
    return first <= m && second <= S - m;
}

opsmith_status opsmith_internal_rotary_check(const char *op, int backward, const opsmith_rotary_params *p,
                                             const void *q, const void *q_out, const void *k, const void *k_out,
                                             const void *cos, const void *sin, const int64_t *position_ids) {
    const opsmith_status bad = OPSMITH_STATUS_INVALID_ARGUMENT;
    opsmith_internal_clear_error();
    if (!p) return opsmith_internal_fail(bad, "%s: params is NULL", op);
    if ((unsigned)p->style >= OPSMITH_ROTARY_STYLE_COUNT)
        return opsmith_internal_fail(bad, "%s: style must be half (0) or interleaved (1), got %d", op,
                                     (int)p->style);
    if ((unsigned)p->dtype >= OPSMITH_DTYPE_COUNT || !opsmith_dtype_is_float(p->dtype))
        return opsmith_internal_fail(OPSMITH_STATUS_UNSUPPORTED_DTYPE,
                                     "%s: dtype must be f64, f32, f16 or bf16, got %s (%d)", op,
                                     opsmith_dtype_name(p->dtype), (int)p->dtype);
    const int sixteen = p->dtype == OPSMITH_DTYPE_F16 || p->dtype == OPSMITH_DTYPE_BF16;
    if (p->cs_dtype != p->dtype && !(sixteen && p->cs_dtype == OPSMITH_DTYPE_F32))
        return opsmith_internal_fail(OPSMITH_STATUS_UNSUPPORTED_DTYPE,
                                     "%s: cs_dtype must be dtype (%s) or f32 beside f16/bf16, got %s", op,
                                     opsmith_dtype_name(p->dtype), opsmith_dtype_name(p->cs_dtype));
    if (p->batch < 0 || p->seq < 0)
        return opsmith_internal_fail(bad, "%s: batch (%lld) and seq (%lld) must be >= 0", op,
                                     (long long)p->batch, (long long)p->seq);
    if (p->head_dim < 2)
        return opsmith_internal_fail(bad, "%s: head_dim (%lld) must be >= 2", op, (long long)p->head_dim);
    if (p->rotary_dim < 2 || p->rotary_dim % 2 || p->rotary_dim > p->head_dim)
        return opsmith_internal_fail(bad, "%s: rotary_dim (%lld) must be even and in [2, head_dim (%lld)]", op,
                                     (long long)p->rotary_dim, (long long)p->head_dim);
    if ((k == NULL) != (k_out == NULL))
        return opsmith_internal_fail(bad, "%s: %s and %s must be both NULL or both non-NULL", op,
                                     backward ? "dk_out" : "k", backward ? "dk" : "k_out");
    if (p->q.heads < 1 || p->q_out.heads != p->q.heads)
        return opsmith_internal_fail(bad, "%s: q heads (%lld) must be >= 1 and equal to q_out's (%lld)", op,
                                     (long long)p->q.heads, (long long)p->q_out.heads);
    if (k && (p->k.heads < 1 || p->k_out.heads != p->k.heads))
        return opsmith_internal_fail(bad, "%s: k heads (%lld) must be >= 1 and equal to k_out's (%lld)", op,
                                     (long long)p->k.heads, (long long)p->k_out.heads);
    if (position_ids && p->max_pos < 1)
        return opsmith_internal_fail(bad, "%s: max_pos (%lld) must be >= 1 with position_ids", op,
                                     (long long)p->max_pos);
    if (p->batch == 0 || p->seq == 0) return OPSMITH_STATUS_SUCCESS;
    const operand t[4] = {{backward ? "dq_out" : "q", q, &p->q},
                          {backward ? "dq" : "q_out", q_out, &p->q_out},
                          {backward ? "dk_out" : "k", k, &p->k},
                          {backward ? "dk" : "k_out", k_out, &p->k_out}};
    const int count = k ? 4 : 2;
    const size_t es = opsmith_dtype_size(p->dtype), cs_es = opsmith_dtype_size(p->cs_dtype);
    for (int i = 0; i < count; i++) {
        if (!t[i].p) return opsmith_internal_fail(bad, "%s: %s is NULL", op, t[i].name);
        if (opsmith_internal_misaligned(t[i].p, es))
            return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: %s (%p) is not aligned to %zu bytes", op,
                                         t[i].name, t[i].p, es);
    }
    if (!cos || !sin) return opsmith_internal_fail(bad, "%s: %s is NULL", op, cos ? "sin" : "cos");
    if (opsmith_internal_misaligned(cos, cs_es) || opsmith_internal_misaligned(sin, cs_es))
        return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: cos/sin are not aligned to %zu bytes", op,
                                     cs_es);
    if (opsmith_internal_misaligned(position_ids, sizeof(int64_t)))
        return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: position_ids is not aligned to 8 bytes", op);
    /* outputs: exactly their own input (in place) or apart from every input
     * and from each other */
    for (int o = 1; o < count; o += 2) {
        for (int i = 0; i < count; i += 2) {
            const int own = i == o - 1;
            if (own && t[o].p == t[i].p && same_view(t[o].v, t[i].v)) continue;
            if (!apart(&t[o], &t[i], p, es))
                return opsmith_internal_fail(bad, "%s: %s overlaps %s; an output may only be its own input "
                                             "(same pointer and strides) or apart from every input", op,
                                             t[o].name, t[i].name);
        }
    }
    if (count == 4 && !apart(&t[1], &t[3], p, es))
        return opsmith_internal_fail(bad, "%s: %s overlaps %s; outputs must be apart", op, t[1].name, t[3].name);
    return OPSMITH_STATUS_SUCCESS;
}
