"""The rows a plan task becomes in the persistent kernel's task table, and the world's
topological order of them (``taskflow.lower`` builds its tables from these; the simulator's
kernel pricing, ``sim.persistent_price``, walks the same rows). Imports neither torch nor
Triton.

A row is a list of ``kernels.task_ops.NCOL`` ints (columns there); ``device_rows`` leaves
``WAIT``/``THRESH`` and ``TRIG0``/``NTRIG`` unset (the lowering fills them: every row of a task
carries its wait and its triggers).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from moesaic.kernels import task_ops as ops
from moesaic.taskflow.draw import nominal_cost
from moesaic.taskflow.engine import EventEngine, Job, Lane
from moesaic.taskflow.plan import Plan
from moesaic.taskflow.tasks import Region, TaskDescriptor

__all__ = ["TableError", "device_rows", "slot_pieces", "world_order"]


class TableError(ValueError):
    """Device tables that a persistent kernel could not run to the end."""


def slot_pieces(r: Region, S: int) -> list[tuple[int, int, int]]:
    """``(slot, first row, rows)`` of each slot that region ``r`` touches."""
    out = []
    for slot in range(r.start // S, (r.stop - 1) // S + 1):
        a, z = max(r.start, slot * S), min(r.stop, (slot + 1) * S)
        out.append((slot, a, z - a))
    return out


def device_rows(plan: Plan, t: TaskDescriptor) -> list[list[int]]:
    """The device rows of plan task ``t`` (wait and triggers not yet filled in)."""
    b = plan.bucket
    P, S, e = b.ep_size, b.slot_rows, b.local_experts
    op = ops.OPCODES[t.task_type]
    rows: list[list[int]] = []

    def row(expert=-1, slot=-1, voff=0, row0=0, dst0=0, n=0, peer=plan.rank) -> None:
        r = [0] * ops.NCOL
        r[ops.OP], r[ops.UID], r[ops.WAIT] = op, t.uid, -1
        r[ops.EXPERT], r[ops.SLOT], r[ops.VOFF] = expert, slot, voff
        r[ops.ROW0], r[ops.DST0], r[ops.ROWS] = row0, dst0, n
        r[ops.PEER], r[ops.HOME] = peer, 0
        rows.append(r)

    if op in ops.WEIGHT_GRAD_OPS:
        js = [t.expert - plan.rank * e] if t.expert >= 0 else list(range(e))
        for j in js:
            row(expert=j, row0=j * P * S, n=P * S)
    elif op in ops.TOKEN_OPS:
        out = t.outputs[0]
        row(row0=out.start, dst0=out.start, n=out.rows)
    elif op in (ops.OPCODES["put_dispatch"], ops.OPCODES["put_dispatch_grad"]):
        for out in t.outputs:  # rows of the target's receive slots (j, this rank)
            for slot, a, n in slot_pieces(out, S):
                j, _ = divmod(slot, P)
                g = out.rank * e + j  # the global expert (dispatch slot) of these rows
                voff = a - slot * S
                sent = e * P + g  # count entry: rows this rank sends to expert g
                row(expert=j, slot=sent, voff=voff, row0=g * S + voff, dst0=a, n=n, peer=out.rank)
    elif op == ops.OPCODES["put_combine"]:
        for src, dst in zip(t.inputs, t.outputs):
            for slot, a, n in slot_pieces(src, S):
                row(
                    expert=slot // P,
                    slot=slot,
                    voff=a - slot * S,
                    row0=a,
                    dst0=dst.start + a - src.start,
                    n=n,
                    peer=dst.rank,
                )
    else:  # row-tiled compute: inputs[0] and outputs[0] are the same receive rows
        src, dst = t.inputs[0], t.outputs[0]
        if (src.start, src.stop) != (dst.start, dst.stop):
            raise TableError(f"lower: row task {t.label} writes rows other than it reads")
        for slot, a, n in slot_pieces(src, S):
            row(expert=slot // P, slot=slot, voff=a - slot * S, row0=a, dst0=a, n=n)
    return rows


def world_order(plans: Sequence[Plan]) -> list[tuple[int, int]]:
    """``(rank, plan uid)`` in the order one simulated execution of every rank's queues
    launches them (the event engine with ``draw.nominal_cost``, events keyed by (rank, event)):
    a job starts only after its event is complete, so no task in this order waits on a task
    after it."""
    lanes: list[Lane[TaskDescriptor]] = []
    thresholds: dict[Hashable, int] = {}
    for p in plans:
        thresholds.update({(p.rank, ev.id): ev.threshold for ev in p.events})
        for name, uids in p.schedule.queues:
            jobs = []
            for uid in uids:
                t = p.tasks[uid]
                wait = (p.rank, t.dependent_event) if t.dependent_event >= 0 else None
                trig = tuple((r.rank, r.event) for r in t.trigger_events)
                jobs.append(Job(key=(p.rank, uid), task=t, wait=wait, triggers=trig))
            lanes.append(Lane(name=(p.rank, name), jobs=jobs))
    tile_m = plans[0].bucket.tile_m
    engine: EventEngine[TaskDescriptor] = EventEngine(
        lanes, thresholds, cost=lambda t: nominal_cost(t, tile_m)
    )
    return [k for k in engine.run().order]  # type: ignore[misc]
