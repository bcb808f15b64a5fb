"""Cross-rank checks on the plans of every rank of one world (``check_world``).

The per-plan checks are ``validate.check_plan``'s; these add what no single plan shows: the same
world settings (``Plan.world_settings``) and direction on every rank, every put matched by the
receiver's remote-write record with the same rows and events, and no deadlock of all 2P queues
together (``validate.simulate`` with ``world=True``: puts bump the counters of their target
ranks). Every failure raises a :class:`PlanWorldError` (a ``PlanError``) or the error of the
check that failed.
"""

from __future__ import annotations

from collections.abc import Sequence

from moesaic.taskflow.plan import Plan
from moesaic.taskflow.validate import PlanError, ensure_validated, simulate

__all__ = ["PlanWorldError", "check_world", "world_mismatch"]


class PlanWorldError(PlanError):
    """Plans of different ranks that do not fit together."""


def world_mismatch(a: Plan, b: Plan) -> str | None:
    """The first world setting in which two plans differ, as ``name (a vs b)``; None if none."""
    sa, sb = a.world_settings, b.world_settings
    for k in sorted(set(sa) | set(sb)):
        if sa.get(k) != sb.get(k):
            return f"{k} ({sa.get(k)!r} vs {sb.get(k)!r})"
    return None


def check_world(plans: Sequence[Plan]) -> None:
    """Cross-rank checks on the plans of every rank of one world (``plans[r]`` is rank r)."""
    if not plans:
        raise PlanWorldError("no plans given")
    P = plans[0].bucket.ep_size
    if len(plans) != P or [p.rank for p in plans] != list(range(P)):
        raise PlanWorldError(
            f"need the plans of ranks 0..{P - 1} in order, got ranks {[p.rank for p in plans]}"
        )
    for p in plans:
        diff = world_mismatch(plans[0], p)
        if diff is not None or p.direction != plans[0].direction:
            raise PlanWorldError(
                f"rank {p.rank}'s plan belongs to another world than rank 0's: "
                f"{diff or f'direction ({plans[0].direction} vs {p.direction})'}"
            )
        ensure_validated(p)
    stubs = [{(w.rank, w.op, w.task_index): w for w in p.remote_writes} for p in plans]
    matched = [0] * P
    for p in plans:
        for t in p.tasks:
            for d in sorted({r.rank for r in t.outputs} - {p.rank}):
                w = stubs[d].get((p.rank, t.op, t.task_index))
                regs = tuple(r for r in t.outputs if r.rank == d)
                evs = tuple(ref.event for ref in t.trigger_events if ref.rank == d)
                if (
                    w is None
                    or w.regions != regs
                    or tuple(sorted(w.trigger_events)) != tuple(sorted(evs))
                ):
                    raise PlanWorldError(
                        f"rank {p.rank} {t.label} writes rank {d}, whose plan does not expect "
                        "exactly these rows and events"
                    )
                matched[d] += 1
    for d, p in enumerate(plans):
        if matched[d] != len(p.remote_writes):
            raise PlanWorldError(
                f"rank {d} expects {len(p.remote_writes)} remote writes, {matched[d]} are sent"
            )
    simulate(plans, world=True)
