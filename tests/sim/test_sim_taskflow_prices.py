"""What the simulator's taskflow and padded steps are priced from (``moesaic.sim.taskflow``,
``moesaic.sim.pipelined``): the measured operations where the profile has them, a put's round
trips, the cores a rank gets, and padded's skipped padding on a CPU."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.sim.collectives import LinkModel, p2p_s
from moesaic.sim.model import ModelSpec
from moesaic.sim.opcal import OPS, OpCal, OpFit, OpPrices
from moesaic.sim.pipelined import Costs
from moesaic.sim.profile import Profile
from moesaic.sim.taskflow import (
    PUT_LATENCIES,
    cpu_slowdown,
    gmm_flops_per_s,
    host_prices,
    layer_plan,
)

ROOT = Path(__file__).resolve().parents[2]
LAYER = ModelSpec.from_toml(ROOT / "examples/models/taskflow_layer.toml")
MODEL = ModelSpec(
    name="m", layers=2, batch=8, seq_len=16, hidden=32, ffn_hidden=64, experts=4, top_k=2
)
KNOBS = {"tile_m": 512, "slot_rows": 512}


def _ops(model: ModelSpec, expert_per_row_s: float = 1e-6) -> OpCal:
    """Measured operations of ``model`` with distinct fits per piece and direction."""
    fwd = {
        k: OpFit(overhead_s=1e-4 * (i + 1), per_unit_s=1e-7 * (i + 1)) for i, k in enumerate(OPS)
    }
    bwd = {
        k: OpFit(overhead_s=3e-4 * (i + 1), per_unit_s=5e-7 * (i + 1)) for i, k in enumerate(OPS)
    }
    fwd["experts"] = OpFit(overhead_s=0.0, per_unit_s=expert_per_row_s)
    bwd["experts"] = OpFit(overhead_s=0.0, per_unit_s=3 * expert_per_row_s)
    return OpCal(
        model=model,
        threads=1,
        expert_count=2,
        tokens=(32, 128),
        fwd=fwd,
        bwd=bwd,
        optimizer=OpFit(overhead_s=2e-3, per_unit_s=1e-9),
    )


def _gmm_seconds(plan) -> float:
    return math.fsum(
        s.end - s.start for s in plan.spans if s.resource == "compute" and "gmm" in s.name
    )


def test_gmm_tiles_run_at_the_measured_expert_rate():
    """With the model's operations the GMM tiles' FLOPs run at the rate of its measured expert
    GEMMs per routed row (forward, and backward at twice the FLOPs), not at the matmul rate."""
    slow, fast = _ops(LAYER, 2e-6), _ops(LAYER, 1e-6)
    assert gmm_flops_per_s(LAYER, Profile(flops_per_s=1e10), "forward") == 1e10
    rate = gmm_flops_per_s(LAYER, Profile(flops_per_s=1e10, ops=fast), "forward")
    assert rate == pytest.approx(LAYER.expert_flops(1) / 1e-6)
    back = gmm_flops_per_s(LAYER, Profile(flops_per_s=1e10, ops=fast), "backward")
    assert back == pytest.approx(2 * LAYER.expert_flops(1) / 3e-6)
    link = LinkModel(
        spec=ClusterSpec(levels=(Level(name="n", size=1, bandwidth_gbps=1.0, latency_ms=0.0),))
    )
    slow_plan, fast_plan = (
        layer_plan(LAYER, link, Profile(flops_per_s=1e10, ops=ops), "forward", **KNOBS)
        for ops in (slow, fast)
    )
    launch = Profile(flops_per_s=1e10).task_overhead_s  # 0: only the FLOPs differ
    assert launch == 0
    assert _gmm_seconds(slow_plan) == pytest.approx(2 * _gmm_seconds(fast_plan), rel=1e-9)


def test_host_tasks_come_from_the_measured_operations():
    ops = _ops(MODEL)
    prices, measured = (
        OpPrices(ops, MODEL),
        host_prices(MODEL, Profile(flops_per_s=1e10, ops=ops), 2),
    )
    T = MODEL.tokens
    assert measured.at_fwd_s == prices.stage_s(T)
    assert measured.at_bwd_s == prices.stage_s(T, backward=True)
    assert measured.head_bwd_s == prices.head_s(T, backward=True)
    # AdamW over what a rank holds: replicated parameters and its half of the experts
    params = MODEL.layers * MODEL.replicated_params_per_block() + MODEL.outer_params()
    params += MODEL.layers * (MODEL.experts // 2) * MODEL.mats * MODEL.hidden * MODEL.ffn_hidden
    assert measured.optimizer_s == pytest.approx(prices.optimizer_s(params * MODEL.param_bytes))
    plain = host_prices(MODEL, Profile(flops_per_s=1e10), 2)  # without: the FLOP rate
    assert (
        plain.at_bwd_s == 2 * plain.at_fwd_s == pytest.approx(2 * MODEL.attention_flops(T) / 1e10)
    )


def test_a_remote_put_pays_its_round_trips():
    """A put is a header and a payload, each sent once the receiver is ready: ``PUT_LATENCIES``
    one-way latencies of its path, the bytes once."""
    assert PUT_LATENCIES == 4
    far = ClusterSpec(levels=(Level(name="node", size=2, bandwidth_gbps=1.0, latency_ms=2.0),))
    near = dataclasses.replace(far, levels=(dataclasses.replace(far.levels[0], latency_ms=0.0),))
    prof = Profile(flops_per_s=1e10)

    def puts(spec: ClusterSpec) -> list[float]:
        plan = layer_plan(LAYER, LinkModel(spec=spec), prof, "forward", **KNOBS)
        return [s.end - s.start for s in plan.spans if s.resource == "a2a" and s.end > s.start]

    slow, fast = puts(far), puts(near)
    assert len(slow) == len(fast) > 0
    for a, b in zip(sorted(slow), sorted(fast), strict=True):
        assert a - b == pytest.approx(PUT_LATENCIES * 2e-3, rel=1e-6)
    assert p2p_s(LinkModel(spec=far), 0, 1, 0.0) == pytest.approx(2e-3)  # a message: one latency


def test_cpu_work_stretches_when_ranks_outnumber_cores():
    assert cpu_slowdown(Profile(flops_per_s=1e10)) == 1.0  # not modelled
    assert cpu_slowdown(Profile(flops_per_s=1e10, cores=2, ranks_per_machine=2)) == 1.0
    assert cpu_slowdown(Profile(flops_per_s=1e10, cores=2, ranks_per_machine=4)) == 2.0
    link = LinkModel(
        spec=ClusterSpec(levels=(Level(name="n", size=1, bandwidth_gbps=1.0, latency_ms=0.0),))
    )
    own = Profile(flops_per_s=1e10, cores=4, ranks_per_machine=1)
    shared = dataclasses.replace(own, ranks_per_machine=8)  # half a core each
    a = layer_plan(LAYER, link, own, "forward", **KNOBS)
    b = layer_plan(LAYER, link, shared, "forward", **KNOBS)
    assert b.makespan == pytest.approx(2 * a.makespan, rel=1e-9)
    assert b.cpu_s == pytest.approx(a.cpu_s, rel=1e-12)  # the CPU itself is the same


@pytest.mark.parametrize(("device", "activation", "skips"), [
    ("cpu", "swiglu", True), ("cpu", "gelu", False), ("cuda", "swiglu", False),
])  # fmt: skip
def test_padded_experts_compute_the_kept_rows_where_the_runtime_skips_padding(
    device, activation, skips
):
    """On a CPU with SwiGLU the padded runtime computes the filled rows only (its wire still
    carries the whole buffer); on a GPU or with GELU the experts compute every row."""
    model = dataclasses.replace(MODEL, capacity_factor=2.0, activation=activation)
    spec = ClusterSpec(levels=(Level(name="node", size=2, bandwidth_gbps=1.0, latency_ms=0.1),))
    link = LinkModel(spec=spec)
    ops = dataclasses.replace(_ops(model), device=device)
    padded = Costs(model, link, Profile(flops_per_s=1e10, ops=ops), 1, strategy="padded")
    dropless = Costs(model, link, Profile(flops_per_s=1e10, ops=ops), 1)
    no_ops = Costs(model, link, Profile(flops_per_s=1e10), 1, strategy="padded")
    assert padded.a2a_bytes == no_ops.a2a_bytes > dropless.a2a_bytes  # padding on the wire
    if skips:
        assert padded.e_s == dropless.e_s
    else:
        assert padded.e_s > dropless.e_s
