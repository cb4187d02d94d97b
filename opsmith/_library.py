"""Finds and loads the route B shared library (opsmith/_C*.so)."""
import glob
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))


def library_path() -> str:
    """Path of the route B library; torch.ops.load_library(path) registers the
    ops on its own, without this package."""
    found = sorted(glob.glob(os.path.join(_HERE, "_C*.so")))
    if not found:
        raise ImportError(
            "opsmith: the compiled library opsmith/_C*.so is missing; build it with `make build`"
        )
    return found[0]


torch.ops.load_library(library_path())
