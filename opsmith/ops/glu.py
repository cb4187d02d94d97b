"""Gated activations in Python: swiglu and geglu (the functional API, route
B), the fake kernels and vmap rules of their two dispatcher ops, the route A
autograd.Function, and GatedMLP, the Llama/Mistral/Qwen2/Gemma MLP block
over them. The dispatcher imports this module for the fake kernels when the
library is loaded on its own (m.set_python_module in csrc/torch/glu.cpp).

Both functions take gate and up as two tensors of one shape, or one packed
tensor [..., 2*I] (gate = first half, up = second half, as a fused gate-up
projection produces) with up None; the packed form's gradient is one packed
tensor too. The kernels read the two halves in place (no copy)."""
from typing import Optional

import torch
import torch.nn.functional as F

from . import first_order_only, pybind_double_backward_error, Module, register_fake
from .. import _library  # noqa: F401  (loads the library: torch.ops.opsmith.* exists after this)
from . import _vmap

_glu_fwd = torch.ops.opsmith.glu_fwd.default
_glu_bwd = torch.ops.opsmith.glu_bwd.default

_GELU_APPROXIMATE = {"none": "gelu", "tanh": "gelu_tanh"}
# GatedMLP's activation names (Hugging Face's hidden_act spellings among them)
_MLP_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_tanh": "gelu_tanh",
                    "gelu_pytorch_tanh": "gelu_tanh"}


