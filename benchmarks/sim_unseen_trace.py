"""One unseen-rule configuration's combinations trained with ``--trace`` on its emulated cluster
and simulated with its stored profile: busy milliseconds per step by lane and by task name,
measured (rank 0 and 1, the trace's last steps) beside simulated (the representative rank).

Where a point's error comes from (``benchmarks/sim_validation.md``). The trace's spans cost a little
time of their own, so a traced step is not the grid's measurement. Per collective lane also
the ranks' arrival (:func:`arrival`): how long a call waits for the last rank to issue it and
how long it takes once every rank has (the ranks' clocks are one machine's monotonic clock),
and how many ranks compute beside a computing rank (:func:`compute_overlap`).
``--traces DIR`` keeps the raw traces there.

A wide rule's configuration (``sim_unseen_wide.py``, rules 27 on, names ``w...``) is traced
the same way from its training config, its stored profile slowed by its runs' speed factor as the
rule judged it.

Usage (root: the emulated network needs network namespaces)::

    python benchmarks/sim_unseen_trace.py RESULT.json NAME strategy:schedule [...] [--out F.json]
        [--traces DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_unseen as su
import sim_unseen_wide as wide
from moesaic.sim.profile import Profile
from moesaic.trace import COMPUTE_RESOURCES

TRACE_STEPS = 3  # moesaic.train.config.TRACE_STEPS: the steps a trace keeps


def _events(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    return data["traceEvents"] if isinstance(data, dict) else data


def by_lane(events: list[dict[str, Any]], steps: int) -> dict[int, dict[str, float]]:
    """Per rank (``pid``), per lane (thread name): busy ms per step."""
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    out: dict[int, dict[str, float]] = collections.defaultdict(
        lambda: collections.defaultdict(float)
    )
    for e in events:
        if e.get("ph") == "X":
            out[e["pid"]][names[e["pid"], e["tid"]]] += e["dur"] / 1e3 / steps
    return {r: {k: round(v, 1) for k, v in d.items()} for r, d in sorted(out.items())}


def by_name(events: list[dict[str, Any]], steps: int, pid: int = 0) -> dict[str, float]:
    """Rank ``pid``'s busy ms per step by task name (phases summed)."""
    out: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and e["pid"] == pid:
            out[e["name"]] += e["dur"] / 1e3 / steps
    return {k: round(v, 1) for k, v in sorted(out.items())}


def arrival(events: list[dict[str, Any]], lane: str) -> dict[str, float] | None:
    """The calls on ``lane`` matched across ranks by name and order: medians (ms) of a call's
    span, of the lag between the first and the last rank issuing it, and of the time from the
    last rank's issue to the first rank's end (the collective itself once all are in)."""
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    calls: dict[tuple[str, int], list[tuple[float, float]]] = collections.defaultdict(list)
    seen: dict[tuple[int, str], int] = collections.defaultdict(int)
    for e in sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"]):
        if names[e["pid"], e["tid"]] != lane:
            continue
        k = seen[e["pid"], e["name"]]
        seen[e["pid"], e["name"]] += 1
        calls[e["name"], k].append((e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3))
    ranks = len({pid for pid, _ in seen})
    full = [c for c in calls.values() if len(c) == ranks and ranks > 1]
    if not full:
        return None
    return {
        "calls": len(full),
        "span_ms": round(statistics.median(e - s for c in full for s, e in c), 2),
        "issue_lag_ms": round(
            statistics.median(max(s for s, _ in c) - min(s for s, _ in c) for c in full), 2
        ),
        "after_last_issue_ms": round(
            statistics.median(min(e for _, e in c) - max(s for s, _ in c) for c in full), 2
        ),
    }


def compute_overlap(events: list[dict[str, Any]]) -> dict[str, float] | None:
    """While a rank computes (its compute lanes' union, the trace's whole span), how many other
    ranks compute too, time-weighted and averaged over the ranks (``others_computing``), beside
    what :mod:`moesaic.sim.contention` assumes, each other rank computing its own share of the
    span independently of this one (``independent``: the sum of the others' shares)."""
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    spans: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and names[e["pid"], e["tid"]] in COMPUTE_RESOURCES:
            spans[e["pid"]].append((e["ts"], e["ts"] + e["dur"]))
    if len(spans) < 2:
        return None
    busy = {r: _union(v) for r, v in spans.items()}
    lo = min(a for v in busy.values() for a, _ in v)
    hi = max(b for v in busy.values() for _, b in v)
    share = {r: sum(b - a for a, b in v) / (hi - lo) for r, v in busy.items()}
    edges = sorted((t, d, r) for r, v in busy.items() for a, b in v for t, d in ((a, 1), (b, -1)))
    active: set[int] = set()
    beside: dict[int, float] = collections.defaultdict(float)
    last = edges[0][0]
    for t, d, r in edges:
        for a in active:
            beside[a] += (t - last) * (len(active) - 1)
        last = t
        (active.add if d > 0 else active.discard)(r)
    return {
        "others_computing": round(
            statistics.fmean(beside[r] / (share[r] * (hi - lo)) for r in busy), 2
        ),
        "independent": round(
            statistics.fmean(sum(share[o] for o in busy if o != r) for r in busy), 2
        ),
        "compute_share": round(statistics.fmean(share.values()), 2),
    }


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def analyse(trace: Path, sim_trace: Path) -> dict[str, Any]:
    """A traced run's and its simulation's busy times and the measured arrival per lane."""
    measured, simulated = _events(trace), _events(sim_trace)
    return {
        "measured_ms_by_lane": by_lane(measured, TRACE_STEPS),
        "simulated_ms_by_lane": by_lane(simulated, 1),
        "measured_ms_by_name": by_name(measured, TRACE_STEPS),
        "simulated_ms_by_name": by_name(simulated, 1),
        "arrival": {
            lane: a for lane in ("a2a", "allreduce") if (a := arrival(measured, lane)) is not None
        },
        "compute_overlap": compute_overlap(measured),
    }


