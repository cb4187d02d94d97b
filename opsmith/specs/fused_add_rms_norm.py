"""The op spec of the residual-add RMSNorm: how every harness (reliability
tests, sanitizer, benchmark, docs/reliability.md's table) reaches
torch.ops.opsmith.fused_add_rms_norm_*. The spec covers the functional form,
(y, h) = fused_add_rms_norm(x, residual, weight); the in-place inference form
is opchecked here too and tested in tests/test_fused_add_rms_norm.py."""
import math

import torch
import torch.nn.functional as F

from ..ops.fused_add_rms_norm import FusedAddRMSNorm, fused_add_rms_norm, fused_add_rms_norm_pybind
from . import SUPPORTED, BenchSpec, DocRow, Hostile, OpSpec, compiled, edited_inputs, randn, rows_finite_except

_TOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}

EPS = 1e-6


def _make_inputs(shape, dtype, device, generator):
    shape = tuple(shape)
    n = shape[-1]
    x = randn(shape, generator, torch.float32, generator.device)
    r = randn(shape, generator, torch.float32, generator.device)
    if n == 1:
        # one element a row: dx ~ eps/h^2 is found by cancellation; |h| >= 0.5 bounds its error
        r = torch.where(x + r < 0, r - 0.5, r + 0.5)
    return {
        "x": x.to(device=device, dtype=dtype),
        "residual": r.to(device=device, dtype=dtype),
        "weight": randn((n,), generator, dtype, device),
    }


def _eps(inputs):
    eps = inputs.get("eps")
    return EPS if eps is None else eps


def _call(inputs):
    return fused_add_rms_norm(inputs["x"], inputs["residual"], inputs["weight"], _eps(inputs))


def _call_pybind(inputs):
    return fused_add_rms_norm_pybind(inputs["x"], inputs["residual"], inputs["weight"], _eps(inputs))


def _opcheck(inputs):
    x, r, w, eps = inputs["x"], inputs["residual"], inputs["weight"], _eps(inputs)
    with torch.no_grad():
        _, h, inv_rms = torch.ops.opsmith.fused_add_rms_norm_fwd(x, r, w, eps)
    dy, dh = torch.randn_like(h), torch.randn_like(h)
    d = (x.detach(), r.detach().clone(), w.detach(), eps)
    return [(torch.ops.opsmith.fused_add_rms_norm_fwd.default, (x, r, w, eps)),
            (torch.ops.opsmith.fused_add_rms_norm_bwd.default, (dy, dh, h, w.detach(), inv_rms)),
            (torch.ops.opsmith.fused_add_rms_norm_bwd.default, (dy, None, h, w.detach(), inv_rms)),
            (torch.ops.opsmith.fused_add_rms_norm_bwd.default, (None, dh, h, w.detach(), inv_rms)),
            # the in-place form on tensors that do not require grad (it has no autograd)
            (torch.ops.opsmith.fused_add_rms_norm_.default, d)]


def _reference(inputs, dtype=None):
    x, r, w = (inputs[k].to(torch.float64) for k in ("x", "residual", "weight"))
    # h is x's dtype by definition (`dtype`: the harness passes float64
    # copies of the inputs and names their dtype), and y normalises that h:
    # a float16 sum past 65504 is inf, as PyTorch's own x + r
    h = (x + r).to(dtype or inputs["x"].dtype).to(torch.float64)
    return F.rms_norm(h, (h.shape[-1],), w, _eps(inputs)), h


def _torch_equivalent(inputs):
    x, r, w = (inputs[k].detach().cpu().float() for k in ("x", "residual", "weight"))
    h = x + r
    return F.rms_norm(h, (h.shape[-1],), w, _eps(inputs)), h


# hostile inputs: float32, small, built on the CPU and moved

def _base(device, gen, rows=4, n=37, **extra):
    inputs = {k: v.to(device) for k, v in _make_inputs((rows, n), torch.float32, "cpu", gen).items()}
    inputs.update(extra)
    return inputs


def _edited(device, gen, key, index, value, **extra):
    return edited_inputs(_base, device, gen, [(key, index, value)], **extra)


def _check_nan_row(spec, inputs, out):
    y, h = out
    assert torch.isnan(y[1].detach().cpu()).all(), "a NaN in row 1 of x + residual makes all of row 1 of y NaN"
    assert torch.isnan(h[1, 5].detach().cpu()), "h keeps the NaN where it was"
    rows_finite_except(y, {1})
    rows_finite_except(h, {1})


def _check_zero_h(spec, inputs, out):
    y, h = out
    assert torch.equal(h[2].detach().cpu(), torch.zeros_like(h[2].cpu())), "x = -residual gives h = 0"
    assert torch.equal(y[2].detach().cpu(), torch.zeros_like(y[2].cpu())), "an all-zero h row with eps > 0 gives zeros"
    rows_finite_except(y, set())


