/* softmax and log_softmax on the CPU: C11 + OpenMP, one row a task, block
 * by block: a block of a row is widened into a float (double for f64)
 * buffer and each pass is a fixed-lane loop over it the compiler
 * vectorizes, the exponential included (cpu_exp.h; libm's expf is a scalar
 * call). Forward: the max; e^(x - max) and its sum, e kept in the output
 * (f32, f64) or a float row buffer on the stack (f16, bf16 rows of up to
 * ROW_KEEP: rounding e to 16 bits before the division would round twice;
 * wider rows compute e again); the division. So each element takes one
 * exponential. Backward: the row's dot product; the write. Each
 * pass reads a block before it writes it, so y = x and dx = dy (in place)
 * compute what they would apart. Formulas in include/opsmith/softmax.h. */
#include <math.h>
#include <stdint.h>

/* Floating-point exceptions are never inspected here, and without this GCC
 * keeps the selects of the exponential as branches on AVX2 and SSE2, which
 * do not vectorize. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include "cpu_exp.h"
#include "cpu_load_store.h"
#include "cpu_rows.h"
#include "internal/softmax.h"

#define LANES 16
#define BLOCK 256 /* elements widened into a buffer at a time (a multiple of LANES) */
#define SERIAL 65536
#define ROW_KEEP 32768 /* floats: 128 KB of stack (a thread has megabytes under glibc) */

/* e^v in place: f64 through libm (f64 is for checking), float vectorized */
static inline void exp_block_f64(double *v, int64_t n) {
    for (int64_t i = 0; i < n; i++) v[i] = exp(v[i]);
}

/* T: storage type; ACC: math type; LOAD/STORE convert one element; EXPB
 * e^v over a block of ACC in place. SAME: T is ACC (the output can hold
 * e^(x - max) itself). */
