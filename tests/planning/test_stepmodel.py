"""predict_step: the paper's forward plus the training parts, from the same pricing."""

from __future__ import annotations

import pytest

import moesaic
from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.planning.stepmodel import predict_step
from moesaic.sim.hybrid_costmodel import evaluate_domains, stream_inputs

SPEC = ClusterSpec(
    levels=(
        Level(name="dc", size=2, bandwidth_gbps=0.1, latency_ms=2.0),
        Level(name="rank", size=2, bandwidth_gbps=1.0, latency_ms=0.1),
    )
)
CFG = moesaic.MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=8)
KW = dict(tokens_per_rank=1024, flops_per_s=3e10, seq_len=256)


def _inputs(cr=1.0):
    return stream_inputs(CFG, ep_size=4, act_bytes=4, param_bytes=4, compression_ratio=cr, **KW)


@pytest.mark.parametrize("domains", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_parts_come_from_the_domain_pricing(domains):
    pred = predict_step(SPEC, CFG, domains, blocks=3, **KW)
    cand = evaluate_domains(SPEC, _inputs(), domains)
    p = pred.parts
    assert p["gather"] == pytest.approx(sum(cand.ag_s))
    assert p["grad_reduce"] == pytest.approx(sum(cand.ag_s))  # dense, like the gather at CR 1
    assert p["all_to_all"] == pytest.approx(sum(cand.a2a_s))
    assert p["shared_all_reduce"] == 0.0
    pe, exp = p["pre_expert"], p["expert"]
    assert pred.forward_s == pytest.approx(pe + p["gather"] + 2 * p["all_to_all"] + exp)
    assert pred.backward_s == pytest.approx(
        2 * pe + 2 * exp + 2 * p["all_to_all"] + p["grad_reduce"]
    )
    assert pred.step_s == pytest.approx(3 * (pred.forward_s + pred.backward_s))


def test_prefetch_hides_the_gather_under_pre_expert_compute():
    plain = predict_step(SPEC, CFG, (2, 2), **KW)
    pre = predict_step(SPEC, CFG, (2, 2), prefetch=True, **KW)
    p = plain.parts
    assert pre.forward_s == pytest.approx(
        max(p["pre_expert"], p["gather"]) + 2 * p["all_to_all"] + p["expert"]
    )
    assert pre.forward_s < plain.forward_s


def test_compression_shrinks_the_gather_not_the_gradient_reduce():
    dense = predict_step(SPEC, CFG, (2, 2), **KW)
    comp = predict_step(SPEC, CFG, (2, 2), compression_ratio=8.0, **KW)
    assert comp.parts["gather"] < dense.parts["gather"] / 3
    assert comp.parts["grad_reduce"] == pytest.approx(dense.parts["grad_reduce"])
    assert comp.parts["shared_all_reduce"] > 0
    # classic EP gathers nothing, compressed or not
    classic = predict_step(SPEC, CFG, (1, 1), compression_ratio=8.0, **KW)
    assert classic.parts["gather"] == classic.parts["shared_all_reduce"] == 0.0


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="blocks"):
        predict_step(SPEC, CFG, (1, 1), blocks=0, **KW)
    with pytest.raises(ValueError, match=r"domain_sizes\[1\] \(3\) must divide"):
        predict_step(SPEC, CFG, (1, 3), **KW)


def test_plan_step_prices_every_candidate_and_picks_the_fastest():
    from moesaic.planning.stepmodel import plan_step

    plan = plan_step(SPEC, CFG, **KW)
    assert [c.domain_sizes for c in plan.candidates] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert plan.classic.domain_sizes == (1, 1)
    assert plan.chosen.step_s == min(c.step_s for c in plan.candidates)
    for c in plan.candidates:
        assert c.step_s == pytest.approx(predict_step(SPEC, CFG, c.domain_sizes, **KW).step_s)
    assert "classic EP" in plan.reason
    # Wide experts (F = 4096) make gathering and reducing them dearer than moving the tokens.
    wide = moesaic.MoEConfig(hidden_size=256, ffn_hidden_size=4096, num_experts=8)
    assert plan_step(SPEC, wide, **KW).chosen.domain_sizes == (1, 1)
