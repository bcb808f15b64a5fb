"""Tile 512 against tile 128 across the FlashDMoE sweep's corners: does the larger tile ever cost?
(issue 54, item 5; the follow-up of ``taskflow_tiles.py``, which found the per-task CPU to be
the taskflow layer's cost at the sweep's center). Writes
``benchmarks/results/seeds_taskflow_tiles_sweep.json``.

    python benchmarks/seeds/taskflow_tiles_sweep.py [--quick] [--out FILE]

The rule, fixed before measuring: the four corners of ``flashdmoe_sweeps.py``'s EP 2 design
(tokens T 1024 and 16384 at E 32; experts E 8 and 64 at T 4096), its shapes (H 128, F 512, K 2,
natural routing, forward only), link (one switch, 0.5 Gbit/s, 0.1 ms) and rounds (7 after 2
warm-up), in one EP 2 world; variants dropless, taskflow static (tile 128), taskflow static tile
512, compute only, comm only. At T 1024 (slots of 128 rows) tile 512 pads each slot to 512 rows
without cutting the task count: the case where the larger tile can only cost.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flashdmoe_sweeps import GBPS, LATENCY_MS, ROUNDS, WARMUP, F, H, K
from taskflow_harness import Point, RunRecord, run_ep, summarize
from taskflow_tiles import VARIANTS

OUT = Path(__file__).resolve().parents[1] / "results" / "seeds_taskflow_tiles_sweep.json"
CORNERS = ((1024, 32), (16384, 32), (4096, 8), (4096, 64))  # (tokens per rank, experts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke: tiny shapes, loopback, 1 round")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    record = RunRecord(args.quick)
    if args.quick:
        points = [Point("quick", 64, 32, 64, 8, K, "router", False)]
        res = run_ep(2, GBPS, LATENCY_MS, points, VARIANTS, 1, 1, loopback=True)
    else:
        points = [Point(f"ep2_t{t}_e{e}", t, H, F, e, K, "router", False) for t, e in CORNERS]
        res = run_ep(2, GBPS, LATENCY_MS, points, VARIANTS, ROUNDS, WARMUP)
    rows = []
    for r in res:
        s = summarize(r)
        m, c = s["median_s"]["forward"], s["cpu_s_mean_rank"]
        print(
            f"{r['point']['name']}: "
            + " | ".join(f"{n} {m[n] * 1e3:.1f} ms cpu {c[n] * 1e3:.0f}" for n in VARIANTS)
            + f" | bound {s['bound_s']['forward'] * 1e3:.1f} | x {s['speedup_vs_dropless']['forward']}",
            flush=True,
        )
        rows.append({"ep": 2, "point": r["point"], "summary": s, "raw": r})
    result = record.result(
        {
            "gbps": GBPS,
            "latency_ms": LATENCY_MS,
            "rounds": ROUNDS,
            "warmup": WARMUP,
        },
        points=rows,
    )
    record.save(result, args.out, OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
