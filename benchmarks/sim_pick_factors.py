"""What made the planner's rule-5 pick fast: its capacity or its Sp? On configurations of
``sim_unseen.py``'s fifth rule the pick (dropless + flowmoe, R = 2, capacity 1.25, Sp = G / 4)
measured 0.74-1.12x the grid's best combination, and the grid's dropless + flowmoe ran without a
capacity at Sp = G / 16. This measures dropless + flowmoe at R = 2 in the 2 x 2 of capacity
(none, 1.25) and Sp (G / 16, G / 4), interleaved, ``--reps`` times each, and predicts each with
the configuration's stored profile (``benchmarks/results/sim_unseen5.json``), so that the
simulator's effect of each factor stands beside the measured one. Measured after the rule, on
its configurations: an explanation, not a validation.

``python benchmarks/sim_pick_factors.py y-+-+- y+++-+ [--reps 2] [--out FILE.json]``; other grids
with ``--capacities none,1.25`` and ``--sp-divisors 16,4`` (the defaults: Sp = G / n for each n).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import sim_unseen as su


def _predict(work: Path, model: Path, sp: int) -> float:
    args = [sys.executable, "-m", "moesaic", "simulate", "--cluster", str(work / "cluster.toml")]
    args += ["--model", str(model), "--profile", str(work / "p.json"), "--json"]
    args += ["--strategy", "dropless", "--schedule", "flowmoe", "--degree", "2"]
    args += ["--sp-bytes", str(sp)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, check=True)
    out = json.loads(proc.stdout)
    return (out[0] if isinstance(out, list) else out)["iteration_ms"] / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("configurations", nargs="+", help="fifth-rule configuration names")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--rule-file", default="benchmarks/results/sim_unseen5.json")
    p.add_argument("--work", default="/tmp/sim_pick_factors")
    p.add_argument("--out", default="benchmarks/results/sim_pick_factors.json")
    p.add_argument("--capacities", default="none,1.25", help="comma list: none or a factor")
    p.add_argument("--sp-divisors", default="16,4", help="comma list of n: Sp = G / n")
    args = p.parse_args()
    rule = json.loads(Path(args.rule_file).read_text())
    stored = {c["name"]: c for c in rule["configurations"]}
    result: dict = {"note": __doc__, "configurations": []}
    for name in args.configurations:
        cfg = su.find_configuration(name)
        work = Path(args.work) / name
        work.mkdir(parents=True, exist_ok=True)
        (work / "cluster.toml").write_text(su.cluster_toml(cfg))
        (work / "p.json").write_text(json.dumps(stored[name]["profile"]))
        grid_sp = next(
            pt["sp_bytes"]
            for pt in rule["points"]
            if pt["configuration"] == name and pt["schedule"] == "flowmoe" and "sp_bytes" in pt
        )
        G = 16 * grid_sp
        caps = [None if x == "none" else float(x) for x in args.capacities.split(",")]
        sps = [G // int(n) for n in args.sp_divisors.split(",")]
        cases = [(cap, sp) for cap in caps for sp in sps]
        entry: dict = {"configuration": name, "G_bytes": G, "cases": []}
        for cap, sp in cases:
            model = work / f"model_{cap}.toml"
            model.write_text(su.job_toml(cfg, work / "unused", capacity=cap))
            entry["cases"].append(
                {"capacity": cap, "ar_chunk": sp, "predicted_s": _predict(work, model, sp)}
            )
        for rep in range(args.reps):
            for case in entry["cases"]:
                cap, sp = case["capacity"], case["ar_chunk"]
                run_dir = work / f"run_{cap}_{sp}"
                shutil.rmtree(run_dir, ignore_errors=True)
                config = work / f"train_{cap}.toml"
                config.write_text(su.job_toml(cfg, run_dir, capacity=cap))
                cmd = [sys.executable, "-m", "moesaic", "train", "--config", str(config)]
                cmd += ["--emulate", str(work / "cluster.toml")]
                cmd += su.combo_flags("dropless", "flowmoe", sp)
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                su._drop_checkpoints(run_dir)
                if proc.returncode != 0:
                    case.setdefault("errors", []).append(proc.stderr.strip()[-300:])
                    continue
                run = {"rep": rep, **su._steps(run_dir, cfg), "wall_s": time.perf_counter() - t0}
                case.setdefault("runs", []).append(run)
                print(name, cap, sp, f"{run['measured_s']:.4f}", flush=True)
        for case in entry["cases"]:
            medians = [r["measured_s"] for r in case.get("runs", [])]
            if medians:
                case["measured_s"] = sum(medians) / len(medians)
        result["configurations"].append(entry)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
