"""What only layer_norm has (the spec-driven harnesses cover the rest):
nn.LayerNorm's drop-in compatibility with torch.nn.LayerNorm, mixed
activation/parameter dtypes, autocast, the two-pass variance."""
import pytest
import torch
import torch.nn.functional as F

import opsmith
import opsmith.pybind
from conftest import devices

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
DEVICES = devices  # the CUDA entry skips (and is counted) without a GPU
ROUTES = {"route_b": opsmith.layer_norm, "route_a": opsmith.pybind.layer_norm}
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(shape, xd, wd, device, seed=0, affine=(True, True)):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = (torch.randn(shape, generator=g) + 0.5).to(device=device, dtype=xd)
    w = torch.randn(n, generator=g).to(device=device, dtype=wd) if affine[0] else None
    b = torch.randn(n, generator=g).to(device=device, dtype=wd) if affine[1] else None
    dy = torch.randn(shape, generator=g).to(device=device, dtype=xd)
    return x, w, b, dy


def _grads(fn, x, w, b, dy):
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]
    y = fn(*leaves, 1e-5)
    want = [t for t in leaves if t is not None]
    return y, dict(zip([k for k, t in zip("xwb", leaves) if t is not None], torch.autograd.grad(y, want, dy)))


def _close(got, ref, tol, what):
    err = (got.double() - ref).abs().max().item()
    bound = tol * max(1.0, ref.abs().max().item())
    assert err <= bound, f"{what}: max|err| {err:.3e} > {bound:.3e}"


# --- the module --------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [{}, {"bias": False}, {"elementwise_affine": False}, {"eps": 1e-3}])
def test_module_state_dict_matches_torch(kwargs):
    ours, theirs = opsmith.nn.LayerNorm(64, **kwargs), torch.nn.LayerNorm(64, **kwargs)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p))
    ours.load_state_dict(theirs.state_dict())  # strict: same keys, same shapes
    assert ours.eps == theirs.eps and ours.normalized_shape == theirs.normalized_shape
    x = torch.randn(3, 5, 64) + 1
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    assert theirs.load_state_dict(ours.state_dict()) is not None
    assert repr(ours).endswith(repr(theirs)[len("LayerNorm"):])


def test_module_defaults_and_multi_dim_shape():
    m = opsmith.nn.LayerNorm((4, 8))
    t = torch.nn.LayerNorm((4, 8))
    assert torch.equal(m.weight, torch.ones(4, 8)) and torch.equal(m.bias, torch.zeros(4, 8))
    with torch.no_grad():
        t.weight.normal_(), t.bias.normal_()
    m.load_state_dict(t.state_dict())
    x = torch.randn(2, 3, 4, 8, requires_grad=True)
    y, yt = m(x), t(x)
    torch.testing.assert_close(y, yt, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, [x, m.weight, m.bias], dy),
                    torch.autograd.grad(yt, [x, t.weight, t.bias], dy)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match=r"LayerNorm: expected input with shape \[\*, 4, 8\]"):
        m(torch.randn(2, 8, 4))


def test_module_dtype_and_device_arguments():
    m = opsmith.nn.LayerNorm(16, dtype=torch.float64)
    assert m.weight.dtype == torch.float64 and m.bias.dtype == torch.float64
    assert opsmith.nn.LayerNorm(16, bias=False).bias is None


# --- mixed dtypes ------------------------------------------------------------------

