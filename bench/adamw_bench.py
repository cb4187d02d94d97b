"""AdamW step benchmark (CUDA): opsmith.optim.AdamW against
torch.optim.AdamW(foreach=True) and (fused=True), each with and without
gradient clipping (opsmith: max_grad_norm, fused into the step; torch:
torch.nn.utils.clip_grad_norm_ before the step).

Two parameter sets: a Llama-like one (~490M float32 params in 300 tensors:
embedding, lm_head, 33 layers of q/k/v/o, gate/up/down and two norms) and
~8000 small tensors of mixed sizes (log-uniform, 1 to 128K elements).
Reported: median ms (triton do_bench) of the eager step (host time
included: thousands of tensors cost Python time per step in every
provider) and of the step replayed from a CUDA graph (device time alone;
torch's optimizers built with capturable=True there), GB/s over the minimal bytes (float32:
read p, g, m, v and write p, m, v = 28 B a param; bf16 params with float32
masters: read g (2), master, m, v; write p (2), master, m, v = 28 B), and
that as a fraction of the device-to-device copy bandwidth measured in the
same run.

    python bench/adamw_bench.py [--quick] [--out bench/results/DIR]
"""
import argparse
import datetime
import json
import math
import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import opsmith  # noqa: E402
from opsmith.bench import _do_bench, copy_bandwidth_gbs  # noqa: E402
from opsmith.optim import AdamW  # noqa: E402

BYTES_PER_PARAM = 28
MAX_NORM = 1.0


def llama_shapes(scale=1.0):
    h, i, vocab, layers = 1024, 2816, 32000, 33
    vocab = int(vocab * scale)
    shapes = [(vocab, h), (vocab, h), (h,)]  # embed, lm_head, final norm
    for _ in range(layers):
        shapes += [(h, h)] * 4 + [(i, h), (i, h), (h, i), (h,), (h,)]
    return shapes


def small_shapes(count=8000, seed=0):
    rng = random.Random(seed)
    return [(max(1, int(math.exp(rng.uniform(0, math.log(131072))))),) for _ in range(count)]


def make(shapes, dtype, device="cuda"):
    params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=torch.float32).to(dtype)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    return params


def providers(mode):
    """name -> build(params, graph) -> (optimizer, step function)."""
    def ours(clip, master=False):
        def build(params, graph):
            opt = AdamW(params, lr=1e-4, master_weights=master, max_grad_norm=MAX_NORM if clip else None)
            return opt, opt.step
        return build

    def torch_opt(clip, **kw):
        def build(params, graph):
            args = dict(kw, capturable=True) if graph else kw
            opt = torch.optim.AdamW(params, lr=torch.tensor(1e-4, device="cuda") if graph else 1e-4, **args)
            if not clip:
                return opt, opt.step

            def step():
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
                opt.step()
            return opt, step
        return build

    if mode == "bf16_master":
        return {"opsmith": ours(False, True), "opsmith+clip": ours(True, True)}
    return {"opsmith": ours(False), "opsmith+clip": ours(True),
            "torch_foreach": torch_opt(False, foreach=True), "torch_foreach+clip": torch_opt(True, foreach=True),
            "torch_fused": torch_opt(False, fused=True), "torch_fused+clip": torch_opt(True, fused=True)}


