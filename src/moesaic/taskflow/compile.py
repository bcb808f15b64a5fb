"""Static scheduler: ODG -> split propagation -> task descriptors -> two queues with events.

Steps (paper §4.2-4.5), all offline and per rank:

1. split propagation (Algorithm 1) over the forward or backward MoE-FFN graph;
2. FillConfigs turn each operator's task count into task descriptors and remote-write records;
3. events: a task's producers are the writers of the rows it reads; consumers with the same
   producer set share one counter whose threshold is the size of that set (many-to-many
   dependencies), and every producer triggers every counter it belongs to;
4. the task graph is frozen; the schedule (``schedule_two_queue``) puts each task on the queue of
   its type's class (``moe_graphs.TASK_TYPES``: GMMs on the matrix queue, everything else on the
   vector/communication queue) in operator-topological order ("kernel by kernel"), then
5. ordering optimisations that only permute independent tasks: rank-aware task reordering of
   communication tiles (RATR, Fig. 6) and cache-guided interleaving of the independent backward
   GMMs by expert;
6. validation (``validate.check_plan``): a plan that fails is a compiler bug and never returned.

Per-rank compilation without seeing the other ranks' plans works because the plans are
rank-symmetric: event ids are assigned from canonical writer keys (operator, rows written), which
are the same on every rank, so the counter a put must bump on rank d is the counter the same rows
have on this rank. ``validate_world.check_world`` verifies that claim on a whole world.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections import defaultdict
from collections.abc import Sequence

from moesaic.checks import is_int
from moesaic.taskflow.bucket import DIRECTIONS, CompileOptions, ShapeBucket
from moesaic.taskflow.graph import propagate_splits
from moesaic.taskflow.moe_fills import FILLS, FillContext
from moesaic.taskflow.moe_graphs import QUEUE_CLASSES, TASK_TYPES, buffer_table, moe_graph
from moesaic.taskflow.plan import PLAN_VERSION, Plan, Schedule, TaskGraph
from moesaic.taskflow.tasks import (
    CompileError,
    Event,
    EventRef,
    ProducerRef,
    Region,
    RemoteWrite,
    TaskDescriptor,
    Tile,
)

# Independent backward GMM pairs that share an input per expert (paper §4.5): the act-grad and
# w2-grad GMMs both read the dispatched gradient; the gate-grad and w1-grad GMMs both read dh.
INTERLEAVE_PAIRS = (("gmm_act_grad", "gmm_w2_grad"), ("gmm_gate_grad", "gmm_w1_grad"))

WriterKey = tuple[str, tuple[tuple[str, int, int], ...]]


def _writer_key(op: str, regions: Sequence[Region]) -> WriterKey:
    return (op, tuple((r.buffer, r.start, r.stop) for r in regions))


def _regions_by_rank(regions: Sequence[Region]) -> dict[int, list[Region]]:
    out: dict[int, list[Region]] = {}
    for r in regions:
        out.setdefault(r.rank, []).append(r)
    return out


class _WriterIndex:
    """Disjoint writer intervals per buffer of this rank, for overlap queries."""

    def __init__(self) -> None:
        self._raw: dict[str, list[tuple[int, int, WriterKey]]] = defaultdict(list)
        self.keys: set[WriterKey] = set()

    def add(self, key: WriterKey, regions: Sequence[Region]) -> None:
        self.keys.add(key)
        for r in regions:
            self._raw[r.buffer].append((r.start, r.stop, key))

    def freeze(self) -> None:
        self._by_buf = {}
        for buf, items in self._raw.items():
            items.sort()
            for (_, stop0, k0), (start1, _, k1) in itertools.pairwise(items):
                if start1 < stop0:
                    raise CompileError(f"buffer {buf!r}: writers {k0[0]} and {k1[0]} overlap")
            self._by_buf[buf] = (items, [it[1] for it in items])

    def producers(self, region: Region) -> set[WriterKey]:
        """Writers overlapping ``region``; raises if some row of it has no writer."""
        items, stops = self._by_buf.get(region.buffer, ([], []))
        i = bisect.bisect_right(stops, region.start)
        covered, found = region.start, set()
        while i < len(items) and items[i][0] < region.stop:
            start, stop, key = items[i]
            if start > covered:
                break
            found.add(key)
            covered = stop
            i += 1
        if covered < region.stop:
            raise CompileError(
                f"rows [{covered}, {region.stop}) of {region.buffer!r} are read but no task "
                "writes them"
            )
        return found


def _assign_events(
    tiles: list[Tile],
    stubs: list[RemoteWrite],
    work_buffers: set[str],
    rank: int,
) -> tuple[list[TaskDescriptor], list[RemoteWrite], list[Event]]:
    """Events of every tile; returns the tasks (uid = position), remote writes and events."""
    index = _WriterIndex()
    for t in tiles:
        local = [r for r in t.outputs if r.rank == rank]
        if local:
            index.add(_writer_key(t.op, local), local)
    for w in stubs:
        index.add(_writer_key(w.op, w.regions), w.regions)
    index.freeze()
    event_of: dict[frozenset[WriterKey], int] = {}
    waits: list[int] = []
    for t in tiles:
        keys: set[WriterKey] = set()
        for r in t.inputs:
            if r.buffer in work_buffers:
                keys |= index.producers(r)
        waits.append(event_of.setdefault(frozenset(keys), len(event_of)) if keys else -1)
    events_of_key: dict[WriterKey, list[int]] = defaultdict(list)
    for key_set, ev in event_of.items():
        for k in key_set:
            events_of_key[k].append(ev)
    producers: list[list[ProducerRef]] = [[] for _ in event_of]
    tasks: list[TaskDescriptor] = []
    for uid, t in enumerate(tiles):
        trig: list[EventRef] = []
        for d, regs in _regions_by_rank(t.outputs).items():
            key = _writer_key(t.op, regs)
            if key not in index.keys:
                raise CompileError(
                    f"{t.op}[{t.task_index}] writes {key[1]} on rank {d}, rows no task writes "
                    f"on rank {rank}: the plan is not rank-symmetric"
                )
            trig += [EventRef(rank=d, event=ev) for ev in sorted(events_of_key.get(key, ()))]
        tasks.append(
            TaskDescriptor.from_tile(
                t, uid=uid, dependent_event=waits[uid], trigger_events=tuple(trig)
            )
        )
        for ref in trig:
            if ref.rank == rank:
                producers[ref.event].append(
                    ProducerRef(rank=rank, op=t.op, task_index=t.task_index)
                )
    out_stubs = []
    for w in stubs:
        evs = tuple(sorted(events_of_key.get(_writer_key(w.op, w.regions), ())))
        out_stubs.append(
            RemoteWrite(
                rank=w.rank, op=w.op, task_index=w.task_index, regions=w.regions, trigger_events=evs
            )
        )
        for ev in evs:
            producers[ev].append(ProducerRef(rank=w.rank, op=w.op, task_index=w.task_index))
    events = [Event(id=i, threshold=len(p), producers=tuple(p)) for i, p in enumerate(producers)]
    return tasks, out_stubs, events


def rank_aware_order(
    tasks: Sequence[TaskDescriptor], queue: Sequence[int], rank: int, bucket: ShapeBucket
) -> list[int]:
    """RATR (paper §4.5, Fig. 6), applied to every run of one operator's tasks in a queue.

    * Dispatch puts rotate the destination by the source rank: at turn i rank r sends to
      ``(r + i) % P``, so at every turn the P ranks send to P different destinations (a Latin
      square) instead of all starting at destination 0. We go local expert by local expert
      (every destination's expert j, then its expert j + 1), so each rank has all P slots of
      its first expert after P turns, not after a whole round of every expert.
    * Consequently rank d receives from source ``(d - i) % P`` at turn i; the row tiles that
      consume the receive slots (GMMs, activations and their gradients) are ordered expert by
      expert, and inside an expert by that arrival turn.
    * Combine puts follow the GMM tiles that feed them, so rank d returns to source
      ``(d - i) % P`` at turn i: again a different destination per rank at every turn.

    Only the relative order of tasks of one operator changes; ties keep their queue order.
    """
    P, S, e = bucket.ep_size, bucket.slot_rows, bucket.local_experts
    out = list(queue)

    def key(pos_uid: tuple[int, int]) -> tuple[int, int, int]:
        pos, uid = pos_uid
        t = tasks[uid]
        kind = TASK_TYPES[t.task_type]
        if kind.put:
            if t.peer < 0:
                return (0, 0, pos)
            if kind.comm == "combine":
                return (t.expert, (rank - t.peer) % P, pos)
            return (t.expert % e, (t.peer - rank) % P, pos)
        if kind.rows and t.expert >= 0:
            src = (t.inputs[0].start // S) % P
            return (t.expert, (rank - src) % P, pos)
        return (0, 0, pos)

    i = 0
    while i < len(out):
        j = i + 1
        while j < len(out) and tasks[out[j]].op == tasks[out[i]].op:
            j += 1
        run = sorted(enumerate(out[i:j]), key=key)
        out[i:j] = [uid for _, uid in run]
        i = j
    return out


def interleave_by_expert(
    tasks: Sequence[TaskDescriptor],
    queue: Sequence[int],
    pairs: Sequence[tuple[str, str]] = INTERLEAVE_PAIRS,
) -> list[int]:
    """Cache-guided GMM interleaving: for each independent pair of operators, reorder their
    tasks (in the positions they already occupy) expert by expert, so both GMMs that read one
    expert's rows run back to back while those rows are still in cache."""
    out = list(queue)
    for pair in pairs:
        slots = [i for i, uid in enumerate(out) if tasks[uid].op in pair]
        rank_of = {out[i]: i for i in slots}  # current position: keeps the RATR order inside

        def _interleave_key(
            t: TaskDescriptor, pair: tuple[str, str] = pair, rank_of: dict[int, int] = rank_of
        ) -> tuple[float, int, int]:
            # A task spanning every expert (an Alg. 1 fall-back) goes first if it feeds the
            # vector queue (the activation-gradient GMM), last if it is a weight-gradient sink.
            first = pair.index(t.op) == 0
            expert = t.expert if t.expert >= 0 else (-1 if first else float("inf"))
            return (expert, pair.index(t.op), rank_of[t.uid])

        ranked = sorted((out[i] for i in slots), key=lambda uid: _interleave_key(tasks[uid]))
        for i, uid in zip(slots, ranked):
            out[i] = uid
    return out


def compile_plan(
    bucket: ShapeBucket,
    direction: str,
    rank: int,
    options: CompileOptions | None = None,
    *,
    validate: bool = True,
) -> Plan:
    """Compile the static plan of one rank.

    Args:
        bucket: shapes, parallel configuration and tile sizes.
        direction: "forward" or "backward".
        rank: the rank in ``[0, bucket.ep_size)``.
        options: scheduler options (RATR, interleaving, forced unsplit operators).
        validate: run ``validate.check_plan`` on the result (on by default; a failure is a
            compiler bug).

    Raises:
        ValueError (or its subclass CompileError): a bad direction, rank or option, or a split
            the task generator cannot tile.
    """
    options = options or CompileOptions()
    if direction not in DIRECTIONS:
        raise ValueError(f"direction ({direction!r}) must be one of {DIRECTIONS}")
    if options.pipeline:  # the pipelined order comes from a simulation of the whole world
        if not is_int(rank) or not 0 <= rank < bucket.ep_size:
            raise ValueError(f"rank ({rank}) must be in [0, {bucket.ep_size})")
        plan = _pipelined_world(bucket, direction, options)[rank]
        if validate:
            from moesaic.taskflow.validate import check_plan

            check_plan(plan)
        return plan
    if not is_int(rank) or not 0 <= rank < bucket.ep_size:
        raise ValueError(f"rank ({rank!r}) must be an int in [0, ep_size={bucket.ep_size})")
    mg = moe_graph(direction, bucket.activation)
    split = propagate_splits(mg.graph, bucket, unsplit=options.unsplit)
    buffers = buffer_table(bucket, direction)
    ctx = FillContext(bucket=bucket, rank=rank, buffers={b.name: b for b in buffers})
    tiles: list[Tile] = []
    stubs: list[RemoteWrite] = []
    for op_name in split.order:
        layout = mg.layouts[op_name]
        new_tiles, new_stubs = FILLS[layout.kind](ctx, op_name, layout, split.task_num[op_name])
        tiles += new_tiles
        stubs += new_stubs
    work = {b.name for b in buffers if b.kind != "input"}
    tasks, stubs, events = _assign_events(tiles, stubs, work, rank)
    graph = TaskGraph(
        buffers=buffers,
        tasks=tuple(tasks),
        events=tuple(events),
        remote_writes=tuple(stubs),
        task_num=split.task_num,
        fell_back=split.fell_back,
    )
    plan = Plan(
        version=PLAN_VERSION,
        direction=direction,
        rank=rank,
        bucket=bucket,
        options=options,
        graph=graph,
        schedule=schedule_two_queue(tasks, rank, bucket, options, direction),
    )
    if validate:
        from moesaic.taskflow.validate import check_plan

        check_plan(plan)
    return plan


def schedule_two_queue(
    tasks: Sequence[TaskDescriptor],
    rank: int,
    bucket: ShapeBucket,
    options: CompileOptions,
    direction: str,
) -> Schedule:
    """The two-queue executor's schedule: each task on the queue of its type's class, in
    operator-topological order, then RATR and (backward) GMM interleaving. The pipelined order
    (``options.pipeline``) needs the whole world: ``compile_plan`` applies it."""
    queues = {
        name: [t.uid for t in tasks if TASK_TYPES[t.task_type].queue_class == name]
        for name in QUEUE_CLASSES
    }
    if options.ratr:
        queues = {n: rank_aware_order(tasks, q, rank, bucket) for n, q in queues.items()}
    if options.interleave and direction == "backward":
        queues["matrix"] = interleave_by_expert(tasks, queues["matrix"])
    return Schedule(executor="two_queue", queues=tuple((n, tuple(q)) for n, q in queues.items()))


def compile_world(
    bucket: ShapeBucket,
    direction: str,
    options: CompileOptions | None = None,
    *,
    validate: bool = True,
) -> list[Plan]:
    """Plans of every rank, and (with ``validate``) the cross-rank check of all of them."""
    options = options or CompileOptions()
    if options.pipeline:
        plans = _pipelined_world(bucket, direction, options)
        if validate:
            from moesaic.taskflow.validate import check_plan

            for plan in plans:
                check_plan(plan)
    else:
        plans = [
            compile_plan(bucket, direction, r, options, validate=validate)
            for r in range(bucket.ep_size)
        ]
    if validate:
        from moesaic.taskflow.validate_world import check_world

        check_world(plans)
    return plans


def _pipelined_world(bucket: ShapeBucket, direction: str, options: CompileOptions) -> list[Plan]:
    """Every rank's plan with the list-scheduled order (``listsched.pipeline_world``), unchecked:
    compiled without it, re-ordered, and marked with ``options``."""
    from moesaic.taskflow.listsched import pipeline_world

    base = dataclasses.replace(options, pipeline=False)
    plans = [
        compile_plan(bucket, direction, r, base, validate=False) for r in range(bucket.ep_size)
    ]
    orders = pipeline_world(plans)
    return [
        dataclasses.replace(p, options=options, schedule=_reordered(p.schedule, order))
        for p, order in zip(plans, orders)
    ]


def _reordered(schedule: Schedule, order: dict[str, list[int]]) -> Schedule:
    queues = tuple((name, tuple(order[name])) for name, _ in schedule.queues)
    return Schedule(executor=schedule.executor, queues=queues)
