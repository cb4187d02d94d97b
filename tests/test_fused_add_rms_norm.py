"""What only the residual-add RMSNorm has (the spec harnesses cover the rest):
equality with the unfused sequence ``h = x + residual; opsmith.rms_norm(h)``
(forward and backward, every dtype, the float32-weight mix, each casting mode,
an offset, odd widths, strided inputs), a float64 reference, one of the two
gradients absent, the in-place inference form, the nn module and its state
dict, errors naming the argument, both routes, opcheck and torch.compile."""
import pytest
import torch
import torch.nn.functional as F

import opsmith
from opsmith.ops.fused_add_rms_norm import fused_add_rms_norm_pybind, fused_add_rms_norm_pybind_

from conftest import requires_cuda
from harness import poison_allocator

COMBOS = [(torch.float64, torch.float64), (torch.float32, torch.float32), (torch.float16, torch.float16),
          (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float32)]
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
EPS = 1e-6


def rand(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=torch.float32).to(device=device, dtype=dtype)


def ulps(got, want):
    """max distance in units of the last place of want's dtype (0 on equal bits)"""
    assert got.dtype == want.dtype and got.shape == want.shape
    if torch.equal(got, want):
        return 0.0
    g, w = got.double(), want.double()
    spacing = torch.finfo(want.dtype).eps * torch.maximum(w.abs(), torch.full_like(w, torch.finfo(want.dtype).tiny))
    return ((g - w).abs() / spacing).max().item()


