/* AdamW launchers (CPU, and CUDA when built with OPSMITH_WITH_CUDA=1)
 * against the float64 scalar reference: several steps over a list of mixed
 * sizes (1 element, odd sizes, a tensor across a chunk boundary, an exact
 * chunk multiple, an empty tensor), every param mode (f32; bf16 with f32
 * masters; bf16 and f16 rounded each step), f32 and bf16 grads, amsgrad,
 * maximize, weight decay, lr from a device scalar, clipping by the fused
 * global norm, and buffers one element off 16-byte alignment (the scalar
 * paths). The reference sees the stored values widened to double; every
 * element of every role is compared after every step. */
#include <math.h>

#include "rms_norm_cases.h" /* xmalloc, TEST_CUDA */

#if TEST_CUDA
#include <cuda_runtime_api.h>
#endif

#define NT 9
static const int64_t SIZES[NT] = {1, 7, 4, 33, 1000, OPSMITH_ADAMW_CHUNK + 5, 3, 2 * OPSMITH_ADAMW_CHUNK, 0};

typedef struct mode {
    opsmith_dtype pdt, gdt;
    int master, amsgrad, maximize;
    double wd;
    int clip, lr_tensor, off; /* off: every buffer one element past 16-byte alignment */
} mode;

/* One backend's copy of the lists: per tensor, each role's buffer. */
typedef struct lists {
    void *p[NT], *g[NT];
    float *m[NT], *v[NT], *x[NT], *w[NT], *step[NT];
} lists;

/* the double state the reference advances */
typedef struct refstate {
    double *p[NT], *g[NT], *m[NT], *v[NT], *x[NT];
    double step[NT];
} refstate;

static void *alloc_host(size_t bytes, int off, size_t es) { return (char *)xmalloc(bytes + 64) + 16 + off * es; }

static void fill_inputs(const mode *md, lists *h, refstate *r, test_rng *rng) {
    const size_t pes = opsmith_dtype_size(md->pdt), ges = opsmith_dtype_size(md->gdt);
    for (int t = 0; t < NT; t++) {
        const int64_t n = SIZES[t];
        h->p[t] = alloc_host(n * pes, md->off, pes);
        h->g[t] = alloc_host(n * ges, md->off, ges);
        h->m[t] = alloc_host(n * 4, md->off, 4);
        h->v[t] = alloc_host(n * 4, md->off, 4);
        h->x[t] = md->amsgrad ? alloc_host(n * 4, md->off, 4) : NULL;
        h->w[t] = md->master ? alloc_host(n * 4, md->off, 4) : NULL;
        h->step[t] = xmalloc(4);
        *h->step[t] = (float)(1 + t % 3); /* tensors at different step counts */
        r->step[t] = *h->step[t];
        r->p[t] = xmalloc((n + 1) * 8), r->g[t] = xmalloc((n + 1) * 8), r->m[t] = xmalloc((n + 1) * 8);
        r->v[t] = xmalloc((n + 1) * 8), r->x[t] = xmalloc((n + 1) * 8);
        for (int64_t i = 0; i < n; i++) {
            const double p = rng_value(rng), m = 0.1 * rng_value(rng), v = 0.01 * (0.05 + rng_uniform(rng));
            if (md->master) {
                h->w[t][i] = (float)p;
                r->p[t][i] = h->w[t][i];
                opsmith_store_from_double(md->pdt, h->p[t], i, r->p[t][i]);
            } else {
                opsmith_store_from_double(md->pdt, h->p[t], i, p);
                r->p[t][i] = opsmith_load_as_double(md->pdt, h->p[t], i);
            }
            h->m[t][i] = (float)m, r->m[t][i] = h->m[t][i];
            h->v[t][i] = (float)v, r->v[t][i] = h->v[t][i];
            if (md->amsgrad) h->x[t][i] = (float)(v * (0.5 + rng_uniform(rng))), r->x[t][i] = h->x[t][i];
        }
    }
}

