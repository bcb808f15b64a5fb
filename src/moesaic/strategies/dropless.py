"""``dropless``: payload-efficient all-to-all-v (FlashDMoE §5.4): only routed rows travel.

Shape legend: T tokens, H hidden, e local experts, P ranks, N rows this rank sends, M rows it
receives. Counts go first (one small all-to-all of ``[P, e]`` int64), then the rows with exact
splits; the backward of each row all-to-all is the all-to-all of the gradients with the splits
swapped.

Host syncs: one per forward and none in the backward; none at all at EP 1 (no split sizes: the
experts take their counts on the device, ``experts.DeviceCounts``). The split sizes must be on
the host (they size the all-to-all), so the send counts and the received counts are read in one
``tolist``; N, M and the rows per local expert are sums of those. The regroup permutation and
the grouped matmul's offsets are computed on the device from the count tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moesaic.experts import DeviceCounts, GroupCounts
from moesaic.routing import PermuteRows
from moesaic.strategies.base import CommStats, DispatchCombineStrategy, ExchangeHandle, Outbound


@dataclass(frozen=True, slots=True)
class DroplessHandle(ExchangeHandle):
    """The plan, the two splits, the regroup permutation and the rows per local expert."""

    # received row order (source, expert) -> (expert, source); None when that is the identity
    # (one rank or one local expert: the rows already arrive grouped by expert)
    regroup_M: torch.Tensor | None
    # rows received per local expert (host list and device tensor; device only at EP 1)
    counts_e: Sequence[int]
    inverse_M: torch.Tensor | None = None  # the inverse permutation of regroup_M


def _regroup(recv_counts_Pe: torch.Tensor, M: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(regroup_M, inverse_M)``: the permutation taking received rows from (source rank,
    local expert) order to (local expert, source rank) order, and its inverse, on the device.

    Equal to a stable sort of the rows' segment keys, without the sort: received row m of
    segment (p, j), i rows into it, goes to the start of (j, p) in expert-major order plus i.
    ``output_size`` (M, from the host splits) keeps ``repeat_interleave`` from reading its sum.
    """
    P, e = recv_counts_Pe.shape
    device = recv_counts_Pe.device
    counts_S = recv_counts_Pe.reshape(-1)  # segments in arrival order (p, j)
    src_start_S = torch.cumsum(counts_S, 0) - counts_S
    counts_eP = recv_counts_Pe.t().reshape(-1)  # the same segments in expert order (j, p)
    dst_start_S = (torch.cumsum(counts_eP, 0) - counts_eP).view(e, P).t().reshape(-1)
    seg_M = torch.repeat_interleave(torch.arange(P * e, device=device), counts_S, output_size=M)
    rows_M = torch.arange(M, device=device)
    inverse_M = rows_M + (dst_start_S - src_start_S).index_select(0, seg_M)
    regroup_M = torch.empty_like(inverse_M).scatter_(0, inverse_M, rows_M)
    return regroup_M, inverse_M


class DroplessStrategy(DispatchCombineStrategy[DroplessHandle]):
    """All-to-all-v of the kept rows, no padding; experts see (local expert, source rank) order."""

    name = "dropless"

    def dispatch_send(self, x_TH, plan):
        P, e = self.group.size, self.placement.num_local
        send_counts_Pe = plan.counts_Pe
        recv_counts_Pe = send_counts_Pe
        if P > 1:
            recv_counts_Pe = torch.empty_like(send_counts_Pe)
            self.group.all_to_all_single(recv_counts_Pe, send_counts_Pe, what="dispatch counts")
        counts_e: Sequence[int]
        if P == 1 and plan.num_kept is not None:
            # One rank, nothing dropped: all T*K rows stay here and no all-to-all needs split
            # sizes, so nothing is read on the host (the experts take the counts on the device).
            in_splits = out_splits = [plan.num_kept]
            counts_e = DeviceCounts(recv_counts_Pe.reshape(-1), plan.num_kept)
        else:
            # The forward's one host read: rows to each rank, and from each rank per expert.
            host = torch.cat([send_counts_Pe.sum(dim=1), recv_counts_Pe.reshape(-1)]).tolist()
            in_splits, recv_Pe = host[:P], [host[P + p * e : P + (p + 1) * e] for p in range(P)]
            out_splits = [sum(row) for row in recv_Pe]
            counts_e = GroupCounts([sum(c) for c in zip(*recv_Pe)], recv_counts_Pe.sum(dim=0))
        x_NH = plan.permute(x_TH, sum(in_splits))
        # Received rows are ordered (source rank, local expert); the experts want them
        # (local expert, source rank).
        regroup_M = inverse_M = None
        if P > 1 and e > 1:
            regroup_M, inverse_M = _regroup(recv_counts_Pe, sum(out_splits))
        row_bytes = x_TH.shape[-1] * x_TH.element_size()
        meta_peer = self.to_every_peer(e * send_counts_Pe.element_size())
        peer_bytes = self.peer_bytes(in_splits, out_splits, row_bytes)
        stats = CommStats(
            dispatch_bytes=self.off_rank(in_splits) * row_bytes,
            combine_bytes=self.off_rank(out_splits) * row_bytes,
            meta_bytes=sum(meta_peer),
            dropped_rows=plan.kept_TK.numel() - x_NH.shape[0],
            collectives=3 if P > 1 else 0,
            peer_bytes_P=tuple(a + b for a, b in zip(peer_bytes, meta_peer)),
        )
        handle = DroplessHandle(
            plan=plan,
            in_splits_P=in_splits,
            out_splits_P=out_splits,
            regroup_M=regroup_M,
            counts_e=counts_e,
            inverse_M=inverse_M,
        )
        return Outbound(x_NH, handle, stats)

    def dispatch_recv(self, rows, handle):
        if handle.regroup_M is None:  # no copy: the rows are already in expert order
            return rows, handle.counts_e
        return PermuteRows.apply(rows, handle.regroup_M, handle.inverse_M), handle.counts_e

    def combine_send(self, y_MH, handle):
        if handle.regroup_M is None:
            return y_MH
        return PermuteRows.apply(y_MH, handle.inverse_M, handle.regroup_M)

    def combine_recv(self, rows, handle):
        return rows
