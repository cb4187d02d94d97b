"""AdamW step benchmark (CUDA): opsmith.optim.AdamW against
torch.optim.AdamW(foreach=True) and (fused=True), each with and without
gradient clipping (opsmith: max_grad_norm, fused into the step; torch:
torch.nn.utils.clip_grad_norm_ before the step).

Two parameter sets: a Llama-like one (~490M float32 params in 300 tensors:
embedding, lm_head, 33 layers of q/k/v/o, gate/up/down and two norms) and
~8000 small tensors of mixed sizes (log-uniform, 1 to 128K elements).
Reported: median ms (triton do_bench), GB/s over the minimal bytes (float32:
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
    """name -> (make optimizer from params, step function)."""
    def ours(clip, master=False):
        def build(params):
            opt = AdamW(params, lr=1e-4, master_weights=master, max_grad_norm=MAX_NORM if clip else None)
            return opt, opt.step
        return build

    def torch_opt(clip, **kw):
        def build(params):
            opt = torch.optim.AdamW(params, lr=1e-4, **kw)
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a quarter of the Llama-like set, 2000 small tensors")
    ap.add_argument("--out", default=None, help="directory for results.json and table.md")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("adamw_bench: needs a CUDA device")
        return 2
    copy = copy_bandwidth_gbs("cuda")
    sets = {"llama_500M_300t": llama_shapes(0.25 if args.quick else 1.0),
            "small_8000t": small_shapes(2000 if args.quick else 8000)}
    rows = []
    for set_name, shapes in sets.items():
        n_params = sum(math.prod(s) for s in shapes)
        for mode, dtype in (("fp32", torch.float32), ("bf16_master", torch.bfloat16)):
            for name, build in providers(mode).items():
                params = make(shapes, dtype)
                opt, step = build(params)
                step()  # state made outside the timing
                torch.cuda.synchronize()
                ms = _do_bench(step)
                gbs = BYTES_PER_PARAM * n_params / (ms * 1e-3) / 1e9
                row = {"set": set_name, "tensors": len(shapes), "params": n_params, "mode": mode,
                       "provider": name, "ms": round(ms, 4), "gbs": round(gbs, 1),
                       "fraction_of_copy": round(gbs / copy, 3)}
                rows.append(row)
                print(f"{set_name:16s} {mode:12s} {name:20s} {ms:9.3f} ms {gbs:7.0f} GB/s {gbs / copy:5.2f}")
                del opt, step, params
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
             f"{meta['copy_bandwidth_gbs']} GB/s; 28 B/param minimal.", "",
             "| set | tensors | params | mode | provider | ms | GB/s | of copy | +clip / step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['set']} | {r['tensors']} | {r['params'] / 1e6:.0f}M | {r['mode']} | {r['provider']} | "
                     f"{r['ms']:.3f} | {r['gbs']:.0f} | {r['fraction_of_copy']:.2f} | {r.get('clip_over_step', '')} |")
    print("\n".join(table))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write("\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
