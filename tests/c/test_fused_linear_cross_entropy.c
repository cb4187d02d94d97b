/* fused_linear_cross_entropy launchers (CPU, and CUDA when built with
 * OPSMITH_WITH_CUDA=1) against the float64 scalar reference.
 *
 * hidden, weight and bias are drawn in double and rounded into the storage
 * dtype; the reference sees the rounded values. Outputs start as 0xFF bytes
 * (NaN in every float type) between guard zones, so an unwritten element or
 * a write outside a tensor fails. Every case runs with all gradients, with
 * the loss alone, and with dweight alone (the gradients in the inputs' dtype
 * or, fp32_dw 2, in float32); hidden has padded rows (a row
 * stride past dim) and target a stride of 2; chunk sizes that do not divide
 * the rows (so a chunk's hidden pointer is not 16-byte aligned). */
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
    int64_t rows, dim, vocab, pad, chunk;
    int bias;
    int ignore_every; /* every k-th target is ignore_index (0: none; -1: all) */
    double ls, z, cap;
    opsmith_cross_entropy_reduction red;
    int fp32_dw;
} fl_case;

static double tol_of(opsmith_dtype dt)
{
    switch (dt) {
    case OPSMITH_DTYPE_F64: return 1e-10;
    case OPSMITH_DTYPE_F32: return 1e-4;
    case OPSMITH_DTYPE_F16: return 5e-3;
    default: return 3e-2;
    }
}

#define CASE_FMT "%s rows=%lld dim=%lld vocab=%lld pad=%lld chunk=%lld bias=%d ign=%d ls=%g z=%g cap=%g %s fp32dw=%d"
#define CASE_ARGS(c)                                                                                              \
    opsmith_dtype_name((c)->dt), (long long)(c)->rows, (long long)(c)->dim, (long long)(c)->vocab,               \
        (long long)(c)->pad, (long long)(c)->chunk, (c)->bias, (c)->ignore_every, (c)->ls, (c)->z, (c)->cap,      \
        (c)->red == OPSMITH_CROSS_ENTROPY_REDUCTION_SUM ? "sum" : "mean", (c)->fp32_dw

typedef struct {
    void *h, *w, *b;   /* storage: h (rows, dim + pad), w (vocab, dim), b (vocab) */
    int64_t *target;   /* rows, stride 2 (odd entries poison) */
    double *hd, *wd, *bd, loss_ref, z_ref, *dh_ref, *dw_ref, *db_ref;
    int64_t ignore;
} fl_data;

static double draw(opsmith_dtype dt, void *base, int64_t i, double v)
{
    opsmith_store_from_double(dt, base, i, v);
    return opsmith_load_as_double(dt, base, i);
}

static void data_init(fl_data *d, const fl_case *c, test_rng *rng)
{
    const size_t es = opsmith_dtype_size(c->dt);
    const int64_t hs = c->dim + c->pad, R = c->rows, D = c->dim, V = c->vocab;
    d->ignore = -100;
    d->h = calloc((size_t)(R * hs + 1), es);
    d->w = calloc((size_t)(V * D), es);
    d->b = c->bias ? calloc((size_t)V, es) : NULL;
    d->target = malloc(sizeof(int64_t) * (size_t)(2 * R + 1));
    d->hd = malloc(sizeof(double) * (size_t)(R * D + 1));
    d->wd = malloc(sizeof(double) * (size_t)(V * D));
    d->bd = c->bias ? malloc(sizeof(double) * (size_t)V) : NULL;
    d->dh_ref = malloc(sizeof(double) * (size_t)(R * D + 1));
    d->dw_ref = malloc(sizeof(double) * (size_t)(V * D));
    d->db_ref = malloc(sizeof(double) * (size_t)V);
    /* logits of order 1..3: hidden in [-1.5, 1.5], weight scaled by 1/sqrt(dim) */
    const double ws = 2.0 / sqrt((double)D);
    for (int64_t r = 0; r < R; r++)
        for (int64_t k = 0; k < D; k++) d->hd[r * D + k] = draw(c->dt, d->h, r * hs + k, 3.0 * rng_uniform(rng) - 1.5);
    for (int64_t i = 0; i < V * D; i++) d->wd[i] = draw(c->dt, d->w, i, ws * (2.0 * rng_uniform(rng) - 1.0));
    for (int64_t v = 0; v < V && c->bias; v++) d->bd[v] = draw(c->dt, d->b, v, rng_uniform(rng) - 0.5);
    int64_t *tref = malloc(sizeof(int64_t) * (size_t)(R + 1));
    for (int64_t r = 0; r < R; r++) {
        int64_t t = (int64_t)(rng_uniform(rng) * (double)V);
        if (t >= V) t = V - 1;
        if (c->ignore_every == -1 || (c->ignore_every > 0 && r % c->ignore_every == 1)) t = d->ignore;
        d->target[2 * r] = t, d->target[2 * r + 1] = 0x7777777777LL;
        tref[r] = t;
    }
    opsmith_fused_linear_cross_entropy_fwd_reference(R, D, V, d->hd, d->wd, d->bd, tref, d->ignore, c->ls, c->z,
                                                     c->cap, c->red, &d->loss_ref, &d->z_ref, d->dh_ref, d->dw_ref,
                                                     d->db_ref);
    free(tref);
}

