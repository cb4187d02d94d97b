"""fused_linear_cross_entropy through every route: loss and the gradients of
hidden, weight and bias against the eager float64 computation
``F.cross_entropy(F.linear(h, W, b), t, ...)`` (z-loss and softcap through the
cross-entropy formula) for every option and dtype, chunk sizes that do not
divide the tokens, torch.compile with ignored targets, autocast, route A
against route B, the module (shared lm_head parameters), errors naming the
argument, and a 30-step training run that tracks the unfused model. CUDA cases
are collected everywhere and skipped without a GPU."""
import itertools

import pytest
import torch
import torch.nn.functional as F

import opsmith
import opsmith.pybind
from opsmith.ops.fused_linear_cross_entropy import (FusedLinearCrossEntropyLoss, fused_linear_cross_entropy,
                                                    fused_linear_cross_entropy_pybind)
from opsmith.specs.cross_entropy import formula

HAS_CUDA = torch.cuda.is_available()
CUDA = pytest.mark.skipif(not HAS_CUDA, reason="CUDA is not available")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
# relative to the largest element of the reference (gradients of a mean are small)
TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
# plus the rounding of a result into float16's subnormals (half its smallest step): a
# gradient of a mean over thousands of tokens can be that small, whoever computes it
FLOOR = {torch.float16: 2.0 ** -25}


def make(n, d, v, dtype, device, bias=True, ignore_frac=0.25, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.rand(n, d, generator=g) * 3 - 1.5).to(dtype).to(device)
    w = ((torch.rand(v, d, generator=g) * 2 - 1) * (2 / d ** 0.5)).to(dtype).to(device)
    b = (torch.rand(v, generator=g) - 0.5).to(dtype).to(device) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t = torch.where(torch.rand(n, generator=g) < ignore_frac, -100, t).to(device)
    return h, w, b, t


def reference(h, w, b, t, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None):
    """Loss in float64 from float64 leaves (h, w, b): differentiable."""
    logits = F.linear(h, w, b)
    per_row = formula(logits, t, None, ignore_index, label_smoothing, z_loss, softcap)
    total = per_row.sum()
    if reduction == "mean":
        count = (t != ignore_index).sum()
        # no token counted: NaN loss and zero gradients, as PyTorch's mean gives
        total = torch.where(count > 0, total / count.clamp(min=1), total.new_tensor(float("nan")))
    return total


def leaves64(*ts):
    return [None if x is None else x.detach().double().requires_grad_() for x in ts]


def assert_close(got, want, dtype, what, relative_to_max=True):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN pattern differs"
    ok = ~torch.isnan(want)
    if not ok.any():
        return
    err = (got[ok] - want[ok]).abs().max().item()
    scale = want[ok].abs().max().item()
    bound = TOL[dtype] * (max(scale, 1e-300) if relative_to_max else max(1.0, scale)) + FLOOR.get(dtype, 0.0)
    assert err <= bound, f"{what}: max|got - float64 reference| = {err:.3e} > {bound:.3e}"


