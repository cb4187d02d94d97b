"""cross_entropy through every route: against torch.nn.functional.cross_entropy in
float64 for every option PyTorch has (weight, ignore_index, reductions,
label_smoothing; every dtype), z_loss and softcap against a float64 formula,
the fused gradient path (the backward scales the forward's gradient; in place
only when the graph is not kept), inplace_grad, out-of-range targets,
everything ignored, errors naming the argument, gradcheck, opcheck,
torch.compile(fullgraph=True), CUDA graphs, route A against route B, the
module. CUDA cases are collected everywhere and skipped without a GPU."""
import itertools

import pytest
import torch
import torch.nn.functional as F

import opsmith
import opsmith.pybind
from opsmith.ops.cross_entropy import CrossEntropyLoss, cross_entropy, cross_entropy_pybind
from opsmith.specs.cross_entropy import formula

HAS_CUDA = torch.cuda.is_available()
CUDA = pytest.mark.skipif(not HAS_CUDA, reason="CUDA is not available")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make(rows, n, dtype, device, ignore_frac=0.25, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=g) * scale).to(dtype).to(device)
    t = torch.randint(0, n, (rows,), generator=g)
    t = torch.where(torch.rand(rows, generator=g) < ignore_frac, -100, t).to(device)
    w = (0.5 + torch.rand(n, generator=g)).to(dtype).to(device)
    return x, t, w


def assert_close(got, want, dtype, what):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN pattern differs"
    ok = ~torch.isnan(want)
    if not ok.any():
        return
    err = (got[ok] - want[ok]).abs().max().item()
    bound = TOL[dtype] * max(1.0, want[ok].abs().max().item())
    assert err <= bound, f"{what}: max|got - float64 reference| = {err:.3e} > {bound:.3e}"


def assert_grad_close(got, want, dtype, what):
    # gradients of a mean are small: relative to their largest element
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert not torch.isnan(got).any(), f"{what}: NaN (an element was not written?)"
    err = (got - want).abs().max().item()
    bound = TOL[dtype] * max(want.abs().max().item(), 1e-300)
    assert err <= bound, f"{what}: max|got - float64 reference| = {err:.3e} > {bound:.3e}"


def torch_reference(x, t, w, **kw):
    """F.cross_entropy on float64 copies: loss and d loss / d logits (incoming gradient g)."""
    xd = x.detach().double().requires_grad_()
    loss = F.cross_entropy(xd, t, None if w is None else w.double(), **kw)
    return loss, xd


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_torch(device, dtype):
    # every combination of the options PyTorch has, one small call each
    x, t, w = make(13, 301, dtype, device)
    for reduction, weighted, ls, ignore in itertools.product(("mean", "sum", "none"), (False, True), (0.0, 0.15),
                                                             (-100, 7)):
        tt = torch.where(torch.arange(13, device=device) % 4 == 2, ignore, t.clamp(min=0))
        kw = dict(ignore_index=ignore, reduction=reduction, label_smoothing=ls)
        what = f"{dtype} {reduction} weighted={weighted} ls={ls} ignore={ignore}"
        xg = x.clone().requires_grad_()
        loss = cross_entropy(xg, tt, w if weighted else None, **kw)
        ref, xd = torch_reference(x, tt, w if weighted else None, **kw)
        assert loss.dtype == dtype and loss.shape == ref.shape, what
        assert_close(loss, ref, dtype, what + " loss")
        g = torch.randn(ref.shape, dtype=torch.float64).to(device) if reduction == "none" else torch.tensor(1.7, dtype=torch.float64, device=device)
        (dx,) = torch.autograd.grad(loss, [xg], g.to(dtype))
        (dref,) = torch.autograd.grad(ref, [xd], g.to(dtype).double())
        assert dx.dtype == dtype and dx.shape == x.shape
        assert_grad_close(dx, dref, dtype, what + " dlogits")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_z_loss_and_softcap(device, dtype, reduction):
    x, t, w = make(9, 515, dtype, device, scale=20.0)
    kw = dict(ignore_index=-100, label_smoothing=0.1, z_loss=1e-3, softcap=15.0)
    xg = x.clone().requires_grad_()
    loss, zl = cross_entropy(xg, t, w, reduction=reduction, return_z_loss=True, **kw)
    xd = x.detach().double().requires_grad_()
    rows = formula(xd, t, w.double(), **kw)
    keep = t != -100
    lse = torch.logsumexp(15.0 * torch.tanh(xd / 15.0), -1)
    zrows = torch.where(keep, 1e-3 * lse * lse, 0.0)
    denom = w.double()[t[keep]].sum()
    ref, zref = {"none": (rows, zrows), "sum": (rows.sum(), zrows.sum()),
                 "mean": (rows.sum() / denom, zrows.sum() / denom)}[reduction]
    assert_close(loss, ref, dtype, "loss")
    assert_close(zl, zref, dtype, "z_loss part")
    assert not zl.requires_grad
    g = torch.rand(ref.shape, dtype=torch.float64, device=device) + 0.5
    (dx,) = torch.autograd.grad(loss, [xg], g.to(dtype))
    (dref,) = torch.autograd.grad(ref, [xd], g.to(dtype).double())
    assert_grad_close(dx, dref, dtype, "dlogits")


