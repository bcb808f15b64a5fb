"""The command line: help, a tiny benchmark run, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moesaic.cli import main
from moesaic.strategies import strategy_names


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "bench" in capsys.readouterr().out


def test_bench_layer_tiny(tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "layer", "--hidden", "16", "--ffn", "16", "--experts", "4", "--tokens", "32"]
    args += ["--ep", "1,2", "--iters", "2", "--warmup", "0", "--out", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["torch"] and result["config"]["ep_sizes"] == [1, 2]
    rows = {(r["ep"], r["impl"], r["routing"]): r for r in result["rows"]}
    assert {(2, "padded", "skewed"), (2, "dropless", "uniform")} <= set(rows)
    # By default every registered strategy that runs without a cluster description: all the
    # built-in ones.
    assert result["config"]["strategies"] == list(strategy_names())
    assert {impl for _, impl, _ in rows} >= set(strategy_names())
    # Skewed routing pads more: padded sends at least what dropless sends.
    assert rows[(2, "padded", "skewed")]["bytes_vs_dropless"] >= 1.0
    assert rows[(2, "padded", "skewed")]["load"]["max_over_mean"] > 1.5


def test_bench_layer_shared_experts_builds_them(tmp_path, monkeypatch, capsys):
    from moesaic.bench import layer as bench_layer

    built = []

    def spy(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    real = bench_layer._layer
    monkeypatch.setattr(bench_layer, "_layer", spy)
    out = tmp_path / "bench.json"
    args = ["bench", "layer", "--hidden", "16", "--ffn", "16", "--experts", "4", "--tokens", "16"]
    args += ["--ep", "1", "--iters", "1", "--warmup", "0", "--strategies", "dropless,padded"]
    args += ["--shared-experts", "2", "--shared-expert-hidden", "8", "--out", str(out)]
    assert main(args) == 0
    assert "skipping the transformers Mixtral peer" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["config"]["num_shared_experts"] == 2
    assert result["config"]["shared_expert_hidden_size"] == 8
    assert {r["impl"] for r in result["rows"]} == {"dropless", "padded"}  # no Mixtral block
    assert len(built) == 4  # two strategies, two routings
    for layer in built:
        assert layer.shared_experts is not None and layer.shared_experts.w1.shape == (16, 16)


def test_user_error_is_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "moesaic", "bench", "layer", "--experts", "6", "--ep", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "num_experts (6) must be divisible by every ep size (got 4)" in proc.stderr
