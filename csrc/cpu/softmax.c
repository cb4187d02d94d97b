/* softmax and log_softmax on the CPU: C11 + OpenMP, one row a task. Every
 * pass is one fixed-lane loop over the row that reads each element in its
 * storage dtype, widens it in registers (bf16 a shift, f16 convert_block.h's
 * branch-free form) and does all of that pass's arithmetic before the next
 * element: no block buffers between the loads and the math, so the compiler
 * vectorizes each pass whole, the exponential included (libm's expf is a
 * scalar call). Forward: the max (64 lanes: max is exact in any order, the
 * lanes are only for independent chains); e = e^(x - max) and its sum,
 * e stored once (into y itself for f32/f64, a float row buffer on the stack
 * for f16/bf16 rows of up to ROW_KEEP, as rounding e to 16 bits before the
 * division would round twice; wider rows compute e again); the scale, fused
 * with the store in the output dtype. log_softmax: the sum without a store,
 * then x - lse. Backward: sum(dy * y) (sum(dy) for log_softmax), then the
 * write, each one read of y and dy. Every element is loaded before its own
 * output is stored, so y = x and dx = dy (in place) compute what they would
 * apart. Where the CPU has them, two dtypes take hand-vectorized paths (at
 * the end of the file), since GCC vectorizes neither conversion well: f16
 * through F16C, softmax's bf16 backward through AVX2 on 32-bit pairs; they
 * sum in the same lanes and give the same bits as the portable loops.
 * Formulas in include/opsmith/softmax.h. */
#include <math.h>
#include <stdint.h>

/* Floating-point exceptions are never inspected here, and without this GCC
 * keeps the selects of the exponential as branches on AVX2 and SSE2, which
 * do not vectorize. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include "convert_block.h"
#include "cpu_exp.h"
#include "cpu_load_store.h"
#include "cpu_rows.h"
#include "internal/softmax.h"

#define MAXL 64 /* lanes of the max */
#define LANES 32 /* lanes of the sums: 2 AVX-512 or 4 AVX2 registers of independent adds */
#define SERIAL 65536
#define ROW_KEEP 32768 /* floats: 128 KB of stack (a thread has megabytes under glibc) */

/* f16 through the branch-free conversions (convert.h's have branches and keep
 * the loops scalar); the same bits */
#define LOADV_F16(p) opsmith_block_f16_to_f32(p)
#define STOREV_F16(v) opsmith_block_f32_to_f16(v)

static inline double exp_f64(double v) { return exp(v); } /* f64 is for checking: libm */

/* T: storage type; ACC: math type; LOAD/STORE convert one element; EXP e^v
 * for v <= 0 (forward), EXPA e^v for any v (log_softmax backward: y is the
 * caller's). SAME: T is ACC (the output can hold e^(x - max) itself). */
