/* RMSNorm on the CPU: C11 + OpenMP over rows.
 * x, y, dy, dx are (rows, n) addressed through row strides; weight, dweight
 * are (n); inv_rms is (rows) in the accumulate type (double for f64, float
 * otherwise). A row is processed in blocks of BLOCK elements widened to the
 * accumulate type (convert_block.h), so one body serves every dtype mix and
 * its loops vectorize. Every block is read before the same block of the
 * output is written, so y = x and dx = dy (in place) compute what they
 * would apart. With a residual (csrc/cpu/fused_add_rms_norm.c) the
 * forward first stores h = x + residual and normalises h, and the backward
 * adds dh to dx: the same loops. */
#include <math.h>

#include "cpu_rows.h"
#include "internal/rms_norm.h"

#define BLOCK OPSMITH_CPU_BLOCK
/* 8 lanes (cpu_rows.h: row sums in fixed lanes) */
#define LANES 8

typedef opsmith_internal_rms_norm_cpu_fwd fwd_args;
typedef opsmith_internal_rms_norm_cpu_bwd bwd_args;

/* One body per accumulate type ACC (float, double), stamped from a macro:
 * the widen/narrow helpers of convert_block.h named by SUFFIX. */
#define DEFINE_RMS_NORM(SUFFIX, ACC)                                                              \
    static ACC sum_lanes_##SUFFIX(ACC *l) { return opsmith_lanes_total_##SUFFIX(l, LANES); }      \
                                                                                                  \
    /* lanes[i % LANES] += a[i] * b[i] over one block */                                          \
    static void add_products_##SUFFIX(ACC *lanes, const ACC *a, const ACC *b, int64_t len) {     \
        OPSMITH_LANES_ADD(LANES, lanes, len, i, a[i] * b[i]);                                     \
    }                                                                                             \
                                                                                                  \
    /* g = dy * (offset + w), or dy without a weight; a pointer to g */                           \
    static const ACC *scaled_##SUFFIX(const ACC *dy, const ACC *w, ACC offset, int64_t len, ACC *g) {\
        if (!w) return dy;                                                                        \
        for (int64_t i = 0; i < len; i++) g[i] = dy[i] * (offset + w[i]);                         \
        return g;                                                                                 \
    }                                                                                             \
                                                                                                  \
    OPSMITH_CPU_CLONES static void fwd_rows_##SUFFIX(const fwd_args *a, int64_t r0, int64_t r1) { \
        ACC xbuf[BLOCK], wbuf[BLOCK], hbuf[BLOCK], obuf[BLOCK];                                   \
        const ACC offset = (ACC)a->offset, eps = (ACC)a->eps;                                     \
        for (int64_t r = r0; r < r1; r++) {                                                       \
            const char *xr = (const char *)a->x + r * a->xs * (int64_t)opsmith_dtype_size(a->xd); \
            char *yr = (char *)a->y + r * a->ys * (int64_t)opsmith_dtype_size(a->yd);             \
            char *hr = a->res ? (char *)a->h + r * a->hs * (int64_t)opsmith_dtype_size(a->xd) : NULL;\
            ACC blocks[LANES] = {0};                                                              \
            for (int64_t b0 = 0, nb = 0; b0 < a->n; b0 += BLOCK, nb++) {                          \
                const int64_t len = a->n - b0 < BLOCK ? a->n - b0 : BLOCK;                        \
                const ACC *xb = opsmith_widen_##SUFFIX(a->xd, xr, b0, len, xbuf);                 \
                if (hr) {                                                                         \
                    /* h = x + res stored in x's dtype, then read back: the norm   */             \
                    /* sees h rounded, as after a separate add (h may be x or res) */             \
                    const char *rr = (const char *)a->res + r * a->rs * (int64_t)opsmith_dtype_size(a->xd);\
                    const ACC *rb = opsmith_widen_##SUFFIX(a->xd, rr, b0, len, wbuf);             \
                    ACC *hb = opsmith_out_##SUFFIX(a->xd, hr, b0, obuf);                          \
                    for (int64_t i = 0; i < len; i++) hb[i] = xb[i] + rb[i];                      \
                    opsmith_narrow_##SUFFIX(a->xd, hb, hr, b0, len);                              \
                    xb = opsmith_widen_##SUFFIX(a->xd, hr, b0, len, xbuf);                        \
                }                                                                                 \
                ACC lanes[LANES] = {0};                                                           \
                add_products_##SUFFIX(lanes, xb, xb, len);                                        \
                blocks[nb % LANES] += sum_lanes_##SUFFIX(lanes);                                  \
            }                                                                                     \
            const ACC inv = (ACC)1 / sqrt(sum_lanes_##SUFFIX(blocks) / (ACC)a->n + eps);          \
            ((ACC *)a->inv_rms)[r] = inv;                                                         \
            if (hr) xr = hr; /* the second pass normalises h */                                   \
            for (int64_t b0 = 0; b0 < a->n; b0 += BLOCK) {                                        \
                const int64_t len = a->n - b0 < BLOCK ? a->n - b0 : BLOCK;                        \
                const ACC *xb = opsmith_widen_##SUFFIX(a->xd, xr, b0, len, xbuf);                 \
                ACC *ob = opsmith_out_##SUFFIX(a->yd, yr, b0, obuf);                              \
                const ACC *wb = a->w ? opsmith_widen_##SUFFIX(a->wd, a->w, b0, len, wbuf) : NULL; \
                ACC scale = inv;                                                                  \
                if (a->llama) {                                                                   \
                    /* x_hat rounded to x's dtype before the weight multiply */                   \
                    for (int64_t i = 0; i < len; i++) hbuf[i] = xb[i] * inv;                      \
                    opsmith_round_##SUFFIX(a->xd, hbuf, len);                                     \
                    xb = hbuf, scale = 1;                                                         \
                }                                                                                 \
                /* element by element, so ob may be x itself (in place) */                        \
                if (wb)                                                                           \
                    for (int64_t i = 0; i < len; i++) ob[i] = xb[i] * scale * (offset + wb[i]);   \
                else                                                                              \
                    for (int64_t i = 0; i < len; i++) ob[i] = xb[i] * scale;                      \
                opsmith_narrow_##SUFFIX(a->yd, ob, yr, b0, len);                                  \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* dx for rows [r0, r1); adds dy * x_hat into partial (n) when non-NULL */                    \
    OPSMITH_CPU_CLONES static void bwd_rows_##SUFFIX(const bwd_args *a, int64_t r0, int64_t r1,   \
                                                     ACC *partial) {                              \
        ACC xbuf[BLOCK], gbuf[BLOCK], wbuf[BLOCK], sbuf[BLOCK], hbuf[BLOCK], obuf[BLOCK];         \
        const ACC offset = (ACC)a->offset;                                                        \
        const int64_t n = a->n;                                                                   \
        for (int64_t r = r0; r < r1; r++) {                                                       \
            const char *xr = (const char *)a->x + r * a->xs * (int64_t)opsmith_dtype_size(a->xd); \
            const char *dyr = (const char *)a->dy + r * a->dys * (int64_t)opsmith_dtype_size(a->gd);\
            char *dxr = (char *)a->dx + r * a->dxs * (int64_t)opsmith_dtype_size(a->xd);          \
            const ACC inv = ((const ACC *)a->inv_rms)[r];                                         \
            ACC blocks[LANES] = {0};                                                              \
            for (int64_t b0 = 0, nb = 0; b0 < n; b0 += BLOCK, nb++) {                             \
                const int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;                              \
                const ACC *xb = opsmith_widen_##SUFFIX(a->xd, xr, b0, len, xbuf);                 \
                const ACC *gb = opsmith_widen_##SUFFIX(a->gd, dyr, b0, len, gbuf);                \
                const ACC *wb = a->w ? opsmith_widen_##SUFFIX(a->wd, a->w, b0, len, wbuf) : NULL; \
                ACC lanes[LANES] = {0};                                                           \
                add_products_##SUFFIX(lanes, scaled_##SUFFIX(gb, wb, offset, len, sbuf), xb, len);\
                blocks[nb % LANES] += sum_lanes_##SUFFIX(lanes);                                  \
            }                                                                                     \
            const ACC scale = inv * inv * inv * sum_lanes_##SUFFIX(blocks) / (ACC)n;              \
            for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {                                           \
                const int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;                              \
                const ACC *xb = opsmith_widen_##SUFFIX(a->xd, xr, b0, len, xbuf);                 \
                const ACC *gb = opsmith_widen_##SUFFIX(a->gd, dyr, b0, len, gbuf);                \
                const ACC *wb = a->w ? opsmith_widen_##SUFFIX(a->wd, a->w, b0, len, wbuf) : NULL; \
                if (partial) {                                                                    \
                    /* before dx is written: dx may be dy itself */                               \
                    for (int64_t i = 0; i < len; i++) hbuf[i] = xb[i] * inv;                      \
                    if (a->llama) opsmith_round_##SUFFIX(a->xd, hbuf, len);                       \
                    for (int64_t i = 0; i < len; i++) partial[b0 + i] += gb[i] * hbuf[i];         \
                }                                                                                 \
                const ACC *sb = scaled_##SUFFIX(gb, wb, offset, len, sbuf);                       \
                ACC *ob = opsmith_out_##SUFFIX(a->xd, dxr, b0, obuf);                             \
                for (int64_t i = 0; i < len; i++) ob[i] = inv * sb[i] - xb[i] * scale;            \
                if (a->dh) {                                                                      \
                    /* the norm's dx rounded to x's dtype, then + dh: how autograd */             \
                    /* sums the two gradients of h (gbuf is free again here)      */              \
                    const char *dhr = (const char *)a->dh + r * a->dhs * (int64_t)opsmith_dtype_size(a->xd);\
                    opsmith_round_##SUFFIX(a->xd, ob, len);                                       \
                    const ACC *db = opsmith_widen_##SUFFIX(a->xd, dhr, b0, len, gbuf);            \
                    for (int64_t i = 0; i < len; i++) ob[i] += db[i];                             \
                }                                                                                 \
                opsmith_narrow_##SUFFIX(a->xd, ob, dxr, b0, len);                                 \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_RMS_NORM(f64, double)
DEFINE_RMS_NORM(f32, float)

static void fwd_rows(const fwd_args *a, int64_t r0, int64_t r1) {
    if (a->xd == OPSMITH_DTYPE_F64) fwd_rows_f64(a, r0, r1);
    else fwd_rows_f32(a, r0, r1);
}

static void bwd_rows(const bwd_args *a, int64_t r0, int64_t r1, void *partial) {
    if (a->xd == OPSMITH_DTYPE_F64) bwd_rows_f64(a, r0, r1, partial);
    else bwd_rows_f32(a, r0, r1, partial);
}

static opsmith_dtype weight_dtype_or_acc(opsmith_dtype x_dtype, opsmith_dtype weight_dtype, const void *weight) {
    return weight ? weight_dtype : opsmith_dtype_accumulate(x_dtype);
}

opsmith_status opsmith_rms_norm_ex_fwd_cpu(opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype y_dtype,
                                           int64_t rows, int64_t n, const void *x, int64_t x_row_stride,
                                           const void *weight, double offset, double eps,
                                           opsmith_rms_norm_casting casting, void *y, int64_t y_row_stride,
                                           void *inv_rms) {
    weight_dtype = weight_dtype_or_acc(x_dtype, weight_dtype, weight);
    opsmith_status s = opsmith_internal_rms_norm_check("rms_norm_fwd_cpu", x_dtype, weight_dtype, y_dtype, rows, n,
                                                       x, x_row_stride, 0, NULL, 0, weight, offset, eps, casting, y,
                                                       y_row_stride, inv_rms, NULL);
    if (s != OPSMITH_STATUS_SUCCESS || rows == 0) return s;
    const fwd_args a = {x_dtype, weight_dtype, y_dtype, rows, n, x_row_stride, y_row_stride, x, weight, y, inv_rms,
                        offset, eps, casting == OPSMITH_RMS_NORM_CASTING_LLAMA, NULL, 0, NULL, 0};
    opsmith_internal_rms_norm_cpu_fwd_run(&a);
    return OPSMITH_STATUS_SUCCESS;
}

void opsmith_internal_rms_norm_cpu_fwd_run(const fwd_args *a) {
    const int t = opsmith_internal_threads_for(a->rows * a->n);
#pragma omp parallel for schedule(static) num_threads(t)
    for (int64_t r = 0; r < a->rows; r++) fwd_rows(a, r, r + 1);
}

size_t opsmith_rms_norm_ex_bwd_cpu_workspace_size(opsmith_dtype x_dtype, opsmith_dtype weight_dtype,
                                                  opsmith_dtype dy_dtype, int64_t rows, int64_t n, const void *dy,
                                                  int64_t dy_row_stride, const void *x, int64_t x_row_stride,
                                                  const void *weight, double offset, opsmith_rms_norm_casting casting,
                                                  const void *inv_rms, void *dx, int64_t dx_row_stride,
                                                  void *dweight) {
    (void)weight_dtype, (void)dy_dtype, (void)dy, (void)dy_row_stride, (void)x, (void)x_row_stride, (void)offset;
    (void)casting, (void)inv_rms, (void)dx, (void)dx_row_stride;
    return opsmith_internal_rms_norm_bwd_cpu_workspace(x_dtype, rows, n, weight && dweight);
}

opsmith_status opsmith_rms_norm_ex_bwd_cpu(opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype dy_dtype,
                                           int64_t rows, int64_t n, const void *dy, int64_t dy_row_stride,
                                           const void *x, int64_t x_row_stride, const void *weight, double offset,
                                           opsmith_rms_norm_casting casting, const void *inv_rms, void *dx,
                                           int64_t dx_row_stride, void *dweight, void *workspace,
                                           size_t workspace_bytes) {
    static const char op[] = "rms_norm_bwd_cpu";
    void *dw = weight ? dweight : NULL;
    weight_dtype = weight_dtype_or_acc(x_dtype, weight_dtype, weight);
    opsmith_status s = opsmith_internal_rms_norm_check(op, x_dtype, weight_dtype, dy_dtype, rows, n, x, x_row_stride,
                                                       1, dy, dy_row_stride, weight, offset, 0.0, casting, dx,
                                                       dx_row_stride, inv_rms, dw);
    if (s != OPSMITH_STATUS_SUCCESS) return s;
    if (rows == 0) {
        /* no rows: the weight gradient is an empty sum */
        if (dw)
            for (int64_t i = 0; i < n; i++) opsmith_store_from_double(weight_dtype, dw, i, 0.0);
        return OPSMITH_STATUS_SUCCESS;
    }
    s = opsmith_internal_check_workspace(op, workspace, workspace_bytes,
                                         opsmith_internal_rms_norm_bwd_cpu_workspace(x_dtype, rows, n, dw != NULL));
    if (s != OPSMITH_STATUS_SUCCESS) return s;
    const bwd_args a = {x_dtype, weight_dtype, dy_dtype, rows, n, dy_row_stride, x_row_stride, dx_row_stride,
                        dy, x, weight, inv_rms, dx, offset, casting == OPSMITH_RMS_NORM_CASTING_LLAMA, NULL, 0};
    opsmith_internal_rms_norm_cpu_bwd_run(&a, dw, workspace);
    return OPSMITH_STATUS_SUCCESS;
}

void opsmith_internal_rms_norm_cpu_bwd_run(const bwd_args *a, void *dw, void *workspace) {
    const int64_t rows = a->rows, n = a->n;
    const int t = opsmith_internal_threads_for(rows * n);
    if (!dw) {
#pragma omp parallel for schedule(static) num_threads(t)
        for (int64_t r = 0; r < rows; r++) bwd_rows(a, r, r + 1, NULL);
        return;
    }
    /* dweight: each of a fixed number of row chunks sums into its own
     * workspace row, then the chunk rows are added in order, so the bits do
     * not depend on the thread count */
    const int64_t chunks = rows < OPSMITH_RMS_NORM_CPU_DWEIGHT_CHUNKS ? rows : OPSMITH_RMS_NORM_CPU_DWEIGHT_CHUNKS;
    const size_t acc = opsmith_dtype_size(opsmith_dtype_accumulate(a->xd));
#pragma omp parallel for schedule(static) num_threads(t)
    for (int64_t c = 0; c < chunks; c++) {
        char *pc = (char *)workspace + (size_t)(c * n) * acc;
        memset(pc, 0, (size_t)n * acc);
        bwd_rows(a, rows * c / chunks, rows * (c + 1) / chunks, pc);
    }
    void *outs[1] = {dw};
    const void *parts[1] = {workspace};
    opsmith_cpu_sum_chunks(a->xd, a->wd, 1, outs, parts, chunks, n, opsmith_internal_threads_for(chunks * n));
}

/* --- the one-dtype launchers ------------------------------------------------------ */

opsmith_status opsmith_rms_norm_fwd_cpu(opsmith_dtype dtype, int64_t rows, int64_t n, const void *x,
                                        int64_t x_row_stride, const void *weight, double eps, void *y,
                                        int64_t y_row_stride, void *inv_rms) {
    return opsmith_rms_norm_ex_fwd_cpu(dtype, dtype, dtype, rows, n, x, x_row_stride, weight, 0.0, eps,
                                       OPSMITH_RMS_NORM_CASTING_NONE, y, y_row_stride, inv_rms);
}

size_t opsmith_rms_norm_bwd_cpu_workspace_size(opsmith_dtype dtype, int64_t rows, int64_t n, const void *dy,
                                               int64_t dy_row_stride, const void *x, int64_t x_row_stride,
                                               const void *weight, const void *inv_rms, void *dx,
                                               int64_t dx_row_stride, void *dweight) {
    return opsmith_rms_norm_ex_bwd_cpu_workspace_size(dtype, dtype, dtype, rows, n, dy, dy_row_stride, x,
                                                      x_row_stride, weight, 0.0, OPSMITH_RMS_NORM_CASTING_NONE,
                                                      inv_rms, dx, dx_row_stride, dweight);
}

opsmith_status opsmith_rms_norm_bwd_cpu(opsmith_dtype dtype, int64_t rows, int64_t n, const void *dy,
                                        int64_t dy_row_stride, const void *x, int64_t x_row_stride,
                                        const void *weight, const void *inv_rms, void *dx, int64_t dx_row_stride,
                                        void *dweight, void *workspace, size_t workspace_bytes) {
    return opsmith_rms_norm_ex_bwd_cpu(dtype, dtype, dtype, rows, n, dy, dy_row_stride, x, x_row_stride, weight,
                                       0.0, OPSMITH_RMS_NORM_CASTING_NONE, inv_rms, dx, dx_row_stride, dweight,
                                       workspace, workspace_bytes);
}
