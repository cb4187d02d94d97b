/* A cache-blocked matrix product for the CPU kernels (csrc/cpu/gemm.c):
 *
 *     out (m x n) = alpha * (A B) [+ bias per column] [+ out]
 *
 * A (m x k) and B (k x n) are read through any two strides, so a transposed
 * operand costs nothing (it is packed anyway); 16-bit operands are widened
 * while packed. Products in float (opsmith_cpu_gemm_f32: operands f32, f16
 * or bf16) or double (opsmith_cpu_gemm_f64: f64 operands); out in any of
 * those dtypes, rows of stride out.ld, unit column stride.
 *
 * Deterministic: every output element is one chain of multiply-adds over k
 * in order, owned by one thread, so results do not depend on the thread
 * count. They may differ in the last bits between machines: FMA or not, and
 * bf16 x bf16 taken in pairs of k (VDPBF16PS) on AVX512-BF16 CPUs.
 *
 * The pack buffers and a task's output tile live on the calling (OpenMP)
 * thread's stack: about 320 KiB. */
#ifndef OPSMITH_CPU_GEMM_H
#define OPSMITH_CPU_GEMM_H

#include <stdint.h>

#include "opsmith.h"

typedef struct opsmith_gemm_operand {
    const void *p;
    opsmith_dtype dtype;
    int64_t rs, cs; /* element (i, j) at p[i * rs + j * cs] (in elements) */
} opsmith_gemm_operand;

typedef struct opsmith_gemm_out {
    void *p;
    opsmith_dtype dtype;
    int64_t ld;              /* row stride in elements */
    double alpha;            /* scale of the product */
    const void *bias;        /* n values added to every row after the scale, or NULL */
    opsmith_dtype bias_dtype;
    int accumulate;          /* nonzero: out += the result (out read in its dtype) */
} opsmith_gemm_out;

void opsmith_cpu_gemm_f32(int64_t m, int64_t n, int64_t k, opsmith_gemm_operand a, opsmith_gemm_operand b,
                          const opsmith_gemm_out *out, int threads);
void opsmith_cpu_gemm_f64(int64_t m, int64_t n, int64_t k, opsmith_gemm_operand a, opsmith_gemm_operand b,
                          const opsmith_gemm_out *out, int threads);

/* The micro-tile (rows x columns of out per register block) that this
 * machine's path uses, for the tests' edge sizes. */
void opsmith_cpu_gemm_tile(int f64, int *mr, int *nr);

/* For the tests: use at most path `level` (0: SSE2, 1: AVX2 + FMA, 2:
 * AVX-512, with the bf16 pair kernel where the CPU has it; < 0: whatever
 * the CPU has). Returns the path now used. Not thread-safe. */
int opsmith_cpu_gemm_cap_path(int level);

#endif /* OPSMITH_CPU_GEMM_H */
