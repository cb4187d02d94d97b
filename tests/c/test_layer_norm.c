/* LayerNorm launchers (CPU, and CUDA when built with OPSMITH_WITH_CUDA=1)
 * against the float64 scalar reference, for every supported (x, weight)
 * dtype pair.
 *
 * Inputs are drawn in double and rounded into their storage dtype; the
 * reference sees the rounded values, so only a kernel's own arithmetic and
 * output rounding are measured. Outputs start as 0xFF bytes (NaN in every
 * float type) so an unwritten element fails, and sit between guard bytes so
 * a write outside a tensor fails too. A CUDA run copies the same host
 * images to the device whole and back whole, so both backends are judged
 * by exactly the same checks. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#if defined(OPSMITH_WITH_CUDA) && OPSMITH_WITH_CUDA
#define LN_CUDA 1
#include <cuda_runtime_api.h>

#include "internal/layer_norm.h"
#else
#define LN_CUDA 0
#endif

#if defined(__has_include)
#if __has_include(<omp.h>)
#define LN_OMP 1
#endif
#endif
#ifndef LN_OMP
#define LN_OMP 0
#endif

enum { LN_GUARD = 64, LN_GUARD_BYTE = 0x5A, LN_POISON = 0xFF };

static void *ln_malloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "out of host memory (%zu bytes)\n", bytes);
        exit(2);
    }
    return p;
}

/* [lead guard][payload][tail guard]; base == NULL stands for a NULL tensor. */
typedef struct ln_image {
    unsigned char *base;
    size_t lead, bytes, total;
} ln_image;

static ln_image ln_image_new(size_t lead, size_t bytes)
{
    ln_image im = {NULL, lead, bytes, lead + bytes + LN_GUARD};
    im.base = ln_malloc(im.total);
    memset(im.base, LN_GUARD_BYTE, im.total);
    memset(im.base + lead, LN_POISON, bytes);
    return im;
}

static ln_image ln_image_copy(const ln_image *im)
{
    ln_image c = *im;
    if (im->base) {
        c.base = ln_malloc(im->total);
        memcpy(c.base, im->base, im->total);
    }
    return c;
}

static void *ln_img(const ln_image *im) { return im->base ? im->base + im->lead : NULL; }
static void ln_image_free(ln_image *im) { free(im->base), im->base = NULL; }

static int ln_guards_ok(const ln_image *im)
{
    for (size_t i = 0; i < im->total; i++)
        if ((i < im->lead || i >= im->lead + im->bytes) && im->base[i] != LN_GUARD_BYTE)
            return 0;
    return 1;
}

static int ln_untouched(const ln_image *im)
{
    for (size_t i = 0; i < im->bytes; i++)
        if (im->base[im->lead + i] != LN_POISON)
            return 0;
    return ln_guards_ok(im);
}

static int ln_gaps_untouched(const ln_image *im, int64_t rows, int64_t n, int64_t stride, size_t es)
{
    for (int64_t r = 0; r + 1 < rows; r++)
        for (size_t b = (size_t)(r * stride + n) * es; b < (size_t)((r + 1) * stride) * es; b++)
            if (im->base[im->lead + b] != LN_POISON)
                return 0;
    return 1;
}

typedef struct ln_case {
    opsmith_dtype xd, wd;
    int64_t rows, n;
    int weight, bias; /* pass them (else NULL) */
    int grads;        /* pass dweight and dbias buffers */
    int64_t x_pad, dy_pad, out_pad;
    int in_off, out_off; /* start one element past an aligned address */
    double eps;
} ln_case;

/* Inputs, their widened values and the reference results. */
typedef struct ln_data {
    char name[192];
    int64_t xs, dys, ys;
    ln_image x, dy, w, b, mean_in, rstd_in;
    double *xd, *dyd, *wd, *bd, *mean_d, *rstd_d;
    double *y_ref, *mean_ref, *rstd_ref, *dx_ref, *dw_ref, *db_ref;
    double y_scale, mean_scale, rstd_scale, dx_scale, dw_scale, db_scale;
} ln_data;

/* The outputs of one forward and one backward. */
typedef struct ln_outs {
    ln_image y, mean, rstd, dx, dw, db;
} ln_outs;

static double ln_value(test_rng *rng, double shift) { return rng_value(rng) + shift; }

static void ln_fill(opsmith_dtype dt, ln_image *im, double *wide, int64_t rows, int64_t n, int64_t stride,
                    test_rng *rng, double shift)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++) {
            opsmith_store_from_double(dt, ln_img(im), r * stride + i, ln_value(rng, shift));
            wide[r * n + i] = opsmith_load_as_double(dt, ln_img(im), r * stride + i);
        }
}

