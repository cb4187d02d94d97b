"""fused_linear_cross_entropy in Python: the functional API (route B), the fake
kernel and vmap rule of its dispatcher op, the route A autograd.Function, and
the nn module. The dispatcher imports this module for the fake kernel when the
library is loaded on its own (m.set_python_module in csrc/torch).

The LM head and its cross-entropy in one op: the logits are computed a chunk
of tokens at a time and never exist whole. The forward computes the loss and
the gradients of hidden, weight and bias (for an incoming gradient of 1)
whenever they require grad; the backward only scales those by the incoming
gradient (on the device, skipped where it is exactly 1: ``loss.backward()``),
through cross_entropy's backward ops."""
from typing import Optional

import torch

from . import Module, register_fake
from .. import _library  # noqa: F401  (loads the library: torch.ops.opsmith.* exists after this)
from . import first_order_only, graph_anchors, pybind_double_backward_error, route_a
from .cross_entropy import _options_repr, _softcap, _validate

_fwd = torch.ops.opsmith.fused_linear_cross_entropy_fwd.default

_REDUCTIONS = {"sum": 1, "mean": 2}


def _reduction(reduction):
    if reduction not in _REDUCTIONS:
        raise ValueError(f"fused_linear_cross_entropy: reduction must be 'sum' or 'mean', got {reduction!r} "
                         "('none' would need the per-token gradients of the whole logits)")
    return _REDUCTIONS[reduction]


def _chunk(chunk_size):
    if chunk_size is None:
        return 0
    chunk_size = int(chunk_size)
    if chunk_size < 1:
        raise ValueError(f"fused_linear_cross_entropy: chunk_size must be None or >= 1, got {chunk_size}")
    return chunk_size


def _rows(hidden, target):
    """(N, D) hidden and (N) target from [..., D] and [...]."""
    if target.is_floating_point():
        raise RuntimeError(f"fused_linear_cross_entropy: target must be int64 class indices, got {target.dtype}")
    if hidden.dim() == 0:
        raise RuntimeError("fused_linear_cross_entropy: hidden must have at least one dim (the features, last)")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise RuntimeError(f"fused_linear_cross_entropy: target must have shape {list(hidden.shape[:-1])} (hidden's "
                           f"shape without the feature dim), got {list(target.shape)}")
    if hidden.dim() == 2:
        return hidden, target
    return hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)


def _autocast(hidden, weight, bias):
    # under autocast the head runs in the autocast dtype, as F.linear would
    # (an fp32 master weight is cast; its gradient flows back through the cast)
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dt = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = None if bias is None else bias.to(dt)
    return hidden, weight, bias


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                               reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                               softcap: Optional[float] = None, *, return_z_loss: bool = False,
                               chunk_size: Optional[int] = None, validate: bool = False):
    """``cross_entropy(linear(hidden, weight, bias), target, ...)`` without the logits.

    hidden ``[..., D]``, weight ``[V, D]`` (the ``lm_head`` weight), bias
    ``[V]`` or None, target ``[...]`` int64 (float64, float32, float16,
    bfloat16: one dtype for all three; under autocast the autocast dtype).
    The loss (and with ``return_z_loss=True`` the z-loss part) is float32 for
    16-bit inputs, as ``F.cross_entropy(F.linear(h, W).float(), t)`` gives.
    Options as :func:`opsmith.cross_entropy` (``ignore_index``,
    ``label_smoothing``, ``z_loss``, ``softcap``; ``reduction`` "mean" or
    "sum"). ``chunk_size``: tokens per chunk of logits (None: chosen from
    the vocabulary size, about 512 MiB of logits on the GPU, less when a
    quarter of the device memory PyTorch's tensors leave free is less; the
    weight gradient's rounding follows the chunking, so set it for
    bitwise-repeatable gradients on a device whose free memory varies).
    Out-of-range targets: IndexError on the CPU; on CUDA a NaN loss and a
    device-side flag, raised (one host synchronisation) with
    ``validate=True``. The gradients are computed in the forward for an
    incoming gradient of 1 and scaled in the backward. They are held in the
    inputs' dtype between the two, except float16's, held in float32 (so a
    loss scaler's gradient, ``torch.amp.GradScaler``, scales them before
    their one rounding to float16, as in the unfused path: a mean's gradient
    over thousands of tokens has elements under float16's normal range); the
    weight's gradient then takes 4 bytes an element until the backward."""
    red = _reduction(reduction)
    cap = _softcap(softcap)
    chunk = _chunk(chunk_size)
    hidden, weight, bias = _autocast(hidden, weight, bias)
    h, t = _rows(hidden, target)
    loss, z, _dh, _dw, _db, error = _fwd(h, weight, t, bias, ignore_index, float(label_smoothing), float(z_loss),
                                         cap, red, chunk)
    if validate:
        _validate(error, weight.shape[0], ignore_index)
    return (loss, z) if return_z_loss else loss


