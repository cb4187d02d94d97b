/* Branch-free conversions between the 16-bit storage types and float, for
 * CPU loops that must vectorize: every case (normal, subnormal, Inf, NaN)
 * is computed and the right one selected, so the compiler turns the
 * selects into blends instead of leaving a branch in the loop. Results are
 * bit for bit those of convert.h (round to nearest even, NaN stays NaN). */
#ifndef OPSMITH_CONVERT_LANES_H
#define OPSMITH_CONVERT_LANES_H

#include <stdint.h>
#include <string.h>

/* always inlined: a call left in a loop stops it vectorizing */
#if defined(__GNUC__)
#define OPSMITH_LANES_INLINE static inline __attribute__((always_inline))
#else
#define OPSMITH_LANES_INLINE static inline
#endif

OPSMITH_LANES_INLINE uint32_t opsmith_lanes_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
OPSMITH_LANES_INLINE float opsmith_lanes_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* c ? a : b as bit arithmetic: a ternary the compiler might keep as a branch */
OPSMITH_LANES_INLINE uint32_t opsmith_lanes_select(uint32_t c, uint32_t a, uint32_t b) {
    return b ^ ((a ^ b) & (0u - c));
}

OPSMITH_LANES_INLINE float opsmith_lanes_bf16_to_f32(uint16_t h) { return opsmith_lanes_float((uint32_t)h << 16); }

OPSMITH_LANES_INLINE uint16_t opsmith_lanes_f32_to_bf16(float f) {
    const uint32_t u = opsmith_lanes_bits(f);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16; /* overflow carries into inf */
    const uint32_t quiet = (u >> 16) | 0x0040u;
    return (uint16_t)opsmith_lanes_select((u & 0x7fffffffu) > 0x7f800000u, quiet, rounded);
}

OPSMITH_LANES_INLINE float opsmith_lanes_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t em = h & 0x7fffu;
    /* exponent rebiased 15 -> 127; Inf/NaN (exponent 31) rebiased once more to 255 */
    uint32_t o = (em << 13) + 0x38000000u;
    o += 0x38000000u & (0u - (uint32_t)(em >= 0x7c00u));
    /* subnormal: as a normal with exponent 2^-14, minus the implicit 2^-14 */
    const float sub = opsmith_lanes_float(o + 0x00800000u) - opsmith_lanes_float(0x38800000u);
    const uint32_t mag = opsmith_lanes_select(em < 0x0400u, opsmith_lanes_bits(sub), o);
    return opsmith_lanes_float(mag | sign);
}

OPSMITH_LANES_INLINE uint16_t opsmith_lanes_f32_to_f16(float f) {
    const uint32_t u = opsmith_lanes_bits(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t a = u & 0x7fffffffu;
    /* normal: rebias, round the 13 dropped bits to even (a carry reaches inf) */
    const uint32_t normal = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
    /* below 2^-14: adding 0.5 lines the f16 subnormal unit (2^-24) up with
     * the float's last mantissa bit, so the FPU's own rounding is the f16 one */
    const uint32_t sub = opsmith_lanes_bits(opsmith_lanes_float(a) + 0.5f) - opsmith_lanes_bits(0.5f);
    const uint32_t nan = 0x7e00u | ((a >> 13) & 0x3ffu);
    uint32_t o = opsmith_lanes_select(a < 0x38800000u, sub, normal);
    o = opsmith_lanes_select(a >= 0x477ff000u, 0x7c00u, o); /* rounds to >= 65520: inf */
    o = opsmith_lanes_select(a > 0x7f800000u, nan, o);
    return (uint16_t)(o | sign);
}

#endif /* OPSMITH_CONVERT_LANES_H */
