"""A run's measured expert loads as the simulator's routing (``ModelSpec.measured_loads``,
``moesaic.sim.model.measured_loads``, ``simulate --loads`` / ``plan --loads``): a training job's
busiest expert carries several times the mean, which uniform routing does not price."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from moesaic.cli import main
from moesaic.sim.model import ModelSpec, expert_shares, measured_loads

ROOT = Path(__file__).resolve().parents[2]
FLOWMOE_2RANK = ROOT / "examples" / "clusters" / "flowmoe_2rank.toml"
TINY = ROOT / "examples" / "train_tiny.toml"  # E 4, 2 blocks
MODEL = ModelSpec(
    name="m", layers=2, batch=4, seq_len=8, hidden=16, ffn_hidden=32, experts=4, top_k=2
)


def _metrics(path: Path, loads_per_step: list[list[list[int]]]) -> Path:
    rows = [{"kind": "eval", "step": 0, "loss": 1.0}]
    rows += [
        {"kind": "train", "step": i + 1, "loss": 1.0, "expert_load": loads}
        for i, loads in enumerate(loads_per_step)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_loads_sum_the_layers_after_the_warm_up(tmp_path):
    warm = [[100, 0, 0, 0], [0, 100, 0, 0]]  # the first two steps are left out
    hot = [[30, 5, 3, 2], [20, 10, 6, 4]]
    path = _metrics(tmp_path / "m.jsonl", [warm, warm, hot, hot])
    assert measured_loads(path) == (100.0, 30.0, 18.0, 12.0)
    assert measured_loads(_metrics(tmp_path / "short.jsonl", [hot])) == (50.0, 15.0, 9.0, 6.0)
    (tmp_path / "none.jsonl").write_text('{"kind": "eval"}\n')
    with pytest.raises(ValueError, match="no train record with expert_load"):
        measured_loads(tmp_path / "none.jsonl")
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not JSON"):
        measured_loads(tmp_path / "bad.jsonl")


def test_measured_loads_are_the_expert_shares_and_capacity_caps_them():
    model = dataclasses.replace(MODEL, measured_loads=[6, 2, 1, 1])  # a list, as from JSON
    assert model.measured_loads == (6.0, 2.0, 1.0, 1.0)
    assert expert_shares(model) == pytest.approx([0.6, 0.2, 0.1, 0.1])
    capped = dataclasses.replace(model, capacity_factor=1.25)  # at most 1.25 / 4 each
    assert expert_shares(capped) == pytest.approx([0.3125, 0.2, 0.1, 0.1])
    assert expert_shares(MODEL) == pytest.approx([0.25] * 4)  # none: uniform
    with pytest.raises(ValueError, match=r"measured_loads has 3 entries; .* \(model.experts = 4\)"):
        dataclasses.replace(MODEL, measured_loads=(1, 1, 1))
    with pytest.raises(ValueError, match=r"model.measured_loads\[1\]"):
        dataclasses.replace(MODEL, measured_loads=(1, -1, 1, 1))
    with pytest.raises(ValueError, match="must not be all zero"):
        dataclasses.replace(MODEL, measured_loads=(0, 0, 0, 0))


def test_simulate_and_plan_take_a_runs_loads(tmp_path, capsys):
    hot = [[400, 20, 20, 40], [300, 60, 60, 60]] * 2  # two blocks; the first expert's rank is hot
    path = _metrics(tmp_path / "metrics.jsonl", [hot, hot, hot])
    base = ["simulate", "--cluster", str(FLOWMOE_2RANK), "--model", str(TINY), "--json"]
    base += ["--flops-per-s", "1e10", "--strategy", "dropless", "--schedule", "vanilla"]

    def step_ms(*extra: str) -> float:
        assert main([*base, *extra]) == 0
        result = json.loads(capsys.readouterr().out)
        return (result[0] if isinstance(result, list) else result)["iteration_ms"]

    uniform = step_ms()
    skewed = step_ms("--loads", str(path))
    assert skewed > uniform * 1.2  # the busiest rank computes and receives more
    five = _metrics(tmp_path / "five.jsonl", [[[1, 1, 1, 1, 1]]])
    assert main([*base, "--loads", str(five)]) == 2
    assert "the run had 5 experts, the model 4" in capsys.readouterr().err
    plan = ["plan", "--cluster", str(FLOWMOE_2RANK), "--model", str(TINY), "--loads", str(path)]
    assert main([*plan, "--domains-only"]) == 2
    assert "--loads applies to the ranking, not to --domains-only" in capsys.readouterr().err
    assert main([*plan, "--flops-per-s", "1e10", "--json"]) == 0
    captured = capsys.readouterr()
    assert "the busiest expert" in captured.err and json.loads(captured.out)
