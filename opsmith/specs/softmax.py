"""The op spec of softmax: how every harness (reliability tests, sanitizer,
benchmark, docs/reliability.md's table) reaches torch.ops.opsmith.softmax_*.
The harnesses run softmax; tests/test_softmax.py runs log_softmax too."""
import math

import torch

from ..ops.softmax import Softmax, softmax, softmax_pybind
from . import SUPPORTED, BenchSpec, Hostile, OpSpec, compiled, randn, rows_finite_except

_TOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def _make_inputs(shape, dtype, device, generator):
    return {"x": randn(tuple(shape), generator, dtype, device)}


def _call(inputs):
    return softmax(inputs["x"])


def _call_pybind(inputs):
    return softmax_pybind(inputs["x"])


def _opcheck(inputs):
    x = inputs["x"]
    y = torch.softmax(x.detach(), -1)
    return [(torch.ops.opsmith.softmax_fwd.default, (x, False)),
            (torch.ops.opsmith.softmax_fwd.default, (x, True)),
            (torch.ops.opsmith.softmax_bwd.default, (torch.randn_like(y), y, False))]


def _reference(inputs, dtype=None):
    return torch.softmax(inputs["x"].to(torch.float64), -1)


def _torch_equivalent(inputs):
    return torch.softmax(inputs["x"].detach().cpu().float(), -1)


def _edited(device, gen, edit, rows=4, n=37):
    inputs = _make_inputs((rows, n), torch.float32, "cpu", gen)
    edit(inputs["x"])
    return {k: v.to(device) for k, v in inputs.items()}


def _set(index, value):
    def edit(t):
        t[index] = value
    return edit


_HOSTILE = (
    Hostile("nan_in_x", lambda d, g: _edited(d, g, _set((1, 5), math.nan)),
            "NaN in that row only", input="one NaN in x",
            check=lambda spec, inputs, out: rows_finite_except(out, [1])),
    Hostile("masked_x", lambda d, g: _edited(d, g, _set((slice(None), slice(0, 3)), -math.inf)),
            "0 where x is -Inf, the rest finite (masked attention scores)", input="-Inf in some elements of every row"),
    Hostile("all_masked_row", lambda d, g: _edited(d, g, _set(2, -math.inf)),
            "NaN in that row (0 / 0), as PyTorch", input="a row of -Inf"),
    Hostile("huge_x", lambda d, g: _edited(d, g, lambda x: x.mul_(1e30)),
            "finite: the max is subtracted first", input="float32 x of magnitude ~1e30"),
    Hostile("integer_x", lambda d, g: {"x": torch.randint(-5, 5, (4, 8), generator=g, dtype=torch.int32).to(d)}, "",
            input="int32 x", raises=r"^softmax: x must be float64, float32, float16 or bfloat16, got Int"),
)


def _bench_inputs(rows, n, dtype, device):
    return {"x": torch.randn(rows, n, dtype=dtype, device=device),
            "dy": torch.randn(rows, n, dtype=dtype, device=device)}


def _liger(n, dtype, device):
    # imported lazily: Liger-Kernel is optional (the bench reports the reason it is skipped)
    from liger_kernel.ops.softmax import LigerSoftmaxFunction
    return lambda x: LigerSoftmaxFunction.apply(x)


def _host_calls(device):
    x = torch.randn(4, 1024, device=device, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    return {
        "opsmith.softmax": lambda: softmax(x),
        "opsmith.softmax (requires_grad)": lambda: softmax(xg),
        "opsmith.pybind.softmax": lambda: softmax_pybind(x),
        "torch.softmax": lambda: torch.softmax(x, -1),
    }


_BENCH = BenchSpec(
    make_inputs=_bench_inputs,
    grad_inputs=["x"],
    providers={
        "opsmith": lambda n, dt, dev: softmax,
        "opsmith_pybind": lambda n, dt, dev: softmax_pybind,
        "torch_eager": lambda n, dt, dev: lambda x: torch.softmax(x, -1),
        "torch_compile": lambda n, dt, dev: compiled(("softmax", n), lambda x: torch.softmax(x, -1)),
        "liger": _liger,
    },
    # forward: read x, write y; backward: read dy and y, write dx
    fwd_bytes=lambda rows, n, s: 2 * rows * n * s,
    fwdbwd_bytes=lambda rows, n, s: 5 * rows * n * s,
    hidden_sizes=[1024, 4096, 16384, 65536, 262144],
    row_counts=[16, 1024, 16384],
    quick_shapes=[(16384, 16384), (4096, 1024), (256, 262144)],
    host_calls=_host_calls,
)


SPEC = OpSpec(
    name="softmax",
    make_inputs=_make_inputs,
    call=_call,
    call_pybind=_call_pybind,
    reference=_reference,
    torch_equivalent=_torch_equivalent,
    tolerance=_TOL.__getitem__,
    outputs=("y",),
    grad_inputs=("x",),
    row_inputs=("x",),
    opcheck=_opcheck,
    double_backward=r"^softmax: double backward is not supported",
    double_backward_pybind=r"^opsmith\.pybind\.softmax: double backward is not supported",
    func_transforms={
        "grad": SUPPORTED,
        "vjp": SUPPORTED,
        "jvp": r"^softmax: forward-mode AD is not supported",
        "vmap": SUPPORTED,
    },
    func_transforms_pybind=r"^opsmith\.pybind\.softmax: route A does not support torch\.func transforms",
    make_module=lambda n: Softmax(-1),
    hostile=_HOSTILE,
    bench=_BENCH,
)
