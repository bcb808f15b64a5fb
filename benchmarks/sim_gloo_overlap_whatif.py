"""What-if (not the simulator's pricing): the pipelined schedules' later all-to-alls of a block
pay no call floor of their own, as if each ran its floor on gloo's second worker thread beside
the first (``gloo_a2a_concurrency.json``: two all-to-alls issued together took 0.62-0.92x the
two in turn). Each all-to-all of microbatch r >= 2 is priced without the link's all-to-all
latency term (``LinkModel.a2a_latency_s``: the worst one-way latency, at least the measured
tiny all-to-all, ``a2a_call_s``), or with ``--overlap wire`` without at most twice the worst
link's one-way latency (a request and its answer); its bytes are priced as before. The seen
rules' pipelined points (moe-only and flowmoe, R = 2) are predicted from their stored profiles
at the runs' speed, as the rules judged them, with the simulator as it is and with the what-if, and the
geometric-mean errors printed per group of rules (17-26: the unseen rules' factorial designs;
27-32: the wider family, training configs).

Usage::

    python benchmarks/sim_gloo_overlap_whatif.py [--overlap floor|wire] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_seen_repredict as seen
from moesaic.sim import pipelined

RESULTS = Path(__file__).resolve().parent / "results"
PIPELINED = {"moe-only", "flowmoe"}
_plain_a2a = pipelined._a2a


OVERLAP = {"overlap": "floor"}  # set once by main from --overlap


def _overlapped_a2a(costs: Any, name: str, s: float, phase: str, blk: int, r: int) -> Any:
    if r >= 2:
        latency = costs.link.a2a_latency_s()
        if OVERLAP["overlap"] == "wire":  # a request and its answer across the worst link
            latency = min(latency, 2 * costs.link.worst_latency_s())
        s = max(0.0, s - latency)
    return _plain_a2a(costs, name, s, phase, blk, r)


def _both(args: list[str]) -> tuple[float | None, float | None]:
    pipelined._a2a = _plain_a2a
    now = seen.simulate_json(args)
    pipelined._a2a = _overlapped_a2a
    try:
        what = seen.simulate_json(args)
    finally:
        pipelined._a2a = _plain_a2a
    if now is None or what is None:
        return None, None
    return now["iteration_ms"] / 1e3, what["iteration_ms"] / 1e3


def wide_points(rule: int) -> list[dict[str, Any]]:
    """A wide rule's pipelined points from training configs, priced twice."""
    data = json.loads((RESULTS / f"sim_unseen{rule}.json").read_text())
    out = []
    for point, _, args in seen.wide_simulations(data, ("train",)):
        if point["schedule"] not in PIPELINED:
            continue
        now, what = _both(args)
        if now is not None:
            out.append(_row(rule, point, now, what))
    return out


def _row(rule: int, point: dict[str, Any], now: float, what: float | None) -> dict[str, Any]:
    return {
        "rule": rule,
        "configuration": point["configuration"],
        "strategy": point["strategy"],
        "schedule": point["schedule"],
        "measured_s": point["measured_s"],
        "now_s": now,
        "whatif_s": what,
    }


def seen_points(rule: int) -> list[dict[str, Any]]:
    """Rules 17-26 through ``sim_seen_repredict.repredict_rule``, priced twice."""
    rows = []
    for mode in ("now", "whatif"):
        pipelined._a2a = _plain_a2a if mode == "now" else _overlapped_a2a
        try:
            pts = seen.repredict_rule(rule, {"dropless", "padded", "hybrid"}, PIPELINED)
        finally:
            pipelined._a2a = _plain_a2a
        rows.append(pts)
    out = []
    for a, b in zip(*rows, strict=True):
        point = {k: a[k] for k in ("configuration", "strategy", "schedule", "measured_s")}
        out.append(_row(rule, point, a["now_s"], b["now_s"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument(
        "--overlap",
        choices=("floor", "wire"),
        default="floor",
        help="what a later all-to-all does not pay: its whole latency term, or at most twice "
        "the worst link's one-way latency",
    )
    args = p.parse_args()
    OVERLAP["overlap"] = args.overlap
    every: list[dict[str, Any]] = []
    summary = {}
    for name, rules, fn in (
        ("17-26", range(17, 27), seen_points),
        ("27-32", range(27, 33), wide_points),
    ):
        pts = [q for rule in rules for q in fn(rule)]
        every += pts
        now = seen.geomean_error([(q["now_s"], q["measured_s"]) for q in pts])
        what = seen.geomean_error([(q["whatif_s"], q["measured_s"]) for q in pts])
        bias = [math.log(q["whatif_s"] / q["measured_s"]) for q in pts]
        summary[name] = {
            "points": len(pts),
            "now_pct": round(now, 2),
            "whatif_pct": round(what, 2),
            "whatif_bias_pct": round(100 * math.expm1(math.fsum(bias) / len(bias)), 2),
        }
        print(name, summary[name], flush=True)
        for rule in rules:
            mine = [q for q in pts if q["rule"] == rule]
            if mine:
                print(
                    f"  rule {rule}: {len(mine)} points, now "
                    f"{seen.geomean_error([(q['now_s'], q['measured_s']) for q in mine]):.1f}%, "
                    f"what-if {seen.geomean_error([(q['whatif_s'], q['measured_s']) for q in mine]):.1f}%",
                    flush=True,
                )
    if args.out:
        out = {"overlap": args.overlap, "summary": summary, "points": every}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