static void ln_data_init(ln_data *d, const ln_case *c, test_rng *rng)
{
    const opsmith_dtype acc = opsmith_dtype_accumulate(c->xd);
    const size_t es = opsmith_dtype_size(c->xd), ws = opsmith_dtype_size(c->wd), aes = opsmith_dtype_size(acc);
    const int64_t rows = c->rows, n = c->n, count = rows * n;
    memset(d, 0, sizeof *d);
    snprintf(d->name, sizeof d->name,
             "x=%s w=%s rows=%lld n=%lld w=%d b=%d grads=%d pad=%lld/%lld/%lld off=%d/%d eps=%g",
             opsmith_dtype_name(c->xd), opsmith_dtype_name(c->wd), (long long)rows, (long long)n, c->weight,
             c->bias, c->grads, (long long)c->x_pad, (long long)c->dy_pad, (long long)c->out_pad, c->in_off,
             c->out_off, c->eps);
    d->xs = n + c->x_pad, d->dys = n + c->dy_pad, d->ys = n + c->out_pad;
    d->x = ln_image_new(LN_GUARD + (size_t)c->in_off * es, (size_t)(rows * d->xs) * es);
    d->dy = ln_image_new(LN_GUARD + (size_t)c->in_off * es, (size_t)(rows * d->dys) * es);
    d->xd = ln_malloc((size_t)count * sizeof(double));
    d->dyd = ln_malloc((size_t)count * sizeof(double));
    /* x sits off zero (mean ~1.5) so a kernel that does not subtract the
     * mean before squaring loses digits and fails */
    ln_fill(c->xd, &d->x, d->xd, rows, n, d->xs, rng, 1.5);
    ln_fill(c->xd, &d->dy, d->dyd, rows, n, d->dys, rng, 0.0);
    if (c->weight) {
        d->w = ln_image_new(LN_GUARD + (size_t)c->out_off * ws, (size_t)n * ws);
        d->wd = ln_malloc((size_t)n * sizeof(double));
        ln_fill(c->wd, &d->w, d->wd, 1, n, n, rng, 0.0);
    }
    if (c->bias) {
        d->b = ln_image_new(LN_GUARD + (size_t)c->out_off * ws, (size_t)n * ws);
        d->bd = ln_malloc((size_t)n * sizeof(double));
        ln_fill(c->wd, &d->b, d->bd, 1, n, n, rng, 0.0);
    }
    d->y_ref = ln_malloc((size_t)count * sizeof(double));
    d->mean_ref = ln_malloc((size_t)rows * sizeof(double));
    d->rstd_ref = ln_malloc((size_t)rows * sizeof(double));
    opsmith_layer_norm_fwd_reference(rows, n, d->xd, d->wd, d->bd, c->eps, d->y_ref, d->mean_ref, d->rstd_ref);
    /* the backward gets the reference statistics rounded to the accumulate
     * type, so a forward bug cannot hide or cause a backward failure */
    d->mean_in = ln_image_new(LN_GUARD, (size_t)rows * aes);
    d->rstd_in = ln_image_new(LN_GUARD, (size_t)rows * aes);
    d->mean_d = ln_malloc((size_t)rows * sizeof(double));
    d->rstd_d = ln_malloc((size_t)rows * sizeof(double));
    for (int64_t r = 0; r < rows; r++) {
        opsmith_store_from_double(acc, ln_img(&d->mean_in), r, d->mean_ref[r]);
        opsmith_store_from_double(acc, ln_img(&d->rstd_in), r, d->rstd_ref[r]);
        d->mean_d[r] = opsmith_load_as_double(acc, ln_img(&d->mean_in), r);
        d->rstd_d[r] = opsmith_load_as_double(acc, ln_img(&d->rstd_in), r);
    }
    d->dx_ref = ln_malloc((size_t)count * sizeof(double));
    d->dw_ref = ln_malloc((size_t)n * sizeof(double));
    d->db_ref = ln_malloc((size_t)n * sizeof(double));
    opsmith_layer_norm_bwd_reference(rows, n, d->dyd, d->xd, d->wd, d->mean_d, d->rstd_d, d->dx_ref, d->dw_ref,
                                     d->db_ref);
    d->y_scale = fmax(1.0, max_abs(d->y_ref, count));
    d->mean_scale = fmax(1.0, max_abs(d->xd, count));
    d->rstd_scale = fmax(1.0, max_abs(d->rstd_ref, rows));
    d->dw_scale = fmax(1.0, max_abs(d->dw_ref, n));
    d->db_scale = fmax(1.0, max_abs(d->db_ref, n));
    /* dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) cancels (entirely
     * for n == 1): any implementation's rounding error scales with the
     * terms, not with their difference, so they set the scale */
    d->dx_scale = fmax(1.0, max_abs(d->dx_ref, count));
    for (int64_t r = 0; r < rows; r++) {
        const double mu = d->mean_d[r], rs = d->rstd_d[r];
        double sg = 0.0, sgx = 0.0;
        for (int64_t i = 0; i < n; i++) {
            const double g = d->dyd[r * n + i] * (d->wd ? d->wd[i] : 1.0);
            sg += g, sgx += g * (d->xd[r * n + i] - mu) * rs;
        }
        for (int64_t i = 0; i < n; i++) {
            const double g = d->dyd[r * n + i] * (d->wd ? d->wd[i] : 1.0);
            const double xh = (d->xd[r * n + i] - mu) * rs;
            d->dx_scale = fmax(d->dx_scale, fmax(fabs(rs * g), fabs(rs * sg / (double)n)));
            d->dx_scale = fmax(d->dx_scale, fabs(rs * xh * sgx / (double)n));
        }
    }
}

static void ln_data_free(ln_data *d)
{
    ln_image_free(&d->x), ln_image_free(&d->dy), ln_image_free(&d->w), ln_image_free(&d->b);
    ln_image_free(&d->mean_in), ln_image_free(&d->rstd_in);
    free(d->xd), free(d->dyd), free(d->wd), free(d->bd), free(d->mean_d), free(d->rstd_d);
    free(d->y_ref), free(d->mean_ref), free(d->rstd_ref), free(d->dx_ref), free(d->dw_ref), free(d->db_ref);
}

static ln_outs ln_outs_new(const ln_case *c, const ln_data *d)
{
    const size_t es = opsmith_dtype_size(c->xd), ws = opsmith_dtype_size(c->wd);
    const size_t aes = opsmith_dtype_size(opsmith_dtype_accumulate(c->xd));
    const size_t lead = LN_GUARD + (size_t)c->out_off * es, wlead = LN_GUARD + (size_t)c->out_off * ws;
    ln_outs o;
    memset(&o, 0, sizeof o);
    o.y = ln_image_new(lead, (size_t)(c->rows * d->ys) * es);
    o.mean = ln_image_new(LN_GUARD, (size_t)c->rows * aes);
    o.rstd = ln_image_new(LN_GUARD, (size_t)c->rows * aes);
    o.dx = ln_image_new(lead, (size_t)(c->rows * d->ys) * es);
    if (c->grads) {
        o.dw = ln_image_new(wlead, (size_t)c->n * ws);
        o.db = ln_image_new(wlead, (size_t)c->n * ws);
    }
    return o;
}

static void ln_outs_free(ln_outs *o)
{
    ln_image_free(&o->y), ln_image_free(&o->mean), ln_image_free(&o->rstd);
    ln_image_free(&o->dx), ln_image_free(&o->dw), ln_image_free(&o->db);
}

