/* LayerNorm on the CPU: C11 + OpenMP over rows.
 * x, y, dy, dx are (rows, n) addressed through row strides; weight, bias,
 * dweight, dbias are (n); mean and rstd are (rows) in the accumulate type
 * (double for f64 x, float otherwise). A row is processed in blocks of
 * OPSMITH_CPU_BLOCK elements widened to the accumulate type
 * (convert_block.h), so one body serves every dtype pair and its loops
 * vectorize. Every block is read before the same block of the output is
 * written, so y = x and dx = dy (in place) compute what they would apart. */
#include <math.h>
#include <string.h>

#include "cpu_rows.h"
#include "internal/layer_norm.h"

#define BLOCK OPSMITH_CPU_BLOCK
/* 32 lanes (cpu_rows.h: row sums in fixed lanes): the row sums are most of
 * the work here, and four vector registers of independent add chains hide
 * the add latency */
#define LANES 32

/* The 32 lanes of one block as four arrays of 8 (lane 8g + k in l<g>[k]),
 * so the compiler keeps each in a register: lanes[i % 32] += EXPR for i in
 * [0, len), EXPR an expression of i. LN_LANES_TOTAL then adds them in the
 * order of opsmith_lanes_total (l[k] += l[k + w], w = 16 .. 1). */
#define LN_LANES(ACC, l) ACC l##0[8] = {0}, l##1[8] = {0}, l##2[8] = {0}, l##3[8] = {0}
#define LN_LANES_ADD(ACC, l, len, i, EXPR)                                  \
    do {                                                                    \
        int64_t i##_0 = 0;                                                  \
        for (; i##_0 + LANES <= (len); i##_0 += LANES) {                    \
            for (int k_ = 0; k_ < 8; k_++) {                                \
                const int64_t i = i##_0 + k_;                               \
                l##0[k_] += (EXPR);                                         \
            }                                                               \
            for (int k_ = 0; k_ < 8; k_++) {                                \
                const int64_t i = i##_0 + 8 + k_;                           \
                l##1[k_] += (EXPR);                                         \
            }                                                               \
            for (int k_ = 0; k_ < 8; k_++) {                                \
                const int64_t i = i##_0 + 16 + k_;                          \
                l##2[k_] += (EXPR);                                         \
            }                                                               \
            for (int k_ = 0; k_ < 8; k_++) {                                \
                const int64_t i = i##_0 + 24 + k_;                          \
                l##3[k_] += (EXPR);                                         \
            }                                                               \
        }                                                                   \
        /* the tail (under 32 elements): element i_0 + t into lane t */     \
        for (int t_ = 0; i##_0 < (len); i##_0++, t_++) {                    \
            const int64_t i = i##_0;                                        \
            const ACC v_ = (EXPR);                                          \
            if (t_ < 8) l##0[t_] += v_;                                     \
            else if (t_ < 16) l##1[t_ - 8] += v_;                           \
            else if (t_ < 24) l##2[t_ - 16] += v_;                          \
            else l##3[t_ - 24] += v_;                                       \
        }                                                                   \
    } while (0)
