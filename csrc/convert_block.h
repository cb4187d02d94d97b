/* Block conversions for the CPU kernels: a run of elements of any float
 * dtype widened into a float (or double) buffer, and narrowed back. A
 * kernel widens a block of a row, does its arithmetic on plain float arrays
 * (loops the compiler vectorizes whatever the storage dtype), and narrows
 * the result: one kernel body serves every dtype and every mix of them.
 * f16 goes through the F16C instructions when the CPU has them (checked at
 * run time), else through the portable C of convert.h; both round to
 * nearest even and quieten NaN the same way. Header-only, static. */
#ifndef OPSMITH_CONVERT_BLOCK_H
#define OPSMITH_CONVERT_BLOCK_H

#include "convert.h"
#include "opsmith.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define OPSMITH_HAVE_F16C_PATH 1

__attribute__((target("avx,f16c"))) static void opsmith_widen_f16_f16c(const uint16_t *p, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + i))));
    for (; i < n; i++) out[i] = _cvtsh_ss(p[i]);
}

__attribute__((target("avx,f16c"))) static void opsmith_narrow_f16_f16c(const float *in, int64_t n, uint16_t *p) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(p + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) p[i] = _cvtss_sh(in[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

static int opsmith_cpu_has_f16c(void) {
    static int has = -1; /* a benign race: every thread computes the same value */
    if (has < 0) has = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
    return has;
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
        for (int64_t i = 0; i < n; i++) buf[i] = opsmith_f16_to_f32(h[i]);
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
        for (int64_t i = 0; i < n; i++) h[i] = opsmith_f32_to_f16(in[i]);
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

/* the double versions: only f64 is kept in double */
static inline const double *opsmith_widen_f64(opsmith_dtype dt, const void *p, int64_t off, int64_t n, double *buf) {
    (void)dt, (void)n, (void)buf;
    return (const double *)p + off;
}
static inline double *opsmith_out_f64(opsmith_dtype dt, void *p, int64_t off, double *buf) {
    (void)dt, (void)buf;
    return (double *)p + off;
}
static inline void opsmith_narrow_f64(opsmith_dtype dt, const double *in, void *p, int64_t off, int64_t n) {
    (void)dt, (void)in, (void)p, (void)off, (void)n;
}
static inline void opsmith_round_f64(opsmith_dtype dt, double *buf, int64_t n) { (void)dt, (void)buf, (void)n; }

#endif /* OPSMITH_CONVERT_BLOCK_H */
