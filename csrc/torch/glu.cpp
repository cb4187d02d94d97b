// Gated activations in PyTorch (swiglu, geglu): the bridge (checks, outputs,
// device guard, stream; the arithmetic is the C library's, csrc/cpu/glu.c and
// csrc/cuda/glu.cu), its route A binding and its route B registration.
//
// gate and up are separate tensors of one shape, or up is None and gate is
// the packed output of a fused gate-up projection, [..., 2I]: gate its first
// half, up its second. The packed form reaches the C ABI as two pointers into
// the one buffer (no copy), and its gradient is written into ONE packed
// buffer [..., 2I] the same way.
//
// Compiled twice, like every bridge: into opsmith._C (route B) and, with
// OPSMITH_ROUTE_A, into opsmith._pybind (route A).
#include <ATen/ops/empty.h>

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

// The public name of the call, for messages: swiglu for silu, geglu for the GELUs.
const char *op_name(const std::string &activation) { return activation == "silu" ? "swiglu" : "geglu"; }

opsmith_glu_activation activation_of(const std::string &a) {
    if (a == "silu") return OPSMITH_GLU_ACTIVATION_SILU;
    if (a == "gelu") return OPSMITH_GLU_ACTIVATION_GELU;
    if (a == "gelu_tanh") return OPSMITH_GLU_ACTIVATION_GELU_TANH;
    TORCH_CHECK(false, "glu: activation must be 'silu', 'gelu' or 'gelu_tanh', got '", a, "'");
}

// gate, up (or packed gate) as the C ABI sees them: two (rows, n) operands.
struct Halves {
    Rows rows;            // the gate tensor's (rows, width) view; keeps a copy alive
    Rows up_rows;         // up's, when separate
    const char *gate_ptr, *up_ptr;
    int64_t gate_stride, up_stride, n;
    bool packed;
};

// Checks gate and up; `what` is the op name for messages.
opsmith_dtype check_inputs(const char *op, const at::Tensor &gate, const std::optional<at::Tensor> &up) {
    check_device_supported(gate, op);
    TORCH_CHECK(gate.dim() >= 1, op, ": gate must have at least 1 dimension, got a 0-dim tensor");
    const opsmith_dtype dtype = dtype_of(gate, op, "gate");
    if (up.has_value()) {
        const at::Tensor &u = *up;
        TORCH_CHECK(u.device() == gate.device(), op, ": up must be on the same device as gate (", gate.device(),
                    "), got ", u.device());
        TORCH_CHECK(u.scalar_type() == gate.scalar_type(), op, ": up must have the same dtype as gate (",
                    gate.scalar_type(), "), got ", u.scalar_type());
        TORCH_CHECK(u.sizes() == gate.sizes(), op, ": up must have the shape of gate ", text(gate.sizes()), ", got ",
                    text(u.sizes()));
    } else {
        TORCH_CHECK(gate.size(-1) % 2 == 0, op,
                    ": a packed gate-up tensor (up None) must have an even last dimension [..., 2*I], "
                    "got shape ", text(gate.sizes()));
    }
    return dtype;
}

Halves halves_of(const at::Tensor &gate, const std::optional<at::Tensor> &up) {
    Halves h;
    h.rows = as_rows(gate);
    h.packed = !up.has_value();
    const size_t es = gate.element_size();
    const char *base = static_cast<const char *>(h.rows.data());
    h.gate_ptr = base;
    h.gate_stride = h.rows.stride;
    if (h.packed) {
        h.n = h.rows.n / 2;
        h.up_ptr = base + h.n * es;
        h.up_stride = h.rows.stride;
    } else {
        h.n = h.rows.n;
        h.up_rows = as_rows(*up);
        h.up_ptr = static_cast<const char *>(h.up_rows.data());
        h.up_stride = h.up_rows.stride;
    }
    return h;
}

// The output shape: gate's, with the last dim halved for the packed form.
std::vector<int64_t> out_shape(const at::Tensor &gate, bool packed) {
    std::vector<int64_t> s(gate.sizes().begin(), gate.sizes().end());
    if (packed) s.back() /= 2;
    return s;
}

} // namespace

