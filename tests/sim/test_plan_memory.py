"""``moesaic plan``'s memory (``planning.plan_memory``): the predicted peak per combination,
``--memory-per-rank`` dropping what does not fit, the least sharding that fits, and the plan
entry's ``dp_shard`` applied by ``moesaic train --plan``."""

from __future__ import annotations

import pytest

from moesaic.planning.plan_memory import fit_memory, memory_lines, sharding_choices
from moesaic.planning.planner import Candidate, Plan
from moesaic.sim.memory import predict_memory
from moesaic.sim.model import ModelSpec, model_config_of
from moesaic.train.plan import plan_settings

MODEL = ModelSpec(
    layers=2, batch=1, seq_len=64, hidden=256, ffn_hidden=64, experts=4, top_k=2, heads=4
)
WORLD = 2


def _cand(strategy: str, schedule: str, ms: float, **options) -> Candidate:
    return Candidate(
        strategy=strategy,
        schedule=schedule,
        options={"pipeline_degree": 1, **options},
        predicted_ms=ms,
        bound_ms=ms,
        compute_ms=ms,
        comm_ms=0.0,
    )


PLAN = Plan(
    ranked=[
        _cand("dropless", "flowmoe", 1.0, ar_chunk=65536),  # runs unsharded only
        _cand("hybrid", "vanilla", 2.0, domain_sizes=[2]),  # unsharded only, gathers experts
        _cand("dropless", "vanilla", 3.0),
        _cand("padded", "moe-only", 4.0),  # pipelined: no prefetch
    ]
)


def _peak(strategy, schedule, dp_shard, domain_size=1):
    cfg = model_config_of(MODEL)
    return predict_memory(
        cfg,
        batch_size=MODEL.batch,
        ep=WORLD,
        dp_shard=dp_shard,
        prefetch=schedule != "moe-only",
        domain_size=domain_size,
    ).peak


def test_sharding_choices():
    assert sharding_choices(2, 2) == [None, 1]
    assert sharding_choices(8, 2) == [None, 1, 2, 4]


def test_no_budget_keeps_every_combination_unsharded():
    fit = fit_memory(PLAN, MODEL, WORLD, None)
    assert [c.name for c in fit.plan.ranked] == [c.name for c in PLAN.ranked]
    assert all("dp_shard" not in c.options for c in fit.plan.ranked)
    assert fit.peaks[1] == _peak("hybrid", "vanilla", None, domain_size=2)
    assert fit.peaks[1] > fit.peaks[2]  # hybrid's gathered experts
    assert fit.dropped == []


def test_budget_drops_and_shards():
    unsharded = _peak("dropless", "vanilla", None)
    sharded = _peak("dropless", "vanilla", 1)
    assert sharded < unsharded
    budget = (sharded + unsharded) / 2  # fits only sharded
    fit = fit_memory(PLAN, MODEL, WORLD, budget)
    kept = fit.plan.ranked
    assert [c.name for c in kept] == ["dropless+vanilla", "padded+moe-only"]
    assert [c.options["dp_shard"] for c in kept] == [1, 1]
    assert fit.peaks == [sharded, _peak("padded", "moe-only", 1)]
    assert len(fit.dropped) == 2
    assert fit.dropped[0].startswith("dropless+flowmoe (R=1 Sp=")
    assert "not sharded: schedule 'flowmoe' does not run with FSDP sharding" in fit.dropped[0]
    assert "strategy 'hybrid' does not run with FSDP sharding" in fit.dropped[1]
    lines = memory_lines(fit, budget)
    assert lines[0].startswith("memory   dropless+vanilla: predicted peak ")
    assert "--dp-shard 1" in lines[0]
    # the plan entry's dp_shard becomes the run's
    entry = {"strategy": "dropless", "schedule": "vanilla", "options": kept[0].options}
    assert plan_settings(entry)["dp_shard"] == 1


def test_nothing_fits_is_one_line():
    with pytest.raises(ValueError, match=r"^no combination fits --memory-per-rank 1000 bytes"):
        fit_memory(PLAN, MODEL, WORLD, 1000.0)
    with pytest.raises(ValueError, match=r"^memory_per_rank \(--memory-per-rank\) \(0\.0\)"):
        fit_memory(PLAN, MODEL, WORLD, 0.0)


def test_an_ep_entry_sets_the_runs_ep():
    entry = {"strategy": "dropless", "schedule": "vanilla", "options": {"ep": 2}}
    assert plan_settings(entry)["ep"] == 2
