/* RMSNorm's options launchers (opsmith_rms_norm_ex_*): mixed dtypes, the
 * weight offset and the casting modes, CPU and (when built with CUDA and a
 * device is present) CUDA, against opsmith_rms_norm_ex_*_reference.
 * Outputs start as NaN (0xFF bytes) with strided rows whose gaps must stay
 * NaN, so unwritten or stray elements fail. */
#include <math.h>

#include "rms_norm_cases.h"



typedef struct buf {
    opsmith_dtype dt;
    int64_t count;
    image im;
    double *wide;
} buf;

static buf buf_new(opsmith_dtype dt, int64_t count)
{
    buf b = {dt, count, image_new(GUARD, (size_t)count * opsmith_dtype_size(dt)), xmalloc((size_t)count * 8)};
    return b;
}

static void buf_fill(buf *b, test_rng *rng)
{
    for (int64_t i = 0; i < b->count; i++) {
        opsmith_store_from_double(b->dt, img(&b->im), i, rng_value(rng));
        b->wide[i] = opsmith_load_as_double(b->dt, img(&b->im), i);
    }
}

static void buf_free(buf *b) { image_free(&b->im), free(b->wide); }


typedef struct launch {
    const combo *c;
    int64_t rows, n, xs, ys;
    double offset, eps;
    opsmith_rms_norm_casting casting;
    int weight;
} launch;


