// Residual add + RMSNorm in PyTorch: the bridge (checks, outputs, device
// guard, stream; the arithmetic is the C library's,
// csrc/cpu/fused_add_rms_norm.c and csrc/cuda/fused_add_rms_norm.cu), its
// route A binding and its route B registration. Compiled twice, as
// rms_norm.cpp is: into opsmith._C (route B) and, with OPSMITH_ROUTE_A,
// into opsmith._pybind (route A).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <optional>
#include <string>
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

constexpr const char *kOp = "fused_add_rms_norm";

struct Options {
    opsmith_dtype x_dtype, weight_dtype, y_dtype; // y_dtype: y's (forward), dy's (backward)
    double offset;
    opsmith_rms_norm_casting casting;
};

opsmith_rms_norm_casting casting_of(c10::string_view mode) {
    if (mode == "none") return OPSMITH_RMS_NORM_CASTING_NONE;
    if (mode == "llama") return OPSMITH_RMS_NORM_CASTING_LLAMA;
    if (mode == "gemma") return OPSMITH_RMS_NORM_CASTING_GEMMA;
    TORCH_CHECK(false, kOp, ": casting_mode must be 'none', 'llama' or 'gemma', got '", std::string(mode), "'");
}

bool is_half(const at::Tensor &t) { return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16; }

// x (or h in the backward, named `x_arg`), weight, the options and the
// dtype y (or dy) has; `y_arg` names where that dtype came from.
Options check_call(const at::Tensor &x, const char *x_arg, const at::Tensor &w, double offset,
                   c10::string_view casting_mode, at::ScalarType y_type, const char *y_arg) {
    check_device_supported(x, kOp);
    TORCH_CHECK(x.dim() >= 1, kOp, ": ", x_arg, " must have at least 1 dimension, got a 0-dim tensor");
    Options o;
    o.x_dtype = dtype_of(x, kOp, x_arg);
    TORCH_CHECK(w.device() == x.device(), kOp, ": weight must be on the same device as ", x_arg, " (", x.device(),
                "), got ", w.device());
    TORCH_CHECK(w.scalar_type() == x.scalar_type() || (is_half(x) && w.scalar_type() == at::kFloat), kOp,
                ": weight must have the dtype of ", x_arg, " (", x.scalar_type(), is_half(x) ? ") or float32" : ")",
                ", got ", w.scalar_type());
    TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), kOp, ": weight must have shape [", text(x.size(-1)),
                "] (last dim of ", x_arg, "), got ", text(w.sizes()));
    o.weight_dtype = dtype_of(w, kOp, "weight");
    const bool weight_is_float = w.scalar_type() == at::kFloat;
    TORCH_CHECK(y_type == x.scalar_type() || (is_half(x) && y_type == at::kFloat && weight_is_float), kOp, ": ",
                y_arg, " must be ", x_arg, "'s dtype (", x.scalar_type(), ")",
                is_half(x) ? (weight_is_float ? " or float32" : ", or float32 with a float32 weight") : "", ", got ",
                y_type);
    o.y_dtype = y_type == at::kFloat ? OPSMITH_DTYPE_F32 : o.x_dtype;
    TORCH_CHECK(std::isfinite(offset), kOp, ": offset must be finite, got ", text(offset));
    o.offset = offset;
    o.casting = casting_of(casting_mode);
    return o;
}

// A tensor that must match x (or h) in device, dtype and shape.
void check_like(const at::Tensor &t, const char *arg, const at::Tensor &x, const char *x_arg) {
    TORCH_CHECK(t.device() == x.device(), kOp, ": ", arg, " must be on the same device as ", x_arg, " (", x.device(),
                "), got ", t.device());
    TORCH_CHECK(t.scalar_type() == x.scalar_type(), kOp, ": ", arg, " must have the dtype of ", x_arg, " (",
                x.scalar_type(), "), got ", t.scalar_type());
    TORCH_CHECK(t.sizes() == x.sizes(), kOp, ": ", arg, " must have the shape of ", x_arg, " ", text(x.sizes()),
                ", got ", text(t.sizes()));
}

Options check_fwd(const at::Tensor &x, const at::Tensor &residual, const at::Tensor &weight, double eps,
                  double offset, c10::string_view casting_mode, std::optional<at::ScalarType> out_dtype) {
    const Options o = check_call(x, "x", weight, offset, casting_mode, out_dtype.value_or(x.scalar_type()), "out_dtype");
    check_like(residual, "residual", x, "x");
    TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, kOp, ": eps must be a finite number >= 0, got ", text(eps));
    return o;
}

