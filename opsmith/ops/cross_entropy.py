"""cross_entropy in Python: the functional API (route B), the fake kernels of its
dispatcher ops, the route A autograd.Function, and the nn module. The
dispatcher imports this module for the fake kernels when the library is
loaded on its own (m.set_python_module in csrc/torch).

The forward computes the logit gradient in the pass that reads the logits
whenever the logits require grad (the training call): the backward then
only multiplies it by the incoming gradient, which the kernel skips where
that gradient is exactly 1 (``loss.backward()``)."""
import math
from typing import Optional

import torch

from . import Module, register_fake
from .. import _library  # noqa: F401  (loads the library: torch.ops.opsmith.* exists after this)
from . import first_order_only, graph_anchors, pybind_double_backward_error, route_a

_fwd = torch.ops.opsmith.cross_entropy_fwd.default
_fwd_inplace = torch.ops.opsmith.cross_entropy_fwd_.default
_bwd = torch.ops.opsmith.cross_entropy_bwd.default

_REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}


def _reduction(reduction):
    if reduction not in _REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    return _REDUCTIONS[reduction]


def _softcap(softcap):
    if softcap is None:
        return 0.0
    softcap = float(softcap)
    # comparisons, not math.isfinite: torch.compile traces them on a symbolic float (NaN fails both)
    if not (0 < softcap < math.inf):
        raise ValueError(f"cross_entropy: softcap must be None or finite and > 0, got {softcap}")
    return softcap


def _rows(logits, target):
    """(N, V) logits and (N) target from [..., V] and [...]; the loss shape of reduction none."""
    if target.is_floating_point():
        raise RuntimeError(f"cross_entropy: target must be int64 class indices, got {target.dtype} "
                           "(probability targets are not supported)")
    if logits.dim() == 0:
        raise RuntimeError("cross_entropy: logits must have at least one dim (the classes, last)")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise RuntimeError(f"cross_entropy: target must have shape {list(logits.shape[:-1])} (logits' shape without "
                           f"the class dim, which is last), got {list(target.shape)}")
    if logits.dim() == 2:
        return logits, target, target.shape
    return logits.reshape(-1, logits.shape[-1]), target.reshape(-1), target.shape


def _options_repr(module) -> str:
    """The loss options a module shows in its repr where they are set."""
    extra = ""
    if module.label_smoothing:
        extra += f", label_smoothing={module.label_smoothing}"
    if module.z_loss:
        extra += f", z_loss={module.z_loss}"
    if module.softcap is not None:
        extra += f", softcap={module.softcap}"
    if getattr(module, "loss_dtype", None) is not None:
        extra += f", loss_dtype={module.loss_dtype}"
    return extra


_HALF = (torch.float16, torch.bfloat16)


def _loss_dtype(logits, loss_dtype):
    """The loss dtype to ask the op for: None (the logits' own) unless given,
    and float32 for 16-bit logits under autocast, as PyTorch (autocast runs
    cross_entropy in float32, so its loss is float32)."""
    if loss_dtype is not None:
        if not isinstance(loss_dtype, torch.dtype):
            raise TypeError(f"cross_entropy: loss_dtype must be None or a torch.dtype, got {loss_dtype!r}")
        return loss_dtype
    if logits.dtype in _HALF and torch.is_autocast_enabled(logits.device.type):
        return torch.float32
    return None


