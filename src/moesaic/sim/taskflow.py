"""The ``taskflow`` strategy's step: each MoE layer runs its compiled plans (HyperParallel-MoE
tiles on a matrix and a vector queue, one-sided puts), the rest as in ``vanilla``.

The task definitions are the compiler's own: ``compile_world(ShapeBucket(...), direction)`` for
every rank, simulated by ``taskflow.validate.simulate`` (the same event engine, whole world:
puts bump their target ranks' counters) with costs from the profile and the cluster instead of
the nominal ones the plan drawing uses:

* every tile handles its valid rows only (:func:`valid_rows`, uniform routing: each slot of
  the bucket holds ``T K / E`` rows; padding costs nothing, an empty put sends nothing);
* GMM tiles: ``2 x rows x H x F`` FLOPs (twice that for SwiGLU's gate-and-up GMMs and their
  gradients) at ``flops_per_s``;
* elementwise and reduction tiles: their elements (:func:`tile_elements`) x the profile's
  measured ``tile_elem_cpu_s`` (memory-bound torch calls; puts pay it for their row copies
  too), or, when it is 0 (not measured), ``10`` FLOPs per element at ``flops_per_s``;
* puts: the rows' bytes from this rank to the destination as one message
  (:func:`moesaic.sim.collectives.p2p_s`), at the all-to-all's measured share of the links at
  the layer's exchange (``T K H`` bytes per rank): a layer's puts are its dispatch and combine
  cut into tiles, every rank sending and receiving at once; a put to itself is a copy and
  costs no network time;
* every tile: ``task_overhead_s / OPS_PER_TASK`` (one launch, where a pipeline stage has ~30)
  plus the profile's ``tile_cpu_s`` (the runtime's own per-task cost);
* every remote put: the profile's ``put_cpu_s`` + ``put_cpu_per_byte_s`` x its bytes of CPU
  on its queue, before the wire time.

**CPU.** A rank's CPU time in a plan is its tiles' and puts' costs but the wire time
(:attr:`LayerPlan.cpu_s`); the step's (:func:`step_cpu_s`) adds the attention, head and
optimizer. When the profile knows the cores per rank (``Profile.cores_per_rank``) the
strategy's iteration is at least the step's CPU time over them (``simulate``).

The layer's forward (backward) plan runs between the attention forward (backward) stages; its
tiles appear in the timeline ("compute" for matrix and elementwise tiles, "a2a" for puts).
Whole-world compilation is O(P) plans: this strategy is for worlds of up to ``MAX_RANKS``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from moesaic.sim.collectives import LinkModel, all_reduce_s, p2p_s
from moesaic.sim.graph import SimGraph, SimTask
from moesaic.sim.model import ModelSpec
from moesaic.sim.profile import OPS_PER_TASK, Profile
from moesaic.taskflow.tasks import Region, TaskDescriptor
from moesaic.trace import Span

if TYPE_CHECKING:
    from moesaic.taskflow.bucket import ShapeBucket

__all__ = [
    "MAX_RANKS",
    "LayerPlan",
    "build_taskflow",
    "default_tiles",
    "layer_plan",
    "model_bucket",
    "step_cpu_s",
    "tile_elements",
    "valid_rows",
]

MAX_RANKS = 64


class LayerPlan:
    """One direction's simulated plan: its makespan, its tiles' spans (from time 0) and rank
    0's CPU seconds (every task's cost but the puts' wire time)."""

    def __init__(self, makespan: float, spans: list[Span], cpu_s: float = 0.0):
        self.makespan = makespan
        self.spans = spans
        self.cpu_s = cpu_s