def _traced(
    work: Path,
    cfg: dict[str, Any],
    config: Path,
    cluster: str,
    combo: tuple[str, str],
    run_dir: Path,
) -> dict[str, Any]:
    """One combination simulated (with its trace) from ``work/p.json``, then trained with
    ``--trace`` at what was simulated (hybrid at the domain sizes the simulation priced, as the
    rules do from the twenty-first on)."""
    strategy, schedule = combo
    sim_trace = work / f"sim_{strategy}_{schedule}.json"
    sargs = ["simulate", "--cluster", cluster, "--model", str(config), "--profile"]
    sargs += [str(work / "p.json"), "--strategy", strategy, "--schedule", schedule, "--json"]
    sargs += ["--trace", str(sim_trace)]
    if schedule != "vanilla":
        sargs += ["--degree", str(su.PIPELINE_DEGREE)]
    sim = json.loads(su.run_cli(sargs).stdout)
    sim = sim[0] if isinstance(sim, list) else sim
    trace = work / f"trace_{strategy}_{schedule}.json"
    args = [sys.executable, "-m", "moesaic", "train", "--config", str(config), "--emulate"]
    flags = su.combo_flags(strategy, schedule, domains=sim.get("domain_sizes"))
    args += [cluster, *flags, "--trace", str(trace)]
    if strategy == "hybrid":
        args += ["--cluster", cluster]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    steps = wide.steps_of(run_dir, cfg) if "levels" in cfg else su._steps(run_dir, cfg)
    return {
        "measured_s": steps["measured_s"],
        "steps_s": steps["steps_s"],
        "predicted_s": sim["iteration_ms"] / 1e3,
        "domain_sizes": sim.get("domain_sizes"),
        "contention": sim.get("contention"),
        **analyse(trace, sim_trace),
    }


def trace_one(work: Path, cfg: dict[str, Any], strategy: str, schedule: str) -> dict[str, Any]:
    """A factorial rule's (1-26) combination traced (:func:`_traced`)."""
    run_dir = work / f"run_{strategy}_{schedule}"
    config = work / f"train_{strategy}.toml"
    config.write_text(su.train_toml(cfg, run_dir, strategy))
    return _traced(work, cfg, config, str(work / "cluster.toml"), (strategy, schedule), run_dir)


def trace_one_wide(work: Path, cfg: dict[str, Any], strategy: str, schedule: str) -> dict:
    """A wide rule's (27 on) combination traced from its training config (:func:`_traced`)."""
    run_dir = work / f"run_{strategy}_{schedule}"
    config = work / f"job_{strategy}_{schedule}.toml"
    text = wide.job_toml(cfg, run_dir, capacity=wide.capacity_of(strategy))
    config.write_text(text)
    return _traced(work, cfg, config, str(work / "cluster.toml"), (strategy, schedule), run_dir)


def setup_wide(work: Path, name: str, data: dict[str, Any]) -> dict[str, Any]:
    """A wide rule's configuration: its cluster and its stored profile at the runs' speed."""
    entry = next(c for c in data["configurations"] if c["name"] == name)
    rules = wide.RULE_SETS.values()
    cfg = next(c for r in rules for c in r.configurations if c["name"] == name)
    (work / "cluster.toml").write_text(wide.cluster_toml(cfg))
    (work / "p_stored.json").write_text(json.dumps(entry["profile"]))
    factor = entry["speed"]["speed_factor"]
    slowed = Profile.load(work / "p_stored.json").slowed(factor, why="the runs' speed reference")
    slowed.save(work / "p.json")
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", help="a sim_unseen result (its configuration's profile)")
    parser.add_argument("name", help="the configuration, e.g. r+-++-")
    parser.add_argument("combos", nargs="+", help="strategy:schedule")
    parser.add_argument("--out", default=None)
    parser.add_argument("--traces", default=None, help="a folder to keep the raw traces in")
    args = parser.parse_args()
    data = json.loads(Path(args.result).read_text())
    work = Path(tempfile.mkdtemp(prefix=f"unseen_trace_{args.name}_"))
    is_wide = "passes" in data  # sim_unseen_wide.py's results
    if is_wide:
        cfg = setup_wide(work, args.name, data)
    else:
        entry = next(c for c in data["configurations"] if c["name"] == args.name)
        cfg = su.find_configuration(args.name)
        (work / "cluster.toml").write_text(su.cluster_toml(cfg))
        (work / "p.json").write_text(json.dumps(entry["profile"]))
    one = trace_one_wide if is_wide else trace_one
    out: dict[str, Any] = {"result": args.result, "configuration": args.name, "runs": {}}
    for combo in args.combos:
        strategy, schedule = combo.split(":")
        out["runs"][combo] = one(work, cfg, strategy, schedule)
        print(combo, json.dumps(out["runs"][combo]), flush=True)
    if args.traces:
        keep = Path(args.traces)
        keep.mkdir(parents=True, exist_ok=True)
        for f in [*work.glob("trace_*.json"), *work.glob("sim_*.json")]:
            shutil.copy(f, keep / f.name)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
