/* Times the CUDA launchers directly, without PyTorch: the loop for kernel
 * work (`make kernel-bench`, then build/kernel_bench on a GPU machine).
 *
 *   build/kernel_bench [rms_norm|layer_norm|fused_add] [bf16|f16|f32|f64] ROWSxN ...
 *   build/kernel_bench rotary [bf16|f16|f32|f64] ROWSxD ... (q 32 heads, k 8, B = 4 when ROWS allows)
 *
 * (rms_norm and bf16 by default; fused_add is fused_add_rms_norm, its
 * backward with dh.) For each shape: forward and backward (with the weight,
 * and for layer_norm the bias, gradient) times,
 * each the median of 7 batches timed by CUDA events, inputs rotated over
 * enough copies to span 256 MB so the L2 cache cannot serve them; GB/s over
 * the bytes each must move (rms_norm forward: x, w in, y out; backward: dy,
 * x, w in, dx, dweight out; layer_norm adds the bias and its gradient;
 * fused_add reads the residual and writes h in the forward, reads dh and h
 * in place of x in the backward) and that as a fraction of a 1 GiB
 * device-to-device copy timed the same way. */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "opsmith.h"

#define CUDA_TRY(call)                                                                              \
    do {                                                                                            \
        cudaError_t e_ = (call);                                                                    \
        if (e_ != cudaSuccess) {                                                                    \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            return 1;                                                                               \
        }                                                                                           \
    } while (0)

enum { BATCHES = 7, MAX_SETS = 16 };
static const size_t kRotateBytes = (size_t)256 << 20;

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef int (*step_fn)(void *ctx, int call);

/* Median over BATCHES of the per-call time (ms) of `calls` back-to-back calls. */
static int time_ms(step_fn step, void *ctx, int calls, double *ms)
{
    cudaEvent_t a, b;
    double t[BATCHES];
    CUDA_TRY(cudaEventCreate(&a));
    CUDA_TRY(cudaEventCreate(&b));
    for (int i = 0; i < calls; i++) /* warm-up */
        if (step(ctx, i))
            return 1;
    for (int k = 0; k < BATCHES; k++) {
        CUDA_TRY(cudaEventRecord(a, 0));
        for (int i = 0; i < calls; i++)
            if (step(ctx, i))
                return 1;
        CUDA_TRY(cudaEventRecord(b, 0));
        CUDA_TRY(cudaEventSynchronize(b));
        float f;
        CUDA_TRY(cudaEventElapsedTime(&f, a, b));
        t[k] = f / calls;
    }
    qsort(t, BATCHES, sizeof t[0], cmp_double);
    *ms = t[BATCHES / 2];
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return 0;
}

struct copy_ctx {
    void *a, *b;
    size_t bytes;
};

static int copy_step(void *p, int call)
{
    (void)call;
    struct copy_ctx *c = p;
    return cudaMemcpyAsync(c->b, c->a, c->bytes, cudaMemcpyDeviceToDevice, 0) != cudaSuccess;
}

enum op { RMS_NORM, LAYER_NORM, FUSED_ADD, ROTARY };
static const char *const kOpNames[] = {"rms_norm", "layer_norm", "fused_add", "rotary"};

struct rms_ctx {
    enum op op;
    opsmith_dtype dt;
    int64_t rows, n;
    int sets;
    /* x doubles as the residual stream's h, r as the residual and dh */
    void *x[MAX_SETS], *dy[MAX_SETS], *r[MAX_SETS];
    void *w, *b, *y, *h, *inv, *rstd, *dx, *dw, *db, *ws;
    size_t ws_bytes;
};

