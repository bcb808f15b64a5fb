"""Predict the already-measured points of the unseen rules 2-26 again with the simulator as it is
now, in one process, for chosen strategies and schedules (a pricing change checked on seen data).

Each configuration's stored profile is used as the rule judged it (from the seventeenth rule:
slowed by the runs' speed factor), with the configuration's cluster and training config rebuilt
from the rule (``sim_unseen.py``), hybrid at the domains its runs trained at where the rule
recorded them. Prints, per rule and overall, the geometric-mean error of the stored predictions
and of the new ones over the chosen points, and writes every point to ``--out``.

Usage::

    python benchmarks/sim_seen_repredict.py --strategy padded [--schedule flowmoe] \
        [--rules 5-26] [--all-reduce ring] [--out /tmp/padded.json]
    python benchmarks/sim_seen_repredict.py --wide benchmarks/results/sim_unseen27.json
    python benchmarks/sim_seen_repredict.py --wide benchmarks/results/sim_unseen31.json --breakdown
    python benchmarks/sim_seen_repredict.py --strategy dropless --rules 17-26 \
        --alone benchmarks/results/sim_alone_calls.json

``--wide``: a ``sim_unseen_wide.py`` result's points predicted again in place, from both
sources at the runs' speed (the first judged predictions kept as ``predicted_s_first``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_unseen
from moesaic.cli import main as moesaic_main
from moesaic.cluster.spec import ClusterSpec
from moesaic.sim.profile import Profile
from sim_call_floors import floored_profile

RESULTS = Path(__file__).resolve().parent / "results"
# configuration name -> the call floors measured on its cluster since (``--alone``): the alone
# all-reduce, and the all-to-all's floor the way ``--a2a-floor`` names
ALONE: dict[str, float] = {}
A2A_FLOOR: dict[str, float] = {}


def stored_profile(entry: dict[str, Any], cluster: Path) -> dict[str, Any]:
    """A configuration's stored profile, with the call floors measured on its cluster since
    (``--alone``) where the profile predates them; a new all-to-all floor re-derives the
    collective shares from their measured times, as ``calibrate`` would have
    (``sim_call_floors.floored_profile``)."""
    profile = dict(entry["profile"])
    if profile.get("allreduce_alone_call_s"):  # measured by its own calibration
        return profile
    if entry["name"] in ALONE:
        profile["allreduce_alone_call_s"] = ALONE[entry["name"]]
    if entry["name"] in A2A_FLOOR:
        stored = Profile.from_dict(profile)
        spec = ClusterSpec.from_toml(cluster)
        a2a = A2A_FLOOR[entry["name"]]
        profile = floored_profile(stored, spec, a2a, stored.allreduce_call_s).to_dict()
    return profile


def geomean_error(pairs: list[tuple[float, float]]) -> float:
    """Geometric mean of ``1 + |p / m - 1|`` minus 1, in percent."""
    if not pairs:
        return math.nan
    logs = [math.log1p(abs(p / m - 1.0)) for p, m in pairs]
    return 100.0 * math.expm1(math.fsum(logs) / len(logs))


def simulate_json(args: list[str]) -> dict[str, Any] | None:
    """``moesaic simulate ... --json`` in this process; None when it refuses."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = moesaic_main(["simulate", *args, "--json"])
        except SystemExit as exc:
            rc = exc.code
    if rc:
        return None
    res = json.loads(out.getvalue())
    return res[0] if isinstance(res, list) else res


