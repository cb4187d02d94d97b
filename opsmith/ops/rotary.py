"""Rotary position embedding in Python: apply_rotary (the functional API,
route B), apply_rotary_pos_emb (a drop-in for Hugging Face's), the fake
kernels of the three dispatcher ops, the route A autograd.Function, and
RotaryEmbedding, the module producing cos/sin as Hugging Face's
LlamaRotaryEmbedding does (rope_type "default" and "llama3").

The kernels read q and k through their strides (a view into a fused qkv
projection is not copied) and rotate both in one pass; the backward is the
rotation by -theta and keeps only cos/sin (and position_ids).

Conventions (the C header, include/opsmith/rotary.h, is the specification):
cos and sin carry rotary_dim values for each (b, s), read as given:
``out = x * cos + rot(x) * sin`` over the first rotary_dim dims, with
rot(x) = cat(-x2, x1) for rotate-half (Llama/NeoX/Hugging Face: cos's two
halves duplicated, as LlamaRotaryEmbedding gives them) and rot(x)[2i] =
-x[2i+1], rot(x)[2i+1] = x[2i] for interleaved (GPT-J: each frequency
repeated, cos[2i] == cos[2i+1]). The dims past rotary_dim pass through."""
import math
from typing import Optional, Tuple

import torch

from . import Module, register_fake
from .. import _library  # noqa: F401  (loads the library: torch.ops.opsmith.* exists after this)

_fwd = torch.ops.opsmith.rotary_fwd.default
_bwd = torch.ops.opsmith.rotary_bwd.default
_inplace = torch.ops.opsmith.rotary_.default

_LAYOUTS = ("bhsd", "bshd")


def _check_layout(layout):
    if layout not in _LAYOUTS:
        raise RuntimeError(f"rotary: layout must be 'bhsd' or 'bshd', got {layout!r}")


def _memory_order(q, k, layout):
    """The layout q and k are laid out in memory when it is the other one
    (q_proj(h).view(B, S, H, D).transpose(1, 2) passed as "bhsd", or
    [B, H, S, D] memory passed as "bshd"), else None. Rotated as that layout
    (on the transposed views), the outputs keep the inputs' memory order, and
    so do the gradients coming back: the projection's backward then reads
    them as a view of [B * S, H * D] instead of copying them. Only where the
    call is otherwise valid, so an error names the layout the caller gave."""
    if q.dim() != 4 or q.stride(3) != 1 or q.size(1) == 1 or q.size(2) == 1 or q.stride(1) >= q.stride(2):
        return None
    if k is not None:
        sdim = 2 if layout == "bhsd" else 1
        if k.dim() != 4 or k.stride(3) != 1 or k.size(0) != q.size(0) or k.size(sdim) != q.size(sdim) \
                or k.size(3) != q.size(3) or (k.size(1) > 1 and k.size(2) > 1 and k.stride(1) >= k.stride(2)):
            return None
    return "bshd" if layout == "bhsd" else "bhsd"


def _rotate(fwd, q, k, cos, sin, position_ids, interleaved, rotary_dim, layout):
    """fwd(q, k, ...) -> (q_out, k_out), run in the inputs' memory order."""
    order = _memory_order(q, k, layout)
    if order is None:
        q_out, k_out = fwd(q, k, cos, sin, position_ids, interleaved, rotary_dim, layout)
        return q_out, (k_out if k is not None else None)
    q_out, k_out = fwd(q.transpose(1, 2), k.transpose(1, 2) if k is not None else None, cos, sin, position_ids,
                       interleaved, rotary_dim, order)
    return q_out.transpose(1, 2), (k_out.transpose(1, 2) if k is not None else None)


# --- route B: the functional API -------------------------------------------------

