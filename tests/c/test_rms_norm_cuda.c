/* RMSNorm CUDA launchers: the same cases and checks as the CPU run. Host
 * images (poison and guards included) are copied to the device whole and
 * copied back whole, so unwritten elements and stray writes show up exactly
 * as on the CPU. Without OPSMITH_WITH_CUDA=1 only the "unavailable" answer
 * of a CUDA-less library is checked. */
#include "rms_norm_cases.h"

#if TEST_CUDA
#include <cuda_runtime_api.h>

#include "internal/rms_norm.h"

/* Records a failure only, so successful API calls do not inflate the count. */
static int cuda_ok(cudaError_t e, const char *expr, const char *where)
{
    if (e == cudaSuccess)
        return 1;
    CHECK(0, "cuda %s: %s failed: %s", where, expr, cudaGetErrorString(e));
    return 0;
}
#define CUDA_OK(call, where) cuda_ok((call), #call, (where))

int cuda_begin(void)
{
    if (!CHECK(opsmith_has_cuda() == 1, "tests built with OPSMITH_WITH_CUDA=1 but opsmith_has_cuda() = %d",
               opsmith_has_cuda()))
        return -1;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
        printf("skipping CUDA cases: %s\n",
               e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found no device");
        cudaGetLastError(); /* clear it so later runtime calls start clean */
        return 0;
    }
    struct cudaDeviceProp prop;
    if (!CUDA_OK(cudaGetDeviceProperties(&prop, 0), "device query"))
        return -1;
    printf("CUDA cases run on device 0: %s\n", prop.name);
    return 1;
}

void cuda_end(int cuda)
{
    if (cuda > 0) {
        CUDA_OK(cudaDeviceSynchronize(), "end");
        CUDA_OK(cudaGetLastError(), "end");
    }
}

/* Copies a whole host image to new device memory; *dev stays NULL for a
 * NULL tensor. Returns 0 on a CUDA error (already recorded). */
static int upload(unsigned char **dev, const image *im, const char *where)
{
    *dev = NULL;
    if (!im->base)
        return 1;
    void *p = NULL;
    if (!CUDA_OK(cudaMalloc(&p, im->total), where))
        return 0;
    *dev = p;
    return CUDA_OK(cudaMemcpy(p, im->base, im->total, cudaMemcpyHostToDevice), where);
}

static int download(image *im, const unsigned char *dev, const char *where)
{
    if (!im->base)
        return 1;
    return CUDA_OK(cudaMemcpy(im->base, dev, im->total, cudaMemcpyDeviceToHost), where);
}

static void *dptr(unsigned char *dev, const image *im) { return dev ? dev + im->lead : NULL; }

/* D_XY and D_DYX hold copies of x and dy for the in-place runs. */
enum { D_X, D_DY, D_W, D_INV_IN, D_Y, D_INV, D_ADX, D_ADW, D_BDX, D_BDW, D_XY, D_DYX, D_COUNT };

static opsmith_status cuda_bwd(const rms_case *c, const rms_data *d, unsigned char **dev,
                               int dx_slot, const bwd_out *o, void *ws, size_t ws_bytes)
{
    return opsmith_rms_norm_bwd_cuda(c->dt, c->rows, c->n, dptr(dev[D_DY], &d->dy), d->dys,
                                     dptr(dev[D_X], &d->x), d->xs, dptr(dev[D_W], &d->w),
                                     dptr(dev[D_INV_IN], &d->inv_in), dptr(dev[dx_slot], &o->dx), d->ys,
                                     dptr(dev[dx_slot + 1], &o->dw), ws, ws_bytes, NULL);
}

