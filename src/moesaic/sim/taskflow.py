"""The ``taskflow`` strategy's step: each MoE layer runs its compiled plans (HyperParallel-MoE
tiles on a matrix and a vector queue, one-sided puts), the rest as in ``vanilla``.

The task definitions are the compiler's own: ``compile_world(ShapeBucket(...), direction)`` for
every rank, simulated by ``taskflow.validate.simulate`` (the same event engine, whole world:
puts bump their target ranks' counters) with costs from the profile and the cluster instead of
the nominal ones the plan drawing uses:

* every tile handles its valid rows only (:func:`valid_rows`; padding costs nothing, an empty
  put sends nothing) under the model's routing (:func:`layer_loads`: its ``measured_loads``,
  which ``simulate`` takes from the profile's ``routing``, else Zipf / uniform: each slot of
  (expert, source rank) holds ``T K`` x the expert's share), layer by layer;
* the bucket is the runtime's (:func:`default_tiles`): its default tile (128 rows) and slots
  holding the busiest (source rank, expert) slot's rows, rounded to a power-of-two number of
  tiles, as ``TaskflowRuntime.bucket`` agrees on it. Under skewed routing that multiplies the
  tiles (most of them empty, each still a task with its CPU) and one rank computes the hot
  experts' rows: in the routing measured on the unseen configurations (``benchmarks/
  sim_unseen.py``) the hottest expert takes 17-47% of a layer's rows, so slots of 256-2048
  rows where uniform routing gives 128-1024;
* the forward's copies of its receive-window buffers (:data:`SAVED_WINDOW`, whole buckets,
  :func:`saved_window_elements`) at the profile's ``copy_elem_cpu_s`` (``measure.cpucal``, measured
  by ``calibrate --model``; 0, not priced, in profiles without it);
* GMM tiles: ``2 x rows x H x F`` FLOPs (twice that for SwiGLU's gate-and-up GMMs and their
  gradients) at the experts' measured FLOP rate in that direction when the profile has the
  model's operations (``profile.ops``: the rank's grouped expert GEMMs at their shapes, per
  row, :func:`gmm_flops_per_s`), else at ``flops_per_s``;
* elementwise and reduction tiles: their elements (:func:`tile_elements`) x the profile's
  measured ``tile_elem_cpu_s`` (memory-bound torch calls; puts pay it for their row copies
  too), or, when it is 0 (not measured), ``10`` FLOPs per element at ``flops_per_s``;
* puts: the rows' bytes from this rank to the destination as one message
  (:func:`moesaic.sim.collectives.p2p_s`), at the all-to-all's measured share of the links at
  the layer's exchange (``T K H`` bytes per rank): a layer's puts are its dispatch and combine
  cut into tiles, every rank sending and receiving at once; a put to itself is a copy and
  costs no network time. A remote put pays ``PUT_LATENCIES`` one-way latencies of its path,
  not one: ``PutChannel`` sends a header and then the payload, gloo sends each message only
  once the receiver has posted its receive (a ready notice and the data: a round trip), and
  the receiving thread posts the payload's receive after the header arrived;
* every tile: ``task_overhead_s / OPS_PER_TASK`` (one launch, where a pipeline stage has ~30)
  plus the profile's ``tile_cpu_s`` (the runtime's own per-task cost);
* every remote put: the profile's ``put_cpu_s`` + ``put_cpu_per_byte_s`` x its bytes of CPU
  on its queue, before the wire time.

The rest of the step (:func:`host_prices`): with ``profile.ops`` each block's attention stage
and the layer's host work (router, routing plan: the ``moe_local`` fit, which also holds a
dropless layer's permute and combine, so it slightly over-prices taskflow's, whose
permute and combine are tiles), the head and AdamW over the rank's parameters are priced from
their measurements as in the other strategies; without, at ``flops_per_s`` (backward twice the
forward) and an optimizer of one task's overhead.

**CPU.** A rank's CPU time in a plan is its tiles' and puts' costs but the wire time
(:attr:`LayerPlan.cpu_s`); the step's (:func:`step_cpu_s`) adds the attention, head and
optimizer. Where more ranks than cores share a machine, every CPU cost in the timeline is
stretched by :func:`cpu_slowdown` (what the contention model of the other strategies,
:mod:`moesaic.sim.contention`, charges their compute with no communication in flight). When the profile knows the cores per rank (``Profile.cores_per_rank``) the
strategy's iteration is at least the step's CPU time over them (``simulate``).

The layer's forward (backward) plan runs between the attention forward (backward) stages; its
tiles appear in the timeline ("compute" for matrix and elementwise tiles, "a2a" for puts).
On a GPU profile a SwiGLU layer's plans are priced as the persistent kernel runs them (one
launch, tiles at the GPU's rates: :mod:`moesaic.sim.persistent_price`); all of the above is
the host runtimes' pricing (CPU profiles, GELU experts).
Whole-world compilation is O(P) plans: this strategy is for worlds of up to ``MAX_RANKS``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

from moesaic.sim.collectives import LinkModel, all_reduce_s, p2p_s
from moesaic.sim.graph import SimGraph, SimTask
from moesaic.sim.model import ModelSpec, layer_shares
from moesaic.sim.persistent_price import kernel_price, kernel_priced
from moesaic.sim.profile import OPS_PER_TASK, Profile
from moesaic.sim.steptail import add_tail, control_bytes
from moesaic.taskflow.tasks import Region, TaskDescriptor
from moesaic.trace import Span

if TYPE_CHECKING:
    from moesaic.taskflow.bucket import ShapeBucket
    from moesaic.taskflow.plan import Plan

__all__ = [
    "MAX_RANKS",
    "HostPrices",
    "LayerPlan",
    "block_plan",
    "build_taskflow",
    "cpu_slowdown",
    "default_tiles",
    "gmm_flops_per_s",
    "host_prices",
    "layer_plan",
    "model_bucket",
    "step_cpu_s",
    "tile_elements",
    "valid_rows",
]

MAX_RANKS = 64
# One-way latencies a remote put takes on its path (module docstring): two messages, each a
# round trip. Measured on an emulated pair at 1.5 ms one way: 6.5-7.2 ms per put in a stream of
# 20 puts of 256 B or 24 KB (4.3-4.8 latencies, the rest its CPU).
PUT_LATENCIES = 4


class LayerPlan:
    """One direction's simulated plan: its makespan, rank 0's tiles' spans (from time 0) and
    the busiest rank's CPU seconds (every task's cost but the puts' wire time)."""

    def __init__(self, makespan: float, spans: list[Span], cpu_s: float = 0.0):
        self.makespan = makespan
        self.spans = spans
        self.cpu_s = cpu_s


