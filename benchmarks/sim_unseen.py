"""Runs the unseen rules 1-26 (``sim_unseen_rules.py``: each rule's text, fixed and committed
before any of its configurations was measured, and the factors it sets): per configuration
``calibrate``, ``simulate`` of every combination and ``plan``, then every strategy x schedule
trained on the emulated cluster in interleaved passes, and the plan's pick; the rule's names
(the grid, steps, R, padded's capacity) are imported from there and used by the other
benchmarks through this module. ``sim_unseen_report.py`` judges a result.

Usage (root: the emulated network needs network namespaces; run on an otherwise idle machine)::

    python benchmarks/sim_unseen.py --list [--rule 2|...|26]  # the eight, nothing run
    python benchmarks/sim_unseen.py [--rule 2|...|26] [--only 0,3] [--out F.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_unseen_rules
from sim_unseen_rules import (
    BLOCKS,
    COMBINATIONS,
    FACTORS,
    HEADS,
    INTRA_NODE,
    PADDED_CAPACITY,
    PASSES_5,
    PIPELINE_DEGREE,
    PRICED_DOMAINS_FROM,
    RETIMED_FROM,
    SEQ,
    STEPS,
    TOP_K,
    WARMUP,
    H,
    configurations,
    find_configuration,
    passes_of,
)


def cluster_toml(cfg: dict[str, Any]) -> str:
    bw, lat = cfg["link"]
    lines = [f'name = "{cfg["name"]}"', f"world_size = {cfg['ranks']}", ""]
    nodes = cfg["ranks"] if cfg.get("flat") else 2
    lines += ["[[levels]]", 'name = "node"', f"size = {nodes}", f"bandwidth_gbps = {bw}"]
    lines += [f"latency_ms = {lat}", ""]
    if cfg["ranks"] == 4 and not cfg.get("flat"):
        bw, lat = cfg.get("intra_node", INTRA_NODE)
        lines += ["[[levels]]", 'name = "rank"', "size = 2"]
        lines += [f"bandwidth_gbps = {bw}", f"latency_ms = {lat}", ""]
    return "\n".join(lines)


def train_toml(cfg: dict[str, Any], run_dir: Path, strategy: str) -> str:
    """The configuration's training config for ``strategy``'s grid runs (padded at
    ``PADDED_CAPACITY``, the others without a capacity)."""
    capacity = PADDED_CAPACITY if strategy == "padded" else None
    return job_toml(cfg, run_dir, capacity=capacity)


def job_toml(cfg: dict[str, Any], run_dir: Path, *, capacity: float | None = None) -> str:
    """The configuration's training config, with ``capacity`` (None: dropless)."""
    batch = cfg["tokens_per_rank"] // SEQ
    moe = [f"num_experts = {cfg['experts']}", f"top_k = {TOP_K}"]
    hidden = cfg.get("hidden", H)
    moe.append(f"ffn_hidden_size = {round(cfg['f_over_h'] * hidden)}")
    if capacity is not None:
        moe.append(f"capacity_factor = {capacity}")
    run = [f"nproc = {cfg['ranks']}", f"ep = {cfg['ranks']}", f"steps = {WARMUP + STEPS}"]
    run += [f"batch_size = {batch}", "eval_every = 0", "ckpt_every = 0", "save_final = false"]
    run += [f'run_dir = "{run_dir}"']
    model = [f"seq_len = {SEQ}", f"d_model = {hidden}", f"n_layers = {cfg.get('blocks', BLOCKS)}"]
    model.append(f"n_heads = {HEADS}")
    return "\n".join([*run, "", "[model]", *model, "", "[model.moe]", *moe, ""])


def combo_flags(
    strategy: str,
    schedule: str,
    ar_chunk: int | None = None,
    domains: list[int] | None = None,
) -> list[str]:
    """The ``moesaic train`` flags of one combination: hybrid at ``domains`` when given (the
    sizes the simulator priced), else ``--domains auto`` (planned by the run at its start)."""
    flags = ["--strategy", strategy, "--schedule", schedule]
    if schedule != "vanilla":
        flags += ["--pipeline-degree", str(PIPELINE_DEGREE)]
    if ar_chunk is not None and schedule == "flowmoe":
        flags += ["--ar-chunk", f"{ar_chunk}B"]
    if strategy == "hybrid":
        flags += ["--domains", "auto" if domains is None else ",".join(map(str, domains))]
    return flags


def _steps(run_dir: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's step times after the warm-up (``metrics.jsonl``: tokens per step /
    ``tokens_per_s``) and their median."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x.get("kind") == "train"]
    tokens = cfg["ranks"] * cfg["tokens_per_rank"]
    step_s = [tokens / x["tokens_per_s"] for x in train[WARMUP:]]
    return {"measured_s": statistics.median(step_s), "steps_s": step_s}


