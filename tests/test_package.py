"""The package's surface: what each op module exports reaches opsmith,
opsmith.nn and opsmith.pybind from the one op list; the C library helpers."""
import os
import re
import subprocess
import sys

import opsmith
import opsmith.nn
import opsmith.ops
import opsmith.pybind
import opsmith.specs


def test_exports_come_from_the_op_list():
    for kind, target in (("FUNCTIONS", opsmith), ("MODULES", opsmith.nn), ("PYBIND", opsmith.pybind)):
        exported = opsmith.ops.exports(kind)
        assert exported, f"no op exports {kind}"
        for name, obj in exported.items():
            assert getattr(target, name) is obj, f"{target.__name__}.{name}"
            assert name in target.__all__
    from opsmith.ops import rms_norm as module
    assert opsmith.rms_norm is module.rms_norm
    assert opsmith.nn.RMSNorm is module.RMSNorm
    assert opsmith.pybind.rms_norm is module.rms_norm_pybind
    assert os.path.isfile(opsmith.library_path())


def test_every_op_module_has_a_spec():
    names = [spec.name for spec in opsmith.specs.load_specs()]
    assert names == list(opsmith.ops.OP_MODULES)


def test_version_and_c_library_helpers():
    with open(os.path.join(opsmith.c_include_dir(), "opsmith.h")) as f:
        text = f.read()
    want = ".".join(re.search(rf"#define OPSMITH_VERSION_{k} (\d+)", text).group(1) for k in ("MAJOR", "MINOR", "PATCH"))
    assert opsmith.__version__ == want
    assert opsmith.c_library().endswith("libopsmith.so")
    flags = subprocess.run([sys.executable, "-m", "opsmith.c_flags"], capture_output=True, text=True,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(opsmith.__file__))), check=True).stdout.split()
    assert f"-I{opsmith.c_include_dir()}" in flags and "-lopsmith" in flags


def test_hf_and_pybind_on_first_use():
    # `import opsmith` imports neither transformers nor route A; opsmith.hf and
    # opsmith.pybind then work as attributes, and a missing name is an AttributeError
    code = ("import sys, opsmith; assert 'transformers' not in sys.modules and 'opsmith.hf' not in sys.modules; "
            "assert callable(opsmith.hf.patch) and 'opsmith.hf' in sys.modules; "
            "assert callable(opsmith.pybind.rms_norm); "
            "import pytest\nwith pytest.raises(AttributeError, match='no attribute'): opsmith.no_such_name")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]


def test_torchscript_refused_by_name_and_trace_works():
    # torch.jit.script cannot compile the modules' Python forwards; the refusal
    # names the module and what works, and tracing does work
    import inspect

    import pytest
    import torch

    classes = [c for _, c in inspect.getmembers(opsmith.nn, inspect.isclass) if issubclass(c, torch.nn.Module)]
    assert len(classes) >= 9 and all(issubclass(c, opsmith.ops.Module) for c in classes), classes
    with pytest.raises(RuntimeError, match=r"^opsmith\.nn\.RMSNorm: torch\.jit\.script is not supported; use "
                                           r"torch\.jit\.trace, torch\.compile or torch\.export"):
        torch.jit.script(opsmith.nn.RMSNorm(8))
    with pytest.raises(RuntimeError, match=r"^opsmith\.nn\.GatedMLP: torch\.jit\.script is not supported"):
        torch.jit.script(torch.nn.Sequential(torch.nn.Linear(8, 8), opsmith.nn.GatedMLP(8, 16)))
    m = opsmith.nn.RMSNorm(8)
    traced = torch.jit.trace(m, torch.randn(2, 8))
    x = torch.randn(5, 8)
    assert torch.equal(traced(x), m(x))