def repredict_rule(
    rule: int, strategies: set[str], schedules: set[str] | None, extra: list[str] | None = None
) -> list[dict]:
    data = json.loads((RESULTS / f"sim_unseen{rule}.json").read_text())
    by_name = {c["name"]: c for c in data["configurations"]}
    points = []
    for name, entry in by_name.items():
        if "profile" not in entry:
            continue
        cfg = sim_unseen.find_configuration(name)
        work = Path(tempfile.mkdtemp(prefix=f"seen_{rule}_"))
        (work / "cluster.toml").write_text(sim_unseen.cluster_toml(cfg))
        (work / "p.json").write_text(json.dumps(stored_profile(entry, work / "cluster.toml")))
        if "speed" in entry:
            profile = Profile.load(work / "p.json")
            profile.slowed(entry["speed"]["speed_factor"]).save(work / "p.json")
        for point in data["points"]:
            if point["configuration"] != name or point["strategy"] not in strategies:
                continue
            if schedules is not None and point["schedule"] not in schedules:
                continue
            if not point.get("measured_s") or not point.get("predicted_s"):
                continue
            strategy, schedule = point["strategy"], point["schedule"]
            toml = work / f"train_{strategy}.toml"
            toml.write_text(sim_unseen.train_toml(cfg, work / "r", strategy))
            args = ["--cluster", str(work / "cluster.toml"), "--model", str(toml)]
            args += ["--profile", str(work / "p.json"), "--strategy", strategy]
            args += ["--schedule", schedule]
            domains = sim_unseen.ran_at(point, rule)
            if domains is not None:
                args += ["--domains", ",".join(map(str, domains))]
            if schedule != "vanilla":
                args += ["--degree", str(sim_unseen.PIPELINE_DEGREE)]
            res = simulate_json([*args, *(extra or [])])
            if res is None:
                continue
            points.append(
                {
                    "rule": rule,
                    "configuration": name,
                    "strategy": strategy,
                    "schedule": schedule,
                    "measured_s": point["measured_s"],
                    "stored_s": point["predicted_s"],
                    "now_s": res["iteration_ms"] / 1e3,
                }
            )
    return points


def wide_simulations(
    data: dict[str, Any], sources: tuple[str, ...] | None = None
) -> Iterator[tuple[dict[str, Any], str, list[str]]]:
    """Each point of a wide rule's result (``sim_unseen_wide.py``) with each source and the
    ``simulate`` arguments that predict it as the rule judges it: the configuration's stored
    profile slowed by its runs' speed factor (the model file's without the measured routing),
    hybrid at the domains its runs trained at."""
    import sim_unseen_wide as wide

    sources = wide.SOURCES if sources is None else sources
    for entry in data["configurations"]:
        rules = wide.RULE_SETS.values()
        cfg = next(c for r in rules for c in r.configurations if c["name"] == entry["name"])
        work = Path(tempfile.mkdtemp(prefix=f"wide_re_{cfg['name']}_"))
        wide.write_files(work, cfg)
        profile = stored_profile(entry, work / "cluster.toml")
        (work / "p.json").write_text(json.dumps(profile))
        profile.pop("routing", None)
        (work / "p_file.json").write_text(json.dumps(profile))
        factor = entry["speed"]["speed_factor"]
        for source in wide.SOURCES:
            p = Profile.load(work / wide.profile_name(source))
            p.slowed(factor, why="the runs' speed reference").save(
                work / wide.profile_name(source, True)
            )
        for point in data["points"]:
            if point["configuration"] != cfg["name"]:
                continue
            domains = point["train"].get("domain_sizes")
            for source in sources:
                args = ["--cluster", str(work / "cluster.toml"), "--model"]
                args += [str(wide.model_path(work, source, point["strategy"]))]
                args += ["--profile", str(work / wide.profile_name(source, True))]
                args += ["--strategy", point["strategy"], "--schedule", point["schedule"]]
                if domains is not None:
                    args += ["--domains", ",".join(map(str, domains))]
                if point["schedule"] != "vanilla":
                    args += ["--degree", str(wide.PIPELINE_DEGREE)]
                yield point, source, args


def repredict_wide(path: Path, breakdown: bool = False) -> None:
    """A wide rule's points (``sim_unseen_wide.py``, rules 27-32) predicted again from both
    sources as the rule judges them (:func:`wide_simulations`); each point's first judged
    prediction kept as ``predicted_s_first``. ``breakdown``: the file is left as it is, and
    each point's training-config prediction is printed beside its measurement with its parts
    (compute and what the CPU contention added to it, the communication, the collectives' load
    between their idle and loaded prices and what that saved against the loaded price)."""
    data = json.loads(path.read_text())
    sources = ("train",) if breakdown else None
    for point, source, args in wide_simulations(data, sources):
        pred = point[source]
        pred.setdefault("predicted_s_first", pred.get("predicted_s"))
        pred.setdefault("range_s_first", pred.get("range_s"))
        res = simulate_json(args)
        if res is None:
            continue
        if breakdown:
            print_breakdown(point["configuration"], point, res)
            continue
        pred["predicted_s"] = res["iteration_ms"] / 1e3
        if res.get("range_ms") is not None:
            pred["range_s"] = [x / 1e3 for x in res["range_ms"]]
    if not breakdown:
        path.write_text(json.dumps(data, indent=1))


