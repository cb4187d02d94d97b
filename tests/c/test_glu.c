/* Gated-activation launchers (CPU, and CUDA when built with
 * OPSMITH_WITH_CUDA=1) against the float64 scalar reference.
 *
 * Inputs are drawn in double and rounded into the storage dtype; the
 * reference sees the rounded values. Outputs start as 0xFF bytes (NaN in
 * every float type) so an unwritten element fails; padding between rows
 * must keep its poison and the guard bytes around every buffer must stay,
 * so a stray write fails too. Each case runs with separate tensors and in
 * the packed form (gate and up, dgate and dup as two halves of one
 * (rows, 2n) buffer), with row padding and one-element misalignment so the
 * scalar paths run beside the vector ones. */
#include <math.h>

#include "rms_norm_cases.h" /* image, GUARD, POISON_BYTE, TEST_CUDA */

#if TEST_CUDA
#include <cuda_runtime_api.h>
#endif

typedef struct glu_case {
    opsmith_dtype dt;
    opsmith_glu_activation act;
    int64_t rows, n;
    int64_t pad;  /* extra elements at the end of every row (NaN in inputs, untouched in outputs) */
    int off;      /* every tensor starts one element past an aligned address */
    int packed;   /* gate/up and dgate/dup are halves of one buffer */
    int with_h;   /* the backward also writes h */
} glu_case;

/* Host images and where each tensor sits in them (element offsets). */
typedef struct glu_bufs {
    image in, dy, y, grad, dup_sep, h; /* in: gate (+ up when packed); grad: dgate (+ dup when packed) */
    image up_sep;                      /* up when not packed */
    int64_t in_stride, dy_stride, out_stride, grad_stride;
    int64_t gate_at, up_at, dgate_at, dup_at;
    double *g, *u, *d;                 /* widened inputs, contiguous */
} glu_bufs;

static double tol_of(opsmith_dtype dt) {
    switch (dt) {
    case OPSMITH_DTYPE_F64: return 1e-12;
    case OPSMITH_DTYPE_F32: return 1e-5;
    case OPSMITH_DTYPE_F16: return 2e-3;
    default: return 1.6e-2;
    }
}

static image new_image(const glu_case *c, int64_t stride) {
    const size_t es = opsmith_dtype_size(c->dt);
    return image_new(GUARD + (size_t)c->off * es, (size_t)(c->rows * stride) * es);
}

static void fill(const glu_case *c, image *im, int64_t at, int64_t stride, double *wide, test_rng *rng, double scale) {
    for (int64_t r = 0; r < c->rows; r++)
        for (int64_t i = 0; i < c->n; i++) {
            opsmith_store_from_double(c->dt, img(im), at + r * stride + i, scale * rng_value(rng));
            wide[r * c->n + i] = opsmith_load_as_double(c->dt, img(im), at + r * stride + i);
        }
}

static void bufs_init(glu_bufs *b, const glu_case *c, test_rng *rng) {
    memset(b, 0, sizeof *b);
    const int64_t n = c->n, count = c->rows * n;
    b->in_stride = c->packed ? 2 * n + c->pad : n + c->pad;
    b->grad_stride = b->in_stride;
    b->dy_stride = b->out_stride = n + c->pad;
    b->gate_at = 0, b->up_at = c->packed ? n : 0;
    b->dgate_at = 0, b->dup_at = c->packed ? n : 0;
    b->g = xmalloc((size_t)count * sizeof(double));
    b->u = xmalloc((size_t)count * sizeof(double));
    b->d = xmalloc((size_t)count * sizeof(double));
    b->in = new_image(c, b->in_stride);
    b->up_sep = c->packed ? (image){0} : new_image(c, b->in_stride);
    b->dy = new_image(c, b->dy_stride);
    /* gate over [-8, 8]: both tails of every activation */
    fill(c, &b->in, b->gate_at, b->in_stride, b->g, rng, 4.0);
    fill(c, c->packed ? &b->in : &b->up_sep, b->up_at, b->in_stride, b->u, rng, 1.0);
    fill(c, &b->dy, 0, b->dy_stride, b->d, rng, 1.0);
}

