"""What a task graph is made of: task descriptors (paper Table 1), regions, events, buffers, and
the per-task-type record. Generic: nothing here knows the MoE graphs or where a task is queued.

A ``TaskDescriptor`` is *what* a task is: its handler type, the regions it reads and writes, the
event it waits on and the events it bumps, and its tile index within its operator. *Where* it
runs (which queue, in which order) is the schedule's business (``plan.Schedule``); facts shared
by every task of one type (queue class, put / row flags, handler, cost class) live once in a
task-type table of ``TaskType`` records (the MoE one is ``moe_graphs.TASK_TYPES``).

Table 1 maps onto ``TaskDescriptor`` as: task_type -> ``task_type``; queue_type -> the task
type's ``queue_class`` and the schedule; dependent_event -> ``dependent_event`` (-1: none);
trigger_event -> ``trigger_events`` (several: one tile can release consumers whose producer sets
differ, e.g. a SwiGLU-grad tile releases its gate-grad GMM tile and the whole-expert w1-grad
GMM); inputs / outputs -> regions (buffer, owning rank, row range); task_index, task_split_num,
task_split_value -> ``task_index``, ``split_num``, ``split_value``. ``tiling_data_position`` has
no meaning here (handlers take the tile from the regions) and is left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class CompileError(ValueError):
    """A bucket, option or split that the task generator cannot tile consistently."""


@dataclass(kw_only=True, slots=True, frozen=True)
class TaskType:
    """Every fact about one task type, in one record.

    Attributes:
        name: the type's name (``TaskDescriptor.task_type``).
        queue_class: the class of queue it runs on (for the two-queue executor: "matrix" or
            "vector"); a schedule puts each task on a queue of its class.
        handler: name of the function that executes it (a runtime resolves it).
        cost_class: how a cost model prices it (e.g. "gmm", "put", "act", "reduce").
        put: it writes regions of other ranks (one-sided put with a remote counter update).
        comm: for puts, the communication pattern ("dispatch" or "combine"), else "".
        rows: row-tiled compute over the receive slots (its tiles follow the GMM rows).
        put_tag: message tag class of a put (distinct per put type), 0 for other types.
    """

    name: str
    queue_class: str
    handler: str
    cost_class: str
    put: bool = False
    comm: str = ""
    rows: bool = False
    put_tag: int = 0

    def __post_init__(self) -> None:
        if self.put != bool(self.comm) or self.put != (self.put_tag > 0):
            raise ValueError(f"task type {self.name!r}: put, comm and put_tag must agree")


@dataclass(kw_only=True, slots=True, frozen=True)
class BufferSpec:
    """One 2-D buffer of a rank: ``rows x cols``; kind is input, work or output."""

    name: str
    rows: int
    cols: int
    kind: str


@dataclass(kw_only=True, slots=True, frozen=True)
class Region:
    """Rows ``[start, stop)`` of buffer ``buffer`` on rank ``rank`` (all columns)."""

    buffer: str
    rank: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(kw_only=True, slots=True, frozen=True)
class EventRef:
    """Event counter ``event`` of rank ``rank``."""

    rank: int
    event: int


class Tile(NamedTuple):
    """What a task computes, before events are assigned: the output of a FillConfig (a named
    tuple: compiling builds one per task and then the task itself, and a tuple is cheap).

    Attributes:
        op: operator (graph node) name.
        task_type: its type (a key of the task-type table).
        inputs: regions read. For a combine put ``inputs[i]`` is sent to ``outputs[i]``.
        outputs: regions written (puts write regions of other ranks).
        task_index: tile index within the operator (stable under reordering).
        split_num: tasks of the operator on this rank.
        split_value: rows per tile.
        expert: global expert of the tile, -1 when it spans several.
        peer: destination rank of a put, -1 when none or several.
    """

    op: str
    task_type: str
    inputs: tuple[Region, ...]
    outputs: tuple[Region, ...]
    task_index: int
    split_num: int
    split_value: int
    expert: int = -1
    peer: int = -1


@dataclass(kw_only=True, slots=True, frozen=True)
class TaskDescriptor:
    """One tile task of a task graph (Table 1); built once, never patched.

    Attributes:
        uid: index in the graph's task table.
        op: operator (graph node) name.
        task_type: handler type (a key of the task-type table).
        dependent_event: local event that must reach its threshold first; -1 for none.
        trigger_events: events (possibly on other ranks) bumped once when this task completes.
        inputs: regions read. For a combine put ``inputs[i]`` is sent to ``outputs[i]``.
        outputs: regions written (puts write regions of other ranks).
        task_index: tile index within the operator (stable under reordering).
        split_num: tasks of the operator on this rank.
        split_value: rows per tile.
        expert: global expert of the tile, -1 when it spans several.
        peer: destination rank of a put, -1 when none or several.
    """

    uid: int
    op: str
    task_type: str
    dependent_event: int
    trigger_events: tuple[EventRef, ...]
    inputs: tuple[Region, ...]
    outputs: tuple[Region, ...]
    task_index: int
    split_num: int
    split_value: int
    expert: int = -1
    peer: int = -1

    @classmethod
    def from_tile(
        cls, tile: Tile, *, uid: int, dependent_event: int, trigger_events: tuple[EventRef, ...]
    ) -> TaskDescriptor:
        """The task of ``tile`` once its uid and events are known."""
        return cls(
            uid=uid,
            op=tile.op,
            task_type=tile.task_type,
            dependent_event=dependent_event,
            trigger_events=trigger_events,
            inputs=tile.inputs,
            outputs=tile.outputs,
            task_index=tile.task_index,
            split_num=tile.split_num,
            split_value=tile.split_value,
            expert=tile.expert,
            peer=tile.peer,
        )

    @property
    def label(self) -> str:
        return f"{self.op}[{self.task_index}]"


@dataclass(kw_only=True, slots=True, frozen=True)
class RemoteWrite:
    """A task of rank ``rank`` that writes ``regions`` of this rank and bumps local events."""

    rank: int
    op: str
    task_index: int
    regions: tuple[Region, ...]
    trigger_events: tuple[int, ...] = ()


@dataclass(kw_only=True, slots=True, frozen=True)
class ProducerRef:
    """A producer of an event: task ``task_index`` of operator ``op`` on rank ``rank``."""

    rank: int
    op: str
    task_index: int


@dataclass(kw_only=True, slots=True, frozen=True)
class Event:
    """An event counter of this rank: ready when ``threshold`` producers have completed."""

    id: int
    threshold: int
    producers: tuple[ProducerRef, ...]
