"""The op spec of LayerNorm: how every harness (reliability tests, sanitizer,
benchmark, docs/reliability.md's table) reaches torch.ops.opsmith.layer_norm_*."""
import math

import torch
import torch.nn.functional as F

from ..ops.layer_norm import LayerNorm, layer_norm, layer_norm_pybind
from . import SUPPORTED, BenchSpec, DocRow, Hostile, OpSpec, compiled, edited_inputs, randn, rows_finite_except

_LN_TOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def _ln_make_inputs(shape, dtype, device, generator):
    shape = tuple(shape)
    n = shape[-1]
    # x off zero (mean ~1): a kernel that squares before subtracting the mean fails
    x = randn(shape, generator, torch.float32, generator.device) + 1.0
    return {
        "x": x.to(device=device, dtype=dtype),
        "weight": randn((n,), generator, dtype, device),
        "bias": randn((n,), generator, dtype, device),
    }


def _ln_eps(inputs):
    eps = inputs.get("eps")
    return 1e-5 if eps is None else eps


def _ln_call(inputs):
    return layer_norm(inputs["x"], inputs.get("weight"), inputs.get("bias"), _ln_eps(inputs))


def _ln_call_pybind(inputs):
    return layer_norm_pybind(inputs["x"], inputs.get("weight"), inputs.get("bias"), _ln_eps(inputs))


def _detached(t):
    return None if t is None else t.detach()


def _ln_opcheck(inputs):
    x, w, b, eps = inputs["x"], inputs.get("weight"), inputs.get("bias"), _ln_eps(inputs)
    _, mean, rstd = torch.ops.opsmith.layer_norm_fwd(x.detach(), _detached(w), _detached(b), eps)
    dy = torch.randn_like(x.detach())
    return [(torch.ops.opsmith.layer_norm_fwd.default, (x, w, b, eps)),
            (torch.ops.opsmith.layer_norm_bwd.default, (dy, x.detach(), _detached(w), _detached(b), mean, rstd))]


def _ln_reference(inputs, dtype=None):
    # the definition, two passes in float64 (F.layer_norm's own float64 mean
    # is not exact: for one element it leaves x - mean ~1e-12 at |x| ~ 1e4)
    x, w, b = inputs["x"].to(torch.float64), inputs.get("weight"), inputs.get("bias")
    d = x - x.mean(-1, keepdim=True)
    y = d * torch.rsqrt((d * d).mean(-1, keepdim=True) + _ln_eps(inputs))
    if w is not None:
        y = y * w.to(torch.float64)
    if b is not None:
        y = y + b.to(torch.float64)
    return y


def _ln_torch_equivalent(inputs):
    x, w, b = inputs["x"].detach(), inputs.get("weight"), inputs.get("bias")
    w32 = None if w is None else w.detach().cpu().float()
    b32 = None if b is None else b.detach().cpu().float()
    return F.layer_norm(x.cpu().float(), (x.shape[-1],), w32, b32, _ln_eps(inputs))


# hostile inputs: float32, small, built on the CPU and moved

def _ln_base(device, gen, rows=4, n=37, **extra):
    inputs = _ln_make_inputs((rows, n), torch.float32, "cpu", gen)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    inputs.update(extra)
    return inputs


def _edited(device, gen, edits=(), **extra):
    return edited_inputs(_ln_base, device, gen, edits, **extra)


def _check_nan_row(spec, inputs, out):
    assert torch.isnan(out[1].detach().cpu()).all(), "a NaN in row 1 must make all of row 1 NaN"
    rows_finite_except(out, {1})
    x = inputs["x"].detach().requires_grad_()
    y = spec.call({**inputs, "x": x})
    (dx,) = torch.autograd.grad(y, [x], torch.ones_like(y))
    assert torch.isnan(dx[1].cpu()).all(), "dx of the NaN row must be NaN"
    rows_finite_except(dx, {1})


def _check_inf_rows(spec, inputs, out):
    o = out.detach().cpu()
    assert torch.isnan(o[0]).all() and torch.isnan(o[2]).all(), "a row holding ±Inf is NaN throughout"
    rows_finite_except(out, {0, 2})


