"""Static checks a plan passes before anything runs it, and the two-queue simulator.

``check_plan`` (one rank) checks: a known version; the buffers are exactly the ones the runtime
allocates for the bucket; every task's operator, handler type and queue agree with the ODG and
its count with split propagation; every region lies inside its buffer, reads only this rank,
writes only writable buffers (and only the slots a put may write); every row of every written
buffer has exactly one writer (FlashDMoE's write-conflict freedom; the communication buffers
are also mapped onto the symmetric layout L and checked against Definition 5.3.2 by
``layout.check_plan_layout``); every event's threshold equals the number of its producers; the
producers of a task's dependent event cover every row it reads; every tile is exactly the one
the FillConfig generates for its (operator, task_index) (handlers derive rows, experts and
destinations from the regions, so only the queue order and the events are free); the schedule
puts every task once on the queue of its type's class; and the queues cannot deadlock
(``simulate`` on the event engine: both queues consume in order and wait on their counters;
writes of other ranks are assumed to arrive). The cross-rank checks on all plans of a world are
``validate_world.check_world``'s; ``simulate`` also runs a whole world's queues, for them and for
the simulator (``sim/taskflow.py``).

A plan that passes ``check_plan`` is marked validated; ``ensure_validated`` (what executors call)
checks a plan object only once.

Every failure raises a ``PlanError`` (a ``ValueError``) whose message names what is wrong.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from typing import cast

from moesaic.taskflow.engine import (
    DeadlockError,
    EngineError,
    EventEngine,
    EventOverflowError,
    Job,
    Lane,
    Timeline,
)
from moesaic.taskflow.graph import propagate_splits
from moesaic.taskflow.layout import WriteConflictError, check_plan_layout
from moesaic.taskflow.moe_fills import FILLS, FillContext
from moesaic.taskflow.moe_graphs import (
    QUEUE_CLASSES,
    TASK_TYPES,
    MoEGraph,
    buffer_table,
    moe_graph,
)
from moesaic.taskflow.plan import PLAN_VERSION, SUPPORTED_VERSIONS, Plan
from moesaic.taskflow.tasks import Region, TaskDescriptor, Tile


class PlanError(ValueError):
    """A plan that must not run."""


class PlanFormatError(PlanError):
    """Malformed structure: a missing or unknown field, a wrong type."""


class PlanVersionError(PlanError):
    """A plan format version this code does not know."""


class PlanRegionError(PlanError):
    """A region outside its buffer, on the wrong rank, or a write conflict / gap."""


class PlanEventError(PlanError):
    """An event whose threshold is not its producer count, or a dependency not covered."""


class PlanDeadlockError(PlanError):
    """The queues cannot all run to completion."""


def version_error(version: object) -> PlanVersionError:
    """The error for a plan of another format version, naming both versions."""
    return PlanVersionError(
        f"plan format version {version!r} is not supported: this build reads version "
        f"{PLAN_VERSION} only; recompile the plan (moesaic taskflow compile)"
    )


def _check_header(plan: Plan) -> None:
    if plan.version not in SUPPORTED_VERSIONS:
        raise version_error(plan.version)
    P = plan.bucket.ep_size
    if not 0 <= plan.rank < P:
        raise PlanFormatError(f"rank ({plan.rank}) must be in [0, ep_size={P})")
    expected = buffer_table(plan.bucket, plan.direction)
    if tuple(plan.buffers) != expected:
        raise PlanRegionError(
            "buffers differ from what the runtime allocates for this bucket and direction "
            f"(got {[(b.name, b.rows, b.cols) for b in plan.buffers]})"
        )


def _check_region(plan: Plan, where: str, r: Region, *, write: bool, remote_ok: bool) -> None:
    bufs = plan.memo("buffers_by_name", lambda p: {b.name: b for b in p.buffers})
    assert isinstance(bufs, dict)  # for the type checker
    if r.buffer not in bufs:
        raise PlanRegionError(f"{where}: buffer {r.buffer!r} does not exist")
    b = bufs[r.buffer]
    if not 0 <= r.start < r.stop <= b.rows:
        raise PlanRegionError(
            f"{where}: rows [{r.start}, {r.stop}) are outside buffer {r.buffer!r} "
            f"of {b.rows} rows (need 0 <= start < stop <= rows)"
        )
    if not 0 <= r.rank < plan.bucket.ep_size:
        raise PlanRegionError(f"{where}: rank {r.rank} is outside [0, {plan.bucket.ep_size})")
    if r.rank != plan.rank and not remote_ok:
        raise PlanRegionError(
            f"{where}: region on rank {r.rank}; this task may only touch rank {plan.rank}"
        )
    if write and b.kind == "input":
        raise PlanRegionError(f"{where}: writes input buffer {r.buffer!r}")


def _check_put(plan: Plan, t: TaskDescriptor) -> None:
    """A put may only write this rank's own slots (dispatch) or return its own experts' rows
    (combine), at the offset the rows came from."""
    b = plan.bucket
    P, e, S = b.ep_size, b.local_experts, b.slot_rows
    for r in t.outputs:
        if r.start // S != (r.stop - 1) // S:
            raise PlanRegionError(f"{t.label}: put region [{r.start}, {r.stop}) straddles a slot")
    if TASK_TYPES[t.task_type].comm != "combine":
        for r in t.outputs:
            if (r.start // S) % P != plan.rank:
                raise PlanRegionError(
                    f"{t.label}: writes slot of source rank {(r.start // S) % P} on rank "
                    f"{r.rank}; a dispatch may only write its own source slot"
                )
        return
    if len(t.inputs) != len(t.outputs):
        raise PlanRegionError(f"{t.label}: put_combine needs one input region per output")
    for src, dst in zip(t.inputs, t.outputs):
        j, s = divmod(src.start // S, P)
        ok = (
            src.start // S == (src.stop - 1) // S
            and dst.rank == s
            and dst.start == (plan.rank * e + j) * S + src.start % S
            and dst.rows == src.rows
        )
        if not ok:
            raise PlanRegionError(
                f"{t.label}: combine of rows [{src.start}, {src.stop}) must go to rank {s} at "
                f"the return rows of expert {plan.rank * e + j}"
            )


def _check_tasks(plan: Plan, mg: MoEGraph) -> dict[str, int]:
    try:
        split = propagate_splits(mg.graph, plan.bucket, unsplit=plan.options.unsplit)
    except ValueError as exc:
        raise PlanFormatError(f"options: {exc}") from None
    n_events = len(plan.events)
    seen: dict[str, set[int]] = defaultdict(set)
    for i, t in enumerate(plan.tasks):
        where = f"tasks[{i}] ({t.label})"
        if t.uid != i:
            raise PlanFormatError(f"{where}: uid ({t.uid}) must equal its position ({i})")
        layout = mg.layouts.get(t.op)
        if layout is None:
            raise PlanFormatError(
                f"{where}: operator {t.op!r} is not in the {plan.direction} graph"
            )
        if t.task_type != layout.task_type:
            raise PlanFormatError(
                f"{where}: task_type ({t.task_type!r}) must be {layout.task_type!r}"
            )
        if t.split_num != split.task_num[t.op] or not 0 <= t.task_index < t.split_num:
            raise PlanFormatError(
                f"{where}: task_index/split_num ({t.task_index}/{t.split_num}) disagree with "
                f"split propagation ({split.task_num[t.op]} tasks)"
            )
        if t.task_index in seen[t.op]:
            raise PlanFormatError(f"{where}: duplicate task_index for operator {t.op!r}")
        seen[t.op].add(t.task_index)
        allowed_in = {*layout.row_inputs, *layout.weight_inputs, *layout.whole_inputs}
        for k, r in enumerate(t.inputs):
            _check_region(plan, f"{where}.inputs[{k}]", r, write=False, remote_ok=False)
            if r.buffer not in allowed_in:
                raise PlanRegionError(f"{where}.inputs[{k}]: {t.op} does not read {r.buffer!r}")
        is_put = TASK_TYPES[t.task_type].put
        for k, r in enumerate(t.outputs):
            _check_region(plan, f"{where}.outputs[{k}]", r, write=True, remote_ok=is_put)
            if r.buffer not in layout.outputs:
                raise PlanRegionError(f"{where}.outputs[{k}]: {t.op} does not write {r.buffer!r}")
        if is_put:
            _check_put(plan, t)
        if not -1 <= t.dependent_event < n_events:
            raise PlanEventError(f"{where}: dependent_event {t.dependent_event} does not exist")
        for ref in t.trigger_events:
            bad_rank = not 0 <= ref.rank < plan.bucket.ep_size
            if bad_rank or ref.event < 0 or (ref.rank == plan.rank and ref.event >= n_events):
                raise PlanEventError(f"{where}: trigger event {ref} does not exist")
    for op, n in split.task_num.items():
        if len(seen[op]) != n:
            raise PlanFormatError(f"operator {op!r} has {len(seen[op])} tasks; must have {n}")
    return split.task_num


def _check_schedule(plan: Plan) -> None:
    """The two-queue schedule: every task once, on the queue of its type's class."""
    sched = plan.schedule
    if sched.executor != "two_queue" or sched.names != QUEUE_CLASSES:
        raise PlanFormatError(
            f"schedule ({sched.executor!r}, queues {list(sched.names)}) must be the two_queue "
            f"executor's, queues {list(QUEUE_CLASSES)}"
        )
    placed: dict[int, str] = {}
    for name, uids in sched.queues:
        for uid in uids:
            if not 0 <= uid < len(plan.tasks):
                raise PlanFormatError(f"{name} queue names task {uid}, which does not exist")
            if uid in placed:
                raise PlanFormatError(f"task {uid} appears twice in the queues")
            t = plan.tasks[uid]
            cls = TASK_TYPES[t.task_type].queue_class
            if cls != name:
                raise PlanFormatError(
                    f"task {uid} ({t.label}) is a {cls} task but sits in the {name} queue"
                )
            placed[uid] = name
    if len(placed) != len(plan.tasks):
        missing = sorted(set(range(len(plan.tasks))) - set(placed))[:5]
        raise PlanFormatError(f"tasks {missing} are in no queue")


