"""The markdown tables of docs/simulator.md (calibration) and benchmarks/sim_validation.md, from the committed results (no measurement).

Usage::

    python benchmarks/sim_tables.py [calibration|summary|points|all]

* ``calibration``: per validated cluster, the floor and the collective shares of its three
  calibrations (``sim_profile_<cluster>{,_cal2,_cal3}.json``);
* ``summary``: the validation's geometric-mean errors by group and mode
  (``sim_validation.json``'s ``summary``), and per run;
* ``points``: every validated point in the measured (loaded and idle) and fitted modes.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from sim_validate import geomean_abs  # the validation's own summary statistic

RESULTS = Path(__file__).resolve().parent / "results"
CLUSTERS = ("flowmoe_2rank", "hybridep_2dc", "hybridep_2dc2", "hybridep_4dc",
            "taskflow_0.5gbps", "taskflow_1gbps", "taskflow_2gbps")  # fmt: skip
SUFFIXES = ("", "_cal2", "_cal3")


def _shares(profile: dict[str, Any], kind: str, regime: str) -> list[float]:
    return [c["share"] for c in sorted(profile["collectives"], key=lambda c: c["bytes_per_rank"])
            if c["kind"] == kind and c.get("regime", "idle") == regime]  # fmt: skip


def _fmt(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


def calibration() -> str:
    lines = [
        "| cluster | floor ms | all-to-all share, idle | all-to-all share, loaded (3 calibrations)"
        " | all-reduce, idle | all-reduce, loaded | sizes per rank | put CPU us (3 calibrations) |",
        "| --- | ---: | --- | --- | --- | --- | --- | ---: |",
    ]
    for name in CLUSTERS:
        profiles = [json.loads((RESULTS / f"sim_profile_{name}{s}.json").read_text())
                    for s in SUFFIXES]  # fmt: skip
        first = profiles[0]
        loaded = [x for p in profiles for x in _shares(p, "all_to_all", "loaded")]
        sizes = sorted({c["bytes_per_rank"] for c in first["collectives"]})
        puts = [p["put_cpu_s"] * 1e6 for p in profiles]
        lines.append(
            f"| {name} | {first['floor_s'] * 1e3:.2f} | {_fmt(_shares(first, 'all_to_all', 'idle'))}"
            f" | {_fmt(_shares(first, 'all_to_all', 'loaded'))} ({min(loaded):.2f}-"
            f"{max(loaded):.2f}) | {_fmt(_shares(first, 'all_reduce', 'idle'))} | "
            f"{_fmt(_shares(first, 'all_reduce', 'loaded'))} | {sizes[0] / 1e3:.0f}-"
            f"{sizes[-1] / 1e3:.0f} kB | {puts[0]:.0f} ({min(puts):.0f}-{max(puts):.0f}) |"
        )
    return "\n".join(lines)


def summary() -> str:
    data = json.loads((RESULTS / "sim_validation.json").read_text())
    cals = data["summary"]["calibrations_geomean_abs_error"]
    lines = ["| calibration | loaded collectives | idle collectives |", "| --- | ---: | ---: |"]
    for key, v in cals.items():
        lines.append(f"| {key} | {100 * v['loaded']:.1f}% | {100 * v['idle']:.1f}% |")
    modes = (("rows", "measured, loaded"), ("rows_measured_idle_collectives", "measured, idle"),
             ("rows_measured_without_taskflow_cpu_model", "measured (loaded), no taskflow CPU"),
             ("rows_fitted", "fitted share (leave one run out)"),
             ("rows_links_as_checked", "cluster check's share"))  # fmt: skip
    lines += ["", "| run | " + " | ".join(m for _, m in modes) + " |",
              "| --- |" + " ---: |" * len(modes)]  # fmt: skip
    runs = sorted({r["source"] for r in data["rows"]}, key=lambda s: s.split(".")[0])
    for run in (*runs, "all"):
        cells = []
        for key, _ in modes:
            errs = [r["error"] for r in data[key] if run in ("all", r["source"])]
            signed = math.fsum(errs) / len(errs)
            cells.append(f"{100 * geomean_abs(errs):.1f}% ({100 * signed:+.1f}%)")
        n = sum(1 for r in data["rows"] if run in ("all", r["source"]))
        lines.append(f"| {run} ({n}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def points() -> str:
    data = json.loads((RESULTS / "sim_validation.json").read_text())
    lines = [
        "| run | point | measured ms | simulated ms (measured, loaded collectives) | error | "
        "simulated ms (measured, idle collectives) | error | simulated ms (fitted share) | "
        "error |",
        "| --- | --- |" + " ---: |" * 7,
    ]
    rows = zip(data["rows"], data["rows_measured_idle_collectives"], data["rows_fitted"],
               strict=True)  # fmt: skip
    for a, b, c in rows:
        run = a["source"].removesuffix(".json")
        lines.append(
            f"| {run} | {a['point']} | {a['measured_ms']:.1f} | {a['simulated_ms']:.1f} | "
            f"{100 * a['error']:+.1f}% | {b['simulated_ms']:.1f} | {100 * b['error']:+.1f}% | "
            f"{c['simulated_ms']:.1f} | {100 * c['error']:+.1f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", nargs="?", default="all",
                        choices=("calibration", "summary", "points", "all"))  # fmt: skip
    args = parser.parse_args()
    for name, fn in (("calibration", calibration), ("summary", summary), ("points", points)):
        if args.table in (name, "all"):
            print(fn(), end="\n\n")


if __name__ == "__main__":
    main()