#define DEFINE_SOFTMAX(SUFFIX, T, ACC, LOAD, STORE, EXPB, LOG, SAME)                                          \
    /* p[0, len) as ACC: p itself when T is ACC, else buf filled */                                           \
    static inline const ACC *widen_##SUFFIX(const T *p, int64_t len, ACC *buf) {                              \
        if (SAME) return (const ACC *)(const void *)p;                                                        \
        for (int64_t k = 0; k < len; k++) buf[k] = LOAD(p[k]);                                                \
        return buf;                                                                                           \
    }                                                                                                         \
                                                                                                              \
    OPSMITH_CPU_CLONES static void fwd_row_##SUFFIX(int64_t n, const T *x, int lg, T *y) {                    \
        ACC m[LANES], s[LANES], xb[BLOCK], eb[BLOCK];                                                         \
        /* 16-bit storage: e^(x - max) kept in a float row buffer on the stack when the                       \
         * row fits (launchers allocate no memory), else computed again in the last pass */                   \
        ACC keep_row[SAME ? 1 : ROW_KEEP];                                                                    \
        ACC *row = !SAME && !lg && n <= ROW_KEEP ? keep_row : NULL;                                           \
        for (int k = 0; k < LANES; k++) m[k] = -INFINITY, s[k] = 0;                                           \
        for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {                                                           \
            const int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;                                              \
            const ACC *v = widen_##SUFFIX(x + b0, len, xb);                                                   \
            int64_t i = 0;                                                                                    \
            for (; i + LANES <= len; i += LANES) {                                                            \
                /* without the pragma GCC keeps the lanes scalar */                                           \
                _Pragma("omp simd")                                                                           \
                for (int k = 0; k < LANES; k++) m[k] = v[i + k] > m[k] ? v[i + k] : m[k];                     \
            }                                                                                                 \
            for (int k = 0; i < len; i++, k++) m[k] = v[i] > m[k] ? v[i] : m[k];                              \
        }                                                                                                     \
        ACC mx = -INFINITY;                                                                                   \
        for (int k = 0; k < LANES; k++) mx = m[k] > mx ? m[k] : mx;                                           \
        /* e = e^(x - mx) into y itself (T is ACC), the row buffer, or a block buffer */                      \
        const int keep = !lg && (SAME || row);                                                                \
        for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {                                                           \
            const int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;                                              \
            const ACC *v = widen_##SUFFIX(x + b0, len, xb);                                                   \
            ACC *e = !keep ? eb : SAME ? (ACC *)(void *)(y + b0) : row + b0;                                  \
            for (int64_t k = 0; k < len; k++) e[k] = v[k] - mx;                                               \
            EXPB(e, len);                                                                                     \
            OPSMITH_LANES_ADD(LANES, s, len, j, e[j]);                                                        \
        }                                                                                                     \
        ACC total = 0;                                                                                        \
        for (int k = 0; k < LANES; k++) total += s[k];                                                        \
        if (lg) {                                                                                             \
            const ACC lse = mx + LOG(total);                                                                  \
            for (int64_t i = 0; i < n; i++) y[i] = STORE(LOAD(x[i]) - lse);                                   \
            return;                                                                                           \
        }                                                                                                     \
        const ACC inv = (ACC)1 / total;                                                                       \
        if (SAME) {                                                                                           \
            ACC *e = (ACC *)(void *)y;                                                                        \
            for (int64_t i = 0; i < n; i++) e[i] *= inv;                                                      \
        } else if (row) {                                                                                     \
            for (int64_t i = 0; i < n; i++) y[i] = STORE(row[i] * inv);                                       \
        } else {                                                                                              \
            for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {                                                       \
                const int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;                                          \
                const ACC *v = widen_##SUFFIX(x + b0, len, xb);                                               \
                for (int64_t k = 0; k < len; k++) eb[k] = v[k] - mx;                                          \
                EXPB(eb, len);                                                                                \
                for (int64_t k = 0; k < len; k++) y[b0 + k] = STORE(eb[k] * inv);                             \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
                                                                                                              \
    OPSMITH_CPU_CLONES static void bwd_row_##SUFFIX(int64_t n, const T *g, const T *y, int lg, T *dx) {       \
        ACC s[LANES], gb[BLOCK], yb[BLOCK], eb[BLOCK];                                                        \
        for (int k = 0; k < LANES; k++) s[k] = 0;                                                             \
        for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {                                                           \
            const int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;                                              \
            const ACC *gv = widen_##SUFFIX(g + b0, len, gb);                                                  \
            if (lg) {                                                                                         \
                OPSMITH_LANES_ADD(LANES, s, len, j, gv[j]);                                                   \
            } else {                                                                                          \
                const ACC *yv = widen_##SUFFIX(y + b0, len, yb);                                              \
                OPSMITH_LANES_ADD(LANES, s, len, j, gv[j] * yv[j]);                                           \
            }                                                                                                 \
        }                                                                                                     \
        ACC total = 0;                                                                                        \
        for (int k = 0; k < LANES; k++) total += s[k];                                                        \
        for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {                                                           \
            const int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;                                              \
            const ACC *gv = widen_##SUFFIX(g + b0, len, gb);                                                  \
            const ACC *yv = widen_##SUFFIX(y + b0, len, yb);                                                  \
            /* the whole block is computed into eb before dx is written: dx may be dy or y */                 \
            if (lg) {                                                                                         \
                for (int64_t k = 0; k < len; k++) eb[k] = yv[k];                                              \
                EXPB(eb, len);                                                                                \
                for (int64_t k = 0; k < len; k++) eb[k] = gv[k] - eb[k] * total;                              \
            } else {                                                                                          \
                for (int64_t k = 0; k < len; k++) eb[k] = yv[k] * (gv[k] - total);                            \
            }                                                                                                 \
            for (int64_t k = 0; k < len; k++) dx[b0 + k] = STORE(eb[k]);                                      \
        }                                                                                                     \
    }                                                                                                         \
                                                                                                              \
    static void fwd_##SUFFIX(int64_t rows, int64_t n, const T *x, int64_t xs, int lg, T *y, int64_t ys,       \
                             int threads) {                                                                   \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(rows > 1 && rows * n > SERIAL)")   \
        for (int64_t r = 0; r < rows; r++) fwd_row_##SUFFIX(n, x + r * xs, lg, y + r * ys);             \
    }                                                                                                         \
                                                                                                              \
    static void bwd_##SUFFIX(int64_t rows, int64_t n, const T *g, int64_t gs, const T *y, int64_t ys, int lg, \
                             T *dx, int64_t dxs, int threads) {                                               \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(rows > 1 && rows * n > SERIAL)")   \
        for (int64_t r = 0; r < rows; r++) bwd_row_##SUFFIX(n, g + r * gs, y + r * ys, lg, dx + r * dxs);     \
    }

