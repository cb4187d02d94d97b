// AdamW in PyTorch: the bridge of the multi-tensor step and of the fused
// global gradient norm (checks naming the list and index, device guard,
// current stream; the arithmetic is the C library's, csrc/cpu/adamw.c and
// csrc/cuda/adamw.cu), its route A binding and its route B registration.
//
// adamw_step_ mutates its lists in place (schema Tensor(a!)[]) and returns
// nothing; non-contiguous tensors go through contiguous copies; an empty max_exp_avg_sqs or master_params list means none.
// lr_tensor and clip_coef are optional float32 scalars on the params'
// device, read by the kernels (no host synchronisation: CUDA graphs capture
// the whole step). adamw_grad_norm returns (norm, clip_coef) as float32
// scalars on the grads' device.
//
// Compiled twice, like every bridge: into opsmith._C (route B) and, with
// OPSMITH_ROUTE_A, into opsmith._pybind (route A).
#include <ATen/MemoryOverlap.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/empty.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "tensor_args.h"

#if OPSMITH_ROUTE_A
#include "pybind_registry.h"
#else
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>
#endif

namespace opsmith {
namespace {

opsmith_dtype storage_dtype(const at::Tensor &t, const char *op, const char *list, size_t i) {
    switch (t.scalar_type()) {
    case at::kFloat: return OPSMITH_DTYPE_F32;
    case at::kBFloat16: return OPSMITH_DTYPE_BF16;
    case at::kHalf: return OPSMITH_DTYPE_F16;
    default:
        TORCH_CHECK(false, op, ": ", list, "[", text((int64_t)i), "] must be float32, bfloat16 or float16, got ",
                    t.scalar_type());
    }
}

// Every tensor of `list`: on `device`, of `dtype` (the first one's when
// dtype is Undefined), with ref[i]'s shape when ref is given; a mutated one
// without elements that share memory. Returns the list's dtype.
at::ScalarType check_list(const char *op, const char *name, at::TensorList list, const at::Device &device,
                          at::ScalarType dtype, at::TensorList ref, const char *ref_name, bool mutated) {
    // messages are only formatted on failure: thousands of tensors a step
    const bool like_first = dtype == at::ScalarType::Undefined;
    for (size_t i = 0; i < list.size(); i++) {
        const at::Tensor &t = list[i];
        const int64_t k = (int64_t)i;
        TORCH_CHECK(t.defined(), op, ": ", name, "[", text(k), "] is undefined");
        TORCH_CHECK(t.device() == device, op, ": ", name, "[", text(k), "] must be on ", device,
                    " (the device of params[0]), got ", t.device());
        if (dtype == at::ScalarType::Undefined) dtype = t.scalar_type();
        TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, "[", text(k), "] must be ", dtype,
                    like_first ? " like " : " (the optimizer state's dtype)", like_first ? name : "",
                    like_first ? "[0]" : "", ", got ", t.scalar_type());
        if (mutated && !t.is_contiguous())
            TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": ", name, "[", text(k),
                        "] has elements that share memory (an expanded view) and cannot be updated in place, got "
                        "strides ", text(t.strides()));
        if (!ref.empty())
            TORCH_CHECK(t.sizes() == ref[i].sizes(), op, ": ", name, "[", text(k), "] must have the shape of ",
                        ref_name, "[", text(k), "] ", text(ref[i].sizes()), ", got ", text(t.sizes()));
    }
    return dtype;
}

void check_scalar(const char *op, const char *name, const at::Tensor &t, const at::Device &device) {
    TORCH_CHECK(t.device() == device, op, ": ", name, " must be on ", device, " (the device of params[0]), got ",
                t.device());
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1, op, ": ", name,
                " must be a float32 tensor of one element, got ", t.scalar_type(), " of shape ", text(t.sizes()));
}

// The kernels see every tensor as one flat run of elements. A list as
// they need it: each tensor itself when contiguous, else a contiguous copy
// (a transposed or sliced view), which a mutated list copies back after the
// step (`pending`). Copies only move data; the step is the kernel's.
struct Flat {
    std::vector<at::Tensor> dense;
    std::vector<std::pair<at::Tensor, at::Tensor>> pending; // (view, its contiguous copy)
};

Flat flat(at::TensorList list, bool mutated) {
    Flat f;
    f.dense.reserve(list.size());
    for (const at::Tensor &t : list) {
        if (t.is_contiguous()) {
            f.dense.push_back(t);
        } else {
            f.dense.push_back(t.contiguous());
            if (mutated) f.pending.emplace_back(t, f.dense.back());
        }
    }
    return f;
}

