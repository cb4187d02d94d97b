"""The op spec of cross_entropy: how every harness (reliability tests, sanitizer,
benchmark, docs/reliability.md's table) reaches torch.ops.opsmith.cross_entropy_*.

The harnesses need outputs whose rows follow the inputs' rows, so the spec
calls reduction="none" (loss per row) with every option on: class weights,
label smoothing, a z-loss and a softcap; tests/test_cross_entropy.py covers
the reductions, the errors and the fused gradient path against PyTorch."""
import math

import torch
import torch.nn.functional as F

from ..ops.cross_entropy import CrossEntropyLoss, cross_entropy, cross_entropy_pybind
from . import SUPPORTED, BenchSpec, DocRow, Hostile, IndexInput, OpSpec, compiled, randn, rows_finite_except

IGNORE_INDEX = -100
LABEL_SMOOTHING = 0.1
Z_LOSS = 1e-3
SOFTCAP = 30.0

_TOL = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def _make_inputs(shape, dtype, device, generator):
    n = shape[-1]
    x = randn(tuple(shape), generator, dtype, device)
    target = torch.randint(0, n, tuple(shape[:-1]), generator=generator, device=generator.device)
    # about one row in four ignored
    ignore = torch.rand(tuple(shape[:-1]), generator=generator, device=generator.device) < 0.25
    target = torch.where(ignore, IGNORE_INDEX, target).to(device)
    weight = (0.5 + torch.rand(n, generator=generator, device=generator.device)).to(dtype=dtype, device=device)
    return {"x": x, "target": target, "weight": weight, "ignore_index": IGNORE_INDEX}


def _kwargs(inputs):
    return dict(weight=inputs.get("weight"), ignore_index=inputs.get("ignore_index", IGNORE_INDEX), reduction="none",
                label_smoothing=LABEL_SMOOTHING, z_loss=Z_LOSS, softcap=SOFTCAP)


def _call(inputs):
    return cross_entropy(inputs["x"], inputs["target"], **_kwargs(inputs))


def _call_pybind(inputs):
    return cross_entropy_pybind(inputs["x"], inputs["target"], **_kwargs(inputs))


def _opcheck(inputs):
    x, t = inputs["x"], inputs["target"]
    x2, t1 = x.reshape(-1, x.shape[-1]), t.reshape(-1)
    args = (inputs.get("weight"), inputs.get("ignore_index", IGNORE_INDEX), LABEL_SMOOTHING, Z_LOSS, SOFTCAP)
    dl = torch.randn_like(x2.detach())
    return [(torch.ops.opsmith.cross_entropy_fwd.default, (x2, t1) + args + (0, False)),
            (torch.ops.opsmith.cross_entropy_fwd.default, (x2, t1) + args + (2, True)),
            (torch.ops.opsmith.cross_entropy_bwd.default, (torch.randn((), dtype=x.dtype, device=x.device), dl))]


def formula(x, target, weight=None, ignore_index=IGNORE_INDEX, label_smoothing=0.0, z_loss=0.0, softcap=None):
    """The per-row loss (reduction none) in x's dtype, with PyTorch ops: the
    definition the kernels are checked against (float64 inputs: the reference)."""
    n = x.shape[-1]
    y = softcap * torch.tanh(x / softcap) if softcap else x
    logp = torch.log_softmax(y, -1)
    lse = torch.logsumexp(y, -1)
    ignored = target == ignore_index
    safe = torch.where(ignored, 0, target)
    w = weight.to(x.dtype) if weight is not None else torch.ones(n, dtype=x.dtype, device=x.device)
    nll = -w[safe] * logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    smooth = -(logp * w).sum(-1)
    loss = (1 - label_smoothing) * nll + label_smoothing / n * smooth + z_loss * lse * lse
    return torch.where(ignored, torch.zeros_like(loss), loss)


def _reference(inputs, dtype=None):
    kw = _kwargs(inputs)
    kw.pop("reduction")
    w = kw.pop("weight")
    return formula(inputs["x"].to(torch.float64), inputs["target"], None if w is None else w.to(torch.float64), **kw)


def _torch_equivalent(inputs):
    kw = _kwargs(inputs)
    kw.pop("reduction")
    w = kw.pop("weight")
    return formula(inputs["x"].detach().cpu().float(), inputs["target"].cpu(), None if w is None else w.cpu().float(), **kw)


# hostile inputs: float32, small, built on the CPU and moved

def _edited(device, gen, edit, rows=4, n=37):
    inputs = _make_inputs((rows, n), torch.float32, "cpu", gen)
    edit(inputs)
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def _nan_row(spec, inputs, out):
    rows_finite_except(out, [1])


def _set_x(index, value):
    def edit(inputs):
        inputs["x"][index] = value
    return edit


_HOSTILE = (
    Hostile("nan_in_x", lambda d, g: _edited(d, g, _set_x((1, 5), math.nan)),
            "NaN loss in that row only (unless its target is ignored)", input="one NaN in x",
            check=lambda spec, inputs, out: None),
    Hostile("masked_logits", lambda d, g: _edited(d, g, _set_x((slice(None), slice(0, 3)), -math.inf)),
            "finite loss: -Inf logits (masked classes) add nothing to the sum; the softcap maps them to -30",
            input="-Inf in some logits of every row"),
    Hostile("all_ignored", lambda d, g: _edited(d, g, lambda i: i["target"].fill_(IGNORE_INDEX)),
            "zeros (reduction none; mean gives NaN, as PyTorch: tests/test_cross_entropy.py)",
            input="every target is ignore_index"),
    Hostile("float_target", lambda d, g: {**_make_inputs((4, 37), torch.float32, d, g),
                                          "target": torch.zeros(4, device=d)},
            "", input="float32 target (class probabilities)",
            raises=r"^cross_entropy: target must be int64 class indices, got torch.float32"),
    Hostile("integer_x", lambda d, g: {**_make_inputs((4, 8), torch.float32, d, g),
                                       "x": torch.randint(-5, 5, (4, 8), generator=g, dtype=torch.int32).to(d)},
            "", input="int32 logits", raises=r"^cross_entropy: logits must be float64, float32, float16 or bfloat16"),
)


