/* What RMSNorm's CPU and CUDA launchers share: argument validation, and the
 * CUDA plan query the tests use. Not exported. */
#ifndef OPSMITH_INTERNAL_RMS_NORM_H
#define OPSMITH_INTERNAL_RMS_NORM_H

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Validates a forward call (backward = 0: out = y in out_dtype = y_dtype;
 * dy is ignored) or a backward call (out = dx in x_dtype; dy in out_dtype =
 * dy_dtype); `op` names the launcher in the error message. Checks the dtype
 * combination, sizes, strides, NULL and misaligned pointers, eps, offset,
 * casting and the aliasing rule (an output is its input exactly, or apart
 * from it). */
OPSMITH_INTERNAL opsmith_status opsmith_internal_rms_norm_check(
    const char *op, opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype out_dtype, int64_t rows,
    int64_t n, const void *x, int64_t x_row_stride, int backward, const void *dy, int64_t dy_row_stride,
    const void *weight, double offset, double eps, opsmith_rms_norm_casting casting, const void *out,
    int64_t out_row_stride, const void *inv_rms, const void *dweight);

/* The same, x named x_name in the messages (the residual-add backward's h). */
OPSMITH_INTERNAL opsmith_status opsmith_internal_rms_norm_check_named(
    const char *op, const char *x_name, opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype out_dtype,
    int64_t rows, int64_t n, const void *x, int64_t x_row_stride, int backward, const void *dy,
    int64_t dy_row_stride, const void *weight, double offset, double eps, opsmith_rms_norm_casting casting,
    const void *out, int64_t out_row_stride, const void *inv_rms, const void *dweight);

/* dweight partial sums of the CPU backward go through a fixed number of
 * row chunks, summed in a fixed order: the result does not depend on the
 * thread count. */
#define OPSMITH_RMS_NORM_CPU_DWEIGHT_CHUNKS 64

/* Workspace of the CPU backward: dweight partial sums over a fixed number
 * of row chunks; 0 without dweight. */
OPSMITH_INTERNAL size_t opsmith_internal_rms_norm_bwd_cpu_workspace(opsmith_dtype x_dtype, int64_t rows, int64_t n,
                                                                    int with_dweight);

/* The CPU kernels' arguments and row loops (csrc/cpu/rms_norm.c), shared
 * with the residual-add op: with `res` set, the forward first stores
 * h = round_x(x + res) (row stride hs) and normalises h; with `dh` set, the
 * backward adds dh to dx rounded to x's dtype. Arguments already checked. */
typedef struct opsmith_internal_rms_norm_cpu_fwd {
    opsmith_dtype xd, wd, yd;
    int64_t rows, n, xs, ys;
    const void *x, *w;
    void *y, *inv_rms;
    double offset, eps;
    int llama;
    const void *res; /* NULL: plain RMSNorm */
    int64_t rs;
    void *h;
    int64_t hs;
} opsmith_internal_rms_norm_cpu_fwd;

typedef struct opsmith_internal_rms_norm_cpu_bwd {
    opsmith_dtype xd, wd, gd; /* gd: dy's dtype */
    int64_t rows, n, dys, xs, dxs;
    const void *dy, *x, *w, *inv_rms;
    void *dx;
    double offset;
    int llama;
    const void *dh; /* NULL: plain RMSNorm */
    int64_t dhs;
} opsmith_internal_rms_norm_cpu_bwd;

/* The forward over every row (rows >= 1). */
OPSMITH_INTERNAL void opsmith_internal_rms_norm_cpu_fwd_run(const opsmith_internal_rms_norm_cpu_fwd *a);

/* The backward over every row (rows >= 1); dweight (NULL: none, else in
 * a->wd) through `workspace` of opsmith_internal_rms_norm_bwd_cpu_workspace bytes. */
OPSMITH_INTERNAL void opsmith_internal_rms_norm_cpu_bwd_run(const opsmith_internal_rms_norm_cpu_bwd *a,
                                                            void *dweight, void *workspace);

/* The CUDA kernel family ("resident", "staged", "generic") a contiguous,
 * aligned RMSNorm call of this shape takes on the current device, and the
 * CTAs that share a row (cluster size) in *ctas; for tests. CUDA builds only. */
OPSMITH_INTERNAL const char *opsmith_internal_rms_norm_cuda_plan(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                                 int backward, int *ctas);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_INTERNAL_RMS_NORM_H */
