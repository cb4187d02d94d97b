// RMSNorm in PyTorch: the bridge (checks, outputs, device guard, stream; the
// arithmetic is the C library's, csrc/cpu/rms_norm.c and
// csrc/cuda/rms_norm.cu), its route A binding and its route B registration.
//
// Compiled twice: into opsmith._C (route B: schemas, CPU/CUDA kernels and
// autograd in the dispatcher) and, with OPSMITH_ROUTE_A, into
// opsmith._pybind (route A: its OPSMITH_PYBIND binding only, registering
// nothing with the dispatcher).
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <limits>
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

constexpr const char *kOp = "rms_norm";

// torch.nn.functional.rms_norm's eps=None: the epsilon of the type its sums
// run in (float32 for 16-bit x; its documentation says x's dtype, its code
// takes the opmath type's)
double default_eps(at::ScalarType t) {
    return t == at::kDouble ? std::numeric_limits<double>::epsilon() : std::numeric_limits<float>::epsilon();
}

// Everything a call says besides its tensors, checked once.
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

// Checks x, weight, the options and the dtype y (or dy) has; `y_arg` names
// where that dtype came from in messages ("out_dtype", "dy").
Options check_call(const at::Tensor &x, const std::optional<at::Tensor> &weight, double offset,
                   c10::string_view casting_mode, at::ScalarType y_type, const char *y_arg) {
    check_device_supported(x, kOp);
    TORCH_CHECK(x.dim() >= 1, kOp, ": x must have at least 1 dimension, got a 0-dim tensor");
    Options o;
    o.x_dtype = dtype_of(x, kOp, "x");
    o.weight_dtype = opsmith_dtype_accumulate(o.x_dtype);
    if (weight.has_value()) {
        const at::Tensor &w = *weight;
        check_same_device(w, x, kOp, "weight");
        // norm weights kept in float32 while x is 16-bit (mixed precision, autocast)
        TORCH_CHECK(w.scalar_type() == x.scalar_type() || (is_half(x) && w.scalar_type() == at::kFloat), kOp,
                    ": weight must have the dtype of x (", x.scalar_type(), is_half(x) ? ") or float32" : ")",
                    ", got ", w.scalar_type());
        TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), kOp, ": weight must have shape [",
                    text(x.size(-1)), "] (last dim of x), got ", text(w.sizes()));
        o.weight_dtype = dtype_of(w, kOp, "weight");
    }
    const bool weight_is_float = !weight.has_value() || weight->scalar_type() == at::kFloat;
    TORCH_CHECK(y_type == x.scalar_type() || (is_half(x) && y_type == at::kFloat && weight_is_float), kOp, ": ",
                y_arg, " must be x's dtype (", x.scalar_type(), ")",
                is_half(x) ? (weight_is_float ? " or float32" : ", or float32 with a float32 weight") : "", ", got ",
                y_type);
    o.y_dtype = y_type == at::kFloat ? OPSMITH_DTYPE_F32 : o.x_dtype;
    TORCH_CHECK(std::isfinite(offset), kOp, ": offset must be finite, got ", text(offset));
    TORCH_CHECK(offset == 0.0 || weight.has_value(), kOp, ": offset (", text(offset),
                ") scales the weight: it needs a weight");
    o.offset = offset;
    o.casting = casting_of(casting_mode);
    return o;
}

const void *weight_data(const std::optional<at::Tensor> &weight, at::Tensor &holder) {
    if (!weight.has_value()) return nullptr;
    holder = weight->contiguous();
    return holder.data_ptr();
}

