"""GatedMLP's recompute mode: memory saved and time lost, one MLP block
forward + backward, recompute=False against recompute=True.

Memory is what autograd saves for the backward (distinct tensors, counted
through saved-tensor hooks, so the same number on any device) and, on CUDA,
the peak allocated during the step above what was allocated before it.
Time is the median of --iters forward + backward steps.

    python bench/glu_recompute.py                                # CPU, float32, a small Llama-like block
    python bench/glu_recompute.py --device cuda --dtype bf16 --rows 16384 --hidden 4096 --inter 14336
"""
import argparse
import os
import sys
import statistics
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the in-place build
from opsmith.bench import saved_tensor_bytes  # noqa: E402
from opsmith.nn import GatedMLP  # noqa: E402

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(module, x, dy, iters):
    device = x.device
    params = list(module.parameters())
    _, saved = saved_tensor_bytes(lambda: module(x))
    times = []
    peak = None
    for i in range(iters + 2):
        if device.type == "cuda" and i == 1:
            sync(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        t0 = time.perf_counter()
        y = module(x)
        torch.autograd.grad(y, [x, *params], dy)
        sync(device)
        if device.type == "cuda" and i == 1:
            peak = torch.cuda.max_memory_allocated(device) - base
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - t0)
    return saved, peak, statistics.median(times) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/glu_recompute.py")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="f32")
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=2816)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--activations", nargs="*", default=["silu", "gelu_tanh"])
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(0)
    print(f"GatedMLP({args.hidden}, {args.inter}) on {args.rows} rows, {args.dtype}, {device}: "
          f"forward + backward (x and the parameters)")
    print("| activation | fused | recompute | saved for backward (MiB) | peak extra (MiB) | ms / step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for activation in args.activations:
        for fused in (False, True):
            base = GatedMLP(args.hidden, args.inter, activation, fused_gate_up=fused).to(device=device, dtype=dtype)
            lean = GatedMLP(args.hidden, args.inter, activation, fused_gate_up=fused, recompute=True)
            lean = lean.to(device=device, dtype=dtype)
            lean.load_state_dict(base.state_dict())
            x = torch.randn(args.rows, args.hidden, device=device, dtype=dtype, requires_grad=True)
            dy = torch.randn(args.rows, args.hidden, device=device, dtype=dtype)
            rows = []
            for recompute, m in ((False, base), (True, lean)):
                saved, peak, ms = measure(m, x, dy, args.iters)
                rows.append((saved, ms))
                peak_txt = f"{peak / 2**20:.1f}" if peak is not None else "-"
                print(f"| {activation} | {fused} | {recompute} | {saved / 2**20:.1f} | {peak_txt} | {ms:.2f} |")
            (s0, t0), (s1, t1) = rows
            print(f"|  |  | saved {100 * (s0 - s1) / s0:.1f}% of saved memory, time {100 * (t1 - t0) / t0:+.1f}% "
                  f"| | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
