"""FlowMoE ablation on an emulated cluster (the paper's Table 5, with Table 6's memory).

Usage (root: the emulated network needs network namespaces)::

    python benchmarks/flowmoe_cluster.py [--cluster examples/clusters/flowmoe_2rank.toml]
        [--steps 15] [--out benchmarks/results/flowmoe_cluster.json] [--loopback]

One world runs every schedule side by side: each has its own copy of the model (same seed),
and the measured steps go round-robin (one step of each configuration per round, a barrier
between steps), so that the shared machine's noise hits all of them alike. Per configuration:
the step time (the slowest rank's, per round; median and p10/p90), the perfect-overlap bound
max(busy compute, busy communication) from the same step's recorded spans
(``moesaic.trace.overlap_bound``), and the speedup over ``vanilla`` and ``moe-only`` as the
median of per-round ratios. ``vanilla`` itself records only whole forward/backward spans (its
all-to-alls run inside them), so its communication share and bound are read from
``moe-only`` at R = 1 (the same work with no overlap: AT, D, E, C one after another, all-reduce
after the backward), which is also timed. Memory: peak RSS per rank (``ru_maxrss``) in a fresh
world per configuration (``ru_maxrss`` only grows, so configurations sharing a process would
hide each other), as the peak and as the growth over the RSS before the first step.

Configurations (Table 5 rows): ``vanilla`` (EP, no pipelining), ``moe-only`` R = 2, 4
(Pipe-MoE), ``flowmoe`` R = 2, 4 with Sp = all gradients (one chunk: attention pipelined, the
all-reduce still after the backward: +Pipe-AT), with a fixed Sp = G/16 (+Pipe-AR), and with Sp
tuned online by ``SpTuner`` (+BO; G = the replicated gradients' bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_CLUSTER = "examples/clusters/flowmoe_2rank.toml"
MODEL = {
    "d_model": 128,
    "n_layers": 4,
    "n_heads": 4,
    "seq_len": 64,
    # the architecture the committed results were measured with (MoEGPT's defaults before
    # RMSNorm and rotary positions), so that old and new figures compare
    "norm": "layernorm",
    "positions": "learned",
    "moe": {
        "num_experts": 4,
        "top_k": 2,
        "ffn_hidden_size": 2048,
        "dispatcher": "dropless",
        "aux_loss_coef": 0.01,
    },
}
BATCH = 8  # sequences per rank (R = 2, 4 divide it)
WARMUP = 2  # steps per configuration before measuring (the first learns the pool's counts)
TUNE_SAMPLES, TUNE_ITERS = 6, 4  # the tuner's budget in the +BO rows (24 steps)
FIXED_SP_DIVISOR = 16  # +Pipe-AR: Sp = G / 16
# (label, schedule, R, Sp): Sp "all" = every gradient in one chunk, "fixed" = G / 16,
# "tuned" = SpTuner, None = not a pool schedule
CONFIGS: list[tuple[str, str, int, str | None]] = [
    ("vanilla", "vanilla", 1, None),
    ("moe-only R=1 (vanilla, traced)", "moe-only", 1, "all"),
    ("moe-only R=2", "moe-only", 2, "all"),
    ("moe-only R=4", "moe-only", 4, "all"),
    ("flowmoe R=2 Sp=G", "flowmoe", 2, "all"),
    ("flowmoe R=4 Sp=G", "flowmoe", 4, "all"),
    ("flowmoe R=2 Sp=G/16", "flowmoe", 2, "fixed"),
    ("flowmoe R=4 Sp=G/16", "flowmoe", 4, "fixed"),
    ("flowmoe R=2 Sp tuned", "flowmoe", 2, "tuned"),
    ("flowmoe R=4 Sp tuned", "flowmoe", 4, "tuned"),
]


def _model_config() -> Any:
    from moesaic.models import MoEGPTConfig

    return MoEGPTConfig.from_dict(MODEL)


def _lm_loss(logits_BTV: Any, y_BT: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), y_BT.flatten())


def _replicated_bytes(model: Any) -> int:
    from moesaic.layer import is_expert_param

    return sum(p.numel() * p.element_size() for p in model.parameters() if not is_expert_param(p))


def _build(layout: Any, rank: int, config: tuple[str, str, int, str | None]) -> Any:
    """The step of one configuration on a fresh model (seed 0 on every configuration)."""
    import torch

    from moesaic.models import MoEGPT
    from moesaic.schedule.base import StepParts
    from moesaic.schedule.flowmoe import FlowMoEStep, MoeOnlyStep
    from moesaic.schedule.vanilla import VanillaStep
    from moesaic.trace import Recorder
    from moesaic.train.parallel import GradientSync

    _, schedule, R, sp = config
    torch.manual_seed(0)
    model = MoEGPT(_model_config(), ep_group=layout.ep_group)
    G = _replicated_bytes(model)
    chunk = {"all": max(4096, G), "fixed": max(4096, G // FIXED_SP_DIVISOR), "tuned": None}
    parts = StepParts(
        model=model,
        loss_fn=_lm_loss,
        grad_sync=GradientSync(layout),
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        pipeline_degree=R,
        ar_chunk_bytes=chunk.get(sp or "all"),
        recorder=Recorder(rank),
    )
    cls = {"vanilla": VanillaStep, "moe-only": MoeOnlyStep, "flowmoe": FlowMoEStep}[schedule]
    return cls(parts)


def _batches(rank: int, n: int) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(100 + rank)
    T = MODEL["seq_len"]
    return [torch.randint(0, 256, (BATCH, T + 1), generator=gen) for _ in range(n)]


def _timed_step(step: Any, x_BT: Any) -> dict[str, float]:
    """One step; its time and, from its recorded spans, busy compute/communication and the
    perfect-overlap bound (this rank)."""
    from moesaic.trace import COMM_RESOURCES, COMPUTE_RESOURCES, busy_time, overlap_bound

    rec = step.parts.recorder
    rec.clear()
    t0 = time.perf_counter()
    result = step.run(x_BT[:, :-1], x_BT[:, 1:])
    seconds = time.perf_counter() - t0
    if not result.applied:
        raise RuntimeError(f"step was not applied: {result.nonfinite}")
    spans = rec.events
    return {
        "time_s": seconds,
        "bound_s": overlap_bound(spans),
        "compute_s": busy_time(spans, COMPUTE_RESOURCES),
        "comm_s": busy_time(spans, COMM_RESOURCES),
        "a2a_s": busy_time(spans, "a2a"),
        "allreduce_s": busy_time(spans, "allreduce"),
        "gather_s": busy_time(spans, "gather"),  # hybrid's expert gathers (compose_cluster.py)
        "sp_bytes": float(result.metrics.get("ar_chunk_bytes", 0.0)),
    }


def timing_worker(rank: int, world: int, steps: int, timeout_s: float) -> dict[str, Any]:
    """Every configuration side by side in this world: warm-up, tuning, round-robin steps."""
    import torch
    import torch.distributed as dist

    from moesaic.schedule.tuner import SpTuner
    from moesaic.train.parallel import build_layout

    torch.set_num_threads(1)
    layout = build_layout(ep_size=world, timeout_s=timeout_s)
    batches = _batches(rank, 4)
    built = [_build(layout, rank, c) for c in CONFIGS]
    for step in built:
        for i in range(WARMUP):
            step.run(batches[i][:, :-1], batches[i][:, 1:])
    tuning: dict[str, Any] = {}
    for config, step in zip(CONFIGS, built):
        if config[3] != "tuned":
            continue
        G = _replicated_bytes(step.parts.model)
        high = max(8192, G)
        step.tuner = SpTuner(
            low=max(4096, high // 64), high=high, samples=TUNE_SAMPLES,
            iters_per_sample=TUNE_ITERS, drift=0.5, seed=0,
        )  # fmt: skip
        t0 = time.perf_counter()
        for i in range(TUNE_SAMPLES * TUNE_ITERS):
            x = batches[i % len(batches)]
            step.run(x[:, :-1], x[:, 1:])
        tuning[config[0]] = {
            "wall_s": time.perf_counter() - t0,
            "low": step.tuner.low,
            "high": step.tuner.high,
            "history": step.tuner.history if rank == 0 else [],
            "chosen_sp_bytes": step.tuner.current() if rank == 0 else None,
        }
    rounds: list[list[dict[str, float]]] = []
    for i in range(steps):
        x = batches[i % len(batches)]
        row = []
        for step in built:
            dist.barrier()
            row.append(_timed_step(step, x))
        rounds.append(row)
    searches = {
        c[0]: s.tuner.searches
        for c, s in zip(CONFIGS, built)
        if getattr(s, "tuner", None) is not None
    }
    for step in built:
        if hasattr(step, "close"):
            step.close()
    return {"rounds": rounds, "tuning": tuning, "searches": searches}


def memory_worker(rank: int, world: int, index: int, timeout_s: float) -> dict[str, float]:
    """Peak RSS of one configuration in a fresh process (``ru_maxrss``, KiB on Linux)."""
    import torch

    from moesaic.train.parallel import build_layout

    torch.set_num_threads(1)
    layout = build_layout(ep_size=world, timeout_s=timeout_s)
    step = _build(layout, rank, CONFIGS[index])
    batches = _batches(rank, 4)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for x in batches:
        step.run(x[:, :-1], x[:, 1:])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if hasattr(step, "close"):
        step.close()
    return {"peak_rss_mib": peak / 1024, "growth_mib": (peak - before) / 1024}


def _stats(values: list[float]) -> dict[str, float]:
    q = sorted(values)
    return {
        "median": statistics.median(q),
        "p10": q[int(0.1 * (len(q) - 1))],
        "p90": q[round(0.9 * (len(q) - 1))],
        "n": len(q),
    }


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration: the slowest rank per round, then medians and spreads over rounds."""
    n_rounds = len(per_rank[0]["rounds"])
    out: dict[str, Any] = {}
    labels = [c[0] for c in CONFIGS]
    worst = [  # [round][config] -> the figures of the slowest rank (a step ends with it)
        [max((r["rounds"][i][k] for r in per_rank), key=lambda d: d["time_s"]) for k in range(len(CONFIGS))]
        for i in range(n_rounds)
    ]  # fmt: skip
    bounds = [[max(r["rounds"][i][k]["bound_s"] for r in per_rank) for k in range(len(CONFIGS))]
              for i in range(n_rounds)]  # fmt: skip
    base = {name: labels.index(name) for name in ("vanilla", "moe-only R=2", "moe-only R=4")}
    for k, label in enumerate(labels):
        times = [worst[i][k]["time_s"] for i in range(n_rounds)]
        b = [bounds[i][k] for i in range(n_rounds)]
        entry = {
            "schedule": CONFIGS[k][1],
            "pipeline_degree": CONFIGS[k][2],
            "sp": CONFIGS[k][3],
            "step_time_s": _stats(times),
            "overlap_bound_s": _stats(b),
            "time_over_bound": _stats([t / x for t, x in zip(times, b) if x > 0]),
            "busy_compute_s": _stats([worst[i][k]["compute_s"] for i in range(n_rounds)]),
            "busy_comm_s": _stats([worst[i][k]["comm_s"] for i in range(n_rounds)]),
            "busy_a2a_s": _stats([worst[i][k]["a2a_s"] for i in range(n_rounds)]),
            "busy_allreduce_s": _stats([worst[i][k]["allreduce_s"] for i in range(n_rounds)]),
            "comm_share_of_step": _stats(
                [worst[i][k]["comm_s"] / worst[i][k]["time_s"] for i in range(n_rounds)]
            ),
            "sp_bytes": worst[-1][k]["sp_bytes"],
        }
        for name, j in base.items():
            ratios = [worst[i][j]["time_s"] / worst[i][k]["time_s"] for i in range(n_rounds)]
            entry[f"speedup_over_{name.replace(' ', '_')}"] = _stats(ratios)
        out[label] = entry
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default=DEFAULT_CLUSTER)
    parser.add_argument("--steps", type=int, default=15, help="measured rounds")
    parser.add_argument("--out", default="benchmarks/results/flowmoe_cluster.json")
    parser.add_argument("--loopback", action="store_true", help="no emulated network (sizing)")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args()

    import flowmoe_cluster as mod  # workers unpickle the functions by this module name
    from moesaic.bench.meta import run_metadata
    from moesaic.cluster.spec import ClusterSpec

    spec = ClusterSpec.from_toml(args.cluster)
    world = spec.world_size
    load_before = os.getloadavg()
    start = time.perf_counter()
    memory: dict[str, Any] = {}
    if args.loopback:
        from moesaic.comm.world import run_world

        def launch(fn: Any, *a: Any) -> list[Any]:
            return run_world(fn, world, *a, timeout_s=900.0, pg_timeout_s=args.timeout_s)

        per_rank = launch(mod.timing_worker, args.steps, args.timeout_s)
    else:
        from moesaic.cluster import EmulatedCluster

        with EmulatedCluster(spec) as cluster:
            per_rank = cluster.run(
                mod.timing_worker, world, args.steps, args.timeout_s, timeout_s=900.0
            )
            if not args.no_memory:
                for k, config in enumerate(CONFIGS):
                    ranks = cluster.run(mod.memory_worker, world, k, args.timeout_s, timeout_s=300)
                    memory[config[0]] = ranks
    wall = time.perf_counter() - start
    summary = summarize(per_rank)
    for label, ranks in memory.items():
        summary[label]["memory_per_rank"] = ranks
    result = {
        "meta": run_metadata(),
        "wall_s": wall,
        "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "cluster": None if args.loopback else json.loads(json.dumps(spec.to_dict())),
        "config": {
            "model": MODEL,
            "batch_per_rank": BATCH,
            "world_size": world,
            "ep": world,
            "dp": 1,
            "optimizer": "AdamW lr 1e-3",
            "warmup_steps": WARMUP,
            "measured_rounds": args.steps,
            "tuner": {"samples": TUNE_SAMPLES, "iters_per_sample": TUNE_ITERS, "drift": 0.5},
            "fixed_sp": f"G/{FIXED_SP_DIVISOR}",
            "configs": CONFIGS,
        },
        "tuning": per_rank[0]["tuning"],
        "tuner_searches": per_rank[0]["searches"],
        "results": summary,
        "notes": [
            "step time: the slowest rank's wall time of step.run per round; speedups: median "
            "(p10, p90) of per-round ratios (same round, same batch)",
            "overlap bound: max(busy compute, busy a2a+allreduce) from the step's recorded spans "
            "(moesaic.trace.overlap_bound), the larger rank's",
            "vanilla's communication share and bound: from 'moe-only R=1 (vanilla, traced)'",
            "memory: ru_maxrss per rank (whole process, torch included) in a fresh world per "
            "configuration, 4 steps; growth = peak - ru_maxrss before the first step",
        ],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(_table(summary))
    print(f"wall {wall:.0f} s -> {out}")
    return 0


def _table(summary: dict[str, Any]) -> str:
    lines = [f"{'config':32} {'step ms':>9} {'bound ms':>9} {'t/bound':>7} {'comm %':>6} "
             f"{'x vanilla':>9} {'x moe-only':>10} {'RSS MiB':>8}"]  # fmt: skip
    for label, e in summary.items():
        mem = e.get("memory_per_rank")
        R = e["pipeline_degree"]
        vs_moe = e.get(f"speedup_over_moe-only_R={max(R, 2)}", {}).get("median", float("nan"))
        lines.append(
            f"{label:32} {1e3 * e['step_time_s']['median']:9.1f} "
            f"{1e3 * e['overlap_bound_s']['median']:9.1f} {e['time_over_bound']['median']:7.2f} "
            f"{100 * e['comm_share_of_step']['median']:6.1f} "
            f"{e['speedup_over_vanilla']['median']:9.2f} {vs_moe:10.2f} "
            f"{max(m['peak_rss_mib'] for m in mem) if mem else float('nan'):8.0f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
