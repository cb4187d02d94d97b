// LayerNorm in PyTorch: the bridge (checks, outputs, device guard, stream; the
// arithmetic is the C library's, csrc/cpu/layer_norm.c and
// csrc/cuda/layer_norm.cu), its route A binding and its route B registration
// (schemas, CPU/CUDA kernels, autocast, autograd).
//
// Compiled twice, like every bridge file: into opsmith._C (route B) and, with
// OPSMITH_ROUTE_A, into opsmith._pybind (its OPSMITH_PYBIND binding only).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "tensor_args.h"

#if OPSMITH_ROUTE_A
#include "pybind_registry.h"
#else
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "autograd.h"
#endif

namespace opsmith {
namespace {

constexpr const char *kOp = "layer_norm";

// The affine parameters' dtype (weight's, else bias's, else x's), checked:
// x's own or float32, as torch.nn.functional.layer_norm takes them.
opsmith_dtype check_params(const at::Tensor &x, const std::optional<at::Tensor> &weight,
                           const std::optional<at::Tensor> &bias) {
    const int64_t n = x.size(-1);
    std::optional<at::ScalarType> param_type;
    for (const auto &[t, name] : {std::pair{&weight, "weight"}, std::pair{&bias, "bias"}}) {
        if (!t->has_value()) continue;
        const at::Tensor &p = **t;
        check_same_device(p, x, kOp, name);
        TORCH_CHECK(p.dim() == 1 && p.size(0) == n, kOp, ": ", name, " must have shape [", text(n),
                    "] (last dim of x), got ", text(p.sizes()));
        TORCH_CHECK(p.scalar_type() == x.scalar_type() || p.scalar_type() == at::kFloat, kOp, ": ", name,
                    " must have the dtype of x (", x.scalar_type(), ") or float32, got ", p.scalar_type());
        TORCH_CHECK(!param_type || *param_type == p.scalar_type(), kOp,
                    ": weight and bias must have the same dtype, got ", *param_type, " and ", p.scalar_type());
        param_type = p.scalar_type();
    }
    if (!param_type) return dtype_of(x, kOp, "x");
    return *param_type == at::kFloat ? OPSMITH_DTYPE_F32 : dtype_of(x, kOp, "x");
}

opsmith_dtype check_x(const at::Tensor &x) {
    check_device_supported(x, kOp);
    TORCH_CHECK(x.dim() >= 1, kOp, ": x must have at least 1 dimension, got a 0-dim tensor");
    const opsmith_dtype dtype = dtype_of(x, kOp, "x");
    return dtype;
}

const void *param_data(const std::optional<at::Tensor> &p, at::Tensor &holder) {
    if (!p.has_value()) return nullptr;
    holder = p->contiguous();
    return holder.data_ptr();
}

at::ScalarType scalar_of(opsmith_dtype d) {
    switch (d) {
    case OPSMITH_DTYPE_F64: return at::kDouble;
    case OPSMITH_DTYPE_F32: return at::kFloat;
    case OPSMITH_DTYPE_F16: return at::kHalf;
    default: return at::kBFloat16;
    }
}

void check_stat(const at::Tensor &s, const at::Tensor &x, const char *name) {
    check_same_device(s, x, kOp, name);
    TORCH_CHECK(s.scalar_type() == accumulate_type(x), kOp, ": ", name, " must be ", accumulate_type(x), " for ",
                x.scalar_type(), " x, got ", s.scalar_type());
    TORCH_CHECK(s.sizes() == x.sizes().slice(0, x.dim() - 1), kOp, ": ", name, " must have shape x.shape[:-1] ",
                text(x.sizes().slice(0, x.dim() - 1)), ", got ", text(s.sizes()));
}

} // namespace

// y, mean, rstd = layer_norm_fwd(x, weight, bias, eps): LayerNorm over the
// last dim of x, as F.layer_norm(x, (n,), weight, bias, eps). y has x's
// dtype; mean and rstd have shape x.shape[:-1], float32 (float64 for
// float64 x). weight and bias: x's dtype or float32.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(const at::Tensor &x,
                                                              const std::optional<at::Tensor> &weight,
                                                              const std::optional<at::Tensor> &bias, double eps) {
    const opsmith_dtype xd = check_x(x);
    const opsmith_dtype wd = check_params(x, weight, bias);
    TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, kOp, ": eps must be a finite number >= 0, got ", text(eps));

    const Rows xr = as_rows(x);
    at::Tensor w_holder, b_holder;
    const void *w = param_data(weight, w_holder), *b = param_data(bias, b_holder);
    at::Tensor y = empty_output(x.sizes(), x.options());
    const auto stat_options = x.options().dtype(accumulate_type(x));
    at::Tensor mean = empty_output(x.sizes().slice(0, x.dim() - 1), stat_options);
    at::Tensor rstd = empty_output(x.sizes().slice(0, x.dim() - 1), stat_options);
    if (xr.rows == 0) return {y, empty_row_stats(mean), empty_row_stats(rstd)}; // no rows, or rows of width 0

    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (x.is_cuda()) {
        const c10::cuda::CUDAGuard guard(x.device());
        status = opsmith_layer_norm_fwd_cuda(xd, wd, xr.rows, xr.n, xr.data(), xr.stride, w, b, eps, y.data_ptr(),
                                             xr.n, mean.data_ptr(), rstd.data_ptr(),
                                             at::cuda::getCurrentCUDAStream(x.get_device()).stream());
    } else
