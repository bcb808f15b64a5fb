"""The generic event engine, the task-type table and the seams between generic and MoE modules."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from moesaic.taskflow import ShapeBucket, compile_plan, load_plan, save_plan
from moesaic.taskflow.engine import (
    DeadlockError,
    EngineError,
    EventEngine,
    EventOverflowError,
    Job,
    Lane,
)
from moesaic.taskflow.moe_graphs import TASK_TYPES, backward_graph, forward_graph

TASKFLOW = Path(__file__).resolve().parents[2] / "src" / "moesaic" / "taskflow"


def _lanes(spec: dict[str, list[tuple[str, str | None, tuple[str, ...]]]]) -> list[Lane]:
    """{lane: [(job, waited event, triggered events)]}; a job's task is its name."""
    return [
        Lane(name=n, jobs=[Job(key=k, task=k, wait=w, triggers=tr) for k, w, tr in jobs])
        for n, jobs in spec.items()
    ]


def test_a_discrete_event_simulation_of_two_resources():
    # A link carries two transfers; a GPU computes on each once it arrived, and a reduce waits
    # on both results (threshold 2). Costs in seconds.
    lanes = _lanes({
        "gpu": [("mm0", "in0", ("out",)), ("mm1", "in1", ("out",)), ("reduce", "out", ())],
        "link": [("send0", None, ("in0",)), ("send1", None, ("in1",))],
    })  # fmt: skip
    cost = {"send0": 2.0, "send1": 3.0, "mm0": 4.0, "mm1": 1.0, "reduce": 0.5}
    launched = []
    eng = EventEngine(
        lanes, {"in0": 1, "in1": 1, "out": 2}, cost=cost.__getitem__, launch=launched.append
    )
    tl = eng.run()
    # send0 [0, 2], send1 [2, 5]; mm0 [2, 6]; mm1 waits for the GPU (6), not the link (5);
    # the reduce starts when both products exist.
    assert tl.start == {"send0": 0, "send1": 2, "mm0": 2, "mm1": 6, "reduce": 7}
    assert tl.end["reduce"] == tl.makespan == 7.5
    # launched by start time; mm0 and send1 both start at 2: lane order ("gpu" first) decides
    assert launched == tl.order == ["send0", "mm0", "send1", "mm1", "reduce"]


def test_outside_writers_fire_before_run_or_from_on_stall():
    lanes = _lanes({"q": [("a", "remote", ("local",)), ("b", "local", ()), ("c", "late", ())]})
    stalls_seen = []

    def on_stall(stalls):
        stalls_seen.append([(s.lane, s.position, s.job.key, s.count, s.threshold) for s in stalls])
        eng.fire("late", at=10.0)  # e.g. a message that arrives after a wait
        return True

    eng = EventEngine(lanes, {"remote": 2, "local": 1, "late": 1}, cost=lambda t: 1.0,
                      on_stall=on_stall)  # fmt: skip
    eng.fire("remote")
    eng.fire("remote", at=3.0)
    tl = eng.run()
    assert tl.start == {"a": 3.0, "b": 4.0, "c": 10.0}
    assert stalls_seen == [[("q", 2, "c", 0, 1)]]


def test_deadlock_names_every_blocked_lane():
    lanes = _lanes({"m": [("x", "ev_y", ("ev_x",))], "v": [("y", "ev_x", ("ev_y",))]})
    with pytest.raises(DeadlockError) as info:
        EventEngine(lanes, {"ev_x": 1, "ev_y": 1}).run()
    assert "lane 'm' at position 0 waits on event 'ev_y' (0/1)" in str(info.value)
    assert [s.job.key for s in info.value.stalls] == ["x", "y"]


def test_an_event_bumped_past_its_threshold_is_an_error():
    lanes = _lanes({"q": [("a", None, ("e",)), ("b", None, ("e",))]})
    with pytest.raises(EventOverflowError, match="more than 1 times") as info:
        EventEngine(lanes, {"e": 1}).run()
    assert info.value.event == "e"


def test_unknown_events_and_a_second_run_are_refused():
    with pytest.raises(EngineError, match="unknown event 'nope'"):
        EventEngine(_lanes({"q": [("a", "nope", ())]}), {}).run()
    eng = EventEngine(_lanes({"q": [("a", None, ())]}), {})
    eng.run()
    with pytest.raises(EngineError, match="runs once"):
        eng.run()


def test_the_task_type_table_covers_every_operator_and_handler():
    from moesaic.taskflow.runtime.handlers import HANDLERS

    for g in (forward_graph("swiglu"), backward_graph("swiglu"), forward_graph("gelu"),
              backward_graph("gelu")):  # fmt: skip
        for op in g.graph.ops.values():
            assert op.op_type in TASK_TYPES
    assert {t.handler for t in TASK_TYPES.values()} == set(HANDLERS)
    tags = [t.put_tag for t in TASK_TYPES.values() if t.put]
    assert len(tags) == len(set(tags)) == 3  # one message tag class per put type


def test_task_descriptors_and_plans_are_frozen():
    b = ShapeBucket(tokens=4, hidden=4, ffn=2, experts=2, top_k=1, ep_size=1, slot_rows=4,
                    tile_m=2)  # fmt: skip
    plan = compile_plan(b, "forward", 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.tasks[0].dependent_event = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.schedule = plan.schedule  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.task_num["dispatch"] = 1  # type: ignore[index]
    assert "queue" not in {f.name for f in dataclasses.fields(plan.tasks[0])}


def test_a_plan_is_validated_once(tmp_path, monkeypatch):
    import torch

    from moesaic.routing import build_plan
    from moesaic.taskflow import validate
    from moesaic.taskflow.runtime import run_forward

    b = ShapeBucket(tokens=3, hidden=4, ffn=2, experts=2, top_k=1, ep_size=1, slot_rows=4,
                    tile_m=2)  # fmt: skip
    loaded = load_plan(save_plan(compile_plan(b, "forward", 0), tmp_path / "p.json"))
    assert loaded.validated
    calls = []
    real = validate.check_plan
    monkeypatch.setattr(validate, "check_plan", lambda p: calls.append(p) or real(p))
    routing = build_plan(torch.tensor([[0], [1], [0]]), torch.ones(3, 1), 2)
    args = (torch.randn(3, 4), routing, torch.randn(2, 4, 2), torch.randn(2, 2, 4),
            torch.randn(2, 4, 2))  # fmt: skip
    for _ in range(3):
        run_forward(loaded, *args)
    assert calls == []  # three steps, no re-validation
    fresh = dataclasses.replace(loaded, rank=0)  # a new object: checked once, then marked
    run_forward(fresh, *args)
    run_forward(fresh, *args)
    assert calls == [fresh]


GENERIC = ("tasks.py", "plan.py", "graph.py", "engine.py")


@pytest.mark.parametrize("name", GENERIC)
def test_generic_modules_import_nothing_moe_specific_nor_torch(name):
    tree = ast.parse((TASKFLOW / name).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    bad = {m for m in imported if "moe_" in m or m.split(".")[0] == "torch"}
    bad |= {m for m in imported if m.startswith("moesaic.taskflow.runtime")}
    assert not bad, f"{name} imports {sorted(bad)}"
