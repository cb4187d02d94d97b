"""The op spec of RMSNorm: how every harness (reliability tests, sanitizer,
benchmark, docs/reliability.md's table) reaches torch.ops.opsmith.rms_norm_*."""
import math

import torch
import torch.nn.functional as F

from ..ops.rms_norm import RMSNorm, rms_norm, rms_norm_pybind
from . import SUPPORTED, BenchSpec, DocRow, Hostile, OpSpec, compiled, randn

_RMS_TOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def _rms_make_inputs(shape, dtype, device, generator):
    shape = tuple(shape)
    n = shape[-1]
    x = randn(shape, generator, torch.float32, generator.device)
    if n == 1:
        # One element a row: dx = g*w*inv_rms*eps/(x^2+eps) is ~0 and found by
        # cancellation, with an absolute error ~u*inv_rms; |x| >= 0.5 bounds it.
        x = torch.where(x < 0, x - 0.5, x + 0.5)
    return {
        "x": x.to(device=device, dtype=dtype),
        "weight": randn((n,), generator, dtype, device),
    }


def _rms_call(inputs):
    return rms_norm(inputs["x"], inputs.get("weight"), inputs.get("eps"))


def _rms_call_pybind(inputs):
    return rms_norm_pybind(inputs["x"], inputs.get("weight"), inputs.get("eps"))


def _rms_opcheck(inputs):
    # both dispatcher ops; requires_grad inputs make opcheck test the autograd registration too
    x, w, eps = inputs["x"], inputs.get("weight"), inputs.get("eps")
    _, inv_rms = torch.ops.opsmith.rms_norm_fwd(x.detach(), None if w is None else w.detach(), eps)
    dy = torch.randn_like(x.detach())
    return [(torch.ops.opsmith.rms_norm_fwd.default, (x, w, eps)),
            (torch.ops.opsmith.rms_norm_bwd.default,
             (dy, x.detach(), None if w is None else w.detach(), inv_rms))]


def _rms_eps(inputs, dtype):
    eps = inputs.get("eps")
    # None means what torch.nn.functional.rms_norm takes: the eps of the type
    # its sums run in (float32 for 16-bit x, float64 for float64)
    if eps is None:
        return torch.finfo(torch.float64 if (dtype or inputs["x"].dtype) == torch.float64 else torch.float32).eps
    return eps


def _rms_reference(inputs, dtype=None):
    x = inputs["x"]
    w = inputs.get("weight")
    eps = _rms_eps(inputs, dtype)
    w64 = None if w is None else w.to(torch.float64)
    return F.rms_norm(x.to(torch.float64), (x.shape[-1],), w64, eps)


def _rms_torch_equivalent(inputs):
    x = inputs["x"].detach()
    w = inputs.get("weight")
    eps = _rms_eps(inputs, None)
    w32 = None if w is None else w.detach().cpu().float()
    return F.rms_norm(x.cpu().float(), (x.shape[-1],), w32, eps)


# hostile inputs: float32, small, built on the CPU and moved

def _rms_base(device, gen, rows=4, n=37, **extra):
    inputs = _rms_make_inputs((rows, n), torch.float32, "cpu", gen)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    inputs.update(extra)
    return inputs


def _edited(device, gen, x_edit=None, weight_edit=None, **extra):
    """Base inputs with x and/or weight edited in place on the CPU, then moved."""
    inputs = _rms_base("cpu", gen, **extra)
    if x_edit:
        x_edit(inputs["x"])
    if weight_edit:
        weight_edit(inputs["weight"])
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def _set(*assignments):
    """Editor setting t[index] = value for each (index, value) pair."""
    def edit(t):
        for index, value in assignments:
            t[index] = value
    return edit


def _cast_weight(inputs, dtype):
    return {**inputs, "weight": inputs["weight"].to(dtype)}


def _move_weight(inputs, device):
    return {**inputs, "weight": inputs["weight"].to(device)}


def _rows_finite_except(out, bad_rows):
    out = out.detach().cpu()
    for r in range(out.shape[0]):
        if r in bad_rows:
            continue
        assert torch.isfinite(out[r]).all(), f"row {r} is not finite, yet only rows {bad_rows} are hostile"


def _check_nan_row(spec, inputs, out):
    # the NaN poisons its row's mean square, hence the whole row...
    assert torch.isnan(out[1].detach().cpu()).all(), "a NaN in row 1 must make all of row 1 NaN"
    _rows_finite_except(out, {1})
    # ...and, in the backward, that row's dx only: rows stay independent
    x = inputs["x"].detach().requires_grad_()
    y = spec.call({**inputs, "x": x})
    (dx,) = torch.autograd.grad(y, [x], torch.ones_like(y))
    assert torch.isnan(dx[1].cpu()).all(), "dx of the NaN row must be NaN"
    _rows_finite_except(dx, {1})


