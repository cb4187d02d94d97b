"""One decode-size call, run eagerly a few times: the program a kernel
profiler (ncu) attaches to, one provider a process.

    python bench/decode_kernels.py OP ROWS N PROVIDER [CALLS] [bwd]

OP is a benchmarked op (rms_norm, layer_norm, fused_add_rms_norm, glu,
rotary, ...), PROVIDER one of its spec's bench providers (opsmith, liger,
torch_compile_F, ...); bf16 inputs from the spec's make_inputs; `bwd` runs
forward+backward steps. Run from the repository root with
the library built."""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from opsmith.bench import provider_step  # noqa: E402


def main(argv):
    op, rows, n, provider = argv[0], int(argv[1]), int(argv[2]), argv[3]
    calls = int(argv[4]) if len(argv) > 4 else 10
    backward = len(argv) > 5 and argv[5] == "bwd"
    step = provider_step(op, provider, rows, n, torch.bfloat16, torch.device("cuda"), backward=backward)
    for _ in range(calls):
        step()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