static void ln_close(const char *be, const ln_data *d, const char *what, opsmith_dtype dt, const void *out,
                     const double *ref, int64_t rows, int64_t n, int64_t stride, double tol, double scale)
{
    double worst = 0.0, got_at = 0.0;
    int64_t at = -1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++) {
            const double got = opsmith_load_as_double(dt, out, r * stride + i);
            const double err = isnan(got) ? INFINITY : fabs(got - ref[r * n + i]);
            if (err > worst || at < 0)
                worst = err, at = r * n + i, got_at = got;
        }
    CHECK(worst <= tol * scale, "%s %s: %s max|err| %.3g > %.3g at [%lld] (got %.9g want %.9g)", be, d->name, what,
          worst, tol * scale, (long long)at, got_at, at >= 0 ? ref[at] : 0.0);
}

static void ln_check_fwd(const ln_case *c, const ln_data *d, const char *be, const ln_image *y, int64_t ys,
                         const ln_image *mean, const ln_image *rstd)
{
    const opsmith_dtype acc = opsmith_dtype_accumulate(c->xd);
    CHECK(ln_guards_ok(y), "%s %s: fwd wrote outside y", be, d->name);
    CHECK(ln_gaps_untouched(y, c->rows, c->n, ys, opsmith_dtype_size(c->xd)),
          "%s %s: fwd wrote between the rows of y", be, d->name);
    CHECK(ln_guards_ok(mean) && ln_guards_ok(rstd), "%s %s: fwd wrote outside mean or rstd", be, d->name);
    /* y mixes x's rounding with the weight's: the coarser of the two */
    const double tol = fmax(norm_tol(c->xd), norm_tol(c->wd));
    ln_close(be, d, "y", c->xd, ln_img(y), d->y_ref, c->rows, c->n, ys, tol, d->y_scale);
    ln_close(be, d, "mean", acc, ln_img(mean), d->mean_ref, 1, c->rows, c->rows, norm_tol(acc), d->mean_scale);
    ln_close(be, d, "rstd", acc, ln_img(rstd), d->rstd_ref, 1, c->rows, c->rows, norm_tol(acc), d->rstd_scale);
}

static void ln_check_bwd(const ln_case *c, const ln_data *d, const char *be, const ln_image *dx, int64_t dxs,
                         const ln_image *dw, const ln_image *db)
{
    CHECK(ln_guards_ok(dx), "%s %s: bwd wrote outside dx", be, d->name);
    CHECK(ln_gaps_untouched(dx, c->rows, c->n, dxs, opsmith_dtype_size(c->xd)),
          "%s %s: bwd wrote between the rows of dx", be, d->name);
    const double tol = fmax(norm_tol(c->xd), norm_tol(c->wd));
    ln_close(be, d, "dx", c->xd, ln_img(dx), d->dx_ref, c->rows, c->n, dxs, tol, d->dx_scale);
    if (!dw || !dw->base)
        return;
    /* sums over rows: twice the dtype's tolerance */
    const double gtol = 2.0 * norm_tol(c->wd);
    if (c->weight) {
        CHECK(ln_guards_ok(dw), "%s %s: bwd wrote outside dweight", be, d->name);
        ln_close(be, d, "dweight", c->wd, ln_img(dw), d->dw_ref, 1, c->n, c->n, gtol, d->dw_scale);
    } else {
        CHECK(ln_untouched(dw), "%s %s: dweight written although weight is NULL", be, d->name);
    }
    CHECK(ln_guards_ok(db), "%s %s: bwd wrote outside dbias", be, d->name);
    ln_close(be, d, "dbias", c->wd, ln_img(db), d->db_ref, 1, c->n, c->n, gtol, d->db_scale);
}

static void *ln_workspace(size_t bytes)
{
    const size_t align = OPSMITH_WORKSPACE_ALIGNMENT;
    void *p = aligned_alloc(align, (bytes + 64 + align - 1) / align * align);
    if (!p) {
        fprintf(stderr, "out of host memory (%zu bytes)\n", bytes);
        exit(2);
    }
    return p;
}

/* --- one backend's calls on host images --------------------------------- */

/* Pointers of one call: host images on the CPU, their device copies on CUDA. */
typedef struct ln_ptrs {
    const void *x, *dy, *w, *b, *mean_in, *rstd_in;
    void *y, *mean, *rstd, *dx, *dw, *db;
} ln_ptrs;

static opsmith_status ln_fwd(int cuda, const ln_case *c, const ln_data *d, const ln_ptrs *p, int64_t ys)
{
#if LN_CUDA
    if (cuda)
        return opsmith_layer_norm_fwd_cuda(c->xd, c->wd, c->rows, c->n, p->x, d->xs, p->w, p->b, c->eps, p->y, ys,
                                           p->mean, p->rstd, NULL);
#endif
    (void)cuda;
    return opsmith_layer_norm_fwd_cpu(c->xd, c->wd, c->rows, c->n, p->x, d->xs, p->w, p->b, c->eps, p->y, ys,
                                      p->mean, p->rstd);
}

static size_t ln_ws_size(int cuda, const ln_case *c, const ln_data *d, const ln_ptrs *p, int64_t dxs)
{
#if LN_CUDA
    if (cuda)
        return opsmith_layer_norm_bwd_cuda_workspace_size(c->xd, c->wd, c->rows, c->n, p->dy, d->dys, p->x, d->xs,
                                                          p->w, p->mean_in, p->rstd_in, p->dx, dxs, p->dw, p->db);
#endif
    (void)cuda;
    return opsmith_layer_norm_bwd_cpu_workspace_size(c->xd, c->wd, c->rows, c->n, p->dy, d->dys, p->x, d->xs, p->w,
                                                     p->mean_in, p->rstd_in, p->dx, dxs, p->dw, p->db);
}

static opsmith_status ln_bwd(int cuda, const ln_case *c, const ln_data *d, const ln_ptrs *p, int64_t dxs)
{
    const size_t bytes = ln_ws_size(cuda, c, d, p, dxs);
    opsmith_status st;
#if LN_CUDA
    if (cuda) {
        void *ws = NULL;
        if (bytes && cudaMalloc(&ws, bytes) != cudaSuccess)
            return OPSMITH_STATUS_CUDA_ERROR;
        st = opsmith_layer_norm_bwd_cuda(c->xd, c->wd, c->rows, c->n, p->dy, d->dys, p->x, d->xs, p->w, p->mean_in,
                                         p->rstd_in, p->dx, dxs, p->dw, p->db, ws, bytes, NULL);
        cudaFree(ws);
        return st;
    }
#endif
    void *ws = bytes ? ln_workspace(bytes) : NULL;
    st = opsmith_layer_norm_bwd_cpu(c->xd, c->wd, c->rows, c->n, p->dy, d->dys, p->x, d->xs, p->w, p->mean_in,
                                    p->rstd_in, p->dx, dxs, p->dw, p->db, ws, bytes);
    free(ws);
    return st;
}

