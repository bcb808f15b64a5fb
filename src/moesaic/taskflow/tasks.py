"""Task descriptors (paper Table 1) and the FillConfigs that turn operator splits into them.

Shape legend: T tokens per rank, E experts, e local experts, P ranks, S slot rows,
R = e * P * S receive rows, n tasks of an operator (from split propagation).

A ``TaskDescriptor`` carries Table 1's fields: ``task_type`` (handler), ``queue`` (matrix or
vector), ``dependent_event`` (one counter to wait on, -1 for none), ``trigger_events`` (counters
to bump on completion), ``inputs`` / ``outputs`` (regions: buffer, owning rank, row range),
``task_index`` (tile index within its operator), ``split_num`` and ``split_value`` (tiles of the
operator and rows per tile). Table 1 has one trigger event per task; we allow several, because
one tile can release consumers whose producer sets differ (a SwiGLU-grad tile releases its own
gate-grad GMM tile, one counter, and the whole-expert w1-grad GMM, another). ``tiling_data_
position`` has no meaning here (handlers take the tile from the regions) and is left out.

A FillConfig (one per fill kind, ``FILLS``) maps (operator, n, bucket, rank) to the tasks this
rank runs and, for communication operators, to ``RemoteWrite`` records: tasks of other ranks that
write into this rank's buffers, named by (rank, operator, task_index) so that every rank's plan is
compiled on its own. Communication regions never straddle a slot; compute tiles never straddle an
expert; GMM tiles never split a reduction dimension (rows for the weight gradients, H or F for
the activation GMMs): a tile always spans a full expert width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moesaic.taskflow.bucket import ShapeBucket
from moesaic.taskflow.moe_graphs import TASK_QUEUES, BufferSpec, OpLayout


class CompileError(ValueError):
    """A bucket, option or split that the task generator cannot tile consistently."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Region:
    """Rows ``[start, stop)`` of buffer ``buffer`` on rank ``rank`` (all columns)."""

    buffer: str
    rank: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(kw_only=True, slots=True, frozen=True)
class EventRef:
    """Event counter ``event`` of rank ``rank``."""

    rank: int
    event: int


@dataclass(kw_only=True, slots=True)
class TaskDescriptor:
    """One tile task (Table 1). ``uid`` is its position in ``Plan.tasks``.

    Attributes:
        uid: index in the plan's task table.
        op: operator (ODG node) name.
        task_type: handler type (``moe_graphs.TASK_QUEUES``).
        queue: "matrix" (GMMs) or "vector" (communication, activations, reductions).
        dependent_event: local event that must reach its threshold first; -1 for none.
        trigger_events: events (possibly on other ranks) bumped once when this task completes.
        inputs: regions read. For ``put_combine`` ``inputs[i]`` is sent to ``outputs[i]``.
        outputs: regions written (puts write regions of other ranks).
        task_index: tile index within the operator (stable under reordering).
        split_num: tasks of the operator on this rank.
        split_value: rows per tile.
        expert: global expert of the tile, -1 when it spans several.
        peer: destination rank of a put, -1 when none or several.
    """

    uid: int
    op: str
    task_type: str
    queue: str
    dependent_event: int
    trigger_events: tuple[EventRef, ...]
    inputs: tuple[Region, ...]
    outputs: tuple[Region, ...]
    task_index: int
    split_num: int
    split_value: int
    expert: int = -1
    peer: int = -1

    @property
    def label(self) -> str:
        return f"{self.op}[{self.task_index}]"


@dataclass(kw_only=True, slots=True, frozen=True)
class RemoteWrite:
    """A task of rank ``rank`` that writes ``regions`` of this rank and bumps local events."""

    rank: int
    op: str
    task_index: int
    regions: tuple[Region, ...]
    trigger_events: tuple[int, ...] = ()


@dataclass(kw_only=True, slots=True, frozen=True)
class ProducerRef:
    """A producer of an event: task ``task_index`` of operator ``op`` on rank ``rank``."""

    rank: int
    op: str
    task_index: int


@dataclass(kw_only=True, slots=True, frozen=True)
class Event:
    """An event counter of this rank: ready when ``threshold`` producers have completed."""

    id: int
    threshold: int
    producers: tuple[ProducerRef, ...]


@dataclass(kw_only=True, slots=True, frozen=True)
class FillContext:
    """What a FillConfig knows: the bucket, the rank and the rank's buffers."""

    bucket: ShapeBucket
    rank: int
    buffers: dict[str, BufferSpec]

    def whole(self, name: str) -> Region:
        return Region(buffer=name, rank=self.rank, start=0, stop=self.buffers[name].rows)

    def expert_block(self, name: str, j: int) -> Region:
        """Rows of local expert j in a per-expert buffer (weights, weight gradients)."""
        per = self.buffers[name].rows // self.bucket.local_experts
        return Region(buffer=name, rank=self.rank, start=j * per, stop=(j + 1) * per)