// y = act(gate) * up; up None: gate is packed [..., 2I] and y is [..., I].
at::Tensor glu_fwd(const at::Tensor &gate, const std::optional<at::Tensor> &up, const std::string &activation) {
    const opsmith_glu_activation act = activation_of(activation);
    const char *op = op_name(activation);
    const opsmith_dtype dtype = check_inputs(op, gate, up);
    const Halves h = halves_of(gate, up);
    at::Tensor y = empty_output(out_shape(gate, h.packed), gate.options());
    const int64_t rows = h.rows.rows;
    if (rows == 0) return y;
    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (gate.is_cuda()) {
        const c10::cuda::CUDAGuard guard(gate.device());
        status = opsmith_glu_fwd_cuda(act, dtype, rows, h.n, h.gate_ptr, h.gate_stride, h.up_ptr, h.up_stride,
                                      y.data_ptr(), h.n, at::cuda::getCurrentCUDAStream(gate.get_device()).stream());
    } else
#endif
    {
        use_torch_cpu_threads();
        status = opsmith_glu_fwd_cpu(act, dtype, rows, h.n, h.gate_ptr, h.gate_stride, h.up_ptr, h.up_stride,
                                     y.data_ptr(), h.n);
    }
    check_status(status, op);
    return y;
}

// dgate, dup, h = glu_bwd(dy, gate, up, activation, with_h). Packed (up
// None): dgate is the whole packed gradient [..., 2I] and dup has shape [0].
// h (act(gate) * up, recomputed in the same pass) has shape [0] unless with_h.
std::tuple<at::Tensor, at::Tensor, at::Tensor> glu_bwd(const at::Tensor &dy, const at::Tensor &gate,
                                                       const std::optional<at::Tensor> &up,
                                                       const std::string &activation, bool with_h) {
    const opsmith_glu_activation act = activation_of(activation);
    const char *op = op_name(activation);
    const opsmith_dtype dtype = check_inputs(op, gate, up);
    const bool packed = !up.has_value();
    const std::vector<int64_t> yshape = out_shape(gate, packed);
    TORCH_CHECK(dy.device() == gate.device(), op, ": dy must be on the same device as gate (", gate.device(),
                "), got ", dy.device());
    TORCH_CHECK(dy.scalar_type() == gate.scalar_type(), op, ": dy must have the same dtype as gate (",
                gate.scalar_type(), "), got ", dy.scalar_type());
    TORCH_CHECK(dy.sizes() == at::IntArrayRef(yshape), op, ": dy must have the output's shape ", text(yshape),
                ", got ", text(dy.sizes()));
    const Halves h = halves_of(gate, up);
    const Rows dyr = as_rows(dy);
    at::Tensor dgate = empty_output(gate.sizes(), gate.options());
    at::Tensor dup = empty_output(packed ? std::vector<int64_t>{0} : yshape, gate.options());
    at::Tensor hout = empty_output(with_h ? yshape : std::vector<int64_t>{0}, gate.options());
    const int64_t rows = h.rows.rows, n = h.n;
    if (rows == 0) return {dgate, dup, hout};
    const size_t es = gate.element_size();
    // packed: both halves of one (rows, 2n) buffer; else two (rows, n) ones
    char *dg = static_cast<char *>(dgate.data_ptr());
    char *du = packed ? dg + n * es : static_cast<char *>(dup.data_ptr());
    const int64_t gs = packed ? 2 * n : n;
    void *hp = with_h ? hout.data_ptr() : nullptr;
    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (gate.is_cuda()) {
        const c10::cuda::CUDAGuard guard(gate.device());
        status = opsmith_glu_bwd_cuda(act, dtype, rows, n, dyr.data(), dyr.stride, h.gate_ptr, h.gate_stride, h.up_ptr,
                                      h.up_stride, dg, gs, du, gs, hp, n,
                                      at::cuda::getCurrentCUDAStream(gate.get_device()).stream());
    } else
#endif
    {
        use_torch_cpu_threads();
        status = opsmith_glu_bwd_cpu(act, dtype, rows, n, dyr.data(), dyr.stride, h.gate_ptr, h.gate_stride, h.up_ptr,
                                     h.up_stride, dg, gs, du, gs, hp, n);
    }
    check_status(status, op);
    return {dgate, dup, hout};
}

#if OPSMITH_ROUTE_A

} // namespace opsmith

OPSMITH_PYBIND(glu) {
    namespace py = pybind11;
    m.def("glu_fwd", &opsmith::glu_fwd, "gated activation forward: act(gate) * up (up None: gate packed)",
          py::arg("gate"), py::arg("up"), py::arg("activation") = "silu");
    m.def("glu_bwd", &opsmith::glu_bwd, "gated activation backward: (dgate, dup, h)", py::arg("dy"), py::arg("gate"),
          py::arg("up"), py::arg("activation") = "silu", py::arg("with_h") = false);
}

