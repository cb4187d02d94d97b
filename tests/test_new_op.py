"""`opsmith new-op`, without building anything: bad names and clashes end
in one line and exit status 2, the expected files are written (in a tree and
as a standalone project), nothing is ever overwritten, and every template is
used and shipped. `make new-op-check` builds and tests what it writes."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

from opsmith import new_op

ROOT = pathlib.Path(__file__).resolve().parents[1]


def fake_tree(root: pathlib.Path) -> pathlib.Path:
    """The parts of an opsmith tree the generator reads and edits."""
    (root / "include" / "opsmith").mkdir(parents=True)
    (root / "include" / "opsmith.h").write_text(
        '#ifndef OPSMITH_H\n/* The ops, one header each (one line per op). */\n'
        '#include "opsmith/rms_norm.h"\n\n#endif\n')
    (root / "opsmith" / "ops").mkdir(parents=True)
    (root / "opsmith" / "ops" / "__init__.py").write_text('OP_MODULES = (\n    "rms_norm",\n)\n\nX = 1\n')
    for d in ("csrc/torch", "csrc/cuda", "tests/c"):
        (root / d).mkdir(parents=True)
    (root / "csrc" / "core.c").write_text("")
    return root


def snapshot(root: pathlib.Path):
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()}


def run(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "opsmith", "new-op", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120)


BAD_NAMES = [
    ("1op", "is not a C identifier"), ("My_op", "is not a C identifier"), ("my-op", "is not a C identifier"),
    ("", "is not a C identifier"), ("my__op", "double or trailing underscore"), ("my_op_", "double or trailing"),
    ("int", "keyword"), ("lambda", "keyword"), ("core", "taken by opsmith's own machinery"),
    ("nn", "taken by opsmith's own machinery"), ("rms_norm", "exists already"), ("gelu_fwd", "read as another op's"),
    ("a" * 41, "longer than 40"),
]


@pytest.mark.parametrize("name,message", BAD_NAMES, ids=[n or "empty" for n, _ in BAD_NAMES])
def test_bad_names_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, name, message):
    root = fake_tree(tmp_path / "tree")
    before = snapshot(root)
    assert new_op.main([name, "--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("opsmith new-op: ") and message in err, err
    assert snapshot(root) == before


@pytest.mark.parametrize("args,message", [
    (["my_op", "--out", "x"], "--out and --namespace go together"),
    (["my_op", "--namespace", "ns"], "--out and --namespace go together"),
    (["my_op", "--out", "x", "--namespace", "opsmith"], "would clash with opsmith's or PyTorch's"),
    (["my_op", "--out", "x", "--namespace", "torch"], "would clash"),
    (["my_op", "--out", "x", "--namespace", "json"], "standard-library module"),
    (["my_op", "--out", "x", "--namespace", "My-ns"], "--namespace 'My-ns' is not a C identifier"),
    (["my_op", "--out", "x", "--namespace", "my_op"], "NAME and --namespace are both"),
    (["my_op", "--bogus"], "unrecognized arguments: --bogus"),
    ([], "the following arguments are required: NAME"),
])
def test_bad_arguments_exit_2(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    try:
        code = new_op.main(args)
    except SystemExit as e:  # argparse's errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "x").exists()


def test_outside_a_tree_says_how(tmp_path):
    p = run("my_op", cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "is not inside an opsmith source tree" in p.stderr and "--out DIR --namespace NS" in p.stderr


def test_help_describes_both_forms(capsys):
    from opsmith.__main__ import main as opsmith_main
    with pytest.raises(SystemExit) as e:
        new_op.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--out DIR" in out and "--namespace NS" in out and "never overwritten" in out
    assert opsmith_main(["--help"]) == 0
    assert "  new-op " in capsys.readouterr().out


IN_TREE = {
    "include/opsmith/my_op.h", "csrc/reference/my_op.c", "csrc/cpu/my_op.c", "csrc/internal/my_op.h",
    "csrc/internal/my_op.c", "csrc/cuda/my_op.cu", "csrc/no_cuda/my_op.c", "csrc/torch/my_op.cpp",
    "opsmith/ops/my_op.py", "opsmith/specs/my_op.py", "tests/test_my_op.py", "tests/c/test_my_op.c",
}


def test_in_tree_writes_every_layer_and_one_line_per_list(tmp_path):
    root = fake_tree(tmp_path)
    before = {p for p in snapshot(root)}
    written = new_op.new_op_in_tree("my_op", root)
    new = {str(p.relative_to(root)) for p in snapshot(root)} - {str(p.relative_to(root)) for p in before}
    assert new == IN_TREE
    assert {str(p.relative_to(root)) for p in written} == IN_TREE | {"include/opsmith.h", "opsmith/ops/__init__.py"}
    header = (root / "include" / "opsmith.h").read_text()
    assert '#include "opsmith/rms_norm.h"\n#include "opsmith/my_op.h"\n' in header
    assert 'OP_MODULES = (\n    "rms_norm",\n    "my_op",\n)\n\nX = 1\n' == (root / "opsmith/ops/__init__.py").read_text()
    for rel in IN_TREE:
        text = (root / rel).read_text()
        assert not new_op.PLACEHOLDER.search(text), f"{rel}: a placeholder was left"
        if rel.endswith(".py"):
            compile(text, rel, "exec")
    bridge = (root / "csrc/torch/my_op.cpp").read_text()
    assert "TORCH_LIBRARY_FRAGMENT(opsmith, m)" in bridge and "OPSMITH_PYBIND(my_op)" in bridge
    assert "struct MyOpBackward : public torch::autograd::Node" in bridge
    assert "HARNESS_GROUP(test_my_op)" in (root / "tests/c/test_my_op.c").read_text()
    assert "opsmith_my_op_fwd_cpu" in (root / "include/opsmith/my_op.h").read_text()


def test_in_tree_never_overwrites(tmp_path, capsys):
    root = fake_tree(tmp_path)
    (root / "csrc" / "cpu").mkdir()
    (root / "csrc" / "cpu" / "my_op.c").write_text("mine\n")
    before = snapshot(root)
    assert new_op.main(["my_op", "--root", str(root)]) == 2
    assert "csrc/cpu/my_op.c exists" in capsys.readouterr().err
    assert snapshot(root) == before, "a refused call wrote something"
    # a second run after a successful one is refused too (the op exists now)
    (root / "csrc" / "cpu" / "my_op.c").unlink()
    assert new_op.main(["other_op", "--root", str(root), "-q"]) == 0
    before = snapshot(root)
    assert new_op.main(["other_op", "--root", str(root)]) == 2
    assert "exists already" in capsys.readouterr().err
    assert snapshot(root) == before


def test_standalone_project(tmp_path):
    out = tmp_path / "proj"
    written = new_op.new_op_standalone("my_op", out, "myops")
    files = {str(p.relative_to(out)) for p in written}
    assert files == {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    expect = {t.format(name="my_op", ns="myops") for _, t in new_op.STANDALONE_FILES + new_op.OP_FILES}
    assert files == expect
    for rel in ("setup.py", "myops/_build.py", "include/myops.h", "include/myops/my_op.h", "csrc/torch/my_op.cpp",
                "myops/ops/my_op.py", "tests/test_my_op.py"):
        assert rel in files
    for rel in files:
        text = (out / rel).read_text()
        assert not new_op.PLACEHOLDER.search(text), f"{rel}: a placeholder was left"
        if rel.endswith(".py"):
            compile(text, rel, "exec")
        if rel.endswith((".h", ".c", ".cu", ".cuh", ".cpp", ".py")):
            # its own prefix and namespace: nothing that would clash with libopsmith or torch.ops.opsmith
            assert "opsmith_" not in text and "OPSMITH_" not in text and "torch.ops.opsmith" not in text, rel
            assert "import opsmith" not in text and "from opsmith" not in text, f"{rel} needs opsmith"
    assert "TORCH_LIBRARY(myops, m)" in (out / "csrc/torch/library.cpp").read_text()
    assert "cpp.load(" in (out / "myops/_build.py").read_text()
    # never overwrites: a second run is refused and changes nothing
    before = snapshot(out)
    with pytest.raises(new_op.NewOpError, match="exists"):
        new_op.new_op_standalone("my_op", out, "myops")
    assert snapshot(out) == before


def test_templates_are_all_used_and_shipped():
    used = {t for t, _ in new_op.OP_FILES + new_op.IN_TREE_FILES + new_op.STANDALONE_FILES}
    present = {str(p.relative_to(new_op.TEMPLATES)) for p in new_op.TEMPLATES.rglob("*") if p.is_file()
               and "__pycache__" not in p.parts}
    assert used == present, f"unused: {present - used}, missing: {used - present}"
    # setup.py's package_data pattern is templates/new_op/*/*.in
    assert all(len(pathlib.Path(t).parts) == 2 and t.endswith(".in") for t in present)
    assert '"templates/new_op/*/*.in"' in (ROOT / "setup.py").read_text()


def test_runs_as_a_file_before_the_tree_is_built(tmp_path):
    # `python opsmith/new_op.py` imports neither torch nor the package (whose
    # import needs the built extensions)
    script = ROOT / "opsmith" / "new_op.py"
    p = subprocess.run([sys.executable, "-S", str(script), "Bad"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("opsmith new-op: NAME 'Bad' is not a C identifier"), p.stderr
    p = subprocess.run([sys.executable, "-S", str(script), "ok_op", "--out", "p", "--namespace", "okns", "-q"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "p" / "okns" / "ops" / "ok_op.py").is_file()


def test_generated_op_checks_as_its_bridge_does(tmp_path):
    # the fake kernels go through the device-checking register_fake (opsmith's
    # in the tree, the project's own copy outside), the bridge allocates with
    # empty_output, and alpha is refused past float's range where the kernels
    # narrow it to float
    root = fake_tree(tmp_path / "tree")
    new_op.new_op_in_tree("my_op", root)
    out = tmp_path / "proj"
    new_op.new_op_standalone("my_op", out, "myops")
    for base, ns in ((root, "opsmith"), (out, "myops")):
        ops = (base / ns / "ops" / "my_op.py").read_text()
        assert "from . import first_order_only, register_fake" in ops
        assert "torch.library.register_fake" not in ops and ops.count("@register_fake(") == 2
        bridge = (base / "csrc/torch/my_op.cpp").read_text()
        assert "at::empty(" not in bridge and bridge.count("empty_output(") == 2
        assert "alpha must be within float's range" in bridge and "FLT_MAX" in bridge
        assert "FLT_MAX" in (base / "csrc/internal/my_op.c").read_text()
        test = (base / "tests/test_my_op.py").read_text()
        assert "silu(" not in test, "a check tied to the template's formula, not derived from reference()"
        assert "def test_alpha_past_float_range" in test and "def test_fake_kernels_refuse_as_the_bridge_does" in test
    assert "def register_fake" in (out / "myops/ops/__init__.py").read_text()
    assert "empty_output" in (out / "csrc/torch/tensor_args.h").read_text()
    assert "alpha past FLT_MAX" in (root / "tests/c/test_my_op.c").read_text()


def test_guide_gives_what_the_generator_writes_and_prints(tmp_path, capsys):
    # docs/guide.md's step 0 names every file the in-tree form writes and
    # every step it prints afterwards, with NAME for the op
    guide = (ROOT / "docs" / "guide.md").read_text()
    for _, target in new_op.OP_FILES + new_op.IN_TREE_FILES:
        path = target.format(name="NAME", ns="opsmith")
        assert f"`{path}`" in guide, f"docs/guide.md does not say what {path} is for"
    for line in ('`#include "opsmith/NAME.h"`', "`OP_MODULES`", "`FUNCTIONS`", "`MODULES`", "`PYBIND`"):
        assert line in guide
    root = fake_tree(tmp_path)
    assert new_op.main(["my_op", "--root", str(root)]) == 0
    steps = capsys.readouterr().out.split("then:\n", 1)[1].splitlines()
    assert steps
    for step in steps:
        command = step.split("#", 1)[0].strip().replace("my_op", "NAME")
        assert command in guide, f"docs/guide.md does not give the step {command!r}"
    # the commands to copy run ctest as the tree was built: NVCC= would
    # switch to a CPU-only configuration and rebuild every object
    blocks = re.findall(r"^```\w*\n(.*?)^```", guide, re.M | re.S)
    assert not [line for b in blocks for line in b.splitlines() if "make ctest" in line and "NVCC=" in line]
