"""PyTorch integration harnesses over every op spec: opcheck, gradcheck in
float64, double backward (gradgradcheck, or the declared error), torch.func
transforms (grad, vjp, jvp, vmap: compared with the reference, or the declared
error), route A under transforms, torch.compile(fullgraph=True) forward and
backward, torch.export (and one AOTInductor package). A harness that does not
apply to a kind of op is not generated."""
import pytest
import torch

import opsmith.specs
from opsmith.specs import SUPPORTED, TRANSFORMS, Skip, as_tuple, flat_inputs, flat_outputs, map_tensors
from conftest import requires_cuda
from harness import (ALL_SPECS, assert_close, clone_inputs, dys_for, generator, grad_tol, op_params,
                     primary, reference_run, results, run_op, to_reference)

GRADS = lambda s: bool(s.grad_inputs)  # noqa: E731


def _routes(spec):
    return [("route_b", spec.call)] + ([("route_a", spec.call_pybind)] if spec.call_pybind else [])


# =============================================================================
# opcheck
# =============================================================================


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("spec", op_params(lambda s: s.opcheck is not None))
def test_opcheck(spec, device, dtype):
    # schema, fake kernel, autograd registration (requires_grad inputs) and
    # aot dispatch of every dispatcher op behind the call
    inputs = spec.make_inputs((5, 37), dtype, device, generator())
    inputs = map_tensors(inputs, lambda k, t: t.requires_grad_(k in spec.grad_inputs and t.is_floating_point()))
    for op, args in spec.opcheck(inputs):
        torch.library.opcheck(op, args)


# =============================================================================
# gradcheck and double backward, float64
# =============================================================================


def _diff_fn(spec, fn, inputs, names):
    """f(*leaves) -> the differentiable outputs, the other inputs fixed."""
    def f(*xs):
        it = iter(xs)
        args = dict(inputs)
        for k in names:
            v = inputs[k]
            args[k] = [next(it) for _ in v] if isinstance(v, list) else next(it)
        return tuple(t for n, t in flat_outputs(spec, fn(args)) if n.split("[")[0] in spec.diff_output_names)
    return f


def _grad_leaves(spec, inputs):
    return [t.detach().requires_grad_() for _, t in flat_inputs(inputs, spec.grad_inputs)]


def _gradcheck_params():
    return [pytest.param(s, route, layout, id=f"{s.name}-{route}-{layout}")
            for s in ALL_SPECS if s.grad_inputs for route, _ in _routes(s)
            for layout in ("contiguous", "transposed")]


@pytest.mark.parametrize("spec,route,layout", _gradcheck_params())
def test_gradcheck(spec, device, route, layout):
    from harness import relayout_rows
    fn = dict(_routes(spec))[route]
    inputs = relayout_rows(spec, spec.make_inputs((3, 11), torch.float64, device, generator()), layout)
    assert torch.autograd.gradcheck(_diff_fn(spec, fn, inputs, spec.grad_inputs), _grad_leaves(spec, inputs))


def _double_backward_params():
    params = []
    for s in ALL_SPECS:
        if not s.grad_inputs:
            continue
        for route, _ in _routes(s):
            declared = s.double_backward if route == "route_b" else s.double_backward_pybind
            marks = [pytest.mark.skip(reason=f"{s.name} {route}: double backward not declared")] if declared is None else []
            params.append(pytest.param(s, route, id=f"{s.name}-{route}", marks=marks))
    return params


@pytest.mark.parametrize("spec,route", _double_backward_params())
def test_double_backward(spec, device, route):
    # Either gradgradcheck passes, or differentiating the returned gradient
    # raises the declared error -- never silently zero. First-order
    # gradients with create_graph=True must work in both cases.
    fn = dict(_routes(spec))[route]
    declared = spec.double_backward if route == "route_b" else spec.double_backward_pybind
    inputs = spec.make_inputs((3, 11), torch.float64, device, generator())
    f = _diff_fn(spec, fn, inputs, spec.grad_inputs)
    xs = _grad_leaves(spec, inputs)
    if declared == SUPPORTED:
        assert torch.autograd.gradgradcheck(f, xs)
        return
    ref_in = to_reference(inputs, wrt=spec.grad_inputs)
    ref_xs = [t for _, t in flat_inputs(ref_in, spec.grad_inputs)]
    ref = _diff_fn(spec, spec.reference, ref_in, spec.grad_inputs)(*ref_xs)
    # a constant upstream gradient (a gradient penalty) and one that requires grad
    for dy_requires_grad in (False, True):
        outs = f(*xs)
        dys = [torch.randn_like(o).requires_grad_(dy_requires_grad) for o in outs]
        grads = torch.autograd.grad(outs, xs, dys, create_graph=True)
        # the first-order gradients are right even so
        ref_grads = torch.autograd.grad(ref, ref_xs, [d.detach().cpu() for d in dys], retain_graph=True)
        for g, r in zip(grads, ref_grads):
            assert_close(g, r, 1e-10, "first-order gradient with create_graph=True")
        # never silently a constant: the gradients are in a graph that refuses
        assert all(g.requires_grad for g in grads), (
            f"dy requires_grad={dy_requires_grad}: with create_graph=True a gradient came back without "
            "a graph; differentiating it would give silent zeros")
        with pytest.raises(RuntimeError, match=declared):
            sum(g.sum() for g in grads).backward()
        # asked for by input (as gradient penalties do): the refusal must be
        # on the path to the inputs, not a None for an "unused" one
        grads = torch.autograd.grad(f(*xs), xs, dys, create_graph=True)
        with pytest.raises(RuntimeError, match=declared):
            torch.autograd.grad(sum(g.sum() for g in grads), xs, allow_unused=True)


