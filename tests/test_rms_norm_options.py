"""RMSNorm's options, on the CPU and CUDA: mixed dtypes (a float32 weight with
16-bit x, as models keep norm weights under mixed precision), the weight
offset (Gemma's 1 + weight), the casting modes of Hugging Face's Llama and
Gemma norms (matched against those modules' own arithmetic), the in-place
backward (dx written over the incoming gradient), and their errors, through
both routes, opcheck and torch.compile."""
import pytest
import torch
import torch.nn.functional as F

import opsmith
from opsmith.ops.rms_norm import rms_norm_pybind

HALF = [torch.bfloat16, torch.float16]
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def rand(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=torch.float32).to(device=device, dtype=dtype)


def llama_rms_norm(x, w, eps):
    # Hugging Face LlamaRMSNorm.forward
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def gemma_rms_norm(x, w, eps):
    # Hugging Face GemmaRMSNorm.forward
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).type_as(x)


def reference(x, w, eps, offset=0.0):
    """float64 forward and gradients of (offset + w) * x_hat"""
    x64 = x.detach().double().cpu().requires_grad_()
    w64 = None if w is None else w.detach().double().cpu().requires_grad_()
    y = F.rms_norm(x64, (x.shape[-1],), None, eps)
    if w64 is not None:
        y = y * (offset + w64)
    return x64, w64, y


def assert_close(got, want, tol, what):
    got = got.detach().double().cpu()
    want = want.detach().double().cpu()
    err = (got - want).abs().max().item()
    bound = tol * max(1.0, want.abs().max().item())
    assert err <= bound, f"{what}: max|err| {err:.3g} > {bound:.3g}"


def assert_same_roundings(got, want, x_dtype):
    """The module's roundings in the same places: almost every element equal
    to the bit, the rest one rounding step of x's dtype away (where the
    float32 x_hat of two computations lands on either side of a rounding
    boundary)."""
    assert got.dtype == want.dtype
    if x_dtype == torch.float32:
        # no 16-bit rounding to share: the two rsqrt computations differ in the last bits
        assert_close(got, want, 1e-5, "y against the module")
        return
    same = (got == want).double().mean().item()
    assert same >= 0.99, f"only {same:.2%} of the elements equal the module's"
    assert_close(got, want, torch.finfo(x_dtype).eps, "y against the module")


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["y_like_x", "y_float32"])
@pytest.mark.parametrize("n", [37, 1024, 4096, 8192, 16384])  # 8192+: the ring forward, staged backward on CUDA
def test_float32_weight_with_16bit_x(device, dtype, out_dtype, n):
    x = rand(300, n, dtype=dtype, device=device).requires_grad_()
    w = (1 + 0.1 * rand(n, device=device)).requires_grad_()
    y = opsmith.rms_norm(x, w, 1e-6, out_dtype=out_dtype)
    assert y.dtype == (out_dtype or dtype)
    x64, w64, y64 = reference(x, w, 1e-6)
    assert_close(y, y64, TOL[dtype], "y")
    dy = rand(300, n, dtype=y.dtype, device=device)
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    dx64, dw64 = torch.autograd.grad(y64, [x64, w64], dy.double().cpu())
    assert dx.dtype == dtype and dw.dtype == torch.float32
    assert_close(dx, dx64, TOL[dtype], "dx")
    assert_close(dw, dw64, TOL[dtype] * 4, "dweight")


@pytest.mark.parametrize("dtype", HALF + [torch.float32], ids=str)
@pytest.mark.parametrize("weight_dtype", [None, torch.float32], ids=["weight_like_x", "weight_float32"])
def test_llama_casting_is_llama_rms_norm(device, dtype, weight_dtype):
    n = 2048
    x = rand(64, n, dtype=dtype, device=device).requires_grad_()
    w = (1 + 0.1 * rand(n, device=device)).to(weight_dtype or dtype).requires_grad_()
    y = opsmith.rms_norm(x, w, 1e-6, casting_mode="llama")
    want = llama_rms_norm(x, w, 1e-6)
    assert y.dtype == want.dtype, (y.dtype, want.dtype)
    assert_same_roundings(y, want, dtype)
    dy = torch.randn_like(want)
    got = torch.autograd.grad(y, [x, w], dy)
    ref = torch.autograd.grad(llama_rms_norm(x.double(), w.double(), 1e-6), [x, w], dy.double())
    assert_close(got[0], ref[0], TOL[dtype], "dx")
    assert_close(got[1], ref[1], TOL[dtype] * 4, "dweight")


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("weight_dtype", [None, torch.float32], ids=["weight_like_x", "weight_float32"])
def test_gemma_casting_and_offset_is_gemma_rms_norm(device, dtype, weight_dtype):
    n = 1024
    x = rand(64, n, dtype=dtype, device=device).requires_grad_()
    w = (0.1 * rand(n, device=device)).to(weight_dtype or dtype).requires_grad_()
    y = opsmith.rms_norm(x, w, 1e-6, offset=1.0, casting_mode="gemma")
    want = gemma_rms_norm(x, w, 1e-6)
    assert y.dtype == want.dtype == dtype
    assert_same_roundings(y, want, dtype)
    x64, w64, y64 = reference(x, w, 1e-6, offset=1.0)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, w], dy)
    ref = torch.autograd.grad(y64, [x64, w64], dy.double().cpu())
    assert_close(got[0], ref[0], TOL[dtype], "dx")
    assert_close(got[1], ref[1], TOL[dtype] * 4, "dweight")


