"""Every registered strategy delivers each routed row to the right expert and back, exactly.

Origin-encoded payloads (DeepEP style): token t of rank s carries ``s * 10^6 + t * 10 + 1`` in
every column, so each row an expert receives names its source rank and token. The fake experts
answer ``global expert id + 1`` on every row, and the combine weights are ``1000^k`` for choice
k, so a token's output ``sum_k 1000^k * (expert_k + 1)`` spells out which expert answered each
choice. float64 keeps every value exact: everything is compared with ``torch.equal``.

Nothing here branches on a strategy's name; a new registered strategy is tested by this file.
"""

from __future__ import annotations

import functools

import pytest
import torch

import moesaic
from moesaic.comm.collectives import EPGroup
from moesaic.placement import ExpertPlacement
from moesaic.routing import build_plan
from moesaic.strategies import get_strategy, make_strategy, strategy_names
from moesaic.strategies.base import StrategyContext
from moesaic.testing import run_world

H, E = 4, 6

# (name, top_k, tokens of rank r, capacity, owners of the experts or None for contiguous)
SCENARIOS = [
    ("contiguous", 2, lambda r: 7 + 2 * r, None, None),
    ("rank-1-without-tokens", 2, lambda r: 0 if r == 1 else 5, None, None),
    ("capacity-drops", 3, lambda r: 8, 2, None),
    ("experts-not-contiguous", 2, lambda r: 6, None, (2, 0, 1, 0, 2, 1)),  # rank of expert g
    ("all-to-one-expert", 1, lambda r: 5, None, None),
]


def _ids(rank: int, scenario: str, T: int, K: int) -> torch.Tensor:
    # A seed fixed across processes (str hashes are salted per process).
    gen = torch.Generator().manual_seed(sum(map(ord, scenario)) * 10 + rank)
    if scenario == "all-to-one-expert":
        return torch.full((T, K), 3, dtype=torch.long)
    rows = [torch.randperm(E, generator=gen)[:K] for _ in range(T)]
    return torch.stack(rows) if rows else torch.empty(0, K, dtype=torch.long)


def _payload(rank: int, T: int) -> torch.Tensor:
    return (rank * 1e6 + torch.arange(T, dtype=torch.float64) * 10 + 1).unsqueeze(1).repeat(1, H)


class _RecordingExperts:
    """Records the rows each local expert receives; answers ``global id + 1`` on every row."""

    def __init__(self, local_ids: tuple[int, ...]) -> None:
        self.local_ids = local_ids
        self.received: list[torch.Tensor] = []

    def __call__(self, x_MH: torch.Tensor, counts_e: list[int]) -> torch.Tensor:
        self.received.extend(x_MH.split(counts_e))
        ids_M = torch.tensor(self.local_ids, dtype=torch.float64)
        ids_M = ids_M.repeat_interleave(torch.tensor(counts_e))
        return (ids_M + 1).unsqueeze(1).expand(-1, H).clone()


def scenarios_for(world: int) -> list:
    """The scenarios a world of ``world`` ranks can hold (explicit owners name ranks < world)."""
    return [s for s in SCENARIOS if s[4] is None or max(s[4]) < world]


def row_strategies(names: tuple[str, ...] | None = None) -> list[str]:
    """Strategies (of ``names``, default every registered one) that hand rows to the
    ``experts`` callable. Those that compute with the weights themselves
    (``needs_expert_weights``: hybrid moves experts, taskflow runs them in tile tasks) are
    checked row by row in their own tests (tests/placement/test_hybrid.py,
    tests/taskflow/test_concurrent.py)."""
    names = strategy_names() if names is None else names
    return [s for s in names if not get_strategy(s).needs_expert_weights]


