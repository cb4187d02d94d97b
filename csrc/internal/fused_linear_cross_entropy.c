/* fused_linear_cross_entropy: argument validation, the default chunk and the
 * workspace layout, shared by the CPU and CUDA launchers. */
#include <math.h>

#include "internal/cross_entropy.h"
#include "internal/fused_linear_cross_entropy.h"

#define DEFAULT_BUDGET ((size_t)512 << 20)

int64_t opsmith_fused_linear_cross_entropy_chunk_rows(opsmith_dtype dtype, int64_t rows, int64_t vocab,
                                                      size_t budget_bytes) {
    const size_t size = opsmith_dtype_is_float(dtype) ? opsmith_dtype_size(dtype) : 4;
    const size_t budget = budget_bytes ? budget_bytes : DEFAULT_BUDGET;
    int64_t c = vocab > 0 ? (int64_t)(budget / (size * (size_t)vocab)) : rows;
    if (c >= 256) c = c / 128 * 128;
    if (c > rows) c = rows;
    return c < 1 ? 1 : c;
}

opsmith_dtype opsmith_internal_flce_grad_dtype(opsmith_dtype dtype, int fp32_dweight) {
    return fp32_dweight == OPSMITH_FLCE_GRADS_FLOAT32 && opsmith_dtype_size(dtype) == 2 ? OPSMITH_DTYPE_F32 : dtype;
}

static size_t up(size_t b) { return (b + 255) / 256 * 256; }

opsmith_flce_layout opsmith_internal_flce_layout(opsmith_dtype dtype, int64_t rows, int64_t dim, int64_t vocab,
                                                 int64_t chunk, int fp32_dweight, int cuda) {
    opsmith_flce_layout l = {0};
    if (chunk <= 0) chunk = opsmith_fused_linear_cross_entropy_chunk_rows(dtype, rows, vocab, 0);
    if (chunk > rows) chunk = rows > 0 ? rows : 1;
    const size_t size = opsmith_dtype_size(dtype), acc = dtype == OPSMITH_DTYPE_F64 ? 8 : 4;
    const int narrow = size == 2;
    const size_t R = (size_t)(rows > 0 ? rows : 0), C = (size_t)chunk, D = (size_t)dim, V = (size_t)vocab;
    size_t at = 0;
#define TAKE(field, bytes) (l.field = at, at += up(bytes))
    if (cuda) {
        TAKE(loss_rows, R * acc);
        TAKE(z_rows, R * acc);
        TAKE(denom_wsum, 5 * acc); /* denom, wsum; the products' alpha, 0, 1 */
        TAKE(logits, C * V * size);
        if (fp32_dweight == OPSMITH_FLCE_DWEIGHT_ACC_FLOAT32 && narrow) TAKE(dweight32, V * D * 4);
        TAKE(dbias, V * acc);
        TAKE(lt, OPSMITH_FLCE_CUBLASLT_WORKSPACE);
    } else {
        /* a chunk's: room for the z-loss rows whatever z_loss is (chunk-sized) */
        l.ce_bytes = opsmith_cross_entropy_fwd_workspace_size(dtype, chunk, 1.0);
        TAKE(logits, C * V * size);
        TAKE(ce, l.ce_bytes);
        TAKE(dweight, V * D * acc);
        TAKE(dbias, V * acc);
    }
#undef TAKE
    l.total = at;
    return l;
}

size_t opsmith_fused_linear_cross_entropy_workspace_size(opsmith_dtype dtype, int64_t rows, int64_t dim, int64_t vocab,
                                                         int64_t chunk_rows, int fp32_dweight, int cuda) {
    if ((unsigned)dtype >= OPSMITH_DTYPE_COUNT || !opsmith_dtype_is_float(dtype) || dim < 1 || vocab < 1) return 0;
    return opsmith_internal_flce_layout(dtype, rows, dim, vocab, chunk_rows, fp32_dweight, cuda).total;
}

