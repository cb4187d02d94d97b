"""Test-only ops (namespace opsmith_test), one of each kind of op the spec
must describe beyond a single-output row op, each with its OpSpec so it runs
through the same harnesses as opsmith's own ops:

* row_center: several outputs (y = (x - mean) * w, and the row mean), both
  differentiable, each with its own upstream gradient;
* scale_: in-place mutation of an input (schema ``Tensor(a!) x``);
* pick_nll: an integer target (int64, [0, n) or ignore_index, not
  differentiable), one loss per row;
* multi_axpy_: tensor lists of mixed sizes, the first list updated in place
  (the shape of a multi-tensor optimizer step).

They are plain PyTorch (torch.library.custom_op, CPU and CUDA): they exist only
to show that the spec and the harnesses handle each kind."""
import math
from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from opsmith.specs import SUPPORTED, Hostile, IndexInput, OpSpec, Skip, randn

_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
_DEVICES = ("cpu", "cuda")
# torch.func.grad/vjp over a custom_op's register_autograd formula
_CUSTOM_OP_FUNC_ERROR = r"In order to use an autograd.Function with functorch transforms"
# a custom_op without a jvp rule gives zero tangents under torch.func.jvp,
# silently (torch 2.11): neither a supported transform nor a clear error
_JVP_SKIP = Skip("torch.library.custom_op without a jvp rule returns zero tangents silently")


def _acc(t):
    return t.double() if t.dtype == torch.float64 else t.float()


def _edited(spec_make, device, gen, edit, shape=(4, 37), dtype=torch.float32):
    inputs = spec_make(shape, dtype, "cpu", gen)
    edit(inputs)
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else
                [t.to(device) for t in v] if isinstance(v, list) else v) for k, v in inputs.items()}


# =============================================================================
# (a) several outputs: row_center(x, w) -> (y, mean)
# =============================================================================

@torch.library.custom_op("opsmith_test::row_center", mutates_args=(), device_types=_DEVICES)
def row_center(x: Tensor, w: Tensor) -> Tuple[Tensor, Tensor]:
    torch._check(w.shape == x.shape[-1:], lambda: f"row_center: w must have shape {list(x.shape[-1:])}, got {list(w.shape)}")
    xa = _acc(x)
    m = xa.mean(-1)
    return ((xa - m.unsqueeze(-1)) * _acc(w)).to(x.dtype), m.to(x.dtype)


@row_center.register_fake
def _(x, w):
    torch._check(w.shape == x.shape[-1:], lambda: f"row_center: w must have shape {list(x.shape[-1:])}")
    return torch.empty_like(x), x.new_empty(x.shape[:-1])


def _row_center_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _row_center_backward(ctx, gy, gm):
    x, w = ctx.saved_tensors
    n = x.shape[-1]
    xa, wa = _acc(x), _acc(w)
    gyw = _acc(gy) * wa
    dx = gyw - gyw.mean(-1, keepdim=True) + (_acc(gm) / n).unsqueeze(-1)
    t = _acc(gy) * (xa - xa.mean(-1, keepdim=True))
    dw = (t.flatten(0, -2) if t.dim() > 1 else t[None]).sum(0)  # no guard on the row count, and width 0 works
    return dx.to(x.dtype), dw.to(w.dtype)


row_center.register_autograd(_row_center_backward, setup_context=_row_center_setup)


def _rc_make(shape, dtype, device, gen):
    return {"x": randn(shape, gen, dtype, device), "w": randn(shape[-1:], gen, dtype, device)}


def _rc_reference(inputs, dtype=None):
    x, w = inputs["x"], inputs["w"]
    m = x.mean(-1)
    return (x - m.unsqueeze(-1)) * w, m


def _rc_torch(inputs):
    x, w = inputs["x"].detach().cpu().float(), inputs["w"].detach().cpu().float()
    m = x.mean(-1)
    return (x - m.unsqueeze(-1)) * w, m


def _rc_nan_row(spec, inputs, out):
    y, m = out
    assert torch.isnan(y[1].cpu()).all() and torch.isnan(m[1].cpu()), "a NaN poisons its row and its mean"