#if LN_CUDA
/* Device copies of host images, downloaded back whole after the calls. */
enum { LN_MAX_IMAGES = 16 };
typedef struct ln_device {
    ln_image *host[LN_MAX_IMAGES];
    unsigned char *dev[LN_MAX_IMAGES];
    int count, ok;
} ln_device;

static void *ln_upload(ln_device *dv, ln_image *im)
{
    if (!im->base || !dv->ok)
        return NULL;
    void *p = NULL;
    if (cudaMalloc(&p, im->total) != cudaSuccess ||
        cudaMemcpy(p, im->base, im->total, cudaMemcpyHostToDevice) != cudaSuccess) {
        CHECK(0, "cuda: upload of %zu bytes failed: %s", im->total, cudaGetErrorString(cudaGetLastError()));
        dv->ok = 0;
        cudaFree(p);
        return NULL;
    }
    dv->host[dv->count] = im, dv->dev[dv->count] = p, dv->count++;
    return (unsigned char *)p + im->lead;
}

static int ln_download(ln_device *dv)
{
    int ok = dv->ok;
    for (int k = 0; k < dv->count; k++) {
        if (ok && cudaMemcpy(dv->host[k]->base, dv->dev[k], dv->host[k]->total, cudaMemcpyDeviceToHost) != cudaSuccess)
            ok = CHECK(0, "cuda: download failed: %s", cudaGetErrorString(cudaGetLastError()));
        cudaFree(dv->dev[k]);
    }
    dv->count = 0;
    return ok;
}
#endif

/* The pointers of a call over these images: host, or fresh device copies. */
static ln_ptrs ln_bind(int cuda, void *dv, ln_data *d, ln_image *x, ln_image *dy, ln_outs *o)
{
    ln_ptrs p;
    memset(&p, 0, sizeof p);
#if LN_CUDA
    if (cuda) {
        ln_device *v = dv;
        p.x = ln_upload(v, x), p.dy = ln_upload(v, dy), p.w = ln_upload(v, &d->w), p.b = ln_upload(v, &d->b);
        p.mean_in = ln_upload(v, &d->mean_in), p.rstd_in = ln_upload(v, &d->rstd_in);
        p.y = ln_upload(v, &o->y), p.mean = ln_upload(v, &o->mean), p.rstd = ln_upload(v, &o->rstd);
        p.dx = ln_upload(v, &o->dx), p.dw = ln_upload(v, &o->dw), p.db = ln_upload(v, &o->db);
        return p;
    }
#endif
    (void)cuda, (void)dv;
    p.x = ln_img(x), p.dy = ln_img(dy), p.w = ln_img(&d->w), p.b = ln_img(&d->b);
    p.mean_in = ln_img(&d->mean_in), p.rstd_in = ln_img(&d->rstd_in);
    p.y = ln_img(&o->y), p.mean = ln_img(&o->mean), p.rstd = ln_img(&o->rstd);
    p.dx = ln_img(&o->dx), p.dw = ln_img(&o->dw), p.db = ln_img(&o->db);
    return p;
}

static int ln_finish(int cuda, void *dv)
{
#if LN_CUDA
    if (cuda)
        return ln_download(dv);
#endif
    (void)cuda, (void)dv;
    return 1;
}

static int ln_ok(opsmith_status st, const char *be, const ln_data *d, const char *what)
{
    return CHECK(st == OPSMITH_STATUS_SUCCESS, "%s %s: %s returned \"%s\" (%s)", be, d->name, what,
                 opsmith_status_string(st), opsmith_last_error());
}

static int ln_same(const ln_image *a, const ln_image *b)
{
    return !a->base || memcmp(ln_img(a), ln_img(b), a->bytes) == 0;
}

/* One forward and backward on a backend, an in-place forward and backward,
 * and a repeat (CPU: on other thread counts) that must give the same bits. */
static void ln_run(int cuda, const ln_case *c, ln_data *d)
{
    const char *be = cuda ? "cuda" : "cpu";
#if LN_CUDA
    ln_device dev = {{0}, {0}, 0, 1};
    void *dv = &dev;
#else
    void *dv = NULL;
#endif
    ln_outs a = ln_outs_new(c, d);
    ln_ptrs p = ln_bind(cuda, dv, d, &d->x, &d->dy, &a);
    /* uploads copy the inputs too: the device copies of x and dy must not change */
    opsmith_status sf = ln_fwd(cuda, c, d, &p, d->ys);
    opsmith_status sb = ln_bwd(cuda, c, d, &p, d->ys);
    if (ln_finish(cuda, dv) && ln_ok(sf, be, d, "fwd") && ln_ok(sb, be, d, "bwd")) {
        ln_check_fwd(c, d, be, &a.y, d->ys, &a.mean, &a.rstd);
        ln_check_bwd(c, d, be, &a.dx, d->ys, &a.dw, &a.db);
    }

    /* in place: y over a copy of x, dx over a copy of dy (their row strides) */
    ln_image xy = ln_image_copy(&d->x), dyx = ln_image_copy(&d->dy);
    ln_outs ip = ln_outs_new(c, d);
    ln_ptrs q = ln_bind(cuda, dv, d, &xy, &d->dy, &ip);
    q.y = (void *)q.x;
    sf = ln_fwd(cuda, c, d, &q, d->xs);
    const int fwd_ok = ln_finish(cuda, dv);
    /* the backward reads the original x; dx goes over dy */
    q = ln_bind(cuda, dv, d, &d->x, &dyx, &ip);
    q.dx = (void *)q.dy;
    sb = ln_bwd(cuda, c, d, &q, d->dys);
    if (ln_finish(cuda, dv) && fwd_ok && ln_ok(sf, be, d, "in-place fwd") && ln_ok(sb, be, d, "in-place bwd")) {
        ln_check_fwd(c, d, be, &xy, d->xs, &ip.mean, &ip.rstd);
        ln_check_bwd(c, d, be, &dyx, d->dys, &ip.dw, &ip.db);
    }
    ln_image_free(&xy), ln_image_free(&dyx), ln_outs_free(&ip);

    /* determinism: the same bits again (CPU: on 1 and 3 threads) */
    const int counts[2] = {3, 1};
    const int repeats = cuda || c->rows * c->n > 1000000 ? 1 : 2;
    for (int k = 0; k < repeats; k++) {
        ln_outs t = ln_outs_new(c, d);
#if LN_OMP
        if (!cuda)
            opsmith_set_num_threads(counts[k]);
#else
        (void)counts;
#endif
        ln_ptrs r = ln_bind(cuda, dv, d, &d->x, &d->dy, &t);
        sf = ln_fwd(cuda, c, d, &r, d->ys);
        sb = ln_bwd(cuda, c, d, &r, d->ys);
        opsmith_set_num_threads(0);
        if (ln_finish(cuda, dv) && ln_ok(sf, be, d, "repeat fwd") && ln_ok(sb, be, d, "repeat bwd"))
            CHECK(ln_same(&a.y, &t.y) && ln_same(&a.mean, &t.mean) && ln_same(&a.rstd, &t.rstd) &&
                      ln_same(&a.dx, &t.dx) && ln_same(&a.dw, &t.dw) && ln_same(&a.db, &t.db),
                  "%s %s: outputs differ bitwise between runs (%d threads the second time)", be, d->name,
                  cuda ? 0 : counts[k]);
        ln_outs_free(&t);
    }
    ln_outs_free(&a);
}