// y (new), h at h_ptr with row stride h_stride, inv_rms (new, filled).
void run_fwd(const Options &o, const Rows &xr, const Rows &rr, const at::Tensor &x, const void *w, double eps,
             at::Tensor &y, void *h_ptr, int64_t h_stride, at::Tensor &inv_rms) {
    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (x.is_cuda()) {
        const c10::cuda::CUDAGuard guard(x.device());
        status = opsmith_fused_add_rms_norm_fwd_cuda(o.x_dtype, o.weight_dtype, o.y_dtype, xr.rows, xr.n, xr.data(),
                                                     xr.stride, rr.data(), rr.stride, w, o.offset, eps, o.casting,
                                                     y.data_ptr(), xr.n, h_ptr, h_stride, inv_rms.data_ptr(),
                                                     at::cuda::getCurrentCUDAStream(x.get_device()).stream());
    } else
#endif
    {
        use_torch_cpu_threads();
        status = opsmith_fused_add_rms_norm_fwd_cpu(o.x_dtype, o.weight_dtype, o.y_dtype, xr.rows, xr.n, xr.data(),
                                                    xr.stride, rr.data(), rr.stride, w, o.offset, eps, o.casting,
                                                    y.data_ptr(), xr.n, h_ptr, h_stride, inv_rms.data_ptr());
    }
    check_status(status, kOp);
}

} // namespace

// y, h, inv_rms = fused_add_rms_norm_fwd(x, residual, weight, eps, offset,
// casting_mode, out_dtype): h = x + residual (x's dtype), y = RMSNorm of h
// as rms_norm_fwd gives it. inv_rms has shape x.shape[:-1], float32 (float64
// for float64 x).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_fwd(const at::Tensor &x, const at::Tensor &residual,
                                                                      const at::Tensor &weight, double eps,
                                                                      double offset, c10::string_view casting_mode,
                                                                      std::optional<at::ScalarType> out_dtype) {
    const Options o = check_fwd(x, residual, weight, eps, offset, casting_mode, out_dtype);
    const Rows xr = as_rows(x), rr = as_rows(residual);
    const at::Tensor w = weight.contiguous();
    at::Tensor y = empty_output(x.sizes(), x.options().dtype(out_dtype.value_or(x.scalar_type())));
    at::Tensor h = empty_output(x.sizes(), x.options());
    at::Tensor inv_rms = empty_output(x.sizes().slice(0, x.dim() - 1), x.options().dtype(accumulate_type(x)));
    if (xr.rows == 0) return {y, h, empty_row_stats(inv_rms)}; // no rows, or rows of width 0
    run_fwd(o, xr, rr, x, w.data_ptr(), eps, y, h.data_ptr(), xr.n, inv_rms);
    return {y, h, inv_rms};
}

// y = fused_add_rms_norm_(x, residual, weight, ...): the inference form, h
// written over residual (whose rows must be addressable in place), y new.
at::Tensor fused_add_rms_norm_(const at::Tensor &x, at::Tensor &residual, const at::Tensor &weight, double eps,
                               double offset, c10::string_view casting_mode, std::optional<at::ScalarType> out_dtype) {
    const Options o = check_fwd(x, residual, weight, eps, offset, casting_mode, out_dtype);
    const Rows xr = as_rows(x), rr = as_rows(residual);
    TORCH_CHECK(rr.tensor.is_same(residual) || rr.rows == 0, kOp,
                "_: residual is written in place, so its rows must be addressable as they are (last dim "
                "contiguous, rows one stride apart, not overlapping), got strides ", text(residual.strides()));
    const at::Tensor w = weight.contiguous();
    at::Tensor y = empty_output(x.sizes(), x.options().dtype(out_dtype.value_or(x.scalar_type())));
    if (xr.rows == 0) return y;
    at::Tensor inv_rms = empty_output({xr.rows}, x.options().dtype(accumulate_type(x)));
    run_fwd(o, xr, rr, x, w.data_ptr(), eps, y, residual.data_ptr(), rr.stride, inv_rms);
    return y;
}

