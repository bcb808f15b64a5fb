"""How far a prediction may be from the step it predicts, and when two predictions are a tie.

**The error bands** (:data:`BANDS`): for each strategy x schedule, from measured / predicted
over the unseen rules 17-33 of ``benchmarks/sim_unseen.py`` and ``sim_unseen_wide.py`` (102
configurations, 1020 points: every prediction made before its measurement with the
configuration's calibrated profile, from its training config, and judged at the runs'
measured speed; :func:`bands_from` computes them from the results,
``benchmarks/results/sim_unseen{17..33}.json``): its median (the model's known bias per
combination, 1.03-1.10: the simulator prices most combinations a little fast) and a low and
high end, the wider of the combination's own 5th-95th percentiles and its median times the
5th-95th percentiles of every point's ratio to its combination's median, pooled over the
combinations (:func:`combination_bands`). The pooled part is there because most of the spread
is a configuration's shift that moves all its combinations together (a calibration a few
percent off, a link priced a little slow): the vanilla combinations, consistent over rules
17-26, had narrow bands of their own, and a configuration that shifted every combination fell
outside (rule 29: 67% covered by the per-combination bands of rules 17-27). Fitted only on the
rules before each of rules 23-33 (``benchmarks/sim_bands_backtest.py``,
``sim_bands_backtest.json``), the per-combination bands covered 63-93% of each next rule's
points (mean 79%), these 73-97% (mean 87%; 73% on rules 30 and 33, whose slow and three-level
clusters shifted by 15-40%; 97% and 83% on rules 31 and 32), 1.62-1.66x wide at the median
against 1.42-1.54x.
A prediction's range is its point times the band; under the routing prior
(:mod:`moesaic.sim.prior`) the low end starts from the prediction at the prior's 10th
percentile and the high end from the one at its 90th (:func:`prediction_range`).

**Ties** (:data:`TIE_BAND`): the errors of two combinations of one configuration differ; the
median over the same rules' pairs of ``|ln(measured_a / predicted_a) - ln(measured_b /
predicted_b)|`` is 0.077. Two predictions closer than that are ordered by the measurement
about as often as against it, so :func:`tie_group` calls every candidate predicted within
``exp(TIE_BAND)`` of the fastest a tie with it, and :func:`break_ties` orders the tied
candidates by the stated rule: the model's own capacity first (a capacity factor the plan
was allowed to set drops assignments the model keeps: a change of what is trained, made only
for a gain the simulator can tell apart), then the simpler schedule (the one registered
earlier: vanilla, then moe-only, then flowmoe), then the smaller pipeline degree, then the
smaller predicted per-rank peak (where the plan predicted memory), then the faster prediction.

Torch-free.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

__all__ = ["BANDS", "DEFAULT_BAND", "TIE_BAND", "band", "bands_from", "prediction_range"]

# (strategy, schedule) -> (low, median, high) of measured / predicted (combination_bands), rules 17-33.
BANDS: dict[tuple[str, str], tuple[float, float, float]] = {
    ("dropless", "vanilla"): (0.82, 1.093, 1.374),
    ("dropless", "moe-only"): (0.817, 1.089, 1.37),
    ("dropless", "flowmoe"): (0.689, 1.073, 1.349),
    ("padded", "vanilla"): (0.816, 1.088, 1.368),
    ("padded", "moe-only"): (0.807, 1.076, 1.353),
    ("padded", "flowmoe"): (0.712, 1.029, 1.33),
    ("hybrid", "vanilla"): (0.827, 1.102, 1.386),
    ("hybrid", "moe-only"): (0.813, 1.085, 1.363),
    ("hybrid", "flowmoe"): (0.712, 1.059, 1.337),
    ("taskflow", "vanilla"): (0.794, 1.059, 1.584),
}
# Every point of the same rules: for a combination without a band of its own.
DEFAULT_BAND = (0.797, 1.081, 1.343)
# The median |difference of two combinations' log errors| within one configuration, same rules.
TIE_BAND = 0.077
RULES = tuple(range(17, 34))

T = TypeVar("T")


def _quantiles(xs: Sequence[float]) -> tuple[float, float, float]:
    qs = statistics.quantiles(xs, n=20, method="inclusive")
    return (round(qs[0], 3), round(statistics.median(xs), 3), round(qs[-1], 3))


def combination_bands(
    by: Mapping[tuple[str, str], Sequence[float]],
) -> dict[tuple[str, str], tuple[float, float, float]]:
    """Each combination's (low, median, high) from its ratios ``by`` combination: the median,
    and the wider of its own 5th-95th percentiles and the median times the pooled residuals'
    (a residual: a ratio over its combination's median)."""
    medians = {k: statistics.median(v) for k, v in by.items()}
    residuals = [x / medians[k] for k, v in by.items() for x in v]
    pooled = statistics.quantiles(residuals, n=20, method="inclusive")
    out = {}
    for k, m in medians.items():
        own = statistics.quantiles(by[k], n=20, method="inclusive")
        lo, hi = min(own[0], m * pooled[0]), max(own[-1], m * pooled[-1])
        out[k] = (round(lo, 3), round(m, 3), round(hi, 3))
    return out


def bands_from(results: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The bands (:func:`combination_bands`), the default band (every point's 5th, 50th and 95th
    percentile) and the tie band from unseen-rule results (each with ``points`` of
    ``configuration``, ``strategy``, ``schedule``, ``measured_s`` and ``predicted_s``)."""
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
        "bands": combination_bands(by),
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


def break_ties(tied: Sequence[T], key: Callable[[T], tuple[float, ...]]) -> list[T]:
    """``tied`` in the tie rule's order; ``key`` gives each one's (whether it changes the
    model's capacity, schedule's knobs, pipeline degree, per-rank peak, predicted)."""
    return sorted(tied, key=key)
