"""FSDP2's traffic priced (``sim.fsdp``): the gathers and reduce-scatters of ``dp_shard`` on the
mesh's levels, on a lane of their own, overlapped as FSDP2 prefetches; and ``plan
--memory-per-rank`` choosing the sharding by step time among those that fit."""

from __future__ import annotations

import dataclasses

import pytest

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.planning.plan_memory import fit_memory
from moesaic.planning.planner import plan_runs
from moesaic.sim.collectives import (
    LinkModel,
    all_gather_s,
    all_reduce_s,
    level_exchange_s,
    ring_all_reduce_s,
)
from moesaic.sim.fsdp import (
    fsdp_traffic,
    mesh_levels,
    reduce_scatter_all_reduces,
    replica_reduce_s,
    replicas_all_reduce_s,
)
from moesaic.sim.memory import predict_run
from moesaic.sim.model import ModelSpec
from moesaic.sim.profile import Profile
from moesaic.sim.simulate import SimOptions, link_model, simulate

MODEL = ModelSpec(
    layers=2, batch=4, seq_len=64, hidden=128, ffn_hidden=256, experts=8, top_k=2, heads=4
)
PROFILE = Profile(flops_per_s=1e10, task_overhead_s=1e-4)


def _spec(outer_gbps: float = 0.4) -> ClusterSpec:
    return ClusterSpec(
        levels=(
            Level(name="node", size=2, bandwidth_gbps=outer_gbps, latency_ms=0.5),
            Level(name="rank", size=2, bandwidth_gbps=2.0, latency_ms=0.1),
        )
    )


def test_traffic_on_the_mesh_levels():
    """The dense units gather over the dense mesh (the world at ep 4, or the inner level at
    ep 2 x dp_shard 1 on 2 ranks); the experts over the one level beside EP."""
    link = LinkModel(spec=_spec())
    block = MODEL.replicated_params_per_block() * MODEL.param_bytes
    t = fsdp_traffic(link, MODEL, ep=4, dp_shard=1, prefetch=True)
    assert t.gather_s == pytest.approx(all_gather_s(link, block / 4))
    assert t.reduce_s == t.gather_s and t.dense_ranks == 4
    t2 = fsdp_traffic(link, MODEL, ep=2, dp_shard=2, prefetch=True)
    experts = 4 * MODEL.mats * MODEL.hidden * MODEL.ffn_hidden * MODEL.param_bytes
    assert t2.gather_s == pytest.approx(
        all_gather_s(link, block / 4) + level_exchange_s(link, 0, 1, experts / 2, gather=True)
    )
    assert mesh_levels(link.spec, 2, inner=2) == (0,)
    with pytest.raises(ValueError, match=r"^ep \(3\) must be a product of the innermost"):
        mesh_levels(link.spec, 1, inner=3)
    with pytest.raises(
        ValueError, match=r"^dp_replicate \(1\) x dp_shard \(2\) x ep \(1\) must be the world"
    ):
        fsdp_traffic(link, MODEL, ep=1, dp_shard=2, prefetch=True)


def test_gloo_reduce_scatters_by_an_all_reduce():
    """gloo's reduce-scatter is an all-reduce of the whole tensor (``ProcessGroupGloo``: clone,
    all-reduce, keep the chunk; ``gloo_collective_bytes.json``: 2.00x a ring all-gather's bytes
    on the loopback): with a CPU
    profile the reduce is priced as that all-reduce, the dense unit's over the dense mesh and
    the experts' over their level; with a GPU's (NCCL) as the gather it mirrors."""
    link = LinkModel(spec=_spec())
    block = MODEL.replicated_params_per_block() * MODEL.param_bytes
    experts = 4 * MODEL.mats * MODEL.hidden * MODEL.ffn_hidden * MODEL.param_bytes
    nccl = fsdp_traffic(link, MODEL, ep=2, dp_shard=2, prefetch=True)
    gloo = fsdp_traffic(link, MODEL, ep=2, dp_shard=2, prefetch=True, all_reduce_scatter=True)
    assert gloo.gather_s == nccl.gather_s == nccl.reduce_s
    expert_all_reduce = 2 * level_exchange_s(link, 0, 1, experts / 2, gather=True)
    assert gloo.reduce_s == pytest.approx(all_reduce_s(link, block) + expert_all_reduce)
    assert gloo.reduce_s > 1.9 * nccl.reduce_s
    root = MODEL.outer_params() * MODEL.param_bytes
    assert gloo.root_reduce_s == pytest.approx(all_reduce_s(link, root))
    assert reduce_scatter_all_reduces("cpu") and not reduce_scatter_all_reduces("cuda")
    spans = {}
    for device in ("cpu", "cuda"):
        profile = dataclasses.replace(PROFILE, device=device)
        opts = SimOptions(dp_shard=2)
        run = simulate(_spec(), MODEL, "dropless", profile, opts, schedule="vanilla")
        spans[device] = {s.name: s.end - s.start for s in run.spans if s.rank == 0}
    assert spans["cpu"]["FR1.2"] > 1.9 * spans["cuda"]["FR1.2"]


