"""``padded``: capacity all-to-all with zero padding, the GShard/DeepSpeed "vanilla EP" baseline.

Shape legend: T tokens, H hidden, E experts, e local experts, P ranks, C capacity, N kept rows.
Every expert gets C rows from every rank: the capacity when ``capacity_factor`` is set (overflow
already dropped by the plan), else the largest per-expert load in the group (one all-reduce
MAX), so nothing is dropped. The padded bytes are the cost this baseline pays on the wire.

The experts skip the padding (``skip_padding``, on by default): a zero row maps to a zero row (no
biases), so only the filled rows are gathered, computed and scattered back into the zero buffer,
with exactly the outputs and gradients of computing on everything. At EP = 1 nothing is sent,
so there is no buffer at all: the kept rows go straight to the experts. At EP > 1 the receiver
finds the filled rows as the non-zero rows, which is exact for SwiGLU experts (an all-zero token
row has a zero output, input gradient and weight gradient) but not for GELU (GELU'(0) != 0),
whose experts then compute on everything (``skip_padding = False``, the reference path, as
DeepSpeed and GShard do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from moesaic.routing import RoutingPlan
from moesaic.strategies.base import CommStats, DispatchCombineStrategy, ExchangeHandle, Outbound


@dataclass(frozen=True, slots=True)
class PaddedHandle(ExchangeHandle):
    """The plan, the (equal) splits, the capacity and each kept row's slot in the buffer."""

    capacity: int
    slots_N: torch.Tensor  # row of the [P*e*C] send buffer holding each kept assignment
    # Set by dispatch_recv when skipping padding: the received rows the experts computed, in
    # (local expert, source rank, slot) order, as rows of the [P*e*C] buffer (read by
    # combine_send, which scatters the outputs back there).
    live_M: list[torch.Tensor] = field(default_factory=list)
    # One rank skipping the padding: no buffer at all, the kept rows go straight to the experts
    # (nothing is sent, so the padded buffer would only be filled and emptied again).
    direct: bool = False


class PaddedStrategy(DispatchCombineStrategy[PaddedHandle]):
    """Equal-split all-to-all of a ``[P*e*C, H]`` zero-padded buffer per rank."""

    name = "padded"
    dispatch_what = "padded all_to_all"
    combine_what = "padded combine"
    # Experts compute on the filled rows only (see the module docstring); False computes on
    # the padding too (the reference path).
    skip_padding: ClassVar[bool] = True

    def dispatch_send(self, x_TH, plan):
        P, e, E = self.group.size, self.placement.num_local, self.placement.num_experts
        H = x_TH.shape[-1]
        meta_peer = self.to_every_peer(0)
        if plan.capacity is not None:
            C = plan.capacity
        else:
            load = plan.counts_E.max().reshape(1)
            C = int(self.group.all_reduce(load, dist.ReduceOp.MAX, "padded max load"))
            meta_peer = self.to_every_peer(load.element_size())
        x_NH = plan.permute(x_TH)
        direct = P == 1 and self.skip_padding
        slots_N = x_NH.new_empty(0, dtype=torch.long) if direct else self._slots(plan, C)
        row_bytes = H * x_TH.element_size()
        off_rank_rows = (P - 1) * e * C
        peer_bytes = self.peer_bytes([e * C] * P, [e * C] * P, row_bytes)
        stats = CommStats(
            dispatch_bytes=off_rank_rows * row_bytes,
            combine_bytes=off_rank_rows * row_bytes,
            meta_bytes=sum(meta_peer),
            padded_rows=E * C - x_NH.shape[0],
            dropped_rows=plan.kept_TK.numel() - plan.order_N.numel(),
            collectives=(2 if plan.capacity is not None else 3) if P > 1 else 0,
            peer_bytes_P=tuple(a + b for a, b in zip(peer_bytes, meta_peer)),
        )
        splits = [x_NH.shape[0]] if direct else [e * C] * P
        handle = PaddedHandle(
            plan=plan,
            in_splits_P=splits,
            out_splits_P=splits,
            capacity=C,
            slots_N=slots_N,
            direct=direct,
        )
        if direct:
            return Outbound(x_NH, handle, stats)
        buf_ECH = x_NH.new_zeros(E * C, H).index_copy(0, slots_N, x_NH)
        return Outbound(buf_ECH, handle, stats)

    def dispatch_recv(self, rows, handle):
        # (source rank, local expert, slot) -> (local expert, source rank, slot)
        P, e, C = self.group.size, self.placement.num_local, handle.capacity
        H = rows.shape[-1]
        if handle.direct:  # the kept rows, already grouped by expert
            return rows, handle.plan.counts_Pe.reshape(-1).tolist()
        filled_PeC = self._filled(rows, handle)
        if filled_PeC is None:
            return rows.view(P, e, C, H).transpose(0, 1).reshape(e * P * C, H), [P * C] * e
        filled_ePC = filled_PeC.transpose(0, 1)
        buffer_row = torch.arange(P * e * C, device=rows.device).view(P, e, C).transpose(0, 1)
        live_M = buffer_row[filled_ePC]
        handle.live_M[:] = [live_M]
        return rows.index_select(0, live_M), filled_ePC.reshape(e, -1).sum(1).tolist()

    def combine_send(self, y_MH, handle):
        P, e, C = self.group.size, self.placement.num_local, handle.capacity
        H = y_MH.shape[-1]
        if handle.direct:
            return y_MH
        if handle.live_M:  # the padding's outputs are zero rows
            return y_MH.new_zeros(P * e * C, H).index_copy(0, handle.live_M[0], y_MH)
        return y_MH.view(e, P, C, H).transpose(0, 1).reshape(P * e * C, H)

    def _filled(self, rows: torch.Tensor, handle: PaddedHandle) -> torch.Tensor | None:
        """Which received rows hold tokens, [P, e, C] bool; None to compute on everything."""
        P, e, C = self.group.size, self.placement.num_local, handle.capacity
        if not self.skip_padding or self.ctx.config.activation != "swiglu":
            return None
        return rows.view(P, e, C, -1).ne(0).any(dim=-1)

    def combine_recv(self, rows, handle):
        if handle.direct:
            return rows
        return rows.index_select(0, handle.slots_N)

    @staticmethod
    def _slots(plan: RoutingPlan, C: int) -> torch.Tensor:
        """Buffer row of each kept assignment: its dispatch slot * C + its rank in the expert."""
        counts_S = plan.counts_Pe.reshape(-1)
        starts_S = torch.cumsum(counts_S, 0) - counts_S
        slot_E = plan.placement.slot_tensor(counts_S.device)
        slot_N = slot_E.index_select(0, plan.expert_N)
        pos_N = torch.arange(plan.order_N.numel(), device=counts_S.device) - starts_S[slot_N]
        return slot_N * C + pos_N
