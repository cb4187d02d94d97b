"""`python -m opsmith bench --device cpu`: every op with a benchmark against
eager PyTorch on this machine's CPU, forward and forward+backward, at the
shapes CPU kernels are judged at (256x1024, 64x4096, 4096x4096, or the op's
BenchSpec.cpu_shapes) in float32, bfloat16 and float16, with torch's thread
count.

Timing: wall clock (perf_counter) of back-to-back calls; each measurement is
the median of REPEATS batches, a batch long enough (>= BATCH_S) that timer
and scheduling noise stay small against it; the two providers alternate
batch by batch, so a slow spell of a shared machine hits both. The eager
baseline is the spec's first `torch_*` provider that is not compiled (or
BenchSpec.cpu_baseline)."""
import datetime
import json
import os
import platform
import statistics
import time
from typing import List, Optional

import torch

from opsmith.specs import load_specs

CPU_SHAPES = [(256, 1024), (64, 4096), (4096, 4096)]
QUICK_SHAPES = [(64, 256)]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
REPEATS = 7
BATCH_S = 0.05
OURS = "opsmith"


def baseline_of(bench) -> Optional[str]:
    explicit = getattr(bench, "cpu_baseline", None)
    if explicit:
        return explicit
    for name in bench.providers:
        if name.startswith("torch_") and "compile" not in name:
            return name
    return None


def _step(bench, fn, inputs, backward):
    args = {k: inputs[k] for k in bench.grad_inputs}

    def step():
        y = fn(**args)
        if backward:
            torch.autograd.grad(y, list(args.values()), inputs["dy"], allow_unused=True)
    return step


def _batch_calls(step) -> int:
    step()  # warm up
    t0 = time.perf_counter()
    step()
    one = max(time.perf_counter() - t0, 1e-7)
    return max(1, int(BATCH_S / one))


def measure_pair(bench, providers, rows, n, dtype, backward, repeats=REPEATS):
    """Median seconds per call of each provider, batches interleaved."""
    steps, calls = {}, {}
    for p in providers:
        inputs = bench.make_inputs(rows, n, dtype, "cpu")
        if backward:
            for k in bench.grad_inputs:
                inputs[k].requires_grad_(True)
        steps[p] = _step(bench, bench.providers[p](n, dtype, "cpu"), inputs, backward)
        calls[p] = _batch_calls(steps[p])
    times = {p: [] for p in providers}
    for _ in range(repeats):
        for p in providers:
            t0 = time.perf_counter()
            for _ in range(calls[p]):
                steps[p]()
            times[p].append((time.perf_counter() - t0) / calls[p])
    return {p: statistics.median(t) for p, t in times.items()}


def table(results) -> str:
    lines = ["| op | direction | dtype | shape | opsmith (us) | eager (us) | speed-up |",
             "| --- | --- | --- | --- | ---: | ---: | ---: |"]
    for r in results["rows"]:
        lines.append(f"| {r['op']} | {r['direction']} | {r['dtype']} | {r['rows']}x{r['hidden']} | "
                     f"{r['ours_us']:.1f} | {r['eager_us']:.1f} | {r['speedup']:.2f}x |")
    worst = min(results["rows"], key=lambda r: r["speedup"])
    best = max(results["rows"], key=lambda r: r["speedup"])
    lines.append("")
    lines.append(f"worst: {worst['op']} {worst['direction']} {worst['dtype']} {worst['rows']}x{worst['hidden']} "
                 f"{worst['speedup']:.2f}x; best: {best['op']} {best['direction']} {best['dtype']} "
                 f"{best['rows']}x{best['hidden']} {best['speedup']:.2f}x")
    return "\n".join(lines)


def machine() -> dict:
    """The CPU's model name and the load average now (where /proc and os say)."""
    meta = {}
    try:
        with open("/proc/cpuinfo") as f:
            meta["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        meta["load_average"] = os.getloadavg()[0]
    except (OSError, StopIteration):
        pass
    return meta


def write_results(out_dir: str, meta: dict, rows: list, lines: List[str]) -> None:
    """out_dir/results.json ({"meta", "rows"}) and out_dir/table.md (lines)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def run(ops: Optional[List[str]], quick: bool, out_dir: str, dtypes: Optional[List[str]] = None) -> int:
    specs = [s for s in load_specs() if s.bench is not None and (not ops or s.name in ops)]
    meta = {
        "date": datetime.date.today().isoformat(),
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "repeats": REPEATS,
        "batch_s": BATCH_S,
        "quick": quick,
    }
    meta.update(machine())
    rows = []
    for spec in specs:
        eager = baseline_of(spec.bench)
        if eager is None or OURS not in spec.bench.providers:
            continue
        shapes = QUICK_SHAPES if quick else (spec.bench.cpu_shapes or CPU_SHAPES)
        for dname in dtypes or list(DTYPES):
            for r, n in shapes:
                for backward in (False, True):
                    t = measure_pair(spec.bench, [OURS, eager], r, n, DTYPES[dname], backward,
                                     repeats=3 if quick else REPEATS)
                    rows.append({"op": spec.name, "direction": "fwd+bwd" if backward else "fwd", "dtype": dname,
                                 "rows": r, "hidden": n, "eager": eager, "ours_us": t[OURS] * 1e6,
                                 "eager_us": t[eager] * 1e6, "speedup": t[eager] / t[OURS]})
                    print(f"{spec.name:12} {rows[-1]['direction']:8} {dname:5} {r}x{n}: opsmith "
                          f"{rows[-1]['ours_us']:10.1f} us, {eager} {rows[-1]['eager_us']:10.1f} us, "
                          f"{rows[-1]['speedup']:.2f}x", flush=True)
    text = table({"meta": meta, "rows": rows}) if rows else "no op with a CPU baseline"
    write_results(out_dir, meta, rows, [text])
    print(text)
    return 0
