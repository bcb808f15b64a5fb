"""Simulate one training iteration of a model on a cluster: a strategy under a schedule.

The two axes are :mod:`moesaic.sim.runs`' (``STRATEGIES``: dropless, padded, hybrid, taskflow;
the schedules it prices, ``check_schedule``: vanilla, moe-only, flowmoe built in; taskflow runs
the unpipelined ones only). Which model prices a run:

* dropless, padded (every schedule) and hybrid under moe-only or flowmoe: the block pipeline of
  :mod:`moesaic.sim.pipelined` (vanilla: R = 1, one all-reduce after the backward; moe-only: R
  chunks; flowmoe: R chunks, attention pipelined too, Sp-byte all-reduce chunks in the gaps),
  hybrid's exchange over its offset group with its gathers before the pipeline and its gradient
  reduce once per block (:func:`moesaic.sim.hybrid.hybrid_costs`), the domain sizes its cost
  model picks unless given (as for vanilla);
* hybrid under vanilla: a training step, as ``moesaic train`` runs it: the block pipeline at
  R = 1 with hybrid's gathers, gradient reduce and the replicated gradients' all-reduce
  (``SimOptions.hybrid_step = "training"``, the default); or HybridEP's benchmark step
  (:func:`moesaic.sim.hybrid.build_hybrid`: no data-parallel all-reduce, no head or optimizer
  per byte; ``hybrid_step = "benchmark"``, what ``benchmarks/hybridep_cluster.py`` measures);
* taskflow: each MoE layer runs its compiled tile plans (:mod:`moesaic.sim.taskflow`).

Compute is priced from the profile's per-operation measurements when it has them (the block
pipeline: :mod:`moesaic.sim.opcal`; ``details["compute_model"]``, ``"extrapolated"``), else at
its FLOP rate; with a CPU model in the profile, every run but taskflow's (which has its own CPU
floor) is re-simulated with its compute slowed by CPU contention (:mod:`moesaic.sim.contention`,
``details["contention"]``).

Outputs use :mod:`moesaic.trace` (``Span``, Chrome trace, PNG, busy time) so simulated and
measured timelines look alike.
"""

from __future__ import annotations

import csv
import dataclasses
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moesaic.checks import check_bool, check_number, check_one_of, check_positive_int
from moesaic.cluster.spec import ClusterSpec
from moesaic.schedule_table import DEFAULT_SCHEDULE
from moesaic.sim.collectives import ALL_REDUCE_ALGORITHMS, LinkModel, rate_bounded_shares
from moesaic.sim.contention import CpuModel, contend
from moesaic.sim.fsdp import (
    fsdp_traffic,
    inner_link,
    reduce_scatter_all_reduces,
    replica_reduce_s,
)
from moesaic.sim.graph import SimGraph, SimTask
from moesaic.sim.hybrid import (
    HybridParts,
    build_hybrid,
    hybrid_costs,
    hybrid_parts,
    plan_domains_fast,
)
from moesaic.sim.memory import predict_run
from moesaic.sim.model import ModelSpec
from moesaic.sim.pipelined import Costs, check_degree, run_pipelined
from moesaic.sim.profile import COLLECTIVE_REGIMES, Profile
from moesaic.sim.runs import (
    LAYER_ONLY_UNSUPPORTED,
    Run,
    check_run,
    legacy_note,
    legacy_run,
    unsupported_reason,
)
from moesaic.strategies.hybrid_options import SHARED_EXPERTS
from moesaic.taskflow.engine import Timeline
from moesaic.trace import COMM_RESOURCES, COMPUTE_RESOURCES, Span, busy_time

__all__ = [
    "SimOptions",
    "SimResult",
    "link_model",
    "simulate",
    "unsupported_reason",
    "write_layer_csv",
]


# What ``hybrid`` under ``vanilla`` simulates (``SimOptions.hybrid_step``).
HYBRID_STEPS = ("training", "benchmark")


