"""What is the gated activations' alone; everything generic (float64
reference, layouts, zero rows, hostile inputs, opcheck, gradcheck, compile,
CUDA graphs, streams, route A == route B, transforms) runs from the spec
(opsmith/specs/glu.py) in test_reliability.py and test_integration.py.

Here: the packed form (one tensor [..., 2*I] in, ONE packed gradient out,
also for a slice of a wider projection), the raw backward's recomputed h,
GatedMLP against a Hugging Face style MLP (outputs, gradients, state dict in
both directions, fused and unfused), the recompute mode (same gradients,
act(gate) * up not saved) and argument checks only these functions have."""
import pytest
import torch
import torch.nn.functional as F

import opsmith
import opsmith.pybind
from opsmith.ops.glu import GatedDownProjection, GatedMLP
from opsmith.bench import saved_tensor_bytes
from opsmith.specs.glu import SPEC

from harness import DTYPES, dtype_id

TOL = {dt: SPEC.tolerance(dt) for dt in DTYPES}
ACTIVATIONS = ["silu", "gelu", "gelu_tanh"]


def call(activation, gate, up=None, route=opsmith):
    if activation == "silu":
        return route.swiglu(gate, up)
    return route.geglu(gate, up, "none" if activation == "gelu" else "tanh")


def torch_math(activation, gate, up):
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="none" if activation == "gelu" else "tanh") * up


def close(got, ref, dtype, what):
    err = (got.double() - ref.double()).abs().max().item() if got.numel() else 0.0
    bound = TOL[dtype] * max(1.0, ref.abs().max().item() if ref.numel() else 1.0)
    assert err <= bound, f"{what}: max err {err:.3e} > {bound:.3e}"


# --- the packed form ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 64), (769,)], ids=["5x7", "2x3x64", "1d-769"])
def test_packed_matches_separate_and_grad_is_one_buffer(device, dtype, activation, shape):
    i = shape[-1]
    packed = (torch.randn(*shape[:-1], 2 * i, device=device) * 3).to(dtype).requires_grad_()
    y = call(activation, packed)
    assert y.shape == (*shape[:-1], i)
    dy = torch.randn_like(y)
    (dpacked,) = torch.autograd.grad(y, [packed], dy)
    # the gradient is one tensor of the packed shape, both halves written
    assert dpacked.shape == packed.shape and torch.isfinite(dpacked).all()
    gate, up = packed.detach().chunk(2, -1)
    gate, up = gate.clone().requires_grad_(), up.clone().requires_grad_()
    ys = call(activation, gate, up)
    dg, du = torch.autograd.grad(ys, [gate, up], dy)
    assert torch.equal(y, ys), "packed and separate forms must give the same bits"
    assert torch.equal(dpacked, torch.cat([dg, du], -1)), "packed gradient = [dgate | dup]"
    # and both against float64 PyTorch
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    ref = torch_math(activation, g64, u64)
    rg, ru = torch.autograd.grad(ref, [g64, u64], dy.double())
    close(y, ref, dtype, "y")
    close(dpacked, torch.cat([rg, ru], -1), dtype, "dpacked")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_packed_slice_of_wider_projection(device, activation):
    # a fused projection with a third block: gate-up is a view with row stride 3I
    rows, i = 6, 40
    proj = torch.randn(rows, 3 * i, device=device, requires_grad=True)
    packed = proj[:, : 2 * i]
    assert packed.stride(0) == 3 * i and not packed.is_contiguous()
    y = call(activation, packed)
    dy = torch.randn_like(y)
    (dproj,) = torch.autograd.grad(y, [proj], dy)
    ref = torch_math(activation, proj.detach()[:, :i].double(), proj.detach()[:, i:2 * i].double())
    close(y, ref, torch.float32, "y")
    assert torch.equal(dproj[:, 2 * i:], torch.zeros_like(dproj[:, 2 * i:])), "the third block gets no gradient"
    g = proj.detach()[:, : 2 * i].contiguous().requires_grad_()
    (dg,) = torch.autograd.grad(call(activation, g), [g], dy)
    assert torch.equal(dproj[:, : 2 * i], dg), "a strided packed view gives the contiguous one's gradient"


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_packed_width_zero(device, activation):
    # [..., 0] packed: I = 0, as silu(gate[..., :0]) * gate[..., 0:] gives it
    packed = torch.randn(2, 3, 0, device=device, requires_grad=True)
    y = call(activation, packed)
    assert y.shape == (2, 3, 0)
    (dg,) = torch.autograd.grad(y, [packed], torch.ones_like(y))
    assert dg.shape == packed.shape


