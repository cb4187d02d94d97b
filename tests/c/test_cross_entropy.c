/* cross_entropy launchers (CPU, and CUDA when built with OPSMITH_WITH_CUDA=1)
 * against the float64 scalar reference.
 *
 * Logits are drawn in double, rounded into the storage dtype, and the
 * reference sees the rounded values. Outputs start as 0xFF bytes (NaN in
 * every float type) so an unwritten element fails; the gradient sits between
 * guard bytes and padded rows, so a write outside it fails too. Every case
 * runs the forward with the gradient, in place over a copy of the logits,
 * and without the gradient, then the backward out of place and in place. */
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
    int64_t rows, n, pad; /* logits and dlogits row stride: n + pad */
    int off;              /* elements the logits start past 16-byte alignment */
    int weighted;         /* class weights */
    int ignore_every;     /* every k-th row's target is ignore_index (0: none; -1: all) */
    double ls, z, cap;
    opsmith_cross_entropy_reduction red;
    double scale; /* logits drawn in [-6, 6] times this (0: 1) */
    int mask;     /* every 7th logit but the target's is -inf (masked) */
    int acc_loss; /* loss and z-loss in the accumulate type (unrounded), not the logits' */
} ce_case;

static opsmith_dtype loss_dtype_of(const ce_case *c)
{
    return c->acc_loss ? opsmith_dtype_accumulate(c->dt) : c->dt;
}

static double tol_of(opsmith_dtype dt)
{
    switch (dt) {
    case OPSMITH_DTYPE_F64: return 1e-11;
    case OPSMITH_DTYPE_F32: return 2e-5;
    case OPSMITH_DTYPE_F16: return 2e-3;
    default: return 1.6e-2;
    }
}

static const char *red_name(opsmith_cross_entropy_reduction r) { return r == 0 ? "none" : r == 1 ? "sum" : "mean"; }

#define CASE_FMT "%s rows=%lld n=%lld pad=%lld off=%d w=%d ign=%d ls=%g z=%g cap=%g %s loss %s"
#define CASE_ARGS(c)                                                                                              \
    opsmith_dtype_name((c)->dt), (long long)(c)->rows, (long long)(c)->n, (long long)(c)->pad, (c)->off,          \
        (c)->weighted, (c)->ignore_every, (c)->ls, (c)->z, (c)->cap, red_name((c)->red),                          \
        opsmith_dtype_name(loss_dtype_of(c))

/* Compares the (rows, n) elements of a padded buffer with ref, relative to
 * max |ref| (gradients of a mean are small); the padding must stay poison. */
static void check_grid(const ce_case *c, const char *what, const guarded_buf *out, const double *ref)
{
    const int64_t s = c->n + c->pad;
    const size_t es = opsmith_dtype_size(c->dt);
    double err = 0.0, scale = 0.0;
    int written = 1, gaps = 1;
    for (int64_t r = 0; r < c->rows; r++)
        for (int64_t i = 0; i < s; i++) {
            const int64_t at = c->off + r * s + i;
            if (i >= c->n) {
                if (r + 1 < c->rows)
                    for (size_t b = 0; b < es; b++)
                        gaps &= ((unsigned char *)guarded_payload(out))[at * es + b] == POISON_BYTE;
                continue;
            }
            const double got = opsmith_load_as_double(c->dt, guarded_payload(out), at), want = ref[r * c->n + i];
            if (isnan(got) != isnan(want))
                written = 0;
            else if (!isnan(want))
                err = fmax(err, fabs(got - want));
            scale = fmax(scale, fabs(want));
        }
    CHECK(written, "%s: " CASE_FMT ": NaN where the reference has none (an element was not written?)", what, CASE_ARGS(c));
    CHECK(err <= tol_of(c->dt) * fmax(scale, 1e-300), "%s: " CASE_FMT ": max err %.3e > %.3e", what, CASE_ARGS(c), err,
          tol_of(c->dt) * scale);
    CHECK(gaps && guarded_ok(out), "%s: " CASE_FMT ": wrote outside the tensor", what, CASE_ARGS(c));
}

/* count values of dtype dt against ref, within tol_of(tol_dt) relative to
 * max(1, max |ref|) */
static void check_values(const ce_case *c, const char *what, const void *got, opsmith_dtype dt, opsmith_dtype tol_dt,
                         const double *ref, int64_t count)
{
    double err = 0.0, scale = 1.0;
    int nan_ok = 1;
    for (int64_t i = 0; i < count; i++) {
        const double g = opsmith_load_as_double(dt, got, i);
        if (isnan(g) != isnan(ref[i])) nan_ok = 0;
        else if (!isnan(g)) err = fmax(err, fabs(g - ref[i])), scale = fmax(scale, fabs(ref[i]));
    }
    CHECK(nan_ok, "%s: " CASE_FMT ": NaN differs from the reference", what, CASE_ARGS(c));
    CHECK(err <= tol_of(tol_dt) * scale, "%s: " CASE_FMT ": max err %.3e > %.3e", what, CASE_ARGS(c), err,
          tol_of(tol_dt) * scale);
}

typedef struct {
    guarded_buf x;          /* logits, padded rows */
    int64_t *target;   /* rows, stride 2 (odd entries poison) */
    void *weight;      /* n, accumulate type, or NULL */
    double *xd, *wd, *loss_ref, *z_ref, *lse_ref, *dl_ref;
    size_t bytes;
    int64_t ignore;
} ce_data;