@dataclass(kw_only=True, slots=True, frozen=True)
class SimOptions:
    """Knobs of the strategies and schedules.

    Attributes:
        degree: R, chunks of the pipelined schedules (must divide ``model.batch``); ``vanilla``
            runs one.
        sp_bytes: Sp of ``flowmoe``; None: the replicated gradients' bytes / 16.
        domain_sizes: ``hybrid``'s domains; None: chosen by its cost model (``plan_step``'s
            rule, HybridEP's step) on the tokens of one chunk under every schedule, as
            ``moesaic train --domains auto`` plans them.
        prefetch: ``hybrid`` gathers prefetched under the pre-expert compute (vanilla) or beside
            the first block's attention (pipelined schedules).
        compression_ratio: ``hybrid``'s SR compression of gathered experts (+Migration: > 1).
        shared_expert_every: the shared experts' all-reduce every this many gathers.
        shared_expert: ``hybrid``'s ``HybridOptions.shared_expert``: the groups of that
            all-reduce ("domain", "all": the offset group too, "none": none).
        taskflow_tile_m: ``taskflow``'s tile rows (``TaskflowOptions.tile_m``); None: the
            simulator's size-based default (``sim.taskflow.default_tiles``).
        taskflow_slot_rows: ``taskflow``'s bucket slot rows (rows per source rank and expert,
            a multiple of the tile); None: the mean load rounded up as the runtime rounds.
        taskflow_pipeline: ``taskflow`` plans in the list-scheduled (pipelined) queue order
            (``TaskflowOptions.pipeline``) rather than kernel order.
        all_reduce: the gradient all-reduce's algorithm (``collectives.ALL_REDUCE_ALGORITHMS``):
            ``"best"`` (default) the faster of ring and hierarchical at each size, as NCCL's
            tuner picks; ``"ring"`` what gloo runs. The same on a one-level cluster.
        dp_shard: FSDP2's degree beside EP (``--dp-shard``): EP over the world's innermost
            ranks, ``world / (dp_replicate x dp_shard)`` of them (whole levels), the experts
            sharded over the ``dp_shard`` ranks beside each, the dense part over every rank of
            a replica (1: EP is the replica); its all-gathers and reduce-scatters priced
            (:mod:`moesaic.sim.fsdp`). None: unsharded, EP the world.
        dp_replicate: replicas outside ``dp_shard x EP`` (``--dp-replicate``): with
            ``dp_shard`` HSDP, each unit's gradient shard all-reduced over the replicas after
            its reduce-scatter; without it replicas of the unsharded model (``--ep`` below the
            world: EP on the innermost ``world / dp_replicate`` ranks, the dense gradients
            all-reduced over the world and the experts' over the replicas after the backward;
            not with a schedule that reduces in the backward, nor hybrid)
            (:mod:`moesaic.sim.fsdp`).
        hybrid_step: what ``hybrid`` under ``vanilla`` is: ``"training"`` (default) a training
            step, the block pipeline at R = 1 (with the all-reduce of the replicated
            gradients); ``"benchmark"`` HybridEP's benchmark step (``sim.hybrid.build_hybrid``,
            no all-reduce), as ``benchmarks/hybridep_cluster.py`` runs it.
    """

    degree: int = 2
    sp_bytes: float | None = None
    domain_sizes: tuple[int, ...] | None = None
    prefetch: bool = False
    compression_ratio: float = 1.0
    shared_expert_every: int = 1
    shared_expert: str = "domain"
    taskflow_tile_m: int | None = None
    taskflow_slot_rows: int | None = None
    taskflow_pipeline: bool = False
    all_reduce: str = "best"
    hybrid_step: str = "training"
    dp_shard: int | None = None
    dp_replicate: int = 1

    def __post_init__(self) -> None:
        check_positive_int("degree", self.degree)
        check_number("compression_ratio", self.compression_ratio, 1.0, 1e6)
        check_positive_int("shared_expert_every", self.shared_expert_every)
        check_one_of("shared_expert", self.shared_expert, SHARED_EXPERTS)
        if self.sp_bytes is not None and not self.sp_bytes > 0:
            raise ValueError(f"sp_bytes ({self.sp_bytes}) must be > 0")
        if self.taskflow_tile_m is not None:
            check_positive_int("taskflow_tile_m", self.taskflow_tile_m)
        if self.taskflow_slot_rows is not None:
            check_positive_int("taskflow_slot_rows", self.taskflow_slot_rows)
        check_bool("taskflow_pipeline", self.taskflow_pipeline)
        check_one_of("all_reduce", self.all_reduce, ALL_REDUCE_ALGORITHMS)
        check_one_of("hybrid_step", self.hybrid_step, HYBRID_STEPS)
        if self.dp_shard is not None:
            check_positive_int("dp_shard", self.dp_shard)
        check_positive_int("dp_replicate", self.dp_replicate)


