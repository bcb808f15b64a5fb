"""Taskized SwiGLU+Add: the microbenchmark of HyperParallel-MoE §6.1-6.2 (Figs. 9 and 10).

Shape legend: M rows, Hi input width (gate half | up half), Ho = Hi / 2 output width.

    s_MHo   = silu(x_MHi[:, :Ho]) * x_MHi[:, Ho:]      (SwiGLU)
    out_MHo = s_MHo + r_MHo                            (Add, e.g. a residual)

Both operators are split along M into ``tiles = ceil(M / tile_m)`` row tiles. Task ``2i`` is
SwiGLU tile i (reads rows of x, writes the same rows of s) and bumps event i (threshold 1);
task ``2i + 1`` is Add tile i (reads rows of s and r, writes rows of out) and waits on event i.
Both are vector tasks in the paper, so a schedule has the two-queue shape with an empty
"matrix" queue and every task on "vector", in one of two orders:

* ``serial``: S0 S1 ... S(n-1) A0 A1 ... A(n-1), the operator-at-a-time order (each Add tile
  reads its SwiGLU output after every later SwiGLU tile has streamed through the caches);
* ``interleaved``: S0 A0 S1 A1 ..., each Add tile right after the SwiGLU tile it consumes
  (producer-consumer distance 1, so s is read back while it is still in cache).

The dynamic executor reads a schedule only for its set of tasks and runs tasks in the order
they become ready; :func:`order_distance` measures what order an executor actually produced.
``make_launch`` runs the real torch ops on tile views of preallocated buffers; ``run_untiled``
is the two whole-tensor ops the tiles are compared with. :func:`chain_graph` is the other
extreme for scheduling overhead: a chain in which no two tasks are ever ready together.

The graph and schedule builders are torch-free; torch is imported by the functions that need it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moesaic.checks import check_one_of, check_positive_int
from moesaic.taskflow.plan import Schedule, TaskGraph
from moesaic.taskflow.tasks import BufferSpec, Event, EventRef, ProducerRef, Region, TaskDescriptor

if TYPE_CHECKING:
    import torch

    from moesaic.taskflow.runtime.executors import EngineLanes
    from moesaic.trace import Recorder

__all__ = [
    "ORDERS",
    "SwigluAddBuffers",
    "SwigluAddShape",
    "chain_graph",
    "make_buffers",
    "make_launch",
    "noop_launch",
    "order_distance",
    "reference",
    "run_graph",
    "run_untiled",
    "swiglu_add_graph",
    "swiglu_add_schedule",
]

ORDERS = ("serial", "interleaved")
SWIGLU, ADD = "swiglu", "add"
BUFFERS = ("x", "s", "r", "out")


@dataclass(kw_only=True, slots=True, frozen=True)
class SwigluAddShape:
    """Sizes of one SwiGLU+Add problem.

    Attributes:
        rows: M, rows of every tensor.
        tile_m: rows per task (the last tile holds the remainder).
        h_in: width of x (gate half then up half); the paper's Fig. 9 uses 4096.
        h_out: width of s, r and out; must be ``h_in / 2`` (2048 in Fig. 9).
    """

    rows: int
    tile_m: int
    h_in: int = 4096
    h_out: int = 2048

    def __post_init__(self) -> None:
        for name in ("rows", "tile_m", "h_in", "h_out"):
            check_positive_int(name, getattr(self, name))
        if self.h_in != 2 * self.h_out:
            raise ValueError(
                f"h_in ({self.h_in}) must be 2 * h_out ({2 * self.h_out}): SwiGLU halves its input"
            )

    @property
    def tiles(self) -> int:
        """Row tiles per operator (tasks = 2 * tiles)."""
        return math.ceil(self.rows / self.tile_m)

    def tile_rows(self, i: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of tile ``i``."""
        return i * self.tile_m, min((i + 1) * self.tile_m, self.rows)

    def working_set_bytes(self, itemsize: int = 4) -> int:
        """Bytes of x, s, r and out together."""
        return self.rows * (self.h_in + 3 * self.h_out) * itemsize


