"""Route A: the pybind11 module opsmith._pybind, wrapped in
torch.autograd.Function. Outside the dispatcher (so not traceable by
torch.compile without a graph break, and refused under torch.func
transforms), and bit for bit the same numbers as route B: both call the same
bridge and kernels. Each op's Function lives in opsmith/ops/<op>.py."""
from . import _library

try:
    from . import _pybind  # noqa: F401  (a missing route A fails here, at import)
except ImportError as e:
    _path = _library._find(_library.ROUTE_A[0])
    if _path is None:
        raise _library.missing_error(_library.missing_parts(_library.ROUTE_A)) from None
    raise _library.missing_error([f"{_library.ROUTE_A[1]} {_path} does not load ({e})"]) from e
from .ops import exports as _exports

globals().update(_exports("PYBIND"))

__all__ = list(_exports("PYBIND"))
