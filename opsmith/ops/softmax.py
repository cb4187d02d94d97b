"""softmax and log_softmax in Python: the functional API (route B), the fake
kernels and vmap rules of the two dispatcher ops, the route A
autograd.Function, and the nn modules. The dispatcher imports this module for
the fake kernels when the library is loaded on its own (m.set_python_module in
csrc/torch). The kernels work over the last dim; another dim is moved there
(a copy when it is not already last)."""
import warnings
from typing import Optional

import torch

from . import Module, register_fake
from .. import _library  # noqa: F401  (loads the library: torch.ops.opsmith.* exists after this)
from . import first_order_only, pybind_double_backward_error, route_a

_softmax_fwd = torch.ops.opsmith.softmax_fwd.default
_softmax_bwd = torch.ops.opsmith.softmax_bwd.default


def _run(fn, x, dim, dtype, log):
    if dim is None:
        # as F.softmax(x, None) and torch.nn.Softmax(): the legacy
        # implicit dim, with torch's deprecation warning
        name = "log_softmax" if log else "softmax"
        warnings.warn(f"Implicit dimension choice for {name} has been deprecated. "
                      "Change the call to include dim=X as an argument.", stacklevel=3)
        dim = 0 if x.dim() in (0, 1, 3) else 1
    # torch's range: [-n, n - 1], a 0-d tensor counting as 1-d
    n = max(x.dim(), 1)
    if not -n <= dim < n:
        raise IndexError(f"{'log_softmax' if log else 'softmax'}: dim {dim} is out of range for a {x.dim()}-d "
                         f"tensor (expected in [{-n}, {n - 1}])")
    if dtype is not None:
        x = x.to(dtype)
    if x.dim() == 0:
        return fn(x, log)
    d = dim % x.dim()
    if d == x.dim() - 1:
        return fn(x, log)
    return fn(x.movedim(d, -1), log).movedim(-1, d)


# --- route B: the functional API -------------------------------------------------

def softmax(x: torch.Tensor, dim: Optional[int] = -1, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``torch.softmax(x, dim)``: float64, float32, float16 or bfloat16 (float32
    math for 16-bit), any shape, rows up to any width. Autograd in C++ (the
    backward uses the saved output); torch.func.grad, vjp and vmap; double
    backward and forward-mode AD raise. ``dim=None`` takes PyTorch's legacy
    implicit dim (0 for 0-, 1- and 3-d x, else 1) with its deprecation warning."""
    return _run(_softmax_fwd, x, dim, dtype, False)


def log_softmax(x: torch.Tensor, dim: Optional[int] = -1, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``torch.log_softmax(x, dim)``; as :func:`softmax`."""
    return _run(_softmax_fwd, x, dim, dtype, True)


@register_fake("opsmith::softmax_fwd")
def _softmax_fwd_fake(x, log=False):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@register_fake("opsmith::softmax_bwd")
def _softmax_bwd_fake(dy, y, log=False):
    torch._check(dy.shape == y.shape, lambda: f"softmax: dy must have the shape of y {list(y.shape)}, got {list(dy.shape)}")
    return torch.empty(y.shape, dtype=y.dtype, device=y.device)


# --- vmap rules --------------------------------------------------------------------
# Row-local over the last dim: a batch dim moved to the front is more rows.

def _to_front(t, bdim, batch_size):
    return t.movedim(bdim, 0) if bdim is not None else t.expand(batch_size, *t.shape)


@torch.library.register_vmap("opsmith::softmax_fwd")
def _softmax_fwd_vmap(info, in_dims, x, log=False):
    return _softmax_fwd(_to_front(x, in_dims[0], info.batch_size), log), 0


@torch.library.register_vmap("opsmith::softmax_bwd")
def _softmax_bwd_vmap(info, in_dims, dy, y, log=False):
    b = info.batch_size
    return _softmax_bwd(_to_front(dy, in_dims[0], b), _to_front(y, in_dims[1], b), log), 0


# --- route A: pybind11 + torch.autograd.Function -------------------------------------

PYBIND_DOUBLE_BACKWARD_ERROR = {
    log: pybind_double_backward_error(name, f"torch.{name}")
    for log, name in ((False, "softmax"), (True, "log_softmax"))
}


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, log):
        y = route_a().softmax_fwd(x, log)
        ctx.save_for_backward(y)
        ctx.log = log
        return y

    @staticmethod
    @first_order_only(lambda ctx: PYBIND_DOUBLE_BACKWARD_ERROR[ctx.log])
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return route_a().softmax_bwd(dy, y, ctx.log), None


PYBIND_TRANSFORM_ERROR = ("opsmith.pybind.softmax: route A does not support torch.func transforms "
                          "(grad, vjp, jvp, vmap); use opsmith.softmax")


def _pybind_call(x, dim, dtype, log):
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(PYBIND_TRANSFORM_ERROR)
    return _run(SoftmaxFunction.apply, x, dim, dtype, log)


def softmax_pybind(x: torch.Tensor, dim: Optional[int] = -1, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Route A twin of opsmith.softmax (opsmith.pybind.softmax): same bits."""
    return _pybind_call(x, dim, dtype, False)


def log_softmax_pybind(x: torch.Tensor, dim: Optional[int] = -1, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Route A twin of opsmith.log_softmax (opsmith.pybind.log_softmax): same bits."""
    return _pybind_call(x, dim, dtype, True)


# --- the nn modules ---------------------------------------------------------------------

class Softmax(Module):
    """Drop-in for ``torch.nn.Softmax(dim)`` (no state; ``dim=None``: PyTorch's
    legacy implicit dim, with its warning)."""

    __constants__ = ["dim"]

    def __init__(self, dim: Optional[int] = -1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softmax(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class LogSoftmax(Softmax):
    """Drop-in for ``torch.nn.LogSoftmax(dim)`` (no state)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return log_softmax(x, self.dim)


# --- what this op adds to opsmith, opsmith.nn and opsmith.pybind -------------------------
FUNCTIONS = {"softmax": softmax, "log_softmax": log_softmax}
MODULES = {"Softmax": Softmax, "LogSoftmax": LogSoftmax}
PYBIND = {"softmax": softmax_pybind, "log_softmax": log_softmax_pybind, "SoftmaxFunction": SoftmaxFunction}
