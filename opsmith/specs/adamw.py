"""The op spec of the AdamW step (opsmith.adamw_step): a tensor-list op that
updates params, exp_avgs and exp_avg_sqs in place (schema Tensor(a!)[]),
with no backward. Its inputs are a list of mixed sizes derived from the
harness's shape; params and grads have the harness's dtype, the state is
float32. The optimizer (opsmith.optim.AdamW) is tested against
torch.optim.AdamW in tests/test_adamw.py; the benchmark is
bench/adamw_bench.py (an optimizer step has no (rows, n) shape for the
spec's row benchmark)."""
import math

import torch
from torch.optim.adamw import adamw as _torch_adamw

from ..ops.adamw import adamw_step, adamw_step_pybind
from . import Hostile, OpSpec, randn

_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
_HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)


def _shapes(shape):
    # mixed sizes from the harness's shape: itself, an odd vector, an odd 2-D, a scalar
    n = shape[-1]
    return [tuple(shape), (n + 3,), (3, max(1, n // 2) + 1), ()]


def _make_inputs(shape, dtype, device, gen):
    shapes = _shapes(shape)
    f32 = torch.float32
    return {
        "params": [randn(s, gen, dtype, device) for s in shapes],
        "grads": [randn(s, gen, dtype, device) for s in shapes],
        "exp_avgs": [randn(s, gen, f32, device) * 0.1 for s in shapes],
        "exp_avg_sqs": [randn(s, gen, f32, device).abs() * 0.01 + 1e-4 for s in shapes],
        # step counts after this step's increment, one per tensor
        "steps": [torch.full((), float(2 + i), device=device) for i in range(len(shapes))],
        **_HP,
    }


def _args(i):
    return (i["params"], i["grads"], i["exp_avgs"], i["exp_avg_sqs"], i["steps"])


def _kwargs(i):
    return {k: i[k] for k in _HP}


# The harnesses compare the params (in the harness's dtype); the float32
# moments are declared mutated (restored after each run) and are compared
# with the reference in tests/test_adamw.py and tests/c/test_adamw.c.
def _call(i):
    adamw_step(*_args(i), **_kwargs(i))
    return i["params"]


def _call_pybind(i):
    adamw_step_pybind(*_args(i), **_kwargs(i))
    return i["params"]


def _reference(i, dtype=None):
    lr, b1, b2, eps, wd = (i[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
    ps = []
    for p, g, m, v, s in zip(*_args(i)):
        s = float(s)
        m = m + (1 - b1) * (g - m)
        v = b2 * v + (1 - b2) * g * g
        p = p * (1 - lr * wd) - lr / (1 - b1 ** s) * m / (v.sqrt() / math.sqrt(1 - b2 ** s) + eps)
        ps.append(p)
    return ps


def _torch(i):
    """torch.optim.AdamW's own functional step on float32 CPU copies."""
    c = lambda lst: [t.detach().cpu().float().clone() for t in lst]  # noqa: E731
    ps, gs, ms, vs = c(i["params"]), c(i["grads"]), c(i["exp_avgs"]), c(i["exp_avg_sqs"])
    steps = [t.detach().cpu().float().clone() - 1 for t in i["steps"]]  # torch increments them itself
    _torch_adamw(ps, gs, ms, vs, [], steps, foreach=False, capturable=False, amsgrad=False,
                 beta1=i["beta1"], beta2=i["beta2"], lr=i["lr"], weight_decay=i["weight_decay"],
                 eps=i["eps"], maximize=False)
    return ps


def _edited(device, gen, edit, shape=(4, 37), dtype=torch.float32):
    inputs = _make_inputs(shape, dtype, "cpu", gen)
    edit(inputs)
    return {k: ([t.to(device) for t in v] if isinstance(v, list) else v) for k, v in inputs.items()}


def _nan_stays(spec, inputs, ps):
    assert torch.isnan(ps[1][2].cpu()), "a NaN grad makes its param NaN"
    assert torch.isfinite(ps[0].cpu()).all() and torch.isfinite(ps[2].cpu()).all(), "other tensors stay finite"


def _expanded(device, gen):
    i = _make_inputs((4, 37), torch.float32, device, gen)
    i["params"][0] = i["params"][0][:1].expand(4, 37)
    return i


SPEC = OpSpec(
    name="adamw",
    make_inputs=_make_inputs,
    call=_call,
    call_pybind=_call_pybind,
    reference=_reference,
    torch_equivalent=_torch,
    tolerance=_TOL.__getitem__,
    outputs=("params",),
    mutated_inputs=("params", "exp_avgs", "exp_avg_sqs"),
    list_inputs=("params", "grads", "exp_avgs", "exp_avg_sqs", "steps"),
    opcheck=lambda i: [(torch.ops.opsmith.adamw_step_.default,
                        (*_args(i)[:4], [], [], i["steps"], i["lr"], None, i["beta1"], i["beta2"], i["eps"],
                         i["weight_decay"], False, False, None))],
    double_backward=None,
    func_transforms={"vmap": r"Batching rule not implemented for opsmith::adamw_step_"},
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    max_scale=1.0,
    hostile=(
        Hostile("nan_in_grads", lambda d, g: _edited(d, g, lambda i: i["grads"][1].__setitem__(2, math.nan)),
                "NaN in that element of that param (and its moments) only", check=_nan_stays),
        Hostile("length_mismatch",
                lambda d, g: {**_make_inputs((4, 37), torch.float32, d, g), "grads": [torch.ones(4, 37, device=d)]},
                "RuntimeError", raises=r"^adamw_step_: grads must have one tensor per param \(4\), got 1"),
        Hostile("shape_mismatch",
                lambda d, g: _edited(d, g, lambda i: i["grads"].__setitem__(2, torch.ones(5))),
                "RuntimeError", raises=r"^adamw_step_: grads\[2\] must have the shape of params\[2\]"),
        Hostile("expanded_param", _expanded, "RuntimeError",
                raises=r"^adamw_step_: params\[0\] has elements that share memory"),
        Hostile("state_not_float32",
                lambda d, g: _edited(d, g, lambda i: i["exp_avgs"].__setitem__(0, i["exp_avgs"][0].half())),
                "RuntimeError", raises=r"^adamw_step_: exp_avgs\[0\] must be Float"),
    ),
)
