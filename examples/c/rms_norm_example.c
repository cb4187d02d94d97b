/* RMSNorm through opsmith's C ABI alone: no Python, no PyTorch.
 *
 *   make example        (builds build/libopsmith.so and this program, runs it)
 *
 * Normalises a small batch on the CPU, checks it against the scalar
 * reference, shows what a bad argument returns, and, when the library has
 * CUDA and a GPU is present, runs the same rows on the GPU. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "opsmith.h"

#ifdef OPSMITH_EXAMPLE_CUDA
#include <cuda_runtime_api.h>
#endif

enum { ROWS = 4, N = 8 };

static int check(opsmith_status st, const char *what) {
    if (st == OPSMITH_STATUS_SUCCESS) return 1;
    fprintf(stderr, "%s: %s: %s\n", what, opsmith_status_string(st), opsmith_last_error());
    return 0;
}

/* max |y - y_ref| over the batch */
static double max_error(const float *y, const double *y_ref) {
    double worst = 0.0;
    for (int i = 0; i < ROWS * N; i++) worst = fmax(worst, fabs((double)y[i] - y_ref[i]));
    return worst;
}

#ifdef OPSMITH_EXAMPLE_CUDA
/* The same forward on the GPU: device buffers, the default stream. Returns
 * 0 on success, 1 on failure, 2 when there is no device to run on. */
static int run_cuda(const float *x, const float *w, const double *y_ref) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) return 2;
    float *dx = NULL, *dw = NULL, *dy = NULL, *dinv = NULL, y[ROWS * N];
    int ok = cudaMalloc((void **)&dx, sizeof(float) * ROWS * N) == cudaSuccess &&
             cudaMalloc((void **)&dw, sizeof(float) * N) == cudaSuccess &&
             cudaMalloc((void **)&dy, sizeof(float) * ROWS * N) == cudaSuccess &&
             cudaMalloc((void **)&dinv, sizeof(float) * ROWS) == cudaSuccess &&
             cudaMemcpy(dx, x, sizeof(float) * ROWS * N, cudaMemcpyHostToDevice) == cudaSuccess &&
             cudaMemcpy(dw, w, sizeof(float) * N, cudaMemcpyHostToDevice) == cudaSuccess;
    ok = ok && check(opsmith_rms_norm_fwd_cuda(OPSMITH_DTYPE_F32, ROWS, N, dx, N, dw, 1e-6, dy, N, dinv, NULL),
                     "rms_norm_fwd_cuda");
    ok = ok && cudaMemcpy(y, dy, sizeof y, cudaMemcpyDeviceToHost) == cudaSuccess;
    if (ok) printf("cuda: max |y - reference| = %.3g\n", max_error(y, y_ref));
    ok = ok && max_error(y, y_ref) < 1e-5;
    cudaFree(dx), cudaFree(dw), cudaFree(dy), cudaFree(dinv);
    return ok ? 0 : 1;
}
#endif

int main(void) {
    printf("opsmith %s (ABI %d; header ABI %d), CUDA compiled in: %s\n", opsmith_version(), opsmith_abi_version(),
           OPSMITH_ABI_VERSION, opsmith_has_cuda() ? "yes" : "no");
    if (opsmith_abi_version() != OPSMITH_ABI_VERSION) {
        fprintf(stderr, "the library's ABI differs from this header's\n");
        return 1;
    }

    float x[ROWS * N], w[N], y[ROWS * N], inv_rms[ROWS];
    double xd[ROWS * N], wd[N], y_ref[ROWS * N], inv_ref[ROWS];
    for (int i = 0; i < ROWS * N; i++) xd[i] = x[i] = (float)sin(0.7 * i + 0.3);
    for (int i = 0; i < N; i++) wd[i] = w[i] = (float)(1.0 + 0.1 * i);
    opsmith_rms_norm_fwd_reference(ROWS, N, xd, wd, 1e-6, y_ref, inv_ref);

    /* x, y are (ROWS, N) with row stride N; inv_rms is (ROWS) float */
    if (!check(opsmith_rms_norm_fwd_cpu(OPSMITH_DTYPE_F32, ROWS, N, x, N, w, 1e-6, y, N, inv_rms),
               "rms_norm_fwd_cpu"))
        return 1;
    const double err = max_error(y, y_ref);
    printf("cpu:  y[0][:4] = %.5f %.5f %.5f %.5f, max |y - reference| = %.3g\n", y[0], y[1], y[2], y[3], err);
    if (!(err < 1e-5)) return 1;

    /* The backward needs a workspace on the CPU too: ask, allocate, pass. */
    float dy[ROWS * N], dx[ROWS * N], dw[N];
    for (int i = 0; i < ROWS * N; i++) dy[i] = (float)cos(0.3 * i);
    const size_t ws_bytes =
        opsmith_rms_norm_bwd_cpu_workspace_size(OPSMITH_DTYPE_F32, ROWS, N, dy, N, x, N, w, inv_rms, dx, N, dw);
    void *ws = aligned_alloc(OPSMITH_WORKSPACE_ALIGNMENT,
                             (ws_bytes + OPSMITH_WORKSPACE_ALIGNMENT - 1) / OPSMITH_WORKSPACE_ALIGNMENT *
                                 OPSMITH_WORKSPACE_ALIGNMENT);
    if (!ws || !check(opsmith_rms_norm_bwd_cpu(OPSMITH_DTYPE_F32, ROWS, N, dy, N, x, N, w, inv_rms, dx, N, dw, ws,
                                               ws_bytes),
                      "rms_norm_bwd_cpu"))
        return 1;
    free(ws);
    printf("cpu:  backward dweight[:4] = %.5f %.5f %.5f %.5f (workspace %zu bytes)\n", dw[0], dw[1], dw[2], dw[3],
           ws_bytes);

    /* A bad argument is a status and a message, never a crash. */
    opsmith_status st = opsmith_rms_norm_fwd_cpu(OPSMITH_DTYPE_F32, ROWS, N, x, N - 1, w, 1e-6, y, N, inv_rms);
    printf("bad row stride: %s: %s\n", opsmith_status_string(st), opsmith_last_error());
    if (st != OPSMITH_STATUS_INVALID_ARGUMENT) return 1;

#ifdef OPSMITH_EXAMPLE_CUDA
    const int cuda = run_cuda(x, w, y_ref);
    if (cuda == 2) printf("cuda: no device, skipped\n");
    if (cuda == 1) return 1;
#endif
    printf("example ok\n");
    return 0;
}
