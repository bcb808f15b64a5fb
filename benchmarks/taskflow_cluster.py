"""The ``taskflow`` layer (static and dynamic executor) vs ``dropless`` on an emulated cluster,
forward + backward, with the perfect-overlap bound beside each figure (issue 12, item 6).

Usage (root: the emulated network needs network namespaces)::

    python benchmarks/taskflow_cluster.py [--ranks 2] [--gbps 0.1 0.2 0.4] [--steps 7]
        [--out benchmarks/results/taskflow_cluster.json] [--trace F.json] [--loopback]

One MoE layer (H, F, E, K below, fp32, one torch thread per rank) on ``--ranks`` ranks joined by
one shaped link level per bandwidth. Per bandwidth one world times, round-robin (a barrier
before each step; a step's time is the slowest rank's):

* ``dropless``: all-to-all-v dispatch, grouped experts, all-to-all-v combine (and the backward
  all-to-alls): communication and compute one after the other;
* ``taskflow static`` / ``taskflow dynamic``: the compiled tile plans with one-sided puts (the
  static executor with the pipelined order, and with the kernel-by-kernel order for contrast);
* ``compute only``: the same layer with every expert on this rank (a solo group), so no byte
  moves: the step's compute;
* ``comm only``: ``dropless``'s exact row exchange (dispatch, combine and their backward) with
  the experts replaced by the identity: the step's communication.

The perfect-overlap bound is ``max(compute only, comm only)``; ``comm share`` is
``comm only / dropless``. Speedups are medians of per-round ratios. Memory: the bytes of the
taskflow receive windows (allocated once per bucket) and of the symmetric layout L
(``symmetric_layout_bytes``) vs the buffers ``dropless`` allocates per step for its exchanges.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

H, F, E, K = 256, 512, 8, 2
TOKENS = 1024  # per rank
TILE = 128
WARMUP = 2
VARIANTS = (
    "dropless",
    "taskflow static",
    "taskflow static, kernel order",
    "taskflow dynamic",
    "compute only",
    "comm only",
)


def _layer(
    dispatcher: str,
    executor: str = "static",
    group: Any = None,
    tile: int = TILE,
    pipe: bool = True,
) -> Any:
    import torch

    from moesaic import MoEConfig, MoELayer

    options = {"executor": executor, "tile_m": tile, "pipeline": pipe}
    cfg = MoEConfig(
        hidden_size=H,
        ffn_hidden_size=F,
        num_experts=E,
        top_k=K,
        dispatcher=dispatcher,
        options=options if dispatcher == "taskflow" else None,
        collective_timeout_s=120.0,
        aux_loss_coef=0.0,
        z_loss_coef=0.0,
    )
    torch.manual_seed(0)
    return MoELayer(cfg, group=group)


def worker(rank: int, world: int, steps: int, trace: bool, tile: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from moesaic.bench.allocator import retain_freed_memory
    from moesaic.comm.collectives import EPGroup
    from moesaic.strategies.base import StrategyContext
    from moesaic.strategies.dropless import DroplessStrategy

    torch.set_num_threads(1)
    retain_freed_memory()  # no page faults per step for any variant (bench/allocator.py)
    if os.environ.get("MOESAIC_SWITCH_INTERVAL"):
        sys.setswitchinterval(float(os.environ["MOESAIC_SWITCH_INTERVAL"]))
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS, H, generator=gen)
    g = torch.randn(TOKENS, H, generator=gen)
    alone = dist.new_group([rank], use_local_synchronization=True)
    layers = {
        "dropless": _layer("dropless"),
        "taskflow static": _layer("taskflow", "static", tile=tile),
        "taskflow static, kernel order": _layer("taskflow", "static", tile=tile, pipe=False),
        "taskflow dynamic": _layer("taskflow", "dynamic", tile=tile),
        "compute only": _layer("dropless", group=alone),
    }
    comm_layer = layers["dropless"]
    identity = DroplessStrategy(StrategyContext(comm_layer.config, EPGroup(None, 120.0),
                                                comm_layer.placement))  # fmt: skip

    cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}

    def step(name: str) -> float:
        dist.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        xi = x.clone().requires_grad_()
        if name == "comm only":  # the same exchanges, experts replaced by the identity
            routed = comm_layer.route(xi)
            y = identity.forward(xi, routed.plan, lambda rows, counts: rows * 1.0).y_TH
        else:
            y = layers[name](xi)
        y.backward(g)
        wall = time.perf_counter() - t0
        cpu[name].append(time.process_time() - c0)  # every thread of this process
        return wall

    for name in VARIANTS:
        for _ in range(WARMUP):
            step(name)
    rounds = []
    rec = layers["taskflow static"].strategy.recorder
    for i in range(steps):
        if trace and i == steps - 1:
            rec.clear()
            rec.enabled = True
        rounds.append([step(name) for name in VARIANTS])
        rec.enabled = False
    times = torch.tensor(rounds)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    tf = layers["taskflow static"].strategy.runtime
    fwd, _ = next(iter(tf._plans.values()))
    stats = layers["dropless"].take_stats()
    return {
        "rounds": times.tolist(),
        "cpu_s_median": {n: statistics.median(v[-steps:]) for n, v in cpu.items()},
        "spans": rec.events,
        "window_bytes": tf.window_bytes(),
        "bucket": fwd.bucket.to_dict(),
        "buckets_compiled": len(tf._plans),
        "dropless_rows_sent_per_step": (stats.comm.dispatch_bytes / (H * 4))
        / max(1, stats.forwards),
        "layer_tokens_per_step": stats.tokens / max(1, stats.forwards),
    }


def _memory(per_rank: list[dict[str, Any]], world: int) -> dict[str, Any]:
    from moesaic.taskflow import symmetric_layout_bytes
    from moesaic.taskflow.bucket import bucket_from_dict

    b = bucket_from_dict(per_rank[0]["bucket"])
    # dropless per step: dispatch receive [M, H], combine receive [N, H] and the same two for the
    # gradients in backward; M ~ N ~ T*K rows (balanced), fp32
    rows = TOKENS * K
    dropless = 4 * rows * H * 4
    layout = symmetric_layout_bytes(TOKENS, E, H, 4, tile_m=b.gmm_rows, capacity=b.slot_rows)
    return {
        "taskflow_window_bytes_per_rank": per_rank[0]["window_bytes"],
        "symmetric_layout_L_bytes_per_rank": layout,
        "dropless_exchange_buffer_bytes_per_step": dropless,
        "slot_rows": b.slot_rows,
        "note": "windows: forward (x_recv + y_ret) and backward (g_recv + dx_ret) of the one "
        "bucket, allocated once; dropless: allocated per step, sized by the exact rows",
    }


def summarize(gbps: float, world: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    rounds = per_rank[0]["rounds"]
    col = {n: [r[i] for r in rounds] for i, n in enumerate(VARIANTS)}
    med = {n: statistics.median(v) for n, v in col.items()}
    bound = max(med["compute only"], med["comm only"])
    ratios = {
        n: statistics.median(d / t for d, t in zip(col["dropless"], col[n]))
        for n in ("taskflow static", "taskflow static, kernel order", "taskflow dynamic")
    }
    return {
        "gbps": gbps,
        "ranks": world,
        "median_s": med,
        "comm_share_of_dropless": med["comm only"] / med["dropless"],
        "overlap_bound_s": bound,
        "speedup_vs_dropless": ratios,
        "bound_speedup_vs_dropless": med["dropless"] / bound,
        "rounds_s": col,
        "memory": _memory(per_rank, world),
        "bucket": per_rank[0]["bucket"],
        # process CPU seconds per step (all threads: workers, subscriber, gloo), per rank
        "cpu_s_per_rank": [r["cpu_s_median"] for r in per_rank],
        "buckets_compiled": per_rank[0]["buckets_compiled"],
    }


def _table(rows: list[dict[str, Any]]) -> str:
    out = [
        "Gbit/s | dropless ms | static ms (x) | static kernel-order ms (x) | dynamic ms (x) | "
        "compute | comm (share) | bound ms (x) | CPU ms/step rank 0: dropless, static, dynamic, "
        "compute"
    ]
    for r in rows:
        m, s = r["median_s"], r["speedup_vs_dropless"]
        out.append(
            f"{r['gbps']:g} | {m['dropless'] * 1e3:.1f} | {m['taskflow static'] * 1e3:.1f} "
            f"({s['taskflow static']:.2f}) | {m['taskflow static, kernel order'] * 1e3:.1f} "
            f"({s['taskflow static, kernel order']:.2f}) | {m['taskflow dynamic'] * 1e3:.1f} "
            f"({s['taskflow dynamic']:.2f}) | {m['compute only'] * 1e3:.1f} | "
            f"{m['comm only'] * 1e3:.1f} ({r['comm_share_of_dropless']:.0%}) | "
            f"{r['overlap_bound_s'] * 1e3:.1f} ({r['bound_speedup_vs_dropless']:.2f}) | "
            + ", ".join(
                f"{r['cpu_s_per_rank'][0][n] * 1e3:.0f}"
                for n in ("dropless", "taskflow static", "taskflow dynamic", "compute only")
            )
        )
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--gbps", type=float, nargs="+", default=[0.1, 0.2, 0.4])
    parser.add_argument("--latency-ms", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=7, help="measured rounds per bandwidth")
    parser.add_argument("--out", default=None)
    parser.add_argument("--trace", default=None, help="Chrome trace of the last static step")
    parser.add_argument("--loopback", action="store_true", help="no emulated network")
    parser.add_argument("--tile", type=int, default=TILE, help="taskflow's tile_m option")
    args = parser.parse_args()

    import taskflow_cluster as mod  # workers unpickle the functions by this module name
    from moesaic.bench.meta import run_metadata
    from moesaic.cluster.spec import ClusterSpec
    from moesaic.trace import write_chrome_trace

    load_before = os.getloadavg()
    start = time.perf_counter()
    rows, last = [], None
    for gbps in args.gbps:
        spec = ClusterSpec.from_dict({
            "name": f"taskflow_{args.ranks}rank", "world_size": args.ranks,
            "levels": [{"name": "rank", "size": args.ranks, "bandwidth_gbps": gbps,
                        "latency_ms": args.latency_ms}],
        })  # fmt: skip
        call = (mod.worker, args.ranks, args.steps, bool(args.trace), args.tile)
        if args.loopback:
            from moesaic.comm.world import run_world

            per_rank = run_world(*call, timeout_s=1800.0)
        else:
            from moesaic.cluster import EmulatedCluster

            with EmulatedCluster(spec) as cluster:
                per_rank = cluster.run(*call, timeout_s=1800.0)
        rows.append(summarize(gbps, args.ranks, per_rank))
        last = per_rank
        print(_table(rows[-1:]), flush=True)
    if args.trace and last is not None:
        write_chrome_trace(args.trace, [r["spans"] for r in last])
    result = {
        "meta": run_metadata(),
        "wall_s": time.perf_counter() - start,
        "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "config": {
            "hidden_size": H,
            "ffn_hidden_size": F,
            "num_experts": E,
            "top_k": K,
            "tokens_per_rank": TOKENS,
            "tile_m": args.tile,
            "dtype": "float32",
            "torch_threads": 1,
            "warmup": WARMUP,
            "rounds": args.steps,
            "latency_ms": args.latency_ms,
            "loopback": args.loopback,
        },
        "points": rows,
    }
    print(_table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
