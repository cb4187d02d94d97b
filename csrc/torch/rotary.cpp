// Rotary position embedding in PyTorch: the bridge (checks, outputs, device
// guard, stream; the arithmetic is the C library's, csrc/cpu/rotary.c and
// csrc/cuda/rotary.cu), its route A binding and its route B registration.
//
// q [B, Hq, S, D] (layout "bhsd") or [B, S, Hq, D] ("bshd"), k likewise with
// its own head count (or None), in any strides whose last dim is contiguous
// (views into a fused qkv projection reach the kernels without a copy).
// cos/sin: [S, R] or [B or 1, S, R] per (b, s), or, with position_ids
// ([B, S] or [S], int64), a [max_pos, R] cache. Three ops:
//   rotary_fwd  (functional: new q_out, k_out; autograd registered)
//   rotary_bwd  (the transpose, for the gradients)
//   rotary_     (in place: q and k are mutated, schema Tensor(a!))
//
// Compiled twice, like every bridge: into opsmith._C (route B) and, with
// OPSMITH_ROUTE_A, into opsmith._pybind (route A).
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>

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

constexpr const char *kOp = "rotary";

// Which of q's dims are (batch, heads, seq).
struct Dims {
    int b, h, s;
};

Dims dims_of(const std::string &layout) {
    if (layout == "bhsd") return {0, 1, 2};
    if (layout == "bshd") return {0, 2, 1};
    TORCH_CHECK(false, kOp, ": layout must be 'bhsd' or 'bshd', got '", layout, "'");
}

opsmith_rotary_view view_of(const at::Tensor &t, Dims d) {
    return {t.size(d.h), t.stride(d.b), t.stride(d.s), t.stride(d.h)};
}

// The checked call: tensors the kernels read (a copy only where the last dim
// is not contiguous) and the C parameters, outputs to be filled in.
struct Call {
    opsmith_rotary_params p{};
    at::Tensor q, k, cos, sin, pos;
    bool has_k = false;
    Dims d{};
};

