/* LayerNorm on the CPU: C11 + OpenMP over rows.
 * x, y, dy, dx are (rows, n) addressed through row strides; weight, bias,
 * dweight, dbias are (n); mean and rstd are (rows) in the accumulate type
 * (double for f64 x, float otherwise). Every loop reads an element before
 * it writes the same element, so y = x and dx = dy (in place) compute what
 * they would apart.
 *
 * The row loops are fixed-lane loops over branch-free conversions
 * (convert_lanes.h) so they vectorize; each row worker is compiled for
 * AVX-512, AVX2+FMA+F16C and baseline x86-64, picked at run time. */
#include <math.h>

#include "convert_lanes.h"
#include "internal/layer_norm.h"

#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#define LN_CLONES __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
#else
#define LN_CLONES
#endif

#define LOAD_F64(v) (v)
#define LOAD_F32(v) (v)
#define LOAD_F16(v) opsmith_lanes_f16_to_f32(v)
#define LOAD_BF16(v) opsmith_lanes_bf16_to_f32(v)
#define STORE_F64(v) (v)
#define STORE_F32(v) (v)
#define STORE_F16(v) opsmith_lanes_f32_to_f16(v)
#define STORE_BF16(v) opsmith_lanes_f32_to_bf16(v)

/* Row sums run block by block: inside a block of BLOCK elements, LANES
 * interleaved partial sums (a vector register's worth or two), added
 * pairwise; the block sums in LANES more. Rounding error then grows with
 * BLOCK / LANES + n / (BLOCK * LANES) rather than n. */
#define LANES 16
#define BLOCK 512

/* acc[0..1] += the row sums of EXPR0 and EXPR1 over j in [0, n) (EXPR1 may
 * be 0: the compiler drops it), blocked as above. */
#define LN_ROW_SUMS(ACC, n, out0, out1, EXPR0, EXPR1)                                          \
    do {                                                                                       \
        ACC blk0[LANES] = {0}, blk1[LANES] = {0};                                              \
        for (int64_t b0 = 0, nb = 0; b0 < (n); b0 += BLOCK, nb++) {                            \
            const int64_t b1 = b0 + BLOCK < (n) ? b0 + BLOCK : (n);                            \
            ACC l0[LANES] = {0}, l1[LANES] = {0};                                              \
            int64_t i = b0;                                                                    \
            for (; i + LANES <= b1; i += LANES)                                                \
                for (int k = 0; k < LANES; k++) {                                              \
                    const int64_t j = i + k;                                                   \
                    l0[k] += (EXPR0);                                                          \
                    l1[k] += (EXPR1);                                                          \
                }                                                                              \
            for (int k = 0; i < b1; i++, k++) {                                                \
                const int64_t j = i;                                                           \
                l0[k] += (EXPR0);                                                              \
                l1[k] += (EXPR1);                                                              \
            }                                                                                  \
            for (int w_ = LANES / 2; w_ > 0; w_ /= 2)                                          \
                for (int k = 0; k < w_; k++) l0[k] += l0[k + w_], l1[k] += l1[k + w_];         \
            blk0[nb % LANES] += l0[0];                                                         \
            blk1[nb % LANES] += l1[0];                                                         \
        }                                                                                      \
        for (int w_ = LANES / 2; w_ > 0; w_ /= 2)                                              \
            for (int k = 0; k < w_; k++) blk0[k] += blk0[k + w_], blk1[k] += blk1[k + w_];     \
        (out0) = blk0[0];                                                                      \
        (out1) = blk1[0];                                                                      \
    } while (0)

