"""The op spec of the gated activations: how every harness (reliability
tests, sanitizer, benchmark, docs/reliability.md's table) reaches
torch.ops.opsmith.glu_*.

One call covers the whole family: from row inputs gate and up it returns
swiglu(gate, up), geglu(gate, up) (exact GELU) and geglu(packed, tanh) over
the packed tensor cat([gate, up], -1), so every harness runs all three
activations and both the separate and the packed form."""
import math

import torch
import torch.nn.functional as F

from ..ops.glu import GatedMLP, geglu, geglu_pybind, swiglu, swiglu_pybind
from . import SUPPORTED, BenchSpec, DocRow, Hostile, OpSpec, compiled, randn

_TOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def _make_inputs(shape, dtype, device, generator):
    shape = tuple(shape)
    # gate over a wider range than N(0, 1), so both tails of every activation run
    gate = randn(shape, generator, torch.float32, generator.device) * 3
    return {"gate": gate.to(device=device, dtype=dtype), "up": randn(shape, generator, dtype, device)}


def _calls(swi, ge, inputs):
    gate, up = inputs["gate"], inputs.get("up")
    approximate = inputs.get("approximate", "none")
    y_swiglu, y_geglu = swi(gate, up), ge(gate, up, approximate)  # the ops' own checks first
    packed = torch.cat([gate, up], -1) if up is not None else gate
    return y_swiglu, y_geglu, ge(packed, None, "tanh")


def _call(inputs):
    return _calls(swiglu, geglu, inputs)


def _call_pybind(inputs):
    return _calls(swiglu_pybind, geglu_pybind, inputs)


def _math(gate, up, approximate="none"):
    packed = torch.cat([gate, up], -1) if up is not None else gate
    g2, u2 = packed.chunk(2, -1)
    if up is None:
        gate, up = g2, u2
    return (F.silu(gate) * up, F.gelu(gate, approximate=approximate) * up,
            F.gelu(g2, approximate="tanh") * u2)


def _reference(inputs, dtype=None):
    up = inputs.get("up")
    return _math(inputs["gate"].to(torch.float64), None if up is None else up.to(torch.float64),
                 inputs.get("approximate", "none"))


def _torch_equivalent(inputs):
    up = inputs.get("up")
    return _math(inputs["gate"].detach().cpu().float(), None if up is None else up.detach().cpu().float(),
                 inputs.get("approximate", "none"))


def _opcheck(inputs):
    gate, up = inputs["gate"], inputs["up"]
    packed = torch.cat([gate.detach(), up.detach()], -1)
    dy = torch.randn_like(gate.detach())
    fwd, bwd = torch.ops.opsmith.glu_fwd.default, torch.ops.opsmith.glu_bwd.default
    return [(fwd, (gate, up, "silu")), (fwd, (gate, up, "gelu")), (fwd, (packed, None, "gelu_tanh")),
            (bwd, (dy, gate.detach(), up.detach(), "silu", False)),
            (bwd, (dy, gate.detach(), up.detach(), "gelu", True)),
            (bwd, (dy, packed, None, "gelu_tanh", True))]


# hostile inputs: float32, small, built on the CPU and moved

def _base(device, gen, rows=4, n=37, **extra):
    inputs = _make_inputs((rows, n), torch.float32, "cpu", gen)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    inputs.update(extra)
    return inputs


def _edited(device, gen, gate_edit=None, up_edit=None):
    inputs = _base("cpu", gen)
    if gate_edit:
        gate_edit(inputs["gate"])
    if up_edit:
        up_edit(inputs["up"])
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def _set(*assignments):
    def edit(t):
        for index, value in assignments:
            t[index] = value
    return edit


def _only_element_bad(index):
    def check(spec, inputs, out):
        for name, o in zip(spec.outputs, out):
            o = o.detach().cpu().clone()
            assert not torch.isfinite(o[index]), f"{name}: element {index} must be NaN/Inf"
            o[index] = 0.0
            assert torch.isfinite(o).all(), f"{name}: a bad element must not leak into others (elementwise op)"
    return check


def _check_saturation(spec, inputs, out):
    ref = spec.reference({k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()})
    for name, o, r in zip(spec.outputs, out, ref):
        err = (o.detach().cpu().double() - r).abs().max().item()
        assert err <= 1e-5 * max(1.0, r.abs().max().item()), f"{name}: max err {err:.3e} on saturated gates"


