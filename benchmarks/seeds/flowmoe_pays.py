"""Where FlowMoE pays (issue 54 item 1): vanilla, moe-only and flowmoe at R = 2 and 4 over the
ratio of communication to compute, each beside its perfect-overlap bound, and the planner's pick.

**The rule that chooses the configurations** (fixed on 2026-12-04 at 04:05 UTC and committed
before any of them was planned or measured; nothing in it may change after the first
measurement):

Four factors: the link speed at three levels, and F/H, tokens per rank and ranks at two levels
each, in a fractional design of 12 points: every link speed with each of the four runs of the
2^(3-1) half fraction of the other three, whose generator is ranks = (F/H) x (tokens) on the
levels coded -1 / +1 (so F/H, tokens and ranks each sit at each level in 6 points, and the link
speed, the factor the communication share follows most, is crossed with all of them):

====  ==============================  ======================  ===============  ================
code  factor                          levels
====  ==============================  ======================  ===============  ================
L     link speed (one switch)         0.1 Gbit/s, 1.0 ms      0.3 Gbit/s,      1.0 Gbit/s,
                                      one way                 0.5 ms           0.2 ms
F     expert width F / H              4 (-1)                  16 (+1)
T     tokens per rank (seq 64)        512 = 8 seq (-1)        1024 = 16 seq (+1)
N     ranks (one per node, EP = N)    2 (-1)                  4 (+1), N = F x T
====  ==============================  ======================  ===============  ================

Fixed for all twelve: MoEGPT H = 128, 4 heads, 2 blocks, both MoE, 4 experts top-2, dropless,
fp32, T = 64, AdamW lr 1e-3, the model's defaults otherwise (RMSNorm, RoPE); every rank is a node
of its own behind one switch (every pair crosses the link); one torch thread per rank.

**What runs on each point**, side by side in one world and round-robin (the harness of
``benchmarks/flowmoe_cluster.py``, imported: a model copy per configuration, same seed, one
step of each per round, a barrier before each step; the step time is the slowest rank's):
``vanilla``; ``moe-only`` at R = 1 (the same work with no overlap, traced: vanilla's
communication share and bound, which vanilla's own spans cannot give); ``moe-only`` at R = 2,
4; ``flowmoe`` at R = 2, 4 with Sp = G/16 (G: the replicated gradients' bytes; the fixed Sp
the FlowMoE benchmark measured best, so that no tuner search is inside the measured steps).
``WARMUP`` steps each, then ``ROUNDS`` rounds. Reported per configuration: median step time,
its perfect-overlap bound max(busy compute, busy communication) from the same step's spans,
the median of per-round ratios over vanilla and over moe-only at the same R.

**Where flowmoe stops paying**: at a point, flowmoe at R "pays" when the median per-round
ratio moe-only/flowmoe at that R exceeds 1.03 (the noise of a median of ``ROUNDS`` ratios on
this machine: the FlowMoE benchmark's p10-p90 of such ratios spans about +-6%), "loses" below
0.97, and "ties" between. The boundary is read against vanilla's communication share (the
traced R = 1 row).

**The planner**: before any point is measured, ``moesaic plan --cluster --model --json`` (no
profile: the compute rate measured here, the routing prior) on each point's cluster and
training config; its pick is the fastest-ranked entry among the configurations measured here
(strategy dropless, schedules vanilla / moe-only / flowmoe, R 1-4), and whether flowmoe is
ranked above moe-only at the same R, to compare with the measured "pays".

Usage (root: the emulated network needs network namespaces)::

    python benchmarks/seeds/flowmoe_pays.py plan            # every point's plan (busy)
    python benchmarks/seeds/flowmoe_pays.py measure --points 0-5   # (quiet) parts of the sweep
    python benchmarks/seeds/flowmoe_pays.py report          # table + plot from the parts
    python benchmarks/seeds/flowmoe_pays.py measure --points 0 --loopback --rounds 1  # smoke

Results: ``benchmarks/results/seeds_flowmoe_pays.json`` (the plans and every measured part)
and ``seeds_flowmoe_pays.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness

LINKS = [(0.1, 1.0), (0.3, 0.5), (1.0, 0.2)]  # Gbit/s, ms one way
F_OVER_H = {-1: 4, +1: 16}
SEQS = {-1: 8, +1: 16}  # sequences of SEQ tokens per rank
RANKS = {-1: 2, +1: 4}
H, HEADS, BLOCKS, SEQ, EXPERTS, TOP_K = 128, 4, 2, 64, 4, 2
WARMUP = 2
ROUNDS = 6
PAYS, LOSES = 1.03, 0.97  # moe-only / flowmoe above PAYS: flowmoe pays; below LOSES: loses
OUT = Path("benchmarks/results/seeds_flowmoe_pays.json")
# (label, schedule, R, Sp) in the harness's format (Sp "fixed" = G / 16)
CONFIGS: list[tuple[str, str, int, str | None]] = [
    ("vanilla", "vanilla", 1, None),
    ("moe-only R=1 (vanilla, traced)", "moe-only", 1, "all"),
    ("moe-only R=2", "moe-only", 2, "all"),
    ("moe-only R=4", "moe-only", 4, "all"),
    ("flowmoe R=2", "flowmoe", 2, "fixed"),
    ("flowmoe R=4", "flowmoe", 4, "fixed"),
]


def points() -> list[dict[str, Any]]:
    """The rule's 12 points: each link speed x the half fraction N = F x T."""
    out = []
    for bw, lat in LINKS:
        for f in (-1, +1):
            for t in (-1, +1):
                n = f * t
                name = f"L{bw:g}_F{F_OVER_H[f]}_T{SEQS[t] * SEQ}_N{RANKS[n]}"
                out.append({
                    "name": name, "link_gbps": bw, "latency_ms": lat,
                    "f_over_h": F_OVER_H[f], "seqs": SEQS[t], "ranks": RANKS[n],
                })  # fmt: skip
    return out