static void outputs_new(glu_bufs *b, const glu_case *c) {
    b->y = new_image(c, b->out_stride);
    b->grad = new_image(c, b->grad_stride);
    b->dup_sep = c->packed ? (image){0} : new_image(c, b->grad_stride);
    b->h = c->with_h ? new_image(c, b->out_stride) : (image){0};
}

static void outputs_free(glu_bufs *b) {
    image_free(&b->y), image_free(&b->grad), image_free(&b->dup_sep), image_free(&b->h);
}

static void bufs_free(glu_bufs *b) {
    outputs_free(b);
    image_free(&b->in), image_free(&b->up_sep), image_free(&b->dy);
    free(b->g), free(b->u), free(b->d);
}

static int guards_ok(const image *im) {
    for (size_t i = 0; i < im->total; i++)
        if ((i < im->lead || i >= im->lead + im->bytes) && im->base[i] != GUARD_BYTE) return 0;
    return 1;
}

/* An output (rows, n) at `at` with `stride` against ref; elements of the
 * image that belong to no written tensor (row padding) must keep their
 * poison. `other_at` >= 0 marks the second half of a packed image as
 * written too (checked separately). */
static void check_out(const glu_case *c, const char *be, const char *what, const image *im, int64_t at,
                      int64_t stride, int64_t other_at, const double *ref) {
    const size_t es = opsmith_dtype_size(c->dt);
    double err = 0.0, scale = 1.0;
    int64_t bad_at = -1;
    for (int64_t i = 0; i < c->rows * c->n; i++) scale = fmax(scale, fabs(ref[i]));
    for (int64_t r = 0; r < c->rows; r++)
        for (int64_t i = 0; i < c->n; i++) {
            const double v = opsmith_load_as_double(c->dt, img(im), at + r * stride + i);
            const double e = fabs(v - ref[r * c->n + i]);
            if (!(e <= err)) err = e, bad_at = r * c->n + i; /* NaN counts as the worst */
        }
    int poison_ok = 1;
    for (int64_t r = 0; r < c->rows && poison_ok; r++)
        for (int64_t i = 0; i < stride; i++) {
            const int mine = i >= at && i < at + c->n;
            const int other = other_at >= 0 && i >= other_at && i < other_at + c->n;
            if (mine || other) continue;
            for (size_t k = 0; k < es; k++)
                if (((unsigned char *)img(im))[(size_t)(r * stride + i) * es + k] != POISON_BYTE) poison_ok = 0;
        }
    CHECK(err <= tol_of(c->dt) * scale, "%s %s %s %s rows=%lld n=%lld pad=%lld off=%d packed=%d: max err %.3e > %.3e "
          "(element %lld)", be, what, opsmith_dtype_name(c->dt), opsmith_glu_activation_name(c->act),
          (long long)c->rows, (long long)c->n, (long long)c->pad, c->off, c->packed, err, tol_of(c->dt) * scale,
          (long long)bad_at);
    CHECK(poison_ok, "%s %s %s: row padding was written", be, what, opsmith_dtype_name(c->dt));
    CHECK(guards_ok(im), "%s %s %s: a guard byte was overwritten", be, what, opsmith_dtype_name(c->dt));
}

/* Pointers of one call into a set of images (host or device bases). */
typedef struct glu_ptrs {
    const void *gate, *up, *dy;
    void *y, *dgate, *dup, *h;
} glu_ptrs;

static char *at_el(void *base, const image *im, int64_t at, size_t es) {
    return base ? (char *)base + im->lead + (size_t)at * es : NULL;
}