def _writers(plan: Plan, mg: MoEGraph) -> dict[tuple, list[Region]]:
    """Regions of this rank written by each producer, keyed (rank, op, task_index)."""
    out: dict[tuple, list[Region]] = defaultdict(list)
    put_ops = {n for n, lay in mg.layouts.items() if TASK_TYPES[lay.task_type].put}
    for t in plan.tasks:
        out[(plan.rank, t.op, t.task_index)] += [r for r in t.outputs if r.rank == plan.rank]
    for k, w in enumerate(plan.remote_writes):
        where = f"remote_writes[{k}] ({w.op}[{w.task_index}] of rank {w.rank})"
        if not 0 <= w.rank < plan.bucket.ep_size or w.rank == plan.rank:
            raise PlanRegionError(f"{where}: rank must be another rank of the group")
        if w.op not in put_ops:
            raise PlanFormatError(f"{where}: operator {w.op!r} is not a put of this graph")
        key = (w.rank, w.op, w.task_index)
        if key in out:
            raise PlanFormatError(f"{where}: listed twice")
        for r in w.regions:
            _check_region(plan, where, r, write=True, remote_ok=False)
        out[key] = list(w.regions)
        for ev in w.trigger_events:
            if not 0 <= ev < len(plan.events):
                raise PlanEventError(f"{where}: trigger event {ev} does not exist")
    return out


