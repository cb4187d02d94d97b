/* opsmith: fused operators for transformer training, behind a plain C ABI.
 *
 * Conventions (see README "Layout"):
 *   - every exported symbol starts with opsmith_; launchers are
 *     opsmith_<op>_<fwd|bwd>_<cpu|cuda>;
 *   - tensors cross as (pointer, int64 sizes, int64 row stride in elements);
 *     the innermost dimension is always contiguous;
 *   - no function exits or aborts: each returns an opsmith_status;
 *   - enums are append-only, and each has a _COUNT sentinel that sizes its
 *     name table (checked at compile time).
 * No CUDA header is needed to include this file: a CUDA stream travels as
 * opsmith_cuda_stream, which is the same type as cudaStream_t. */
#ifndef OPSMITH_H
#define OPSMITH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum opsmith_status {
    OPSMITH_STATUS_SUCCESS = 0,
    OPSMITH_STATUS_INVALID_ARGUMENT = 1, /* a size, stride or pointer is out of range */
    OPSMITH_STATUS_UNSUPPORTED_DTYPE = 2,
    OPSMITH_STATUS_MISALIGNED = 3,       /* a pointer is not aligned to its element size */
    OPSMITH_STATUS_OUT_OF_MEMORY = 4,    /* host scratch memory could not be allocated */
    OPSMITH_STATUS_WORKSPACE_TOO_SMALL = 5,
    OPSMITH_STATUS_CUDA_ERROR = 6,       /* a CUDA launch or runtime call failed */
    OPSMITH_STATUS_CUDA_UNAVAILABLE = 7, /* the library was built without CUDA */
    OPSMITH_STATUS_COUNT
} opsmith_status;

/* A static string for every status, e.g. "invalid argument". Never NULL. */
const char *opsmith_status_string(opsmith_status status);

/* The CUDA runtime's own message for the last CUDA error seen by a launcher
 * on this thread, or "" when none. Static storage; valid until the next call. */
const char *opsmith_last_cuda_error(void);

typedef enum opsmith_dtype {
    OPSMITH_DTYPE_F64 = 0,
    OPSMITH_DTYPE_F32 = 1,
    OPSMITH_DTYPE_F16 = 2,  /* IEEE binary16 */
    OPSMITH_DTYPE_BF16 = 3, /* bfloat16: the top half of a binary32 */
    OPSMITH_DTYPE_COUNT
} opsmith_dtype;

/* "f64", "f32", "f16", "bf16"; "?" for a value outside the enum. */
const char *opsmith_dtype_name(opsmith_dtype dtype);
/* Bytes per element; 0 for a value outside the enum. */
size_t opsmith_dtype_size(opsmith_dtype dtype);
/* The type statistics are kept and accumulated in: F64 for F64, else F32. */
opsmith_dtype opsmith_dtype_accumulate(opsmith_dtype dtype);

/* 1 when the CUDA launchers were compiled in, 0 when they return
 * OPSMITH_STATUS_CUDA_UNAVAILABLE. */
int opsmith_has_cuda(void);

typedef struct CUstream_st *opsmith_cuda_stream; /* == cudaStream_t; NULL = legacy default stream */

/* ---------------------------------------------------------------------------
 * RMSNorm over the last dimension:
 *     y[r, i]   = x[r, i] * inv_rms[r] * weight[i]
 *     inv_rms[r] = 1 / sqrt(mean_i(x[r, i]^2) + eps)
 * Shapes: x is (rows, n), row r at x + r * x_row_stride elements;
 *         weight is (n) contiguous, or NULL for no weight;
 *         y is (rows, n) contiguous; inv_rms is (rows) in
 *         opsmith_dtype_accumulate(dtype), saved for the backward pass.
 * Sums run in the accumulate type whatever the storage type.
 * rows may be 0 (nothing is done); n must be >= 1; eps must be >= 0.
 * ------------------------------------------------------------------------ */
opsmith_status opsmith_rms_norm_fwd_cpu(opsmith_dtype dtype, int64_t rows, int64_t n,
                                        const void *x, int64_t x_row_stride,
                                        const void *weight, double eps,
                                        void *y, void *inv_rms);

/* Backward:
 *     g[r, i]  = dy[r, i] * weight[i]            (weight = 1 when NULL)
 *     dx[r, i] = inv_rms[r] * (g[r, i] - x[r, i] * inv_rms[r]^2 * mean_j(g[r, j] * x[r, j]))
 *     dweight[i] = sum_r dy[r, i] * x[r, i] * inv_rms[r]
 * Shapes: dy and x are (rows, n) with their own row strides; inv_rms is the
 * forward's; dx is (rows, n) contiguous; dweight is (n), written only when
 * both weight and dweight are non-NULL. The dweight sum is deterministic:
 * the same inputs give the same bits whatever the thread count. */
opsmith_status opsmith_rms_norm_bwd_cpu(opsmith_dtype dtype, int64_t rows, int64_t n,
                                        const void *dy, int64_t dy_row_stride,
                                        const void *x, int64_t x_row_stride,
                                        const void *weight, const void *inv_rms,
                                        void *dx, void *dweight);

/* The CUDA launchers take the same arguments, device pointers, and run
 * asynchronously on `stream` of the current device. They never synchronise. */
opsmith_status opsmith_rms_norm_fwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n,
                                         const void *x, int64_t x_row_stride,
                                         const void *weight, double eps,
                                         void *y, void *inv_rms,
                                         opsmith_cuda_stream stream);

/* Device scratch the CUDA backward needs, in bytes (0 when none). The
 * caller allocates it (so an allocator that is being graph-captured can),
 * 16-byte aligned, and passes it with its size. */
size_t opsmith_rms_norm_bwd_cuda_workspace_size(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                int with_dweight);

opsmith_status opsmith_rms_norm_bwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n,
                                         const void *dy, int64_t dy_row_stride,
                                         const void *x, int64_t x_row_stride,
                                         const void *weight, const void *inv_rms,
                                         void *dx, void *dweight,
                                         void *workspace, size_t workspace_bytes,
                                         opsmith_cuda_stream stream);

/* ---------------------------------------------------------------------------
 * Scalar references: the specification each fast kernel is tested against.
 * Plain loops over float64 data (inputs already widened to double), double
 * accumulation, no threads. Same shapes as above; all arrays contiguous;
 * weight and dweight may be NULL.
 * ------------------------------------------------------------------------ */
void opsmith_rms_norm_fwd_reference(int64_t rows, int64_t n, const double *x,
                                    const double *weight, double eps,
                                    double *y, double *inv_rms);
void opsmith_rms_norm_bwd_reference(int64_t rows, int64_t n, const double *dy,
                                    const double *x, const double *weight,
                                    const double *inv_rms, double *dx, double *dweight);

/* Element conversions between the storage types and double, for callers
 * that prepare inputs or read outputs (tests, benchmarks). Round to nearest
 * even; NaN stays NaN. */
double opsmith_load_as_double(opsmith_dtype dtype, const void *base, int64_t index);
void opsmith_store_from_double(opsmith_dtype dtype, void *base, int64_t index, double value);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_H */