static glu_ptrs ptrs_of(const glu_case *c, const glu_bufs *b, void *in, void *up_sep, void *dy, void *y, void *grad,
                        void *dup_sep, void *h) {
    const size_t es = opsmith_dtype_size(c->dt);
    glu_ptrs p;
    p.gate = at_el(in, &b->in, b->gate_at, es);
    p.up = c->packed ? at_el(in, &b->in, b->up_at, es) : at_el(up_sep, &b->up_sep, 0, es);
    p.dy = at_el(dy, &b->dy, 0, es);
    p.y = at_el(y, &b->y, 0, es);
    p.dgate = at_el(grad, &b->grad, b->dgate_at, es);
    p.dup = c->packed ? at_el(grad, &b->grad, b->dup_at, es) : at_el(dup_sep, &b->dup_sep, 0, es);
    p.h = c->with_h ? at_el(h, &b->h, 0, es) : NULL;
    return p;
}

static void check_all(const glu_case *c, const glu_bufs *b, const char *be) {
    const int64_t count = c->rows * c->n;
    double *y = xmalloc((size_t)count * 8), *dg = xmalloc((size_t)count * 8), *du = xmalloc((size_t)count * 8);
    double *h = xmalloc((size_t)count * 8);
    opsmith_glu_fwd_reference(c->act, c->rows, c->n, b->g, b->u, y);
    opsmith_glu_bwd_reference(c->act, c->rows, c->n, b->d, b->g, b->u, dg, du, h);
    check_out(c, be, "y", &b->y, 0, b->out_stride, -1, y);
    check_out(c, be, "dgate", &b->grad, b->dgate_at, b->grad_stride, c->packed ? b->dup_at : -1, dg);
    if (c->packed) check_out(c, be, "dup", &b->grad, b->dup_at, b->grad_stride, b->dgate_at, du);
    else check_out(c, be, "dup", &b->dup_sep, 0, b->grad_stride, -1, du);
    if (c->with_h) check_out(c, be, "h", &b->h, 0, b->out_stride, -1, h);
    free(y), free(dg), free(du), free(h);
}

static void run_cpu(const glu_case *c, glu_bufs *b) {
    outputs_new(b, c);
    glu_ptrs p = ptrs_of(c, b, b->in.base, b->up_sep.base, b->dy.base, b->y.base, b->grad.base, b->dup_sep.base,
                         b->h.base);
    opsmith_status s = opsmith_glu_fwd_cpu(c->act, c->dt, c->rows, c->n, p.gate, b->in_stride, p.up, b->in_stride,
                                           p.y, b->out_stride);
    CHECK(s == OPSMITH_STATUS_SUCCESS, "cpu fwd: %s (%s)", opsmith_status_string(s), opsmith_last_error());
    s = opsmith_glu_bwd_cpu(c->act, c->dt, c->rows, c->n, p.dy, b->dy_stride, p.gate, b->in_stride, p.up,
                            b->in_stride, p.dgate, b->grad_stride, p.dup, b->grad_stride, p.h, b->out_stride);
    CHECK(s == OPSMITH_STATUS_SUCCESS, "cpu bwd: %s (%s)", opsmith_status_string(s), opsmith_last_error());
    check_all(c, b, "cpu");
    outputs_free(b);
}

#if TEST_CUDA
/* A whole host image copied to the device (poison and guards too); NULL stays NULL. */
static void *upload(const image *im) {
    if (!im->base) return NULL;
    void *p = NULL;
    if (cudaMalloc(&p, im->total) != cudaSuccess) return NULL;
    cudaMemcpy(p, im->base, im->total, cudaMemcpyHostToDevice);
    return p;
}

static void download(image *im, void *p) {
    if (im->base && p) cudaMemcpy(im->base, p, im->total, cudaMemcpyDeviceToHost);
    cudaFree(p);
}

