"""Op specs: one OpSpec per op (opsmith/specs/<op>.py, found from the op list
in opsmith/ops/__init__.py), read by every harness -- the reliability tests,
bench/sanitize_ops.py, the benchmark (opsmith.bench) and the hostile-input
table of docs/reliability.md (`python -m opsmith.specs --docs` regenerates it).

What an OpSpec says, so the harnesses need no op-specific code:

* ``make_inputs(shape, dtype, device, generator)`` returns a dict of fresh
  random inputs (never zeros/ones): tensors, lists of tensors (the names in
  ``list_inputs``) and non-tensor arguments (such as ``eps``). ``shape`` is
  the shape ``(*, n)`` of the row inputs; an op without row inputs (a list
  op) derives its tensors' sizes from it.
* ``call(inputs)`` runs route B; ``call_pybind`` route A (None: no route A).
  Both return one tensor, or a tuple with one item per name in ``outputs``
  (an item may be a list of tensors). An op that mutates inputs (schema
  ``Tensor(a!)``, named in ``mutated_inputs``) returns the mutated tensors,
  the way PyTorch's in-place ops return self.
* ``reference(inputs, dtype=None)`` returns the same structure in float64
  from float64 copies of the inputs; it is differentiable (torch.autograd),
  and composable with torch.func. ``dtype`` is the dtype the op ran in, for
  defaults that depend on it.
* ``diff_outputs``: the outputs with an upstream gradient; ``grad_inputs``:
  the differentiable inputs. ``index_inputs``: integer inputs (int64, never
  differentiable) with their range and ignore value.
* ``row_inputs``: tensors whose leading dims are rows (shape ``(*, n)``, or
  ``(*)`` for an index input of the rows); every other tensor input is shared
  by all rows, and every output's leading dims are the rows. Row i of an
  output depends only on row i of the row inputs and on the shared inputs:
  the layout, zero-row and huge-tensor harnesses rely on that, and do not run
  for ops without row inputs.
* ``double_backward``, ``func_transforms``: SUPPORTED, or the regex of the
  clear RuntimeError raised instead (None: does not apply).
"""
from __future__ import annotations

import argparse
import importlib
import pathlib
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..ops import OP_MODULES

Inputs = Dict[str, Any]

SUPPORTED = "supported"
TRANSFORMS = ("grad", "vjp", "jvp", "vmap")
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Skip:
    """A harness that would apply but is not run for this op, and why
    (reported as skipped, never as passed)."""

    reason: str


@dataclass(frozen=True)
class Hostile:
    """One hostile input: how to build it, and what the op must do with it.

    With ``raises`` set, every route must raise RuntimeError whose message
    matches it (re.search). Otherwise the op must return, with the same
    NaN/+Inf/-Inf pattern as ``OpSpec.torch_equivalent`` on the same input and
    its finite values close to it; ``check`` adds op-specific assertions.
    ``input`` and ``does`` are the two cells of docs/reliability.md's table."""

    name: str
    make: Callable[[str, torch.Generator], Inputs]
    does: str
    input: str = ""
    raises: Optional[str] = None
    check: Optional[Callable[["OpSpec", Inputs, Any], None]] = None
    cuda_only: bool = False  # needs a GPU beside the CPU (mixed-device cases)


@dataclass(frozen=True)
class IndexInput:
    """An integer (int64) input: valid values are [0, high(inputs)), plus
    ``ignore_index`` where the op skips an entry. Never differentiable."""

    name: str
    high: Callable[[Inputs], int]
    ignore_index: Optional[int] = None


@dataclass(frozen=True)
class DocRow:
    """A row of docs/reliability.md's table for a behaviour a generic harness
    checks (zero rows, layouts, ...): input, what the op does, the test."""

    input: str
    does: str
    test: str


