"""The op spec of cross_entropy: how every harness (reliability tests, sanitizer,
benchmark, docs/reliability.md's table) reaches torch.ops.opsmith.cross_entropy_*."""
import math

import torch

from ..ops.cross_entropy import CrossEntropy, cross_entropy, cross_entropy_pybind
from . import SUPPORTED, BenchSpec, DocRow, Hostile, OpSpec, compiled, randn

# the alpha the harnesses run with: not 1, so a kernel that ignores it fails
ALPHA = 1.5

_TOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def _make_inputs(shape, dtype, device, generator):
    return {"x": randn(tuple(shape), generator, dtype, device), "alpha": ALPHA}


def _alpha(inputs):
    return inputs.get("alpha", 1.0)


def _call(inputs):
    return cross_entropy(inputs["x"], _alpha(inputs))


def _call_pybind(inputs):
    return cross_entropy_pybind(inputs["x"], _alpha(inputs))


def _opcheck(inputs):
    # both dispatcher ops; a requires_grad x makes opcheck test the autograd registration too
    x, alpha = inputs["x"], _alpha(inputs)
    dy = torch.randn_like(x.detach())
    return [(torch.ops.opsmith.cross_entropy_fwd.default, (x, alpha)),
            (torch.ops.opsmith.cross_entropy_bwd.default, (dy, x.detach(), alpha))]


def _formula(x, alpha):
    return x * torch.sigmoid(alpha * x)


def _reference(inputs, dtype=None):
    return _formula(inputs["x"].to(torch.float64), _alpha(inputs))


def _torch_equivalent(inputs):
    return _formula(inputs["x"].detach().cpu().float(), _alpha(inputs))


# hostile inputs: float32, small, built on the CPU and moved

def _base(device, gen, rows=4, n=37, **extra):
    inputs = _make_inputs((rows, n), torch.float32, "cpu", gen)
    inputs.update(extra)
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def _edited(device, gen, edit, **extra):
    inputs = _base("cpu", gen, **extra)
    edit(inputs["x"])
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def _set(index, value):
    def edit(t):
        t[index] = value
    return edit


def _check_only_that_element(spec, inputs, out):
    o = out.detach().cpu()
    bad = ~torch.isfinite(o)
    assert bad.sum().item() == 1 and bad[1, 5], "a NaN in x must give NaN in that element of y only"


_HOSTILE = (
    Hostile("nan_in_x", lambda d, g: _edited(d, g, _set((1, 5), math.nan)),
            "NaN in that element of y only (elementwise)", input="one NaN in x",
            check=_check_only_that_element),
    Hostile("inf_in_x", lambda d, g: _edited(d, g, lambda x: (x.__setitem__((2, 3), math.inf),
                                                              x.__setitem__((0, 0), -math.inf))),
            "+Inf gives +Inf; -Inf gives NaN (-inf · 0), as PyTorch's x * sigmoid(alpha x)",
            input="+Inf and -Inf in x"),
    Hostile("huge_x", lambda d, g: _edited(d, g, lambda x: x.mul_(1e30)),
            "finite: y = x where alpha x is large, -0 where it is very negative (exp overflows to inf)",
            input="float32 x of magnitude ~1e30"),
    Hostile("nan_alpha", lambda d, g: _base(d, g, alpha=math.nan), "",
            input="alpha = NaN", raises=r"^cross_entropy: alpha must be finite"),
    Hostile("inf_alpha", lambda d, g: _base(d, g, alpha=math.inf), "",
            input="alpha = Inf", raises=r"^cross_entropy: alpha must be finite"),
    Hostile("integer_x", lambda d, g: {"x": torch.randint(-5, 5, (4, 8), generator=g, dtype=torch.int32).to(d)}, "",
            input="int32 x", raises=r"^cross_entropy: x must be float64, float32, float16 or bfloat16, got Int"),
)


# --- benchmark -----------------------------------------------------------------------

def _bench_inputs(rows, n, dtype, device):
    return {"x": torch.randn(rows, n, dtype=dtype, device=device),
            "dy": torch.randn(rows, n, dtype=dtype, device=device)}


def _host_calls(device):
    x = torch.randn(4, 256, device=device, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    return {
        "opsmith.cross_entropy": lambda: cross_entropy(x, ALPHA),
        "opsmith.cross_entropy (requires_grad)": lambda: cross_entropy(xg, ALPHA),
        "opsmith.pybind.cross_entropy": lambda: cross_entropy_pybind(x, ALPHA),
        "torch cross_entropy formula": lambda: _formula(x, ALPHA),
    }


_BENCH = BenchSpec(
    make_inputs=_bench_inputs,
    grad_inputs=["x"],
    providers={
        "opsmith": lambda n, dt, dev: lambda x: cross_entropy(x, ALPHA),
        "opsmith_pybind": lambda n, dt, dev: lambda x: cross_entropy_pybind(x, ALPHA),
        "torch_eager": lambda n, dt, dev: lambda x: _formula(x, ALPHA),
        "torch_compile": lambda n, dt, dev: compiled(("cross_entropy", n), lambda x: _formula(x, ALPHA)),
    },
    # forward: read x, write y. backward: read dy, x; write dx.
    fwd_bytes=lambda rows, n, s: 2 * rows * n * s,
    fwdbwd_bytes=lambda rows, n, s: 2 * rows * n * s + 3 * rows * n * s,
    hidden_sizes=[1024, 4096, 16384],
    row_counts=[1, 16, 1024, 16384, 65536],
    quick_shapes=[(4096, 4096), (65536, 1024), (16, 4096)],
    host_calls=_host_calls,
)


_DOC_ROWS = (
    DocRow("zero rows: x of shape (0, n) or (3, 0, n)", "empty output and dx of x's shape", "`test_zero_rows`"),
    DocRow("transposed, sliced, every-other-row, expanded (stride-0 rows), storage-offset x and dy",
           "matches the reference; no NaN from the NaN padding the views skip over", "`test_layouts`"),
)


SPEC = OpSpec(
    name="cross_entropy",
    make_inputs=_make_inputs,
    call=_call,
    call_pybind=_call_pybind,
    reference=_reference,
    torch_equivalent=_torch_equivalent,
    tolerance=_TOL.__getitem__,
    outputs=("y",),
    grad_inputs=("x",),
    row_inputs=("x",),
    opcheck=_opcheck,
    # the C++ autograd node's backward is not differentiable; route A's is
    # @once_differentiable
    double_backward=r"^cross_entropy: double backward is not supported",
    double_backward_pybind=r"trying to differentiate twice a function that was marked with @once_differentiable",
    func_transforms={
        "grad": SUPPORTED,
        "vjp": SUPPORTED,
        "jvp": r"^cross_entropy: forward-mode AD is not supported",
        "vmap": SUPPORTED,  # register_vmap in opsmith/ops/cross_entropy.py
    },
    func_transforms_pybind=r"^opsmith\.pybind\.cross_entropy: route A does not support torch\.func transforms",
    make_module=lambda n: CrossEntropy(ALPHA),
    hostile=_HOSTILE,
    doc_rows=_DOC_ROWS,
    bench=_BENCH,
)
