"""layer_norm on the CPU against eager PyTorch: forward and forward+backward
times (median of repeats) for every dtype pair at a few shapes, as a
markdown table. Usage: python bench/layer_norm_cpu.py [--threads 2]"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import opsmith

SHAPES = [(256, 1024), (64, 4096), (4096, 4096)]
PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
         (torch.float64, torch.float64), (torch.bfloat16, torch.float32), (torch.float16, torch.float32)]


def _time(fn, budget_s=0.4, repeats=7):
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-6)
    calls = max(1, int(budget_s / repeats / one))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples) * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    name = lambda d: str(d).replace("torch.", "").replace("bfloat16", "bf16").replace("float", "f")
    print(f"torch {torch.__version__}, {args.threads} threads; ms (median), ratio = eager / opsmith (> 1: opsmith faster)\n")
    print("| x / weight | rows x n | fwd opsmith | fwd eager | ratio | fwd+bwd opsmith | fwd+bwd eager | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for xd, wd in PAIRS:
        for rows, n in SHAPES:
            x = torch.randn(rows, n).to(xd)
            w = (1 + 0.1 * torch.randn(n)).to(wd)
            b = (0.1 * torch.randn(n)).to(wd)
            dy = torch.randn(rows, n).to(xd)
            ours = lambda x, w, b: opsmith.layer_norm(x, w, b, 1e-5)
            eager = lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-5)
            row = []
            for fn in (ours, eager):
                with torch.no_grad():
                    row.append(_time(lambda: fn(x, w, b)))
            xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
            for fn in (ours, eager):
                row.append(_time(lambda: torch.autograd.grad(fn(xg, wg, bg), [xg, wg, bg], dy)))
            f, fe, fb, fbe = row
            print(f"| {name(xd)} / {name(wd)} | {rows} x {n} | {f:.3f} | {fe:.3f} | {fe / f:.2f} "
                  f"| {fb:.3f} | {fbe:.3f} | {fbe / fb:.2f} |", flush=True)


if __name__ == "__main__":
    main()
