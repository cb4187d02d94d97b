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

#include <mutex>
#include <optional>
#include <string>
#include <thread>
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

// The last use of a node's saved gradients, for a backward that scales them
// in place when the graph is not kept (cross_entropy, the fused linear op):
// the memory of a [N, V] or [V, D] tensor saved. The engine calls
// will_release_variables() and then apply() in one thread for the backward
// that frees the graph, but other threads may run backwards over the same
// graph at once (retain_graph=True beside it). So the in-place use belongs to
// that thread's next apply alone (taken under the node's mutex, held for the
// whole apply), after which the saved tensors are spent: a later apply fails
// as a backward through a freed graph does. And a saved tensor someone else
// holds (the raw op returned it to its caller) is never written.
class LastUse {
  public:
    void will_release() { releaser_ = std::this_thread::get_id(); }
    // In apply, with the node's mutex held: true when this call may write
    // over its saved tensors; checks they were not spent by an earlier one.
    bool take(const char *node) {
        TORCH_CHECK(!spent_, node, ": trying to backward through the graph a second time (its saved gradients were "
                    "used by the backward that freed it); specify retain_graph=True on the first backward");
        const bool mine = releaser_ == std::this_thread::get_id();
        if (mine) releaser_ = std::thread::id(); // another thread's apply leaves it to the releaser
        return mine;
    }
    void spend() { spent_ = true; }

  private:
    std::thread::id releaser_;
    bool spent_ = false;
};

// True when t's memory is held by `expected` references alone (a node's
// SavedVariable and the tensor unpacked from it: 2), so writing over it
// changes nothing anyone else can read.
inline bool held_only_by(const at::Tensor &t, size_t expected) {
    return t.use_count() <= expected && t.has_storage() && t.storage().use_count() == 1;
}

// What a forward hands its caller of a tensor its node saves and may write
// over: a view of its own. While the caller keeps it, the storage counts
// that holder (held_only_by says no); once dropped, nothing of it is left,
// where the saved tensor itself, once seen by Python, stays counted.
inline at::Tensor view_for_caller(const at::Tensor &t) {
    if (!t.defined()) return t;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return t.alias();
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
