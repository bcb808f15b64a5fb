"""A harness process for the teardown tests: builds a cluster, reports it, then waits to die.

Usage: ``python _harness_child.py MODE OUT_DIR`` with MODE ``idle`` (just hold the cluster) or
``workers`` (run a job whose workers sleep). Prints one JSON line (run id, delay line pid) once
the cluster is up; in ``workers`` mode each worker also writes its pid to ``OUT_DIR``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moesaic.cluster import ClusterSpec, EmulatedCluster, Level


def sleepy_worker(rank: int, world: int, out_dir: str) -> int:
    """Runs in each worker: leaves its pid behind, then sleeps (bounded) until killed."""
    Path(out_dir, f"worker-{rank}.pid").write_text(str(os.getpid()))
    time.sleep(60)
    return 0


def main() -> None:
    mode, out_dir = sys.argv[1], sys.argv[2]
    spec = ClusterSpec(
        levels=(Level(name="node", size=2, bandwidth_gbps=0.1, latency_ms=1.0),), name="child"
    )
    with EmulatedCluster(spec) as cluster:
        info = {"run_id": cluster.run_id, "delayline_pid": cluster.delayline_pid}
        print(json.dumps(info), flush=True)
        if mode == "workers":
            from _harness_child import sleepy_worker as fn  # importable by reference

            cluster.run(fn, cluster.world_size, out_dir, timeout_s=60)
        else:
            time.sleep(60)


if __name__ == "__main__":
    main()
