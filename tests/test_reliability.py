"""Reliability harnesses over every op spec (opsmith.specs, plus the test-only
ops of tests/testing_ops.py): float64 reference on CPU and CUDA, CUDA graphs,
streams, odd and huge shapes, memory layouts, hostile inputs, requires-grad
subsets, property tests, determinism and route A vs route B. The PyTorch
integration harnesses (opcheck, gradcheck, double backward, torch.func,
torch.compile) are in test_integration.py. docs/reliability.md describes each
harness; its hostile-input table is generated from the specs.

A harness that does not apply to a kind of op (no row inputs, no gradients,
no route A) is not generated for it."""
import copy
import ctypes
import gc
import itertools
import random
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import opsmith
import opsmith.specs
from conftest import BASE_SEED, HAS_CUDA, requires_cuda
from harness import (ALL_SPECS, DTYPES, LAYOUTS, NATIVE_SPECS, assert_bitwise_equal, assert_close,
                     check_against_reference, clone_inputs, compare_results, dtype_id, dys_for,
                     flat_inputs, generator, grad_tol, layout_applies, op_params, primary, reference_run,
                     refill, relayout, relayout_rows, results, run_op, scaled)

ROWS = lambda s: bool(s.row_inputs)  # noqa: E731
GRADS = lambda s: bool(s.grad_inputs)  # noqa: E731
ROUTE_A = lambda s: s.call_pybind is not None  # noqa: E731

