"""The gated activations on the CPU against eager PyTorch (F.silu(g) * u,
F.gelu(g, approximate) * u), forward and forward + backward, at a few
shapes; best of --reps calls, interleaved, torch's threads = opsmith's.

    python bench/glu_cpu.py                      # bf16 and f32, 256x11008 and 4096x4096
    python bench/glu_cpu.py --shapes 64x14336 --dtypes bf16
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the in-place build
import opsmith  # noqa: E402

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64}
ACTS = {"swiglu": (lambda g, u: opsmith.swiglu(g, u), lambda g, u: F.silu(g) * u),
        "geglu": (lambda g, u: opsmith.geglu(g, u), lambda g, u: F.gelu(g) * u),
        "geglu_tanh": (lambda g, u: opsmith.geglu(g, u, "tanh"), lambda g, u: F.gelu(g, approximate="tanh") * u)}


def best_ms(fns, reps):
    """Best of reps for each fn, the fns interleaved call by call: on a
    shared machine the minimum is the least disturbed, and interleaving
    gives every fn the same disturbances."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return [b * 1e3 for b in best]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/glu_cpu.py")
    p.add_argument("--shapes", nargs="*", default=["256x11008", "4096x4096"])
    p.add_argument("--dtypes", nargs="*", choices=list(DTYPES), default=["f32", "bf16"])
    p.add_argument("--acts", nargs="*", choices=list(ACTS), default=list(ACTS))
    p.add_argument("--reps", type=int, default=25)
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| op | dtype | rows x I | direction | opsmith ms | eager ms | eager / opsmith |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for shape in args.shapes:
        rows, n = map(int, shape.split("x"))
        for dname in args.dtypes:
            dt = DTYPES[dname]
            g = (torch.randn(rows, n) * 3).to(dt)
            u = torch.randn(rows, n).to(dt)
            dy = torch.randn(rows, n).to(dt)
            gg, ug = g.clone().requires_grad_(), u.clone().requires_grad_()
            for name in args.acts:
                ours, eager = ACTS[name]
                for direction in ("fwd", "fwd+bwd"):
                    if direction == "fwd":
                        fns = [lambda f=f: f(g, u) for f in (ours, eager)]
                    else:
                        fns = [lambda f=f: torch.autograd.grad(f(gg, ug), [gg, ug], dy) for f in (ours, eager)]
                    t_ours, t_eager = best_ms(fns, args.reps)
                    print(f"| {name} | {dname} | {rows}x{n} | {direction} | {t_ours:.2f} | {t_eager:.2f} | "
                          f"{t_eager / t_ours:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
