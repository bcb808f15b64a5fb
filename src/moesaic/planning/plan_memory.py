"""``moesaic plan``'s memory: each ranked combination's predicted per-rank peak
(``moesaic.sim.memory``), ``--memory-per-rank BYTES`` to drop what does not fit, and the
FSDP2 sharding (``--dp-shard``) that makes a combination fit.

The plan's ranks are the expert-parallel group (``plan_cli``), so a combination runs at EP = the
cluster's world size, unsharded or with ``dp_shard`` d, for every d with d x EP dividing the
world (here d = 1: the dense part sharded over the EP ranks); only where its strategy and
schedule run sharded (``planning.sharding.check_sharding``: their ``Supports.unsharded_why`` and
``ScheduleSpec.unsharded_why``, the declarations the trainer reads). Each combination takes the
sharding that fits with the shortest predicted step: the simulator prices FSDP2's all-gathers
and reduce-scatters (``sim.fsdp``, through the plan's ``reprice``), so where unsharded fits it
wins unless sharding is priced faster, and the plan is ranked again on the chosen steps (a plan
without a pricer takes the least sharding that fits). A combination that fits no way is
dropped, with its smallest predicted peak. Torch-free.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moesaic.planning.planner import rank
from moesaic.planning.sharding import check_sharding
from moesaic.sim.memory import predict_run
from moesaic.sim.model import ModelSpec, model_config_of

__all__ = [
    "MemoryFit",
    "add_memory_option",
    "apply_memory",
    "fit_memory",
    "memory_lines",
    "sharding_choices",
]

MIB = 2**20
MAX_DROPPED = 10  # dropped combinations listed one a line; beyond, a count


def sharding_choices(world: int, ep: int) -> list[int | None]:
    """Unsharded (None), then every ``dp_shard`` d, smallest first, with d x ep dividing
    ``world`` (the rest of the world replicates: ``--dp-replicate``)."""
    rest = world // ep
    return [None, *(d for d in range(1, rest + 1) if rest % d == 0)]


@dataclasses.dataclass(slots=True)
class MemoryFit:
    """The plan after ``--memory-per-rank``.

    Attributes:
        plan: the ranking with the combinations that fit (each with its ``dp_shard`` in its
            options when sharded and its predicted ``peak_bytes``), in the same order.
        dropped: one line per dropped combination.
    """

    plan: Any
    dropped: list[str]

    @property
    def peaks(self) -> list[float]:
        """Predicted peak bytes per rank of each kept combination, in ranking order."""
        return [c.peak_bytes for c in self.plan.ranked]


def fit_memory(plan: Any, model: ModelSpec, world: int, budget: float | None) -> MemoryFit:
    """Each combination of ``plan`` (``planning.planner.Plan``) priced in memory at its EP
    (``world``, or its option ``ep``: replicas of the unsharded model, never sharded here):
    the least sharding whose predicted peak fits ``budget`` bytes (None: unsharded, no
    limit); the combinations that fit no way are dropped.

    Raises:
        ValueError: ``budget`` not positive, or no combination fits (naming the smallest
            predicted peak and the budget).
    """
    if budget is not None and not budget > 0:
        raise ValueError(f"memory_per_rank (--memory-per-rank) ({budget!r}) must be > 0 bytes")
    kept, dropped = [], []
    for cand in plan.ranked:
        tried: list[str] = []
        fitting: list[tuple[int | None, float]] = []
        ep = int(cand.options.get("ep", world))  # below the world: replicas, not sharded
        choices = sharding_choices(world, world) if budget is not None and ep == world else [None]
        for d in choices:
            if d is not None:
                try:
                    check_sharding(cand.strategy, cand.schedule)
                except ValueError as exc:
                    tried.append(f"not sharded: {str(exc).split(': ', 1)[0]}")
                    break
            domains = cand.options.get("domain_sizes")
            peak = predict_run(
                model, cand.strategy, cand.schedule, ep, domain_sizes=domains, dp_shard=d
            ).peak
            if budget is None or peak <= budget:
                fitting.append((d, peak))
                if plan.reprice is None:  # no price for sharding: the least that fits
                    break
                continue
            tried.append(f"{'unsharded' if d is None else f'dp_shard {d}'} {peak / MIB:.1f} MiB")
        if not fitting:
            dropped.append(f"{cand.name} ({cand.knobs()}): {'; '.join(tried)}")
            continue
        priced = [(_sharded(plan, cand, d), peak) for d, peak in fitting]
        # the shortest predicted step; equal ones to the less sharded (listed first)
        cand, peak = min(priced, key=lambda t: t[0].predicted_ms)
        kept.append(dataclasses.replace(cand, peak_bytes=peak))  # also the tie rule's key
    if not kept and budget is not None:  # (without a budget every combination is kept)
        raise ValueError(
            f"no combination fits --memory-per-rank {budget:.0f} bytes ({budget / MIB:.1f} MiB) "
            f"per rank: {dropped[0]}"
        )
    if plan.reprice is not None:  # ranked again on the chosen steps (and peaks, for ties)
        kept = rank(kept)
    return MemoryFit(plan=dataclasses.replace(plan, ranked=kept), dropped=dropped)


def _sharded(plan: Any, cand: Any, d: int | None) -> Any:
    """``cand`` with ``dp_shard`` d: priced again by the plan's ``reprice`` where it has one."""
    if d is None:
        return cand
    if plan.reprice is None:
        return dataclasses.replace(cand, options={**cand.options, "dp_shard": d})
    return plan.reprice(cand, d)


def add_memory_option(p: Any) -> None:
    """``--memory-per-rank BYTES`` on ``moesaic plan``'s parser."""
    p.add_argument(
        "--memory-per-rank",
        type=float,
        metavar="BYTES",
        help="drop the combinations whose predicted peak per rank exceeds BYTES, sharding "
        "(--dp-shard) those that fit only so (moesaic.sim.memory)",
    )


def apply_memory(
    model: ModelSpec, budget: float | None, plan: Any, world: int, note: Any
) -> MemoryFit | None:
    """``plan`` fitted to ``budget`` bytes per rank (``--memory-per-rank``, :func:`fit_memory`)
    on ``model``; without a budget and for a model the memory model cannot express
    (``model_config_of``'s refusals), a note and None."""
    try:
        model_config_of(model)
    except ValueError as exc:
        if budget is not None:
            raise ValueError(f"--memory-per-rank cannot predict this model: {exc}") from None
        note(f"per-rank memory not predicted: {exc}")
        return None
    return fit_memory(plan, model, world, budget)


def memory_lines(fit: MemoryFit, budget: float | None) -> list[str]:
    """The text report's lines: the pick's predicted peak and sharding, what was dropped (one
    line each, at most ``MAX_DROPPED`` lines, then a count)."""
    best, peak = fit.plan.ranked[0], fit.peaks[0]
    shard = best.options.get("dp_shard")
    how = "unsharded" if shard is None else f"--dp-shard {shard}"
    limit = "" if budget is None else f" (of --memory-per-rank {budget / MIB:.1f} MiB)"
    lines = [f"memory   {best.name}: predicted peak {peak / MIB:.1f} MiB per rank, {how}{limit}"]
    lines += [f"dropped  {line}" for line in fit.dropped[:MAX_DROPPED]]
    if len(fit.dropped) > MAX_DROPPED:
        lines.append(f"dropped  ... and {len(fit.dropped) - MAX_DROPPED} more that do not fit")
    return lines