requires_two_gpus = pytest.mark.skipif(
    not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _big_gpu():
    return HAS_CUDA and torch.cuda.get_device_properties(0).total_memory > 40e9


requires_big_gpu = pytest.mark.skipif(not _big_gpu(), reason="needs a CUDA GPU with more than 40 GB")


def _supports(spec, dtype):
    if dtype not in spec.dtypes:
        pytest.skip(f"{spec.name} has no {dtype_id(dtype)}")


# =============================================================================
# float64 reference, CPU and CUDA
# =============================================================================


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec", op_params())
def test_reference(spec, device, dtype):
    # fresh random inputs (never zeros), outputs from a poisoned allocator
    _supports(spec, dtype)
    check_against_reference(spec, spec.make_inputs((37, 300), dtype, device, generator()), generator())


@pytest.mark.parametrize("spec", op_params(lambda s: bool(s.index_inputs)))
def test_index_inputs(spec, device):
    # the integer inputs lie in their declared range, and the ignore value is
    # among them (so the harnesses reach the ignore path)
    inputs = spec.make_inputs((64, 50), torch.float32, device, generator())
    for idx in spec.index_inputs:
        t = inputs[idx.name]
        assert t.dtype == torch.int64, f"{idx.name} is {t.dtype}"
        high = idx.high(inputs)
        in_range = (t >= 0) & (t < high)
        ignored = t == idx.ignore_index if idx.ignore_index is not None else torch.zeros_like(in_range)
        assert bool((in_range | ignored).all()), f"{idx.name} outside [0, {high})"
        if idx.ignore_index is not None:
            assert bool(ignored.any()) and bool(in_range.any())
            all_ignored = dict(inputs, **{idx.name: torch.full_like(t, idx.ignore_index)})
            check_against_reference(spec, all_ignored, generator())


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


GRAPH_WIDTHS = [1024, 777]  # a width the vector (packed) path takes, and one it cannot


@requires_cuda
@pytest.mark.parametrize("n", GRAPH_WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("spec", op_params())
def test_cuda_graph_forward(spec, dtype, n):
    gen = generator()
    shape = (257, n)
    static = spec.make_inputs(shape, dtype, "cuda", gen)

    def fwd():
        return [t.detach() for t in results(spec, spec.call(static))]

    _warm_up_on_side_stream(fwd)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fwd()

    previous = None
    for _ in range(3):
        fresh = spec.make_inputs(shape, dtype, "cuda", gen)
        refill(static, fresh)
        graph.replay()
        got = [t.clone() for t in static_out]
        eager, _ = run_op(spec.call, spec, fresh, wrt=())
        torch.cuda.synchronize()
        for g, (name, e) in zip(got, eager):
            assert torch.equal(g, e), f"{name}: graph replay differs from an eager call on the same inputs"
        if previous is not None:
            # a replay that ignored the new inputs would repeat the last output
            assert not all(torch.equal(g, p) for g, p in zip(got, previous)), "replay did not see the new inputs"
        previous = got
        last = fresh
    ref, _ = reference_run(spec, last)
    for g, (name, r) in zip(previous, ref):
        assert_close(g, r, spec.tolerance(dtype), f"replayed {name} vs float64")


@requires_cuda
@pytest.mark.parametrize("n", GRAPH_WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("spec", op_params(GRADS))
def test_cuda_graph_forward_backward(spec, dtype, n):
    # The backward takes scratch memory (the weight-gradient partial sums):
    # it must come from PyTorch's allocator, or capture fails or replays stale data.
    gen = generator()
    shape = (257, n)
    static = spec.make_inputs(shape, dtype, "cuda", gen)
    static_dys = dys_for(spec, static, gen)
    leaves_in = dict(flat_inputs(static, spec.grad_inputs))
    for t in leaves_in.values():
        t.requires_grad_()

    def step():
        outs = [(k, t) for k, t in opsmith.specs.flat_outputs(spec, spec.call(static)) if k in static_dys]
        grads = torch.autograd.grad([t for _, t in outs], list(leaves_in.values()),
                                    [static_dys[k] for k, _ in outs])
        return [t.detach() for _, t in outs] + list(grads)

    _warm_up_on_side_stream(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_results = step()

    for _ in range(3):
        fresh = spec.make_inputs(shape, dtype, "cuda", gen)
        fresh_dys = {k: torch.randn_like(v) for k, v in static_dys.items()}
        refill(static, fresh)
        refill(static_dys, fresh_dys)
        graph.replay()
        got = [t.clone() for t in static_results]
        eager = step()
        torch.cuda.synchronize()
        for i, (g, e) in enumerate(zip(got, eager)):
            assert torch.equal(g, e), f"result {i}: graph replay differs from eager"
    ref, ref_grads = reference_run(spec, static, static_dys)
    tol = spec.tolerance(dtype)
    ref_diff = [r for k, r in ref if k in static_dys]
    for i, r in enumerate(ref_diff):
        assert_close(got[i], r, tol, f"replayed output {i} vs float64")
    for k, g in zip(leaves_in, got[len(ref_diff):]):
        assert_close(g, ref_grads[k], grad_tol(spec, k, tol), f"replayed grad {k} vs float64")


@requires_cuda
@pytest.mark.parametrize("spec", op_params(lambda s: s.make_module is not None))
def test_compile_reduce_overhead_training(spec):
    # mode="reduce-overhead" runs the compiled forward and backward as CUDA
    # graphs (cudagraph trees); a few SGD steps must track eager ones.
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


def _produced_late(spec, inputs):
    # the floating row inputs (every floating tensor of a list op), recomputed
    return scaled(spec, inputs, 2.0)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("spec", op_params())
def test_side_stream(spec, dtype):
    # The input is produced late on a side stream (after a long sleep). The op
    # must run on the current stream: on the default stream instead it would
    # read the input before the multiply wrote it.
    gen = generator()
    base = spec.make_inputs((512, 2048), dtype, "cuda", gen)
    dys = dys_for(spec, base, gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # base and dys exist before the side stream reads them
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time
        produced = _produced_late(spec, base)
        outs, grads = run_op(spec.call, spec, produced, dys)
        done = torch.cuda.Event()
        done.record()
    torch.cuda.current_stream().wait_event(done)
    ref, ref_grads = reference_run(spec, produced, dys)
    compare_results(spec, outs, grads, ref, ref_grads, spec.tolerance(dtype))


@requires_two_gpus
@pytest.mark.parametrize("spec", op_params())
def test_tensors_on_second_gpu(spec):
    # Tensors on cuda:1 while cuda:0 is current: the op must switch device
    # and use cuda:1's current stream, where the inputs are produced late.
    torch.cuda.set_device(0)
    gen = generator()
    inputs = spec.make_inputs((300, 1536), torch.float32, "cuda:1", gen)
    dys = dys_for(spec, inputs, gen)
    with torch.cuda.device(1):
        torch.cuda._sleep(100_000_000)
        inputs = _produced_late(spec, inputs)
    assert torch.cuda.current_device() == 0
    outs, grads = run_op(spec.call, spec, inputs, dys)
    assert torch.cuda.current_device() == 0, "the op left another device current"
    for k, t in outs + list(grads.items()):
        assert t.device == torch.device("cuda:1"), f"{k} on {t.device}"
    ref, ref_grads = reference_run(spec, inputs, dys)
    compare_results(spec, outs, grads, ref, ref_grads, spec.tolerance(torch.float32))
    # the forward's arithmetic does not depend on the device: same bits on cuda:0
    on0, _ = run_op(spec.call, spec, opsmith.specs.map_tensors(inputs, lambda k, t: t.to("cuda:0")), wrt=())
    for (k, a), (_, b) in zip(outs, on0):
        assert_bitwise_equal(a.to("cuda:0"), b, f"{k} on cuda:1 vs cuda:0")


# =============================================================================
# Shapes and layouts
# =============================================================================


@pytest.mark.parametrize("shape", [(0, 64), (3, 0, 64)], ids=["0x64", "3x0x64"])
@pytest.mark.parametrize("spec", op_params(ROWS))
def test_zero_rows(spec, device, shape):
    # No rows is a valid, empty batch: empty outputs whose leading dims are
    # the rows, and the gradient of a shared input is an empty sum, zero (not
    # uninitialised memory).
    gen = generator()
    inputs = spec.make_inputs(shape, torch.float32, device, gen)
    dys = dys_for(spec, inputs, gen)
    outs, grads = run_op(spec.call, spec, inputs, dys)
    lead = shape[:-1]
    for k, t in outs:
        assert tuple(t.shape[:len(lead)]) == lead and t.numel() == 0, f"{k}: shape {tuple(t.shape)}"
    assert set(grads) == set(spec.grad_inputs)
    for k, g in grads.items():
        assert g.shape == inputs[k].shape, f"grad {k}: shape {tuple(g.shape)}"
        if k not in spec.row_inputs:
            assert torch.equal(g, torch.zeros_like(inputs[k])), f"grad {k} over no rows must be zero"
    ref, ref_grads = reference_run(spec, inputs, dys)
    compare_results(spec, outs, grads, ref, ref_grads, spec.tolerance(torch.float32))


@pytest.mark.parametrize("shape", [(4, 0), (2, 3, 0)], ids=["4x0", "2x3x0"])
@pytest.mark.parametrize("spec", op_params(lambda s: ROWS(s) and s.zero_width))
def test_zero_width(spec, device, shape):
    # Rows of width 0, as PyTorch's own op takes them: empty outputs of the
    # reference's shapes, empty gradients of the inputs' shapes, no kernel.
    gen = generator()
    inputs = spec.make_inputs(shape, torch.float32, device, gen)
    dys = dys_for(spec, inputs, gen)
    outs, grads = run_op(spec.call, spec, inputs, dys)
    ref, ref_grads = reference_run(spec, inputs, dys)
    for (k, t), (_, r) in zip(outs, ref):
        assert t.shape == r.shape, f"{k}: shape {tuple(t.shape)}, reference {tuple(r.shape)}"
        # the rows' own outputs are empty; a per-row output (a statistic over
        # nothing) is what the reference gives, NaN included
        torch.testing.assert_close(t.cpu().double(), r.cpu().double(), equal_nan=True, msg=k)
    assert any(t.numel() == 0 for _, t in outs), "no output is empty"
    assert set(grads) == set(spec.grad_inputs)
    for k, g in grads.items():
        assert g.shape == inputs[k].shape and g.numel() == 0, f"grad {k}: shape {tuple(g.shape)}"


def test_zero_width_norm_statistics(device):
    # the norms' per-row statistics over no elements: NaN (a mean over
    # nothing), written although no kernel runs
    x = torch.randn(3, 0, device=device)
    _, mean, rstd = torch.ops.opsmith.layer_norm_fwd(x, None, None, 1e-5)
    _, inv = torch.ops.opsmith.rms_norm_fwd(x, None, None)
    _, h, inv_add = torch.ops.opsmith.fused_add_rms_norm_fwd(x, x, torch.ones(0, device=device), 1e-6)
    assert h.shape == (3, 0)
    for name, t in (("mean", mean), ("rstd", rstd), ("inv_rms", inv), ("fused add inv_rms", inv_add)):
        assert t.shape == (3,) and bool(t.isnan().all()), f"{name}: {t}"


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(1, 257), (257,), (1, 1)], ids=["1x257", "1d", "1x1"])
@pytest.mark.parametrize("spec", op_params())
def test_one_row(spec, device, dtype, shape):
    _supports(spec, dtype)
    check_against_reference(spec, spec.make_inputs(shape, dtype, device, generator()), generator())


@pytest.mark.parametrize("n", [7, 13, 127, 8191])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec", op_params())
def test_prime_widths(spec, device, dtype, n):
    # Widths no vector width divides: the scalar tail of every loop runs.
    _supports(spec, dtype)
    check_against_reference(spec, spec.make_inputs((5, n), dtype, device, generator()), generator())


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec", op_params())
def test_row_wider_than_any_tile(spec, device, dtype):
    # 100003 (prime) is wider than a block covers in one pass or keeps in
    # registers, and than the CPU kernel's summation blocks.
    _supports(spec, dtype)
    check_against_reference(spec, spec.make_inputs((3, 100003), dtype, device, generator()), generator())


def _layout_params():
    params = []
    for spec in ALL_SPECS:
        for layout in LAYOUTS[1:]:
            why = layout_applies(spec, layout)
            marks = [pytest.mark.skip(reason=why)] if why else []
            params.append(pytest.param(spec, layout, id=f"{spec.name}-{layout}", marks=marks))
    return params


@pytest.mark.parametrize("n", [131, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec,layout", _layout_params())
def test_layouts(spec, device, dtype, layout, n):
    # The row inputs (every floating tensor of a list op) and the upstream
    # gradients take the layout; n = 256 would take the vector path if the
    # layout allowed it.
    _supports(spec, dtype)
    gen = generator()
    inputs = relayout_rows(spec, spec.make_inputs((6, n), dtype, device, gen), layout)
    x = primary(spec, inputs)
    if layout != "storage_offset":
        assert not x.is_contiguous()
    else:
        assert x.storage_offset() == 1
    dys = {k: relayout(v, layout) for k, v in dys_for(spec, inputs, gen).items()}
    check_against_reference(spec, inputs, gen, dys=dys)


@requires_big_gpu
@pytest.mark.parametrize("spec", op_params(ROWS))
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
    with torch.no_grad():  # the outputs' shapes, for upstream gradients drawn on the GPU
        shapes = [(k, t.shape) for k, t in run_op(spec.call, spec, inputs, wrt=(), check_inputs=False)[0]
                  if k.split("[")[0] in spec.diff_output_names]
    dys = {k: torch.randn(shape, generator=gen, device="cuda", dtype=dtype) for k, shape in shapes}
    outs, grads = run_op(spec.call, spec, inputs, dys, check_inputs=False)
    tol = spec.tolerance(dtype)
    shared_ref = {}
    chunk = 1 << 17
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        sub = {k: (v[r0:r1] if k in spec.row_inputs else v) for k, v in inputs.items()}
        ref, ref_grads = reference_run(spec, sub, {k: d[r0:r1] for k, d in dys.items()}, device="cuda")
        for (k, got), (_, r) in zip(outs, ref):
            assert_close(got[r0:r1], r, tol, f"{k} rows {r0}:{r1}")
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


def _meta_params():
    params = []
    for spec in ALL_SPECS:
        if not spec.native or spec.list_inputs:
            continue
        names = [k for k, v in spec.make_inputs((4, 64), torch.float32, "cpu", generator()).items()
                 if isinstance(v, torch.Tensor)]
        params += [pytest.param(spec, name, id=f"{spec.name}-{name}") for name in names[1:]]
    return params


@pytest.mark.parametrize("spec,name", _meta_params())
def test_an_input_left_on_meta_is_refused(spec, name):
    # a weight never loaded (a model built on the meta device) beside real
    # inputs: the dispatcher sends the call to the fake kernel, which must
    # refuse it as the bridge does, not return uninitialised memory
    inputs = spec.make_inputs((4, 64), torch.float32, "cpu", generator())
    inputs[name] = inputs[name].detach().to("meta")
    # named as the op's argument (the spec's cos_cache is the op's cos)
    with pytest.raises(RuntimeError, match=rf"\b{name.split('_')[0]}\w* must be on the same device as"):
        spec.call(inputs)



def _routes(spec):
    return [("route_b", spec.call)] + ([("route_a", spec.call_pybind)] if spec.call_pybind else [])


def _hostile_params():
    params = []
    for spec in ALL_SPECS:
        for case in spec.hostile:
            for dev in (["cuda"] if case.cuda_only else ["cpu", "cuda"]):
                for route, _ in _routes(spec):
                    marks = [requires_cuda] if dev == "cuda" else []
                    params.append(pytest.param(spec, case, dev, route, marks=marks,
                                               id=f"{spec.name}-{case.name}-{dev}-{route}"))
    return params


@pytest.mark.parametrize("spec,case,device,route", _hostile_params())
def test_hostile_input(spec, case, device, route):
    inputs = case.make(device, generator())
    fn = dict(_routes(spec))[route]
    if case.raises:
        # a clean RuntimeError naming the argument, never a crash or a result
        with pytest.raises(RuntimeError, match=case.raises):
            fn(inputs)
        return
    want = [t for _, t in opsmith.specs.flat_outputs(spec, spec.torch_equivalent(clone_inputs(inputs)))]
    original = clone_inputs(inputs)
    out = fn(inputs)
    got_all = results(spec, out)
    assert len(got_all) == len(want)
    tol = 2 * spec.tolerance(primary(spec, inputs).dtype)
    for i, (g, w) in enumerate(zip(got_all, want)):
        g = g.detach().cpu().float()
        assert g.shape == w.shape, f"output {i}: shape {tuple(g.shape)} vs torch {tuple(w.shape)}"
        for what, mask in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
            assert torch.equal(mask(g), mask(w)), (
                f"output {i}: {what} pattern differs from PyTorch's: op {mask(g).nonzero().tolist()} "
                f"vs torch {mask(w).nonzero().tolist()}")
        finite = torch.isfinite(w)
        if finite.any():
            err = (g[finite] - w[finite]).abs().max().item()
            bound = tol * max(1.0, w[finite].abs().max().item())
            assert err <= bound, f"output {i}: finite values: max|op - torch| = {err:.3e} > {bound:.3e}"
    if case.check:
        case.check(spec, original, out)


def _grad_subset_params():
    params = []
    for spec in ALL_SPECS:
        full = set(spec.grad_inputs)
        for r in range(len(spec.grad_inputs)):
            for subset in itertools.combinations(spec.grad_inputs, r):
                if set(subset) != full:
                    name = "+".join(subset) + "_only" if subset else "none"
                    for route, _ in _routes(spec):
                        params.append(pytest.param(spec, subset, route, id=f"{spec.name}-{name}-{route}"))
    return params


@pytest.mark.parametrize("spec,subset,route", _grad_subset_params())
def test_requires_grad_subsets(spec, subset, device, route):
    # Only some inputs (or none) require grad: the backward must still give
    # the right gradients for those that do, and with none there is no graph.
    fn = dict(_routes(spec))[route]
    gen = generator()
    inputs = spec.make_inputs((6, 50), torch.float32, device, gen)
    tol = spec.tolerance(torch.float32)
    if not subset:
        outs = results(spec, fn(clone_inputs(inputs)))
        for t in outs:
            assert not t.requires_grad and t.grad_fn is None
        ref, _ = reference_run(spec, inputs, wrt=())
        for t, (k, r) in zip(outs, ref):
            assert_close(t, r, tol, k)
        return
    dys = dys_for(spec, inputs, gen)
    _, grads = run_op(fn, spec, inputs, dys, wrt=subset)
    _, ref_grads = reference_run(spec, inputs, dys, wrt=subset)
    assert set(grads) == set(ref_grads)
    for k in grads:
        assert_close(grads[k], ref_grads[k], grad_tol(spec, k, tol), f"grad {k}")


# =============================================================================
# Randomised
# =============================================================================

SCALES = [1e-4, 1.0, 1e4]


@pytest.mark.parametrize("spec", op_params())
@settings(max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    lead=st.lists(st.integers(0, 5), max_size=2),
    n=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
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
    scale = min(scale, spec.max_scale)
    gen = torch.Generator().manual_seed(seed)
    inputs = spec.make_inputs(tuple(lead) + (n,), dtype, "cpu", gen)
    inputs = relayout_rows(spec, scaled(spec, inputs, scale), layout)
    check_against_reference(spec, inputs, gen)


SWEEP_CASES = 30
SWEEP_WIDTHS = [256, 1024, 2048, 4096, 8192, 16384, 20480, 32768]


def _sweep_case(index):
    rng = random.Random(BASE_SEED * 1000 + index)
    dtype = rng.choice(DTYPES)
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
@pytest.mark.parametrize("spec", op_params())
def test_random_sweep_cuda(spec, index):
    dtype, shape, layout, scale, seed = _sweep_case(index)
    _supports(spec, dtype)
    scale = min(scale, spec.max_scale)
    gen = torch.Generator().manual_seed(seed)
    inputs = spec.make_inputs(shape, dtype, "cuda", gen)
    inputs = relayout_rows(spec, scaled(spec, inputs, scale), layout)
    try:
        check_against_reference(spec, inputs, gen)
    except AssertionError as e:
        raise AssertionError(f"case {index}: {dtype_id(dtype)} {shape} {layout} scale {scale}: {e}") from None


# =============================================================================
# Determinism and CPU threads
# =============================================================================


def _opsmith_num_threads():
    lib = ctypes.CDLL(opsmith.library_path())
    if not hasattr(lib, "opsmith_get_num_threads"):
        pytest.skip("the library does not export opsmith_get_num_threads (older C ABI)")
    fn = lib.opsmith_get_num_threads
    fn.restype, fn.argtypes = ctypes.c_int, []
    return fn


@pytest.mark.parametrize("n", [1000, 999])  # vector path and scalar path on CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("spec", op_params())
def test_deterministic(spec, device, dtype, n):
    # 3000 rows: a weight gradient reduced with atomics or in thread-count
    # dependent order would differ between runs. On the CPU the runs also
    # change the thread count (torch.set_num_threads; opsmith's CPU launcher
    # takes at::get_num_threads(), checked below): the result must not depend on it.
    gen = generator()
    inputs = spec.make_inputs((3000, n), dtype, device, gen)
    dys = dys_for(spec, inputs, gen)
    original = torch.get_num_threads()
    threads = [original, 1, 3] if device == "cpu" else [original] * 3
    get_threads = _opsmith_num_threads() if device == "cpu" and spec.native else None
    runs = []
    try:
        for t in threads:
            torch.set_num_threads(t)
            outs, grads = run_op(spec.call, spec, inputs, dys)
            if get_threads is not None:
                assert get_threads() == t, f"torch.set_num_threads({t}) did not reach opsmith: {get_threads()}"
            runs.append(outs + sorted(grads.items()))
    finally:
        torch.set_num_threads(original)
    for i, run in enumerate(runs[1:], start=1):
        for (what, a), (_, b) in zip(runs[0], run):
            assert_bitwise_equal(a, b, f"{what}, run 0 vs run {i} (threads {threads[0]} vs {threads[i]})")


def _openmp_runtimes():
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "/" in line}
    names = {}
    for p in paths:
        base = p.rsplit("/", 1)[-1]
        for kind in ("libgomp", "libiomp", "libomp"):
            if base.startswith(kind + ".") or base.startswith(kind + "-") or base.startswith(kind + "5"):
                names.setdefault(kind, set()).add(p)
    return names


@pytest.mark.skipif(not torch.backends.openmp.is_available(), reason="torch built without OpenMP")
def test_openmp_runtimes_and_threads(record_property):
    # Which OpenMP runtimes this process has loaded: torch's own and the one
    # opsmith's C library was linked with may differ (libgomp vs libomp /
    # libiomp). Whatever is loaded, the thread count opsmith's CPU kernels
    # use must follow torch.set_num_threads, because the bridge passes it on
    # explicitly rather than relying on a shared runtime.
    x = torch.randn(64, 300)
    opsmith.rms_norm(x, None, 1e-6)
    runtimes = _openmp_runtimes()
    record_property("openmp_runtimes", {k: sorted(v) for k, v in runtimes.items()})
    assert runtimes, "torch reports OpenMP, yet no OpenMP runtime is mapped"
    get_threads = _opsmith_num_threads()
    original = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            opsmith.rms_norm(x, None, 1e-6)
            assert get_threads() == t, (
                f"with OpenMP runtimes {sorted(runtimes)} loaded, torch.set_num_threads({t}) "
                f"gave opsmith {get_threads()} threads")
    finally:
        torch.set_num_threads(original)


# =============================================================================
# Route A vs route B
# =============================================================================


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec", op_params(ROUTE_A))
def test_route_a_equals_route_b(spec, device, dtype):
    # Both routes call the same bridge and kernels: identical bits, forward
    # and every gradient, contiguous and transposed row inputs.
    _supports(spec, dtype)
    gen = generator()
    for layout in ("contiguous", "transposed"):
        inputs = relayout_rows(spec, spec.make_inputs((64, 769), dtype, device, gen), layout)
        dys = dys_for(spec, inputs, gen)
        outs_b, grads_b = run_op(spec.call, spec, inputs, dys)
        outs_a, grads_a = run_op(spec.call_pybind, spec, inputs, dys)
        for (k, a), (_, b) in zip(outs_a, outs_b):
            assert_bitwise_equal(a, b, f"{layout} {k}")
        assert set(grads_a) == set(grads_b) == set(spec.grad_inputs)
        for k in grads_b:
            assert_bitwise_equal(grads_a[k], grads_b[k], f"{layout} grad {k}")


@pytest.mark.parametrize("spec", op_params(ROUTE_A))
def test_route_a_against_reference(spec, device):
    # route A against the float64 reference, not only against route B
    check_against_reference(spec, spec.make_inputs((6, 300), torch.float32, device, generator()),
                            generator(), fn=spec.call_pybind)


# =============================================================================
# The documentation of these harnesses
# =============================================================================


def test_docs_table_is_generated():
    # the hostile-input table of docs/reliability.md is what
    # `python -m opsmith.specs --docs` writes from the specs
    text = opsmith.specs.DOCS.read_text()
    assert text == opsmith.specs.render_docs(text), (
        "docs/reliability.md's table is not the generated one: run `python -m opsmith.specs --docs`")


def test_docs_name_existing_tests():
    import test_integration
    text = opsmith.specs.DOCS.read_text()
    named = set(re.findall(r"`(test_\w+)(?![\w.])", text))  # not `test_x.py`
    assert named, "docs/reliability.md names no tests"
    known = set(globals()) | set(vars(test_integration))
    missing = sorted(n for n in named if n not in known)
    assert not missing, f"docs/reliability.md names tests that do not exist: {missing}"