@dataclass(frozen=True)
class BenchSpec:
    """How `python -m opsmith bench` measures the op (CUDA)."""

    # (rows, n, dtype, device) -> dict of tensors: the differentiable inputs
    # (in `grad_inputs` order), plus "dy" for the backward
    make_inputs: Callable
    grad_inputs: List[str]
    # provider name -> factory(hidden size, dtype, device) -> fn(**inputs) -> output
    providers: Dict[str, Callable]
    # minimal bytes moved (each input read once, each output written once):
    # (rows, n, element size) -> bytes
    fwd_bytes: Callable
    fwdbwd_bytes: Callable
    hidden_sizes: List[int] = field(default_factory=list)
    row_counts: List[int] = field(default_factory=list)
    quick_shapes: List[Tuple[int, int]] = field(default_factory=list)
    # (rows, n) for `bench --device cpu` where the norms' 256x1024, 64x4096,
    # 4096x4096 mean something else (empty: those)
    cpu_shapes: List[Tuple[int, int]] = field(default_factory=list)
    # device -> {name: fn()}: the public calls whose host time per call is measured
    host_calls: Optional[Callable[[Any], Dict[str, Callable]]] = None


@dataclass(frozen=True)
class OpSpec:
    name: str
    make_inputs: Callable[[Sequence[int], torch.dtype, Any, torch.Generator], Inputs]
    call: Callable[[Inputs], Any]
    reference: Callable[..., Any]
    # PyTorch's own op on the same values in float32 on the CPU (same
    # structure as call): the NaN/Inf behaviour hostile inputs must reproduce
    torch_equivalent: Callable[[Inputs], Any]
    # max|out - ref| <= tolerance(dtype) * max(1, max|ref|)
    tolerance: Callable[[torch.dtype], float]
    outputs: Tuple[str, ...] = ("out",)
    diff_outputs: Optional[Tuple[str, ...]] = None  # None: every output (when grad_inputs)
    grad_inputs: Tuple[str, ...] = ()
    row_inputs: Tuple[str, ...] = ()
    # rows of width 0 ([..., 0]) are a valid, empty input with empty outputs, as
    # PyTorch's own op takes them (False: the op needs a width, as classes)
    zero_width: bool = True
    index_inputs: Tuple[IndexInput, ...] = ()
    mutated_inputs: Tuple[str, ...] = ()
    list_inputs: Tuple[str, ...] = ()
    call_pybind: Optional[Callable[[Inputs], Any]] = None
    # inputs -> [(OpOverload, args)]: every dispatcher op behind the call, for opcheck
    opcheck: Optional[Callable[[Inputs], Sequence[Tuple[Any, tuple]]]] = None
    double_backward: Optional[str] = SUPPORTED
    double_backward_pybind: Optional[str] = None
    func_transforms: Mapping[str, Optional[str]] = field(default_factory=dict)
    func_transforms_pybind: Optional[str] = None  # the error route A raises under any transform
    # gradients of shared inputs sum over rows: their rounding grows a little
    grad_slack: float = 4.0
    dtypes: Tuple[torch.dtype, ...] = DTYPES
    # the largest factor the randomised harnesses scale the row inputs by
    # (1e-4, 1 or 1e4): an op whose outputs grow with its inputs (no
    # normalisation) overflows float16 at 1e4 like PyTorch's own would, which
    # says nothing about the kernel
    max_scale: float = 1e4
    # the op as a module of width n (for the torch.compile training test)
    make_module: Optional[Callable[[int], torch.nn.Module]] = None
    hostile: Tuple[Hostile, ...] = ()
    doc_rows: Tuple[DocRow, ...] = ()
    bench: Optional[BenchSpec] = None
    # an opsmith op (C/CUDA kernels, OpenMP threads) rather than a test-only one
    native: bool = True

    @property
    def diff_output_names(self) -> Tuple[str, ...]:
        if not self.grad_inputs:
            return ()
        return self.outputs if self.diff_outputs is None else self.diff_outputs

    @property
    def index_names(self) -> Tuple[str, ...]:
        return tuple(i.name for i in self.index_inputs)

    def kind(self) -> str:
        """One line: what sort of op this is (for docs and test ids)."""
        parts = ["row op" if self.row_inputs else "tensor-list op" if self.list_inputs else "op"]
        if len(self.outputs) > 1:
            parts.append(f"{len(self.outputs)} outputs")
        if self.mutated_inputs:
            parts.append("mutates " + ", ".join(self.mutated_inputs))
        if self.index_inputs:
            parts.append("integer " + ", ".join(self.index_names))
        if self.list_inputs:
            parts.append("lists " + ", ".join(self.list_inputs))
        return "; ".join(parts)


# --- structure helpers (shared by the harnesses) -----------------------------------

