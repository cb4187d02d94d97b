"""`opsmith new-op NAME`: writes a new operator into every layer of the
opsmith tree, as a working elementwise op (y = x * sigmoid(alpha * x), with
its backward) that the user then edits into their own:

    opsmith new-op NAME [--root DIR]          into the opsmith source tree
    opsmith new-op NAME --out DIR --namespace NS
                                              a standalone project: its own
                                              torch.ops.NS.*, C prefix NS_,
                                              setup.py and a JIT loader

The files come from templates shipped in the package
(opsmith/templates/new_op/<group>/*.in) with @name@, @Name@, @NAME@ (the
op) and @ns@, @NS@ (C prefix, dispatcher namespace and Python package:
opsmith in the tree, NS outside) filled in. Nothing is overwritten: when
any file the op would write exists, nothing is written at all.

This module imports neither torch nor the rest of the package: in a tree
not built yet (where `import opsmith` fails), `python opsmith/new_op.py NAME`
runs the same command."""
import argparse
import keyword
import os
import pathlib
import re
import sys
from typing import Dict, List, Optional, Sequence, Tuple

TEMPLATES = pathlib.Path(__file__).resolve().parent / "templates" / "new_op"

# (template, target) per group; targets are formatted with name and ns
OP_FILES: Tuple[Tuple[str, str], ...] = (
    ("op/header.h.in", "include/{ns}/{name}.h"),
    ("op/reference.c.in", "csrc/reference/{name}.c"),
    ("op/cpu.c.in", "csrc/cpu/{name}.c"),
    ("op/internal.h.in", "csrc/internal/{name}.h"),
    ("op/internal.c.in", "csrc/internal/{name}.c"),
    ("op/cuda.cu.in", "csrc/cuda/{name}.cu"),
    ("op/no_cuda.c.in", "csrc/no_cuda/{name}.c"),
    ("op/bridge.cpp.in", "csrc/torch/{name}.cpp"),
    ("op/ops.py.in", "{ns}/ops/{name}.py"),
    ("op/test.py.in", "tests/test_{name}.py"),
)
IN_TREE_FILES: Tuple[Tuple[str, str], ...] = (
    ("in_tree/spec.py.in", "opsmith/specs/{name}.py"),
    ("in_tree/test_c.c.in", "tests/c/test_{name}.c"),
)
STANDALONE_FILES: Tuple[Tuple[str, str], ...] = (
    ("standalone/README.md.in", "README.md"),
    ("standalone/setup.py.in", "setup.py"),
    ("standalone/pyproject.toml.in", "pyproject.toml"),
    ("standalone/gitignore.in", ".gitignore"),
    ("standalone/ns.h.in", "include/{ns}.h"),
    ("standalone/core.c.in", "csrc/core.c"),
    ("standalone/no_cuda_core.c.in", "csrc/no_cuda/core.c"),
    ("standalone/cuda_core.cu.in", "csrc/cuda/core.cu"),
    ("standalone/convert.h.in", "csrc/convert.h"),
    ("standalone/internal.h.in", "csrc/internal.h"),
    ("standalone/common.cuh.in", "csrc/cuda/common.cuh"),
    ("standalone/tensor_args.h.in", "csrc/torch/tensor_args.h"),
    ("standalone/autograd.h.in", "csrc/torch/autograd.h"),
    ("standalone/pybind_registry.h.in", "csrc/torch/pybind_registry.h"),
    ("standalone/library.cpp.in", "csrc/torch/library.cpp"),
    ("standalone/pybind.cpp.in", "csrc/torch/pybind.cpp"),
    ("standalone/init.py.in", "{ns}/__init__.py"),
    ("standalone/build.py.in", "{ns}/_build.py"),
    ("standalone/library.py.in", "{ns}/_library.py"),
    ("standalone/pybind_loader.py.in", "{ns}/_pybind.py"),
    ("standalone/nn.py.in", "{ns}/nn.py"),
    ("standalone/pybind.py.in", "{ns}/pybind.py"),
    ("standalone/ops_init.py.in", "{ns}/ops/__init__.py"),
)

