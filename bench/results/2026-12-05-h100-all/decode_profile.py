"""Decode-size norms, forward+backward: each kernel's GPU time (torch.profiler), opsmith against torch.compile."""
import sys, os, torch
sys.path.insert(0, os.getcwd())
import opsmith
from torch.profiler import profile, ProfilerActivity
import torch.nn.functional as F

def cases():
    for rows, h in ((16, 4096), (1, 8192), (64, 4096)):
        x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
        def rms_eager(x, w):
            xf = x.float(); return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w
        rc = torch.compile(rms_eager)
        lc = torch.compile(lambda x, w, b: F.layer_norm(x, (h,), w, b))
        yield f"rms {rows}x{h} opsmith", lambda: torch.autograd.grad(opsmith.rms_norm(x, w), (x, w), g)
        yield f"rms {rows}x{h} compile", lambda: torch.autograd.grad(rc(x, w), (x, w), g)
        yield f"ln {rows}x{h} opsmith", lambda: torch.autograd.grad(opsmith.layer_norm(x, w, b), (x, w, b), g)
        yield f"ln {rows}x{h} compile", lambda: torch.autograd.grad(lc(x, w, b), (x, w, b), g)

def more():
    q = torch.randn(1, 32, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos = torch.randn(1, 4, 128, device="cuda", dtype=torch.bfloat16)
    sin = torch.randn(1, 4, 128, device="cuda", dtype=torch.bfloat16)
    yield "rotary 4 tokens fwd opsmith", lambda: opsmith.apply_rotary_pos_emb(q.detach(), k.detach(), cos, sin)
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        yield "rotary 4 tokens fwd liger", lambda: liger_rotary_pos_emb(q.detach(), k.detach(), cos, sin)
    except Exception as e:
        print("liger rope:", e)
    gate = torch.randn(16, 8192, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(16, 8192, device="cuda", dtype=torch.bfloat16)
    yield "swiglu 16x8192 fwd opsmith", lambda: opsmith.swiglu(gate, up)
    sc = torch.compile(lambda a, b: torch.nn.functional.silu(a) * b)
    yield "swiglu 16x8192 fwd compile", lambda: sc(gate, up)

import itertools
for name, fn in itertools.chain(cases(), more()):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20): fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    tot = sum(e.device_time_total for e in evs) / 20
    print(f"== {name}: {tot:.2f} us of kernels a step")
    for e in sorted(evs, key=lambda e: -e.device_time_total):
        print(f"   {e.count/20:4.1f}x {e.device_time_total/e.count:7.2f} us  {e.key[:110]}")