class HostPrices(NamedTuple):
    """Seconds of a taskflow step's tasks outside its layer plans (one block's attention
    stage, the head, forward and backward; the optimizer step) and its GMM tiles' FLOP rates
    by direction (:func:`host_prices`)."""

    at_fwd_s: float
    at_bwd_s: float
    head_fwd_s: float
    head_bwd_s: float
    optimizer_s: float
    gmm_flops_per_s: dict[str, float]


def gmm_flops_per_s(model: ModelSpec, profile: Profile, direction: str) -> float:
    """FLOPs per second of ``direction``'s GMM tiles: the rate of the model's measured expert
    GEMMs (``profile.ops``: per routed row, a whole expert's forward is ``expert_flops(1)``,
    its backward twice that), else the profile's ``flops_per_s``."""
    if profile.ops is None:
        return profile.flops_per_s
    from moesaic.sim.opcal import OpPrices

    prices = OpPrices(profile.ops, model)
    backward = direction == "backward"
    per_row = (prices.bwd if backward else prices.fwd)["experts"].per_unit_s
    flops = model.expert_flops(1) * (2.0 if backward else 1.0)
    return flops / per_row if per_row > 0 else profile.flops_per_s


def cpu_slowdown(profile: Profile) -> float:
    """How much longer a rank's CPU work takes when the machine's cores are shared by more
    ranks than it has cores (``Profile.cores_per_rank`` < 1): one torch thread per rank (the
    training default there) gets ``cores_per_rank`` of a core; 1 when not modelled."""
    cores = profile.cores_per_rank
    return 1.0 if cores is None else max(1.0, 1.0 / cores)


def host_prices(model: ModelSpec, profile: Profile, world: int) -> HostPrices:
    """The step's tasks outside its layer plans on a world of ``world`` ranks (the module
    docstring says how each is priced)."""
    T = model.tokens
    rates = {d: gmm_flops_per_s(model, profile, d) for d in ("forward", "backward")}
    grads = model.layers * model.replicated_params_per_block() + model.outer_params()
    if profile.ops is None:
        at_s = profile.stage_s(model, T)
        head_s = 0.0 if model.layer_only else profile.compute_s(model.head_flops(T))
        optimizer_s = profile.task_overhead_s if grads * model.param_bytes else 0.0
        return HostPrices(at_s, 2 * at_s, head_s, 2 * head_s, optimizer_s, rates)
    from moesaic.sim.opcal import OpPrices

    prices = OpPrices(profile.ops, model)
    params = grads + model.layers * model.experts // world * model.mats * model.hidden * (
        model.ffn_hidden
    )
    optimizer_s = 0.0 if model.layer_only else prices.optimizer_s(params * model.param_bytes)
    return HostPrices(
        prices.stage_s(T),
        prices.stage_s(T, backward=True),
        prices.head_s(T),
        prices.head_s(T, backward=True),
        optimizer_s,
        rates,
    )


