/* LayerNorm on the CPU: C11 + OpenMP over rows.
 * x, y, dy, dx are (rows, n) addressed through row strides; weight, bias,
 * dweight, dbias are (n); mean and rstd are (rows) in the accumulate type
 * (double for f64 x, float otherwise). Every loop reads an element before
 * it writes the same element, so y = x and dx = dy (in place) compute what
 * they would apart.
 *
 * The row loops are fixed-lane loops over branch-free conversions
 * (convert_lanes.h) so they vectorize; each row worker is compiled for
 * AVX-512, AVX2 and baseline x86-64, picked at run time. */
#include <math.h>
#include <stdlib.h>

#include "convert_lanes.h"
#include "internal/layer_norm.h"

#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
/* ISA levels, not arch= targets: an arch= clone may not inline the
 * conversions (a tuning mismatch), and a call in a loop stops it vectorizing */
#define LN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
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
 * interleaved partial sums (two to four vector registers, so as many
 * independent add chains hide the add latency), added pairwise; the block
 * sums in LANES more. Rounding error then grows with BLOCK / LANES +
 * n / (BLOCK * LANES) rather than n. */
#define LANES 32
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


/* Whole-row conversions for the 16-bit x types: their rows are converted
 * once into a float buffer, the passes run on the buffer, and y is
 * converted back once. f16 uses the F16C instructions where the CPU has
 * them (same rounding: nearest even, NaN quietened); the portable loops
 * vectorize otherwise. */
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define LN_HAVE_F16C 1
__attribute__((target("avx,f16c"))) static void f16_row_in_f16c(const uint16_t *s, float *d, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    for (; i < n; i++) d[i] = opsmith_lanes_f16_to_f32(s[i]);
}
__attribute__((target("avx,f16c"))) static void f16_row_out_f16c(const float *s, uint16_t *d, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) d[i] = opsmith_lanes_f32_to_f16(s[i]);
}
static int has_f16c(void) {
    static int cached = -1; /* benign race: every thread computes the same value */
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
    }
    return cached;
}
#else
#define LN_HAVE_F16C 0
#endif

LN_CLONES static void f16_row_in_portable(const uint16_t *s, float *d, int64_t n) {
    for (int64_t i = 0; i < n; i++) d[i] = opsmith_lanes_f16_to_f32(s[i]);
}
LN_CLONES static void f16_row_out_portable(const float *s, uint16_t *d, int64_t n) {
    for (int64_t i = 0; i < n; i++) d[i] = opsmith_lanes_f32_to_f16(s[i]);
}
static void f16_row_in(const uint16_t *s, float *d, int64_t n) {
#if LN_HAVE_F16C
    if (has_f16c()) {
        f16_row_in_f16c(s, d, n);
        return;
    }
#endif
    f16_row_in_portable(s, d, n);
}
static void f16_row_out(const float *s, uint16_t *d, int64_t n) {
#if LN_HAVE_F16C
    if (has_f16c()) {
        f16_row_out_f16c(s, d, n);
        return;
    }
#endif
    f16_row_out_portable(s, d, n);
}
LN_CLONES static void bf16_row_in(const uint16_t *s, float *d, int64_t n) {
    for (int64_t i = 0; i < n; i++) d[i] = opsmith_lanes_bf16_to_f32(s[i]);
}
LN_CLONES static void bf16_row_out(const float *s, uint16_t *d, int64_t n) {
    for (int64_t i = 0; i < n; i++) d[i] = opsmith_lanes_f32_to_bf16(s[i]);
}
/* stand-ins for the types that need no buffer (never called) */
static void none_row_in(const void *s, void *d, int64_t n) { (void)s, (void)d, (void)n; }
static void none_row_out(const void *s, void *d, int64_t n) { (void)s, (void)d, (void)n; }

/* Threads worth starting for `elements` of work: below ~32K elements a
 * thread, waking another costs more than it saves (and on a busy machine a
 * parallel region can wait a scheduler tick for a descheduled thread). */