static void glu_run_cuda(const glu_case *c, glu_bufs *b) {
    outputs_new(b, c);
    void *in = upload(&b->in), *ups = upload(&b->up_sep), *dy = upload(&b->dy), *y = upload(&b->y);
    void *grad = upload(&b->grad), *dups = upload(&b->dup_sep), *h = upload(&b->h);
    glu_ptrs p = ptrs_of(c, b, in, ups, dy, y, grad, dups, h);
    opsmith_status s = opsmith_glu_fwd_cuda(c->act, c->dt, c->rows, c->n, p.gate, b->in_stride, p.up, b->in_stride,
                                            p.y, b->out_stride, NULL);
    CHECK(s == OPSMITH_STATUS_SUCCESS, "cuda fwd: %s (%s)", opsmith_status_string(s), opsmith_last_error());
    s = opsmith_glu_bwd_cuda(c->act, c->dt, c->rows, c->n, p.dy, b->dy_stride, p.gate, b->in_stride, p.up,
                             b->in_stride, p.dgate, b->grad_stride, p.dup, b->grad_stride, p.h, b->out_stride, NULL);
    CHECK(s == OPSMITH_STATUS_SUCCESS, "cuda bwd: %s (%s)", opsmith_status_string(s), opsmith_last_error());
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "cuda glu: kernel failed");
    cudaFree(in), cudaFree(ups), cudaFree(dy);
    download(&b->y, y), download(&b->grad, grad), download(&b->dup_sep, dups), download(&b->h, h);
    check_all(c, b, "cuda");
    outputs_free(b);
}

static int cuda_present(void) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        cudaGetLastError();
        return 0;
    }
    return 1;
}
#endif

/* In place: y = up, and in the backward dgate = gate, dup = up (packed
 * gradient written over the packed input). Same bits as apart. */
static void test_in_place(opsmith_dtype dt, opsmith_glu_activation act) {
    enum { ROWS = 3, N = 37 };
    const size_t es = opsmith_dtype_size(dt);
    test_rng rng = {17};
    unsigned char *a = xmalloc(ROWS * 2 * N * es), *b = xmalloc(ROWS * 2 * N * es), *dy = xmalloc(ROWS * N * es);
    unsigned char *y = xmalloc(ROWS * N * es), *dg = xmalloc(ROWS * 2 * N * es);
    for (int64_t i = 0; i < ROWS * 2 * N; i++) opsmith_store_from_double(dt, a, i, 3 * rng_value(&rng));
    for (int64_t i = 0; i < ROWS * N; i++) opsmith_store_from_double(dt, dy, i, rng_value(&rng));
    memcpy(b, a, ROWS * 2 * N * es);
    /* apart */
    opsmith_status s1 = opsmith_glu_fwd_cpu(act, dt, ROWS, N, a, 2 * N, a + N * es, 2 * N, y, N);
    opsmith_status s2 = opsmith_glu_bwd_cpu(act, dt, ROWS, N, dy, N, a, 2 * N, a + N * es, 2 * N, dg, 2 * N,
                                            dg + N * es, 2 * N, NULL, 0);
    /* y over up of a copy */
    unsigned char *c = xmalloc(ROWS * 2 * N * es);
    memcpy(c, a, ROWS * 2 * N * es);
    opsmith_status s3 = opsmith_glu_fwd_cpu(act, dt, ROWS, N, c, 2 * N, c + N * es, 2 * N, c + N * es, 2 * N);
    int same = 1;
    for (int64_t r = 0; r < ROWS; r++) same &= !memcmp(c + (r * 2 * N + N) * es, y + r * N * es, N * es);
    CHECK(s1 == 0 && s2 == 0 && s3 == 0 && same, "in place y = up (%s %s): status %d/%d/%d, same bits %d",
          opsmith_dtype_name(dt), opsmith_glu_activation_name(act), s1, s2, s3, same);
    /* packed gradient over the packed input itself */
    opsmith_status s4 = opsmith_glu_bwd_cpu(act, dt, ROWS, N, dy, N, b, 2 * N, b + N * es, 2 * N, b, 2 * N,
                                            b + N * es, 2 * N, NULL, 0);
    CHECK(s4 == 0 && !memcmp(b, dg, ROWS * 2 * N * es), "in place dgate = gate, dup = up (%s %s): status %d",
          opsmith_dtype_name(dt), opsmith_glu_activation_name(act), s4);
    free(a), free(b), free(c), free(dy), free(y), free(dg);
}