static void new_grads(const mode *md, lists *h, refstate *r, test_rng *rng) {
    for (int t = 0; t < NT; t++)
        for (int64_t i = 0; i < SIZES[t]; i++) {
            opsmith_store_from_double(md->gdt, h->g[t], i, 0.3 * rng_value(rng));
            r->g[t][i] = opsmith_load_as_double(md->gdt, h->g[t], i);
        }
}

/* max |got - want| / (tol_abs + tol_rel * |want|) over a role; <= 1 passes */
static double worst(double got, double want, double rel, double abs_) {
    const double e = fabs(got - want);
    if (isnan(got) || isnan(want)) return isnan(got) && isnan(want) ? 0 : INFINITY;
    return e / (abs_ + rel * fabs(want));
}

static void compare(const mode *md, const lists *h, const refstate *r, double lr, const char *dev, int step) {
    double wp = 0, wm = 0, wv = 0, wx = 0, wr = 0;
    int exact = 1;
    const int rounded = md->pdt != OPSMITH_DTYPE_F32 && !md->master;
    const double prel = rounded ? (md->pdt == OPSMITH_DTYPE_BF16 ? 1.0 / 256 : 1.0 / 2048) : 4e-6;
    for (int t = 0; t < NT; t++)
        for (int64_t i = 0; i < SIZES[t]; i++) {
            const double want = r->p[t][i];
            if (md->master) {
                wp = fmax(wp, worst(h->w[t][i], want, 4e-6, 2e-4 * lr));
                /* the param is the master rounded, bit for bit */
                uint16_t bits;
                opsmith_store_from_double(md->pdt, &bits, 0, h->w[t][i]);
                exact &= bits == ((const uint16_t *)h->p[t])[i];
            } else {
                wp = fmax(wp, worst(opsmith_load_as_double(md->pdt, h->p[t], i), want, prel, 2e-4 * lr));
            }
            wm = fmax(wm, worst(h->m[t][i], r->m[t][i], 4e-6, 1e-7));
            wv = fmax(wv, worst(h->v[t][i], r->v[t][i], 4e-6, 1e-9));
            if (md->amsgrad) wx = fmax(wx, worst(h->x[t][i], r->x[t][i], 4e-6, 1e-9));
        }
    wr = fmax(fmax(wp, wm), fmax(wv, wx));
    CHECK(wr <= 1.0 && exact,
          "%s adamw step %d (param %s%s, grad %s, amsgrad %d, maximize %d, wd %g, clip %d, lr_tensor %d, off %d): "
          "error/tol p %.3g m %.3g v %.3g vmax %.3g%s",
          dev, step, opsmith_dtype_name(md->pdt), md->master ? "+master" : "", opsmith_dtype_name(md->gdt),
          md->amsgrad, md->maximize, md->wd, md->clip, md->lr_tensor, md->off, wp, wm, wv, wx,
          exact ? "" : "; param != rounded master");
}

static const double LR = 1e-2, B1 = 0.9, B2 = 0.999, EPS = 1e-8, MAX_NORM = 0.5;

/* the reference step, clipping included; returns the reference norm */
static double reference_step(const mode *md, refstate *r) {
    const double norm = opsmith_adamw_grad_norm_reference(NT, SIZES, (const double *const *)r->g);
    double coef = 1.0;
    if (md->clip) {
        coef = MAX_NORM / (norm + 1e-6);
        if (coef > 1.0) coef = 1.0;
    }
    for (int t = 0; t < NT; t++) r->step[t] += 1;
    opsmith_adamw_step_reference(NT, SIZES, r->p, (const double *const *)r->g, r->m, r->v, r->x, r->step, LR, B1,
                                 B2, EPS, md->wd, md->amsgrad, md->maximize, coef);
    return norm;
}