def _check_nan_column(col):
    def check(spec, inputs, out):
        o = out.detach().cpu()
        assert torch.isnan(o[:, col]).all(), "a NaN parameter makes its column NaN in every row"
        rest = torch.cat([o[:, :col], o[:, col + 1:]], dim=1)
        assert torch.isfinite(rest).all(), "a NaN parameter must not leak into other columns"
    return check


def _check_matches_reference(spec, inputs, out):
    ref = spec.reference({k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()})
    err = (out.detach().cpu().double() - ref).abs().max().item()
    bound = spec.tolerance(inputs["x"].dtype) * max(1.0, ref.abs().max().item())
    assert err <= bound, f"max|out - float64 reference| = {err:.3e} > {bound:.3e}"


def _constant_row(device, gen, eps=None):
    inputs = _ln_base("cpu", gen, **({} if eps is None else {"eps": eps}))
    inputs["x"][2] = 3.25
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def _check_constant_row_bias(spec, inputs, out):
    o = out.detach().cpu()
    b = inputs["bias"].detach().cpu()
    assert torch.equal(o[2], b), "a constant row with eps > 0 gives the bias (xhat = 0)"
    _check_matches_reference(spec, inputs, out)


def _check_constant_row_nan(spec, inputs, out):
    assert torch.isnan(out[2].detach().cpu()).all(), "eps = 0 and a constant row: 0 * (1/0) = NaN across the row"
    rows_finite_except(out, {2})


def _check_large_offset(spec, inputs, out):
    # mean 100, spread ~1: the two-pass variance keeps the digits a float32
    # E[x^2] - E[x]^2 would lose (x^2 ~ 1e4, its rounding ~1e-3 of a variance ~1)
    _check_matches_reference(spec, inputs, out)


def _cast(inputs, **dtypes):
    return {**inputs, **{k: inputs[k].to(d) for k, d in dtypes.items()}}


def _move(inputs, device, *names):
    return {**inputs, **{k: inputs[k].to(device) for k in names}}


