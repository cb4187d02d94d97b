/* Gated activations (GLU family): SwiGLU and GeGLU, the MLP nonlinearity of
 * Llama, Mistral, Qwen2 (SiLU) and Gemma (GELU, tanh approximation).
 * Included by opsmith.h; conventions there.
 *
 * Forward:
 *     y[r, i] = act(gate[r, i]) * up[r, i]
 * Backward:
 *     dgate[r, i] = dy[r, i] * up[r, i] * act'(gate[r, i])
 *     dup[r, i]   = dy[r, i] * act(gate[r, i])
 *     h[r, i]     = act(gate[r, i]) * up[r, i]     (optional: the forward's y,
 *                                                   recomputed in the same pass)
 * act is silu(g) = g * sigmoid(g), gelu(g) = g * Phi(g) (Phi the normal CDF,
 * through erf) or gelu_tanh(g) = g/2 * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3))).
 *
 * Shapes: every tensor is (rows, n) with its own row stride in elements
 * (innermost dimension contiguous). All tensors have `dtype` (f64, f32, f16,
 * bf16); the arithmetic runs in opsmith_dtype_accumulate(dtype) and each
 * output is rounded once. rows may be 0 (nothing is done); n must be >= 1.
 *
 * A fused gate-up projection produces one packed tensor (rows, 2n), gate in
 * columns [0, n) and up in [n, 2n). It is passed as two pointers into the
 * same buffer: gate = p, up = p + n, both with row stride 2n (or the
 * packed tensor's own row stride); its gradient likewise as dgate = q,
 * dup = q + n into one (rows, 2n) buffer. Inputs may overlap each other
 * freely (they are only read).
 *
 * Aliasing: an output may be exactly one of the inputs (same pointer and
 * row stride: in place, e.g. y = up), and is otherwise apart from every
 * input; outputs are apart from each other. "Apart" allows interleaved
 * rows: the packed halves above (dgate = q, dup = q + n, one row stride)
 * share no element, so they count as apart.
 *
 * Pointers need only the alignment of their element type. The kernels take
 * 16-byte vector loads where every pointer and row stride allows them, and
 * a scalar path otherwise (odd widths, misaligned slices). */
#ifndef OPSMITH_GLU_H
#define OPSMITH_GLU_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum opsmith_glu_activation {
    OPSMITH_GLU_ACTIVATION_SILU = 0,      /* SwiGLU */
    OPSMITH_GLU_ACTIVATION_GELU = 1,      /* GeGLU, exact (erf) GELU */
    OPSMITH_GLU_ACTIVATION_GELU_TANH = 2, /* GeGLU, tanh-approximated GELU */
    OPSMITH_GLU_ACTIVATION_COUNT
} opsmith_glu_activation;

/* "silu", "gelu", "gelu_tanh"; "?" for a value outside the enum. */
OPSMITH_API const char *opsmith_glu_activation_name(opsmith_glu_activation activation);

OPSMITH_API opsmith_status opsmith_glu_fwd_cpu(opsmith_glu_activation activation, opsmith_dtype dtype,
                                               int64_t rows, int64_t n,
                                               const void *gate, int64_t gate_row_stride,
                                               const void *up, int64_t up_row_stride,
                                               void *y, int64_t y_row_stride);

/* h may be NULL (not computed): the memory-lean training mode passes it to
 * get act(gate) * up back without keeping the forward's y. */
OPSMITH_API opsmith_status opsmith_glu_bwd_cpu(opsmith_glu_activation activation, opsmith_dtype dtype,
                                               int64_t rows, int64_t n,
                                               const void *dy, int64_t dy_row_stride,
                                               const void *gate, int64_t gate_row_stride,
                                               const void *up, int64_t up_row_stride,
                                               void *dgate, int64_t dgate_row_stride,
                                               void *dup, int64_t dup_row_stride,
                                               void *h, int64_t h_row_stride);

/* The CUDA launchers take the same arguments as device pointers, plus the
 * stream they run on. */
OPSMITH_API opsmith_status opsmith_glu_fwd_cuda(opsmith_glu_activation activation, opsmith_dtype dtype,
                                                int64_t rows, int64_t n,
                                                const void *gate, int64_t gate_row_stride,
                                                const void *up, int64_t up_row_stride,
                                                void *y, int64_t y_row_stride, opsmith_cuda_stream stream);

OPSMITH_API opsmith_status opsmith_glu_bwd_cuda(opsmith_glu_activation activation, opsmith_dtype dtype,
                                                int64_t rows, int64_t n,
                                                const void *dy, int64_t dy_row_stride,
                                                const void *gate, int64_t gate_row_stride,
                                                const void *up, int64_t up_row_stride,
                                                void *dgate, int64_t dgate_row_stride,
                                                void *dup, int64_t dup_row_stride,
                                                void *h, int64_t h_row_stride, opsmith_cuda_stream stream);

/* Scalar references, the specification: plain loops over contiguous
 * float64 (rows, n) arrays; h may be NULL. */
OPSMITH_API void opsmith_glu_fwd_reference(opsmith_glu_activation activation, int64_t rows, int64_t n,
                                           const double *gate, const double *up, double *y);
OPSMITH_API void opsmith_glu_bwd_reference(opsmith_glu_activation activation, int64_t rows, int64_t n,
                                           const double *dy, const double *gate, const double *up,
                                           double *dgate, double *dup, double *h);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_GLU_H */