def _validate(error, n, ignore_index):
    # one host synchronisation, asked for (validate=True)
    flag, row, value = error.tolist()
    if flag:
        raise IndexError(f"cross_entropy: target {value} (row {row}) is out of range [0, {n}) "
                         f"and not ignore_index ({ignore_index})")


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor] = None,
                  ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                  z_loss: float = 0.0, softcap: Optional[float] = None, *, return_z_loss: bool = False,
                  inplace_grad: bool = False, validate: bool = False, loss_dtype: Optional[torch.dtype] = None):
    """Softmax cross-entropy over the last dim, as ``torch.nn.functional.cross_entropy``.

    logits ``[..., V]`` (float64, float32, float16, bfloat16; float32 math for
    16-bit), target ``[...]`` int64 class indices, weight ``[V]`` in logits'
    dtype or, beside 16-bit logits, float32 (read unrounded). ``z_loss`` adds ``z_loss * lse**2`` per token (reduced like the
    loss; ``return_z_loss=True`` returns ``(loss, z_loss_part)``), ``softcap``
    applies ``softcap * tanh(logits / softcap)`` first (Gemma 2).
    ``inplace_grad=True`` writes the logit gradient over the logits' memory
    when there is a gradient to compute (logits must not be used again; eager
    mode; under no_grad nothing is written). Out-of-range targets: on the
    CPU an IndexError naming the target; on CUDA that row's loss is NaN and a
    device-side flag records it, checked (one host synchronisation) when
    ``validate=True``. Every target ignored with reduction mean gives NaN, as
    PyTorch. The loss (and z-loss part) has the logits' dtype, and under
    autocast float32 for 16-bit logits, as PyTorch's; ``loss_dtype`` asks
    for one: the logits' dtype or ``torch.float32`` (float64 logits: float64),
    the kernel's float32 value unrounded (the logits are not copied, and the
    logit gradient keeps the logits' dtype)."""
    red = _reduction(reduction)
    cap = _softcap(softcap)
    if inplace_grad and logits.requires_grad and (logits.is_leaf or (logits._base is not None and logits._base.is_leaf)):
        raise RuntimeError("cross_entropy: inplace_grad=True writes the gradient over logits, which must not be a "
                           "leaf that requires grad (it is meant for the output of the lm head); use inplace_grad=False")
    x, t, shape = _rows(logits, target)
    ldt = _loss_dtype(logits, loss_dtype)
    # no gradient to compute (no_grad, evaluation): the logits are left as they are
    if inplace_grad and torch.is_grad_enabled() and logits.requires_grad:
        loss, z, error = _fwd_inplace(x, t, weight, ignore_index, float(label_smoothing), float(z_loss), cap, red,
                                      loss_dtype=ldt)
    else:
        loss, z, _dl, error = _fwd(x, t, weight, ignore_index, float(label_smoothing), float(z_loss), cap, red,
                                   loss_dtype=ldt)
    if validate:
        _validate(error, logits.shape[-1], ignore_index)
    if red == 0:
        loss, z = loss.view(shape), z.view(shape)
    return (loss, z) if return_z_loss else loss


# --- fake kernels ------------------------------------------------------------------

def _fake_outputs(logits, target, label_smoothing, z_loss, softcap, reduction, loss_dtype):
    torch._check(logits.dim() == 2, lambda: f"cross_entropy: logits must be 2-D (N, V), got {list(logits.shape)}")
    torch._check(target.dtype == torch.int64, lambda: f"cross_entropy: target must be int64 class indices, got {target.dtype}")
    torch._check(target.dim() == 1 and target.shape[0] == logits.shape[0],
                 lambda: f"cross_entropy: target must have shape [{logits.shape[0]}] (logits' rows), got {list(target.shape)}")
    torch._check(0.0 <= label_smoothing <= 1.0, lambda: f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    torch._check(math.isfinite(z_loss) and z_loss >= 0, lambda: f"cross_entropy: z_loss must be finite and >= 0, got {z_loss}")
    torch._check(math.isfinite(softcap) and softcap >= 0, lambda: f"cross_entropy: softcap must be finite and > 0 (or 0: none), got {softcap}")
    torch._check(0 <= reduction <= 2, lambda: f"cross_entropy: reduction must be 0 (none), 1 (sum) or 2 (mean), got {reduction}")
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    ldt = logits.dtype if loss_dtype is None else loss_dtype
    torch._check(ldt in (logits.dtype, acc),
                 lambda: f"cross_entropy: loss_dtype must be None, logits' dtype ({logits.dtype}) or {acc}, got {ldt}")
    shape = (logits.shape[0],) if reduction == 0 else ()
    return (logits.new_empty(shape, dtype=ldt), logits.new_empty(shape, dtype=ldt),
            logits.new_empty((3,), dtype=torch.int64))


@register_fake("opsmith::cross_entropy_fwd")
def _fwd_fake(logits, target, weight=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=0.0,
              reduction=2, compute_grad=False, loss_dtype=None):
    loss, z, error = _fake_outputs(logits, target, label_smoothing, z_loss, softcap, reduction, loss_dtype)
    dl = logits.new_empty(logits.shape) if compute_grad else logits.new_empty((0,))
    return loss, z, dl, error


@register_fake("opsmith::cross_entropy_fwd_")
def _fwd_inplace_fake(logits, target, weight=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=0.0,
                      reduction=2, loss_dtype=None):
    return _fake_outputs(logits, target, label_smoothing, z_loss, softcap, reduction, loss_dtype)


@register_fake("opsmith::cross_entropy_bwd")
def _bwd_fake(grad, dlogits):
    torch._check(grad.dim() == 0 or (grad.dim() == 1 and grad.shape[0] == dlogits.shape[0]),
                 lambda: "cross_entropy: grad must be a scalar (reduction sum or mean) or have one value per row")
    return dlogits.new_empty(dlogits.shape)


@register_fake("opsmith::cross_entropy_bwd_")
def _bwd_inplace_fake(grad, dlogits):
    return None


_VMAP_ERROR = ("cross_entropy: torch.func.vmap is not supported; fold the batch dim into the rows "
               "(logits [B * N, V]) or use torch.nn.functional.cross_entropy")


def _refuse_vmap(*args, **kwargs):
    raise RuntimeError(_VMAP_ERROR)


for _name in ("cross_entropy_fwd", "cross_entropy_fwd_", "cross_entropy_bwd"):
    torch.library.register_vmap(f"opsmith::{_name}")(_refuse_vmap)


# --- route A: pybind11 + torch.autograd.Function -------------------------------------

PYBIND_DOUBLE_BACKWARD_ERROR = pybind_double_backward_error("cross_entropy", "torch.nn.functional.cross_entropy")


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, weight, ignore_index, label_smoothing, z_loss, softcap, reduction,
                loss_dtype=None, anchors=()):
        if weight is not None and weight.requires_grad:
            raise RuntimeError("cross_entropy: the gradient of weight is not implemented (as in PyTorch); "
                               "pass weight.detach()")
        loss, z, dl, error = route_a().cross_entropy_fwd(logits, target, weight, ignore_index, label_smoothing,
                                                         z_loss, softcap, reduction, logits.requires_grad,
                                                         loss_dtype)
        ctx.save_for_backward(dl)
        # only the precomputed gradient is saved: the anchors tie the
        # backward's result to the logits' graph (graph_anchors)
        ctx.anchors = anchors
        ctx.mark_non_differentiable(z, error)
        return loss, z, error

    @staticmethod
    @first_order_only(PYBIND_DOUBLE_BACKWARD_ERROR)
    def backward(ctx, g, _gz, _gerror):
        (dl,) = ctx.saved_tensors
        # a float32 loss's gradient is float32: the kernel reads it as it is
        return route_a().cross_entropy_bwd(g, dl), None, None, None, None, None, None, None, None, None


