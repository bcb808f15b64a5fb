"""A compiled plan lowered to flat device tables for the persistent kernel (issue 26, item 2).

Shape legend: n device tasks, m trigger entries, V events, Q queues, T tokens, K top-k, E
experts, e local experts, P ranks, S slot rows.

``lower(plan)`` turns one rank's validated plan into ``DeviceTables``: int32 tensors that a
persistent kernel (``moesaic.kernels.persistent``) walks without any host work per tile:

* ``tasks`` ``[n, NCOL]``: one row per device task (columns in ``kernels.task_ops``): opcode,
  plan uid, the event waited on and its threshold, the slice of ``triggers`` it bumps, and the
  tile's coordinates (local expert, slot and in-slot offset for the step's valid-row count, first
  row read, first row written, rows). The queues' rows are concatenated, each queue in its
  compiled order; ``queue_starts`` ``[Q + 1]`` cuts them (the **concurrent** mode: one program
  per queue). A plan task whose rows span several slots, or a weight-gradient task spanning
  several experts, becomes several rows: the first carries the wait, the last the triggers.
* ``order`` ``[n]``: the rows in **single-program** order: the queues' launch order in one
  simulated execution (the event engine with the drawing's nominal costs; with
  ``CompileOptions(pipeline=True)`` the queues are listsched's world-consistent orders), so a
  single program walking it never reaches a wait whose producers come later.
* ``triggers`` ``[m]`` (event ids) and ``thresholds`` ``[V]``; ``counters()`` gives the
  zeroed int32 counters of one step.

Empty slots need no extra signal: a tile whose slot has no valid row this step skips its body
and still bumps its triggers, so every count reaches its threshold whatever the routing (the
static-counter rule of the plans). The routing of a step goes to the device as ``StepTables``
(``step_tables``): valid rows per slot, the token (and combine weight) of every dispatch row,
the returned row of every (token, choice).

``check_tables`` (run by ``lower``) refuses tables a kernel could not finish: an unknown opcode,
an event id or trigger slice out of range, a wait whose threshold differs from its event's, an
event whose bumps do not add up to its threshold (unreachable, or bumped past it), a
single-program order that waits before the producers, queues that deadlock together.

EP 1 only: at EP > 1 dispatch and combine tiles are puts to other ranks with remote counter
updates, which the device data plane (a separate item of issue 26) has to provide.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from moesaic.kernels import task_ops as ops
from moesaic.taskflow.draw import nominal_cost
from moesaic.taskflow.engine import DeadlockError, EventEngine, Job, Lane
from moesaic.taskflow.plan import Plan
from moesaic.taskflow.runtime.sequential import StepRouting
from moesaic.taskflow.tasks import Region, TaskDescriptor
from moesaic.taskflow.validate import ensure_validated

__all__ = [
    "MODES",
    "DeviceTables",
    "StepTables",
    "TableError",
    "check_tables",
    "lower",
    "single_program_order",
    "step_tables",
]

MODES = ("single_program", "concurrent")


class TableError(ValueError):
    """Device tables that a persistent kernel could not run to the end."""


@dataclass(frozen=True, slots=True)
class DeviceTables:
    """The static device form of one plan (see the module docstring).

    Attributes:
        direction: "forward" or "backward".
        tasks: int32 ``[n, NCOL]``, queues concatenated, each in its compiled order.
        queue_names: the schedule's queue names, in ``tasks``' order.
        queue_starts: int32 ``[Q + 1]``: queue q is rows ``queue_starts[q] .. [q + 1]``.
        order: int64 ``[n]``: the rows of ``tasks`` in single-program order.
        triggers: int32 ``[m]``: the local event ids the tasks bump (slices of it).
        thresholds: int32 ``[V]``: threshold of every event.
        hidden, ffn, top_k, local_experts, ep_size, slot_rows: the bucket's shape.
    """

    direction: str
    tasks: torch.Tensor
    queue_names: tuple[str, ...]
    queue_starts: torch.Tensor
    order: torch.Tensor
    triggers: torch.Tensor
    thresholds: torch.Tensor
    hidden: int
    ffn: int
    top_k: int
    local_experts: int
    ep_size: int
    slot_rows: int

    def program_tables(self, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tasks, starts)`` as a kernel launch takes them: program p runs rows
        ``starts[p] .. starts[p + 1]``. ``single_program``: one program over ``order``;
        ``concurrent``: one program per queue."""
        if mode == "single_program":
            dev = self.tasks.device
            starts = torch.tensor([0, self.tasks.shape[0]], dtype=torch.int32, device=dev)
            return self.tasks[self.order.to(dev)].contiguous(), starts
        if mode == "concurrent":
            return self.tasks, self.queue_starts
        raise ValueError(f"mode ({mode!r}) must be one of {MODES}")

    def counters(self) -> torch.Tensor:
        """Zeroed int32 event counters of one step (at least one, for an event-free plan)."""
        return torch.zeros(
            max(1, self.thresholds.numel()), dtype=torch.int32, device=self.tasks.device
        )

    def to(self, device: torch.device | str) -> DeviceTables:
        """The tables on ``device``."""
        return dataclasses.replace(
            self,
            tasks=self.tasks.to(device),
            queue_starts=self.queue_starts.to(device),
            order=self.order.to(device),
            triggers=self.triggers.to(device),
            thresholds=self.thresholds.to(device),
        )