def test_offset_gradcheck():
    x = torch.randn(5, 13, dtype=torch.float64, requires_grad=True)
    w = torch.randn(13, dtype=torch.float64, requires_grad=True)
    for casting in ("none", "gemma"):
        assert torch.autograd.gradcheck(lambda a, b: opsmith.rms_norm(a, b, 1e-6, offset=0.75, casting_mode=casting),
                                        (x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inplace_backward_writes_dx_over_the_gradient(device, dtype):
    x = rand(128, 512, dtype=dtype, device=device)
    w = (1 + 0.1 * rand(512, device=device)).to(dtype)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    c = rand(128, 512, dtype=dtype, device=device)
    (opsmith.rms_norm(xa, wa, 1e-6) * c).sum().backward()
    y = opsmith.rms_norm(xb, wb, 1e-6, inplace_backward=True)
    # dy = c, made by the product's backward: a gradient nothing else holds
    # (nothing from Python may touch it: a Python reference is a holder too,
    # so the path is read from the profiler's op names)
    from harness import opsmith_ops_run

    ops = opsmith_ops_run(lambda: (y * c).sum().backward())
    # The same values, not always the same bits: on CUDA a short batch's
    # backward apart from dy takes the split plan (dweight summed beside the
    # rows), which cannot read dy while dx is written over it.
    # (dweight sums 128 rows: its absolute error scales with them)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(xb.grad, xa.grad, **tol)
    torch.testing.assert_close(wb.grad, wa.grad, **tol)
    # the memory saving is real: the in-place backward ran
    assert "opsmith::rms_norm_bwd_" in ops and "opsmith::rms_norm_bwd" not in ops, sorted(ops)


@pytest.mark.parametrize("use", ["residual", "view_and_residual", "caller_holds_dy", "twice"])
def test_inplace_backward_leaves_a_shared_gradient(device, use):
    # where autograd hands y's gradient to another reader too (y + x passes
    # one tensor to both sides; a view of y shares its storage; the caller
    # keeps the gradient it passed), dx must not be written over it
    x = rand(64, 256, device=device)
    w = (1 + 0.1 * rand(256, device=device))
    dy = rand(64, 256, device=device)
    grads = []
    for inplace in (False, True):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = opsmith.rms_norm(xs, ws, 1e-6, inplace_backward=inplace)
        g = dy.clone()
        keep = g.clone()
        if use == "residual":
            (y + xs).backward(g)
        elif use == "view_and_residual":
            (y.view(-1) + xs.view(-1)).backward(g.view(-1))
        elif use == "caller_holds_dy":
            y.backward(g)
            assert torch.equal(g, keep), "the caller's gradient was overwritten"
        else:
            (y + y).backward(g)
        grads.append((xs.grad, ws.grad))
    (xa, wa), (xb, wb) = grads
    torch.testing.assert_close(xb, xa, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wb, wa, rtol=1e-5, atol=1e-4)


def test_inplace_backward_falls_back_where_it_cannot(device):
    x = rand(16, 256, dtype=torch.bfloat16, device=device).requires_grad_()
    w = rand(256, device=device).requires_grad_()
    # y float32, x bfloat16: dx cannot live in dy's memory
    y = opsmith.rms_norm(x, w, 1e-6, out_dtype=torch.float32, inplace_backward=True)
    dy = torch.randn_like(y)
    keep = dy.clone()
    y.backward(dy)
    assert torch.equal(dy, keep) and x.grad.dtype == torch.bfloat16
    # a gradient with a graph of its own (create_graph) is not overwritten
    x2 = rand(16, 256, device=device).requires_grad_()
    y2 = opsmith.rms_norm(x2, None, 1e-6, inplace_backward=True)
    dy2 = torch.randn_like(y2).requires_grad_()
    keep2 = dy2.detach().clone()
    (dx2,) = torch.autograd.grad(y2, [x2], dy2, create_graph=True)
    assert torch.equal(dy2.detach(), keep2)


def test_options_under_compile_fullgraph(device):
    x = rand(64, 768, dtype=torch.bfloat16, device=device)
    w = (0.1 * rand(768, device=device)).requires_grad_()

    def f(a, b):
        return opsmith.rms_norm(a, b, 1e-6, offset=1.0, casting_mode="llama", inplace_backward=True)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = f(xa, w), compiled(xb, w)
    assert ya.dtype == yb.dtype == torch.float32
    assert torch.equal(ya, yb)
    dy = torch.randn_like(ya)
    ga = torch.autograd.grad(ya, [xa, w], dy.clone())
    gb = torch.autograd.grad(yb, [xb, w], dy.clone())
    for a, b in zip(ga, gb):
        assert torch.equal(a, b)


def test_opcheck_with_options(device):
    x = rand(8, 64, dtype=torch.bfloat16, device=device)
    w = rand(64, device=device)
    y, inv = torch.ops.opsmith.rms_norm_fwd(x, w, 1e-6, 1.0, "llama", torch.float32, False)
    dy = torch.randn_like(y)
    dy16 = torch.randn_like(x)
    torch.library.opcheck(torch.ops.opsmith.rms_norm_fwd.default,
                          (x.requires_grad_(), w.requires_grad_(), 1e-6, 1.0, "llama", torch.float32, True))
    torch.library.opcheck(torch.ops.opsmith.rms_norm_bwd.default, (dy, x.detach(), w.detach(), inv, 1.0, "llama"))
    torch.library.opcheck(torch.ops.opsmith.rms_norm_bwd_.default,
                          (dy16, x.detach(), w.detach(), inv, 1.0, "llama"))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_route_a_matches_route_b(device, dtype):
    x = rand(33, 200, dtype=dtype, device=device)
    w = rand(200, device=device)
    for kwargs in ({}, {"casting_mode": "llama"}, {"offset": 1.0, "casting_mode": "gemma"},
                   {"out_dtype": torch.float32}):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
        ya, yb = opsmith.rms_norm(xa, wa, 1e-6, **kwargs), rms_norm_pybind(xb, wb, 1e-6, **kwargs)
        assert ya.dtype == yb.dtype and torch.equal(ya, yb), kwargs
        dy = torch.randn_like(ya)
        ya.backward(dy), yb.backward(dy)
        assert torch.equal(xa.grad, xb.grad) and torch.equal(wa.grad, wb.grad), kwargs


def test_bad_options(device):
    x = rand(4, 8, dtype=torch.bfloat16, device=device)
    w = rand(8, device=device)
    with pytest.raises(ValueError, match=r"^rms_norm: casting_mode must be 'none', 'llama' or 'gemma', got 'mistral'"):
        opsmith.rms_norm(x, w, casting_mode="mistral")
    with pytest.raises(RuntimeError, match=r"^rms_norm: casting_mode must be 'none', 'llama' or 'gemma', got 'x'"):
        torch.ops.opsmith.rms_norm_fwd(x, w, None, 0.0, "x")
    with pytest.raises(RuntimeError, match=r"^rms_norm: offset \(1\) scales the weight: it needs a weight"):
        opsmith.rms_norm(x, None, offset=1.0)
    with pytest.raises(RuntimeError, match=r"^rms_norm: offset must be finite, got inf"):
        opsmith.rms_norm(x, w, offset=float("inf"))
    with pytest.raises(RuntimeError, match=r"^rms_norm: weight must have the dtype of x \(Float\), got BFloat16"):
        opsmith.rms_norm(x.float(), w.bfloat16())
    with pytest.raises(RuntimeError, match=r"^rms_norm: weight must have the dtype of x \(BFloat16\) or float32, got Half"):
        opsmith.rms_norm(x, w.half())
    with pytest.raises(RuntimeError, match=r"^rms_norm: out_dtype must be x's dtype \(BFloat16\), or float32 with a float32 weight, got Float"):
        opsmith.rms_norm(x, w.bfloat16(), out_dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"^rms_norm: out_dtype must be x's dtype \(BFloat16\) or float32, got Half"):
        opsmith.rms_norm(x, w, out_dtype=torch.float16)
    _, inv = torch.ops.opsmith.rms_norm_fwd(x, w, 1e-6)
    with pytest.raises(RuntimeError, match=r"^rms_norm: the in-place backward needs dy in x's dtype"):
        torch.ops.opsmith.rms_norm_bwd_(torch.randn(4, 8, device=device), x, w, inv)


def test_module_options_and_autocast():
    m = opsmith.nn.RMSNorm(64, eps=1e-6, offset=1.0, casting_mode="gemma")
    assert torch.equal(m.weight, torch.zeros(64)), "the weight starts where offset + weight = 1"
    assert "offset=1.0" in repr(m) and "gemma" in repr(m)
    ref = torch.nn.RMSNorm(64, eps=1e-6)
    m.load_state_dict({"weight": ref.weight.detach() - 1.0})
    x = torch.randn(3, 5, 64)
    assert_close(m(x), ref(x), 1e-6, "offset module against torch.nn.RMSNorm")
    # autocast: the float32 module weight meets bfloat16 activations
    lin = torch.nn.Linear(64, 64)
    norm = opsmith.nn.RMSNorm(64, eps=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = lin(torch.randn(4, 64))
        assert h.dtype == torch.bfloat16
        y = norm(h)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert norm.weight.grad.dtype == torch.float32 and torch.isfinite(norm.weight.grad).all()
    assert lin.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="casting_mode"):
        opsmith.nn.RMSNorm(8, casting_mode="bad")
    with pytest.raises(ValueError, match="offset scales the weight"):
        opsmith.nn.RMSNorm(8, elementwise_affine=False, offset=1.0)