#define LN_MIN_PER_THREAD 32768
static int ln_threads_for(int threads, int64_t elements) {
    const int64_t useful = elements / LN_MIN_PER_THREAD;
    return useful < 1 ? 1 : useful < threads ? (int)useful : threads;
}

/* a buffered value or the element itself (B is a constant: no branch left) */
#define LN_PICK(B, buffered, direct) ((B) ? (buffered) : (direct))
#define LN_PUT(B, buffered, direct, STORE, v) \
    do {                                      \
        if (B) (buffered) = (v);              \
        else (direct) = STORE(v);             \
    } while (0)

#define DEFINE_LAYER_NORM(SUFFIX, T, W, ACC, LOADX, STOREX, LOADW, STOREW, BUFFERED, ROW_IN, ROW_OUT) \
    /* BUFFERED (16-bit x): the first pass converts the row once into buf, the                       \
     * other passes read the converted values */                                                     \
    LN_CLONES static void ln_fwd_rows_##SUFFIX(int64_t r0, int64_t r1, int64_t n, const T *x,        \
                                               int64_t xs, const W *w, const W *b, ACC eps, T *y,    \
                                               int64_t ys, ACC *mean, ACC *rstd, ACC *buf) {         \
        for (int64_t r = r0; r < r1; r++) {                                                          \
            const T *xr = x + r * xs;                                                                \
            T *yr = y + r * ys;                                                                      \
            ACC sum, unused;                                                                         \
            if (BUFFERED) {                                                                          \
                ROW_IN((const void *)xr, (void *)buf, n);                                            \
                LN_ROW_SUMS(ACC, n, sum, unused, buf[j], (ACC)0);                                    \
            } else                                                                                   \
                LN_ROW_SUMS(ACC, n, sum, unused, (ACC)LOADX(xr[j]), (ACC)0);                         \
            const ACC mu = sum / (ACC)n;                                                             \
            ACC sq;                                                                                  \
            /* the second pass: squared deviations from the mean, no cancellation */                 \
            if (BUFFERED)                                                                            \
                LN_ROW_SUMS(ACC, n, sq, unused, (buf[j] - mu) * (buf[j] - mu), (ACC)0);              \
            else                                                                                     \
                LN_ROW_SUMS(ACC, n, sq, unused, ((ACC)LOADX(xr[j]) - mu) * ((ACC)LOADX(xr[j]) - mu), \
                            (ACC)0);                                                                 \
            (void)unused;                                                                            \
            const ACC rs = (ACC)1 / sqrt(sq / (ACC)n + eps);                                         \
            mean[r] = mu;                                                                            \
            rstd[r] = rs;                                                                            \
            if (BUFFERED) {                                                                          \
                if (w && b)                                                                          \
                    for (int64_t i = 0; i < n; i++) buf[i] = (buf[i] - mu) * rs * (ACC)LOADW(w[i]) + (ACC)LOADW(b[i]); \
                else if (w)                                                                          \
                    for (int64_t i = 0; i < n; i++) buf[i] = (buf[i] - mu) * rs * (ACC)LOADW(w[i]); \
                else if (b)                                                                          \
                    for (int64_t i = 0; i < n; i++) buf[i] = (buf[i] - mu) * rs + (ACC)LOADW(b[i]); \
                else                                                                                 \
                    for (int64_t i = 0; i < n; i++) buf[i] = (buf[i] - mu) * rs;                     \
                ROW_OUT((const void *)buf, (void *)yr, n);                                           \
                continue;                                                                            \
            }                                                                                        \
            if (w && b)                                                                              \
                for (int64_t i = 0; i < n; i++)                                                      \
                    yr[i] = STOREX(((ACC)LOADX(xr[i]) - mu) * rs * (ACC)LOADW(w[i]) + (ACC)LOADW(b[i])); \
            else if (w)                                                                              \
                for (int64_t i = 0; i < n; i++) yr[i] = STOREX(((ACC)LOADX(xr[i]) - mu) * rs * (ACC)LOADW(w[i])); \
            else if (b)                                                                              \
                for (int64_t i = 0; i < n; i++) yr[i] = STOREX(((ACC)LOADX(xr[i]) - mu) * rs + (ACC)LOADW(b[i])); \
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
                                               ACC *pw, ACC *pb, ACC *bx, ACC *bd) {                 \
        for (int64_t r = r0; r < r1; r++) {                                                          \
            const T *xr = x + r * xs, *dyr = dy + r * dys;                                           \
            T *dxr = dx + r * dxs;                                                                   \
            const ACC mu = mean[r], rs = rstd[r];                                                    \
            if (BUFFERED) { /* both rows converted once; dx goes over the dy buffer */               \
                ROW_IN((const void *)xr, (void *)bx, n);                                             \
                ROW_IN((const void *)dyr, (void *)bd, n);                                            \
            }                                                                                        \
            ACC sg, sgx;                                                                             \
            if (w)                                                                                   \
                LN_ROW_SUMS(ACC, n, sg, sgx, LN_PICK(BUFFERED, bd[j], (ACC)LOADX(dyr[j])) * (ACC)LOADW(w[j]),                  \
                            LN_PICK(BUFFERED, bd[j], (ACC)LOADX(dyr[j])) * (ACC)LOADW(w[j]) * (LN_PICK(BUFFERED, bx[j], (ACC)LOADX(xr[j])) - mu));       \
            else                                                                                     \
                LN_ROW_SUMS(ACC, n, sg, sgx, LN_PICK(BUFFERED, bd[j], (ACC)LOADX(dyr[j])),                                     \
                            LN_PICK(BUFFERED, bd[j], (ACC)LOADX(dyr[j])) * (LN_PICK(BUFFERED, bx[j], (ACC)LOADX(xr[j])) - mu));                          \
            const ACC mg = sg / (ACC)n, mgx = sgx * rs / (ACC)n;                                     \
            if (w && pw)                                                                             \
                for (int64_t i = 0; i < n; i++) {                                                    \
                    const ACC d = LN_PICK(BUFFERED, bd[i], (ACC)LOADX(dyr[i])), xh = (LN_PICK(BUFFERED, bx[i], (ACC)LOADX(xr[i])) - mu) * rs;            \
                    pw[i] += d * xh;                                                                 \
                    pb[i] += d;                                                                      \
                    LN_PUT(BUFFERED, bd[i], dxr[i], STOREX, rs * (d * (ACC)LOADW(w[i]) - mg - xh * mgx));                    \
                }                                                                                    \
            else if (w)                                                                              \
                for (int64_t i = 0; i < n; i++) {                                                    \
                    const ACC d = LN_PICK(BUFFERED, bd[i], (ACC)LOADX(dyr[i])), xh = (LN_PICK(BUFFERED, bx[i], (ACC)LOADX(xr[i])) - mu) * rs;            \
                    LN_PUT(BUFFERED, bd[i], dxr[i], STOREX, rs * (d * (ACC)LOADW(w[i]) - mg - xh * mgx));                    \
                }                                                                                    \
            else if (pw)                                                                             \
                for (int64_t i = 0; i < n; i++) {                                                    \
                    const ACC d = LN_PICK(BUFFERED, bd[i], (ACC)LOADX(dyr[i])), xh = (LN_PICK(BUFFERED, bx[i], (ACC)LOADX(xr[i])) - mu) * rs;            \
                    pw[i] += d * xh;                                                                 \
                    pb[i] += d;                                                                      \
                    LN_PUT(BUFFERED, bd[i], dxr[i], STOREX, rs * (d - mg - xh * mgx));                                                          \
                }                                                                                    \
            else                                                                                     \
                for (int64_t i = 0; i < n; i++) {                                                    \
                    const ACC d = LN_PICK(BUFFERED, bd[i], (ACC)LOADX(dyr[i])), xh = (LN_PICK(BUFFERED, bx[i], (ACC)LOADX(xr[i])) - mu) * rs;            \
                    LN_PUT(BUFFERED, bd[i], dxr[i], STOREX, rs * (d - mg - xh * mgx));                                                          \
                }                                                                                    \
            if (BUFFERED) ROW_OUT((const void *)bd, (void *)dxr, n);                                 \
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
    static opsmith_status ln_fwd_##SUFFIX(int64_t rows, int64_t n, const void *x, int64_t xs,         \
                                          const void *w,                                             \
                                const void *b, double eps, void *y, int64_t ys, void *mean,          \
                                void *rstd, int threads) {                                           \
        /* one contiguous range of rows a thread: the worker is called through                       \
         * its run-time dispatch once a range, not once a row */                                     \
        threads = ln_threads_for(threads, rows * n);                                                 \
        const int64_t parts = rows < threads ? rows : threads;                                       \
        int failed = 0;                                                                              \
        _Pragma("omp parallel for schedule(static) num_threads(threads) reduction(|: failed)")      \
        for (int64_t p = 0; p < parts; p++) {                                                        \
            ACC *buf = BUFFERED ? malloc((size_t)n * sizeof(ACC)) : NULL;                            \
            if (BUFFERED && !buf) {                                                                  \
                failed = 1;                                                                          \
                continue;                                                                            \
            }                                                                                        \
            ln_fwd_rows_##SUFFIX(rows * p / parts, rows * (p + 1) / parts, n, (const T *)x, xs,      \
                                 (const W *)w, (const W *)b, (ACC)eps, (T *)y, ys, (ACC *)mean,      \
                                 (ACC *)rstd, buf);                                                  \
            free(buf);                                                                               \
        }                                                                                            \
        return failed ? OPSMITH_STATUS_OUT_OF_MEMORY : OPSMITH_STATUS_SUCCESS;                       \
    }                                                                                                \
                                                                                                     \
    /* part is the workspace: (2, chunks, n) partial sums, zeroed here */                            \
    static opsmith_status ln_bwd_##SUFFIX(int64_t rows, int64_t n, const void *dy, int64_t dys, const void *x, \
                                int64_t xs, const void *w, const void *mean, const void *rstd,       \
                                void *dx, int64_t dxs, void *dw, void *db, void *part,               \
                                int threads) {                                                       \
        int failed = 0;                                                                              \
        /* the chunks below are fixed; only how many threads share them varies */                   \
        threads = ln_threads_for(threads, 2 * rows * n);                                             \
        if (!dw && !db) {                                                                            \
            const int64_t parts = rows < threads ? rows : threads;                                   \
            _Pragma("omp parallel for schedule(static) num_threads(threads) reduction(|: failed)")  \
            for (int64_t p = 0; p < parts; p++) {                                                    \
                ACC *bx = BUFFERED ? malloc(2 * (size_t)n * sizeof(ACC)) : NULL;                     \
                if (BUFFERED && !bx) {                                                               \
                    failed = 1;                                                                      \
                    continue;                                                                        \
                }                                                                                    \
                ln_bwd_rows_##SUFFIX(rows * p / parts, rows * (p + 1) / parts, n, (const T *)dy, dys, \
                                     (const T *)x, xs, (const W *)w, (const ACC *)mean,              \
                                     (const ACC *)rstd, (T *)dx, dxs, NULL, NULL, bx, bx ? bx + n : NULL); \
                free(bx);                                                                            \
            }                                                                                        \
            return failed ? OPSMITH_STATUS_OUT_OF_MEMORY : OPSMITH_STATUS_SUCCESS;                   \
        }                                                                                            \
        const int64_t chunks = rows < OPSMITH_LAYER_NORM_CPU_CHUNKS ? rows : OPSMITH_LAYER_NORM_CPU_CHUNKS; \
        ACC *pw = (ACC *)part, *pb = pw + chunks * n;                                                \
        _Pragma("omp parallel for schedule(static) num_threads(threads) reduction(|: failed)")      \
        for (int64_t c = 0; c < chunks; c++) {                                                       \
            ACC *bx = BUFFERED ? malloc(2 * (size_t)n * sizeof(ACC)) : NULL;                         \
            if (BUFFERED && !bx) {                                                                   \
                failed = 1;                                                                          \
                continue;                                                                            \
            }                                                                                        \
            for (int64_t i = 0; i < n; i++) pw[c * n + i] = 0, pb[c * n + i] = 0;                    \
            ln_bwd_rows_##SUFFIX(rows * c / chunks, rows * (c + 1) / chunks, n, (const T *)dy, dys,  \
                                 (const T *)x, xs, (const W *)w, (const ACC *)mean, (const ACC *)rstd, \
                                 (T *)dx, dxs, pw + c * n, pb + c * n, bx, bx ? bx + n : NULL);      \
            free(bx);                                                                                \
        }                                                                                            \
        if (failed) return OPSMITH_STATUS_OUT_OF_MEMORY;                                             \
        const int64_t cols = n < threads ? n : threads;                                              \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                            \
        for (int64_t p = 0; p < cols; p++) {                                                         \
            if (dw) ln_sum_chunks_##SUFFIX(n * p / cols, n * (p + 1) / cols, n, chunks, pw, (W *)dw); \
            if (db) ln_sum_chunks_##SUFFIX(n * p / cols, n * (p + 1) / cols, n, chunks, pb, (W *)db); \
        }                                                                                            \
        return OPSMITH_STATUS_SUCCESS;                                                               \
    }