Call prepare(const char *qn, const char *kn, const at::Tensor &q, const std::optional<at::Tensor> &k,
             const at::Tensor &cos, const at::Tensor &sin, const std::optional<at::Tensor> &position_ids,
             bool interleaved, std::optional<int64_t> rotary_dim, const std::string &layout, bool inplace) {
    Call c;
    c.d = dims_of(layout);
    check_device_supported(q, kOp);
    c.p.dtype = dtype_of(q, kOp, qn);
    TORCH_CHECK(q.dim() == 4, kOp, ": ", qn, " must be 4-D [", layout == "bhsd" ? "B, H, S, D" : "B, S, H, D",
                "] (layout '", layout, "'), got shape ", text(q.sizes()));
    const int64_t B = q.size(c.d.b), S = q.size(c.d.s), D = q.size(3);
    TORCH_CHECK(D >= 2, kOp, ": ", qn, "'s head_dim must be >= 2, got shape ", text(q.sizes()));
    c.has_k = k.has_value();
    c.q = q;
    if (q.stride(3) != 1 && q.size(3) > 1) {
        TORCH_CHECK(!inplace, kOp, ": in place, ", qn, " must have a contiguous last dim, got strides ",
                    text(q.strides()));
        c.q = q.contiguous();
    }
    if (c.has_k) {
        const at::Tensor &kt = *k;
        TORCH_CHECK(kt.device() == q.device(), kOp, ": ", kn, " must be on ", qn, "'s device (", q.device(),
                    "), got ", kt.device());
        TORCH_CHECK(kt.scalar_type() == q.scalar_type(), kOp, ": ", kn, " must have ", qn, "'s dtype (",
                    q.scalar_type(), "), got ", kt.scalar_type());
        TORCH_CHECK(kt.dim() == 4 && kt.size(c.d.b) == B && kt.size(c.d.s) == S && kt.size(3) == D, kOp, ": ", kn,
                    " must be 4-D with ", qn, "'s batch, seq and head_dim (", qn, " ", text(q.sizes()),
                    ", layout '", layout, "'), got shape ", text(kt.sizes()));
        c.k = kt;
        if (kt.stride(3) != 1 && D > 1) {
            TORCH_CHECK(!inplace, kOp, ": in place, ", kn, " must have a contiguous last dim, got strides ",
                        text(kt.strides()));
            c.k = kt.contiguous();
        }
    }
    if (inplace) {
        TORCH_CHECK(at::has_internal_overlap(q) != at::MemOverlap::Yes, kOp, ": in place, ", qn,
                    " must not have elements sharing memory (an expanded tensor)");
        TORCH_CHECK(!c.has_k || at::has_internal_overlap(*k) != at::MemOverlap::Yes, kOp, ": in place, ", kn,
                    " must not have elements sharing memory (an expanded tensor)");
    }
    // cos, sin
    TORCH_CHECK(cos.device() == q.device() && sin.device() == q.device(), kOp, ": cos and sin must be on ", qn,
                "'s device (", q.device(), "), got ", cos.device(), " and ", sin.device());
    TORCH_CHECK(cos.sizes() == sin.sizes(), kOp, ": cos and sin must have one shape, got ", text(cos.sizes()),
                " and ", text(sin.sizes()));
    TORCH_CHECK(cos.scalar_type() == sin.scalar_type(), kOp, ": cos and sin must have one dtype, got ",
                cos.scalar_type(), " and ", sin.scalar_type());
    const bool sixteen = q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16;
    TORCH_CHECK(cos.scalar_type() == q.scalar_type() || (sixteen && cos.scalar_type() == at::kFloat), kOp,
                ": cos must have ", qn, "'s dtype (", q.scalar_type(), ") or float32 beside float16/bfloat16, got ",
                cos.scalar_type());
    c.p.cs_dtype = dtype_of(cos, kOp, "cos");
    TORCH_CHECK(cos.dim() >= 1, kOp, ": cos must have a last dim of rotary_dim values, got a 0-dim tensor");
    const int64_t R = cos.size(-1);
    if (rotary_dim.has_value())
        TORCH_CHECK(*rotary_dim == R, kOp, ": cos must have rotary_dim (", text(*rotary_dim),
                    ") values in its last dim, got shape ", text(cos.sizes()));
    TORCH_CHECK(R >= 2 && R % 2 == 0 && R <= D, kOp, ": rotary_dim (cos's last dim, ", text(R),
                ") must be even and in [2, head_dim (", text(D), ")]");
    c.cos = cos.stride(-1) == 1 ? cos : cos.contiguous();
    c.sin = sin.stride(-1) == 1 ? sin : sin.contiguous();
    if (position_ids.has_value()) {
        const at::Tensor &pos = *position_ids;
        TORCH_CHECK(pos.scalar_type() == at::kLong, kOp, ": position_ids must be int64, got ", pos.scalar_type());
        TORCH_CHECK(pos.device() == q.device(), kOp, ": position_ids must be on ", qn, "'s device (", q.device(),
                    "), got ", pos.device());
        TORCH_CHECK((pos.dim() == 2 && (pos.size(0) == B || pos.size(0) == 1) && pos.size(1) == S) ||
                        (pos.dim() == 1 && pos.size(0) == S),
                    kOp, ": position_ids must be [B, S] = [", text(B), ", ", text(S), "], [1, S] or [S], got shape ",
                    text(pos.sizes()));
        TORCH_CHECK(cos.dim() == 2, kOp, ": with position_ids, cos must be a [max_pos, rotary_dim] cache, got shape ",
                    text(cos.sizes()));
        c.pos = pos;
        c.p.pos_batch_stride = pos.dim() == 2 && pos.size(0) > 1 ? pos.stride(0) : 0;
        c.p.pos_seq_stride = pos.stride(-1);
        c.p.max_pos = cos.size(0);
        c.p.cs_batch_stride = 0;
        c.p.cs_seq_stride = c.cos.stride(0);
        TORCH_CHECK(c.sin.stride(0) == c.cos.stride(0), kOp, ": cos and sin must have one layout");
    } else {
        TORCH_CHECK((cos.dim() == 2 && cos.size(0) == S) ||
                        (cos.dim() == 3 && (cos.size(0) == B || cos.size(0) == 1) && cos.size(1) == S),
                    kOp, ": cos must be [S, rotary_dim] or [B, S, rotary_dim] with S = ", text(S), ", B = ", text(B),
                    " (or a [max_pos, rotary_dim] cache with position_ids), got shape ", text(cos.sizes()));
        const int64_t sdim = cos.dim() - 2;
        c.p.cs_seq_stride = S > 1 ? c.cos.stride(sdim) : 0;
        c.p.cs_batch_stride = cos.dim() == 3 && cos.size(0) > 1 ? c.cos.stride(0) : 0;
        TORCH_CHECK(c.sin.stride(sdim) == c.cos.stride(sdim) &&
                        (cos.dim() == 2 || c.sin.stride(0) == c.cos.stride(0) || cos.size(0) == 1),
                    kOp, ": cos and sin must have one layout (strides ", text(c.cos.strides()), " and ",
                    text(c.sin.strides()), ")");
    }
    c.p.style = interleaved ? OPSMITH_ROTARY_STYLE_INTERLEAVED : OPSMITH_ROTARY_STYLE_HALF;
    c.p.batch = B, c.p.seq = S, c.p.head_dim = D, c.p.rotary_dim = R;
    c.p.q = view_of(c.q, c.d);
    if (c.has_k) c.p.k = view_of(c.k, c.d);
    return c;
}