#define DEFINE_LAYER_NORM(SUFFIX, T, W, ACC, LOADX, STOREX, LOADW, STOREW)                         \
    LN_CLONES static void ln_fwd_rows_##SUFFIX(int64_t r0, int64_t r1, int64_t n, const T *x,        \
                                               int64_t xs, const W *w, const W *b, ACC eps, T *y,    \
                                               int64_t ys, ACC *mean, ACC *rstd) {                   \
        for (int64_t r = r0; r < r1; r++) {                                                          \
            const T *xr = x + r * xs;                                                                \
            T *yr = y + r * ys;                                                                      \
            ACC sum, unused;                                                                         \
            LN_ROW_SUMS(ACC, n, sum, unused, (ACC)LOADX(xr[j]), (ACC)0);                             \
            const ACC mu = sum / (ACC)n;                                                             \
            ACC sq;                                                                                  \
            /* the second pass: squared deviations from the mean, no cancellation */                 \
            LN_ROW_SUMS(ACC, n, sq, unused, ((ACC)LOADX(xr[j]) - mu) * ((ACC)LOADX(xr[j]) - mu),     \
                        (ACC)0);                                                                     \
            (void)unused;                                                                            \
            const ACC rs = (ACC)1 / sqrt(sq / (ACC)n + eps);                                         \
            mean[r] = mu;                                                                            \
            rstd[r] = rs;                                                                            \
            if (w && b)                                                                              \
                for (int64_t i = 0; i < n; i++)                                                      \
                    yr[i] = STOREX(((ACC)LOADX(xr[i]) - mu) * rs * (ACC)LOADW(w[i]) + (ACC)LOADW(b[i])); \
            else if (w)                                                                              \
                for (int64_t i = 0; i < n; i++)                                                      \
                    yr[i] = STOREX(((ACC)LOADX(xr[i]) - mu) * rs * (ACC)LOADW(w[i]));                \
            else if (b)                                                                              \
                for (int64_t i = 0; i < n; i++)                                                      \
                    yr[i] = STOREX(((ACC)LOADX(xr[i]) - mu) * rs + (ACC)LOADW(b[i]));                \
            else                                                                                     \
                for (int64_t i = 0; i < n; i++) yr[i] = STOREX(((ACC)LOADX(xr[i]) - mu) * rs);      \
        }                                                                                            \
    }                                                                                                \
                                                                                                     \
    /* dx for rows [r0, r1); when pw is non-NULL, adds dy * xhat into pw and                         \
     * dy into pb (the chunk's partial rows) */                                                      \
    LN_CLONES static void ln_bwd_rows_##SUFFIX(int64_t r0, int64_t r1, int64_t n, const T *dy,       \
                                               int64_t dys, const T *x, int64_t xs, const W *w,      \
                                               const ACC *mean, const ACC *rstd, T *dx, int64_t dxs, \
                                               ACC *pw, ACC *pb) {                                   \
        for (int64_t r = r0; r < r1; r++) {                                                          \
            const T *xr = x + r * xs, *dyr = dy + r * dys;                                           \
            T *dxr = dx + r * dxs;                                                                   \
            const ACC mu = mean[r], rs = rstd[r];                                                    \
            ACC sg, sgx;                                                                             \
            if (w)                                                                                   \
                LN_ROW_SUMS(ACC, n, sg, sgx, (ACC)LOADX(dyr[j]) * (ACC)LOADW(w[j]),                  \
                            (ACC)LOADX(dyr[j]) * (ACC)LOADW(w[j]) * ((ACC)LOADX(xr[j]) - mu));       \
            else                                                                                     \
                LN_ROW_SUMS(ACC, n, sg, sgx, (ACC)LOADX(dyr[j]),                                     \
                            (ACC)LOADX(dyr[j]) * ((ACC)LOADX(xr[j]) - mu));                          \
            const ACC mg = sg / (ACC)n, mgx = sgx * rs / (ACC)n;                                     \
            if (w && pw)                                                                             \
                for (int64_t i = 0; i < n; i++) {                                                    \
                    const ACC d = (ACC)LOADX(dyr[i]), xh = ((ACC)LOADX(xr[i]) - mu) * rs;            \
                    pw[i] += d * xh;                                                                 \
                    pb[i] += d;                                                                      \
                    dxr[i] = STOREX(rs * (d * (ACC)LOADW(w[i]) - mg - xh * mgx));                    \
                }                                                                                    \
            else if (w)                                                                              \
                for (int64_t i = 0; i < n; i++) {                                                    \
                    const ACC d = (ACC)LOADX(dyr[i]), xh = ((ACC)LOADX(xr[i]) - mu) * rs;            \
                    dxr[i] = STOREX(rs * (d * (ACC)LOADW(w[i]) - mg - xh * mgx));                    \
                }                                                                                    \
            else if (pw)                                                                             \
                for (int64_t i = 0; i < n; i++) {                                                    \
                    const ACC d = (ACC)LOADX(dyr[i]), xh = ((ACC)LOADX(xr[i]) - mu) * rs;            \
                    pw[i] += d * xh;                                                                 \
                    pb[i] += d;                                                                      \
                    dxr[i] = STOREX(rs * (d - mg - xh * mgx));                                       \
                }                                                                                    \
            else                                                                                     \
                for (int64_t i = 0; i < n; i++) {                                                    \
                    const ACC d = (ACC)LOADX(dyr[i]), xh = ((ACC)LOADX(xr[i]) - mu) * rs;            \
                    dxr[i] = STOREX(rs * (d - mg - xh * mgx));                                       \
                }                                                                                    \
        }                                                                                            \
    }                                                                                                \
                                                                                                     \
    /* out[i] = sum over the chunks of part[c * n + i], in chunk order */                            \
    LN_CLONES static void ln_sum_chunks_##SUFFIX(int64_t i0, int64_t i1, int64_t n, int64_t chunks,  \
                                                 const ACC *part, W *out) {                          \
        for (int64_t i = i0; i < i1; i++) {                                                          \
            ACC s = 0;                                                                               \
            for (int64_t c = 0; c < chunks; c++) s += part[c * n + i];                               \
            out[i] = STOREW(s);                                                                      \
        }                                                                                            \
    }                                                                                                \
                                                                                                     \
    static void ln_fwd_##SUFFIX(int64_t rows, int64_t n, const void *x, int64_t xs, const void *w,   \
                                const void *b, double eps, void *y, int64_t ys, void *mean,          \
                                void *rstd, int threads) {                                           \
        /* one contiguous range of rows a thread: the worker is called through                       \
         * its run-time dispatch once a range, not once a row */                                     \
        const int64_t parts = rows < threads ? rows : threads;                                       \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                            \
        for (int64_t p = 0; p < parts; p++)                                                          \
            ln_fwd_rows_##SUFFIX(rows * p / parts, rows * (p + 1) / parts, n, (const T *)x, xs,      \
                                 (const W *)w, (const W *)b, (ACC)eps, (T *)y, ys, (ACC *)mean,      \
                                 (ACC *)rstd);                                                       \
    }                                                                                                \
                                                                                                     \
    /* part is the workspace: (2, chunks, n) partial sums, zeroed here */                            \
    static void ln_bwd_##SUFFIX(int64_t rows, int64_t n, const void *dy, int64_t dys, const void *x, \
                                int64_t xs, const void *w, const void *mean, const void *rstd,       \
                                void *dx, int64_t dxs, void *dw, void *db, void *part,               \
                                int threads) {                                                       \
        if (!dw && !db) {                                                                            \
            const int64_t parts = rows < threads ? rows : threads;                                   \
            _Pragma("omp parallel for schedule(static) num_threads(threads)")                        \
            for (int64_t p = 0; p < parts; p++)                                                      \
                ln_bwd_rows_##SUFFIX(rows * p / parts, rows * (p + 1) / parts, n, (const T *)dy, dys, \
                                     (const T *)x, xs, (const W *)w, (const ACC *)mean,              \
                                     (const ACC *)rstd, (T *)dx, dxs, NULL, NULL);                   \
            return;                                                                                  \
        }                                                                                            \
        const int64_t chunks = rows < OPSMITH_LAYER_NORM_CPU_CHUNKS ? rows : OPSMITH_LAYER_NORM_CPU_CHUNKS; \
        ACC *pw = (ACC *)part, *pb = pw + chunks * n;                                                \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                            \
        for (int64_t c = 0; c < chunks; c++) {                                                       \
            for (int64_t i = 0; i < n; i++) pw[c * n + i] = 0, pb[c * n + i] = 0;                    \
            ln_bwd_rows_##SUFFIX(rows * c / chunks, rows * (c + 1) / chunks, n, (const T *)dy, dys,  \
                                 (const T *)x, xs, (const W *)w, (const ACC *)mean, (const ACC *)rstd, \
                                 (T *)dx, dxs, pw + c * n, pb + c * n);                              \
        }                                                                                            \
        const int64_t cols = n < threads ? n : threads;                                              \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                            \
        for (int64_t p = 0; p < cols; p++) {                                                         \
            if (dw) ln_sum_chunks_##SUFFIX(n * p / cols, n * (p + 1) / cols, n, chunks, pw, (W *)dw); \
            if (db) ln_sum_chunks_##SUFFIX(n * p / cols, n * (p + 1) / cols, n, chunks, pb, (W *)db); \
        }                                                                                            \
    }

