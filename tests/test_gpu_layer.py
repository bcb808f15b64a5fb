"""benchmarks/gpu_layer.py on CPU (``--device cpu --quick``): it runs every part that needs no
GPU, checks each module against dropless first, and ``--repredict`` recomputes the simulator's
predictions of a result file (what issue 27's GPU runs committed)."""

from __future__ import annotations

import json

import pytest

from _scripts import load_benchmark


@pytest.fixture(scope="module")
def gpu_layer():
    return load_benchmark("gpu_layer")


def test_quick_run_times_and_checks_the_modules(gpu_layer, tmp_path):
    out = tmp_path / "layer.json"
    argv = ["--device", "cpu", "--quick", "--out", str(out), "--iters", "2", "--stream", "2"]
    argv += ["--warmup", "1", "--passes", "3", "--modules", "padded-cf1.25"]
    assert gpu_layer.main(argv) == 0
    (row,) = json.loads(out.read_text())["configs"]
    assert set(row["modules"]) == {"dropless", "padded-cf1.25"}  # --modules: dropless always
    for r in row["modules"].values():
        assert r["stream_ms"] > 0 and r["step_ms"] > 0
        assert r["passes"] == 3 and len(r["passes_stream_ms"]) == 3
        assert r["stream_ms"] == sorted(r["passes_stream_ms"])[1]  # the median of the rounds
        assert r["stream_ms_spread"] == [min(r["passes_stream_ms"]), max(r["passes_stream_ms"])]
    assert row["race"] == {}  # no torchtitan: no race
    assert row["dense_gemm_bound_ms"] is None  # measured on a GPU only


def test_repredict_adds_the_simulators_prediction(gpu_layer, tmp_path):
    from moesaic.sim.profile import Profile

    result = {
        "dtype": "torch.bfloat16",
        "configs": [
            {"name": "m", "H": 64, "F": 128, "E": 4, "K": 2, "T": 256,
             "modules": {"dropless": {"stream_ms": 2.0}}},
        ],
    }  # fmt: skip
    src, prof, out = tmp_path / "r.json", tmp_path / "p.json", tmp_path / "out.json"
    src.write_text(json.dumps(result))
    gpu = Profile(flops_per_s=1e12, half_flops_per_s=4e12, device="cuda", mem_bytes_per_s=1e12)
    gpu.save(prof)
    assert gpu_layer.main(["--repredict", str(src), "--profile", str(prof), "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["configs"]
    assert row["repredicted_ms"] > 0
    assert row["repredicted_error"] == pytest.approx(row["repredicted_ms"] / 2.0 - 1)
    assert gpu_layer.main(["--repredict", str(src), "--out", str(out)]) == 2  # needs --profile


def test_race_takes_each_sides_better_variant(gpu_layer):
    modules = {
        "dropless": {"stream_ms": 4.0},
        "dropless+compile": {"error": "x"},
        "torchtitan": {"stream_ms": 7.0},
        "torchtitan+compile": {"stream_ms": 5.0},
    }
    r = gpu_layer.race(modules)
    assert (r["ours"], r["torchtitan"]) == ("dropless", "torchtitan+compile")
    assert r["speedup"] == pytest.approx(5.0 / 4.0)