# --- fake kernel -------------------------------------------------------------------

def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@register_fake("opsmith::fused_linear_cross_entropy_fwd")
def _fwd_fake(hidden, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=0.0,
              reduction=2, chunk_size=0, grad_hidden=False, grad_weight=False, grad_bias=False):
    op = "fused_linear_cross_entropy"
    torch._check(hidden.dim() == 2, lambda: f"{op}: hidden must be 2-D (N, D), got {list(hidden.shape)}")
    torch._check(weight.dim() == 2 and weight.shape[1] == hidden.shape[1],
                 lambda: f"{op}: weight must have shape [V, {hidden.shape[1]}], got {list(weight.shape)}")
    torch._check(weight.dtype == hidden.dtype,
                 lambda: f"{op}: weight must have hidden's dtype ({hidden.dtype}), got {weight.dtype}")
    torch._check(target.dtype == torch.int64, lambda: f"{op}: target must be int64 class indices, got {target.dtype}")
    torch._check(target.dim() == 1 and target.shape[0] == hidden.shape[0],
                 lambda: f"{op}: target must have shape [{hidden.shape[0]}] (hidden's rows), got {list(target.shape)}")
    torch._check(reduction in (1, 2), lambda: f"{op}: reduction must be 1 (sum) or 2 (mean), got {reduction}")
    acc = _acc(hidden.dtype)
    # float16's gradients come back float32 (the backward scales them, autograd rounds them once)
    gd = torch.float32 if hidden.dtype == torch.float16 else hidden.dtype
    n, d, v = hidden.shape[0], hidden.shape[1], weight.shape[0]
    return (hidden.new_empty((), dtype=acc), hidden.new_empty((), dtype=acc),
            hidden.new_empty((n, d) if grad_hidden else (0,), dtype=gd),
            hidden.new_empty((v, d) if grad_weight else (0,), dtype=gd),
            hidden.new_empty((v,) if grad_bias and bias is not None else (0,), dtype=gd),
            hidden.new_empty((3,), dtype=torch.int64))


_VMAP_ERROR = ("fused_linear_cross_entropy: torch.func.vmap is not supported; fold the batch dim into the tokens "
               "(hidden [B * N, D])")


@torch.library.register_vmap("opsmith::fused_linear_cross_entropy_fwd")
def _refuse_vmap(*args, **kwargs):
    raise RuntimeError(_VMAP_ERROR)


# --- route A: pybind11 + torch.autograd.Function -------------------------------------

PYBIND_DOUBLE_BACKWARD_ERROR = pybind_double_backward_error(
    "fused_linear_cross_entropy", "torch.nn.functional.linear and cross_entropy")


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, reduction,
                chunk_size, anchors=()):
        nh, nw, nb = ctx.needs_input_grad[:3]
        loss, z, dh, dw, db, error = route_a().fused_linear_cross_entropy_fwd(
            hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap, reduction, chunk_size,
            nh, nw, nb)
        ctx.save_for_backward(dh, dw, db)
        ctx.flags = (nh, nw, nb)
        # only computed gradients are saved: the anchors tie the backward's
        # results to the inputs' graph (graph_anchors)
        ctx.anchors = anchors
        ctx.mark_non_differentiable(z, error)
        return loss, z, error

    @staticmethod
    @first_order_only(PYBIND_DOUBLE_BACKWARD_ERROR)
    def backward(ctx, g, _gz, _gerror):
        saved = ctx.saved_tensors
        grads = []
        for flag, d in zip(ctx.flags, saved):
            if not flag or g is None:
                grads.append(None)
                continue
            d2 = d.view(1, -1) if d.dim() == 1 else d
            grads.append(route_a().cross_entropy_bwd(g, d2).view(d.shape))
        return (*grads, None, None, None, None, None, None, None, None)


