/* Rotary position embedding (RoPE) of q and k, in one call for both.
 * Included by opsmith.h; conventions there.
 *
 * Shapes. q is [batch, q_heads, seq, head_dim] addressed through three
 * strides in elements (batch, seq, head; the last dim contiguous), so the
 * [B, H, S, D] and [B, S, H, D] layouts and strided views into a fused qkv
 * projection are all just strides. k likewise with its own k_heads (grouped
 * query attention) and strides; k may be NULL (q alone). Each output has its
 * own strides too.
 *
 * cos and sin give, for every (b, s), rotary_dim values (rotary_dim even,
 * 2 <= rotary_dim <= head_dim):
 *   - position_ids NULL: row (b, s) is at cos + b * cs_batch_stride +
 *     s * cs_seq_stride (Hugging Face's [B, S, R] cos, or [S, R] with
 *     cs_batch_stride 0);
 *   - position_ids non-NULL (int64, element (b, s) at b * pos_batch_stride +
 *     s * pos_seq_stride): a [max_pos, R] cache, row p at cos + p *
 *     cs_seq_stride (cs_batch_stride unused). A position outside [0, max_pos)
 *     is an error on the CPU; on CUDA (no host synchronisation) the rotated
 *     part of that (b, s) row comes out NaN.
 * cos and sin share their strides.
 *
 * The rotation, on pairs (a, b) of the first rotary_dim elements of every
 * head vector x (the rest, [rotary_dim, head_dim), is copied through):
 *   rotate-half (Llama, NeoX, Hugging Face): a = i, b = i + R/2, i < R/2
 *   interleaved (GPT-J):                      a = 2i, b = 2i + 1, i < R/2
 *   forward:   out[a] = x[a] cos[a] - x[b] sin[a]
 *              out[b] = x[b] cos[b] + x[a] sin[b]
 * which is exactly out = x * cos + rot(x) * sin with rot(x)[a] = -x[b],
 * rot(x)[b] = x[a]: Hugging Face's `q * cos + rotate_half(q) * sin` for
 * rotate-half (where cos[i] == cos[i + R/2], the two halves duplicated),
 * and GPT-J's `x * cos + rotate_every_two(x) * sin` for interleaved (where
 * cos[2i] == cos[2i + 1], each frequency repeated: repeat_interleave of the
 * half-length table). Every one of the R values is read as given.
 *   backward (the transpose, i.e. the rotation by -theta):
 *              dx[a] = dy[a] cos[a] + dy[b] sin[b]
 *              dx[b] = dy[b] cos[b] - dy[a] sin[a]
 * so the backward needs only cos and sin (no saved activations).
 *
 * dtype is q's and k's (and the outputs'); cs_dtype is cos/sin's: dtype
 * itself, or f32 beside f16/bf16 q and k (a float32 cache). The arithmetic
 * runs in opsmith_dtype_accumulate(dtype), each output rounded once.
 *
 * Aliasing: each output may be exactly its own input (same pointer and
 * strides: in place) and is otherwise apart from every input; q's and k's
 * operands may interleave in one buffer (heads of one fused qkv row) as long
 * as they share no element. batch or seq may be 0 (nothing is done). */
#ifndef OPSMITH_ROTARY_H
#define OPSMITH_ROTARY_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum opsmith_rotary_style {
    OPSMITH_ROTARY_STYLE_HALF = 0,        /* rotate-half: pairs (i, i + R/2) */
    OPSMITH_ROTARY_STYLE_INTERLEAVED = 1, /* GPT-J: pairs (2i, 2i + 1) */
    OPSMITH_ROTARY_STYLE_COUNT
} opsmith_rotary_style;

/* "half", "interleaved"; "?" for a value outside the enum. */
OPSMITH_API const char *opsmith_rotary_style_name(opsmith_rotary_style style);

/* Where one of q, k, q_out, k_out lives: heads and strides in elements. */
typedef struct opsmith_rotary_view {
    int64_t heads;
    int64_t batch_stride, seq_stride, head_stride;
} opsmith_rotary_view;

/* Everything a call needs but the pointers of q and k. */
typedef struct opsmith_rotary_params {
    opsmith_rotary_style style;
    opsmith_dtype dtype, cs_dtype;
    int64_t batch, seq, head_dim, rotary_dim;
    opsmith_rotary_view q, q_out, k, k_out; /* k, k_out ignored when k is NULL */
    int64_t cs_batch_stride, cs_seq_stride;
    int64_t pos_batch_stride, pos_seq_stride, max_pos; /* used when position_ids is non-NULL */
} opsmith_rotary_params;

/* Forward: q_out, k_out = rope(q), rope(k). k and k_out NULL together. */
OPSMITH_API opsmith_status opsmith_rotary_fwd_cpu(const opsmith_rotary_params *p, const void *q, void *q_out,
                                                  const void *k, void *k_out, const void *cos, const void *sin,
                                                  const int64_t *position_ids);
/* Backward: dq, dk = rope^T(dq_out), rope^T(dk_out): the same arguments,
 * with the output gradients as q, k and the input gradients as q_out, k_out. */
OPSMITH_API opsmith_status opsmith_rotary_bwd_cpu(const opsmith_rotary_params *p, const void *dq_out, void *dq,
                                                  const void *dk_out, void *dk, const void *cos, const void *sin,
                                                  const int64_t *position_ids);

/* The CUDA launchers: the same arguments as device pointers (p itself on
 * the host, read during the call), plus the stream. One launch for q and k. */
OPSMITH_API opsmith_status opsmith_rotary_fwd_cuda(const opsmith_rotary_params *p, const void *q, void *q_out,
                                                   const void *k, void *k_out, const void *cos, const void *sin,
                                                   const int64_t *position_ids, opsmith_cuda_stream stream);
OPSMITH_API opsmith_status opsmith_rotary_bwd_cuda(const opsmith_rotary_params *p, const void *dq_out, void *dq,
                                                   const void *dk_out, void *dk, const void *cos, const void *sin,
                                                   const int64_t *position_ids, opsmith_cuda_stream stream);

/* Scalar reference, the specification: x is a contiguous float64
 * [rows, head_dim] array of head vectors, cs (cos, sin) contiguous
 * [rows, rotary_dim] (the row each head vector uses); backward != 0 applies
 * the transpose. */
OPSMITH_API void opsmith_rotary_reference(opsmith_rotary_style style, int backward, int64_t rows, int64_t head_dim,
                                          int64_t rotary_dim, const double *x, const double *cos,
                                          const double *sin, double *out);

#ifdef __cplusplus
}
#endif
#endif /* OPSMITH_ROTARY_H */
