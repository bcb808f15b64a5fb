"""Issue 24's example, measured and simulated before and after the per-operation compute model.

Usage (root: the emulated network needs network namespaces)::

    python benchmarks/sim_opcal_check.py [--steps 6] [--out benchmarks/results/sim_opcal_check.json]
        [--cluster C.toml --model M.toml] [--profile P.json]

``--cluster`` and ``--model`` (a model file; 2-rank-divisible experts, batch divisible by 4)
measure another configuration the same way (issue 24 item 3's grid); ``--profile`` reuses a
profile ``calibrate --cluster --model`` wrote for them instead of calibrating.

The configuration is the issue's, chosen before any measurement here: 2 ranks at 120 Mbit/s and
1 ms one way, the model H 160, 3 blocks, E 6, K 2, F 1536, 4 heads, 8 x 64 tokens per rank
(``MODEL``, ``CLUSTER``), fp32, one torch thread per rank, AdamW. The runs:

1. ``moesaic calibrate --cluster CLUSTER --model MODEL`` (links, collective shares, put CPU,
   the model's operations with 1 thread and 3 experts per rank): the profile;
2. the schedules measured side by side in one world on the emulated cluster
   (``flowmoe_cluster.timing_worker``: the same model per configuration, round-robin steps, a
   barrier between steps, the slowest rank per round, median): ``CONFIGS``, R = 2 (training's
   default; moe-only also at R = 4), flowmoe with Sp = G (one chunk) and G/16; and the same on
   an unshaped loopback world (the compute the network leaves);
3. each configuration simulated with the profile as ``calibrate`` wrote it ("after": compute
   from the model's operations, CPU contention) and without ``ops`` and the communication CPU
   (``comm_cpu_s``, ``comm_cpu_per_byte_s``, ``comm_cpu_busy``)
   ("before": one FLOP rate, the ``512^3`` matmul's, and a fixed overhead per task).

The load average before and after is recorded: the machine is shared.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

CLUSTER = """name = "issue24_2rank"
world_size = 2

