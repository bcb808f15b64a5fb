"""The compiled plan of one rank: the paper's Static Schedule Configuration (SSC).

A plan is everything a runtime needs and nothing it has to decide: the buffers, the task table,
the event counters with their thresholds, the writes other ranks make into this rank's buffers,
and the order of the matrix queue (GMMs) and the vector/communication queue (puts, activations,
reductions). One plan exists per (shape bucket, direction, EP size, rank).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass

from moesaic.taskflow.bucket import CompileOptions, ShapeBucket
from moesaic.taskflow.moe_graphs import BufferSpec
from moesaic.taskflow.tasks import Event, RemoteWrite, TaskDescriptor

PLAN_FORMAT = "moesaic.taskflow.plan"
PLAN_VERSION = 1
SUPPORTED_VERSIONS = (1,)


@dataclass(kw_only=True, slots=True)
class Plan:
    """Static taskflow of one rank (treat as immutable once built or loaded).

    Attributes:
        version: plan format version.
        direction: "forward" or "backward".
        rank: the rank that runs it.
        bucket: shapes and parallel configuration it was compiled for.
        options: scheduler options used.
        buffers: the rank's buffers (see ``moe_graphs.buffer_table``).
        tasks: task table; ``tasks[i].uid == i``.
        events: event counters of this rank; ``events[i].id == i``.
        remote_writes: tasks of other ranks writing this rank's buffers.
        matrix_queue: uids in matrix-queue order.
        vector_queue: uids in vector/communication-queue order.
        task_num: tasks per operator, as split propagation decided.
        fell_back: operators that fell back to one task (Alg. 1, line 12).
    """

    version: int
    direction: str
    rank: int
    bucket: ShapeBucket
    options: CompileOptions
    buffers: tuple[BufferSpec, ...]
    tasks: tuple[TaskDescriptor, ...]
    events: tuple[Event, ...]
    remote_writes: tuple[RemoteWrite, ...]
    matrix_queue: tuple[int, ...]
    vector_queue: tuple[int, ...]
    task_num: dict[str, int]
    fell_back: tuple[str, ...] = ()

    def queue(self, name: str) -> tuple[int, ...]:
        """The uids of queue ``name`` ("matrix" or "vector") in execution order."""
        if name == "matrix":
            return self.matrix_queue
        if name == "vector":
            return self.vector_queue
        raise ValueError(f"queue ({name!r}) must be 'matrix' or 'vector'")

    def buffer(self, name: str) -> BufferSpec:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    @property
    def fingerprint(self) -> str:
        """Hash of what every rank of a world must agree on (bucket, direction, options)."""
        blob = json.dumps(
            [self.version, self.direction, self.bucket.to_dict(), self.options.to_dict()],
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def summary(self) -> dict:
        """Counts for printing and benchmarks: tasks per queue and operator, events, thresholds."""
        thresholds = Counter(ev.threshold for ev in self.events)
        return {
            "direction": self.direction,
            "rank": self.rank,
            "tasks": len(self.tasks),
            "matrix_tasks": len(self.matrix_queue),
            "vector_tasks": len(self.vector_queue),
            "events": len(self.events),
            "remote_writes": len(self.remote_writes),
            "max_threshold": max(thresholds, default=0),
            "threshold_histogram": {str(k): v for k, v in sorted(thresholds.items())},
            "task_num": dict(self.task_num),
            "fell_back": list(self.fell_back),
            "triggers": sum(len(t.trigger_events) for t in self.tasks),
        }
