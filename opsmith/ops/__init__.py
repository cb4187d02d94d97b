"""The op list. Each op has its own module here (opsmith/ops/<op>.py: the
functional API, fake kernels, vmap rules, the route A autograd.Function and
the nn module) that declares what it adds to the package:

    FUNCTIONS = {name: function}  ->  opsmith.<name>
    MODULES   = {name: nn.Module} ->  opsmith.nn.<name>
    PYBIND    = {name: route A}   ->  opsmith.pybind.<name>

Adding an op = its module + one entry in OP_MODULES (its spec lives in
opsmith/specs/<op>.py, found from the same list)."""
import functools
import importlib
import inspect
from typing import Dict, List

import torch

OP_MODULES = (
    "rms_norm",
    "glu",
    "layer_norm",
    "fused_add_rms_norm",
    "rotary",
    "adamw",
    "cross_entropy",
    "softmax",
    "fused_linear_cross_entropy",
)

_KINDS = ("FUNCTIONS", "MODULES", "PYBIND")

_route_a = None


def route_a():
    """The route A module (opsmith._pybind), imported on first use: `import
    opsmith` does not need it."""
    global _route_a
    if _route_a is None:
        from .._library import route_a_module
        _route_a = route_a_module()
    return _route_a


def register_fake(qualname: str):
    """torch.library.register_fake with the bridge's device rule checked:
    every tensor argument on the first one's device. One tensor on the meta
    device beside real ones (a weight never loaded from a checkpoint) sends
    the call to the fake kernel, not to the bridge that would refuse it; the
    fake kernel refuses it too rather than return uninitialised memory."""
    op = qualname.split("::", 1)[1]

    def decorate(fake):
        signature = inspect.signature(fake)

        @functools.wraps(fake)
        def checked(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            tensors = [(name, t) for name, t in bound.items() if isinstance(t, torch.Tensor)]
            if tensors:
                first, device = tensors[0][0], tensors[0][1].device
                for name, t in tensors[1:]:
                    torch._check(t.device == device, lambda: f"{op}: {name} must be on the same device as {first} "
                                                             f"({device}), got {t.device}")
            return fake(*args, **kwargs)

        # _stacklevel: torch records the op module (the decorator's caller) as
        # the fake kernel's home, which it checks against set_python_module
        torch.library.register_fake(qualname, checked, _stacklevel=2)
        return fake

    return decorate


def op_modules() -> List:
    return [importlib.import_module(f"{__name__}.{name}") for name in OP_MODULES]


def exports(kind: str) -> Dict[str, object]:
    """Every op's `kind` (FUNCTIONS, MODULES or PYBIND) merged, in list order;
    a name two ops both export is an error."""
    assert kind in _KINDS, kind
    out: Dict[str, object] = {}
    for module in op_modules():
        for name, obj in getattr(module, kind, {}).items():
            if name in out:
                raise ImportError(f"opsmith: {module.__name__} exports {kind} {name!r}, already exported")
            out[name] = obj
    return out


# --- route A: backwards that refuse to be differentiated -------------------------------

class _Refused(torch.autograd.Function):
    """The first `count` tensors as they are, in a graph through all of
    them whose backward raises `message`."""

    @staticmethod
    def forward(ctx, message, count, *tensors):
        ctx.message = message
        return tensors[:count]

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


class _Anchor(torch.autograd.Function):
    """An empty tensor in the inputs' graph: no kernel, and it keeps none of
    their storage alive."""

    @staticmethod
    def forward(ctx, *tensors):
        return tensors[0].new_empty(0)

    @staticmethod
    def backward(ctx, grad):
        return (None,) * len(ctx.needs_input_grad)


def graph_anchors(*tensors) -> list:
    """For a route A Function that saves none of its differentiable inputs:
    ``[anchor]`` of those that require grad (``[]`` when none does, or grad
    mode is off), to pass to ``.apply`` and keep as ``ctx.anchors``, so
    first_order_only can tie the backward's outputs to the inputs' graph. A
    list, not a tensor argument: the Function gets no extra edge."""
    needed = [t for t in tensors if t is not None and t.requires_grad]
    if not torch.is_grad_enabled() or not needed:
        return []
    return [_Anchor.apply(*needed)]


def check_param(op: str, optional: bool = True, **params) -> None:
    """A TypeError naming the argument where a norm's weight or bias is not a
    tensor (or None, where optional): for a shape, that torch.nn.functional's
    norms take normalized_shape second, opsmith's normalize over the last dim
    and take the weight there."""
    for name, value in params.items():
        if isinstance(value, torch.Tensor) or (optional and value is None):
            continue
        if isinstance(value, (tuple, list, int, torch.Size)) and not isinstance(value, bool):
            raise TypeError(f"{op}: {name} must be a tensor{' or None' if optional else ''}, got "
                            f"{type(value).__name__} {value!r}: opsmith.{op} normalizes over the last dim of x "
                            f"and takes no normalized_shape (torch.nn.functional's second argument); for "
                            f"several trailing dims use the module, or flatten them into the last")
        raise TypeError(f"{op}: {name} must be a tensor"
                        f"{' or None' if optional else ' of the hidden size (this norm always has one)'}, "
                        f"got {type(value).__name__}")


def pybind_double_backward_error(name: str, alternative: str) -> str:
    """Route A's refusal of double backward for opsmith.pybind.<name>."""
    return (f"opsmith.pybind.{name}: double backward is not supported (route A's backward is not "
            f"differentiable); compute higher-order gradients with {alternative}")


class Module(torch.nn.Module):
    """The base of opsmith.nn's modules. torch.jit.script calls
    ``__prepare_scriptable__`` first: the forwards call Python wrappers
    (keyword-only options, dtype logic) that TorchScript cannot compile, so
    it is refused in words that name the module and what works instead,
    where TorchScript's own error names none."""

    def __prepare_scriptable__(self):
        raise RuntimeError(f"opsmith.nn.{type(self).__name__}: torch.jit.script is not supported; use torch.jit.trace, "
                           "torch.compile or torch.export (each works with opsmith's ops)")


def first_order_only(message):
    """Decorates a route A Function's backward (under @staticmethod) whose
    result is not differentiable. With create_graph=True, the gradients come
    back in a graph through the incoming gradients, the saved tensors and
    ``ctx.anchors`` (graph_anchors) that raises ``message`` (a str, or
    ctx -> str) when differentiated.

    Not @once_differentiable: its error node hangs on fresh detached leaves,
    so ``torch.autograd.grad(grads, inputs, allow_unused=True)`` never
    reaches it and returns None, and a constant incoming gradient gives no
    graph at all (silent zeros)."""

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if not torch.is_grad_enabled():  # no create_graph: the backward as it is
                return backward(ctx, *grads)
            with torch.no_grad():
                outputs = backward(ctx, *grads)
            sources = [g for g in grads if isinstance(g, torch.Tensor) and g.requires_grad]
            sources += [t for t in ctx.saved_tensors if t is not None and t.requires_grad]
            sources += getattr(ctx, "anchors", [])
            single = isinstance(outputs, torch.Tensor)
            outs = (outputs,) if single else tuple(outputs)
            # one twin per tensor: a backward may return one gradient twice
            unique = list({id(t): t for t in outs if isinstance(t, torch.Tensor)}.values())
            if not sources or not unique:
                return outputs
            text = message(ctx) if callable(message) else message
            twins = dict(zip(map(id, unique), _Refused.apply(text, len(unique), *unique, *sources)))
            outs = tuple(twins[id(t)] if isinstance(t, torch.Tensor) else t for t in outs)
            return outs[0] if single else outs

        return wrapper

    return decorate
