/* What LayerNorm's CPU and CUDA launchers share: argument validation, the
 * CPU workspace size, and the CUDA plan query the tests use. Not exported. */
#ifndef OPSMITH_INTERNAL_LAYER_NORM_H
#define OPSMITH_INTERNAL_LAYER_NORM_H

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The arguments of one forward (backward = 0: out = y, dy, dweight, dbias
 * ignored) or backward (out = dx; bias ignored) call; `op` names the
 * launcher in error messages. */
typedef struct opsmith_layer_norm_args {
    const char *op;
    int backward;
    opsmith_dtype x_dtype, weight_dtype;
    int64_t rows, n;
    const void *x;
    int64_t x_row_stride;
    const void *dy;
    int64_t dy_row_stride;
    const void *weight, *bias;
    double eps;
    const void *out;
    int64_t out_row_stride;
    const void *mean, *rstd;
    const void *dweight, *dbias;
} opsmith_layer_norm_args;

/* Checks the dtype pair, sizes, strides, NULL and misaligned pointers, eps
 * and the aliasing rule (an output is its one permitted input exactly, or
 * apart from every tensor). */
OPSMITH_INTERNAL opsmith_status opsmith_internal_layer_norm_check(const opsmith_layer_norm_args *a);

/* dweight and dbias partial sums of the CPU backward go through row
 * chunks, summed in a fixed order; their number is a function of rows
 * alone, so the result does not depend on the thread count. A chunk holds
 * at least OPSMITH_LAYER_NORM_CPU_CHUNK_ROWS rows (its partial rows cost
 * about 1/that of its work), except that up to 4 rows get a chunk each and
 * up to 64 rows 4 chunks (a few threads still share them); at most
 * OPSMITH_LAYER_NORM_CPU_CHUNKS chunks. */
#define OPSMITH_LAYER_NORM_CPU_CHUNKS 64
#define OPSMITH_LAYER_NORM_CPU_CHUNK_ROWS 16

static inline int64_t opsmith_internal_layer_norm_cpu_chunks(int64_t rows) {
    const int64_t few = rows < 4 ? rows : 4;
    const int64_t c = rows / OPSMITH_LAYER_NORM_CPU_CHUNK_ROWS;
    return c < few ? few : c < OPSMITH_LAYER_NORM_CPU_CHUNKS ? c : OPSMITH_LAYER_NORM_CPU_CHUNKS;
}

/* Workspace of the CPU backward: per chunk, a partial row for dweight and
 * one for dbias (both when either is asked for), in the accumulate type. */
OPSMITH_INTERNAL size_t opsmith_internal_layer_norm_bwd_cpu_workspace(opsmith_dtype x_dtype, int64_t rows, int64_t n,
                                                                      int with_dweight, int with_dbias);

/* The CUDA kernel family ("resident", "warp": resident with a warp a row,
 * "staged" or "generic") a contiguous, aligned call of this shape takes on
 * the current device; for tests. CUDA builds only. */
OPSMITH_INTERNAL const char *opsmith_internal_layer_norm_cuda_plan(opsmith_dtype x_dtype, opsmith_dtype weight_dtype,
                                                                   int64_t rows, int64_t n, int backward);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_INTERNAL_LAYER_NORM_H */
