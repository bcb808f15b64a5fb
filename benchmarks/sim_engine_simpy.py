"""The simulator's event loop against SimPy on the same task graphs (issue: "use a well-kept
library where it serves, or show by measurement why your own loop is needed").

Usage::

    pip install simpy   # not a dependency of moesaic
    python benchmarks/sim_engine_simpy.py [--out benchmarks/results/sim_engine_simpy.json]

Graphs: the 1,000-datacenter x 8-rank EP and HybridEP (+Migration) iterations of
``benchmarks/sim_scale.py``, as the representative rank (41 tasks) and with every rank
simulated (``SimGraph.replicate``: 328,000 tasks). SimPy runs each lane as a process that waits
for its job's event (a counter reaching its threshold, as in ``taskflow.engine.EventEngine``),
holds the lane for the task's seconds, then bumps its triggers. Both loops must give the same
makespan; the wall times are compared on one core, side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def run_simpy(graph: Any) -> float:
    """The makespan of ``graph`` (a ``SimGraph``) simulated by SimPy."""
    import simpy

    env = simpy.Environment()
    thresholds, extra = graph.join_counters()
    for jobs in graph.lanes.values():
        for task, _ in jobs:
            thresholds[task.key] = 1
    counts = dict.fromkeys(thresholds, 0)
    events = {k: env.event() for k in thresholds}

    def bump(key: Hashable) -> None:
        counts[key] += 1
        if counts[key] == thresholds[key]:
            events[key].succeed()

    def lane(jobs: list[Any]) -> Any:
        for task, wait in jobs:
            if wait is not None:
                yield events[wait]
            if task.seconds > 0:
                yield env.timeout(task.seconds)
            bump(task.key)
            for join in extra.get(task.key, ()):
                bump(join)

    for jobs in graph.lanes.values():
        env.process(lane(jobs))
    env.run()
    return float(env.now)


def compare(name: str, graph: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    ours = graph.run().makespan
    ours_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs = run_simpy(graph)
    simpy_s = time.perf_counter() - t0
    tasks = sum(len(v) for v in graph.lanes.values())
    row = {
        "graph": name,
        "tasks": tasks,
        "makespan_ms": ours * 1e3,
        "simpy_makespan_ms": theirs * 1e3,
        "same_makespan": abs(ours - theirs) <= 1e-9 * max(ours, 1e-12),
        "engine_wall_s": ours_s,
        "simpy_wall_s": simpy_s,
        "simpy_over_engine": simpy_s / ours_s,
        "engine_tasks_per_s": tasks / ours_s,
        "simpy_tasks_per_s": tasks / simpy_s,
    }
    print(
        f"{name:40s} {tasks:7d} tasks: engine {ours_s:8.3f} s, SimPy {simpy_s:8.3f} s "
        f"({simpy_s / ours_s:.2f}x), same makespan {row['same_makespan']}"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/sim_engine_simpy.json"))
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, as sim_scale
    import simpy

    import sim_scale
    from moesaic.bench.meta import run_metadata
    from moesaic.sim.collectives import LinkModel
    from moesaic.sim.hybrid import build_hybrid, hybrid_parts, plan_domains_fast
    from moesaic.sim.profile import Profile

    spec, model = sim_scale.cluster(1000, 10.0), sim_scale.model_for(1000)
    profile = Profile(flops_per_s=sim_scale.FLOPS, source="assumed rate")
    link = LinkModel(spec=spec)
    rows = []
    for name, domains, kw in (("ep", (1, 1), {}), ("hybrid +Migration", None, sim_scale.MIGRATION)):
        parts = (
            hybrid_parts(link, model, domains, sim_scale.FLOPS)
            if domains
            else plan_domains_fast(link, model, sim_scale.FLOPS, **kw)[0]
        )
        g = build_hybrid(parts, model, profile)
        rows.append(compare(f"{name}, representative rank", g))
        rows.append(
            compare(f"{name}, every rank ({spec.world_size})", g.replicate(spec.world_size))
        )
    out = {"meta": run_metadata(), "simpy": simpy.__version__, "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
