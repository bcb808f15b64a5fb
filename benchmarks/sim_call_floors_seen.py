"""The stored points of the unseen rules 17-32 (``--wide-rules`` for more) priced again under
variants of the pricing, summarised: each variant's folder holds ``sim_seen_repredict.py``'s
output for rules 17-26 (``r17_26.json``, ``--out``) and copies of the wide rules' results
(27-32 unless ``--wide-rules`` says otherwise) predicted again in place (``--wide``). Per
variant: the geometric-mean error and mean signed error of rules 17-26 and of the wide rules
(training configs and model files), per wide configuration, and how the fastest predicted grid
job of each wide configuration did (within 5% of the best measured, the best measured within
the tie band of it, the best measured predicted fastest).

Usage (``VARIANT=DIR`` pairs; ``benchmarks/sim_validation.md`` has the commands that made them)::

    python benchmarks/sim_call_floors_seen.py head=/tmp/var/head b2bs=/tmp/var/b2bs \
        --out benchmarks/results/sim_call_floors_seen.json
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moesaic.sim.uncertainty import TIE_BAND

WIDE = "27-32"  # the wide rules summarised unless --wide-rules names others (first-last)


def geomean_pct(errors: list[float]) -> float:
    return 100 * math.expm1(math.fsum(math.log1p(abs(e)) for e in errors) / len(errors))


def _stats(errors: list[float]) -> dict[str, float]:
    return {
        "points": len(errors),
        "error_pct": round(geomean_pct(errors), 2),
        "bias_pct": round(100 * statistics.fmean(errors), 2),
    }


def summarise(folder: Path, wide: str = WIDE) -> dict[str, Any]:
    seen = json.loads((folder / "r17_26.json").read_text())
    out: dict[str, Any] = {"17-26": _stats([p["now_s"] / p["measured_s"] - 1 for p in seen])}
    per_source: dict[str, list[float]] = collections.defaultdict(list)
    per_config: dict[str, list[float]] = collections.defaultdict(list)
    picks = {"configurations": 0, "pick_within_5pct": 0, "best_in_tie": 0, "best_first": 0}
    lo, hi = (int(x) for x in wide.split("-"))
    for rule in range(lo, hi + 1):
        data = json.loads((folder / f"sim_unseen{rule}.json").read_text())
        jobs: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        for p in data["points"]:
            measured = statistics.median(r["measured_s"] for r in p["runs"])
            for source in ("train", "file"):
                error = p[source]["predicted_s"] / measured - 1
                per_source[source].append(error)
                if source == "train":
                    per_config[p["configuration"]].append(error)
                    jobs[p["configuration"]].append((p[source]["predicted_s"], measured))
        for pts in jobs.values():
            first = min(pts)
            best = min(pts, key=lambda x: x[1])
            picks["configurations"] += 1
            picks["pick_within_5pct"] += first[1] <= 1.05 * best[1]
            picks["best_in_tie"] += best[0] <= (1 + TIE_BAND) * first[0]
            picks["best_first"] += best is first
    out[wide] = {source: _stats(errors) for source, errors in per_source.items()}
    out[wide]["per_configuration"] = {c: _stats(e) for c, e in per_config.items()}
    out[wide]["fastest_predicted_grid_job"] = picks
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="+", help="NAME=FOLDER")
    ap.add_argument("--wide-rules", default=WIDE, help="first-last of the wide rules (27 on)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = {}
    wide = args.wide_rules
    for spec in args.variants:
        name, folder = spec.split("=", 1)
        result[name] = summarise(Path(folder), wide)
        r = result[name]
        print(
            f"{name}: 17-26 {r['17-26']['error_pct']}% ({r['17-26']['bias_pct']:+}); {wide} "
            f"train {r[wide]['train']['error_pct']}%, file {r[wide]['file']['error_pct']}%; "
            f"{r[wide]['fastest_predicted_grid_job']}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
