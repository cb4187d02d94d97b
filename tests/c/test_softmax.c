/* softmax launchers (CPU, and CUDA when built with OPSMITH_WITH_CUDA=1)
 * against the float64 scalar reference.
 *
 * Inputs are drawn in double, rounded into the storage dtype, and the
 * reference sees the rounded values, so only the kernel's own arithmetic and
 * output rounding are measured. Outputs start as 0xFF bytes (NaN in every
 * float type) so an unwritten element fails, and sit between guard bytes so
 * a write outside the tensor (or into the padding between rows) fails too. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#if defined(OPSMITH_WITH_CUDA) && OPSMITH_WITH_CUDA
#include <cuda_runtime_api.h>
#define TEST_CUDA 1
#else
#define TEST_CUDA 0
#endif

typedef struct {
    opsmith_dtype dt;
    int64_t rows, n, pad; /* row stride of every tensor: n + pad */
    int off;              /* elements the tensors start past 16-byte alignment */
    int log; /* 0: softmax, 1: log_softmax */
    double scale; /* x drawn in [-2, 2] times this (0: 1) */
    int mask;     /* every 7th element of x is -inf (masked) */
} softmax_case;

static double tol_of(opsmith_dtype dt)
{
    switch (dt) {
    case OPSMITH_DTYPE_F64: return 1e-12;
    case OPSMITH_DTYPE_F32: return 1e-5; /* sums of 40000 terms in float */
    case OPSMITH_DTYPE_F16: return 2e-3;
    default: return 1.6e-2;
    }
}

/* Compares the (rows, n) elements of out (row stride s, starting `off`
 * elements in) with ref; the padding between rows must still be poison. */
static void check_out(const softmax_case *c, const char *what, const char *be, const guarded_buf *out,
                      const double *ref)
{
    const int64_t s = c->n + c->pad;
    const size_t es = opsmith_dtype_size(c->dt);
    double err = 0.0, scale = 1.0;
    int untouched = 1, gaps = 1;
    for (int64_t r = 0; r < c->rows; r++)
        for (int64_t i = 0; i < s; i++) {
            const int64_t at = c->off + r * s + i;
            if (i >= c->n) { /* padding between rows (the last row's ends the tensor) */
                if (r + 1 < c->rows)
                    for (size_t b = 0; b < es; b++)
                        gaps &= ((unsigned char *)guarded_payload(out))[at * es + b] == POISON_BYTE;
                continue;
            }
            const double got = opsmith_load_as_double(c->dt, guarded_payload(out), at), want = ref[r * c->n + i];
            if (isnan(got)) untouched = 0;
            err = fmax(err, fabs(got - want));
            scale = fmax(scale, fabs(want));
        }
    CHECK(untouched, "%s %s %s rows=%lld n=%lld pad=%lld off=%d: an element was not written (NaN)", be, what,
          opsmith_dtype_name(c->dt), (long long)c->rows, (long long)c->n, (long long)c->pad, c->off);
    CHECK(err <= tol_of(c->dt) * scale, "%s %s %s rows=%lld n=%lld pad=%lld off=%d: max err %.3e > %.3e", be, what,
          opsmith_dtype_name(c->dt), (long long)c->rows, (long long)c->n, (long long)c->pad, c->off, err,
          tol_of(c->dt) * scale);
    CHECK(gaps && guarded_ok(out), "%s %s %s rows=%lld n=%lld: wrote outside the tensor", be, what,
          opsmith_dtype_name(c->dt), (long long)c->rows, (long long)c->n);
}

/* The test's inputs: x and dy in the dtype (with padding left poison),
 * their rounded values in double, and the reference results. */
typedef struct {
    guarded_buf x, dy, yin; /* yin: the backward's y, drawn like dy */
    double *xd, *dyd, *yd, *y_ref, *dx_ref;
    size_t bytes;
} softmax_data;