static int fwd_step(void *p, int call)
{
    struct rms_ctx *c = p;
    int s = call % c->sets;
    opsmith_status st;
    if (c->op == LAYER_NORM)
        st = opsmith_layer_norm_fwd_cuda(c->dt, c->dt, c->rows, c->n, c->x[s], c->n, c->w, c->b, 1e-5, c->y, c->n,
                                         c->inv, c->rstd, 0);
    else if (c->op == FUSED_ADD)
        st = opsmith_fused_add_rms_norm_fwd_cuda(c->dt, c->dt, c->dt, c->rows, c->n, c->x[s], c->n, c->r[s], c->n,
                                                 c->w, 0.0, 1e-6, OPSMITH_RMS_NORM_CASTING_NONE, c->y, c->n, c->h,
                                                 c->n, c->inv, 0);
    else
        st = opsmith_rms_norm_fwd_cuda(c->dt, c->rows, c->n, c->x[s], c->n, c->w, 1e-6, c->y, c->n, c->inv, 0);
    if (st != OPSMITH_STATUS_SUCCESS)
        fprintf(stderr, "forward: %s %s\n", opsmith_status_string(st), opsmith_last_error());
    return st != OPSMITH_STATUS_SUCCESS;
}

static int bwd_step(void *p, int call)
{
    struct rms_ctx *c = p;
    int s = call % c->sets;
    opsmith_status st;
    if (c->op == LAYER_NORM)
        st = opsmith_layer_norm_bwd_cuda(c->dt, c->dt, c->rows, c->n, c->dy[s], c->n, c->x[s], c->n, c->w, c->inv,
                                         c->rstd, c->dx, c->n, c->dw, c->db, c->ws, c->ws_bytes, 0);
    else if (c->op == FUSED_ADD)
        st = opsmith_fused_add_rms_norm_bwd_cuda(c->dt, c->dt, c->dt, c->rows, c->n, c->dy[s], c->n, c->r[s], c->n,
                                                 c->x[s], c->n, c->w, 0.0, OPSMITH_RMS_NORM_CASTING_NONE, c->inv,
                                                 c->dx, c->n, c->dw, c->ws, c->ws_bytes, 0);
    else
        st = opsmith_rms_norm_bwd_cuda(c->dt, c->rows, c->n, c->dy[s], c->n, c->x[s], c->n, c->w, c->inv, c->dx,
                                       c->n, c->dw, c->ws, c->ws_bytes, 0);
    if (st != OPSMITH_STATUS_SUCCESS)
        fprintf(stderr, "backward: %s %s\n", opsmith_status_string(st), opsmith_last_error());
    return st != OPSMITH_STATUS_SUCCESS;
}

/* Random values in [-2, 2): a host block of `block` elements, copied over
 * the whole device tensor (timing does not depend on the values repeating). */
static int fill(void *dev, size_t bytes, const unsigned char *block, size_t block_bytes)
{
    for (size_t off = 0; off < bytes; off += block_bytes) {
        size_t k = bytes - off < block_bytes ? bytes - off : block_bytes;
        CUDA_TRY(cudaMemcpy((unsigned char *)dev + off, block, k, cudaMemcpyHostToDevice));
    }
    return 0;
}

