"""Rank every runnable combination of strategy, schedule and knobs by its simulated step time.

:func:`plan_runs` enumerates, for a model on a cluster under a profile:

* every pair of :mod:`moesaic.sim.runs` (a strategy the simulator prices under each schedule it
  supports; taskflow vanilla only), the pairs that cannot simulate this cluster and model left
  out with their reason (``unsupported_reason``);
* the knobs of each pair (option names are those of ``moesaic train``, so that a plan entry
  becomes flags one for one: :mod:`moesaic.train.plan`):

  - ``pipeline_degree`` R: 1 under ``vanilla``; every one of ``PIPELINE_DEGREES`` that divides
    the batch under ``moe-only`` and ``flowmoe``;
  - ``ar_chunk`` Sp (``flowmoe``): the replicated gradients' bytes G over each of
    ``SP_DIVISORS``, at least ``MIN_AR_CHUNK_BYTES`` (what training accepts);
  - ``domain_sizes`` and ``compression_ratio`` (``hybrid``): for each compression ratio asked
    for, the ``DOMAIN_CANDIDATES`` best domain tuples of HybridEP's fast step model
    (:func:`moesaic.sim.hybrid.hybrid_parts`, the rule of ``plan_domains_fast``) on the tokens
    of one chunk, not the cross product of every divisor tuple; gathers prefetched, as
    training runs them;
  - ``pipeline`` (``taskflow``): its plans in kernel order and in list-scheduled order;
  - ``capacity_factor``, only for the capacity factors the caller allows
    (``capacity_factors``, ``moesaic plan --capacity-factor``): every pair again on the model
    with that capacity (the assignments past ``ceil(cf T K / E)`` per expert and source rank
    dropped, a change of the model that the planner never makes unasked); the candidates
    without the option keep the model's own capacity (dropless when it has none);

and prices each with :func:`moesaic.sim.simulate.simulate`, so that whatever the simulator learns
(its compute and link models) flows into the ranking. ``hybrid`` under ``vanilla`` is priced as
the training step it is (``SimOptions.hybrid_step = "training"``, the simulator's default: the
block pipeline at R = 1 with the all-reduce of the replicated gradients), not as HybridEP's
benchmark step.

Rank symmetry keeps the count of simulations small at any scale: each simulation prices one
representative rank (``SimGraph``) and the domain shortlist is closed-form, so the number of
simulations depends on the knobs, never on the number of ranks (:attr:`Plan.simulations`; the
1,000-datacenter example plans in well under a second). Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from moesaic.checks import check_number, check_one_of, check_positive_int
from moesaic.cluster.spec import ClusterSpec
from moesaic.schedule_table import schedule_names
from moesaic.sim.hybrid import hybrid_parts
from moesaic.sim.hybrid_costmodel import domain_size_choices
from moesaic.sim.model import ModelSpec
from moesaic.sim.prior import RoutingPrior
from moesaic.sim.profile import Profile
from moesaic.sim.runs import STRATEGIES, Run, check_schedule, runs, unsupported_reason
from moesaic.sim.simulate import SimOptions, SimResult, link_model, simulate
from moesaic.sim.uncertainty import TIE_BAND, break_ties, prediction_range, tie_group

__all__ = [
    "DOMAIN_CANDIDATES",
    "MIN_AR_CHUNK_BYTES",
    "PIPELINE_DEGREES",
    "SP_DIVISORS",
    "Candidate",
    "Plan",
    "plan_runs",
]

# R of the pipelined schedules tried (those dividing the batch): the emulated 2-rank cluster
# measured R = 2 and 4 within 3% of each other (flowmoe 1.49x and 1.45x vanilla,
# flowmoe_cluster.json); 8 for batches that chunk finer.
PIPELINE_DEGREES = (2, 4, 8)
# Sp = G / n for each n: the simulator's default n = 16 and one step either side by 4x.
SP_DIVISORS = (4, 16, 64)
# The least Sp training accepts (moesaic.train.schedule_options.MIN_AR_CHUNK_BYTES: below it
# a gloo all-reduce costs its latency whatever its size); the same number, which this
# torch-free simulator package may not import from train.
MIN_AR_CHUNK_BYTES = 4096
# Domain tuples per compression ratio and R that the simulator prices: the fast step model
# ranks every divisor tuple (64 at 1,000 DCs x 8) in milliseconds; the simulator decides among
# its best few.
DOMAIN_CANDIDATES = 3


@dataclass(frozen=True, slots=True)
class Candidate:
    """One ranked combination and its simulated step.

    Attributes:
        strategy: ``runs.STRATEGIES``.
        schedule: a schedule the simulator prices (``runs.check_schedule``).
        options: the knobs, named as ``moesaic train``'s options (``pipeline_degree``,
            ``ar_chunk``) and of the strategy's options class (``domain_sizes``,
            ``compression_ratio``; ``pipeline``).
        predicted_ms: the simulated iteration.
        bound_ms: the perfect-overlap bound max(total compute, total communication).
        compute_ms: compute busy time.
        comm_ms: communication busy time.
        caveat: why this prediction is not to be trusted with this profile (its cost model
            lacks a measured input, :func:`uncalibrated_reason`), None when it is: such a
            combination ranks after every other, whatever its prediction.
        range_ms: the prediction's range (``sim.uncertainty.prediction_range``: the
            combination's error band, around the routing prior's 10th-90th percentiles when
            the routing is the prior's).
        tie: predicted within the tie band of the fastest (``sim.uncertainty``): the leading
            entries that the simulator cannot tell apart, ordered by the tie rule.
        peak_bytes: the predicted per-rank peak (``planning.plan_memory``'s fit sets it; None
            before it or where memory is not predicted): the tie rule's key after R.
    """

    strategy: str
    schedule: str
    options: dict[str, Any]
    predicted_ms: float
    bound_ms: float
    compute_ms: float
    comm_ms: float
    caveat: str | None = None
    range_ms: tuple[float, float] | None = None
    tie: bool = False
    peak_bytes: float | None = None

    @property
    def name(self) -> str:
        """``strategy+schedule``."""
        return Run(self.strategy, self.schedule).name

    def knobs(self) -> str:
        """The options in one short line (``R=2 Sp=1.2MB domains=[1, 2]``)."""
        o = self.options
        parts = [f"R={o['pipeline_degree']}"]
        if "ar_chunk" in o:
            parts.append(f"Sp={_bytes(o['ar_chunk'])}")
        if "domain_sizes" in o:
            parts.append(f"domains={o['domain_sizes']}")
        if o.get("compression_ratio", 1.0) != 1.0:
            parts.append(f"CR={o['compression_ratio']:g}")
        if o.get("pipeline"):
            parts.append("pipelined plan")
        if "capacity_factor" in o:
            parts.append(f"capacity={o['capacity_factor']:g}")
        if "ep" in o:
            parts.append(f"EP={o['ep']}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of ``moesaic plan --json``."""
        return {
            "strategy": self.strategy,
            "schedule": self.schedule,
            "options": dict(self.options),
            "predicted_ms": self.predicted_ms,
            "bound_ms": self.bound_ms,
            "compute_ms": self.compute_ms,
            "comm_ms": self.comm_ms,
            **({"range_ms": list(self.range_ms)} if self.range_ms else {}),
            "tie": self.tie,
            **({"caveat": self.caveat} if self.caveat else {}),
        }


