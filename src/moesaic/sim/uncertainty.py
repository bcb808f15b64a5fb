"""How far a prediction may be from the step it predicts, and when two predictions are a tie.

**The error bands** (:data:`BANDS`): for each strategy x schedule, the 5th and 95th percentiles
(and the median) of measured / predicted over the unseen rules 17-27 of
``benchmarks/sim_unseen.py`` and ``sim_unseen_wide.py`` (84 configurations: every prediction
made before its measurement with the configuration's calibrated profile, from its training
config, and judged at the runs' measured speed; :func:`bands_from` computes them from the
results, ``benchmarks/results/sim_unseen{17..27}.json``). They hold both the model's known bias
per combination (the medians, 1.02-1.13: the simulator prices most combinations a little fast)
and the calibration's spread. The 5th-95th rather than the 10th-90th: bands fitted on rules
17-26 covered 65% (training config) and 72% (model file) of the twenty-seventh rule's wider
family, where the bias is smaller and its sign varies; the wider band is for configurations
unlike the ones it was fitted on (the twenty-eighth rule checks it). A prediction's range is its
point times the band; under the routing prior (:mod:`moesaic.sim.prior`) the low end starts
from the prediction at the prior's 10th percentile and the high end from the one at its 90th
(:func:`prediction_range`).

**Ties** (:data:`TIE_BAND`): the errors of two combinations of one configuration differ; the
median over the same rules' pairs of ``|ln(measured_a / predicted_a) - ln(measured_b /
predicted_b)|`` is 0.076. Two predictions closer than that are ordered by the measurement
about as often as against it, so :func:`tie_group` calls every candidate predicted within
``exp(TIE_BAND)`` of the fastest a tie with it, and :func:`break_ties` orders the tied
candidates by the stated rule: the model's own capacity first (a capacity factor the plan
was allowed to set drops assignments the model keeps: a change of what is trained, made only
for a gain the simulator can tell apart), then the simpler schedule (the one registered
earlier: vanilla, then moe-only, then flowmoe), then the smaller pipeline degree, then the
faster prediction.

Torch-free.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

__all__ = ["BANDS", "DEFAULT_BAND", "TIE_BAND", "band", "bands_from", "prediction_range"]

# (strategy, schedule) -> (5th, 50th, 95th percentile of measured / predicted), rules 17-27.
BANDS: dict[tuple[str, str], tuple[float, float, float]] = {
    ("dropless", "vanilla"): (0.913, 1.117, 1.258),
    ("dropless", "moe-only"): (0.903, 1.099, 1.341),
    ("dropless", "flowmoe"): (0.657, 1.055, 1.331),
    ("padded", "vanilla"): (0.921, 1.121, 1.304),
    ("padded", "moe-only"): (0.906, 1.088, 1.297),
    ("padded", "flowmoe"): (0.693, 1.022, 1.325),
    ("hybrid", "vanilla"): (0.925, 1.115, 1.348),
    ("hybrid", "moe-only"): (0.912, 1.098, 1.337),
    ("hybrid", "flowmoe"): (0.705, 1.059, 1.337),
    ("taskflow", "vanilla"): (0.845, 1.13, 1.59),
}
# Every point of the same rules: for a combination without a band of its own.
DEFAULT_BAND = (0.817, 1.09, 1.343)
# The median |difference of two combinations' log errors| within one configuration, same rules.
TIE_BAND = 0.076
RULES = tuple(range(17, 28))

T = TypeVar("T")


def _quantiles(xs: Sequence[float]) -> tuple[float, float, float]:
    qs = statistics.quantiles(xs, n=20, method="inclusive")
    return (round(qs[0], 3), round(statistics.median(xs), 3), round(qs[-1], 3))


def bands_from(results: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The bands, the default band and the tie band from unseen-rule results (each with
    ``points`` of ``configuration``, ``strategy``, ``schedule``, ``measured_s`` and
    ``predicted_s``)."""
    by: dict[tuple[str, str], list[float]] = {}
    logs: dict[tuple[int, str], list[float]] = {}
    for i, data in enumerate(results):
        for p in data["points"]:
            # the wider rules (27 on) predict each point twice: its training config's
            # prediction (measured routing) is the one judged here, as in rules 17-26
            predicted = p.get("predicted_s", p.get("train", {}).get("predicted_s"))
            if "measured_s" not in p or predicted is None:
                continue
            ratio = p["measured_s"] / predicted
            by.setdefault((p["strategy"], p["schedule"]), []).append(ratio)
            logs.setdefault((i, p["configuration"]), []).append(math.log(ratio))
    diffs = [abs(a - b) for v in logs.values() for j, a in enumerate(v) for b in v[j + 1 :]]
    return {
        "bands": {k: _quantiles(v) for k, v in by.items()},
        "default": _quantiles([x for v in by.values() for x in v]),
        "tie_band": round(statistics.median(diffs), 3),
    }


def band(strategy: str, schedule: str) -> tuple[float, float]:
    """The (5th, 95th) percentile of measured / predicted for the combination (:data:`BANDS`)."""
    lo, _, hi = BANDS.get((strategy, schedule), DEFAULT_BAND)
    return lo, hi


def prediction_range(
    strategy: str, schedule: str, point: float, low: float | None = None, high: float | None = None
) -> tuple[float, float]:
    """The range of a prediction ``point``: the band around it, or around ``low`` and
    ``high`` (the predictions at the routing prior's 10th and 90th percentiles) when given."""
    lo, hi = band(strategy, schedule)
    a = min(point, low) if low is not None else point
    b = max(point, high) if high is not None else point
    return a * lo, b * hi


def tie_group(predicted: Sequence[float]) -> int:
    """How many of the leading ``predicted`` (sorted, fastest first) are a tie with the first."""
    if not predicted:
        return 0
    limit = predicted[0] * math.exp(TIE_BAND)
    return sum(1 for p in predicted if p <= limit)


def break_ties(tied: Sequence[T], key: Callable[[T], tuple[int, int, int, float]]) -> list[T]:
    """``tied`` in the tie rule's order; ``key`` gives each one's (whether it changes the
    model's capacity, schedule's knobs, pipeline degree, predicted)."""
    return sorted(tied, key=key)
