"""A compiled part of opsmith that is missing or does not load: the import
fails with an ImportError naming the part and the command that builds it for
the way opsmith was installed. Each case is a copy of the package in a
temporary directory (without some of its .so files), imported in a fresh
interpreter."""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

import opsmith
from opsmith import _library

PACKAGE = os.path.dirname(os.path.abspath(opsmith.__file__))


def _copy(tmp, *, keep=(), source_tree=False, c_library=True):
    """opsmith/ copied under tmp without its compiled parts, except the .so
    files whose patterns are in `keep`; `source_tree` adds what marks a
    checkout (setup.py, Makefile, csrc/torch) and puts the C library in
    build/, else it goes in opsmith/lib like a wheel's."""
    root = tmp / "site"
    shutil.copytree(PACKAGE, root / "opsmith",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", "lib", "include"))
    for pattern in keep:
        for path in glob.glob(os.path.join(PACKAGE, pattern)):
            shutil.copy2(path, root / "opsmith")
    shutil.copytree(opsmith.c_include_dir(), root / "opsmith" / "include")
    lib = root / "build" if source_tree else root / "opsmith" / "lib"
    if c_library:
        lib.mkdir(parents=True, exist_ok=True)
        shutil.copy2(opsmith.c_library(), lib / "libopsmith.so")
    if source_tree:
        for name in ("setup.py", "Makefile"):
            (root / name).write_text("")
        (root / "csrc" / "torch").mkdir(parents=True)
    return root


def _import(root, *modules, extra_path=()):
    """Imports each module in one fresh interpreter; prints the ImportError's
    message (between markers) for each that fails, else `imported FILE`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, extra_path), str(root)]))
    script = ("import importlib, sys\n"
              f"for name in {list(modules or ['opsmith'])!r}:\n"
              "    try:\n"
              "        print('imported', importlib.import_module(name).__file__)\n"
              "    except ImportError as e:\n"
              "        print('<<<' + str(e) + '>>>')\n"
              "        for m in [m for m in sys.modules if m.startswith('opsmith')]:\n"  # the next one starts afresh
              "            del sys.modules[m]\n")
    p = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout


def _messages(out):
    msgs = [part.split(">>>")[0] for part in out.split("<<<")[1:]]
    assert msgs, f"the import succeeded:\n{out}"
    for msg in msgs:
        assert msg.startswith("opsmith cannot load its compiled parts:\n  - "), msg
    return msgs


def test_installed_package_without_its_libraries_says_reinstall(tmp_path):
    root = _copy(tmp_path, c_library=False)
    msgs = _messages(_import(root, "opsmith", "opsmith._library", "opsmith.pybind"))
    assert len(msgs) == 3
    for msg in msgs:
        lines = msg.splitlines()
        assert "  - the route B library (torch.ops.opsmith.*) opsmith/_C*.so is missing" in lines
        assert f"  - the C library libopsmith.so is missing (looked for {root / 'opsmith' / 'lib' / 'libopsmith.so'})" \
            in lines
        assert "  - the route A module opsmith._pybind (opsmith.pybind) opsmith/_pybind*.so is missing" in lines
        assert lines[-2].startswith(f"This opsmith is an installed package ({root / 'opsmith'}): reinstall it")
        assert lines[-1].strip().startswith("pip install --no-build-isolation --force-reinstall ")
        assert "make" not in msg


def test_source_tree_says_make_build(tmp_path):
    root = _copy(tmp_path, source_tree=True)
    msg = _messages(_import(root))[0]
    lines = msg.splitlines()
    assert "  - the route B library (torch.ops.opsmith.*) opsmith/_C*.so is missing" in lines
    assert "libopsmith.so" not in msg  # the C library is there, in build/
    assert lines[-3] == f"This opsmith is a source tree ({root}): build them with `make build` there:"
    assert lines[-2].strip() == f"make -C {root} build"
    assert lines[-1] == f"(`opsmith new-op` runs before that as `python {root}/opsmith/new_op.py NAME`)"


def test_editable_install_says_pip_install_e_again(tmp_path):
    root = _copy(tmp_path, source_tree=True, c_library=False)
    # what pip leaves for an editable install: a dist-info whose direct_url.json says so
    dist = tmp_path / "meta" / "opsmith-0.0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: opsmith\nVersion: 0.0.0\n")
    (dist / "direct_url.json").write_text(json.dumps({"url": root.as_uri(), "dir_info": {"editable": True}}))
    msg = _messages(_import(root, extra_path=[tmp_path / "meta"]))[0]
    lines = msg.splitlines()
    assert "  - the route B library (torch.ops.opsmith.*) opsmith/_C*.so is missing" in lines
    assert (f"  - the C library libopsmith.so is missing (looked for {root / 'opsmith' / 'lib' / 'libopsmith.so'} "
            f"and {root / 'build' / 'libopsmith.so'})") in lines
    assert lines[-2].startswith(f"This opsmith is an editable install of {root}: ")
    assert lines[-1].strip() == f"pip install --no-build-isolation -e {root}"


def test_library_that_does_not_load_says_why(tmp_path):
    root = _copy(tmp_path)
    bad = root / "opsmith" / os.path.basename(_library.library_path())
    bad.write_bytes(b"not a shared library\n" * 64)
    msg = _messages(_import(root))[0]
    assert msg.splitlines()[1].startswith(f"  - the route B library (torch.ops.opsmith.*) {bad} does not load (")
    assert "--force-reinstall" in msg


def test_missing_route_a_fails_at_opsmith_pybind_only(tmp_path):
    root = _copy(tmp_path, keep=("_C*.so",))
    out = _import(root, "opsmith", "opsmith.pybind")
    assert out.startswith("imported " + str(root / "opsmith")), out
    msgs = _messages(out)
    assert len(msgs) == 1
    assert msgs[0].splitlines()[1:-2] == [
        "  - the route A module opsmith._pybind (opsmith.pybind) opsmith/_pybind*.so is missing"]


def test_this_checkout_is_recognised():
    kind, command = _library.install_kind()
    if _library._is_source_tree(_library._TREE):
        assert kind in ("source", "editable")
        assert command.endswith(" build") if kind == "source" else (" -e " in command)
    else:
        assert kind == "installed" and "--force-reinstall" in command
    assert _library.missing_parts(_library.ROUTE_A, _library.ROUTE_B) == []


def test_route_b_built_for_this_interpreter_is_loaded_first(tmp_path, monkeypatch):
    # a tree built by two Pythons: the library tagged for the running one is
    # loaded, not the first by name (a 3.12 interpreter loaded
    # _C.cpython-311-*.so, the other Python's build, from such a tree)
    import importlib.machinery
    ours = importlib.machinery.EXTENSION_SUFFIXES[0]
    names = ["_C.cpython-30-x86_64-linux-gnu.so", f"_C{ours}", "_C.cpython-399-x86_64-linux-gnu.so"]
    for name in names:
        (tmp_path / name).write_text("")
    monkeypatch.setattr(_library, "_HERE", str(tmp_path))
    assert _library._find("_C*.so") == str(tmp_path / f"_C{ours}")
    (tmp_path / f"_C{ours}").unlink()
    # none for this interpreter: the first by name, whose loading then says what is wrong
    assert _library._find("_C*.so") == str(tmp_path / names[0])
