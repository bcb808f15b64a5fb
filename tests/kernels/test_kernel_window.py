"""The symmetric window's slot map (``kernels.window``) against ``taskflow.layout``'s offsets,
and ``permute`` filling the window's dispatch staging cells (tests/kernels/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from moesaic.kernels.window import window_slots
from moesaic.routing import build_plan
from moesaic.taskflow.layout import STAGING, SymmetricLayout


@pytest.mark.parametrize(
    ("P", "e", "T", "K", "capacity"),
    [
        (2, 2, 9, 2, 3),  # capacity drops; C = 3 aligned up to C' = 4
        (3, 1, 7, 3, 8),  # K = E, nothing dropped, C' = C
        (1, 5, 1, 1, 1),  # T = 1, four empty experts
    ],
)
def test_window_slots_match_the_layout(P, e, T, K, capacity):
    gen = torch.Generator().manual_seed(P * 10 + T)
    E = P * e
    topk_ids_TK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    plan = build_plan(topk_ids_TK, torch.rand(T, K, generator=gen), E, capacity=capacity)
    layout = SymmetricLayout(
        world_size=P, local_experts=e, capacity=capacity, hidden_size=16, dtype_bytes=4, tile_m=4
    )
    slot_TK = window_slots(
        plan.topk_ids_TK, plan.kept_TK, local_experts=e, aligned_capacity=layout.aligned_capacity
    )
    # the host reference: kept assignments of each expert in token order fill its cell's rows
    seen = [0] * E
    for t in range(T):
        for k in range(K):
            x = int(topk_ids_TK[t, k])
            if not plan.kept_TK[t, k]:
                assert slot_TK[t, k] == -1
                continue
            offset = layout.offset(x // e, 0, STAGING, x % e, seen[x])
            assert int(slot_TK[t, k]) * layout.row_bytes == offset
            seen[x] += 1


def test_permute_fills_the_window():
    pytest.importorskip("triton")
    from moesaic.kernels.permute import permute, permute_reference

    P, e, T, K, C = 2, 2, 11, 2, 4
    topk_ids_TK = torch.stack([torch.randperm(P * e)[:K] for _ in range(T)])
    plan = build_plan(topk_ids_TK, torch.rand(T, K), P * e, capacity=C)
    layout = SymmetricLayout(
        world_size=P, local_experts=e, capacity=C, hidden_size=24, dtype_bytes=4, tile_m=8
    )
    slot_TK = window_slots(
        plan.topk_ids_TK, plan.kept_TK, local_experts=e, aligned_capacity=layout.aligned_capacity
    )
    rows = layout.payload_bytes // layout.row_bytes
    x_TH = torch.arange(1, T + 1, dtype=torch.float32)[:, None].expand(T, 24)  # token t: t + 1
    window_RH = permute(x_TH, slot_TK, rows)
    assert torch.equal(window_RH, permute_reference(x_TH, slot_TK, rows))
    kept = slot_TK >= 0
    token_TK = torch.arange(1, T + 1)[:, None].expand(T, K)
    assert torch.equal(window_RH[slot_TK[kept], 0], token_TK[kept].float())
    assert int(window_RH.any(dim=1).sum()) == int(kept.sum())  # padding, other cells: zero
