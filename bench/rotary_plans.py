"""Rotary's flat plan at issue 14's shapes, bf16 (q [B, 32, S, D], k [B, 8, S, D],
cos/sin [B, S, D] as Hugging Face passes them): median ms (triton do_bench, L2
flushed) and the fraction of the copy bandwidth measured in the same run over the
minimal bytes (q, k, cos, sin read once; q, k written once; the backward the same
for dq, dk), beside a copy of q and k's bytes (the ceiling at that size). The label names the run:

    python bench/rotary_plans.py default

Rows are appended to $OUT/rotary_plans.jsonl when OUT is set."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import opsmith  # noqa: E402
from ring_plans import run  # noqa: E402

BF16 = torch.bfloat16


def cases():
    """(name, fn, minimal bytes) at each shape: batch, sequence, head_dim."""
    for b, s, d in ((4, 4096, 128), (4, 4096, 64), (4, 4096, 256), (32, 4096, 128), (1, 32768, 128)):
        q = torch.randn(b, 32, s, d, device="cuda", dtype=BF16)
        k = torch.randn(b, 8, s, d, device="cuda", dtype=BF16)
        cos = torch.randn(b, s, d, device="cuda", dtype=BF16)
        sin = torch.randn(b, s, d, device="cuda", dtype=BF16)
        qk = (q.numel() + k.numel()) * 2
        cs = 2 * cos.numel() * 2
        shape = f"{b}x{s}x{d}"
        # a plain copy of q and k's bytes: the ceiling at this size (a copy's ramp and tail included)
        src = torch.empty(q.numel() + k.numel(), device="cuda", dtype=BF16)
        dst = torch.empty_like(src)
        yield f"copy of q+k {shape}", (lambda src=src, dst=dst: dst.copy_(src)), 2 * qk
        yield f"rotary fwd {shape}", (lambda q=q, k=k, cos=cos, sin=sin: opsmith.apply_rotary(q, k, cos, sin)), \
            2 * qk + cs
        qg, kg = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        gq, gk = torch.randn_like(q), torch.randn_like(k)

        def fwd_bwd(qg=qg, kg=kg, cos=cos, sin=sin, gq=gq, gk=gk):
            oq, ok = opsmith.apply_rotary(qg, kg, cos, sin)
            return torch.autograd.grad((oq, ok), (qg, kg), (gq, gk))
        yield f"rotary fwd+bwd {shape}", fwd_bwd, 4 * qk + 2 * cs


def main():
    run(sys.argv[1], cases(), "rotary_plans.jsonl")


if __name__ == "__main__":
    main()