static int bench_shape(enum op op, opsmith_dtype dt, int64_t rows, int64_t n, double copy_gbs,
                       const unsigned char *block, size_t block_bytes)
{
    struct rms_ctx c;
    memset(&c, 0, sizeof c);
    c.op = op;
    c.dt = dt;
    c.rows = rows;
    c.n = n;
    size_t es = opsmith_dtype_size(dt), as = opsmith_dtype_size(opsmith_dtype_accumulate(dt));
    size_t tensor = (size_t)rows * n * es;
    const int per_set = op == FUSED_ADD ? 3 : 2;
    c.sets = (int)((kRotateBytes + per_set * tensor - 1) / (per_set * tensor));
    if (c.sets < 1)
        c.sets = 1;
    if (c.sets > MAX_SETS)
        c.sets = MAX_SETS;
    for (int s = 0; s < c.sets; s++) {
        CUDA_TRY(cudaMalloc(&c.x[s], tensor));
        CUDA_TRY(cudaMalloc(&c.dy[s], tensor));
        if (fill(c.x[s], tensor, block, block_bytes) || fill(c.dy[s], tensor, block + es, block_bytes - es))
            return 1;
        if (op == FUSED_ADD) {
            CUDA_TRY(cudaMalloc(&c.r[s], tensor));
            if (fill(c.r[s], tensor, block + 2 * es, block_bytes - 2 * es))
                return 1;
        }
    }
    CUDA_TRY(cudaMalloc(&c.w, n * es));
    CUDA_TRY(cudaMalloc(&c.y, tensor));
    CUDA_TRY(cudaMalloc(&c.dx, tensor));
    CUDA_TRY(cudaMalloc(&c.dw, n * es));
    CUDA_TRY(cudaMalloc(&c.b, n * es));
    CUDA_TRY(cudaMalloc(&c.db, n * es));
    CUDA_TRY(cudaMalloc(&c.h, tensor));
    CUDA_TRY(cudaMalloc(&c.inv, rows * as));
    CUDA_TRY(cudaMalloc(&c.rstd, rows * as));
    if (op == LAYER_NORM)
        c.ws_bytes = opsmith_layer_norm_bwd_cuda_workspace_size(dt, dt, rows, n, c.dy[0], n, c.x[0], n, c.w, c.inv,
                                                                c.rstd, c.dx, n, c.dw, c.db);
    else if (op == FUSED_ADD)
        c.ws_bytes = opsmith_fused_add_rms_norm_bwd_cuda_workspace_size(dt, dt, dt, rows, n, c.w, c.dw);
    else
        c.ws_bytes = opsmith_rms_norm_bwd_cuda_workspace_size(dt, rows, n, c.dy[0], n, c.x[0], n, c.w, c.inv, c.dx,
                                                              n, c.dw);
    CUDA_TRY(cudaMalloc(&c.ws, c.ws_bytes ? c.ws_bytes : 16));
    if (fill(c.w, n * es, block, block_bytes) || fill(c.b, n * es, block + es, block_bytes - es))
        return 1;
    /* enough calls a batch that a batch lasts about 2 ms */
    double probe;
    if (time_ms(fwd_step, &c, 3, &probe))
        return 1;
    int calls = (int)(2.0 / (probe + 1e-4));
    if (calls < 3)
        calls = 3;
    if (calls > 2000)
        calls = 2000;
    double f_ms, b_ms;
    if (time_ms(fwd_step, &c, calls, &f_ms) || time_ms(bwd_step, &c, calls, &b_ms))
        return 1;
    /* (row tensors, parameter vectors) each direction reads and writes */
    const int fwd_rows = op == FUSED_ADD ? 4 : 2, fwd_params = op == LAYER_NORM ? 2 : 1;
    const int bwd_rows = op == FUSED_ADD ? 4 : 3, bwd_params = op == LAYER_NORM ? 4 : 2;
    double fb = (double)(fwd_rows * rows * n + fwd_params * n) * es;
    double bb = (double)(bwd_rows * rows * n + bwd_params * n) * es;
    double f_gbs = fb / (f_ms * 1e6), b_gbs = bb / (b_ms * 1e6), fb_gbs = (fb + bb) / ((f_ms + b_ms) * 1e6);
    printf("%-10s %-5s %8lld x %-6lld  fwd %9.2f us %7.0f GB/s %.3f | bwd %9.2f us %7.0f GB/s %.3f | fwd+bwd %.3f\n",
           kOpNames[op], opsmith_dtype_name(dt), (long long)rows, (long long)n, f_ms * 1e3, f_gbs, f_gbs / copy_gbs,
           b_ms * 1e3, b_gbs, b_gbs / copy_gbs, fb_gbs / copy_gbs);
    fflush(stdout);
    for (int s = 0; s < c.sets; s++) {
        cudaFree(c.x[s]);
        cudaFree(c.dy[s]);
        cudaFree(c.r[s]);
    }
    cudaFree(c.b);
    cudaFree(c.db);
    cudaFree(c.h);
    cudaFree(c.rstd);
    cudaFree(c.w);
    cudaFree(c.y);
    cudaFree(c.dx);
    cudaFree(c.dw);
    cudaFree(c.inv);
    cudaFree(c.ws);
    return 0;
}

