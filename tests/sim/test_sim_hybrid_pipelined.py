"""``hybrid`` under the pipelined schedules (issue 22, item 5): dropless's exchange over the
offset group (priced against the one cost home, ``cluster.cost``, on the traffic matrix of
every offset group at once), the gathers before the pipeline and one gradient reduce per
block, related to ``hybrid`` under vanilla by a stated rule; domains of 1 are dropless; more
bandwidth is never slower."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.sim.collectives import (
    LinkModel,
    all_reduce_s,
    all_to_all_shares_s,
    all_to_all_v_s,
    offset_group_sizes,
)
from moesaic.sim.hybrid import hybrid_parts
from moesaic.sim.hybrid_costmodel import domain_size_choices
from moesaic.sim.model import ModelSpec
from moesaic.sim.pipelined import Costs, domain_shares
from moesaic.sim.profile import Profile
from moesaic.sim.simulate import SimOptions, simulate

MODEL = ModelSpec(
    layers=2, batch=4, seq_len=64, hidden=128, ffn_hidden=256, experts=8, top_k=2, heads=4
)
PROFILE = Profile(flops_per_s=1e10, task_overhead_s=1e-4)
ONE_CHUNK = 1e15  # Sp above every gradient: one all-reduce chunk, after the backward


def _spec(*levels: tuple[int, float, float], scale: float = 1.0) -> ClusterSpec:
    return ClusterSpec(
        levels=tuple(
            Level(name=f"l{i}", size=s, bandwidth_gbps=b * scale, latency_ms=a)
            for i, (s, b, a) in enumerate(levels)
        )
    )


ONE_LEVEL = _spec((4, 0.5, 1.0))
TWO_LEVELS = _spec((2, 0.1, 2.0), (4, 1.0, 0.1))


def _offset_traffic(spec: ClusterSpec, ds: tuple[int, ...], D: float, shares: list[float]):
    """``bytes_PP`` of every offset group's all-to-all-v at once: rank ``p`` sends ``D x
    shares[q]`` to the member of its offset group in domain ``q`` (its own share stays)."""
    Q_l = offset_group_sizes(spec, ds)
    P = spec.world_size
    out = [[0.0] * P for _ in range(P)]
    for src in range(P):
        offsets = [c % s for c, s in zip(spec.coords(src), ds)]
        for q in range(math.prod(Q_l)):
            digits, rest = [], q
            for n in reversed(Q_l):
                rest, d = divmod(rest, n)
                digits.append(d)
            coords = [d * s + o for d, s, o in zip(reversed(digits), ds, offsets)]
            dst = 0
            for c, lv in zip(coords, spec.levels):
                dst = dst * lv.size + c
            if dst != src:
                out[src][dst] += D * shares[q]
    return out


@pytest.mark.parametrize(
    "levels",
    [
        ((4, 0.5, 0.0),),  # one level
        ((2, 0.1, 0.0), (4, 1.0, 0.0)),  # slow outer, fast inner
        ((3, 1.0, 0.0), (1, 5.0, 0.0), (4, 0.5, 0.0)),  # a level of 1, slower inner links
    ],
)
def test_offset_group_exchange_is_the_traffic_matrix(levels):
    """Every domain tuple, skewed routing: the closed form over the offset groups equals
    ``cluster.cost.network_time`` on the whole world's traffic matrix (no latency: the matrix
    form pays the world's, the exchange its group's)."""
    spec = _spec(*levels)
    link = LinkModel(spec=spec)
    model = dataclasses.replace(MODEL, experts=spec.world_size * 2, routing_skew=1.2)
    D = 3.0e5
    for ds in domain_size_choices(spec):
        shares = domain_shares(model, spec, ds)
        assert math.fsum(shares) == pytest.approx(1.0)
        got = all_to_all_shares_s(link, D, shares, domain_sizes=ds)
        want = all_to_all_v_s(link, _offset_traffic(spec, ds, D, shares))
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), ds
    with pytest.raises(ValueError, match="domain_sizes"):
        offset_group_sizes(spec, (5,) * spec.num_levels)


def test_offset_group_latency_is_its_outermost_level():
    link = LinkModel(spec=TWO_LEVELS)
    assert link.worst_latency_s() == link.worst_latency_s((1, 1)) == 2e-3
    assert link.worst_latency_s((2, 1)) == pytest.approx(1e-4)  # one DC: the inner level's
    assert link.worst_latency_s((2, 4)) == 0.0  # one rank per group: no exchange


@pytest.mark.parametrize("schedule", ["moe-only", "flowmoe"])
@pytest.mark.parametrize("spec", [ONE_LEVEL, TWO_LEVELS], ids=["one-level", "two-levels"])
def test_domains_of_one_are_dropless(spec, schedule):
    """No gathers: the same graph as dropless under the same schedule over the same group."""
    ones = (1,) * spec.num_levels
    for R, skew in ((1, 0.0), (2, 0.0), (4, 1.0)):
        model = dataclasses.replace(MODEL, routing_skew=skew)
        opts = SimOptions(degree=R, domain_sizes=ones)
        h = simulate(spec, model, "hybrid", PROFILE, opts, schedule=schedule)
        d = simulate(spec, model, "dropless", PROFILE, opts, schedule=schedule)
        assert h.iteration_s == pytest.approx(d.iteration_s, rel=1e-12)
        # Names (and their order) exactly; each time to the same relative rule as the iteration.
        assert [s.name for s in h.spans] == [s.name for s in d.spans]
        assert [s.start for s in h.spans] == pytest.approx([s.start for s in d.spans], rel=1e-12)
        assert [s.end for s in h.spans] == pytest.approx([s.end for s in d.spans], rel=1e-12)
        assert not [s for s in h.spans if s.resource == "gather"]


@pytest.mark.parametrize(
    ("spec", "ds"),
    [
        (ONE_LEVEL, (2,)),
        (_spec((2, 0.1, 2.0), (2, 1.0, 0.1)), (1, 2)),
        (TWO_LEVELS, (1, 2)),
        (TWO_LEVELS, (2, 1)),
    ],
    ids=["one-level", "2x2", "2x4-inner", "2x4-outer"],
)
def test_one_chunk_is_hybrid_vanilla_plus_the_training_step(spec, ds):
    """The stated rule. At R = 1 with one all-reduce chunk every task waits for the one before
    it, under hybrid+flowmoe as under hybrid+vanilla (HybridEP's step), so each iteration is
    its compute + communication. The communication of hybrid+flowmoe is vanilla's (L gathers,
    4L exchanges, L gradient reduces) plus dropless's count exchange (one latency of the
    offset group per dispatch) and the replicated gradients' all-reduce, which HybridEP's step
    leaves out; its exchange is one all-to-all over the offset group where vanilla's hops level
    by level, equal when the tokens cross one level (one level, or domains covering all but
    one) and never slower otherwise."""
    opts = SimOptions(degree=1, sp_bytes=ONE_CHUNK, domain_sizes=ds)
    v = simulate(spec, MODEL, "hybrid", PROFILE, dataclasses.replace(opts, hybrid_step="benchmark"))
    f = simulate(spec, MODEL, "hybrid", PROFILE, opts, schedule="flowmoe")
    for r in (v, f):
        assert r.iteration_s == pytest.approx(r.compute_s + r.comm_s, rel=1e-12)
    link = LinkModel(spec=spec, all_reduce="best")
    extra = MODEL.layers * link.worst_latency_s(ds)
    extra += all_reduce_s(link, Costs(MODEL, link, PROFILE, 1).grad_bytes())
    hops = sum(1 for n, q in zip((lv.size for lv in spec.levels), ds) if q < n)
    if hops == 1:
        assert f.comm_s - extra == pytest.approx(v.comm_s, rel=1e-12)
    else:
        assert f.comm_s - extra < v.comm_s
    gathers = _gathers(f)  # each block's gathers and reduce: vanilla's parts
    assert gathers == pytest.approx(_gathers(v)) and len(gathers) == 2 * MODEL.layers
    parts = hybrid_parts(link, MODEL, ds, PROFILE.flops_per_s)
    assert gathers[("fwd", 1)] == pytest.approx(parts.gather) and parts.gather > 0
    assert gathers[("bwd", 1)] == pytest.approx(parts.grad_reduce) and parts.grad_reduce > 0


def _gathers(result) -> dict[tuple[str, int], float]:
    """Seconds of the gather lane's tasks by (phase, block)."""
    spans = [s for s in result.spans if s.resource == "gather"]
    return {(s.args["phase"], s.args["block"]): s.duration for s in spans}