/* --- bad arguments -------------------------------------------------------- */

typedef struct ln_call {
    opsmith_dtype xd, wd;
    int64_t rows, n, xs, dys, ys, dxs;
    const void *x, *dy, *w, *b, *mean_in, *rstd_in;
    double eps;
    void *y, *mean, *rstd, *dx, *dw, *db, *ws;
    size_t ws_bytes;
} ln_call;

static opsmith_status ln_call_fwd(int cuda, const ln_call *a)
{
#if LN_CUDA
    if (cuda)
        return opsmith_layer_norm_fwd_cuda(a->xd, a->wd, a->rows, a->n, a->x, a->xs, a->w, a->b, a->eps, a->y, a->ys,
                                           a->mean, a->rstd, NULL);
#endif
    (void)cuda;
    return opsmith_layer_norm_fwd_cpu(a->xd, a->wd, a->rows, a->n, a->x, a->xs, a->w, a->b, a->eps, a->y, a->ys,
                                      a->mean, a->rstd);
}

static opsmith_status ln_call_bwd(int cuda, const ln_call *a)
{
#if LN_CUDA
    if (cuda)
        return opsmith_layer_norm_bwd_cuda(a->xd, a->wd, a->rows, a->n, a->dy, a->dys, a->x, a->xs, a->w, a->mean_in,
                                           a->rstd_in, a->dx, a->dxs, a->dw, a->db, a->ws, a->ws_bytes, NULL);
#endif
    (void)cuda;
    return opsmith_layer_norm_bwd_cpu(a->xd, a->wd, a->rows, a->n, a->dy, a->dys, a->x, a->xs, a->w, a->mean_in,
                                      a->rstd_in, a->dx, a->dxs, a->dw, a->db, a->ws, a->ws_bytes);
}

static void ln_expect(opsmith_status got, opsmith_status want, const char *names, const char *be, const char *what)
{
    const char *msg = opsmith_last_error();
    if (!CHECK(got == want, "layer_norm %s %s: returned \"%s\" (%s), expected \"%s\"", be, what,
               opsmith_status_string(got), msg, opsmith_status_string(want)))
        return;
    if (want == OPSMITH_STATUS_SUCCESS)
        CHECK(msg[0] == '\0', "layer_norm %s %s: succeeded but last_error is \"%s\"", be, what, msg);
    else
        CHECK(strstr(msg, names) != NULL, "layer_norm %s %s: last_error \"%s\" does not name %s", be, what, msg,
              names);
}