#define DEFINE_SOFTMAX(SUFFIX, T, ACC, LOAD, STORE, EXP, EXPA, LOG, SAME)                                     \
    OPSMITH_CPU_CLONES static void fwd_row_##SUFFIX(int64_t n, const T *x, int lg, T *y) {                    \
        ACC m[MAXL], s[LANES];                                                                                \
        /* 16-bit storage: e^(x - max) kept in a float row buffer on the stack when the                       \
         * row fits (launchers allocate no memory), else computed again in the last pass */                   \
        ACC keep_row[SAME ? 1 : ROW_KEEP];                                                                    \
        ACC *const e_out = lg ? NULL : SAME ? (ACC *)(void *)y : n <= ROW_KEEP ? keep_row : NULL;             \
        for (int k = 0; k < MAXL; k++) m[k] = -INFINITY;                                                      \
        for (int k = 0; k < LANES; k++) s[k] = 0;                                                             \
        int64_t i = 0;                                                                                        \
        for (; i + MAXL <= n; i += MAXL) {                                                                    \
            _Pragma("omp simd") for (int k = 0; k < MAXL; k++) {                                              \
                const ACC v = LOAD(x[i + k]);                                                                 \
                m[k] = v > m[k] ? v : m[k];                                                                   \
            }                                                                                                 \
        }                                                                                                     \
        for (int k = 0; i < n; i++, k++) {                                                                    \
            const ACC v = LOAD(x[i]);                                                                         \
            m[k] = v > m[k] ? v : m[k];                                                                       \
        }                                                                                                     \
        ACC mx = -INFINITY;                                                                                   \
        for (int k = 0; k < MAXL; k++) mx = m[k] > mx ? m[k] : mx;                                            \
        /* e = e^(x - mx), summed in lanes; stored where the last pass will read it */                        \
        if (e_out) {                                                                                          \
            for (i = 0; i + LANES <= n; i += LANES) {                                                         \
                _Pragma("omp simd") for (int k = 0; k < LANES; k++) {                                         \
                    const ACC e = EXP(LOAD(x[i + k]) - mx);                                                   \
                    e_out[i + k] = e;                                                                         \
                    s[k] += e;                                                                                \
                }                                                                                             \
            }                                                                                                 \
            for (int k = 0; i < n; i++, k++) {                                                                \
                const ACC e = EXP(LOAD(x[i]) - mx);                                                           \
                e_out[i] = e;                                                                                 \
                s[k] += e;                                                                                    \
            }                                                                                                 \
        } else {                                                                                              \
            for (i = 0; i + LANES <= n; i += LANES) {                                                         \
                _Pragma("omp simd") for (int k = 0; k < LANES; k++) s[k] += EXP(LOAD(x[i + k]) - mx);         \
            }                                                                                                 \
            for (int k = 0; i < n; i++, k++) s[k] += EXP(LOAD(x[i]) - mx);                                    \
        }                                                                                                     \
        for (int w = LANES / 2; w > 0; w /= 2)                                                                \
            for (int k = 0; k < w; k++) s[k] += s[k + w];                                                     \
        const ACC total = s[0];                                                                               \
        if (lg) {                                                                                             \
            const ACC lse = mx + LOG(total);                                                                  \
            _Pragma("omp simd") for (int64_t j = 0; j < n; j++) y[j] = STORE(LOAD(x[j]) - lse);               \
            return;                                                                                           \
        }                                                                                                     \
        const ACC inv = (ACC)1 / total;                                                                       \
        if (e_out) {                                                                                          \
            _Pragma("omp simd") for (int64_t j = 0; j < n; j++) y[j] = STORE(e_out[j] * inv);                 \
        } else {                                                                                              \
            _Pragma("omp simd") for (int64_t j = 0; j < n; j++) y[j] = STORE(EXP(LOAD(x[j]) - mx) * inv);     \
        }                                                                                                     \
    }                                                                                                         \
                                                                                                              \
    OPSMITH_CPU_CLONES static void bwd_row_##SUFFIX(int64_t n, const T *g, const T *y, int lg, T *dx) {       \
        ACC s[LANES];                                                                                         \
        for (int k = 0; k < LANES; k++) s[k] = 0;                                                             \
        int64_t i = 0;                                                                                        \
        if (lg) {                                                                                             \
            for (; i + LANES <= n; i += LANES) {                                                              \
                _Pragma("omp simd") for (int k = 0; k < LANES; k++) s[k] += LOAD(g[i + k]);                   \
            }                                                                                                 \
            for (int k = 0; i < n; i++, k++) s[k] += LOAD(g[i]);                                              \
        } else {                                                                                              \
            for (; i + LANES <= n; i += LANES) {                                                              \
                _Pragma("omp simd") for (int k = 0; k < LANES; k++) s[k] += LOAD(g[i + k]) * LOAD(y[i + k]);  \
            }                                                                                                 \
            for (int k = 0; i < n; i++, k++) s[k] += LOAD(g[i]) * LOAD(y[i]);                                 \
        }                                                                                                     \
        for (int w = LANES / 2; w > 0; w /= 2)                                                                \
            for (int k = 0; k < w; k++) s[k] += s[k + w];                                                     \
        const ACC total = s[0];                                                                               \
        /* dx may be dy: each element is read before its own dx is written */                                 \
        if (lg) {                                                                                             \
            _Pragma("omp simd") for (int64_t j = 0; j < n; j++) dx[j] =                                       \
                STORE(LOAD(g[j]) - EXPA(LOAD(y[j])) * total);                                                 \
        } else {                                                                                              \
            _Pragma("omp simd") for (int64_t j = 0; j < n; j++) dx[j] = STORE(LOAD(y[j]) * (LOAD(g[j]) - total)); \
        }                                                                                                     \
    }                                                                                                         \
                                                                                                              \
    static void fwd_##SUFFIX(int64_t rows, int64_t n, const T *x, int64_t xs, int lg, T *y, int64_t ys,       \
                             int threads) {                                                                   \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1 && rows > 1 && rows * n > SERIAL)") \
        for (int64_t r = 0; r < rows; r++) fwd_row_##SUFFIX(n, x + r * xs, lg, y + r * ys);                   \
    }                                                                                                         \
                                                                                                              \
    static void bwd_##SUFFIX(int64_t rows, int64_t n, const T *g, int64_t gs, const T *y, int64_t ys, int lg, \
                             T *dx, int64_t dxs, int threads) {                                               \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1 && rows > 1 && rows * n > SERIAL)") \
        for (int64_t r = 0; r < rows; r++) bwd_row_##SUFFIX(n, g + r * gs, y + r * ys, lg, dx + r * dxs);     \
    }