DEFINE_SOFTMAX(f64, double, double, LOAD_F64, STORE_F64, exp_block_f64, log, 1)
DEFINE_SOFTMAX(f32, float, float, LOAD_F32, STORE_F32, opsmith_exp_block_f32, logf, 1)
DEFINE_SOFTMAX(f16, uint16_t, float, LOAD_F16, STORE_F16, opsmith_exp_block_f32, logf, 0)
DEFINE_SOFTMAX(bf16, uint16_t, float, LOAD_BF16, STORE_BF16, opsmith_exp_block_f32, logf, 0)

opsmith_status opsmith_softmax_fwd_cpu(opsmith_dtype dtype, int64_t rows, int64_t n, const void *x,
                                       int64_t x_row_stride, int log, void *y, int64_t y_row_stride) {
    opsmith_status s = opsmith_internal_softmax_check("softmax_fwd_cpu", dtype, rows, n, x, x_row_stride, 0, NULL, 0,
                                                      y, y_row_stride);
    if (s != OPSMITH_STATUS_SUCCESS || rows == 0) return s;
    const int t = opsmith_get_num_threads(), lg = log != 0;
    switch (dtype) {
    case OPSMITH_DTYPE_F64: fwd_f64(rows, n, x, x_row_stride, lg, y, y_row_stride, t); break;
    case OPSMITH_DTYPE_F32: fwd_f32(rows, n, x, x_row_stride, lg, y, y_row_stride, t); break;
    case OPSMITH_DTYPE_F16: fwd_f16(rows, n, x, x_row_stride, lg, y, y_row_stride, t); break;
    case OPSMITH_DTYPE_BF16: fwd_bf16(rows, n, x, x_row_stride, lg, y, y_row_stride, t); break;
    default: return OPSMITH_STATUS_UNSUPPORTED_DTYPE;
    }
    return OPSMITH_STATUS_SUCCESS;
}

opsmith_status opsmith_softmax_bwd_cpu(opsmith_dtype dtype, int64_t rows, int64_t n, const void *dy,
                                       int64_t dy_row_stride, const void *y, int64_t y_row_stride, int log, void *dx,
                                       int64_t dx_row_stride) {
    opsmith_status s = opsmith_internal_softmax_check("softmax_bwd_cpu", dtype, rows, n, y, y_row_stride, 1, dy,
                                                      dy_row_stride, dx, dx_row_stride);
    if (s != OPSMITH_STATUS_SUCCESS || rows == 0) return s;
    const int t = opsmith_get_num_threads(), lg = log != 0;
    const int64_t gs = dy_row_stride, ys = y_row_stride, ds = dx_row_stride;
    switch (dtype) {
    case OPSMITH_DTYPE_F64: bwd_f64(rows, n, dy, gs, y, ys, lg, dx, ds, t); break;
    case OPSMITH_DTYPE_F32: bwd_f32(rows, n, dy, gs, y, ys, lg, dx, ds, t); break;
    case OPSMITH_DTYPE_F16: bwd_f16(rows, n, dy, gs, y, ys, lg, dx, ds, t); break;
    case OPSMITH_DTYPE_BF16: bwd_bf16(rows, n, dy, gs, y, ys, lg, dx, ds, t); break;
    default: return OPSMITH_STATUS_UNSUPPORTED_DTYPE;
    }
    return OPSMITH_STATUS_SUCCESS;
}
