"""Runs the wider family's unseen rules (``sim_unseen_wide_rules.py``: odd world sizes, top-1
and top-k > 2, three-level clusters, skewed routing; each configuration predicted from its
training config and from a model file): per configuration ``calibrate``, ``plan`` and
``simulate`` of every combination before any run, then every strategy x schedule and each
plan's pick trained on the emulated cluster in interleaved passes, and the predictions made
again at the runs' measured speed. The procedure and what is judged are rule 27's text
(``RULE_27``), with each later rule's changes in its own text; ``sim_unseen_wide_report.py``
judges a result.

Usage (root: the emulated network needs network namespaces)::

    python benchmarks/sim_unseen_wide.py --list
    python benchmarks/sim_unseen_wide.py [--rule 27|...|34] [--only 0,2] [--out FILE.json]
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

# the unseen rules' grid, steps, sequences, heads, blocks, R and padded's capacity
from sim_unseen import (
    BLOCKS,
    COMBINATIONS,
    HEADS,
    PADDED_CAPACITY,
    PIPELINE_DEGREE,
    SEQ,
    STEPS,
    WARMUP,
)
from sim_unseen_wide_rules import RULE_SETS, Rule

SOURCES = ("train", "file")  # the training config's prediction, the model file's


def ranks(cfg: dict[str, Any]) -> int:
    return math.prod(level[1] for level in cfg["levels"])


def cluster_toml(cfg: dict[str, Any]) -> str:
    lines = [f'name = "{cfg["name"]}"', f"world_size = {ranks(cfg)}", ""]
    for name, size, bw, lat in cfg["levels"]:
        lines += ["[[levels]]", f'name = "{name}"', f"size = {size}"]
        lines += [f"bandwidth_gbps = {bw}", f"latency_ms = {lat}", ""]
    return "\n".join(lines)


def ffn(cfg: dict[str, Any]) -> int:
    return round(cfg["f_over_h"] * cfg["hidden"])


def job_toml(cfg: dict[str, Any], run_dir: Path, *, capacity: float | None = None) -> str:
    """The configuration's training config, with ``capacity`` (None: dropless)."""
    moe = [f"num_experts = {cfg['experts']}", f"top_k = {cfg['top_k']}"]
    moe += [f"ffn_hidden_size = {ffn(cfg)}", f"init_std = {cfg['init_std']}"]
    if capacity is not None:
        moe.append(f"capacity_factor = {capacity}")
    world = ranks(cfg)
    run = [f"nproc = {world}", f"ep = {world}", f"steps = {WARMUP + STEPS}"]
    run += [f"batch_size = {cfg['tokens_per_rank'] // SEQ}", "eval_every = 0", "ckpt_every = 0"]
    run += ["save_final = false", f'run_dir = "{run_dir}"']
    model = [f"seq_len = {SEQ}", f"d_model = {cfg['hidden']}", f"n_layers = {BLOCKS}"]
    model.append(f"n_heads = {HEADS}")
    return "\n".join([*run, "", "[model]", *model, "", "[model.moe]", *moe, ""])


def model_toml(cfg: dict[str, Any], *, capacity: float | None = None) -> str:
    """The configuration as a model file (``moesaic.sim.model``'s format): no data."""
    lines = ["[model]", f'name = "{cfg["name"]}"', f"layers = {BLOCKS}"]
    lines += [f"batch = {cfg['tokens_per_rank'] // SEQ}", f"seq_len = {SEQ}"]
    lines += [f"hidden = {cfg['hidden']}", f"ffn_hidden = {ffn(cfg)}"]
    lines += [f"experts = {cfg['experts']}", f"top_k = {cfg['top_k']}", f"heads = {HEADS}"]
    if capacity is not None:
        lines.append(f"capacity_factor = {capacity}")
    return "\n".join(lines) + "\n"


def capacity_of(strategy: str) -> float | None:
    return PADDED_CAPACITY if strategy == "padded" else None


