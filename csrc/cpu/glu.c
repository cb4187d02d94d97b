/* Gated activations on the CPU: C11 + OpenMP, one pass over the rows.
 * gate, up, y, dy, dgate, dup, h are (rows, n) addressed through row
 * strides (the packed form is two pointers into one buffer). Work is split
 * into (row, column chunk) items so a few wide rows still use every thread.
 *
 * The activations run in float for f32/f16/bf16 through the vectorizable
 * exp of cpu_exp.h (libm's expf does not vectorize), in double through libm for
 * f64. Every element is read before the same element is written, and no
 * element is touched by two iterations, so the in-place forms (an output
 * that is exactly an input) are safe under `omp simd`. On x86-64 the row
 * kernels are compiled for AVX-512, AVX2+FMA and the baseline, and the
 * loader picks the best the machine has (target_clones). */
#include <math.h>

/* Floating-point exceptions are never inspected here, and without this GCC
 * keeps the selects of the loops below as branches, which do not vectorize. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include "convert.h"
#include "cpu_exp.h"
#include "cpu_load_store.h"
#include "internal/glu.h"

#include "convert_block.h"
#include "cpu_clones.h"

/* Columns a work item covers: big enough that the loop overhead vanishes,
 * small enough that a (1, 14336) decode row still splits across threads. */
#define GLU_CHUNK 4096

#define GELU_TANH_K 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_TANH_C 0.044715f
#define INV_SQRT2 0.7071067811865476f
#define INV_SQRT_2PI 0.3989422804014327f

/* silu(g) = g * sigmoid(g); slope = s (1 + g (1 - s)). */
static inline float silu_f32(float g, float *slope) {
    const float s = 1.0f / (1.0f + opsmith_exp_f32(-g));
    *slope = s * (1.0f + g * (1.0f - s));
    return g * s;
}

/* Phi(g) = erfc(-g / sqrt 2) / 2, with erfc(z) for z >= 0 from the
 * Chebyshev-fitted form t exp(-z^2 + P(t)), t = 1 / (1 + z/2) (relative
 * error below 1.2e-7), and erfc(-z) = 2 - erfc(z): computing the small
 * tail directly keeps gelu's far negative side accurate. */
static inline float gelu_f32(float g, float *slope) {
    const float z = fabsf(g) * INV_SQRT2;
    const float t = 1.0f / (1.0f + 0.5f * z);
    float p = 0.17087277f;
    p = p * t - 0.82215223f;
    p = p * t + 1.48851587f;
    p = p * t - 1.13520398f;
    p = p * t + 0.27886807f;
    p = p * t - 0.18628806f;
    p = p * t + 0.09678418f;
    p = p * t + 0.37409196f;
    p = p * t + 1.00002368f;
    p = p * t - 1.26551223f;
    const float tail = 0.5f * t * opsmith_exp_f32(p - z * z); /* Phi(-|g|) */
    const float cdf = g < 0.0f ? tail : 1.0f - tail;
    *slope = cdf + g * INV_SQRT_2PI * opsmith_exp_f32(-0.5f * g * g);
    return g * cdf;
}

/* gelu_tanh with tanh(u) = 1 - 2 / (e^{2u} + 1) (exact limits +-1). */
static inline float gelu_tanh_f32(float g, float *slope) {
    const float g2 = g * g;
    const float u = GELU_TANH_K * (g + GELU_TANH_C * g2 * g);
    const float th = 1.0f - 2.0f / (opsmith_exp_f32(2.0f * u) + 1.0f);
    *slope = 0.5f * (1.0f + th) + 0.5f * g * (1.0f - th * th) * GELU_TANH_K * (1.0f + 3.0f * GELU_TANH_C * g2);
    return 0.5f * g * (1.0f + th);
}

/* The same three in double, through libm (f64 is for checking, not speed). */
static inline double silu_f64(double g, double *slope) {
    const double s = 1.0 / (1.0 + exp(-g));
    *slope = s * (1.0 + g * (1.0 - s));
    return g * s;
}

static inline double gelu_f64(double g, double *slope) {
    const double cdf = 0.5 * erfc(-g * 0.7071067811865476);
    *slope = cdf + g * 0.3989422804014327 * exp(-0.5 * g * g);
    return g * cdf;
}