// dx, dweight = fused_add_rms_norm_bwd(dy, dh, h, weight, inv_rms, offset,
// casting_mode, weight_grad): dx = rms_norm_bwd(dy; h) + dh, the gradient of
// both x and residual; dy or dh None counts as zero. dx has h's dtype, dweight
// the weight's; dweight has shape [0] when weight_grad is false (a frozen
// weight: its column sums are skipped).
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_bwd(const std::optional<at::Tensor> &dy,
                                                          const std::optional<at::Tensor> &dh, const at::Tensor &h,
                                                          const at::Tensor &weight, const at::Tensor &inv_rms,
                                                          double offset, c10::string_view casting_mode,
                                                          bool weight_grad) {
    const Options o =
        check_call(h, "h", weight, offset, casting_mode, dy.has_value() ? dy->scalar_type() : h.scalar_type(), "dy");
    if (dy.has_value()) {
        TORCH_CHECK(dy->device() == h.device(), kOp, ": dy must be on the same device as h (", h.device(), "), got ",
                    dy->device());
        TORCH_CHECK(dy->sizes() == h.sizes(), kOp, ": dy must have the shape of h ", text(h.sizes()), ", got ",
                    text(dy->sizes()));
    }
    if (dh.has_value()) check_like(*dh, "dh", h, "h");
    TORCH_CHECK(inv_rms.device() == h.device(), kOp, ": inv_rms must be on the same device as h (", h.device(),
                "), got ", inv_rms.device());
    TORCH_CHECK(inv_rms.scalar_type() == accumulate_type(h), kOp, ": inv_rms must be ", accumulate_type(h), " for ",
                h.scalar_type(), " h, got ", inv_rms.scalar_type());
    TORCH_CHECK(inv_rms.sizes() == h.sizes().slice(0, h.dim() - 1), kOp, ": inv_rms must have shape h.shape[:-1] ",
                text(h.sizes().slice(0, h.dim() - 1)), ", got ", text(inv_rms.sizes()));
    at::Tensor dx = empty_output(h.sizes(), h.options());
    if (!dy.has_value()) {
        // no gradient reaches y: dx = dh, and the weight gets none
        if (dh.has_value()) dx.copy_(*dh);
        else dx.zero_();
        return {dx, at::zeros({weight_grad ? h.size(-1) : 0}, weight.options())};
    }
    at::Tensor dweight = empty_output({weight_grad ? h.size(-1) : 0}, weight.options());
    void *dw = weight_grad ? dweight.data_ptr() : nullptr;
    const Rows hr = as_rows(h), dyr = as_rows(*dy);
    std::optional<Rows> dhr;
    if (dh.has_value()) dhr = as_rows(*dh);
    const at::Tensor inv = inv_rms.contiguous(), w = weight.contiguous();
    const void *dh_ptr = dhr ? dhr->data() : nullptr;
    const int64_t dh_stride = dhr ? dhr->stride : hr.n;
    if (hr.n == 0) return {dx, dweight}; // rows of width 0: every gradient is empty
    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (h.is_cuda()) {
        const c10::cuda::CUDAGuard guard(h.device());
        const size_t ws_bytes = opsmith_fused_add_rms_norm_bwd_cuda_workspace_size(
            o.x_dtype, o.weight_dtype, o.y_dtype, hr.rows, hr.n, w.data_ptr(), dw);
        at::Tensor ws = workspace(ws_bytes, h);
        status = opsmith_fused_add_rms_norm_bwd_cuda(
            o.x_dtype, o.weight_dtype, o.y_dtype, hr.rows, hr.n, dyr.data(), dyr.stride, dh_ptr, dh_stride, hr.data(),
            hr.stride, w.data_ptr(), o.offset, o.casting, inv.data_ptr(), dx.data_ptr(), hr.n, dw,
            data_or_null(ws), ws_bytes, at::cuda::getCurrentCUDAStream(h.get_device()).stream());
    } else
#endif
    {
        use_torch_cpu_threads();
        const size_t ws_bytes = opsmith_fused_add_rms_norm_bwd_cpu_workspace_size(
            o.x_dtype, o.weight_dtype, o.y_dtype, hr.rows, hr.n, w.data_ptr(), dw);
        at::Tensor ws = workspace(ws_bytes, h);
        status = opsmith_fused_add_rms_norm_bwd_cpu(o.x_dtype, o.weight_dtype, o.y_dtype, hr.rows, hr.n, dyr.data(),
                                                    dyr.stride, dh_ptr, dh_stride, hr.data(), hr.stride, w.data_ptr(),
                                                    o.offset, o.casting, inv.data_ptr(), dx.data_ptr(), hr.n, dw,
                                                    data_or_null(ws), ws_bytes);
    }
    check_status(status, kOp);
    return {dx, dweight};
}

#if OPSMITH_ROUTE_A

} // namespace opsmith

