// RMSNorm bridge: checks, outputs, device guard, stream; the arithmetic is
// the C library's (csrc/cpu/rms_norm.c, csrc/cuda/rms_norm.cu).
#include <ATen/ops/empty.h>

#include <cmath>
#include <limits>

#include "bridge.h"
#include "tensor_args.h"

namespace opsmith {
namespace {

constexpr const char *kOp = "rms_norm";

double default_eps(at::ScalarType t) {
    switch (t) {
    case at::kDouble: return std::numeric_limits<double>::epsilon();
    case at::kFloat: return std::numeric_limits<float>::epsilon();
    case at::kHalf: return 0.0009765625;   // torch.finfo(torch.float16).eps
    case at::kBFloat16: return 0.0078125;  // torch.finfo(torch.bfloat16).eps
    default: return 0.0;
    }
}

// Checks x and weight; returns the C dtype. Shared by forward and backward.
opsmith_dtype check_x_weight(const at::Tensor &x, const std::optional<at::Tensor> &weight) {
    check_device_supported(x, kOp);
    TORCH_CHECK(x.dim() >= 1, kOp, ": x must have at least 1 dimension, got a 0-dim tensor");
    const opsmith_dtype dtype = dtype_of(x, kOp, "x");
    TORCH_CHECK(x.size(-1) > 0, kOp, ": x must have a non-empty last dimension, got shape ",
                text(x.sizes()));
    if (weight.has_value()) {
        const at::Tensor &w = *weight;
        check_same_device(w, x, kOp, "weight");
        check_same_dtype(w, x, kOp, "weight");
        TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), kOp, ": weight must have shape [",
                    text(x.size(-1)), "] (last dim of x), got ", text(w.sizes()));
    }
    return dtype;
}

const void *weight_data(const std::optional<at::Tensor> &weight, at::Tensor &holder) {
    if (!weight.has_value()) return nullptr;
    holder = weight->contiguous();
    return holder.data_ptr();
}

} // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor &x,
                                                const std::optional<at::Tensor> &weight,
                                                std::optional<double> eps) {
    const opsmith_dtype dtype = check_x_weight(x, weight);
    const double e = eps.has_value() ? *eps : default_eps(x.scalar_type());
    TORCH_CHECK(std::isfinite(e) && e >= 0.0, kOp, ": eps must be a finite number >= 0, got ", text(e));

    const Rows xr = as_rows(x);
    at::Tensor w_holder;
    const void *w = weight_data(weight, w_holder);
    at::Tensor y = at::empty(x.sizes(), x.options());
    at::Tensor inv_rms = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(accumulate_type(x)));
    if (xr.rows == 0) return {y, inv_rms};

    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (x.is_cuda()) {
        const c10::cuda::CUDAGuard guard(x.device());
        status = opsmith_rms_norm_fwd_cuda(dtype, xr.rows, xr.n, xr.data(), xr.stride, w, e,
                                           y.data_ptr(), inv_rms.data_ptr(),
                                           at::cuda::getCurrentCUDAStream(x.get_device()).stream());
    } else
#endif
        status = opsmith_rms_norm_fwd_cpu(dtype, xr.rows, xr.n, xr.data(), xr.stride, w, e,
                                          y.data_ptr(), inv_rms.data_ptr());
    check_status(status, kOp);
    return {y, inv_rms};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor &dy, const at::Tensor &x,
                                                const std::optional<at::Tensor> &weight,
                                                const at::Tensor &inv_rms) {
    const opsmith_dtype dtype = check_x_weight(x, weight);
    check_same_device(dy, x, kOp, "dy");
    check_same_dtype(dy, x, kOp, "dy");
    TORCH_CHECK(dy.sizes() == x.sizes(), kOp, ": dy must have the shape of x ", text(x.sizes()), ", got ",
                text(dy.sizes()));
    check_same_device(inv_rms, x, kOp, "inv_rms");
    TORCH_CHECK(inv_rms.scalar_type() == accumulate_type(x), kOp, ": inv_rms must be ",
                     accumulate_type(x), " for ", x.scalar_type(), " x, got ", inv_rms.scalar_type());
    TORCH_CHECK(inv_rms.sizes() == x.sizes().slice(0, x.dim() - 1), kOp,
                ": inv_rms must have shape x.shape[:-1] ", text(x.sizes().slice(0, x.dim() - 1)),
                ", got ", text(inv_rms.sizes()));

    const Rows xr = as_rows(x), dyr = as_rows(dy);
    const at::Tensor inv = inv_rms.contiguous();
    at::Tensor w_holder;
    const void *w = weight_data(weight, w_holder);
    at::Tensor dx = at::empty(x.sizes(), x.options());
    at::Tensor dweight = at::empty({w ? x.size(-1) : 0}, x.options());

    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (x.is_cuda()) {
        const c10::cuda::CUDAGuard guard(x.device());
        const size_t ws_bytes = opsmith_rms_norm_bwd_cuda_workspace_size(dtype, xr.rows, xr.n, w != nullptr);
        // from the caching allocator, so graph capture and stream ordering hold
        at::Tensor ws = at::empty({(int64_t)ws_bytes}, x.options().dtype(at::kByte));
        status = opsmith_rms_norm_bwd_cuda(dtype, xr.rows, xr.n, dyr.data(), dyr.stride, xr.data(),
                                           xr.stride, w, inv.data_ptr(), dx.data_ptr(),
                                           w ? dweight.data_ptr() : nullptr,
                                           ws_bytes ? ws.data_ptr() : nullptr, ws_bytes,
                                           at::cuda::getCurrentCUDAStream(x.get_device()).stream());
    } else
#endif
        status = opsmith_rms_norm_bwd_cpu(dtype, xr.rows, xr.n, dyr.data(), dyr.stride, xr.data(),
                                          xr.stride, w, inv.data_ptr(), dx.data_ptr(),
                                          w ? dweight.data_ptr() : nullptr);
    check_status(status, kOp);
    return {dx, dweight};
}

} // namespace opsmith
