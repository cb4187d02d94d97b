"""Builds opsmith: the C library (by the Makefile, with gcc and nvcc alone)
and the two PyTorch extensions over it:

  opsmith/_C        route B: a plain shared library whose static initialisers
                    register the ops with the dispatcher (TORCH_LIBRARY and one
                    TORCH_LIBRARY_FRAGMENT per op); loaded with
                    torch.ops.load_library, no Python module init.
  opsmith/_pybind   route A: a pybind11 module exposing the same bridge
                    functions; the bridge files are compiled again with
                    OPSMITH_ROUTE_A=1, which keeps their dispatcher
                    registrations out of it.

The kernels are compiled once, into build/libopsmith.a, which both
extensions link; the wheel also carries the C library itself
(opsmith/lib/libopsmith.so and opsmith/include/) for C programs.

Works from `make`, `pip install --no-build-isolation .` and
`pip install --no-build-isolation -e .` alike: the C library is built here
when it is missing or stale. CUDA is built when nvcc is found (on PATH, in
CUDA_HOME or /usr/local/cuda); without it a CPU-only build, with a warning.
OPSMITH_WITH_CUDA=0/1 overrides the detection.

Every op's bridge is csrc/torch/<op>.cpp, found here without a list.
torch.utils.cpp_extension supplies the compiler flags, include paths and
libraries of whichever torch is installed, and ninja recompiles only what
changed.
"""
import filecmp
import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def here(*parts):
    return os.path.join(ROOT, *parts)


def find_nvcc():
    for candidate in (shutil.which("nvcc"),
                      os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc") if os.environ.get("CUDA_HOME") else None,
                      "/usr/local/cuda/bin/nvcc"):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


NVCC = find_nvcc()
if "OPSMITH_WITH_CUDA" in os.environ:
    WITH_CUDA = os.environ["OPSMITH_WITH_CUDA"] == "1"
else:
    WITH_CUDA = NVCC is not None
if WITH_CUDA and NVCC is None:
    sys.exit("opsmith: OPSMITH_WITH_CUDA=1 but no nvcc was found (PATH, CUDA_HOME, /usr/local/cuda)")
if not WITH_CUDA and "OPSMITH_WITH_CUDA" not in os.environ:
    print("opsmith: WARNING: no CUDA toolkit (nvcc) found: building the CPU kernels only", file=sys.stderr)
if WITH_CUDA and NVCC and "CUDA_HOME" not in os.environ:
    os.environ["CUDA_HOME"] = os.path.dirname(os.path.dirname(NVCC))  # for cpp_extension
Extension = CUDAExtension if WITH_CUDA else CppExtension