static inline double gelu_tanh_f64(double g, double *slope) {
    const double k = 0.7978845608028654, c = 0.044715;
    const double th = tanh(k * (g + c * g * g * g));
    *slope = 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th * th) * k * (1.0 + 3.0 * c * g * g);
    return 0.5 * g * (1.0 + th);
}

/* One (dtype, activation) pair: a forward and a backward over the columns
 * [c0, c1) of one row, stamped from one template. T is the storage type,
 * ACC the math type, ACT the activation (value returned, slope stored). */
#define DEFINE_GLU(NAME, T, ACC, LOAD, STORE, ACT)                                                  \
    OPSMITH_CPU_CLONES static void glu_fwd_span_##NAME(int64_t len, const T *g, const T *u, T *y) {         \
        _Pragma("omp simd")                                                                         \
        for (int64_t i = 0; i < len; i++) {                                                         \
            ACC slope;                                                                              \
            const ACC v = ACT(LOAD(g[i]), &slope);                                                  \
            y[i] = STORE(v * LOAD(u[i]));                                                           \
        }                                                                                           \
    }                                                                                               \
    OPSMITH_CPU_CLONES static void glu_bwd_span_##NAME(int64_t len, const T *dy, const T *g, const T *u,    \
                                               T *dg, T *du, T *h) {                                \
        if (h) {                                                                                    \
            _Pragma("omp simd")                                                                     \
            for (int64_t i = 0; i < len; i++) {                                                     \
                ACC slope;                                                                          \
                const ACC uv = LOAD(u[i]), d = LOAD(dy[i]);                                         \
                const ACC v = ACT(LOAD(g[i]), &slope);                                              \
                dg[i] = STORE(d * uv * slope);                                                      \
                du[i] = STORE(d * v);                                                               \
                h[i] = STORE(v * uv);                                                               \
            }                                                                                       \
        } else {                                                                                    \
            _Pragma("omp simd")                                                                     \
            for (int64_t i = 0; i < len; i++) {                                                     \
                ACC slope;                                                                          \
                const ACC uv = LOAD(u[i]), d = LOAD(dy[i]);                                         \
                const ACC v = ACT(LOAD(g[i]), &slope);                                              \
                dg[i] = STORE(d * uv * slope);                                                      \
                du[i] = STORE(d * v);                                                               \
            }                                                                                       \
        }                                                                                           \
    }

/* The 16-bit storage types go through float tiles: each tile is widened
 * into float arrays (convert_block.h: F16C for float16 where the CPU has
 * it), the float loop runs on them, and the results are rounded back. Each of the three loops then vectorizes at full width (a
 * loop mixing 16-bit and 32-bit lanes gets half-width vectors), and the
 * arithmetic is exactly the float kernel's. A whole tile of every input is
 * read before any output of it is written, so the in-place forms hold. */
#define TILE 512

