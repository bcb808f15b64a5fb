"""Step time and traffic of ``--dp-shard 2 --ep 2`` against the unsharded EP 2 x DP 2 run on
an emulated cluster (issue 50, "Speed"): the same model and batches, ``moesaic train
--emulate examples/clusters/compose_2x2.toml`` (2 nodes x 2 ranks, 0.4 Gbit/s between the
nodes, 2 Gbit/s inside one), the two runs interleaved over rounds (the machine is shared).

Per run: rank 0's median step time after the first 3 steps (``tokens_per_s`` of
``metrics.jsonl``), the bytes each rank's ``eth0`` sent over the whole run (the launcher's
``network`` record: kernel counters, start-up included) and that total over the steps (an
upper bound of a step's bytes: start-up is in it, in both runs alike). Bound: a
rank's bytes per step over the slowest link it crosses (0.4 Gbit/s: EP groups are the ranks of
one node, the dense part's dp_shard_ep group and the DP group cross nodes).

Usage (root, for the network namespaces)::

    python benchmarks/fsdp_cluster.py --out benchmarks/results/fsdp_cluster.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from fsdp_memory import MODEL  # the model with the large dense part

CLUSTER = Path(__file__).resolve().parent.parent / "examples/clusters/compose_2x2.toml"
STEPS, BATCH, SEQ, WARM = 12, 2, 64, 3
SLOW_LINK_BPS = 0.4e9 / 8
CASES = {
    "unsharded EP 2 x DP 2": ["--ep", "2"],
    "dp_shard 2 x EP 2": ["--dp-shard", "2", "--ep", "2"],
}


def run(data: Path, work: Path, flags: list[str]) -> dict:
    run_dir = work / "run"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    args = [sys.executable, "-m", "moesaic", "train", "--data", str(data)]
    args += ["--run-dir", str(run_dir), "--emulate", str(CLUSTER), *MODEL]
    args += ["--batch-size", str(BATCH), "--steps", str(STEPS), "--no-save-final"]
    args += ["--no-progress", "--warmup-steps", "2", *flags]
    subprocess.run(args, check=True, capture_output=True, timeout=900)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    (network,) = [r for r in records if r["kind"] == "network"]
    tokens = 4 * BATCH * SEQ
    times = [tokens / r["tokens_per_s"] for r in steps[WARM:]]
    return {"step_s": statistics.median(times), "tx_bytes": network["tx_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "corpus.txt"
        data.write_bytes(Path(json.__file__).parent.parent.joinpath("argparse.py").read_bytes())
        for _ in range(args.rounds):
            for name, flags in CASES.items():
                results[name].append(run(data, work, flags))
                print(name, results[name][-1], flush=True)
    rows = {}
    for name, runs in results.items():
        tx = max(max(r["tx_bytes"]) for r in runs)
        rows[name] = {
            "step_s_median": statistics.median(r["step_s"] for r in runs),
            "step_s_runs": [r["step_s"] for r in runs],
            "tx_bytes_max_rank_per_run": tx,
            "tx_bytes_per_step_max_rank": tx / STEPS,
            "bound_s_per_step_at_slow_link": tx / STEPS / SLOW_LINK_BPS,
            "runs": runs,
        }
    base, sharded = rows["unsharded EP 2 x DP 2"], rows["dp_shard 2 x EP 2"]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    result = {
        "what": __doc__.split("\n\n")[0],
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {
            "cluster": str(CLUSTER.name),
            "flags": [*MODEL, "--batch-size", str(BATCH), "--steps", str(STEPS)],
            "warm_up_steps_dropped": WARM,
            "rounds": args.rounds,
        },
        "rows": rows,
        "sharded_over_unsharded": {
            "step_time": sharded["step_s_median"] / base["step_s_median"],
            "tx_bytes": sharded["tx_bytes_max_rank_per_run"] / base["tx_bytes_max_rank_per_run"],
        },
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["sharded_over_unsharded"]))


if __name__ == "__main__":
    main()
