"""Routing invariants, compared exactly (they are index paths)."""

from __future__ import annotations

import pytest
import torch

import moesaic
from moesaic.placement import ExpertPlacement
from moesaic.reference import ReferenceMoE
from moesaic.routing import build_plan


def _random_ids(T, K, E, seed):
    gen = torch.Generator().manual_seed(seed)
    if T == 0:
        return torch.zeros(0, K, dtype=torch.long)
    return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).view(T, K)


@pytest.mark.parametrize(
    ("T", "K", "E", "P"),
    [
        (37, 2, 8, 4),  # uneven counts over 4 ranks
        (1, 1, 1, 1),  # one token, one expert
        (5, 7, 7, 1),  # K = E, prime E
        (0, 2, 4, 2),  # a rank with no tokens
    ],
)
def test_plan_counts_and_round_trip(T, K, E, P):
    ids = _random_ids(T, K, E, seed=T + K)
    weights = torch.rand(T, K)
    plan = build_plan(ids, weights, ExpertPlacement.contiguous(E, P))
    assert int(plan.counts_E.sum()) == T * K
    assert torch.equal(plan.counts_E, torch.bincount(ids.reshape(-1), minlength=E))
    assert torch.equal(plan.send_counts_P, plan.counts_E.view(P, -1).sum(1))
    # Expert-grouped order: experts non-decreasing, tokens ascending within an expert.
    experts_N = ids.reshape(-1)[plan.order_N]
    assert torch.all(experts_N[1:] >= experts_N[:-1])
    # Permute then unpermute with unit weights sums each token's K copies: K * x.
    x = torch.arange(T * 3, dtype=torch.float64).view(T, 3) * 1000 + 1
    ones = build_plan(ids, torch.ones(T, K), ExpertPlacement.contiguous(E, P))
    assert torch.equal(ones.unpermute(ones.permute(x)), K * x)
    # With one-hot weights on choice 0 the round trip is the identity.
    first = build_plan(ids, torch.nn.functional.one_hot(torch.zeros(T, dtype=torch.long), K), E)
    assert torch.equal(first.unpermute(first.permute(x)), x)


def test_permuted_rows_encode_their_source():
    T, K, E = 20, 2, 6
    ids = _random_ids(T, K, E, seed=3)
    plan = build_plan(ids, torch.rand(T, K), E)
    x = torch.arange(T, dtype=torch.float32).unsqueeze(1)  # row t holds t
    rows = plan.permute(x).squeeze(1).long()
    assert torch.equal(rows, plan.order_N // K)
    for n, flat in enumerate(plan.order_N.tolist()):
        assert rows[n] == flat // K


def test_capacity_drops_follow_the_documented_rule():
    cfg = moesaic.MoEConfig(
        hidden_size=4, ffn_hidden_size=4, num_experts=4, top_k=2, capacity_factor=0.5
    )
    T = 16
    ids = _random_ids(T, 2, 4, seed=11)
    cap = cfg.capacity(T)  # ceil(0.5 * 16 * 2 / 4) = 4
    assert cap == 4
    plan = build_plan(ids, torch.rand(T, 2), 4, capacity=cap)
    assert torch.all(plan.counts_E <= cap)
    want = ReferenceMoE(cfg).kept(ids)  # the reference's literal loop
    assert plan.kept_TK.tolist() == want
    assert int(plan.counts_E.sum()) == int(plan.kept_TK.sum())


def test_router_is_fp32_and_aux_loss_uniform_value():
    cfg = moesaic.MoEConfig(
        hidden_size=8,
        ffn_hidden_size=8,
        num_experts=4,
        top_k=1,
        z_loss_coef=0.0,
        aux_loss_coef=1.0,
    )
    router = moesaic.Router(cfg)
    torch.nn.init.zeros_(router.weight)
    x = torch.randn(8, 8, dtype=torch.bfloat16)
    plan, aux = router(x)
    assert plan.topk_weights_TK.dtype == torch.float32
    # A uniform router (all probabilities 1/E) gives exactly 1.0 whatever the assignment.
    assert aux.loss().item() == pytest.approx(1.0)