// The C call on q's device (outputs may be the inputs themselves).
void launch(const Call &c, bool backward, void *q_out, void *k_out) {
    const void *k = c.has_k ? c.k.data_ptr() : nullptr;
    const int64_t *pos = c.pos.defined() ? c.pos.data_ptr<int64_t>() : nullptr;
    opsmith_status status;
#if OPSMITH_WITH_CUDA
    if (c.q.is_cuda()) {
        const c10::cuda::CUDAGuard guard(c.q.device());
        const auto stream = at::cuda::getCurrentCUDAStream(c.q.get_device()).stream();
        status = (backward ? opsmith_rotary_bwd_cuda : opsmith_rotary_fwd_cuda)(
            &c.p, c.q.data_ptr(), q_out, k, k_out, c.cos.data_ptr(), c.sin.data_ptr(), pos, stream);
    } else
#endif
    {
        use_torch_cpu_threads();
        status = (backward ? opsmith_rotary_bwd_cpu : opsmith_rotary_fwd_cpu)(
            &c.p, c.q.data_ptr(), q_out, k, k_out, c.cos.data_ptr(), c.sin.data_ptr(), pos);
    }
    check_status(status, kOp);
}

std::tuple<at::Tensor, at::Tensor> out_of_place(bool backward, const at::Tensor &q, const std::optional<at::Tensor> &k,
                                                const at::Tensor &cos, const at::Tensor &sin,
                                                const std::optional<at::Tensor> &position_ids, bool interleaved,
                                                std::optional<int64_t> rotary_dim, const std::string &layout) {
    Call c = prepare(backward ? "dq_out" : "q", backward ? "dk_out" : "k", q, k, cos, sin, position_ids, interleaved,
                     rotary_dim, layout, false);
    // outputs contiguous in the logical layout
    at::Tensor q_out = empty_output(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
    at::Tensor k_out = c.has_k ? empty_output(k->sizes(), k->options().memory_format(at::MemoryFormat::Contiguous))
                               : empty_output({0}, q.options());
    if (q.numel() == 0 && (!c.has_k || k->numel() == 0)) return {q_out, k_out};
    c.p.q_out = view_of(q_out, c.d);
    if (c.has_k) c.p.k_out = view_of(k_out, c.d);
    if (c.p.batch > 0 && c.p.seq > 0) launch(c, backward, q_out.data_ptr(), c.has_k ? k_out.data_ptr() : nullptr);
    return {q_out, k_out};
}

} // namespace