ROW_CENTER = OpSpec(
    name="row_center",
    max_scale=1.0,  # x - mean(x) and its products grow with x: float16 overflows at 1e4
    make_inputs=_rc_make,
    call=lambda i: torch.ops.opsmith_test.row_center(i["x"], i["w"]),
    reference=_rc_reference,
    torch_equivalent=_rc_torch,
    tolerance=_TOL.__getitem__,
    outputs=("y", "mean"),
    grad_inputs=("x", "w"),
    row_inputs=("x",),
    opcheck=lambda i: [(torch.ops.opsmith_test.row_center.default, (i["x"], i["w"]))],
    double_backward=SUPPORTED,
    func_transforms={"grad": _CUSTOM_OP_FUNC_ERROR, "vjp": _CUSTOM_OP_FUNC_ERROR,
                     "jvp": _JVP_SKIP, "vmap": SUPPORTED},
    hostile=(
        Hostile("nan_in_x", lambda d, g: _edited(_rc_make, d, g, lambda i: i["x"].__setitem__((1, 5), math.nan)),
                "NaN across row 1 of y and in its mean", check=_rc_nan_row),
        Hostile("w_wrong_shape", lambda d, g: {**_rc_make((4, 37), torch.float32, d, g), "w": torch.ones(38, device=d)},
                "RuntimeError", raises=r"^row_center: w must have shape \[37\], got \[38\]"),
    ),
    native=False,
)


# =============================================================================
# (b) in-place: scale_(Tensor(a!) x, Tensor w) -> ()
# =============================================================================

@torch.library.custom_op("opsmith_test::scale_", mutates_args=("x",), device_types=_DEVICES)
def scale_(x: Tensor, w: Tensor) -> None:
    x.copy_(_acc(x) * _acc(w))


@scale_.register_fake
def _(x, w):
    return None


def _scale_call(inputs):
    torch.ops.opsmith_test.scale_(inputs["x"], inputs["w"])
    return inputs["x"]


SCALE_ = OpSpec(
    name="scale_",
    max_scale=1.0,  # x * w grows with x: float16 overflows at 1e4
    make_inputs=_rc_make,
    call=_scale_call,
    reference=lambda i, dtype=None: i["x"] * i["w"],
    torch_equivalent=lambda i: i["x"].detach().cpu().float() * i["w"].detach().cpu().float(),
    tolerance=_TOL.__getitem__,
    outputs=("x",),
    row_inputs=("x",),
    mutated_inputs=("x",),
    opcheck=lambda i: [(torch.ops.opsmith_test.scale_.default, (i["x"], i["w"]))],
    double_backward=None,
    func_transforms={"vmap": r"Batching rule not implemented for opsmith_test::scale_"},
    hostile=(
        Hostile("nan_in_w", lambda d, g: _edited(_rc_make, d, g, lambda i: i["w"].__setitem__(7, math.nan)),
                "NaN in that column of every row"),
        Hostile("expanded_x", lambda d, g: {**_rc_make((4, 37), torch.float32, d, g),
                                            "x": torch.ones(1, 37, device=d).expand(4, 37)},
                "RuntimeError: an in-place write to overlapping memory is refused",
                raises=r"more than one element of the written-to tensor refers to a single memory location"),
    ),
    native=False,
)


# =============================================================================
# (c) integer targets: pick_nll(x, target, ignore_index) -> loss per row
# =============================================================================

IGNORE_INDEX = -100


