"""softmax and log_softmax through every route: against PyTorch in float64 on
fresh random inputs (outputs poisoned first), any dim, layouts, masked rows,
errors naming the argument, gradcheck, opcheck, torch.compile(fullgraph=True),
CUDA graphs, route A against route B, vmap, the modules. CUDA cases are
collected everywhere and skipped without a GPU."""
import math

import pytest
import torch

import opsmith
import opsmith.pybind
from opsmith.ops.softmax import LogSoftmax, Softmax, log_softmax, log_softmax_pybind, softmax, softmax_pybind

HAS_CUDA = torch.cuda.is_available()
CUDA = pytest.mark.skipif(not HAS_CUDA, reason="CUDA is not available")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
FNS = {"softmax": (softmax, torch.softmax), "log_softmax": (log_softmax, torch.log_softmax)}


def poison(t):
    """On CUDA, a block of t's size filled with NaN and freed: the caching
    allocator hands it to the next output of that size, so an element the
    kernel does not write stays NaN and fails the comparison."""
    if t.is_cuda:
        torch.full(t.shape, math.nan, dtype=t.dtype, device=t.device)


def assert_close(got, want, dtype, what):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN pattern differs"
    ok = ~torch.isnan(want) & torch.isfinite(want)
    if not ok.any():
        return
    err = (got[ok] - want[ok]).abs().max().item()
    bound = TOL[dtype] * max(1.0, want[ok].abs().max().item())
    assert err <= bound, f"{what}: max|got - float64 reference| = {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("name", FNS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(3, 257), (2, 5, 64), (4099,), (1, 1), (2, 40000)], ids=str)
def test_reference(device, dtype, shape, name):
    ours, theirs = FNS[name]
    x = (torch.randn(shape) * 3).to(dtype).to(device).requires_grad_()
    dy = torch.randn(shape).to(dtype).to(device)
    poison(x)
    y = ours(x)
    assert y.shape == x.shape and y.dtype == dtype
    xd = x.detach().double().requires_grad_()
    ref = theirs(xd, -1)
    assert_close(y, ref, dtype, "y")
    (dx,) = torch.autograd.grad(y, [x], dy)
    (dref,) = torch.autograd.grad(ref, [xd], dy.double())
    assert_close(dx, dref, dtype, "dx")


@pytest.mark.parametrize("device", DEVICES)
def test_dims_dtype_and_layouts(device):
    x = torch.randn(4, 6, 33, device=device)
    for dim in (0, 1, -1, 2, -3):
        for name, (ours, theirs) in FNS.items():
            assert_close(ours(x, dim), theirs(x.double(), dim), torch.float32, f"{name} dim={dim}")
    assert softmax(x.half(), dtype=torch.float32).dtype == torch.float32
    base = torch.randn(64, 66, device=device)
    for v in (base.t(), base[:, 1:65], base[::2], base[0:1].expand(5, 66)):
        vg = v.detach().requires_grad_()
        y = softmax(vg)
        assert_close(y, torch.softmax(v.double(), -1), torch.float32, "layout")
        dy = torch.randn_like(v)
        (dx,) = torch.autograd.grad(y, [vg], dy)
        xd = v.double().requires_grad_()
        (dref,) = torch.autograd.grad(torch.softmax(xd, -1), [xd], dy.double())
        assert_close(dx, dref, torch.float32, "layout dx")
    assert softmax(torch.empty(0, 8, device=device)).shape == (0, 8)
    assert_close(softmax(torch.tensor(2.0, device=device)), torch.tensor(1.0), torch.float32, "0-dim")


def test_dim_none_is_torch_implicit_dim():
    # torch.nn.Softmax() and F.softmax(x, None): the legacy implicit dim
    # (0 for 0-, 1- and 3-d x, else 1) with a deprecation warning; so here
    for shape in ((), (5,), (3, 5), (2, 3, 5), (2, 3, 4, 5)):
        x = torch.randn(shape)
        for ours, theirs in ((opsmith.nn.Softmax(None), torch.nn.Softmax(None)),
                             (opsmith.nn.LogSoftmax(None), torch.nn.LogSoftmax(None))):
            with pytest.warns(UserWarning, match="Implicit dimension choice"):
                got = ours(x)
            with pytest.warns(UserWarning, match="Implicit dimension choice"):
                want = theirs(x)
            assert_close(got, want.double(), torch.float32, f"{type(ours).__name__} {shape}")
        with pytest.warns(UserWarning, match="Implicit dimension choice for softmax"):
            got = softmax_pybind(x, None)
        with pytest.warns(UserWarning):
            want = torch.nn.functional.softmax(x, None)
        assert_close(got, want.double(), torch.float32, f"pybind {shape}")