static void data_init(ce_data *d, const ce_case *c, test_rng *rng)
{
    const int64_t s = c->n + c->pad, count = c->rows * c->n;
    const size_t es = opsmith_dtype_size(c->dt);
    const opsmith_dtype acc = opsmith_dtype_accumulate(c->dt);
    d->bytes = (size_t)(c->off + (c->rows ? (c->rows - 1) * s + c->n : 0)) * es + 16;
    d->x = guarded_new(d->bytes, POISON_BYTE);
    d->target = malloc(sizeof(int64_t) * (size_t)(2 * c->rows + 1));
    d->xd = malloc(sizeof(double) * (size_t)(count + 1));
    d->wd = malloc(sizeof(double) * (size_t)c->n);
    d->weight = c->weighted ? malloc(opsmith_dtype_size(acc) * (size_t)c->n) : NULL;
    d->loss_ref = malloc(sizeof(double) * (size_t)(c->rows + 1));
    d->z_ref = malloc(sizeof(double) * (size_t)(c->rows + 1));
    d->lse_ref = malloc(sizeof(double) * (size_t)(c->rows + 1));
    d->dl_ref = malloc(sizeof(double) * (size_t)(count + 1));
    d->ignore = c->n == 5 ? 2 : -100; /* an ignore_index inside [0, n) too */
    for (int64_t r = 0; r < c->rows; r++)
        for (int64_t i = 0; i < c->n; i++) {
            const int64_t at = c->off + r * s + i;
            /* wide logits, so the softmax is far from uniform */
            opsmith_store_from_double(c->dt, guarded_payload(&d->x), at,
                                      3.0 * rng_value(rng) * (c->scale > 0 ? c->scale : 1.0));
            d->xd[r * c->n + i] = opsmith_load_as_double(c->dt, guarded_payload(&d->x), at);
        }
    for (int64_t r = 0; r < c->rows; r++) {
        int64_t t = (int64_t)(rng_uniform(rng) * (double)c->n);
        if (t == d->ignore) t = (t + 1) % c->n;
        if (c->ignore_every < 0 || (c->ignore_every > 0 && r % c->ignore_every == 1)) t = d->ignore;
        d->target[2 * r] = t, d->target[2 * r + 1] = -7777;
        if (c->mask)
            for (int64_t i = 3; i < c->n; i += 7) {
                if (i == t) continue;
                const int64_t at = c->off + r * (c->n + c->pad) + i;
                opsmith_store_from_double(c->dt, guarded_payload(&d->x), at, -INFINITY);
                d->xd[r * c->n + i] = -INFINITY;
            }
    }
    for (int64_t i = 0; i < c->n; i++) {
        d->wd[i] = c->weighted ? 0.25 + rng_uniform(rng) : 1.0;
        if (c->weighted) opsmith_store_from_double(acc, d->weight, i, d->wd[i]);
    }
    int64_t *tc = malloc(sizeof(int64_t) * (size_t)(c->rows + 1));
    for (int64_t r = 0; r < c->rows; r++) tc[r] = d->target[2 * r];
    opsmith_cross_entropy_fwd_reference(c->rows, c->n, d->xd, tc, c->weighted ? d->wd : NULL, d->ignore, c->ls, c->z,
                                        c->cap, c->red, d->loss_ref, d->z_ref, d->lse_ref, d->dl_ref);
    free(tc);
}

static void data_free(ce_data *d)
{
    free(d->x.base), free(d->target), free(d->weight), free(d->xd), free(d->wd);
    free(d->loss_ref), free(d->z_ref), free(d->lse_ref), free(d->dl_ref);
}

static void *at_off(const guarded_buf *b, const ce_case *c)
{
    return (unsigned char *)guarded_payload(b) + (size_t)c->off * opsmith_dtype_size(c->dt);
}

/* The launchers under test, CPU or CUDA, with host pointers: the CUDA
 * wrappers copy whole buffers (poison and guards included) to the device and
 * back, so unwritten elements and stray writes show up exactly as on the CPU. */
typedef opsmith_status (*fwd_fn)(const ce_case *c, const ce_data *d, const void *x, void *loss, void *z, void *lse,
                                 void *dl, int64_t *error);
typedef opsmith_status (*bwd_fn)(const ce_case *c, const void *grad, int64_t gs, const guarded_buf *dl, guarded_buf *dx);

static opsmith_status fwd_cpu(const ce_case *c, const ce_data *d, const void *x, void *loss, void *z, void *lse,
                              void *dl, int64_t *error)
{
    const size_t wb = opsmith_cross_entropy_fwd_workspace_size(c->dt, c->rows, c->z);
    void *ws = aligned_alloc(OPSMITH_WORKSPACE_ALIGNMENT, wb);
    const int64_t s = c->n + c->pad;
    opsmith_status st = opsmith_cross_entropy_fwd_cpu(c->dt, c->rows, c->n, x, s, d->target, 2, d->weight, d->ignore,
                                                      c->ls, c->z, c->cap, c->red, loss_dtype_of(c), loss, z, lse, dl,
                                                      s, error, ws, wb);
    free(ws);
    return st;
}

static opsmith_status bwd_cpu(const ce_case *c, const void *grad, int64_t gs, const guarded_buf *dl, guarded_buf *dx)
{
    const int64_t s = c->n + c->pad;
    return opsmith_cross_entropy_bwd_cpu(c->dt, c->rows, c->n, loss_dtype_of(c), grad, gs, at_off(dl, c), s,
                                         at_off(dx, c), s);
}

#if TEST_CUDA
static int cuda_ok(cudaError_t e, const char *what)
{
    return CHECK(e == cudaSuccess, "cuda %s: %s", what, cudaGetErrorString(e));
}

static void *dev_copy(const void *host, size_t bytes)
{
    void *p = NULL;
    if (!cuda_ok(cudaMalloc(&p, bytes ? bytes : 1), "malloc")) return NULL;
    if (host) cuda_ok(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice), "upload");
    return p;
}

