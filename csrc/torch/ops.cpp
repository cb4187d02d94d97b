// Route B: opsmith's ops in the PyTorch dispatcher (torch.ops.opsmith.*).
// Each schema is defined once; its CPU, CUDA and Autograd kernels follow it.
// Autograd is registered here in C++, not from Python, so a call costs no
// Python frames (a Python autograd layer costs tens of microseconds a call).
// The fake (shape-only) kernels live in opsmith/ops.py, which
// set_python_module names so the dispatcher can import it when this library
// is loaded on its own.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "bridge.h"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// --- rms_norm ---------------------------------------------------------------

auto &rms_norm_fwd_op() {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("opsmith::rms_norm_fwd", "")
                         .typed<decltype(opsmith::rms_norm_fwd)>();
    return op;
}

auto &rms_norm_bwd_op() {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("opsmith::rms_norm_bwd", "")
                         .typed<decltype(opsmith::rms_norm_bwd)>();
    return op;
}

struct RMSNormFunction : public torch::autograd::Function<RMSNormFunction> {
    static variable_list forward(AutogradContext *ctx, const at::Tensor &x,
                                 const std::optional<at::Tensor> &weight, std::optional<double> eps) {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        auto [y, inv_rms] = rms_norm_fwd_op().call(x, weight, eps);
        ctx->save_for_backward({x, weight.value_or(at::Tensor()), inv_rms});
        // inv_rms is a saved statistic, not a result to differentiate through
        ctx->mark_non_differentiable({inv_rms});
        return {y, inv_rms};
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        const variable_list saved = ctx->get_saved_variables();
        const at::Tensor &x = saved[0], &weight = saved[1], &inv_rms = saved[2];
        if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
        const std::optional<at::Tensor> w = weight.defined() ? std::optional<at::Tensor>(weight) : std::nullopt;
        auto [dx, dweight] = rms_norm_bwd_op().call(grads[0], x, w, inv_rms);
        return {dx, weight.defined() ? dweight : at::Tensor(), at::Tensor()};
    }
};

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd_autograd(const at::Tensor &x,
                                                         const std::optional<at::Tensor> &weight,
                                                         std::optional<double> eps) {
    variable_list out = RMSNormFunction::apply(x, weight, eps);
    return {out[0], out[1]};
}

} // namespace

TORCH_LIBRARY(opsmith, m) {
    m.set_python_module("opsmith.ops");
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
    m.impl("rms_norm_fwd", &rms_norm_fwd_autograd);
}