def test_sharded_step_pays_its_gathers_where_compute_cannot_hide_them():
    """On a slow link the sharded step is slower than the unsharded one (1.5x the gradient
    bytes: gathered forward and backward, reduce-scattered, no all-reduce); with prefetch
    (vanilla) the gathers after the first overlap the compute, so the step grows by less than
    their sum; a schedule that all-reduces chunks in the backward is refused."""
    spec = _spec(0.1)
    for schedule in ("vanilla", "moe-only"):
        plain = simulate(spec, MODEL, "dropless", PROFILE, SimOptions(), schedule=schedule)
        opts = SimOptions(dp_shard=1)
        sharded = simulate(spec, MODEL, "dropless", PROFILE, opts, schedule=schedule)
        names = {s.name for s in sharded.spans}
        assert {"FS.root", "FS1.1", "FR1.2", "FR.root"} <= names
        assert "AR1" in {s.name for s in plain.spans} and "AR1" not in names
        assert sharded.iteration_s > plain.iteration_s
    slow_compute = Profile(flops_per_s=2e8, task_overhead_s=1e-4)
    fast = _spec(4.0)
    t = fsdp_traffic(LinkModel(spec=fast), MODEL, ep=4, dp_shard=1, prefetch=True)
    total = 2 * MODEL.layers * (t.gather_s) + MODEL.layers * t.reduce_s
    plain = simulate(fast, MODEL, "dropless", slow_compute, SimOptions(), schedule="vanilla")
    sharded = simulate(
        fast, MODEL, "dropless", slow_compute, SimOptions(dp_shard=1), schedule="vanilla"
    )
    assert sharded.iteration_s - plain.iteration_s < 0.5 * total
    with pytest.raises(ValueError, match=r"^dp_shard \(1\) with schedule 'flowmoe'"):
        simulate(spec, MODEL, "dropless", PROFILE, SimOptions(dp_shard=1), schedule="flowmoe")


def test_plan_shards_by_step_time_among_what_fits():
    """With a budget only the sharded run fits: the plan prices each kept combination sharded
    (its step grows by FSDP2's traffic) and ranks again; without a pricer it would have kept
    the unsharded prediction."""
    spec = _spec(0.1)
    model = dataclasses.replace(MODEL, hidden=256, ffn_hidden=64, batch=1, experts=4)
    plan = plan_runs(spec, model, PROFILE, strategies=("dropless",), schedules=("vanilla",))
    cand = plan.ranked[0]
    unsharded = predict_run(model, "dropless", "vanilla", 4).peak
    sharded = predict_run(model, "dropless", "vanilla", 4, dp_shard=1).peak
    assert sharded < unsharded
    budget = (sharded + unsharded) / 2
    fit = fit_memory(plan, model, 4, budget)
    best = fit.plan.ranked[0]
    assert best.options["dp_shard"] == 1
    expected = simulate(spec, model, "dropless", PROFILE, SimOptions(dp_shard=1, degree=1))
    assert best.predicted_ms == pytest.approx(expected.iteration_s * 1e3)
    assert best.predicted_ms > cand.predicted_ms
    blind = fit_memory(dataclasses.replace(plan, reprice=None), model, 4, budget)
    assert blind.plan.ranked[0].predicted_ms == cand.predicted_ms
    # with room for both, unsharded is faster and kept
    roomy = fit_memory(plan, model, 4, 2 * unsharded)
    assert "dp_shard" not in roomy.plan.ranked[0].options