static void dev_back(void *host, void *dev, size_t bytes)
{
    if (host && dev) cuda_ok(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost), "download");
    cudaFree(dev);
}

static opsmith_status fwd_cuda(const ce_case *c, const ce_data *d, const void *x, void *loss, void *z, void *lse,
                               void *dl, int64_t *error)
{
    const size_t es = opsmith_dtype_size(c->dt), as = opsmith_dtype_size(opsmith_dtype_accumulate(c->dt));
    const size_t ls = opsmith_dtype_size(loss_dtype_of(c));
    const int64_t s = c->n + c->pad, outs = c->red == OPSMITH_CROSS_ENTROPY_REDUCTION_NONE ? c->rows : 1;
    const size_t wb = opsmith_cross_entropy_fwd_workspace_size(c->dt, c->rows, c->z), lead = (size_t)c->off * es;
    const size_t xbytes = d->bytes + 2 * GUARD;
    /* x and dl point into buffers of d->bytes (+ guards): copy the whole buffer */
    const unsigned char *xb = (const unsigned char *)x - lead - GUARD;
    unsigned char *dlb = dl ? (unsigned char *)dl - lead - GUARD : NULL;
    const int inplace = dl == x;
    int64_t zero_error[OPSMITH_CROSS_ENTROPY_ERROR_COUNT] = {0};
    unsigned char *dx_ = dev_copy(xb, xbytes), *ddl = dl && !inplace ? dev_copy(dlb, xbytes) : NULL;
    int64_t *dt_ = dev_copy(d->target, sizeof(int64_t) * (size_t)(2 * c->rows + 1));
    void *dw = d->weight ? dev_copy(d->weight, as * (size_t)c->n) : NULL;
    void *dloss = dev_copy(loss, ls * (size_t)outs), *dz = z ? dev_copy(z, ls * (size_t)outs) : NULL;
    void *dlse = lse ? dev_copy(lse, as * (size_t)(c->rows + 1)) : NULL, *dws = dev_copy(NULL, wb);
    int64_t *derr = dev_copy(zero_error, sizeof zero_error);
    unsigned char *dlp = !dl ? NULL : inplace ? dx_ + GUARD + lead : ddl + GUARD + lead;
    opsmith_status st = opsmith_cross_entropy_fwd_cuda(c->dt, c->rows, c->n, dx_ + GUARD + lead, s, dt_, 2, dw,
                                                       d->ignore, c->ls, c->z, c->cap, c->red, loss_dtype_of(c), dloss,
                                                       dz, dlse, dlp, s,
                                                       derr, dws, wb, NULL);
    cuda_ok(cudaDeviceSynchronize(), "fwd");
    if (inplace) dev_back(dlb, dx_, xbytes);
    else cudaFree(dx_), dev_back(dlb, ddl, xbytes);
    dev_back(loss, dloss, ls * (size_t)outs), dev_back(z, dz, ls * (size_t)outs);
    dev_back(lse, dlse, as * (size_t)c->rows);
    dev_back(error ? error : zero_error, derr, sizeof zero_error);
    cudaFree(dt_), cudaFree(dw), cudaFree(dws);
    return st;
}

static opsmith_status bwd_cuda(const ce_case *c, const void *grad, int64_t gs, const guarded_buf *dl, guarded_buf *dx)
{
    const size_t es = opsmith_dtype_size(c->dt), lead = (size_t)c->off * es, bytes = dl->bytes + 2 * GUARD;
    const int64_t s = c->n + c->pad, gcount = gs ? c->rows : 1;
    const int inplace = dl == dx;
    unsigned char *ddl = dev_copy(dl->base, bytes), *ddx = inplace ? ddl : dev_copy(dx->base, bytes);
    void *dg = dev_copy(grad, opsmith_dtype_size(loss_dtype_of(c)) * (size_t)gcount);
    opsmith_status st = opsmith_cross_entropy_bwd_cuda(c->dt, c->rows, c->n, loss_dtype_of(c), dg, gs, ddl + GUARD + lead, s,
                                                       ddx + GUARD + lead, s, NULL);
    cuda_ok(cudaDeviceSynchronize(), "bwd");
    dev_back(dx->base, ddx, bytes);
    if (!inplace) cudaFree(ddl);
    cudaFree(dg);
    return st;
}

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
    static float x[8], loss[2];
    static int64_t t[2], err[3];
    opsmith_status st = opsmith_cross_entropy_fwd_cuda(OPSMITH_DTYPE_F32, 2, 4, x, 4, t, 1, NULL, -100, 0, 0, 0,
                                                       OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN, OPSMITH_DTYPE_F32, loss, NULL,
                                                       NULL, NULL, 4,
                                                       err, NULL, 0, NULL);
    CHECK(opsmith_has_cuda() || (st == OPSMITH_STATUS_CUDA_UNAVAILABLE && strstr(opsmith_last_error(), "without CUDA")),
          "CUDA-less cross_entropy_fwd_cuda returned \"%s\" (%s)", opsmith_status_string(st), opsmith_last_error());
    st = opsmith_cross_entropy_bwd_cuda(OPSMITH_DTYPE_F32, 2, 4, OPSMITH_DTYPE_F32, loss, 0, x, 4, x, 4, NULL);
    CHECK(opsmith_has_cuda() || st == OPSMITH_STATUS_CUDA_UNAVAILABLE, "CUDA-less cross_entropy_bwd_cuda returned \"%s\"",
          opsmith_status_string(st));
    return -1;
}
#define fwd_cuda NULL
#define bwd_cuda NULL
#endif

