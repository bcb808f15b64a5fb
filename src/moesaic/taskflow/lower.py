"""Compiled plans lowered to flat device tables for the persistent kernel (issues 26 and 53).

Shape legend: n device tasks, m trigger entries, V events, Q queues, T tokens, K top-k, E
experts, e local experts, P ranks, S slot rows.

``lower_world(plans)`` turns the validated plans of every rank of one world (one plan at EP 1)
into ``WorldTables``: per rank ``DeviceTables``, int32 tensors that a persistent kernel
(``moesaic.kernels.persistent``) walks without any host work per tile:

* ``tasks`` ``[n, NCOL]``: one row per device task (columns in ``kernels.task_ops``): opcode,
  plan uid, the event waited on and its threshold, the slice of ``triggers`` it bumps, the
  tile's coordinates (local expert, count entry and in-slot offset for the step's valid rows,
  first row read, first row written, rows) and the rank a put writes to. The queues' rows are
  concatenated, each queue in its compiled order (``queue_starts`` cuts them). A plan task whose
  rows span several slots, or a weight-gradient task spanning several experts, becomes several
  rows, each carrying the task's wait and its triggers (a GPU may run them at once), so an
  event's device threshold counts its producers' rows (the plan's when every task is one row).
* ``triggers`` ``[m]`` (event ids) with ``trigger_ranks`` ``[m]`` (the rank owning each event:
  a put bumps its target's arrival event) and ``thresholds`` ``[V]``; ``counters()`` gives
  fresh (zeroed) int32 counters, for a launch at epoch 1.
* ``order`` ``[n]``: the rank's rows in the world's **topological order**: one simulated
  execution of every rank's queues together (the event engine with the drawing's nominal
  costs, events keyed by (rank, event); with ``CompileOptions(pipeline=True)`` the queues are
  listsched's world-consistent orders). ``WorldTables.order`` is that order over all ranks'
  rows. The kernel's programs take rows from it by an atomic ticket, so a row's producers hold
  earlier tickets: whatever the number of programs (one, or one per SM) and however they
  interleave, a waiting row's producers have been taken by running programs, and executed one
  after another (Triton's interpreter runs a grid's programs in turn) no wait ever blocks.

Empty slots need no extra signal: a tile whose slot has no valid row this step skips its body
and still bumps its triggers, so every count reaches its threshold whatever the routing (the
static-counter rule of the plans). The routing of a step goes to the device as ``StepTables``
(``step_tables``): valid rows per receive slot and per sent expert, the token (and combine
weight) of every dispatch row, the returned row of every (token, choice).

``check_world_tables`` (run by ``lower_world``) refuses tables a kernel could not finish: an
unknown opcode, an event id, trigger slice or peer out of range, a wait whose threshold differs
from its event's, an event whose bumps over all ranks do not add up to its threshold
(unreachable, or bumped past it) or that no row waits on (a launch ends only after every bump
into its counters landed, so the next launch counts on from ``epoch * threshold``), a rank
whose events no row of some other rank bumps (ranks must stay within one launch of each other
for the two counter sets of ``taskflow.runtime.epochs``), a topological order that waits
before the producers.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moesaic.kernels import task_ops as ops
from moesaic.taskflow.compile import compile_world
from moesaic.taskflow.lower_rows import TableError, device_rows, world_order
from moesaic.taskflow.plan import Plan
from moesaic.taskflow.runtime.sequential import StepRouting
from moesaic.taskflow.validate import ensure_validated

__all__ = [
    "DeviceTables",
    "StepTables",
    "TableError",
    "WorldTables",
    "check_tables",
    "check_world_tables",
    "lower",
    "lower_world",
    "step_tables",
    "world_order",
]


@dataclass(frozen=True, slots=True)
class DeviceTables:
    """The static device form of one rank's plan (see the module docstring).

    Attributes:
        direction: "forward" or "backward".
        tasks: int32 ``[n, NCOL]``, queues concatenated, each in its compiled order.
        queue_names: the schedule's queue names, in ``tasks``' order.
        queue_starts: int32 ``[Q + 1]``: queue q is rows ``queue_starts[q] .. [q + 1]``.
        order: int64 ``[n]``: the rows of ``tasks`` in the world's topological order.
        triggers: int32 ``[m]``: the event ids the tasks bump (slices of it).
        trigger_ranks: int32 ``[m]``: the rank of each trigger's event.
        thresholds: int32 ``[V]``: threshold of every event of this rank.
        rank: the rank whose plan this is.
        hidden, ffn, top_k, local_experts, ep_size, slot_rows: the bucket's shape.
    """

    direction: str
    tasks: torch.Tensor
    queue_names: tuple[str, ...]
    queue_starts: torch.Tensor
    order: torch.Tensor
    triggers: torch.Tensor
    trigger_ranks: torch.Tensor
    thresholds: torch.Tensor
    rank: int
    hidden: int
    ffn: int
    top_k: int
    local_experts: int
    ep_size: int
    slot_rows: int

    def launch_rows(self) -> torch.Tensor:
        """The task rows in topological order, as one rank's launch takes them."""
        return self.tasks[self.order.to(self.tasks.device)].contiguous()

    def counters(self) -> torch.Tensor:
        """Fresh (zeroed) int32 event counters, for a launch at epoch 1 (at least one, for an
        event-free plan)."""
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
            trigger_ranks=self.trigger_ranks.to(device),
            thresholds=self.thresholds.to(device),
        )