def test_replicas_all_reduce_each_shard_over_the_outer_level():
    """HSDP (dp_replicate 2 x dp_shard 1 x EP 2 on 2 nodes of 2): the gathers stay inside a
    node (the dense part sharded over its 2 ranks), and each unit's reduce adds a ring
    all-reduce of its shard over the 2 nodes: a reduce-scatter and an all-gather of half the
    shard on the node level. A mesh that does not fill the world is refused."""
    spec = ClusterSpec(
        levels=(
            Level(name="node", size=2, bandwidth_gbps=0.4, latency_ms=1.0),
            Level(name="rank", size=2, bandwidth_gbps=2.0, latency_ms=0.1),
        )
    )
    link = LinkModel(spec=spec)
    block = MODEL.replicated_params_per_block() * MODEL.param_bytes
    experts = MODEL.experts // 2 * MODEL.mats * MODEL.hidden * MODEL.ffn_hidden
    experts *= MODEL.param_bytes
    hsdp = fsdp_traffic(link, MODEL, ep=2, dp_shard=1, prefetch=True, dp_replicate=2)
    inside = fsdp_traffic(LinkModel(spec=ClusterSpec(levels=spec.levels[1:])), MODEL, ep=2,
                          dp_shard=1, prefetch=True)  # fmt: skip
    assert hsdp.gather_s == pytest.approx(inside.gather_s) and hsdp.dense_ranks == 2
    shard = block / 2 + experts
    ring = 2 * level_exchange_s(link, 0, 1, shard / 2, gather=True)
    assert hsdp.reduce_s == pytest.approx(inside.reduce_s + ring)
    assert ring > 0 and hsdp.root_reduce_s > hsdp.root_gather_s
    opts = SimOptions(dp_shard=1, dp_replicate=2)
    step = simulate(spec, MODEL, "dropless", PROFILE, opts, schedule="vanilla")
    alone = simulate(spec, MODEL, "dropless", PROFILE, SimOptions(dp_shard=2), schedule="vanilla")
    assert step.iteration_s > 0 and alone.iteration_s > 0
    with pytest.raises(ValueError, match=r"^dp_replicate \(3\) x dp_shard \(1\) x ep \(2\)"):
        fsdp_traffic(link, MODEL, ep=2, dp_shard=1, prefetch=True, dp_replicate=3)


def test_replicas_of_the_unsharded_model_reduce_dense_over_the_world_experts_over_replicas():
    """dp_replicate 2 without dp_shard on 2 nodes of 2: EP on a node's 2 ranks, and after the
    backward the dense gradients all-reduced over the 4 ranks, then each rank's experts over
    the 2 nodes (a ring on the node level), as GradientSync runs them; the step is the EP 2
    step with that reduction in place of the dense all-reduce on the node. Refused under a
    schedule that reduces in the backward and for hybrid."""
    spec = ClusterSpec(
        levels=(
            Level(name="node", size=2, bandwidth_gbps=0.4, latency_ms=1.0),
            Level(name="rank", size=2, bandwidth_gbps=2.0, latency_ms=0.1),
        )
    )
    link = LinkModel(spec=spec)
    dense = MODEL.layers * MODEL.replicated_params_per_block() + MODEL.outer_params()
    experts = MODEL.layers * MODEL.experts // 2 * MODEL.mats * MODEL.hidden * MODEL.ffn_hidden
    want = all_reduce_s(link, dense * MODEL.param_bytes) + 2 * level_exchange_s(
        link, 0, 1, experts * MODEL.param_bytes / 2, gather=True
    )
    assert replica_reduce_s(link, MODEL, ep=2, dp_replicate=2) == pytest.approx(want)
    opts = SimOptions(dp_replicate=2)
    step = simulate(spec, MODEL, "dropless", PROFILE, opts, schedule="vanilla")
    (ar,) = [s for s in step.spans if s.name == "AR1"]
    # simulate's link: the profile's, the all-reduce the faster of ring and hierarchical
    world = link_model(spec, PROFILE, opts.all_reduce)
    assert ar.duration == pytest.approx(replica_reduce_s(world, MODEL, ep=2, dp_replicate=2))
    assert replica_reduce_s(world, MODEL, ep=2, dp_replicate=2) <= want
    node = ClusterSpec(levels=spec.levels[1:])
    ep2 = simulate(node, MODEL, "dropless", PROFILE, SimOptions(), schedule="vanilla")
    (ar2,) = [s for s in ep2.spans if s.name == "AR1"]
    assert step.iteration_s == pytest.approx(ep2.iteration_s - ar2.duration + ar.duration)
    for strategy, schedule in (("dropless", "flowmoe"), ("hybrid", "vanilla")):
        with pytest.raises(ValueError, match=r"^dp_replicate \(2\) without dp_shard with"):
            simulate(spec, MODEL, strategy, PROFILE, opts, schedule=schedule)


