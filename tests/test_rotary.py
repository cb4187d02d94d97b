"""What is the rotary embedding's alone; everything generic (float64
reference, hostile inputs, opcheck, gradcheck, double backward, compile,
CUDA graphs, streams, route A == route B, transforms) runs from the spec
(opsmith/specs/rotary.py) in test_reliability.py and test_integration.py.

Here: against Hugging Face's apply_rotary_pos_emb (both layouts, every
dtype, gradients), RotaryEmbedding against LlamaRotaryEmbedding (default and
llama3), views into a fused qkv projection (in place and out of place, v
untouched), every cos/sin form, GPT-J interleaved partial rotary, GQA and k
None, the in-place op, positions out of range, and the CUDA kernel's paths
(16-byte packs and the scalar fallback: odd head dims, misaligned views,
float32 cos/sin beside 16-bit q) against float64."""
import math
import zlib

import pytest
import torch

import opsmith
import opsmith.pybind
from opsmith.specs.rotary import SPEC, rotate_every_two, rotate_half

from conftest import requires_cuda
from harness import DTYPES, dtype_id

TOL = {dt: SPEC.tolerance(dt) for dt in DTYPES}

try:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply_rotary_pos_emb
except ImportError:  # pragma: no cover - depends on the environment
    hf_apply_rotary_pos_emb = None

requires_hf = pytest.mark.skipif(hf_apply_rotary_pos_emb is None, reason="transformers is not installed")


def close(got, ref, dtype, what):
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    err = (got.double().cpu() - ref.double().cpu()).abs().max().item() if got.numel() else 0.0
    scale = max(1.0, ref.double().abs().max().item()) if ref.numel() else 1.0
    assert err <= TOL[dtype] * scale, f"{what}: max err {err:.3e} > {TOL[dtype] * scale:.3e}"


def angles(b, s, d, device, interleaved=False, gen=None, dtype=torch.float32):
    theta = torch.rand(b, s, d // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
    theta = torch.repeat_interleave(theta, 2, -1) if interleaved else torch.cat([theta, theta], -1)
    return theta.cos().to(device, dtype), theta.sin().to(device, dtype)


def reference(x, cos, sin, interleaved=False, layout="bhsd"):
    """float64: x [B, H, S, D] or [B, S, H, D]; cos/sin [B, S, R] (broadcast over heads)."""
    x = x.double()
    cos, sin = cos.double(), sin.double()
    cos, sin = (cos[:, None], sin[:, None]) if layout == "bhsd" else (cos[:, :, None], sin[:, :, None])
    r = cos.shape[-1]
    xr, rest = x[..., :r], x[..., r:]
    rot = rotate_every_two(xr) if interleaved else rotate_half(xr)
    return torch.cat([xr * cos + rot * sin, rest], -1)


# --- Hugging Face ---------------------------------------------------------------


@requires_hf
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_matches_hf_apply_rotary_pos_emb(device, dtype, unsqueeze_dim):
    gen = torch.Generator().manual_seed(0)
    b, s, hq, hk, d = 2, 7, 4, 2, 64
    shape_q = (b, hq, s, d) if unsqueeze_dim == 1 else (b, s, hq, d)
    shape_k = (b, hk, s, d) if unsqueeze_dim == 1 else (b, s, hk, d)
    q = torch.randn(shape_q, generator=gen).to(device, dtype).requires_grad_()
    k = torch.randn(shape_k, generator=gen).to(device, dtype).requires_grad_()
    config = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hk,
                         max_position_embeddings=64)
    rope = LlamaRotaryEmbedding(config).to(device)
    pos = torch.randint(0, 64, (b, s), generator=gen).to(device)
    cos, sin = rope(q, pos)
    got_q, got_k = opsmith.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    want_q, want_k = hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    assert got_q.dtype == want_q.dtype and got_k.dtype == want_k.dtype
    # against float64 of the same inputs (Hugging Face's own rounding differs in 16-bit)
    ref_q, ref_k = hf_apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double(),
                                           unsqueeze_dim=unsqueeze_dim)
    close(got_q, ref_q, dtype, "q")
    close(got_k, ref_k, dtype, "k")
    close(got_q, want_q, dtype, "q vs Hugging Face")
    dq, dk = torch.randn_like(got_q), torch.randn_like(got_k)
    g = torch.autograd.grad((got_q, got_k), (q, k), (dq, dk))
    r = torch.autograd.grad((ref_q, ref_k), (q, k), (dq.double(), dk.double()))
    close(g[0], r[0], dtype, "dq")
    close(g[1], r[1], dtype, "dk")


