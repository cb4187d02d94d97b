/* The residual-add RMSNorm launchers (opsmith_fused_add_rms_norm_*), CPU
 * and (when built with CUDA and a device is present) CUDA, against the
 * float64 reference: every dtype combination, each casting mode, an offset,
 * odd and packed widths, strided rows, h written over residual, dh absent.
 * Outputs start as NaN (0xFF bytes) and the gaps between strided rows must
 * stay NaN, so unwritten or stray elements fail. Also: the fused results
 * are bit for bit those of a separate add followed by opsmith_rms_norm_ex_*
 * on the CPU, and bad arguments fail naming the argument. */
#include <math.h>

#include "rms_norm_cases.h"



/* a strided (rows, stride) buffer of dtype dt, random values in the first n
 * of every row, NaN between; wide = the values, contiguous (rows, n) */
typedef struct buf {
    opsmith_dtype dt;
    image im;
    double *wide;
} buf;

static buf buf_rows(opsmith_dtype dt, int64_t rows, int64_t n, int64_t stride, test_rng *rng)
{
    buf b = {dt, image_new(GUARD, (size_t)(rows * stride) * opsmith_dtype_size(dt)), xmalloc((size_t)(rows * n) * 8)};
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++) {
            opsmith_store_from_double(dt, img(&b.im), r * stride + i, rng_value(rng));
            b.wide[r * n + i] = opsmith_load_as_double(dt, img(&b.im), r * stride + i);
        }
    return b;
}

static void buf_free(buf *b) { image_free(&b->im), free(b->wide); }

static image out_rows(opsmith_dtype dt, int64_t rows, int64_t stride)
{
    return image_new(GUARD, (size_t)(rows * stride) * opsmith_dtype_size(dt));
}


typedef struct launch {
    const combo *c;
    int64_t rows, n, s; /* s: the row stride of every row tensor */
    double offset;
    opsmith_rms_norm_casting casting;
    int h_over_residual; /* the in-place form: h is residual */
    int with_dh;
} launch;


