/* The CPU matrix product of cpu_gemm.h, Goto/BLIS-structured in C11 + OpenMP.
 *
 * The output is cut into tasks of MC x NC; a task is one thread's and runs
 * the whole k loop for its tile, KC at a time: the task's MC x KC block of A
 * packed into micro-panels (MR rows interleaved: a[p][0..MR)), then, for
 * each NR columns, a KC x NR micro-panel of B packed (b[p][0..NR)) and the
 * register-blocked MR x NR micro-kernel run down the A block, adding into a
 * float (double) tile of the task that stays in cache across the k blocks.
 * The epilogue scales, adds the bias, accumulates and stores the tile in
 * the output's dtype. Packing absorbs the strides (so transposes are free)
 * and the widening of 16-bit operands; the pack buffers and the tile live
 * on the thread's stack (about 320 KiB).
 *
 * The micro-kernel is a fixed-lane loop nest that gcc unrolls into vector
 * FMAs held in registers: 8 x 32 floats (16 zmm accumulators) for AVX-512,
 * 4 x 24 (12 ymm) for AVX2 + FMA, 4 x 8 for SSE2; 4 x 24, 8 x 4 and 4 x 4
 * doubles. The path is picked at run time. Each output element is one
 * multiply-add chain over k in order whatever the tile, so the paths agree
 * except for FMA's single rounding, and the thread count changes nothing. */
#include <math.h>
#include <string.h>

#include "convert.h"
#include "cpu_gemm.h"

#define KC 128
#define NC 384 /* multiple of every path's NR */
#define MC_F 144 /* multiple of every path's MR */
#define MC_D 72

/* ---- element access by dtype --------------------------------------------- */

static inline float load_f(const void *p, opsmith_dtype dt, int64_t i) {
    switch (dt) {
    case OPSMITH_DTYPE_F32: return ((const float *)p)[i];
    case OPSMITH_DTYPE_F16: return opsmith_f16_to_f32(((const uint16_t *)p)[i]);
    case OPSMITH_DTYPE_BF16: return opsmith_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return (float)((const double *)p)[i];
    }
}

static inline double load_d(const void *p, opsmith_dtype dt, int64_t i) {
    return dt == OPSMITH_DTYPE_F64 ? ((const double *)p)[i] : (double)load_f(p, dt, i);
}

/* ---- packing, shared by every path -------------------------------------- */

/* Per operand storage type (SRC_T, widened by CONV): the loops run along
 * whichever stride is 1, with no per-element dispatch.
 * pack_a: dst = ceil(mc / mr) micro-panels of kc x mr (rows past mc zeros)
 * of A[i0 .. i0 + mc)[p0 .. p0 + kc). pack_b: dst = kc x nr of
 * B[p0 .. p0 + kc)[j0 .. j0 + cols), zeros past cols. */