# =============================================================================
# torch.func transforms
# =============================================================================


def _transform_params():
    params = []
    for s in ALL_SPECS:
        for t in TRANSFORMS:
            if t not in s.func_transforms:
                continue  # does not apply (e.g. grad of an op without gradients)
            declared = s.func_transforms[t]
            marks = [pytest.mark.skip(reason=declared.reason)] if isinstance(declared, Skip) else []
            params.append(pytest.param(s, t, id=f"{s.name}-{t}", marks=marks))
    return params


def _loss_fn(spec, fn, inputs, dys):
    f = _diff_fn(spec, fn, inputs, spec.grad_inputs)
    names = [n for n in dys]

    def loss(*xs):
        return sum((o * d).sum() for o, d in zip(f(*xs), [dys[n] for n in names]))
    return loss


def _vmap_inputs(spec, device, batch, gen):
    """`batch` independent input sets, stacked on dim 0 (tensors and list
    elements); non-tensor arguments from the first."""
    sets = [spec.make_inputs((4, 33), torch.float64, device, gen) for _ in range(batch)]
    stacked = {}
    for k, v in sets[0].items():
        if isinstance(v, torch.Tensor):
            stacked[k] = torch.stack([s[k] for s in sets])
        elif isinstance(v, list):
            stacked[k] = [torch.stack([s[k][i] for s in sets]) for i in range(len(v))]
        else:
            stacked[k] = v
    return sets, stacked


@pytest.mark.parametrize("spec,transform", _transform_params())
def test_func_transform(spec, device, transform):
    declared = spec.func_transforms[transform]
    gen = generator()
    tol = 1e-10  # float64
    if transform == "vmap":
        _check_vmap(spec, device, gen, declared)
        return
    inputs = spec.make_inputs((4, 33), torch.float64, device, gen)
    dys = dys_for(spec, inputs, gen)
    xs = [t.detach() for _, t in flat_inputs(inputs, spec.grad_inputs)]
    # the reference on the op's device, so upstream gradients and tangents
    # drawn there serve both
    ref_in = to_reference(inputs, device=device)
    ref_xs = [t.detach() for _, t in flat_inputs(ref_in, spec.grad_inputs)]
    if transform == "grad":
        def run():
            return torch.func.grad(_loss_fn(spec, spec.call, inputs, dys), argnums=tuple(range(len(xs))))(*xs)
        if declared != SUPPORTED:
            with pytest.raises(RuntimeError, match=declared):
                run()
            return
        got = run()
        want = torch.func.grad(_loss_fn(spec, spec.reference, ref_in, dys), argnums=tuple(range(len(xs))))(*ref_xs)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, tol, f"grad {i}")
    elif transform == "vjp":
        f = _diff_fn(spec, spec.call, inputs, spec.grad_inputs)
        cot = tuple(dys.values())
        if declared != SUPPORTED:
            with pytest.raises(RuntimeError, match=declared):
                out, vjp_fn = torch.func.vjp(f, *xs)
                vjp_fn(cot)
            return
        out, vjp_fn = torch.func.vjp(f, *xs)
        got = vjp_fn(cot)
        rout, rvjp = torch.func.vjp(_diff_fn(spec, spec.reference, ref_in, spec.grad_inputs), *ref_xs)
        want = rvjp(cot)
        for i, (o, r) in enumerate(zip(out, rout)):
            assert_close(o, r, tol, f"vjp output {i}")
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, tol, f"vjp gradient {i}")
    elif transform == "jvp":
        f = _diff_fn(spec, spec.call, inputs, spec.grad_inputs)
        tangents = tuple(torch.randn_like(x) for x in xs)
        if declared != SUPPORTED:
            with pytest.raises(RuntimeError, match=declared):
                torch.func.jvp(f, tuple(xs), tangents)
            return
        out, tan = torch.func.jvp(f, tuple(xs), tangents)
        rout, rtan = torch.func.jvp(_diff_fn(spec, spec.reference, ref_in, spec.grad_inputs), tuple(ref_xs),
                                    tangents)
        for i, (t, r) in enumerate(zip(tan, rtan)):
            assert_close(t, r, tol, f"jvp tangent {i}")


