/* RMSNorm launchers (CPU, and CUDA when built with OPSMITH_WITH_CUDA=1)
 * against the float64 scalar reference.
 *
 * Inputs are drawn in double, rounded into the storage dtype, and the
 * reference sees the rounded values, so only the kernel's own arithmetic and
 * output rounding are measured. Outputs start as 0xFF bytes (NaN in every
 * float type) so an unwritten element fails, and sit between guard bytes so
 * a write outside the tensor fails too. */
#include <math.h>

#include "rms_norm_cases.h"

/* The library's threads come from the same OpenMP runtime, so the test can
 * change their count to check that dweight does not depend on it. */
#if defined(__has_include)
#if __has_include(<omp.h>)
#include <omp.h>
#define TEST_OMP 1
#endif
#endif
#ifndef TEST_OMP
#define TEST_OMP 0
#endif

static int image_guards_ok(const image *im)
{
    for (size_t i = 0; i < im->total; i++)
        if ((i < im->lead || i >= im->lead + im->bytes) && im->base[i] != GUARD_BYTE)
            return 0;
    return 1;
}

/* Still all poison and guards: nothing was written. */
static int image_untouched(const image *im)
{
    for (size_t i = 0; i < im->bytes; i++)
        if (im->base[im->lead + i] != POISON_BYTE)
            return 0;
    return image_guards_ok(im);
}

/* Fills x or dy: every element through the dtype, padding left as NaN. */
static void fill_input(opsmith_dtype dt, image *im, double *wide, int64_t rows, int64_t n,
                       int64_t stride, test_rng *rng)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++) {
            opsmith_store_from_double(dt, img(im), r * stride + i, rng_value(rng));
            wide[r * n + i] = opsmith_load_as_double(dt, img(im), r * stride + i);
        }
}

static void data_init(rms_data *d, const rms_case *c, test_rng *rng)
{
    const opsmith_dtype acc = opsmith_dtype_accumulate(c->dt);
    const size_t es = opsmith_dtype_size(c->dt), aes = opsmith_dtype_size(acc);
    const int64_t rows = c->rows, n = c->n, count = rows * n;
    memset(d, 0, sizeof *d);
    snprintf(d->name, sizeof d->name, "%s rows=%lld n=%lld w=%d dw=%d pad=%lld/%lld/%lld off=%d/%d eps=%g",
             opsmith_dtype_name(c->dt), (long long)rows, (long long)n, c->weight, c->dweight,
             (long long)c->x_pad, (long long)c->dy_pad, (long long)c->out_pad, c->in_off, c->out_off, c->eps);
    d->xs = n + c->x_pad;
    d->dys = n + c->dy_pad;
    d->ys = n + c->out_pad;
    d->x = image_new(GUARD + (size_t)c->in_off * es, (size_t)(rows * d->xs) * es);
    d->dy = image_new(GUARD + (size_t)c->in_off * es, (size_t)(rows * d->dys) * es);
    d->xd = xmalloc((size_t)count * sizeof(double));
    d->dyd = xmalloc((size_t)count * sizeof(double));
    fill_input(c->dt, &d->x, d->xd, rows, n, d->xs, rng);
    fill_input(c->dt, &d->dy, d->dyd, rows, n, d->dys, rng);
    if (c->weight) {
        d->w = image_new(GUARD + (size_t)c->out_off * es, (size_t)n * es);
        d->wd = xmalloc((size_t)n * sizeof(double));
        fill_input(c->dt, &d->w, d->wd, 1, n, n, rng);
    }

    d->y_ref = xmalloc((size_t)count * sizeof(double));
    d->inv_ref = xmalloc((size_t)rows * sizeof(double));
    opsmith_rms_norm_fwd_reference(rows, n, d->xd, d->wd, c->eps, d->y_ref, d->inv_ref);

    /* The backward gets the reference inv_rms rounded to the accumulate type,
     * so a forward bug cannot hide or cause a backward failure. */
    d->inv_in = image_new(GUARD, (size_t)rows * aes);
    d->inv_d = xmalloc((size_t)rows * sizeof(double));
    for (int64_t r = 0; r < rows; r++) {
        opsmith_store_from_double(acc, img(&d->inv_in), r, d->inv_ref[r]);
        d->inv_d[r] = opsmith_load_as_double(acc, img(&d->inv_in), r);
    }
    d->dx_ref = xmalloc((size_t)count * sizeof(double));
    if (c->weight && c->dweight)
        d->dw_ref = xmalloc((size_t)n * sizeof(double));
    opsmith_rms_norm_bwd_reference(rows, n, d->dyd, d->xd, d->wd, d->inv_d, d->dx_ref, d->dw_ref);

    d->y_scale = fmax(1.0, max_abs(d->y_ref, count));
    d->inv_scale = fmax(1.0, max_abs(d->inv_ref, rows));
    d->dw_scale = d->dw_ref ? max_abs(d->dw_ref, n) : 0.0;
    /* dx = inv*(g - x*inv^2*mean(g*x)) cancels when x is nearly parallel to g
     * (always for n == 1): the rounding error of any implementation scales
     * with the two terms, not with their difference, so they set the scale. */
    d->dx_scale = fmax(1.0, max_abs(d->dx_ref, count));
    for (int64_t r = 0; r < rows; r++) {
        const double inv = d->inv_d[r];
        double m = 0.0;
        for (int64_t i = 0; i < n; i++)
            m += d->dyd[r * n + i] * (d->wd ? d->wd[i] : 1.0) * d->xd[r * n + i];
        m /= (double)n;
        for (int64_t i = 0; i < n; i++) {
            double g = d->dyd[r * n + i] * (d->wd ? d->wd[i] : 1.0);
            d->dx_scale = fmax(d->dx_scale, fabs(inv * g));
            d->dx_scale = fmax(d->dx_scale, fabs(d->xd[r * n + i] * inv * inv * inv * m));
        }
    }
}

