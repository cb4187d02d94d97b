"""LayerNorm in Python: the functional API (route B), the fake kernels and vmap
rules of its two dispatcher ops, the route A autograd.Function, and the nn
module. The dispatcher imports this module for the fake kernels when the
library is loaded on its own (m.set_python_module in csrc/torch)."""
import numbers
from typing import List, Optional, Tuple, Union

import torch

from . import check_param, Module, register_fake
from .. import _library, _sharding  # noqa: F401  (loads the library: torch.ops.opsmith.* exists after this)
from . import _vmap

_layer_norm_fwd = torch.ops.opsmith.layer_norm_fwd.default
_layer_norm_bwd = torch.ops.opsmith.layer_norm_bwd.default


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --- route B: the functional API -------------------------------------------------

def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension of x:
    ``(x - mean) / sqrt(var + eps) * weight + bias``.

    Same result as ``torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)``,
    and the same output dtype: x's, with weight and bias in x's dtype or in
    float32 (norm parameters kept in float32 beside 16-bit activations);
    under CUDA autocast, float32 (layer_norm is on autocast's float32 list).
    Sums run in float32 (float64 for float64 x). Autograd is registered in
    C++ (csrc/torch): first-order gradients, torch.func.grad and vjp; double
    backward and forward-mode AD raise. A weight or bias that gets no
    gradient (frozen, or not asked for by ``torch.autograd.grad``) costs no
    column sums in the backward."""
    check_param("layer_norm", weight=weight, bias=bias)
    return _layer_norm_fwd(x, weight, bias, eps)[0]


def _param_dtype(x, weight, bias):
    p = weight if weight is not None else bias
    return x.dtype if p is None else p.dtype


@register_fake("opsmith::layer_norm_fwd")
def _layer_norm_fwd_fake(x, weight, bias, eps=1e-5):
    torch._check(x.dim() >= 1, lambda: "layer_norm: x must have at least 1 dimension")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            torch._check(p.shape == x.shape[-1:],
                         lambda: f"layer_norm: {name} must have shape {list(x.shape[-1:])}, got {list(p.shape)}")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    acc = _accumulate_dtype(x.dtype)
    mean = torch.empty(x.shape[:-1], dtype=acc, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=acc, device=x.device)
    return y, mean, rstd


@register_fake("opsmith::layer_norm_bwd")
def _layer_norm_bwd_fake(dy, x, weight, bias, mean, rstd, weight_grad=True, bias_grad=True):
    pd = _param_dtype(x, weight, bias)
    n = x.shape[-1]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # shape [0] for a parameter that is absent or whose gradient is not asked for
    dweight = torch.empty((n if weight is not None and weight_grad else 0,), dtype=pd, device=x.device)
    dbias = torch.empty((n if bias is not None and bias_grad else 0,), dtype=pd, device=x.device)
    return dx, dweight, dbias


# --- vmap rules --------------------------------------------------------------------
# Row-local like rms_norm: a batch dim of x (dy, mean, rstd) is more rows, so
# a batched x with unbatched parameters is one call. Batched parameters, or a
# backward that computes parameter gradients (per-example sums over rows),
# loop over the batch and stack.


@torch.library.register_vmap("opsmith::layer_norm_fwd")
def _layer_norm_fwd_vmap(info, in_dims, x, weight, bias, eps=1e-5):
    x_bdim, w_bdim, b_bdim = in_dims[0], in_dims[1], in_dims[2]
    torch._check(x_bdim is None or x.dim() >= 2,
                 lambda: "layer_norm: x must have at least 1 dimension, got a 0-dim tensor")
    if w_bdim is None and b_bdim is None:
        out = _layer_norm_fwd(x.movedim(x_bdim, 0), weight, bias, eps)
    else:
        out = _vmap.loop(info.batch_size, in_dims[:3], lambda a, w, b: _layer_norm_fwd(a, w, b, eps), (x, weight, bias))
    return tuple(out), (0, 0, 0)


@torch.library.register_vmap("opsmith::layer_norm_bwd")
def _layer_norm_bwd_vmap(info, in_dims, dy, x, weight, bias, mean, rstd, weight_grad=True, bias_grad=True):
    dy_bdim, x_bdim, w_bdim, b_bdim, m_bdim, r_bdim = in_dims[:6]
    sums = (weight is not None and weight_grad) or (bias is not None and bias_grad)
    if not sums and w_bdim is None and b_bdim is None:
        # no per-example parameter gradient: the batch is more rows, one call
        b = info.batch_size
        dx, dw, db = _layer_norm_bwd(_vmap.to_front(dy, dy_bdim, b), _vmap.to_front(x, x_bdim, b), weight, bias,
                                     _vmap.to_front(mean, m_bdim, b), _vmap.to_front(rstd, r_bdim, b),
                                     weight_grad, bias_grad)
        return (dx, dw, db), (0, None, None)
    out = _vmap.loop(info.batch_size, in_dims[:6],
                     lambda *a: _layer_norm_bwd(*a, weight_grad, bias_grad), (dy, x, weight, bias, mean, rstd))
    return out, (0, 0, 0)


# --- tensor parallelism: DTensor sharding rules ------------------------------------
# layer_norm_fwd(x, weight, bias, eps) -> (y, mean, rstd); layer_norm_bwd(dy, x,
# weight, bias, mean, rstd) -> (dx, dweight, dbias)
_sharding.row_local(_layer_norm_fwd, _layer_norm_bwd, fwd_tensor_args=3, fwd_outputs=3,
                    bwd_row_args=(0, 1, 4, 5), bwd_param_args=(2, 3), bwd_outputs_row=1, bwd_outputs_param=2)


# --- route A: pybind11 + torch.autograd.Function -------------------------------------

from . import first_order_only, pybind_double_backward_error, route_a as _pybind

PYBIND_DOUBLE_BACKWARD_ERROR = pybind_double_backward_error("layer_norm", "torch.nn.functional.layer_norm")


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = _pybind().layer_norm_fwd(x, weight, bias, eps)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y

    @staticmethod
    @first_order_only(PYBIND_DOUBLE_BACKWARD_ERROR)
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        weight_grad = weight is not None and ctx.needs_input_grad[1]
        bias_grad = bias is not None and ctx.needs_input_grad[2]
        dx, dweight, dbias = _pybind().layer_norm_bwd(dy, x, weight, bias, mean, rstd, weight_grad, bias_grad)
        return dx, (dweight if weight_grad else None), (dbias if bias_grad else None), None


PYBIND_TRANSFORM_ERROR = ("opsmith.pybind.layer_norm: route A does not support torch.func transforms "
                          "(grad, vjp, jvp, vmap); use opsmith.layer_norm")


def layer_norm_pybind(x: torch.Tensor, weight: Optional[torch.Tensor] = None,
                      bias: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """Route A twin of opsmith.layer_norm (opsmith.pybind.layer_norm): same bits,
    same autocast behaviour. First-order gradients only; not under torch.func
    transforms."""
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(PYBIND_TRANSFORM_ERROR)
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        # as route B's AutocastCUDA kernel: float32 inputs, autocast off inside
        cast = [None if t is None else t.float() for t in (x, weight, bias)]
        with torch.autocast("cuda", enabled=False):
            return LayerNormFunction.apply(*cast, eps)
    return LayerNormFunction.apply(x, weight, bias, eps)


# --- the nn module ---------------------------------------------------------------------

class LayerNorm(Module):
    """Drop-in for torch.nn.LayerNorm (same arguments, parameters and
    state-dict keys: weight, bias), computed by opsmith's kernels."""

    __constants__ = ["normalized_shape", "eps", "elementwise_affine"]
    normalized_shape: Tuple[int, ...]
    eps: float
    elementwise_affine: bool

    def __init__(self, normalized_shape: Union[int, List[int], Tuple[int, ...], torch.Size],
                 eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
            if bias:
                self.bias = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = len(self.normalized_shape)
        if tuple(x.shape[x.dim() - k:]) != self.normalized_shape or x.dim() < k:
            raise RuntimeError(
                f"LayerNorm: expected input with shape [*, {', '.join(map(str, self.normalized_shape))}], "
                f"got {list(x.shape)}")
        if k == 1:
            return layer_norm(x, self.weight, self.bias, self.eps)
        # normalise over the last k dims as one flattened dim
        w = self.weight.reshape(-1) if self.weight is not None else None
        b = self.bias.reshape(-1) if self.bias is not None else None
        return layer_norm(x.flatten(-k), w, b, self.eps).view(x.shape)

    def extra_repr(self) -> str:
        return "{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}".format(**self.__dict__)


FUNCTIONS = {"layer_norm": layer_norm}
MODULES = {"LayerNorm": LayerNorm}
PYBIND = {"layer_norm": layer_norm_pybind, "LayerNormFunction": LayerNormFunction}