PYBIND_TRANSFORM_ERROR = ("opsmith.pybind.cross_entropy: route A does not support torch.func transforms "
                          "(grad, vjp, jvp, vmap); use opsmith.cross_entropy")


def cross_entropy_pybind(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor] = None,
                         ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                         z_loss: float = 0.0, softcap: Optional[float] = None, *, return_z_loss: bool = False,
                         validate: bool = False, loss_dtype: Optional[torch.dtype] = None):
    """Route A twin of opsmith.cross_entropy (opsmith.pybind.cross_entropy): same bits.
    First-order gradients only; not under torch.func transforms; no inplace_grad."""
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(PYBIND_TRANSFORM_ERROR)
    red = _reduction(reduction)
    x, t, shape = _rows(logits, target)
    loss, z, error = CrossEntropyFunction.apply(x, t, weight, ignore_index, float(label_smoothing), float(z_loss),
                                                _softcap(softcap), red, _loss_dtype(logits, loss_dtype),
                                                graph_anchors(x))
    if validate:
        _validate(error, logits.shape[-1], ignore_index)
    if red == 0:
        loss, z = loss.view(shape), z.view(shape)
    return (loss, z) if return_z_loss else loss


# --- the nn module ---------------------------------------------------------------------

class CrossEntropyLoss(Module):
    """Drop-in for ``torch.nn.CrossEntropyLoss`` (same arguments, same
    ``weight`` buffer in the state dict; class indices as targets, classes in
    the last dim), plus ``z_loss``, ``softcap``, ``return_z_loss``,
    ``inplace_grad`` and ``loss_dtype`` as in :func:`opsmith.cross_entropy`."""

    __constants__ = ["ignore_index", "reduction", "label_smoothing", "z_loss", "softcap", "return_z_loss",
                     "inplace_grad", "loss_dtype"]

    def __init__(self, weight: Optional[torch.Tensor] = None, size_average=None, ignore_index: int = -100,
                 reduce=None, reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                 softcap: Optional[float] = None, return_z_loss: bool = False, inplace_grad: bool = False,
                 loss_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        if size_average is not None or reduce is not None:
            reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
        _reduction(reduction)
        _softcap(softcap)
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.return_z_loss = return_z_loss
        self.inplace_grad = inplace_grad
        self.loss_dtype = loss_dtype

    def forward(self, input: torch.Tensor, target: torch.Tensor):
        return cross_entropy(input, target, self.weight, self.ignore_index, self.reduction, self.label_smoothing,
                             self.z_loss, self.softcap, return_z_loss=self.return_z_loss,
                             inplace_grad=self.inplace_grad, loss_dtype=self.loss_dtype)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}" + _options_repr(self)


# --- what this op adds to opsmith, opsmith.nn and opsmith.pybind -------------------------
FUNCTIONS = {"cross_entropy": cross_entropy}
MODULES = {"CrossEntropyLoss": CrossEntropyLoss}
PYBIND = {"cross_entropy": cross_entropy_pybind, "CrossEntropyFunction": CrossEntropyFunction}