def write_files(work: Path, cfg: dict[str, Any]) -> None:
    (work / "cluster.toml").write_text(cluster_toml(cfg))
    for strategy in {s for s, _ in COMBINATIONS}:
        cap = capacity_of(strategy)
        (work / f"train_{strategy}.toml").write_text(job_toml(cfg, work / "r", capacity=cap))
        (work / f"model_{strategy}.toml").write_text(model_toml(cfg, capacity=cap))


def combo_flags(strategy: str, schedule: str, sp: int | None, domains: list[int] | None):
    flags = ["--strategy", strategy, "--schedule", schedule]
    if schedule != "vanilla":
        flags += ["--pipeline-degree", str(PIPELINE_DEGREE)]
    if sp is not None and schedule == "flowmoe":
        flags += ["--ar-chunk", f"{sp}B"]
    if strategy == "hybrid":
        flags += ["--domains", "auto" if domains is None else ",".join(map(str, domains))]
    return flags


def run_cli(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moesaic", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def steps_of(run_dir: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x.get("kind") == "train"]
    tokens = ranks(cfg) * cfg["tokens_per_rank"]
    step_s = [tokens / x["tokens_per_s"] for x in train[WARMUP:]]
    summary = next((x for x in lines if x.get("kind") == "summary"), {})
    # what the run trained, resolved (the rules from the 29th pool the runs of equal ones)
    combination = summary.get("combination")
    return {"measured_s": statistics.median(step_s), "steps_s": step_s, "combination": combination}


def train(work: Path, cfg: dict[str, Any], name: str, config: str, flags: list[str]) -> dict:
    """One emulated training run of ``config`` with ``flags``; rank 0's median step."""
    run_dir = work / f"run_{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    path = work / f"job_{name}.toml"
    path.write_text(config.replace(f'run_dir = "{work / "r"}"', f'run_dir = "{run_dir}"'))
    cluster = str(work / "cluster.toml")
    args = [sys.executable, "-m", "moesaic", "train", "--config", str(path), "--emulate", cluster]
    args += flags
    t0 = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=1500)
    wall = time.perf_counter() - t0
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-3:], "wall_s": wall}
    return {**steps_of(run_dir, cfg), "wall_s": wall}


def calibrate(work: Path) -> dict[str, Any]:
    """The profile (``p.json``, with the job's routing) and its copy without routing
    (``p_file.json``: what a model file's user has)."""
    args = ["calibrate", "--cluster", str(work / "cluster.toml"), "--out", str(work / "p.json")]
    t0 = time.perf_counter()
    proc = run_cli([*args, "--model", str(work / "train_dropless.toml")])
    if proc.returncode != 0:
        raise RuntimeError(f"calibrate failed: {proc.stderr.strip()[-800:]}")
    profile = json.loads((work / "p.json").read_text())
    routing = profile.pop("routing", None)
    (work / "p_file.json").write_text(json.dumps(profile))
    return {"calibrate_s": time.perf_counter() - t0, "routing": routing}


def model_path(work: Path, source: str, strategy: str) -> Path:
    return work / (f"train_{strategy}.toml" if source == "train" else f"model_{strategy}.toml")


def profile_name(source: str, slowed: bool = False) -> str:
    return ("p" if source == "train" else "p_file") + ("_runs" if slowed else "") + ".json"


def plan(work: Path, source: str, slowed: bool = False) -> list[dict[str, Any]]:
    """``moesaic plan --json --capacity-factor 1.25`` from ``source``; the ranking (the pick
    written to ``plan_<source>.json``)."""
    args = ["plan", "--cluster", str(work / "cluster.toml"), "--model"]
    args += [str(model_path(work, source, "dropless"))]
    args += ["--profile", str(work / profile_name(source, slowed)), "--json"]
    args += ["--capacity-factor", str(PADDED_CAPACITY)]
    proc = run_cli(args)
    if proc.returncode != 0:
        raise RuntimeError(f"plan failed: {proc.stderr.strip()[-800:]}")
    ranking = json.loads(proc.stdout)
    if not slowed:
        (work / f"plan_{source}.json").write_text(json.dumps(ranking[:1]))
    return ranking