#endif
    {
        use_torch_cpu_threads();
        status = opsmith_layer_norm_fwd_cpu(xd, wd, xr.rows, xr.n, xr.data(), xr.stride, w, b, eps, y.data_ptr(),
                                            xr.n, mean.data_ptr(), rstd.data_ptr());
    }
    check_status(status, kOp);
    return {y, mean, rstd};
}

// dx, dweight, dbias = layer_norm_bwd(dy, x, weight, bias, mean, rstd,
// weight_grad, bias_grad): bias is read for its dtype and presence only.
// dweight (dbias) has the weight's (bias's) dtype, shape [0] when weight
// (bias) is None or its gradient is not asked for (a frozen parameter: its
// column sums are skipped).
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(const at::Tensor &dy, const at::Tensor &x,
                                                              const std::optional<at::Tensor> &weight,
                                                              const std::optional<at::Tensor> &bias,
                                                              const at::Tensor &mean, const at::Tensor &rstd,
                                                              bool weight_grad, bool bias_grad) {
    const opsmith_dtype xd = check_x(x);
    const opsmith_dtype wd = check_params(x, weight, bias);
    check_same_device(dy, x, kOp, "dy");
    check_same_dtype(dy, x, kOp, "dy");
    TORCH_CHECK(dy.sizes() == x.sizes(), kOp, ": dy must have the shape of x ", text(x.sizes()), ", got ",
                text(dy.sizes()));
    check_stat(mean, x, "mean");
    check_stat(rstd, x, "rstd");

    const Rows xr = as_rows(x), dyr = as_rows(dy);
    const at::Tensor m = mean.contiguous(), r = rstd.contiguous();
    at::Tensor w_holder;
    const void *w = param_data(weight, w_holder);
    const auto param_options = x.options().dtype(scalar_of(wd));
    at::Tensor dx = empty_output(x.sizes(), x.options());
    const bool want_dw = w && weight_grad, want_db = bias.has_value() && bias_grad;
    at::Tensor dweight = empty_output({want_dw ? x.size(-1) : 0}, param_options);
    at::Tensor dbias = empty_output({want_db ? x.size(-1) : 0}, param_options);
    void *dw = want_dw ? dweight.data_ptr() : nullptr;
    void *db = want_db ? dbias.data_ptr() : nullptr;
    if (xr.n == 0) return {dx, dweight, dbias}; // rows of width 0: every gradient is empty

    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (x.is_cuda()) {
        const c10::cuda::CUDAGuard guard(x.device());
        const size_t ws_bytes = opsmith_layer_norm_bwd_cuda_workspace_size(
            xd, wd, xr.rows, xr.n, dyr.data(), dyr.stride, xr.data(), xr.stride, w, m.data_ptr(), r.data_ptr(),
            dx.data_ptr(), xr.n, dw, db);
        at::Tensor ws = workspace(ws_bytes, x);
        status = opsmith_layer_norm_bwd_cuda(xd, wd, xr.rows, xr.n, dyr.data(), dyr.stride, xr.data(), xr.stride, w,
                                             m.data_ptr(), r.data_ptr(), dx.data_ptr(), xr.n, dw, db,
                                             data_or_null(ws), ws_bytes,
                                             at::cuda::getCurrentCUDAStream(x.get_device()).stream());
    } else
#endif
    {
        use_torch_cpu_threads();
        const size_t ws_bytes = opsmith_layer_norm_bwd_cpu_workspace_size(
            xd, wd, xr.rows, xr.n, dyr.data(), dyr.stride, xr.data(), xr.stride, w, m.data_ptr(), r.data_ptr(),
            dx.data_ptr(), xr.n, dw, db);
        at::Tensor ws = workspace(ws_bytes, x);
        status = opsmith_layer_norm_bwd_cpu(xd, wd, xr.rows, xr.n, dyr.data(), dyr.stride, xr.data(), xr.stride, w,
                                            m.data_ptr(), r.data_ptr(), dx.data_ptr(), xr.n, dw, db,
                                            data_or_null(ws), ws_bytes);
    }
    check_status(status, kOp);
    return {dx, dweight, dbias};
}

