"""Finds and loads the route B shared library (opsmith/_C*.so), and finds the
plain C library and its headers: in an installed package opsmith/lib and
opsmith/include (put there by setup.py), in the source tree build/ and
include/.

A compiled part that is missing or does not load raises ImportError saying
which part, where it was looked for, and the command that builds it for the
way opsmith was installed (source tree, editable install, regular install)."""
import glob
import importlib.machinery
import json
import os
import re
from typing import List, Optional, Tuple

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_TREE = os.path.dirname(_HERE)

# the compiled parts: (file pattern under the package, what it is)
ROUTE_B = ("_C*.so", "the route B library (torch.ops.opsmith.*)")
ROUTE_A = ("_pybind*.so", "the route A module opsmith._pybind (opsmith.pybind)")


def _is_source_tree(tree: str) -> bool:
    return all(os.path.exists(os.path.join(tree, p)) for p in ("setup.py", "Makefile", os.path.join("csrc", "torch")))


def _direct_url(dist) -> Optional[dict]:
    try:
        text = dist.read_text("direct_url.json")
        return json.loads(text) if text else None
    except (OSError, ValueError):
        return None


def _url_path(url: str) -> Optional[str]:
    from urllib.parse import unquote, urlparse
    parsed = urlparse(url)
    return os.path.realpath(unquote(parsed.path)) if parsed.scheme == "file" else None


def install_kind() -> Tuple[str, str]:
    """How this copy of opsmith was installed, and the shell command that
    (re)builds its compiled parts: ("source", make build), ("editable",
    pip install -e again) or ("installed", a reinstall)."""
    from importlib.metadata import distributions
    dists = list(distributions(name="opsmith"))
    if _is_source_tree(_TREE):
        tree = os.path.realpath(_TREE)
        for dist in dists:
            info = _direct_url(dist) or {}
            if info.get("dir_info", {}).get("editable") and _url_path(info.get("url", "")) == tree:
                return "editable", f"pip install --no-build-isolation -e {_TREE}"
        return "source", f"make -C {_TREE} build"
    for dist in dists:  # installed from a checkout that is still there: reinstall from it
        info = _direct_url(dist) or {}
        source = _url_path(info.get("url", "")) if "dir_info" in info else None
        if source and _is_source_tree(source):
            return "installed", f"pip install --no-build-isolation --force-reinstall {source}"
    return "installed", "pip install --no-build-isolation --force-reinstall opsmith"


_HOW = {
    "source": "This opsmith is a source tree ({where}): build them with `make build` there:",
    "editable": "This opsmith is an editable install of {where}: build them by installing it again:",
    "installed": "This opsmith is an installed package ({where}): reinstall it to build them "
                 "(from the checkout or wheel it came from, if not from the index):",
}


def missing_error(problems: List[str]) -> ImportError:
    """The ImportError for compiled parts that are missing or do not load:
    each problem, then how opsmith was installed and the command that builds
    them that way."""
    kind, command = install_kind()
    where = _TREE if kind != "installed" else _HERE
    lines = ["opsmith cannot load its compiled parts:", *(f"  - {p}" for p in problems),
             _HOW[kind].format(where=where), f"    {command}"]
    if kind == "source":  # the generator needs none of them: an op of one's own can come first
        lines.append(f"(`opsmith new-op` runs before that as `python {os.path.join(where, 'opsmith', 'new_op.py')} NAME`)")
    return ImportError("\n".join(lines))


def _find(pattern: str) -> Optional[str]:
    """The compiled part matching pattern, built for this interpreter where
    there is one: a tree built by two Pythons holds _C.cpython-311-*.so and
    _C.cpython-312-*.so side by side, and the first by name is not the one the
    running interpreter was built against (Python's own import machinery picks
    route A by EXTENSION_SUFFIXES the same way)."""
    found = sorted(glob.glob(os.path.join(_HERE, pattern)))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        for path in found:
            if path.endswith(suffix):
                return path
    return found[0] if found else None


def _c_library_candidates() -> Tuple[str, ...]:
    # a wheel's copy in the package, else (source tree, editable install) the Makefile's
    inside = os.path.join(_HERE, "lib", "libopsmith.so")
    return (inside, os.path.join(_TREE, "build", "libopsmith.so")) if _is_source_tree(_TREE) else (inside,)


def missing_parts(*parts: Tuple[str, str]) -> List[str]:
    """A sentence for each of `parts` ((pattern, what) pairs; the C library
    is always looked for) that is not where it should be."""
    problems = [f"{what} opsmith/{pattern} is missing" for pattern, what in parts if _find(pattern) is None]
    if not any(os.path.exists(p) for p in _c_library_candidates()):
        problems.append("the C library libopsmith.so is missing (looked for "
                        + " and ".join(_c_library_candidates()) + ")")
    return problems


def library_path() -> str:
    """Path of the route B library; torch.ops.load_library(path) registers the
    ops on its own, without this package."""
    found = _find(ROUTE_B[0])
    if found is None:
        raise missing_error(missing_parts(ROUTE_B))
    return found


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
    return _first(*_c_library_candidates())


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


def _load() -> None:
    problems = missing_parts(ROUTE_B)
    if problems:
        # route A is not needed here, but is named when it is missing too: the same command builds both
        if _find(ROUTE_A[0]) is None:
            problems.append(f"{ROUTE_A[1]} opsmith/{ROUTE_A[0]} is missing")
        raise missing_error(problems)
    path = library_path()
    try:
        torch.ops.load_library(path)
    except OSError as e:  # dlopen's reason: an undefined symbol, another torch, a truncated file
        raise missing_error([f"{ROUTE_B[1]} {path} does not load ({e})"]) from e


_load()


def _c_abi_handle():
    """The C ABI as the route B library carries it (ctypes; public symbols only)."""
    import ctypes
    lib = ctypes.CDLL(library_path())
    lib.opsmith_version.restype = ctypes.c_char_p
    return lib


def c_abi() -> int:
    """opsmith_abi_version() of the C library linked into route B."""
    return int(_c_abi_handle().opsmith_abi_version())


def route_a_module():
    """opsmith._pybind, or an ImportError naming what is missing and how to
    build it for the way opsmith was installed."""
    try:
        from . import _pybind
    except ImportError as e:
        path = _find(ROUTE_A[0])
        if path is None:
            raise missing_error(missing_parts(ROUTE_A)) from None
        raise missing_error([f"{ROUTE_A[1]} {path} does not load ({e})"]) from e
    return _pybind
