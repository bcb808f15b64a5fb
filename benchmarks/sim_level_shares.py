"""The exchanges inside one level measured on the clusters of earlier unseen rules and added
to their stored profiles: a what-if on configurations already measured (an explanation of those
results, not a validation; the validation is a rule chosen before it is measured).

For each configuration of a result file of ``benchmarks/sim_unseen.py`` whose cluster has more
than one level: the cluster is brought up again and :func:`moesaic.measure.calibrate.level_shares`
measured on it (what ``calibrate --cluster`` now measures, at the sizes of the stored world
collectives, relative to the stored profile's links); the profile gets them as its
``level_shares``. Nothing is predicted here: ``sim_unseen.py --repredict --out FILE`` prices the
copy again (the same way as a copy without them, for the base arm).

Usage (root: the emulated network needs network namespaces)::

    python benchmarks/sim_level_shares.py benchmarks/results/sim_unseen22.json \\
        --out /tmp/sim_unseen22_level.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_unseen as su
from moesaic.cluster.netns import EmulatedCluster
from moesaic.cluster.spec import ClusterSpec
from moesaic.measure.calibrate import level_shares, share_probe
from moesaic.sim.profile import Profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a sim_unseen.py result file")
    ap.add_argument("--out", required=True, help="where the copy with level shares goes")
    args = ap.parse_args()
    data = json.loads(Path(args.result).read_text())
    for entry in data["configurations"]:
        cfg = su.find_configuration(entry["name"])
        work = Path(tempfile.mkdtemp(prefix=f"levels_{entry['name']}_"))
        (work / "cluster.toml").write_text(su.cluster_toml(cfg))
        spec = ClusterSpec.from_toml(work / "cluster.toml")
        stored = Profile.from_dict(entry["profile"])
        if spec.num_levels < 2 or not stored.collectives:
            continue
        probe = share_probe(stored, stored.a2a_call_s, stored.allreduce_call_s)
        base = int(max(x.bytes_per_rank for x in stored.collectives))
        with EmulatedCluster(spec) as cluster:
            measured = level_shares(cluster, probe, base)
        entry["profile"]["level_shares"] = [dataclasses.asdict(x) for x in measured]
        summary = ", ".join(
            f"L{x.level} {x.regime} {x.bytes_per_rank / 1e3:.0f} kB {x.measured_s * 1e3:.1f} ms "
            f"(share {x.share:.2f})"
            for x in measured
        )
        print(f"{entry['name']}: {summary or 'no inner level'}", flush=True)
        Path(args.out).write_text(json.dumps(data, indent=1))
    Path(args.out).write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