@torch.library.custom_op("opsmith_test::pick_nll", mutates_args=(), device_types=_DEVICES)
def pick_nll(x: Tensor, target: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    # loss[r] = -x[r, target[r]]; 0 where target == ignore_index; NaN where the
    # target is out of range (no host sync: a kernel could not raise either)
    torch._check(target.dtype == torch.int64, lambda: f"pick_nll: target must be int64, got {target.dtype}")
    n = x.shape[-1]
    ignored = target == ignore_index
    valid = (target >= 0) & (target < n)
    picked = _acc(x).gather(-1, target.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1)
    loss = torch.where(ignored, torch.zeros_like(picked), torch.where(valid, -picked, math.nan))
    return loss.to(x.dtype)


@pick_nll.register_fake
def _(x, target, ignore_index=IGNORE_INDEX):
    torch._check(target.dtype == torch.int64, lambda: "pick_nll: target must be int64")
    return x.new_empty(x.shape[:-1])


def _pick_setup(ctx, inputs, output):
    x, target, ignore_index = inputs
    ctx.save_for_backward(target)
    ctx.shape, ctx.dtype, ctx.ignore_index = x.shape, x.dtype, ignore_index


def _pick_backward(ctx, gloss):
    (target,) = ctx.saved_tensors
    n = ctx.shape[-1]
    keep = (target != ctx.ignore_index) & (target >= 0) & (target < n)
    g = torch.where(keep, -_acc(gloss), 0.0)
    dx = torch.zeros(ctx.shape, dtype=g.dtype, device=g.device)
    dx.scatter_(-1, target.clamp(0, n - 1).unsqueeze(-1), g.unsqueeze(-1))
    return dx.to(ctx.dtype), None, None


pick_nll.register_autograd(_pick_backward, setup_context=_pick_setup)


def _pick_make(shape, dtype, device, gen):
    n = shape[-1]
    x = randn(shape, gen, dtype, device)
    target = torch.randint(0, n, tuple(shape[:-1]), generator=gen, device=gen.device)
    # about one row in four ignored
    ignore = torch.rand(tuple(shape[:-1]), generator=gen, device=gen.device) < 0.25
    target = torch.where(ignore, IGNORE_INDEX, target).to(device)
    return {"x": x, "target": target, "ignore_index": IGNORE_INDEX}


def _pick_reference(inputs, dtype=None):
    x, t, ii = inputs["x"], inputs["target"], inputs["ignore_index"]
    n = x.shape[-1]
    safe = t.clamp(0, n - 1)
    picked = x.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    valid = (t >= 0) & (t < n)
    return torch.where(t == ii, torch.zeros_like(picked), torch.where(valid, -picked, math.nan))


def _pick_torch(inputs):
    # F.nll_loss (reduction none); its CPU kernel raises on an out-of-range
    # target where the op gives NaN
    x = inputs["x"].detach().cpu().float()
    t = inputs["target"].cpu()
    n = x.shape[-1]
    valid = (t >= 0) & (t < n) | (t == inputs["ignore_index"])
    safe = torch.where(valid, t, inputs["ignore_index"])
    loss = F.nll_loss(x.reshape(-1, n), safe.reshape(-1), reduction="none",
                      ignore_index=inputs["ignore_index"]).reshape(t.shape)
    return torch.where(valid, loss, math.nan)


def _set_target(values):
    def edit(inputs):
        for r, v in values.items():
            inputs["target"][r] = v
    return edit


def _pick_out_of_range(spec, inputs, out):
    o = out.cpu()
    assert torch.isnan(o[1]) and torch.isnan(o[2]), "out-of-range targets give NaN"
    assert torch.isfinite(o[0]) and torch.isfinite(o[3]), "other rows stay finite"


PICK_NLL = OpSpec(
    name="pick_nll",
    make_inputs=_pick_make,
    call=lambda i: torch.ops.opsmith_test.pick_nll(i["x"], i["target"], i["ignore_index"]),
    reference=_pick_reference,
    torch_equivalent=_pick_torch,
    tolerance=_TOL.__getitem__,
    outputs=("loss",),
    grad_inputs=("x",),
    row_inputs=("x", "target"),
    zero_width=False,  # a row needs its classes
    index_inputs=(IndexInput("target", high=lambda i: i["x"].shape[-1], ignore_index=IGNORE_INDEX),),
    opcheck=lambda i: [(torch.ops.opsmith_test.pick_nll.default, (i["x"], i["target"], i["ignore_index"]))],
    double_backward=SUPPORTED,
    func_transforms={"grad": _CUSTOM_OP_FUNC_ERROR, "vjp": _CUSTOM_OP_FUNC_ERROR, "jvp": _JVP_SKIP,
                     "vmap": SUPPORTED},
    hostile=(
        Hostile("target_out_of_range", lambda d, g: _edited(_pick_make, d, g, _set_target({0: 3, 1: 37, 2: -1, 3: 0})),
                "NaN loss in the rows whose target is out of range; other rows finite", check=_pick_out_of_range),
        Hostile("all_ignored", lambda d, g: _edited(_pick_make, d, g, lambda i: i["target"].fill_(IGNORE_INDEX)),
                "zeros"),
        Hostile("float_target", lambda d, g: {**_pick_make((4, 37), torch.float32, d, g),
                                              "target": torch.zeros(4, device=d)},
                "RuntimeError", raises=r"^pick_nll: target must be int64, got torch.float32"),
    ),
    native=False,
)


# =============================================================================
# (d) tensor lists: multi_axpy_(Tensor(a!)[] ys, Tensor[] xs, float alpha) -> ()
# =============================================================================

@torch.library.custom_op("opsmith_test::multi_axpy_", mutates_args=("ys",), device_types=_DEVICES)
def multi_axpy_(ys: List[Tensor], xs: List[Tensor], alpha: float) -> None:
    torch._check(len(ys) == len(xs), lambda: f"multi_axpy_: ys and xs must have the same length, got {len(ys)} and {len(xs)}")
    for i, (y, x) in enumerate(zip(ys, xs)):
        torch._check(y.shape == x.shape, lambda: f"multi_axpy_: ys[{i}] and xs[{i}] must have the same shape")
        y.copy_(_acc(y) + alpha * _acc(x))


@multi_axpy_.register_fake
def _(ys, xs, alpha):
    torch._check(len(ys) == len(xs), lambda: "multi_axpy_: ys and xs must have the same length")
    return None


def _list_shapes(shape):
    # mixed sizes from the harness's shape: itself, a vector, an odd 2-D, a scalar
    n = shape[-1]
    return [tuple(shape), (n + 3,), (3, max(1, n // 2) + 1), ()]


def _axpy_make(shape, dtype, device, gen):
    shapes = _list_shapes(shape)
    return {"ys": [randn(s, gen, dtype, device) for s in shapes],
            "xs": [randn(s, gen, dtype, device) for s in shapes],
            "alpha": 0.75}


def _axpy_call(inputs):
    torch.ops.opsmith_test.multi_axpy_(inputs["ys"], inputs["xs"], inputs["alpha"])
    return inputs["ys"]


def _axpy_torch(inputs):
    ys = [y.detach().cpu().float().clone() for y in inputs["ys"]]
    torch._foreach_add_(ys, [x.detach().cpu().float() for x in inputs["xs"]], alpha=inputs["alpha"])
    return ys


def _axpy_nan(spec, inputs, out):
    assert torch.isnan(out[1][2].cpu()) and torch.isfinite(out[0].cpu()).all(), "a NaN stays in its tensor"


MULTI_AXPY_ = OpSpec(
    name="multi_axpy_",
    make_inputs=_axpy_make,
    call=_axpy_call,
    reference=lambda i, dtype=None: [y + i["alpha"] * x for y, x in zip(i["ys"], i["xs"])],
    torch_equivalent=_axpy_torch,
    tolerance=_TOL.__getitem__,
    outputs=("ys",),
    mutated_inputs=("ys",),
    list_inputs=("ys", "xs"),
    opcheck=lambda i: [(torch.ops.opsmith_test.multi_axpy_.default, (i["ys"], i["xs"], i["alpha"]))],
    double_backward=None,
    func_transforms={"vmap": r"Batching rule not implemented for opsmith_test::multi_axpy_"},
    # y + alpha x rounds with the inputs' magnitude, not the result's: at 1e4 a
    # result near 0 (cancellation) carries an error the result-relative tolerance refuses
    max_scale=1.0,
    hostile=(
        Hostile("nan_in_xs", lambda d, g: _edited(_axpy_make, d, g, lambda i: i["xs"][1].__setitem__(2, math.nan)),
                "NaN in that element of that tensor only", check=_axpy_nan),
        Hostile("length_mismatch", lambda d, g: {**_axpy_make((4, 37), torch.float32, d, g),
                                                 "xs": [torch.ones(4, 37, device=d)]},
                "RuntimeError", raises=r"^multi_axpy_: ys and xs must have the same length, got 4 and 1"),
        Hostile("shape_mismatch", lambda d, g: _edited(_axpy_make, d, g, lambda i: i["xs"].__setitem__(2, torch.ones(5))),
                "RuntimeError", raises=r"^multi_axpy_: ys\[2\] and xs\[2\] must have the same shape"),
    ),
    native=False,
)

SPECS = [ROW_CENTER, SCALE_, PICK_NLL, MULTI_AXPY_]
