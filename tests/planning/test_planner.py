"""The planner (issue 24, items 4 and 6): every runnable strategy x schedule x knobs priced by the
simulator and ranked; each entry is what ``simulate`` gives for its options and what training
accepts; what cannot run is said; the 1,000-DC case costs as many simulations as a 2-rank one."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from pathlib import Path

import pytest

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.planning.planner import (
    DOMAIN_CANDIDATES,
    MIN_AR_CHUNK_BYTES,
    PIPELINE_DEGREES,
    SP_DIVISORS,
    plan_runs,
)
from moesaic.sim.hybrid import plan_domains_fast
from moesaic.sim.hybrid_costmodel import domain_size_choices
from moesaic.sim.model import ModelSpec
from moesaic.sim.profile import Profile
from moesaic.sim.simulate import SimOptions, link_model, simulate
from moesaic.sim.steptail import control_bytes, control_s
from moesaic.strategies.registry import check_supported
from moesaic.train.model_files import load_model_spec

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = ROOT / "examples" / "clusters"
MODELS = ROOT / "examples" / "models"
# 2 x 2 ranks: every strategy runs, hybrid has 4 domain tuples (3 priced)
SMALL = ClusterSpec.from_toml(CLUSTERS / "2dc_2node_small.toml")
MODEL = ModelSpec(layers=2, batch=4, seq_len=32, hidden=64, ffn_hidden=128, experts=4, top_k=2)
PROFILE = Profile(flops_per_s=2e10)


def _dcs(n: int) -> ClusterSpec:
    """n datacenters x 8 ranks (benchmarks/sim_scale.py's cluster)."""
    dc = Level(name="datacenter", size=n, bandwidth_gbps=10.0, latency_ms=10.0)
    rank = Level(name="rank", size=8, bandwidth_gbps=400.0, latency_ms=0.01)
    return ClusterSpec(name=f"{n}dc", levels=(dc, rank))


@pytest.fixture(scope="module")
def small_plan():
    return plan_runs(SMALL, MODEL, PROFILE, compression_ratios=(1.0, 4.0))


def test_ranked_fastest_first_and_runnable(small_plan):
    """Sorted; each entry is a pair training supports, with the knobs it accepts."""
    ranked = small_plan.ranked
    # sorted; equal to 9 digits is a tie, which goes to the simpler (earlier) combination
    # those with a caveat last (taskflow without its CPU figures in PROFILE), each part sorted
    assert [c.caveat is not None for c in ranked] == sorted(c.caveat is not None for c in ranked)
    # the leading tie (sim.uncertainty) in the tie rule's order, tests/sim/test_uncertainty.py
    ranked = [c for c in ranked if not c.tie]
    pairs = [
        (a, b) for a, b in itertools.pairwise(ranked) if (a.caveat is None) == (b.caveat is None)
    ]
    assert all(a.predicted_ms <= b.predicted_ms * (1 + 1e-9) for a, b in pairs)
    assert small_plan.skipped == []
    for c in ranked:
        check_supported(c.strategy, schedule=c.schedule)  # raises if it cannot run
        R = c.options["pipeline_degree"]
        assert R == 1 if c.schedule == "vanilla" else R in PIPELINE_DEGREES and MODEL.batch % R == 0
        assert ("ar_chunk" in c.options) == (c.schedule == "flowmoe")
        assert c.options.get("ar_chunk", MIN_AR_CHUNK_BYTES) >= MIN_AR_CHUNK_BYTES
        assert ("domain_sizes" in c.options) == (c.strategy == "hybrid")
        if c.strategy == "hybrid":
            ds = c.options["domain_sizes"]
            assert all(lv.size % s == 0 for s, lv in zip(ds, SMALL.levels, strict=True))
        assert c.bound_ms == pytest.approx(max(c.compute_ms, c.comm_ms))
        assert c.bound_ms <= c.predicted_ms * (1 + 1e-9)


def test_sp_floor_is_trainings():
    """The planner's least Sp is the one ``moesaic train`` accepts (a copy: sim/ may not import
    train/)."""
    from moesaic.train.schedule_options import MIN_AR_CHUNK_BYTES as TRAIN_MIN

    assert MIN_AR_CHUNK_BYTES == TRAIN_MIN


def test_every_combination_is_enumerated(small_plan):
    """The count is the stated cross product: per non-taskflow pair R values x Sp values (flowmoe)
    x (hybrid) compression ratios x DOMAIN_CANDIDATES tuples; taskflow's two plan orders."""
    Rs = [r for r in PIPELINE_DEGREES if MODEL.batch % r == 0]
    per_strategy = 1 + len(Rs) + len(Rs) * len(SP_DIVISORS)
    hybrid = 2 * min(DOMAIN_CANDIDATES, len(domain_size_choices(SMALL)))
    expected = 2 * per_strategy + hybrid * per_strategy + 2
    assert len(small_plan.ranked) == expected
    keys = [_key(c) for c in small_plan.ranked]
    assert len(set(keys)) == len(keys)
    assert {c.strategy for c in small_plan.ranked} == {"dropless", "padded", "hybrid", "taskflow"}


def _key(c) -> tuple[str, str, str]:
    """A candidate's identity: its pair and its options."""
    return c.strategy, c.schedule, repr(sorted(c.options.items()))


def _sim_options(c) -> SimOptions:
    """The simulator's options of a plan entry (its knobs; hybrid's gathers prefetched)."""
    o = c.options
    return SimOptions(
        degree=o["pipeline_degree"],
        sp_bytes=o.get("ar_chunk"),
        domain_sizes=tuple(o["domain_sizes"]) if "domain_sizes" in o else None,
        compression_ratio=o.get("compression_ratio", 1.0),
        prefetch=c.strategy == "hybrid",
        taskflow_pipeline=o.get("pipeline", False),
    )


@pytest.mark.parametrize("index", [0, 1, 5, 17, -1])
def test_entry_is_what_simulate_gives(small_plan, index):
    """The planner's number for an entry equals ``simulate`` run directly with its options."""
    c = small_plan.ranked[index]
    r = simulate(SMALL, MODEL, c.strategy, PROFILE, _sim_options(c), schedule=c.schedule)
    assert c.predicted_ms == pytest.approx(r.iteration_s * 1e3, rel=1e-12)
    assert c.bound_ms == pytest.approx(r.bound_s * 1e3, rel=1e-12)


def test_hybrid_vanilla_includes_the_gradient_all_reduce(small_plan):
    """HybridEP's benchmark step (``hybrid_step="benchmark"``) has no data-parallel all-reduce;
    hybrid+vanilla as trained (the simulator's default, what the planner ranks) has one
    (``AR1``) on top of the same gathers and exchanges: the block pipeline at R = 1, whose
    control collective (``moesaic.sim.steptail``) is vanilla's blocking call after ``AR1``
    where moe-only's travels beside it."""
    c = next(c for c in small_plan.ranked if c.name == "hybrid+vanilla")
    ds = tuple(c.options["domain_sizes"])
    cr = c.options["compression_ratio"]
    opts = SimOptions(domain_sizes=ds, prefetch=True, compression_ratio=cr)
    bench_opts = dataclasses.replace(opts, hybrid_step="benchmark")
    bench = simulate(SMALL, MODEL, "hybrid", PROFILE, bench_opts)
    assert not [s for s in bench.spans if s.resource == "allreduce"]
    step = simulate(SMALL, MODEL, "hybrid", PROFILE, opts)
    pipeline = simulate(
        SMALL, MODEL, "hybrid", PROFILE, dataclasses.replace(opts, degree=1), schedule="moe-only"
    )
    link = link_model(SMALL, PROFILE)
    checks = control_s(link, control_bytes(MODEL.layers, MODEL.experts))
    assert step.iteration_s == pytest.approx(pipeline.iteration_s + checks, rel=1e-12)
    reduces = [s for s in step.spans if s.resource == "allreduce"]
    assert [s.name for s in reduces] == ["AR1", "norm"] and reduces[0].duration > 0
    assert c.predicted_ms == pytest.approx(step.iteration_s * 1e3, rel=1e-12)


def test_domain_shortlist_starts_with_the_fast_planners_pick():
    """The first tuple priced for hybrid is plan_domains_fast's choice (the same rule)."""
    plan = plan_runs(SMALL, MODEL, PROFILE, strategies=("hybrid",), schedules=("vanilla",))
    link = link_model(SMALL, PROFILE)
    chosen, _ = plan_domains_fast(link, MODEL, PROFILE.flops_per_s, prefetch=True)
    priced = [tuple(c.options["domain_sizes"]) for c in plan.ranked]
    assert len(priced) == min(DOMAIN_CANDIDATES, len(domain_size_choices(SMALL)))
    assert chosen.domain_sizes in priced


def test_reason_names_the_pick_and_the_margin(small_plan):
    best = small_plan.chosen
    reason = small_plan.reason
    assert reason.startswith(f"{best.name} ({best.knobs()}) predicted")
    other = next(c for c in small_plan.ranked if c.strategy != best.strategy)
    ratio = other.predicted_ms / best.predicted_ms
    assert f"{ratio:.3f}x faster than the best of another strategy, {other.name}" in reason


def test_what_cannot_run_is_said():
    """A world beyond taskflow's simulated size, and a batch no R divides, are skipped with why;
    a layer-only model leaves hybrid out."""
    odd = dataclasses.replace(MODEL, batch=3, experts=80)
    plan = plan_runs(_dcs(10), odd, PROFILE, strategies=("dropless", "taskflow"))
    skipped = dict(plan.skipped)
    assert skipped["taskflow+vanilla"] == "simulates worlds of <= 64 ranks, the cluster has 80"
    assert skipped["dropless+moe-only"] == "no R of [2, 4, 8] divides model.batch (3)"
    assert skipped["dropless+flowmoe"] == skipped["dropless+moe-only"]
    assert {c.name for c in plan.ranked} == {"dropless+vanilla"}
    layer = dataclasses.replace(MODEL, layer_only=True)
    plan = plan_runs(SMALL, layer, PROFILE, strategies=("hybrid", "dropless"))
    assert [name for name, _ in plan.skipped] == [
        "hybrid+vanilla",
        "hybrid+moe-only",
        "hybrid+flowmoe",
    ]
    assert all("model.layer_only" in why for _, why in plan.skipped)
    assert {c.strategy for c in plan.ranked} == {"dropless"}


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"degrees": ()}, ["degrees", "empty"]),
        ({"degrees": (0,)}, ["degrees[0]"]),
        ({"compression_ratios": (0.5,)}, ["compression_ratios[0]"]),
        ({"sp_divisors": (0,)}, ["sp_divisors[0]"]),
        ({"schedules": ("pipelined",)}, ["schedules[0]", "'pipelined'"]),
        ({"strategies": ("nope",)}, ["'nope'"]),
        ({"domain_candidates": 0}, ["domain_candidates"]),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, words):
    with pytest.raises(ValueError) as exc:
        plan_runs(SMALL, MODEL, PROFILE, **kwargs)
    for word in words:
        assert word in str(exc.value)