def _check_vmap(spec, device, gen, declared):
    batch = 3
    sets, stacked = _vmap_inputs(spec, device, batch, gen)
    names = [k for k, v in stacked.items() if isinstance(v, (torch.Tensor, list))]

    def f(*tensors):
        args = dict(stacked)
        args.update(zip(names, tensors))
        return tuple(results(spec, spec.call(args))) if not spec.mutated_inputs else tuple(
            t.clone() for t in results(spec, spec.call(args)))

    # every tensor batched; then only the row inputs (shared ones unbatched)
    cases = [(tuple(0 for _ in names), "all batched")]
    if spec.row_inputs and len(names) > len([n for n in names if n in spec.row_inputs]):
        cases.append((tuple(0 if n in spec.row_inputs else None for n in names), "row inputs batched"))
    for in_dims, what in cases:
        args = [clone_inputs(stacked)[n] if d == 0 else clone_inputs(sets[0])[n] for n, d in zip(names, in_dims)]
        if declared != SUPPORTED:
            with pytest.raises(RuntimeError, match=declared):
                torch.func.vmap(f, in_dims=in_dims)(*args)
            return
        got = torch.func.vmap(f, in_dims=in_dims)(*args)
        for b in range(batch):
            example = dict(sets[b])
            for n, d in zip(names, in_dims):
                if d is None:
                    example[n] = sets[0][n]
            ref, _ = reference_run(spec, example, wrt=())
            for (k, r), g in zip(ref, [t for t in got for t in (t if isinstance(t, (list, tuple)) else [t])]):
                assert_close(g[b], r, 1e-10, f"vmap ({what}) example {b} {k}")
    if spec.func_transforms.get("grad") == SUPPORTED and spec.grad_inputs:
        # per-example gradients: vmap over grad (the backward op runs batched)
        dys = dys_for(spec, sets[0], gen)
        gnames = list(spec.grad_inputs)

        def loss(*xs):
            args = dict(stacked)
            args.update(zip(gnames, xs))
            return sum((o * dys[n]).sum() for n, o in flat_outputs(spec, spec.call(args)) if n in dys)

        xs = [stacked[n] for n in gnames]
        got = torch.func.vmap(torch.func.grad(loss, argnums=tuple(range(len(xs)))))(*xs)
        for b in range(batch):
            _, ref_grads = reference_run(spec, sets[b], dys)
            for n, g in zip(gnames, got):
                assert_close(g[b], ref_grads[n], 1e-10, f"vmap(grad) example {b} grad {n}")


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("spec", op_params(lambda s: s.call_pybind is not None and s.func_transforms_pybind))
def test_func_transform_route_a(spec, device, transform):
    # route A's autograd.Function cannot take part in torch.func: it says so
    inputs = spec.make_inputs((4, 33), torch.float64, device, generator())
    xs = [t.detach() for _, t in flat_inputs(inputs, spec.grad_inputs)]
    f = _diff_fn(spec, spec.call_pybind, inputs, spec.grad_inputs)
    with pytest.raises(RuntimeError, match=spec.func_transforms_pybind):
        if transform == "grad":
            torch.func.grad(lambda *a: sum(o.sum() for o in f(*a)))(*xs)
        elif transform == "vjp":
            torch.func.vjp(f, *xs)
        elif transform == "jvp":
            torch.func.jvp(f, tuple(xs), tuple(torch.randn_like(x) for x in xs))
        else:
            torch.func.vmap(f)(*[x.unsqueeze(0).expand(2, *x.shape) for x in xs])


# =============================================================================
# torch.compile(fullgraph=True), forward and backward
# =============================================================================


def _compile_params():
    params = []
    for s in ALL_SPECS:
        params.append(pytest.param(s, "cpu", "aot_eager", id=f"{s.name}-cpu-aot_eager"))
        if s.native:
            # Inductor on CPU compiles C++ (~20 s here): one case per opsmith op
            params.append(pytest.param(s, "cpu", "inductor", id=f"{s.name}-cpu-inductor"))
        params.append(pytest.param(s, "cuda", "inductor", id=f"{s.name}-cuda-inductor", marks=requires_cuda))
    return params