PAIRS = [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
         (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("xd,wd", PAIRS, ids=lambda d: str(d).replace("torch.", ""))
def test_output_dtypes_match_torch(xd, wd, route):
    x, w, b, dy = _inputs((6, 40), xd, wd, "cpu")
    y, grads = _grads(ROUTES[route], x, w, b, dy)
    yt, gt = _grads(lambda x, w, b, eps: F.layer_norm(x, (40,), w, b, eps), x, w, b, dy)
    assert y.dtype == yt.dtype == xd
    for k in "xwb":
        assert grads[k].dtype == gt[k].dtype, f"d{k}: {grads[k].dtype} vs torch {gt[k].dtype}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, True)], ids=["w+b", "w", "b"])
@pytest.mark.parametrize("xd,wd", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                   (torch.float64, torch.float32)], ids=["bf16-f32", "f16-f32", "f64-f32"])
@pytest.mark.parametrize("n", [8, 769, 4096])
def test_mixed_dtypes(xd, wd, affine, device, n):
    """Forward and gradients of a mixed pair against float64 F.layer_norm on
    the same (rounded) values; parameter gradients in the parameters' dtype."""
    x, w, b, dy = _inputs((33, n), xd, wd, device, seed=n, affine=affine)
    for route, fn in ROUTES.items():
        y, grads = _grads(fn, x, w, b, dy)
        ref, rgrads = _grads(lambda x, w, b, eps: F.layer_norm(x, (n,), w, b, eps),
                             *[None if t is None else t.double() for t in (x, w, b, dy)])
        tol = max(TOL[xd], TOL[wd])
        assert y.dtype == xd
        _close(y, ref, tol, f"{route} y")
        _close(grads["x"], rgrads["x"], tol, f"{route} dx")
        for k in "wb":
            if k in grads:
                assert grads[k].dtype == wd
                # a sum over rows of x-dtype products, kept in float32
                _close(grads[k], rgrads[k], 4 * TOL[torch.float32] * 33, f"{route} d{k}")


@needs_cuda
@pytest.mark.parametrize("xd", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("n", [1024, 4096, 24576])
def test_cuda_mixed_dtypes_at_training_sizes(xd, n):
    """16-bit x with float32 weight and bias (autocast's pair) past the short
    batch: the many-rows and ring forwards, the staged backward."""
    rows = 300
    x, w, b, dy = _inputs((rows, n), xd, torch.float32, "cuda", seed=n + 1, affine=(True, True))
    for route, fn in ROUTES.items():
        y, grads = _grads(fn, x, w, b, dy)
        ref, rgrads = _grads(lambda x, w, b, eps: F.layer_norm(x, (n,), w, b, eps),
                             *[t.double() for t in (x, w, b, dy)])
        assert y.dtype == xd
        _close(y, ref, TOL[xd], f"{route} y")
        _close(grads["x"], rgrads["x"], TOL[xd], f"{route} dx")
        for k in "wb":
            assert grads[k].dtype == torch.float32
            _close(grads[k], rgrads[k], 4 * TOL[torch.float32] * rows, f"{route} d{k}")


@needs_cuda
@pytest.mark.parametrize("shape,xd", [((3, 32768), torch.bfloat16), ((65600, 258), torch.float64),
                                      ((70000, 7), torch.float32)], ids=["3x32768-bf16", "65600x258-f64", "70000x7-f32"])
def test_cuda_plans_at_the_edges(shape, xd):
    """The short batch at 8 packs a thread in 16-bit, the resident forward
    and generic kernels past 65535 rows (a grid's y limit), against float64."""
    x, w, b, dy = _inputs(shape, xd, xd, "cuda", seed=shape[0])
    y, grads = _grads(opsmith.layer_norm, x, w, b, dy)
    ref, rgrads = _grads(lambda x, w, b, eps: F.layer_norm(x, (shape[-1],), w, b, eps),
                         *[t.double() for t in (x, w, b, dy)])
    _close(y, ref, TOL[xd], "y")
    _close(grads["x"], rgrads["x"], TOL[xd], "dx")
    for k in "wb":
        # sums over the rows, rounding with their count
        _close(grads[k], rgrads[k], TOL[xd] * shape[0] ** 0.5, f"d{k}")


def test_float64_x_with_float32_weight():
    # PyTorch refuses this pair on the CPU; opsmith takes it (output float64)
    x, w, b, _ = _inputs((4, 16), torch.float64, torch.float32, "cpu")
    y = opsmith.layer_norm(x, w, b)
    assert y.dtype == torch.float64
    _close(y, F.layer_norm(x, (16,), w.double(), b.double()), 1e-6, "y")


@pytest.mark.parametrize("wd", [torch.float16, torch.float64])
def test_unsupported_parameter_dtype_named(wd):
    x, w, b, _ = _inputs((4, 16), torch.bfloat16, wd, "cpu")
    with pytest.raises(RuntimeError, match=r"^layer_norm: weight must have the dtype of x \(BFloat16\) or float32"):
        opsmith.layer_norm(x, w, b)
    with pytest.raises(RuntimeError, match=r"^layer_norm: bias must have the dtype of x \(BFloat16\) or float32"):
        opsmith.layer_norm(x, None, b)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "fused_add_rms_norm"])
def test_normalized_shape_in_the_weight_place_named(op):
    # F.layer_norm(x, (n,), w) / F.rms_norm(x, (n,), w) carried over: a
    # TypeError naming the argument, not the dispatcher's schema dump
    x = torch.randn(2, 3, 8)
    args = {"layer_norm": (x, (8,)), "rms_norm": (x, [8]), "fused_add_rms_norm": (x, x, torch.Size([8]))}[op]
    with pytest.raises(TypeError, match=rf"^{op}: weight must be a tensor( or None)?, got \w+ .*8.*normalized_shape"):
        getattr(opsmith, op)(*args)
    if op == "layer_norm":
        with pytest.raises(TypeError, match=r"^layer_norm: bias must be a tensor or None, got int 8"):
            opsmith.layer_norm(x, torch.ones(8), 8)


