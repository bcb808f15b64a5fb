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
from moesaic.sim.pipelined import rank_shares
from moesaic.sim.profile import Profile, RoutingLoads

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


def test_loads_are_per_step_and_layer_after_the_warm_up(tmp_path):
    warm = [[100, 0, 0, 0], [0, 100, 0, 0]]  # the first two steps are left out
    hot = [[30, 5, 3, 2], [20, 10, 6, 4]]
    other = [[2, 30, 5, 3], [4, 20, 10, 6]]  # another expert the busiest
    path = _metrics(tmp_path / "m.jsonl", [warm, warm, hot, other])
    rows = ((30.0, 5.0, 3.0, 2.0), (20.0, 10.0, 6.0, 4.0), (2.0, 30.0, 5.0, 3.0))
    assert measured_loads(path) == (*rows, (4.0, 20.0, 10.0, 6.0))
    # each step's busiest expert is priced (0.75 and 0.5 of a layer's rows), not the sum's
    model = dataclasses.replace(MODEL, measured_loads=measured_loads(path))
    assert max(expert_shares(model, 4)) == pytest.approx((0.75 + 0.5 + 0.75 + 0.5) / 4)
    short = measured_loads(_metrics(tmp_path / "short.jsonl", [hot]))
    assert short == ((30.0, 5.0, 3.0, 2.0), (20.0, 10.0, 6.0, 4.0))
    (tmp_path / "none.jsonl").write_text('{"kind": "eval"}\n')
    with pytest.raises(ValueError, match="no train record with expert_load"):
        measured_loads(tmp_path / "none.jsonl")
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not JSON"):
        measured_loads(tmp_path / "bad.jsonl")
    ragged = _metrics(tmp_path / "ragged.jsonl", [hot, [[1, 2, 3, 4]]])
    with pytest.raises(ValueError, match="expert_load records of different shapes"):
        measured_loads(ragged)


