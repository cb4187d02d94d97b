/* cross_entropy on the CPU: C11 + OpenMP, one row a task. A row is read
 * three times (max and the smoothing sum; the exponential sum; the
 * gradient), block by block: a block is widened into a float (double for
 * f64) buffer and each pass is a fixed-lane loop over it the compiler
 * vectorizes, the exponential included (cpu_exp.h; libm's expf is a scalar
 * call). A row of the widest vocabularies (262144 bf16, 512 KB) stays in
 * the core's cache between the passes. Targets are checked, and the mean's
 * denominator summed, before any row runs, on the calling thread in row
 * order (so the results do not depend on the thread count). Formulas in
 * include/opsmith/cross_entropy.h. */
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
#include "internal/cross_entropy.h"

#define LANES 16
#define BLOCK 256 /* elements of a row widened into a buffer at a time (a multiple of LANES) */

/* DT, T: the storage dtype and type; ACC: accumulate type; WIDEN a block of
 * DT to ACC (convert_block.h); LOAD/STORE convert one element; EXPN e^v of
 * one v <= 0 (f64 through libm: f64 is for checking); LOG, TANH in ACC. The
 * row workers go block by block: a block is widened (and softcapped) into a
 * buffer, then each pass is a plain loop over it that the compiler
 * vectorizes. */
