"""Benchmark suite: `python -m opsmith bench [--ops ...] [--quick]` (CUDA only).

For each registered op, forward and forward+backward, over a sweep of
(rows, hidden size, dtype), every provider is timed in the same run
(triton's do_bench median, CUDA events), with inputs rotated across enough
copies that the L2 cache cannot serve them. Each row reports the time, the
achieved GB/s over the minimal bytes the op must move (each input read once,
each output written once), that as a fraction of the device-to-device copy
bandwidth measured in the same run, and the peak extra memory.

What is measured for each op (inputs, providers, shapes, the minimal-bytes
model) is the `bench` part of its spec (opsmith/specs/<op>.py).

`--device cpu` times every op against eager PyTorch on the CPU
(opsmith/cpu_bench.py). `--routes` measures something else, on any device: route A (pybind11)
against route B (torch.library) on rms_norm (opsmith/route_bench.py)."""
import csv
import datetime
import json
import os
import platform
import sys
import time
from typing import List, Optional

import torch

from ._cli import Parser

from opsmith.specs import OpSpec, load_specs

L2_FLUSH_BYTES = 256 << 20  # rotate inputs over at least this many bytes

# every swept shape compiles its own graph: lift dynamo's recompile limit so
# none of them silently falls back to eager
for _name in ("cache_size_limit", "recompile_limit"):
    if hasattr(torch._dynamo.config, _name):
        setattr(torch._dynamo.config, _name, 4096)

# name -> OpSpec, for every op whose spec has a benchmark (OpSpec.bench)
OPS = {spec.name: spec for spec in load_specs() if spec.bench is not None}


# --- measurement -----------------------------------------------------------------