/* one forward + backward on the CPU (cuda = 0) or CUDA, checked against the reference */
static void run_case(const launch *L, int cuda, test_rng *rng)
{
    const combo *c = L->c;
    const int64_t rows = L->rows, n = L->n, s = L->s;
    const opsmith_dtype acc = opsmith_dtype_accumulate(c->x);
    char name[220];
    snprintf(name, sizeof name, "%s x=%s w=%s y=%s rows=%lld n=%lld stride=%lld offset=%g casting=%s h=residual:%d dh:%d",
             cuda ? "cuda" : "cpu", opsmith_dtype_name(c->x), opsmith_dtype_name(c->w), opsmith_dtype_name(c->y),
             (long long)rows, (long long)n, (long long)s, L->offset, opsmith_rms_norm_casting_name(L->casting),
             L->h_over_residual, L->with_dh);
    buf x = buf_rows(c->x, rows, n, s, rng), res = buf_rows(c->x, rows, n, s, rng);
    buf dy = buf_rows(c->y, rows, n, s, rng), dh = buf_rows(c->x, rows, n, s, rng), w = buf_rows(c->w, 1, n, n, rng);
    const size_t cells = (size_t)(rows * n);
    double *y_ref = xmalloc(cells * 8), *h_ref = xmalloc(cells * 8), *inv_ref = xmalloc((size_t)rows * 8);
    double *dx_ref = xmalloc(cells * 8), *dw_ref = xmalloc((size_t)n * 8);
    opsmith_fused_add_rms_norm_fwd_reference(rows, n, x.wide, res.wide, w.wide, L->offset, 1e-6, L->casting, c->x,
                                             y_ref, h_ref, inv_ref);
    opsmith_fused_add_rms_norm_bwd_reference(rows, n, dy.wide, L->with_dh ? dh.wide : NULL, h_ref, w.wide, L->offset,
                                             L->casting, c->x, inv_ref, dx_ref, dw_ref);
    image y = out_rows(c->y, rows, s), hbuf = out_rows(c->x, rows, s), inv = out_rows(acc, 1, rows);
    image dx = out_rows(c->x, rows, s), dw = out_rows(c->w, 1, n);
    image *h = L->h_over_residual ? &res.im : &hbuf; /* the in-place form: h lands in residual's buffer */
    opsmith_status fs, bs;
    if (!cuda) {
        fs = opsmith_fused_add_rms_norm_fwd_cpu(c->x, c->w, c->y, rows, n, img(&x.im), s, img(&res.im), s, img(&w.im),
                                                L->offset, 1e-6, L->casting, img(&y), s, img(h), s, img(&inv));
        const size_t ws_bytes =
            opsmith_fused_add_rms_norm_bwd_cpu_workspace_size(c->x, c->w, c->y, rows, n, img(&w.im), img(&dw));
        void *ws = ws_bytes ? workspace_alloc(ws_bytes) : NULL;
        bs = opsmith_fused_add_rms_norm_bwd_cpu(c->x, c->w, c->y, rows, n, img(&dy.im), s,
                                                L->with_dh ? img(&dh.im) : NULL, s, img(h), s, img(&w.im), L->offset,
                                                L->casting, img(&inv), img(&dx), s, img(&dw), ws, ws_bytes);
        free(ws);
    } else {
#if TEST_CUDA
        void *dxp = to_device(&x.im), *drs = to_device(&res.im), *ddy = to_device(&dy.im), *ddh = to_device(&dh.im);
        void *dwt = to_device(&w.im), *dyo = to_device(&y), *dho = to_device(&hbuf), *dinv = to_device(&inv);
        void *ddx = to_device(&dx), *ddw = to_device(&dw);
        void *dh_out = L->h_over_residual ? drs : dho;
        fs = opsmith_fused_add_rms_norm_fwd_cuda(c->x, c->w, c->y, rows, n, dxp, s, drs, s, dwt, L->offset, 1e-6,
                                                 L->casting, dyo, s, dh_out, s, dinv, NULL);
        const size_t ws_bytes = opsmith_fused_add_rms_norm_bwd_cuda_workspace_size(c->x, c->w, c->y, rows, n, dwt, ddw);
        void *ws = NULL;
        if (ws_bytes) cudaMalloc(&ws, ws_bytes);
        bs = opsmith_fused_add_rms_norm_bwd_cuda(c->x, c->w, c->y, rows, n, ddy, s, L->with_dh ? ddh : NULL, s, dh_out,
                                                 s, dwt, L->offset, L->casting, dinv, ddx, s, ddw, ws, ws_bytes, NULL);
        CHECK(cudaDeviceSynchronize() == cudaSuccess, "%s: kernel failed", name);
        cudaFree(ws);
        from_device(&y, dyo), from_device(&hbuf, dho), from_device(&res.im, drs), from_device(&inv, dinv);
        from_device(&dx, ddx), from_device(&dw, ddw);
        cudaFree((unsigned char *)dxp - x.im.lead), cudaFree((unsigned char *)ddy - dy.im.lead);
        cudaFree((unsigned char *)ddh - dh.im.lead), cudaFree((unsigned char *)dwt - w.im.lead);
#else
        fs = bs = OPSMITH_STATUS_CUDA_UNAVAILABLE;
#endif
    }
    if (CHECK(fs == OPSMITH_STATUS_SUCCESS, "%s: fwd status %s: %s", name, opsmith_status_string(fs),
              opsmith_last_error())) {
        /* h is x + residual rounded once to x's dtype: exactly the reference's */
        check_rows("h", name, c->x, h, h_ref, rows, n, s, 0.0);
        check_rows("y", name, c->y, &y, y_ref, rows, n, s, options_tol2(c->x, c->y));
        check_rows("inv_rms", name, acc, &inv, inv_ref, 1, rows, rows, options_tol(acc));
    }
    if (CHECK(bs == OPSMITH_STATUS_SUCCESS, "%s: bwd status %s: %s", name, opsmith_status_string(bs),
              opsmith_last_error())) {
        check_rows("dx", name, c->x, &dx, dx_ref, rows, n, s, options_tol2(c->x, c->y));
        check_rows("dweight", name, c->w, &dw, dw_ref, 1, n, n, options_tol2(c->x, c->w));
    }
    buf_free(&x), buf_free(&res), buf_free(&dy), buf_free(&dh), buf_free(&w);
    image_free(&y), image_free(&hbuf), image_free(&inv), image_free(&dx), image_free(&dw);
    free(y_ref), free(h_ref), free(inv_ref), free(dx_ref), free(dw_ref);
}

