"""Strategy and schedule as two axes (issue 22, item 5): the API and ``moesaic simulate`` take
them apart, ``all`` enumerates every pair that can run, a pair that cannot (taskflow under a
pipelined schedule) is refused naming the parameter and the rule, and the old mixed names
still work with a deprecation note."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import moesaic.strategy_table as strategy_table
from moesaic.cli import main
from moesaic.cluster.spec import ClusterSpec
from moesaic.schedule_table import schedule_names
from moesaic.sim.model import ModelSpec
from moesaic.sim.profile import Profile
from moesaic.sim.runs import STRATEGIES, UNPIPELINED_ONLY, Run, runs
from moesaic.sim.simulate import SimOptions, simulate

SCHEDULES = schedule_names()
ROOT = Path(__file__).resolve().parents[2]
FLOWMOE_CLUSTER = str(ROOT / "examples/clusters/flowmoe_2rank.toml")
FLOWMOE_MODEL = str(ROOT / "examples/models/flowmoe_small.toml")
SPEC = ClusterSpec.from_toml(FLOWMOE_CLUSTER)
MODEL = ModelSpec.from_toml(FLOWMOE_MODEL)
PROFILE = Profile(flops_per_s=1e11)
TASKFLOW_RULE = "taskflow runs no pipelined schedule: its dispatch, GEMMs and combine are fused"


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    args = ("--routing", "uniform", *args)  # compared with simulate() on the model as given
    rc = main(["simulate", "--cluster", FLOWMOE_CLUSTER, "--model", FLOWMOE_MODEL, *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_all_is_every_valid_pair():
    every = runs("all", "all")
    assert len(every) == len(set(every)) == (len(STRATEGIES) - 1) * len(SCHEDULES) + 1
    assert [r for r in every if r.strategy == "taskflow"] == [Run("taskflow", "vanilla")]
    assert runs("taskflow", "all") == [Run("taskflow", "vanilla")]
    assert runs("hybrid", "all") == [Run("hybrid", s) for s in SCHEDULES]
    assert runs("all", "flowmoe") == [Run(n, "flowmoe") for n in STRATEGIES if n != "taskflow"]
    assert Run("hybrid", "flowmoe") in every and Run("hybrid", "flowmoe").name == "hybrid+flowmoe"


@pytest.mark.parametrize("run", runs("all", "all"), ids=lambda r: r.name)
def test_api_takes_strategy_and_schedule_apart(run):
    r = simulate(SPEC, MODEL, run.strategy, PROFILE, schedule=run.schedule)
    assert (r.strategy, r.schedule, r.name) == (*run, run.name)
    summary = r.summary()
    assert (summary["strategy"], summary["schedule"], summary["name"]) == (*run, run.name)
    if run.strategy != "taskflow" and not (run.strategy == "hybrid" and run.schedule == "vanilla"):
        # the block pipeline: vanilla is one chunk, the others --degree's
        assert summary["degree"] == (1 if run.schedule == "vanilla" else 2)
    names = {s.name for s in r.spans}
    assert ("AR2" in names) == (run.schedule == "flowmoe")  # Sp chunks only under flowmoe


def test_the_schedule_is_the_step_the_strategy_the_exchange():
    """The same strategy under each schedule: three different steps; the same schedule under
    each strategy: the same compute stages, a different exchange (skewed routing, so padded
    sends more than dropless)."""
    times = {s: simulate(SPEC, MODEL, "dropless", PROFILE, schedule=s) for s in SCHEDULES}
    assert len({r.iteration_s for r in times.values()}) == len(SCHEDULES)
    model = dataclasses.replace(MODEL, routing_skew=1.0)
    d = simulate(SPEC, model, "dropless", PROFILE, schedule="flowmoe")
    p = simulate(SPEC, model, "padded", PROFILE, schedule="flowmoe")
    assert {s.name for s in d.spans} == {s.name for s in p.spans}
    a2a = {r.strategy: sum(s.duration for s in r.spans if s.resource == "a2a") for r in (d, p)}
    assert a2a["padded"] > a2a["dropless"]


def test_taskflow_under_a_pipelined_schedule_is_refused(capsys):
    for schedule in ("moe-only", "flowmoe"):
        with pytest.raises(ValueError, match=rf"schedule \('{schedule}'\)") as exc:
            simulate(SPEC, MODEL, "taskflow", PROFILE, schedule=schedule)
        assert TASKFLOW_RULE in str(exc.value)
        rc, out, err = _cli(capsys, "--strategy", "taskflow", "--schedule", schedule)
        assert rc == 2 and out == ""
        assert f"--strategy taskflow --schedule {schedule}" in err and TASKFLOW_RULE in err
    assert set(UNPIPELINED_ONLY) == {"taskflow"}


def test_unknown_and_unpriced_names_are_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"strategy \('nope'\) must be one of 'dropless'"):
        simulate(SPEC, MODEL, "nope", PROFILE)
    with pytest.raises(ValueError, match=r"schedule \('pipe'\) must be one of 'vanilla'"):
        simulate(SPEC, MODEL, "dropless", PROFILE, schedule="pipe")
    # registered for training but without a cost model here
    monkeypatch.setitem(strategy_table._TARGETS, "toy", "toy_module:Toy")
    with pytest.raises(ValueError, match=r"'toy' is registered .* no cost model for it"):
        simulate(SPEC, MODEL, "toy", PROFILE)


def test_cli_takes_strategy_and_schedule_apart(capsys):
    rc, out, err = _cli(capsys, "--strategy", "hybrid", "--schedule", "flowmoe", "--json")
    one = json.loads(out)
    assert rc == 0 and err == ""
    assert (one["name"], one["degree"], one["domain_sizes"]) == ("hybrid+flowmoe", 2, [1])
    # a named strategy runs vanilla unless told; --schedule all runs every schedule it can
    rc, out, _ = _cli(capsys, "--strategy", "padded", "--json")
    assert json.loads(out)["name"] == "padded+vanilla"
    rc, out, _ = _cli(capsys, "--strategy", "taskflow", "--schedule", "all", "--json")
    assert json.loads(out)["name"] == "taskflow+vanilla"
    rc, out, _ = _cli(capsys, "--schedule", "moe-only", "--json")
    names = [r["name"] for r in json.loads(out)]
    assert names == ["dropless+moe-only", "padded+moe-only", "hybrid+moe-only"]
    rc, out, _ = _cli(capsys, "--strategy", "all", "--json")
    assert "hybrid+flowmoe" in [r["name"] for r in json.loads(out)]
    rc, _, err = _cli(capsys, "--strategy", "dropless", "--schedule", "pipelined")
    assert rc == 2 and "schedule ('pipelined') must be one of 'vanilla'" in err


@pytest.mark.parametrize(
    ("old", "strategy", "schedule", "options"),
    [
        ("vanilla", "dropless", "vanilla", {}),
        ("moe-only", "dropless", "moe-only", {}),
        ("flowmoe", "dropless", "flowmoe", {}),
        ("ep", "hybrid", "vanilla", {"domain_sizes": (1,)}),  # classic EP: domains of 1
    ],
)
def test_old_mixed_names_still_work(capsys, old, strategy, schedule, options):
    want = simulate(SPEC, MODEL, strategy, PROFILE, SimOptions(**options), schedule=schedule)
    with pytest.warns(DeprecationWarning, match=f"strategy '{old}' is deprecated"):
        got = simulate(SPEC, MODEL, old, PROFILE)
    assert (got.strategy, got.schedule, got.iteration_s) == (strategy, schedule, want.iteration_s)
    rc, out, err = _cli(capsys, "--strategy", old, "--json")
    assert rc == 0 and json.loads(out)["iteration_ms"] == pytest.approx(want.iteration_s * 1e3)
    domains = " --domains 1" if options else ""
    assert err == (
        f"moesaic simulate: --strategy {old} is deprecated (strategy and schedule are separate "
        f"options now): read as --strategy {strategy} --schedule {schedule}{domains}\n"
    )
    rc, _, err = _cli(capsys, "--strategy", old, "--schedule", "vanilla")
    assert rc == 2 and f"--strategy {old} is the old name of --strategy {strategy}" in err


def test_the_pairs_are_the_ones_training_runs():
    """The simulator is torch-free, so it cannot read the strategies' ``supports`` (their
    classes import torch): its rule must agree with theirs."""
    from moesaic.strategies.registry import get_strategy

    for name in STRATEGIES:
        supports = get_strategy(name).supports
        declared = [s for s in SCHEDULES if supports.runs_under(s)]
        assert [r.schedule for r in runs(name, "all")] == declared, name