def row_ulps(got, want):
    """max distance in units of the last place of each row's largest |want|.
    A gradient is a difference of terms of the row's scale (dy * w against
    x_hat times a row sum, plus dh): where it cancels to near zero, a 1-ulp
    change in the row sum (another CUDA plan, another summation order) is
    many ulps of the small result but never more than a few of the row."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double(), want.double()
    scale = w.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(want.dtype).tiny)
    return ((g - w).abs() / (torch.finfo(want.dtype).eps * scale)).max().item()


GRAD_ROW_ULPS = 4  # the gradients on CUDA against the unfused op (CPU: the same bits)


def assert_close(got, want, tol, what):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    err = (got - want).abs().max().item()
    bound = tol * max(1.0, want.abs().max().item())
    assert err <= bound, f"{what}: max|err| {err:.3g} > {bound:.3g}"


def unfused(x, r, w, offset, casting_mode, dys=None):
    """the sequence the op fuses, through autograd: (y, h) and the grads"""
    xs, rs, ws = (t.detach().clone().requires_grad_() for t in (x, r, w))
    h = xs + rs
    y = opsmith.rms_norm(h, ws, EPS, offset=offset, casting_mode=casting_mode)
    if dys is None:
        return y, h
    dy, dh = dys
    outs, grads = zip(*[(o, g) for o, g in ((y, dy), (h, dh)) if g is not None])
    gx, gr, gw = torch.autograd.grad(outs, (xs, rs, ws), grads, allow_unused=True)
    return y, h, gx, gr, gw


def fused(fn, x, r, w, offset, casting_mode, dys):
    xs, rs, ws = (t.detach().clone().requires_grad_() for t in (x, r, w))
    n = x.numel() * x.element_size()
    poison_allocator(x.device, n, n, n)  # unwritten elements read as NaN
    y, h = fn(xs, rs, ws, EPS, offset=offset, casting_mode=casting_mode)
    dy, dh = dys
    outs, grads = zip(*[(o, g) for o, g in ((y, dy), (h, dh)) if g is not None])
    gx, gr, gw = torch.autograd.grad(outs, (xs, rs, ws), grads, allow_unused=True)
    return y, h, gx, gr, gw


@pytest.mark.parametrize("x_dtype,w_dtype", COMBOS, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("casting_mode,offset", [("none", 0.0), ("llama", 0.0), ("gemma", 1.0), ("none", 1.0)])
@pytest.mark.parametrize("shape", [(5, 37), (2, 3, 1024), (33, 4096)], ids=str)
def test_matches_unfused(device, x_dtype, w_dtype, casting_mode, offset, shape):
    # the fused op against h = x + residual then opsmith.rms_norm: h to the
    # bit, y, dx, dresidual and dweight to the bit or within 1 ulp
    x, r = rand(*shape, dtype=x_dtype, device=device), rand(*shape, dtype=x_dtype, device=device)
    w = rand(shape[-1], dtype=w_dtype, device=device)
    y_u, h_u, gx_u, gr_u, gw_u = unfused(x, r, w, offset, casting_mode, dys := (
        rand(*shape, dtype=opsmith.rms_norm(x, w, casting_mode=casting_mode).dtype, device=device),
        rand(*shape, dtype=x_dtype, device=device)))
    for fn in (opsmith.fused_add_rms_norm, fused_add_rms_norm_pybind):
        y, h, gx, gr, gw = fused(fn, x, r, w, offset, casting_mode, dys)
        assert y.dtype == y_u.dtype and h.dtype == x_dtype and gx.dtype == x_dtype and gw.dtype == w_dtype
        assert torch.equal(h, h_u), "h must be x + residual rounded once, as PyTorch's add"
        assert torch.equal(gx, gr), "x and residual get the same gradient"
        assert ulps(y, y_u) <= 1, f"{fn.__name__} y: {ulps(y, y_u)} ulps from the unfused op"
        for name, got, want in (("dx", gx, gx_u), ("dresidual", gr, gr_u)):
            err = row_ulps(got, want)
            assert err <= GRAD_ROW_ULPS, f"{fn.__name__} {name}: {err} row ulps from the unfused op"
        assert_close(gw, gw_u, TOL[x_dtype], f"{fn.__name__} dweight")
        if device == "cpu":
            # the same row loops as rms_norm's: the same bits
            assert torch.equal(y, y_u) and torch.equal(gx, gx_u) and torch.equal(gw, gw_u)


@pytest.mark.parametrize("x_dtype,r_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                             (torch.float16, torch.float32), (torch.bfloat16, torch.float16)],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_mixed_residual_dtype_adds_as_torch(device, x_dtype, r_dtype):
    # a 16-bit sublayer output beside a float32 residual stream (autocast):
    # h = x + residual in the promoted dtype, as the unfused add gives, and
    # each input's gradient in its own dtype
    x, r = rand(3, 5, 96, dtype=x_dtype, device=device), rand(3, 5, 96, dtype=r_dtype, device=device)
    hd = torch.promote_types(x_dtype, r_dtype)
    w = rand(96, dtype=torch.float32, device=device)
    dys = (rand(3, 5, 96, dtype=hd, device=device), rand(3, 5, 96, dtype=hd, device=device))
    y_u, h_u, gx_u, gr_u, gw_u = unfused(x, r, w, 0.0, "none", dys)
    for fn in (opsmith.fused_add_rms_norm, fused_add_rms_norm_pybind):
        y, h, gx, gr, gw = fused(fn, x, r, w, 0.0, "none", dys)
        assert (y.dtype, h.dtype, gx.dtype, gr.dtype, gw.dtype) == (hd, hd, x_dtype, r_dtype, torch.float32)
        assert torch.equal(h, h_u), "h must be x + residual in the promoted dtype"
        assert ulps(y, y_u) <= 1
        for name, got, want in (("dx", gx, gx_u), ("dresidual", gr, gr_u)):
            assert row_ulps(got, want) <= GRAD_ROW_ULPS, f"{fn.__name__} {name}"
        assert_close(gw, gw_u, TOL[hd], f"{fn.__name__} dweight")
    if r_dtype == hd:  # in place: h over the residual stream, x converted
        for fn in (opsmith.fused_add_rms_norm_, fused_add_rms_norm_pybind_):
            r2 = r.clone()
            with torch.no_grad():
                y = fn(x, r2, w, EPS)
            assert torch.equal(r2, h_u) and ulps(y, y_u) <= 1


def test_module_under_autocast_with_a_float32_residual():
    # Hugging Face's pattern: the residual stream stays float32, the sublayer
    # (a Linear under autocast) returns bfloat16; FusedAddRMSNorm must replace
    # the unfused add and norm
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    norm = opsmith.nn.FusedAddRMSNorm(64)
    ref = opsmith.nn.RMSNorm(64, eps=1e-6)
    x = torch.randn(4, 7, 64, requires_grad=True)
    outs = []
    for fused_path in (True, False):
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = lin(x)
            y, h = norm(a, x) if fused_path else (ref(a + x), a + x)
        assert a.dtype == torch.bfloat16 and h.dtype == y.dtype == torch.float32
        (y.square().sum() + h.sum()).backward()
        outs.append((y.detach(), h.detach(), x.grad.clone()))
    (yf, hf, gf), (yu, hu, gu) = outs
    assert torch.equal(hf, hu)
    assert_close(yf, yu, 1e-5, "y")
    assert_close(gf, gu, 1e-5, "x.grad")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 127, 4099])
def test_float64_reference(device, dtype, n):
    # against float64 arithmetic on fresh inputs (h rounded to dtype as the op stores it)
    x, r, w = rand(6, n, dtype=dtype, device=device), rand(6, n, dtype=dtype, device=device), rand(n, dtype=dtype, device=device)
    dy, dh = rand(6, n, dtype=dtype, device=device), rand(6, n, dtype=dtype, device=device)
    y, h, gx, _, gw = fused(opsmith.fused_add_rms_norm, x, r, w, 1.0, "none", (dy, dh))
    h64 = (x.double() + r.double()).to(dtype).double().cpu().requires_grad_()
    w64 = w.double().cpu().requires_grad_()
    y64 = F.rms_norm(h64, (n,), None, EPS) * (1.0 + w64)
    gh, gw64 = torch.autograd.grad(y64, (h64, w64), dy.double().cpu())
    assert_close(h, h64, 0.0, "h")
    assert_close(y, y64, TOL[dtype], "y")
    assert_close(gx, gh + dh.double().cpu(), TOL[dtype], "dx")
    assert_close(gw, gw64, TOL[dtype] * 4, "dweight")


def test_non_contiguous(device):
    # strided rows and transposed views go in as the bridge's row views or copies
    base = rand(8, 2 * 300, dtype=torch.bfloat16, device=device)
    x = base[:, ::2]                                 # last dim strided: copied
    r = rand(300, 8, dtype=torch.bfloat16, device=device).t()  # transposed
    wide = rand(8, 320, dtype=torch.bfloat16, device=device)
    r2 = wide[:, 10:310]                             # rows 320 apart: read in place
    w = rand(300, dtype=torch.float32, device=device)
    for xx, rr in ((x, r), (x, r2), (r2, r)):
        y, h = opsmith.fused_add_rms_norm(xx, rr, w)
        y_u, h_u = unfused(xx.contiguous(), rr.contiguous(), w, 0.0, "none")
        assert torch.equal(h, h_u) and ulps(y, y_u) <= 1


@pytest.mark.parametrize("which", ["dy", "dh"])
def test_backward_one_gradient(device, which):
    # only y (or only h) feeds the loss: the other gradient is absent, as zero
    x, r, w = rand(4, 96, device=device), rand(4, 96, device=device), rand(96, device=device)
    dy, dh = rand(4, 96, device=device), rand(4, 96, device=device)
    dys = (dy, None) if which == "dy" else (None, dh)
    for fn in (opsmith.fused_add_rms_norm, fused_add_rms_norm_pybind):
        y, h, gx, gr, gw = fused(fn, x, r, w, 0.0, "none", dys)
        _, _, gx_u, gr_u, gw_u = unfused(x, r, w, 0.0, "none", dys)
        assert torch.equal(gx, gr) and row_ulps(gx, gx_u) <= GRAD_ROW_ULPS
        if device == "cpu":
            assert torch.equal(gx, gx_u)
        if which == "dh":
            assert torch.equal(gx, dh), "only h's gradient: it passes through unchanged"
            assert gw is None or torch.equal(gw, torch.zeros_like(gw))
        else:
            assert_close(gw, gw_u, TOL[torch.float32], "dweight")
    # the raw backward op with either gradient None
    _, h, inv = torch.ops.opsmith.fused_add_rms_norm_fwd(x, r, w, EPS)
    dx, dw = torch.ops.opsmith.fused_add_rms_norm_bwd(None, dh, h, w, inv)
    assert torch.equal(dx, dh) and torch.equal(dw, torch.zeros_like(w))
    dx, dw = torch.ops.opsmith.fused_add_rms_norm_bwd(None, None, h, w, inv)
    assert torch.equal(dx, torch.zeros_like(h)) and torch.equal(dw, torch.zeros_like(w))


@pytest.mark.parametrize("x_dtype,w_dtype", COMBOS, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("casting_mode", ["none", "llama", "gemma"])
def test_inplace_matches_functional(device, x_dtype, w_dtype, casting_mode):
    x, r = rand(9, 515, dtype=x_dtype, device=device), rand(9, 515, dtype=x_dtype, device=device)
    w = rand(515, dtype=w_dtype, device=device)
    y_f, h_f = opsmith.fused_add_rms_norm(x, r, w, offset=0.5, casting_mode=casting_mode)
    for fn in (opsmith.fused_add_rms_norm_, fused_add_rms_norm_pybind_):
        res = r.clone()
        ptr, version = res.data_ptr(), res._version
        with torch.no_grad():
            y = fn(x, res, w, offset=0.5, casting_mode=casting_mode)
        assert res.data_ptr() == ptr and res._version > version, "residual is written in place"
        assert torch.equal(res, h_f), "residual now holds h"
        assert torch.equal(y, y_f) and y.data_ptr() != ptr
    with torch.inference_mode():
        res = r.clone()
        y = opsmith.fused_add_rms_norm_(x, res, w, offset=0.5, casting_mode=casting_mode)
    assert torch.equal(res, h_f) and torch.equal(y, y_f)


def test_inplace_strided_residual(device):
    # rows of residual one stride apart are written where they are; a view
    # whose rows cannot be addressed in place is refused
    x = rand(6, 64, device=device)
    wide = rand(6, 80, device=device)
    w = rand(64, device=device)
    y_f, h_f = opsmith.fused_add_rms_norm(x, wide[:, 8:72], w)
    with torch.no_grad():
        y = opsmith.fused_add_rms_norm_(x, wide[:, 8:72], w)
    assert torch.equal(wide[:, 8:72], h_f) and torch.equal(y, y_f)
    with pytest.raises(RuntimeError, match=r"^fused_add_rms_norm_: residual is written in place"):
        with torch.no_grad():
            opsmith.fused_add_rms_norm_(x, rand(64, 6, device=device).t(), w)


def test_inplace_refuses_autograd(device):
    x, r, w = rand(2, 16, device=device), rand(2, 16, device=device), rand(16, device=device)
    for fn in (opsmith.fused_add_rms_norm_, fused_add_rms_norm_pybind_):
        for args in ((x.requires_grad_(), r, w), (x.detach(), r, w.requires_grad_())):
            with pytest.raises(RuntimeError, match=r"^fused_add_rms_norm_: the in-place form has no autograd"):
                fn(*args)
            x, w = x.detach(), w.detach()
        with torch.no_grad():  # the same inputs without recording: fine
            fn(x.requires_grad_(), r.clone(), w)
        x = x.detach()


def test_module_and_state_dict(device):
    m = opsmith.nn.FusedAddRMSNorm(64, eps=EPS, offset=1.0, casting_mode="gemma").to(device)
    assert list(m.state_dict()) == ["weight"] and torch.equal(m.weight, torch.zeros(64, device=device))
    hf_like = {"weight": rand(64, device=device)}
    m.load_state_dict(hf_like)
    x, r = rand(3, 5, 64, device=device), rand(3, 5, 64, device=device)
    y, h = m(x, r)
    y_u, h_u = unfused(x, r, hf_like["weight"], 1.0, "gemma")
    assert torch.equal(h, h_u) and ulps(y, y_u.detach()) <= 1
    y.sum().backward()
    assert m.weight.grad is not None and m.weight.grad.shape == (64,)
    assert "offset=1.0" in repr(m) and "gemma" in repr(m)
    with pytest.raises(RuntimeError, match=r"FusedAddRMSNorm: expected input with shape \[\*, 64\]"):
        m(rand(3, 63, device=device), rand(3, 63, device=device))
    with pytest.raises(ValueError, match="casting_mode"):
        opsmith.nn.FusedAddRMSNorm(64, casting_mode="fp8")


def test_bad_inputs_name_the_argument(device):
    x, r, w = rand(4, 32, device=device), rand(4, 32, device=device), rand(32, device=device)
    cases = [
        ((x, r[:, :31], w), r"^fused_add_rms_norm: residual must have the shape of x \[4, 32\], got \[4, 31\]"),
        ((x, r, w[:31]), r"^fused_add_rms_norm: weight must have shape \[32\] \(last dim of x\), got \[31\]"),
        ((x.half(), r.half(), w.double()), r"^fused_add_rms_norm: weight must have the dtype of x \(Half\) or float32"),
        ((x.int(), r.int(), w), r"^fused_add_rms_norm: x must be float64, float32, float16 or bfloat16, got Int"),
    ]
    for args, msg in cases:
        for fn in (opsmith.fused_add_rms_norm, fused_add_rms_norm_pybind):
            with pytest.raises(RuntimeError, match=msg):
                fn(*args)
        with torch.no_grad(), pytest.raises(RuntimeError, match=msg.replace("norm:", "norm_?:")):
            opsmith.fused_add_rms_norm_(*[a.clone() for a in args])
    with pytest.raises(RuntimeError, match=r"^fused_add_rms_norm: eps must be a finite number >= 0, got -1"):
        opsmith.fused_add_rms_norm(x, r, w, -1.0)
    with pytest.raises(ValueError, match=r"^fused_add_rms_norm: casting_mode must be"):
        opsmith.fused_add_rms_norm(x, r, w, casting_mode="LLAMA")
    for fn, name in ((opsmith.fused_add_rms_norm, "fused_add_rms_norm"), (fused_add_rms_norm_pybind, "fused_add_rms_norm"),
                     (opsmith.fused_add_rms_norm_, "fused_add_rms_norm_")):
        with torch.no_grad(), pytest.raises(TypeError, match=rf"^{name}: weight must be a tensor of the hidden size "
                                                               r"\(this norm always has one\), got NoneType"):
            fn(x, r.clone(), None)
    # the functions add in the promoted dtype, which the weight must suit
    for fn in (opsmith.fused_add_rms_norm, fused_add_rms_norm_pybind, opsmith.fused_add_rms_norm_):
        with torch.no_grad(), pytest.raises(RuntimeError, match=r"^fused_add_rms_norm_?: weight must have the dtype "
                                                                 r"of x \+ residual \(Double\), got Float$"):
            fn(x, r.double(), w)
    # the raw op takes one dtype; the functions promote (test_mixed_residual_dtype_adds_as_torch)
    with pytest.raises(RuntimeError, match=r"^fused_add_rms_norm: residual must have the dtype of x \(Float\), got Double"):
        torch.ops.opsmith.fused_add_rms_norm_fwd(x, r.double(), w, EPS)
    for fn in (opsmith.fused_add_rms_norm_, fused_add_rms_norm_pybind_):
        with torch.no_grad(), pytest.raises(RuntimeError, match=r"^fused_add_rms_norm_: residual must hold h = x \+ "
                                                                 r"residual, which is torch.float32 \(x torch.float32, "
                                                                 r"residual torch.bfloat16\)"):
            fn(x, r.bfloat16(), w)
    _, h, inv = torch.ops.opsmith.fused_add_rms_norm_fwd(x, r, w, EPS)
    with pytest.raises(RuntimeError, match=r"^fused_add_rms_norm: dh must have the dtype of h \(Float\), got Double"):
        torch.ops.opsmith.fused_add_rms_norm_bwd(x, x.double(), h, w, inv)
    with pytest.raises(RuntimeError, match=r"^fused_add_rms_norm: inv_rms must have shape h.shape\[:-1\]"):
        torch.ops.opsmith.fused_add_rms_norm_bwd(x, None, h, w, inv[:3])


def test_double_backward_and_jvp_refused():
    x, r, w = rand(3, 8).requires_grad_(), rand(3, 8).requires_grad_(), rand(8).requires_grad_()
    y, h = opsmith.fused_add_rms_norm(x, r, w)
    (gx,) = torch.autograd.grad((y * y).sum() + h.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"^fused_add_rms_norm: double backward is not supported"):
        gx.sum().backward()
    with pytest.raises(RuntimeError, match=r"^fused_add_rms_norm: forward-mode AD is not supported"):
        torch.func.jvp(lambda a: opsmith.fused_add_rms_norm(a, r.detach(), w.detach())[0], (x.detach(),),
                       (torch.ones_like(x),))


def test_opcheck_inplace(device):
    x, r, w = rand(4, 40, device=device), rand(4, 40, device=device), rand(40, device=device)
    torch.library.opcheck(torch.ops.opsmith.fused_add_rms_norm_.default, (x, r.clone(), w, EPS, 1.0, "llama"))
    torch.library.opcheck(torch.ops.opsmith.fused_add_rms_norm_fwd.default, (x, r, w, EPS, 0.0, "gemma"))


def test_compile_fullgraph(device):
    # forward and backward traced as one graph, and the in-place form under no_grad
    torch._dynamo.reset()
    x, r = rand(6, 128, dtype=torch.bfloat16, device=device), rand(6, 128, dtype=torch.bfloat16, device=device)
    w = rand(128, dtype=torch.float32, device=device)

    def train_step(a, b, c):
        y, h = opsmith.fused_add_rms_norm(a, b, c, casting_mode="llama")
        return y.float().square().sum() + h.float().sum()

    args = [t.clone().requires_grad_() for t in (x, r, w)]
    loss = torch.compile(train_step, fullgraph=True)(*args)
    loss.backward()
    twin = [t.clone().requires_grad_() for t in (x, r, w)]
    loss_e = train_step(*twin)
    loss_e.backward()
    assert_close(loss, loss_e, 1e-5, "compiled loss")
    for a, b in zip(args, twin):
        assert torch.equal(a.grad, b.grad)

    def decode(a, b, c):
        y = opsmith.fused_add_rms_norm_(a, b, c)
        return y, b

    res, res_e = r.clone(), r.clone()
    with torch.no_grad():
        y, h = torch.compile(decode, fullgraph=True)(x, res, w)
        y_e, h_e = decode(x, res_e, w)
    assert torch.equal(y, y_e) and torch.equal(h, h_e) and torch.equal(res, res_e)


@requires_cuda
def test_cuda_kernel_families():
    # decode-sized and many-row calls (the resident and staged plans, the
    # cluster split for wide rows, the ring forward with rows walked by its
    # persistent clusters: 3000 x 8192, 600 x 32768) against the unfused op
    for rows, n in ((1, 4096), (64, 8192), (1024, 4096), (4096, 16384), (300, 12288), (17, 5000), (3000, 8192),
                    (600, 32768), (3, 32768)):  # 3 x 32768: the short batch at 8 packs a thread
        x, r = rand(rows, n, dtype=torch.bfloat16, device="cuda"), rand(rows, n, dtype=torch.bfloat16, device="cuda")
        w = rand(n, dtype=torch.float32, device="cuda")
        dys = (rand(rows, n, dtype=torch.bfloat16, device="cuda"), rand(rows, n, dtype=torch.bfloat16, device="cuda"))
        y, h, gx, _, gw = fused(opsmith.fused_add_rms_norm, x, r, w, 0.0, "none", dys)
        y_u, h_u, gx_u, _, gw_u = unfused(x, r, w, 0.0, "none", dys)
        assert torch.equal(h, h_u), (rows, n)
        assert ulps(y, y_u) <= 1 and row_ulps(gx, gx_u) <= GRAD_ROW_ULPS, (rows, n)
        assert_close(gw, gw_u, TOL[torch.bfloat16], f"dweight {rows}x{n}")