static void data_init(softmax_data *d, const softmax_case *c, test_rng *rng)
{
    const int64_t s = c->n + c->pad, count = c->rows * c->n;
    const size_t es = opsmith_dtype_size(c->dt);
    d->bytes = (size_t)(c->off + (c->rows ? (c->rows - 1) * s + c->n : 0)) * es + 16;
    d->x = guarded_new(d->bytes, POISON_BYTE), d->dy = guarded_new(d->bytes, POISON_BYTE);
    d->yin = guarded_new(d->bytes, POISON_BYTE);
    d->xd = malloc(sizeof(double) * (size_t)(count + 1)), d->dyd = malloc(sizeof(double) * (size_t)(count + 1));
    d->yd = malloc(sizeof(double) * (size_t)(count + 1));
    d->y_ref = malloc(sizeof(double) * (size_t)(count + 1)), d->dx_ref = malloc(sizeof(double) * (size_t)(count + 1));
    if (!d->xd || !d->dyd || !d->yd || !d->y_ref || !d->dx_ref) {
        fprintf(stderr, "out of host memory\n");
        exit(2);
    }
    for (int64_t r = 0; r < c->rows; r++)
        for (int64_t i = 0; i < c->n; i++) {
            const int64_t at = c->off + r * s + i;
            const double xv = c->mask && i % 7 == 3 ? -INFINITY : rng_value(rng) * (c->scale > 0 ? c->scale : 1.0);
            opsmith_store_from_double(c->dt, guarded_payload(&d->x), at, xv);
            opsmith_store_from_double(c->dt, guarded_payload(&d->dy), at, rng_value(rng));
            opsmith_store_from_double(c->dt, guarded_payload(&d->yin), at, rng_value(rng));
            d->xd[r * c->n + i] = opsmith_load_as_double(c->dt, guarded_payload(&d->x), at);
            d->dyd[r * c->n + i] = opsmith_load_as_double(c->dt, guarded_payload(&d->dy), at);
            d->yd[r * c->n + i] = opsmith_load_as_double(c->dt, guarded_payload(&d->yin), at);
        }
    opsmith_softmax_fwd_reference(c->rows, c->n, d->xd, c->log, d->y_ref);
    opsmith_softmax_bwd_reference(c->rows, c->n, d->dyd, d->yd, c->log, d->dx_ref);
}

static void data_free(softmax_data *d)
{
    free(d->x.base), free(d->dy.base), free(d->yin.base), free(d->xd), free(d->dyd), free(d->yd), free(d->y_ref);
    free(d->dx_ref);
}

static void *at_off(const guarded_buf *b, const softmax_case *c)
{
    return (unsigned char *)guarded_payload(b) + (size_t)c->off * opsmith_dtype_size(c->dt);
}

static void run_cpu(const softmax_case *c, const softmax_data *d)
{
    const int64_t s = c->n + c->pad;
    guarded_buf y = guarded_new(d->bytes, POISON_BYTE), dx = guarded_new(d->bytes, POISON_BYTE);
    opsmith_status st = opsmith_softmax_fwd_cpu(c->dt, c->rows, c->n, at_off(&d->x, c), s, c->log, at_off(&y, c), s);
    if (CHECK(st == OPSMITH_STATUS_SUCCESS, "cpu fwd: %s (%s)", opsmith_status_string(st), opsmith_last_error()))
        check_out(c, "fwd", "cpu", &y, d->y_ref);
    st = opsmith_softmax_bwd_cpu(c->dt, c->rows, c->n, at_off(&d->dy, c), s, at_off(&d->yin, c), s, c->log,
                               at_off(&dx, c), s);
    if (CHECK(st == OPSMITH_STATUS_SUCCESS, "cpu bwd: %s (%s)", opsmith_status_string(st), opsmith_last_error()))
        check_out(c, "bwd", "cpu", &dx, d->dx_ref);
    /* in place: y over a copy of x, dx over a copy of dy */
    memcpy(y.base, d->x.base, d->bytes + 2 * GUARD);
    st = opsmith_softmax_fwd_cpu(c->dt, c->rows, c->n, at_off(&y, c), s, c->log, at_off(&y, c), s);
    if (CHECK(st == OPSMITH_STATUS_SUCCESS, "cpu fwd in place: %s", opsmith_last_error()))
        check_out(c, "fwd in place", "cpu", &y, d->y_ref);
    memcpy(dx.base, d->dy.base, d->bytes + 2 * GUARD);
    st = opsmith_softmax_bwd_cpu(c->dt, c->rows, c->n, at_off(&dx, c), s, at_off(&d->yin, c), s, c->log,
                               at_off(&dx, c), s);
    if (CHECK(st == OPSMITH_STATUS_SUCCESS, "cpu bwd in place: %s", opsmith_last_error()))
        check_out(c, "bwd in place", "cpu", &dx, d->dx_ref);
    free(y.base), free(dx.base);
}