/* runs one forward + backward on the CPU (cuda = 0) or CUDA and checks both */
static void run_case(const launch *L, int cuda, test_rng *rng)
{
    const combo *c = L->c;
    const int64_t rows = L->rows, n = L->n;
    const opsmith_dtype acc = opsmith_dtype_accumulate(c->x);
    char name[200];
    snprintf(name, sizeof name, "%s x=%s w=%s y=%s rows=%lld n=%lld offset=%g casting=%s weight=%d",
             cuda ? "cuda" : "cpu", opsmith_dtype_name(c->x), opsmith_dtype_name(c->w), opsmith_dtype_name(c->y),
             (long long)rows, (long long)n, L->offset, opsmith_rms_norm_casting_name(L->casting), L->weight);
    buf x = buf_new(c->x, rows * L->xs), dy = buf_new(c->y, rows * L->xs), w = buf_new(c->w, n);
    buf_fill(&x, rng), buf_fill(&dy, rng), buf_fill(&w, rng);
    double *xd = xmalloc((size_t)(rows * n) * 8), *dyd = xmalloc((size_t)(rows * n) * 8);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++)
            xd[r * n + i] = x.wide[r * L->xs + i], dyd[r * n + i] = dy.wide[r * L->xs + i];
    const double *wd = L->weight ? w.wide : NULL;
    double *y_ref = xmalloc((size_t)(rows * n) * 8), *inv_ref = xmalloc((size_t)rows * 8);
    double *dx_ref = xmalloc((size_t)(rows * n) * 8), *dw_ref = xmalloc((size_t)n * 8);
    opsmith_rms_norm_ex_fwd_reference(rows, n, xd, wd, L->offset, L->eps, L->casting, c->x, y_ref, inv_ref);
    opsmith_rms_norm_ex_bwd_reference(rows, n, dyd, xd, wd, L->offset, L->casting, c->x, inv_ref, dx_ref,
                                      L->weight ? dw_ref : NULL);
    /* the backward gets inv_rms in the accumulate type: the reference's, rounded */
    image inv_in = image_new(GUARD, (size_t)rows * opsmith_dtype_size(acc));
    for (int64_t r = 0; r < rows; r++) opsmith_store_from_double(acc, img(&inv_in), r, inv_ref[r]);
    image y = image_new(GUARD, (size_t)(rows * L->ys) * opsmith_dtype_size(c->y));
    image inv = image_new(GUARD, (size_t)rows * opsmith_dtype_size(acc));
    image dx = image_new(GUARD, (size_t)(rows * L->ys) * opsmith_dtype_size(c->x));
    image dw = image_new(GUARD, (size_t)n * opsmith_dtype_size(c->w));
    const void *wp = L->weight ? img(&w.im) : NULL;
    void *dwp = L->weight ? img(&dw) : NULL;
    opsmith_status fs, bs;
    if (!cuda) {
        fs = opsmith_rms_norm_ex_fwd_cpu(c->x, c->w, c->y, rows, n, img(&x.im), L->xs, wp, L->offset, L->eps,
                                         L->casting, img(&y), L->ys, img(&inv));
        const size_t ws_bytes = opsmith_rms_norm_ex_bwd_cpu_workspace_size(
            c->x, c->w, c->y, rows, n, img(&dy.im), L->xs, img(&x.im), L->xs, wp, L->offset, L->casting,
            img(&inv_in), img(&dx), L->ys, dwp);
        void *ws = ws_bytes ? workspace_alloc(ws_bytes) : NULL;
        bs = opsmith_rms_norm_ex_bwd_cpu(c->x, c->w, c->y, rows, n, img(&dy.im), L->xs, img(&x.im), L->xs, wp,
                                         L->offset, L->casting, img(&inv_in), img(&dx), L->ys, dwp, ws, ws_bytes);
        free(ws);
    } else {
#if TEST_CUDA
        void *dxp_ = to_device(&x.im), *ddy = to_device(&dy.im), *dwt = L->weight ? to_device(&w.im) : NULL;
        void *dinv_in = to_device(&inv_in), *dy_out = to_device(&y), *dinv = to_device(&inv);
        void *ddx = to_device(&dx), *ddw = L->weight ? to_device(&dw) : NULL;
        fs = opsmith_rms_norm_ex_fwd_cuda(c->x, c->w, c->y, rows, n, dxp_, L->xs, dwt, L->offset, L->eps,
                                          L->casting, dy_out, L->ys, dinv, NULL);
        const size_t ws_bytes = opsmith_rms_norm_ex_bwd_cuda_workspace_size(
            c->x, c->w, c->y, rows, n, ddy, L->xs, dxp_, L->xs, dwt, L->offset, L->casting, dinv_in, ddx, L->ys, ddw);
        void *ws = NULL;
        if (ws_bytes) cudaMalloc(&ws, ws_bytes);
        bs = opsmith_rms_norm_ex_bwd_cuda(c->x, c->w, c->y, rows, n, ddy, L->xs, dxp_, L->xs, dwt, L->offset,
                                          L->casting, dinv_in, ddx, L->ys, ddw, ws, ws_bytes, NULL);
        CHECK(cudaDeviceSynchronize() == cudaSuccess, "%s: kernel failed", name);
        cudaFree(ws);
        from_device(&y, dy_out), from_device(&inv, dinv), from_device(&dx, ddx);
        if (ddw) from_device(&dw, ddw);
        cudaFree((unsigned char *)dxp_ - x.im.lead), cudaFree((unsigned char *)ddy - dy.im.lead);
        cudaFree((unsigned char *)dinv_in - inv_in.lead);
        if (dwt) cudaFree((unsigned char *)dwt - w.im.lead);
#else
        fs = bs = OPSMITH_STATUS_CUDA_UNAVAILABLE;
#endif
    }
    if (CHECK(fs == OPSMITH_STATUS_SUCCESS, "%s: fwd status %s: %s", name, opsmith_status_string(fs),
              opsmith_last_error())) {
        check_rows("y", name, c->y, &y, y_ref, rows, n, L->ys, options_tol2(c->x, c->y));
        check_rows("inv_rms", name, acc, &inv, inv_ref, 1, rows, rows, options_tol(acc));
    }
    if (fs == OPSMITH_STATUS_SUCCESS && L->casting == OPSMITH_RMS_NORM_CASTING_LLAMA && c->y == OPSMITH_DTYPE_F32 &&
        c->x != OPSMITH_DTYPE_F32 && L->weight) {
        /* LLAMA rounds x_hat to x's dtype before the weight multiply: then
         * y / (offset + w) lies on x's grid (to f32 precision); the
         * tolerances above are too wide to see that rounding */
        int off_grid = 0;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < n; i++) {
                const double v = opsmith_load_as_double(c->y, img(&y), r * L->ys + i) / (L->offset + w.wide[i]);
                unsigned char cell[8];
                opsmith_store_from_double(c->x, cell, 0, v);
                off_grid += fabs(opsmith_load_as_double(c->x, cell, 0) - v) > 1e-6 * fabs(v);
            }
        CHECK(off_grid == 0, "%s: %d elements of y / w are not x_hat rounded to %s", name, off_grid,
              opsmith_dtype_name(c->x));
    }
    if (CHECK(bs == OPSMITH_STATUS_SUCCESS, "%s: bwd status %s: %s", name, opsmith_status_string(bs),
              opsmith_last_error())) {
        check_rows("dx", name, c->x, &dx, dx_ref, rows, n, L->ys, options_tol2(c->x, c->y));
        if (L->weight) check_rows("dweight", name, c->w, &dw, dw_ref, 1, n, n, options_tol2(c->x, c->w));
        else CHECK(isnan(opsmith_load_as_double(c->w, img(&dw), 0)), "%s: dweight written without a weight", name);
    }
    buf_free(&x), buf_free(&dy), buf_free(&w);
    image_free(&inv_in), image_free(&y), image_free(&inv), image_free(&dx), image_free(&dw);
    free(xd), free(dyd), free(y_ref), free(inv_ref), free(dx_ref), free(dw_ref);
}