@dataclass(frozen=True, slots=True)
class WorldTables:
    """The device tables of every rank of one world and their topological order.

    Attributes:
        ranks: ``DeviceTables`` of rank 0 .. P - 1.
        order: int64 ``[N, 2]``: ``(rank, row)`` of every rank's rows in topological order.
    """

    ranks: tuple[DeviceTables, ...]
    order: torch.Tensor

    def to(self, device: torch.device | str) -> WorldTables:
        """The tables on ``device``."""
        return WorldTables(
            ranks=tuple(t.to(device) for t in self.ranks), order=self.order.to(device)
        )


@dataclass(frozen=True, slots=True)
class StepTables:
    """The routing of one step on the device (what ``StepRouting`` is on the host).

    Attributes:
        count: int32 ``[e * P + E]``: valid rows of each receive slot ``j * P + s``, then the
            rows this rank sends to each global expert (a dispatch put's valid rows).
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


def lower(plan: Plan) -> DeviceTables:
    """The device tables of ``plan``; at EP > 1 the other ranks' plans (the same bucket and
    options) are compiled to order and check the world's tables together.

    Raises:
        TableError: a plan the persistent kernel cannot run (GELU) or tables that fail the
            check.
    """
    world: list[Plan] = [plan]
    if plan.bucket.ep_size > 1:
        world = compile_world(plan.bucket, plan.direction, plan.options)
        world[plan.rank] = plan
    return lower_world(world).ranks[plan.rank]


def lower_world(plans: Sequence[Plan]) -> WorldTables:
    """The device tables of a world's plans (rank r's plan at index r; validated first if
    they are not yet), checked by ``check_world_tables``.

    Raises:
        TableError: plans of different worlds, a plan the persistent kernel cannot run
            (GELU), or tables that fail the check.
    """
    P = plans[0].bucket.ep_size
    if [p.rank for p in plans] != list(range(P)) or any(
        p.world_fingerprint != plans[0].world_fingerprint or p.direction != plans[0].direction
        for p in plans
    ):
        raise TableError(
            f"lower_world: needs the {plans[0].direction} plans of ranks 0 .. {P - 1} of one "
            f"world in rank order, got ranks {[p.rank for p in plans]}"
        )
    rows_of_uid: list[dict[int, list[int]]] = []
    built = []
    for plan in plans:
        ensure_validated(plan)
        _check_lowerable(plan)
    # every row of a task waits and bumps (rows may run at once on a GPU): an event's device
    # threshold is the rows of its producers, the plan's threshold when a task is one row
    pieces = [{t.uid: device_rows(p, t) for t in p.tasks} for p in plans]
    bumps: dict[tuple[int, int], int] = {}
    for p, mine_of in zip(plans, pieces):
        for t in p.tasks:
            for ref in t.trigger_events:
                key = (ref.rank, ref.event)
                bumps[key] = bumps.get(key, 0) + len(mine_of[t.uid])
    for plan, mine_of in zip(plans, pieces):
        thresholds = {ev.id: bumps.get((plan.rank, ev.id), 0) for ev in plan.events}
        rows: list[list[int]] = []
        triggers: list[int] = []
        trigger_ranks: list[int] = []
        mine_of_uid: dict[int, list[int]] = {}
        starts = [0]
        for _, uids in plan.schedule.queues:
            for uid in uids:
                t = plan.tasks[uid]
                mine = mine_of[uid]
                for row in mine:
                    if t.dependent_event >= 0:
                        row[ops.WAIT] = t.dependent_event
                        row[ops.THRESH] = thresholds[t.dependent_event]
                    row[ops.TRIG0], row[ops.NTRIG] = len(triggers), len(t.trigger_events)
                triggers.extend(ref.event for ref in t.trigger_events)
                trigger_ranks.extend(ref.rank for ref in t.trigger_events)
                mine_of_uid[uid] = list(range(len(rows), len(rows) + len(mine)))
                rows.extend(mine)
            starts.append(len(rows))
        rows_of_uid.append(mine_of_uid)
        built.append((plan, rows, triggers, trigger_ranks, starts, thresholds))
    order = [(r, i) for r, uid in world_order(plans) for i in rows_of_uid[r][uid]]
    ranks = []
    for plan, rows, triggers, trigger_ranks, starts, thresholds in built:
        b = plan.bucket
        ranks.append(
            DeviceTables(
                direction=plan.direction,
                tasks=torch.tensor(rows, dtype=torch.int32).reshape(-1, ops.NCOL),
                queue_names=plan.schedule.names,
                queue_starts=torch.tensor(starts, dtype=torch.int32),
                order=torch.tensor([i for r, i in order if r == plan.rank], dtype=torch.int64),
                triggers=torch.tensor(triggers, dtype=torch.int32),
                trigger_ranks=torch.tensor(trigger_ranks, dtype=torch.int32),
                thresholds=torch.tensor(
                    [thresholds[i] for i in range(len(thresholds))], dtype=torch.int32
                ),
                rank=plan.rank,
                hidden=b.hidden,
                ffn=b.ffn,
                top_k=b.top_k,
                local_experts=b.local_experts,
                ep_size=b.ep_size,
                slot_rows=b.slot_rows,
            )
        )
    world = WorldTables(
        ranks=tuple(ranks), order=torch.tensor(order, dtype=torch.int64).reshape(-1, 2)
    )
    check_world_tables(world)
    return world


def check_tables(tables: DeviceTables) -> None:
    """``check_world_tables`` on one EP-1 rank's tables (a world of one; its order is the
    world's).

    Raises:
        TableError: see ``check_world_tables``; also tables of a rank of EP > 1 (their events
            are bumped by other ranks: check them with their world).
    """
    if tables.ep_size != 1:
        raise TableError(
            f"check_tables: rank {tables.rank} of ep_size {tables.ep_size}: other ranks bump "
            "its events, so its tables are checked with the world's (check_world_tables)"
        )
    order = torch.stack([torch.zeros_like(tables.order), tables.order.cpu()], dim=1)
    check_world_tables(WorldTables(ranks=(tables,), order=order))


def check_world_tables(world: WorldTables) -> None:
    """Refuse tables a persistent kernel could not run to the end (see the module docstring).

    Raises:
        TableError: naming the rank (at EP > 1), row, event or order position at fault and
            the rule.
    """
    P = len(world.ranks)
    allowed = ops.FORWARD_OPS if world.ranks[0].direction == "forward" else ops.BACKWARD_OPS
    thr = [t.thresholds.tolist() for t in world.ranks]
    bumps = [[0] * len(x) for x in thr]
    heard = [[r == s for s in range(P)] for r in range(P)]  # heard[r][s]: s bumps r's events
    tasks_of = []
    for r, tables in enumerate(world.ranks):
        who = f"rank {r} " if P > 1 else ""
        t = tables.tasks
        if t.dtype != torch.int32 or t.dim() != 2 or t.shape[1] != ops.NCOL:
            raise TableError(
                f"{who}tasks must be int32 [n, {ops.NCOL}], got {t.dtype} {tuple(t.shape)}"
            )
        tasks, trig = t.tolist(), tables.triggers.tolist()
        trig_ranks = tables.trigger_ranks.tolist()
        tasks_of.append((tasks, trig, trig_ranks))
        V = len(thr[r])
        for i, row in enumerate(tasks):
            if row[ops.OP] not in allowed:
                raise TableError(
                    f"{who}task row {i}: opcode {row[ops.OP]} is not a {tables.direction} op"
                )
            w = row[ops.WAIT]
            if not -1 <= w < V:
                raise TableError(f"{who}task row {i}: WAIT event {w} must be -1 or in [0, {V})")
            want = thr[r][w] if w >= 0 else 0
            if row[ops.THRESH] != want:
                raise TableError(
                    f"{who}task row {i}: THRESH {row[ops.THRESH]} must equal event {w}'s "
                    f"threshold {want}"
                )
            if not 0 <= row[ops.PEER] < P or row[ops.HOME] != 0:
                raise TableError(
                    f"{who}task row {i}: PEER {row[ops.PEER]} must be in [0, {P}) and HOME "
                    f"{row[ops.HOME]} 0"
                )
            a, k = row[ops.TRIG0], row[ops.NTRIG]
            if k < 0 or a < 0 or a + k > len(trig):
                raise TableError(
                    f"{who}task row {i}: triggers [{a}, {a + k}) out of [0, {len(trig)})"
                )
            for ev, er in zip(trig[a : a + k], trig_ranks[a : a + k]):
                if not 0 <= er < P or not 0 <= ev < len(thr[er]):
                    raise TableError(
                        f"{who}task row {i}: trigger event {ev} of rank {er} must be an event "
                        f"of a rank in [0, {P})"
                    )
                bumps[er][ev] += 1
                heard[er][r] = True
            if row[ops.ROWS] < 0:
                raise TableError(f"{who}task row {i}: ROWS {row[ops.ROWS]} must be >= 0")
        starts = tables.queue_starts.tolist()
        n = len(tasks)
        if (
            len(starts) != len(tables.queue_names) + 1
            or starts[0] != 0
            or starts[-1] != n
            or any(a > z for a, z in itertools.pairwise(starts))
        ):
            raise TableError(
                f"{who}queue_starts {starts} must rise from 0 to {n}, one cut per queue"
            )
    for r in range(P):
        who = f"rank {r} " if P > 1 else ""
        deaf = [s for s in range(P) if not heard[r][s]]
        if deaf:
            raise TableError(
                f"rank {r}: no row of rank {deaf[0]} bumps its events (every rank's launch must "
                "wait on every other rank's, so that ranks stay within one launch of each "
                "other and two counter sets used in turn suffice: taskflow.runtime.epochs)"
            )
        waited = {row[ops.WAIT] for row in tasks_of[r][0]}
        for ev, want in enumerate(thr[r]):
            if want < 1:
                raise TableError(f"{who}event {ev}: threshold {want} must be >= 1")
            if ev not in waited:
                raise TableError(
                    f"{who}event {ev}: no row waits on it (every event must be waited on, so "
                    "that a launch ends only after every bump into its counters landed)"
                )
            if bumps[r][ev] != want:
                rule = "is unreachable" if bumps[r][ev] < want else "would be passed"
                raise TableError(
                    f"{who}event {ev}: threshold {want} {rule}: the tasks bump it "
                    f"{bumps[r][ev]} times (every threshold must equal its event's number of "
                    "bumps)"
                )
    order = [tuple(x) for x in world.order.tolist()]
    every = sorted((r, i) for r in range(P) for i in range(len(tasks_of[r][0])))
    if sorted(order) != every:
        raise TableError(f"order must be a permutation of the {len(every)} task rows")
    for r, tables in enumerate(world.ranks):
        if tables.order.tolist() != [i for q, i in order if q == r]:
            raise TableError(f"rank {r}: its order must be its rows in the world's order")
    count = [[0] * len(x) for x in thr]
    for pos, (r, i) in enumerate(order):
        tasks, trig, trig_ranks = tasks_of[r]
        row = tasks[i]
        w = row[ops.WAIT]
        if w >= 0 and count[r][w] < thr[r][w]:
            who = f"rank {r} " if P > 1 else ""
            raise TableError(
                f"single-program order: position {pos} ({who}task row {i}, plan uid "
                f"{row[ops.UID]}) waits on event {w} at {count[r][w]}/{thr[r][w]}; its "
                "producers come later, so one program would wait forever"
            )
        a, k = row[ops.TRIG0], row[ops.NTRIG]
        for ev, er in zip(trig[a : a + k], trig_ranks[a : a + k]):
            count[er][ev] += 1


def step_tables(tables: DeviceTables, route: StepRouting, device: torch.device) -> StepTables:
    """The step's routing (``sequential.step_routing``) as device tensors for ``tables``."""
    e, P, S = tables.local_experts, tables.ep_size, tables.slot_rows
    E = e * P
    recv = [route.recv_counts_eP[j][s] for j in range(e) for s in range(P)]
    count = torch.tensor(recv + list(route.send_counts_E), dtype=torch.int32)
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