static void expect(opsmith_status got, opsmith_status want, const char *needle, const char *what) {
    const char *msg = opsmith_last_error();
    CHECK(got == want && strstr(msg, needle) != NULL, "%s: status %d (want %d), message \"%s\" (want \"%s\")", what,
          (int)got, (int)want, msg, needle);
}

static void glu_bad_args(void) {
    float g[64], u[64], y[64], d[64], dg[64], du[64], h[64];
    for (int i = 0; i < 64; i++) g[i] = u[i] = d[i] = 0.5f + i;
    const opsmith_status BAD = OPSMITH_STATUS_INVALID_ARGUMENT;
    const opsmith_dtype F = OPSMITH_DTYPE_F32;
    const opsmith_glu_activation S = OPSMITH_GLU_ACTIVATION_SILU;
    expect(opsmith_glu_fwd_cpu((opsmith_glu_activation)7, F, 2, 4, g, 4, u, 4, y, 4), BAD, "activation must be",
           "bad activation");
    expect(opsmith_glu_fwd_cpu(S, OPSMITH_DTYPE_I32, 2, 4, g, 4, u, 4, y, 4), OPSMITH_STATUS_UNSUPPORTED_DTYPE,
           "dtype must be", "integer dtype");
    expect(opsmith_glu_fwd_cpu(S, F, -1, 4, g, 4, u, 4, y, 4), BAD, "rows (-1) must be >= 0", "negative rows");
    expect(opsmith_glu_fwd_cpu(S, F, 2, 0, g, 4, u, 4, y, 4), BAD, "n (0) must be >= 1", "n = 0");
    expect(opsmith_glu_fwd_cpu(S, F, 2, 4, NULL, 4, u, 4, y, 4), BAD, "gate is NULL", "NULL gate");
    expect(opsmith_glu_fwd_cpu(S, F, 2, 4, g, 4, NULL, 4, y, 4), BAD, "up is NULL", "NULL up");
    expect(opsmith_glu_fwd_cpu(S, F, 2, 4, g, 4, u, 4, NULL, 4), BAD, "y is NULL", "NULL y");
    expect(opsmith_glu_fwd_cpu(S, F, 2, 4, g, 3, u, 4, y, 4), BAD, "gate_row_stride (3) must be >= n (4)",
           "short gate stride");
    expect(opsmith_glu_fwd_cpu(S, F, 2, 4, g, 4, u, 4, y, 2), BAD, "y_row_stride (2) must be >= n (4)",
           "short y stride");
    expect(opsmith_glu_fwd_cpu(S, F, 2, 4, (char *)g + 1, 4, u, 4, y, 4), OPSMITH_STATUS_MISALIGNED,
           "gate", "misaligned gate");
    expect(opsmith_glu_fwd_cpu(S, F, 2, 4, g, 4, u, 4, g + 2, 4), BAD, "y overlaps gate", "y overlapping gate");
    expect(opsmith_glu_bwd_cpu(S, F, 2, 4, NULL, 4, g, 4, u, 4, dg, 4, du, 4, NULL, 0), BAD, "dy is NULL", "NULL dy");
    expect(opsmith_glu_bwd_cpu(S, F, 2, 4, d, 4, g, 4, u, 4, dg, 4, NULL, 4, NULL, 0), BAD, "dup is NULL",
           "NULL dup");
    expect(opsmith_glu_bwd_cpu(S, F, 2, 4, d, 4, g, 4, u, 4, dg, 4, dg + 1, 4, NULL, 0), BAD,
           "dup overlaps dgate", "dup overlapping dgate");
    /* packed halves of one buffer whose rows are too short to hold both: they collide */
    expect(opsmith_glu_bwd_cpu(S, F, 2, 4, d, 4, g, 8, g + 4, 8, dg, 6, dg + 4, 6, NULL, 0), BAD,
           "dup overlaps dgate", "packed halves with a short row stride");
    expect(opsmith_glu_bwd_cpu(S, F, 2, 4, d, 4, g, 4, u, 4, dg, 4, du, 4, h, 1), BAD, "h_row_stride (1)",
           "short h stride");
    expect(opsmith_glu_bwd_cpu(S, F, 2, 4, d, 4, g, 4, u, 4, dg, 4, du, 4, u + 1, 4), BAD, "h overlaps up",
           "h overlapping up");
    /* a bad call writes nothing */
    for (int i = 0; i < 64; i++) y[i] = -1.0f;
    opsmith_glu_fwd_cpu(S, F, 2, 4, g, 3, u, 4, y, 4);
    int untouched = 1;
    for (int i = 0; i < 64; i++) untouched &= y[i] == -1.0f;
    CHECK(untouched, "a refused call wrote its output");
    /* rows == 0 is a no-op, even with NULL pointers; success clears the error */
    expect(opsmith_glu_fwd_cpu(S, F, 0, 4, NULL, 0, NULL, 0, NULL, 0), OPSMITH_STATUS_SUCCESS, "", "zero rows");
    CHECK(opsmith_last_error()[0] == 0, "success must empty opsmith_last_error()");
    CHECK(!strcmp(opsmith_glu_activation_name(OPSMITH_GLU_ACTIVATION_GELU_TANH), "gelu_tanh") &&
              !strcmp(opsmith_glu_activation_name((opsmith_glu_activation)9), "?"),
          "activation names");
#if TEST_CUDA
    expect(opsmith_glu_fwd_cuda(S, F, 2, 4, g, 3, u, 4, y, 4, NULL), BAD, "gate_row_stride (3)",
           "cuda: short gate stride");
#else
    expect(opsmith_glu_fwd_cuda(S, F, 2, 4, g, 4, u, 4, y, 4, NULL), OPSMITH_STATUS_CUDA_UNAVAILABLE,
           "built without CUDA", "cuda stand-in fwd");
    expect(opsmith_glu_bwd_cuda(S, F, 2, 4, d, 4, g, 4, u, 4, dg, 4, du, 4, NULL, 0, NULL),
           OPSMITH_STATUS_CUDA_UNAVAILABLE, "built without CUDA", "cuda stand-in bwd");
#endif
}

