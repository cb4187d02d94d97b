"""A small model built from opsmith modules, trained under torch.distributed.

    torchrun --nproc_per_node=2 examples/distributed_train.py --mode ddp  --device cpu
    torchrun --nproc_per_node=2 examples/distributed_train.py --mode fsdp --device cuda
    python examples/distributed_train.py --mode single   (one process, the whole batch)

Every mode sees the same global batch each step (rank r takes its slice), so
the losses of all modes should track each other. Prints one JSON line with
the per-step mean loss over the global batch (rank 0 only)."""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import opsmith


class Block(torch.nn.Module):
    """Pre-norm MLP block: x + W2 silu(W1 RMSNorm(x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = opsmith.nn.RMSNorm(dim, eps=1e-6)
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


class TinyModel(torch.nn.Module):
    def __init__(self, dim=64, hidden=128, layers=2, classes=10):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.norm = opsmith.nn.RMSNorm(dim, eps=1e-6)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def batches(steps, global_batch, dim, classes, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(global_batch, 8, dim, generator=g)
        y = torch.randint(0, classes, (global_batch, 8), generator=g)
        yield x, y


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["single", "ddp", "fsdp"], default="single")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()

    distributed = args.mode != "single"
    rank, world = 0, 1
    if distributed:
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)  # same initial weights in every process and mode
    model = TinyModel().to(device=device, dtype=dtype)
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    elif args.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard
        mesh = dist.init_device_mesh(device.type, (world,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    losses = []
    per_rank = args.global_batch // world
    t0 = time.perf_counter()
    for x, y in batches(args.steps, args.global_batch, 64, 10):
        x = x[rank * per_rank:(rank + 1) * per_rank].to(device, dtype)
        y = y[rank * per_rank:(rank + 1) * per_rank].to(device)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP/FSDP average gradients over ranks = the global-batch gradient
        opt.step()
        mean = loss.detach().clone()
        if distributed:
            dist.all_reduce(mean)
            mean /= world
        losses.append(round(mean.item(), 6))
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    if rank == 0:
        print(json.dumps({"mode": args.mode, "world": world, "device": device.type,
                          "losses": losses, "seconds": round(elapsed, 3),
                          "samples_per_s_per_rank": round(args.steps * per_rank / elapsed, 1)}))
    if distributed:
        dist.barrier()  # every rank done with its collectives
        dist.destroy_process_group()
        # End the process here, without finalizing the interpreter. Works
        # around a torch bug (2.11; https://github.com/pytorch/pytorch/issues/190489):
        # destroy_process_group stops gloo's worker threads only when nothing
        # else refers to the group, and DDP's reducer, FSDP2's DeviceMesh and
        # DTensor's sharding caches, and torch.distributed.nn.functional (whose
        # functions take group.WORLD as a default argument) all keep it. A worker
        # releases the last work it ran, and the tensors of the collectives
        # before it, a moment after the wait on that work has returned; freeing
        # a tensor that has a Python object takes the GIL, and once the
        # interpreter has begun to finalize that ends the thread (pthread_exit)
        # inside a noexcept destructor: "terminate called without an active
        # exception", SIGABRT. os._exit ends every thread at once instead.
        # See docs/distributed.md.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
