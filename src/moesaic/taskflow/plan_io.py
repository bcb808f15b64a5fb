"""Plan files: versioned JSON, parsed strictly and validated before a plan object is returned.

Format (version 2; version 1 files are refused: they carried a queue per task and no world
fingerprint)::

    {"format": "moesaic.taskflow.plan", "version": 2, "direction": "forward", "rank": 0,
     "world": "<16 hex digits: Plan.world_fingerprint>",
     "bucket": {...ShapeBucket fields...}, "options": {"ratr": true, "interleave": true,
     "unsplit": []},
     "buffers": [{"name": "x_TH", "rows": 4096, "cols": 7168, "kind": "input"}, ...],
     "tasks": [{"uid": 0, "op": "dispatch", "task_type": "put_dispatch",
                "dependent_event": -1, "trigger_events": [[rank, event], ...],
                "inputs": [[buffer, rank, start, stop], ...], "outputs": [...],
                "task_index": 0, "split_num": 256, "split_value": 128, "expert": 0, "peer": 0},
               ...],
     "events": [{"id": 0, "threshold": 2, "producers": [[rank, op, task_index], ...]}, ...],
     "remote_writes": [{"rank": 1, "op": "dispatch", "task_index": 3,
                        "regions": [[buffer, rank, start, stop]], "trigger_events": [0]}, ...],
     "task_num": {"dispatch": 256, ...}, "fell_back": [],
     "schedule": {"executor": "two_queue",
                  "queues": [["matrix", [uid, ...]], ["vector", [uid, ...]]]}}

``load_plan`` / ``plan_from_dict`` reject (``PlanError``, a ``ValueError``) anything malformed:
an unknown format or version, missing or unknown fields, wrong types (a bool is not an int), a
``world`` fingerprint that does not match the bucket and options, and then everything
``validate.check_plan`` checks. A plan that is returned can run (and is marked validated).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from moesaic.checks import is_int
from moesaic.taskflow.bucket import bucket_from_dict, options_from_dict
from moesaic.taskflow.plan import PLAN_FORMAT, SUPPORTED_VERSIONS, Plan, Schedule, TaskGraph
from moesaic.taskflow.tasks import (
    BufferSpec,
    Event,
    EventRef,
    ProducerRef,
    Region,
    RemoteWrite,
    TaskDescriptor,
)
from moesaic.taskflow.validate import PlanFormatError, check_plan, version_error

_TOP = {
    "format",
    "version",
    "direction",
    "rank",
    "world",
    "bucket",
    "options",
    "buffers",
    "tasks",
    "events",
    "remote_writes",
    "task_num",
    "fell_back",
    "schedule",
}
_TASK = {
    "uid",
    "op",
    "task_type",
    "dependent_event",
    "trigger_events",
    "inputs",
    "outputs",
    "task_index",
    "split_num",
    "split_value",
    "expert",
    "peer",
}


def _region_out(r: Region) -> list:
    return [r.buffer, r.rank, r.start, r.stop]


def plan_to_dict(plan: Plan) -> dict:
    """The JSON-ready form of a plan."""
    return {
        "format": PLAN_FORMAT,
        "version": plan.version,
        "direction": plan.direction,
        "rank": plan.rank,
        "world": plan.world_fingerprint,
        "bucket": plan.bucket.to_dict(),
        "options": plan.options.to_dict(),
        "buffers": [
            {"name": b.name, "rows": b.rows, "cols": b.cols, "kind": b.kind} for b in plan.buffers
        ],
        "tasks": [
            {
                "uid": t.uid,
                "op": t.op,
                "task_type": t.task_type,
                "dependent_event": t.dependent_event,
                "trigger_events": [[r.rank, r.event] for r in t.trigger_events],
                "inputs": [_region_out(r) for r in t.inputs],
                "outputs": [_region_out(r) for r in t.outputs],
                "task_index": t.task_index,
                "split_num": t.split_num,
                "split_value": t.split_value,
                "expert": t.expert,
                "peer": t.peer,
            }
            for t in plan.tasks
        ],
        "events": [
            {
                "id": ev.id,
                "threshold": ev.threshold,
                "producers": [[p.rank, p.op, p.task_index] for p in ev.producers],
            }
            for ev in plan.events
        ],
        "remote_writes": [
            {
                "rank": w.rank,
                "op": w.op,
                "task_index": w.task_index,
                "regions": [_region_out(r) for r in w.regions],
                "trigger_events": list(w.trigger_events),
            }
            for w in plan.remote_writes
        ],
        "task_num": dict(plan.task_num),
        "fell_back": list(plan.fell_back),
        "schedule": {
            "executor": plan.schedule.executor,
            "queues": [[name, list(uids)] for name, uids in plan.schedule.queues],
        },
    }


def _int(v: object, where: str) -> int:
    if not is_int(v):
        raise PlanFormatError(f"{where} must be an int, got {type(v).__name__} ({v!r})")
    assert isinstance(v, int)  # for the type checker; is_int said so
    return v


def _str(v: object, where: str) -> str:
    if not isinstance(v, str):
        raise PlanFormatError(f"{where} must be a string, got {type(v).__name__}")
    return v


def _list(v: object, where: str) -> list:
    if not isinstance(v, list):
        raise PlanFormatError(f"{where} must be a list, got {type(v).__name__}")
    return v


def _obj(v: object, where: str, fields: set[str]) -> dict:
    if not isinstance(v, dict):
        raise PlanFormatError(f"{where} must be an object, got {type(v).__name__}")
    missing, unknown = fields - set(v), set(v) - fields
    if missing:
        raise PlanFormatError(f"{where} misses fields {sorted(missing)}")
    if unknown:
        raise PlanFormatError(f"{where} has unknown fields {sorted(unknown)}")
    return v


def _region(v: object, where: str) -> Region:
    v = _list(v, where)
    if len(v) != 4:
        raise PlanFormatError(f"{where} must be [buffer, rank, start, stop]")
    return Region(
        buffer=_str(v[0], f"{where}[0]"),
        rank=_int(v[1], f"{where}[1]"),
        start=_int(v[2], f"{where}[2]"),
        stop=_int(v[3], f"{where}[3]"),
    )


def _regions(v: object, where: str) -> tuple[Region, ...]:
    return tuple(_region(r, f"{where}[{i}]") for i, r in enumerate(_list(v, where)))


def _task(v: object, where: str) -> TaskDescriptor:
    d = _obj(v, where, _TASK)
    trig = []
    for i, ref in enumerate(_list(d["trigger_events"], f"{where}.trigger_events")):
        ref = _list(ref, f"{where}.trigger_events[{i}]")
        if len(ref) != 2:
            raise PlanFormatError(f"{where}.trigger_events[{i}] must be [rank, event]")
        trig.append(EventRef(rank=_int(ref[0], where), event=_int(ref[1], where)))
    ints = {
        k: _int(d[k], f"{where}.{k}")
        for k in (
            "uid",
            "dependent_event",
            "task_index",
            "split_num",
            "split_value",
            "expert",
            "peer",
        )
    }
    return TaskDescriptor(
        op=_str(d["op"], f"{where}.op"),
        task_type=_str(d["task_type"], f"{where}.task_type"),
        trigger_events=tuple(trig),
        inputs=_regions(d["inputs"], f"{where}.inputs"),
        outputs=_regions(d["outputs"], f"{where}.outputs"),
        **ints,
    )


def _event(v: object, where: str) -> Event:
    d = _obj(v, where, {"id", "threshold", "producers"})
    prods = []
    for i, p in enumerate(_list(d["producers"], f"{where}.producers")):
        p = _list(p, f"{where}.producers[{i}]")
        if len(p) != 3:
            raise PlanFormatError(f"{where}.producers[{i}] must be [rank, op, task_index]")
        prods.append(
            ProducerRef(rank=_int(p[0], where), op=_str(p[1], where), task_index=_int(p[2], where))
        )
    return Event(
        id=_int(d["id"], f"{where}.id"),
        threshold=_int(d["threshold"], f"{where}.threshold"),
        producers=tuple(prods),
    )


def _remote(v: object, where: str) -> RemoteWrite:
    d = _obj(v, where, {"rank", "op", "task_index", "regions", "trigger_events"})
    evs = tuple(
        _int(e, f"{where}.trigger_events[{i}]")
        for i, e in enumerate(_list(d["trigger_events"], f"{where}.trigger_events"))
    )
    return RemoteWrite(
        rank=_int(d["rank"], f"{where}.rank"),
        op=_str(d["op"], f"{where}.op"),
        task_index=_int(d["task_index"], f"{where}.task_index"),
        regions=_regions(d["regions"], f"{where}.regions"),
        trigger_events=evs,
    )


def _schedule(v: object) -> Schedule:
    d = _obj(v, "schedule", {"executor", "queues"})
    queues = []
    for i, q in enumerate(_list(d["queues"], "schedule.queues")):
        q = _list(q, f"schedule.queues[{i}]")
        if len(q) != 2:
            raise PlanFormatError(f"schedule.queues[{i}] must be [name, [uid, ...]]")
        name = _str(q[0], f"schedule.queues[{i}][0]")
        uids = tuple(_int(u, f"schedule.queues[{i}][1][]") for u in _list(q[1], name))
        queues.append((name, uids))
    return Schedule(executor=_str(d["executor"], "schedule.executor"), queues=tuple(queues))


def plan_from_dict(d: object, *, validate: bool = True) -> Plan:
    """Parse a plan dict strictly and (by default) validate it; raises ``PlanError``."""
    if not isinstance(d, dict):
        raise PlanFormatError(f"a plan must be a JSON object, got {type(d).__name__}")
    if d.get("format") != PLAN_FORMAT:
        raise PlanFormatError(f"format ({d.get('format')!r}) must be {PLAN_FORMAT!r}")
    version = d.get("version")
    if not is_int(version) or version not in SUPPORTED_VERSIONS:
        raise version_error(version)
    d = _obj(d, "plan", _TOP)
    direction = _str(d["direction"], "direction")
    if direction not in ("forward", "backward"):
        raise PlanFormatError(f"direction ({direction!r}) must be 'forward' or 'backward'")
    try:
        bucket = bucket_from_dict(d["bucket"])
        options = options_from_dict(d["options"])
    except (TypeError, ValueError) as exc:
        raise PlanFormatError(f"bucket/options: {exc}") from None
    buffers = []
    for i, b in enumerate(_list(d["buffers"], "buffers")):
        b = _obj(b, f"buffers[{i}]", {"name", "rows", "cols", "kind"})
        buffers.append(
            BufferSpec(
                name=_str(b["name"], f"buffers[{i}].name"),
                rows=_int(b["rows"], f"buffers[{i}].rows"),
                cols=_int(b["cols"], f"buffers[{i}].cols"),
                kind=_str(b["kind"], f"buffers[{i}].kind"),
            )
        )
    task_num = d["task_num"]
    if not isinstance(task_num, dict):
        raise PlanFormatError("task_num must be an object")
    graph = TaskGraph(
        buffers=tuple(buffers),
        tasks=tuple(_task(t, f"tasks[{i}]") for i, t in enumerate(_list(d["tasks"], "tasks"))),
        events=tuple(_event(e, f"events[{i}]") for i, e in enumerate(_list(d["events"], "events"))),
        remote_writes=tuple(
            _remote(w, f"remote_writes[{i}]")
            for i, w in enumerate(_list(d["remote_writes"], "remote_writes"))
        ),
        task_num={_str(k, "task_num key"): _int(v, f"task_num.{k}") for k, v in task_num.items()},
        fell_back=tuple(_str(o, "fell_back[]") for o in _list(d["fell_back"], "fell_back")),
    )
    plan = Plan(
        version=_int(version, "version"),
        direction=direction,
        rank=_int(d["rank"], "rank"),
        bucket=bucket,
        options=options,
        graph=graph,
        schedule=_schedule(d["schedule"]),
    )
    world = _str(d["world"], "world")
    if world != plan.world_fingerprint:
        raise PlanFormatError(
            f"world ({world!r}) is not the fingerprint of the plan's bucket and options "
            f"({plan.world_fingerprint!r}): the file was edited or damaged"
        )
    if validate:
        check_plan(plan)
        if plan.task_num != _expected_task_num(plan):
            raise PlanFormatError("task_num disagrees with split propagation")
    return plan


def _expected_task_num(plan: Plan) -> dict[str, int]:
    return dict(Counter(t.op for t in plan.tasks))


def save_plan(plan: Plan, path: str | os.PathLike) -> Path:
    """Write a plan as JSON (atomically: a temp file renamed into place)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(plan_to_dict(plan), separators=(",", ":")))
    tmp.replace(path)
    return path


def load_plan(path: str | os.PathLike) -> Plan:
    """Read, parse and validate a plan file; raises ``PlanError`` naming what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise PlanFormatError(f"{path}: not valid JSON ({exc})") from None
    return plan_from_dict(data)


def plan_filename(plan: Plan) -> str:
    """Canonical file name: direction, bucket shape, EP size and rank."""
    b = plan.bucket
    return (
        f"plan-{plan.direction}-T{b.tokens}-H{b.hidden}-F{b.ffn}-E{b.experts}-K{b.top_k}"
        f"-S{b.slot_rows}-ep{b.ep_size}-r{plan.rank}-{plan.fingerprint}.json"
    )