void copy_back(const Flat &f) {
    for (const auto &pr : f.pending) pr.first.copy_(pr.second);
}

template <typename T> std::vector<T> pointers(const std::vector<at::Tensor> &list) {
    std::vector<T> out(list.size());
    for (size_t i = 0; i < list.size(); i++) out[i] = static_cast<T>(list[i].data_ptr());
    return out;
}

} // namespace

void adamw_step_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList max_exp_avg_sqs, at::TensorList master_params, at::TensorList steps, double lr,
                 const std::optional<at::Tensor> &lr_tensor, double beta1, double beta2, double eps,
                 double weight_decay, bool amsgrad, bool maximize, const std::optional<at::Tensor> &clip_coef,
                 bool increment_steps) {
    const char *op = "adamw_step_";
    const size_t n = params.size();
    auto same_length = [&](at::TensorList l, const char *name) {
        TORCH_CHECK(l.size() == n, op, ": ", name, " must have one tensor per param (", text((int64_t)n), "), got ",
                    text((int64_t)l.size()));
    };
    same_length(grads, "grads");
    same_length(exp_avgs, "exp_avgs");
    same_length(exp_avg_sqs, "exp_avg_sqs");
    same_length(steps, "steps");
    if (amsgrad) same_length(max_exp_avg_sqs, "max_exp_avg_sqs (amsgrad)");
    else TORCH_CHECK(max_exp_avg_sqs.empty(), op, ": max_exp_avg_sqs must be empty without amsgrad");
    if (!master_params.empty()) same_length(master_params, "master_params");
    TORCH_CHECK(lr >= 0.0 || lr_tensor.has_value(), op, ": lr must be >= 0, got ", text(lr));
    TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, op, ": beta1 must be in [0, 1), got ", text(beta1));
    TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, op, ": beta2 must be in [0, 1), got ", text(beta2));
    TORCH_CHECK(eps >= 0.0, op, ": eps must be >= 0, got ", text(eps));
    TORCH_CHECK(weight_decay >= 0.0, op, ": weight_decay must be >= 0, got ", text(weight_decay));
    if (n == 0) return;
    const at::Device device = params[0].device();
    check_device_supported(params[0], op);
    const at::ScalarType pt = check_list(op, "params", params, device, at::ScalarType::Undefined, {}, "", true);
    const opsmith_dtype pdt = storage_dtype(params[0], op, "params", 0);
    const at::ScalarType gt = check_list(op, "grads", grads, device, at::ScalarType::Undefined, params, "params", false);
    const opsmith_dtype gdt = storage_dtype(grads[0], op, "grads", 0);
    check_list(op, "exp_avgs", exp_avgs, device, at::kFloat, params, "params", true);
    check_list(op, "exp_avg_sqs", exp_avg_sqs, device, at::kFloat, params, "params", true);
    if (amsgrad) check_list(op, "max_exp_avg_sqs", max_exp_avg_sqs, device, at::kFloat, params, "params", true);
    if (!master_params.empty()) {
        TORCH_CHECK(pt != at::kFloat, op, ": master_params must be empty for float32 params (they are the masters)");
        check_list(op, "master_params", master_params, device, at::kFloat, params, "params", true);
    }
    check_list(op, "steps", steps, device, at::kFloat, {}, "", false);
    for (size_t i = 0; i < n; i++)
        TORCH_CHECK(steps[i].numel() == 1, op, ": steps[", text((int64_t)i), "] must have one element, got shape ",
                    text(steps[i].sizes()));
    if (lr_tensor) check_scalar(op, "lr_tensor", *lr_tensor, device);
    if (clip_coef) check_scalar(op, "clip_coef", *clip_coef, device);
    (void)gt;

    std::vector<int64_t> numels(n);
    for (size_t i = 0; i < n; i++) numels[i] = params[i].numel();
    // the copies below stay out of autograd: this is an optimizer update
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const Flat fp = flat(params, true), fg = flat(grads, false), fm = flat(exp_avgs, true),
               fv = flat(exp_avg_sqs, true), fx = flat(max_exp_avg_sqs, true), fw = flat(master_params, true),
               fs = flat(steps, false);
    const std::vector<void *> p = pointers<void *>(fp.dense);
    const std::vector<const void *> g = pointers<const void *>(fg.dense);
    const std::vector<float *> m = pointers<float *>(fm.dense), v = pointers<float *>(fv.dense);
    const std::vector<float *> x = pointers<float *>(fx.dense), w = pointers<float *>(fw.dense);
    const std::vector<float *> s = pointers<float *>(fs.dense); // one element each: always the tensor itself
    const float *lr_p = lr_tensor ? lr_tensor->data_ptr<float>() : nullptr;
    const float *coef_p = clip_coef ? clip_coef->data_ptr<float>() : nullptr;
    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (device.is_cuda()) {
        const c10::cuda::CUDAGuard guard(device);
        const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index()).stream();
        status = increment_steps ? opsmith_adamw_increment_steps_cuda((int64_t)n, s.data(), stream)
                                 : OPSMITH_STATUS_SUCCESS;
        if (status == OPSMITH_STATUS_SUCCESS)
            status = opsmith_adamw_step_cuda((int64_t)n, numels.data(), pdt, gdt, p.data(), g.data(), m.data(), v.data(),
                                         amsgrad ? x.data() : nullptr, w.empty() ? nullptr : w.data(), s.data(), lr,
                                         lr_p, beta1, beta2, eps, weight_decay, amsgrad, maximize, coef_p, stream);
    } else
