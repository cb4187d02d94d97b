/* Status strings, dtype metadata and the element conversions that every
 * other test relies on to prepare inputs and read outputs. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "harness.h"

static void test_status_strings(void)
{
    const char *seen[OPSMITH_STATUS_COUNT];
    for (int s = 0; s < OPSMITH_STATUS_COUNT; s++) {
        const char *str = opsmith_status_string((opsmith_status)s);
        seen[s] = str;
        if (!CHECK(str != NULL, "status_string(%d) is NULL", s))
            continue;
        CHECK(str[0] != '\0', "status_string(%d) is empty", s);
        for (int t = 0; t < s; t++)
            if (seen[t] != NULL)
                CHECK(strcmp(seen[t], str) != 0, "status_string(%d) == status_string(%d) == \"%s\"",
                      s, t, str);
    }
    /* Out of range values must still give a printable string. */
    CHECK(opsmith_status_string(OPSMITH_STATUS_COUNT) != NULL, "status_string(COUNT) is NULL");
    CHECK(opsmith_status_string((opsmith_status)1000) != NULL, "status_string(1000) is NULL");
    CHECK(opsmith_last_error() != NULL, "last_error() is NULL");
    int has = opsmith_has_cuda();
    CHECK(has == 0 || has == 1, "has_cuda() = %d, expected 0 or 1", has);
}

static void test_dtype_metadata(void)
{
    static const char *const names[] = {"f64", "f32", "f16", "bf16", "i32", "i64"};
    static const size_t sizes[] = {8, 4, 2, 2, 4, 8};
    static const int is_float[] = {1, 1, 1, 1, 0, 0};
    static const opsmith_dtype accum[] = {OPSMITH_DTYPE_F64, OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32,
                                          OPSMITH_DTYPE_F32, OPSMITH_DTYPE_I64, OPSMITH_DTYPE_I64};
    _Static_assert(sizeof names / sizeof names[0] == OPSMITH_DTYPE_COUNT, "a name for every dtype");
    for (int d = 0; d < OPSMITH_DTYPE_COUNT; d++) {
        const char *name = opsmith_dtype_name((opsmith_dtype)d);
        CHECK(name != NULL && strcmp(name, names[d]) == 0, "dtype_name(%d) = \"%s\", expected \"%s\"",
              d, name ? name : "(null)", names[d]);
        size_t size = opsmith_dtype_size((opsmith_dtype)d);
        CHECK(size == sizes[d], "dtype_size(%s) = %zu, expected %zu", names[d], size, sizes[d]);
        opsmith_dtype acc = opsmith_dtype_accumulate((opsmith_dtype)d);
        CHECK(acc == accum[d], "dtype_accumulate(%s) = %d, expected %d", names[d], (int)acc,
              (int)accum[d]);
        CHECK(opsmith_dtype_is_float((opsmith_dtype)d) == is_float[d], "dtype_is_float(%s) = %d", names[d],
              opsmith_dtype_is_float((opsmith_dtype)d));
    }
    CHECK(opsmith_dtype_is_float(OPSMITH_DTYPE_COUNT) == 0, "dtype_is_float(COUNT) = 1");
    const opsmith_dtype bad[] = {OPSMITH_DTYPE_COUNT, (opsmith_dtype)77};
    for (int i = 0; i < 2; i++) {
        const char *name = opsmith_dtype_name(bad[i]);
        CHECK(name != NULL && strcmp(name, "?") == 0, "dtype_name(%d) = \"%s\", expected \"?\"",
              (int)bad[i], name ? name : "(null)");
        CHECK(opsmith_dtype_size(bad[i]) == 0, "dtype_size(%d) = %zu, expected 0", (int)bad[i],
              opsmith_dtype_size(bad[i]));
    }
}

/* Independent decoders, so the load path is not only checked against itself. */
static double decode_f16(uint16_t b)
{
    int sign = b >> 15, e = (b >> 10) & 31, m = b & 1023;
    double v;
    if (e == 0)
        v = ldexp((double)m, -24);
    else if (e == 31)
        v = m ? NAN : INFINITY;
    else
        v = ldexp((double)(1024 + m), e - 25);
    return sign ? -v : v;
}

static double decode_bf16(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return (double)f;
}

