/* e^x in float for the CPU kernels (softmax, cross_entropy, glu): branch
 * free, so a loop over it vectorizes (libm's expf is a scalar call).
 * Header-only, static; inlined into the callers, whose row workers are
 * compiled per ISA (OPSMITH_CPU_CLONES), so each gets its vector width.
 *
 * x = k ln2 + r, |r| <= ln2/2, k an integer; e^r = 1 + r + r^2 q(r), q of
 * degree 4 fitted (minimax in relative error) on that interval, within
 * about 1 ulp of e^x over the whole float range; 2^k applied as two
 * power-of-two factors, so results down to the subnormals (x >= -103.3)
 * round once and results past FLT_MAX (x > 88.72) overflow to inf. The
 * clamps keep k within the two factors' exponent range: -inf gives 0, +inf
 * inf; NaN fails both compares and stays NaN through the arithmetic.
 * GCC keeps the clamps as branches (no vector loop) on AVX2 and SSE2 unless
 * the including file is compiled without trapping math (its
 * `#pragma GCC optimize("no-trapping-math")`). */
#ifndef OPSMITH_CPU_EXP_H
#define OPSMITH_CPU_EXP_H

#include <stdint.h>

#include "convert.h"

/* For c already clamped: e^r of the reduction c = k ln2 + r, and in *t the
 * shifter sum whose low mantissa bits hold k. */
static inline float opsmith_exp_reduced_f32(float c, float *t_out) {
    /* round c / ln2 to an integer through the 1.5 * 2^23 shifter: t's low
     * mantissa bits then hold k itself (no float-to-int conversion, which
     * for NaN would be undefined) */
    const float t = c * 1.44269504088896341f + 12582912.0f;
    const float kf = t - 12582912.0f;
    /* ln2 in two parts, the first with few enough bits that kf * it is exact */
    const float r = (c - kf * 0.693145751953125f) - kf * 1.428606765330187e-06f;
    float q = 1.381461159e-03f;
    q = q * r + 8.368710056e-03f;
    q = q * r + 4.166838899e-02f;
    q = q * r + 1.666652113e-01f;
    q = q * r + 4.999999404e-01f;
    *t_out = t;
    return 1.0f + (r + r * r * q);
}

static inline float opsmith_exp_f32(float x) {
    float c = x > 88.75f ? 88.75f : x;
    c = c < -104.0f ? -104.0f : c;
    float t;
    const float p = opsmith_exp_reduced_f32(c, &t);
    const int32_t k = (int32_t)(opsmith_f32_bits(t) - 0x4b400000u);
    /* 2^k = 2^h 2^(k - h), each factor a normal float for k in [-150, 128] */
    const int32_t h = k >> 1;
    const float s1 = opsmith_f32_from_bits((uint32_t)(h + 127) << 23);
    const float s2 = opsmith_f32_from_bits((uint32_t)(k - h + 127) << 23);
    return p * s1 * s2;
}

/* e^x for x <= 0 or NaN (x - max in softmax and cross-entropy):
 * opsmith_exp_f32's reduction and polynomial (the same bits wherever e^x
 * is a normal float), with 2^k one factor: x is clamped at -88, where
 * k = -127 and 2^k's bits are 0, so results below FLT_MIN (2^-126; e^x <
 * 1.2e-38) are 0 instead of subnormal, -inf gives exactly 0, and no upper
 * clamp is needed. NaN stays NaN. */
static inline float opsmith_exp_nonpos_f32(float x) {
    float t;
    const float p = opsmith_exp_reduced_f32(x < -88.0f ? -88.0f : x, &t);
    /* t's low mantissa bits hold k (the 1.5 * 2^23 shifter); shifted up 23 the
     * shifter's own bits fall off the top: (k + 127) << 23, 0 for k = -127 */
    return p * opsmith_f32_from_bits((opsmith_f32_bits(t) << 23) + (127u << 23));
}

#endif /* OPSMITH_CPU_EXP_H */