static void data_free(fl_data *d)
{
    free(d->h), free(d->w), free(d->b), free(d->target), free(d->hd), free(d->wd), free(d->bd);
    free(d->dh_ref), free(d->dw_ref), free(d->db_ref);
}

/* outputs: loss and z in the accumulate type; gradients in guarded buffers (NULL base: not asked) */
typedef struct {
    double loss[1], z[1];
    guarded_buf dh, dw, db;
    int64_t error[OPSMITH_CROSS_ENTROPY_ERROR_COUNT];
} fl_out;

typedef opsmith_status (*fwd_fn)(const fl_case *c, const fl_data *d, fl_out *o);

/* the gradients' dtype: float32 for a 16-bit case under OPSMITH_FLCE_GRADS_FLOAT32 */
static opsmith_dtype grad_dt(const fl_case *c)
{
    return c->fp32_dw == OPSMITH_FLCE_GRADS_FLOAT32 && opsmith_dtype_size(c->dt) == 2 ? OPSMITH_DTYPE_F32 : c->dt;
}

static void *payload_or_null(const guarded_buf *b) { return b->base ? guarded_payload(b) : NULL; }

static opsmith_status fwd_cpu(const fl_case *c, const fl_data *d, fl_out *o)
{
    const size_t wb = opsmith_fused_linear_cross_entropy_workspace_size(c->dt, c->rows, c->dim, c->vocab, c->chunk,
                                                                        c->fp32_dw, 0);
    /* the workspace alignment opsmith.h asks for */
    void *ws = aligned_alloc(OPSMITH_WORKSPACE_ALIGNMENT, (wb + OPSMITH_WORKSPACE_ALIGNMENT) / OPSMITH_WORKSPACE_ALIGNMENT *
                                                              OPSMITH_WORKSPACE_ALIGNMENT);
    memset(ws, POISON_BYTE, wb);
    opsmith_status st = opsmith_fused_linear_cross_entropy_fwd_cpu(
        c->dt, c->rows, c->dim, c->vocab, d->h, c->dim + c->pad, d->w, d->b, d->target, 2, d->ignore, c->ls, c->z,
        c->cap, c->red, c->chunk, c->fp32_dw, o->loss, o->z, payload_or_null(&o->dh), payload_or_null(&o->dw),
        payload_or_null(&o->db), o->error, ws, wb);
    free(ws);
    return st;
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
    else cudaMemset(p, POISON_BYTE, bytes);
    return p;
}

static void dev_back(void *host, void *dev, size_t bytes)
{
    if (host && dev) cuda_ok(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost), "download");
    cudaFree(dev);
}

/* a guarded buffer on the device, guards included; its payload pointer */
static unsigned char *dev_guarded(const guarded_buf *b)
{
    return b->base ? dev_copy(b->base, b->bytes + 2 * GUARD) : NULL;
}

