"""Route A: the pybind11 module opsmith._pybind, wrapped in
torch.autograd.Function. Outside the dispatcher (so not traceable by
torch.compile without a graph break, and refused under torch.func
transforms), and bit for bit the same numbers as route B: both call the same
bridge and kernels. Each op's Function lives in opsmith/ops/<op>.py."""
from . import _library

_library.route_a_module()  # a missing route A fails here, at import, saying how to build it
from .ops import exports as _exports

globals().update(_exports("PYBIND"))

__all__ = list(_exports("PYBIND"))