def test_experts_must_fit_the_world():
    with pytest.raises(ValueError, match=r"model.experts \(6\).*world_size \(4\)"):
        plan_runs(SMALL, dataclasses.replace(MODEL, experts=6), PROFILE)


def test_1000_datacenters_cost_the_simulations_of_10():
    """Rank symmetry: planning 8,000 ranks runs exactly as many (one-rank) simulations as
    planning 80, and the example's plan returns in about a second (the bound is a guard
    against an explosion on a loaded machine, not a benchmark)."""
    model = load_model_spec(MODELS / "hybridep_1000dc.toml")
    spec = ClusterSpec.from_toml(CLUSTERS / "hybridep_1000dc.toml")
    assert spec.world_size == 8000 and model.experts == 8000
    profile = Profile(flops_per_s=1e14)
    t0 = time.perf_counter()
    big = plan_runs(spec, model, profile)
    wall = time.perf_counter() - t0
    small = plan_runs(_dcs(10), dataclasses.replace(model, experts=80), profile)
    assert big.simulations == small.simulations
    assert len(big.ranked) == len(small.ranked)
    Rs = [r for r in PIPELINE_DEGREES if model.batch % r == 0]
    per_pair = 1 + len(Rs) + len(Rs) * (1 + len(SP_DIVISORS))  # flowmoe: one run finds G
    assert big.simulations == (2 + DOMAIN_CANDIDATES) * per_pair
    why = "simulates worlds of <= 64 ranks, the cluster has 8000"
    assert dict(big.skipped) == {"taskflow+vanilla": why}
    assert wall < 20, f"planning 8,000 ranks took {wall:.1f} s"
    assert math.isfinite(big.chosen.predicted_ms)