// The checks the backward ops share; returns their options.
Options check_bwd(const at::Tensor &dy, const at::Tensor &x, const std::optional<at::Tensor> &weight,
                  const at::Tensor &inv_rms, double offset, c10::string_view casting_mode) {
    const Options o = check_call(x, weight, offset, casting_mode, dy.scalar_type(), "dy");
    check_same_device(dy, x, kOp, "dy");
    TORCH_CHECK(dy.sizes() == x.sizes(), kOp, ": dy must have the shape of x ", text(x.sizes()), ", got ",
                text(dy.sizes()));
    check_same_device(inv_rms, x, kOp, "inv_rms");
    TORCH_CHECK(inv_rms.scalar_type() == accumulate_type(x), kOp, ": inv_rms must be ", accumulate_type(x), " for ",
                x.scalar_type(), " x, got ", inv_rms.scalar_type());
    TORCH_CHECK(inv_rms.sizes() == x.sizes().slice(0, x.dim() - 1), kOp, ": inv_rms must have shape x.shape[:-1] ",
                text(x.sizes().slice(0, x.dim() - 1)), ", got ", text(inv_rms.sizes()));
    return o;
}

// dx (of x's shape, row stride dx_stride) and dweight into given memory.
void run_bwd(const Options &o, const Rows &dyr, const Rows &xr, const at::Tensor &x, const void *w,
             const at::Tensor &inv, void *dx, int64_t dx_stride, void *dw) {
    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (x.is_cuda()) {
        const c10::cuda::CUDAGuard guard(x.device());
        const size_t ws_bytes = opsmith_rms_norm_ex_bwd_cuda_workspace_size(
            o.x_dtype, o.weight_dtype, o.y_dtype, xr.rows, xr.n, dyr.data(), dyr.stride, xr.data(), xr.stride, w,
            o.offset, o.casting, inv.data_ptr(), dx, dx_stride, dw);
        at::Tensor ws = workspace(ws_bytes, x);
        status = opsmith_rms_norm_ex_bwd_cuda(o.x_dtype, o.weight_dtype, o.y_dtype, xr.rows, xr.n, dyr.data(),
                                              dyr.stride, xr.data(), xr.stride, w, o.offset, o.casting,
                                              inv.data_ptr(), dx, dx_stride, dw, data_or_null(ws), ws_bytes,
                                              at::cuda::getCurrentCUDAStream(x.get_device()).stream());
    } else
#endif
    {
        use_torch_cpu_threads();
        const size_t ws_bytes = opsmith_rms_norm_ex_bwd_cpu_workspace_size(
            o.x_dtype, o.weight_dtype, o.y_dtype, xr.rows, xr.n, dyr.data(), dyr.stride, xr.data(), xr.stride, w,
            o.offset, o.casting, inv.data_ptr(), dx, dx_stride, dw);
        at::Tensor ws = workspace(ws_bytes, x);
        status = opsmith_rms_norm_ex_bwd_cpu(o.x_dtype, o.weight_dtype, o.y_dtype, xr.rows, xr.n, dyr.data(),
                                             dyr.stride, xr.data(), xr.stride, w, o.offset, o.casting,
                                             inv.data_ptr(), dx, dx_stride, dw, data_or_null(ws), ws_bytes);
    }
    check_status(status, kOp);
}

} // namespace

// y, inv_rms = rms_norm_fwd(x, weight, eps, offset, casting_mode, out_dtype,
// inplace_backward): RMSNorm over the last dim of x, y = x_hat * (offset +
// weight). inv_rms has shape x.shape[:-1], float32 (float64 for float64 x).
// eps defaults to default_eps(x's dtype), as torch.nn.functional.rms_norm;
// out_dtype to x's dtype. inplace_backward is read by the autograd kernel
// only (dx may be written over dy).
std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor &x, const std::optional<at::Tensor> &weight,
                                                std::optional<double> eps, double offset,
                                                c10::string_view casting_mode,
                                                std::optional<at::ScalarType> out_dtype, bool inplace_backward) {
    (void)inplace_backward;
    const Options o = check_call(x, weight, offset, casting_mode, out_dtype.value_or(x.scalar_type()), "out_dtype");
    const double e = eps.has_value() ? *eps : default_eps(x.scalar_type());
    TORCH_CHECK(std::isfinite(e) && e >= 0.0, kOp, ": eps must be a finite number >= 0, got ", text(e));

    const Rows xr = as_rows(x);
    at::Tensor w_holder;
    const void *w = weight_data(weight, w_holder);
    at::Tensor y = empty_output(x.sizes(), x.options().dtype(out_dtype.value_or(x.scalar_type())));
    at::Tensor inv_rms = empty_output(x.sizes().slice(0, x.dim() - 1), x.options().dtype(accumulate_type(x)));
    if (xr.rows == 0) return {y, empty_row_stats(inv_rms)}; // no rows, or rows of width 0

    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (x.is_cuda()) {
        const c10::cuda::CUDAGuard guard(x.device());
        status = opsmith_rms_norm_ex_fwd_cuda(o.x_dtype, o.weight_dtype, o.y_dtype, xr.rows, xr.n, xr.data(),
                                              xr.stride, w, o.offset, e, o.casting, y.data_ptr(), xr.n,
                                              inv_rms.data_ptr(), at::cuda::getCurrentCUDAStream(x.get_device()).stream());
    } else
#endif
    {
        use_torch_cpu_threads();
        status = opsmith_rms_norm_ex_fwd_cpu(o.x_dtype, o.weight_dtype, o.y_dtype, xr.rows, xr.n, xr.data(),
                                             xr.stride, w, o.offset, e, o.casting, y.data_ptr(), xr.n,
                                             inv_rms.data_ptr());
    }
    check_status(status, kOp);
    return {y, inv_rms};
}

