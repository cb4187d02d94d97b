/* Block conversions for the CPU kernels: a run of elements of any float
 * dtype widened into a float (or double) buffer, and narrowed back. A
 * kernel widens a block of a row, does its arithmetic on plain float arrays
 * (loops the compiler vectorizes whatever the storage dtype), and narrows
 * the result: one kernel body serves every dtype and every mix of them.
 * f16 goes through the F16C instructions when the CPU has them (checked at
 * run time), else through the branch-free conversions below; bf16 through
 * convert.h's (a shift, and a select). All round to nearest even and
 * quieten NaN the same way, bit for bit. Header-only, static. */
#ifndef OPSMITH_CONVERT_BLOCK_H
#define OPSMITH_CONVERT_BLOCK_H

#include "convert.h"
#include "opsmith.h"

/* f16 <-> float without a branch, for the portable loops to vectorize:
 * every case (normal, subnormal, Inf, NaN) is computed and the right one
 * selected, as bit arithmetic (a ternary the compiler might keep as a
 * branch). The same bits as convert.h's opsmith_f16_to_f32 and
 * opsmith_f32_to_f16. */
static inline uint32_t opsmith_block_select(uint32_t c, uint32_t a, uint32_t b) { return b ^ ((a ^ b) & (0u - c)); }

static inline float opsmith_block_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t em = h & 0x7fffu;
    /* exponent rebiased 15 -> 127; Inf/NaN (exponent 31) rebiased once more to 255 */
    uint32_t o = (em << 13) + 0x38000000u;
    o += 0x38000000u & (0u - (uint32_t)(em >= 0x7c00u));
    o |= 0x00400000u & (0u - (uint32_t)(em > 0x7c00u)); /* NaN quietened, as F16C */
    /* subnormal: as a normal with exponent 2^-14, minus the implicit 2^-14 */
    const float sub = opsmith_f32_from_bits(o + 0x00800000u) - opsmith_f32_from_bits(0x38800000u);
    const uint32_t mag = opsmith_block_select(em < 0x0400u, opsmith_f32_bits(sub), o);
    return opsmith_f32_from_bits(mag | sign);
}

static inline uint16_t opsmith_block_f32_to_f16(float f) {
    const uint32_t u = opsmith_f32_bits(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t a = u & 0x7fffffffu;
    /* normal: rebias, round the 13 dropped bits to even (a carry reaches inf) */
    const uint32_t normal = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
    /* below 2^-14: adding 0.5 lines the f16 subnormal unit (2^-24) up with
     * the float's last mantissa bit, so the FPU's own rounding is the f16 one */
    const uint32_t sub = opsmith_f32_bits(opsmith_f32_from_bits(a) + 0.5f) - opsmith_f32_bits(0.5f);
    const uint32_t nan = 0x7e00u | ((a >> 13) & 0x3ffu);
    uint32_t o = opsmith_block_select(a < 0x38800000u, sub, normal);
    o = opsmith_block_select(a >= 0x477ff000u, 0x7c00u, o); /* rounds to >= 65520: inf */
    o = opsmith_block_select(a > 0x7f800000u, nan, o);
    return (uint16_t)(o | sign);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define OPSMITH_HAVE_F16C_PATH 1

__attribute__((target("avx,f16c"))) static void opsmith_widen_f16_ymm(const uint16_t *p, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + i))));
    for (; i < n; i++) out[i] = _cvtsh_ss(p[i]);
}

__attribute__((target("avx,f16c"))) static void opsmith_narrow_f16_ymm(const float *in, int64_t n, uint16_t *p) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(p + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) p[i] = _cvtss_sh(in[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* the same conversions 16 at a time (AVX-512F's forms of the F16C instructions: the same bits) */
__attribute__((target("avx512f,f16c"))) static void opsmith_widen_f16_zmm(const uint16_t *p, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + i))));
    opsmith_widen_f16_ymm(p + i, n - i, out + i);
}

__attribute__((target("avx512f,f16c"))) static void opsmith_narrow_f16_zmm(const float *in, int64_t n, uint16_t *p) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(p + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    opsmith_narrow_f16_ymm(in + i, n - i, p + i);
}

/* 0: no F16C, 1: F16C, 2: F16C and AVX-512F (a benign race: every thread
 * computes the same value) */