def check_call(h, w, b, t, dtype, what, chunk_size=None, g=1.0, fn=fused_linear_cross_entropy, **kw):
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    bg = None if b is None else b.clone().requires_grad_()
    loss = fn(hg, wg, t, bg, chunk_size=chunk_size, **kw)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), what
    assert loss.shape == (), what
    hd, wd, bd = leaves64(h, w, b)
    ref = reference(hd, wd, bd, t, **kw)
    assert_close(loss, ref, dtype, what + " loss", relative_to_max=False)
    gg = torch.tensor(g, dtype=loss.dtype, device=loss.device)
    loss.backward(gg)
    ref.backward(torch.tensor(g, dtype=torch.float64, device=ref.device))
    for name, got, want in (("dhidden", hg, hd), ("dweight", wg, wd), ("dbias", bg, bd)):
        if got is None:
            continue
        assert got.grad is not None and got.grad.dtype == dtype, f"{what} {name}"
        assert_close(got.grad, want.grad, dtype, f"{what} {name}")
    return loss


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_eager(device, dtype):
    # every option, chunk sizes that do not divide the 37 tokens (and the default)
    h, w, b, t = make(37, 24, 67, dtype, device)
    for reduction, bias, ls, z, cap, chunk in itertools.product(("mean", "sum"), (False, True), (0.0, 0.1),
                                                                (0.0, 1e-3), (None, 5.0), (None, 8)):
        kw = dict(reduction=reduction, label_smoothing=ls, z_loss=z, softcap=cap)
        what = f"{dtype} {kw} bias={bias} chunk={chunk}"
        check_call(h, w, b if bias else None, t, dtype, what, chunk_size=chunk, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_incoming_gradient_and_leading_dims(device):
    # an incoming gradient other than 1 scales every gradient; [B, S, D] hidden
    dtype = torch.float32
    h, w, b, t = make(24, 16, 33, dtype, device)
    check_call(h, w, b, t, dtype, "g=1.7", chunk_size=5, g=1.7)
    check_call(h, w, b, t, dtype, "g=-0.25 sum", chunk_size=7, g=-0.25, reduction="sum")
    h3, t3 = h.view(4, 6, 16), t.view(4, 6)
    loss3 = fused_linear_cross_entropy(h3, w, t3, b, chunk_size=5)
    loss2 = fused_linear_cross_entropy(h, w, t, b, chunk_size=5)
    assert torch.equal(loss3, loss2)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_hidden_and_ignore_index(device):
    # a column slice of a wider tensor (row stride past D), another ignore_index
    dtype = torch.float32
    h, w, b, t = make(19, 40, 29, dtype, device)
    hs = h[:, 3:35]
    ws = w[:, 3:35].contiguous()
    tt = torch.where(t == -100, 5, t)
    tt[::3] = 5
    check_call(hs, ws, b, tt, dtype, "strided, ignore 5", chunk_size=4, ignore_index=5)
    assert not hs.is_contiguous()


@pytest.mark.parametrize("device", DEVICES)
def test_all_ignored_and_empty(device):
    h, w, b, t = make(6, 8, 16, torch.float32, device)
    t = torch.full_like(t, -100)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fused_linear_cross_entropy(hg, wg, t)
    assert torch.isnan(loss), "every target ignored, mean: NaN (as PyTorch)"
    loss.backward()
    assert torch.equal(hg.grad, torch.zeros_like(h)) and torch.equal(wg.grad, torch.zeros_like(w))
    assert fused_linear_cross_entropy(h, w, t, reduction="sum").item() == 0.0
    e = fused_linear_cross_entropy(h[:0], w, t[:0], reduction="sum")
    assert e.item() == 0.0
    assert torch.isnan(fused_linear_cross_entropy(h[:0], w, t[:0]))


def test_bad_target_cpu():
    h, w, b, t = make(6, 8, 16, torch.float32, "cpu")
    t[4] = 16
    with pytest.raises(IndexError, match=r"target 16 \(row 4\) is out of range"):
        fused_linear_cross_entropy(h, w, t)


@CUDA
def test_bad_target_cuda_flag():
    h, w, b, t = make(6, 8, 16, torch.float32, "cuda")
    t[4] = 16
    assert torch.isnan(fused_linear_cross_entropy(h, w, t))
    with pytest.raises(IndexError, match=r"target 16 \(row 4\) is out of range"):
        fused_linear_cross_entropy(h, w, t, validate=True)


@pytest.mark.parametrize("device", DEVICES)
def test_route_a_equals_route_b(device):
    h, w, b, t = make(21, 16, 45, torch.bfloat16, device)
    outs = []
    for fn in (fused_linear_cross_entropy, fused_linear_cross_entropy_pybind, opsmith.pybind.fused_linear_cross_entropy):
        hg, wg, bg = h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
        loss, z = fn(hg, wg, t, bg, label_smoothing=0.1, z_loss=1e-3, chunk_size=6, return_z_loss=True)
        (loss * 1.5).backward()
        outs.append((loss, z, hg.grad, wg.grad, bg.grad))
    for other in outs[1:]:
        for a, b_ in zip(outs[0], other):
            assert torch.equal(a, b_)


@pytest.mark.parametrize("device", DEVICES)
def test_float32_incoming_gradient_read_unrounded(device):
    # the loss is float32: its gradient (here 1/7, as a mean over 7 items
    # gives) scales each 16-bit gradient in float32, rounded once, through
    # both routes; rounding 1/7 to bfloat16 first would change some elements
    h, w, b, t = make(21, 16, 45, torch.bfloat16, device)
    for fn in (fused_linear_cross_entropy, fused_linear_cross_entropy_pybind):
        grads = []
        for scale in (1.0, 1.0 / 7.0):
            hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
            (fn(hg, wg, t, chunk_size=6) * scale).backward()
            grads.append((hg.grad, wg.grad))
        for one, seventh in zip(*grads):
            assert torch.equal(seventh, (one.float() * (1.0 / 7.0)).to(torch.bfloat16))
            assert not torch.equal(seventh, (one.float() * torch.tensor(1.0 / 7.0).bfloat16().float()).bfloat16())


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_and_partial_grads(device):
    h, w, b, t = make(17, 16, 45, torch.float32, device)
    # the same chunks as the calls below: on CUDA the logits' products (cuBLASLt) round
    # by their shape, so only equal chunks promise equal bits
    with torch.no_grad():
        l0 = fused_linear_cross_entropy(h, w, t, b, chunk_size=4)
    assert l0.grad_fn is None
    # a frozen head: only hidden's gradient
    hg = h.clone().requires_grad_()
    loss = fused_linear_cross_entropy(hg, w, t, b, chunk_size=4)
    loss.backward()
    hd, wd, bd = leaves64(h, w, b)
    ref = reference(hd, wd, bd, t)
    ref.backward()
    assert_close(hg.grad, hd.grad, torch.float32, "dhidden alone")
    assert torch.equal(loss.detach(), l0)
    # only the weight's gradient
    wg = w.clone().requires_grad_()
    fused_linear_cross_entropy(h, wg, t, b, chunk_size=4).backward()
    assert_close(wg.grad, wd.grad, torch.float32, "dweight alone")


def test_raw_op_gradients_left_as_returned():
    # the raw op hands its caller the gradients its node saves: the backward
    # that frees the graph must not scale them in place while the caller holds
    # them (the public function drops them, and there it does)
    h, w, b = torch.randn(32, 16), torch.randn(100, 16), torch.randn(100)
    hg, wg, bg = (a.clone().requires_grad_() for a in (h, w, b))
    t = torch.randint(0, 100, (32,))
    loss, _, dh, dw, db, _ = torch.ops.opsmith.fused_linear_cross_entropy_fwd(hg, wg, t, bg)
    keep = [dh.clone(), dw.clone(), db.clone()]
    (loss * 3).backward()
    assert all(torch.equal(a, k) for a, k in zip((dh, dw, db), keep))
    for got, ref in zip((hg.grad, wg.grad, bg.grad), keep):
        torch.testing.assert_close(got, 3 * ref)


@pytest.mark.parametrize("device", DEVICES)
def test_retain_graph_twice(device):
    # the graph kept: the saved gradients are scaled out of place, so a second backward agrees
    h, w, b, t = make(9, 8, 20, torch.float32, device)
    hg = h.clone().requires_grad_()
    loss = fused_linear_cross_entropy(hg, w, t)
    loss.backward(torch.tensor(2.0, device=device), retain_graph=True)
    first = hg.grad.clone()
    hg.grad = None
    loss.backward(torch.tensor(2.0, device=device))
    assert torch.equal(first, hg.grad)


def test_double_backward_refused():
    h, w, b, t = make(5, 4, 7, torch.float64, "cpu")
    hg = h.clone().requires_grad_()
    loss = fused_linear_cross_entropy(hg, w, t)
    (dh,) = torch.autograd.grad(loss, [hg], create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        dh.sum().backward()


def test_gradcheck():
    h, w, b, t = make(5, 4, 7, torch.float64, "cpu")
    fn = lambda hh, ww, bb: fused_linear_cross_entropy(hh, ww, t, bb, label_smoothing=0.1, z_loss=1e-2, softcap=3.0,
                                                       chunk_size=2)
    assert torch.autograd.gradcheck(fn, (h.requires_grad_(), w.requires_grad_(), b.requires_grad_()))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_with_ignore_index(device):
    # torch.compile(fullgraph=True): the mean's count is on the device, so
    # ignored targets give the right loss and gradients (no silent wrong loss)
    torch._dynamo.reset()
    h, w, b, t = make(32, 16, 40, torch.float32, device, ignore_frac=0.5)

    def step(hh, ww, tt):
        return fused_linear_cross_entropy(hh, ww, tt, ignore_index=-100, chunk_size=8)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = compiled(hg, wg, t)
    loss.backward()
    hd, wd, _ = leaves64(h, w, None)
    ref = reference(hd, wd, None, t)
    ref.backward()
    assert_close(loss, ref, torch.float32, "compiled loss", relative_to_max=False)
    assert_close(hg.grad, hd.grad, torch.float32, "compiled dhidden")
    assert_close(wg.grad, wd.grad, torch.float32, "compiled dweight")
    # a second call with a different count of ignored targets: same graph, right answer
    t2 = torch.where(torch.arange(32, device=device) < 24, -100, t.clamp(min=0))
    l2 = compiled(h, w, t2)
    assert_close(l2, reference(h.double(), w.double(), None, t2), torch.float32, "compiled, other mask",
                 relative_to_max=False)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast(device):
    # float32 master weights under bf16 autocast: the head runs in bf16, the
    # loss is float32, and the float32 weight gets a float32 gradient
    h, w, b, t = make(16, 32, 50, torch.float32, device)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(hg, wg, t, chunk_size=5)
    assert loss.dtype == torch.float32
    loss.backward()
    assert wg.grad.dtype == torch.float32 and hg.grad.dtype == torch.float32
    hd, wd, _ = leaves64(h.bfloat16(), w.bfloat16(), None)
    ref = reference(hd, wd, None, t)
    ref.backward()
    assert_close(loss, ref, torch.bfloat16, "autocast loss", relative_to_max=False)
    assert_close(wg.grad, wd.grad, torch.bfloat16, "autocast dweight")
    assert_close(hg.grad, hd.grad, torch.bfloat16, "autocast dhidden")


def test_errors_name_the_argument():
    h, w, b, t = make(6, 8, 16, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"weight must have hidden's dtype"):
        fused_linear_cross_entropy(h, w.double(), t)
    with pytest.raises(RuntimeError, match=r"weight must have shape \[V, 8\]"):
        fused_linear_cross_entropy(h, w[:, :5], t)
    with pytest.raises(RuntimeError, match=r"bias must have shape \[16\]"):
        fused_linear_cross_entropy(h, w, t, b[:3])
    with pytest.raises(RuntimeError, match=r"target must have shape \[6\]"):
        fused_linear_cross_entropy(h, w, t[:3])
    with pytest.raises(RuntimeError, match=r"target must be int64"):
        fused_linear_cross_entropy(h, w, t.float())
    with pytest.raises(ValueError, match=r"reduction must be 'sum' or 'mean'"):
        fused_linear_cross_entropy(h, w, t, reduction="none")
    with pytest.raises(ValueError, match=r"chunk_size must be None or >= 1"):
        fused_linear_cross_entropy(h, w, t, chunk_size=0)
    with pytest.raises(RuntimeError, match=r"label_smoothing must be in \[0, 1\]"):
        fused_linear_cross_entropy(h, w, t, label_smoothing=2.0)
    with pytest.raises(RuntimeError, match=r"hidden must be float64, float32, float16 or bfloat16"):
        fused_linear_cross_entropy(h.int(), w, t)


def test_module_shares_lm_head():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 20, bias=True)
    loss_fn = FusedLinearCrossEntropyLoss.from_linear(head, ignore_index=-1, label_smoothing=0.1, chunk_size=3)
    assert loss_fn.weight is head.weight and loss_fn.bias is head.bias
    assert set(loss_fn.state_dict()) == set(head.state_dict()) == {"weight", "bias"}
    assert "label_smoothing=0.1" in repr(loss_fn) and "chunk_size=3" in repr(loss_fn)
    x = torch.randn(2, 5, 8, requires_grad=True)
    t = torch.randint(0, 20, (2, 5))
    t[0, 1] = -1
    loss = loss_fn(x, t)
    ref = F.cross_entropy(head(x).view(-1, 20), t.view(-1), ignore_index=-1, label_smoothing=0.1)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    loss.backward()
    g = head.weight.grad.clone()
    head.weight.grad = None
    ref.backward()
    torch.testing.assert_close(g, head.weight.grad, rtol=1e-4, atol=1e-6)
    m2 = FusedLinearCrossEntropyLoss(head.weight, return_z_loss=True, z_loss=1e-3)
    loss2, z = m2(x, t.clamp(min=0))
    assert z.item() > 0 and loss2.item() > z.item()
    assert opsmith.nn.FusedLinearCrossEntropyLoss is FusedLinearCrossEntropyLoss


def test_module_keeps_a_computed_or_plain_weight():
    # a head merged from an adapter (computed from other tensors) and a plain
    # leaf tensor are kept as they are: the gradient reaches A and B, and the
    # leaf's own .grad, not a copy the module made
    torch.manual_seed(1)
    base, a, b = torch.randn(20, 8), torch.randn(20, 2, requires_grad=True), torch.randn(2, 8, requires_grad=True)
    leaf = torch.randn(20, 8, requires_grad=True)
    x, t = torch.randn(6, 8), torch.randint(0, 20, (6,))
    for make_w, wanted in ((lambda: base + a @ b, (a, b)), (lambda: leaf, (leaf,))):
        w = make_w()
        loss_fn = FusedLinearCrossEntropyLoss(w)
        assert loss_fn.weight is w and set(loss_fn.state_dict()) == {"weight"} and not list(loss_fn.parameters())
        got = torch.autograd.grad(loss_fn(x, t), wanted)
        ref = torch.autograd.grad(F.cross_entropy(F.linear(x, make_w()), t), wanted)
        for g, r in zip(got, ref):
            assert g.abs().sum() > 0
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


class _TinyLM(torch.nn.Module):
    def __init__(self, vocab=61, dim=24):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 48), torch.nn.GELU(), torch.nn.Linear(48, dim))
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)

    def hidden(self, ids):
        x = self.embed(ids)
        return x + self.mlp(x)