IDENTIFIER = re.compile(r"[a-z][a-z0-9_]*\Z")
PLACEHOLDER = re.compile(r"@(name|Name|NAME|ns|NS)@")
C_KEYWORDS = {
    "auto", "break", "case", "char", "const", "continue", "default", "do", "double", "else", "enum", "extern",
    "float", "for", "goto", "if", "inline", "int", "long", "register", "restrict", "return", "short", "signed",
    "sizeof", "static", "struct", "switch", "typedef", "union", "unsigned", "void", "volatile", "while", "bool",
    "class", "delete", "new", "namespace", "operator", "private", "protected", "public", "template", "this",
    "throw", "try", "catch", "typename", "using", "virtual", "friend", "mutable", "explicit", "export",
    "nullptr", "constexpr", "decltype", "noexcept", "alignas", "alignof", "asm",
}
# file stems of the shared machinery, and the package's own names: an op
# named like one of them would shadow it (csrc/internal/<op>.h beside
# csrc/internal.h, opsmith.<op> over a submodule, ...)
RESERVED = {
    "core", "internal", "convert", "common", "rows", "launch_plan", "partial_sums", "row_pipeline", "library",
    "pybind", "pybind_registry", "tensor_args", "autograd", "harness", "main", "types", "ops", "nn", "specs",
    "bench", "demo", "doctor", "templates", "new_op", "c_flags", "c_library", "c_include_dir", "library_path",
    "cli", "include", "lib", "build", "test", "tests", "opsmith", "torch", "aten", "prim", "cuda", "cpu",
    "reference", "no_cuda", "setup",
}
RESERVED_NAMESPACES = {"opsmith", "torch", "aten", "prim", "prims", "c10", "at", "cuda", "test", "tests",
                       "setup", "build", "include", "csrc"}
MAX_NAME = 40


class NewOpError(Exception):
    """A bad name, a clash or a file that exists: one line for the user."""


def camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_") if part)


def check_name(name: str, what: str = "NAME") -> None:
    if not IDENTIFIER.match(name or ""):
        raise NewOpError(f"{what} {name!r} is not a C identifier in snake_case "
                         f"(lowercase letters, digits and _, starting with a letter)")
    if len(name) > MAX_NAME:
        raise NewOpError(f"{what} {name!r} is longer than {MAX_NAME} characters")
    if "__" in name or name.endswith("_"):
        raise NewOpError(f"{what} {name!r} has a double or trailing underscore (reserved in C and C++)")
    if name in C_KEYWORDS or keyword.iskeyword(name):
        raise NewOpError(f"{what} {name!r} is a C, C++ or Python keyword")


def check_op_name(name: str) -> None:
    check_name(name)
    if name in RESERVED:
        raise NewOpError(f"NAME {name!r} is taken by opsmith's own machinery "
                         f"(file or module {name}); choose another")
    if name.endswith(("_fwd", "_bwd")) or name.startswith("internal_"):
        raise NewOpError(f"NAME {name!r} would give launcher names that read as another op's "
                         f"(<op>_fwd/_bwd, internal_*); choose another")


def check_namespace(ns: str) -> None:
    check_name(ns, "--namespace")
    if ns in RESERVED_NAMESPACES or ns.startswith("opsmith"):
        raise NewOpError(f"--namespace {ns!r} would clash with opsmith's or PyTorch's own "
                         f"(namespace, C prefix or package); choose another")
    if ns in getattr(sys, "stdlib_module_names", ()):
        raise NewOpError(f"--namespace {ns!r} is a standard-library module: the package would shadow it")


def render(text: str, name: str, ns: str) -> str:
    values = {"name": name, "Name": camel(name), "NAME": name.upper(), "ns": ns, "NS": ns.upper()}
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def plan(files: Sequence[Tuple[str, str]], name: str, ns: str) -> Dict[str, str]:
    """target path (relative) -> rendered text."""
    out = {}
    for template, target in files:
        text = (TEMPLATES / template).read_text()
        out[target.format(name=name, ns=ns)] = render(text, name, ns)
    return out