DEFINE_SOFTMAX(f64, double, double, LOAD_F64, STORE_F64, exp_f64, exp_f64, log, 1)
DEFINE_SOFTMAX(f32, float, float, LOAD_F32, STORE_F32, opsmith_exp_nonpos_f32, opsmith_exp_f32, logf, 1)
DEFINE_SOFTMAX(f16, uint16_t, float, LOADV_F16, STOREV_F16, opsmith_exp_nonpos_f32, opsmith_exp_f32, logf, 0)
DEFINE_SOFTMAX(bf16, uint16_t, float, LOAD_BF16, STORE_BF16, opsmith_exp_nonpos_f32, opsmith_exp_f32, logf, 0)

/* f16 on a CPU with F16C: the conversions in hardware, 8 at a time, out of
 * line (convert_block.h), so the row goes through float buffers: the forward
 * widens the row (up to ROW_KEEP) into one, runs float's row worker in place
 * and narrows the result; the backward widens dy and y block by block. The
 * same bits as the inline path (the same lanes, the same rounding). */
#if OPSMITH_HAVE_F16C_PATH
#define F16_BLOCK 1024 /* a multiple of LANES: element i still sums into lane i % LANES */

/* the max of x[0, n) (NaN ignored, as in the other paths: max_ps returns its
 * second operand when one is NaN), the conversions inline */
__attribute__((target("avx2,f16c"))) static float max_f16_f16c(const uint16_t *x, int64_t n) {
#define F16X8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p)))
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        m0 = _mm256_max_ps(F16X8(x + i), m0);
        m1 = _mm256_max_ps(F16X8(x + i + 8), m1);
        m2 = _mm256_max_ps(F16X8(x + i + 16), m2);
        m3 = _mm256_max_ps(F16X8(x + i + 24), m3);
    }
#undef F16X8
    float m[8], mx = -INFINITY;
    _mm256_storeu_ps(m, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    for (int k = 0; k < 8; k++) mx = m[k] > mx ? m[k] : mx;
    for (; i < n; i++) {
        const float v = _cvtsh_ss(x[i]);
        mx = v > mx ? v : mx;
    }
    return mx;
}

/* y = f16(row * inv), the scale fused with the narrowing */
__attribute__((target("avx2,f16c"))) static void scale_narrow_f16c(const float *row, float inv, int64_t n,
                                                                   uint16_t *y) {
    const __m256 s = _mm256_set1_ps(inv);
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(void *)(y + i), _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(row + i), s), rn));
    for (; i < n; i++) y[i] = _cvtss_sh(row[i] * inv, rn);
}

/* the forward's three passes over blocks of the row widened into an L1 buffer;
 * e^(x - max) kept in a float row buffer for rows up to ROW_KEEP, else
 * computed again */
