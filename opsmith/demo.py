"""`opsmith demo --kernels`: RMSNorm forward+backward through route A and route B on the best
device present, checked against PyTorch in float64, timed against eager
PyTorch (torch.nn.functional.rms_norm), printed as a table."""
import sys
import statistics
import time

import torch


import opsmith
import opsmith.pybind
from opsmith.specs.rms_norm import SPEC

# max |out - ref| / max(1, max |ref|) allowed for each dtype (output rounding)
TOLERANCE = {dt: SPEC.tolerance(dt) for dt in SPEC.dtypes}


def _fwd_bwd(fn, x, w, dy):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = fn(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y.detach(), dx, dw


def _rel_err(outs, refs):
    return max(((o.double() - r).abs().max() / r.abs().max().clamp_min(1.0)).item()
               for o, r in zip(outs, refs))


def _time_pair_ms(fa, fb, device, repeats=9, batch_s=0.03):
    """Median milliseconds a call of fa and of fb. On a GPU, CUDA events
    around each call. On the CPU, batches of back-to-back calls (each at
    least batch_s long, so timer and scheduling noise stay small against
    it), the two functions alternating batch by batch so a slow spell of a
    shared machine hits both alike: the speed-up column is stable run to run."""
    for _ in range(3):
        fa(), fb()
    times = ([], [])
    if device.type == "cuda":
        for _ in range(5 * repeats):
            for fn, t in zip((fa, fb), times):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                t.append(start.elapsed_time(end))
    else:
        calls = []
        for fn in (fa, fb):
            t0 = time.perf_counter()
            fn()
            calls.append(max(1, int(batch_s / max(time.perf_counter() - t0, 1e-7))))
        for _ in range(repeats):
            for fn, n, t in zip((fa, fb), calls, times):
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                t.append((time.perf_counter() - t0) * 1e3 / n)
    return tuple(statistics.median(t) for t in times)


def check_device(arg: str, prog: str):
    """torch.device for --device, or None after a one-line message (exit 2)."""
    try:
        device = torch.device(arg)
    except RuntimeError:
        print(f"{prog}: --device {arg!r} is not a device (cpu, cuda, cuda:N)", file=sys.stderr)
        return None
    if device.type not in ("cpu", "cuda"):
        print(f"{prog}: --device {arg!r}: opsmith runs on cpu and cuda", file=sys.stderr)
        return None
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        have = f"{torch.cuda.device_count()} CUDA device(s)" if torch.cuda.is_available() else "no CUDA device"
        print(f"{prog}: --device {arg!r}, but this machine has {have}", file=sys.stderr)
        return None
    return device


def run_kernel_check(device) -> int:
    """`opsmith demo --kernels`: the table described at the top."""
    shapes = [(4096, 4096), (1024, 8192)] if device.type == "cuda" else [(256, 1024), (64, 4096)]
    gen = torch.Generator(device="cpu").manual_seed(0)

    routes = {
        "B torch.library": lambda x, w: opsmith.rms_norm(x, w),
        "A pybind11": lambda x, w: opsmith.pybind.rms_norm(x, w),
    }
    eager = lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w)  # noqa: E731

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"opsmith RMSNorm forward+backward on {name} (torch {torch.__version__})")
    header = (f"{'dtype':<9} {'shape':<12} {'err B':>9} {'err A':>9} {'A==B':>5} "
              f"{'opsmith ms':>11} {'eager ms':>9} {'speed-up':>8}")
    print(header)
    print("-" * len(header))
    ok = True
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for rows, n in shapes:
            x = torch.randn(rows, n, generator=gen).to(device, dtype)
            w = (1 + 0.1 * torch.randn(n, generator=gen)).to(device, dtype)
            dy = torch.randn(rows, n, generator=gen).to(device, dtype)
            # the routes' eps=None, as torch.nn.functional.rms_norm takes it:
            # the eps of the type the sums run in
            eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
            ref = _fwd_bwd(lambda a, b: torch.nn.functional.rms_norm(a, (n,), b, eps),
                           x.double(), w.double(), dy.double())
            out = {k: _fwd_bwd(f, x, w, dy) for k, f in routes.items()}
            err_b = _rel_err(out["B torch.library"], ref)
            err_a = _rel_err(out["A pybind11"], ref)
            same = all(torch.equal(a, b) for a, b in zip(out["A pybind11"], out["B torch.library"]))
            ok &= err_a <= TOLERANCE[dtype] and err_b <= TOLERANCE[dtype] and same
            t_ops, t_eager = _time_pair_ms(lambda: _fwd_bwd(routes["B torch.library"], x, w, dy),
                                           lambda: _fwd_bwd(eager, x, w, dy), device)
            print(f"{str(dtype).replace('torch.', ''):<9} {f'{rows}x{n}':<12} {err_b:>9.2e} {err_a:>9.2e} "
                  f"{'yes' if same else 'NO':>5} {t_ops:>11.3f} {t_eager:>9.3f} {t_eager / t_ops:>7.2f}x")
    print("all results within tolerance, routes A and B identical" if ok else "MISMATCH: see rows above")
    return 0 if ok else 1
