"""Finds and loads the route B shared library (opsmith/_C*.so), and finds the
plain C library and its headers: in an installed package opsmith/lib and
opsmith/include (put there by setup.py), in the source tree build/ and
include/."""
import glob
import os
import re

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_TREE = os.path.dirname(_HERE)


def library_path() -> str:
    """Path of the route B library; torch.ops.load_library(path) registers the
    ops on its own, without this package."""
    found = sorted(glob.glob(os.path.join(_HERE, "_C*.so")))
    if not found:
        raise ImportError(
            "opsmith: the compiled library opsmith/_C*.so is missing; build it with `make build`"
        )
    return found[0]


def _first(*paths: str) -> str:
    for p in paths:
        if os.path.exists(p):
            return p
    return paths[0]


def c_include_dir() -> str:
    """Directory holding opsmith.h (the C ABI), for C and C++ programs."""
    return _first(os.path.join(_HERE, "include"), os.path.join(_TREE, "include"))


def c_library() -> str:
    """Path of libopsmith.so, the C library without PyTorch."""
    return _first(os.path.join(_HERE, "lib", "libopsmith.so"), os.path.join(_TREE, "build", "libopsmith.so"))


def c_flags() -> str:
    """Compiler and linker flags for a C program over opsmith.h and libopsmith.so."""
    libdir = os.path.dirname(c_library())
    return f"-I{c_include_dir()} -L{libdir} -lopsmith -Wl,-rpath,{libdir}"


def version() -> str:
    """MAJOR.MINOR.PATCH, read from opsmith.h (the one place it is written)."""
    try:
        with open(os.path.join(c_include_dir(), "opsmith.h")) as f:
            text = f.read()
        return ".".join(re.search(rf"#define OPSMITH_VERSION_{k} (\d+)", text).group(1)
                        for k in ("MAJOR", "MINOR", "PATCH"))
    except (OSError, AttributeError):
        from importlib.metadata import PackageNotFoundError, version as dist_version
        try:
            return dist_version("opsmith")
        except PackageNotFoundError:
            return "0+unknown"


torch.ops.load_library(library_path())


def _c_abi_handle():
    """The C ABI as the route B library carries it (ctypes; public symbols only)."""
    import ctypes
    lib = ctypes.CDLL(library_path())
    lib.opsmith_version.restype = ctypes.c_char_p
    return lib


def c_abi() -> int:
    """opsmith_abi_version() of the C library linked into route B."""
    return int(_c_abi_handle().opsmith_abi_version())