static float adamw_run_cpu(const mode *md, lists *h) {
    float lr = (float)LR, norm = -1, coef = -1;
    float *coef_p = md->clip ? &coef : NULL;
    const size_t ws = opsmith_adamw_grad_norm_cpu_workspace_size(NT, SIZES);
    void *work = aligned_alloc(OPSMITH_WORKSPACE_ALIGNMENT, (ws + 63) / 64 * 64 + 64);
    opsmith_status s = opsmith_adamw_grad_norm_cpu(NT, SIZES, md->gdt, (const void *const *)h->g, MAX_NORM, &norm,
                                                   coef_p, work, ws);
    CHECK(s == OPSMITH_STATUS_SUCCESS, "cpu norm: %s (%s)", opsmith_status_string(s), opsmith_last_error());
    free(work);
    for (int t = 0; t < NT; t++) *h->step[t] += 1;
    s = opsmith_adamw_step_cpu(NT, SIZES, md->pdt, md->gdt, h->p, (const void *const *)h->g, h->m, h->v,
                               md->amsgrad ? h->x : NULL, md->master ? h->w : NULL, (const float *const *)h->step,
                               md->lr_tensor ? -1.0 : LR, md->lr_tensor ? &lr : NULL, B1, B2, EPS, md->wd,
                               md->amsgrad, md->maximize, coef_p);
    CHECK(s == OPSMITH_STATUS_SUCCESS, "cpu step: %s (%s)", opsmith_status_string(s), opsmith_last_error());
    return norm;
}

#if TEST_CUDA
static void *to_dev(const void *host, size_t bytes, int off, size_t es) {
    char *d = NULL;
    if (cudaMalloc((void **)&d, bytes + 64) != cudaSuccess) return NULL;
    d += 16 + off * es;
    if (bytes) cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice);
    return d;
}
static void back(void *host, const void *dev, size_t bytes) {
    if (bytes) cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost);
}
static void dev_free(void *d, int off, size_t es) {
    if (d) cudaFree((char *)d - 16 - off * es);
}

/* one step on the device from the host lists' current values, results copied back */
static float adamw_run_cuda(const mode *md, lists *h) {
    const size_t pes = opsmith_dtype_size(md->pdt), ges = opsmith_dtype_size(md->gdt);
    lists d;
    for (int t = 0; t < NT; t++) {
        const int64_t n = SIZES[t];
        *h->step[t] += 1;
        d.p[t] = to_dev(h->p[t], n * pes, md->off, pes);
        d.g[t] = to_dev(h->g[t], n * ges, md->off, ges);
        d.m[t] = to_dev(h->m[t], n * 4, md->off, 4);
        d.v[t] = to_dev(h->v[t], n * 4, md->off, 4);
        d.x[t] = md->amsgrad ? to_dev(h->x[t], n * 4, md->off, 4) : NULL;
        d.w[t] = md->master ? to_dev(h->w[t], n * 4, md->off, 4) : NULL;
        d.step[t] = to_dev(h->step[t], 4, 0, 4);
    }
    float host3[3] = {(float)LR, -1.0f, -1.0f}; /* lr, norm, coef */
    float *dev3 = to_dev(host3, 12, 0, 4);
    const size_t ws = opsmith_adamw_grad_norm_cuda_workspace_size(NT, SIZES);
    void *work = NULL;
    cudaMalloc(&work, ws);
    cudaMemset(work, 0xFF, ws);
    opsmith_status s = opsmith_adamw_grad_norm_cuda(NT, SIZES, md->gdt, (const void *const *)d.g, MAX_NORM, dev3 + 1,
                                                    md->clip ? dev3 + 2 : NULL, work, ws, NULL);
    CHECK(s == OPSMITH_STATUS_SUCCESS, "cuda norm: %s (%s)", opsmith_status_string(s), opsmith_last_error());
    s = opsmith_adamw_step_cuda(NT, SIZES, md->pdt, md->gdt, d.p, (const void *const *)d.g, d.m, d.v,
                                md->amsgrad ? d.x : NULL, md->master ? d.w : NULL, (const float *const *)d.step,
                                md->lr_tensor ? -1.0 : LR, md->lr_tensor ? dev3 : NULL, B1, B2, EPS, md->wd,
                                md->amsgrad, md->maximize, md->clip ? dev3 + 2 : NULL, NULL);
    CHECK(s == OPSMITH_STATUS_SUCCESS, "cuda step: %s (%s)", opsmith_status_string(s), opsmith_last_error());
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "cuda adamw: kernel failed");
    back(host3, dev3, 12);
    for (int t = 0; t < NT; t++) {
        const int64_t n = SIZES[t];
        back(h->p[t], d.p[t], n * pes), back(h->m[t], d.m[t], n * 4), back(h->v[t], d.v[t], n * 4);
        if (md->amsgrad) back(h->x[t], d.x[t], n * 4);
        if (md->master) back(h->w[t], d.w[t], n * 4);
        dev_free(d.p[t], md->off, pes), dev_free(d.g[t], md->off, ges), dev_free(d.m[t], md->off, 4);
        dev_free(d.v[t], md->off, 4), dev_free(d.x[t], md->off, 4), dev_free(d.w[t], md->off, 4);
        dev_free(d.step[t], 0, 4);
    }
    dev_free(dev3, 0, 4);
    cudaFree(work);
    return host3[1];
}