def print_breakdown(name: str, point: dict[str, Any], res: dict[str, Any]) -> None:
    c = res.get("contention") or {}
    measured, predicted = point["measured_s"] * 1e3, res["iteration_ms"]
    print(
        f"{name} {point['strategy']:>8} {point['schedule']:>8}: measured {measured:6.0f} ms, "
        f"predicted {predicted:6.0f} ({predicted / measured - 1:+6.1%}): compute "
        f"{res['compute_ms']:5.0f} (contention +{c.get('compute_added_ms', 0.0):4.0f}), "
        f"communication {res['comm_ms']:5.0f} (exposed {res['exposed_comm_ms']:5.0f}), load "
        f"{c.get('collective_load', 0.0):.2f} saving {c.get('comm_saved_ms', 0.0):4.0f}",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", default="padded", help="comma-separated strategies")
    p.add_argument("--schedule", default=None, help="comma-separated schedules (default: all)")
    p.add_argument("--rules", default="5-26", help="first-last")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--all-reduce", default=None, help="simulate's --all-reduce for every point (default: its)"
    )
    p.add_argument(
        "--wide", default=None, help="a sim_unseen_wide result to predict again in place"
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="with --wide: print each point's parts, leave the file as it is",
    )
    p.add_argument(
        "--alone",
        default=None,
        help="sim_alone_calls.py's result: the alone all-reduce measured on the stored clusters",
    )
    p.add_argument(
        "--a2a-floor",
        choices=("after-last", "back-to-back"),
        default=None,
        help="with --alone: the all-to-all's call floor measured since: from the last rank's "
        "issue, or a call's mean time back to back",
    )
    args = p.parse_args()
    if args.a2a_floor and not args.alone:
        p.error("--a2a-floor applies with --alone only (the floors measured on the clusters)")
    if args.alone:
        measured = json.loads(Path(args.alone).read_text())
        ALONE.update({k.split("/", 1)[1]: s for k, s in measured["alone_call_s"].items()})
        if args.a2a_floor:
            a2a = measured["a2a_call"]
            key = f"{args.a2a_floor.replace('-', '_')}_s"
            A2A_FLOOR.update({k.split("/", 1)[1]: x[key] for k, x in a2a.items()})
    if args.wide:
        repredict_wide(Path(args.wide), args.breakdown)
        return
    lo, hi = (int(x) for x in args.rules.split("-"))
    strategies = set(args.strategy.split(","))
    schedules = set(args.schedule.split(",")) if args.schedule else None
    every: list[dict] = []
    for rule in range(lo, hi + 1):
        extra = ["--all-reduce", args.all_reduce] if args.all_reduce else None
        pts = repredict_rule(rule, strategies, schedules, extra)
        every += pts
        stored = geomean_error([(q["stored_s"], q["measured_s"]) for q in pts])
        now = geomean_error([(q["now_s"], q["measured_s"]) for q in pts])
        bias = [math.log(q["now_s"] / q["measured_s"]) for q in pts]
        mean_bias = 100 * math.expm1(math.fsum(bias) / max(1, len(bias)))
        print(
            f"rule {rule}: {len(pts)} points, stored {stored:.1f}%, now {now:.1f}% "
            f"(bias {mean_bias:+.1f}%)",
            flush=True,
        )
    stored = geomean_error([(q["stored_s"], q["measured_s"]) for q in every])
    now = geomean_error([(q["now_s"], q["measured_s"]) for q in every])
    bias = [math.log(q["now_s"] / q["measured_s"]) for q in every]
    print(
        f"all: {len(every)} points, stored {stored:.1f}%, now {now:.1f}% "
        f"(bias {100 * math.expm1(math.fsum(bias) / max(1, len(bias))):+.1f}%)"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(every, indent=1))


if __name__ == "__main__":
    main()
