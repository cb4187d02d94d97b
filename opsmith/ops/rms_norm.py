"""RMSNorm in Python: the functional API (route B), the fake kernels and vmap
rules of its two dispatcher ops, the route A autograd.Function, and the nn
module. The dispatcher imports this module for the fake kernels when the
library is loaded on its own (m.set_python_module in csrc/torch)."""
import numbers
from typing import Optional, Tuple, Union

import torch

from . import check_param, Module, register_fake
from .. import _library, _sharding  # noqa: F401  (loads the library: torch.ops.opsmith.* exists after this)
from . import _vmap

# the overloads themselves: calling them skips the packet's overload lookup
_rms_norm_fwd = torch.ops.opsmith.rms_norm_fwd.default
_rms_norm_bwd = torch.ops.opsmith.rms_norm_bwd.default


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --- route B: the functional API -------------------------------------------------

CASTING_MODES = ("none", "llama", "gemma")


def _default_out_dtype(x, weight, casting_mode):
    # LlamaRMSNorm returns weight * x_hat.to(x.dtype): the promoted dtype
    # (float32 for a float32 weight); every other mode returns x's dtype, as
    # torch.nn.functional.rms_norm and GemmaRMSNorm do
    if casting_mode == "llama" and weight is not None:
        return torch.promote_types(x.dtype, weight.dtype)
    return None


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: Optional[float] = None, *,
             offset: float = 0.0, casting_mode: str = "none", out_dtype: Optional[torch.dtype] = None,
             inplace_backward: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension of x:
    ``x / sqrt(mean(x**2, -1) + eps) * (offset + weight)``.

    With the defaults, the result of
    ``torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)``; eps None
    means the epsilon of the type the sums run in, as PyTorch computes it:
    ``torch.finfo(torch.float32).eps`` for float32, float16 and bfloat16 x,
    float64's for float64 x. Sums run in float32 (float64 for float64 x).

    - weight: x's dtype, or float32 with float16/bfloat16 x (norm weights kept
      in float32 under mixed precision).
    - offset: Gemma's ``(1 + weight)`` is ``offset=1.0``; needs a weight.
    - casting_mode: ``"llama"`` rounds x_hat to x's dtype before the weight
      multiply and returns the promoted dtype, as Hugging Face's
      ``LlamaRMSNorm``; ``"gemma"`` computes in float32 and returns x's dtype,
      as ``GemmaRMSNorm``; ``"none"``: one rounding, x's dtype.
    - out_dtype: overrides the output dtype (x's dtype, or float32 for 16-bit
      x with a float32 weight or none).
    - inplace_backward: the backward writes dx over the incoming gradient
      (saves a tensor of x's size) when nothing else holds that gradient or
      its memory; one autograd shares with another reader (a residual
      ``y + x`` passes one tensor to both sides, a view of y shares its
      storage, ``y.backward(g)`` leaves g with the caller; one Python has
      seen, through a hook on y or an autograd.Function's backward, counts as
      held) is left as it is and dx gets memory of its own.

    Autograd is registered in C++ (csrc/torch): first-order gradients,
    torch.func.grad and vjp; double backward and forward-mode AD raise. A
    weight that gets no gradient (frozen, as in LoRA fine-tuning, or not
    asked for by ``torch.autograd.grad``) costs no column sums in the
    backward."""
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"rms_norm: casting_mode must be 'none', 'llama' or 'gemma', got {casting_mode!r}")
    check_param("rms_norm", weight=weight)
    if out_dtype is None:
        out_dtype = _default_out_dtype(x, weight, casting_mode)
    return _rms_norm_fwd(x, weight, eps, offset, casting_mode, out_dtype, inplace_backward)[0]


def _check_fake(x, weight):
    torch._check(x.dim() >= 1, lambda: "rms_norm: x must have at least 1 dimension")
    if weight is not None:
        torch._check(weight.shape == x.shape[-1:],
                     lambda: f"rms_norm: weight must have shape {list(x.shape[-1:])}, got {list(weight.shape)}")


@register_fake("opsmith::rms_norm_fwd")
def _rms_norm_fwd_fake(x, weight, eps=None, offset=0.0, casting_mode="none", out_dtype=None,
                       inplace_backward=False):
    _check_fake(x, weight)
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    inv_rms = torch.empty(x.shape[:-1], dtype=_accumulate_dtype(x.dtype), device=x.device)
    return y, inv_rms


def _dweight_fake(x, weight, weight_grad):
    # shape [0] when there is no weight or its gradient is not asked for
    n = x.shape[-1] if weight is not None and weight_grad else 0
    return torch.empty((n,), dtype=x.dtype if weight is None else weight.dtype, device=x.device)


@register_fake("opsmith::rms_norm_bwd")
def _rms_norm_bwd_fake(dy, x, weight, inv_rms, offset=0.0, casting_mode="none", weight_grad=True):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), _dweight_fake(x, weight, weight_grad)


@register_fake("opsmith::rms_norm_bwd_")
def _rms_norm_bwd_inplace_fake(dy, x, weight, inv_rms, offset=0.0, casting_mode="none", weight_grad=True):
    return _dweight_fake(x, weight, weight_grad)


# --- vmap rules --------------------------------------------------------------------
# The op is row-local: a batch dim of x (and dy, inv_rms) is more rows, so a
# batched x with an unbatched weight is one call. A batched weight, or a
# backward with a weight (its gradient is a per-example sum over rows), cannot
# be one call: those loop over the batch and stack.


def _check_example_rank(x, bdim):
    # the op's own check, on one example (vmap hides the batch dim from it)
    torch._check(bdim is None or x.dim() >= 2,
                 lambda: "rms_norm: x must have at least 1 dimension, got a 0-dim tensor")


@torch.library.register_vmap("opsmith::rms_norm_fwd")
def _rms_norm_fwd_vmap(info, in_dims, x, weight, eps=None, offset=0.0, casting_mode="none", out_dtype=None,
                       inplace_backward=False):
    x_bdim, w_bdim = in_dims[0], in_dims[1]
    _check_example_rank(x, x_bdim)

    def op(a, b):
        return _rms_norm_fwd(a, b, eps, offset, casting_mode, out_dtype, inplace_backward)

    if w_bdim is None:
        y, inv_rms = op(x.movedim(x_bdim, 0), weight)
    else:
        y, inv_rms = _vmap.loop(info.batch_size, (x_bdim, w_bdim), op, (x, weight))
    return (y, inv_rms), (0, 0)


@torch.library.register_vmap("opsmith::rms_norm_bwd")
def _rms_norm_bwd_vmap(info, in_dims, dy, x, weight, inv_rms, offset=0.0, casting_mode="none", weight_grad=True):
    dy_bdim, x_bdim, w_bdim, inv_bdim = in_dims[:4]
    if (weight is None or not weight_grad) and w_bdim is None:
        # no per-example weight gradient: the batch is more rows, one call
        b = info.batch_size
        dx, dweight = _rms_norm_bwd(_vmap.to_front(dy, dy_bdim, b), _vmap.to_front(x, x_bdim, b), weight,
                                    _vmap.to_front(inv_rms, inv_bdim, b), offset, casting_mode, weight_grad)
        return (dx, dweight), (0, None)
    out = _vmap.loop(info.batch_size, (dy_bdim, x_bdim, w_bdim, inv_bdim),
                     lambda a, b, c, d: _rms_norm_bwd(a, b, c, d, offset, casting_mode, weight_grad),
                     (dy, x, weight, inv_rms))
    return out, (0, 0)


# --- tensor parallelism: DTensor sharding rules ------------------------------------
# rms_norm_fwd(x, weight, ...) -> (y, inv_rms); rms_norm_bwd(dy, x, weight,
# inv_rms, ...) -> (dx, dweight). The in-place backward never meets a DTensor
# (the autograd node takes the functional op for tensor subclasses).
_sharding.row_local(_rms_norm_fwd, _rms_norm_bwd, fwd_tensor_args=2, fwd_outputs=2,
                    bwd_row_args=(0, 1, 3), bwd_param_args=(2,), bwd_outputs_row=1, bwd_outputs_param=1)


# --- route A: pybind11 + torch.autograd.Function -------------------------------------

from . import first_order_only, pybind_double_backward_error, route_a as _pybind

PYBIND_DOUBLE_BACKWARD_ERROR = pybind_double_backward_error("rms_norm", "torch.nn.functional.rms_norm")


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset=0.0, casting_mode="none", out_dtype=None):
        y, inv_rms = _pybind().rms_norm_fwd(x, weight, eps, offset, casting_mode, out_dtype)
        ctx.save_for_backward(x, weight, inv_rms)
        ctx.options = (offset, casting_mode)
        return y

    @staticmethod
    @first_order_only(PYBIND_DOUBLE_BACKWARD_ERROR)
    def backward(ctx, dy):
        x, weight, inv_rms = ctx.saved_tensors
        weight_grad = weight is not None and ctx.needs_input_grad[1]
        dx, dweight = _pybind().rms_norm_bwd(dy, x, weight, inv_rms, *ctx.options, weight_grad)
        return dx, (dweight if weight_grad else None), None, None, None, None


PYBIND_TRANSFORM_ERROR = ("opsmith.pybind.rms_norm: route A does not support torch.func transforms "
                          "(grad, vjp, jvp, vmap); use opsmith.rms_norm")


def rms_norm_pybind(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: Optional[float] = None, *,
                    offset: float = 0.0, casting_mode: str = "none",
                    out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Route A twin of opsmith.rms_norm (opsmith.pybind.rms_norm): same bits.
    First-order gradients only; not under torch.func transforms."""
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(PYBIND_TRANSFORM_ERROR)
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"rms_norm: casting_mode must be 'none', 'llama' or 'gemma', got {casting_mode!r}")
    if out_dtype is None:
        out_dtype = _default_out_dtype(x, weight, casting_mode)
    return RMSNormFunction.apply(x, weight, eps, offset, casting_mode, out_dtype)