def test_raw_backward_packed_and_h(device):
    packed = torch.randn(4, 2 * 33, device=device)
    dy = torch.randn(4, 33, device=device)
    for activation in ACTIVATIONS:
        y = torch.ops.opsmith.glu_fwd(packed, None, activation)
        dgate, dup, h = torch.ops.opsmith.glu_bwd(dy, packed, None, activation, True)
        assert dgate.shape == packed.shape and dup.shape == (0,), "packed: one gradient buffer, no dup"
        assert torch.equal(h, y), "h recomputed in the backward pass is the forward's y, bit for bit"
        _, _, none = torch.ops.opsmith.glu_bwd(dy, packed, None, activation, False)
        assert none.shape == (0,)


# --- argument checks these functions have ---------------------------------------------------

def test_argument_errors():
    g = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match=r"^geglu: approximate must be 'none' or 'tanh', got 'exact'"):
        opsmith.geglu(g, g, "exact")
    with pytest.raises(RuntimeError, match=r"glu: activation must be 'silu', 'gelu' or 'gelu_tanh', got 'relu'"):
        torch.ops.opsmith.glu_fwd(g, g, "relu")
    with pytest.raises(RuntimeError, match=r"^geglu: dy must have the output's shape \[3, 4\], got \[3, 8\]"):
        torch.ops.opsmith.glu_bwd(g, g, None, "gelu", False)
    with pytest.raises(RuntimeError, match=r"^swiglu: dy must have the same dtype as gate"):
        torch.ops.opsmith.glu_bwd(g.double(), g, g, "silu", False)
    with pytest.raises(ValueError, match=r"GatedMLP: activation must be one of"):
        GatedMLP(8, 16, activation="relu")


def test_route_a_equals_route_b_packed():
    packed = torch.randn(5, 2 * 19, requires_grad=True)
    for activation in ACTIVATIONS:
        yb = call(activation, packed)
        ya = call(activation, packed, route=opsmith.pybind)
        dy = torch.randn_like(yb)
        assert torch.equal(ya, yb)
        assert torch.equal(torch.autograd.grad(ya, packed, dy)[0], torch.autograd.grad(yb, packed, dy)[0])


# --- GatedMLP against a Hugging Face style MLP ------------------------------------------------

