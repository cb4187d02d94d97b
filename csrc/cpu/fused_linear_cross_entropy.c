/* fused_linear_cross_entropy on the CPU: C11 + OpenMP. Over chunks of tokens:
 * the chunk's logits (h W^T), cross_entropy's own CPU kernel on them (loss
 * per row, the logit gradient written over them), then dhidden (dl W) and
 * the dweight/dbias accumulators (dl^T h added once a chunk). The three
 * products are cpu_gemm.h's packed, register-blocked GEMM, whose every
 * output element is one owner's fixed-order sum, and the chunks run in
 * order, so results do not depend on the thread count. 16-bit operands are
 * widened by the GEMM as it packs them (bf16 pairs multiplied directly on
 * AVX512-BF16 CPUs): no widened copies; products and accumulators in the
 * accumulate type (float; double for f64). The mean's scale is applied when
 * the gradients are stored, in dtype or (OPSMITH_FLCE_GRADS_FLOAT32)
 * float32. Formulas in include/opsmith/fused_linear_cross_entropy.h. */
#include <math.h>
#include <string.h>

#include "convert.h"
#include "cpu_gemm.h"
#include "internal/cross_entropy.h"
#include "internal/fused_linear_cross_entropy.h"

#define VBLOCK 64 /* vocabulary entries a dbias task */

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

/* The chunk's three products, each one opsmith_cpu_gemm (cpu_gemm.h) call,
 * which widens 16-bit operands as it packs them (or multiplies bf16 pairs
 * directly where the CPU can). ACC: float (f32, f16, bf16) or double (f64);
 * GEMM: its f32 or f64 product. h: (c, dim) rows of stride hs, w: (vocab,
 * dim), logits and dl (the logit gradient written over them): (c, vocab),
 * all in dtype. */
