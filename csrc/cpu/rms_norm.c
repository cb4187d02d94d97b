/* RMSNorm on the CPU: C11 + OpenMP over rows.
 * x, y, dy, dx are (rows, n) addressed through row strides; weight, dweight
 * are (n); inv_rms is (rows) in the accumulate type (double for f64, float
 * otherwise). Every loop reads an element before it writes the same
 * element, so y = x and dx = dy (in place) compute what they would apart. */
#include <math.h>

#include "convert.h"
#include "internal/rms_norm.h"

/* Each storage type gets its own forward and backward, stamped from one
 * template: T is the storage type, ACC the accumulate type, LOAD/STORE
 * convert one element between them. */
#define LOAD_F64(p) (p)
#define STORE_F64(v) (v)
#define LOAD_F32(p) (p)
#define STORE_F32(v) (v)
#define LOAD_F16(p) opsmith_f16_to_f32(p)
#define STORE_F16(v) opsmith_f32_to_f16(v)
#define LOAD_BF16(p) opsmith_bf16_to_f32(p)
#define STORE_BF16(v) opsmith_f32_to_bf16(v)

/* Row sums run block by block: inside a block of BLOCK elements, LANES
 * interleaved partial sums added pairwise; the block sums in LANES more.
 * Rounding error then grows with BLOCK / LANES + n / (BLOCK * LANES)
 * rather than n, and the compiler can keep the lanes in vector registers. */
#define LANES 8
#define BLOCK 512