void run_cuda(const rms_case *c, const rms_data *d)
{
    const char *name = d->name;
    const size_t es = opsmith_dtype_size(c->dt);
    const size_t aes = opsmith_dtype_size(opsmith_dtype_accumulate(c->dt));
    image y = image_new(GUARD + (size_t)c->out_off * es, (size_t)(c->rows * d->ys) * es);
    image inv = image_new(GUARD, (size_t)c->rows * aes);
    image xy = image_copy(&d->x), dyx = image_copy(&d->dy);
    bwd_out a = bwd_out_new(c), b = bwd_out_new(c);
    unsigned char *dev[D_COUNT] = {NULL};
    const image *host[D_COUNT] = {&d->x, &d->dy, &d->w, &d->inv_in, &y, &inv, &a.dx, &a.dw, &b.dx, &b.dw, &xy, &dyx};
    void *ws = NULL;
    /* the size query takes the launcher's arguments; only NULL or not matters */
    const size_t ws_bytes = opsmith_rms_norm_bwd_cuda_workspace_size(
        c->dt, c->rows, c->n, img(&d->dy), d->dys, img(&d->x), d->xs, img(&d->w), img(&d->inv_in), img(&a.dx),
        d->ys, img(&a.dw));
    int ok = 1;
    for (int k = 0; k < D_COUNT && ok; k++)
        ok = upload(&dev[k], host[k], name);
    if (!ok || (ws_bytes && !CUDA_OK(cudaMalloc(&ws, ws_bytes), name)))
        goto done;

    opsmith_status st = opsmith_rms_norm_fwd_cuda(c->dt, c->rows, c->n, dptr(dev[D_X], &d->x), d->xs,
                                                  dptr(dev[D_W], &d->w), c->eps, dptr(dev[D_Y], &y), d->ys,
                                                  dptr(dev[D_INV], &inv), NULL);
    if (CHECK(st == OPSMITH_STATUS_SUCCESS, "cuda %s: fwd returned \"%s\" (%s)", name,
              opsmith_status_string(st), opsmith_last_error()) &&
        CUDA_OK(cudaDeviceSynchronize(), name) && download(&y, dev[D_Y], name) &&
        download(&inv, dev[D_INV], name))
        check_fwd(c, d, "cuda", &y, d->ys, &inv);

    /* in place: y over the copy of x, dx over the copy of dy */
    st = opsmith_rms_norm_fwd_cuda(c->dt, c->rows, c->n, dptr(dev[D_XY], &xy), d->xs, dptr(dev[D_W], &d->w), c->eps,
                                   dptr(dev[D_XY], &xy), d->xs, dptr(dev[D_INV], &inv), NULL);
    if (CHECK(st == OPSMITH_STATUS_SUCCESS, "cuda %s: in-place fwd returned \"%s\" (%s)", name,
              opsmith_status_string(st), opsmith_last_error()) &&
        CUDA_OK(cudaDeviceSynchronize(), name) && download(&xy, dev[D_XY], name))
        check_fwd(c, d, "cuda in-place", &xy, d->xs, &inv);
    st = opsmith_rms_norm_bwd_cuda(c->dt, c->rows, c->n, dptr(dev[D_DYX], &dyx), d->dys, dptr(dev[D_X], &d->x), d->xs,
                                   dptr(dev[D_W], &d->w), dptr(dev[D_INV_IN], &d->inv_in), dptr(dev[D_DYX], &dyx),
                                   d->dys, NULL, NULL, 0, NULL);
    if (CHECK(st == OPSMITH_STATUS_SUCCESS, "cuda %s: in-place bwd returned \"%s\" (%s)", name,
              opsmith_status_string(st), opsmith_last_error()) &&
        CUDA_OK(cudaDeviceSynchronize(), name) && download(&dyx, dev[D_DYX], name)) {
        rms_case no_dw = *c;
        no_dw.dweight = 0;
        check_bwd(&no_dw, d, "cuda in-place", &dyx, d->dys, NULL);
    }

    st = cuda_bwd(c, d, dev, D_ADX, &a, ws, ws_bytes);
    if (!CHECK(st == OPSMITH_STATUS_SUCCESS, "cuda %s: bwd returned \"%s\" (%s)", name,
               opsmith_status_string(st), opsmith_last_error()) ||
        !CUDA_OK(cudaDeviceSynchronize(), name) || !download(&a.dx, dev[D_ADX], name) ||
        !download(&a.dw, dev[D_ADW], name))
        goto done;
    check_bwd(c, d, "cuda", &a.dx, d->ys, &a.dw);

    /* Same inputs again, workspace reused: dx and dweight must repeat bit for bit. */
    st = cuda_bwd(c, d, dev, D_BDX, &b, ws, ws_bytes);
    if (CHECK(st == OPSMITH_STATUS_SUCCESS, "cuda %s: 2nd bwd returned \"%s\" (%s)", name,
              opsmith_status_string(st), opsmith_last_error()) &&
        CUDA_OK(cudaDeviceSynchronize(), name) && download(&b.dx, dev[D_BDX], name) &&
        download(&b.dw, dev[D_BDW], name))
        check_same(c, d, "cuda", "second run", &a, &b);
done:
    for (int k = 0; k < D_COUNT; k++)
        if (dev[k])
            CUDA_OK(cudaFree(dev[k]), name);
    if (ws)
        CUDA_OK(cudaFree(ws), name);
    image_free(&y), image_free(&inv), image_free(&xy), image_free(&dyx);
    bwd_out_free(&a), bwd_out_free(&b);
}

