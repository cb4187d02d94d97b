"""Residual add fused with RMSNorm, as pre-norm transformer blocks use it:
``h = x + residual; y = rms_norm(h, weight)`` in one pass, returning (y, h).
The functional API (route B, autograd in C++), its in-place inference form,
the fake kernels and vmap rules of the dispatcher ops, the route A
autograd.Function, and the nn module. The dispatcher imports this module for
the fake kernels when the library is loaded on its own."""
from typing import Optional, Tuple

import torch

from . import check_param, Module, register_fake
from .. import _library  # noqa: F401  (loads the library: torch.ops.opsmith.* exists after this)
from . import _vmap
from .rms_norm import CASTING_MODES, _accumulate_dtype, _default_out_dtype

_fwd = torch.ops.opsmith.fused_add_rms_norm_fwd.default
_bwd = torch.ops.opsmith.fused_add_rms_norm_bwd.default
_inplace = torch.ops.opsmith.fused_add_rms_norm_.default


def _check_mode(casting_mode, who="fused_add_rms_norm"):
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"{who}: casting_mode must be 'none', 'llama' or 'gemma', got {casting_mode!r}")


def _check_call(casting_mode, weight, who="fused_add_rms_norm"):
    _check_mode(casting_mode, who)
    check_param(who, optional=False, weight=weight)


