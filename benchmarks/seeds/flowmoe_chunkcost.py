"""Where flowmoe's extra time goes at the points where it loses to moe-only (issue 54 item 1):
the spans of each step, summed by lane, task kind and phase, for moe-only, flowmoe with one
all-reduce chunk (Sp = G) and flowmoe with Sp = G/16, at the same R, side by side.

Usage (root)::

    python benchmarks/seeds/flowmoe_chunkcost.py L1_F4_T512_N4 [--rounds 6] [--out FILE.json]

(``--out``: the point's part of FILE.json, other points' parts kept;
``benchmarks/results/seeds_flowmoe_chunkcost.json``.)

The point is one of ``flowmoe_pays.py``'s (its cluster, model and batch); the configurations
run in one world, round-robin, through ``flowmoe_cluster.py``'s harness (``_build``), and every
measured step's spans of every rank are reduced to: the step time, the busy (union) time of
each lane, and the summed duration of each (lane, kind, phase) (e.g. ``compute AT fwd``,
``allreduce AR bwd``) with its count. Figures per configuration: medians over rounds of the
slowest rank's step and of the per-rank mean of each sum.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness

CONFIGS: list[tuple[str, str, int, str | None]] = [
    ("moe-only R=2", "moe-only", 2, "all"),
    ("flowmoe R=2 Sp=G", "flowmoe", 2, "all"),
    ("flowmoe R=2 Sp=G/16", "flowmoe", 2, "fixed"),
    ("moe-only R=4", "moe-only", 4, "all"),
    ("flowmoe R=4 Sp=G/16", "flowmoe", 4, "fixed"),
]
WARMUP = 2


def _digest(spans: list[Any], seconds: float) -> dict[str, Any]:
    from moesaic.trace import busy_time

    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for s in spans:
        key = f"{s.resource} {s.kind} {s.args.get('phase', '')}".strip()
        sums[key] += s.duration
        counts[key] += 1
    lanes = sorted({s.resource for s in spans})
    return {
        "time_s": seconds,
        "busy_s": {lane: busy_time(spans, lane) for lane in lanes},
        "sum_s": dict(sums),
        "count": dict(counts),
    }


def worker(rank: int, world: int, point: dict[str, Any], rounds: int) -> Any:
    import torch
    import torch.distributed as dist
    from flowmoe_pays import model_dict

    import flowmoe_cluster as fc
    from moesaic.train.parallel import build_layout

    fc.MODEL = model_dict(point)
    fc.BATCH = point["seqs"]
    torch.set_num_threads(1)
    layout = build_layout(ep_size=world, timeout_s=120.0)
    batches = fc._batches(rank, 4)
    built = [fc._build(layout, rank, c) for c in CONFIGS]
    for step in built:
        for i in range(WARMUP):
            step.run(batches[i][:, :-1], batches[i][:, 1:])
    out: list[list[dict[str, Any]]] = []
    for i in range(rounds):
        x = batches[i % len(batches)]
        row = []
        for step in built:
            dist.barrier()
            rec = step.parts.recorder
            rec.clear()
            t0 = time.perf_counter()
            step.run(x[:, :-1], x[:, 1:])
            row.append(_digest(rec.events, time.perf_counter() - t0))
        out.append(row)
    for step in built:
        if hasattr(step, "close"):
            step.close()
    return out


def summarize(per_rank: list[list[list[dict[str, Any]]]]) -> dict[str, Any]:
    rounds = len(per_rank[0])
    res: dict[str, Any] = {}
    for k, (label, *_rest) in enumerate(CONFIGS):
        times = [max(r[i][k]["time_s"] for r in per_rank) for i in range(rounds)]
        keys = sorted({key for r in per_rank for i in range(rounds) for key in r[i][k]["sum_s"]})
        lanes = sorted({ln for r in per_rank for i in range(rounds) for ln in r[i][k]["busy_s"]})

        def mean_over_ranks(i: int, field: str, key: str, k: int = k) -> float:
            return statistics.mean(r[i][k][field].get(key, 0.0) for r in per_rank)

        res[label] = {
            "step_ms": 1e3 * statistics.median(times),
            "busy_ms": {
                ln: 1e3 * statistics.median(mean_over_ranks(i, "busy_s", ln) for i in range(rounds))
                for ln in lanes
            },
            "sum_ms": {
                key: 1e3
                * statistics.median(mean_over_ranks(i, "sum_s", key) for i in range(rounds))
                for key in keys
            },
            "count": {key: per_rank[0][0][k]["count"].get(key, 0) for key in keys},
        }
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("point")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import flowmoe_chunkcost as mod  # workers unpickle the worker by this module name
    from flowmoe_pays import _work, points

    from moesaic.cluster import EmulatedCluster
    from moesaic.cluster.spec import ClusterSpec

    p = next(q for q in points() if q["name"] == args.point)
    spec = ClusterSpec.from_toml(str(_work(p) / "cluster.toml"))
    load = os.getloadavg()
    t0 = time.perf_counter()
    with EmulatedCluster(spec) as cluster:
        per_rank = cluster.run(mod.worker, p["ranks"], p, args.rounds, timeout_s=900.0)
    res = summarize(per_rank)
    doc = {
        "point": p,
        "rounds": args.rounds,
        "wall_s": time.perf_counter() - t0,
        "load_average_1_5_15": {"before": load, "after": os.getloadavg()},
        "results": res,
    }
    for label, r in res.items():
        print(f"== {label}: step {r['step_ms']:.0f} ms; busy " + ", ".join(
            f"{ln} {v:.0f}" for ln, v in r["busy_ms"].items()))  # fmt: skip
        for key, v in sorted(r["sum_ms"].items(), key=lambda kv: -kv[1]):
            print(f"   {key:28} {v:7.1f} ms  x{r['count'][key]}")
    if args.out:  # one file, a part per point
        out = Path(args.out)
        parts = json.loads(out.read_text()) if out.exists() else {}
        parts[p["name"]] = doc
        out.write_text(json.dumps(parts, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