void test_bad_args_cuda(opsmith_dtype dt)
{
    const char *where = "bad-args setup";
    /* 256 bytes per tensor: room for 2 rows of 4 in any dtype, zeroed so
     * the valid base call computes on finite numbers. */
    enum { X, DY, W, INV_IN, Y, INV, DX, DW, COUNT };
    void *p[COUNT] = {NULL}, *ws = NULL;
    int ok = 1;
    for (int k = 0; k < COUNT && ok; k++)
        ok = CUDA_OK(cudaMalloc(&p[k], 256), where) && CUDA_OK(cudaMemset(p[k], 0, 256), where);
    const size_t ws_bytes = ok ? opsmith_rms_norm_bwd_cuda_workspace_size(dt, 2, 4, p[DY], 4, p[X], 4, p[W],
                                                                          p[INV_IN], p[DX], 4, p[DW])
                               : 0;
    CHECK(!ok || ws_bytes > 0, "cuda %s: the backward with dweight needs a workspace, size query says 0",
          opsmith_dtype_name(dt));
    if (ok && ws_bytes)
        ok = CUDA_OK(cudaMalloc(&ws, ws_bytes + 64), where); /* room for the misaligned case */
    if (ok) {
        const call_args base = {dt, 2, 4, 4, 4, 4, 4, p[X], p[DY], p[W], p[INV_IN], 1e-6,
                                p[Y], p[INV], p[DX], p[DW], ws, ws_bytes};
        test_bad_args(1, &base);
        /* A rejected call must not leave an error behind for the next one. */
        CUDA_OK(cudaDeviceSynchronize(), "after bad-args calls");
        CUDA_OK(cudaGetLastError(), "after bad-args calls");
    }
    for (int k = 0; k < COUNT; k++)
        if (p[k])
            CUDA_OK(cudaFree(p[k]), where);
    if (ws)
        CUDA_OK(cudaFree(ws), where);
}

/* Each launch plan stays reachable: a plan the device refuses (too much
 * shared memory, a cluster it cannot place) falls back to a slower kernel
 * with the same results, which only this check would notice. */