/* Rotary at the shape family: q [B, 32, S, D], k [B, 8, S, D]
 * (contiguous, the [B, H, S, D] layout), cos/sin [B, S, D] of x's dtype,
 * rotate-half, out of place; the backward reads dq_out, dk_out and writes
 * dq, dk. Bytes: q, k, cos, sin read once and q, k written once. */
struct rot_ctx {
    opsmith_rotary_params p;
    int sets;
    void *q[MAX_SETS], *k[MAX_SETS], *cos, *sin, *qo, *ko;
};

static int rot_step(void *v, int call, int bwd)
{
    struct rot_ctx *c = v;
    int s = call % c->sets;
    opsmith_status st = (bwd ? opsmith_rotary_bwd_cuda : opsmith_rotary_fwd_cuda)(&c->p, c->q[s], c->qo, c->k[s],
                                                                                  c->ko, c->cos, c->sin, NULL, 0);
    if (st != OPSMITH_STATUS_SUCCESS)
        fprintf(stderr, "rotary: %s %s\n", opsmith_status_string(st), opsmith_last_error());
    return st != OPSMITH_STATUS_SUCCESS;
}
static int rot_fwd_step(void *v, int call) { return rot_step(v, call, 0); }
static int rot_bwd_step(void *v, int call) { return rot_step(v, call, 1); }

static int bench_rotary(opsmith_dtype dt, int64_t rows, int64_t d, double copy_gbs, const unsigned char *block,
                        size_t block_bytes)
{
    struct rot_ctx c;
    memset(&c, 0, sizeof c);
    const int64_t hq = 32, hk = 8, B = rows % 4 == 0 ? 4 : 1, S = rows / B;
    opsmith_rotary_params *p = &c.p;
    p->style = OPSMITH_ROTARY_STYLE_HALF, p->dtype = dt, p->cs_dtype = dt;
    p->batch = B, p->seq = S, p->head_dim = d, p->rotary_dim = d;
    p->q = (opsmith_rotary_view){hq, hq * S * d, d, S * d};
    p->k = (opsmith_rotary_view){hk, hk * S * d, d, S * d};
    p->q_out = p->q, p->k_out = p->k;
    p->cs_batch_stride = S * d, p->cs_seq_stride = d;
    const size_t es = opsmith_dtype_size(dt), qb = (size_t)(rows * hq * d) * es, kb = (size_t)(rows * hk * d) * es,
                 cb = (size_t)(rows * d) * es;
    c.sets = (int)((kRotateBytes + qb + kb - 1) / (qb + kb));
    if (c.sets > MAX_SETS)
        c.sets = MAX_SETS;
    for (int s = 0; s < c.sets; s++) {
        CUDA_TRY(cudaMalloc(&c.q[s], qb));
        CUDA_TRY(cudaMalloc(&c.k[s], kb));
        if (fill(c.q[s], qb, block, block_bytes) || fill(c.k[s], kb, block + es, block_bytes - es))
            return 1;
    }
    CUDA_TRY(cudaMalloc(&c.cos, cb));
    CUDA_TRY(cudaMalloc(&c.sin, cb));
    CUDA_TRY(cudaMalloc(&c.qo, qb));
    CUDA_TRY(cudaMalloc(&c.ko, kb));
    if (fill(c.cos, cb, block + 2 * es, block_bytes - 2 * es) || fill(c.sin, cb, block + 3 * es, block_bytes - 3 * es))
        return 1;
    double probe;
    if (time_ms(rot_fwd_step, &c, 3, &probe))
        return 1;
    int calls = (int)(2.0 / (probe + 1e-4));
    calls = calls < 3 ? 3 : calls > 2000 ? 2000 : calls;
    double f_ms, b_ms;
    if (time_ms(rot_fwd_step, &c, calls, &f_ms) || time_ms(rot_bwd_step, &c, calls, &b_ms))
        return 1;
    const double bytes = 2.0 * (double)(qb + kb + cb);
    const double f_gbs = bytes / (f_ms * 1e6), b_gbs = bytes / (b_ms * 1e6);
    printf("rotary     %-5s %8lld x %-6lld  fwd %9.2f us %7.0f GB/s %.3f | bwd %9.2f us %7.0f GB/s %.3f | fwd+bwd %.3f\n",
           opsmith_dtype_name(dt), (long long)rows, (long long)d, f_ms * 1e3, f_gbs, f_gbs / copy_gbs, b_ms * 1e3,
           b_gbs, b_gbs / copy_gbs, 2 * bytes / ((f_ms + b_ms) * 1e6) / copy_gbs);
    fflush(stdout);
    for (int s = 0; s < c.sets; s++)
        cudaFree(c.q[s]), cudaFree(c.k[s]);
    cudaFree(c.cos), cudaFree(c.sin), cudaFree(c.qo), cudaFree(c.ko);
    return 0;
}

