"""Every operator the reliability harnesses (tests/test_reliability.py) run
over, one OpSpec each. A new operator joins all of them -- CUDA graphs,
streams, shapes and layouts, hostile inputs, property tests, determinism,
route A vs route B -- by appending one OpSpec to OPS.

Conventions an OpSpec follows, so the harnesses need no op-specific code:

* ``make_inputs(shape, dtype, device, generator)`` returns a dict of
  contiguous tensors; ``shape`` is the shape of the row inputs (``*, n``).
  It may also hold non-tensor arguments (such as ``eps``); hostile cases use
  that to pass them.
* The inputs named in ``row_inputs`` carry the rows in their leading
  dimensions; every other tensor input is shared by all rows (e.g. a
  weight of shape (n,)). The output has the shape of the row inputs, and row
  i of the output depends only on row i of the row inputs and on the shared
  inputs. The huge-tensor test relies on that to check a problem too large
  for one float64 reference chunk by chunk.
* ``reference`` is differentiable: the harnesses take float64 gradients of
  it with torch.autograd.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

import opsmith
import opsmith.nn
import opsmith.pybind

Inputs = Dict[str, Any]

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Hostile:
    """One hostile input: how to build it, and what the op must do with it.

    With ``raises`` set, every route must raise RuntimeError whose message
    matches it (re.search). Otherwise the op must return, with the same
    NaN/+Inf/-Inf pattern as ``OpSpec.torch_equivalent`` on the same input and
    its finite values close to it; ``check`` adds op-specific assertions.
    ``does`` is the one-line description docs/reliability.md repeats."""

    name: str
    make: Callable[[str, torch.Generator], Inputs]
    does: str
    raises: Optional[str] = None
    check: Optional[Callable[["OpSpec", Inputs, torch.Tensor], None]] = None
    cuda_only: bool = False  # needs a GPU beside the CPU (mixed-device cases)


@dataclass(frozen=True)
class OpSpec:
    name: str
    make_inputs: Callable[[Sequence[int], torch.dtype, Any, torch.Generator], Inputs]
    grad_inputs: Tuple[str, ...]
    row_inputs: Tuple[str, ...]
    call: Callable[[Inputs], torch.Tensor]  # route B (torch.library op)
    call_pybind: Callable[[Inputs], torch.Tensor]  # route A (pybind11 + autograd.Function)
    # float64 result from the inputs upcast to float64. `dtype` is the dtype
    # the op ran in, for defaults that depend on it, when the tensors passed
    # are already float64 copies.
    reference: Callable[..., torch.Tensor]
    # PyTorch's own op on the same values in float32 on the CPU: the NaN/Inf
    # behaviour hostile inputs must reproduce.
    torch_equivalent: Callable[[Inputs], torch.Tensor]
    # max|out - ref| <= tolerance(dtype) * max(1, max|ref|)
    tolerance: Callable[[torch.dtype], float]
    # gradients of shared inputs sum over rows: their rounding grows a little
    grad_slack: float = 4.0
    dtypes: Tuple[torch.dtype, ...] = DTYPES
    # the op as a module of width n (for the torch.compile training test)
    make_module: Optional[Callable[[int], torch.nn.Module]] = None
    hostile: Tuple[Hostile, ...] = field(default_factory=tuple)


def tensors(inputs: Inputs) -> Dict[str, torch.Tensor]:
    return {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}


# --- RMSNorm -----------------------------------------------------------------

_RMS_TOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def _randn(shape, generator, dtype, device):
    # Drawn in float32 on the generator's device, then rounded: every dtype
    # and device sees the same kind of values for one seed.
    v = torch.randn(tuple(shape), generator=generator, device=generator.device, dtype=torch.float32)
    return v.to(device=device, dtype=dtype)


def _rms_make_inputs(shape, dtype, device, generator):
    shape = tuple(shape)
    n = shape[-1]
    x = _randn(shape, generator, torch.float32, generator.device)
    if n == 1:
        # One element a row: dx = g*w*inv_rms*eps/(x^2+eps) is ~0 and found by
        # cancellation, with an absolute error ~u*inv_rms; |x| >= 0.5 bounds it.
        x = torch.where(x < 0, x - 0.5, x + 0.5)
    return {
        "x": x.to(device=device, dtype=dtype),
        "weight": _randn((n,), generator, dtype, device),
    }


def _rms_call(inputs):
    return opsmith.rms_norm(inputs["x"], inputs.get("weight"), inputs.get("eps"))


def _rms_call_pybind(inputs):
    return opsmith.pybind.rms_norm(inputs["x"], inputs.get("weight"), inputs.get("eps"))


def _rms_eps(inputs, dtype):
    eps = inputs.get("eps")
    # None means the eps of the op's dtype, like torch.nn.functional.rms_norm
    return torch.finfo(dtype or inputs["x"].dtype).eps if eps is None else eps


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
            check=_check_nan_row),
    Hostile("inf_in_x", lambda d, g: _edited(d, g, _set(((2, 3), math.inf), ((0, 0), -math.inf))),
            "in a row holding +-Inf, 1/rms = 0: the Inf element gives NaN (inf*0), the rest of the row 0",
            check=_check_inf_row),
    Hostile("nan_in_weight",
            lambda d, g: _edited(d, g, weight_edit=_set((7, math.nan))),
            "NaN in that column of every row; other columns finite",
            check=_check_nan_weight),
    Hostile("eps_zero_nonzero_rows", lambda d, g: _rms_base(d, g, eps=0.0),
            "works: finite, matches the float64 reference with eps = 0",
            check=_check_matches_reference),
    Hostile("eps_zero_all_zero_row", lambda d, g: _edited(d, g, _set((2, 0.0)), eps=0.0),
            "NaN across the all-zero row (0 * 1/sqrt(0)), like F.rms_norm; other rows finite",
            check=_check_zero_row_nan),
    Hostile("default_eps_all_zero_row", lambda d, g: _edited(d, g, _set((2, 0.0))),
            "zeros in that row (eps keeps 1/rms finite); other rows match the reference",
            check=_check_zero_row_zeros),
    Hostile("squares_overflow_float32", lambda d, g: _edited(d, g, lambda x: x.mul_(1e20)),
            "all zeros: the float32 sum of squares overflows to inf, 1/rms = 0 (F.rms_norm in float32 does the same)",
            check=_check_overflow),
    Hostile("squares_underflow_eps_zero",
            lambda d, g: _edited(d, g, _set((0, 1e-30)), eps=0.0),
            "+-Inf across that row: its squares underflow to 0, 1/rms = inf (F.rms_norm does the same)",
            check=_check_underflow),
    Hostile("negative_eps", lambda d, g: _rms_base(d, g, eps=-1e-3),
            "RuntimeError `rms_norm: eps must be a finite number >= 0, got -0.001`",
            raises=r"^rms_norm: eps must be a finite number >= 0"),
    Hostile("nan_eps", lambda d, g: _rms_base(d, g, eps=math.nan),
            "RuntimeError `rms_norm: eps must be a finite number >= 0, got nan`",
            raises=r"^rms_norm: eps must be a finite number >= 0"),
    Hostile("inf_eps", lambda d, g: _rms_base(d, g, eps=math.inf),
            "RuntimeError `rms_norm: eps must be a finite number >= 0, got inf`",
            raises=r"^rms_norm: eps must be a finite number >= 0"),
    Hostile("integer_x",
            lambda d, g: {"x": torch.randint(-5, 5, (4, 8), generator=g, dtype=torch.int32).to(d)},
            "RuntimeError `rms_norm: x must be float64, float32, float16 or bfloat16, got Int`",
            raises=r"^rms_norm: x must be float64, float32, float16 or bfloat16, got Int"),
    Hostile("complex_x",
            lambda d, g: {"x": torch.randn(4, 8, generator=g, dtype=torch.complex64).to(d)},
            "RuntimeError `rms_norm: x must be float64, float32, float16 or bfloat16, got ComplexFloat`",
            raises=r"^rms_norm: x must be float64, float32, float16 or bfloat16"),
    Hostile("weight_dtype_differs", lambda d, g: _cast_weight(_rms_base(d, g), torch.float64),
            "RuntimeError `rms_norm: weight must have the same dtype as x (Float), got Double`",
            raises=r"^rms_norm: weight must have the same dtype as x \(Float\), got Double"),
    Hostile("weight_wrong_shape", lambda d, g: {**_rms_base(d, g), "weight": torch.ones(38, device=d)},
            "RuntimeError `rms_norm: weight must have shape [37] (last dim of x), got [38]`",
            raises=r"^rms_norm: weight must have shape \[37\]"),
    Hostile("zero_dim_x", lambda d, g: {"x": torch.tensor(1.5, device=d)},
            "RuntimeError `rms_norm: x must have at least 1 dimension, got a 0-dim tensor`",
            raises=r"^rms_norm: x must have at least 1 dimension"),
    Hostile("empty_last_dim", lambda d, g: {"x": torch.empty(4, 0, device=d)},
            "RuntimeError `rms_norm: x must have a non-empty last dimension, got shape [4, 0]`",
            raises=r"^rms_norm: x must have a non-empty last dimension"),
    Hostile("weight_on_cpu_x_on_cuda", lambda d, g: _move_weight(_rms_base("cuda", g), "cpu"),
            "RuntimeError `rms_norm: weight must be on the same device as x (cuda:0), got cpu`",
            raises=r"^rms_norm: weight must be on the same device as x", cuda_only=True),
    Hostile("weight_on_cuda_x_on_cpu", lambda d, g: _move_weight(_rms_base("cpu", g), "cuda"),
            "RuntimeError `rms_norm: weight must be on the same device as x (cpu), got cuda:0`",
            raises=r"^rms_norm: weight must be on the same device as x", cuda_only=True),
)


RMS_NORM = OpSpec(
    name="rms_norm",
    make_inputs=_rms_make_inputs,
    grad_inputs=("x", "weight"),
    row_inputs=("x",),
    call=_rms_call,
    call_pybind=_rms_call_pybind,
    reference=_rms_reference,
    torch_equivalent=_rms_torch_equivalent,
    tolerance=_RMS_TOL.__getitem__,
    make_module=lambda n: opsmith.nn.RMSNorm(n),
    hostile=_RMS_HOSTILE,
)

OPS = [RMS_NORM]