@pytest.mark.parametrize("device", DEVICES)
def test_training_tracks_unfused(device):
    # 30 AdamW steps of a tiny LM, fused head + loss against lm_head + F.cross_entropy from the same start:
    # the losses stay together (no drift)
    torch.manual_seed(0)
    a = _TinyLM().to(device)
    b = _TinyLM().to(device)
    b.load_state_dict(a.state_dict())
    loss_fn = FusedLinearCrossEntropyLoss.from_linear(b.lm_head, chunk_size=16)
    oa = torch.optim.AdamW(a.parameters(), lr=3e-3)
    ob = torch.optim.AdamW(b.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    first = last = None
    for step in range(30):
        ids = torch.randint(0, 61, (4, 17), generator=g).to(device)
        x, y = ids[:, :-1], ids[:, 1:].clone()
        y[:, :2] = -100  # a masked prompt
        la = F.cross_entropy(a.lm_head(a.hidden(x)).float().flatten(0, 1), y.flatten())
        lb = loss_fn(b.hidden(x), y)
        for opt, loss in ((oa, la), (ob, lb)):
            opt.zero_grad()
            loss.backward()
            opt.step()
        worst = max(worst, abs(la.item() - lb.item()))
        first = la.item() if first is None else first
        last = la.item()
    assert worst < 1e-3, f"fused and unfused losses drifted apart by {worst:.2e}"
    assert last < first, "the model did not learn"


@CUDA
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_larger_shapes(dtype):
    # cuBLASLt tiles, odd vocabulary, chunks that do not divide, both dweight accumulators
    for (n, d, v, chunk) in ((300, 96, 1000, 128), (257, 200, 3001, None), (64, 128, 4099, 17)):
        h, w, b, t = make(n, d, v, dtype, "cuda")
        check_call(h, w, b, t, dtype, f"{dtype} {n}x{d}x{v} chunk={chunk}", chunk_size=chunk, label_smoothing=0.1,
                   z_loss=1e-4)
    # Llama 3's vocabulary, no bias, no options: each chunk's rows walked by the cross-entropy kernel
    # specialised for the plain call
    h, w, _, t = make(300, 32, 128256, dtype, "cuda", bias=False)
    check_call(h, w, None, t, dtype, f"{dtype} 300x32x128256 plain chunk=150", chunk_size=150)


@pytest.mark.parametrize("device", DEVICES)
def test_float16_mean_over_many_tokens(device):
    # p / tokens is under float16's smallest subnormal (6e-8) for nearly every class here
    # (p ~ 6e-5, 4096 tokens): a logit gradient stored already divided by the count flushes
    # to zero and dhidden loses sum_c p_c W_c. The weight rows share a component, so that
    # term is as large as the target's own row rather than lost in noise.
    n, d, v = 4096, 32, 16384
    g = torch.Generator().manual_seed(3)
    h = (torch.rand(n, d, generator=g) - 0.5).half().to(device)
    w = (0.2 + 0.05 * (torch.rand(v, d, generator=g) - 0.5)).half().to(device)
    t = torch.randint(0, v, (n,), generator=g).to(device)
    check_call(h, w, None, t, torch.float16, f"float16 {n}x{d}x{v} mean on {device}")


def _rel_err(got, want):
    """|got - want| / |want| in norm, and how many elements came back zero where want is not"""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).norm() / want.norm()).item(), int(((got == 0) & (want != 0)).sum())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", ["b", "a"])
