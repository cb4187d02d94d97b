"""Reliability harnesses run over every operator in tests/op_registry.py:
CUDA graphs, streams, odd and huge shapes, memory layouts, hostile inputs,
property tests, determinism and route A vs route B. docs/reliability.md
describes each harness and tabulates every hostile input.

Accuracy is always measured against the float64 reference computed from the
very inputs the op saw (already rounded to its dtype), so the only error
measured is the op's own: max|out - ref| <= tol * max(1, max|ref|).
"""
import copy
import gc
import itertools
import math
import pathlib
import random
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import BASE_SEED, HAS_CUDA, requires_cuda
from op_registry import OPS, tensors

OP_PARAMS = [pytest.param(spec, id=spec.name) for spec in OPS]

requires_two_gpus = pytest.mark.skipif(
    not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _big_gpu():
    return HAS_CUDA and torch.cuda.get_device_properties(0).total_memory > 40e9


requires_big_gpu = pytest.mark.skipif(not _big_gpu(), reason="needs a CUDA GPU with more than 40 GB")

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "reliability.md"

_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32,
             torch.float16: torch.int16, torch.bfloat16: torch.int16}


def dtype_id(dtype):
    return str(dtype).replace("torch.", "")


def generator():
    # Seeded from the global RNG, which conftest seeds per test: reruns of a
    # test see the same inputs, different tests different ones.
    return torch.Generator().manual_seed(int(torch.randint(0, 2**62, ()).item()))


def randn_like_out(spec, inputs, gen):
    """A random upstream gradient shaped like the output (the row inputs)."""
    x = inputs[spec.row_inputs[0]]
    return torch.randn(tuple(x.shape), generator=gen).to(device=x.device, dtype=x.dtype)


def poison_allocator(device, *nbytes):
    # The op allocates its outputs with torch.empty. Filling and freeing
    # blocks of the sizes it is about to ask for makes the allocator likely to
    # hand them back, so an element the kernel fails to write reads as NaN
    # (all-ones bits, in every float dtype) rather than a lucky zero.
    blocks = [torch.full((b,), 255, dtype=torch.uint8, device=device) for b in nbytes if b > 0]
    del blocks


def nbytes(t):
    return t.numel() * t.element_size()


def run_op(fn, spec, inputs, dy=None, wrt=None):
    """out = fn(inputs) with the inputs named in `wrt` (default: all grad
    inputs) as leaves requiring grad; with dy, also their gradients.
    detach() keeps each tensor's layout (strides, offset, stride 0)."""
    wrt = spec.grad_inputs if wrt is None else tuple(wrt)
    leaves = {k: (v.detach().requires_grad_(k in wrt) if isinstance(v, torch.Tensor) else v)
              for k, v in inputs.items()}
    device = inputs[spec.row_inputs[0]].device
    poison_allocator(device, *(nbytes(inputs[k]) for k in spec.row_inputs))
    out = fn(leaves)
    grads = {}
    if dy is not None and wrt:
        poison_allocator(device, *(nbytes(inputs[k]) for k in wrt))
        got = torch.autograd.grad(out, [leaves[k] for k in wrt], dy)
        grads = dict(zip(wrt, got))
    return out.detach(), grads


def reference_run(spec, inputs, dy=None, wrt=None, device="cpu"):
    """The float64 reference output (and gradients) for these inputs."""
    wrt = spec.grad_inputs if wrt is None else tuple(wrt)
    dtype = inputs[spec.row_inputs[0]].dtype
    leaves = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            v = v.detach().to(device=device, dtype=torch.float64).requires_grad_(k in wrt)
        leaves[k] = v
    out = spec.reference(leaves, dtype=dtype)
    grads = {}
    if dy is not None and wrt:
        got = torch.autograd.grad(out, [leaves[k] for k in wrt], dy.to(device=device, dtype=torch.float64))
        grads = dict(zip(wrt, got))
    return out.detach(), grads