def test_replicas_across_levels_are_gloos_ring_over_the_levels_they_span():
    """Replicas spanning two levels (EP on the GPUs of a node, 4 replicas over 2 DCs x 2
    nodes): gloo's ring in rank order, 2 (r - 1) steps of 1 / r of the bytes, both EP rings at
    once. A DC's or a node's uplink carries one edge per ring (2 flows); a GPU's its own rank's
    (1); each step pays the DC's latency. At EP 1 over every level it is the world's ring; on
    one level it stays that level's exchange."""
    dc = Level(name="dc", size=2, bandwidth_gbps=0.1, latency_ms=10.0)
    node = Level(name="node", size=2, bandwidth_gbps=0.2, latency_ms=4.0)
    gpu = Level(name="gpu", size=2, bandwidth_gbps=2.0, latency_ms=0.1)
    link = LinkModel(spec=ClusterSpec(levels=(dc, node, gpu)))
    levels = mesh_levels(link.spec, 4, inner=2)
    assert levels == (0, 1)
    nbytes, chunk = 8e6, 2e6
    step = max(2 * chunk / link.bytes_per_s(0), 2 * chunk / link.bytes_per_s(1))
    step = max(step, chunk / link.bytes_per_s(2))
    want = 6 * step + 6 * link.latency_s(0)
    assert replicas_all_reduce_s(link, levels, 2, nbytes) == pytest.approx(want)
    world = LinkModel(spec=ClusterSpec(levels=(dc, node)), all_reduce="ring")
    everywhere = mesh_levels(world.spec, 4, inner=1)
    assert replicas_all_reduce_s(world, everywhere, 1, nbytes) == pytest.approx(
        ring_all_reduce_s(world, nbytes)
    )
    one = mesh_levels(link.spec, 2, inner=4)
    assert replicas_all_reduce_s(link, one, 4, nbytes) == pytest.approx(
        2 * level_exchange_s(link, 0, 1, nbytes / 2, gather=True)
    )
    # the unsharded model's replicas at EP 1 on 2 DCs x 2 nodes: priced, dense then experts
    experts = MODEL.layers * MODEL.experts * MODEL.mats * MODEL.hidden * MODEL.ffn_hidden
    dense = MODEL.layers * MODEL.replicated_params_per_block() + MODEL.outer_params()
    got = replica_reduce_s(world, MODEL, ep=1, dp_replicate=4)
    assert got == pytest.approx(
        all_reduce_s(world, dense * MODEL.param_bytes)
        + ring_all_reduce_s(world, experts * MODEL.param_bytes)
    )


def test_experts_need_only_divide_ep_when_replicas_take_the_rest():
    """Fewer experts than ranks are priced when the replicas leave an EP they divide (8 ranks,
    4 experts: EP 4 x 2 replicas, EP 2 x 4, EP 1 x 8); at EP = world they are refused, naming
    the world size, and with replicas naming EP."""
    spec = ClusterSpec(
        levels=(
            Level(name="dc", size=2, bandwidth_gbps=0.1, latency_ms=10.0),
            Level(name="node", size=2, bandwidth_gbps=0.2, latency_ms=4.0),
            Level(name="rank", size=2, bandwidth_gbps=0.5, latency_ms=2.0),
        )
    )
    model = dataclasses.replace(MODEL, experts=4)
    for replicas in (2, 4, 8):
        opts = SimOptions(dp_replicate=replicas)
        assert simulate(spec, model, "dropless", PROFILE, opts, schedule="vanilla").iteration_s > 0
    with pytest.raises(ValueError, match=r"^model.experts \(4\) must be a multiple of the cluster"):
        simulate(spec, model, "dropless", PROFILE, SimOptions(), schedule="vanilla")
    three = dataclasses.replace(MODEL, experts=6)
    with pytest.raises(ValueError, match=r"multiple of EP \(world / replicas\) \(4\)"):
        simulate(spec, three, "dropless", PROFILE, SimOptions(dp_replicate=2), schedule="vanilla")
