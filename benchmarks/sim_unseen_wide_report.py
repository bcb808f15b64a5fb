"""The judgement of ``benchmarks/sim_unseen_wide.py``'s result (the twenty-seventh rule), per
source of the predictions (``train``: the training config with its measured routing; ``file``:
the model file, the routing prior):

* error: the geometric mean of ``1 + |predicted - measured| / measured`` minus 1 over every
  point (predictions at the runs' measured speed), and the median;
* coverage: the share of points whose range (``simulate --json``'s ``range_ms``) holds the
  measurement;
* per configuration: the best measured combination; whether the predictions rank it first
  (strict), within 5% of the first, or as a tie of the plan made before the runs (one of the
  plan's entries of its strategy and schedule marked ``tie``; padded at the grid's capacity);
  the plan's pick measured over the best measured.

From the twenty-ninth rule on (``"pooled"`` in the result) a plan's pick whose runs trained a
grid point's combination (equal ``combination`` records) is that point's job: its runs join
the point's before anything is judged (:func:`pooled`), and ``pick_over_best_unpooled`` gives
the ratio of its own runs to the grid's best beside the judged one.

From the thirty-second rule on (``"picks_measured"`` in the result) the plan's pick (its first
entry after the tie rule) is a measured job like the grid's: where it measured no slower than
the best grid point (``pick_fastest``), the measured fastest job is the one the plan ranked
first, and the configuration counts for the ranking clause (``first_or_tie``) as well as by
``strict`` or ``tie`` (the plan often ranks first a job the grid does not run: dropless or
hybrid at a capacity the plan may set).

Not judged, beside the pick: ``repeat_ceiling`` (:func:`repeat_ceiling`), the pick rule met by
the measurement itself, each pass's fastest measured by the other passes: the noise floor a
perfect prediction would meet.

Usage::

    python benchmarks/sim_unseen_wide_report.py [benchmarks/results/sim_unseen27.json] [--markdown]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_unseen_report import geomean_error, within_5pct
from sim_unseen_wide import SOURCES


def _combo(p: dict[str, Any]) -> str:
    return f"{p['strategy']}+{p['schedule']}"


def _in_tie(plan: list[dict[str, Any]], point: dict[str, Any]) -> bool:
    """Whether the plan marks an entry of ``point``'s strategy and schedule (padded at a
    capacity, the others without) a tie with its first."""
    for row in plan:
        if (row["strategy"], row["schedule"]) != (point["strategy"], point["schedule"]):
            continue
        capped = "capacity_factor" in row["options"]
        if capped == (point["strategy"] == "padded") and row.get("tie"):
            return True
    return False


def repeat_ceiling(points: list[dict[str, Any]]) -> list[float] | None:
    """The pick rule met by the measurement itself: for each pass, the combination fastest in
    that pass measured by the mean of the other passes, over the best of those means (a
    perfect predictor's pick at this noise; None with fewer than two passes). Not judged."""
    runs = [[r["measured_s"] for r in p["runs"] if "measured_s" in r] for p in points]
    passes = min((len(r) for r in runs), default=0)
    if passes < 2:
        return None
    out = []
    for i in range(passes):
        rest = [statistics.fmean(r[j] for j in range(passes) if j != i) for r in runs]
        pick = min(range(len(runs)), key=lambda k: runs[k][i])
        out.append(round(rest[pick] / min(rest), 3))
    return out


def pooled(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``data`` with each plan's pick that trained a grid point's combination (every
    run of it recording the combination one of the point's runs records) joined to that point:
    the point's ``measured_s`` and the pick's are the mean over the medians of both's runs; the
    pick keeps ``own_measured_s`` and names the point in ``pooled_with``."""
    data = copy.deepcopy(data)
    for c in data["configurations"]:
        mine = [p for p in data["points"] if p["configuration"] == c["name"]]
        joined: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(mine))}
        for source in SOURCES:
            pick = c.get(f"pick_{source}", {})
            runs = [r for r in pick.get("runs", []) if "measured_s" in r]
            combos = {json.dumps(r.get("combination"), sort_keys=True) for r in runs}
            if "measured_s" not in pick or len(combos) != 1 or runs[0].get("combination") is None:
                continue
            for i, p in enumerate(mine):
                if any(r.get("combination") == runs[0]["combination"] for r in p["runs"]):
                    joined[i].append(pick)
                    pick["own_measured_s"] = pick["measured_s"]
                    pick["pooled_with"] = _combo(p)
                    break
        for i, p in enumerate(mine):
            if not joined[i] or "measured_s" not in p:
                continue
            runs = p["runs"] + [r for pick in joined[i] for r in pick["runs"]]
            p["measured_s"] = statistics.fmean(r["measured_s"] for r in runs if "measured_s" in r)
            for pick in joined[i]:
                pick["measured_s"] = p["measured_s"]
    return data


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """The judgement (module docstring); pooled first where the rule pools equal jobs."""
    if not data.get("pooled"):
        return _summarize(data)
    out = _summarize(pooled(data))
    raw = _summarize(data)
    for source in SOURCES:
        for c, r in zip(out[source]["configurations"], raw[source]["configurations"], strict=True):
            c["pick_over_best_unpooled"] = r["pick_over_best"]
    return out


def _summarize(data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    picks_measured = bool(data.get("picks_measured"))
    for source in SOURCES:
        points = [
            p
            for p in data["points"]
            if "measured_s" in p and p[source].get("predicted_s") is not None
        ]
        errors = [abs(p[source]["predicted_s"] / p["measured_s"] - 1) for p in points]
        covered = [
            p[source]["range_s"][0] <= p["measured_s"] <= p[source]["range_s"][1]
            for p in points
            if p[source].get("range_s")
        ]
        configs = []
        for c in data["configurations"]:
            mine = [p for p in points if p["configuration"] == c["name"]]
            if not mine:
                continue
            best = min(mine, key=lambda p: p["measured_s"])
            first = min(mine, key=lambda p: p[source]["predicted_s"])
            plan = c.get(f"plan_{source}_calibrated", [])
            pick = c.get(f"pick_{source}", {})
            configs.append(
                {
                    "configuration": c["name"],
                    "best_measured": _combo(best),
                    "best_measured_ms": round(best["measured_s"] * 1e3, 1),
                    "ranked_first": _combo(first),
                    "ranked_first_over_best": round(first["measured_s"] / best["measured_s"], 3),
                    "strict": first is best,
                    "within_5pct": within_5pct(
                        best[source]["predicted_s"], first[source]["predicted_s"]
                    ),
                    "tie": _in_tie(plan, best),
                    "plan_pick": (
                        f"{plan[0]['strategy']}+{plan[0]['schedule']} "
                        f"{json.dumps(plan[0]['options'])}"
                        if plan
                        else None
                    ),
                    "pick_over_best": (
                        round(pick["measured_s"] / best["measured_s"], 3)
                        if "measured_s" in pick
                        else None
                    ),
                    "pick_fastest": (
                        "measured_s" in pick and pick["measured_s"] <= best["measured_s"]
                    ),
                    "repeat_ceiling": repeat_ceiling(mine),
                }
            )
        geo = geomean_error(errors)
        out[source] = {
            "points": len(points),
            "geomean_error": geo,
            "median_error": statistics.median(errors) if errors else None,
            "range_coverage": sum(covered) / len(covered) if covered else None,
            "strict": sum(c["strict"] for c in configs),
            "within_5pct": sum(c["within_5pct"] for c in configs),
            "first_or_tie": sum(
                c["strict"] or c["tie"] or (picks_measured and c["pick_fastest"]) for c in configs
            ),
            "pick_within_5pct": sum(
                c["pick_over_best"] is not None and c["pick_over_best"] <= 1.05 for c in configs
            ),
            "configurations": configs,
        }
    return out


def markdown(data: dict[str, Any], s: dict[str, Any]) -> str:
    rows = [
        "| configuration | combination | measured ms (runs) | training config ms (range) "
        "| error | model file ms (range) | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in data["points"]:
        if "measured_s" not in p:
            why = "; ".join(str(r.get("error")) for r in p["runs"] if "error" in r)
            rows.append(f"| {p['configuration']} | {_combo(p)} | failed: {why[:120]} | | | | |")
            continue
        runs = ", ".join(f"{r['measured_s'] * 1e3:.0f}" for r in p["runs"] if "measured_s" in r)
        cells = [p["configuration"], _combo(p), f"{p['measured_s'] * 1e3:.0f} ({runs})"]
        for source in SOURCES:
            pred = p[source]
            if pred.get("predicted_s") is None:
                cells += ["-", "-"]
                continue
            lo, hi = pred.get("range_s") or (math.nan, math.nan)
            err = pred["predicted_s"] / p["measured_s"] - 1
            cells += [f"{pred['predicted_s'] * 1e3:.0f} ({lo * 1e3:.0f}-{hi * 1e3:.0f})"]
            cells += [f"{err:+.0%}"]
        rows.append("| " + " | ".join(cells) + " |")
    for source in SOURCES:
        rows += [
            "",
            f"**{source}**: error {s[source]['geomean_error']:.1%} (geometric mean), "
            f"range coverage {s[source]['range_coverage']:.0%}",
            "",
            "| configuration | best measured | ranked first (its measured / best) | strict "
            "| within 5% | tie | plan pick | pick / best | pick fastest | one pass's pick / best |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in s[source]["configurations"]:
            rows.append(
                f"| {c['configuration']} | {c['best_measured']} ({c['best_measured_ms']:.0f} ms) "
                f"| {c['ranked_first']} ({c['ranked_first_over_best']:.2f}) "
                f"| {'yes' if c['strict'] else 'no'} | {'yes' if c['within_5pct'] else 'no'} "
                f"| {'yes' if c['tie'] else 'no'} | {c['plan_pick']} | {c['pick_over_best']} "
                f"| {'yes' if c['pick_fastest'] else 'no'} | {c['repeat_ceiling']} |"
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", default="benchmarks/results/sim_unseen27.json")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    with open(args.path) as f:
        data = json.load(f)
    s = summarize(data)
    if args.markdown:
        print(markdown(data, s))
    print(json.dumps(s, indent=1))


if __name__ == "__main__":
    main()
