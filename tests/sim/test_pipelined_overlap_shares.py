"""FlowMoE's gradient chunks and the loaded collective shares: a share point timed slower than a
larger size allows (a stall in its few timed calls) is held to the links' rate
(``collectives.rate_bounded_shares``, applied by ``simulate.link_model`` to the loaded regime),
so the chunks below the smallest measured size do not pay the stall as a rate."""

from __future__ import annotations

import pytest

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.sim.collectives import LinkModel, rate_bounded_shares, ring_all_reduce_s
from moesaic.sim.model import ModelSpec
from moesaic.sim.profile import CollectiveShare, Profile
from moesaic.sim.simulate import SimOptions, link_model, simulate

FLAT4 = ClusterSpec(levels=(Level(name="node", size=4, bandwidth_gbps=0.3, latency_ms=1.0),))
# v-+--+'s loaded all-reduce (rule 2 of benchmarks/sim_unseen.py): 0.35 MB timed at 111 ms,
# 1.4 MB at 70 ms; the smaller size's share (0.135) is a stall, not a rate
STALLED = ((351552.0, 0.135), (1406240.0, 0.889), (5624992.0, 0.890))


def _profile(points, regime: str, **kw) -> Profile:
    shares = tuple(
        CollectiveShare(kind="all_reduce", bytes_per_rank=b, share=s, regime=regime)
        for b, s in points
    )
    return Profile(flops_per_s=1e10, collectives=shares, **kw)


def test_consistent_points_are_kept():
    # the time beyond the share-1 term, b (1/s - 1), grows with b: nothing to bound
    points = ((1e5, 0.5), (1e6, 0.6), (1e7, 0.55))
    assert rate_bounded_shares(points) == points
    assert rate_bounded_shares(()) == ()


def test_a_stalled_size_is_held_to_the_larger_sizes_time():
    bounded = rate_bounded_shares(STALLED)
    assert bounded[1:] == STALLED[1:]
    assert bounded[0][1] == pytest.approx(1 / (1 + 1406240 * (1 / 0.889 - 1) / 351552))
    # in time: the smaller all-reduce takes the larger one's time less its extra bytes at the
    # links' full rate (share 1), no more
    link = LinkModel(spec=FLAT4, allreduce_shares=bounded)
    one = LinkModel(spec=FLAT4)
    small, large = STALLED[0][0], STALLED[1][0]
    extra = ring_all_reduce_s(one, large) - ring_all_reduce_s(one, small)
    assert ring_all_reduce_s(link, small) == pytest.approx(ring_all_reduce_s(link, large) - extra)
    raw = LinkModel(spec=FLAT4, allreduce_shares=STALLED)
    assert ring_all_reduce_s(raw, small) > ring_all_reduce_s(raw, large)  # the stall


def test_a_larger_size_above_share_1_raises_a_smaller_one_to_share_1_at_most():
    # 4 MB measured under its share-1 term (share 3): the latency term is off, not the rate
    assert rate_bounded_shares(((1e6, 0.5), (4e6, 3.0))) == ((1e6, 1.0), (4e6, 3.0))
    assert rate_bounded_shares(((1e6, 1.5), (4e6, 3.0))) == ((1e6, 1.5), (4e6, 3.0))


def test_simulate_bounds_the_loaded_points_only():
    loaded = link_model(FLAT4, _profile(STALLED, "loaded"))
    assert loaded.allreduce_shares == rate_bounded_shares(STALLED)
    idle = link_model(FLAT4, _profile(STALLED, "idle"))
    assert idle.allreduce_shares == STALLED


def test_flowmoe_chunks_do_not_pay_a_stall_as_a_rate():
    model = ModelSpec(layers=2, batch=4, seq_len=64, hidden=64, ffn_hidden=64, experts=4, top_k=2)
    grad = model.layers * model.replicated_params_per_block() + model.outer_params()
    G = grad * model.param_bytes
    # measured sizes around the whole buffer; the chunks (G / 16) lie below the smallest
    points = ((G / 4, 0.1), (G, 0.9), (4 * G, 0.9))
    profile = _profile(points, "loaded")
    link = link_model(FLAT4, profile)
    lat = 2 * 3 * link.worst_latency_s()  # the ring's 2 (P - 1) latencies
    whole = ring_all_reduce_s(link, G) - lat
    chunks = 16 * (ring_all_reduce_s(link, G / 16) - lat)
    assert chunks == pytest.approx(whole * 0.9 / rate_bounded_shares(points)[0][1])
    assert chunks < 1.5 * whole  # unbounded: 9 x (share 0.1 against 0.9)
    flow = simulate(FLAT4, model, "dropless", profile, SimOptions(degree=2), schedule="flowmoe")
    spans = [s for s in flow.spans if s.resource == "allreduce" and s.name.startswith("AR")]
    # the gaps' chunks (G / 16 each) and the tail's, one call (grad_layout.py), each priced
    # at its own size's bounded share
    sizes = [s.args["bytes"] for s in spans]
    assert sum(sizes) == pytest.approx(G) and sizes[0] == pytest.approx(G / 16)
    assert 1 < len(spans) < 16 and sizes[-1] > G / 16
    for s in spans:
        assert s.duration == pytest.approx(ring_all_reduce_s(link, s.args["bytes"]))


def test_a_skewed_ranks_compute_gets_the_cores_the_lighter_ones_leave():
    """Processor sharing: 4 ranks on 2 cores, 1 thread each. Uniform loads: every rank computes
    beside the others all along (factor 1). Loads 0.4/0.2/0.2/0.2: the busiest computes 0.2 at
    4 ranks on 2 cores (x2) and its last 0.2 alone (x1): 0.6 where all-beside charges 0.8."""
    from moesaic.sim.contention import CpuModel, skewed_compute_factor

    cpu = CpuModel(cores_per_rank=0.5, threads=1)
    assert skewed_compute_factor([0.25] * 4, cpu) == pytest.approx(1.0)
    assert skewed_compute_factor([0.4, 0.2, 0.2, 0.2], cpu) == pytest.approx(0.6 / 0.8)
    # every rank with a core of its own: nothing to free
    assert skewed_compute_factor([0.7, 0.1, 0.1, 0.1], CpuModel(cores_per_rank=1.0)) == 1.0
    # ranks in any order; 3 of 4 done at once leave the busiest 2 cores (1 thread: x1)
    assert skewed_compute_factor([0.1, 0.7, 0.1, 0.1], cpu) == pytest.approx(
        (0.1 * 2 + 0.6 * 1) / (0.7 * 2)
    )
