"""FlashDMoE's symmetric buffer layout (paper 003, §5.3-5.4) and its write-conflict check.

Shape legend (the paper's letters, per rank): P ranks (expert-parallel world), R communication
rounds, B staging buffers per round, e local experts (the paper's "E" in L), C expert capacity
in rows, C' = C aligned up to the tile height bM, H hidden, E = P * e experts in the model.

Every rank allocates the same ``L = P x R x B x e x C' x H`` tensor once per shape and reuses it
every step (§5.3, "We define L as ..."):

* ``P`` (first dim, ``peer``): for an incoming cell, the rank that wrote it; for a staging
  cell, the rank its rows are bound for. The paper's index is ``p*`` (Definition 5.3.2).
* ``R = 2`` rounds: 0 = token dispatch, 1 = combine ("two rounds, one for token dispatch and
  one for combine").
* ``B = 2`` staging buffers per round: 0 = outgoing staging (written only by the owner,
  Definition 5.3.2 rule 2), 1 = incoming (written by one-sided puts, rule 1); "the factor of 2
  accounts for separate buffers for incoming and outgoing data within each communication round".
* ``e`` local experts, ``C'`` rows per (peer, expert) cell: the capacity C aligned *up* to a
  multiple of the tile height bM (§5.4 in-place padding, "we further align this capacity to
  ensure divisibility by the tile block size bM = 128").
* ``H`` elements of ``dtype_bytes`` each per row.

Since ``P * e = E`` and (uniform routing, Fig. 5.2) ``C * E = S``, the payload is
``R * B * S * H`` elements, ``Size(L) = 4 Size(T)`` (§5.3), and when ``S / E < bM`` the
alignment inflates it by ``bM * E / S`` (§5.4's case formula).

Table 6.2 lists Size(L) as 64.00, 128.01 and 256.02 MB. The payload alone is 64, 128 and 256
MiB exactly; the extra 0.01 / 0.02 MB are the tile flags that live in the same symmetric
allocation. The paper gives no formula for them; the authors' implementation (FlashMoE's
``bootstrap.cuh``: ``flagBytes = (epWorld * expertSlots + E * TCM * TNx) * sizeof(flagsType)``)
allocates one 8-byte signal per (peer, local expert) and one per ``bM x bN`` tile of every
expert's ``C' x H`` block, with ``bN = 64``. That is the reading taken here (``tile_n=64``,
``signal_bytes=8``): it reproduces every row of the table, and the table rules out the others
(``bN = 128`` gives 128.00 for 4K tokens / 64 experts, ``bN = 32`` gives 64.01 for 4K / 16).
MB in the table is MiB (4K tokens x 4 KB = 16 MiB = Size(T)). The implementation's P + 1 word
barrier array is not counted (it does not depend on the shape and is below the table's rounding).

Where the paper is ambiguous, the table decides:

* Table 6.2's column says ``max(bM, EC)`` while §5.4 says "align ... to ensure divisibility by
  bM". They agree on every row of the table (all powers of two); for other capacities only the
  round-up gives tiles that never straddle a cell, so C' = ``ceil(C / bM) * bM``.
* The experiments use top-2 routing with capacity factor 1.0 (§6.1), yet the table's EC column
  is exactly Tokens / Experts, so the capacity is ``ceil(capacity_factor * top_k * tokens / E)``
  with ``top_k=1`` by default (the formula ``MoEConfig.capacity`` uses).

Write-conflict freedom (Definition 5.3.2, Theorem 5.3.1): a write ``w(p_s, p_t, i)`` with
``i = (p*, r, b, e, c)`` is valid when (1) an inter-device write (and a self-loop put) has
``p* = p_s`` and ``b = 1``, and (2) a staging write (``b = 0``) has ``p_s = p_t``. Valid writes
of distinct sources never share a coordinate. ``check_write_conflicts`` checks both things for a
concrete write set: no two writers touch overlapping bytes of one rank's L (a sweep over byte
ranges), and every write obeys the definition (so the set stays conflict free whatever the
routing). ``plan_layout_writes`` maps a taskflow plan's communication buffers onto L, and
``validate.check_plan`` runs the check on every plan.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from moesaic.checks import check_int, check_number, check_positive_int
from moesaic.config import capacity_slots

if TYPE_CHECKING:
    from moesaic.taskflow.bucket import ShapeBucket
    from moesaic.taskflow.plan import Plan

DISPATCH_ROUND = 0  # r = 0: tokens to the experts
COMBINE_ROUND = 1  # r = 1: expert outputs back to their sources
STAGING = 0  # b = 0: outgoing rows, written by the owning rank only (Def. 5.3.2 rule 2)
INCOMING = 1  # b = 1: rows put by peer p* (Def. 5.3.2 rule 1)


def expert_capacity(
    tokens: int, num_experts: int, top_k: int = 1, capacity_factor: float = 1.0
) -> int:
    """Rows per expert and source rank, ``ceil(capacity_factor * tokens * top_k / num_experts)``.

    Table 6.2's EC column is Tokens / Experts, i.e. ``top_k=1, capacity_factor=1.0``.
    """
    check_positive_int("tokens", tokens)
    check_positive_int("num_experts", num_experts)
    check_positive_int("top_k", top_k)
    check_number("capacity_factor", capacity_factor, 0.0, lo_open=True)
    return max(1, capacity_slots(capacity_factor, tokens, top_k, num_experts))


class ByteRange(NamedTuple):
    """Bytes ``[start, stop)`` of one rank's symmetric buffer."""

    start: int
    stop: int