def model_dict(p: dict[str, Any]) -> dict[str, Any]:
    return {
        "d_model": H,
        "n_layers": BLOCKS,
        "n_heads": HEADS,
        "seq_len": SEQ,
        "moe": {
            "num_experts": EXPERTS,
            "top_k": TOP_K,
            "ffn_hidden_size": p["f_over_h"] * H,
            "dispatcher": "dropless",
        },
    }


def cluster_toml(p: dict[str, Any]) -> str:
    return "\n".join([
        f'name = "{p["name"]}"', f"world_size = {p['ranks']}", "",
        "[[levels]]", 'name = "node"', f"size = {p['ranks']}",
        f"bandwidth_gbps = {p['link_gbps']}", f"latency_ms = {p['latency_ms']}", "",
    ])  # fmt: skip


def train_toml(p: dict[str, Any]) -> str:
    m = model_dict(p)
    lines = [f"nproc = {p['ranks']}", f"ep = {p['ranks']}", f"batch_size = {p['seqs']}", ""]
    lines += ["[model]"] + [f"{k} = {v}" for k, v in m.items() if k != "moe"]
    lines += ["", "[model.moe]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in m["moe"].items()]
    return "\n".join(lines) + "\n"


def _work(p: dict[str, Any]) -> Path:
    d = Path("/tmp/seeds_flowmoe_pays") / p["name"]
    d.mkdir(parents=True, exist_ok=True)
    (d / "cluster.toml").write_text(cluster_toml(p))
    (d / "train.toml").write_text(train_toml(p))
    return d


def _measured_entry(e: dict[str, Any]) -> tuple[str, int] | None:
    """(schedule, R) of a ranking entry among the configurations measured here, else None."""
    if e.get("strategy") != "dropless":
        return None
    opts = e.get("options", {})
    if opts.get("capacity_factor") is not None:
        return None
    schedule = e.get("schedule")
    R = int(opts.get("pipeline_degree", 1) or 1)
    if schedule == "vanilla":
        return ("vanilla", 1)
    if schedule in ("moe-only", "flowmoe") and R in (1, 2, 4):
        return (schedule, R)
    return None


def plan_point(p: dict[str, Any]) -> dict[str, Any]:
    d = _work(p)
    args = [sys.executable, "-m", "moesaic", "plan", "--cluster", str(d / "cluster.toml")]
    args += ["--model", str(d / "train.toml"), "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-800:]}
    ranking = json.loads(proc.stdout)
    rows = []
    for e in ranking:
        key = _measured_entry(e)
        if key is None:
            continue
        rows.append({
            "schedule": key[0], "R": key[1], "options": e.get("options", {}),
            "predicted_ms": e.get("predicted_ms"), "tie": e.get("tie"),
        })  # fmt: skip
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:  # the ranking is fastest first: keep each (schedule, R)'s first entry
        best.setdefault((r["schedule"], r["R"]), r)
    pick = rows[0] if rows else None
    flow_over_moe = {}
    for R in (2, 4):
        f, m = best.get(("flowmoe", R)), best.get(("moe-only", R))
        if f and m and f["predicted_ms"] and m["predicted_ms"]:
            flow_over_moe[f"R={R}"] = m["predicted_ms"] / f["predicted_ms"]
    return {
        "pick": pick,
        "overall_pick": {
            k: ranking[0].get(k) for k in ("strategy", "schedule", "options", "predicted_ms")
        },
        "best_per_config": {f"{s} R={R}": v for (s, R), v in best.items()},
        "predicted_moe_only_over_flowmoe": flow_over_moe,
        "plan_s": time.perf_counter() - t0,
    }


def point_worker(rank: int, world: int, p: dict[str, Any], rounds: int, timeout_s: float) -> Any:
    """The harness's ``timing_worker`` on this point's model and batch and our configurations."""
    import flowmoe_cluster as fc

    fc.MODEL = model_dict(p)
    fc.BATCH = p["seqs"]
    fc.CONFIGS = CONFIGS
    fc.WARMUP = WARMUP
    return fc.timing_worker(rank, world, rounds, timeout_s)


def measure_point(p: dict[str, Any], rounds: int, loopback: bool) -> dict[str, Any]:
    import flowmoe_pays as mod  # workers unpickle the worker by this module name

    import flowmoe_cluster as fc
    from moesaic.cluster.spec import ClusterSpec

    d = _work(p)
    spec = ClusterSpec.from_toml(str(d / "cluster.toml"))
    load = os.getloadavg()
    t0 = time.perf_counter()
    if loopback:
        from moesaic.comm.world import run_world

        per_rank = run_world(
            mod.point_worker, p["ranks"], p, rounds, 120.0, timeout_s=900.0, pg_timeout_s=120.0
        )
    else:
        from moesaic.cluster import EmulatedCluster

        with EmulatedCluster(spec) as cluster:
            per_rank = cluster.run(mod.point_worker, p["ranks"], p, rounds, 120.0, timeout_s=900.0)
    fc.CONFIGS = CONFIGS  # summarize reads the labels
    summary = fc.summarize(per_rank)
    return {
        "point": p,
        "wall_s": time.perf_counter() - t0,
        "load_average_1_5_15": {"before": load, "after": os.getloadavg()},
        "loopback": loopback,
        "rounds": rounds,
        "results": summary,
    }


def _load() -> dict[str, Any]:
    return json.loads(OUT.read_text()) if OUT.exists() else {}


def _save(doc: dict[str, Any]) -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, indent=1) + "\n")