// The weight gradient's tensor: (n) in the weight's dtype when it is asked
// for, else shape [0] (no weight, or a weight that needs no gradient: a
// frozen norm, as in LoRA fine-tuning, skips the column sums).
at::Tensor dweight_output(const at::Tensor &x, const std::optional<at::Tensor> &weight, bool weight_grad) {
    const bool wanted = weight.has_value() && weight_grad;
    return empty_output({wanted ? x.size(-1) : 0}, x.options().dtype(weight ? weight->scalar_type() : x.scalar_type()));
}

// dx, dweight = rms_norm_bwd(dy, x, weight, inv_rms, offset, casting_mode,
// weight_grad); dx has x's dtype, dweight the weight's, shape [0] when weight
// is None or weight_grad is false.
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor &dy, const at::Tensor &x,
                                                const std::optional<at::Tensor> &weight, const at::Tensor &inv_rms,
                                                double offset, c10::string_view casting_mode, bool weight_grad) {
    const Options o = check_bwd(dy, x, weight, inv_rms, offset, casting_mode);
    const Rows xr = as_rows(x), dyr = as_rows(dy);
    const at::Tensor inv = inv_rms.contiguous();
    at::Tensor w_holder;
    const void *w = weight_data(weight, w_holder);
    at::Tensor dx = empty_output(x.sizes(), x.options());
    at::Tensor dweight = dweight_output(x, weight, weight_grad);
    if (xr.n > 0) run_bwd(o, dyr, xr, x, w, inv, dx.data_ptr(), xr.n, dweight.numel() ? dweight.data_ptr() : nullptr);
    return {dx, dweight};
}

// True when dx can be written over dy: one dtype, and dy's rows addressable
// in place (no copy would be made).
bool can_write_over(const at::Tensor &dy, const at::Tensor &x) {
    return dy.scalar_type() == x.scalar_type() && dy.sizes() == x.sizes() && dy.numel() > 0 &&
           as_rows(dy).tensor.is_same(dy);
}

// dweight = rms_norm_bwd_(dy, ...): the backward with dx written over dy
// (dy becomes dx); the memory saving of an in-place backward.
at::Tensor rms_norm_bwd_(at::Tensor &dy, const at::Tensor &x, const std::optional<at::Tensor> &weight,
                         const at::Tensor &inv_rms, double offset, c10::string_view casting_mode, bool weight_grad) {
    const Options o = check_bwd(dy, x, weight, inv_rms, offset, casting_mode);
    TORCH_CHECK(can_write_over(dy, x), kOp, ": the in-place backward needs dy in x's dtype (", x.scalar_type(),
                ") with rows addressable in place, got ", dy.scalar_type(), " of strides ", text(dy.strides()));
    const Rows xr = as_rows(x), dyr = as_rows(dy);
    const at::Tensor inv = inv_rms.contiguous();
    at::Tensor w_holder;
    const void *w = weight_data(weight, w_holder);
    at::Tensor dweight = dweight_output(x, weight, weight_grad);
    if (xr.n > 0)
        run_bwd(o, dyr, xr, x, w, inv, dy.data_ptr(), dyr.stride, dweight.numel() ? dweight.data_ptr() : nullptr);
    return dweight;
}

