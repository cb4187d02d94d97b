// RMSNorm in PyTorch: the bridge (checks, outputs, device guard, stream; the
// arithmetic is the C library's, csrc/cpu/rms_norm.c and
// csrc/cuda/rms_norm.cu), its route A binding and its route B registration.
//
// Compiled twice: into opsmith._C (route B: schemas, CPU/CUDA kernels and
// autograd in the dispatcher) and, with OPSMITH_ROUTE_A, into
// opsmith._pybind (route A: its OPSMITH_PYBIND binding only, registering
// nothing with the dispatcher).
#include <ATen/ops/empty.h>

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

#include "tensor_args.h"

#if OPSMITH_ROUTE_A
#include "pybind_registry.h"
#else
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "autograd.h"
#endif

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

// y, inv_rms = rms_norm_fwd(x, weight, eps): RMSNorm over the last dim of x.
// inv_rms has shape x.shape[:-1], float32 (float64 for float64 x).
// eps defaults to torch.finfo(x.dtype).eps, as torch.nn.functional.rms_norm.
std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor &x, const std::optional<at::Tensor> &weight,
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
        status = opsmith_rms_norm_fwd_cuda(dtype, xr.rows, xr.n, xr.data(), xr.stride, w, e, y.data_ptr(), xr.n,
                                           inv_rms.data_ptr(), at::cuda::getCurrentCUDAStream(x.get_device()).stream());
    } else
#endif
    {
        use_torch_cpu_threads();
        status = opsmith_rms_norm_fwd_cpu(dtype, xr.rows, xr.n, xr.data(), xr.stride, w, e, y.data_ptr(), xr.n,
                                          inv_rms.data_ptr());
    }
    check_status(status, kOp);
    return {y, inv_rms};
}

// dx, dweight = rms_norm_bwd(dy, x, weight, inv_rms); dweight has shape [0]
// when weight is None.
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor &dy, const at::Tensor &x,
                                                const std::optional<at::Tensor> &weight, const at::Tensor &inv_rms) {
    const opsmith_dtype dtype = check_x_weight(x, weight);
    check_same_device(dy, x, kOp, "dy");
    check_same_dtype(dy, x, kOp, "dy");
    TORCH_CHECK(dy.sizes() == x.sizes(), kOp, ": dy must have the shape of x ", text(x.sizes()), ", got ",
                text(dy.sizes()));
    check_same_device(inv_rms, x, kOp, "inv_rms");
    TORCH_CHECK(inv_rms.scalar_type() == accumulate_type(x), kOp, ": inv_rms must be ", accumulate_type(x), " for ",
                x.scalar_type(), " x, got ", inv_rms.scalar_type());
    TORCH_CHECK(inv_rms.sizes() == x.sizes().slice(0, x.dim() - 1), kOp, ": inv_rms must have shape x.shape[:-1] ",
                text(x.sizes().slice(0, x.dim() - 1)), ", got ", text(inv_rms.sizes()));

    const Rows xr = as_rows(x), dyr = as_rows(dy);
    const at::Tensor inv = inv_rms.contiguous();
    at::Tensor w_holder;
    const void *w = weight_data(weight, w_holder);
    at::Tensor dx = at::empty(x.sizes(), x.options());
    at::Tensor dweight = at::empty({w ? x.size(-1) : 0}, x.options());
    void *dw = w ? dweight.data_ptr() : nullptr;

    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (x.is_cuda()) {
        const c10::cuda::CUDAGuard guard(x.device());
        const size_t ws_bytes = opsmith_rms_norm_bwd_cuda_workspace_size(
            dtype, xr.rows, xr.n, dyr.data(), dyr.stride, xr.data(), xr.stride, w, inv.data_ptr(), dx.data_ptr(),
            xr.n, dw);
        at::Tensor ws = workspace(ws_bytes, x);
        status = opsmith_rms_norm_bwd_cuda(dtype, xr.rows, xr.n, dyr.data(), dyr.stride, xr.data(), xr.stride, w,
                                           inv.data_ptr(), dx.data_ptr(), xr.n, dw, data_or_null(ws), ws_bytes,
                                           at::cuda::getCurrentCUDAStream(x.get_device()).stream());
    } else
#endif
    {
        use_torch_cpu_threads();
        const size_t ws_bytes = opsmith_rms_norm_bwd_cpu_workspace_size(
            dtype, xr.rows, xr.n, dyr.data(), dyr.stride, xr.data(), xr.stride, w, inv.data_ptr(), dx.data_ptr(),
            xr.n, dw);
        at::Tensor ws = workspace(ws_bytes, x);
        status = opsmith_rms_norm_bwd_cpu(dtype, xr.rows, xr.n, dyr.data(), dyr.stride, xr.data(), xr.stride, w,
                                          inv.data_ptr(), dx.data_ptr(), xr.n, dw, data_or_null(ws), ws_bytes);
    }
    check_status(status, kOp);
    return {dx, dweight};
}

#if OPSMITH_ROUTE_A

} // namespace opsmith