OPSMITH_CPU_CLONES static void fwd_row_f16_buf(int64_t n, const uint16_t *x, int lg, uint16_t *y) {
    float xb[F16_BLOCK], s[LANES];
    float keep_row[ROW_KEEP];
    float *const row = !lg && n <= ROW_KEEP ? keep_row : NULL;
    for (int k = 0; k < LANES; k++) s[k] = 0;
    const float mx = max_f16_f16c(x, n);
    for (int64_t b0 = 0; b0 < n; b0 += F16_BLOCK) {
        const int64_t len = n - b0 < F16_BLOCK ? n - b0 : F16_BLOCK;
        opsmith_widen_f16_f16c(x + b0, len, xb);
        float *const e = row ? row + b0 : xb;
        int64_t j = 0;
        for (; j + LANES <= len; j += LANES) {
#pragma omp simd
            for (int k = 0; k < LANES; k++) {
                const float v = opsmith_exp_nonpos_f32(xb[j + k] - mx);
                e[j + k] = v;
                s[k] += v;
            }
        }
        for (int k = 0; j < len; j++, k++) {
            const float v = opsmith_exp_nonpos_f32(xb[j] - mx);
            e[j] = v;
            s[k] += v;
        }
    }
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int k = 0; k < w; k++) s[k] += s[k + w];
    const float total = s[0], lse = mx + logf(total), inv = 1.0f / total;
    if (row) {
        scale_narrow_f16c(row, inv, n, y);
        return;
    }
    for (int64_t b0 = 0; b0 < n; b0 += F16_BLOCK) {
        const int64_t len = n - b0 < F16_BLOCK ? n - b0 : F16_BLOCK;
        opsmith_widen_f16_f16c(x + b0, len, xb);
        if (lg) {
#pragma omp simd
            for (int64_t j = 0; j < len; j++) xb[j] = xb[j] - lse;
        } else {
#pragma omp simd
            for (int64_t j = 0; j < len; j++) xb[j] = opsmith_exp_nonpos_f32(xb[j] - mx) * inv;
        }
        opsmith_narrow_f16_f16c(xb, len, y + b0); /* y may be x: this block of x is read */
    }
}

OPSMITH_CPU_CLONES static void bwd_row_f16_buf(int64_t n, const uint16_t *g, const uint16_t *y, int lg, uint16_t *dx) {
    float gb[F16_BLOCK], yb[F16_BLOCK], s[LANES];
    for (int k = 0; k < LANES; k++) s[k] = 0;
    for (int64_t b0 = 0; b0 < n; b0 += F16_BLOCK) {
        const int64_t len = n - b0 < F16_BLOCK ? n - b0 : F16_BLOCK;
        opsmith_widen_f16_f16c(g + b0, len, gb);
        if (lg) {
            OPSMITH_LANES_ADD(LANES, s, len, j, gb[j]);
        } else {
            opsmith_widen_f16_f16c(y + b0, len, yb);
            OPSMITH_LANES_ADD(LANES, s, len, j, gb[j] * yb[j]);
        }
    }
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int k = 0; k < w; k++) s[k] += s[k + w];
    const float total = s[0];
    for (int64_t b0 = 0; b0 < n; b0 += F16_BLOCK) {
        const int64_t len = n - b0 < F16_BLOCK ? n - b0 : F16_BLOCK;
        opsmith_widen_f16_f16c(g + b0, len, gb);
        opsmith_widen_f16_f16c(y + b0, len, yb);
        if (lg) {
            for (int64_t j = 0; j < len; j++) gb[j] = gb[j] - opsmith_exp_f32(yb[j]) * total;
        } else {
            for (int64_t j = 0; j < len; j++) gb[j] = yb[j] * (gb[j] - total);
        }
        opsmith_narrow_f16_f16c(gb, len, dx + b0); /* dx may be dy: this block of dy is read */
    }
}

/* softmax's backward, conversions inline: 8 elements a step in four
 * accumulators (the 32 lanes of the other paths: element i into lane i % 32,
 * a multiply then an add, so the same bits) */
__attribute__((target("avx2,f16c"))) static void bwd_row_f16_f16c(int64_t n, const uint16_t *g, const uint16_t *y,
                                                                  uint16_t *dx) {
#define F16X8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p)))
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(F16X8(g + i), F16X8(y + i)));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(F16X8(g + i + 8), F16X8(y + i + 8)));
        a2 = _mm256_add_ps(a2, _mm256_mul_ps(F16X8(g + i + 16), F16X8(y + i + 16)));
        a3 = _mm256_add_ps(a3, _mm256_mul_ps(F16X8(g + i + 24), F16X8(y + i + 24)));
    }
    float s[LANES];
    _mm256_storeu_ps(s, a0);
    _mm256_storeu_ps(s + 8, a1);
    _mm256_storeu_ps(s + 16, a2);
    _mm256_storeu_ps(s + 24, a3);
    for (int k = 0; i < n; i++, k++) s[k] += _cvtsh_ss(g[i]) * _cvtsh_ss(y[i]);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int k = 0; k < w; k++) s[k] += s[k + w];
    const __m256 t = _mm256_set1_ps(s[0]);
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    /* dx may be dy: each step reads its dy before it writes */
    for (i = 0; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(void *)(dx + i),
                         _mm256_cvtps_ph(_mm256_mul_ps(F16X8(y + i), _mm256_sub_ps(F16X8(g + i), t)), rn));
    for (; i < n; i++) dx[i] = _cvtss_sh(_cvtsh_ss(y[i]) * (_cvtsh_ss(g[i]) - s[0]), rn);