@pytest.mark.parametrize("device", DEVICES)
def test_wide_rows(device):
    # a Gemma-sized row on the CPU; CUDA also takes the unaligned (scalar) path
    rows = 2 if device == "cpu" else 6
    x, t, _ = make(rows, 262144, torch.bfloat16, device, ignore_frac=0.0)
    for xs in ((x,) if device == "cpu" else (x, torch.nn.functional.pad(x, (0, 3))[:, 1:262145])):
        xg = xs.detach().requires_grad_()  # a leaf with xs's strides (clone would make it dense)
        loss = cross_entropy(xg, t)
        ref, xd = torch_reference(xs, t, None)
        assert_close(loss, ref, torch.bfloat16, "loss")
        loss.backward()
        ref.backward()
        assert_grad_close(xg.grad, xd.grad, torch.bfloat16, "dlogits")


# CUDA's plans: a row a CTA in shared memory up to ~72 KB, clusters of 2, 4, 8
# CTAs for wider rows (bf16 128256: 4; 262144: 8; float64 262144: too wide, the
# streaming kernel), odd widths (one row: the on-chip kernel's tail; more: the
# streaming kernel), float32 logits scaled by 1e4 (the gradient's
# p = exp(y - max) / sum), every option PyTorch has, masked logits.
@CUDA
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n,scale,masked", [
    (4, 128256, 3.0, False), (2, 262144, 3.0, True), (1, 128257, 3.0, False), (3, 32000, 3.0, False),
    (9, 16384, 3.0, True), (14, 15631, 1e4, False), (3, 128256, 1e4, False),
], ids=str)
def test_cuda_on_chip_plans(dtype, rows, n, scale, masked):
    if scale > 100 and dtype in (torch.float16, torch.bfloat16):
        pytest.skip("logits scaled by 1e4: float32 and float64")
    x, t, w = make(rows, n, dtype, "cuda", ignore_frac=0.25 if rows > 3 else 0.0, seed=n + rows, scale=scale)
    if masked:
        x[:, 3::7] = -float("inf")
        x[torch.arange(rows, device="cuda"), t.clamp(min=0)] = 1.0  # the target's logit stays finite
    for weighted, ls, reduction in ((False, 0.0, "mean"), (True, 0.1, "sum"), (False, 0.0, "none")):
        if masked and ls > 0:
            continue  # smoothing over -inf logits is inf, as PyTorch
        kw = dict(reduction=reduction, label_smoothing=ls)
        what = f"{dtype} {rows}x{n} scale={scale} masked={masked} weighted={weighted} ls={ls} {reduction}"
        xg = x.clone().requires_grad_()
        loss = cross_entropy(xg, t, w if weighted else None, **kw)
        ref, xd = torch_reference(x, t, w if weighted else None, **kw)
        assert_close(loss, ref, dtype, what + " loss")
        g = torch.randn(ref.shape, dtype=torch.float64).to("cuda") if reduction == "none" else torch.tensor(1.0, dtype=torch.float64, device="cuda")
        (dx,) = torch.autograd.grad(loss, [xg], g.to(dtype))
        (dref,) = torch.autograd.grad(ref, [xd], g.to(dtype).double())
        assert_grad_close(dx, dref, dtype, what + " dlogits")


# More rows than clusters fit at once: each persistent cluster walks several
# rows, alternating its partial slots (bf16 128256: 4-CTA clusters, 262144:
# 8; 16384 and 1000: one-CTA rows, two slice stages), the
# gradient written over the logits too (inplace_grad), against float64. Plain:
# no weight, no smoothing (the kernel specialised for the common training call).
@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows,n", [(300, 128256), (80, 262144), (5000, 1000), (700, 16384)], ids=str)
@pytest.mark.parametrize("plain", [False, True], ids=["weighted-smoothed", "plain"])
def test_cuda_rows_walked_by_persistent_clusters(dtype, rows, n, plain):
    x, t, w = make(rows, n, dtype, "cuda", seed=rows + n)
    w, kw = (None, {}) if plain else (w, dict(label_smoothing=0.05))
    ref, xd = torch_reference(x, t, w, **kw)
    (dref,) = torch.autograd.grad(ref, [xd])
    what = f"{dtype} {rows}x{n}"
    xg = x.clone().requires_grad_()
    loss = cross_entropy(xg, t, w, **kw)
    assert_close(loss, ref, dtype, what + " loss")
    (dx,) = torch.autograd.grad(loss, [xg])
    assert_grad_close(dx, dref, dtype, what + " dlogits")
    # the same through inplace_grad: the gradient over the logits' own memory
    logits = x.clone().requires_grad_()
    h = logits * 1.0  # not a leaf: inplace_grad writes over it
    loss2 = cross_entropy(h, t, w, inplace_grad=True, **kw)
    assert torch.equal(loss2, loss)
    loss2.backward()
    assert torch.equal(logits.grad, dx)
    # without a gradient (the forward alone: the streaming kernel, a block a
    # row, where these walk slices of a row over a cluster) the loss sums in
    # another order: the same to within the loss dtype's last bits
    with torch.no_grad():
        alone = cross_entropy(x, t, w, **kw)
    eps = torch.finfo(loss.dtype).eps
    torch.testing.assert_close(alone, loss.detach(), rtol=4 * eps, atol=0)