static void data_free(rms_data *d)
{
    image_free(&d->x), image_free(&d->dy), image_free(&d->w), image_free(&d->inv_in);
    free(d->xd), free(d->dyd), free(d->wd), free(d->inv_d);
    free(d->y_ref), free(d->inv_ref), free(d->dx_ref), free(d->dw_ref);
}

/* max |out - ref| <= tol * scale over (rows, n), out with row stride
 * `stride`, ref contiguous; a NaN anywhere counts as an infinite error. */
static void check_close(const char *be, const rms_data *d, const char *what, opsmith_dtype dt,
                        const void *out, const double *ref, int64_t rows, int64_t n, int64_t stride,
                        double tol, double scale)
{
    double worst = 0.0, got_at = 0.0;
    int64_t at = -1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++) {
            double got = opsmith_load_as_double(dt, out, r * stride + i);
            double err = isnan(got) ? INFINITY : fabs(got - ref[r * n + i]);
            if (err > worst || at < 0) {
                worst = err, at = r * n + i, got_at = got;
            }
        }
    double bound = tol * scale;
    CHECK(worst <= bound, "%s %s: %s max|err| %.3g > %.3g at [%lld] (got %.9g want %.9g)", be,
          d->name, what, worst, bound, (long long)at, got_at, at >= 0 ? ref[at] : 0.0);
}

/* The elements between rows of a strided output still hold their poison. */
static int row_gaps_untouched(const image *im, int64_t rows, int64_t n, int64_t stride, size_t es)
{
    for (int64_t r = 0; r + 1 < rows; r++)
        for (size_t b = (size_t)(r * stride + n) * es; b < (size_t)((r + 1) * stride) * es; b++)
            if (im->base[im->lead + b] != POISON_BYTE)
                return 0;
    return 1;
}

void check_fwd(const rms_case *c, const rms_data *d, const char *be, const image *y, int64_t ys,
               const image *inv)
{
    const opsmith_dtype acc = opsmith_dtype_accumulate(c->dt);
    CHECK(image_guards_ok(y), "%s %s: fwd wrote outside y", be, d->name);
    CHECK(row_gaps_untouched(y, c->rows, c->n, ys, opsmith_dtype_size(c->dt)),
          "%s %s: fwd wrote between the rows of y (row stride %lld)", be, d->name, (long long)ys);
    CHECK(image_guards_ok(inv), "%s %s: fwd wrote outside inv_rms", be, d->name);
    check_close(be, d, "y", c->dt, img(y), d->y_ref, c->rows, c->n, ys, norm_tol(c->dt), d->y_scale);
    /* inv_rms is kept in the accumulate type, so it gets that type's tolerance. */
    check_close(be, d, "inv_rms", acc, img(inv), d->inv_ref, 1, c->rows, c->rows, norm_tol(acc), d->inv_scale);
}

