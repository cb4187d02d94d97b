/* Minimal test harness shared by the C test files.
 * CHECK never aborts: it counts a pass or a failure and prints the failure
 * with its location and a message naming the case, so one run reports every
 * broken case at once. */
#ifndef OPSMITH_TEST_HARNESS_H
#define OPSMITH_TEST_HARNESS_H

#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "opsmith.h"

#if defined(__GNUC__)
#define HARNESS_PRINTF(fmt_index) __attribute__((format(printf, fmt_index, fmt_index + 1)))
#else
#define HARNESS_PRINTF(fmt_index)
#endif

/* Records one check; returns ok so callers can skip dependent checks. */
int harness_check(int ok, const char *file, int line, const char *fmt, ...) HARNESS_PRINTF(4);
/* Counts `count` cases as skipped (only CUDA cases without a device). */
void harness_skip(int count);

#define CHECK(cond, ...) harness_check((cond) ? 1 : 0, __FILE__, __LINE__, __VA_ARGS__)

/* Seeded PRNG (splitmix64): reproducible inputs without libc rand(). */

/* The bound a norm's result keeps from the float64 reference, relative to
 * max(1, max |reference|): one rounding to the storage type plus the row
 * sums' error (RMSNorm and LayerNorm alike). */
static inline double norm_tol(opsmith_dtype dt)
{
    switch (dt) {
    case OPSMITH_DTYPE_F64: return 1e-12;
    case OPSMITH_DTYPE_F32: return 2e-6;
    case OPSMITH_DTYPE_F16: return 2e-3;
    default: return 1.6e-2;
    }
}

static inline double max_abs(const double *v, int64_t count)
{
    double m = 0.0;
    for (int64_t i = 0; i < count; i++)
        m = fmax(m, fabs(v[i]));
    return m;
}

typedef struct test_rng {
    uint64_t state;
} test_rng;

static inline uint64_t rng_next(test_rng *r)
{
    uint64_t z = (r->state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [0, 1). */
static inline double rng_uniform(test_rng *r)
{
    return (double)(rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

/* Uniform in [-2, 2] but never within 2^-6 of zero, so no input is zero
 * (or becomes zero after rounding to f16/bf16). */
static inline double rng_value(test_rng *r)
{
    double v;
    do {
        v = 4.0 * rng_uniform(r) - 2.0;
    } while (v > -0.015625 && v < 0.015625);
    return v;
}

/* Test groups register themselves, so adding a test file needs no central
 * list: `HARNESS_GROUP(test_foo) { ...checks... }` defines the group and a
 * constructor that enrolls it before main runs every group in turn. */
/* A host buffer between two guard zones: a kernel that writes past its
 * tensor changes them (guarded_ok). The payload starts as `fill`
 * (POISON_BYTE: NaN in every float format, so an unwritten element shows). */
#define GUARD 64
#define GUARD_BYTE 0x5A
#define POISON_BYTE 0xFF

typedef struct guarded_buf {
    unsigned char *base; /* [GUARD][payload][GUARD] */
    size_t bytes;
} guarded_buf;

static inline guarded_buf guarded_new(size_t bytes, unsigned char fill)
{
    guarded_buf b = {(unsigned char *)malloc(bytes + 2 * GUARD), bytes};
    if (!b.base) {
        fprintf(stderr, "out of host memory (%zu bytes)\n", bytes);
        exit(2);
    }
    memset(b.base, GUARD_BYTE, bytes + 2 * GUARD);
    memset(b.base + GUARD, fill, bytes);
    return b;
}

static inline void *guarded_payload(const guarded_buf *b) { return b->base + GUARD; }

static inline int guarded_ok(const guarded_buf *b)
{
    for (size_t i = 0; i < GUARD; i++)
        if (b->base[i] != GUARD_BYTE || b->base[GUARD + b->bytes + i] != GUARD_BYTE)
            return 0;
    return 1;
}

typedef void (*harness_group_fn)(void);
void harness_register(const char *name, harness_group_fn fn);

#define HARNESS_GROUP(name)                                                                        \
    static void name(void);                                                                        \
    __attribute__((constructor)) static void name##_register(void) { harness_register(#name, name); } \
    static void name(void)

#endif /* OPSMITH_TEST_HARNESS_H */