@requires_hf
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_apply_rotary_pos_emb_partial_as_hf_partial_rotary(device, unsqueeze_dim):
    """cos/sin narrower than the heads: the first cos.shape[-1] dims rotated,
    the rest passed through, as Hugging Face's partial-rotary
    apply_rotary_pos_emb (Bamba's) does; the same values in float64."""
    try:
        from transformers.models.bamba.modeling_bamba import apply_rotary_pos_emb as hf_partial
    except ImportError:  # pragma: no cover - older transformers
        pytest.skip("this transformers has no Bamba")
    gen = torch.Generator().manual_seed(1)
    b, s, hq, hk, d, r = 2, 5, 4, 2, 64, 32
    shape_q = (b, hq, s, d) if unsqueeze_dim == 1 else (b, s, hq, d)
    shape_k = (b, hk, s, d) if unsqueeze_dim == 1 else (b, s, hk, d)
    q = torch.randn(shape_q, generator=gen, dtype=torch.float64).to(device)
    k = torch.randn(shape_k, generator=gen, dtype=torch.float64).to(device)
    cos = torch.randn(b, s, r, generator=gen, dtype=torch.float64).to(device)
    sin = torch.randn(b, s, r, generator=gen, dtype=torch.float64).to(device)
    got = opsmith.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    want = hf_partial(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    for g, w, what in zip(got, want, "qk"):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=what)
        assert torch.equal(g[..., r:], (q if what == "q" else k)[..., r:]), f"{what}: pass-through dims changed"


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_pybind_apply_rotary_pos_emb_same_bits_as_route_b(device, unsqueeze_dim):
    # route A's Hugging Face signature: the same outputs, gradients and
    # promotion (float32 cos beside bfloat16 q) as route B's
    gen = torch.Generator().manual_seed(3)
    b, s, hq, hk, d = 2, 5, 4, 2, 32
    shape_q = (b, hq, s, d) if unsqueeze_dim == 1 else (b, s, hq, d)
    shape_k = (b, hk, s, d) if unsqueeze_dim == 1 else (b, s, hk, d)
    q0 = torch.randn(shape_q, generator=gen).to(device, torch.bfloat16)
    k0 = torch.randn(shape_k, generator=gen).to(device, torch.bfloat16)
    cos, sin = angles(b, s, d, device)
    outs, grads = [], []
    for fn in (opsmith.apply_rotary_pos_emb, opsmith.pybind.apply_rotary_pos_emb):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        got = fn(q, k, cos.float(), sin.float(), unsqueeze_dim=unsqueeze_dim)
        assert got[0].dtype == got[1].dtype == torch.float32
        dq = torch.linspace(-1, 1, got[0].numel(), device=device).view_as(got[0])
        dk = torch.linspace(1, -1, got[1].numel(), device=device).view_as(got[1])
        outs.append(got)
        grads.append(torch.autograd.grad(got, (q, k), (dq, dk)))
    for a, b_ in zip(outs[0] + grads[0], outs[1] + grads[1]):
        assert torch.equal(a, b_)
    with pytest.raises(RuntimeError, match=r"^opsmith.pybind.apply_rotary_pos_emb: unsqueeze_dim must be 1"):
        opsmith.pybind.apply_rotary_pos_emb(q0, k0, cos, sin, unsqueeze_dim=0)


@requires_hf
def test_hf_float32_cos_beside_bfloat16_q_promotes_like_hf():
    q, k = torch.randn(1, 2, 3, 8, dtype=torch.bfloat16), torch.randn(1, 1, 3, 8, dtype=torch.bfloat16)
    cos, sin = angles(1, 3, 8, "cpu")
    got = opsmith.apply_rotary_pos_emb(q, k, cos.float(), sin.float())
    want = hf_apply_rotary_pos_emb(q, k, cos.float(), sin.float())
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.float32
        close(g, w, torch.float32, "promoted")


