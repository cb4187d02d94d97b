/* csrc/convert_block.h against csrc/convert.h: the CPU kernels convert
 * float16 up to four ways (convert.h's scalar functions, convert_block.h's
 * branch-free ones that vectorize, F16C 8 at a time, and its AVX-512 form
 * 16 at a time, where the CPU has them) and promise the same bits from
 * each. Every float16 widened; every 4099th
 * float and the neighbourhoods of each rounding boundary narrowed. */
#include <stdint.h>
#include <string.h>

#include "convert_block.h"
#include "harness.h"

static uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float float_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* narrows n floats every way this CPU has and checks they agree */
static int narrow_agrees(const float *x, int n, uint32_t *bad)
{
    uint16_t block[256], ymm[256], zmm[256];
    const int level = opsmith_cpu_f16_level();
    for (int i = 0; i < n; i++) block[i] = opsmith_block_f32_to_f16(x[i]);
    if (level >= 1) opsmith_narrow_f16_ymm(x, n, ymm);
    if (level >= 2) opsmith_narrow_f16_zmm(x, n, zmm);
    for (int i = 0; i < n; i++) {
        const uint16_t want = opsmith_f32_to_f16(x[i]);
        if (block[i] != want || (level >= 1 && ymm[i] != want) || (level >= 2 && zmm[i] != want)) {
            *bad = bits_of(x[i]);
            return 0;
        }
    }
    return 1;
}

HARNESS_GROUP(test_convert_block)
{
    /* widening: all 65536 float16 values */
    static uint16_t h[65536];
    static float ymm[65536], zmm[65536];
    const int level = opsmith_cpu_f16_level();
    for (uint32_t i = 0; i < 65536; i++) h[i] = (uint16_t)i;
    volatile int64_t count = 65535; /* not a constant, and odd: the vector loops' tails run too */
    if (level >= 1) opsmith_widen_f16_ymm(h, count, ymm);
    if (level >= 2) opsmith_widen_f16_zmm(h, count, zmm);
    int widen_bad = -1;
    for (uint32_t i = 0; i < 65535 && widen_bad < 0; i++) {
        const uint32_t want = bits_of(opsmith_f16_to_f32(h[i]));
        if (bits_of(opsmith_block_f16_to_f32(h[i])) != want || (level >= 1 && bits_of(ymm[i]) != want) ||
            (level >= 2 && bits_of(zmm[i]) != want))
            widen_bad = (int)i;
    }
    CHECK(bits_of(opsmith_block_f16_to_f32(0xffff)) == bits_of(opsmith_f16_to_f32(0xffff)), "float16 0xffff widens differently");
    CHECK(widen_bad < 0, "float16 0x%04x widens differently across convert.h, convert_block.h and F16C (CPU level %d)",
          widen_bad, level);

    /* narrowing: a sweep of the whole float range, then each boundary
     * (subnormal unit, smallest normal, largest finite, the overflow
     * threshold 65520, infinity, NaN payloads) and 64 floats either side */
    float batch[256];
    int filled = 0, ok = 1;
    uint32_t bad = 0;
    for (uint64_t u = 0; u <= 0xffffffffull && ok; u += 4099) {
        batch[filled++] = float_of((uint32_t)u);
        if (filled == 256) ok = narrow_agrees(batch, filled, &bad), filled = 0;
    }
    if (ok && filled) ok = narrow_agrees(batch, filled, &bad);
    static const float edges[] = {0x1p-25f, 0x1p-24f, 0x1.8p-24f, 0x1p-15f, 0x1p-14f, 0x1.ffcp-15f, 1.0f,
                                  65504.0f, 65519.99f, 65520.0f, 1e30f};
    for (size_t e = 0; e < sizeof edges / sizeof edges[0] && ok; e++)
        for (int sign = 0; sign < 2 && ok; sign++) {
            const uint32_t c = bits_of(edges[e]) | (sign ? 0x80000000u : 0u);
            for (int d = -64; d < 64; d++) batch[d + 64] = float_of(c + (uint32_t)d);
            ok = narrow_agrees(batch, 128, &bad);
        }
    for (uint32_t p = 0; p < 128 && ok; p++) { /* infinities and NaNs, payloads high and low */
        batch[2 * p] = float_of(0x7f800000u | (p << 16) | p);
        batch[2 * p + 1] = float_of(0xff800000u | (p << 13) | (p & 7));
    }
    if (ok) ok = narrow_agrees(batch, 256, &bad);
    CHECK(ok, "float 0x%08x narrows to float16 differently across convert.h, convert_block.h and F16C", bad);
}