#if TEST_CUDA
/* Whole buffers (poison and guards included) go to the device and back, so
 * unwritten elements and stray writes show up exactly as on the CPU. */
static int cuda_ok(cudaError_t e, const char *what)
{
    return CHECK(e == cudaSuccess, "cuda %s: %s", what, cudaGetErrorString(e));
}

static unsigned char *dev_copy(const guarded_buf *b, size_t total)
{
    unsigned char *p = NULL;
    if (!cuda_ok(cudaMalloc((void **)&p, total), "malloc")) return NULL;
    if (!cuda_ok(cudaMemcpy(p, b->base, total, cudaMemcpyHostToDevice), "upload")) {
        cudaFree(p);
        return NULL;
    }
    return p;
}

static int dev_back(guarded_buf *b, const unsigned char *p, size_t total)
{
    return cuda_ok(cudaMemcpy(b->base, p, total, cudaMemcpyDeviceToHost), "download");
}

/* out of place, then in place (y over a copy of x, dx over a copy of dy) */
static void run_cuda(const softmax_case *c, const softmax_data *d)
{
    const int64_t s = c->n + c->pad;
    const size_t total = d->bytes + 2 * GUARD, lead = GUARD + (size_t)c->off * opsmith_dtype_size(c->dt);
    guarded_buf y = guarded_new(d->bytes, POISON_BYTE), dx = guarded_new(d->bytes, POISON_BYTE);
    unsigned char *dev_x = dev_copy(&d->x, total), *dev_dy = dev_copy(&d->dy, total), *dev_yin = dev_copy(&d->yin, total);
    unsigned char *dev_y = dev_copy(&y, total), *dev_dx = dev_copy(&dx, total);
    if (dev_x && dev_dy && dev_yin && dev_y && dev_dx) {
        opsmith_status st = opsmith_softmax_fwd_cuda(c->dt, c->rows, c->n, dev_x + lead, s, c->log, dev_y + lead, s,
                                                   NULL);
        CHECK(st == OPSMITH_STATUS_SUCCESS, "cuda fwd: %s (%s)", opsmith_status_string(st), opsmith_last_error());
        st = opsmith_softmax_bwd_cuda(c->dt, c->rows, c->n, dev_dy + lead, s, dev_yin + lead, s, c->log,
                                    dev_dx + lead, s, NULL);
        CHECK(st == OPSMITH_STATUS_SUCCESS, "cuda bwd: %s (%s)", opsmith_status_string(st), opsmith_last_error());
        if (cuda_ok(cudaDeviceSynchronize(), "run") && dev_back(&y, dev_y, total) && dev_back(&dx, dev_dx, total)) {
            check_out(c, "fwd", "cuda", &y, d->y_ref);
            check_out(c, "bwd", "cuda", &dx, d->dx_ref);
        }
        /* in place: x and dy are overwritten (copies: the next case draws fresh ones) */
        st = opsmith_softmax_fwd_cuda(c->dt, c->rows, c->n, dev_x + lead, s, c->log, dev_x + lead, s, NULL);
        CHECK(st == OPSMITH_STATUS_SUCCESS, "cuda fwd in place: %s", opsmith_last_error());
        st = opsmith_softmax_bwd_cuda(c->dt, c->rows, c->n, dev_dy + lead, s, dev_yin + lead, s, c->log,
                                    dev_dy + lead, s, NULL);
        CHECK(st == OPSMITH_STATUS_SUCCESS, "cuda bwd in place: %s", opsmith_last_error());
        guarded_buf yi = guarded_new(d->bytes, POISON_BYTE), dxi = guarded_new(d->bytes, POISON_BYTE);
        if (cuda_ok(cudaDeviceSynchronize(), "run in place") && dev_back(&yi, dev_x, total) &&
            dev_back(&dxi, dev_dy, total)) {
            /* the padding holds x's (dy's) poison, as the fresh buffers' */
            check_out(c, "fwd in place", "cuda", &yi, d->y_ref);
            check_out(c, "bwd in place", "cuda", &dxi, d->dx_ref);
        }
        free(yi.base), free(dxi.base);
    }
    cudaFree(dev_x), cudaFree(dev_dy), cudaFree(dev_yin), cudaFree(dev_y), cudaFree(dev_dx);
    free(y.base), free(dx.base);
}