def _check_coverage(plan: Plan, writers: dict[tuple, list[Region]]) -> None:
    """Every row of every written buffer of this rank has exactly one writer."""
    by_buf: dict[str, list[tuple[int, int, tuple]]] = defaultdict(list)
    for key, regions in writers.items():
        for r in regions:
            by_buf[r.buffer].append((r.start, r.stop, key))
    for b in plan.buffers:
        if b.kind == "input":
            continue
        items = sorted(by_buf.get(b.name, []))
        pos = 0
        for start, stop, key in items:
            if start != pos:
                what = "is written twice" if start < pos else "is never written"
                lo, hi = min(start, pos), max(start, pos)
                raise PlanRegionError(
                    f"buffer {b.name!r} rows [{lo}, {hi}) {what} (at writer {key[1]}[{key[2]}] "
                    f"of rank {key[0]})"
                )
            pos = stop
        if pos != b.rows:
            raise PlanRegionError(f"buffer {b.name!r} rows [{pos}, {b.rows}) are never written")


def _check_events(plan: Plan, writers: dict[tuple, list[Region]]) -> None:
    counted: dict[int, list[tuple]] = defaultdict(list)
    for t in plan.tasks:
        for ref in t.trigger_events:
            if ref.rank == plan.rank:
                counted[ref.event].append((plan.rank, t.op, t.task_index))
    for w in plan.remote_writes:
        for ev_id in w.trigger_events:
            counted[ev_id].append((w.rank, w.op, w.task_index))
    for i, ev in enumerate(plan.events):
        if ev.id != i:
            raise PlanFormatError(f"events[{i}]: id ({ev.id}) must equal its position")
        listed = sorted((p.rank, p.op, p.task_index) for p in ev.producers)
        actual = sorted(counted.get(i, []))
        if ev.threshold != len(actual) or listed != actual:
            raise PlanEventError(
                f"event {i}: threshold ({ev.threshold}) must equal the number of its producers "
                f"({len(actual)} tasks trigger it, {len(listed)} are listed)"
            )
        if ev.threshold < 1:
            raise PlanEventError(f"event {i}: threshold ({ev.threshold}) must be >= 1")
    bufs = {b.name: b for b in plan.buffers}
    for t in plan.tasks:
        reads = [r for r in t.inputs if bufs[r.buffer].kind != "input"]
        if not reads:
            continue
        if t.dependent_event < 0:
            raise PlanEventError(f"{t.label}: reads {reads[0].buffer!r} but waits on no event")
        got = [
            r
            for p in plan.events[t.dependent_event].producers
            for r in writers.get((p.rank, p.op, p.task_index), [])
        ]
        for r in reads:
            spans = sorted((w.start, w.stop) for w in got if w.buffer == r.buffer)
            pos = r.start
            for a, z in spans:
                if a <= pos < z:
                    pos = z
            if pos < r.stop:
                raise PlanEventError(
                    f"{t.label}: rows [{pos}, {r.stop}) of {r.buffer!r} are read before any "
                    f"producer of event {t.dependent_event} writes them"
                )