def _drop_checkpoints(run_dir: Path) -> None:
    """A run's final checkpoint is not needed here and takes up to ~1 GB: 88 runs filled the
    disk during the fourth rule's first invocation."""
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def measure(
    work: Path,
    cfg: dict[str, Any],
    strategy: str,
    schedule: str,
    ar_chunk: int | None = None,
    domains: list[int] | None = None,
) -> dict[str, Any]:
    """One emulated training run; rank 0's median step time after the warm-up (flowmoe at
    ``ar_chunk`` bytes when given, else the training default; hybrid at ``domains`` when
    given, else ``--domains auto``)."""
    run_dir = work / f"run_{strategy}_{schedule}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a second pass starts afresh
    config = work / f"train_{strategy}.toml"
    config.write_text(train_toml(cfg, run_dir, strategy))
    cluster = str(work / "cluster.toml")
    args = [sys.executable, "-m", "moesaic", "train", "--config", str(config)]
    args += ["--emulate", cluster, *combo_flags(strategy, schedule, ar_chunk, domains)]
    if strategy == "hybrid":  # its domains are on the cluster's levels
        args += ["--cluster", cluster]
    t0 = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=1200)
    wall = time.perf_counter() - t0
    _drop_checkpoints(run_dir)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:], "wall_s": wall}
    return {**_steps(run_dir, cfg), "wall_s": wall}


def run_cli(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moesaic", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def calibrate(work: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """``moesaic calibrate --cluster --model``: the profile every prediction of ``cfg`` uses,
    measured before any of its runs."""
    (work / "train_dropless.toml").write_text(train_toml(cfg, work / "unused", "dropless"))
    args = ["calibrate", "--cluster", str(work / "cluster.toml"), "--out", str(work / "p.json")]
    t0 = time.perf_counter()
    proc = run_cli([*args, "--model", str(work / "train_dropless.toml")])
    if proc.returncode != 0:
        raise RuntimeError(f"calibrate failed: {proc.stderr.strip()[-500:]}")
    return {"calibrate_s": time.perf_counter() - t0}


def plan(work: Path, capacity: float | None = None) -> list[dict[str, Any]]:
    """``moesaic plan --json`` with the configuration's profile (before any measurement),
    allowed ``capacity`` when given."""
    args = ["plan", "--cluster", str(work / "cluster.toml"), "--model"]
    args += [str(work / "train_dropless.toml"), "--profile", str(work / "p.json"), "--json"]
    if capacity is not None:
        args += ["--capacity-factor", str(capacity)]
    proc = run_cli(args)
    if proc.returncode != 0:
        raise RuntimeError(f"plan failed: {proc.stderr.strip()[-500:]}")
    ranking = json.loads(proc.stdout)
    (work / "plan.json").write_text(json.dumps(ranking[:1]))
    return ranking


def predict(
    work: Path,
    strategy: str,
    schedule: str,
    profile: str = "p.json",
    domains: list[int] | None = None,
) -> dict[str, Any]:
    """``moesaic simulate --json`` of one combination with the configuration's profile (the
    file ``profile`` in ``work``); hybrid at ``domains`` when given, else at the sizes the
    simulator plans (recorded as ``domain_sizes``)."""
    args = ["simulate", "--cluster", str(work / "cluster.toml"), "--model"]
    args += [str(work / f"train_{strategy}.toml"), "--profile", str(work / profile)]
    args += ["--strategy", strategy, "--schedule", schedule, "--json"]
    if domains is not None:
        args += ["--domains", ",".join(map(str, domains))]
    if schedule != "vanilla":
        args += ["--degree", str(PIPELINE_DEGREE)]
    proc = run_cli(args)
    if proc.returncode != 0:
        return {"predict_error": proc.stderr.strip().splitlines()[-1:]}
    out = json.loads(proc.stdout)
    out = out[0] if isinstance(out, list) else out
    pred = {"predicted_s": out["iteration_ms"] / 1e3, "bound_s": out["bound_ms"] / 1e3}
    if out.get("sp_bytes") is not None:
        pred["sp_bytes"] = int(out["sp_bytes"])
    if out.get("domain_sizes") is not None:
        pred["domain_sizes"] = [int(x) for x in out["domain_sizes"]]
    return pred


def measure_plan(work: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """The planner's pick trained with ``moesaic train --plan plan.json --emulate`` on the job's
    model as given (the configuration without a capacity factor; one the pick sets applies)."""
    pick = json.loads((work / "plan.json").read_text())[0]
    strategy = pick["strategy"]
    run_dir = work / "run_plan"
    shutil.rmtree(run_dir, ignore_errors=True)
    # the job's model as given (no capacity: a capacity factor is the plan's to set)
    config = work / "train_plan.toml"
    config.write_text(job_toml(cfg, run_dir))
    cluster = str(work / "cluster.toml")
    args = [sys.executable, "-m", "moesaic", "train", "--config", str(config)]
    args += ["--emulate", cluster, "--plan", str(work / "plan.json")]
    if strategy == "hybrid":
        args += ["--cluster", cluster]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=1200)
    _drop_checkpoints(run_dir)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return {**_steps(run_dir, cfg), "pick": pick}


def repredict(path: Path) -> None:
    """Every point of a result predicted again by the simulator as it is now (same profiles,
    slowed by the configuration's speed factor where the rule measured one; the configuration's
    files rebuilt from the rule); the first prediction is kept as ``predicted_s_first``."""
    data = json.loads(path.read_text())
    by_name = {c["name"]: c for c in data["configurations"]}
    for name, entry in by_name.items():
        cfg = find_configuration(name)
        work = Path(tempfile.mkdtemp(prefix=f"unseen_re_{name}_"))
        (work / "cluster.toml").write_text(cluster_toml(cfg))
        (work / "p.json").write_text(json.dumps(entry["profile"]))
        if "speed" in entry:  # the seventeenth rule's on: judged at the runs' speed
            from moesaic.sim.profile import Profile

            profile = Profile.load(work / "p.json")
            profile.slowed(entry["speed"]["speed_factor"]).save(work / "p.json")
        for strategy in {p["strategy"] for p in data["points"] if p["configuration"] == name}:
            (work / f"train_{strategy}.toml").write_text(train_toml(cfg, work / "r", strategy))
        for point in (p for p in data["points"] if p["configuration"] == name):
            point.setdefault("predicted_s_first", point.get("predicted_s"))
            domains = ran_at(point, data.get("rule_number", 1))
            point.update(predict(work, point["strategy"], point["schedule"], domains=domains))
    path.write_text(json.dumps(data, indent=1))


def speed_reference(work: Path) -> float:
    """The profile's speed reference timed here now (its model, its threads), seconds."""
    from moesaic.measure.opmeasure import reference_s
    from moesaic.sim.profile import Profile

    ops = Profile.load(work / "p.json").ops
    if ops is None or ops.reference_s <= 0:
        raise RuntimeError("the profile has no speed reference: calibrate --model records one")
    return reference_s(ops.model, threads=ops.threads)


