// fused_linear_cross_entropy in PyTorch: the bridge (checks, outputs, device
// guard, stream, workspace; the arithmetic is the C library's,
// csrc/cpu/fused_linear_cross_entropy.c and csrc/cuda/fused_linear_cross_entropy.cu),
// its route A binding and its route B registration.
//
// The forward computes the loss and, when asked (or when an input requires
// grad), the gradients of hidden, weight and bias for an incoming gradient of
// 1; the backward only scales them by the incoming gradient through
// cross_entropy's backward ops (in place, and not at all on the device when
// that gradient is exactly 1: the common loss.backward()).
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
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

constexpr const char *kOp = "fused_linear_cross_entropy";
// the extra memory a call may take on the GPU: the chunk of logits, and a
// float32 dweight accumulator where it fits beside it; each at most a
// quarter of what the device has free at the call (device_free_bytes: its
// memory less PyTorch's live tensors), so a nearly full device gets smaller
// chunks rather than an out-of-memory error
constexpr size_t kBudget = size_t(1) << 30;
constexpr size_t kChunkBudget = size_t(512) << 20;
constexpr size_t kMinChunkBudget = size_t(16) << 20;

// the chunk budget: kChunkBudget, or OPSMITH_FLCE_CHUNK_MB (16-4096, read
// once) to trade the chunk's memory against the products' size when
// measuring a whole training step (opsmith bench --e2e)
size_t chunk_budget_setting() {
    static const size_t budget = [] {
        const char *v = getenv("OPSMITH_FLCE_CHUNK_MB");
        char *end = nullptr;
        const long mb = v && *v ? strtol(v, &end, 10) : 0;
        return v && *v && !*end && mb >= 16 && mb <= 4096 ? (size_t)mb << 20 : kChunkBudget;
    }();
    return budget;
}

struct Checked {
    opsmith_dtype dtype;
    Rows h;
    at::Tensor weight, target;
};

Checked check_fwd(const at::Tensor &hidden, const at::Tensor &weight, const at::Tensor &target,
                  const std::optional<at::Tensor> &bias, double ls, double z_loss, double softcap, int64_t reduction,
                  int64_t chunk_size) {
    check_device_supported(hidden, kOp);
    const opsmith_dtype dtype = dtype_of(hidden, kOp, "hidden");
    TORCH_CHECK(hidden.dim() == 2, kOp, ": hidden must be 2-D (N, D), got ", text(hidden.sizes()));
    TORCH_CHECK(hidden.size(1) >= 1, kOp, ": hidden must have at least one feature, got ", text(hidden.sizes()));
    check_same_device(weight, hidden, kOp, "weight");
    TORCH_CHECK(weight.scalar_type() == hidden.scalar_type(), kOp, ": weight must have hidden's dtype (",
                hidden.scalar_type(), "), got ", weight.scalar_type(),
                " (under mixed precision use autocast, or cast the weight)");
    TORCH_CHECK(weight.dim() == 2 && weight.size(1) == hidden.size(1) && weight.size(0) >= 1, kOp,
                ": weight must have shape [V, ", text(hidden.size(1)), "] (the lm_head weight, V >= 1), got ",
                text(weight.sizes()));
    TORCH_CHECK(target.scalar_type() == at::kLong, kOp, ": target must be int64 class indices, got ",
                target.scalar_type());
    check_same_device(target, hidden, kOp, "target");
    TORCH_CHECK(target.dim() == 1 && target.size(0) == hidden.size(0), kOp, ": target must have shape [",
                text(hidden.size(0)), "] (hidden's rows), got ", text(target.sizes()));
    if (bias.has_value() && bias->defined()) {
        check_same_device(*bias, hidden, kOp, "bias");
        TORCH_CHECK(bias->scalar_type() == hidden.scalar_type(), kOp, ": bias must have hidden's dtype (",
                    hidden.scalar_type(), "), got ", bias->scalar_type());
        TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), kOp, ": bias must have shape [",
                    text(weight.size(0)), "] (weight's rows), got ", text(bias->sizes()));
    }
    TORCH_CHECK(ls >= 0.0 && ls <= 1.0, kOp, ": label_smoothing must be in [0, 1], got ", text(ls));
    TORCH_CHECK(std::isfinite(z_loss) && z_loss >= 0.0, kOp, ": z_loss must be finite and >= 0, got ", text(z_loss));
    TORCH_CHECK(std::isfinite(softcap) && softcap >= 0.0, kOp, ": softcap must be finite and > 0 (or 0: none), got ",
                text(softcap));
    TORCH_CHECK(reduction == 1 || reduction == 2, kOp, ": reduction must be 1 (sum) or 2 (mean), got ", text(reduction));
    TORCH_CHECK(chunk_size >= 0, kOp, ": chunk_size must be >= 0 (0: chosen from the shape), got ", text(chunk_size));
    return {dtype, as_rows(hidden), weight.contiguous(), target.contiguous()};
}

} // namespace

