"""`python -m opsmith bench --routes`: the two ways opsmith reaches PyTorch,
measured side by side on one op (rms_norm) and one device.

  route A  pybind11 module opsmith._pybind + torch.autograd.Function
           (opsmith.pybind.rms_norm)
  route B  torch.library ops torch.ops.opsmith.* with fake kernels and C++
           autograd (opsmith.rms_norm)

For each route: whether torch.compile(fullgraph=True) traces it (forward,
and forward+backward; the error class when it does not), what
torch.library.opcheck says, the host time per call on a small tensor (median
over batches of back-to-back calls, with and without requires_grad; on CUDA
the device is synchronised outside the timed loop only), the time to build
the extension and the size of its shared library.

Build time is measured one of three ways (--build-time), and the results say
which:
  compile  each route's bridge files compiled afresh into a temporary
           directory by setuptools + torch.utils.cpp_extension, with the
           extension arguments setup.py gives (one compile job at a time),
           linked too; wall time, plus each object's time from ninja's log.
  log      the object compile times setup.py's last build recorded in
           ninja's log (build/temp.*/opsmith__C, opsmith__pybind): compile
           only, run with MAX_JOBS parallel jobs, no link.
  none     not measured.
"""
import datetime
import glob
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

import opsmith
import opsmith.pybind
from . import _pybind

ROUTES = ("A", "B")
ROUTE_TITLES = {"A": "route A: pybind11 + autograd.Function", "B": "route B: torch.library"}
# the extension each route builds (setup.py's names) and the route file that
# joins the shared bridge files
EXTENSIONS = {"A": ("_pybind", "pybind.cpp"), "B": ("_C", "library.cpp")}
ROUTE_FILES = {"library.cpp", "pybind.cpp"}
EPS = 1e-6
HOST_SHAPE = (4, 256)  # small: the call's host cost dominates its work