void check_bwd(const rms_case *c, const rms_data *d, const char *be, const image *dx, int64_t dxs,
               const image *dw)
{
    CHECK(image_guards_ok(dx), "%s %s: bwd wrote outside dx", be, d->name);
    CHECK(row_gaps_untouched(dx, c->rows, c->n, dxs, opsmith_dtype_size(c->dt)),
          "%s %s: bwd wrote between the rows of dx (row stride %lld)", be, d->name, (long long)dxs);
    check_close(be, d, "dx", c->dt, img(dx), d->dx_ref, c->rows, c->n, dxs, norm_tol(c->dt), d->dx_scale);
    if (!c->dweight)
        return;
    if (c->weight) {
        CHECK(image_guards_ok(dw), "%s %s: bwd wrote outside dweight", be, d->name);
        check_close(be, d, "dweight (NaN counts as failure)", c->dt, img(dw), d->dw_ref, 1, c->n, c->n,
                    norm_tol(c->dt), d->dw_scale);
    } else {
        CHECK(image_untouched(dw), "%s %s: dweight written although weight is NULL", be, d->name);
    }
}

void check_same(const rms_case *c, const rms_data *d, const char *be, const char *how,
                const bwd_out *a, const bwd_out *b)
{
    int same = memcmp(img(&a->dx), img(&b->dx), a->dx.bytes) == 0;
    CHECK(same, "%s %s: dx differs bitwise between runs (%s)", be, d->name, how);
    if (c->weight && c->dweight) {
        same = memcmp(img(&a->dw), img(&b->dw), a->dw.bytes) == 0;
        CHECK(same, "%s %s: dweight differs bitwise between runs (%s)", be, d->name, how);
    }
}

bwd_out bwd_out_new(const rms_case *c)
{
    const size_t es = opsmith_dtype_size(c->dt);
    const size_t lead = GUARD + (size_t)c->out_off * es;
    bwd_out o = {image_new(lead, (size_t)(c->rows * (c->n + c->out_pad)) * es), {NULL, 0, 0, 0}};
    if (c->dweight)
        o.dw = image_new(lead, (size_t)c->n * es);
    return o;
}

void bwd_out_free(bwd_out *o) { image_free(&o->dx), image_free(&o->dw); }

void *workspace_alloc(size_t bytes)
{
    const size_t align = OPSMITH_WORKSPACE_ALIGNMENT;
    void *p = aligned_alloc(align, (bytes + 64 + align - 1) / align * align);
    if (!p) {
        fprintf(stderr, "out of host memory (%zu bytes)\n", bytes);
        exit(2);
    }
    return p;
}

image image_copy(const image *im)
{
    image c = *im;
    c.base = xmalloc(im->total);
    memcpy(c.base, im->base, im->total);
    return c;
}

/* dx into o->dx (row stride ys), or with o == NULL in place: dx over dy. */
static opsmith_status cpu_bwd(const rms_case *c, const rms_data *d, bwd_out *o, image *dy_inout)
{
    const void *dy = img(dy_inout ? dy_inout : &d->dy);
    void *dx = o ? img(&o->dx) : img(dy_inout);
    const int64_t dxs = o ? d->ys : d->dys;
    void *dw = o ? img(&o->dw) : NULL;
    const size_t ws_bytes = opsmith_rms_norm_bwd_cpu_workspace_size(c->dt, c->rows, c->n, dy, d->dys, img(&d->x),
                                                                    d->xs, img(&d->w), img(&d->inv_in), dx, dxs, dw);
    void *ws = ws_bytes ? workspace_alloc(ws_bytes) : NULL;
    opsmith_status st = opsmith_rms_norm_bwd_cpu(c->dt, c->rows, c->n, dy, d->dys, img(&d->x), d->xs, img(&d->w),
                                                 img(&d->inv_in), dx, dxs, dw, ws, ws_bytes);
    free(ws);
    return st;
}