class HFStyleMLP(torch.nn.Module):
    """The MLP of transformers' Llama/Mistral/Qwen2 (and Gemma with
    gelu_pytorch_tanh), written out: down_proj(act_fn(gate_proj(x)) * up_proj(x))."""

    def __init__(self, hidden, inter, activation, bias=False):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=bias)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=bias)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=bias)
        self.act_fn = {"silu": F.silu, "gelu": F.gelu,
                       "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_gated_mlp_matches_hf_style(device, activation, fused, bias):
    hidden, inter = 24, 56
    hf = HFStyleMLP(hidden, inter, activation, bias).to(device).double()
    ours = GatedMLP(hidden, inter, activation, bias=bias, fused_gate_up=fused).to(device).double()
    ours.load_state_dict(hf.state_dict())  # strict: every key maps
    x = torch.randn(2, 5, hidden, device=device, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 5, hidden, device=device, dtype=torch.float64)
    y_ref, y = hf(x), ours(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    gx_ref, *gp_ref = torch.autograd.grad(y_ref, [x, *hf.parameters()], dy)
    gx, *gp = torch.autograd.grad(y, [x, *ours.parameters()], dy)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-10, atol=1e-10)
    # parameter gradients, compared through the state-dict layout
    ref = dict(zip([k for k, _ in hf.named_parameters()], gp_ref))
    got = dict(zip([k for k, _ in ours.named_parameters()], gp))
    if fused:
        got["gate_proj.weight"], got["up_proj.weight"] = got.pop("gate_up_proj.weight").chunk(2, 0)
        if bias:
            got["gate_proj.bias"], got["up_proj.bias"] = got.pop("gate_up_proj.bias").chunk(2, 0)
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-10, atol=1e-10, msg=k)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_state_dict_fused_saves_and_loads_as_gate_up(bias):
    hidden, inter = 8, 12
    fused = GatedMLP(hidden, inter, bias=bias, fused_gate_up=True)
    sd = fused.state_dict()
    names = ["gate_proj", "up_proj", "down_proj"]
    kinds = ["weight", "bias"] if bias else ["weight"]
    assert list(sd) == [f"{n}.{k}" for n in names for k in kinds], list(sd)
    assert sd["gate_proj.weight"].shape == (inter, hidden) and sd["up_proj.weight"].shape == (inter, hidden)
    assert torch.equal(torch.cat([sd["gate_proj.weight"], sd["up_proj.weight"]]), fused.gate_up_proj.weight)
    # the halves are their own storage (a checkpoint holds each weight once)
    assert sd["gate_proj.weight"].untyped_storage().data_ptr() != fused.gate_up_proj.weight.untyped_storage().data_ptr()
    # fused -> unfused -> HF-style -> fused, strictly, same function throughout
    unfused = GatedMLP(hidden, inter, bias=bias)
    unfused.load_state_dict(sd)
    hf = HFStyleMLP(hidden, inter, "silu", bias)
    hf.load_state_dict(unfused.state_dict())
    again = GatedMLP(hidden, inter, bias=bias, fused_gate_up=True)
    again.load_state_dict(hf.state_dict())
    x = torch.randn(3, hidden)
    y = fused(x)
    for m in (unfused, hf, again):
        torch.testing.assert_close(m(x), y)
    assert torch.equal(again.gate_up_proj.weight, fused.gate_up_proj.weight)


def test_state_dict_nested_prefix_and_strict_errors():
    parent = torch.nn.Sequential(torch.nn.Linear(8, 8), GatedMLP(8, 12, fused_gate_up=True), torch.nn.Linear(8, 2))
    keys = list(parent.state_dict())
    assert keys == ["0.weight", "0.bias", "1.gate_proj.weight", "1.up_proj.weight", "1.down_proj.weight",
                    "2.weight", "2.bias"], keys
    other = torch.nn.Sequential(torch.nn.Linear(8, 8), GatedMLP(8, 12), torch.nn.Linear(8, 2))
    other.load_state_dict(parent.state_dict())
    torch.testing.assert_close(other[1].gate_proj.weight, parent[1].gate_up_proj.weight[:12])
    broken = parent.state_dict()
    del broken["1.up_proj.weight"]
    with pytest.raises(RuntimeError, match="gate_up_proj.weight"):
        parent.load_state_dict(broken)
    # a fused checkpoint of this module itself loads too
    m = GatedMLP(8, 12, fused_gate_up=True)
    m.load_state_dict({"gate_up_proj.weight": torch.randn(24, 8), "down_proj.weight": torch.randn(8, 12)})


# --- recompute --------------------------------------------------------------------------------

