"""What is RMSNorm's alone; everything generic (float64 reference, layouts,
zero rows, hostile inputs, opcheck, gradcheck, compile, CUDA graphs, streams,
route A == route B, transforms) runs from its spec (opsmith/specs/rms_norm.py)
in test_reliability.py and test_integration.py.

Here: the no-weight path over hidden sizes, launch plans, input ranks, many
rows, eps semantics (the default eps of each dtype), the raw ops' second
output (inv_rms) and the raw backward op's named argument checks, the vmap
rules' batched-weight and backward cases, nn.RMSNorm as a drop-in for
torch.nn.RMSNorm, and the library loading alone. Numbers are checked
against the spec's float64 reference with the spec's tolerances."""

import importlib
import math
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import opsmith
from opsmith.specs.rms_norm import SPEC

from conftest import requires_cuda
from harness import DTYPES, assert_bitwise_equal, dtype_id

TOL = {dt: SPEC.tolerance(dt) for dt in DTYPES}
# dweight sums over rows, so its rounding error grows a little with them.
DWEIGHT_SLACK = SPEC.grad_slack

HIDDEN_SIZES = [1, 3, 769, 5125, 8192, 65536]


def acc_dtype(dtype):
    """Type opsmith keeps statistics (inv_rms) in."""
    return torch.float64 if dtype == torch.float64 else torch.float32

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


def default_eps(dtype):
    # what torch.nn.functional.rms_norm takes for eps=None: the epsilon of
    # the type its sums run in (float32 for 16-bit x)
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def reference(x, weight, eps, dy):
    """(y, inv_rms, dx, dweight) in float64 on the CPU: y and its gradients
    from the spec's reference, inv_rms (the raw op's second output) beside it."""
    if eps is None:
        eps = default_eps(x.dtype)
    x64 = x.detach().cpu().to(torch.float64).requires_grad_()
    w64 = None if weight is None else weight.detach().cpu().to(torch.float64).requires_grad_()
    y = SPEC.reference({"x": x64, "weight": w64, "eps": eps})
    y.backward(dy.detach().cpu().to(torch.float64))
    inv = torch.rsqrt(x64.detach().pow(2).mean(-1) + eps)
    return y.detach(), inv, x64.grad, None if w64 is None else w64.grad


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


@pytest.mark.parametrize("n", HIDDEN_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_no_weight(device, dtype, n):
    # weight None: the kernels' no-weight path, and a (0,) dweight from the raw op
    rows = 6 if n <= 769 else 3 if n <= 8192 else 2
    x = rand_x(rows, n, dtype=dtype, device=device)
    dy = rand(rows, n, dtype=dtype, device=device)
    check_rms_norm(x, None, None, dy)


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
        # the same with a width no 16-byte pack divides: the generic kernels
        (70000, 7, 8 * DWEIGHT_SLACK),
    ],
    ids=["2048x128", "70000x8", "70000x7"],
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
    # x is scaled so that mean(x^2) is about the default eps: the eps term
    # then changes the result far beyond the tolerance, so a wrong default
    # (e.g. float16's own eps for float16 inputs, which PyTorch does not
    # take) or an ignored eps is caught.
    scale = math.sqrt(default_eps(dtype))
    n = 64
    x = rand(4, n, dtype=dtype, device=device, scale=scale)
    weight = rand(n, dtype=dtype, device=device)
    dy = rand(4, n, dtype=dtype, device=device)
    if eps is None:
        y_default = reference(x, weight, None, dy)[0]
        y_no_eps = reference(x, weight, 0.0, dy)[0]
        assert (y_default - y_no_eps).abs().max() > 10 * TOL[dtype] * max(1.0, y_default.abs().max().item())
        # PyTorch's own default, on the same tensors (its documentation says
        # x's dtype's epsilon; its code takes float32's for 16-bit x)
        pairs = ((opsmith.rms_norm(x, weight), F.rms_norm(x.cpu(), (n,), weight.cpu())),
                 (opsmith.nn.RMSNorm(n, device=device, dtype=dtype)(x), torch.nn.RMSNorm(n, dtype=dtype)(x.cpu())))
        for got, want in pairs:
            got, want = got.detach().cpu().double(), want.detach().double()
            assert (got - want).abs().max() <= 2 * TOL[dtype] * max(1.0, want.abs().max().item())
    check_rms_norm(x, weight, eps, dy)



N_LAYOUT = 259  # not a multiple of any vector width


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_non_contiguous_weight_and_dy(device, dtype):
    n = N_LAYOUT
    x = rand(5, n, dtype=dtype, device=device)
    weight = rand(2 * n, dtype=dtype, device=device)[::2]
    dy = rand_transposed_like((5, n), dtype, device)
    assert not weight.is_contiguous() and not dy.is_contiguous()
    check_rms_norm(x, weight, 1e-6, dy)



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