#define LN_EXPECT(fn, change, want, names)                                                    \
    do {                                                                                      \
        ln_call a_ = *base;                                                                   \
        a_.change;                                                                            \
        ln_expect(fn(cuda, &a_), want, names, be, #fn " with " #change);                      \
    } while (0)

/* base: a valid call with rows = 2, n = 4, every row stride 4 */
static void ln_bad_args(int cuda, const ln_call *base)
{
    const char *be = cuda ? "cuda" : "cpu";
    const opsmith_status INVALID = OPSMITH_STATUS_INVALID_ARGUMENT, DTYPE = OPSMITH_STATUS_UNSUPPORTED_DTYPE;
    const opsmith_status MISALIGNED = OPSMITH_STATUS_MISALIGNED, SMALL = OPSMITH_STATUS_WORKSPACE_TOO_SMALL;
    const opsmith_status OK = OPSMITH_STATUS_SUCCESS;
    const size_t es = opsmith_dtype_size(base->xd);
    LN_EXPECT(ln_call_fwd, rows = 2, OK, "");
    LN_EXPECT(ln_call_fwd, rows = 0, OK, "");
    LN_EXPECT(ln_call_fwd, w = NULL; a_.b = NULL, OK, "");
    LN_EXPECT(ln_call_fwd, n = 0, INVALID, "n (0)");
    LN_EXPECT(ln_call_fwd, rows = -1, INVALID, "rows (-1)");
    LN_EXPECT(ln_call_fwd, x = NULL, INVALID, "x is NULL");
    LN_EXPECT(ln_call_fwd, y = NULL, INVALID, "y is NULL");
    LN_EXPECT(ln_call_fwd, mean = NULL, INVALID, "mean is NULL");
    LN_EXPECT(ln_call_fwd, rstd = NULL, INVALID, "rstd is NULL");
    LN_EXPECT(ln_call_fwd, xs = 3, INVALID, "x_row_stride (3)");
    LN_EXPECT(ln_call_fwd, ys = 3, INVALID, "y_row_stride (3)");
    LN_EXPECT(ln_call_fwd, eps = -1e-6, INVALID, "eps");
    LN_EXPECT(ln_call_fwd, eps = NAN, INVALID, "eps");
    LN_EXPECT(ln_call_fwd, xd = OPSMITH_DTYPE_I32, DTYPE, "x_dtype");
    LN_EXPECT(ln_call_fwd, xd = (opsmith_dtype)99, DTYPE, "x_dtype");
    LN_EXPECT(ln_call_fwd, wd = OPSMITH_DTYPE_I64, DTYPE, "weight_dtype");
    LN_EXPECT(ln_call_fwd, wd = base->xd == OPSMITH_DTYPE_BF16 ? OPSMITH_DTYPE_F16 : OPSMITH_DTYPE_BF16, DTYPE,
              "weight_dtype");
    LN_EXPECT(ln_call_fwd, x = (const char *)base->x + 1, MISALIGNED, "x (");
    LN_EXPECT(ln_call_fwd, y = (char *)base->y + 1, MISALIGNED, "y (");
    LN_EXPECT(ln_call_fwd, w = (const char *)base->w + 1, MISALIGNED, "weight (");
    LN_EXPECT(ln_call_fwd, b = (const char *)base->b + 1, MISALIGNED, "bias (");
    LN_EXPECT(ln_call_fwd, mean = (char *)base->mean + 1, MISALIGNED, "mean (");
    LN_EXPECT(ln_call_fwd, y = (void *)base->x, OK, "");
    LN_EXPECT(ln_call_fwd, y = (char *)base->x + es; a_.rows = 1, INVALID, "y overlaps x");
    LN_EXPECT(ln_call_fwd, y = (void *)base->x; a_.ys = 5, INVALID, "y overlaps x");
    LN_EXPECT(ln_call_fwd, y = (void *)base->b; a_.rows = 1, INVALID, "y overlaps bias");
    LN_EXPECT(ln_call_fwd, mean = base->y, INVALID, "y overlaps mean");
    /* y may be x, but a weight that is x too is read by every row while y is written */
    LN_EXPECT(ln_call_fwd, y = (void *)base->x; a_.w = base->x, INVALID, "y overlaps weight");
    /* mean and rstd are written beside y: apart from the inputs and each other */
    LN_EXPECT(ln_call_fwd, rstd = base->mean, INVALID, "rstd overlaps mean");
    LN_EXPECT(ln_call_fwd, mean = (void *)base->x, INVALID, "mean overlaps x");

    LN_EXPECT(ln_call_bwd, rows = 2, OK, "");
    LN_EXPECT(ln_call_bwd, rows = 0, OK, "");
    LN_EXPECT(ln_call_bwd, n = 0, INVALID, "n (0)");
    LN_EXPECT(ln_call_bwd, dy = NULL, INVALID, "dy is NULL");
    LN_EXPECT(ln_call_bwd, x = NULL, INVALID, "x is NULL");
    LN_EXPECT(ln_call_bwd, mean_in = NULL, INVALID, "mean is NULL");
    LN_EXPECT(ln_call_bwd, rstd_in = NULL, INVALID, "rstd is NULL");
    LN_EXPECT(ln_call_bwd, dx = NULL, INVALID, "dx is NULL");
    LN_EXPECT(ln_call_bwd, dys = 3, INVALID, "dy_row_stride (3)");
    LN_EXPECT(ln_call_bwd, dxs = 3, INVALID, "dx_row_stride (3)");
    /* no rows: dweight and dbias are still written (zeros), so their alignment is still checked */
    LN_EXPECT(ln_call_bwd, rows = 0; a_.dw = (char *)base->dw + 1, MISALIGNED, "dweight (");
    LN_EXPECT(ln_call_bwd, xd = OPSMITH_DTYPE_COUNT, DTYPE, "x_dtype");
    LN_EXPECT(ln_call_bwd, wd = OPSMITH_DTYPE_I32, DTYPE, "weight_dtype");
    LN_EXPECT(ln_call_bwd, dy = (const char *)base->dy + 1, MISALIGNED, "dy (");
    LN_EXPECT(ln_call_bwd, db = (char *)base->db + 1, MISALIGNED, "dbias (");
    LN_EXPECT(ln_call_bwd, dx = (void *)base->dy; a_.dxs = base->dys, OK, "");
    LN_EXPECT(ln_call_bwd, dx = (void *)base->x, INVALID, "dx overlaps x");
    LN_EXPECT(ln_call_bwd, dx = (char *)base->dy + es; a_.rows = 1, INVALID, "dx overlaps dy");
    LN_EXPECT(ln_call_bwd, db = base->dx, INVALID, "dx overlaps dbias");
    /* dweight and dbias apart from everything (written while the inputs are read) */
    LN_EXPECT(ln_call_bwd, dw = (void *)base->w, INVALID, "dweight overlaps weight");
    LN_EXPECT(ln_call_bwd, dw = (void *)base->x, INVALID, "dweight overlaps x");
    LN_EXPECT(ln_call_bwd, db = (void *)base->dy, INVALID, "dbias overlaps dy");
    LN_EXPECT(ln_call_bwd, db = (void *)base->rstd_in, INVALID, "dbias overlaps rstd");
    LN_EXPECT(ln_call_bwd, db = base->dw, INVALID, "dweight overlaps dbias");
    LN_EXPECT(ln_call_bwd, ws_bytes = base->ws_bytes - 1, SMALL, "workspace_bytes");
    LN_EXPECT(ln_call_bwd, ws = NULL, INVALID, "workspace is NULL");
    LN_EXPECT(ln_call_bwd, ws = (char *)base->ws + 16, MISALIGNED, "workspace (");
    LN_EXPECT(ln_call_bwd, ws = NULL; a_.ws_bytes = 0; a_.dw = NULL; a_.db = NULL, OK, "");
}

static void ln_bad_args_on(int cuda, opsmith_dtype xd, opsmith_dtype wd)
{
    /* doubles: aligned room for every dtype, 2 rows of 4 */
    enum { X, DY, W, B, MEAN, RSTD, Y, DX, DW, DB, COUNT };
    static double host[COUNT][8];
    memset(host, 0, sizeof host);
    void *p[COUNT];
    for (int k = 0; k < COUNT; k++)
        p[k] = host[k];
#if LN_CUDA
    if (cuda)
        for (int k = 0; k < COUNT; k++)
            if (cudaMalloc(&p[k], sizeof host[k]) != cudaSuccess ||
                cudaMemset(p[k], 0, sizeof host[k]) != cudaSuccess) {
                CHECK(0, "cuda bad-args: cudaMalloc failed");
                return;
            }
#endif
    ln_call base = {xd, wd, 2, 4, 4, 4, 4, 4, p[X], p[DY], p[W], p[B], p[MEAN], p[RSTD], 1e-5,
                    p[Y], p[MEAN], p[RSTD], p[DX], p[DW], p[DB], NULL, 0};
#if LN_CUDA
    if (cuda)
        base.ws_bytes = opsmith_layer_norm_bwd_cuda_workspace_size(xd, wd, 2, 4, p[DY], 4, p[X], 4, p[W], p[MEAN],
                                                                   p[RSTD], p[DX], 4, p[DW], p[DB]);
    else
#endif
        base.ws_bytes = opsmith_layer_norm_bwd_cpu_workspace_size(xd, wd, 2, 4, p[DY], 4, p[X], 4, p[W], p[MEAN],
                                                                  p[RSTD], p[DX], 4, p[DW], p[DB]);
    CHECK(base.ws_bytes > 0, "layer_norm %s: a backward with dweight needs a workspace, the size query says 0",
          cuda ? "cuda" : "cpu");
    /* a workspace with 64 bytes to spare, so a misaligned pointer stays inside */
#if LN_CUDA
    if (cuda)
        cudaMalloc(&base.ws, base.ws_bytes + 64);
    else
#endif
        base.ws = ln_workspace(base.ws_bytes);
    ln_bad_args(cuda, &base);
#if LN_CUDA
    if (cuda) {
        cudaFree(base.ws);
        for (int k = 0; k < COUNT; k++)
            cudaFree(p[k]);
        return;
    }
#endif
    free(base.ws);
}

/* --- cases ----------------------------------------------------------------- */

static int ln_cases(opsmith_dtype xd, opsmith_dtype wd, ln_case *out)
{
    const int mixed = xd != wd;
    static const int64_t ns[] = {1, 3, 8, 769, 5125, 8192};
    static const int64_t rows_list[] = {1, 7, 130};
    const ln_case base = {xd, wd, 7, 8, 1, 1, 1, 0, 0, 0, 0, 0, 1e-5};
    int k = 0;
    for (int i = 0; i < 6; i++) {
        for (int j = 0; j < 3; j++)
            if (!mixed || j == 1)
                out[k] = base, out[k].n = ns[i], out[k].rows = rows_list[j], k++;
        out[k] = base, out[k].n = ns[i], out[k].weight = 0, out[k].bias = 0, k++;
        out[k] = base, out[k].n = ns[i], out[k].x_pad = 5, out[k].dy_pad = 3, k++;
    }
    const ln_case extra[] = {
        {xd, wd, 7, 769, 0, 1, 1, 5, 3, 0, 0, 0, 1e-5},      /* bias only, strided */
        {xd, wd, 7, 769, 1, 0, 1, 0, 0, 0, 0, 0, 1e-5},      /* weight only */
        {xd, wd, 130, 769, 1, 1, 0, 0, 0, 0, 0, 0, 1e-5},    /* dx only: no gradient buffers */
        {xd, wd, 7, 8, 0, 0, 1, 0, 0, 0, 0, 0, 1e-5},        /* dweight given, weight NULL: untouched */
        {xd, wd, 7, 8192, 1, 1, 1, 0, 0, 0, 1, 0, 1e-5},     /* x, dy one element off */
        {xd, wd, 7, 1024, 1, 1, 1, 0, 0, 0, 0, 1, 1e-5},     /* weight, bias, outputs one off */
        {xd, wd, 7, 5125, 1, 1, 1, 5, 3, 3, 1, 1, 1e-5},     /* everything off and strided */
        {xd, wd, 7, 8192, 1, 1, 1, 8, 16, 8, 0, 0, 1e-5},    /* padded, 16-byte aligned rows */
        {xd, wd, 7, 8, 1, 1, 1, 0, 0, 0, 0, 0, 0.0},         /* eps = 0 */
        {xd, wd, 130, 8, 1, 1, 1, 0, 0, 0, 0, 0, 0.5},       /* eps comparable to the variance */
        {xd, wd, 2000, 1024, 1, 1, 1, 0, 0, 0, 0, 0, 1e-5},  /* many rows: the gradient sums */
        {xd, wd, 3, 100003, 1, 1, 1, 0, 0, 5, 0, 0, 1e-5},   /* wider than any tile */
        /* CUDA plans: short batches (latency), many rows (throughput and
         * staged), the widest resident rows, a packed row wider than them */
        {xd, wd, 140, 512, 1, 1, 1, 0, 0, 0, 0, 0, 1e-5},
        {xd, wd, 140, 4096, 1, 1, 1, 0, 0, 8, 0, 0, 1e-5},
        {xd, wd, 3, 4096, 1, 1, 1, 0, 0, 0, 0, 0, 1e-5},
        {xd, wd, 3, 16384, 1, 1, 1, 0, 0, 0, 0, 0, 1e-5},
        {xd, wd, 300, 16384, 1, 1, 1, 0, 0, 0, 0, 0, 1e-5},
        {xd, wd, 140, 32768, 1, 1, 1, 0, 0, 0, 0, 0, 1e-5},
        {xd, wd, 140, 40000, 1, 1, 1, 0, 0, 0, 0, 0, 1e-5},
        {xd, wd, 13000, 512, 1, 1, 1, 8, 16, 0, 0, 0, 1e-5},
        {xd, wd, 1000, 4096, 1, 1, 1, 0, 0, 0, 0, 0, 1e-5},
        /* warp rows (forward) and the staged backward at small widths: one
         * pack a row, a few, a ragged last pack per lane, a mixed-dtype size */
        {xd, wd, 300, 8, 1, 1, 1, 0, 0, 0, 0, 0, 1e-5},
        {xd, wd, 300, 24, 1, 1, 1, 0, 0, 0, 0, 0, 1e-5},
        {xd, wd, 300, 512, 1, 1, 1, 0, 0, 0, 0, 0, 1e-5},
        {xd, wd, 290, 1000, 0, 1, 1, 0, 0, 0, 0, 0, 1e-5},
        /* the staged backward split over a cluster (2 CTAs bf16/f16, 4 f32, 8 f64) */
        {xd, wd, 280, 24576, 1, 1, 1, 0, 0, 0, 0, 0, 1e-5},
        /* the ring forward with more rows than its clusters: each walks several */
        {xd, wd, 900, 8192, 1, 1, 1, 0, 0, 0, 0, 0, 1e-5},
    };
    for (size_t i = 0; i < sizeof extra / sizeof extra[0]; i++)
        /* the largest shapes for the same-dtype pairs only: keeps the run short */
        if (extra[i].rows * extra[i].n <= (mixed ? 300000 : 8000000))
            out[k++] = extra[i];
    return k;
}

#if LN_CUDA
static int ln_cuda_begin(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        cudaGetLastError();
        return 0;
    }
    return 1;
}