def _cancelling_row(device, gen):
    inputs = _base("cpu", gen)
    inputs["residual"][2] = -inputs["x"][2]
    return {k: v.to(device) for k, v in inputs.items()}


def _with(inputs, **changes):
    return {**inputs, **changes}


_HOSTILE = (
    Hostile("nan_in_x", lambda d, g: _edited(d, g, "x", (1, 5), math.nan),
            "NaN across that row of y, NaN at that element of h; other rows unaffected",
            input="one NaN in row 1 of x", check=_check_nan_row),
    Hostile("nan_in_residual", lambda d, g: _edited(d, g, "residual", (1, 5), math.nan),
            "NaN across that row of y, NaN at that element of h; other rows unaffected",
            input="one NaN in row 1 of residual", check=_check_nan_row),
    Hostile("residual_cancels_x", _cancelling_row,
            "h = 0 in that row and y = 0 there (eps keeps 1/rms finite); other rows finite",
            input="residual = -x in row 2", check=_check_zero_h),
    Hostile("negative_eps", lambda d, g: _base(d, g, eps=-1e-3),
            "`fused_add_rms_norm: eps must be a finite number >= 0, got -0.001`",
            input="eps = -1e-3", raises=r"^fused_add_rms_norm: eps must be a finite number >= 0"),
    Hostile("nan_eps", lambda d, g: _base(d, g, eps=math.nan),
            "`fused_add_rms_norm: eps must be a finite number >= 0, got nan`",
            input="eps = NaN", raises=r"^fused_add_rms_norm: eps must be a finite number >= 0"),
    Hostile("residual_dtype_differs", lambda d, g: _with(_base(d, g), residual=_base(d, g)["residual"].double()),
            "`fused_add_rms_norm: weight must have the dtype of x + residual (Double), got Float` (x and "
            "residual add in their promoted dtype, as `x + residual`; the weight must suit that one)",
            input="float32 x, float64 residual, float32 weight",
            raises=r"^fused_add_rms_norm_?: weight must have the dtype of x \+ residual \(Double\), got Float"),
    Hostile("residual_wrong_shape", lambda d, g: _with(_base(d, g), residual=torch.ones(4, 38, device=d)),
            "`fused_add_rms_norm: residual must have the shape of x [4, 37], got [4, 38]`",
            input="residual of (4, 38) for x of (4, 37)",
            raises=r"^fused_add_rms_norm: residual must have the shape of x \[4, 37\], got \[4, 38\]"),
    Hostile("weight_dtype_differs", lambda d, g: _with(_base(d, g), weight=torch.ones(37, dtype=torch.float64, device=d)),
            "`fused_add_rms_norm: weight must have the dtype of x (Float), got Double`",
            input="float32 x, float64 weight",
            raises=r"^fused_add_rms_norm: weight must have the dtype of x \(Float\), got Double"),
    Hostile("weight_wrong_shape", lambda d, g: _with(_base(d, g), weight=torch.ones(38, device=d)),
            "`fused_add_rms_norm: weight must have shape [37] (last dim of x), got [38]`",
            input="weight of 38 for x of width 37",
            raises=r"^fused_add_rms_norm: weight must have shape \[37\]"),
    Hostile("integer_x",
            lambda d, g: {"x": torch.randint(-5, 5, (4, 8), generator=g, dtype=torch.int32).to(d),
                          "residual": torch.randint(-5, 5, (4, 8), generator=g, dtype=torch.int32).to(d),
                          "weight": torch.ones(8, dtype=torch.int32, device=d)},
            "`fused_add_rms_norm: x must be float64, float32, float16 or bfloat16, got Int`",
            input="int32 x and residual",
            raises=r"^fused_add_rms_norm: x must be float64, float32, float16 or bfloat16, got Int"),
    Hostile("zero_dim_x",
            lambda d, g: {"x": torch.tensor(1.5, device=d), "residual": torch.tensor(0.5, device=d),
                          "weight": torch.ones(1, device=d)},
            "`fused_add_rms_norm: x must have at least 1 dimension, got a 0-dim tensor`",
            input="0-dim x", raises=r"^fused_add_rms_norm: x must have at least 1 dimension"),
    Hostile("residual_on_cpu_x_on_cuda", lambda d, g: _with(_base("cuda", g), residual=_base("cpu", g)["residual"]),
            "`fused_add_rms_norm: residual must be on the same device as x (cuda:0), got cpu`",
            input="residual on the CPU, x on CUDA",
            raises=r"^fused_add_rms_norm: residual must be on the same device as x", cuda_only=True),
)


# --- benchmark -----------------------------------------------------------------------

def _bench_inputs(rows, n, dtype, device):
    return {
        "x": torch.randn(rows, n, dtype=dtype, device=device),
        "residual": torch.randn(rows, n, dtype=dtype, device=device),
        "w": (1 + 0.1 * torch.randn(n, device=device)).to(dtype),
        # the gradients of y and h
        "dy": (torch.randn(rows, n, dtype=dtype, device=device), torch.randn(rows, n, dtype=dtype, device=device)),
    }