def _check_inf_row(spec, inputs, out):
    # sum of squares = inf, so 1/rms = 0: inf * 0 = NaN, finite * 0 = 0
    o = out.detach().cpu()
    assert torch.isnan(o[2, 3]), "the Inf element itself gives NaN (inf * 0)"
    others = torch.cat([o[2, :3], o[2, 4:]])
    assert torch.equal(others, torch.zeros_like(others)), "the rest of an Inf row is 0"
    _rows_finite_except(out, {0, 2})


def _check_nan_weight(spec, inputs, out):
    o = out.detach().cpu()
    assert torch.isnan(o[:, 7]).all(), "a NaN weight makes its column NaN in every row"
    rest = torch.cat([o[:, :7], o[:, 8:]], dim=1)
    assert torch.isfinite(rest).all(), "a NaN weight must not leak into other columns"


def _check_matches_reference(spec, inputs, out):
    ref = spec.reference({k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()})
    err = (out.detach().cpu().double() - ref).abs().max().item()
    bound = spec.tolerance(inputs["x"].dtype) * max(1.0, ref.abs().max().item())
    assert err <= bound, f"max|out - float64 reference| = {err:.3e} > {bound:.3e}"


def _check_zero_row_nan(spec, inputs, out):
    assert torch.isnan(out[2].detach().cpu()).all(), "eps=0 and an all-zero row: 0 * (1/0) = NaN across the row"
    _rows_finite_except(out, {2})


def _check_zero_row_zeros(spec, inputs, out):
    o = out.detach().cpu()
    assert torch.equal(o[2], torch.zeros_like(o[2])), "an all-zero row with eps > 0 gives zeros"
    _check_matches_reference(spec, inputs, out)


def _check_overflow(spec, inputs, out):
    # float32 squares of ~1e20 overflow the float32 accumulator: 1/rms = 0
    o = out.detach().cpu()
    assert torch.equal(o, torch.zeros_like(o)), "squares overflowing float32 give 1/rms = 0, so zeros"


def _check_underflow(spec, inputs, out):
    o = out.detach().cpu()
    assert torch.isinf(o[0]).all(), "squares underflowing to 0 with eps=0 give 1/rms = inf, so +-inf"
    _rows_finite_except(out, {0})