#define DEFINE_CROSS_ENTROPY(SUFFIX, DT, T, ACC, WIDEN, LOAD, STORE, EXPN, LOG, TANH)                            \
    /* softcapped logit */                                                                                      \
    static inline ACC cap_##SUFFIX(ACC v, ACC cap, ACC inv_cap) { return cap > 0 ? cap * TANH(v * inv_cap) : v; } \
                                                                                                                \
    /* the softcapped logits x[k], k < len: x itself when T is ACC and there is                                 \
     * no softcap (no copy), else widened into buf (convert_block.h: F16C for                                   \
     * float16 where the CPU has it) */                                                                         \
    static inline const ACC *load_##SUFFIX(const T *x, int64_t len, ACC cap, ACC inv_cap, ACC *buf) {           \
        const ACC *y = WIDEN(DT, x, 0, len, buf);                                                               \
        if (!(cap > 0)) return y;                                                                               \
        for (int64_t k = 0; k < len; k++) buf[k] = cap * TANH(y[k] * inv_cap);                                  \
        return buf;                                                                                             \
    }                                                                                                           \
                                                                                                                \
    /* the shift of a row's exponentials: its max; 0 for a row of -inf (every                                  \
     * e^(y - 0) is then 0 and the loss NaN, as PyTorch). A +inf max stays:                                     \
     * inf - inf makes the row NaN, as PyTorch, and y - base is never > 0 */                                    \
    static inline ACC base_of_##SUFFIX(ACC mx) { return mx > -(ACC)INFINITY ? mx : (ACC)0; }                    \
                                                                                                                \
    /* e[j] = e^(y[j] - base) for j < len and their sums into the lanes s (the                                  \
     * lanes of OPSMITH_LANES_ADD), one loop: the exponential of arguments <= 0 */                              \
    static inline void exp_sum_##SUFFIX(const ACC *y, int64_t len, ACC base, ACC *e, ACC *s) {                  \
        int64_t j0 = 0;                                                                                         \
        for (; j0 + LANES <= len; j0 += LANES) {                                                                \
            _Pragma("omp simd")                                                                                 \
            for (int k = 0; k < LANES; k++) {                                                                   \
                const ACC v = EXPN(y[j0 + k] - base);                                                           \
                e[j0 + k] = v;                                                                                  \
                s[k] += v;                                                                                      \
            }                                                                                                   \
        }                                                                                                       \
        for (int k = 0; j0 < len; j0++, k++) s[k] += e[j0] = EXPN(y[j0] - base);                                \
    }                                                                                                           \
                                                                                                                \
    /* the lanes m of the max of y[j], j < len */                                                               \
    static inline void max_lanes_##SUFFIX(const ACC *y, int64_t len, ACC *m) {                                  \
        int64_t i = 0;                                                                                          \
        for (; i + LANES <= len; i += LANES) {                                                                  \
            /* without the pragma GCC keeps the lanes scalar */                                                 \
            _Pragma("omp simd")                                                                                 \
            for (int k = 0; k < LANES; k++) m[k] = y[i + k] > m[k] ? y[i + k] : m[k];                           \
        }                                                                                                       \
        for (int k = 0; i < len; i++, k++) m[k] = y[i] > m[k] ? y[i] : m[k];                                    \
    }                                                                                                           \
                                                                                                                \
    /* the lanes a of sum w[j] (y[j] - base) (no weight: 1), for label smoothing's                              \
     * sum_c w_c (lse - y_c) = W log(total) - sum_c w_c (y_c - base): differences                               \
     * from the max, not W lse - sum w y, whose two large terms cancel when the                                 \
     * logits lie far from zero (a loss of 14 off by 5 at logits ~1e6) */                                       \
    static inline void wdev_sum_##SUFFIX(const ACC *y, int64_t len, const ACC *w, ACC base, ACC *a) {           \
        if (w) OPSMITH_LANES_ADD(LANES, a, len, j, w[j] * (y[j] - base));                                       \
        else OPSMITH_LANES_ADD(LANES, a, len, j, y[j] - base);                                                  \
    }                                                                                                           \
                                                                                                                \
    /* the row's shift from the max lanes m */                                                                  \
    static inline ACC row_base_##SUFFIX(const ACC *m) {                                                         \
        ACC mx = -INFINITY;                                                                                     \
        for (int k = 0; k < LANES; k++) mx = m[k] > mx ? m[k] : mx;                                             \
        return base_of_##SUFFIX(mx);                                                                            \
    }                                                                                                           \
                                                                                                                \
    /* the exponential sum from its lanes s; *wy from the lanes a when wanted */                                \
    static inline ACC row_total_##SUFFIX(const ACC *s, const ACC *a, ACC *wy) {                                 \
        ACC total = 0, sum_wy = 0;                                                                              \
        for (int k = 0; k < LANES; k++) total += s[k], sum_wy += a[k];                                          \
        if (wy) *wy = sum_wy;                                                                                   \
        return total;                                                                                           \
    }                                                                                                           \
                                                                                                                \
    /* lse of one row, as base + log(total) with total = sum e^(y - base);                                      \
     * *wy = sum_c w[c] (y[c] - base) when wy is not NULL (wdev_sum) */                                         \
    OPSMITH_CPU_CLONES static ACC row_lse_##SUFFIX(int64_t n, const T *x, ACC cap, const ACC *w, ACC *wy,       \
                                                   ACC *base_out, ACC *total_out) {                             \
        const ACC inv_cap = cap > 0 ? (ACC)1 / cap : (ACC)0;                                                    \
        ACC m[LANES], a[LANES], s[LANES], buf[BLOCK], e[BLOCK];                                                 \
        for (int k = 0; k < LANES; k++) m[k] = -INFINITY, a[k] = 0, s[k] = 0;                                   \
        for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {                                                             \
            const int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;                                                \
            max_lanes_##SUFFIX(load_##SUFFIX(x + b0, len, cap, inv_cap, buf), len, m);                          \
        }                                                                                                       \
        const ACC base = row_base_##SUFFIX(m);                                                                  \
        for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {                                                             \
            const int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;                                                \
            const ACC *y = load_##SUFFIX(x + b0, len, cap, inv_cap, buf);                                       \
            exp_sum_##SUFFIX(y, len, base, e, s);                                                               \
            if (wy) wdev_sum_##SUFFIX(y, len, w ? w + b0 : NULL, base, a);                                      \
        }                                                                                                       \
        const ACC total = row_total_##SUFFIX(s, a, wy);                                                         \
        *base_out = base, *total_out = total;                                                                   \
        return base + LOG(total);                                                                               \
    }                                                                                                           \
                                                                                                                \
    /* the gradient of one row (scaled by `scale`): formula in the header, with                                 \
     * p = e^(y - base) / total (row_lse's): never through a rounded lse, whose                                 \
     * ulp at |y| ~ 1e4 in float would be an error of p. d may be x (in place):                                 \
     * each block is read whole before it is written */                                                         \
    OPSMITH_CPU_CLONES static void row_grad_##SUFFIX(int64_t n, const T *x, int64_t t, ACC cap, const ACC *w,   \
                                                     ACC base, ACC total, ACC coef, ACC smooth,                 \
                                                     ACC target_coef, ACC scale, T *d) {                        \
        const ACC pc = coef / total;                                                                            \
        const ACC inv_cap = cap > 0 ? (ACC)1 / cap : (ACC)0;                                                    \
        const ACC y_t = cap_##SUFFIX(LOAD(x[t]), cap, inv_cap);                                                 \
        ACC buf[BLOCK], g[BLOCK];                                                                               \
        for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {                                                             \
            const int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;                                                \
            const ACC *y = load_##SUFFIX(x + b0, len, cap, inv_cap, buf);                                       \
            _Pragma("omp simd")                                                                                 \
            for (int64_t k = 0; k < len; k++) g[k] = EXPN(y[k] - base);                                         \
            /* (p coef - smooth w) dy scale, dy the softcap's slope */                                          \
            for (int64_t k = 0; k < len; k++) g[k] *= pc;                                                       \
            if (w) {                                                                                            \
                for (int64_t k = 0; k < len; k++) g[k] -= smooth * w[b0 + k];                                   \
            } else {                                                                                            \
                for (int64_t k = 0; k < len; k++) g[k] -= smooth;                                               \
            }                                                                                                   \
            if (cap > 0)                                                                                        \
                for (int64_t k = 0; k < len; k++) g[k] *= (ACC)1 - (y[k] * inv_cap) * (y[k] * inv_cap);         \
            for (int64_t k = 0; k < len; k++) d[b0 + k] = STORE(g[k] * scale);                                  \
        }                                                                                                       \
        /* the target's own term, after the sweep: d may be x (in place) */                                     \
        const ACC e_t = EXPN(y_t - base);                                                                       \
        const ACC dy_t = cap > 0 ? (ACC)1 - (y_t * inv_cap) * (y_t * inv_cap) : (ACC)1;                         \
        d[t] = STORE((e_t * pc - smooth * (w ? w[t] : (ACC)1) - target_coef) * dy_t * scale);                 \
    }                                                                                                           \
                                                                                                                \
    /* A row that fits one block (n <= BLOCK: small vocabularies), read and   \
     * widened once: max, e = exp(y - max) kept in the buffer, their sum, and  \
     * from them the gradient (p = e / sum) when d is not NULL: one pass of    \
     * loads and exponentials where the general path makes three. coef is     \
     * coef0 + z2 lse (the z-loss term needs lse). Returns lse; *wy, *base_out \
     * and *total_out as row_lse's. d may be x (in place): every y is read     \
     * before d is written. */                                                 \
    OPSMITH_CPU_CLONES static ACC row_small_##SUFFIX(int64_t n, const T *x, int64_t t, ACC cap, const ACC *w,  \
                                                     ACC *wy, ACC coef0, ACC z2, ACC smooth, ACC target_coef,  \
                                                     ACC scale, T *d, ACC *base_out, ACC *total_out) {         \
        const ACC inv_cap = cap > 0 ? (ACC)1 / cap : (ACC)0;                                                    \
        ACC buf[BLOCK], e[BLOCK], m[LANES], a[LANES], s[LANES];                                                 \
        for (int k = 0; k < LANES; k++) m[k] = -INFINITY, a[k] = 0, s[k] = 0;                                   \
        const ACC *y = load_##SUFFIX(x, n, cap, inv_cap, buf);                                                  \
        max_lanes_##SUFFIX(y, n, m);                                                                            \
        const ACC base = row_base_##SUFFIX(m);                                                                  \
        exp_sum_##SUFFIX(y, n, base, e, s);                                                                     \
        if (wy) wdev_sum_##SUFFIX(y, n, w, base, a);                                                            \
        const ACC total = row_total_##SUFFIX(s, a, wy);                                                         \
        const ACC lse = base + LOG(total);                                                                      \
        *base_out = base, *total_out = total;                                                                   \
        if (!d) return lse;                                                                                     \
        const ACC pc = (coef0 + z2 * lse) / total;                                                              \
        for (int64_t k = 0; k < n; k++) e[k] *= pc;                                                             \
        if (w) {                                                                                                \
            for (int64_t k = 0; k < n; k++) e[k] -= smooth * w[k];                                              \
        } else {                                                                                                \
            for (int64_t k = 0; k < n; k++) e[k] -= smooth;                                                     \
        }                                                                                                       \
        e[t] -= target_coef;                                                                                    \
        if (cap > 0)                                                                                            \
            for (int64_t k = 0; k < n; k++) e[k] *= (ACC)1 - (y[k] * inv_cap) * (y[k] * inv_cap);               \
        for (int64_t k = 0; k < n; k++) d[k] = STORE(e[k] * scale);                                             \
        return lse;                                                                                             \
    }                                                                                                           \
                                                                                                                \
    /* a loss value in the logits' type or (loss_acc) unrounded in ACC */                                    \
    static void put_loss_##SUFFIX(void *p, int64_t i, ACC v, int loss_acc) {                                    \
        if (loss_acc) ((ACC *)p)[i] = v;                                                                        \
        else ((T *)p)[i] = STORE(v);                                                                            \
    }                                                                                                           \
                                                                                                                \
    static opsmith_status fwd_##SUFFIX(int64_t rows, int64_t n, const T *x, int64_t xs, const int64_t *tg,      \
                                       int64_t ts, const ACC *w, int64_t ignore, ACC ls, ACC z, ACC cap, int red, \
                                       int loss_acc, void *loss, void *zout, ACC *lse_out, T *dl, int64_t dls,  \
                                       int64_t *error, ACC *ws, int threads) {                                  \
        ACC denom = 0, wsum = 0;                                                                                \
        for (int64_t r = 0; r < rows; r++) {                                                                    \
            const int64_t t = tg[r * ts];                                                                       \
            if (t == ignore) continue;                                                                          \
            if (t < 0 || t >= n) {                                                                              \
                if (error) error[0] = 1, error[1] = r, error[2] = t;                                            \
                return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT,                                   \
                                             "cross_entropy_fwd_cpu: target %lld (row %lld) is out of range "   \
                                             "[0, %lld) and not ignore_index (%lld)",                           \
                                             (long long)t, (long long)r, (long long)n, (long long)ignore);      \
            }                                                                                                   \
            denom += w ? w[t] : (ACC)1;                                                                         \
        }                                                                                                       \
        for (int64_t c = 0; c < n; c++) wsum += w ? w[c] : (ACC)1;                                              \
        const ACC scale = red == OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN ? (ACC)1 / denom : (ACC)1;                \
        const ACC ls_n = ls / (ACC)n;                                                                           \
        ACC *loss_rows = ws, *z_rows = (ACC *)opsmith_internal_cross_entropy_z_rows(ws, rows, z, sizeof(ACC)); \
        /* rows taken a chunk of ~16K logits at a time: one shared counter update a row cost more than   \
           a narrow row's own work, twice so after long two-thread bursts (bench/NOTES.md) */              \
        const int64_t chunk = n >= 16384 ? 1 : 16384 / n;                                                   \
        _Pragma("omp parallel for schedule(dynamic, chunk) num_threads(threads) if(rows > 1 && rows * n > 65536)") \
        for (int64_t r = 0; r < rows; r++) {                                                                    \
            const T *xr = x + r * xs;                                                                           \
            const int64_t t = tg[r * ts];                                                                       \
            ACC wy = 0, base = 0, total = 1;                                                                    \
            const ACC inv_cap = cap > 0 ? (ACC)1 / cap : (ACC)0;                                                \
            /* the target's logit, read before the row is written (in place) */                                 \
            const ACC wt = t == ignore ? (ACC)0 : w ? w[t] : (ACC)1;                                            \
            const ACC y_t = t == ignore ? (ACC)0 : cap_##SUFFIX(LOAD(xr[t]), cap, inv_cap);                     \
            /* a row that fits one block: lse and the gradient from one read (ignored rows: lse alone) */       \
            const int small = n <= BLOCK;                                                                       \
            const ACC lse = small ? row_small_##SUFFIX(n, xr, t, cap, w, ls > 0 ? &wy : NULL,                   \
                                                       ((ACC)1 - ls) * wt + ls_n * wsum, 2 * z, ls_n,           \
                                                       ((ACC)1 - ls) * wt, scale,                               \
                                                       t == ignore ? NULL : dl ? dl + r * dls : NULL, &base,    \
                                                       &total)                                                  \
                                  : row_lse_##SUFFIX(n, xr, cap, w, ls > 0 ? &wy : NULL, &base, &total);        \
            if (lse_out) lse_out[r] = lse;                                                                      \
            if (t == ignore) {                                                                                  \
                loss_rows[r] = 0;                                                                               \
                if (z_rows) z_rows[r] = 0;                                                                      \
                if (dl)                                                                                         \
                    for (int64_t c = 0; c < n; c++) dl[r * dls + c] = STORE((ACC)0);                            \
                continue;                                                                                       \
            }                                                                                                   \
            const ACC zl = z * lse * lse;                                                                       \
            /* (base - y_t) + log(total): lse - y_t without lse's rounding (ulp 2 at |y| ~ 3e7 in float) */     \
            ACC l = ((ACC)1 - ls) * wt * ((base - y_t) + LOG(total)) + zl;                                      \
            if (ls > 0) l += ls_n * (wsum * LOG(total) - wy); /* sum_c w_c (lse - y_c), wdev_sum */             \
            loss_rows[r] = l;                                                                                   \
            if (z_rows) z_rows[r] = zl;                                                                         \
            if (dl && !small)                                                                                   \
                row_grad_##SUFFIX(n, xr, t, cap, w, base, total, ((ACC)1 - ls) * wt + ls_n * wsum + 2 * z * lse, \
                                  ls_n, ((ACC)1 - ls) * wt, scale, dl + r * dls);                               \
        }                                                                                                       \
        if (red == OPSMITH_CROSS_ENTROPY_REDUCTION_NONE) {                                                      \
            for (int64_t r = 0; r < rows; r++) {                                                                \
                put_loss_##SUFFIX(loss, r, loss_rows[r], loss_acc);                                            \
                if (zout) put_loss_##SUFFIX(zout, r, z_rows ? z_rows[r] : (ACC)0, loss_acc);                    \
            }                                                                                                   \
        } else {                                                                                                \
            ACC total = 0, z_total = 0;                                                                         \
            for (int64_t r = 0; r < rows; r++) total += loss_rows[r], z_total += z_rows ? z_rows[r] : (ACC)0;   \
            const ACC d = red == OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN ? denom : (ACC)1;                         \
            put_loss_##SUFFIX(loss, 0, total / d, loss_acc);                                                   \
            if (zout) put_loss_##SUFFIX(zout, 0, z_total / d, loss_acc);                                        \
        }                                                                                                       \
        return OPSMITH_STATUS_SUCCESS;                                                                          \
    }                                                                                                           \
                                                                                                                \
    /* grad_acc: the incoming gradient in ACC (a float32 loss's), read unrounded */                            \
    static void bwd_##SUFFIX(int64_t rows, int64_t n, int grad_acc, const void *g, int64_t gs, const T *d,      \
                             int64_t ds, T *dx, int64_t dxs, int threads) {                                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(rows * n > 65536)")                  \
        for (int64_t r = 0; r < rows; r++) {                                                                    \
            const ACC s = grad_acc ? ((const ACC *)g)[r * gs] : LOAD(((const T *)g)[r * gs]);                   \
            if (dx == d && s == (ACC)1) continue; /* in place, nothing to scale */                              \
            const T *dr = d + r * ds;                                                                           \
            T *o = dx + r * dxs;                                                                                \
            int64_t i = 0;                                                                                      \
            for (; i + LANES <= n; i += LANES) {                                                                \
                ACC v[LANES];                                                                                   \
                for (int k = 0; k < LANES; k++) v[k] = LOAD(dr[i + k]) * s;                                     \
                for (int k = 0; k < LANES; k++) o[i + k] = STORE(v[k]);                                         \
            }                                                                                                   \
            for (; i < n; i++) o[i] = STORE(LOAD(dr[i]) * s);                                                   \
        }                                                                                                       \
    }

/* float's exponentials, log and tanh, expanded into the argument list */
#define CE_F32_MATH opsmith_exp_nonpos_f32, logf, tanhf
#define DEFINE_CE(...) DEFINE_CROSS_ENTROPY(__VA_ARGS__)
DEFINE_CE(f64, OPSMITH_DTYPE_F64, double, double, opsmith_widen_f64, LOAD_F64, STORE_F64, exp, log, tanh)
DEFINE_CE(f32, OPSMITH_DTYPE_F32, float, float, opsmith_widen_f32, LOAD_F32, STORE_F32, CE_F32_MATH)
DEFINE_CE(f16, OPSMITH_DTYPE_F16, uint16_t, float, opsmith_widen_f32, LOAD_F16, STORE_F16, CE_F32_MATH)
DEFINE_CE(bf16, OPSMITH_DTYPE_BF16, uint16_t, float, opsmith_widen_f32, LOAD_BF16, STORE_BF16, CE_F32_MATH)

opsmith_status opsmith_cross_entropy_fwd_cpu(opsmith_dtype dtype, int64_t rows, int64_t n, const void *logits,
                                             int64_t logits_row_stride, const int64_t *target, int64_t target_stride,
                                             const void *weight, int64_t ignore_index, double label_smoothing,
                                             double z_loss, double softcap, opsmith_cross_entropy_reduction reduction,
                                             opsmith_dtype loss_dtype, void *loss, void *z_out, void *lse,
                                             void *dlogits,
                                             int64_t dlogits_row_stride, int64_t *error, void *workspace,
                                             size_t workspace_bytes) {
    opsmith_status s = opsmith_internal_cross_entropy_fwd_check(
        "cross_entropy_fwd_cpu", dtype, rows, n, logits, logits_row_stride, target, label_smoothing, z_loss, softcap,
        (int)reduction, loss_dtype, loss, dlogits, dlogits_row_stride, error, 0, workspace, workspace_bytes, weight, z_out,
        lse);
    if (s != OPSMITH_STATUS_SUCCESS) return s;
    const int t = opsmith_get_num_threads();
    const int loss_acc = loss_dtype != dtype;
    const int64_t xs = logits_row_stride, ts = target_stride, ds = dlogits_row_stride;
    const int red = (int)reduction;
    const float ls = (float)label_smoothing, z = (float)z_loss, cap = (float)softcap;
    switch (dtype) {
    case OPSMITH_DTYPE_F64:
        return fwd_f64(rows, n, logits, xs, target, ts, weight, ignore_index, label_smoothing, z_loss, softcap, red,
                       loss_acc, loss, z_out, lse, dlogits, ds, error, workspace, t);
    case OPSMITH_DTYPE_F32:
        return fwd_f32(rows, n, logits, xs, target, ts, weight, ignore_index, ls, z, cap, red, loss_acc, loss, z_out,
                       lse, dlogits, ds, error, workspace, t);
    case OPSMITH_DTYPE_F16:
        return fwd_f16(rows, n, logits, xs, target, ts, weight, ignore_index, ls, z, cap, red, loss_acc, loss, z_out,
                       lse, dlogits, ds, error, workspace, t);
    case OPSMITH_DTYPE_BF16:
        return fwd_bf16(rows, n, logits, xs, target, ts, weight, ignore_index, ls, z, cap, red, loss_acc, loss, z_out,
                        lse, dlogits, ds, error, workspace, t);
    default: return OPSMITH_STATUS_UNSUPPORTED_DTYPE;
    }
}

opsmith_status opsmith_cross_entropy_bwd_cpu(opsmith_dtype dtype, int64_t rows, int64_t n, opsmith_dtype grad_dtype,
                                             const void *grad, int64_t grad_stride, const void *dlogits, int64_t dlogits_row_stride,
                                             void *dx, int64_t dx_row_stride) {
    opsmith_status s = opsmith_internal_cross_entropy_bwd_check("cross_entropy_bwd_cpu", dtype, rows, n, grad_dtype,
                                                                grad, grad_stride, dlogits, dlogits_row_stride, dx,
                                                                dx_row_stride);
    if (s != OPSMITH_STATUS_SUCCESS || rows == 0) return s;
    const int t = opsmith_get_num_threads(), ga = grad_dtype != dtype;
    const int64_t gs = grad_stride, ds = dlogits_row_stride, xs = dx_row_stride;
    switch (dtype) {
    case OPSMITH_DTYPE_F64: bwd_f64(rows, n, ga, grad, gs, dlogits, ds, dx, xs, t); break;
    case OPSMITH_DTYPE_F32: bwd_f32(rows, n, ga, grad, gs, dlogits, ds, dx, xs, t); break;
    case OPSMITH_DTYPE_F16: bwd_f16(rows, n, ga, grad, gs, dlogits, ds, dx, xs, t); break;
    case OPSMITH_DTYPE_BF16: bwd_bf16(rows, n, ga, grad, gs, dlogits, ds, dx, xs, t); break;
    default: return OPSMITH_STATUS_UNSUPPORTED_DTYPE;
    }
    return OPSMITH_STATUS_SUCCESS;
}