@requires_hf
@pytest.mark.parametrize("rope_type", ["default", "llama3"])
def test_rotary_embedding_matches_llama(rope_type):
    params = {"rope_type": rope_type, "rope_theta": 500000.0}
    if rope_type == "llama3":
        params.update(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    config = LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=131072,
                         rope_parameters=params)
    theirs = LlamaRotaryEmbedding(config)
    ours = opsmith.nn.RotaryEmbedding.from_config(config)
    kw = {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")}
    direct = opsmith.nn.RotaryEmbedding(128, 131072, base=500000.0, rope_type=rope_type, **kw)
    assert torch.equal(ours.inv_freq, theirs.inv_freq) and torch.equal(direct.inv_freq, theirs.inv_freq)
    assert "inv_freq" not in ours.state_dict()  # non-persistent, as theirs
    pos = torch.tensor([[0, 1, 7, 100, 8191, 8192, 65000, 131071]])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.empty(0, dtype=dtype)
        for a, b in zip(ours(x, pos), theirs(x, pos)):
            assert a.dtype == b.dtype == dtype and torch.equal(a, b)
    if rope_type == "llama3":  # the scaling did something
        plain = opsmith.nn.RotaryEmbedding(128, base=500000.0)
        assert not torch.equal(plain.inv_freq, ours.inv_freq)


def test_rotary_embedding_interleaved_and_cache():
    emb = opsmith.nn.RotaryEmbedding(16, interleaved=True)
    cos, sin = emb.cache(10)
    assert cos.shape == (10, 16) and torch.equal(cos[:, 0::2], cos[:, 1::2])
    half = opsmith.nn.RotaryEmbedding(16)
    hc, _ = half.cache(10)
    assert torch.equal(hc[:, :8], hc[:, 8:]) and torch.equal(hc[:, :8], cos[:, 0::2])


# --- layouts, views, cos/sin forms ---------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("inplace", [False, True])
def test_fused_qkv_views(device, layout, interleaved, inplace):
    # q, k, v as views into one projection [B, S, (Hq + 2 Hk) D]: read (and
    # in place written) without a copy; v is never touched
    gen = torch.Generator().manual_seed(1)
    b, s, hq, hk, d = 2, 5, 4, 2, 32
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, generator=gen).to(device)
    before = qkv.clone()
    q, k, v = qkv.split([hq * d, hk * d, hk * d], -1)
    q, k = q.view(b, s, hq, d), k.view(b, s, hk, d)
    if layout == "bhsd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = angles(b, s, d, device, interleaved, gen)
    ref_q = reference(q, cos, sin, interleaved, layout)
    ref_k = reference(k, cos, sin, interleaved, layout)
    out_q, out_k = opsmith.apply_rotary(q, k, cos, sin, interleaved=interleaved, layout=layout, inplace=inplace)
    close(out_q, ref_q, torch.float32, "q")
    close(out_k, ref_k, torch.float32, "k")
    if inplace:
        assert out_q is q and out_k is k
        assert torch.equal(qkv[..., (hq + hk) * d:], before[..., (hq + hk) * d:]), "v was written"
    else:
        assert torch.equal(qkv, before), "out of place wrote into its inputs"


@pytest.mark.parametrize("form", ["[S,D]", "[1,S,D]", "[B,S,D]", "cache+[B,S]", "cache+[S]", "cache+[1,S]"])
def test_cos_sin_forms(device, form):
    gen = torch.Generator().manual_seed(2)
    b, s, h, d = 3, 6, 2, 16
    q = torch.randn(b, h, s, d, generator=gen).to(device)
    if form.startswith("cache"):
        max_pos = 20
        cache_cos, cache_sin = angles(1, max_pos, d, device, gen=gen)
        cache_cos, cache_sin = cache_cos[0], cache_sin[0]
        shape = {"cache+[B,S]": (b, s), "cache+[S]": (s,), "cache+[1,S]": (1, s)}[form]
        pos = torch.randint(0, max_pos, shape, generator=gen).to(device)
        full_pos = pos.expand(b, s) if pos.dim() == 2 else pos[None].expand(b, s)
        cos, sin = cache_cos[full_pos], cache_sin[full_pos]
        got, none = opsmith.apply_rotary(q, None, cache_cos, cache_sin, pos)
    else:
        cos, sin = angles(b if form == "[B,S,D]" else 1, s, d, device, gen=gen)
        cos, sin = cos.expand(b, s, d), sin.expand(b, s, d)
        c, sn = {"[S,D]": (cos[0], sin[0]), "[1,S,D]": (cos[:1], sin[:1]), "[B,S,D]": (cos, sin)}[form]
        got, none = opsmith.apply_rotary(q, None, c, sn)
    assert none is None
    close(got, reference(q, cos, sin), torch.float32, form)