#define DEFINE_GLU16(NAME, DT, ACT)                                                                 \
    OPSMITH_CPU_CLONES static void glu_fwd_span_##NAME(int64_t len, const uint16_t *g, const uint16_t *u,   \
                                               uint16_t *y) {                                       \
        float gf[TILE], uf[TILE];                                                                   \
        for (int64_t b = 0; b < len; b += TILE) {                                                   \
            const int m = len - b < TILE ? (int)(len - b) : TILE;                                   \
            opsmith_widen_f32(DT, g, b, m, gf); /* 16-bit: always into the buffer */                \
            opsmith_widen_f32(DT, u, b, m, uf);                                                     \
            _Pragma("omp simd")                                                                     \
            for (int i = 0; i < m; i++) {                                                           \
                float slope;                                                                        \
                gf[i] = ACT(gf[i], &slope) * uf[i];                                                 \
            }                                                                                       \
            opsmith_narrow_f32(DT, gf, y, b, m);                                                    \
        }                                                                                           \
    }                                                                                               \
    OPSMITH_CPU_CLONES static void glu_bwd_span_##NAME(int64_t len, const uint16_t *dy, const uint16_t *g,  \
                                               const uint16_t *u, uint16_t *dg, uint16_t *du,       \
                                               uint16_t *h) {                                       \
        float df[TILE], gf[TILE], uf[TILE], hf[TILE];                                               \
        for (int64_t b = 0; b < len; b += TILE) {                                                   \
            const int m = len - b < TILE ? (int)(len - b) : TILE;                                   \
            opsmith_widen_f32(DT, dy, b, m, df);                                                    \
            opsmith_widen_f32(DT, g, b, m, gf);                                                     \
            opsmith_widen_f32(DT, u, b, m, uf);                                                     \
            _Pragma("omp simd")                                                                     \
            for (int i = 0; i < m; i++) {                                                           \
                float slope;                                                                        \
                const float v = ACT(gf[i], &slope);                                                 \
                gf[i] = df[i] * uf[i] * slope;                                                      \
                hf[i] = v * uf[i];                                                                  \
                uf[i] = df[i] * v;                                                                  \
            }                                                                                       \
            opsmith_narrow_f32(DT, gf, dg, b, m);                                                   \
            opsmith_narrow_f32(DT, uf, du, b, m);                                                   \
            if (h) opsmith_narrow_f32(DT, hf, h, b, m);                                             \
        }                                                                                           \
    }