void test_cuda_plans(void)
{
    int device = 0, major = 0;
    if (!CUDA_OK(cudaGetDevice(&device), "plans") ||
        !CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "plans"))
        return;
    const int clusters = major >= 9; /* thread-block clusters: sm_90 and newer */
    static const struct {
        opsmith_dtype dt;
        int64_t rows, n;
        int backward;
        const char *family; /* expected; "staged" with ctas > 1 needs clusters */
        int ctas;
    } plans[] = {
        {OPSMITH_DTYPE_BF16, 3, 4096, 0, "resident", 1},
        {OPSMITH_DTYPE_BF16, 3, 4096, 1, "split", 1},       /* a short batch: one launch, no workspace */
        {OPSMITH_DTYPE_F64, 100, 8192, 1, "split", 1},
        {OPSMITH_DTYPE_BF16, 2000, 4096, 0, "resident", 1},
        {OPSMITH_DTYPE_BF16, 13000, 512, 1, "staged", 1},
        {OPSMITH_DTYPE_BF16, 2000, 8192, 1, "staged", 1},
        {OPSMITH_DTYPE_F32, 2000, 8192, 1, "staged", 1},
        {OPSMITH_DTYPE_F64, 2000, 8192, 1, "staged", 2},
        {OPSMITH_DTYPE_BF16, 300, 32768, 0, "ring", 1},     /* many rows of >= 1024 packs: 64 KB, one CTA */
        {OPSMITH_DTYPE_F32, 300, 32768, 0, "ring", 2},      /* 128 KB: a cluster of 2 */
        {OPSMITH_DTYPE_BF16, 2000, 8192, 0, "ring", 1},
        {OPSMITH_DTYPE_BF16, 100, 8192, 0, "resident", 1},  /* fewer rows than SMs */
        {OPSMITH_DTYPE_BF16, 300, 32768, 1, "staged", 2},
        {OPSMITH_DTYPE_BF16, 140, 4096, 1, "resident", 1},
        {OPSMITH_DTYPE_BF16, 200, 65536, 1, "staged", 4},
        {OPSMITH_DTYPE_F32, 200, 65536, 1, "staged", 8},
        {OPSMITH_DTYPE_F64, 200, 65536, 1, "generic", 0},
    };
    for (size_t i = 0; i < sizeof plans / sizeof plans[0]; i++) {
        int ctas = -1;
        const char *family = opsmith_internal_rms_norm_cuda_plan(plans[i].dt, plans[i].rows, plans[i].n,
                                                                 plans[i].backward, &ctas);
        const char *want = plans[i].family;
        int want_ctas = plans[i].ctas;
        if (want_ctas > 1 && !clusters)
            want = "generic", want_ctas = 0;
        CHECK(strcmp(family, want) == 0 && ctas == want_ctas,
              "cuda plan %s %lld x %lld %s: got %s (ctas %d), want %s (ctas %d)",
              opsmith_dtype_name(plans[i].dt), (long long)plans[i].rows, (long long)plans[i].n,
              plans[i].backward ? "bwd" : "fwd", family, ctas, want, want_ctas);
    }
}

#else /* !TEST_CUDA */

int cuda_begin(void)
{
    if (opsmith_has_cuda()) {
        printf("note: the library has CUDA but these tests were built without "
               "OPSMITH_WITH_CUDA=1, so no CUDA case is compiled\n");
        return -1;
    }
    /* A CUDA-less build must answer CUDA_UNAVAILABLE to a valid call; these
     * host buffers are never touched by such a build. */
    static float x[8], dy[8], inv_in[2] = {1.0f, 1.0f}, y[8], inv[2], dx[8];
    opsmith_status st = opsmith_rms_norm_fwd_cuda(OPSMITH_DTYPE_F32, 2, 4, x, 4, NULL, 1e-6, y, 4,
                                                  inv, NULL);
    CHECK(st == OPSMITH_STATUS_CUDA_UNAVAILABLE, "CUDA-less fwd_cuda returned \"%s\"",
          opsmith_status_string(st));
    CHECK(strstr(opsmith_last_error(), "without CUDA") != NULL, "CUDA-less fwd_cuda: last_error \"%s\"",
          opsmith_last_error());
    st = opsmith_rms_norm_bwd_cuda(OPSMITH_DTYPE_F32, 2, 4, dy, 4, x, 4, NULL, inv_in, dx, 4, NULL,
                                   NULL, 0, NULL);
    CHECK(st == OPSMITH_STATUS_CUDA_UNAVAILABLE, "CUDA-less bwd_cuda returned \"%s\"",
          opsmith_status_string(st));
    return -1;
}

void cuda_end(int cuda) { (void)cuda; }
void run_cuda(const rms_case *c, const rms_data *d) { (void)c, (void)d; }
void test_bad_args_cuda(opsmith_dtype dt) { (void)dt; }
void test_cuda_plans(void) {}

#endif
