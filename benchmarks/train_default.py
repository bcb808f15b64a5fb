"""The default ``moesaic train`` run (the README's main command): throughput and loss curve.

Usage: ``python benchmarks/train_default.py [--out benchmarks/results/train_default_cpu.json]
[-- extra moesaic train flags]``. Runs the command in a subprocess (as a user would), then reads
its metrics.jsonl and writes machine, versions, commit, date, the full config, tokens/s (median
and spread over steps after the first five) and the train/validation loss curves.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moesaic.bench.meta import run_metadata
from moesaic.train.config import TrainConfig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/train_default_cpu.json")
    parser.add_argument("extra", nargs="*", help="flags passed on to moesaic train")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="moesaic-train-bench-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "moesaic", "train", "--run-dir", str(run_dir), *args.extra]
        start = time.perf_counter()
        subprocess.run(cmd, check=True)
        wall = time.perf_counter() - start
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    val = [(r["step"], r["val_loss"]) for r in records if r["kind"] == "val"]
    steady = sorted(r["tokens_per_s"] for r in train[5:])
    cfg = TrainConfig().to_dict()
    result = {
        "meta": run_metadata(),
        "command": "moesaic train " + " ".join(args.extra),
        "config": cfg,
        "extra_flags": args.extra,
        "wall_s_end_to_end": wall,
        "tokens_per_step": cfg["nproc"] * cfg["batch_size"] * cfg["model"]["seq_len"],
        "tokens_per_s": {
            "median": steady[len(steady) // 2],
            "p10": steady[len(steady) // 10],
            "p90": steady[(9 * len(steady)) // 10],
        },
        "train_loss": {
            "first": train[0]["loss"],
            "last": train[-1]["loss"],
            "mean_last_20": sum(r["loss"] for r in train[-20:]) / len(train[-20:]),
        },
        "val_loss": {"first": val[0][1], "last": val[-1][1], "curve": val},
        "train_loss_every_25": [(r["step"], r["loss"]) for r in train if r["step"] % 25 == 0],
        "expert_imbalance_last": train[-1]["imbalance"],
        "note": "2 CPU cores shared with other work; tokens/s is global (all ranks).",
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("tokens_per_s", "train_loss", "wall_s_end_to_end")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