def test_gptj_interleaved_partial_rotary():
    # GPT-J: rotary_dim 64 of a 256 head, every frequency repeated in place
    gen = torch.Generator().manual_seed(3)
    b, s, h, d, r = 2, 4, 3, 256, 64
    q = torch.randn(b, s, h, d, generator=gen)
    theta = torch.rand(b, s, r // 2, generator=gen) * 6
    sin_half, cos_half = theta.sin(), theta.cos()
    # their formula: x * cos + rotate_every_two(x) * sin on the first r dims
    cos = torch.repeat_interleave(cos_half, 2, -1)[:, :, None]
    sin = torch.repeat_interleave(sin_half, 2, -1)[:, :, None]
    want = torch.cat([q[..., :r] * cos + rotate_every_two(q[..., :r]) * sin, q[..., r:]], -1)
    got, _ = opsmith.apply_rotary(q, None, cos[:, :, 0], sin[:, :, 0], interleaved=True, rotary_dim=r,
                                  layout="bshd")
    close(got, want, torch.float32, "gptj")


def test_backward_is_rotation_by_minus_theta():
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 5, 8, generator=gen, dtype=torch.float64)
    cos, sin = angles(1, 5, 8, "cpu", gen=gen, dtype=torch.float64)
    dq = torch.randn_like(q)
    back = torch.ops.opsmith.rotary_bwd(dq, None, cos, sin)[0]
    assert torch.allclose(back, opsmith.apply_rotary(dq, None, cos, -sin)[0], atol=1e-14)
    # and the round trip is the identity (cos^2 + sin^2 = 1)
    assert torch.allclose(torch.ops.opsmith.rotary_bwd(opsmith.apply_rotary(q, None, cos, sin)[0], None,
                                                       cos, sin)[0], q, atol=1e-13)


