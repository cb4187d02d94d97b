"""`opsmith doctor`: what this machine has and what opsmith was built with,
checked, with the command that fixes each problem found. Exit status 0 when
nothing is wrong, 1 when something is."""
import os
import re
import shutil
import subprocess
import sys

import torch

from ._cli import Parser
import torch.nn.functional as F

import opsmith
from . import _library


def _sass_arches(path: str):
    """The GPU architectures whose machine code (sm_XY) and PTX (compute_XY)
    the library carries, from cuobjdump; None when cuobjdump is missing."""
    tool = shutil.which("cuobjdump") or ("/usr/local/cuda/bin/cuobjdump"
                                         if os.path.exists("/usr/local/cuda/bin/cuobjdump") else None)
    if not tool:
        return None
    sass, ptx = set(), set()
    for flag, out in (("--list-elf", sass), ("--list-ptx", ptx)):
        try:
            text = subprocess.run([tool, flag, path], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        out.update(int(m) for m in re.findall(r"sm_(\d+)", text))
    return sorted(sass), sorted(ptx)


def _openmp_runtimes():
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if len(line.split()) >= 6}
    except OSError:
        return []
    return sorted(p for p in paths if re.search(r"lib(g|i)?omp[^/]*\.so", os.path.basename(p)))


def main(argv=None) -> int:
    parser = Parser(prog="opsmith doctor", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    problems = []

    def row(name, value):
        print(f"{name:<22} {value}")

    lib = _library._c_abi_handle()
    c_version = lib.opsmith_version().decode()
    row("opsmith", f"{opsmith.__version__} (package {os.path.dirname(opsmith.__file__)})")
    row("C library", f"{c_version}, ABI {lib.opsmith_abi_version()}, CUDA compiled in: "
        f"{'yes' if lib.opsmith_has_cuda() else 'no'}")
    if c_version != opsmith.__version__:
        problems.append(("the compiled library is not the package's version",
                         f"rebuild: `{_library.install_kind()[1]}`"))
    row("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    row("python", sys.version.split()[0])

    has_gpu = torch.cuda.is_available()
    cap = None
    if has_gpu:
        cap = torch.cuda.get_device_capability(0)
        row("GPU", f"{torch.cuda.get_device_name(0)}, sm_{cap[0]}{cap[1]}, {torch.cuda.device_count()} device(s)")
    else:
        row("GPU", "none visible to torch")
    arches = _sass_arches(_library.library_path()) if lib.opsmith_has_cuda() else ([], [])
    if arches is None:
        row("kernels built for", "unknown (cuobjdump not found)")
    else:
        sass, ptx = arches
        row("kernels built for", (", ".join(f"sm_{a}" for a in sass) or "no machine code")
            + (f" + PTX {', '.join(f'compute_{a}' for a in ptx)}" if ptx else ""))
        if cap is not None:
            want = cap[0] * 10 + cap[1]
            covered = want in sass or any(p <= want for p in ptx)
            row("this GPU covered", "yes" if covered else "NO")
            if not covered:
                problems.append((f"the library has no code for sm_{want}",
                                 "rebuild with that arch in CUDA_ARCH (Makefile) or a PTX it can compile"))
    if has_gpu and not lib.opsmith_has_cuda():
        problems.append(("a GPU is present but the library was built without CUDA",
                         "install the CUDA toolkit (nvcc) and rebuild (`make build` or pip install again)"))

    # the routes, each run once against PyTorch
    x = torch.randn(4, 64, dtype=torch.float64)
    w = torch.randn(64, dtype=torch.float64)
    ref = F.rms_norm(x, (64,), w, 1e-6)
    routes = {"route B (torch.ops)": lambda a, b: opsmith.rms_norm(a, b, 1e-6)}
    try:
        import opsmith.pybind as route_a
        routes["route A (pybind11)"] = lambda a, b: route_a.rms_norm(a, b, 1e-6)
    except ImportError as e:
        row("route A (pybind11)", f"does not load: {e}")
        problems.append(("route A does not load", f"rebuild: `{_library.install_kind()[1]}`"))
    devices = ["cpu"] + (["cuda"] if has_gpu and lib.opsmith_has_cuda() else [])
    for name, fn in routes.items():
        results = []
        for dev in devices:
            try:
                err = (fn(x.to(dev), w.to(dev)).cpu() - ref).abs().max().item()
                results.append(f"{dev} ok (max err {err:.1e})" if err < 1e-10 else f"{dev} WRONG (max err {err:.1e})")
                if not err < 1e-10:
                    problems.append((f"{name} gives wrong results on {dev}", "run `make test` and report it"))
            except RuntimeError as e:
                results.append(f"{dev} FAILED: {str(e).splitlines()[0]}")
                problems.append((f"{name} fails on {dev}", "run `make test` to see which part"))
        row(name, "; ".join(results))

    runtimes = _openmp_runtimes()
    row("OpenMP runtimes", ", ".join(runtimes) or "none mapped")
    row("CPU threads", f"torch {torch.get_num_threads()}, opsmith {lib.opsmith_get_num_threads()} "
        "(the bridge passes torch's count on each call)")

    if problems:
        print(f"\n{len(problems)} problem(s):")
        for what, fix in problems:
            print(f"- {what}: {fix}")
        return 1
    print("\nnothing wrong found")
    return 0