#undef F16X8
}

/* bf16's backward the same way under AVX2: widening is a shift or a mask,
 * narrowing convert.h's rounding, on the 32-bit pairs that hold two elements */
__attribute__((target("avx2"))) static void bwd_row_bf16_avx2(int64_t n, const uint16_t *g, const uint16_t *y,
                                                              uint16_t *dx) {
    /* elements as pairs (see the write below): a[0] holds the even elements of
     * each 32, a[1] the odd, a[2], a[3] those of the second 16; each
     * accumulator lane still sums the elements of one lane i % 32, in order */
    const __m256i top = _mm256_set1_epi32((int)0xffff0000u);
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        for (int h = 0; h < 2; h++) {
            const __m256i gp = _mm256_loadu_si256((const __m256i *)(const void *)(g + i + 16 * h));
            const __m256i yp = _mm256_loadu_si256((const __m256i *)(const void *)(y + i + 16 * h));
            a[2 * h] = _mm256_add_ps(a[2 * h], _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(gp, 16)),
                                                             _mm256_castsi256_ps(_mm256_slli_epi32(yp, 16))));
            a[2 * h + 1] = _mm256_add_ps(a[2 * h + 1], _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(gp, top)),
                                                                     _mm256_castsi256_ps(_mm256_and_si256(yp, top))));
        }
    }
    float s[LANES], part[LANES];
    for (int q = 0; q < 4; q++) _mm256_storeu_ps(part + 8 * q, a[q]);
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 8; j++) {
            s[16 * h + 2 * j] = part[16 * h + j];
            s[16 * h + 2 * j + 1] = part[16 * h + 8 + j];
        }
    for (int k = 0; i < n; i++, k++) s[k] += opsmith_bf16_to_f32(g[i]) * opsmith_bf16_to_f32(y[i]);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int k = 0; k < w; k++) s[k] += s[k + w];
    /* the write 16 elements a step as 8 pairs: a pair's 32 bits hold the odd
     * element's bf16 bits on top (masked: a float) and the even one's below
     * (shifted up: a float), so neither widening nor narrowing moves data
     * across lanes; each result is rounded in place (to nearest even, NaN
     * quietened: convert.h's rule) and the two halves joined */
    const __m256 t = _mm256_set1_ps(s[0]);
    const __m256i bias = _mm256_set1_epi32(0x7fff),
                  one = _mm256_set1_epi32(0x10000), absm = _mm256_set1_epi32(0x7fffffff),
                  inf = _mm256_set1_epi32(0x7f800000), quiet = _mm256_set1_epi32(0x00400000);
    for (i = 0; i + 16 <= n; i += 16) {
        const __m256i gp = _mm256_loadu_si256((const __m256i *)(const void *)(g + i));
        const __m256i yp = _mm256_loadu_si256((const __m256i *)(const void *)(y + i));
        __m256i r[2];
        for (int h = 0; h < 2; h++) {
            const __m256 gv = _mm256_castsi256_ps(h ? _mm256_and_si256(gp, top) : _mm256_slli_epi32(gp, 16));
            const __m256 yv = _mm256_castsi256_ps(h ? _mm256_and_si256(yp, top) : _mm256_slli_epi32(yp, 16));
            const __m256i u = _mm256_castps_si256(_mm256_mul_ps(yv, _mm256_sub_ps(gv, t)));
            /* + 0x7fff + the kept lowest bit (bit 16): the top 16 bits are then rounded */
            const __m256i rounded =
                _mm256_add_epi32(_mm256_add_epi32(u, bias), _mm256_srli_epi32(_mm256_and_si256(u, one), 16));
            const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absm), inf);
            r[h] = _mm256_blendv_epi8(rounded, _mm256_or_si256(u, quiet), nan);
        }
        _mm256_storeu_si256((__m256i *)(void *)(dx + i),
                            _mm256_or_si256(_mm256_and_si256(r[1], top), _mm256_srli_epi32(r[0], 16)));
    }
    for (; i < n; i++) dx[i] = opsmith_f32_to_bf16(opsmith_bf16_to_f32(y[i]) * (opsmith_bf16_to_f32(g[i]) - s[0]));
}