_LN_HOSTILE = (
    Hostile("nan_in_x", lambda d, g: _edited(d, g, [("x", (1, 5), math.nan)]),
            "NaN across that row (forward), NaN dx for that row only (backward); other rows unaffected",
            input="one NaN in row 1", check=_check_nan_row),
    Hostile("inf_in_x", lambda d, g: _edited(d, g, [("x", (2, 3), math.inf), ("x", (0, 0), -math.inf)]),
            "NaN across a row holding ±Inf (its mean is infinite, so every deviation is Inf or NaN), as F.layer_norm gives; other rows unaffected",
            input="+Inf in row 2, -Inf in row 0", check=_check_inf_rows),
    Hostile("nan_in_weight", lambda d, g: _edited(d, g, [("weight", 7, math.nan)]),
            "NaN in that column of every row; other columns finite",
            input="one NaN weight", check=_check_nan_column(7)),
    Hostile("nan_in_bias", lambda d, g: _edited(d, g, [("bias", 11, math.nan)]),
            "NaN in that column of every row; other columns finite",
            input="one NaN bias", check=_check_nan_column(11)),
    Hostile("constant_row", lambda d, g: _constant_row(d, g),
            "that row is the bias exactly (zero variance, eps keeps rstd finite); other rows match the reference",
            input="a row of one repeated value", check=_check_constant_row_bias),
    Hostile("constant_row_eps_zero", lambda d, g: _constant_row(d, g, eps=0.0),
            "NaN across that row (0 · 1/sqrt(0)), as F.layer_norm gives; other rows finite",
            input="eps = 0 and a constant row", check=_check_constant_row_nan),
    Hostile("eps_zero", lambda d, g: _ln_base(d, g, eps=0.0),
            "works: finite, matches the float64 reference with eps = 0",
            input="eps = 0", check=_check_matches_reference),
    Hostile("large_mean_small_spread",
            lambda d, g: {**_ln_base(d, g), "x": (_ln_base("cpu", g)["x"] + 100.0).to(d)},
            "matches the float64 reference: the variance is the mean of squared deviations from the mean, not E[x²] − E[x]² (which would cancel to noise)",
            input="x of mean 100 and spread 1", check=_check_large_offset),
    Hostile("negative_eps", lambda d, g: _ln_base(d, g, eps=-1e-3),
            "`layer_norm: eps must be a finite number >= 0, got -0.001`",
            input="eps = -1e-3", raises=r"^layer_norm: eps must be a finite number >= 0"),
    Hostile("nan_eps", lambda d, g: _ln_base(d, g, eps=math.nan),
            "`layer_norm: eps must be a finite number >= 0, got nan`",
            input="eps = NaN", raises=r"^layer_norm: eps must be a finite number >= 0"),
    Hostile("integer_x",
            lambda d, g: {"x": torch.randint(-5, 5, (4, 8), generator=g, dtype=torch.int32).to(d)},
            "`layer_norm: x must be float64, float32, float16 or bfloat16, got Int`",
            input="int32 x", raises=r"^layer_norm: x must be float64, float32, float16 or bfloat16, got Int"),
    Hostile("weight_dtype_unsupported", lambda d, g: _cast(_ln_base(d, g), weight=torch.float64, bias=torch.float64),
            "`layer_norm: weight must have the dtype of x (Float) or float32, got Double`",
            input="float32 x, float64 weight and bias",
            raises=r"^layer_norm: weight must have the dtype of x \(Float\) or float32, got Double"),
    Hostile("weight_bias_dtypes_differ",
            lambda d, g: _cast(_ln_base(d, g), x=torch.bfloat16, weight=torch.bfloat16),
            "`layer_norm: weight and bias must have the same dtype, got BFloat16 and Float`",
            input="bfloat16 x and weight, float32 bias",
            raises=r"^layer_norm: weight and bias must have the same dtype"),
    Hostile("bias_wrong_shape", lambda d, g: {**_ln_base(d, g), "bias": torch.ones(38, device=d)},
            "`layer_norm: bias must have shape [37] (last dim of x), got [38]`",
            input="bias of 38 for x of width 37", raises=r"^layer_norm: bias must have shape \[37\]"),
    Hostile("zero_dim_x", lambda d, g: {"x": torch.tensor(1.5, device=d)},
            "`layer_norm: x must have at least 1 dimension, got a 0-dim tensor`",
            input="0-dim x", raises=r"^layer_norm: x must have at least 1 dimension"),
    Hostile("bias_on_cpu_x_on_cuda", lambda d, g: _move(_ln_base("cuda", g), "cpu", "bias"),
            "`layer_norm: bias must be on the same device as x (cuda:0), got cpu`",
            input="bias on the CPU, x on CUDA",
            raises=r"^layer_norm: bias must be on the same device as x", cuda_only=True),
)


# --- benchmark -----------------------------------------------------------------------

def _bench_inputs(rows, n, dtype, device):
    return {
        "x": torch.randn(rows, n, dtype=dtype, device=device),
        "w": (1 + 0.1 * torch.randn(n, device=device)).to(dtype),
        "b": (0.1 * torch.randn(n, device=device)).to(dtype),
        "dy": torch.randn(rows, n, dtype=dtype, device=device),
    }


def _liger_layer_norm_factory(n, dtype, device):
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5)


def _host_calls(device):
    x = torch.randn(4, 256, device=device, dtype=torch.bfloat16)
    w = torch.ones(256, device=device, dtype=torch.bfloat16)
    b = torch.zeros(256, device=device, dtype=torch.bfloat16)
    xg, wg, bg = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    return {
        "opsmith.layer_norm": lambda: layer_norm(x, w, b),
        "opsmith.layer_norm (requires_grad)": lambda: layer_norm(xg, wg, bg),
        "opsmith.pybind.layer_norm": lambda: layer_norm_pybind(x, w, b),
        "F.layer_norm": lambda: F.layer_norm(x, (256,), w, b),
        "F.layer_norm (requires_grad)": lambda: F.layer_norm(xg, (256,), wg, bg),
    }