def apply_rotary(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                 position_ids: Optional[torch.Tensor] = None, *, interleaved: bool = False,
                 rotary_dim: Optional[int] = None, layout: str = "bhsd",
                 inplace: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Rotary position embedding of q and k in one kernel: ``(q_out, k_out)``.

    q is ``[B, Hq, S, D]`` (layout "bhsd") or ``[B, S, Hq, D]`` ("bshd"), k
    the same with its own head count (grouped-query attention) or None (then
    k_out is None). Any strides with a contiguous last dim, such as views into
    a fused qkv projection, are read in place. The outputs keep the inputs'
    memory order: q given as ``q_proj(h).view(B, S, H, D).transpose(1, 2)``
    (layout "bhsd") gives q_out of the same strides, so the gradient reaching
    q_proj needs no copy.

    cos/sin: ``[S, R]`` or ``[B, S, R]`` (Hugging Face's, from
    LlamaRotaryEmbedding), or with ``position_ids`` (int64 ``[B, S]`` or
    ``[S]``, positions per batch row) a ``[max_pos, R]`` cache. R =
    rotary_dim (default: cos's last dim; must equal it when given) may be
    less than D: the remaining dims pass through. cos/sin have q's dtype, or
    float32 beside float16/bfloat16 q. The math runs in float32 (float64 for
    float64), every output rounded once.

    inplace=True rotates q and k in place (schema ``Tensor(a!)``) and returns
    them; it does not take part in autograd (raises when an input requires
    grad). Out of place, gradients of any order flow to q and k (not to
    cos/sin, which must not require grad); forward-mode AD raises."""
    _check_layout(layout)
    if inplace:
        _inplace(q, k, cos, sin, position_ids, interleaved, rotary_dim, layout)
        return q, k
    return _rotate(_fwd, q, k, cos, sin, position_ids, interleaved, rotary_dim, layout)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         position_ids: Optional[torch.Tensor] = None,
                         unsqueeze_dim: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin,
    unsqueeze_dim=1)`` (rotate-half): cos/sin ``[B, S, D]`` (or ``[S, D]``) as
    LlamaRotaryEmbedding returns them; unsqueeze_dim 1 for q/k ``[B, H, S, D]``,
    2 for ``[B, S, H, D]``. position_ids is accepted and ignored, as in
    Hugging Face's. cos/sin narrower than D rotate the first cos.shape[-1]
    dims and pass the rest through, as the partial-rotary versions of the
    function do (Bamba's; Llama's raises on the mismatch). Returns what
    theirs returns, dtype included (float32 cos beside bfloat16 q promotes
    the result to float32)."""
    return _pos_emb(_fwd, "apply_rotary_pos_emb", q, k, cos, sin, unsqueeze_dim)


def _pos_emb(fwd, name, q, k, cos, sin, unsqueeze_dim):
    """Hugging Face's apply_rotary_pos_emb through fwd (route B's op or route A's Function)."""
    if unsqueeze_dim not in (1, 2, -3, -2):
        raise RuntimeError(f"{name}: unsqueeze_dim must be 1 ([B, H, S, D]) or 2 ([B, S, H, D]), "
                           f"got {unsqueeze_dim}")
    layout = "bhsd" if unsqueeze_dim in (1, -3) else "bshd"
    dtype = torch.promote_types(torch.promote_types(q.dtype, cos.dtype), k.dtype)
    if q.dtype != dtype or k.dtype != dtype:
        q, k = q.to(dtype), k.to(dtype)
    if cos.dtype != dtype and not (cos.dtype == torch.float32 and dtype in (torch.float16, torch.bfloat16)):
        cos, sin = cos.to(dtype), sin.to(dtype)
    # q_proj(h).view(B, S, H, D).transpose(1, 2), as Hugging Face builds q
    # and k: the outputs keep that order, as its elementwise rotation does
    return _rotate(fwd, q, k, cos, sin, None, False, None, layout)


# --- fake kernels ------------------------------------------------------------------

def _fake_check(q, k, cos, sin, position_ids, layout):
    _check_layout(layout)
    torch._check(q.dim() == 4, lambda: f"rotary: q must be 4-D, got shape {list(q.shape)}")
    torch._check(cos.shape == sin.shape, lambda: "rotary: cos and sin must have one shape")
    if k is not None:
        torch._check(k.dim() == 4 and k.dtype == q.dtype, lambda: "rotary: k must be 4-D with q's dtype")


def _outs(q, k):
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = (torch.empty(k.shape, dtype=k.dtype, device=k.device) if k is not None
             else torch.empty((0,), dtype=q.dtype, device=q.device))
    return q_out, k_out


@register_fake("opsmith::rotary_fwd")
def _rotary_fwd_fake(q, k, cos, sin, position_ids=None, interleaved=False, rotary_dim=None, layout="bhsd"):
    _fake_check(q, k, cos, sin, position_ids, layout)
    return _outs(q, k)


@register_fake("opsmith::rotary_bwd")
def _rotary_bwd_fake(dq_out, dk_out, cos, sin, position_ids=None, interleaved=False, rotary_dim=None,
                     layout="bhsd"):
    _fake_check(dq_out, dk_out, cos, sin, position_ids, layout)
    return _outs(dq_out, dk_out)


@register_fake("opsmith::rotary_")
def _rotary_inplace_fake(q, k, cos, sin, position_ids=None, interleaved=False, rotary_dim=None, layout="bhsd"):
    _fake_check(q, k, cos, sin, position_ids, layout)
    return None


# --- vmap: refused clearly (a batch dim over q, k and cos/sin at once has no
# single [B, S] folding; call the op on the batched shape instead) ------------

def _no_vmap(name):
    def rule(info, in_dims, *args):
        raise RuntimeError(f"rotary: torch.func.vmap is not supported ({name}); apply the rotation to the batched "
                           "tensors directly (any batch size B)")
    return rule


for _name in ("rotary_fwd", "rotary_bwd", "rotary_"):
    torch.library.register_vmap(f"opsmith::{_name}", _no_vmap(_name))


# --- route A: pybind11 + torch.autograd.Function -------------------------------------

from . import route_a as _pybind


class RotaryFunction(torch.autograd.Function):
    """q, k -> rotated q, k. Linear in q and k, so every derivative is a
    rotation: the backward is the transpose (_RotaryTranspose), whose own
    backward is this Function again, to any order (as route B)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids, interleaved, rotary_dim, layout):
        if cos.requires_grad or sin.requires_grad:
            raise RuntimeError("rotary: cos and sin must not require grad (no gradient flows to them); "
                               "pass cos.detach(), sin.detach()")
        q_out, k_out = _pybind().rotary_fwd(q, k, cos, sin, position_ids, interleaved, rotary_dim, layout)
        return _keep(ctx, q, k, cos, sin, position_ids, (interleaved, rotary_dim, layout), q_out, k_out)

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        return _through(ctx, _RotaryTranspose, dq_out, dk_out)


class _RotaryTranspose(torch.autograd.Function):
    """dq_out, dk_out -> dq, dk: the transpose of the rotation."""

    @staticmethod
    def forward(ctx, dq_out, dk_out, cos, sin, position_ids, interleaved, rotary_dim, layout):
        dq, dk = _pybind().rotary_bwd(dq_out, dk_out, cos, sin, position_ids, interleaved, rotary_dim, layout)
        return _keep(ctx, dq_out, dk_out, cos, sin, position_ids, (interleaved, rotary_dim, layout), dq, dk)

    @staticmethod
    def backward(ctx, ddq, ddk):
        return _through(ctx, RotaryFunction, ddq, ddk)


def _keep(ctx, a, b, cos, sin, position_ids, args, a_out, b_out):
    """What either direction's backward needs: the tables, the options, and
    a's shape for a missing incoming gradient."""
    ctx.save_for_backward(cos, sin, position_ids)
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros to rotate
    ctx.args = args
    ctx.has_b = b is not None
    ctx.a_meta = (a.shape, a.dtype, a.device)
    if b is None:
        ctx.mark_non_differentiable(b_out)
    return a_out, b_out


def _through(ctx, fn, ga, gb):
    """The gradients of a and b: the other direction applied to theirs."""
    cos, sin, position_ids = ctx.saved_tensors
    if ga is None and gb is None:
        return (None,) * 8
    if ga is None:
        shape, dtype, device = ctx.a_meta
        ga = torch.zeros(shape, dtype=dtype, device=device)
    ra, rb = fn.apply(ga, gb if ctx.has_b else None, cos, sin, position_ids, *ctx.args)
    return ra, (rb if ctx.has_b and gb is not None else None), None, None, None, None, None, None


def _rotary_function(q, k, *args):
    return RotaryFunction.apply(q, k, *args)


def apply_rotary_pybind(q, k, cos, sin, position_ids=None, *, interleaved=False, rotary_dim=None, layout="bhsd",
                        inplace=False):
    """Route A twin of opsmith.apply_rotary (opsmith.pybind.apply_rotary): same bits,
    gradients of any order; not under torch.func transforms."""
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError("opsmith.pybind.apply_rotary: route A does not support torch.func transforms "
                           "(grad, vjp, jvp, vmap); use opsmith.apply_rotary")
    _check_layout(layout)
    if inplace:
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, cos, sin)):
            raise RuntimeError("rotary: inplace=True does not support autograd (q, k, cos or sin requires grad); "
                               "use inplace=False")
        _pybind().rotary_(q, k, cos, sin, position_ids, interleaved, rotary_dim, layout)
        return q, k
    return _rotate(_rotary_function, q, k, cos, sin, position_ids, interleaved, rotary_dim, layout)