@pytest.mark.parametrize("spec,device,backend", _compile_params())
def test_compile_fullgraph(spec, device, backend):
    # fullgraph=True turns any graph break into an error; the counter checks
    # that one graph covered the whole function (elementwise work around the
    # op is fused into the same graph).
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)

    def f(args):
        pre = map_tensors(args, lambda k, t: (t * 2.0 + 1.0) if t.is_floating_point() and k in spec.grad_inputs else t)
        if spec.mutated_inputs:  # mutate the op's own copy: a graph input stays as it was
            pre = {k: ([t.clone() for t in v] if isinstance(v, list) else v.clone()) if k in spec.mutated_inputs else v
                   for k, v in pre.items()}
        items = tuple([t * 3.0 for t in it] if isinstance(it, list) else it * 3.0
                      for it in as_tuple(spec, spec.call(pre)))
        return items if len(spec.outputs) > 1 else items[0]

    compiled = torch.compile(f, backend=counter, fullgraph=True)
    gen = generator()
    inputs = spec.make_inputs((4, 8, 96), torch.float32, device, gen)
    dys = dys_for(spec, inputs, gen)
    outs_c, grads_c = run_op(compiled, spec, inputs, dys)
    outs_e, grads_e = run_op(f, spec, inputs, dys)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs"
    tol = spec.tolerance(torch.float32)
    for (k, c), (_, e) in zip(outs_c, outs_e):
        assert_close(c, e, tol, f"compiled {k}")
    assert set(grads_c) == set(grads_e)
    for k in grads_c:
        assert_close(grads_c[k], grads_e[k], grad_tol(spec, k, tol), f"compiled grad {k}")
    torch._dynamo.reset()


# =============================================================================
# torch.export (deployment): the exported program keeps the op itself and
# computes the same bits; AOTInductor compiles and loads one
# =============================================================================


def _exportable(spec, device):
    gen = generator()
    inputs = spec.make_inputs((4, 8, 96), torch.float32, device, gen)
    keys = [k for k, v in inputs.items() if isinstance(v, torch.Tensor)]

    class Program(torch.nn.Module):
        def forward(self, *tensors):
            args = dict(inputs)
            args.update(zip(keys, tensors))
            for k in spec.mutated_inputs:  # the op's own copy: the program's inputs stay as they were
                args[k] = args[k].clone()
            return as_tuple(spec, spec.call(args))

    return Program(), tuple(inputs[k].detach() for k in keys)


def _same(got, want, what):
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        assert (g is None) == (w is None), what
        if g is not None:
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), what


@pytest.mark.parametrize("spec", op_params(lambda s: s.native and not s.list_inputs))
def test_export(spec, device):
    program, tensors = _exportable(spec, device)
    exported = torch.export.export(program, tensors)
    ops = {n.target.name() for n in exported.graph.nodes
           if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)}
    assert any(name.startswith("opsmith::") for name in ops), f"{spec.name}: no opsmith op in {sorted(ops)}"
    _same(tuple(exported.module()(*tensors)), tuple(program(*tensors)), f"{spec.name}: exported")


def test_aot_inductor_package(tmp_path):
    # a model with an opsmith norm compiled ahead of time (C++ codegen, ~35 s
    # on 2 cores) and loaded back: the package calls the op through the
    # dispatcher, so `import opsmith` before loading it is all it needs
    import opsmith

    model = torch.nn.Sequential(opsmith.nn.RMSNorm(64), torch.nn.Linear(64, 32))
    x = torch.randn(5, 64)
    exported = torch.export.export(model, (x,))
    path = torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "model.pt2"))
    loaded = torch._inductor.aoti_load_package(path)
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(loaded(x), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_compile_dynamic_one_graph_for_every_row_count(spec):
    # dynamic=True with gradients: a new row count (tokens, sequence length)
    # must reuse the graph, so nothing on the op's path (its autograd node
    # included) may read a concrete size and guard on it.
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda args: spec.call(args), backend=counter, dynamic=True)
    gen = generator()
    first = None
    for shape in ((4, 8, 96), (4, 11, 96), (4, 13, 96)):
        inputs = spec.make_inputs(shape, torch.float32, "cpu", gen)
        dys = dys_for(spec, inputs, gen)
        outs_c, grads_c = run_op(compiled, spec, inputs, dys)
        outs_e, grads_e = run_op(spec.call, spec, inputs, dys)
        tol = spec.tolerance(torch.float32)
        for (k, c), (_, e) in zip(outs_c, outs_e):
            assert_close(c, e, tol, f"compiled {k} at {shape}")
        assert set(grads_c) == set(grads_e) and bool(grads_c) == bool(spec.grad_inputs)
        for k in grads_c:
            assert_close(grads_c[k], grads_e[k], grad_tol(spec, k, tol), f"compiled grad {k} at {shape}")
        first = first or counter.frame_count
        assert counter.frame_count == first, f"a new row count compiled again: {shape}"
    torch._dynamo.reset()
