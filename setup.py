"""Builds opsmith's two PyTorch extensions over the C library (build/libopsmith.a,
made by the Makefile):

  opsmith/_C        route B: a plain shared library whose static initialisers
                    register the ops with the dispatcher (TORCH_LIBRARY); loaded
                    with torch.ops.load_library, no Python module init.
  opsmith/_pybind   route A: a pybind11 module exposing the same bridge functions.

torch.utils.cpp_extension supplies the compiler flags, include paths and
libraries of whichever torch is installed, and ninja recompiles only what
changed. OPSMITH_WITH_CUDA=0 builds CPU-only.
"""
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
WITH_CUDA = os.environ.get("OPSMITH_WITH_CUDA", "1") == "1"
Extension = CUDAExtension if WITH_CUDA else CppExtension


def here(*parts):
    return os.path.join(ROOT, *parts)


BRIDGE = ["csrc/torch/rms_norm.cpp"]
HEADERS = [here("include", "opsmith.h"), here("csrc", "torch", "bridge.h")]
COMMON = dict(
    include_dirs=[here("include"), here("csrc")],
    extra_objects=[here("build", "libopsmith.a")],
    extra_compile_args={"cxx": ["-O2", f"-DOPSMITH_WITH_CUDA={int(WITH_CUDA)}"]},
    extra_link_args=["-fopenmp"],
    # relink when the C library or a bridge header changes
    depends=[here("build", "libopsmith.a")] + HEADERS,
)

setup(
    name="opsmith",
    ext_modules=[
        Extension("opsmith._C", BRIDGE + ["csrc/torch/ops.cpp"], **COMMON),
        Extension("opsmith._pybind", BRIDGE + ["csrc/torch/pybind.cpp"], **COMMON),
    ],
    cmdclass={"build_ext": BuildExtension},
)