#define DEFINE_PACK(S, T, SRC, SRC_T, CONV)                                                                   \
    NO_MEMCPY static void pack_a_##S##_##SRC(T *restrict dst, const opsmith_gemm_operand *a, int64_t i0, int64_t p0,    \
                                   int64_t mc, int64_t kc, int mr) {                                          \
        const SRC_T *src = (const SRC_T *)a->p;                                                               \
        const int64_t rs = a->rs, cs = a->cs;                                                                 \
        for (int64_t ir = 0; ir < mc; ir += mr) {                                                             \
            T *restrict d = dst + ir * kc;                                                                    \
            const int rows = mc - ir < mr ? (int)(mc - ir) : mr;                                              \
            if (cs == 1) {                                                                                    \
                for (int i = 0; i < rows; i++) {                                                              \
                    const SRC_T *restrict row = src + (i0 + ir + i) * rs + p0;                                \
                    for (int64_t p = 0; p < kc; p++) d[p * mr + i] = (T)CONV(row[p]);                         \
                }                                                                                             \
            } else {                                                                                          \
                for (int64_t p = 0; p < kc; p++) {                                                            \
                    const SRC_T *restrict col = src + (p0 + p) * cs + (i0 + ir) * rs;                         \
                    for (int i = 0; i < rows; i++) d[p * mr + i] = (T)CONV(col[i * rs]);                      \
                }                                                                                             \
            }                                                                                                 \
            if (rows < mr)                                                                                    \
                for (int64_t p = 0; p < kc; p++)                                                              \
                    for (int i = rows; i < mr; i++) d[p * mr + i] = 0;                                        \
        }                                                                                                     \
    }                                                                                                         \
                                                                                                              \
    NO_MEMCPY static void pack_b_##S##_##SRC(T *restrict dst, const opsmith_gemm_operand *b, int64_t p0, int64_t j0,    \
                                   int64_t kc, int cols, int nr) {                                            \
        const SRC_T *src = (const SRC_T *)b->p;                                                               \
        const int64_t rs = b->rs, cs = b->cs;                                                                 \
        if (cs == 1 || rs != 1) {                                                                             \
            for (int64_t p = 0; p < kc; p++) {                                                                \
                const SRC_T *restrict row = src + (p0 + p) * rs + j0 * cs;                                    \
                if (cs == 1)                                                                                  \
                    for (int j = 0; j < cols; j++) dst[p * nr + j] = (T)CONV(row[j]);                         \
                else                                                                                          \
                    for (int j = 0; j < cols; j++) dst[p * nr + j] = (T)CONV(row[j * cs]);                    \
            }                                                                                                 \
        } else {                                                                                              \
            for (int j = 0; j < cols; j++) {                                                                  \
                const SRC_T *restrict col = src + (j0 + j) * cs + p0;                                         \
                for (int64_t p = 0; p < kc; p++) dst[p * nr + j] = (T)CONV(col[p]);                           \
            }                                                                                                 \
        }                                                                                                     \
        if (cols < nr)                                                                                        \
            for (int64_t p = 0; p < kc; p++)                                                                  \
                for (int j = cols; j < nr; j++) dst[p * nr + j] = 0;                                          \
    }

#define SAME(x) (x)
/* a row of B is copied in an inline loop, not a memcpy call per row */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_MEMCPY __attribute__((optimize("no-tree-loop-distribute-patterns")))
#else
#define NO_MEMCPY
#endif
DEFINE_PACK(f, float, f32, float, SAME)
DEFINE_PACK(f, float, bf16, uint16_t, opsmith_bf16_to_f32)
DEFINE_PACK(f, float, f16, uint16_t, opsmith_f16_to_f32)
DEFINE_PACK(d, double, f64, double, SAME)

static void pack_a_f(float *dst, const opsmith_gemm_operand *a, int64_t i0, int64_t p0, int64_t mc, int64_t kc,
                     int mr) {
    if (a->dtype == OPSMITH_DTYPE_BF16) pack_a_f_bf16(dst, a, i0, p0, mc, kc, mr);
    else if (a->dtype == OPSMITH_DTYPE_F16) pack_a_f_f16(dst, a, i0, p0, mc, kc, mr);
    else pack_a_f_f32(dst, a, i0, p0, mc, kc, mr);
}

static void pack_b_f(float *dst, const opsmith_gemm_operand *b, int64_t p0, int64_t j0, int64_t kc, int cols,
                     int nr) {
    if (b->dtype == OPSMITH_DTYPE_BF16) pack_b_f_bf16(dst, b, p0, j0, kc, cols, nr);
    else if (b->dtype == OPSMITH_DTYPE_F16) pack_b_f_f16(dst, b, p0, j0, kc, cols, nr);
    else pack_b_f_f32(dst, b, p0, j0, kc, cols, nr);
}

#define pack_a_d pack_a_d_f64
#define pack_b_d pack_b_d_f64

/* ---- micro-kernels -------------------------------------------------------- */

/* c[i][j] (row stride ldc) = (first ? 0 : c[i][j]) + sum over p < kc of
 * a[p][i] b[p][j], in p order, for the MR x NR tile */
