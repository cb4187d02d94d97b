"""Norm parameters that need no gradient (a frozen norm in LoRA fine-tuning,
or torch.autograd.grad asked for the input's gradient alone): the backward
skips their column sums (the backward ops' weight_grad / bias_grad flags),
the inputs' gradients stay right, and the parameters get no gradient. For
RMSNorm, residual add + RMSNorm and LayerNorm, both routes."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import opsmith
import opsmith.pybind
from opsmith.ops import route_a
from conftest import devices

OPS = ("rms_norm", "fused_add_rms_norm", "layer_norm")
BWD = {op: op + "_bwd" for op in OPS}
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _call(op, route, x, w, b):
    """The op's outputs for input x, weight w and b (LayerNorm's bias, the
    residual of fused add + RMSNorm)."""
    ns = opsmith if route == "B" else opsmith.pybind
    if op == "rms_norm":
        return (ns.rms_norm(x, w, 1e-6),)
    if op == "layer_norm":
        return (ns.layer_norm(x, w, b, 1e-5),)
    return tuple(ns.fused_add_rms_norm(x, b, w, 1e-6))


def _reference(op, x, w, b):
    x, w, b = (t.double() if t is not None else None for t in (x, w, b))
    if op == "rms_norm":
        return (F.rms_norm(x, x.shape[-1:], w, 1e-6),)
    if op == "layer_norm":
        return (F.layer_norm(x, x.shape[-1:], w, b, 1e-5),)
    h = x + b
    return F.rms_norm(h, h.shape[-1:], w, 1e-6), h


def _inputs(op, device, dtype, rows=6, n=40):
    x = torch.randn(rows, n, device=device).to(dtype)
    w = (torch.rand(n, device=device) + 0.5).to(dtype)
    if op == "rms_norm":
        b = None
    elif op == "layer_norm":
        b = torch.randn(n, device=device).to(dtype)
    else:
        b = torch.randn(rows, n, device=device).to(dtype)  # the residual
    return x, w, b


def _loss(outs, seeds):
    return sum((o.float() * s).sum() for o, s in zip(outs, seeds))


class _BackwardCalls(TorchDispatchMode):
    """The arguments, by name, of every opsmith backward op dispatched."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "opsmith" and func._schema.name.split("::")[1].endswith("_bwd"):
            named = {a.name: a.default_value for a in func._schema.arguments if a.has_default_value()}
            named.update(zip([a.name for a in func._schema.arguments], args))
            named.update(kwargs)
            self.calls.append(named)
        return func(*args, **kwargs)


def _route_a_calls(monkeypatch, op):
    """Records route A's backward calls (the pybind11 function, wrapped)."""
    module, name = route_a(), BWD[op]
    real, calls = getattr(module, name), []
    params = {"rms_norm": ("weight_grad",), "fused_add_rms_norm": ("weight_grad",),
              "layer_norm": ("weight_grad", "bias_grad")}[op]
    n_tensor = {"rms_norm": 4, "fused_add_rms_norm": 5, "layer_norm": 6}[op]

    def wrapper(*args):
        # flags after the tensors and (RMSNorm) offset and casting mode
        flags = args[len(args) - len(params):] if len(args) > n_tensor else ()
        calls.append(dict(zip(params, flags)))
        return real(*args)

    monkeypatch.setattr(module, name, wrapper)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("route", ["B", "A"])
@pytest.mark.parametrize("op", OPS)
def test_frozen_parameters_get_no_gradient_and_skip_their_sums(op, route, dtype, device, monkeypatch):
    x, w, b = _inputs(op, device, dtype)
    x.requires_grad_()
    if op == "fused_add_rms_norm":
        b.requires_grad_()  # the residual is an activation; only the weight is frozen
    seeds = [torch.randn(x.shape, device=device) for _ in range(2 if op == "fused_add_rms_norm" else 1)]
    calls = _route_a_calls(monkeypatch, op) if route == "A" else None
    mode = _BackwardCalls()
    outs = _call(op, route, x, w, b)
    with mode:
        _loss(outs, seeds).backward()
    recorded = mode.calls if route == "B" else calls
    assert len(recorded) == 1, recorded
    assert recorded[0]["weight_grad"] is False
    if op == "layer_norm":
        assert recorded[0]["bias_grad"] is False
    assert w.grad is None
    if op == "layer_norm":
        assert b.grad is None
    # the input's gradient against float64 autograd of the reference
    xr = x.detach().double().requires_grad_()
    br = b.detach().double().requires_grad_() if op == "fused_add_rms_norm" else b
    want = torch.autograd.grad(_loss(_reference(op, xr, w, br), [s.double() for s in seeds]), xr)[0]
    tol = TOL[dtype] * max(1.0, want.abs().max().item())
    assert (x.grad.double() - want).abs().max().item() <= tol
    if op == "fused_add_rms_norm":
        assert torch.equal(b.grad, x.grad)