/* Same value, same sign of zero, or both NaN. */
static int same_value(double a, double b)
{
    if (isnan(a) || isnan(b))
        return isnan(a) && isnan(b);
    return a == b && signbit(a) == signbit(b);
}

/* Every 16-bit pattern: load must decode exactly, and storing the loaded
 * value must give the same bits back (any NaN is accepted for a NaN). */
static void test_roundtrip_16(opsmith_dtype dt)
{
    long bad_load = 0, bad_store = 0;
    unsigned first_load = 0, first_store = 0;
    for (uint32_t p = 0; p < 65536; p++) {
        uint16_t in = (uint16_t)p, out = 0;
        double want = dt == OPSMITH_DTYPE_F16 ? decode_f16(in) : decode_bf16(in);
        double got = opsmith_load_as_double(dt, &in, 0);
        if (!same_value(got, want) && bad_load++ == 0)
            first_load = p;
        opsmith_store_from_double(dt, &out, 0, got);
        int ok = isnan(want) ? isnan(opsmith_load_as_double(dt, &out, 0)) : out == in;
        if (!ok && bad_store++ == 0)
            first_store = p;
    }
    CHECK(bad_load == 0, "%s load: %ld of 65536 bit patterns decode wrong, first 0x%04x",
          opsmith_dtype_name(dt), bad_load, first_load);
    CHECK(bad_store == 0, "%s store(load(bits)) != bits for %ld patterns, first 0x%04x",
          opsmith_dtype_name(dt), bad_store, first_store);
}

/* Random bit patterns for the wide types (exhaustive is too slow). */
static void test_roundtrip_wide(opsmith_dtype dt)
{
    test_rng rng = {0x5EEDull + (uint64_t)dt};
    long bad = 0;
    uint64_t first = 0;
    for (int i = 0; i < 100000; i++) {
        uint64_t bits = rng_next(&rng);
        double want;
        unsigned char in[8], out[8];
        if (dt == OPSMITH_DTYPE_F32) {
            uint32_t b32 = (uint32_t)bits;
            float f;
            memcpy(&f, &b32, 4);
            want = (double)f;
            memcpy(in, &b32, 4);
        } else {
            memcpy(&want, &bits, 8);
            memcpy(in, &bits, 8);
        }
        double got = opsmith_load_as_double(dt, in, 0);
        opsmith_store_from_double(dt, out, 0, got);
        size_t sz = dt == OPSMITH_DTYPE_F32 ? 4 : 8;
        int ok = same_value(got, want) &&
                 (isnan(want) ? isnan(opsmith_load_as_double(dt, out, 0)) : memcmp(in, out, sz) == 0);
        if (!ok && bad++ == 0)
            first = bits;
    }
    CHECK(bad == 0, "%s: %ld of 100000 random bit patterns do not round-trip, first 0x%llx",
          opsmith_dtype_name(dt), bad, (unsigned long long)first);
}

struct rounding_case {
    opsmith_dtype dt;
    double in, want;
    const char *what;
};