@dataclass(slots=True)
class Plan:
    """Every priced combination, fastest first, and what was left out.

    Attributes:
        ranked: the candidates by predicted step time (equal to 9 digits: in enumeration
            order, strategy by strategy, vanilla first, smaller R first), those with a
            ``caveat`` after all the others.
        skipped: ``(strategy+schedule, why)`` of the pairs that cannot run here.
        simulations: how many simulations were run (independent of the number of ranks).
    """

    ranked: list[Candidate]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    simulations: int = 0
    # prices a ranked candidate again with FSDP2 sharding of degree d (``plan_memory``), set by
    # :func:`plan_runs`; None: the plan cannot price sharding (the least sharding that fits)
    reprice: Callable[[Candidate, int], Candidate] | None = field(
        default=None, repr=False, compare=False
    )

    @property
    def chosen(self) -> Candidate:
        """The fastest combination."""
        return self.ranked[0]

    @property
    def reason(self) -> str:
        """Why the pick: what bounds it, what ties with it (``Candidate.tie``) and by how much
        it beats the best combination of another strategy and of another schedule."""
        best = self.chosen
        bound = "compute" if best.compute_ms >= best.comm_ms else "communication"
        text = (
            f"{best.name} ({best.knobs()}) predicted {best.predicted_ms:.4g} ms, "
            f"{bound}-bound (compute {best.compute_ms:.4g} ms, communication "
            f"{best.comm_ms:.4g} ms, {100 * _hidden_share(best):.0f}% of it hidden; bound "
            f"{best.bound_ms:.4g} ms)"
        )
        ties = [c for c in self.ranked[1:] if c.tie]
        if ties:
            names = ", ".join(f"{c.name} ({c.knobs()})" for c in ties[:3])
            more = f" and {len(ties) - 3} more" if len(ties) > 3 else ""
            fastest = min(c.predicted_ms for c in self.ranked if c.tie)
            text += (
                f"; a tie with {names}{more} (predicted within {100 * math.expm1(TIE_BAND):.1f}% "
                f"of the fastest, {fastest:.4g} ms: closer than the simulator tells apart; the "
                "tie rule picks the model's own capacity, then the simpler schedule, then the smaller "
                "R, then the smaller memory, then the faster)"
            )
        for axis in ("strategy", "schedule"):
            mine = getattr(best, axis)
            other = next((c for c in self.ranked if getattr(c, axis) != mine), None)
            if other is not None:
                ratio = other.predicted_ms / best.predicted_ms
                text += (
                    f"; {ratio:.3f}x faster than the best of another {axis}, {other.name} "
                    f"({other.knobs()})"
                )
        if "capacity_factor" in best.options:
            cf = best.options["capacity_factor"]
            text += f"; drops the assignments past capacity factor {cf:g} (allowed by the caller)"
            keep = next((c for c in self.ranked if "capacity_factor" not in c.options), None)
            if keep is not None:
                ratio = keep.predicted_ms / best.predicted_ms
                text += (
                    f", {ratio:.3f}x faster than the best at the model's own capacity, "
                    f"{keep.name} ({keep.knobs()})"
                )
        return text


