"""The kernel profiles of this run, one script (torch.profiler, CUDA kernels only):

    python kernel_profiles.py e2e opsmith|liger  one patched Llama-3.2-1B training step, 4 x 4096 bf16,
                                                 kernel time by kind (e2e_profile_*.txt)
    python kernel_profiles.py decode             decode-size norms fwd+bwd, opsmith against torch.compile,
                                                 rotary and SwiGLU forwards (decode_profile.txt)
    python kernel_profiles.py diag               decode-size norm backward with and without the weight
                                                 gradient, and the backward alone (rotary-layout/diag.txt)

Run from the repository root with the library built."""
import itertools
import os
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.getcwd())
import opsmith  # noqa: E402


def kernel_events(fn, reps, warmup):
    """fn run `reps` times under the profiler after `warmup` runs: its CUDA kernel events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return [e for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]


def report(name, fn, reps=20, warmup=5):
    evs = kernel_events(fn, reps, warmup)
    print(f"== {name}: {sum(e.device_time_total for e in evs) / reps:.2f} us of kernels a step")
    for e in sorted(evs, key=lambda e: -e.device_time_total):
        print(f"   {e.count / reps:4.1f}x {e.device_time_total / e.count:7.2f} us  {e.key[:110]}")


def e2e(which):
    # one step's kernels by kind: bench/step_profile.py (this run's e2e_profile_*.txt
    # were taken before it called the model with use_cache=False, the same kernels)
    sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
    from step_profile import profile_step
    profile_step(which, "eager", top=40)


def decode_cases():
    for rows, h in ((16, 4096), (1, 8192), (64, 4096)):
        x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)

        def rms_eager(x, w):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w
        rc = torch.compile(rms_eager)
        lc = torch.compile(lambda x, w, b, h=h: F.layer_norm(x, (h,), w, b))
        yield f"rms {rows}x{h} opsmith", lambda x=x, w=w, g=g: torch.autograd.grad(opsmith.rms_norm(x, w), (x, w), g)
        yield f"rms {rows}x{h} compile", lambda x=x, w=w, g=g, rc=rc: torch.autograd.grad(rc(x, w), (x, w), g)
        yield f"ln {rows}x{h} opsmith", \
            lambda x=x, w=w, b=b, g=g: torch.autograd.grad(opsmith.layer_norm(x, w, b), (x, w, b), g)
        yield f"ln {rows}x{h} compile", lambda x=x, w=w, b=b, g=g, lc=lc: torch.autograd.grad(lc(x, w, b), (x, w, b), g)
    q = torch.randn(1, 32, 4, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 4, 128, device="cuda", dtype=torch.bfloat16)
    cos = torch.randn(1, 4, 128, device="cuda", dtype=torch.bfloat16)
    sin = torch.randn(1, 4, 128, device="cuda", dtype=torch.bfloat16)
    yield "rotary 4 tokens fwd opsmith", lambda: opsmith.apply_rotary_pos_emb(q, k, cos, sin)
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        yield "rotary 4 tokens fwd liger", lambda: liger_rotary_pos_emb(q, k, cos, sin)
    except Exception as e:  # noqa: BLE001 - a comparison row, reported and skipped
        print("liger rope:", e)
    gate = torch.randn(16, 8192, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(16, 8192, device="cuda", dtype=torch.bfloat16)
    yield "swiglu 16x8192 fwd opsmith", lambda: opsmith.swiglu(gate, up)
    sc = torch.compile(lambda a, b: F.silu(a) * b)
    yield "swiglu 16x8192 fwd compile", lambda: sc(gate, up)


def diag_cases():
    for rows, h in ((16, 4096), (1, 8192)):
        x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
        for wg in (True, False):
            w = torch.randn(h, device="cuda", dtype=torch.bfloat16, requires_grad=wg)
            b = torch.randn(h, device="cuda", dtype=torch.bfloat16, requires_grad=wg)
            yield f"rms {rows}x{h} dweight={wg}", \
                lambda x=x, w=w, g=g, ins=((x, w) if wg else (x,)): torch.autograd.grad(opsmith.rms_norm(x, w), ins, g)
            yield f"ln {rows}x{h} dweight={wg}", lambda x=x, w=w, b=b, g=g, ins=((x, w, b) if wg else (x,)): \
                torch.autograd.grad(opsmith.layer_norm(x, w, b), ins, g)
        w = torch.randn(h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = opsmith.rms_norm(x, w)
        yield f"rms {rows}x{h} backward only, retain_graph", \
            lambda y=y, x=x, w=w, g=g: torch.autograd.grad(y, (x, w), g, retain_graph=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "e2e":
        e2e(sys.argv[2])
    else:
        for name, fn in (decode_cases() if mode == "decode" else diag_cases()):
            report(name, fn, reps=20 if mode == "decode" else 50)
