"""Runs every registered op forward and backward on CUDA over shapes that
take each kernel path (register-resident packed rows, wide packed rows,
element-wise rows, strided rows, no weight), for compute-sanitizer to
watch. Exits non-zero if a result is off, so a silent corruption fails too."""
import os
import sys

import torch

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]  # the in-place build of opsmith, the test registry
from op_registry import OPS  # noqa: E402

# (rows, width): element path (odd widths), warp rows, resident packed, wide
# packed; few rows take the CUDA latency plans (a row a block), more rows
# than SMs the throughput plans (several rows a block, 4 and 8 packs a thread)
SHAPES = [(3, 1), (5, 3), (7, 769), (33, 64), (4, 1024), (9, 4096), (2, 5125), (2, 65536),
          (300, 4096), (140, 32768), (600, 4096), (140, 65536)]


def main() -> int:
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    bad = 0
    for spec in OPS:
        for dtype in spec.dtypes:
            for rows, n in SHAPES:
                inputs = spec.make_inputs((rows, n), dtype, device, gen)
                for name in spec.grad_inputs:
                    inputs[name].requires_grad_(True)
                for strided in (False, True):
                    args = dict(inputs)
                    if strided:  # every other row of a taller tensor: a row stride of 2n
                        first = spec.grad_inputs[0]
                        tall = torch.cat([args[first].detach()] * 2, 0).requires_grad_(True)
                        args[first] = tall[::2]
                    out = spec.call(args)
                    grads = torch.autograd.grad(out, [args[k] for k in spec.grad_inputs],
                                                torch.randn_like(out))
                    ref = spec.reference(args)
                    err = ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1)).item()
                    finite = all(torch.isfinite(g).all().item() for g in grads)
                    if not (err <= spec.tolerance(dtype)) or not finite:
                        bad += 1
                        print(f"MISMATCH {spec.name} {dtype} {rows}x{n} strided={strided}: err {err:.2e}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"sanitize_ops: {'all results correct' if bad == 0 else f'{bad} wrong results'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