def test_hf_drop_in_keeps_the_projections_order(device):
    # Hugging Face's q_proj(h).view(B, S, H, D).transpose(1, 2): the drop-in's
    # outputs and the gradients it returns keep the [B, S, H, D] order (as
    # Hugging Face's elementwise rotation does), so the projections' backward
    # reads the gradient as a view, no copy; other layouts are as before
    gen = torch.Generator().manual_seed(12)
    B, S, H, Hk, D = 2, 5, 4, 2, 16
    hq = torch.randn(B, S, H * D, generator=gen).to(device).requires_grad_()
    hk = torch.randn(B, S, Hk * D, generator=gen).to(device).requires_grad_()
    q, k = hq.view(B, S, H, D).transpose(1, 2), hk.view(B, S, Hk, D).transpose(1, 2)
    cos, sin = angles(B, S, D, device, gen=gen)
    q_out, k_out = opsmith.apply_rotary_pos_emb(q, k, cos, sin)
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()
    for got, x in ((q_out, q), (k_out, k)):
        close(got, reference(x.detach(), cos, sin), torch.float32, "transposed input")
    # gradients as attention returns them: in its inputs' layout
    dq = torch.randn(B, S, H, D, generator=gen).to(device).transpose(1, 2)
    dk = torch.randn(B, S, Hk, D, generator=gen).to(device).transpose(1, 2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        gq, gk = torch.autograd.grad((q_out, k_out), (hq, hk), (dq, dk))
    copies = [e.name for e in prof.events() if e.name in ("aten::copy_", "aten::clone", "aten::contiguous")]
    assert not copies, f"the backward copied: {copies}"
    for g, x, hx, dx in ((gq, q, hq, dq), (gk, k, hk, dk)):
        want = torch.autograd.grad(reference(x, cos, sin), hx, dx.double())[0]
        close(g, want, torch.float32, "gradient through the view")
    # contiguous [B, H, S, D] q and k: contiguous outputs, as before
    q2, k2 = opsmith.apply_rotary_pos_emb(q.contiguous(), k.contiguous(), cos, sin)
    assert q2.is_contiguous() and k2.is_contiguous()
    assert torch.equal(q2, q_out) and torch.equal(k2, k_out)
    # a q that is not 4-D still gets the op's own message, naming the layout asked for
    with pytest.raises(RuntimeError, match=r"q must be 4-D \[B, H, S, D\] \(layout 'bhsd'\)"):
        opsmith.apply_rotary_pos_emb(hq[0], hq[0], cos, sin)


ENTRIES = {
    "apply_rotary": lambda q, k, cos, sin, layout: opsmith.apply_rotary(q, k, cos, sin, layout=layout),
    "pybind": lambda q, k, cos, sin, layout: opsmith.pybind.apply_rotary(q, k, cos, sin, layout=layout),
    "k None": lambda q, k, cos, sin, layout: (opsmith.apply_rotary(q, None, cos, sin, layout=layout)[0], None),
}


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_outputs_keep_the_inputs_memory_order(entry, layout, device):
    # q and k whose memory is in the other layout's order (for "bhsd",
    # q_proj(h).view(B, S, H, D).transpose(1, 2); for "bshd", [B, H, S, D]
    # memory transposed): the outputs keep that order, the gradients too, and
    # the bits equal those of the same values given contiguous
    gen = torch.Generator().manual_seed(21)
    B, S, H, Hk, D = 2, 6, 4, 2, 16
    q_mem = torch.randn(B, S, H, D, generator=gen).to(device) if layout == "bhsd" else \
        torch.randn(B, H, S, D, generator=gen).to(device)
    k_mem = torch.randn(B, S, Hk, D, generator=gen).to(device) if layout == "bhsd" else \
        torch.randn(B, Hk, S, D, generator=gen).to(device)
    q_mem.requires_grad_()
    k_mem.requires_grad_()
    q, k = q_mem.transpose(1, 2), k_mem.transpose(1, 2)
    cos, sin = angles(B, S, D, device, gen=gen)
    q_out, k_out = ENTRIES[entry](q, k, cos, sin, layout)
    close(q_out, reference(q.detach(), cos, sin, layout=layout), torch.float32, "q")
    assert q_out.stride() == q.stride()
    q2, k2 = ENTRIES[entry](q.detach().contiguous(), k.detach().contiguous(), cos, sin, layout)
    assert q2.is_contiguous() and torch.equal(q2, q_out)
    outs, mems, dys = [q_out], [q_mem], [torch.randn(q_mem.shape, generator=gen).to(device).transpose(1, 2)]
    if k_out is not None:
        close(k_out, reference(k.detach(), cos, sin, layout=layout), torch.float32, "k")
        assert k_out.stride() == k.stride() and torch.equal(k2, k_out)
        outs.append(k_out), mems.append(k_mem)
        dys.append(torch.randn(k_mem.shape, generator=gen).to(device).transpose(1, 2))
    grads = torch.autograd.grad(outs, mems, dys)
    for g, m, dy in zip(grads, mems, dys):
        assert g.is_contiguous()  # as the memory it flows back to
        want = torch.autograd.grad(reference(m.transpose(1, 2), cos, sin, layout=layout), m, dy.double())[0]
        close(g, want, torch.float32, "gradient")


def test_memory_order_path_keeps_the_callers_layout_in_errors():
    # a k that does not fit q: the message names the layout passed, not the
    # one the memory order would have used
    q = torch.randn(2, 6, 4, 16).transpose(1, 2)
    k = torch.randn(2, 5, 2, 16).transpose(1, 2)
    cos, sin = angles(2, 6, 16, "cpu")
    with pytest.raises(RuntimeError, match="layout 'bhsd'"):
        opsmith.apply_rotary(q, k, cos, sin)


def test_gqa_and_k_gradient_only(device):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 8, 3, 16, generator=gen).to(device).requires_grad_()
    k = torch.randn(2, 2, 3, 16, generator=gen).to(device).requires_grad_()
    cos, sin = angles(2, 3, 16, device, gen=gen)
    q_out, k_out = opsmith.apply_rotary(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    dk = torch.randn_like(k_out)
    gq, gk = torch.autograd.grad(k_out, (q, k), dk, allow_unused=True)
    assert gq is None or not gq.any()
    want = torch.autograd.grad(reference(k, cos, sin), k, dk.double())[0]
    close(gk, want, torch.float32, "dk alone")


# --- in place ------------------------------------------------------------------------


def test_inplace_matches_out_of_place_and_bumps_version(device):
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 5, 32, generator=gen).to(device, torch.bfloat16)
    k = torch.randn(2, 1, 5, 32, generator=gen).to(device, torch.bfloat16)
    cos, sin = angles(2, 5, 32, device, gen=gen)
    cos, sin = cos.float(), sin.float()  # a float32 table beside bfloat16 q
    want_q, want_k = opsmith.apply_rotary(q, k, cos, sin)
    v = q._version
    q2, k2 = opsmith.apply_rotary(q, k, cos, sin, inplace=True)
    assert q2 is q and k2 is k and q._version > v
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    q3 = q.clone()
    opsmith.pybind.apply_rotary(q3, None, cos, sin, inplace=True)
    assert torch.equal(q3, opsmith.apply_rotary(q, None, cos, sin)[0])


