"""The table of ``benchmarks/sim_unseen.py``'s result: per point the measured and predicted step
and the error; per configuration whether the prediction ranks the fastest measured combination
first (or within 5% of the first), how the grid's predicted-fastest combination measured against
the best, and how the planner's pick measured against the best measured combination and against
the best of those it could choose (in rules 1-4 the planner plans the configuration's model as
given, without a capacity factor, so the padded runs at capacity 1.25, which drop tokens, are not
among its choices; from rule 5 on it is allowed that capacity, and every grid combination is a
choice); the geometric-mean error over every point. Where a point was measured in several passes
(rule 5), the table also gives each run's median and their spread, and how the ranking fares
against the spread (``within_noise``: the measured best and the ranked-first combination differ
by less than the larger of their two runs' spreads), and the repeat's ceiling (``repeat_*``): the
measurement's own passes split into two halves in every way (one pass against the other for
two; a half of the passes against the other half from four), one half's means taken as the
prediction and judged on the other's by the same two rules (the fastest ranked first or within
5%; the ranked-first within 10% of the best), as the fraction of the splits that meet each.

From the seventeenth rule on, ``predicted_s`` is the prediction at the runs' measured speed
(the rule's text); ``--calibrated`` reports the prediction at the calibration's speed instead
(``predicted_calibrated_s``).

Usage::

    python benchmarks/sim_unseen_report.py [benchmarks/results/sim_unseen.json] [--markdown]
        [--calibrated]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from typing import Any


def _runs(p: dict[str, Any]) -> list[float]:
    """A point's per-run medians (one run before rule 5)."""
    runs = [r["measured_s"] for r in p.get("runs", []) if "measured_s" in r]
    return runs or [p["measured_s"]]


def _spread(p: dict[str, Any]) -> float:
    """The relative spread of a point's runs: (max - min) / mean (0 for a single run)."""
    runs = _runs(p)
    return (max(runs) - min(runs)) / (sum(runs) / len(runs))


def _within_noise(best: dict[str, Any], other: dict[str, Any]) -> bool | None:
    """Whether ``other`` measured within the runs' spread of ``best`` (None: single runs)."""
    if len(_runs(best)) < 2 or len(_runs(other)) < 2:
        return None
    gap = other["measured_s"] / best["measured_s"] - 1
    return gap <= max(_spread(best), _spread(other))


def geomean_error(errors: list[float]) -> float | None:
    """The geometric mean of ``1 + error`` minus 1 (None without errors)."""
    return math.exp(sum(math.log1p(e) for e in errors) / len(errors)) - 1 if errors else None


def within_5pct(best_predicted: float, first_predicted: float) -> bool:
    """The ranking's looser clause: the measured-fastest combination predicted within 5% of
    the predicted-first."""
    return best_predicted <= 1.05 * first_predicted


def _meets(
    points: list[dict[str, Any]], predicted: dict[int, float], measured: dict[int, float]
) -> tuple[bool, bool]:
    """(the measured-fastest predicted within 5% of the predicted-first, the predicted-first
    measured within 10% of the fastest); ``predicted``/``measured`` by index in ``points``."""
    best = min(range(len(points)), key=measured.__getitem__)
    first = min(range(len(points)), key=predicted.__getitem__)
    return (
        within_5pct(predicted[best], predicted[first]),
        measured[first] <= 1.10 * measured[best],
    )