_RMS_HOSTILE = (
    Hostile("nan_in_x", lambda d, g: _edited(d, g, _set(((1, 5), math.nan))),
            "NaN across that row (forward), NaN dx for that row only (backward); other rows unaffected",
            input="one NaN in row 1",
            check=_check_nan_row),
    Hostile("inf_in_x", lambda d, g: _edited(d, g, _set(((2, 3), math.inf), ((0, 0), -math.inf))),
            "in a row holding ±Inf, 1/rms = 0: the Inf element gives NaN (inf·0), the rest of the row 0; other rows unaffected",
            input="+Inf in row 2, -Inf in row 0",
            check=_check_inf_row),
    Hostile("nan_in_weight",
            lambda d, g: _edited(d, g, weight_edit=_set((7, math.nan))),
            "NaN in that column of every row; other columns finite",
            input="one NaN weight",
            check=_check_nan_weight),
    Hostile("eps_zero_nonzero_rows", lambda d, g: _rms_base(d, g, eps=0.0),
            "works: finite, matches the float64 reference with eps = 0",
            input="eps = 0",
            check=_check_matches_reference),
    Hostile("eps_zero_all_zero_row", lambda d, g: _edited(d, g, _set((2, 0.0)), eps=0.0),
            "NaN across the all-zero row (0 · 1/sqrt(0)), as F.rms_norm gives; other rows finite",
            input="eps = 0 and an all-zero row",
            check=_check_zero_row_nan),
    Hostile("default_eps_all_zero_row", lambda d, g: _edited(d, g, _set((2, 0.0))),
            "zeros in that row (eps keeps 1/rms finite); other rows match the reference",
            input="an all-zero row, eps None",
            check=_check_zero_row_zeros),
    Hostile("squares_overflow_float32", lambda d, g: _edited(d, g, lambda x: x.mul_(1e20)),
            "all zeros: the float32 sum of squares overflows to inf, so 1/rms = 0. F.rms_norm in float32 does the same; the float64 answer would be finite (a limit of float32 accumulation, not a crash)",
            input="float32 x of magnitude ~1e20",
            check=_check_overflow),
    Hostile("squares_underflow_eps_zero",
            lambda d, g: _edited(d, g, _set((0, 1e-30)), eps=0.0),
            "±Inf across that row: its squares underflow to 0, 1/rms = inf (F.rms_norm does the same)",
            input="a row of 1e-30, eps = 0",
            check=_check_underflow),
    Hostile("negative_eps", lambda d, g: _rms_base(d, g, eps=-1e-3),
            "`rms_norm: eps must be a finite number >= 0, got -0.001`",
            input="eps = -1e-3",
            raises=r"^rms_norm: eps must be a finite number >= 0"),
    Hostile("nan_eps", lambda d, g: _rms_base(d, g, eps=math.nan),
            "`rms_norm: eps must be a finite number >= 0, got nan`",
            input="eps = NaN",
            raises=r"^rms_norm: eps must be a finite number >= 0"),
    Hostile("inf_eps", lambda d, g: _rms_base(d, g, eps=math.inf),
            "`rms_norm: eps must be a finite number >= 0, got inf`",
            input="eps = Inf",
            raises=r"^rms_norm: eps must be a finite number >= 0"),
    Hostile("integer_x",
            lambda d, g: {"x": torch.randint(-5, 5, (4, 8), generator=g, dtype=torch.int32).to(d)},
            "`rms_norm: x must be float64, float32, float16 or bfloat16, got Int`",
            input="int32 x",
            raises=r"^rms_norm: x must be float64, float32, float16 or bfloat16, got Int"),
    Hostile("complex_x",
            lambda d, g: {"x": torch.randn(4, 8, generator=g, dtype=torch.complex64).to(d)},
            "`rms_norm: x must be float64, float32, float16 or bfloat16, got ComplexFloat`",
            input="complex64 x",
            raises=r"^rms_norm: x must be float64, float32, float16 or bfloat16"),
    Hostile("weight_dtype_differs", lambda d, g: _cast_weight(_rms_base(d, g), torch.float64),
            "`rms_norm: weight must have the dtype of x (Float), got Double`",
            input="float32 x, float64 weight",
            raises=r"^rms_norm: weight must have the dtype of x \(Float\), got Double"),
    Hostile("weight_wrong_shape", lambda d, g: {**_rms_base(d, g), "weight": torch.ones(38, device=d)},
            "`rms_norm: weight must have shape [37] (last dim of x), got [38]`",
            input="weight of 38 for x of width 37",
            raises=r"^rms_norm: weight must have shape \[37\]"),
    Hostile("zero_dim_x", lambda d, g: {"x": torch.tensor(1.5, device=d)},
            "`rms_norm: x must have at least 1 dimension, got a 0-dim tensor`",
            input="0-dim x",
            raises=r"^rms_norm: x must have at least 1 dimension"),
    Hostile("weight_on_cpu_x_on_cuda", lambda d, g: _move_weight(_rms_base("cuda", g), "cpu"),
            "`rms_norm: weight must be on the same device as x (cuda:0), got cpu`",
            input="weight on the CPU, x on CUDA",
            raises=r"^rms_norm: weight must be on the same device as x", cuda_only=True),
    Hostile("weight_on_cuda_x_on_cpu", lambda d, g: _move_weight(_rms_base("cpu", g), "cuda"),
            "`rms_norm: weight must be on the same device as x (cpu), got cuda:0`: the dispatcher picks the CUDA kernel for the CUDA weight, which refuses the host x",
            input="weight on CUDA, x on the CPU",
            raises=r"^rms_norm: weight must be on the same device as x", cuda_only=True),
)


# --- benchmark -----------------------------------------------------------------------

def _bench_inputs(rows, n, dtype, device):
    return {
        "x": torch.randn(rows, n, dtype=dtype, device=device),
        "w": (1 + 0.1 * torch.randn(n, device=device)).to(dtype),
        "dy": torch.randn(rows, n, dtype=dtype, device=device),
    }


def _llama_rms_norm(x, w, eps=1e-6):
    # Hugging Face LlamaRMSNorm.forward: upcast to float32, normalise, cast back, scale
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dtype)


def _liger_rms_norm_factory(n, dtype, device):
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    module = LigerRMSNorm(n, eps=1e-6).to(device=device, dtype=dtype)
    return lambda x, w: module(x)  # module holds its own weight, same shape


def _host_calls(device):
    x = torch.randn(4, 256, device=device, dtype=torch.bfloat16)
    w = torch.ones(256, device=device, dtype=torch.bfloat16)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    return {
        "opsmith.rms_norm": lambda: rms_norm(x, w, 1e-6),
        "opsmith.rms_norm (requires_grad)": lambda: rms_norm(xg, wg, 1e-6),
        "torch.ops.opsmith.rms_norm_fwd": lambda: torch.ops.opsmith.rms_norm_fwd(x, w, 1e-6),
        "opsmith.pybind.rms_norm": lambda: rms_norm_pybind(x, w, 1e-6),
        "opsmith.pybind.rms_norm (requires_grad)": lambda: rms_norm_pybind(xg, wg, 1e-6),
        "F.rms_norm": lambda: F.rms_norm(x, (256,), w, 1e-6),
        "F.rms_norm (requires_grad)": lambda: F.rms_norm(xg, (256,), wg, 1e-6),
    }


