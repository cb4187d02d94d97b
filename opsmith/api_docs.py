"""docs/api.md, generated from the docstrings: every public function, module
and option of the package, in the order the op list gives them.

    python -m opsmith.api_docs            rewrite docs/api.md
    python -m opsmith.api_docs --check    exit 1 when docs/api.md is stale

tests/test_api_docs.py checks that every public name has a docstring and
that docs/api.md is what this generates."""
import importlib
import inspect
import pathlib
import sys
from typing import List, Tuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
API_MD = ROOT / "docs" / "api.md"

HEADER = """# opsmith API

Generated from the docstrings by `python -m opsmith.api_docs` (a test fails when
this file is stale or a public name has no docstring). Functions are
`opsmith.<name>`, modules `opsmith.nn.<Name>`; the raw dispatcher ops are
`torch.ops.opsmith.*` (their schemas: `python -c "import opsmith, torch;
print(torch.ops.opsmith.rms_norm_fwd.default._schema)"`), and route A's
functions `opsmith.pybind.<name>` take the same arguments as the functions here.
"""

# (section title, module, names or None for the module's __all__)
SECTIONS: Tuple[Tuple[str, str, object], ...] = (
    ("Functions", "opsmith", "FUNCTIONS"),
    ("Modules (`opsmith.nn`)", "opsmith.nn", None),
    ("Optimizers (`opsmith.optim`)", "opsmith.optim", None),
    ("Hugging Face models (`opsmith.hf`)", "opsmith.hf", None),
    ("Package helpers", "opsmith", ("library_path", "c_library", "c_include_dir")),
)


def _signature(obj) -> str:
    try:
        target = obj.__init__ if inspect.isclass(obj) else obj
        sig = inspect.signature(target)
        if inspect.isclass(obj):
            params = list(sig.parameters.values())[1:]
            sig = sig.replace(parameters=params, return_annotation=inspect.Signature.empty)
        return str(sig)
    except (TypeError, ValueError):
        return "(...)"


def public_names() -> List[Tuple[str, str, List[Tuple[str, object]]]]:
    """[(section, module name, [(qualified name, object)])] for what exists in
    this build (a section whose module is absent is left out)."""
    out = []
    for title, module_name, names in SECTIONS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if names == "FUNCTIONS":
            from opsmith import ops
            names = list(ops.exports("FUNCTIONS"))
        elif names is None:
            names = [n for n in getattr(module, "__all__", []) if not n.startswith("_")]
        items = [(f"{module_name}.{n}", getattr(module, n)) for n in names]
        out.append((title, module_name, [(q, o) for q, o in items if callable(o)]))
    return out


def undocumented() -> List[str]:
    missing = []
    for _, _, items in public_names():
        for qualified, obj in items:
            if not (inspect.getdoc(obj) or "").strip():
                missing.append(qualified)
    return missing


def render() -> str:
    parts = [HEADER]
    for title, _, items in public_names():
        parts.append(f"## {title}\n")
        for qualified, obj in items:
            kind = "class" if inspect.isclass(obj) else "function"
            parts.append(f"### `{qualified}`\n\n```python\n{kind} {qualified.split('.')[-1]}{_signature(obj)}\n```\n")
            parts.append((inspect.getdoc(obj) or "").strip() + "\n")
    return "\n".join(parts)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in argv:
        stale = not API_MD.exists() or API_MD.read_text() != text
        if stale:
            print("docs/api.md is stale: run python -m opsmith.api_docs", file=sys.stderr)
        return 1 if stale else 0
    API_MD.write_text(text)
    print(f"wrote {API_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
