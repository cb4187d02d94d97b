/* Conversions between the 16-bit storage types and float, in plain C11
 * (no compiler half types), shared by the CPU kernels and the references.
 * Round to nearest even; NaN stays NaN (quietened). */
#ifndef OPSMITH_CONVERT_H
#define OPSMITH_CONVERT_H

#include <stdint.h>
#include <string.h>

static inline uint32_t opsmith_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float opsmith_f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float opsmith_bf16_to_f32(uint16_t h) { return opsmith_f32_from_bits((uint32_t)h << 16); }

/* written as a select, not a branch, so loops over it vectorize */
static inline uint16_t opsmith_f32_to_bf16(float f) {
    const uint32_t u = opsmith_f32_bits(f);
    const uint32_t quiet_nan = (u >> 16) | 0x0040u;
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16; /* to nearest even; overflow carries into inf */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

static inline float opsmith_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    /* inf, or NaN quietened (as F16C and PyTorch's own conversion do) */
    if (exp == 0x1fu) return opsmith_f32_from_bits(sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u));
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24 is exact in float */
        float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    return opsmith_f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t opsmith_f32_to_f16(float f) {
    uint32_t u = opsmith_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
    if (a < 0x38800000u) {
        /* below the smallest normal (2^-14): subnormal or zero. Shift the
         * 24-bit significand right so its unit is 2^-24, rounding to even. */
        if (a < 0x33000000u) return sign; /* < 2^-25 rounds to zero */
        uint32_t e = a >> 23;
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e; /* 14..24 */
        uint32_t q = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    /* normal: rebias the exponent, round the 13 dropped bits to even */
    uint32_t r = a - 0x38000000u; /* exponent 127 -> 15 bias */
    r += 0xfffu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
}

#endif /* OPSMITH_CONVERT_H */