opsmith_status opsmith_internal_flce_check(const char *op, opsmith_dtype dtype, int64_t rows, int64_t dim,
                                           int64_t vocab, const void *hidden, int64_t hidden_row_stride,
                                           const void *weight, const void *bias, const int64_t *target, double ls,
                                           double z_loss, double softcap, int reduction, int64_t *chunk_rows,
                                           int fp32_dweight, const void *loss, const void *z_out, const void *dhidden,
                                           const void *dweight, const void *dbias, const int64_t *error, int cuda,
                                           const void *workspace, size_t workspace_bytes) {
    const opsmith_status bad = OPSMITH_STATUS_INVALID_ARGUMENT;
    opsmith_internal_clear_error();
    if ((unsigned)dtype >= OPSMITH_DTYPE_COUNT || !opsmith_dtype_is_float(dtype))
        return opsmith_internal_fail(OPSMITH_STATUS_UNSUPPORTED_DTYPE,
                                     "%s: dtype must be f64, f32, f16 or bf16, got %s (%d)", op,
                                     opsmith_dtype_name(dtype), (int)dtype);
    if (rows < 0) return opsmith_internal_fail(bad, "%s: rows (%lld) must be >= 0", op, (long long)rows);
    if (dim < 1) return opsmith_internal_fail(bad, "%s: dim (%lld) must be >= 1", op, (long long)dim);
    if (vocab < 1) return opsmith_internal_fail(bad, "%s: vocab (%lld) must be >= 1", op, (long long)vocab);
    const opsmith_status options = opsmith_internal_cross_entropy_check_options(op, dtype, ls, z_loss, softcap);
    if (options != OPSMITH_STATUS_SUCCESS) return options;
    if (reduction != OPSMITH_CROSS_ENTROPY_REDUCTION_SUM && reduction != OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN)
        return opsmith_internal_fail(bad, "%s: reduction (%d) must be 1 (sum) or 2 (mean)", op, reduction);
    if (fp32_dweight != OPSMITH_FLCE_GRADS_IN_DTYPE && fp32_dweight != OPSMITH_FLCE_DWEIGHT_ACC_FLOAT32 &&
        fp32_dweight != OPSMITH_FLCE_GRADS_FLOAT32)
        return opsmith_internal_fail(bad, "%s: fp32_dweight (%d) must be 0, 1 or 2 (an opsmith_flce_grads)", op,
                                     fp32_dweight);
    if (*chunk_rows <= 0) *chunk_rows = opsmith_fused_linear_cross_entropy_chunk_rows(dtype, rows, vocab, 0);
    if (!loss) return opsmith_internal_fail(bad, "%s: loss is NULL", op);
    if (cuda && !error) return opsmith_internal_fail(bad, "%s: error is NULL", op);
    if (!weight) return opsmith_internal_fail(bad, "%s: weight is NULL", op);
    if (!workspace && workspace_bytes)
        return opsmith_internal_fail(bad, "%s: workspace is NULL", op);
    opsmith_status s = opsmith_internal_check_workspace(
        op, workspace, workspace_bytes,
        opsmith_internal_flce_layout(dtype, rows, dim, vocab, *chunk_rows, fp32_dweight, cuda).total);
    if (s != OPSMITH_STATUS_SUCCESS) return s;
    if (rows > 0) {
        if (!hidden) return opsmith_internal_fail(bad, "%s: hidden is NULL", op);
        if (!target) return opsmith_internal_fail(bad, "%s: target is NULL", op);
        if (rows > 1 && hidden_row_stride < dim)
            return opsmith_internal_fail(bad, "%s: hidden_row_stride (%lld) must be >= dim (%lld) when rows > 1", op,
                                         (long long)hidden_row_stride, (long long)dim);
    }
    const size_t size = opsmith_dtype_size(dtype),
                 gsize = opsmith_dtype_size(opsmith_internal_flce_grad_dtype(dtype, fp32_dweight));
    const struct { const char *name; const void *p; size_t align; } ptrs[] = {
        {"hidden", hidden, size}, {"weight", weight, size}, {"bias", bias, size},
        {"dhidden", dhidden, gsize}, {"dweight", dweight, gsize}, {"dbias", dbias, gsize},
    };
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
        if (opsmith_internal_misaligned(ptrs[i].p, ptrs[i].align))
            return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: %s (%p) is not aligned to %zu bytes", op,
                                         ptrs[i].name, ptrs[i].p, ptrs[i].align);
    const size_t acc = dtype == OPSMITH_DTYPE_F64 ? 8 : 4;
    if (opsmith_internal_misaligned(loss, acc))
        return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: loss (%p) is not aligned to %zu bytes", op, loss,
                                     acc);
    if (opsmith_internal_misaligned(z_out, acc))
        return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: z_out (%p) is not aligned to %zu bytes", op, z_out,
                                     acc);
    if (opsmith_internal_misaligned(target, 8))
        return opsmith_internal_fail(OPSMITH_STATUS_MISALIGNED, "%s: target (%p) is not aligned to 8 bytes", op,
                                     (const void *)target);
    return OPSMITH_STATUS_SUCCESS;
}