static int cpu_has_avx2(void) {
    static int has = -1; /* a benign race: every thread computes the same value */
    if (has < 0) has = __builtin_cpu_supports("avx2");
    return has;
}
#endif

static void bwd_bf16_any(int64_t rows, int64_t n, const uint16_t *g, int64_t gs, const uint16_t *y, int64_t ys,
                         int lg, uint16_t *dx, int64_t dxs, int threads) {
#if OPSMITH_HAVE_F16C_PATH
    if (!lg && cpu_has_avx2()) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1 && rows * n > SERIAL)
        for (int64_t r = 0; r < rows; r++) bwd_row_bf16_avx2(n, g + r * gs, y + r * ys, dx + r * dxs);
        return;
    }
#endif
    bwd_bf16(rows, n, g, gs, y, ys, lg, dx, dxs, threads);
}

static void fwd_f16_any(int64_t rows, int64_t n, const uint16_t *x, int64_t xs, int lg, uint16_t *y, int64_t ys,
                        int threads) {
#if OPSMITH_HAVE_F16C_PATH
    if (opsmith_cpu_has_f16c()) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1 && rows * n > SERIAL)
        for (int64_t r = 0; r < rows; r++) fwd_row_f16_buf(n, x + r * xs, lg, y + r * ys);
        return;
    }
#endif
    fwd_f16(rows, n, x, xs, lg, y, ys, threads);
}

static void bwd_f16_any(int64_t rows, int64_t n, const uint16_t *g, int64_t gs, const uint16_t *y, int64_t ys,
                        int lg, uint16_t *dx, int64_t dxs, int threads) {
#if OPSMITH_HAVE_F16C_PATH
    if (opsmith_cpu_has_f16c()) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1 && rows * n > SERIAL)
        for (int64_t r = 0; r < rows; r++) {
            if (lg) bwd_row_f16_buf(n, g + r * gs, y + r * ys, lg, dx + r * dxs);
            else bwd_row_f16_f16c(n, g + r * gs, y + r * ys, dx + r * dxs);
        }
        return;
    }
#endif
    bwd_f16(rows, n, g, gs, y, ys, lg, dx, dxs, threads);
}

opsmith_status opsmith_softmax_fwd_cpu(opsmith_dtype dtype, int64_t rows, int64_t n, const void *x,
                                       int64_t x_row_stride, int log, void *y, int64_t y_row_stride) {
    opsmith_status s = opsmith_internal_softmax_check("softmax_fwd_cpu", dtype, rows, n, x, x_row_stride, 0, NULL, 0,
                                                      y, y_row_stride);
    if (s != OPSMITH_STATUS_SUCCESS || rows == 0) return s;
    const int t = opsmith_get_num_threads(), lg = log != 0;
    switch (dtype) {
    case OPSMITH_DTYPE_F64: fwd_f64(rows, n, x, x_row_stride, lg, y, y_row_stride, t); break;
    case OPSMITH_DTYPE_F32: fwd_f32(rows, n, x, x_row_stride, lg, y, y_row_stride, t); break;
    case OPSMITH_DTYPE_F16: fwd_f16_any(rows, n, x, x_row_stride, lg, y, y_row_stride, t); break;
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
    case OPSMITH_DTYPE_F16: bwd_f16_any(rows, n, dy, gs, y, ys, lg, dx, ds, t); break;
    case OPSMITH_DTYPE_BF16: bwd_bf16_any(rows, n, dy, gs, y, ys, lg, dx, ds, t); break;
    default: return OPSMITH_STATUS_UNSUPPORTED_DTYPE;
    }
    return OPSMITH_STATUS_SUCCESS;
}
