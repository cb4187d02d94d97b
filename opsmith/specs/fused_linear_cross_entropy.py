"""The op spec of fused_linear_cross_entropy: how every harness (reliability
tests, sanitizer, benchmark, docs/reliability.md's table) reaches
torch.ops.opsmith.fused_linear_cross_entropy_fwd.

The op reduces over every token (one loss), so the row harnesses (layouts,
zero rows, huge tensors) do not apply; the spec's shape (*, D) gives hidden
[*, D] against a fixed odd vocabulary with every option on (bias, ignored
targets, label smoothing, z-loss, softcap) and a chunk size that does not
divide the tokens. tests/test_fused_linear_cross_entropy.py covers the rest
against eager float64 PyTorch. bench/flce_bench.py times the issue's shapes
(ms, TFLOP/s, peak extra memory)."""
import math

import torch
import torch.nn.functional as F

from ..ops.fused_linear_cross_entropy import fused_linear_cross_entropy, fused_linear_cross_entropy_pybind
from . import SUPPORTED, BenchSpec, Hostile, IndexInput, OpSpec, compiled, randn
from .cross_entropy import formula

IGNORE_INDEX = -100
VOCAB = 97
LABEL_SMOOTHING = 0.1
Z_LOSS = 1e-3
SOFTCAP = 30.0
CHUNK = 5

_TOL = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 5e-3,
    torch.bfloat16: 3e-2,
}


def _make_inputs(shape, dtype, device, generator):
    d = shape[-1]
    hidden = randn(tuple(shape), generator, dtype, device)
    weight = (torch.randn(VOCAB, d, generator=generator, device=generator.device) / math.sqrt(d)).to(dtype=dtype,
                                                                                                    device=device)
    bias = (0.1 * torch.randn(VOCAB, generator=generator, device=generator.device)).to(dtype=dtype, device=device)
    target = torch.randint(0, VOCAB, tuple(shape[:-1]), generator=generator, device=generator.device)
    ignore = torch.rand(tuple(shape[:-1]), generator=generator, device=generator.device) < 0.25
    target = torch.where(ignore, IGNORE_INDEX, target).to(device)
    return {"hidden": hidden, "weight": weight, "bias": bias, "target": target, "ignore_index": IGNORE_INDEX}


def _kwargs(inputs):
    # reduction sum: a call whose every target is ignored (one-row and
    # property cases) gives 0 rather than the mean's NaN; the mean is covered
    # by tests/test_fused_linear_cross_entropy.py
    return dict(bias=inputs.get("bias"), ignore_index=inputs.get("ignore_index", IGNORE_INDEX), reduction="sum",
                label_smoothing=LABEL_SMOOTHING, z_loss=Z_LOSS, softcap=SOFTCAP)


# The loss is float32 for 16-bit inputs; the harnesses expect outputs in the
# inputs' dtype, so the calls round it there (differentiably: the gradients
# still come from the op). tests/test_fused_linear_cross_entropy.py checks the
# float32 loss itself.

def _call(inputs):
    h = inputs["hidden"]
    return fused_linear_cross_entropy(h, inputs["weight"], inputs["target"], chunk_size=CHUNK,
                                      **_kwargs(inputs)).to(h.dtype)


def _call_pybind(inputs):
    h = inputs["hidden"]
    return fused_linear_cross_entropy_pybind(h, inputs["weight"], inputs["target"], chunk_size=CHUNK,
                                             **_kwargs(inputs)).to(h.dtype)


def loss_formula(hidden, weight, target, bias=None, ignore_index=IGNORE_INDEX, reduction="mean", label_smoothing=0.0,
                 z_loss=0.0, softcap=None):
    """The reduced loss with PyTorch ops in hidden's dtype (float64 inputs: the reference)."""
    logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), weight, bias)
    t = target.reshape(-1)
    per_row = formula(logits, t, None, ignore_index, label_smoothing, z_loss, softcap)
    if reduction == "sum":
        return per_row.sum()
    count = (t != ignore_index).sum()
    # no token counted: NaN loss and zero gradients, as PyTorch's mean gives
    return torch.where(count > 0, per_row.sum() / count.clamp(min=1), per_row.new_tensor(math.nan))