#if OPSMITH_ROUTE_A

} // namespace opsmith

OPSMITH_PYBIND(rms_norm) {
    namespace py = pybind11;
    m.def(
        "rms_norm_fwd",
        [](const at::Tensor &x, const std::optional<at::Tensor> &weight, std::optional<double> eps, double offset,
           const std::string &casting_mode, std::optional<at::ScalarType> out_dtype) {
            return opsmith::rms_norm_fwd(x, weight, eps, offset, casting_mode, out_dtype, false);
        },
        "RMSNorm forward: (y, inv_rms)", py::arg("x"), py::arg("weight"), py::arg("eps") = py::none(),
        py::arg("offset") = 0.0, py::arg("casting_mode") = "none", py::arg("out_dtype") = py::none());
    m.def(
        "rms_norm_bwd",
        [](const at::Tensor &dy, const at::Tensor &x, const std::optional<at::Tensor> &weight,
           const at::Tensor &inv_rms, double offset, const std::string &casting_mode, bool weight_grad) {
            return opsmith::rms_norm_bwd(dy, x, weight, inv_rms, offset, casting_mode, weight_grad);
        },
        "RMSNorm backward: (dx, dweight)", py::arg("dy"), py::arg("x"), py::arg("weight"), py::arg("inv_rms"),
        py::arg("offset") = 0.0, py::arg("casting_mode") = "none", py::arg("weight_grad") = true);
}

namespace opsmith {

#else // route B

namespace {

constexpr const char *kNotTwice =
    "rms_norm: double backward is not supported (the backward of rms_norm is not differentiable); "
    "compute higher-order gradients with torch.nn.functional.rms_norm";

const auto &rms_norm_fwd_op() { return dispatcher_op<rms_norm_fwd>("opsmith::rms_norm_fwd"); }
const auto &rms_norm_bwd_op() { return dispatcher_op<rms_norm_bwd>("opsmith::rms_norm_bwd"); }
const auto &rms_norm_bwd_inplace_op() { return dispatcher_op<rms_norm_bwd_>("opsmith::rms_norm_bwd_"); }

// grad_fn of y: dx and dweight from the saved x, weight and inv_rms.
struct RMSNormBackward : public torch::autograd::Node {
    SavedVariable x_, weight_, inv_rms_;
    bool has_weight_ = false, inplace_ = false;
    double offset_ = 0.0;
    std::string casting_;

