"""cross_entropy through every route: the float64 reference on fresh random inputs
(outputs poisoned first), layouts, errors naming the argument, gradcheck,
opcheck, torch.compile(fullgraph=True), route A against route B, the module.
CUDA cases are collected everywhere and skipped without a GPU."""
import math

import pytest
import torch

import opsmith
import opsmith.pybind
from opsmith.ops.cross_entropy import CrossEntropy, cross_entropy, cross_entropy_pybind

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="CUDA is not available"))]
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ALPHA = 1.5


def reference(x, alpha):
    x = x.detach().double()
    return x * torch.sigmoid(alpha * x)


def reference_grad(dy, x, alpha):
    x, dy = x.detach().double(), dy.detach().double()
    s = torch.sigmoid(alpha * x)
    return dy * s * (1 + alpha * x * (1 - s))


def poison(t):
    # fill and free a block of the output's size: the allocator is then likely
    # to hand it to the op, and an element it does not write stays NaN
    torch.full(t.shape, math.nan, dtype=t.dtype, device=t.device)


def assert_close(got, want, dtype, what):
    assert not torch.isnan(got).any(), f"{what}: NaN (an element was not written?)"
    err = (got.double() - want).abs().max().item() if want.numel() else 0.0
    bound = TOL[dtype] * max(1.0, want.abs().max().item() if want.numel() else 0.0)
    assert err <= bound, f"{what}: max|got - float64 reference| = {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(3, 257), (2, 5, 64), (4099,), (), (1, 1)], ids=str)
def test_reference(device, dtype, shape):
    x = (torch.randn(shape, device=device) * 2).to(dtype).requires_grad_()
    dy = torch.randn(shape, device=device).to(dtype)
    poison(x)
    y = cross_entropy(x, ALPHA)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    assert_close(y, reference(x, ALPHA), dtype, "y")
    poison(x)
    (dx,) = torch.autograd.grad(y, [x], dy)
    assert_close(dx, reference_grad(dy, x, ALPHA), dtype, "dx")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["transposed", "sliced", "every_other_row", "expanded", "offset"])
def test_layouts(device, layout):
    base = torch.randn(64, 66, device=device)
    x = {"transposed": base.t(), "sliced": base[:, 1:65], "every_other_row": base[::2],
         "expanded": base[0:1].expand(5, 66), "offset": base.view(-1)[3:3 + 64 * 33].view(64, 33)}[layout]
    y = cross_entropy(x, ALPHA)
    assert_close(y, reference(x, ALPHA), torch.float32, layout)
    dy = torch.randn_like(x)
    dx = torch.ops.opsmith.cross_entropy_bwd(dy, x, ALPHA)
    assert_close(dx, reference_grad(dy, x, ALPHA), torch.float32, layout + " dx")


@pytest.mark.parametrize("device", DEVICES)
def test_empty_and_alpha_values(device):
    assert cross_entropy(torch.empty(0, 8, device=device)).shape == (0, 8)
    x = torch.randn(4, 33, device=device, dtype=torch.float64)
    for alpha in (0.0, -2.0, 1.0, 10.0):
        assert_close(cross_entropy(x, alpha), reference(x, alpha), torch.float64, f"alpha={alpha}")
    # alpha = 1 is SiLU
    torch.testing.assert_close(cross_entropy(x), torch.nn.functional.silu(x))


@pytest.mark.parametrize("device", DEVICES)
def test_errors_name_the_argument(device):
    x = torch.randn(4, 8, device=device)
    for alpha in (math.nan, math.inf):
        with pytest.raises(RuntimeError, match=r"^cross_entropy: alpha must be finite"):
            cross_entropy(x, alpha)
        with pytest.raises(RuntimeError, match=r"^cross_entropy: alpha must be finite"):
            cross_entropy_pybind(x, alpha)
    with pytest.raises(RuntimeError, match=r"^cross_entropy: x must be float64, float32, float16 or bfloat16, got Int"):
        cross_entropy(torch.ones(4, 8, dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match=r"^cross_entropy: dy must have the shape of x"):
        torch.ops.opsmith.cross_entropy_bwd(torch.randn(4, 9, device=device), x, 1.0)
    with pytest.raises(RuntimeError, match=r"^cross_entropy: dy must have the same dtype as x"):
        torch.ops.opsmith.cross_entropy_bwd(x.double(), x, 1.0)


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck(device):
    x = torch.randn(3, 17, device=device, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: cross_entropy(t, ALPHA), (x,))
    assert torch.autograd.gradcheck(lambda t: cross_entropy_pybind(t, ALPHA), (x,))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = torch.randn(4, 40, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.opsmith.cross_entropy_fwd.default, (x, ALPHA))
    torch.library.opcheck(torch.ops.opsmith.cross_entropy_bwd.default, (torch.randn(4, 40, device=device), x.detach(), ALPHA))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager" if device == "cpu" else "inductor")
    f = lambda t: cross_entropy(t * 2.0 + 1.0, ALPHA) * 3.0  # noqa: E731
    x = torch.randn(4, 8, 96, device=device, requires_grad=True)
    y = torch.compile(f, backend=counter, fullgraph=True)(x)
    (g,) = torch.autograd.grad(y.sum(), [x])
    (g_eager,) = torch.autograd.grad(f(x).sum(), [x])
    assert counter.frame_count == 1
    torch.testing.assert_close(y, f(x))
    torch.testing.assert_close(g, g_eager)
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_route_a_equals_route_b(device, dtype):
    x = torch.randn(5, 77, device=device).to(dtype).requires_grad_()
    dy = torch.randn(5, 77, device=device).to(dtype)
    ya, yb = cross_entropy_pybind(x, ALPHA), cross_entropy(x, ALPHA)
    assert torch.equal(ya, yb)
    assert torch.equal(torch.autograd.grad(ya, [x], dy)[0], torch.autograd.grad(yb, [x], dy)[0])
    assert opsmith.pybind.cross_entropy is cross_entropy_pybind


def test_autodiff_limits_and_transforms():
    x = torch.randn(3, 10, dtype=torch.float64, requires_grad=True)
    (dx,) = torch.autograd.grad(cross_entropy(x, ALPHA).sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError, match=r"^cross_entropy: double backward is not supported"):
        dx.sum().backward()
    with pytest.raises(RuntimeError, match=r"^cross_entropy: forward-mode AD is not supported"):
        torch.func.jvp(lambda t: cross_entropy(t, ALPHA), (x.detach(),), (torch.ones_like(x),))
    g = torch.func.grad(lambda t: cross_entropy(t, ALPHA).sum())(x.detach())
    torch.testing.assert_close(g, reference_grad(torch.ones_like(x), x, ALPHA))
    xb = torch.randn(4, 3, 10, dtype=torch.float64)
    torch.testing.assert_close(torch.func.vmap(lambda t: cross_entropy(t, ALPHA), in_dims=1)(xb),
                               reference(xb, ALPHA).movedim(1, 0))
    with pytest.raises(RuntimeError, match=r"route A does not support torch\.func transforms"):
        torch.func.grad(lambda t: cross_entropy_pybind(t, ALPHA).sum())(x.detach())


def test_module():
    m = opsmith.nn.CrossEntropy(alpha=ALPHA)
    assert isinstance(m, CrossEntropy) and "alpha=1.5" in repr(m)
    x = torch.randn(2, 9)
    torch.testing.assert_close(m(x), cross_entropy(x, ALPHA))
    assert dict(m.state_dict()) == {}
