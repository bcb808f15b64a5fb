"""How often a prediction's error band covers the measurement on a rule it was not fitted on.

For each unseen rule N of ``TESTS`` the bands are fitted on rules 17 to N - 1 only (their
committed results, ``benchmarks/results/sim_unseen{17..}.json``, the training config's
prediction of each point as ``sim.uncertainty.bands_from`` reads it) and judged on rule N's
points: the share whose measured / predicted falls inside its combination's band (the default
band for a combination without one). Three constructions side by side:

* ``per_combination``: each combination's own 5th-95th percentiles (the bands until rule 29);
* ``pooled``: each combination's median times the 5th-95th percentiles of every point's ratio
  to its combination's median (the residuals pooled over the combinations);
* ``committed``: :func:`moesaic.sim.uncertainty.combination_bands`, the wider of the two.

Only the error band is judged (the routing prior's ends of a model file's range are not);
seen data: no prediction changes, only the band around it.

Usage::

    python benchmarks/sim_bands_backtest.py [--out benchmarks/results/sim_bands_backtest.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from moesaic.sim.uncertainty import RULES, combination_bands

RESULTS = Path(__file__).resolve().parent / "results"
FIRST = RULES[0]
TESTS = tuple(r for r in RULES if r >= FIRST + 6)  # at least six rules to fit on

Key = tuple[str, str]
Bands = dict[Key, tuple[float, float, float]]


def ratios(rule: int) -> list[tuple[Key, float]]:
    """Rule ``rule``'s (combination, measured / predicted) from its training config."""
    data = json.loads((RESULTS / f"sim_unseen{rule}.json").read_text())
    out = []
    for p in data["points"]:
        predicted = p.get("predicted_s", p.get("train", {}).get("predicted_s"))
        if "measured_s" in p and predicted:
            out.append(((p["strategy"], p["schedule"]), p["measured_s"] / predicted))
    return out


def _q(xs: Sequence[float]) -> tuple[float, float]:
    qs = statistics.quantiles(xs, n=20, method="inclusive")
    return qs[0], qs[-1]


def per_combination(by: Mapping[Key, Sequence[float]]) -> Bands:
    return {k: (_q(v)[0], statistics.median(v), _q(v)[1]) for k, v in by.items()}


def pooled(by: Mapping[Key, Sequence[float]]) -> Bands:
    med = {k: statistics.median(v) for k, v in by.items()}
    lo, hi = _q([x / med[k] for k, v in by.items() for x in v])
    return {k: (m * lo, m, m * hi) for k, m in med.items()}


CONSTRUCTIONS: dict[str, Callable[[Mapping[Key, Sequence[float]]], Bands]] = {
    "per_combination": per_combination,
    "pooled": pooled,
    "committed": combination_bands,
}


def backtest() -> dict[str, Any]:
    rows = {r: ratios(r) for r in RULES}
    out: dict[str, Any] = {"tests": {}, "fitted_from": FIRST}
    for test in TESTS:
        by: dict[Key, list[float]] = {}
        for r in range(FIRST, test):
            for k, x in rows[r]:
                by.setdefault(k, []).append(x)
        default = _q([x for v in by.values() for x in v])
        entry: dict[str, Any] = {"points": len(rows[test])}
        for name, build in CONSTRUCTIONS.items():
            bands = build(by)
            inside, widths = 0, []
            for k, x in rows[test]:
                lo, _, hi = bands.get(k, (default[0], 0.0, default[1]))
                inside += lo <= x <= hi
                widths.append(hi / lo)
            entry[name] = {
                "coverage": round(inside / len(rows[test]), 3),
                "median_width": round(statistics.median(widths), 3),
            }
        out["tests"][str(test)] = entry
    for name in CONSTRUCTIONS:
        covs = [e[name]["coverage"] for e in out["tests"].values()]
        out[name] = {"min": min(covs), "max": max(covs), "mean": round(statistics.fmean(covs), 3)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the result here as JSON")
    args = p.parse_args()
    result = backtest()
    for test, entry in result["tests"].items():
        cells = "  ".join(
            f"{name} {100 * entry[name]['coverage']:.0f}% (x{entry[name]['median_width']:.2f})"
            for name in CONSTRUCTIONS
        )
        print(f"rule {test} ({entry['points']} points): {cells}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