@dataclass(kw_only=True, slots=True, frozen=True)
class SymmetricLayout:
    """The symmetric tensor ``L = P x R x B x e x C' x H`` of one rank, plus its tile signals.

    Attributes:
        world_size: P, expert-parallel ranks (first dimension, the peer ``p*``).
        local_experts: e, experts per rank (``E = P * e``).
        capacity: C, rows per (peer, local expert) cell before alignment (for a taskflow plan,
            the bucket's ``slot_rows``).
        hidden_size: H, elements per row.
        dtype_bytes: bytes per element (Table 6.2: 4, FlashDMoE runs in fp32).
        tile_m: bM, the tile height C is aligned up to (§5.4; 128 in the paper).
        rounds: R, communication rounds (§5.3: 2, dispatch and combine).
        buffers: B, staging buffers per round (§5.3: 2, outgoing and incoming).
        tile_n: bN, the tile width of the per-tile signals (64 reproduces Table 6.2).
        signal_bytes: bytes per signal word (8: one uint64 flag); 0 leaves signals out.
    """

    world_size: int
    local_experts: int
    capacity: int
    hidden_size: int
    dtype_bytes: int
    tile_m: int = 128
    rounds: int = 2
    buffers: int = 2
    tile_n: int = 64
    signal_bytes: int = 8

    def __post_init__(self) -> None:
        for name in (
            "world_size",
            "local_experts",
            "capacity",
            "hidden_size",
            "dtype_bytes",
            "tile_m",
            "rounds",
            "buffers",
            "tile_n",
        ):
            check_positive_int(name, getattr(self, name))
        check_int("signal_bytes", self.signal_bytes, minimum=0)

    @classmethod
    def for_bucket(cls, bucket: ShapeBucket, dtype_bytes: int = 4) -> SymmetricLayout:
        """The layout a taskflow plan's communication buffers map onto: C = ``slot_rows``,
        bM = the GMM tile height (``slot_rows`` is a multiple of it, so C' = C)."""
        return cls(
            world_size=bucket.ep_size,
            local_experts=bucket.local_experts,
            capacity=bucket.slot_rows,
            hidden_size=bucket.hidden,
            dtype_bytes=dtype_bytes,
            tile_m=bucket.gmm_rows,
        )

    @property
    def aligned_capacity(self) -> int:
        """C' = C rounded up to a multiple of ``tile_m`` (in-place padding, §5.4)."""
        return -(-self.capacity // self.tile_m) * self.tile_m

    @property
    def row_bytes(self) -> int:
        return self.hidden_size * self.dtype_bytes

    @property
    def cell_bytes(self) -> int:
        """One (peer, round, buffer, expert) cell: ``C' x H`` elements."""
        return self.aligned_capacity * self.row_bytes

    @property
    def cells(self) -> int:
        return self.world_size * self.rounds * self.buffers * self.local_experts

    @property
    def payload_bytes(self) -> int:
        """``P * R * B * e * C' * H * dtype_bytes``: the tensor L itself."""
        return self.cells * self.cell_bytes

    @property
    def signal_count(self) -> int:
        """One signal per (peer, local expert) plus one per ``bM x bN`` tile of every expert's
        ``C' x H`` block: ``P*e + P*e * (C'/bM) * ceil(H/bN)``."""
        experts = self.world_size * self.local_experts
        tiles_n = -(-self.hidden_size // self.tile_n)
        return experts + experts * (self.aligned_capacity // self.tile_m) * tiles_n

    @property
    def total_bytes(self) -> int:
        """Payload plus signals (laid out after the payload): what Table 6.2 calls Size(L)."""
        return self.payload_bytes + self.signal_count * self.signal_bytes

    def offset(self, peer: int, round: int, buffer: int, expert: int, slot: int) -> int:
        """Byte offset of row ``slot`` of cell ``(peer, round, buffer, expert)`` (row-major)."""
        check_int("peer", peer, 0, self.world_size - 1)
        check_int("round", round, 0, self.rounds - 1)
        check_int("buffer", buffer, 0, self.buffers - 1)
        check_int("expert", expert, 0, self.local_experts - 1)
        check_int("slot", slot, 0, self.aligned_capacity - 1)
        cell = ((peer * self.rounds + round) * self.buffers + buffer) * self.local_experts + expert
        return cell * self.cell_bytes + slot * self.row_bytes

    def region(
        self, peer: int, round: int, buffer: int, expert: int, slot: int = 0, rows: int = 1
    ) -> ByteRange:
        """Bytes covered by ``rows`` rows from ``slot`` of one cell; a write never leaves its
        cell (``slot + rows <= C'``)."""
        check_positive_int("rows", rows)
        start = self.offset(peer, round, buffer, expert, slot)
        if slot + rows > self.aligned_capacity:
            raise ValueError(
                f"slot + rows ({slot} + {rows}) must be <= the aligned capacity "
                f"({self.aligned_capacity}): a write may not leave its cell"
            )
        return ByteRange(start, start + rows * self.row_bytes)


def symmetric_layout_bytes(
    tokens: int,
    num_experts: int,
    hidden_size: int,
    dtype_bytes: int,
    tile_m: int = 128,
    *,
    top_k: int = 1,
    capacity_factor: float = 1.0,
    capacity: int | None = None,
    rounds: int = 2,
    buffers: int = 2,
    tile_n: int = 64,
    signal_bytes: int = 8,
) -> int:
    """Size(L) in bytes for one rank (§5.3-5.4; reproduces Table 6.2's Size(L) column).

    ``P * R * B * e * C' * H * dtype_bytes`` plus the tile signals, with ``P * e`` = the
    model's experts, so the size does not depend on how they are split over ranks.

    Args:
        tokens: S, tokens per rank (Table 6.2's Tokens).
        num_experts: E, experts in the model (Table 6.2's Experts).
        hidden_size: H (Table 6.2: 1024, with fp32 4 KB per token).
        dtype_bytes: bytes per element.
        tile_m: bM, the capacity is aligned up to a multiple of it (§5.4).
        top_k: routed experts per token in the capacity (Table 6.2's EC = Tokens / Experts: 1).
        capacity_factor: multiplies the capacity (§6.1: 1.0).
        capacity: rows per (rank, expert) cell; overrides the three arguments above (e.g. a
            taskflow bucket's ``slot_rows``).
        rounds: R (§5.3: 2).
        buffers: B (§5.3: 2).
        tile_n: bN of the per-tile signals (64 reproduces Table 6.2).
        signal_bytes: bytes per signal; 0 gives the payload alone (exactly ``4 Size(T)`` when
            ``S / E >= bM``).

    Returns:
        The bytes of one rank's symmetric allocation.
    """
    if capacity is None:
        capacity = expert_capacity(tokens, num_experts, top_k, capacity_factor)
    layout = SymmetricLayout(
        world_size=1,
        local_experts=num_experts,
        capacity=capacity,
        hidden_size=hidden_size,
        dtype_bytes=dtype_bytes,
        tile_m=tile_m,
        rounds=rounds,
        buffers=buffers,
        tile_n=tile_n,
        signal_bytes=signal_bytes,
    )
    return layout.total_bytes


# -- write-conflict freedom (Definition 5.3.2) -------------------------------------------------


class WriteConflictError(ValueError):
    """Two writers hit overlapping bytes of L, or a write breaks Definition 5.3.2."""


@dataclass(kw_only=True, slots=True, frozen=True)
class LayoutWrite:
    """``w(p_s, p_t, i)`` with ``i = (peer, round, buffer, expert, slot .. slot + rows - 1)``.

    Attributes:
        writer: who writes (a task label such as ``rank 1 dispatch[3]``); distinct writers may
            never overlap, one writer may rewrite its own bytes.
        source: p_s, the rank that issues the write.
        target: p_t, the rank whose L it lands in.
        peer: p*, first coordinate of the index.
        round: r.
        buffer: b (``STAGING`` or ``INCOMING``).
        expert: local expert index on the target.
        slot: first row inside the cell.
        rows: rows written.
    """

    writer: str
    source: int
    target: int
    peer: int
    round: int
    buffer: int
    expert: int
    slot: int = 0
    rows: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.writer, str) or not self.writer:
            raise ValueError(f"writer must be a non-empty str, got {self.writer!r}")
        for name in ("source", "target", "peer", "round", "buffer", "expert", "slot"):
            check_int(name, getattr(self, name), minimum=0)
        check_positive_int("rows", self.rows)

    def describe(self) -> str:
        """The writer, its ranks and its coordinates, for error messages."""
        return (
            f"{self.writer!r} (rank {self.source} -> rank {self.target}: peer {self.peer}, "
            f"round {self.round}, buffer {self.buffer}, expert {self.expert}, rows "
            f"{self.slot}..{self.slot + self.rows - 1})"
        )


def _rule_violation(w: LayoutWrite) -> str | None:
    """Which rule of Definition 5.3.2 ``w`` breaks, or None."""
    if w.buffer == STAGING and w.source != w.target:
        return f"rule 2: a staging write (buffer {STAGING}) must stay on its own rank (p_s = p_t)"
    if w.source != w.target and w.buffer != INCOMING:
        return f"rule 1: a write to another rank must use buffer {INCOMING}"
    if w.buffer == INCOMING and w.peer != w.source:
        return f"rule 1: a put into buffer {INCOMING} must be indexed by its source (p* = p_s)"
    return None


def check_write_conflicts(
    layout: SymmetricLayout, writes: Iterable[LayoutWrite], *, rules: bool = True
) -> dict[int, int]:
    """Prove that ``writes`` are write-write conflict free on ``layout``.

    First every write is mapped to its byte range on its target rank and the ranges of each
    rank are swept in order: two distinct writers with overlapping bytes are a conflict
    (Definition 5.3.1, for any two writers, not only two ranks: two tasks of one rank on
    different queues race as well). Then, with ``rules``, every write must be a valid index of
    Definition 5.3.2, which rules out conflicts between ranks for every routing, not only this
    write set (Theorem 5.3.1).

    Returns:
        Bytes written per target rank (distinct bytes).

    Raises:
        WriteConflictError: names both writers and the overlapping byte range, or the write and
            the rule it breaks.
        ValueError: a coordinate outside the layout (names the field).
    """
    by_target: dict[int, list[tuple[int, int, int, LayoutWrite]]] = defaultdict(list)
    items = list(writes)
    for k, w in enumerate(items):
        check_int("target", w.target, 0, layout.world_size - 1)
        check_int("source", w.source, 0, layout.world_size - 1)
        r = layout.region(w.peer, w.round, w.buffer, w.expert, w.slot, w.rows)
        by_target[w.target].append((r.start, r.stop, k, w))
    covered: dict[int, int] = {}
    for target, spans in sorted(by_target.items()):
        spans.sort(key=lambda s: (s[0], s[1], s[2]))
        total, cur_stop, cur = 0, -1, None
        for start, stop, _, w in spans:
            if cur is not None and start < cur_stop:
                if w.writer != cur.writer:
                    raise WriteConflictError(
                        f"write conflict on rank {target}: bytes [{start}, {min(stop, cur_stop)}) "
                        f"are written by {cur.describe()} and by {w.describe()}"
                    )
                total += max(0, stop - cur_stop)
            else:
                total += stop - start
            if stop > cur_stop:
                cur_stop, cur = stop, w
        covered[target] = total
    if rules:
        for w in items:
            why = _rule_violation(w)
            if why is not None:
                raise WriteConflictError(f"{w.describe()} breaks Definition 5.3.2 {why}")
    return covered


def all_to_all_writes(
    layout: SymmetricLayout, tile_rows: int | None = None
) -> Iterator[LayoutWrite]:
    """The writes of one dispatch + combine step over every rank, tile by tile.

    For every source s, destination d and local expert j of d: s stages the rows for (d, j)
    (round 0, buffer 0 of s, peer d), puts them into d (round 0, buffer 1 of d, peer s); d
    stages the expert's outputs for s (round 1, buffer 0 of d, peer s) and puts them back
    (round 1, buffer 1 of s, peer d). Together they write every payload byte of every rank once.
    """
    C = layout.aligned_capacity
    step = C if tile_rows is None else check_positive_int("tile_rows", tile_rows)
    P, e = layout.world_size, layout.local_experts
    for s, d, j, c in itertools.product(range(P), range(P), range(e), range(0, C, step)):
        n, tile = min(step, C - c), f"e{j} rows {c}"
        # (writer, source, target, peer, round, buffer) of the tile's four writes
        for writer, source, target, peer, rnd, buf in (
            (f"rank {s} stage {tile} for rank {d}", s, s, d, DISPATCH_ROUND, STAGING),
            (f"rank {s} dispatch {tile} to rank {d}", s, d, s, DISPATCH_ROUND, INCOMING),
            (f"rank {d} stage {tile} for rank {s}", d, d, s, COMBINE_ROUND, STAGING),
            (f"rank {d} combine {tile} to rank {s}", d, s, d, COMBINE_ROUND, INCOMING),
        ):
            yield LayoutWrite(
                writer=writer,
                source=source,
                target=target,
                peer=peer,
                round=rnd,
                buffer=buf,
                expert=j,
                slot=c,
                rows=n,
            )


# -- taskflow plans on L ------------------------------------------------------------------------

# The communication buffers of a taskflow plan (moe_graphs.buffer_table) and the cell of L each
# maps to: receive rows (j * P + s) * S -> round 0, incoming, peer s (the source); staging rows
# (j * P + s) * S -> round 1, staging, peer s (where the outputs go); return rows of global
# expert g -> round 1, incoming, peer g // e (the expert's owner). Dispatch puts gather straight
# from the token buffer, so round 0's staging cells are not used by these plans.
PLAN_BUFFERS: dict[str, dict[str, tuple[int, int]]] = {
    "forward": {
        "x_recv": (DISPATCH_ROUND, INCOMING),
        "y_rows": (COMBINE_ROUND, STAGING),
        "y_ret": (COMBINE_ROUND, INCOMING),
    },
    "backward": {
        "g_recv": (DISPATCH_ROUND, INCOMING),
        "dx_rows": (COMBINE_ROUND, STAGING),
        "dx_ret": (COMBINE_ROUND, INCOMING),
    },
}


def plan_layout_writes(plan: Plan) -> list[LayoutWrite]:
    """Every write that lands in this rank's communication buffers, as writes of L: the
    rank's own tasks (staging, self-loop puts) and the other ranks' puts (``remote_writes``).
    A region that spans several cells becomes one write per cell."""
    b = plan.bucket
    P, e, S = b.ep_size, b.local_experts, b.slot_rows
    cells = PLAN_BUFFERS[plan.direction]
    regions = [
        (f"rank {plan.rank} {t.label}", plan.rank, r)
        for t in plan.tasks
        for r in t.outputs
        if r.rank == plan.rank
    ]
    regions += [
        (f"rank {w.rank} {w.op}[{w.task_index}]", w.rank, r)
        for w in plan.remote_writes
        for r in w.regions
    ]
    out = []
    for writer, source, r in regions:
        if r.buffer not in cells:
            continue
        rnd, buf = cells[r.buffer]
        row = r.start
        while row < r.stop:
            cell, c = divmod(row, S)
            n = min(r.stop, (cell + 1) * S) - row
            if buf == INCOMING and rnd == COMBINE_ROUND:
                peer, j = divmod(cell, e)  # return rows: global expert g = cell
            else:
                j, peer = divmod(cell, P)  # receive / staging rows: slot (j * P + s)
            out.append(
                LayoutWrite(
                    writer=writer,
                    source=source,
                    target=plan.rank,
                    peer=peer,
                    round=rnd,
                    buffer=buf,
                    expert=j,
                    slot=c,
                    rows=n,
                )
            )
            row += n
    return out


def check_plan_layout(plan: Plan) -> dict[int, int]:
    """The validator's hook: ``check_write_conflicts`` on ``plan_layout_writes(plan)``."""
    return check_write_conflicts(SymmetricLayout.for_bucket(plan.bucket), plan_layout_writes(plan))
