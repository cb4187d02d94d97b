// Autograd helpers for route B kernels registered on the Autograd key.
// opsmith's autograd nodes are written the way ATen's own are (a Node
// subclass with SavedVariables, history set on the outputs), not as
// torch::autograd::Function: the per-call cost stays in C++, and
// torch.func.grad / vjp work, which refuse a C++ autograd.Function.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <optional>
#include <string>
#include <type_traits>

namespace opsmith {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// The dispatcher's handle of the op `name` whose C++ signature is Fn's (the
// Autograd kernels call the op below the Autograd key through it, so the
// backend kernel for the inputs' device runs), looked up once. Keyed by the
// function itself: two ops of the same signature get their own handles.
template <auto &Fn> const auto &dispatcher_op(const char *name) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<std::remove_reference_t<decltype(Fn)>>();
    return op;
}

// Forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) needs a
// forward derivative; an op without one refuses dual inputs clearly rather
// than returning a primal with its tangent silently dropped.
template <typename... Tensors> void refuse_forward_ad(const char *op, const Tensors &...inputs) {
    const bool dual = (torch::autograd::isFwGradDefined(std::optional<at::Tensor>(inputs)) || ...);
    TORCH_CHECK(!dual, op, ": forward-mode AD is not supported (torch.func.jvp, torch.autograd.forward_ad); "
                "use reverse mode (torch.autograd.grad, torch.func.grad, torch.func.vjp)");
}

inline at::Tensor tensor_or_undefined(const std::optional<at::Tensor> &t) {
    return t.has_value() ? *t : at::Tensor();
}

// Gradients computed without history inside a backward (or by a raw
// backward op) while the graph is being built (create_graph=True, or a
// backward op called on tensors that require grad): differentiating them
// again must fail with `message`, never give silent zeros. They get an
// Error node as their grad_fn, whose edges lead to the inputs they came from.
template <typename... Inputs>
void refuse_double_backward(const std::string &message, variable_list outputs, const Inputs &...inputs) {
    if (!torch::autograd::compute_requires_grad(inputs...)) return;
    auto error = std::make_shared<torch::autograd::Error>(message, torch::autograd::collect_next_edges(inputs...));
    for (const at::Tensor &out : outputs)
        if (out.defined() && torch::autograd::isDifferentiableType(out.scalar_type()))
            torch::autograd::set_history(out, error);
}

} // namespace opsmith