def apply_rotary_pos_emb_pybind(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Route A twin of opsmith.apply_rotary_pos_emb
    (opsmith.pybind.apply_rotary_pos_emb): same bits, gradients of any
    order; not under torch.func transforms."""
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError("opsmith.pybind.apply_rotary_pos_emb: route A does not support torch.func transforms "
                           "(grad, vjp, jvp, vmap); use opsmith.apply_rotary_pos_emb")
    return _pos_emb(_rotary_function, "opsmith.pybind.apply_rotary_pos_emb", q, k, cos, sin, unsqueeze_dim)


# --- cos/sin like Hugging Face's LlamaRotaryEmbedding ----------------------------------

def _default_inv_freq(dim, base, device=None):
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))


def _llama3_inv_freq(inv_freq, factor, low_freq_factor, high_freq_factor, old_context_len):
    # Llama 3.1's frequency scaling: long wavelengths divided by factor, short
    # ones kept, the band between blended smoothly (as transformers computes it)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(Module):
    """cos/sin for rotary embeddings, as Hugging Face's LlamaRotaryEmbedding
    gives them: ``forward(x, position_ids) -> (cos, sin)``, each ``[B, S, dim]``
    (the two halves duplicated, for rotate-half) in x's dtype, computed in
    float32. ``inv_freq`` is a non-persistent buffer, as theirs.

    rope_type "default" (``base ** (-2i / dim)``) or "llama3" (Llama 3.1's
    scaled frequencies: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``). ``from_config(config)`` reads a
    Hugging Face config (``rope_parameters`` or the older ``rope_scaling`` /
    ``rope_theta``, head_dim, partial_rotary_factor). interleaved=True
    repeats each frequency in place (GPT-J layout) instead of duplicating
    the halves."""

    def __init__(self, dim: int, max_position_embeddings: int = 2048, base: float = 10000.0,
                 rope_type: str = "default", factor: float = 8.0, low_freq_factor: float = 1.0,
                 high_freq_factor: float = 4.0, original_max_position_embeddings: int = 8192,
                 interleaved: bool = False, device=None) -> None:
        super().__init__()
        if dim < 2 or dim % 2:
            raise ValueError(f"RotaryEmbedding: dim must be even and >= 2, got {dim}")
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"RotaryEmbedding: rope_type must be 'default' or 'llama3', got {rope_type!r}")
        self.dim, self.base, self.rope_type, self.interleaved = dim, base, rope_type, interleaved
        self.max_seq_len_cached = self.original_max_seq_len = max_position_embeddings
        inv_freq = _default_inv_freq(dim, base, device)
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, factor, low_freq_factor, high_freq_factor,
                                        original_max_position_embeddings)
        self.attention_scaling = 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @classmethod
    def from_config(cls, config, device=None) -> "RotaryEmbedding":
        params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
        rope_type = params.get("rope_type", params.get("type", "default"))
        kw = {}
        if rope_type == "llama3":
            kw = dict(factor=params["factor"], low_freq_factor=params["low_freq_factor"],
                      high_freq_factor=params["high_freq_factor"],
                      original_max_position_embeddings=params["original_max_position_embeddings"])
        return cls(dim, config.max_position_embeddings, base, rope_type, device=device, **kw)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = (torch.repeat_interleave(freqs, 2, dim=-1) if self.interleaved else torch.cat((freqs, freqs), dim=-1))
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    def cache(self, max_pos: int, device=None, dtype=torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
        """A ``[max_pos, dim]`` cos/sin cache for ``apply_rotary(..., position_ids)``."""
        pos = torch.arange(max_pos, device=device if device is not None else self.inv_freq.device)
        cos, sin = self.forward(torch.empty(0, dtype=dtype, device=pos.device), pos[None])
        return cos[0], sin[0]

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, rope_type={self.rope_type!r}, interleaved={self.interleaved}"


# --- what this op adds to opsmith, opsmith.nn and opsmith.pybind -------------------------
FUNCTIONS = {"apply_rotary": apply_rotary, "apply_rotary_pos_emb": apply_rotary_pos_emb}
MODULES = {"RotaryEmbedding": RotaryEmbedding}
PYBIND = {"apply_rotary": apply_rotary_pybind, "apply_rotary_pos_emb": apply_rotary_pos_emb_pybind,
          "RotaryFunction": RotaryFunction}