@pytest.mark.parametrize("op", OPS)
def test_grad_of_the_input_alone_skips_the_weight_sums(op, device):
    x, w, b = _inputs(op, device, torch.float32)
    x.requires_grad_()
    w.requires_grad_()  # trainable, but not asked for by autograd.grad
    outs = _call(op, "B", x, w, b)
    seeds = [torch.randn(o.shape, device=device) for o in outs]
    mode = _BackwardCalls()
    with mode:
        (dx,) = torch.autograd.grad(_loss(outs, seeds), [x])
    assert [c["weight_grad"] for c in mode.calls] == [False]
    # the same dx as a backward that computes the weight's gradient too
    outs = _call(op, "B", x, w, b)
    dx_both, dw = torch.autograd.grad(_loss(outs, seeds), [x, w])
    assert torch.equal(dx, dx_both) if device == "cpu" else torch.allclose(dx, dx_both, rtol=1e-6, atol=1e-6)
    assert dw.shape == w.shape


@pytest.mark.parametrize("frozen", ["weight", "bias"])
def test_layer_norm_one_frozen_parameter(frozen, device):
    x, w, b = _inputs("layer_norm", device, torch.float32)
    x.requires_grad_()
    trained = b if frozen == "weight" else w
    trained.requires_grad_()
    (y,) = _call("layer_norm", "B", x, w, b)
    dy = torch.randn_like(y)
    mode = _BackwardCalls()
    with mode:
        y.backward(dy)
    assert mode.calls[0]["weight_grad"] is (frozen == "bias")
    assert mode.calls[0]["bias_grad"] is (frozen == "weight")
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    F.layer_norm(xr, xr.shape[-1:], wr, br, 1e-5).backward(dy.double())
    want = br.grad if frozen == "weight" else wr.grad
    assert (trained.grad.double() - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
    assert (w if frozen == "weight" else b).grad is None


def _bwd_args(op, device):
    """Inputs of the op's backward, from its forward."""
    x, w, b = _inputs(op, device, torch.float32)
    if op == "rms_norm":
        y, inv = torch.ops.opsmith.rms_norm_fwd(x, w, 1e-6)
        return torch.ops.opsmith.rms_norm_bwd.default, (torch.randn_like(y), x, w, inv), {}
    if op == "layer_norm":
        y, mean, rstd = torch.ops.opsmith.layer_norm_fwd(x, w, b, 1e-5)
        return torch.ops.opsmith.layer_norm_bwd.default, (torch.randn_like(y), x, w, b, mean, rstd), {}
    y, h, inv = torch.ops.opsmith.fused_add_rms_norm_fwd(x, b, w, 1e-6)
    return (torch.ops.opsmith.fused_add_rms_norm_bwd.default,
            (torch.randn_like(y), torch.randn_like(h), h, w, inv), {})


@pytest.mark.parametrize("op", OPS)
def test_backward_op_without_parameter_gradients(op, device):
    bwd, args, _ = _bwd_args(op, device)
    off = {"weight_grad": False} if op != "layer_norm" else {"weight_grad": False, "bias_grad": False}
    full = bwd(*args)
    lean = bwd(*args, **off)
    assert torch.equal(lean[0], full[0]) if device == "cpu" else torch.allclose(lean[0], full[0], 1e-6, 1e-6)
    for g in lean[1:]:
        assert g.shape == (0,)
    for g in full[1:]:
        assert g.shape == args[0].shape[-1:]
    torch.library.opcheck(bwd, args, off)


@pytest.mark.parametrize("op", OPS)
def test_backward_op_vmap_without_parameter_gradients(op, device):
    bwd, args, _ = _bwd_args(op, device)
    off = {"weight_grad": False} if op != "layer_norm" else {"weight_grad": False, "bias_grad": False}
    batch = 3
    # a batch of examples: every row-shaped argument gets a batch dim in front
    params = {"rms_norm": (2,), "layer_norm": (2, 3), "fused_add_rms_norm": (3,)}[op]
    batched = [t if i in params else torch.stack([t * (k + 1) for k in range(batch)])
               for i, t in enumerate(args)]
    in_dims = tuple(None if i in params else 0 for i in range(len(args)))
    got = torch.func.vmap(lambda *a: bwd(*a, **off), in_dims=in_dims)(*batched)
    for k in range(batch):
        one = bwd(*[t if i in params else t[k] for i, t in enumerate(batched)], **off)
        assert torch.allclose(got[0][k], one[0], rtol=1e-6, atol=1e-6)
    for g in got[1:]:
        assert g.numel() == 0


@pytest.mark.parametrize("op", OPS)
def test_frozen_weight_under_compile(op):
    torch._dynamo.reset()
    x, w, b = _inputs(op, "cpu", torch.float32)
    x.requires_grad_()
    fn = torch.compile(lambda x, w, b: _call(op, "B", x, w, b), backend="aot_eager", fullgraph=True)
    outs = fn(x, w, b)
    seeds = [torch.randn(o.shape) for o in outs]
    _loss(outs, seeds).backward()
    xr = x.detach().double().requires_grad_()
    want = torch.autograd.grad(_loss(_reference(op, xr, w, b), [s.double() for s in seeds]), xr)[0]
    assert (x.grad.double() - want).abs().max().item() <= 2e-5 * max(1.0, want.abs().max().item())
    assert w.grad is None