# --- the nn module ---------------------------------------------------------------------

class RMSNorm(Module):
    """Drop-in for torch.nn.RMSNorm, computed by opsmith's kernels; with the
    keyword options also for Hugging Face's norms: ``casting_mode="llama"``
    (LlamaRMSNorm and the models that copy it), ``offset=1.0,
    casting_mode="gemma"`` (GemmaRMSNorm, whose weight starts at 0). The
    weight starts so that offset + weight = 1. A float32 weight with 16-bit
    inputs is computed as such (no cast of the weight per call)."""

    __constants__ = ["normalized_shape", "eps", "elementwise_affine", "offset", "casting_mode"]
    normalized_shape: Tuple[int, ...]
    eps: Optional[float]
    elementwise_affine: bool

    def __init__(self, normalized_shape: Union[int, Tuple[int, ...], torch.Size],
                 eps: Optional[float] = None, elementwise_affine: bool = True,
                 device=None, dtype=None, *, offset: float = 0.0, casting_mode: str = "none",
                 inplace_backward: bool = False) -> None:
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        if casting_mode not in CASTING_MODES:
            raise ValueError(f"RMSNorm: casting_mode must be 'none', 'llama' or 'gemma', got {casting_mode!r}")
        if offset != 0.0 and not elementwise_affine:
            raise ValueError("RMSNorm: offset scales the weight: it needs elementwise_affine=True")
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.offset = float(offset)
        self.casting_mode = casting_mode
        self.inplace_backward = inplace_backward
        if elementwise_affine:
            self.weight = torch.nn.Parameter(
                torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.constant_(self.weight, 1.0 - self.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = len(self.normalized_shape)
        if tuple(x.shape[-k:]) != self.normalized_shape:
            raise RuntimeError(
                f"RMSNorm: expected input with shape [*, {', '.join(map(str, self.normalized_shape))}], "
                f"got {list(x.shape)}")
        options = dict(offset=self.offset, casting_mode=self.casting_mode, inplace_backward=self.inplace_backward)
        if k == 1:
            return rms_norm(x, self.weight, self.eps, **options)
        # normalize over the last k dims as one flattened dim
        weight = self.weight.reshape(-1) if self.weight is not None else None
        y = rms_norm(x.flatten(-k), weight, self.eps, **options)
        return y.view(*x.shape[:-k], *self.normalized_shape)

    def extra_repr(self) -> str:
        s = "{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}".format(**self.__dict__)
        if self.offset:
            s += f", offset={self.offset}"
        if self.casting_mode != "none":
            s += f", casting_mode={self.casting_mode!r}"
        return s


# --- what this op adds to opsmith, opsmith.nn and opsmith.pybind -------------------------
FUNCTIONS = {"rms_norm": rms_norm}
MODULES = {"RMSNorm": RMSNorm}
PYBIND = {"rms_norm": rms_norm_pybind, "RMSNormFunction": RMSNormFunction}
