"""fused_linear_cross_entropy benchmark (CUDA): the LM head and its loss,
forward+backward, at the issue's shapes (bf16, N=8192 tokens: Llama 3's head
D=4096, V=128256, and Gemma 2's D=2304, V=262144), against eager PyTorch
``F.cross_entropy(F.linear(h, W).float(), t)``, the same under torch.compile,
and Liger-Kernel's LigerFusedLinearCrossEntropyFunction (when installed).

Reported per provider: median ms of forward+backward (triton's do_bench when
present, else CUDA events), achieved TFLOP/s over the 6 N D V FLOPs of the
three products, and the peak extra memory: torch.cuda.max_memory_allocated
during the step minus what was allocated before it, minus the gradients of
hidden and weight (the inputs are allocated before; so the figure is what the
op needs beyond its inputs and their gradients).

    python bench/flce_bench.py [--quick] [--providers opsmith,eager,...] [--chunk-size N] [--out DIR]
"""
import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import opsmith  # noqa: E402

SHAPES = [(8192, 4096, 128256), (8192, 2304, 262144)]
QUICK_SHAPES = [(8192, 4096, 128256)]


def providers(chunk_size):
    def ops(h, w, t):
        return opsmith.fused_linear_cross_entropy(h, w, t, chunk_size=chunk_size)

    def eager(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t)

    compiled = torch.compile(eager, dynamic=False)

    def liger():
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        def fn(h, w, t):
            out = LigerFusedLinearCrossEntropyFunction.apply(h, w, t)
            return out[0] if isinstance(out, tuple) else out
        return fn

    return {"opsmith": lambda: ops, "eager": lambda: eager, "torch_compile": lambda: compiled, "liger": liger}


def time_ms(fn):
    try:
        from triton.testing import do_bench
        return do_bench(fn, warmup=5, rep=50, return_mode="median")
    except ImportError:
        times = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)


def run_one(make_fn, n, d, v, dtype):
    torch.manual_seed(0)
    h = torch.randn(n, d, dtype=dtype, device="cuda", requires_grad=True)
    w = (torch.randn(v, d, dtype=dtype, device="cuda") / d ** 0.5).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    t[::7] = -100
    fn = make_fn()

    def step():
        h.grad = w.grad = None
        fn(h, w, t).backward()

    step()  # compile, autotune, cuBLASLt handle: outside the timing
    torch.cuda.synchronize()
    h.grad = w.grad = None
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    grads = h.grad.numel() * h.grad.element_size() + w.grad.numel() * w.grad.element_size()
    extra = torch.cuda.max_memory_allocated() - base - grads
    ms = time_ms(step)
    flops = 6.0 * n * d * v
    return {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, "peak_extra_gib": extra / 2**30}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the Llama 3 shape alone")
    ap.add_argument("--providers", default="opsmith,eager,torch_compile,liger")
    ap.add_argument("--chunk-size", type=int, default=None, help="opsmith's tokens per chunk (default: from the shape)")
    ap.add_argument("--out", default=None, help="a folder for results.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("flce_bench: needs a CUDA GPU")
    table = providers(args.chunk_size)
    rows = []
    for (n, d, v) in (QUICK_SHAPES if args.quick else SHAPES):
        for name in args.providers.split(","):
            try:
                r = run_one(table[name], n, d, v, torch.bfloat16)
            except ImportError as e:
                print(f"N={n} D={d} V={v} {name:14s} skipped: {e}")
                continue
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                print(f"N={n} D={d} V={v} {name:14s} out of memory")
                continue
            r.update(provider=name, n=n, d=d, v=v, dtype="bfloat16")
            rows.append(r)
            print(f"N={n} D={d} V={v} {name:14s} {r['ms']:8.2f} ms  {r['tflops']:6.1f} TFLOP/s  "
                  f"+{r['peak_extra_gib']:.2f} GiB")
            torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "device": torch.cuda.get_device_name(),
                "torch": torch.__version__, "chunk_size": args.chunk_size}
        with open(os.path.join(args.out, "flce_bench.json"), "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