[[levels]]
name = "node"
size = 2
bandwidth_gbps = 0.12
latency_ms = 1.0
"""
MODEL = """[model]
name = "issue24"
layers = 3
batch = 8
seq_len = 64
hidden = 160
ffn_hidden = 1536
experts = 6
top_k = 2
heads = 4
"""


def train_model(model: Any) -> dict[str, Any]:
    """``moesaic train``'s ``[model]`` of a model file (``MoEGPT``'s defaults otherwise)."""
    return {
        "d_model": model.hidden,
        "n_layers": model.layers,
        "n_heads": model.heads,
        "seq_len": model.seq_len,
        "vocab_size": model.vocab,
        "moe": {
            "num_experts": model.experts,
            "top_k": model.top_k,
            "ffn_hidden_size": model.ffn_hidden,
            "activation": model.activation,
            "dispatcher": "dropless",
        },
    }


# (label, schedule, R, Sp: "all" = G, "fixed" = G/16), as flowmoe_cluster.CONFIGS
CONFIGS: list[tuple[str, str, int, str | None]] = [
    ("vanilla", "vanilla", 1, None),
    ("moe-only R=2", "moe-only", 2, "all"),
    ("moe-only R=4", "moe-only", 4, "all"),
    ("flowmoe R=2 Sp=G", "flowmoe", 2, "all"),
    ("flowmoe R=2 Sp=G/16", "flowmoe", 2, "fixed"),
]


def worker(
    rank: int, world: int, steps: int, timeout_s: float, model: dict[str, Any], batch: int
) -> dict[str, Any]:
    """``flowmoe_cluster.timing_worker`` on this model and these configurations."""
    import flowmoe_cluster as fc

    fc.MODEL, fc.BATCH, fc.CONFIGS = model, batch, CONFIGS
    return fc.timing_worker(rank, world, steps, timeout_s)


def _measure(spec: Any, model: Any, steps: int, loopback: bool) -> dict[str, Any]:
    import flowmoe_cluster as fc
    import sim_opcal_check as mod  # workers unpickle the function by this module name

    fc.MODEL, fc.BATCH, fc.CONFIGS = train_model(model), model.batch, CONFIGS
    args = (steps, 120.0, train_model(model), model.batch)
    if loopback:
        from moesaic.comm.world import run_world

        per_rank = run_world(mod.worker, spec.world_size, *args, timeout_s=900.0)
    else:
        from moesaic.cluster import EmulatedCluster

        with EmulatedCluster(spec) as cluster:
            per_rank = cluster.run(mod.worker, spec.world_size, *args, timeout_s=900.0)
    summary = fc.summarize(per_rank)
    return {
        label: {
            "step_ms": e["step_time_s"]["median"] * 1e3,
            "step_ms_p10_p90": [e["step_time_s"]["p10"] * 1e3, e["step_time_s"]["p90"] * 1e3],
            "busy_compute_ms": e["busy_compute_s"]["median"] * 1e3,
            "busy_comm_ms": e["busy_comm_s"]["median"] * 1e3,
            "sp_bytes": e["sp_bytes"],
        }
        for label, e in summary.items()
    }


def _simulate(spec: Any, model: Any, profile: Any, measured: dict[str, Any]) -> dict[str, Any]:
    from moesaic.sim.simulate import SimOptions, simulate

    out = {}
    for label, schedule, R, _sp in CONFIGS:
        sp = measured[label]["sp_bytes"] or None
        sim = simulate(
            spec, model, "dropless", profile, SimOptions(degree=R, sp_bytes=sp), schedule=schedule
        )
        out[label] = {
            "iteration_ms": sim.iteration_s * 1e3,
            "compute_ms": sim.compute_s * 1e3,
            "comm_ms": sim.comm_s * 1e3,
            "details": {k: v for k, v in sim.details.items() if k != "plans"},
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="measured rounds per world")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/sim_opcal_check.json"))
    ap.add_argument("--profile", default=None, help="reuse this profile (skip calibrate)")
    ap.add_argument("--cluster", default=None, help="another cluster (default: the issue's)")
    ap.add_argument("--model", default=None, help="another model file (default: the issue's)")
    args = ap.parse_args()

    from moesaic.bench.meta import run_metadata
    from moesaic.cluster.spec import ClusterSpec
    from moesaic.sim.model import ModelSpec
    from moesaic.sim.profile import Profile

    tmp = Path(tempfile.mkdtemp(prefix="sim_opcal_"))
    cluster_text = Path(args.cluster).read_text() if args.cluster else CLUSTER
    model_text = Path(args.model).read_text() if args.model else MODEL
    (tmp / "cluster.toml").write_text(cluster_text)
    (tmp / "model.toml").write_text(model_text)
    spec = ClusterSpec.from_toml(tmp / "cluster.toml")
    model = ModelSpec.from_toml(tmp / "model.toml")
    load = {"before": os.getloadavg()}
    t0 = time.perf_counter()
    profile_path = Path(args.profile) if args.profile else tmp / "profile.json"
    if not args.profile:
        cmd = [
            sys.executable,
            "-m",
            "moesaic",
            "calibrate",
            "--cluster",
            str(tmp / "cluster.toml"),
            "--model",
            str(tmp / "model.toml"),
            "--out",
            str(profile_path),
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    load["after_calibrate"] = os.getloadavg()
    measured = _measure(spec, model, args.steps, loopback=False)
    load["after_emulated"] = os.getloadavg()
    unshaped = _measure(spec, model, args.steps, loopback=True)
    load["after_loopback"] = os.getloadavg()
    after = Profile.load(profile_path)
    before = dataclasses.replace(
        after, ops=None, comm_cpu_s=0.0, comm_cpu_per_byte_s=0.0, comm_cpu_busy=0.0
    )
    sims = {
        "before": _simulate(spec, model, before, measured),
        "after": _simulate(spec, model, after, measured),
    }
    rows = []
    for label, *_ in CONFIGS:
        m = measured[label]["step_ms"]
        row = {
            "config": label,
            "measured_ms": m,
            "unshaped_ms": unshaped[label]["step_ms"],
            "measured_busy_compute_ms": measured[label]["busy_compute_ms"],
        }
        for k, s in sims.items():
            row[f"{k}_ms"] = s[label]["iteration_ms"]
            row[f"{k}_error"] = s[label]["iteration_ms"] / m - 1
            row[f"{k}_compute_ms"] = s[label]["compute_ms"]
        rows.append(row)

    def geomean(key: str) -> float:
        return math.exp(statistics.fmean(math.log(abs(r[key])) for r in rows))

    result = {
        "meta": run_metadata(),
        "rule": "issue 24's example configuration as stated in the issue (chosen before "
        "measuring); R = 2, training's default; flowmoe with Sp = G and G/16 (not tuned)",
        "cluster": cluster_text,
        "model": model_text,
        "train_model": train_model(model),
        "configs": CONFIGS,
        "steps": args.steps,
        "load_average_1_5_15": load,
        "wall_s": time.perf_counter() - t0,
        "profile": after.to_dict(),
        "rows": rows,
        "geomean_abs_error": {"before": geomean("before_error"), "after": geomean("after_error")},
        "measured": measured,
        "measured_unshaped": unshaped,
        "simulated": sims,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    head = ("meas", "unshaped", "before", "err", "after", "err")
    print(f"{'config':22} " + " ".join(f"{h:>8}" for h in head))
    for r in rows:
        print(
            f"{r['config']:22} {r['measured_ms']:7.1f} {r['unshaped_ms']:8.1f} "
            f"{r['before_ms']:7.1f} {r['before_error']:+7.1%} {r['after_ms']:7.1f} "
            f"{r['after_error']:+7.1%}"
        )
    print(json.dumps(result["geomean_abs_error"]), json.dumps(load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