# Logits far from zero (float32, offset by 1e6 and 3e7, ulp 0.06 and 2): the
# loss is (m - y_t) + log(sum), never lse - y_t through a rounded lse (which
# was 0.27 off a loss of 14 at 3e7 on the CPU), and the gradient's exp(y - m)
# takes y - m exactly; the plain call (Llama's), through one CTA a row
# (16384) and a cluster (128256) on CUDA.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset", [1e6, 3e7], ids=["1e6", "3e7"])
@pytest.mark.parametrize("rows,n", [(300, 16384), (150, 128256)], ids=str)
def test_logits_far_from_zero(device, offset, rows, n):
    x, t, _ = make(rows, n, torch.float32, device, seed=rows + n)
    x = x + offset
    ref, xd = torch_reference(x, t, None)
    (dref,) = torch.autograd.grad(ref, [xd])
    xg = x.clone().requires_grad_()
    loss = cross_entropy(xg, t)
    assert_close(loss, ref, torch.float32, f"offset {offset:g} loss")
    (dx,) = torch.autograd.grad(loss, [xg])
    assert_grad_close(dx, dref, torch.float32, f"offset {offset:g} {rows}x{n} dlogits")


# Label smoothing's term, sum_c w_c (lse - y_c), at the same offsets: formed
# from differences to a logit of the row (the CPU: its max; CUDA: its first),
# not as W lse - sum w y (two terms of ~1e11 whose difference is the answer:
# a loss of 14 came back 5 off at 1e6).
@pytest.mark.parametrize("offset", [1e6, 3e7], ids=["1e6", "3e7"])
@pytest.mark.parametrize("rows,n", [(300, 16384), (150, 128256), (64, 1000)], ids=str)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("device", DEVICES)
def test_label_smoothing_far_from_zero(device, offset, rows, n, weighted):
    x, t, w = make(rows, n, torch.float32, device, seed=rows + n)
    x, w = x + offset, w if weighted else None
    ref, xd = torch_reference(x, t, w, label_smoothing=0.1)
    (dref,) = torch.autograd.grad(ref, [xd])
    xg = x.clone().requires_grad_()
    loss = cross_entropy(xg, t, w, label_smoothing=0.1)
    assert_close(loss, ref, torch.float32, f"offset {offset:g} {rows}x{n} smoothed loss")
    (dx,) = torch.autograd.grad(loss, [xg])
    assert_grad_close(dx, dref, torch.float32, f"offset {offset:g} {rows}x{n} smoothed dlogits")


@pytest.mark.parametrize("device", DEVICES)
def test_shapes_and_layouts(device):
    x, t, w = make(24, 66, torch.float32, device)
    t = t.clamp(min=0)
    # [..., V] with target [...]; reduction none keeps the target's shape
    x3, t3 = x.view(2, 12, 66), t.view(2, 12)
    out = cross_entropy(x3, t3, reduction="none")
    assert out.shape == (2, 12)
    assert_close(out, F.cross_entropy(x.double(), t, reduction="none").view(2, 12), torch.float32, "3-D")
    # one row, unbatched, as PyTorch
    assert_close(cross_entropy(x[0], t[0]), F.cross_entropy(x[0].double(), t[0]), torch.float32, "1-D")
    base = torch.randn(66, 48, device=device)
    views = {"transposed": base.t()[:, :66], "sliced": base[:48, 1:40].t().contiguous()[:, :24].t(),
             "every_other_row": torch.randn(96, 66, device=device)[::2]}
    for name, v in views.items():
        tv = torch.randint(0, v.shape[-1], (v.shape[0],), device=device)
        vg = v.clone().requires_grad_() if name == "transposed" else v.requires_grad_()
        loss = cross_entropy(vg, tv, label_smoothing=0.1)
        ref, vd = torch_reference(v, tv, None, label_smoothing=0.1)
        assert_close(loss, ref, torch.float32, name)
        loss.backward()
        ref.backward()
        assert_grad_close(vg.grad, vd.grad, torch.float32, name + " dlogits")


@pytest.mark.parametrize("device", DEVICES)
def test_reductions_of_nothing(device):
    x = torch.empty(0, 8, device=device, requires_grad=True)
    t = torch.empty(0, dtype=torch.long, device=device)
    assert cross_entropy(x, t, reduction="none").shape == (0,)
    assert cross_entropy(x, t, reduction="sum").item() == 0.0
    assert torch.isnan(cross_entropy(x, t, reduction="mean"))
    assert torch.isnan(F.cross_entropy(x, t, reduction="mean"))  # what PyTorch gives


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [False, True])
def test_all_ignored(device, weighted):
    x, t, w = make(5, 33, torch.float32, device, ignore_frac=1.0)
    assert (t == -100).all()
    xg = x.clone().requires_grad_()
    loss = cross_entropy(xg, t, w if weighted else None, label_smoothing=0.1)
    ref = F.cross_entropy(x, t, w if weighted else None, label_smoothing=0.1)
    assert torch.isnan(loss) and torch.isnan(ref), "mean over no targets is NaN, as PyTorch"
    loss.backward()
    assert torch.equal(xg.grad, torch.zeros_like(x)), "ignored rows have zero gradient"
    assert cross_entropy(x, t, reduction="sum").item() == 0.0


def test_bad_target_cpu():
    x, t, _ = make(4, 10, torch.float32, "cpu", ignore_frac=0.0)
    t[2] = 10
    with pytest.raises(IndexError, match=r"^cross_entropy: target 10 \(row 2\) is out of range \[0, 10\)"):
        cross_entropy(x, t)
    t[2] = -3
    with pytest.raises(IndexError, match=r"target -3 \(row 2\)"):
        cross_entropy_pybind(x, t)