// (loss, z_loss, dhidden, dweight, dbias, error) = fused_linear_cross_entropy_fwd(hidden (N, D),
// weight (V, D), target (N), bias (V)?, ...): loss and z_loss [] in the accumulate type; each gradient
// (for an incoming gradient of 1; float32 for float16 inputs, else the inputs' dtype) when its flag is
// set (dbias also needs bias), else empty;
// error: the device-side flag of out-of-range targets (3 int64).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
fused_linear_cross_entropy_fwd(const at::Tensor &hidden, const at::Tensor &weight, const at::Tensor &target,
                               const std::optional<at::Tensor> &bias, int64_t ignore_index, double label_smoothing,
                               double z_loss, double softcap, int64_t reduction, int64_t chunk_size,
                               bool grad_hidden, bool grad_weight, bool grad_bias) {
    const Checked c = check_fwd(hidden, weight, target, bias, label_smoothing, z_loss, softcap, reduction, chunk_size);
    const bool has_bias = bias.has_value() && bias->defined();
    const int64_t N = c.h.rows, D = c.h.n, V = weight.size(0);
    const auto opts = hidden.options();
    // the loss in float32 for 16-bit inputs (float64 for float64), as the
    // float32 cross-entropy of an LM head's logits gives
    const auto acc_opts = opts.dtype(accumulate_type(hidden));
    at::Tensor loss = empty_output({}, acc_opts), z = empty_output({}, acc_opts);
    // float16's gradients in float32: the backward scales them by the incoming
    // gradient (a loss scaler's 65536, say) and autograd rounds them to
    // float16 after that, as the unfused path rounds; stored in float16 for
    // an incoming gradient of 1, a mean's elements below 6.1e-5 would lose
    // their bits before the scale
    const bool f32_grads = c.dtype == OPSMITH_DTYPE_F16;
    const auto grad_opts = f32_grads ? opts.dtype(at::kFloat) : opts;
    at::Tensor dh = grad_hidden ? empty_output({N, D}, grad_opts) : empty_output({0}, grad_opts);
    at::Tensor dw = grad_weight ? empty_output({V, D}, grad_opts) : empty_output({0}, grad_opts);
    at::Tensor db = grad_bias && has_bias ? empty_output({V}, grad_opts) : empty_output({0}, grad_opts);
    at::Tensor error = at::zeros({OPSMITH_CROSS_ENTROPY_ERROR_COUNT}, opts.dtype(at::kLong));
    const bool cuda = hidden.is_cuda();
    const size_t size = hidden.element_size();
    const size_t quarter_free = device_free_bytes(hidden) / 4;
    const size_t chunk_budget = std::max(kMinChunkBudget, std::min(chunk_budget_setting(), quarter_free));
    const int64_t chunk =
        chunk_size > 0 ? chunk_size : opsmith_fused_linear_cross_entropy_chunk_rows(c.dtype, N, V, chunk_budget);
    const int64_t cmin = chunk < N ? chunk : (N > 0 ? N : 1);
    const int fp32_dw = f32_grads ? OPSMITH_FLCE_GRADS_FLOAT32
                        : cuda && grad_weight && size == 2 &&
                                  (size_t)V * D * 4 + (size_t)cmin * V * size <= std::min(kBudget, 2 * quarter_free)
                            ? OPSMITH_FLCE_DWEIGHT_ACC_FLOAT32
                            : OPSMITH_FLCE_GRADS_IN_DTYPE;
    const size_t wb = opsmith_fused_linear_cross_entropy_workspace_size(c.dtype, N, D, V, chunk, fp32_dw, cuda);
    at::Tensor ws = workspace(wb, hidden);
    const void *x = N ? c.h.data() : nullptr;
    const int64_t *t = N ? c.target.const_data_ptr<int64_t>() : nullptr;
    const at::Tensor bias_c = has_bias ? bias->contiguous() : at::Tensor();
    const void *b = has_bias ? bias_c.data_ptr() : nullptr;
    const auto red = (opsmith_cross_entropy_reduction)reduction;
    void *dhp = grad_hidden ? data_or_null(dh) : nullptr, *dwp = grad_weight ? dw.data_ptr() : nullptr;
    void *dbp = db.numel() ? db.data_ptr() : nullptr;
    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (cuda) {
        const c10::cuda::CUDAGuard guard(hidden.device());
        status = opsmith_fused_linear_cross_entropy_fwd_cuda(
            c.dtype, N, D, V, x, c.h.stride, c.weight.data_ptr(), b, t, 1, ignore_index, label_smoothing, z_loss,
            softcap, red, chunk, fp32_dw, loss.data_ptr(), z.data_ptr(), dhp, dwp, dbp, error.data_ptr<int64_t>(),
            ws.data_ptr(), wb, at::cuda::getCurrentCUDAStream(hidden.get_device()).stream());
    } else
#endif
    {
        use_torch_cpu_threads();
        status = opsmith_fused_linear_cross_entropy_fwd_cpu(
            c.dtype, N, D, V, x, c.h.stride, c.weight.data_ptr(), b, t, 1, ignore_index, label_smoothing, z_loss,
            softcap, red, chunk, fp32_dw, loss.data_ptr(), z.data_ptr(), dhp, dwp, dbp, error.data_ptr<int64_t>(),
            ws.data_ptr(), wb);
        TORCH_CHECK_INDEX(status != OPSMITH_STATUS_INVALID_ARGUMENT || !std::strstr(opsmith_last_error(), "out of range"),
                          kOp, ": ", std::strstr(opsmith_last_error(), "target"));
    }
    check_status(status, kOp);
    return {loss, z, dh, dw, db, error};
}

