"""The ``taskflow`` strategy's step: each MoE layer runs its compiled plans (HyperParallel-MoE
tiles on a matrix and a vector queue, one-sided puts), the rest as in ``vanilla``.

The task definitions are the compiler's own: ``compile_world(ShapeBucket(...), direction)`` for
every rank, simulated by ``taskflow.validate.simulate`` (the same event engine, whole world:
puts bump their target ranks' counters) with costs from the profile and the cluster instead of
the nominal ones the plan drawing uses:

* GMM tiles: ``2 x rows x H x F`` FLOPs (twice that for SwiGLU's gate-and-up GMMs and their
  gradients) at ``flops_per_s``;
* elementwise and reduction tiles: ``10`` FLOPs per element of their rows;
* puts: the rows' bytes from this rank to the destination as one message
  (:func:`moesaic.sim.collectives.p2p_s`); a put to itself is a copy and costs no network time;
* every tile: ``task_overhead_s / OPS_PER_TASK`` (one launch, where a pipeline stage has ~30).

The layer's forward (backward) plan runs between the attention forward (backward) stages; its
tiles appear in the timeline ("compute" for matrix and elementwise tiles, "a2a" for puts).
Whole-world compilation is O(P) plans: this strategy is for worlds of up to ``MAX_RANKS``.
"""

from __future__ import annotations

import math

from moesaic.sim.collectives import LinkModel, p2p_s, ring_all_reduce_s
from moesaic.sim.graph import SimGraph, SimTask
from moesaic.sim.model import ModelSpec
from moesaic.sim.profile import OPS_PER_TASK, Profile
from moesaic.trace import Span

__all__ = ["MAX_RANKS", "LayerPlan", "build_taskflow", "layer_plan"]

MAX_RANKS = 64


class LayerPlan:
    """One direction's simulated plan: its makespan and its tiles' spans (from time 0)."""

    def __init__(self, makespan: float, spans: list[Span]):
        self.makespan = makespan
        self.spans = spans


def layer_plan(model: ModelSpec, link: LinkModel, profile: Profile, direction: str) -> LayerPlan:
    """Compiles and simulates one MoE layer's ``direction`` plans on every rank; rank 0's tiles."""
    from moesaic.taskflow.bucket import ShapeBucket, slot_rows_for
    from moesaic.taskflow.compile import compile_world
    from moesaic.taskflow.moe_graphs import TASK_TYPES
    from moesaic.taskflow.tasks import TaskDescriptor
    from moesaic.taskflow.validate import simulate

    P = link.world_size
    if P > MAX_RANKS:
        raise ValueError(f"the taskflow strategy simulates worlds of <= {MAX_RANKS} ranks, got {P}")
    T, H, F = model.tokens, model.hidden, model.ffn_hidden
    tile_m = min(128, 1 << max(T * model.top_k // model.experts - 1, 0).bit_length())
    slot = slot_rows_for(math.ceil(T * model.top_k / model.experts), tile_m)
    bucket = ShapeBucket(tokens=T, hidden=H, ffn=F, experts=model.experts, top_k=model.top_k,
                         ep_size=P, slot_rows=slot, tile_m=tile_m,
                         activation=model.activation)  # fmt: skip
    plans = compile_world(bucket, direction)
    launch_s = profile.task_overhead_s / OPS_PER_TASK
    swiglu = model.activation == "swiglu"

    def cost(t: TaskDescriptor) -> float:
        kind = TASK_TYPES[t.task_type]
        if kind.put:
            rows = sum(r.rows for r in t.outputs)
            dst = t.peer if t.peer >= 0 else t.outputs[0].rank
            src = t.inputs[0].rank if t.inputs else dst
            return launch_s + p2p_s(link, src, dst, rows * H * model.act_bytes)
        if kind.cost_class == "gmm":
            wide = swiglu and ("gate" in t.task_type or "w1" in t.task_type)
            return launch_s + 2.0 * t.split_value * H * F * (2 if wide else 1) / profile.flops_per_s
        width = F if kind.cost_class == "act" else H
        return launch_s + 10.0 * t.split_value * width / profile.flops_per_s

    tl = simulate(plans, world=True, cost=cost)
    plan = plans[0]
    spans = []
    for t in plan.tasks:
        kind = TASK_TYPES[t.task_type]
        spans.append(Span(rank=0, resource="a2a" if kind.put else "compute", name=t.op,
                          start=tl.start[(0, t.uid)], end=tl.end[(0, t.uid)],
                          args={"tile": t.task_index}))  # fmt: skip
    return LayerPlan(tl.makespan, spans)


def build_taskflow(
    model: ModelSpec, link: LinkModel, profile: Profile
) -> tuple[SimGraph, dict[str, LayerPlan]]:
    """The step's graph: per block ``AT`` then the layer's plan (one task standing for it,
    expanded into its tiles afterwards), the head, the backward in reverse, one all-reduce of the
    replicated gradients and the optimizer."""
    plans = {d: layer_plan(model, link, profile, d) for d in ("forward", "backward")}
    T = model.tokens
    at_s = profile.compute_s(model.attention_flops(T))
    g = SimGraph()
    for blk in range(1, model.layers + 1):
        g.add("compute", SimTask(f"AT1.{blk}", "compute", at_s, "fwd", blk, 1))
        g.add("compute", SimTask(f"MoE{blk}", "taskflow", plans["forward"].makespan, "fwd", blk))
    g.add("compute", SimTask("head1", "compute", profile.compute_s(model.head_flops(T)), "fwd"))
    g.add("compute", SimTask("head1", "compute", 2 * profile.compute_s(model.head_flops(T)), "bwd"))
    for blk in range(model.layers, 0, -1):
        g.add("compute", SimTask(f"MoE{blk}", "taskflow", plans["backward"].makespan, "bwd", blk))
        last = g.add("compute", SimTask(f"AT1.{blk}", "compute", 2 * at_s, "bwd", blk, 1))
    grad = model.layers * model.replicated_params_per_block() + model.outer_params()
    nbytes = grad * model.param_bytes
    ar = g.add("net", SimTask("AR1", "allreduce", ring_all_reduce_s(link, nbytes), "bwd", 0, 0,
                              nbytes), last)  # fmt: skip
    g.add("compute", SimTask("optimizer", "optimizer", profile.task_overhead_s), ar)
    return g, plans