def _do_bench(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth_gbs(device) -> float:
    """Device-to-device copy of 1 GiB: bytes read + bytes written over time."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = _do_bench(lambda: b.copy_(a))
    return 2 * a.numel() / (ms * 1e-3) / 1e9


def provider_step(op: str, provider: str, rows: int, n: int, dtype, device, backward: bool = False):
    """One call of op's bench provider on one set of its bench inputs, as a
    step to run or capture: a forward without autograd, or (backward) a
    forward and the gradients of its grad inputs."""
    spec = OPS[op].bench
    s = spec.make_inputs(rows, n, dtype, device)
    inputs = {k: s[k].requires_grad_(backward) for k in spec.grad_inputs}
    fn, dy = spec.providers[provider](n, dtype, device), s["dy"]

    def step():
        if backward:
            torch.autograd.grad(fn(**inputs), list(inputs.values()), dy, allow_unused=True)
        else:
            with torch.no_grad():
                fn(**inputs)

    return step


def _measure(spec: OpSpec, provider: str, rows, n, dtype, device, backward: bool):
    op = spec.bench
    elem = torch.empty((), dtype=dtype).element_size()
    per_set = op.fwdbwd_bytes(rows, n, elem)
    copies = max(1, min(64, -(-L2_FLUSH_BYTES // per_set)))
    sets = [op.make_inputs(rows, n, dtype, device) for _ in range(copies)]
    fn = op.providers[provider](n, dtype, device)
    if backward:
        for s in sets:
            for k in op.grad_inputs:
                s[k].requires_grad_(True)
    state = {"i": 0}

    def step():
        s = sets[state["i"] % copies]
        state["i"] += 1
        args = {k: s[k] for k in op.grad_inputs}
        y = fn(**args)
        if backward:
            torch.autograd.grad(y, list(args.values()), s["dy"], allow_unused=True)

    step()  # compile / autotune outside the timing
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize()
    peak_extra = torch.cuda.max_memory_allocated(device) - base
    moved = (op.fwdbwd_bytes if backward else op.fwd_bytes)(rows, n, elem)
    if rows <= SMALL_ROWS or backward:
        # decoding-sized calls, and every forward+backward step (a forward,
        # an autograd call, several launches: on a slow host the host sets
        # the pace of steps under ~1 ms): time the replay of a CUDA graph of
        # several calls (inputs rotate inside it), so the GPU time is measured
        calls = GRAPH_CALLS if moved < L2_FLUSH_BYTES else 3
        if not _waits_on_host(step):
            try:
                return _graph_ms(step, calls), moved, peak_extra, "graph"
            except Exception:
                torch.cuda.synchronize()
    return _do_bench(step), moved, peak_extra, "events"


SMALL_ROWS = 64
GRAPH_CALLS = 20


def _waits_on_host(step) -> bool:
    """Whether a step synchronises with the host (Liger's cross-entropy
    does): such a step is timed by events, never captured, since a capture
    it breaks can leave the stream capturing and every later case failing."""
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return False
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode(prev)
        torch.cuda.synchronize()


def capture_graph(step, calls: int):
    """A CUDA graph of `calls` calls of step (warmed up on a side stream
    first), replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            step()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def _graph_ms(step, calls: int = GRAPH_CALLS) -> float:
    return _do_bench(capture_graph(step, calls).replay) / calls


def host_overhead_us(device, calls: int = 2000, ops: Optional[List[str]] = None):
    """Per-call host time of the public calls on a tiny tensor: wall time of
    `calls` back-to-back calls (the GPU work of each is far shorter). The
    calls are each spec's `bench.host_calls`."""
    cases = {}
    for name in (list(OPS) if ops is None else ops):
        if OPS[name].bench.host_calls is not None:
            cases.update(OPS[name].bench.host_calls(device))
    out = {}
    for name, fn in cases.items():
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        out[name] = round(best, 2)
    return out


def saved_tensor_bytes(fn):
    """(fn(), bytes of the distinct tensors autograd saves for the backward
    while fn() builds the graph), counted through saved-tensor hooks, so the
    same on any device."""
    seen = {}

    def pack(t):
        seen[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def _sweep(spec: OpSpec, quick: bool, dtypes: Optional[List[str]] = None):
    op = spec.bench
    if quick:
        shapes = list(op.quick_shapes)
        return shapes, [DTYPES[d] for d in dtypes or ["bf16"]]
    max_elems = 1 << 30
    shapes = [(r, n) for n in op.hidden_sizes for r in op.row_counts if r * n <= max_elems]
    return shapes, [DTYPES[d] for d in dtypes or list(DTYPES)]


def run(ops: List[str], quick: bool, out_dir: str, providers: Optional[List[str]] = None,
        dtypes: Optional[List[str]] = None, budget_s: Optional[float] = None) -> int:
    if not torch.cuda.is_available():
        print("opsmith bench: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    os.makedirs(out_dir, exist_ok=True)
    copy_gbs = copy_bandwidth_gbs(device)
    meta = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "copy_bandwidth_gbs": round(copy_gbs, 1),
        "quick": quick,
    }
    print(f"{meta['gpu']}  torch {meta['torch']}  copy bandwidth {copy_gbs:.0f} GB/s")
    meta["host_overhead_us"] = host_overhead_us(device, ops=ops)
    print("host time per call (us):", json.dumps(meta["host_overhead_us"], indent=1))
    rows_out = []
    jobs = []
    for name in ops:
        op = OPS[name]
        shapes, swept_dtypes = _sweep(op, quick, dtypes)
        # dtype outermost: a run cut short by --budget loses whole dtypes,
        # not one direction of every shape
        for dtype in swept_dtypes:
            for rows, n in shapes:
                for backward in (False, True):
                    for p in op.bench.providers:
                        if providers is None or p in providers:
                            jobs.append((op, p, rows, n, dtype, backward))
    t0 = time.time()
    for i, (op, p, rows, n, dtype, backward) in enumerate(jobs):
        if budget_s is not None and time.time() - t0 > budget_s:
            meta["stopped_early"] = f"{i} of {len(jobs)} measurements run within the {budget_s:.0f} s budget"
            print(f"\nopsmith bench: {meta['stopped_early']}", file=sys.stderr)
            break
        direction = "fwd+bwd" if backward else "fwd"
        try:
            ms, moved, peak, timing = _measure(op, p, rows, n, dtype, device, backward)
            err = ""
        except Exception as e:  # a provider that cannot run a shape is recorded, not fatal
            ms, moved, peak, timing = float("nan"), 0, 0, ""
            err = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        gbs = moved / (ms * 1e-3) / 1e9 if ms == ms else float("nan")
        rows_out.append({
            "op": op.name, "direction": direction, "provider": p, "dtype": str(dtype).replace("torch.", ""),
            "rows": rows, "hidden": n, "ms": ms, "bytes": moved, "gbs": gbs,
            "fraction_of_copy": gbs / copy_gbs, "peak_extra_mb": peak / 2**20, "timing": timing,
            "error": err,
        })
        torch.cuda.empty_cache()
        done = i + 1
        bar = "#" * (30 * done // len(jobs))
        sys.stderr.write(f"\r[{bar:<30}] {done}/{len(jobs)} {time.time() - t0:5.0f}s")
    sys.stderr.write("\n")
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows_out}, f, indent=1)
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows_out[0]))
        w.writeheader()
        w.writerows(rows_out)
    print(summary_table({"meta": meta, "rows": rows_out}))
    return 0