#define DEFINE_GLU_DTYPE(SUFFIX, T, ACC, LOAD, STORE, MATH)                                          \
    DEFINE_GLU(silu_##SUFFIX, T, ACC, LOAD, STORE, silu_##MATH)                                     \
    DEFINE_GLU(gelu_##SUFFIX, T, ACC, LOAD, STORE, gelu_##MATH)                                     \
    DEFINE_GLU(gelu_tanh_##SUFFIX, T, ACC, LOAD, STORE, gelu_tanh_##MATH)

#define DEFINE_GLU16_DTYPE(SUFFIX, DT)                                                               \
    DEFINE_GLU16(silu_##SUFFIX, DT, silu_f32)                                                       \
    DEFINE_GLU16(gelu_##SUFFIX, DT, gelu_f32)                                                       \
    DEFINE_GLU16(gelu_tanh_##SUFFIX, DT, gelu_tanh_f32)

DEFINE_GLU_DTYPE(f64, double, double, LOAD_F64, STORE_F64, f64)
DEFINE_GLU_DTYPE(f32, float, float, LOAD_F32, STORE_F32, f32)
DEFINE_GLU16_DTYPE(f16, OPSMITH_DTYPE_F16)
DEFINE_GLU16_DTYPE(bf16, OPSMITH_DTYPE_BF16)

/* The span kernels, typeless, indexed [activation][dtype]. */
typedef void (*fwd_span_fn)(int64_t, const void *, const void *, void *);
typedef void (*bwd_span_fn)(int64_t, const void *, const void *, const void *, void *, void *, void *);

#define FWD_ROW(A) {(fwd_span_fn)glu_fwd_span_##A##_f64, (fwd_span_fn)glu_fwd_span_##A##_f32, \
                    (fwd_span_fn)glu_fwd_span_##A##_f16, (fwd_span_fn)glu_fwd_span_##A##_bf16}
#define BWD_ROW(A) {(bwd_span_fn)glu_bwd_span_##A##_f64, (bwd_span_fn)glu_bwd_span_##A##_f32, \
                    (bwd_span_fn)glu_bwd_span_##A##_f16, (bwd_span_fn)glu_bwd_span_##A##_bf16}
static const fwd_span_fn FWD[OPSMITH_GLU_ACTIVATION_COUNT][4] = {FWD_ROW(silu), FWD_ROW(gelu), FWD_ROW(gelu_tanh)};
static const bwd_span_fn BWD[OPSMITH_GLU_ACTIVATION_COUNT][4] = {BWD_ROW(silu), BWD_ROW(gelu), BWD_ROW(gelu_tanh)};

/* (rows, n) as work items of at most GLU_CHUNK columns. When every operand
 * is contiguous (row stride n) the rows are one long row, so no item is a
 * short row tail. */
typedef struct plan {
    int64_t rows, n, chunks;
} plan;

static plan make_plan(int64_t rows, int64_t n, int contiguous) {
    plan p = {rows, n, 0};
    if (contiguous) p.n = rows * n, p.rows = 1;
    p.chunks = (p.n + GLU_CHUNK - 1) / GLU_CHUNK;
    return p;
}

#define AT(p, stride, r, c, size) ((p) ? (char *)(p) + ((r) * (stride) + (c)) * (int64_t)(size) : NULL)

opsmith_status opsmith_glu_fwd_cpu(opsmith_glu_activation activation, opsmith_dtype dtype, int64_t rows, int64_t n,
                                   const void *gate, int64_t gate_row_stride, const void *up, int64_t up_row_stride,
                                   void *y, int64_t y_row_stride) {
    opsmith_status s = opsmith_internal_glu_check("glu_fwd_cpu", activation, dtype, rows, n, 0, NULL, 0, gate,
                                                  gate_row_stride, up, up_row_stride, y, y_row_stride, NULL, 0,
                                                  NULL, 0);
    if (s != OPSMITH_STATUS_SUCCESS || rows == 0) return s;
    const int contiguous = gate_row_stride == n && up_row_stride == n && y_row_stride == n;
    const plan p = make_plan(rows, n, contiguous || rows == 1);
    const fwd_span_fn fn = FWD[activation][dtype];
    const size_t es = opsmith_dtype_size(dtype);
    const int64_t items = p.rows * p.chunks;
    const int threads = opsmith_internal_threads_for(rows * n);
#pragma omp parallel for schedule(static) num_threads(threads) if (items > 1)
    for (int64_t it = 0; it < items; it++) {
        const int64_t r = it / p.chunks, c0 = it % p.chunks * GLU_CHUNK;
        const int64_t len = p.n - c0 < GLU_CHUNK ? p.n - c0 : GLU_CHUNK;
        fn(len, AT(gate, gate_row_stride, r, c0, es), AT(up, up_row_stride, r, c0, es),
           AT(y, y_row_stride, r, c0, es));
    }
    return OPSMITH_STATUS_SUCCESS;
}

opsmith_status opsmith_glu_bwd_cpu(opsmith_glu_activation activation, opsmith_dtype dtype, int64_t rows, int64_t n,
                                   const void *dy, int64_t dy_row_stride, const void *gate, int64_t gate_row_stride,
                                   const void *up, int64_t up_row_stride, void *dgate, int64_t dgate_row_stride,
                                   void *dup, int64_t dup_row_stride, void *h, int64_t h_row_stride) {
    opsmith_status s = opsmith_internal_glu_check("glu_bwd_cpu", activation, dtype, rows, n, 1, dy, dy_row_stride,
                                                  gate, gate_row_stride, up, up_row_stride, dgate, dgate_row_stride,
                                                  dup, dup_row_stride, h, h_row_stride);
    if (s != OPSMITH_STATUS_SUCCESS || rows == 0) return s;
    const int contiguous = dy_row_stride == n && gate_row_stride == n && up_row_stride == n &&
                           dgate_row_stride == n && dup_row_stride == n && (!h || h_row_stride == n);
    const plan p = make_plan(rows, n, contiguous || rows == 1);
    const bwd_span_fn fn = BWD[activation][dtype];
    const size_t es = opsmith_dtype_size(dtype);
    const int64_t items = p.rows * p.chunks;
    const int threads = opsmith_internal_threads_for(rows * n);
#pragma omp parallel for schedule(static) num_threads(threads) if (items > 1)
    for (int64_t it = 0; it < items; it++) {
        const int64_t r = it / p.chunks, c0 = it % p.chunks * GLU_CHUNK;
        const int64_t len = p.n - c0 < GLU_CHUNK ? p.n - c0 : GLU_CHUNK;
        fn(len, AT(dy, dy_row_stride, r, c0, es), AT(gate, gate_row_stride, r, c0, es),
           AT(up, up_row_stride, r, c0, es), AT(dgate, dgate_row_stride, r, c0, es),
           AT(dup, dup_row_stride, r, c0, es), AT(h, h_row_stride, r, c0, es));
    }
    return OPSMITH_STATUS_SUCCESS;
}
