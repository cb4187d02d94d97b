"""RMSNorm in Python: the functional API (route B), the fake kernels and vmap
rules of its two dispatcher ops, the route A autograd.Function, and the nn
module. The dispatcher imports this module for the fake kernels when the
library is loaded on its own (m.set_python_module in csrc/torch)."""
import numbers
from typing import Optional, Tuple, Union

import torch

from .. import _library  # noqa: F401  (loads the library: torch.ops.opsmith.* exists after this)

# the overloads themselves: calling them skips the packet's overload lookup
_rms_norm_fwd = torch.ops.opsmith.rms_norm_fwd.default
_rms_norm_bwd = torch.ops.opsmith.rms_norm_bwd.default


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --- route B: the functional API -------------------------------------------------

def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None,
             eps: Optional[float] = None) -> torch.Tensor:
    """RMSNorm over the last dimension of x:
    ``x / sqrt(mean(x**2, -1) + eps) * weight``.

    Same result as ``torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)``;
    eps None means ``torch.finfo(x.dtype).eps``. x and weight share device and
    dtype (float64, float32, float16, bfloat16); sums run in float32 (float64
    for float64). Autograd is registered in C++ (csrc/torch): first-order
    gradients, torch.func.grad and vjp; double backward and forward-mode AD
    raise."""
    return _rms_norm_fwd(x, weight, eps)[0]


@torch.library.register_fake("opsmith::rms_norm_fwd")
def _rms_norm_fwd_fake(x, weight, eps=None):
    torch._check(x.dim() >= 1, lambda: "rms_norm: x must have at least 1 dimension")
    if weight is not None:
        torch._check(weight.shape == x.shape[-1:],
                     lambda: f"rms_norm: weight must have shape {list(x.shape[-1:])}, got {list(weight.shape)}")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    inv_rms = torch.empty(x.shape[:-1], dtype=_accumulate_dtype(x.dtype), device=x.device)
    return y, inv_rms


@torch.library.register_fake("opsmith::rms_norm_bwd")
def _rms_norm_bwd_fake(dy, x, weight, inv_rms):
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dweight = torch.empty((x.shape[-1] if weight is not None else 0,), dtype=x.dtype, device=x.device)
    return dx, dweight


# --- vmap rules --------------------------------------------------------------------
# The op is row-local: a batch dim of x (and dy, inv_rms) is more rows, so a
# batched x with an unbatched weight is one call. A batched weight, or a
# backward with a weight (its gradient is a per-example sum over rows), cannot
# be one call: those loop over the batch and stack.

def _to_front(t, bdim, batch_size):
    if t is None:
        return None
    return t.movedim(bdim, 0) if bdim is not None else t.expand(batch_size, *t.shape)


def _loop(batch_size, in_dims, op, args):
    outs = []
    for i in range(batch_size):
        outs.append(op(*[a.select(d, i) if d is not None and a is not None else a
                         for a, d in zip(args, in_dims)]))
    return tuple(torch.stack(o) for o in zip(*outs))


def _check_example_rank(x, bdim):
    # the op's own check, on one example (vmap hides the batch dim from it)
    torch._check(bdim is None or x.dim() >= 2,
                 lambda: "rms_norm: x must have at least 1 dimension, got a 0-dim tensor")


@torch.library.register_vmap("opsmith::rms_norm_fwd")
def _rms_norm_fwd_vmap(info, in_dims, x, weight, eps=None):
    x_bdim, w_bdim = in_dims[0], in_dims[1]
    _check_example_rank(x, x_bdim)
    if w_bdim is None:
        y, inv_rms = _rms_norm_fwd(x.movedim(x_bdim, 0), weight, eps)
    else:
        y, inv_rms = _loop(info.batch_size, (x_bdim, w_bdim), lambda a, b: _rms_norm_fwd(a, b, eps), (x, weight))
    return (y, inv_rms), (0, 0)