#define DEFINE_RMS_NORM(SUFFIX, T, ACC, LOAD, STORE)                                              \
    static ACC sum_lanes_##SUFFIX(ACC *l) {                                                       \
        for (int w = LANES / 2; w > 0; w /= 2)                                                    \
            for (int k = 0; k < w; k++) l[k] += l[k + w];                                         \
        return l[0];                                                                              \
    }                                                                                             \
                                                                                                  \
    /* sum_i a[i] * b[i] * (c ? c[i] : 1); b == a gives the sum of squares */                     \
    static ACC dot_##SUFFIX(const T *a, const T *b, const T *c, int64_t n) {                      \
        ACC blocks[LANES] = {0};                                                                  \
        for (int64_t b0 = 0, nb = 0; b0 < n; b0 += BLOCK, nb++) {                                 \
            const int64_t b1 = b0 + BLOCK < n ? b0 + BLOCK : n;                                   \
            ACC lanes[LANES] = {0};                                                               \
            if (c)                                                                                \
                for (int64_t i = b0; i < b1; i++)                                                 \
                    lanes[i % LANES] += LOAD(a[i]) * LOAD(b[i]) * LOAD(c[i]);                     \
            else                                                                                  \
                for (int64_t i = b0; i < b1; i++) lanes[i % LANES] += LOAD(a[i]) * LOAD(b[i]);   \
            blocks[nb % LANES] += sum_lanes_##SUFFIX(lanes);                                      \
        }                                                                                         \
        return sum_lanes_##SUFFIX(blocks);                                                        \
    }                                                                                             \
                                                                                                  \
    static ACC sum_squares_##SUFFIX(const T *x, int64_t n) { return dot_##SUFFIX(x, x, NULL, n); } \
                                                                                                  \
    static void rms_norm_fwd_##SUFFIX(int64_t rows, int64_t n, const T *x, int64_t xs,            \
                                      const T *w, ACC eps, T *y, int64_t ys, ACC *inv_rms,         \
                                      int threads) {                                              \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                         \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            const T *xr = x + r * xs;                                                             \
            T *yr = y + r * ys;                                                                   \
            ACC inv = (ACC)1 / sqrt(sum_squares_##SUFFIX(xr, n) / (ACC)n + eps);                  \
            inv_rms[r] = inv;                                                                     \
            if (w)                                                                                \
                for (int64_t i = 0; i < n; i++) yr[i] = STORE(LOAD(xr[i]) * inv * LOAD(w[i]));   \
            else                                                                                  \
                for (int64_t i = 0; i < n; i++) yr[i] = STORE(LOAD(xr[i]) * inv);                \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* dx for rows [r0, r1); adds dy * x * inv_rms into partial when it is non-NULL */             \
    static void rms_norm_bwd_rows_##SUFFIX(int64_t r0, int64_t r1, int64_t n, const T *dy,        \
                                           int64_t dys, const T *x, int64_t xs, const T *w,        \
                                           const ACC *inv_rms, T *dx, int64_t dxs, ACC *partial) { \
        for (int64_t r = r0; r < r1; r++) {                                                       \
            const T *xr = x + r * xs, *dyr = dy + r * dys;                                        \
            T *dxr = dx + r * dxs;                                                                \
            ACC inv = inv_rms[r];                                                                 \
            ACC scale = inv * inv * inv * dot_##SUFFIX(dyr, xr, w, n) / (ACC)n;                   \
            for (int64_t i = 0; i < n; i++) {                                                     \
                ACC g = LOAD(dyr[i]), xv = LOAD(xr[i]);                                           \
                if (partial) partial[i] += g * xv * inv;                                          \
                if (w) g *= LOAD(w[i]);                                                           \
                dxr[i] = STORE(inv * g - xv * scale);                                             \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* partial is the workspace: (chunks, n) sums, zeroed here */                                 \
    static void rms_norm_bwd_##SUFFIX(int64_t rows, int64_t n, const T *dy, int64_t dys,          \
                                      const T *x, int64_t xs, const T *w, const ACC *inv_rms,      \
                                      T *dx, int64_t dxs, T *dw, ACC *partial, int threads) {      \
        if (!dw) {                                                                                \
            _Pragma("omp parallel for schedule(static) num_threads(threads)")                     \
            for (int64_t r = 0; r < rows; r++)                                                    \
                rms_norm_bwd_rows_##SUFFIX(r, r + 1, n, dy, dys, x, xs, w, inv_rms, dx, dxs, NULL);\
            return;                                                                               \
        }                                                                                         \
        const int64_t chunks = rows < OPSMITH_RMS_NORM_CPU_DWEIGHT_CHUNKS                          \
                                   ? rows : OPSMITH_RMS_NORM_CPU_DWEIGHT_CHUNKS;                   \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                         \
        for (int64_t c = 0; c < chunks; c++) {                                                    \
            ACC *pc = partial + c * n;                                                            \
            for (int64_t i = 0; i < n; i++) pc[i] = 0;                                            \
            rms_norm_bwd_rows_##SUFFIX(rows * c / chunks, rows * (c + 1) / chunks, n, dy, dys, x,  \
                                       xs, w, inv_rms, dx, dxs, pc);                              \
        }                                                                                         \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                         \
        for (int64_t i = 0; i < n; i++) {                                                         \
            ACC s = 0;                                                                            \
            for (int64_t c = 0; c < chunks; c++) s += partial[c * n + i];                         \
            dw[i] = STORE(s);                                                                     \
        }                                                                                         \
    }

DEFINE_RMS_NORM(f64, double, double, LOAD_F64, STORE_F64)
DEFINE_RMS_NORM(f32, float, float, LOAD_F32, STORE_F32)
DEFINE_RMS_NORM(f16, uint16_t, float, LOAD_F16, STORE_F16)
DEFINE_RMS_NORM(bf16, uint16_t, float, LOAD_BF16, STORE_BF16)

opsmith_status opsmith_rms_norm_fwd_cpu(opsmith_dtype dtype, int64_t rows, int64_t n, const void *x,
                                        int64_t x_row_stride, const void *weight, double eps, void *y,
                                        int64_t y_row_stride, void *inv_rms) {
    opsmith_status s = opsmith_internal_rms_norm_check("rms_norm_fwd_cpu", dtype, rows, n, x, x_row_stride, 0, NULL, 0,
                                                       weight, eps, y, y_row_stride, inv_rms, NULL);
    if (s != OPSMITH_STATUS_SUCCESS || rows == 0) return s;
    const int t = opsmith_get_num_threads();
    const int64_t xs = x_row_stride, ys = y_row_stride;
    switch (dtype) {
    case OPSMITH_DTYPE_F64: rms_norm_fwd_f64(rows, n, x, xs, weight, eps, y, ys, inv_rms, t); break;
    case OPSMITH_DTYPE_F32: rms_norm_fwd_f32(rows, n, x, xs, weight, (float)eps, y, ys, inv_rms, t); break;
    case OPSMITH_DTYPE_F16: rms_norm_fwd_f16(rows, n, x, xs, weight, (float)eps, y, ys, inv_rms, t); break;
    case OPSMITH_DTYPE_BF16: rms_norm_fwd_bf16(rows, n, x, xs, weight, (float)eps, y, ys, inv_rms, t); break;
    default: return OPSMITH_STATUS_UNSUPPORTED_DTYPE;
    }
    return OPSMITH_STATUS_SUCCESS;
}

size_t opsmith_rms_norm_bwd_cpu_workspace_size(opsmith_dtype dtype, int64_t rows, int64_t n, const void *dy,
                                               int64_t dy_row_stride, const void *x, int64_t x_row_stride,
                                               const void *weight, const void *inv_rms, void *dx,
                                               int64_t dx_row_stride, void *dweight) {
    (void)dy, (void)dy_row_stride, (void)x, (void)x_row_stride, (void)inv_rms, (void)dx, (void)dx_row_stride;
    return opsmith_internal_rms_norm_bwd_cpu_workspace(dtype, rows, n, weight && dweight);
}

opsmith_status opsmith_rms_norm_bwd_cpu(opsmith_dtype dtype, int64_t rows, int64_t n, const void *dy,
                                        int64_t dy_row_stride, const void *x, int64_t x_row_stride,
                                        const void *weight, const void *inv_rms, void *dx, int64_t dx_row_stride,
                                        void *dweight, void *workspace, size_t workspace_bytes) {
    static const char op[] = "rms_norm_bwd_cpu";
    void *dw = weight ? dweight : NULL;
    opsmith_status s = opsmith_internal_rms_norm_check(op, dtype, rows, n, x, x_row_stride, 1, dy, dy_row_stride,
                                                       weight, 0.0, dx, dx_row_stride, inv_rms, dw);
    if (s != OPSMITH_STATUS_SUCCESS) return s;
    if (rows == 0) {
        /* no rows: the weight gradient is an empty sum */
        if (dw)
            for (int64_t i = 0; i < n; i++) opsmith_store_from_double(dtype, dw, i, 0.0);
        return OPSMITH_STATUS_SUCCESS;
    }
    s = opsmith_internal_check_workspace(op, workspace, workspace_bytes,
                                         opsmith_internal_rms_norm_bwd_cpu_workspace(dtype, rows, n, dw != NULL));
    if (s != OPSMITH_STATUS_SUCCESS) return s;
    const int t = opsmith_get_num_threads();
    const int64_t dys = dy_row_stride, xs = x_row_stride, dxs = dx_row_stride;
    switch (dtype) {
    case OPSMITH_DTYPE_F64: rms_norm_bwd_f64(rows, n, dy, dys, x, xs, weight, inv_rms, dx, dxs, dw, workspace, t); break;
    case OPSMITH_DTYPE_F32: rms_norm_bwd_f32(rows, n, dy, dys, x, xs, weight, inv_rms, dx, dxs, dw, workspace, t); break;
    case OPSMITH_DTYPE_F16: rms_norm_bwd_f16(rows, n, dy, dys, x, xs, weight, inv_rms, dx, dxs, dw, workspace, t); break;
    case OPSMITH_DTYPE_BF16: rms_norm_bwd_bf16(rows, n, dy, dys, x, xs, weight, inv_rms, dx, dxs, dw, workspace, t); break;
    default: return OPSMITH_STATUS_UNSUPPORTED_DTYPE;
    }
    return OPSMITH_STATUS_SUCCESS;
}
