"""What every spec-driven test shares: the spec list (opsmith's ops and the
test-only ones), running an op with poisoned outputs, the float64 reference
run, comparisons, memory layouts.

Accuracy is always measured against the float64 reference computed from the
very inputs the op saw (already rounded to its dtype), so the only error
measured is the op's own: max|out - ref| <= tol * max(1, max|ref|)."""
import math
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch

import opsmith.specs as specs_mod
from opsmith.specs import OpSpec, flat_inputs, flat_outputs, leaves, map_tensors

import testing_ops

NATIVE_SPECS = list(specs_mod.SPECS)
TEST_SPECS = list(testing_ops.SPECS)
ALL_SPECS = NATIVE_SPECS + TEST_SPECS

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]

_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32,
             torch.float16: torch.int16, torch.bfloat16: torch.int16,
             torch.int64: torch.int64, torch.int32: torch.int32}


def dtype_id(dtype):
    return str(dtype).replace("torch.", "")


def op_params(where=lambda spec: True, specs: Sequence[OpSpec] = None):
    """One pytest.param per spec the harness applies to (the others are not generated)."""
    return [pytest.param(s, id=s.name) for s in (ALL_SPECS if specs is None else specs) if where(s)]


def generator():
    # Seeded from the global RNG, which conftest seeds per test: reruns of a
    # test see the same inputs, different tests different ones.
    return torch.Generator().manual_seed(int(torch.randint(0, 2**62, ()).item()))


def is_float(t):
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def primary(spec: OpSpec, inputs) -> torch.Tensor:
    """The tensor that sets the op's dtype and device: its first floating
    row input, else its first floating tensor."""
    for k in spec.row_inputs:
        if is_float(inputs.get(k)):
            return inputs[k]
    return next(t for _, t in flat_inputs(inputs) if is_float(t))