_HOSTILE = (
    Hostile("nan_in_gate", lambda d, g: _edited(d, g, _set(((1, 5), math.nan))),
            "NaN in that element of every output; every other element finite", input="one NaN in gate",
            check=_only_element_bad((1, 5))),
    Hostile("nan_in_up", lambda d, g: _edited(d, g, up_edit=_set(((2, 3), math.nan))),
            "NaN in that element only", input="one NaN in up", check=_only_element_bad((2, 3))),
    Hostile("neg_inf_in_gate", lambda d, g: _edited(d, g, _set(((0, 0), -math.inf))),
            "NaN in that element (-inf · 0, as F.silu(g) * u and F.gelu(g) * u give); others finite",
            input="-Inf in gate", check=_only_element_bad((0, 0))),
    Hostile("inf_in_up", lambda d, g: _edited(d, g, up_edit=_set(((3, 36), math.inf))),
            "±Inf in that element (act(gate) · inf); others finite", input="+Inf in up",
            check=_only_element_bad((3, 36))),
    Hostile("saturated_gates", lambda d, g: _edited(d, g, lambda x: x.mul_(40.0)),
            "matches the float64 reference: silu(g) -> g or -0, gelu(g) -> g or -0 without overflow in exp",
            input="gate ~ ±100", check=_check_saturation),
    Hostile("integer_gate",
            lambda d, g: {"gate": torch.randint(-5, 5, (4, 8), generator=g, dtype=torch.int32).to(d),
                          "up": torch.randint(-5, 5, (4, 8), generator=g, dtype=torch.int32).to(d)},
            "`swiglu: gate must be float64, float32, float16 or bfloat16, got Int`", input="int32 gate and up",
            raises=r"^swiglu: gate must be float64, float32, float16 or bfloat16, got Int"),
    Hostile("up_dtype_differs", lambda d, g: {**_base(d, g), "up": _base(d, g)["up"].double()},
            "`swiglu: up must have the same dtype as gate (Float), got Double`", input="float32 gate, float64 up",
            raises=r"^swiglu: up must have the same dtype as gate \(Float\), got Double"),
    Hostile("up_wrong_shape", lambda d, g: {**_base(d, g), "up": torch.ones(4, 38, device=d)},
            "`swiglu: up must have the shape of gate [4, 37], got [4, 38]`", input="up (4, 38) for gate (4, 37)",
            raises=r"^swiglu: up must have the shape of gate \[4, 37\], got \[4, 38\]"),
    Hostile("packed_odd_width", lambda d, g: {"gate": torch.randn(4, 7, generator=g).to(d), "up": None},
            "`swiglu: a packed gate-up tensor (up None) must have an even last dimension [..., 2*I], "
            "got shape [4, 7]`", input="packed gate (4, 7), up None",
            raises=r"^swiglu: a packed gate-up tensor \(up None\) must have an even"),
    Hostile("zero_dim_gate", lambda d, g: {"gate": torch.tensor(1.5, device=d), "up": torch.tensor(2.0, device=d)},
            "`swiglu: gate must have at least 1 dimension, got a 0-dim tensor`", input="0-dim gate and up",
            raises=r"^swiglu: gate must have at least 1 dimension"),
    Hostile("bad_approximate", lambda d, g: _base(d, g, approximate="erf"),
            "`geglu: approximate must be 'none' or 'tanh', got 'erf'`", input="geglu approximate='erf'",
            raises=r"^geglu: approximate must be 'none' or 'tanh', got 'erf'"),
    Hostile("up_on_cpu_gate_on_cuda", lambda d, g: {**_base("cuda", g), "up": _base("cpu", g)["up"]},
            "`swiglu: up must be on the same device as gate (cuda:0), got cpu`", input="up on the CPU, gate on CUDA",
            raises=r"^swiglu: up must be on the same device as gate", cuda_only=True),
)


# --- benchmark -----------------------------------------------------------------------
# Shapes are (rows, I): gate and up are (rows, I) each, y (rows, I). The
# default entry is SwiGLU; bench/glu_bench.py runs the GeGLU ones too.

def _bench_inputs(rows, n, dtype, device):
    return {"gate": torch.randn(rows, n, dtype=dtype, device=device),
            "up": torch.randn(rows, n, dtype=dtype, device=device),
            "dy": torch.randn(rows, n, dtype=dtype, device=device)}


def _liger_swiglu(n, dtype, device):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    return lambda gate, up: LigerSiLUMulFunction.apply(gate, up)


def _liger_geglu(n, dtype, device):
    # Liger's GELU-mul is the tanh approximation only
    from liger_kernel.ops.geglu import LigerGELUMulFunction
    return lambda gate, up: LigerGELUMulFunction.apply(gate, up)


def _eager(approximate):
    if approximate is None:
        return lambda gate, up: F.silu(gate) * up
    return lambda gate, up: F.gelu(gate, approximate=approximate) * up


def _providers(activation):
    """opsmith (route B and A), eager PyTorch, torch.compile of it, Liger."""
    approximate = {"silu": None, "gelu": "none", "gelu_tanh": "tanh"}[activation]
    # providers are called with the inputs by name: fn(gate=..., up=...)
    if activation == "silu":
        ours, ours_a = (lambda gate, up: swiglu(gate, up)), (lambda gate, up: swiglu_pybind(gate, up))
    else:
        ours = lambda gate, up: geglu(gate, up, approximate)  # noqa: E731
        ours_a = lambda gate, up: geglu_pybind(gate, up, approximate)  # noqa: E731
    providers = {
        "opsmith": lambda n, dt, dev: ours,
        "opsmith_pybind": lambda n, dt, dev: ours_a,
        "torch_eager": lambda n, dt, dev: _eager(approximate),
        "torch_compile": lambda n, dt, dev: compiled(("glu", activation, n), _eager(approximate)),
    }
    if activation == "silu":
        providers["liger"] = _liger_swiglu
    elif activation == "gelu_tanh":
        providers["liger"] = _liger_geglu
    return providers


