"""The benchmark suite's bookkeeping, which runs without a GPU: the sweep,
the tables made from results, the README section generated from them."""
import os
import json

import pytest
import torch

bench = pytest.importorskip("opsmith.bench")


def _row(direction, dtype, rows, hidden, provider, ms, **extra):
    r = {"op": "rms_norm", "direction": direction, "provider": provider, "dtype": dtype,
         "rows": rows, "hidden": hidden, "ms": ms, "bytes": 1, "gbs": 1.0 / ms,
         "fraction_of_copy": 0.5 / ms, "peak_extra_mb": 0.0, "timing": "events", "error": ""}
    r.update(extra)
    return r


def _results(rows, **meta):
    m = {"gpu": "GPU", "torch": "t", "cuda": "c", "date": "d", "copy_bandwidth_gbs": 1.0}
    m.update(meta)
    return {"meta": m, "rows": rows}


def test_sweep_limits_size_and_dtypes():
    shapes, dtypes = bench._sweep(bench.OPS["rms_norm"], quick=False, dtypes=["f16"])
    assert dtypes == [torch.float16]
    assert shapes and all(r * n <= 1 << 30 for r, n in shapes)
    assert (262144, 4096) in shapes and (262144, 8192) not in shapes
    _, quick_dtypes = bench._sweep(bench.OPS["rms_norm"], quick=True)
    assert quick_dtypes == [torch.bfloat16]


def test_table_marks_the_fastest_and_a_missing_provider():
    rows = [_row("fwd", "bfloat16", 8, 512, "opsmith", 2.0),
            _row("fwd", "bfloat16", 8, 512, "torch_F", 1.0),
            _row("fwd", "bfloat16", 8, 512, "liger", float("nan"))]
    table = bench.summary_table(_results(rows))
    line = next(l for l in table.splitlines() if "8x512" in l)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4:] == ["2.0000 (0.25)", "1.0000 (0.50)*", "n/a", "2.00x"]


def test_table_compares_opsmith_with_the_fastest_other_provider():
    rows = [_row("fwd", "bfloat16", 8, 512, "opsmith", 1.5),
            _row("fwd", "bfloat16", 8, 512, "torch_F", 2.0),
            _row("fwd", "bfloat16", 8, 512, "liger", 3.0),
            _row("fwd", "bfloat16", 16, 512, "torch_F", 2.0)]  # opsmith missing here
    table = bench.summary_table(_results(rows))
    assert "| opsmith / best other |" in table
    ratio = {l.split("|")[4].strip(): l.strip().strip("|").split("|")[-1].strip()
             for l in table.splitlines() if l.startswith("| rms_norm")}
    assert ratio == {"8x512": "0.75x", "16x512": "n/a"}
    alone = bench.summary_table(_results([_row("fwd", "bfloat16", 8, 512, "opsmith", 1.0)]))
    assert "best other" not in alone


def test_condensed_table_keeps_largest_and_decode_rows():
    rows = [_row(d, "bfloat16", r, n, "opsmith", 1.0)
            for d in ("fwd", "fwd+bwd") for n in (512, 4096) for r in (1, 16, 1024, 65536)]
    rows.append(_row("fwd", "bfloat16", 262144, 512, "opsmith", 1.0))
    table = bench.summary_table(_results(rows), condensed=True)
    shapes = [l.split("|")[4].strip() for l in table.splitlines() if l.startswith("| rms_norm")]
    assert shapes == ["16x512", "262144x512", "16x4096", "65536x4096",
                      "16x512", "65536x512", "16x4096", "65536x4096"]


def test_table_says_when_a_run_stopped_early():
    table = bench.summary_table(_results([_row("fwd", "float32", 1, 512, "opsmith", 1.0)],
                                         stopped_early="3 of 9 measurements"))
    assert "Stopped early: 3 of 9 measurements." in table.splitlines()[0]


def test_readme_section_is_replaced_between_markers(tmp_path):
    results_dir = tmp_path / "run"
    results_dir.mkdir()
    rows = [_row("fwd", "bfloat16", 65536, 512, "opsmith", 1.0)]
    (results_dir / "results.json").write_text(json.dumps(_results(rows)))
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{bench.README_BEGIN}\nold table\n{bench.README_END}\nafter\n")
    bench.write_readme_table(str(results_dir), str(readme))
    text = readme.read_text()
    assert "old table" not in text and "65536x512" in text
    assert text.startswith("before\n") and text.endswith(f"{bench.README_END}\nafter\n")
    assert "65536x512" in (results_dir / "table.md").read_text()  # full table regenerated too