# The forward's buffers that live in the receive window and that the backward reads, so the
# step keeps them as copies: ``taskflow.runtime.sequential.SAVED`` that are
# ``taskflow.runtime.concurrent.RECEIVE_BUFFERS`` (named here without importing torch; tested).
SAVED_WINDOW = frozenset({"x_recv", "y_ret"})
# Buffers in the return layout (one slot per global expert, on the sender):
# ``taskflow.runtime.handlers.RETURN_LAYOUT`` (kept here without importing torch; tested equal).
RETURN_LAYOUT = frozenset({"y_ret", "dx_ret"})


class SlotLoads:
    """Valid rows of every bucket slot when each rank sends ``rows_E[x]`` rows to expert ``x``
    (experts in placement order, ``local`` per rank, ``ranks`` ranks): the count rule of
    ``taskflow.runtime.sequential.StepRows.count``, every source rank routing alike. A slot of a
    receive-layout buffer on rank ``r`` is (local expert ``j``, source ``s``), ``slot = j P +
    s``, and holds ``rows_E[r e + j]``; a return-layout slot is the global expert itself."""

    def __init__(self, rows_E: list[float], local: int, ranks: int) -> None:
        self.rows_E, self.local, self.ranks = list(rows_E), local, ranks

    def __call__(self, buffer: str, rank: int, slot: int) -> float:
        if buffer in RETURN_LAYOUT:
            return self.rows_E[slot]
        return self.rows_E[rank * self.local + slot // self.ranks]

    @property
    def worst(self) -> float:
        """The most rows one (source rank, expert) slot holds (what the runtime's bucket
        all-reduce agrees on, ``TaskflowRuntime.bucket``)."""
        return max(self.rows_E)


def valid_rows(region: Region, slot_rows: int, load: float | SlotLoads) -> float:
    """Rows of ``region`` a handler touches when every slot holds ``load`` valid rows (a number,
    or per slot: :class:`SlotLoads`): all of a token-layout buffer (``*_TH``, ``*_TK``), else
    each slot's first valid rows (the count rule of
    ``taskflow.runtime.sequential.StepRows.segments``)."""
    if region.buffer.endswith(("_TH", "_TK")):
        return float(region.rows)
    total = 0.0
    for k in range(region.start // slot_rows, (region.stop - 1) // slot_rows + 1):
        a, z = max(region.start, k * slot_rows), min(region.stop, (k + 1) * slot_rows)
        n = load(region.buffer, region.rank, k) if callable(load) else load
        total += max(0.0, min(z - a, n - (a - k * slot_rows)))
    return total


def tile_elements(
    t: TaskDescriptor, model: ModelSpec, slot_rows: int, load: float | SlotLoads
) -> float:
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
    model: ModelSpec,
    tile_m: int | None = None,
    slot_rows: int | None = None,
    load: SlotLoads | None = None,
) -> tuple[int, int]:
    """``(tile_m, slot_rows)`` of the model's bucket as ``moesaic train`` runs it: ``tile_m``
    defaults to the runtime's (``TaskflowOptions.tile_m``, 128); the slot holds the most rows
    of any (source rank, expert) slot, ``load.worst`` (uniform routing without ``load``: the
    mean), rounded as the runtime's bucket rounds it (``slot_rows_for``: a power-of-two number
    of tiles). Given values are kept (a slot must be a multiple of the tile)."""
    from moesaic.strategies.taskflow_options import TaskflowOptions
    from moesaic.taskflow.bucket import slot_rows_for

    rows = model.tokens * model.top_k
    if tile_m is None:
        tile_m = TaskflowOptions().tile_m
    if slot_rows is None:
        worst = load.worst if load is not None else rows / model.experts
        slot_rows = slot_rows_for(math.ceil(worst - 1e-9), tile_m)
    if slot_rows % tile_m:
        raise ValueError(
            f"taskflow_slot_rows ({slot_rows}) must be a multiple of taskflow_tile_m ({tile_m})"
        )
    return tile_m, slot_rows


def layer_loads(model: ModelSpec, ranks: int) -> list[SlotLoads]:
    """Each MoE layer's routed rows per (source rank, expert) on ``ranks`` ranks, as the
    simulator's other strategies price routing (``sim.model.expert_shares``, one layer at a
    time, in placement order): the model's ``measured_loads`` (a run's, or the profile's
    ``routing`` that ``simulate`` puts there), each layer normalised, else Zipf
    (``routing_skew``; uniform at 0); a capacity caps every expert at ``cf / E`` of the rows.
    One entry per row of loads (a single one stands for every layer)."""
    E = model.experts
    if E % ranks:
        raise ValueError(f"model.experts ({E}) must be a multiple of the ranks ({ranks})")
    routed = model.tokens * model.top_k
    return [SlotLoads([routed * x for x in row], E // ranks, ranks) for row in layer_shares(model)]


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
    load: SlotLoads | None = None,
) -> LayerPlan:
    """Compiles and simulates one MoE layer's ``direction`` plans on every rank; rank 0's tiles.

    ``tile_m``, ``slot_rows``: the bucket's (:func:`default_tiles`); ``pipeline``: the
    list-scheduled queue order (``CompileOptions.pipeline``) instead of kernel order;
    ``load``: the layer's routed rows per slot (:func:`layer_loads`; None: the model's first
    layer), which also size the default bucket.
    """
    from moesaic.taskflow.bucket import CompileOptions
    from moesaic.taskflow.compile import compile_world
    from moesaic.taskflow.moe_graphs import TASK_TYPES
    from moesaic.taskflow.validate import simulate

    P = link.world_size
    if P > MAX_RANKS:
        raise ValueError(f"the taskflow strategy simulates worlds of <= {MAX_RANKS} ranks, got {P}")
    T, H, F = model.tokens, model.hidden, model.ffn_hidden
    if load is None:
        load = layer_loads(model, P)[0]
    tile_m, slot = default_tiles(model, tile_m, slot_rows, load)
    bucket = model_bucket(model, ep_size=P, slot_rows=slot, tile_m=tile_m)
    plans = compile_world(bucket, direction, CompileOptions(pipeline=pipeline))
    if kernel_priced(model, profile):  # on CUDA the persistent kernel runs the plans
        k = kernel_price(plans, model, link, profile, load.rows_E, saved_window_elements(plans[0]))
        return LayerPlan(k.makespan, k.spans, k.cpu_s)
    launch_s = profile.task_overhead_s / OPS_PER_TASK
    swiglu = model.activation == "swiglu"

    launch_s += profile.tile_cpu_s
    elem_s = profile.tile_elem_cpu_s
    gmm_rate = gmm_flops_per_s(model, profile, direction)

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
        if not nbytes:
            return 0.0
        src, dst = ends(t)
        rounds = (PUT_LATENCIES - 1) * max(link.spec.path(src, dst).latency_ms * 1e-3, link.floor_s)
        return p2p_s(link, src, dst, nbytes / share) + rounds

    slow = cpu_slowdown(profile)

    def cost(t: TaskDescriptor) -> float:
        return slow * cpu_cost(t) + (wire(t) if TASK_TYPES[t.task_type].put else 0.0)

    def cpu_cost(t: TaskDescriptor) -> float:
        """A task's CPU seconds on cores of its own (a put's: without its wire time)."""
        kind = TASK_TYPES[t.task_type]
        if kind.cost_class == "gmm" and not kind.put:
            # Handlers compute on the valid rows only: the tile's share of them.
            m = t.split_value * valid_rows(t.inputs[0], slot, load) / t.inputs[0].rows
            wide = swiglu and ("gate" in t.task_type or "w1" in t.task_type)
            return launch_s + 2.0 * m * H * F * (2 if wide else 1) / gmm_rate
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
            return launch_s + handler + cpu
        return launch_s + handler

    tl = simulate(plans, world=True, cost=cost)
    plan = plans[0]
    # the busiest rank's CPU (skewed routing loads one rank more than the others)
    cpu_s = max(math.fsum(cpu_cost(t) for t in p.tasks) for p in plans)
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
    # The forward keeps its receive-window buffers for the backward as copies, whole buckets
    # (padding rows too), after the plan ran (``TaskflowRuntime.forward``): every rank at once.
    copy_s = saved_window_elements(plan) * profile.copy_elem_cpu_s
    return LayerPlan(tl.makespan + slow * copy_s, spans, cpu_s + copy_s)


def saved_window_elements(plan: Plan) -> int:
    """Elements a forward plan's step copies after it ran: its receive-window buffers that the
    backward reads (:data:`SAVED_WINDOW`), each whole (``slot_rows`` per slot whatever the
    routing); 0 for a backward plan."""
    if plan.direction != "forward":
        return 0
    return sum(
        spec.rows * spec.cols
        for spec in plan.buffers
        if spec.name in SAVED_WINDOW and spec.kind != "input"
    )


def block_plan(plans: dict[str, LayerPlan], direction: str, block: Any) -> LayerPlan:
    """Block ``block``'s ``direction`` plan in :func:`build_taskflow`'s ``plans``: its own
    (``"forward.<block>"``) where the layers' routing differs, else the one for every block."""
    return plans.get(f"{direction}.{block}", plans[direction])


def step_cpu_s(
    model: ModelSpec, profile: Profile, plans: dict[str, LayerPlan], world: int = 1
) -> float:
    """A rank's CPU seconds in one taskflow step on ``world`` ranks: every block's attention
    stage (forward and backward) and its layer's plans (``plans["forward.<block>"]`` where
    the layers' routing differs, else ``plans["forward"]`` for every block), the head and the
    optimizer (:func:`host_prices`); none of the wire time."""
    p = host_prices(model, profile, world)
    layers = math.fsum(
        block_plan(plans, d, blk).cpu_s
        for blk in range(1, model.layers + 1)
        for d in ("forward", "backward")
    )
    host = model.layers * (p.at_fwd_s + p.at_bwd_s) + p.head_fwd_s + p.head_bwd_s + p.optimizer_s
    return host + layers


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
    knobs are :func:`layer_plan`'s; each block's plans run its own routing
    (:func:`layer_loads`: its bucket and valid rows) where the model's loads differ by layer,
    returned as ``"forward.<block>"`` and ``"backward.<block>"`` besides ``"forward"`` and
    ``"backward"`` (block 1's, which the timeline draws for every block)."""
    knobs = {"tile_m": tile_m, "slot_rows": slot_rows}
    loads = layer_loads(model, link.world_size)
    by_row = [
        {
            d: layer_plan(model, link, profile, d, pipeline=pipeline, load=load, **knobs)
            for d in ("forward", "backward")
        }
        for load in loads[: model.layers]
    ]
    plans = dict(by_row[0])
    if len(by_row) > 1:
        for blk in range(1, model.layers + 1):
            for d in ("forward", "backward"):
                plans[f"{d}.{blk}"] = by_row[(blk - 1) % len(by_row)][d]

    p = host_prices(model, profile, link.world_size)
    slow = cpu_slowdown(profile)
    p = p._replace(
        at_fwd_s=slow * p.at_fwd_s,
        at_bwd_s=slow * p.at_bwd_s,
        head_fwd_s=slow * p.head_fwd_s,
        head_bwd_s=slow * p.head_bwd_s,
        optimizer_s=slow * p.optimizer_s,
    )
    g = SimGraph()
    for blk in range(1, model.layers + 1):
        g.add("compute", SimTask(f"AT1.{blk}", "compute", p.at_fwd_s, "fwd", blk, 1))
        moe_s = block_plan(plans, "forward", blk).makespan
        g.add("compute", SimTask(f"MoE{blk}", "taskflow", moe_s, "fwd", blk))
    g.add("compute", SimTask("head1", "compute", p.head_fwd_s, "fwd"))
    g.add("compute", SimTask("head1", "compute", p.head_bwd_s, "bwd"))
    for blk in range(model.layers, 0, -1):
        moe_s = block_plan(plans, "backward", blk).makespan
        g.add("compute", SimTask(f"MoE{blk}", "taskflow", moe_s, "bwd", blk))
        last = g.add("compute", SimTask(f"AT1.{blk}", "compute", p.at_bwd_s, "bwd", blk, 1))
    grad = model.layers * model.replicated_params_per_block() + model.outer_params()
    nbytes = grad * model.param_bytes
    if nbytes == 0:  # layer_only: no replicated gradient, no optimizer step
        return g, plans
    ar = g.add(
        "net", SimTask("AR1", "allreduce", all_reduce_s(link, nbytes), "bwd", 0, 0, nbytes), last
    )
    add_tail(g, link, "net", ar, p.optimizer_s, nbytes=control_bytes(model.layers, model.experts))
    return g, plans
