// cross_entropy in PyTorch: the bridge (checks, outputs, device guard, stream; the
// arithmetic is the C library's, csrc/cpu/cross_entropy.c and csrc/cuda/cross_entropy.cu),
// its route A binding and its route B registration.
//
// The forward can compute the logit gradient in the pass that reads the
// logits (compute_grad, or the Autograd kernel when the logits require
// grad): the gradient of the reduced loss for an incoming gradient of 1,
// saved for the backward, which only multiplies it by the incoming gradient
// (in place and skipped on the device where that gradient is exactly 1, the
// common loss.backward()).
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <cstring>

#include "tensor_args.h"

#if OPSMITH_ROUTE_A
#include "pybind_registry.h"
#else
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

#include "autograd.h"
#endif

namespace opsmith {
namespace {

constexpr const char *kOp = "cross_entropy";

struct Checked {
    opsmith_dtype dtype, loss_dtype; // loss_dtype: dtype or its accumulate type
    at::ScalarType loss_type;
    Rows x;
    at::Tensor target, weight; // target contiguous int64; weight contiguous in the accumulate type, or undefined
};

// Checks a forward call; logits are (N, V), target (N).
Checked check_fwd(const at::Tensor &logits, const at::Tensor &target, const std::optional<at::Tensor> &weight,
                  double ls, double z_loss, double softcap, int64_t reduction,
                  std::optional<at::ScalarType> loss_dtype) {
    check_device_supported(logits, kOp);
    const opsmith_dtype dtype = dtype_of(logits, kOp, "logits");
    TORCH_CHECK(logits.dim() == 2, kOp, ": logits must be 2-D (N, V), got ", text(logits.sizes()));
    TORCH_CHECK(logits.size(1) >= 1, kOp, ": logits must have at least one class, got ", text(logits.sizes()));
    TORCH_CHECK(target.scalar_type() == at::kLong, kOp, ": target must be int64 class indices, got ",
                target.scalar_type(), " (probability targets are not supported)");
    check_same_device(target, logits, kOp, "target");
    TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), kOp, ": target must have shape [",
                text(logits.size(0)), "] (logits' rows), got ", text(target.sizes()));
    TORCH_CHECK(ls >= 0.0 && ls <= 1.0, kOp, ": label_smoothing must be in [0, 1], got ", text(ls));
    TORCH_CHECK(std::isfinite(z_loss) && z_loss >= 0.0, kOp, ": z_loss must be finite and >= 0, got ", text(z_loss));
    TORCH_CHECK(std::isfinite(softcap) && softcap >= 0.0, kOp, ": softcap must be finite and > 0 (or 0: none), got ",
                text(softcap));
    TORCH_CHECK(reduction >= 0 && reduction <= 2, kOp, ": reduction must be 0 (none), 1 (sum) or 2 (mean), got ",
                text(reduction));
    // the loss in logits' dtype (PyTorch's) or unrounded in the accumulate
    // type (PyTorch's under autocast, which computes 16-bit logits' loss in float32)
    const at::ScalarType acc_type = accumulate_type(logits);
    const at::ScalarType loss_type = loss_dtype.value_or(logits.scalar_type());
    TORCH_CHECK(loss_type == logits.scalar_type() || loss_type == acc_type, kOp,
                ": loss_dtype must be None, logits' dtype (", logits.scalar_type(), ")",
                acc_type != logits.scalar_type() ? " or float32" : "", ", got ", loss_type);
    at::Tensor w;
    if (weight.has_value() && weight->defined()) {
        check_same_device(*weight, logits, kOp, "weight");
        // a float32 weight beside 16-bit logits (a class-weight buffer kept in
        // float32 under autocast) is read as it is: the kernels take it in
        // the accumulate type anyway
        TORCH_CHECK(weight->scalar_type() == logits.scalar_type() || weight->scalar_type() == acc_type, kOp,
                    ": weight must have logits' dtype (", logits.scalar_type(), ")",
                    acc_type != logits.scalar_type() ? " or float32" : "", ", got ", weight->scalar_type());
        TORCH_CHECK(weight->dim() == 1 && weight->size(0) == logits.size(1), kOp, ": weight must have shape [",
                    text(logits.size(1)), "] (one per class), got ", text(weight->sizes()));
        w = weight->to(acc_type).contiguous();
    }
    const opsmith_dtype loss_dt = loss_type == logits.scalar_type() ? dtype : opsmith_dtype_accumulate(dtype);
    return {dtype, loss_dt, loss_type, as_rows(logits), target.contiguous(), w};
}

