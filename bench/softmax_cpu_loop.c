/* Times softmax's CPU launchers alone, without PyTorch: best of 30 calls a
 * direction, in ns an element, each dtype, softmax and log_softmax, for one
 * ROWSxN on THREADS threads. Build and run (after `make build`):
 *
 *   cc -O2 -Iinclude -Icsrc bench/softmax_cpu_loop.c -Lbuild -lopsmith -Wl,-rpath,$PWD/build -o build/softmax_cpu_loop
 *   build/softmax_cpu_loop [N (4096)] [THREADS (1)] [ROWS (256)]
 *
 * Best of (not median): on a shared machine a slow call is another
 * process, not the kernel. bench/softmax_eager_kernels.py times eager
 * PyTorch's CPU kernels the same way. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "convert.h"
#include "opsmith.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const int64_t n = argc > 1 ? atoll(argv[1]) : 4096, rows = argc > 3 ? atoll(argv[3]) : 256;
    opsmith_set_num_threads(argc > 2 ? atoi(argv[2]) : 1);
    const size_t count = (size_t)(rows * n);
    float *xf = malloc(count * 4), *yf = malloc(count * 4), *gf = malloc(count * 4), *df = malloc(count * 4);
    uint16_t *x16 = malloc(count * 2), *y16 = malloc(count * 2), *g16 = malloc(count * 2), *d16 = malloc(count * 2);
    if (!xf || !yf || !gf || !df || !x16 || !y16 || !g16 || !d16) return 1;
    srand(1);
    for (size_t i = 0; i < count; i++) {
        xf[i] = ((float)rand() / RAND_MAX - 0.5f) * 8;
        gf[i] = (float)rand() / RAND_MAX - 0.5f;
    }
    const char *names[] = {"f32", "bf16", "f16"};
    const opsmith_dtype dtypes[] = {OPSMITH_DTYPE_F32, OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_F16};
    for (int d = 0; d < 3; d++) {
        for (size_t i = 0; i < count; i++) {
            x16[i] = d == 1 ? opsmith_f32_to_bf16(xf[i]) : opsmith_f32_to_f16(xf[i]);
            g16[i] = d == 1 ? opsmith_f32_to_bf16(gf[i]) : opsmith_f32_to_f16(gf[i]);
        }
        void *x = d ? (void *)x16 : xf, *y = d ? (void *)y16 : yf, *g = d ? (void *)g16 : gf, *dx = d ? (void *)d16 : df;
        for (int lg = 0; lg < 2; lg++) {
            /* each direction's calls back to back, as eager's are timed */
            double fwd = 1e9, bwd = 1e9;
            for (int r = 0; r < 30; r++) {
                const double t0 = now();
                if (opsmith_softmax_fwd_cpu(dtypes[d], rows, n, x, n, lg, y, n) != OPSMITH_STATUS_SUCCESS) return 1;
                const double t1 = now();
                fwd = t1 - t0 < fwd ? t1 - t0 : fwd;
            }
            for (int r = 0; r < 30; r++) {
                const double t1 = now();
                if (opsmith_softmax_bwd_cpu(dtypes[d], rows, n, g, n, y, n, lg, dx, n) != OPSMITH_STATUS_SUCCESS) return 1;
                const double t2 = now();
                bwd = t2 - t1 < bwd ? t2 - t1 : bwd;
            }
            printf("%-4s %-11s %lldx%lld fwd %.3f ns/el bwd %.3f ns/el\n", names[d], lg ? "log_softmax" : "softmax",
                   (long long)rows, (long long)n, fwd * 1e9 / count, bwd * 1e9 / count);
        }
    }
    return 0;
}
