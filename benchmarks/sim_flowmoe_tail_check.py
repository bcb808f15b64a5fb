"""FlowMoE's gradient tail as one chunk (``schedule/grad_layout.py``), checked on seen
configurations: the runtime before and after, measured side by side, and the simulator's
price of the tail before and after (``sim/pipelined.py``'s ``sim/grad_chunks.py`'s `one_tail_chunk``) beside them.

**The rule** (fixed on 2026-12-04 at 08:20 UTC, before any of its runs): the eight
configurations of the last seen unseen rule (26, ``sim_unseen.py``), ``dropless`` under
``flowmoe`` at R = 2 with the training's default Sp, as that rule ran it (``sim_unseen.measure``'s
run: ``WARMUP`` + ``STEPS`` steps, rank 0's median step after the warm-up). Per
configuration, in this order: the runtime before the tail change (commit ``BEFORE``, from a
git worktree given by ``--before``, put first on ``PYTHONPATH``), then the runtime now, then
now again, then before again (ABBA, so a drift of the machine's speed over the four runs
cancels in the pair's mean). Reported per configuration: the medians before and after, their
ratio (after / before), and the simulator's predicted step with the tail as one call per Sp
chunk (the model before) and as one chunk (now), each with the configuration's stored profile
slowed by its runs' speed factor (as ``sim_seen_repredict.py`` predicts the seen points). The
question: does the price's change follow the runtime's, configuration by configuration?

Usage (root: the emulated network needs network namespaces)::

    git worktree add /tmp/before 167ea1d
    python benchmarks/sim_flowmoe_tail_check.py --before /tmp/before \\
        --out benchmarks/results/sim_flowmoe_tail_check.json
"""

from __future__ import annotations

import argparse
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

import sim_unseen
from sim_seen_repredict import repredict_rule

ROOT = Path(__file__).resolve().parent.parent
RULE = 26
BEFORE = "167ea1d"  # the parent of b16ff5a, the tail change
STRATEGY, SCHEDULE = "dropless", "flowmoe"


def measure(work: Path, cfg: dict[str, Any], src: Path | None) -> dict[str, Any]:
    """One run of ``cfg``'s flowmoe (``sim_unseen.measure``'s), with ``src`` first on the
    ``PYTHONPATH`` (None: this checkout)."""
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    config = work / "train.toml"
    config.write_text(sim_unseen.train_toml(cfg, run_dir, STRATEGY))
    args = [sys.executable, "-m", "moesaic", "train", "--config", str(config)]
    args += ["--emulate", str(work / "cluster.toml"), *sim_unseen.combo_flags(STRATEGY, SCHEDULE)]
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src / "src"), env.get("PYTHONPATH", "")])
    t0 = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=1200, env=env)
    wall = time.perf_counter() - t0
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"{cfg['name']}: {(proc.stderr or proc.stdout).strip()[-800:]}")
    return {**sim_unseen._steps(run_dir, cfg), "wall_s": wall}


def predictions(src: Path | None) -> dict[str, float]:
    """Rule 26's flowmoe points predicted by the simulator of ``src`` (None: this checkout),
    in a child process so that ``src`` is imported."""
    if src is None:
        points = repredict_rule(RULE, {STRATEGY}, {SCHEDULE})
        return {p["configuration"]: p["now_s"] for p in points}
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks');"
        "from sim_seen_repredict import repredict_rule;"
        f"print(json.dumps({{p['configuration']: p['now_s'] for p in "
        f"repredict_rule({RULE}, {{'{STRATEGY}'}}, {{'{SCHEDULE}'}})}}))"
    )
    env = {**os.environ, "PYTHONPATH": str(src / "src")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=src, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, type=Path, help=f"a worktree at {BEFORE}")
    ap.add_argument("--only", default=None, help="comma-separated configuration indices")
    ap.add_argument("--out", default="benchmarks/results/sim_flowmoe_tail_check.json")
    args = ap.parse_args()
    before = args.before.resolve()
    price_before, price_now = predictions(before), predictions(None)
    configs = sim_unseen.configurations(RULE)
    if args.only:
        configs = [configs[int(i)] for i in args.only.split(",")]
    stored = json.loads((ROOT / f"benchmarks/results/sim_unseen{RULE}.json").read_text())
    measured_then = {
        p["configuration"]: p.get("measured_s")
        for p in stored["points"]
        if p["strategy"] == STRATEGY and p["schedule"] == SCHEDULE
    }
    rows = []
    for cfg in configs:
        work = Path(tempfile.mkdtemp(prefix="tailcheck_"))
        (work / "cluster.toml").write_text(sim_unseen.cluster_toml(cfg))
        runs = {"before": [], "after": []}
        for which in ("before", "after", "after", "before"):
            m = measure(work, cfg, before if which == "before" else None)
            runs[which].append(m["measured_s"])
            print(f"{cfg['name']} {which}: {m['measured_s'] * 1e3:.1f} ms", flush=True)
        b, a = statistics.fmean(runs["before"]), statistics.fmean(runs["after"])
        name = cfg["name"]
        row = {
            "configuration": name,
            "measured_before_s": runs["before"],
            "measured_after_s": runs["after"],
            "after_over_before": a / b,
            "measured_in_rule_s": measured_then.get(name),
            "price_before_s": price_before.get(name),
            "price_after_s": price_now.get(name),
        }
        if row["price_before_s"] and row["price_after_s"]:
            row["price_after_over_before"] = row["price_after_s"] / row["price_before_s"]
            row["error_before"] = row["price_before_s"] / b - 1
            row["error_after"] = row["price_after_s"] / a - 1
        rows.append(row)
        print(json.dumps(row), flush=True)

    def geo(key: str) -> float | None:
        vals = [abs(r[key]) for r in rows if key in r]
        return math.exp(statistics.fmean(math.log1p(v) for v in vals)) - 1 if vals else None

    out = {
        "rule": "benchmarks/sim_flowmoe_tail_check.py docstring",
        "before_commit": BEFORE,
        "rows": rows,
        "measured_after_over_before_geomean": math.exp(
            statistics.fmean(math.log(r["after_over_before"]) for r in rows)
        ),
        "price_error_geomean": {"before": geo("error_before"), "after": geo("error_after")},
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
