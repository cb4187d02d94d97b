/* fused_linear_cross_entropy on the CPU: C11 + OpenMP. Over chunks of tokens:
 * the chunk's logits (cache-blocked: a block of weight rows against every
 * token of the chunk), cross_entropy's own CPU kernel on them (loss per row,
 * the logit gradient written over them), then dhidden (a token a task) and
 * the dweight/dbias accumulators (a block of vocabulary rows a task, so each
 * accumulator element has one owner and a fixed summation order: results do
 * not depend on the thread count). 16-bit weight is widened once a call, a
 * chunk of hidden once a chunk; products and accumulators in the accumulate
 * type (float; double for f64). The mean's scale is applied when the
 * gradients are stored. Formulas in include/opsmith/fused_linear_cross_entropy.h. */
#include <math.h>
#include <string.h>

#include "convert.h"
#include "internal/cross_entropy.h"
#include "internal/fused_linear_cross_entropy.h"

#define LANES 8
#define VBLOCK 16 /* weight rows a task */

/* widen n values of a 16-bit or f32 dtype to float */
static void widen_f(opsmith_dtype dtype, const void *src, int64_t n, float *dst) {
    const uint16_t *h = src;
    switch (dtype) {
    case OPSMITH_DTYPE_F32: memcpy(dst, src, sizeof(float) * (size_t)n); break;
    case OPSMITH_DTYPE_F16: for (int64_t i = 0; i < n; i++) dst[i] = opsmith_f16_to_f32(h[i]); break;
    default: for (int64_t i = 0; i < n; i++) dst[i] = opsmith_bf16_to_f32(h[i]); break;
    }
}

static void narrow_f(opsmith_dtype dtype, const float *src, int64_t n, float scale, void *dst) {
    uint16_t *h = dst;
    switch (dtype) {
    case OPSMITH_DTYPE_F32: for (int64_t i = 0; i < n; i++) ((float *)dst)[i] = src[i] * scale; break;
    case OPSMITH_DTYPE_F16: for (int64_t i = 0; i < n; i++) h[i] = opsmith_f32_to_f16(src[i] * scale); break;
    default: for (int64_t i = 0; i < n; i++) h[i] = opsmith_f32_to_bf16(src[i] * scale); break;
    }
}

static void widen_d(opsmith_dtype dtype, const void *src, int64_t n, double *dst) {
    (void)dtype;
    memcpy(dst, src, sizeof(double) * (size_t)n);
}

static void narrow_d(opsmith_dtype dtype, const double *src, int64_t n, double scale, void *dst) {
    (void)dtype;
    for (int64_t i = 0; i < n; i++) ((double *)dst)[i] = src[i] * scale;
}

/* ACC: float (f32, f16, bf16) or double (f64). h: (c, dim) rows of stride hs
 * in ACC; w: (vocab, dim) in ACC; logits (c, vocab) and dl in dtype. */