@dataclass(frozen=True, slots=True)
class StepTables:
    """The routing of one step on the device (what ``StepRouting`` is on the host).

    Attributes:
        count: int32 ``[e * P]``: valid rows of each receive slot ``j * P + s``.
        tok: int32 ``[E * S]``: token of dispatch row ``expert * S + i`` (-1: padding).
        wt: fp32 ``[E * S]``: its combine weight (the backward dispatch scales by it).
        ret: int32 ``[T, K]``: returned row of choice (t, k), -1 where the capacity dropped it.
        wtk: fp32 ``[T, K]``: the combine weights.
    """

    count: torch.Tensor
    tok: torch.Tensor
    wt: torch.Tensor
    ret: torch.Tensor
    wtk: torch.Tensor


def _check_lowerable(plan: Plan) -> None:
    b = plan.bucket
    if b.ep_size != 1:
        raise TableError(
            f"lower: the plan is for ep_size {b.ep_size}; the persistent kernel runs EP 1 only "
            "(its dispatch and combine tiles would be puts to other ranks with remote counter "
            "updates, which the device data plane has to provide)"
        )
    if b.activation != "swiglu":
        raise TableError(
            f"lower: activation {b.activation!r} has no device opcode; the persistent kernel "
            "runs SwiGLU plans"
        )
    allowed = ops.FORWARD_OPS if plan.direction == "forward" else ops.BACKWARD_OPS
    for t in plan.tasks:
        if ops.OPCODES.get(t.task_type) not in allowed:
            raise TableError(
                f"lower: task {t.label} has type {t.task_type!r}, which the {plan.direction} "
                "kernel does not execute"
            )
        if any(ref.rank != plan.rank for ref in t.trigger_events):
            raise TableError(f"lower: task {t.label} bumps another rank's counter")