// q_out, k_out = rope(q), rope(k); k None: k_out has shape [0].
std::tuple<at::Tensor, at::Tensor> rotary_fwd(const at::Tensor &q, const std::optional<at::Tensor> &k,
                                              const at::Tensor &cos, const at::Tensor &sin,
                                              const std::optional<at::Tensor> &position_ids, bool interleaved,
                                              std::optional<int64_t> rotary_dim, const std::string &layout) {
    return out_of_place(false, q, k, cos, sin, position_ids, interleaved, rotary_dim, layout);
}

// dq, dk = rope^T(dq_out), rope^T(dk_out): the gradients of rotary_fwd.
std::tuple<at::Tensor, at::Tensor> rotary_bwd(const at::Tensor &dq_out, const std::optional<at::Tensor> &dk_out,
                                              const at::Tensor &cos, const at::Tensor &sin,
                                              const std::optional<at::Tensor> &position_ids, bool interleaved,
                                              std::optional<int64_t> rotary_dim, const std::string &layout) {
    return out_of_place(true, dq_out, dk_out, cos, sin, position_ids, interleaved, rotary_dim, layout);
}

// q, k = rope(q), rope(k) in place (views into a fused qkv buffer included).
void rotary_inplace(const at::Tensor &q, const std::optional<at::Tensor> &k, const at::Tensor &cos,
                    const at::Tensor &sin, const std::optional<at::Tensor> &position_ids, bool interleaved,
                    std::optional<int64_t> rotary_dim, const std::string &layout) {
    Call c = prepare("q", "k", q, k, cos, sin, position_ids, interleaved, rotary_dim, layout, true);
    if (c.p.batch == 0 || c.p.seq == 0) return;
    c.p.q_out = c.p.q;
    if (c.has_k) c.p.k_out = c.p.k;
    launch(c, false, c.q.data_ptr(), c.has_k ? c.k.data_ptr() : nullptr);
}

#if OPSMITH_ROUTE_A

} // namespace opsmith

OPSMITH_PYBIND(rotary) {
    namespace py = pybind11;
    m.def("rotary_fwd", &opsmith::rotary_fwd, "rotary embedding forward: (q_out, k_out)", py::arg("q"), py::arg("k"),
          py::arg("cos"), py::arg("sin"), py::arg("position_ids") = py::none(), py::arg("interleaved") = false,
          py::arg("rotary_dim") = py::none(), py::arg("layout") = "bhsd");
    m.def("rotary_bwd", &opsmith::rotary_bwd, "rotary embedding backward: (dq, dk)", py::arg("dq_out"),
          py::arg("dk_out"), py::arg("cos"), py::arg("sin"), py::arg("position_ids") = py::none(),
          py::arg("interleaved") = false, py::arg("rotary_dim") = py::none(), py::arg("layout") = "bhsd");
    m.def("rotary_", &opsmith::rotary_inplace, "rotary embedding in place", py::arg("q"), py::arg("k"),
          py::arg("cos"), py::arg("sin"), py::arg("position_ids") = py::none(), py::arg("interleaved") = false,
          py::arg("rotary_dim") = py::none(), py::arg("layout") = "bhsd");
}