#endif
    {
        use_torch_cpu_threads();
        status = increment_steps ? opsmith_adamw_increment_steps_cpu((int64_t)n, s.data()) : OPSMITH_STATUS_SUCCESS;
        if (status == OPSMITH_STATUS_SUCCESS)
            status = opsmith_adamw_step_cpu((int64_t)n, numels.data(), pdt, gdt, p.data(), g.data(), m.data(), v.data(),
                                        amsgrad ? x.data() : nullptr, w.empty() ? nullptr : w.data(), s.data(), lr,
                                        lr_p, beta1, beta2, eps, weight_decay, amsgrad, maximize, coef_p);
    }
    check_status(status, op);
    for (const Flat *f : {&fp, &fm, &fv, &fx, &fw}) copy_back(*f);
}

std::tuple<at::Tensor, at::Tensor> adamw_grad_norm(at::TensorList grads, double max_norm) {
    const char *op = "adamw_grad_norm";
    TORCH_CHECK(!grads.empty(), op, ": grads must not be empty (the norm needs a device)");
    TORCH_CHECK(max_norm > 0.0, op, ": max_norm must be > 0, got ", text(max_norm));
    const at::Device device = grads[0].device();
    check_device_supported(grads[0], op);
    check_list(op, "grads", grads, device, at::ScalarType::Undefined, {}, "", false);
    const opsmith_dtype gdt = storage_dtype(grads[0], op, "grads", 0);
    const int64_t n = (int64_t)grads.size();
    std::vector<int64_t> numels(n);
    for (int64_t i = 0; i < n; i++) numels[i] = grads[i].numel();
    const Flat fg = flat(grads, false);
    const std::vector<const void *> g = pointers<const void *>(fg.dense);
    // two tensors, not two views of one: results must not alias each other
    at::Tensor out = empty_output({}, grads[0].options().dtype(at::kFloat));
    at::Tensor coef = empty_output({}, grads[0].options().dtype(at::kFloat));
    float *norm = out.data_ptr<float>(), *coef_p = coef.data_ptr<float>();
    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (device.is_cuda()) {
        const c10::cuda::CUDAGuard guard(device);
        const size_t bytes = opsmith_adamw_grad_norm_cuda_workspace_size(n, numels.data());
        at::Tensor ws = workspace(bytes, out);
        status = opsmith_adamw_grad_norm_cuda(n, numels.data(), gdt, g.data(), max_norm, norm, coef_p,
                                              bytes ? ws.data_ptr() : nullptr, bytes,
                                              at::cuda::getCurrentCUDAStream(device.index()).stream());
    } else
#endif
    {
        use_torch_cpu_threads();
        const size_t bytes = opsmith_adamw_grad_norm_cpu_workspace_size(n, numels.data());
        at::Tensor ws = workspace(bytes, out);
        status = opsmith_adamw_grad_norm_cpu(n, numels.data(), gdt, g.data(), max_norm, norm, coef_p,
                                             bytes ? ws.data_ptr() : nullptr, bytes);
    }
    check_status(status, op);
    return {out, coef};
}

#if !OPSMITH_ROUTE_A
namespace {

void refuse_grad_mode(at::TensorList params) {
    if (!at::GradMode::is_enabled()) return;
    for (size_t i = 0; i < params.size(); i++)
        TORCH_CHECK(!params[i].requires_grad(), "adamw_step_: params[", text((int64_t)i),
                    "] requires grad and grad mode is on: an optimizer step is not differentiable; call it under "
                    "torch.no_grad() (as torch.optim optimizers do)");
}

void bump_versions(at::TensorList list) {
    for (const at::Tensor &t : list) torch::autograd::increment_version(t);
}

} // namespace