def _entries() -> Dict[str, Dict[str, Callable]]:
    """Each route's public call and its raw binding (below the autograd layer
    it adds: the autograd.Function for A, the op overload for B)."""
    return {
        "A": {"call": opsmith.pybind.rms_norm, "raw": _pybind.rms_norm_fwd,
              "call_name": "opsmith.pybind.rms_norm", "raw_name": "opsmith._pybind.rms_norm_fwd"},
        "B": {"call": opsmith.rms_norm, "raw": torch.ops.opsmith.rms_norm_fwd.default,
              "call_name": "opsmith.rms_norm", "raw_name": "torch.ops.opsmith.rms_norm_fwd.default"},
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _error(e: BaseException) -> Dict[str, str]:
    lines = str(e).strip().splitlines()
    return {"error": f"{type(e).__module__}.{type(e).__name__}", "message": (lines[0] if lines else "")[:300]}


# --- torch.compile(fullgraph=True) ------------------------------------------------

def compile_check(call: Callable, device: torch.device, backend: str) -> Dict[str, Dict]:
    """Compiles `call` with fullgraph=True, runs it and compares with eager:
    forward, then forward+backward (inputs requiring grad; the backward graph
    AOTAutograd traces runs through y.backward)."""
    out = {}
    n = 64
    x = torch.randn(8, n, device=device, dtype=torch.float32)
    w = torch.randn(n, device=device, dtype=torch.float32)
    dy = torch.randn(8, n, device=device, dtype=torch.float32)
    for case in ("forward", "forward+backward"):
        torch._dynamo.reset()
        fn = torch.compile(lambda a, b: call(a, b, EPS), fullgraph=True, backend=backend)
        grad = case == "forward+backward"
        xe, we = x.clone().requires_grad_(grad), w.clone().requires_grad_(grad)
        xc, wc = x.clone().requires_grad_(grad), w.clone().requires_grad_(grad)
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():  # dynamo's advice on a graph break: the error class is recorded
                warnings.simplefilter("ignore")
                y = fn(xc, wc)
                if grad:
                    y.backward(dy)
            _sync(device)
        except Exception as e:  # the result being measured: which error, not a failure of the benchmark
            out[case] = {"traced": False, **_error(e)}
            continue
        seconds = time.perf_counter() - t0
        ye = call(xe, we, EPS)
        pairs = [(y, ye)]
        if grad:
            ye.backward(dy)
            pairs += [(xc.grad, xe.grad), (wc.grad, we.grad)]
        same = all(a is not None and b is not None and torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                   for a, b in pairs)
        out[case] = {"traced": True, "matches_eager": same, "first_call_s": round(seconds, 3)}
    torch._dynamo.reset()
    return out


# --- torch.library.opcheck ---------------------------------------------------------

def opcheck_route(route: str, device: torch.device) -> Dict:
    """opcheck on route B's two ops (schema, autograd registration, fake
    kernel, AOT dispatch); on route A's function, which is no dispatcher op,
    what opcheck answers is recorded."""
    x = torch.randn(8, 64, device=device, dtype=torch.float32, requires_grad=True)
    w = torch.randn(64, device=device, dtype=torch.float32, requires_grad=True)
    if route == "A":
        try:
            torch.library.opcheck(opsmith.pybind.rms_norm, (x, w, EPS))
        except Exception as e:
            return {"applicable": False, "passed": False, **_error(e)}
        return {"applicable": True, "passed": True}
    results, failed = {}, []
    y, inv_rms = torch.ops.opsmith.rms_norm_fwd(x.detach(), w.detach(), EPS)
    cases = {
        "rms_norm_fwd": (torch.ops.opsmith.rms_norm_fwd.default, (x, w, EPS)),
        "rms_norm_bwd": (torch.ops.opsmith.rms_norm_bwd.default,
                         (torch.randn_like(y), x.detach(), w.detach(), inv_rms)),
    }
    for name, (op, args) in cases.items():
        try:
            results[name] = torch.library.opcheck(op, args)
        except Exception as e:
            results[name] = _error(e)
            failed.append(name)
    passed = not failed and all(v == "SUCCESS" for r in results.values() for v in r.values())
    return {"applicable": True, "passed": passed, "tests": results}


# --- host time per call -------------------------------------------------------------

def host_time_us(fn: Callable, device: torch.device, batches: int, calls: int) -> Dict:
    """Median over `batches` of the wall time of `calls` back-to-back calls,
    per call. On CUDA the device is synchronised after each timed batch, outside
    the timer: the timer sees the host's launch cost, not the kernel."""
    for _ in range(max(20, calls)):
        fn()
    _sync(device)
    per_call = []
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter_ns()
        _sync(device)
        per_call.append((t1 - t0) / calls / 1e3)
    per_call.sort()
    return {"median_us": round(statistics.median(per_call), 3), "min_us": round(per_call[0], 3),
            "p90_us": round(per_call[int(0.9 * (len(per_call) - 1))], 3), "batches": batches,
            "calls_per_batch": calls}


def host_cases(device: torch.device) -> Dict[str, Dict[str, Callable]]:
    x = torch.randn(*HOST_SHAPE, device=device, dtype=torch.float32)
    w = torch.randn(HOST_SHAPE[-1], device=device, dtype=torch.float32)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    cases = {}
    for route, e in _entries().items():
        call, raw = e["call"], e["raw"]
        cases[route] = {
            "call": lambda call=call: call(x, w, EPS),
            "call (requires_grad)": lambda call=call: call(xg, wg, EPS),
            "raw binding": lambda raw=raw: raw(x, w, EPS),
        }
    # eager PyTorch's own op, for scale
    cases["torch"] = {
        "call": lambda: F.rms_norm(x, HOST_SHAPE[-1:], w, EPS),
        "call (requires_grad)": lambda: F.rms_norm(xg, HOST_SHAPE[-1:], wg, EPS),
    }
    return cases


# --- build time and binary size -------------------------------------------------------

_BUILD_ONE = r"""
import json, sys, time
spec = json.loads(sys.argv[1])
t_import = time.perf_counter()
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
Ext = CUDAExtension if spec["cuda"] else CppExtension
ext = Ext(spec["name"], spec["sources"], include_dirs=spec["include_dirs"], extra_objects=spec["extra_objects"],
          extra_compile_args={"cxx": spec["flags"]}, extra_link_args=["-fopenmp"])
t0 = time.perf_counter()
setup(name="opsmith_route_build", ext_modules=[ext], cmdclass={"build_ext": BuildExtension},
      script_args=["-q", "build_ext", "--build-temp", spec["temp"], "--build-lib", spec["lib"]])
print("BUILD_SECONDS", time.perf_counter() - t0)
"""


def _source_tree() -> Optional[str]:
    tree = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ok = all(os.path.exists(os.path.join(tree, p)) for p in ("setup.py", "csrc/torch", "build/libopsmith.a"))
    return tree if ok else None


def _route_sources(tree: str, route: str) -> List[str]:
    # as setup.py: every bridge file, plus the route's own file
    bridge = sorted(p for p in glob.glob(os.path.join(tree, "csrc", "torch", "*.cpp"))
                    if os.path.basename(p) not in ROUTE_FILES)
    return bridge + [os.path.join(tree, "csrc", "torch", EXTENSIONS[route][1])]


def _ninja_objects(path: str) -> Dict[str, float]:
    """Seconds each object took, from a ninja log (v5: start_ms end_ms mtime
    output hash; a rebuilt output's latest line wins)."""
    objects = {}
    with open(path) as f:
        for line in f:
            parts = line.split("\t")
            if line.startswith("#") or len(parts) < 4:
                continue
            objects[os.path.basename(parts[3])] = (int(parts[1]) - int(parts[0])) / 1e3
    return objects


def _with_cuda() -> bool:
    """Whether the installed route B library was built with CUDA: it registered a CUDA kernel."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("opsmith::rms_norm_fwd", "CUDA")


def build_time_compile(tree: str, route: str) -> Dict:
    name, _ = EXTENSIONS[route]
    cuda = _with_cuda()
    tmp = tempfile.mkdtemp(prefix=f"opsmith-route-{route}-")
    try:
        spec = {
            "name": name, "sources": _route_sources(tree, route), "cuda": cuda,
            "include_dirs": [os.path.join(tree, "include"), os.path.join(tree, "csrc")],
            "extra_objects": [os.path.join(tree, "build", "libopsmith.a")],
            "flags": ["-O2", f"-DOPSMITH_WITH_CUDA={int(cuda)}", f"-DOPSMITH_ROUTE_A={int(route == 'A')}"],
            "temp": os.path.join(tmp, "temp"), "lib": os.path.join(tmp, "lib"),
        }
        # one compile job at a time: each object's time is its own, not shared with its sibling's
        env = dict(os.environ, MAX_JOBS="1")
        load = os.getloadavg()[0]
        # CPU time of the build's processes (the compilers included: each is waited for): on a
        # shared machine the wall time grows with the load, the CPU time much less
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        # run from the empty temporary directory: setuptools reads the configuration files of its cwd
        p = subprocess.run([sys.executable, "-c", _BUILD_ONE, json.dumps(spec)], cwd=tmp, env=env,
                           capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        if p.returncode != 0:
            return {"method": "compile", "error": (p.stderr or p.stdout).strip().splitlines()[-1:]}
        seconds = float(p.stdout.split("BUILD_SECONDS")[-1].split()[0])
        logs = glob.glob(os.path.join(tmp, "temp", "**", ".ninja_log"), recursive=True)
        objects = _ninja_objects(logs[0]) if logs else {}
        so = glob.glob(os.path.join(tmp, "lib", "**", f"{name}*.so"), recursive=True)
        return {"method": "compile", "seconds": round(seconds, 2), "process_s": round(wall, 2),
                "cpu_s": round(cpu, 2),
                "objects_s": {k: round(v, 2) for k, v in sorted(objects.items())},
                "link_and_setup_s": round(seconds - sum(objects.values()), 2), "jobs": 1,
                "load_average_at_start": round(load, 2), "cuda": cuda,
                "built_size_bytes": os.path.getsize(so[0]) if so else None}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_time_log(tree: str, route: str) -> Dict:
    name, _ = EXTENSIONS[route]
    logs = sorted(glob.glob(os.path.join(tree, "build", "temp.*", f"opsmith_{name}", ".ninja_log")))
    if not logs:
        return {"method": "log", "error": "no ninja log of setup.py's build under build/temp.*"}
    objects = _ninja_objects(logs[-1])
    return {"method": "log", "seconds": round(sum(objects.values()), 2),
            "objects_s": {k: round(v, 2) for k, v in sorted(objects.items())},
            "jobs": "MAX_JOBS of that build (the Makefile: nproc)", "log": os.path.relpath(logs[-1], tree),
            "note": "compile only (setuptools links outside ninja)"}


def build_time(route: str, how: str) -> Dict:
    if how == "none":
        return {"method": "none"}
    tree = _source_tree()
    if tree is None:
        return {"method": how, "error": "needs the source tree (setup.py, csrc/, build/libopsmith.a)"}
    return build_time_compile(tree, route) if how == "compile" else build_time_log(tree, route)


def binary_size(route: str) -> Dict:
    """Size of the extension's .so as loaded, and without its debug sections
    (cpp_extension compiles with Python's -g), which is what a stripped
    wheel would carry."""
    name, _ = EXTENSIONS[route]
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, f"{name}*.so")))
    if not found:
        return {"error": f"opsmith/{name}*.so not found"}
    out = {"path": os.path.relpath(found[0], os.path.dirname(here)), "bytes": os.path.getsize(found[0])}
    strip = shutil.which("strip")
    if strip:
        with tempfile.TemporaryDirectory() as tmp:
            copy = os.path.join(tmp, "lib.so")
            if subprocess.run([strip, "--strip-debug", found[0], "-o", copy], capture_output=True).returncode == 0:
                out["bytes_without_debug"] = os.path.getsize(copy)
    return out


# --- the whole measurement -------------------------------------------------------------

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(device: torch.device, quick: bool, build: str, backend: Optional[str] = None) -> Dict:
    backend = backend or ("aot_eager" if quick else "inductor")
    batches, calls = (30, 20) if quick else (400, 50)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "machine": platform.node(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "device": str(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "opsmith": opsmith.__version__,
        "quick": quick,
        "compile_backend": backend,
        "host_shape": list(HOST_SHAPE),
        "host_dtype": "float32",
        "build_time_method": build,
        "torch_threads": torch.get_num_threads(),
    }
    entries = _entries()
    cases = host_cases(device)
    routes = {}
    for route in ROUTES:
        print(f"{ROUTE_TITLES[route]}: compile, opcheck, host time, build", file=sys.stderr)
        r = {"call": entries[route]["call_name"], "raw": entries[route]["raw_name"]}
        r["compile"] = compile_check(entries[route]["call"], device, backend)
        r["opcheck"] = opcheck_route(route, device)
        r["host_us"] = {name: host_time_us(fn, device, batches, calls) for name, fn in cases[route].items()}
        r["build"] = build_time(route, build)
        r["binary"] = binary_size(route)
        routes[route] = r
    reference = {"call": "torch.nn.functional.rms_norm",
                 "host_us": {name: host_time_us(fn, device, batches, calls) for name, fn in cases["torch"].items()}}
    return {"meta": meta, "routes": routes, "reference": reference}


# --- the table --------------------------------------------------------------------------

def _compile_cell(c: Dict) -> str:
    if c.get("traced"):
        return "traced" + ("" if c.get("matches_eager") else ", DIFFERS from eager")
    return f"not traced: `{c['error'].rsplit('.', 1)[-1]}`"


def _opcheck_cell(o: Dict) -> str:
    if not o.get("applicable"):
        return f"not applicable (not a dispatcher op): `{o['error'].rsplit('.', 1)[-1]}`"
    if o.get("passed"):
        tests = sorted({t for r in o.get("tests", {}).values() for t in r})
        return "passed" + (f" ({', '.join(t.replace('test_', '') for t in tests)})" if tests else "")
    return "FAILED: " + ", ".join(f"{k}: {v}" for k, v in o.get("tests", {}).items())


def _mb(n: Optional[int]) -> str:
    return f"{n / 2**20:.2f} MiB" if n else "n/a"


def _build_cell(b: Dict) -> str:
    if b.get("method") == "none":
        return "not measured"
    if "error" in b:
        return f"n/a ({b['error']})"
    objects = ", ".join(f"{k.replace('.o', '.cpp')} {v:.1f}" for k, v in b["objects_s"].items())
    if b["method"] == "compile":
        return (f"{b['seconds']:.1f} s ({objects}; link+setup {b['link_and_setup_s']:.1f}); "
                f"{b['cpu_s']:.1f} s of CPU time")
    return f"{b['seconds']:.1f} s of compiling ({objects})"


def _binary_cell(b: Dict) -> str:
    if "error" in b:
        return "n/a"
    cell = _mb(b["bytes"])
    if b.get("bytes_without_debug"):
        cell += f" ({_mb(b['bytes_without_debug'])} without debug info)"
    return cell


BUILD_METHODS = {
    "compile": "each route's bridge files compiled afresh into a temporary directory by setuptools + "
               "torch.utils.cpp_extension with setup.py's extension arguments, one job at a time, and linked; "
               "wall seconds per object in parentheses, then the CPU time of the whole build (compilers "
               "included), which depends less on what else the machine runs",
    "log": "the object compile times setup.py's last build recorded in ninja's log (compile only, "
           "parallel jobs, no link)",
    "none": "not measured",
}


def table(results: Dict) -> str:
    m, routes, ref = results["meta"], results["routes"], results["reference"]
    where = m["gpu"] or m["cpu"]
    lines = [
        f"rms_norm through both routes on {m['device']} ({where}; {m['machine']}, {m['cpu_count']} CPUs), "
        f"torch {m['torch']}" + (f", CUDA {m['cuda']}" if m["device"].startswith("cuda") else "")
        + f", opsmith {m['opsmith']}, "
        f"{m['date']}{', quick mode' if m['quick'] else ''}.",
        "",
        f"| | {ROUTE_TITLES['A']} | {ROUTE_TITLES['B']} |",
        "|---|---|---|",
        f"| call | `{routes['A']['call']}` | `{routes['B']['call']}` |",
    ]
    for case in ("forward", "forward+backward"):
        lines.append(f"| torch.compile(fullgraph=True), {case} ({m['compile_backend']}) | "
                     f"{_compile_cell(routes['A']['compile'][case])} | {_compile_cell(routes['B']['compile'][case])} |")
    lines.append(f"| torch.library.opcheck | {_opcheck_cell(routes['A']['opcheck'])} | "
                 f"{_opcheck_cell(routes['B']['opcheck'])} |")
    shape = "x".join(map(str, m["host_shape"]))
    labels = {"call": "host time per call, us", "call (requires_grad)": "host time per call, requires_grad, us",
              "raw binding": "host time per call of the raw binding, us"}
    for case, label in labels.items():
        cells = [f"{routes[r]['host_us'][case]['median_us']:.2f}" for r in ROUTES]
        if case == "raw binding":
            cells = [f"{c} (`{routes[r]['raw']}`)" for c, r in zip(cells, ROUTES)]
        lines.append(f"| {label} ({shape} {m['host_dtype']}) | {cells[0]} | {cells[1]} |")
    lines.append(f"| build time | {_build_cell(routes['A']['build'])} | {_build_cell(routes['B']['build'])} |")
    lines.append(f"| shared library | {_binary_cell(routes['A']['binary'])} | {_binary_cell(routes['B']['binary'])} |")
    h = ref["host_us"]
    lines += [
        "",
        f"Host time: median over {routes['A']['host_us']['call']['batches']} batches of "
        f"{routes['A']['host_us']['call']['calls_per_batch']} back-to-back calls"
        + (", the device synchronised after each batch outside the timer" if m["device"].startswith("cuda")
           else " (on the CPU a call's time includes its kernel's work on the 1024 elements)")
        + f"; eager `{ref['call']}` takes {h['call']['median_us']:.2f} us "
          f"({h['call (requires_grad)']['median_us']:.2f} with requires_grad). "
          f"Build time: {BUILD_METHODS[m['build_time_method']]}"
        + (f" (load average {routes['A']['build']['load_average_at_start']} / "
           f"{routes['B']['build']['load_average_at_start']} at the start)"
           if m["build_time_method"] == "compile" and "load_average_at_start" in routes["A"]["build"]
           and "load_average_at_start" in routes["B"]["build"] else "")
        + ". Both libraries link the same C library (build/libopsmith.a), so both carry every kernel.",
    ]
    errors = [f"- route {r}, {case}: `{c['error']}`: {c['message']}"
              for r in ROUTES for case, c in routes[r]["compile"].items() if not c.get("traced")]
    errors += [f"- route {r}, opcheck: `{routes[r]['opcheck']['error']}`: {routes[r]['opcheck']['message']}"
               for r in ROUTES if "error" in routes[r]["opcheck"]]
    if errors:
        lines += ["", "Errors recorded:", *errors]
    return "\n".join(lines)


def run(device: str, quick: bool, out_dir: str, build: str, backend: Optional[str] = None) -> int:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("opsmith bench --routes: --device cuda, but no CUDA device is visible", file=sys.stderr)
        return 2
    if dev.type == "cuda" and not _with_cuda():
        print("opsmith bench --routes: --device cuda, but opsmith was built without CUDA", file=sys.stderr)
        return 2
    results = measure(dev, quick, build, backend)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = table(results)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0