def test_dim_out_of_range_is_an_index_error():
    # as torch: [-n, n - 1], a 0-d tensor counting as 1-d; never wrapped around
    for x, dim in ((torch.randn(3, 5), 2), (torch.randn(3, 5), -3), (torch.tensor(1.0), 1)):
        for f in (softmax, log_softmax, softmax_pybind, log_softmax_pybind):
            with pytest.raises(IndexError, match=f"dim {dim} is out of range"):
                f(x, dim)
            with pytest.raises(IndexError):
                torch.softmax(x, dim)


@pytest.mark.parametrize("device", DEVICES)
def test_masked_rows(device):
    x = torch.randn(3, 40, device=device)
    x[:, :5] = -math.inf
    x[2] = -math.inf
    for name, (ours, theirs) in FNS.items():
        y, ref = ours(x), theirs(x.double(), -1)
        assert torch.isnan(y[2]).all() and torch.isnan(ref[2]).all(), "a row of -inf is NaN, as PyTorch"
        assert_close(y[:2], ref[:2], torch.float32, name)


# CUDA's plans: a row a CTA in shared memory up to ~72 KB, clusters of 2, 4, 8
# CTAs for wider rows (bf16 128256: 4 forward, 8 backward; float64 262144: too
# wide, the streaming kernel), odd widths (rows unaligned past the first: the
# streaming kernel; one row: the on-chip kernel's tail), float32 logits scaled
# by 1e4 (y = exp(x - max) / sum: the error must stay at float32's 1e-5), masked
# entries; rows of at most 256 packs a warp a row (264: 33 bf16 packs, P = 2
# with idle lanes; 2048 bf16: 256 packs, P = 8), up to 4096 packs a block a
# row (2056: 257 packs, 96 threads with idle packs; 16384; 1000 float32: 250
# packs; 16384 float32: 4096 packs, 1024 threads), wider the ring (34816
# bf16: 4352 packs, just past the block rows).
# float64 references; outputs poisoned first.
@CUDA
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n,scale,masked", [
    (4, 128256, 3.0, False), (2, 262144, 3.0, True), (1, 128257, 3.0, False), (3, 128257, 3.0, False),
    (9, 16384, 3.0, False), (64, 1024, 3.0, True), (14, 15631, 1e4, False), (3, 128256, 1e4, False),
    (2042, 237, 1e4, False), (33, 264, 3.0, True), (9, 2056, 3.0, False), (130, 2048, 1e4, False),
    (5, 34816, 3.0, False),
], ids=str)
def test_cuda_on_chip_plans(dtype, rows, n, scale, masked):
    if scale > 100 and dtype in (torch.float16, torch.bfloat16):
        pytest.skip("logits scaled by 1e4: float32 and float64")
    g = torch.Generator().manual_seed(n + rows)
    x = (torch.rand(rows, n, generator=g, dtype=torch.float64) * 4 - 2) * scale
    if masked:
        x[:, 3::7] = -math.inf
    x = x.to(dtype).cuda().requires_grad_()
    dy = torch.randn(rows, n, generator=g).to(dtype).cuda()
    for name, (ours, theirs) in FNS.items():
        y = ours(x)
        xd = x.detach().double().requires_grad_()
        ref = theirs(xd, -1)
        assert_close(y, ref, dtype, f"{name} y")
        (dx,) = torch.autograd.grad(y, [x], dy)
        (dref,) = torch.autograd.grad(ref, [xd], dy.double())
        assert_close(dx, dref, dtype, f"{name} dx")


# More rows than clusters fit at once: each persistent cluster of the ring
# forward walks several rows (40000: clusters of 2 CTAs in bf16, 4 in
# float32, one slice stage); beside them rows that take a block a row
# (16384) and a warp a row (1000), more than fit at once as well. The
# output allocated over NaN first; float64 references.
@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows,n", [(5000, 1000), (700, 16384), (400, 40000), (300, 128256), (60, 262144)], ids=str)
def test_cuda_rows_walked_by_persistent_clusters(dtype, rows, n):
    g = torch.Generator().manual_seed(rows + n)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype).cuda()
    for name, (ours, theirs) in FNS.items():
        poison(x)
        y = ours(x)
        assert_close(y, theirs(x.double(), -1), dtype, f"{name} {rows}x{n}")


