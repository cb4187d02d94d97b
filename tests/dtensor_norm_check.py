"""Run by tests/test_distributed.py under torch.distributed.run with two
processes on gloo: every norm op on DTensors (sharded on rows, sharded on
the hidden dim, replicated) against the same op on the full tensors, forward
and backward. Prints one JSON line on rank 0."""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import opsmith  # noqa: E402

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: E402

# op name -> (call(x, weight) -> y); every norm op with a sharding rule
NORMS = {
    "rms_norm": lambda x, w: opsmith.rms_norm(x, w, 1e-6),
    "rms_norm_gemma": lambda x, w: opsmith.rms_norm(x, w, 1e-6, offset=1.0, casting_mode="gemma"),
}
if hasattr(opsmith, "layer_norm"):
    NORMS["layer_norm"] = lambda x, w: opsmith.layer_norm(x, w, w * 0.5, 1e-5)
if hasattr(opsmith, "fused_add_rms_norm"):
    # the residual is sin(x) (same placement as x, other values);
    # y + 0.5 h feeds both outputs' gradients back
    def _fused_add(x, w):
        y, h = opsmith.fused_add_rms_norm(x, torch.sin(x), w, 1e-6)
        return y + 0.5 * h
    NORMS["fused_add_rms_norm"] = _fused_add


def main():
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    x_full = torch.randn(4, 6, 32, dtype=torch.float64)
    w_full = torch.randn(32, dtype=torch.float64)
    dy_full = torch.randn(4, 6, 32, dtype=torch.float64)
    results = {}
    for name, call in NORMS.items():
        xr = x_full.clone().requires_grad_()
        wr = w_full.clone().requires_grad_()
        y_ref = call(xr, wr)
        y_ref.backward(dy_full)
        for label, placement in (("rows", Shard(0)), ("seq", Shard(1)), ("hidden", Shard(2)),
                                 ("replicated", Replicate())):
            x = distribute_tensor(x_full, mesh, [placement]).requires_grad_()
            w = distribute_tensor(w_full, mesh, [Replicate()]).requires_grad_()
            y = call(x, w)
            y.backward(distribute_tensor(dy_full, mesh, [y.placements[0]]))
            err = max((y.full_tensor() - y_ref).abs().max().item(),
                      (x.grad.full_tensor() - xr.grad).abs().max().item(),
                      (w.grad.full_tensor() - wr.grad).abs().max().item())
            results[f"{name}/{label}"] = {"max_err": err, "y_placement": str(y.placements[0])}
            # a frozen weight: the backward skips its sums (a [0] dweight on
            # the DTensor path too), x's gradient the same, the weight none
            x = distribute_tensor(x_full, mesh, [placement]).requires_grad_()
            w = distribute_tensor(w_full, mesh, [Replicate()])
            y = call(x, w)
            y.backward(distribute_tensor(dy_full, mesh, [y.placements[0]]))
            err = (x.grad.full_tensor() - xr.grad).abs().max().item() if w.grad is None else float("inf")
            results[f"{name}/{label}/frozen"] = {"max_err": err, "y_placement": str(y.placements[0])}
    if dist.get_rank() == 0:
        print(json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # gloo's teardown can abort at interpreter exit (docs/distributed.md)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
