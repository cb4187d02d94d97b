"""opsmith: fused operators for PyTorch, written in C and CUDA C.

Importing the package loads the route B library, so torch.ops.opsmith.*
exists; opsmith.rms_norm and friends are thin wrappers over those ops,
re-exported from each op's module in opsmith/ops/. Route A (pybind11 +
autograd.Function) is opsmith.pybind, the modules opsmith.nn. opsmith.hf
(Hugging Face patching) and opsmith.pybind are imported on first use, so
`import opsmith` alone imports neither transformers nor the route A module.

A compiled part that is missing or does not load makes the import fail with
an ImportError naming it and the command that builds it for the way opsmith
was installed (opsmith/_library.py).
"""
from ._library import c_include_dir, c_library, library_path, version as _version
from . import ops

__version__ = _version()

globals().update(ops.exports("FUNCTIONS"))

from . import nn  # noqa: E402
from . import optim  # noqa: E402

__all__ = [*ops.exports("FUNCTIONS"), "nn", "optim", "ops", "library_path", "c_library", "c_include_dir"]


def __getattr__(name):
    # opsmith.hf and opsmith.pybind on first use (PEP 562): `import opsmith`
    # then `opsmith.hf.patch(model)` works as `import opsmith.hf` would
    if name in ("hf", "pybind"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