namespace opsmith {

#else // route B

namespace {

const auto &rotary_fwd_op() { return dispatcher_op<rotary_fwd>("opsmith::rotary_fwd"); }
const auto &rotary_bwd_op() { return dispatcher_op<rotary_bwd>("opsmith::rotary_bwd"); }
const auto &rotary_inplace_op() { return dispatcher_op<rotary_inplace>("opsmith::rotary_"); }

void refuse_cos_sin_grad(const at::Tensor &cos, const at::Tensor &sin) {
    TORCH_CHECK(!(torch::autograd::compute_requires_grad(cos, sin)), kOp,
                ": cos and sin must not require grad (no gradient flows to them); pass cos.detach(), sin.detach()");
}

// grad_fn of rotary_fwd's outputs (transpose_ = true: their gradients are
// rotary_bwd of the incoming ones) and of rotary_bwd's (false: rotary_fwd).
// The op is linear in q and k, so this is the whole derivative; only cos/sin
// (and positions) are kept. The call goes through the dispatcher's Autograd
// key: under create_graph it records itself, so every order of derivative works.
struct RotaryBackward : public torch::autograd::Node {
    SavedVariable cos_, sin_, pos_;
    bool transpose_ = true, has_pos_ = false, has_k_ = false, interleaved_ = false;
    std::optional<int64_t> rotary_dim_;
    std::string layout_;
    std::vector<c10::SymInt> q_shape_; // symbolic under torch.compile: no guard on q's shape
    at::TensorOptions q_options_;

    variable_list apply(variable_list &&grads) override {
        at::Tensor dq_out = grads[0];
        const at::Tensor dk_out = grads.size() > 1 ? grads[1] : at::Tensor();
        if (!dq_out.defined() && !dk_out.defined()) return {at::Tensor(), at::Tensor()};
        if (!dq_out.defined()) dq_out = at::zeros_symint(q_shape_, q_options_); // k's gradient alone was asked for
        const std::optional<at::Tensor> pos = has_pos_ ? std::optional<at::Tensor>(pos_.unpack()) : std::nullopt;
        const std::optional<at::Tensor> dk = has_k_ && dk_out.defined() ? std::optional<at::Tensor>(dk_out)
                                                                         : std::nullopt;
        const at::Tensor cos = cos_.unpack(), sin = sin_.unpack();
        at::Tensor dq, dkk;
        std::tie(dq, dkk) = (transpose_ ? rotary_bwd_op() : rotary_fwd_op())
                                .call(dq_out, dk, cos, sin, pos, interleaved_, rotary_dim_, layout_);
        if (!dk.has_value()) dkk = at::Tensor();
        return {dq, dkk};
    }
    void release_variables() override {
        cos_.reset_data();
        sin_.reset_data();
        pos_.reset_data();
    }
    std::string name() const override { return transpose_ ? "RotaryBackward" : "RotaryBackwardBackward"; }
};

// The Autograd kernel of rotary_fwd (transpose = true) and rotary_bwd (false).
std::tuple<at::Tensor, at::Tensor> rotary_autograd(bool transpose, const at::Tensor &q,
                                                   const std::optional<at::Tensor> &k, const at::Tensor &cos,
                                                   const at::Tensor &sin, const std::optional<at::Tensor> &position_ids,
                                                   bool interleaved, std::optional<int64_t> rotary_dim,
                                                   const std::string &layout) {
    refuse_forward_ad(kOp, q, tensor_or_undefined(k), cos, sin);
    refuse_cos_sin_grad(cos, sin);
    at::Tensor q_out, k_out;
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        std::tie(q_out, k_out) = (transpose ? rotary_fwd_op() : rotary_bwd_op())
                                     .call(q, k, cos, sin, position_ids, interleaved, rotary_dim, layout);
    }
    if (torch::autograd::compute_requires_grad(q, k)) {
        auto node = std::make_shared<RotaryBackward>();
        node->set_next_edges(torch::autograd::collect_next_edges(q, k));
        node->transpose_ = transpose;
        node->cos_ = SavedVariable(cos, false);
        node->sin_ = SavedVariable(sin, false);
        node->has_pos_ = position_ids.has_value();
        if (node->has_pos_) node->pos_ = SavedVariable(*position_ids, false);
        node->has_k_ = k.has_value();
        node->interleaved_ = interleaved;
        node->rotary_dim_ = rotary_dim;
        node->layout_ = layout;
        node->q_shape_ = q.sym_sizes().vec();
        node->q_options_ = q.options();
        if (k.has_value()) torch::autograd::set_history(std::vector<at::Tensor>{q_out, k_out}, node);
        else torch::autograd::set_history(q_out, node); // k None: k_out is an empty placeholder
    }
    return {q_out, k_out};
}

std::tuple<at::Tensor, at::Tensor> rotary_fwd_autograd(const at::Tensor &q, const std::optional<at::Tensor> &k,
                                                       const at::Tensor &cos, const at::Tensor &sin,
                                                       const std::optional<at::Tensor> &position_ids,
                                                       bool interleaved, std::optional<int64_t> rotary_dim,
                                                       const std::string &layout) {
    return rotary_autograd(true, q, k, cos, sin, position_ids, interleaved, rotary_dim, layout);
}

std::tuple<at::Tensor, at::Tensor> rotary_bwd_autograd(const at::Tensor &dq_out, const std::optional<at::Tensor> &dk_out,
                                                       const at::Tensor &cos, const at::Tensor &sin,
                                                       const std::optional<at::Tensor> &position_ids,
                                                       bool interleaved, std::optional<int64_t> rotary_dim,
                                                       const std::string &layout) {
    return rotary_autograd(false, dq_out, dk_out, cos, sin, position_ids, interleaved, rotary_dim, layout);
}

void rotary_inplace_autograd(const at::Tensor &q, const std::optional<at::Tensor> &k, const at::Tensor &cos,
                             const at::Tensor &sin, const std::optional<at::Tensor> &position_ids, bool interleaved,
                             std::optional<int64_t> rotary_dim, const std::string &layout) {
    TORCH_CHECK(!torch::autograd::compute_requires_grad(q, k, cos, sin), kOp,
                ": inplace=True does not support autograd (q, k, cos or sin requires grad); use inplace=False");
    refuse_forward_ad(kOp, q, tensor_or_undefined(k), cos, sin);
    {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        rotary_inplace_op().call(q, k, cos, sin, position_ids, interleaved, rotary_dim, layout);
    }
    torch::autograd::impl::bump_version(q);
    if (k.has_value()) torch::autograd::impl::bump_version(*k);
}

} // namespace