@CUDA
def test_bad_target_cuda():
    # no host synchronisation by default: that row is NaN and a device-side
    # flag is set; validate=True checks the flag (one sync) and raises
    x, t, _ = make(4, 10, torch.float32, "cuda", ignore_frac=0.0)
    t[2] = 12
    rows = cross_entropy(x, t, reduction="none")
    assert torch.isnan(rows[2]) and torch.isfinite(rows[[0, 1, 3]]).all()
    xg = x.clone().requires_grad_()
    loss = cross_entropy(xg, t)
    assert torch.isnan(loss)
    loss.backward()
    assert torch.isnan(xg.grad[2]).all() and torch.isfinite(xg.grad[[0, 1, 3]]).all()
    with pytest.raises(IndexError, match=r"^cross_entropy: target 12 \(row 2\) is out of range \[0, 10\)"):
        cross_entropy(x, t, validate=True)
    t[2] = 3
    assert torch.isfinite(cross_entropy(x, t, validate=True))


@pytest.mark.parametrize("device", DEVICES)
def test_backward_scaling(device):
    # the backward multiplies the forward's gradient by the incoming one: in
    # place only when the graph is not kept, so retain_graph gives equal results
    x, t, w = make(7, 40, torch.float64, device)
    xg = x.clone().requires_grad_()
    loss = cross_entropy(xg, t, w, label_smoothing=0.2)
    ref, xd = torch_reference(x, t, w, label_smoothing=0.2)
    (g1,) = torch.autograd.grad(loss * 3.0, [xg], retain_graph=True)
    (g2,) = torch.autograd.grad(loss * 3.0, [xg], retain_graph=True)
    (g3,) = torch.autograd.grad(loss, [xg])
    (r1,) = torch.autograd.grad(ref * 3.0, [xd])
    assert torch.equal(g1, g2)
    assert_grad_close(g1, r1, torch.float64, "3 * loss")
    assert_grad_close(g3 * 3.0, r1, torch.float64, "loss")


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_grad(device):
    # the training call: logits from the lm head, the gradient over their memory
    g = torch.Generator().manual_seed(3)
    h = torch.randn(10, 16, generator=g).to(device).requires_grad_()
    W = torch.randn(50, 16, generator=g).to(device).requires_grad_()
    t = torch.randint(0, 50, (10,), generator=g).to(device)
    logits = h @ W.t()
    ptr = logits.data_ptr()
    loss = cross_entropy(logits, t, label_smoothing=0.1, inplace_grad=True)
    loss.backward()
    h2, W2 = h.detach().clone().requires_grad_(), W.detach().clone().requires_grad_()
    F.cross_entropy(h2 @ W2.t(), t, label_smoothing=0.1).backward()
    torch.testing.assert_close(loss, F.cross_entropy(h.detach() @ W.detach().t(), t, label_smoothing=0.1))
    torch.testing.assert_close(h.grad, h2.grad)
    torch.testing.assert_close(W.grad, W2.grad)
    assert logits.data_ptr() == ptr
    # nothing to differentiate (no_grad): the logits stay as they are
    with torch.no_grad():
        logits = h @ W.t()
        kept = logits.clone()
        cross_entropy(logits, t, inplace_grad=True)
        assert torch.equal(logits, kept)
    # a leaf that requires grad cannot be overwritten
    with pytest.raises(RuntimeError, match=r"^cross_entropy: inplace_grad=True writes the gradient over logits"):
        cross_entropy(torch.randn(4, 8, device=device, requires_grad=True), t[:4] % 8, inplace_grad=True)
    # anything else that saved the logits fails its version check instead of using the gradient
    logits = h.detach() @ W.t()
    other = (logits * logits).sum()
    cross_entropy(logits, t, inplace_grad=True).backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        other.backward()


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("device", DEVICES)
def test_float32_class_weight_beside_16bit_logits(device, dtype, autocast):
    # a class-weight buffer kept in float32 (as under autocast, where
    # PyTorch's nll_loss runs in float32): read as it is, not rounded to the
    # logits' dtype, for the loss and the gradient
    x, t, _ = make(16, 40, dtype, device)
    w = (0.5 + torch.rand(40, device=device)) * (1 + 2 ** -10)  # bits below 16-bit precision
    x.requires_grad_()
    with torch.autocast(device, dtype=dtype, enabled=autocast):
        loss = cross_entropy(x, t, w, label_smoothing=0.1)
        pybind_loss = cross_entropy_pybind(x, t, w, label_smoothing=0.1)
    want, xd = torch_reference(x, t, w, label_smoothing=0.1)
    assert_close(loss, want, dtype, "loss")
    assert torch.equal(loss, pybind_loss)
    (g,) = torch.autograd.grad(loss, x)
    (gw,) = torch.autograd.grad(want, xd)
    assert_grad_close(g, gw, dtype, "grad")
    # against the weight rounded to the logits' dtype: not the same (it was not rounded)
    rounded = cross_entropy(x.detach(), t, w.to(dtype), label_smoothing=0.1, reduction="none")
    assert not torch.equal(cross_entropy(x.detach(), t, w, label_smoothing=0.1, reduction="none"), rounded)
    with pytest.raises(RuntimeError, match=r"weight must have logits' dtype \((BFloat16|Half)\) or float32, got Double"):
        cross_entropy(x, t, w.double())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("device", DEVICES)