@pytest.mark.parametrize("prefetch", [False, True])
def test_gathers_before_the_pipeline_one_reduce_per_block(prefetch):
    """R = 2 chunks, 2 blocks: the L gathers run first (the first attention waits for them
    unless prefetched); each block's gradient reduce runs once, after its last chunk's expert
    backward and before its attention backward; the exchange is per chunk."""
    opts = SimOptions(degree=2, domain_sizes=(2,), prefetch=prefetch)
    r = simulate(ONE_LEVEL, MODEL, "hybrid", PROFILE, opts, schedule="flowmoe")
    by = {(s.name, s.args.get("phase")): s for s in r.spans}
    ags = [by[(f"G.{b}", "fwd")] for b in (1, 2)]
    first_at = by[("AT1.1", "fwd")]
    assert first_at.start == (0.0 if prefetch else pytest.approx(ags[-1].end))
    assert by[("D1.1", "fwd")].start >= ags[-1].end
    assert sorted(_gathers(r)) == [("bwd", 1), ("bwd", 2), ("fwd", 1), ("fwd", 2)]
    for blk in (1, 2):
        rs = by[(f"G.{blk}", "bwd")]
        experts = [by[(f"E{c}.{blk}", "bwd")] for c in (1, 2)]
        attention = [by[(f"AT{c}.{blk}", "bwd")] for c in (1, 2)]
        assert rs.start >= max(e.end for e in experts)
        assert min(a.start for a in attention) >= rs.end
    link = LinkModel(spec=ONE_LEVEL, all_reduce="best")
    chunk = MODEL.tokens // 2 * MODEL.top_k * MODEL.hidden * MODEL.act_bytes
    shares = domain_shares(MODEL, ONE_LEVEL, (2,))
    a2a = all_to_all_shares_s(link, chunk, shares, domain_sizes=(2,))
    assert by[("C2.1", "fwd")].duration == pytest.approx(a2a)
    assert by[("C2.1", "fwd")].args["bytes"] == pytest.approx(chunk)