static void run(const char *be, fwd_fn fwd, bwd_fn bwd, const ce_case *c, const ce_data *d, test_rng *rng)
{
    char what[96];
    const opsmith_dtype acc = opsmith_dtype_accumulate(c->dt), ldt = loss_dtype_of(c);
    const size_t as = opsmith_dtype_size(acc), ls = opsmith_dtype_size(ldt);
    const int64_t outs = c->red == OPSMITH_CROSS_ENTROPY_REDUCTION_NONE ? c->rows : 1, count = c->rows * c->n;
    void *loss = malloc(ls * (size_t)(outs + 1)), *z = malloc(ls * (size_t)(outs + 1));
    void *lse = malloc(as * (size_t)(c->rows + 1));
    guarded_buf dl = guarded_new(d->bytes, POISON_BYTE), dx = guarded_new(d->bytes, POISON_BYTE);
    memset(loss, POISON_BYTE, ls * (size_t)outs), memset(z, POISON_BYTE, ls * (size_t)outs);
    memset(lse, POISON_BYTE, as * (size_t)c->rows);
    int64_t error[OPSMITH_CROSS_ENTROPY_ERROR_COUNT] = {0};

    /* forward with the gradient */
    opsmith_status st = fwd(c, d, at_off(&d->x, c), loss, z, lse, at_off(&dl, c), error);
    snprintf(what, sizeof what, "%s fwd", be);
    if (CHECK(st == OPSMITH_STATUS_SUCCESS, "%s: %s (%s)", what, opsmith_status_string(st), opsmith_last_error())) {
        /* a loss in the accumulate type is held to that type's tolerance:
         * rounding it to the logits' 16 bits fails */
        check_values(c, "loss", loss, ldt, ldt, d->loss_ref, outs);
        check_values(c, "z_loss", z, ldt, ldt, d->z_ref, outs);
        check_values(c, "lse", lse, acc, c->dt, d->lse_ref, c->rows);
        check_grid(c, what, &dl, d->dl_ref);
        CHECK(error[0] == 0, "%s: " CASE_FMT ": error flag set", what, CASE_ARGS(c));
    }
    /* in place: the gradient over a copy of the logits */
    guarded_buf xi = guarded_new(d->bytes, GUARD_BYTE);
    memcpy(xi.base, d->x.base, d->bytes + 2 * GUARD);
    memset(loss, POISON_BYTE, ls * (size_t)outs);
    st = fwd(c, d, at_off(&xi, c), loss, NULL, NULL, at_off(&xi, c), NULL);
    snprintf(what, sizeof what, "%s fwd in place", be);
    if (CHECK(st == OPSMITH_STATUS_SUCCESS, "%s: %s (%s)", what, opsmith_status_string(st), opsmith_last_error())) {
        check_values(c, "loss (in place)", loss, ldt, ldt, d->loss_ref, outs);
        /* the padding holds the logits' poison: compare only the rows */
        check_grid(c, what, &xi, d->dl_ref);
    }
    free(xi.base);
    /* no gradient: the loss alone */
    memset(loss, POISON_BYTE, ls * (size_t)outs);
    st = fwd(c, d, at_off(&d->x, c), loss, NULL, NULL, NULL, NULL);
    if (CHECK(st == OPSMITH_STATUS_SUCCESS, "%s fwd (no grad): %s", be, opsmith_last_error()))
        check_values(c, "loss (no grad)", loss, ldt, ldt, d->loss_ref, outs);

    /* backward: dx = grad * dlogits, from the kernel's own dlogits */
    const int64_t gs = c->red == OPSMITH_CROSS_ENTROPY_REDUCTION_NONE ? 1 : 0, gcount = gs ? c->rows : 1;
    void *grad = malloc(ls * (size_t)(gcount + 1)); /* the loss's dtype: a float32 loss's gradient is float32 */
    double *gd = malloc(sizeof(double) * (size_t)(gcount + 1)), *dlv = malloc(sizeof(double) * (size_t)(count + 1));
    double *dx_ref = malloc(sizeof(double) * (size_t)(count + 1));
    for (int64_t i = 0; i < gcount; i++) {
        opsmith_store_from_double(ldt, grad, i, i % 3 == 2 ? 1.0 : rng_value(rng)); /* some rows exactly 1 */
        gd[i] = opsmith_load_as_double(ldt, grad, i);
    }
    const int64_t s = c->n + c->pad;
    for (int64_t r = 0; r < c->rows; r++)
        for (int64_t i = 0; i < c->n; i++) dlv[r * c->n + i] = opsmith_load_as_double(c->dt, guarded_payload(&dl), c->off + r * s + i);
    opsmith_cross_entropy_bwd_reference(c->rows, c->n, gd, gs, dlv, dx_ref);
    st = bwd(c, grad, gs, &dl, &dx);
    snprintf(what, sizeof what, "%s bwd", be);
    if (CHECK(st == OPSMITH_STATUS_SUCCESS, "%s: %s (%s)", what, opsmith_status_string(st), opsmith_last_error()))
        check_grid(c, what, &dx, dx_ref);
    st = bwd(c, grad, gs, &dl, &dl);
    snprintf(what, sizeof what, "%s bwd in place", be);
    if (CHECK(st == OPSMITH_STATUS_SUCCESS, "%s: %s (%s)", what, opsmith_status_string(st), opsmith_last_error()))
        check_grid(c, what, &dl, dx_ref);
    free(grad), free(gd), free(dlv), free(dx_ref);
    free(loss), free(z), free(lse), free(dl.base), free(dx.base);
}

/* A target out of range: the CPU fails naming it; CUDA flags it on the
 * device (row, value) and makes that row's loss NaN. */