OPSMITH_PYBIND(rms_norm) {
    namespace py = pybind11;
    m.def("rms_norm_fwd", &opsmith::rms_norm_fwd, "RMSNorm forward: (y, inv_rms)", py::arg("x"), py::arg("weight"),
          py::arg("eps") = py::none());
    m.def("rms_norm_bwd", &opsmith::rms_norm_bwd, "RMSNorm backward: (dx, dweight)", py::arg("dy"), py::arg("x"),
          py::arg("weight"), py::arg("inv_rms"));
}

namespace opsmith {

#else // route B

namespace {

constexpr const char *kNotTwice =
    "rms_norm: double backward is not supported (the backward of rms_norm is not differentiable); "
    "compute higher-order gradients with torch.nn.functional.rms_norm";

auto &rms_norm_fwd_op() {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("opsmith::rms_norm_fwd", "")
                         .typed<decltype(rms_norm_fwd)>();
    return op;
}

auto &rms_norm_bwd_op() {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("opsmith::rms_norm_bwd", "")
                         .typed<decltype(rms_norm_bwd)>();
    return op;
}

// grad_fn of y: dx and dweight from the saved x, weight and inv_rms.
struct RMSNormBackward : public torch::autograd::Node {
    SavedVariable x_, weight_, inv_rms_;
    bool has_weight_ = false;

    variable_list apply(variable_list &&grads) override {
        const at::Tensor &dy = grads[0];
        if (!dy.defined()) return {at::Tensor(), at::Tensor()};
        const at::Tensor x = x_.unpack();
        const std::optional<at::Tensor> w =
            has_weight_ ? std::optional<at::Tensor>(weight_.unpack()) : std::nullopt;
        at::Tensor dx, dw;
        {
            at::AutoDispatchBelowADInplaceOrView below_autograd;
            std::tie(dx, dw) = rms_norm_bwd_op().call(dy, x, w, inv_rms_.unpack());
        }
        if (!has_weight_) dw = at::Tensor();
        refuse_double_backward(kNotTwice, {dx, dw}, dy, x, w);
        return {dx, dw};
    }
    void release_variables() override {
        x_.reset_data();
        weight_.reset_data();
        inv_rms_.reset_data();
    }
    std::string name() const override { return "RMSNormBackward"; }
};

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd_autograd(const at::Tensor &x, const std::optional<at::Tensor> &weight,
                                                         std::optional<double> eps) {
    refuse_forward_ad(kOp, x, tensor_or_undefined(weight));
    at::Tensor y, inv_rms;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        std::tie(y, inv_rms) = rms_norm_fwd_op().call(x, weight, eps);
    }
    if (torch::autograd::compute_requires_grad(x, weight)) {
        auto node = std::make_shared<RMSNormBackward>();
        node->set_next_edges(torch::autograd::collect_next_edges(x, weight));
        node->x_ = SavedVariable(x, false);
        node->has_weight_ = weight.has_value();
        if (weight.has_value()) node->weight_ = SavedVariable(*weight, false);
        node->inv_rms_ = SavedVariable(inv_rms, false);
        torch::autograd::set_history(y, node);
        // inv_rms is a saved statistic, not a result to differentiate through
    }
    return {y, inv_rms};
}

// The raw backward op on tensors that require grad: its results must not
// look differentiable.
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_autograd(const at::Tensor &dy, const at::Tensor &x,
                                                         const std::optional<at::Tensor> &weight,
                                                         const at::Tensor &inv_rms) {
    refuse_forward_ad(kOp, dy, x, tensor_or_undefined(weight));
    at::Tensor dx, dw;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        std::tie(dx, dw) = rms_norm_bwd_op().call(dy, x, weight, inv_rms);
    }
    refuse_double_backward(kNotTwice, {dx, dw}, dy, x, weight);
    return {dx, dw};
}

} // namespace

#endif // route B

} // namespace opsmith

#if !OPSMITH_ROUTE_A

TORCH_LIBRARY_FRAGMENT(opsmith, m) {
    m.set_python_module("opsmith.ops.rms_norm");
    m.def("rms_norm_fwd(Tensor x, Tensor? weight, float? eps=None) -> (Tensor y, Tensor inv_rms)");
    m.def("rms_norm_bwd(Tensor dy, Tensor x, Tensor? weight, Tensor inv_rms) -> (Tensor dx, Tensor dweight)");
}

TORCH_LIBRARY_IMPL(opsmith, CPU, m) {
    m.impl("rms_norm_fwd", &opsmith::rms_norm_fwd);
    m.impl("rms_norm_bwd", &opsmith::rms_norm_bwd);
}

#if OPSMITH_WITH_CUDA
TORCH_LIBRARY_IMPL(opsmith, CUDA, m) {
    m.impl("rms_norm_fwd", &opsmith::rms_norm_fwd);
    m.impl("rms_norm_bwd", &opsmith::rms_norm_bwd);
}
#endif

TORCH_LIBRARY_IMPL(opsmith, Autograd, m) {
    m.impl("rms_norm_fwd", &opsmith::rms_norm_fwd_autograd);
    m.impl("rms_norm_bwd", &opsmith::rms_norm_bwd_autograd);
}

#endif // route B