static void ln_cuda_plans(void)
{
    static const struct {
        opsmith_dtype xd, wd;
        int64_t rows, n;
        int backward;
        const char *family;
    } plans[] = {
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16, 3, 4096, 0, "resident"},
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_F32, 3, 4096, 1, "split"},      /* a short batch: one launch */
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16, 2000, 4096, 0, "resident"},
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16, 300, 16384, 0, "ring"},      /* more rows than SMs, >= 1024 packs */
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16, 300, 4096, 0, "resident"},   /* 512 packs */
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16, 100, 16384, 0, "resident"},  /* fewer rows than SMs */
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16, 140, 32768, 0, "ring"},      /* 64 KB: one CTA a row */
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16, 140, 40000, 0, "ring"},
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16, 140, 40004, 0, "generic"},   /* not whole packs */
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16, 13000, 512, 0, "warp"},
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16, 2000, 1024, 0, "warp"},
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_F32, 300, 8, 0, "warp"},
        {OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32, 2000, 1024, 0, "resident"},
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16, 13000, 512, 1, "staged"},
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_F32, 1000, 4096, 1, "staged"},
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_F32, 300, 512, 1, "staged"},
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16, 300, 16384, 1, "staged"},
        {OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32, 300, 16384, 1, "staged"},    /* cluster of 2 */
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16, 280, 24576, 1, "staged"},  /* cluster of 2 */
        {OPSMITH_DTYPE_F64, OPSMITH_DTYPE_F64, 280, 24576, 1, "staged"},    /* cluster of 8 */
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16, 140, 40000, 1, "staged"},  /* cluster of 4 */
        {OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32, 140, 4096, 1, "resident"},   /* under 2 rows an SM */
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16, 140, 32768, 1, "staged"},  /* cluster of 2 */
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16, 3, 32768, 1, "split"},     /* no sums in shared memory */
        {OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32, 3, 65536, 1, "generic"},     /* 16384 packs: past the resident plan */
        {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16, 300, 100003, 1, "generic"},
    };
    for (size_t i = 0; i < sizeof plans / sizeof plans[0]; i++) {
        const char *got = opsmith_internal_layer_norm_cuda_plan(plans[i].xd, plans[i].wd, plans[i].rows, plans[i].n,
                                                                plans[i].backward);
        CHECK(strcmp(got, plans[i].family) == 0, "layer_norm cuda plan x=%s w=%s %lld x %lld %s: got %s, want %s",
              opsmith_dtype_name(plans[i].xd), opsmith_dtype_name(plans[i].wd), (long long)plans[i].rows,
              (long long)plans[i].n, plans[i].backward ? "bwd" : "fwd", got, plans[i].family);
    }
}
#endif