/* 1000 tensors, three launches' worth of tensor slots (the launches of one
 * call overlap on sm_90), carved 16-byte aligned out of one device buffer a
 * role, one of them several chunks long: one fp32 step, read back as soon
 * as the stream is done, against the reference */
static void test_cuda_many_launches(void) {
    enum { COUNT = 1000 };
    static int64_t sizes[COUNT];
    static size_t at[COUNT];
    static void *dp[COUNT];
    static const void *dg[COUNT];
    static float *dm[COUNT], *dv[COUNT];
    static const float *dstep[COUNT];
    static double *rp[COUNT], *rg[COUNT], *rm[COUNT], *rv[COUNT], *rx[COUNT], rstep[COUNT];
    test_rng rng = {4242};
    size_t total = 0;
    for (int t = 0; t < COUNT; t++) {
        sizes[t] = t == 500 ? 3 * OPSMITH_ADAMW_CHUNK + 5 : 1 + (int64_t)(rng_uniform(&rng) * 300);
        at[t] = total;
        total += (size_t)(sizes[t] + 3) / 4 * 4;
    }
    float *h[4], *d[4], *steps_h = xmalloc(COUNT * 4), *steps_d = NULL;
    double *ref[4];
    for (int q = 0; q < 4; q++) {
        h[q] = xmalloc(total * 4), ref[q] = xmalloc(total * 8), d[q] = NULL;
        cudaMalloc((void **)&d[q], total * 4);
    }
    double *rx_all = xmalloc(total * 8);
    cudaMalloc((void **)&steps_d, COUNT * 4);
    for (size_t i = 0; i < total; i++) {
        h[0][i] = (float)rng_value(&rng), h[1][i] = (float)(0.3 * rng_value(&rng));
        h[2][i] = (float)(0.1 * rng_value(&rng)), h[3][i] = (float)(0.01 * (0.05 + rng_uniform(&rng)));
        for (int q = 0; q < 4; q++) ref[q][i] = h[q][i];
    }
    for (int t = 0; t < COUNT; t++) {
        steps_h[t] = (float)(2 + t % 3), rstep[t] = steps_h[t];
        dp[t] = d[0] + at[t], dg[t] = d[1] + at[t], dm[t] = d[2] + at[t], dv[t] = d[3] + at[t];
        dstep[t] = steps_d + t;
        rp[t] = ref[0] + at[t], rg[t] = ref[1] + at[t], rm[t] = ref[2] + at[t], rv[t] = ref[3] + at[t];
        rx[t] = rx_all + at[t];
    }
    for (int q = 0; q < 4; q++) cudaMemcpy(d[q], h[q], total * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(steps_d, steps_h, COUNT * 4, cudaMemcpyHostToDevice);
    opsmith_status s = opsmith_adamw_step_cuda(COUNT, sizes, OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32, dp, dg, dm, dv,
                                               NULL, NULL, dstep, LR, NULL, B1, B2, EPS, 0.01, 0, 0, NULL, NULL);
    CHECK(s == OPSMITH_STATUS_SUCCESS, "cuda step, %d tensors: %s (%s)", COUNT, opsmith_status_string(s),
          opsmith_last_error());
    for (int q = 0; q < 4; q++) cudaMemcpy(h[q], d[q], total * 4, cudaMemcpyDeviceToHost);
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "cuda adamw, %d tensors: kernel failed", COUNT);
    opsmith_adamw_step_reference(COUNT, sizes, rp, (const double *const *)rg, rm, rv, rx, rstep, LR, B1, B2, EPS,
                                 0.01, 0, 0, 1.0);
    double wp = 0, wm = 0, wv = 0;
    for (int t = 0; t < COUNT; t++)
        for (int64_t i = 0; i < sizes[t]; i++) {
            const size_t k = at[t] + (size_t)i;
            wp = fmax(wp, worst(h[0][k], rp[t][i], 4e-6, 2e-4 * LR));
            wm = fmax(wm, worst(h[2][k], rm[t][i], 4e-6, 1e-7));
            wv = fmax(wv, worst(h[3][k], rv[t][i], 4e-6, 1e-9));
        }
    CHECK(fmax(wp, fmax(wm, wv)) <= 1.0, "cuda adamw, %d tensors in one call: error/tol p %.3g m %.3g v %.3g",
          COUNT, wp, wm, wv);
    for (int q = 0; q < 4; q++) free(h[q]), free(ref[q]), cudaFree(d[q]);
    free(rx_all), free(steps_h), cudaFree(steps_d);
}

