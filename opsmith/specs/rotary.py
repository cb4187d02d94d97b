"""The op spec of the rotary embedding: how every harness (reliability
tests, sanitizer, benchmark, docs/reliability.md's table) reaches
torch.ops.opsmith.rotary_*.

One call covers both conventions: from q [B, Hq, S, D], k [B, Hk, S, D]
(grouped-query heads) it returns rotate-half over the whole head with
Hugging Face's per-(b, s) cos/sin ([B, S, D], layout "bhsd"), and
interleaved partial rotary with a [max_pos, R] cache indexed by per-row
position_ids on the "bshd" strided views q.transpose(1, 2), k.transpose(1, 2)
(no copy). The shape (*, n) the harnesses pass sets S (the rows, at most 9)
and D (n, made even, at most 40)."""
import math

import torch

from ..ops.rotary import RotaryEmbedding, apply_rotary, apply_rotary_pybind
from . import SUPPORTED, BenchSpec, DocRow, Hostile, IndexInput, OpSpec, compiled, randn

_TOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}

B, HQ, HK = 2, 3, 1


def _sizes(shape):
    shape = tuple(shape)
    rows = 1
    for s in shape[:-1]:
        rows *= s
    n = shape[-1] if shape else 1
    d = 2 * max(1, min(n, 40) // 2)
    r = max(2, (d // 2) // 2 * 2)  # partial: about half the head, even
    return min(rows, 9), d, r


def _angles(shape, generator, device):
    return (torch.rand(shape, generator=generator, device=generator.device) * 2 * math.pi).to(device)


def _make_inputs(shape, dtype, device, generator):
    s, d, r = _sizes(shape)
    max_pos = s + 7
    theta = _angles((B, s, d // 2), generator, device)
    theta = torch.cat([theta, theta], -1)  # Hugging Face's duplicated halves
    cache = torch.repeat_interleave(_angles((max_pos, r // 2), generator, device), 2, -1)  # GPT-J's repeated pairs
    pos = torch.randint(0, max_pos, (B, s), generator=generator, device=generator.device).to(device)
    return {
        "q": randn((B, HQ, s, d), generator, dtype, device),
        "k": randn((B, HK, s, d), generator, dtype, device),
        "cos": theta.cos().to(dtype), "sin": theta.sin().to(dtype),
        "cos_cache": cache.cos().to(dtype), "sin_cache": cache.sin().to(dtype),
        "position_ids": pos,
    }


def _calls(fn, inputs):
    q, k = inputs["q"], inputs["k"]
    q1, k1 = fn(q, k, inputs["cos"], inputs["sin"])
    q2, k2 = fn(q.transpose(1, 2), k.transpose(1, 2), inputs["cos_cache"], inputs["sin_cache"],
                inputs["position_ids"], interleaved=True, layout="bshd")
    return q1, k1, q2, k2


def _call(inputs):
    return _calls(apply_rotary, inputs)


def _call_pybind(inputs):
    return _calls(apply_rotary_pybind, inputs)


def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def rotate_every_two(x):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), -1).flatten(-2)


def _math(inputs, cast):
    q, k = cast(inputs["q"]), cast(inputs["k"])
    cos, sin = cast(inputs["cos"])[:, None], cast(inputs["sin"])[:, None]
    q1, k1 = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    pos = inputs["position_ids"].cpu() if cast(inputs["q"]).device.type == "cpu" else inputs["position_ids"]
    cc, sc = cast(inputs["cos_cache"])[pos][:, :, None], cast(inputs["sin_cache"])[pos][:, :, None]
    r = cc.shape[-1]

    def gptj(x):
        x = x.transpose(1, 2)
        xr, rest = x[..., :r], x[..., r:]
        return torch.cat([xr * cc + rotate_every_two(xr) * sc, rest], -1)

    return q1, k1, gptj(q), gptj(k)


def _reference(inputs, dtype=None):
    return _math(inputs, lambda t: t.to(torch.float64))


def _torch_equivalent(inputs):
    return _math(inputs, lambda t: t.detach().cpu().float())


def _opcheck(inputs):
    q, k, cos, sin = inputs["q"], inputs["k"], inputs["cos"], inputs["sin"]
    cc, sc, pos = inputs["cos_cache"], inputs["sin_cache"], inputs["position_ids"]
    fwd, bwd, inplace = (torch.ops.opsmith.rotary_fwd.default, torch.ops.opsmith.rotary_bwd.default,
                         torch.ops.opsmith.rotary_.default)
    qd, kd = q.detach(), k.detach()
    return [(fwd, (q, k, cos, sin, None, False, None, "bhsd")),
            (fwd, (q, None, cos, sin, None, False, None, "bhsd")),
            (fwd, (q.transpose(1, 2), k.transpose(1, 2), cc, sc, pos, True, None, "bshd")),
            (bwd, (torch.randn_like(qd), torch.randn_like(kd), cos, sin, None, False, None, "bhsd")),
            (inplace, (qd.clone(), kd.clone(), cos, sin, None, False, None, "bhsd")),
            (inplace, (qd.clone().transpose(1, 2), None, cc, sc, pos, True, None, "bshd"))]


# hostile inputs: float32, small, built on the CPU and moved

def _base(device, gen, **extra):
    inputs = _make_inputs((5, 16), torch.float32, "cpu", gen)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    inputs.update(extra)
    return inputs


def _edited(device, gen, name, index, value):
    inputs = _base("cpu", gen)
    inputs[name][index] = value
    return {k: v.to(device) for k, v in inputs.items()}


def _nan_stays_in_head(spec, inputs, out):
    # a NaN in q[0, 1, 2, 3]: only head 1 of (b 0, s 2) turns NaN (its pair partner too), nothing else
    q1 = out[0].detach().cpu()
    bad = ~torch.isfinite(q1)
    assert bad[0, 1, 2].any() and bad.sum() == bad[0, 1, 2].sum(), "a NaN must stay in its head vector"
    assert torch.isfinite(out[1].detach().cpu()).all(), "a NaN in q must not reach k"


_HOSTILE = (
    Hostile("nan_in_q", lambda d, g: _edited(d, g, "q", (0, 1, 2, 3), math.nan),
            "NaN in that element and its rotation partner only (q, head 1, (b 0, s 2)); k finite",
            input="one NaN in q", check=_nan_stays_in_head),
    Hostile("inf_in_cos", lambda d, g: _edited(d, g, "cos", (1, 0, 2), math.inf),
            "±Inf/NaN exactly where x · cos does (that (b, s) and dim, every head of q and k)",
            input="+Inf in cos"),
    Hostile("integer_q",
            lambda d, g: {**_base(d, g), "q": torch.randint(-5, 5, (2, 3, 5, 16), generator=g).to(d)},
            "`rotary: q must be float64, float32, float16 or bfloat16, got Long`", input="int64 q",
            raises=r"^rotary: q must be float64, float32, float16 or bfloat16, got Long"),
    Hostile("k_dtype_differs", lambda d, g: {**_base(d, g), "k": _base(d, g)["k"].double()},
            "`rotary: k must have q's dtype (Float), got Double`", input="float32 q, float64 k",
            raises=r"^rotary: k must have q's dtype \(Float\), got Double"),
    Hostile("q_3d", lambda d, g: {**_base(d, g), "q": _base(d, g)["q"][0]},
            "`rotary: q must be 4-D [B, H, S, D] (layout 'bhsd'), got shape [3, 5, 16]`", input="3-D q",
            raises=r"^rotary: q must be 4-D \[B, H, S, D\]"),
    Hostile("cos_wrong_seq", lambda d, g: {**_base(d, g), "cos": _base(d, g)["cos"][:, :4], "sin": _base(d, g)["sin"][:, :4]},
            "`rotary: cos must be [S, rotary_dim] or [B, S, rotary_dim] with S = 5, ...`", input="cos for 4 positions, q for 5",
            raises=r"^rotary: cos must be \[S, rotary_dim\] or \[B, S, rotary_dim\] with S = 5"),
    Hostile("odd_rotary_dim", lambda d, g: {**_base(d, g), "cos": _base(d, g)["cos"][..., :5], "sin": _base(d, g)["sin"][..., :5]},
            "`rotary: rotary_dim (cos's last dim, 5) must be even and in [2, head_dim (16)]`", input="cos of 5 values",
            raises=r"^rotary: rotary_dim \(cos's last dim, 5\) must be even"),
    Hostile("cos_on_cpu_q_on_cuda", lambda d, g: {**_base("cuda", g), "cos": _base("cpu", g)["cos"]},
            "`rotary: cos and sin must be on q's device (cuda:0), got cpu and cuda:0`", input="cos on the CPU, q on CUDA",
            raises=r"^rotary: cos and sin must be on q's device", cuda_only=True),
)


# --- benchmark -----------------------------------------------------------------------
# Shapes are (rows, n) = (batch * seq tokens, head_dim) with 32 query and 8
# key/value heads (Llama 3 8B), layout [B, H, S, D], batch 4 (1 when rows is
# not a multiple of 4); cos/sin [B, S, D] in q's dtype as LlamaRotaryEmbedding
# gives them. The anchor shape is (16384, 128): q [4, 32, 4096, 128], k [4, 8, 4096, 128].
BENCH_HQ, BENCH_HK = 32, 8
_cos_sin = {}


def _bsd(rows):
    b = 4 if rows % 4 == 0 else 1
    return b, rows // b


def _bench_cos_sin(b, s, n, dtype, device):
    key = (b, s, n, dtype, str(device))
    if key not in _cos_sin:
        _cos_sin.clear()
        emb = RotaryEmbedding(n, max_position_embeddings=s).to(device)
        pos = torch.arange(s, device=device)[None].expand(b, s)
        _cos_sin[key] = emb(torch.empty(0, dtype=dtype, device=device), pos)
    return _cos_sin[key]


def _bench_inputs(rows, n, dtype, device):
    b, s = _bsd(rows)
    q = torch.randn(b, BENCH_HQ, s, n, dtype=dtype, device=device)
    k = torch.randn(b, BENCH_HK, s, n, dtype=dtype, device=device)
    return {"q": q, "k": k, "dy": (torch.randn_like(q), torch.randn_like(k))}


def _hf_eager():
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    except ImportError:  # the same formula
        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    return apply_rotary_pos_emb


def _provider(make):
    def factory(n, dtype, device):
        inner = make(n, dtype, device)

        def fn(q, k):
            cos, sin = _bench_cos_sin(q.shape[0], q.shape[2], n, dtype, q.device)
            return inner(q, k, cos, sin)
        return fn
    return factory


def _liger(n, dtype, device):
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    return liger_rotary_pos_emb


_BENCH = BenchSpec(
    make_inputs=_bench_inputs,
    grad_inputs=["q", "k"],
    providers={
        "opsmith": _provider(lambda n, dt, dev: apply_rotary),
        "opsmith_pybind": _provider(lambda n, dt, dev: apply_rotary_pybind),
        "torch_eager": _provider(lambda n, dt, dev: _hf_eager()),
        "torch_compile": _provider(lambda n, dt, dev: compiled(("rotary", n), _hf_eager())),
        "liger": _provider(_liger),
    },
    # forward: read q, k, cos, sin; write q, k. backward: read dq, dk, cos, sin; write dq, dk
    fwd_bytes=lambda rows, n, s: (2 * (BENCH_HQ + BENCH_HK) + 2) * rows * n * s,
    fwdbwd_bytes=lambda rows, n, s: 2 * (2 * (BENCH_HQ + BENCH_HK) + 2) * rows * n * s,
    hidden_sizes=[64, 128, 256],
    # batch 4, seq 1 (decoding) to 32768
    row_counts=[4, 64, 1024, 4096, 16384, 65536, 131072],
    quick_shapes=[(16384, 128), (16384, 64), (16384, 256), (131072, 128), (1024, 128), (4, 128)],
    # tokens x head_dim (32 + 8 heads): a decode batch, a prefill, a long prefill
    cpu_shapes=[(4, 128), (1024, 128), (4096, 128)],
    host_calls=None,
)


_DOC_ROWS = (
    DocRow("q [B, Hq, S, D] and k [B, Hk, S, D] with Hq != Hk; q.transpose(1, 2) views as layout 'bshd'",
           "one launch rotates both; the strided views are read without a copy; matches the float64 reference",
           "`test_reference`"),
    DocRow("views into a fused qkv projection [B, S, (Hq + 2 Hk) D], in place and out of place",
           "q and k rotated, v untouched; in place writes only q's and k's elements",
           "`tests/test_rotary.py::test_fused_qkv_*`"),
    DocRow("cos/sin [S, D], [1, S, D], [B, S, D]; a [max_pos, R] cache with position_ids [B, S] or [S]",
           "matches Hugging Face's apply_rotary_pos_emb and the float64 reference",
           "`tests/test_rotary.py::test_cos_sin_forms`"),
)


SPEC = OpSpec(
    name="rotary",
    make_inputs=_make_inputs,
    call=_call,
    call_pybind=_call_pybind,
    reference=_reference,
    torch_equivalent=_torch_equivalent,
    tolerance=_TOL.__getitem__,
    outputs=("q_half", "k_half", "q_interleaved", "k_interleaved"),
    grad_inputs=("q", "k"),
    index_inputs=(IndexInput("position_ids", high=lambda inputs: inputs["cos_cache"].shape[0]),),
    opcheck=_opcheck,
    # the op is linear in q and k: its backward is the same op transposed,
    # registered with autograd too, so every order of derivative works
    double_backward=SUPPORTED,
    double_backward_pybind=SUPPORTED,
    func_transforms={
        "grad": SUPPORTED,
        "vjp": SUPPORTED,
        "jvp": r"^rotary: forward-mode AD is not supported",
        "vmap": r"^rotary: torch.func.vmap is not supported",
    },
    func_transforms_pybind=r"^opsmith\.pybind\.apply_rotary: route A does not support torch\.func transforms",
    # outputs are products of two inputs (x and cos): float16 overflows at 1e4 as PyTorch's would
    max_scale=1.0,
    hostile=_HOSTILE,
    doc_rows=_DOC_ROWS,
    bench=_BENCH,
)