def _repeat_ceiling(points: list[dict[str, Any]]) -> tuple[float, float] | None:
    """The fractions of the ways to split the passes into two halves in which one half's means,
    taken as the prediction, meet the ranking and the pick rule on the other half's (None:
    single runs)."""
    passes = min(len(_runs(p)) for p in points)
    if passes < 2:
        return None
    splits = list(itertools.combinations(range(passes), passes // 2))
    ranked = picked = 0
    for half in splits:
        other = [i for i in range(passes) if i not in half]
        pred = {j: statistics.fmean(_runs(p)[i] for i in half) for j, p in enumerate(points)}
        meas = {j: statistics.fmean(_runs(p)[i] for i in other) for j, p in enumerate(points)}
        r, k = _meets(points, pred, meas)
        ranked += r
        picked += k
    return ranked / len(splits), picked / len(splits)


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    points = [p for p in data["points"] if "measured_s" in p and "predicted_s" in p]
    errors = [abs(p["predicted_s"] - p["measured_s"]) / p["measured_s"] for p in points]
    geo = geomean_error(errors)
    configs = []
    for c in data["configurations"]:
        mine = [p for p in points if p["configuration"] == c["name"]]
        if not mine:
            continue
        best = min(mine, key=lambda p: p["measured_s"])
        ranked_first = min(mine, key=lambda p: p["predicted_s"])
        # the measured-fastest is "ranked first" when its prediction is within 5% of the first's
        ok, _ = _meets(
            mine,
            {j: p["predicted_s"] for j, p in enumerate(mine)},
            {j: p["measured_s"] for j, p in enumerate(mine)},
        )
        pick = c.get("plan_measured", {})
        pick_ratio = pick["measured_s"] / best["measured_s"] if "measured_s" in pick else None
        ceiling = _repeat_ceiling(mine)
        capacity_allowed = data.get("rule_number", 1) >= 5
        choosable = [p for p in mine if capacity_allowed or p["strategy"] != "padded"]
        best_choosable = min(choosable, key=lambda p: p["measured_s"])
        pick_ratio_choosable = (
            pick["measured_s"] / best_choosable["measured_s"] if "measured_s" in pick else None
        )
        configs.append(
            {
                "configuration": c["name"],
                "best_measured": f"{best['strategy']}+{best['schedule']}",
                "best_measured_s": best["measured_s"],
                "ranked_first": f"{ranked_first['strategy']}+{ranked_first['schedule']}",
                "best_ranked_first_or_within_5pct": ok,
                "within_noise": _within_noise(best, ranked_first),
                "ranked_first_over_best_measured": ranked_first["measured_s"] / best["measured_s"],
                "repeat_ranked": None if ceiling is None else ceiling[0],
                "repeat_picked": None if ceiling is None else ceiling[1],
                "plan_pick": (
                    f"{pick['pick']['strategy']}+{pick['pick']['schedule']} "
                    f"{json.dumps(pick['pick']['options'])}"
                    if "pick" in pick
                    else None
                ),
                "plan_pick_measured_s": pick.get("measured_s"),
                "plan_pick_over_best_measured": pick_ratio,
                "best_without_capacity": (
                    f"{best_choosable['strategy']}+{best_choosable['schedule']}"
                ),
                "plan_pick_over_best_without_capacity": pick_ratio_choosable,
            }
        )
    ceilings = [c for c in configs if c["repeat_ranked"] is not None]
    return {
        "points": len(points),
        "ranked": sum(c["best_ranked_first_or_within_5pct"] for c in configs),
        "ranked_first_within_10pct": sum(
            c["ranked_first_over_best_measured"] <= 1.10 for c in configs
        ),
        "repeat_ranked": sum(c["repeat_ranked"] for c in ceilings) if ceilings else None,
        "repeat_picked": sum(c["repeat_picked"] for c in ceilings) if ceilings else None,
        "failed_points": [p for p in data["points"] if "measured_s" not in p],
        "geomean_error": geo,
        "median_error": sorted(errors)[len(errors) // 2] if errors else None,
        "median_run_spread": sorted(map(_spread, points))[len(points) // 2] if points else None,
        "configurations": configs,
    }


def markdown(data: dict[str, Any], s: dict[str, Any]) -> str:
    rows = [
        "| configuration | combination | measured ms (runs) | predicted ms | error |",
        "|---|---|---|---|---|",
    ]
    for p in data["points"]:
        if "measured_s" in p and "predicted_s" in p:
            err = (p["predicted_s"] - p["measured_s"]) / p["measured_s"]
            runs = _runs(p)
            each = f" ({', '.join(f'{r * 1e3:.0f}' for r in runs)})" if len(runs) > 1 else ""
            rows.append(
                f"| {p['configuration']} | {p['strategy']}+{p['schedule']} | "
                f"{p['measured_s'] * 1e3:.0f}{each} | {p['predicted_s'] * 1e3:.0f} | {err:+.0%} |"
            )
    rows += [
        "",
        "| configuration | best measured | ranked first (its measured / best) | ok | plan pick "
        "| pick / best | best without capacity | pick / it |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    for c in s["configurations"]:
        rows.append(
            f"| {c['configuration']} | {c['best_measured']} ({c['best_measured_s'] * 1e3:.0f} ms) "
            f"| {c['ranked_first']} ({c['ranked_first_over_best_measured']:.2f}) "
            f"| {'yes' if c['best_ranked_first_or_within_5pct'] else 'no'} "
            f"| {c['plan_pick']} | {ratio(c['plan_pick_over_best_measured'])} "
            f"| {c['best_without_capacity']} | {ratio(c['plan_pick_over_best_without_capacity'])} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", default="benchmarks/results/sim_unseen.json")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument(
        "--calibrated",
        action="store_true",
        help="judge the predictions at the calibration's speed (rule 17 on: predicted_calibrated_s)",
    )
    args = parser.parse_args()
    with open(args.path) as f:
        data = json.load(f)
    if args.calibrated:
        for p in data["points"]:
            if "predicted_calibrated_s" in p:
                p["predicted_s"] = p["predicted_calibrated_s"]
    s = summarize(data)
    if args.markdown:
        print(markdown(data, s))
    print(json.dumps({k: v for k, v in s.items() if k != "failed_points"}, indent=1))
    print("failed points:", len(s["failed_points"]))


if __name__ == "__main__":
    main()
