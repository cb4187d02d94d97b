/* cross_entropy on the CPU: C11 + OpenMP, one row a task. A row is read
 * three times (max and the smoothing sum; the exponential sum; the
 * gradient), each a fixed-lane loop the compiler can vectorize; a row of
 * the widest vocabularies (262144 bf16, 512 KB) stays in the core's cache
 * between the passes. Targets are checked, and the mean's denominator
 * summed, before any row runs, on the calling thread in row order (so the
 * results do not depend on the thread count). Formulas in
 * include/opsmith/cross_entropy.h. */
#include <math.h>

#include "convert.h"
#include "internal/cross_entropy.h"

#define LOAD_F64(p) (p)
#define STORE_F64(v) (v)
#define LOAD_F32(p) (p)
#define STORE_F32(v) (v)
#define LOAD_F16(p) opsmith_f16_to_f32(p)
#define STORE_F16(v) opsmith_f32_to_f16(v)
#define LOAD_BF16(p) opsmith_bf16_to_f32(p)
#define STORE_BF16(v) opsmith_f32_to_bf16(v)

#define LANES 8

/* T: storage type; ACC: accumulate type; LOAD/STORE convert one element;
 * EXP, LOG, TANH in ACC. */
#define DEFINE_CROSS_ENTROPY(SUFFIX, T, ACC, LOAD, STORE, EXP, LOG, TANH)                                      \
    /* softcapped logit */                                                                                      \
    static inline ACC cap_##SUFFIX(ACC v, ACC cap, ACC inv_cap) { return cap > 0 ? cap * TANH(v * inv_cap) : v; } \
                                                                                                                \
    /* lse of one row; *wy = sum_c w[c] y[c] when wy is not NULL */                                             \
    static ACC row_lse_##SUFFIX(int64_t n, const T *x, ACC cap, const ACC *w, ACC *wy) {                        \
        const ACC inv_cap = cap > 0 ? (ACC)1 / cap : (ACC)0;                                                    \
        ACC m[LANES], s[LANES], a[LANES];                                                                       \
        for (int k = 0; k < LANES; k++) m[k] = -INFINITY, s[k] = 0, a[k] = 0;                                   \
        int64_t i = 0;                                                                                          \
        for (; i + LANES <= n; i += LANES)                                                                      \
            for (int k = 0; k < LANES; k++) {                                                                   \
                const ACC y = cap_##SUFFIX(LOAD(x[i + k]), cap, inv_cap);                                       \
                m[k] = y > m[k] ? y : m[k];                                                                     \
                a[k] += (w ? w[i + k] : (ACC)1) * y;                                                            \
            }                                                                                                   \
        ACC mx = -INFINITY, sum_wy = 0;                                                                         \
        for (; i < n; i++) {                                                                                    \
            const ACC y = cap_##SUFFIX(LOAD(x[i]), cap, inv_cap);                                               \
            mx = y > mx ? y : mx;                                                                               \
            sum_wy += (w ? w[i] : (ACC)1) * y;                                                                  \
        }                                                                                                       \
        for (int k = 0; k < LANES; k++) mx = m[k] > mx ? m[k] : mx, sum_wy += a[k];                             \
        if (wy) *wy = sum_wy;                                                                                   \
        /* a row of -inf (or a NaN) gives NaN, as PyTorch */                                                    \
        const ACC base = isfinite(mx) ? mx : (ACC)0;                                                            \
        ACC total = 0;                                                                                          \
        i = 0;                                                                                                  \
        for (; i + LANES <= n; i += LANES)                                                                      \
            for (int k = 0; k < LANES; k++) s[k] += EXP(cap_##SUFFIX(LOAD(x[i + k]), cap, inv_cap) - base);     \
        for (; i < n; i++) total += EXP(cap_##SUFFIX(LOAD(x[i]), cap, inv_cap) - base);                         \
        for (int k = 0; k < LANES; k++) total += s[k];                                                          \
        return base + LOG(total);                                                                               \
    }                                                                                                           \
                                                                                                                \
    /* the gradient of one row (scaled by `scale`): formula in the header */                                    \
    static void row_grad_##SUFFIX(int64_t n, const T *x, int64_t t, ACC cap, const ACC *w, ACC lse, ACC coef,   \
                                  ACC smooth, ACC target_coef, ACC scale, T *d) {                               \
        const ACC inv_cap = cap > 0 ? (ACC)1 / cap : (ACC)0;                                                    \
        const ACC y_t = cap_##SUFFIX(LOAD(x[t]), cap, inv_cap);                                                 \
        int64_t i = 0;                                                                                          \
        for (; i + LANES <= n; i += LANES) {                                                                    \
            ACC g[LANES];                                                                                       \
            for (int k = 0; k < LANES; k++) {                                                                   \
                const ACC y = cap_##SUFFIX(LOAD(x[i + k]), cap, inv_cap);                                       \
                const ACC dy = cap > 0 ? (ACC)1 - (y * inv_cap) * (y * inv_cap) : (ACC)1;                       \
                g[k] = (EXP(y - lse) * coef - smooth * (w ? w[i + k] : (ACC)1)) * dy * scale;                   \
            }                                                                                                   \
            for (int k = 0; k < LANES; k++) d[i + k] = STORE(g[k]);                                             \
        }                                                                                                       \
        for (; i < n; i++) {                                                                                    \
            const ACC y = cap_##SUFFIX(LOAD(x[i]), cap, inv_cap);                                               \
            const ACC dy = cap > 0 ? (ACC)1 - (y * inv_cap) * (y * inv_cap) : (ACC)1;                           \
            d[i] = STORE((EXP(y - lse) * coef - smooth * (w ? w[i] : (ACC)1)) * dy * scale);                    \
        }                                                                                                       \
        /* the target's own term, after the sweep: d may be x (in place) */                                     \
        const ACC dy_t = cap > 0 ? (ACC)1 - (y_t * inv_cap) * (y_t * inv_cap) : (ACC)1;                         \
        d[t] = STORE((EXP(y_t - lse) * coef - smooth * (w ? w[t] : (ACC)1) - target_coef) * dy_t * scale);      \
    }                                                                                                           \
                                                                                                                \
    static opsmith_status fwd_##SUFFIX(int64_t rows, int64_t n, const T *x, int64_t xs, const int64_t *tg,      \
                                       int64_t ts, const ACC *w, int64_t ignore, ACC ls, ACC z, ACC cap, int red, \
                                       T *loss, T *zout, ACC *lse_out, T *dl, int64_t dls, int64_t *error,      \
                                       ACC *ws, int threads) {                                                  \
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
        ACC *loss_rows = ws, *z_rows = ws + rows;                                                               \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads) if(rows > 1 && rows * n > 65536)")  \
        for (int64_t r = 0; r < rows; r++) {                                                                    \
            const T *xr = x + r * xs;                                                                           \
            const int64_t t = tg[r * ts];                                                                       \
            ACC wy = 0;                                                                                         \
            const ACC lse = row_lse_##SUFFIX(n, xr, cap, w, ls > 0 ? &wy : NULL);                               \
            if (lse_out) lse_out[r] = lse;                                                                      \
            if (t == ignore) {                                                                                  \
                loss_rows[r] = 0, z_rows[r] = 0;                                                                \
                if (dl)                                                                                         \
                    for (int64_t c = 0; c < n; c++) dl[r * dls + c] = STORE((ACC)0);                            \
                continue;                                                                                       \
            }                                                                                                   \
            const ACC inv_cap = cap > 0 ? (ACC)1 / cap : (ACC)0;                                                \
            const ACC wt = w ? w[t] : (ACC)1, y_t = cap_##SUFFIX(LOAD(xr[t]), cap, inv_cap);                    \
            const ACC zl = z * lse * lse;                                                                       \
            ACC l = ((ACC)1 - ls) * wt * (lse - y_t) + zl;                                                      \
            if (ls > 0) l += ls_n * (wsum * lse - wy);                                                          \
            loss_rows[r] = l, z_rows[r] = zl;                                                                   \
            if (dl)                                                                                             \
                row_grad_##SUFFIX(n, xr, t, cap, w, lse, ((ACC)1 - ls) * wt + ls_n * wsum + 2 * z * lse, ls_n,  \
                                  ((ACC)1 - ls) * wt, scale, dl + r * dls);                                     \
        }                                                                                                       \
        if (red == OPSMITH_CROSS_ENTROPY_REDUCTION_NONE) {                                                      \
            for (int64_t r = 0; r < rows; r++) {                                                                \
                loss[r] = STORE(loss_rows[r]);                                                                  \
                if (zout) zout[r] = STORE(z_rows[r]);                                                           \
            }                                                                                                   \
        } else {                                                                                                \
            ACC total = 0, z_total = 0;                                                                         \
            for (int64_t r = 0; r < rows; r++) total += loss_rows[r], z_total += z_rows[r];                     \
            const ACC d = red == OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN ? denom : (ACC)1;                         \
            loss[0] = STORE(total / d);                                                                         \
            if (zout) zout[0] = STORE(z_total / d);                                                             \
        }                                                                                                       \
        return OPSMITH_STATUS_SUCCESS;                                                                          \
    }                                                                                                           \
                                                                                                                \
    static void bwd_##SUFFIX(int64_t rows, int64_t n, const T *g, int64_t gs, const T *d, int64_t ds, T *dx,     \
                             int64_t dxs, int threads) {                                                        \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(rows * n > 65536)")                  \
        for (int64_t r = 0; r < rows; r++) {                                                                    \
            const ACC s = LOAD(g[r * gs]);                                                                      \
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

DEFINE_CROSS_ENTROPY(f64, double, double, LOAD_F64, STORE_F64, exp, log, tanh)
DEFINE_CROSS_ENTROPY(f32, float, float, LOAD_F32, STORE_F32, expf, logf, tanhf)
DEFINE_CROSS_ENTROPY(f16, uint16_t, float, LOAD_F16, STORE_F16, expf, logf, tanhf)
DEFINE_CROSS_ENTROPY(bf16, uint16_t, float, LOAD_BF16, STORE_BF16, expf, logf, tanhf)

opsmith_status opsmith_cross_entropy_fwd_cpu(opsmith_dtype dtype, int64_t rows, int64_t n, const void *logits,
                                             int64_t logits_row_stride, const int64_t *target, int64_t target_stride,
                                             const void *weight, int64_t ignore_index, double label_smoothing,
                                             double z_loss, double softcap, opsmith_cross_entropy_reduction reduction,
                                             void *loss, void *z_out, void *lse, void *dlogits,
                                             int64_t dlogits_row_stride, int64_t *error, void *workspace,
                                             size_t workspace_bytes) {
    opsmith_status s = opsmith_internal_cross_entropy_fwd_check(
        "cross_entropy_fwd_cpu", dtype, rows, n, logits, logits_row_stride, target, label_smoothing, z_loss, softcap,
        (int)reduction, loss, dlogits, dlogits_row_stride, error, 0, workspace, workspace_bytes);
    if (s != OPSMITH_STATUS_SUCCESS) return s;
    const int t = opsmith_get_num_threads();
    const int64_t xs = logits_row_stride, ts = target_stride, ds = dlogits_row_stride;
    const int red = (int)reduction;
    const float ls = (float)label_smoothing, z = (float)z_loss, cap = (float)softcap;
    switch (dtype) {
    case OPSMITH_DTYPE_F64:
        return fwd_f64(rows, n, logits, xs, target, ts, weight, ignore_index, label_smoothing, z_loss, softcap, red,
                       loss, z_out, lse, dlogits, ds, error, workspace, t);
    case OPSMITH_DTYPE_F32:
        return fwd_f32(rows, n, logits, xs, target, ts, weight, ignore_index, ls, z, cap, red, loss, z_out, lse,
                       dlogits, ds, error, workspace, t);
    case OPSMITH_DTYPE_F16:
        return fwd_f16(rows, n, logits, xs, target, ts, weight, ignore_index, ls, z, cap, red, loss, z_out, lse,
                       dlogits, ds, error, workspace, t);
    case OPSMITH_DTYPE_BF16:
        return fwd_bf16(rows, n, logits, xs, target, ts, weight, ignore_index, ls, z, cap, red, loss, z_out, lse,
                        dlogits, ds, error, workspace, t);
    default: return OPSMITH_STATUS_UNSUPPORTED_DTYPE;
    }
}

opsmith_status opsmith_cross_entropy_bwd_cpu(opsmith_dtype dtype, int64_t rows, int64_t n, const void *grad,
                                             int64_t grad_stride, const void *dlogits, int64_t dlogits_row_stride,
                                             void *dx, int64_t dx_row_stride) {
    opsmith_status s = opsmith_internal_cross_entropy_bwd_check("cross_entropy_bwd_cpu", dtype, rows, n, grad,
                                                                grad_stride, dlogits, dlogits_row_stride, dx,
                                                                dx_row_stride);
    if (s != OPSMITH_STATUS_SUCCESS || rows == 0) return s;
    const int t = opsmith_get_num_threads();
    switch (dtype) {
    case OPSMITH_DTYPE_F64: bwd_f64(rows, n, grad, grad_stride, dlogits, dlogits_row_stride, dx, dx_row_stride, t); break;
    case OPSMITH_DTYPE_F32: bwd_f32(rows, n, grad, grad_stride, dlogits, dlogits_row_stride, dx, dx_row_stride, t); break;
    case OPSMITH_DTYPE_F16: bwd_f16(rows, n, grad, grad_stride, dlogits, dlogits_row_stride, dx, dx_row_stride, t); break;
    case OPSMITH_DTYPE_BF16: bwd_bf16(rows, n, grad, grad_stride, dlogits, dlogits_row_stride, dx, dx_row_stride, t); break;
    default: return OPSMITH_STATUS_UNSUPPORTED_DTYPE;
    }
    return OPSMITH_STATUS_SUCCESS;
}
