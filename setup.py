"""Builds opsmith's two PyTorch extensions over the C library (build/libopsmith.a,
made by the Makefile):

  opsmith/_C        route B: a plain shared library whose static initialisers
                    register the ops with the dispatcher (TORCH_LIBRARY and one
                    TORCH_LIBRARY_FRAGMENT per op); loaded with
                    torch.ops.load_library, no Python module init.
  opsmith/_pybind   route A: a pybind11 module exposing the same bridge
                    functions; the bridge files are compiled again with
                    OPSMITH_ROUTE_A=1, which keeps their dispatcher
                    registrations out of it.

Every op's bridge is csrc/torch/<op>.cpp, found here without a list.
torch.utils.cpp_extension supplies the compiler flags, include paths and
libraries of whichever torch is installed, and ninja recompiles only what
changed. OPSMITH_WITH_CUDA=0 builds CPU-only.
"""
import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
WITH_CUDA = os.environ.get("OPSMITH_WITH_CUDA", "1") == "1"
Extension = CUDAExtension if WITH_CUDA else CppExtension


def here(*parts):
    return os.path.join(ROOT, *parts)


ROUTE_FILES = {"library.cpp", "pybind.cpp"}
BRIDGE = sorted(os.path.relpath(p, ROOT) for p in glob.glob(here("csrc", "torch", "*.cpp"))
                if os.path.basename(p) not in ROUTE_FILES)
HEADERS = sorted(glob.glob(here("include", "**", "*.h"), recursive=True) + glob.glob(here("csrc", "torch", "*.h")))


def common(route_a: bool):
    flags = ["-O2", f"-DOPSMITH_WITH_CUDA={int(WITH_CUDA)}", f"-DOPSMITH_ROUTE_A={int(route_a)}"]
    return dict(
        include_dirs=[here("include"), here("csrc")],
        extra_objects=[here("build", "libopsmith.a")],
        extra_compile_args={"cxx": flags},
        extra_link_args=["-fopenmp"],
        # relink when the C library or a bridge header changes
        depends=[here("build", "libopsmith.a")] + HEADERS,
    )


class BuildRoutes(BuildExtension):
    """The bridge sources are shared by both extensions, with different
    flags: each extension gets its own object directory, so ninja does not
    reuse route B's objects (with dispatcher registrations) for route A."""

    def build_extension(self, ext):
        temp = self.build_temp
        self.build_temp = os.path.join(temp, ext.name.replace(".", "_"))
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = temp


setup(
    name="opsmith",
    ext_modules=[
        Extension("opsmith._C", BRIDGE + ["csrc/torch/library.cpp"], **common(False)),
        Extension("opsmith._pybind", BRIDGE + ["csrc/torch/pybind.cpp"], **common(True)),
    ],
    cmdclass={"build_ext": BuildRoutes},
)
