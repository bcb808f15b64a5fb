"""Memory of FlashDMoE's symmetric layout against the ``dropless`` strategy's buffers.

``compare_layout_memory`` puts one rank's symmetric layout L (``layout.SymmetricLayout``,
allocated once per shape bucket and reused every step) beside the row buffers one ``dropless``
forward allocates and frees again (``strategies/dropless.py``, counted without torch here; a test
counts the real allocations). docs/taskflow.md, "Symmetric layout", has the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from moesaic.checks import check_int, check_positive_int
from moesaic.taskflow.layout import SymmetricLayout, expert_capacity


@dataclass(kw_only=True, slots=True, frozen=True)
class LayoutMemory:
    """Bytes of the symmetric layout against what ``dropless`` allocates for one forward.

    Attributes:
        symmetric_bytes: one rank's L with its signals, allocated once per shape bucket.
        dropless_rows: rows of each transient buffer of one ``dropless`` forward on one rank:
            ``send`` (the permuted tokens, N), ``recv`` (the dispatch all-to-all's output, M),
            ``regroup`` (rows regrouped by local expert, M), ``combine_send`` (outputs put back
            in arrival order, M), ``combine_recv`` (the combine all-to-all's output, N),
            ``combine_gather`` (``RoutingPlan.unpermute``'s gather of each token's K rows, N).
            Measured: these are exactly the row buffers a ``dropless`` forward allocates
            (tests/taskflow/test_layout.py counts them at EP 1 and 2).
        row_bytes: bytes per row (H * dtype_bytes).
    """

    symmetric_bytes: int
    dropless_rows: dict[str, int]
    row_bytes: int

    @property
    def dropless_bytes(self) -> int:
        return sum(self.dropless_rows.values()) * self.row_bytes

    @property
    def ratio(self) -> float:
        """symmetric / dropless."""
        return self.symmetric_bytes / self.dropless_bytes


def compare_layout_memory(
    *,
    tokens: int,
    num_experts: int,
    top_k: int,
    hidden_size: int,
    dtype_bytes: int,
    world_size: int,
    tile_m: int = 128,
    slot_rows: int | None = None,
    recv_rows: int | None = None,
) -> LayoutMemory:
    """The symmetric layout of a taskflow bucket vs ``dropless``'s per-step buffers, one rank.

    Args:
        tokens: T per rank.
        num_experts: E.
        top_k: K; dropless sends N = T * K rows (nothing is dropped).
        hidden_size: H.
        dtype_bytes: bytes per element.
        world_size: P (divides E). At P = 1 ``dropless``'s all-to-alls return their input, so
            only the permuted tokens and the combine's gather are allocated; regrouping happens
            when P > 1 and e > 1.
        tile_m: bM.
        slot_rows: C, rows per (source rank, expert) slot; default the balanced load
            ``ceil(T * K / E)`` (the bucket must hold the hottest slot of a step: a skewed step
            needs a larger one, e.g. ``slot_rows_for(max_load, tile_m)``).
        recv_rows: M, rows this rank receives; default N (balanced routing). A hot rank
            receives more.
    """
    check_positive_int("world_size", world_size)
    if num_experts % world_size:
        raise ValueError(
            f"num_experts ({num_experts}) must be divisible by world_size ({world_size})"
        )
    C = expert_capacity(tokens, num_experts, top_k) if slot_rows is None else slot_rows
    layout = SymmetricLayout(
        world_size=world_size,
        local_experts=num_experts // world_size,
        capacity=C,
        hidden_size=hidden_size,
        dtype_bytes=dtype_bytes,
        tile_m=tile_m,
    )
    N = tokens * top_k
    M = N if recv_rows is None else check_int("recv_rows", recv_rows, minimum=0)
    exchange = world_size > 1
    regroup = exchange and layout.local_experts > 1
    rows = {
        "send": N,
        "recv": M if exchange else 0,
        "regroup": M if regroup else 0,
        "combine_send": M if regroup else 0,
        "combine_recv": N if exchange else 0,
        "combine_gather": N,
    }
    return LayoutMemory(
        symmetric_bytes=layout.total_bytes, dropless_rows=rows, row_bytes=layout.row_bytes
    )
