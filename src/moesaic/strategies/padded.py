"""``padded``: capacity all-to-all with zero padding, the GShard/DeepSpeed "vanilla EP" baseline.

Shape legend: T tokens, H hidden, E experts, e local experts, P ranks, C capacity, N kept rows,
A the T*K routed assignments in sort order (``RoutingPlan.order_TK``).

Every expert gets C rows from every rank: the capacity when ``capacity_factor`` is set (overflow
already dropped by the plan), else the largest per-expert load in the group (one all-reduce
MAX), so nothing is dropped. The padded bytes are the cost this baseline pays on the wire.

On the CPU the experts skip the padding (``skip_padding``, on by default): a zero row maps to a
zero row (no biases), so only the filled rows are gathered, computed and scattered back into the
zero buffer, with exactly the outputs and gradients of computing on everything. At EP = 1 nothing
is sent, so there is no buffer at all: the kept rows go straight to the experts. At EP > 1 the
receiver finds the filled rows as the non-zero rows, which is exact for SwiGLU experts (an
all-zero token row has a zero output, input gradient and weight gradient) but not for GELU
(GELU'(0) != 0), whose experts then compute on everything (``skip_padding = False``, the
reference path, as DeepSpeed and GShard do).

Host syncs: which rows are filled is known only on the device, so skipping the padding reads it
(at EP 1 the kept rows per expert, at EP > 1 the filled received rows). On a CPU that costs
nothing; on a GPU it would stall the device every layer, so there the experts compute on the
whole static buffer (as GShard and DeepSpeed do) and the layer reads nothing: 0 host syncs with
a capacity, 1 (the all-reduced C) without. The buffer is filled by one gather (a padding row
reads a zero row) and the outputs come back by one gather, both of static shape; the rows that
a capacity dropped are counted on the device (``CommStats.dropped_rows`` and ``padded_rows``
are then 0-d tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from moesaic.experts import GroupCounts
from moesaic.routing import RoutingPlan
from moesaic.strategies.base import CommStats, DispatchCombineStrategy, ExchangeHandle, Outbound


@dataclass(frozen=True, slots=True)
class PaddedHandle(ExchangeHandle):
    """The plan, the (equal) splits, the capacity and each assignment's row in the buffer."""

    capacity: int
    # Row of the [P*e*C] buffer holding each sorted assignment (``plan.order_TK``); P*e*C, a
    # zero row appended on receipt, for the assignments a capacity dropped.
    row_A: torch.Tensor
    # Set by dispatch_recv when skipping padding: the received rows the experts computed, in
    # (local expert, source rank, slot) order, as rows of the [P*e*C] buffer (read by
    # combine_send, which scatters the outputs back there).
    live_M: list[torch.Tensor] = field(default_factory=list)
    # One rank skipping the padding: no buffer at all, the kept rows go straight to the experts
    # (nothing is sent, so the padded buffer would only be filled and emptied again); these are
    # then the rows per local expert (read once by dispatch_send), else None.
    direct_counts_e: GroupCounts | None = None

    @property
    def direct(self) -> bool:
        return self.direct_counts_e is not None