static int adamw_cuda_present(void) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        cudaGetLastError();
        return 0;
    }
    return 1;
}
#endif

static void free_all(const mode *md, lists *h, refstate *r) {
    const size_t pes = opsmith_dtype_size(md->pdt), ges = opsmith_dtype_size(md->gdt);
    for (int t = 0; t < NT; t++) {
        free((char *)h->p[t] - 16 - md->off * pes), free((char *)h->g[t] - 16 - md->off * ges);
        free((char *)h->m[t] - 16 - md->off * 4), free((char *)h->v[t] - 16 - md->off * 4);
        if (h->x[t]) free((char *)h->x[t] - 16 - md->off * 4);
        if (h->w[t]) free((char *)h->w[t] - 16 - md->off * 4);
        free(h->step[t]);
        free(r->p[t]), free(r->g[t]), free(r->m[t]), free(r->v[t]), free(r->x[t]);
    }
}

/* Three steps of one mode on one backend (cuda = 1: the CUDA launchers). */
static void run_mode(const mode *md, int cuda, uint64_t seed) {
    test_rng rng = {seed};
    lists h;
    refstate r;
    memset(&h, 0, sizeof h);
    fill_inputs(md, &h, &r, &rng);
    const char *dev = cuda ? "cuda" : "cpu";
    for (int step = 1; step <= 3; step++) {
        new_grads(md, &h, &r, &rng);
        const double want = reference_step(md, &r);
        double got;
#if TEST_CUDA
        if (cuda) got = adamw_run_cuda(md, &h);
        else
#endif
            got = adamw_run_cpu(md, &h);
        CHECK(fabs(got - want) <= 2e-6 * want, "%s grad norm (grad %s): %.9g, reference %.9g", dev,
              opsmith_dtype_name(md->gdt), got, want);
        compare(md, &h, &r, LR, dev, step);
        /* a param rounded every step: the next step starts from what was stored */
        if (md->pdt != OPSMITH_DTYPE_F32 && !md->master)
            for (int t = 0; t < NT; t++)
                for (int64_t i = 0; i < SIZES[t]; i++) r.p[t][i] = opsmith_load_as_double(md->pdt, h.p[t], i);
    }
    free_all(md, &h, &r);
}

static void expect(opsmith_status got, opsmith_status want, const char *needle, const char *what) {
    CHECK(got == want && strstr(opsmith_last_error(), needle), "%s: got %s (%s), want %s with \"%s\"", what,
          opsmith_status_string(got), opsmith_last_error(), opsmith_status_string(want), needle);
}