@dataclass(kw_only=True, slots=True)
class SimResult:
    """One simulated iteration (seconds) and its timeline."""

    strategy: str
    schedule: str
    ranks: int
    iteration_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    wall_s: float
    spans: list[Span]
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """``strategy+schedule``, the label of the run's outputs."""
        return Run(self.strategy, self.schedule).name

    @property
    def bound_s(self) -> float:
        """The perfect-overlap bound max(total compute, total communication)."""
        return max(self.compute_s, self.comm_s)

    @property
    def overlap_ratio(self) -> float:
        """Share of the communication hidden under compute (1 when there is none)."""
        return 1.0 - self.exposed_comm_s / self.comm_s if self.comm_s > 0 else 1.0

    def summary(self) -> dict[str, Any]:
        """The JSON fields of ``moesaic simulate --json``."""
        return {
            "name": self.name,
            "strategy": self.strategy,
            "schedule": self.schedule,
            "ranks": self.ranks,
            "iteration_ms": self.iteration_s * 1e3,
            "compute_ms": self.compute_s * 1e3,
            "comm_ms": self.comm_s * 1e3,
            "exposed_comm_ms": self.exposed_comm_s * 1e3,
            "overlap_ratio": self.overlap_ratio,
            "bound_ms": self.bound_s * 1e3,
            "wall_s": self.wall_s,
            **self.details,
        }