def _eager(x, residual, w):
    h = x + residual
    return F.rms_norm(h, (h.shape[-1],), w, EPS), h


def _liger_factory(n, dtype, device):
    # Liger-Kernel's fused add + RMSNorm (0.8.5), imported only here; "llama" is its default casting
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    return lambda x, residual, w: LigerFusedAddRMSNormFunction.apply(x, residual, w, EPS, 0.0, "llama", False)


def _host_calls(device):
    x = torch.randn(4, 256, device=device, dtype=torch.bfloat16)
    r = torch.randn(4, 256, device=device, dtype=torch.bfloat16)
    w = torch.ones(256, device=device, dtype=torch.bfloat16)
    xg, rg, wg = x.clone().requires_grad_(), r.clone().requires_grad_(), w.clone().requires_grad_()
    return {
        "opsmith.fused_add_rms_norm": lambda: fused_add_rms_norm(x, r, w),
        "opsmith.fused_add_rms_norm (requires_grad)": lambda: fused_add_rms_norm(xg, rg, wg),
        "x + r, F.rms_norm": lambda: _eager(x, r, w),
        "x + r, F.rms_norm (requires_grad)": lambda: _eager(xg, rg, wg),
    }


_BENCH = BenchSpec(
    make_inputs=_bench_inputs,
    grad_inputs=["x", "residual", "w"],
    providers={
        "opsmith": lambda n, dt, dev: lambda x, residual, w: fused_add_rms_norm(x, residual, w, EPS),
        "opsmith_pybind": lambda n, dt, dev: lambda x, residual, w: fused_add_rms_norm_pybind(x, residual, w, EPS),
        "torch_eager": lambda n, dt, dev: _eager,
        "torch_compile": lambda n, dt, dev: compiled(("fused_add_rms_norm", n), _eager),
        "liger": _liger_factory,
    },
    # forward: read x, residual, w; write y, h. backward: read dy, dh, h, w; write dx, dw
    # (x and residual share one gradient tensor)
    fwd_bytes=lambda rows, n, s: (4 * rows * n + n) * s,
    fwdbwd_bytes=lambda rows, n, s: (4 * rows * n + n) * s + (4 * rows * n + 2 * n) * s,
    hidden_sizes=[1024, 2048, 4096, 8192, 16384],
    row_counts=[1, 16, 64, 1024, 4096, 16384, 65536],
    quick_shapes=[(16384, 4096), (32768, 4096), (8192, 8192), (65536, 2048), (4096, 16384), (64, 4096),
                  (16, 8192), (1, 4096)],
    host_calls=_host_calls,
)


_DOC_ROWS = (
    DocRow("the in-place form fused_add_rms_norm_(x, residual, weight)",
           "h written over residual, y returned, equal to the functional form's; with autograd recording it "
           "raises `fused_add_rms_norm_: the in-place form has no autograd`",
           "`tests/test_fused_add_rms_norm.py::test_inplace_*`"),
    DocRow("dy or dh absent (only y or only h used)", "dx = dh alone, or the norm's gradient alone; dweight zeros "
           "without dy", "`tests/test_fused_add_rms_norm.py::test_backward_one_gradient`"),
    DocRow("rows of width 0: x and residual of shape (4, 0) or (2, 3, 0)",
           "empty y, h and gradients, as x + residual and torch.nn.functional.rms_norm", "`test_zero_width`"),
)


class _Block(torch.nn.Module):
    """FusedAddRMSNorm as one layer of a sequential model (the compile
    training harness): residual = tanh(x), out = y + h."""

    def __init__(self, n):
        super().__init__()
        self.norm = FusedAddRMSNorm(n)

    def forward(self, x):
        y, h = self.norm(x, torch.tanh(x))
        return y + h


SPEC = OpSpec(
    name="fused_add_rms_norm",
    make_inputs=_make_inputs,
    call=_call,
    call_pybind=_call_pybind,
    reference=_reference,
    torch_equivalent=_torch_equivalent,
    tolerance=_TOL.__getitem__,
    outputs=("y", "h"),
    grad_inputs=("x", "residual", "weight"),
    row_inputs=("x", "residual"),
    opcheck=_opcheck,
    double_backward=r"^fused_add_rms_norm: double backward is not supported",
    double_backward_pybind=r"^opsmith\.pybind\.fused_add_rms_norm: double backward is not supported",
    func_transforms={
        "grad": SUPPORTED,
        "vjp": SUPPORTED,
        "jvp": r"^fused_add_rms_norm: forward-mode AD is not supported",
        "vmap": SUPPORTED,  # register_vmap in opsmith/ops/fused_add_rms_norm.py
    },
    func_transforms_pybind=r"^opsmith\.pybind\.fused_add_rms_norm: route A does not support torch\.func transforms",
    make_module=_Block,
    hostile=_HOSTILE,
    doc_rows=_DOC_ROWS,
    bench=_BENCH,
)
