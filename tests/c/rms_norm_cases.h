/* Shared between the CPU and CUDA RMSNorm tests: one case description, its
 * generated inputs and float64 reference results, and the checks, so both
 * backends are measured by exactly the same rules. */
#ifndef OPSMITH_TEST_RMS_NORM_CASES_H
#define OPSMITH_TEST_RMS_NORM_CASES_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#if defined(OPSMITH_WITH_CUDA) && OPSMITH_WITH_CUDA
#define TEST_CUDA 1
#else
#define TEST_CUDA 0
#endif

#define GUARD 64         /* bytes around every buffer that must stay untouched */
#define GUARD_BYTE 0x5A
#define POISON_BYTE 0xFF /* NaN in f64, f32, f16 and bf16 */

static inline void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "out of host memory (%zu bytes)\n", bytes);
        exit(2);
    }
    return p;
}

/* A host buffer laid out as [lead guard][payload][tail guard]. The lead
 * includes any deliberate misalignment offset; the same image is copied to
 * the device for CUDA runs, so both backends are checked identically.
 * base == NULL stands for "no tensor" (a NULL argument). */
typedef struct image {
    unsigned char *base;
    size_t lead, bytes, total;
} image;

static inline image image_new(size_t lead, size_t bytes)
{
    image im = {NULL, lead, bytes, lead + bytes + GUARD};
    im.base = xmalloc(im.total);
    memset(im.base, GUARD_BYTE, im.total);
    memset(im.base + lead, POISON_BYTE, bytes);
    return im;
}

static inline void *img(const image *im) { return im->base ? im->base + im->lead : NULL; }

static inline void image_free(image *im)
{
    free(im->base);
    im->base = NULL;
}

typedef struct rms_case {
    opsmith_dtype dt;
    int64_t rows, n;
    int weight;            /* pass a weight (else NULL) */
    int dweight;           /* pass a dweight buffer (must stay untouched when !weight) */
    int64_t x_pad, dy_pad; /* extra elements between rows, filled with NaN */
    int in_off;            /* x and dy start one element past an aligned address */
    int out_off;           /* weight, y, dx, dweight one element off too */
    double eps;
    int64_t out_pad;       /* extra elements between y (and dx) rows: must stay untouched */
} rms_case;

typedef struct rms_data {
    char name[160];
    int64_t xs, dys, ys;       /* row strides in elements (ys: y and dx) */
    image x, dy, w, inv_in;    /* inputs; inv_in in the accumulate dtype */
    double *xd, *dyd, *wd, *inv_d; /* the same values, widened, contiguous */
    double *y_ref, *inv_ref, *dx_ref, *dw_ref;
    double y_scale, inv_scale, dx_scale, dw_scale; /* error is judged against tol * scale */
} rms_data;

typedef struct bwd_out {
    image dx, dw;
} bwd_out;

bwd_out bwd_out_new(const rms_case *c);
void bwd_out_free(bwd_out *o);
/* y (dx) is checked row by row with row stride ys (dxs); elements between
 * rows must still hold their poison. */
void check_fwd(const rms_case *c, const rms_data *d, const char *be, const image *y, int64_t ys,
               const image *inv);
void check_bwd(const rms_case *c, const rms_data *d, const char *be, const image *dx, int64_t dxs,
               const image *dw);
/* A copy of an input image, for the in-place runs (y = x, dx = dy). */
image image_copy(const image *im);
void check_same(const rms_case *c, const rms_data *d, const char *be, const char *how,
                const bwd_out *a, const bwd_out *b);

/* Arguments of one launcher call, for the bad-argument tests. */
typedef struct call_args {
    opsmith_dtype dt;
    int64_t rows, n, xs, dys, ys, dxs;
    const void *x, *dy, *w, *inv_in;
    double eps;
    void *y, *inv, *dx, *dw, *ws;
    size_t ws_bytes;
} call_args;

/* base must be a valid call with rows = 2, n = 4, all row strides 4, and a
 * workspace of ws_bytes >= what the backward needs, aligned to
 * OPSMITH_WORKSPACE_ALIGNMENT with 64 bytes to spare. */
