"""Routing and layer features of today's MoE models against the reference written from the papers.

Shared experts (DeepSeek-MoE, Qwen2-MoE's gate), auxiliary-loss-free balancing and group-limited
routing (DeepSeek-V3), the routed scaling factor (DeepSeek-V2/V3), the sequence-wise balance
loss (DeepSeek-V3) and the global-batch balance scope (Qwen3): forward, aux loss and every
gradient of an EP = 1 layer against ``ReferenceMoE`` (the relative rule of
``assert_close_to_ref``). EP = 2 and 4 run the same options in tests/test_ep_parity.py.
"""

from __future__ import annotations

import pytest
import torch

import moesaic
from moesaic.reference import ReferenceMoE
from moesaic.testing import assert_close_to_ref

H, F = 12, 20


def _cfg(**overrides) -> moesaic.MoEConfig:
    base = {"hidden_size": H, "ffn_hidden_size": F, "num_experts": 8, "top_k": 2}
    return moesaic.MoEConfig(init_std=0.5, **{**base, **overrides})


def _layer(cfg: moesaic.MoEConfig, bias: bool = False, seed: int = 0) -> moesaic.MoELayer:
    torch.manual_seed(seed)
    layer = moesaic.MoELayer(cfg)
    if bias:  # a bias large enough to change choices (scores are in (0, 1))
        sd = layer.full_state_dict()
        sd["router.score_bias"] = torch.linspace(-0.4, 0.4, cfg.num_experts)
        layer.load_full_state_dict(sd)
    return layer


def _compare(cfg: moesaic.MoEConfig, x: torch.Tensor, bias: bool = False) -> dict:
    """Forward, aux loss and every gradient of the layer against the reference; the errors."""
    layer = _layer(cfg, bias)
    sd = layer.full_state_dict()
    x = x.clone().requires_grad_()
    y = layer(x)
    aux = moesaic.aux_loss(layer)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    ((y * g).sum() + aux).backward()
    refs = {}
    for dtype in (torch.float32, torch.float64):
        ref = ReferenceMoE.from_full_state_dict(cfg, sd).to(dtype)
        xr = x.detach().to(dtype).requires_grad_()
        yr, auxr = ref(xr)
        ((yr * g.to(dtype)).sum() + auxr).backward()
        refs[dtype] = (yr.detach(), auxr.detach(), xr.grad, dict(ref.named_parameters()))
    (y32, a32, gx32, p32), (y64, a64, gx64, p64) = refs[torch.float32], refs[torch.float64]
    assert_close_to_ref(y.detach(), y32, y64, "y")
    assert_close_to_ref(aux.detach(), a32, a64, "aux")
    assert_close_to_ref(x.grad, gx32, gx64, "x.grad")
    names = [n for n, _ in layer.named_parameters()]
    assert sorted(names) == sorted(p64), "the reference has the layer's parameters"
    errors = {"y": (y.detach().double() - y64).abs().max().item()}
    for name, param in layer.named_parameters():
        assert_close_to_ref(param.grad, p32[name].grad, p64[name].grad, f"{name}.grad")
        errors[name] = (param.grad.double() - p64[name].grad).abs().max().item()
    return errors


CASES = [
    # two shared experts of their own width beside the routed ones (DeepSeek-MoE)
    ("shared", {"num_shared_experts": 2, "shared_expert_hidden_size": 8}, False),
    # Qwen2-MoE: one shared expert (width ffn_hidden_size) behind a sigmoid gate
    ("shared-gate", {"num_shared_experts": 1, "shared_expert_gate": True}, False),
    # 4 groups of 2, a token keeps the 2 best groups (sigmoid scores, DeepSeek-V3)
    ("groups", {"num_expert_groups": 4, "topk_groups": 2, "score_func": "sigmoid"}, False),
    # one group kept: all K choices inside one group of 4
    ("one-group", {"num_expert_groups": 2, "topk_groups": 1, "top_k": 3}, False),
    ("scaling", {"routed_scaling_factor": 2.5}, False),
    # the bias moves choices; weights stay the unbiased scores (normalised, scaled)
    (
        "bias",
        {"score_bias_update_rate": 1e-3, "score_func": "sigmoid", "routed_scaling_factor": 2.5},
        True,
    ),
    ("seq-aux", {"seq_aux_loss_coef": 0.3, "aux_loss_coef": 0.0}, False),
    ("global-scope", {"balance_loss_scope": "global", "aux_loss_coef": 1.0}, False),
    # all of DeepSeek-V3's routing at once, with a capacity dropping some choices
    (
        "deepseek-v3",
        {
            "score_func": "sigmoid",
            "top_k": 3,
            "num_expert_groups": 4,
            "topk_groups": 2,
            "score_bias_update_rate": 1e-3,
            "routed_scaling_factor": 2.5,
            "num_shared_experts": 1,
            "seq_aux_loss_coef": 0.1,
            "capacity_factor": 0.75,
        },
        True,
    ),
]


@pytest.mark.parametrize(("name", "overrides", "bias"), CASES, ids=[c[0] for c in CASES])
def test_feature_matches_reference(name, overrides, bias):
    # [B=3, T=5, H]: three sequences for the sequence-wise loss
    x = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(1))
    _compare(_cfg(**overrides), x, bias)


def test_bias_changes_the_choice_not_the_weights():
    cfg = _cfg(score_func="sigmoid", score_bias_update_rate=1e-3, normalize_topk=False)
    torch.manual_seed(0)
    layer = moesaic.MoELayer(cfg)
    x = torch.randn(16, H)
    with torch.no_grad():
        _, scores = layer.router.scores(x)
        layer.router.score_bias.copy_(torch.tensor([10.0, 10.0] + [0.0] * 6))
        plan, _ = layer.router(x)
    # every token picks experts 0 and 1, weighted by their unbiased scores
    assert torch.equal(plan.topk_ids_TK.sort(dim=1).values, torch.tensor([[0, 1]] * 16))
    torch.testing.assert_close(plan.topk_weights_TK, scores.gather(1, plan.topk_ids_TK))