/* in place: y = x and dx = dy give the bits of the separate-buffer run */
static void check_in_place(opsmith_dtype dt, opsmith_rms_norm_casting casting, test_rng *rng)
{
    const int64_t rows = 5, n = 300;
    buf x = buf_new(dt, rows * n), dy = buf_new(dt, rows * n), w = buf_new(dt, n);
    buf_fill(&x, rng), buf_fill(&dy, rng), buf_fill(&w, rng);
    image y = image_new(GUARD, x.im.bytes), inv = image_new(GUARD, (size_t)rows * 8), dx = image_new(GUARD, x.im.bytes);
    image xy = image_new(GUARD, x.im.bytes), dyx = image_new(GUARD, x.im.bytes), inv2 = image_new(GUARD, (size_t)rows * 8);
    memcpy(img(&xy), img(&x.im), x.im.bytes), memcpy(img(&dyx), img(&dy.im), x.im.bytes);
    opsmith_status s1 = opsmith_rms_norm_ex_fwd_cpu(dt, dt, dt, rows, n, img(&x.im), n, img(&w.im), 1.0, 1e-6, casting,
                                                    img(&y), n, img(&inv));
    opsmith_status s2 = opsmith_rms_norm_ex_fwd_cpu(dt, dt, dt, rows, n, img(&xy), n, img(&w.im), 1.0, 1e-6, casting,
                                                    img(&xy), n, img(&inv2));
    CHECK(s1 == 0 && s2 == 0 && memcmp(img(&y), img(&xy), x.im.bytes) == 0,
          "%s %s: y = x in place differs from y apart", opsmith_dtype_name(dt), opsmith_rms_norm_casting_name(casting));
    s1 = opsmith_rms_norm_ex_bwd_cpu(dt, dt, dt, rows, n, img(&dy.im), n, img(&x.im), n, NULL, 0.0, casting, img(&inv),
                                     img(&dx), n, NULL, NULL, 0);
    s2 = opsmith_rms_norm_ex_bwd_cpu(dt, dt, dt, rows, n, img(&dyx), n, img(&x.im), n, NULL, 0.0, casting, img(&inv),
                                     img(&dyx), n, NULL, NULL, 0);
    CHECK(s1 == 0 && s2 == 0 && memcmp(img(&dx), img(&dyx), x.im.bytes) == 0,
          "%s %s: dx = dy in place differs from dx apart", opsmith_dtype_name(dt), opsmith_rms_norm_casting_name(casting));
    buf_free(&x), buf_free(&dy), buf_free(&w);
    image_free(&y), image_free(&inv), image_free(&dx), image_free(&xy), image_free(&dyx), image_free(&inv2);
}

static void expect_error(opsmith_status got, opsmith_status want, const char *needle, const char *what)
{
    CHECK(got == want && strstr(opsmith_last_error(), needle) != NULL, "%s: status %s, message \"%s\" (want %s, \"%s\")",
          what, opsmith_status_string(got), opsmith_last_error(), opsmith_status_string(want), needle);
}

