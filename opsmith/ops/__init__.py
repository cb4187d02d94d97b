"""The op list. Each op has its own module here (opsmith/ops/<op>.py: the
functional API, fake kernels, vmap rules, the route A autograd.Function and
the nn module) that declares what it adds to the package:

    FUNCTIONS = {name: function}  ->  opsmith.<name>
    MODULES   = {name: nn.Module} ->  opsmith.nn.<name>
    PYBIND    = {name: route A}   ->  opsmith.pybind.<name>

Adding an op = its module + one entry in OP_MODULES (its spec lives in
opsmith/specs/<op>.py, found from the same list)."""
import importlib
from typing import Dict, List

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