#define NONE_IN(s, d, n) none_row_in(s, d, n)
#define NONE_OUT(s, d, n) none_row_out(s, d, n)
#define F16_IN(s, d, n) f16_row_in(s, d, n)
#define F16_OUT(s, d, n) f16_row_out(s, d, n)
#define BF16_IN(s, d, n) bf16_row_in(s, d, n)
#define BF16_OUT(s, d, n) bf16_row_out(s, d, n)
DEFINE_LAYER_NORM(f64, double, double, double, LOAD_F64, STORE_F64, LOAD_F64, STORE_F64, 0, NONE_IN, NONE_OUT)
DEFINE_LAYER_NORM(f64_f32, double, float, double, LOAD_F64, STORE_F64, LOAD_F32, STORE_F32, 0, NONE_IN, NONE_OUT)
DEFINE_LAYER_NORM(f32, float, float, float, LOAD_F32, STORE_F32, LOAD_F32, STORE_F32, 0, NONE_IN, NONE_OUT)
DEFINE_LAYER_NORM(f16, uint16_t, uint16_t, float, LOAD_F16, STORE_F16, LOAD_F16, STORE_F16, 1, F16_IN, F16_OUT)
DEFINE_LAYER_NORM(f16_f32, uint16_t, float, float, LOAD_F16, STORE_F16, LOAD_F32, STORE_F32, 1, F16_IN, F16_OUT)
DEFINE_LAYER_NORM(bf16, uint16_t, uint16_t, float, LOAD_BF16, STORE_BF16, LOAD_BF16, STORE_BF16, 1, BF16_IN, BF16_OUT)
DEFINE_LAYER_NORM(bf16_f32, uint16_t, float, float, LOAD_BF16, STORE_BF16, LOAD_F32, STORE_F32, 1, BF16_IN, BF16_OUT)

typedef opsmith_status (*ln_fwd_fn)(int64_t, int64_t, const void *, int64_t, const void *, const void *, double, void *,
                          int64_t, void *, void *, int);
typedef opsmith_status (*ln_bwd_fn)(int64_t, int64_t, const void *, int64_t, const void *, int64_t, const void *,
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
    s = fwd(rows, n, x, x_row_stride, weight, bias, eps, y, y_row_stride, mean, rstd, opsmith_get_num_threads());
    if (s != OPSMITH_STATUS_SUCCESS)
        return opsmith_internal_fail(s, "layer_norm_fwd_cpu: no host memory for a row buffer of %lld floats",
                                     (long long)n);
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
    s = bwd(rows, n, dy, dy_row_stride, x, x_row_stride, weight, mean, rstd, dx, dx_row_stride, dw, dbias, workspace,
            opsmith_get_num_threads());
    if (s != OPSMITH_STATUS_SUCCESS)
        return opsmith_internal_fail(s, "%s: no host memory for row buffers of %lld floats", op, (long long)(2 * n));
    return OPSMITH_STATUS_SUCCESS;
}