def _hidden_share(c: Candidate) -> float:
    """Share of the communication that overlaps compute (1 when there is none)."""
    if c.comm_ms <= 0:
        return 1.0
    exposed = min(max(c.predicted_ms - c.compute_ms, 0.0), c.comm_ms)
    return 1.0 - exposed / c.comm_ms


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}B"


def _check_choices(
    degrees: Sequence[int], sp_divisors: Sequence[float], compression_ratios: Sequence[float]
) -> None:
    for name, values in (
        ("degrees", degrees),
        ("sp_divisors", sp_divisors),
        ("compression_ratios", compression_ratios),
    ):
        if not values:
            raise ValueError(f"{name} must not be empty")
    for i, r in enumerate(degrees):
        check_positive_int(f"degrees[{i}]", r)
    for i, n in enumerate(sp_divisors):
        check_number(f"sp_divisors[{i}]", n, 0.0, lo_open=True)
    for i, cr in enumerate(compression_ratios):
        check_number(f"compression_ratios[{i}]", cr, 1.0, 1e6)


class _Pricer:
    """Runs the simulations of one plan and counts them."""

    def __init__(
        self,
        spec: ClusterSpec,
        model: ModelSpec,
        profile: Profile,
        all_reduce: str,
        prior: RoutingPrior | None = None,
    ):
        self.spec, self.model, self.profile, self.all_reduce = spec, model, profile, all_reduce
        self.simulations = 0
        # the model at the routing prior's 10th and 90th percentiles (None: routing is known)
        self.spread = (
            None
            if prior is None
            else [dataclasses.replace(model, measured_loads=prior.rows(i)) for i in (0, 2)]
        )

    def run(self, run: Run, model: ModelSpec | None = None, **opts: Any) -> SimResult:
        self.simulations += 1
        options = SimOptions(all_reduce=self.all_reduce, **opts)
        return simulate(
            self.spec,
            model or self.model,
            run.strategy,
            self.profile,
            options,
            schedule=run.schedule,
        )

    def candidate(self, run: Run, options: dict[str, Any], **opts: Any) -> Candidate:
        r = self.run(run, **opts)
        ends = [self.run(run, m, **opts).iteration_s * 1e3 for m in self.spread or ()]
        point = r.iteration_s * 1e3
        return Candidate(
            strategy=run.strategy,
            schedule=run.schedule,
            options=options,
            predicted_ms=r.iteration_s * 1e3,
            bound_ms=r.bound_s * 1e3,
            compute_ms=r.compute_s * 1e3,
            comm_ms=r.comm_s * 1e3,
            caveat=uncalibrated_reason(self.profile, run),
            range_ms=prediction_range(run.strategy, run.schedule, point, *ends),
        )