def as_tuple(spec: OpSpec, result) -> tuple:
    """call()'s result as one item per name in spec.outputs."""
    if len(spec.outputs) == 1:
        return (result,)
    assert isinstance(result, (tuple, list)) and len(result) == len(spec.outputs), (
        f"{spec.name}: expected {len(spec.outputs)} outputs {spec.outputs}, got {type(result).__name__}")
    return tuple(result)


def leaves(name: str, value) -> List[Tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of one item: a tensor, or a list of them (name[i])."""
    if isinstance(value, torch.Tensor):
        return [(name, value)]
    if isinstance(value, (list, tuple)):
        return [(f"{name}[{i}]", t) for i, t in enumerate(value)]
    return []


def flat_outputs(spec: OpSpec, result) -> List[Tuple[str, torch.Tensor]]:
    out = []
    for name, item in zip(spec.outputs, as_tuple(spec, result)):
        out += leaves(name, item)
    return out


def flat_inputs(inputs: Inputs, names: Optional[Sequence[str]] = None) -> List[Tuple[str, torch.Tensor]]:
    out = []
    for k in (inputs if names is None else names):
        out += leaves(k, inputs.get(k))
    return out


def map_tensors(inputs: Inputs, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> Inputs:
    """inputs with fn(name, t) applied to every tensor (list elements too)."""
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            out[k] = fn(k, v)
        elif isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v):
            out[k] = [fn(k, t) for t in v]
        else:
            out[k] = v
    return out


def randn(shape, generator, dtype, device):
    """Drawn in float32 on the generator's device, then rounded and moved:
    every dtype and device sees the same kind of values for one seed."""
    v = torch.randn(tuple(shape), generator=generator, device=generator.device, dtype=torch.float32)
    return v.to(device=device, dtype=dtype)


_compiled: Dict[Any, Callable] = {}


def edited_inputs(base: Callable[..., Inputs], device, generator, edits=(), **extra) -> Inputs:
    """A hostile input: base("cpu", generator, **extra) with (name, index,
    value) edits made on the CPU, then moved to device."""
    inputs = base("cpu", generator, **extra)
    for name, index, value in edits:
        inputs[name][index] = value
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def rows_finite_except(out: torch.Tensor, bad_rows) -> None:
    """Every row of out but bad_rows is finite: a hostile value stays in its row."""
    out = out.detach().cpu()
    for r in range(out.shape[0]):
        if r not in bad_rows:
            assert torch.isfinite(out[r]).all(), f"row {r} is not finite, yet only rows {bad_rows} are hostile"


def compiled(key, fn):
    """torch.compile(fn, dynamic=False), once per key (benchmark providers)."""
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, dynamic=False)
    return _compiled[key]


# --- discovery ----------------------------------------------------------------------

def load_specs() -> List[OpSpec]:
    """Every opsmith op's spec, in the order of opsmith.ops.OP_MODULES."""
    return [importlib.import_module(f"{__name__}.{name}").SPEC for name in OP_MODULES]


def __getattr__(name):
    if name == "SPECS":  # loaded on first use: importing the package stays cheap
        value = load_specs()
        globals()["SPECS"] = value
        return value
    raise AttributeError(name)


# --- docs/reliability.md's table ----------------------------------------------------------

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
DOCS_BEGIN = "<!-- hostile table: generated by `python -m opsmith.specs --docs`, do not edit -->"
DOCS_END = "<!-- end of hostile table -->"


def _error_text(regex: str) -> str:
    # the regex as the message reads: anchors and escapes dropped
    text = regex.lstrip("^").rstrip("$")
    return re.sub(r"\\(.)", r"\1", text)


def _autodiff_rows(spec: OpSpec) -> List[str]:
    rows = []

    def cell(value, works):
        if value is None:
            return None
        if isinstance(value, Skip):
            return f"not checked: {value.reason}"
        return works if value == SUPPORTED else f"RuntimeError `{_error_text(value)}`"

    route_b = "route B" if spec.call_pybind else "the op"
    gradgrad = "works: gradients of the gradients match the float64 reference (gradgradcheck)"
    db = cell(spec.double_backward, gradgrad)
    if db and spec.grad_inputs:
        rows.append(f"| double backward, {route_b}: differentiating the gradients taken with "
                    f"`create_graph=True` (upstream gradient constant or requiring grad; those "
                    f"gradients themselves are right) | {db} | `test_double_backward[{spec.name}-route_b]` |")
    db = cell(spec.double_backward_pybind, gradgrad)
    if db and spec.grad_inputs and spec.call_pybind:
        refused = "" if spec.double_backward_pybind == SUPPORTED else (
            ", also through `torch.autograd.grad` of the inputs with `allow_unused=True` (where "
            "`@once_differentiable` would hand back gradients without a graph, or None: silently constant)")
        rows.append(f"| double backward, route A: the same{refused} "
                    f"| {db} | `test_double_backward[{spec.name}-route_a]` |")
    what = {"grad": "`torch.func.grad`", "vjp": "`torch.func.vjp`",
            "jvp": "`torch.func.jvp` (forward-mode AD)", "vmap": "`torch.func.vmap`"}
    for t in TRANSFORMS:
        c = cell(spec.func_transforms.get(t), "works: matches the float64 reference")
        if c:
            rows.append(f"| {what[t]}, {route_b} | {c} | `test_func_transform[{spec.name}-{t}]` |")
    if spec.call_pybind and spec.func_transforms_pybind:
        rows.append(f"| route A under any torch.func transform (grad, vjp, jvp, vmap) "
                    f"| RuntimeError `{_error_text(spec.func_transforms_pybind)}` "
                    f"| `test_func_transform_route_a[{spec.name}-*]` |")
    return rows


def _grad_subset_rows(spec: OpSpec) -> List[str]:
    import itertools
    rows = []
    full = set(spec.grad_inputs)
    for r in range(len(spec.grad_inputs)):
        for subset in itertools.combinations(spec.grad_inputs, r):
            if set(subset) == full:
                continue
            if not subset:
                rows.append(f"| nothing requires grad | returns outputs with `requires_grad` False and no "
                            f"`grad_fn`, values match the reference | `test_requires_grad_subsets[{spec.name}-none-*]` |")
            else:
                names = " and ".join(subset)
                others = ", ".join(k for k in spec.grad_inputs if k not in subset)
                rows.append(f"| only {names} requires grad ({others} does not) | works; the gradient of "
                            f"{names} matches the float64 reference "
                            f"| `test_requires_grad_subsets[{spec.name}-{'+'.join(subset)}_only-*]` |")
    return rows


def docs_table(specs: Optional[Sequence[OpSpec]] = None) -> str:
    """The generated section of docs/reliability.md: per op, a row per hostile
    case, autodiff behaviour, requires-grad subset and documented harness."""
    specs = load_specs() if specs is None else specs
    out = []
    for spec in specs:
        out += [f"### {spec.name} ({spec.kind()})", "",
                "| input | what the op does | test |", "| --- | --- | --- |"]
        for case in spec.hostile:
            label = f"`{case.name}`" + (f": {case.input}" if case.input else "")
            if case.cuda_only:
                label += " (CUDA only)"
            does = case.does
            if case.raises and not does:
                does = f"RuntimeError `{_error_text(case.raises)}`"
            out.append(f"| {label} | {does} | `test_hostile_input[{spec.name}-{case.name}-*]` |")
        out += _grad_subset_rows(spec)
        out += _autodiff_rows(spec)
        out += [f"| {r.input} | {r.does} | {r.test} |" for r in spec.doc_rows]
        out.append("")
    return "\n".join(out).rstrip("\n")


def render_docs(text: str, specs: Optional[Sequence[OpSpec]] = None) -> str:
    """text with the section between the markers replaced by docs_table()."""
    start, end = text.index(DOCS_BEGIN), text.index(DOCS_END)
    return text[:start] + f"{DOCS_BEGIN}\n{docs_table(specs)}\n" + text[end:]


def write_docs(path: pathlib.Path = DOCS) -> bool:
    """Rewrites the table in path; True when it changed."""
    path = pathlib.Path(path)
    text = path.read_text()
    new = render_docs(text)
    if new != text:
        path.write_text(new)
    return new != text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opsmith.specs")
    parser.add_argument("--docs", nargs="?", const=str(DOCS), metavar="PATH",
                        help="regenerate the hostile-input table of docs/reliability.md (or PATH)")
    parser.add_argument("--list", action="store_true", help="list the specs")
    args = parser.parse_args(argv)
    if args.docs:
        changed = write_docs(pathlib.Path(args.docs))
        print(f"{args.docs}: {'rewritten' if changed else 'up to date'}")
        return 0
    for spec in load_specs():
        print(f"{spec.name}: {spec.kind()}; {len(spec.hostile)} hostile cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