def test_inplace_refuses_autograd():
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    cos, sin = angles(1, 3, 8, "cpu")
    with pytest.raises(RuntimeError, match=r"^rotary: inplace=True does not support autograd"):
        opsmith.apply_rotary(q, None, cos.float(), sin.float(), inplace=True)
    with pytest.raises(RuntimeError, match=r"inplace=True does not support autograd"):
        opsmith.pybind.apply_rotary(q, None, cos.float(), sin.float(), inplace=True)


def test_inplace_refuses_overlapping_q_and_k():
    buf = torch.randn(1, 3, 2, 8)
    cos, sin = angles(1, 2, 8, "cpu")
    q, k = buf[:, :2], buf[:, 1:]  # share head 1
    with pytest.raises(RuntimeError, match="overlaps"):
        opsmith.apply_rotary(q, k, cos.float(), sin.float(), inplace=True)
    with pytest.raises(RuntimeError, match="must not have elements sharing memory"):
        opsmith.apply_rotary(buf[:, :1].expand(1, 3, 2, 8), None, cos.float(), sin.float(), inplace=True)


# --- arguments ----------------------------------------------------------------------


def test_argument_errors():
    q = torch.randn(1, 2, 3, 8)
    cos, sin = [t.float() for t in angles(1, 3, 8, "cpu")]
    with pytest.raises(RuntimeError, match=r"^rotary: layout must be 'bhsd' or 'bshd', got 'sbhd'"):
        opsmith.apply_rotary(q, None, cos, sin, layout="sbhd")
    with pytest.raises(RuntimeError, match=r"^rotary: cos must have rotary_dim \(4\) values"):
        opsmith.apply_rotary(q, None, cos, sin, rotary_dim=4)
    with pytest.raises(RuntimeError, match=r"^rotary: cos must have q's dtype \(Float\) or float32"):
        opsmith.apply_rotary(q, None, cos.double(), sin.double())
    with pytest.raises(RuntimeError, match=r"^rotary: position_ids must be int64"):
        opsmith.apply_rotary(q, None, cos[0], sin[0], torch.zeros(1, 3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"^rotary: cos and sin must not require grad"):
        opsmith.apply_rotary(q, None, cos.requires_grad_(), sin)
    with pytest.raises(RuntimeError, match=r"^rotary: torch.func.vmap is not supported"):
        torch.func.vmap(lambda x: opsmith.apply_rotary(x, None, cos.detach(), sin)[0])(q[None])


def test_position_out_of_range_cpu():
    q = torch.randn(1, 1, 2, 8)
    cache = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match=r"position_ids\[0, 1\] = 4 is outside \[0, max_pos = 4\)"):
        opsmith.apply_rotary(q, None, cache, cache, torch.tensor([[0, 4]]))