def valid_rows(region: Region, slot_rows: int, load: float) -> float:
    """Rows of ``region`` a handler touches when every slot holds ``load`` valid rows: all of a
    token-layout buffer (``*_TH``, ``*_TK``), else each slot's first ``load`` rows (the count
    rule of ``taskflow.runtime.sequential.StepRows.segments``)."""
    if region.buffer.endswith(("_TH", "_TK")):
        return float(region.rows)
    total = 0.0
    for k in range(region.start // slot_rows, (region.stop - 1) // slot_rows + 1):
        a, z = max(region.start, k * slot_rows), min(region.stop, (k + 1) * slot_rows)
        total += max(0.0, min(z - a, load - (a - k * slot_rows)))
    return total


def tile_elements(t: TaskDescriptor, model: ModelSpec, slot_rows: int, load: float) -> float:
    """Elements a non-GMM task's handler touches when every slot holds ``load`` valid rows: a
    put's valid rows (its outputs) x H; an elementwise or reduction tile's share of its
    region's valid rows x its width (F for activations, else H). 0 for GMM tiles."""
    from moesaic.taskflow.moe_graphs import TASK_TYPES

    kind = TASK_TYPES[t.task_type]
    if kind.put:
        return sum(valid_rows(r, slot_rows, load) for r in t.outputs) * model.hidden
    if kind.cost_class == "gmm":
        return 0.0
    region = t.outputs[0] if kind.cost_class == "reduce" else t.inputs[0]
    m = t.split_value * valid_rows(region, slot_rows, load) / region.rows
    return m * (model.ffn_hidden if kind.cost_class == "act" else model.hidden)


def default_tiles(
    model: ModelSpec, tile_m: int | None = None, slot_rows: int | None = None
) -> tuple[int, int]:
    """``(tile_m, slot_rows)`` of the model's bucket: ``tile_m`` defaults to the mean rows per
    (rank, expert) as a power of two, at most 128 (the runtime's default); the slot
    holds the mean load rounded as the runtime rounds (``slot_rows_for``). Given values are
    kept (a slot must be a multiple of the tile)."""
    from moesaic.taskflow.bucket import slot_rows_for

    rows = model.tokens * model.top_k
    if tile_m is None:
        tile_m = min(128, 1 << max(rows // model.experts - 1, 0).bit_length())
    if slot_rows is None:
        slot_rows = slot_rows_for(math.ceil(rows / model.experts), tile_m)
    if slot_rows % tile_m:
        raise ValueError(
            f"taskflow_slot_rows ({slot_rows}) must be a multiple of taskflow_tile_m ({tile_m})"
        )
    return tile_m, slot_rows


def model_bucket(model: ModelSpec, *, ep_size: int, slot_rows: int, tile_m: int) -> ShapeBucket:
    """The compiler's shape bucket of ``model``'s MoE layer on ``ep_size`` ranks."""
    from moesaic.taskflow.bucket import ShapeBucket

    return ShapeBucket(
        tokens=model.tokens,
        hidden=model.hidden,
        ffn=model.ffn_hidden,
        experts=model.experts,
        top_k=model.top_k,
        ep_size=ep_size,
        slot_rows=slot_rows,
        tile_m=tile_m,
        activation=model.activation,
    )


def layer_plan(
    model: ModelSpec,
    link: LinkModel,
    profile: Profile,
    direction: str,
    *,
    tile_m: int | None = None,
    slot_rows: int | None = None,
    pipeline: bool = False,
) -> LayerPlan:
    """Compiles and simulates one MoE layer's ``direction`` plans on every rank; rank 0's tiles.

    ``tile_m``, ``slot_rows``: the bucket's (:func:`default_tiles`); ``pipeline``: the
    list-scheduled queue order (``CompileOptions.pipeline``) instead of kernel order.
    """
    from moesaic.taskflow.bucket import CompileOptions
    from moesaic.taskflow.compile import compile_world
    from moesaic.taskflow.moe_graphs import TASK_TYPES
    from moesaic.taskflow.validate import simulate

    P = link.world_size
    if P > MAX_RANKS:
        raise ValueError(f"the taskflow strategy simulates worlds of <= {MAX_RANKS} ranks, got {P}")
    T, H, F = model.tokens, model.hidden, model.ffn_hidden
    tile_m, slot = default_tiles(model, tile_m, slot_rows)
    bucket = model_bucket(model, ep_size=P, slot_rows=slot, tile_m=tile_m)
    plans = compile_world(bucket, direction, CompileOptions(pipeline=pipeline))
    launch_s = profile.task_overhead_s / OPS_PER_TASK
    swiglu = model.activation == "swiglu"

    load = T * model.top_k / model.experts  # valid rows of every slot (uniform routing)

    launch_s += profile.tile_cpu_s
    elem_s = profile.tile_elem_cpu_s

    def ends(t: TaskDescriptor) -> tuple[int, int]:
        """A put's source and destination ranks."""
        dst = t.peer if t.peer >= 0 else t.outputs[0].rank
        return (t.inputs[0].rank if t.inputs else dst), dst

    def put_bytes(t: TaskDescriptor) -> float:
        """Bytes a put sends over the network (0 when empty or to itself)."""
        src, dst = ends(t)
        return tile_elements(t, model, slot, load) * model.act_bytes if src != dst else 0.0

    # The puts of a layer are its dispatch (or combine) exchange cut into tiles: every rank
    # sends and receives at once, as in an all-to-all of T K H bytes per rank, so their bytes
    # run at the all-to-all's measured share of the links (1.0 when none was measured).
    share = link.share("all_to_all", T * model.top_k * H * model.act_bytes)

    def wire(t: TaskDescriptor) -> float:
        """A put's network seconds (0 for every other task and for empty or self puts)."""
        nbytes = put_bytes(t)
        return p2p_s(link, *ends(t), nbytes / share) if nbytes else 0.0

    def cost(t: TaskDescriptor) -> float:
        kind = TASK_TYPES[t.task_type]
        if kind.cost_class == "gmm" and not kind.put:
            # Handlers compute on the valid rows only: the tile's share of them.
            m = t.split_value * valid_rows(t.inputs[0], slot, load) / t.inputs[0].rows
            wide = swiglu and ("gate" in t.task_type or "w1" in t.task_type)
            return launch_s + 2.0 * m * H * F * (2 if wide else 1) / profile.flops_per_s
        elems = tile_elements(t, model, slot, load)
        # measured memory-bound handler CPU per element, else 10 FLOPs per element (puts: none)
        handler = (
            elems * elem_s if elem_s else (0.0 if kind.put else 10.0 * elems / profile.flops_per_s)
        )
        if kind.put:
            nbytes = put_bytes(t)  # 0: signalled locally or a copy (runtime/concurrent.py)
            if nbytes == 0:
                return launch_s + handler
            cpu = profile.put_cpu_s + nbytes * profile.put_cpu_per_byte_s
            return launch_s + handler + cpu + wire(t)
        return launch_s + handler

    tl = simulate(plans, world=True, cost=cost)
    plan = plans[0]
    cpu_s = math.fsum(
        cost(t) - (wire(t) if TASK_TYPES[t.task_type].put else 0.0) for t in plan.tasks
    )
    spans = []
    for t in plan.tasks:
        kind = TASK_TYPES[t.task_type]
        spans.append(
            Span(
                rank=0,
                resource="a2a" if kind.put else "compute",
                name=t.op,
                start=tl.start[(0, t.uid)],
                end=tl.end[(0, t.uid)],
                args={"tile": t.task_index},
            )
        )
    return LayerPlan(tl.makespan, spans, cpu_s)


def step_cpu_s(model: ModelSpec, profile: Profile, plans: dict[str, LayerPlan]) -> float:
    """A rank's CPU seconds in one taskflow step: every block's attention (forward and twice
    that backward) and its layer's plans, the head and the optimizer; none of the wire time."""
    T = model.tokens
    at_s = profile.compute_s(model.attention_flops(T))
    head_s = 0.0 if model.layer_only else profile.compute_s(model.head_flops(T))
    grad = model.layers * model.replicated_params_per_block() + model.outer_params()
    optimizer_s = profile.task_overhead_s if grad * model.param_bytes else 0.0
    per_block = 3 * at_s + plans["forward"].cpu_s + plans["backward"].cpu_s
    return model.layers * per_block + 3 * head_s + optimizer_s


def build_taskflow(
    model: ModelSpec,
    link: LinkModel,
    profile: Profile,
    *,
    tile_m: int | None = None,
    slot_rows: int | None = None,
    pipeline: bool = False,
) -> tuple[SimGraph, dict[str, LayerPlan]]:
    """The step's graph: per block ``AT`` then the layer's plan (one task standing for it,
    expanded into its tiles afterwards), the head, the backward in reverse, one all-reduce of the
    replicated gradients and the optimizer (neither for a ``layer_only`` model). The plan's
    knobs are :func:`layer_plan`'s."""
    knobs = {"tile_m": tile_m, "slot_rows": slot_rows}
    plans = {
        d: layer_plan(model, link, profile, d, pipeline=pipeline, **knobs)
        for d in ("forward", "backward")
    }
    T = model.tokens
    at_s = profile.compute_s(model.attention_flops(T))
    g = SimGraph()
    for blk in range(1, model.layers + 1):
        g.add("compute", SimTask(f"AT1.{blk}", "compute", at_s, "fwd", blk, 1))
        g.add("compute", SimTask(f"MoE{blk}", "taskflow", plans["forward"].makespan, "fwd", blk))
    head_s = 0.0 if model.layer_only else profile.compute_s(model.head_flops(T))
    g.add("compute", SimTask("head1", "compute", head_s, "fwd"))
    g.add("compute", SimTask("head1", "compute", 2 * head_s, "bwd"))
    for blk in range(model.layers, 0, -1):
        g.add("compute", SimTask(f"MoE{blk}", "taskflow", plans["backward"].makespan, "bwd", blk))
        last = g.add("compute", SimTask(f"AT1.{blk}", "compute", 2 * at_s, "bwd", blk, 1))
    grad = model.layers * model.replicated_params_per_block() + model.outer_params()
    nbytes = grad * model.param_bytes
    if nbytes == 0:  # layer_only: no replicated gradient, no optimizer step
        return g, plans
    ar = g.add(
        "net", SimTask("AR1", "allreduce", all_reduce_s(link, nbytes), "bwd", 0, 0, nbytes), last
    )
    g.add("compute", SimTask("optimizer", "optimizer", profile.task_overhead_s), ar)
    return g, plans
