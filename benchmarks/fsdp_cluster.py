"""Step time and traffic of ``--dp-shard 2 --ep 2`` (FSDP2) and ``--dp-replicate 2 --ep 2``
(HSDP) against the unsharded EP 2 x DP 2 run on an emulated cluster (issue 50, "Speed"): the
same model and batches, ``moesaic train --emulate examples/clusters/compose_2x2.toml`` (2 nodes
x 2 ranks, 0.4 Gbit/s between the nodes, 2 Gbit/s inside one), the runs interleaved over rounds
(the machine is shared).

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
import json
import statistics
import tempfile
from pathlib import Path

from fsdp_common import MODEL, provenance, train_records, write_corpus

CLUSTER = Path(__file__).resolve().parent.parent / "examples/clusters/compose_2x2.toml"
STEPS, BATCH, SEQ, WARM = 12, 2, 64, 3
SLOW_LINK_BPS = 0.4e9 / 8
CASES = {
    "unsharded EP 2 x DP 2": ["--ep", "2"],
    "dp_shard 2 x EP 2": ["--dp-shard", "2", "--ep", "2"],
    # HSDP: the dense part sharded over a node's 2 ranks, replicated over the 2 nodes
    "dp_replicate 2 x EP 2": ["--dp-replicate", "2", "--ep", "2"],
}


def run(data: Path, work: Path, case: list[str]) -> dict:
    flags = ["--emulate", str(CLUSTER), "--batch-size", str(BATCH), "--steps", str(STEPS)]
    flags += ["--warmup-steps", "2", *case]
    records = train_records(data, work, flags, timeout_s=900)
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
        data = write_corpus(work)
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
    base = rows["unsharded EP 2 x DP 2"]
    result = {
        **provenance(__doc__),
        "config": {
            "cluster": str(CLUSTER.name),
            "flags": [*MODEL, "--batch-size", str(BATCH), "--steps", str(STEPS)],
            "warm_up_steps_dropped": WARM,
            "rounds": args.rounds,
        },
        "rows": rows,
        "over_unsharded": {
            name: {
                "step_time": row["step_s_median"] / base["step_s_median"],
                "tx_bytes": row["tx_bytes_max_rank_per_run"] / base["tx_bytes_max_rank_per_run"],
            }
            for name, row in rows.items()
            if row is not base
        },
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["over_unsharded"]))


if __name__ == "__main__":
    main()