def test_bias_only_gradient_dtype():
    x, _, b, dy = _inputs((4, 16), torch.bfloat16, torch.float32, "cpu", affine=(False, True))
    y, grads = _grads(opsmith.layer_norm, x, None, b, dy)
    assert grads["b"].dtype == torch.float32
    _close(grads["b"], dy.double().sum(0), 1e-5 * 4, "dbias = sum of dy")


# --- autocast ------------------------------------------------------------------------

@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("xd", [torch.float32, torch.bfloat16])
def test_autocast_cpu_matches_torch(xd, route):
    # CPU autocast does not touch layer_norm: x's dtype comes out, as F.layer_norm's
    x, w, b, _ = _inputs((4, 32), xd, torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ROUTES[route](x, w, b)
        yt = F.layer_norm(x, (32,), w, b)
    assert y.dtype == yt.dtype


@needs_cuda
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("amp", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("xd,wd", [(torch.bfloat16, torch.float32), (torch.float16, torch.float16),
                                   (torch.float32, torch.float32)], ids=["bf16-f32", "f16-f16", "f32-f32"])
def test_autocast_cuda_matches_torch(xd, wd, amp, route):
    # layer_norm is on CUDA autocast's float32 list: float32 out, gradients
    # back to the inputs in their own dtypes
    x, w, b, _ = _inputs((8, 64), xd, wd, "cuda")
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    with torch.autocast("cuda", dtype=amp):
        y = ROUTES[route](*leaves)
        yt = F.layer_norm(x, (64,), w, b)
    assert y.dtype == yt.dtype == torch.float32
    _close(y, F.layer_norm(x.double(), (64,), w.double(), b.double()), TOL[xd], "y")
    grads = torch.autograd.grad(y, leaves, torch.randn_like(y))
    assert [g.dtype for g in grads] == [xd, wd, wd]


@needs_cuda
def test_autocast_cuda_under_compile():
    x, w, b, _ = _inputs((8, 64), torch.bfloat16, torch.float32, "cuda")
    fn = torch.compile(lambda x, w, b: opsmith.layer_norm(x, w, b), fullgraph=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert fn(x, w, b).dtype == torch.float32


# --- the variance ----------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [64, 4096])
def test_variance_is_two_pass(device, n):
    """Mean 300, spread 0.01: E[x^2] - E[x]^2 in float32 cancels to noise
    (x^2 ~ 9e4 rounds by ~0.008, the variance is 1e-4); the mean of squared
    deviations keeps it."""
    g = torch.Generator().manual_seed(1)
    x = (300 + 0.01 * torch.randn(16, n, generator=g)).float().to(device)
    _, mean, rstd = torch.ops.opsmith.layer_norm_fwd(x, None, None, 0.0)
    xd = x.double()
    ref_rstd = 1 / xd.var(-1, unbiased=False).sqrt()
    assert ((rstd.double() - ref_rstd).abs() / ref_rstd).max().item() < 1e-3
    torch.testing.assert_close(mean.double(), xd.mean(-1), rtol=1e-6, atol=0)


# The ring forward (many rows of at least 1024 packs): more rows than its
# persistent clusters, so each walks several (bf16 8192: one-CTA rows, two
# stages; bf16 32768: one stage; f32 32768: clusters of 2); mixed parameter
# dtype and no bias too; the
# output allocated over NaN first; float64 reference.
@needs_cuda
@pytest.mark.parametrize("xd,wd,affine", [(torch.bfloat16, torch.bfloat16, (True, True)),
                                          (torch.bfloat16, torch.float32, (True, False)),
                                          (torch.float32, torch.float32, (True, True))], ids=str)
@pytest.mark.parametrize("rows,n", [(3000, 8192), (700, 32768)], ids=str)
def test_cuda_ring_forward_rows_walked(xd, wd, affine, rows, n):
    x, w, b, _ = _inputs((rows, n), xd, wd, "cuda", seed=rows, affine=affine)
    torch.full((rows, n), float("nan"), dtype=xd, device="cuda")  # freed: the output's block next
    y = opsmith.layer_norm(x, w, b, 1e-5)
    ref = F.layer_norm(x.double(), (n,), None if w is None else w.double(), None if b is None else b.double(), 1e-5)
    assert not torch.isnan(y).any()
    _close(y, ref, TOL[xd], f"{xd}/{wd} {rows}x{n}")