def _slot_pieces(r: Region, S: int) -> list[tuple[int, int, int]]:
    """``(slot, first row, rows)`` of each slot that region ``r`` touches."""
    out = []
    for slot in range(r.start // S, (r.stop - 1) // S + 1):
        a, z = max(r.start, slot * S), min(r.stop, (slot + 1) * S)
        out.append((slot, a, z - a))
    return out


def _rows_of(plan: Plan, t: TaskDescriptor) -> list[list[int]]:
    """The device rows of plan task ``t`` (wait and triggers not yet filled in)."""
    b = plan.bucket
    P, S, e = b.ep_size, b.slot_rows, b.local_experts
    op = ops.OPCODES[t.task_type]
    rows: list[list[int]] = []

    def row(expert=-1, slot=-1, voff=0, row0=0, dst0=0, n=0) -> None:
        r = [0] * ops.NCOL
        r[ops.OP], r[ops.UID], r[ops.WAIT] = op, t.uid, -1
        r[ops.EXPERT], r[ops.SLOT], r[ops.VOFF] = expert, slot, voff
        r[ops.ROW0], r[ops.DST0], r[ops.ROWS] = row0, dst0, n
        rows.append(r)

    if op in ops.WEIGHT_GRAD_OPS:
        js = [t.expert - plan.rank * e] if t.expert >= 0 else list(range(e))
        for j in js:
            row(expert=j, row0=j * P * S, n=P * S)
    elif op in ops.TOKEN_OPS:
        out = t.outputs[0]
        row(row0=out.start, dst0=out.start, n=out.rows)
    elif op in (ops.OPCODES["put_dispatch"], ops.OPCODES["put_dispatch_grad"]):
        for out in t.outputs:
            for slot, a, n in _slot_pieces(out, S):
                j, _ = divmod(slot, P)
                g = out.rank * e + j  # the global expert (dispatch slot) of these rows
                voff = a - slot * S
                row(expert=j, slot=slot, voff=voff, row0=g * S + voff, dst0=a, n=n)
    elif op == ops.OPCODES["put_combine"]:
        for src, dst in zip(t.inputs, t.outputs):
            for slot, a, n in _slot_pieces(src, S):
                row(
                    expert=slot // P,
                    slot=slot,
                    voff=a - slot * S,
                    row0=a,
                    dst0=dst.start + a - src.start,
                    n=n,
                )
    else:  # row-tiled compute: inputs[0] and outputs[0] are the same receive rows
        src, dst = t.inputs[0], t.outputs[0]
        if (src.start, src.stop) != (dst.start, dst.stop):
            raise TableError(f"lower: row task {t.label} writes rows other than it reads")
        for slot, a, n in _slot_pieces(src, S):
            row(expert=slot // P, slot=slot, voff=a - slot * S, row0=a, dst0=a, n=n)
    return rows


def single_program_order(plan: Plan) -> list[int]:
    """Plan uids in the order one simulated execution of the queues launches them (the event
    engine with ``draw.nominal_cost``): a job starts only after its event is complete, so no
    task in this order waits on a task after it."""
    tile_m = plan.bucket.tile_m
    lanes, thresholds = _plan_lanes(plan)
    engine: EventEngine[TaskDescriptor] = EventEngine(
        lanes, thresholds, cost=lambda t: nominal_cost(t, tile_m)
    )
    return [int(k) for k in engine.run().order]  # type: ignore[call-overload]


def _plan_lanes(plan: Plan) -> tuple[list[Lane[TaskDescriptor]], dict[Hashable, int]]:
    lanes = []
    for name, uids in plan.schedule.queues:
        jobs = []
        for uid in uids:
            t = plan.tasks[uid]
            wait = t.dependent_event if t.dependent_event >= 0 else None
            jobs.append(
                Job(key=uid, task=t, wait=wait, triggers=tuple(r.event for r in t.trigger_events))
            )
        lanes.append(Lane(name=name, jobs=jobs))
    return lanes, {ev.id: ev.threshold for ev in plan.events}


def lower(plan: Plan) -> DeviceTables:
    """The device tables of ``plan`` (validated first if it is not yet), checked by
    ``check_tables``.

    Raises:
        TableError: a plan the persistent kernel cannot run (EP > 1, GELU) or tables that
            fail the check.
    """
    ensure_validated(plan)
    _check_lowerable(plan)
    b = plan.bucket
    thresholds = {ev.id: ev.threshold for ev in plan.events}
    rows: list[list[int]] = []
    triggers: list[int] = []
    rows_of_uid: dict[int, list[int]] = {}
    starts = [0]
    for _, uids in plan.schedule.queues:
        for uid in uids:
            t = plan.tasks[uid]
            mine = _rows_of(plan, t)
            first, last = mine[0], mine[-1]
            if t.dependent_event >= 0:
                first[ops.WAIT] = t.dependent_event
                first[ops.THRESH] = thresholds[t.dependent_event]
            last[ops.TRIG0], last[ops.NTRIG] = len(triggers), len(t.trigger_events)
            triggers.extend(ref.event for ref in t.trigger_events)
            rows_of_uid[uid] = list(range(len(rows), len(rows) + len(mine)))
            rows.extend(mine)
        starts.append(len(rows))
    order = [i for uid in single_program_order(plan) for i in rows_of_uid[uid]]
    tables = DeviceTables(
        direction=plan.direction,
        tasks=torch.tensor(rows, dtype=torch.int32).reshape(-1, ops.NCOL),
        queue_names=plan.schedule.names,
        queue_starts=torch.tensor(starts, dtype=torch.int32),
        order=torch.tensor(order, dtype=torch.int64),
        triggers=torch.tensor(triggers, dtype=torch.int32),
        thresholds=torch.tensor([thresholds[i] for i in range(len(thresholds))], dtype=torch.int32),
        hidden=b.hidden,
        ffn=b.ffn,
        top_k=b.top_k,
        local_experts=b.local_experts,
        ep_size=b.ep_size,
        slot_rows=b.slot_rows,
    )
    check_tables(tables)
    return tables


def _table_lanes(
    tasks: list[list[int]], trig: list[int], starts: list[int], names: tuple[str, ...]
) -> list[Lane[int]]:
    lanes = []
    for q, name in enumerate(names):
        jobs = []
        for i in range(starts[q], starts[q + 1]):
            r = tasks[i]
            wait = r[ops.WAIT] if r[ops.WAIT] >= 0 else None
            bumps = tuple(trig[r[ops.TRIG0] : r[ops.TRIG0] + r[ops.NTRIG]])
            jobs.append(Job(key=i, task=i, wait=wait, triggers=bumps))
        lanes.append(Lane(name=name, jobs=jobs))
    return lanes


def check_tables(tables: DeviceTables) -> None:
    """Refuse tables a persistent kernel could not run to the end (see the module docstring).

    Raises:
        TableError: naming the row, event or order position at fault and the rule.
    """
    t = tables.tasks
    if t.dtype != torch.int32 or t.dim() != 2 or t.shape[1] != ops.NCOL:
        raise TableError(f"tasks must be int32 [n, {ops.NCOL}], got {t.dtype} {tuple(t.shape)}")
    tasks, trig = t.tolist(), tables.triggers.tolist()
    thr = tables.thresholds.tolist()
    V, n = len(thr), len(tasks)
    allowed = ops.FORWARD_OPS if tables.direction == "forward" else ops.BACKWARD_OPS
    bumps = [0] * V
    for i, r in enumerate(tasks):
        if r[ops.OP] not in allowed:
            raise TableError(f"task row {i}: opcode {r[ops.OP]} is not a {tables.direction} op")
        w = r[ops.WAIT]
        if not -1 <= w < V:
            raise TableError(f"task row {i}: WAIT event {w} must be -1 or in [0, {V})")
        want = thr[w] if w >= 0 else 0
        if r[ops.THRESH] != want:
            raise TableError(
                f"task row {i}: THRESH {r[ops.THRESH]} must equal event {w}'s threshold {want}"
            )
        a, k = r[ops.TRIG0], r[ops.NTRIG]
        if k < 0 or a < 0 or a + k > len(trig):
            raise TableError(f"task row {i}: triggers [{a}, {a + k}) out of [0, {len(trig)})")
        for ev in trig[a : a + k]:
            if not 0 <= ev < V:
                raise TableError(f"task row {i}: trigger event {ev} must be in [0, {V})")
            bumps[ev] += 1
        if r[ops.ROWS] < 0:
            raise TableError(f"task row {i}: ROWS {r[ops.ROWS]} must be >= 0")
    for ev in range(V):
        if thr[ev] < 1:
            raise TableError(f"event {ev}: threshold {thr[ev]} must be >= 1")
        if bumps[ev] != thr[ev]:
            rule = "is unreachable" if bumps[ev] < thr[ev] else "would be passed"
            raise TableError(
                f"event {ev}: threshold {thr[ev]} {rule}: the tasks bump it {bumps[ev]} times "
                "(every threshold must equal its event's number of bumps)"
            )
    order = tables.order.tolist()
    if sorted(order) != list(range(n)):
        raise TableError(f"order must be a permutation of the {n} task rows")
    count = [0] * V
    for pos, i in enumerate(order):
        r = tasks[i]
        w = r[ops.WAIT]
        if w >= 0 and count[w] < thr[w]:
            raise TableError(
                f"single-program order: position {pos} (task row {i}, plan uid {r[ops.UID]}) "
                f"waits on event {w} at {count[w]}/{thr[w]}; its producers come later, so one "
                "program would wait forever"
            )
        for ev in trig[r[ops.TRIG0] : r[ops.TRIG0] + r[ops.NTRIG]]:
            count[ev] += 1
    starts = tables.queue_starts.tolist()
    if (
        len(starts) != len(tables.queue_names) + 1
        or starts[0] != 0
        or starts[-1] != n
        or any(a > z for a, z in itertools.pairwise(starts))
    ):
        raise TableError(f"queue_starts {starts} must rise from 0 to {n}, one cut per queue")
    lanes = _table_lanes(tasks, trig, starts, tables.queue_names)
    try:
        EventEngine(lanes, dict(enumerate(thr))).run()
    except DeadlockError as exc:
        raise TableError(f"concurrent mode: the queues' programs would deadlock: {exc}") from exc


def step_tables(tables: DeviceTables, route: StepRouting, device: torch.device) -> StepTables:
    """The step's routing (``sequential.step_routing``) as device tensors for ``tables``."""
    e, P, S = tables.local_experts, tables.ep_size, tables.slot_rows
    E = e * P
    count = torch.tensor(
        [route.recv_counts_eP[j][s] for j in range(e) for s in range(P)], dtype=torch.int32
    )
    tok = torch.full((E * S,), -1, dtype=torch.int32)
    wt = torch.zeros(E * S, dtype=torch.float32)
    for g in range(E):
        n = route.send_counts_E[g]
        tok[g * S : g * S + n] = route.tokens_E[g]
        wt[g * S : g * S + n] = route.weights_E[g]
    ret = route.ret_row_TK.to(torch.int32)
    if route.dropped_TK is not None:
        ret = ret.masked_fill(route.dropped_TK, -1)
    return StepTables(
        count=count.to(device),
        tok=tok.to(device),
        wt=wt.to(device),
        ret=ret.contiguous().to(device),
        wtk=route.weights_TK.float().contiguous().to(device),
    )