def opsmith_ops_run(fn):
    """The opsmith:: ops that fn() ran, from the profiler: which path a
    backward took where a Python reference to its tensors would change it."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("opsmith::")}


def poison_allocator(device, *nbytes):
    # The op allocates its outputs with torch.empty. Filling and freeing
    # blocks of the sizes it is about to ask for makes the allocator likely to
    # hand them back, so an element the kernel fails to write reads as NaN
    # (all-ones bits, in every float dtype) rather than a lucky zero.
    blocks = [torch.full((b,), 255, dtype=torch.uint8, device=device) for b in nbytes if b > 0]
    del blocks


def nbytes(t):
    return t.numel() * t.element_size()


def make_dys(spec: OpSpec, outs: List[Tuple[str, torch.Tensor]], gen) -> Dict[str, torch.Tensor]:
    """A random upstream gradient for every leaf of every differentiable output."""
    dys = {}
    for name, t in outs:
        if name.split("[")[0] in spec.diff_output_names:
            dys[name] = torch.randn(tuple(t.shape), generator=gen).to(device=t.device, dtype=t.dtype)
    return dys


def dys_for(spec: OpSpec, inputs, gen) -> Dict[str, torch.Tensor]:
    """Upstream gradients shaped like the outputs for these inputs (from one
    no-grad call: the shapes, not the values, are used)."""
    with torch.no_grad():
        outs, _ = run_op(spec.call, spec, inputs, wrt=(), check_inputs=False)
    return make_dys(spec, outs, gen)


def run_op(fn, spec: OpSpec, inputs, dys=None, wrt=None, check_inputs=True):
    """outs = fn(inputs) with the inputs named in `wrt` (default: all grad
    inputs) as leaves requiring grad; with dys, also their gradients.

    Returns ([(name, output)], {input leaf name: gradient}). detach() keeps
    each tensor's layout (strides, offset, stride 0). Inputs the spec declares
    mutated are restored afterwards (their new values are in the outputs),
    and every other input is checked to be left bit for bit as it was."""
    wrt = spec.grad_inputs if wrt is None else tuple(wrt)
    leaves_in = map_tensors(inputs, lambda k, t: t.detach().requires_grad_(k in wrt and t.is_floating_point()))
    device = primary(spec, inputs).device
    saved = {k: t.clone() for k, t in flat_inputs(leaves_in, spec.mutated_inputs)}
    before = ({k: t.clone() for k, t in flat_inputs(leaves_in) if k not in saved}
              if check_inputs else {})
    poison_allocator(device, *(nbytes(t) for _, t in flat_inputs(inputs) if is_float(t)))
    result = fn(leaves_in)
    outs = flat_outputs(spec, result)
    grads = {}
    if dys and wrt:
        poison_allocator(device, *(nbytes(t) for _, t in flat_inputs(inputs, wrt)))
        # an output independent of the inputs asked for has no graph (row_center's mean and w)
        diff = [(n, t) for n, t in outs if n in dys and t.requires_grad]
        ins = flat_inputs(leaves_in, wrt)
        got = torch.autograd.grad([t for _, t in diff], [t for _, t in ins], [dys[n] for n, _ in diff])
        grads = {n: g for (n, _), g in zip(ins, got)}
    outs = [(n, t.detach().clone() if spec.mutated_inputs else t.detach()) for n, t in outs]
    with torch.no_grad():
        for k, t in flat_inputs(leaves_in, spec.mutated_inputs):
            t.copy_(saved[k])
    for k, t in flat_inputs(leaves_in):
        if k in before:
            assert_bitwise_equal(before[k], t.detach(), f"input {k} (not declared mutated) was modified")
    return outs, grads


def to_reference(inputs, device="cpu", wrt=()):
    """float64 copies of the floating tensors (requiring grad where in wrt);
    integer tensors and other arguments as they are."""
    def convert(k, t):
        if t.is_floating_point():
            return t.detach().to(device=device, dtype=torch.float64).requires_grad_(k in wrt)
        return t.detach().to(device)
    return map_tensors(inputs, convert)


def reference_run(spec: OpSpec, inputs, dys=None, wrt=None, device="cpu"):
    """The float64 reference outputs (and gradients) for these inputs."""
    wrt = spec.grad_inputs if wrt is None else tuple(wrt)
    dtype = primary(spec, inputs).dtype
    ref_in = to_reference(inputs, device, wrt)
    outs = flat_outputs(spec, spec.reference(ref_in, dtype=dtype))
    grads = {}
    if dys and wrt:
        diff = [(n, t) for n, t in outs if n in dys and t.requires_grad]
        ins = flat_inputs(ref_in, wrt)
        got = torch.autograd.grad([t for _, t in diff], [t for _, t in ins],
                                  [dys[n].to(device=device, dtype=torch.float64) for n, _ in diff])
        grads = {n: g for (n, _), g in zip(ins, got)}
    return [(n, t.detach()) for n, t in outs], grads


def assert_close(got, ref, tol, what):
    assert tuple(got.shape) == tuple(ref.shape), f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if got.numel() == 0:
        return
    if not got.is_floating_point():
        assert torch.equal(got.cpu(), ref.cpu().to(got.dtype)), f"{what}: integer values differ"
        return
    g = got.detach().to(device=ref.device, dtype=torch.float64)
    r = ref.detach().to(torch.float64)
    # Outputs come from torch.empty: memory the op left unwritten or filled
    # with garbage shows as NaN/Inf (see poison_allocator) where the reference has none.
    bad = ~torch.isfinite(g) & torch.isfinite(r)
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} non-finite values where the reference is finite, first at {first}")
    # where the reference is not finite (an overflowing input), the op gives
    # the same: NaN where it has NaN, the same infinity where it has one
    odd = ~torch.isfinite(r) & ~((torch.isnan(g) & torch.isnan(r)) | (g == r))
    if odd.any():
        first = tuple(int(i) for i in odd.nonzero()[0])
        raise AssertionError(f"{what}: {int(odd.sum())} values differ where the reference is not finite, "
                             f"first at {first}: {g[first].item()} against {r[first].item()}")
    fin = torch.isfinite(r)
    if not fin.any():
        return
    err = (g[fin] - r[fin]).abs().max().item()
    bound = tol * max(1.0, r[fin].abs().max().item())
    assert err <= bound, f"{what}: max|out - ref| = {err:.3e} > {bound:.3e}"


def assert_bitwise_equal(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, (
        f"{what}: {a.dtype}{tuple(a.shape)}@{a.device} vs {b.dtype}{tuple(b.shape)}@{b.device}")
    if a.dtype == torch.bool:
        assert torch.equal(a, b), f"{what}: not identical"
        return
    # integer views, so -0.0 vs 0.0 and NaN payloads count too
    ia = a.detach().contiguous().view(_INT_VIEW[a.dtype])
    ib = b.detach().contiguous().view(_INT_VIEW[b.dtype])
    assert torch.equal(ia, ib), f"{what}: not bit-identical ({int((ia != ib).sum())} elements differ)"


def grad_tol(spec: OpSpec, name: str, tol: float) -> float:
    return tol * (1.0 if name.split("[")[0] in spec.row_inputs or spec.list_inputs else spec.grad_slack)


def compare_results(spec, outs, grads, ref, ref_grads, tol, what=""):
    assert [n for n, _ in outs] == [n for n, _ in ref], f"outputs {[n for n, _ in outs]} vs reference {[n for n, _ in ref]}"
    for (n, t), (_, r) in zip(outs, ref):
        assert_close(t, r, tol, f"{what}{n}")
    assert set(grads) == set(ref_grads), f"gradients of {sorted(grads)} vs reference {sorted(ref_grads)}"
    for k, g in grads.items():
        assert_close(g, ref_grads[k], grad_tol(spec, k, tol), f"{what}grad {k}")


def check_against_reference(spec: OpSpec, inputs, gen, fn=None, dys=None):
    """Forward and every gradient of `fn` (route B by default) vs float64."""
    fn = spec.call if fn is None else fn
    p = primary(spec, inputs)
    dtype, device = p.dtype, p.device
    dys = dys_for(spec, inputs, gen) if dys is None else dys
    outs, grads = run_op(fn, spec, inputs, dys)
    ref, ref_grads = reference_run(spec, inputs, dys)
    for n, t in outs:
        assert t.device == device, f"{n} is on {t.device}"
        if t.is_floating_point():
            assert t.dtype == dtype, f"{n} is {t.dtype}, expected {dtype}"
    for k, g in grads.items():
        want = dict(flat_inputs(inputs))[k]
        assert g.dtype == want.dtype and g.device == device, f"grad {k} is {g.dtype} on {g.device}"
    compare_results(spec, outs, grads, ref, ref_grads, spec.tolerance(dtype))


# --- memory layouts ---------------------------------------------------------------

NEEDS_2D = {"transposed", "strided_rows", "expanded"}
LAYOUTS = ["contiguous", "transposed", "sliced", "strided_rows", "expanded", "storage_offset"]


def relayout(t, layout):
    """A view holding t's values (for "expanded": its first row, repeated) in
    the given memory layout. Padding the view skips over is NaN, so a kernel
    reading past a row's end or a wrong stride shows in its output."""
    if layout == "contiguous" or (layout in NEEDS_2D and t.dim() < 2) or t.dim() == 0:
        return t
    shape, n = tuple(t.shape), t.shape[-1]
    if layout == "transposed":  # last dim strided: not a (rows, n) view, the op must cope
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "expanded":  # stride-0 rows: every row aliases one
        return t[..., :1, :].expand(shape)
    if layout == "sliced":  # rows longer than n (row stride n + 3)
        buf = torch.full(shape[:-1] + (n + 3,), math.nan, dtype=t.dtype, device=t.device)
        view = buf[..., :n]
    elif layout == "strided_rows":  # every other row
        buf = torch.full(shape[:-2] + (2 * shape[-2], n), math.nan, dtype=t.dtype, device=t.device)
        view = buf[..., ::2, :]
    elif layout == "storage_offset":  # contiguous, one element off any vector alignment
        buf = torch.full((t.numel() + 1,), math.nan, dtype=t.dtype, device=t.device)
        view = buf[1:].view(shape)
    else:
        raise ValueError(layout)
    view.copy_(t)
    return view


