"""``dropless``: payload-efficient all-to-all-v (FlashDMoE §5.4): only routed rows travel.

Shape legend: T tokens, H hidden, e local experts, P ranks, N rows this rank sends, M rows it
receives. Counts go first (one small all-to-all of ``[P, e]`` int64), then the rows with exact
splits; the backward of each row all-to-all is the all-to-all of the gradients with the splits
swapped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moesaic.strategies.base import CommStats, DispatchCombineStrategy, ExchangeHandle, Outbound


@dataclass(frozen=True, slots=True)
class DroplessHandle(ExchangeHandle):
    """The plan, the two splits, the regroup permutation and the rows per local expert."""

    # received row order (source, expert) -> (expert, source); None when that is the identity
    # (one rank or one local expert: the rows already arrive grouped by expert)
    regroup_M: torch.Tensor | None
    counts_e: list[int]  # rows received per local expert
    inverse_M: torch.Tensor | None = None  # the inverse permutation of regroup_M


class _PermuteRows(torch.autograd.Function):
    """``x.index_select(0, perm)`` for a permutation: its backward is the gather by the inverse
    permutation (no zero fill and scatter-add as for a general index_select; same values)."""

    @staticmethod
    def forward(ctx, x_MH, perm_M, inverse_M):
        ctx.save_for_backward(inverse_M)
        return x_MH.index_select(0, perm_M)

    @staticmethod
    def backward(ctx, grad_MH):
        (inverse_M,) = ctx.saved_tensors
        return grad_MH.index_select(0, inverse_M), None, None


class DroplessStrategy(DispatchCombineStrategy[DroplessHandle]):
    """All-to-all-v of the kept rows, no padding; experts see (local expert, source rank) order."""

    name = "dropless"

    def dispatch_send(self, x_TH, plan):
        P, e = self.group.size, self.placement.num_local
        x_NH = plan.permute(x_TH)
        send_counts_Pe = plan.counts_Pe
        recv_counts_Pe = torch.empty_like(send_counts_Pe)
        self.group.all_to_all_single(recv_counts_Pe, send_counts_Pe, what="dispatch counts")
        in_splits = send_counts_Pe.sum(dim=1).tolist()
        out_splits = recv_counts_Pe.sum(dim=1).tolist()
        # Received rows are ordered (source rank, local expert); the experts want them
        # (local expert, source rank): a stable sort of the segment keys.
        regroup_M = inverse_M = None
        if P > 1 and e > 1:
            seg_keys = torch.arange(e).repeat(P) * P + torch.arange(P).repeat_interleave(e)
            row_keys_M = seg_keys.repeat_interleave(recv_counts_Pe.reshape(-1).cpu())
            regroup_M = torch.sort(row_keys_M, stable=True).indices.to(x_TH.device)
            inverse_M = torch.empty_like(regroup_M)
            inverse_M[regroup_M] = torch.arange(regroup_M.numel(), device=regroup_M.device)
        row_bytes = x_TH.shape[-1] * x_TH.element_size()
        meta_peer = self.to_every_peer(e * send_counts_Pe.element_size())
        peer_bytes = self.peer_bytes(in_splits, out_splits, row_bytes)
        stats = CommStats(
            dispatch_bytes=self.off_rank(in_splits) * row_bytes,
            combine_bytes=self.off_rank(out_splits) * row_bytes,
            meta_bytes=sum(meta_peer),
            dropped_rows=plan.kept_TK.numel() - plan.order_N.numel(),
            collectives=3 if P > 1 else 0,
            peer_bytes_P=tuple(a + b for a, b in zip(peer_bytes, meta_peer)),
        )
        handle = DroplessHandle(
            plan=plan,
            in_splits_P=in_splits,
            out_splits_P=out_splits,
            regroup_M=regroup_M,
            counts_e=recv_counts_Pe.sum(dim=0).tolist(),
            inverse_M=inverse_M,
        )
        return Outbound(x_NH, handle, stats)

    def dispatch_recv(self, rows, handle):
        if handle.regroup_M is None:  # no copy: the rows are already in expert order
            return rows, handle.counts_e
        return _PermuteRows.apply(rows, handle.regroup_M, handle.inverse_M), handle.counts_e

    def combine_send(self, y_MH, handle):
        if handle.regroup_M is None:
            return y_MH
        return _PermuteRows.apply(y_MH, handle.inverse_M, handle.regroup_M)

    def combine_recv(self, rows, handle):
        return rows
