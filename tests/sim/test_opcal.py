"""Per-operation compute (``moesaic.sim.opcal``): the scaling rule, the profile's ``ops`` (round
trip, older profiles), the pricing of the pipelined tasks from it, and ``calibrate --model``."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from moesaic.cli import main
from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.measure.opmeasure import measure_ops
from moesaic.sim.collectives import LinkModel
from moesaic.sim.model import ModelSpec
from moesaic.sim.opcal import OPS, OpCal, OpFit, OpPrices, fit_line
from moesaic.sim.pipelined import Costs
from moesaic.sim.profile import Profile
from moesaic.sim.simulate import SimOptions, simulate
from moesaic.simtools.calibrate_cli import _measure_model

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MODEL = ModelSpec(
    name="m", layers=2, batch=8, seq_len=16, hidden=32, ffn_hidden=64, experts=4, top_k=2
)
_TINY = dict(
    name="tiny", layers=1, batch=2, seq_len=8, hidden=16, ffn_hidden=32, experts=2, top_k=1, heads=2
)
TINY_TOML = """[model]
name = "tiny"
layers = 1
batch = 2
seq_len = 8
hidden = 16
ffn_hidden = 32
experts = 2
top_k = 1
heads = 2
"""


def _cal(model: ModelSpec = MODEL, threads: int = 1) -> OpCal:
    """Distinct fits per piece and direction, so that a mix-up shows."""
    fwd = {
        k: OpFit(overhead_s=1e-3 * (i + 1), per_unit_s=1e-6 * (i + 1)) for i, k in enumerate(OPS)
    }
    bwd = {
        k: OpFit(overhead_s=3e-3 * (i + 1), per_unit_s=5e-6 * (i + 1)) for i, k in enumerate(OPS)
    }
    return OpCal(
        model=model,
        threads=threads,
        expert_count=2,
        tokens=(32, 128),
        fwd=fwd,
        bwd=bwd,
        optimizer=OpFit(overhead_s=2e-3, per_unit_s=1e-9),
    )


def _spec(world: int = 2) -> ClusterSpec:
    return ClusterSpec(levels=(Level(name="node", size=world, bandwidth_gbps=1.0, latency_ms=0.1),))


def test_fit_line_recovers_a_line_and_clamps_noise():
    fit = fit_line(100, 0.5 + 100 * 2e-3, 400, 0.5 + 400 * 2e-3)
    assert fit.overhead_s == pytest.approx(0.5) and fit.per_unit_s == pytest.approx(2e-3)
    assert fit.seconds(1000) == pytest.approx(2.5)
    # the larger size measured faster (noise): its mean as a fixed cost
    assert fit_line(1, 3.0, 2, 1.0) == OpFit(overhead_s=2.0, per_unit_s=0.0)
    # an intercept below 0: through the origin and the larger point
    fit = fit_line(1, 0.0, 2, 4.0)
    assert fit.overhead_s == 0.0 and fit.per_unit_s == pytest.approx(2.0)
    with pytest.raises(ValueError, match=r"n2 \(1\) must be > n1 \(2\)"):
        fit_line(2, 1.0, 1, 1.0)
    with pytest.raises(ValueError, match="overhead_s"):
        OpFit(overhead_s=-1.0, per_unit_s=0.0)


@pytest.mark.parametrize("strategy", ["dropless", "padded"])
def test_chunks_pay_the_fixed_cost_once_each(strategy):
    """The rule: a task of n tokens costs overhead + per_unit n, so R chunks cost R overheads
    plus the same per-unit time as one chunk; the backward uses its own fits."""
    profile = Profile(flops_per_s=1e12, ops=_cal())
    link = LinkModel(spec=_spec())
    one = Costs(MODEL, link, profile, 1, strategy=strategy)
    four = Costs(MODEL, link, profile, 4, strategy=strategy)
    fwd, bwd = profile.ops.fwd, profile.ops.bwd
    stage_overhead = fwd["attention"].overhead_s + fwd["moe_local"].overhead_s
    assert 4 * four.at_s - one.at_s == pytest.approx(3 * stage_overhead)
    assert 4 * four.e_s - one.e_s == pytest.approx(3 * fwd["experts"].overhead_s)
    assert 4 * four.head_s - one.head_s == pytest.approx(3 * fwd["head"].overhead_s)
    T = MODEL.tokens
    assert one.at_bwd_s == pytest.approx(bwd["attention"].seconds(T) + bwd["moe_local"].seconds(T))
    assert one.e_bwd_s != pytest.approx(2 * one.e_s)  # not "backward = 2 x forward"
    params_bytes = 4 * (
        2 * MODEL.replicated_params_per_block() + MODEL.outer_params() + 2 * 2 * 3 * 32 * 64
    )
    assert one.optimizer_s == pytest.approx(profile.ops.optimizer.seconds(params_bytes))
    assert one.notes == []


def test_flops_pricing_is_unchanged_without_ops():
    profile = Profile(flops_per_s=1e9, task_overhead_s=1e-4)
    c = Costs(MODEL, LinkModel(spec=_spec()), profile, 2)
    assert c.at_s == pytest.approx(MODEL.attention_flops(MODEL.tokens // 2) / 1e9 + 1e-4)
    assert (c.at_bwd_s, c.e_bwd_s, c.head_bwd_s) == (2 * c.at_s, 2 * c.e_s, 2 * c.head_s)


def test_another_model_is_extrapolated_by_the_flop_ratio_and_says_so():
    cal = _cal()
    wider = dataclasses.replace(MODEL, name="wide", hidden=64, ffn_hidden=256)
    prices = OpPrices(cal, wider)
    ratio = wider.expert_flops(1) / MODEL.expert_flops(1)
    assert prices.fwd["experts"].per_unit_s == pytest.approx(cal.fwd["experts"].per_unit_s * ratio)
    assert prices.fwd["experts"].overhead_s == cal.fwd["experts"].overhead_s
    assert prices.bwd["head"].per_unit_s == pytest.approx(2 * cal.bwd["head"].per_unit_s)
    (note,) = prices.notes
    assert "measured on model 'm', extrapolated to 'wide'" in note
    assert "hidden 32 vs 64" in note and "ffn_hidden 64 vs 256" in note
    # batch and layers are not a shape: nothing extrapolated
    assert OpPrices(cal, dataclasses.replace(MODEL, batch=2, layers=5)).notes == []
    sim = simulate(_spec(), wider, "dropless", Profile(flops_per_s=1e12, ops=cal))
    assert sim.details["compute_model"] == "ops" and sim.details["ops_model"] == "m"
    assert sim.details["extrapolated"] == prices.notes


def test_simulated_tasks_are_the_measured_ones():
    profile = Profile(flops_per_s=1e12, ops=_cal())
    sim = simulate(_spec(1), MODEL, "dropless", profile, SimOptions(degree=2), schedule="moe-only")
    prices = OpPrices(profile.ops, MODEL)
    spans = {(s.name, s.args.get("phase")): s.duration for s in sim.spans}
    T = MODEL.tokens // 2
    assert spans[("AT1.1", "fwd")] == pytest.approx(prices.stage_s(T))
    assert spans[("AT2.1", "bwd")] == pytest.approx(prices.stage_s(T, backward=True))
    rows = T * MODEL.top_k  # one rank: every routed row is its own
    assert spans[("E1.2", "bwd")] == pytest.approx(prices.expert_s(rows, backward=True))
    assert spans[("head2", "fwd")] == pytest.approx(prices.head_s(T))
    assert sim.details["compute_model"] == "ops" and "extrapolated" not in sim.details
    flops = simulate(_spec(1), MODEL, "dropless", Profile(flops_per_s=1e12))
    assert flops.details["compute_model"] == "flops"


def test_profile_round_trip_and_older_profiles(tmp_path):
    p = Profile(flops_per_s=1e10, ops=_cal(), comm_cpu_s=1e-4, comm_cpu_per_byte_s=2e-9)
    back = Profile.load(p.save(tmp_path / "p.json"))
    assert back == p
    # every committed profile predates ops and the communication CPU: they load without them
    old = Profile.load(RESULTS / "sim_profile_flowmoe_2rank.json")
    assert old.ops is None and old.comm_cpu_s == 0.0 and old.comm_cpu_per_byte_s == 0.0
    # operations measured before the speed reference load with none
    data = json.loads(json.dumps(dataclasses.replace(p, ops=_cal()).to_dict()))
    data["ops"].pop("reference_s")
    assert Profile.from_dict(data).ops.reference_s == 0.0
    data = json.loads(json.dumps(p.to_dict()))
    data["ops"]["fwd"].pop("head")
    with pytest.raises(ValueError, match=r"ops\.fwd must map each of"):
        Profile.from_dict(data)
    data = json.loads(json.dumps(p.to_dict()))
    data["ops"]["bogus"] = 1
    with pytest.raises(ValueError, match=r"profile\.ops: unknown field\(s\) \['bogus'\]"):
        Profile.from_dict(data)
    data = json.loads(json.dumps(p.to_dict()))
    data["ops"]["model"]["top_k"] = 9
    with pytest.raises(ValueError, match=r"profile\.ops: model\.top_k \(9\) must be <="):
        Profile.from_dict(data)


def test_measure_ops_on_a_tiny_model():
    model = _tiny()
    cal = measure_ops(model, world=2, threads=1, repeats=2)
    assert cal.model == model and cal.expert_count == 1 and cal.threads == 1
    assert cal.tokens == (8, 16)  # a quarter of the batch (at least 1 sequence), then 2
    for fits in (cal.fwd, cal.bwd):
        assert set(fits) == set(OPS)
        # every piece costs something at the model's size
        assert all(fit.seconds(16) > 0 for fit in fits.values())
    assert cal.optimizer.seconds(1e6) > 0
    # the speed reference (a block and the head, forward and backward) is timed beside them
    assert cal.reference_s > 0
    with pytest.raises(ValueError, match=r"model\.experts \(2\) must be a multiple of world \(4\)"):
        measure_ops(model, world=4)


def _tiny() -> ModelSpec:
    return ModelSpec(**_TINY)  # type: ignore[arg-type]


def test_calibrate_model_writes_the_operations(tmp_path, capsys):
    (tmp_path / "m.toml").write_text(TINY_TOML)
    out = tmp_path / "p.json"
    argv = ["calibrate", "--out", str(out), "--model", str(tmp_path / "m.toml"), "--threads", "1"]
    assert main(argv) == 0
    profile = Profile.load(out)
    assert profile.ops is not None and profile.ops.model == _tiny()
    assert profile.ops.threads == 1 and profile.ops.expert_count == 2  # no cluster: one rank
    assert "operations of model 'tiny' timed here (1 threads)" in profile.source
    # and the taskflow runtime's CPU at the model's layer (the planner's caveat without them)
    assert profile.tile_cpu_s > 0 and profile.tile_elem_cpu_s > 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["ops"]["model"]["name"] == "tiny"
    assert main(["calibrate", "--out", str(tmp_path / "q.json"), "--threads", "1"]) == 2
    assert "--threads applies to --model only" in capsys.readouterr().err
    # 2 experts on a 4-rank cluster: timed at EP 2, the largest group dividing both (one
    # expert per rank), what `plan --ep` prices below the world
    ops, _ = _measure_model(argparse.Namespace(model=str(tmp_path / "m.toml"), threads=1), 4)
    assert ops.expert_count == 1
    assert "1 experts per rank (EP 2: 2 experts do not spread over 4)" in capsys.readouterr().out
    assert main(["calibrate", "--out", str(tmp_path / "q.json"), "--contention-s", "-1"]) == 2
    assert "--contention-s (-1.0) must be" in capsys.readouterr().err