/* On the CPU the fused op is the unfused sequence bit for bit: h = x + r
 * rounded, opsmith_rms_norm_ex_* on h, and dx = round(dx_norm) + dh. */
static void check_unfused(const combo *c, opsmith_rms_norm_casting casting, test_rng *rng)
{
    const int64_t rows = 7, n = 301;
    const opsmith_dtype acc = opsmith_dtype_accumulate(c->x);
    const size_t xb = (size_t)(rows * n) * opsmith_dtype_size(c->x);
    buf x = buf_rows(c->x, rows, n, n, rng), res = buf_rows(c->x, rows, n, n, rng), w = buf_rows(c->w, 1, n, n, rng);
    buf dy = buf_rows(c->y, rows, n, n, rng), dh = buf_rows(c->x, rows, n, n, rng);
    image y = out_rows(c->y, rows, n), h = out_rows(c->x, rows, n), inv = out_rows(acc, 1, rows);
    image y2 = out_rows(c->y, rows, n), h2 = out_rows(c->x, rows, n), inv2 = out_rows(acc, 1, rows);
    image dx = out_rows(c->x, rows, n), dx2 = out_rows(c->x, rows, n), dw = out_rows(c->w, 1, n), dw2 = out_rows(c->w, 1, n);
    opsmith_status s1 = opsmith_fused_add_rms_norm_fwd_cpu(c->x, c->w, c->y, rows, n, img(&x.im), n, img(&res.im), n,
                                                           img(&w.im), 1.0, 1e-6, casting, img(&y), n, img(&h), n,
                                                           img(&inv));
    for (int64_t i = 0; i < rows * n; i++) opsmith_store_from_double(c->x, img(&h2), i, x.wide[i] + res.wide[i]);
    opsmith_status s2 = opsmith_rms_norm_ex_fwd_cpu(c->x, c->w, c->y, rows, n, img(&h2), n, img(&w.im), 1.0, 1e-6,
                                                    casting, img(&y2), n, img(&inv2));
    CHECK(s1 == 0 && s2 == 0 && memcmp(img(&h), img(&h2), xb) == 0 &&
              memcmp(img(&y), img(&y2), (size_t)(rows * n) * opsmith_dtype_size(c->y)) == 0,
          "x=%s w=%s y=%s %s: fused forward differs from add + rms_norm", opsmith_dtype_name(c->x),
          opsmith_dtype_name(c->w), opsmith_dtype_name(c->y), opsmith_rms_norm_casting_name(casting));
    size_t ws_bytes = opsmith_fused_add_rms_norm_bwd_cpu_workspace_size(c->x, c->w, c->y, rows, n, img(&w.im), img(&dw));
    void *ws = workspace_alloc(ws_bytes);
    s1 = opsmith_fused_add_rms_norm_bwd_cpu(c->x, c->w, c->y, rows, n, img(&dy.im), n, img(&dh.im), n, img(&h), n,
                                            img(&w.im), 1.0, casting, img(&inv), img(&dx), n, img(&dw), ws, ws_bytes);
    s2 = opsmith_rms_norm_ex_bwd_cpu(c->x, c->w, c->y, rows, n, img(&dy.im), n, img(&h), n, img(&w.im), 1.0, casting,
                                     img(&inv), img(&dx2), n, img(&dw2), ws, ws_bytes);
    for (int64_t i = 0; i < rows * n; i++)
        opsmith_store_from_double(c->x, img(&dx2), i, opsmith_load_as_double(c->x, img(&dx2), i) + dh.wide[i]);
    CHECK(s1 == 0 && s2 == 0 && memcmp(img(&dx), img(&dx2), xb) == 0 &&
              memcmp(img(&dw), img(&dw2), (size_t)n * opsmith_dtype_size(c->w)) == 0,
          "x=%s w=%s y=%s %s: fused backward differs from rms_norm's + dh", opsmith_dtype_name(c->x),
          opsmith_dtype_name(c->w), opsmith_dtype_name(c->y), opsmith_rms_norm_casting_name(casting));
    free(ws);
    buf_free(&x), buf_free(&res), buf_free(&w), buf_free(&dy), buf_free(&dh);
    image_free(&y), image_free(&h), image_free(&inv), image_free(&y2), image_free(&h2), image_free(&inv2);
    image_free(&dx), image_free(&dx2), image_free(&dw), image_free(&dw2);
}

