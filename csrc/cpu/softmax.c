/* softmax and log_softmax on the CPU: C11 + OpenMP, one row a task, each
 * pass a fixed-lane loop the compiler can vectorize (forward: max, sum of
 * exponentials, write; backward: the row's dot product, write). Each pass
 * reads a group before it writes it, so y = x and dx = dy (in place) compute
 * what they would apart. Formulas in include/opsmith/softmax.h. */
#include <math.h>

#include "convert.h"
#include "internal/softmax.h"

#define LOAD_F64(p) (p)
#define STORE_F64(v) (v)
#define LOAD_F32(p) (p)
#define STORE_F32(v) (v)
#define LOAD_F16(p) opsmith_f16_to_f32(p)
#define STORE_F16(v) opsmith_f32_to_f16(v)
#define LOAD_BF16(p) opsmith_bf16_to_f32(p)
#define STORE_BF16(v) opsmith_f32_to_bf16(v)

#define LANES 8
#define SERIAL 65536

#define DEFINE_SOFTMAX(SUFFIX, T, ACC, LOAD, STORE, EXP, LOG)                                                  \
    static void fwd_row_##SUFFIX(int64_t n, const T *x, int lg, T *y) {                                       \
        ACC m[LANES], s[LANES];                                                                               \
        for (int k = 0; k < LANES; k++) m[k] = -INFINITY, s[k] = 0;                                           \
        int64_t i = 0;                                                                                        \
        for (; i + LANES <= n; i += LANES)                                                                    \
            for (int k = 0; k < LANES; k++) {                                                                 \
                const ACC v = LOAD(x[i + k]);                                                                 \
                m[k] = v > m[k] ? v : m[k];                                                                   \
            }                                                                                                 \
        ACC mx = -INFINITY;                                                                                   \
        for (; i < n; i++) {                                                                                  \
            const ACC v = LOAD(x[i]);                                                                         \
            mx = v > mx ? v : mx;                                                                             \
        }                                                                                                     \
        for (int k = 0; k < LANES; k++) mx = m[k] > mx ? m[k] : mx;                                           \
        ACC total = 0;                                                                                        \
        i = 0;                                                                                                \
        for (; i + LANES <= n; i += LANES)                                                                    \
            for (int k = 0; k < LANES; k++) s[k] += EXP(LOAD(x[i + k]) - mx);                                 \
        for (; i < n; i++) total += EXP(LOAD(x[i]) - mx);                                                     \
        for (int k = 0; k < LANES; k++) total += s[k];                                                        \
        const ACC lse = mx + LOG(total);                                                                      \
        i = 0;                                                                                                \
        for (; i + LANES <= n; i += LANES) {                                                                  \
            ACC v[LANES];                                                                                     \
            for (int k = 0; k < LANES; k++) v[k] = LOAD(x[i + k]) - lse;                                      \
            if (!lg)                                                                                          \
                for (int k = 0; k < LANES; k++) v[k] = EXP(v[k]);                                             \
            for (int k = 0; k < LANES; k++) y[i + k] = STORE(v[k]);                                           \
        }                                                                                                     \
        for (; i < n; i++) {                                                                                  \
            const ACC v = LOAD(x[i]) - lse;                                                                   \
            y[i] = STORE(lg ? v : EXP(v));                                                                    \
        }                                                                                                     \
    }                                                                                                         \
                                                                                                              \
    static void bwd_row_##SUFFIX(int64_t n, const T *g, const T *y, int lg, T *dx) {                          \
        ACC s[LANES];                                                                                         \
        for (int k = 0; k < LANES; k++) s[k] = 0;                                                             \
        ACC total = 0;                                                                                        \
        int64_t i = 0;                                                                                        \
        for (; i + LANES <= n; i += LANES)                                                                    \
            for (int k = 0; k < LANES; k++) s[k] += lg ? LOAD(g[i + k]) : LOAD(g[i + k]) * LOAD(y[i + k]);    \
        for (; i < n; i++) total += lg ? LOAD(g[i]) : LOAD(g[i]) * LOAD(y[i]);                                \
        for (int k = 0; k < LANES; k++) total += s[k];                                                        \
        i = 0;                                                                                                \
        for (; i + LANES <= n; i += LANES) {                                                                  \
            ACC v[LANES];                                                                                     \
            for (int k = 0; k < LANES; k++) {                                                                 \
                const ACC gy = LOAD(g[i + k]), yy = LOAD(y[i + k]);                                           \
                v[k] = lg ? gy - EXP(yy) * total : yy * (gy - total);                                         \
            }                                                                                                 \
            for (int k = 0; k < LANES; k++) dx[i + k] = STORE(v[k]);                                          \
        }                                                                                                     \
        for (; i < n; i++) {                                                                                  \
            const ACC gy = LOAD(g[i]), yy = LOAD(y[i]);                                                       \
            dx[i] = STORE(lg ? gy - EXP(yy) * total : yy * (gy - total));                                     \
        }                                                                                                     \
    }                                                                                                         \
                                                                                                              \
    static void fwd_##SUFFIX(int64_t rows, int64_t n, const T *x, int64_t xs, int lg, T *y, int64_t ys,       \
                             int threads) {                                                                   \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(rows > 1 && rows * n > SERIAL)")   \
        for (int64_t r = 0; r < rows; r++) fwd_row_##SUFFIX(n, x + r * xs, lg, y + r * ys);                   \
    }                                                                                                         \
                                                                                                              \
    static void bwd_##SUFFIX(int64_t rows, int64_t n, const T *g, int64_t gs, const T *y, int64_t ys, int lg, \
                             T *dx, int64_t dxs, int threads) {                                               \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(rows > 1 && rows * n > SERIAL)")   \
        for (int64_t r = 0; r < rows; r++) bwd_row_##SUFFIX(n, g + r * gs, y + r * ys, lg, dx + r * dxs);     \
    }

DEFINE_SOFTMAX(f64, double, double, LOAD_F64, STORE_F64, exp, log)
DEFINE_SOFTMAX(f32, float, float, LOAD_F32, STORE_F32, expf, logf)
DEFINE_SOFTMAX(f16, uint16_t, float, LOAD_F16, STORE_F16, expf, logf)
DEFINE_SOFTMAX(bf16, uint16_t, float, LOAD_BF16, STORE_BF16, expf, logf)

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