def test_measured_loads_are_the_expert_shares_and_capacity_caps_them():
    model = dataclasses.replace(MODEL, measured_loads=[6, 2, 1, 1])  # a list, as from JSON
    assert model.measured_loads == ((6.0, 2.0, 1.0, 1.0),)  # one row: every layer
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
    with pytest.raises(ValueError, match=r"model.measured_loads\[1\] has 3 entries"):
        dataclasses.replace(MODEL, measured_loads=[[1, 1, 1, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match=r"model.measured_loads\[1\] must be a list"):
        dataclasses.replace(MODEL, measured_loads=[[1, 1, 1, 1], 1])


def test_each_layers_busiest_rank_counts_not_their_sum():
    """Layer 1's hot expert is on rank 0, layer 2's on rank 1: summed as placed the two ranks
    would look half as hot; the step waits for each layer's busiest rank."""
    model = dataclasses.replace(MODEL, measured_loads=[[7, 1, 1, 1], [1, 1, 1, 7]])
    assert expert_shares(model) == pytest.approx([0.4, 0.1, 0.1, 0.4])  # placement kept
    assert rank_shares(model, 2) == pytest.approx([0.8, 0.2])  # the busiest rank first
    assert expert_shares(model, 4) == pytest.approx([0.7, 0.1, 0.1, 0.1])
    summed = dataclasses.replace(MODEL, measured_loads=[8, 2, 2, 8])
    assert rank_shares(summed, 2) == pytest.approx([0.5, 0.5])
    with pytest.raises(ValueError, match=r"groups \(3\) must divide model.experts \(4\)"):
        expert_shares(model, 3)


def test_simulate_and_plan_take_a_runs_loads(tmp_path, capsys):
    hot = [[400, 20, 20, 40], [300, 60, 60, 60]] * 2  # two blocks; the first expert's rank is hot
    path = _metrics(tmp_path / "metrics.jsonl", [hot, hot, hot])
    base = ["simulate", "--cluster", str(FLOWMOE_2RANK), "--model", str(TINY), "--json"]
    base += ["--flops-per-s", "1e10", "--strategy", "dropless", "--schedule", "vanilla"]

    def step_ms(*extra: str) -> float:
        assert main([*base, *extra]) == 0
        result = json.loads(capsys.readouterr().out)
        return (result[0] if isinstance(result, list) else result)["iteration_ms"]

    flat = _metrics(tmp_path / "flat.jsonl", [[[1, 1, 1, 1]] * 2] * 3)
    uniform = step_ms("--loads", str(flat))
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


def _profile_with(tmp_path: Path, loads: list[list[float]]) -> Path:
    routing = RoutingLoads(loads=loads, source="test router")
    tmp_path.mkdir(exist_ok=True)
    return Profile(flops_per_s=1e10, routing=routing).save(tmp_path / "p.json")


def test_the_profiles_routing_is_priced_unless_loads_are_given(tmp_path, capsys):
    base = ["simulate", "--cluster", str(FLOWMOE_2RANK), "--model", str(TINY), "--json"]
    base += ["--strategy", "dropless", "--schedule", "vanilla"]

    def step_ms(*extra: str) -> tuple[float, str]:
        assert main([*base, *extra]) == 0
        out = capsys.readouterr()
        result = json.loads(out.out)
        return (result[0] if isinstance(result, list) else result)["iteration_ms"], out.err

    uniform, _ = step_ms("--profile", str(_profile_with(tmp_path / "u", [[1, 1, 1, 1]] * 2)))
    hot = _profile_with(tmp_path / "h", [[40, 2, 2, 4], [3, 6, 30, 6]])
    skewed, said = step_ms("--profile", str(hot))
    assert skewed > uniform * 1.2
    assert "routing from the profile (test router): the busiest expert 3.33x, 2.67x" in said
    run = _metrics(tmp_path / "metrics.jsonl", [[[1, 1, 1, 1]] * 2] * 3)  # --loads wins
    assert step_ms("--profile", str(hot), "--loads", str(run))[0] == pytest.approx(uniform)
    five = _profile_with(tmp_path / "f", [[1, 1, 1, 1, 9]])
    other, said = step_ms("--profile", str(five))  # not used: the routing prior instead
    assert other == pytest.approx(step_ms("--flops-per-s", "1e10")[0])
    assert "has 5 experts, the model 4: not used" in said and "routing prior" in said


def test_profile_routing_round_trips_and_is_checked(tmp_path):
    path = _profile_with(tmp_path, [[3, 1, 0, 0], [1, 1, 1, 1]])
    routing = Profile.load(path).routing
    assert routing == RoutingLoads(loads=((3, 1, 0, 0), (1, 1, 1, 1)), source="test router")
    for bad, rule in (
        ([[1, 1], [1]], "one non-empty row per MoE layer, all as long"),
        ([], "one non-empty row per MoE layer"),
        ([[0, 0]], r"loads\[0\] must not be all zero"),
        ([[1, -1]], r"loads\[0\]\[1\]"),
    ):
        with pytest.raises(ValueError, match=rule):
            RoutingLoads(loads=bad, source="x")
    data = json.loads(path.read_text())
    data["routing"] = [1, 2]
    with pytest.raises(ValueError, match=r"profile.routing must be an object"):
        Profile.from_dict(data)


def test_calibrate_runs_the_jobs_router_on_its_data(tmp_path, capsys):
    """A real one-process run of the tiny config (seconds): the loads of its steps 3-4, one row
    per step and MoE layer, in the profile; the run's own output is held back. A bad step count is
    refused before anything is measured."""
    out = tmp_path / "p.json"
    argv = ["calibrate", "--model", str(TINY), "--out", str(out), "--size", "64"]
    assert main([*argv, "--routing-steps", "4"]) == 0
    said = capsys.readouterr().out
    routing = Profile.load(out).routing
    assert routing is not None and len(routing.loads) == 2 * 2 and len(routing.loads[0]) == 4
    # no --cluster: one rank's batch, 8 sequences x 64 tokens; top-2 per step and layer
    tokens = 8 * 64
    assert all(sum(row) == tokens * 2 for row in routing.loads)
    assert f"steps 3-4 of a one-process run at {tokens} tokens per step" in said
    assert "summary" not in said and "tok/s" not in said
    assert main([*argv, "--routing-steps", "2"]) == 2
    assert "--routing-steps (2) must be 0 or > 2" in capsys.readouterr().err
    assert main(["calibrate", "--out", str(out), "--routing-steps", "3"]) == 2
    assert "--routing-steps applies to --model only" in capsys.readouterr().err


def test_the_routing_run_is_the_job_on_one_process(tmp_path):
    """The job's model, seed and data, the world's global batch on one rank, dropless under
    vanilla, nothing of the job's own run options (emulation, plan, checkpoints, trace)."""
    from moesaic.train.config import TrainConfig
    from moesaic.train.routing_run import routing_config

    job = TrainConfig.from_dict(
        {
            "nproc": 4,
            "batch_size": 6,
            "steps": 600,
            "seed": 7,
            "schedule": "flowmoe",
            "pipeline_degree": 2,
            "ckpt_every": 50,
            "trace": str(tmp_path / "t.json"),
            "model": {
                "d_model": 32,
                "n_heads": 2,
                "moe": {"num_experts": 8, "ffn_hidden_size": 64, "capacity_factor": 1.25},
            },
        }
    )
    run = routing_config(job, world=4, steps=8, run_dir=tmp_path / "r")
    assert (run.nproc, run.ep, run.batch_size, run.steps) == (1, 1, 24, 8)
    assert (run.schedule, run.ckpt_every, run.trace, run.seed) == ("vanilla", 0, None, 7)
    assert run.model.moe.dispatcher == "dropless" and run.model.moe.capacity_factor is None
    assert run.model.d_model == 32 and run.model.moe.num_experts == 8
    assert run.run_dir == str(tmp_path / "r")


def test_many_rows_are_described_by_their_range():
    from moesaic.planning.loads import describe_loads

    assert describe_loads([[3, 1, 1, 1], [1, 2, 1, 1]]) == "2.00x, 1.60x the mean"
    rows = [[3, 1, 1, 1]] * 3 + [[1, 2, 1, 1]] * 3
    assert describe_loads(rows) == "1.60-2.00x the mean (median 2.00x over 6 rows: steps x layers)"
