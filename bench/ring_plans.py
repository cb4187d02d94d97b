"""The row ops whose launch plans include the persistent ring (cross-entropy,
softmax, LayerNorm, RMSNorm, fused add + RMSNorm) at their issues' shapes,
and SwiGLU's (glu; not in the default set), bf16: median ms (triton
do_bench, L2 flushed) and the fraction of the copy bandwidth measured in
the same run over the minimal bytes. Run it under the ring's tuning
variables to compare plans in one build, or once a build, for example:

    python bench/ring_plans.py default
    OPSMITH_RING_STAGES=0 python bench/ring_plans.py streaming
    OPSMITH_RING_STAGES=1 python bench/ring_plans.py one-stage ce softmax

(OPSMITH_RING_STAGES, OPSMITH_RING_MAX_CTAS, OPSMITH_RING_SLICE_KB,
OPSMITH_RING_PACKS, OPSMITH_RING_SPECIALISED, OPSMITH_RING_WARP_PACKS: see
csrc/cuda/launch_plan.cuh; OPSMITH_SOFTMAX_BLOCK_PACKS: csrc/cuda/softmax.cu;
OPSMITH_NORM_FWD_PACKS, OPSMITH_NORM_LATENCY_PACKS,
OPSMITH_NORM_RING_MIN_PACKS, OPSMITH_NORM_WARP_ROW_PACKS, OPSMITH_NORM_FWD_EARLY and
OPSMITH_NORM_WARP_ROW_LEAN for the norms:
csrc/cuda/norm_plan.cuh).
Rows are appended to $OUT/ring_plans.jsonl when OUT is set."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import opsmith  # noqa: E402
from triton.testing import do_bench  # noqa: E402

BF16 = torch.bfloat16


def median_ms(fn):
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def copy_gbs():
    a = torch.empty(1 << 29, device="cuda", dtype=torch.float32)
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / median_ms(lambda: b.copy_(a)) / 1e6


def randn(*shape):
    return torch.randn(*shape, device="cuda", dtype=BF16)


def cases(which):
    """(name, fn, minimal bytes) of each op in `which` at its shapes."""
    if "ce" in which:
        for n, v in ((8192, 128256), (4096, 262144)):
            x, t = randn(n, v), torch.randint(0, v, (n,), device="cuda")
            xg = x.clone().requires_grad_(True)

            def fwd(x=x, t=t):
                with torch.no_grad():
                    return opsmith.cross_entropy(x, t)
            yield f"ce fwd {n}x{v}", fwd, n * v * 2
            yield f"ce fwd+bwd {n}x{v}", (lambda xg=xg, t=t: torch.autograd.grad(opsmith.cross_entropy(xg, t), xg)), \
                2 * n * v * 2
    if "softmax" in which:
        for r, c in ((16384, 16384), (4096, 65536), (1024, 262144), (65536, 4096), (32768, 8192), (8192, 32768)):
            x = randn(r, c)
            yield f"softmax fwd {r}x{c}", (lambda x=x: opsmith.softmax(x)), 2 * r * c * 2
            if c <= 32768:  # the block-row plan's widths (OPSMITH_SOFTMAX_BLOCK_PACKS)
                xg, g = x.clone().requires_grad_(True), randn(r, c)
                yield f"softmax fwd+bwd {r}x{c}", \
                    (lambda xg=xg, g=g: torch.autograd.grad(opsmith.softmax(xg), xg, g)), 5 * r * c * 2
    if "narrow" in which:
        # softmax rows of at most 256 packs: a warp a row (OPSMITH_RING_WARP_PACKS=0: the ring)
        for r, c in ((4096, 1024), (16384, 1024), (4096, 2048), (32768, 512)):
            x = randn(r, c)
            xg = x.clone().requires_grad_(True)
            g = randn(r, c)
            yield f"softmax fwd {r}x{c}", (lambda x=x: opsmith.softmax(x)), 2 * r * c * 2
            yield f"softmax fwd+bwd {r}x{c}", \
                (lambda xg=xg, g=g: torch.autograd.grad(opsmith.softmax(xg), xg, g)), 5 * r * c * 2
    if "ln" in which:
        for r, c in ((8192, 16384), (16384, 8192), (4096, 32768), (16384, 4096), (65536, 1024), (131072, 512)):
            x, w = randn(r, c), randn(c)
            yield f"layer_norm fwd {r}x{c}", (lambda x=x, w=w: opsmith.layer_norm(x, w, w)), 2 * r * c * 2
    if "rms" in which:
        for r, c in ((2048, 32768), (8192, 8192), (1024, 65536), (8192, 16384), (16384, 4096), (65536, 1024)):
            x, w = randn(r, c), randn(c)
            yield f"rms_norm fwd {r}x{c}", (lambda x=x, w=w: opsmith.rms_norm(x, w)), 2 * r * c * 2
    if "glu" in which:
        # forward: gate and up read, y written; backward: dy, gate and up read, dgate and dup written
        for r, n in ((16384, 14336), (4096, 11008), (8192, 28672), (16384, 4096), (4096, 14336)):
            gate, up, dy = randn(r, n), randn(r, n), randn(r, n)
            yield f"swiglu fwd {r}x{n}", (lambda g=gate, u=up: opsmith.swiglu(g, u)), 3 * r * n * 2
            gg, ug = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
            yield f"swiglu fwd+bwd {r}x{n}", \
                (lambda g=gg, u=ug, d=dy: torch.autograd.grad(opsmith.swiglu(g, u), (g, u), d)), 8 * r * n * 2
    if "add" in which:
        for r, c in ((8192, 8192), (4096, 16384), (2048, 32768), (16384, 4096), (32768, 4096), (65536, 2048)):
            x, res, w = randn(r, c), randn(r, c), randn(c)
            yield f"fused_add fwd {r}x{c}", (lambda x=x, res=res, w=w: opsmith.fused_add_rms_norm(x, res, w)), \
                4 * r * c * 2


def run(label, cases, jsonl):
    """Times each (name, fn, minimal bytes) of `cases`, prints a row each and
    appends the run to $OUT/`jsonl` when OUT is set."""
    copy = copy_gbs()
    rows = []
    for name, fn, nbytes in cases:
        ms = median_ms(fn)
        rows.append((name, ms, nbytes / ms / 1e6 / copy))
        print(f"{label:12s} {name:32s} {ms:8.4f} ms  {rows[-1][2]:5.3f}", flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, jsonl), "a") as fh:
            fh.write(json.dumps({"label": label, "copy_gbs": copy, "gpu": torch.cuda.get_device_name(),
                                 "torch": torch.__version__, "rows": rows}) + "\n")


def main():
    which = sys.argv[2:] or ["ce", "softmax", "narrow", "ln", "rms", "add"]
    run(sys.argv[1], cases(which), "ring_plans.jsonl")


if __name__ == "__main__":
    main()
