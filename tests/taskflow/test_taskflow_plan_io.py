"""Plan files: round trip, and malformed or hostile plans rejected before they can run."""

from __future__ import annotations

import copy
import json

import pytest

from moesaic.taskflow import (
    PLAN_VERSION,
    PlanError,
    PlanEventError,
    PlanFormatError,
    PlanRegionError,
    PlanVersionError,
    ShapeBucket,
    compile_plan,
    load_plan,
    plan_from_dict,
    plan_to_dict,
    save_plan,
)
from moesaic.taskflow.plan_io import plan_filename

BUCKET = ShapeBucket(
    tokens=7, hidden=8, ffn=6, experts=4, top_k=2, ep_size=2, slot_rows=4, tile_m=2
)


@pytest.fixture(scope="module")
def good():
    return {d: plan_to_dict(compile_plan(BUCKET, d, 1)) for d in ("forward", "backward")}


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_round_trip_through_a_file(tmp_path, good, direction):
    plan = plan_from_dict(good[direction])
    path = save_plan(plan, tmp_path / plan_filename(plan))
    assert path.name.startswith(f"plan-{direction}-T7-") and path.name.endswith(".json")
    again = load_plan(path)
    assert plan_to_dict(again) == good[direction]
    assert again.fingerprint == plan.fingerprint
    assert json.loads(path.read_text())["version"] == PLAN_VERSION


def _task(d, op, index=0):
    return next(t for t in d["tasks"] if t["op"] == op and t["task_index"] == index)


def _gmm_reading(d, event):
    return next(t for t in d["tasks"] if t["dependent_event"] == event)


def _mutations():
    """(name, mutate(dict), expected error class, message regex)."""

    def version(d):
        d["version"] = 99

    def fmt(d):
        d["format"] = "something-else"

    def region_out_of_bounds(d):
        _task(d, "gmm1", 1)["outputs"][0][3] = 10_000  # stop past the end of h

    def region_negative(d):
        _task(d, "act", 0)["inputs"][0][2] = -4

    def threshold(d):
        d["events"][3]["threshold"] += 1

    def dropped_dependency(d):
        _task(d, "gmm2", 2)["dependent_event"] = -1

    def wrong_dependency(d):
        # wait on another tile's event: the rows this tile reads are not covered
        _task(d, "gmm2", 2)["dependent_event"] = _task(d, "gmm2", 3)["dependent_event"]

    def writes_weights(d):
        _task(d, "gmm1", 0)["outputs"][0][0] = "w1"

    def write_conflict(d):
        t0, t1 = _task(d, "act", 0), _task(d, "act", 1)
        t1["outputs"][0] = list(t0["outputs"][0])

    def other_source_slot(d):
        # a dispatch tile of rank 1 writing the slot that belongs to source rank 0
        out = _task(d, "dispatch", 0)["outputs"][0]
        out[2] -= BUCKET.slot_rows
        out[3] -= BUCKET.slot_rows

    def bigger_buffer(d):
        d["buffers"][0]["rows"] *= 2

    def _queue(d, name):
        return next(q[1] for q in d["schedule"]["queues"] if q[0] == name)

    def queue_duplicate(d):
        _queue(d, "vector").append(_queue(d, "vector")[0])

    def queue_missing(d):
        _queue(d, "matrix").pop()

    def wrong_queue(d):
        _queue(d, "vector").append(_queue(d, "matrix").pop())

    def unknown_executor(d):
        d["schedule"]["executor"] = "five_queue"

    def world_edited(d):
        d["world"] = "0" * 16

    def bool_as_int(d):
        d["tasks"][0]["task_index"] = True

    def missing_field(d):
        del d["tasks"][0]["outputs"]

    def unknown_field(d):
        d["tasks"][0]["launch_missiles"] = 1

    def unknown_op(d):
        _task(d, "act", 0)["op"] = "exec"

    def trigger_unknown_event(d):
        _task(d, "act", 0)["trigger_events"].append([1, 10_000])

    def remote_into_input(d):
        d["remote_writes"][0]["regions"][0][0] = "x_TH"

    def consistent_swap(d):
        # Swap the rows two GMM1 tiles write *and* the counters they bump: every declared region
        # and event stays consistent, but the tiles no longer compute the rows they claim.
        a, b = _task(d, "gmm1", 0), _task(d, "gmm1", 1)
        a["outputs"], b["outputs"] = b["outputs"], a["outputs"]
        a["trigger_events"], b["trigger_events"] = b["trigger_events"], a["trigger_events"]
        for ev in d["events"]:
            for p in ev["producers"]:
                if p[1] == "gmm1" and p[2] in (0, 1):
                    p[2] = 1 - p[2]

    return [
        (
            "consistent swap",
            consistent_swap,
            PlanRegionError,
            "differ from the tile the FillConfig",
        ),
        ("unknown version", version, PlanVersionError, r"version 99 is not supported"),
        ("unknown format", fmt, PlanFormatError, "format"),
        ("region out of bounds", region_out_of_bounds, PlanRegionError, "outside buffer 'h'"),
        ("negative region", region_negative, PlanRegionError, "outside buffer 'h'"),
        ("wrong threshold", threshold, PlanEventError, r"event 3: threshold \(\d+\) must equal"),
        ("dropped dependency", dropped_dependency, PlanEventError, "waits on no event"),
        ("wrong dependency", wrong_dependency, PlanEventError, "read before any producer"),
        ("writes weights", writes_weights, PlanRegionError, "writes input buffer 'w1'"),
        ("write conflict", write_conflict, PlanRegionError, "written twice"),
        ("foreign slot", other_source_slot, PlanRegionError, "its own source slot"),
        ("buffer resized", bigger_buffer, PlanRegionError, "buffers differ"),
        ("task queued twice", queue_duplicate, PlanFormatError, "appears twice"),
        ("task in no queue", queue_missing, PlanFormatError, "in no queue"),
        ("task in wrong queue", wrong_queue, PlanFormatError, "sits in the vector queue"),
        ("unknown executor", unknown_executor, PlanFormatError, "two_queue executor's"),
        ("world fingerprint edited", world_edited, PlanFormatError, "is not the fingerprint"),
        ("bool as int", bool_as_int, PlanFormatError, r"task_index must be an int"),
        ("missing field", missing_field, PlanFormatError, r"misses fields \['outputs'\]"),
        ("unknown field", unknown_field, PlanFormatError, "unknown fields"),
        ("unknown operator", unknown_op, PlanFormatError, "'exec' is not in the forward graph"),
        ("unknown event", trigger_unknown_event, PlanEventError, "does not exist"),
        ("remote write into input", remote_into_input, PlanRegionError, "writes input buffer"),
    ]


