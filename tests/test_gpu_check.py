"""benchmarks/gpu_check.py's correctness part on CPU (``--device cpu --quick``): it passes on the
real layer and exits 1 when the layer is wrong, so a GPU run that says "ok" means something; its
tests part runs tests/gpu (every test skipped here) and exits 1 when one fails."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from _scripts import load_benchmark
from moesaic.experts import GroupedExperts


@pytest.fixture(scope="module")
def gpu_check():
    return load_benchmark("gpu_check")


def test_correctness_passes_on_cpu(gpu_check, tmp_path):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--device", "cpu", "--quick", "--skip", "speed", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    # tests/gpu ran first, in a subprocess: collected, and every GPU test skipped without CUDA
    tests = result["tests"]
    assert tests["rc"] == 0 and tests["skipped"] > 0, tests
    assert tests["passed"] == tests["failed"] == tests["errors"] == 0, tests
    assert "skipped" in tests["summary"], tests["summary"]
    checks = result["correctness"]
    ran = {(c["dispatcher"], c["dtype"]) for c in checks if "skipped" not in c}
    assert {
        ("dropless", "fp32"),
        ("dropless", "bf16"),
        ("padded", "fp32"),
        ("padded", "bf16"),
    } <= ran
    for c in checks:
        if "skipped" not in c:
            assert c["ok"] and {"y", "x.grad", "router.weight.grad", "experts.w2.grad"} <= set(
                c["errors"]
            )


def test_a_wrong_expert_output_fails_loudly(gpu_check, tmp_path, monkeypatch):
    forward = GroupedExperts.forward
    # 1% off: beyond fp32's rounding by 4 orders (inside bf16's allowance of 4 ulps of the
    # scale, 3%). hybrid and taskflow run their own expert kernels, so only these two see it.
    monkeypatch.setattr(GroupedExperts, "forward", lambda self, x, c: forward(self, x, c) * 1.01)
    out = tmp_path / "gpu_check.json"
    argv = ["--device", "cpu", "--quick", "--skip", "speed,tests", "--out", str(out)]
    assert gpu_check.main(argv) == 1
    checks = json.loads(out.read_text())["correctness"]
    failed = {c["dispatcher"] for c in checks if c["dtype"] == "fp32" and c.get("ok") is False}
    assert {"dropless", "padded"} <= failed


def test_a_failing_gpu_test_fails_the_check(gpu_check, tmp_path, monkeypatch):
    # a junit report with one failure, one skip and one pass, as pytest would leave it
    real_run = subprocess.run

    def fake_run(cmd, **kwargs):
        if "pytest" not in cmd:  # e.g. git, for the result's metadata
            return real_run(cmd, **kwargs)
        junit = Path(next(a for a in cmd if a.startswith("--junitxml=")).split("=", 1)[1])
        junit.write_text(
            '<testsuites><testsuite name="pytest">'
            '<testcase classname="tests.gpu.test_x" name="test_a"><failure message="x"/></testcase>'
            '<testcase classname="tests.gpu.test_x" name="test_b"><skipped message="y"/></testcase>'
            '<testcase classname="tests.gpu.test_x" name="test_c"/>'
            "</testsuite></testsuites>"
        )
        return subprocess.CompletedProcess(cmd, 1, "1 failed, 1 passed, 1 skipped in 0.1s\n", "")

    monkeypatch.setattr(gpu_check.subprocess, "run", fake_run)
    out = tmp_path / "gpu_check.json"
    argv = ["--device", "cpu", "--quick", "--skip", "speed", "--out", str(out)]
    assert gpu_check.main(argv) == 1
    tests = json.loads(out.read_text())["tests"]
    assert (tests["passed"], tests["failed"], tests["skipped"]) == (1, 1, 1)
    assert tests["failed_tests"] == ["tests.gpu.test_x::test_a"]
    assert tests["summary"] == "1 failed, 1 passed, 1 skipped in 0.1s"