def _geglu_activation(approximate: str) -> str:
    if approximate not in _GELU_APPROXIMATE:
        raise RuntimeError(f"geglu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return _GELU_APPROXIMATE[approximate]


# --- route B: the functional API -------------------------------------------------

def swiglu(gate: torch.Tensor, up: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu(gate) * up`` in one pass (SwiGLU, the Llama/Mistral/Qwen2 MLP).

    Same result as ``torch.nn.functional.silu(gate) * up``, rounded once:
    the math runs in float32 for float16/bfloat16 (float64 for float64).
    With up None, gate is the packed output of a fused gate-up projection,
    ``[..., 2*I]``: gate its first half, up its second, y ``[..., I]``.
    Autograd is registered in C++: first-order gradients, torch.func.grad,
    vjp and vmap; double backward and forward-mode AD raise."""
    return _glu_fwd(gate, up, "silu")


def geglu(gate: torch.Tensor, up: Optional[torch.Tensor] = None, approximate: str = "none") -> torch.Tensor:
    """``gelu(gate, approximate) * up`` in one pass (GeGLU; Gemma uses
    ``approximate="tanh"``). Same conventions as :func:`swiglu`, and the
    result of ``torch.nn.functional.gelu(gate, approximate=approximate) * up``."""
    return _glu_fwd(gate, up, _geglu_activation(approximate))


def _out_shape(gate, up):
    return gate.shape if up is not None else (*gate.shape[:-1], gate.shape[-1] // 2)


def _check_fake(gate, up):
    torch._check(gate.dim() >= 1, lambda: "glu: gate must have at least 1 dimension, got a 0-dim tensor")
    if up is not None:
        torch._check(up.shape == gate.shape,
                     lambda: f"glu: up must have the shape of gate {list(gate.shape)}, got {list(up.shape)}")
        torch._check(up.dtype == gate.dtype, lambda: "glu: up must have the same dtype as gate")
    else:
        torch._check(gate.shape[-1] % 2 == 0,
                     lambda: "glu: a packed gate-up tensor (up None) must have an even last dimension")


@register_fake("opsmith::glu_fwd")
def _glu_fwd_fake(gate, up, activation="silu"):
    _check_fake(gate, up)
    return gate.new_empty(_out_shape(gate, up))


@register_fake("opsmith::glu_bwd")
def _glu_bwd_fake(dy, gate, up, activation="silu", with_h=False):
    _check_fake(gate, up)
    y_shape = _out_shape(gate, up)
    dgate = gate.new_empty(gate.shape)
    dup = gate.new_empty(y_shape if up is not None else (0,))
    h = gate.new_empty(y_shape if with_h else (0,))
    return dgate, dup, h


# --- vmap rules: elementwise, so a batch dim is more rows ----------------------------


@torch.library.register_vmap("opsmith::glu_fwd")
def _glu_fwd_vmap(info, in_dims, gate, up, activation="silu"):
    b = info.batch_size
    torch._check(in_dims[0] is None or gate.dim() >= 2,
                 lambda: "glu: gate must have at least 1 dimension, got a 0-dim tensor")
    return _glu_fwd(_vmap.to_front(gate, in_dims[0], b), _vmap.to_front(up, in_dims[1], b), activation), 0


@torch.library.register_vmap("opsmith::glu_bwd")
def _glu_bwd_vmap(info, in_dims, dy, gate, up, activation="silu", with_h=False):
    b = info.batch_size
    dgate, dup, h = _glu_bwd(_vmap.to_front(dy, in_dims[0], b), _vmap.to_front(gate, in_dims[1], b),
                             _vmap.to_front(up, in_dims[2], b), activation, with_h)
    # the empty placeholders ([0]: no dup for the packed form, no h) are not batched
    return (dgate, dup, h), (0, 0 if up is not None else None, 0 if with_h else None)


# --- route A: pybind11 + torch.autograd.Function -------------------------------------

from . import route_a as _pybind

_TORCH_GLU = {"silu": "torch.nn.functional.silu(gate) * up", "gelu": "torch.nn.functional.gelu(gate) * up",
              "gelu_tanh": "torch.nn.functional.gelu(gate, approximate='tanh') * up"}
# per activation: the name the user called (opsmith.pybind.swiglu or geglu)
PYBIND_DOUBLE_BACKWARD_ERROR = {
    activation: pybind_double_backward_error("swiglu" if activation == "silu" else "geglu", formula)
    for activation, formula in _TORCH_GLU.items()
}


class GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation):
        y = _pybind().glu_fwd(gate, up, activation)
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        return y

    @staticmethod
    @first_order_only(lambda ctx: PYBIND_DOUBLE_BACKWARD_ERROR[ctx.activation])
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dgate, dup, _ = _pybind().glu_bwd(dy, gate, up, ctx.activation, False)
        return dgate, (dup if up is not None else None), None


def _route_a_check(name):
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(f"opsmith.pybind.{name}: route A does not support torch.func transforms "
                           f"(grad, vjp, jvp, vmap); use opsmith.{name}")


def swiglu_pybind(gate: torch.Tensor, up: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Route A twin of opsmith.swiglu (opsmith.pybind.swiglu): same bits.
    First-order gradients only; not under torch.func transforms."""
    _route_a_check("swiglu")
    return GLUFunction.apply(gate, up, "silu")


def geglu_pybind(gate: torch.Tensor, up: Optional[torch.Tensor] = None, approximate: str = "none") -> torch.Tensor:
    """Route A twin of opsmith.geglu (opsmith.pybind.geglu): same bits."""
    _route_a_check("geglu")
    return GLUFunction.apply(gate, up, _geglu_activation(approximate))


# --- recompute: the down projection without keeping h --------------------------------

# the alternative is torch's formula, not GatedMLP(recompute=False): route
# B's gated activation refuses double backward too
RECOMPUTE_DOUBLE_BACKWARD_ERROR = {
    activation: ("opsmith.nn.GatedMLP(recompute=True) (and opsmith.hf's patched MLPs): double backward is not "
                 "supported (the backward that recomputes act(gate) * up is not differentiable); compute "
                 f"higher-order gradients with torch.nn.functional.linear({formula}, weight, bias)")
    for activation, formula in _TORCH_GLU.items()
}


class GatedDownProjection(torch.autograd.Function):
    """``F.linear(act(gate) * up, weight, bias)`` that keeps no h = act(gate)*up
    for the backward: down_proj's weight gradient needs h, which the backward
    recomputes from gate and up (saved anyway, for the activation's own
    gradient) in the same kernel pass that computes dgate and dup. Saves
    rows x I elements per MLP for one extra read of nothing: the backward
    kernel reads dy, gate, up once either way and writes h beside the
    gradients."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, activation):
        h = _glu_fwd(gate, up, activation)
        out = F.linear(h, weight, bias)
        ctx.save_for_backward(gate, up, weight)
        ctx.activation = activation
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    @first_order_only(lambda ctx: RECOMPUTE_DOUBLE_BACKWARD_ERROR[ctx.activation])
    def backward(ctx, dout):
        gate, up, weight = ctx.saved_tensors
        dh = (dout @ weight.to(dout.dtype)).to(gate.dtype)
        dgate, dup, h = _glu_bwd(dh, gate, up, ctx.activation, True)
        dweight = dbias = None
        dout2 = dout.reshape(-1, dout.shape[-1])
        if ctx.needs_input_grad[2]:
            dweight = (dout2.t() @ h.reshape(-1, h.shape[-1]).to(dout.dtype)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            dbias = dout2.sum(0).to(ctx.bias_dtype)
        return dgate, (dup if up is not None else None), dweight, dbias, None


# --- the nn module ---------------------------------------------------------------------

class GatedMLP(Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: the MLP of Llama, Mistral,
    Qwen2 (activation "silu") and Gemma ("gelu_tanh"), with their state-dict
    keys gate_proj, up_proj, down_proj (torch.nn.Linear submodules).

    fused_gate_up=True computes gate and up with one projection
    (``gate_up_proj``, weight [2*I, hidden]) whose output feeds the packed
    form of the activation; its state dict still saves and loads as
    gate_proj/up_proj (state-dict hooks), so checkpoints move freely between
    the two layouts and Hugging Face. recompute=True keeps no act(gate)*up
    for the backward (see GatedDownProjection): less memory, the same
    gradients bit for bit."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool = False,
                 fused_gate_up: bool = False, recompute: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        if activation not in _MLP_ACTIVATIONS:
            raise ValueError(f"GatedMLP: activation must be one of {sorted(_MLP_ACTIVATIONS)}, got {activation!r}")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self._act = _MLP_ACTIVATIONS[activation]
        self.fused_gate_up = fused_gate_up
        self.recompute = recompute
        kw = dict(bias=bias, device=device, dtype=dtype)
        if fused_gate_up:
            self.gate_up_proj = torch.nn.Linear(hidden_size, 2 * intermediate_size, **kw)
            self._register_state_dict_hook(GatedMLP._split_gate_up)
            # static functions, not bound methods: a module holding its own bound method is a
            # reference cycle, freed only by the cyclic collector
            self._register_load_state_dict_pre_hook(GatedMLP._join_gate_up)
        else:
            self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, **kw)
            self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up:
            gate, up = F.linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias), None
        else:
            gate = F.linear(x, self.gate_proj.weight, self.gate_proj.bias)
            up = F.linear(x, self.up_proj.weight, self.up_proj.bias)
        if self.recompute and torch.is_grad_enabled():
            return GatedDownProjection.apply(gate, up, self.down_proj.weight, self.down_proj.bias, self._act)
        return F.linear(_glu_fwd(gate, up, self._act), self.down_proj.weight, self.down_proj.bias)

    # gate_up_proj.{weight,bias} <-> gate_proj.* + up_proj.* (in Hugging Face's key order)
    @staticmethod
    def _split_gate_up(module, state_dict, prefix, local_metadata):
        moved = {}
        for kind in ("weight", "bias"):
            key = f"{prefix}gate_up_proj.{kind}"
            if key in state_dict:
                t = state_dict.pop(key)
                i = t.shape[0] // 2
                # copies, not views: a checkpoint must not hold the fused tensor twice
                moved[f"{prefix}gate_proj.{kind}"] = t[:i].clone()
                moved[f"{prefix}up_proj.{kind}"] = t[i:].clone()
        rest = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(f"{prefix}down_proj.")]}
        for name in ("gate_proj", "up_proj"):
            for kind in ("weight", "bias"):
                if f"{prefix}{name}.{kind}" in moved:
                    state_dict[f"{prefix}{name}.{kind}"] = moved[f"{prefix}{name}.{kind}"]
        state_dict.update(rest)

    @staticmethod
    def _join_gate_up(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for kind in ("weight", "bias"):
            g, u = f"{prefix}gate_proj.{kind}", f"{prefix}up_proj.{kind}"
            if g in state_dict and u in state_dict:
                state_dict[f"{prefix}gate_up_proj.{kind}"] = torch.cat([state_dict.pop(g), state_dict.pop(u)], 0)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"activation={self.activation!r}, fused_gate_up={self.fused_gate_up}, recompute={self.recompute}")


# --- what this op adds to opsmith, opsmith.nn and opsmith.pybind -------------------------
FUNCTIONS = {"swiglu": swiglu, "geglu": geglu}
MODULES = {"GatedMLP": GatedMLP}
PYBIND = {"swiglu": swiglu_pybind, "geglu": geglu_pybind, "GLUFunction": GLUFunction}