static opsmith_status fwd_cuda(const fl_case *c, const fl_data *d, fl_out *o)
{
    const size_t es = opsmith_dtype_size(c->dt), as = opsmith_dtype_size(opsmith_dtype_accumulate(c->dt));
    const size_t wb = opsmith_fused_linear_cross_entropy_workspace_size(c->dt, c->rows, c->dim, c->vocab, c->chunk,
                                                                        c->fp32_dw, 1);
    void *h = dev_copy(d->h, es * (size_t)(c->rows * (c->dim + c->pad) + 1));
    void *w = dev_copy(d->w, es * (size_t)(c->vocab * c->dim));
    void *b = d->b ? dev_copy(d->b, es * (size_t)c->vocab) : NULL;
    int64_t *t = dev_copy(d->target, sizeof(int64_t) * (size_t)(2 * c->rows + 1));
    void *loss = dev_copy(o->loss, as), *z = dev_copy(o->z, as), *ws = dev_copy(NULL, wb);
    int64_t *err = dev_copy(o->error, sizeof o->error);
    unsigned char *dh = dev_guarded(&o->dh), *dw = dev_guarded(&o->dw), *db = dev_guarded(&o->db);
    opsmith_status st = opsmith_fused_linear_cross_entropy_fwd_cuda(
        c->dt, c->rows, c->dim, c->vocab, h, c->dim + c->pad, w, b, t, 2, d->ignore, c->ls, c->z, c->cap, c->red,
        c->chunk, c->fp32_dw, loss, z, dh ? dh + GUARD : NULL, dw ? dw + GUARD : NULL, db ? db + GUARD : NULL, err, ws,
        wb, NULL);
    cuda_ok(cudaDeviceSynchronize(), "fwd");
    dev_back(o->loss, loss, as), dev_back(o->z, z, as), dev_back(o->error, err, sizeof o->error);
    dev_back(o->dh.base, dh, o->dh.bytes + 2 * GUARD), dev_back(o->dw.base, dw, o->dw.bytes + 2 * GUARD);
    dev_back(o->db.base, db, o->db.bytes + 2 * GUARD);
    cudaFree(h), cudaFree(w), cudaFree(b), cudaFree(t), cudaFree(ws);
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
    static float h[8], w[8], loss[2];
    static int64_t t[2], err[3];
    opsmith_status st = opsmith_fused_linear_cross_entropy_fwd_cuda(
        OPSMITH_DTYPE_F32, 2, 4, 2, h, 4, w, NULL, t, 1, -100, 0, 0, 0, OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN, 0, 0,
        loss, NULL, NULL, NULL, NULL, err, NULL, 0, NULL);
    CHECK(opsmith_has_cuda() || (st == OPSMITH_STATUS_CUDA_UNAVAILABLE && strstr(opsmith_last_error(), "without CUDA")),
          "CUDA-less fused_linear_cross_entropy_fwd_cuda returned \"%s\" (%s)", opsmith_status_string(st),
          opsmith_last_error());
    return -1;
}
#define fwd_cuda NULL
#endif

/* count values of grad_dt(c) in a guarded buffer against ref, relative to max |ref| */
static void check_grad(const fl_case *c, const char *what, const guarded_buf *g, const double *ref, int64_t count)
{
    double err = 0.0, scale = 0.0;
    int nan_ok = 1;
    for (int64_t i = 0; i < count; i++) {
        const double got = opsmith_load_as_double(grad_dt(c), guarded_payload(g), i);
        if (isnan(got) != isnan(ref[i])) nan_ok = 0;
        else if (!isnan(got)) err = fmax(err, fabs(got - ref[i]));
        scale = fmax(scale, fabs(ref[i]));
    }
    CHECK(nan_ok, "%s: " CASE_FMT ": NaN differs from the reference (an element not written?)", what, CASE_ARGS(c));
    CHECK(err <= tol_of(c->dt) * fmax(scale, 1e-30), "%s: " CASE_FMT ": max err %.3e > %.3e (max |ref| %.3e)", what,
          CASE_ARGS(c), err, tol_of(c->dt) * scale, scale);
    CHECK(guarded_ok(g), "%s: " CASE_FMT ": wrote outside the tensor", what, CASE_ARGS(c));
}

