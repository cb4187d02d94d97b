"""Eager PyTorch's CPU softmax kernels timed as bench/softmax_cpu_loop.c times
opsmith's launchers: best of 30 calls, ns an element, softmax and
log_softmax forward and backward (torch._softmax_backward_data), float32,
bfloat16 and float16. Usage:
    python bench/softmax_eager_kernels.py [N (4096)] [THREADS (1)] [ROWS (256)]"""
import sys
import time

import torch


def best(fn, calls=30):
    t = 1e9
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(1)
    for name, dt in (("f32", torch.float32), ("bf16", torch.bfloat16), ("f16", torch.float16)):
        x = ((torch.rand(rows, n, generator=gen) - 0.5) * 8).to(dt)
        g = (torch.rand(rows, n, generator=gen) - 0.5).to(dt)
        for log in (False, True):
            fwd = torch.log_softmax if log else torch.softmax
            bwd = torch._log_softmax_backward_data if log else torch._softmax_backward_data
            y = fwd(x, -1)
            tf = best(lambda: fwd(x, -1))
            tb = best(lambda: bwd(g, y, -1, dt))
            print(f"{name:4s} {'log_softmax' if log else 'softmax':11s} {rows}x{n} fwd {tf * 1e9 / x.numel():.3f} ns/el "
                  f"bwd {tb * 1e9 / x.numel():.3f} ns/el")


if __name__ == "__main__":
    main()