def ran_at(point: dict[str, Any], rule: int) -> list[int] | None:
    """The domain sizes ``point``'s runs trained at, for a prediction of it again: the ones
    first priced from ``PRICED_DOMAINS_FROM`` on (a slowed profile or a changed simulator may
    plan others), else None (the runs planned theirs with ``--domains auto``)."""
    return point.get("domain_sizes") if rule >= PRICED_DOMAINS_FROM else None


def predict_retimed(
    work: Path, points: list[dict[str, Any]], refs: list[float], rule: int = RETIMED_FROM
) -> dict:
    """The seventeenth rule's judged predictions: every point predicted again with the profile
    slowed by the configuration's speed factor (the geometric mean over its runs of the
    references before and after each, over the profile's); the first kept as
    ``predicted_calibrated_s``."""
    from moesaic.sim.profile import Profile

    profile = Profile.load(work / "p.json")
    assert profile.ops is not None
    runs = [math.sqrt(a * b) / profile.ops.reference_s for a, b in itertools.pairwise(refs)]
    factor = math.exp(statistics.fmean(math.log(f) for f in runs))
    profile.slowed(factor, why="the runs' speed reference").save(work / "p_runs.json")
    for point in points:
        point["predicted_calibrated_s"] = point.get("predicted_s")
        point["bound_calibrated_s"] = point.get("bound_s")
        domains = ran_at(point, rule)
        point.update(predict(work, point["strategy"], point["schedule"], "p_runs.json", domains))
    return {
        "reference_calibrated_s": profile.ops.reference_s,
        "references_s": refs,
        "run_factors": runs,
        "speed_factor": factor,
    }


