"""cross_entropy in Python: the functional API (route B), the fake kernels and vmap
rules of its two dispatcher ops, the route A autograd.Function, and the nn
module. The dispatcher imports this module for the fake kernels when the
library is loaded on its own (m.set_python_module in csrc/torch)."""
import math

import torch

from .. import _library  # noqa: F401  (loads the library: torch.ops.opsmith.* exists after this)

# the overloads themselves: calling them skips the packet's overload lookup
_cross_entropy_fwd = torch.ops.opsmith.cross_entropy_fwd.default
_cross_entropy_bwd = torch.ops.opsmith.cross_entropy_bwd.default


# --- route B: the functional API -------------------------------------------------

def cross_entropy(x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``x * sigmoid(alpha * x)``, elementwise (alpha = 1 is SiLU).

    Any shape; float64, float32, float16 or bfloat16, arithmetic in float32
    (float64 for float64); alpha must be finite. Autograd is registered in
    C++ (csrc/torch): first-order gradients, torch.func.grad, vjp and vmap;
    double backward and forward-mode AD raise."""
    return _cross_entropy_fwd(x, alpha)


def _check_alpha(alpha):
    torch._check(math.isfinite(alpha), lambda: f"cross_entropy: alpha must be finite, got {alpha}")


@torch.library.register_fake("opsmith::cross_entropy_fwd")
def _cross_entropy_fwd_fake(x, alpha=1.0):
    _check_alpha(alpha)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.register_fake("opsmith::cross_entropy_bwd")
def _cross_entropy_bwd_fake(dy, x, alpha=1.0):
    _check_alpha(alpha)
    torch._check(dy.shape == x.shape, lambda: f"cross_entropy: dy must have the shape of x {list(x.shape)}, got {list(dy.shape)}")
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


# --- vmap rules --------------------------------------------------------------------
# The op is elementwise: a batch dim is more elements, so a batched call is
# one call with the batch dim in front (an unbatched dy or x is expanded).

def _to_front(t, bdim, batch_size):
    return t.movedim(bdim, 0) if bdim is not None else t.expand(batch_size, *t.shape)


@torch.library.register_vmap("opsmith::cross_entropy_fwd")
def _cross_entropy_fwd_vmap(info, in_dims, x, alpha=1.0):
    return _cross_entropy_fwd(x, alpha), in_dims[0]


@torch.library.register_vmap("opsmith::cross_entropy_bwd")
def _cross_entropy_bwd_vmap(info, in_dims, dy, x, alpha=1.0):
    b = info.batch_size
    return _cross_entropy_bwd(_to_front(dy, in_dims[0], b), _to_front(x, in_dims[1], b), alpha), 0


# --- route A: pybind11 + torch.autograd.Function -------------------------------------

_pybind_module = None


def _pybind():
    # imported on first use: `import opsmith` does not need route A
    global _pybind_module
    if _pybind_module is None:
        from .. import _pybind as module
        _pybind_module = module
    return _pybind_module


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        y = _pybind().cross_entropy_fwd(x, alpha)
        ctx.save_for_backward(x)
        ctx.alpha = alpha
        return y

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled() and not dy.requires_grad and ctx.saved_tensors[0].requires_grad:
            # create_graph=True with a constant dy: once_differentiable looks
            # at dy only, and would hand back a gradient without a graph --
            # differentiating it would give silent zeros. Through a dy that
            # requires grad, it marks it, so differentiating it raises instead.
            dy = dy.detach().requires_grad_()
        return CrossEntropyFunction._backward(ctx, dy)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def _backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return _pybind().cross_entropy_bwd(dy, x, ctx.alpha), None


PYBIND_TRANSFORM_ERROR = ("opsmith.pybind.cross_entropy: route A does not support torch.func transforms "
                          "(grad, vjp, jvp, vmap); use opsmith.cross_entropy")


def cross_entropy_pybind(x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """Route A twin of opsmith.cross_entropy (opsmith.pybind.cross_entropy): same bits.
    First-order gradients only; not under torch.func transforms."""
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(PYBIND_TRANSFORM_ERROR)
    return CrossEntropyFunction.apply(x, alpha)


# --- the nn module ---------------------------------------------------------------------

class CrossEntropy(torch.nn.Module):
    """``x * sigmoid(alpha * x)`` as a module; alpha is fixed (a constant,
    not a parameter)."""

    __constants__ = ["alpha"]
    alpha: float

    def __init__(self, alpha: float = 1.0) -> None:
        super().__init__()
        self.alpha = float(alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cross_entropy(x, self.alpha)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}"


# --- what this op adds to opsmith, opsmith.nn and opsmith.pybind -------------------------
FUNCTIONS = {"cross_entropy": cross_entropy}
MODULES = {"CrossEntropy": CrossEntropy}
PYBIND = {"cross_entropy": cross_entropy_pybind, "CrossEntropyFunction": CrossEntropyFunction}