# --- benchmark -----------------------------------------------------------------------

_TARGETS = {}


def _target_for(x):
    # one fixed random target per (rows, vocabulary, device), made outside the timing
    key = (x.shape[0], x.shape[-1], str(x.device))
    if key not in _TARGETS:
        g = torch.Generator(device=x.device).manual_seed(0)
        _TARGETS[key] = torch.randint(0, x.shape[-1], (x.shape[0],), generator=g, device=x.device)
    return _TARGETS[key]


def _bench_inputs(rows, n, dtype, device):
    return {"x": torch.randn(rows, n, dtype=dtype, device=device), "dy": torch.ones((), dtype=dtype, device=device)}


def _eager(x):
    return F.cross_entropy(x.float(), _target_for(x))


def _liger(n, dtype, device):
    # imported lazily: Liger-Kernel is optional (the bench reports the reason it is skipped)
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

    def fn(x):
        out = LigerCrossEntropyFunction.apply(x, _target_for(x), None)  # weight (no default in Liger 0.8)
        return out[0] if isinstance(out, tuple) else out
    return fn


def _host_calls(device):
    x = torch.randn(8, 4096, device=device, dtype=torch.bfloat16)
    t = torch.randint(0, 4096, (8,), device=device)
    xg = x.clone().requires_grad_()
    return {
        "opsmith.cross_entropy": lambda: cross_entropy(x, t),
        "opsmith.cross_entropy (requires_grad)": lambda: cross_entropy(xg, t),
        "opsmith.pybind.cross_entropy": lambda: cross_entropy_pybind(x, t),
        "torch.nn.functional.cross_entropy": lambda: F.cross_entropy(x, t),
    }


_BENCH = BenchSpec(
    make_inputs=_bench_inputs,
    grad_inputs=["x"],
    providers={
        "opsmith": lambda n, dt, dev: lambda x: cross_entropy(x, _target_for(x)),
        "opsmith_pybind": lambda n, dt, dev: lambda x: cross_entropy_pybind(x, _target_for(x)),
        "torch_eager": lambda n, dt, dev: _eager,
        "torch_compile": lambda n, dt, dev: compiled(("cross_entropy", n), _eager),
        "liger": _liger,
    },
    # forward: read the logits once; forward+backward: read them once and
    # write their gradient once (the targets and the per-row values are noise)
    fwd_bytes=lambda rows, n, s: rows * n * s,
    fwdbwd_bytes=lambda rows, n, s: 2 * rows * n * s,
    hidden_sizes=[32768, 128256, 262144],
    row_counts=[1024, 8192],
    quick_shapes=[(8192, 128256), (8192, 262144), (4096, 32768), (16, 128256)],
    host_calls=_host_calls,
)


_DOC_ROWS = (
    DocRow("zero rows: logits of shape (0, V)", "empty per-row loss; sum 0, mean NaN (as PyTorch)", "`test_zero_rows`"),
    DocRow("target out of range (not ignore_index)",
           "CPU: IndexError naming the target and its row; CUDA: that row's loss and gradient NaN and a device-side "
           "flag, raised as IndexError by `validate=True` (one host synchronisation)", "tests/test_cross_entropy.py"),
    DocRow("every target ignored, reduction mean", "NaN loss and zero gradient (as PyTorch)",
           "tests/test_cross_entropy.py"),
)


class _LossLayer(torch.nn.Module):
    """CrossEntropyLoss as one layer of a sequential model (the compile
    training harness): each row's loss against a fixed target scales the
    row, so the gradient flows through the loss and past it."""

    def __init__(self, n):
        super().__init__()
        self.loss = CrossEntropyLoss(reduction="none", label_smoothing=LABEL_SMOOTHING, z_loss=Z_LOSS,
                                     softcap=SOFTCAP)

    def forward(self, x):
        target = torch.arange(x.shape[0], device=x.device) % x.shape[-1]
        return x * self.loss(x, target).unsqueeze(-1)


SPEC = OpSpec(
    name="cross_entropy",
    make_inputs=_make_inputs,
    call=_call,
    call_pybind=_call_pybind,
    reference=_reference,
    torch_equivalent=_torch_equivalent,
    tolerance=_TOL.__getitem__,
    outputs=("loss",),
    grad_inputs=("x",),
    row_inputs=("x", "target"),
    zero_width=False,  # a row needs its classes (PyTorch: target out of bounds)
    index_inputs=(IndexInput("target", high=lambda i: i["x"].shape[-1], ignore_index=IGNORE_INDEX),),
    opcheck=_opcheck,
    double_backward=r"^cross_entropy: double backward is not supported",
    double_backward_pybind=r"^opsmith\.pybind\.cross_entropy: double backward is not supported",
    func_transforms={
        "grad": SUPPORTED,
        "vjp": SUPPORTED,
        "jvp": r"^cross_entropy: forward-mode AD is not supported",
        "vmap": r"^cross_entropy: torch.func.vmap is not supported",
    },
    func_transforms_pybind=r"^opsmith\.pybind\.cross_entropy: route A does not support torch\.func transforms",
    # the loss grows with the logits (and the z-loss with their square)
    max_scale=1.0,
    make_module=lambda n: _LossLayer(n),
    hostile=_HOSTILE,
    doc_rows=_DOC_ROWS,
    bench=_BENCH,
)