#if OPSMITH_ROUTE_A

} // namespace opsmith

OPSMITH_PYBIND(layer_norm) {
    namespace py = pybind11;
    m.def("layer_norm_fwd", &opsmith::layer_norm_fwd, "LayerNorm forward: (y, mean, rstd)", py::arg("x"),
          py::arg("weight"), py::arg("bias"), py::arg("eps") = 1e-5);
    m.def("layer_norm_bwd", &opsmith::layer_norm_bwd, "LayerNorm backward: (dx, dweight, dbias)", py::arg("dy"),
          py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("mean"), py::arg("rstd"),
          py::arg("weight_grad") = true, py::arg("bias_grad") = true);
}

namespace opsmith {

#else // route B

namespace {

constexpr const char *kNotTwice =
    "layer_norm: double backward is not supported (the backward of layer_norm is not differentiable); "
    "compute higher-order gradients with torch.nn.functional.layer_norm";

const auto &layer_norm_fwd_op() { return dispatcher_op<layer_norm_fwd>("opsmith::layer_norm_fwd"); }
const auto &layer_norm_bwd_op() { return dispatcher_op<layer_norm_bwd>("opsmith::layer_norm_bwd"); }

std::optional<at::Tensor> unpack_optional(bool present, SavedVariable &v) {
    return present ? std::optional<at::Tensor>(v.unpack()) : std::nullopt;
}

// grad_fn of y: dx, dweight and dbias from the saved x, weight, mean and rstd.
struct LayerNormBackward : public torch::autograd::Node {
    SavedVariable x_, weight_, bias_, mean_, rstd_;
    bool has_weight_ = false, has_bias_ = false;

