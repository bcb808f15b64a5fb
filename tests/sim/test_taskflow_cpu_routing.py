"""The taskflow simulation under skewed routing (``sim.taskflow.layer_loads``, ``SlotLoads``):
the bucket the runtime agrees on (its busiest slot), each slot's valid rows, per-layer plans,
and the forward's copies of its receive window (``saved_window_elements``)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.sim.collectives import LinkModel
from moesaic.sim.model import ModelSpec
from moesaic.sim.profile import Profile
from moesaic.sim.taskflow import (
    RETURN_LAYOUT,
    SAVED_WINDOW,
    SlotLoads,
    build_taskflow,
    default_tiles,
    layer_loads,
    layer_plan,
    model_bucket,
    saved_window_elements,
    step_cpu_s,
    valid_rows,
)
from moesaic.taskflow.bucket import CompileOptions, slot_rows_for
from moesaic.taskflow.compile import compile_world
from moesaic.taskflow.tasks import Region

MODEL = ModelSpec(layers=2, batch=2, seq_len=64, hidden=32, ffn_hidden=64, experts=4, top_k=2)
SPEC = ClusterSpec(levels=(Level(name="n", size=2, bandwidth_gbps=1.0, latency_ms=0.1),))
PROFILE = Profile(flops_per_s=1e10, tile_cpu_s=2e-5, tile_elem_cpu_s=1e-9)


# one hot expert (placement order): rank 0 holds experts 0, 1
HOT = (70.0, 10.0, 10.0, 10.0)


def test_layouts_are_the_runtimes():
    from moesaic.taskflow.runtime.concurrent import RECEIVE_BUFFERS
    from moesaic.taskflow.runtime.handlers import RETURN_LAYOUT as RUNTIME_RETURN
    from moesaic.taskflow.runtime.sequential import SAVED

    assert RETURN_LAYOUT == RUNTIME_RETURN
    assert frozenset(SAVED) & RECEIVE_BUFFERS == SAVED_WINDOW


def test_uniform_loads_are_the_mean_and_skewed_ones_size_the_bucket():
    (uniform,) = layer_loads(MODEL, 2)
    routed = MODEL.tokens * MODEL.top_k
    assert uniform.rows_E == pytest.approx([routed / 4] * 4)
    hot = dataclasses.replace(MODEL, measured_loads=(HOT, (25.0, 25.0, 25.0, 25.0)))
    first, second = layer_loads(hot, 2)
    assert first.worst == pytest.approx(0.7 * routed)
    assert second.rows_E == pytest.approx(uniform.rows_E)
    # the runtime's default tile, the slot its bucket rounds the busiest slot to
    assert default_tiles(hot, load=first) == (128, slot_rows_for(math.ceil(0.7 * routed), 128))
    assert default_tiles(MODEL) == (128, 128)


def test_slot_counts_follow_the_runtimes_layouts():
    load = SlotLoads([7.0, 1.0, 2.0, 3.0], local=2, ranks=2)
    # receive layout on rank 1: slot = local expert j * P + source; expert = 1 * 2 + j
    assert [load("x_recv", 1, k) for k in range(4)] == [2.0, 2.0, 3.0, 3.0]
    assert [load("x_recv", 0, k) for k in range(4)] == [7.0, 7.0, 1.0, 1.0]
    # return layout: the global expert
    assert [load("y_ret", 1, k) for k in range(4)] == [7.0, 1.0, 2.0, 3.0]
    region = Region(buffer="x_recv", rank=0, start=0, stop=4 * 8)
    assert valid_rows(region, 8, load) == 7 + 7 + 1 + 1
    assert valid_rows(region, 8, 3.0) == 12


def test_a_hot_expert_lengthens_the_step_and_the_busiest_ranks_cpu():
    link = LinkModel(spec=SPEC)
    hot = dataclasses.replace(MODEL, measured_loads=(HOT,))
    _, even = build_taskflow(MODEL, link, PROFILE)
    _, skewed = build_taskflow(hot, link, PROFILE)
    for d in ("forward", "backward"):
        assert skewed[d].makespan > even[d].makespan
        assert skewed[d].cpu_s > even[d].cpu_s
    assert step_cpu_s(hot, PROFILE, skewed, 2) > step_cpu_s(MODEL, PROFILE, even, 2)


def test_layers_with_their_own_loads_run_their_own_plans():
    link = LinkModel(spec=SPEC)
    two = dataclasses.replace(MODEL, measured_loads=(HOT, (25.0, 25.0, 25.0, 25.0)))
    _, plans = build_taskflow(two, link, PROFILE)
    _, even = build_taskflow(MODEL, link, PROFILE)
    assert plans["forward.2"].makespan == pytest.approx(even["forward"].makespan)
    assert plans["forward.1"].makespan > plans["forward.2"].makespan
    assert plans["forward"] is plans["forward.1"]
    want = sum(plans[f"{d}.{b}"].cpu_s for d in ("forward", "backward") for b in (1, 2))
    p0 = step_cpu_s(MODEL, PROFILE, {"forward": even["forward"], "backward": even["backward"]}, 2)
    assert step_cpu_s(two, PROFILE, plans, 2) - p0 == pytest.approx(
        want - 2 * (even["forward"].cpu_s + even["backward"].cpu_s)
    )


def test_the_forward_pays_its_window_copies_whole_buckets():
    link = LinkModel(spec=SPEC)
    tile, slot = default_tiles(MODEL)
    bucket = model_bucket(MODEL, ep_size=2, slot_rows=slot, tile_m=tile)
    fwd, bwd = (compile_world(bucket, d, CompileOptions())[0] for d in ("forward", "backward"))
    # x_recv and y_ret: e P S rows of H each
    assert saved_window_elements(fwd) == 2 * 2 * 2 * slot * MODEL.hidden
    assert saved_window_elements(bwd) == 0
    copy = dataclasses.replace(PROFILE, copy_elem_cpu_s=1e-9)
    for d, extra in (("forward", saved_window_elements(fwd) * 1e-9), ("backward", 0.0)):
        plain, paid = layer_plan(MODEL, link, PROFILE, d), layer_plan(MODEL, link, copy, d)
        assert paid.makespan - plain.makespan == pytest.approx(extra)
        assert paid.cpu_s - plain.cpu_s == pytest.approx(extra)