def swiglu_add_graph(shape: SwigluAddShape) -> TaskGraph:
    """The task graph: SwiGLU tile i (uid 2i) bumps event i, which Add tile i (uid 2i+1) waits on."""
    n = shape.tiles
    tasks: list[TaskDescriptor] = []
    events: list[Event] = []
    for i in range(n):
        start, stop = shape.tile_rows(i)
        x, s, r, out = (Region(buffer=b, rank=0, start=start, stop=stop) for b in BUFFERS)
        events.append(
            Event(id=i, threshold=1, producers=(ProducerRef(rank=0, op=SWIGLU, task_index=i),))
        )
        tasks.append(
            TaskDescriptor(
                uid=2 * i,
                op=SWIGLU,
                task_type=SWIGLU,
                dependent_event=-1,
                trigger_events=(EventRef(rank=0, event=i),),
                inputs=(x,),
                outputs=(s,),
                task_index=i,
                split_num=n,
                split_value=shape.tile_m,
            )
        )
        tasks.append(
            TaskDescriptor(
                uid=2 * i + 1,
                op=ADD,
                task_type=ADD,
                dependent_event=i,
                trigger_events=(),
                inputs=(s, r),
                outputs=(out,),
                task_index=i,
                split_num=n,
                split_value=shape.tile_m,
            )
        )
    m, hi, ho = shape.rows, shape.h_in, shape.h_out
    buffers = (
        BufferSpec(name="x", rows=m, cols=hi, kind="input"),
        BufferSpec(name="r", rows=m, cols=ho, kind="input"),
        BufferSpec(name="s", rows=m, cols=ho, kind="work"),
        BufferSpec(name="out", rows=m, cols=ho, kind="output"),
    )
    return TaskGraph(
        buffers=buffers,
        tasks=tuple(tasks),
        events=tuple(events),
        remote_writes=(),
        task_num={SWIGLU: n, ADD: n},
    )


def swiglu_add_schedule(graph: TaskGraph, order: str) -> Schedule:
    """The two-queue schedule of ``graph``: empty "matrix" queue, every task on "vector".

    Args:
        graph: a graph of :func:`swiglu_add_graph`.
        order: "serial" (all SwiGLU tiles, then all Add tiles) or "interleaved" (S0 A0 S1 A1 ...).
    """
    check_one_of("order", order, ORDERS)
    n = len(graph.tasks) // 2
    if order == "serial":
        uids = (*range(0, 2 * n, 2), *range(1, 2 * n, 2))
    else:
        uids = tuple(range(2 * n))
    return Schedule(executor="two_queue", queues=(("matrix", ()), ("vector", uids)))


def chain_graph(tasks: int) -> tuple[TaskGraph, Schedule]:
    """A dependency chain: task i waits on event i-1 and bumps event i, so no two tasks are
    ever ready together (every task of a dynamic executor goes through its Scheduler and a
    Processor wake-up); all on "vector" of a two-queue schedule, in chain order."""
    n = check_positive_int("tasks", tasks)
    graph_tasks, events = [], []
    for i in range(n):
        r = Region(buffer="c", rank=0, start=i, stop=i + 1)
        events.append(
            Event(id=i, threshold=1, producers=(ProducerRef(rank=0, op="c", task_index=i),))
        )
        graph_tasks.append(
            TaskDescriptor(
                uid=i,
                op="c",
                task_type="c",
                dependent_event=i - 1,
                trigger_events=(EventRef(rank=0, event=i),),
                inputs=(r,),
                outputs=(r,),
                task_index=i,
                split_num=n,
                split_value=1,
            )
        )
    graph = TaskGraph(
        buffers=(BufferSpec(name="c", rows=n, cols=1, kind="work"),),
        tasks=tuple(graph_tasks),
        events=tuple(events),
        remote_writes=(),
        task_num={"c": n},
    )
    return graph, Schedule(
        executor="two_queue", queues=(("matrix", ()), ("vector", tuple(range(n))))
    )


def order_distance(uids: Sequence[int]) -> float:
    """Mean producer-consumer distance of an executed order: over the tiles, the positions
    between SwiGLU tile i (uid 2i) and Add tile i (uid 2i+1). 1 for "interleaved", ``tiles``
    for "serial"; what a dynamic executor produced lies wherever readiness put it."""
    pos = {uid: k for k, uid in enumerate(uids)}
    n = len(uids) // 2
    if n == 0 or len(pos) != 2 * n or set(pos) != set(range(2 * n)):
        raise ValueError(f"uids must hold each of 0..{2 * n - 1} once, got {len(uids)} uids")
    return sum(pos[2 * i + 1] - pos[2 * i] for i in range(n)) / n


@dataclass(kw_only=True, slots=True)
class SwigluAddBuffers:
    """Preallocated tensors of one problem: inputs x_MHi, r_MHo; work s_MHo; output out_MHo."""

    x_MHi: torch.Tensor
    r_MHo: torch.Tensor
    s_MHo: torch.Tensor
    out_MHo: torch.Tensor