HARNESS_GROUP(test_layer_norm)
{
#if LN_CUDA
    const int cuda = ln_cuda_begin();
    if (!cuda)
        printf("layer_norm: skipping CUDA cases (no device)\n");
#else
    const int cuda = 0;
    /* a library without CUDA says so, naming the launcher */
    double x[8] = {1, 2, 3, 4, 5, 6, 7, 8}, y[8], m[2], r[2];
    opsmith_status st = opsmith_layer_norm_fwd_cuda(OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32, 2, 4, x, 4, NULL, NULL,
                                                    1e-5, y, 4, m, r, NULL);
    CHECK(st == OPSMITH_STATUS_CUDA_UNAVAILABLE && strstr(opsmith_last_error(), "layer_norm_fwd_cuda"),
          "layer_norm_fwd_cuda without CUDA: \"%s\" (%s)", opsmith_status_string(st), opsmith_last_error());
#endif
    static const opsmith_dtype pairs[][2] = {
        {OPSMITH_DTYPE_F64, OPSMITH_DTYPE_F64},   {OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32},
        {OPSMITH_DTYPE_F16, OPSMITH_DTYPE_F16},   {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16},
        {OPSMITH_DTYPE_F16, OPSMITH_DTYPE_F32},   {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_F32},
        {OPSMITH_DTYPE_F64, OPSMITH_DTYPE_F32},
    };
    for (size_t pi = 0; pi < sizeof pairs / sizeof pairs[0]; pi++) {
        ln_case cases[64];
        const int count = ln_cases(pairs[pi][0], pairs[pi][1], cases);
        test_rng rng = {0x1A7E4ull * (uint64_t)(pi + 1)};
        for (int i = 0; i < count; i++) {
            ln_data d;
            ln_data_init(&d, &cases[i], &rng);
            ln_run(0, &cases[i], &d);
            if (cuda)
                ln_run(1, &cases[i], &d);
            else
                harness_skip(LN_CUDA);
            ln_data_free(&d);
        }
        ln_bad_args_on(0, pairs[pi][0], pairs[pi][1]);
        if (cuda)
            ln_bad_args_on(1, pairs[pi][0], pairs[pi][1]);
    }
#if LN_CUDA
    if (cuda)
        ln_cuda_plans();
#endif
}