/* 1: a device runs the cases; 0: none here (skipped); -1: failed. */
static int cuda_begin(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        cudaGetLastError();
        return 0;
    }
    return 1;
}
#else
static int cuda_begin(void)
{
    /* a CUDA-less library answers CUDA_UNAVAILABLE, naming the reason */
    static float x[8], y[8];
    opsmith_status st = opsmith_softmax_fwd_cuda(OPSMITH_DTYPE_F32, 2, 4, x, 4, 1, y, 4, NULL);
    CHECK(opsmith_has_cuda() || (st == OPSMITH_STATUS_CUDA_UNAVAILABLE && strstr(opsmith_last_error(), "without CUDA")),
          "CUDA-less softmax_fwd_cuda returned \"%s\" (%s)", opsmith_status_string(st), opsmith_last_error());
    st = opsmith_softmax_bwd_cuda(OPSMITH_DTYPE_F32, 2, 4, x, 4, x, 4, 1, y, 4, NULL);
    CHECK(opsmith_has_cuda() || st == OPSMITH_STATUS_CUDA_UNAVAILABLE, "CUDA-less softmax_bwd_cuda returned \"%s\"",
          opsmith_status_string(st));
    return -1;
}
static void run_cuda(const softmax_case *c, const softmax_data *d) { (void)c, (void)d; }
#endif

/* One bad argument: the status, and a message naming it. */
static void expect(opsmith_status got, opsmith_status want, const char *needle, const char *what)
{
    CHECK(got == want && strstr(opsmith_last_error(), needle) != NULL,
          "%s: got \"%s\" (%s), want \"%s\" naming \"%s\"", what, opsmith_status_string(got), opsmith_last_error(),
          opsmith_status_string(want), needle);
}