void test_bad_args(int cuda, const call_args *base);

/* CUDA side (test_rms_norm_cuda.c). cuda_begin returns 1 when CUDA cases
 * run, 0 when they are skipped for want of a device, -1 when they are not
 * compiled in. */
int cuda_begin(void);
void cuda_end(int cuda);
void run_cuda(const rms_case *c, const rms_data *d);
void test_bad_args_cuda(opsmith_dtype dt);
void test_cuda_plans(void);

/* A host workspace as the ABI asks: aligned to OPSMITH_WORKSPACE_ALIGNMENT,
 * with 64 spare bytes so a deliberately misaligned pointer stays inside. */
void *workspace_alloc(size_t bytes);

/* The dtype combinations of the RMSNorm options family (opsmith_rms_norm_ex_*,
 * opsmith_fused_add_rms_norm_*): one dtype, or a 16-bit x with a float32
 * weight and y in x's dtype or float32. */
typedef struct combo {
    opsmith_dtype x, w, y;
} combo;

static const combo kCombos[] = {
    {OPSMITH_DTYPE_F64, OPSMITH_DTYPE_F64, OPSMITH_DTYPE_F64},   {OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32},
    {OPSMITH_DTYPE_F16, OPSMITH_DTYPE_F16, OPSMITH_DTYPE_F16},   {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_BF16},
    {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_F32, OPSMITH_DTYPE_BF16}, {OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32},
    {OPSMITH_DTYPE_F16, OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F16},   {OPSMITH_DTYPE_F16, OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32},
};

/* their tolerance per dtype, relative to the output's scale */
static inline double options_tol(opsmith_dtype dt) {
    switch (dt) {
    case OPSMITH_DTYPE_F64: return 1e-12;
    case OPSMITH_DTYPE_F32: return 4e-6;
    case OPSMITH_DTYPE_F16: return 2e-3;
    default: return 1.6e-2;
    }
}

/* the coarser of two dtypes' tolerances */
static inline double options_tol2(opsmith_dtype a, opsmith_dtype b) {
    return options_tol(a) > options_tol(b) ? options_tol(a) : options_tol(b);
}

/* max |out - ref| <= tol * max(1, max|ref|) over the rows of a strided
 * output, and the gaps between rows still NaN */
static inline void check_rows(const char *what, const char *name, opsmith_dtype dt, const image *out,
                              const double *ref, int64_t rows, int64_t n, int64_t stride, double tol) {
    double worst = 0, scale = 1;
    int gaps = 1;
    for (int64_t i = 0; i < rows * n; i++) scale = fmax(scale, fabs(ref[i]));
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < n; i++) {
            const double got = opsmith_load_as_double(dt, img(out), r * stride + i);
            worst = fmax(worst, isnan(got) ? INFINITY : fabs(got - ref[r * n + i]));
        }
        for (int64_t i = n; i < stride && r + 1 < rows; i++)
            gaps &= isnan(opsmith_load_as_double(dt, img(out), r * stride + i));
    }
    CHECK(worst <= tol * scale, "%s %s: max|err| %.3g > %.3g", name, what, worst, tol * scale);
    CHECK(gaps, "%s %s: written between rows", name, what);
}

#if TEST_CUDA
#include <cuda_runtime_api.h>

/* an image's bytes (guards included) on the device; the pointer its data
 * starts at there (NULL for an empty image) */
static inline void *to_device(const image *im) {
    void *p = NULL;
    if (!im->base) return NULL;
    if (!CHECK(cudaMalloc(&p, im->total) == cudaSuccess, "cudaMalloc")) return NULL;
    cudaMemcpy(p, im->base, im->total, cudaMemcpyHostToDevice);
    return (unsigned char *)p + im->lead;
}

/* back into the image, and the device copy freed */
static inline void from_device(image *im, void *dev) {
    cudaMemcpy(im->base, (unsigned char *)dev - im->lead, im->total, cudaMemcpyDeviceToHost);
    cudaFree((unsigned char *)dev - im->lead);
}
#endif

#endif /* OPSMITH_TEST_RMS_NORM_CASES_H */