def plot(results_json: str) -> str:
    """adamw.png beside results.json: fraction of copy bandwidth (graph
    replay) per set and mode, one bar per provider."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(results_json) as f:
        data = json.load(f)
    rows, meta = data["rows"], data["meta"]
    groups = sorted({(r["set"], r["mode"]) for r in rows}, key=lambda g: (g[0], g[1]))
    names = list(dict.fromkeys(r["provider"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        vals = [next((r["fraction_of_copy"] for r in rows if (r["set"], r["mode"]) == g and r["provider"] == name),
                     0.0) for g in groups]
        ax.bar([i + k * width for i in range(len(groups))], vals, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], [f"{s}\n{m}" for s, m in groups])
    ax.set_ylabel("fraction of copy bandwidth (28 B/param)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"AdamW step, {meta['gpu']}, torch {meta['torch']} (CUDA-graph replay)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    out = os.path.join(os.path.dirname(results_json), "adamw.png")
    fig.savefig(out, dpi=110)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a quarter of the Llama-like set, 2000 small tensors")
    ap.add_argument("--out", default=None, help="directory for results.json, table.md and adamw.png")
    ap.add_argument("--plot", metavar="RESULTS_JSON", help="only draw adamw.png from a results.json")
    ap.add_argument("--sets", nargs="+", choices=["llama", "small"], default=["llama", "small"],
                    help="the parameter sets to run (default both)")
    ap.add_argument("--modes", nargs="+", choices=["fp32", "bf16_master"], default=["fp32", "bf16_master"])
    ap.add_argument("--providers", nargs="+", metavar="NAME", default=None,
                    help="only these providers (their names in the table, e.g. opsmith opsmith+clip)")
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return 0
    if not torch.cuda.is_available():
        print("adamw_bench: needs a CUDA device")
        return 2
    copy = copy_bandwidth_gbs("cuda")
    sets = {}
    if "llama" in args.sets:
        sets["llama_500M_300t"] = llama_shapes(0.25 if args.quick else 1.0)
    if "small" in args.sets:
        sets["small_8000t"] = small_shapes(2000 if args.quick else 8000)
    rows = []
    for set_name, shapes in sets.items():
        n_params = sum(math.prod(s) for s in shapes)
        for mode, dtype in (("fp32", torch.float32), ("bf16_master", torch.bfloat16)):
            if mode not in args.modes:
                continue
            for name, build in providers(mode).items():
                if args.providers is not None and name not in args.providers:
                    continue
                params = make(shapes, dtype)
                opt, step = build(params, False)
                step()  # state made outside the timing
                torch.cuda.synchronize()
                eager_ms = _do_bench(step)
                del opt, step
                graph_ms = None
                try:
                    opt, step = build(params, True)
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(3):  # state and lazy initialisation outside the graph
                            step()
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        step()
                    graph_ms = _do_bench(graph.replay)
                    del graph, opt, step
                except Exception as e:  # a provider that cannot be captured: eager time only
                    print(f"  {name}: no CUDA graph ({type(e).__name__}: {str(e)[:120]})")
                ms = graph_ms if graph_ms is not None else eager_ms
                gbs = BYTES_PER_PARAM * n_params / (ms * 1e-3) / 1e9
                row = {"set": set_name, "tensors": len(shapes), "params": n_params, "mode": mode,
                       "provider": name, "ms": round(ms, 4), "eager_ms": round(eager_ms, 4),
                       "graph_ms": None if graph_ms is None else round(graph_ms, 4), "gbs": round(gbs, 1),
                       "fraction_of_copy": round(gbs / copy, 3)}
                rows.append(row)
                print(f"{set_name:16s} {mode:12s} {name:20s} graph {ms:9.3f} ms {gbs:7.0f} GB/s "
                      f"{gbs / copy:5.2f}   eager {eager_ms:9.3f} ms")
                del params
                torch.cuda.empty_cache()
    # clipping's cost: step+clip over step, per set/mode/family
    for r in rows:
        if r["provider"].endswith("+clip"):
            base = next(b for b in rows if b["set"] == r["set"] and b["mode"] == r["mode"]
                        and b["provider"] == r["provider"][:-5])
            r["clip_over_step"] = round(r["ms"] / base["ms"], 3)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": datetime.date.today().isoformat(), "copy_bandwidth_gbs": round(copy, 1),
            "bytes_per_param": BYTES_PER_PARAM, "quick": args.quick}
    table = [f"{meta['gpu']}, torch {meta['torch']}, CUDA {meta['cuda']}, {meta['date']}; copy bandwidth "
             f"{meta['copy_bandwidth_gbs']} GB/s; 28 B/param minimal. ms: CUDA-graph replay (eager where a "
             f"provider cannot be captured); GB/s and fraction of copy from it.", "",
             "| set | tensors | params | mode | provider | ms | GB/s | of copy | +clip / step | eager ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['set']} | {r['tensors']} | {r['params'] / 1e6:.0f}M | {r['mode']} | {r['provider']} | "
                     f"{r['ms']:.3f} | {r['gbs']:.0f} | {r['fraction_of_copy']:.2f} | {r.get('clip_over_step', '')} | "
                     f"{r['eager_ms']:.3f} |")
    print("\n".join(table))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write("\n".join(table) + "\n")
        try:
            plot(os.path.join(args.out, "results.json"))
        except ImportError:
            print("adamw_bench: matplotlib missing, no plot (draw it later with --plot results.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