static void check_scalar(const fl_case *c, const char *what, const double *got, double ref)
{
    const double g = opsmith_load_as_double(opsmith_dtype_accumulate(c->dt), got, 0);
    CHECK(isnan(g) == isnan(ref), "%s: " CASE_FMT ": got %g, reference %g", what, CASE_ARGS(c), g, ref);
    if (!isnan(ref))
        CHECK(fabs(g - ref) <= tol_of(c->dt) * fmax(1.0, fabs(ref)), "%s: " CASE_FMT ": got %.9g, reference %.9g",
              what, CASE_ARGS(c), g, ref);
}

/* mode 0: every gradient; 1: the loss alone; 2: dweight alone */
static void run(const char *be, fwd_fn fwd, const fl_case *c, const fl_data *d, int mode)
{
    char what[96];
    const size_t es = opsmith_dtype_size(grad_dt(c));
    const int64_t R = c->rows, D = c->dim, V = c->vocab;
    fl_out o;
    memset(&o, 0, sizeof o);
    memset(o.loss, POISON_BYTE, sizeof o.loss), memset(o.z, POISON_BYTE, sizeof o.z);
    if (mode == 0) o.dh = guarded_new(es * (size_t)(R * D), POISON_BYTE);
    if (mode != 1) o.dw = guarded_new(es * (size_t)(V * D), POISON_BYTE);
    if (mode == 0 && c->bias) o.db = guarded_new(es * (size_t)V, POISON_BYTE);
    opsmith_status st = fwd(c, d, &o);
    snprintf(what, sizeof what, "%s fwd mode %d", be, mode);
    if (CHECK(st == OPSMITH_STATUS_SUCCESS, "%s: " CASE_FMT ": %s (%s)", what, CASE_ARGS(c), opsmith_status_string(st),
              opsmith_last_error())) {
        check_scalar(c, "loss", o.loss, d->loss_ref);
        check_scalar(c, "z_loss", o.z, d->z_ref);
        if (o.dh.base) check_grad(c, "dhidden", &o.dh, d->dh_ref, R * D);
        if (o.dw.base) check_grad(c, "dweight", &o.dw, d->dw_ref, V * D);
        if (o.db.base) check_grad(c, "dbias", &o.db, d->db_ref, V);
        CHECK(o.error[0] == 0, "%s: " CASE_FMT ": error flag set", what, CASE_ARGS(c));
    }
    free(o.dh.base), free(o.dw.base), free(o.db.base);
}

/* A target out of range: the CPU fails naming it before writing; CUDA
 * flags it on the device and the loss is NaN. */
static void test_bad_target(const char *be, fwd_fn fwd, int cuda)
{
    fl_case c = {OPSMITH_DTYPE_F32, 6, 8, 10, 0, 4, 0, 0, 0.0, 0.0, 0.0, OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN, 0};
    test_rng rng = {0xBAD7A6E7ull};
    fl_data d;
    data_init(&d, &c, &rng);
    d.target[2 * 4] = 10; /* row 4 */
    fl_out o;
    memset(&o, 0, sizeof o);
    o.dh = guarded_new(4 * 6 * 8, POISON_BYTE);
    const opsmith_status st = fwd(&c, &d, &o);
    if (cuda) {
        CHECK(st == OPSMITH_STATUS_SUCCESS, "%s bad target: %s", be, opsmith_status_string(st));
        CHECK(o.error[0] == 1 && o.error[1] == 4 && o.error[2] == 10, "%s bad target: flag %lld row %lld value %lld", be,
              (long long)o.error[0], (long long)o.error[1], (long long)o.error[2]);
        CHECK(isnan(opsmith_load_as_double(OPSMITH_DTYPE_F32, o.loss, 0)), "%s bad target: loss not NaN", be);
    } else {
        CHECK(st == OPSMITH_STATUS_INVALID_ARGUMENT && strstr(opsmith_last_error(), "target 10 (row 4) is out of range"),
              "%s bad target: %s (%s)", be, opsmith_status_string(st), opsmith_last_error());
        unsigned char *p = guarded_payload(&o.dh);
        int untouched = 1;
        for (size_t i = 0; i < o.dh.bytes; i++) untouched &= p[i] == POISON_BYTE;
        CHECK(untouched, "%s bad target: dhidden written before the target check", be);
    }
    free(o.dh.base);
    data_free(&d);
}

