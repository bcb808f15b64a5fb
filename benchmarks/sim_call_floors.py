"""The collectives' call floors on the clusters of earlier unseen rules, and the rules' points
priced again with them: a what-if on configurations already measured (an explanation of those
results, not a validation; the validation is a rule chosen before it is measured).

For each configuration of a result file of ``benchmarks/sim_unseen.py``: its cluster is brought up
again and ``calibrate``'s call floors measured on it (:func:`moesaic.measure.calibrate.collective_calls`,
on the otherwise idle machine, as ``calibrate --cluster`` now does); its stored profile gets the
floors, and its collective shares are derived again from their measured times relative to the
floored closed forms (what ``calibrate --cluster`` computes from the same times); every point is
predicted again and the planner asked again (with the capacity the rule allowed it). The
profile, the new predictions (``predicted_s``; the stored ones as ``predicted_s_first``), the
new plan (``plan_top3``; the stored one as ``plan_top3_first``) and the floors are written to
``--out``; ``sim_unseen_report.py`` reads it as it reads the original.

With ``--loaded-only`` only the loaded all-reduce (``allreduce_loaded_call_s``) is measured
again and replaced; the idle floors and the shares stay as the rule's calibration stored them.

Usage::

    python benchmarks/sim_call_floors.py benchmarks/results/sim_unseen5.json \\
        --out benchmarks/results/sim_unseen5_floors.json
    python benchmarks/sim_call_floors.py benchmarks/results/sim_unseen15.json --loaded-only \\
        --out /tmp/sim_unseen15_loaded.json
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
from moesaic.measure.calibrate import collective_calls, collective_share, share_probe
from moesaic.sim.profile import Profile


def floored_profile(profile: Profile, spec: ClusterSpec, a2a: float, allreduce: float) -> Profile:
    """``profile`` with the call floors, its shares derived again from their measured times
    relative to the floored closed forms (a time within the floor: the point is dropped)."""
    probe = share_probe(profile, a2a, allreduce)
    shares = []
    for x in profile.collectives:
        share = collective_share(spec, probe, x.kind, x.bytes_per_rank, x.measured_s)
        if share is not None:
            shares.append(dataclasses.replace(x, share=share))
    return dataclasses.replace(
        profile, a2a_call_s=a2a, allreduce_call_s=allreduce, collectives=tuple(shares)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a sim_unseen.py result file")
    ap.add_argument("--out", required=True, help="where the re-priced result goes")
    ap.add_argument(
        "--loaded-only",
        action="store_true",
        help="replace only the loaded all-reduce (allreduce_loaded_call_s)",
    )
    args = ap.parse_args()
    data = json.loads(Path(args.result).read_text())
    capacity = 1.25 if data.get("rule_number", 0) >= 5 else None
    for entry in data["configurations"]:
        cfg = su.find_configuration(entry["name"])
        work = Path(tempfile.mkdtemp(prefix=f"floors_{entry['name']}_"))
        (work / "cluster.toml").write_text(su.cluster_toml(cfg))
        spec = ClusterSpec.from_toml(work / "cluster.toml")
        with EmulatedCluster(spec) as cluster:
            a2a, allreduce, loaded, _ = collective_calls(cluster)
        stored = Profile.from_dict(entry["profile"])
        if args.loaded_only:
            entry["loaded_call_ms_first"] = stored.allreduce_loaded_call_s * 1e3
            entry["loaded_call_ms"] = loaded * 1e3
            profile = dataclasses.replace(stored, allreduce_loaded_call_s=loaded)
            a2a, allreduce = stored.a2a_call_s, stored.allreduce_call_s
        else:
            profile = floored_profile(stored, spec, a2a, allreduce)
            entry["call_floors_ms"] = {"all_to_all": a2a * 1e3, "all_reduce": allreduce * 1e3}
        entry["profile"] = profile.to_dict()
        profile.save(work / "p.json")
        points = [p for p in data["points"] if p["configuration"] == entry["name"]]
        for strategy in {p["strategy"] for p in points}:
            (work / f"train_{strategy}.toml").write_text(su.train_toml(cfg, work / "r", strategy))
        for point in points:
            point.setdefault("predicted_s_first", point.get("predicted_s"))
            point.update(su.predict(work, point["strategy"], point["schedule"]))
        (work / "train_dropless.toml").write_text(su.train_toml(cfg, work / "r", "dropless"))
        entry.setdefault("plan_top3_first", entry.get("plan_top3"))
        entry["plan_top3"] = su.plan(work, capacity)[:3]
        loaded_ms = profile.allreduce_loaded_call_s * 1e3
        pick = entry["plan_top3"][0]["reason"].split(" predicted")[0]
        print(
            f"{entry['name']}: all-to-all {a2a * 1e3:.2f} ms, all-reduce {allreduce * 1e3:.2f} ms "
            f"a call, loaded {loaded_ms:.1f} ms; pick {pick}",
            flush=True,
        )
        Path(args.out).write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
