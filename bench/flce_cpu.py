"""fused_linear_cross_entropy on the CPU against eager PyTorch
``F.cross_entropy(F.linear(h, W).float(), t)`` (its GEMMs are oneDNN/MKL's),
forward+backward (gradients of hidden and weight), at the demo model's LM
head (1024 tokens x 128 hidden x 256 vocabulary) and two LLM-like heads
(1024 x 1024 x 32000, 256 x 2048 x 128256), float32 and bfloat16, for each
thread count asked.

Timing: wall clock of whole steps; the two providers alternate step by step
(a slow spell of the shared machine hits both), each step's batch repeated
until it lasts >= 0.2 s, median over --repeats. GFLOP/s counts the three
products, 6 N D V. Usage:
    python bench/flce_cpu.py [--threads 1 2] [--dtypes f32 bf16] [--shapes demo ...] [--out DIR]
writes DIR/results.json and DIR/table.md when --out is given."""
import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

# OPSMITH_ROOT: another checkout to measure (e.g. the one before a change)
sys.path.insert(0, os.environ.get("OPSMITH_ROOT", os.path.join(os.path.dirname(__file__), "..")))
import opsmith  # noqa: E402
from opsmith.cpu_bench import machine, write_results  # noqa: E402

SHAPES = {"demo": (1024, 128, 256), "32k": (1024, 1024, 32000), "128k": (256, 2048, 128256)}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def steps(n, d, v, dtype):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g) / d ** 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = -100

    def ours():
        torch.autograd.grad(opsmith.fused_linear_cross_entropy(h, w, t), [h, w])

    def eager():
        torch.autograd.grad(F.cross_entropy(F.linear(h, w).float(), t), [h, w])
    return {"opsmith": ours, "eager": eager}


def measure(fns, repeats, min_s=0.2):
    calls = {}
    for name, fn in fns.items():
        fn()
        t0 = time.perf_counter()
        fn()
        calls[name] = max(1, int(min_s / max(time.perf_counter() - t0, 1e-7)))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            times[name].append((time.perf_counter() - t0) / calls[name])
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    lines = ["| shape (N x D x V) | dtype | threads | opsmith (ms) | opsmith GFLOP/s | eager (ms) | eager GFLOP/s "
             "| eager / opsmith |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape in args.shapes:
            n, d, v = SHAPES[shape]
            flop = 6.0 * n * d * v
            for dname in args.dtypes:
                t = measure(steps(n, d, v, DTYPES[dname]), args.repeats)
                row = {"shape": [n, d, v], "dtype": dname, "threads": threads, "ours_ms": t["opsmith"] * 1e3,
                       "eager_ms": t["eager"] * 1e3, "ours_gflops": flop / t["opsmith"] / 1e9,
                       "eager_gflops": flop / t["eager"] / 1e9, "ratio": t["eager"] / t["opsmith"]}
                rows.append(row)
                lines.append(f"| {n} x {d} x {v} | {dname} | {threads} | {row['ours_ms']:.1f} | "
                             f"{row['ours_gflops']:.1f} | {row['eager_ms']:.1f} | {row['eager_gflops']:.1f} | "
                             f"{row['ratio']:.2f}x |")
                print(lines[-1], flush=True)
    meta = {"torch": torch.__version__, "opsmith": opsmith.__file__, **machine()}
    try:
        meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=os.path.dirname(opsmith.__file__)).stdout.strip()
    except OSError:
        pass
    if args.out:
        write_results(args.out, meta, rows, lines)


if __name__ == "__main__":
    main()
