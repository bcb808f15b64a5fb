"""benchmarks/gpu_train_step.py on CPU (``--device cpu --quick``): the training job runs in this
process as rank 0 of a world of one (gloo) on a tiny Qwen3-MoE, its figures are read back from
its metrics, the simulator's peak is set beside it, and the process's environment is left as it
was. The torchtitan side needs torchtitan (not a test dependency): refused with the reason."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest

from _scripts import load_benchmark

pytest.importorskip("transformers")


def test_quick_run_trains_and_reports(tmp_path):
    bench = load_benchmark("gpu_train_step")
    before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    out = tmp_path / "step.json"
    assert bench.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    assert {k: os.environ.get(k) for k in before} == before
    result = json.loads(out.read_text())
    ours = result["moesaic"]
    assert ours["rc"] == 0 and ours["steps"] == 4  # 1 warm-up + 3 timed
    assert ours["tokens_per_s"] > 0 and math.isfinite(ours["loss_last"])
    assert ours["predicted_peak_gib"] > 0 and "host_syncs_per_step" not in ours  # CUDA only
    active, per_token = bench.flops_per_token(result["model"], result["seq_len"])
    assert result["active_params"] == active and result["flops_per_token"] == per_token
    titan = result["torchtitan"]
    if importlib.util.find_spec("torchtitan") is None:  # not a test dependency: the reason
        assert titan["error"] == "ModuleNotFoundError: No module named 'torchtitan'"
    else:
        assert titan["tokens_per_s"] > 0 and titan["losses_finite"]
