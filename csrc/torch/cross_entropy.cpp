// cross_entropy in PyTorch: the bridge (checks, outputs, device guard, stream; the
// arithmetic is the C library's, csrc/cpu/cross_entropy.c and csrc/cuda/cross_entropy.cu),
// its route A binding and its route B registration.
//
// Compiled twice: into opsmith._C (route B: schemas, CPU/CUDA kernels and
// autograd in the dispatcher) and, with OPSMITH_ROUTE_A, into opsmith._pybind
// (route A: its OPSMITH_PYBIND binding only, registering nothing with the
// dispatcher).
#include <ATen/ops/empty.h>

#include <cmath>

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

constexpr const char *kOp = "cross_entropy";

// Checks x and alpha; returns the C dtype. Shared by forward and backward.
opsmith_dtype check_x_alpha(const at::Tensor &x, double alpha) {
    check_device_supported(x, kOp);
    const opsmith_dtype dtype = dtype_of(x, kOp, "x");
    TORCH_CHECK(std::isfinite(alpha), kOp, ": alpha must be finite, got ", text(alpha));
    return dtype;
}

// A 0-dim tensor is one row of one element (the C ABI's tensors are (rows, n)).
at::Tensor at_least_1d(const at::Tensor &t) { return t.dim() == 0 ? t.reshape({1}) : t; }

} // namespace

// y = cross_entropy_fwd(x, alpha) = x * sigmoid(alpha * x), any shape; y is contiguous.
at::Tensor cross_entropy_fwd(const at::Tensor &x, double alpha) {
    const opsmith_dtype dtype = check_x_alpha(x, alpha);
    at::Tensor y = at::empty(x.sizes(), x.options());
    if (x.numel() == 0) return y;
    const Rows xr = as_rows(at_least_1d(x));

    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (x.is_cuda()) {
        const c10::cuda::CUDAGuard guard(x.device());
        status = opsmith_cross_entropy_fwd_cuda(dtype, xr.rows, xr.n, xr.data(), xr.stride, alpha, y.data_ptr(), xr.n,
                                     at::cuda::getCurrentCUDAStream(x.get_device()).stream());
    } else
#endif
    {
        use_torch_cpu_threads();
        status = opsmith_cross_entropy_fwd_cpu(dtype, xr.rows, xr.n, xr.data(), xr.stride, alpha, y.data_ptr(), xr.n);
    }
    check_status(status, kOp);
    return y;
}

// dx = cross_entropy_bwd(dy, x, alpha); dy has the shape, dtype and device of x.
at::Tensor cross_entropy_bwd(const at::Tensor &dy, const at::Tensor &x, double alpha) {
    const opsmith_dtype dtype = check_x_alpha(x, alpha);
    check_same_device(dy, x, kOp, "dy");
    check_same_dtype(dy, x, kOp, "dy");
    TORCH_CHECK(dy.sizes() == x.sizes(), kOp, ": dy must have the shape of x ", text(x.sizes()), ", got ",
                text(dy.sizes()));
    at::Tensor dx = at::empty(x.sizes(), x.options());
    if (x.numel() == 0) return dx;
    const Rows xr = as_rows(at_least_1d(x)), dyr = as_rows(at_least_1d(dy));

    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (x.is_cuda()) {
        const c10::cuda::CUDAGuard guard(x.device());
        status = opsmith_cross_entropy_bwd_cuda(dtype, xr.rows, xr.n, dyr.data(), dyr.stride, xr.data(), xr.stride, alpha,
                                     dx.data_ptr(), xr.n, at::cuda::getCurrentCUDAStream(x.get_device()).stream());
    } else
#endif
    {
        use_torch_cpu_threads();
        status = opsmith_cross_entropy_bwd_cpu(dtype, xr.rows, xr.n, dyr.data(), dyr.stride, xr.data(), xr.stride, alpha,
                                    dx.data_ptr(), xr.n);
    }
    check_status(status, kOp);
    return dx;
}

#if OPSMITH_ROUTE_A

} // namespace opsmith