def test_loss_dtype_follows_autocast(device, dtype, reduction):
    # PyTorch: 16-bit logits give a 16-bit loss, and under autocast (which
    # runs cross_entropy in float32) a float32 one. opsmith gives the same
    # dtypes, and the float32 loss is the kernel's value unrounded: held to
    # float32's tolerance, which a loss rounded to 16 bits misses
    x, t, w = make(64, 300, dtype, device, seed=3)
    kw = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    want, _ = torch_reference(x, t, w, reduction=reduction, label_smoothing=0.1)
    plain, z_plain = cross_entropy(x, t, w, return_z_loss=True, **kw)
    assert plain.dtype == z_plain.dtype == F.cross_entropy(x, t, w, reduction=reduction).dtype == dtype
    with torch.autocast(device, dtype=dtype):
        auto, z_auto = cross_entropy(x, t, w, return_z_loss=True, **kw)
        assert F.cross_entropy(x, t, w, reduction=reduction).dtype == torch.float32
        # asked for: the logits' dtype under autocast too
        asked16 = cross_entropy(x, t, w, loss_dtype=dtype, **kw)
        pybind_auto = cross_entropy_pybind(x, t, w, **kw)
    assert auto.dtype == z_auto.dtype == pybind_auto.dtype == torch.float32 and asked16.dtype == dtype
    explicit, z_explicit = cross_entropy(x, t, w, return_z_loss=True, loss_dtype=torch.float32, **kw)
    assert torch.equal(auto, explicit) and torch.equal(z_auto, z_explicit) and torch.equal(auto, pybind_auto)
    # the 16-bit loss is the float32 one rounded once
    assert torch.equal(plain, auto.to(dtype)) and torch.equal(asked16, plain) and torch.equal(z_plain, z_auto.to(dtype))
    z_want = 1e-3 * torch.logsumexp(x.double(), dim=-1) ** 2 * (t != -100)
    z_want = z_want if reduction == "none" else z_want.sum() / ((w.double()[t.clamp(min=0)] * (t != -100)).sum()
                                                               if reduction == "mean" else 1.0)
    assert_close(auto, want + z_want, torch.float32, "float32 loss")
    assert_close(z_auto, z_want, torch.float32, "float32 z-loss")
    if reduction != "mean":  # (a mean of ~5 can round by chance to within float32's tolerance)
        rounding = (plain.double().cpu() - (want + z_want).cpu()).abs().max().item()
        assert rounding > TOL[torch.float32] * max(1.0, want.abs().max().item()), \
            "the 16-bit loss should differ from the float64 reference by its rounding"


@pytest.mark.parametrize("inplace_grad", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_float32_loss_gradient(device, inplace_grad):
    # the float32 loss's gradient flows back into the 16-bit logit gradient:
    # an incoming 1 gives the very gradient of the 16-bit loss, another
    # incoming gradient the float64 reference's within bf16
    x, t, w = make(32, 200, torch.bfloat16, device, seed=5)
    grads = []
    for loss_dtype in (None, torch.float32):
        xg = x.clone().requires_grad_()
        head = xg * 1.0  # inplace_grad writes over a non-leaf, as the lm head's output
        loss = cross_entropy(head, t, w, loss_dtype=loss_dtype, inplace_grad=inplace_grad)
        assert loss.dtype == (torch.float32 if loss_dtype else torch.bfloat16)
        (g,) = torch.autograd.grad(loss, xg)
        assert g.dtype == torch.bfloat16
        grads.append(g)
    assert torch.equal(grads[0], grads[1])
    xg = x.clone().requires_grad_()
    loss = cross_entropy(xg, t, w, reduction="none", loss_dtype=torch.float32)
    incoming = torch.rand(32, device=device) + 0.5
    (g,) = torch.autograd.grad(loss, xg, incoming)
    want, xd = torch_reference(x, t, w, reduction="none")
    (gw,) = torch.autograd.grad(want, xd, incoming.double().cpu() if device == "cpu" else incoming.double())
    assert_grad_close(g, gw, torch.bfloat16, "grad through a float32 loss")
    # the float32 incoming gradient is read unrounded: each element is the
    # float32 product of the saved gradient and it, rounded once (rounding
    # the incoming gradient to bfloat16 first changes some of them)
    (dl,) = torch.autograd.grad(cross_entropy(xg, t, w, reduction="none"), xg, torch.ones(32, device=device,
                                                                                         dtype=torch.bfloat16))
    assert torch.equal(g, (dl.float() * incoming[:, None]).to(torch.bfloat16))
    assert not torch.equal(g, (dl.float() * incoming.to(torch.bfloat16).float()[:, None]).to(torch.bfloat16))
    # route A takes the float32 gradient as well
    xa = x.clone().requires_grad_()
    la = cross_entropy_pybind(xa, t, w, reduction="none", loss_dtype=torch.float32)
    assert la.dtype == torch.float32 and torch.equal(la, loss.detach())
    assert torch.equal(torch.autograd.grad(la, xa, incoming)[0], g)


@pytest.mark.parametrize("device", DEVICES)
def test_loss_dtype_errors_and_module(device):
    x, t, w = make(4, 8, torch.bfloat16, device, ignore_frac=0.0)
    with pytest.raises(RuntimeError, match=r"cross_entropy: loss_dtype must be None, logits' dtype \(BFloat16\) or "
                                           r"float32, got Half"):
        cross_entropy(x, t, loss_dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"cross_entropy: loss_dtype must be None, logits' dtype \(Float\), got Double"):
        cross_entropy(x.float(), t, loss_dtype=torch.float64)
    with pytest.raises(TypeError, match=r"loss_dtype must be None or a torch.dtype, got 'float32'"):
        cross_entropy(x, t, loss_dtype="float32")
    # float64 logits keep a float64 loss under autocast, as PyTorch
    with torch.autocast(device, dtype=torch.bfloat16):
        assert cross_entropy(x.double(), t).dtype == torch.float64
        assert cross_entropy(x.float(), t).dtype == torch.float32
    module = opsmith.nn.CrossEntropyLoss(loss_dtype=torch.float32)
    assert "loss_dtype=torch.float32" in repr(module)
    assert torch.equal(module(x, t), cross_entropy(x, t, loss_dtype=torch.float32))
    torch.library.opcheck(torch.ops.opsmith.cross_entropy_fwd.default,
                          (x.clone().requires_grad_(), t, w, -100, 0.1, 1e-3, 0.0, 2, True),
                          {"loss_dtype": torch.float32})
    torch.library.opcheck(torch.ops.opsmith.cross_entropy_fwd_.default, (x.clone(), t, None, -100, 0.0, 0.0, 0.0, 0),
                          {"loss_dtype": torch.float32})
    # the backward op takes the gradient in dlogits' dtype or float32, nothing else
    dl = torch.randn(4, 8, device=device).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.opsmith.cross_entropy_bwd.default, (torch.rand(4, device=device), dl))
    with pytest.raises(RuntimeError, match=r"cross_entropy: grad must have dlogits' dtype \(BFloat16\) or float32, "
                                           r"got Double"):
        torch.ops.opsmith.cross_entropy_bwd(torch.tensor(2.0, dtype=torch.float64, device=device), dl)