@pytest.mark.parametrize("device", DEVICES)
def test_errors_name_the_argument(device):
    with pytest.raises(RuntimeError, match=r"^softmax: x must be float64, float32, float16 or bfloat16, got Int"):
        softmax(torch.ones(4, 8, dtype=torch.int32, device=device))
    y = torch.randn(4, 8, device=device)
    with pytest.raises(RuntimeError, match=r"^softmax: dy must have the shape of y"):
        torch.ops.opsmith.softmax_bwd(torch.randn(4, 9, device=device), y, False)
    with pytest.raises(RuntimeError, match=r"^softmax: dy must have y's dtype"):
        torch.ops.opsmith.softmax_bwd(y.double(), y, False)


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck(device):
    x = torch.randn(3, 17, device=device, dtype=torch.float64, requires_grad=True)
    for f in (softmax, log_softmax, softmax_pybind, log_softmax_pybind):
        assert torch.autograd.gradcheck(lambda t: f(t, 0), (x,))
        assert torch.autograd.gradcheck(f, (x,))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = torch.randn(4, 40, device=device, requires_grad=True)
    for log in (False, True):
        torch.library.opcheck(torch.ops.opsmith.softmax_fwd.default, (x, log))
        torch.library.opcheck(torch.ops.opsmith.softmax_bwd.default,
                              (torch.randn(4, 40, device=device), torch.softmax(x.detach(), -1), log))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager" if device == "cpu" else "inductor")
    f = lambda t: (softmax(t * 2.0, 1) * log_softmax(t, -1)).sum()  # noqa: E731
    x = torch.randn(4, 8, 96, device=device, requires_grad=True)
    y = torch.compile(f, backend=counter, fullgraph=True)(x)
    (g,) = torch.autograd.grad(y, [x])
    (g_eager,) = torch.autograd.grad(f(x), [x])
    assert counter.frame_count == 1
    torch.testing.assert_close(y, f(x))
    torch.testing.assert_close(g, g_eager)
    torch._dynamo.reset()


@CUDA
def test_cuda_graph_capture():
    x = torch.randn(64, 4099, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    # the reference through another leaf: a leaf's gradient accumulator keeps
    # the stream it was made on, and the captured backward must not feed one
    # made on the default (legacy) stream
    x_ref = x.detach().clone().requires_grad_()
    ref = softmax(x_ref)
    (gref,) = torch.autograd.grad(ref, [x_ref], dy)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            torch.autograd.grad(softmax(x), [x], dy)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = softmax(x)
        (gx,) = torch.autograd.grad(y, [x], dy)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, ref) and torch.equal(gx, gref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_route_a_equals_route_b(device, dtype):
    x = torch.randn(5, 77, device=device).to(dtype).requires_grad_()
    dy = torch.randn(5, 77, device=device).to(dtype)
    for a, b in ((softmax_pybind, softmax), (log_softmax_pybind, log_softmax)):
        ya, yb = a(x), b(x)
        assert torch.equal(ya, yb)
        assert torch.equal(torch.autograd.grad(ya, [x], dy)[0], torch.autograd.grad(yb, [x], dy)[0])
    assert opsmith.pybind.softmax is softmax_pybind and opsmith.pybind.log_softmax is log_softmax_pybind


def test_autodiff_limits_and_transforms():
    x = torch.randn(3, 10, dtype=torch.float64, requires_grad=True)
    (dx,) = torch.autograd.grad((softmax(x) ** 2).sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError, match=r"^softmax: double backward is not supported"):
        dx.sum().backward()
    with pytest.raises(RuntimeError, match=r"^softmax: forward-mode AD is not supported"):
        torch.func.jvp(softmax, (x.detach(),), (torch.ones_like(x),))
    w = torch.randn(10, dtype=torch.float64)
    g = torch.func.grad(lambda t: (log_softmax(t) * w).sum())(x.detach())
    xd = x.detach().clone().requires_grad_()
    (torch.log_softmax(xd, -1) * w).sum().backward()
    torch.testing.assert_close(g, xd.grad)
    xb = torch.randn(4, 3, 10, dtype=torch.float64)
    torch.testing.assert_close(torch.func.vmap(softmax, in_dims=1)(xb), torch.softmax(xb, -1).movedim(1, 0))
    with pytest.raises(RuntimeError, match=r"route A does not support torch\.func transforms"):
        torch.func.grad(lambda t: softmax_pybind(t).sum())(x.detach())


def test_modules():
    x = torch.randn(2, 3, 9)
    assert isinstance(opsmith.nn.Softmax(1), Softmax) and "dim=1" in repr(opsmith.nn.Softmax(1))
    torch.testing.assert_close(opsmith.nn.Softmax(1)(x), torch.nn.Softmax(1)(x))
    torch.testing.assert_close(opsmith.nn.LogSoftmax(-1)(x), torch.nn.LogSoftmax(-1)(x))
    assert isinstance(opsmith.nn.LogSoftmax(), LogSoftmax)
    assert dict(opsmith.nn.Softmax().state_dict()) == {}