def _rows(regions) -> list[tuple]:
    return [(r.buffer, r.rank, r.start, r.stop) for r in regions][:2]


def _check_against_fill(plan: Plan, task_num: dict[str, int], mg: MoEGraph) -> None:
    """Tiles must be exactly the FillConfig's for the bucket: handlers derive rows, experts and
    destinations from the regions, so only the queue order and the events are free."""
    ctx = FillContext(bucket=plan.bucket, rank=plan.rank, buffers={b.name: b for b in plan.buffers})
    expected: dict[tuple[str, int], Tile] = {}
    stubs: set[tuple[int, str, int, tuple[Region, ...]]] = set()
    for op, n in task_num.items():
        layout = mg.layouts[op]
        tasks, remote = FILLS[layout.kind](ctx, op, layout, n)
        expected.update({(t.op, t.task_index): t for t in tasks})
        stubs.update((w.rank, w.op, w.task_index, w.regions) for w in remote)
    for t in plan.tasks:
        e = expected[(t.op, t.task_index)]
        got = (t.inputs, t.outputs, t.expert, t.peer, t.split_value)
        if got != (e.inputs, e.outputs, e.expert, e.peer, e.split_value):
            raise PlanRegionError(
                f"{t.label}: regions, expert, peer or split_value differ from the tile the "
                f"FillConfig generates for this bucket (outputs {_rows(t.outputs)}, expected "
                f"{_rows(e.outputs)})"
            )
    got_stubs = {(w.rank, w.op, w.task_index, w.regions) for w in plan.remote_writes}
    if got_stubs != stubs or len(got_stubs) != len(plan.remote_writes):
        raise PlanRegionError("remote_writes differ from the writes the other ranks' tiles make")


