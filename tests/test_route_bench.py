"""`opsmith bench --routes --quick` on the CPU (and on a GPU where there is
one): the results have their structure, and the numbers in them are measured
(positive times, sizes of files that exist), with route B passing opcheck
and tracing under torch.compile(fullgraph=True)."""
import json
import math

import pytest

from conftest import devices
from opsmith import bench, route_bench


@pytest.fixture(scope="module", params=devices)
def routes(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("routes")
    assert bench.main(["--routes", "--quick", "--device", request.param, "--out", str(out)]) == 0
    with open(out / "results.json") as f:
        results = json.load(f)
    with open(out / "table.md") as f:
        table = f.read()
    return results, table


def _positive(v):
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def test_structure(routes):
    results, _ = routes
    assert set(results) == {"meta", "routes", "reference"}
    meta = results["meta"]
    for key in ("date", "machine", "cpu", "device", "torch", "python", "opsmith", "compile_backend",
                "build_time_method"):
        assert meta[key], key
    assert meta["device"] in ("cpu", "cuda") and meta["quick"] is True and meta["build_time_method"] == "log"
    assert (meta["gpu"] is not None) == (meta["device"] == "cuda")
    assert set(results["routes"]) == {"A", "B"}
    for r in results["routes"].values():
        assert set(r) >= {"call", "raw", "compile", "opcheck", "host_us", "build", "binary"}
        assert set(r["compile"]) == {"forward", "forward+backward"}
        assert set(r["host_us"]) == {"call", "call (requires_grad)", "raw binding"}
    assert results["routes"]["A"]["call"] == "opsmith.pybind.rms_norm"
    assert results["routes"]["B"]["call"] == "opsmith.rms_norm"


def test_host_times_are_measured(routes):
    results, _ = routes
    timings = [t for r in results["routes"].values() for t in r["host_us"].values()]
    timings += list(results["reference"]["host_us"].values())
    for t in timings:
        assert _positive(t["median_us"]) and t["min_us"] <= t["median_us"] <= t["p90_us"], t
        assert t["batches"] >= 10 and t["calls_per_batch"] >= 10
    # a call with autograd does more than the raw binding under it
    for r in results["routes"].values():
        assert r["host_us"]["call (requires_grad)"]["median_us"] > 0.5 * r["host_us"]["raw binding"]["median_us"]


def test_route_b_passes_opcheck_and_traces(routes):
    results, _ = routes
    b = results["routes"]["B"]
    assert b["opcheck"]["passed"] is True
    for op in ("rms_norm_fwd", "rms_norm_bwd"):
        tests = b["opcheck"]["tests"][op]
        assert tests and set(tests.values()) == {"SUCCESS"}, tests
        assert "test_faketensor" in tests and "test_autograd_registration" in tests
    for case in ("forward", "forward+backward"):
        assert b["compile"][case]["traced"] is True and b["compile"][case]["matches_eager"] is True, b["compile"]


def test_route_a_outcomes_are_recorded(routes):
    results, _ = routes
    a = results["routes"]["A"]
    # an autograd.Function over a pybind11 call: a graph break, which fullgraph=True makes an error
    for case in ("forward", "forward+backward"):
        c = a["compile"][case]
        assert c["traced"] is False and c["error"] == "torch._dynamo.exc.Unsupported", c
    assert a["opcheck"]["applicable"] is False and a["opcheck"]["error"], a["opcheck"]


def test_sizes_and_build_times(routes):
    results, _ = routes
    for name, r in results["routes"].items():
        binary = r["binary"]
        assert _positive(binary["bytes"]) and binary["path"].endswith(".so"), binary
        if "bytes_without_debug" in binary:
            assert 0 < binary["bytes_without_debug"] <= binary["bytes"]
        build = r["build"]
        assert build["method"] == "log"
        if route_bench._source_tree() and "error" not in build:
            assert _positive(build["seconds"])
            assert "rms_norm.o" in build["objects_s"] and all(_positive(v) for v in build["objects_s"].values())
            assert ("pybind.o" if name == "A" else "library.o") in build["objects_s"]


def test_table(routes):
    results, table = routes
    lines = table.splitlines()
    header = next(l for l in lines if l.startswith("| |"))
    assert route_bench.ROUTE_TITLES["A"] in header and route_bench.ROUTE_TITLES["B"] in header
    rows = {l.split("|")[1].strip(): [c.strip() for c in l.strip().strip("|").split("|")[1:]]
            for l in lines if l.startswith("| ") and not l.startswith("| |")}
    assert rows["torch.library.opcheck"][1].startswith("passed")
    compile_rows = [k for k in rows if k.startswith("torch.compile(fullgraph=True)")]
    assert len(compile_rows) == 2 and all(rows[k][1] == "traced" for k in compile_rows)
    host = next(k for k in rows if k.startswith("host time per call, us"))
    for cell, r in zip(rows[host], "AB"):
        assert abs(float(cell) - results["routes"][r]["host_us"]["call"]["median_us"]) < 0.006
    assert results["meta"]["torch"] in table


def test_cuda_without_a_gpu_is_refused(tmp_path, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert bench.main(["--routes", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()