def _reference(inputs, dtype=None):
    kw = _kwargs(inputs)
    b = kw.pop("bias")
    return loss_formula(inputs["hidden"].to(torch.float64), inputs["weight"].to(torch.float64), inputs["target"],
                        None if b is None else b.to(torch.float64), **kw)


def _torch_equivalent(inputs):
    kw = _kwargs(inputs)
    b = kw.pop("bias")
    c = lambda t: None if t is None else t.detach().cpu().float()  # noqa: E731
    return loss_formula(c(inputs["hidden"]), c(inputs["weight"]), inputs["target"].cpu(), c(b), **kw)


def _opcheck(inputs):
    h, t = inputs["hidden"], inputs["target"]
    h2, t1 = h.reshape(-1, h.shape[-1]), t.reshape(-1)
    args = (inputs["bias"], inputs.get("ignore_index", IGNORE_INDEX), LABEL_SMOOTHING, Z_LOSS, SOFTCAP)
    op = torch.ops.opsmith.fused_linear_cross_entropy_fwd.default
    return [(op, (h2, inputs["weight"], t1) + args + (2, CHUNK, False, False, False)),
            (op, (h2, inputs["weight"], t1) + args + (2, 0, True, True, False)),
            (op, (h2, inputs["weight"], t1) + args + (1, 0, True, True, True))]


def _edited(device, gen, edit, rows=6, d=16):
    inputs = _make_inputs((rows, d), torch.float32, "cpu", gen)
    edit(inputs)
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def _set_hidden(index, value):
    def edit(inputs):
        target = inputs["target"]
        target[index[0]] = 3  # the row counts
        inputs["hidden"][index] = value
    return edit


_HOSTILE = (
    Hostile("nan_in_hidden", lambda d, g: _edited(d, g, _set_hidden((1, 5), math.nan)),
            "NaN loss (the NaN row's logits are NaN)", input="one NaN in hidden"),
    Hostile("all_ignored", lambda d, g: _edited(d, g, lambda i: i["target"].fill_(IGNORE_INDEX)),
            "sum: 0 and zero gradients (mean: NaN and zero gradients, as PyTorch; tests/test_fused_linear_cross_entropy.py)",
            input="every target is ignore_index"),
    Hostile("float_target", lambda d, g: {**_make_inputs((4, 16), torch.float32, d, g),
                                          "target": torch.zeros(4, device=d)},
            "", input="float32 target",
            raises=r"^fused_linear_cross_entropy: target must be int64 class indices, got torch.float32"),
    Hostile("weight_dtype_mismatch",
            lambda d, g: _edited(d, g, lambda i: i.__setitem__("weight", i["weight"].double())),
            "", input="float64 weight beside float32 hidden",
            raises=r"fused_linear_cross_entropy: weight must have hidden's dtype"),
    Hostile("weight_width_mismatch",
            lambda d, g: _edited(d, g, lambda i: i.__setitem__("weight", i["weight"][:, :7].contiguous())),
            "", input="weight narrower than hidden's last dim",
            raises=r"fused_linear_cross_entropy: weight must have shape \[V, 16\]"),
)


# --- benchmark: the LM head (hidden [N, D], weight [V, D]) -----------------------------
# BenchSpec's shapes are (rows, n): here rows = tokens N, n = vocabulary V, with
# D from the vocabulary (Llama 3's head for 128256, Gemma 2's for 262144)

def _dim_for(v):
    # the heads; a narrow D elsewhere (the CPU benchmark's shapes)
    return {128256: 4096, 262144: 2304, 32768: 2048}.get(v, 256)


_TARGETS = {}


def _target_for(h, v):
    key = (h.shape[0], v, str(h.device))
    if key not in _TARGETS:
        g = torch.Generator(device=h.device).manual_seed(0)
        _TARGETS[key] = torch.randint(0, v, (h.shape[0],), generator=g, device=h.device)
    return _TARGETS[key]