static void test_bad_target(const char *be, fwd_fn fwd, int cuda, int64_t n)
{
    const ce_case c = {OPSMITH_DTYPE_F32, 4, n, 0, 0, 0, 0, 0.0, 0.0, 0.0, OPSMITH_CROSS_ENTROPY_REDUCTION_NONE, 0, 0, 0};
    test_rng rng = {42};
    ce_data d;
    data_init(&d, &c, &rng);
    d.target[2 * 2] = n + 4;
    float loss[4];
    int64_t error[OPSMITH_CROSS_ENTROPY_ERROR_COUNT] = {0};
    opsmith_status st = fwd(&c, &d, at_off(&d.x, &c), loss, NULL, NULL, NULL, error);
    if (!cuda) {
        CHECK(st == OPSMITH_STATUS_INVALID_ARGUMENT && strstr(opsmith_last_error(), "target 9 (row 2) is out of range [0, 5)") &&
                  n == 5,
              "%s bad target: got \"%s\" (%s)", be, opsmith_status_string(st), opsmith_last_error());
    } else {
        CHECK(st == OPSMITH_STATUS_SUCCESS, "%s bad target: launch failed: %s", be, opsmith_last_error());
        CHECK(isnan(loss[2]) && !isnan(loss[0]) && !isnan(loss[3]), "%s bad target: that row's loss must be NaN, only it", be);
    }
    CHECK(error[0] == 1 && error[1] == 2 && error[2] == n + 4,
          "%s bad target (n=%lld): error buffer {%lld, %lld, %lld}, want {1, 2, %lld}", be, (long long)n,
          (long long)error[0], (long long)error[1], (long long)error[2], (long long)(n + 4));
    data_free(&d);
}

static void expect(opsmith_status got, opsmith_status want, const char *needle, const char *what)
{
    CHECK(got == want && strstr(opsmith_last_error(), needle) != NULL,
          "%s: got \"%s\" (%s), want \"%s\" naming \"%s\"", what, opsmith_status_string(got), opsmith_last_error(),
          opsmith_status_string(want), needle);
}

