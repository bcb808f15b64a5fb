"""The simulator's closed-form collectives: equal to the one cost home (``cluster.cost``) on
small clusters, and to the textbook closed forms on a single link."""

from __future__ import annotations

import math
import random

import pytest

from moesaic.cluster import cost
from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.sim.collectives import (
    LinkModel,
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    all_to_all_shares_s,
    all_to_all_v_s,
    hierarchical_all_reduce_s,
    level_exchange_s,
    p2p_s,
    ring_all_reduce_s,
)
from moesaic.sim.hybrid import hybrid_parts, moe_config
from moesaic.sim.hybrid_costmodel import evaluate_domains, stream_inputs
from moesaic.sim.model import ModelSpec


def _spec(*levels: tuple[int, float, float]) -> ClusterSpec:
    return ClusterSpec(
        levels=tuple(
            Level(name=f"l{i}", size=s, bandwidth_gbps=b, latency_ms=lat)
            for i, (s, b, lat) in enumerate(levels)
        )
    )


SPECS = [
    _spec((2, 1.0, 5.0)),  # one link, two ranks
    _spec((5, 0.3, 1.0)),  # one level, prime size
    _spec((2, 0.1, 10.0), (2, 0.4, 3.0)),  # 2 DCs x 2 nodes
    _spec((3, 0.5, 4.0), (1, 2.0, 0.5), (4, 8.0, 0.01)),  # a level of size 1 in the middle
    _spec((2, 10.0, 1.0), (3, 1.0, 0.1)),  # inner links slower than outer ones
]
IDS = ["1link", "prime", "2x2", "3x1x4", "slow-inner"]


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_uniform_all_to_all_equals_cluster_cost(spec):
    link = LinkModel(spec=spec)
    assert all_to_all_s(link, 12345.0) == pytest.approx(cost.all_to_all_time_s(spec, 12345.0))


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_ring_all_reduce_equals_cluster_cost(spec):
    link = LinkModel(spec=spec)
    got = ring_all_reduce_s(link, 1e6)
    assert got == pytest.approx(cost.ring_all_reduce_time_s(spec, 1e6))


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_all_gather_equals_ring_steps_of_cluster_cost(spec):
    P = spec.world_size
    step = cost.traffic_time_s(spec, cost.ring_step_bytes(P, 777.0), collectives=1)
    assert all_gather_s(LinkModel(spec=spec), 777.0) == pytest.approx((P - 1) * step)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_skewed_all_to_all_v_equals_its_traffic_matrix(spec):
    """Every rank sends D x shares[dst]: the O(P) form equals cluster.cost on the P x P matrix."""
    P = spec.world_size
    rng = random.Random(P)
    w = [rng.random() ** 3 for _ in range(P)]
    shares = [x / sum(w) for x in w]
    D = 1e5
    matrix = [[0.0 if s == d else D * shares[d] for d in range(P)] for s in range(P)]
    link = LinkModel(spec=spec)
    want = cost.traffic_time_s(spec, matrix, collectives=1)
    assert all_to_all_shares_s(link, D, shares) == pytest.approx(want)
    assert all_to_all_v_s(link, matrix) == pytest.approx(want)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_hybrid_phases_equal_evaluate_domains(spec):
    """Gathers and token hops by level_exchange_s equal evaluate_domains (P x P matrices) for
    every divisor tuple of domain sizes."""
    from moesaic.sim.hybrid_costmodel import domain_size_choices

    P = spec.world_size
    model = ModelSpec(
        layers=1, batch=2, seq_len=64, hidden=64, ffn_hidden=96, experts=4 * P, top_k=2
    )
    inputs = stream_inputs(
        moe_config(model),
        tokens_per_rank=128,
        ep_size=P,
        flops_per_s=1e10,
        act_bytes=4,
        param_bytes=4,
        seq_len=64,
    )
    for ds in domain_size_choices(spec):
        ref = evaluate_domains(spec, inputs, ds)
        got = hybrid_parts(LinkModel(spec=spec), model, ds, 1e10)
        assert got.gather == pytest.approx(sum(ref.ag_s)), ds
        assert got.all_to_all == pytest.approx(sum(ref.a2a_s)), ds