def _task(ctx: FillContext, op: str, layout: OpLayout, **kw) -> TaskDescriptor:
    return TaskDescriptor(
        uid=-1,
        op=op,
        task_type=layout.task_type,
        queue=TASK_QUEUES[layout.task_type],
        dependent_event=-1,
        trigger_events=(),
        **kw,
    )


def _slot_tile(total: int, n: int, slot: int, op: str) -> int:
    """Rows per tile for n tiles of ``total`` rows; tiles must not straddle a slot."""
    if total % n or slot % (total // n):
        raise CompileError(
            f"operator {op!r}: {n} tasks over {total} rows give tiles that straddle slots of "
            f"{slot} rows (tile rows must divide the slot)"
        )
    return total // n


def fill_send_tokens(ctx: FillContext, op: str, layout: OpLayout, n: int):
    """Dispatch (forward or backward): gather this rank's routed rows into remote slots.

    Task ``(d * e + j) * tiles + i`` writes tile i of slot (local expert j, source = this rank)
    on rank d. With n == 1 a single task writes every slot on every rank.
    """
    b, me = ctx.bucket, ctx.rank
    P, e, S = b.ep_size, b.local_experts, b.slot_rows
    out = layout.outputs[0]
    inputs = tuple(ctx.whole(name) for name in layout.whole_inputs)
    tasks, stubs = [], []
    if n == 1:
        outs = tuple(
            Region(buffer=out, rank=d, start=(j * P + me) * S, stop=(j * P + me + 1) * S)
            for d in range(P)
            for j in range(e)
        )
        tasks.append(
            _task(ctx, op, layout, inputs=inputs, outputs=outs, task_index=0, split_num=1,
                  split_value=S)
        )  # fmt: skip
        for s in range(P):
            if s != me:
                regs = tuple(
                    Region(buffer=out, rank=me, start=(j * P + s) * S, stop=(j * P + s + 1) * S)
                    for j in range(e)
                )
                stubs.append(RemoteWrite(rank=s, op=op, task_index=0, regions=regs))
        return tasks, stubs
    tile = _slot_tile(b.experts * S, n, S, op)
    tps = S // tile
    for d in range(P):
        for j in range(e):
            for i in range(tps):
                start = (j * P + me) * S + i * tile
                reg = Region(buffer=out, rank=d, start=start, stop=start + tile)
                tasks.append(
                    _task(ctx, op, layout, inputs=inputs, outputs=(reg,),
                          task_index=(d * e + j) * tps + i, split_num=n, split_value=tile,
                          expert=d * e + j, peer=d)
                )  # fmt: skip
    for s in range(P):
        if s == me:
            continue
        for j in range(e):
            for i in range(tps):
                start = (j * P + s) * S + i * tile
                reg = Region(buffer=out, rank=me, start=start, stop=start + tile)
                idx = (me * e + j) * tps + i
                stubs.append(RemoteWrite(rank=s, op=op, task_index=idx, regions=(reg,)))
    return tasks, stubs


def fill_send_rows(ctx: FillContext, op: str, layout: OpLayout, n: int):
    """Combine (forward or backward): send expert-output tiles back to their source ranks.

    Tiles follow the GMM row partition of the input: tile k covers rows ``[k*tile, (k+1)*tile)``
    of slot (j, s) and goes to the return slot of global expert ``me * e + j`` on rank s.
    """
    b, me = ctx.bucket, ctx.rank
    P, e, S, R = b.ep_size, b.local_experts, b.slot_rows, b.recv_rows
    src, out = layout.row_inputs[0], layout.outputs[0]
    tasks, stubs = [], []

    def ret(rank: int, g: int, off: int, rows: int) -> Region:
        return Region(buffer=out, rank=rank, start=g * S + off, stop=g * S + off + rows)

    if n == 1:
        slots = [(j, s) for j in range(e) for s in range(P)]
        ins = tuple(
            Region(buffer=src, rank=me, start=(j * P + s) * S, stop=(j * P + s + 1) * S)
            for j, s in slots
        )
        outs = tuple(ret(s, me * e + j, 0, S) for j, s in slots)
        tasks.append(
            _task(ctx, op, layout, inputs=ins, outputs=outs, task_index=0, split_num=1,
                  split_value=S)
        )  # fmt: skip
        for q in range(P):
            if q != me:
                regs = tuple(ret(me, q * e + j, 0, S) for j in range(e))
                stubs.append(RemoteWrite(rank=q, op=op, task_index=0, regions=regs))
        return tasks, stubs
    tile = _slot_tile(R, n, S, op)
    for k in range(n):
        a = k * tile
        j, s = divmod(a // S, P)
        reg_in = Region(buffer=src, rank=me, start=a, stop=a + tile)
        tasks.append(
            _task(ctx, op, layout, inputs=(reg_in,), outputs=(ret(s, me * e + j, a % S, tile),),
                  task_index=k, split_num=n, split_value=tile, expert=me * e + j, peer=s)
        )  # fmt: skip
    for q in range(P):
        if q == me:
            continue
        for j in range(e):
            for i in range(S // tile):
                k = ((j * P + me) * S + i * tile) // tile
                reg = ret(me, q * e + j, i * tile, tile)
                stubs.append(RemoteWrite(rank=q, op=op, task_index=k, regions=(reg,)))
    return tasks, stubs


def fill_rows(ctx: FillContext, op: str, layout: OpLayout, n: int):
    """Row-tiled compute (GMMs over rows, activations and their gradients)."""
    b, me = ctx.bucket, ctx.rank
    R = b.recv_rows
    tile = R if n == 1 else _slot_tile(R, n, b.slot_rows, op)
    tasks = []
    for k in range(n):
        a, z = k * tile, (k + 1) * tile
        j = a // b.expert_rows if n > 1 else -1
        rows = tuple(Region(buffer=x, rank=me, start=a, stop=z) for x in layout.row_inputs)
        if n > 1:
            weights = tuple(ctx.expert_block(w, j) for w in layout.weight_inputs)
        else:
            weights = tuple(ctx.whole(w) for w in layout.weight_inputs)
        outs = tuple(Region(buffer=y, rank=me, start=a, stop=z) for y in layout.outputs)
        tasks.append(
            _task(ctx, op, layout, inputs=rows + weights, outputs=outs, task_index=k,
                  split_num=n, split_value=tile, expert=me * b.local_experts + j if j >= 0 else -1)
        )  # fmt: skip
    return tasks, []


def fill_experts(ctx: FillContext, op: str, layout: OpLayout, n: int):
    """Weight-gradient GMMs: one task per local expert over all of its rows (never split)."""
    b, me = ctx.bucket, ctx.rank
    e = b.local_experts
    if n not in (1, e):
        raise CompileError(f"operator {op!r}: {n} tasks; a weight-gradient GMM takes 1 or e ({e})")
    tasks = []
    per_expert = n == e  # also true for e == 1: then the single task is expert me*e's
    for j in range(n):
        if not per_expert:
            a, z = 0, b.recv_rows
            outs = tuple(ctx.whole(y) for y in layout.outputs)
        else:
            a, z = j * b.expert_rows, (j + 1) * b.expert_rows
            outs = tuple(ctx.expert_block(y, j) for y in layout.outputs)
        rows = tuple(Region(buffer=x, rank=me, start=a, stop=z) for x in layout.row_inputs)
        tasks.append(
            _task(ctx, op, layout, inputs=rows, outputs=outs, task_index=j, split_num=n,
                  split_value=z - a, expert=me * e + j if per_expert else -1)
        )  # fmt: skip
    return tasks, []


def fill_tokens(ctx: FillContext, op: str, layout: OpLayout, n: int):
    """Source-side reductions, tiled by tokens; they read whole return buffers (routing decides
    which rows a token needs, so no finer dependency is static)."""
    b, me = ctx.bucket, ctx.rank
    T = b.tokens
    tile = math.ceil(T / n)
    if (n - 1) * tile >= T:
        raise CompileError(f"operator {op!r}: {n} token tiles of {tile} rows leave an empty tile")
    whole = tuple(ctx.whole(x) for x in layout.whole_inputs)
    tasks = []
    for i in range(n):
        a, z = i * tile, min(T, (i + 1) * tile)
        rows = tuple(Region(buffer=x, rank=me, start=a, stop=z) for x in layout.row_inputs)
        outs = tuple(Region(buffer=y, rank=me, start=a, stop=z) for y in layout.outputs)
        tasks.append(
            _task(ctx, op, layout, inputs=rows + whole, outputs=outs, task_index=i,
                  split_num=n, split_value=tile)
        )  # fmt: skip
    return tasks, []


FILLS = {
    "send_tokens": fill_send_tokens,
    "send_rows": fill_send_rows,
    "rows": fill_rows,
    "experts": fill_experts,
    "tokens": fill_tokens,
}