static void test_bad_args(void)
{
    static float x[8], loss[2], dl[8];
    static int64_t t[2] = {0, 1};
    static _Alignas(64) unsigned char ws[256];
    const opsmith_dtype F32 = OPSMITH_DTYPE_F32;
    const opsmith_status INVALID = OPSMITH_STATUS_INVALID_ARGUMENT;
    const opsmith_cross_entropy_reduction MEAN = OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN;
#define FWD(rows, n, X, XS, T, LS, Z, CAP, RED, LOSS, DL, DLS, WS, WB)                                            \
    opsmith_cross_entropy_fwd_cpu(F32, rows, n, X, XS, T, 1, NULL, -100, LS, Z, CAP, RED, F32, LOSS, NULL, NULL, DL, \
                                  DLS, NULL, WS, WB)
    expect(FWD(2, 4, x, 4, t, 0, 0, 0, MEAN, loss, dl, 4, ws, sizeof ws), OPSMITH_STATUS_SUCCESS, "", "valid fwd");
    expect(FWD(-1, 4, x, 4, t, 0, 0, 0, MEAN, loss, dl, 4, ws, sizeof ws), INVALID, "rows (-1)", "rows < 0");
    expect(FWD(2, 0, x, 4, t, 0, 0, 0, MEAN, loss, dl, 4, ws, sizeof ws), INVALID, "n (0)", "n = 0");
    expect(FWD(2, 4, NULL, 4, t, 0, 0, 0, MEAN, loss, dl, 4, ws, sizeof ws), INVALID, "logits is NULL", "logits NULL");
    expect(FWD(2, 4, x, 4, NULL, 0, 0, 0, MEAN, loss, dl, 4, ws, sizeof ws), INVALID, "target is NULL", "target NULL");
    expect(FWD(2, 4, x, 4, t, 0, 0, 0, MEAN, NULL, dl, 4, ws, sizeof ws), INVALID, "loss is NULL", "loss NULL");
    expect(FWD(2, 4, x, 3, t, 0, 0, 0, MEAN, loss, dl, 4, ws, sizeof ws), INVALID, "logits_row_stride (3)", "stride");
    expect(FWD(2, 4, x, 4, t, 0, 0, 0, MEAN, loss, dl, 3, ws, sizeof ws), INVALID, "dlogits_row_stride (3)", "dl stride");
    expect(FWD(2, 4, x, 4, t, 1.5, 0, 0, MEAN, loss, dl, 4, ws, sizeof ws), INVALID, "label_smoothing (1.5)", "ls > 1");
    expect(FWD(2, 4, x, 4, t, NAN, 0, 0, MEAN, loss, dl, 4, ws, sizeof ws), INVALID, "label_smoothing", "ls NaN");
    expect(FWD(2, 4, x, 4, t, 0, -1, 0, MEAN, loss, dl, 4, ws, sizeof ws), INVALID, "z_loss (-1)", "z < 0");
    expect(FWD(2, 4, x, 4, t, 0, 0, INFINITY, MEAN, loss, dl, 4, ws, sizeof ws), INVALID, "softcap (inf)", "cap inf");
    expect(FWD(2, 4, x, 4, t, 0, 0, 0, (opsmith_cross_entropy_reduction)7, loss, dl, 4, ws, sizeof ws), INVALID,
           "reduction (7)", "reduction");
    expect(FWD(2, 4, x, 4, t, 0, 0, 0, MEAN, loss, dl, 4, NULL, 0), INVALID, "workspace is NULL", "no workspace");
    expect(FWD(2, 4, x, 4, t, 0, 0, 0, MEAN, loss, dl, 4, ws, 8), OPSMITH_STATUS_WORKSPACE_TOO_SMALL, "workspace_bytes (8)",
           "small workspace");
    /* the workspace: one accumulate value a row (the z-loss rows only with a
     * z-loss), so a workspace sized for z_loss 0 is too small for z_loss > 0 */
    const size_t plain = opsmith_cross_entropy_fwd_workspace_size(F32, 60, 0.0),
                 with_z = opsmith_cross_entropy_fwd_workspace_size(F32, 60, 1e-4);
    CHECK(plain >= 62 * 4 && plain <= 62 * 4 + OPSMITH_WORKSPACE_ALIGNMENT, "workspace(f32, 60 rows, z 0) = %zu bytes",
          plain);
    CHECK(with_z >= 122 * 4 && with_z <= 122 * 4 + OPSMITH_WORKSPACE_ALIGNMENT, "workspace(f32, 60 rows, z 1e-4) = %zu",
          with_z);
    CHECK(opsmith_cross_entropy_fwd_workspace_size(OPSMITH_DTYPE_F64, 60, 0.0) >= 62 * 8, "f64 workspace in doubles");
    expect(FWD(60, 1, x, 1, t, 0, 1e-4, 0, MEAN, loss, NULL, 1, ws, plain), OPSMITH_STATUS_WORKSPACE_TOO_SMALL,
           "workspace_bytes", "workspace without the z-loss rows");
    expect(FWD(2, 4, x, 4, t, 0, 0, 0, MEAN, loss, x + 1, 4, ws, sizeof ws), INVALID, "dlogits overlaps logits",
           "partial alias");
    expect(FWD(2, 4, (char *)x + 1, 4, t, 0, 0, 0, MEAN, loss, dl, 4, ws, sizeof ws), OPSMITH_STATUS_MISALIGNED,
           "logits (", "misaligned logits");
    /* every pointer's alignment, the scalar outputs' and the class weights' too */
    expect(FWD(2, 4, x, 4, t, 0, 0, 0, MEAN, (char *)loss + 1, dl, 4, ws, sizeof ws), OPSMITH_STATUS_MISALIGNED,
           "loss (", "misaligned loss");
    expect(opsmith_cross_entropy_fwd_cpu(F32, 2, 4, x, 4, t, 1, NULL, -100, 0, 0, 0, MEAN, F32, loss,
                                         (char *)loss + 1, NULL, dl, 4, NULL, ws, sizeof ws),
           OPSMITH_STATUS_MISALIGNED, "z_out (", "misaligned z_out");
    expect(opsmith_cross_entropy_fwd_cpu(F32, 2, 4, x, 4, t, 1, NULL, -100, 0, 0, 0, MEAN, F32, loss, NULL,
                                         (char *)dl + 2, NULL, 4, NULL, ws, sizeof ws),
           OPSMITH_STATUS_MISALIGNED, "lse (", "misaligned lse");
    expect(opsmith_cross_entropy_fwd_cpu(F32, 2, 4, x, 4, t, 1, (char *)dl + 1, -100, 0, 0, 0, MEAN, F32, loss, NULL,
                                         NULL, NULL, 4, NULL, ws, sizeof ws),
           OPSMITH_STATUS_MISALIGNED, "weight (", "misaligned weight");
    /* softcap and z_loss narrowed to float for float logits: within its range */
    expect(FWD(2, 4, x, 4, t, 0, 0, 1e39, MEAN, loss, dl, 4, ws, sizeof ws), INVALID, "softcap (1e+39) must be 0 or within",
           "softcap past FLT_MAX");
    expect(FWD(2, 4, x, 4, t, 0, 0, 1e-40, MEAN, loss, dl, 4, ws, sizeof ws), INVALID, "softcap (1e-40) must be 0 or within",
           "softcap under FLT_MIN");
    expect(FWD(2, 4, x, 4, t, 0, 1e39, 0, MEAN, loss, dl, 4, ws, sizeof ws), INVALID, "z_loss (1e+39) must be <=",
           "z_loss past FLT_MAX");
    expect(opsmith_cross_entropy_fwd_cpu(OPSMITH_DTYPE_I32, 2, 4, x, 4, t, 1, NULL, -100, 0, 0, 0, MEAN,
                                         OPSMITH_DTYPE_I32, loss, NULL, NULL, NULL, 4, NULL, ws, sizeof ws),
           OPSMITH_STATUS_UNSUPPORTED_DTYPE, "i32", "integer dtype");
    /* the loss in the logits' dtype or their accumulate type, nothing else */
    expect(opsmith_cross_entropy_fwd_cpu(F32, 2, 4, x, 4, t, 1, NULL, -100, 0, 0, 0, MEAN, OPSMITH_DTYPE_F64, loss, NULL,
                                         NULL, dl, 4, NULL, ws, sizeof ws),
           INVALID, "loss_dtype (f64) must be the logits' dtype (f32) or its accumulate type (f32)", "f64 loss, f32 logits");
    expect(opsmith_cross_entropy_fwd_cpu(OPSMITH_DTYPE_BF16, 2, 4, x, 4, t, 1, NULL, -100, 0, 0, 0, MEAN,
                                         OPSMITH_DTYPE_F16, loss, NULL, NULL, NULL, 4, NULL, ws, sizeof ws),
           INVALID, "loss_dtype (f16)", "f16 loss, bf16 logits");
    expect(opsmith_cross_entropy_bwd_cpu(F32, 2, 4, F32, loss, 0, dl, 4, x, 4), OPSMITH_STATUS_SUCCESS, "", "valid bwd");
    expect(opsmith_cross_entropy_bwd_cpu(F32, 2, 4, F32, loss, 2, dl, 4, x, 4), INVALID, "grad_stride (2)", "grad stride");
    expect(opsmith_cross_entropy_bwd_cpu(F32, 2, 4, F32, NULL, 0, dl, 4, x, 4), INVALID, "grad is NULL", "grad NULL");
    expect(opsmith_cross_entropy_bwd_cpu(F32, 2, 4, F32, loss, 0, dl, 4, dl + 1, 4), INVALID, "dx overlaps dlogits",
           "dx alias");
    expect(opsmith_cross_entropy_bwd_cpu(OPSMITH_DTYPE_BF16, 2, 4, OPSMITH_DTYPE_F64, loss, 0, dl, 4, x, 4), INVALID,
           "grad_dtype (f64) must be the logits' dtype (bf16) or its accumulate type (f32)", "f64 grad, bf16 logits");
    expect(opsmith_cross_entropy_bwd_cpu(OPSMITH_DTYPE_BF16, 2, 4, F32, (char *)loss + 2, 0, dl, 4, x, 4),
           OPSMITH_STATUS_MISALIGNED, "grad (", "a float32 grad aligned to 2 bytes only");
#undef FWD
}

