"""The compiled plan of one rank (the paper's Static Schedule Configuration): a frozen task graph
plus a schedule for one executor.

* ``TaskGraph``: what must happen — buffers, tasks (regions, events waited on and bumped),
  event counters with thresholds, and the writes other ranks make into this rank's buffers. No
  queue and no order in it.
* ``Schedule``: how one executor runs it — named queues, each an order of task uids. The
  two-queue executor has a "matrix" queue (GMMs) and a "vector" queue (communication,
  activations, reductions); other executors (more queues, a simulator's resources) would use
  other names on the same graph.

One plan exists per (shape bucket, direction, EP size, rank). Every field is immutable, so a
plan that passed ``validate.check_plan`` stays valid: the check marks it (``validated``) and
executors skip re-checking a marked plan. ``dataclasses.replace`` gives a new, unmarked plan.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from moesaic.taskflow.bucket import CompileOptions, ShapeBucket
from moesaic.taskflow.tasks import BufferSpec, Event, RemoteWrite, TaskDescriptor

PLAN_FORMAT = "moesaic.taskflow.plan"
PLAN_VERSION = 2
SUPPORTED_VERSIONS = (2,)


def _hash(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(kw_only=True, slots=True, frozen=True)
class TaskGraph:
    """The frozen task graph of one rank.

    Attributes:
        buffers: the rank's buffers.
        tasks: task table; ``tasks[i].uid == i``.
        events: event counters of this rank; ``events[i].id == i``.
        remote_writes: tasks of other ranks writing this rank's buffers.
        task_num: tasks per operator, as split propagation decided (read-only mapping).
        fell_back: operators that fell back to one task (Alg. 1, line 12).
    """

    buffers: tuple[BufferSpec, ...]
    tasks: tuple[TaskDescriptor, ...]
    events: tuple[Event, ...]
    remote_writes: tuple[RemoteWrite, ...]
    task_num: Mapping[str, int]
    fell_back: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "task_num", MappingProxyType(dict(self.task_num)))


@dataclass(kw_only=True, slots=True, frozen=True)
class Schedule:
    """Queue orders of a task graph for one executor.

    Attributes:
        executor: the executor kind the queues are for (e.g. "two_queue").
        queues: ``(name, uids in execution order)`` per queue, in the executor's queue order.
    """

    executor: str
    queues: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.queues)

    def queue(self, name: str) -> tuple[int, ...]:
        """The uids of queue ``name`` in execution order."""
        for n, uids in self.queues:
            if n == name:
                return uids
        raise ValueError(f"queue ({name!r}) must be one of {self.names}")

    def with_queue(self, name: str, uids: Sequence[int]) -> Schedule:
        """A copy with queue ``name`` replaced by ``uids``."""
        self.queue(name)  # raises for an unknown name
        queues = tuple((n, tuple(uids) if n == name else q) for n, q in self.queues)
        return Schedule(executor=self.executor, queues=queues)

    def queue_of(self) -> dict[int, str]:
        """The queue name of every scheduled uid."""
        return {uid: name for name, uids in self.queues for uid in uids}


@dataclass(kw_only=True, slots=True, frozen=True)
class Plan:
    """Static taskflow of one rank: header, task graph and schedule (immutable).

    Attributes:
        version: plan format version.
        direction: "forward" or "backward".
        rank: the rank that runs it.
        bucket: shapes and parallel configuration it was compiled for.
        options: scheduler options used.
        graph: the task graph.
        schedule: the queue orders.
    """

    version: int
    direction: str
    rank: int
    bucket: ShapeBucket
    options: CompileOptions
    graph: TaskGraph
    schedule: Schedule
    _validated: bool = field(default=False, init=False, repr=False, compare=False)
    _memo: dict[str, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    # -- the graph's parts, for brevity -----------------------------------------------------------
    @property
    def buffers(self) -> tuple[BufferSpec, ...]:
        return self.graph.buffers

    @property
    def tasks(self) -> tuple[TaskDescriptor, ...]:
        return self.graph.tasks

    @property
    def events(self) -> tuple[Event, ...]:
        return self.graph.events

    @property
    def remote_writes(self) -> tuple[RemoteWrite, ...]:
        return self.graph.remote_writes

    @property
    def task_num(self) -> Mapping[str, int]:
        return self.graph.task_num

    @property
    def fell_back(self) -> tuple[str, ...]:
        return self.graph.fell_back

    def queue(self, name: str) -> tuple[int, ...]:
        """The uids of the schedule's queue ``name`` in execution order."""
        return self.schedule.queue(name)

    def buffer(self, name: str) -> BufferSpec:
        for b in self.graph.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    # -- validation mark and fingerprints ---------------------------------------------------------
    @property
    def validated(self) -> bool:
        """True once ``validate.check_plan`` passed on this very object."""
        return self._validated

    def _mark_validated(self) -> None:
        """Called by ``validate.check_plan`` only (the plan is immutable, so the mark holds)."""
        object.__setattr__(self, "_validated", True)

    def memo(self, key: str, build: Callable[[Plan], object]) -> object:
        """``build(self)``, computed once per plan object (the plan is immutable, so anything
        derived from it stays true; an executor keeps its per-step job lists here)."""
        if key not in self._memo:
            self._memo[key] = build(self)
        return self._memo[key]

    @property
    def world_settings(self) -> dict[str, object]:
        """Every setting that must agree across the ranks of one world, flattened
        (``bucket.tokens``, ``options.ratr``, ...). The direction is not one of them: a world
        has a forward and a backward plan per rank."""
        out: dict[str, object] = {"version": self.version}
        out.update({f"bucket.{k}": v for k, v in self.bucket.to_dict().items()})
        out.update({f"options.{k}": v for k, v in self.options.to_dict().items()})
        return out

    @property
    def world_fingerprint(self) -> str:
        """Hash of ``world_settings``: equal for every plan of one compiled world."""
        return _hash(self.world_settings)

    @property
    def fingerprint(self) -> str:
        """Hash of the world and the direction: what the ranks running one step agree on."""
        return _hash([self.world_fingerprint, self.direction])

    def summary(self) -> dict:
        """Counts for printing and benchmarks: tasks per queue and operator, events, thresholds."""
        thresholds = Counter(ev.threshold for ev in self.events)
        out: dict = {"direction": self.direction, "rank": self.rank, "tasks": len(self.tasks)}
        for name, uids in self.schedule.queues:
            out[f"{name}_tasks"] = len(uids)
        out.update(
            {
                "events": len(self.events),
                "remote_writes": len(self.remote_writes),
                "max_threshold": max(thresholds, default=0),
                "threshold_histogram": {str(k): v for k, v in sorted(thresholds.items())},
                "task_num": dict(self.task_num),
                "fell_back": list(self.fell_back),
                "triggers": sum(len(t.trigger_events) for t in self.tasks),
            }
        )
        return out