#define DEFINE_KERNEL(NAME, T, MR, NR, ATTR, MADD, UNROLL)                                                    \
    ATTR static void NAME(int64_t kc, const T *restrict a, const T *restrict b, T *restrict c, int64_t ldc,   \
                          int first) {                                                                        \
        T acc[MR][NR];                                                                                        \
        for (int i = 0; i < MR; i++)                                                                          \
            for (int j = 0; j < NR; j++) acc[i][j] = first ? (T)0 : c[i * ldc + j];                          \
        for (int64_t p = 0; p < kc; p++) {                                                                    \
            const T *bp = b + p * NR, *ap = a + p * MR;                                                       \
            UNROLL for (int i = 0; i < MR; i++) {                                                             \
                const T x = ap[i];                                                                            \
                UNROLL for (int j = 0; j < NR; j++) acc[i][j] = MADD(x, bp[j], acc[i][j]);                           \
            }                                                                                                 \
        }                                                                                                     \
        for (int i = 0; i < MR; i++)                                                                          \
            for (int j = 0; j < NR; j++) c[i * ldc + j] = acc[i][j];                                          \
    }

#define MUL_ADD(x, y, z) ((x) * (y) + (z))

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define X86_PATHS 1
#define ATTR_512 __attribute__((target("avx512f,avx512vl,fma")))
#define ATTR_256 __attribute__((target("avx2,fma")))
/* shapes and unrolling that gcc 12 turns into broadcast + FMA on whole
 * registers with no shuffles or spills in the k loop (objdump-checked;
 * others, e.g. 6 x 16 floats, get vectorized across k instead) */
#define FULL_UNROLL _Pragma("GCC unroll 32")
DEFINE_KERNEL(kernel_f_512, float, 8, 32, ATTR_512, fmaf, )
DEFINE_KERNEL(kernel_f_256, float, 4, 24, ATTR_256, fmaf, )
DEFINE_KERNEL(kernel_d_512, double, 4, 24, ATTR_512, fma, )
DEFINE_KERNEL(kernel_d_256, double, 8, 4, ATTR_256, fma, FULL_UNROLL)
#endif
DEFINE_KERNEL(kernel_f_base, float, 4, 8, , MUL_ADD, )
DEFINE_KERNEL(kernel_d_base, double, 4, 4, , MUL_ADD, )

typedef void (*kernel_f_fn)(int64_t, const float *, const float *, float *, int64_t, int);
typedef void (*kernel_d_fn)(int64_t, const double *, const double *, double *, int64_t, int);

/* 2: AVX-512F + FMA, 1: AVX2 + FMA, 0: neither; at most the tests' cap */
static int path_cap = 2;

static int cpu_level(void) {
#ifdef X86_PATHS
    static int level = -1; /* a race writes the same value */
    if (level < 0) {
        __builtin_cpu_init();
        const int fma3 = __builtin_cpu_supports("fma");
        level = fma3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") ? 2
                : fma3 && __builtin_cpu_supports("avx2")                                         ? 1
                                                                                                 : 0;
    }
    return level;
#else
    return 0;
#endif
}

static int isa_level(void) {
    const int l = cpu_level();
    return l < path_cap ? l : path_cap;
}

int opsmith_cpu_gemm_cap_path(int level) {
    path_cap = level < 0 ? 2 : level;
    return isa_level();
}

void opsmith_cpu_gemm_tile(int f64, int *mr, int *nr) {
    static const int tiles[2][3][2] = {{{4, 8}, {4, 24}, {8, 32}}, {{4, 4}, {8, 4}, {4, 24}}};
    const int l = isa_level();
    *mr = tiles[f64 != 0][l][0], *nr = tiles[f64 != 0][l][1];
}

/* ---- bf16 x bf16 on AVX512-BF16 ------------------------------------------ */

/* Both operands bf16 on a machine with VDPBF16PS: the micro-kernel takes k
 * two at a time, the products exact in float and added pair by pair (the
 * instruction's rounding; subnormals flushed), twice the multiply-adds of
 * an FMA a cycle. The panels hold k in pairs: a[p/2][i][p%2], b[p/2][j][p%2]
 * (an odd k's last pair padded with zero). An intrinsics kernel: gcc does
 * not vectorize to this instruction. */
#ifdef X86_PATHS
#include <immintrin.h>
#define ATTR_BF16 __attribute__((target("avx512f,avx512bf16")))
#define MR_BF16 8
#define NR_BF16 32

static int has_bf16_dot(void) {
    static int v = -1; /* a race writes the same value */
    if (v < 0) v = cpu_level() == 2 && __builtin_cpu_supports("avx512bf16");
    return v && isa_level() == 2;
}