def test_float16_under_a_loss_scale(device, route):
    # GradScaler's 65536 times a mean over 2048 tokens: the gradients of an incoming gradient of 1
    # have elements under float16's normal range (6.1e-5), so they must not be rounded to float16
    # before the scale. The unfused path (float16 linear, float32 cross-entropy) rounds after it;
    # opsmith's gradients must be as close to float64 as that path's and have no more zeros (rounded
    # before the scale, as they were, they come back 1.2x its error with 37 and 552 zeros here).
    n, d, v, scale = 2048, 64, 8192, 65536.0
    h, w, _, t = make(n, d, v, torch.float16, device, bias=False, ignore_frac=0.0, seed=5)
    fn = fused_linear_cross_entropy if route == "b" else fused_linear_cross_entropy_pybind
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    (fn(hg, wg, t) * scale).backward()
    assert hg.grad.dtype == wg.grad.dtype == torch.float16
    hu, wu = h.clone().requires_grad_(), w.clone().requires_grad_()
    (F.cross_entropy(F.linear(hu, wu).float(), t) * scale).backward()
    hd, wd = leaves64(h, w)
    reference(hd, wd, None, t).backward()
    for name, ours, unfused, want in (("dhidden", hg, hu, hd), ("dweight", wg, wu, wd)):
        err, zeros = _rel_err(ours.grad.double() / scale, want.grad)
        err_u, zeros_u = _rel_err(unfused.grad.double() / scale, want.grad)
        assert err <= 1.1 * err_u, f"{name}: relative error {err:.3e}, the unfused path's {err_u:.3e}"
        assert zeros <= zeros_u, f"{name}: {zeros} elements zero (the unfused path: {zeros_u})"