void adamw_step_autograd(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList master_params,
                         at::TensorList steps, double lr, const std::optional<at::Tensor> &lr_tensor, double beta1,
                         double beta2, double eps, double weight_decay, bool amsgrad, bool maximize,
                         const std::optional<at::Tensor> &clip_coef, bool increment_steps) {
    refuse_grad_mode(params);
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        static const auto op = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("opsmith::adamw_step_", "")
                                   .typed<decltype(adamw_step_autograd)>();
        op.call(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps, lr, lr_tensor, beta1,
                beta2, eps, weight_decay, amsgrad, maximize, clip_coef, increment_steps);
    }
    for (at::TensorList l : {params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params}) bump_versions(l);
    if (increment_steps) bump_versions(steps);
}

std::tuple<at::Tensor, at::Tensor> adamw_grad_norm_autograd(at::TensorList grads, double max_norm) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("opsmith::adamw_grad_norm", "")
                               .typed<decltype(adamw_grad_norm_autograd)>();
    return op.call(grads, max_norm);
}
#endif

} // namespace opsmith

#if OPSMITH_ROUTE_A

OPSMITH_PYBIND(adamw) {
    namespace py = pybind11;
    m.def(
        "adamw_step_",
        [](std::vector<at::Tensor> params, std::vector<at::Tensor> grads, std::vector<at::Tensor> exp_avgs,
           std::vector<at::Tensor> exp_avg_sqs, std::vector<at::Tensor> max_exp_avg_sqs,
           std::vector<at::Tensor> master_params, std::vector<at::Tensor> steps, double lr,
           std::optional<at::Tensor> lr_tensor, double beta1, double beta2, double eps, double weight_decay,
           bool amsgrad, bool maximize, std::optional<at::Tensor> clip_coef, bool increment_steps) {
            opsmith::adamw_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps, lr,
                                 lr_tensor, beta1, beta2, eps, weight_decay, amsgrad, maximize, clip_coef,
                                 increment_steps);
        },
        "AdamW multi-tensor step, in place", py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("max_exp_avg_sqs"), py::arg("master_params"), py::arg("steps"),
        py::arg("lr"), py::arg("lr_tensor"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("amsgrad"), py::arg("maximize"), py::arg("clip_coef"),
        py::arg("increment_steps") = false);
    m.def(
        "adamw_grad_norm",
        [](std::vector<at::Tensor> grads, double max_norm) { return opsmith::adamw_grad_norm(grads, max_norm); },
        "global L2 norm of grads and min(1, max_norm / (norm + 1e-6))", py::arg("grads"), py::arg("max_norm"));
}

#else

TORCH_LIBRARY_FRAGMENT(opsmith, m) {
    m.set_python_module("opsmith.ops.adamw");
    m.def("adamw_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
          "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] master_params, Tensor(f!)[] steps, float lr, "
          "Tensor? lr_tensor, float beta1, float beta2, float eps, float weight_decay, bool amsgrad, bool maximize, "
          "Tensor? clip_coef, bool increment_steps=False) -> ()");
    m.def("adamw_grad_norm(Tensor[] grads, float max_norm) -> (Tensor norm, Tensor clip_coef)");
}

TORCH_LIBRARY_IMPL(opsmith, CPU, m) {
    m.impl("adamw_step_", &opsmith::adamw_step_);
    m.impl("adamw_grad_norm", &opsmith::adamw_grad_norm);
}

#if OPSMITH_WITH_CUDA
TORCH_LIBRARY_IMPL(opsmith, CUDA, m) {
    m.impl("adamw_step_", &opsmith::adamw_step_);
    m.impl("adamw_grad_norm", &opsmith::adamw_grad_norm);
}
#endif

// Unboxed Autograd kernels: without them every call goes through PyTorch's
// boxed autograd and ADInplaceOrView fallbacks, which convert each tensor of
// every list to an IValue (most of the host time of a step over thousands
// of tensors). An optimizer update has no gradient; the mutated tensors get
// their version bumped, as any in-place op does.
TORCH_LIBRARY_IMPL(opsmith, Autograd, m) {
    m.impl("adamw_step_", &opsmith::adamw_step_autograd);
    m.impl("adamw_grad_norm", &opsmith::adamw_grad_norm_autograd);
}

#endif // route B