def layout_applies(spec: OpSpec, layout: str) -> Optional[str]:
    """None, or why this layout is not tried for this op."""
    relaid = spec.row_inputs or spec.list_inputs
    if layout == "expanded" and set(spec.mutated_inputs) & set(relaid):
        return "an in-place write into stride-0 rows is refused (a hostile case), not a layout"
    return None


def relayout_rows(spec: OpSpec, inputs, layout):
    """The floating row inputs of the full row shape take the layout (and so,
    by the caller, the upstream gradient); index and shared inputs keep theirs.
    An op without row inputs (a list op) relays every floating tensor."""
    if layout_applies(spec, layout):
        return inputs
    if not spec.row_inputs:
        return map_tensors(inputs, lambda k, t: relayout(t, layout) if t.is_floating_point() else t)
    shape = primary(spec, inputs).shape
    return {k: (relayout(v, layout) if k in spec.row_inputs and is_float(v) and v.shape == shape else v)
            for k, v in inputs.items()}


def scaled(spec: OpSpec, inputs, scale):
    # scale the floating row inputs, or every floating tensor of a list op
    # (via float64, so the scaling itself rounds once)
    def f(k, t):
        if t.is_floating_point() and (k in spec.row_inputs or not spec.row_inputs):
            return (t.double() * scale).to(t.dtype)
        return t
    return map_tensors(inputs, f)


def refill(static, fresh):
    """Copy fresh inputs into the static tensors (same structure) in place."""
    with torch.no_grad():
        s, f = dict(flat_inputs(static)), dict(flat_inputs(fresh))
        for k, t in f.items():
            s[k].copy_(t)


def clone_inputs(inputs):
    return map_tensors(inputs, lambda k, t: t.detach().clone())


def results(spec: OpSpec, result) -> List[torch.Tensor]:
    return [t for _, t in flat_outputs(spec, result)]


__all__ = [n for n in dir() if not n.startswith("_")] + ["leaves"]