def run_configuration_passes(
    cfg: dict[str, Any],
    index: int,
    out: dict[str, Any],
    path: str,
    *,
    retimed: bool = False,
    passes: int = PASSES_5,
    rule: int = 5,
) -> None:
    """The fifth rule's protocol on one configuration: calibrate, plan (capacity allowed),
    predict every combination, then ``passes`` passes of every combination (flowmoe at the
    predicted Sp) and the pick; ``measured_s`` is the mean of a point's runs' medians.
    ``retimed`` (from the seventeenth rule): the speed reference timed before the first run and
    after every run, and every point predicted again at the runs' speed
    (:func:`predict_retimed`). From ``PRICED_DOMAINS_FROM`` on, hybrid runs at the domain
    sizes its prediction priced (:func:`ran_at`), not at the ones ``--domains auto`` plans."""
    work = Path(tempfile.mkdtemp(prefix=f"unseen_{cfg['name']}_"))
    (work / "cluster.toml").write_text(cluster_toml(cfg))
    entry: dict[str, Any] = {"index": index, **cfg, "load_before": os.getloadavg()}
    entry.update(calibrate(work, cfg))
    for strategy in {s for s, _ in COMBINATIONS}:
        (work / f"train_{strategy}.toml").write_text(train_toml(cfg, work / "r", strategy))
    ranking = plan(work, capacity=PADDED_CAPACITY)
    entry["plan_top3"] = ranking[:3]
    points = []
    for strategy, schedule in COMBINATIONS:
        point = {"configuration": cfg["name"], "strategy": strategy, "schedule": schedule}
        point.update(predict(work, strategy, schedule))
        point["runs"] = []
        points.append(point)
    picks: list[dict[str, Any]] = []
    refs = [speed_reference(work)] if retimed else []
    for _ in range(passes):
        for point in points:
            sp = point.get("sp_bytes") if point["schedule"] == "flowmoe" else None
            domains = ran_at(point, rule)
            run = measure(work, cfg, point["strategy"], point["schedule"], sp, domains)
            if retimed:
                refs.append(speed_reference(work))
                run["reference_after_s"] = refs[-1]
            point["runs"].append(run)
            print(json.dumps({**{k: v for k, v in point.items() if k != "runs"}, **run}))
        picks.append(measure_plan(work, cfg))
        if retimed:
            refs.append(speed_reference(work))
    for point in points:
        medians = [r["measured_s"] for r in point["runs"] if "measured_s" in r]
        if len(medians) == passes:
            point["measured_s"] = statistics.fmean(medians)
        else:
            point["error"] = [r["error"] for r in point["runs"] if "error" in r]
    if retimed:
        entry["speed"] = predict_retimed(work, points, refs, rule)
    out["points"] += points
    medians = [p["measured_s"] for p in picks if "measured_s" in p]
    entry["plan_measured"] = {"runs": picks}
    if len(medians) == passes:
        entry["plan_measured"].update(measured_s=statistics.fmean(medians), pick=picks[0]["pick"])
    entry["profile"] = json.loads((work / "p.json").read_text())
    entry["load_after"] = os.getloadavg()
    out["configurations"].append(entry)
    print(json.dumps({k: v for k, v in entry.items() if k != "profile"}), flush=True)
    Path(path).write_text(json.dumps(out, indent=1))
    shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the configurations only")
    parser.add_argument("--rule", type=int, default=1, help="1 to 26 (the docstring's rules)")
    parser.add_argument("--only", default=None, help="comma-separated configuration indices")
    parser.add_argument("--out", default="benchmarks/results/sim_unseen.json")
    parser.add_argument(
        "--repredict", action="store_true", help="predict --out's points again, measure nothing"
    )
    args = parser.parse_args()
    if args.repredict:
        repredict(Path(args.out))
        return
    cfgs = configurations(args.rule)
    if args.list:
        for i, c in enumerate(cfgs):
            print(i, c["name"], {k: c[k] for k in FACTORS}, "hidden", c["hidden"])
        return
    chosen = range(len(cfgs)) if args.only is None else [int(x) for x in args.only.split(",")]
    out: dict[str, Any] = {
        "rule": sim_unseen_rules.__doc__,
        "rule_number": args.rule,
        "configurations": [],
        "points": [],
    }
    for i in chosen:
        cfg = cfgs[i]
        if args.rule >= 5:
            retimed = args.rule >= RETIMED_FROM
            passes = passes_of(args.rule)
            run_configuration_passes(
                cfg, i, out, args.out, retimed=retimed, passes=passes, rule=args.rule
            )
            continue
        work = Path(tempfile.mkdtemp(prefix=f"unseen_{cfg['name']}_"))
        (work / "cluster.toml").write_text(cluster_toml(cfg))
        entry: dict[str, Any] = {"index": i, **cfg, "load_before": os.getloadavg()}
        entry.update(calibrate(work, cfg))
        ranking = plan(work)
        entry["plan_top3"] = ranking[:3]
        for strategy, schedule in COMBINATIONS:
            point = {"configuration": cfg["name"], "strategy": strategy, "schedule": schedule}
            point.update(measure(work, cfg, strategy, schedule))
            point.update(predict(work, strategy, schedule))
            out["points"].append(point)
            print(json.dumps(point), flush=True)
        entry["plan_measured"] = measure_plan(work, cfg)
        entry["profile"] = json.loads((work / "p.json").read_text())
        entry["load_after"] = os.getloadavg()
        out["configurations"].append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k != "profile"}), flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