def _bench_inputs(rows, v, dtype, device):
    d = _dim_for(v)
    return {"h": torch.randn(rows, d, dtype=dtype, device=device),
            "w": torch.randn(v, d, dtype=dtype, device=device) / math.sqrt(d),
            "dy": torch.ones((), dtype=torch.float32, device=device)}


def _eager(h, w):
    return F.cross_entropy(F.linear(h, w).float(), _target_for(h, w.shape[0]))


def _liger(v, dtype, device):
    # imported lazily: Liger-Kernel is optional (the bench reports the reason it is skipped)
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    def fn(h, w):
        out = LigerFusedLinearCrossEntropyFunction.apply(h, w, _target_for(h, w.shape[0]))
        return out[0] if isinstance(out, tuple) else out
    return fn


def _host_calls(device):
    h = torch.randn(8, 64, device=device, dtype=torch.bfloat16)
    w = torch.randn(512, 64, device=device, dtype=torch.bfloat16)
    t = torch.randint(0, 512, (8,), device=device)
    hg = h.clone().requires_grad_()
    return {
        "opsmith.fused_linear_cross_entropy": lambda: fused_linear_cross_entropy(h, w, t),
        "opsmith.fused_linear_cross_entropy (requires_grad)": lambda: fused_linear_cross_entropy(hg, w, t),
        "opsmith.pybind.fused_linear_cross_entropy": lambda: fused_linear_cross_entropy_pybind(h, w, t),
        "F.cross_entropy(F.linear(h, W))": lambda: F.cross_entropy(F.linear(h, w), t),
    }


_BENCH = BenchSpec(
    make_inputs=_bench_inputs,
    grad_inputs=["h", "w"],
    providers={
        "opsmith": lambda v, dt, dev: lambda h, w: fused_linear_cross_entropy(h, w, _target_for(h, w.shape[0])),
        "opsmith_pybind": lambda v, dt, dev: lambda h, w: fused_linear_cross_entropy_pybind(
            h, w, _target_for(h, w.shape[0])),
        "torch_eager": lambda v, dt, dev: _eager,
        "torch_compile": lambda v, dt, dev: compiled(("fused_linear_cross_entropy", v), _eager),
        "liger": _liger,
    },
    # minimal bytes: hidden and the weight read once (forward), plus their
    # gradients written once (forward+backward); the logits never leave the chip
    fwd_bytes=lambda rows, v, s: (rows + v) * _dim_for(v) * s,
    fwdbwd_bytes=lambda rows, v, s: 2 * (rows + v) * _dim_for(v) * s,
    hidden_sizes=[128256, 262144],
    row_counts=[8192],
    quick_shapes=[(8192, 128256), (8192, 262144), (1024, 32768)],
    host_calls=_host_calls,
)


SPEC = OpSpec(
    name="fused_linear_cross_entropy",
    make_inputs=_make_inputs,
    call=_call,
    call_pybind=_call_pybind,
    reference=_reference,
    torch_equivalent=_torch_equivalent,
    tolerance=_TOL.__getitem__,
    outputs=("loss",),
    grad_inputs=("hidden", "weight", "bias"),
    index_inputs=(IndexInput("target", high=lambda i: VOCAB, ignore_index=IGNORE_INDEX),),
    opcheck=_opcheck,
    double_backward=r"^fused_linear_cross_entropy: double backward is not supported",
    double_backward_pybind=r"^opsmith\.pybind\.fused_linear_cross_entropy: double backward is not supported",
    func_transforms={
        "grad": SUPPORTED,
        "vjp": SUPPORTED,
        "jvp": r"^fused_linear_cross_entropy: forward-mode AD is not supported",
        "vmap": r"^fused_linear_cross_entropy: torch.func.vmap is not supported",
    },
    func_transforms_pybind=(r"^opsmith\.pybind\.fused_linear_cross_entropy: route A does not support torch\.func "
                            r"transforms"),
    max_scale=1.0,
    hostile=_HOSTILE,
    bench=_BENCH,
)
