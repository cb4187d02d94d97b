"""Runs every opsmith op (the specs of opsmith.specs) forward and backward on
CUDA over shapes that take each kernel path (register-resident packed rows,
wide packed rows, element-wise rows, strided rows), for compute-sanitizer to
watch. Exits non-zero if a result is off, so a silent corruption fails too."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the in-place build
from opsmith.specs import flat_inputs, flat_outputs, load_specs, map_tensors  # noqa: E402

# (rows, width): element path (odd widths), warp rows, resident packed, wide
# packed; few rows take the CUDA latency plans (a row a block), more rows
# than SMs the throughput plans (several rows a block, 4 and 8 packs a thread)
SHAPES = [(3, 1), (5, 3), (7, 769), (33, 64), (4, 1024), (9, 4096), (2, 5125), (2, 65536),
          (300, 4096), (140, 32768), (600, 4096), (140, 65536)]


def _strided(t):
    # every other row of a taller tensor: a row stride of 2n
    return torch.cat([t.detach()] * 2, 0)[::2]


def check(spec, inputs, dtype):
    """Runs the op forward and backward; the relative error of every output
    against the float64 reference, and whether every gradient is finite."""
    for _, t in flat_inputs(inputs, spec.grad_inputs):
        t.requires_grad_(True)
    outs = flat_outputs(spec, spec.call(inputs))
    diff = [t for n, t in outs if n.split("[")[0] in spec.diff_output_names and t.requires_grad]
    grads = []
    if diff:
        grads = torch.autograd.grad(diff, [t for _, t in flat_inputs(inputs, spec.grad_inputs)],
                                    [torch.randn_like(t) for t in diff])
    ref_in = map_tensors(inputs, lambda k, t: t.detach().double() if t.is_floating_point() else t)
    ref = flat_outputs(spec, spec.reference(ref_in, dtype=dtype))
    err = 0.0
    for (_, o), (_, r) in zip(outs, ref):
        if o.numel():
            err = max(err, ((o.detach().double() - r).abs().max() / r.abs().max().clamp_min(1)).item())
    return err, all(torch.isfinite(g).all().item() for g in grads)


def main() -> int:
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    bad = 0
    for spec in load_specs():
        for dtype in spec.dtypes:
            for rows, n in SHAPES:
                for strided in (False, True) if spec.row_inputs else (False,):
                    inputs = spec.make_inputs((rows, n), dtype, device, gen)
                    if strided:
                        shape = inputs[spec.row_inputs[0]].shape
                        inputs = {k: (_strided(v) if k in spec.row_inputs and v.shape == shape else v)
                                  for k, v in inputs.items()}
                    err, finite = check(spec, inputs, dtype)
                    if not (err <= spec.tolerance(dtype)) or not finite:
                        bad += 1
                        print(f"MISMATCH {spec.name} {dtype} {rows}x{n} strided={strided}: err {err:.2e}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"sanitize_ops: {'all results correct' if bad == 0 else f'{bad} wrong results'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
