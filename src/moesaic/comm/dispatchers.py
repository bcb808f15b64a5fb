"""Dispatchers: move expert-grouped tokens to the ranks owning their experts, and back.

Shape legend: T tokens, H hidden, E experts, e = E / P local experts, P ranks, N kept
assignments sent by this rank, M rows received (for local experts), C capacity.

Rank p owns experts ``[p*e, (p+1)*e)``. Both dispatchers hand the experts rows grouped by local
expert (``counts_e`` rows for each), and both are autograd-correct: the backward of each
all-to-all is the all-to-all of the gradients with the splits swapped. Every rank, even one with
no tokens to send or receive, issues the same collectives in the same order, forward and
backward, so zero-token ranks never hang their peers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moesaic.comm.collectives import EPGroup, all_to_all_v
from moesaic.routing import RoutingPlan


@dataclass(slots=True)
class CommStats:
    """Bytes this rank sent to other ranks in the last forward (self-sends are not counted)."""

    dispatch_bytes: int = 0
    combine_bytes: int = 0
    meta_bytes: int = 0
    padded_rows: int = 0
    # Collectives issued by the forward; the backward issues one all-to-all per forward
    # all-to-all of rows (2). Each costs at least one path latency on a real network.
    collectives: int = 0
    # Bytes sent to each rank of the group (dispatch + combine; 0 for this rank): what a
    # network model needs to see which links the traffic crosses.
    peer_bytes_P: tuple[int, ...] = ()

    @property
    def total_bytes(self) -> int:
        return self.dispatch_bytes + self.combine_bytes + self.meta_bytes


@dataclass(slots=True)
class DispatchHandle:
    """What ``combine`` needs to undo a ``dispatch``."""

    plan: RoutingPlan
    counts_e: list[int]
    extra: dict = field(default_factory=dict)


class Dispatcher:
    """Interface: ``dispatch`` tokens to their experts' ranks, ``combine`` the outputs back."""

    name = "base"

    def __init__(self, group: EPGroup, num_experts: int) -> None:
        self.group = group
        self.num_experts = num_experts
        self.num_local = num_experts // group.size
        self.stats = CommStats()

    def dispatch(
        self, x_TH: torch.Tensor, plan: RoutingPlan
    ) -> tuple[torch.Tensor, DispatchHandle]:
        raise NotImplementedError

    def combine(self, y_MH: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        raise NotImplementedError

    def _peer_bytes(self, sent_P: list[int], received_P: list[int], row_bytes: int):
        """Dispatch rows go out as sent, combine rows go back to where they came from."""
        me = self.group.rank
        return tuple(
            0 if p == me else (s + r) * row_bytes
            for p, (s, r) in enumerate(zip(sent_P, received_P))
        )

    def _off_rank(self, rows_P: list[int]) -> int:
        """Rows of a per-rank split that leave this rank."""
        return sum(rows_P) - rows_P[self.group.rank]


class DroplessDispatcher(Dispatcher):
    """Payload-efficient all-to-all-v (FlashDMoE §5.4): only routed tokens travel, no padding.

    Counts go first (one small all-to-all of ``[P, e]`` int64), then the rows with exact splits.
    """

    name = "dropless"

    def dispatch(self, x_TH, plan):
        P, e = self.group.size, self.num_local
        x_NH = plan.permute(x_TH)
        send_counts_Pe = plan.counts_E.view(P, e)
        recv_counts_Pe = torch.empty_like(send_counts_Pe)
        self.group.all_to_all_single(recv_counts_Pe, send_counts_Pe, what="dispatch counts")
        in_splits = plan.send_counts_P.tolist()
        out_splits = recv_counts_Pe.sum(dim=1).tolist()
        x_recv_MH = all_to_all_v(x_NH, self.group, in_splits, out_splits, "dispatch all_to_all_v")
        # Received rows are ordered (source rank, local expert); the experts want them
        # (local expert, source rank): a stable sort of the segment keys.
        seg_keys = torch.arange(e).repeat(P) * P + torch.arange(P).repeat_interleave(e)
        row_keys_M = seg_keys.repeat_interleave(recv_counts_Pe.reshape(-1).cpu())
        regroup_M = torch.sort(row_keys_M, stable=True).indices.to(x_TH.device)
        x_MH = x_recv_MH.index_select(0, regroup_M)
        row_bytes = x_TH.shape[-1] * x_TH.element_size()
        self.stats = CommStats(
            dispatch_bytes=self._off_rank(in_splits) * row_bytes,
            combine_bytes=self._off_rank(out_splits) * row_bytes,
            meta_bytes=(P - 1) * e * send_counts_Pe.element_size() if P > 1 else 0,
            collectives=3 if P > 1 else 0,
            peer_bytes_P=self._peer_bytes(in_splits, out_splits, row_bytes),
        )
        handle = DispatchHandle(
            plan,
            recv_counts_Pe.sum(dim=0).tolist(),
            {"regroup": regroup_M, "in": in_splits, "out": out_splits},
        )
        return x_MH, handle

    def combine(self, y_MH, handle):
        regroup_M = handle.extra["regroup"]
        inverse_M = torch.empty_like(regroup_M)
        inverse_M[regroup_M] = torch.arange(regroup_M.numel(), device=regroup_M.device)
        y_recv_MH = y_MH.index_select(0, inverse_M)
        y_NH = all_to_all_v(
            y_recv_MH, self.group, handle.extra["out"], handle.extra["in"], "combine all_to_all_v"
        )
        return handle.plan.unpermute(y_NH)


class PaddedDispatcher(Dispatcher):
    """Capacity all-to-all with zero padding: the GShard/DeepSpeed "vanilla EP" baseline.

    Every expert gets C rows from every rank: the capacity when ``capacity_factor`` is set
    (overflow already dropped by the plan), else the largest per-expert load in the group (one
    all-reduce MAX), so nothing is dropped. Experts compute on the padding too: that and the
    padded bytes are the cost this baseline pays.
    """

    name = "padded"

    def dispatch(self, x_TH, plan):
        P, e, E = self.group.size, self.num_local, self.num_experts
        H = x_TH.shape[-1]
        if plan.capacity is not None:
            C = plan.capacity
        else:
            load = plan.counts_E.max().reshape(1)
            C = int(self.group.all_reduce(load, dist.ReduceOp.MAX, "padded max load"))
        x_NH = plan.permute(x_TH)
        slot_N = self._slots(plan, C)
        buf_ECH = x_NH.new_zeros(E * C, H).index_copy(0, slot_N, x_NH)
        recv = all_to_all_v(buf_ECH, self.group, [e * C] * P, [e * C] * P, "padded all_to_all")
        # (source rank, local expert, slot) -> (local expert, source rank, slot)
        x_MH = recv.view(P, e, C, H).transpose(0, 1).reshape(e * P * C, H)
        row_bytes = H * x_TH.element_size()
        off_rank_rows = (P - 1) * e * C
        self.stats = CommStats(
            dispatch_bytes=off_rank_rows * row_bytes,
            combine_bytes=off_rank_rows * row_bytes,
            meta_bytes=(P - 1) * 8 if plan.capacity is None and P > 1 else 0,
            padded_rows=E * C - x_NH.shape[0],
            collectives=(2 if plan.capacity is not None else 3) if P > 1 else 0,
            peer_bytes_P=self._peer_bytes([e * C] * P, [e * C] * P, row_bytes),
        )
        return x_MH, DispatchHandle(plan, [P * C] * e, {"C": C, "slots": slot_N})

    def combine(self, y_MH, handle):
        P, e, C = self.group.size, self.num_local, handle.extra["C"]
        H = y_MH.shape[-1]
        y_send = y_MH.view(e, P, C, H).transpose(0, 1).reshape(P * e * C, H)
        y_ECH = all_to_all_v(y_send, self.group, [e * C] * P, [e * C] * P, "padded combine")
        y_NH = y_ECH.index_select(0, handle.extra["slots"])
        return handle.plan.unpermute(y_NH)

    @staticmethod
    def _slots(plan: RoutingPlan, C: int) -> torch.Tensor:
        """Row of the [E*C] buffer for each expert-grouped assignment: expert * C + rank in it."""
        counts_E = plan.counts_E
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        expert_N = plan.topk_ids_TK.reshape(-1).index_select(0, plan.order_N)
        pos_N = torch.arange(plan.order_N.numel(), device=counts_E.device) - starts_E[expert_N]
        return expert_N * C + pos_N


DISPATCHERS: dict[str, type[Dispatcher]] = {
    DroplessDispatcher.name: DroplessDispatcher,
    PaddedDispatcher.name: PaddedDispatcher,
}


def make_dispatcher(name: str, group: EPGroup, num_experts: int) -> Dispatcher:
    if name not in DISPATCHERS:
        raise ValueError(f"dispatcher ({name!r}) must be one of {', '.join(DISPATCHERS)}")
    return DISPATCHERS[name](group, num_experts)