#endif // route B

} // namespace opsmith

#if !OPSMITH_ROUTE_A

TORCH_LIBRARY_FRAGMENT(opsmith, m) {
    m.set_python_module("opsmith.ops.rotary");
    m.def("rotary_fwd(Tensor q, Tensor? k, Tensor cos, Tensor sin, Tensor? position_ids=None, "
          "bool interleaved=False, int? rotary_dim=None, str layout=\"bhsd\") -> (Tensor q_out, Tensor k_out)");
    m.def("rotary_bwd(Tensor dq_out, Tensor? dk_out, Tensor cos, Tensor sin, Tensor? position_ids=None, "
          "bool interleaved=False, int? rotary_dim=None, str layout=\"bhsd\") -> (Tensor dq, Tensor dk)");
    m.def("rotary_(Tensor(a!) q, Tensor(b!)? k, Tensor cos, Tensor sin, Tensor? position_ids=None, "
          "bool interleaved=False, int? rotary_dim=None, str layout=\"bhsd\") -> ()");
}

TORCH_LIBRARY_IMPL(opsmith, CPU, m) {
    m.impl("rotary_fwd", &opsmith::rotary_fwd);
    m.impl("rotary_bwd", &opsmith::rotary_bwd);
    m.impl("rotary_", &opsmith::rotary_inplace);
}

#if OPSMITH_WITH_CUDA
TORCH_LIBRARY_IMPL(opsmith, CUDA, m) {
    m.impl("rotary_fwd", &opsmith::rotary_fwd);
    m.impl("rotary_bwd", &opsmith::rotary_bwd);
    m.impl("rotary_", &opsmith::rotary_inplace);
}
#endif

TORCH_LIBRARY_IMPL(opsmith, Autograd, m) {
    m.impl("rotary_fwd", &opsmith::rotary_fwd_autograd);
    m.impl("rotary_bwd", &opsmith::rotary_bwd_autograd);
    m.impl("rotary_", &opsmith::rotary_inplace_autograd);
}

#endif // route B