def test_library_alone_names_the_fake_impl_module(tmp_path):
    # Loaded alone, the library names the module holding its fake kernels
    # (m.set_python_module): under FakeTensorMode torch says to import it, and
    # importing exactly that module makes the op traceable.
    import os
    path = str(opsmith.library_path())
    root = os.path.dirname(os.path.dirname(os.path.abspath(opsmith.__file__)))
    code = textwrap.dedent(
        f"""
        import sys
        import torch
        import traceback
        from torch._subclasses.fake_tensor import FakeTensorMode
        torch.ops.load_library({path!r})
        assert torch._C._dispatch_pystub("opsmith::rms_norm_fwd", "")[0] == "opsmith.ops.rms_norm"
        try:
            with FakeTensorMode():
                torch.ops.opsmith.rms_norm_fwd(torch.empty(3, 8), None, None)
        except Exception:
            assert "import the 'opsmith.ops.rms_norm' Python module" in traceback.format_exc()
        else:
            raise AssertionError("a fake call without the fake kernels' module succeeded")
        sys.path.insert(0, {root!r})
        import opsmith.ops.rms_norm
        with FakeTensorMode():
            y, inv = torch.ops.opsmith.rms_norm_fwd(torch.empty(3, 8), None, None)
            dx, dw = torch.ops.opsmith.rms_norm_bwd(y, y, None, inv)
        print(tuple(y.shape), tuple(inv.shape), tuple(dx.shape), tuple(dw.shape))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "(3, 8) (3,) (3, 8) (0,)"


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
    eps_val = default_eps(dtype) if eps is None else eps
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
# The raw backward op
# --------------------------------------------------------------------------

BAD_BACKWARD = {
    "dy_shape": (lambda x, w, inv: (rand(4, 9), x, w, inv), r"^rms_norm: dy must have the shape of x \[4, 8\], got \[4, 9\]"),
    "dy_dtype": (lambda x, w, inv: (rand(4, 8, dtype=torch.float64), x, w, inv), r"^rms_norm: dy must be x's dtype"),
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


# --------------------------------------------------------------------------
# vmap rules (opsmith/ops/rms_norm.py): the cases one call cannot express
# --------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["x_batched", "x_and_weight_batched", "weight_batched", "x_bdim_1"])
def test_vmap_forward_in_dims(device, case):
    # a batched weight loops over the batch; a batched x alone is one call
    B, rows, n = 3, 4, 33
    xs = rand(B, rows, n, dtype=torch.float64, device=device)
    ws = rand(B, n, dtype=torch.float64, device=device)
    if case == "x_batched":
        args, in_dims, pick = (xs, ws[0]), (0, None), lambda b: (xs[b], ws[0])
    elif case == "x_and_weight_batched":
        args, in_dims, pick = (xs, ws), (0, 0), lambda b: (xs[b], ws[b])
    elif case == "weight_batched":
        args, in_dims, pick = (xs[0], ws), (None, 0), lambda b: (xs[0], ws[b])
    else:
        args, in_dims, pick = (xs.movedim(0, 1), ws[0]), (1, None), lambda b: (xs[b], ws[0])
    y, inv = torch.func.vmap(lambda a, w: torch.ops.opsmith.rms_norm_fwd(a, w, 1e-6), in_dims=in_dims)(*args)
    for b in range(B):
        x, w = pick(b)
        y_ref, inv_ref, _, _ = reference(x, w, 1e-6, torch.ones_like(x))
        assert_close(y[b], y_ref, TOL[torch.float64], f"y[{b}]")
        assert_close(inv[b], inv_ref, TOL[torch.float64], f"inv_rms[{b}]")


@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no_weight"])
@pytest.mark.parametrize("batched", ["dy", "dy_x_inv", "all"])
def test_vmap_backward_in_dims(device, batched, with_weight):
    # vmap over the raw backward: per-example dweight (a sum over each
    # example's rows) needs the loop; without weight, one call
    B, rows, n = 3, 4, 33
    xs = rand(B, rows, n, dtype=torch.float64, device=device)
    ws = rand(B, n, dtype=torch.float64, device=device) if with_weight else None
    dys = rand(B, rows, n, dtype=torch.float64, device=device)
    invs = torch.stack([torch.ops.opsmith.rms_norm_fwd(xs[b], None if ws is None else ws[b], 1e-6)[1]
                        for b in range(B)])
    bat = {"dy": {"dy"}, "dy_x_inv": {"dy", "x", "inv"}, "all": {"dy", "x", "inv", "w"}}[batched]
    if ws is None:
        bat.discard("w")
    get = lambda name, full, b: full[b] if name in bat else full[0]  # noqa: E731
    args = [dys if "dy" in bat else dys[0], xs if "x" in bat else xs[0],
            None if ws is None else (ws if "w" in bat else ws[0]), invs if "inv" in bat else invs[0]]
    in_dims = tuple(0 if (name in bat and a is not None) else None
                    for name, a in zip(("dy", "x", "w", "inv"), args))
    dx, dw = torch.func.vmap(torch.ops.opsmith.rms_norm_bwd, in_dims=in_dims)(*args)
    for b in range(B):
        x = get("x", xs, b)
        w = None if ws is None else get("w", ws, b)
        _, _, dx_ref, dw_ref = reference(x, w, 1e-6, get("dy", dys, b))
        # inv_rms comes from the op, as in a real backward; the example's x
        # and inv_rms agree only when both or neither are batched
        if ("x" in bat) != ("inv" in bat):
            continue
        assert_close(dx[b], dx_ref, TOL[torch.float64], f"dx[{b}]")
        if ws is not None:
            assert_close(dw[b], dw_ref, TOL[torch.float64] * DWEIGHT_SLACK, f"dw[{b}]")
        else:
            assert tuple(dw.shape) == (B, 0)


def test_vmap_zero_dim_example_is_refused():
    # vmap hides the batch dim: a per-example 0-dim x must be refused as the op refuses it
    with pytest.raises(RuntimeError, match=r"^rms_norm: x must have at least 1 dimension"):
        torch.func.vmap(lambda a: opsmith.rms_norm(a, None, 1e-6))(torch.randn(5))
