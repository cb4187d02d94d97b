"""opsmith modules inside torch.distributed: a small model trained under DDP
and FSDP2 (fully_shard) with two processes tracks a one-process run of the
same global batch. CPU runs use gloo and run everywhere; the CUDA runs use
NCCL and need two GPUs."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "distributed_train.py")

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _launch(cmd, env=None, timeout=300) -> subprocess.CompletedProcess:
    """Runs cmd in a session (and process group) of its own; on a timeout, an
    error or an interrupt, and once it has exited, kills that whole group, so
    no launcher, rank or grandchild outlives the test. A timeout raises
    subprocess.TimeoutExpired with the output so far."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    except BaseException:
        _kill_group(proc.pid)
        proc.communicate()
        raise
    finally:
        # whatever the launcher left behind (a rank it did not reap)
        _kill_group(proc.pid)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _gone(pid: int) -> bool:
    """pid has exited (a zombie waiting for its reaper counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_launch_timeout_kills_the_whole_process_group():
    # a launcher whose child outlives it by far, as a hung rank would
    child = "import time; time.sleep(120)"
    launcher = ("import subprocess, sys, time; "
                f"p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
                "print(p.pid, flush=True); time.sleep(120)")
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as info:
        _launch([sys.executable, "-c", launcher], timeout=5)
    assert time.monotonic() - t0 < 60
    grandchild = int(info.value.output.split()[0])
    deadline = time.monotonic() + 10
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(grandchild), f"pid {grandchild} outlived the timed-out launch"


def _run(mode: str, device: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    args = ["--mode", mode, "--device", device, "--steps", "6"]
    if mode == "single":
        cmd = [sys.executable, SCRIPT] + args
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               "--master_addr=127.0.0.1", f"--master_port={_free_port()}", SCRIPT] + args
    proc = _launch(cmd, env=env, timeout=300)
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


def test_norms_on_dtensors():
    """Tensor parallelism: each norm on DTensors over two gloo processes
    matches the op on full tensors; sharded on rows it runs locally (the
    output keeps the input's placement), sharded on the hidden dim DTensor
    redistributes first."""
    script = os.path.join(ROOT, "tests", "dtensor_norm_check.py")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", script]
    proc = _launch(cmd, env=env, timeout=300)
    assert proc.returncode == 0, f"dtensor check failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    assert len(lines) == 1, proc.stdout
    results = json.loads(lines[0])
    assert {"rms_norm/rows", "rms_norm/hidden", "rms_norm_gemma/seq", "layer_norm/rows", "layer_norm/hidden",
            "fused_add_rms_norm/rows", "fused_add_rms_norm/seq", "fused_add_rms_norm/hidden",
            "rms_norm/rows/frozen", "layer_norm/hidden/frozen", "fused_add_rms_norm/seq/frozen"} <= set(results)
    for case, r in results.items():
        assert r["max_err"] <= 1e-10, f"{case}: max error {r['max_err']}"
        if case.endswith(("/rows", "/seq", "/rows/frozen", "/seq/frozen")):
            # row-sharded: computed where the rows are, no gather
            assert r["y_placement"].startswith(("S(", "Shard")), f"{case}: output {r['y_placement']}"
