"""How long one gradient all-reduce call takes while the ranks compute, on an emulated cluster:
what FlowMoE's chunks pay in the backward (issue 24, the flowmoe ranking misses).

``moesaic calibrate`` measures the all-reduce's call floor as a stream of tiny calls on the idle
machine (``calibrate.collective_calls``), and the simulator prices every gradient chunk with it.
A traced flowmoe run on a 4-rank cluster sharing 2 cores (z++--+, benchmarks/sim_validation.md, the sixth
rule) showed chunks of 110 kB in flight 22-46 ms each beside the backward, against 4.8 ms
priced. This measures, per size and cluster, with every rank's slowest time per repetition:

* ``idle``: one all-reduce issued and waited, after a barrier, ``REPS`` times;
* ``loaded``: the same while a thread of every rank runs fp32 matmuls (``calibrate``'s load);
* ``loaded_stream``: ``STREAM`` calls issued at once and waited, under that load, per call;
* ``idle_stream``: the same without the load (what ``allreduce_call_s`` measures).

``python benchmarks/allreduce_under_load.py CLUSTER.toml [...] --out FILE.json`` (root: it
starts the emulated network). The machine should be otherwise idle.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPS = 8
STREAM = 16
SIZES = (1024, 110_760, 1_048_576)


def worker(rank: int, world: int, sizes: list[int], reps: int, stream: int, timeout_s: float):
    """Per size: ``{kind: [seconds per call, ...]}`` on this rank (see the module docstring)."""
    import torch

    from moesaic.comm.collectives import EPGroup
    from moesaic.measure.calibrate import matmul_load

    group = EPGroup(None, timeout_s)

    def isolated(g: torch.Tensor) -> list[float]:
        out = []
        for i in range(1 + reps):
            group.barrier("all-reduce under load barrier")
            t0 = time.perf_counter()
            group.start_all_reduce(g, what="all-reduce under load").wait()
            if i:
                out.append(time.perf_counter() - t0)
        return out

    def streamed(nbytes: int) -> list[float]:
        grads = [torch.zeros(nbytes // 4) for _ in range(stream)]
        group.barrier("all-reduce under load barrier")
        t0 = time.perf_counter()
        pending = [group.start_all_reduce(x, what="all-reduce under load") for x in grads]
        for p in pending:
            p.wait()
        return [(time.perf_counter() - t0) / stream]

    results: dict[str, dict[str, list[float]]] = {}
    for nbytes in sizes:
        g = torch.zeros(nbytes // 4)
        results[str(nbytes)] = {"idle": isolated(g), "idle_stream": streamed(nbytes)}
    with matmul_load():
        for nbytes in sizes:
            g = torch.zeros(nbytes // 4)
            results[str(nbytes)]["loaded"] = isolated(g)
            results[str(nbytes)]["loaded_stream"] = streamed(nbytes)
    group.barrier("all-reduce under load barrier")
    return results


def measure(cluster_file: str, timeout_s: float = 300.0) -> dict:
    """Start the cluster of ``cluster_file``, run :func:`worker` on every rank, summarise."""
    import allreduce_under_load as me  # by module name: the workers unpickle the function
    from moesaic.cluster.netns import EmulatedCluster
    from moesaic.cluster.spec import ClusterSpec

    spec = ClusterSpec.from_toml(cluster_file)
    with EmulatedCluster(spec) as cluster:
        per_rank = cluster.run(
            me.worker, spec.world_size, list(SIZES), REPS, STREAM, timeout_s, timeout_s=timeout_s
        )
    out: dict = {"cluster": cluster_file, "name": spec.name, "world": spec.world_size}
    for size, kinds in per_rank[0].items():
        row = {}
        for kind, values in kinds.items():
            slowest = [max(r[size][kind][i] for r in per_rank) * 1e3 for i in range(len(values))]
            row[kind] = {
                "ms": [round(v, 2) for v in slowest],
                "median_ms": statistics.median(slowest),
            }
        out[size] = row
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("clusters", nargs="+", help="cluster TOML files")
    p.add_argument("--out", default="benchmarks/results/allreduce_under_load.json")
    args = p.parse_args()
    # the cluster's workers import this module by name
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    sys.path.insert(0, str(HERE))
    runs = {"load_before": os.getloadavg(), "runs": []}
    for f in args.clusters:
        res = measure(f)
        runs["runs"].append(res)
        for size in map(str, SIZES):
            medians = {k: round(v["median_ms"], 2) for k, v in res[size].items()}
            print(res["name"], size, "bytes: median ms per call", json.dumps(medians), flush=True)
    runs["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