#if OPSMITH_ROUTE_A

} // namespace opsmith

OPSMITH_PYBIND(fused_linear_cross_entropy) {
    namespace py = pybind11;
    m.def("fused_linear_cross_entropy_fwd", &opsmith::fused_linear_cross_entropy_fwd,
          "fused_linear_cross_entropy forward: (loss, z_loss, dhidden, dweight, dbias, error)", py::arg("hidden"),
          py::arg("weight"), py::arg("target"), py::arg("bias"), py::arg("ignore_index") = -100,
          py::arg("label_smoothing") = 0.0, py::arg("z_loss") = 0.0, py::arg("softcap") = 0.0,
          py::arg("reduction") = 2, py::arg("chunk_size") = 0, py::arg("grad_hidden") = false,
          py::arg("grad_weight") = false, py::arg("grad_bias") = false);
}

namespace opsmith {

#else // route B

namespace {

constexpr const char *kNotTwice =
    "fused_linear_cross_entropy: double backward is not supported (its backward is not differentiable); "
    "compute higher-order gradients with torch.nn.functional.linear and cross_entropy";

const auto &fwd_op() {
    return dispatcher_op<fused_linear_cross_entropy_fwd>("opsmith::fused_linear_cross_entropy_fwd");
}

// cross_entropy's backward ops scale a saved gradient by the incoming one
using ScaleFn = at::Tensor(const at::Tensor &, const at::Tensor &);
using ScaleInplaceFn = void(const at::Tensor &, at::Tensor &);
const c10::TypedOperatorHandle<ScaleFn> &scale_op() {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("opsmith::cross_entropy_bwd", "").typed<ScaleFn>();
    return op;
}
const c10::TypedOperatorHandle<ScaleInplaceFn> &scale_inplace_op() {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("opsmith::cross_entropy_bwd_", "").typed<ScaleInplaceFn>();
    return op;
}

// grad_fn of the loss: the forward's gradients times the incoming one.
struct FusedLinearCrossEntropyBackward : public torch::autograd::Node {
    SavedVariable dh_, dw_, db_;
    bool has_h_ = false, has_w_ = false, has_b_ = false; // which next edges (hidden, weight, bias) exist
    LastUse last_use_; // the graph is not kept: the saved gradients may be scaled in place

    void will_release_variables() override {
        std::lock_guard<std::mutex> lock(mutex_);
        last_use_.will_release();
    }

