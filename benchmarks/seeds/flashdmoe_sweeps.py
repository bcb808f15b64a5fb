"""FlashDMoE's sweeps (thesis Tables 6.3-6.5: tokens, experts, GPUs) and its payload efficiency
(Fig. 6.3b) on the emulated CPU cluster (issue 54, item 5). Writes
``benchmarks/results/seeds_flashdmoe_sweeps.json`` and ``seeds_flashdmoe_sweeps.png``.

    python benchmarks/seeds/flashdmoe_sweeps.py [--quick] [--out FILE] [--plot-only]

The rule, fixed before measuring (commit of this docstring precedes the result):

* Paper: one MoE layer's forward latency (H 1024, F 4096, top-2, capacity factor 1.0, FP32 for
  FlashDMoE) on 8 H100s; tokens T 1K-8K at E 32 (Table 6.3), experts E 16-128 at T 8K (Table
  6.4), GPUs 2 / 4 / 8 at E 32, T 8K with the tokens per GPU constant (Table 6.5, so T counts
  tokens per GPU); the baselines (Megatron-LM, Comet, FasterMoE, DeepEP) pad to the capacity,
  FlashDMoE sends only the routed tokens (in-place padding, §5.4).
* Ours: the forward of one layer (as the paper's tables), fp32, top-2, F = 4H as the paper, with
  H = 128, F = 512 (the paper's 1024 x 4096 would make the 16K-token point a 50 GFLOP forward
  per rank, seconds on one core); T = tokens per rank; natural routing: the layer's own
  (untrained) gate on a random input, the same for every variant, its imbalance (largest
  expert load over the mean) recorded per point.
* Points: a one-factor-at-a-time design around the center (EP 2, E 32, T 4096):
  tokens T in {1024, 2048, 4096, 8192, 16384} at EP 2, E 32; experts E in {8, 16, 32, 64} at
  EP 2, T 4096; ranks EP in {2, 4} at E 32, T 4096, and EP 4 also at T {1024, 16384} (E 32)
  and E {8, 64} (T 4096), so each factor's sweep is seen at both EP sizes where it is cheap.
  EP 4 is the most the 2 cores hold (one thread per rank); the paper's 8 GPUs are not.
* Link: one level, 0.1 ms, 0.5 Gbit/s: at the center the forward's off-rank bytes at line
  rate take as long as its expert FLOPs at 50 GFLOP/s (one core's measured fp32 GEMM rate):
  8192 rows x 6*H*F = 3.2 GFLOP -> 64 ms; 8192 rows x 512 B x 1/2 x 2 (dispatch, combine)
  = 4.2 MB = 34 Mbit -> 0.52 Gbit/s.
* Variants: ``dropless`` (all-to-all-v of the exact rows: Megatron-LM's dropless path),
  ``padded`` (every (source rank, expert) slot padded to the group's largest load, no drops:
  the padding baselines, without the capacity factor's drops so the work is equal),
  ``taskflow dynamic`` (FlashDMoE's design: scheduler + processor pool, one-sided puts of
  only the routed rows), ``taskflow static`` (HyperParallel-MoE's compiled order), ``compute
  only`` and ``comm only`` for the bound max(compute, comm). Bytes sent per rank counted on
  the wire and by the library (``taskflow_harness``).
* Rounds: 7 measured after 2 warm-up, round-robin within each point.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from taskflow_harness import Point, RunRecord, run_ep, summarize

RESULTS = Path(__file__).resolve().parents[1] / "results"
OUT = RESULTS / "seeds_flashdmoe_sweeps.json"
H, F, K = 128, 512, 2
GBPS, LATENCY_MS = 0.5, 0.1
VARIANTS = ("dropless", "padded", "taskflow dynamic", "taskflow static", "compute only",
            "comm only")  # fmt: skip
CENTER = {"tokens": 4096, "experts": 32}
TOKENS = (1024, 2048, 4096, 8192, 16384)
EXPERTS = (8, 16, 32, 64)
# EP -> (tokens, experts) points
DESIGN = {
    2: sorted({(t, 32) for t in TOKENS} | {(4096, e) for e in EXPERTS}),
    4: sorted({(t, 32) for t in (1024, 4096, 16384)} | {(4096, e) for e in (8, 32, 64)}),
}
ROUNDS, WARMUP = 7, 2
# the paper's tables (ms): FlashDMoE and the baselines
PAPER = {
    "tokens_E32_8gpu": {
        "x": [1024, 2048, 4096, 8192],
        "FlashDMoE": [2.07, 1.90, 2.19, 2.33],
        "Comet": [2.87, 5.12, 9.54, 19.01],
        "FasterMoE": [3.85, 5.04, 7.44, 12.37],
        "Megatron": [2.59, 3.83, 5.83, 10.32],
        "DeepEP": [3.80, 3.83, 4.62, 7.12],
    },
    "experts_T8K_8gpu": {
        "x": [16, 32, 64, 128],
        "FlashDMoE": [1.20, 2.33, 4.20, 8.20],
        "Comet": [19.01, 19.01, 19.21, 19.36],
        "FasterMoE": [11.38, 12.37, 16.64, 22.65],
        "Megatron": [10.47, 10.32, 10.47, 10.47],
        "DeepEP": [5.59, 7.12, 7.49, 11.30],
    },
    "gpus_E32_T8K": {
        "x": [2, 4, 8],
        "FlashDMoE": [6.00, 1.98, 2.33],
        "Comet": [7.26, 10.98, 19.01],
        "FasterMoE": [14.28, 13.59, 12.37],
        "Megatron": [6.59, 7.82, 10.32],
        "DeepEP": [9.65, 6.72, 7.12],
    },
}
SHOWN = ("dropless", "padded", "taskflow dynamic", "taskflow static")
COLORS = {"dropless": "C0", "padded": "C1", "taskflow dynamic": "C2", "taskflow static": "C3"}


def _line(ep: int, s: dict[str, Any], p: dict[str, Any], imb: float) -> str:
    m, b = s["median_s"]["forward"], s["bound_s"]["forward"]
    mb = s["wire_bytes_mean_rank"]
    return (
        f"EP{ep} T{p['tokens']} E{p['experts']} (load max/mean {imb:.2f}): "
        + " | ".join(f"{n} {m[n] * 1e3:.1f} ms {mb[n] / 1e6:.2f} MB" for n in m)
        + f" | bound {b * 1e3:.1f}"
    )


def plot(result: dict[str, Any], path: Path) -> None:
    """Forward ms against tokens, experts and ranks (bound dashed), and the bytes on the wire."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]

    def pick(ep: int, key: str, fixed: dict[str, int]) -> list[dict[str, Any]]:
        sel = [
            r
            for r in pts
            if r["ep"] == ep and all(r["point"][k] == v for k, v in fixed.items() if k != key)
        ]
        return sorted(sel, key=lambda r: r["point"][key])

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for ax, key in zip(axes[:2], ("tokens", "experts")):
        for ep, style in ((2, "-"), (4, ":")):
            rows = pick(ep, key, CENTER)
            if not rows:
                continue
            xs = [r["point"][key] for r in rows]
            for n in SHOWN:
                ax.plot(xs, [r["summary"]["median_s"]["forward"][n] * 1e3 for r in rows],
                        style, marker="o", color=COLORS[n], label=f"{n} EP{ep}")  # fmt: skip
            ax.plot(xs, [r["summary"]["bound_s"]["forward"] * 1e3 for r in rows], style,
                    color="k", label=f"bound EP{ep}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"{key} (per rank)" if key == "tokens" else key)
        ax.set_ylabel("forward ms")
        ax.set_title(f"{key} sweep (center T 4096, E 32)")
    ax = axes[2]
    rows = sorted(
        (r for r in pts if all(r["point"][k] == v for k, v in CENTER.items())),
        key=lambda r: r["ep"],
    )
    xs = [r["ep"] for r in rows]
    for n in SHOWN:
        ax.plot(xs, [r["summary"]["median_s"]["forward"][n] * 1e3 for r in rows], marker="o",
                color=COLORS[n], label=n)  # fmt: skip
    ax.plot(xs, [r["summary"]["bound_s"]["forward"] * 1e3 for r in rows], "k--", label="bound")
    ax.set_xlabel("EP ranks")
    ax.set_ylabel("forward ms")
    ax.set_title("ranks (T 4096 per rank, E 32)")
    ax = axes[3]
    for r in pts:
        s = r["summary"]
        for n, mk in (("dropless", "o"), ("padded", "s"), ("taskflow dynamic", "^")):
            ax.scatter(s["median_s"]["forward"][n] * 1e3, s["wire_bytes_mean_rank"][n] * 8,
                       marker=mk, color=COLORS[n], label=n if r is pts[0] else None)  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("forward ms")
    ax.set_ylabel("bits on the wire per rank")
    ax.set_title("payload efficiency (Fig. 6.3b analogue; every point)")
    for ax in axes:
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke: tiny shapes, loopback, 1 round")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out")
    args = ap.parse_args()
    out = Path(args.out) if args.out else OUT
    if args.plot_only:
        plot(json.loads(out.read_text()), out.with_suffix(".png"))
        return 0

    record = RunRecord(args.quick)
    rows = []
    for ep, design in DESIGN.items():
        if args.quick:
            points = [Point(f"quick_ep{ep}", 64, 32, 64, 8, K, "router", False)]
            res = run_ep(ep, GBPS, LATENCY_MS, points, VARIANTS, 1, 1, loopback=True)
        else:
            points = [Point(f"ep{ep}_t{t}_e{e}", t, H, F, e, K, "router", False) for t, e in design]
            res = run_ep(ep, GBPS, LATENCY_MS, points, VARIANTS, ROUNDS, WARMUP)
        for r in res:
            s = summarize(r)
            print(_line(ep, s, r["point"], r["expert_load_max_over_mean"]), flush=True)
            rows.append({"ep": ep, "point": r["point"], "summary": s, "raw": r})
    result = record.result(
        {
            "hidden": H,
            "ffn": F,
            "top_k": K,
            "gbps": GBPS,
            "latency_ms": LATENCY_MS,
            "rounds": ROUNDS,
            "warmup": WARMUP,
            "phase": "forward",
        },
        paper_ms=PAPER,
        points=rows,
    )
    if not args.quick or args.out:
        out.write_text(json.dumps(result, indent=1) + "\n")
        plot(result, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
