"""Accuracy of the emulated cluster: configured vs measured bandwidth and latency per level.

Runs, on this machine, as root:

1. ``unshaped``: two ranks joined by a link shaped far above what the machine can move
   (100 Gbit/s, 0 ms). What it measures is the emulator's floor (latency) and ceiling
   (bandwidth through tbf + the userspace delay line + gloo), the limits every other
   configuration must stay inside.
2. Each cluster file given (default: the checked-in small examples), ``--repeats`` times with a
   fresh cluster each time, reporting every repeat plus the median and spread of the errors.
3. The issue's reference cluster ``2dc_2node.toml`` (1 / 10 Gbit/s), once, to show what happens
   beyond the ceiling (it is not expected to pass on a 2-core machine).

Writes ``benchmarks/results/cluster_check.json`` with machine, versions, commit, date and config.

    sudo python benchmarks/cluster_check.py [--repeats 3] [--out FILE] [CLUSTER.toml ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from moesaic.cluster import ClusterSpec, EmulatedCluster, Level
from moesaic.cluster.system import require_support
from moesaic.cluster.verify import check

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "clusters"
DEFAULT_CLUSTERS = [EXAMPLES / "2dc_2node_small.toml", EXAMPLES / "2dc_2node_2gpu_small.toml"]
REFERENCE = EXAMPLES / "2dc_2node.toml"


def _machine() -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = "unknown"
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
        "hostname": platform.node(),
        "kernel": platform.release(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_at_start": os.getloadavg(),
    }


def _one(spec: ClusterSpec, *, duration_s: float, tolerance: float) -> dict:
    start = time.monotonic()
    with EmulatedCluster(spec) as cluster:
        report = check(cluster, duration_s=duration_s, tolerance=tolerance, timeout_s=600)
    print(report.table(), flush=True)
    return {**report.to_dict(), "wall_s": time.monotonic() - start}


def _summary(runs: list[dict]) -> list[dict]:
    """Median and spread (min..max) of each level's errors over the repeats."""
    out = []
    for i, level in enumerate(runs[0]["levels"]):
        bw = [r["levels"][i]["bandwidth_error"] for r in runs]
        lat = [r["levels"][i]["latency_error"] for r in runs]
        lat_med = [r["levels"][i]["measured_latency_median_ms"] for r in runs]
        out.append(
            {
                "level_name": level["level_name"],
                "configured_bandwidth_gbps": level["configured_bandwidth_gbps"],
                "configured_latency_ms": level["configured_latency_ms"],
                "bandwidth_error_median": statistics.median(bw),
                "bandwidth_error_range": [min(bw), max(bw)],
                "latency_error_median": statistics.median(lat),
                "latency_error_range": [min(lat), max(lat)],
                "latency_median_ms_median": statistics.median(lat_med),
                "within_tolerance_all_repeats": all(
                    r["levels"][i]["within_tolerance"] for r in runs
                ),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("clusters", nargs="*", type=Path, default=DEFAULT_CLUSTERS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=0.3)
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument("--no-reference", action="store_true", help="skip 2dc_2node.toml")
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "cluster_check.json"
    )
    args = parser.parse_args(argv)
    require_support()
    result: dict = {
        "benchmark": "cluster_check",
        "machine": _machine(),
        "config": {
            "repeats": args.repeats,
            "duration_s": args.duration_s,
            "tolerance": args.tolerance,
            "mtu_bytes": 9000,
            "latency_estimator": "min over 40 ping-pongs of RTT/2 (median also reported)",
            "bandwidth_estimator": "(big - small) bytes / (t(big) - t(small)), small = big / 4",
        },
    }
    print("== unshaped (emulator floor and ceiling)", flush=True)
    unshaped = ClusterSpec(
        levels=(Level(name="link", size=2, bandwidth_gbps=100.0, latency_ms=0.0),),
        name="unshaped",
    )
    floor = _one(unshaped, duration_s=0.5, tolerance=args.tolerance)["levels"][0]
    result["unshaped"] = {
        "note": "100 Gbit/s tbf, 0 ms: what tbf + delay line + gloo sustain on this machine",
        "bandwidth_gbps": floor["measured_bandwidth_gbps"],
        "latency_min_ms": floor["measured_latency_ms"],
        "latency_median_ms": floor["measured_latency_median_ms"],
    }
    result["clusters"] = []
    for path in args.clusters:
        spec = ClusterSpec.from_toml(path)
        runs = []
        for i in range(args.repeats):
            print(f"== {path.name} repeat {i + 1}/{args.repeats}", flush=True)
            runs.append(_one(spec, duration_s=args.duration_s, tolerance=args.tolerance))
        result["clusters"].append(
            {"file": str(path.relative_to(REPO)), "summary": _summary(runs), "runs": runs}
        )
    if not args.no_reference:
        print(f"== {REFERENCE.name} (beyond this machine's ceiling)", flush=True)
        run = _one(
            ClusterSpec.from_toml(REFERENCE), duration_s=args.duration_s, tolerance=args.tolerance
        )
        result["reference"] = {
            "file": str(REFERENCE.relative_to(REPO)),
            "note": "10 Gbit/s and 0.1 ms are beyond the unshaped ceiling/floor above",
            "run": run,
        }
    result["machine"]["load_average_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
