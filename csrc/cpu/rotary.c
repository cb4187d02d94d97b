/* Rotary position embedding on the CPU: C11 + OpenMP over the (batch, seq)
 * rows. Each row converts its cos/sin (a tile of pairs at a time) into the
 * math type once and applies them to every head of q and of k, so cos/sin
 * are read once per (b, s) whatever the head counts. The pairs of a tile are
 * widened into arrays, rotated, and narrowed back: every element of a head
 * is read before any of it is written, so the in-place form (an output that
 * is exactly its input) is safe. Dims [rotary_dim, head_dim) are copied
 * through (not touched in place). */
#include <string.h>

#include "convert.h"
#include "cpu_load_store.h" /* LOAD_<DT>, STORE_<DT>: float16 branch-free, so the tile loops vectorize */
#include "internal/rotary.h"

#include "cpu_clones.h"

#define TILE 128 /* pairs a tile */

static double load_cs(opsmith_dtype dt, const void *p, int64_t i) {
    switch (dt) {
    case OPSMITH_DTYPE_F64: return ((const double *)p)[i];
    case OPSMITH_DTYPE_F32: return ((const float *)p)[i];
    case OPSMITH_DTYPE_F16: return opsmith_f16_to_f32(((const uint16_t *)p)[i]);
    default: return opsmith_bf16_to_f32(((const uint16_t *)p)[i]);
    }
}

/* Index of the first and second element of pair i. */
static inline int64_t pair_a(int interleaved, int64_t half, int64_t i) { (void)half; return interleaved ? 2 * i : i; }
static inline int64_t pair_b(int interleaved, int64_t half, int64_t i) { return interleaved ? 2 * i + 1 : i + half; }

/* One head's pairs [i0, i0 + m): out[a] = x[a] ca - x[b] sa, out[b] = x[b] cb + x[a] sb
 * (the backward's sines arrive already swapped and negated). */
#define DEFINE_ROPE(NAME, T, ACC, LOAD, STORE)                                                       \
    OPSMITH_CPU_CLONES static void rope_tile_##NAME(int interleaved, int64_t half, int64_t i0, int m,       \
                                             const T *x, T *out, const ACC *ca, const ACC *sa,       \
                                             const ACC *cb, const ACC *sb) {                         \
        ACC xa[TILE], xb[TILE];                                                                      \
        if (interleaved) {                                                                           \
            _Pragma("omp simd")                                                                      \
            for (int i = 0; i < m; i++) xa[i] = LOAD(x[2 * (i0 + i)]), xb[i] = LOAD(x[2 * (i0 + i) + 1]); \
        } else {                                                                                     \
            _Pragma("omp simd")                                                                      \
            for (int i = 0; i < m; i++) xa[i] = LOAD(x[i0 + i]), xb[i] = LOAD(x[i0 + half + i]);     \
        }                                                                                            \
        _Pragma("omp simd")                                                                          \
        for (int i = 0; i < m; i++) {                                                                \
            const ACC a = xa[i], b = xb[i];                                                          \
            xa[i] = a * ca[i] - b * sa[i];                                                           \
            xb[i] = b * cb[i] + a * sb[i];                                                           \
        }                                                                                            \
        if (interleaved) {                                                                           \
            _Pragma("omp simd")                                                                      \
            for (int i = 0; i < m; i++) out[2 * (i0 + i)] = STORE(xa[i]), out[2 * (i0 + i) + 1] = STORE(xb[i]); \
        } else {                                                                                     \
            _Pragma("omp simd")                                                                      \
            for (int i = 0; i < m; i++) out[i0 + i] = STORE(xa[i]), out[i0 + half + i] = STORE(xb[i]); \
        }                                                                                            \
    }

DEFINE_ROPE(f64, double, double, LOAD_F64, STORE_F64)
DEFINE_ROPE(f32, float, float, LOAD_F32, STORE_F32)
DEFINE_ROPE(f16, uint16_t, float, LOAD_F16, STORE_F16)
DEFINE_ROPE(bf16, uint16_t, float, LOAD_BF16, STORE_BF16)

/* The operands of q or k in one struct, for the row loop. */
typedef struct side {
    const char *in;
    char *out;
    const opsmith_rotary_view *vi, *vo;
} side;

/* Every head of both sides for one (b, s) row, through tiles of pairs. ACC
 * is double for f64, float otherwise. */