def predict(
    work: Path,
    source: str,
    strategy: str,
    schedule: str,
    domains: list[int] | None = None,
    slowed: bool = False,
) -> dict[str, Any]:
    """``moesaic simulate --json`` of one combination from ``source``."""
    args = ["simulate", "--cluster", str(work / "cluster.toml"), "--model"]
    args += [str(model_path(work, source, strategy))]
    args += ["--profile", str(work / profile_name(source, slowed))]
    args += ["--strategy", strategy, "--schedule", schedule, "--json"]
    if domains is not None:
        args += ["--domains", ",".join(map(str, domains))]
    if schedule != "vanilla":
        args += ["--degree", str(PIPELINE_DEGREE)]
    proc = run_cli(args)
    if proc.returncode != 0:
        return {"predict_error": proc.stderr.strip().splitlines()[-2:]}
    out = json.loads(proc.stdout)
    out = out[0] if isinstance(out, list) else out
    pred: dict[str, Any] = {"predicted_s": out["iteration_ms"] / 1e3}
    if out.get("range_ms") is not None:
        pred["range_s"] = [x / 1e3 for x in out["range_ms"]]
    if out.get("sp_bytes") is not None:
        pred["sp_bytes"] = int(out["sp_bytes"])
    if out.get("domain_sizes") is not None:
        pred["domain_sizes"] = [int(x) for x in out["domain_sizes"]]
    return pred


def speed_reference(work: Path) -> float:
    from moesaic.measure.opmeasure import reference_s
    from moesaic.sim.profile import Profile

    ops = Profile.load(work / "p.json").ops
    if ops is None or ops.reference_s <= 0:
        raise RuntimeError("the profile has no speed reference")
    return reference_s(ops.model, threads=ops.threads)


def slow_profiles(work: Path, refs: list[float]) -> dict[str, Any]:
    """Both profiles slowed by the runs' speed factor (``p_runs.json``, ``p_file_runs.json``)."""
    from moesaic.sim.profile import Profile

    profile = Profile.load(work / "p.json")
    assert profile.ops is not None
    runs = [math.sqrt(a * b) / profile.ops.reference_s for a, b in itertools.pairwise(refs)]
    factor = math.exp(statistics.fmean(math.log(f) for f in runs))
    for source in SOURCES:
        p = Profile.load(work / profile_name(source))
        p.slowed(factor, why="the runs' speed reference").save(work / profile_name(source, True))
    return {
        "reference_calibrated_s": profile.ops.reference_s,
        "references_s": refs,
        "speed_factor": factor,
    }


