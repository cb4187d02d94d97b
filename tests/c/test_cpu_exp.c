/* csrc/cpu_exp.h, the float exponential of the CPU softmax, cross_entropy
 * and glu kernels: within 1 ulp of the float64 e^x across the float range
 * (subnormal results included), the limits exact (-inf -> 0, +inf and
 * overflow -> inf, NaN -> NaN), and the block form (a vectorized loop, as
 * the kernels run it) giving the scalar form's bits. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math", "tree-vectorize") /* as the kernels: the block loop vectorizes */
#endif
#include <math.h>
#include <stdint.h>

#include "cpu_exp.h"
#include "harness.h"

/* units in the last place of the float nearest e^x, as a double */
static double ulp_err(float got, double want)
{
    const double ulp = want < 1.1754943508222875e-38 ? 1.401298464324817e-45 : ldexp(1.0, ilogb(want) - 23);
    return fabs((double)got - want) / ulp;
}

HARNESS_GROUP(test_cpu_exp)
{
    /* a sweep over the finite range that matters, every 4099th float */
    double worst = 0;
    float worst_x = 0;
    int limits_ok = 1;
    float xs[1024], ys[1024];
    int filled = 0;
    for (uint64_t u = 0; u <= 0xffffffffull; u += 4099) {
        const float x = opsmith_f32_from_bits((uint32_t)u);
        if (!(x > -110.0f && x < 100.0f))
            continue;
        const float y = opsmith_exp_f32(x);
        const double want = exp((double)x);
        if (want > 3.4028234663852886e38) { /* past FLT_MAX (and its rounding): inf */
            limits_ok &= ((double)(float)want == INFINITY) ? isinf(y) && y > 0 : ulp_err(y, want) <= 1.0;
            continue;
        }
        const double e = ulp_err(y, want);
        if (e > worst)
            worst = e, worst_x = x;
        if (filled < 1024)
            xs[filled++] = x;
    }
    CHECK(worst <= 1.0, "exp_f32: %.3f ulp from the float64 e^x at x = %a", worst, (double)worst_x);
    CHECK(limits_ok, "exp_f32: an overflowing x did not give inf");

    const struct { float x; float want; } exact[] = {
        {-INFINITY, 0.0f}, {INFINITY, INFINITY}, {0.0f, 1.0f}, {-0.0f, 1.0f}, {1e30f, INFINITY},
        {-1e30f, 0.0f}, {88.7229f, INFINITY}, {-104.5f, 0.0f}, {-103.5f, 0x1p-149f},
    };
    for (size_t i = 0; i < sizeof exact / sizeof exact[0]; i++) {
        const float y = opsmith_exp_f32(exact[i].x);
        CHECK(y == exact[i].want, "exp_f32(%a) = %a, expected %a", (double)exact[i].x, (double)y,
              (double)exact[i].want);
    }
    CHECK(isnan(opsmith_exp_f32(NAN)), "exp_f32(NaN) is not NaN");
    CHECK(isnan(opsmith_exp_f32(-NAN)), "exp_f32(-NaN) is not NaN");
    CHECK(opsmith_exp_f32(88.72f) < INFINITY && opsmith_exp_f32(88.72f) > 3.3e38f, "exp_f32(88.72) not finite");

    /* in a vectorized loop (as glu's kernels run it): the specials and the
     * sweep's first values, an odd count, give the scalar form's bits */
    const float special[] = {-INFINITY, INFINITY, NAN, 0.0f, 88.75f, 89.0f, -104.0f, -87.5f, -1e4f, 1e4f};
    for (size_t i = 0; i < sizeof special / sizeof special[0] && filled < 1024; i++)
        xs[filled++] = special[i];
    for (int i = 0; i < filled; i++)
        ys[i] = xs[i];
    const int n = filled - 1;
#pragma GCC ivdep
    for (int i = 0; i < n; i++)
        ys[i] = opsmith_exp_f32(ys[i]);
    int same = 1;
    for (int i = 0; i < filled - 1; i++) {
        const float s = opsmith_exp_f32(xs[i]);
        same &= (isnan(s) && isnan(ys[i])) || opsmith_f32_bits(s) == opsmith_f32_bits(ys[i]);
    }
    CHECK(same, "exp_f32 in a vectorized loop differs from exp_f32");
    CHECK(opsmith_f32_bits(ys[filled - 1]) == opsmith_f32_bits(xs[filled - 1]), "the vectorized loop wrote past n");
}