static void run_cpu(const rms_case *c, const rms_data *d)
{
    const size_t es = opsmith_dtype_size(c->dt);
    const size_t aes = opsmith_dtype_size(opsmith_dtype_accumulate(c->dt));
    image y = image_new(GUARD + (size_t)c->out_off * es, (size_t)(c->rows * d->ys) * es);
    image inv = image_new(GUARD, (size_t)c->rows * aes);
    opsmith_status st = opsmith_rms_norm_fwd_cpu(c->dt, c->rows, c->n, img(&d->x), d->xs,
                                                 img(&d->w), c->eps, img(&y), d->ys, img(&inv));
    if (CHECK(st == OPSMITH_STATUS_SUCCESS, "cpu %s: fwd returned \"%s\" (%s)", d->name,
              opsmith_status_string(st), opsmith_last_error()))
        check_fwd(c, d, "cpu", &y, d->ys, &inv);
    image_free(&y);

    /* in place: y over a copy of x, which has x's row stride */
    image xy = image_copy(&d->x);
    st = opsmith_rms_norm_fwd_cpu(c->dt, c->rows, c->n, img(&xy), d->xs, img(&d->w), c->eps, img(&xy), d->xs,
                                  img(&inv));
    if (CHECK(st == OPSMITH_STATUS_SUCCESS, "cpu %s: in-place fwd returned \"%s\" (%s)", d->name,
              opsmith_status_string(st), opsmith_last_error()))
        check_fwd(c, d, "cpu in-place", &xy, d->xs, &inv);
    image_free(&xy), image_free(&inv);

    image dyx = image_copy(&d->dy);
    st = cpu_bwd(c, d, NULL, &dyx);
    if (CHECK(st == OPSMITH_STATUS_SUCCESS, "cpu %s: in-place bwd returned \"%s\" (%s)", d->name,
              opsmith_status_string(st), opsmith_last_error())) {
        rms_case no_dw = *c;
        no_dw.dweight = 0;
        check_bwd(&no_dw, d, "cpu in-place", &dyx, d->dys, NULL);
    }
    image_free(&dyx);

    bwd_out a = bwd_out_new(c), b = bwd_out_new(c);
    st = cpu_bwd(c, d, &a, NULL);
    if (!CHECK(st == OPSMITH_STATUS_SUCCESS, "cpu %s: bwd returned \"%s\"", d->name,
               opsmith_status_string(st)))
        goto done;
    check_bwd(c, d, "cpu", &a.dx, d->ys, &a.dw);
    st = cpu_bwd(c, d, &b, NULL);
    if (CHECK(st == OPSMITH_STATUS_SUCCESS, "cpu %s: 2nd bwd returned \"%s\"", d->name,
              opsmith_status_string(st)))
        check_same(c, d, "cpu", "same threads", &a, &b);
#if TEST_OMP
    /* Different thread counts split the rows differently; the bits must not move. */
    if (c->rows > 1) {
        const int saved = opsmith_get_num_threads();
        const int counts[2] = {1, 3};
        for (int k = 0; k < 2; k++) {
            bwd_out t = bwd_out_new(c);
            opsmith_set_num_threads(counts[k]);
            CHECK(opsmith_get_num_threads() == counts[k], "set_num_threads(%d): get_num_threads() = %d",
                  counts[k], opsmith_get_num_threads());
            st = cpu_bwd(c, d, &t, NULL);
            opsmith_set_num_threads(0);
            char how[32];
            snprintf(how, sizeof how, "%d vs %d threads", saved, counts[k]);
            if (CHECK(st == OPSMITH_STATUS_SUCCESS, "cpu %s: bwd (%s) returned \"%s\"", d->name,
                      how, opsmith_status_string(st)))
                check_same(c, d, "cpu", how, &a, &t);
            bwd_out_free(&t);
        }
    }
#endif
done:
    bwd_out_free(&a), bwd_out_free(&b);
}