namespace opsmith {

#else // route B

namespace {

std::string not_twice(const std::string &activation) {
    return std::string(op_name(activation)) +
           ": double backward is not supported (the backward of the gated activation is not differentiable); "
           "compute higher-order gradients with torch.nn.functional." +
           (activation == "silu" ? "silu(gate) * up" : "gelu(gate) * up");
}

const auto &glu_fwd_op() { return dispatcher_op<glu_fwd>("opsmith::glu_fwd"); }
const auto &glu_bwd_op() { return dispatcher_op<glu_bwd>("opsmith::glu_bwd"); }

// grad_fn of y: dgate and dup (or the one packed gradient) from the saved gate and up.
struct GLUBackward : public torch::autograd::Node {
    SavedVariable gate_, up_;
    bool has_up_ = false;
    std::string activation_;

    variable_list apply(variable_list &&grads) override {
        const at::Tensor &dy = grads[0];
        if (!dy.defined()) return {at::Tensor(), at::Tensor()};
        const at::Tensor gate = gate_.unpack();
        const std::optional<at::Tensor> up = has_up_ ? std::optional<at::Tensor>(up_.unpack()) : std::nullopt;
        at::Tensor dgate, dup, h;
        {
            at::AutoDispatchBelowADInplaceOrView below_autograd;
            std::tie(dgate, dup, h) = glu_bwd_op().call(dy, gate, up, activation_, false);
        }
        if (!has_up_) dup = at::Tensor();
        refuse_double_backward(not_twice(activation_), {dgate, dup}, dy, gate, up);
        return {dgate, dup};
    }
    void release_variables() override {
        gate_.reset_data();
        up_.reset_data();
    }
    std::string name() const override { return "GLUBackward"; }
};

at::Tensor glu_fwd_autograd(const at::Tensor &gate, const std::optional<at::Tensor> &up,
                            const std::string &activation) {
    refuse_forward_ad(op_name(activation), gate, tensor_or_undefined(up));
    at::Tensor y;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        y = glu_fwd_op().call(gate, up, activation);
    }
    if (torch::autograd::compute_requires_grad(gate, up)) {
        auto node = std::make_shared<GLUBackward>();
        node->set_next_edges(torch::autograd::collect_next_edges(gate, up));
        node->gate_ = SavedVariable(gate, false);
        node->has_up_ = up.has_value();
        if (up.has_value()) node->up_ = SavedVariable(*up, false);
        node->activation_ = activation;
        torch::autograd::set_history(y, node);
    }
    return y;
}

// The raw backward op on tensors that require grad: its results must not
// look differentiable.
std::tuple<at::Tensor, at::Tensor, at::Tensor> glu_bwd_autograd(const at::Tensor &dy, const at::Tensor &gate,
                                                                const std::optional<at::Tensor> &up,
                                                                const std::string &activation, bool with_h) {
    refuse_forward_ad(op_name(activation), dy, gate, tensor_or_undefined(up));
    at::Tensor dgate, dup, h;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        std::tie(dgate, dup, h) = glu_bwd_op().call(dy, gate, up, activation, with_h);
    }
    refuse_double_backward(not_twice(activation), {dgate, dup, h}, dy, gate, up);
    return {dgate, dup, h};
}

} // namespace

#endif // route B

} // namespace opsmith

#if !OPSMITH_ROUTE_A

TORCH_LIBRARY_FRAGMENT(opsmith, m) {
    m.set_python_module("opsmith.ops.glu");
    m.def("glu_fwd(Tensor gate, Tensor? up, str activation=\"silu\") -> Tensor y");
    m.def("glu_bwd(Tensor dy, Tensor gate, Tensor? up, str activation=\"silu\", bool with_h=False) "
          "-> (Tensor dgate, Tensor dup, Tensor h)");
}

TORCH_LIBRARY_IMPL(opsmith, CPU, m) {
    m.impl("glu_fwd", &opsmith::glu_fwd);
    m.impl("glu_bwd", &opsmith::glu_bwd);
}

#if OPSMITH_WITH_CUDA
TORCH_LIBRARY_IMPL(opsmith, CUDA, m) {
    m.impl("glu_fwd", &opsmith::glu_fwd);
    m.impl("glu_bwd", &opsmith::glu_bwd);
}
#endif

TORCH_LIBRARY_IMPL(opsmith, Autograd, m) {
    m.impl("glu_fwd", &opsmith::glu_fwd_autograd);
    m.impl("glu_bwd", &opsmith::glu_bwd_autograd);
}

#endif // route B