OPSMITH_PYBIND(fused_add_rms_norm) {
    namespace py = pybind11;
    m.def(
        "fused_add_rms_norm_fwd",
        [](const at::Tensor &x, const at::Tensor &residual, const at::Tensor &weight, double eps, double offset,
           const std::string &casting_mode, std::optional<at::ScalarType> out_dtype) {
            return opsmith::fused_add_rms_norm_fwd(x, residual, weight, eps, offset, casting_mode, out_dtype);
        },
        "residual add + RMSNorm forward: (y, h, inv_rms)", py::arg("x"), py::arg("residual"), py::arg("weight"),
        py::arg("eps") = 1e-6, py::arg("offset") = 0.0, py::arg("casting_mode") = "none",
        py::arg("out_dtype") = py::none());
    m.def(
        "fused_add_rms_norm_",
        [](const at::Tensor &x, at::Tensor &residual, const at::Tensor &weight, double eps, double offset,
           const std::string &casting_mode, std::optional<at::ScalarType> out_dtype) {
            return opsmith::fused_add_rms_norm_(x, residual, weight, eps, offset, casting_mode, out_dtype);
        },
        "residual add + RMSNorm, h written over residual: y", py::arg("x"), py::arg("residual"), py::arg("weight"),
        py::arg("eps") = 1e-6, py::arg("offset") = 0.0, py::arg("casting_mode") = "none",
        py::arg("out_dtype") = py::none());
    m.def(
        "fused_add_rms_norm_bwd",
        [](const std::optional<at::Tensor> &dy, const std::optional<at::Tensor> &dh, const at::Tensor &h,
           const at::Tensor &weight, const at::Tensor &inv_rms, double offset, const std::string &casting_mode,
           bool weight_grad) {
            return opsmith::fused_add_rms_norm_bwd(dy, dh, h, weight, inv_rms, offset, casting_mode, weight_grad);
        },
        "residual add + RMSNorm backward: (dx, dweight)", py::arg("dy"), py::arg("dh"), py::arg("h"),
        py::arg("weight"), py::arg("inv_rms"), py::arg("offset") = 0.0, py::arg("casting_mode") = "none",
        py::arg("weight_grad") = true);
}

namespace opsmith {

#else // route B

namespace {

constexpr const char *kNotTwice =
    "fused_add_rms_norm: double backward is not supported (the backward of fused_add_rms_norm is not "
    "differentiable); compute higher-order gradients with x + residual and torch.nn.functional.rms_norm";

const auto &fwd_op() { return dispatcher_op<fused_add_rms_norm_fwd>("opsmith::fused_add_rms_norm_fwd"); }
const auto &bwd_op() { return dispatcher_op<fused_add_rms_norm_bwd>("opsmith::fused_add_rms_norm_bwd"); }
const auto &inplace_op() { return dispatcher_op<fused_add_rms_norm_>("opsmith::fused_add_rms_norm_"); }

// grad_fn of y and h: dx = dresidual and dweight from the saved h (an
// output of this node), weight and inv_rms.
struct FusedAddRMSNormBackward : public torch::autograd::Node {
    SavedVariable h_, weight_, inv_rms_;
    double offset_ = 0.0;
    std::string casting_;