#define LN_LANES_TOTAL(l)                                                   \
    (LN_FOLD8(l##0, l##2), LN_FOLD8(l##1, l##3), LN_FOLD8(l##0, l##1),      \
     l##0[0] += l##0[4], l##0[1] += l##0[5], l##0[2] += l##0[6], l##0[3] += l##0[7], \
     l##0[0] += l##0[2], l##0[1] += l##0[3], l##0[0] += l##0[1], l##0[0])
/* The forward's lanes run on over SPAN blocks before they are totalled
 * into the row's block lanes: one fold a pass for a row of up to SPAN *
 * BLOCK elements. Folding each block cost ~20% of the forward at 1024
 * float32 (a fold's dependent adds for every 512 elements); a lane now adds
 * up to SPAN * BLOCK / LANES = 128 terms before its fold, against 16. */
#define SPAN 8
#define LN_SPAN_END(l, blocks, nb, last)                                    \
    do {                                                                    \
        if ((nb) % SPAN == SPAN - 1 || (last)) {                            \
            blocks[((nb) / SPAN) % LANES] += LN_LANES_TOTAL(l);             \
            memset(l##0, 0, sizeof l##0), memset(l##1, 0, sizeof l##1);     \
            memset(l##2, 0, sizeof l##2), memset(l##3, 0, sizeof l##3);     \
        }                                                                   \
    } while (0)
/* a row of one span has only its first block lane set (0 + t is t) */
#define LN_ROW_TOTAL(SUFFIX, blocks, n) \
    ((n) <= SPAN * BLOCK ? blocks[0] : opsmith_lanes_total_##SUFFIX(blocks, LANES))
#define LN_FOLD8(a, b) (a[0] += b[0], a[1] += b[1], a[2] += b[2], a[3] += b[3], \
                        a[4] += b[4], a[5] += b[5], a[6] += b[6], a[7] += b[7])

/* y[b0 + i] = EXPR for i < len: bfloat16 rounded in the same loop (no
 * float block stored and read back), float16 through the block (F16C), the
 * accumulate type straight into y (ob is y there) */
#define LN_STORE(SUFFIX, EXPR)                                                                    \
    do {                                                                                          \
        if (a->xd == OPSMITH_DTYPE_BF16) {                                                        \
            uint16_t *y16_ = (uint16_t *)(void *)yr + b0;                                         \
            for (int64_t i = 0; i < len; i++) y16_[i] = opsmith_f32_to_bf16((float)(EXPR));      \
        } else {                                                                                  \
            for (int64_t i = 0; i < len; i++) ob[i] = (EXPR);                                     \
            opsmith_narrow_##SUFFIX(a->xd, ob, yr, b0, len);                                      \
        }                                                                                         \
    } while (0)

/* Rows of up to ROW_BYTES of the accumulate type are widened once, not
 * once a pass (the blocks and sums are the same either way). */
#define ROW_BYTES 16384

typedef struct fwd_args {
    opsmith_dtype xd, wd;
    int64_t n, xs, ys;
    const void *x, *w, *b;
    void *y, *mean, *rstd;
    double eps;
} fwd_args;

typedef struct bwd_args {
    opsmith_dtype xd, wd;
    int64_t n, dys, xs, dxs;
    const void *dy, *x, *w, *mean, *rstd;
    void *dx;
} bwd_args;

/* One body per accumulate type ACC (float, double), stamped from a macro:
 * the widen/narrow helpers of convert_block.h named by SUFFIX, ACC_DT the
 * dtype that needs no widening. */
#define DEFINE_LAYER_NORM(SUFFIX, ACC, ACC_DT)                                                    \
    /* all n of a row widened at once into `row` when it fits (or is used in                      \
     * place); else NULL, and each pass widens block by block */                                  \
    static const ACC *whole_##SUFFIX(opsmith_dtype dt, const void *p, int64_t n, ACC *row) {      \
        if (dt == ACC_DT || n * (int64_t)sizeof(ACC) <= ROW_BYTES)                                \
            return opsmith_widen_##SUFFIX(dt, p, 0, n, row);                                      \
        return NULL;                                                                              \
    }                                                                                             \
    /* the block [b0, b0 + len) of p, from its widened row when there is one */                   \
    static inline const ACC *block_##SUFFIX(const ACC *whole, opsmith_dtype dt, const void *p,    \
                                            int64_t b0, int64_t len, ACC *buf) {                  \
        return whole ? whole + b0 : opsmith_widen_##SUFFIX(dt, p, b0, len, buf);                  \
    }                                                                                             \
                                                                                                  \
    /* y, mean, rstd for rows [r0, r1): a pass for the mean, a pass for the                       \
     * squared deviations from it (no cancellation), a pass for y */                              \
    OPSMITH_CPU_CLONES static void fwd_rows_##SUFFIX(const fwd_args *a, int64_t r0, int64_t r1) { \
        ACC xrow[ROW_BYTES / sizeof(ACC)], wrow[ROW_BYTES / sizeof(ACC)], brow[ROW_BYTES / sizeof(ACC)];\
        ACC xbuf[BLOCK], wbuf[BLOCK], bbuf[BLOCK], obuf[BLOCK];                                   \
        const ACC eps = (ACC)a->eps;                                                              \
        const int64_t n = a->n, es = (int64_t)opsmith_dtype_size(a->xd);                          \
        /* the parameters widened once for all the rows, when they fit */                         \
        const ACC *ww = a->w ? whole_##SUFFIX(a->wd, a->w, n, wrow) : NULL;                       \
        const ACC *bw = a->b ? whole_##SUFFIX(a->wd, a->b, n, brow) : NULL;                       \
        for (int64_t r = r0; r < r1; r++) {                                                       \
            const char *xr = (const char *)a->x + r * a->xs * es;                                 \
            char *yr = (char *)a->y + r * a->ys * es;                                             \
            /* the first pass widens each block (into the row buffer when the                     \
             * row fits) right before summing it, while it is in L1 */                            \
            ACC *fill = a->xd != ACC_DT && n * (int64_t)sizeof(ACC) <= ROW_BYTES ? xrow : NULL;   \
            const ACC *xw = a->xd == ACC_DT ? (const ACC *)(const void *)xr : fill;               \
            ACC blocks[LANES] = {0};                                                              \
            LN_LANES(ACC, l);                                                                     \
            for (int64_t b0 = 0, nb = 0; b0 < n; b0 += BLOCK, nb++) {                             \
                const int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;                              \
                const ACC *xb = opsmith_widen_##SUFFIX(a->xd, xr, b0, len, fill ? fill + b0 : xbuf); \
                LN_LANES_ADD(ACC, l, len, j, xb[j]);                                              \
                LN_SPAN_END(l, blocks, nb, b0 + len == n);                                        \
            }                                                                                     \
            const ACC mu = LN_ROW_TOTAL(SUFFIX, blocks, n) / (ACC)n;                              \
            memset(blocks, 0, sizeof blocks);                                                     \
            for (int64_t b0 = 0, nb = 0; b0 < n; b0 += BLOCK, nb++) {                             \
                const int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;                              \
                const ACC *xb = block_##SUFFIX(xw, a->xd, xr, b0, len, xbuf);                     \
                LN_LANES_ADD(ACC, l, len, j, (xb[j] - mu) * (xb[j] - mu));                        \
                LN_SPAN_END(l, blocks, nb, b0 + len == n);                                        \
            }                                                                                     \
            const ACC rs = (ACC)1 / sqrt(LN_ROW_TOTAL(SUFFIX, blocks, n) / (ACC)n + eps);         \
            ((ACC *)a->mean)[r] = mu;                                                             \
            ((ACC *)a->rstd)[r] = rs;                                                             \
            for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {                                           \
                const int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;                              \
                const ACC *xb = block_##SUFFIX(xw, a->xd, xr, b0, len, xbuf);                     \
                const ACC *wb = a->w ? block_##SUFFIX(ww, a->wd, a->w, b0, len, wbuf) : NULL;     \
                const ACC *bb = a->b ? block_##SUFFIX(bw, a->wd, a->b, b0, len, bbuf) : NULL;     \
                ACC *ob = opsmith_out_##SUFFIX(a->xd, yr, b0, obuf);                              \
                /* element by element, so ob may be x itself (in place) */                        \
                if (wb && bb)                                                                     \
                    LN_STORE(SUFFIX, (xb[i] - mu) * rs * wb[i] + bb[i]);                          \
                else if (wb)                                                                      \
                    LN_STORE(SUFFIX, (xb[i] - mu) * rs * wb[i]);                                  \
                else if (bb)                                                                      \
                    LN_STORE(SUFFIX, (xb[i] - mu) * rs + bb[i]);                                  \
                else                                                                              \
                    LN_STORE(SUFFIX, (xb[i] - mu) * rs);                                          \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* dx for rows [r0, r1); when pw is non-NULL, adds dy * xhat into pw and                      \
     * dy into pb (n each: the chunk's partial rows) */                                           \
    OPSMITH_CPU_CLONES static void bwd_rows_##SUFFIX(const bwd_args *a, int64_t r0, int64_t r1,   \
                                                     ACC *pw, ACC *pb) {                          \
        ACC xrow[ROW_BYTES / sizeof(ACC)], grow[ROW_BYTES / sizeof(ACC)], wrow[ROW_BYTES / sizeof(ACC)];\
        ACC xbuf[BLOCK], gbuf[BLOCK], wbuf[BLOCK], obuf[BLOCK];                                   \
        const int64_t n = a->n, es = (int64_t)opsmith_dtype_size(a->xd);                          \
        const ACC *ww = a->w ? whole_##SUFFIX(a->wd, a->w, n, wrow) : NULL;                       \
        for (int64_t r = r0; r < r1; r++) {                                                       \
            const char *xr = (const char *)a->x + r * a->xs * es;                                 \
            const char *dyr = (const char *)a->dy + r * a->dys * es;                              \
            char *dxr = (char *)a->dx + r * a->dxs * es;                                          \
            const ACC mu = ((const ACC *)a->mean)[r], rs = ((const ACC *)a->rstd)[r];             \
            const ACC *xw = whole_##SUFFIX(a->xd, xr, n, xrow);                                   \
            const ACC *gw = whole_##SUFFIX(a->xd, dyr, n, grow);                                  \
            /* the sums of g = dy * w and of g * (x - mean) */                                    \
            ACC blocks_g[LANES] = {0}, blocks_gx[LANES] = {0};                                    \
            for (int64_t b0 = 0, nb = 0; b0 < n; b0 += BLOCK, nb++) {                             \
                const int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;                              \
                const ACC *xb = block_##SUFFIX(xw, a->xd, xr, b0, len, xbuf);                     \
                const ACC *gb = block_##SUFFIX(gw, a->xd, dyr, b0, len, gbuf);                    \
                LN_LANES(ACC, g);                                                                 \
                LN_LANES(ACC, h);                                                                 \
                if (a->w) { /* g * w formed where it is summed, not stored */                     \
                    const ACC *wb = block_##SUFFIX(ww, a->wd, a->w, b0, len, wbuf);               \
                    LN_LANES_ADD(ACC, g, len, j, gb[j] * wb[j]);                                  \
                    LN_LANES_ADD(ACC, h, len, j, gb[j] * wb[j] * (xb[j] - mu));                   \
                } else {                                                                          \
                    LN_LANES_ADD(ACC, g, len, j, gb[j]);                                          \
                    LN_LANES_ADD(ACC, h, len, j, gb[j] * (xb[j] - mu));                           \
                }                                                                                 \
                blocks_g[nb % LANES] += LN_LANES_TOTAL(g);                                        \
                blocks_gx[nb % LANES] += LN_LANES_TOTAL(h);                                       \
            }                                                                                     \
            const ACC mg = opsmith_lanes_total_##SUFFIX(blocks_g, LANES) / (ACC)n;                \
            const ACC mgx = opsmith_lanes_total_##SUFFIX(blocks_gx, LANES) * rs / (ACC)n;         \
            for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {                                           \
                const int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;                              \
                const ACC *xb = block_##SUFFIX(xw, a->xd, xr, b0, len, xbuf);                     \
                const ACC *gb = block_##SUFFIX(gw, a->xd, dyr, b0, len, gbuf);                    \
                if (pw) /* before dx is written: dx may be dy itself */                           \
                    for (int64_t i = 0; i < len; i++) {                                           \
                        pw[b0 + i] += gb[i] * ((xb[i] - mu) * rs);                                \
                        pb[b0 + i] += gb[i];                                                      \
                    }                                                                             \
                ACC *ob = opsmith_out_##SUFFIX(a->xd, dxr, b0, obuf);                             \
                /* x_hat and g * w formed again where used, not stored */                         \
                if (a->w) {                                                                       \
                    const ACC *wb = block_##SUFFIX(ww, a->wd, a->w, b0, len, wbuf);               \
                    for (int64_t i = 0; i < len; i++)                                             \
                        ob[i] = rs * (gb[i] * wb[i] - mg - (xb[i] - mu) * rs * mgx);              \
                } else {                                                                          \
                    for (int64_t i = 0; i < len; i++) ob[i] = rs * (gb[i] - mg - (xb[i] - mu) * rs * mgx); \
                }                                                                                 \
                opsmith_narrow_##SUFFIX(a->xd, ob, dxr, b0, len);                                 \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_LAYER_NORM(f64, double, OPSMITH_DTYPE_F64)
DEFINE_LAYER_NORM(f32, float, OPSMITH_DTYPE_F32)

static void fwd_rows(const fwd_args *a, int64_t r0, int64_t r1) {
    if (a->xd == OPSMITH_DTYPE_F64) fwd_rows_f64(a, r0, r1);
    else fwd_rows_f32(a, r0, r1);
}

static void bwd_rows(const bwd_args *a, int64_t r0, int64_t r1, void *pw, void *pb) {
    if (a->xd == OPSMITH_DTYPE_F64) bwd_rows_f64(a, r0, r1, (double *)pw, (double *)pb);
    else bwd_rows_f32(a, r0, r1, (float *)pw, (float *)pb);
}

opsmith_status opsmith_layer_norm_fwd_cpu(opsmith_dtype x_dtype, opsmith_dtype weight_dtype, int64_t rows, int64_t n,
                                          const void *x, int64_t x_row_stride, const void *weight, const void *bias,
                                          double eps, void *y, int64_t y_row_stride, void *mean, void *rstd) {
    const opsmith_layer_norm_args c = {"layer_norm_fwd_cpu", 0, x_dtype, weight_dtype, rows, n, x, x_row_stride,
                                       NULL, 0, weight, bias, eps, y, y_row_stride, mean, rstd, NULL, NULL};
    opsmith_status s = opsmith_internal_layer_norm_check(&c);
    if (s != OPSMITH_STATUS_SUCCESS || rows == 0) return s;
    const fwd_args a = {x_dtype, weight_dtype, n, x_row_stride, y_row_stride, x, weight, bias, y, mean, rstd, eps};
    /* one contiguous range of rows a thread */
    const int t = opsmith_internal_threads_for(rows * n);
    const int64_t parts = rows < t ? rows : t;
#pragma omp parallel for schedule(static) num_threads(t)
    for (int64_t p = 0; p < parts; p++) fwd_rows(&a, rows * p / parts, rows * (p + 1) / parts);
    return OPSMITH_STATUS_SUCCESS;
}

size_t opsmith_layer_norm_bwd_cpu_workspace_size(opsmith_dtype x_dtype, opsmith_dtype weight_dtype, int64_t rows,
                                                 int64_t n, const void *dy, int64_t dy_row_stride, const void *x,
                                                 int64_t x_row_stride, const void *weight, const void *mean,
                                                 const void *rstd, void *dx, int64_t dx_row_stride, void *dweight,
                                                 void *dbias) {
    (void)weight_dtype, (void)dy, (void)dy_row_stride, (void)x, (void)x_row_stride, (void)mean, (void)rstd;
    (void)dx, (void)dx_row_stride;
    return opsmith_internal_layer_norm_bwd_cpu_workspace(x_dtype, rows, n, weight && dweight, dbias != NULL);
}

opsmith_status opsmith_layer_norm_bwd_cpu(opsmith_dtype x_dtype, opsmith_dtype weight_dtype, int64_t rows, int64_t n,
                                          const void *dy, int64_t dy_row_stride, const void *x, int64_t x_row_stride,
                                          const void *weight, const void *mean, const void *rstd, void *dx,
                                          int64_t dx_row_stride, void *dweight, void *dbias, void *workspace,
                                          size_t workspace_bytes) {
    static const char op[] = "layer_norm_bwd_cpu";
    void *dw = weight ? dweight : NULL;
    const opsmith_layer_norm_args c = {op, 1, x_dtype, weight_dtype, rows, n, x, x_row_stride, dy, dy_row_stride,
                                       weight, NULL, 0.0, dx, dx_row_stride, mean, rstd, dw, dbias};
    opsmith_status s = opsmith_internal_layer_norm_check(&c);
    if (s != OPSMITH_STATUS_SUCCESS) return s;
    if (rows == 0) {
        /* no rows: the parameter gradients are empty sums */
        for (int64_t i = 0; i < n; i++) {
            if (dw) opsmith_store_from_double(weight_dtype, dw, i, 0.0);
            if (dbias) opsmith_store_from_double(weight_dtype, dbias, i, 0.0);
        }
        return OPSMITH_STATUS_SUCCESS;
    }
    s = opsmith_internal_check_workspace(
        op, workspace, workspace_bytes,
        opsmith_internal_layer_norm_bwd_cpu_workspace(x_dtype, rows, n, dw != NULL, dbias != NULL));
    if (s != OPSMITH_STATUS_SUCCESS) return s;
    const bwd_args a = {x_dtype, weight_dtype, n, dy_row_stride, x_row_stride, dx_row_stride,
                        dy, x, weight, mean, rstd, dx};
    const int t = opsmith_internal_threads_for(rows * n);
    if (!dw && !dbias) {
        const int64_t parts = rows < t ? rows : t;
#pragma omp parallel for schedule(static) num_threads(t)
        for (int64_t p = 0; p < parts; p++) bwd_rows(&a, rows * p / parts, rows * (p + 1) / parts, NULL, NULL);
        return OPSMITH_STATUS_SUCCESS;
    }
    /* dweight and dbias: each of a fixed number of row chunks (a function of
     * rows alone) sums into its own partial rows of the workspace, (2,
     * chunks, n); then each column adds its chunks in order. The bits do not
     * depend on the thread count. */
    const int64_t chunks = opsmith_internal_layer_norm_cpu_chunks(rows);
    const size_t acc = opsmith_dtype_size(opsmith_dtype_accumulate(x_dtype));
    char *pw = (char *)workspace, *pb = pw + (size_t)(chunks * n) * acc;
#pragma omp parallel for schedule(static) num_threads(t)
    for (int64_t k = 0; k < chunks; k++) {
        char *pwk = pw + (size_t)(k * n) * acc, *pbk = pb + (size_t)(k * n) * acc;
        memset(pwk, 0, (size_t)n * acc);
        memset(pbk, 0, (size_t)n * acc);
        bwd_rows(&a, rows * k / chunks, rows * (k + 1) / chunks, pwk, pbk);
    }
    void *outs[2] = {dw, dbias};
    const void *parts[2] = {pw, pb};
    opsmith_cpu_sum_chunks(x_dtype, weight_dtype, 2, outs, parts, chunks, n,
                           opsmith_internal_threads_for(2 * chunks * n));
    return OPSMITH_STATUS_SUCCESS;
}
