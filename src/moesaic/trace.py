"""Timelines of training steps: who ran what, when, on which resource of which rank.

A ``Recorder`` (one per rank) collects ``Span``s: (rank, resource, name, start, end, args).
Resources are lanes that run one thing at a time in the schedules: ``"compute"`` (the main
thread: attention, gate, experts, head), ``"a2a"`` (the all-to-alls, from issue to completion),
``"allreduce"`` (gradient all-reduce chunks), ``"optimizer"``; the training loop adds
``"step"`` (one span per optimizer step). Names follow FlowMoE's tasks: ``"AT{r}.{l}"``,
``"D{r}.{l}"``, ``"E{r}.{l}"``, ``"C{r}.{l}"``, ``"head{r}"``, ``"AR{k}"``, ``"optimizer"``
(``vanilla``: ``"forward"``, ``"backward"``, ``"allreduce"``); ``args`` hold
``phase``/``block``/``chunk``/``bytes`` where known.

Times are ``time.perf_counter()`` seconds: CLOCK_MONOTONIC on Linux, one clock for every
process of a machine, so the ranks of one node (and of the emulated cluster, whose namespaces
share the host's clock) line up; ranks on different machines would need a clock offset.

Outputs: ``chrome_trace`` / ``write_chrome_trace`` (the Chrome trace event format, which
Perfetto and chrome://tracing open: one process per rank, one thread per resource) and
``draw_timeline`` (a PNG, matplotlib). ``busy_time`` and ``overlap_bound`` give the
perfect-overlap bound max(busy compute, busy communication) from the same spans.

Torch- and communication-free (matplotlib is imported only by ``draw_timeline``); the spans of
every rank are gathered by :func:`moesaic.comm.spans.gather_spans`.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moesaic.checks import check_bool, check_int

# Lane order within a rank (unknown resources follow, alphabetically).
RESOURCES = ("step", "compute", "encode", "a2a", "gather", "allreduce", "optimizer")
COMPUTE_RESOURCES = ("compute", "encode", "optimizer")
COMM_RESOURCES = ("a2a", "gather", "allreduce")

# Task kind (the name without its chunk/block numbers) -> colour (matplotlib's tab10/tab20).
_KIND_COLORS = {
    "AT": "#1f77b4",
    "head": "#17becf",
    "E": "#2ca02c",
    "D": "#ff7f0e",
    "C": "#d62728",
    "AR": "#9467bd",
    "optimizer": "#8c564b",
    "forward": "#1f77b4",
    "backward": "#aec7e8",
    "allreduce": "#9467bd",
    "step": "#c7c7c7",
}
_OTHER_COLORS = ("#e377c2", "#7f7f7f", "#bcbd22", "#98df8a", "#ffbb78", "#c5b0d5")


@dataclass(frozen=True, slots=True)
class Span:
    """One task on one resource of one rank.

    Attributes:
        rank: the global rank that ran it.
        resource: its lane ("compute", "a2a", "allreduce", "optimizer", "step", ...).
        name: the task ("AT1.2", "D1.2", "AR3", "optimizer", ...).
        start: ``time.perf_counter()`` seconds when it began (a collective: when issued).
        end: when it ended (a collective: when its work completed); ``end >= start``.
        args: what else is known (phase, block, chunk, bytes); JSON-friendly values.
    """

    rank: int
    resource: str
    name: str
    start: float
    end: float
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        """``end - start`` in seconds."""
        return self.end - self.start

    @property
    def kind(self) -> str:
        """The task kind: the name without trailing numbers and dots ("AT1.2" -> "AT")."""
        return re.sub(r"[\d.]+$", "", self.name) or self.name

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (``from_dict`` reads it back)."""
        return {
            "rank": self.rank,
            "resource": self.resource,
            "name": self.name,
            "start": self.start,
            "end": self.end,
            "args": _jsonable(self.args),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Span:
        """The span ``to_dict`` wrote."""
        return cls(
            rank=int(d["rank"]),
            resource=str(d["resource"]),
            name=str(d["name"]),
            start=float(d["start"]),
            end=float(d["end"]),
            args=dict(d.get("args", {})),
        )


def _jsonable(args: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in args.items():
        out[str(k)] = v if isinstance(v, (str, int, float, bool)) or v is None else str(v)
    return out


class Recorder:
    """Collects this rank's spans; thread-safe (gloo's completion callbacks record too).

    A disabled recorder records nothing and costs one attribute test per call, so schedules can
    record unconditionally.

    Args:
        rank: this process's global rank (stamped on every span).
        enabled: record (True) or ignore every call (False).
    """

    def __init__(self, rank: int = 0, enabled: bool = True) -> None:
        self.rank = check_int("rank", rank, 0)
        self.enabled = check_bool("enabled", enabled)
        self._lock = threading.Lock()
        self._spans: list[Span] = []

    def now(self) -> float:
        """The clock of every span: ``time.perf_counter()`` seconds."""
        return time.perf_counter()

    @contextmanager
    def span(self, resource: str, name: str, **args: Any) -> Iterator[None]:
        """Record the enclosed block as one span (also when it raises)."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(resource, name, start, time.perf_counter(), **args)

    def add(self, resource: str, name: str, start: float, end: float, **args: Any) -> None:
        """Record a span whose times were taken elsewhere (a collective's issue/completion)."""
        if not self.enabled:
            return
        if end < start:
            raise ValueError(
                f"span {name!r} on {resource!r}: end ({end}) must be >= start ({start})"
            )
        span = Span(rank=self.rank, resource=resource, name=name, start=start, end=end, args=args)
        with self._lock:
            self._spans.append(span)

    @property
    def events(self) -> list[Span]:
        """A copy of the spans recorded so far, in the order they were added."""
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        """Forget every span (the training loop keeps only the last few steps)."""
        with self._lock:
            self._spans.clear()


def maybe_span(
    recorder: Recorder | None, resource: str, name: str, **args: Any
) -> AbstractContextManager[None]:
    """``recorder.span(resource, name, **args)``, or nothing when ``recorder`` is None."""
    return nullcontext() if recorder is None else recorder.span(resource, name, **args)


def _lane_order(resources: Collection[str]) -> list[str]:
    known = [r for r in RESOURCES if r in resources]
    return known + sorted(set(resources) - set(RESOURCES))


def _origin(spans_per_rank: Sequence[Sequence[Span]]) -> float:
    starts = [s.start for spans in spans_per_rank for s in spans]
    return min(starts) if starts else 0.0


def chrome_trace(
    spans_per_rank: Sequence[Sequence[Span]], *, process_names: Mapping[int, str] | None = None
) -> dict[str, Any]:
    """The Chrome trace event format of every rank's spans (Perfetto, chrome://tracing).

    One process per rank (``pid`` = the span's rank, named "rank N" or
    ``process_names[rank]``: the simulator names one per strategy), one thread per resource
    (``tid`` = its place in ``RESOURCES`` order, named after it), one complete event
    (``"ph": "X"``) per span with ``ts``/``dur`` in microseconds from the earliest span of all
    ranks. Events are sorted by (pid, tid, ts).
    """
    origin = _origin(spans_per_rank)
    by_rank: dict[int, set[str]] = {}
    for index, spans in enumerate(spans_per_rank):
        by_rank.setdefault(index, set())
        for s in spans:
            by_rank.setdefault(s.rank, set()).add(s.resource)
    meta: list[dict[str, Any]] = []
    tids: dict[tuple[int, str], int] = {}
    for rank in sorted(by_rank):
        name = (process_names or {}).get(rank, f"rank {rank}")
        meta.append(_meta("process_name", rank, 0, {"name": name}))
        meta.append(_meta("process_sort_index", rank, 0, {"sort_index": rank}))
        for tid, resource in enumerate(_lane_order(by_rank[rank])):
            tids[rank, resource] = tid
            meta.append(_meta("thread_name", rank, tid, {"name": resource}))
            meta.append(_meta("thread_sort_index", rank, tid, {"sort_index": tid}))
    events = []
    for spans in spans_per_rank:
        for s in spans:
            event: dict[str, Any] = {
                "name": s.name,
                "cat": s.resource,
                "ph": "X",
                "ts": round((s.start - origin) * 1e6, 3),
                "dur": round((s.end - s.start) * 1e6, 3),
                "pid": s.rank,
                "tid": tids[s.rank, s.resource],
            }
            if s.args:
                event["args"] = _jsonable(s.args)
            events.append(event)
    events.sort(key=lambda e: (e["pid"], e["tid"], e["ts"]))
    return {"traceEvents": meta + events, "displayTimeUnit": "ms"}


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def write_chrome_trace(
    path: str | Path,
    spans_per_rank: Sequence[Sequence[Span]],
    *,
    process_names: Mapping[int, str] | None = None,
) -> Path:
    """Write ``chrome_trace(spans_per_rank, process_names=...)`` as JSON to ``path`` (parents
    created)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    trace = chrome_trace(spans_per_rank, process_names=process_names)
    out.write_text(json.dumps(trace) + "\n")
    return out


def draw_timeline(
    path: str | Path, spans_per_rank: Sequence[Sequence[Span]], *, title: str = ""
) -> Path:
    """Draw every rank's spans as a PNG: one lane per (rank, resource), coloured by task kind.

    Backward tasks (``args["phase"] == "bwd"``) are hatched. Time runs in milliseconds from the
    earliest span. Needs matplotlib (``pip install moesaic[test]`` or ``matplotlib``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:  # pragma: no cover - matplotlib is in the test extra
        raise RuntimeError(
            "draw_timeline needs matplotlib (pip install matplotlib); the Chrome trace "
            "(write_chrome_trace) does not"
        ) from exc
    origin = _origin(spans_per_rank)
    lanes: list[tuple[int, str]] = []
    by_rank: dict[int, set[str]] = {}
    for spans in spans_per_rank:
        for s in spans:
            by_rank.setdefault(s.rank, set()).add(s.resource)
    for rank in sorted(by_rank):
        lanes += [(rank, resource) for resource in _lane_order(by_rank[rank])]
    lane_of = {lane: i for i, lane in enumerate(lanes)}
    colors = dict(_KIND_COLORS)
    used: dict[str, str] = {}
    fig, ax = plt.subplots(figsize=(12, 0.45 * max(len(lanes), 2) + 1.2))
    try:
        # One bar collection per (lane, kind, backward): a few dozen artists, not one per span
        # (a traced FlowMoE step at R = 4 has hundreds of spans per rank).
        bars: dict[tuple[int, str, bool], list[tuple[float, float]]] = {}
        for spans in spans_per_rank:
            for s in spans:
                kind = s.kind
                if kind not in colors:
                    colors[kind] = _OTHER_COLORS[len(colors) % len(_OTHER_COLORS)]
                used.setdefault(kind, colors[kind])
                key = (lane_of[s.rank, s.resource], kind, s.args.get("phase") == "bwd")
                bars.setdefault(key, []).append(
                    ((s.start - origin) * 1e3, max(s.duration * 1e3, 1e-6))
                )
        for (y, kind, bwd), xranges in bars.items():
            ax.broken_barh(
                xranges,
                (y - 0.4, 0.8),
                facecolors=colors[kind],
                edgecolor="black",
                linewidth=0.3,
                hatch="//" if bwd else None,
            )
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels([f"rank {r} {res}" for r, res in lanes])
        ax.set_ylim(max(len(lanes), 1) - 0.5, -0.5)
        ax.set_xlabel("time (ms)")
        ax.set_title(title or "timeline")
        ax.legend(
            handles=[Patch(facecolor=c, label=k) for k, c in used.items()],
            loc="upper left",
            bbox_to_anchor=(1.0, 1.0),
            fontsize="small",
        )
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=120)
    finally:
        plt.close(fig)
    return out


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total


def busy_time(spans: Sequence[Span], resource: str | Collection[str]) -> float:
    """Seconds during which ``resource`` (or any of several) was busy: the length of the union
    of its spans' intervals, so overlapping spans (two all-to-alls in flight) count once.

    Spans of several ranks are put on one axis: pass one rank's spans for a per-rank figure.
    """
    wanted = {resource} if isinstance(resource, str) else set(resource)
    return _union_length([(s.start, s.end) for s in spans if s.resource in wanted])


def overlap_bound(spans: Sequence[Span]) -> float:
    """The perfect-overlap bound of one step: max(busy compute, busy communication) seconds.

    Compute is ``COMPUTE_RESOURCES`` ("compute", "encode", "optimizer"), communication
    ``COMM_RESOURCES`` ("a2a", "gather", "allreduce"); each is a union of intervals. With spans of several
    ranks, the largest rank's bound (a step ends when its slowest rank does).
    """
    ranks = sorted({s.rank for s in spans})
    bounds = [0.0]
    for rank in ranks:
        mine = [s for s in spans if s.rank == rank]
        bounds.append(max(busy_time(mine, COMPUTE_RESOURCES), busy_time(mine, COMM_RESOURCES)))
    return max(bounds)


@dataclass(frozen=True, slots=True)
class StepFigures:
    """One rank's recorded step against its perfect-overlap bound.

    Attributes:
        name: the step span's name ("step8").
        rank: the rank.
        time_s: the step span's length.
        compute_s: busy time of ``COMPUTE_RESOURCES`` within the step.
        comm_s: busy time of ``COMM_RESOURCES`` within the step.
    """

    name: str
    rank: int
    time_s: float
    compute_s: float
    comm_s: float

    @property
    def bound_s(self) -> float:
        """max(compute, communication): no schedule of these tasks can be shorter."""
        return max(self.compute_s, self.comm_s)

    @property
    def ratio(self) -> float:
        """``time_s / bound_s`` (1.0 = perfect overlap; inf when nothing was recorded)."""
        return self.time_s / self.bound_s if self.bound_s > 0 else math.inf


def step_figures(spans: Sequence[Span]) -> list[StepFigures]:
    """Per recorded step (each span on the ``"step"`` lane) of each rank: its time, the busy
    compute and communication of the tasks of that rank that started within it, and so its
    distance from the overlap bound. Sorted by (rank, start).

    ``vanilla`` records no separate all-to-all spans (they are inside ``forward`` and
    ``backward``), so its compute figure includes them and its bound is an over-estimate.
    """
    out = []
    steps = sorted((s for s in spans if s.resource == "step"), key=lambda s: (s.rank, s.start))
    for st in steps:
        mine = [
            s
            for s in spans
            if s.rank == st.rank and s.resource != "step" and st.start <= s.start < st.end
        ]
        out.append(
            StepFigures(
                name=st.name,
                rank=st.rank,
                time_s=st.duration,
                compute_s=busy_time(mine, COMPUTE_RESOURCES),
                comm_s=busy_time(mine, COMM_RESOURCES),
            )
        )
    return out


__all__ = [
    "COMM_RESOURCES",
    "COMPUTE_RESOURCES",
    "RESOURCES",
    "Recorder",
    "Span",
    "StepFigures",
    "busy_time",
    "chrome_trace",
    "draw_timeline",
    "maybe_span",
    "overlap_bound",
    "step_figures",
    "write_chrome_trace",
]
