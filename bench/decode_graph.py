"""Decode-size calls (forwards, or forward+backward steps with --backward)
as CUDA graphs of many calls, to split a call's time in graph replay into
its kernels' run and what a graph node costs beyond it:

- each provider's time a call in the replay of a graph of `--calls` calls
  (CUDA events, median of the replays);
- each kernel's time inside that replay (torch.profiler over replays);
- the same for a graph of a one-element fill, the floor a node costs.

    python bench/decode_graph.py [--calls 100] [--label NAME] [--ops ...] [--providers ...] [--backward]

Run from the repository root with the library built. OPSMITH_NORM_LATENCY_PACKS
(csrc/cuda/norm_plan.cuh) picks the packs a thread of the norms' plan for a
short batch, read once a process: one process a setting, `--label` naming it.
Rows are printed and appended to $OUT/decode_graph.jsonl when OUT is set."""
import argparse
import json
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.getcwd())
from opsmith.bench import capture_graph, provider_step  # noqa: E402

NORM_SHAPES = [(1, 4096), (16, 4096), (64, 4096), (1, 8192), (16, 8192)]
# (rows, n) as each op's bench spec reads them: rotary's rows are batch 4 x
# seq tokens of head_dim n (32 query and 8 key heads)
SHAPES = {"rms_norm": NORM_SHAPES, "layer_norm": NORM_SHAPES, "fused_add_rms_norm": NORM_SHAPES,
          "glu": [(1, 14336), (16, 14336), (64, 14336)], "rotary": [(4, 128), (64, 128)]}
PROVIDERS = {"rms_norm": ["opsmith", "torch_compile_F", "torch_compile_hf_llama", "liger"],
             "layer_norm": ["opsmith", "torch_compile_F", "liger"],
             "fused_add_rms_norm": ["opsmith", "torch_compile", "liger"],
             "glu": ["opsmith", "torch_compile", "liger"],
             "rotary": ["opsmith", "torch_compile", "liger"]}


def replay_us(g, calls, reps=50):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def kernels_us(g, calls, reps=5):
    """{kernel name: mean us a run} over the kernels the replays ran, and their sum a call."""
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    evs = [e for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    per = {e.key[:90]: round(e.device_time_total / e.count, 3) for e in evs if e.count}
    total = sum(e.device_time_total for e in evs) / (reps * calls)
    return per, total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--label", default=os.environ.get("OPSMITH_NORM_LATENCY_PACKS", "default"))
    ap.add_argument("--opsmith-only", action="store_true")
    ap.add_argument("--ops", nargs="*", default=list(PROVIDERS))
    ap.add_argument("--providers", nargs="*", default=None, help="default: each op's list")
    ap.add_argument("--backward", action="store_true", help="forward+backward steps, not forwards")
    args = ap.parse_args()
    dev = torch.device("cuda")
    out = os.environ.get("OUT")
    sink = open(os.path.join(out, "decode_graph.jsonl"), "a") if out else None

    def emit(row):
        row = {"label": args.label, "gpu": torch.cuda.get_device_name(dev), **row}
        print(json.dumps(row), flush=True)
        if sink:
            sink.write(json.dumps(row) + "\n")

    one = torch.zeros(1, device=dev)
    g = capture_graph(lambda: one.fill_(1.0), args.calls)
    per, k = kernels_us(g, args.calls)
    emit({"op": "floor", "provider": "fill_ one element", "us_call": round(replay_us(g, args.calls), 3),
          "kernel_us_call": round(k, 3), "kernels": per})
    for op in args.ops:
        providers = [p for p in PROVIDERS[op] if args.providers is None or p in args.providers]
        for rows, n in SHAPES[op]:
            for prov in providers[:1] if args.opsmith_only else providers:
                head = {"op": op, "dir": "fwd+bwd" if args.backward else "fwd", "rows": rows, "n": n,
                        "provider": prov}
                try:
                    step = provider_step(op, prov, rows, n, torch.bfloat16, dev, backward=args.backward)
                    step()
                    g = capture_graph(step, args.calls)
                    us = replay_us(g, args.calls)
                    per, k = kernels_us(g, args.calls)
                except Exception as e:  # a provider that cannot run here is reported, not fatal
                    emit({**head, "error": repr(e)[:200]})
                    continue
                emit({**head, "us_call": round(us, 3), "kernel_us_call": round(k, 3), "kernels": per})


if __name__ == "__main__":
    main()