def test_group_limited_choice_stays_inside_the_best_groups():
    cfg = _cfg(num_expert_groups=4, topk_groups=2, top_k=4, score_func="sigmoid")
    torch.manual_seed(0)
    router = moesaic.Router(cfg)
    torch.nn.init.normal_(router.weight, std=1.0)
    x = torch.randn(64, H)
    with torch.no_grad():
        _, scores = router.scores(x)
        ids = router.choose(scores)
    best2_TG = scores.view(64, 4, 2).sum(-1)  # groups of 2: their top-2 sum is the group's sum
    kept_TG = best2_TG.topk(2, dim=-1).indices.sort(dim=1).values
    assert torch.equal((ids // 2).sort(dim=1).values.unique_consecutive(dim=1), kept_TG)


def test_score_bias_update_rule_and_stats():
    """``bias += gamma * sign(mean_load - load_e)``; the stats count all choices before drops."""
    cfg = _cfg(score_bias_update_rate=0.5, capacity_factor=0.25)
    layer = _layer(cfg)
    x = torch.randn(2, 10, H)
    layer(x[0])
    layer(x[1])  # two forwards of one step: their loads add up
    stats = layer.take_stats()
    assert int(stats.routed_E.sum()) == 2 * 10 * 2 > int(stats.counts_E.sum())  # drops happened
    load = stats.routed_E.double()
    layer.update_score_bias(load)
    want = 0.5 * torch.sign(load.mean() - load)
    torch.testing.assert_close(layer.router.score_bias, want.float(), rtol=0, atol=0)
    assert "router.score_bias" in layer.state_dict()  # a buffer: saved with the model
    no_bias = _layer(_cfg())
    no_bias.update_score_bias(load)  # without a bias: nothing to update
    assert no_bias.router.score_bias is None and no_bias.take_stats().routed_E is None


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_sequence_and_global_losses_are_exact_over_chunks(chunks):
    """Chunks of whole sequences sum to the batch's aux loss (sequence mean, global loads)."""
    cfg = _cfg(seq_aux_loss_coef=0.5, balance_loss_scope="global", aux_loss_coef=1.0)
    layer = _layer(cfg)
    x = torch.randn(6, 4, H)
    layer.router.weight.requires_grad_(True)
    layer(x)
    whole = moesaic.aux_loss(layer)
    for part in x.tensor_split(chunks):
        layer(part)
    torch.testing.assert_close(moesaic.aux_loss(layer), whole, rtol=1e-6, atol=0)


def test_shared_experts_are_replicated_and_in_the_full_state():
    cfg = _cfg(num_shared_experts=2, shared_expert_gate=True)
    layer = _layer(cfg)
    keys = layer.full_state_keys()
    assert {"shared_experts.w1", "shared_experts.w3", "shared_experts.w2"} <= set(keys)
    assert layer.shared_experts.w1.shape == (H, 2 * F) and layer.shared_experts.gate.shape == (
        1,
        H,
    )
    assert not any(moesaic.layer.is_expert_param(p) for p in layer.shared_experts.parameters())
    other = _layer(cfg, seed=1)
    other.load_full_state_dict(layer.full_state_dict())
    x = torch.randn(4, H)
    assert torch.equal(other(x), layer(x))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_shared_experts": -1}, r"num_shared_experts \(-1\) must be >= 0"),
        ({"shared_expert_hidden_size": 0}, r"shared_expert_hidden_size \(0\) must be > 0"),
        ({"shared_expert_gate": True}, r"shared_expert_gate \(True\) needs num_shared_experts"),
        ({"score_bias_update_rate": -0.1}, r"score_bias_update_rate \(-0.1\) must be a finite"),
        ({"num_expert_groups": 3}, r"num_expert_groups \(3\) must divide num_experts \(8\)"),
        ({"num_expert_groups": 4, "topk_groups": 5}, r"topk_groups \(5\) must be <= 4"),
        ({"num_expert_groups": 4, "topk_groups": 0}, r"topk_groups \(0\) must be >= 1"),
        (
            {"num_expert_groups": 4, "topk_groups": 1, "top_k": 3},
            r"top_k \(3\) must be <= topk_groups \(1\) x experts per group \(2\) = 2",
        ),
        (
            {"routed_scaling_factor": 0.0},
            r"routed_scaling_factor \(0.0\) must be a finite number >",
        ),
        ({"seq_aux_loss_coef": float("inf")}, r"seq_aux_loss_coef \(inf\) must be a finite"),
        ({"balance_loss_scope": "world"}, r"balance_loss_scope \('world'\) must be one of"),
    ],
)
def test_bad_values_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        _cfg(**overrides)


def test_moe_layer_freq_places_the_moe_blocks():
    from moesaic.models.config import MoEGPTConfig

    cfg = MoEGPTConfig(n_layers=6, dense_layers=1, moe_layer_freq=2)
    assert [i for i in range(6) if cfg.is_moe_block(i)] == [2, 4]  # DeepSeek's rule
    assert cfg.num_moe_layers == 2 and cfg.first_moe_block == 2
    assert MoEGPTConfig(n_layers=3).num_moe_layers == 3  # default: every block
    with pytest.raises(ValueError, match=r"moe_layer_freq \(0\) must be > 0"):
        MoEGPTConfig(moe_layer_freq=0)