def test_taskflow_without_its_cpu_figures_ranks_last_with_a_caveat(small_plan):
    """A profile without taskflow's CPU figures prices its host-thread tiles at zero (42-75%
    under on the unseen configurations): those entries carry a caveat and rank after every
    other combination; with the figures they rank by their prediction, no caveat."""
    import dataclasses

    flagged = [c for c in small_plan.ranked if c.caveat]
    assert flagged and {c.strategy for c in flagged} == {"taskflow"}
    assert small_plan.ranked[-len(flagged) :] == flagged
    assert "tile_cpu_s" in flagged[0].to_dict()["caveat"]
    measured = dataclasses.replace(PROFILE, tile_cpu_s=1e-4, tile_elem_cpu_s=1e-9)
    plan = plan_runs(SMALL, MODEL, measured, strategies=("dropless", "taskflow"))
    assert not [c for c in plan.ranked if c.caveat]


def test_capacity_factors_price_every_pair_again_at_each_capacity(small_plan):
    """Allowed capacity factors add every pair again, priced on the model with that capacity
    (what ``simulate`` gives for it) and carrying the option; the model's own capacity adds
    nothing; a pick that drops says so and by how much it beats the best that does not."""
    plan = plan_runs(SMALL, MODEL, PROFILE, compression_ratios=(1.0, 4.0), capacity_factors=(1.25,))
    own = [c for c in plan.ranked if "capacity_factor" not in c.options]
    capped = [c for c in plan.ranked if "capacity_factor" in c.options]
    assert len(own) == len(capped) == len(small_plan.ranked)
    assert {c.options["capacity_factor"] for c in capped} == {1.25}
    assert plan.simulations == 2 * small_plan.simulations
    assert sorted(map(_key, own)) == sorted(map(_key, small_plan.ranked))
    model = dataclasses.replace(MODEL, capacity_factor=1.25)
    for c in (capped[0], capped[-1], next(c for c in capped if c.strategy == "padded")):
        r = simulate(SMALL, model, c.strategy, PROFILE, _sim_options(c), schedule=c.schedule)
        assert c.predicted_ms == pytest.approx(r.iteration_s * 1e3, rel=1e-12)
    # padded pads every expert to the largest load without a capacity, to 1.25x the mean with
    padded = {
        "capacity_factor" in c.options: c.predicted_ms
        for c in plan.ranked
        if c.name == "padded+vanilla"
    }
    assert padded[True] != padded[False]
    same = plan_runs(SMALL, model, PROFILE, strategies=("padded",), capacity_factors=(1.25,))
    assert not [c for c in same.ranked if "capacity_factor" in c.options]
    if "capacity_factor" in plan.chosen.options:
        assert "drops the assignments past capacity factor 1.25" in plan.reason
        assert f"best at the model's own capacity, {own[0].name}" in plan.reason
    with pytest.raises(ValueError, match=r"capacity_factors\[1\]"):
        plan_runs(SMALL, MODEL, PROFILE, capacity_factors=(1.0, 0.0))