CONDENSED_SMALL_ROWS = 16
OURS = "opsmith"  # the provider the tables compare with the fastest other one


def summary_table(results, condensed: bool = False) -> str:
    """Markdown: per (op, direction, dtype, shape), each provider's time and
    fraction of copy bandwidth; the fastest marked. condensed: per hidden
    size only the largest row count swept and CONDENSED_SMALL_ROWS rows."""
    rows = results["rows"]
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    keys = sorted(dict.fromkeys((r["op"], r["direction"], r["dtype"], r["rows"], r["hidden"]) for r in rows),
                  key=lambda k: (k[0], k[1] != "fwd", k[2], k[4], k[3]))
    if condensed:
        largest = {}  # (op, direction, dtype, hidden) -> largest row count swept
        for op, direction, dtype, n_rows, hidden in keys:
            largest[op, direction, dtype, hidden] = max(largest.get((op, direction, dtype, hidden), 0), n_rows)
        keys = [k for k in keys if k[3] in (largest[k[0], k[1], k[2], k[4]], CONDENSED_SMALL_ROWS)]
    by = {(r["op"], r["direction"], r["dtype"], r["rows"], r["hidden"], r["provider"]): r for r in rows}
    compare = int(OURS in providers and len(providers) > 1)
    m = results["meta"]
    # results from before every forward+backward step was graph-timed say so
    fwdbwd = [r for r in rows if r["direction"] == "fwd+bwd" and r["ms"] == r["ms"]]
    graphed = (f"forward+backward steps and forward rows <= {SMALL_ROWS}"
               if fwdbwd and all(r.get("timing") == "graph" for r in fwdbwd) else f"rows <= {SMALL_ROWS}")
    out = [f"{m['gpu']}, torch {m['torch']}, CUDA {m['cuda']}, {m['date']}; copy bandwidth "
           f"{m['copy_bandwidth_gbs']} GB/s. Cells: median ms (fraction of copy bandwidth); * = fastest; "
           f"{graphed} timed by CUDA-graph replay."
           + (f" Stopped early: {m['stopped_early']}." if m.get("stopped_early") else ""), "",
           "| op | dir | dtype | rows x hidden | " + " | ".join(providers)
           + (f" | {OURS} / best other" if compare else "") + " |",
           "|---|---|---|---|" + "---|" * (len(providers) + compare)]
    for k in keys:
        cells = [by.get(k + (p,)) for p in providers]
        times = [c["ms"] for c in cells if c and c["ms"] == c["ms"]]
        best = min(times) if times else None
        txt = []
        for c in cells:
            if not c or c["ms"] != c["ms"]:
                txt.append("n/a")
            else:
                txt.append(f"{c['ms']:.4f} ({c['fraction_of_copy']:.2f}){'*' if c['ms'] == best else ''}")
        if compare:
            # time over the fastest other provider's: above 1.00x a row misses
            # "at least as fast as the best" (decode rows: within 1.2x)
            ours = by.get(k + (OURS,))
            others = [c["ms"] for p, c in zip(providers, cells) if p != OURS and c and c["ms"] == c["ms"]]
            ok = ours and ours["ms"] == ours["ms"] and others
            txt.append(f"{ours['ms'] / min(others):.2f}x" if ok else "n/a")
        out.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]}x{k[4]} | " + " | ".join(txt) + " |")
    if "host_overhead_us" in m:
        out += ["", "Host time per call on a 4x256 bf16 tensor (us):", "",
                "| call | us |", "|---|---|"]
        out += [f"| {k} | {v} |" for k, v in m["host_overhead_us"].items()]
    return "\n".join(out)