def _refuse_existing(root: pathlib.Path, targets) -> None:
    existing = [t for t in targets if (root / t).exists()]
    if existing:
        raise NewOpError(f"{root / existing[0]} exists ({len(existing)} of the op's {len(targets)} files do); "
                         f"nothing was written")


def _write(root: pathlib.Path, files: Dict[str, str]) -> List[pathlib.Path]:
    written = []
    for target, text in files.items():
        path = root / target
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "x") as f:  # "x": never overwrite, even racing another writer
            f.write(text)
        written.append(path)
    return written


# --- into the opsmith tree ------------------------------------------------------------

INCLUDE_LINE = re.compile(r'^#include "opsmith/[a-z0-9_]+\.h"\n', re.M)
OP_LIST = re.compile(r"^OP_MODULES = \(\n(?P<body>(?:    .*\n)*?)\)", re.M)


def find_tree(start: pathlib.Path) -> Optional[pathlib.Path]:
    """The opsmith source tree at or above start (include/opsmith.h, csrc/,
    opsmith/ops/__init__.py), or None."""
    for d in [start, *start.parents]:
        if (d / "include" / "opsmith.h").is_file() and (d / "opsmith" / "ops" / "__init__.py").is_file() \
                and (d / "csrc").is_dir():
            return d
    return None


def _existing_ops(ops_init: str) -> List[str]:
    m = OP_LIST.search(ops_init)
    if not m:
        raise NewOpError("opsmith/ops/__init__.py has no `OP_MODULES = (` list to add the op to")
    return re.findall(r'"([a-z0-9_]+)"', m.group("body"))


def _edited_lists(root: pathlib.Path, name: str) -> Dict[pathlib.Path, str]:
    """The two shared lists with the op's line added: include/opsmith.h's
    #include and opsmith/ops/__init__.py's OP_MODULES entry."""
    header = root / "include" / "opsmith.h"
    text = header.read_text()
    lines = list(INCLUDE_LINE.finditer(text))
    if not lines:
        raise NewOpError(f"{header} has no `#include \"opsmith/<op>.h\"` line to add the op's after")
    end = lines[-1].end()
    new_header = text[:end] + f'#include "opsmith/{name}.h"\n' + text[end:]

    ops_init = root / "opsmith" / "ops" / "__init__.py"
    text = ops_init.read_text()
    m = OP_LIST.search(text)
    new_ops = text[:m.end("body")] + f'    "{name}",\n' + text[m.end("body"):]
    return {header: new_header, ops_init: new_ops}


def new_op_in_tree(name: str, root: pathlib.Path) -> List[pathlib.Path]:
    check_op_name(name)
    ops = _existing_ops((root / "opsmith" / "ops" / "__init__.py").read_text())
    if name in ops:
        raise NewOpError(f"an op named {name!r} exists already (opsmith/ops/__init__.py's OP_MODULES)")
    taken = {camel(o) for o in ops}
    if camel(name) in taken:
        raise NewOpError(f"NAME {name!r} gives the module name {camel(name)}, which another op's name gives too")
    stems = {p.stem for d in ("csrc", "csrc/torch", "csrc/cuda", "opsmith", "tests/c") for p in (root / d).glob("*.*")}
    if name in stems:
        raise NewOpError(f"NAME {name!r} is the name of a shared file of the tree; choose another")
    files = plan(OP_FILES + IN_TREE_FILES, name, "opsmith")
    _refuse_existing(root, list(files))
    lists = _edited_lists(root, name)
    written = _write(root, files)
    for path, text in lists.items():
        path.write_text(text)
    return written + list(lists)


def new_op_standalone(name: str, out: pathlib.Path, ns: str) -> List[pathlib.Path]:
    check_op_name(name)
    check_namespace(ns)
    if name == ns:
        raise NewOpError(f"NAME and --namespace are both {name!r}: the op's module would shadow the package")
    if out.exists() and not out.is_dir():
        raise NewOpError(f"--out {out} exists and is not a directory")
    files = plan(STANDALONE_FILES + OP_FILES, name, ns)
    _refuse_existing(out, list(files))
    return _write(out, files)