static void test_rounding(void)
{
    const double inf = INFINITY;
    const struct rounding_case cases[] = {
        {OPSMITH_DTYPE_BF16, 1.0 + 0x1p-9, 1.0, "bf16 1+2^-9 rounds down"},
        {OPSMITH_DTYPE_BF16, 1.0 + 0x1p-8, 1.0, "bf16 tie 1+2^-8 to even"},
        {OPSMITH_DTYPE_BF16, 1.0 + 3 * 0x1p-8, 1.0 + 0x1p-6, "bf16 tie 1+3*2^-8 to even"},
        /* a double just above a tie must not be rounded twice (via float) */
        {OPSMITH_DTYPE_BF16, 1.0 + 0x1p-8 + 0x1p-40, 1.0 + 0x1p-7, "bf16 just above tie (double rounding)"},
        {OPSMITH_DTYPE_BF16, -(1.0 + 0x1p-8 + 0x1p-40), -(1.0 + 0x1p-7), "bf16 negative just above tie"},
        {OPSMITH_DTYPE_BF16, 3.4e38, inf, "bf16 overflow to inf"},
        {OPSMITH_DTYPE_BF16, -3.4e38, -inf, "bf16 overflow to -inf"},
        {OPSMITH_DTYPE_BF16, 0x1p-133, 0x1p-133, "bf16 smallest subnormal"},
        {OPSMITH_DTYPE_BF16, 0x1p-134, 0.0, "bf16 half smallest subnormal to even (0)"},
        {OPSMITH_DTYPE_BF16, -0.0, -0.0, "bf16 -0"},
        {OPSMITH_DTYPE_BF16, inf, inf, "bf16 inf"},
        {OPSMITH_DTYPE_BF16, NAN, NAN, "bf16 NaN"},
        {OPSMITH_DTYPE_F16, 65504.0, 65504.0, "f16 max"},
        {OPSMITH_DTYPE_F16, 65519.99, 65504.0, "f16 just below overflow tie"},
        {OPSMITH_DTYPE_F16, 65520.0, inf, "f16 65520 to inf"},
        {OPSMITH_DTYPE_F16, -65520.0, -inf, "f16 -65520 to -inf"},
        {OPSMITH_DTYPE_F16, 1e6, inf, "f16 1e6 to inf"},
        {OPSMITH_DTYPE_F16, 0x1p-14, 0x1p-14, "f16 smallest normal"},
        {OPSMITH_DTYPE_F16, 0x1p-24, 0x1p-24, "f16 subnormal 2^-24"},
        {OPSMITH_DTYPE_F16, -0x1p-24, -0x1p-24, "f16 subnormal -2^-24"},
        {OPSMITH_DTYPE_F16, 0x1p-25, 0.0, "f16 tie 2^-25 to even (0)"},
        {OPSMITH_DTYPE_F16, 0x1p-25 * 1.0000001, 0x1p-24, "f16 just above 2^-25"},
        {OPSMITH_DTYPE_F16, 3 * 0x1p-25, 0x1p-23, "f16 tie 3*2^-25 to even"},
        {OPSMITH_DTYPE_F16, -1e-10, -0.0, "f16 underflow keeps sign"},
        {OPSMITH_DTYPE_F16, 1.0 + 0x1p-11, 1.0, "f16 tie 1+2^-11 to even"},
        {OPSMITH_DTYPE_F16, 1.0 + 3 * 0x1p-11, 1.0 + 0x1p-9, "f16 tie 1+3*2^-11 to even"},
        {OPSMITH_DTYPE_F16, 1.0 + 0x1p-11 + 0x1p-40, 1.0 + 0x1p-10, "f16 just above tie (double rounding)"},
        {OPSMITH_DTYPE_F16, inf, inf, "f16 inf"},
        {OPSMITH_DTYPE_F16, -inf, -inf, "f16 -inf"},
        {OPSMITH_DTYPE_F16, NAN, NAN, "f16 NaN"},
        {OPSMITH_DTYPE_F32, 1.0 + 0x1p-24, 1.0, "f32 tie to even"},
        {OPSMITH_DTYPE_F32, 1.0 + 3 * 0x1p-24, 1.0 + 0x1p-22, "f32 tie 1+3*2^-24 to even"},
        {OPSMITH_DTYPE_F32, 1.0 + 0x1p-24 + 0x1p-50, 1.0 + 0x1p-23, "f32 just above tie"},
        {OPSMITH_DTYPE_F32, (double)FLT_MAX, (double)FLT_MAX, "f32 max"},
        {OPSMITH_DTYPE_F32, 1e39, inf, "f32 overflow"},
        {OPSMITH_DTYPE_F32, 0x1p-149, 0x1p-149, "f32 smallest subnormal"},
        {OPSMITH_DTYPE_F32, 0x1p-150, 0.0, "f32 tie to 0"},
        {OPSMITH_DTYPE_F32, NAN, NAN, "f32 NaN"},
        {OPSMITH_DTYPE_F64, 1.0 / 3.0, 1.0 / 3.0, "f64 1/3"},
        {OPSMITH_DTYPE_F64, DBL_MAX, DBL_MAX, "f64 max"},
        {OPSMITH_DTYPE_F64, 0x1p-1074, 0x1p-1074, "f64 smallest subnormal"},
        {OPSMITH_DTYPE_F64, -0.0, -0.0, "f64 -0"},
        {OPSMITH_DTYPE_F64, NAN, NAN, "f64 NaN"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const struct rounding_case *c = &cases[i];
        unsigned char buf[8];
        memset(buf, 0, sizeof buf);
        opsmith_store_from_double(c->dt, buf, 0, c->in);
        double got = opsmith_load_as_double(c->dt, buf, 0);
        CHECK(same_value(got, c->want), "%s: store(%.17g) loads %.17g, expected %.17g", c->what,
              c->in, got, c->want);
    }
}

/* index addresses element `index` and nothing else. */
static void test_indexing(void)
{
    for (int d = 0; d < OPSMITH_DTYPE_COUNT; d++) {
        opsmith_dtype dt = (opsmith_dtype)d;
        size_t es = opsmith_dtype_size(dt);
        unsigned char buf[8 * 8], before[8 * 8];
        for (int i = 0; i < 8; i++)
            opsmith_store_from_double(dt, buf, i, (double)(i + 1));
        memcpy(before, buf, sizeof buf);
        const double v = opsmith_dtype_is_float(dt) ? -0.5 : -3.0;
        opsmith_store_from_double(dt, buf, 5, v);
        int others_same = memcmp(buf, before, 5 * es) == 0 &&
                          memcmp(buf + 6 * es, before + 6 * es, 2 * es) == 0;
        CHECK(others_same, "%s: store at index 5 changed other elements", opsmith_dtype_name(dt));
        int loads_ok = opsmith_load_as_double(dt, buf, 5) == v &&
                       opsmith_load_as_double(dt, buf, 7) == 8.0 &&
                       opsmith_load_as_double(dt, buf + es, 1) == 3.0;
        CHECK(loads_ok, "%s: load at index gives wrong element", opsmith_dtype_name(dt));
    }
}

/* The version the header promises is the library's, and the core's
 * thread setting is per thread and round-trips. */
static void test_version_and_threads(void)
{
    CHECK(opsmith_abi_version() == OPSMITH_ABI_VERSION, "abi_version() = %d, header says %d", opsmith_abi_version(),
          OPSMITH_ABI_VERSION);
    char want[32];
    snprintf(want, sizeof want, "%d.%d.%d", OPSMITH_VERSION_MAJOR, OPSMITH_VERSION_MINOR, OPSMITH_VERSION_PATCH);
    CHECK(strcmp(opsmith_version(), want) == 0, "version() = \"%s\", header says \"%s\"", opsmith_version(), want);
    const int dflt = opsmith_get_num_threads();
    CHECK(dflt >= 1, "get_num_threads() = %d by default", dflt);
    opsmith_set_num_threads(3);
    CHECK(opsmith_get_num_threads() == 3, "after set_num_threads(3): %d", opsmith_get_num_threads());
    opsmith_set_num_threads(-2);
    CHECK(opsmith_get_num_threads() == dflt, "set_num_threads(-2) must mean the default, got %d",
          opsmith_get_num_threads());
    opsmith_set_num_threads(0);
    CHECK(opsmith_get_num_threads() == dflt, "set_num_threads(0): %d, default %d", opsmith_get_num_threads(), dflt);
    /* i32/i64 convert exactly */
    int64_t i64 = 0;
    opsmith_store_from_double(OPSMITH_DTYPE_I64, &i64, 0, 9007199254740992.0);
    CHECK(i64 == 9007199254740992LL, "i64 store of 2^53 = %lld", (long long)i64);
    int32_t i32 = 0;
    opsmith_store_from_double(OPSMITH_DTYPE_I32, &i32, 0, -2147483648.0);
    CHECK(i32 == INT32_MIN && opsmith_load_as_double(OPSMITH_DTYPE_I32, &i32, 0) == -2147483648.0,
          "i32 round trip of INT32_MIN gave %d", (int)i32);
}

HARNESS_GROUP(test_types)
{
    test_version_and_threads();
    test_status_strings();
    test_dtype_metadata();
    test_roundtrip_16(OPSMITH_DTYPE_F16);
    test_roundtrip_16(OPSMITH_DTYPE_BF16);
    test_roundtrip_wide(OPSMITH_DTYPE_F32);
    test_roundtrip_wide(OPSMITH_DTYPE_F64);
    test_rounding();
    test_indexing();
}
