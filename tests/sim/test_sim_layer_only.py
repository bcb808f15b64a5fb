"""A model of MoE layers alone (``layer_only``, the setup of ``benchmarks/taskflow_cluster.py``)
and the taskflow tiles' valid rows: padding of the bucket's slots costs nothing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.schedule_table import schedule_names
from moesaic.sim.model import ModelSpec
from moesaic.sim.profile import Profile
from moesaic.sim.runs import runs
from moesaic.sim.simulate import SimOptions, simulate
from moesaic.sim.taskflow import valid_rows
from moesaic.taskflow.tasks import Region

SCHEDULES = schedule_names()
ROOT = Path(__file__).resolve().parents[2]
LAYER = ModelSpec.from_toml(ROOT / "examples/models/taskflow_layer.toml")
PAIR = ClusterSpec(levels=(Level(name="node", size=2, bandwidth_gbps=1.0, latency_ms=0.1),))
PROFILE = Profile(flops_per_s=9e10)


def test_layer_only_step_is_the_layer_alone():
    """vanilla on a layer-only model: the gate and the experts forward + backward (3x), the
    four all-to-alls and the forward's counts exchange; no head, all-reduce or optimizer."""
    r = simulate(PAIR, LAYER, "dropless", PROFILE, SimOptions(degree=1))
    T, H, E, K, F = 1024, 256, 8, 2, 512
    flops = 3 * (2 * T * H * E + 3 * 2 * (T * K) * H * F)  # gate; SwiGLU: 3 matrices
    assert r.compute_s == pytest.approx(flops / 9e10, rel=1e-12)
    names = {s.name for s in r.spans}
    assert not names & {"AR1", "optimizer"}, names
    # Each all-to-all sends T K H fp32 bytes / 2 across the one link, plus a latency.
    a2a_s = T * K * H * 4 / 2 / (1e9 / 8) + 1e-4
    assert r.comm_s == pytest.approx(4 * a2a_s + 1e-4, rel=1e-9)
    assert r.iteration_s == pytest.approx(r.compute_s + r.comm_s, rel=1e-9)
    # A full model of the same shape adds attention, head, all-reduce and optimizer.
    full = dataclasses.replace(LAYER, layer_only=False)
    assert simulate(PAIR, full, "dropless", PROFILE, SimOptions(degree=1)).iteration_s > (
        r.iteration_s
    )
    # flowmoe on a layer-only model has no gradient to chunk (and does not fail).
    one = SimOptions(degree=1)
    assert simulate(PAIR, LAYER, "dropless", PROFILE, one, schedule="flowmoe").iteration_s > 0


def test_layer_only_refused_by_hybrid(capsys):
    for schedule in SCHEDULES:
        with pytest.raises(ValueError, match=r"model\.layer_only"):
            simulate(PAIR, LAYER, "hybrid", PROFILE, schedule=schedule)
    # --strategy all leaves them out for a layer-only model.
    from moesaic.cli import main

    cluster = str(ROOT / "examples/clusters/flowmoe_2rank.toml")
    model = str(ROOT / "examples/models/taskflow_layer.toml")
    assert main(["simulate", "--cluster", cluster, "--model", model, "--json"]) == 0
    out = capsys.readouterr()
    names = [r["name"] for r in json.loads(out.out)]
    assert names == [r.name for r in runs("all", "all") if r.strategy != "hybrid"]
    assert out.err == (
        "moesaic simulate: --strategy all --schedule all: skipping hybrid+vanilla, "
        "hybrid+moe-only, hybrid+flowmoe (no layer-only cost model: model.layer_only is set)\n"
    )


def test_layer_only_must_be_a_bool():
    with pytest.raises(ValueError, match=r"model\.layer_only"):
        dataclasses.replace(LAYER, layer_only="yes")


@pytest.mark.parametrize(
    ("buffer", "start", "stop", "want"),
    [
        ("x_recv", 0, 128, 128),  # first tile of a slot: all valid
        ("x_recv", 128, 384, 128),  # straddles the load (256) of slot 0
        ("x_recv", 256, 512, 0),  # padding only
        ("x_recv", 0, 1024, 512),  # two slots, 256 each
        ("y_ret", 500, 700, 188),  # end of slot 0 (padding), start of slot 1
        ("y_TH", 0, 100, 100),  # token layout: every row
    ],
)
def test_valid_rows(buffer, start, stop, want):
    region = Region(buffer=buffer, rank=0, start=start, stop=stop)
    assert valid_rows(region, 512, 256.0) == want


def test_taskflow_padding_costs_nothing():
    """The same layer in a bucket of 256-row slots and in one of 512 (twice the tiles, half of
    them padding): the same compute and puts. Would fail if tiles cost their padded rows."""
    tight = SimOptions(taskflow_tile_m=128, taskflow_slot_rows=256)
    padded = SimOptions(taskflow_tile_m=128, taskflow_slot_rows=512)
    a = simulate(PAIR, LAYER, "taskflow", PROFILE, tight)
    b = simulate(PAIR, LAYER, "taskflow", PROFILE, padded)
    assert b.compute_s == pytest.approx(a.compute_s, rel=1e-9)
    assert b.comm_s == pytest.approx(a.comm_s, rel=1e-9)  # empty puts send nothing
    # The compute matches vanilla's: the same FLOPs, split into tiles.
    v = simulate(PAIR, LAYER, "dropless", PROFILE, SimOptions(degree=1))
    assert a.compute_s == pytest.approx(v.compute_s, rel=0.02)
    with pytest.raises(ValueError, match="taskflow_slot_rows"):
        odd = SimOptions(taskflow_tile_m=128, taskflow_slot_rows=320)
        simulate(PAIR, LAYER, "taskflow", PROFILE, odd)
