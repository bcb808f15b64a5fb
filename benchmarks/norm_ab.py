"""A/B of a training-step change on the emulated clusters: the same ``moesaic train --emulate``
runs with two source trees (``PYTHONPATH``), interleaved over rounds so that a slow stretch of
the machine does not fall on one version. Used for the gradient norm (``moesaic.gradnorm``):
``benchmarks/results/norm_ab.json``.

The cases are configurations of ``sim_unseen.py``'s rules with its training configs and flags;
``measured_s`` is rank 0's median step after the warm-up.

Usage (root; an otherwise idle machine)::

    git worktree add /tmp/abold 994c8e8   # the tree before the change
    python benchmarks/norm_ab.py --old /tmp/abold/src --new src --out F.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_unseen as su

# (configuration, strategy, schedule, Sp bytes or None)
CASES = (
    ("y++---", "dropless", "vanilla", None),
    ("y++---", "dropless", "flowmoe", 142200),
    ("y++---", "padded", "moe-only", None),
    ("y+--++", "dropless", "vanilla", None),
    ("y+--++", "padded", "flowmoe", 140280),
)


def run(work: Path, cfg: dict, strategy: str, schedule: str, sp: int | None, src: str) -> dict:
    """One emulated run with ``src`` first on the path."""
    run_dir = work / "run"
    subprocess.run(["rm", "-rf", str(run_dir)], check=False)
    config = work / f"train_{strategy}.toml"
    config.write_text(su.train_toml(cfg, run_dir, strategy))
    args = [sys.executable, "-m", "moesaic", "train", "--config", str(config)]
    args += ["--emulate", str(work / "cluster.toml"), *su.combo_flags(strategy, schedule, sp)]
    env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
    su._drop_checkpoints(run_dir)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return su._steps(run_dir, cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the source tree before the change")
    ap.add_argument("--new", required=True, help="the source tree after it")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = []
    for rnd in range(args.rounds):
        for name, strategy, schedule, sp in CASES:
            cfg = su.find_configuration(name)
            work = Path(f"/tmp/norm_ab_{name}")
            work.mkdir(exist_ok=True)
            (work / "cluster.toml").write_text(su.cluster_toml(cfg))
            for version, src in (("old", args.old), ("new", args.new)):
                rec = {"round": rnd, "configuration": name, "strategy": strategy}
                rec |= {"schedule": schedule, "version": version}
                rec |= run(work, cfg, strategy, schedule, sp, src)
                out.append(rec)
                print(json.dumps({k: v for k, v in rec.items() if k != "steps_s"}), flush=True)
                Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