at::Tensor loss_like(const Checked &c, const at::Tensor &logits, int64_t reduction) {
    const auto options = logits.options().dtype(c.loss_type);
    return reduction == OPSMITH_CROSS_ENTROPY_REDUCTION_NONE ? empty_output({logits.size(0)}, options)
                                                             : empty_output({}, options);
}

// Runs the forward launcher; dl (or nullptr) with row stride dls.
void run_fwd(const Checked &c, const at::Tensor &logits, int64_t ignore_index, double ls, double z_loss,
             double softcap, int64_t reduction, at::Tensor &loss, at::Tensor &z, void *dl, int64_t dls,
             at::Tensor &error) {
    const auto red = (opsmith_cross_entropy_reduction)reduction;
    // one accumulate value a row (two with a z-loss): the op's only memory
    // beyond its inputs and outputs; no lse output (nothing reads it)
    const size_t wb = opsmith_cross_entropy_fwd_workspace_size(c.dtype, c.x.rows, z_loss);
    at::Tensor ws = workspace(wb, logits);
    const void *w = c.weight.defined() ? c.weight.data_ptr() : nullptr;
    const int64_t *t = c.target.numel() ? c.target.const_data_ptr<int64_t>() : nullptr;
    const void *x = c.x.rows ? c.x.data() : nullptr;
    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (logits.is_cuda()) {
        const c10::cuda::CUDAGuard guard(logits.device());
        status = opsmith_cross_entropy_fwd_cuda(c.dtype, c.x.rows, c.x.n, x, c.x.stride, t, 1, w, ignore_index, ls,
                                                z_loss, softcap, red, c.loss_dtype, loss.data_ptr(), z.data_ptr(),
                                                nullptr, dl,
                                                dls, error.data_ptr<int64_t>(), ws.data_ptr(), wb,
                                                at::cuda::getCurrentCUDAStream(logits.get_device()).stream());
    } else
#endif
    {
        use_torch_cpu_threads();
        status = opsmith_cross_entropy_fwd_cpu(c.dtype, c.x.rows, c.x.n, x, c.x.stride, t, 1, w, ignore_index, ls,
                                               z_loss, softcap, red, c.loss_dtype, loss.data_ptr(), z.data_ptr(),
                                               nullptr, dl,
                                               dls, error.data_ptr<int64_t>(), ws.data_ptr(), wb);
        // the C message names the launcher; the user called cross_entropy
        // (from "target" on; the whole message if it has no "target": a null
        // const char * must never reach the message)
        if (status == OPSMITH_STATUS_INVALID_ARGUMENT && std::strstr(opsmith_last_error(), "out of range")) {
            const char *m = opsmith_last_error(), *from = std::strstr(m, "target");
            TORCH_CHECK_INDEX(false, kOp, ": ", std::string(from ? from : m));
        }
    }
    check_status(status, kOp);
}

} // namespace

// (loss, z_loss, dlogits, error) = cross_entropy_fwd(logits (N, V), target (N), ...): loss and
// z_loss in loss_dtype (None: logits' dtype; or their accumulate type), [N] for reduction none (0)
// else []; dlogits (N, V) contiguous when compute_grad, else empty; error: the device-side flag
// (3 int64).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
cross_entropy_fwd(const at::Tensor &logits, const at::Tensor &target, const std::optional<at::Tensor> &weight,
                  int64_t ignore_index, double label_smoothing, double z_loss, double softcap, int64_t reduction,
                  bool compute_grad, std::optional<at::ScalarType> loss_dtype) {
    const Checked c = check_fwd(logits, target, weight, label_smoothing, z_loss, softcap, reduction, loss_dtype);
    at::Tensor loss = loss_like(c, logits, reduction), z = loss_like(c, logits, reduction);
    at::Tensor dl = compute_grad ? empty_output(logits.sizes(), logits.options()) : empty_output({0}, logits.options());
    at::Tensor error = at::zeros({OPSMITH_CROSS_ENTROPY_ERROR_COUNT}, logits.options().dtype(at::kLong));
    run_fwd(c, logits, ignore_index, label_smoothing, z_loss, softcap, reduction, loss, z,
            compute_grad && dl.numel() ? dl.data_ptr() : nullptr, c.x.n, error);
    return {loss, z, dl, error};
}

