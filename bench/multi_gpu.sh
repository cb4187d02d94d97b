#!/usr/bin/env bash
# On a machine with 2+ GPUs: the distributed tests on CUDA, then throughput
# per GPU of the example model on 1 and 2 GPUs (DDP and FSDP2) for the
# 1 -> 2 GPU scaling. Usage: bench/multi_gpu.sh OUT_DIR (after `make build`)
set -uo pipefail
out=${1:-bench/results/latest}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# NVLink multicast stays off (shared hosts)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pytest -q tests/test_distributed.py tests/test_reliability.py -k "distributed or two_gpu or cuda1" \
    > "$out/multi-gpu-tests.log" 2>&1
args="--device cuda --steps 200 --global-batch 4096 --dtype bfloat16"
{
  python3 examples/distributed_train.py --mode single $args
  torchrun --nproc_per_node=2 examples/distributed_train.py --mode ddp $args
  torchrun --nproc_per_node=2 examples/distributed_train.py --mode fsdp $args
} 2>/dev/null | grep '^{' > "$out/multi-gpu-throughput.jsonl"
tail -3 "$out/multi-gpu-tests.log"; cat "$out/multi-gpu-throughput.jsonl"