static void expect(opsmith_status got, opsmith_status want, const char *needle, const char *what)
{
    CHECK(got == want && strstr(opsmith_last_error(), needle), "bad args (%s): got \"%s\" (%s), want \"%s\" with \"%s\"",
          what, opsmith_status_string(got), opsmith_last_error(), opsmith_status_string(want), needle);
}

static void test_bad_args(void)
{
    static float h[64], w[64], dh[64], loss[2];
    static int64_t t[4] = {0, 1, 2, 3};
    static _Alignas(64) unsigned char ws[1 << 16];
    const opsmith_dtype F32 = OPSMITH_DTYPE_F32;
    const opsmith_cross_entropy_reduction MEAN = OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN;
    const opsmith_status INVALID = OPSMITH_STATUS_INVALID_ARGUMENT;
#define FWD(rows, dim, vocab, hp, hs, wp, red, dhp, wsp, wsb)                                                          \
    opsmith_fused_linear_cross_entropy_fwd_cpu(F32, rows, dim, vocab, hp, hs, wp, NULL, t, 1, -100, 0.0, 0.0, 0.0, red, \
                                               0, 0, loss, NULL, dhp, NULL, NULL, NULL, wsp, wsb)
    const size_t wb = opsmith_fused_linear_cross_entropy_workspace_size(F32, 4, 4, 4, 0, 0, 0);
    CHECK(wb > 0 && wb <= sizeof ws, "workspace size %zu", wb);
    expect(FWD(4, 4, 4, h, 4, w, MEAN, dh, ws, wb), OPSMITH_STATUS_SUCCESS, "", "valid");
    expect(FWD(4, 4, 4, h, 4, w, OPSMITH_CROSS_ENTROPY_REDUCTION_NONE, dh, ws, wb), INVALID, "reduction (0)", "none");
    expect(FWD(4, 0, 4, h, 4, w, MEAN, dh, ws, wb), INVALID, "dim (0)", "dim 0");
    expect(FWD(4, 4, 0, h, 4, w, MEAN, dh, ws, wb), INVALID, "vocab (0)", "vocab 0");
    expect(FWD(4, 4, 4, h, 3, w, MEAN, dh, ws, wb), INVALID, "hidden_row_stride (3)", "row stride");
    expect(FWD(4, 4, 4, h, 4, NULL, MEAN, dh, ws, wb), INVALID, "weight is NULL", "weight NULL");
    expect(FWD(4, 4, 4, NULL, 4, w, MEAN, dh, ws, wb), INVALID, "hidden is NULL", "hidden NULL");
    expect(FWD(4, 4, 4, h, 4, w, MEAN, dh, ws, 8), OPSMITH_STATUS_WORKSPACE_TOO_SMALL, "workspace_bytes (8)", "small ws");
    expect(FWD(4, 4, 4, (char *)h + 1, 4, w, MEAN, dh, ws, wb), OPSMITH_STATUS_MISALIGNED, "hidden (", "misaligned");
    expect(opsmith_fused_linear_cross_entropy_fwd_cpu(F32, 4, 4, 4, h, 4, w, NULL, t, 1, -100, 1.5, 0.0, 0.0, MEAN, 0, 0,
                                                      loss, NULL, dh, NULL, NULL, NULL, ws, wb),
           INVALID, "label_smoothing (1.5)", "smoothing");
    expect(opsmith_fused_linear_cross_entropy_fwd_cpu(OPSMITH_DTYPE_I32, 4, 4, 4, h, 4, w, NULL, t, 1, -100, 0, 0, 0,
                                                      MEAN, 0, 0, loss, NULL, dh, NULL, NULL, NULL, ws, wb),
           OPSMITH_STATUS_UNSUPPORTED_DTYPE, "i32", "integer dtype");
    expect(opsmith_fused_linear_cross_entropy_fwd_cpu(F32, 4, 4, 4, h, 4, w, NULL, t, 1, -100, 0, 0, 0, MEAN, 0, 0, loss,
                                                      (char *)loss + 1, dh, NULL, NULL, NULL, ws, wb),
           OPSMITH_STATUS_MISALIGNED, "z_out (", "misaligned z_out");
    expect(opsmith_fused_linear_cross_entropy_fwd_cpu(F32, 4, 4, 4, h, 4, w, NULL, t, 1, -100, 0, 0, 1e39, MEAN, 0, 0,
                                                      loss, NULL, dh, NULL, NULL, NULL, ws, wb),
           INVALID, "softcap (1e+39) must be 0 or within", "softcap past FLT_MAX");
    expect(opsmith_fused_linear_cross_entropy_fwd_cpu(F32, 4, 4, 4, h, 4, w, NULL, t, 1, -100, 0, 0, 0, MEAN, 0, 3, loss,
                                                      NULL, dh, NULL, NULL, NULL, ws, wb),
           INVALID, "fp32_dweight (3) must be 0, 1 or 2", "fp32_dweight 3");
    /* float32 gradients of float16 inputs must be 4-byte aligned */
    static _Alignas(8) uint16_t h16[32], w16[32];
    const size_t wb16 = opsmith_fused_linear_cross_entropy_workspace_size(OPSMITH_DTYPE_F16, 4, 4, 4, 0, 2, 0);
    CHECK(wb16 > 0 && wb16 <= sizeof ws, "float16 workspace size %zu", wb16);
    expect(opsmith_fused_linear_cross_entropy_fwd_cpu(OPSMITH_DTYPE_F16, 4, 4, 4, h16, 4, w16, NULL, t, 1, -100, 0, 0, 0,
                                                      MEAN, 0, 2, loss, NULL, (char *)dh + 2, NULL, NULL, NULL, ws, wb16),
           OPSMITH_STATUS_MISALIGNED, "dhidden (", "float32 dhidden on 2 bytes");
#undef FWD
    /* the default chunk: from the budget, a multiple of 128, within [1, rows] */
    CHECK(opsmith_fused_linear_cross_entropy_chunk_rows(OPSMITH_DTYPE_BF16, 8192, 128256, 0) == 2048,
          "default chunk at V=128256 bf16: %lld",
          (long long)opsmith_fused_linear_cross_entropy_chunk_rows(OPSMITH_DTYPE_BF16, 8192, 128256, 0));
    CHECK(opsmith_fused_linear_cross_entropy_chunk_rows(OPSMITH_DTYPE_BF16, 100, 1000, 0) == 100, "chunk <= rows");
    CHECK(opsmith_fused_linear_cross_entropy_chunk_rows(OPSMITH_DTYPE_F32, 10, 1 << 30, 1) == 1, "chunk >= 1");
}

