"""Rank symmetry: simulating every rank (``SimGraph.replicate``, collectives joined over ranks)
gives the representative rank's iteration; with skewed expert loads the representative must be
the busiest rank."""

from __future__ import annotations

import dataclasses

import pytest

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.sim.collectives import LinkModel
from moesaic.sim.graph import SimGraph, SimTask
from moesaic.sim.hybrid import build_hybrid, hybrid_parts
from moesaic.sim.model import ModelSpec
from moesaic.sim.pipelined import Costs, run_pipelined
from moesaic.sim.profile import Profile

SPEC = ClusterSpec(
    levels=(
        Level(name="dc", size=2, bandwidth_gbps=0.1, latency_ms=2.0),
        Level(name="r", size=3, bandwidth_gbps=1.0, latency_ms=0.1),
    )
)
MODEL = ModelSpec(layers=3, batch=4, seq_len=32, hidden=64, ffn_hidden=128, experts=6, top_k=2)
PROFILE = Profile(flops_per_s=1e9, task_overhead_s=1e-4)


@pytest.mark.parametrize("prefetch", [False, True])
def test_every_rank_equals_the_representative_hybrid(prefetch):
    link = LinkModel(spec=SPEC)
    g = build_hybrid(hybrid_parts(link, MODEL, (2, 3), 1e9, prefetch=prefetch), MODEL, PROFILE)
    rep = g.run()
    full = g.replicate(SPEC.world_size).run()
    assert full.makespan == pytest.approx(rep.makespan, rel=1e-12)
    assert len(full.end) == SPEC.world_size * len(rep.end)


@pytest.mark.parametrize("overlap", [False, True])
def test_every_rank_equals_the_representative_pipelined(overlap):
    g, tl = run_pipelined(
        Costs(MODEL, LinkModel(spec=SPEC), PROFILE, 2), degree=2, overlap=overlap, chunk_bytes=None
    )
    assert g.replicate(SPEC.world_size).run().makespan == pytest.approx(tl.makespan, rel=1e-12)


def test_skewed_ranks_wait_for_the_busiest():
    """Rank k's experts take (1 + k/2) x as long: every collective waits for the slowest rank,
    so the whole world's iteration is the representative graph with the busiest rank's times,
    and longer than with the least busy rank's."""
    link = LinkModel(spec=SPEC)
    costs = Costs(dataclasses.replace(MODEL, routing_skew=0.0), link, PROFILE, 2)
    g, _ = run_pipelined(costs, degree=2, overlap=True, chunk_bytes=None)
    P = SPEC.world_size

    def seconds(rank: int, task: SimTask) -> float:
        return task.seconds * (1 + rank / 2) if task.name.startswith("E") else task.seconds

    full = g.replicate(P, seconds).run().makespan
    busiest = g.replicate(1, lambda r, t: seconds(P - 1, t)).run().makespan
    idlest = g.replicate(1, lambda r, t: seconds(0, t)).run().makespan
    assert full == pytest.approx(busiest, rel=1e-12)
    assert idlest < busiest


def test_a_task_key_twice_is_refused():
    g = SimGraph()
    t = SimTask("AT1.1", "compute", 1.0, "fwd")
    g.add("compute", t)
    g.add("compute", t)
    with pytest.raises(ValueError, match="appears twice"):
        g.run()


def test_taskflow_layers_are_the_compiled_plans():
    """The taskflow step runs the compiler's own tiles: every forward and backward tile of rank
    0's plans appears once per MoE layer, puts on the a2a lane, within the layer's slot."""
    from moesaic.sim.simulate import simulate
    from moesaic.taskflow.bucket import ShapeBucket
    from moesaic.taskflow.compile import compile_plan

    spec = ClusterSpec(levels=(Level(name="n", size=2, bandwidth_gbps=0.1, latency_ms=1.0),))
    model = ModelSpec(layers=2, batch=2, seq_len=64, hidden=32, ffn_hidden=64, experts=4, top_k=2)
    r = simulate(spec, model, "taskflow", PROFILE)
    bucket = ShapeBucket(
        tokens=128, hidden=32, ffn=64, experts=4, top_k=2, ep_size=2, slot_rows=128, tile_m=128
    )  # the runtime's default tile (TaskflowOptions.tile_m) and the bucket it rounds 64 rows to
    for direction, phase in (("forward", "fwd"), ("backward", "bwd")):
        tiles = compile_plan(bucket, direction, 0).tasks
        for blk in (1, 2):
            got = [
                s
                for s in r.spans
                if s.args.get("block") == blk and "tile" in s.args and s.args.get("phase") == phase
            ]
            assert sorted((s.name, s.args["tile"]) for s in got) == sorted(
                (t.op, t.task_index) for t in tiles
            )
    puts = [s for s in r.spans if s.resource == "a2a"]
    assert puts and all("put" in s.name or s.name.startswith(("dispatch", "combine")) for s in puts)
    assert r.bound_s <= r.iteration_s + 1e-12 <= r.compute_s + r.comm_s + 1e-9


def test_taskflow_refuses_a_world_too_big_to_compile():
    from moesaic.sim.simulate import simulate

    spec = ClusterSpec(levels=(Level(name="n", size=128, bandwidth_gbps=1.0, latency_ms=1.0),))
    model = ModelSpec(layers=1, batch=1, seq_len=64, hidden=32, ffn_hidden=64, experts=128, top_k=2)
    with pytest.raises(ValueError, match="taskflow"):
        simulate(spec, model, "taskflow", PROFILE)
