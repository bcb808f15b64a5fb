"""FSDP2's traffic as the simulator prices it (``sim.fsdp``) against the measured sharded run of
``benchmarks/results/fsdp_cluster.json`` (``--dp-shard 2 --ep 2`` on ``compose_2x2``, 4 ranks):
``moesaic calibrate --cluster --model`` on that cluster and model (a profile of its own), then
``simulate`` of dropless + vanilla with ``dp_shard`` 2 (EP over the node's 2 ranks, the experts
sharded over the 2 nodes, the dense part over all 4), with ``dp_replicate`` 2 (HSDP: the dense
part sharded over a node's 2 ranks, each shard all-reduced over the 2 nodes) and with
``dp_shard`` 1 on the 4 ranks (the planner's layout: EP = world), beside the measured step and
bytes, and the unsharded EP 2 x DP 2 run (``dp_replicate`` 2 without ``dp_shard``: EP on a
node, the dense gradients all-reduced over the 4 ranks and the experts' over the 2 nodes).

Usage (root: the emulated network needs network namespaces)::

    python benchmarks/sim_fsdp_check.py [--profile P.json] [--out benchmarks/results/sim_fsdp_check.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from fsdp_common import calibrate_on, train_toml

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "examples/clusters/compose_2x2.toml"
MEASURED = ROOT / "benchmarks/results/fsdp_cluster.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None, help="a calibrated profile to reuse")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from moesaic.cluster.spec import ClusterSpec
    from moesaic.sim.profile import Profile
    from moesaic.sim.simulate import SimOptions, simulate
    from moesaic.train.model_files import load_model_spec

    work = Path(tempfile.mkdtemp(prefix="fsdp_check_"))
    if args.profile is None:
        train, profile_path = calibrate_on(CLUSTER, work)
    else:
        train, profile_path = work / "train.toml", Path(args.profile)
        train.write_text(train_toml(work / "r"))
    spec = ClusterSpec.from_toml(CLUSTER)
    profile = Profile.load(profile_path)
    model = load_model_spec(train)
    measured = json.loads(MEASURED.read_text())["rows"]
    out: dict = {"cluster": CLUSTER.name, "profile": json.loads(profile_path.read_text())}
    rows = {}
    meshes = (
        ("dp_shard 2 x EP 2", SimOptions(dp_shard=2)),
        ("dp_replicate 2 x EP 2", SimOptions(dp_shard=1, dp_replicate=2)),
        ("dp_shard 1 x EP 4 (not measured)", SimOptions(dp_shard=1)),
        ("unsharded EP 2 x DP 2", SimOptions(dp_replicate=2)),
    )
    for name, opts in meshes:
        r = simulate(spec, model, "dropless", profile, opts, schedule="vanilla")
        fsdp = [s for s in r.spans if s.name.startswith(("FS", "FR"))]
        rows[name] = {
            "predicted_s": r.iteration_s,
            "compute_s": r.compute_s,
            "comm_s": r.comm_s,
            "fsdp_busy_s": sum(s.end - s.start for s in fsdp),
            "fsdp_bytes_per_step": sum(s.args.get("bytes", 0) for s in fsdp),
        }
    plain = simulate(spec, model, "dropless", profile, SimOptions(), schedule="vanilla")
    rows["unsharded EP 4 (not measured)"] = {"predicted_s": plain.iteration_s}
    for name in ("dp_shard 2 x EP 2", "dp_replicate 2 x EP 2", "unsharded EP 2 x DP 2"):
        m = measured[name]
        rows[name]["measured_s"] = m["step_s_median"]
        rows[name]["measured_tx_bytes_per_step"] = m["tx_bytes_per_step_max_rank"]
        rows[name]["error"] = rows[name]["predicted_s"] / m["step_s_median"] - 1
    out["rows"] = rows
    print(json.dumps(rows, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
