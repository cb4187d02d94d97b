"""Tests for opsmith's RMSNorm operators.

Numerical results are checked against a float64 PyTorch reference computed
here, from the very inputs handed to opsmith (already rounded to the tested
dtype) upcast to float64, so the only error measured is opsmith's own.
"""

import importlib
import math
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import opsmith

from conftest import requires_cuda

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]

# max|out - ref| <= TOL * max(1, max|ref|)
TOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}
# dweight sums over rows, so its rounding error grows a little with them.
DWEIGHT_SLACK = 2.0

HIDDEN_SIZES = [1, 3, 769, 5125, 8192, 65536]


def acc_dtype(dtype):
    """Type opsmith keeps statistics (inv_rms) in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dtype_id(dtype):
    return str(dtype).replace("torch.", "")


def rand(*shape, dtype=torch.float32, device="cpu", scale=1.0, min_abs=0.0):
    # Drawn in float32 then rounded, so every dtype (and both devices) get
    # the same kind of values; never all-zero, unlike torch.ones/zeros inputs
    # that hide indexing and weighting bugs. min_abs > 0 keeps every value at
    # least that far from zero.
    v = torch.randn(shape, device=device)
    if min_abs:
        v = torch.where(v < 0, v - min_abs, v + min_abs)
    return (v * scale).to(dtype)


def rand_x(*shape, **kw):
    # With one element per row, dx = g * inv_rms * eps / (x^2 + eps) is ~0
    # and computed by cancellation, so its absolute error is ~u * inv_rms * |g|.
    # Keeping |x| >= 0.5 bounds inv_rms and thus that (unavoidable) error.
    return rand(*shape, min_abs=0.5 if shape[-1] == 1 else 0.0, **kw)


def rand_transposed_like(shape, dtype, device):
    """Random tensor of `shape` whose memory layout is fully reversed."""
    base = rand(*reversed(shape), dtype=dtype, device=device)
    return base.permute(*reversed(range(len(shape))))


def reference(x, weight, eps, dy):
    """float64 autograd reference: (y, inv_rms, dx, dweight) on the CPU."""
    if eps is None:
        # Same default as torch.nn.functional.rms_norm: eps of x's dtype.
        eps = torch.finfo(x.dtype).eps
    x64 = x.detach().cpu().to(torch.float64).requires_grad_()
    w64 = None if weight is None else weight.detach().cpu().to(torch.float64).requires_grad_()
    inv = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    y = x64 * inv
    if w64 is not None:
        y = y * w64
    y.backward(dy.detach().cpu().to(torch.float64))
    return (
        y.detach(),
        inv.detach().squeeze(-1),
        x64.grad,
        None if w64 is None else w64.grad,
    )


def assert_close(out, ref, tol, what, dtype=None, device=None):
    assert out is not None, f"{what}: missing"
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if dtype is not None:
        assert out.dtype == dtype, f"{what}: dtype {out.dtype} != {dtype}"
    if device is not None:
        assert out.device.type == torch.device(device).type, f"{what}: on {out.device}, expected {device}"
    if out.numel() == 0:
        return
    out64 = out.detach().cpu().to(torch.float64)
    ref64 = ref.detach().cpu().to(torch.float64)
    assert torch.isfinite(out64).all(), f"{what}: non-finite values"
    err = (out64 - ref64).abs().max().item()
    bound = tol * max(1.0, ref64.abs().max().item())
    assert err <= bound, f"{what}: max|out-ref| = {err:.3e} > {bound:.3e}"


_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def assert_bitwise_equal(a, b, what):
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.device == b.device, f"{what}: device {a.device} != {b.device}"
    a_bits = a.detach().contiguous().view(_INT_VIEW[a.dtype])
    b_bits = b.detach().contiguous().view(_INT_VIEW[b.dtype])
    assert torch.equal(a_bits, b_bits), f"{what}: not bit-identical"


def fwd_bwd(fn, x, weight, eps, dy):
    """y = fn(x, weight, eps); y.backward(dy). Returns (y, dx, dweight).

    detach() keeps x's layout (strides, offset, even stride 0), so the
    operator sees exactly the layout the caller built."""
    x = x.detach().requires_grad_()
    weight = None if weight is None else weight.detach().requires_grad_()
    y = fn(x, weight, eps)
    y.backward(dy)
    return y.detach(), x.grad, None if weight is None else weight.grad


def check_rms_norm(x, weight, eps, dy, dweight_slack=DWEIGHT_SLACK):
    """Forward and backward through opsmith.rms_norm and through the raw
    route-B operators, against the float64 reference."""
    dtype, device = x.dtype, x.device
    tol, acc = TOL[dtype], acc_dtype(dtype)
    snapshot = [t.clone() for t in (x, weight, dy) if t is not None]

    y_ref, inv_ref, dx_ref, dw_ref = reference(x, weight, eps, dy)

    y, dx, dw = fwd_bwd(opsmith.rms_norm, x, weight, eps, dy)
    assert_close(y, y_ref, tol, "y", dtype, device)
    assert_close(dx, dx_ref, tol, "dx", dtype, device)
    if weight is not None:
        assert_close(dw, dw_ref, tol * dweight_slack, "dweight", dtype, device)

    y2, inv = torch.ops.opsmith.rms_norm_fwd(x, weight, eps)
    assert_close(y2, y_ref, tol, "rms_norm_fwd y", dtype, device)
    assert_close(inv, inv_ref, TOL[acc], "rms_norm_fwd inv_rms", acc, device)

    dx2, dw2 = torch.ops.opsmith.rms_norm_bwd(dy, x, weight, inv)
    assert_close(dx2, dx_ref, tol, "rms_norm_bwd dx", dtype, device)
    if weight is not None:
        assert_close(dw2, dw_ref, tol * dweight_slack, "rms_norm_bwd dweight", dtype, device)
    else:
        assert tuple(dw2.shape) == (0,), f"dweight without weight: shape {tuple(dw2.shape)}, expected (0,)"

    # Inputs are read-only for every operator.
    for before, after in zip(snapshot, [t for t in (x, weight, dy) if t is not None]):
        assert_bitwise_equal(before, after, "input modified")


@pytest.fixture
def pybind_route():
    # Imported here, not at module level, so a broken route A fails only its tests.
    return importlib.import_module("opsmith.pybind")


@pytest.fixture
def pybind_module():
    return importlib.import_module("opsmith._pybind")


@pytest.fixture
def opsmith_nn():
    return importlib.import_module("opsmith.nn")


# --------------------------------------------------------------------------
# Accuracy: dtypes, hidden sizes, ranks, eps
# --------------------------------------------------------------------------


@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no_weight"])
@pytest.mark.parametrize("n", HIDDEN_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_hidden_sizes(device, dtype, n, with_weight):
    # Few rows for the wide cases: they exercise the per-row reduction, and
    # keep the float64 reference cheap.
    rows = 6 if n <= 769 else 3 if n <= 8192 else 2
    x = rand_x(rows, n, dtype=dtype, device=device)
    weight = rand(n, dtype=dtype, device=device) if with_weight else None
    dy = rand(rows, n, dtype=dtype, device=device)
    check_rms_norm(x, weight, None, dy)


@pytest.mark.parametrize(
    "rows,n",
    # More rows than the GPU has SMs (140) take the CUDA throughput plan, a
    # few (3) the latency plan; together they reach every packs-a-thread
    # count of the register-resident kernels. 32768 is the widest resident
    # row in 16-bit types; 40000 is packed but wider than any resident plan.
    # Many rows a block wrap the staged kernels' ring of row stages; 32768
    # and 65536 split a row over a cluster of CTAs.
    [(140, 512), (140, 2048), (140, 4096), (3, 4096), (140, 16384), (3, 16384),
     (140, 32768), (3, 32768), (140, 40000), (13000, 512), (2000, 8192), (300, 32768),
     (200, 65536)],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_launch_plans(device, dtype, rows, n):
    x = rand_x(rows, n, dtype=dtype, device=device)
    weight = rand(n, dtype=dtype, device=device)
    dy = rand(rows, n, dtype=dtype, device=device)
    check_rms_norm(x, weight, None, dy)


@pytest.mark.parametrize("shape", [(96,), (5, 96), (2, 3, 96), (2, 1, 3, 96)], ids=["1d", "2d", "3d", "4d"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_input_ranks(device, dtype, shape):
    # All leading dims are rows; a 1-D x is one row and has a 0-dim inv_rms.
    x = rand(*shape, dtype=dtype, device=device)
    weight = rand(shape[-1], dtype=dtype, device=device)
    dy = rand(*shape, dtype=dtype, device=device)
    check_rms_norm(x, weight, 1e-5, dy)


@pytest.mark.parametrize(
    "rows,n,dweight_slack",
    [
        # dweight sums 2048 rows: accumulating in the storage type (instead
        # of float32) would show for float16/bfloat16.
        (2048, 128, DWEIGHT_SLACK),
        # More rows than a CUDA grid's y/z dimension allows (65535). A plain
        # float32 sum over 70000 rows legitimately loses more bits, hence
        # the looser dweight bound.
        (70000, 8, 8 * DWEIGHT_SLACK),
    ],
    ids=["2048x128", "70000x8"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_many_rows(device, dtype, rows, n, dweight_slack):
    x = rand(rows, n, dtype=dtype, device=device)
    weight = rand(n, dtype=dtype, device=device)
    dy = rand(rows, n, dtype=dtype, device=device)
    check_rms_norm(x, weight, 1e-6, dy, dweight_slack=dweight_slack)


@pytest.mark.parametrize("eps", [None, 0.0, 1e-6, 0.5])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_eps(device, dtype, eps):
    # x is scaled so that mean(x^2) is about finfo(dtype).eps: the eps term
    # then changes the result far beyond the tolerance, so a wrong default
    # (e.g. float32's eps for float16 inputs) or an ignored eps is caught.
    scale = math.sqrt(torch.finfo(dtype).eps)
    n = 64
    x = rand(4, n, dtype=dtype, device=device, scale=scale)
    weight = rand(n, dtype=dtype, device=device)
    dy = rand(4, n, dtype=dtype, device=device)
    if eps is None:
        y_default = reference(x, weight, None, dy)[0]
        y_no_eps = reference(x, weight, 0.0, dy)[0]
        assert (y_default - y_no_eps).abs().max() > 10 * TOL[dtype] * max(1.0, y_default.abs().max().item())
    check_rms_norm(x, weight, eps, dy)


# --------------------------------------------------------------------------
# Memory layouts
# --------------------------------------------------------------------------

N_LAYOUT = 259  # not a multiple of any vector width

X_LAYOUTS = {
    # last dim strided: the operator must not assume a unit inner stride
    "transposed": lambda n, **kw: rand(n, 4, **kw).t(),
    # rows longer than n (odd row stride)
    "sliced_last_dim": lambda n, **kw: rand(4, n + 29, **kw)[:, :n],
    # row stride 2n
    "every_other_row": lambda n, **kw: rand(8, n, **kw)[::2],
    # row stride 0: every row aliases the same memory
    "expanded": lambda n, **kw: rand(1, n, **kw).expand(4, n),
    # leading dims that cannot be merged into one row stride
    "sliced_middle_dim": lambda n, **kw: rand(2, 7, n, **kw)[:, 1:4],
    "expanded_middle_dim": lambda n, **kw: rand(2, 1, n, **kw).expand(2, 3, n),
    # contiguous, but the data pointer is one element off any vector alignment
    "storage_offset": lambda n, **kw: rand(4 * n + 1, **kw)[1:].view(4, n),
}


@pytest.mark.parametrize("layout", list(X_LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_non_contiguous_x(device, dtype, layout):
    x = X_LAYOUTS[layout](N_LAYOUT, dtype=dtype, device=device)
    if layout != "storage_offset":
        assert not x.is_contiguous()
    weight = rand(N_LAYOUT, dtype=dtype, device=device)
    dy = rand(*x.shape, dtype=dtype, device=device)
    check_rms_norm(x, weight, 1e-6, dy)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_non_contiguous_weight_and_dy(device, dtype):
    n = N_LAYOUT
    x = rand(5, n, dtype=dtype, device=device)
    weight = rand(2 * n, dtype=dtype, device=device)[::2]
    dy = rand_transposed_like((5, n), dtype, device)
    assert not weight.is_contiguous() and not dy.is_contiguous()
    check_rms_norm(x, weight, 1e-6, dy)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    rows=st.integers(0, 6),
    n=st.integers(1, 300),
    layout=st.sampled_from(["contiguous"] + [k for k in X_LAYOUTS if "middle" not in k]),
    with_weight=st.booleans(),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_shapes_and_layouts_cpu(rows, n, layout, with_weight, dtype, seed):
    # Property test over odd sizes and layouts, CPU only to stay fast.
    torch.manual_seed(seed)
    min_abs = 0.5 if n == 1 else 0.0  # see rand_x
    if layout == "contiguous":
        x = rand(rows, n, dtype=dtype, min_abs=min_abs)
    elif layout == "transposed":
        x = rand(n, rows, dtype=dtype, min_abs=min_abs).t()
    elif layout == "sliced_last_dim":
        x = rand(rows, n + 3, dtype=dtype, min_abs=min_abs)[:, :n]
    elif layout == "every_other_row":
        x = rand(2 * rows, n, dtype=dtype, min_abs=min_abs)[::2]
    elif layout == "expanded":
        x = rand(1, n, dtype=dtype, min_abs=min_abs).expand(rows, n)
    else:  # storage_offset
        x = rand(rows * n + 1, dtype=dtype, min_abs=min_abs)[1:].view(rows, n)
    weight = rand(n, dtype=dtype) if with_weight else None
    dy = rand(rows, n, dtype=dtype)
    check_rms_norm(x, weight, 1e-6, dy)


# --------------------------------------------------------------------------
# Edge cases of the API
# --------------------------------------------------------------------------


@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no_weight"])
@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)])
def test_zero_rows(device, shape, with_weight):
    # No rows is a valid (empty) batch, not an error.
    n = shape[-1]
    x = rand(*shape, device=device)
    weight = rand(n, device=device) if with_weight else None
    y, inv = torch.ops.opsmith.rms_norm_fwd(x, weight, None)
    assert tuple(y.shape) == shape and y.dtype == x.dtype
    assert tuple(inv.shape) == shape[:-1] and inv.dtype == torch.float32
    dx, dw = torch.ops.opsmith.rms_norm_bwd(torch.empty_like(x), x, weight, inv)
    assert tuple(dx.shape) == shape
    if with_weight:
        # A sum over no rows is zero, not uninitialised memory.
        assert tuple(dw.shape) == (n,)
        assert torch.equal(dw, torch.zeros_like(weight))
    else:
        assert tuple(dw.shape) == (0,)

    xg = x.clone().requires_grad_()
    wg = None if weight is None else weight.clone().requires_grad_()
    opsmith.rms_norm(xg, wg).sum().backward()
    assert tuple(xg.grad.shape) == shape
    if wg is not None:
        assert torch.equal(wg.grad, torch.zeros_like(weight))


@pytest.mark.parametrize("grad_of", ["x_only", "weight_only"])
def test_partial_requires_grad(device, grad_of):
    # Backward must work when only one input needs a gradient.
    n = 40
    x = rand(3, n, device=device).requires_grad_(grad_of == "x_only")
    weight = rand(n, device=device).requires_grad_(grad_of == "weight_only")
    dy = rand(3, n, device=device)
    opsmith.rms_norm(x, weight, 1e-6).backward(dy)
    _, _, dx_ref, dw_ref = reference(x, weight, 1e-6, dy)
    if grad_of == "x_only":
        assert weight.grad is None
        assert_close(x.grad, dx_ref, TOL[torch.float32], "dx")
    else:
        assert x.grad is None
        assert_close(weight.grad, dw_ref, TOL[torch.float32] * DWEIGHT_SLACK, "dweight")


def _dtype_pattern(dtype):
    # Accept the usual spellings (torch, c10 and opsmith's own), without
    # letting "float16" match inside "bfloat16" or "float" inside "float32".
    names = {
        torch.float64: "float64|double|f64",
        torch.float32: "float32|float|f32",
        torch.float16: "float16|half|f16",
        torch.bfloat16: "bfloat16|bf16",
    }[dtype]
    return re.compile(rf"(?<![A-Za-z])({names})\b", re.IGNORECASE)


BAD_INPUTS = {
    # name: (make(device) -> (x, weight, eps), message regex, dtypes the message must name)
    "weight_dtype_f32_f64": (
        lambda d: (rand(4, 8, device=d), rand(8, dtype=torch.float64, device=d), 1e-5),
        r"^rms_norm:.*\bweight\b",
        (torch.float32, torch.float64),
    ),
    "weight_dtype_bf16_f16": (
        lambda d: (rand(4, 8, dtype=torch.bfloat16, device=d), rand(8, dtype=torch.float16, device=d), 1e-5),
        r"^rms_norm:.*\bweight\b",
        (torch.bfloat16, torch.float16),
    ),
    "weight_too_long": (
        lambda d: (rand(4, 8, device=d), rand(9, device=d), 1e-5),
        r"^rms_norm:.*weight must have shape \[",
        (),
    ),
    "weight_2d": (
        lambda d: (rand(4, 8, device=d), rand(1, 8, device=d), 1e-5),
        r"^rms_norm:.*weight must have shape \[",
        (),
    ),
    "integer_x": (
        lambda d: (torch.randint(-5, 5, (4, 8), dtype=torch.int32, device=d), None, 1e-5),
        r"^rms_norm:.*\bx\b",
        (),
    ),
    "empty_last_dim": (
        lambda d: (rand(4, 0, device=d), None, 1e-5),
        r"^rms_norm:.*\bx\b",
        (),
    ),
    "zero_dim_x": (
        lambda d: (torch.tensor(1.5, device=d), None, 1e-5),
        r"^rms_norm:.*\bx\b",
        (),
    ),
    "negative_eps": (
        lambda d: (rand(4, 8, device=d), rand(8, device=d), -1e-3),
        r"^rms_norm:.*\beps\b",
        (),
    ),
}

ENTRY_POINTS = ["op", "autograd", "pybind"]


def _entry_point(name):
    if name == "op":
        return lambda x, w, eps: torch.ops.opsmith.rms_norm_fwd(x, w, eps)
    if name == "autograd":
        return opsmith.rms_norm
    return importlib.import_module("opsmith.pybind").rms_norm


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs(device, case, entry):
    make, pattern, dtypes = BAD_INPUTS[case]
    x, weight, eps = make(device)
    fn = _entry_point(entry)
    with pytest.raises(RuntimeError, match=pattern) as info:
        fn(x, weight, eps)
    first_line = str(info.value).splitlines()[0]
    for dt in dtypes:
        assert _dtype_pattern(dt).search(first_line), f"message does not name {dt}: {first_line!r}"


@requires_cuda
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_weight_on_other_device(entry):
    x = rand(4, 8, device="cuda")
    weight = rand(8, device="cpu")
    with pytest.raises(RuntimeError, match=r"^rms_norm:.*\bweight\b"):
        _entry_point(entry)(x, weight, 1e-5)


# --------------------------------------------------------------------------
# PyTorch integration: opcheck, gradcheck, torch.compile
# --------------------------------------------------------------------------

OPCHECK_CASES = [
    pytest.param(torch.float32, True, 1e-5, id="f32-weight"),
    pytest.param(torch.float32, False, None, id="f32-no_weight-default_eps"),
    pytest.param(torch.bfloat16, True, 1e-5, id="bf16-weight"),
]


@pytest.mark.parametrize("dtype,with_weight,eps", OPCHECK_CASES)
def test_opcheck_fwd(device, dtype, with_weight, eps):
    # requires_grad inputs make opcheck verify the autograd registration too.
    x = rand(5, 37, dtype=dtype, device=device).requires_grad_()
    weight = rand(37, dtype=dtype, device=device).requires_grad_() if with_weight else None
    torch.library.opcheck(torch.ops.opsmith.rms_norm_fwd.default, (x, weight, eps))


@pytest.mark.parametrize("dtype,with_weight,eps", OPCHECK_CASES)
def test_opcheck_bwd(device, dtype, with_weight, eps):
    x = rand(5, 37, dtype=dtype, device=device)
    weight = rand(37, dtype=dtype, device=device) if with_weight else None
    _, inv = torch.ops.opsmith.rms_norm_fwd(x, weight, eps)
    dy = rand(5, 37, dtype=dtype, device=device)
    torch.library.opcheck(torch.ops.opsmith.rms_norm_bwd.default, (dy, x, weight, inv))


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no_weight"])
@pytest.mark.parametrize("route", ["route_b", "route_a"])
def test_gradcheck(device, route, with_weight, layout):
    fn = opsmith.rms_norm if route == "route_b" else importlib.import_module("opsmith.pybind").rms_norm
    if layout == "transposed":
        x = rand(11, 3, dtype=torch.float64, device=device).t()
    else:
        x = rand(3, 11, dtype=torch.float64, device=device)
    x = x.detach().requires_grad_()
    inputs = (x,)
    if with_weight:
        inputs += (rand(11, dtype=torch.float64, device=device).requires_grad_(),)
    assert torch.autograd.gradcheck(lambda *a: fn(a[0], a[1] if len(a) > 1 else None, 1e-6), inputs)


COMPILE_CASES = [
    # aot_eager traces forward and backward through the operators' fake
    # implementations without generating code, so it is cheap on CPU.
    pytest.param("cpu", "aot_eager", True, id="cpu-aot_eager-weight"),
    pytest.param("cpu", "aot_eager", False, id="cpu-aot_eager-no_weight"),
    # Inductor on CPU compiles C++ (~20 s here): one case only.
    pytest.param("cpu", "inductor", True, id="cpu-inductor-weight"),
    pytest.param("cuda", "inductor", True, id="cuda-inductor-weight", marks=requires_cuda),
    pytest.param("cuda", "inductor", False, id="cuda-inductor-no_weight", marks=requires_cuda),
]


@pytest.mark.parametrize("device,backend,with_weight", COMPILE_CASES)
def test_compile_fullgraph(device, backend, with_weight):
    # fullgraph=True turns any graph break into an error; the counter checks
    # that one graph covered the whole function.
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)

    def f(x, w):
        return opsmith.rms_norm(x * 2.0 + 1.0, w, 1e-6) * 3.0

    compiled = torch.compile(f, backend=counter, fullgraph=True)

    n = 96
    x = rand(4, 8, n, device=device)
    weight = rand(n, device=device) if with_weight else None
    dy = rand(4, 8, n, device=device)

    y_c, dx_c, dw_c = fwd_bwd(lambda a, b, _: compiled(a, b), x, weight, None, dy)
    y_e, dx_e, dw_e = fwd_bwd(lambda a, b, _: f(a, b), x, weight, None, dy)

    assert counter.frame_count == 1
    tol = TOL[torch.float32]
    assert_close(y_c, y_e, tol, "compiled y", torch.float32, device)
    assert_close(dx_c, dx_e, tol, "compiled dx", torch.float32, device)
    if with_weight:
        assert_close(dw_c, dw_e, tol * DWEIGHT_SLACK, "compiled dweight", torch.float32, device)
    torch._dynamo.reset()


# --------------------------------------------------------------------------
# Route A (pybind11) against route B (torch.ops)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no_weight"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_route_a_matches_route_b_bitwise(device, dtype, with_weight, layout, pybind_route, pybind_module):
    # Both routes must run the same kernels: identical bits, not just close.
    # 64 rows so a parallel dweight reduction spans several blocks/threads.
    rows, n = 64, 769
    if layout == "transposed":
        x = rand(n, rows, dtype=dtype, device=device).t()
    else:
        x = rand(rows, n, dtype=dtype, device=device)
    weight = rand(n, dtype=dtype, device=device) if with_weight else None
    dy = rand(rows, n, dtype=dtype, device=device)

    y_b, dx_b, dw_b = fwd_bwd(opsmith.rms_norm, x, weight, None, dy)
    y_a, dx_a, dw_a = fwd_bwd(pybind_route.rms_norm, x, weight, None, dy)
    assert_bitwise_equal(y_a, y_b, "y")
    assert_bitwise_equal(dx_a, dx_b, "dx")
    if with_weight:
        assert_bitwise_equal(dw_a, dw_b, "dweight")

    # The raw functions of both routes, too.
    y_b, inv_b = torch.ops.opsmith.rms_norm_fwd(x, weight, None)
    y_a, inv_a = pybind_module.rms_norm_fwd(x, weight, None)
    assert_bitwise_equal(y_a, y_b, "rms_norm_fwd y")
    assert_bitwise_equal(inv_a, inv_b, "rms_norm_fwd inv_rms")
    dx_b, dw_b = torch.ops.opsmith.rms_norm_bwd(dy, x, weight, inv_b)
    dx_a, dw_a = pybind_module.rms_norm_bwd(dy, x, weight, inv_a)
    assert_bitwise_equal(dx_a, dx_b, "rms_norm_bwd dx")
    assert_bitwise_equal(dw_a, dw_b, "rms_norm_bwd dweight")


def test_route_a_matches_reference(device, pybind_route):
    # Route A against the float64 reference, not only against route B.
    x = rand(6, 300, device=device)
    weight = rand(300, device=device)
    dy = rand(6, 300, device=device)
    y_ref, _, dx_ref, dw_ref = reference(x, weight, None, dy)
    y, dx, dw = fwd_bwd(pybind_route.rms_norm, x, weight, None, dy)
    tol = TOL[torch.float32]
    assert_close(y, y_ref, tol, "y", torch.float32, device)
    assert_close(dx, dx_ref, tol, "dx", torch.float32, device)
    assert_close(dw, dw_ref, tol * DWEIGHT_SLACK, "dweight", torch.float32, device)


# --------------------------------------------------------------------------
# The shared library on its own
# --------------------------------------------------------------------------


def test_library_loads_alone_in_subprocess(tmp_path):
    # A fresh interpreter that never imports opsmith must be able to load the
    # route-B library with torch.ops.load_library and call the operator.
    path = str(opsmith.library_path())
    code = textwrap.dedent(
        f"""
        import sys
        import torch
        torch.ops.load_library({path!r})
        assert "opsmith" not in sys.modules
        x = torch.tensor([[3.0, 4.0], [1.0, -1.0]], dtype=torch.float64)
        w = torch.tensor([2.0, 0.5], dtype=torch.float64)
        y, inv = torch.ops.opsmith.rms_norm_fwd(x, w, 0.0)
        print(" ".join(f"{{v:.9f}}" for v in y.flatten().tolist() + inv.tolist()))
        """
    )
    # cwd is a scratch dir so the source tree's opsmith package is not importable.
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    inv0 = 1.0 / math.sqrt((3.0**2 + 4.0**2) / 2)
    expected = [3.0 * inv0 * 2.0, 4.0 * inv0 * 0.5, 2.0, -0.5, inv0, 1.0]
    assert proc.stdout.split() == [f"{v:.9f}" for v in expected]


# --------------------------------------------------------------------------
# opsmith.nn.RMSNorm as a drop-in for torch.nn.RMSNorm
# --------------------------------------------------------------------------


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no_affine"])
@pytest.mark.parametrize("normalized_shape", [8, (8,), (4, 8), [4, 8]], ids=["int", "tuple1", "tuple2", "list2"])
def test_nn_rmsnorm_interface(device, opsmith_nn, normalized_shape, affine):
    ref = torch.nn.RMSNorm(normalized_shape, elementwise_affine=affine, device=device)
    mod = opsmith_nn.RMSNorm(normalized_shape, elementwise_affine=affine, device=device)
    assert isinstance(mod, torch.nn.Module)
    # Public attributes that code written for torch.nn.RMSNorm reads.
    assert mod.normalized_shape == ref.normalized_shape
    assert mod.eps == ref.eps
    assert mod.elementwise_affine == ref.elementwise_affine
    assert [k for k, _ in mod.named_parameters()] == [k for k, _ in ref.named_parameters()]
    sd, ref_sd = mod.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)
    for k in ref_sd:
        assert sd[k].shape == ref_sd[k].shape and sd[k].dtype == ref_sd[k].dtype
    if affine:
        assert isinstance(mod.weight, torch.nn.Parameter)
        assert mod.weight.device.type == device
        assert torch.equal(mod.weight, ref.weight)  # same initialisation (ones)
    else:
        assert mod.weight is None


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_nn_rmsnorm_factory_kwargs(device, opsmith_nn, dtype):
    mod = opsmith_nn.RMSNorm((3, 5), eps=1e-4, device=device, dtype=dtype)
    assert mod.weight.dtype == dtype and mod.weight.device.type == device
    assert tuple(mod.weight.shape) == (3, 5)
    assert mod.eps == 1e-4


@pytest.mark.parametrize("eps", [None, 1e-5])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no_affine"])
@pytest.mark.parametrize("normalized_shape", [64, (4, 16)], ids=["int", "tuple2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_nn_rmsnorm_matches_torch(device, opsmith_nn, dtype, normalized_shape, affine, eps):
    ref = torch.nn.RMSNorm(normalized_shape, eps=eps, elementwise_affine=affine, device=device, dtype=dtype)
    if affine:
        with torch.no_grad():
            ref.weight.copy_(rand(*ref.weight.shape, dtype=dtype, device=device))
    mod = opsmith_nn.RMSNorm(normalized_shape, eps=eps, elementwise_affine=affine, device=device, dtype=dtype)
    mod.load_state_dict(ref.state_dict())
    if affine:
        assert torch.equal(mod.weight, ref.weight)
    # ...and back: torch's module accepts opsmith's state_dict.
    torch.nn.RMSNorm(normalized_shape, eps=eps, elementwise_affine=affine, device=device, dtype=dtype).load_state_dict(
        mod.state_dict()
    )

    shape = tuple(ref.normalized_shape)
    x = rand(3, 5, *shape, dtype=dtype, device=device)
    dy = rand(3, 5, *shape, dtype=dtype, device=device)
    y, dx, _ = fwd_bwd(lambda a, _w, _e: mod(a), x, None, None, dy)
    y_torch, _, _ = fwd_bwd(lambda a, _w, _e: ref(a), x, None, None, dy)

    # float64 reference of the same module maths.
    eps_val = torch.finfo(dtype).eps if eps is None else eps
    x64 = x.detach().cpu().double().requires_grad_()
    w64 = ref.weight.detach().cpu().double().requires_grad_() if affine else None
    y64 = F.rms_norm(x64, shape, w64, eps_val)
    y64.backward(dy.cpu().double())

    tol = TOL[dtype]
    assert_close(y, y64, tol, "y", dtype, device)
    assert_close(y, y_torch, 2 * tol, "y vs torch.nn.RMSNorm", dtype, device)
    assert_close(dx, x64.grad, tol, "dx", dtype, device)
    if affine:
        assert_close(mod.weight.grad, w64.grad, tol * DWEIGHT_SLACK, "dweight", dtype, device)


def test_nn_rmsnorm_non_contiguous_input(device, opsmith_nn):
    # The normalized dims (4, 16) are not contiguous in memory here.
    mod = opsmith_nn.RMSNorm((4, 16), eps=1e-6, device=device)
    with torch.no_grad():
        mod.weight.copy_(rand(4, 16, device=device))
    x = rand(3, 16, 4, device=device).transpose(-1, -2)
    dy = rand(3, 4, 16, device=device)
    y, dx, _ = fwd_bwd(lambda a, _w, _e: mod(a), x, None, None, dy)
    x64 = x.detach().cpu().double().requires_grad_()
    w64 = mod.weight.detach().cpu().double().requires_grad_()
    y64 = F.rms_norm(x64, (4, 16), w64, 1e-6)
    y64.backward(dy.cpu().double())
    tol = TOL[torch.float32]
    assert_close(y, y64, tol, "y", torch.float32, device)
    assert_close(dx, x64.grad, tol, "dx", torch.float32, device)
    assert_close(mod.weight.grad, w64.grad, tol * DWEIGHT_SLACK, "dweight", torch.float32, device)


# --------------------------------------------------------------------------
# CUDA specifics
# --------------------------------------------------------------------------


@requires_cuda
def test_cuda_graph_capture():
    # Kernels must run on PyTorch's current stream and take their scratch
    # from PyTorch's allocator; otherwise capture fails or replays stale data.
    rows, n = 32, 1024
    x = rand(rows, n, device="cuda")
    weight = rand(n, device="cuda")
    dy = rand(rows, n, device="cuda")

    def step():
        y, inv = torch.ops.opsmith.rms_norm_fwd(x, weight, 1e-6)
        dx, dw = torch.ops.opsmith.rms_norm_bwd(dy, x, weight, inv)
        return y, inv, dx, dw

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture, as CUDA graphs require
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()

    # New inputs in the same buffers: the replay must see them.
    with torch.no_grad():
        x.copy_(rand(rows, n, device="cuda"))
        weight.copy_(rand(n, device="cuda"))
        dy.copy_(rand(rows, n, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    for got, want, what in zip(outs, step(), ["y", "inv_rms", "dx", "dweight"]):
        assert_bitwise_equal(got, want, what)


@requires_cuda
def test_cuda_side_stream():
    # Work issued under a non-default stream is ordered on that stream.
    rows, n = 256, 4096
    side = torch.cuda.Stream()
    x = rand(rows, n, device="cuda")
    weight = rand(n, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000)  # delay the side stream so a wrong stream shows up
        x2 = x * 1.5
        y, inv = torch.ops.opsmith.rms_norm_fwd(x2, weight, 1e-6)
    side.synchronize()
    y_ref, inv_ref, _, _ = reference(x * 1.5, weight, 1e-6, torch.ones_like(x))
    assert_close(y, y_ref, TOL[torch.float32], "y", torch.float32, "cuda")
    assert_close(inv, inv_ref, TOL[torch.float32], "inv_rms", torch.float32, "cuda")


@requires_cuda
def test_cuda_and_cpu_agree():
    # Same inputs on both devices: both close to the reference (already
    # checked elsewhere) and to each other.
    x = rand(8, 2048, device="cpu")
    weight = rand(2048)
    y_cpu, inv_cpu = torch.ops.opsmith.rms_norm_fwd(x, weight, 1e-6)
    y_gpu, inv_gpu = torch.ops.opsmith.rms_norm_fwd(x.cuda(), weight.cuda(), 1e-6)
    assert_close(y_gpu, y_cpu, 2 * TOL[torch.float32], "y")
    assert_close(inv_gpu, inv_cpu, 2 * TOL[torch.float32], "inv_rms")



@requires_cuda
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_x_on_cpu_weight_on_cuda(entry):
    # the dispatcher picks the CUDA kernel because weight is on CUDA; the
    # bridge must refuse rather than hand host memory to a CUDA kernel
    x, weight = rand(4, 8), rand(8, device="cuda")
    with pytest.raises(RuntimeError, match=r"^rms_norm: weight must be on the same device as x"):
        _entry_point(entry)(x, weight, 1e-5)


# The raw backward op is public too (torch.ops.opsmith.rms_norm_bwd): its
# arguments get the same named checks as the forward's.
BAD_BACKWARD = {
    "dy_shape": (lambda x, w, inv: (rand(4, 9), x, w, inv), r"^rms_norm: dy must have the shape of x \[4, 8\], got \[4, 9\]"),
    "dy_dtype": (lambda x, w, inv: (rand(4, 8, dtype=torch.float64), x, w, inv), r"^rms_norm: dy must have the same dtype as x"),
    "inv_rms_dtype": (lambda x, w, inv: (rand(4, 8), x, w, inv.double()), r"^rms_norm: inv_rms must be Float"),
    "inv_rms_shape": (lambda x, w, inv: (rand(4, 8), x, w, inv[:3]), r"^rms_norm: inv_rms must have shape x.shape\[:-1\] \[4\], got \[3\]"),
    "weight_shape": (lambda x, w, inv: (rand(4, 8), x, w[:7], inv), r"^rms_norm: weight must have shape \[8\]"),
}


@pytest.mark.parametrize("case", list(BAD_BACKWARD))
def test_backward_op_bad_inputs(case):
    x, w = rand(4, 8), rand(8)
    _, inv = torch.ops.opsmith.rms_norm_fwd(x, w, 1e-6)
    make, pattern = BAD_BACKWARD[case]
    with pytest.raises(RuntimeError, match=pattern):
        torch.ops.opsmith.rms_norm_bwd(*make(x, w, inv))
