"""softmax and cross_entropy on the CPU against eager PyTorch, at the shapes
their CPU kernels are judged at (softmax 256x4096 and 256x32000, cross-entropy
256x32000 and 64x128256), float32 and bfloat16, forward and forward+backward,
for each thread count asked. Timing and providers are `python -m opsmith bench
--device cpu`'s (opsmith/cpu_bench.py: interleaved batches, median; the spec's
eager provider). Usage:
    python bench/softmax_ce_cpu.py [--threads 1 2] [--out DIR]
writes DIR/results.json and DIR/table.md when --out is given."""
import argparse

import torch

from opsmith.cpu_bench import OURS, baseline_of, machine, measure_pair, write_results
from opsmith.specs import load_specs

SHAPES = {"softmax": [(256, 4096), (256, 32000)], "cross_entropy": [(256, 32000), (64, 128256)]}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["f32", "bf16"])
    parser.add_argument("--ops", nargs="+", default=list(SHAPES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    specs = {s.name: s for s in load_specs()}
    rows = []
    lines = ["| op | direction | dtype | shape | threads | opsmith (us) | eager (us) | eager / opsmith |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for threads in args.threads:
        torch.set_num_threads(threads)
        for op in args.ops:
            bench = specs[op].bench
            eager = baseline_of(bench)
            for dname in args.dtypes:
                for r, n in SHAPES[op]:
                    for backward in (False, True):
                        t = measure_pair(bench, [OURS, eager], r, n, DTYPES[dname], backward)
                        row = {"op": op, "direction": "fwd+bwd" if backward else "fwd", "dtype": dname,
                               "rows": r, "hidden": n, "threads": threads, "eager": eager,
                               "ours_us": t[OURS] * 1e6, "eager_us": t[eager] * 1e6,
                               "speedup": t[eager] / t[OURS]}
                        rows.append(row)
                        lines.append(f"| {op} | {row['direction']} | {dname} | {r}x{n} | {threads} | "
                                     f"{row['ours_us']:.0f} | {row['eager_us']:.0f} | {row['speedup']:.2f}x |")
                        print(lines[-1], flush=True)
    meta = {"torch": torch.__version__, **machine()}
    if args.out:
        write_results(args.out, meta, rows, lines)


if __name__ == "__main__":
    main()