def _graph(
    run: Run, model: ModelSpec, link: LinkModel, profile: Profile, opts: SimOptions
) -> tuple[SimGraph, Timeline, dict[str, Any]]:
    if run.strategy == "taskflow":
        if opts.dp_shard is not None or opts.dp_replicate > 1:
            raise ValueError("dp_shard, dp_replicate: the taskflow pricing runs EP = world")
        return _taskflow(model, link, profile, opts)
    traits = run.traits  # check_run: a schedule priced by "block-pipeline"
    R = check_degree(model, opts.degree) if traits.pipelined else 1
    world = link
    replicas = opts.dp_shard is None and opts.dp_replicate > 1  # of the unsharded model
    if opts.dp_shard is not None or replicas:  # EP over the innermost levels
        outside = (opts.dp_shard or 1) * opts.dp_replicate  # divides the world: simulate
        link = inner_link(link, link.world_size // outside)
    if replicas and (run.strategy == "hybrid" or traits.reduce_in_backward):
        # hybrid's gradients are reduced inside its domains (parts.grad_reduce), a chunked
        # schedule's in the backward: neither is GradientSync's two calls after it
        raise ValueError(
            f"dp_replicate ({opts.dp_replicate}) without dp_shard with {run.name}: replicas of "
            "the unsharded model are priced where the gradients are all-reduced after the "
            "backward outside hybrid's domains"
        )
    parts = None
    if run.strategy == "hybrid":
        # planned on the tokens of one chunk, as training plans --domains auto
        chunk = dataclasses.replace(model, batch=model.batch // R)
        parts = _hybrid_parts(chunk, link, profile, opts)
    if parts is not None and not traits.pipelined and opts.hybrid_step == "benchmark":
        if opts.dp_shard is not None:
            raise ValueError("dp_shard: HybridEP's benchmark step runs no FSDP2 sharding")
        g = build_hybrid(parts, model, profile)
        return g, g.run(), {"domain_sizes": list(parts.domain_sizes)}
    if parts is not None:
        costs = hybrid_costs(link, model, profile, R, parts)
    else:
        costs = Costs(model, link, profile, R, strategy=run.strategy)
    sp = None
    if traits.reduce_in_backward and costs.grad_bytes() > 0:  # layer_only: nothing to reduce
        sp = opts.sp_bytes if opts.sp_bytes is not None else costs.grad_bytes() / 16
    if opts.dp_shard is not None:  # FSDP2 over the whole world, EP over the inner link
        if sp is not None:
            raise ValueError(
                f"dp_shard ({opts.dp_shard}) with schedule {run.schedule!r}: FSDP2 reduce-"
                "scatters each unit's gradients, a schedule that all-reduces gradient chunks "
                "in the backward does not run sharded"
            )
        prefetch = not traits.pipelined  # train/fsdp.py: off for the chunked schedules
        ep, d, r = link.world_size, opts.dp_shard, opts.dp_replicate
        traffic = fsdp_traffic(
            world,
            model,
            ep=ep,
            dp_shard=d,
            prefetch=prefetch,
            dp_replicate=r,
            all_reduce_scatter=reduce_scatter_all_reduces(profile.device),
        )
        costs.shard(traffic)
    if replicas:
        ep, r = link.world_size, opts.dp_replicate
        costs.replicate(replica_reduce_s(world, model, ep=ep, dp_replicate=r))
    overlap = traits.overlaps_attention
    early = traits.pipelined  # the pipelined steps gather their flags early
    g, tl = run_pipelined(costs, degree=R, overlap=overlap, chunk_bytes=sp, early=early)
    details: dict[str, Any] = {"degree": R, **_compute_details(profile, costs.notes)}
    if sp is not None:
        details["sp_bytes"] = sp
    if parts is not None:
        details["domain_sizes"] = list(parts.domain_sizes)
    return g, tl, details


def _compute_details(profile: Profile, notes: list[str]) -> dict[str, Any]:
    """How the run's compute was priced: ``compute_model`` ``"ops"`` (the profile's measured
    operations of ``ops_model``; ``extrapolated``: what differs from the simulated model) or
    ``"flops"`` (``flops_per_s``)."""
    if profile.ops is None:
        return {"compute_model": "flops"}
    out: dict[str, Any] = {"compute_model": "ops", "ops_model": profile.ops.model.name}
    if notes:
        out["extrapolated"] = list(notes)
    return out


def _hybrid_parts(
    model: ModelSpec, link: LinkModel, profile: Profile, opts: SimOptions
) -> HybridParts:
    """One block's HybridEP parts with ``opts.domain_sizes`` or the ones its cost model picks."""
    kw: dict[str, Any] = dict(
        prefetch=opts.prefetch,
        compression_ratio=opts.compression_ratio,
        shared_expert_every=opts.shared_expert_every,
        shared_expert=opts.shared_expert,
    )
    if opts.domain_sizes is not None:
        return hybrid_parts(link, model, opts.domain_sizes, profile.flops_per_s, **kw)
    return plan_domains_fast(link, model, profile.flops_per_s, **kw)[0]


def _taskflow(
    model: ModelSpec, link: LinkModel, profile: Profile, opts: SimOptions
) -> tuple[SimGraph, Timeline, dict[str, Any]]:
    from moesaic.sim.taskflow import build_taskflow, step_cpu_s

    g, plans = build_taskflow(
        model,
        link,
        profile,
        tile_m=opts.taskflow_tile_m,
        slot_rows=opts.taskflow_slot_rows,
        pipeline=opts.taskflow_pipeline,
    )
    cpu_s = step_cpu_s(model, profile, plans, link.world_size)
    # A rank's queues share its cores: a step takes at least its CPU time over them.
    cores = profile.cores_per_rank
    floor = 0.0 if cores is None else cpu_s / cores
    return g, g.run(), {"plans": plans, "cpu_ms": cpu_s * 1e3, "cpu_floor_ms": floor * 1e3}


def _resolve(
    spec: ClusterSpec, strategy: str, schedule: str | None, opts: SimOptions
) -> tuple[Run, SimOptions]:
    """The run and options ``simulate`` was given; an old mixed name (``runs.LEGACY_NAMES``)
    without a schedule is read as its pair, with a DeprecationWarning."""
    legacy = legacy_run(strategy, spec.num_levels) if schedule is None else None
    if legacy is None:
        return check_run(strategy, DEFAULT_SCHEDULE if schedule is None else schedule), opts
    warnings.warn(legacy_note(strategy), DeprecationWarning, stacklevel=3)
    run, domains = legacy
    if domains is not None:  # classic EP, whatever domains were given
        opts = dataclasses.replace(opts, domain_sizes=domains)
    return run, opts


def link_model(
    spec: ClusterSpec, profile: Profile, all_reduce: str = "best", regime: str | None = None
) -> LinkModel:
    """The links ``simulate`` prices ``spec`` on under ``profile``: measured levels at their
    measured rates, the profile's floor, collective shares of ``regime`` (None: the loaded ones
    where measured, held to the links' rate: :func:`_shares`) and call floors, ``all_reduce``'s
    algorithm."""
    link_spec, scale = profile.link_spec(spec)
    return LinkModel(
        spec=link_spec,
        floor_s=profile.floor_s,
        bandwidth_scale=scale,
        a2a_shares=_shares(profile, "all_to_all", regime),
        allreduce_shares=_shares(profile, "all_reduce", regime),
        all_reduce=all_reduce,
        a2a_call_s=profile.a2a_call_s,
        allreduce_call_s=profile.allreduce_call_s,
        allreduce_loaded_call_s=profile.allreduce_loaded_call_s,
        allreduce_alone_call_s=profile.allreduce_alone_call_s,
        level_shares=_level_shares(spec, profile, regime),
    )


def _level_shares(
    spec: ClusterSpec, profile: Profile, regime: str | None
) -> tuple[tuple[tuple[float, float], ...], ...]:
    """The profile's per-level exchange shares (``Profile.level_share_points``: ``regime``'s
    where measured, else the loaded ones held to the links' rate as :func:`_shares` holds
    them, else the idle ones), only for the cluster they were measured on (the profile's
    ``cluster`` with ``spec``'s levels); else none (the world's shares price those
    exchanges)."""
    if profile.cluster is None or tuple(profile.cluster.levels) != tuple(spec.levels):
        return ()
    measured = {x.regime for x in profile.level_shares}
    if regime is not None and regime in measured:
        return profile.level_share_points(regime)
    points = profile.level_share_points()
    if "loaded" in measured:
        return tuple(rate_bounded_shares(p) if p else p for p in points)
    return points


def _shares(
    profile: Profile, kind: str, regime: str | None = None
) -> tuple[tuple[float, float], ...]:
    """The profile's share points of ``kind`` as the simulation prices them: ``regime``'s as
    measured where the profile has points of it; else (or with ``regime`` None) the loaded
    regime's where it has them, held to what the links can do
    (:func:`~moesaic.sim.collectives.rate_bounded_shares`: a size timed slower than a larger
    one allows held a stall, which FlowMoE's small gradient chunks would otherwise pay as a
    rate), else the idle regime's as measured."""
    if regime is not None:
        check_one_of("regime", regime, COLLECTIVE_REGIMES)
    measured = {x.regime for x in profile.collectives if x.kind == kind}
    if regime is not None and regime in measured:
        return profile.collective_shares(kind, regime)
    points = profile.collective_shares(kind)
    if "loaded" in measured:
        return rate_bounded_shares(points)
    return points


def _idle_comm_s(
    g: SimGraph,
    run: Run,
    model: ModelSpec,
    spec: ClusterSpec,
    profile: Profile,
    opts: SimOptions,
    details: dict[str, Any],
) -> dict[str, float] | None:
    """The seconds of ``g``'s communication tasks at the idle regime's shares (by key), for
    :func:`~moesaic.sim.contention.contend` to price each between them and its loaded seconds
    by the compute beside it; None unless the profile measured both regimes (then every
    collective is priced as the one it has; a kind measured loaded only stays so). ``g`` built
    once more on the idle shares, with the domains ``g`` was planned with; a task whose bytes or
    lane differ there keeps its loaded price."""
    if {x.regime for x in profile.collectives} != {"idle", "loaded"}:
        return None
    if "domain_sizes" in details:  # the idle links must not plan other domains
        opts = dataclasses.replace(opts, domain_sizes=tuple(details["domain_sizes"]))
    link = link_model(spec, profile, opts.all_reduce, regime="idle")
    idle, _, _ = _graph(run, model, link, profile, opts)
    loaded = {t.key: t for t in g.tasks() if t.resource in COMM_RESOURCES}
    return {
        t.key: t.seconds
        for t in idle.tasks()
        if t.key in loaded
        and loaded[t.key].resource == t.resource
        and loaded[t.key].nbytes == t.nbytes
    }


def simulate(
    spec: ClusterSpec,
    model: ModelSpec,
    strategy: str,
    profile: Profile,
    options: SimOptions | None = None,
    *,
    schedule: str | None = None,
) -> SimResult:
    """Simulates one iteration of ``model`` on ``spec``: ``strategy`` under ``schedule``.

    Args:
        spec: the cluster.
        model: the model and one rank's batch.
        strategy: ``runs.STRATEGIES`` (dropless, padded, hybrid, taskflow). Deprecated: an old
            mixed name (``vanilla``, ``moe-only``, ``flowmoe``, ``ep``) with ``schedule`` None.
        profile: the machine's rates.
        options: the strategies' and schedules' knobs.
        schedule: a schedule the simulator prices (``runs.check_schedule``: vanilla,
            moe-only, flowmoe built in); None: the default (vanilla).

    Raises:
        ValueError: an unknown strategy or schedule, a pair that cannot run (taskflow under a
            pipelined schedule), or a model that does not fit the world (experts not a
            multiple of the EP ranks, R not dividing the batch), naming the field.
    """
    run, opts = _resolve(spec, strategy, schedule, options or SimOptions())
    t0 = time.perf_counter()
    outside = (opts.dp_shard or 1) * opts.dp_replicate  # EP is the rest of the world
    if spec.world_size % outside:
        raise ValueError(
            f"dp_replicate ({opts.dp_replicate}) x dp_shard ({opts.dp_shard}) must divide "
            f"the world size ({spec.world_size})"
        )
    ep = spec.world_size // outside
    if model.experts % ep:
        where = "the cluster's world_size" if ep == spec.world_size else "EP (world / replicas)"
        raise ValueError(f"model.experts ({model.experts}) must be a multiple of {where} ({ep})")
    if model.layer_only and run.strategy in LAYER_ONLY_UNSUPPORTED:
        raise ValueError(
            f"strategy {run.strategy!r} cannot simulate a model with model.layer_only: its "
            "gathers and domains are priced by planning.stepmodel, which always includes the "
            "block's attention"
        )
    profile = profile.for_model(model.act_bytes)  # a bf16 model at the bf16 matmul rate
    link = link_model(spec, profile, opts.all_reduce)
    g, tl, details = _graph(run, model, link, profile, opts)
    cpu = CpuModel.of(profile) if run.strategy != "taskflow" else None  # taskflow: its floor
    if cpu is not None:
        idle = _idle_comm_s(g, run, model, spec, profile, opts, details)
        tl, details["contention"] = contend(g, tl, cpu, idle, profile.sync_waits)
    plans = details.pop("plans", None)
    spans = [_span(t, tl) for t in g.tasks() if t.key in tl.end]
    if plans is not None:  # each layer task expanded into its plan's tiles
        spans = _expand(spans, plans)
    spans.sort(key=lambda s: (s.start, s.resource))
    details.update(memory_details(model, run, spec.world_size, details.get("domain_sizes")))
    compute = busy_time(spans, COMPUTE_RESOURCES)
    comm = busy_time(spans, COMM_RESOURCES)
    both = busy_time(spans, (*COMPUTE_RESOURCES, *COMM_RESOURCES))
    return SimResult(
        strategy=run.strategy,
        schedule=run.schedule,
        ranks=spec.world_size,
        iteration_s=max(tl.makespan, details.get("cpu_floor_ms", 0.0) * 1e-3),
        compute_s=compute,
        comm_s=comm,
        exposed_comm_s=min(max(both - compute, 0.0), comm),
        wall_s=time.perf_counter() - t0,
        spans=spans,
        details=details,
    )


def memory_details(
    model: ModelSpec, run: Run, ranks: int, domain_sizes: Sequence[int] | None
) -> dict[str, Any]:
    """``peak_bytes_per_rank``: the per-rank peak ``moesaic.sim.memory`` predicts for the
    run trained unsharded at EP = ``ranks`` (``memory_per_rank``: its parts); or
    ``memory_note``, why it is not predicted (a model a training config cannot express)."""
    try:
        pred = predict_run(model, run.strategy, run.schedule, ranks, domain_sizes=domain_sizes)
    except ValueError as exc:
        return {"memory_note": f"per-rank memory not predicted: {exc}"}
    return {"peak_bytes_per_rank": pred.peak, "memory_per_rank": pred.to_dict()}


def _span(t: SimTask, tl: Timeline) -> Span:
    fields = (("phase", t.phase), ("block", t.block), ("chunk", t.chunk), ("bytes", t.nbytes))
    args = {k: v for k, v in fields if v}
    return Span(
        rank=0,
        resource=t.resource,
        name=t.name,
        start=tl.start[t.key],
        end=tl.end[t.key],
        args=args,
    )


def _expand(spans: list[Span], plans: dict[str, Any]) -> list[Span]:
    from moesaic.sim.taskflow import block_plan

    out = []
    for s in spans:
        if s.resource != "taskflow":
            out.append(s)
            continue
        d = "forward" if s.args.get("phase") == "fwd" else "backward"
        plan = block_plan(plans, d, s.args.get("block"))
        for t in plan.spans:
            start, end = s.start + t.start, s.start + t.end
            args = {**t.args, **s.args}
            out.append(
                Span(rank=s.rank, resource=t.resource, name=t.name, start=start, end=end, args=args)
            )
    return out


def write_layer_csv(path: str | Path, spans: Sequence[Span] | Mapping[Run, Sequence[Span]]) -> Path:
    """Per run (strategy and schedule), block and phase: compute and communication busy
    milliseconds, task counts.

    ``spans`` is one timeline (its ``strategy`` and ``schedule`` columns left empty) or a
    mapping of run to timeline (``simulate --csv``: one table for every run).
    """
    by_run = dict(spans) if isinstance(spans, Mapping) else {Run("", ""): spans}
    path = Path(path)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["strategy", "schedule", "block", "phase", "compute_ms", "comm_ms", "tasks"])
        for run, timeline in by_run.items():
            for (blk, phase), row in sorted(_layer_rows(timeline).items()):
                compute, comm = f"{row['compute_ms']:.6f}", f"{row['comm_ms']:.6f}"
                w.writerow([*run, blk, phase or "-", compute, comm, int(row["tasks"])])
    return path


def _layer_rows(spans: Sequence[Span]) -> dict[tuple[int, str], dict[str, float]]:
    rows: dict[tuple[int, str], dict[str, float]] = {}
    for s in spans:
        blk = int(s.args.get("block", 0))
        key = (blk, str(s.args.get("phase", "")))
        row = rows.setdefault(key, {"compute_ms": 0.0, "comm_ms": 0.0, "tasks": 0})
        col = "compute_ms" if s.resource in COMPUTE_RESOURCES else "comm_ms"
        row[col] += s.duration * 1e3
        row["tasks"] += 1
    return rows