def test_ep_below_the_world_is_priced_as_replicas():
    """``ep_sizes``: each combination the simulator prices with replicas of the unsharded model
    (the gradients all-reduced after the backward) priced again at EP 2 of the 4 ranks, its
    entry what ``simulate`` gives with ``dp_replicate`` 2; the others are left out."""
    plan = plan_runs(SMALL, MODEL, PROFILE, ep_sizes=(2,))
    replicas = [c for c in plan.ranked if "ep" in c.options]
    names = {c.name for c in replicas}
    assert names == {f"{s}+{t}" for s in ("dropless", "padded") for t in ("vanilla", "moe-only")}
    skipped = dict(plan.skipped)  # the others, with the simulator's reason
    assert {"hybrid+vanilla at EP 2", "dropless+flowmoe at EP 2"} <= set(skipped)
    assert "taskflow pricing runs EP = world" in skipped["taskflow+vanilla at EP 2"]
    for c in replicas:
        assert c.options["ep"] == 2 and "EP=2" in c.knobs()
        opts = SimOptions(degree=c.options["pipeline_degree"], dp_replicate=2)
        r = simulate(SMALL, MODEL, c.strategy, PROFILE, opts, schedule=c.schedule)
        assert c.predicted_ms == pytest.approx(r.iteration_s * 1e3)
    # two replicas across the slow datacenter link: the all-to-alls stay inside one DC
    at_world = {(c.name, c.knobs()): c for c in plan.ranked if "ep" not in c.options}
    for c in replicas:
        twin = at_world[(c.name, c.knobs().replace(" EP=2", ""))]
        assert c.predicted_ms != pytest.approx(twin.predicted_ms)


def test_fewer_experts_than_ranks_are_planned_below_the_world():
    """2 experts on 4 ranks: no EP = the world (skipped with the reason), EP 1 and 2 priced as
    replicas, each entry what ``simulate`` gives; without ``ep_sizes`` one line names it."""
    two = dataclasses.replace(MODEL, experts=2)
    plan = plan_runs(SMALL, two, PROFILE, ep_sizes=(1, 2))
    assert plan.ranked and all(c.options["ep"] in (1, 2) for c in plan.ranked)
    assert {c.options["ep"] for c in plan.ranked} == {1, 2}
    assert "is not a multiple of the world size (4)" in dict(plan.skipped)["EP 4"]
    for c in plan.ranked[:4]:
        opts = SimOptions(degree=c.options["pipeline_degree"], dp_replicate=4 // c.options["ep"])
        r = simulate(SMALL, two, c.strategy, PROFILE, opts, schedule=c.schedule)
        assert c.predicted_ms == pytest.approx(r.iteration_s * 1e3)
    with pytest.raises(ValueError, match=r"model.experts \(2\) must be a multiple .* ep_sizes"):
        plan_runs(SMALL, two, PROFILE)


@pytest.mark.parametrize("ep", [4, 3, 0])
def test_ep_sizes_must_divide_the_world_below_it(ep):
    with pytest.raises(ValueError, match=r"ep_sizes\[0\]"):
        plan_runs(SMALL, MODEL, PROFILE, ep_sizes=(ep,))