_BENCH = BenchSpec(
    make_inputs=_bench_inputs,
    grad_inputs=["x", "w", "b"],
    providers={
        "opsmith": lambda n, dt, dev: lambda x, w, b: layer_norm(x, w, b, 1e-5),
        "opsmith_pybind": lambda n, dt, dev: lambda x, w, b: layer_norm_pybind(x, w, b, 1e-5),
        "torch_F": lambda n, dt, dev: lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-5),
        "torch_compile_F": lambda n, dt, dev: compiled(
            ("F.layer_norm", n), lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)),
        "liger": _liger_layer_norm_factory,
    },
    # forward: read x, w, b; write y. backward: read dy, x, w; write dx, dw, db
    # (mean and rstd, one float a row each way, are left out as for rms_norm)
    fwd_bytes=lambda rows, n, s: (2 * rows * n + 2 * n) * s,
    fwdbwd_bytes=lambda rows, n, s: (2 * rows * n + 2 * n) * s + (3 * rows * n + 3 * n) * s,
    hidden_sizes=[512, 1024, 2048, 4096, 8192, 16384],
    row_counts=[1, 16, 64, 1024, 4096, 16384, 65536, 262144],
    quick_shapes=[(4096, 4096), (16384, 4096), (4096, 8192), (65536, 1024), (8192, 16384),
                  (16, 4096), (1, 8192)],
    host_calls=_host_calls,
)


_DOC_ROWS = (
    DocRow("zero rows: x of shape (0, n) or (3, 0, n)",
           "empty output and dx of x's shape; dweight and dbias are zeros (empty sums)", "`test_zero_rows`"),
    DocRow("rows of width 0: x of shape (4, 0) or (2, 3, 0)",
           "empty output and gradients, as torch.nn.functional.layer_norm (mean and rstd NaN)", "`test_zero_width`"),
    DocRow("one row: (1, 257), 1-D (257,), (1, 1)", "matches the reference, forward and backward", "`test_one_row`"),
    DocRow("prime widths 7, 13, 127, 8191", "matches the reference (the scalar tail of every loop runs)",
           "`test_prime_widths`"),
    DocRow("a row of 100003 elements", "matches the reference on CPU and CUDA", "`test_row_wider_than_any_tile`"),
    DocRow("transposed, sliced, every-other-row, expanded (stride-0 rows), storage-offset x and dy",
           "matches the reference", "`test_layouts`"),
    DocRow("weight and bias in float32 beside float16/bfloat16 x (and float64 x)",
           "output in x's dtype as F.layer_norm, dweight/dbias in float32; matches the float64 reference",
           "`tests/test_layer_norm.py::test_mixed_dtypes`"),
    DocRow("CUDA autocast (bf16/fp16)", "float32 output, as F.layer_norm (autocast's float32 list); CPU autocast leaves it alone, as it does F.layer_norm",
           "`tests/test_layer_norm.py::test_autocast_*`"),
)


SPEC = OpSpec(
    name="layer_norm",
    make_inputs=_ln_make_inputs,
    call=_ln_call,
    call_pybind=_ln_call_pybind,
    reference=_ln_reference,
    torch_equivalent=_ln_torch_equivalent,
    tolerance=_LN_TOL.__getitem__,
    outputs=("y",),
    grad_inputs=("x", "weight", "bias"),
    row_inputs=("x",),
    opcheck=_ln_opcheck,
    double_backward=r"^layer_norm: double backward is not supported",
    double_backward_pybind=r"^opsmith\.pybind\.layer_norm: double backward is not supported",
    func_transforms={
        "grad": SUPPORTED,
        "vjp": SUPPORTED,
        "jvp": r"^layer_norm: forward-mode AD is not supported",
        "vmap": SUPPORTED,
    },
    func_transforms_pybind=r"^opsmith\.pybind\.layer_norm: route A does not support torch\.func transforms",
    make_module=lambda n: LayerNorm(n),
    hostile=_LN_HOSTILE,
    doc_rows=_DOC_ROWS,
    bench=_BENCH,
)
