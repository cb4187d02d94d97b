/* RMSNorm on CUDA: the C launchers. The kernels and their launch plans are
 * in rms_norm_kernels.cuh (shared with the residual-add op). */
#include "rms_norm_kernels.cuh"

using namespace opsmith;

extern "C" opsmith_status opsmith_rms_norm_ex_fwd_cuda(opsmith_dtype x_dtype, opsmith_dtype weight_dtype,
                                                       opsmith_dtype y_dtype, int64_t rows, int64_t n, const void *x,
                                                       int64_t x_row_stride, const void *weight, double offset,
                                                       double eps, opsmith_rms_norm_casting casting, void *y,
                                                       int64_t y_row_stride, void *inv_rms,
                                                       opsmith_cuda_stream stream) {
    weight_dtype = kernel_weight_dtype(x_dtype, weight_dtype, weight);
    opsmith_status st = opsmith_internal_rms_norm_check("rms_norm_fwd_cuda", x_dtype, weight_dtype, y_dtype, rows, n,
                                                        x, x_row_stride, 0, nullptr, 0, weight, offset, eps, casting,
                                                        y, y_row_stride, inv_rms, nullptr);
    if (st != OPSMITH_STATUS_SUCCESS || rows == 0) return st;
    const bool llama = casting == OPSMITH_RMS_NORM_CASTING_LLAMA;
    return dispatch_mixed(x_dtype, weight_dtype, y_dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto k) {
        using K = decltype(k);
        const Opts<AccK<K>> o{(AccK<K>)offset, llama};
        return fwd<K>(rows, n, x, x_row_stride, weight, o, eps, y, y_row_stride, inv_rms, stream);
    });
}

extern "C" opsmith_status opsmith_rms_norm_fwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n, const void *x,
                                                    int64_t x_row_stride, const void *weight, double eps, void *y,
                                                    int64_t y_row_stride, void *inv_rms, opsmith_cuda_stream stream) {
    return opsmith_rms_norm_ex_fwd_cuda(dtype, dtype, dtype, rows, n, x, x_row_stride, weight, 0.0, eps,
                                        OPSMITH_RMS_NORM_CASTING_NONE, y, y_row_stride, inv_rms, stream);
}

/* Which kernel family a contiguous, 16-byte aligned call of this shape
 * takes on the current device: "resident", "split" (a short batch's
 * backward with dweight), "staged" (with the CTAs a row in ctas), "ring",
 * or "generic". Tests use it to keep each plan reachable. */
extern "C" const char *opsmith_internal_rms_norm_cuda_plan(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                           int backward, int *ctas) {
    const Launch none{nullptr, 0, 0, 0, 0, "generic"};
    Launch l = dispatch_mixed(dtype, dtype, dtype, none, [&](auto k) {
        using K = decltype(k);
        if (backward) {
            const Launch split = bwd_split_launch<K, false>(rows, n);
            return split.grid ? split : bwd_launch<K>(rows, n, true);
        }
        int stages = 0;
        return fwd_plan<K>(rows, n, &stages);
    });
    if (l.grid <= 0) l.family = "generic", l.ctas = 0;
    if (ctas) *ctas = l.ctas;
    return l.family;
}

extern "C" size_t opsmith_rms_norm_ex_bwd_cuda_workspace_size(
    opsmith_dtype x_dtype, opsmith_dtype weight_dtype, opsmith_dtype dy_dtype, int64_t rows, int64_t n,
    const void *dy, int64_t dy_row_stride, const void *x, int64_t x_row_stride, const void *weight, double offset,
    opsmith_rms_norm_casting casting, const void *inv_rms, void *dx, int64_t dx_row_stride, void *dweight) {
    (void)dy, (void)dy_row_stride, (void)x, (void)x_row_stride, (void)offset, (void)casting, (void)inv_rms;
    (void)dx, (void)dx_row_stride;
    if (!weight || !dweight || rows <= 0 || n <= 0) return 0;
    const int64_t groups = dispatch_mixed(x_dtype, weight_dtype, dy_dtype, (int64_t)0, [&](auto k) {
        return bwd_workspace_rows<decltype(k)>(rows, n);
    });
    return (size_t)(groups * n) * opsmith_dtype_size(opsmith_dtype_accumulate(x_dtype));
}