def assert_close(got, ref, tol, what):
    assert tuple(got.shape) == tuple(ref.shape), f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if got.numel() == 0:
        return
    g = got.detach().to(device=ref.device, dtype=torch.float64)
    r = ref.detach().to(torch.float64)
    # Outputs come from torch.empty: memory the op left unwritten or filled
    # with garbage shows as NaN/Inf (see poison_allocator) where the reference has none.
    bad = ~torch.isfinite(g) & torch.isfinite(r)
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} non-finite values where the reference is finite, first at {first}")
    err = (g - r).abs().max().item()
    bound = tol * max(1.0, r.abs().max().item())
    assert err <= bound, f"{what}: max|out - ref| = {err:.3e} > {bound:.3e}"


def assert_bitwise_equal(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, (
        f"{what}: {a.dtype}{tuple(a.shape)}@{a.device} vs {b.dtype}{tuple(b.shape)}@{b.device}")
    # integer views, so -0.0 vs 0.0 and NaN payloads count too
    ia = a.detach().contiguous().view(_INT_VIEW[a.dtype])
    ib = b.detach().contiguous().view(_INT_VIEW[b.dtype])
    assert torch.equal(ia, ib), f"{what}: not bit-identical ({int((ia != ib).sum())} elements differ)"


def check_against_reference(spec, inputs, gen, fn=None, dy=None):
    """Forward and every gradient of `fn` (route B by default) vs float64."""
    fn = spec.call if fn is None else fn
    x = inputs[spec.row_inputs[0]]
    dtype, device = x.dtype, x.device
    dy = randn_like_out(spec, inputs, gen) if dy is None else dy
    out, grads = run_op(fn, spec, inputs, dy)
    ref, ref_grads = reference_run(spec, inputs, dy)
    tol = spec.tolerance(dtype)
    assert out.dtype == dtype and out.device == device, f"out is {out.dtype} on {out.device}"
    assert_close(out, ref, tol, "out")
    for k, g in grads.items():
        assert g.dtype == inputs[k].dtype and g.device == device, f"grad {k} is {g.dtype} on {g.device}"
        slack = 1.0 if k in spec.row_inputs else spec.grad_slack
        assert_close(g, ref_grads[k], tol * slack, f"grad {k}")


# --- memory layouts ------------------------------------------------------------

NEEDS_2D = {"transposed", "strided_rows", "expanded"}
LAYOUTS = ["contiguous", "transposed", "sliced", "strided_rows", "expanded", "storage_offset"]


def relayout(t, layout):
    """A view holding t's values (for "expanded": its first row, repeated) in
    the given memory layout. Padding the view skips over is NaN, so a kernel
    reading past a row's end or a wrong stride shows in its output."""
    if layout == "contiguous" or (layout in NEEDS_2D and t.dim() < 2):
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


def relayout_rows(spec, inputs, layout):
    return {k: (relayout(v, layout) if k in spec.row_inputs else v) for k, v in inputs.items()}


# =============================================================================
# CUDA graphs
# =============================================================================


def _warm_up_on_side_stream(fn, iters=3):
    # As the CUDA graphs docs show: run a few times on a side stream before
    # capture, so lazy initialisation (handles, allocator pools) is not captured.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(iters):
            fn()
    torch.cuda.current_stream().wait_stream(side)


def _refill(static, fresh):
    with torch.no_grad():
        for k, t in tensors(fresh).items():
            static[k].copy_(t)


GRAPH_WIDTHS = [1024, 777]  # a width the vector (packed) path takes, and one it cannot


@requires_cuda
@pytest.mark.parametrize("n", GRAPH_WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("spec", OP_PARAMS)
def test_cuda_graph_forward(spec, dtype, n):
    gen = generator()
    shape = (257, n)
    static = spec.make_inputs(shape, dtype, "cuda", gen)

    def fwd():
        return spec.call(static)

    _warm_up_on_side_stream(fwd)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fwd()

    previous = None
    for _ in range(3):
        _refill(static, spec.make_inputs(shape, dtype, "cuda", gen))
        graph.replay()
        eager = fwd()
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager), "graph replay differs from an eager call on the same inputs"
        if previous is not None:
            # a replay that ignored the new inputs would repeat the last output
            assert not torch.equal(static_out, previous), "replay did not see the new inputs"
        previous = static_out.clone()
    ref, _ = reference_run(spec, static)
    assert_close(static_out, ref, spec.tolerance(dtype), "replayed out vs float64")


@requires_cuda
@pytest.mark.parametrize("n", GRAPH_WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("spec", OP_PARAMS)
def test_cuda_graph_forward_backward(spec, dtype, n):
    # The backward takes scratch memory (the weight-gradient partial sums):
    # it must come from PyTorch's allocator, or capture fails or replays stale data.
    gen = generator()
    shape = (257, n)
    static = spec.make_inputs(shape, dtype, "cuda", gen)
    for k in spec.grad_inputs:
        static[k].requires_grad_()
    static_dy = randn_like_out(spec, static, gen)

    def step():
        out = spec.call(static)
        grads = torch.autograd.grad(out, [static[k] for k in spec.grad_inputs], static_dy)
        return (out.detach(),) + tuple(grads)

    _warm_up_on_side_stream(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_results = step()

    names = ("out",) + tuple(f"grad {k}" for k in spec.grad_inputs)
    for _ in range(3):
        fresh = spec.make_inputs(shape, dtype, "cuda", gen)
        fresh["dy"] = randn_like_out(spec, fresh, gen)
        _refill({**static, "dy": static_dy}, fresh)
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        for got, want, what in zip(static_results, eager, names):
            assert torch.equal(got, want), f"{what}: graph replay differs from eager"
    ref, ref_grads = reference_run(spec, static, static_dy)
    tol = spec.tolerance(dtype)
    assert_close(static_results[0], ref, tol, "replayed out vs float64")
    for k, got in zip(spec.grad_inputs, static_results[1:]):
        slack = 1.0 if k in spec.row_inputs else spec.grad_slack
        assert_close(got, ref_grads[k], tol * slack, f"replayed grad {k} vs float64")


@requires_cuda
@pytest.mark.parametrize("spec", OP_PARAMS)
def test_compile_reduce_overhead_training(spec):
    # mode="reduce-overhead" runs the compiled forward and backward as CUDA
    # graphs (cudagraph trees); a few SGD steps must track eager ones.
    if spec.make_module is None:
        pytest.skip(f"{spec.name} has no module")
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    d_in, width, d_out, steps = 64, 256, 16, 8
    model = torch.nn.Sequential(
        torch.nn.Linear(d_in, width), spec.make_module(width), torch.nn.Linear(width, d_out)).cuda()
    twin = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_e = torch.optim.SGD(twin.parameters(), lr=0.05)

    gen = generator()
    losses_c, losses_e = [], []
    try:
        for _ in range(steps):
            # fresh tensors each step: cudagraph trees must copy them in
            x = torch.randn(32, d_in, generator=gen).cuda()
            target = torch.randn(32, d_out, generator=gen).cuda()
            torch.compiler.cudagraph_mark_step_begin()
            loss = F.mse_loss(compiled(x), target)
            opt_c.zero_grad(set_to_none=True)
            loss.backward()
            opt_c.step()
            losses_c.append(loss.item())

            loss = F.mse_loss(twin(x), target)
            opt_e.zero_grad(set_to_none=True)
            loss.backward()
            opt_e.step()
            losses_e.append(loss.item())
        skips = counters["inductor"]["cudagraph_skips"]
    finally:
        torch._dynamo.reset()

    # otherwise "reduce-overhead" silently ran without graphs, proving nothing
    assert skips == 0, f"cudagraphs were skipped {skips} time(s); see the 'skipping cudagraphs' warning"
    for step, (c, e) in enumerate(zip(losses_c, losses_e)):
        assert abs(c - e) <= 1e-4 * max(1.0, abs(e)), f"step {step}: compiled loss {c} vs eager {e}"
    moved = max((p.detach() - s).abs().max().item() for p, s in zip(model.parameters(), start))
    assert moved > 1e-3, "training did not change the parameters: the comparison would prove nothing"
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close(p, q, 1e-4, f"parameter {name} after {steps} steps")


# =============================================================================
# Streams and devices
# =============================================================================


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("spec", OP_PARAMS)
def test_side_stream(spec, dtype):
    # The input is produced late on a side stream (after a long sleep). The op
    # must run on the current stream: on the default stream instead it would
    # read the input before the multiply wrote it.
    gen = generator()
    base = spec.make_inputs((512, 2048), dtype, "cuda", gen)
    dy = randn_like_out(spec, base, gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # base and dy exist before the side stream reads them
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time
        produced = {k: (v * 2 if k in spec.row_inputs else v) for k, v in base.items()}
        out, grads = run_op(spec.call, spec, produced, dy)
        done = torch.cuda.Event()
        done.record()
    torch.cuda.current_stream().wait_event(done)
    ref, ref_grads = reference_run(spec, produced, dy)
    tol = spec.tolerance(dtype)
    assert_close(out, ref, tol, "out")
    for k, g in grads.items():
        assert_close(g, ref_grads[k], tol * (1.0 if k in spec.row_inputs else spec.grad_slack), f"grad {k}")


@requires_two_gpus
@pytest.mark.parametrize("spec", OP_PARAMS)
def test_tensors_on_second_gpu(spec):
    # Tensors on cuda:1 while cuda:0 is current: the op must switch device
    # and use cuda:1's current stream, where the inputs are produced late.
    torch.cuda.set_device(0)
    gen = generator()
    inputs = spec.make_inputs((300, 1536), torch.float32, "cuda:1", gen)
    dy = randn_like_out(spec, inputs, gen)
    with torch.cuda.device(1):
        torch.cuda._sleep(100_000_000)
        inputs = {k: (v * 2 if k in spec.row_inputs else v) for k, v in inputs.items()}
    assert torch.cuda.current_device() == 0
    out, grads = run_op(spec.call, spec, inputs, dy)
    assert torch.cuda.current_device() == 0, "the op left another device current"
    assert out.device == torch.device("cuda:1")
    for k, g in grads.items():
        assert g.device == torch.device("cuda:1"), f"grad {k} on {g.device}"
    ref, ref_grads = reference_run(spec, inputs, dy)
    tol = spec.tolerance(torch.float32)
    assert_close(out, ref, tol, "out")
    for k, g in grads.items():
        assert_close(g, ref_grads[k], tol * (1.0 if k in spec.row_inputs else spec.grad_slack), f"grad {k}")
    # the forward's arithmetic does not depend on the device: same bits on cuda:0
    on0, _ = run_op(spec.call, spec, {k: (v.to("cuda:0") if isinstance(v, torch.Tensor) else v)
                                      for k, v in inputs.items()})
    assert_bitwise_equal(out.to("cuda:0"), on0, "out on cuda:1 vs cuda:0")


# =============================================================================
# Shapes and layouts
# =============================================================================


@pytest.mark.parametrize("shape", [(0, 64), (3, 0, 64)], ids=["0x64", "3x0x64"])
@pytest.mark.parametrize("spec", OP_PARAMS)
def test_zero_rows(spec, device, shape):
    # No rows is a valid, empty batch: empty outputs, and the gradient of a
    # shared input is an empty sum, zero (not uninitialised memory).
    gen = generator()
    inputs = spec.make_inputs(shape, torch.float32, device, gen)
    dy = torch.empty(shape, device=device)
    out, grads = run_op(spec.call, spec, inputs, dy)
    assert tuple(out.shape) == shape and out.dtype == torch.float32
    assert set(grads) == set(spec.grad_inputs)
    for k, g in grads.items():
        assert g.shape == inputs[k].shape, f"grad {k}: shape {tuple(g.shape)}"
        if k not in spec.row_inputs:
            assert torch.equal(g, torch.zeros_like(inputs[k])), f"grad {k} over no rows must be zero"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("shape", [(1, 257), (257,), (1, 1)], ids=["1x257", "1d", "1x1"])
@pytest.mark.parametrize("spec", OP_PARAMS)
def test_one_row(spec, device, dtype, shape):
    check_against_reference(spec, spec.make_inputs(shape, dtype, device, generator()), generator())


@pytest.mark.parametrize("n", [7, 13, 127, 8191])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("spec", OP_PARAMS)
def test_prime_widths(spec, device, dtype, n):
    # Widths no vector width divides: the scalar tail of every loop runs.
    check_against_reference(spec, spec.make_inputs((5, n), dtype, device, generator()), generator())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("spec", OP_PARAMS)
def test_row_wider_than_any_tile(spec, device, dtype):
    # 100003 (prime) is wider than a block covers in one pass or keeps in
    # registers, and than the CPU kernel's summation blocks.
    check_against_reference(spec, spec.make_inputs((3, 100003), dtype, device, generator()), generator())


@pytest.mark.parametrize("n", [131, 256])
@pytest.mark.parametrize("layout", [l for l in LAYOUTS if l != "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("spec", OP_PARAMS)
def test_layouts(spec, device, dtype, layout, n):
    # The row inputs and the upstream gradient both take the layout; n = 256
    # would take the vector path if the layout allowed it.
    gen = generator()
    inputs = spec.make_inputs((6, n), dtype, device, gen)
    inputs = relayout_rows(spec, inputs, layout)
    x = inputs[spec.row_inputs[0]]
    if layout != "storage_offset":
        assert not x.is_contiguous()
    else:
        assert x.storage_offset() == 1
    dy = relayout(randn_like_out(spec, inputs, gen), layout)
    check_against_reference(spec, inputs, gen, dy=dy)


@requires_big_gpu
@pytest.mark.parametrize("spec", OP_PARAMS)
def test_more_than_2_31_elements(spec):
    # 2^31 + 3072 elements: any 32-bit element index overflows. Every row is
    # checked, against a float64 reference computed chunk by chunk on the
    # GPU; shared-input gradients are the sum of the chunks' gradients.
    dtype = torch.bfloat16
    rows, n = 2**21 + 3, 1024
    assert rows * n > 2**31
    try:
        _check_huge(spec, dtype, rows, n)
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def _check_huge(spec, dtype, rows, n):
    gen = torch.Generator(device="cuda").manual_seed(BASE_SEED)
    inputs = spec.make_inputs((rows, n), dtype, "cuda", gen)
    dy = torch.randn((rows, n), generator=gen, device="cuda", dtype=dtype)
    out, grads = run_op(spec.call, spec, inputs, dy)
    tol = spec.tolerance(dtype)
    shared_ref = {}
    chunk = 1 << 17
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        sub = {k: (v[r0:r1] if k in spec.row_inputs else v) for k, v in inputs.items()}
        ref, ref_grads = reference_run(spec, sub, dy[r0:r1], device="cuda")
        assert_close(out[r0:r1], ref, tol, f"out rows {r0}:{r1}")
        for k, g in ref_grads.items():
            if k in spec.row_inputs:
                assert_close(grads[k][r0:r1], g, tol, f"grad {k} rows {r0}:{r1}")
            else:
                shared_ref[k] = g if k not in shared_ref else shared_ref[k] + g
        del sub, ref, ref_grads
    for k, g in shared_ref.items():
        assert_close(grads[k], g, tol * spec.grad_slack, f"grad {k} (sum over all {rows} rows)")


# =============================================================================
# Hostile inputs
# =============================================================================


def _hostile_params():
    params = []
    for spec in OPS:
        for case in spec.hostile:
            devices = ["cuda"] if case.cuda_only else ["cpu", "cuda"]
            for dev in devices:
                marks = [requires_cuda] if dev == "cuda" else []
                params.append(pytest.param(spec, case, dev, id=f"{spec.name}-{case.name}-{dev}", marks=marks))
    return params


@pytest.mark.parametrize("route", ["route_b", "route_a"])
@pytest.mark.parametrize("spec,case,device", _hostile_params())
def test_hostile_input(spec, case, device, route):
    inputs = case.make(device, generator())
    fn = spec.call if route == "route_b" else spec.call_pybind
    if case.raises:
        # a clean RuntimeError naming the argument, never a crash or a result
        with pytest.raises(RuntimeError, match=case.raises):
            fn(inputs)
        return
    out = fn(inputs)
    want = spec.torch_equivalent(inputs)
    got = out.detach().cpu().float()
    assert got.shape == want.shape
    for what, mask in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
        assert torch.equal(mask(got), mask(want)), (
            f"{what} pattern differs from PyTorch's: op {mask(got).nonzero().tolist()} "
            f"vs torch {mask(want).nonzero().tolist()}")
    finite = torch.isfinite(want)
    if finite.any():
        err = (got[finite] - want[finite]).abs().max().item()
        bound = 2 * spec.tolerance(inputs[spec.row_inputs[0]].dtype) * max(1.0, want[finite].abs().max().item())
        assert err <= bound, f"finite values: max|op - torch| = {err:.3e} > {bound:.3e}"
    if case.check:
        case.check(spec, inputs, out)


def _grad_subset_params():
    params = []
    for spec in OPS:
        full = set(spec.grad_inputs)
        for r in range(len(spec.grad_inputs)):
            for subset in itertools.combinations(spec.grad_inputs, r):
                if set(subset) != full:
                    name = "+".join(subset) + "_only" if subset else "none"
                    params.append(pytest.param(spec, subset, id=f"{spec.name}-{name}"))
    return params


@pytest.mark.parametrize("route", ["route_b", "route_a"])
@pytest.mark.parametrize("spec,subset", _grad_subset_params())
def test_requires_grad_subsets(spec, subset, device, route):
    # Only some inputs (or none) require grad: the backward must still give
    # the right gradients for those that do, and with none there is no graph.
    fn = spec.call if route == "route_b" else spec.call_pybind
    gen = generator()
    inputs = spec.make_inputs((6, 50), torch.float32, device, gen)
    if not subset:
        out = fn(inputs)
        assert not out.requires_grad and out.grad_fn is None
        ref, _ = reference_run(spec, inputs, wrt=())
        assert_close(out, ref, spec.tolerance(torch.float32), "out")
        return
    dy = randn_like_out(spec, inputs, gen)
    out, grads = run_op(fn, spec, inputs, dy, wrt=subset)
    _, ref_grads = reference_run(spec, inputs, dy, wrt=subset)
    tol = spec.tolerance(torch.float32)
    for k in subset:
        assert_close(grads[k], ref_grads[k], tol * (1.0 if k in spec.row_inputs else spec.grad_slack), f"grad {k}")


# =============================================================================
# Randomised
# =============================================================================

SCALES = [1e-4, 1.0, 1e4]


def _scaled(spec, inputs, scale):
    # scale the row inputs (via float64, so the scaling itself rounds once)
    return {k: ((v.double() * scale).to(v.dtype) if k in spec.row_inputs else v) for k, v in inputs.items()}


@pytest.mark.parametrize("spec", OP_PARAMS)
@settings(max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    lead=st.lists(st.integers(0, 5), max_size=2),
    n=st.integers(1, 300),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.float16, torch.bfloat16]),
    layout=st.sampled_from(LAYOUTS),
    scale=st.sampled_from(SCALES),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_cpu(spec, lead, n, dtype, layout, scale, seed):
    # 1-D, 2-D and 3-D shapes (rows may be 0), any width up to 300, every
    # dtype, every layout, values ~1e-4, ~1 or ~1e4: forward and gradients
    # match the float64 reference.
    if dtype not in spec.dtypes:
        return
    gen = torch.Generator().manual_seed(seed)
    inputs = spec.make_inputs(tuple(lead) + (n,), dtype, "cpu", gen)
    inputs = relayout_rows(spec, _scaled(spec, inputs, scale), layout)
    check_against_reference(spec, inputs, gen)


SWEEP_CASES = 30
SWEEP_WIDTHS = [256, 1024, 2048, 4096, 8192, 16384, 20480, 32768]


def _sweep_case(index):
    rng = random.Random(BASE_SEED * 1000 + index)
    dtype = rng.choice([torch.float64, torch.float32, torch.float16, torch.bfloat16])
    kind = rng.random()
    if kind < 0.35:
        n = rng.randint(1, 300)
    elif kind < 0.7:
        n = rng.randint(300, 20000)
    else:
        n = rng.choice(SWEEP_WIDTHS)  # vector-friendly: the packed and register-resident paths
    max_rows = max(1, 1_000_000 // n)  # keeps the CPU float64 reference quick
    ndim = rng.choice([1, 2, 2, 3])
    if ndim == 1:
        lead = ()
    elif ndim == 2:
        lead = (rng.randint(0, min(max_rows, 3000)),)
    else:
        a = rng.randint(1, 8)
        lead = (a, rng.randint(0, max(1, min(max_rows // a, 400))))
    # contiguous often: the only layout the vector and register-resident
    # kernels see (the bridge copies the ones it cannot view as rows)
    layout = "contiguous" if rng.random() < 0.4 else rng.choice(LAYOUTS[1:])
    scale = rng.choice(SCALES)
    seed = rng.randrange(2**31)
    return dtype, lead + (n,), layout, scale, seed


@requires_cuda
@pytest.mark.parametrize("index", range(SWEEP_CASES))
@pytest.mark.parametrize("spec", OP_PARAMS)
def test_random_sweep_cuda(spec, index):
    dtype, shape, layout, scale, seed = _sweep_case(index)
    if dtype not in spec.dtypes:
        pytest.skip(f"{spec.name} has no {dtype}")
    gen = torch.Generator().manual_seed(seed)
    inputs = spec.make_inputs(shape, dtype, "cuda", gen)
    inputs = relayout_rows(spec, _scaled(spec, inputs, scale), layout)
    try:
        check_against_reference(spec, inputs, gen)
    except AssertionError as e:
        raise AssertionError(f"case {index}: {dtype_id(dtype)} {shape} {layout} scale {scale}: {e}") from None


# =============================================================================
# Determinism
# =============================================================================


@pytest.mark.parametrize("n", [1000, 999])  # vector path and scalar path on CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("spec", OP_PARAMS)
def test_deterministic(spec, device, dtype, n):
    # 3000 rows: a weight gradient reduced with atomics or in thread-count
    # dependent order would differ between runs. On the CPU the runs also
    # change the OpenMP thread count (torch.set_num_threads reaches the one
    # OpenMP runtime both use): the result must not depend on it.
    gen = generator()
    inputs = spec.make_inputs((3000, n), dtype, device, gen)
    dy = randn_like_out(spec, inputs, gen)
    original = torch.get_num_threads()
    threads = [original, 1, 3] if device == "cpu" else [original] * 3
    runs = []
    try:
        for t in threads:
            torch.set_num_threads(t)
            out, grads = run_op(spec.call, spec, inputs, dy)
            runs.append([out] + [grads[k] for k in spec.grad_inputs])
    finally:
        torch.set_num_threads(original)
    names = ["out"] + [f"grad {k}" for k in spec.grad_inputs]
    for i, run in enumerate(runs[1:], start=1):
        for a, b, what in zip(runs[0], run, names):
            assert_bitwise_equal(a, b, f"{what}, run 0 vs run {i} (threads {threads[0]} vs {threads[i]})")


# =============================================================================
# Route A vs route B
# =============================================================================


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("spec", OP_PARAMS)
def test_route_a_equals_route_b(spec, device, dtype):
    # Both routes call the same bridge and kernels: identical bits, forward
    # and every gradient.
    gen = generator()
    inputs = spec.make_inputs((64, 769), dtype, device, gen)
    dy = randn_like_out(spec, inputs, gen)
    out_b, grads_b = run_op(spec.call, spec, inputs, dy)
    out_a, grads_a = run_op(spec.call_pybind, spec, inputs, dy)
    assert_bitwise_equal(out_a, out_b, "out")
    for k in spec.grad_inputs:
        assert_bitwise_equal(grads_a[k], grads_b[k], f"grad {k}")


# =============================================================================
# The documentation of this file
# =============================================================================


def test_docs_match_the_harness():
    # docs/reliability.md tabulates every hostile case, and every test it
    # names exists here.
    text = DOCS.read_text()
    for spec in OPS:
        for case in spec.hostile:
            assert f"`{case.name}`" in text, f"docs/reliability.md does not list hostile case {case.name!r}"
    named = set(re.findall(r"`(test_\w+)(?![\w.])", text))  # not `test_x.py`
    assert named, "docs/reliability.md names no tests"
    missing = sorted(n for n in named if n not in globals())
    assert not missing, f"docs/reliability.md names tests that do not exist: {missing}"
