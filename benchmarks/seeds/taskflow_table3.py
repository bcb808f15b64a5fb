"""HyperParallel-MoE Table 3 (Dispatch-to-Combine latency, forward and backward apart, balanced
routing) and rank-aware task reordering (RATR, §4.5) on the emulated CPU cluster (issue 54,
item 4). Writes ``benchmarks/results/seeds_taskflow_table3.json``.

    python benchmarks/seeds/taskflow_table3.py [--quick] [--out FILE]

The rule, fixed before measuring (commit of this docstring precedes the result):

* Paper: DeepSeek-V3 MoE-FFN (H 7168, F 2048, top-k 8, 8 local experts per rank, bf16), forced
  balanced routing, EP 4 / 8 / 16; baseline the operator-by-operator path with collective
  all-to-all; HyperParallel-MoE with one-sided puts, RATR and backward GMM interleaving.
* Ours, kept from the paper: top-k K = 8, 8 local experts per rank (E = 8 * EP), balanced
  routing (every (source rank, expert) slot gets T*K/E rows), forward and backward timed apart
  (the module interval: dispatch to combine; the gate is outside it as in the paper), the
  taskflow layer with its defaults (static executor, RATR and interleaving on) against
  ``dropless`` (the operator-by-operator baseline with all-to-all-v) and ``padded``.
* Changed for this machine: EP 2 and 4 (2 cores hold at most 4 ranks of one thread each);
  fp32; H = 256, F = 512 (the CPU layer shape of ``benchmarks/taskflow_cluster.py``: the
  paper's F/H = 2/7 would leave 73-column GEMMs, which a CPU core runs at a fraction of its
  rate, so the tile overhead, not the schedule, would decide); T = 512 tokens per rank
  (T*K = 4096 rows: slots of 256 rows at EP 2, 128 at EP 4, i.e. 2 or 1 tiles of 128).
* Link: one level (every rank under one switch), 0.1 ms, 0.4 Gbit/s: the bandwidth at which
  the forward's off-rank bytes at EP 4 take, at line rate, as long as its expert FLOPs on the
  2 cores at 50 GFLOP/s (one core's measured fp32 GEMM rate): 4 ranks x 4096 rows x 6*H*F =
  12.9 GFLOP / 100 GFLOP/s = 129 ms; 2 x 4096 rows x 1 KiB x 3/4 = 6.3 MB = 50 Mbit / 129 ms
  = 0.39 Gbit/s. Comm and compute near equal is where overlap has the most to win (and
  where the paper's own figures put it: its baseline forward of 16.3 ms is about its GEMMs'
  time at the accelerator's rate).
* RATR (item 4's second half): the same layer at EP 4 with ``taskflow static`` and
  ``taskflow static, no RATR`` side by side in both worlds above, and in a third world at
  EP 4 with a 4x slower link (0.1 Gbit/s: communication 4x the compute), where balancing the
  destinations has the most to win; every rank's link is shaped both ways, so puts from
  several ranks to one destination share that rank's switch port (the hotspot RATR avoids).
* Variants: dropless, padded, taskflow static, taskflow static no RATR, compute only, comm
  only (``taskflow_harness``), bound = max(compute only, comm only) per phase.
* Rounds: 7 measured after 2 warm-up at EP 2 and 4 (0.4 Gbit/s); 9 after 2 in the RATR world.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from taskflow_harness import Point, RunRecord, run_ep, summarize

OUT = Path(__file__).resolve().parents[1] / "results" / "seeds_taskflow_table3.json"
H, F, K, LOCAL, T = 256, 512, 8, 8, 512
LATENCY_MS = 0.1
TABLE3 = ("dropless", "padded", "taskflow static", "taskflow static, no RATR",
          "compute only", "comm only")  # fmt: skip
RATR = ("dropless", "taskflow static", "taskflow static, no RATR", "compute only", "comm only")
# (name, ep, Gbit/s, variants, rounds)
WORLDS = (
    ("table3", 2, 0.4, TABLE3, 7),
    ("table3", 4, 0.4, TABLE3, 7),
    ("ratr", 4, 0.1, RATR, 9),
)
# the paper's Table 3 (ms): EP -> phase -> (baseline, HyperParallel-MoE)
PAPER = {
    4: {"forward": (16.3, 10.2), "backward": (27.9, 19.4), "total": (44.2, 29.6)},
    8: {"forward": (17.3, 10.3), "backward": (29.8, 19.6), "total": (47.1, 29.9)},
    16: {"forward": (18.4, 11.2), "backward": (30.5, 19.9), "total": (48.9, 31.1)},
}


def _row(name: str, ep: int, gbps: float, s: dict[str, Any]) -> str:
    lines = []
    for ph in ("forward", "backward", "total"):
        m, b = s["median_s"][ph], s["bound_s"][ph]
        cells = " | ".join(f"{n} {m[n] * 1e3:.1f}" for n in m)
        sp = s["speedup_vs_dropless"][ph]
        lines.append(
            f"{name} EP{ep} {gbps:g}G {ph}: {cells} | bound {b * 1e3:.1f} | "
            + ", ".join(f"{n} x{v:.2f}" for n, v in sp.items())
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke: tiny shape, loopback, 1 round")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    record = RunRecord(args.quick)
    worlds = []
    for name, ep, gbps, variants, rounds in WORLDS:
        if args.quick:
            p = Point(f"{name}_quick", 64, 32, 64, 4 * ep, 4, "balanced", True)
            res = run_ep(ep, gbps, LATENCY_MS, [p], variants, 1, 1, loopback=True)
        else:
            p = Point(f"{name}_ep{ep}", T, H, F, LOCAL * ep, K, "balanced", True)
            res = run_ep(ep, gbps, LATENCY_MS, [p], variants, rounds, 2)
        s = summarize(res[0])
        print(_row(name, ep, gbps, s), flush=True)
        worlds.append({"name": name, "ep": ep, "gbps": gbps, "summary": s, "raw": res[0]})
    result = record.result(
        {
            "hidden": H,
            "ffn": F,
            "top_k": K,
            "local_experts": LOCAL,
            "tokens_per_rank": T,
            "latency_ms": LATENCY_MS,
        },
        paper_table3_ms=PAPER,
        worlds=worlds,
    )
    record.save(result, args.out, OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