/* Bad arguments: each call changes one field of a valid call. */
static opsmith_status call_fwd(int cuda, const call_args *a)
{
#if TEST_CUDA
    if (cuda)
        return opsmith_rms_norm_fwd_cuda(a->dt, a->rows, a->n, a->x, a->xs, a->w, a->eps, a->y, a->ys,
                                         a->inv, NULL);
#endif
    (void)cuda;
    return opsmith_rms_norm_fwd_cpu(a->dt, a->rows, a->n, a->x, a->xs, a->w, a->eps, a->y, a->ys, a->inv);
}

static opsmith_status call_bwd(int cuda, const call_args *a)
{
#if TEST_CUDA
    if (cuda)
        return opsmith_rms_norm_bwd_cuda(a->dt, a->rows, a->n, a->dy, a->dys, a->x, a->xs, a->w,
                                         a->inv_in, a->dx, a->dxs, a->dw, a->ws, a->ws_bytes, NULL);
#endif
    (void)cuda;
    return opsmith_rms_norm_bwd_cpu(a->dt, a->rows, a->n, a->dy, a->dys, a->x, a->xs, a->w,
                                    a->inv_in, a->dx, a->dxs, a->dw, a->ws, a->ws_bytes);
}

/* A failing call must also say, in opsmith_last_error(), which argument
 * was wrong (`names`); a successful one leaves the message empty. */
static void expect_status(opsmith_status got, opsmith_status want, const char *names, const char *be,
                          opsmith_dtype dt, const char *what)
{
    const char *msg = opsmith_last_error();
    if (!CHECK(got == want, "%s %s %s: returned \"%s\" (%s), expected \"%s\"", be, opsmith_dtype_name(dt),
               what, opsmith_status_string(got), msg, opsmith_status_string(want)))
        return;
    if (want == OPSMITH_STATUS_SUCCESS)
        CHECK(msg[0] == '\0', "%s %s %s: succeeded but last_error is \"%s\"", be, opsmith_dtype_name(dt), what, msg);
    else
        CHECK(strstr(msg, names) != NULL, "%s %s %s: last_error \"%s\" does not name %s", be,
              opsmith_dtype_name(dt), what, msg, names);
}

