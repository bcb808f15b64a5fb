"""The persistent kernel's price in ``moesaic simulate``/``plan`` (``sim.persistent_price``) on
the committed GPU profiles (H100, H200): one launch, tiles padded to the kernel's GEMM tile as
the lowered plan has them, puts on the node's links beside the tiles; a CPU profile keeps the
host runtime's pricing.

The figures compared are the pricer's own at two shapes (tokens, experts), read against what
the lowered plan says must change between them; no timing from a benchmark is copied here."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.sim.collectives import LinkModel
from moesaic.sim.model import ModelSpec
from moesaic.sim.persistent_price import KERNEL_BM, kernel_price, kernel_priced
from moesaic.sim.profile import Profile
from moesaic.sim.taskflow import (
    default_tiles,
    layer_loads,
    layer_plan,
    model_bucket,
    saved_window_elements,
)

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
GPUS = ("sim_profile_h100.json", "sim_profile_h200.json")
NODE = LinkModel(
    spec=ClusterSpec(levels=(Level(name="node", size=2, bandwidth_gbps=900.0, latency_ms=0.002),))
)


def _model(tokens: int, experts: int) -> ModelSpec:
    return ModelSpec(
        name="m",
        layers=1,
        batch=1,
        seq_len=tokens,
        hidden=64,
        ffn_hidden=128,
        experts=experts,
        top_k=2,
        act_bytes=2,
    )


def _price(model: ModelSpec, profile: Profile, direction: str = "forward", copies: bool = False):
    from moesaic.taskflow.compile import compile_world

    load = layer_loads(model, NODE.world_size)[0]
    tile_m, slot = default_tiles(model, load=load)
    bucket = model_bucket(model, ep_size=NODE.world_size, slot_rows=slot, tile_m=tile_m)
    plans = compile_world(bucket, direction)
    copy = saved_window_elements(plans[0]) if copies else 0
    return kernel_price(plans, model, NODE, profile, load.rows_E, copy)


@pytest.mark.parametrize("name", GPUS)
def test_a_gpu_profile_prices_one_launch_and_padded_tiles(name):
    gpu = Profile.load(RESULTS / name)
    assert kernel_priced(_model(256, 8), gpu)
    # uniform routing, 2 ranks: each rank sends T K / E rows to every expert, each slot
    # (expert, source) holds that many; a slot's GEMM tile is padded to KERNEL_BM rows
    few, one_tile = _model(64, 8), _model(256, 8)  # 16 and 64 rows a slot: one tile each
    two_tiles = _model(512, 8)  # 128 rows a slot: two tiles
    a, b, c = (_price(m, gpu) for m in (few, one_tile, two_tiles))
    assert KERNEL_BM == 256 * 2 // 8
    assert a.flops == b.flops  # 16 valid rows cost a whole 64-row tile
    assert c.flops == pytest.approx(2 * b.flops)
    assert a.nbytes < b.nbytes < c.nbytes  # the memory-bound rows are the valid ones
    # twice the experts at the same tokens: half the rows a slot (32), padded to one tile:
    # twice the tiles, twice the padded FLOPs
    d = _price(_model(256, 16), gpu)
    assert d.tiles > b.tiles
    assert d.flops == pytest.approx(2 * b.flops)
    for p in (a, b, c, d):
        assert p.launch_s == gpu.launch_s > 0 and p.cpu_s == p.launch_s  # one launch
        body = max(p.compute_s, p.wire_s, p.chain_s)
        assert p.makespan == pytest.approx(p.launch_s + body)
        assert p.wire_s > 0  # the other rank's experts are reached by puts


def test_the_priced_tiles_are_the_lowered_rows():
    """The pricer walks the rows ``taskflow.lower`` gives the kernel: as many, and the
    kernel's CUDA GEMM tile is ``KERNEL_BM`` rows."""
    pytest.importorskip("triton")
    import torch

    from moesaic.kernels.persistent import device_tiles
    from moesaic.taskflow.compile import compile_world
    from moesaic.taskflow.lower import lower_world

    assert device_tiles(torch.device("cuda"))[0] == KERNEL_BM
    gpu = Profile.load(RESULTS / GPUS[0])
    model = _model(256, 8)
    load = layer_loads(model, 2)[0]
    tile_m, slot = default_tiles(model, load=load)
    bucket = model_bucket(model, ep_size=2, slot_rows=slot, tile_m=tile_m)
    for direction in ("forward", "backward"):
        plans = compile_world(bucket, direction)
        price = kernel_price(plans, model, NODE, gpu, load.rows_E)
        rows = [t.tasks.shape[0] for t in lower_world(plans).ranks]
        assert price.tiles == max(rows)


def test_the_layer_plan_prices_the_kernel_on_a_gpu_and_the_host_runtime_on_a_cpu():
    gpu = Profile.load(RESULTS / GPUS[0])
    cpu = Profile.load(RESULTS / "sim_profile_cpu.json")
    model = _model(256, 8)
    on_gpu = layer_plan(model, NODE, gpu, "forward")
    assert on_gpu.cpu_s == gpu.launch_s  # the host's part: one launch, no step per tile
    priced = _price(model, gpu, copies=True)
    assert priced.copy_s > 0  # the forward's window copies for the backward
    assert on_gpu.makespan == pytest.approx(priced.makespan)
    on_cpu = layer_plan(model, NODE, cpu, "forward")
    assert not kernel_priced(model, cpu)
    assert on_cpu.cpu_s > 100 * gpu.launch_s  # every tile's host cost
    gelu = dataclasses.replace(model, activation="gelu")
    assert not kernel_priced(gelu, gpu)  # the kernel runs SwiGLU only: the host runtime's price
    assert layer_plan(gelu, NODE, gpu, "forward").cpu_s > gpu.launch_s