def plot(results, out_dir: str) -> List[str]:
    """One PNG per op and direction: GB/s against hidden size at the largest
    row count swept for each, one line per provider (bf16)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in results["rows"] if r["dtype"] == "bfloat16" and r["gbs"] == r["gbs"]]
    paths = []
    for op, direction in dict.fromkeys((r["op"], r["direction"]) for r in rows):
        sel = [r for r in rows if r["op"] == op and r["direction"] == direction]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for p in dict.fromkeys(r["provider"] for r in sel):
            best = {}
            for r in sel:
                if r["provider"] == p and r["rows"] * r["hidden"] >= best.get(r["hidden"], (0, None))[0]:
                    best[r["hidden"]] = (r["rows"] * r["hidden"], r["gbs"])
            hs = sorted(best)
            ax.plot(hs, [best[h][1] for h in hs], marker="o", label=p)
        ax.axhline(results["meta"]["copy_bandwidth_gbs"], color="gray", ls="--", label="copy")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("hidden size (largest row count swept)")
        ax.set_ylabel("GB/s over minimal bytes")
        ax.set_title(f"{op} {direction}, bf16, {results['meta']['gpu']}")
        ax.legend(fontsize=8)
        path = os.path.join(out_dir, f"{op}_{direction.replace('+', '_')}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


README_BEGIN = "<!-- bench table: generated by `python -m opsmith bench --readme DIR`, do not edit -->"
README_END = "<!-- end of bench table -->"


def write_readme_table(results_dirs, readme: str = "README.md") -> None:
    """Regenerate each results_dir/table.md and replace the README's
    benchmark section with one condensed table per directory, all from the
    results.json files (never typed by hand). One directory or a list."""
    if isinstance(results_dirs, str):
        results_dirs = [results_dirs]
    parts = []
    for results_dir in results_dirs:
        with open(os.path.join(results_dir, "results.json")) as f:
            results = json.load(f)
        with open(os.path.join(results_dir, "table.md"), "w") as f:
            f.write(summary_table(results) + "\n")
        ops = ", ".join(dict.fromkeys(r["op"] for r in results["rows"]))
        parts.append(f"{ops}: from `{results_dir}/results.json`, per hidden size the largest row count swept "
                     f"and {CONDENSED_SMALL_ROWS} rows (every shape: `{results_dir}/table.md`):\n\n"
                     f"{summary_table(results, condensed=True)}\n")
    with open(readme) as f:
        text = f.read()
    start, end = text.index(README_BEGIN), text.index(README_END)
    with open(readme, "w") as f:
        f.write(text[:start] + README_BEGIN + "\n" + "\n".join(parts) + text[end:])


def main(argv=None) -> int:
    parser = Parser(prog="opsmith bench")
    parser.add_argument("--ops", nargs="*", default=list(OPS))
    parser.add_argument("--providers", nargs="*", default=None)
    parser.add_argument("--quick", action="store_true", help="a few large shapes (bf16 unless --dtypes)")
    parser.add_argument("--dtypes", nargs="*", choices=list(DTYPES), default=None,
                        help="dtypes to sweep (default: all three; bf16 with --quick)")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="stop starting measurements after this long; the results say so")
    parser.add_argument("--out", default=None, help="results directory (default bench/results/latest; "
                        "bench/results/latest-routes with --routes)")
    parser.add_argument("--readme", metavar="DIR", nargs="+",
                        help="only regenerate each DIR/table.md and README.md's tables from DIR/results.json")
    routes = parser.add_argument_group("--routes", "route A (pybind11) against route B (torch.library) on rms_norm")
    routes.add_argument("--routes", action="store_true",
                        help="compare the two routes: torch.compile, opcheck, host time, build time, binary size "
                             "(any device; --quick for a short run)")
    routes.add_argument("--device", default=None,
                        help="cpu: the CPU benchmark against eager PyTorch (opsmith/cpu_bench.py); with --routes: "
                             "cpu or cuda (default: cuda when present)")
    routes.add_argument("--build-time", choices=("compile", "log", "none"), default=None,
                        help="with --routes: compile each route afresh (default), read setup.py's ninja log "
                             "(default with --quick), or skip")
    routes.add_argument("--backend", default=None,
                        help="with --routes: torch.compile backend (default inductor; aot_eager with --quick)")
    e2e = parser.add_argument_group("--e2e", "a Hugging Face Llama-3.2-1B training step under each configuration "
                                    "(opsmith/e2e_bench.py)")
    e2e.add_argument("--e2e", action="store_true", help="eager, torch.compile, Liger-patched, opsmith-patched "
                     "(and compiled): tokens/s and peak memory (CUDA)")
    e2e.add_argument("--batch", type=int, default=4, help="with --e2e: sequences a step (default 4)")
    e2e.add_argument("--seq", type=int, default=4096, help="with --e2e: tokens a sequence (default 4096)")
    e2e.add_argument("--configs", nargs="*", default=None, help="with --e2e: a subset of the configurations")
    e2e.add_argument("--max-batch", action="store_true", help="with --e2e: also the largest batch each fits")
    args = parser.parse_args(argv)
    if args.e2e:
        from .e2e_bench import CONFIGS, run as run_e2e
        configs = args.configs or list(CONFIGS)
        bad = [c for c in configs if c not in CONFIGS]
        if bad:
            parser.error(f"--configs: unknown {', '.join(bad)} (choose from {', '.join(CONFIGS)})")
        return run_e2e(args.out or os.path.join("bench", "results", "latest-e2e"), configs, args.batch, args.seq,
                       find_max=args.max_batch)
    if args.routes:
        from .route_bench import run as run_routes
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        build = args.build_time or ("log" if args.quick else "compile")
        return run_routes(device, args.quick, args.out or os.path.join("bench", "results", "latest-routes"),
                          build, args.backend)
    if args.device == "cpu":
        from .cpu_bench import run as run_cpu
        return run_cpu(args.ops if args.ops != list(OPS) else None, args.quick,
                       args.out or os.path.join("bench", "results", "latest-cpu"), args.dtypes)
    if args.out is None:
        args.out = os.path.join("bench", "results", "latest")
    if args.readme:
        write_readme_table(args.readme)
        return 0
    rc = run(args.ops, args.quick, args.out, args.providers, args.dtypes, args.budget)
    if rc == 0:
        with open(os.path.join(args.out, "results.json")) as f:
            results = json.load(f)
        try:
            plot(results, args.out)
        except ImportError:
            print("matplotlib missing: no plots", file=sys.stderr)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(summary_table(results) + "\n")
    return rc