_NAMES = {torch.float64: "Double", torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16"}


def _promoted(x, residual, weight, inplace=False):
    """x and residual in the dtype of ``x + residual``. A float32 residual
    stream beside a 16-bit sublayer output (autocast) adds to float32, as the
    unfused add does; the lower one is converted (one copy, differentiable).
    The in-place form writes h over residual, so only x may be converted."""
    if not (isinstance(x, torch.Tensor) and isinstance(residual, torch.Tensor)) or x.dtype == residual.dtype:
        return x, residual
    if x.dtype not in _NAMES or residual.dtype not in _NAMES:
        return x, residual  # the op names the bad dtype
    who = "fused_add_rms_norm_" if inplace else "fused_add_rms_norm"
    dt = torch.promote_types(x.dtype, residual.dtype)
    if inplace and residual.dtype != dt:
        raise RuntimeError(f"{who}: residual must hold h = x + residual, which is {dt} "
                           f"(x {x.dtype}, residual {residual.dtype}); pass residual as {dt}, or use "
                           "fused_add_rms_norm")
    half = dt in (torch.float16, torch.bfloat16)
    if isinstance(weight, torch.Tensor) and not (weight.dtype == dt or (half and weight.dtype == torch.float32)):
        # the op would name h's dtype as x's, which is not the x passed here
        raise RuntimeError(f"{who}: weight must have the dtype of x + residual ({_NAMES[dt]})"
                           f"{' or float32' if half else ''}, got {_NAMES.get(weight.dtype, weight.dtype)}")
    return x.to(dt), residual.to(dt)


# --- route B: the functional API -------------------------------------------------

def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                       offset: float = 0.0, casting_mode: str = "none",
                       out_dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` then ``y = opsmith.rms_norm(h, weight, eps, offset=..., casting_mode=...)``,
    in one pass; returns ``(y, h)``.

    x and residual have one shape; h has the dtype of ``x + residual`` (rounded
    once, as that add gives: a bfloat16 x beside a float32 residual, as under
    autocast, gives a float32 h, the lower one converted first), y
    rms_norm's output dtype (h's; with
    ``casting_mode="llama"`` and a float32 weight, float32). weight is x's
    dtype or float32 with 16-bit x. The backward takes the gradients of y and
    h (either may be absent) and gives x and residual the same gradient,
    ``rms_norm_backward(dy; h) + dh``, and the weight its own (skipped for a
    weight that gets no gradient: frozen, or not asked for). Double backward
    and forward-mode AD raise."""
    _check_call(casting_mode, weight)
    x, residual = _promoted(x, residual, weight)
    if out_dtype is None:
        out_dtype = _default_out_dtype(x, weight, casting_mode)
    y, h, _ = _fwd(x, residual, weight, eps, offset, casting_mode, out_dtype)
    return y, h


def fused_add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                        offset: float = 0.0, casting_mode: str = "none",
                        out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The in-place inference form of :func:`fused_add_rms_norm`, as inference
    engines use it: h is written over ``residual`` (which must have rows
    addressable in place) and y is returned. No autograd: with grad mode on
    and an input that requires grad it raises (use it under
    ``torch.no_grad()`` or ``torch.inference_mode()``). x is converted to
    residual's dtype where that is ``x + residual``'s; otherwise it raises."""
    _check_call(casting_mode, weight, "fused_add_rms_norm_")
    x, residual = _promoted(x, residual, weight, inplace=True)
    if out_dtype is None:
        out_dtype = _default_out_dtype(x, weight, casting_mode)
    return _inplace(x, residual, weight, eps, offset, casting_mode, out_dtype)


def _check_fake(x, residual, weight):
    torch._check(x.dim() >= 1, lambda: "fused_add_rms_norm: x must have at least 1 dimension")
    torch._check(residual.shape == x.shape, lambda: (f"fused_add_rms_norm: residual must have the shape of x "
                                                     f"{list(x.shape)}, got {list(residual.shape)}"))
    torch._check(weight.shape == x.shape[-1:],
                 lambda: f"fused_add_rms_norm: weight must have shape {list(x.shape[-1:])}, got {list(weight.shape)}")


@register_fake("opsmith::fused_add_rms_norm_fwd")
def _fwd_fake(x, residual, weight, eps=1e-6, offset=0.0, casting_mode="none", out_dtype=None):
    _check_fake(x, residual, weight)
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    inv_rms = torch.empty(x.shape[:-1], dtype=_accumulate_dtype(x.dtype), device=x.device)
    return y, h, inv_rms


@register_fake("opsmith::fused_add_rms_norm_bwd")
def _bwd_fake(dy, dh, h, weight, inv_rms, offset=0.0, casting_mode="none", weight_grad=True):
    # dweight has shape [0] when its gradient is not asked for
    return (torch.empty(h.shape, dtype=h.dtype, device=h.device),
            torch.empty((h.shape[-1] if weight_grad else 0,), dtype=weight.dtype, device=h.device))


@register_fake("opsmith::fused_add_rms_norm_")
def _inplace_fake(x, residual, weight, eps=1e-6, offset=0.0, casting_mode="none", out_dtype=None):
    _check_fake(x, residual, weight)
    return torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)


# --- vmap rules --------------------------------------------------------------------
# Row-local, as rms_norm: a batch dim of the row tensors is more rows, so an
# unbatched weight makes one call; a batched weight, or the backward of a
# weight that needs its gradient (a per-example sum over rows), loops over
# the batch.


@torch.library.register_vmap("opsmith::fused_add_rms_norm_fwd")
def _fwd_vmap(info, in_dims, x, residual, weight, eps=1e-6, offset=0.0, casting_mode="none", out_dtype=None):
    x_bdim, r_bdim, w_bdim = in_dims[:3]
    torch._check(x.dim() >= 2 if x_bdim is not None else True,
                 lambda: "fused_add_rms_norm: x must have at least 1 dimension, got a 0-dim tensor")

    def op(a, b, c):
        return _fwd(a, b, c, eps, offset, casting_mode, out_dtype)

    b = info.batch_size
    if w_bdim is None:
        out = op(_vmap.to_front(x, x_bdim, b), _vmap.to_front(residual, r_bdim, b), weight)
    else:
        out = _vmap.loop(b, (x_bdim, r_bdim, w_bdim), op, (x, residual, weight))
    return tuple(out), (0, 0, 0)


@torch.library.register_vmap("opsmith::fused_add_rms_norm_bwd")
def _bwd_vmap(info, in_dims, dy, dh, h, weight, inv_rms, offset=0.0, casting_mode="none", weight_grad=True):
    b = info.batch_size
    if not weight_grad and in_dims[3] is None:
        args = [_vmap.to_front(t, d, b) for t, d in zip((dy, dh, h, inv_rms), in_dims[:3] + in_dims[4:5])]
        dx, dweight = _bwd(args[0], args[1], args[2], weight, args[3], offset, casting_mode, False)
        return (dx, dweight), (0, None)
    out = _vmap.loop(b, in_dims[:5],
                     lambda a, c, d, e, f: _bwd(a, c, d, e, f, offset, casting_mode, weight_grad),
                     (dy, dh, h, weight, inv_rms))
    return out, (0, 0)


# --- route A: pybind11 + torch.autograd.Function -------------------------------------

# --- tensor parallelism: DTensor sharding rules ------------------------------------
# fused_add_rms_norm_fwd(x, residual, weight, ...) -> (y, h, inv_rms);
# fused_add_rms_norm_bwd(dy, dh, h, weight, inv_rms, ...) -> (dx, dweight).
# The in-place form is an inference op: it has no rule, so a DTensor there
# fails in DTensor's dispatch with the op's name.
from .. import _sharding  # noqa: E402

_sharding.row_local(_fwd, _bwd, fwd_tensor_args=3, fwd_outputs=3, fwd_row_args=2,
                    bwd_row_args=(0, 1, 2, 4), bwd_param_args=(3,), bwd_outputs_row=1, bwd_outputs_param=1)


from . import first_order_only, pybind_double_backward_error, route_a as _pybind

PYBIND_DOUBLE_BACKWARD_ERROR = pybind_double_backward_error(
    "fused_add_rms_norm", "x + residual and torch.nn.functional.rms_norm")


class FusedAddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps=1e-6, offset=0.0, casting_mode="none", out_dtype=None):
        y, h, inv_rms = _pybind().fused_add_rms_norm_fwd(x, residual, weight, eps, offset, casting_mode, out_dtype)
        ctx.save_for_backward(h, weight, inv_rms)
        ctx.options = (offset, casting_mode)
        return y, h

    @staticmethod
    @first_order_only(PYBIND_DOUBLE_BACKWARD_ERROR)
    def backward(ctx, dy, dh):
        h, weight, inv_rms = ctx.saved_tensors
        if dy is None and dh is None:
            return None, None, None, None, None, None, None
        weight_grad = ctx.needs_input_grad[2]
        if dy is None:
            dx, dweight = dh, None
        else:
            dx, dweight = _pybind().fused_add_rms_norm_bwd(dy, dh, h, weight, inv_rms, *ctx.options, weight_grad)
            if not weight_grad:
                dweight = None
        # the same gradient for x and residual (autograd copies before accumulating into a leaf)
        return dx, dx, dweight, None, None, None, None


PYBIND_TRANSFORM_ERROR = ("opsmith.pybind.fused_add_rms_norm: route A does not support torch.func transforms "
                          "(grad, vjp, jvp, vmap); use opsmith.fused_add_rms_norm")


def fused_add_rms_norm_pybind(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                              offset: float = 0.0, casting_mode: str = "none",
                              out_dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Route A twin of opsmith.fused_add_rms_norm (opsmith.pybind.fused_add_rms_norm):
    same bits. First-order gradients only; not under torch.func transforms."""
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(PYBIND_TRANSFORM_ERROR)
    _check_call(casting_mode, weight)
    x, residual = _promoted(x, residual, weight)
    if out_dtype is None:
        out_dtype = _default_out_dtype(x, weight, casting_mode)
    return FusedAddRMSNormFunction.apply(x, residual, weight, eps, offset, casting_mode, out_dtype)


def fused_add_rms_norm_pybind_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                               offset: float = 0.0, casting_mode: str = "none",
                               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Route A twin of opsmith.fused_add_rms_norm_ (h over residual, y returned)."""
    _check_call(casting_mode, weight, "fused_add_rms_norm_")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, residual, weight)):
        raise RuntimeError("fused_add_rms_norm_: the in-place form has no autograd; call it under torch.no_grad() "
                           "or torch.inference_mode(), or use opsmith.fused_add_rms_norm for training")
    x, residual = _promoted(x, residual, weight, inplace=True)
    if out_dtype is None:
        out_dtype = _default_out_dtype(x, weight, casting_mode)
    y = _pybind().fused_add_rms_norm_(x, residual, weight, eps, offset, casting_mode, out_dtype)
    if not torch.is_inference(residual):
        torch.autograd.graph.increment_version(residual)  # the C++ write went around autograd's counter
    return y


# --- the nn module ---------------------------------------------------------------------

class FusedAddRMSNorm(Module):
    """``forward(x, residual) -> (y, h)`` with ``h = x + residual`` and
    ``y = RMSNorm(h)``: the add and norm of a pre-norm transformer block in
    one pass (``residual = h`` for the next block). One parameter, ``weight``
    (state-dict key ``weight``, as Hugging Face's RMSNorm modules), starting
    so that offset + weight = 1. ``casting_mode`` and ``offset`` as
    opsmith.nn.RMSNorm (``"llama"``; ``offset=1.0, casting_mode="gemma"``)."""

    __constants__ = ["hidden_size", "eps", "offset", "casting_mode"]

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, offset: float = 0.0, casting_mode: str = "none",
                 device=None, dtype=None) -> None:
        super().__init__()
        _check_mode(casting_mode, "FusedAddRMSNorm")
        self.hidden_size = int(hidden_size)
        self.eps = float(eps)
        self.offset = float(offset)
        self.casting_mode = casting_mode
        self.weight = torch.nn.Parameter(torch.empty(self.hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.constant_(self.weight, 1.0 - self.offset)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if x.shape[-1:] != (self.hidden_size,):
            raise RuntimeError(f"FusedAddRMSNorm: expected input with shape [*, {self.hidden_size}], "
                               f"got {list(x.shape)}")
        return fused_add_rms_norm(x, residual, self.weight, self.eps, offset=self.offset,
                                  casting_mode=self.casting_mode)

    def extra_repr(self) -> str:
        s = f"{self.hidden_size}, eps={self.eps}"
        if self.offset:
            s += f", offset={self.offset}"
        if self.casting_mode != "none":
            s += f", casting_mode={self.casting_mode!r}"
        return s


# --- what this op adds to opsmith, opsmith.nn and opsmith.pybind -------------------------
FUNCTIONS = {"fused_add_rms_norm": fused_add_rms_norm, "fused_add_rms_norm_": fused_add_rms_norm_}
MODULES = {"FusedAddRMSNorm": FusedAddRMSNorm}
PYBIND = {"fused_add_rms_norm": fused_add_rms_norm_pybind, "fused_add_rms_norm_": fused_add_rms_norm_pybind_,
          "FusedAddRMSNormFunction": FusedAddRMSNormFunction}