    variable_list apply(variable_list &&grads) override {
        at::Tensor dy = std::move(grads[0]); // the engine's reference, so use_count() counts the others
        if (!dy.defined()) return {at::Tensor(), at::Tensor()};
        const at::Tensor x = x_.unpack();
        const std::optional<at::Tensor> w =
            has_weight_ ? std::optional<at::Tensor>(weight_.unpack()) : std::nullopt;
        // the weight's column sums only when this backward delivers them (a
        // frozen weight, or autograd.grad asked for x's gradient alone: not)
        const bool weight_grad = has_weight_ && task_should_compute_output(1);
        at::Tensor dx, dw;
        {
            at::AutoDispatchBelowADInplaceOrView below_autograd;
            // dx over dy when the caller allowed it and dy is plain memory this
            // node owns the use of: not while a graph is built through dy, not
            // for tensor subclasses (torch.compile's tracing), which take the
            // functional op, and not while anything else holds dy or its
            // storage (y + x hands one gradient to both sides; y.backward(g)
            // leaves g with the caller), whose reader would see dx; a wrapper with
            // no storage of its own (torch.func) takes the functional op too
            if (inplace_ && held_only_by(dy, 1) && !dy.requires_grad() && !at::isTensorSubclassLike(dy) && can_write_over(dy, x)) {
                dw = rms_norm_bwd_inplace_op().call(dy, x, w, inv_rms_.unpack(), offset_, casting_, weight_grad);
                dx = dy;
            } else {
                std::tie(dx, dw) = rms_norm_bwd_op().call(dy, x, w, inv_rms_.unpack(), offset_, casting_, weight_grad);
            }
        }
        if (!weight_grad) dw = at::Tensor();
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
                                                         std::optional<double> eps, double offset,
                                                         c10::string_view casting_mode,
                                                         std::optional<at::ScalarType> out_dtype,
                                                         bool inplace_backward) {
    refuse_forward_ad(kOp, x, tensor_or_undefined(weight));
    at::Tensor y, inv_rms;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        std::tie(y, inv_rms) = rms_norm_fwd_op().call(x, weight, eps, offset, casting_mode, out_dtype, inplace_backward);
    }
    if (torch::autograd::compute_requires_grad(x, weight)) {
        auto node = std::make_shared<RMSNormBackward>();
        node->set_next_edges(torch::autograd::collect_next_edges(x, weight));
        node->x_ = SavedVariable(x, false);
        node->has_weight_ = weight.has_value();
        if (weight.has_value()) node->weight_ = SavedVariable(*weight, false);
        node->inv_rms_ = SavedVariable(inv_rms, false);
        node->offset_ = offset;
        node->casting_ = std::string(casting_mode);
        node->inplace_ = inplace_backward;
        torch::autograd::set_history(y, node);
        // inv_rms is a saved statistic, not a result to differentiate through
    }
    return {y, inv_rms};
}

// The raw backward op on tensors that require grad: its results must not
// look differentiable.
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_autograd(const at::Tensor &dy, const at::Tensor &x,
                                                         const std::optional<at::Tensor> &weight,
                                                         const at::Tensor &inv_rms, double offset,
                                                         c10::string_view casting_mode, bool weight_grad) {
    refuse_forward_ad(kOp, dy, x, tensor_or_undefined(weight));
    at::Tensor dx, dw;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        std::tie(dx, dw) = rms_norm_bwd_op().call(dy, x, weight, inv_rms, offset, casting_mode, weight_grad);
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
    m.def("rms_norm_fwd(Tensor x, Tensor? weight, float? eps=None, float offset=0., str casting_mode=\"none\", "
          "ScalarType? out_dtype=None, bool inplace_backward=False) -> (Tensor y, Tensor inv_rms)");
    // weight_grad=False: dweight is not computed (shape [0]), for a weight that needs no gradient
    m.def("rms_norm_bwd(Tensor dy, Tensor x, Tensor? weight, Tensor inv_rms, float offset=0., "
          "str casting_mode=\"none\", bool weight_grad=True) -> (Tensor dx, Tensor dweight)");
    // dx written over dy
    m.def("rms_norm_bwd_(Tensor(a!) dy, Tensor x, Tensor? weight, Tensor inv_rms, float offset=0., "
          "str casting_mode=\"none\", bool weight_grad=True) -> Tensor dweight");
}

TORCH_LIBRARY_IMPL(opsmith, CPU, m) {
    m.impl("rms_norm_fwd", &opsmith::rms_norm_fwd);
    m.impl("rms_norm_bwd", &opsmith::rms_norm_bwd);
    m.impl("rms_norm_bwd_", &opsmith::rms_norm_bwd_);
}

#if OPSMITH_WITH_CUDA
TORCH_LIBRARY_IMPL(opsmith, CUDA, m) {
    m.impl("rms_norm_fwd", &opsmith::rms_norm_fwd);
    m.impl("rms_norm_bwd", &opsmith::rms_norm_bwd);
    m.impl("rms_norm_bwd_", &opsmith::rms_norm_bwd_);
}
#endif

TORCH_LIBRARY_IMPL(opsmith, Autograd, m) {
    m.impl("rms_norm_fwd", &opsmith::rms_norm_fwd_autograd);
    m.impl("rms_norm_bwd", &opsmith::rms_norm_bwd_autograd);
}

#endif // route B
