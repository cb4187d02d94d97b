// softmax and log_softmax in PyTorch: the bridge (checks, outputs, device guard,
// stream; the arithmetic is the C library's, csrc/cpu/softmax.c and
// csrc/cuda/softmax.cu), its route A binding and its route B registration.
// Over the last dim; the Python layer moves another dim there.
#include <ATen/ops/empty.h>

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

constexpr const char *kOp = "softmax";

// A 0-dim tensor is one row of one element (the C ABI's tensors are (rows, n)).
at::Tensor at_least_1d(const at::Tensor &t) { return t.dim() == 0 ? t.reshape({1}) : t; }

} // namespace

// y = softmax_fwd(x, log): softmax (or log_softmax) over the last dim; y is contiguous.
at::Tensor softmax_fwd(const at::Tensor &x, bool log) {
    check_device_supported(x, kOp);
    const opsmith_dtype dtype = dtype_of(x, kOp, "x");
    at::Tensor y = empty_output(x.sizes(), x.options());
    if (x.numel() == 0) return y;
    const Rows xr = as_rows(at_least_1d(x));
    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (x.is_cuda()) {
        const c10::cuda::CUDAGuard guard(x.device());
        status = opsmith_softmax_fwd_cuda(dtype, xr.rows, xr.n, xr.data(), xr.stride, log, y.data_ptr(), xr.n,
                                          at::cuda::getCurrentCUDAStream(x.get_device()).stream());
    } else
#endif
    {
        use_torch_cpu_threads();
        status = opsmith_softmax_fwd_cpu(dtype, xr.rows, xr.n, xr.data(), xr.stride, log, y.data_ptr(), xr.n);
    }
    check_status(status, kOp);
    return y;
}

// dx = softmax_bwd(dy, y, log) from the forward's output y; dy has y's shape, dtype and device.
at::Tensor softmax_bwd(const at::Tensor &dy, const at::Tensor &y, bool log) {
    check_device_supported(y, kOp);
    const opsmith_dtype dtype = dtype_of(y, kOp, "y");
    check_same_device(dy, y, kOp, "dy");
    TORCH_CHECK(dy.scalar_type() == y.scalar_type(), kOp, ": dy must have y's dtype (", y.scalar_type(), "), got ",
                dy.scalar_type());
    TORCH_CHECK(dy.sizes() == y.sizes(), kOp, ": dy must have the shape of y ", text(y.sizes()), ", got ",
                text(dy.sizes()));
    at::Tensor dx = empty_output(y.sizes(), y.options());
    if (y.numel() == 0) return dx;
    const Rows yr = as_rows(at_least_1d(y)), dyr = as_rows(at_least_1d(dy));
    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (y.is_cuda()) {
        const c10::cuda::CUDAGuard guard(y.device());
        status = opsmith_softmax_bwd_cuda(dtype, yr.rows, yr.n, dyr.data(), dyr.stride, yr.data(), yr.stride, log,
                                          dx.data_ptr(), yr.n, at::cuda::getCurrentCUDAStream(y.get_device()).stream());
    } else
#endif
    {
        use_torch_cpu_threads();
        status = opsmith_softmax_bwd_cpu(dtype, yr.rows, yr.n, dyr.data(), dyr.stride, yr.data(), yr.stride, log,
                                         dx.data_ptr(), yr.n);
    }
    check_status(status, kOp);
    return dx;
}

#if OPSMITH_ROUTE_A

} // namespace opsmith

OPSMITH_PYBIND(softmax) {
    namespace py = pybind11;
    m.def("softmax_fwd", &opsmith::softmax_fwd, "softmax forward: y", py::arg("x"), py::arg("log") = false);
    m.def("softmax_bwd", &opsmith::softmax_bwd, "softmax backward: dx", py::arg("dy"), py::arg("y"),
          py::arg("log") = false);
}

namespace opsmith {

#else // route B

namespace {

constexpr const char *kNotTwice =
    "softmax: double backward is not supported (the backward of softmax is not differentiable); "
    "compute higher-order gradients with torch.softmax";

const auto &softmax_fwd_op() { return dispatcher_op<softmax_fwd>("opsmith::softmax_fwd"); }
const auto &softmax_bwd_op() { return dispatcher_op<softmax_bwd>("opsmith::softmax_bwd"); }

// grad_fn of y: dx from the saved output y (the input is not kept).
struct SoftmaxBackward : public torch::autograd::Node {
    SavedVariable y_;
    bool log_ = false;

    variable_list apply(variable_list &&grads) override {
        const at::Tensor &dy = grads[0];
        if (!dy.defined()) return {at::Tensor()};
        const at::Tensor y = y_.unpack(shared_from_this());
        at::Tensor dx;
        {
            at::AutoDispatchBelowADInplaceOrView below_autograd;
            dx = softmax_bwd_op().call(dy, y, log_);
        }
        if (at::GradMode::is_enabled())
            torch::autograd::set_history(dx, std::make_shared<torch::autograd::Error>(
                                                 kNotTwice, torch::autograd::edge_list(next_edges())));
        return {dx};
    }
    void release_variables() override { y_.reset_data(); }
    std::string name() const override { return log_ ? "LogSoftmaxBackward" : "SoftmaxBackward"; }
};

at::Tensor softmax_fwd_autograd(const at::Tensor &x, bool log) {
    refuse_forward_ad(kOp, x);
    at::Tensor y;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        y = softmax_fwd_op().call(x, log);
    }
    if (torch::autograd::compute_requires_grad(x)) {
        auto node = std::make_shared<SoftmaxBackward>();
        node->set_next_edges(torch::autograd::collect_next_edges(x));
        node->log_ = log;
        torch::autograd::set_history(y, node);
        node->y_ = SavedVariable(y, true);
    }
    return y;
}

// The raw backward op on tensors that require grad: its result must not
// look differentiable.
at::Tensor softmax_bwd_autograd(const at::Tensor &dy, const at::Tensor &y, bool log) {
    refuse_forward_ad(kOp, dy, y);
    at::Tensor dx;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        dx = softmax_bwd_op().call(dy, y, log);
    }
    refuse_double_backward(kNotTwice, {dx}, dy, y);
    return dx;
}

} // namespace

#endif // route B

} // namespace opsmith

#if !OPSMITH_ROUTE_A

TORCH_LIBRARY_FRAGMENT(opsmith, m) {
    m.set_python_module("opsmith.ops.softmax");
    m.def("softmax_fwd(Tensor x, bool log=False) -> Tensor y");
    m.def("softmax_bwd(Tensor dy, Tensor y, bool log=False) -> Tensor dx");
}

TORCH_LIBRARY_IMPL(opsmith, CPU, m) {
    m.impl("softmax_fwd", &opsmith::softmax_fwd);
    m.impl("softmax_bwd", &opsmith::softmax_bwd);
}

#if OPSMITH_WITH_CUDA
TORCH_LIBRARY_IMPL(opsmith, CUDA, m) {
    m.impl("softmax_fwd", &opsmith::softmax_fwd);
    m.impl("softmax_bwd", &opsmith::softmax_bwd);
}
#endif

TORCH_LIBRARY_IMPL(opsmith, Autograd, m) {
    m.impl("softmax_fwd", &opsmith::softmax_fwd_autograd);
    m.impl("softmax_bwd", &opsmith::softmax_bwd_autograd);
}

#endif // route B
