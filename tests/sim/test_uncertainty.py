"""Ties called ties (issue 55 item 3): each prediction's range is its combination's error band
from the committed unseen rules, and ``plan`` marks the leading entries it cannot tell apart
and orders them by the stated tie rule."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

import pytest

from _scripts import load_benchmark
from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.planning.plan_memory import fit_memory
from moesaic.planning.planner import plan_runs
from moesaic.sim.model import ModelSpec
from moesaic.sim.profile import Profile
from moesaic.sim.uncertainty import (
    BANDS,
    DEFAULT_BAND,
    RULES,
    TIE_BAND,
    band,
    bands_from,
    combination_bands,
    prediction_range,
    tie_group,
)

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SMALL = ClusterSpec.from_toml(ROOT / "examples" / "clusters" / "2dc_2node_small.toml")
# 2 ranks on a fast link: compute-bound, every schedule close to the others
FAST = ClusterSpec(
    name="fast", levels=(Level(name="rank", size=2, bandwidth_gbps=400.0, latency_ms=0.001),)
)
MODEL = ModelSpec(layers=2, batch=4, seq_len=32, hidden=64, ffn_hidden=128, experts=4, top_k=2)


def test_the_bands_are_the_committed_rules_errors():
    data = [json.loads((RESULTS / f"sim_unseen{r}.json").read_text()) for r in RULES]
    got = bands_from(data)
    assert got["bands"] == BANDS
    assert got["default"] == DEFAULT_BAND
    assert got["tie_band"] == TIE_BAND


def test_a_band_is_the_wider_of_its_own_and_the_pooled_residuals():
    """The pooled residuals widen a combination whose own ratios are close together; one whose
    own spread is wider keeps it."""
    tight = [1.0 + 0.001 * i for i in range(20)]
    wide = [0.6 + 0.04 * i for i in range(20)]
    bands = combination_bands({("a", "x"): tight, ("b", "x"): wide})
    lo, mid, hi = bands[("a", "x")]
    assert lo < min(tight) and hi > max(tight) and mid == round(statistics.median(tight), 3)
    own = statistics.quantiles(wide, n=20, method="inclusive")
    assert bands[("b", "x")][0] == round(own[0], 3) and bands[("b", "x")][2] == round(own[-1], 3)


def test_the_committed_backtest_is_what_the_rules_give():
    """``sim_bands_backtest.json``: each rule from the 23rd judged by bands fitted on the rules
    before it only, recomputed from the committed results."""
    backtest = load_benchmark("sim_bands_backtest")
    committed = json.loads((RESULTS / "sim_bands_backtest.json").read_text())
    assert backtest.backtest() == committed
    assert backtest.CONSTRUCTIONS["committed"] is combination_bands


def test_range_is_the_band_around_the_point_or_the_priors_ends():
    lo, hi = band("padded", "flowmoe")
    assert prediction_range("padded", "flowmoe", 100.0) == pytest.approx((100 * lo, 100 * hi))
    assert prediction_range("padded", "flowmoe", 100.0, 90.0, 130.0) == pytest.approx(
        (90 * lo, 130 * hi)
    )
    assert band("someone-elses", "vanilla") == (DEFAULT_BAND[0], DEFAULT_BAND[2])


def test_tie_group_is_the_band_from_the_first():
    edge = 100.0 * math.exp(TIE_BAND)
    assert tie_group([100.0, 101.0, edge * 0.999, edge * 1.001]) == 3
    assert tie_group([100.0, 200.0]) == 1
    assert tie_group([]) == 0


def test_plan_marks_the_tie_and_orders_it_by_the_rule():
    plan = plan_runs(FAST, MODEL, Profile(flops_per_s=2e10))
    trusted = [c for c in plan.ranked if c.caveat is None]
    tied = [c for c in trusted if c.tie]
    assert tied == trusted[: len(tied)]  # the leading entries
    fastest = min(c.predicted_ms for c in trusted)
    assert len(tied) > 1  # compute-bound: the combinations are close, a tie to break
    assert all(c.predicted_ms <= fastest * math.exp(TIE_BAND) for c in tied)
    rest = trusted[len(tied) :]
    assert all(c.predicted_ms > fastest * math.exp(TIE_BAND) for c in rest)
    assert [c.predicted_ms for c in rest] == sorted(c.predicted_ms for c in rest)

    def key(c):
        R = c.options["pipeline_degree"]
        changed = "capacity_factor" in c.options
        knobs = (R > 1) + ("ar_chunk" in c.options)
        return (changed, knobs, R, c.peak_bytes or 0.0, c.predicted_ms)

    assert [key(c) for c in tied] == sorted(key(c) for c in tied)
    assert "a tie with" in plan.reason and plan.chosen is tied[0]
    for c in plan.ranked:
        lo, hi = c.range_ms
        assert lo <= c.predicted_ms <= hi
        assert c.to_dict()["range_ms"] == [lo, hi] and c.to_dict()["tie"] == c.tie


def test_a_tie_takes_the_smaller_memory_before_the_faster_prediction():
    """After the memory fit (``plan_memory``: every entry's predicted peak) the tied entries
    of one capacity, schedule and R go by the smaller peak: hybrid with experts gathered
    into domains of 2, predicted faster by less than the tie band, after dropless."""
    plan = plan_runs(FAST, MODEL, Profile(flops_per_s=2e10))
    fitted = fit_memory(plan, MODEL, FAST.world_size, None).plan
    ranked = fitted.ranked
    tied = [c for c in ranked if c.tie]
    assert all(c.peak_bytes is not None and c.peak_bytes > 0 for c in ranked)
    keys = [(("capacity_factor" in c.options), c.options["pipeline_degree"]) for c in tied]
    for a, b, ka, kb in zip(tied, tied[1:], keys, keys[1:]):
        if ka == kb and a.schedule == b.schedule:
            assert a.peak_bytes <= b.peak_bytes
    vanilla = [c for c in tied if c.schedule == "vanilla"]
    gathered = next(c for c in vanilla if c.options.get("domain_sizes") == [2])
    dropless = next(c for c in vanilla if c.strategy == "dropless")
    assert gathered.predicted_ms < dropless.predicted_ms  # faster, within the band
    assert gathered.peak_bytes > dropless.peak_bytes
    assert vanilla.index(dropless) < vanilla.index(gathered)
    assert "then the smaller memory" in fitted.reason


def test_a_tie_keeps_the_models_own_capacity():
    """A capacity factor the plan may set drops assignments the model keeps: within a tie the
    model as given goes first, even where the capped entry is predicted faster."""
    skewed = dataclasses.replace(MODEL, measured_loads=((1.6, 1.0, 1.0, 1.0),))
    plan = plan_runs(FAST, skewed, Profile(flops_per_s=2e10), capacity_factors=(1.0,))
    tied = [c for c in plan.ranked if c.tie]
    capped = [c for c in tied if "capacity_factor" in c.options]
    own = [c for c in tied if "capacity_factor" not in c.options]
    assert capped and own  # the case the rule decides
    assert min(c.predicted_ms for c in capped) < min(c.predicted_ms for c in own)
    assert tied[: len(own)] == own and plan.chosen is own[0]
    assert "the model's own capacity, then the simpler schedule" in plan.reason
    # a gain past the tie band is one the simulator tells apart: the capped entry is picked
    hot = dataclasses.replace(MODEL, measured_loads=((3.0, 1.0, 1.0, 1.0),))
    plan = plan_runs(FAST, hot, Profile(flops_per_s=2e10), capacity_factors=(1.0,))
    assert plan.chosen.options["capacity_factor"] == 1.0
    assert all("capacity_factor" in c.options for c in plan.ranked if c.tie)