OPSMITH_PYBIND(cross_entropy) {
    namespace py = pybind11;
    m.def("cross_entropy_fwd", &opsmith::cross_entropy_fwd, "cross_entropy forward: y", py::arg("x"), py::arg("alpha") = 1.0);
    m.def("cross_entropy_bwd", &opsmith::cross_entropy_bwd, "cross_entropy backward: dx", py::arg("dy"), py::arg("x"),
          py::arg("alpha") = 1.0);
}

namespace opsmith {

#else // route B

namespace {

constexpr const char *kNotTwice =
    "cross_entropy: double backward is not supported (the backward of cross_entropy is not differentiable)";

// the dispatcher's handles of the two ops (autograd.h), looked up once
const auto &cross_entropy_fwd_op() { return dispatcher_op<cross_entropy_fwd>("opsmith::cross_entropy_fwd"); }
const auto &cross_entropy_bwd_op() { return dispatcher_op<cross_entropy_bwd>("opsmith::cross_entropy_bwd"); }

// grad_fn of y: dx from the saved x (s is recomputed, nothing else is kept).
struct CrossEntropyBackward : public torch::autograd::Node {
    SavedVariable x_;
    double alpha_ = 1.0;

    variable_list apply(variable_list &&grads) override {
        const at::Tensor &dy = grads[0];
        if (!dy.defined()) return {at::Tensor()};
        const at::Tensor x = x_.unpack();
        at::Tensor dx;
        {
            at::AutoDispatchBelowADInplaceOrView below_autograd;
            dx = cross_entropy_bwd_op().call(dy, x, alpha_);
        }
        refuse_double_backward(kNotTwice, {dx}, dy, x);
        return {dx};
    }
    void release_variables() override { x_.reset_data(); }
    std::string name() const override { return "CrossEntropyBackward"; }
};

at::Tensor cross_entropy_fwd_autograd(const at::Tensor &x, double alpha) {
    refuse_forward_ad(kOp, x);
    at::Tensor y;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        y = cross_entropy_fwd_op().call(x, alpha);
    }
    if (torch::autograd::compute_requires_grad(x)) {
        auto node = std::make_shared<CrossEntropyBackward>();
        node->set_next_edges(torch::autograd::collect_next_edges(x));
        node->x_ = SavedVariable(x, false);
        node->alpha_ = alpha;
        torch::autograd::set_history(y, node);
    }
    return y;
}

// The raw backward op on tensors that require grad: its result must not
// look differentiable.
at::Tensor cross_entropy_bwd_autograd(const at::Tensor &dy, const at::Tensor &x, double alpha) {
    refuse_forward_ad(kOp, dy, x);
    at::Tensor dx;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        dx = cross_entropy_bwd_op().call(dy, x, alpha);
    }
    refuse_double_backward(kNotTwice, {dx}, dy, x);
    return dx;
}

} // namespace

#endif // route B

} // namespace opsmith

#if !OPSMITH_ROUTE_A

TORCH_LIBRARY_FRAGMENT(opsmith, m) {
    m.set_python_module("opsmith.ops.cross_entropy");
    m.def("cross_entropy_fwd(Tensor x, float alpha=1.0) -> Tensor y");
    m.def("cross_entropy_bwd(Tensor dy, Tensor x, float alpha=1.0) -> Tensor dx");
}

TORCH_LIBRARY_IMPL(opsmith, CPU, m) {
    m.impl("cross_entropy_fwd", &opsmith::cross_entropy_fwd);
    m.impl("cross_entropy_bwd", &opsmith::cross_entropy_bwd);
}

#if OPSMITH_WITH_CUDA
TORCH_LIBRARY_IMPL(opsmith, CUDA, m) {
    m.impl("cross_entropy_fwd", &opsmith::cross_entropy_fwd);
    m.impl("cross_entropy_bwd", &opsmith::cross_entropy_bwd);
}
#endif

TORCH_LIBRARY_IMPL(opsmith, Autograd, m) {
    m.impl("cross_entropy_fwd", &opsmith::cross_entropy_fwd_autograd);
    m.impl("cross_entropy_bwd", &opsmith::cross_entropy_bwd_autograd);
}

#endif // route B