# --- the command ------------------------------------------------------------------------

DESCRIPTION = """\
Writes a new operator NAME as a working elementwise op, y = x * sigmoid(alpha * x)
with its backward, in every layer, for you to edit into your own: C ABI header,
float64 reference, C11/OpenMP CPU kernel, validation, CUDA kernel, no-CUDA
stand-ins, the PyTorch bridge (route B dispatcher op with autograd, route A
pybind11), the Python module (functional API, fake kernels, vmap rules,
autograd.Function, nn module), and tests.

Without --out: into the opsmith source tree around the current directory (or
--root): also its op spec (opsmith/specs/NAME.py, which enrolls it in every
harness and the benchmark), its C test, and one line each in include/opsmith.h
and opsmith/ops/__init__.py.

With --out DIR --namespace NS: a standalone project in DIR that needs neither
the opsmith tree nor the opsmith package: torch.ops.NS.NAME_fwd/_bwd, C symbols
NS_*, a setup.py (ahead-of-time build) and a loader that builds just in time
with torch.utils.cpp_extension.load when nothing is prebuilt; its own tests.

NAME and NS are lowercase C identifiers (snake_case). An existing file is
never overwritten: if any file the op would write exists, nothing is written.

`python -m opsmith new-op` needs the tree built (`make build`: importing the
package loads its compiled parts); before that, `python opsmith/new_op.py`
from the tree's root runs the same command."""


def _parser():
    if __package__:
        from ._cli import Parser
    else:  # run as a file (python opsmith/new_op.py): in a tree not built yet, `import opsmith` fails
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        from _cli import Parser
    p = Parser(prog="opsmith new-op", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", metavar="NAME", help="the op's name, e.g. scaled_silu (a lowercase C identifier)")
    p.add_argument("--root", metavar="DIR", help="the opsmith source tree to add the op to "
                                                 "(default: the one around the current directory)")
    p.add_argument("--out", metavar="DIR", help="write a standalone project into DIR instead (with --namespace)")
    p.add_argument("--namespace", metavar="NS", help="the standalone project's dispatcher namespace, C prefix "
                                                     "and Python package (with --out)")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    return p


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.out is not None or args.namespace is not None:
            if args.out is None or args.namespace is None:
                parser.error("--out and --namespace go together")
            if args.root is not None:
                parser.error("--root is for the opsmith tree; a standalone project takes --out and --namespace")
            out = pathlib.Path(args.out)
            written = new_op_standalone(args.name, out, args.namespace)
            steps = [f"cd {out}",
                     f"python -m pytest -q tests     # builds just in time (torch.utils.cpp_extension.load)",
                     "pip install --no-build-isolation .   # or: build ahead of time"]
            base = out
        else:
            check_op_name(args.name)
            root = pathlib.Path(args.root) if args.root else find_tree(pathlib.Path.cwd())
            if root is None or find_tree(root) != root:
                parser.error(f"{args.root or os.getcwd()} is not inside an opsmith source tree "
                             f"(no include/opsmith.h and opsmith/ops/__init__.py); "
                             f"for a project of your own use --out DIR --namespace NS")
            written = new_op_in_tree(args.name, root)
            steps = ["make build                       # the Makefile and setup.py find the new files",
                     f"make ctest                       # its C test with the others (build/test_c {args.name}: alone)",
                     f"python -m pytest -q tests/test_{args.name}.py",
                     "python -m opsmith.specs --docs   # its rows in docs/reliability.md's table (a test checks it)",
                     f"python -m pytest -q tests/test_reliability.py tests/test_integration.py -k {args.name}"]
            base = root
    except NewOpError as e:
        print(f"opsmith new-op: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"opsmith new-op: wrote {args.name} ({len(written)} files):")
        for path in written:
            print(f"  {os.path.relpath(path, base)}")
        print("then:")
        for s in steps:
            print(f"  {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