// The forward with the gradient written over logits (inplace_grad): (loss, z_loss, error).
std::tuple<at::Tensor, at::Tensor, at::Tensor>
cross_entropy_fwd_(at::Tensor &logits, const at::Tensor &target, const std::optional<at::Tensor> &weight,
                   int64_t ignore_index, double label_smoothing, double z_loss, double softcap, int64_t reduction,
                   std::optional<at::ScalarType> loss_dtype) {
    const Checked c = check_fwd(logits, target, weight, label_smoothing, z_loss, softcap, reduction, loss_dtype);
    TORCH_CHECK(c.x.tensor.is_same(logits), kOp,
                ": inplace_grad=True needs logits whose rows are addressable in place (last dim contiguous), "
                "got strides ", text(logits.strides()));
    at::Tensor loss = loss_like(c, logits, reduction), z = loss_like(c, logits, reduction);
    at::Tensor error = at::zeros({OPSMITH_CROSS_ENTROPY_ERROR_COUNT}, logits.options().dtype(at::kLong));
    run_fwd(c, logits, ignore_index, label_smoothing, z_loss, softcap, reduction, loss, z,
            logits.numel() ? logits.data_ptr() : nullptr, c.x.stride, error);
    return {loss, z, error};
}

namespace {

// Checks a backward call: grad [] (sum, mean) or [N] (none) in dlogits' dtype or (the
// gradient of a float32 loss) their accumulate type, dlogits (N, V).
void check_bwd(const at::Tensor &grad, const at::Tensor &dlogits) {
    check_device_supported(dlogits, kOp);
    (void)dtype_of(dlogits, kOp, "dlogits");
    TORCH_CHECK(dlogits.dim() == 2, kOp, ": dlogits must be 2-D (N, V), got ", text(dlogits.sizes()));
    check_same_device(grad, dlogits, kOp, "grad");
    const at::ScalarType acc = accumulate_type(dlogits);
    TORCH_CHECK(grad.scalar_type() == dlogits.scalar_type() || grad.scalar_type() == acc, kOp,
                ": grad must have dlogits' dtype (", dlogits.scalar_type(), ")",
                acc != dlogits.scalar_type() ? " or float32" : "", ", got ", grad.scalar_type());
    TORCH_CHECK(grad.dim() == 0 || (grad.dim() == 1 && grad.size(0) == dlogits.size(0)), kOp,
                ": grad must be a scalar (reduction sum or mean) or have shape [", text(dlogits.size(0)),
                "] (reduction none), got ", text(grad.sizes()));
}

void run_bwd(const at::Tensor &grad, const Rows &d, void *dx, int64_t dxs, const at::Tensor &like) {
    const opsmith_dtype dtype = dtype_of(like, kOp, "dlogits");
    const opsmith_dtype gdt = grad.scalar_type() == like.scalar_type() ? dtype : opsmith_dtype_accumulate(dtype);
    const at::Tensor g = grad.contiguous();
    const int64_t gs = grad.dim() == 0 ? 0 : 1;
    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (like.is_cuda()) {
        const c10::cuda::CUDAGuard guard(like.device());
        status = opsmith_cross_entropy_bwd_cuda(dtype, d.rows, d.n, gdt, g.data_ptr(), gs, d.data(), d.stride, dx, dxs,
                                                at::cuda::getCurrentCUDAStream(like.get_device()).stream());
    } else
#endif
    {
        use_torch_cpu_threads();
        status = opsmith_cross_entropy_bwd_cpu(dtype, d.rows, d.n, gdt, g.data_ptr(), gs, d.data(), d.stride, dx, dxs);
    }
    check_status(status, kOp);
}

} // namespace

// dlogits_out = cross_entropy_bwd(grad, dlogits) = grad * dlogits (per row for reduction none).
at::Tensor cross_entropy_bwd(const at::Tensor &grad, const at::Tensor &dlogits) {
    check_bwd(grad, dlogits);
    at::Tensor dx = empty_output(dlogits.sizes(), dlogits.options());
    if (dlogits.numel() == 0) return dx;
    run_bwd(grad, as_rows(dlogits), dx.data_ptr(), dlogits.size(1), dlogits);
    return dx;
}

// The same, written over dlogits (rows whose grad is exactly 1 are not touched).
void cross_entropy_bwd_(const at::Tensor &grad, at::Tensor &dlogits) {
    check_bwd(grad, dlogits);
    if (dlogits.numel() == 0) return;
    const Rows d = as_rows(dlogits);
    TORCH_CHECK(d.tensor.is_same(dlogits), kOp, ": the in-place backward needs dlogits with rows addressable in place");
    run_bwd(grad, d, dlogits.data_ptr(), d.stride, dlogits);
}

#if OPSMITH_ROUTE_A

} // namespace opsmith

