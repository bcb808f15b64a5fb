"""The layer's fast paths against their reference paths and moesaic.reference (issue 13).

* grouped_mm: torch's own ``_grouped_mm`` backward and our explicit one agree with the loop.
* dropless: no regroup copy where the received rows already arrive in expert order (one rank,
  or one local expert per rank).
* RoutingPlan.unpermute: the no-drop path (a pure permutation, no zero row) and the drop path.
* padded: experts skip the padding (filled rows only; at EP 1 no buffer at all) with the outputs
  and gradients of computing on everything (``skip_padding = False``), EP 1 and 2, SwiGLU, GELU.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from moesaic import MoEConfig, MoELayer
from moesaic.comm.world import run_world
from moesaic.experts import _fast_path_ok, _grouped_mm_op, grouped_mm_reference
from moesaic.reference import ReferenceMoE
from moesaic.routing import build_plan
from moesaic.strategies.padded import PaddedStrategy

CFG = MoEConfig(hidden_size=16, ffn_hidden_size=32, num_experts=4, top_k=2)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("counts", [[5, 0, 8], [13, 0, 0], [0, 0, 13]])
def test_grouped_mm_backwards_agree_with_the_loop(native, counts):
    if not _fast_path_ok(torch.device("cpu"), torch.float32, native):
        pytest.skip("this torch._grouped_mm path fails its self-check on CPU")
    x = torch.randn(sum(counts), 16, requires_grad=True)
    w = torch.randn(3, 16, 8, requires_grad=True)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    g = torch.randn(sum(counts), 8)
    fast = torch.autograd.grad(_grouped_mm_op(x, w, offs, native), (x, w), g)
    ref = torch.autograd.grad(grouped_mm_reference(x, w, counts), (x, w), g)
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_fast_path_probe_is_not_disabled_by_a_first_call_without_grad(context):
    """The probe runs a backward; a first forward under no_grad / inference_mode (evaluation
    before training) must not cache "no fast path" for the whole process (it did: every later
    training step then ran the per-group loop, measured ~9% slower)."""
    cpu = torch.device("cpu")
    _fast_path_ok.cache_clear()
    with_grad = [_fast_path_ok(cpu, torch.float32, native) for native in (True, False)]
    _fast_path_ok.cache_clear()
    try:
        with context():
            assert [_fast_path_ok(cpu, torch.float32, native) for native in (True, False)] == (
                with_grad
            )
    finally:
        _fast_path_ok.cache_clear()


def test_unpermute_without_drops_equals_the_zero_row_path():
    torch.manual_seed(0)
    T, K, E, H = 9, 2, 4, 5
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    y_NH = torch.randn(T * K, H)
    dropless = build_plan(ids, w, E)
    assert dropless.order_N.numel() == T * K
    got = dropless.unpermute(y_NH)
    # The zero-row path on the same plan (one extra, never-read row: forces N < T*K handling).
    slot = torch.full((T * K,), T * K, dtype=torch.long)
    slot[dropless.order_N] = torch.arange(T * K)
    expect = (torch.cat([y_NH, y_NH.new_zeros(1, H)])[slot].view(T, K, H) * w[..., None]).sum(1)
    assert torch.equal(got, expect)
    # With drops (capacity 1): dropped choices contribute zero.
    capped = build_plan(ids, w, E, capacity=1)
    n = capped.order_N.numel()
    y = capped.unpermute(y_NH[:n])
    for t in range(T):
        row = sum(
            w[t, k] * y_NH[(capped.order_N == t * K + k).nonzero().item()]
            for k in range(K)
            if capped.kept_TK[t, k]
        )
        torch.testing.assert_close(y[t], row if torch.is_tensor(row) else torch.zeros(H))


def _step(layer: MoELayer, x: torch.Tensor, g: torch.Tensor):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = layer(x)
    (y * g).sum().backward()
    layer.take_aux_terms()
    return [y.detach(), x.grad] + [p.grad for p in (layer.experts.w1, layer.experts.w2)]


def _padded_both_ways(rank: int, world: int, activation: str, skewed: bool) -> list[float]:
    """Padded skipping the padding vs computing on it, same weights and input: the largest
    difference of the output and each gradient (GEMMs of other row counts may block the sums
    differently, so a few ulps, not bitwise)."""
    cfg = dataclasses.replace(CFG, dispatcher="padded", capacity_factor=1.0, activation=activation)
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    if skewed:
        with torch.no_grad():
            layer.router.weight[:, 0] = -2.0 * torch.arange(4.0)
    gen = torch.Generator().manual_seed(rank)
    x, g = torch.randn(24, 16, generator=gen), torch.randn(24, 16, generator=gen)
    if skewed:
        x[:, 0] = 1.0
    x[3] = 0.0  # a real all-zero token: skipping it must still be exact (SwiGLU) or not happen
    fast = _step(layer, x, g)
    assert isinstance(layer.strategy, PaddedStrategy)
    handle = layer.strategy.dispatch_send(x, layer.route(x).plan).handle
    layer.take_aux_terms()
    assert handle.direct == (world == 1)  # the fast path was the one measured
    layer.strategy.skip_padding = False  # the instance attribute shadows the class default
    ref = _step(layer, x, g)
    return [
        (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30) for a, b in zip(fast, ref)
    ]


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("skewed", [False, True])
def test_padded_skipping_padding_is_exact_at_ep1(activation, skewed):
    assert max(_padded_both_ways(0, 1, activation, skewed)) < 1e-6


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_padded_skipping_padding_is_exact_at_ep2(activation):
    results = _ep2_results(("padded both ways", activation))
    assert max(max(r) for r in results) < 1e-6, results


def _padded_vs_reference(rank: int, world: int) -> float:
    cfg = dataclasses.replace(CFG, dispatcher="padded", capacity_factor=1.0)
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    ref = ReferenceMoE.from_full_state_dict(cfg, layer.full_state_dict())
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(rank))
    return (layer(x) - ref(x)[0]).abs().max().item()


def test_padded_fast_path_matches_the_reference_at_ep2():
    assert max(_ep2_results("padded vs reference")) < 1e-5


def _dropless_regroup(rank: int, world: int, experts: int) -> tuple[bool, float]:
    cfg = dataclasses.replace(CFG, num_experts=experts)
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    ref = ReferenceMoE.from_full_state_dict(cfg, layer.full_state_dict())
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(rank))
    out = layer.strategy.dispatch_send(x, layer.route(x).plan)
    layer.take_aux_terms()
    no_copy = out.handle.regroup_M is None
    return no_copy, (layer(x) - ref(x)[0]).abs().max().item()


# The EP 2 checks above and below in one spawned world (a spawn costs seconds on 2 cores): per
# key, the worker and its arguments after (rank, world).
EP2_JOBS = {
    ("padded both ways", "swiglu"): (_padded_both_ways, ("swiglu", True)),
    ("padded both ways", "gelu"): (_padded_both_ways, ("gelu", True)),
    "padded vs reference": (_padded_vs_reference, ()),
    ("dropless regroup", 2): (_dropless_regroup, (2,)),
    ("dropless regroup", 4): (_dropless_regroup, (4,)),
}


def _ep2_worker(rank: int, world: int) -> dict:
    return {key: fn(rank, world, *args) for key, (fn, args) in EP2_JOBS.items()}


@functools.cache
def _ep2_world() -> list[dict]:
    return run_world(_ep2_worker, 2, timeout_s=120)


def _ep2_results(key) -> list:
    """Per rank, what ``EP2_JOBS[key]`` returned in the shared EP 2 world."""
    return [r[key] for r in _ep2_world()]


@pytest.mark.parametrize(
    ("world", "experts", "no_copy"), [(1, 4, True), (2, 2, True), (2, 4, False)]
)
def test_dropless_regroups_only_when_rows_arrive_out_of_expert_order(world, experts, no_copy):
    results = (
        [_dropless_regroup(0, 1, experts)]
        if world == 1
        else _ep2_results(("dropless regroup", experts))
    )
    for skipped, err in results:
        assert skipped == no_copy and err < 1e-5


def test_permute_rows_backward_is_the_inverse_gather():
    from moesaic.routing import PermuteRows

    perm = torch.randperm(11)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(11)
    x = torch.randn(11, 3, requires_grad=True)
    g = torch.randn(11, 3)
    (fast,) = torch.autograd.grad(PermuteRows.apply(x, perm, inverse), x, g)
    (ref,) = torch.autograd.grad(x.index_select(0, perm), x, g)
    assert torch.equal(fast, ref)


@pytest.mark.parametrize("rows", [12, 7])  # all T*K = 12 assignments (gather), or the kept 7
def test_replicate_tokens_backward_equals_index_selects(rows):
    """The permute's backward: a gather of each token's K rows and a sum when every assignment
    has a row, the index_add of a general index_select otherwise; the same values."""
    from moesaic.routing import _ReplicateTokens

    T, K = 4, 3
    order = torch.randperm(T * K)[:rows]
    x = torch.randn(T, 5, requires_grad=True, dtype=torch.float64)
    g = torch.randn(rows, 5, dtype=torch.float64)
    (fast,) = torch.autograd.grad(_ReplicateTokens.apply(x, order, K), x, g)
    (ref,) = torch.autograd.grad(x.index_select(0, order // K), x, g)
    assert torch.allclose(fast, ref, rtol=0, atol=1e-12)
