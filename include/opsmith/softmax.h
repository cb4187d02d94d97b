/* softmax and log_softmax over the last dim of (rows, n). Included by
 * opsmith.h; conventions there.
 *
 * Forward (log = 0: softmax; log = 1: log_softmax), per row:
 *     lse      = log(sum_i exp(x[i]))                 (online max and sum)
 *     y[i]     = exp(x[i] - lse)        or  x[i] - lse
 * Backward, from the forward's output y:
 *     softmax:     dx[i] = y[i] * (dy[i] - sum_j dy[j] y[j])
 *     log_softmax: dx[i] = dy[i] - exp(y[i]) * sum_j dy[j]
 * Shapes: x, y, dy and dx are (rows, n), each with its own row stride. All
 * tensors have `dtype` (f64, f32, f16, bf16); the arithmetic runs in
 * opsmith_dtype_accumulate(dtype). rows may be 0 (nothing is done); n >= 1.
 * A row of -inf gives NaN (0 / 0), as PyTorch. No workspace.
 * Aliasing: y may be x (in place), dx may be dy; nothing else may overlap. */
#ifndef OPSMITH_SOFTMAX_H
#define OPSMITH_SOFTMAX_H

#ifdef __cplusplus
extern "C" {
#endif

OPSMITH_API opsmith_status opsmith_softmax_fwd_cpu(opsmith_dtype dtype, int64_t rows, int64_t n, const void *x,
                                                   int64_t x_row_stride, int log, void *y, int64_t y_row_stride);

OPSMITH_API opsmith_status opsmith_softmax_bwd_cpu(opsmith_dtype dtype, int64_t rows, int64_t n, const void *dy,
                                                   int64_t dy_row_stride, const void *y, int64_t y_row_stride, int log,
                                                   void *dx, int64_t dx_row_stride);

/* The CUDA launchers take the same arguments as device pointers, plus the
 * stream they run on. */
OPSMITH_API opsmith_status opsmith_softmax_fwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n, const void *x,
                                                    int64_t x_row_stride, int log, void *y, int64_t y_row_stride,
                                                    opsmith_cuda_stream stream);

OPSMITH_API opsmith_status opsmith_softmax_bwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n, const void *dy,
                                                    int64_t dy_row_stride, const void *y, int64_t y_row_stride,
                                                    int log, void *dx, int64_t dx_row_stride,
                                                    opsmith_cuda_stream stream);

/* Scalar references, the specification the kernels are tested against:
 * plain loops over float64 data, no threads; all arrays contiguous. */
OPSMITH_API void opsmith_softmax_fwd_reference(int64_t rows, int64_t n, const double *x, int log, double *y);
OPSMITH_API void opsmith_softmax_bwd_reference(int64_t rows, int64_t n, const double *dy, const double *y, int log,
                                               double *dx);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_SOFTMAX_H */