HARNESS_GROUP(test_fused_linear_cross_entropy)
{
    const int cuda = cuda_begin();
    const opsmith_cross_entropy_reduction SUM = OPSMITH_CROSS_ENTROPY_REDUCTION_SUM,
                                          MEAN = OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN;
    /* {dt, rows, dim, vocab, pad, chunk, bias, ignore_every, ls, z, cap, red, fp32_dw}; small (the CPU
     * reference is rows * dim * vocab); odd sizes, chunks that do not divide the rows, every option */
    const fl_case shapes[] = {
        {0, 1, 1, 1, 0, 0, 0, 0, 0.0, 0.0, 0.0, MEAN, 0},
        {0, 7, 5, 11, 3, 3, 1, 3, 0.1, 1e-3, 5.0, MEAN, 0},
        {0, 13, 16, 37, 0, 0, 0, 2, 0.0, 0.0, 0.0, SUM, 0},
        {0, 33, 24, 130, 1, 8, 1, 4, 0.2, 1e-4, 30.0, MEAN, 1},
        {0, 9, 64, 257, 0, 4, 0, 0, 0.0, 1e-2, 0.0, MEAN, 0},
        {0, 20, 40, 100, 8, 7, 1, 0, 0.05, 0.0, 2.0, SUM, 1},
        {0, 6, 8, 16, 0, 2, 1, -1, 0.1, 1e-4, 0.0, MEAN, 0}, /* every target ignored: NaN, gradients 0 */
        {0, 6, 8, 16, 0, 4, 0, -1, 0.0, 0.0, 0.0, SUM, 0},
        {0, 0, 8, 16, 0, 0, 1, 0, 0.0, 0.0, 0.0, MEAN, 0},    /* no rows: NaN / 0, gradients 0 */
        {0, 0, 8, 16, 0, 0, 0, 0, 0.0, 0.0, 0.0, SUM, 1},
        /* the gradients in float32 (16-bit dtypes) */
        {0, 33, 24, 130, 1, 8, 1, 4, 0.2, 1e-4, 30.0, MEAN, 2},
        {0, 20, 40, 100, 8, 7, 1, 0, 0.05, 0.0, 2.0, SUM, 2},
        {0, 6, 8, 16, 0, 2, 1, -1, 0.1, 1e-4, 0.0, MEAN, 2},
        {0, 0, 8, 16, 0, 0, 1, 0, 0.0, 0.0, 0.0, MEAN, 2},
    };
    /* CUDA alone: the shapes cuBLASLt tiles, odd ones, many chunks, both dweight accumulators */
    const fl_case gpu_shapes[] = {
        {0, 300, 96, 1000, 0, 128, 1, 5, 0.1, 1e-4, 0.0, MEAN, 0},
        {0, 300, 96, 1000, 0, 128, 1, 5, 0.1, 1e-4, 0.0, MEAN, 1},
        {0, 64, 128, 4099, 4, 17, 0, 3, 0.0, 0.0, 30.0, SUM, 0},
        {0, 257, 200, 3001, 0, 0, 1, 0, 0.0, 1e-4, 0.0, MEAN, 0},
        {0, 512, 256, 2048, 0, 100, 0, 7, 0.0, 0.0, 0.0, MEAN, 0},
        {0, 300, 96, 1000, 0, 128, 1, 5, 0.1, 1e-4, 0.0, MEAN, 2},
        {0, 257, 200, 3001, 0, 0, 1, 0, 0.0, 1e-4, 0.0, SUM, 2},
    };
    for (int di = 0; di < OPSMITH_DTYPE_COUNT; di++) {
        const opsmith_dtype dt = (opsmith_dtype)di;
        if (!opsmith_dtype_is_float(dt)) continue;
        test_rng rng = {0xF1CEull * (uint64_t)(di + 1)};
        for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
            fl_case c = shapes[k];
            c.dt = dt;
            fl_data d;
            data_init(&d, &c, &rng);
            for (int mode = 0; mode < 3; mode++) {
                run("cpu", fwd_cpu, &c, &d, mode);
                if (cuda > 0) run("cuda", fwd_cuda, &c, &d, mode);
                else if (cuda == 0) harness_skip(1);
            }
            data_free(&d);
        }
        for (size_t k = 0; k < sizeof gpu_shapes / sizeof gpu_shapes[0]; k++) {
            fl_case c = gpu_shapes[k];
            c.dt = dt;
            if (cuda <= 0) {
                if (cuda == 0) harness_skip(1);
                continue;
            }
            fl_data d;
            data_init(&d, &c, &rng);
            run("cuda", fwd_cuda, &c, &d, 0);
            data_free(&d);
        }
    }
    test_bad_target("cpu", fwd_cpu, 0);
    if (cuda > 0) test_bad_target("cuda", fwd_cuda, 1);
    test_bad_args();
}
