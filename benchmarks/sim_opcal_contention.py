"""How much a rank's compute slows down while its collectives stream, on an emulated cluster
and on unshaped loopback (``moesaic.measure.cpuload``'s measurement, both places side by side).

Usage (root)::

    python benchmarks/sim_opcal_contention.py [--seconds 3] [--kib 512]
        [--out benchmarks/results/sim_opcal_contention.json]

On issue 24's cluster (2 ranks at 120 Mbit/s, 1 ms; ``sim_opcal_check.CLUSTER``), then on an
unshaped loopback world of 2 ranks: ``cpuload.slowdown_worker`` (one torch thread per rank, a
GEMM loop alone, then beside a thread streaming ``--kib`` KiB-per-rank all-to-alls). The
communication kept ``L`` cores busy (``cpuload.comm_cores``, one core per rank here); against
it, what the puts' CPU per call and byte (``sim_opcal_check.json``'s profile) would give at the
measured call and byte rates.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--kib", type=int, default=512, help="all-to-all KiB per rank per call")
    ap.add_argument("--profile", default=str(ROOT / "benchmarks/results/sim_opcal_check.json"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/sim_opcal_contention.json"))
    args = ap.parse_args()

    from moesaic.bench.meta import run_metadata
    from moesaic.cluster import EmulatedCluster
    from moesaic.cluster.spec import ClusterSpec
    from moesaic.comm.world import run_world
    from moesaic.measure.cpuload import comm_cores, slowdown_worker
    from sim_opcal_check import CLUSTER

    spec = ClusterSpec.from_dict(tomllib.loads(CLUSTER))
    cores_per_rank = (os.cpu_count() or 1) / spec.world_size
    job = (args.seconds, args.kib * 1024, 120.0)
    load = {"before": os.getloadavg()}
    with EmulatedCluster(spec) as cluster:
        emulated = cluster.run(slowdown_worker, spec.world_size, *job, timeout_s=300.0)
    load["after_emulated"] = os.getloadavg()
    loopback = run_world(slowdown_worker, spec.world_size, *job, timeout_s=300.0)
    load["after_loopback"] = os.getloadavg()
    profile = json.loads(Path(args.profile).read_text())["profile"]
    rows = {}
    for name, ranks in (("emulated", emulated), ("loopback", loopback)):
        med = {k: statistics.median(r[k] for r in ranks) for k in ranks[0]}
        explained = (
            profile["comm_cpu_s"] * med["calls_per_s"]
            + profile["comm_cpu_per_byte_s"] * med["bytes_per_s"]
        )
        rows[name] = {
            "ranks": ranks,
            **med,
            "comm_cores_measured": comm_cores(med["slowdown"], 1, cores_per_rank),
            "comm_cores_from_put_cpu": min(1.0, explained),
        }
    result = {
        "meta": run_metadata(),
        "notes": __doc__,
        "cluster": CLUSTER,
        "seconds": args.seconds,
        "kib": args.kib,
        "cores_per_rank": cores_per_rank,
        "put_cpu_profile": {k: profile[k] for k in ("comm_cpu_s", "comm_cpu_per_byte_s")},
        "load_average_1_5_15": load,
        "results": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for name, r in rows.items():
        print(
            f"{name}: compute {r['slowdown']:.2f}x slower; communication keeps "
            f"{r['comm_cores_measured']:.2f} cores busy (the puts' CPU: "
            f"{r['comm_cores_from_put_cpu']:.3f}) at {r['bytes_per_s'] / 1e6:.1f} MB/s, "
            f"{r['calls_per_s']:.0f} calls/s"
        )
    print(json.dumps(load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
