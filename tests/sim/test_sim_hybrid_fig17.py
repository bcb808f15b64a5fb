"""HybridEP's simulated costs against the paper's own equations (the Fig. 17 argument of
docs/simulator.md): on one level of G "datacenters" (one rank each, the paper's §III
assumption) the simulator's forward is Eq. 10 at ``p = (G - S) / (G - 1)`` (Definition 1), so a
fixed domain of ``S`` can remove only ``(S - 1) / (G - 1)`` of the all-to-all and EP / HybridEP
is at most ``(G - 1) / (G - S)``; and whether the gathers pay follows Eq. 12's sign."""

from __future__ import annotations

import random

import pytest

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.sim.collectives import LinkModel
from moesaic.sim.hybrid import hybrid_parts, moe_config
from moesaic.sim.hybrid_costmodel import latency, stream_inputs
from moesaic.sim.model import ModelSpec


def _one_level(G: int, gbps: float) -> LinkModel:
    lv = Level(name="datacenter", size=G, bandwidth_gbps=gbps, latency_ms=0.0)
    return LinkModel(spec=ClusterSpec(name="one_level", levels=(lv,)))


def _model(G: int, batch: int, F: int) -> ModelSpec:
    return ModelSpec(
        layers=1,
        batch=batch,
        seq_len=512,
        hidden=512,
        ffn_hidden=F,
        experts=G,
        top_k=2,
        act_bytes=2,
        param_bytes=2,
    )


@pytest.mark.parametrize(
    ("G", "batch", "F", "flops", "S"),
    [
        (8, 4, 1024, 1e12, 2),  # Table IV's G = 8: case 2.1 (2D < G P_E), both AG and A2A
        (8, 64, 64, 1e12, 8),  # case 2.2: all gather, no all-to-all left
        (8, 1, 64, 1e10, 4),  # case 1: the gathers hide under the pre-expert compute
        (1000, 16, 256, 1e14, 10),  # the fixed domain of sim_scale at 1,000 "DCs"
        (1000, 16, 256, 1e14, 500),
    ],
)
def test_forward_is_the_papers_eq10_at_definition1_p(G, batch, F, flops, S):
    """Term by term: Eq. 3 (``p (G-1) D / G B``), Eq. 4 (``(1-p)(G-1) P_E / B``) and Eq. 10
    (``max(PE, AG) + 2 A2A``) equal the simulator's closed-form phases."""
    link, model = _one_level(G, 10.0), _model(G, batch, F)
    parts = hybrid_parts(link, model, (S,), flops, prefetch=True)
    inputs = stream_inputs(
        moe_config(model),
        tokens_per_rank=model.tokens,
        ep_size=G,
        flops_per_s=flops,
        seq_len=model.seq_len,
    )
    ref = latency(inputs, (G - S) / (G - 1), num_ranks=G, bandwidth_gbps=10.0)
    assert parts.gather == pytest.approx(ref.ag_s, rel=1e-12)
    assert parts.all_to_all == pytest.approx(ref.a2a_s, rel=1e-12, abs=1e-15)
    assert parts.paper_latency_s == pytest.approx(ref.final_s, rel=1e-12)


def test_fixed_domain_speedup_is_bounded_by_the_all_to_all_share_it_removes():
    """A domain of S removes only the chunks bound for its S - 1 other members (§III-B,
    "Relationships"): EP / HybridEP <= (G - 1) / (G - S), forward (Eq. 10) and training step,
    over random sizes, compression and bandwidths at G = 1,000; a model in which a domain
    removed the whole inter-DC hop of its tokens would break it."""
    rng = random.Random(17)
    G = 1000
    for _ in range(40):
        S = rng.choice([2, 10, 50, 100, 250, 500])
        link = _one_level(G, rng.choice([1.0, 10.0, 100.0]))
        model = _model(G, rng.choice([1, 16, 256]), rng.choice([16, 256, 2048]))
        flops = rng.choice([1e11, 1e13, 1e15])
        kw = {"prefetch": True, "compression_ratio": rng.choice([1.0, 16.0, 256.0])}
        ep = hybrid_parts(link, model, (1,), flops)
        hy = hybrid_parts(link, model, (S,), flops, **kw)  # type: ignore[arg-type]
        bound = (G - 1) / (G - S) * (1 + 1e-12)
        assert ep.paper_latency_s / hy.paper_latency_s <= bound
        assert ep.step_s / hy.step_s <= bound


@pytest.mark.parametrize("batch", [2, 256])  # 2D / G P_E = 0.02, 2.7
def test_eq12_sign_decides_whether_a_fixed_domain_pays(batch):
    """With the gathers exposed (Eq. 12, ``Lat_PE`` ~ 0): HybridEP's forward beats EP's iff
    ``2D > G P_E`` (case 2.2), whatever the domain size."""
    G, F = 1000, 64
    link, model = _one_level(G, 10.0), _model(G, batch, F)
    inputs = stream_inputs(
        moe_config(model),
        tokens_per_rank=model.tokens,
        ep_size=G,
        flops_per_s=1e18,
        seq_len=model.seq_len,
    )
    wins = 2 * inputs.data_bytes > G * inputs.expert_bytes
    assert wins == (batch == 256)  # D = T K H 2 bytes; P_E = 3 H F 2 bytes (SwiGLU)
    ep = hybrid_parts(link, model, (1,), 1e18).paper_latency_s
    for S in (2, 10, 100, 500):
        hy = hybrid_parts(link, model, (S,), 1e18, prefetch=True).paper_latency_s
        assert (ep > hy) == wins