static void test_bad_args(void)
{
    static double x[8], dy[8], y[8], dx[8];
    const opsmith_dtype F32 = OPSMITH_DTYPE_F32;
    const opsmith_status INVALID = OPSMITH_STATUS_INVALID_ARGUMENT, DTYPE = OPSMITH_STATUS_UNSUPPORTED_DTYPE;
    expect(opsmith_softmax_fwd_cpu(F32, 2, 4, x, 4, 1, y, 4), OPSMITH_STATUS_SUCCESS, "", "valid fwd");
    expect(opsmith_softmax_fwd_cpu(F32, -1, 4, x, 4, 1, y, 4), INVALID, "rows (-1)", "rows < 0");
    expect(opsmith_softmax_fwd_cpu(F32, 2, 0, x, 4, 1, y, 4), INVALID, "n (0)", "n = 0");
    expect(opsmith_softmax_fwd_cpu(F32, 2, 4, NULL, 4, 1, y, 4), INVALID, "x is NULL", "x NULL");
    expect(opsmith_softmax_fwd_cpu(F32, 2, 4, x, 4, 1, NULL, 4), INVALID, "y is NULL", "y NULL");
    expect(opsmith_softmax_fwd_cpu(F32, 2, 4, x, 3, 1, y, 4), INVALID, "x_row_stride (3)", "x stride");
    expect(opsmith_softmax_fwd_cpu(F32, 2, 4, x, 4, 1, y, 3), INVALID, "y_row_stride (3)", "y stride");
    expect(opsmith_softmax_fwd_cpu(OPSMITH_DTYPE_I32, 2, 4, x, 4, 1, y, 4), DTYPE, "i32", "integer dtype");
    expect(opsmith_softmax_fwd_cpu((opsmith_dtype)99, 2, 4, x, 4, 1, y, 4), DTYPE, "dtype", "dtype out of range");
    expect(opsmith_softmax_fwd_cpu(F32, 2, 4, (char *)x + 1, 4, 1, y, 4), OPSMITH_STATUS_MISALIGNED, "x (",
           "misaligned x");
    expect(opsmith_softmax_fwd_cpu(F32, 2, 4, x, 4, 1, (float *)x + 1, 4), INVALID, "y overlaps x", "partial alias");
    expect(opsmith_softmax_fwd_cpu(F32, 0, 4, NULL, 4, 1, NULL, 4), OPSMITH_STATUS_SUCCESS, "", "no rows");
    expect(opsmith_softmax_bwd_cpu(F32, 2, 4, dy, 4, x, 4, 1, dx, 4), OPSMITH_STATUS_SUCCESS, "", "valid bwd");
    expect(opsmith_softmax_bwd_cpu(F32, 2, 4, NULL, 4, x, 4, 1, dx, 4), INVALID, "dy is NULL", "dy NULL");
    expect(opsmith_softmax_bwd_cpu(F32, 2, 4, dy, 4, x, 4, 1, NULL, 4), INVALID, "dx is NULL", "dx NULL");
    expect(opsmith_softmax_bwd_cpu(F32, 2, 4, dy, 3, x, 4, 1, dx, 4), INVALID, "dy_row_stride (3)", "dy stride");
    expect(opsmith_softmax_bwd_cpu(F32, 2, 4, dy, 4, x, 4, 1, (void *)x, 4), INVALID, "dx overlaps y", "dx = y");
    expect(opsmith_softmax_bwd_cpu(F32, 2, 4, dy, 4, x, 4, 1, (char *)dx + 2, 4), OPSMITH_STATUS_MISALIGNED, "dx (",
           "misaligned dx");
}

typedef struct {
    int64_t rows, n, pad;
    int off, log;
    double scale;
    int mask;
} shape;

static void run_shapes(const shape *shapes, size_t count, int cuda, int cuda_only, uint64_t seed)
{
    for (int di = 0; di < OPSMITH_DTYPE_COUNT; di++) {
        const opsmith_dtype dt = (opsmith_dtype)di;
        if (!opsmith_dtype_is_float(dt))
            continue; /* integer dtypes are refused: test_bad_args */
        test_rng rng = {seed * (uint64_t)(di + 1)};
        for (size_t k = 0; k < count; k++) {
            const shape *h = &shapes[k];
            /* logits scaled by 1e4 only where the dtype holds them exactly enough (float32, float64) */
            if (h->scale > 1.0 && dt != OPSMITH_DTYPE_F32 && dt != OPSMITH_DTYPE_F64) continue;
            const softmax_case c = {dt, h->rows, h->n, h->pad, h->off, h->log, h->scale, h->mask};
            /* the CUDA-only shapes run on the CPU too where small, which checks the test's own expectations
             * (scaled logits included); not rows over 100000 (the CPU backward's float32 running sum of
             * dy y over random y drifts past 1e-5) */
            const int cpu = c.rows > 0 && (!cuda_only || (c.rows * c.n <= (1 << 20) && c.n <= 100000));
            if (cuda_only && cuda == 0 && !cpu) {
                harness_skip(1);
                continue;
            }
            softmax_data d;
            data_init(&d, &c, &rng);
            if (cpu)
                run_cpu(&c, &d);
            if (cuda > 0 && c.rows > 0)
                run_cuda(&c, &d);
            else if (cuda == 0)
                harness_skip(1);
            data_free(&d);
        }
    }
}