def _host_calls(device):
    g = torch.randn(4, 256, device=device, dtype=torch.bfloat16)
    u = torch.randn(4, 256, device=device, dtype=torch.bfloat16)
    gg, ug = g.clone().requires_grad_(), u.clone().requires_grad_()
    return {
        "opsmith.swiglu": lambda: swiglu(g, u),
        "opsmith.swiglu (requires_grad)": lambda: swiglu(gg, ug),
        "torch.ops.opsmith.glu_fwd": lambda: torch.ops.opsmith.glu_fwd(g, u, "silu"),
        "opsmith.pybind.swiglu": lambda: swiglu_pybind(g, u),
        "F.silu(g) * u": lambda: F.silu(g) * u,
        "F.silu(g) * u (requires_grad)": lambda: F.silu(gg) * ug,
    }


def bench_spec(activation: str) -> BenchSpec:
    return BenchSpec(
        make_inputs=_bench_inputs,
        grad_inputs=["gate", "up"],
        providers=_providers(activation),
        # forward: read gate, up; write y. backward: read dy, gate, up; write dgate, dup
        fwd_bytes=lambda rows, n, s: 3 * rows * n * s,
        fwdbwd_bytes=lambda rows, n, s: 3 * rows * n * s + 5 * rows * n * s,
        # intermediate sizes: Llama 2 7B (11008), Llama 3 8B / Mistral 7B (14336), Qwen2 7B (18944),
        # Llama 3 70B (28672), and powers of two
        hidden_sizes=[4096, 8192, 11008, 14336, 18944, 28672],
        row_counts=[1, 16, 64, 1024, 4096, 16384],
        quick_shapes=[(16384, 4096), (16384, 8192), (16384, 14336), (4096, 11008), (8192, 28672), (4096, 18944),
                      (64, 14336), (16, 14336),
                      (1, 14336), (1, 28672)],
        host_calls=_host_calls if activation == "silu" else None,
    )


_DOC_ROWS = (
    DocRow("zero rows: gate and up of shape (0, n) or (3, 0, n)", "empty outputs and gradients of their shapes",
           "`test_zero_rows`"),
    DocRow("rows of width 0: gate and up of shape (4, 0) or (2, 3, 0), or packed (2, 3, 0)",
           "empty outputs and gradients of their shapes, as silu(gate) * up",
           "`test_zero_width`, `tests/test_glu.py::test_packed_width_zero`"),
    DocRow("one row, 1-D, prime widths 7, 13, 127, 8191, a row of 100003",
           "matches the reference (the scalar CUDA path and the CPU chunk tails run)",
           "`test_one_row`, `test_prime_widths`, `test_row_wider_than_any_tile`"),
    DocRow("transposed, sliced, every-other-row, expanded, storage-offset gate/up and dy",
           "matches the reference; no NaN from the padding the views skip over", "`test_layouts`"),
    DocRow("packed gate-up [..., 2*I] (up None), also a slice of a wider projection (row stride > 2*I)",
           "y [..., I] and ONE packed gradient [..., 2*I] (both halves), equal to the separate form's",
           "`tests/test_glu.py::test_packed_*`"),
    DocRow("GatedMLP(recompute=True)", "the same output and gradients as recompute=False, bit for bit on the CPU; "
           "act(gate) * up is not among the saved tensors", "`tests/test_glu.py::test_recompute_*`"),
    DocRow("GatedMLP(fused_gate_up=True) state dict", "saves and loads as gate_proj / up_proj / down_proj, "
           "interchangeable with the unfused module and a Hugging Face style MLP",
           "`tests/test_glu.py::test_state_dict_*`"),
)


SPEC = OpSpec(
    name="glu",
    make_inputs=_make_inputs,
    call=_call,
    call_pybind=_call_pybind,
    reference=_reference,
    torch_equivalent=_torch_equivalent,
    tolerance=_TOL.__getitem__,
    outputs=("swiglu", "geglu", "geglu_tanh_packed"),
    grad_inputs=("gate", "up"),
    row_inputs=("gate", "up"),
    opcheck=_opcheck,
    double_backward=r"^swiglu: double backward is not supported",
    double_backward_pybind=r"^opsmith\.pybind\.swiglu: double backward is not supported",
    func_transforms={
        "grad": SUPPORTED,
        "vjp": SUPPORTED,
        "jvp": r"^swiglu: forward-mode AD is not supported",
        "vmap": SUPPORTED,  # register_vmap in opsmith/ops/glu.py
    },
    func_transforms_pybind=r"^opsmith\.pybind\.swiglu: route A does not support torch\.func transforms",
    # outputs are products of two inputs: float16 overflows at 1e4 like PyTorch's own would
    max_scale=1.0,
    make_module=lambda n: GatedMLP(n, 2 * n),
    hostile=_HOSTILE,
    doc_rows=_DOC_ROWS,
    bench=bench_spec("silu"),
)