@requires_cuda
def test_position_out_of_range_cuda_gives_nan_row():
    q = torch.randn(1, 2, 2, 8, device="cuda")
    cache = torch.randn(4, 4, device="cuda")
    out = opsmith.apply_rotary(q, None, cache, cache, torch.tensor([[1, 9]], device="cuda"))[0]
    assert torch.isfinite(out[:, :, 0]).all()
    assert torch.isnan(out[:, :, 1, :4]).all(), "the rotated dims of a bad position must be NaN"
    assert torch.equal(out[:, :, 1, 4:], q[:, :, 1, 4:])


@requires_cuda
def test_position_out_of_range_cuda_flat_plan():
    # rows enough for the flat kernel at 8 heads a thread (not the short-batch plans)
    gen = torch.Generator().manual_seed(31)
    s = 8192
    q = torch.randn(1, 12, s, 64, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(1, 4, s, 64, generator=gen).to("cuda", torch.bfloat16)
    cc, sc = angles(1, 64, 64, "cuda", gen=gen)
    pos = torch.randint(0, 64, (1, s), generator=gen).to("cuda")
    bad = torch.zeros(s, dtype=torch.bool, device="cuda")
    bad[::97] = True
    pos[0, bad] = 64 + torch.arange(int(bad.sum()), device="cuda")
    cache = (cc[0].to(torch.bfloat16), sc[0].to(torch.bfloat16))
    got_q, got_k = opsmith.apply_rotary(q, k, *cache, pos)
    good = pos[0].clamp(max=63)
    for got, x in ((got_q, q), (got_k, k)):
        assert torch.isnan(got[:, :, bad]).all(), "every element of a bad position's rows must be NaN"
        want = reference(x, cache[0][good][None], cache[1][good][None])
        close(got[:, :, ~bad], want[:, :, ~bad], torch.bfloat16, "the good rows")


# --- the CUDA kernel's paths ---------------------------------------------------------


CUDA_SHAPES = [  # (B, S, Hq, Hk, D, R)
    (2, 17, 8, 2, 128, 128), (1, 1, 32, 8, 128, 128), (3, 5, 4, 4, 64, 64), (2, 9, 4, 1, 256, 256),
    (2, 7, 3, 1, 80, 32), (2, 5, 2, 2, 6, 6), (1, 33, 5, 3, 18, 10), (2, 3, 4, 0, 130, 130),
    (1, 300, 2, 1, 96, 96), (2, 4, 40, 8, 128, 64),
    # past the short-batch plans: the flat kernel at 8 (6, 16) heads a thread, with a q head
    # count no multiple of 8 beside k's 4, partial rotary; and without k
    (2, 4096, 12, 4, 64, 48), (1, 8192, 20, 0, 64, 64),
]


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("variant", ["bhsd", "bshd-view", "fused", "cache", "misaligned", "f32-cos"])
def test_cuda_against_float64(dtype, shape, interleaved, variant):
    b, s, hq, hk, d, r = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, interleaved, variant)).encode()))
    layout = "bhsd"
    q = torch.randn(b, hq, s, d, generator=gen).to("cuda", dtype)
    k = torch.randn(b, hk, s, d, generator=gen).to("cuda", dtype) if hk else None
    cos, sin = angles(b, s, r, "cuda", interleaved, gen)
    pos, table = None, (cos, sin)
    if variant == "bshd-view":
        layout = "bshd"
        q = q.transpose(1, 2)
        k = k.transpose(1, 2) if k is not None else None
    elif variant == "fused":
        layout = "bshd"
        qkv = torch.randn(b, s, (hq + 2 * max(hk, 1)) * d + 8, generator=gen).to("cuda", dtype)
        q = qkv[..., :hq * d].view(b, s, hq, d)
        k = qkv[..., hq * d:(hq + hk) * d].view(b, s, hk, d) if hk else None
    elif variant == "cache":
        max_pos = s + 11
        cc, sc = angles(1, max_pos, r, "cuda", interleaved, gen)
        pos = torch.randint(0, max_pos, (b, s), generator=gen).to("cuda")
        table = (cc[0], sc[0])
        cos, sin = cc[0][pos], sc[0][pos]
    elif variant == "misaligned":  # one element off every 16-byte boundary: the scalar kernel
        buf = torch.randn(q.numel() + 1, generator=gen).to("cuda", dtype)
        q = buf[1:].view(q.shape)
    if variant != "f32-cos" or dtype not in (torch.float16, torch.bfloat16):
        table = tuple(t.to(dtype) for t in table)
        cos, sin = cos.to(dtype), sin.to(dtype)
    else:
        table = tuple(t.float() for t in table)
    ref_q = reference(q, cos, sin, interleaved, layout)
    ref_k = reference(k, cos, sin, interleaved, layout) if k is not None else None
    for inplace in (False, True):
        qi = q.clone() if inplace else q
        ki = k.clone() if (inplace and k is not None) else k
        got_q, got_k = opsmith.apply_rotary(qi, ki, *table, pos, interleaved=interleaved, layout=layout,
                                            inplace=inplace)
        close(got_q, ref_q, dtype, f"q inplace={inplace}")
        if k is not None:
            close(got_k, ref_k, dtype, f"k inplace={inplace}")
        else:
            assert got_k is None
    # backward: the transpose, against float64 autograd
    qg = q.detach().clone().requires_grad_()
    kg = k.detach().clone().requires_grad_() if k is not None else None
    outs = opsmith.apply_rotary(qg, kg, *table, pos, interleaved=interleaved, layout=layout)
    dq = torch.randn(outs[0].shape, generator=gen).to("cuda", dtype)
    if kg is not None:
        dk = torch.randn(outs[1].shape, generator=gen).to("cuda", dtype)
        g = torch.autograd.grad(outs, (qg, kg), (dq, dk))
    else:
        g = torch.autograd.grad(outs[0], qg, dq)
    q64 = q.detach().double().requires_grad_()
    r = torch.autograd.grad(reference(q64, cos, sin, interleaved, layout), q64, dq.double())[0]
    close(g[0], r, dtype, "dq")
    if kg is not None:
        k64 = k.detach().double().requires_grad_()
        r = torch.autograd.grad(reference(k64, cos, sin, interleaved, layout), k64, dk.double())[0]
        close(g[1], r, dtype, "dk")