@pytest.mark.parametrize("spec", [ONE_LEVEL, TWO_LEVELS], ids=["one-level", "two-levels"])
def test_more_bandwidth_is_never_slower(spec):
    """Every domain tuple and the planned one, hybrid under every schedule and dropless and
    padded under the pipelined ones: scaling every link up never lengthens the iteration."""
    levels = [(lv.size, lv.bandwidth_gbps, lv.latency_ms) for lv in spec.levels]
    domains = (None, *domain_size_choices(spec))
    cases = [("hybrid", s, ds) for s in ("vanilla", "moe-only", "flowmoe") for ds in domains]
    cases += [(n, s, None) for n in ("dropless", "padded") for s in ("moe-only", "flowmoe")]
    for strategy, schedule, ds in cases:
        opts = SimOptions(degree=2, domain_sizes=ds)
        times = [
            simulate(_spec(*levels, scale=k), MODEL, strategy, PROFILE, opts, schedule=schedule)
            for k in (0.25, 1.0, 4.0, 16.0)
        ]
        its = [t.iteration_s for t in times]
        assert all(b <= a * (1 + 1e-12) for a, b in itertools.pairwise(its)), (
            strategy,
            schedule,
            ds,
        )
        assert its[-1] < its[0]


def test_padded_pays_for_its_padding():
    """Uniform routing: padded's buffer is dropless's rows (the same all-to-all); skewed: every
    expert gets the busiest one's rows from every rank (more bytes, more compute); with a
    capacity factor the buffer is the capacity."""
    link = LinkModel(spec=ONE_LEVEL)
    d, p = (Costs(MODEL, link, PROFILE, 2, strategy=n) for n in ("dropless", "padded"))
    assert p.a2a_bytes == pytest.approx(d.a2a_bytes) and p.a2a_s == pytest.approx(d.a2a_s)
    assert p.e_s == pytest.approx(d.e_s)
    skew = dataclasses.replace(MODEL, routing_skew=1.0)
    d, p = (Costs(skew, link, PROFILE, 2, strategy=n) for n in ("dropless", "padded"))
    assert p.a2a_bytes > d.a2a_bytes and p.a2a_s > d.a2a_s
    cf = dataclasses.replace(MODEL, capacity_factor=2.0)
    p = Costs(cf, link, PROFILE, 2, strategy="padded")
    capacity = math.ceil(2.0 * (MODEL.tokens // 2) * MODEL.top_k / MODEL.experts)
    assert p.a2a_bytes == MODEL.experts * capacity * MODEL.hidden * MODEL.act_bytes
    assert p.counts_s == 0.0  # a fixed capacity needs no agreement


def test_padded_without_capacity_pads_to_the_largest_load_of_any_rank():
    """With recorded (or prior) loads, the world's sums over a step, padded's buffer is the
    largest (source rank, expert) load of a chunk: the busiest share raised by the prior's
    largest-of-P-ranks factor (more than 1 on 4 ranks), capped at the chunk's tokens; a stated
    Zipf skew keeps every rank alike."""
    from moesaic.sim.pipelined import padded_capacity
    from moesaic.sim.prior import largest_source_factor

    link = LinkModel(spec=ONE_LEVEL)
    loads = tuple(float(x) for x in (40, 10, 10, 10, 10, 10, 5, 5))
    model = dataclasses.replace(MODEL, experts=8, measured_loads=(loads,))
    tokens = model.tokens // 2
    busiest = tokens * model.top_k * 40 / 90
    f = largest_source_factor(8, model.top_k, tokens, model.tokens * 4, model.hidden, 4)
    assert f > 1.05
    assert padded_capacity(model, tokens, 4) == min(tokens, math.ceil(busiest * f))
    p = Costs(model, link, PROFILE, 2, strategy="padded")
    C = padded_capacity(model, tokens, 4)
    assert p.a2a_bytes == pytest.approx(8 * C * model.hidden * model.act_bytes)
    assert padded_capacity(model, tokens, 4) > math.ceil(busiest)
    zipf = dataclasses.replace(MODEL, experts=8, routing_skew=1.0)
    shares = [(e + 1) ** -1.0 for e in range(8)]
    assert padded_capacity(zipf, tokens, 4) == math.ceil(
        tokens * zipf.top_k * shares[0] / math.fsum(shares) - 1e-9
    )