    variable_list apply(variable_list &&grads) override {
        const at::Tensor &dy = grads[0];
        if (!dy.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
        const at::Tensor x = x_.unpack();
        const std::optional<at::Tensor> w = unpack_optional(has_weight_, weight_);
        const std::optional<at::Tensor> b = unpack_optional(has_bias_, bias_);
        // column sums only for the parameters this backward delivers to (a
        // frozen one, or autograd.grad not asking for it: skipped)
        const bool weight_grad = has_weight_ && task_should_compute_output(1);
        const bool bias_grad = has_bias_ && task_should_compute_output(2);
        at::Tensor dx, dw, db;
        {
            at::AutoDispatchBelowADInplaceOrView below_autograd;
            std::tie(dx, dw, db) =
                layer_norm_bwd_op().call(dy, x, w, b, mean_.unpack(), rstd_.unpack(), weight_grad, bias_grad);
        }
        if (!weight_grad) dw = at::Tensor();
        if (!bias_grad) db = at::Tensor();
        refuse_double_backward(kNotTwice, {dx, dw, db}, dy, x, w, b);
        return {dx, dw, db};
    }
    void release_variables() override {
        x_.reset_data();
        weight_.reset_data();
        bias_.reset_data();
        mean_.reset_data();
        rstd_.reset_data();
    }
    std::string name() const override { return "LayerNormBackward"; }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_autograd(const at::Tensor &x,
                                                                       const std::optional<at::Tensor> &weight,
                                                                       const std::optional<at::Tensor> &bias,
                                                                       double eps) {
    refuse_forward_ad(kOp, x, tensor_or_undefined(weight), tensor_or_undefined(bias));
    at::Tensor y, mean, rstd;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        std::tie(y, mean, rstd) = layer_norm_fwd_op().call(x, weight, bias, eps);
    }
    if (torch::autograd::compute_requires_grad(x, weight, bias)) {
        auto node = std::make_shared<LayerNormBackward>();
        node->set_next_edges(torch::autograd::collect_next_edges(x, weight, bias));
        node->x_ = SavedVariable(x, false);
        node->has_weight_ = weight.has_value();
        node->has_bias_ = bias.has_value();
        if (weight.has_value()) node->weight_ = SavedVariable(*weight, false);
        if (bias.has_value()) node->bias_ = SavedVariable(*bias, false);
        node->mean_ = SavedVariable(mean, false);
        node->rstd_ = SavedVariable(rstd, false);
        torch::autograd::set_history(y, node);
        // mean and rstd are saved statistics, not results to differentiate through
    }
    return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_autograd(const at::Tensor &dy, const at::Tensor &x,
                                                                       const std::optional<at::Tensor> &weight,
                                                                       const std::optional<at::Tensor> &bias,
                                                                       const at::Tensor &mean,
                                                                       const at::Tensor &rstd, bool weight_grad,
                                                                       bool bias_grad) {
    refuse_forward_ad(kOp, dy, x, tensor_or_undefined(weight));
    at::Tensor dx, dw, db;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        std::tie(dx, dw, db) = layer_norm_bwd_op().call(dy, x, weight, bias, mean, rstd, weight_grad, bias_grad);
    }
    refuse_double_backward(kNotTwice, {dx, dw, db}, dy, x, weight);
    return {dx, dw, db};
}

// CUDA autocast runs torch's layer_norm in float32 (it is on autocast's
// float32 list): the inputs are cast, and y comes out float32, as there.
// CPU autocast leaves layer_norm alone, so no AutocastCPU kernel.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_autocast_cuda(const at::Tensor &x,
                                                                            const std::optional<at::Tensor> &weight,
                                                                            const std::optional<at::Tensor> &bias,
                                                                            double eps) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
    const auto cuda = c10::DeviceType::CUDA;
    return layer_norm_fwd_op().call(at::autocast::cached_cast(at::kFloat, x, cuda),
                                    at::autocast::cached_cast(at::kFloat, weight, cuda),
                                    at::autocast::cached_cast(at::kFloat, bias, cuda), eps);
}

} // namespace

#endif // route B

} // namespace opsmith

#if !OPSMITH_ROUTE_A

TORCH_LIBRARY_FRAGMENT(opsmith, m) {
    m.set_python_module("opsmith.ops.layer_norm");
    m.def("layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, float eps=1e-05) -> "
          "(Tensor y, Tensor mean, Tensor rstd)");
    // weight_grad / bias_grad False: that gradient is not computed (shape [0])
    m.def("layer_norm_bwd(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, "
          "bool weight_grad=True, bool bias_grad=True) -> (Tensor dx, Tensor dweight, Tensor dbias)");
}

TORCH_LIBRARY_IMPL(opsmith, CPU, m) {
    m.impl("layer_norm_fwd", &opsmith::layer_norm_fwd);
    m.impl("layer_norm_bwd", &opsmith::layer_norm_bwd);
}

#if OPSMITH_WITH_CUDA
TORCH_LIBRARY_IMPL(opsmith, CUDA, m) {
    m.impl("layer_norm_fwd", &opsmith::layer_norm_fwd);
    m.impl("layer_norm_bwd", &opsmith::layer_norm_bwd);
}
#endif

TORCH_LIBRARY_IMPL(opsmith, Autograd, m) {
    m.impl("layer_norm_fwd", &opsmith::layer_norm_fwd_autograd);
    m.impl("layer_norm_bwd", &opsmith::layer_norm_bwd_autograd);
}

TORCH_LIBRARY_IMPL(opsmith, AutocastCUDA, m) {
    m.impl("layer_norm_fwd", &opsmith::layer_norm_fwd_autocast_cuda);
}

#endif // route B