@pytest.mark.parametrize("device", DEVICES)
def test_float16_gradients_come_back_in_float32(device):
    # the raw op's float16 gradients are float32 (scaled by the backward, rounded by autograd);
    # its fake kernel says the same, so torch.compile plans the same dtypes
    from torch._subclasses.fake_tensor import FakeTensorMode
    op = torch.ops.opsmith.fused_linear_cross_entropy_fwd.default
    for dtype, gd in ((torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)):
        h, w, b, t = make(9, 8, 20, dtype, device)
        out = op(h, w, t, b, -100, 0.0, 0.0, 0.0, 2, 0, True, True, True)
        assert [x.dtype for x in out[2:5]] == [gd] * 3, f"{dtype}: {[x.dtype for x in out[2:5]]}"
        with FakeTensorMode() as mode:
            fake = op(*(mode.from_tensor(x) for x in (h, w, t, b)), -100, 0.0, 0.0, 0.0, 2, 0, True, True, True)
        assert [(x.dtype, x.shape) for x in fake[2:5]] == [(x.dtype, x.shape) for x in out[2:5]], str(dtype)


@CUDA
def test_cuda_memory_stays_in_budget():
    # the whole bf16 logits would be 256 MiB: the call takes a chunk of them (32 MiB here), cuBLASLt's
    # 32 MiB and a float32 dweight accumulator (32 MiB), never the whole
    n, d, v = 4096, 256, 32768
    h, w, b, t = make(n, d, v, torch.bfloat16, "cuda", bias=False)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = fused_linear_cross_entropy(hg, wg, t, chunk_size=512)
    loss.backward()
    torch.cuda.synchronize()
    grads = hg.grad.numel() * 2 + wg.grad.numel() * 2
    extra = torch.cuda.max_memory_allocated() - base - grads
    assert extra < n * v * 2 // 2, f"extra memory {extra / 2**20:.1f} MiB (the logits: {n * v * 2 / 2**20:.0f} MiB)"


