"""opsmith: fused operators for PyTorch, written in C and CUDA C.

Importing the package loads the route B library, so torch.ops.opsmith.*
exists; opsmith.rms_norm and friends are thin wrappers over those ops.
Route A (pybind11 + autograd.Function) lives in opsmith.pybind.
"""
from ._library import library_path
from . import ops
from .ops import rms_norm
from . import nn

__all__ = ["rms_norm", "nn", "ops", "library_path"]