/* cuda_only: shapes for the CUDA plans, run on the CPU too where small
 * and unscaled (which checks the test's own expectations) */
static void run_list(const ce_case *shapes, size_t count, int cuda, int cuda_only, uint64_t seed)
{
    for (int di = 0; di < OPSMITH_DTYPE_COUNT; di++) {
        const opsmith_dtype dt = (opsmith_dtype)di;
        if (!opsmith_dtype_is_float(dt)) continue;
        test_rng rng = {seed * (uint64_t)(di + 1)};
        for (size_t k = 0; k < count; k++) {
            ce_case c = shapes[k];
            c.dt = dt;
            c.acc_loss = (int)(k % 2); /* every other shape: the loss unrounded, as under autocast */
            /* logits scaled by 1e4: float32 and float64 only */
            if (c.scale > 1.0 && dt != OPSMITH_DTYPE_F32 && dt != OPSMITH_DTYPE_F64) continue;
            /* the CPU takes the CUDA plans' cases that are small enough to be quick */
            const int cpu = !cuda_only || (c.rows * c.n <= 300000);
            if (!cpu && cuda <= 0) {
                if (cuda == 0) harness_skip(1);
                continue;
            }
            ce_data d;
            data_init(&d, &c, &rng);
            if (cpu) run("cpu", fwd_cpu, bwd_cpu, &c, &d, &rng);
            if (cuda > 0) run("cuda", fwd_cuda, bwd_cuda, &c, &d, &rng);
            else if (cuda == 0) harness_skip(1);
            data_free(&d);
        }
    }
}

/* a +inf logit makes its row's loss and gradient NaN (inf - inf), as
 * PyTorch, and leaves the other rows alone: the small-row and the general
 * CPU paths */
static void test_infinite_logit(void)
{
    for (int64_t n = 8; n <= 300; n += 292) {
        float x[2 * 300], loss[2], dl[2 * 300];
        int64_t t[2] = {1, 2};
        _Alignas(64) unsigned char ws[256];
        for (int64_t i = 0; i < 2 * n; i++) x[i] = (float)((i * 7) % 11) * 0.25f - 1.0f;
        x[3] = INFINITY;
        const opsmith_status st = opsmith_cross_entropy_fwd_cpu(
            OPSMITH_DTYPE_F32, 2, n, x, n, t, 1, NULL, -100, 0.0, 0.0, 0.0, OPSMITH_CROSS_ENTROPY_REDUCTION_NONE,
            OPSMITH_DTYPE_F32, loss, NULL, NULL, dl, n, NULL, ws, sizeof ws);
        CHECK(st == OPSMITH_STATUS_SUCCESS, "n=%lld: status %d", (long long)n, (int)st);
        int row0_nan = isnan(loss[0]), row1_finite = isfinite(loss[1]);
        for (int64_t c = 0; c < n; c++) row0_nan &= isnan(dl[c]) != 0, row1_finite &= isfinite(dl[n + c]) != 0;
        CHECK(row0_nan, "n=%lld: a +inf logit must make its row's loss and gradient NaN (loss %g)", (long long)n,
              (double)loss[0]);
        CHECK(row1_finite, "n=%lld: the row without one must stay finite (loss %g)", (long long)n, (double)loss[1]);
    }
}