OPSMITH_PYBIND(cross_entropy) {
    namespace py = pybind11;
    m.def("cross_entropy_fwd", &opsmith::cross_entropy_fwd,
          "cross_entropy forward: (loss, z_loss, dlogits, error)", py::arg("logits"), py::arg("target"),
          py::arg("weight"), py::arg("ignore_index") = -100, py::arg("label_smoothing") = 0.0,
          py::arg("z_loss") = 0.0, py::arg("softcap") = 0.0, py::arg("reduction") = 2,
          py::arg("compute_grad") = false, py::arg("loss_dtype") = py::none());
    m.def("cross_entropy_bwd", &opsmith::cross_entropy_bwd, "cross_entropy backward: grad * dlogits", py::arg("grad"),
          py::arg("dlogits"));
}

namespace opsmith {

#else // route B

namespace {

constexpr const char *kNotTwice =
    "cross_entropy: double backward is not supported (the backward of cross_entropy is not differentiable); "
    "compute higher-order gradients with torch.nn.functional.cross_entropy";

const auto &fwd_op() { return dispatcher_op<cross_entropy_fwd>("opsmith::cross_entropy_fwd"); }
const auto &fwd_inplace_op() { return dispatcher_op<cross_entropy_fwd_>("opsmith::cross_entropy_fwd_"); }
const auto &bwd_op() { return dispatcher_op<cross_entropy_bwd>("opsmith::cross_entropy_bwd"); }
const auto &bwd_inplace_op() { return dispatcher_op<cross_entropy_bwd_>("opsmith::cross_entropy_bwd_"); }

// grad_fn of the loss: the forward's gradient times the incoming one.
struct CrossEntropyBackward : public torch::autograd::Node {
    SavedVariable dlogits_;
    LastUse last_use_; // the graph is not kept: the saved gradient may be scaled in place

    void will_release_variables() override {
        std::lock_guard<std::mutex> lock(mutex_);
        last_use_.will_release();
    }

    variable_list apply(variable_list &&grads) override {
        std::lock_guard<std::mutex> lock(mutex_);
        const at::Tensor &g = grads[0]; // a float32 loss's (loss_dtype) is float32: the kernel reads it as it is
        if (!g.defined()) return {at::Tensor()};
        const bool last = last_use_.take("cross_entropy");
        at::Tensor d = dlogits_.unpack();
        at::Tensor dx;
        {
            at::AutoDispatchBelowADInplaceOrView below_autograd;
            // in place only on plain memory this node owns the last use of:
            // not while a graph is built through g, not for tensor subclasses
            // (torch.compile's tracing), which take the functional op
            if (last && !at::GradMode::is_enabled() && !g.requires_grad() && !at::isTensorSubclassLike(d) &&
                !at::isTensorSubclassLike(g) && held_only_by(d, 2) && as_rows(d).tensor.is_same(d)) {
                bwd_inplace_op().call(g, d);
                last_use_.spend();
                dx = d;
            } else {
                dx = bwd_op().call(g, d);
            }
        }
        // create_graph=True: differentiating dx again must fail clearly (the
        // logits are not saved, so the error node takes this node's edges)
        if (at::GradMode::is_enabled())
            torch::autograd::set_history(dx, std::make_shared<torch::autograd::Error>(kNotTwice, torch::autograd::edge_list(next_edges())));
        return {dx};
    }
    void release_variables() override {
        std::lock_guard<std::mutex> lock(mutex_);
        dlogits_.reset_data();
    }
    std::string name() const override { return "CrossEntropyBackward"; }
};

void check_weight_grad(const std::optional<at::Tensor> &weight) {
    TORCH_CHECK(!(weight.has_value() && weight->defined() && weight->requires_grad() && at::GradMode::is_enabled()),
                kOp, ": the gradient of weight is not implemented (as in PyTorch); pass weight.detach()");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
cross_entropy_fwd_autograd(const at::Tensor &logits, const at::Tensor &target, const std::optional<at::Tensor> &weight,
                           int64_t ignore_index, double ls, double z_loss, double softcap, int64_t reduction,
                           bool compute_grad, std::optional<at::ScalarType> loss_dtype) {
    refuse_forward_ad(kOp, logits, tensor_or_undefined(weight));
    check_weight_grad(weight);
    const bool need = torch::autograd::compute_requires_grad(logits);
    at::Tensor loss, z, dl, error;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        std::tie(loss, z, dl, error) =
            fwd_op().call(logits, target, weight, ignore_index, ls, z_loss, softcap, reduction, compute_grad || need,
                          loss_dtype);
    }
    if (need) {
        auto node = std::make_shared<CrossEntropyBackward>();
        node->set_next_edges(torch::autograd::collect_next_edges(logits));
        node->dlogits_ = SavedVariable(dl, false);
        torch::autograd::set_history(loss, node);
        // z_loss, dlogits and error are reports, not results to differentiate through
        dl = view_for_caller(dl);
    }
    return {loss, z, dl, error};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor>
cross_entropy_fwd_inplace_autograd(at::Tensor &logits, const at::Tensor &target,
                                   const std::optional<at::Tensor> &weight, int64_t ignore_index, double ls,
                                   double z_loss, double softcap, int64_t reduction,
                                   std::optional<at::ScalarType> loss_dtype) {
    refuse_forward_ad(kOp, logits, tensor_or_undefined(weight));
    check_weight_grad(weight);
    const bool need = torch::autograd::compute_requires_grad(logits);
    TORCH_CHECK(!(need && logits.is_leaf()), kOp,
                ": inplace_grad=True writes the gradient over logits, which must not be a leaf that requires grad "
                "(it is meant for the output of the lm head); use inplace_grad=False");
    at::Tensor loss, z, error;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        std::tie(loss, z, error) =
            fwd_inplace_op().call(logits, target, weight, ignore_index, ls, z_loss, softcap, reduction, loss_dtype);
    }
    // logits now hold the gradient: anything else that saved them fails its
    // version check rather than differentiating through the overwritten values
    torch::autograd::increment_version(logits);
    if (need) {
        auto node = std::make_shared<CrossEntropyBackward>();
        node->set_next_edges(torch::autograd::collect_next_edges(logits));
        node->dlogits_ = SavedVariable(logits, false);
        torch::autograd::set_history(loss, node);
    }
    return {loss, z, error};
}

at::Tensor cross_entropy_bwd_autograd(const at::Tensor &grad, const at::Tensor &dlogits) {
    refuse_forward_ad(kOp, grad, dlogits);
    at::Tensor dx;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        dx = bwd_op().call(grad, dlogits);
    }
    refuse_double_backward(kNotTwice, {dx}, grad, dlogits);
    return dx;
}

} // namespace

