"""flowmoe against moe-only with top-1 routing and with many small experts (issue 55 item 2):
a configuration of this script's own (none of the unseen rules' 1-27) calibrated on its
emulated cluster, then each combination simulated with ``--trace`` and trained with
``--trace`` at what was simulated (flowmoe at the Sp its prediction prices), busy milliseconds
per step by lane and by task name side by side (``sim_unseen_trace.analyse``).

Usage (root: the emulated network needs network namespaces)::

    python benchmarks/sim_flowmoe_trace.py NAME [--out benchmarks/results/sim_flowmoe_trace.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_unseen_trace as sut
import sim_unseen_wide as wide

# Levels outermost first as (name, size, Gbit/s, ms one way); not one of rule 27's.
CONFIGURATIONS: dict[str, dict[str, Any]] = {
    # two data centres, top-1, a slow long link
    "t55top1": {
        "name": "t55top1",
        "levels": (("dc", 2, 0.25, 3.0),),
        "hidden": 128,
        "f_over_h": 2,
        "experts": 8,
        "top_k": 1,
        "init_std": 0.02,
        "tokens_per_rank": 1024,
    },
    # many small experts on 4 ranks
    "t55fine": {
        "name": "t55fine",
        "levels": (("node", 2, 0.8, 0.3), ("rank", 2, 4.0, 0.07)),
        "hidden": 96,
        "f_over_h": 0.5,
        "experts": 16,
        "top_k": 4,
        "init_std": 0.02,
        "tokens_per_rank": 512,
    },
}
COMBOS = (("dropless", "moe-only"), ("dropless", "flowmoe"))


def trace_one(work: Path, cfg: dict[str, Any], strategy: str, schedule: str) -> dict[str, Any]:
    config = work / f"train_{strategy}.toml"
    cluster = str(work / "cluster.toml")
    sim_trace = work / f"sim_{strategy}_{schedule}.json"
    sargs = ["simulate", "--cluster", cluster, "--model", str(config), "--profile"]
    sargs += [str(work / "p.json"), "--strategy", strategy, "--schedule", schedule, "--json"]
    sargs += ["--trace", str(sim_trace)]
    if schedule != "vanilla":
        sargs += ["--degree", str(wide.PIPELINE_DEGREE)]
    proc = wide.run_cli(sargs)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-2:]}
    sim = json.loads(proc.stdout)
    sim = sim[0] if isinstance(sim, list) else sim
    run_dir = work / f"run_{strategy}_{schedule}"
    job = work / f"job_{strategy}_{schedule}.toml"
    job.write_text(wide.job_toml(cfg, run_dir))
    trace = work / f"trace_{strategy}_{schedule}.json"
    flags = wide.combo_flags(strategy, schedule, sim.get("sp_bytes"), None)
    args = [sys.executable, "-m", "moesaic", "train", "--config", str(job), "--emulate", cluster]
    args += [*flags, "--trace", str(trace)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-3:]}
    steps = wide.steps_of(run_dir, cfg)
    return {
        "measured_s": steps["measured_s"],
        "steps_s": steps["steps_s"],
        "predicted_s": sim["iteration_ms"] / 1e3,
        "sp_bytes": sim.get("sp_bytes"),
        "simulated": {k: sim.get(k) for k in ("compute_ms", "comm_ms", "exposed_comm_ms")},
        **sut.analyse(trace, sim_trace),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(CONFIGURATIONS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", default=None, help="a profile to reuse (no calibration)")
    args = parser.parse_args()
    cfg = CONFIGURATIONS[args.name]
    work = Path(tempfile.mkdtemp(prefix=f"flowmoe_trace_{cfg['name']}_"))
    wide.write_files(work, cfg)
    if args.profile:
        (work / "p.json").write_text(Path(args.profile).read_text())
        calibration: dict[str, Any] = {"profile_from": args.profile}
    else:
        calibration = wide.calibrate(work)
    out: dict[str, Any] = {"configuration": cfg, "calibration": calibration, "runs": {}}
    for strategy, schedule in COMBOS:
        out["runs"][f"{strategy}+{schedule}"] = trace_one(work, cfg, strategy, schedule)
        print(strategy, schedule, json.dumps(out["runs"][f"{strategy}+{schedule}"]), flush=True)
    out["profile"] = json.loads((work / "p.json").read_text())
    print("work", work)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
