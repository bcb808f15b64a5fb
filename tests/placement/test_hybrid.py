"""The ``hybrid`` strategy (HybridEP): equal to the reference for every domain size, forward and
backward; gathers cached and prefetched; compressed gathers send what they claim.

One spawned world of 4 ranks runs every case (spawning costs seconds on 2 cores). Each rank
regenerates every rank's input, runs the reference over the whole world's tokens and compares
its output, input gradient, expert gradients (its own shard: gathered copies' gradients must
have been reduced back to it) and the router gradient summed over ranks.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import moesaic
from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.comm.collectives import record_collectives
from moesaic.placement.compress import compressed_nbytes, shared_expert, sr_decode, sr_encode
from moesaic.strategies.hybrid import HybridStrategy
from moesaic.strategies.migration import decode_experts, encode_experts, pack_rows, unpack_rows
from moesaic.strategies.prefetch import ExpertPrefetcher
from moesaic.testing import (
    assert_close_to_ref,
    reference_world,
    route_all_to_first_experts,
    run_world,
)
from moesaic.trace import Recorder

H, F, E = 16, 24, 8
WORLD = 4
TWO_BY_TWO = ClusterSpec(
    levels=(
        Level(name="dc", size=2, bandwidth_gbps=1.0, latency_ms=5.0),
        Level(name="rank", size=2, bandwidth_gbps=10.0, latency_ms=0.1),
    )
)

# (name, domain sizes, two-level topology?)
DOMAINS = [
    ("S1", (1,), False),  # classic EP
    ("S2", (2,), False),
    ("S4", (4,), False),  # all-gather only
    ("dc1x2", (1, 2), True),  # gather inside a datacenter, tokens across
    ("dc2x1", (2, 1), True),  # gather across datacenters, tokens inside
    ("dc2x2", (2, 2), True),
]
# (name, config overrides, tokens of rank r, routing)
SCENARIOS = [
    ("default", {}, lambda r: 12, None),
    ("skewed", {}, lambda r: 9, "one_rank"),  # every token to experts 0 and 1 (rank 0)
    ("rank-without-tokens", {}, lambda r: 0 if r == 1 else 5 + 3 * r, None),
    ("capacity-drops", {"capacity_factor": 0.75}, lambda r: 12, None),
    ("gelu", {"activation": "gelu", "score_func": "sigmoid"}, lambda r: 7, None),
]


def _inputs(rank: int, n: int, one_rank: bool) -> torch.Tensor:
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(1000 + rank))
    if one_rank:
        x[:, 0] = x[:, 0].abs() + 1.0
    return x


def _layer(domains, two_level: bool, overrides=(), routing=None, **options):
    cfg = moesaic.MoEConfig(
        hidden_size=H,
        ffn_hidden_size=F,
        num_experts=E,
        init_std=0.5,
        dispatcher="hybrid",
        options={"domain_sizes": domains, **options},
        **dict(overrides),
    )
    torch.manual_seed(4321)
    layer = moesaic.MoELayer(cfg, topology=TWO_BY_TWO if two_level else None)
    sd = route_all_to_first_experts(layer) if routing == "one_rank" else layer.full_state_dict()
    return cfg, layer, sd


def _parity_case(rank, domains, two_level, overrides, tokens, routing) -> dict:
    cfg, layer, sd = _layer(domains, two_level, overrides, routing)
    strategy = layer.strategy
    assert isinstance(strategy, HybridStrategy)
    xs = [_inputs(p, tokens(p), routing == "one_rank") for p in range(WORLD)]
    gs = [
        torch.randn(x.shape, generator=torch.Generator().manual_seed(7 + p))
        for p, x in enumerate(xs)
    ]
    x = xs[rank].clone().requires_grad_()
    before = layer.ep.traffic.snapshot()
    y = layer(x)
    after = layer.ep.traffic.snapshot()
    ((y * gs[rank]).sum() + moesaic.aux_loss(layer)).backward()
    ref = reference_world(cfg, sd, xs, gs)
    (y32, _, gx32, gw32), (y64, _, gx64, gw64) = ref[torch.float32], ref[torch.float64]
    tag = f"{domains} {two_level} rank {rank}"
    assert_close_to_ref(y.detach(), y32[rank].detach(), y64[rank].detach(), f"{tag} y")
    assert_close_to_ref(x.grad, gx32[rank], gx64[rank], f"{tag} x.grad")
    e = E // WORLD
    mats = ("w1", "w2") if cfg.activation == "gelu" else ("w1", "w3", "w2")
    for name in mats:
        got = getattr(layer.experts, name).grad
        want32, want64 = gw32[f"experts.{name}"], gw64[f"experts.{name}"]
        lo, hi = rank * e, (rank + 1) * e
        assert_close_to_ref(got, want32[lo:hi], want64[lo:hi], f"{tag} {name}.grad")
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    assert_close_to_ref(router_grad, gw32["router.weight"], gw64["router.weight"], f"{tag} router")
    # The strategy's accounting equals what the EP group (and its subgroups) actually sent.
    stats = layer.take_stats().comm
    sent_P = [b - a for a, b in zip(before[0], after[0])]
    assert list(stats.peer_bytes_P) == sent_P, tag
    assert stats.collectives == after[1] - before[1], tag
    S = math.prod(domains)
    expert_bytes = len(mats) * e * H * F * 4  # w1, (w3,) w2 of e experts, fp32
    assert stats.expert_bytes == (S - 1) * expert_bytes, tag
    # Tokens never leave the rank when one domain holds every expert.
    if S == WORLD:
        assert stats.dispatch_bytes == stats.combine_bytes == 0, tag
    return {"domain": strategy.domain_ranks, "offset": strategy.offset_ranks}


def _cache_and_prefetch(rank: int) -> dict:
    """Gathers once per weight version; a prefetch replaces the forward's own gather."""
    out = {}
    _, layer, _ = _layer((2, 2), True)
    x = _inputs(rank, 6, False)
    with record_collectives() as log:
        y0 = layer(x)
        y0.square().sum().backward()
    # One message per gathered level for all three weight matrices, each way.
    out["gathers"] = sum("hybrid gather of" in what for *_, what in log)
    out["reduces"] = sum("gradient reduce" in what for *_, what in log)
    first = layer.take_stats().comm.expert_bytes
    y1 = layer(x)  # same weights: the cached copies
    second = layer.take_stats().comm.expert_bytes
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    with torch.no_grad():
        layer.experts.w1.mul_(1.5)  # an in-place update, like an optimizer step
    y2 = layer(x)
    third = layer.take_stats().comm.expert_bytes
    out["bytes"] = (first, second, third)
    assert not torch.equal(y2, y0)
    # Two layers, prefetched after the "optimizer step": the forwards send no gather of
    # their own, and the outputs equal the synchronous ones.
    model = torch.nn.Sequential(_layer((2, 2), True)[1], _layer((4,), False)[1])
    model(x)
    for m in model:
        m.take_stats()
    recorder = Recorder(rank)
    with ExpertPrefetcher(model, recorder=recorder) as prefetcher:
        with torch.no_grad():
            for m in model:
                m.experts.w2.mul_(0.5)  # the "optimizer step"
        prefetcher.start()
        got = model(x)
        prefetched = [m.take_stats().comm for m in model]
    for m in model:  # the same forward with synchronous gathers
        m.strategy._cache = None
    want = model(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    out["prefetched_bytes"] = [s.expert_bytes for s in prefetched]
    out["spans"] = sorted({(s.resource, s.name) for s in recorder.events})
    return out


def _compressed(rank: int) -> dict:
    cr = 4.0
    _, layer, sd = _layer((2,), False, compression_ratio=cr)
    x = _inputs(rank, 10, False).requires_grad_()
    y = layer(x)
    y.square().sum().backward()
    stats = layer.take_stats().comm
    e = E // WORLD
    payload = 3 * e * compressed_nbytes(H * F, cr, 4)
    shared = 3 * H * F * 4  # the shared experts' all-reduce message
    # Own experts exact, the peer's decoded: the output is close to, not equal to, exact.
    _, exact, _ = _layer((2,), False)
    exact.load_full_state_dict(sd)
    y_exact = exact(x.detach())
    # Shared experts recomputed every 2nd gather: the gather after an update reuses them.
    _, every2, _ = _layer((2,), False, compression_ratio=cr, shared_expert_every=2)
    sent = []
    for _ in range(3):
        every2(x.detach())
        sent.append(every2.take_stats().comm.expert_bytes)
        with torch.no_grad():
            every2.experts.w1.mul_(1.01)
    return {
        "every2": sent,
        "scopes": {scope: _shared_scope(rank, cr, scope) for scope in ("all", "none")},
        "expert_bytes": stats.expert_bytes,
        "want_bytes": payload + shared,
        "rel_err": float((y - y_exact).norm() / y_exact.norm()),
        "grad_finite": bool(torch.isfinite(layer.experts.w1.grad).all()),
    }


def _shared_scope(rank: int, cr: float, scope: str) -> dict:
    """``shared_expert`` "all" (the mean of all E experts, also all-reduced over the offset
    group) and "none" (zeros, no all-reduce): the peer's copies decode to ``sr_encode``/
    ``sr_decode`` of its weights against that shared expert; the bytes say what went where."""
    _, layer, sd = _layer((2,), False, compression_ratio=cr, shared_expert=scope)
    strategy = layer.strategy
    weights = (layer.experts.w1, layer.experts.w3, layer.experts.w2)
    gathered, stats = strategy._gathered(weights)
    e = E // WORLD
    for name, copies in zip(("w1", "w3", "w2"), gathered):
        full = sd[f"experts.{name}"]
        shared = full.mean(dim=0) if scope == "all" else torch.zeros_like(full[0])
        for pos, owner in enumerate(strategy.bundle):
            for j in range(e):
                w = full[owner * e + j]
                want = w if owner == rank else sr_decode(sr_encode(w, shared, cr), shared)
                # the all-reduced sum adds in another order than mean(): ulps of the shared expert
                torch.testing.assert_close(copies[pos * e + j], want, rtol=0, atol=1e-6)
    return {"peer_bytes": list(stats.peer_bytes_P), "collectives": stats.collectives}


def _world(rank: int, world: int) -> dict:
    results: dict = {"parity": {}}
    for name, domains, two_level in DOMAINS:
        for scenario, overrides, tokens, routing in SCENARIOS:
            results["parity"][f"{name}/{scenario}"] = _parity_case(
                rank, domains, two_level, overrides, tokens, routing
            )
    results["cache"] = _cache_and_prefetch(rank)
    results["compressed"] = _compressed(rank)
    # Bad descriptions are refused on every rank before any collective.
    with pytest.raises(ValueError, match=r"domain_sizes \(\[2\]\) must have one entry per"):
        _layer((2,), True)
    with pytest.raises(ValueError, match=r"domain_sizes\[0\] \(3\) must divide"):
        _layer((3,), False)
    return results


@pytest.fixture(scope="module")
def world_results():
    return run_world(_world, WORLD, timeout_s=300)


def test_every_domain_size_equals_the_reference(world_results):
    for res in world_results:
        assert len(res["parity"]) == len(DOMAINS) * len(SCENARIOS)
    # Domains and offset groups as the topology says: rank = 2 * dc + rank-in-dc.
    groups = world_results[1]["parity"]
    assert groups["S2/default"] == {"domain": [0, 1], "offset": [1, 3]}
    assert groups["dc2x1/default"] == {"domain": [1, 3], "offset": [0, 1]}
    assert groups["dc1x2/default"] == {"domain": [0, 1], "offset": [1, 3]}
    assert groups["S1/default"] == {"domain": [1], "offset": [0, 1, 2, 3]}


def test_gathers_are_cached_and_prefetched(world_results):
    for res in world_results:
        cache = res["cache"]
        full = 3 * (3 * (E // WORLD) * H * F * 4)  # 3 peers of a 4-rank domain
        assert cache["bytes"] == (full, 0, full)
        assert cache["gathers"] == 2 and cache["reduces"] == 2  # levels, not levels x weights
        assert cache["prefetched_bytes"] == [full, full]
        assert ("encode", "encode L0") in cache["spans"]
        assert ("gather", "gather L1") in cache["spans"]


def test_compressed_gather_sends_the_compressed_bytes(world_results):
    for res in world_results:
        comp = res["compressed"]
        assert comp["expert_bytes"] == comp["want_bytes"]
        shared = 3 * H * F * 4
        assert comp["every2"] == [
            comp["want_bytes"],
            comp["want_bytes"] - shared,
            comp["want_bytes"],
        ]
        assert 0 < comp["rel_err"] < 1.0 and comp["grad_finite"]


def test_batched_wire_form_equals_per_expert_sr():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(3, 8, 5, generator=gen)
    shared = shared_expert(w)
    for cr in (1.0, 2.5, 10.0):
        payload = encode_experts(w, shared, cr)
        decoded = decode_experts(payload, shared, (8, 5), w.dtype, cr)
        for i in range(3):
            want = sr_decode(sr_encode(w[i], shared, cr), shared)
            assert torch.equal(decoded[i], want), cr
        assert payload.numel() * payload.element_size() == 3 * compressed_nbytes(40, cr, 4)
    assert torch.equal(
        decode_experts(encode_experts(w, shared, 1.0), shared, (8, 5), w.dtype, 1.0), w
    )


def test_packed_rows_travel_as_one_message_and_unpack_bit_exact():
    """Every weight matrix in one message: rows stay rows (a gather concatenates packed rows
    of several members, and they unpack to those members' rows), any dtype, bit for bit."""
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(3, 4, 5, generator=gen)
    b = torch.randn(3, 7, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    c = torch.randint(0, 2**31 - 1, (3, 2), generator=gen, dtype=torch.int32)
    mine, theirs = pack_rows([a, b, c]), pack_rows([a + 1, b, c - 1])
    assert mine.dtype == torch.uint8 and mine.shape == (3, 4 * 5 * 4 + 7 * 2 + 2 * 4)
    got = unpack_rows(torch.cat([mine, theirs]), [a, b, c])
    for t, want in zip(got, [torch.cat([a, a + 1]), torch.cat([b, b]), torch.cat([c, c - 1])]):
        assert t.dtype == want.dtype and torch.equal(t, want)


def test_shared_expert_scopes_encode_against_their_mean_and_send_what_they_say(world_results):
    e = E // WORLD
    payload = 3 * e * compressed_nbytes(H * F, 4.0, 4)
    shared = 3 * H * F * 4
    for rank, res in enumerate(world_results):
        scopes = res["compressed"]["scopes"]
        peer = rank ^ 1  # the domain (2,): ranks {0, 1} and {2, 3}
        offset = rank ^ 2  # the offset group: one rank per domain
        want_all, want_none = [0] * WORLD, [0] * WORLD
        want_all[peer], want_all[offset] = payload + shared, shared
        want_none[peer] = payload
        assert scopes["all"] == {"peer_bytes": want_all, "collectives": 3}  # 2 all-reduces
        assert scopes["none"] == {"peer_bytes": want_none, "collectives": 1}