def test_compiled_loss_under_autocast():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    x, t, w = make(12, 96, torch.bfloat16, "cpu")
    f = lambda v: cross_entropy(v * 2.0, t, w, label_smoothing=0.1)  # noqa: E731
    xg = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.compile(f, backend=counter, fullgraph=True)(xg)
        y_eager = f(xg)
    assert counter.frame_count == 1 and y.dtype == y_eager.dtype == torch.float32
    assert torch.equal(y, y_eager)
    (g,) = torch.autograd.grad(y, [xg])
    (g_eager,) = torch.autograd.grad(y_eager, [xg])
    assert torch.equal(g, g_eager)
    torch._dynamo.reset()


@pytest.mark.parametrize("device", DEVICES)
def test_errors_name_the_argument(device):
    x, t, w = make(4, 8, torch.float32, device, ignore_frac=0.0)
    cases = [
        (lambda: cross_entropy(x, t, reduction="avg"), ValueError, r"^cross_entropy: reduction must be"),
        (lambda: cross_entropy(x, t, label_smoothing=1.5), RuntimeError, r"^cross_entropy: label_smoothing must be in \[0, 1\]"),
        (lambda: cross_entropy(x, t, z_loss=-1.0), RuntimeError, r"^cross_entropy: z_loss must be finite and >= 0"),
        (lambda: cross_entropy(x, t, softcap=0.0), ValueError, r"^cross_entropy: softcap must be None or finite and > 0"),
        (lambda: cross_entropy(x, t.int()), RuntimeError, r"^cross_entropy: target must be int64 class indices, got Int"),
        (lambda: cross_entropy(x, t.float()), RuntimeError, r"^cross_entropy: target must be int64 class indices"),
        (lambda: cross_entropy(x, t[:3]), RuntimeError, r"^cross_entropy: target must have shape \[4\]"),
        (lambda: cross_entropy(x, t, w[:5]), RuntimeError, r"^cross_entropy: weight must have shape \[8\]"),
        (lambda: cross_entropy(x, t, w.double()), RuntimeError, r"^cross_entropy: weight must have logits' dtype \(Float\), got Double"),
        (lambda: cross_entropy(x.int(), t), RuntimeError, r"^cross_entropy: logits must be float64, float32, float16 or bfloat16"),
        (lambda: cross_entropy(x.requires_grad_(), t, w.clone().requires_grad_()), RuntimeError,
         r"^cross_entropy: the gradient of weight is not implemented"),
    ]
    for fn, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            fn()