@CUDA
def test_cuda_graph_capture():
    h, w, b, t = make(64, 32, 300, torch.bfloat16, "cuda")
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    eager = fused_linear_cross_entropy(h, w, t, b, chunk_size=16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_linear_cross_entropy(h, w, t, b, chunk_size=16)  # warm-up (cuBLASLt handle)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_linear_cross_entropy(h, w, t, b, chunk_size=16)
    out.fill_(float("nan"))  # the replay must write it
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)


def test_chunk_budget_variable():
    # OPSMITH_FLCE_CHUNK_MB sets the default chunk's memory (read once, so in a fresh process): 16 MiB of
    # float32 logits at V = 8192 is 512 tokens, so the default call equals chunk_size=512 bit for bit
    # (and, at 600 tokens, differs from one chunk of all 600, whose weight gradient sums in another order)
    import os
    import subprocess
    import sys
    code = (
        "import torch, opsmith\n"
        "g = torch.Generator().manual_seed(0)\n"
        "h = torch.randn(600, 16, generator=g, requires_grad=True)\n"
        "w = (torch.randn(8192, 16, generator=g) * 0.3).requires_grad_()\n"
        "t = torch.randint(0, 8192, (600,), generator=g)\n"
        "def run(chunk):\n"
        "    h.grad = w.grad = None\n"
        "    opsmith.fused_linear_cross_entropy(h, w, t, chunk_size=chunk).backward()\n"
        "    return w.grad.clone()\n"
        "d, c512, c600 = run(None), run(512), run(600)\n"
        "print(torch.equal(d, c512), torch.equal(c512, c600))\n")
    env = dict(os.environ, OPSMITH_FLCE_CHUNK_MB="16")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    same_as_512, chunks_alike = out.stdout.split()[-2:]
    if chunks_alike == "True":
        pytest.skip("one chunk and two give the same bits here: the chunk cannot be told from the result")
    assert same_as_512 == "True", "OPSMITH_FLCE_CHUNK_MB=16 should make the default chunk 512 tokens"
