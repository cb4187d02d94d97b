"""Modules over the functional API, drop-in replacements for their PyTorch
counterparts: same constructor arguments, parameter names and state-dict keys.
Each is defined in its op's module (opsmith/ops/<op>.py) and re-exported here."""
from .ops import exports as _exports

globals().update(_exports("MODULES"))

__all__ = list(_exports("MODULES"))
