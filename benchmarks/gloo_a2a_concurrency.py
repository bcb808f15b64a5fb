"""Do all-to-alls issued together on gloo overlap? Two all-to-alls of ``b`` bytes per pair
issued at once (async, then both waited: how the pipelined schedules issue a block's R
dispatches) against the same two one after the other and one of ``2 b``, on an emulated
cluster whose latency dominates (the thirtieth unseen rule's slow links).

The simulator serialises every all-to-all of a rank on one network lane, each paying the
all-to-all's latency term (at least the calibrated ``a2a_call_s``). If ProcessGroupGloo's
worker threads (2 by default) run two issued collectives at once, the second's latency hides
under the first and R = 2 pays less than twice the calls' latency.

Usage (root: the emulated network needs network namespaces)::

    python benchmarks/gloo_a2a_concurrency.py [--out benchmarks/results/gloo_a2a_concurrency.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from moesaic.cluster.spec import ClusterSpec, Level

sys.path.insert(0, str(Path(__file__).resolve().parent))

# (name, levels): the thirtieth rule's two slow clusters
CLUSTERS = (
    ("3 nodes, 0.4 Gbit/s, 1.5 ms", (("node", 3, 0.4, 1.5),)),
    ("3 DCs x 2, 0.3 Gbit/s 3 ms / 5 Gbit/s", (("dc", 3, 0.3, 3.0), ("rank", 2, 5.0, 0.05))),
)
SIZES = (4 * 1024, 64 * 1024)  # bytes per pair: latency-bound, and a few ms of bandwidth
REPS = 12


def worker(rank: int, world: int, sizes: list[int], reps: int, timeout_s: float) -> dict:
    import torch

    from moesaic.comm.collectives import EPGroup

    group = EPGroup(None, timeout_s)
    out: dict[str, dict[str, list[float]]] = {}
    for b in sizes:
        one = [torch.zeros(world * b // 4) for _ in range(2)]
        double = torch.zeros(world * 2 * b // 4)
        recv = [torch.empty_like(t) for t in one]
        recv2 = torch.empty_like(double)
        times: dict[str, list[float]] = {"together": [], "sequential": [], "one_double": []}
        for i in range(1 + reps):
            for mode in times:
                group.barrier("concurrency barrier")
                t0 = time.perf_counter()
                if mode == "together":
                    pending = [group.start_all_to_all(r, s) for r, s in zip(recv, one)]
                    for p in pending:
                        p.wait()
                elif mode == "sequential":
                    for r, s in zip(recv, one):
                        group.all_to_all_single(r, s)
                else:
                    group.all_to_all_single(recv2, double)
                if i:
                    times[mode].append(time.perf_counter() - t0)
        out[str(b)] = times
    group.barrier("concurrency barrier")
    return out


def measure(levels: tuple, timeout_s: float = 300.0) -> dict[str, Any]:
    import gloo_a2a_concurrency as me  # by module name: the workers unpickle the function
    from moesaic.cluster.netns import EmulatedCluster

    spec = ClusterSpec(
        name="probe",
        levels=tuple(
            Level(name=n, size=s, bandwidth_gbps=bw, latency_ms=lat) for n, s, bw, lat in levels
        ),
    )
    with EmulatedCluster(spec) as cluster:
        per_rank = cluster.run(
            me.worker, spec.world_size, list(SIZES), REPS, timeout_s, timeout_s=timeout_s
        )
    result: dict[str, Any] = {}
    for b in map(str, SIZES):
        modes = per_rank[0][b]
        # per repetition the slowest rank, then the median over repetitions
        med = {
            m: statistics.median(max(r[b][m][i] for r in per_rank) for i in range(REPS))
            for m in modes
        }
        result[b] = {
            **{f"{m}_ms": round(v * 1e3, 2) for m, v in med.items()},
            "together_over_sequential": round(med["together"] / med["sequential"], 3),
        }
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    out: dict[str, Any] = {
        "what": __doc__.split("\n\n")[0],
        "machine": platform.node(),
        "torch": torch.__version__,
        "commit": commit.stdout.strip(),
        "reps": REPS,
        "clusters": {},
    }
    for name, levels in CLUSTERS:
        out["clusters"][name] = measure(levels)
        print(name, json.dumps(out["clusters"][name]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