#define EXPECT(fn, change, want, names)                                                        \
    do {                                                                                       \
        call_args a_ = *base;                                                                  \
        a_.change;                                                                             \
        expect_status(fn(cuda, &a_), want, names, be, base->dt, #fn " with " #change);         \
    } while (0)

void test_bad_args(int cuda, const call_args *base)
{
    const char *be = cuda ? "cuda" : "cpu";
    const opsmith_status INVALID = OPSMITH_STATUS_INVALID_ARGUMENT;
    const opsmith_status DTYPE = OPSMITH_STATUS_UNSUPPORTED_DTYPE;
    const opsmith_status MISALIGNED = OPSMITH_STATUS_MISALIGNED;
    const opsmith_status SMALL = OPSMITH_STATUS_WORKSPACE_TOO_SMALL;
    const opsmith_status OK = OPSMITH_STATUS_SUCCESS;
    const size_t es = opsmith_dtype_size(base->dt);
    EXPECT(call_fwd, rows = 2, OK, "");
    EXPECT(call_fwd, rows = 0, OK, "");
    EXPECT(call_fwd, n = 0, INVALID, "n (0)");
    EXPECT(call_fwd, n = -1, INVALID, "n (-1)");
    EXPECT(call_fwd, rows = -1, INVALID, "rows (-1)");
    EXPECT(call_fwd, x = NULL, INVALID, "x is NULL");
    EXPECT(call_fwd, y = NULL, INVALID, "y is NULL");
    EXPECT(call_fwd, inv = NULL, INVALID, "inv_rms is NULL");
    EXPECT(call_fwd, xs = 3, INVALID, "x_row_stride (3)");
    EXPECT(call_fwd, ys = 3, INVALID, "y_row_stride (3)");
    EXPECT(call_fwd, eps = -1e-6, INVALID, "eps");
    EXPECT(call_fwd, eps = NAN, INVALID, "eps");
    EXPECT(call_fwd, dt = OPSMITH_DTYPE_COUNT, DTYPE, "dtype");
    EXPECT(call_fwd, dt = OPSMITH_DTYPE_I64, DTYPE, "i64");
    EXPECT(call_fwd, dt = (opsmith_dtype)99, DTYPE, "dtype");
    EXPECT(call_fwd, x = (const char *)base->x + 1, MISALIGNED, "x (");
    EXPECT(call_fwd, y = (char *)base->y + 1, MISALIGNED, "y (");
    EXPECT(call_fwd, w = (const char *)base->w + 1, MISALIGNED, "weight (");
    /* aliasing: y may be x exactly, and nothing else */
    EXPECT(call_fwd, y = (void *)base->x, OK, "");
    EXPECT(call_fwd, y = (char *)base->x + es; a_.rows = 1, INVALID, "y overlaps x");
    EXPECT(call_fwd, y = (void *)base->x; a_.ys = 5, INVALID, "y overlaps x");
    EXPECT(call_fwd, y = (void *)base->w, INVALID, "y overlaps weight");
    /* y may be x, but a weight that is x too is read by every row while y is written */
    EXPECT(call_fwd, y = (void *)base->x; a_.w = base->x, INVALID, "y overlaps weight");
    /* inv_rms is written beside y: apart from x, the weight and y */
    EXPECT(call_fwd, inv = (void *)base->x, INVALID, "inv_rms overlaps x");
    EXPECT(call_fwd, inv = (void *)base->w, INVALID, "inv_rms overlaps weight");
    EXPECT(call_fwd, inv = base->y, INVALID, "inv_rms overlaps y");

    EXPECT(call_bwd, rows = 2, OK, "");
    EXPECT(call_bwd, rows = 0, OK, "");
    EXPECT(call_bwd, n = 0, INVALID, "n (0)");
    EXPECT(call_bwd, rows = -1, INVALID, "rows (-1)");
    EXPECT(call_bwd, dy = NULL, INVALID, "dy is NULL");
    EXPECT(call_bwd, x = NULL, INVALID, "x is NULL");
    EXPECT(call_bwd, inv_in = NULL, INVALID, "inv_rms is NULL");
    EXPECT(call_bwd, dx = NULL, INVALID, "dx is NULL");
    EXPECT(call_bwd, xs = 3, INVALID, "x_row_stride (3)");
    EXPECT(call_bwd, dys = 3, INVALID, "dy_row_stride (3)");
    EXPECT(call_bwd, dxs = 3, INVALID, "dx_row_stride (3)");
    EXPECT(call_bwd, dt = OPSMITH_DTYPE_COUNT, DTYPE, "dtype");
    EXPECT(call_bwd, dt = OPSMITH_DTYPE_I32, DTYPE, "i32");
    EXPECT(call_bwd, dy = (const char *)base->dy + 1, MISALIGNED, "dy (");
    EXPECT(call_bwd, dx = (char *)base->dx + 1, MISALIGNED, "dx (");
    EXPECT(call_bwd, dx = (void *)base->dy; a_.dxs = base->dys, OK, "");
    EXPECT(call_bwd, dx = (void *)base->x, INVALID, "dx overlaps x");
    EXPECT(call_bwd, dx = (char *)base->dy + es; a_.rows = 1, INVALID, "dx overlaps dy");
    /* dweight apart from everything (written while the inputs are read) */
    EXPECT(call_bwd, dw = (void *)base->w, INVALID, "dweight overlaps weight");
    EXPECT(call_bwd, dw = (void *)base->x, INVALID, "dweight overlaps x");
    EXPECT(call_bwd, dw = (void *)base->dy, INVALID, "dweight overlaps dy");
    EXPECT(call_bwd, dw = base->dx, INVALID, "dweight overlaps dx");
    EXPECT(call_bwd, dw = (void *)base->inv_in, INVALID, "dweight overlaps inv_rms");
    /* no rows: dweight is still written (zeros), so its alignment is still checked */
    EXPECT(call_bwd, rows = 0; a_.dw = (char *)base->dw + 1, MISALIGNED, "dweight (");
    /* the workspace rules of opsmith.h, on both backends */
    EXPECT(call_bwd, ws_bytes = base->ws_bytes - 1, SMALL, "workspace_bytes");
    EXPECT(call_bwd, ws = NULL, INVALID, "workspace is NULL");
    EXPECT(call_bwd, ws = (char *)base->ws + 16, MISALIGNED, "workspace (");
    EXPECT(call_bwd, ws = NULL; a_.ws_bytes = 0; a_.dw = NULL, OK, ""); /* no dweight: none needed */
}

static void test_bad_args_cpu(opsmith_dtype dt)
{
    /* Doubles give every dtype enough aligned room for 2 rows of 4. */
    static double x[8], dy[8], w[4], inv[2], y[8], dx[8], dw[4];
    for (int i = 0; i < 8; i++)
        x[i] = dy[i] = 0.0, y[i] = dx[i] = 0.0;
    for (int i = 0; i < 4; i++)
        w[i] = dw[i] = 0.0;
    inv[0] = inv[1] = 0.0;
    const size_t ws_bytes = opsmith_rms_norm_bwd_cpu_workspace_size(dt, 2, 4, dy, 4, x, 4, w, inv, dx, 4, dw);
    CHECK(ws_bytes > 0, "cpu %s: the backward with dweight needs a workspace, size query says 0",
          opsmith_dtype_name(dt));
    void *ws = workspace_alloc(ws_bytes);
    const call_args base = {dt, 2, 4, 4, 4, 4, 4, x, dy, w, inv, 1e-6, y, inv, dx, dw, ws, ws_bytes};
    test_bad_args(0, &base);
    free(ws);
}

static int build_cases(opsmith_dtype dt, rms_case *out)
{
    static const int64_t ns[] = {1, 3, 8, 769, 5125, 8192, 65536};
    static const int64_t rows_list[] = {1, 7, 130};
    const rms_case base = {dt, 7, 8, 1, 1, 0, 0, 0, 0, 1e-6, 0};
    int k = 0;
    for (int i = 0; i < 7; i++) {
        for (int j = 0; j < 3; j++) {
            if (ns[i] == 65536 && rows_list[j] > 7)
                continue; /* keeps the largest size cheap */
            out[k] = base, out[k].n = ns[i], out[k].rows = rows_list[j], k++;
        }
        const int64_t rows = ns[i] == 65536 ? 3 : 7;
        out[k] = base, out[k].n = ns[i], out[k].rows = rows, out[k].weight = 0, out[k].dweight = 0, k++;
        out[k] = base, out[k].n = ns[i], out[k].rows = rows, out[k].x_pad = 5, out[k].dy_pad = 3, k++;
    }
    const rms_case extra[] = {
        {dt, 7, 769, 0, 0, 5, 3, 0, 0, 1e-6, 0},    /* strided, no weight */
        {dt, 130, 769, 1, 0, 0, 0, 0, 0, 1e-6, 0},  /* weight but no dweight: dx only */
        {dt, 7, 8, 0, 1, 0, 0, 0, 0, 1e-6, 0},      /* dweight given, weight NULL: untouched */
        /* n and strides a multiple of every vector width, so only the
         * one-element offset can force the unvectorized path */
        {dt, 7, 8192, 1, 1, 0, 0, 1, 0, 1e-6, 0},   /* x, dy one element off */
        {dt, 7, 1024, 1, 1, 0, 0, 0, 1, 1e-6, 0},   /* weight, y, dx, dweight one off */
        {dt, 7, 5125, 1, 1, 0, 0, 1, 1, 1e-6, 0},   /* every tensor off, odd n */
        {dt, 7, 8192, 1, 1, 5, 3, 1, 1, 1e-6, 0},   /* off and oddly strided */
        {dt, 7, 8192, 1, 1, 8, 16, 0, 0, 1e-6, 0},  /* padded, 16-byte aligned rows */
        /* strided outputs: y and dx rows apart, odd and 16-byte aligned gaps */
        {dt, 7, 769, 1, 1, 0, 0, 0, 0, 1e-6, 3},
        {dt, 140, 4096, 1, 1, 0, 0, 0, 0, 1e-6, 8},
        {dt, 2000, 1024, 1, 1, 8, 8, 0, 0, 1e-6, 8},
        {dt, 13000, 512, 1, 1, 0, 0, 0, 0, 1e-6, 16},
        {dt, 300, 32768, 1, 1, 0, 0, 0, 0, 1e-6, 8},
        {dt, 3, 100003, 1, 1, 0, 0, 0, 0, 1e-6, 5},
        {dt, 7, 8, 1, 1, 0, 0, 0, 0, 0.0, 0},       /* eps = 0 is allowed */
        {dt, 130, 8, 1, 1, 0, 0, 0, 0, 0.5, 0},     /* eps comparable to mean(x^2) */
        {dt, 2000, 1024, 1, 1, 0, 0, 0, 0, 1e-6, 0}, /* many rows: dweight reduction */
        /* each CUDA launch plan: 140 rows (more than a GPU's SMs) take the
         * throughput plan, 3 rows the latency plan, at every packs-a-thread
         * count; 32768 is the widest register-resident row in 16-bit types,
         * 40000 a packed row wider than any resident plan */
        {dt, 140, 512, 1, 1, 0, 0, 0, 0, 1e-6, 0},
        {dt, 140, 2048, 1, 1, 0, 0, 0, 0, 1e-6, 0},
        {dt, 140, 4096, 1, 1, 0, 0, 0, 0, 1e-6, 0},
        {dt, 3, 4096, 1, 1, 0, 0, 0, 0, 1e-6, 0},
        /* the split backward (no more rows than SMs, dweight summed by
         * column blocks beside the rows' blocks): rows past a block's warps */
        {dt, 100, 4096, 1, 1, 0, 0, 0, 0, 1e-6, 0},
        {dt, 132, 2048, 1, 1, 8, 16, 0, 0, 1e-6, 8},
        {dt, 140, 16384, 1, 1, 0, 0, 0, 0, 1e-6, 0},
        {dt, 3, 16384, 1, 1, 0, 0, 0, 0, 1e-6, 0},
        {dt, 140, 32768, 1, 1, 0, 0, 0, 0, 1e-6, 0},
        {dt, 3, 32768, 0, 0, 0, 0, 0, 0, 1e-6, 0},
        {dt, 140, 40000, 1, 1, 0, 0, 0, 0, 1e-6, 0},
        /* the staged plans with several rows a block (or cluster), so the
         * ring of row stages wraps: padded rows at one pack a thread; 8192
         * (a cluster of 2 in f64); 32768 and 65536 split over clusters of
         * 2-8 CTAs (f64 65536 takes the generic kernel) */
        {dt, 13000, 512, 1, 1, 8, 16, 0, 0, 1e-6, 0},
        {dt, 2000, 8192, 1, 1, 0, 0, 0, 0, 1e-6, 0},
        {dt, 300, 32768, 0, 0, 0, 0, 0, 0, 1e-6, 0},
        {dt, 200, 65536, 1, 1, 0, 0, 0, 0, 1e-6, 0},
    };
    for (size_t i = 0; i < sizeof extra / sizeof extra[0]; i++)
        out[k++] = extra[i];
    return k;
}

HARNESS_GROUP(test_rms_norm)
{
    const int cuda = cuda_begin();
    for (int di = 0; di < OPSMITH_DTYPE_COUNT; di++) {
        const opsmith_dtype dt = (opsmith_dtype)di;
        if (!opsmith_dtype_is_float(dt))
            continue; /* integer dtypes are refused: test_bad_args */
        rms_case cases[96];
        const int count = build_cases(dt, cases);
        test_rng rng = {0xC0FFEEull * (uint64_t)(di + 1)};
        for (int i = 0; i < count; i++) {
            rms_data d;
            data_init(&d, &cases[i], &rng);
            run_cpu(&cases[i], &d);
            if (cuda > 0)
                run_cuda(&cases[i], &d);
            else if (cuda == 0)
                harness_skip(1);
            data_free(&d);
        }
        test_bad_args_cpu(dt);
        if (cuda > 0)
            test_bad_args_cuda(dt);
        else if (cuda == 0)
            harness_skip(1);
    }
    if (cuda > 0)
        test_cuda_plans();
    else if (cuda == 0)
        harness_skip(1);
    cuda_end(cuda);
}