@pytest.mark.parametrize("device", DEVICES)
def test_bridge_errors_name_the_argument(device):
    # the C++ checks the Python functional runs before (target shape,
    # reduction) and those of the backward, reached by calling the ops
    # themselves, both routes: each message carries numbers, which once
    # crashed the process (a segmentation fault, on the GPU machine) when
    # streamed rather than formatted with text() (tests/test_bridge_messages.py)
    x, t, w = make(4, 8, torch.float32, device, ignore_frac=0.0)
    ops = torch.ops.opsmith
    from opsmith import _pybind
    dl = torch.randn(4, 8, device=device)
    cases = [
        (lambda f: f(x, t[:3], None, -100, 0.0, 0.0, 0.0, 2, False),
         r"^cross_entropy: target must have shape \[4\] \(logits' rows\), got \[3\]"),
        (lambda f: f(x, t, None, -100, 0.0, 0.0, 0.0, 7, False),
         r"^cross_entropy: reduction must be 0 \(none\), 1 \(sum\) or 2 \(mean\), got 7$"),
        (lambda f: f(x, t, w[:5], -100, 0.0, 0.0, 0.0, 2, False),
         r"^cross_entropy: weight must have shape \[8\] \(one per class\), got \[5\]"),
        (lambda f: f(x, t, w.view(2, 4), -100, 0.0, 0.0, 0.0, 2, True),
         r"^cross_entropy: weight must have shape \[8\] \(one per class\), got \[2, 4\]"),
    ]
    for fwd in (ops.cross_entropy_fwd.default, _pybind.cross_entropy_fwd):
        for fn, pattern in cases:
            with pytest.raises(RuntimeError, match=pattern):
                fn(fwd)
    with pytest.raises(RuntimeError, match=r"^cross_entropy: weight must have shape \[8\] \(one per class\), got \[5\]"):
        ops.cross_entropy_fwd_.default(x.clone(), t, w[:5], -100, 0.0, 0.0, 0.0, 2)
    grad_pattern = (r"^cross_entropy: grad must be a scalar \(reduction sum or mean\) or have shape \[4\] "
                    r"\(reduction none\), got \[3\]")
    for bwd in (ops.cross_entropy_bwd.default, _pybind.cross_entropy_bwd):
        with pytest.raises(RuntimeError, match=grad_pattern):
            bwd(torch.randn(3, device=device), dl)
    with pytest.raises(RuntimeError, match=grad_pattern):
        ops.cross_entropy_bwd_.default(torch.randn(3, device=device), dl)
    # the functional's own message for the weight, with a [V]-long weight of another shape
    with pytest.raises(RuntimeError, match=r"^cross_entropy: weight must have shape \[8\] \(one per class\), got \[1, 8\]"):
        cross_entropy(x, t, w.view(1, 8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradcheck(device, reduction):
    x, t, w = make(5, 11, torch.float64, device)
    x.requires_grad_()
    kw = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-2, softcap=4.0)
    assert torch.autograd.gradcheck(lambda v: cross_entropy(v, t, w, **kw), (x,))
    assert torch.autograd.gradcheck(lambda v: cross_entropy_pybind(v, t, w, **kw), (x,))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x, t, w = make(6, 40, torch.float32, device)
    x.requires_grad_()
    for red, grad in ((0, False), (2, True), (1, True)):
        torch.library.opcheck(torch.ops.opsmith.cross_entropy_fwd.default, (x, t, w, -100, 0.1, 1e-3, 10.0, red, grad))
    torch.library.opcheck(torch.ops.opsmith.cross_entropy_fwd_.default, (x.detach().clone(), t, None, -100, 0.1, 0.0, 0.0, 2))
    dl = torch.randn(6, 40, device=device)
    torch.library.opcheck(torch.ops.opsmith.cross_entropy_bwd.default, (torch.tensor(2.0, device=device), dl))
    torch.library.opcheck(torch.ops.opsmith.cross_entropy_bwd.default, (torch.randn(6, device=device), dl))
    torch.library.opcheck(torch.ops.opsmith.cross_entropy_bwd_.default, (torch.randn(6, device=device), dl.clone()))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager" if device == "cpu" else "inductor")
    x, t, w = make(12, 96, torch.float32, device)
    f = lambda v: cross_entropy(v * 2.0 + 1.0, t, w, label_smoothing=0.1, z_loss=1e-3) * 3.0  # noqa: E731
    xg = x.clone().requires_grad_()
    y = torch.compile(f, backend=counter, fullgraph=True)(xg)
    (g,) = torch.autograd.grad(y, [xg])
    (g_eager,) = torch.autograd.grad(f(xg), [xg])
    assert counter.frame_count == 1
    torch.testing.assert_close(y, f(xg))
    torch.testing.assert_close(g, g_eager)
    torch._dynamo.reset()


def test_the_saved_gradient_scaled_in_place_only_when_no_one_else_holds_it():
    import threading

    from harness import opsmith_ops_run

    x, t, _ = make(64, 100, torch.float32, "cpu")
    xg = x.clone().requires_grad_()
    # the functions: the backward that frees the graph scales the saved gradient in place
    loss = cross_entropy(xg, t)
    assert opsmith_ops_run(lambda: loss.backward()) == {"opsmith::cross_entropy_bwd_"}
    # the raw op returned the gradient to its caller: never written behind it
    loss, _, dl, _ = torch.ops.opsmith.cross_entropy_fwd(xg, t, None, compute_grad=True)
    keep = dl.clone()
    assert opsmith_ops_run(lambda: (loss * 3).backward()) == {"opsmith::cross_entropy_bwd"}
    assert torch.equal(dl, keep)
    # backwards over one graph from several threads at once (two keeping the
    # graph, one freeing it): each gets the right gradient or the error of a
    # freed graph, never the one scaled in place for another
    for trial in range(8):
        loss = cross_entropy(xg, t, reduction="none")
        go = torch.rand(64) + 0.5
        ref = torch.autograd.grad(loss, xg, go, retain_graph=True)[0].clone()
        wrong = []

        def run(keep):
            for _ in range(20 if keep else 1):
                try:
                    g = torch.autograd.grad(loss, xg, go, retain_graph=keep)[0]
                except RuntimeError as e:
                    assert "second time" in str(e) or "freed" in str(e), str(e)
                    continue
                if not torch.equal(g, ref):
                    wrong.append((keep, (g - ref).abs().max().item()))

        threads = [threading.Thread(target=run, args=(k,)) for k in (True, True, False)]
        [th.start() for th in threads]
        [th.join() for th in threads]
        assert not wrong, wrong[:3]


def test_compile_a_softcap_that_changes():
    # a softcap that is a module attribute (dynamic=True) or changes between
    # calls reaches the check as a symbolic float: fullgraph must hold
    from torch._dynamo.testing import CompileCounterWithBackend
    from opsmith.nn import FusedLinearCrossEntropyLoss

    x, t, _ = make(8, 50, torch.float32, "cpu")
    for dynamic in (True, None):
        torch._dynamo.reset()
        m = CrossEntropyLoss(softcap=30.0)
        head = FusedLinearCrossEntropyLoss(torch.randn(50, 16), softcap=30.0)
        cm = torch.compile(m, backend=CompileCounterWithBackend("aot_eager"), fullgraph=True, dynamic=dynamic)
        ch = torch.compile(head, backend=CompileCounterWithBackend("aot_eager"), fullgraph=True, dynamic=dynamic)
        h = torch.randn(8, 16)
        for cap in (30.0, 20.0, 10.0):
            m.softcap = head.softcap = cap
            torch.testing.assert_close(cm(x, t), cross_entropy(x, t, softcap=cap))
            torch.testing.assert_close(ch(h, t), opsmith.fused_linear_cross_entropy(h, head.weight, t, softcap=cap))
    torch._dynamo.reset()


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_graph_capture(dtype):
    # forward + backward capture: no host synchronisation anywhere
    x, t, w = make(64, 4099, dtype, "cuda")
    xg = x.clone().requires_grad_()
    kw = dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0)
    # the reference through another leaf: a leaf's gradient accumulator keeps
    # the stream it was made on, and the captured backward must not feed one
    # made on the default (legacy) stream
    x_ref = x.clone().requires_grad_()
    ref = cross_entropy(x_ref, t, w, **kw)
    (gref,) = torch.autograd.grad(ref * 2.0, [x_ref])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up on the side stream
            torch.autograd.grad(cross_entropy(xg, t, w, **kw) * 2.0, [xg])
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = cross_entropy(xg, t, w, **kw)
        (gx,) = torch.autograd.grad(loss * 2.0, [xg])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(loss, ref) and torch.equal(gx, gref)


