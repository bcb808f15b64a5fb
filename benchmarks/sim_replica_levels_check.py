"""Replicas of the unsharded model priced across cluster levels (``sim.fsdp.replicas_all_reduce_s``)
against measured steps: ``moesaic train --emulate examples/clusters/2dc_2node_small.toml`` (2
datacenters x 2 nodes, 0.1 Gbit/s and 10 ms between the DCs, 0.4 Gbit/s and 3 ms between the
nodes) at ``--ep 1`` (4 replicas spanning both levels: gloo's ring over them), ``--ep 2`` (2
replicas on the DC level: that level's exchange, the validated form) and ``--ep 4`` (no
replicas), the model of ``fsdp_common`` (a dense part 1.5x its experts).

Every prediction is made before any run: ``moesaic calibrate --cluster --model`` on that cluster
and model, then ``simulate`` of dropless + vanilla with ``dp_replicate`` 4, 2 and 1. The runs
are interleaved over 2 rounds, rank 0's median step after the first 3 steps each; the error is
predicted over the mean of the rounds' medians.

``--cluster`` measures another cluster file at ``--eps`` (EP sizes dividing ``--experts``; the
replicas are the rest of the world): ``2dc_2node_2gpu_small.toml`` (8 ranks, three levels, 8
experts) at ``--ep 1`` (8 replicas over all three levels), ``--ep 2`` (4 replicas spanning the
DC and node levels, 2 rings at once), ``--ep 4`` (2 on the DC level) and ``--ep 8`` (none).
The result file holds one entry per cluster (``clusters``); a run replaces its cluster's.

Usage (root: the emulated network needs network namespaces)::

    python benchmarks/sim_replica_levels_check.py --out benchmarks/results/sim_replica_levels_check.json
    python benchmarks/sim_replica_levels_check.py --cluster examples/clusters/2dc_2node_2gpu_small.toml \
        --experts 8 --eps 1,2,4,8 --out benchmarks/results/sim_replica_levels_check.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from fsdp_common import calibrate_on, provenance, train_records, write_corpus

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "examples/clusters/2dc_2node_small.toml"
STEPS, BATCH, SEQ, WARM, ROUNDS = 12, 2, 64, 3, 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default=str(CLUSTER), help="a cluster file")
    ap.add_argument("--eps", default="1,2,4", help="comma-separated EP sizes")
    ap.add_argument("--experts", type=int, default=4, help="the model's experts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cluster = Path(args.cluster)
    from moesaic.cluster.spec import ClusterSpec
    from moesaic.sim.profile import Profile
    from moesaic.sim.simulate import SimOptions, simulate
    from moesaic.train.model_files import load_model_spec

    work = Path(tempfile.mkdtemp(prefix="replica_levels_"))
    spec = ClusterSpec.from_toml(cluster)
    world = spec.world_size
    train, profile_path = calibrate_on(cluster, work, world=world, experts=args.experts)
    cases = {ep: world // ep for ep in map(int, args.eps.split(","))}  # --ep: replicas
    profile = Profile.load(profile_path)
    model = load_model_spec(train)
    rows: dict[str, dict] = {}
    for ep, replicas in cases.items():
        opts = SimOptions(dp_replicate=replicas) if replicas > 1 else SimOptions()
        r = simulate(spec, model, "dropless", profile, opts, schedule="vanilla")
        ar = [s for s in r.spans if s.name == "AR1"]
        rows[f"--ep {ep}"] = {
            "replicas": replicas,
            "predicted_s": r.iteration_s,
            "predicted_allreduce_s": sum(s.end - s.start for s in ar),
            "runs_s": [],
        }
    print(json.dumps(rows), flush=True)  # every prediction before any run
    data = write_corpus(work)
    for _ in range(ROUNDS):
        for ep in cases:
            flags = ["--emulate", str(cluster), "--batch-size", str(BATCH), "--steps", str(STEPS)]
            flags += ["--warmup-steps", "2", "--ep", str(ep)]
            records = train_records(data, work, flags, timeout_s=1200, experts=args.experts)
            steps = [r for r in records if r["kind"] == "train"]
            times = [world * BATCH * SEQ / r["tokens_per_s"] for r in steps[WARM:]]
            rows[f"--ep {ep}"]["runs_s"].append(statistics.median(times))
            print(ep, rows[f"--ep {ep}"]["runs_s"][-1], flush=True)
    for row in rows.values():
        row["measured_s"] = statistics.fmean(row["runs_s"])
        row["error"] = row["predicted_s"] / row["measured_s"] - 1
    entry = {**provenance(__doc__ or ""), "cluster": cluster.name, "rows": rows}
    entry["profile"] = json.loads(profile_path.read_text())
    print(json.dumps(rows, indent=1))
    if args.out:
        path = Path(args.out)
        out = json.loads(path.read_text()) if path.exists() else {"clusters": {}}
        out["clusters"][cluster.name] = entry
        path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
