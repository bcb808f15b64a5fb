"""Does the unseen-rule protocol's flowmoe measurement depend on Sp? One configuration of
``sim_unseen.py``'s rules, padded: moe-only, flowmoe with ``ar_chunk = "auto"`` (what the grid
runs: 2 + 6 steps, so the measured steps are the tuner's first samples) and flowmoe at Sp = G/16
(what the simulator prices), interleaved, ``--reps`` times each.

``python benchmarks/sim_unseen_sp_check.py x+-+-- [--reps 2] [--baselines moe-only,vanilla]
[--out FILE.json]`` (``--baselines``: the schedules measured beside flowmoe; moe-only by
default).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import sim_unseen as su
from moesaic.train.model_files import load_model_spec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("configuration", help="a sim_unseen configuration name, e.g. x+-+--")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--baselines", default="moe-only", help="comma list of schedules")
    p.add_argument("--work", default="/tmp/sim_unseen_sp_check")
    p.add_argument("--out", default="benchmarks/results/sim_unseen_sp_check.json")
    args = p.parse_args()
    cfg = su.find_configuration(args.configuration)
    work = Path(args.work) / cfg["name"]
    work.mkdir(parents=True, exist_ok=True)
    (work / "cluster.toml").write_text(su.cluster_toml(cfg))
    (work / "model.toml").write_text(su.train_toml(cfg, work / "unused", "padded"))
    spec = load_model_spec(work / "model.toml")
    G = (spec.layers * spec.replicated_params_per_block() + spec.outer_params()) * spec.param_bytes
    runs = []
    for rep in range(args.reps):
        plain = [(schedule, None) for schedule in args.baselines.split(",")]
        for schedule, sp in (*plain, ("flowmoe", "auto"), ("flowmoe", str(G // 16))):
            run_dir = work / f"run_{schedule}_{sp}_{rep}"
            config = work / f"train_{rep}.toml"
            config.write_text(su.train_toml(cfg, run_dir, "padded"))
            cmd = [sys.executable, "-m", "moesaic", "train", "--config", str(config)]
            cmd += ["--emulate", str(work / "cluster.toml"), *su.combo_flags("padded", schedule)]
            cmd += ["--ar-chunk", sp] if sp is not None else []
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                print(f"{schedule} {sp}: failed: {proc.stderr.strip()[-300:]}", file=sys.stderr)
                continue
            r = {"schedule": schedule, "ar_chunk": sp, "rep": rep, **su._steps(run_dir, cfg)}
            r["wall_s"] = time.perf_counter() - t0
            su._drop_checkpoints(run_dir)
            runs.append(r)
            print(f"{schedule:8s} Sp {sp}: {r['measured_s']:.4f} s", flush=True)
    out = {"configuration": cfg["name"], "strategy": "padded", "G_bytes": G, "runs": runs}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
