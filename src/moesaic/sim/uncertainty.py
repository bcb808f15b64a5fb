"""How far a prediction may be from the step it predicts, and when two predictions are a tie.

**The error bands** (:data:`BANDS`): for each strategy x schedule, the 10th and 90th percentiles
of measured / predicted over the unseen rules 17-26 of ``benchmarks/sim_unseen.py`` (80
configurations, 8 each, every prediction made before its measurement with the configuration's
calibrated profile and judged at the runs' measured speed; :func:`bands_from` computes them from
the results, ``benchmarks/results/sim_unseen{17..26}.json``). They hold both the model's known
bias per combination (the medians, 1.02-1.13: the simulator prices most combinations a little
fast) and the calibration's spread (each configuration was calibrated once, its runs' speed
measured around them). A prediction's range is its point times the band; under the routing
prior (:mod:`moesaic.sim.prior`) the low end starts from the prediction at the prior's 10th
percentile and the high end from the one at its 90th (:func:`prediction_range`).

**Ties** (:data:`TIE_BAND`): the errors of two combinations of one configuration differ; the
median over the same rules' pairs of ``|ln(measured_a / predicted_a) - ln(measured_b /
predicted_b)|`` is 0.073. Two predictions closer than that are ordered by the measurement
about as often as against it, so :func:`tie_group` calls every candidate predicted within
``exp(TIE_BAND)`` of the fastest a tie with it, and :func:`break_ties` orders the tied
candidates by the stated rule: the simpler schedule first (the one registered earlier:
vanilla, then moe-only, then flowmoe), then the smaller pipeline degree, then the faster
prediction.

Torch-free.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

__all__ = ["BANDS", "DEFAULT_BAND", "TIE_BAND", "band", "bands_from", "prediction_range"]

# (strategy, schedule) -> (10th, 50th, 90th percentile of measured / predicted), rules 17-26.
BANDS: dict[tuple[str, str], tuple[float, float, float]] = {
    ("dropless", "vanilla"): (0.974, 1.124, 1.237),
    ("dropless", "moe-only"): (0.974, 1.102, 1.271),
    ("dropless", "flowmoe"): (0.798, 1.052, 1.265),
    ("padded", "vanilla"): (0.949, 1.124, 1.270),
    ("padded", "moe-only"): (0.926, 1.084, 1.266),
    ("padded", "flowmoe"): (0.745, 1.022, 1.268),
    ("hybrid", "vanilla"): (0.994, 1.115, 1.263),
    ("hybrid", "moe-only"): (0.975, 1.101, 1.270),
    ("hybrid", "flowmoe"): (0.807, 1.059, 1.298),
    ("taskflow", "vanilla"): (0.904, 1.130, 1.477),
}
# Every point of the same rules: for a combination without a band of its own.
DEFAULT_BAND = (0.899, 1.091, 1.291)
# The median |difference of two combinations' log errors| within one configuration, same rules.
TIE_BAND = 0.073
RULES = tuple(range(17, 27))

T = TypeVar("T")


def _quantiles(xs: Sequence[float]) -> tuple[float, float, float]:
    qs = statistics.quantiles(xs, n=10, method="inclusive")
    return (round(qs[0], 3), round(statistics.median(xs), 3), round(qs[-1], 3))


def bands_from(results: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The bands, the default band and the tie band from unseen-rule results (each with
    ``points`` of ``configuration``, ``strategy``, ``schedule``, ``measured_s`` and
    ``predicted_s``)."""
    by: dict[tuple[str, str], list[float]] = {}
    logs: dict[tuple[int, str], list[float]] = {}
    for i, data in enumerate(results):
        for p in data["points"]:
            if "measured_s" not in p or "predicted_s" not in p:
                continue
            ratio = p["measured_s"] / p["predicted_s"]
            by.setdefault((p["strategy"], p["schedule"]), []).append(ratio)
            logs.setdefault((i, p["configuration"]), []).append(math.log(ratio))
    diffs = [abs(a - b) for v in logs.values() for j, a in enumerate(v) for b in v[j + 1 :]]
    return {
        "bands": {k: _quantiles(v) for k, v in by.items()},
        "default": _quantiles([x for v in by.values() for x in v]),
        "tie_band": round(statistics.median(diffs), 3),
    }


def band(strategy: str, schedule: str) -> tuple[float, float]:
    """The (10th, 90th) percentile of measured / predicted for the combination."""
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


def break_ties(tied: Sequence[T], key: Callable[[T], tuple[int, int, float]]) -> list[T]:
    """``tied`` in the tie rule's order; ``key`` gives each one's (schedule's registration
    index, pipeline degree, predicted)."""
    return sorted(tied, key=key)