#endif // route B

} // namespace opsmith

#if !OPSMITH_ROUTE_A

TORCH_LIBRARY_FRAGMENT(opsmith, m) {
    m.set_python_module("opsmith.ops.cross_entropy");
    m.def("cross_entropy_fwd(Tensor logits, Tensor target, Tensor? weight, int ignore_index=-100, "
          "float label_smoothing=0., float z_loss=0., float softcap=0., int reduction=2, bool compute_grad=False, "
          "ScalarType? loss_dtype=None) -> (Tensor loss, Tensor z_loss, Tensor dlogits, Tensor error)");
    // the gradient written over logits (inplace_grad=True)
    m.def("cross_entropy_fwd_(Tensor(a!) logits, Tensor target, Tensor? weight, int ignore_index=-100, "
          "float label_smoothing=0., float z_loss=0., float softcap=0., int reduction=2, "
          "ScalarType? loss_dtype=None) -> (Tensor loss, Tensor z_loss, Tensor error)");
    m.def("cross_entropy_bwd(Tensor grad, Tensor dlogits) -> Tensor dx");
    m.def("cross_entropy_bwd_(Tensor grad, Tensor(a!) dlogits) -> ()");
}

TORCH_LIBRARY_IMPL(opsmith, CPU, m) {
    m.impl("cross_entropy_fwd", &opsmith::cross_entropy_fwd);
    m.impl("cross_entropy_fwd_", &opsmith::cross_entropy_fwd_);
    m.impl("cross_entropy_bwd", &opsmith::cross_entropy_bwd);
    m.impl("cross_entropy_bwd_", &opsmith::cross_entropy_bwd_);
}

#if OPSMITH_WITH_CUDA
TORCH_LIBRARY_IMPL(opsmith, CUDA, m) {
    m.impl("cross_entropy_fwd", &opsmith::cross_entropy_fwd);
    m.impl("cross_entropy_fwd_", &opsmith::cross_entropy_fwd_);
    m.impl("cross_entropy_bwd", &opsmith::cross_entropy_bwd);
    m.impl("cross_entropy_bwd_", &opsmith::cross_entropy_bwd_);
}
#endif

TORCH_LIBRARY_IMPL(opsmith, Autograd, m) {
    m.impl("cross_entropy_fwd", &opsmith::cross_entropy_fwd_autograd);
    m.impl("cross_entropy_fwd_", &opsmith::cross_entropy_fwd_inplace_autograd);
    m.impl("cross_entropy_bwd", &opsmith::cross_entropy_bwd_autograd);
}

#endif // route B