def version():
    """MAJOR.MINOR.PATCH from include/opsmith.h, the one place it is written."""
    with open(here("include", "opsmith.h")) as f:
        text = f.read()
    parts = [re.search(rf"#define OPSMITH_VERSION_{k} (\d+)", text).group(1) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(parts)


_C_LIBRARY_BUILT = []


def build_c_library():
    """`make lib so`: the static library the extensions link and the shared
    one the wheel carries; make rebuilds only what changed. Once a run:
    build_ext and build_py both need it."""
    if _C_LIBRARY_BUILT:
        return
    make = ["make", "-C", ROOT, f"-j{os.cpu_count() or 1}", "lib", "so"]
    if not WITH_CUDA:
        make.append("NVCC=")
    else:
        make.append(f"NVCC={NVCC}")
    subprocess.check_call(make)
    _C_LIBRARY_BUILT.append(True)


ROUTE_FILES = {"library.cpp", "pybind.cpp"}
BRIDGE = sorted(os.path.relpath(p, ROOT) for p in glob.glob(here("csrc", "torch", "*.cpp"))
                if os.path.basename(p) not in ROUTE_FILES)
HEADERS = sorted(glob.glob(here("include", "**", "*.h"), recursive=True) + glob.glob(here("csrc", "torch", "*.h")))


def common(route_a: bool):
    flags = ["-O2", f"-DOPSMITH_WITH_CUDA={int(WITH_CUDA)}", f"-DOPSMITH_ROUTE_A={int(route_a)}"]
    archive = here("build", "libopsmith.a")
    # route B carries the whole C ABI (opsmith.doctor and ctypes callers ask it
    # for functions no bridge calls, such as opsmith_has_cuda); route A only
    # what its bridge uses
    link = ["-fopenmp"] if route_a else ["-Wl,--whole-archive", archive, "-Wl,--no-whole-archive", "-fopenmp"]
    if WITH_CUDA:
        # fused_linear_cross_entropy's matrix products (cuBLASLt, the same major
        # version as torch's own): after the archive that uses it, or a linker
        # with --as-needed drops it
        link.append("-lcublasLt")
    return dict(
        include_dirs=[here("include"), here("csrc")],
        extra_objects=[archive] if route_a else [],
        extra_compile_args={"cxx": flags},
        extra_link_args=link,
        # relink when the C library or a bridge header changes
        depends=[here("build", "libopsmith.a")] + HEADERS,
    )


class BuildRoutes(BuildExtension):
    """Builds the C library first, then the extensions. The bridge sources
    are shared by both extensions, with different flags: each extension gets
    its own object directory, so ninja does not reuse route B's objects (with
    dispatcher registrations) for route A."""

    def finalize_options(self):
        super().finalize_options()
        # setuptools adds a virtual environment's include/ (headers of packages
        # installed there, usually none): an empty one is dropped so that the
        # compile commands are the same from every interpreter and ninja
        # reuses the objects (make, pip install, pip install -e alike)
        venv_include = os.path.join(sys.exec_prefix, "include")
        if sys.exec_prefix != sys.base_exec_prefix and not any(files for _, _, files in os.walk(venv_include)):
            self.include_dirs = [d for d in self.include_dirs if os.path.abspath(d) != os.path.abspath(venv_include)]

    def run(self):
        build_c_library()
        super().run()

    def build_extension(self, ext):
        # one object directory in the tree whoever builds (pip's editable
        # build passes a temporary one): a pip install after `make` compiles
        # nothing again
        temp, sources, extra = self.build_temp, ext.sources, ext.extra_objects
        self.build_temp = object_dir(ROOT, self.plat_name, ext.name)
        reused = reused_objects(ext, self.plat_name)
        ext.sources = [s for s in sources if s not in reused]
        # before the C library archive (route A), which resolves their symbols
        ext.extra_objects = list(reused.values()) + list(extra)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp, ext.sources, ext.extra_objects = temp, sources, extra


def object_dir(root, plat_name, ext_name):
    return os.path.join(root, "build", f"temp.{plat_name}-{sys.implementation.cache_tag}", ext_name.replace(".", "_"))


def reused_objects(ext, plat_name):
    """OPSMITH_REUSE_OBJECTS_FROM=TREE (`make new-op-check`, which builds a
    copy of the tree with one op added): each bridge source identical to
    TREE's, whose object TREE built after it, is linked from TREE's object
    instead of compiled again ({source: object}). Sound only for a tree that
    differs from TREE by added ops (the shared headers gained declarations
    no existing source uses); at least one source is compiled."""
    other = os.environ.get("OPSMITH_REUSE_OBJECTS_FROM")
    if not other or os.path.abspath(other) == ROOT:
        return {}
    objects = object_dir(os.path.abspath(other), plat_name, ext.name)
    reused = {}
    for src in ext.sources:
        theirs, obj = os.path.join(other, src), os.path.join(objects, os.path.splitext(src)[0] + ".o")
        if (os.path.isfile(theirs) and os.path.isfile(obj) and os.path.getmtime(obj) >= os.path.getmtime(theirs)
                and filecmp.cmp(here(src), theirs, shallow=False)):
            reused[src] = obj
    if len(reused) == len(ext.sources):
        reused.pop(ext.sources[-1])
    return reused


class BuildPy(build_py):
    """Puts the C library and its headers into the package: opsmith/lib,
    opsmith/include (opsmith.c_library() and opsmith.c_include_dir() find them)."""

    def run(self):
        super().run()
        build_c_library()
        target = os.path.join(self.build_lib, "opsmith")
        os.makedirs(os.path.join(target, "lib"), exist_ok=True)
        shutil.copy2(here("build", "libopsmith.so"), os.path.join(target, "lib", "libopsmith.so"))
        include = os.path.join(target, "include")
        if os.path.isdir(include):
            shutil.rmtree(include)
        shutil.copytree(here("include"), include)


setup(
    version=version(),
    packages=find_packages(include=["opsmith", "opsmith.*"]),
    # `opsmith new-op`'s templates (opsmith/templates/new_op/<group>/*.in)
    package_data={"opsmith": ["templates/new_op/*/*.in"]},
    ext_modules=[
        Extension("opsmith._C", BRIDGE + ["csrc/torch/library.cpp"], **common(False)),
        Extension("opsmith._pybind", BRIDGE + ["csrc/torch/pybind.cpp"], **common(True)),
    ],
    cmdclass={"build_ext": BuildRoutes, "build_py": BuildPy},
)