    variable_list apply(variable_list &&grads) override {
        const at::Tensor &dy = grads[0], &dh = grads[1];
        if (!dy.defined() && !dh.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
        const at::Tensor h = h_.unpack(shared_from_this()), w = weight_.unpack();
        // the weight's column sums only when this backward delivers them
        const bool weight_grad = task_should_compute_output(2);
        at::Tensor dx, dw;
        if (!dy.defined()) {
            // only h's own gradient: it passes to x and residual as it is (as
            // an add's backward does); the weight gets none
            dx = dh;
        } else {
            at::AutoDispatchBelowADInplaceOrView below_autograd;
            std::tie(dx, dw) = bwd_op().call(dy, dh.defined() ? std::optional<at::Tensor>(dh) : std::nullopt, h, w,
                                             inv_rms_.unpack(), offset_, casting_, weight_grad);
            if (!weight_grad) dw = at::Tensor();
        }
        refuse_double_backward(kNotTwice, {dx, dw}, dy, dh, h, w);
        // x and residual get the same gradient; autograd copies before it
        // accumulates into a leaf, so sharing the tensor is safe
        return {dx, dx, dw};
    }
    void release_variables() override {
        h_.reset_data();
        weight_.reset_data();
        inv_rms_.reset_data();
    }
    std::string name() const override { return "FusedAddRMSNormBackward"; }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_autograd(const at::Tensor &x, const at::Tensor &residual,
                                                            const at::Tensor &weight, double eps, double offset,
                                                            c10::string_view casting_mode,
                                                            std::optional<at::ScalarType> out_dtype) {
    refuse_forward_ad(kOp, x, residual, weight);
    at::Tensor y, h, inv_rms;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        std::tie(y, h, inv_rms) = fwd_op().call(x, residual, weight, eps, offset, casting_mode, out_dtype);
    }
    if (torch::autograd::compute_requires_grad(x, residual, weight)) {
        auto node = std::make_shared<FusedAddRMSNormBackward>();
        node->set_next_edges(torch::autograd::collect_next_edges(x, residual, weight));
        node->weight_ = SavedVariable(weight, false);
        node->inv_rms_ = SavedVariable(inv_rms, false);
        node->offset_ = offset;
        node->casting_ = std::string(casting_mode);
        torch::autograd::set_history(y, node);
        torch::autograd::set_history(h, node);
        node->h_ = SavedVariable(h, true); // after set_history: saved as this node's output
    }
    return {y, h, inv_rms};
}

std::tuple<at::Tensor, at::Tensor> bwd_autograd(const std::optional<at::Tensor> &dy,
                                                const std::optional<at::Tensor> &dh, const at::Tensor &h,
                                                const at::Tensor &weight, const at::Tensor &inv_rms, double offset,
                                                c10::string_view casting_mode, bool weight_grad) {
    refuse_forward_ad(kOp, tensor_or_undefined(dy), tensor_or_undefined(dh), h, weight);
    at::Tensor dx, dw;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        std::tie(dx, dw) = bwd_op().call(dy, dh, h, weight, inv_rms, offset, casting_mode, weight_grad);
    }
    refuse_double_backward(kNotTwice, {dx, dw}, dy, dh, h, weight);
    return {dx, dw};
}

// The in-place form is for inference: with autograd recording (grad mode on
// and an input that requires grad) it refuses, rather than write over a
// tensor a graph may need.
at::Tensor inplace_autograd(const at::Tensor &x, at::Tensor &residual, const at::Tensor &weight, double eps,
                            double offset, c10::string_view casting_mode, std::optional<at::ScalarType> out_dtype) {
    TORCH_CHECK(!(at::GradMode::is_enabled() && torch::autograd::compute_requires_grad(x, residual, weight)), kOp,
                "_: the in-place form has no autograd; call it under torch.no_grad() or torch.inference_mode(), "
                "or use opsmith.fused_add_rms_norm for training");
    refuse_forward_ad(kOp, x, residual, weight);
    at::Tensor y;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        y = inplace_op().call(x, residual, weight, eps, offset, casting_mode, out_dtype);
    }
    torch::autograd::impl::bump_version(residual); // residual was written: saved copies of it are stale
    return y;
}

} // namespace

#endif // route B

} // namespace opsmith

#if !OPSMITH_ROUTE_A

TORCH_LIBRARY_FRAGMENT(opsmith, m) {
    m.set_python_module("opsmith.ops.fused_add_rms_norm");
    m.def("fused_add_rms_norm_fwd(Tensor x, Tensor residual, Tensor weight, float eps=1e-06, float offset=0., "
          "str casting_mode=\"none\", ScalarType? out_dtype=None) -> (Tensor y, Tensor h, Tensor inv_rms)");
    m.def("fused_add_rms_norm_bwd(Tensor? dy, Tensor? dh, Tensor h, Tensor weight, Tensor inv_rms, "
          "float offset=0., str casting_mode=\"none\", bool weight_grad=True) -> (Tensor dx, Tensor dweight)");
    // h written over residual
    m.def("fused_add_rms_norm_(Tensor x, Tensor(a!) residual, Tensor weight, float eps=1e-06, float offset=0., "
          "str casting_mode=\"none\", ScalarType? out_dtype=None) -> Tensor y");
}

TORCH_LIBRARY_IMPL(opsmith, CPU, m) {
    m.impl("fused_add_rms_norm_fwd", &opsmith::fused_add_rms_norm_fwd);
    m.impl("fused_add_rms_norm_bwd", &opsmith::fused_add_rms_norm_bwd);
    m.impl("fused_add_rms_norm_", &opsmith::fused_add_rms_norm_);
}

#if OPSMITH_WITH_CUDA
TORCH_LIBRARY_IMPL(opsmith, CUDA, m) {
    m.impl("fused_add_rms_norm_fwd", &opsmith::fused_add_rms_norm_fwd);
    m.impl("fused_add_rms_norm_bwd", &opsmith::fused_add_rms_norm_bwd);
    m.impl("fused_add_rms_norm_", &opsmith::fused_add_rms_norm_);
}
#endif

TORCH_LIBRARY_IMPL(opsmith, Autograd, m) {
    m.impl("fused_add_rms_norm_fwd", &opsmith::fwd_autograd);
    m.impl("fused_add_rms_norm_bwd", &opsmith::bwd_autograd);
    m.impl("fused_add_rms_norm_", &opsmith::inplace_autograd);
}

#endif // route B