extern "C" size_t opsmith_rms_norm_bwd_cuda_workspace_size(opsmith_dtype dtype, int64_t rows, int64_t n,
                                                           const void *dy, int64_t dy_row_stride, const void *x,
                                                           int64_t x_row_stride, const void *weight,
                                                           const void *inv_rms, void *dx, int64_t dx_row_stride,
                                                           void *dweight) {
    return opsmith_rms_norm_ex_bwd_cuda_workspace_size(dtype, dtype, dtype, rows, n, dy, dy_row_stride, x,
                                                       x_row_stride, weight, 0.0, OPSMITH_RMS_NORM_CASTING_NONE,
                                                       inv_rms, dx, dx_row_stride, dweight);
}

extern "C" opsmith_status opsmith_rms_norm_ex_bwd_cuda(opsmith_dtype x_dtype, opsmith_dtype weight_dtype,
                                                       opsmith_dtype dy_dtype, int64_t rows, int64_t n,
                                                       const void *dy, int64_t dy_row_stride, const void *x,
                                                       int64_t x_row_stride, const void *weight, double offset,
                                                       opsmith_rms_norm_casting casting, const void *inv_rms,
                                                       void *dx, int64_t dx_row_stride, void *dweight,
                                                       void *workspace, size_t workspace_bytes,
                                                       opsmith_cuda_stream stream) {
    static const char op[] = "rms_norm_bwd_cuda";
    void *dw = weight ? dweight : nullptr;
    weight_dtype = kernel_weight_dtype(x_dtype, weight_dtype, weight);
    opsmith_status st = opsmith_internal_rms_norm_check(op, x_dtype, weight_dtype, dy_dtype, rows, n, x, x_row_stride,
                                                        1, dy, dy_row_stride, weight, offset, 0.0, casting, dx,
                                                        dx_row_stride, inv_rms, dw);
    if (st != OPSMITH_STATUS_SUCCESS) return st;
    if (rows == 0) {
        /* no rows: the weight gradient is an empty sum */
        if (dw && cudaMemsetAsync(dw, 0, (size_t)n * opsmith_dtype_size(weight_dtype), stream) != cudaSuccess)
            return launch_status();
        return OPSMITH_STATUS_SUCCESS;
    }
    st = opsmith_internal_check_workspace(
        op, workspace, workspace_bytes,
        opsmith_rms_norm_ex_bwd_cuda_workspace_size(x_dtype, weight_dtype, dy_dtype, rows, n, dy, dy_row_stride, x,
                                                    x_row_stride, weight, offset, casting, inv_rms, dx,
                                                    dx_row_stride, dw));
    if (st != OPSMITH_STATUS_SUCCESS) return st;
    const bool llama = casting == OPSMITH_RMS_NORM_CASTING_LLAMA;
    return dispatch_mixed(x_dtype, weight_dtype, dy_dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto k) {
        using K = decltype(k);
        const Opts<AccK<K>> o{(AccK<K>)offset, llama};
        return bwd<K>(rows, n, dy, dy_row_stride, x, x_row_stride, weight, o, inv_rms, dx, dx_row_stride, dw,
                      workspace, stream);
    });
}

extern "C" opsmith_status opsmith_rms_norm_bwd_cuda(opsmith_dtype dtype, int64_t rows, int64_t n, const void *dy,
                                                    int64_t dy_row_stride, const void *x, int64_t x_row_stride,
                                                    const void *weight, const void *inv_rms, void *dx,
                                                    int64_t dx_row_stride, void *dweight, void *workspace,
                                                    size_t workspace_bytes, opsmith_cuda_stream stream) {
    return opsmith_rms_norm_ex_bwd_cuda(dtype, dtype, dtype, rows, n, dy, dy_row_stride, x, x_row_stride, weight,
                                        0.0, OPSMITH_RMS_NORM_CASTING_NONE, inv_rms, dx, dx_row_stride, dweight,
                                        workspace, workspace_bytes, stream);
}