static void expect_error(opsmith_status got, opsmith_status want, const char *needle, const char *what)
{
    CHECK(got == want && strstr(opsmith_last_error(), needle) != NULL, "%s: status %s, message \"%s\" (want %s, \"%s\")",
          what, opsmith_status_string(got), opsmith_last_error(), opsmith_status_string(want), needle);
}

static void check_bad_arguments(void)
{
    const opsmith_dtype f = OPSMITH_DTYPE_F32;
    const opsmith_rms_norm_casting none = OPSMITH_RMS_NORM_CASTING_NONE;
    float x[16] = {1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8}, r[16] = {0}, y[16], h[16], w[8] = {1}, inv[2];
    float dy[16] = {1}, dx[16], dw[8], ws[1024];
    expect_error(opsmith_fused_add_rms_norm_fwd_cpu(f, f, f, 2, 8, x, 8, NULL, 8, w, 0, 1e-6, none, y, 8, h, 8, inv),
                 OPSMITH_STATUS_INVALID_ARGUMENT, "residual is NULL", "no residual");
    expect_error(opsmith_fused_add_rms_norm_fwd_cpu(f, f, f, 2, 8, x, 8, r, 8, w, 0, 1e-6, none, y, 8, NULL, 8, inv),
                 OPSMITH_STATUS_INVALID_ARGUMENT, "h is NULL", "no h");
    expect_error(opsmith_fused_add_rms_norm_fwd_cpu(f, f, f, 2, 8, x, 8, r, 4, w, 0, 1e-6, none, y, 8, h, 8, inv),
                 OPSMITH_STATUS_INVALID_ARGUMENT, "residual_row_stride (4) must be >= n", "residual rows overlap");
    expect_error(opsmith_fused_add_rms_norm_fwd_cpu(f, f, f, 2, 8, x, 8, r, 8, w, 0, 1e-6, none, y, 8, y, 8, inv),
                 OPSMITH_STATUS_INVALID_ARGUMENT, "y overlaps h", "h is y");
    expect_error(opsmith_fused_add_rms_norm_fwd_cpu(f, f, f, 2, 8, x, 8, r, 8, w, 0, 1e-6, none, y, 8, r + 1, 8, inv),
                 OPSMITH_STATUS_INVALID_ARGUMENT, "h overlaps residual", "h shifted over residual");
    expect_error(opsmith_fused_add_rms_norm_fwd_cpu(f, f, f, 2, 8, x, 8, (const char *)r + 2, 8, w, 0, 1e-6, none, y,
                                                    8, h, 8, inv),
                 OPSMITH_STATUS_MISALIGNED, "residual", "misaligned residual");
    expect_error(opsmith_fused_add_rms_norm_fwd_cpu(f, f, f, 2, 8, x, 8, r, 8, w, 0, -1.0, none, y, 8, h, 8, inv),
                 OPSMITH_STATUS_INVALID_ARGUMENT, "eps (-1) must be >= 0", "negative eps");
    /* h may be residual itself (the in-place form) and x itself */
    CHECK(opsmith_fused_add_rms_norm_fwd_cpu(f, f, f, 2, 8, x, 8, r, 8, w, 0, 1e-6, none, y, 8, r, 8, inv) == 0,
          "h = residual must be accepted: %s", opsmith_last_error());
    expect_error(opsmith_fused_add_rms_norm_bwd_cpu(f, f, f, 2, 8, dy, 8, dx, 8, h, 8, w, 0, none, inv, dx, 8, dw, ws,
                                                    sizeof ws),
                 OPSMITH_STATUS_INVALID_ARGUMENT, "dx overlaps dh", "dx is dh");
    expect_error(opsmith_fused_add_rms_norm_bwd_cpu(f, f, f, 2, 8, dy, 8, r, 4, h, 8, w, 0, none, inv, dx, 8, dw, ws,
                                                    sizeof ws),
                 OPSMITH_STATUS_INVALID_ARGUMENT, "dh_row_stride (4) must be >= n", "dh rows overlap");
    expect_error(opsmith_fused_add_rms_norm_bwd_cpu(f, f, f, 2, 8, NULL, 8, r, 8, h, 8, w, 0, none, inv, dx, 8, dw, ws,
                                                    sizeof ws),
                 OPSMITH_STATUS_INVALID_ARGUMENT, "dy is NULL", "no dy");
    /* the backward's messages name h (its normalised input), not x */
    expect_error(opsmith_fused_add_rms_norm_bwd_cpu(f, f, f, 2, 8, dy, 8, r, 8, NULL, 8, w, 0, none, inv, dx, 8, dw, ws,
                                                    sizeof ws),
                 OPSMITH_STATUS_INVALID_ARGUMENT, "h is NULL", "no h");
    expect_error(opsmith_fused_add_rms_norm_bwd_cpu(f, f, f, 2, 8, dy, 8, r, 8, h, 4, w, 0, none, inv, dx, 8, dw, ws,
                                                    sizeof ws),
                 OPSMITH_STATUS_INVALID_ARGUMENT, "h_row_stride (4) must be >= n", "h rows overlap");
    /* dx may be dy, but not when dy is h too: h is read after dx's block is written */
    expect_error(opsmith_fused_add_rms_norm_bwd_cpu(f, f, f, 2, 8, dy, 8, r, 8, dy, 8, w, 0, none, inv, dy, 8, dw, ws,
                                                    sizeof ws),
                 OPSMITH_STATUS_INVALID_ARGUMENT, "dx overlaps h", "dx = dy = h");
    expect_error(opsmith_fused_add_rms_norm_fwd_cuda(f, f, f, 2, 8, x, 8, r, 8, w, 0, -1.0, none, y, 8, h, 8, inv, NULL),
                 TEST_CUDA ? OPSMITH_STATUS_INVALID_ARGUMENT : OPSMITH_STATUS_CUDA_UNAVAILABLE,
                 TEST_CUDA ? "eps (-1) must be >= 0" : "built without CUDA", "CUDA launcher's checks");
}