HARNESS_GROUP(test_cross_entropy)
{
    const int cuda = cuda_begin();
    const opsmith_cross_entropy_reduction NONE = OPSMITH_CROSS_ENTROPY_REDUCTION_NONE,
                                          SUM = OPSMITH_CROSS_ENTROPY_REDUCTION_SUM,
                                          MEAN = OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN;
    /* widths around the CPU's LANES and the CUDA packs and block sweeps;
     * padded and offset (unaligned: the scalar paths) rows; every option */
    const ce_case shapes[] = {
        {0, 1, 1, 0, 0, 0, 0, 0.0, 0.0, 0.0, MEAN, 0, 0, 0},      {0, 3, 7, 0, 0, 0, 0, 0.0, 0.0, 0.0, NONE, 0, 0, 0},
        {0, 5, 64, 0, 0, 1, 2, 0.1, 0.0, 0.0, MEAN, 0, 0, 0},     {0, 4, 5, 0, 0, 1, 3, 0.2, 1e-3, 0.0, SUM, 0, 0, 0},
        {0, 7, 33, 5, 1, 0, 3, 0.0, 1e-2, 5.0, MEAN, 0, 0, 0},    {0, 4, 256, 8, 0, 1, 0, 0.3, 1e-4, 2.0, NONE, 0, 0, 0},
        {0, 2, 4099, 0, 0, 0, 0, 0.0, 0.0, 0.0, MEAN, 0, 0, 0},   {0, 3, 8193, 0, 3, 1, 2, 0.1, 1e-4, 30.0, SUM, 0, 0, 0},
        {0, 300, 129, 0, 0, 0, 5, 0.05, 0.0, 0.0, MEAN, 0, 0, 0}, {0, 6, 40000, 16, 0, 1, 4, 0.1, 1e-4, 0.0, NONE, 0, 0, 0},
        {0, 2, 262144, 0, 0, 1, 0, 0.1, 1e-4, 30.0, MEAN, 0, 0, 0}, /* Gemma's vocabulary */
        {0, 3, 128259, 5, 1, 0, 0, 0.0, 0.0, 0.0, SUM, 0, 0, 0},   /* wide, odd and unaligned: the scalar path */
        {0, 4, 16, 0, 0, 1, -1, 0.1, 1e-4, 0.0, MEAN, 0, 0, 0},   /* every row ignored: NaN, gradient 0 */
        {0, 4, 16, 0, 0, 0, -1, 0.0, 0.0, 0.0, SUM, 0, 0, 0},     {0, 0, 16, 0, 0, 0, 0, 0.0, 0.0, 0.0, MEAN, 0, 0, 0},
        {0, 0, 16, 0, 0, 0, 0, 0.0, 0.0, 0.0, SUM, 0, 0, 0},
    };
    run_list(shapes, sizeof shapes / sizeof shapes[0], cuda, 0, 0xCE5EEDull);
    test_infinite_logit();
    /* CUDA's on-chip plans (online_softmax.cuh: a CTA a row up to ~72 KB a
     * slice, then clusters of 2, 4, 8; float64 262144 is too wide: the
     * streaming kernel), with every option: Llama 3's and Gemma's
     * vocabularies; single aligned rows with an odd tail (the last CTA's
     * scalar tail); padded rows; unaligned (streaming); logits scaled by
     * 1e4 in float32 (the gradient's p = exp(y - m) / sum, no lse formed);
     * masked (-inf) logits; ignored rows inside a cluster launch */
    const ce_case wide[] = {
        {0, 4, 128256, 0, 0, 1, 3, 0.1, 1e-4, 0.0, MEAN, 0, 0, 0},  {0, 3, 128256, 8, 0, 0, 0, 0.0, 0.0, 30.0, NONE, 0, 0, 0},
        {0, 2, 262144, 0, 0, 0, 0, 0.0, 1e-4, 0.0, SUM, 0, 0, 0},    {0, 1, 128257, 0, 0, 1, 0, 0.1, 1e-3, 0.0, MEAN, 0, 0, 0},
        {0, 1, 262151, 0, 0, 0, 0, 0.0, 0.0, 0.0, NONE, 0, 0, 0},    {0, 3, 16384, 8, 0, 1, 2, 0.2, 0.0, 5.0, MEAN, 0, 0, 0},
        {0, 9, 32000, 0, 0, 0, 0, 0.0, 0.0, 0.0, MEAN, 0, 0, 0},     {0, 5, 70000, 0, 2, 1, 0, 0.1, 1e-4, 0.0, SUM, 0, 0, 0},
        {0, 3, 128256, 0, 0, 0, 2, 0.0, 1e-4, 0.0, MEAN, 1e4, 0, 0}, {0, 14, 15631, 0, 0, 0, 0, 0.0, 0.0, 0.0, NONE, 1e4, 0, 0},
        {0, 2, 262144, 0, 0, 1, 0, 0.1, 0.0, 0.0, SUM, 1e4, 0, 0},  {0, 7, 4096, 0, 3, 0, 0, 0.0, 0.0, 0.0, NONE, 1e4, 0, 0},
        {0, 2, 128256, 0, 0, 0, 0, 0.0, 1e-4, 0.0, MEAN, 0, 1, 0},   {0, 4, 65536, 0, 0, 1, 0, 0.0, 0.0, 0.0, NONE, 0, 1, 0},
        {0, 6, 100000, 0, 0, 0, -1, 0.1, 1e-4, 0.0, MEAN, 0, 0, 0}, {0, 2, 1000, 0, 0, 0, 0, 0.0, 0.0, 0.0, SUM, 0, 0, 0},
        {0, 5, 100, 0, 0, 0, 0, 0.0, 0.0, 0.0, MEAN, 0, 1, 0},      {0, 3, 1001, 3, 0, 1, 0, 0.0, 1e-4, 0.0, NONE, 0, 1, 0},
        {0, 3, 1001, 0, 1, 0, 0, 0.0, 0.0, 0.0, SUM, 0, 1, 0}, /* masked, unaligned: the streaming scalar path */
        /* logits of magnitude 1e30 (on chip, cluster, streaming) */
        {0, 4, 4096, 0, 0, 1, 0, 0.0, 0.0, 0.0, MEAN, 1e30, 0, 0},  {0, 2, 128256, 0, 0, 0, 0, 0.0, 0.0, 0.0, NONE, 1e30, 0, 0},
        {0, 3, 999, 0, 1, 0, 0, 0.0, 0.0, 0.0, SUM, 1e30, 0, 0},
    };
    run_list(wide, sizeof wide / sizeof wide[0], cuda, 1, 0xCE5EED2ull);
    test_bad_target("cpu", fwd_cpu, 0, 5);
    if (cuda > 0) {
        test_bad_target("cuda", fwd_cuda, 1, 5);     /* the streaming kernel */
        test_bad_target("cuda", fwd_cuda, 1, 4096);  /* on chip, a CTA a row */
        test_bad_target("cuda", fwd_cuda, 1, 131072); /* on chip, a cluster a row */
    }
    test_bad_args();
}