HARNESS_GROUP(test_glu) {
    static const opsmith_dtype dts[] = {OPSMITH_DTYPE_F64, OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F16, OPSMITH_DTYPE_BF16};
    /* (rows, n): odd and prime widths, widths of whole packs, one row, a
     * row wider than a CPU chunk */
    static const int64_t shapes[][2] = {{1, 1}, {3, 7}, {5, 64}, {4, 769}, {2, 5125}, {1, 14336}, {9, 8}, {33, 40}};
#if TEST_CUDA
    const int cuda = cuda_present();
    if (!cuda) printf("skipping CUDA glu cases: no device\n");
#endif
    test_rng rng = {2026};
    int cases = 0;
    for (int a = 0; a < OPSMITH_GLU_ACTIVATION_COUNT; a++)
        for (size_t di = 0; di < sizeof dts / sizeof dts[0]; di++)
            for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
                for (int layout = 0; layout < 4; layout++) {
                    glu_case c = {dts[di], (opsmith_glu_activation)a, shapes[si][0], shapes[si][1],
                                  /* pad */ (layout & 1) ? 3 : 0, /* off */ layout == 3,
                                  /* packed */ (layout & 2) != 0, /* with_h */ (int)((si + layout) & 1)};
                    glu_bufs b;
                    bufs_init(&b, &c, &rng);
                    run_cpu(&c, &b);
#if TEST_CUDA
                    if (cuda) glu_run_cuda(&c, &b);
                    else harness_skip(1);
#endif
                    bufs_free(&b);
                    cases++;
                }
    for (int a = 0; a < OPSMITH_GLU_ACTIVATION_COUNT; a++)
        for (size_t di = 0; di < sizeof dts / sizeof dts[0]; di++) test_in_place(dts[di], (opsmith_glu_activation)a);
    glu_bad_args();
    (void)cases;
}
