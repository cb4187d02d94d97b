"""Decode-size norm backward: where its time goes. Kernel times (torch.profiler) with and without the weight gradient,
and a plain timing loop (CUDA events) of the backward alone."""
import sys, os, torch
sys.path.insert(0, os.getcwd())
import opsmith
from torch.profiler import profile, ProfilerActivity

NCU = bool(os.environ.get("NCU"))
def prof(name, fn, reps=50):
    if NCU:
        print("== ncu case:", name); fn(); fn(); torch.cuda.synchronize(); return
    for _ in range(5): fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps): fn()
        torch.cuda.synchronize()
    evs = [e for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"== {name}: {sum(e.device_time_total for e in evs)/reps:.2f} us")
    for e in sorted(evs, key=lambda e: -e.device_time_total):
        print(f"   {e.count/reps:4.1f}x {e.device_time_total/e.count:7.2f} us  {e.key[:100]}")

for rows, h in ((16, 4096), (1, 8192)):
    x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
    for wg in (True, False):
        w = torch.randn(h, device="cuda", dtype=torch.bfloat16, requires_grad=wg)
        b = torch.randn(h, device="cuda", dtype=torch.bfloat16, requires_grad=wg)
        ins = (x, w) if wg else (x,)
        prof(f"rms {rows}x{h} dweight={wg}", lambda: torch.autograd.grad(opsmith.rms_norm(x, w), ins, g))
        insl = (x, w, b) if wg else (x,)
        prof(f"ln {rows}x{h} dweight={wg}", lambda: torch.autograd.grad(opsmith.layer_norm(x, w, b), insl, g))
    # the backward alone, back to back (no forward between): does a warm SM change it?
    w = torch.randn(h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = opsmith.rms_norm(x, w)
    prof(f"rms {rows}x{h} backward only, retain_graph", lambda: torch.autograd.grad(y, (x, w), g, retain_graph=True))
