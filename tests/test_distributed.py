"""opsmith modules inside torch.distributed: a small model trained under DDP
and FSDP2 (fully_shard) with two processes tracks a one-process run of the
same global batch. CPU runs use gloo and run everywhere; the CUDA runs use
NCCL and need two GPUs."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "distributed_train.py")

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(mode: str, device: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    args = ["--mode", mode, "--device", device, "--steps", "6"]
    if mode == "single":
        cmd = [sys.executable, SCRIPT] + args
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               "--master_addr=127.0.0.1", f"--master_port={_free_port()}", SCRIPT] + args
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{mode} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=two_gpus)])
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_distributed_matches_single_process(mode, device):
    single = _run("single", device)
    multi = _run(mode, device)
    assert multi["world"] == 2
    assert len(multi["losses"]) == len(single["losses"]) == 6
    # the loss must actually move, or equality would prove nothing
    assert abs(single["losses"][-1] - single["losses"][0]) > 1e-3
    for step, (a, b) in enumerate(zip(single["losses"], multi["losses"])):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), f"step {step}: single {a} vs {mode} {b}"