static void test_errors(void) {
    const opsmith_status BAD = OPSMITH_STATUS_INVALID_ARGUMENT;
    const opsmith_dtype F = OPSMITH_DTYPE_F32, B = OPSMITH_DTYPE_BF16;
    float a[8] = {0}, b[8] = {0}, c[8] = {0}, d[8] = {0}, st = 1.0f, norm, coef;
    int64_t n[1] = {8}, neg[1] = {-1};
    void *p[1] = {a};
    const void *g[1] = {b};
    float *m[1] = {c}, *v[1] = {d}, *none[1] = {NULL};
    const float *s[1] = {&st};
    expect(opsmith_adamw_step_cpu(1, n, OPSMITH_DTYPE_F64, F, p, g, m, v, NULL, NULL, s, 1e-3, NULL, .9, .999, 1e-8,
                                  0, 0, 0, NULL),
           OPSMITH_STATUS_UNSUPPORTED_DTYPE, "param_dtype must be f32, bf16 or f16, got f64", "f64 params");
    expect(opsmith_adamw_step_cpu(1, n, F, OPSMITH_DTYPE_I32, p, g, m, v, NULL, NULL, s, 1e-3, NULL, .9, .999, 1e-8,
                                  0, 0, 0, NULL),
           OPSMITH_STATUS_UNSUPPORTED_DTYPE, "grad_dtype", "i32 grads");
    expect(opsmith_adamw_step_cpu(1, n, F, F, p, g, m, v, NULL, m, s, 1e-3, NULL, .9, .999, 1e-8, 0, 0, 0, NULL), BAD,
           "master_params must be NULL for f32 params", "masters for f32 params");
    expect(opsmith_adamw_step_cpu(1, n, F, F, p, g, m, v, NULL, NULL, s, 1e-3, NULL, .9, .999, 1e-8, 0, 1, 0, NULL),
           BAD, "max_exp_avg_sqs is NULL", "amsgrad without max_exp_avg_sqs");
    expect(opsmith_adamw_step_cpu(1, n, F, F, p, g, m, v, none, NULL, s, 1e-3, NULL, .9, .999, 1e-8, 0, 1, 0, NULL),
           BAD, "max_exp_avg_sqs[0] is NULL", "amsgrad with a NULL tensor");
    expect(opsmith_adamw_step_cpu(1, n, F, F, p, g, m, NULL, NULL, NULL, s, 1e-3, NULL, .9, .999, 1e-8, 0, 0, 0, NULL),
           BAD, "exp_avg_sqs is NULL", "NULL exp_avg_sqs");
    expect(opsmith_adamw_step_cpu(1, neg, F, F, p, g, m, v, NULL, NULL, s, 1e-3, NULL, .9, .999, 1e-8, 0, 0, 0, NULL),
           BAD, "numels[0] (-1) must be >= 0", "negative numel");
    expect(opsmith_adamw_step_cpu(1, n, F, F, p, g, m, v, NULL, NULL, s, 1e-3, NULL, 1.0, .999, 1e-8, 0, 0, 0, NULL),
           BAD, "beta1 (1) must be in [0, 1)", "beta1 = 1");
    expect(opsmith_adamw_step_cpu(1, n, F, F, p, g, m, v, NULL, NULL, s, -1.0, NULL, .9, .999, 1e-8, 0, 0, 0, NULL),
           BAD, "lr (-1) must be >= 0", "negative lr");
    void *mis[1] = {(char *)a + 2};
    expect(opsmith_adamw_step_cpu(1, n, F, F, mis, g, m, v, NULL, NULL, s, 1e-3, NULL, .9, .999, 1e-8, 0, 0, 0, NULL),
           OPSMITH_STATUS_MISALIGNED, "params[0]", "misaligned param");
    /* a refused call writes nothing */
    CHECK(a[0] == 0 && c[0] == 0 && d[0] == 0, "a refused call wrote its tensors");
    expect(opsmith_adamw_step_cpu(0, NULL, F, B, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 1e-3, NULL, .9, .999, 1e-8,
                                  0, 0, 0, NULL),
           OPSMITH_STATUS_SUCCESS, "", "empty list");
    CHECK(opsmith_last_error()[0] == 0, "success must empty opsmith_last_error()");
    _Alignas(64) double ws[8];
    expect(opsmith_adamw_grad_norm_cpu(1, n, F, g, 1.0, &norm, &coef, NULL, 0), BAD, "workspace is NULL",
           "norm without workspace");
    expect(opsmith_adamw_grad_norm_cpu(1, n, F, g, 1.0, &norm, &coef, ws, 4), OPSMITH_STATUS_WORKSPACE_TOO_SMALL,
           "workspace_bytes (4) must be >= 8", "small workspace");
    expect(opsmith_adamw_grad_norm_cpu(1, n, F, g, 0.0, &norm, &coef, ws, 8), BAD, "max_norm (0) must be > 0",
           "max_norm 0");
    expect(opsmith_adamw_grad_norm_cpu(1, n, F, g, 1.0, NULL, &coef, ws, 8), BAD, "norm is NULL", "NULL norm");
    /* an empty list: norm 0, coefficient 1 */
    expect(opsmith_adamw_grad_norm_cpu(0, NULL, F, NULL, 1.0, &norm, &coef, NULL, 0), OPSMITH_STATUS_SUCCESS, "",
           "empty norm");
    CHECK(norm == 0.0f && coef == 1.0f, "empty list: norm %g coef %g", norm, coef);
    CHECK(opsmith_adamw_grad_norm_cpu_workspace_size(2, (int64_t[]){OPSMITH_ADAMW_CHUNK + 1, 3}) == 3 * sizeof(double),
          "workspace size: one double per chunk");
    /* a NaN gradient gives a NaN norm and coefficient */
    b[3] = NAN;
    opsmith_adamw_grad_norm_cpu(1, n, F, g, 1.0, &norm, &coef, ws, 8);
    CHECK(isnan(norm) && isnan(coef), "NaN grad: norm %g coef %g", norm, coef);
#if !TEST_CUDA
    expect(opsmith_adamw_step_cuda(1, n, F, F, p, g, m, v, NULL, NULL, s, 1e-3, NULL, .9, .999, 1e-8, 0, 0, 0, NULL,
                                   NULL),
           OPSMITH_STATUS_CUDA_UNAVAILABLE, "built without CUDA", "cuda stand-in step");
    expect(opsmith_adamw_grad_norm_cuda(1, n, F, g, 1.0, &norm, &coef, ws, 8, NULL), OPSMITH_STATUS_CUDA_UNAVAILABLE,
           "built without CUDA", "cuda stand-in norm");
#else
    expect(opsmith_adamw_step_cuda(1, n, OPSMITH_DTYPE_F64, F, p, g, m, v, NULL, NULL, s, 1e-3, NULL, .9, .999, 1e-8,
                                   0, 0, 0, NULL, NULL),
           OPSMITH_STATUS_UNSUPPORTED_DTYPE, "param_dtype", "cuda: f64 params");
#endif
}

