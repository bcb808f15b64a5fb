"""The slot map of the symmetric window: where each assignment's row goes in FlashDMoE's ``L``.

Shape legend: T tokens, K top-k, E experts, P ranks, e local experts (E = P * e), C' aligned
capacity (rows per cell), R rounds, B buffers.

``taskflow.layout.SymmetricLayout`` lays one rank's window out as ``L = P x R x B x e x C' x H``;
viewed as rows ``[P*R*B*e*C', H]``, the row of slot c of cell (peer p, round r, buffer b, local
expert j) is ``(((p*R + r)*B + b)*e + j)*C' + c``. ``window_slots`` gives that row for every
assignment (its expert's peer and local index under the contiguous placement, its rank among
the kept assignments to that expert in token order), -1 for a dropped one or one past C'. It
is a ``permute`` slot map: ``permute(x_TH, window_slots(...), rows)`` fills the dispatch
staging cells in one pass, padding rows left zero. Torch only (no Triton), on the device: no
host sync.
"""

from __future__ import annotations

import torch


def window_slots(
    topk_ids_TK: torch.Tensor,
    kept_TK: torch.Tensor,
    *,
    local_experts: int,
    aligned_capacity: int,
    rounds: int = 2,
    buffers: int = 2,
    round: int = 0,
    buffer: int = 0,
) -> torch.Tensor:
    """Row of each assignment in the window ``L`` viewed as ``[P*R*B*e*C', H]`` (int64 [T, K]).

    Args:
        topk_ids_TK: global expert ids (``RoutingPlan.topk_ids_TK``); E = P * e, contiguous
            placement (expert x on rank ``x // e``).
        kept_TK: False where the capacity dropped the assignment (``RoutingPlan.kept_TK``).
        local_experts: e.
        aligned_capacity: C' (``SymmetricLayout.aligned_capacity``).
        rounds, buffers: R and B of the layout.
        round, buffer: the cell's round (0 dispatch, 1 combine) and buffer (0 staging, 1
            incoming).
    """
    if not 0 <= round < rounds or not 0 <= buffer < buffers:
        raise ValueError(f"round {round} / buffer {buffer} outside R={rounds}, B={buffers}")
    if local_experts <= 0 or aligned_capacity <= 0:
        raise ValueError("local_experts and aligned_capacity must be > 0")
    T, K = topk_ids_TK.shape
    device = topk_ids_TK.device
    ids = topk_ids_TK.reshape(-1)
    kept = kept_TK.reshape(-1)
    # rank of each kept assignment among its expert's, in token order (a stable sort by expert)
    sentinel = ids.max() + 1 if ids.numel() else ids.new_zeros(())  # dropped sort last
    keys = torch.where(kept, ids, sentinel)
    order = torch.sort(keys, stable=True).indices
    sorted_keys = keys[order]
    first = torch.searchsorted(sorted_keys, sorted_keys, right=False)
    pos = torch.empty_like(ids)
    pos[order] = torch.arange(ids.numel(), device=device) - first
    peer, local = ids // local_experts, ids % local_experts
    cell = ((peer * rounds + round) * buffers + buffer) * local_experts + local
    slot = cell * aligned_capacity + pos
    return torch.where(kept & (pos < aligned_capacity), slot, -1).view(T, K)