@CUDA
@pytest.mark.parametrize("z_loss", [0.0, 1e-4])
@pytest.mark.parametrize("weighted", [False, True])
def test_cuda_extra_memory(z_loss, weighted):
    # beyond the logits and their gradient, a training step holds one float32
    # a row (two with a z-loss) and a few scalars (loss, z-loss, error flag)
    rows, n = 4096, 32000
    x, t, w = make(rows, n, torch.bfloat16, "cuda")
    w = w if weighted else None
    logits = x.requires_grad_()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = cross_entropy(logits, t, w, z_loss=z_loss)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - logits.grad.numel() * logits.grad.element_size()
    # weight is converted to float32 once (n values), as PyTorch keeps it
    allowed = rows * 4 * (2 if z_loss else 1) + (n * 4 if weighted else 0) + 4096
    assert extra <= allowed, f"extra memory {extra} B > {allowed} B ({extra / rows:.1f} B/row)"
    assert torch.isfinite(loss) and logits.grad.abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_route_a_equals_route_b(device, dtype):
    x, t, w = make(5, 77, dtype, device)
    for red in ("mean", "none"):
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        kw = dict(reduction=red, label_smoothing=0.1, z_loss=1e-3, softcap=20.0)
        ya, yb = cross_entropy_pybind(xa, t, w, **kw), cross_entropy(xb, t, w, **kw)
        assert torch.equal(ya, yb)
        g = torch.randn(ya.shape, device=device).to(dtype)
        assert torch.equal(torch.autograd.grad(ya, [xa], g)[0], torch.autograd.grad(yb, [xb], g)[0])
    assert opsmith.pybind.cross_entropy is cross_entropy_pybind


def test_autodiff_limits_and_transforms():
    x, t, _ = make(3, 10, torch.float64, "cpu")
    x.requires_grad_()
    (dx,) = torch.autograd.grad(cross_entropy(x, t), [x], create_graph=True)
    with pytest.raises(RuntimeError, match=r"^cross_entropy: double backward is not supported"):
        dx.sum().backward()
    with pytest.raises(RuntimeError, match=r"^cross_entropy: forward-mode AD is not supported"):
        torch.func.jvp(lambda v: cross_entropy(v, t), (x.detach(),), (torch.ones_like(x),))
    g = torch.func.grad(lambda v: cross_entropy(v, t, label_smoothing=0.1))(x.detach())
    ref, xd = torch_reference(x, t, None, label_smoothing=0.1)
    ref.backward()
    torch.testing.assert_close(g, xd.grad)
    with pytest.raises(RuntimeError, match=r"cross_entropy: torch.func.vmap is not supported"):
        torch.func.vmap(lambda v: cross_entropy(v, t))(x.detach().unsqueeze(0).expand(2, 3, 10))
    with pytest.raises(RuntimeError, match=r"route A does not support torch\.func transforms"):
        torch.func.grad(lambda v: cross_entropy_pybind(v, t))(x.detach())


def test_module():
    x, t, w = make(6, 9, torch.float32, "cpu")
    ours = opsmith.nn.CrossEntropyLoss(weight=w, label_smoothing=0.1, ignore_index=-100)
    theirs = torch.nn.CrossEntropyLoss(weight=w, label_smoothing=0.1, ignore_index=-100)
    assert isinstance(ours, CrossEntropyLoss) and "label_smoothing=0.1" in repr(ours)
    assert ours.state_dict().keys() == theirs.state_dict().keys() == {"weight"}
    torch.testing.assert_close(ours(x, t), theirs(x, t))
    assert opsmith.nn.CrossEntropyLoss(reduction="none")(x, t.clamp(min=0)).shape == (6,)
    loss, z = opsmith.nn.CrossEntropyLoss(z_loss=1e-2, return_z_loss=True)(x, t)
    assert z.item() > 0 and loss.item() > z.item()
    assert opsmith.nn.CrossEntropyLoss(size_average=False).reduction == "sum"