    variable_list apply(variable_list &&grads) override {
        std::lock_guard<std::mutex> lock(mutex_);
        variable_list out;
        if (has_h_) out.emplace_back();
        if (has_w_) out.emplace_back();
        if (has_b_) out.emplace_back();
        if (!grads[0].defined()) return out;
        const bool last = last_use_.take("fused_linear_cross_entropy");
        const at::Tensor saved[3] = {has_h_ ? dh_.unpack() : at::Tensor(), has_w_ ? dw_.unpack() : at::Tensor(),
                                     has_b_ ? db_.unpack() : at::Tensor()};
        {
            at::AutoDispatchBelowADInplaceOrView below_autograd;
            // the loss is float32 (16-bit inputs): cross_entropy's backward reads
            // that gradient as it is and rounds each product once
            const at::Tensor &g = grads[0];
            const bool inplace = last && !at::GradMode::is_enabled() && !grads[0].requires_grad() &&
                                 !at::isTensorSubclassLike(g);
            size_t k = 0;
            for (const at::Tensor &d : saved) {
                if (!d.defined()) continue;
                // held by the SavedVariable and saved[] alone: the raw op's caller may hold it too
                const bool over = inplace && !at::isTensorSubclassLike(d) && d.is_contiguous() && held_only_by(d, 2);
                // as (rows, n) for cross_entropy's backward: dbias is one row (symbolic
                // sizes, so that torch.compile does not specialise on the token count)
                at::Tensor d2 = d.dim() == 1 ? d.view_symint({1, d.sym_size(0)}) : d;
                if (over) {
                    scale_inplace_op().call(g, d2);
                    last_use_.spend();
                    out[k++] = d;
                } else {
                    out[k++] = scale_op().call(g, d2).view_symint(d.sym_sizes());
                }
            }
        }
        if (at::GradMode::is_enabled())
            for (auto &o : out)
                if (o.defined())
                    torch::autograd::set_history(
                        o, std::make_shared<torch::autograd::Error>(kNotTwice, torch::autograd::edge_list(next_edges())));
        return out;
    }
    void release_variables() override {
        std::lock_guard<std::mutex> lock(mutex_);
        dh_.reset_data();
        dw_.reset_data();
        db_.reset_data();
    }
    std::string name() const override { return "FusedLinearCrossEntropyBackward"; }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
fused_linear_cross_entropy_fwd_autograd(const at::Tensor &hidden, const at::Tensor &weight, const at::Tensor &target,
                                        const std::optional<at::Tensor> &bias, int64_t ignore_index, double ls,
                                        double z_loss, double softcap, int64_t reduction, int64_t chunk_size,
                                        bool grad_hidden, bool grad_weight, bool grad_bias) {
    const at::Tensor b = tensor_or_undefined(bias);
    refuse_forward_ad(kOp, hidden, weight, b);
    const bool gm = at::GradMode::is_enabled();
    const bool nh = gm && hidden.requires_grad(), nw = gm && weight.requires_grad(),
               nb = gm && b.defined() && b.requires_grad();
    at::Tensor loss, z, dh, dw, db, error;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        std::tie(loss, z, dh, dw, db, error) = fwd_op().call(hidden, weight, target, bias, ignore_index, ls, z_loss,
                                                             softcap, reduction, chunk_size, grad_hidden || nh,
                                                             grad_weight || nw, grad_bias || nb);
    }
    if (nh || nw || nb) {
        auto node = std::make_shared<FusedLinearCrossEntropyBackward>();
        node->has_h_ = nh, node->has_w_ = nw, node->has_b_ = nb;
        torch::autograd::edge_list edges;
        if (nh) edges.push_back(torch::autograd::impl::gradient_edge(hidden));
        if (nw) edges.push_back(torch::autograd::impl::gradient_edge(weight));
        if (nb) edges.push_back(torch::autograd::impl::gradient_edge(b));
        node->set_next_edges(std::move(edges));
        if (nh) node->dh_ = SavedVariable(dh, false);
        if (nw) node->dw_ = SavedVariable(dw, false);
        if (nb) node->db_ = SavedVariable(db, false);
        torch::autograd::set_history(loss, node);
        dh = view_for_caller(dh), dw = view_for_caller(dw), db = view_for_caller(db);
    }
    return {loss, z, dh, dw, db, error};
}

} // namespace

#endif // route B

} // namespace opsmith

#if !OPSMITH_ROUTE_A

TORCH_LIBRARY_FRAGMENT(opsmith, m) {
    m.set_python_module("opsmith.ops.fused_linear_cross_entropy");
    m.def("fused_linear_cross_entropy_fwd(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, "
          "int ignore_index=-100, float label_smoothing=0., float z_loss=0., float softcap=0., int reduction=2, "
          "int chunk_size=0, bool grad_hidden=False, bool grad_weight=False, bool grad_bias=False) -> "
          "(Tensor loss, Tensor z_loss, Tensor dhidden, Tensor dweight, Tensor dbias, Tensor error)");
}

TORCH_LIBRARY_IMPL(opsmith, CPU, m) {
    m.impl("fused_linear_cross_entropy_fwd", &opsmith::fused_linear_cross_entropy_fwd);
}

#if OPSMITH_WITH_CUDA
TORCH_LIBRARY_IMPL(opsmith, CUDA, m) {
    m.impl("fused_linear_cross_entropy_fwd", &opsmith::fused_linear_cross_entropy_fwd);
}
#endif

TORCH_LIBRARY_IMPL(opsmith, Autograd, m) {
    m.impl("fused_linear_cross_entropy_fwd", &opsmith::fused_linear_cross_entropy_fwd_autograd);
}

#endif // route B