DEFINE_LAYER_NORM(f64, double, double, double, LOAD_F64, STORE_F64, LOAD_F64, STORE_F64)
DEFINE_LAYER_NORM(f64_f32, double, float, double, LOAD_F64, STORE_F64, LOAD_F32, STORE_F32)
DEFINE_LAYER_NORM(f32, float, float, float, LOAD_F32, STORE_F32, LOAD_F32, STORE_F32)
DEFINE_LAYER_NORM(f16, uint16_t, uint16_t, float, LOAD_F16, STORE_F16, LOAD_F16, STORE_F16)
DEFINE_LAYER_NORM(f16_f32, uint16_t, float, float, LOAD_F16, STORE_F16, LOAD_F32, STORE_F32)
DEFINE_LAYER_NORM(bf16, uint16_t, uint16_t, float, LOAD_BF16, STORE_BF16, LOAD_BF16, STORE_BF16)
DEFINE_LAYER_NORM(bf16_f32, uint16_t, float, float, LOAD_BF16, STORE_BF16, LOAD_F32, STORE_F32)

typedef void (*ln_fwd_fn)(int64_t, int64_t, const void *, int64_t, const void *, const void *, double, void *,
                          int64_t, void *, void *, int);
typedef void (*ln_bwd_fn)(int64_t, int64_t, const void *, int64_t, const void *, int64_t, const void *,
                          const void *, const void *, void *, int64_t, void *, void *, void *, int);