#define DEFINE_ROW(NAME, T, ACC)                                                                     \
    static void rope_row_##NAME(const opsmith_rotary_params *p, int backward, int64_t b, int64_t s,  \
                                const side *sides, int nsides, const char *cosr, const char *sinr) { \
        const int interleaved = p->style == OPSMITH_ROTARY_STYLE_INTERLEAVED;                        \
        const int64_t half = p->rotary_dim / 2;                                                      \
        const size_t es = sizeof(T);                                                                 \
        ACC ca[TILE], sa[TILE], cb[TILE], sb[TILE];                                                  \
        for (int64_t i0 = 0; i0 < half; i0 += TILE) {                                                \
            const int m = half - i0 < TILE ? (int)(half - i0) : TILE;                                \
            for (int i = 0; i < m; i++) {                                                            \
                const int64_t a = pair_a(interleaved, half, i0 + i), bb = pair_b(interleaved, half, i0 + i); \
                const ACC sav = (ACC)load_cs(p->cs_dtype, sinr, a), sbv = (ACC)load_cs(p->cs_dtype, sinr, bb); \
                ca[i] = (ACC)load_cs(p->cs_dtype, cosr, a);                                          \
                cb[i] = (ACC)load_cs(p->cs_dtype, cosr, bb);                                         \
                /* the transpose: out[a] = x[a] ca + x[b] sb, out[b] = x[b] cb - x[a] sa */          \
                sa[i] = backward ? -sbv : sav;                                                       \
                sb[i] = backward ? -sav : sbv;                                                       \
            }                                                                                        \
            for (int k = 0; k < nsides; k++) {                                                       \
                const side *t = &sides[k];                                                           \
                for (int64_t h = 0; h < t->vi->heads; h++) {                                         \
                    const T *x = (const T *)(t->in + (b * t->vi->batch_stride + s * t->vi->seq_stride + \
                                                      h * t->vi->head_stride) * (int64_t)es);        \
                    T *o = (T *)(t->out + (b * t->vo->batch_stride + s * t->vo->seq_stride +         \
                                           h * t->vo->head_stride) * (int64_t)es);                   \
                    rope_tile_##NAME(interleaved, half, i0, m, x, o, ca, sa, cb, sb);                \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        if (p->rotary_dim == p->head_dim) return;                                                    \
        for (int k = 0; k < nsides; k++) {                                                           \
            const side *t = &sides[k];                                                               \
            for (int64_t h = 0; h < t->vi->heads; h++) {                                             \
                const char *x = t->in + (b * t->vi->batch_stride + s * t->vi->seq_stride +           \
                                         h * t->vi->head_stride + p->rotary_dim) * (int64_t)es;      \
                char *o = t->out + (b * t->vo->batch_stride + s * t->vo->seq_stride +                \
                                    h * t->vo->head_stride + p->rotary_dim) * (int64_t)es;           \
                if (o != x) memcpy(o, x, (size_t)(p->head_dim - p->rotary_dim) * es);                \
            }                                                                                        \
        }                                                                                            \
    }

DEFINE_ROW(f64, double, double)
DEFINE_ROW(f32, float, float)
DEFINE_ROW(f16, uint16_t, float)
DEFINE_ROW(bf16, uint16_t, float)

typedef void (*row_fn)(const opsmith_rotary_params *, int, int64_t, int64_t, const side *, int, const char *,
                       const char *);

static opsmith_status rope_cpu(const char *op, int backward, const opsmith_rotary_params *p, const void *q,
                               void *q_out, const void *k, void *k_out, const void *cos, const void *sin,
                               const int64_t *position_ids) {
    opsmith_status st = opsmith_internal_rotary_check(op, backward, p, q, q_out, k, k_out, cos, sin, position_ids);
    if (st != OPSMITH_STATUS_SUCCESS || p->batch == 0 || p->seq == 0) return st;
    if (position_ids) /* on the host: a bad position is an error, before anything is written */
        for (int64_t b = 0; b < p->batch; b++)
            for (int64_t s = 0; s < p->seq; s++) {
                const int64_t pos = position_ids[b * p->pos_batch_stride + s * p->pos_seq_stride];
                if (pos < 0 || pos >= p->max_pos)
                    return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT,
                                                 "%s: position_ids[%lld, %lld] = %lld is outside [0, max_pos = %lld)",
                                                 op, (long long)b, (long long)s, (long long)pos,
                                                 (long long)p->max_pos);
            }
    static const row_fn ROW[4] = {rope_row_f64, rope_row_f32, rope_row_f16, rope_row_bf16};
    const row_fn fn = ROW[p->dtype];
    const side sides[2] = {{(const char *)q, (char *)q_out, &p->q, &p->q_out},
                           {(const char *)k, (char *)k_out, &p->k, &p->k_out}};
    const int nsides = k ? 2 : 1;
    const size_t cs_es = opsmith_dtype_size(p->cs_dtype);
    const int64_t rows = p->batch * p->seq;
    const int64_t heads = p->q.heads + (k ? p->k.heads : 0);
    const int threads = opsmith_internal_threads_for(rows * heads * p->head_dim);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t b = r / p->seq, s = r % p->seq;
        const int64_t off = position_ids ? position_ids[b * p->pos_batch_stride + s * p->pos_seq_stride] *
                                               p->cs_seq_stride
                                         : b * p->cs_batch_stride + s * p->cs_seq_stride;
        fn(p, backward, b, s, sides, nsides, (const char *)cos + off * (int64_t)cs_es,
           (const char *)sin + off * (int64_t)cs_es);
    }
    return OPSMITH_STATUS_SUCCESS;
}

opsmith_status opsmith_rotary_fwd_cpu(const opsmith_rotary_params *p, const void *q, void *q_out, const void *k,
                                      void *k_out, const void *cos, const void *sin, const int64_t *position_ids) {
    return rope_cpu("rotary_fwd_cpu", 0, p, q, q_out, k, k_out, cos, sin, position_ids);
}

opsmith_status opsmith_rotary_bwd_cpu(const opsmith_rotary_params *p, const void *dq_out, void *dq,
                                      const void *dk_out, void *dk, const void *cos, const void *sin,
                                      const int64_t *position_ids) {
    return rope_cpu("rotary_bwd_cpu", 1, p, dq_out, dq, dk_out, dk, cos, sin, position_ids);
}