def _select(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def verdict(ratio: float) -> str:
    return "pays" if ratio > PAYS else "loses" if ratio < LOSES else "ties"


def report(doc: dict[str, Any]) -> str:
    """The table (markdown) and the plot, from the measured parts."""
    rows = []
    head = (
        "| point | vanilla comm share | vanilla ms (bound) | moe-only R2 / R4 ms (bound) | "
        "flowmoe R2 / R4 ms (bound) | flowmoe x moe-only R2 / R4 | flowmoe x vanilla R2 / R4 "
        "| verdict R2 / R4 | plan pick | plan: flowmoe x moe-only R2 / R4 |"
    )
    rows.append(head)
    rows.append("|" + " --- |" * 10)
    xs, ys, cs = [], [], []
    for p in points():
        m = doc.get("measured", {}).get(p["name"])
        pl = doc.get("plans", {}).get(p["name"], {})
        if m is None:
            rows.append(f"| {p['name']} | not measured | | | | | | | | |")
            continue
        r = m["results"]

        def ms(label: str, r: dict[str, Any] = r) -> str:
            e = r[label]
            return f"{1e3 * e['step_time_s']['median']:.0f} ({1e3 * e['overlap_bound_s']['median']:.0f})"

        traced = r["moe-only R=1 (vanilla, traced)"]
        share = traced["comm_share_of_step"]["median"]
        van_bound = traced["overlap_bound_s"]["median"]
        fm = [r[f"flowmoe R={R}"][f"speedup_over_moe-only_R={R}"]["median"] for R in (2, 4)]
        fv = [r[f"flowmoe R={R}"]["speedup_over_vanilla"]["median"] for R in (2, 4)]
        pick = pl.get("pick") or {}
        pick_s = f"{pick.get('schedule')} R={pick.get('R')}" if pick else "-"
        pred = pl.get("predicted_moe_only_over_flowmoe", {})
        van = r["vanilla"]["step_time_s"]["median"]
        rows.append(
            f"| {p['name']} | {100 * share:.0f}% | {1e3 * van:.0f} ({1e3 * van_bound:.0f}) | "
            f"{ms('moe-only R=2')} / {ms('moe-only R=4')} | {ms('flowmoe R=2')} / "
            f"{ms('flowmoe R=4')} | {fm[0]:.2f} / {fm[1]:.2f} | {fv[0]:.2f} / {fv[1]:.2f} | "
            f"{verdict(fm[0])} / {verdict(fm[1])} | {pick_s} | "
            + " / ".join(f"{pred.get(f'R={R}', float('nan')):.2f}" for R in (2, 4))
            + " |"
        )
        for k, R in enumerate((2, 4)):
            xs.append(share)
            ys.append(fm[k])
            cs.append(R)
    if xs:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4))
        for R, marker in ((2, "o"), (4, "s")):
            sel = [(x, y) for x, y, c in zip(xs, ys, cs) if c == R]
            ax.scatter([x for x, _ in sel], [y for _, y in sel], marker=marker, label=f"R = {R}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhspan(LOSES, PAYS, color="grey", alpha=0.15, label="tie band")
        ax.set_xlabel("vanilla's communication share of its step (traced R = 1)")
        ax.set_ylabel("moe-only / flowmoe step time (same R)")
        ax.set_title("Where FlowMoE pays (emulated clusters, 2 CPU cores)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(OUT.with_suffix(".png"), dpi=110)
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["plan", "measure", "report", "list"])
    ap.add_argument("--points", default="0-11", help="indices, e.g. 0-5,8")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--loopback", action="store_true", help="no emulated network (smoke only)")
    args = ap.parse_args()
    pts = points()
    if args.what == "list":
        for i, p in enumerate(pts):
            print(i, p["name"])
        return 0
    doc = _load()
    if args.what == "plan":
        doc.setdefault("plans", {})
        for i in _select(args.points):
            doc["plans"][pts[i]["name"]] = plan_point(pts[i])
            print(pts[i]["name"], json.dumps(doc["plans"][pts[i]["name"]].get("pick")))
        _save(doc)
        return 0
    if args.what == "measure":
        from moesaic.bench.meta import run_metadata

        doc.setdefault("measured", {})
        for i in _select(args.points):
            res = measure_point(pts[i], args.rounds, args.loopback)
            res["meta"] = run_metadata()
            if args.loopback:
                print(
                    json.dumps({k: v["step_time_s"]["median"] for k, v in res["results"].items()})
                )
                continue  # a smoke run is never saved
            doc["measured"][pts[i]["name"]] = res
            _save(doc)  # after each point: a part cut short keeps what it measured
            print(pts[i]["name"], f"{res['wall_s']:.0f} s")
        print(report(doc))
        return 0
    print(report(doc))
    _save(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
