"""EP = 2 and 4 on real gloo worlds: outputs and gradients equal the reference and EP = 1.

One spawned world per EP size runs every case (spawning costs seconds on 2 cores). Each rank
regenerates every rank's input from a seeded generator, so it can run the reference on the whole
world's tokens: expert gradients on an EP rank hold every rank's contribution, and the router's
(replicated) gradient summed over ranks must equal the reference's.

Tolerances: arithmetic is compared with ``assert_close_to_ref`` (fast path at most 2x the error
of the float32 reference against a float64 one, see its docstring). Index paths (routing,
counts, bytes) are compared exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moesaic
from moesaic.strategies import strategy_names
from moesaic.testing import (
    assert_close_to_ref,
    reference_world,
    route_all_to_first_experts,
    run_world,
)

H, F, E = 16, 24, 8

# Routing scenarios: (name, MoEConfig overrides, tokens per rank (callable of rank), routing).
# Every registered strategy runs every scenario: nothing below branches on a strategy's name.
SCENARIOS = [
    ("default", {}, lambda r: 12, None),
    ("capacity-drops", {"capacity_factor": 0.75}, lambda r: 12, None),
    ("capacity-large", {"capacity_factor": 4.0}, lambda r: 12, None),  # >= any load: no drops
    (
        "sigmoid-gelu-unnormalised",
        {"score_func": "sigmoid", "activation": "gelu", "normalize_topk": False},
        lambda r: 12,
        None,
    ),
    # uneven batches, and rank 1 has no tokens at all
    ("rank-without-tokens", {}, lambda r: 0 if r == 1 else 5 + 3 * r, None),
    # every token to experts 0 and 1 (rank 0): all other ranks receive zero tokens
    ("all-to-one-rank", {}, lambda r: 9, "one_rank"),
    # top-1: literally every token to expert 0
    ("all-to-one-expert", {"top_k": 1}, lambda r: 9, "one_rank"),
    ("one-token-per-rank", {}, lambda r: 1, None),
    ("k-equals-E", {"top_k": E}, lambda r: 6, None),
    # DeepSeek-V3 / Qwen2-MoE layer features: a gated shared expert, 4 groups of which a
    # token keeps 2, scaled weights; then a score bias moving choices ("bias": set below),
    # the sequence-wise loss and the global-batch balance loss (loads all-reduced; rank 1,
    # without tokens, still takes part in that all-reduce)
    (
        "shared-groups-scaled",
        {
            "score_func": "sigmoid",
            "num_shared_experts": 1,
            "shared_expert_hidden_size": 8,
            "shared_expert_gate": True,
            "num_expert_groups": 4,
            "topk_groups": 2,
            "routed_scaling_factor": 2.5,
        },
        lambda r: 12,
        None,
    ),
    (
        "bias-seq-global",
        {
            "score_bias_update_rate": 1e-3,
            "seq_aux_loss_coef": 0.3,
            "balance_loss_scope": "global",
            "aux_loss_coef": 0.5,
        },
        lambda r: 0 if r == 1 else 4 + 3 * r,
        "bias",
    ),
]


def parity_cases(strategies: tuple[str, ...]) -> list:
    """Every scenario for each of ``strategies``: ``(name, overrides, tokens, routing)``."""
    return [
        (f"{scenario}/{strategy}", {**overrides, "dispatcher": strategy}, tokens, routing)
        for strategy in strategies
        for scenario, overrides, tokens, routing in SCENARIOS
    ]


CASES = parity_cases(strategy_names())


def _inputs(rank: int, n_tokens: int, one_rank: bool) -> torch.Tensor:
    # Same seed in every case: cases that differ only in dispatcher see the same data.
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(n_tokens, H, generator=gen)
    if one_rank:
        x[:, 0] = x[:, 0].abs() + 1.0  # a positive feature the router keys on
    return x


def _build(overrides: dict, routing: str | None):
    cfg = moesaic.MoEConfig(
        hidden_size=H, ffn_hidden_size=F, num_experts=E, init_std=0.5, **overrides
    )
    torch.manual_seed(4321)
    layer = moesaic.MoELayer(cfg)
    sd = route_all_to_first_experts(layer) if routing == "one_rank" else layer.full_state_dict()
    if routing == "bias":  # large enough to move choices (softmax scores of 8 experts)
        sd["router.score_bias"] = torch.linspace(-0.2, 0.2, E)
        layer.load_full_state_dict(sd)
    return cfg, layer, sd


def _init_cfg() -> moesaic.MoEConfig:
    return moesaic.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E)


def ep_worker(rank: int, world: int, strategies: tuple[str, ...] | None = None) -> dict:
    """Every case of ``strategies`` (default: every registered one) on this rank."""
    cases = CASES if strategies is None else parity_cases(strategies)
    # Initialisation independent of the EP size: this rank's shard, and the gathered whole.
    torch.manual_seed(99)
    layer = moesaic.MoELayer(_init_cfg())
    results = {
        "_init": {
            "local": {n: p.detach().clone() for n, p in layer.named_parameters()},
            "full": layer.full_state_dict(),
        }
    }
    # An expert count the EP size does not divide is refused on every rank, before any collective.
    with pytest.raises(ValueError, match=rf"num_experts \(5\) .* expert-parallel size \({world}\)"):
        moesaic.MoELayer(moesaic.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=5))
    # Resharding: a full state loaded on EP = N gives each rank its slice, and gathers back.
    torch.manual_seed(7)
    other = moesaic.MoELayer(_init_cfg()).full_state_dict()
    layer.load_full_state_dict(other)
    for key, value in layer.full_state_dict().items():
        assert torch.equal(value, other[key]), key
    for name, overrides, tokens, routing in cases:
        cfg, layer, sd = _build(overrides, routing)
        xs = [_inputs(p, tokens(p), routing == "one_rank") for p in range(world)]
        gs = [
            torch.randn(x.shape, generator=torch.Generator().manual_seed(7 + p))
            for p, x in enumerate(xs)
        ]
        x = xs[rank].clone().requires_grad_()
        before = layer.ep.traffic.snapshot()
        y = layer(x)
        after = layer.ep.traffic.snapshot()
        aux = moesaic.aux_loss(layer)
        ((y * gs[rank]).sum() + aux).backward()

        ref = reference_world(cfg, sd, xs, gs)
        (y32, a32, gx32, gw32), (y64, a64, gx64, gw64) = ref[torch.float32], ref[torch.float64]
        tag = f"{name} rank {rank}"
        assert_close_to_ref(y.detach(), y32[rank].detach(), y64[rank].detach(), f"{tag} y")
        assert_close_to_ref(aux.detach(), a32[rank].detach(), a64[rank].detach(), f"{tag} aux")
        assert_close_to_ref(x.grad, gx32[rank], gx64[rank], f"{tag} x.grad")
        lo, hi = rank * E // world, (rank + 1) * E // world
        for pname in sd:
            if not pname.startswith("experts."):
                continue
            got = getattr(layer.experts, pname.split(".")[1]).grad
            assert_close_to_ref(
                got,
                gw32[pname][lo:hi],
                gw64[pname][lo:hi],
                f"{tag} {pname}.grad",
            )
        router_grad = layer.router.weight.grad.clone()
        dist.all_reduce(router_grad)
        assert_close_to_ref(
            router_grad, gw32["router.weight"], gw64["router.weight"], f"{tag} router.grad"
        )

        # The strategy's own accounting equals what the group actually sent, peer by peer.
        stats = layer.take_stats()
        sent_P = [b - a for a, b in zip(before[0], after[0])]
        assert list(stats.comm.peer_bytes_P) == sent_P, tag
        assert stats.comm.collectives == after[1] - before[1], tag
        assert stats.comm.total_bytes == sum(sent_P), tag
        assert stats.forwards == 1 and stats.tokens == x.shape[0], tag
        results[name] = {
            "y": y.detach(),
            "x_grad": x.grad,
            "w1_grad": layer.experts.w1.grad,
            "counts": stats.counts_E,
        }
    return results


def _ep1_outputs(world: int, cases: list) -> dict:
    """The same cases on an EP = 1 layer in this process."""
    out = {}
    for name, overrides, tokens, routing in cases:
        _, layer, _ = _build(overrides, routing)
        ys = []
        for p in range(world):
            ys.append(layer(_inputs(p, tokens(p), routing == "one_rank")).detach())
        out[name] = ys
    return out


def _check_init(per_rank: list[dict], world: int) -> None:
    torch.manual_seed(99)
    ep1 = moesaic.MoELayer(_init_cfg())
    e = E // world
    for r in range(world):
        init = per_rank[r]["_init"]
        for name, param in ep1.named_parameters():
            want = param if name.startswith("router") else param[r * e : (r + 1) * e]
            assert torch.equal(init["local"][name], want), (r, name)
        for key, value in ep1.full_state_dict().items():
            assert torch.equal(init["full"][key], value), (r, key)


@pytest.mark.parametrize("world", [2, 4])
def test_ep_equals_reference_and_ep1(world):
    per_rank = run_world(ep_worker, world, timeout_s=240)
    check_parity(per_rank, world, strategy_names())


def check_parity(per_rank: list[dict], world: int, strategies: tuple[str, ...]) -> None:
    """What ``ep_worker`` returned for ``strategies`` against EP = 1 and each other (the
    reference was checked on the ranks)."""
    _check_init(per_rank, world)
    cases = parity_cases(strategies)
    ep1 = _ep1_outputs(world, cases)
    for name, *_ in cases:
        for r in range(world):
            # EP = N and EP = 1 run the same fp32 ops on the same rows, grouped differently
            # into matmuls; CPU GEMM blocking may change the last bits, not more.
            torch.testing.assert_close(per_rank[r][name]["y"], ep1[name][r], rtol=1e-5, atol=1e-6)
    # Without drops every strategy computes the same thing (same tolerance, same reason).
    first, *others = strategies
    for scenario in ("default", "capacity-large", "rank-without-tokens", "all-to-one-rank"):
        for other in others:
            for r in range(world):
                torch.testing.assert_close(
                    per_rank[r][f"{scenario}/{other}"]["y"],
                    per_rank[r][f"{scenario}/{first}"]["y"],
                    rtol=1e-5,
                    atol=1e-6,
                )
    # Ranks 1.. receive nothing when every token goes to experts 0 and 1, yet took part.
    for strategy in strategies:
        for r in range(world):
            counts = per_rank[r][f"all-to-one-rank/{strategy}"]["counts"]
            assert counts[2:].sum() == 0 and counts[:2].sum() == 9 * 2
            one = per_rank[r][f"all-to-one-expert/{strategy}"]["counts"]
            assert one.tolist() == [9] + [0] * (E - 1)
            assert per_rank[r][f"all-to-one-rank/{strategy}"]["w1_grad"].shape[0] == E // world
        for r in range(1, world):
            w1_grad = per_rank[r][f"all-to-one-rank/{strategy}"]["w1_grad"]
            assert torch.count_nonzero(w1_grad) == 0