def test_readme_takes_one_table_per_results_dir(tmp_path):
    dirs = []
    for name, shape in (("a", 65536), ("b", 1024)):
        d = tmp_path / name
        d.mkdir()
        d.joinpath("results.json").write_text(json.dumps(_results([_row("fwd", "bfloat16", shape, 512, "opsmith", 1.0)])))
        dirs.append(str(d))
    readme = tmp_path / "README.md"
    readme.write_text(f"{bench.README_BEGIN}\nold\n{bench.README_END}\n")
    bench.write_readme_table(dirs, str(readme))
    text = readme.read_text()
    assert "old" not in text and "65536x512" in text and "1024x512" in text
    assert text.index(dirs[0]) < text.index(dirs[1])
    assert text.count(bench.README_BEGIN) == 1 and text.count(bench.README_END) == 1


def test_e2e_training_step_runs_each_way_on_a_tiny_model():
    """The end-to-end benchmark's child process (one configuration, one
    training step) on a 2-layer stand-in on the CPU: Hugging Face as it is
    and opsmith-patched (also with its decoder layers compiled) give a JSON
    line with a finite loss, the same start."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = {}
    for config in ("hf_eager", "opsmith", "opsmith_adamw", "opsmith_compile"):
        p = subprocess.run([sys.executable, "-m", "opsmith.e2e_bench", "--one", config, "--device", "cpu", "--tiny",
                            "--batch", "2", "--seq", "32", "--steps", "1", "--warmup", "1"],
                           capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        out[config] = json.loads(p.stdout.strip().splitlines()[-1])
    # the kernels compared with the optimizer held equal; opsmith's AdamW in a row of its own
    assert out["opsmith"]["optimizer"] == "torch AdamW" and out["hf_eager"]["optimizer"] == "torch AdamW"
    assert out["opsmith_adamw"]["optimizer"] == "opsmith AdamW"
    for r in out.values():
        assert r["tokens_per_s"] > 0 and r["loss"] == r["loss"]
    # one optimizer step in: bf16 models, the same data; the losses agree to bf16
    for config in ("opsmith", "opsmith_adamw", "opsmith_compile"):
        assert abs(out[config]["loss"] - out["hf_eager"]["loss"]) < 0.05 * out["hf_eager"]["loss"]


def test_e2e_largest_batch_search_finds_the_boundary_from_any_guess():
    """The largest-batch search: for every true answer and every guess, the
    largest fitting batch, probing nothing above the limit, nothing twice,
    and two probes when the guess is right."""
    from opsmith.e2e_bench import largest_fitting
    limit = 40
    for answer in range(0, limit + 1):
        for guess in range(1, limit + 1):
            probes = []

            def fits(b):
                assert 1 <= b <= limit and b not in probes
                probes.append(b)
                return b <= answer
            ok = min(answer, 4) if answer else 0  # the measured batch, when it fitted
            assert largest_fitting(fits, ok, guess, limit) == answer, (answer, guess, probes)
            if guess == answer and ok < answer < limit:
                assert probes == [answer, answer + 1]
            assert len(probes) <= 2 * limit.bit_length() + 2


def test_e2e_batch_guess_from_the_measured_memory():
    from opsmith.e2e_bench import batch_guess
    # 7 GiB before the step, 57 at batch 4: 12.5 GiB a sequence; 139 GiB device, 2 kept back
    measured = {"batch": 4, "peak_gib": 57.0, "phase_gib": {"before": 7.0}, "device_gib": 139.0}
    assert batch_guess(measured, 256) == int((139 - 2 - 7) / 12.5) == 10
    assert batch_guess(measured, 8) == 8
    assert batch_guess({"batch": 4, "peak_gib": 5.0}, 256) == 1  # nothing to go on: start at one


def test_e2e_merge_keeps_the_configuration_order_and_refuses_mixed_gpus(tmp_path):
    from opsmith import e2e_bench
    row = {"batch": 4, "seq": 16, "tokens_per_s": 1.0, "ms_per_step": 1.0, "peak_gib": 1.0, "loss": 1.0,
           "optimizer": "o", "gpu": "G"}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "e2e.json").write_text(json.dumps([dict(row, config="opsmith_compile")]))
    (tmp_path / "b" / "e2e.json").write_text(json.dumps([dict(row, config="hf_eager"), dict(row, config="opsmith")]))
    out = tmp_path / "all"
    assert e2e_bench.main(["--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    assert [r["config"] for r in json.loads((out / "e2e.json").read_text())] == ["hf_eager", "opsmith",
                                                                                  "opsmith_compile"]
    assert (out / "e2e.md").read_text().count("| opsmith") == 2
    (tmp_path / "a" / "e2e.json").write_text(json.dumps([dict(row, config="opsmith_compile", gpu="H")]))
    assert e2e_bench.main(["--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 2