PYBIND_TRANSFORM_ERROR = ("opsmith.pybind.fused_linear_cross_entropy: route A does not support torch.func "
                          "transforms (grad, vjp, jvp, vmap); use opsmith.fused_linear_cross_entropy")


def fused_linear_cross_entropy_pybind(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                      bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                                      reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                                      softcap: Optional[float] = None, *, return_z_loss: bool = False,
                                      chunk_size: Optional[int] = None, validate: bool = False):
    """Route A twin of opsmith.fused_linear_cross_entropy (opsmith.pybind.fused_linear_cross_entropy):
    same bits. First-order gradients only; not under torch.func transforms."""
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(PYBIND_TRANSFORM_ERROR)
    red = _reduction(reduction)
    cap = _softcap(softcap)
    chunk = _chunk(chunk_size)
    hidden, weight, bias = _autocast(hidden, weight, bias)
    h, t = _rows(hidden, target)
    loss, z, error = FusedLinearCrossEntropyFunction.apply(h, weight, bias, t, ignore_index, float(label_smoothing),
                                                           float(z_loss), cap, red, chunk,
                                                           graph_anchors(h, weight, bias))
    if validate:
        _validate(error, weight.shape[0], ignore_index)
    return (loss, z) if return_z_loss else loss


# --- the nn module ---------------------------------------------------------------------

class FusedLinearCrossEntropyLoss(Module):
    """The LM head and its loss in one module: ``lm_head`` + ``CrossEntropyLoss``
    without the logits. Give it the head's weight (and bias), which it shares
    (tied: the same Parameter objects, state-dict keys ``weight`` and ``bias``
    as ``nn.Linear``; a tensor that is not a Parameter, such as a head merged
    from an adapter, is kept as it is, a buffer, and its gradient flows to
    what it was computed from), or build it from the head with
    :meth:`from_linear`;
    ``forward(hidden [..., D], target [...])`` returns the loss (and the
    z-loss part with ``return_z_loss=True``). Options as
    :func:`opsmith.fused_linear_cross_entropy`."""

    __constants__ = ["ignore_index", "reduction", "label_smoothing", "z_loss", "softcap", "return_z_loss",
                     "chunk_size"]

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                 softcap: Optional[float] = None, return_z_loss: bool = False,
                 chunk_size: Optional[int] = None) -> None:
        super().__init__()
        _reduction(reduction)
        _softcap(softcap)
        _chunk(chunk_size)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError("FusedLinearCrossEntropyLoss: weight must be the lm_head weight, a [V, D] tensor")
        # a Parameter is shared as the module's own; any other tensor (a head
        # merged from an adapter, computed from other tensors) is kept as it
        # is, a buffer, so its gradient reaches what it was computed from
        for name, t in (("weight", weight), ("bias", bias)):
            if t is None or isinstance(t, torch.nn.Parameter):
                self.register_parameter(name, t)
            else:
                self.register_buffer(name, t)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.return_z_loss = return_z_loss
        self.chunk_size = chunk_size

    @classmethod
    def from_linear(cls, lm_head: torch.nn.Linear, **kwargs) -> "FusedLinearCrossEntropyLoss":
        """The loss over ``lm_head``'s own parameters (shared, not copied)."""
        return cls(lm_head.weight, lm_head.bias, **kwargs)

    def forward(self, hidden: torch.Tensor, target: torch.Tensor):
        return fused_linear_cross_entropy(hidden, self.weight, target, self.bias, self.ignore_index, self.reduction,
                                          self.label_smoothing, self.z_loss, self.softcap,
                                          return_z_loss=self.return_z_loss, chunk_size=self.chunk_size)

    def extra_repr(self) -> str:
        extra = (f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, "
                 f"bias={self.bias is not None}, ignore_index={self.ignore_index}, reduction={self.reduction!r}")
        extra += _options_repr(self)
        if self.chunk_size is not None:
            extra += f", chunk_size={self.chunk_size}"
        return extra


# --- what this op adds to opsmith, opsmith.nn and opsmith.pybind -------------------------
FUNCTIONS = {"fused_linear_cross_entropy": fused_linear_cross_entropy}
MODULES = {"FusedLinearCrossEntropyLoss": FusedLinearCrossEntropyLoss}
PYBIND = {"fused_linear_cross_entropy": fused_linear_cross_entropy_pybind,
          "FusedLinearCrossEntropyFunction": FusedLinearCrossEntropyFunction}