HARNESS_GROUP(test_fused_add_rms_norm)
{
    test_rng rng = {20261204};
    /* odd width (scalar paths), packed widths for the register plans, many
     * rows (CUDA's staged backward), wide rows (its cluster split) */
    const int64_t shapes[][2] = {{3, 37}, {6, 1024}, {300, 512}, {2, 12288}, {200, 16384}};
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
                    /* variant 0: separate h, dh; 1: offset 1, strided rows, h over
                     * residual; 2: no dh */
                    const int64_t n = shapes[si][1], pad = variant == 1 ? 8 : 0;
                    if (si == 4 && (variant != 0 || k != 0) && !cuda) continue; /* the wide case once on the CPU */
                    launch L = {&kCombos[ci], shapes[si][0], n, n + pad, variant == 1 ? 1.0 : 0.0, castings[k],
                                variant == 1, variant != 2};
                    run_case(&L, 0, &rng);
                    if (cuda > 0) run_case(&L, 1, &rng);
                }
    if (cuda == 0 && TEST_CUDA) harness_skip(1);
#if TEST_CUDA
    cuda_end(cuda);
#endif
    for (size_t ci = 0; ci < sizeof kCombos / sizeof kCombos[0]; ci++)
        for (size_t k = 0; k < 3; k++) check_unfused(&kCombos[ci], castings[k], &rng);
    check_bad_arguments();
}
