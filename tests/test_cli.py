"""The command line as a user meets it: help that names every command, a
version, a doctor that checks the build, and bad arguments that end in one
line and exit status 2, never a traceback."""
import os
import platform
import subprocess
import sys

import pytest
import torch

import opsmith
from conftest import HAS_CUDA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "opsmith", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_help_names_every_command():
    for args in ((), ("--help",), ("-h",)):
        p = cli(*args)
        assert p.returncode == 0, p.stderr
        for command in ("demo", "bench", "doctor"):
            assert f"  {command} " in p.stdout, f"--help does not describe {command}:\n{p.stdout}"


def test_version():
    p = cli("--version")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[:2] == ["opsmith", opsmith.__version__]
    assert f"torch {torch.__version__}" in p.stdout


def test_doctor_checks_the_build():
    p = cli("doctor")
    assert p.returncode == 0, f"doctor found problems on a good build:\n{p.stdout}\n{p.stderr}"
    for what in ("C library", "torch", "GPU", "route B (torch.ops)", "route A (pybind11)", "OpenMP runtimes",
                 "CPU threads"):
        assert what in p.stdout, f"doctor does not report {what!r}:\n{p.stdout}"
    assert "cpu ok" in p.stdout
    if HAS_CUDA:
        assert "cuda ok" in p.stdout


BAD = [
    (("frobnicate",), r"opsmith: unknown command 'frobnicate'"),
    (("demo", "--bogus"), r"opsmith demo: unrecognized arguments: --bogus"),
    (("bench", "--dtypes", "int8"), r"opsmith bench: argument --dtypes"),
    (("demo", "--device", "banana"), r"opsmith demo: --device 'banana' is not a device"),
    (("demo", "--device", "cuda:7"), r"opsmith demo: --device 'cuda:7', but this machine has"),
    (("demo", "--steps", "0"), r"opsmith demo: --steps must be at least 1, got 0"),
    (("demo", "--config", "huge"), r"opsmith demo: argument --config: invalid choice"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_are_one_line_and_exit_2(args, message):
    if args[-1] == "cuda:7" and HAS_CUDA and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    p = cli(*args)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, f"not one line:\n{p.stderr}"
    assert __import__("re").match(message, lines[0]), lines[0]


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a machine without a GPU")
def test_cuda_asked_for_where_there_is_none():
    p = cli("demo", "--device", "cuda")
    assert p.returncode == 2 and "no CUDA device" in p.stderr, p.stderr
    p = cli("bench", "--quick")
    assert p.returncode == 2 and "needs a CUDA device" in p.stderr, p.stderr
    p = cli("bench", "--e2e")
    assert p.returncode == 2 and "needs a CUDA device" in p.stderr, p.stderr


def test_demo_trains_both_models_and_writes_its_outputs(tmp_path):
    """A short run of the main job: both models from one seed, losses printed
    side by side and agreeing, tokens/s, per-op times, the plots and JSON."""
    p = cli("demo", "--device", "cpu", "--steps", "6", "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "losses agree" in p.stdout and "tokens/s" in p.stdout and "rms_norm" in p.stdout, p.stdout
    if platform.libc_ver()[0] == "glibc":  # the timings without fresh mappings' page faults
        assert "freed memory kept" in p.stdout, p.stdout
    import json
    result = json.loads((tmp_path / "demo.json").read_text())
    ours, theirs = result["runs"]["opsmith"]["losses"], result["runs"]["torch"]["losses"]
    # the same start: one function, rounding apart (opsmith's kernels sum in their own order)
    assert len(ours) == len(theirs) >= 2 and ours[0][0] == theirs[0][0]
    assert abs(ours[0][1] - theirs[0][1]) <= 1e-4 * abs(theirs[0][1])
    assert result["max_loss_diff"] <= result["tolerance"]
    assert (tmp_path / "loss_curves.png").stat().st_size > 1000


def test_demo_kernels_check_still_runs():
    p = cli("demo", "--device", "cpu", "--kernels")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "routes A and B identical" in p.stdout