static int opsmith_cpu_f16_level(void) {
    static int level = -1;
    if (level < 0)
        level = !(__builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx")) ? 0
                : __builtin_cpu_supports("avx512f")                                ? 2
                                                                                   : 1;
    return level;
}

static int opsmith_cpu_has_f16c(void) { return opsmith_cpu_f16_level() > 0; }

/* float16 <-> float through the widest F16C form the CPU has (call only
 * when opsmith_cpu_has_f16c()) */
static inline void opsmith_widen_f16_f16c(const uint16_t *p, int64_t n, float *out) {
    if (opsmith_cpu_f16_level() == 2) opsmith_widen_f16_zmm(p, n, out);
    else opsmith_widen_f16_ymm(p, n, out);
}

static inline void opsmith_narrow_f16_f16c(const float *in, int64_t n, uint16_t *p) {
    if (opsmith_cpu_f16_level() == 2) opsmith_narrow_f16_zmm(in, n, p);
    else opsmith_narrow_f16_ymm(in, n, p);
}
#else
#define OPSMITH_HAVE_F16C_PATH 0
#endif

/* elements [off, off + n) of p, of dtype dt, as floats: a pointer into p
 * itself for f32 (no copy), else `buf` filled */
static inline const float *opsmith_widen_f32(opsmith_dtype dt, const void *p, int64_t off, int64_t n, float *buf) {
    switch (dt) {
    case OPSMITH_DTYPE_F32: return (const float *)p + off;
    case OPSMITH_DTYPE_BF16: {
        const uint16_t *h = (const uint16_t *)p + off;
        for (int64_t i = 0; i < n; i++) buf[i] = opsmith_bf16_to_f32(h[i]);
        return buf;
    }
    default: { /* f16 */
        const uint16_t *h = (const uint16_t *)p + off;
#if OPSMITH_HAVE_F16C_PATH
        if (opsmith_cpu_has_f16c()) {
            opsmith_widen_f16_f16c(h, n, buf);
            return buf;
        }
#endif
        for (int64_t i = 0; i < n; i++) buf[i] = opsmith_block_f16_to_f32(h[i]);
        return buf;
    }
    }
}

/* where a block of results of dtype dt should be computed: straight into
 * the output for f32, else `buf` (then opsmith_narrow_f32 stores it) */
static inline float *opsmith_out_f32(opsmith_dtype dt, void *p, int64_t off, float *buf) {
    return dt == OPSMITH_DTYPE_F32 ? (float *)p + off : buf;
}

/* stores the n results in `in` (from opsmith_out_f32) at [off, off + n) of p */
static inline void opsmith_narrow_f32(opsmith_dtype dt, const float *in, void *p, int64_t off, int64_t n) {
    switch (dt) {
    case OPSMITH_DTYPE_F32: return; /* computed in place */
    case OPSMITH_DTYPE_BF16: {
        uint16_t *h = (uint16_t *)p + off;
        for (int64_t i = 0; i < n; i++) h[i] = opsmith_f32_to_bf16(in[i]);
        return;
    }
    default: {
        uint16_t *h = (uint16_t *)p + off;
#if OPSMITH_HAVE_F16C_PATH
        if (opsmith_cpu_has_f16c()) {
            opsmith_narrow_f16_f16c(in, n, h);
            return;
        }
#endif
        for (int64_t i = 0; i < n; i++) h[i] = opsmith_block_f32_to_f16(in[i]);
        return;
    }
    }
}

/* each of buf's n floats rounded to dtype dt and widened again */
static inline void opsmith_round_f32(opsmith_dtype dt, float *buf, int64_t n) {
    if (dt == OPSMITH_DTYPE_BF16) {
        for (int64_t i = 0; i < n; i++) buf[i] = opsmith_bf16_to_f32(opsmith_f32_to_bf16(buf[i]));
    } else if (dt == OPSMITH_DTYPE_F16) {
        uint16_t h[64];
        for (int64_t i0 = 0; i0 < n; i0 += 64) {
            const int64_t m = n - i0 < 64 ? n - i0 : 64;
            opsmith_narrow_f32(dt, buf + i0, h, 0, m);
            opsmith_widen_f32(dt, h, 0, m, buf + i0);
        }
    }
}

/* The double versions, for f64 x: f64 is used in place, and f32 (a
 * LayerNorm's float32 parameters beside f64 x) widened exactly and
 * narrowed by rounding to nearest. */
static inline const double *opsmith_widen_f64(opsmith_dtype dt, const void *p, int64_t off, int64_t n, double *buf) {
    if (dt == OPSMITH_DTYPE_F64) return (const double *)p + off;
    const float *f = (const float *)p + off;
    for (int64_t i = 0; i < n; i++) buf[i] = f[i];
    return buf;
}
static inline double *opsmith_out_f64(opsmith_dtype dt, void *p, int64_t off, double *buf) {
    return dt == OPSMITH_DTYPE_F64 ? (double *)p + off : buf;
}
static inline void opsmith_narrow_f64(opsmith_dtype dt, const double *in, void *p, int64_t off, int64_t n) {
    if (dt == OPSMITH_DTYPE_F64) return; /* computed in place */
    float *f = (float *)p + off;
    for (int64_t i = 0; i < n; i++) f[i] = (float)in[i];
}
static inline void opsmith_round_f64(opsmith_dtype dt, double *buf, int64_t n) { (void)dt, (void)buf, (void)n; }

#endif /* OPSMITH_CONVERT_BLOCK_H */