#define DEFINE_FLCE(S, ACC)                                                                                        \
    static ACC dot_##S(const ACC *a, const ACC *b, int64_t n) {                                                   \
        ACC lane[LANES] = {0};                                                                                    \
        int64_t k = 0;                                                                                            \
        for (; k + LANES <= n; k += LANES)                                                                        \
            for (int j = 0; j < LANES; j++) lane[j] += a[k + j] * b[k + j];                                       \
        ACC s = 0;                                                                                                \
        for (; k < n; k++) s += a[k] * b[k];                                                                      \
        for (int j = 0; j < LANES; j++) s += lane[j];                                                             \
        return s;                                                                                                 \
    }                                                                                                             \
                                                                                                                  \
    /* out[t][r] = dot(h_t, w_r) for 2 rows of h and 4 of w: every load of h                                   \
     * serves 4 products and every load of w 2 (the lanes stay in registers) */                                   \
    static void dots2x4_##S(const ACC *h0, const ACC *h1, const ACC *w, int64_t dim, ACC out[2][4]) {           \
        ACC a[2][4][LANES];                                                                                       \
        for (int t = 0; t < 2; t++)                                                                               \
            for (int r = 0; r < 4; r++)                                                                           \
                for (int j = 0; j < LANES; j++) a[t][r][j] = 0;                                                   \
        const ACC *w0 = w, *w1 = w + dim, *w2 = w + 2 * dim, *w3 = w + 3 * dim;                                   \
        int64_t k = 0;                                                                                            \
        for (; k + LANES <= dim; k += LANES)                                                                      \
            for (int j = 0; j < LANES; j++) {                                                                     \
                const ACC x0 = h0[k + j], x1 = h1[k + j];                                                         \
                a[0][0][j] += x0 * w0[k + j], a[0][1][j] += x0 * w1[k + j];                                       \
                a[0][2][j] += x0 * w2[k + j], a[0][3][j] += x0 * w3[k + j];                                       \
                a[1][0][j] += x1 * w0[k + j], a[1][1][j] += x1 * w1[k + j];                                       \
                a[1][2][j] += x1 * w2[k + j], a[1][3][j] += x1 * w3[k + j];                                       \
            }                                                                                                     \
        const ACC *hh[2] = {h0, h1}, *ww[4] = {w0, w1, w2, w3};                                                   \
        for (int t = 0; t < 2; t++)                                                                               \
            for (int r = 0; r < 4; r++) {                                                                         \
                ACC s = 0;                                                                                        \
                for (int64_t q = k; q < dim; q++) s += hh[t][q] * ww[r][q];                                       \
                for (int j = 0; j < LANES; j++) s += a[t][r][j];                                                  \
                out[t][r] = s;                                                                                    \
            }                                                                                                     \
    }                                                                                                             \
                                                                                                                  \
    static void logits_##S(opsmith_dtype dtype, int64_t c, int64_t dim, int64_t vocab, const ACC *h, int64_t hs,  \
                           const ACC *w, const void *bias, void *out, int threads) {                              \
        const size_t size = opsmith_dtype_size(dtype);                                                            \
        const int64_t blocks = (vocab + VBLOCK - 1) / VBLOCK;                                                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(c * vocab * dim > 65536)")             \
        for (int64_t b = 0; b < blocks; b++) {                                                                    \
            const int64_t v0 = b * VBLOCK, v1 = v0 + VBLOCK < vocab ? v0 + VBLOCK : vocab;                        \
            ACC bv[VBLOCK], y[2][VBLOCK], o[2][4];                                                                \
            if (bias) widen_##S(dtype, (const char *)bias + (size_t)v0 * size, v1 - v0, bv);                      \
            for (int64_t i = 0; i < c; i += 2) {                                                                  \
                const int pair = i + 1 < c;                                                                       \
                const ACC *h0 = h + i * hs, *h1 = pair ? h0 + hs : h0;                                            \
                int64_t v = v0;                                                                                   \
                for (; v + 4 <= v1; v += 4) {                                                                     \
                    dots2x4_##S(h0, h1, w + v * dim, dim, o);                                                     \
                    for (int r = 0; r < 4; r++) y[0][v - v0 + r] = o[0][r], y[1][v - v0 + r] = o[1][r];           \
                }                                                                                                 \
                for (; v < v1; v++)                                                                               \
                    y[0][v - v0] = dot_##S(h0, w + v * dim, dim), y[1][v - v0] = dot_##S(h1, w + v * dim, dim);   \
                for (int t = 0; t < 1 + pair; t++) {                                                              \
                    if (bias)                                                                                     \
                        for (int64_t q = 0; q < v1 - v0; q++) y[t][q] += bv[q];                                   \
                    narrow_##S(dtype, y[t], v1 - v0, (ACC)1, (char *)out + ((size_t)(i + t) * vocab + v0) * size); \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
    }                                                                                                             \
                                                                                                                  \
    /* dh (c, dim; ACC) = dl (c, vocab) w; stored scaled into dhidden rows */                                     \
    static void dhidden_##S(opsmith_dtype dtype, int64_t c, int64_t dim, int64_t vocab, const void *dl,           \
                            const ACC *w, ACC *dh, ACC scale, void *dhidden, int threads) {                       \
        const size_t size = opsmith_dtype_size(dtype);                                                            \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(c * vocab * dim > 65536)")             \
        for (int64_t i = 0; i < c; i++) {                                                                         \
            ACC *row = dh + i * dim;                                                                              \
            ACC g[VBLOCK];                                                                                        \
            for (int64_t k = 0; k < dim; k++) row[k] = 0;                                                         \
            for (int64_t v0 = 0; v0 < vocab; v0 += VBLOCK) {                                                      \
                const int64_t nv = v0 + VBLOCK < vocab ? VBLOCK : vocab - v0;                                     \
                widen_##S(dtype, (const char *)dl + ((size_t)i * vocab + v0) * size, nv, g);                      \
                for (int64_t j = 0; j < nv; j++) {                                                                \
                    const ACC gv = g[j];                                                                          \
                    const ACC *wr = w + (v0 + j) * dim;                                                           \
                    if (gv != 0)                                                                                  \
                        for (int64_t k = 0; k < dim; k++) row[k] += gv * wr[k];                                   \
                }                                                                                                 \
            }                                                                                                     \
            narrow_##S(dtype, row, dim, scale, (char *)dhidden + (size_t)i * dim * size);                         \
        }                                                                                                         \
    }                                                                                                             \
                                                                                                                  \
    /* dw (vocab, dim) += dl^T h; db (vocab) += column sums of dl; either may be NULL */                          \
    static void dweight_##S(opsmith_dtype dtype, int64_t c, int64_t dim, int64_t vocab, const void *dl,           \
                            const ACC *h, int64_t hs, ACC *dw, ACC *db, int threads) {                            \
        const size_t size = opsmith_dtype_size(dtype);                                                            \
        const int64_t blocks = (vocab + VBLOCK - 1) / VBLOCK;                                                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(c * vocab * dim > 65536)")             \
        for (int64_t b = 0; b < blocks; b++) {                                                                    \
            const int64_t v0 = b * VBLOCK, nv = v0 + VBLOCK < vocab ? VBLOCK : vocab - v0;                        \
            ACC g[VBLOCK];                                                                                        \
            for (int64_t i = 0; i < c; i++) {                                                                     \
                widen_##S(dtype, (const char *)dl + ((size_t)i * vocab + v0) * size, nv, g);                      \
                const ACC *hr = h + i * hs;                                                                       \
                for (int64_t j = 0; j < nv; j++) {                                                                \
                    const ACC gv = g[j];                                                                          \
                    if (db) db[v0 + j] += gv;                                                                     \
                    if (dw && gv != 0) {                                                                          \
                        ACC *wr = dw + (v0 + j) * dim;                                                            \
                        for (int64_t k = 0; k < dim; k++) wr[k] += gv * hr[k];                                    \
                    }                                                                                             \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
    }

DEFINE_FLCE(f, float)
DEFINE_FLCE(d, double)

/* The forward over the chunks in ACC (S: f or d). */
#define RUN_FLCE(S, ACC)                                                                                          \
    do {                                                                                                          \
        const ACC *w = narrow ? (const ACC *)(ws + l.wf) : (const ACC *)weight;                                   \
        if (narrow) {                                                                                             \
            ACC *wf = (ACC *)(ws + l.wf);                                                                         \
            _Pragma("omp parallel for schedule(static) num_threads(threads) if(vocab * dim > 65536)")             \
            for (int64_t v = 0; v < vocab; v++)                                                                   \
                widen_##S(dtype, (const char *)weight + (size_t)v * dim * size, dim, wf + v * dim);               \
        }                                                                                                         \
        ACC *dw = dweight ? (ACC *)(ws + l.dweight) : NULL, *db = dbias ? (ACC *)(ws + l.dbias) : NULL;           \
        if (dw) memset(dw, 0, sizeof(ACC) * (size_t)vocab * (size_t)dim);                                         \
        if (db) memset(db, 0, sizeof(ACC) * (size_t)vocab);                                                       \
        ACC total = 0, z_total = 0;                                                                               \
        const ACC scale = red == OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN ? (denom > 0 ? (ACC)1 / (ACC)denom : (ACC)0) \
                                                                       : (ACC)1;                                  \
        for (int64_t r0 = 0; r0 < rows; r0 += chunk) {                                                            \
            const int64_t c = r0 + chunk < rows ? chunk : rows - r0;                                              \
            const ACC *h;                                                                                         \
            int64_t hs;                                                                                           \
            if (narrow) {                                                                                         \
                ACC *hf = (ACC *)(ws + l.hf);                                                                     \
                for (int64_t i = 0; i < c; i++)                                                                   \
                    widen_##S(dtype, (const char *)hidden + (size_t)(r0 + i) * hrs * size, dim, hf + i * dim);    \
                h = hf, hs = dim;                                                                                 \
            } else {                                                                                              \
                h = (const ACC *)hidden + r0 * hrs, hs = hrs;                                                     \
            }                                                                                                     \
            logits_##S(dtype, c, dim, vocab, h, hs, w, bias, logits, threads);                                    \
            double scratch = 0;                                                                                   \
            opsmith_status st = opsmith_cross_entropy_fwd_cpu(                                                    \
                dtype, c, vocab, logits, vocab, target + r0 * target_stride, target_stride, NULL, ignore_index,   \
                label_smoothing, z_loss, softcap, OPSMITH_CROSS_ENTROPY_REDUCTION_SUM, &scratch, NULL, NULL,      \
                grads ? logits : NULL, vocab, NULL, ws + l.ce, l.ce_bytes);                                       \
            if (st != OPSMITH_STATUS_SUCCESS) return st;                                                          \
            const ACC *per_row = (const ACC *)(ws + l.ce);                                                        \
            for (int64_t i = 0; i < c; i++) total += per_row[i], z_total += per_row[c + i];                       \
            if (dhidden)                                                                                          \
                dhidden_##S(dtype, c, dim, vocab, logits, w, (ACC *)(ws + l.dh), scale,                           \
                            (char *)dhidden + (size_t)r0 * dim * size, threads);                                  \
            if (dw || db) dweight_##S(dtype, c, dim, vocab, logits, h, hs, dw, db, threads);                      \
        }                                                                                                         \
        const ACC d = red == OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN ? (ACC)denom : (ACC)1;                          \
        *(ACC *)loss = total / d;                                                                                 \
        if (z_out) *(ACC *)z_out = z_total / d;                                                                   \
        if (dw) narrow_##S(dtype, dw, vocab * dim, scale, dweight);                                               \
        if (db) narrow_##S(dtype, db, vocab, scale, dbias);                                                       \
    } while (0)

opsmith_status opsmith_fused_linear_cross_entropy_fwd_cpu(
    opsmith_dtype dtype, int64_t rows, int64_t dim, int64_t vocab, const void *hidden, int64_t hidden_row_stride,
    const void *weight, const void *bias, const int64_t *target, int64_t target_stride, int64_t ignore_index,
    double label_smoothing, double z_loss, double softcap, opsmith_cross_entropy_reduction reduction,
    int64_t chunk_rows, int fp32_dweight, void *loss, void *z_out, void *dhidden, void *dweight, void *dbias,
    int64_t *error, void *workspace, size_t workspace_bytes) {
    const char *op = "fused_linear_cross_entropy_fwd_cpu";
    int64_t chunk = chunk_rows;
    opsmith_status s = opsmith_internal_flce_check(op, dtype, rows, dim, vocab, hidden, hidden_row_stride, weight,
                                                   bias, target, label_smoothing, z_loss, softcap, (int)reduction,
                                                   &chunk, fp32_dweight, loss, dhidden, dweight, dbias, error, 0,
                                                   workspace, workspace_bytes);
    if (s != OPSMITH_STATUS_SUCCESS) return s;
    /* targets checked and the mean's denominator counted before anything is written */
    int64_t denom = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = target[r * target_stride];
        if (t == ignore_index) continue;
        if (t < 0 || t >= vocab) {
            if (error) error[0] = 1, error[1] = r, error[2] = t;
            return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT,
                                         "%s: target %lld (row %lld) is out of range [0, %lld) and not ignore_index "
                                         "(%lld)",
                                         op, (long long)t, (long long)r, (long long)vocab, (long long)ignore_index);
        }
        denom++;
    }
    const opsmith_flce_layout l = opsmith_internal_flce_layout(dtype, rows, dim, vocab, chunk, fp32_dweight, 0);
    if (chunk > rows) chunk = rows > 0 ? rows : 1;
    char *ws = workspace;
    void *logits = ws + l.logits;
    const int threads = opsmith_get_num_threads(), narrow = opsmith_dtype_size(dtype) == 2;
    const int grads = dhidden || dweight || dbias;
    const size_t size = opsmith_dtype_size(dtype);
    const int64_t hrs = hidden_row_stride;
    const int red = (int)reduction;
    if (dtype == OPSMITH_DTYPE_F64)
        RUN_FLCE(d, double);
    else
        RUN_FLCE(f, float);
    return OPSMITH_STATUS_SUCCESS;
}