/* The kernels of a (checked) dtype pair: weight in x's dtype, or f32. */
static void kernels_of(opsmith_dtype xd, opsmith_dtype wd, ln_fwd_fn *fwd, ln_bwd_fn *bwd) {
    const int f32w = wd == OPSMITH_DTYPE_F32 && xd != OPSMITH_DTYPE_F32;
    switch (xd) {
    case OPSMITH_DTYPE_F64: *fwd = f32w ? ln_fwd_f64_f32 : ln_fwd_f64, *bwd = f32w ? ln_bwd_f64_f32 : ln_bwd_f64; break;
    case OPSMITH_DTYPE_F32: *fwd = ln_fwd_f32, *bwd = ln_bwd_f32; break;
    case OPSMITH_DTYPE_F16: *fwd = f32w ? ln_fwd_f16_f32 : ln_fwd_f16, *bwd = f32w ? ln_bwd_f16_f32 : ln_bwd_f16; break;
    default: *fwd = f32w ? ln_fwd_bf16_f32 : ln_fwd_bf16, *bwd = f32w ? ln_bwd_bf16_f32 : ln_bwd_bf16; break;
    }
}

opsmith_status opsmith_layer_norm_fwd_cpu(opsmith_dtype x_dtype, opsmith_dtype weight_dtype, int64_t rows, int64_t n,
                                          const void *x, int64_t x_row_stride, const void *weight, const void *bias,
                                          double eps, void *y, int64_t y_row_stride, void *mean, void *rstd) {
    const opsmith_layer_norm_args a = {"layer_norm_fwd_cpu", 0, x_dtype, weight_dtype, rows, n, x, x_row_stride,
                                       NULL, 0, weight, bias, eps, y, y_row_stride, mean, rstd, NULL, NULL};
    opsmith_status s = opsmith_internal_layer_norm_check(&a);
    if (s != OPSMITH_STATUS_SUCCESS || rows == 0) return s;
    ln_fwd_fn fwd;
    ln_bwd_fn bwd;
    kernels_of(x_dtype, weight_dtype, &fwd, &bwd);
    fwd(rows, n, x, x_row_stride, weight, bias, eps, y, y_row_stride, mean, rstd, opsmith_get_num_threads());
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
    const opsmith_layer_norm_args a = {op, 1, x_dtype, weight_dtype, rows, n, x, x_row_stride, dy, dy_row_stride,
                                       weight, NULL, 0.0, dx, dx_row_stride, mean, rstd, dw, dbias};
    opsmith_status s = opsmith_internal_layer_norm_check(&a);
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
    ln_fwd_fn fwd;
    ln_bwd_fn bwd;
    kernels_of(x_dtype, weight_dtype, &fwd, &bwd);
    bwd(rows, n, dy, dy_row_stride, x, x_row_stride, weight, mean, rstd, dx, dx_row_stride, dw, dbias, workspace,
        opsmith_get_num_threads());
    return OPSMITH_STATUS_SUCCESS;
}