/* the pair (x[0], x[1]) as one 32-bit word, x[0] in the low half (x86: little-endian) */
static inline uint32_t pair_at(const uint16_t *x) {
    uint32_t v;
    memcpy(&v, x, 4);
    return v;
}

static inline uint32_t pair_of(uint16_t lo, uint16_t hi) { return (uint32_t)lo | (uint32_t)hi << 16; }

/* full panels (every row, even kc) along the unit stride; the rest element by element */
NO_MEMCPY static void pack_a_pairs(uint16_t *restrict dst, const opsmith_gemm_operand *a, int64_t i0, int64_t p0,
                                   int64_t mc, int64_t kc) {
    const uint16_t *src = (const uint16_t *)a->p;
    const int64_t kp = (kc + 1) & ~(int64_t)1, rs = a->rs, cs = a->cs;
    for (int64_t ir = 0; ir < mc; ir += MR_BF16) {
        uint16_t *restrict d = dst + ir * kp;
        uint32_t *restrict d32 = (uint32_t *)(void *)d;
        const int rows = mc - ir < MR_BF16 ? (int)(mc - ir) : MR_BF16;
        if (rows == MR_BF16 && kp == kc && cs == 1) {
            for (int i = 0; i < MR_BF16; i++) {
                const uint16_t *row = src + (i0 + ir + i) * rs + p0;
                for (int64_t q = 0; q < kc / 2; q++) d32[q * MR_BF16 + i] = pair_at(row + 2 * q);
            }
        } else if (rows == MR_BF16 && kp == kc && rs == 1) {
            for (int64_t q = 0; q < kc / 2; q++) {
                const uint16_t *x0 = src + (p0 + 2 * q) * cs + i0 + ir, *x1 = x0 + cs;
                for (int i = 0; i < MR_BF16; i++) d32[q * MR_BF16 + i] = pair_of(x0[i], x1[i]);
            }
        } else {
            for (int64_t p = 0; p < kp; p++)
                for (int i = 0; i < MR_BF16; i++)
                    d[(p >> 1) * 2 * MR_BF16 + 2 * i + (p & 1)] =
                        i < rows && p < kc ? src[(i0 + ir + i) * rs + (p0 + p) * cs] : 0;
        }
    }
}

NO_MEMCPY static void pack_b_pairs(uint16_t *restrict dst, const opsmith_gemm_operand *b, int64_t p0, int64_t j0,
                                   int64_t kc, int cols) {
    const uint16_t *src = (const uint16_t *)b->p;
    const int64_t kp = (kc + 1) & ~(int64_t)1, rs = b->rs, cs = b->cs;
    uint32_t *restrict d32 = (uint32_t *)(void *)dst;
    if (cols == NR_BF16 && kp == kc && rs == 1) {
        for (int j = 0; j < NR_BF16; j++) {
            const uint16_t *col = src + (j0 + j) * cs + p0;
            for (int64_t q = 0; q < kc / 2; q++) d32[q * NR_BF16 + j] = pair_at(col + 2 * q);
        }
    } else if (cols == NR_BF16 && kp == kc && cs == 1) {
        for (int64_t q = 0; q < kc / 2; q++) {
            const uint16_t *x0 = src + (p0 + 2 * q) * rs + j0, *x1 = x0 + rs;
            for (int j = 0; j < NR_BF16; j++) d32[q * NR_BF16 + j] = pair_of(x0[j], x1[j]);
        }
    } else {
        for (int64_t p = 0; p < kp; p++)
            for (int j = 0; j < NR_BF16; j++)
                dst[(p >> 1) * 2 * NR_BF16 + 2 * j + (p & 1)] =
                    j < cols && p < kc ? src[(p0 + p) * rs + (j0 + j) * cs] : 0;
    }
}

/* c[i][j] (row stride ldc) = (first ? 0 : c[i][j]) + the kc2 pairs' products */
ATTR_BF16 static void kernel_bf16(int64_t kc2, const uint16_t *restrict a, const uint16_t *restrict b,
                                  float *restrict c, int64_t ldc, int first) {
    __m512 acc[MR_BF16][2];
    for (int i = 0; i < MR_BF16; i++)
        for (int h = 0; h < 2; h++) acc[i][h] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc + 16 * h);
    for (int64_t p = 0; p < kc2; p++) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * 2 * NR_BF16);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + p * 2 * NR_BF16 + 32);
        for (int i = 0; i < MR_BF16; i++) {
            int32_t pair;
            memcpy(&pair, a + p * 2 * MR_BF16 + 2 * i, 4);
            const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, b1);
        }
    }
    for (int i = 0; i < MR_BF16; i++)
        for (int h = 0; h < 2; h++) _mm512_storeu_ps(c + i * ldc + 16 * h, acc[i][h]);
}
#endif