def test_single_link_closed_forms():
    """Two ranks on one link of B bytes/s and latency a: the textbook forms."""
    B, a = 1e9 / 8, 5e-3
    link = LinkModel(spec=_spec((2, 1.0, 5.0)))
    n = 1e6
    assert all_to_all_s(link, n) == pytest.approx(n / B + a)
    assert ring_all_reduce_s(link, n) == pytest.approx(2 * (n / 2 / B + a))
    assert hierarchical_all_reduce_s(link, n) == pytest.approx(2 * (n / 2 / B + a))
    assert all_gather_s(link, n) == pytest.approx(n / B + a)
    assert p2p_s(link, 0, 1, n) == pytest.approx(n / B + a)
    assert level_exchange_s(link, 0, 1, n) == pytest.approx(n / B + a)
    # P ranks on one switch: ring all-reduce 2 (P-1) (n/P/B + a)
    P = 8
    ring = LinkModel(spec=_spec((P, 1.0, 5.0)))
    assert ring_all_reduce_s(ring, n) == pytest.approx(2 * (P - 1) * (n / P / B + a))
    assert all_to_all_s(ring, n) == pytest.approx((P - 1) * n / B + a)


def test_hierarchical_all_reduce_two_levels():
    """2 DCs x 4 ranks: ring reduce-scatter inside (4 ranks, n/4 chunks over the inner links),
    then across DCs on n/4 shards (4 rings share each DC uplink)."""
    spec = _spec((2, 1.0, 10.0), (4, 10.0, 0.1))
    link = LinkModel(spec=spec)
    n, B_out, B_in = 8e6, 1e9 / 8, 1e10 / 8
    inner = 2 * 3 * (n / 4 / B_in + 1e-4)
    outer = 2 * 1 * (4 * (n / 4 / 2) / B_out + 1e-2)
    assert hierarchical_all_reduce_s(link, n) == pytest.approx(inner + outer)
    assert hierarchical_all_reduce_s(link, n) < ring_all_reduce_s(link, n)


@pytest.mark.parametrize("n", [0.0, 1e3, 1e6, 1e8])
def test_all_reduce_algorithm_choice(n):
    """``ring`` is gloo's ring, ``hierarchical`` the hierarchical one, ``best`` the faster at
    each size (NCCL-like); all three are one collective on a one-level cluster."""
    two = _spec((2, 1.0, 10.0), (4, 10.0, 0.1))
    ring, hier = (
        ring_all_reduce_s(LinkModel(spec=two), n),
        hierarchical_all_reduce_s(LinkModel(spec=two), n),
    )
    assert all_reduce_s(LinkModel(spec=two), n) == ring  # the default: what gloo runs
    assert all_reduce_s(LinkModel(spec=two, all_reduce="hierarchical"), n) == hier
    assert all_reduce_s(LinkModel(spec=two, all_reduce="best"), n) == min(ring, hier)
    assert hier < ring  # 2 x 4 ranks, 10 ms between DCs: 2 slow steps instead of 14
    one = _spec((8, 1.0, 5.0))
    got = {a: all_reduce_s(LinkModel(spec=one, all_reduce=a), n) for a in ("ring", "best")}
    assert got["best"] == pytest.approx(got["ring"], rel=1e-12)
    with pytest.raises(ValueError, match="all_reduce"):
        LinkModel(spec=one, all_reduce="tree")


def test_latency_floor_and_bandwidth_scale():
    spec = _spec((2, 1.0, 0.0))
    n, B = 1e6, 1e9 / 8
    link = LinkModel(spec=spec, floor_s=2e-4, bandwidth_scale=0.5)
    assert all_to_all_s(link, n) == pytest.approx(n / (0.5 * B) + 2e-4)
    assert ring_all_reduce_s(link, 0.0) == pytest.approx(2 * 2e-4)  # a floor even for 0 bytes
    assert all_to_all_v_s(link, [[0, n], [n, 0]]) == pytest.approx(n / (0.5 * B) + 2e-4)


def test_single_rank_costs_nothing():
    link = LinkModel(spec=_spec((1, 1.0, 5.0)))
    assert all_to_all_s(link, 1e6) == ring_all_reduce_s(link, 1e6) == all_gather_s(link, 1) == 0


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda lk: all_to_all_s(lk, -1.0), "bytes_per_pair"),
        (lambda lk: all_to_all_s(lk, math.inf), "bytes_per_pair"),
        (lambda lk: all_to_all_shares_s(lk, 1.0, [1.0]), "shares_P"),
        (lambda lk: all_to_all_shares_s(lk, 1.0, [0.5, 0.6]), "shares_P"),
        (lambda lk: level_exchange_s(lk, 0, 2, 1.0), "peers"),
        (lambda lk: LinkModel(spec=lk.spec, floor_s=-1.0), "floor_s"),
        (lambda lk: LinkModel(spec=lk.spec, bandwidth_scale=0.0), "bandwidth_scale"),
    ],
)
def test_bad_arguments_name_the_field(call, match):
    with pytest.raises(ValueError, match=match):
        call(LinkModel(spec=_spec((2, 1.0, 1.0))))