#define DEFINE_FLCE(S, ACC, ACC_DTYPE, GEMM)                                                                      \
    /* logits = h w^T (+ bias), rounded once to dtype */                                                          \
    static void logits_##S(opsmith_dtype dtype, int64_t c, int64_t dim, int64_t vocab, const void *h, int64_t hs, \
                           const void *w, const void *bias, void *out, int threads) {                             \
        const opsmith_gemm_operand a = {h, dtype, hs, 1}, b = {w, dtype, 1, dim};                                 \
        const opsmith_gemm_out o = {out, dtype, vocab, 1.0, bias, dtype, 0};                                      \
        GEMM(c, vocab, dim, a, b, &o, threads);                                                                   \
    }                                                                                                             \
                                                                                                                  \
    /* dhidden rows (of dh_dtype) = scale * (dl w) */                                                             \
    static void dhidden_##S(opsmith_dtype dtype, int64_t c, int64_t dim, int64_t vocab, const void *dl,           \
                            const void *w, ACC scale, void *dhidden, opsmith_dtype dh_dtype, int threads) {       \
        const opsmith_gemm_operand a = {dl, dtype, vocab, 1}, b = {w, dtype, dim, 1};                             \
        const opsmith_gemm_out o = {dhidden, dh_dtype, dim, (double)scale, NULL, dh_dtype, 0};                    \
        GEMM(c, dim, vocab, a, b, &o, threads);                                                                   \
    }                                                                                                             \
                                                                                                                  \
    /* dw (vocab, dim; of dw_dtype) = [dw +] alpha (dl^T h) (the chunk's sum, added once); db (vocab) += column  \
     * sums of dl (a block of vocabulary a task, rows in order); either may be NULL */                            \
    static void dweight_##S(opsmith_dtype dtype, int64_t c, int64_t dim, int64_t vocab, const void *dl,           \
                            const void *h, int64_t hs, void *dw, opsmith_dtype dw_dtype, ACC alpha, int add,      \
                            ACC *db, int threads) {                                                               \
        if (dw) {                                                                                                 \
            const opsmith_gemm_operand a = {dl, dtype, 1, vocab}, b = {h, dtype, hs, 1};                          \
            const opsmith_gemm_out o = {dw, dw_dtype, dim, (double)alpha, NULL, dw_dtype, add};                   \
            GEMM(vocab, dim, c, a, b, &o, threads);                                                               \
        }                                                                                                         \
        if (!db) return;                                                                                          \
        const size_t size = opsmith_dtype_size(dtype);                                                            \
        const int64_t blocks = (vocab + VBLOCK - 1) / VBLOCK;                                                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(c * vocab > 65536)")                   \
        for (int64_t bk = 0; bk < blocks; bk++) {                                                                 \
            const int64_t v0 = bk * VBLOCK, nv = v0 + VBLOCK < vocab ? VBLOCK : vocab - v0;                       \
            ACC g[VBLOCK];                                                                                        \
            for (int64_t i = 0; i < c; i++) {                                                                     \
                widen_##S(dtype, (const char *)dl + ((size_t)i * vocab + v0) * size, nv, g);                      \
                for (int64_t j = 0; j < nv; j++) db[v0 + j] += g[j];                                              \
            }                                                                                                     \
        }                                                                                                         \
    }

#define ACC_DTYPE_f OPSMITH_DTYPE_F32
#define ACC_DTYPE_d OPSMITH_DTYPE_F64
DEFINE_FLCE(f, float, OPSMITH_DTYPE_F32, opsmith_cpu_gemm_f32)
DEFINE_FLCE(d, double, OPSMITH_DTYPE_F64, opsmith_cpu_gemm_f64)

/* The forward over the chunks in ACC (S: f or d). */
#define RUN_FLCE(S, ACC)                                                                                          \
    do {                                                                                                          \
        /* dweight itself accumulates when it holds ACC or there is one chunk (the mean's scale applied to each  \
         * chunk's sum); else the ACC accumulator, narrowed with the scale at the end. gd: the gradients' dtype */ \
        const opsmith_dtype gd = opsmith_internal_flce_grad_dtype(dtype, fp32_dweight);                           \
        const size_t gsize = opsmith_dtype_size(gd);                                                              \
        const int dw_direct = gsize == sizeof(ACC) || chunk >= rows;                                              \
        void *dw = !dweight ? NULL : dw_direct ? dweight : (void *)(ws + l.dweight);                              \
        const opsmith_dtype dw_dtype = dw_direct ? gd : ACC_DTYPE_##S;                                            \
        ACC *db = dbias ? (ACC *)(ws + l.dbias) : NULL;                                                           \
        if (db) memset(db, 0, sizeof(ACC) * (size_t)vocab);                                                       \
        ACC total = 0, z_total = 0;                                                                               \
        const ACC scale = red == OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN ? (denom > 0 ? (ACC)1 / (ACC)denom : (ACC)0) \
                                                                       : (ACC)1;                                  \
        for (int64_t r0 = 0; r0 < rows; r0 += chunk) {                                                            \
            const int64_t c = r0 + chunk < rows ? chunk : rows - r0;                                              \
            const void *h = (const char *)hidden + (size_t)r0 * hrs * size;                                       \
            logits_##S(dtype, c, dim, vocab, h, hrs, weight, bias, logits, threads);                                    \
            double scratch = 0;                                                                                   \
            opsmith_status st = opsmith_cross_entropy_fwd_cpu(                                                    \
                dtype, c, vocab, logits, vocab, target + r0 * target_stride, target_stride, NULL, ignore_index,   \
                label_smoothing, z_loss, softcap, OPSMITH_CROSS_ENTROPY_REDUCTION_SUM, dtype, &scratch, NULL, NULL, \
                grads ? logits : NULL, vocab, NULL, ws + l.ce, l.ce_bytes);                                       \
            if (st != OPSMITH_STATUS_SUCCESS) return st;                                                          \
            const ACC *per_row = (const ACC *)(ws + l.ce);                                                        \
            const ACC *z_rows = (const ACC *)opsmith_internal_cross_entropy_z_rows(ws + l.ce, c, z_loss, sizeof(ACC)); \
            for (int64_t i = 0; i < c; i++) total += per_row[i], z_total += z_rows ? z_rows[i] : (ACC)0;          \
            if (dhidden)                                                                                          \
                dhidden_##S(dtype, c, dim, vocab, logits, weight, scale, (char *)dhidden + (size_t)r0 * dim * gsize, \
                            gd, threads);                                                                         \
            if (dw || db)                                                                                         \
                dweight_##S(dtype, c, dim, vocab, logits, h, hrs, dw, dw_dtype, dw_direct ? scale : (ACC)1, r0 > 0,  \
                            db, threads);                                                                         \
        }                                                                                                         \
        const ACC d = red == OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN ? (ACC)denom : (ACC)1;                          \
        *(ACC *)loss = total / d;                                                                                 \
        if (z_out) *(ACC *)z_out = z_total / d;                                                                   \
        if (dw && !dw_direct) narrow_##S(gd, (const ACC *)dw, vocab * dim, scale, dweight);                       \
        if (dw && rows == 0) memset(dweight, 0, gsize * (size_t)vocab * (size_t)dim);                             \
        if (db) narrow_##S(gd, db, vocab, scale, dbias);                                                          \
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
                                                   &chunk, fp32_dweight, loss, z_out, dhidden, dweight, dbias, error, 0,
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
    const int threads = opsmith_get_num_threads();
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
