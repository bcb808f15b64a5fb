"""The taskflow handlers' measured CPU per element (``moesaic.measure.cpucal``) and how the simulator
charges it (``Profile.tile_elem_cpu_s``, ``moesaic.sim.taskflow.tile_elements``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.measure.cpucal import elem_cpu_s, measure, non_gmm_elements
from moesaic.sim.collectives import LinkModel
from moesaic.sim.model import ModelSpec
from moesaic.sim.profile import Profile
from moesaic.sim.taskflow import layer_plan, model_bucket, tile_elements
from moesaic.taskflow.bucket import CompileOptions
from moesaic.taskflow.compile import compile_world
from moesaic.taskflow.moe_graphs import TASK_TYPES

ROOT = Path(__file__).resolve().parents[2]
LAYER = ModelSpec.from_toml(ROOT / "examples/models/taskflow_layer.toml")
PAIR = ClusterSpec(levels=(Level(name="node", size=2, bandwidth_gbps=1.0, latency_ms=0.1),))
LOAD = LAYER.tokens * LAYER.top_k / LAYER.experts  # rows per slot, uniform routing


def _rank0_tasks(direction: str, P: int = 2, tile_m: int = 512):
    bucket = model_bucket(LAYER, ep_size=P, slot_rows=512, tile_m=tile_m)
    return compile_world(bucket, direction, CompileOptions(pipeline=True))[0].tasks


def test_tile_elements_count_rows_times_width_of_non_gmm_tiles():
    tasks = _rank0_tasks("forward", P=1)
    by_type: dict[str, float] = {}
    for t in tasks:
        by_type[t.task_type] = by_type.get(t.task_type, 0.0) + tile_elements(t, LAYER, 512, LOAD)
    T, K, H, F = LAYER.tokens, LAYER.top_k, LAYER.hidden, LAYER.ffn_hidden
    # one rank: every one of the T K routed rows is dispatched, activated and combined once
    assert by_type["put_dispatch"] == T * K * H
    assert by_type["swiglu"] == T * K * F
    assert by_type["put_combine"] == T * K * H
    assert by_type["topk_combine"] == T * H  # the token-layout output
    assert by_type["gmm_gate_up"] == by_type["gmm_down"] == 0.0
    assert non_gmm_elements(LAYER, 512, 512)["swiglu"] == T * K * F


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_elem_cpu_is_charged_per_element_of_non_gmm_tiles(direction):
    """Off (0): the old pricing, 10 FLOPs per element, puts free; on: every non-GMM tile
    costs its elements x the rate, on top of the puts' own CPU (which stays as it was)."""
    link = LinkModel(spec=PAIR)
    knobs = {"tile_m": 512, "slot_rows": 512}
    cpu = {"flops_per_s": 1e10, "put_cpu_s": 1e-4}
    plain = layer_plan(LAYER, link, Profile(**cpu), direction, **knobs)
    on = layer_plan(LAYER, link, Profile(**cpu, tile_elem_cpu_s=1e-9), direction, **knobs)
    tasks = _rank0_tasks(direction)
    elems = sum(tile_elements(t, LAYER, 512, LOAD) for t in tasks)
    act = sum(tile_elements(t, LAYER, 512, LOAD) for t in tasks if not TASK_TYPES[t.task_type].put)
    assert elems > act > 0
    # on replaces the 10-FLOP price of the elementwise tiles and adds the puts' copies
    assert on.cpu_s - plain.cpu_s == pytest.approx(elems * 1e-9 - 10 * act / 1e10)
    assert on.makespan > plain.makespan


def test_profiles_without_the_field_load_and_negative_is_refused():
    old = json.loads(json.dumps(Profile(flops_per_s=1.0).to_dict()))
    del old["tile_elem_cpu_s"]
    assert Profile.from_dict(old).tile_elem_cpu_s == 0.0
    with pytest.raises(ValueError, match=r"profile\.tile_elem_cpu_s"):
        Profile(flops_per_s=1.0, tile_elem_cpu_s=-1e-9)


def test_elem_cpu_divides_the_non_gmm_handler_cpu_by_their_elements():
    elems = non_gmm_elements(LAYER, 512, 512)
    handler = {k: 1e-3 for k in elems} | {"gmm_gate_up": 5.0}  # GMM CPU is not counted
    got = elem_cpu_s(LAYER, {"handler_cpu_s": handler, "tile_m": 512, "slot_rows": 512})
    assert got == pytest.approx(len(elems) * 1e-3 / sum(elems.values()))


def test_committed_measurement_covers_the_validated_tiles():
    data = json.loads((ROOT / "benchmarks/results/taskflow_handler_cpu.json").read_text())
    tiles = {p["tile_m"] for p in data["points"]}
    assert tiles >= {128, 512}
    for p in data["points"]:
        assert p["tile_elem_cpu_s"] == pytest.approx(elem_cpu_s(LAYER, p))
        assert 1e-11 < p["tile_elem_cpu_s"] < 1e-7  # ns per element: memory-bound torch calls


@pytest.mark.timeout(120)
def test_measure_times_every_handler_type_on_one_rank():
    """A small layer, one step (~5 s): every task type of the plans is timed, with CPU."""
    small = ModelSpec(
        name="small",
        layers=1,
        batch=1,
        seq_len=64,
        hidden=32,
        ffn_hidden=64,
        experts=4,
        top_k=2,
        heads=2,
        vocab=32,
        activation="swiglu",
        layer_only=True,
    )
    m = measure(small, 32, steps=1)
    kinds = {t.task_type for d in ("forward", "backward") for t in _small_tasks(small, d)}
    assert set(m["handler_cpu_s"]) == kinds
    assert all(v > 0 for v in m["handler_cpu_s"].values())
    assert m["cpu_s"]["taskflow static"] > 0 and m["wall_s"]["compute only"] > 0
    assert elem_cpu_s(small, m) > 0


def _small_tasks(model: ModelSpec, direction: str):
    bucket = model_bucket(model, ep_size=1, slot_rows=32, tile_m=32)
    return compile_world(bucket, direction, CompileOptions(pipeline=True))[0].tasks