def layout_worker(rank: int, world: int, names: tuple[str, ...] | None = None) -> list[str]:
    """Every scenario that fits ``world`` ranks (``scenarios_for``) for each of
    ``row_strategies(names)``; returns the tags checked."""
    checked = []
    for strategy in row_strategies(names):
        for scenario, K, tokens, capacity, owners in scenarios_for(world):
            tag = f"{strategy}/{scenario} rank {rank}"
            cfg = moesaic.MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=E, top_k=K)
            if owners is None:
                placement = ExpertPlacement.contiguous(E, world)
            else:
                placement = ExpertPlacement.from_owners(owners, world)
            ctx = StrategyContext(cfg, EPGroup(None, 60.0), placement)
            strat = make_strategy(strategy, ctx)
            plans = []
            for s in range(world):
                T = tokens(s)
                weights = (1000.0 ** torch.arange(K, dtype=torch.float64)).expand(T, K)
                plans.append(build_plan(_ids(s, scenario, T, K), weights, placement, capacity))
            plan = plans[rank]
            local_ids = placement.local_experts(rank)
            experts = _RecordingExperts(local_ids)
            y_TH = strat.forward(_payload(rank, plan.num_tokens), plan, experts).y_TH
            received = experts.received
            # Combine: each kept choice k of token t came back from its expert, weighted 1000^k.
            kept = plan.kept_TK.to(torch.float64)
            want_T = (kept * 1000.0 ** torch.arange(K) * (plan.topk_ids_TK + 1)).sum(dim=1)
            assert torch.equal(y_TH, want_T.unsqueeze(1).expand(-1, H)), tag
            # Dispatch: expert g received exactly the kept rows routed to it, from every rank.
            assert len(received) == len(local_ids), tag
            for g, rows in zip(local_ids, received):
                assert torch.equal(rows, rows[:, :1].expand(-1, H)), tag  # rows arrive whole
                values = rows[:, 0][rows[:, 0] != 0]  # zero rows are padding
                want = [
                    s * 1e6 + int(t) * 10 + 1
                    for s, p in enumerate(plans)
                    for t, k in zip(*torch.nonzero(p.topk_ids_TK == g, as_tuple=True))
                    if p.kept_TK[t, k]
                ]
                got = torch.sort(values).values
                assert torch.equal(got, torch.tensor(sorted(want), dtype=torch.float64)), (tag, g)
            checked.append(tag)
    return checked


def placed_layer_worker(rank: int, world: int, names: tuple[str, ...] | None = None) -> list[str]:
    """A layer with experts placed out of order computes what the contiguous one does."""
    owners = (2, 0, 1, 0, 2, 1)
    checked = []
    for strategy in strategy_names() if names is None else names:
        cfg = moesaic.MoEConfig(
            hidden_size=H, ffn_hidden_size=8, num_experts=E, init_std=0.5, dispatcher=strategy
        )
        torch.manual_seed(5)
        contiguous = moesaic.MoELayer(cfg)
        torch.manual_seed(5)
        placed = moesaic.MoELayer(cfg, placement=ExpertPlacement.from_owners(owners, world))
        # Same seed: each rank holds bitwise the experts it was given, whatever their ids.
        full = contiguous.full_state_dict()
        for key, value in placed.full_state_dict().items():
            assert torch.equal(value, full[key]), (strategy, key)
        local = list(placed.placement.local_experts(rank))
        assert torch.equal(placed.experts.w1.detach(), full["experts.w1"][local])
        x = torch.randn(5 + rank, H, generator=torch.Generator().manual_seed(rank))
        y_c, y_p = contiguous(x), placed(x)
        torch.testing.assert_close(y_p, y_c, rtol=1e-6, atol=1e-7)  # other GEMM groupings
        checked.append(strategy)
    return checked


def _both_workers(rank: int, world: int) -> tuple[list, list]:
    return layout_worker(rank, world), placed_layer_worker(rank, world)


@functools.cache
def _world_of_3() -> list[tuple[list, list]]:
    """Both checks, one after the other, in one spawned world of 3 (a spawn costs seconds)."""
    return run_world(_both_workers, 3, timeout_s=120)


def test_every_strategy_delivers_rows_exactly():
    per_rank = [layout for layout, _ in _world_of_3()]
    want = len(row_strategies()) * len(SCENARIOS)  # all of them fit 3 ranks
    assert all(len(tags) == want for tags in per_rank)


def test_layer_with_experts_placed_out_of_order_matches_contiguous():
    per_rank = [placed for _, placed in _world_of_3()]
    assert all(tags == list(strategy_names()) for tags in per_rank)


def test_placement_validation_names_the_rule():
    with pytest.raises(ValueError, match=r"each expert id 0\.\.3 exactly once"):
        ExpertPlacement(4, ((0, 1), (1, 2)))
    with pytest.raises(ValueError, match="same number of experts"):
        ExpertPlacement(3, ((0, 1), (2,)))
    with pytest.raises(ValueError, match=r"owner of expert 1 \(5\) must be a rank in \[0, 2\)"):
        ExpertPlacement.from_owners([0, 5], 2)
    p = ExpertPlacement.from_owners([1, 0, 1, 0], 2)
    assert p.slot_of_expert == (2, 0, 3, 1) and p.local_experts(1) == (0, 2)
    assert p.peers([0, 3, 0, 0], rank=1) == (0,) and not p.is_contiguous