def check_plan(plan: Plan) -> None:
    """All single-rank checks (see the module docstring); raises a ``PlanError``. A plan that
    passes is marked (``plan.validated``), so executors do not check it again."""
    _check_header(plan)
    mg = moe_graph(plan.direction, plan.bucket.activation)  # built once per check
    task_num = _check_tasks(plan, mg)
    _check_schedule(plan)
    writers = _writers(plan, mg)
    try:  # FlashDMoE Def. 5.3.2 on the communication buffers, mapped onto the symmetric layout
        check_plan_layout(plan)
    except WriteConflictError as exc:
        raise PlanRegionError(str(exc)) from None
    _check_coverage(plan, writers)
    _check_events(plan, writers)
    _check_against_fill(plan, task_num, mg)
    simulate([plan], world=False)
    plan._mark_validated()


def ensure_validated(plan: Plan) -> None:
    """``check_plan`` unless this plan object already passed it (it is immutable)."""
    if not plan.validated:
        check_plan(plan)


def _lanes(plans: Sequence[Plan], world: bool) -> list[Lane[TaskDescriptor]]:
    """Engine lanes of ``plans``: one per (rank, queue); jobs keyed ``(rank, uid)``, events
    ``(rank, event id)``. With ``world=False`` a task bumps only its own rank's counters."""
    lanes = []
    for p in plans:
        r, tasks = p.rank, p.tasks
        trig = [
            tuple((x.rank, x.event) for x in t.trigger_events if world or x.rank == r)
            for t in tasks
        ]
        for name, uids in p.schedule.queues:
            jobs = [
                Job(
                    (r, u),
                    tasks[u],
                    (r, tasks[u].dependent_event) if tasks[u].dependent_event >= 0 else None,
                    trig[u],
                )
                for u in uids
            ]
            lanes.append(Lane((r, name), jobs))
    return lanes


def simulate(
    plans: Sequence[Plan],
    *,
    world: bool,
    cost: Callable[[TaskDescriptor], float] | None = None,
) -> Timeline:
    """Run the queues of ``plans`` on the event engine (``engine.EventEngine``).

    Each queue starts its head task once its dependent event reached its threshold (at the
    latest completion among the producers), one task at a time. With ``world=False`` a single
    plan runs and writes of other ranks count as arrived at time 0; with ``world=True``
    ``plans[r]`` is rank r and puts bump the counters of their target ranks. The timeline is
    keyed by ``(rank, uid)``.

    Raises:
        PlanDeadlockError: some queue cannot finish; names every blocked head.
        PlanEventError: an event is triggered more often than its threshold, or does not exist.
    """
    thresholds: dict[Hashable, int] = {
        (p.rank, ev.id): ev.threshold for p in plans for ev in p.events
    }
    engine = EventEngine(_lanes(plans, world), thresholds, cost=cost)
    try:
        if not world:
            for w in plans[0].remote_writes:
                for ev in w.trigger_events:
                    engine.fire((plans[0].rank, ev))
        return engine.run()
    except DeadlockError as exc:
        blocked = []
        for s in exc.stalls:
            rank, queue = cast(tuple[int, str], s.lane)  # simulate's lanes are (rank, name)
            t = s.job.task
            blocked.append(
                f"rank {rank} {queue} queue at position {s.position} ({t.label}) waits on event "
                f"{t.dependent_event} ({s.count}/{s.threshold})"
            )
        raise PlanDeadlockError("plan deadlocks: " + "; ".join(blocked)) from None
    except EventOverflowError as exc:
        rank, ev = cast(tuple[int, int], exc.event)  # simulate's events are (rank, id)
        raise PlanEventError(
            f"rank {rank} event {ev} is triggered more than {thresholds[exc.event]} times"
        ) from None
    except EngineError as exc:
        raise PlanEventError(str(exc)) from None