_BENCH = BenchSpec(
    make_inputs=_bench_inputs,
    grad_inputs=["x", "w"],
    providers={
        "opsmith": lambda n, dt, dev: lambda x, w: rms_norm(x, w, 1e-6),
        "opsmith_pybind": lambda n, dt, dev: lambda x, w: rms_norm_pybind(x, w, 1e-6),
        "torch_F": lambda n, dt, dev: lambda x, w: F.rms_norm(x, (n,), w, 1e-6),
        "torch_hf_llama": lambda n, dt, dev: _llama_rms_norm,
        "torch_compile_F": lambda n, dt, dev: compiled(
            ("F", n), lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6)),
        "torch_compile_hf_llama": lambda n, dt, dev: compiled(("hf", n), _llama_rms_norm),
        "liger": _liger_rms_norm_factory,
    },
    # forward: read x, w; write y. backward: read dy, x, w; write dx, dw.
    fwd_bytes=lambda rows, n, s: (2 * rows * n + n) * s,
    fwdbwd_bytes=lambda rows, n, s: (2 * rows * n + n) * s + (3 * rows * n + 2 * n) * s,
    hidden_sizes=[512, 1024, 2048, 4096, 8192, 16384, 32768, 65536],
    row_counts=[1, 16, 64, 1024, 4096, 16384, 65536, 262144],
    quick_shapes=[(4096, 4096), (16384, 4096), (4096, 8192), (65536, 1024), (2048, 32768),
                  (512, 65536), (16, 4096), (1, 8192)],
    host_calls=_host_calls,
)


# --- behaviour the generic harnesses check, as docs/reliability.md states it ----------------

_DOC_ROWS = (
    DocRow("zero rows: x of shape (0, n) or (3, 0, n)",
           "empty output and dx of x's shape; the weight gradient is zeros (an empty sum, not uninitialised memory)",
           "`test_zero_rows`"),
    DocRow("rows of width 0: x of shape (4, 0) or (2, 3, 0)",
           "empty output and gradients, as torch.nn.functional.rms_norm (inv_rms NaN: a mean over nothing)",
           "`test_zero_width`"),
    DocRow("one row: (1, 257), 1-D (257,), (1, 1)", "matches the reference, forward and backward", "`test_one_row`"),
    DocRow("prime widths 7, 13, 127, 8191", "matches the reference (the scalar tail of every loop runs)",
           "`test_prime_widths`"),
    DocRow("a row of 100003 elements", "matches the reference on CPU and CUDA", "`test_row_wider_than_any_tile`"),
    DocRow("transposed, sliced, every-other-row, expanded (stride-0 rows), storage-offset x and dy",
           "matches the reference; no NaN from the NaN padding the views skip over", "`test_layouts`"),
    DocRow("more than 2^31 elements: bf16 x of (2^21 + 3, 1024), CUDA with > 40 GB",
           "every row of y and dx and the whole weight gradient match a chunked float64 reference",
           "`test_more_than_2_31_elements`"),
    DocRow("values ~1e-4 and ~1e4, any dtype and layout", "match the reference (property test)",
           "`test_property_cpu`, `test_random_sweep_cuda`"),
)


SPEC = OpSpec(
    name="rms_norm",
    make_inputs=_rms_make_inputs,
    call=_rms_call,
    call_pybind=_rms_call_pybind,
    reference=_rms_reference,
    torch_equivalent=_rms_torch_equivalent,
    tolerance=_RMS_TOL.__getitem__,
    outputs=("y",),
    grad_inputs=("x", "weight"),
    row_inputs=("x",),
    opcheck=_rms_opcheck,
    # neither the C++ autograd node's backward nor route A's
    # (first_order_only) is differentiable
    double_backward=r"^rms_norm: double backward is not supported",
    double_backward_pybind=r"^opsmith\.pybind\.rms_norm: double backward is not supported",
    func_transforms={
        "grad": SUPPORTED,
        "vjp": SUPPORTED,
        "jvp": r"^rms_norm: forward-mode AD is not supported",
        "vmap": SUPPORTED,  # register_vmap in opsmith/ops/rms_norm.py
    },
    func_transforms_pybind=r"^opsmith\.pybind\.rms_norm: route A does not support torch\.func transforms",
    make_module=lambda n: RMSNorm(n),
    hostile=_RMS_HOSTILE,
    doc_rows=_DOC_ROWS,
    bench=_BENCH,
)