/* increment_steps adds exactly 1 to every counter, also past one CUDA
 * launch's table (3840 counters), and refuses NULL entries */
static void test_increment_steps(int cuda) {
    enum { N = 9000 };
    float *host = xmalloc(N * sizeof(float));
    float **ptrs = xmalloc(N * sizeof(float *));
    for (int i = 0; i < N; i++) host[i] = (float)(i % 97) + 0.5f;
    if (!cuda) {
        for (int i = 0; i < N; i++) ptrs[i] = host + i;
        CHECK(opsmith_adamw_increment_steps_cpu(N, ptrs) == OPSMITH_STATUS_SUCCESS, "cpu increment: %s",
              opsmith_last_error());
        ptrs[5] = NULL;
        CHECK(opsmith_adamw_increment_steps_cpu(N, ptrs) == OPSMITH_STATUS_INVALID_ARGUMENT &&
                  strstr(opsmith_last_error(), "steps[5] is NULL"),
              "cpu increment: a NULL counter must be refused, got '%s'", opsmith_last_error());
    }
#if TEST_CUDA
    else {
        float *dev = NULL;
        CHECK(cudaMalloc((void **)&dev, N * sizeof(float)) == cudaSuccess, "cudaMalloc");
        cudaMemcpy(dev, host, N * sizeof(float), cudaMemcpyHostToDevice);
        for (int i = 0; i < N; i++) ptrs[i] = dev + i;
        CHECK(opsmith_adamw_increment_steps_cuda(N, ptrs, NULL) == OPSMITH_STATUS_SUCCESS, "cuda increment: %s",
              opsmith_last_error());
        cudaMemcpy(host, dev, N * sizeof(float), cudaMemcpyDeviceToHost);
        cudaFree(dev);
    }
#endif
    int bad = 0;
    for (int i = 0; i < N; i++) bad += host[i] != (float)(i % 97) + 1.5f;
    CHECK(bad == 0, "%s increment: %d of %d counters not advanced by exactly 1", cuda ? "cuda" : "cpu", bad, N);
    free(host);
    free(ptrs);
}