def uncalibrated_reason(profile: Profile, run: Run) -> str | None:
    """Why ``run``'s prediction lacks a measured input of ``profile``, or None.

    ``taskflow``'s tiles run on host threads whose per-task and per-element CPU
    (``tile_cpu_s``, ``tile_elem_cpu_s``) dominate its step on a CPU; ``moesaic calibrate``
    does not measure them, and without them they are priced at zero. On the unseen
    configurations of ``benchmarks/sim_unseen.py`` such taskflow predictions were 42-75% under
    the measured steps, and the planner picked taskflow in 4 of 8 configurations where it
    measured 1.35-2.27x the best combination.
    """
    if run.strategy == "taskflow" and profile.tile_cpu_s == 0 and profile.tile_elem_cpu_s == 0:
        return (
            "the profile has no taskflow CPU figures (tile_cpu_s, tile_elem_cpu_s; "
            "`python -m moesaic.measure.cpucal` measures the latter), so its tiles' host CPU is "
            "priced at zero: ranked last"
        )
    return None


def _degrees(run: Run, model: ModelSpec, degrees: Sequence[int]) -> list[int]:
    if not run.traits.pipelined:
        return [1]
    return sorted({r for r in degrees if model.batch % r == 0})


def _best_domains(
    spec: ClusterSpec,
    model: ModelSpec,
    profile: Profile,
    *,
    degree: int,
    compression_ratio: float,
    count: int,
) -> list[tuple[int, ...]]:
    """The ``count`` best domain tuples by HybridEP's fast step model on one chunk's tokens
    (ties to smaller domains, as ``plan_domains_fast``)."""
    chunk = dataclasses.replace(model, batch=model.batch // degree)
    prof = profile.for_model(model.act_bytes)
    link = link_model(spec, prof)
    scored = [
        (
            hybrid_parts(
                link,
                chunk,
                ds,
                prof.flops_per_s,
                prefetch=True,
                compression_ratio=compression_ratio,
            ).step_s,
            math.prod(ds),
            ds,
        )
        for ds in domain_size_choices(spec)
    ]
    scored.sort(key=lambda t: (t[0], t[1]))
    return [ds for _, _, ds in scored[:count]]


def _pair_candidates(
    pricer: _Pricer,
    run: Run,
    *,
    degrees: Sequence[int],
    sp_divisors: Sequence[float],
    compression_ratios: Sequence[float],
    domain_candidates: int,
    dp_replicate: int = 1,
) -> list[Candidate]:
    """Every knob setting of one pair, priced; ``dp_replicate`` > 1: with EP on the innermost
    world / ``dp_replicate`` ranks and replicas of the unsharded model outside them
    (``SimOptions.dp_replicate``; ValueError where the simulator does not price that)."""
    out: list[Candidate] = []
    for R in _degrees(run, pricer.model, degrees):
        if run.strategy == "taskflow":
            for pipeline in (False, True):
                opts = {"pipeline_degree": 1, "pipeline": pipeline}
                out.append(
                    pricer.candidate(
                        run, opts, taskflow_pipeline=pipeline, dp_replicate=dp_replicate
                    )
                )
            continue
        settings: list[tuple[dict[str, Any], dict[str, Any]]] = [({}, {})]
        if run.strategy == "hybrid":
            settings = [
                (
                    {"domain_sizes": list(ds), "compression_ratio": cr},
                    {"domain_sizes": ds, "compression_ratio": cr, "prefetch": True},
                )
                for cr in compression_ratios
                for ds in _best_domains(
                    pricer.spec,
                    pricer.model,
                    pricer.profile,
                    degree=R,
                    compression_ratio=cr,
                    count=domain_candidates,
                )
            ]
        for shown, sim in settings:
            base = {"pipeline_degree": R, **shown}
            if not run.traits.reduce_in_backward:
                out.append(pricer.candidate(run, base, degree=R, dp_replicate=dp_replicate, **sim))
                continue
            out += _sp_candidates(
                pricer, run, base, sp_divisors, degree=R, dp_replicate=dp_replicate, **sim
            )
    return out


def _sp_candidates(
    pricer: _Pricer,
    run: Run,
    base: dict[str, Any],
    sp_divisors: Sequence[float],
    **sim: Any,
) -> list[Candidate]:
    """``flowmoe`` at each Sp = G / n (G read off the simulator's default, G / 16)."""
    first = pricer.run(run, **sim)
    default_sp = first.details.get("sp_bytes")
    if default_sp is None:  # nothing to all-reduce (a layer-only model): one setting
        return [pricer.candidate(run, base, **sim)]
    grad_bytes = 16 * default_sp
    sps = sorted({max(MIN_AR_CHUNK_BYTES, int(grad_bytes / n)) for n in sp_divisors})
    return [pricer.candidate(run, {**base, "ar_chunk": sp}, sp_bytes=sp, **sim) for sp in sps]


def plan_runs(
    spec: ClusterSpec,
    model: ModelSpec,
    profile: Profile,
    *,
    strategies: Sequence[str] = STRATEGIES,
    schedules: Sequence[str] | None = None,
    degrees: Sequence[int] = PIPELINE_DEGREES,
    sp_divisors: Sequence[float] = SP_DIVISORS,
    compression_ratios: Sequence[float] = (1.0,),
    domain_candidates: int = DOMAIN_CANDIDATES,
    all_reduce: str = "best",
    capacity_factors: Sequence[float] = (),
    routing_prior: RoutingPrior | None = None,
    ep_sizes: Sequence[int] = (),
) -> Plan:
    """Every runnable combination of ``model`` on ``spec``, simulated and ranked.

    Args:
        spec: the cluster (one expert-parallel group).
        model: the model and one rank's batch.
        profile: the machine's rates (``moesaic calibrate``).
        strategies: the strategies to consider (default: every one the simulator prices).
        schedules: the schedules to consider (default: every registered one; one the
            simulator does not price is skipped with its reason).
        degrees: R of the pipelined schedules (those dividing ``model.batch`` are tried).
        sp_divisors: ``flowmoe``'s Sp = G / n for each n.
        compression_ratios: ``hybrid``'s SR compression ratios (1: exact gathers).
        domain_candidates: ``hybrid``'s domain tuples priced per R and compression ratio.
        all_reduce: the gradient all-reduce's algorithm (``SimOptions.all_reduce``).
        capacity_factors: capacity factors the caller allows the plan to set (each > 0):
            every pair is priced again on the model with each one that differs from its own
            (``model.capacity_factor``), as candidates with the option ``capacity_factor``.
        routing_prior: the routing prior ``model``'s loads come from (its 50th percentile),
            or None (the loads are known): each candidate is priced again at the prior's
            10th and 90th percentiles for its range.
        ep_sizes: expert-parallel sizes below the world to price too (each dividing the
            world size and ``model.experts``): replicas of the unsharded model, EP on the
            innermost ``ep`` ranks (``SimOptions.dp_replicate`` = world / ep), as candidates
            with the option ``ep``; a combination the simulator does not price so (hybrid,
            the schedules that reduce gradients in the backward, taskflow) or a size whose EP
            group or replicas do not fall on whole levels of the cluster (the replicas'
            all-reduce is priced on one level) is left out, in ``skipped`` with the reason.
            Empty: EP = the world only. Where ``model.experts`` is not a multiple of the
            world size, EP = the world is left out (in ``skipped``) and these are the plan.

    Raises:
        ValueError: an unknown strategy or schedule, a bad knob, or no combination that can
            run (naming why each pair cannot), or experts that do not spread over the
            world with no ``ep_sizes``.
    """
    _check_choices(degrees, sp_divisors, compression_ratios)
    for i, cf in enumerate(capacity_factors):
        check_number(f"capacity_factors[{i}]", cf, 0.0, 1e3, lo_open=True)
    check_positive_int("domain_candidates", domain_candidates)
    world = spec.world_size
    for i, ep in enumerate(ep_sizes):
        check_positive_int(f"ep_sizes[{i}]", ep)
        if ep >= world or world % ep or model.experts % ep:
            raise ValueError(
                f"ep_sizes[{i}] ({ep}) must be below the world size ({world}) and divide it and "
                f"model.experts ({model.experts})"
            )
    # EP = the world, where the experts spread over it, and each smaller size asked for
    full = model.experts % world == 0
    if not full and not ep_sizes:
        raise ValueError(
            f"model.experts ({model.experts}) must be a multiple of the cluster's world_size "
            f"({world}) for EP = the world (each rank holds experts / world_size experts); "
            "ep_sizes (`plan --ep auto`) ranks EP groups that divide the experts"
        )
    replicate = ([1] if full else []) + [world // ep for ep in ep_sizes]
    pairs = _pairs(strategies, schedules)
    own = model.capacity_factor
    variants: list[tuple[ModelSpec, dict[str, Any]]] = [(model, {})]
    variants += [
        (dataclasses.replace(model, capacity_factor=float(cf)), {"capacity_factor": float(cf)})
        for cf in dict.fromkeys(capacity_factors)
        if float(cf) != own
    ]
    ranked: list[Candidate] = []
    skipped: list[tuple[str, str]] = []
    simulations = 0
    pricers: dict[float | None, _Pricer] = {}
    for variant, extra in variants:
        pricer = _Pricer(spec, variant, profile, all_reduce, routing_prior)
        pricers[extra.get("capacity_factor")] = pricer
        for run in pairs:
            why = unsupported_reason(spec, variant, run)
            if why is None and run.traits.pipelined and not _degrees(run, variant, degrees):
                why = f"no R of {list(degrees)} divides model.batch ({variant.batch})"
            if why is not None:
                if not extra:  # said once, for the model as given
                    skipped.append((run.name, why))
                continue
            for r in replicate:
                try:
                    if r > 1:  # the simulator's reason before the knobs' search
                        pricer.run(run, degree=_degrees(run, variant, degrees)[0], dp_replicate=r)
                    found = _pair_candidates(
                        pricer,
                        run,
                        degrees=degrees,
                        sp_divisors=sp_divisors,
                        compression_ratios=compression_ratios,
                        domain_candidates=domain_candidates,
                        dp_replicate=r,
                    )
                except ValueError as exc:  # not priced with replicas, or not on whole levels
                    if r == 1:
                        raise
                    if not extra:  # said once, for the model as given
                        skipped.append((f"{run.name} at EP {world // r}", str(exc)))
                    continue
                below = {"ep": world // r} if r > 1 else {}
                ranked += [
                    dataclasses.replace(c, options={**c.options, **extra, **below}) for c in found
                ]
        simulations += pricer.simulations
    if not full:
        skipped.append(
            (
                f"EP {world}",
                f"model.experts ({model.experts}) is not a multiple of the world size ({world})",
            )
        )
    if not ranked:
        left = "; ".join(f"{name}: {why}" for name, why in skipped) or "none asked for"
        raise ValueError(f"no combination can run this model on this cluster ({left})")
    return Plan(
        ranked=rank(ranked),
        skipped=skipped,
        simulations=simulations,
        reprice=lambda c, d: _reprice(pricers, c, d),
    )


def rank(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates by predicted step time, those with a caveat last, the leading ties
    marked and in the tie rule's order (:func:`_ties_first`). Equal to 9 digits (float noise
    between equivalent graphs) is a tie, which goes to the earlier given, simpler combination:
    vanilla before the pipelined, smaller R first."""
    ranked = [dataclasses.replace(c, tie=False) for c in candidates]
    order = {id(c): i for i, c in enumerate(ranked)}
    ranked.sort(key=lambda c: (c.caveat is not None, float(f"{c.predicted_ms:.9g}"), order[id(c)]))
    return _ties_first(ranked)


def _sim_options(c: Candidate) -> dict[str, Any]:
    """The ``SimOptions`` a candidate was priced with, read back from its options (the names
    of ``moesaic train``'s options, :class:`Candidate`)."""
    o = c.options
    opts: dict[str, Any] = {"degree": int(o.get("pipeline_degree", 1))}
    if "ar_chunk" in o:
        opts["sp_bytes"] = o["ar_chunk"]
    if "domain_sizes" in o:
        opts["domain_sizes"] = tuple(o["domain_sizes"])
        opts["compression_ratio"] = o.get("compression_ratio", 1.0)
        opts["prefetch"] = True
    if "pipeline" in o:
        opts["taskflow_pipeline"] = bool(o["pipeline"])
    return opts


def _reprice(pricers: dict[float | None, _Pricer], c: Candidate, dp_shard: int) -> Candidate:
    """``c`` priced again with FSDP2 sharding of degree ``dp_shard`` (its gathers and
    reduce-scatters, ``sim.fsdp``), ``dp_shard`` in its options."""
    pricer = pricers[c.options.get("capacity_factor")]
    options = {**c.options, "dp_shard": dp_shard}
    run = Run(c.strategy, c.schedule)
    return pricer.candidate(run, options, dp_shard=dp_shard, **_sim_options(c))


def _simplicity(c: Candidate) -> tuple[int, int, int, float, float]:
    """The tie rule's key: whether the plan changed the model's capacity (the option
    ``capacity_factor``: it drops assignments the model as given keeps, a change of what is
    trained worth making only for a gain the simulator can tell apart), how many knobs the
    schedule sets beyond one chunk (a pipeline degree above 1, an all-reduce chunk), the
    pipeline degree, the predicted per-rank peak (0 where not predicted), the prediction."""
    R = int(c.options.get("pipeline_degree", 1))
    changed = int("capacity_factor" in c.options)
    knobs = (R > 1) + ("ar_chunk" in c.options)
    return (changed, knobs, R, c.peak_bytes or 0.0, c.predicted_ms)


def _ties_first(ranked: list[Candidate]) -> list[Candidate]:
    """The leading candidates without a caveat that tie with the fastest, marked ``tie`` and
    in the tie rule's order, then the others as ranked. The memory key counts once the memory
    fit (``plan_memory``) has predicted each peak and ranks its candidates again."""
    trusted = [c for c in ranked if c.caveat is None]
    n = tie_group([c.predicted_ms for c in trusted])
    if n < 2:
        return ranked
    tied = [dataclasses.replace(c, tie=True) for c in break_ties(trusted[:n], _simplicity)]
    return tied + [c for c in ranked if all(c is not t for t in trusted[:n])]


def _pairs(strategies: Sequence[str], schedules: Sequence[str] | None) -> list[Run]:
    """The pairs of the strategies and schedules asked for that can run together (taskflow
    under a pipelined schedule cannot), strategy by strategy."""
    for i, t in enumerate(schedules or ()):
        check_schedule(check_one_of(f"schedules[{i}]", t, schedule_names()))
    every = [r for s in strategies for r in runs(s, "all")]  # an unpriced schedule: skipped
    pairs = [r for r in every if schedules is None or r.schedule in schedules]
    return list(dict.fromkeys(pairs))
