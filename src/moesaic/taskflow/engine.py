"""One event engine for every consumer of a task graph: the deadlock check, the sequential
executor, the plan drawing, and (later) concurrent runtimes and a cluster simulator.

Generic and torch-free: it knows lanes, jobs and event counters, nothing about MoE or plans.

* A **lane** is a named in-order queue or resource (a matrix queue, a vector queue, a link): it
  runs its jobs one at a time, in the given order.
* A **job** waits on at most one event (``wait``) and, when it ends, bumps each event in
  ``triggers`` by one. Event keys are any hashable (``(rank, event id)`` for a world of plans).
* An **event** is ready when its counter reaches its threshold; bumping it past the threshold
  is an error (a producer counted twice).

``EventEngine.run`` is a discrete-event simulation: a lane's head starts at
``max(lane free, time its event became ready)`` and ends ``cost(task)`` later; heads are launched
in order of start time (ties: lane order), so ``launch(task)`` sees a time-ordered sequence and
can execute the task for real (the sequential executor) or do nothing (a simulation). Events of
outside writers (another rank's put) are fired with ``fire(event, at)``, before ``run`` or from
``on_stall``, the hook called when no lane can go on: it may complete outside work (wait for a
message) and fire its events, returning True; otherwise the engine raises ``DeadlockError``
naming every blocked lane. The result is a ``Timeline``: start and end per job key, and the
launch order.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")


class EngineError(ValueError):
    """A malformed engine input, or an event bumped past its threshold."""


class EventOverflowError(EngineError):
    """An event was bumped more often than its threshold; ``event`` names it."""

    def __init__(self, message: str, event: Hashable) -> None:
        super().__init__(message)
        self.event = event


class DeadlockError(EngineError):
    """No lane can go on and some still hold jobs; ``stalls`` describes each blocked head."""

    def __init__(self, message: str, stalls: list[Stall]) -> None:
        super().__init__(message)
        self.stalls = stalls


class Job(NamedTuple, Generic[T]):
    """One unit of work on a lane (a named tuple: the deadlock check builds one per task, and a
    tuple is built in 0.56 us against 0.93 us for a frozen dataclass here).

    Attributes:
        key: unique name of the job (the timeline is keyed by it).
        task: what ``cost`` and ``launch`` receive.
        wait: the event it waits on, None for none.
        triggers: events bumped by one when it ends.
    """

    key: Hashable
    task: T
    wait: Hashable | None = None
    triggers: tuple[Hashable, ...] = ()


class Lane(NamedTuple, Generic[T]):
    """A named in-order queue or resource and its jobs."""

    name: Hashable
    jobs: Sequence[Job[T]]


@dataclass(kw_only=True, slots=True, frozen=True)
class Stall:
    """A blocked lane: its head job at ``position`` waits on an event at ``count/threshold``."""

    lane: Hashable
    position: int
    job: Job
    count: int
    threshold: int


@dataclass(kw_only=True, slots=True)
class Timeline:
    """Start and end time of every job (by key) and the order jobs were launched in."""

    start: dict[Hashable, float] = field(default_factory=dict)
    end: dict[Hashable, float] = field(default_factory=dict)
    order: list[Hashable] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max(self.end.values(), default=0.0)


class EventEngine(Generic[T]):
    """Run lanes of jobs against event counters (see the module docstring).

    Args:
        lanes: the lanes, in tie-breaking order.
        thresholds: threshold of every event (>= 1).
        cost: duration of a task in seconds (or any unit); default 0.
        launch: called once per job when it starts, in start-time order.
        on_stall: called with the blocked lanes when none can go on; returns True after
            firing at least one event (``fire``), False to give up (a deadlock).
    """

    def __init__(
        self,
        lanes: Sequence[Lane[T]],
        thresholds: Mapping[Hashable, int],
        *,
        cost: Callable[[T], float] | None = None,
        launch: Callable[[T], None] | None = None,
        on_stall: Callable[[list[Stall]], bool] | None = None,
    ) -> None:
        self.lanes = list(lanes)
        self.thresholds = dict(thresholds)
        self.cost = cost
        self.launch = launch
        self.on_stall = on_stall
        self.count: dict[Hashable, int] = dict.fromkeys(self.thresholds, 0)
        self.ready_at: dict[Hashable, float] = dict.fromkeys(self.thresholds, 0.0)
        self._pos = [0] * len(self.lanes)
        self._free = [0.0] * len(self.lanes)
        self._waiting: dict[Hashable, list[int]] = {}
        self._heap: list[tuple[float, int]] = []
        self._running = False

    def fire(self, event: Hashable, at: float = 0.0) -> None:
        """Bump ``event`` by one at time ``at`` (an outside writer finished)."""
        try:
            n = self.count[event] + 1
        except KeyError:
            raise EngineError(f"event {event!r} has no threshold") from None
        thr = self.thresholds[event]
        if n > thr:
            raise EventOverflowError(f"event {event!r} is triggered more than {thr} times", event)
        self.count[event] = n
        if at > self.ready_at[event]:
            self.ready_at[event] = at
        if n == thr and self._running:
            for li in self._waiting.pop(event, ()):
                self._offer(li)

    def _offer(self, li: int) -> None:
        """Queue lane ``li``'s head for launch if its event is ready, else park the lane."""
        jobs, pos = self.lanes[li].jobs, self._pos[li]
        if pos >= len(jobs):
            return
        ev = jobs[pos].wait
        if ev is None:
            heapq.heappush(self._heap, (self._free[li], li))
            return
        count = self.count.get(ev)
        if count is None:
            raise EngineError(f"lane {self.lanes[li].name!r} job waits on unknown event {ev!r}")
        if count >= self.thresholds[ev]:
            free, ready = self._free[li], self.ready_at[ev]
            heapq.heappush(self._heap, (free if free > ready else ready, li))
        else:
            self._waiting.setdefault(ev, []).append(li)

    def _stalls(self) -> list[Stall]:
        out = []
        for li, lane in enumerate(self.lanes):
            if self._pos[li] < len(lane.jobs):
                job = lane.jobs[self._pos[li]]
                ev = job.wait
                out.append(
                    Stall(
                        lane=lane.name,
                        position=self._pos[li],
                        job=job,
                        count=self.count.get(ev, 0),
                        threshold=self.thresholds.get(ev, 0),
                    )
                )
        return out

    def run(self) -> Timeline:
        """Run every lane to its end; raises ``DeadlockError`` or ``EventOverflowError``."""
        if self._running:
            raise EngineError("an engine runs once")
        self._running = True
        tl = Timeline()
        for li in range(len(self.lanes)):
            self._offer(li)
        cost, launch, heap, pos, free = self.cost, self.launch, self._heap, self._pos, self._free
        lanes, fire, offer = self.lanes, self.fire, self._offer
        t_start, t_end, order = tl.start, tl.end, tl.order
        while True:
            while heap:
                start, li = heapq.heappop(heap)
                job = lanes[li].jobs[pos[li]]
                if launch is not None:
                    launch(job.task)
                end = start + cost(job.task) if cost is not None else start
                t_start[job.key] = start
                t_end[job.key] = end
                order.append(job.key)
                pos[li] += 1
                free[li] = end
                for ev in job.triggers:
                    fire(ev, end)
                offer(li)
            stalls = self._stalls()
            if not stalls:
                return tl
            if self.on_stall is None or not self.on_stall(stalls):
                raise DeadlockError(
                    "deadlock: "
                    + "; ".join(
                        f"lane {s.lane!r} at position {s.position} waits on event {s.job.wait!r} "
                        f"({s.count}/{s.threshold})"
                        for s in stalls
                    ),
                    stalls,
                )