/* thread counts do not change the bits of the norm or the step */
static void test_threads(void) {
    mode md = {OPSMITH_DTYPE_F32, OPSMITH_DTYPE_BF16, 0, 1, 0, 0.1, 1, 0, 0};
    float out[2][2];
    for (int k = 0; k < 2; k++) {
        opsmith_set_num_threads(k ? 3 : 1);
        test_rng rng = {5};
        lists h;
        refstate r;
        memset(&h, 0, sizeof h);
        fill_inputs(&md, &h, &r, &rng);
        new_grads(&md, &h, &r, &rng);
        out[k][0] = adamw_run_cpu(&md, &h);
        out[k][1] = ((float *)h.p[5])[OPSMITH_ADAMW_CHUNK + 2];
        free_all(&md, &h, &r);
    }
    opsmith_set_num_threads(0);
    CHECK(out[0][0] == out[1][0] && out[0][1] == out[1][1], "1 and 3 threads differ: norm %.9g vs %.9g",
          out[0][0], out[1][0]);
}

HARNESS_GROUP(test_adamw) {
    const opsmith_dtype F = OPSMITH_DTYPE_F32, B = OPSMITH_DTYPE_BF16, H = OPSMITH_DTYPE_F16;
    /* param modes: f32; bf16 + f32 master; bf16, f16 rounded each step */
    const struct { opsmith_dtype pdt; int master; } pm[] = {{F, 0}, {B, 1}, {B, 0}, {H, 0}};
    const opsmith_dtype gdts[] = {F, B};
    /* (amsgrad, maximize, wd, clip, lr_tensor, off) */
    const struct { int ams, max; double wd; int clip, lrt, off; } var[] = {
        {0, 0, 0.0, 0, 0, 0}, {1, 1, 0.1, 1, 1, 0}, {0, 1, 0.01, 1, 0, 1}, {1, 0, 0.1, 0, 1, 1}};
    int cuda = 0;
#if TEST_CUDA
    cuda = adamw_cuda_present();
    if (!cuda) printf("skipping CUDA adamw cases: no device\n");
#endif
    test_increment_steps(0);
#if TEST_CUDA
    if (cuda) test_increment_steps(1), test_cuda_many_launches();
#endif
    if (!cuda) harness_skip(2);
    uint64_t seed = 1;
    for (size_t a = 0; a < sizeof pm / sizeof pm[0]; a++)
        for (size_t b = 0; b < 2; b++)
            for (size_t c = 0; c < sizeof var / sizeof var[0]; c++) {
                const mode md = {pm[a].pdt, gdts[b], pm[a].master, var[c].ams, var[c].max, var[c].wd,
                                 var[c].clip, var[c].lrt, var[c].off};
                run_mode(&md, 0, seed);
                if (cuda) run_mode(&md, 1, seed);
                else harness_skip(1);
                seed++;
            }
    test_errors();
    test_threads();
}
