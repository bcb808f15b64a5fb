"""Concurrent executors of a task graph: static two-queue workers and FlashDMoE's actor runtime.

Generic: they run any ``TaskGraph`` (the MoE-FFN plans, a SwiGLU+Add microbenchmark) through a
``launch(task)`` callback that does the task's work; the executor owns the order and the event
counters (``comm.counters.EventCounters``: thresholds, deadline-bounded waits, listeners).
After ``launch`` returns, the executor bumps the task's triggers on this rank; triggers on other
ranks are the launch's business (its puts carry them).

**Static** (:func:`run_static`, HyperParallel-MoE §4.4, the CPU analogue of the AIC/AIV workers):
one worker per schedule queue (the calling thread runs the first), each consuming its queue in
the compiled order: wait until the task's dependent event reaches its threshold, run, bump.
No decision is made at run time; the only per-task cost is a counter check and a bump.

**Dynamic** (:func:`run_dynamic`, FlashDMoE Alg. 1-4): the Subscriber (the transport's receiving
thread, or any bump) notifies through the counters' listener; a Scheduler thread turns an event
that reached its threshold into ready tasks on a ready queue; a pool of Processors takes ready
tasks in arrival order, runs them and bumps their triggers, which may notify the Scheduler again.
Order is decided at run time, so the same graph needs no compiled schedule order (the schedule
is read only for the set of tasks), at the price of two thread hand-offs per task.

Both stop at the first error: a failing task, or a wait past ``timeout_s`` (a peer that died),
makes every other worker's wait fail at once (``EventCounters.fail``) and the first error is
re-raised on the calling thread. Every executed task can be recorded as a ``trace.Span`` on the
lane of its worker ("matrix", "vector"; "processor0", ...), for a Chrome trace per queue per rank.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Hashable

from moesaic.checks import check_positive, check_positive_int
from moesaic.comm.collectives import CollectiveError
from moesaic.comm.counters import EventCounters
from moesaic.taskflow.engine import Job, Lane
from moesaic.taskflow.plan import Schedule, TaskGraph
from moesaic.taskflow.tasks import TaskDescriptor
from moesaic.trace import Recorder

__all__ = ["EXECUTORS", "engine_lanes", "make_counters", "run_dynamic", "run_static"]

EXECUTORS = ("static", "dynamic")
Launch = Callable[[TaskDescriptor], None]


def make_counters(graph: TaskGraph, rank: int) -> EventCounters:
    """Fresh counters for one run of ``graph`` (at least one, so an event-free graph works).

    The executors bump and wait without validating each event id: a graph's ids are
    ``0 .. len(events) - 1`` (``TaskGraph``; checked when a plan is validated), which these
    counters cover."""
    return EventCounters(max(1, len(graph.events)), rank)


class _Failures:
    """The first error of a run, shared by its threads."""

    def __init__(self, counters: EventCounters) -> None:
        self.counters = counters
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()

    def add(self, where: str, exc: BaseException) -> None:
        with self.lock:
            self.errors.append(exc)
        self.counters.fail(f"{where} failed: {(str(exc).splitlines() or [''])[0][:200]}")

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]


class _Worker(threading.Thread):
    """One worker thread of a run, daemonic (a worker stranded by an interrupted caller never
    keeps the interpreter from exiting) and with its own ``finished`` flag: after a join that a
    signal interrupted, CPython 3.11's ``Thread.join`` may report a running thread as stopped
    (bpo-45274's fix releases the thread's own state lock), so ``_run_threads`` waits for the
    flag instead of joining again."""

    def __init__(self, target: Callable[..., None], name: str, *args: object) -> None:
        super().__init__(name=name, daemon=True)
        self._work, self._work_args = target, args
        self.finished = threading.Event()

    def run(self) -> None:
        try:
            self._work(*self._work_args)
        finally:
            self.finished.set()


def _run_threads(
    threads: list[_Worker],
    failures: _Failures,
    main: Callable[[], object] | None = None,
    stop: Callable[[], None] | None = None,
) -> None:
    """Start ``threads``, run ``main`` on the calling thread, join them, raise the first error.

    An exception in the calling thread outside ``main`` (a Ctrl-C while it joins) fails the
    run's counters and calls ``stop``, so the workers return instead of waiting out their
    deadline; it waits for them to finish, then re-raises it."""
    try:
        for th in threads:
            th.start()
        if main is not None:
            main()
        for th in threads:
            th.join()
    except BaseException as exc:
        failures.add("the calling thread", exc)
        if stop is not None:
            stop()
        for th in threads:
            if th.ident is not None:
                th.finished.wait()
        raise
    failures.raise_first()


def _bump_local(counters: EventCounters, task: TaskDescriptor, rank: int) -> None:
    for ref in task.trigger_events:
        if ref.rank == rank:
            counters.bump_unchecked(ref.event)


EngineLanes = tuple[list[Lane[TaskDescriptor]], dict[Hashable, int]]


def engine_lanes(graph: TaskGraph, schedule: Schedule, rank: int) -> EngineLanes:
    """The event engine's lanes of ``graph`` on ``rank`` (``taskflow.engine``): one ``Lane`` per
    schedule queue, a ``Job`` per task keyed by its uid (``wait``: its dependent event or None;
    ``triggers``: its events on this rank; other ranks count their own receives), and the
    thresholds by event id. The sequential executor hands them to ``EventEngine``; the static
    executor runs each lane on its own thread. Build once per plan (``Plan.memo``)."""
    lanes = []
    for name, uids in schedule.queues:
        jobs = []
        for uid in uids:
            t = graph.tasks[uid]
            wait = t.dependent_event if t.dependent_event >= 0 else None
            trig = tuple(r.event for r in t.trigger_events if r.rank == rank)
            jobs.append(Job(key=uid, task=t, wait=wait, triggers=trig))
        lanes.append(Lane(name=name, jobs=jobs))
    thresholds: dict[Hashable, int] = {ev.id: ev.threshold for ev in graph.events}
    return lanes, thresholds


def run_static(
    graph: TaskGraph,
    schedule: Schedule,
    rank: int,
    launch: Launch,
    counters: EventCounters,
    *,
    timeout_s: float = 60.0,
    recorder: Recorder | None = None,
    lanes: EngineLanes | None = None,
) -> None:
    """Run every queue of ``schedule`` on its own worker, each in its compiled order.

    Args:
        graph: the task graph (tasks, events with thresholds).
        schedule: the queues (one worker each; the calling thread runs the first).
        rank: this rank (triggers of other ranks are left to ``launch``).
        launch: does one task's work.
        counters: the run's event counters (fresh, or reset, per run).
        timeout_s: bound on every wait for an event.
        recorder: records one span per task on the lane named after its queue.
        lanes: ``engine_lanes(graph, schedule, rank)``, when the caller keeps them.
    """
    check_positive("timeout_s", timeout_s)
    queues, thresholds = lanes or engine_lanes(graph, schedule, rank)
    failures = _Failures(counters)
    record = recorder is not None and recorder.enabled
    counts = counters.counts_view  # read without the lock: counts only go up
    wait, bump = counters.wait_unchecked, counters.bump_unchecked

    def work(lane: Lane[TaskDescriptor]) -> None:
        name = str(lane.name)
        try:
            if record:
                clock = time.perf_counter
                for job in lane.jobs:
                    ev = job.wait
                    if ev is not None and counts[ev] < thresholds[ev]:  # type: ignore[call-overload]
                        wait(ev, thresholds[ev], timeout_s)  # type: ignore[arg-type]
                    start = clock()
                    launch(job.task)
                    recorder.add(name, job.task.label, start, clock(), uid=job.key)  # type: ignore[union-attr]
                    for e in job.triggers:
                        bump(e)  # type: ignore[arg-type]
                return
            # the hot loop: a list read, the task, the bumps (a Job unpacks like a tuple)
            for _, task, ev, triggers in lane.jobs:
                if ev is not None and counts[ev] < thresholds[ev]:  # type: ignore[call-overload]
                    wait(ev, thresholds[ev], timeout_s)  # type: ignore[arg-type]
                launch(task)
                for e in triggers:
                    bump(e)  # type: ignore[arg-type]
        except BaseException as exc:
            failures.add(f"the {name} worker", exc)

    threads = [_Worker(work, f"moesaic-{lane.name}-{rank}", lane) for lane in queues[1:]]
    _run_threads(threads, failures, lambda: work(queues[0]) if queues else None)


def run_dynamic(
    graph: TaskGraph,
    schedule: Schedule,
    rank: int,
    launch: Launch,
    counters: EventCounters,
    *,
    processors: int = 2,
    timeout_s: float = 60.0,
    recorder: Recorder | None = None,
) -> None:
    """Run the graph's scheduled tasks on a Scheduler and ``processors`` Processors.

    Tasks become ready when their dependent event reaches its threshold (decided at run time,
    in arrival order); the schedule contributes only which tasks run. Arguments as
    :func:`run_static`; ``processors`` is the size of the processor pool.
    """
    check_positive("timeout_s", timeout_s)
    check_positive_int("processors", processors)
    tasks, thresholds = graph.tasks, [ev.threshold for ev in graph.events]
    uids = [uid for _, q in schedule.queues for uid in q]
    total = len(uids)
    waiting: dict[int, list[int]] = {}
    initial: list[int] = []
    for uid in sorted(uids):
        ev = tasks[uid].dependent_event
        (waiting.setdefault(ev, []) if ev >= 0 else initial).append(uid)
    notify: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    ready: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    failures = _Failures(counters)
    record = recorder is not None and recorder.enabled
    done = [0]
    done_lock = threading.Lock()

    def listener(event: int, count: int) -> None:  # on the bumping thread: enqueue only
        if count >= thresholds[event] and event in waiting:  # a repeat finds nothing left
            notify.put(event)

    counters.add_listener(listener)
    for ev, _ in waiting.items():  # events already complete before the run (pre-fired writes)
        if counters.count(ev) >= thresholds[ev]:
            notify.put(ev)

    def stop_all() -> None:
        notify.put(None)
        for _ in range(processors):
            ready.put(None)

    def scheduler() -> None:
        released = len(initial)
        for uid in initial:
            ready.put(uid)
        try:
            while released < total:
                try:
                    ev = notify.get(timeout=timeout_s)
                except queue.Empty:
                    pending = sorted(e for e in waiting if counters.count(e) < thresholds[e])
                    raise CollectiveError(
                        f"taskflow dynamic scheduler on rank {rank}: no event completed within "
                        f"{timeout_s:g}s; {total - released} tasks wait on events "
                        f"{pending[:8]}: a peer died, hung or runs another plan"
                    ) from None
                if ev is None:
                    return
                for uid in waiting.pop(ev, ()):
                    ready.put(uid)
                    released += 1
        except BaseException as exc:
            failures.add("the scheduler", exc)
            stop_all()

    def processor(k: int) -> None:
        name = f"processor{k}"
        try:
            while True:
                try:
                    uid = ready.get(timeout=timeout_s)
                except queue.Empty:
                    raise CollectiveError(
                        f"taskflow processor {k} on rank {rank}: no task became ready within "
                        f"{timeout_s:g}s"
                    ) from None
                if uid is None:
                    return
                t = tasks[uid]
                start = time.perf_counter()
                launch(t)
                if record:
                    recorder.add(name, t.label, start, time.perf_counter(), uid=uid)  # type: ignore[union-attr]
                _bump_local(counters, t, rank)
                with done_lock:
                    done[0] += 1
                    last = done[0] == total
                if last:
                    stop_all()
        except BaseException as exc:
            failures.add(f"processor {k}", exc)
            stop_all()

    if total == 0:
        return
    threads = [_Worker(scheduler, f"moesaic-scheduler-{rank}")]
    threads += [_Worker(processor, f"moesaic-processor{k}-{rank}", k) for k in range(processors)]
    _run_threads(threads, failures, stop=stop_all)