int main(int argc, char **argv)
{
    opsmith_dtype dt = OPSMITH_DTYPE_BF16;
    enum op op = RMS_NORM;
    int first = 1;
    for (int i = 0; i < 4; i++)
        if (argc > first && strcmp(argv[first], kOpNames[i]) == 0)
            op = (enum op)i, first++;
    if (argc > first && strchr(argv[first], 'x') == NULL) {
        const char *names[] = {"f64", "f32", "f16", "bf16"};
        const opsmith_dtype types[] = {OPSMITH_DTYPE_F64, OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F16, OPSMITH_DTYPE_BF16};
        int found = 0;
        for (int i = 0; i < 4; i++)
            if (strcmp(argv[first], names[i]) == 0)
                dt = types[i], found = 1;
        if (!found) {
            fprintf(stderr, "kernel_bench: unknown op or dtype '%s' (rms_norm, layer_norm, fused_add, rotary; bf16, f16, f32, f64)\n",
                    argv[first]);
            return 2;
        }
        first++;
    }
    if (first >= argc) {
        fprintf(stderr, "usage: kernel_bench [rms_norm|layer_norm|fused_add] [bf16|f16|f32|f64] ROWSxN ...\n");
        return 2;
    }
    struct copy_ctx cp = {NULL, NULL, (size_t)1 << 30};
    CUDA_TRY(cudaMalloc(&cp.a, cp.bytes));
    CUDA_TRY(cudaMalloc(&cp.b, cp.bytes));
    CUDA_TRY(cudaMemset(cp.a, 1, cp.bytes));
    double copy_ms;
    if (time_ms(copy_step, &cp, 5, &copy_ms))
        return 1;
    double copy_gbs = 2.0 * cp.bytes / (copy_ms * 1e6);
    cudaFree(cp.a);
    cudaFree(cp.b);
    printf("copy %.0f GB/s (1 GiB device to device, read + write)\n", copy_gbs);

    size_t es = opsmith_dtype_size(dt), block_elems = (size_t)1 << 22;
    unsigned char *block = malloc(block_elems * es);
    if (!block)
        return 1;
    srand(1234);
    for (size_t i = 0; i < block_elems; i++)
        opsmith_store_from_double(dt, block, (int64_t)i, 4.0 * rand() / ((double)RAND_MAX + 1) - 2.0);
    int rc = 0;
    for (int a = first; a < argc && rc == 0; a++) {
        long long rows, n;
        if (sscanf(argv[a], "%lldx%lld", &rows, &n) != 2 || rows < 1 || n < 1) {
            fprintf(stderr, "kernel_bench: bad shape '%s' (want ROWSxN)\n", argv[a]);
            rc = 2;
            break;
        }
        rc = op == ROTARY ? bench_rotary(dt, rows, n, copy_gbs, block, block_elems * es)
                          : bench_shape(op, dt, rows, n, copy_gbs, block, block_elems * es);
    }
    free(block);
    return rc;
}