@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_recompute_same_grads_less_saved(device, activation, fused, dtype):
    hidden, inter, rows = 32, 96, 20
    base = GatedMLP(hidden, inter, activation, bias=True, fused_gate_up=fused).to(device=device, dtype=dtype)
    lean = GatedMLP(hidden, inter, activation, bias=True, fused_gate_up=fused, recompute=True)
    lean = lean.to(device=device, dtype=dtype)
    lean.load_state_dict(base.state_dict())
    x = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, hidden, device=device, dtype=dtype)
    y0, saved0 = saved_tensor_bytes(lambda: base(x))
    y1, saved1 = saved_tensor_bytes(lambda: lean(x))
    assert torch.equal(y0, y1)
    g0 = torch.autograd.grad(y0, [x, *base.parameters()], dy)
    g1 = torch.autograd.grad(y1, [x, *lean.parameters()], dy)
    for (name, _), a, b in zip(base.named_parameters(), g0[1:], g1[1:]):
        if device == "cpu":
            assert torch.equal(a, b), f"grad {name} differs"
        else:
            close(b, a, dtype, f"grad {name}")
    assert torch.equal(g0[0], g1[0]) if device == "cpu" else True
    h_bytes = rows * inter * torch.empty((), dtype=dtype).element_size()
    assert saved0 - saved1 == h_bytes, f"recompute should save exactly h ({h_bytes} B): {saved0} -> {saved1}"


def test_recompute_no_grad_is_plain_forward():
    m = GatedMLP(8, 16, recompute=True)
    x = torch.randn(4, 8)
    with torch.no_grad():
        y = m(x)
    assert y.grad_fn is None
    torch.testing.assert_close(y, GatedMLP.forward(m, x))


@pytest.mark.parametrize("dy_requires_grad", [False, True])
def test_recompute_double_backward_refused(dy_requires_grad):
    """Differentiating the recompute mode's gradients raises, also through
    torch.autograd.grad(..., inputs, allow_unused=True) (never None or zeros)."""
    m = GatedMLP(8, 16, recompute=True).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    xs = [x, *m.parameters()]
    for allow_unused in (False, True):
        y = m(x)
        dy = torch.randn_like(y).requires_grad_(dy_requires_grad)
        grads = torch.autograd.grad(y, xs, dy, create_graph=True)
        assert all(g.requires_grad for g in grads)
        with pytest.raises(RuntimeError, match=r"^opsmith\.nn\.GatedMLP\(recompute=True\).*double backward is not "
                                               r"supported"):
            torch.autograd.grad(sum(g.sum() for g in grads), xs, allow_unused=allow_unused)


def test_recompute_function_gradcheck():
    gate = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    up = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    for activation in ACTIVATIONS:
        assert torch.autograd.gradcheck(lambda g, u, w, b: GatedDownProjection.apply(g, u, w, b, activation),
                                        (gate, up, w, b))


# --- the benchmark's entries -------------------------------------------------------------------

@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_bench_providers_agree_on_cpu(activation):
    # the providers are called as `opsmith bench` calls them (inputs by name);
    # Liger and torch.compile need a GPU / a compile and are left to the GPU run
    from opsmith.specs.glu import bench_spec
    spec = bench_spec(activation)
    inputs = spec.make_inputs(4, 64, torch.float32, "cpu")
    args = {k: inputs[k] for k in spec.grad_inputs}
    expected = torch_math(activation, args["gate"], args["up"])
    ran = []
    for name, factory in spec.providers.items():
        if name in ("liger", "torch_compile"):
            continue
        torch.testing.assert_close(factory(64, torch.float32, "cpu")(**args), expected, msg=name)
        ran.append(name)
    assert {"opsmith", "opsmith_pybind", "torch_eager"} <= set(ran)
    assert ("liger" in spec.providers) == (activation != "gelu"), "Liger has SiLU-mul and tanh GELU-mul only"
    assert spec.fwd_bytes(2, 8, 2) == 3 * 2 * 8 * 2 and spec.fwdbwd_bytes(2, 8, 2) == 8 * 2 * 8 * 2


@pytest.mark.parametrize("fused", [False, True])
def test_module_freed_without_the_cyclic_collector(fused):
    # a module that holds its own bound method (a state-dict hook) is a cycle:
    # its weights would wait for gc rather than go with the last reference
    import gc
    import weakref

    gc.disable()
    try:
        m = opsmith.nn.GatedMLP(16, 24, fused_gate_up=fused)
        m.load_state_dict(m.state_dict())
        r, w = weakref.ref(m), weakref.ref(m.down_proj.weight)
        del m
        assert r() is None and w() is None
    finally:
        gc.enable()