def make_buffers(
    shape: SwigluAddShape, *, seed: int = 0, dtype: torch.dtype | None = None
) -> SwigluAddBuffers:
    """Random inputs (every page touched) and zeroed work and output buffers (fp32 default)."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    gen = torch.Generator().manual_seed(seed)
    m, ho = shape.rows, shape.h_out
    return SwigluAddBuffers(
        x_MHi=torch.randn(m, shape.h_in, generator=gen).to(dtype),
        r_MHo=torch.randn(m, ho, generator=gen).to(dtype),
        s_MHo=torch.zeros(m, ho, dtype=dtype),
        out_MHo=torch.zeros(m, ho, dtype=dtype),
    )


def _swiglu(x_MHi: torch.Tensor, s_MHo: torch.Tensor) -> None:
    """s = silu(gate) * up without a temporary: silu into s, then multiply in place."""
    import torch

    ho = s_MHo.shape[1]
    # the stubs omit silu's out= overload, which torch has (aten::silu.out)
    torch._C._nn.silu(x_MHi[:, :ho], out=s_MHo)  # type: ignore[call-arg]
    torch.mul(s_MHo, x_MHi[:, ho:], out=s_MHo)


def make_launch(graph: TaskGraph, bufs: SwigluAddBuffers) -> Callable[[TaskDescriptor], None]:
    """A launch that runs each task's torch ops on views of ``bufs`` taken from its regions.

    The views are cut once here, so a launch costs a list lookup and the ops.
    """
    import torch

    named = {"x": bufs.x_MHi, "r": bufs.r_MHo, "s": bufs.s_MHo, "out": bufs.out_MHo}
    for spec in graph.buffers:
        if tuple(named[spec.name].shape) != (spec.rows, spec.cols):
            raise ValueError(
                f"buffer {spec.name} has shape {tuple(named[spec.name].shape)}, the graph "
                f"needs ({spec.rows}, {spec.cols})"
            )

    def view(region: Region) -> torch.Tensor:
        return named[region.buffer][region.start : region.stop]

    table: list[tuple[bool, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    for t in graph.tasks:
        if t.task_type == SWIGLU:
            table.append((True, view(t.inputs[0]), view(t.outputs[0]), None))
        else:
            table.append((False, view(t.inputs[0]), view(t.inputs[1]), view(t.outputs[0])))
    add = torch.add

    def launch(task: TaskDescriptor) -> None:
        is_swiglu, a, b, c = table[task.uid]
        if is_swiglu:
            _swiglu(a, b)
        else:
            add(a, b, out=c)

    return launch


def noop_launch(task: TaskDescriptor) -> None:
    """A launch that does nothing: what is left of a run is the executor's own cost."""


def run_untiled(bufs: SwigluAddBuffers) -> None:
    """The baseline: SwiGLU over all rows, then Add over all rows (two whole-tensor ops)."""
    import torch

    _swiglu(bufs.x_MHi, bufs.s_MHo)
    torch.add(bufs.s_MHo, bufs.r_MHo, out=bufs.out_MHo)


def reference(bufs: SwigluAddBuffers) -> torch.Tensor:
    """``silu(x[:, :Ho]) * x[:, Ho:] + r`` computed afresh (plain torch, new tensors)."""
    import torch.nn.functional as F

    ho = bufs.r_MHo.shape[1]
    return F.silu(bufs.x_MHi[:, :ho]) * bufs.x_MHi[:, ho:] + bufs.r_MHo


def run_graph(
    executor: str,
    graph: TaskGraph,
    schedule: Schedule,
    launch: Callable[[TaskDescriptor], None],
    *,
    processors: int = 1,
    timeout_s: float = 60.0,
    recorder: Recorder | None = None,
    lanes: EngineLanes | None = None,
) -> None:
    """One run of ``graph`` on the "static" or "dynamic" executor with fresh counters.

    Args:
        executor: "static" (schedule order per queue) or "dynamic" (order decided at run time).
        graph: the task graph.
        schedule: its schedule (the dynamic executor reads only its set of tasks).
        launch: does one task's work.
        processors: size of the dynamic executor's processor pool (ignored by "static").
        timeout_s: bound on every wait.
        recorder: records one span per task.
        lanes: the static executor's ``engine_lanes(graph, schedule, 0)``, built once by the
            caller as a compiled plan's are (None: built in this call).
    """
    from moesaic.taskflow.runtime.executors import (
        EXECUTORS,
        make_counters,
        run_dynamic,
        run_static,
    )

    check_one_of("executor", executor, EXECUTORS)
    counters = make_counters(graph, 0)
    if executor == "static":
        run_static(
            graph,
            schedule,
            0,
            launch,
            counters,
            timeout_s=timeout_s,
            recorder=recorder,
            lanes=lanes,
        )
    else:
        run_dynamic(
            graph,
            schedule,
            0,
            launch,
            counters,
            processors=processors,
            timeout_s=timeout_s,
            recorder=recorder,
        )