class PaddedStrategy(DispatchCombineStrategy[PaddedHandle]):
    """Equal-split all-to-all of a ``[P*e*C, H]`` zero-padded buffer per rank."""

    name = "padded"
    dispatch_what = "padded all_to_all"
    combine_what = "padded combine"
    # On the CPU the experts compute on the filled rows only (see the module docstring); False
    # computes on the padding too (the reference path, and what a GPU runs: no host reads).
    skip_padding: ClassVar[bool] = True

    def _skips_padding(self, device: torch.device) -> bool:
        """Skip the padding: it reads which rows are filled, a host sync except on the CPU."""
        return self.skip_padding and device.type == "cpu"

    def dispatch_send(self, x_TH, plan):
        P, e, E = self.group.size, self.placement.num_local, self.placement.num_experts
        H = x_TH.shape[-1]
        meta_peer = self.to_every_peer(0)
        direct_counts = None
        if P == 1 and self._skips_padding(x_TH.device):
            # one host read (free on the CPU): the rows per expert; N and C follow
            counts_S = plan.counts_Pe.reshape(-1)
            direct_counts = GroupCounts(counts_S.tolist(), counts_S)
            C = plan.capacity if plan.capacity is not None else max(direct_counts)
        elif plan.capacity is not None:
            C = plan.capacity
        else:  # the one host read: C sizes the buffer
            load = plan.counts_E.max().reshape(1)
            C = int(self.group.all_reduce(load, dist.ReduceOp.MAX, "padded max load"))
        if plan.capacity is None:  # the max load was all-reduced (no bytes at P = 1)
            meta_peer = self.to_every_peer(plan.counts_E.element_size())
        # N, on the host when known (no capacity, or read above), else a 0-d tensor
        kept: int | torch.Tensor | None = plan.num_kept
        if direct_counts is not None:  # the kept rows, already grouped by expert
            kept = sum(direct_counts)
            send = plan.permute(x_TH, kept)
            row_A = send.new_empty(0, dtype=torch.long)
        else:  # the buffer, by one gather: padding rows read a zero row appended to x_TH
            token_EC, row_A = self._layout(plan, C)
            send = torch.cat([x_TH, x_TH.new_zeros(1, H)]).index_select(0, token_EC)
        if kept is None:
            kept = plan.counts_E.sum()
        row_bytes = H * x_TH.element_size()
        off_rank_rows = (P - 1) * e * C
        peer_bytes = self.peer_bytes([e * C] * P, [e * C] * P, row_bytes)
        stats = CommStats(
            dispatch_bytes=off_rank_rows * row_bytes,
            combine_bytes=off_rank_rows * row_bytes,
            meta_bytes=sum(meta_peer),
            padded_rows=E * C - kept,
            dropped_rows=plan.kept_TK.numel() - kept,
            collectives=(2 if plan.capacity is not None else 3) if P > 1 else 0,
            peer_bytes_P=tuple(a + b for a, b in zip(peer_bytes, meta_peer)),
        )
        splits = [send.shape[0]] if direct_counts is not None else [e * C] * P
        handle = PaddedHandle(
            plan=plan,
            in_splits_P=splits,
            out_splits_P=splits,
            capacity=C,
            row_A=row_A,
            direct_counts_e=direct_counts,
        )
        return Outbound(send, handle, stats)

    def dispatch_recv(self, rows, handle):
        # (source rank, local expert, slot) -> (local expert, source rank, slot)
        P, e, C = self.group.size, self.placement.num_local, handle.capacity
        H = rows.shape[-1]
        if handle.direct_counts_e is not None:  # the kept rows, already grouped by expert
            return rows, handle.direct_counts_e
        filled_PeC = self._filled(rows, handle)
        if filled_PeC is None:
            full = torch.full((e,), P * C, dtype=torch.long, device=rows.device)
            x_MH = rows.view(P, e, C, H).transpose(0, 1).reshape(e * P * C, H)
            return x_MH, GroupCounts([P * C] * e, full)
        filled_ePC = filled_PeC.transpose(0, 1)
        counts_e = filled_ePC.reshape(e, -1).sum(1)
        counts = GroupCounts(counts_e.tolist(), counts_e)  # the one read (free on the CPU)
        buffer_row = torch.arange(P * e * C, device=rows.device).view(P, e, C).transpose(0, 1)
        live = torch.nonzero_static(filled_ePC.reshape(-1), size=sum(counts)).squeeze(1)
        live_M = buffer_row.reshape(-1).index_select(0, live)
        handle.live_M[:] = [live_M]
        return rows.index_select(0, live_M), counts

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
        if not self._skips_padding(rows.device) or self.ctx.config.activation != "swiglu":
            return None
        return rows.view(P, e, C, -1).ne(0).any(dim=-1)

    def combine_recv(self, rows, handle):
        """The outputs of every sorted assignment [A, H] (zero rows for the dropped ones)."""
        if handle.direct:
            return rows
        if handle.plan.capacity is not None:  # dropped assignments read a zero row at P*e*C
            rows = torch.cat([rows, rows.new_zeros(1, rows.shape[-1])])
        return rows.index_select(0, handle.row_A)

    @staticmethod
    def _layout(plan: RoutingPlan, C: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token_EC, row_A)``: the token each buffer row holds (T: a zero row, the padding)
        and the buffer row of each sorted assignment (E*C where dropped), static shapes.

        Buffer row ``s*C + i`` holds the sorted assignment ``start_s + i`` when ``i`` is below
        the kept count of dispatch slot s (at most C); the kept assignments come first in
        ``order_TK``, so assignment a was dropped when ``a >= N``.
        """
        T, K = plan.topk_ids_TK.shape
        order_A = plan.order_TK
        A, device = order_A.numel(), order_A.device
        counts_S = plan.counts_Pe.reshape(-1)
        S = counts_S.numel()
        starts_S = torch.cumsum(counts_S, 0) - counts_S
        i_C = torch.arange(C, device=device)
        live_SC = i_C < counts_S.unsqueeze(1)
        sorted_SC = torch.where(live_SC, starts_S.unsqueeze(1) + i_C, A).reshape(-1)
        token_A1 = torch.cat([order_A // K, order_A.new_full((1,), T)])  # entry A: a zero row
        token_EC = token_A1.index_select(0, sorted_SC)
        expert_A = plan.topk_ids_TK.reshape(-1).index_select(0, order_A)
        slot_A = expert_A
        if not plan.placement.is_contiguous:
            slot_A = plan.placement.slot_tensor(device).index_select(0, expert_A)
        row_A = slot_A * C + torch.arange(A, device=device) - starts_S.index_select(0, slot_A)
        if plan.capacity is not None:
            kept_A = torch.arange(A, device=device) < counts_S.sum()
            row_A = torch.where(kept_A, row_A, S * C)
        return token_EC, row_A
