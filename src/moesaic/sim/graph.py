"""Simulated task graphs: one representative rank's tasks on in-order lanes, run by the project's
one event engine (:class:`moesaic.taskflow.engine.EventEngine`).

A task is a :class:`SimTask` (name as in ``moesaic.trace``: ``AT{r}.{l}``, ``D``, ``E``, ``C``,
``head{r}``, ``AR{k}``, ``optimizer``; the resource its span is drawn on; seconds). A
:class:`SimGraph` holds lanes of (task, the key of the task it waits on); every task bumps its own
event, so a job waits on one earlier task of another lane (its lane order gives the rest).

**Rank symmetry.** Every rank of an expert-parallel world runs the same schedule and meets the
others in every collective, so one rank's graph, with collective durations that already account
for the whole world (``sim.collectives``), gives the iteration. Under skewed routing the ranks
differ only in their expert load; collectives wait for the slowest, so the representative rank
is the busiest one (its expert rows, the world's traffic matrix). Simulating 8,000 ranks thus
costs one rank's graph plus O(P) per distinct collective.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from moesaic.checks import check_positive_int
from moesaic.taskflow.engine import EventEngine, Job, Lane, Timeline
from moesaic.trace import COMM_RESOURCES

__all__ = ["SimGraph", "SimTask"]


def _rank_key(key: str, rank: int) -> str:
    """A representative task's key as rank ``rank``'s (``SimTask.key`` with that rank)."""
    if key.startswith("join:"):
        return "join:" + _rank_key(key[5:], rank)
    return f"r{rank}/{key}" if rank else key


class SimTask(NamedTuple):
    """One task of the simulated rank (a named tuple: thousands are built per simulation).

    Attributes:
        name: the task's name, as the runtimes record it.
        resource: the trace lane ("compute", "a2a", "allreduce", "gather", "optimizer").
        seconds: its duration.
        phase: "fwd", "bwd" or "" (neither).
        block: 1-based MoE block, 0 when none.
        chunk: 1-based microbatch, 0 when none.
        nbytes: bytes a rank sends (communication), 0 otherwise.
        rank: the rank that runs it (0 for the representative rank).
    """

    name: str
    resource: str
    seconds: float
    phase: str = ""
    block: int = 0
    chunk: int = 0
    nbytes: float = 0.0
    rank: int = 0

    @property
    def key(self) -> str:
        key = f"{self.phase}:{self.name}" if self.phase else self.name
        return f"r{self.rank}/{key}" if self.rank else key


@dataclass(slots=True)
class SimGraph:
    """Lanes of ``(task, waited task key or None)``, in issue order.

    ``add`` appends a task to a lane; ``run`` hands every lane to the event engine and returns
    its timeline (keys: ``SimTask.key``).
    """

    lanes: dict[str, list[tuple[SimTask, str | None]]] = field(default_factory=dict)
    joins: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def add(
        self,
        lane: str,
        task: SimTask,
        wait: SimTask | str | tuple[SimTask | str, ...] | None = None,
    ) -> SimTask:
        """Appends ``task`` to ``lane``; it waits for ``wait`` (a task, a key, or several tasks
        or keys: a join event that each of them bumps)."""
        if isinstance(wait, tuple) and not isinstance(wait, SimTask):
            key: str | None = f"join:{task.key}"
            self.joins[f"join:{task.key}"] = tuple(t if isinstance(t, str) else t.key for t in wait)
        else:
            key = wait.key if isinstance(wait, SimTask) else wait
        self.lanes.setdefault(lane, []).append((task, key))
        return task

    def replicate(
        self, world: int, seconds: Callable[[int, SimTask], float] | None = None
    ) -> SimGraph:
        """Every rank's copy of this (representative) graph, for a simulation without the rank
        symmetry: a communication task (a collective) waits until *every* rank has finished the
        task it waits for (a join of ``world`` bumps), a compute task for its own rank's task.
        ``seconds(rank, task)`` may give ranks different durations (skewed expert loads).
        """
        check_positive_int("world", world)
        out = SimGraph()
        for lane, jobs in self.lanes.items():
            for rank in range(world):
                for task, wait in jobs:
                    t = task._replace(rank=rank)
                    if seconds is not None:
                        t = t._replace(seconds=seconds(rank, task))
                    w = None if wait is None else _rank_key(wait, rank)
                    if wait is not None and task.resource in COMM_RESOURCES and world > 1:
                        # one join per collective, shared by every rank's copy
                        w = f"sync:{task.key}"
                        if rank == 0:
                            keys = self.joins.get(wait, (wait,))  # a join: its tasks
                            out.joins[w] = tuple(
                                _rank_key(k, r) for r in range(world) for k in keys
                            )
                    out.lanes.setdefault(f"{rank}/{lane}", []).append((t, w))
        for join, keys in self.joins.items():  # joins of the representative graph: per rank
            for rank in range(world):
                out.joins[_rank_key(join, rank)] = tuple(_rank_key(k, rank) for k in keys)
        return out

    def tasks(self) -> Iterable[SimTask]:
        for jobs in self.lanes.values():
            for task, _ in jobs:
                yield task

    def join_counters(self) -> tuple[dict[Hashable, int], dict[str, list[str]]]:
        """``(thresholds, extra)``: each join's count to reach (its tasks), and for a task key
        the joins its completion also bumps."""
        thresholds: dict[Hashable, int] = {}
        extra: dict[str, list[str]] = {}
        for join, keys in self.joins.items():
            thresholds[join] = len(keys)
            for k in keys:
                extra.setdefault(k, []).append(join)
        return thresholds, extra

    def run(self, lanes: dict[str, list[tuple[SimTask, str | None]]] | None = None) -> Timeline:
        """Simulates the graph (or the given lanes, another order of the same tasks)."""
        lanes = self.lanes if lanes is None else lanes
        thresholds, extra = self.join_counters()
        engine_lanes = []
        for name, jobs in lanes.items():
            out = []
            for task, wait in jobs:
                key = task.key
                if key in thresholds:
                    raise ValueError(f"task key {key!r} appears twice in the graph")
                thresholds[key] = 1
                triggers = (key, *extra.get(key, ()))
                out.append(Job(key=key, task=task, wait=wait, triggers=triggers))
            engine_lanes.append(Lane(name=name, jobs=out))
        engine: EventEngine[SimTask] = EventEngine(
            engine_lanes, thresholds, cost=lambda t: t.seconds
        )
        return engine.run()