HARNESS_GROUP(test_softmax)
{
    const int cuda = cuda_begin();
    /* widths around the CPU's LANES and CHUNK and the CUDA packs; padded,
     * offset (unaligned: the scalar paths) and one-row calls */
    static const shape shapes[] = {
        {1, 1, 0, 0, 0, 0, 0},    {3, 7, 0, 0, 1, 0, 0},      {5, 64, 0, 0, 0, 0, 0},   {2, 4099, 0, 0, 1, 0, 0},
        {7, 33, 5, 1, 0, 0, 0},    {4, 256, 8, 0, 1, 0, 0},    {1, 8193, 0, 3, 0, 0, 0}, {300, 129, 0, 0, 1, 0, 0},
        {16, 2048, 16, 0, 0, 0, 0}, {3, 40000, 8, 0, 1, 0, 0}, {2, 40000, 0, 1, 0, 0, 0}, {0, 16, 0, 0, 1, 0, 0},
        /* masked (-inf) entries */
        {6, 1000, 0, 0, 0, 0, 1}, {3, 515, 1, 0, 1, 0, 1},
    };
    run_shapes(shapes, sizeof shapes / sizeof shapes[0], cuda, 0, 0x5EEDull);
    /* CUDA's on-chip plans: aligned rows of 257 to 4096 whole packs a block
     * a row in registers (9000 and 16384 but in float64, 4096 scaled), wider
     * ones a CTA a row (cluster of 1)
     * up to ~72 KB a slice, then clusters of 2, 4, 8 (bf16 128256: 4 CTAs
     * forward, 8 backward; 262144: 8; float64 262144 is too wide: the
     * streaming kernels); aligned single rows with an odd tail (the last
     * CTA's scalar tail); padded rows; unaligned wide rows (streaming);
     * scale 1e4 (and 1e30) and masked rows through the cluster path */
    static const shape wide[] = {
        {4, 128256, 0, 0, 0, 0, 0}, {3, 128256, 8, 0, 1, 0, 0}, {2, 262144, 0, 0, 0, 0, 0}, {2, 262144, 0, 0, 1, 0, 1},
        {1, 128257, 0, 0, 0, 0, 0}, {1, 262151, 0, 0, 1, 0, 0}, {1, 36871, 0, 0, 0, 0, 1},  {3, 16384, 8, 0, 0, 0, 0},
        {9, 16384, 0, 0, 1, 0, 0},  {5, 70000, 0, 2, 0, 0, 0},  {2, 128259, 5, 1, 1, 0, 0}, {14, 15631, 0, 0, 0, 1e4, 0},
        {3, 128256, 0, 0, 1, 1e4, 0}, {2, 262144, 0, 0, 0, 1e4, 0}, {2042, 237, 0, 0, 0, 1e4, 0}, {4, 65536, 0, 0, 0, 0, 0},
        {2, 100000, 0, 0, 0, 0, 0}, {3, 9000, 0, 0, 1, 0, 0},   {14, 1563, 0, 0, 0, 1e4, 0}, {5, 237, 3, 0, 1, 1e4, 0},
        {7, 4096, 0, 3, 0, 1e4, 0}, /* unaligned: the streaming kernel's scalar path, scaled */
        /* |x| ~ 1e30: far past where exp(y - max) may be formed from y log2e and max log2e */
        {6, 4096, 0, 0, 0, 1e30, 0}, {3, 128256, 0, 0, 1, 1e30, 0}, {5, 237, 0, 1, 0, 1e30, 0},
    };
    run_shapes(wide, sizeof wide / sizeof wide[0], cuda, 1, 0x5EED2ull);
    test_bad_args();
}