@requires_cuda
def test_cuda_route_a_equals_route_b_and_cpu_close():
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(2, 8, 33, 128, generator=gen).to(torch.bfloat16)
    k = torch.randn(2, 2, 33, 128, generator=gen).to(torch.bfloat16)
    cos, sin = [t.to(torch.bfloat16) for t in angles(2, 33, 128, "cpu", gen=gen)]
    a = opsmith.apply_rotary(q.cuda(), k.cuda(), cos.cuda(), sin.cuda())
    b = opsmith.pybind.apply_rotary(q.cuda(), k.cuda(), cos.cuda(), sin.cuda())
    c = opsmith.apply_rotary(q, k, cos, sin)
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y)
        close(x.cpu(), z, torch.bfloat16, "CUDA vs CPU")


@requires_cuda
def test_cuda_more_than_2_31_elements():
    # q of 2^31 + 384 elements (int64 offsets everywhere); rows at both ends checked
    if torch.cuda.get_device_properties(0).total_memory < 40e9:
        pytest.skip("needs a CUDA GPU with more than 40 GB")
    s, d = (1 << 24) + 3, 128
    q = torch.randn(1, s, 1, d, device="cuda", dtype=torch.bfloat16)
    cache_cos, cache_sin = angles(1, 64, d, "cuda")
    pos = torch.arange(s, device="cuda") % 64
    out, _ = opsmith.apply_rotary(q, None, cache_cos[0], cache_sin[0], pos, layout="bshd")
    wants = {}
    for rows in (slice(0, 5), slice(s - 5, s)):
        p = pos[rows]
        wants[rows.start] = want = reference(q[:, rows], cache_cos[0][p][None], cache_sin[0][p][None], layout="bshd")
        close(out[:, rows], want, torch.bfloat16, f"rows {rows}")
    del out
    opsmith.apply_rotary(q, None, cache_cos[0], cache_sin[0], pos, layout="bshd", inplace=True)
    for start, want in wants.items():
        close(q[:, start:start + 5], want, torch.bfloat16, f"in place, rows from {start}")
