"""FillConfigs of the MoE-FFN graphs: operator splits -> tiles and remote-write records.

Shape legend: T tokens per rank, E experts, e local experts, P ranks, S slot rows,
R = e * P * S receive rows, n tasks of an operator (from split propagation).

A FillConfig (one per fill kind, ``FILLS``) maps (operator, n, bucket, rank) to the tiles this
rank runs and, for communication operators, to ``RemoteWrite`` records: tasks of other ranks that
write into this rank's buffers, named by (rank, operator, task_index) so that every rank's plan is
compiled on its own. Communication regions never straddle a slot; compute tiles never straddle an
expert; GMM tiles never split a reduction dimension (rows for the weight gradients, H or F for
the activation GMMs): a tile always spans a full expert width.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moesaic.taskflow.bucket import ShapeBucket
from moesaic.taskflow.moe_graphs import OpLayout
from moesaic.taskflow.tasks import BufferSpec, CompileError, Region, RemoteWrite, Tile


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


def _task(ctx: FillContext, op: str, layout: OpLayout, **kw: Any) -> Tile:
    return Tile(op=op, task_type=layout.task_type, **kw)


def _slot_tile(total: int, n: int, slot: int, op: str) -> int:
    """Rows per tile for n tiles of ``total`` rows; tiles must not straddle a slot."""
    if total % n or slot % (total // n):
        raise CompileError(
            f"operator {op!r}: {n} tasks over {total} rows give tiles that straddle slots of "
            f"{slot} rows (tile rows must divide the slot)"
        )
    return total // n


def fill_send_tokens(ctx: FillContext, op: str, layout: OpLayout, n: int) -> Fills:
    """Dispatch (forward or backward): gather this rank's routed rows into remote slots.

    Task ``(d * e + j) * tiles + i`` writes tile i of slot (local expert j, source = this rank)
    on rank d. With n == 1 a single task writes every slot on every rank.
    """
    b, me = ctx.bucket, ctx.rank
    P, e, S = b.ep_size, b.local_experts, b.slot_rows
    out = layout.outputs[0]
    inputs = tuple(ctx.whole(name) for name in layout.whole_inputs)
    tasks: list[Tile] = []
    stubs: list[RemoteWrite] = []
    if n == 1:
        outs = tuple(
            Region(buffer=out, rank=d, start=(j * P + me) * S, stop=(j * P + me + 1) * S)
            for d in range(P)
            for j in range(e)
        )
        tasks.append(
            _task(
                ctx,
                op,
                layout,
                inputs=inputs,
                outputs=outs,
                task_index=0,
                split_num=1,
                split_value=S,
            )
        )
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
                    _task(
                        ctx,
                        op,
                        layout,
                        inputs=inputs,
                        outputs=(reg,),
                        task_index=(d * e + j) * tps + i,
                        split_num=n,
                        split_value=tile,
                        expert=d * e + j,
                        peer=d,
                    )
                )
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


def fill_send_rows(ctx: FillContext, op: str, layout: OpLayout, n: int) -> Fills:
    """Combine (forward or backward): send expert-output tiles back to their source ranks.

    Tiles follow the GMM row partition of the input: tile k covers rows ``[k*tile, (k+1)*tile)``
    of slot (j, s) and goes to the return slot of global expert ``me * e + j`` on rank s.
    """
    b, me = ctx.bucket, ctx.rank
    P, e, S, R = b.ep_size, b.local_experts, b.slot_rows, b.recv_rows
    src, out = layout.row_inputs[0], layout.outputs[0]
    tasks: list[Tile] = []
    stubs: list[RemoteWrite] = []

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
            _task(
                ctx, op, layout, inputs=ins, outputs=outs, task_index=0, split_num=1, split_value=S
            )
        )
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
            _task(
                ctx,
                op,
                layout,
                inputs=(reg_in,),
                outputs=(ret(s, me * e + j, a % S, tile),),
                task_index=k,
                split_num=n,
                split_value=tile,
                expert=me * e + j,
                peer=s,
            )
        )
    for q in range(P):
        if q == me:
            continue
        for j in range(e):
            for i in range(S // tile):
                k = ((j * P + me) * S + i * tile) // tile
                reg = ret(me, q * e + j, i * tile, tile)
                stubs.append(RemoteWrite(rank=q, op=op, task_index=k, regions=(reg,)))
    return tasks, stubs


def fill_rows(ctx: FillContext, op: str, layout: OpLayout, n: int) -> Fills:
    """Row-tiled compute (GMMs over rows, activations and their gradients)."""
    b, me = ctx.bucket, ctx.rank
    R = b.recv_rows
    tile = R if n == 1 else _slot_tile(R, n, b.slot_rows, op)
    tasks: list[Tile] = []
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
            _task(
                ctx,
                op,
                layout,
                inputs=rows + weights,
                outputs=outs,
                task_index=k,
                split_num=n,
                split_value=tile,
                expert=me * b.local_experts + j if j >= 0 else -1,
            )
        )
    return tasks, []


def fill_experts(ctx: FillContext, op: str, layout: OpLayout, n: int) -> Fills:
    """Weight-gradient GMMs: one task per local expert over all of its rows (never split)."""
    b, me = ctx.bucket, ctx.rank
    e = b.local_experts
    if n not in (1, e):
        raise CompileError(f"operator {op!r}: {n} tasks; a weight-gradient GMM takes 1 or e ({e})")
    tasks: list[Tile] = []
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
            _task(
                ctx,
                op,
                layout,
                inputs=rows,
                outputs=outs,
                task_index=j,
                split_num=n,
                split_value=z - a,
                expert=me * e + j if per_expert else -1,
            )
        )
    return tasks, []


def fill_tokens(ctx: FillContext, op: str, layout: OpLayout, n: int) -> Fills:
    """Source-side reductions, tiled by tokens; they read whole return buffers (routing decides
    which rows a token needs, so no finer dependency is static)."""
    b, me = ctx.bucket, ctx.rank
    T = b.tokens
    tile = math.ceil(T / n)
    if (n - 1) * tile >= T:
        raise CompileError(f"operator {op!r}: {n} token tiles of {tile} rows leave an empty tile")
    whole = tuple(ctx.whole(x) for x in layout.whole_inputs)
    tasks: list[Tile] = []
    for i in range(n):
        a, z = i * tile, min(T, (i + 1) * tile)
        rows = tuple(Region(buffer=x, rank=me, start=a, stop=z) for x in layout.row_inputs)
        outs = tuple(Region(buffer=y, rank=me, start=a, stop=z) for y in layout.outputs)
        tasks.append(
            _task(
                ctx,
                op,
                layout,
                inputs=rows + whole,
                outputs=outs,
                task_index=i,
                split_num=n,
                split_value=tile,
            )
        )
    return tasks, []


Fills = tuple[list[Tile], list[RemoteWrite]]
FillFn = Callable[[FillContext, str, OpLayout, int], Fills]

FILLS: dict[str, FillFn] = {
    "send_tokens": fill_send_tokens,
    "send_rows": fill_send_rows,
    "rows": fill_rows,
    "experts": fill_experts,
    "tokens": fill_tokens,
}