@pytest.mark.parametrize("name, mutate, exc, match", _mutations(), ids=[m[0] for m in _mutations()])
def test_hostile_plans_are_rejected(good, name, mutate, exc, match):
    d = copy.deepcopy(good["forward"])
    mutate(d)
    with pytest.raises(exc, match=match) as info:
        plan_from_dict(d)
    assert isinstance(info.value, ValueError) and isinstance(info.value, PlanError)


def test_not_json_and_not_an_object(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        load_plan(path)
    with pytest.raises(PlanFormatError, match="must be a JSON object"):
        plan_from_dict([1, 2, 3])


def test_the_executor_refuses_a_mutated_plan_object():
    import dataclasses

    import torch

    from moesaic.routing import build_plan
    from moesaic.taskflow.runtime import run_forward

    b = ShapeBucket(tokens=3, hidden=4, ffn=2, experts=2, top_k=1, ep_size=1, slot_rows=4,
                    tile_m=2)  # fmt: skip
    plan = compile_plan(b, "forward", 0)
    assert plan.validated  # checked on compile
    bad = dataclasses.replace(
        plan, schedule=plan.schedule.with_queue("vector", plan.queue("vector")[::-1])
    )
    assert not bad.validated  # a replaced plan is a new, unchecked object
    routing = build_plan(torch.tensor([[0], [1], [0]]), torch.ones(3, 1), 2)
    with pytest.raises(PlanError):
        run_forward(bad, torch.randn(3, 4), routing, torch.randn(2, 4, 2), torch.randn(2, 2, 4),
                    torch.randn(2, 4, 2))  # fmt: skip
