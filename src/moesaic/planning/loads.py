"""Which expert loads a plan or a simulation prices for a model: the model's own, a profile's
measured routing (``calibrate --model``, ``--measure-routing``) or the routing prior
(:mod:`moesaic.sim.prior`). Read by ``moesaic simulate`` / ``plan`` (``simtools.cli_files``) and
``moesaic train --plan auto`` (``train.plan_auto``). Torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from moesaic.sim.prior import RoutingPrior

__all__ = ["describe_loads", "model_loads"]


def describe_loads(rows: Any) -> str:
    """The busiest expert of each row against the mean, e.g. ``3.40x, 2.10x the mean``; past
    four rows (a run's steps x layers) their range and median."""
    ratios = [max(row) * len(row) / sum(row) for row in rows]
    if len(ratios) > 4:
        mid = sorted(ratios)[len(ratios) // 2]
        return (
            f"{min(ratios):.2f}-{max(ratios):.2f}x the mean (median {mid:.2f}x over "
            f"{len(ratios)} rows: steps x layers)"
        )
    return ", ".join(f"{r:.2f}x" for r in ratios) + " the mean"


def model_loads(
    model: Any,
    *,
    note: Callable[[str], None],
    profile: Any = None,
    world: int | None = None,
    uniform: bool = False,
) -> tuple[Any, Any]:
    """``model`` with expert loads, the first of: the model's own ``measured_loads`` or
    ``routing_skew``, the ``profile``'s (a run of the job's router on its data) when they have
    the model's experts, else the routing prior at its 50th percentile (``world`` ranks' tokens
    per step), unless ``uniform``, ``world`` is None or the model is ``layer_only`` (a layer
    timed alone on random activations: uniform). Says which it used (``note``). Returns the
    model and the prior (None when it is not used)."""
    if model.measured_loads or model.routing_skew:
        return model, None
    routing = getattr(profile, "routing", None)
    if routing is not None and len(routing.loads[0]) == model.experts:
        note(
            f"routing from the profile ({routing.source}): the busiest expert "
            f"{describe_loads(routing.loads)}"
        )
        return dataclasses.replace(model, measured_loads=routing.loads), None
    if routing is not None:
        note(
            f"the profile's routing ({routing.source}) has {len(routing.loads[0])} experts, "
            f"the model {model.experts}: not used"
        )
    if world is None or model.layer_only or uniform:
        return model, None
    prior = RoutingPrior.of(model.experts, model.top_k, model.tokens * world, model.hidden)
    note(prior.describe() + "; the range is priced at the 10th and 90th")
    return dataclasses.replace(model, measured_loads=prior.rows(1)), prior