@torch.library.register_vmap("opsmith::rms_norm_bwd")
def _rms_norm_bwd_vmap(info, in_dims, dy, x, weight, inv_rms):
    dy_bdim, x_bdim, w_bdim, inv_bdim = in_dims
    if weight is None:
        b = info.batch_size
        dx, dweight = _rms_norm_bwd(_to_front(dy, dy_bdim, b), _to_front(x, x_bdim, b), None,
                                    _to_front(inv_rms, inv_bdim, b))
        return (dx, dweight), (0, None)
    out = _loop(info.batch_size, in_dims, _rms_norm_bwd, (dy, x, weight, inv_rms))
    return out, (0, 0)


# --- route A: pybind11 + torch.autograd.Function -------------------------------------

_pybind_module = None


def _pybind():
    # imported on first use: `import opsmith` does not need route A
    global _pybind_module
    if _pybind_module is None:
        from .. import _pybind as module
        _pybind_module = module
    return _pybind_module


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, inv_rms = _pybind().rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, inv_rms)
        return y

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled() and not dy.requires_grad and any(
                t is not None and t.requires_grad for t in ctx.saved_tensors[:2]):
            # create_graph=True with a constant dy (a gradient penalty):
            # once_differentiable looks at dy only, and would hand back
            # gradients without a graph -- differentiating them would give
            # silent zeros. Through a dy that requires grad, it marks them,
            # so differentiating them raises instead.
            dy = dy.detach().requires_grad_()
        return RMSNormFunction._backward(ctx, dy)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def _backward(ctx, dy):
        x, weight, inv_rms = ctx.saved_tensors
        dx, dweight = _pybind().rms_norm_bwd(dy, x, weight, inv_rms)
        return dx, (dweight if weight is not None else None), None


PYBIND_TRANSFORM_ERROR = ("opsmith.pybind.rms_norm: route A does not support torch.func transforms "
                          "(grad, vjp, jvp, vmap); use opsmith.rms_norm")


def rms_norm_pybind(x: torch.Tensor, weight: Optional[torch.Tensor] = None,
                    eps: Optional[float] = None) -> torch.Tensor:
    """Route A twin of opsmith.rms_norm (opsmith.pybind.rms_norm): same bits.
    First-order gradients only; not under torch.func transforms."""
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(PYBIND_TRANSFORM_ERROR)
    return RMSNormFunction.apply(x, weight, eps)


# --- the nn module ---------------------------------------------------------------------

class RMSNorm(torch.nn.Module):
    """Drop-in for torch.nn.RMSNorm, computed by opsmith's kernels."""

    __constants__ = ["normalized_shape", "eps", "elementwise_affine"]
    normalized_shape: Tuple[int, ...]
    eps: Optional[float]
    elementwise_affine: bool

    def __init__(self, normalized_shape: Union[int, Tuple[int, ...], torch.Size],
                 eps: Optional[float] = None, elementwise_affine: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = torch.nn.Parameter(
                torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = len(self.normalized_shape)
        if tuple(x.shape[-k:]) != self.normalized_shape:
            raise RuntimeError(
                f"RMSNorm: expected input with shape [*, {', '.join(map(str, self.normalized_shape))}], "
                f"got {list(x.shape)}")
        if k == 1:
            return rms_norm(x, self.weight, self.eps)
        # normalize over the last k dims as one flattened dim
        weight = self.weight.reshape(-1) if self.weight is not None else None
        return rms_norm(x.flatten(-k), weight, self.eps).view(x.shape)

    def extra_repr(self) -> str:
        return "{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}".format(
            **self.__dict__)


# --- what this op adds to opsmith, opsmith.nn and opsmith.pybind -------------------------
FUNCTIONS = {"rms_norm": rms_norm}
MODULES = {"RMSNorm": RMSNorm}
PYBIND = {"rms_norm": rms_norm_pybind, "RMSNormFunction": RMSNormFunction}