def run_configuration(cfg: dict[str, Any], out: dict[str, Any], path: str, rule: Rule) -> None:
    passes = rule.passes
    work = Path(tempfile.mkdtemp(prefix=f"unseen_{cfg['name']}_"))
    write_files(work, cfg)
    entry: dict[str, Any] = {**cfg, "ranks": ranks(cfg), "load_before": os.getloadavg()}
    entry.update(calibrate(work))
    # every prediction before any measurement
    for source in SOURCES:
        entry[f"plan_{source}_calibrated"] = plan(work, source)[:5]
    points = []
    for strategy, schedule in COMBINATIONS:
        point: dict[str, Any] = {"configuration": cfg["name"], "strategy": strategy}
        point["schedule"] = schedule
        point["train"] = predict(work, "train", strategy, schedule)
        domains = point["train"].get("domain_sizes")
        point["file"] = predict(work, "file", strategy, schedule, domains)
        point["runs"] = []
        points.append(point)
    print(json.dumps({"configuration": cfg["name"], "predicted": points}), flush=True)
    refs = [speed_reference(work)]
    picks: dict[str, list[dict[str, Any]]] = {s: [] for s in SOURCES}
    for _ in range(passes):
        for point in points:
            strategy, schedule = point["strategy"], point["schedule"]
            sp = point["train"].get("sp_bytes")
            domains = point["train"].get("domain_sizes")
            config = job_toml(cfg, work / "r", capacity=capacity_of(strategy))
            flags = combo_flags(strategy, schedule, sp, domains)
            if strategy == "hybrid":
                flags += ["--cluster", str(work / "cluster.toml")]
            run = train(work, cfg, f"{strategy}_{schedule}", config, flags)
            refs.append(speed_reference(work))
            run["reference_after_s"] = refs[-1]
            point["runs"].append(run)
            print(json.dumps({"name": cfg["name"], "combo": f"{strategy}+{schedule}", **run}))
        for source in SOURCES:
            pick = json.loads((work / f"plan_{source}.json").read_text())[0]
            flags = ["--plan", str(work / f"plan_{source}.json")]
            if pick["strategy"] == "hybrid":
                flags += ["--cluster", str(work / "cluster.toml")]
            run = train(work, cfg, f"plan_{source}", job_toml(cfg, work / "r"), flags)
            refs.append(speed_reference(work))
            picks[source].append({**run, "pick": pick})
            print(json.dumps({"name": cfg["name"], "plan": source, **run}), flush=True)
    for point in points:
        medians = [r["measured_s"] for r in point["runs"] if "measured_s" in r]
        if len(medians) == passes:
            point["measured_s"] = statistics.fmean(medians)
    entry["speed"] = slow_profiles(work, refs)
    for point in points:  # judged: at the runs' speed
        for source in SOURCES:
            point[source]["calibrated"] = {
                k: point[source].get(k) for k in ("predicted_s", "range_s")
            }
            domains = point["train"].get("domain_sizes")
            again = predict(work, source, point["strategy"], point["schedule"], domains, True)
            point[source].update(
                {k: v for k, v in again.items() if k in ("predicted_s", "range_s")}
            )
    for source in SOURCES:
        entry[f"plan_{source}"] = plan(work, source, slowed=True)
        medians = [p["measured_s"] for p in picks[source] if "measured_s" in p]
        entry[f"pick_{source}"] = {"runs": picks[source]}
        if len(medians) == passes:
            entry[f"pick_{source}"]["measured_s"] = statistics.fmean(medians)
    entry["profile"] = json.loads((work / "p.json").read_text())
    entry["load_after"] = os.getloadavg()
    out["configurations"].append(entry)
    out["points"] += points
    Path(path).write_text(json.dumps(out, indent=1))
    shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the configurations only")
    parser.add_argument("--only", default=None, help="comma-separated configuration indices")
    parser.add_argument("--rule", type=int, default=27, choices=sorted(RULE_SETS))
    parser.add_argument("--out", default=None, help="default results/sim_unseen{rule}.json")
    args = parser.parse_args()
    rule = RULE_SETS[args.rule]
    text, configurations = rule.text, rule.configurations
    args.out = args.out or f"benchmarks/results/sim_unseen{args.rule}.json"
    if args.list:
        for i, c in enumerate(configurations):
            print(i, c["name"], ranks(c), "ranks", {k: v for k, v in c.items() if k != "name"})
        return
    chosen = range(len(configurations)) if args.only is None else map(int, args.only.split(","))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    out: dict[str, Any] = {
        "rule": text,
        "passes": rule.passes,
        "pooled": rule.pooled,
        "picks_measured": rule.picks_measured,
        "commit": commit.stdout.strip(),
        "configurations": [],
        "points": [],
    }
    for i in chosen:
        run_configuration(configurations[i], out, args.out, rule)


if __name__ == "__main__":
    main()