/* ---- the driver ----------------------------------------------------------- */

#define DEFINE_GEMM(S, T, MC, SUFFIX)                                                                         \
    /* the tile's first mc x nc stored into out at (i0, j0) */                                                \
    static void epilogue_##S(const T *tile, int64_t i0, int64_t j0, int64_t mc, int64_t nc,                   \
                             const opsmith_gemm_out *o) {                                                     \
        const T alpha = (T)o->alpha;                                                                          \
        T row[NC], bias[NC];                                                                                  \
        if (o->bias)                                                                                          \
            for (int64_t j = 0; j < nc; j++) bias[j] = (T)load_##S(o->bias, o->bias_dtype, j0 + j);          \
        for (int64_t i = 0; i < mc; i++) {                                                                    \
            const int64_t at = (i0 + i) * o->ld + j0;                                                         \
            for (int64_t j = 0; j < nc; j++) row[j] = alpha * tile[i * NC + j];                               \
            if (o->bias)                                                                                      \
                for (int64_t j = 0; j < nc; j++) row[j] += bias[j];                                           \
            if (o->accumulate)                                                                                \
                for (int64_t j = 0; j < nc; j++) row[j] += (T)load_##S(o->p, o->dtype, at + j);              \
            switch (o->dtype) {                                                                               \
            case OPSMITH_DTYPE_F64:                                                                           \
                for (int64_t j = 0; j < nc; j++) ((double *)o->p)[at + j] = (double)row[j];                   \
                break;                                                                                        \
            case OPSMITH_DTYPE_F32:                                                                           \
                for (int64_t j = 0; j < nc; j++) ((float *)o->p)[at + j] = (float)row[j];                     \
                break;                                                                                        \
            case OPSMITH_DTYPE_F16:                                                                           \
                for (int64_t j = 0; j < nc; j++) ((uint16_t *)o->p)[at + j] = opsmith_f32_to_f16((float)row[j]); \
                break;                                                                                        \
            default:                                                                                          \
                for (int64_t j = 0; j < nc; j++)                                                              \
                    ((uint16_t *)o->p)[at + j] = opsmith_f32_to_bf16((float)row[j]);                          \
                break;                                                                                        \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
                                                                                                              \
    void opsmith_cpu_gemm_##SUFFIX(int64_t m, int64_t n, int64_t k, opsmith_gemm_operand a,                   \
                                   opsmith_gemm_operand b, const opsmith_gemm_out *out, int threads) {        \
        if (m <= 0 || n <= 0) return;                                                                         \
        BF16_DIVERT_##S                                                                                       \
        kernel_##S##_fn kernel = kernel_##S##_base;                                                           \
        int mr, nr;                                                                                           \
        opsmith_cpu_gemm_tile(sizeof(T) == 8, &mr, &nr);                                                      \
        KERNEL_PICK_##S                                                                                       \
        const int64_t tm = (m + MC - 1) / MC, tn = (n + NC - 1) / NC, tasks = tm * tn;                        \
        const double flops = 2.0 * (double)m * (double)n * (double)(k > 0 ? k : 1);                           \
        if (threads < 1) threads = 1;                                                                         \
        /* consecutive tasks share their columns of B, so a thread finds them in cache */                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1 && flops > 2e6)")      \
        for (int64_t t = 0; t < tasks; t++) {                                                                 \
            _Alignas(64) T abuf[MC * KC];                                                                     \
            _Alignas(64) T bbuf[KC * 32];                                                                     \
            _Alignas(64) T tile[MC * NC];                                                                     \
            const int64_t i0 = (t % tm) * MC, j0 = (t / tm) * NC;                                             \
            const int64_t mc = m - i0 < MC ? m - i0 : MC, nc = n - j0 < NC ? n - j0 : NC;                     \
            if (k <= 0) memset(tile, 0, sizeof tile);                                                         \
            for (int64_t p0 = 0; p0 < k; p0 += KC) {                                                          \
                const int64_t kc = k - p0 < KC ? k - p0 : KC;                                                 \
                pack_a_##S(abuf, &a, i0, p0, mc, kc, mr);                                                     \
                for (int64_t jr = 0; jr < nc; jr += nr) {                                                     \
                    pack_b_##S(bbuf, &b, p0, j0 + jr, kc, nc - jr < nr ? (int)(nc - jr) : nr, nr);           \
                    for (int64_t ir = 0; ir < mc; ir += mr)                                                   \
                        kernel(kc, abuf + ir * kc, bbuf, tile + ir * NC + jr, NC, p0 == 0);                   \
                }                                                                                             \
            }                                                                                                 \
            epilogue_##S(tile, i0, j0, mc, nc, out);                                                          \
        }                                                                                                     \
    }

#ifdef X86_PATHS
#define KERNEL_PICK_f                                                                                         \
    if (isa_level() == 2) kernel = kernel_f_512;                                                              \
    else if (isa_level() == 1) kernel = kernel_f_256;
#define KERNEL_PICK_d                                                                                         \
    if (isa_level() == 2) kernel = kernel_d_512;                                                              \
    else if (isa_level() == 1) kernel = kernel_d_256;
#else
#define KERNEL_PICK_f
#define KERNEL_PICK_d
#endif

#ifdef X86_PATHS
static void gemm_bf16(int64_t m, int64_t n, int64_t k, opsmith_gemm_operand a, opsmith_gemm_operand b,
                      const opsmith_gemm_out *out, int threads);
#define BF16_DIVERT_f                                                                                         \
    if (a.dtype == OPSMITH_DTYPE_BF16 && b.dtype == OPSMITH_DTYPE_BF16 && has_bf16_dot()) {                   \
        gemm_bf16(m, n, k, a, b, out, threads);                                                               \
        return;                                                                                               \
    }
#else
#define BF16_DIVERT_f
#endif
#define BF16_DIVERT_d

DEFINE_GEMM(f, float, MC_F, f32)
DEFINE_GEMM(d, double, MC_D, f64)

#ifdef X86_PATHS
/* opsmith_cpu_gemm_f32's driver with the bf16 pair panels and kernel */
static void gemm_bf16(int64_t m, int64_t n, int64_t k, opsmith_gemm_operand a, opsmith_gemm_operand b,
                      const opsmith_gemm_out *out, int threads) {
    const int64_t tm = (m + MC_F - 1) / MC_F, tn = (n + NC - 1) / NC, tasks = tm * tn;
    const double flops = 2.0 * (double)m * (double)n * (double)(k > 0 ? k : 1);
    if (threads < 1) threads = 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && flops > 2e6)
    for (int64_t t = 0; t < tasks; t++) {
        _Alignas(64) uint16_t abuf[MC_F * KC];
        _Alignas(64) uint16_t bbuf[KC * NR_BF16];
        _Alignas(64) float tile[MC_F * NC];
        const int64_t i0 = (t % tm) * MC_F, j0 = (t / tm) * NC;
        const int64_t mc = m - i0 < MC_F ? m - i0 : MC_F, nc = n - j0 < NC ? n - j0 : NC;
        if (k <= 0) memset(tile, 0, sizeof tile);
        for (int64_t p0 = 0; p0 < k; p0 += KC) {
            const int64_t kc = k - p0 < KC ? k - p0 : KC, kp = (kc + 1) & ~(int64_t)1;
            pack_a_pairs(abuf, &a, i0, p0, mc, kc);
            for (int64_t jr = 0; jr < nc; jr += NR_BF16) {
                pack_b_pairs(bbuf, &b, p0, j0 + jr, kc, nc - jr < NR_BF16 ? (int)(nc - jr) : NR_BF16);
                for (int64_t ir = 0; ir < mc; ir += MR_BF16)
                    kernel_bf16(kp / 2, abuf + ir * kp, bbuf, tile + ir * NC + jr, NC, p0 == 0);
            }
        }
        epilogue_f(tile, i0, j0, mc, nc, out);
    }
}
#endif
