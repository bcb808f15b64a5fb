"""Where the taskflow layer's time goes on the emulated CPU cluster: its tile size (issue 54, items
4 and 5, the follow-up of ``taskflow_table3.py`` and ``flashdmoe_sweeps.py``). Writes
``benchmarks/results/seeds_taskflow_tiles.json``.

    python benchmarks/seeds/taskflow_tiles.py [--quick] [--out FILE]

Both seeds runs found the taskflow layer needing 1.5-2.2x the CPU per step of ``dropless`` for
the same rows (``cpu_s_mean_rank``), and losing to it wherever that CPU is the bottleneck. A
step's tasks and puts scale with rows / ``tile_m``; if the extra CPU is per task, 4x larger
tiles cut it. The rule, fixed before measuring:

* Points: the two EP 2 points of those runs, the configurations where taskflow came closest:
  Table 3's (H 256, F 512, K 8, E 16, T 512 per rank, balanced routing, forward and backward,
  0.4 Gbit/s; slots of 256 rows: 2 tiles of 128 or 1 of 512) and FlashDMoE's center (H 128,
  F 512, K 2, E 32, T 4096, natural routing, forward only, 0.5 Gbit/s; slots of 512 rows: 4
  tiles or 1). One world per link speed, as in those runs; 0.1 ms latency.
* Added after the first pass (04:42 UTC, committed before the second): the FlashDMoE center at
  EP 4 (two ranks per core, where the CPU binds most), and ``--passes`` (the whole set again,
  each pass a fresh world; 2 for the committed result).
* Variants: dropless, taskflow static (tile 128, the default), taskflow static tile 512,
  compute only, comm only; 9 rounds after 2 warm-up, round-robin.
* Read: the time, the CPU per step and the bytes of each tile size beside dropless and the
  bound; the tile count halves or quarters, the rows and bytes do not change.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from taskflow_harness import Point, RunRecord, run_ep, summarize

OUT = Path(__file__).resolve().parents[1] / "results" / "seeds_taskflow_tiles.json"
VARIANTS = ("dropless", "taskflow static", "taskflow static, tile 512", "compute only",
            "comm only")  # fmt: skip
# (EP, Gbit/s, point)
WORLDS = (
    (2, 0.4, Point("table3_ep2", 512, 256, 512, 16, 8, "balanced", True)),
    (2, 0.5, Point("flashdmoe_center_ep2", 4096, 128, 512, 32, 2, "router", False)),
    (4, 0.5, Point("flashdmoe_center_ep4", 4096, 128, 512, 32, 2, "router", False)),
)
ROUNDS, WARMUP, LATENCY_MS = 9, 2, 0.1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke: tiny shapes, loopback, 1 round")
    ap.add_argument("--out", default=None)
    ap.add_argument("--passes", type=int, default=2, help="the whole set, this many times")
    args = ap.parse_args()

    record = RunRecord(args.quick)
    rows = []
    for i, (ep, gbps, p) in ((i, w) for i in range(args.passes) for w in WORLDS):
        if args.quick:
            p = Point(p.name, 64, 32, 64, 8, p.top_k, p.routing, p.backward)
            res = run_ep(ep, gbps, LATENCY_MS, [p], VARIANTS, 1, 1, loopback=True)[0]
        else:
            res = run_ep(ep, gbps, LATENCY_MS, [p], VARIANTS, ROUNDS, WARMUP)[0]
        s = summarize(res)
        ph = "total" if p.backward else "forward"
        print(
            f"pass {i} {p.name} {gbps:g}G {ph}: "
            + " | ".join(
                f"{n} {s['median_s'][ph][n] * 1e3:.1f} ms cpu {s['cpu_s_mean_rank'][n] * 1e3:.0f}"
                for n in VARIANTS
            )
            + f" | bound {s['bound_s'][ph] * 1e3:.1f} | x vs dropless {s['speedup_vs_dropless'][ph]}",
            flush=True,
        )
        rows.append({"pass": i, "gbps": gbps, "ep": ep, "point": res["point"], "summary": s,
                     "raw": res})  # fmt: skip
    result = record.result(
        {
            "rounds": ROUNDS,
            "warmup": WARMUP,
            "latency_ms": LATENCY_MS,
        },
        points=rows,
    )
    record.save(result, args.out, OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
