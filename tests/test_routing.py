"""Routing invariants, compared exactly (they are index paths)."""

from __future__ import annotations

import pytest
import torch

import moesaic
from moesaic.placement import ExpertPlacement
from moesaic.reference import ReferenceMoE
from moesaic.router_gate import gate_logits
from moesaic.routing import _narrow_keys, build_plan


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


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_gate_logits_match_the_fp32_linear_forward_and_backward(x_dtype, w_dtype):
    """The half-precision gate (_GateLogits) against F.linear in fp32 on the same values:
    logits to fp32 rounding, the input gradient to its dtype's rounding, the weight gradient
    to fp32 rounding when the weight is fp32 (the two-term split) and to bf16's otherwise."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 96, generator=gen).to(x_dtype).requires_grad_()
    w = (0.05 * torch.randn(12, 96, generator=gen)).to(w_dtype).requires_grad_()
    g = torch.randn(300, 12, generator=gen)
    y = gate_logits(x, w)
    (y * g).sum().backward()
    x32 = x.detach().float().requires_grad_()
    w32 = w.detach().float().requires_grad_()
    y32 = torch.nn.functional.linear(x32, w32)
    (y32 * g).sum().backward()

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    assert y.dtype == torch.float32 and rel(y, y32) < 1e-5
    assert x.grad.dtype == x_dtype and w.grad.dtype == w_dtype
    # The input gradient: the fp32 one rounded to x's dtype, give or take the split's 2^-16.
    assert rel(x.grad, x32.grad.to(x_dtype).float()) < 1e-3
    assert rel(w.grad, w32.grad) < (1e-5 if w_dtype == torch.float32 else 4e-3)


def test_gate_logits_rejects_fp32_tokens():
    with pytest.raises(ValueError, match="x_TH must be bf16 or fp16"):
        gate_logits(torch.zeros(2, 4), torch.zeros(3, 4))


def test_router_routes_bf16_tokens_as_on_fp32_logits():
    """A bf16 router's choice and weights equal those of its fp32 linear on the same values."""
    cfg = moesaic.MoEConfig(hidden_size=64, ffn_hidden_size=8, num_experts=16, top_k=4)
    torch.manual_seed(5)
    router = moesaic.Router(cfg).to(torch.bfloat16)
    torch.nn.init.normal_(router.weight, std=0.2)
    x = torch.randn(500, 64).to(torch.bfloat16)
    plan, _ = router(x)
    logits = torch.nn.functional.linear(x.float(), router.weight.float())
    want = torch.topk(logits.softmax(-1), 4, dim=-1)
    assert torch.equal(plan.topk_ids_TK, want.indices)
    w = want.values / want.values.sum(-1, keepdim=True)
    torch.testing.assert_close(plan.topk_weights_TK, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("largest", [3, 255, 256, 40000, 2**31])
def test_narrow_sort_keys_give_the_same_stable_order(largest):
    keys = torch.randint(
        0, min(largest, 2**40) + 1, (3000,), generator=torch.Generator().manual_seed(1)
    )
    narrow = _narrow_keys(keys, largest)
    assert narrow.element_size() <= keys.element_size()
    want = torch.sort(keys, stable=True).indices
    assert torch.equal(torch.sort(narrow, stable=True).indices, want)


def test_z_loss_from_the_top_probability_equals_logsumexp_value_and_gradient():
    from moesaic.router_losses import z_loss

    gen = torch.Generator().manual_seed(7)
    logits = (4 * torch.randn(200, 16, generator=gen)).requires_grad_()
    probs = logits.softmax(-1)
    top = probs.argmax(-1, keepdim=True)
    fast = z_loss(logits, probs, top)
    (g_fast,) = torch.autograd.grad(fast, logits)
    slow = z_loss(logits)
    (g_slow,) = torch.autograd.grad(slow, logits)
    torch.testing.assert_close(fast, slow, rtol=1e-6, atol=0)
    torch.testing.assert_close(g_fast, g_slow, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("capacity", [None, 3])
def test_build_plan_with_the_routers_counts_equals_counting_again(capacity):
    from moesaic.routing import count_ids

    ids = _random_ids(40, 2, 6, seed=4)
    w = torch.rand(40, 2)
    want = build_plan(ids, w, 6, capacity=capacity)
    got = build_plan(ids, w, 6, capacity=capacity, all_counts_E=count_ids(ids.reshape(-1), 6))
    for f in ("counts_E", "order_TK", "kept_TK", "counts_Pe"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f


def test_plan_and_aux_terms_are_pytree_nodes():
    """``tree_flatten`` (what FSDP2 before torch 2.13 uses to find a unit's output tensors)
    reaches the plan's and the aux terms' tensors, and unflattening gives equal objects (the
    plan's slot cache anew)."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    from moesaic import MoEConfig
    from moesaic.routing import Router

    torch.manual_seed(0)
    router = Router(MoEConfig(hidden_size=8, ffn_hidden_size=16, num_experts=4, top_k=2))
    plan, aux = router(torch.randn(6, 8))
    leaves, spec = tree_flatten((plan, aux))
    grads = [t for t in leaves if torch.is_tensor(t) and t.requires_grad]
    assert any(t is plan.topk_weights_TK for t in grads)
    assert any(t is aux.probs_mean_E for t in grads) and any(t is aux.z for t in grads)
    plan2, aux2 = tree_unflatten(leaves, spec)
    assert type(plan2) is type(plan) and plan2.placement == plan.placement
    assert plan2.topk_weights_TK is plan.topk_weights_TK and plan2.num_kept == plan.num_kept
    assert plan2._slots == {} and plan2._slots is not plan._slots
    assert aux2 == aux