static void check_bad_options(void)
{
    float x[8] = {1, 2, 3, 4, 5, 6, 7, 8}, y[8], inv[2];
    uint16_t w16[4] = {0x3f80, 0x3f80, 0x3f80, 0x3f80};
    float w32[4] = {1, 1, 1, 1};
    expect_error(opsmith_rms_norm_ex_fwd_cpu(OPSMITH_DTYPE_F32, OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_F32, 2, 4, x, 4, w16,
                                             0, 1e-6, OPSMITH_RMS_NORM_CASTING_NONE, y, 4, inv),
                 OPSMITH_STATUS_UNSUPPORTED_DTYPE, "not a supported combination", "f32 x with a bf16 weight");
    expect_error(opsmith_rms_norm_ex_fwd_cpu(OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F16, 2, 4, x, 4, w32,
                                             0, 1e-6, OPSMITH_RMS_NORM_CASTING_NONE, y, 4, inv),
                 OPSMITH_STATUS_UNSUPPORTED_DTYPE, "y_dtype f16", "f32 x and weight, f16 y");
    expect_error(opsmith_rms_norm_ex_fwd_cpu(OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32, 2, 4, x, 4, NULL,
                                             1.0, 1e-6, OPSMITH_RMS_NORM_CASTING_NONE, y, 4, inv),
                 OPSMITH_STATUS_INVALID_ARGUMENT, "offset (1) needs a weight", "offset without a weight");
    expect_error(opsmith_rms_norm_ex_fwd_cpu(OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32, 2, 4, x, 4, w32,
                                             NAN, 1e-6, OPSMITH_RMS_NORM_CASTING_NONE, y, 4, inv),
                 OPSMITH_STATUS_INVALID_ARGUMENT, "offset (nan) must be finite", "NaN offset");
    expect_error(opsmith_rms_norm_ex_fwd_cpu(OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32, 2, 4, x, 4, w32,
                                             0, 1e-6, (opsmith_rms_norm_casting)7, y, 4, inv),
                 OPSMITH_STATUS_INVALID_ARGUMENT, "casting (7)", "casting out of range");
    CHECK(strcmp(opsmith_rms_norm_casting_name(OPSMITH_RMS_NORM_CASTING_LLAMA), "llama") == 0 &&
              strcmp(opsmith_rms_norm_casting_name((opsmith_rms_norm_casting)9), "?") == 0,
          "casting names");
}

HARNESS_GROUP(test_rms_norm_options)
{
    test_rng rng = {20261203};
    /* shapes: odd width (scalar paths), packed widths for the register
     * plans, many rows (CUDA's staged backward), one wide row */
    const int64_t shapes[][2] = {{3, 37}, {6, 1024}, {300, 512}, {2, 12288}};
    const opsmith_rms_norm_casting castings[] = {OPSMITH_RMS_NORM_CASTING_NONE, OPSMITH_RMS_NORM_CASTING_LLAMA,
                                                 OPSMITH_RMS_NORM_CASTING_GEMMA};
    int cuda = 0;
#if TEST_CUDA
    cuda = cuda_begin();
#endif
    for (size_t ci = 0; ci < sizeof kCombos / sizeof kCombos[0]; ci++)
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
            for (size_t k = 0; k < 3; k++)
                for (int variant = 0; variant < 3; variant++) {
                    /* variant 0: weight, offset 0; 1: weight, offset 1 (Gemma), strided rows; 2: no weight */
                    const int64_t n = shapes[si][1], pad = variant == 1 ? 8 : 0;
                    launch L = {&kCombos[ci], shapes[si][0], n, n + pad, n + pad, variant == 1 ? 1.0 : 0.0, 1e-6,
                                castings[k], variant != 2};
                    run_case(&L, 0, &rng);
                    if (cuda > 0) run_case(&L, 1, &rng);
                }
    if (cuda == 0 && TEST_CUDA) harness_skip(1);
#if TEST_CUDA
    cuda_end(cuda);
#endif
    for (int dt = 0; dt < 4; dt++) {
        check_in_place((opsmith_dtype)dt, OPSMITH_RMS_NORM_CASTING_NONE, &rng);
        check_in_place((opsmith_dtype)dt, OPSMITH_RMS_NORM_CASTING_LLAMA, &rng);
    }
    check_bad_options();
}
