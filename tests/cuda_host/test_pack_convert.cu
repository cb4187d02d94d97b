/* The pack conversions of csrc/cuda/common.cuh (unpack, unpack_n, pack_of) against
 * the element-wise to_acc / from_acc they replace, bit for bit, run on the
 * host (the helpers are __host__ __device__; nvcc compiles this file, no
 * GPU needed). Every bfloat16 and float16 bit pattern is unpacked; floats
 * are rounded from every exponent with random mantissas, the rounding
 * ties, the boundaries of each format, infinities and NaNs. What runs here
 * is the CUDA headers' host code for the intrinsics; on the device (sm_80,
 * sm_90) the element-wise and the paired conversions are the same F2FP
 * instruction, each half rounded alone, and bf16 -> float is a shift
 * (sm_90) or a byte permute (sm_80) that the shift and the mask reproduce
 * (read in the SASS). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "cuda/common.cuh"

using namespace opsmith;

static int failures = 0;
static long checks = 0;

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static uint16_t bits16h(__half h) {
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}
static uint16_t bits16b(__nv_bfloat16 h) {
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}

template <typename T> static uint16_t raw(T v);
template <> uint16_t raw<__half>(__half v) { return bits16h(v); }
template <> uint16_t raw<__nv_bfloat16>(__nv_bfloat16 v) { return bits16b(v); }

/* unpack of every 16-bit pattern, in every lane of a pack */
template <typename T> static void check_unpack_all(const char *name) {
    for (uint32_t b = 0; b < 65536; b += 8) {
        Pack<T> p;
        uint16_t u[8];
        for (int k = 0; k < 8; k++) u[k] = (uint16_t)(b + k);
        memcpy(&p, u, 16);
        float v[8];
        unpack(p, v);
        for (int k = 0; k < 8; k++) {
            const float want = to_acc(p.v[k]);
            checks++;
            if (bits(v[k]) != bits(want) && !(isnan(v[k]) && isnan(want))) {
                if (failures++ < 10)
                    printf("FAIL unpack<%s> 0x%04x lane %d: %08x != %08x\n", name, u[k], k, bits(v[k]), bits(want));
            }
        }
    }
}

/* unpack_n over N values in registers: whole packs (N = 16, two packs) and
 * a length that fills none (N = 6, element by element), every pattern */
template <typename T, int N> static void check_unpack_n(const char *name) {
    for (uint32_t b = 0; b < 65536; b += N) {
        T x[N];
        for (int k = 0; k < N; k++) {
            const uint16_t u = (uint16_t)(b + k);
            memcpy(&x[k], &u, 2);
        }
        float v[N];
        unpack_n(x, v);
        for (int k = 0; k < N; k++) {
            const float want = to_acc(x[k]);
            checks++;
            if (bits(v[k]) != bits(want) && !(isnan(v[k]) && isnan(want))) {
                if (failures++ < 10)
                    printf("FAIL unpack_n<%s, %d> 0x%04x: %08x != %08x\n", name, N, (unsigned)(b + k), bits(v[k]),
                           bits(want));
            }
        }
    }
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t next_u32() {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

template <typename T> static void check_pack_of(const float (&v)[8], const char *name) {
    const Pack<T> p = pack_of<T>(v);
    for (int k = 0; k < 8; k++) {
        const T want = from_acc<T>(v[k]);
        checks++;
        if (raw<T>(p.v[k]) != raw<T>(want)) {
            if (failures++ < 10)
                printf("FAIL pack_of<%s> %a lane %d: %04x != %04x\n", name, (double)v[k], k, raw<T>(p.v[k]),
                       raw<T>(want));
        }
    }
}

static float f_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

int main() {
    check_unpack_all<__nv_bfloat16>("bf16");
    check_unpack_all<__half>("f16");
    check_unpack_n<__nv_bfloat16, 16>("bf16");
    check_unpack_n<__nv_bfloat16, 6>("bf16");
    check_unpack_n<__half, 16>("f16");

    /* rounding: random mantissas at every exponent, both signs; exact
     * halfway points of both 16-bit formats; and the special values */
    float v[8];
    int n = 0;
    auto push = [&](float x) {
        v[n++] = x;
        if (n == 8) {
            check_pack_of<__nv_bfloat16>(v, "bf16");
            check_pack_of<__half>(v, "f16");
            n = 0;
        }
    };
    for (uint32_t e = 0; e < 256; e++)
        for (int i = 0; i < 256; i++) {
            const uint32_t m = next_u32() & 0x7fffffu, sign = (uint32_t)(i & 1) << 31;
            push(f_of(sign | e << 23 | m));
            push(f_of(sign | e << 23 | (m & ~0xffffu) | 0x8000u));            /* bf16 tie */
            push(f_of(sign | e << 23 | (m & ~0x1fffu) | 0x1000u));            /* f16 tie (normal range) */
            push(f_of(sign | e << 23 | (m & ~0xffffu) | 0x7fffu));            /* just below a bf16 tie */
        }
    const float special[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 65504.0f, 65520.0f, 65519.99f,
                             6.1035156e-05f, 5.9604645e-08f, 2.9802322e-08f, 1e-45f, 3.4028235e38f, -3.4028235e38f,
                             1.0f};
    for (float x : special) push(x);
    while (n) push(1.5f);

    /* float and double packs pass through unchanged */
    {
        float fv[4] = {1.0f, -2.5f, NAN, INFINITY}, back[4];
        const Pack<float> p = pack_of<float>(fv);
        unpack(p, back);
        for (int k = 0; k < 4; k++, checks++)
            if (bits(back[k]) != bits(fv[k])) failures++;
    }
    printf("pack conversions: %ld checks, %d failures\n", checks, failures);
    return failures ? 1 : 0;
}
